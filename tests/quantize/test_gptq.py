"""GPTQ: lazy-batch Cholesky solver vs the straightforward OBS loop, checkpoint layout."""
import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.quantize import gptq, lqq


def correlated_inputs(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g, dtype=torch.float64) / k**0.5 + torch.eye(k, dtype=torch.float64)
    x = torch.randn(m, k, generator=g, dtype=torch.float64) @ mix
    x[:, :3] *= 8  # a few strong channels
    return x


@pytest.mark.parametrize("grid_name", ["int4sym", "lqq"])
def test_lazy_batch_equals_naive_loop(grid_name):
    g = torch.Generator().manual_seed(1)
    n, k, gs = 16, 256, 64
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
    x = correlated_inputs(512, k)
    h = x.T @ x
    grid = gptq.Int4Sym() if grid_name == "int4sym" else gptq.LqqGrid(ref.quantize_w8_per_channel(w)[1])
    fast, pf = gptq.gptq(w, h, grid, gs, block_size=128)
    slow, ps = gptq.gptq_naive(w, h, grid, gs)
    # same algorithm: identical grid points except where float rounding flips a tie
    same = torch.isclose(fast, slow, rtol=0, atol=1e-9)
    assert same.float().mean() > 0.995
    # and the few flipped ties do not change the output error materially
    x_err = lambda q: float(((x @ (q - w).T) ** 2).sum())  # noqa: E731
    assert abs(x_err(fast) - x_err(slow)) <= 0.01 * x_err(slow)


def test_gptq_beats_rtn_on_the_calibration_data():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 256, generator=g, dtype=torch.float64) * 0.05
    x = correlated_inputs(1024, 256, seed=3)
    h = x.T @ x
    y = x @ w.T
    # W4A16
    t = gptq.gptq_w4a16(w, h, 64)
    rtn_w4, _ = gptq.gptq(w, torch.eye(256, dtype=torch.float64) * 1e6, gptq.Int4Sym(), 64, percdamp=0)
    err_gptq = ((x @ gptq.dequantize_gptq(t).double().T - y) ** 2).sum()
    err_rtn = ((x @ rtn_w4.T - y) ** 2).sum()
    assert err_gptq < 0.8 * err_rtn
    # W4A8 LiquidQuant grid
    tl = gptq.gptq_lqq(w, h, 64)
    rl = ref.quantize_weight_lqq(w, 64)
    err_l = ((x @ lqq.dequantize(tl).T - y) ** 2).sum()
    err_lr = ((x @ lqq.dequantize(rl).T - y) ** 2).sum()
    assert err_l < 0.8 * err_lr
    assert torch.equal(tl["channel_scale"], rl["channel_scale"])  # level 1 fixed before GPTQ


def test_gptq_lqq_tensors_are_valid_and_decode_to_the_solver_output():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8, 128, generator=g, dtype=torch.float64)
    x = correlated_inputs(256, 128)
    h = x.T @ x
    t = gptq.gptq_lqq(w, h, 64)
    F.W4Layout(8, 128, 64)
    assert t["qweight"].dtype == torch.uint8 and t["qweight"].shape == (8, 64)
    assert t["group_scale"].shape == (8, 2) and int(t["group_scale"].min()) >= 1
    grid = gptq.LqqGrid(t["channel_scale"])
    w_hat, _ = gptq.gptq(w, h, grid, 64)
    assert torch.allclose(lqq.dequantize(t), w_hat, rtol=0, atol=1e-12)


def test_gptq_checkpoint_layout_matches_vllm():
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        pack_quantized_values_into_int32, unpack_quantized_values_into_int32)
    from vllm.scalar_type import scalar_types

    g = torch.Generator().manual_seed(5)
    n, k, gs = 24, 256, 128
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // gs, generator=g) + 0.1
    t = gptq.pack_gptq(codes, scale, gs)
    assert t["qweight"].shape == (k // 8, n) and t["qweight"].dtype == torch.int32
    assert t["scales"].shape == (k // gs, n) and t["scales"].dtype == torch.float16
    assert t["qzeros"].shape == (k // gs, n // 8) and t["qzeros"].dtype == torch.int32
    assert torch.equal(t["g_idx"], torch.arange(k, dtype=torch.int32) // gs)
    # vLLM's own helpers: qweight is [K, N] packed along K (dim 0), zeros packed along N
    wtype = scalar_types.uint4b8
    assert torch.equal(unpack_quantized_values_into_int32(t["qweight"], wtype, packed_dim=0),
                       codes.T.to(torch.int32))
    assert torch.equal(pack_quantized_values_into_int32(codes.T.to(torch.int32), wtype, packed_dim=0),
                       t["qweight"])
    zeros = unpack_quantized_values_into_int32(t["qzeros"], wtype, packed_dim=1)
    assert bool((zeros == wtype.bias - 1).all())  # v1 "gptq" format: zero - 1
    assert torch.equal(gptq.unpack_gptq(t["qweight"]), codes)
    w = gptq.dequantize_gptq(t)
    want = (codes.float() - wtype.bias) * scale.half().float().repeat_interleave(gs, 1)
    assert torch.equal(w, want)
    cfg = gptq.gptq_quantize_config(gs, 0.01)
    assert cfg["quant_method"] == "gptq" and cfg["sym"] is True and cfg["desc_act"] is False
    assert cfg["bits"] == 4 and cfg["checkpoint_format"] == "gptq"
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
    vc = AutoGPTQConfig.from_config(cfg)
    assert vc.quant_type == wtype and vc.group_size == gs and vc.desc_act is False


def test_dead_inputs_are_zeroed():
    w = torch.ones(8, 64, dtype=torch.float64)
    x = torch.randn(100, 64, dtype=torch.float64)
    x[:, 5] = 0
    q, _ = gptq.gptq(w, x.T @ x, gptq.Int4Sym(), 64)
    assert bool((q[:, 5] == 0).all())


def test_lqq_grid_outside_the_fitted_range_decodes_exactly():
    # a group fitted on a narrow range, then a column far outside it (what GPTQ updates do)
    s1 = torch.full((4,), 1.0)
    grid = gptq.LqqGrid(s1)
    fitted = torch.tensor([[100.0, 110.0, 119.0, 105.0]] * 4, dtype=torch.float64)
    fitted[:, 0] = torch.tensor([100.0, 90.0, -119.0, 0.0])
    params = grid.fit(fitted, slice(0, 4))
    step, offset = params[0], params[1]
    col = torch.tensor([119.0, 119.0, 119.0, 119.0], dtype=torch.float64)
    fake = grid.fake(col, params)
    # what the exported codes decode to through the byte-lane recipe
    q = ref.lqq_encode(grid.w8(fake)[:, None], step, offset, 1)
    lanes = (q.long() * step.long() + offset.long())
    assert int(lanes.max()) <= 255
    dec = F.lqq_dequant_lanes(q, step, offset).double()[:, 0]
    assert torch.equal(dec, fake)
