"""scripts/diag_tp_rounding.py's TP=2 emulation (issue #7): the two ranks' partial outputs must
add up to the whole layer, so that the only difference it puts in is the bf16 rounding."""
import pytest
import torch
from torch import nn

from vllm_mixprec import reference as ref
from vllm_mixprec.quantize.modules import MixPrecLinear


@pytest.fixture
def diag(repo_module):
    return repo_module("scripts/diag_tp_rounding.py")


def _w4a8(n=48, k=256, bias=True, smooth=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = ref.quantize_weight_lqq(torch.randn(n, k, generator=g), 64)
    if smooth:
        tensors["input_smooth"] = torch.rand(k, generator=g) + 0.5
    return MixPrecLinear(tensors, torch.randn(n, generator=g) if bias else None)


@pytest.mark.parametrize("smooth", [False, True])
def test_global_scale_partials_sum_to_the_layer(diag, smooth):
    mod = _w4a8(smooth=smooth)
    x = torch.randn(5, 256) * torch.linspace(0.1, 4, 256)
    parts = diag.w4a8_partials(mod, x, per_rank_scale=False)
    xq, xs = ref.quantize_act(x, getattr(mod, "input_smooth", None))
    whole = ref.w4a8_gemm(xq, xs, mod.qweight, mod.group_scale, mod.group_offset, mod.channel_scale,
                          mod.bias, torch.float64)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-12, atol=1e-9)


def test_rank_scale_quantizes_each_half_alone(diag):
    mod = _w4a8(bias=False)
    x = torch.randn(3, 256)
    x[:, 200] = 50.0  # an outlier in rank 1's half only: its scale must not reach rank 0's codes
    parts = diag.w4a8_partials(mod, x, per_rank_scale=True)
    xq0, xs0 = ref.quantize_act(x[:, :128])
    w8 = ref.dequantize_weight_w8(mod.qweight, mod.group_scale, mod.group_offset)
    want0 = ref._int_gemm(xq0, w8[:, :128]) * xs0.double()[:, None] * mod.channel_scale.double()[None]
    torch.testing.assert_close(parts[0], want0)
    glob = diag.w4a8_partials(mod, x, per_rank_scale=False)
    assert not torch.allclose(parts[0], glob[0])


def test_dense_partials_and_the_emulated_rounding(diag):
    lin = nn.Linear(256, 40).requires_grad_(False)
    x = torch.randn(6, 256)
    parts = diag.dense_partials(lin, x)
    torch.testing.assert_close(parts[0] + parts[1], x.double() @ lin.weight.double().T + lin.bias.double())
    emu = diag.RowParallelEmulation(lin)
    y1 = emu(x)
    emu.mode = "tp2"
    y2 = emu(x)
    for y in (y1, y2):  # both bf16 values, as the served layer's output
        assert torch.equal(y, y.to(torch.bfloat16).float())
    # each bf16 rounding moves a value by at most 2^-8 of it: three of them (two partials, the
    # sum) against one, bounded by the partials' size (they may cancel), and not everywhere
    bound = 2.0 ** -8 * ((parts[0].abs() + parts[1].abs()) + y1.double().abs() + y2.double().abs())
    assert ((y2 - y1).double().abs() <= bound).all()
    assert (y1 == y2).float().mean() > 0.3


def test_fp32_mode_rounds_once_as_tp1(diag):
    """tp2-fp32 (a float32 all-reduce, global scale) rounds the float32 sum of the halves once:
    TP=1's bf16 output but for a rare tie, where tp2 rounds many elements apart."""
    mod = _w4a8(bias=False, seed=4)
    x = torch.randn(16, 256)
    emu = diag.RowParallelEmulation(mod)
    y = {}
    for mode in ("tp1", "tp2", "tp2-fp32"):
        emu.mode = mode
        y[mode] = emu(x)
    fp32_off = int((y["tp2-fp32"] != y["tp1"]).sum())
    assert fp32_off <= 2 and int((y["tp2"] != y["tp1"]).sum()) > 10 * max(1, fp32_off)


def test_bad_shard_control_changes_only_rank_1(diag):
    mod = _w4a8(bias=False, seed=3)
    x = torch.randn(4, 256)
    good = diag.w4a8_partials(mod, x, per_rank_scale=False)
    bad = diag.w4a8_partials(mod, x, per_rank_scale=False, bad_shard=True)
    torch.testing.assert_close(bad[0], good[0])
    assert (bad[1] - good[1]).abs().max() > 0.1 * good[1].abs().max()


def test_compare_reports_the_perplexity_ratio(diag):
    ids = torch.tensor([1, 2, 3, 0])
    base = torch.log_softmax(torch.randn(4, 5, dtype=torch.float64), -1)
    same = diag.compare(base, base.clone(), ids)
    assert same["ppl_ratio"] == pytest.approx(1.0) and same["argmax_flips"] == 0
    worse = base.clone()
    worse[torch.arange(3), ids[1:]] -= 0.5  # every target 0.5 nats less likely
    assert diag.compare(base, worse, ids)["ppl_ratio"] == pytest.approx(torch.e ** 0.5)
