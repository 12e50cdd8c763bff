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
#     Marlin 5 % (csrc/gemm/NOTES.md "Session 49"); prepared in session 49, not run yet
# Usage (GPU host, extension built): OUT=... bash scripts/profile_ncu.sh [gemm] [gemm-u8] [gemm-c3] [gemm-u8-c3] [attn]
#   [wgmma-m256] [wgmma-m1024] [quant-m1024] [decode-cold]
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
print("plan", list(torch.ops.mixprec_C.w4a8_plan(m, n, k, grp, sms, -1, 0, m >= 64 and cuda.has_wgmma())))
for _ in range(8):
    xq, xs = cuda.quantize_act(x)
    torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, -1, 0)
torch.cuda.synchronize()
PY
)
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
      BYTE_METRICS=dram__bytes_read.sum,lts__t_bytes.sum,lts__t_sector_hit_rate.pct
      # DECODE_COLD_L2PF: also ours with decode_l2_prefetch at that many batches (session 50)
      for variant in ours_cuda_gemm ${DECODE_COLD_L2PF:+ours_cuda_gemm:$DECODE_COLD_L2PF} marlin_w4a16; do
        method=${variant%%:*} pf=0 tag=$variant
        case $variant in *:*) pf=${variant#*:} tag=$method-l2pf$pf ;; esac
        if [ $method = marlin_w4a16 ]; then kern=regex:Marlin; else kern=regex:w4a8_decode_kernel; fi
        for cache in all none; do
          # the DRAM and L2 byte counts say whether a prefetch fetched bytes the loads never used
          MIXPREC_GEMM_DECODE_L2_PREFETCH=$pf "$NCU" "${SECTIONS[@]}" --metrics "$BYTE_METRICS" \
            --cache-control $cache -k $kern \
            --launch-skip 20 --launch-count 1 \
            python3 benchmarks/bench_gemm.py --ms 1 --shapes 8192x28672 --flush read --methods $method \
            --out "$OUT_DIR/$t-$tag-$cache" > "$OUT_DIR/$t-m1-$tag-cache-$cache.txt" 2>&1
        done
      done
      ;;
    *) echo "unknown target $t (gemm, gemm-u8, gemm-c3, gemm-u8-c3, attn, wgmma-m256, wgmma-m1024, quant-m1024, decode-cold)"
       exit 2 ;;
  esac
  echo "== $t: $(grep -E 'Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy' "$OUT_DIR/$t"-[mk]*.txt | head -6 | tr -s ' ')"
done
