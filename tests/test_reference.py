"""reference.py against independent float64 math."""
import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _block_magnitudes(m, k, gen, lo, hi):
    """N(0, 1) activations whose 128-channel blocks range in magnitude from 10^lo to 10^hi."""
    mag = torch.logspace(lo, hi, k // F.ACT_BLOCK).repeat_interleave(F.ACT_BLOCK)
    return torch.randn(m, k, generator=gen) * mag


def test_quantize_act_per_token(seeded):
    x = torch.randn(9, 256, generator=seeded) * torch.logspace(-2, 2, 9)[:, None]
    q, s = ref.quantize_act(x)
    assert q.dtype == torch.int8 and s.shape == (9,)
    assert q.abs().amax(1).eq(127).all()  # the largest element of every token maps to +-127
    assert _rel(q.float() * s[:, None], x) < 0.01


def test_quantize_act_smooth_divides(seeded):
    x = torch.randn(4, 128, generator=seeded)
    sm = torch.rand(128, generator=seeded) + 0.5
    assert torch.equal(ref.quantize_act(x, sm)[0], ref.quantize_act(x / sm)[0])


@pytest.mark.parametrize("dtype,weight", [(torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)])
def test_add_rms_norm_is_vllms_native_form(seeded, dtype, weight):
    """reference.add_rms_norm is vLLM 0.26's fused_add_rms_norm IR op as it runs on the CPU (its
    native implementation), bit for bit; add_rms_norm_quantize_act quantizes its normed row."""
    import vllm.ir.ops as ir_ops

    x, res = ((torch.randn(5, 96, generator=seeded) * 3).to(dtype) for _ in range(2))
    w = (torch.rand(96, generator=seeded) + 0.5).to(dtype) if weight else None
    y, h = ref.add_rms_norm(x, res, w, 1e-5)
    want_y, want_h = ir_ops.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(y, want_y) and torch.equal(h, want_h) and y.dtype == h.dtype == dtype
    q, s, r = ref.add_rms_norm_quantize_act(x, res, w, 1e-5)
    want_q, want_s = ref.quantize_act(want_y)
    assert torch.equal(q, want_q) and torch.equal(s, want_s) and torch.equal(r, want_h)


def test_w4a8_gemm_matches_float64(seeded):
    m, n, k, g = 7, 40, 256, 64
    w = torch.randn(n, k, generator=seeded, dtype=torch.float64)
    t = ref.quantize_weight_lqq(w, g)
    x = torch.randn(m, k, generator=seeded, dtype=torch.float64)
    xq, xs = ref.quantize_act(x)
    bias = torch.randn(n, generator=seeded, dtype=torch.float64)
    y = ref.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                      bias, torch.float64)
    w_hat = ref.dequantize_weight(t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                                  torch.float64)
    expect = (xq.double() * xs.double()[:, None]) @ w_hat.T + bias
    assert _rel(y, expect) < 1e-12
    # and the quantized layer is close to the float one
    assert _rel(y, x @ w.T + bias) < 0.15


