"""csrc W4A8 ops against reference.py on the GPU (`pytest -m gpu tests/kernels/test_cuda_gemm.py`).

References run in float64 on the same GPU. Outputs are poisoned (NaN left in the caching
allocator's block) so that an unwritten element fails.
"""
import os
import subprocess
import sys

import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.kernels import cuda

from cuda_gemm_helpers import (DEV, _gen, assert_norm_quant_close, capture_after_warmup, check_close, decoder_chain,
                               poison, random_act, random_lqq, replays_with_new_inputs, skip_without_csrc_ops)

pytestmark = pytest.mark.gpu



@pytest.fixture(autouse=True)
def _need_ops():
    skip_without_csrc_ops()




def run_gemm(m, n, k, g, out_dtype, seed, bias_dtype=None, kernel=-1, splits=0, packed=True):
    gen = _gen(seed)
    qw, gs, go, cs = random_lqq(n, k, g, gen)
    xq, xs = random_act(m, k, gen)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen, device=DEV).to(bias_dtype)
    y_ref = ref.w4a8_gemm(xq, xs, qw, gs, go, cs, bias, torch.float64)
    poison(m * n, out_dtype)
    if packed:
        pq, gp = cuda.repack_w4a8(qw, gs, go)
        y = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, bias, out_dtype, kernel, splits)
    else:
        y = cuda.w4a8_gemm(xq, xs, qw, gs, go, cs, bias, out_dtype)
    torch.cuda.synchronize()
    return y, y_ref


# --- GEMM correctness --------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 200, 1024])
@pytest.mark.parametrize("n,k,g", [(16, 64, 64), (48, 256, 128), (512, 1024, 64), (272, 384, 128)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_gemm_matches_reference(m, n, k, g, out_dtype):
    y, y_ref = run_gemm(m, n, k, g, out_dtype, seed=m * 7919 + n * 31 + k, bias_dtype=out_dtype, packed=False)
    check_close(y, y_ref, out_dtype)


def assert_integer_sums_exact(m, n, k, g, kernel, splits, seed):
    """x_scale = channel_scale = 1, float32 out: the int32 sums come out exactly (|acc| < 2^24)."""
    gen = _gen(seed)
    qw, gs, go, _ = random_lqq(n, k, g, gen)
    xq, _ = random_act(m, k, gen)
    ones_m, ones_n = torch.ones(m, device=DEV), torch.ones(n, device=DEV)
    acc = ref._int_gemm(xq, ref.dequantize_weight_w8(qw, gs, go))
    assert float(acc.abs().max()) < 2 ** 24
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    poison(m * n, torch.float32)
    y = torch.ops.mixprec_C.w4a8_gemm(xq, ones_m, pq, gp, ones_n, None, torch.float32, kernel, splits)
    assert torch.equal(y.double(), acc)


@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 31, 32, 33, 64, 65, 130])
@pytest.mark.parametrize("kernel", [0, 1, 2, 3])
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_gemm_integer_exact_every_kernel(m, kernel, splits):
    if kernel in (0, 1) and m > 64:
        pytest.skip("decode kernels take M <= 64")
    # 13 row tiles: odd, not a multiple of 8 (tiled CTAs overhang N)
    assert_integer_sums_exact(m, 208, 1024, 64, kernel, splits, seed=1000 + 17 * m + kernel + 101 * splits)


@pytest.mark.parametrize("m", [1, 5, 9, 16, 17, 32, 41, 64])
@pytest.mark.parametrize("kernel", [0, 1])
@pytest.mark.parametrize("splits", [1, 3, 5])
@pytest.mark.parametrize("k,g", [(1024, 64), (1728, 64), (3328, 128)])
@pytest.mark.parametrize("u8,ctas,preload_max_m", [(1, 2, 0), (0, 3, 0), (1, 3, 0), (0, 2, 32), (0, 3, 32),
                                                   (1, 2, 32), (0, 0, 16), (1, 3, 16)])
def test_decode_options_integer_exact(m, kernel, splits, k, g, u8, ctas, preload_max_m, launch_options):
    """The decode kernels' builds besides the default (s8, 2 CTAs per SM): decode_u8 (u8 x s8 MMA,
    128 * sum_k x subtracted per warp), decode_ctas_per_sm=3 (80 registers; M > 16 keeps the
    2-CTA build) and decode_preload_max_m (at M <= it, so never past M = 32, the first batch's weights read before the
    PDL wait, at M = 9-16 only in the 3-CTA build unless it is over 16, half a batch in that build's
    32-channel kernel; warps with fewer chunks than a batch skip it): the int32 sums exactly, with warps
    whose chunk range is empty, one chunk, or a partial unroll batch (27 and 52 chunks), every token tile count
    (M = 1..64: eight token tiles past M = 32, forced only) and G = 128."""
    launch_options(decode_u8=u8, decode_ctas_per_sm=ctas, decode_preload_max_m=preload_max_m)
    assert_integer_sums_exact(m, 208, k, g, kernel, splits, seed=2000 + 17 * m + kernel + 101 * splits + k)


