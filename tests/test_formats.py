"""Packed layouts (formats.py) against the references (reference.py)."""
import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref


@pytest.mark.parametrize("k", [2, 8, 130])
def test_nibbles_round_trip(seeded, k):
    q = torch.randint(0, 16, (5, k), generator=seeded)
    p = F.pack_nibbles(q)
    assert p.dtype == torch.uint8 and p.shape == (5, k // 2)
    assert torch.equal(F.unpack_nibbles(p), q.to(torch.uint8))
    # even k in the low nibble, the order every kernel relies on
    assert int(p[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)


def test_int4_round_trip(seeded):
    v = torch.randint(-8, 8, (3, 64), generator=seeded)
    assert torch.equal(F.unpack_int4(F.pack_int4(v)), v.to(torch.int8))


def test_pack_rejects_odd():
    with pytest.raises(ValueError, match="odd"):
        F.pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


def test_w4_layout_errors_name_the_field():
    with pytest.raises(ValueError, match="group_size=32"):
        F.W4Layout(64, 256, 32)
    with pytest.raises(ValueError, match="in_features=100"):
        F.W4Layout(64, 100, 64)
    with pytest.raises(ValueError, match="in_features=200"):
        F.W4ActLayout(200, 0)
    with pytest.raises(ValueError, match="num_a8_blocks=3"):
        F.W4ActLayout(256, 3)


def test_lqq_lane_recipe_matches_formula():
    """Exhaustive over step, min and code: (q*s + a) ^ 0x80 == q*s + min when the lane fits."""
    q = torch.arange(16)[:, None, None]
    s = torch.arange(1, F.MAX_GROUP_STEP + 1)[None, :, None]
    mn = torch.arange(-F.W8_PROTECT, F.W8_PROTECT + 1)[None, None, :]
    fits = (q * s + mn) <= 127
    got = F.lqq_dequant_lanes(q, s, (128 + mn).to(torch.uint8)).to(torch.int32)
    assert torch.equal(got[fits.expand_as(got)], (q * s + mn).expand_as(got)[fits.expand_as(got)])


def test_lqq_packed_word_four_lanes(seeded):
    for _ in range(2000):
        qs = torch.randint(0, 16, (4,), generator=seeded).tolist()
        s = int(torch.randint(1, 17, (1,), generator=seeded))
        mn = int(torch.randint(-119, 120, (1,), generator=seeded))
        if max(qs) * s + mn > 127:
            continue
        word = sum(v << (8 * i) for i, v in enumerate(qs))
        out = F.lqq_dequant_packed_word(word, s, 128 + mn)
        lanes = [((out >> (8 * i)) & 0xFF) for i in range(4)]
        assert [b - 256 if b > 127 else b for b in lanes] == [v * s + mn for v in qs]


@pytest.mark.parametrize("g", F.SUPPORTED_GROUP_SIZES)
def test_quantize_weight_lqq_is_close_and_exact_in_int8(seeded, g):
    w = torch.randn(48, 4 * g, generator=seeded, dtype=torch.float64)
    t = ref.quantize_weight_lqq(w, g)
    assert {k: (tuple(v.shape), v.dtype) for k, v in t.items()} == {
        k: v for k, v in F.W4Layout(48, 4 * g, g).tensor_specs().items()}
    w8, _ = ref.quantize_w8_per_channel(w)
    w8_hat = ref.dequantize_weight_w8(t["qweight"], t["group_scale"], t["group_offset"])
    # ceil(range/15) alone moves every int8 weight by at most half a step (<= 8) ...
    step, off = ref.lqq_group_params(w8, g, step_candidates=1)
    w8_ceil = ref.dequantize_weight_w8(F.pack_nibbles(ref.lqq_encode(w8, step, off, g)), step, off)
    assert (w8_ceil.int() - w8.int()).abs().max() <= F.MAX_GROUP_STEP // 2
    # ... and the default search over {floor, ceil} never does worse in squared error
    assert ((w8_hat.int() - w8.int()) ** 2).sum() <= ((w8_ceil.int() - w8.int()) ** 2).sum()
    w_hat = ref.dequantize_weight(t["qweight"], t["group_scale"], t["group_offset"],
                                  t["channel_scale"], torch.float64)
    rel = (w_hat - w).norm() / w.norm()
    assert rel < 0.12, rel  # 4-bit with 64/128 groups on Gaussian weights


def test_kv_page_layout_bytes():
    for d, want in ((128, 136), (64, 72), (256, 264)):
        assert F.KVPageLayout("kv4", d, 16).row_bytes == want
    assert F.KVPageLayout("kv8", 128, 16).row_bytes == 264
    assert F.kv_capacity_ratio("kv4", 128) == pytest.approx(512 / 136)
    with pytest.raises(ValueError, match="kv scheme"):
        F.KVPageLayout("kv2", 128, 16)


@pytest.mark.parametrize("scheme", ["kv4", "kv8"])
def test_kv_planes_are_disjoint_views(scheme):
    lay = F.KVPageLayout(scheme, 64, 16)
    cache = torch.zeros(lay.cache_shape(3, 2), dtype=lay.storage_dtype())
    planes = F.kv_planes(cache, lay)
    for i, (name, p) in enumerate(planes.items()):
        p.view(torch.uint8).fill_(i + 1)
    counts = torch.bincount(cache.view(torch.uint8).flatten(), minlength=len(planes) + 1)
    assert counts[0] == 0, "some bytes of the page belong to no plane"
    sizes = {name: p.view(torch.uint8).numel() for name, p in planes.items()}
    assert sum(sizes.values()) == cache.numel()


@pytest.mark.parametrize("scheme", ["kv4", "kv8"])
def test_kv_quant_error_bound(seeded, scheme):
    x = torch.randn(7, 3, 64, generator=seeded)
    codes, scale, zero = ref.quantize_kv(x, scheme)
    xh = ref.dequantize_kv(codes, scale, zero, scheme)
    step = scale.float()[..., None]
    # within half a step (plus fp16 rounding of the scale/zero)
    assert ((xh - x).abs() <= 0.5 * step + 2e-3 * x.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("n", [1, 2, 8, 128])
def test_hadamard_is_sylvester_and_orthonormal(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester's recursion, the oracle: [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    got = F.hadamard(n)
    assert got.dtype == torch.float32 and got.shape == (n, n)
    assert torch.allclose(got.double() * n ** 0.5, h, rtol=1e-6, atol=0)
    assert torch.equal(got, got.T)
    assert torch.allclose(got.double() @ got.double(), torch.eye(n, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("n", [0, 3, 96])
def test_hadamard_rejects_other_sizes(n):
    with pytest.raises(ValueError, match=f"n={n} is not a power of two"):
        F.hadamard(n)


def test_act_rotation_matrix_names():
    """The one mapping from a checkpoint's act_rotation name to its matrix."""
    assert torch.equal(F.act_rotation_matrix("hadamard"), F.hadamard(F.ACT_BLOCK))
    assert F.act_rotation_matrix("none") is None
    r64 = F.act_rotation_matrix("hadamard64")
    half = F.ACT_BLOCK // 2
    assert torch.equal(r64[:half, :half], F.hadamard(half)) and torch.equal(r64[half:, half:], F.hadamard(half))
    assert not r64[:half, half:].any() and not r64[half:, :half].any(), "the halves never mix"
    assert torch.allclose(r64 @ r64.T, torch.eye(F.ACT_BLOCK), atol=1e-6), "orthogonal"
    with pytest.raises(ValueError, match="act_rotation 'givens' is not one of"):
        F.act_rotation_matrix("givens")
    # the width of the fast transforms the kernels run, and their float32 norm
    assert [F.act_rotation_size(r) for r in F.ACT_ROTATIONS] == [0, F.ACT_BLOCK, half]
    assert F.hadamard_norm(64) == 0.125 and F.hadamard_norm(128) == float(torch.tensor(0.5 ** 3.5))


def test_act_block_perm_finds_whole_block_moves(seeded):
    """W4Ax act_perm's runtime forms: a permutation moving whole blocks, channels in order (what
    `--a8-select blocks` writes), becomes its block table and back; any other stays [K]."""
    k = 4 * F.ACT_BLOCK
    blocks = F.random_act_perm(k, "blocks", seeded)
    assert blocks.dtype == torch.int32 and sorted(blocks.tolist()) == [0, 1, 2, 3]
    channels = F.act_channel_perm(blocks, k)
    assert torch.equal(channels.view(4, -1)[:, 0], blocks.long() * F.ACT_BLOCK)
    assert torch.equal(F.act_block_perm(channels.to(torch.int32)), blocks)
    assert torch.equal(F.act_channel_perm(channels, k), channels)
    assert [F.act_perm_unit(p, k) for p in (channels, blocks)] == [1, F.ACT_BLOCK]
    # the quantizer's own block selection is such a permutation
    from vllm_mixprec.quantize import fmpq
    chosen = fmpq.act_permutation(torch.rand(k, generator=seeded), "blocks")
    assert F.act_block_perm(chosen) is not None
    swapped = channels.clone()
    swapped[[5, 6]] = swapped[[6, 5]]  # two channels of one block out of order
    shifted = torch.roll(torch.arange(k), 1)  # whole runs, not on block boundaries
    for other in (swapped, shifted, F.random_act_perm(k, "channels", seeded), torch.arange(100)):
        assert F.act_block_perm(other) is None
    assert torch.equal(F.act_block_perm(torch.arange(k)), torch.arange(4, dtype=torch.int32))


def test_act_perm_forms_errors():
    with pytest.raises(ValueError, match=r"expected \(256,\) channels or \(2,\) blocks of 128"):
        F.act_perm_unit(torch.arange(3), 256)
    with pytest.raises(ValueError, match="act_perm form 'rows' is not one of"):
        F.random_act_perm(256, "rows")
    with pytest.raises(ValueError, match="k=200 is not divisible by 128"):
        F.random_act_perm(200, "blocks")


@pytest.mark.parametrize("k", [64, 192, 4096])
def test_wgmma_act_k_order_is_the_unit_transpose(k):
    """In every 64 k, 4-byte unit 4a + b lands at unit 4b + a (the packing's k permutation, as the
    wgmma kernel's 4-byte cp.async applies it); bytes stay in order inside a unit."""
    order = F.wgmma_act_k_order(k)
    assert order.dtype == torch.int64 and torch.equal(order.sort().values, torch.arange(k))
    assert torch.equal(order[order], torch.arange(k))  # an involution
    x = torch.arange(k)
    xw = x[order]
    for c in range(k // 64):
        for a in range(4):
            for b in range(4):
                dst = 64 * c + 4 * (4 * b + a)
                assert torch.equal(xw[dst:dst + 4], x[64 * c + 4 * (4 * a + b):][:4])
    assert not torch.equal(order, torch.arange(k))


def test_wgmma_act_k_order_needs_whole_chunks():
    with pytest.raises(ValueError, match=r"K \(wgmma k order\)=96 is not divisible by 64"):
        F.wgmma_act_k_order(96)


def test_reference_gemm_reads_the_wgmma_order(seeded):
    m, n, k, g = 5, 32, 192, 64
    t = ref.quantize_weight_lqq(torch.randn(n, k), g)
    qw, gs, go, cs = t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"]
    x = torch.randn(m, k)
    xq, xs = ref.quantize_act(x)
    xw, xws = ref.quantize_act(x, None, wgmma_order=True)
    assert torch.equal(xw, ref.to_wgmma_act_order(xq)) and torch.equal(xws, xs)
    assert torch.equal(ref.to_wgmma_act_order(xw), xq)
    y = ref.w4a8_gemm(xq, xs, qw, gs, go, cs, None, torch.float64)
    assert torch.equal(ref.w4a8_gemm(xw, xs, qw, gs, go, cs, None, torch.float64, x_wgmma_order=True), y)
    assert not torch.equal(ref.w4a8_gemm(xw, xs, qw, gs, go, cs, None, torch.float64), y)