def test_w4ax_gemm_one_8bit_block_equals_w4a8(seeded):
    """K = one activation block, all 8-bit: the block scale is the token scale."""
    m, n, k = 3, 32, F.ACT_BLOCK
    w = torch.randn(n, k, generator=seeded)
    t = ref.quantize_weight_lqq(w, 64)
    x = torch.randn(m, k, generator=seeded)
    ident = torch.arange(k, dtype=torch.int32)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, ident, k)
    assert x4.shape == (m, 0) and s4.shape == (m, 0)
    args = (t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    y = ref.w4ax_gemm(x8, s8, x4, s4, *args, out_dtype=torch.float64)
    xq, xs = ref.quantize_act(x)
    assert torch.equal(x8, xq) and torch.equal(s8[:, 0], xs)
    assert torch.allclose(y, ref.w4a8_gemm(xq, xs, *args, out_dtype=torch.float64))


def test_w4ax_scales_per_token_block(seeded):
    m, k, k8 = 4, 640, 256
    x = _block_magnitudes(m, k, seeded, -3, 3)
    perm = torch.randperm(k, generator=seeded).to(torch.int32)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, k8)
    assert x8.shape == (m, k8) and s8.shape == (m, 2) and x4.shape == (m, (k - k8) // 2)
    assert s4.shape == (m, 3) and s8.dtype == s4.dtype == torch.float32
    blocks = x[:, perm.long()].double().view(m, -1, F.ACT_BLOCK).abs().amax(-1)
    assert torch.equal(s8, (blocks[:, :2] / F.A8_MAX).float())
    assert torch.equal(s4, (blocks[:, 2:] / F.A4_TOP).float())
    # every block's largest value maps to the end of its grid, whatever its magnitude: a nibble
    # q stands for q + 1/2, so the ends are 7 (+7.5) and -8 (-7.5)
    q4 = F.unpack_int4(x4).view(m, 3, F.ACT_BLOCK)
    assert (q4.double() + 0.5).abs().amax(-1).eq(F.A4_TOP).all()
    assert x8.view(m, 2, F.ACT_BLOCK).abs().amax(-1).eq(F.A8_MAX).all()
    # and the dequantization is within half a step of each block's own scale
    xd = ref.dequantize_act_w4ax(x8, s8, x4, s4).double()
    step = torch.cat([s8, s4], 1).double().repeat_interleave(F.ACT_BLOCK, 1)
    assert ((xd - x[:, perm.long()].double()).abs() <= 0.5 * step * (1 + 1e-6)).all()


def test_w4ax_4bit_grid_is_the_16_half_integers(seeded):
    """formats.A4_TOP: a 4-bit block's values round to the nearest of (q + 1/2) * s, q in
    [-8, 7], s = max|block| / 7.5; all 16 nibbles occur, zero is not a level, and the error is
    at most s / 2 (the integer grid -7..7 with s = max / 7 wastes the nibble -8)."""
    m, k = 64, 4 * F.ACT_BLOCK
    x = torch.randn(m, k, generator=seeded, dtype=torch.float64)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, torch.arange(k, dtype=torch.int32), 0)
    q = F.unpack_int4(x4).double()
    assert set(q.unique().tolist()) == set(range(-8, 8))
    s = s4.double().repeat_interleave(F.ACT_BLOCK, 1)
    assert torch.equal(q, torch.floor(x / s).clamp(-8, 7))  # the nearest half-integer
    xd = ref.dequantize_act_w4ax(x8, s8, x4, s4).double()
    assert torch.allclose(xd, (q + 0.5) * s, rtol=1e-6, atol=0) and not (xd == 0).any()
    assert ((xd - x).abs() <= 0.5 * s * (1 + 1e-6)).all()


def test_w4ax_small_4bit_block_keeps_its_resolution(seeded):
    """Two 4-bit blocks 10^4 apart in magnitude. With one scale per token (the old format) the
    small block rounds to zero; with one per (token, block) it keeps 4-bit resolution. The
    weights are zero on the large block, so the output is the small block's contribution."""
    m, n, k = 6, 48, 2 * F.ACT_BLOCK
    x = torch.randn(m, k, generator=seeded, dtype=torch.float64)
    x[:, :F.ACT_BLOCK] *= 100.0
    x[:, F.ACT_BLOCK:] *= 0.01
    w = torch.randn(n, k, generator=seeded, dtype=torch.float64)
    w[:, :F.ACT_BLOCK] = 0
    t = ref.quantize_weight_lqq(w, 64)
    ident = torch.arange(k, dtype=torch.int32)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, ident, 0)
    assert s4.shape == (m, 2) and (s4[:, 0] > 1000 * s4[:, 1]).all()
    y = ref.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                      t["channel_scale"], out_dtype=torch.float64)
    w_hat = ref.dequantize_weight(t["qweight"], t["group_scale"], t["group_offset"],
                                  t["channel_scale"], torch.float64)
    assert (w_hat[:, :F.ACT_BLOCK] == 0).all()
    exact = x @ w_hat.T  # float64: the activations' quantization error alone
    assert _rel(y, exact) < 0.25
    # the old per-token scale, max|x4| / 7 over both blocks, leaves nothing of the small block
    per_token = x.abs().amax(1, keepdim=True).float().double() / F.A4_MAX
    old = (torch.round(x / per_token).clamp(-7, 7) * per_token) @ w_hat.T
    assert _rel(old, exact) > 0.99


