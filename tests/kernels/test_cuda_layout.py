"""The CUDA W4A8 weight layout, on the CPU: repack/unpack, the kernel's register recipe, errors.

`emulate_w4a8_dequant_reference` replays the kernel's dequantisation and the mma.m16n8k32
fragment placement in torch, so a wrong index in the layout shows up here without a GPU.
"""
import pytest
import torch

from vllm_mixprec import reference as ref
from vllm_mixprec.kernels import cuda

SHAPES = [(16, 64, 64), (32, 256, 64), (48, 512, 128), (64, 384, 128), (16, 1024, 64), (80, 640, 128)]


def _random_checkpoint(n, k, g, gen):
    """Arbitrary bytes: the repack is a permutation and must not care about values."""
    return (torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
            torch.randint(0, 256, (n, k // g), generator=gen, dtype=torch.uint8),
            torch.randint(0, 256, (n, k // g), generator=gen, dtype=torch.uint8))


def _lqq_checkpoint(n, k, g, gen):
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    w[:, :: max(1, k // 7)] *= 8  # a few outliers, so the groups use different steps
    t = ref.quantize_weight_lqq(w, g)
    return t["qweight"], t["group_scale"], t["group_offset"]


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_repack_round_trip(n, k, g, seeded):
    qw, gs, go = _random_checkpoint(n, k, g, seeded)
    packed, gparams = cuda.repack_w4a8_reference(qw, gs, go)
    assert packed.dtype == torch.uint8 and packed.shape == (n // 16, 8 * k) and packed.is_contiguous()
    assert gparams.dtype == torch.int32 and gparams.shape == (n // 16, k // g, 8) and gparams.is_contiguous()
    q2, s2, o2 = cuda.unpack_w4a8_reference(packed, gparams)
    assert torch.equal(q2, qw) and torch.equal(s2, gs) and torch.equal(o2, go)


@pytest.mark.parametrize("n,k,g", SHAPES)
def test_kernel_recipe_reproduces_reference_weights(n, k, g, seeded):
    qw, gs, go = _lqq_checkpoint(n, k, g, seeded)
    packed, gparams = cuda.repack_w4a8_reference(qw, gs, go)
    w8 = cuda.emulate_w4a8_dequant_reference(packed, gparams)
    assert torch.equal(w8, ref.dequantize_weight_w8(qw, gs, go))


def test_layout_bytes_spelled_out():
    """One hand-checked position: lane 5 (g=1, t=1), word 3 of tile 0, chunk 1.

    Word 3 = step 1, odd channel: channel 2*1 + 1 = 3, k0 = 64 + 16*1 + 8 = 88; byte 2 holds
    nibbles of k = 90 (low) and 94 (high).
    """
    n, k, g = 16, 128, 64
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[3, 90], q[3, 94] = 0x7, 0xA
    qw = q[:, 0::2] | (q[:, 1::2] << 4)
    gs = torch.ones(n, k // g, dtype=torch.uint8)
    gs[3, 1], gs[2, 1] = 5, 9
    go = torch.full((n, k // g), 128, dtype=torch.uint8)
    go[3, 1] = 200
    packed, gparams = cuda.repack_w4a8_reference(qw, gs, go)
    offset = 1 * 512 + 5 * 16 + 3 * 4 + 2
    assert int(packed[0, offset]) == 0xA7
    assert int(packed[0].count_nonzero()) == 1
    word = int(gparams[0, 1, 1]) & 0xFFFFFFFF  # channels 2 and 3, group 1
    assert word == 9 | (128 << 8) | (5 << 16) | (200 << 24)


def test_gparams_word_byte_order():
    n, k, g = 32, 128, 64
    gs = (torch.arange(n)[:, None] * 2 + torch.arange(k // g)[None, :]).to(torch.uint8) + 1
    go = gs + 100
    _, gparams = cuda.repack_w4a8_reference(torch.zeros(n, k // 2, dtype=torch.uint8), gs, go)
    raw = gparams.view(torch.uint8).view(n // 16, k // g, 8, 4)
    for tile in range(n // 16):
        for grp in range(k // g):
            for gi in range(8):
                ch = tile * 16 + 2 * gi
                assert raw[tile, grp, gi].tolist() == [int(gs[ch, grp]), int(go[ch, grp]),
                                                     int(gs[ch + 1, grp]), int(go[ch + 1, grp])]


@pytest.mark.parametrize("n,k,groups,match", [
    (24, 128, 2, r"N \(out_features\) % 16"),
    (16, 128, 4, r"group size of 64"),       # G = 32
    (16, 192, 1, r"group size of 64"),       # G = 192 = 64 * 3
    (16, 128, 3, r"not a multiple"),
])
def test_repack_rejects_bad_shapes(n, k, groups, match):
    qw = torch.zeros(n, k // 2, dtype=torch.uint8)
    gs = torch.ones(n, groups, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        cuda.repack_w4a8_reference(qw, gs, gs.clone())


def test_repack_rejects_bad_dtypes_and_mismatch():
    qw = torch.zeros(16, 64, dtype=torch.int8)
    gs = torch.ones(16, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        cuda.repack_w4a8_reference(qw, gs, gs)
    with pytest.raises(ValueError, match="does not match"):
        cuda.repack_w4a8_reference(qw.view(torch.uint8), gs, gs[:, :1])


def test_unpack_rejects_bad_shapes():
    with pytest.raises(ValueError, match="packed qweight"):
        cuda.unpack_w4a8_reference(torch.zeros(1, 100, dtype=torch.uint8), torch.zeros(1, 1, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="gparams"):
        cuda.unpack_w4a8_reference(torch.zeros(1, 512, dtype=torch.uint8), torch.zeros(1, 1, 4, dtype=torch.int32))


def test_prepare_weights_swaps_parameters(seeded):
    n, k, g = 32, 256, 64
    qw, gs, go = _lqq_checkpoint(n, k, g, seeded)
    layer = torch.nn.Module()
    for name, t in (("qweight", qw), ("group_scale", gs), ("group_offset", go),
                    ("channel_scale", torch.rand(n, generator=seeded, dtype=torch.float64) + 0.1)):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    cuda.prepare_weights(layer)
    assert layer.qweight.shape == (n // 16, 8 * k) and layer.group_scale.dtype == torch.int32
    assert layer.group_offset.numel() == 0
    assert layer.channel_scale.dtype == torch.float32
    assert all(not p.requires_grad for p in layer.parameters())
    q2, s2, o2 = cuda.unpack_w4a8_reference(layer.qweight.data, layer.group_scale.data)
    assert torch.equal(q2, qw) and torch.equal(s2, gs) and torch.equal(o2, go)


def test_ops_registered_with_meta_shapes():
    if not cuda.available():
        pytest.skip(f"csrc ops not built: {cuda.load_error()}")

    def meta(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    y = torch.ops.mixprec_C.w4a8_gemm(meta(3, 128, dtype=torch.int8), meta(3), meta(2, 1024, dtype=torch.uint8),
                                      meta(2, 2, 8, dtype=torch.int32), meta(32), None, torch.bfloat16)
    assert y.shape == (3, 32) and y.dtype == torch.bfloat16
    q, s = torch.ops.mixprec_C.quantize_act(meta(5, 64, dtype=torch.float16), None)
    assert q.shape == (5, 64) and q.dtype == torch.int8 and s.shape == (5,) and s.dtype == torch.float32
    # the wgmma k order flags (trailing, defaulted): same shapes
    y = torch.ops.mixprec_C.w4a8_gemm(meta(3, 128, dtype=torch.int8), meta(3), meta(2, 1024, dtype=torch.uint8),
                                      meta(2, 2, 8, dtype=torch.int32), meta(32), None, torch.float16, -1, 0, True)
    assert y.shape == (3, 32) and y.dtype == torch.float16
    q, s = torch.ops.mixprec_C.quantize_act(meta(5, 64, dtype=torch.float16), None, True)
    assert q.shape == (5, 64) and q.dtype == torch.int8
    # the KV4 decode page kernel mutates out / part_o / part_lse and returns nothing
    i32 = dict(dtype=torch.int32)
    res = torch.ops.mixprec_C.decode_kv4_pages(
        meta(2, 8, 128, dtype=torch.bfloat16), meta(9, 2, 16, 136, dtype=torch.uint8), meta(2, 4, **i32),
        meta(2, **i32), meta(3, **i32), meta(2, 8, 128, dtype=torch.bfloat16), meta(8, 8, 128), meta(8, 8),
        None, 0.1, 2, 4, 4, 16, 128, 1, 4)
    assert res is None


def _u32(t):
    """[..., 4] uint8 -> [...] int64 little-endian words."""
    return (t.to(torch.int64) << (8 * torch.arange(4))).sum(-1)


def _bytes_i8(word):
    """[...] int64 word -> [..., 4] int8 lanes."""
    return ((word[..., None] >> (8 * torch.arange(4))) & 0xFF).to(torch.uint8).view(torch.int8)


def _simulate_warp_tile(packed, gparams, x, tile, group_shift, unsigned=False):
    """One warp of the kernel on one 16-channel tile and 8 tokens, fragment by fragment.

    Builds the mma.m16n8k32 A/B operands from what each lane holds (as the kernel code
    loads and dequantises them), multiplies them as the PTX ISA defines the fragments
    (A: reg i byte b -> row g + 8*(i&1), col 4t + b + 16*(i>>1); B: reg i byte b -> row
    4t + b + 16i, col g; C: reg i -> row g + 8*(i>>1), col 2t + (i&1)), and scatters C the
    way the epilogue does (MMA rows g, g+8 -> channels 2g, 2g+1). Returns y[token, channel].
    unsigned: the decode_u8 path; A holds u = w8 + 128 (no XOR, u8 x s8 MMA), and each lane
    subtracts 128 * sum_k x of its C registers' tokens as subtract_unsigned_offset does (lane
    (g, t) sums token g's x over its k-slice; the 4 t-lanes' sums add up; C register i is token
    2t + (i & 1), fetched from lane 4 * (2t + (i & 1))).
    """
    chunks = packed.shape[1] // 512
    lanes = torch.arange(32)
    g, t = lanes // 4, lanes % 4
    d = torch.zeros(16, 8, dtype=torch.int64)
    flip = 0 if unsigned else 0x80808080
    xsum = torch.zeros(32, dtype=torch.int64)  # per lane (unsigned)
    for c in range(chunks):
        words = _u32(packed[tile, c * 512:(c + 1) * 512].view(32, 4, 4))  # lane, j
        pw = gparams[tile, c >> group_shift].to(torch.int64) & 0xFFFFFFFF  # g -> word
        pw = pw[g]  # per lane
        a = torch.zeros(2, 4, 32, dtype=torch.int64)  # step, reg, lane
        for j in range(4):
            p = j & 1
            s = (pw >> (16 * p)) & 0xFF
            off = ((pw >> (16 * p + 8)) & 0xFF) * 0x01010101
            lo, hi = words[:, j] & 0x0F0F0F0F, (words[:, j] >> 4) & 0x0F0F0F0F
            a[j >> 1, p] = ((lo * s + off) & 0xFFFFFFFF) ^ flip
            a[j >> 1, 2 + p] = ((hi * s + off) & 0xFFFFFFFF) ^ flip
        xv = _u32(x[g][:, None, c * 64:(c + 1) * 64].reshape(32, 4, 16)[lanes, t].view(32, 4, 4).view(torch.uint8))
        xsum += _bytes_i8(xv).to(torch.int64).sum((1, 2))
        for step in range(2):
            A = torch.zeros(16, 32, dtype=torch.int64)
            B = torch.zeros(32, 8, dtype=torch.int64)
            for i in range(4):
                vals = _bytes_i8(a[step, i])  # lane, byte
                vals = (vals.view(torch.uint8) if unsigned else vals).to(torch.int64)
                for b in range(4):
                    A[g + 8 * (i & 1), 4 * t + b + 16 * (i >> 1)] = vals[:, b]
            for i in range(2):
                vals = _bytes_i8(xv[:, 2 * step + i]).to(torch.int64)
                for b in range(4):
                    B[4 * t + b + 16 * i, g] = vals[:, b]
            d += A @ B
    if unsigned:
        token_sum = xsum.view(8, 4).sum(1)  # the two shfl_xor steps: token g's sum on every lane g
        for i in range(4):
            row, col = g + 8 * (i >> 1), 2 * t + (i & 1)
            d[row, col] -= 128 * token_sum[col]  # __shfl_sync from lane 4 * col
    y = torch.zeros(8, 16, dtype=torch.int64)
    for i in range(4):
        row, col = g + 8 * (i >> 1), 2 * t + (i & 1)
        y[col, 2 * (row % 8) + row // 8] = d[row, col]  # c_i -> (token, channel)
    return y


@pytest.mark.parametrize("unsigned", [False, True])
@pytest.mark.parametrize("k,g", [(128, 64), (256, 128)])
def test_fragment_level_simulation_matches_integer_gemm(k, g, unsigned, seeded):
    n = 32
    qw, gs, go = _lqq_checkpoint(n, k, g, seeded)
    packed, gparams = cuda.repack_w4a8_reference(qw, gs, go)
    x = torch.randint(-127, 128, (8, k), generator=seeded, dtype=torch.int8)
    w8 = ref.dequantize_weight_w8(qw, gs, go).to(torch.int64)
    expect = x.to(torch.int64) @ w8.T  # [8, N]
    for tile in range(n // 16):
        y = _simulate_warp_tile(packed, gparams, x, tile, (g // 64).bit_length() - 1, unsigned)
        assert torch.equal(y, expect[:, tile * 16:(tile + 1) * 16])


def _dp4a_u8s8(a, b):
    """IDP.4A u8 x s8 of [lanes] int64 words: the 4 byte products summed."""
    return (_bytes_i8(a).view(torch.uint8).to(torch.int64) * _bytes_i8(b).to(torch.int64)).sum(-1)


def _simulate_dp4a_one_token(packed, gparams, x0, tile, group_shift, chunk_ranges):
    """One warp of the decode kernel's IDP.4A form (decode_dp4a, M = 1) on one 16-channel tile, as
    dp4a_codes_one_token and apply_group_one_token compute it: the 4-bit codes (high nibbles left
    times 16) dotted with the lane's 16 activations, then per group's share (two chunks of one group
    when the group is >= 128 and the share starts at an even chunk, else one) each row scaled by
    its group scale and offset by (a - 128) * sum(x); the 4 t-lanes' k-slices summed last
    (sum_one_token_slices); lane (g, 0) holds rows g / g + 8, i.e. channels 2g / 2g + 1.
    chunk_ranges: the warps' [lo, hi) chunk ranges. Returns y[channel] of token 0."""
    lanes = torch.arange(32)
    g, t = lanes // 4, lanes % 4
    c0 = torch.zeros(32, dtype=torch.int64)  # C register 0 (row g) and 2 (row g + 8) per lane
    c2 = torch.zeros(32, dtype=torch.int64)
    lo, hi = 0x0F0F0F0F, 0xF0F0F0F0
    for c_lo, c_hi in chunk_ranges:
        step = 2 if group_shift > 0 else 1
        assert c_lo % step == 0 and (c_hi - c_lo) % step == 0, "a pair must not straddle two groups"
        for c in range(c_lo, c_hi, step):
            sums = [torch.zeros(32, dtype=torch.int64) for _ in range(4)]
            x_sum = torch.zeros(32, dtype=torch.int64)
            for cc in range(c, c + step):
                w = _u32(packed[tile, cc * 512:(cc + 1) * 512].view(32, 4, 4))  # lane, word j
                xv = _u32(x0[cc * 64:(cc + 1) * 64].view(torch.uint8).view(4, 4, 4))[t]  # lane, x.x .. x.w
                x_sum += _bytes_i8(xv).to(torch.int64).sum((1, 2))
                sums[0] += _dp4a_u8s8(w[:, 0] & lo, xv[:, 0]) + _dp4a_u8s8(w[:, 2] & lo, xv[:, 2])
                sums[1] += _dp4a_u8s8(w[:, 0] & hi, xv[:, 1]) + _dp4a_u8s8(w[:, 2] & hi, xv[:, 3])
                sums[2] += _dp4a_u8s8(w[:, 1] & lo, xv[:, 0]) + _dp4a_u8s8(w[:, 3] & lo, xv[:, 2])
                sums[3] += _dp4a_u8s8(w[:, 1] & hi, xv[:, 1]) + _dp4a_u8s8(w[:, 3] & hi, xv[:, 3])
            assert bool((sums[1] % 16 == 0).all() and (sums[3] % 16 == 0).all())  # the >> 4 is exact
            pw = (gparams[tile, c >> group_shift].to(torch.int64) & 0xFFFFFFFF)[g]  # the first chunk's group
            s_even, s_odd = pw & 0xFF, (pw >> 16) & 0xFF
            a_even, a_odd = ((pw >> 8) & 0xFF) - 128, ((pw >> 24) & 0xFF) - 128
            c0 += s_even * (sums[0] + (sums[1] >> 4)) + a_even * x_sum
            c2 += s_odd * (sums[2] + (sums[3] >> 4)) + a_odd * x_sum
    c0, c2 = c0.view(8, 4).sum(1), c2.view(8, 4).sum(1)  # the two shfl_xor steps, per g
    y = torch.zeros(16, dtype=torch.int64)
    y[0::2], y[1::2] = c0, c2
    return y


def _dp4a_chunk_ranges(chunks, splits, warps=8):
    """The decode kernel's [lo, hi) chunk range per split and warp in its IDP.4A form: split and
    warp shares rounded up to even chunks (w4a8_decode_kernel's kAlign)."""
    up2 = lambda n: -(-n // 2) * 2  # noqa: E731
    per_split, ranges = up2(-(-chunks // splits)), []
    for s in range(splits):
        split_lo = min(chunks, s * per_split)
        split_hi = min(chunks, split_lo + per_split)
        per_warp = up2(-(-(split_hi - split_lo) // warps))
        for w in range(warps):
            c_lo = min(split_hi, split_lo + w * per_warp)
            ranges.append((c_lo, min(split_hi, c_lo + per_warp)))
    return ranges


@pytest.mark.parametrize("k,g,splits", [(128, 64, 1), (256, 128, 1), (512, 64, 1), (3328, 128, 1), (3328, 128, 3),
                                          (3328, 128, 5), (1728, 64, 5), (4608, 128, 5)])
def test_dp4a_one_token_simulation_matches_integer_gemm(k, g, splits, seeded):
    """decode_dp4a's arithmetic on the packed layout gives the int8 weights' exact sums at M = 1:
    the identity (q*s + a) ^ 0x80 = q*s + a - 128 (as s8), the word / activation pairing, and the
    pairs of chunks scaled once, over the kernel's even-aligned warp ranges (some empty)."""
    n = 48
    qw, gs, go = _lqq_checkpoint(n, k, g, seeded)
    packed, gparams = cuda.repack_w4a8_reference(qw, gs, go)
    x0 = torch.randint(-127, 128, (k,), generator=seeded, dtype=torch.int8)
    w8 = ref.dequantize_weight_w8(qw, gs, go).to(torch.int64)
    expect = w8 @ x0.to(torch.int64)  # [N]
    ranges = _dp4a_chunk_ranges(k // 64, splits)
    covered = [c for lo, hi in ranges for c in range(lo, hi)]
    assert covered == list(range(k // 64))  # every chunk once
    for tile in range(n // 16):
        y = _simulate_dp4a_one_token(packed, gparams, x0, tile, (g // 64).bit_length() - 1, ranges)
        assert torch.equal(y, expect[tile * 16:(tile + 1) * 16])
