#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over our kernels.
# Usage (GPU host, repo root, extension built): scripts/sanitize.sh [cuda] [triton]
#   SANITIZE_TOOLS="racecheck" runs a subset of the four tools; SANITIZE_TRITON_K replaces the
#   triton target's pytest -k selection; SANITIZE_CUDA_ARGS=quantize limits the cuda target to
#   quantize_act, SANITIZE_CUDA_ARGS=ops to the decode ops (norm op, SiLU op, both after the GEMM).
#   cuda:   scripts/sanitize_cuda_driver.py, every csrc kernel (mma.sync, wgmma, quantize_act, the
#           norm and SiLU ops)
#   triton: a pytest -m gpu selection that launches every Triton kernel (W4A8/W4Ax GEMM and
#           activation quantizers, KV quantize-and-store, paged decode/prefill attention, the
#           exact-prefill context workspace)
# Logs go to $OUT (or ./out)/sanitize; exits non-zero if a tool or a driver fails.
# torch's own kernels are checked too; summary.txt counts the reports that name our kernels
# separately. vLLM's FlashAttention-3 (which exact prefill calls) is excluded from the triton
# target: its warp-specialized named barriers and TMA/mbarrier handoffs are invisible to racecheck
# and synccheck (1,716 RAW "hazards" and a divergent-barrier abort in FlashAttnFwdSm90 alone, H200,
# 2026-11-27), so it would drown our kernels' reports. SANITIZE_EXCLUDE="" checks it too.
set -u
PY="${PYTHON:-python3}"
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-$PWD/out}/sanitize"
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
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(cuda triton)
TRITON_TESTS=(
  "tests/kernels/test_triton_gemm.py::test_gpu_w4ax"
  "tests/attention_backend/test_attn_kernels.py::test_paged_attention_gpu"
  "tests/attention_backend/test_attn_kernels.py::test_gather_path_gpu"
  "tests/attention_backend/test_attn_kernels.py::test_paged_attention_gpu_decode_configs"
  "tests/attention_backend/test_attn_kernels.py::test_decode_fused_merge_counts_and_resets"
)
# decode_configs: five decode rows, the residual tail attended in the last split
# (decode_tail_mode); fused_merge: the last page program merges (decode_merge_mode)
TRITON_K="${SANITIZE_TRITON_K:-test_gpu_w4ax or (1-4-128 and dtype1) or (gather_path_gpu and 4-128 and dtype1) or (decode_configs and kv4 and 64 and tail-in-split) or fused_merge}"
status=0
: > "$OUT_DIR/summary.txt"
for target in "${targets[@]}"; do
  case $target in
    cuda) cmd=("$PY" scripts/sanitize_cuda_driver.py ${SANITIZE_CUDA_ARGS:-}); exclude=()
          ours_re="w4a8_(decode|tiled|wgmma)[a-z_]*kernel|quantize_act_int8_[a-z_]*kernel|(add_rms_norm|silu_mul)_quantize_act_kernel" ;;
    triton) cmd=("$PY" -m pytest -q -p no:cacheprovider -x "${TRITON_TESTS[@]}"
                 -k "$TRITON_K")
          fa3=${SANITIZE_EXCLUDE-kns=FlashAttnFwdSm90}
          exclude=(); [ -n "$fa3" ] && exclude=(--kernel-name-exclude "$fa3")
          ours_re="_(paged_attn|decode_finish|quant|w4a8|w4ax|gemm|store|gather_context)[a-z0-9_]*" ;;
    *) echo "unknown target $target (cuda, triton)"; exit 2 ;;
  esac
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
    extra=""
    [ "$tool" = "memcheck" ] && extra="--leak-check no"
    [ "$tool" = "racecheck" ] && extra="--racecheck-report all"
    log="$OUT_DIR/$target-$tool.log"
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$CS" --tool "$tool" $extra "${exclude[@]}" --error-exitcode 99 "${cmd[@]}" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1)
    ours=$(grep -E "^=========.*(Invalid|Race|Uninitialized|Barrier|hazard)" -A3 "$log" | grep -cE "$ours_re")
    result=$(grep -E "^failures:|passed|failed" "$log" | tail -1)
    line="$target $tool${exclude[*]:+ (${exclude[*]})}: rc=$rc | ${summary:-no summary} | reports naming our kernels: $ours | ${result:-driver did not finish} ($(( $(date +%s) - start ))s)"
    echo "$line" | tee -a "$OUT_DIR/summary.txt"
    [ "$rc" -ne 0 ] && status=1
  done
done
exit $status