def test_w4ax_gemm_matches_float64(seeded):
    """Per-block exact integer dots, each times its block scale: equal (to float64 rounding) to
    the dequantized activations times the dequantized weights, plus bias."""
    m, n, k, k8 = 5, 40, 512, 128
    x = _block_magnitudes(m, k, seeded, -2, 2)
    t = ref.quantize_weight_lqq(torch.randn(n, k, generator=seeded, dtype=torch.float64), 128)
    bias = torch.randn(n, generator=seeded, dtype=torch.float64)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, torch.arange(k), k8)
    y = ref.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                      t["channel_scale"], bias, torch.float64)
    xd = torch.cat([x8.double(), F.unpack_int4(x4).double() + 0.5], 1) * torch.cat(
        [s8, s4], 1).double().repeat_interleave(F.ACT_BLOCK, 1)
    w_hat = ref.dequantize_weight(t["qweight"], t["group_scale"], t["group_offset"],
                                  t["channel_scale"], torch.float64)
    assert _rel(y, xd @ w_hat.T + bias) < 1e-12


def test_w4ax_permutation_is_consistent(seeded):
    """Permuting activations and weight K identically leaves the product unchanged."""
    m, n, k, k8 = 4, 32, 512, 128
    w = torch.randn(n, k, generator=seeded)
    x = torch.randn(m, k, generator=seeded)
    perm = torch.randperm(k, generator=seeded).to(torch.int32)
    t = ref.quantize_weight_lqq(w[:, perm.long()], 64)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, k8)
    assert x8.shape == (m, k8) and x4.shape == (m, (k - k8) // 2)
    assert s8.shape == (m, 1) and s4.shape == (m, 3)
    y = ref.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                      t["channel_scale"], out_dtype=torch.float64)
    assert _rel(y, x.double() @ w.double().T) < 0.25  # 4-bit activations on 3/4 of K


def test_w4ax_nonfinite_row_poisons_every_block(seeded):
    """A NaN/Inf anywhere in a token row: NaN in all of its scales (both parts), zero codes."""
    m, k, k8 = 3, 512, 128
    x = torch.randn(m, k, generator=seeded)
    x[1, 400] = float("inf")  # lands in some 4-bit block after the permutation below
    perm = torch.randperm(k, generator=seeded)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, k8)
    assert torch.isnan(s8[1]).all() and torch.isnan(s4[1]).all()
    assert (x8[1] == 0).all() and (x4[1] == 0).all()
    assert torch.isfinite(s8[[0, 2]]).all() and torch.isfinite(s4[[0, 2]]).all()
    with pytest.raises(ValueError, match="k8=64"):
        ref.quantize_act_w4ax(x, perm, 64)


@pytest.mark.parametrize("k8", [0, 128, 512])
def test_w4ax_rotation_quantizes_rotated_4bit_blocks(seeded, k8):
    """act_rotation: the 8-bit part is untouched; each 4-bit block is x_b @ H, rounded to within
    half a step of its own scale (oracle: the rotation written out in float64)."""
    m, k = 6, 512
    x = _block_magnitudes(m, k, seeded, -1, 1)
    perm = torch.randperm(k, generator=seeded)
    h = F.hadamard()
    plain = ref.quantize_act_w4ax(x, perm, k8)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, k8, act_rotation="hadamard")
    assert torch.equal(x8, plain[0]) and torch.equal(s8, plain[1])
    blocks = x.double()[:, perm][:, k8:].reshape(m, -1, F.ACT_BLOCK) @ h.double()
    assert torch.allclose(s4.double(), blocks.abs().amax(-1) / F.A4_TOP, rtol=1e-6)
    err = (F.unpack_int4(x4).double().view_as(blocks) + 0.5) * s4.double()[..., None] - blocks
    assert bool((err.abs() <= s4.double()[..., None] * (0.5 + 1e-5)).all())


