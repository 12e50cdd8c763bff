"""Property-based tests (hypothesis): the Triton KV write and attention kernels against
reference.py, with GPU NaN semantics in the interpreter (tests/conftest.py
`gpu_float_semantics`).

  * quantize_and_store writes exactly the reference's codes and scales for any shape, slot
    mapping (with padding) and value distribution; a K/V row holding a NaN or an Inf is
    stored with a NaN scale (kv4: and zero) and zero codes;
  * paged attention matches the reference over ragged batches of every feature combination;
  * attention over a poisoned key or value is NaN for exactly the queries that attend to
    it (causally), and every other query matches the reference, with the chunk read from
    the cache or in 16 bits (exact prefill).
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mixprec_strategies import NONFINITE, float_tensor, poison_rows  # noqa: E402

from vllm_mixprec import formats as F  # noqa: E402
from vllm_mixprec import reference as ref  # noqa: E402
from vllm_mixprec.kernels.triton.attention import paged_attention  # noqa: E402
from vllm_mixprec.kernels.triton.kv_cache import quantize_and_store  # noqa: E402

from attn_helpers import DEVICE, make_batch, tolerance  # noqa: E402


@pytest.fixture(autouse=True)
def _nan_like_gpu(gpu_float_semantics):
    return


@st.composite
def writes(draw):
    scheme = draw(st.sampled_from(["kv4", "kv8"]))
    t, h = draw(st.integers(1, 6)), draw(st.integers(1, 2))
    d, b = draw(st.sampled_from([64, 128])), draw(st.sampled_from([16, 32]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    nb = draw(st.integers(1, 3))
    key = float_tensor(draw, (t, h, d), dtype)
    value = float_tensor(draw, (t, h, d), dtype)
    bad_k, bad_v = poison_rows(draw, key), poison_rows(draw, value)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    slots = torch.randperm(nb * b, generator=g)[:t]
    if len(slots) < t:
        slots = torch.cat([slots, torch.full((t - len(slots),), -1)])
    slots[torch.rand(t, generator=g) < 0.2] = -1  # vLLM's padding slots
    k_smooth = (torch.rand(h, d, generator=g) + 0.5) if draw(st.booleans()) else None
    return F.KVPageLayout(scheme, d, b), key, value, bad_k, bad_v, slots, nb, k_smooth


def _same_planes(got, want, layout):
    pg, pw = F.kv_planes(got, layout), F.kv_planes(want, layout)
    for name in pw:
        g, w = pg[name], pw[name]
        if g.is_floating_point():
            assert torch.equal(torch.isnan(g), torch.isnan(w)), name
            assert torch.equal(g.nan_to_num(), w.nan_to_num()), name
        else:
            assert torch.equal(g, w), name


@settings(max_examples=100)
@given(writes())
def test_quantize_and_store_matches_reference(case):
    layout, key, value, bad_k, bad_v, slots, nb, k_smooth = case
    h = key.shape[1]
    want = torch.full(layout.cache_shape(nb, h), 0x5A, dtype=torch.uint8).view(layout.storage_dtype())
    got = want.clone().to(DEVICE)
    ref.reshape_and_cache(key, value, want, slots, layout, k_smooth)
    quantize_and_store(key.to(DEVICE), value.to(DEVICE), got, slots.to(DEVICE), layout,
                       None if k_smooth is None else k_smooth.to(DEVICE))
    got = got.cpu()
    _same_planes(got, want, layout)
    planes = F.kv_planes(got, layout)
    keep = slots >= 0
    blk, off = slots[keep] // layout.block_size, slots[keep] % layout.block_size
    for name, bad in (("k", bad_k), ("v", bad_v)):
        scale = planes[f"{name}_scale"][blk, :, off]  # [written tokens, H]
        assert torch.equal(torch.isnan(scale), bad[keep]), name  # NaN exactly where poisoned


@st.composite
def poisoned_batches(draw):
    scheme = draw(st.sampled_from(["kv4", "kv8"]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    nrows = draw(st.integers(1, 2))
    rows = []
    for _ in range(nrows):
        seq = draw(st.integers(1, 24))
        rows.append((draw(st.sampled_from([1, 1, min(seq, 5)])), seq))
    target = draw(st.integers(0, nrows - 1))
    pos = draw(st.integers(0, rows[target][1] - 1))
    return (scheme, dtype, rows, target, pos, draw(st.sampled_from(["k", "v"])),
            draw(st.sampled_from(NONFINITE)), draw(st.sampled_from([0, 16])), draw(st.integers(0, 2**16)),
            draw(st.booleans()))


def _writer(k, v, cache, sm, layout, k_smooth, residual):
    quantize_and_store(k, v, cache, sm, layout, k_smooth, residual)


@settings(max_examples=25)
@given(poisoned_batches())
def test_attention_over_a_poisoned_row_is_nan_where_attended(case):
    scheme, dtype, rows, target, pos, which, value, res, seed, exact = case
    torch.manual_seed(seed)
    b = make_batch(scheme, dtype, 64, 1, 4, rows, residual_tokens=res, writer=_writer)
    # rewrite one token of one row with a non-finite value, through the kernel (and its
    # residual copy), as a later layer's NaN would arrive; exact: prefill rows also read it
    # from the step's K/V (b.k/b.v, which chunk_kv slices)
    (b.k if which == "k" else b.v)[target][pos, 0, 3] = value
    bt = b.block_table[target]
    slot = (bt[pos // 16].long() * 16 + pos % 16).reshape(1)
    _writer(b.k[target][pos:pos + 1], b.v[target][pos:pos + 1], b.cache, slot, b.layout, None,
            b.residual)
    out = torch.full_like(b.q, 7.0)
    paged_attention(b.q, b.cache, b.layout, b.block_table, b.seq_lens, b.qsl, 0.125, b.residual,
                    num_splits=2, out=out, chunk_kv=b.chunk_kv() if exact else None)
    want = b.reference(0.125, exact)
    out = out.double().cpu()
    # query j of row i sits at position seq_len - qlen + j; it attends pos iff it is >= pos
    hit = torch.zeros(b.q.shape[0], dtype=torch.bool)
    for i, (q, s) in enumerate(rows):
        start = int(b.qsl[i])
        if i == target:
            hit[start:start + q] = torch.arange(s - q, s) >= pos
    assert torch.isnan(want[hit]).all()  # the reference's own policy
    assert torch.isnan(out[hit]).all(), "a non-finite K/V row became finite attention output"
    assert torch.isfinite(out[~hit]).all()
    torch.testing.assert_close(out[~hit], want[~hit], **tolerance(dtype))


@st.composite
def attention_batches(draw):
    """Ragged batches over every feature the kernels combine: scheme, dtype, GQA ratio, head
    dim, decode and prefill rows (chunks after a context too), residual window, SmoothAttention,
    split count and exact prefill."""
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        seq = draw(st.integers(1, 40))
        rows.append((draw(st.sampled_from([0, 1, 1, min(seq, draw(st.integers(2, 20)))])), seq))
    return dict(scheme=draw(st.sampled_from(["kv4", "kv8"])),
                dtype=draw(st.sampled_from([torch.float16, torch.bfloat16])),
                head_dim=draw(st.sampled_from([64, 128])), kv_heads=draw(st.integers(1, 2)),
                group=draw(st.sampled_from([1, 2, 4, 6])), rows=rows,
                residual=draw(st.sampled_from([0, 8, 16])), smooth=draw(st.booleans()),
                splits=draw(st.sampled_from([1, 2, 4])), exact=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=30, deadline=None)
@given(attention_batches())
def test_paged_attention_matches_reference(case):
    torch.manual_seed(case["seed"])
    d = case["head_dim"]
    b = make_batch(case["scheme"], case["dtype"], d, case["kv_heads"], case["group"],
                   case["rows"], residual_tokens=case["residual"], smooth=case["smooth"],
                   writer=_writer)
    out = torch.full_like(b.q, float("nan"))
    paged_attention(b.q, b.cache, b.layout, b.block_table, b.seq_lens, b.qsl, d ** -0.5,
                    b.residual, b.k_smooth, num_splits=case["splits"], out=out,
                    chunk_kv=b.chunk_kv() if case["exact"] else None)
    assert not out.isnan().any(), "a query row was not written"
    torch.testing.assert_close(out.double().cpu(), b.reference(d ** -0.5, case["exact"]),
                               **tolerance(case["dtype"]))
