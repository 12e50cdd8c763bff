#!/usr/bin/env bash
# The GPU job, run on the offline GPU host after the vLLM bundle is installed:
#   bash .gpu/part2/install-on-host.sh install .gpu/part2 && . /tmp/mixprec-site/env.sh \
#     && bash scripts/gpu_check.sh [STAGE...]
# Stages (default: env build test bench e2e): env build diag test (= test_kernels + test_other)
# test_csrc bench_gemm bench_cuda bench_attn bench (= bench_gemm + bench_attn) bench_prefill tune_attn tune_prefill sanitize
# profile e2e load property sweep_splits tp tp_kv4 recheck gather bench_fp8 decode pdl act_quant tp_control tail
# finish_rows min_tiles pdl_rows merge_fused merge_fused_cap merge_rows merge_rows_bench w4ax startup
# decode_sweep decode_plan gemm_launch gemm_flush cuda_decode cuda_decode_tune decode_impl_ab
# rerun_refactors vllm_int_attn merge_rows_rest tp_global tp_nan_locate small_tiles small_tiles_sweep tp_split
# tp_rest_a tp_rest_b tp_real_global tp_real_exact tp_exact tp_real_control tp_epilogue_tests sanitize_cuda
# tp_real_exact_verdict wgmma_pdl_tests wgmma_pdl_bench wgmma_pdl_sanitize gemm_table
# stream_k_tests stream_k_sweep stream_k_auto stream_k_verify stream_k_sanitize decode_hbm
# decode_options decode_options_splits decode_options_check decode_build decode_table decode_table_tested
# decode_preload decode_preload_table mid_table profile_mid wgmma_diag stream_k_oos w4ax_alloc w4ax_sweep
# quant_lean cluster_pair cluster_pair_sanitize racecheck_probe pair_tail pair_racecheck_split pair_pull
# pair_pull_ab decode_pdl profile_decode_cold w4ax_tests property_cuda_gemm issue_table stream_k_refit
# profile_decode_stalls profile_decode_ceiling decode_dp4a decode_dp4a_c3 decode_dp4a_final
# decode_dp4a_per_chunk_c3 decode_m64 decode_m64_auto decode_groups decode_groups_rows16
# decode_groups_auto test_attention test_other_rest decode_k_sweep decode_k_auto x_wgmma_tests
# x_wgmma_bench x_wgmma_table x_wgmma_compiled x_wgmma_serve x_wgmma_compiled_more x_input_order
# x_input_order_piece x_input_order_layers w4ax_rot_chunks w4ax_split w4ax_compiled
# x_input_fused_piece w4ax_perm x_order_piece_aba triton_tiles triton_tiles_w4ax triton_mid_linear
# test_triton_gemm triton_quant_rows quant_split quant_split_table triton_decode_linear
# decode_chain_tests decode_chain_preload env_arms served_marlin norm_quant_vllm decode_ops_tests
# decode_ops_serve profile_silu quant_ops_pdl closeout
# Each stage writes its logs, JSON and PNG to $OUT (./out when $OUT is unset). A call of the
# device tool is limited to 10 minutes, so long sessions run the stages in separate calls on
# the same warm host: the built extension and /tmp/mixprec-site survive between them.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/out}
mkdir -p "$OUT"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
SITE=/tmp/mixprec-site
status=0
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env build test bench e2e)

log() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }

# vLLM finds plugins through package metadata: give the source tree a dist-info on the path.
register_plugin() {
  local di=$SITE/vllm_mixprec-0.1.0.dist-info
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm-mixprec\nVersion: 0.1.0\n' > "$di/METADATA"
  printf '[vllm.general_plugins]\nmixprec = vllm_mixprec:register\n\n[console_scripts]\nvllm-mixprec = vllm_mixprec.cli:main\n' > "$di/entry_points.txt"
  : > "$di/RECORD"
}

stage_env() {
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton, vllm
p = torch.cuda.get_device_properties(0)
print(f"device {p.name} sm_{p.major}{p.minor} SMs={p.multi_processor_count} mem={p.total_memory/2**30:.1f}GiB")
print(f"torch {torch.__version__} triton {triton.__version__} vllm {vllm.__version__}")
PY
  register_plugin
  python3 -c "import importlib.metadata as m; print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name=='mixprec'])"
}

# The host's CC/CXX (/opt/gcc, a wrapper around g++ 13.3) link the C++ runtime statically: a
# TORCH_CHECK failing inside an op then crashes the process instead of raising
# (scripts/diag_cxx_throw.sh, 2026-11-23). The system g++ is the same 13.3 and links it
# dynamically, as torch does; setup.py refuses a build that does not.
use_system_gxx() { [ -x /usr/bin/g++ ] && export CC=/usr/bin/gcc CXX=/usr/bin/g++; return 0; }
build_ext_90a() {  # LOG: csrc/ in place for sm_90a (incremental: only changed sources recompile)
  use_system_gxx
  MIXPREC_BUILD_CUDA=1 MIXPREC_CUDA_ARCHS="90a" MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$1" 2>&1 \
    || { log "BUILD FAILED ($1)"; tail -40 "$1"; return 1; }
}
stage_build() {
  use_system_gxx
  log "building csrc/ (sm90a) with CXX=${CXX:-default}"
  local t0=$SECONDS
  build_ext_90a "$OUT/build.log" || return 1
  log "built in $((SECONDS - t0)) s: $(ls vllm_mixprec/_C*.so)"
  python3 -c "import vllm_mixprec.kernels as k; print(k.describe())"
  # op errors must reach Python as exceptions (a crash here would kill the test session)
  python3 tests/kernels/cuda_error_cases.py > "$OUT/op_error_cases.log" 2>&1 \
    || { log "op error cases FAILED"; tail -20 "$OUT/op_error_cases.log"; return 1; }
  log "op error cases: $(grep -c '  ok:' "$OUT/op_error_cases.log") raised as expected"
}

# pytest -m gpu, in parts that each fit one 10-minute device call:
#   test_kernels (tests/kernels, the wgmma file last under its own timeout), test_other (the
#   rest); `test` runs both. -v names every test in the log, so a killed run still shows
#   where it was; --durations lists the slow ones.
pytest_gpu() { pytest_logged "$1" "$2" -m gpu "${@:3}"; }
pytest_logged() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  log "pytest $*"
  timeout "$limit" python3 -m pytest -v -rfE --durations=15 -p no:cacheprovider \
    --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$name.log" | tail -25
  [ "$rc" -eq 124 ] && log "$name TIMED OUT after $limit s; last: $(grep -E '(PASSED|FAILED|SKIPPED|ERROR)' "$OUT/$name.log" | tail -1)"
  return "$rc"
}
stage_test_kernels() {
  local rc=0
  pytest_gpu pytest-gpu-kernels 360 tests/kernels --deselect tests/kernels/test_cuda_gemm_wgmma.py || rc=1
  pytest_gpu pytest-gpu-wgmma 150 -x tests/kernels/test_cuda_gemm_wgmma.py || rc=1
  return $rc
}
# test_other: the attention GPU tests compare with float64 references computed on the CPU (seconds
# a test at 3000 tokens; serially they outran a 10-minute call from session 26 on), so pytest-xdist
# (carried in .gpu/pyextra) spreads them over the host's 16 cores; the rest (eval starts vLLM) runs
# one test at a time.
stage_test_attention() {
  use_pyextra xdist || return 1
  OMP_NUM_THREADS=2 pytest_gpu pytest-gpu-attention 420 -n "${GPU_TEST_WORKERS:-8}" tests/attention_backend
}
stage_test_other_rest() { pytest_gpu pytest-gpu-other-rest 400 tests --ignore=tests/kernels --ignore=tests/attention_backend; }
stage_test_other() { local rc=0; stage_test_attention || rc=1; stage_test_other_rest || rc=1; return $rc; }
stage_test() { local rc=0; stage_test_kernels || rc=1; stage_test_other || rc=1; return $rc; }
# Only the csrc GEMM tests (after a change to csrc/gemm: ~2 minutes instead of test_kernels' 4.5)
stage_test_csrc() { pytest_gpu pytest-gpu-csrc 360 tests/kernels/test_cuda_gemm.py tests/kernels/test_cuda_gemm_wgmma.py; }

# Property tests (hypothesis) on the device, csrc and Triton kernels included. They are not
# gpu-marked (the Triton ones run on the CPU in CI too), so `-m gpu` leaves them out. The host has
# no hypothesis or pytest-xdist: carry .gpu/pyextra (`make gpu-bundle` fills it).
use_pyextra() {  # MODULE: put .gpu/pyextra on the path and check that MODULE imports
  [ -d "$REPO/.gpu/pyextra" ] && export PYTHONPATH=$REPO/.gpu/pyextra:$PYTHONPATH
  python3 -c "import $1" 2>/dev/null || { log "no $1 on the path: carry .gpu/pyextra"; return 1; }
}
stage_property() {
  use_pyextra hypothesis || return 1
  pytest_logged pytest-property 540 tests/kernels/test_cuda_properties.py tests/kernels/test_triton_properties.py \
    tests/attention_backend/test_kv_properties.py tests/test_formats_properties.py tests/test_reference_properties.py
}

