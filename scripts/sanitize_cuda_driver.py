"""Small driver for compute-sanitizer: every csrc W4A8 kernel variant (on the wgmma kernels, x in
either k order), quantize_act (either order, its rows split over CTAs or not) and the decode
graphs' norm and SiLU ops (alone and as dependents of the decode GEMM) once.

Run by scripts/sanitize.sh; it exits non-zero if a result is wrong, so the sanitizer
log and the exit code both count. `sanitize_cuda_driver.py quantize` runs quantize_act's cases only,
`sanitize_cuda_driver.py ops` the decode ops' only.
"""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "kernels")]  # the checkout; the GPU tests' helpers

from vllm_mixprec import reference as ref
from vllm_mixprec.kernels import cuda

from cuda_gemm_helpers import decoder_chain

DEV = "cuda"


def lqq(n, k, g, gen):
    q = torch.randint(0, 16, (n, k), generator=gen, device=DEV, dtype=torch.int32)
    s = torch.randint(1, 17, (n, k // g), generator=gen, device=DEV, dtype=torch.int32)
    a = 9 + (torch.rand((n, k // g), generator=gen, device=DEV) * (255 - 15 * s - 8)).floor().to(torch.int32)
    a = torch.minimum(a, 255 - 15 * s)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8), s.to(torch.uint8), a.to(torch.uint8)


def main() -> int:
    if not cuda.available():
        print("csrc ops not built:", cuda.load_error())
        return 2
    gen = torch.Generator(device=DEV).manual_seed(0)
    only = sys.argv[1:]  # [] (every case), ["quantize"] (quantize_act), ["ops"] (the decode ops)
    if only not in ([], ["quantize"], ["ops"]):
        print(f"usage: {sys.argv[0]} [quantize | ops], not {' '.join(only)}")
        return 2
    failures = gemm_cases(gen) if not only else 0
    failures += quantize_cases(gen) if only != ["ops"] else 0
    failures += decode_ops_cases(gen) if only != ["quantize"] else 0
    torch.cuda.synchronize()
    print("failures:", failures)
    return 1 if failures else 0


def gemm_cases(gen) -> int:
    failures = 0
    # (M, N, K, G, kernel, splits): decode and tiled, with and without split-K, N not a
    # multiple of the CTA tile, K ranges that leave warps a partial unroll batch or none.
    cases = [
        (1, 48, 320, 64, 0, 1), (1, 48, 320, 64, 1, 1), (1, 208, 1024, 128, 1, 3), (3, 208, 1024, 128, 1, 3),
        (16, 64, 4096, 64, 0, 0), (17, 80, 512, 64, 1, 2), (32, 16, 192, 64, 0, 5),
        (33, 208, 512, 64, 2, 1), (64, 144, 640, 128, 2, 3), (65, 208, 512, 64, 3, 1),
        (200, 80, 384, 128, 3, 2), (5, 32, 128, 64, 3, 1),
    ]
    if cuda.has_wgmma():  # sm_90a kernels 4..8: partial CTA tiles in M and N, split-K, stream-K
        cases += [(64, 256, 512, 64, 4, 1), (130, 272, 1024, 128, 5, 2), (300, 128, 640, 64, 6, 1),
                  (65, 512, 8192, 128, 4, 3), (70, 208, 768, 64, 7, 2), (130, 144, 1024, 128, 8, 1),
                  (64, 128, 4096, 128, 7, 4),
                  # stream-K (splits=-1): tiles cut between CTAs, partials, the finisher's wait
                  (65, 512, 8192, 128, 4, -1), (200, 208, 576, 64, 7, -1), (300, 272, 1024, 64, 5, -1),
                  (130, 144, 2048, 128, 8, -1),
                  # hybrid stream-K: 17 x 24 = 408 tiles > 2 waves, so whole waves run
                  # data-parallel before the split remainder
                  (2100, 6144, 256, 128, 4, -1)]
    # The decode kernels again with unsigned weight bytes (decode_u8), with the 3-CTA build
    # (decode_ctas_per_sm=3, M <= 16) and with the first weight batch read before the PDL wait
    # at every decode M (decode_preload_max_m=32); at M = 1 also the IDP.4A form (decode_dp4a)
    builds = ((1, 2, 0, 0), (0, 3, 0, 0), (1, 3, 0, 0), (0, 2, 32, 0), (0, 3, 32, 0),
              (0, 2, 0, 1), (0, 3, 16, 1))  # (u8, CTAs per SM, preload max M, dp4a)
    option_cases = [c + b for b in builds for c in cases
                    if c[4] in (0, 1) and (b[1] == 2 or c[0] <= 16) and (not b[3] or c[0] == 1)]
    # The wgmma cases again on x in the wgmma k order (the kXTma kernels: x by TMA, the box's zero
    # fill past M and K standing in for the copies the cp.async path skips)
    x_order_cases = [c + (0, 2, 0, 0, 1) for c in cases if c[4] >= 4]
    defaults = cuda.set_launch_options()
    for m, n, k, g, kernel, splits, u8, ctas, pre, dp4a, x_order in (
            [c + (0, 2, 0, 0, 0) for c in cases] + [c + (0,) for c in option_cases] + x_order_cases):
        cuda.set_launch_options(decode_u8=u8, decode_ctas_per_sm=ctas, decode_preload_max_m=pre, decode_dp4a=dp4a)
        qw, gs, go = lqq(n, k, g, gen)
        cs = torch.rand(n, generator=gen, device=DEV) * 1e-3 + 1e-4
        x = torch.randn(m, k, generator=gen, device=DEV, dtype=torch.float16)
        bias = torch.randn(n, generator=gen, device=DEV, dtype=torch.float16)
        xq, xs = cuda.quantize_act(x, None, bool(x_order))
        pq, gp = cuda.repack_w4a8(qw, gs, go)
        y = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, bias, torch.float16, kernel, splits, bool(x_order))
        x_natural = ref.to_wgmma_act_order(xq) if x_order else xq  # the order is its own inverse
        y_ref = ref.w4a8_gemm(x_natural, xs, qw, gs, go, cs, bias, torch.float64)
        rel = float((y.double() - y_ref).norm() / y_ref.norm())
        ok = rel < 2e-3 and bool(torch.isfinite(y).all())
        failures += not ok
        print(f"M={m:4d} N={n:4d} K={k:5d} G={g:3d} kernel={kernel} splits={splits} u8={u8} ctas={ctas} "
              f"preload_max_m={pre} dp4a={dp4a} x_wgmma_order={x_order}: rel={rel:.2e} {'ok' if ok else 'FAIL'}")
    cuda.set_launch_options(**defaults)
    return failures


def quantize_cases(gen) -> int:
    failures = 0
    for dtype, k in ((torch.bfloat16, 1000), (torch.float32, 4096), (torch.float16, 8192)):
        x = torch.randn(9, k, generator=gen, device=DEV).to(dtype)
        sm = torch.rand(k, generator=gen, device=DEV) + 0.5
        q, s = cuda.quantize_act(x, sm)
        q_ref, s_ref = ref.quantize_act(x, sm)
        ok = int((q.int() - q_ref.int()).abs().max()) <= 1 and torch.allclose(s, s_ref, rtol=1e-6, atol=0)
        if k % 64 == 0:  # the wgmma k order needs whole 64-wide blocks
            q_wgmma, s_wgmma = cuda.quantize_act(x, sm, True)
            ok = ok and torch.equal(q_wgmma, ref.to_wgmma_act_order(q)) and torch.equal(s_wgmma, s)
        failures += not ok
        print(f"quantize_act {dtype} K={k}: {'ok' if ok else 'FAIL'}")
    # Rows split over CTAs (act_quant_split): the rule and forced chunks, the last chunk partial
    # (K = 14344, 28680), a NaN row, either k order.
    defaults = cuda.set_launch_options()
    for dtype, m, k in ((torch.bfloat16, 16, 14344), (torch.float16, 3, 28672), (torch.float32, 9, 8192),
                        (torch.bfloat16, 32, 28680)):
        x = torch.randn(m, k, generator=gen, device=DEV).to(dtype)
        x[m - 1, k // 2] = float("nan")
        cuda.set_launch_options(act_quant_split=0)
        q0, s0 = cuda.quantize_act(x)
        for split in (1, 1024, 4096):
            cuda.set_launch_options(act_quant_split=split)
            q, s = cuda.quantize_act(x)
            ok = torch.equal(q, q0) and torch.equal(s.nan_to_num(-1), s0.nan_to_num(-1))
            if k % 64 == 0:
                q_wgmma, _ = cuda.quantize_act(x, None, True)
                ok = ok and torch.equal(q_wgmma, ref.to_wgmma_act_order(q0))
            failures += not ok
            print(f"quantize_act split={split} {dtype} M={m} K={k}: {'ok' if ok else 'FAIL'}")
    cuda.set_launch_options(**defaults)
    return failures


def codes_close(got, want) -> bool:
    """A fused quantizer against its reference: scales within 2^-7 (the fused kernel sums in
    another order, which can move a value by one rounding of its dtype), codes within one."""
    (q, s), (q_ref, s_ref) = got, want
    return (int((q.int() - q_ref.int()).abs().max()) <= 1
            and torch.allclose(s, s_ref, rtol=2.0 ** -7, atol=0, equal_nan=True))


def decode_ops_cases(gen) -> int:
    """The decode graphs' ops: add + RMSNorm + quantizer (one CTA a row), SiLU-and-mul + quantizer
    (a row over a cluster of CTAs), and both as programmatic dependents of the decode GEMM
    (quant_ops_pdl), which reads its weights before its wait and lets them launch after it."""
    failures = 0
    for dtype, m, k, weighted, smoothed in ((torch.bfloat16, 1, 8192, True, False),
                                            (torch.float16, 5, 4096, False, True),
                                            (torch.bfloat16, 64, 16384, True, True)):
        x, res = (torch.randn(m, k, generator=gen, device=DEV).to(dtype) for _ in range(2))
        w = (torch.rand(k, generator=gen, device=DEV) + 0.5).to(dtype) if weighted else None
        sm = torch.rand(k, generator=gen, device=DEV) + 0.5 if smoothed else None
        q, s, r = cuda.add_rms_norm_quantize_act(x, res, w, 1e-5, sm)
        q_ref, s_ref, r_ref = ref.add_rms_norm_quantize_act(x, res, w, 1e-5, sm)
        ok = torch.equal(r, r_ref) and codes_close((q, s), (q_ref, s_ref))
        failures += not ok
        print(f"add_rms_norm_quantize_act {dtype} M={m} K={k} weight={weighted} smooth={smoothed}: "
              f"{'ok' if ok else 'FAIL'}")
    # (max_cluster, cta_vecs): the batch's rule; one CTA a row; 2 CTAs; 16 CTAs of 128 vectors
    # (28672 outputs make 7 CTAs of the default 512 vectors, so 16 needs the smaller CTAs)
    for dtype, m, k, cluster, cta_vecs, smoothed in (
            (torch.bfloat16, 1, 28672, None, cuda.SILU_QUANT_CTA_VECS, False),
            (torch.float16, 3, 14336, 1, cuda.SILU_QUANT_CTA_VECS, True),
            (torch.bfloat16, 16, 14344, 2, cuda.SILU_QUANT_CTA_VECS, False),
            (torch.bfloat16, 40, 28672, 16, 128, True)):
        gate_up = torch.randn(m, 2 * k, generator=gen, device=DEV).to(dtype)
        sm = torch.rand(k, generator=gen, device=DEV) + 0.5 if smoothed else None
        q, s = cuda.silu_mul_quantize_act(gate_up, sm, cluster, cta_vecs)
        ok = codes_close((q, s), ref.silu_mul_quantize_act(gate_up, sm))
        failures += not ok
        print(f"silu_mul_quantize_act {dtype} M={m} K={k} max_cluster={cluster} cta_vecs={cta_vecs} "
              f"smooth={smoothed}: {'ok' if ok else 'FAIL'}")
    defaults = cuda.set_launch_options()
    hidden, inter = 1024, 2048
    for m in (1, 16, 40):  # GEMM -> norm op -> GEMM -> SiLU op -> GEMM -> quantize_act, dependents
        layers = [(*cuda.repack_w4a8(*lqq(n, k, 128, gen)),
                   torch.rand(n, generator=gen, device=DEV) * 1e-3 + 1e-4)
                  for n, k in ((hidden, hidden), (2 * inter, hidden), (hidden, inter))]
        xq, xs = cuda.quantize_act(torch.randn(m, hidden, generator=gen, device=DEV, dtype=torch.bfloat16))
        res = torch.randn(m, hidden, generator=gen, device=DEV).to(torch.bfloat16)
        outs = []
        for pdl in (0, 1):
            cuda.set_launch_options(quant_ops_pdl=pdl)
            outs.append(decoder_chain(layers, xq, xs, res, None))
        ok = all(torch.equal(a, b) for a, b in zip(*outs))
        failures += not ok
        print(f"decode chain M={m}, quant_ops_pdl 0 against 1: {'ok' if ok else 'FAIL'}")
    cuda.set_launch_options(**defaults)
    return failures


if __name__ == "__main__":
    sys.exit(main())