@pytest.mark.parametrize("m", [1, 2, 8, 9])
@pytest.mark.parametrize("kernel", [0, 1])
@pytest.mark.parametrize("splits", [1, 3, 5])
@pytest.mark.parametrize("k,g", [(1024, 64), (1728, 64), (3328, 128)])
@pytest.mark.parametrize("u8,ctas,preload_max_m", [(0, 2, 0), (0, 3, 0), (0, 0, 16), (1, 2, 32), (1, 3, 16)])
def test_decode_dp4a_integer_exact(m, kernel, splits, k, g, u8, ctas, preload_max_m, launch_options):
    """decode_dp4a: at M = 1 the decode kernels' IDP.4A form (the 4-bit codes times x, no dequant,
    no MMA; the t-lanes' k-slices summed after the loop) in every build, with decode_u8 on or off
    (M = 1 ignores it); at M = 2..9 the option leaves the MMA forms: the int32 sums exactly, with
    empty, one-chunk and partial-batch warp ranges as test_decode_options_integer_exact has them."""
    launch_options(decode_dp4a=1, decode_u8=u8, decode_ctas_per_sm=ctas, decode_preload_max_m=preload_max_m)
    assert_integer_sums_exact(m, 208, k, g, kernel, splits, seed=3000 + 17 * m + kernel + 101 * splits + k)


