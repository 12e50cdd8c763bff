#!/usr/bin/env bash
# The A/B harness of issue #6 (benchmarks/ab.py, docs/AB.md) on the offline GPU host, in stages that
# each fit one 10-minute call of the device tool. After the vLLM bundle is installed:
#   (the stash calls of docs/GPU_HOST.md, "The device calls": .gpu/part1, then .gpu/part1w), then
#   bash .gpu/part2/install-on-host.sh install .gpu/part2 && . /tmp/mixprec-site/env.sh && bash scripts/gpu_ab.sh setup
# then, one call each (on the same warm host: checkpoints, build and results survive between calls):
#   bash scripts/gpu_ab.sh ckpt                         # random Llama-3-8B checkpoints (bf16, GPTQ, mixprec, KV4)
#   bash scripts/gpu_ab.sh throughput w4a8kv4 marlin    # `vllm bench throughput` on these arms
#   bash scripts/gpu_ab.sh serve w4a8kv4                # `vllm serve` + `vllm bench serve` concurrency sweep
#   bash scripts/gpu_ab.sh longctx w4a8kv4 bf16         # shared/baselines/kv_baseline.py's long-context run
#   bash scripts/gpu_ab.sh throughput,longctx fp8       # several workloads in one call
#   bash scripts/gpu_ab.sh profile w4a8kv4 fp8 marlin   # one decode step's GPU time by op class, per arm
#   bash scripts/gpu_ab.sh report                       # the table and the issue's targets so far
#   bash scripts/gpu_ab.sh aba throughput A B           # A, then B, then A again on this host, and their table
# Arms: bf16 marlin machete fp8 w4a8 w4a8kv4 (default: all six), marlin-int8, and the w4a8kv4-*
# arms that change one default each (docs/AB.md): -unfused -siluquant -inductorquant -siluop -noquantpdl -cachedprefill
# -tritonchunk -mergectx -pdl -tailprog -naturalorder -inputorder -codesorder.
# A workload stage resumes: what ab.jsonl already has as ok is skipped, so the same command can be
# repeated after a call ran out of time. Results accumulate in $AB_RESULTS on the host and are
# copied to $OUT after every finished run (ab.jsonl, ab.json, ab-logs.tar.gz): a killed call loses
# nothing it finished. Draw the plots where matplotlib is: vllm-mixprec ab --replot DIR_WITH_AB_JSONL.
# Settings (environment):
#   AB_LAYERS   decoder layers (32 = Llama-3-8B; the 2026-11-22 KV baseline's model had 8, vocab 8192)
#   AB_WORK     checkpoint folder (default /tmp/mixprec-ab; ~28 GB at 32 layers)
#   AB_RESULTS  results folder on the host (default $AB_WORK/results)
#   AB_BUDGET   seconds this call may spend (default 540); runs that cannot finish are not started
#   AB_ARGS     more harness options, e.g. "--num-prompts 400 --concurrency 1,8"
#   AB_PRIOR    an ab.jsonl from an earlier host (carried in the working tree) merged in first
#   AB_PROFILE_ARGS   more step_profile options for `profile`, e.g. "--steps 3 --timed-steps 8"
#   AB_PROFILE_REDO=1 `profile` reruns the arms whose result is already in $AB_RESULTS/profile
#   AB_KEEP_CODE=1    the code Inductor generated for the arms, from vLLM's compile cache, to $OUT
#   MIXPREC_KERNEL=cuda   make the mixprec arms fail rather than run without the csrc kernels
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/out}
mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
WORK=${AB_WORK:-/tmp/mixprec-ab}
RES=${AB_RESULTS:-$WORK/results}
LAYERS=${AB_LAYERS:-32}
BUDGET=${AB_BUDGET:-540}
DEFAULT_ARMS=bf16,marlin,machete,fp8,w4a8,w4a8kv4

log() { echo "[gpu_ab $(date +%H:%M:%S)] $*"; }