def test_w4ax_rotated_basis_is_the_same_gemm(seeded):
    """(x_b H)(W_b H)^T = x_b W_b^T: the weight stored in the rotated basis gives the float64
    product of the original x and W, up to the quantization of both."""
    m, n, k, k8 = 8, 48, 512, 128
    w = torch.randn(n, k, generator=seeded, dtype=torch.float64)
    x = torch.randn(m, k, generator=seeded)
    perm = torch.randperm(k, generator=seeded).to(torch.int32)
    h = F.hadamard()
    wb = ref.rotate_a4_blocks(w[:, perm.long()], k8, h)
    assert _rel(ref.w4ax_act_input(x, perm, k8, None, "hadamard").double() @ wb.T, x.double() @ w.T) < 1e-6
    t = ref.quantize_weight_lqq(wb, 64)
    y = ref.w4ax_gemm(*ref.quantize_act_w4ax(x, perm, k8, act_rotation="hadamard"), t["qweight"],
                      t["group_scale"], t["group_offset"], t["channel_scale"],
                      out_dtype=torch.float64)
    assert _rel(y, x.double() @ w.T) < 0.25


def test_w4ax_rotation_spreads_spikes_inside_a_block(seeded):
    """One spike per token in every 4-bit block (at a random channel, so the permutation cannot
    isolate it): unrotated, the spike sets the block's step and the rest rounds to zero; rotated,
    the spike is spread over the block's 128 channels. The point of act_rotation."""
    m, k = 64, 512
    x = torch.randn(m, k, generator=seeded)
    spikes = torch.randint(0, F.ACT_BLOCK, (m, k // F.ACT_BLOCK), generator=seeded)
    spikes += torch.arange(0, k, F.ACT_BLOCK)
    x.scatter_(1, spikes, 25.0)
    ident = torch.arange(k)

    def act_error(rotation):
        xq = ref.dequantize_act_w4ax(*ref.quantize_act_w4ax(x, ident, 0, act_rotation=rotation))
        return _rel(ref.rotate_a4_blocks(xq, 0, F.act_rotation_matrix(rotation)), x)  # H^-1 = H

    assert act_error("hadamard") < 0.5 * act_error("none")


@pytest.mark.parametrize("rotation", ["hadamard", "hadamard64"])
@pytest.mark.parametrize("k8", [0, 128, 384])
def test_hadamard_a4_blocks_is_the_butterfly_spec_and_the_matrix(seeded, rotation, k8):
    """The fast transform bit for bit against the butterflies written out one channel pair at a
    time (float32, strides 1, 2, .., n/2, then the float32 norm), and within float32 rounding of
    the 4-bit blocks times the rotation's matrix in float64; the 8-bit part untouched."""
    m, k = 3, 512
    x = torch.randn(m, k, generator=seeded) * 4
    got = ref.hadamard_a4_blocks(x, k8, rotation)
    n = F.act_rotation_size(rotation)
    want = x.clone()
    s = 1
    while s < n:
        for i in range(k8, k):
            if (i - k8) & s == 0:
                a, b = want[:, i].clone(), want[:, i + s].clone()
                want[:, i], want[:, i + s] = a + b, a - b
        s *= 2
    want[:, k8:] *= F.hadamard_norm(n)
    assert torch.equal(got, want)
    exact = ref.rotate_a4_blocks(x.double(), k8, F.act_rotation_matrix(rotation))
    assert float((got.double() - exact).abs().max()) < 1e-5 * float(exact.abs().max())
    assert torch.equal(got[:, :k8], x[:, :k8]) and torch.equal(ref.hadamard_a4_blocks(x, k8, "none"), x)


def test_quantize_act_chunked_one_scale_per_chunk(seeded):
    """A8_CHUNK-channel chunks, each with its own scale; where every chunk of a row has the same
    amax, the codes and the scales equal quantize_act's."""
    m, k = 5, 4 * F.A8_CHUNK
    x = torch.randn(m, k, generator=seeded)
    q, s = ref.quantize_act_chunked(x)
    assert q.dtype == torch.int8 and s.shape == (m, k // F.A8_CHUNK) and s.dtype == torch.float32
    assert q.view(m, -1, F.A8_CHUNK).abs().amax(-1).eq(127).all()  # each chunk's largest -> +-127
    x.view(m, -1, F.A8_CHUNK)[..., 0] = 10.0  # the same amax in every chunk
    q, s = ref.quantize_act_chunked(x)
    q1, s1 = ref.quantize_act(x)
    assert torch.equal(q, q1) and torch.equal(s, s1[:, None].expand_as(s))


def test_w4a8_gemm_chunked_matches_float64_and_is_no_worse(seeded):
    m, n, k = 6, 48, 512
    w = torch.randn(n, k, generator=seeded, dtype=torch.float64)
    t = ref.quantize_weight_lqq(w, 64)
    args = (t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    x = _block_magnitudes(m, k, seeded, -2, 1).double()  # chunk magnitudes over three decades
    bias = torch.randn(n, generator=seeded, dtype=torch.float64)
    xq, xs = ref.quantize_act_chunked(x)
    y = ref.w4a8_gemm_chunked(xq, xs, *args, bias, torch.float64)
    w_hat = ref.dequantize_weight(*args, torch.float64)
    x_hat = xq.double() * xs.double().repeat_interleave(F.A8_CHUNK, dim=1)
    assert _rel(y, x_hat @ w_hat.T + bias) < 1e-12
    # per-chunk scales keep the small chunks' resolution: closer to the float layer than per token
    exact = x @ w_hat.T + bias
    xq1, xs1 = ref.quantize_act(x)
    y1 = ref.w4a8_gemm(xq1, xs1, *args, bias, torch.float64)
    assert _rel(y, exact) < 0.8 * _rel(y1, exact)  # 0.61x here


def test_quantize_act_chunked_nonfinite_rows_and_bad_k(seeded):
    x = torch.randn(3, 2 * F.A8_CHUNK, generator=seeded)
    x[1, 100] = float("nan")
    q, s = ref.quantize_act_chunked(x)
    assert torch.isnan(s[1]).all() and (q[1] == 0).all() and torch.isfinite(s[[0, 2]]).all()
    with pytest.raises(ValueError, match="K=96 is not a multiple of the activation chunk 64"):
        ref.quantize_act_chunked(torch.randn(2, 96))


@pytest.mark.parametrize("scheme", ["kv4", "kv8"])
def test_paged_attention_matches_dense(seeded, scheme):
    h, hq, d, b = 2, 4, 64, 16
    lay = F.KVPageLayout(scheme, d, b)
    cache = torch.zeros(lay.cache_shape(8, h), dtype=lay.storage_dtype())
    seq_lens = torch.tensor([5, 37])
    tables = torch.tensor([[3, 0, 0], [6, 1, 4]])
    ks, vs = [], []
    for i, L in enumerate(seq_lens.tolist()):
        k = torch.randn(L, h, d, generator=seeded)
        v = torch.randn(L, h, d, generator=seeded)
        pos = torch.arange(L)
        slots = tables[i][pos // b] * b + pos % b
        ref.reshape_and_cache(k, v, cache, slots, lay)
        ks.append(k), vs.append(v)
    q = torch.randn(3, hq, d, generator=seeded)  # seq 0: 1 query, seq 1: 2 queries
    qsl = torch.tensor([0, 1, 3])
    out = ref.paged_attention(q, cache, lay, tables, seq_lens, qsl, d ** -0.5)
    for i in range(2):
        s, e = int(qsl[i]), int(qsl[i + 1])
        exact = ref.attention(q[s:e], ks[i], vs[i], d ** -0.5)
        tol = 0.15 if scheme == "kv4" else 0.02
        assert _rel(out[s:e], exact) < tol


def test_reshape_and_cache_skips_pad_slots(seeded):
    lay = F.KVPageLayout("kv8", 64, 16)
    cache = torch.zeros(lay.cache_shape(2, 1), dtype=lay.storage_dtype())
    k = torch.randn(2, 1, 64, generator=seeded)
    ref.reshape_and_cache(k, k, cache, torch.tensor([-1, 3]), lay)
    planes = F.kv_planes(cache, lay)
    assert planes["k_scale"][0, 0, 3] > 0
    assert int((planes["k_scale"] != 0).sum()) == 1
