"""MixPrecConfig: round trip and errors that name the bad field."""
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


@pytest.mark.parametrize("change,field", [
    ({"group_size": 32}, "group_size"),
    ({"group_size": "64"}, "group_size"),
    ({"weight_scheme": "w4a4"}, "weight_scheme"),
    ({"weight_bits": 3}, "weight_bits"),
    ({"act_bits": 4}, "act_bits"),
    ({"kv_scheme": "kv2"}, "kv_scheme"),
    ({"format_version": 2}, "format_version"),
    ({"quant_method": "gptq"}, "quant_method"),
    ({"a8_fraction": 0.5}, "a8_fraction"),
    ({"weight_scheme": "w4ax", "act_bits": "4/8", "a8_fraction": 1.5}, "a8_fraction"),
    ({"weight_scheme": "w4ax", "act_bits": "4/8"}, "a8_fraction"),
    ({"ignored_layers": "lm_head"}, "ignored_layers"),
    ({"runtime_smooth": "yes"}, "runtime_smooth"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_field_is_named(change, field):
    with pytest.raises(MixPrecConfigError, match=field):
        MixPrecConfig.from_config(dict(GOOD, **change))


@pytest.mark.parametrize("missing", MixPrecScheme.REQUIRED)
def test_missing_field_is_named(missing):
    d = dict(GOOD)
    del d[missing]
    with pytest.raises(MixPrecConfigError, match=missing):
        MixPrecConfig.from_config(d)


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