# What is new since the last device session: the attention GPU tests (exact prefill in Triton
# and through FlashAttention + merge, bias-aware K, decode configs, CUDA graphs), the W4Ax Triton
# GPU tests and the Inductor act-quant fusion test. 64 tests; on 2026-11-25 300 s covered 19
# of them (the float64 references of 3000-token rows dominate), hence a call of its own.
stage_recheck() {
  pytest_gpu pytest-gpu-recheck 560 tests/attention_backend tests/kernels/test_triton_gemm.py \
    tests/kernels/test_act_quant_fusion.py -k "not test_gpu_w4a8 or w4ax"
}
# Exact prefill's context workspace + FlashAttention (the default since session 9): its kernel
# against the reference, the paged-attention paths, the backend over steps, big GPU shapes.
stage_gather() {
  pytest_logged pytest-gpu-gather 240 tests/attention_backend -k "gather or chunk_impl_auto or context_tokens"
}
# The decode path changed in session 10 (empty splits exit, the finish kernel merges SC splits a
# load): its GPU tests, then the issue's decode grid (batch {1,8,64} x context {1K,8K,32K}) for
# FA3 and our three decode methods; vLLM's Triton int4/int8 are left out (the slow part of the grid).
stage_decode() {
  local rc=0
  # (the CPU-class ones run on the GPU here too; of the big-shape test, fast unpack, G = 4, D = 128;
  # the residual directory's CUDA-graph update against the eager one)
  pytest_logged pytest-gpu-decode 360 tests/attention_backend/test_attn_kernels.py \
    tests/attention_backend/test_attn_residual.py \
    -k "decode or matches_reference or (paged_attention_gpu and 1-4-128) or graphed or kernel_update" || rc=1
  run_bench bench_attention_decode 300 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --methods fa3-bf16 mixprec-kv4 mixprec-kv4-r16 mixprec-kv8 --out "$OUT" || rc=1
  # the same small batches with the residual tail left to the finish kernel (the default
  # attends it in the last split there: attention.decode_tail_mode)
  mkdir -p "$OUT/tail-in-finish"
  MIXPREC_ATTN_TAIL_IN_SPLIT=0 run_bench bench_attention_tail_in_finish 120 python3 benchmarks/bench_attention.py \
    --rep-ms 100 --batch 1 8 --methods fa3-bf16 mixprec-kv4-r16 mixprec-kv8 --out "$OUT/tail-in-finish" || rc=1
  # the finish kernel as a programmatic dependent launch (attention.decode_pdl, off by default)
  mkdir -p "$OUT/pdl"
  MIXPREC_ATTN_PDL=1 run_bench bench_attention_pdl 120 python3 benchmarks/bench_attention.py \
    --rep-ms 100 --batch 1 8 64 --methods fa3-bf16 mixprec-kv4-r16 mixprec-kv8 --out "$OUT/pdl" || rc=1
  return $rc
}
# What session 12 left unrun (session 13): the PDL decode path's GPU tests (bit-identical to plain
# launches, eager and replayed from a CUDA graph), the residual directory kernel's GPU tests after
# its tile change, the traced quantization's tests on the GPU; then the PDL A/B at batch 1/8/64.
stage_pdl() {
  local rc=0
  pytest_logged pytest-gpu-pdl 300 tests/attention_backend/test_attn_kernels.py \
    tests/attention_backend/test_attn_residual.py tests/kernels/test_act_quant_fusion.py \
    tests/kernels/test_nonfinite_linear.py \
    -k "pdl or cuda_graph_replay or kernel_update or graphed or fusion or nonfinite or quantiz" || rc=1
  run_bench bench_attention_plain 150 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 64 --ctx 1024 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT" || rc=1
  mkdir -p "$OUT/pdl"
  MIXPREC_ATTN_PDL=1 run_bench bench_attention_pdl 150 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 64 --ctx 1024 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT/pdl" || rc=1
  return $rc
}
# The residual tail as a program of its own (MIXPREC_ATTN_TAIL=program, off by default until
# timed): its GPU tests, then the decode grid at batch 1/8/64 with the default placement and with it.
stage_tail() {
  local rc=0
  pytest_logged pytest-gpu-tail 300 tests/attention_backend/test_attn_kernels.py \
    -k "tail-program or tail_mode or merges_many_splits" || rc=1
  run_bench bench_attention_tail_default 150 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 64 --ctx 1024 8192 --methods fa3-bf16 mixprec-kv4 mixprec-kv4-r16 --out "$OUT" || rc=1
  mkdir -p "$OUT/tail-program"
  MIXPREC_ATTN_TAIL=program run_bench bench_attention_tail_program 150 python3 benchmarks/bench_attention.py \
    --rep-ms 100 --batch 1 8 64 --ctx 1024 8192 --methods mixprec-kv4-r16 --out "$OUT/tail-program" || rc=1
  # with the finish kernel merge-only, PDL may now hide its launch (it cost 5.2 us at 8 x 1K with the tail in it)
  mkdir -p "$OUT/tail-program-pdl"
  MIXPREC_ATTN_TAIL=program MIXPREC_ATTN_PDL=1 run_bench bench_attention_tail_program_pdl 150 python3 \
    benchmarks/bench_attention.py --rep-ms 100 --batch 1 8 64 --ctx 1024 8192 --methods mixprec-kv4-r16 \
    --out "$OUT/tail-program-pdl" || rc=1
  return $rc
}
# Session 15: the finish kernel merges over the group's rows (not tl.dot's 16), and the split-K
# counters of captured GEMMs are no longer zeroed by a fill per GEMM: their GPU tests, then the
# decode grid at batch 1/8/64 with the default tail placement and with the tail program.
stage_finish_rows() {
  local rc=0
  pytest_logged pytest-gpu-finish-rows 300 tests/kernels/test_cuda_gemm.py \
    tests/attention_backend/test_attn_kernels.py \
    -k "graph or merges_many_splits or decode_cuda_graph_replay or pdl_matches or decode_configs" || rc=1
  run_bench bench_attention_rows 150 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 64 --ctx 1024 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT" || rc=1
  mkdir -p "$OUT/tail-program"
  MIXPREC_ATTN_TAIL=program run_bench bench_attention_rows_tail_program 150 python3 benchmarks/bench_attention.py \
    --rep-ms 100 --batch 1 8 64 --ctx 1024 8192 --methods mixprec-kv4-r16 --out "$OUT/tail-program" || rc=1
  return $rc
}
# Session 15: at least MIXPREC_ATTN_MIN_TILES page tiles a decode split (fewer partials for a
# short row); its GPU tests, then batch 1/8 x 1K/8K with 1 (the default), 2 and 4.
stage_min_tiles() {
  local rc=0 t
  pytest_logged pytest-gpu-min-tiles 200 tests/attention_backend/test_attn_kernels.py \
    -k "min_tiles or merges_many_splits" || rc=1
  for t in 1 2 4; do
    mkdir -p "$OUT/min-tiles-$t"
    MIXPREC_ATTN_MIN_TILES=$t run_bench bench_attention_min_tiles_$t 120 python3 benchmarks/bench_attention.py \
      --rep-ms 100 --batch 1 8 --ctx 1024 2048 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT/min-tiles-$t" || rc=1
  done
  return $rc
}
# Session 15: the finish kernel as a PDL launch again, now that its merge runs over the group's
# rows (session 13 found PDL 5.2 us slower at 8 x 1K with the 16-row merge)
stage_pdl_rows() {
  local rc=0
  run_bench bench_attention_plain 120 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 --ctx 1024 2048 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT" || rc=1
  mkdir -p "$OUT/pdl"
  MIXPREC_ATTN_PDL=1 run_bench bench_attention_pdl 120 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 --ctx 1024 2048 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT/pdl" || rc=1
  return $rc
}
# Session 16: the decode merge fused into the page kernel (MIXPREC_ATTN_MERGE=fused: the last
# program of a (row, kv head) merges, no finish kernel). Its GPU tests (graph replay, bit-equal
# to the finish kernel's merge, counters left zero), then batch 1/8/64 x 1K/8K: the default,
# fused with the tail in the last split, fused with the tail program.
stage_merge_fused() {
  local rc=0
  pytest_logged pytest-gpu-merge-fused 300 tests/attention_backend/test_attn_kernels.py \
    -k "fused or merges_many_splits or decode_cuda_graph_replay" || rc=1
  run_bench bench_attention_default 150 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 64 --ctx 1024 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT" || rc=1
  mkdir -p "$OUT/fused" "$OUT/fused-tail-program"
  MIXPREC_ATTN_MERGE=fused run_bench bench_attention_fused 150 python3 benchmarks/bench_attention.py \
    --rep-ms 100 --batch 1 8 64 --ctx 1024 8192 --methods mixprec-kv4-r16 --out "$OUT/fused" || rc=1
  MIXPREC_ATTN_MERGE=fused MIXPREC_ATTN_TAIL=program run_bench bench_attention_fused_tail_program 150 \
    python3 benchmarks/bench_attention.py --rep-ms 100 --batch 1 8 64 --ctx 1024 8192 \
    --methods mixprec-kv4-r16 --out "$OUT/fused-tail-program" || rc=1
  return $rc
}
# For session 17: at batch 8 the fused merge lost (37.5 against 33.2 us at 1K) with its page
# kernel at 211 registers (2 CTAs an SM), where the finish-tail page kernel has 143 (3). ptxas
# (no GPU) fits the fused + tail-program kernel in 160-168 registers without spills: time it
# capped, beside the default, at batch 2/4/8/64 (batches 2 and 4 are untimed with either).
stage_merge_fused_cap() {
  local rc=0 cap
  run_bench bench_attention_default 150 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 2 4 8 64 --ctx 1024 8192 --methods fa3-bf16 mixprec-kv4-r16 --out "$OUT" || rc=1
  for cap in 0 168 160; do
    mkdir -p "$OUT/fused-program-cap$cap"
    MIXPREC_ATTN_MERGE=fused MIXPREC_ATTN_TAIL=program MIXPREC_ATTN_DECODE_MAXNREG=$cap \
      run_bench bench_attention_fused_cap$cap 150 python3 benchmarks/bench_attention.py --rep-ms 100 \
      --batch 1 2 4 8 64 --ctx 1024 8192 --methods mixprec-kv4-r16 --out "$OUT/fused-program-cap$cap" || rc=1
  done
  return $rc
}
# Session 17: the fused merge with its page kernel capped at 168 registers is the default for
# KV4 batches of fewer (row, kv head) pairs than SMs (decode_merge_mode). merge_rows: its GPU
# tests (session 17 ran 41 of them in 300 s, with the benches after them in the same stage;
# alone they get a call of their own). merge_rows_bench: batch 1-64 x 1K/8K with the defaults
# and with the finish kernel forced (session 16's rule for batch > 1), both in this run.
stage_merge_rows() {
  pytest_logged pytest-gpu-merge-rows 540 tests/attention_backend/test_attn_kernels.py \
    -k "fused or merges_many_splits or decode_cuda_graph_replay or paged_attention_gpu"
}
# merge_rows less the 55 tests that passed in session 24 before its time ran out (their ids are
# in that run's log)
stage_merge_rows_rest() {
  local done_log=benchmarks/results/2026-11-27-s24/merge-rows/pytest-gpu-merge-rows.log args=()
  mapfile -t args < <(grep -oE '^tests/[^ ]+ PASSED' "$done_log" | sed -e 's/ PASSED$//' -e 's/^/--deselect=/')
  log "merge_rows_rest: ${#args[@]} tests deselected (passed in session 24)"
  pytest_logged pytest-gpu-merge-rows-rest 540 tests/attention_backend/test_attn_kernels.py \
    -k "fused or merges_many_splits or decode_cuda_graph_replay or paged_attention_gpu" "${args[@]}"
}
stage_merge_rows_bench() {
  local rc=0
  run_bench bench_attention_default 180 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 2 4 8 16 32 64 --ctx 1024 8192 --methods fa3-bf16 mixprec-kv4-r16 mixprec-kv8 --out "$OUT" || rc=1
  mkdir -p "$OUT/merge-kernel"
  MIXPREC_ATTN_MERGE=kernel run_bench bench_attention_merge_kernel 150 python3 benchmarks/bench_attention.py \
    --rep-ms 100 --batch 2 4 8 16 --ctx 1024 8192 --methods mixprec-kv4-r16 --out "$OUT/merge-kernel" || rc=1
  return $rc
}
# W4Ax with the block rotation (act_rotation "hadamard"): its GPU tests, then its cost against W4Ax
# without rotation, W4A8 and Marlin on two Llama-3-8B shapes
stage_w4ax_tests() { pytest_gpu pytest-gpu-w4ax 360 tests/kernels/test_triton_gemm.py -k w4ax; }
stage_w4ax() {
  local rc=0
  stage_w4ax_tests || rc=1
  mkdir -p "$OUT/w4ax"
  run_bench bench_gemm_w4ax 300 python3 benchmarks/bench_gemm.py --shapes 4096x6144,14336x4096 \
    --ms 1,16,256,4096 --methods ours_triton_q,ours_cuda,ours_w4ax_triton_q,ours_w4ax_rot_triton_q,marlin_w4a16 \
    --out "$OUT/w4ax" || rc=1
  return $rc
}
# The decode kernels' start-up compiles (docs/STARTUP.md): the precompile's GPU test (warmed keys are
# serving's), then a cold Triton cache per mode, one-by-one at first launch against the parallel precompile
stage_startup() {
  local rc=0
  pytest_logged pytest-gpu-precompile 240 tests/attention_backend/test_attn_precompile.py -m gpu || rc=1
  run_bench bench_startup_compile 420 python3 benchmarks/bench_startup_compile.py --out "$OUT" || rc=1
  return $rc
}
stage_property_cuda_gemm() {
  use_pyextra hypothesis || return 1
  pytest_logged pytest-property-cuda 200 tests/kernels/test_cuda_properties.py
}

run_bench() {  # NAME TIMEOUT CMD...: one benchmark, its log in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  log "$name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40
}

