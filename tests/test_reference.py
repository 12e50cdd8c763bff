"""reference.py against independent float64 math."""
import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


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


def test_w4ax_gemm_all_8bit_equals_w4a8(seeded):
    m, n, k = 3, 32, 256
    w = torch.randn(n, k, generator=seeded)
    t = ref.quantize_weight_lqq(w, 64)
    x = torch.randn(m, k, generator=seeded)
    ident = torch.arange(k, dtype=torch.int32)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, ident, k)
    assert x4.shape == (m, 0)
    args = (t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    y = ref.w4ax_gemm(x8, s8, x4, s4, *args, out_dtype=torch.float64)
    xq, xs = ref.quantize_act(x)
    assert torch.allclose(y, ref.w4a8_gemm(xq, xs, *args, out_dtype=torch.float64))


def test_w4ax_permutation_is_consistent(seeded):
    """Permuting activations and weight K identically leaves the product unchanged."""
    m, n, k, k8 = 4, 32, 512, 128
    w = torch.randn(n, k, generator=seeded)
    x = torch.randn(m, k, generator=seeded)
    perm = torch.randperm(k, generator=seeded).to(torch.int32)
    t = ref.quantize_weight_lqq(w[:, perm.long()], 64)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, k8)
    assert x8.shape == (m, k8) and x4.shape == (m, (k - k8) // 2)
    y = ref.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                      t["channel_scale"], out_dtype=torch.float64)
    assert _rel(y, x.double() @ w.double().T) < 0.25  # 4-bit activations on 3/4 of K


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
