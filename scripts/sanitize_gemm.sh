#!/usr/bin/env bash
# compute-sanitizer over the W4A8 CUDA ops (memcheck, racecheck, synccheck, initcheck).
# Usage (GPU host, repo root, extension built): scripts/sanitize_gemm.sh
# Logs go to $OUT (or ./out)/sanitize_gemm; exits non-zero if a tool or the driver fails.
# No kernel filter: torch's own kernels are checked too; summary.txt counts the reports that
# name our kernels (w4a8_*_kernel, quantize_act_int8_kernel) separately.
set -u
PY="${PYTHON:-python3}"
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-$PWD/out}/sanitize_gemm"
mkdir -p "$OUT_DIR"
CS="$(command -v compute-sanitizer || true)"
for cand in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
            /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$CS" ] && [ -x "$cand" ] && CS="$cand"
done
if [ -z "$CS" ]; then
  echo "compute-sanitizer not found (PATH, /usr/local/cuda*/bin)" | tee "$OUT_DIR/summary.txt"
  exit 2
fi
"$CS" --version > "$OUT_DIR/version.txt" 2>&1
status=0
: > "$OUT_DIR/summary.txt"
for tool in memcheck racecheck synccheck initcheck; do
  extra=""
  [ "$tool" = "memcheck" ] && extra="--leak-check no"
  [ "$tool" = "racecheck" ] && extra="--racecheck-report all"
  log="$OUT_DIR/$tool.log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  "$CS" --tool "$tool" $extra --error-exitcode 99 "$PY" scripts/sanitize_gemm_driver.py > "$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
  ours=$(grep -cE "w4a8_(decode|tiled)_kernel|quantize_act_int8_kernel" "$log")
  driver=$(grep -E "^failures:" "$log" | tail -1)
  line="$tool: rc=$rc | ${summary:-no summary} | lines naming our kernels: $ours | driver ${driver:-did not finish} ($(( $(date +%s) - start ))s)"
  echo "$line" | tee -a "$OUT_DIR/summary.txt"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