# The Inductor-fused activation quantisation at decode sizes against plain RMSNorm / SiLU-and-mul,
# and mixprec::silu_mul_quantize_act (compile_passes.py) against Inductor's SiLU+quant kernel
stage_act_quant() {
  local rc=0
  pytest_logged pytest-gpu-silu-quant 200 tests/kernels/test_triton_gemm.py tests/test_compile_passes.py \
    -k "silu_mul or compile" || rc=1
  run_bench bench_act_quant 300 python3 benchmarks/bench_act_quant.py --ms 1 8 64 512 --out "$OUT" || rc=1
  # the split rows' second pass as a plain launch (gemm.split_rows_pdl)
  mkdir -p "$OUT/quant-no-pdl"
  MIXPREC_QUANT_PDL=0 run_bench bench_act_quant_no_pdl 200 python3 benchmarks/bench_act_quant.py --ms 1 8 \
    --out "$OUT/quant-no-pdl" || rc=1
  return $rc
}
stage_bench_gemm() { run_bench bench_gemm 420 python3 benchmarks/bench_gemm.py --out "$OUT"; }
# The Llama-3-8B layers at decode and prefill M against FP8 W8A8 (what `--quantization fp8` runs)
stage_bench_fp8() {
  run_bench bench_gemm_fp8 300 python3 benchmarks/bench_gemm.py --shapes 4096x6144,4096x4096,4096x28672,14336x4096 \
    --ms 1,16,256,1024,4096 --methods ours_cuda,ours_cuda_gemm,fp8_w8a8,marlin_w4a16,cublas_bf16,ours_triton_q,ours_w4ax_triton_q \
    --out "$OUT/fp8"
}
stage_bench_cuda() { run_bench bench_w4a8_cuda 400 python3 scripts/bench_w4a8_cuda.py --ms 1 4 16 32 64 256 1024 4096 --out "$OUT"; }
# The wgmma tile x split-K grid of the layer shapes where the split heuristic was seen to miss
stage_sweep_splits() {
  run_bench bench_w4a8_cuda_splits 400 python3 scripts/bench_w4a8_cuda.py --shapes 4096x6144 4096x4096 \
    14336x4096 8192x10240 --ms 64 256 1024 2048 --splits-sweep --no-marlin --out "$OUT/splits_sweep.json"
}
# The 128-channel wgmma tiles (kernels 7, 8) and the planner that picks them (session 27): their
# GPU tests and bench_gemm's linear at M = 64-256 (issue #4's method) with the auto plan, on the
# layers whose 256-channel tiles leave SMs idle. small_tiles_sweep: the tile x split sweep rows
# session 27's 300 s run did not reach (kernels 4-8 x 1, 2, 4 splits; the planner's data)
stage_small_tiles() {
  local rc=0
  pytest_gpu pytest-gpu-wgmma 240 tests/kernels/test_cuda_gemm_wgmma.py || rc=1
  run_bench bench_gemm_small_n 200 python3 benchmarks/bench_gemm.py --ms 64,128,256 \
    --shapes 4096x6144,4096x4096,14336x4096,8192x10240 --methods ours_cuda,ours_cuda_gemm,marlin_w4a16 \
    --out "$OUT/gemm-small-n" || rc=1
  return $rc
}
stage_small_tiles_sweep() {
  run_bench bench_w4a8_cuda_tiles 560 python3 scripts/bench_w4a8_cuda.py --shapes 4096x4096 14336x4096 \
    8192x10240 --ms 256 64 128 --splits-sweep --group 128 --out "$OUT/tiles_sweep.json"
}
# The decode kernels (M <= 32) x K splits on every Llama layer shape, Marlin beside them: the
# data of the decode plan (csrc/gemm/NOTES.md, "Decode plan")
# (DECODE_SWEEP_SHAPES / DECODE_SWEEP_MS narrow it, e.g. "8192x10240" and "16": issue #4's M <= 16 miss)
stage_decode_sweep() {
  run_bench bench_w4a8_cuda_decode 560 python3 scripts/bench_w4a8_cuda.py --shapes ${DECODE_SWEEP_SHAPES:-4096x6144 \
    4096x4096 4096x28672 14336x4096 8192x10240 8192x57344 28672x8192 8192x28672} --ms ${DECODE_SWEEP_MS:-1 16 32} \
    --splits-sweep --out "$OUT/decode_sweep.json"
}
# The decode plan after that sweep: the csrc GEMM tests, the auto pick against every forced
# kernel on the shapes whose plan changed (Marlin beside it, same run), then bench_gemm's
# L2-flushed table at M = 1 and 16 (ours, Marlin, Machete)
stage_decode_plan() {
  local rc=0
  pytest_gpu pytest-gpu-csrc-decode 120 tests/kernels/test_cuda_gemm.py || rc=1
  run_bench bench_w4a8_cuda_auto 200 python3 scripts/bench_w4a8_cuda.py --shapes 4096x4096 14336x4096 \
    4096x6144 8192x10240 28672x8192 --ms 1 16 --out "$OUT/decode_auto.json" || rc=1
  run_bench bench_gemm_decode 200 python3 benchmarks/bench_gemm.py --ms 1,16 \
    --shapes 4096x4096,14336x4096,4096x6144,4096x28672,8192x10240,28672x8192,8192x28672 \
    --methods ours_cuda,ours_cuda_gemm,marlin_w4a16,machete_w4a16 --out "$OUT/bench_gemm_decode" || rc=1
  return $rc
}
# Session 24: quantize_act in one pass, and the decode GEMM as a programmatic dependent launch
# (csrc/gemm/NOTES.md, "PDL"): the csrc tests, then every launch variant against the launch
# before (same run, Marlin beside it)
stage_gemm_launch() {
  local rc=0
  pytest_gpu pytest-gpu-csrc-launch 200 tests/kernels/test_cuda_gemm.py || rc=1
  run_bench bench_w4a8_cuda_launch 330 python3 scripts/bench_w4a8_cuda.py --shapes 4096x4096 14336x4096 \
    4096x6144 8192x28672 28672x8192 --ms 1 16 --launch-sweep --out "$OUT/launch_sweep.json" || rc=1
  return $rc
}
# bench_gemm's decode table with each L2 flush (ours with the launch defaults, Marlin, Machete)
stage_gemm_flush() {
  local rc=0 f
  for f in write read; do
    run_bench "bench_gemm_flush_$f" 200 python3 benchmarks/bench_gemm.py --ms 1,16 --flush $f \
      --shapes 4096x4096,14336x4096,4096x6144,4096x28672,8192x10240,28672x8192,8192x28672 \
      --methods ours_cuda,ours_cuda_gemm,marlin_w4a16,machete_w4a16 --out "$OUT/bench_gemm_flush_$f" || rc=1
  done
  return $rc
}
# The CUDA KV4 decode page kernel (csrc/attention/): its GPU tests, then the decode grid with
# the page kernel forced each way (bench_attention.py's -cuda / -triton methods), same run.
# CUDA_DECODE_BENCH_ARGS narrows the grid (default: batch 1 8 64 x ctx 1K 8K 32K).
stage_cuda_decode() {
  local rc=0
  # the prefetch distance that cuda_decode_tune found best on this host, unless one is set
  if [ -z "${MIXPREC_ATTN_CUDA_PREFETCH:-}" ] && [ -f /tmp/mixprec-cuda-prefetch ]; then
    export MIXPREC_ATTN_CUDA_PREFETCH=$(cat /tmp/mixprec-cuda-prefetch)
  fi
  log "MIXPREC_ATTN_CUDA_PREFETCH=${MIXPREC_ATTN_CUDA_PREFETCH:-default}"
  pytest_logged pytest-gpu-cuda-decode 240 tests/attention_backend/test_attn_cuda_decode.py || rc=1
  # shellcheck disable=SC2086
  run_bench bench_attention_cuda_decode 420 python3 benchmarks/bench_attention.py --rep-ms 100 \
    ${CUDA_DECODE_BENCH_ARGS:---batch 1 2 4 8 64 --ctx 1024 8192 32768} \
    --methods fa3-bf16 mixprec-kv4-triton mixprec-kv4-cuda mixprec-kv4-r16-triton mixprec-kv4-r16-cuda \
    --out "$OUT/cuda-decode" || rc=1
  return $rc
}
# The CUDA page kernel's knobs, each in its own run beside FA3: L2 prefetch distance
# (MIXPREC_ATTN_CUDA_PREFETCH) and the one-wave split cap (MIXPREC_ATTN_CUDA_WAVE=0 turns it off)
stage_cuda_decode_tune() {
  local rc=0 p
  for p in 0 4 8; do
    MIXPREC_ATTN_CUDA_PREFETCH=$p run_bench "bench_cuda_decode_prefetch$p" 150 python3 benchmarks/bench_attention.py \
      --rep-ms 100 --batch 8 64 --ctx 8192 32768 --methods fa3-bf16 mixprec-kv4-cuda \
      --out "$OUT/cuda-decode-prefetch$p" || rc=1
  done
  MIXPREC_ATTN_CUDA_WAVE=0 run_bench bench_cuda_decode_nowave 150 python3 benchmarks/bench_attention.py \
    --rep-ms 100 --batch 8 64 --ctx 8192 32768 --methods fa3-bf16 mixprec-kv4-cuda \
    --out "$OUT/cuda-decode-nowave" || rc=1
  # the fastest distance (sum of the kernel's times over the four shapes) for stage cuda_decode
  python3 - "$OUT" <<'PY' | tee "$OUT/cuda-decode-prefetch-best.txt"
import glob, json, sys
tot = {}
for f in glob.glob(f"{sys.argv[1]}/cuda-decode-prefetch*/attention-*.json"):
    p = int(f.split("cuda-decode-prefetch")[1].split("/")[0])
    rows = [r for r in json.load(open(f))["results"] if r["method"] == "mixprec-kv4-cuda"]
    if len(rows) == 4:
        tot[p] = sum(r["ms"] for r in rows)
print({p: round(t, 4) for p, t in sorted(tot.items())})
best = min(tot, key=tot.get) if tot else 0
open("/tmp/mixprec-cuda-prefetch", "w").write(str(best))
print("best prefetch", best)
PY
  return $rc
}
# Served: greedy generation through vLLM with the Triton and the CUDA KV4 decode page kernel
# (scripts/decode_impl_ab.py) on the A/B harness's 8-layer Llama-3-8B-shape W4A8 + KV4 checkpoint
stage_decode_impl_ab() {
  local ckpt=/tmp/mixprec-ab/llama3-8b-L8/mixprec-w4a8kv4-g64
  [ -d "$ckpt" ] || AB_LAYERS=8 AB_CKPTS=mixprec,mixprec-kv4 AB_BUDGET=200 bash scripts/gpu_ab.sh ckpt > "$OUT/ab-ckpt.log" 2>&1 \
    || { log "checkpoint build FAILED"; tail -20 "$OUT/ab-ckpt.log"; return 1; }
  timeout 400 python3 scripts/decode_impl_ab.py --model "$ckpt" --out "$OUT/decode-impl-ab" ${DECODE_AB_ARGS:-} 2>&1 | tail -40
  return "${PIPESTATUS[0]}"
}
# What changed since its last GPU run: ops.cpp's device checks (check_cuda; every csrc op's error
# paths are in test_cuda_gemm) and the CUDA-graph test helpers of attn_helpers
stage_rerun_refactors() {
  local rc=0
  pytest_logged pytest-gpu-cuda-decode 240 tests/attention_backend/test_attn_cuda_decode.py || rc=1
  pytest_gpu pytest-gpu-attn-graph 120 tests/attention_backend/test_attn_kernels.py -k graph || rc=1
  stage_test_csrc || rc=1
  return $rc
}
# vLLM's TRITON_ATTN with int4/int8_per_token_head over the issue's whole decode grid, beside FA3
# and ours (KV4 with the default page-kernel choice, KV8), in one run
stage_vllm_int_attn() {
  run_bench bench_attention_vllm_int 560 python3 benchmarks/bench_attention.py --rep-ms 100 \
    --batch 1 8 64 --ctx 1024 8192 32768 \
    --methods fa3-bf16 triton-int4 triton-int8 mixprec-kv4 mixprec-kv8 --out "$OUT/vllm-int"
}
stage_bench_attn() { run_bench bench_attention 420 python3 benchmarks/bench_attention.py --out "$OUT"; }
stage_bench() { stage_bench_gemm; stage_bench_attn; }
# BENCH_PREFILL_METHODS: the methods (default: FA3 and the two FlashAttention-based exact paths)
stage_bench_prefill() {
  # shellcheck disable=SC2086
  run_bench bench_attention_prefill 240 python3 benchmarks/bench_attention.py --prefill --rep-ms 60 \
    --methods ${BENCH_PREFILL_METHODS:-fa3-bf16 mixprec-kv4-flash mixprec-kv4-gather mixprec-kv8-flash mixprec-kv8-gather} \
    --out "$OUT"
}
stage_tune_attn() { run_bench bench_attention_tune 500 python3 benchmarks/bench_attention.py --tune --out "$OUT"; }
stage_tune_prefill() { run_bench bench_attention_tune_prefill 500 python3 benchmarks/bench_attention.py --tune-prefill --out "$OUT"; }
stage_diag() { timeout 300 bash scripts/diag_cxx_throw.sh 2>&1 | tee "$OUT/diag_cxx_throw.log" | tail -30; }
stage_profile() { OUT=$OUT timeout 400 bash scripts/profile_ncu.sh gemm attn 2>&1 | tail -20; }
stage_profile_decode_cold() { OUT=$OUT timeout 400 bash scripts/profile_ncu.sh decode-cold 2>&1 | tail -20; }
stage_profile_decode_stalls() { OUT=$OUT timeout 400 bash scripts/profile_ncu.sh decode-stalls 2>&1 | tail -20; }
stage_profile_decode_ceiling() { OUT=$OUT timeout 300 bash scripts/profile_ncu.sh decode-ceiling 2>&1 | tail -20; }
stage_profile_silu() { OUT=$OUT timeout 240 bash scripts/profile_ncu.sh silu 2>&1 | tail -5; }
stage_sanitize() { OUT=$OUT timeout 540 bash scripts/sanitize.sh cuda triton 2>&1 | tail -30; }

stage_e2e() {
  log "end to end: random-weight checkpoint -> vllm serve --quantization mixprec"
  timeout 500 python3 scripts/e2e_serve.py --out "$OUT" 2>&1 | tee "$OUT/e2e.log" | tail -40
  return "${PIPESTATUS[0]}"
}

# Load on loopback (issue #7): $OUT/load.json, $OUT/serve-load.log; LOAD_BUDGET (540) s inside, the timeout is a backstop
stage_load() {
  log "load on loopback: vllm serve W4A8 + KV4, 256 concurrent streams x 3 rounds"
  local budget=${LOAD_BUDGET:-540}
  timeout $((budget + 40)) python3 scripts/load_serve.py --out "$OUT" --budget "$budget" 2>&1 | tee "$OUT/load.log" | tail -40
  return "${PIPESTATUS[0]}"
}

