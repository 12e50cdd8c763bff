"""Malformed checkpoints through vLLM's real linear layers (TP=1, gloo): each one is refused
at load time (weight_loader or process_weights_after_loading) with an error that names the
tensor and the fix, instead of loading and then serving wrong numbers.

Cases already covered elsewhere (not repeated here): wrong qweight dtype, truncated
group_scale, group_scale = 0, group size not dividing K (test_linear.py); bad or missing
quantization_config fields (test_config.py).
"""
import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.quant_methods.config import MixPrecConfig

BASE = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8", "weight_bits": 4,
        "act_bits": 8, "group_size": 64, "kv_scheme": "none"}
FIX = "re-export the checkpoint with `vllm-mixprec quantize`"


def _row_layer(cfg=BASE, k=256, n=128, prefix="model.layers.3.mlp.down_proj"):
    from vllm.model_executor.layers.linear import RowParallelLinear
    return RowParallelLinear(k, n, bias=False, quant_config=MixPrecConfig.from_config(cfg),
                             params_dtype=torch.float16, prefix=prefix)


def _qkv_layer(hidden=256, head=64, nh=4, nkv=2):
    from vllm.model_executor.layers.linear import QKVParallelLinear
    return QKVParallelLinear(hidden, head, nh, nkv, bias=False,
                             quant_config=MixPrecConfig.from_config(BASE),
                             params_dtype=torch.float16, prefix="model.layers.0.self_attn.qkv_proj")


def _tensors(n, k, gen, g=64):
    return ref.quantize_weight_lqq(torch.randn(n, k, generator=gen), g)


def _load(layer, tensors, shard_id=None, skip=()):
    for name, t in tensors.items():
        if name in skip:
            continue
        p = getattr(layer, name)
        if shard_id is None:
            p.weight_loader(p, t)
        else:
            p.weight_loader(p, t, shard_id)


def _refused(layer, *patterns):
    with pytest.raises(ValueError) as e:
        layer.quant_method.process_weights_after_loading(layer)
    msg = str(e.value)
    for pat in patterns:
        assert pat in msg, (pat, msg)
    return msg


# --- missing and truncated tensors --------------------------------------------------------

@pytest.mark.parametrize("name", ["qweight", "group_scale", "group_offset", "channel_scale"])
def test_missing_tensor_is_refused(vllm_tp1, seeded, name):
    """vLLM skips its missing-weight check for quantized models: without ours, the parameter
    stays torch.empty() and the layer serves whatever memory it got."""
    layer = _row_layer()
    _load(layer, _tensors(128, 256, seeded), skip=(name,))
    _refused(layer, "model.layers.3.mlp.down_proj", f"['{name}']", "were not in the checkpoint",
             FIX, "ignored_layers")


def test_missing_shard_of_merged_layer_is_refused(vllm_tp1, seeded):
    layer = _qkv_layer()
    for sid, n in (("q", 256), ("k", 128), ("v", 128)):
        _load(layer, _tensors(n, 256, seeded), sid, skip=("group_offset",) if sid == "k" else ())
    _refused(layer, "qkv_proj", "group_offset (shards loaded: ['q', 'v'] of 3)", FIX)


def test_complete_merged_layer_passes(vllm_tp1, seeded):
    """The completeness check counts shards; a full load in any order passes it."""
    layer = _qkv_layer()
    for sid, n in (("v", 128), ("q", 256), ("k", 128)):
        _load(layer, _tensors(n, 256, seeded), sid)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.mixprec_impl == "reference"


def test_truncated_shard_of_merged_layer_is_refused(vllm_tp1, seeded):
    """A k_proj qweight with fewer rows than the model's kv heads need (truncated tensor)."""
    layer = _qkv_layer()
    t = _tensors(128, 256, seeded)
    with pytest.raises(ValueError, match=r"qkv_proj\.qweight: checkpoint shape \(64, 128\) does not "
                                         r"fit .*shard 'k'.*truncated.*re-export"):
        layer.qweight.weight_loader(layer.qweight, t["qweight"][:64], "k")


# --- scales: dtype and shape --------------------------------------------------------------

@pytest.mark.parametrize("name,bad,expect", [
    ("channel_scale", lambda t: t.to(torch.bfloat16), r"channel_scale: checkpoint dtype torch.bfloat16, "
                                                       r"expected torch.float32"),
    ("group_offset", lambda t: t.to(torch.int8), r"group_offset: checkpoint dtype torch.int8, "
                                                  r"expected torch.uint8"),
    ("channel_scale", lambda t: t[:, None], r"channel_scale: checkpoint shape \(128, 1\) does not fit"),
    ("group_scale", lambda t: t.T.contiguous(), r"group_scale: checkpoint shape \(4, 128\) does not fit"),
])
def test_scales_with_wrong_dtype_or_shape(vllm_tp1, seeded, name, bad, expect):
    layer = _row_layer()
    t = _tensors(128, 256, seeded)
    p = getattr(layer, name)
    with pytest.raises(ValueError, match=expect + ".*re-export"):
        p.weight_loader(p, bad(t[name]))


