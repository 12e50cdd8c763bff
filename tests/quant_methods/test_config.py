"""MixPrecConfig: round trip and errors that name the bad field and the fix."""
import re

import pytest

from vllm_mixprec.quant_methods.config import MixPrecConfig, MixPrecConfigError, MixPrecScheme

GOOD = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8", "weight_bits": 4,
        "act_bits": 8, "group_size": 64, "kv_scheme": "kv4", "ignored_layers": ["lm_head"],
        "runtime_smooth": False}


def test_round_trip():
    cfg = MixPrecConfig.from_config(dict(GOOD))
    assert cfg.get_name() == "mixprec"
    assert cfg.scheme.to_dict() == GOOD
    assert MixPrecConfig.from_config(cfg.scheme.to_dict()).scheme == cfg.scheme


def test_w4ax_round_trip():
    d = dict(GOOD, weight_scheme="w4ax", act_bits="4/8", a8_fraction=0.25)
    assert MixPrecScheme.from_dict(d).to_dict() == d
    assert MixPrecScheme.from_dict(d).act_rotation == "none"  # checkpoints from before the field
    d_rot = dict(d, act_rotation="hadamard")
    assert MixPrecScheme.from_dict(d_rot).act_rotation == "hadamard"
    assert MixPrecScheme.from_dict(d_rot).to_dict() == d_rot
    assert MixPrecScheme.from_dict(dict(d, act_rotation="none")).to_dict() == d


# (bad value, field the error must name, the fix it must spell out)
@pytest.mark.parametrize("change,field,fix", [
    ({"group_size": 32}, "group_size", "--group-size 64"),
    ({"group_size": "64"}, "group_size", "--group-size 64"),
    ({"group_size": 64.0}, "group_size", "--group-size 64"),
    ({"weight_scheme": "w4a4"}, "weight_scheme", "--scheme w4a8"),
    ({"weight_bits": 3}, "weight_bits", "set it to 4"),
    ({"weight_bits": 8}, "weight_bits", "set it to 4"),
    ({"act_bits": 4}, "act_bits", "set it to 8"),
    ({"act_bits": True}, "act_bits", "set it to 8"),
    ({"kv_scheme": "kv2"}, "kv_scheme", "--kv none"),
    ({"format_version": 2}, "format_version", "upgrade vllm_mixprec"),
    ({"quant_method": "gptq"}, "quant_method", "without --quantization mixprec"),
    ({"a8_fraction": 0.5}, "a8_fraction", "remove the field"),
    ({"weight_scheme": "w4ax", "act_bits": "4/8", "a8_fraction": 1.5}, "a8_fraction", "--a8-fraction"),
    ({"weight_scheme": "w4ax", "act_bits": "4/8"}, "a8_fraction", "--a8-fraction"),
    ({"ignored_layers": "lm_head"}, "ignored_layers", r'e\.g\. \["lm_head"\]'),
    ({"runtime_smooth": "yes"}, "runtime_smooth", "JSON booleans"),
    ({"kv_residual_tokens": 129}, "kv_residual_tokens", r"integer in \[0, 128\]"),
    ({"kv_residual_tokens": -1}, "kv_residual_tokens", "remove it to use the default"),
    ({"kv_residual_tokens": "16"}, "kv_residual_tokens", "remove it to use the default"),
    ({"bogus": 1}, "bogus", "Upgrade vllm_mixprec, or remove the field"),
    ({"act_rotation": "hadamard"}, "act_rotation", "only valid with weight_scheme 'w4ax'"),
    ({"weight_scheme": "w4ax", "act_bits": "4/8", "a8_fraction": 0.25, "act_rotation": "givens"},
     "act_rotation", "--act-rotation hadamard"),
    ({"weight_scheme": "w4ax", "act_bits": "4/8", "a8_fraction": 0.25, "act_rotation": True},
     "act_rotation", "--act-rotation hadamard"),
])
def test_bad_field_is_named(change, field, fix):
    with pytest.raises(MixPrecConfigError, match=field) as e:
        MixPrecConfig.from_config(dict(GOOD, **change))
    assert re.search(fix, str(e.value)), str(e.value)


@pytest.mark.parametrize("missing", MixPrecScheme.REQUIRED)
def test_missing_field_is_named(missing):
    d = dict(GOOD)
    del d[missing]
    with pytest.raises(MixPrecConfigError, match=missing) as e:
        MixPrecConfig.from_config(d)
    assert "re-export the checkpoint with `vllm-mixprec quantize`" in str(e.value)


def test_kv_residual_tokens_reaches_the_backend(vllm_tp1, monkeypatch):
    """The checkpoint's kv_residual_tokens is what the CUSTOM backend uses (it used to be
    accepted by the loader and then silently ignored: the backend read an attribute that
    MixPrecConfig did not have)."""
    from vllm_mixprec.attention_backend import residual as R

    monkeypatch.delenv(R.ENV_TOKENS, raising=False)
    cfg = MixPrecConfig.from_config(dict(GOOD, kv_residual_tokens=48))
    assert cfg.scheme.to_dict()["kv_residual_tokens"] == 48
    monkeypatch.setattr(vllm_tp1, "quant_config", cfg)
    assert R.residual_tokens(vllm_tp1, 16) == 48
    monkeypatch.setattr(vllm_tp1, "quant_config", MixPrecConfig.from_config(dict(GOOD)))
    assert R.residual_tokens(vllm_tp1, 16) == 16  # absent: the default, one block


def test_override_claims_only_mixprec_checkpoints():
    assert MixPrecConfig.override_quantization_method(GOOD, None) == "mixprec"
    assert MixPrecConfig.override_quantization_method({"quant_method": "gptq"}, "mixprec") is None


def test_ignored_layers_and_merged_shards():
    cfg = MixPrecConfig.from_config(dict(GOOD, ignored_layers=["lm_head", "model.layers.0.mlp.*"]))
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                  "gate_up_proj": ["gate_proj", "up_proj"]}
    assert cfg.is_layer_ignored("lm_head")
    assert cfg.is_layer_ignored("model.layers.0.mlp.gate_up_proj")
    assert not cfg.is_layer_ignored("model.layers.1.mlp.gate_up_proj")
    partial = MixPrecConfig.from_config(dict(GOOD, ignored_layers=["model.layers.0.self_attn.q_proj"]))
    partial.packed_modules_mapping = cfg.packed_modules_mapping
    with pytest.raises(MixPrecConfigError, match="only some shards"):
        partial.is_layer_ignored("model.layers.0.self_attn.qkv_proj")
