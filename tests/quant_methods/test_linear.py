"""create_weights + weight_loader + apply through vLLM's real linear layers (TP=1, gloo)."""
import pytest
import torch

from linear_helpers import load_tensors
from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.quant_methods.config import MixPrecConfig

BASE = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8", "weight_bits": 4,
        "act_bits": 8, "group_size": 64, "kv_scheme": "none"}


def _shard(n, k, gen, g=64):
    w = torch.randn(n, k, generator=gen)
    return w, ref.quantize_weight_lqq(w, g)


def _check_apply(layer, tensors_by_shard, m, k, gen, dtype=torch.float16):
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.mixprec_impl == "reference"
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = layer.quant_method.apply(layer, x)
    cat = {name: torch.cat([t[name] for t in tensors_by_shard]) for name in tensors_by_shard[0]}
    xq, xs = ref.quantize_act(x)
    expect = ref.w4a8_gemm(xq, xs, cat["qweight"], cat["group_scale"], cat["group_offset"],
                           cat["channel_scale"], out_dtype=torch.float64)
    assert y.dtype == dtype and y.shape == expect.shape
    rel = float((y.double() - expect).norm() / expect.norm())
    assert rel < 1e-3 + torch.finfo(dtype).eps, rel  # plus output rounding


def test_qkv_merged_loading(vllm_tp1, seeded):
    from vllm.model_executor.layers.linear import QKVParallelLinear
    hidden, head, nh, nkv = 256, 64, 4, 2
    layer = QKVParallelLinear(hidden, head, nh, nkv, bias=False, quant_config=MixPrecConfig.from_config(BASE),
                              params_dtype=torch.float16, prefix="model.layers.0.self_attn.qkv_proj")
    shards = {}
    for sid, n in (("q", nh * head), ("k", nkv * head), ("v", nkv * head)):
        _, shards[sid] = _shard(n, hidden, seeded)
    for sid in ("v", "q", "k"):  # checkpoint order must not matter
        load_tensors(layer, shards[sid], sid)
    _check_apply(layer, [shards["q"], shards["k"], shards["v"]], 5, hidden, seeded)