# --- LiquidQuant parameters out of range ----------------------------------------------------

def test_group_offset_below_protective_range(vllm_tp1, seeded):
    """offset < 9 means min < -119: not something the exporter writes (FORMAT.md)."""
    layer = _row_layer()
    t = _tensors(128, 256, seeded)
    t["group_offset"][7, 2] = 8
    _load(layer, t)
    _refused(layer, "down_proj: group_offset has values outside [9, 247] (found [8,", FIX)


def test_lane_overflow_is_refused(vllm_tp1, seeded):
    """q*s + a > 255 carries into the neighbouring weight in the kernels' byte lanes. Each
    parameter alone is in range here (s=16, a=200 and q=15), only their combination is not,
    which the old per-field range checks let through."""
    layer = _row_layer()
    t = _tensors(128, 256, seeded)
    t["group_scale"][5, 1] = 16
    t["group_offset"][5, 1] = 200
    q = F.unpack_nibbles(t["qweight"])
    q[5, 64 + 3] = 15  # group 1 of row 5
    t["qweight"] = F.pack_nibbles(q)
    assert F.lqq_param_errors(t["qweight"], t["group_scale"], t["group_offset"])  # detected
    _load(layer, t)
    _refused(layer, "q*group_scale + group_offset > 255", "row 5, group 1: 440", FIX)


def test_exporter_output_passes_the_lane_check(seeded):
    """The check is not too strict: the exporter's own output (random and extreme rows) passes."""
    w = torch.randn(64, 256, generator=seeded) * torch.logspace(-3, 3, 64)[:, None]
    w[0] = 0.0
    w[1, :64] = 5.0
    w[2, ::2] = -1e4
    t = ref.quantize_weight_lqq(w, 64)
    assert F.lqq_param_errors(t["qweight"], t["group_scale"], t["group_offset"]) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_bad_channel_scale_is_refused(vllm_tp1, seeded, value):
    layer = _row_layer()
    t = _tensors(128, 256, seeded)
    t["channel_scale"][17] = value
    _load(layer, t)
    _refused(layer, "channel_scale has non-finite or non-positive values", FIX)


@pytest.mark.parametrize("value", [float("nan"), 0.0])
def test_bad_input_smooth_is_refused(vllm_tp1, seeded, value):
    """runtime_smooth divides activations by input_smooth: 0 or NaN would poison every token."""
    layer = _row_layer(dict(BASE, runtime_smooth=True))
    t = _tensors(128, 256, seeded)
    t["input_smooth"] = torch.rand(256, generator=seeded) + 0.5
    t["input_smooth"][3] = value
    _load(layer, t)
    _refused(layer, "input_smooth has non-finite or non-positive values", FIX)


# --- W4Ax ---------------------------------------------------------------------------------

W4AX = dict(BASE, weight_scheme="w4ax", act_bits="4/8", a8_fraction=0.25)


@pytest.mark.parametrize("what,expect", [
    ("duplicate", "act_perm is not a permutation of range(512)"),
    ("blocks", "a8_blocks=5 is outside [0, K/128 = 4]"),
])
def test_w4ax_metadata_is_checked(vllm_tp1, seeded, what, expect):
    layer = _row_layer(W4AX, k=512, n=64)
    t = _tensors(64, 512, seeded)
    perm = torch.randperm(512, generator=seeded).to(torch.int32)
    blocks = 1
    if what == "duplicate":
        perm[10] = perm[11]
    else:
        blocks = 5
    t.update(act_perm=perm, a8_blocks=torch.tensor([blocks], dtype=torch.int32))
    _load(layer, t)
    _refused(layer, "down_proj: " + expect, FIX)


def test_w4ax_refuses_row_parallel_sharding(vllm_tp1):
    """A W4Ax down_proj split over 2 ranks along K (what TP=2 asks of create_weights)."""
    layer = torch.nn.Module()
    method = MixPrecConfig.from_config(W4AX).get_quant_method(_row_layer(W4AX, k=512, n=64),
                                                              "model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"w4ax' permutes all of K.*--tensor-parallel-size 1"):
        method.create_weights(layer, 256, [64], 512, 64, torch.float16,
                              weight_loader=lambda *a: None)


def test_w4ax_needs_k_multiple_of_128(vllm_tp1):
    with pytest.raises(ValueError, match=r"down_proj: input size 320 is not a multiple of 128.*"
                                         r"--scheme w4a8"):
        _row_layer(W4AX, k=320, n=64)
