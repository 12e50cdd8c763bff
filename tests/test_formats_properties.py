"""Property-based tests (hypothesis) of the packed layouts in formats.py.

Profile: tests/conftest.py ("ci": derandomized, no deadline). Example counts are listed in
docs/RELIABILITY.md; each test states its own in @settings.
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_mixprec import formats as F  # noqa: E402


def _tensor(draw, shape, lo, hi, dtype):
    """Values in [lo, hi]: uniform, or all-equal, or only the two extremes."""
    n = 1
    for s in shape:
        n *= s
    kind = draw(st.sampled_from(["uniform", "constant", "extremes"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if kind == "uniform":
        v = torch.randint(lo, hi + 1, (n,), generator=g)
    elif kind == "constant":
        v = torch.full((n,), draw(st.integers(lo, hi)))
    else:
        v = torch.where(torch.rand(n, generator=g) < 0.5, lo, hi)
    return v.reshape(shape).to(dtype)


@st.composite
def packed_shapes(draw):
    batch = draw(st.lists(st.integers(1, 5), min_size=0, max_size=2))
    return (*batch, 2 * draw(st.integers(1, 96)))


@settings(max_examples=100)
@given(data=st.data(), shape=packed_shapes())
def test_nibble_round_trip(data, shape):
    q = _tensor(data.draw, shape, 0, 15, torch.uint8)
    p = F.pack_nibbles(q)
    assert p.dtype == torch.uint8 and p.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(p & 0xF, q[..., 0::2]) and torch.equal(p >> 4, q[..., 1::2])  # even k low
    assert torch.equal(F.unpack_nibbles(p), q)


@settings(max_examples=100)
@given(data=st.data(), shape=packed_shapes())
def test_int4_round_trip(data, shape):
    v = _tensor(data.draw, shape, -8, 7, torch.int8)
    p = F.pack_int4(v)
    assert torch.equal(F.unpack_int4(p), v)
    low = (p & 0xF).to(torch.int16)
    assert torch.equal(torch.where(low >= 8, low - 16, low).to(torch.int8), v[..., 0::2])


@st.composite
def lane_params(draw):
    """(q0..q3, step, offset) with max(q)*step + offset <= 255: the lanes never carry."""
    step = draw(st.integers(1, F.MAX_GROUP_STEP))
    offset = draw(st.integers(F.W4_OFFSET_RANGE[0], 255 - step))  # q = 0 always fits
    qmax = min(15, (255 - offset) // step)
    q = draw(st.lists(st.integers(0, qmax), min_size=4, max_size=4))
    return q, step, offset


@settings(max_examples=100)
@given(lane_params())
def test_packed_word_recipe_equals_lane_recipe(params):
    """The 32-bit register recipe (one IMAD + one XOR per 4 weights) equals the per-lane one,
    and both equal q*step + offset - 128 exactly."""
    q, step, offset = params
    word = sum(v << (8 * i) for i, v in enumerate(q))
    r = F.lqq_dequant_packed_word(word, step, offset)
    lanes = F.lqq_dequant_lanes(torch.tensor(q), torch.tensor(step), torch.tensor(offset))
    got = [((r >> (8 * i)) & 0xFF) for i in range(4)]
    assert got == [int(x) & 0xFF for x in lanes]
    assert [int(x) for x in lanes] == [v * step + offset - 128 for v in q]


@st.composite
def lqq_tensors(draw):
    n = draw(st.integers(1, 6))
    g = draw(st.sampled_from(F.SUPPORTED_GROUP_SIZES))
    k = g * draw(st.integers(1, 3))
    q = _tensor(draw, (n, k), 0, 15, torch.uint8)
    scale = _tensor(draw, (n, k // g), 0, 20, torch.uint8)     # 0 and 17..20 are invalid
    offset = _tensor(draw, (n, k // g), 0, 255, torch.uint8)  # <9 and >247 are invalid
    return F.pack_nibbles(q), scale, offset, q, g


@settings(max_examples=150)
@given(lqq_tensors())
def test_lqq_param_errors_is_exact(t):
    """The load-time check flags a layer iff some element overflows its byte lane or a
    parameter is out of range (brute force over every element)."""
    qweight, scale, offset, q, g = t
    s = scale.repeat_interleave(g, 1).int()
    a = offset.repeat_interleave(g, 1).int()
    overflow = bool((q.int() * s + a > 255).any())
    bad_step = bool(((scale < 1) | (scale > F.MAX_GROUP_STEP)).any())
    bad_off = bool(((offset < 9) | (offset > 247)).any())
    errs = F.lqq_param_errors(qweight, scale, offset)
    hypothesis.event(f"overflow={overflow} bad_step={bad_step} bad_offset={bad_off}")
    assert any("> 255" in e for e in errs) == overflow
    assert any(e.startswith("group_scale") for e in errs) == bad_step
    assert any(e.startswith("group_offset") for e in errs) == bad_off
    if not errs:  # then the dequantization is exact in every lane
        w8 = F.lqq_dequant_lanes(q, s, a)
        assert torch.equal(w8.int(), q.int() * s + a - 128)


@settings(max_examples=50)
@given(scheme=st.sampled_from(["kv4", "kv8"]), head_dim=st.integers(1, 16).map(lambda x: 16 * x),
       block=st.sampled_from([16, 32, 64, 128]), blocks=st.integers(1, 3), heads=st.integers(1, 3))
def test_kv_planes_tile_the_slab(scheme, head_dim, block, blocks, heads):
    """The planes of every (block, head) slab are disjoint and cover it exactly: writing each
    plane with its own byte pattern leaves every byte of the cache claimed exactly once."""
    lay = F.KVPageLayout(scheme, head_dim, block)
    cache = torch.zeros(lay.cache_shape(blocks, heads), dtype=lay.storage_dtype())
    planes = F.kv_planes(cache, lay)
    owner = torch.zeros(cache.numel(), dtype=torch.int64)
    raw = cache.view(torch.uint8).reshape(-1)
    for i, (name, p) in enumerate(sorted(planes.items())):
        raw.zero_()
        p.view(torch.uint8).fill_(0xFF)
        owner += (raw == 0xFF).long() * (1 << i)
        assert int((raw == 0xFF).sum()) == p.numel() * p.element_size(), name
    assert (owner > 0).all()  # covered
    assert torch.equal(owner & (owner - 1), torch.zeros_like(owner))  # never twice
    assert lay.slab_bytes == sum(p[0, 0].numel() * p.element_size() for p in planes.values())