# TP=2 against TP=1 (issue #7), on nvidia-h100-x2 or nvidia-h200-x2: greedy tokens of random-weight
# Llama and Qwen2 shapes (scripts/tp_check.py). Two models a call: each needs 2 vLLM starts
# (session 13: llama-kv4 + qwen2-none took 452 s).
stage_tp() { run_tp llama-none,qwen2-none; }
stage_tp_kv4() { run_tp llama-kv4,qwen2-kv4; }
stage_tp_control() { run_tp llama-bf16,qwen2-bf16; }  # vLLM's own TP on the unquantized models
# TP=2 with the row maxima all-gathered (MIXPREC_TP_ACT_SCALE=global: TP=1's activation codes) on
# the Qwen2 shape, which rank scales left 0 of 8 identical (session 13; the bf16 control 4 of 8)
stage_tp_global() {
  OUT=$OUT/tp-global MIXPREC_TP_ACT_SCALE=global run_tp "${TP_GLOBAL_MODELS:-qwen2-none}"
}
# Session 26's NaN at TP=2 on qwen2-none (docs/RELIABILITY.md): which variant has it (vLLM's own
# TP on the bf16 model, ours eager / compiled without graphs), with every rank's modules hooked
# in the eager ones (scripts/diag_tp_nan.py)
stage_tp_nan_locate() {
  mkdir -p "$OUT/tp-nan"
  log "diag_tp_nan ($(python3 -c 'import torch; print(torch.cuda.device_count())') GPUs)"
  timeout "${TP_TIMEOUT:-580}" python3 scripts/diag_tp_nan.py --out "$OUT/tp-nan" \
    ${DIAG_VARIANTS:+--variants "$DIAG_VARIANTS"} 2>&1 | grep -v -E '^(INFO|WARNING)' | tail -20
  return "${PIPESTATUS[0]}"
}
# Session 27: TP=2 with the default per-rank scale through tp_check (a fresh compile cache),
# then MIXPREC_TP_ACT_SCALE=global's TP=2 child eager, its NaN count printed
stage_tp_split() {
  local rc=0
  rm -rf /root/.cache/vllm/torch_compile_cache
  OUT=$OUT/tp-rank run_tp qwen2-none || rc=1
  mkdir -p "$OUT/tp-global-eager"
  log "MIXPREC_TP_ACT_SCALE=global, TP=2, eager"
  TP_CHECK_EAGER=1 MIXPREC_TP_ACT_SCALE=global NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0 timeout 200 python3 scripts/tp_check.py \
    --child /tmp/mixprec-tp/qwen2-w4a8-none 2 none "$OUT/tp-global-eager/tp2.json" \
    > "$OUT/tp-global-eager/child.log" 2>&1 || rc=1
  python3 - "$OUT/tp-global-eager/tp2.json" <<'PY' || rc=1
import json, math, sys
r = json.load(open(sys.argv[1]))
bad = sum(any(not math.isfinite(v) for t in p["top"] for v in t.values()) for p in r)
print("global eager TP=2 nonfinite prompts:", bad, "of", len(r))
PY
  return $rc
}
# Session 28, what #7 still lacked. Host 1: the global scale compiled at TP=2 after session 27's
# fix (an empty compile cache), then the default scale on llama-none; qwen2-kv4 in a call of its own
stage_tp_rest_a() {
  local rc=0
  rm -rf /root/.cache/vllm/torch_compile_cache
  OUT=$OUT/tp-global TP_TIMEOUT=290 MIXPREC_TP_ACT_SCALE=global run_tp qwen2-none || rc=1
  OUT=$OUT/tp-rank TP_TIMEOUT=290 run_tp llama-none || rc=1
  return $rc
}
stage_tp_rest_b() { OUT=$OUT/tp-rank TP_TIMEOUT=560 run_tp qwen2-kv4; }
# Host 2, after the 22 Qwen part stashes and `gpu_models.sh assemble`: the real Qwen's RTN W4A8
# export at TP=1 and TP=2 with the global scale, greedy tokens and lcet10's perplexity
real_tp_args() {  # tp_check's arguments for the real Qwen and its lcet10 perplexity
  local m=${MIXPREC_MODELS:-/root/mixprec-models}
  echo "--real $m/models/qwen2.5-coder-1.5b --ppl-text $m/text/lcet10.txt"
}
stage_tp_real_global() {
  OUT=$OUT/tp-real-global MIXPREC_TP_ACT_SCALE=global TP_ARGS="$(real_tp_args)" \
    run_tp "${TP_REAL_MODELS:-real-none}"
}
# The same with MIXPREC_TP_REDUCE=exact (the integer dot products all-reduced: TP=1's output bit
# for bit, kernels.tp_reduce); TP_REAL_MODELS=real-none,real-kv4 adds KV4
stage_tp_real_exact() {
  OUT=$OUT/tp-real-exact MIXPREC_TP_ACT_SCALE=global MIXPREC_TP_REDUCE=exact TP_ARGS="$(real_tp_args)" \
    run_tp "${TP_REAL_MODELS:-real-none}"
}
# The exact reduction's clean verdict, on one host: TP=1 vs TP=2 eager (no Inductor: every op
# rounds as eager does), then compiled with TORCHINDUCTOR_DETERMINISTIC=1 (no timing-picked
# reduction configs), then the compiled TP=1 control; ~4 + 5 + 4 min, one call each:
# TP_REAL_EXACT_PART=eager|det|control (and session 30's first|casts)
stage_tp_real_exact_verdict() {
  local part=${TP_REAL_EXACT_PART:-eager} real
  real=$(real_tp_args)
  run_exact() { MIXPREC_TP_ACT_SCALE=global MIXPREC_TP_REDUCE=exact TP_ARGS="$real" run_tp real-none; }
  case $part in
    eager) OUT=$OUT/tp-real-exact-eager TP_CHECK_EAGER=1 run_exact ;;
    det) OUT=$OUT/tp-real-exact-det TORCHINDUCTOR_DETERMINISTIC=1 run_exact ;;
    control) OUT=$OUT/tp-real-control-det TORCHINDUCTOR_DETERMINISTIC=1 \
               TP_ARGS="--second-tp 1 $real" run_tp real-none ;;
    # Session 30: the eager TP=1 runs of one host agreed bit for bit except the host's first
    # vLLM process (ppl 21.2824 against 21.3172); run first on a fresh host, this pair says
    # whether the first process differs. The caches it leaves behind are listed.
    first) OUT=$OUT/tp-real-first-eager TP_CHECK_EAGER=1 TP_ARGS="--second-tp 1 $real" run_tp real-none
           du -s ~/.triton ~/.nv ~/.cache/* 2>/dev/null > "$OUT/caches-after-first.txt" ;;
    # Inductor keeps a fused kernel's intermediates in fp32 where eager rounds each op to bf16;
    # at TP=2 the collectives make it store (round) the down projection's input before it is
    # quantized, at TP=1 it need not. Emulating eager's casts should remove that difference.
    casts) OUT=$OUT/tp-real-exact-casts TORCHINDUCTOR_DETERMINISTIC=1 TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1 \
             run_exact ;;
    *) log "TP_REAL_EXACT_PART=$part: expected eager, det, control, first or casts"; return 2 ;;
  esac
}
# The run-to-run control: the real model at TP=1 twice, each compiled afresh (tp_check --second-tp 1)
stage_tp_real_control() {
  OUT=$OUT/tp-real-control TP_ARGS="--second-tp 1 $(real_tp_args)" run_tp "${TP_REAL_MODELS:-real-none}"
}
# The GPU tests of the epilogue MIXPREC_TP_REDUCE=exact runs after its all-reduce
stage_tp_epilogue_tests() {
  mkdir -p "$OUT/tp-epilogue"
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cuda_gemm.py \
    tests/kernels/test_triton_gemm.py -k epilogue 2>&1 | tee "$OUT/tp-epilogue/pytest.log" | tail -5
  return "${PIPESTATUS[0]}"
}
stage_sanitize_cuda() { OUT=$OUT timeout 400 bash scripts/sanitize.sh cuda 2>&1 | tail -30; }
# Random-weight models with it (their TP=1 top-2 gaps are <= 0.11: any rounding shows)
stage_tp_exact() { OUT=$OUT/tp-exact MIXPREC_TP_ACT_SCALE=global MIXPREC_TP_REDUCE=exact run_tp "${TP_EXACT_MODELS:-qwen2-none}"; }
run_tp() {  # MODELS; $OUT may be a stage's own subfolder
  mkdir -p "$OUT"
  log "TP=2 vs TP=1 on $1 ($(python3 -c 'import torch; print(torch.cuda.device_count())') GPUs)"
  timeout "${TP_TIMEOUT:-580}" python3 scripts/tp_check.py --out "$OUT" --models "$1" ${TP_ARGS:-} 2>&1 | grep -v -E '^(INFO|WARNING)' \
    | tee "$OUT/tp-$1.log" | tail -20
  return "${PIPESTATUS[0]}"
}

# Session 31: the wgmma kernels as programmatic dependent launches. Their tests (PDL on/off
# bit-identical after quantize_act, every tile and split), then session 30's unrun W4Ax Triton
# changes (the half-integer 4-bit grid) and the epilogue op on the device.
stage_wgmma_pdl_tests() {
  pytest_gpu pytest-gpu-wgmma-pdl 420 tests/kernels/test_cuda_gemm.py tests/kernels/test_cuda_gemm_wgmma.py \
    tests/kernels/test_triton_gemm.py tests/kernels/test_act_quant_fusion.py
}
# PDL on/off for every M (CUDA graphs, weights rotated past the L2, no flush), all variants in
# one run; then issue #4's table (do_bench's L2 flush) with cuBLAS and _int_mm beside Marlin
stage_wgmma_pdl_bench() {
  local rc=0
  run_bench bench_w4a8_cuda_pdl 300 python3 scripts/bench_w4a8_cuda.py --shapes 4096x4096 4096x6144 \
    14336x4096 8192x10240 8192x28672 --ms 64 256 1024 --group 128 --launch-sweep --out "$OUT/launch_sweep_wgmma.json" || rc=1
  run_bench bench_gemm_targets 280 python3 benchmarks/bench_gemm.py --ms 64,256,1024,4096 \
    --shapes 4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,28672x8192,8192x28672 \
    --methods ours_cuda,ours_cuda_gemm,marlin_w4a16,cublas_bf16,int8_mm --out "$OUT/gemm-targets" || rc=1
  return $rc
}
# After the quantizer's one-pass rule (rows over 8192 elements: two-pass above 128 rows): its
# tests, the quantizer A/B at the rows it moved, then issue #4's whole table (M = 1 to 4096, every
# Llama shape, every baseline, do_bench's L2 flush) in one run
stage_gemm_table() {
  local rc=0
  pytest_gpu pytest-gpu-quant 200 tests/kernels/test_cuda_gemm.py -k "quantize or launch_options" || rc=1
  run_bench bench_w4a8_cuda_quant 200 python3 scripts/bench_w4a8_cuda.py --shapes 14336x4096 28672x8192 \
    --ms 64 128 256 1024 --group 128 --launch-sweep --no-marlin --out "$OUT/launch_sweep_quant.json" || rc=1
  stage_issue_table || rc=1
  return $rc
}
stage_issue_table() {
  run_bench bench_gemm_table 400 python3 benchmarks/bench_gemm.py --ms 1,16,64,256,1024,4096 \
    --shapes 4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,28672x8192,8192x28672 \
    --methods ours_cuda,ours_cuda_gemm,ours_cuda_gemm_xw,ours_cuda_quant,marlin_w4a16,machete_w4a16,cublas_bf16,int8_mm \
    --out "$OUT/gemm-table"
}
# Stream-K (session 32): the wgmma kernels' exactness with splits=-1 first, then every auto
# wgmma kernel as planned and as stream-K, and the auto GEMM/linear with the option off and on,
# on the 7 Llama shapes at M = 64..4096 (CUDA graphs, weights rotated past the L2).
stage_stream_k_tests() {
  pytest_gpu pytest-gpu-stream-k 420 tests/kernels/test_cuda_gemm_wgmma.py tests/kernels/test_cuda_gemm.py
}
stage_stream_k_sweep() {
  run_bench bench_w4a8_cuda_stream_k 420 python3 scripts/bench_w4a8_cuda.py --shapes 4096x6144 4096x4096 \
    4096x28672 14336x4096 8192x10240 28672x8192 8192x28672 --ms ${STREAM_K_MS:-256 1024} --group 128 \
    --stream-k-sweep --no-marlin --out "$OUT/stream_k_sweep.json"
}
# The auto plans alone (stream-K option off and on, GEMM and linear) at the M the sweep above
# leaves out (session 33: the planner's stream-K estimate was fitted at M = 256 and 1024).
stage_stream_k_auto() {
  run_bench bench_w4a8_cuda_stream_k_auto 420 python3 scripts/bench_w4a8_cuda.py --shapes 4096x6144 4096x4096 \
    4096x28672 14336x4096 8192x10240 28672x8192 8192x28672 --ms ${STREAM_K_MS:-64 4096} --group 128 \
    --stream-k-sweep --sk-kernels --no-marlin --out "$OUT/stream_k_auto.json"
}
# What session 33 left unmeasured with stream-K on by default: the auto plans (option off and on)
# at M between the fitted ones, and the 70B shapes at M = 64 (~300 s with the default M; then
# issue_table for issue #4's table with the default-on planner, and stream_k_sanitize).
stage_stream_k_verify() {
  local rc=0
  STREAM_K_MS="${STREAM_K_VERIFY_MS:-128 384 768}" stage_stream_k_auto || rc=1
  run_bench bench_w4a8_cuda_stream_k_auto_70b 120 python3 scripts/bench_w4a8_cuda.py --shapes 28672x8192 \
    8192x28672 --ms 64 --group 128 --stream-k-sweep --sk-kernels --no-marlin --out "$OUT/stream_k_auto_70b.json" || rc=1
  return $rc
}
# Session 34's refitted stream-K estimate: the auto plans, option off and on, where its picks
# differ from session 33's (4096x6144 at M = 64-384, 4096x4096 and 14336x4096 at M = 64,
# 28672x8192 at M = 768)
stage_stream_k_refit() {
  local rc=0
  run_bench bench_w4a8_cuda_stream_k_refit 200 python3 scripts/bench_w4a8_cuda.py \
    --shapes 4096x6144 4096x4096 14336x4096 --ms 64 128 384 --group 128 --stream-k-sweep --sk-kernels \
    --no-marlin --out "$OUT/stream_k_refit.json" || rc=1
  run_bench bench_w4a8_cuda_stream_k_refit_70b 100 python3 scripts/bench_w4a8_cuda.py --shapes 28672x8192 \
    --ms 768 --group 128 --stream-k-sweep --sk-kernels --no-marlin --out "$OUT/stream_k_refit_70b.json" || rc=1
  return $rc
}
# Session 42's refit out of sample: each wgmma kernel classic and stream-K (and the auto plan, the
# option off and on) at every shape x M whose pick the refit changed and no run timed
# (scripts/fit_stream_k.py lists them), plus the 8192x8192 rows session 42's sweep did not reach.
# One JSON per shape: sk_oos_KxN.json. About 6 minutes.
stage_stream_k_oos() {
  local rc=0 spec shape
  for spec in 18944x3584:64,160 13824x5120:160,320,640 8192x1024:192 5120x27648:320,384 5120x5120:512 \
              8192x8192:128,192,256; do
    shape=${spec%%:*}
    run_bench "sk_oos_$shape" 120 python3 scripts/bench_w4a8_cuda.py --no-marlin --group 128 --stream-k-sweep \
      --shapes "$shape" --ms $(echo "${spec#*:}" | tr ',' ' ') --out "$OUT/sk_oos_$shape.json" || rc=1
  done
  return $rc
}
# W4Ax at the shares the per-layer allocation gives (session 33's recipe on Qwen2.5-1.5B: qkv and
# o all 8-bit, gate_up all 4-bit, down 32 of 70 blocks at 8 bits; 64-point rotation halves), on
# Qwen2.5-1.5B's and Llama-3-8B's shapes, beside W4A8 (csrc and Triton) and Marlin.
# W4AX_ALLOC_SPECS "share:shapes ..." sets other shares (session 45: layer-blocks, the CLI default),
# W4AX_ALLOC_METHODS the bench's methods.
stage_w4ax_alloc() {
  local rc=0 share shapes
  local methods=${W4AX_ALLOC_METHODS:-ours_cuda,ours_triton_q,ours_w4ax_triton_q,ours_w4ax_rot_triton_q,ours_w4ax_rot_torch_triton_q,marlin_w4a16}
  local specs=${W4AX_ALLOC_SPECS:-"1.0:1536x2048,1536x1536,4096x6144,4096x4096 0.0:1536x17920,4096x28672 0.457:8960x1536,14336x4096"}
  for spec in $specs; do
    share=${spec%%:*}; shapes=${spec#*:}
    mkdir -p "$OUT/w4ax-alloc-$share"
    run_bench "bench_gemm_w4ax_$share" 240 python3 benchmarks/bench_gemm.py --shapes "$shapes" \
      --ms 1,16,256,1024 --methods $methods --w4ax-a8-share "$share" --w4ax-rotation hadamard64 \
      --out "$OUT/w4ax-alloc-$share" || rc=1
  done
  return $rc
}
# The W4Ax quantizer's A-B-A over one bench_gemm.py tuning option: NAME OPTION SHAPES MS VALUE...;
# the linear with and without rotation, and the quantizer alone, on all-4-bit rows.
w4ax_quant_aba() {
  local name=$1 option=$2 shapes=$3 ms=$4 rc=0 r i=0
  shift 4
  for r in "$@"; do
    i=$((i + 1))
    mkdir -p "$OUT/$name-$i-$r"
    run_bench "bench_${name//-/_}_$i-$r" 200 python3 benchmarks/bench_gemm.py --shapes "$shapes" --ms "$ms" \
      --methods ours_w4ax_triton_q,ours_w4ax_quant,ours_w4ax_rot_triton_q,ours_w4ax_rot_quant --w4ax-a8-share 0.0 \
      --w4ax-rotation hadamard64 "$option" "$r" --out "$OUT/$name-$i-$r" || rc=1
  done
  return $rc
}
# Session 67: how many rotated 4-bit blocks the W4Ax quantizer holds in one pass
# (gemm.ROTATED_CHUNK_BLOCKS), A-B-A (W4AX_ROT_CHUNKS), on all-4-bit down projections: Llama-3-8B's
# (112 blocks: two passes at 64, one at 128), Qwen2.5-1.5B's (70: the same) and Llama-3-70B's (224:
# two passes either way).
stage_w4ax_rot_chunks() {
  # shellcheck disable=SC2086  # the values are words
  w4ax_quant_aba w4ax-rot-chunks --w4ax-rotated-chunk-blocks 8960x1536,14336x4096,28672x8192 \
    1,16,256,1024 ${W4AX_ROT_CHUNKS:-64 128 64}
}
# Session 68: the W4Ax quantizer's rows split over programs of R blocks at every M (bench_gemm
# --w4ax-split-blocks; 0 is one program a row, session 67's), A-B-A over W4AX_SPLITS, after its GPU
# tests, on QKV and the 8B and 70B down projections: the check of gemm.w4ax_split_blocks_for.
stage_w4ax_split() {
  local rc=0
  [ -n "${W4AX_SPLIT_SKIP_TESTS:-}" ] || pytest_gpu pytest-w4ax-split 300 tests/kernels/test_triton_gemm.py -k w4ax || rc=1
  # shellcheck disable=SC2086
  w4ax_quant_aba w4ax-split --w4ax-split-blocks "${W4AX_SPLIT_SHAPES:-4096x6144,14336x4096,28672x8192}" \
    "${W4AX_SPLIT_MS:-1,16,64,256,1024,4096}" ${W4AX_SPLITS:-8 0 8} || rc=1
  return $rc
}
# Session 71: the W4Ax quantizer over its input permutation's forms (bench_gemm --w4ax-perm), A-B-A:
# whole blocks moved as a block table (a --a8-select blocks layer, the default, since session 71),
# the same as its [K] channel table (the kernel's read before), and any channel anywhere
# (--a8-select channels; every W4Ax table before session 71 timed this one).
stage_w4ax_perm() {
  # shellcheck disable=SC2086
  w4ax_quant_aba w4ax-perm --w4ax-perm "${W4AX_PERM_SHAPES:-4096x6144,14336x4096,28672x8192}" \
    "${W4AX_PERM_MS:-1,16,256,1024,4096}" ${W4AX_PERMS:-blocks blocks-as-channels channels blocks}
}
# Session 69: W4Ax compiled as vLLM compiles it, by default (the op before, then the opaque
# w4ax_linear: the Triton quantizer and GEMM) and traced (MIXPREC_W4AX_QUANT=traced: Inductor's
# 5-15 quantize kernels), against W4A8 compiled the same way (the csrc GEMM: after `build`), a
# quarter of the blocks at 8 bits. The kernel arm splits rows as gemm.w4ax_split_blocks_for says
# (session 70's default), or over W4AX_COMPILED_SPLIT blocks at every M (0: one program a row).
stage_w4ax_compiled() {
  # shellcheck disable=SC2086  # the values are words
  run_bench bench_compiled_w4ax 540 python3 benchmarks/bench_compiled_linear.py --compare w4ax \
    --out "$OUT/w4ax-compiled" --layers ${W4AX_COMPILED_LAYERS:-qkv gate_up down o_proj} \
    --ms ${W4AX_COMPILED_MS:-1 16 256 1024 4096} ${W4AX_COMPILED_SPLIT:+--w4ax-split-blocks "$W4AX_COMPILED_SPLIT"}
}
# The Triton W4Ax GEMM's tile configs at M = 256 and 1024 (bench_gemm.py --sweep over
# --sweep-method ours_w4ax_triton_q), all-8-bit and at 25 % 8-bit blocks (session 45)
stage_w4ax_sweep() {
  local rc=0 share
  for share in ${W4AX_SWEEP_SHARES:-1.0 0.25}; do
    mkdir -p "$OUT/w4ax-sweep-$share"
    run_bench "bench_gemm_w4ax_sweep_$share" 280 python3 benchmarks/bench_gemm.py \
      --shapes "${W4AX_SWEEP_SHAPES:-4096x4096,4096x28672,14336x4096}" --ms "${W4AX_SWEEP_MS:-256,1024}" \
      --methods ours_w4ax_triton_q,ours_triton_q --sweep --sweep-method ours_w4ax_triton_q \
      --w4ax-a8-share "$share" --rep-ms 30 --out "$OUT/w4ax-sweep-$share" || rc=1
  done
  return $rc
}
# The Triton W4A8 GEMM's tile configs past 64 tokens (bench_gemm.py --sweep, the GEMM alone), the
# data that gemm.LARGE_M_TILES was set from (session 75, H100; benchmarks/NOTES-gemm.md, "Tile choices").
stage_triton_tiles() {
  mkdir -p "$OUT/triton-tiles"
  run_bench bench_gemm_triton_tiles 420 python3 benchmarks/bench_gemm.py \
    --shapes "${TRITON_TILES_SHAPES:-4096x6144,14336x4096,8192x28672}" --ms "${TRITON_TILES_MS:-256,1024,4096}" \
    --methods ours_triton,marlin_w4a16 --sweep --sweep-method ours_triton --rep-ms 30 --out "$OUT/triton-tiles"
}
# Session 79: the Triton GEMMs' 33-64-token tiles (session 78) through the linear (quantizer +
# GEMM) against Marlin and the csrc linear; then the whole Triton GEMM file's GPU tests.
stage_triton_mid_linear() {
  mkdir -p "$OUT/triton-mid-linear"
  run_bench bench_gemm_triton_mid_linear 420 python3 benchmarks/bench_gemm.py \
    --shapes "${TRITON_TILES_SHAPES:-4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,28672x8192,8192x28672}" \
    --ms "${TRITON_TILES_MS:-40,48,64}" \
    --methods ours_triton_q,ours_w4ax_triton_q,ours_cuda,marlin_w4a16 --out "$OUT/triton-mid-linear"
}
stage_test_triton_gemm() { pytest_gpu pytest-gpu-triton-gemm 560 tests/kernels/test_triton_gemm.py; }
# Session 79: the Triton quantize_act's rows split over programs (as silu_mul_quantize_act's) against
# one program a row, then both ops' long-row GPU tests.
stage_triton_quant_rows() {
  local rc=0
  run_bench bench_triton_quantize_act 200 python3 scripts/bench_triton_quantize_act.py --out "$OUT" || rc=1
  pytest_gpu pytest-gpu-quantize-long-rows 200 tests/kernels/test_triton_gemm.py -k "quantize_act" || rc=1
  return $rc
}
# Session 80: the csrc quantize_act's rows split over CTAs (act_quant_split; 0 never, 1 the rule,
# 1024 / 2048 / 4096 forced chunks; A-B-A with 0 last): its GPU tests, the quantizer alone
# (rows in L2), then the linear (no flush, weights rotated past the L2).
stage_quant_split() {
  local rc=0
  pytest_gpu pytest-gpu-quant-split 300 tests/kernels/test_cuda_gemm.py tests/kernels/test_gemm_plan.py \
    -k "quantize or launch_options" || rc=1
  run_bench bench_quant_split 200 python3 scripts/bench_w4a8_cuda.py --quant-only \
    --shapes ${QUANT_SPLIT_KS:-4096x1 8192x1 11008x1 14336x1 28672x1} --ms ${QUANT_SPLIT_MS:-1 4 8 16 32 64} \
    --option-ab act_quant_split --out "$OUT/quant_split.json" || rc=1
  run_bench bench_quant_split_linear 300 python3 scripts/bench_w4a8_cuda.py --auto-only --no-marlin --group 128 \
    --shapes ${QUANT_SPLIT_SHAPES:-4096x6144 8192x10240 14336x4096 28672x8192 8192x28672} \
    --ms ${QUANT_SPLIT_LINEAR_MS:-1 8 16 32} --option-ab act_quant_split --out "$OUT/quant_split_linear.json" || rc=1
  return $rc
}
# Session 80: issue #4's rows at M = 1 / 16 / 64 under the write flush, the quantizer's split rule off,
# on (the default), off again (MIXPREC_ACT_QUANT_SPLIT is read when the extension loads).
stage_quant_split_table() {
  env_arms_table split-table MIXPREC_ACT_QUANT_SPLIT "0 1 0" "${QUANT_SPLIT_TABLE_MS:-1,16,64}" \
    ours_cuda,ours_cuda_gemm,ours_cuda_quant,marlin_w4a16
}
# bench_gemm.py (write flush) on issue #4's seven shapes once an arm, each arm with VAR set to the
# next of VALUES (an A-B-A when a value repeats): NAME VAR "VALUES" MS METHODS; $OUT/NAME-i:value/.
env_arms_table() {
  local name=$1 var=$2 values=$3 ms=$4 methods=$5 rc=0 i=0 v
  for v in $values; do
    i=$((i + 1))
    mkdir -p "$OUT/$name-$i:$v"
    run_bench "bench_${name//-/_}_$i" 200 env "$var=$v" python3 benchmarks/bench_gemm.py --ms "$ms" \
      --shapes ${ENV_ARMS_SHAPES:-4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,28672x8192,8192x28672} \
      --methods "$methods" --out "$OUT/$name-$i:$v" || rc=1
  done
  return $rc
}
# Session 81: what the decode GEMM can do while the quantizer runs (the linear's chain), under the
# write flush. First the GPU tests of the quantizer and the launch options (decode_chain_tests); then the
# weight preload at M = 9-16 in the 2-CTA builds (decode_preload_max_m 16 / 32 / 16; it lost).
stage_decode_chain_tests() {
  local rc=0
  pytest_gpu pytest-gpu-launch-options 300 tests/kernels/test_cuda_gemm.py tests/kernels/test_gemm_plan.py \
    -k "quantize or launch_options" || rc=1
  pytest_gpu pytest-gpu-triton-split-rows 200 tests/kernels/test_triton_gemm.py -k "quantize_act or split_rows" || rc=1
  return $rc
}
stage_decode_chain_preload() {
  env_arms_table preload-table MIXPREC_GEMM_DECODE_PRELOAD_MAX_M "16 32 16" "${PRELOAD_TABLE_MS:-12,16}" \
    ours_cuda,ours_cuda_gemm,marlin_w4a16
}
# Any variable's arms the same way: ENV_ARMS_VAR, ENV_ARMS_VALUES, ENV_ARMS_MS (default 1,16),
# ENV_ARMS_METHODS (default the linear, the GEMM, Marlin W4A16), ENV_ARMS_NAME (default env-arms).
# Session 81 timed the retired decode_prefetch_chunks option so (benchmarks/results/2026-12-06-s81/).
stage_env_arms() {
  env_arms_table "${ENV_ARMS_NAME:-env-arms}" "$ENV_ARMS_VAR" "$ENV_ARMS_VALUES" "${ENV_ARMS_MS:-1,16}" \
    "${ENV_ARMS_METHODS:-ours_cuda,ours_cuda_gemm,marlin_w4a16}"
}
# Session 80: the Triton W4A8 linear at 1-32 tokens on session 79's tiles and split quantizer,
# beside its GEMM alone and Marlin (write flush).
stage_triton_decode_linear() {
  mkdir -p "$OUT/triton-decode-linear"
  run_bench bench_gemm_triton_decode_linear 300 python3 benchmarks/bench_gemm.py \
    --shapes "${TRITON_TILES_SHAPES:-4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,8192x57344,28672x8192,8192x28672}" \
    --ms "${TRITON_TILES_MS:-1,16,32}" --methods ours_triton,ours_triton_q,marlin_w4a16 --out "$OUT/triton-decode-linear"
}
# Session 76: the same sweep for the W4Ax GEMM alone (block_k <= 128: one activation block's scale
# a k-step), at M = 16-4096 on the 8B shapes, beside its quantizer + GEMM at the default tile.
stage_triton_tiles_w4ax() {
  mkdir -p "$OUT/triton-tiles-w4ax"
  run_bench bench_gemm_triton_tiles_w4ax 560 python3 benchmarks/bench_gemm.py \
    --shapes "${TRITON_TILES_SHAPES:-4096x6144,4096x4096,4096x28672,14336x4096}" \
    --ms "${TRITON_TILES_MS:-16,128,256,512,1024,4096}" \
    --methods ours_w4ax_triton,ours_w4ax_triton_q,marlin_w4a16 --sweep --sweep-method ours_w4ax_triton \
    --rep-ms 25 --out "$OUT/triton-tiles-w4ax"
}
# Session 46: the one-pass quantizer's lean arithmetic (act_quant_lean, on by default: 1 / scale,
# the division only near half-integers; the same codes) against its per-element division: the
# quantizer's GPU tests, the quantizer alone and the linear, then issue #4's M = 256 / 1024 rows.
stage_quant_lean() {
  local rc=0
  pytest_gpu pytest-gpu-quant-lean 240 tests/kernels/test_cuda_gemm.py -k "quantize or launch_options" || rc=1
  run_bench bench_quant_lean 150 python3 scripts/bench_w4a8_cuda.py --quant-only \
    --shapes 4096x6144 8192x10240 14336x4096 --ms 1 16 64 256 1024 4096 \
    --option-ab act_quant_lean --out "$OUT/quant_lean.json" || rc=1
  run_bench bench_quant_lean_linear 200 python3 scripts/bench_w4a8_cuda.py --auto-only \
    --shapes 4096x6144 4096x4096 14336x4096 --ms 64 256 1024 --group 128 \
    --option-ab act_quant_lean --out "$OUT/quant_lean_linear.json" || rc=1
  stage_mid_table || rc=1
  return $rc
}
# Session 47: the cluster pair (splits=-2: two K halves a tile in a cluster of 2 CTAs, summed in
# shared memory): the GPU tests, then the auto plan and linear with the planner's pair option off
# and on, in one run.
stage_cluster_pair() {
  local rc=0
  pytest_gpu pytest-gpu-pair 300 tests/kernels/test_cuda_gemm_wgmma.py tests/kernels/test_cuda_gemm.py || rc=1
  run_bench bench_pair 300 python3 scripts/bench_w4a8_cuda.py --no-marlin --auto-only --group 128 \
    --option-ab gemm_cluster_pair --shapes ${PAIR_SHAPES:-4096x6144 4096x4096 14336x4096 8192x10240 28672x8192} \
    --ms ${PAIR_MS:-128 192 256 512} --out "$OUT/pair.json" || rc=1
  return $rc
}
# Session 48: kernel 4 where a pair launch runs whole tiles first (more tiles than half the SMs):
# as planned without the pair, as stream-K, as a pair, and the auto plans, in one run.
stage_pair_tail() {
  run_bench bench_pair_tail 300 python3 scripts/bench_w4a8_cuda.py --no-marlin --group 128 --kernels 4 --pair \
    --stream-k-sweep --sk-kernels 4 --shapes ${PAIR_SHAPES:-4096x6144 4096x4096 14336x4096 28672x8192} \
    --ms ${PAIR_MS:-768 1024 1536} --out "$OUT/pair_tail.json"
}
# Session 49: does the decode GEMM's no-flush time owe its lead to the programmatic dependent
# launch overlapping back-to-back GEMMs of the bench's graph? (H100: a read flush slowed ours
# +14 %, Marlin +5 %.) gemm_pdl off and on without a flush, then bench_gemm's read flush with
# the option off and on at load, one host.
stage_decode_pdl() {
  local rc=0 pdl shapes="4096x4096 14336x4096 8192x10240 8192x28672 28672x8192"
  run_bench bench_w4a8_cuda_decode_pdl 200 python3 scripts/bench_w4a8_cuda.py --shapes $shapes --ms 1 16 \
    --group 128 --auto-only --no-marlin --option-ab gemm_pdl --out "$OUT/decode_pdl.json" || rc=1
  for pdl in 0 1; do
    run_bench "bench_gemm_read_pdl$pdl" 150 env MIXPREC_GEMM_PDL=$pdl python3 benchmarks/bench_gemm.py --ms 1,16 \
      --flush read --shapes "${shapes// /,}" --methods ours_cuda,ours_cuda_gemm,marlin_w4a16 \
      --out "$OUT/bench_gemm_read_pdl$pdl" || rc=1
  done
  return $rc
}
# Session 49: the pair's partial sums pulled from the peer (plain) against pushed into it
# (wgmma_pair_push, sessions 47-48). pair_pull: the GPU tests, memcheck and racecheck on 15 pair
# tests, and the plain build's auto plans with the pair option off and on; pair_pull_ab (next
# call, same host): the same bench for the push build, then the plain one again (A-B-A).
pair_pull_bench() {  # VARIANTS
  WGMMA_DIAG_VARIANTS="$1" WGMMA_DIAG_BENCH_ARGS="--option-ab gemm_cluster_pair" \
    WGMMA_DIAG_SHAPES="${PAIR_SHAPES:-4096x4096 14336x4096 28672x8192}" \
    WGMMA_DIAG_MS="${PAIR_MS:-256 768}" stage_wgmma_diag
}
stage_pair_pull() {
  local rc=0
  pytest_gpu pytest-gpu-pair 300 tests/kernels/test_cuda_gemm_wgmma.py tests/kernels/test_cuda_gemm.py || rc=1
  stage_cluster_pair_sanitize || rc=1
  pair_pull_bench plain || rc=1
  return $rc
}
stage_pair_pull_ab() { pair_pull_bench "wgmma_pair_push plain"; }
# compute-sanitizer on cluster-pair launches (the shared::cluster exchange included)
stage_cluster_pair_sanitize() {
  local rc=0 tool
  for tool in memcheck racecheck; do
    log "compute-sanitizer --tool $tool: cluster pair"
    timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/kernels/test_cuda_gemm_wgmma.py -k "cluster_pair_integer_exact and (65-208-576 or 192-272-8192 or 1100-1040-576)" \
      > "$OUT/sanitize-pair-$tool.log" 2>&1 || rc=1
    tail -3 "$OUT/sanitize-pair-$tool.log"
  done
  return $rc
}
# Sessions 48-49: racecheck on one pair test per kernel, with the programmatic dependent launch on
# and off, for the plain build (session 49: the partial sums pulled from the peer) and each diag
# patch of PAIR_RACECHECK_VARIANTS (wgmma_pair_push: the sums pushed into the peer, as in sessions
# 47-48, which racecheck reported): the hazard counts per (variant, kernel, PDL) in
# pair-racecheck-split.txt.
stage_pair_racecheck_split() {
  local v kernel pdl rc=0 tag
  : > "$OUT/pair-racecheck-split.txt"
  for v in ${PAIR_RACECHECK_VARIANTS:-plain wgmma_pair_push}; do
    if [ "$v" != plain ]; then build_variant "$v" "$OUT/rebuild.log" || return 1; fi
    for pdl in 1 0; do
      for kernel in 4 5 6 7 8; do
        tag="$v-k$kernel-pdl$pdl"
        MIXPREC_GEMM_PDL=$pdl timeout 120 compute-sanitizer --tool racecheck python3 -m pytest -q -m gpu \
          -p no:cacheprovider tests/kernels/test_cuda_gemm_wgmma.py \
          -k "cluster_pair_integer_exact and 65-208-576-$kernel" > "$OUT/pair-racecheck-$tag.log" 2>&1
        echo "$tag: $(grep -h -E 'RACECHECK SUMMARY|passed|failed' "$OUT/pair-racecheck-$tag.log" | tr '\n' ' ')" \
          >> "$OUT/pair-racecheck-split.txt"
      done
    done
    if [ "$v" != plain ]; then build_ext_90a "$OUT/rebuild.log" || rc=1; fi  # back to the plain build
  done
  cat "$OUT/pair-racecheck-split.txt"
  return $rc
}
# Does racecheck follow barrier.cluster? scripts/diag/racecheck_cluster_probe.cu's variants of the
# pair's exchange, each run plain (it checks its sums) and under racecheck (hazard counts).
stage_racecheck_probe() {
  local rc=0 v nvcc_bin
  nvcc_bin=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  "$nvcc_bin" -O2 -lineinfo -gencode=arch=compute_90a,code=sm_90a scripts/diag/racecheck_cluster_probe.cu \
    -o /tmp/racecheck_probe > "$OUT/racecheck-probe-build.log" 2>&1 || { log "probe build failed"; return 1; }
  { compute-sanitizer --version; compute-sanitizer --help | grep -i -A2 racecheck; } > "$OUT/racecheck-probe-tool.txt" 2>&1
  for v in push_cp push_st push_cg pull_cp racy mbar mbar_zero push_cp_y dyn4; do
    /tmp/racecheck_probe "$v" >> "$OUT/racecheck-probe.log" 2>&1 || { [ "$v" = racy ] || rc=1; }
    timeout 60 compute-sanitizer --tool racecheck /tmp/racecheck_probe "$v" \
      > "$OUT/racecheck-probe-$v.log" 2>&1
    echo "$v: $(grep -h 'RACECHECK SUMMARY' "$OUT/racecheck-probe-$v.log" || echo 'no summary')" >> "$OUT/racecheck-probe.log"
  done
  /tmp/racecheck_probe clusters > "$OUT/cluster-occupancy.txt" 2>&1 || rc=1
  cat "$OUT/racecheck-probe.log" "$OUT/cluster-occupancy.txt"
  return $rc
}
# The decode GEMM (M <= 32) on every Llama layer shape beside cuBLAS bf16 on the same shape (the
# HBM bandwidth a GEMV reaches), Marlin in the same run: issue #4's "80 % of HBM" on an H100.
# (Session 35's decode-ring stages are in commit 72ee91c; the option is gone.)
stage_decode_hbm() {
  run_bench bench_w4a8_cuda_decode_hbm 300 python3 scripts/bench_w4a8_cuda.py --shapes 4096x6144 4096x4096 \
    4096x28672 14336x4096 8192x10240 28672x8192 8192x28672 --ms ${DECODE_HBM_MS:-1 16} --group 128 \
    --cublas-gemv --out "$OUT/decode_hbm.json"
}
# Sessions 35-36: the decode GEMM's builds besides the default: unsigned weight bytes (decode_u8:
# u8 x s8 MMA, no XOR per weight byte) and 80 registers for 3 CTAs per SM (decode_ctas_per_sm=3,
# M <= 16), against the default in one run, after their GPU tests. decode_options_check: memcheck
# over every kernel including those builds, and ncu of each build at 8192x28672, M = 1.
stage_decode_options() {
  local rc=0
  pytest_gpu pytest-gpu-decode-options 200 tests/kernels/test_cuda_gemm.py \
    -k "options or llama70b or integer_exact or graph" || rc=1
  # (session 36's run hit a 300 s limit one shape short: 8192x28672)
  run_bench bench_w4a8_cuda_decode_options 400 python3 scripts/bench_w4a8_cuda.py --shapes 4096x6144 4096x4096 \
    4096x28672 14336x4096 8192x10240 28672x8192 8192x28672 --ms ${DECODE_OPTIONS_MS:-1 16} --group 128 \
    --decode-options-sweep --cublas-gemv --out "$OUT/decode_options.json" || rc=1
  return $rc
}
# Session 55: decode_dp4a (M = 1: IDP.4A on the 4-bit codes, no dequant, no MMA) after its GPU tests,
# off-on-off in one run on the 7 Llama rows under the planner's build (session 55's planner gave
# the option the 2-CTA build where the 3-CTA grid was over one wave; since session 56 the same
# build as without it), then again with the 2-CTA build forced.
stage_decode_dp4a() {
  local rc=0
  pytest_gpu pytest-gpu-decode-dp4a 200 tests/kernels/test_cuda_gemm.py \
    -k "dp4a or launch_options_bit_identical or llama70b or graph" || rc=1
  local bench=(python3 scripts/bench_w4a8_cuda.py --no-marlin --ms 1 --group 128 --option-ab decode_dp4a
    --shapes 4096x6144 4096x4096 4096x28672 14336x4096 8192x10240 28672x8192 8192x28672)
  run_bench bench_w4a8_cuda_decode_dp4a 200 "${bench[@]}" --cublas-gemv --out "$OUT/decode_dp4a.json" || rc=1
  MIXPREC_GEMM_DECODE_CTAS_PER_SM=2 run_bench bench_w4a8_cuda_decode_dp4a_c2 200 "${bench[@]}" \
    --out "$OUT/decode_dp4a_c2.json" || rc=1
  return $rc
}
# Session 56: the IDP.4A form's forced 3-CTA build, off-on-off, on the rows where session 55's
# planner gave decode_dp4a the 2-CTA build (N = 28672) or kept the 3-CTA one (8192x10240).
stage_decode_dp4a_c3() {
  MIXPREC_GEMM_DECODE_CTAS_PER_SM=3 run_bench bench_w4a8_cuda_decode_dp4a_c3 200 python3 scripts/bench_w4a8_cuda.py \
    --no-marlin --ms 1 --group 128 --option-ab decode_dp4a --shapes 4096x28672 8192x10240 8192x28672 \
    --out "$OUT/decode_dp4a_c3.json"
}
# Session 56's last call: the planner with decode_dp4a on (the 3-CTA build on the multi-wave rows
# again) after the dp4a GPU tests, off-on-off at M = 1 on the 7 Llama rows with cuBLAS's GEMV; the
# Marlin table; then the per-chunk form (session 55's) in the forced 3-CTA build on the N = 28672 rows.
stage_decode_dp4a_final() {
  local rc=0
  pytest_gpu pytest-gpu-decode-dp4a-final 200 tests/kernels/test_cuda_gemm.py -k "dp4a or llama70b or graph" || rc=1
  run_bench bench_w4a8_cuda_decode_dp4a_final 200 python3 scripts/bench_w4a8_cuda.py --no-marlin --ms 1 --group 128 \
    --option-ab decode_dp4a --shapes 4096x6144 4096x4096 4096x28672 14336x4096 8192x10240 28672x8192 8192x28672 \
    --cublas-gemv --out "$OUT/decode_dp4a_final.json" || rc=1
  stage_decode_table || rc=1
  stage_decode_dp4a_per_chunk_c3 || rc=1
  return $rc
}
# Session 58: the decode kernels with eight token tiles (kernels 0, 1 forced at M = 33-64) after
# their GPU tests, timed against the auto plan (tiled mma.sync at M = 33-63, wgmma from 64),
# wgmma kernel 7 forced and Marlin W4A16, on the Llama shapes (CUDA graphs, weights rotated past
# the L2, group 128).
stage_decode_m64() {
  local rc=0
  pytest_gpu pytest-gpu-decode-m64 240 tests/kernels/test_cuda_gemm.py -k "integer_exact" || rc=1
  run_bench bench_w4a8_cuda_decode_m64 330 python3 scripts/bench_w4a8_cuda.py --group 128 --kernels 0 1 7 \
    --ms ${DECODE_M64_MS:-32 40 48 64} \
    --shapes ${DECODE_M64_SHAPES:-4096x6144 4096x4096 4096x28672 14336x4096 8192x10240 28672x8192 8192x28672} \
    --out "$OUT/decode_m64.json" || rc=1
  return $rc
}
# Then the planner that takes the decode kernel at M = 33-64 where its grid is one wave (the wgmma
# kernels elsewhere): the csrc GEMM tests, and the auto GEMM and linear against Marlin W4A16.
stage_decode_m64_auto() {
  local rc=0
  stage_test_csrc || rc=1
  run_bench bench_w4a8_cuda_decode_m64_auto 240 python3 scripts/bench_w4a8_cuda.py --group 128 --auto-only \
    --ms ${DECODE_M64_MS:-40 48 64} \
    --shapes ${DECODE_M64_SHAPES:-4096x6144 4096x4096 4096x28672 14336x4096 8192x10240 28672x8192 8192x28672} \
    --out "$OUT/decode_m64_auto.json" || rc=1
  return $rc
}
# Session 59: 32 channels at M = 33-64 in two token groups (3 or 4 tiles a warp, no spill) after
# the decode GPU tests; kernels 0 (16 channels, eight token tiles), 1 (32, two groups) and 7
# forced beside the auto plan on the Llama shapes, no Marlin (session 58's run has it).
GROUPS_SHAPES="4096x6144 4096x4096 4096x28672 14336x4096 8192x10240 28672x8192 8192x28672"
groups_bench() {  # NAME TIMEOUT ARGS...: bench_w4a8_cuda.py at M = 40-64 on those shapes, to $OUT/NAME.json
  local name=$1 limit=$2; shift 2
  run_bench "bench_w4a8_cuda_$name" "$limit" python3 scripts/bench_w4a8_cuda.py --group 128 \
    --ms ${GROUPS_MS:-40 48 56 64} --shapes ${GROUPS_SHAPES_RUN:-$GROUPS_SHAPES} "$@" --out "$OUT/$name.json"
}
stage_decode_groups() {
  local rc=0
  pytest_gpu pytest-gpu-decode-groups 200 tests/kernels/test_cuda_gemm.py -k "integer_exact" || rc=1
  groups_bench decode_groups 330 --no-marlin --kernels 0 1 7 || rc=1
  return $rc
}
# Then the candidate with 16 channels in two token groups too (scripts/diag/decode_rows16_token_groups.patch):
# its decode tests and kernels 0 and 1 again, then the plain build back.
stage_decode_groups_rows16() {
  local rc=0
  build_variant decode_rows16_token_groups "$OUT/rebuild.log" || return 1  # the candidate's .so; the source is plain
  pytest_gpu pytest-gpu-decode-groups-rows16 200 tests/kernels/test_cuda_gemm.py -k "integer_exact and not dp4a" || rc=1
  groups_bench decode_groups_rows16 300 --no-marlin --kernels 0 1 || rc=1
  build_ext_90a "$OUT/rebuild.log" || rc=1
  return $rc
}
# Then the planner that takes them (32 channels where only their grid is one wave, to K = 4096):
# the csrc GEMM tests; the auto GEMM and linear against Marlin W4A16 on the Llama shapes; kernels 1
# and 7 at K = 8192 and 14336 on one-wave 32-channel grids (where the K limit should lie).
stage_decode_groups_auto() {
  local rc=0
  stage_test_csrc || rc=1
  groups_bench decode_groups_auto 300 --auto-only || rc=1
  run_bench bench_w4a8_cuda_decode_groups_k 120 python3 scripts/bench_w4a8_cuda.py --no-marlin --group 128 \
    --kernels 1 7 --ms 40 64 --shapes 8192x6144 8192x8192 14336x6144 14336x8192 \
    --out "$OUT/decode_groups_k.json" || rc=1
  return $rc
}
# A finer K limit for kernel 1 (32 channels, two token groups) at M = 33-64 where only its grid is
# one wave (K <= 4096 until session 61, from session 59's four-row probe): auto (the wgmma plan past
# K = 4096 then) and kernels 0, 1, 7 forced, K = 4096-12288 on N = 6144 and 8192.
stage_decode_k_sweep() {
  GROUPS_SHAPES_RUN="4096x8192 6144x6144 6144x8192 8192x6144 8192x8192 10240x6144 10240x8192 12288x6144 12288x8192" \
    groups_bench decode_k_sweep 330 --no-marlin --kernels 0 1 7
}
# Then the limit drawn from it (K x token tiles a group <= 32768): the csrc GEMM tests, and the auto
# GEMM and linear against Marlin W4A16 on the sweep's shapes whose plan it moved to kernel 1.
stage_decode_k_auto() {
  local rc=0
  stage_test_csrc || rc=1
  GROUPS_SHAPES_RUN="6144x6144 6144x8192 8192x6144 8192x8192 10240x6144 10240x8192" \
    groups_bench decode_k_auto 270 --auto-only || rc=1
  return $rc
}
# The per-chunk IDP.4A form (session 55's) in the forced 3-CTA build on the N = 28672 rows, plain
# (chunk pairs) before and after it (session 56 ran out of device time for it; session 57 ran it).
stage_decode_dp4a_per_chunk_c3() {
  local rc=0 v i=0
  for v in plain decode_dp4a_per_chunk plain; do
    i=$((i + 1))
    [ $i -gt 1 ] && { build_variant "$v" "$OUT/rebuild.log" || return 1; }
    MIXPREC_GEMM_DECODE_CTAS_PER_SM=3 run_bench "bench_w4a8_cuda_c3_${i}_$v" 200 python3 scripts/bench_w4a8_cuda.py \
      --no-marlin --ms 1 --group 128 --option-ab decode_dp4a --shapes 4096x28672 8192x28672 \
      --out "$OUT/c3_${i}_$v.json" || rc=1
  done
  return $rc
}
# The same builds x K splits (kernels 0 and 1) on the one shape that misses 1.2x Marlin at M <= 16
stage_decode_options_splits() {
  run_bench bench_w4a8_cuda_decode_options_splits 300 python3 scripts/bench_w4a8_cuda.py \
    --shapes ${DECODE_SWEEP_SHAPES:-8192x10240} --ms ${DECODE_SWEEP_MS:-1 16} --group 128 \
    --decode-options-sweep --splits-sweep --out "$OUT/decode_options_splits.json"
}
stage_decode_options_check() {
  local rc=0
  OUT=$OUT SANITIZE_TOOLS=memcheck timeout 150 bash scripts/sanitize.sh cuda 2>&1 | tail -4 || rc=1
  OUT=$OUT timeout 200 bash scripts/profile_ncu.sh gemm gemm-u8 gemm-c3 gemm-u8-c3 2>&1 | tail -12
  return $rc
}
# Session 36: the decode planner's build pick (2 or 3 CTAs per SM) on every Llama shape against
# the 2-CTA build it replaced, cuBLAS's GEMV and Marlin in the same run, after the GPU tests.
stage_decode_build() {
  local rc=0
  pytest_gpu pytest-gpu-decode-build 240 tests/kernels/test_cuda_gemm.py tests/kernels/test_gemm_plan.py || rc=1
  run_bench bench_w4a8_cuda_decode_build 300 python3 scripts/bench_w4a8_cuda.py --shapes 4096x6144 4096x4096 \
    4096x28672 14336x4096 8192x10240 28672x8192 8192x28672 --ms 1 16 --group 128 --option-ab decode_ctas_per_sm \
    --cublas-gemv --out "$OUT/decode_build.json" || rc=1
  return $rc
}
# Issue #4's bench_gemm table at M = 1 and 16 (do_bench's L2 flush, every baseline)
stage_decode_table() {
  run_bench bench_gemm_decode_table 300 python3 benchmarks/bench_gemm.py --ms 1,16 \
    --shapes 4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,28672x8192,8192x28672 \
    --methods ours_cuda,ours_cuda_gemm,marlin_w4a16,machete_w4a16,cublas_bf16 --out "$OUT/gemm-decode-table"
}
# The GEMM tests, then that table: the check of the final planner (session 36's last call)
stage_decode_table_tested() {
  local rc=0
  pytest_gpu pytest-gpu-decode-table 240 tests/kernels/test_cuda_gemm.py tests/kernels/test_gemm_plan.py || rc=1
  stage_decode_table || rc=1
  return $rc
}
# decode_preload_max_m (each decode warp reads its first weight batch before the PDL wait, at
# M <= the option) after its GPU tests: 0 (never), 8, 16 (the default) and 32, in one run, on the
# Llama shapes (DECODE_PRELOAD_SHAPES) at M = 1, 8, 16 (DECODE_PRELOAD_MS; session 36 prepared it,
# session 37 ran it). DECODE_PRELOAD_ARGS adds bench arguments, e.g. --auto-only --no-marlin.
stage_decode_preload() {
  local rc=0
  pytest_gpu pytest-gpu-decode-preload 200 tests/kernels/test_cuda_gemm.py -k "options or graph" || rc=1
  run_bench bench_w4a8_cuda_decode_preload 300 python3 scripts/bench_w4a8_cuda.py \
    --shapes ${DECODE_PRELOAD_SHAPES:-4096x6144 4096x4096 4096x28672 14336x4096 8192x10240 28672x8192 8192x28672} \
    --ms ${DECODE_PRELOAD_MS:-1 8 16} --group 128 --option-ab decode_preload_max_m ${DECODE_PRELOAD_ARGS:-} \
    --out "$OUT/decode_preload.json" || rc=1
  return $rc
}
# Issue #4's bench_gemm table at M = 1, 16 with the preload at every M, and memcheck with the preload cases.
stage_decode_preload_table() {
  local rc=0
  (export OUT=$OUT/preload-on MIXPREC_GEMM_DECODE_PRELOAD_MAX_M=32 && mkdir -p "$OUT" && stage_decode_table) || rc=1
  OUT=$OUT SANITIZE_TOOLS=memcheck timeout 150 bash scripts/sanitize.sh cuda 2>&1 | tail -4 || rc=1
  return $rc
}
# ncu of what issue #4's M = 256 and 1024 rows spend: the wgmma GEMM at M = 256 (4096 x 4096) and at
# M = 1024 (4096 x 6144, the cuBLAS miss), and quantize_act at M = 1024 (K = 4096)
stage_profile_mid() {
  OUT=$OUT timeout 280 bash scripts/profile_ncu.sh wgmma-m256 wgmma-m1024 quant-m1024 2>&1 | tail -8
}
# Where the wgmma GEMM's time goes, or an A/B of kernel code: the auto GEMM and the linear at
# M = 64 .. 4096 (WGMMA_DIAG_MS) on WGMMA_DIAG_SHAPES, built as the tree is ("plain") and rebuilt
# with scripts/diag/ patches applied, one variant at a time (WGMMA_DIAG_VARIANTS: each a patch name
# or names joined by "+"; a variant may repeat, to see the noise). The default variants are
# diagnostic builds (wrong results, timing only): the consumers only wait for and release each
# stage (feed only); the producer copies nothing (compute only); x copied in 16-byte units instead
# of the k-permuting 4-byte ones (x16); feed only with x16. Also in scripts/diag/, not in the
# default set: no weight or group-word copies (wgmma_no_w_copy) and no weight LDS, the consumers
# dequantising words made in registers (wgmma_no_w_lds): what the weights' trip through shared
# memory costs (session 39: 13-23 % of the GEMM; session 40: 7-13 % is the copies). The same A/B
# serves kernel changes (wgmma_w_cpasync: the weights by cp.async again in every kernel, against
# session 40's TMA; wgmma_w_tma_all: by TMA in kernel 7 too, where it lost 2.4-3 %;
# wgmma_k7_deep: kernel 7 with 12 stages, 1.2-3.9 % slower in session 42; sessions
# 38-40 ran a weight register ring, the decode GEMM's half-batch preload, per-row-tile bulk
# copies and an epilogue prefetch this way), with
# WGMMA_DIAG_BENCH_ARGS added to the bench (e.g. "--option-ab decode_preload_max_m").
# Variants named in WGMMA_DIAG_TEST also run the GEMM GPU tests (correct builds only). The sources
# are patched only while a variant builds; a variant is built only when it differs from the one
# before (plain, plain needs no build), and the plain build is left behind at the end.
# Builds csrc/ for sm_90a with the scripts/diag patches of VARIANT ('+'-joined; plain: none)
# applied, then puts the sources back; a failed build rebuilds the plain sources and returns 1.
build_variant() {  # VARIANT LOG
  local v=$1 log=$2 p patches rc=0
  patches=$(echo "$v" | tr '+' ' ')
  if [ "$v" != plain ]; then
    for p in $patches; do apply_patch "scripts/diag/$p.patch" || { log "patch $p failed"; return 1; }; done
  fi
  build_ext_90a "$log" || rc=1
  if [ "$v" != plain ]; then
    for p in $(echo "$patches" | tr ' ' '\n' | tac); do apply_patch -R "scripts/diag/$p.patch" || return 1; done
  fi
  [ $rc -eq 0 ] || { build_ext_90a "$log"; return 1; }
}
apply_patch() {  # [-R] FILE: patch(1), or git apply where the host lacks it
  if command -v patch > /dev/null; then patch -p1 -s "${@:1:$#-1}" < "${@: -1}"; else git apply "${@:1:$#-1}" "${@: -1}"; fi
}
stage_wgmma_diag() {
  local rc=0 v i=0 built=plain
  for v in ${WGMMA_DIAG_VARIANTS:-plain wgmma_feed_only wgmma_compute_only}; do
    i=$((i + 1))
    if [ "$v" != "$built" ]; then  # the sources stay plain between variants; only the build follows them
      build_variant "$v" "$OUT/rebuild.log" || return 1
      built=$v
    fi
    case " ${WGMMA_DIAG_TEST:-} " in
      *" $v "*) pytest_gpu "pytest-gpu-diag${i}" 150 tests/kernels/test_cuda_gemm_wgmma.py tests/kernels/test_cuda_gemm.py || rc=1 ;;
    esac
    run_bench "diag${i}_${v//+/_and_}" 150 python3 scripts/bench_w4a8_cuda.py --no-marlin --auto-only --group 128 \
      --shapes ${WGMMA_DIAG_SHAPES:-4096x4096 4096x6144 8192x28672} --ms ${WGMMA_DIAG_MS:-256 1024 4096} \
      ${WGMMA_DIAG_BENCH_ARGS:-} --out "$OUT/diag${i}_${v//+/_and_}.json" || rc=1
  done
  if [ "$built" != plain ]; then build_ext_90a "$OUT/rebuild.log" || rc=1; fi  # leave the plain build behind
  return $rc
}
# Session 63: x in the wgmma k order (the quantizer writes it, the wgmma kernels copy it by TMA).
# The csrc GEMM suite and the linear's tests, then the auto GEMM on either order and the linear
# (which picks the order) against the natural-order linear, the same run; then issue #4's table.
stage_x_wgmma_tests() {
  pytest_gpu pytest-gpu-x-wgmma 420 tests/kernels/test_cuda_gemm.py tests/kernels/test_cuda_gemm_wgmma.py \
    tests/kernels/test_nonfinite_linear.py tests/kernels/test_cuda_layout.py
}
stage_x_wgmma_bench() {
  run_bench bench_w4a8_cuda_x_wgmma 300 python3 scripts/bench_w4a8_cuda.py --no-marlin --auto-only --group 128 \
    --shapes ${X_WGMMA_SHAPES:-4096x6144 4096x4096 14336x4096 28672x8192} --ms ${X_WGMMA_MS:-256 1024 4096} \
    --out "$OUT/x_wgmma.json"
}
stage_x_wgmma_table() {
  run_bench bench_gemm_x_wgmma 480 python3 benchmarks/bench_gemm.py --ms ${X_WGMMA_TABLE_MS:-256,1024,4096} \
    --shapes 4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,28672x8192,8192x28672 \
    --methods ours_cuda,ours_cuda_gemm,ours_cuda_gemm_xw,ours_cuda_quant,cublas_bf16,int8_mm --out "$OUT/gemm-x-wgmma"
}
# The compiled path: compile_passes.WgmmaActOrder's tests on the GPU, then a layer as vLLM compiles
# it (the op before + the linear) with and without the pass, the same run; then vLLM serving with it.
stage_x_wgmma_compiled() {
  local rc=0
  pytest_gpu pytest-gpu-compile-pass 300 tests/test_compile_passes.py tests/kernels/test_cuda_gemm_wgmma.py \
    -k "wgmma_order" || rc=1
  run_bench bench_compiled_linear 360 python3 benchmarks/bench_compiled_linear.py --out "$OUT" || rc=1
  return $rc
}
# The layers the pass's shape rule was not measured on: o_proj and Llama-3-70B's four (next session).
stage_x_wgmma_compiled_more() {
  run_bench bench_compiled_linear_more 540 python3 benchmarks/bench_compiled_linear.py --out "$OUT" \
    --layers o_proj qkv_70b gate_up_70b down_70b o_proj_70b qkv --ms 128 256 1024 4096 --code
}
# Session 64: the quantizer permuting its input instead of its codes (WgmmaActOrder input_order,
# MIXPREC_X_WGMMA_ORDER=input), against both, on every layer shape (Inductor's code kept, tarred:
# the device tool returns a few files only).
stage_x_input_order() {
  local rc=0
  pytest_gpu pytest-gpu-input-order 300 tests/test_compile_passes.py -k "wgmma" || rc=1
  run_bench bench_compiled_linear_input_order 540 python3 benchmarks/bench_compiled_linear.py --out "$OUT" \
    --layers qkv gate_up down o_proj qkv_70b down_70b --ms 128 256 1024 4096 --code || rc=1
  tar czf "$OUT/inductor-code.tgz" -C "$OUT" inductor-code && rm -r "$OUT/inductor-code"
  return $rc
}
# Session 65: input order won every layer alone (H200), yet its one served run decoded 17 % slower
# than session 64's (another host). A decoder piece (o_proj .. QKV, four GEMMs) compiled with
# vLLM's Inductor options (combo kernels), timed replayed and launched (vLLM launches batches past
# 512 tokens), Inductor's code kept (a call of its own: six compiles of four GEMMs); then, in
# x_input_order_layers, the single layers under the same options.
stage_x_input_order_piece() {
  local rc=0
  run_bench bench_compiled_linear_piece 540 python3 benchmarks/bench_compiled_linear.py --out "$OUT/piece" \
    --layers piece piece_70b --ms 256 1024 4096 --vllm-inductor --code || rc=1
  tar czf "$OUT/piece-code.tgz" -C "$OUT/piece" inductor-code && rm -r "$OUT/piece/inductor-code"
  return $rc
}
# Session 69: the same piece with MIXPREC_X_WGMMA_ORDER=input_fused beside the three orders (the QKV's
# quantizer kept in its norm's kernel: 6 kernels besides the GEMMs where input order has 7, on the CPU).
stage_x_input_fused_piece() {
  local rc=0
  run_bench bench_compiled_linear_input_fused 540 python3 benchmarks/bench_compiled_linear.py \
    --out "$OUT/input-fused" --layers ${X_INPUT_FUSED_LAYERS:-piece} --ms 256 1024 4096 --vllm-inductor \
    --input-fused --code || rc=1
  tar czf "$OUT/input-fused-code.tgz" -C "$OUT/input-fused" inductor-code && rm -r "$OUT/input-fused/inductor-code"
  return $rc
}
# Session 72: the decoder pieces (8B and 70B) compiled five ways, vLLM's Inductor options: natural,
# codes permuted everywhere, input order, input_fused (the default since session 73), and the
# codes by the wgmma_order_pays rule (the default before), each timed three times in A-B-C /
# C-B-A / A-B-C order (drift in the log).
stage_x_order_piece_aba() {
  # shellcheck disable=SC2086  # the values are words
  run_bench bench_compiled_linear_order_aba 540 python3 benchmarks/bench_compiled_linear.py \
    --out "$OUT/order-aba" --layers ${X_ORDER_ABA_LAYERS:-piece piece_70b} --ms ${X_ORDER_ABA_MS:-256 1024 4096} \
    --vllm-inductor --input-fused --rule --rounds 3
}
# Session 88: quant_ops_pdl (the quantizer ops as programmatic dependents of the kernel before them; the
# decode GEMM lets them launch once its CTAs are past their own wait): its GPU tests, the chain of
# GEMMs and ops back to back and in a CUDA graph, and the ops against their references (it is on by default).
stage_quant_ops_pdl() {
  pytest_gpu pytest-gpu-quant-ops-pdl 240 tests/kernels/test_cuda_gemm.py \
    -k "dependents_of_the_decode_gemm or launch_options_bit_identical or add_rms_norm or silu_mul_quantize_act or quantize_act or graph"
}
# Session 89: issue #4's evidence on one tree in one call (~6 min after `env build`; session 90
# timed its sanitizers at 2.0 min and the table at 1.8, docs/GPU_HOST.md): the csrc
# GEMM tests, every csrc kernel under the four sanitizers (the decode ops' cases included), the
# table (issue_table), and the 70B and 8B decoder pieces against Marlin with the defaults.
stage_closeout() {
  local rc=0
  stage_test_csrc || rc=1
  stage_sanitize_cuda || rc=1
  stage_issue_table || rc=1
  SERVED_MARLIN_LAYERS=piece_70b SERVED_MARLIN_NAME=70b SERVED_MARLIN_MS="1 2 4 8 16" \
    SERVED_MARLIN_ARGS="--decode-ops --profile 20" stage_served_marlin || rc=1
  SERVED_MARLIN_LAYERS=piece SERVED_MARLIN_NAME=8b SERVED_MARLIN_MS="1 4 16" \
    SERVED_MARLIN_ARGS="--decode-ops" stage_served_marlin || rc=1
  return $rc
}
# Session 82: decode as served against Marlin W4A16 (issue #4's M <= 16 target as a served layer
# pays it): the decoder pieces compiled as the plugin compiles batches of at most 64 tokens (the
# quantizer fused into the op before) and over Marlin layers of the same weights, vLLM's Inductor
# options, three rounds in A-B / B-A / A-B order. The pieces' weights outgrow the L2.
# SERVED_MARLIN_ARGS: more flags (--silu-op, --profile CALLS).
stage_served_marlin() {
  # shellcheck disable=SC2086  # the values are words
  run_bench "bench_compiled_marlin${SERVED_MARLIN_NAME:+_$SERVED_MARLIN_NAME}" 540 \
    python3 benchmarks/bench_compiled_linear.py --compare marlin \
    --out "$OUT/served-marlin${SERVED_MARLIN_NAME:+-$SERVED_MARLIN_NAME}" --layers ${SERVED_MARLIN_LAYERS:-piece} \
    --ms ${SERVED_MARLIN_MS:-1 2 4 8 16 32 64} --vllm-inductor --rounds 3 ${SERVED_MARLIN_ARGS:-}
}
# Session 82: the ops between the decode GEMMs, alone (bench_act_quant.py) for the 8B and 70B widths,
# with vLLM's add + RMSNorm + per-token int8 kernel beside Inductor's fused norm + quant
# (NORM_QUANT_ARGS: more options, e.g. "--norm-op cuda 0 16" for the plugin's own op: its csrc
# kernel (session 84) and its Triton kernel at its own and at 16 warps, session 83; "--patterns silu
# --silu-op cuda cuda1 triton" for the SiLU op's kernels, session 85).
stage_norm_quant_vllm() {
  local rc=0 widths name hidden inter
  for widths in 8b:4096:14336 70b:8192:28672; do
    IFS=: read -r name hidden inter <<< "$widths"
    # shellcheck disable=SC2086  # the values are words
    run_bench "bench_act_quant_$name" 300 python3 benchmarks/bench_act_quant.py --vllm-norm-quant \
      --hidden "$hidden" --inter "$inter" --ms ${NORM_QUANT_MS:-1 16} --out "$OUT/act-quant-$name" \
      ${NORM_QUANT_ARGS:-} || rc=1
  done
  return $rc
}
# Session 83: MIXPREC_DECODE_QUANT_OPS=1's ops and pass on the GPU (session 85: with the SiLU op),
# then served (does the pass match vLLM's graph: its log line), then bench_compiled_linear's arm
# (served_marlin with --decode-ops).
stage_decode_ops_tests() {
  pytest_gpu pytest-gpu-decode-ops 300 tests/kernels/test_triton_gemm.py tests/kernels/test_cuda_gemm.py \
    tests/test_compile_passes.py -k "add_rms_norm or silu_mul_quantize_act or decode_quant"
}
stage_decode_ops_serve() {
  log "end to end with MIXPREC_DECODE_QUANT_OPS=1: vllm serve --quantization mixprec (compiled), W4A8"
  mkdir -p "$OUT/decode-ops-serve"
  MIXPREC_DECODE_QUANT_OPS=1 timeout 420 python3 scripts/e2e_serve.py --out "$OUT/decode-ops-serve" --arms w4a8 \
    2>&1 | tee "$OUT/decode-ops-serve/e2e.log" | tail -30
  local rc=${PIPESTATUS[0]}
  grep -h -E "decode graphs|compile ranges split" "$OUT"/decode-ops-serve/serve-*.log | head -5
  return "$rc"
}
stage_x_input_order_layers() {
  run_bench bench_compiled_linear_vllm_opts 300 python3 benchmarks/bench_compiled_linear.py --out "$OUT/layers" \
    --layers qkv down o_proj --ms 1024 --vllm-inductor
}
stage_x_wgmma_serve() {
  log "end to end with the wgmma order pass: vllm serve --quantization mixprec (compiled), W4A8"
  timeout 420 python3 scripts/e2e_serve.py --out "$OUT" --arms w4a8 2>&1 | tee "$OUT/e2e.log" | tail -30
  local rc=${PIPESTATUS[0]}
  grep -h -E "wgmma k order|compile ranges split" "$OUT"/serve-*.log | head -5
  return "$rc"
}
# Issue #4's bench_gemm table at M = 256 and 1024 (do_bench's L2 flush, every baseline)
stage_mid_table() {
  run_bench bench_gemm_mid_table 200 python3 benchmarks/bench_gemm.py --ms 256,1024 \
    --shapes 4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,28672x8192,8192x28672 \
    --methods ours_cuda,ours_cuda_gemm,marlin_w4a16,machete_w4a16,cublas_bf16 --out "$OUT/gemm-mid-table"
}
stage_stream_k_sanitize() {
  OUT=$OUT timeout 400 bash scripts/sanitize.sh cuda 2>&1 | tail -30
}
stage_wgmma_pdl_sanitize() {
  OUT=$OUT SANITIZE_TRITON_K="test_gpu_w4ax" timeout 500 bash scripts/sanitize.sh cuda triton 2>&1 | tail -30
}

# Any stage may start vLLM, which needs the plugin's dist-info (session 30 lost a call to a
# stage run without env before it); writing it again is harmless.
register_plugin
for s in "${stages[@]}"; do
  "stage_$s" || { status=1; log "stage $s FAILED"; }
done
log "done, status $status; files in $OUT:"; ls -la "$OUT"
exit $status