@pytest.mark.parametrize("kernel,splits,m", [(0, 1, 16), (1, 2, 16), (2, 1, 200), (3, 1, 200), (3, 3, 200)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_epilogue_of_the_integer_sums_is_the_kernels(kernel, splits, m, out_dtype):
    """MIXPREC_TP_REDUCE=exact runs the GEMM with unit scales (its integer sums, float32) and
    reference.w4a8_epilogue after the all-reduce, eager and as Inductor compiles it: TP=1's output
    bit for bit only if both round as every kernel's epilogue does (the wgmma kernels are
    bit-identical to kernel 3: test_cuda_gemm_wgmma)."""
    n, k, g = 208, 1024, 64
    gen = _gen(77 + kernel + 13 * m)
    qw, gs, go, cs = random_lqq(n, k, g, gen)
    xq, xs = random_act(m, k, gen)
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    y = torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, out_dtype, kernel, splits)
    acc = torch.ops.mixprec_C.w4a8_gemm(xq, torch.ones_like(xs), pq, gp, torch.ones_like(cs), None,
                                        torch.float32, kernel, splits)
    assert torch.equal(ref.w4a8_epilogue(acc, xs, cs, None, out_dtype), y)
    compiled = torch.compile(ref.w4a8_epilogue, dynamic=False)
    assert torch.equal(compiled(acc, xs, cs, None, out_dtype), y)


@pytest.mark.parametrize("m", [1, 16, 32])
def test_gemm_llama70b_up_proj_shape(m):
    """K x N = 8192 x 28672 (the decode target), and a small-N shape that takes split-K."""
    for n, k in ((28672, 8192), (1024, 8192)):
        y, y_ref = run_gemm(m, n, k, 64, torch.bfloat16, seed=m + n)
        check_close(y, y_ref, torch.bfloat16)


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gemm_bias_and_out_dtypes(bias_dtype, out_dtype):
    y, y_ref = run_gemm(5, 64, 512, 128, out_dtype, seed=3, bias_dtype=bias_dtype)
    check_close(y, y_ref, out_dtype)


def test_gemm_deterministic_split_k():
    a, _ = run_gemm(4, 128, 4096, 64, torch.float16, seed=11, kernel=0, splits=7)
    b, _ = run_gemm(4, 128, 4096, 64, torch.float16, seed=11, kernel=0, splits=7)
    assert torch.equal(a, b)


def test_gemm_m_zero():
    qw, gs, go, cs = random_lqq(32, 128, 64, _gen(0))
    y = cuda.w4a8_gemm(torch.empty(0, 128, dtype=torch.int8, device=DEV), torch.empty(0, device=DEV),
                       qw, gs, go, cs, None, torch.float16)
    assert y.shape == (0, 32)


def test_gemm_unaligned_activation_view():
    gen = _gen(5)
    qw, gs, go, cs = random_lqq(64, 256, 64, gen)
    big, xs = random_act(3, 256 + 8, gen)
    xq = big[:, 8:]  # strided, 8-byte offset: the op must copy, not misread
    y = cuda.w4a8_gemm(xq, xs, qw, gs, go, cs, None, torch.float16)
    check_close(y, ref.w4a8_gemm(xq, xs, qw, gs, go, cs, None, torch.float64), torch.float16)


# --- quantize_act ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 4096), (7, 8192), (33, 1000), (200, 64), (3, 28672)])
@pytest.mark.parametrize("smooth_dtype", [None, torch.float32, "same"])
def test_quantize_act_matches_reference(dtype, m, k, smooth_dtype):
    gen = _gen(m * k)
    x = (torch.randn(m, k, generator=gen, device=DEV) * torch.logspace(-3, 3, m, device=DEV)[:, None]).to(dtype)
    smooth = None
    if smooth_dtype is not None:
        smooth = (torch.rand(k, generator=gen, device=DEV) + 0.25).to(dtype if smooth_dtype == "same" else smooth_dtype)
    poison(m * k, torch.int8)
    q, s = cuda.quantize_act(x, smooth)
    q_ref, s_ref = ref.quantize_act(x, smooth)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == (m, k) and s.shape == (m,)
    assert float(((s - s_ref).abs() / s_ref).max()) <= 1e-6
    diff = (q.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and int((diff != 0).sum()) <= max(1, q.numel() // 10000)


# K per path: one-pass with 1, 2 and 4 vectors per thread (4096, 8192, 14336, 28672, 32768 = the
# largest), the two-pass loop above that (32776), and the scalar loop (K % 8 != 0).
@pytest.mark.parametrize("k", [64, 4096, 8192, 14336, 28672, 32768, 32776, 1001])
@pytest.mark.parametrize("dtype,smooth_dtype", [(torch.bfloat16, None), (torch.float16, torch.float32),
                                                (torch.float32, "same")])
@pytest.mark.parametrize("m", [3, 200, 1100])
def test_quantize_act_one_pass_matches_two_pass(k, dtype, smooth_dtype, m, launch_options):
    """The register-resident kernel computes what the two-pass loop does, bit for bit, with a
    non-finite row (NaN scale, zero codes) among finite ones, with its lean arithmetic
    (act_quant_lean, the default: 1 / scale, the division near half-integers) and without. At
    m = 200 and 1100 rows over 8192 elements take the two-pass loop (more rows than SMs)."""
    gen = _gen(k + m)
    x = (torch.randn(m, k, generator=gen, device=DEV) * 10).to(dtype)
    x[1, k // 3] = float("nan")
    smooth = None
    if smooth_dtype is not None:
        smooth = (torch.rand(k, generator=gen, device=DEV) + 0.25).to(dtype if smooth_dtype == "same" else smooth_dtype)
    got = {}
    # act_quant_split=0: these kernels whatever rows the split rule takes
    for one_pass, lean in ((0, 1), (1, 0), (1, 1)):
        launch_options(act_quant_one_pass=one_pass, act_quant_lean=lean, act_quant_split=0)
        poison(m * k, torch.int8)
        got[one_pass, lean] = cuda.quantize_act(x, smooth)
    torch.cuda.synchronize()
    q0, s0 = got[0, 1]
    finite = torch.arange(m, device=DEV) != 1
    for mode, (q, s) in got.items():
        assert torch.equal(q, q0), mode
        assert torch.equal(s[finite], s0[finite]) and bool(torch.isnan(s[1])), mode
        assert int(q[1].abs().sum()) == 0, mode
    q_ref, s_ref = ref.quantize_act(x, smooth)
    assert float(((s0[finite] - s_ref[finite]).abs() / s_ref[finite]).max()) <= 1e-6


# M x K for the split rows (act_quant_split): rows of 1 to 40 chunks, K a multiple of no chunk
# (4104, 14344, 28680), the most rows the forced chunks take (64); the rule splits (16, 14336) and
# (16, 28680)
SPLIT_ROW_SHAPES = [(1, 4096), (1, 28672), (3, 4104), (16, 14336), (16, 28680), (5, 14344), (64, 8192),
                    (2, 32768), (7, 40000)]


@pytest.mark.parametrize("m,k", SPLIT_ROW_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("wgmma_order", [False, True])
def test_quantize_act_split_rows_bit_identical(m, k, dtype, wgmma_order, launch_options):
    """Rows split over CTAs (act_quant_split: the rule, and each forced chunk) give the one-pass
    kernel's codes and scales bit for bit (rows over 32768 the two-pass loop's), in either k order,
    with rows holding NaN, +Inf, -Inf, zeros only, subnormals, and a row whose largest magnitude is
    negative; every code and scale written."""
    gen = _gen(7 * m + k)
    x = (torch.randn(m, k, generator=gen, device=DEV) * torch.logspace(-2, 2, m, device=DEV)[:, None]).to(dtype)
    specials = [("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf"))]
    for row, (_, value) in zip(range(1, m), specials):
        x[row, (row * 977) % k] = value
    if m > 4:
        x[4] = 0
    if m > 5:
        tiny = torch.finfo(dtype).tiny
        x[5] = (torch.rand(k, generator=gen, device=DEV) * tiny).to(dtype)  # subnormals
    x[0, k - 1] = -x[0].abs().max() * 2  # the amax at the last element, negative
    if wgmma_order and k % 64:
        pytest.skip("the wgmma k order permutes whole 64-k chunks")
    got = {}
    for split in (0, 1, 1024, 2048, 4096):
        launch_options(act_quant_split=split)
        poison(m * k, torch.int8)
        poison(m, torch.float32)
        got[split] = cuda.quantize_act(x, None, wgmma_order)
    torch.cuda.synchronize()
    q0, s0 = got[0]
    for split, (q, s) in got.items():
        assert torch.equal(q, q0), split
        assert torch.equal(s.nan_to_num(-1), s0.nan_to_num(-1)), split
    q_ref, s_ref = ref.quantize_act(x)
    if wgmma_order:
        q_ref = q_ref[:, F.wgmma_act_k_order(k).to(DEV)]
    finite = ~torch.isnan(s_ref)
    assert torch.equal(torch.isnan(s0), ~finite)
    assert torch.equal(s0[finite], s_ref[finite])
    diff = (q0.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and int((diff != 0).sum()) <= max(1, q0.numel() // 10000)
    assert int(q0[~finite].abs().sum()) == 0


def test_quantize_act_split_rows_skip_what_they_cannot_take(launch_options):
    """Forced splitting leaves a smoothing divisor, a row of K % 8 != 0 and an unaligned view to the
    other kernels, and splits an aligned strided view: the same codes as with splitting off."""
    gen = _gen(99)
    x = torch.randn(4, 16392, generator=gen, device=DEV, dtype=torch.bfloat16) * 5
    smooth = torch.rand(16384, generator=gen, device=DEV) + 0.5
    cases = [(x[:, :16384], smooth), (x[:, :16385], None), (x[:, 1:16385], None), (x[:, 8:16392], None)]
    for inp, sm in cases:
        outs = []
        for split in (0, 2048):
            launch_options(act_quant_split=split)
            outs.append(cuda.quantize_act(inp, sm))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        q_ref, s_ref = ref.quantize_act(inp, sm)
        assert float(((outs[1][1] - s_ref).abs() / s_ref).max()) <= 1e-6


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (5, 1024, 14336), (16, 2048, 8192), (32, 512, 1024),
                                   (2, 64, 4096), (64, 4096, 4096), (256, 4096, 4096), (200, 1024, 14336),
                                   (1024, 6144, 4096)])
def test_gemm_launch_options_bit_identical(m, n, k, launch_options):
    """The decode kernels (M <= 32), s8 or u8 weights (decode_u8) or IDP.4A at M = 1 (decode_dp4a),
    the quantizer a programmatic dependent too (quant_ops_pdl), the 2- or 3-CTA build or the
    planner's, with the first weights preloaded at no M, M <= 8, M <= 16 (the default: M = 9-16 in
    the 3-CTA build only) or every M, the quantizer's rows split (act_quant_split) or not, and on
    an H100/H200 the wgmma kernels (M = 200-1024; M = 64 takes the decode kernel), as programmatic dependent launches (sm_90) after
    either quantizer give the plain launch's bits;
    (2, 64, 4096), (64, 4096, 4096) and (200, 1024, 14336) split K. The linear op runs
    quantize_act first, so the dependent really overlaps a producer of its input."""
    gen = _gen(m + n + k)
    layer, _ = _prepared_layer(n, k, 64, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    outs = []
    for pdl, one_pass, u8, ctas, pre, dp4a, split, qpdl in (
            (0, 0, 0, 2, 0, 0, 0, 0), (1, 0, 0, 2, 0, 0, 0, 0), (1, 1, 0, 2, 0, 0, 0, 0), (0, 1, 0, 2, 0, 0, 0, 0),
            (1, 1, 1, 2, 0, 0, 0, 0), (0, 0, 1, 2, 0, 0, 0, 0), (1, 1, 0, 3, 0, 0, 0, 0), (1, 1, 1, 3, 0, 0, 0, 0),
            (1, 1, 0, 0, 0, 0, 0, 0), (1, 1, 0, 0, 32, 0, 0, 0), (0, 0, 0, 2, 32, 0, 0, 0), (1, 1, 1, 3, 32, 0, 0, 0),
            (1, 1, 0, 0, 8, 0, 0, 0), (1, 1, 0, 0, 16, 0, 0, 0), (1, 1, 1, 3, 16, 0, 0, 0), (0, 0, 0, 2, 0, 1, 0, 0),
            (1, 1, 0, 0, 16, 1, 0, 0), (1, 1, 0, 3, 0, 1, 0, 0), (1, 1, 1, 3, 32, 1, 0, 0), (1, 1, 0, 0, 16, 1, 1, 0),
            (0, 1, 0, 0, 16, 1, 1, 0), (1, 1, 0, 0, 16, 1, 1024, 0), (1, 1, 0, 3, 32, 0, 4096, 0),
            (1, 1, 0, 0, 16, 1, 1, 1), (1, 1, 0, 0, 16, 0, 1, 1), (0, 0, 0, 3, 32, 0, 0, 1), (1, 1, 0, 2, 0, 0, 0, 1)):
        launch_options(gemm_pdl=pdl, act_quant_one_pass=one_pass, decode_u8=u8, decode_ctas_per_sm=ctas,
                       decode_preload_max_m=pre, decode_dp4a=dp4a, act_quant_split=split, quant_ops_pdl=qpdl)
        for _ in range(3):  # back to back, so a dependent can start before its producer ends
            poison(m * n, torch.bfloat16)
            y = torch.ops.mixprec.w4a8_linear(x, layer.qweight, layer.group_scale, layer.group_offset,
                                              layer.channel_scale, None, None, "cuda")
            outs.append(((pdl, one_pass, u8, ctas, pre, dp4a, split, qpdl), y))
    torch.cuda.synchronize()
    for opts, y in outs[1:]:
        assert torch.equal(y, outs[0][1]), opts


@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_quant_ops_as_dependents_of_the_decode_gemm(m, launch_options):
    """quant_ops_pdl: the three quantizer ops launched as programmatic dependents of the decode GEMM
    whose output they read (which lets them launch once its CTAs are past their own wait). Four
    steps back to back on inputs that change every step, eagerly and replayed from one CUDA graph
    captured with the option on, give the plain launches' outputs bit for bit; an op that read its
    input before the GEMM had written it would read the step before's."""
    hidden, inter = 2048, 4096
    gen = _gen(7100 + m)
    layers = []
    for n, k in ((hidden, hidden), (2 * inter, hidden), (hidden, inter)):
        qw, gs, go, cs = random_lqq(n, k, 128, gen)
        layers.append((*cuda.repack_w4a8(qw, gs, go), cs))
    weight = (torch.rand(hidden, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    steps = [(*random_act(m, hidden, gen), torch.randn(m, hidden, generator=gen, device=DEV).to(torch.bfloat16))
             for _ in range(4)]
    runs = {}
    for quant_ops_pdl in (0, 1):
        launch_options(quant_ops_pdl=quant_ops_pdl)
        runs[quant_ops_pdl] = [decoder_chain(layers, *step, weight) for step in steps]  # no sync between steps
        torch.cuda.synchronize()
    for step, (plain, dependent) in enumerate(zip(runs[0], runs[1])):
        for i, (a, b) in enumerate(zip(plain, dependent)):
            assert torch.equal(a, b), (step, i)
    y1, q1, s1, r1 = runs[0][-1][:4]
    assert_norm_quant_close((q1, s1, r1), ref.add_rms_norm_quantize_act(y1, steps[-1][2], weight, 1e-5))

    launch_options(quant_ops_pdl=1)
    static = [t.clone() for t in steps[0]]
    graph, outs, _ = capture_after_warmup(lambda st: decoder_chain(layers, *st, weight), static)
    for step, inputs in enumerate(steps):
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(runs[0][step], outs)):
            assert torch.equal(a, b), (step, i)


@pytest.mark.parametrize("k", [4096, 40000])  # one-pass, two-pass
def test_quantize_act_near_ties_round_like_the_reference(k):
    """Values at and a few ulps either side of every (j + 1/2) * scale round half to even, as
    torch.round does (a quantizer that multiplied by 1 / scale would differ on some of them)."""
    gen = _gen(k)
    rows = []
    for scale in (torch.rand(6, generator=gen, device=DEV).double() * 20 - 10).exp2().float():
        halves = (torch.arange(-127, 127, device=DEV, dtype=torch.float32) + 0.5) * scale
        near = [halves]
        for direction in (float("inf"), float("-inf")):
            v = halves
            for _ in range(3):
                v = torch.nextafter(v, torch.full_like(v, direction))
                near.append(v)
        row = torch.cat(near + [torch.tensor([127.0], device=DEV) * scale])
        row = row[row.abs() <= 127 * scale]
        rows.append(torch.cat([row, torch.zeros(k - row.numel(), device=DEV)])[torch.randperm(k, generator=gen,
                                                                                               device=DEV)])
    x = torch.stack(rows)
    poison(x.numel(), torch.int8)
    q, s = cuda.quantize_act(x)
    q_ref, s_ref = ref.quantize_act(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q, q_ref)


def test_quantize_act_strided_and_zero_rows():
    x = torch.randn(6, 512, device=DEV, dtype=torch.float16)
    x[2] = 0  # scale clamps at 1e-8 / 127, codes are 0
    xt = torch.randn(512, 12, device=DEV, dtype=torch.float16).t()  # column-major view
    for inp in (x, xt, x[:, 64:320]):
        q, s = cuda.quantize_act(inp)
        q_ref, s_ref = ref.quantize_act(inp)
        assert torch.equal(q, q_ref) and torch.allclose(s, s_ref, rtol=1e-6, atol=0)


# --- add_rms_norm_quantize_act -------------------------------------------------------------

def _norm_inputs(m, k, dtype, weight, smooth, seed):
    """x, residual, weight (x's dtype) and float32 smoothing as served; row 1 holds a NaN."""
    gen = _gen(seed)
    x, res = (torch.randn(m, k, generator=gen, device=DEV).to(dtype) for _ in range(2))
    if m > 1:
        x[1, 7] = float("nan")
    w = (torch.rand(k, generator=gen, device=DEV) + 0.5).to(dtype) if weight else None
    sm = torch.rand(k, generator=gen, device=DEV) + 0.5 if smooth else None
    return x, res, w, sm


# One vector a thread (K <= 8192, a partial warp at K = 200), two (14336, 16384 = the largest).
@pytest.mark.parametrize("m,k", [(1, 4096), (16, 8192), (64, 4096), (3, 14336), (2, 16384), (5, 200)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight,smooth", [(True, True), (True, False), (False, False)])
def test_add_rms_norm_quantize_act_matches_reference(m, k, dtype, weight, smooth):
    """Outputs poisoned; row 1's NaN gives it a NaN scale and zero codes, its residual kept."""
    x, res, w, sm = _norm_inputs(m, k, dtype, weight, smooth, m * k + weight + 2 * smooth)
    for numel, out_dtype in ((m * k, torch.int8), (m, torch.float32), (m * k, dtype)):
        poison(numel, out_dtype)
    got = cuda.add_rms_norm_quantize_act(x, res, w, 1e-5, sm)
    want = ref.add_rms_norm_quantize_act(*(None if t is None else t.cpu() for t in (x, res, w)), 1e-5,
                                         None if sm is None else sm.cpu())
    assert [t.dtype for t in got] == [torch.int8, torch.float32, dtype]
    assert m == 1 or (torch.isnan(got[1][1]) and (got[0][1] == 0).all())
    assert_norm_quant_close(got, want)


def test_add_rms_norm_quantize_act_errors():
    op = cuda.add_rms_norm_quantize_act
    x = torch.randn(2, 72, device=DEV, dtype=torch.bfloat16)
    for args, message in (
            ((x[:, :60], x[:, :60], None), r"rows of K % 8 == 0 and at most 16384 columns, got K = 60"),
            ((x.float(), x.float(), None), "x must be float16 or bfloat16, got Float"),
            ((x, x.half(), None), "residual must match x"),
            ((x, x, x[0].half()), r"weight must be \[72\] of x's dtype BFloat16, got \[72\] Half"),
            ((x[:, 4:68], x[:, 4:68], None), "rows, weight and smooth must start on 16-byte boundaries"),
            ((x[:, :64], x[:, :64], x[0, 4:68]), "rows, weight and smooth must start on 16-byte boundaries")):
        with pytest.raises(RuntimeError, match=message):
            op(*args, 1e-5)
    with pytest.raises(RuntimeError, match=r"smooth must be \[72\] float32, got \[72\] BFloat16"):
        op(x, x, None, 1e-5, x[0])
    big = torch.randn(1, 16392, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="got K = 16392"):
        op(big, big, None, 1e-5)
    q, s, r = op(x[:0], x[:0], None, 1e-5)  # no rows: nothing launched
    assert (q.shape, s.shape, r.shape) == ((0, 72), (0,), (0, 72))


# --- silu_mul_quantize_act -------------------------------------------------------------------

def _silu_inputs(m, k, dtype, smooth, seed):
    """gate_up [M, 2K] and float32 smoothing as served; row 1 holds a NaN in its up half."""
    gen = _gen(seed)
    gate_up = (torch.randn(m, 2 * k, generator=gen, device=DEV) * 2).to(dtype)
    if m > 1:
        gate_up[1, k + 5] = float("nan")
    sm = torch.rand(k, generator=gen, device=DEV) + 0.5 if smooth else None
    return gate_up, sm


# Rows over clusters of 1-7 CTAs (K = 200: a partial warp; 11008: a short last CTA; 28672:
# Llama-3-70B's), of one CTA (max_cluster 1: two vectors a thread past 8192), of up to 16 smaller
# CTAs (Hopper's non-portable sizes), of the op's own cluster size for M rows (None), M up to 64.
@pytest.mark.parametrize("m,k", [(1, 28672), (3, 14336), (16, 4096), (64, 8192), (5, 200), (2, 11008)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("max_cluster,cta_vecs", [(8, 512), (2, 512), (1, 512), (16, 128), (None, 512)])
def test_silu_mul_quantize_act_matches_reference(m, k, dtype, smooth, max_cluster, cta_vecs):
    """Bit for bit the reference's two torch ops run on the GPU (ATen's silu there; codes through
    the lean arithmetic), within a code of the CPU's; outputs poisoned; row 1's NaN gives it a NaN
    scale and zero codes."""
    clusters = max_cluster or cuda.silu_quant_cluster_for(m, k)
    plan = cuda.silu_quant_plan(k, clusters if torch.cuda.get_device_capability()[0] >= 9 else 1, cta_vecs)
    if plan is None:
        pytest.skip(f"K = {k} does not fit one CTA (sm_80, or max_cluster 1)")
    gate_up, sm = _silu_inputs(m, k, dtype, smooth, m * k + smooth + clusters)
    for numel, out_dtype in ((m * k, torch.int8), (m, torch.float32)):
        poison(numel, out_dtype)
    q, s = cuda.silu_mul_quantize_act(gate_up, sm, max_cluster, cta_vecs)
    q_gpu, s_gpu = ref.silu_mul_quantize_act(gate_up, sm)
    assert (q.dtype, q.shape, s.dtype, s.shape) == (torch.int8, (m, k), torch.float32, (m,))
    assert m == 1 or (torch.isnan(s[1]) and (q[1] == 0).all())
    assert torch.equal(s.nan_to_num(-1.0), s_gpu.nan_to_num(-1.0)) and torch.equal(q, q_gpu)
    q_cpu, s_cpu = ref.silu_mul_quantize_act(gate_up.cpu(), None if sm is None else sm.cpu())
    torch.testing.assert_close(s.cpu(), s_cpu, rtol=2.0 ** -7, atol=0, equal_nan=True)
    assert int((q.cpu().int() - q_cpu.int()).abs().max()) <= 1


def test_silu_mul_quantize_act_errors():
    op = cuda.silu_mul_quantize_act
    x = torch.randn(2, 152, device=DEV, dtype=torch.bfloat16)
    gu = x[:, :144]  # K = 72
    sm = torch.rand(80, device=DEV)
    clusters = torch.cuda.get_device_capability()[0] >= 9
    top = 8 * 1024 * 2 * 8 if clusters else 1024 * 2 * 8
    for args, message in (
            ((gu.float(),), "gate_up must be float16 or bfloat16, got Float"),
            ((x[:, :143],), r"gate_up must be 2-D \[M, 2K\]"),
            ((x[:, :120],), rf"rows of K % 8 == 0 outputs, at most {top} .*got M = 2, K = 60"),
            ((gu, sm[:72].bfloat16()), r"smooth must be \[72\] float32, got \[72\] BFloat16"),
            ((gu, None, 17), "max_cluster must be 1 to 16, got 17"),
            ((gu, None, 0), "max_cluster must be 1 to 16, got 0"),
            ((gu, None, 8, 0), "cta_vecs must be 1 to 2048, got 0"),
            ((gu, None, 8, 2049), "cta_vecs must be 1 to 2048, got 2049"),
            ((x[:, 4:148],), "gate_up's rows and smooth must start on 16-byte boundaries"),
            ((gu, sm[1:73]), "gate_up's rows and smooth must start on 16-byte boundaries")):
        with pytest.raises(RuntimeError, match=message):
            op(*args)
    big = torch.randn(1, 2 * (top + 8), device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"got M = 1, K = {top + 8}"):
        op(big)
    q, s = op(gu[:0])  # no rows: nothing launched
    assert (q.shape, s.shape) == ((0, 72), (0,))


def _fused_op_case(op_name, k):
    """(input to replace, the op of it, the reference of it, the expected log key's tail, the
    closeness check) of one of the decode graphs' fused quantizer ops on rows of k."""
    if op_name == "add_rms_norm_quantize_act":
        x, res, w, sm = _norm_inputs(4, k, torch.bfloat16, True, True, k)
        return (x, lambda t: torch.ops.mixprec.add_rms_norm_quantize_act(t, res, w, 1e-5, sm),
                lambda t: ref.add_rms_norm_quantize_act(t.cpu(), res.cpu(), w.cpu(), 1e-5, sm.cpu()),
                (k, torch.bfloat16, torch.float32), assert_norm_quant_close)

    def bit_exact(got, want):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].nan_to_num(-1.0), want[1].nan_to_num(-1.0))
    gate_up, sm = _silu_inputs(4, k, torch.bfloat16, True, k)
    return (gate_up, lambda t: torch.ops.mixprec.silu_mul_quantize_act(t, sm),
            lambda t: ref.silu_mul_quantize_act(t, sm), (2 * k, torch.float32), bit_exact)


@pytest.mark.parametrize("use_cuda", [True, False])
@pytest.mark.parametrize("op_name,switch,k", [("add_rms_norm_quantize_act", "_NORM_QUANT_CUDA", 4096),
                                              ("silu_mul_quantize_act", "_SILU_QUANT_CUDA", 14336)])
def test_fused_quant_op_picks_its_kernel(op_name, switch, k, use_cuda, monkeypatch):
    """mixprec::add_rms_norm_quantize_act and mixprec::silu_mul_quantize_act take the csrc kernel
    where it applies (unless the benchmarks' switch says Triton), Triton's where it does not
    (K % 8 != 0), log which, and replay in a CUDA graph."""
    from vllm_mixprec import kernels

    monkeypatch.setattr(kernels, switch, use_cuda)
    monkeypatch.setattr(kernels, "_KERNEL_CHOICES_LOGGED", set())
    for k, csrc in ((k, use_cuda), (100, False)):
        x, op, want_of, key, check = _fused_op_case(op_name, k)
        graph, out, _ = capture_after_warmup(op, x)
        for x_new in replays_with_new_inputs(graph, x, k, trials=2):
            check(out, want_of(x_new))
        assert (op_name, csrc, torch.bfloat16, *key) in kernels._KERNEL_CHOICES_LOGGED


# --- graphs, compile, the linear op -------------------------------------------------------

def _checkpoint_layer(n, k, g, gen):
    """A module holding random LiquidQuant weights as a checkpoint stores them."""
    qw, gs, go, cs = random_lqq(n, k, g, gen)
    layer = torch.nn.Module()
    for name, t in (("qweight", qw), ("group_scale", gs), ("group_offset", go), ("channel_scale", cs)):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    return layer, (qw, gs, go, cs)


def _prepared_layer(n, k, g, gen):
    layer, raw = _checkpoint_layer(n, k, g, gen)
    cuda.prepare_weights(layer)
    return layer, raw


@pytest.mark.parametrize("same_stream", [False, True], ids=["capture-stream", "warmup-stream"])
@pytest.mark.parametrize("m,n,k", [(4, 64, 4096), (3, 1024, 1024), (1, 8192, 2048), (100, 256, 512)])
def test_cuda_graph_capture_and_replay(m, n, k, same_stream, tmp_path):
    """(4, 64, 4096) takes split-K. Its arrival counters are one zeroed buffer per stream that
    the kernels leave zero (ops.cpp: split_counters). Captured on the warmup's stream the graph
    reuses that stream's buffer, and eager launches between replays share it; captured on a
    fresh stream (as vLLM does: its warm-ups run elsewhere) it takes the device's buffer, so
    either way the graph holds no fill kernel (the 2026-11-26 profile found 64 a step)."""
    gen = _gen(42)
    layer, raw = _prepared_layer(n, k, 64, gen)
    bias = torch.randn(n, device=DEV, dtype=torch.bfloat16)

    def f(x):
        xq, xs = cuda.quantize_act(x)
        return cuda.w4a8_gemm(xq, xs, layer.qweight, layer.group_scale, layer.group_offset,
                              layer.channel_scale, bias, x.dtype)

    x_static = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # (debug_dump needs the cudaGraph_t kept)
    graph.enable_debug_mode()
    graph, y_static, side = capture_after_warmup(f, x_static, graph, same_stream)
    graph.debug_dump(str(tmp_path / "graph.dot"))
    dot = (tmp_path / "graph.dot").read_text()
    assert "w4a8" in dot, "the dump does not name the GEMM kernel: wrong graph dumped?"
    assert "FillFunctor" not in dot
    for trial in range(3):
        x_new = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=_gen(trial))
        x_static.copy_(x_new)
        with torch.cuda.stream(side if same_stream else torch.cuda.current_stream()):
            graph.replay()
            expect = f(x_new)
        torch.cuda.synchronize()
        assert torch.equal(y_static, expect)
        xq, xs = cuda.quantize_act(x_new)
        check_close(y_static, ref.w4a8_gemm(xq, xs, *raw, bias, torch.float64), torch.bfloat16)


def test_torch_compile_fullgraph_through_fake_impls():
    gen = _gen(7)
    layer, _ = _prepared_layer(256, 512, 128, gen)

    def f(x):
        xq, xs = cuda.quantize_act(x)
        return cuda.w4a8_gemm(xq, xs, layer.qweight, layer.group_scale, layer.group_offset,
                              layer.channel_scale, None, x.dtype)

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    for m in (1, 9):
        x = torch.randn(m, 512, device=DEV, dtype=torch.float16)
        assert torch.equal(compiled(x), f(x))


@pytest.mark.parametrize("smooth", [False, True])
def test_inductor_fuses_act_quant_into_rmsnorm(smooth, monkeypatch):
    """vLLM's default compile path (kernels.apply_linear under torch.compile): RMSNorm then the
    linear, through Inductor on the GPU. The quantization is traced as torch ops and fused by
    Inductor, which may skip the bf16 rounding of the normed h inside its kernel and round its
    divisions differently, so a few codes move by one: relative error, not bit equality."""
    from types import SimpleNamespace

    from vllm_mixprec import kernels
    monkeypatch.setattr(kernels, "_FUSE_ACT_QUANT", True)
    gen = _gen(11)
    prepared, raw = _prepared_layer(512, 1024, 64, gen)
    sm = (torch.rand(1024, generator=gen, device=DEV) + 0.5) if smooth else None
    layer = SimpleNamespace(qweight=prepared.qweight, group_scale=prepared.group_scale,
                            group_offset=prepared.group_offset,
                            channel_scale=prepared.channel_scale, input_smooth=sm,
                            mixprec_impl="cuda", mixprec_scheme="w4a8")

    def block(x, gamma):
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * gamma
        return kernels.apply_linear(layer, h, None), h

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    gamma = (torch.rand(1024, generator=gen, device=DEV) + 0.5).to(torch.bfloat16)
    for m in (1, 7, 300):
        x = torch.randn(m, 1024, generator=gen, device=DEV).to(torch.bfloat16)
        y, h = compiled(x, gamma)
        y_eager, _ = block(x, gamma)
        xq, xs = ref.quantize_act(h, sm)
        want = ref.w4a8_gemm(xq, xs, *raw, None, torch.float64)
        rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
        assert y.dtype == torch.bfloat16 and bool(torch.isfinite(y).all())
        assert rel(y, want) < 1e-2 and rel(y, y_eager) < 1e-2, (m, rel(y, want), rel(y, y_eager))


def test_w4a8_linear_custom_op_cuda_impl():
    gen = _gen(9)
    layer, raw = _prepared_layer(128, 256, 64, gen)
    x = torch.randn(5, 256, device=DEV, dtype=torch.float16)
    smooth = torch.rand(256, device=DEV) + 0.5
    y = torch.ops.mixprec.w4a8_linear(x, layer.qweight, layer.group_scale, layer.group_offset,
                                      layer.channel_scale, None, smooth, "cuda")
    xq, xs = cuda.quantize_act(x, smooth)  # codes checked against the reference elsewhere
    check_close(y, ref.w4a8_gemm(xq, xs, *raw, None, torch.float64), torch.float16)


# --- errors ------------------------------------------------------------------------------

def test_errors_name_the_problem():
    """Every error case raises a Python exception naming the problem (cuda_error_cases.py).

    Run in a child process: a C++ exception lost on its way to Python kills the child, not
    the session, and the output names the case.
    """
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_error_cases.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"exit {r.returncode} (negative: killed by that signal)\n{out[-4000:]}"
    assert "FAIL" not in out and "finite=True" in out, out[-4000:]


def test_prepare_linear_debug_log_names_the_planned_launches(caplog):
    """The linear method's debug log (kernels.prepare_linear) on a real sm_90 layer: one line
    with the csrc plan at each M, from the planner w4a8_gemm runs (cuda.describe_plans)."""
    import logging

    from vllm_mixprec import kernels
    layer, _ = _checkpoint_layer(6144, 4096, 128, _gen(7))
    layer.mixprec_in_features, layer.mixprec_out_features = 4096, 6144
    with caplog.at_level(logging.DEBUG, logger=kernels.logger.name):
        kernels.prepare_linear(layer, "w4a8", "model.layers.0.self_attn.qkv_proj")
    assert layer.mixprec_impl == "cuda"
    lines = [r.getMessage() for r in caplog.records if "csrc plans" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    expect = cuda.describe_plans(6144, 4096, 128, layer.qweight.device)
    assert lines[0].endswith(expect) and "M=1 " in expect and "M=4096 wgmma" in expect, lines[0]
