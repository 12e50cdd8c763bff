#!/usr/bin/env bash
# The real models on the offline GPU host: SmolLM2-135M bf16, the `make demo` W4A8+KV8 checkpoint and
# the eval texts travel as the parts `make gpu-models` writes (.gpu/models/partK, <= 48 MiB each:
# 3 parts, of which the last is ~42 MiB), then scripts/real_model_check.py runs there (issues #5, #6).
#
# Device calls (the `run` tool), back to back so that the host stays warm (it goes ~30 s after a call
# ends, and with it /root/mixprec-stash, /root/mixprec-models and /tmp/mixprec-site):
#   1. carry [".gpu/part1"]          bash .gpu/part1/install-on-host.sh stash .gpu/part1 && mkdir -p /root/mixprec-stash/wheels
#  1b. carry [".gpu/part1w"]         bash scripts/gpu_part1w.sh
#   2. carry [".gpu/models/part1"]   bash scripts/gpu_models.sh stash .gpu/models/part1
#   3. carry [".gpu/models/part2"]   bash scripts/gpu_models.sh stash .gpu/models/part2
#   4. carry [".gpu/models/part3"]   bash scripts/gpu_models.sh stash .gpu/models/part3
#   5. carry [".gpu/part2"]          bash scripts/gpu_models.sh check bf16,bf16-triton,bf16-kv8
#        installs the vLLM bundle (part 2 + the stashed part 1), registers the plugin (gpu_check.sh
#        env), assembles the models (sha256-checked), then the greedy arms (compiled, CUDA graphs)
#   6. no carry                      bash scripts/gpu_models.sh check rest
#        every arm not yet done on this host (bf16-kv4; w4a8-kv8, w4a8: perplexity, eager); repeat it while
#        real_model_check.json says arms are missing (exit status 3)
# With `make gpu-models QWEN=1` the pack also holds the real Qwen2.5-Coder-1.5B (~25 more parts,
# one stash call each, before call 5); its arms: `bash scripts/gpu_models.sh check qwen-bf16,qwen-kv8`,
# then qwen-w4a8-kv4 and qwen-sakc-kv8 (both made on the host from the bf16 folder; the second
# calibrates on the pack's alice29, ~1-3 min)
# (`rest` includes them when the Qwen folder is there). `make gpu-models QWEN=only` packs the texts and Qwen alone
# (~25 parts of 44 MiB): then only the qwen-* arms can run.
# Each call with timeout_s 600. The verdict is $OUT/real_model_check.json (status of the call, and
# all_arms_on_this_host for the whole check) and $OUT/real_model_check.log. A host lost between
# calls shows as "parts [...] were not stashed" or "part 1 is missing": start again at call 1.
#
#   bash scripts/gpu_models.sh stash PARTDIR     keep one part in $MODELS (/root/mixprec-models); idempotent
#   bash scripts/gpu_models.sh assemble          rebuild the folders from every part; fails naming missing parts
#   bash scripts/gpu_models.sh check [ARMS]      bundle + plugin + assemble, then real_model_check.py --arms ARMS
#                                                (default rest) within CHECK_BUDGET s (default: what is left of 570)
#   bash scripts/gpu_models.sh check-host-ref ARMS [RUNS]   the same against a CPU reference of RUNS (default:
#                                                ARMS) computed on this host first (a DERIVED folder built here)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODELS=${MIXPREC_MODELS:-/root/mixprec-models}
OUT=${OUT:-$REPO/out}
SITE=/tmp/mixprec-site
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
log() { echo "[gpu_models $(date +%H:%M:%S)] $*"; }

pack() { python3 -m vllm_mixprec.eval.modelpack "$@" --dest "$MODELS"; }

vllm_ready() {
  if [ ! -f "$SITE/env.sh" ]; then
    [ -d "$REPO/.gpu/part2" ] || { log "no vLLM in $SITE and no .gpu/part2 here: carry .gpu/part2 (call 5)"; return 1; }
    log "installing the vLLM bundle"
    bash "$REPO/.gpu/part2/install-on-host.sh" install "$REPO/.gpu/part2" || return 1
  fi
  . "$SITE/env.sh"
  OUT=$OUT bash "$REPO/scripts/gpu_check.sh" env > "$OUT/gpu_check_env.log" 2>&1 \
    || { log "gpu_check.sh env FAILED"; tail -20 "$OUT/gpu_check_env.log"; return 1; }
  tail -3 "$OUT/gpu_check_env.log"
}

# Bundle, plugin and models ready on this host (the start of every check).
prepare_check() {
  mkdir -p "$OUT"
  vllm_ready || exit 1
  pack assemble || exit 1
}
# real_model_check.py on ARMS (then any extra arguments) within CHECK_BUDGET s (default: what is
# left of 570).
check_arms() {
  local arms=$1 budget=${CHECK_BUDGET:-$((570 - SECONDS))}
  shift
  log "real_model_check.py --arms $arms${*:+ $*} --budget $budget"
  exec timeout $((budget + 25)) python3 scripts/real_model_check.py --models-dir "$MODELS" --out "$OUT" \
    --arms "$arms" "$@" --budget "$budget"
}

step=${1:-}
case "$step" in
  stash) pack stash "${2:?usage: gpu_models.sh stash PARTDIR}" ;;
  assemble) pack assemble ;;
  check)
    prepare_check
    check_arms "${2:-rest}"
    ;;
  check-host-ref)
    # For a DERIVED model calibrated on the host (qwen-sakc-kv8), whose bytes the host's CPU may
    # round differently from the committed reference's: compute the CPU reference of RUNS on this
    # host's cores ($OUT/host-ref.json, pinning the bytes built here), then check ARMS against it.
    # docs/GPU_HOST.md, "qwen-sakc-kv8 on a host whose CPU builds other bytes".
    runs=${3:-${2:?usage: gpu_models.sh check-host-ref ARMS [RUNS]}}
    prepare_check
    log "CPU reference of $runs on this host -> $OUT/host-ref.json"
    python3 scripts/real_model_check.py --models-dir "$MODELS" --cpu-reference "$OUT/host-ref.json" \
      --runs "$runs" || { log "host CPU reference FAILED"; exit 1; }
    check_arms "$2" --reference "$OUT/host-ref.json"
    ;;
  *) echo "usage: gpu_models.sh stash PARTDIR | assemble | check [ARMS] | check-host-ref ARMS [RUNS]" >&2; exit 2 ;;
esac