def test_gate_up_merged_loading(vllm_tp1, seeded):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    layer = MergedColumnParallelLinear(256, [384, 384], bias=False,
                                       quant_config=MixPrecConfig.from_config(BASE),
                                       params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.gate_up_proj")
    shards = [_shard(384, 256, seeded)[1] for _ in range(2)]
    load_tensors(layer, shards[1], 1)
    load_tensors(layer, shards[0], 0)
    _check_apply(layer, shards, 3, 256, seeded, torch.bfloat16)


def test_first_layer_installs_the_silu_quant_fusion(vllm_tp1, monkeypatch):
    """With MIXPREC_FUSE_SILU_QUANT=1, building a mixprec linear layer puts compile_passes'
    pass where vLLM's pass manager takes it, and vLLM's compile-cache hash then covers it
    (through the pass's uuid)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    from vllm_mixprec import compile_passes as cp
    monkeypatch.setenv("MIXPREC_FUSE_SILU_QUANT", "1")  # opt-in
    inductor_cfg = vllm_tp1.compilation_config.inductor_compile_config
    monkeypatch.delitem(inductor_cfg, cp.HOOK, raising=False)
    before = vllm_tp1.compilation_config.compute_hash()
    RowParallelLinear(128, 64, bias=False, quant_config=MixPrecConfig.from_config(BASE),
                      params_dtype=torch.float16, prefix="model.layers.0.mlp.down_proj")
    assert isinstance(inductor_cfg[cp.HOOK], cp.MixprecPostGrad)
    assert inductor_cfg[cp.HOOK].get(cp.SiluMulQuantFusion) is not None
    assert vllm_tp1.compilation_config.compute_hash() != before
    monkeypatch.delitem(inductor_cfg, cp.HOOK)


def test_row_parallel_with_bias(vllm_tp1, seeded):
    from vllm.model_executor.layers.linear import RowParallelLinear
    layer = RowParallelLinear(384, 128, bias=True, quant_config=MixPrecConfig.from_config(BASE),
                              params_dtype=torch.float16, prefix="model.layers.0.mlp.down_proj")
    _, t = _shard(128, 384, seeded)
    load_tensors(layer, t, None)
    layer.bias.data.copy_(torch.randn(128, generator=seeded))
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 384, generator=seeded).half()
    y, _ = layer(x)
    xq, xs = ref.quantize_act(x)
    expect = ref.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                           layer.bias.data, torch.float64)
    assert float((y.double() - expect).norm() / expect.norm()) < 1e-3


def test_bad_dtype_and_shape_are_named(vllm_tp1, seeded):
    from vllm.model_executor.layers.linear import RowParallelLinear
    layer = RowParallelLinear(256, 128, bias=False, quant_config=MixPrecConfig.from_config(BASE),
                              params_dtype=torch.float16, prefix="model.layers.3.mlp.down_proj")
    _, t = _shard(128, 256, seeded)
    with pytest.raises(ValueError, match=r"down_proj\.qweight: checkpoint dtype torch.int32"):
        layer.qweight.weight_loader(layer.qweight, t["qweight"].to(torch.int32))
    with pytest.raises(ValueError, match=r"down_proj\.group_scale: checkpoint shape \(128, 3\)"):
        layer.group_scale.weight_loader(layer.group_scale, t["group_scale"][:, :3])


def test_corrupt_group_params_refused(vllm_tp1, seeded):
    from vllm.model_executor.layers.linear import RowParallelLinear
    layer = RowParallelLinear(256, 128, bias=False, quant_config=MixPrecConfig.from_config(BASE),
                              params_dtype=torch.float16, prefix="model.layers.3.mlp.down_proj")
    _, t = _shard(128, 256, seeded)
    t["group_scale"][5, 1] = 0
    load_tensors(layer, t, None)
    with pytest.raises(ValueError, match="group_scale has values outside"):
        layer.quant_method.process_weights_after_loading(layer)


def test_group_size_must_divide_k(vllm_tp1):
    from vllm.model_executor.layers.linear import RowParallelLinear
    cfg = MixPrecConfig.from_config(dict(BASE, group_size=128))
    with pytest.raises(ValueError, match="group_size=128"):
        RowParallelLinear(320, 128, bias=False, quant_config=cfg, params_dtype=torch.float16,
                          prefix="model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("perm_form", F.ACT_PERM_FORMS)
@pytest.mark.parametrize("rotation", ["none", "hadamard", "hadamard64"])
def test_w4ax_layer(vllm_tp1, seeded, rotation, perm_form):
    """A W4Ax layer against the reference; a checkpoint permutation of whole blocks is held as
    the block table after loading (formats.act_block_perm), a channel one as it came."""
    from vllm.model_executor.layers.linear import RowParallelLinear
    cfg = MixPrecConfig.from_config(dict(BASE, weight_scheme="w4ax", act_bits="4/8", a8_fraction=0.25,
                                         act_rotation=rotation))
    k, n = 512, 64
    layer = RowParallelLinear(k, n, bias=False, quant_config=cfg, params_dtype=torch.float16,
                              prefix="model.layers.0.mlp.down_proj")
    w = torch.randn(n, k, generator=seeded)
    perm = F.act_channel_perm(F.random_act_perm(k, perm_form, seeded), k).to(torch.int32)
    t = ref.quantize_weight_lqq(w[:, perm.long()], 64)
    t.update(act_perm=perm, a8_blocks=torch.tensor([1], dtype=torch.int32))
    load_tensors(layer, t, None)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.mixprec_k8 == 128
    held = layer.act_perm.data
    assert held.dtype == torch.int32 and torch.equal(F.act_channel_perm(held, k), perm.long())
    assert held.shape == ((k // F.ACT_BLOCK,) if perm_form == "blocks" else (k,))
    assert layer.mixprec_act_rotation == rotation
    x = torch.randn(3, k, generator=seeded).half()
    y = layer.quant_method.apply(layer, x)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, 128, act_rotation=rotation)
    assert s8.shape == (3, 1) and s4.shape == (3, 3)  # one scale per (token, 128-channel block)
    expect = ref.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                           t["channel_scale"], out_dtype=torch.float64)
    assert float((y.double() - expect).norm() / expect.norm()) < 1e-3
