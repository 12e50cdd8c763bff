"""W4A8 export choices: clipping and the per-group range search stay inside the format."""
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.quantize import gptq, lqq


def weighted_err(w8, t, act_sq):
    w8_hat = ref.dequantize_weight_w8(t["qweight"], t["group_scale"], t["group_offset"]).double()
    return (((w8_hat - w8.double()) ** 2) * act_sq[None]).sum()


def test_ratio_one_is_reference_rtn():
    w = torch.randn(8, 128, dtype=torch.float64)
    a, b = lqq.quantize_lqq_clipped(w, 64), ref.quantize_weight_lqq(w, 64)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_clip_search_never_worse_than_rtn():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 256, generator=g, dtype=torch.float64)
    w[:, 7] *= 6  # heavy tails make clipping pay off
    act_sq = torch.rand(256, generator=g, dtype=torch.float64)
    t, ratio = lqq.clip_search(w, 64, act_sq)
    err = lambda tt: (((lqq.dequantize(tt) - w) ** 2) * act_sq).sum(1)  # noqa: E731
    assert bool((err(t) <= err(ref.quantize_weight_lqq(w, 64)) + 1e-12).all())
    assert ratio.min() < 1.0


def test_group_search_is_legal_and_beats_minmax():
    g = torch.Generator().manual_seed(1)
    w8 = torch.randint(-119, 120, (64, 256), generator=g, dtype=torch.int8)
    w8[::3, ::5] = 119  # extremes in many groups
    w8[1::3, 2::7] = -119
    act_sq = torch.rand(256, generator=g, dtype=torch.float64) ** 4
    step, offset = lqq.search_group_params(w8, 64, act_sq)
    assert int(step.min()) >= 1 and int(step.max()) <= F.MAX_GROUP_STEP
    assert int(offset.min()) >= 128 - F.W8_PROTECT and int(offset.max()) <= 128 + F.W8_PROTECT
    q = ref.lqq_encode(w8, step, offset, 64)
    # every code in use keeps its byte lane in range (clipping may push codes past the range)
    qmax = q.view(64, 4, 64).amax(-1).long()
    assert int((offset.long() + qmax * step.long()).max()) <= 255
    t = {"qweight": F.pack_nibbles(q), "group_scale": step, "group_offset": offset}
    s0, o0 = ref.lqq_group_params(w8, 64)
    t0 = {"qweight": F.pack_nibbles(ref.lqq_encode(w8, s0, o0, 64)), "group_scale": s0, "group_offset": o0}
    assert weighted_err(w8, t, act_sq) <= weighted_err(w8, t0, act_sq)
    # the packed-word recipe decodes every group's largest code exactly, in all 4 lanes
    for n in range(64):
        for j in range(4):
            s, a, c = int(step[n, j]), int(offset[n, j]), int(qmax[n, j])
            out = F.lqq_dequant_packed_word(c * 0x01010101, s, a)
            assert out == ((a - 128 + c * s) & 0xFF) * 0x01010101


def test_searched_export_and_gptq_with_search_are_valid():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 128, generator=g, dtype=torch.float64)
    x = torch.randn(256, 128, generator=g, dtype=torch.float64)
    act_sq = x.pow(2).mean(0)
    t = lqq.quantize_lqq_searched(w, 64, act_sq, 0.9)
    for tt in (t, gptq.gptq_lqq(w, x.T @ x, 64, 0.01, 0.9, act_sq)):
        q = F.unpack_nibbles(tt["qweight"]).view(16, 2, 64).amax(-1).long()
        assert int((tt["group_offset"].long() + q * tt["group_scale"].long()).max()) <= 255
        y = x @ lqq.dequantize(tt).T
        assert torch.isfinite(y).all()
    # searched export is never worse than RTN on the weighted objective
    base = ref.quantize_weight_lqq(w, 64)
    e = lambda tt: float((((lqq.dequantize(tt) - w) ** 2) * act_sq).sum())  # noqa: E731
    assert e(lqq.quantize_lqq_searched(w, 64, act_sq)) <= e(base) + 1e-12


def test_fake_weight_is_the_dequantized_export_bit_for_bit():
    """The alpha searches' unpacked shortcut equals quantize -> pack -> unpack -> dequantize,
    on weights with outlier rows, constant groups (range 0) and ranges on step boundaries."""
    gen = torch.Generator().manual_seed(3)
    for n, k, g in ((48, 256, 64), (33, 512, 128), (128, 1536, 64)):
        w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 2, n)[:, None]
        w[1, :g] = 0.25                    # a constant group
        w[2] = torch.arange(k) % 16 - 7.5  # integer-spaced ranges
        w[3, 5] = 1e3                      # an outlier that squeezes its row
        want = ref.dequantize_weight(**ref.quantize_weight_lqq(w, g))
        got = lqq.fake_weight_lqq(w, g)
        assert got.dtype == torch.float32 and torch.equal(got, want), (n, k, g)
        assert torch.equal(lqq.fake_weight_lqq(w.double(), g), want)
