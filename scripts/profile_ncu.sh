#!/usr/bin/env bash
# Nsight Compute profiles of the two decode hot spots, for the notes on where time goes:
#   gemm: the csrc W4A8 decode GEMM at M=1, K x N = 8192 x 28672 (after quantize_act)
#   gemm-u8, gemm-c3, gemm-u8-c3: the same with the decode_u8 launch option
#     (MIXPREC_GEMM_DECODE_U8=1), the 3-CTA build (MIXPREC_GEMM_DECODE_CTAS_PER_SM=3), or both
#   attn: the Triton KV4 decode attention kernel at batch 64 x 8K context (GQA 32/8, d=128)
#   wgmma-m256: the planner's wgmma kernel at M = 256, K x N = 4096 x 4096 (issue #4's M = 256 miss)
#   wgmma-m1024: the same at M = 1024, K x N = 4096 x 6144 (issue #4's cuBLAS 1.2x miss)
#   quant-m1024: quantize_act at M = 1024, K = 4096 (bf16); WarpStateStats' "No Instruction" stalls
#     tell instruction fetch apart from memory (csrc/gemm/NOTES.md "quantize_act: three experiments")
#   decode-cold: our decode GEMM and Marlin W4A16 at M = 1, K x N = 8192 x 28672, group 128, each
#     with ncu's default cache control (caches flushed before the kernel: cold, as under a read
#     flush) and with --cache-control none (warm): on the H100 a read flush slowed ours 14 % and
#     Marlin 5 % (csrc/gemm/NOTES.md "Session 49"); run on the H200 in session 52
#   decode-stalls: the same two kernels, cold, at application clocks, with the stall reasons per
#     SASS instruction (reports kept)
#   decode-ceiling: the bandwidth a plain stream reaches, as decode-stalls measures: cuBLAS's
#     bf16 GEMV of the same shape and torch's max over 1 GiB
#   silu: silu_mul_quantize_act at M = 1 on Llama-3-70B's and 8B's rows (28672, 14336; bf16), warm
#     L2 at application clocks (as served after gate_up): the csrc kernel at its plans
#     (max_cluster/cta_vecs in SILU_PLANS, default "8/512 16/128 16/256 4/512") and Triton's two
#     split-row kernels; each kernel's duration, stalls and launch, and a CSV of the durations
# Usage (GPU host, extension built): OUT=... bash scripts/profile_ncu.sh [gemm] [gemm-u8] [gemm-c3] [gemm-u8-c3] [attn]
#   [wgmma-m256] [wgmma-m1024] [quant-m1024] [decode-cold] [decode-stalls] [decode-ceiling] [silu]
set -u
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-$PWD/out}/ncu"
mkdir -p "$OUT_DIR"
NCU="$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)"
[ -z "$NCU" ] && { echo "ncu not found"; exit 2; }
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats)
# The W4A8 linear (quantize_act, then the auto GEMM) 8 times on random LiquidQuant weights of
# M x K x N, group G (from the environment); prints the plan it runs.
LINEAR_PY=$(cat <<'PY'
import os
import torch
from vllm_mixprec.kernels import cuda
m, n, k, grp = (int(os.environ[v]) for v in ("M", "N", "K", "G"))
g = torch.Generator(device="cuda").manual_seed(0)
qw = torch.randint(0, 256, (n, k // 2), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
gs = torch.randint(1, 17, (n, k // grp), device="cuda", generator=g, dtype=torch.int32).to(torch.uint8)
go = torch.full((n, k // grp), 9, device="cuda", dtype=torch.uint8)
pq, gp = cuda.repack_w4a8(qw, gs, go)
cs = torch.rand(n, device="cuda", generator=g) * 1e-3
x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=g)
sms = torch.cuda.get_device_properties(0).multi_processor_count
print("plan", list(torch.ops.mixprec_C.w4a8_plan(m, n, k, grp, sms, -1, 0, cuda.auto_gemm_kernel_family(m, n) == "wgmma")))
for _ in range(8):
    xq, xs = cuda.quantize_act(x)
    torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, -1, 0)
torch.cuda.synchronize()
PY
)
# The decode modes' process (M = 1, 8192 x 28672, group 128, read flush) and each method's kernel
DECODE_M1=(python3 benchmarks/bench_gemm.py --ms 1 --shapes 8192x28672 --flush read)
decode_kernel() { if [ "$1" = marlin_w4a16 ]; then echo regex:Marlin; else echo regex:w4a8_decode_kernel; fi; }
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(gemm attn)
for t in "${targets[@]}"; do
  case $t in
    gemm|gemm-u8|gemm-c3|gemm-u8-c3)
      u8=0; case $t in *-u8*) u8=1 ;; esac
      ctas=2; case $t in *-c3) ctas=3 ;; esac
      M=1 N=28672 K=8192 G=64 MIXPREC_GEMM_DECODE_U8=$u8 MIXPREC_GEMM_DECODE_CTAS_PER_SM=$ctas "$NCU" "${SECTIONS[@]}" \
        -k regex:w4a8_decode_kernel --launch-skip 5 --launch-count 1 python3 -c "$LINEAR_PY" > "$OUT_DIR/$t-m1.txt" 2>&1
      ;;
    attn)
      "$NCU" "${SECTIONS[@]}" -k regex:_paged_attn_kernel --launch-skip 3 --launch-count 1 \
        python3 benchmarks/bench_attention.py --batch 64 --ctx 8192 --methods mixprec-kv4 --rep-ms 5 \
        --out "$OUT_DIR" > "$OUT_DIR/attn-kv4-64x8k.txt" 2>&1 ;;
    wgmma-m256|wgmma-m1024)
      # Saved as a report, then printed three ways: every section with its charts (the stall
      # reasons), every metric (raw CSV), and the SASS with each instruction's sampled stalls.
      if [ $t = wgmma-m256 ]; then m=256 n=4096; else m=1024 n=6144; fi
      M=$m N=$n K=4096 G=128 "$NCU" "${SECTIONS[@]}" --section InstructionStats --section SourceCounters \
        -k regex:w4a8_wgmma_kernel --launch-skip 5 --launch-count 1 -f -o "$OUT_DIR/$t" python3 -c "$LINEAR_PY" \
        > "$OUT_DIR/$t-run.txt" 2>&1
      "$NCU" --import "$OUT_DIR/$t.ncu-rep" --print-details all > "$OUT_DIR/$t-k4096.txt" 2>&1
      "$NCU" --import "$OUT_DIR/$t.ncu-rep" --page raw --csv > "$OUT_DIR/$t-raw.csv" 2>&1
      "$NCU" --import "$OUT_DIR/$t.ncu-rep" --page source --print-source sass --csv > "$OUT_DIR/$t-sass.csv" 2>&1
      ;;
    quant-m1024)
      "$NCU" "${SECTIONS[@]}" --section InstructionStats -k regex:quantize_act_int8 --launch-skip 5 \
        --launch-count 1 python3 - > "$OUT_DIR/$t-k4096.txt" 2>&1 <<'PY'