# The plugin's entry point (gpu_check.sh env writes it) and the packages `vllm bench serve` needs.
preflight() {
  if ! python3 -c "import importlib.metadata as m, sys
sys.exit(not [e for e in m.entry_points(group='vllm.general_plugins') if e.name == 'mixprec'])" 2>/dev/null; then
    log "registering the plugin (gpu_check.sh env)"
    bash scripts/gpu_check.sh env > "$OUT/gpu_check-env.log" 2>&1 \
      || { log "gpu_check.sh env FAILED"; tail -20 "$OUT/gpu_check-env.log"; return 1; }
  fi
  python3 -c "import aiohttp, PIL, vllm.benchmarks.serve, vllm.benchmarks.throughput" \
    || { log "vllm bench cannot import its dependencies (above)"; return 1; }
  python3 -c "import vllm_mixprec.kernels as k; print('mixprec kernels:', k.describe())" 2>/dev/null | grep -v '^INFO'
  df -h "$(dirname "$WORK")" | tail -1
}

stage_setup() {  # register the plugin and build csrc/ (a few minutes on a fresh host)
  bash scripts/gpu_check.sh env build && preflight
}

stage_ckpt() {
  log "checkpoints: $LAYERS layers -> $WORK"
  timeout -k 20 "$((BUDGET - SECONDS))" python3 -m vllm_mixprec.eval.synthetic --work "$WORK" --layers "$LAYERS" \
    --ckpts "${AB_CKPTS:-bf16,gptq,mixprec,mixprec-kv4}" 2>&1 | grep --line-buffered -v -E '^(INFO|WARNING)' \
    | tee "$OUT/ab-ckpt.log"
  local rc=${PIPESTATUS[0]}
  du -sh "$WORK"/*/* 2>/dev/null
  return "$rc"
}

run_workloads() {  # WORKLOADS [ARM...]
  local wl=$1; shift
  local arms; arms=$(IFS=,; echo "${*:-$DEFAULT_ARMS}")
  preflight || return 1
  local left=$((BUDGET - SECONDS))
  log "$wl on $arms, $LAYERS layers, budget ${left} s; results in $RES (copied to $OUT)"
  # shellcheck disable=SC2086
  timeout -k 30 "$((left + 20))" python3 benchmarks/ab.py --out "$RES" --mirror "$OUT" --work "$WORK" \
    --layers "$LAYERS" --workloads "$wl" --arms "$arms" --resume --budget "$left" \
    ${AB_PRIOR:+--prior "$AB_PRIOR"} ${AB_ARGS:-} 2>&1 | tee "$OUT/ab-${wl//,/-}.log"
  return "${PIPESTATUS[0]}"
}

# `profile ARM...` (default w4a8kv4 fp8 marlin): vllm_mixprec/eval/step_profile.py per arm, batch 256,
# context 1024, on the same checkpoints as `throughput`, then its --compare table and bar chart.
# Results stay in $RES/profile; to $OUT go step_profile-<arm>.json, step_profile-compare.{txt,png}
# and step_profile-logs.tar.gz (each arm's full log and its torch trace). An arm already done is
# skipped; an arm is not started with less than AB_PROFILE_MIN (150) s of budget left.
PROFILE_ARMS=w4a8kv4,fp8,marlin
VLLM_LOG_RE='^(\([A-Za-z_0-9]+ pid=[0-9]+\) )?(INFO|DEBUG|WARNING) [0-9]{2}-[0-9]{2} '

stage_profile() {
  local arms=("$@") dir=$RES/profile rc=0 arm left st f
  [ ${#arms[@]} -gt 0 ] || IFS=, read -ra arms <<< "$PROFILE_ARMS"
  preflight || return 1
  mkdir -p "$dir/logs"
  for arm in "${arms[@]}"; do
    if [ -s "$dir/step_profile-$arm.json" ] && [ -z "${AB_PROFILE_REDO:-}" ]; then
      log "profile $arm: done earlier ($dir/step_profile-$arm.json)"
      cp "$dir/step_profile-$arm.json" "$OUT"/
      continue
    fi
    left=$((BUDGET - SECONDS))
    if [ "$left" -lt "${AB_PROFILE_MIN:-150}" ]; then
      log "profile $arm: not started, ${left} s of budget left (repeat the command)"
      [ "$rc" -eq 1 ] || rc=3
      continue
    fi
    log "profile $arm: $LAYERS layers, batch 256, context 1024, budget ${left} s"
    # shellcheck disable=SC2086
    timeout -k 20 "$((left - 10))" python3 -m vllm_mixprec.eval.step_profile --ckpt "$WORK" --layers "$LAYERS" \
      --arm "$arm" --batch 256 --context 1024 --out "$dir" ${AB_PROFILE_ARGS:-} 2>&1 \
      | tee "$dir/logs/step_profile-$arm.log" | grep --line-buffered -v -E "$VLLM_LOG_RE"
    st=${PIPESTATUS[0]}
    if [ "$st" -ne 0 ] || [ ! -s "$dir/step_profile-$arm.json" ]; then
      log "profile $arm FAILED (exit $st); the log ends:"
      tail -25 "$dir/logs/step_profile-$arm.log"
      rc=1
    else
      cp "$dir/step_profile-$arm.json" "$OUT"/
    fi
  done
  local files=()
  for arm in "${arms[@]}"; do
    [ -s "$dir/step_profile-$arm.json" ] && files+=("$dir/step_profile-$arm.json")
  done
  if [ ${#files[@]} -gt 0 ]; then
    python3 -m vllm_mixprec.eval.step_profile --compare "${files[@]}" --out "$OUT" | tee "$OUT/step_profile-compare.txt"
  fi
  f=$OUT/step_profile-logs.tar.gz
  # shellcheck disable=SC2046
  tar czf "$f" -C "$dir" logs $(cd "$dir" && ls -d traces-* 2>/dev/null)
  if [ "$(stat -c %s "$f")" -gt $((15 * 1024 * 1024)) ]; then
    log "traces too large to bring back (16 MB a file): $f holds the logs only; the traces stay in $dir"
    tar czf "$f" -C "$dir" logs
  fi
  return "$rc"
}

stage_report() {
  python3 benchmarks/ab.py --replot "$RES" 2>&1 | grep -v -E '^(INFO|WARNING)'
  cp "$RES"/ab.jsonl "$RES"/ab.json "$OUT"/ 2>/dev/null
  return 0
}

# `aba WORKLOAD A B`: A, B, then A again, each round in a results folder of its own ($RES/aba-N,
# $OUT/aba-N), so that --resume does not skip A's second run; repeating the command after a call
# ran out of budget goes on where it stopped. Then `ab.py --aba-report`: each arm against the mean
# of A's rounds, with A's drift (docs/AB.md). AB_PRIOR is not merged: every round runs on this host.
stage_aba() {
  local wl=${1:-} a=${2:-} b=${3:-} i=0 arm rc=0
  if [ -z "$b" ] || [ $# -gt 3 ]; then
    echo "usage: gpu_ab.sh aba WORKLOAD ARM_A ARM_B (e.g. aba throughput w4a8kv4-codesorder w4a8kv4)" >&2
    return 2
  fi
  for arm in "$a" "$b" "$a"; do
    i=$((i + 1))
    mkdir -p "$OUT/aba-$i"
    AB_PRIOR='' RES=$RES/aba-$i OUT=$OUT/aba-$i run_workloads "$wl" "$arm" || { rc=$?; break; }
  done
  python3 benchmarks/ab.py --aba-report "$RES/aba-1" "$RES/aba-2" "$RES/aba-3" | tee "$OUT/aba.txt"
  return "$rc"
}

stage_clean() {  # frees the disk: checkpoints go, results stay
  rm -rf "$WORK"/llama3-8b-L* "$WORK"/tokenizer && log "checkpoints removed from $WORK"
}

[ $# -ge 1 ] || { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 2; }
stage=$1; shift
case "$stage" in
  setup|ckpt|report|clean) "stage_$stage" ;;
  profile) stage_profile "$@" ;;
  aba) stage_aba "$@" ;;
  *) for w in ${stage//,/ }; do
       case "$w" in
         throughput|serve|longctx) ;;
         *) echo "unknown stage $w (setup ckpt throughput serve longctx profile aba report clean)" >&2; exit 2 ;;
       esac
     done
     run_workloads "$stage" "$@" ;;
esac
status=$?
# AB_KEEP_CODE=1: the code Inductor generated for the arms (vLLM's compile cache: each arm's
# folder is named in its engine log, "Using cache directory" / "saved AOT compiled function")
if [ -n "${AB_KEEP_CODE:-}" ] && [ -d "$HOME/.cache/vllm/torch_compile_cache" ]; then
  (cd "$HOME/.cache/vllm" && find torch_compile_cache -name '*.py' -size -4M | tar czf "$OUT/compile-code.tgz" -T -)
  log "Inductor's code: $OUT/compile-code.tgz ($(du -h "$OUT/compile-code.tgz" | cut -f1))"
fi
log "done, status $status (0 ok, 1 a run failed, 3 budget left work undone: repeat the command); files in $OUT:"
ls -la "$OUT"
exit $status
