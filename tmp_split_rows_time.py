import torch, triton
from vllm_mixprec.kernels.triton import gemm as tg
K = 14336
for m in (1, 8, 16, 32, 64, 128, 256, 512):
    gu = torch.randn(m, 2 * K, device="cuda", dtype=torch.bfloat16)
    res = {}
    for name, lim in (("split", 4096), ("row", 0)):
        tg.SPLIT_ROWS_MAX_M = lim
        f = lambda: tg.silu_mul_quantize_act(gu)
        f(); torch.cuda.synchronize()
        res[name] = triton.testing.do_bench_cudagraph(f, rep=100) * 1e3
    print(f"M={m:4d} split {res['split']:7.2f} us  one-program-per-row {res['row']:7.2f} us", flush=True)