import torch
from vllm_mixprec.kernels import cuda
x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(8):
    cuda.quantize_act(x)
torch.cuda.synchronize()
PY
      ;;
    decode-cold)
      # the DRAM and L2 byte counts: bytes fetched against bytes the kernel needs
      BYTE_METRICS=dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct
      for method in ours_cuda_gemm marlin_w4a16; do
        for cache in all none; do
          "$NCU" "${SECTIONS[@]}" --metrics "$BYTE_METRICS" --cache-control $cache -k "$(decode_kernel $method)" \
            --launch-skip 20 --launch-count 1 \
            "${DECODE_M1[@]}" --methods $method \
            --out "$OUT_DIR/$t-$method-$cache" > "$OUT_DIR/$t-m1-$method-cache-$cache.txt" 2>&1
        done
      done
      ;;
    decode-stalls)
      # As decode-cold (cold L2), but at the clocks the benchmarks run at (--clock-control none;
      # ncu's default locks the SMs at base, 1.36 GHz on the H200), saved as reports and printed
      # with the stall reasons, every metric, and the SASS with each instruction's sampled stalls.
      for method in ours_cuda_gemm marlin_w4a16; do
        rep="$OUT_DIR/$t-m1-$method"
        "$NCU" "${SECTIONS[@]}" --section InstructionStats --section SourceCounters --clock-control none \
          -k "$(decode_kernel $method)" --launch-skip 20 --launch-count 1 -f -o "$rep" \
          "${DECODE_M1[@]}" --methods $method \
          --out "$OUT_DIR/$t-$method" > "$rep-run.txt" 2>&1
        "$NCU" --import "$rep.ncu-rep" --print-details all > "$rep.txt" 2>&1
        "$NCU" --import "$rep.ncu-rep" --page raw --csv > "$rep-raw.csv" 2>&1
        "$NCU" --import "$rep.ncu-rep" --page source --print-source sass --csv > "$rep-sass.csv" 2>&1
      done
      ;;
    decode-ceiling)
      # What a plain stream reaches on this GPU, on the same footing as decode-stalls (cold L2,
      # application clocks): cuBLAS's bf16 GEMV at M = 1, 8192 x 28672 (470 MB of weights; nvjet
      # kernels in CUDA 13), and a reduction over 1 GiB of int32 (torch's max).
      "$NCU" --section SpeedOfLight --section LaunchStats --metrics dram__bytes_read.sum --clock-control none \
        -k regex:nvjet --launch-skip 2 --launch-count 2 \
        "${DECODE_M1[@]}" --methods cublas_bf16 \
        --out "$OUT_DIR/$t-cublas_bf16" > "$OUT_DIR/$t-m1-cublas_bf16.txt" 2>&1
      "$NCU" --section SpeedOfLight --metrics dram__bytes_read.sum --clock-control none \
        -k regex:reduce --launch-skip 2 --launch-count 1 python3 -c "
import torch
b = torch.empty(2 ** 28, dtype=torch.int32, device='cuda').random_()
for _ in range(4):
    b.max()
torch.cuda.synchronize()" > "$OUT_DIR/$t-max-1GiB.txt" 2>&1
      ;;
    silu)
      rep="$OUT_DIR/silu-m1"
      SILU_PLANS="${SILU_PLANS:-8/512 16/128 16/256 4/512}" "$NCU" --section SpeedOfLight --section LaunchStats \
        --section WarpStateStats --section Occupancy --cache-control none --clock-control none \
        -k "regex:silu_mul_quantize_act_kernel|_quant_act_chunk" -f -o "$rep" python3 - > "$rep-run.txt" 2>&1 <<'PY'
import os
import torch
from vllm_mixprec.kernels import cuda
from vllm_mixprec.kernels.triton import gemm as tg
plans = [tuple(int(v) for v in p.split("/")) for p in os.environ["SILU_PLANS"].split()]
for k in (28672, 14336):
    gate_up = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
    for plan in plans:  # 3 calls each, in this order: the report's kernels follow it
        print("K", k, "plan", plan, cuda.silu_quant_plan(k, *plan), flush=True)
        for _ in range(3):
            cuda.silu_mul_quantize_act(gate_up, None, *plan)
    print("K", k, "triton", flush=True)
    for _ in range(3):
        tg.silu_mul_quantize_act(gate_up, None)
torch.cuda.synchronize()
PY
      "$NCU" --import "$rep.ncu-rep" --print-details all > "$rep.txt" 2>&1
      "$NCU" --import "$rep.ncu-rep" --page raw --csv > "$rep-raw.csv" 2>&1
      ;;
    *) echo "unknown target $t (gemm, gemm-u8, gemm-c3, gemm-u8-c3, attn, wgmma-m256, wgmma-m1024, quant-m1024, decode-cold, decode-stalls, decode-ceiling, silu)"
       exit 2 ;;
  esac
  echo "== $t: $(grep -E 'Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy' "$OUT_DIR/$t"-[mk]*.txt | head -6 | tr -s ' ')"
done
