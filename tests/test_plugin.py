"""The plugin as vLLM sees it: entry point, registration, CLI parsing, config resolution."""
import importlib.metadata
import json

import pytest


def test_entry_point_is_discoverable():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [e for e in eps if e.name == "mixprec"]
    assert len(ours) == 1 and ours[0].value == "vllm_mixprec:register"
    assert callable(ours[0].load())


def test_register_twice_and_registries():
    import vllm_mixprec
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_mixprec.register()
    vllm_mixprec.register()
    assert QUANTIZATION_METHODS.count("mixprec") == 1
    assert AttentionBackendEnum.CUSTOM.get_path() == vllm_mixprec.BACKEND_CLASS_PATH


def test_mixprec_env_is_in_the_compile_cache_key(monkeypatch):
    """A MIXPREC_* variable that changes the traced graph must change vLLM's compile-cache key
    (session 26: reruns with another MIXPREC_TP_ACT_SCALE loaded the first run's graph)."""
    import vllm.envs as envs
    from vllm.config.utils import hash_factors

    import vllm_mixprec
    from vllm_mixprec import compile_cache

    vllm_mixprec.register()
    for k in [k for k in __import__("os").environ if k.startswith("MIXPREC_")]:
        monkeypatch.delenv(k)
    keys = {}
    for value in (None, "rank", "global"):
        if value is None:
            monkeypatch.delenv("MIXPREC_TP_ACT_SCALE", raising=False)
        else:
            monkeypatch.setenv("MIXPREC_TP_ACT_SCALE", value)
        keys[value] = hash_factors(envs.compile_factors())  # the env part of both cache keys
        assert envs.compile_factors()[compile_cache.FACTOR] == compile_cache.mixprec_env()
    assert len(set(keys.values())) == 3, "each setting needs its own compiled graph"
    assert compile_cache.mixprec_env({"MIXPREC_B": "2", "MIXPREC_A": "1", "OTHER": "x"}) == \
        "MIXPREC_A=1;MIXPREC_B=2"


def test_register_does_not_touch_cuda():
    import subprocess
    import sys
    code = ("import torch, vllm_mixprec; vllm_mixprec.register(); "
            "import sys; sys.exit(1 if torch.cuda.is_initialized() else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


@pytest.fixture
def cpu_platform(monkeypatch):
    """vLLM's own `vllm bench` swaps the Unspecified platform for CPU the same way."""
    from vllm import platforms
    from vllm.platforms.cpu import CpuPlatform
    monkeypatch.setattr(platforms, "current_platform", CpuPlatform())


def _tiny_llama(tmp_path, quantization_config=None):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
           "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
           "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "rope_theta": 10000.0}
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


MIXPREC_CFG = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8",
               "weight_bits": 4, "act_bits": 8, "group_size": 64, "kv_scheme": "kv4"}


def _engine_args(argv):
    import vllm_mixprec
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    vllm_mixprec.register()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv + ["--skip-tokenizer-init"]))


def test_cli_accepts_quantization_mixprec(cpu_platform, tmp_path):
    ea = _engine_args(["--model", _tiny_llama(tmp_path, MIXPREC_CFG), "--quantization", "mixprec",
                       "--kv-cache-dtype", "int4_per_token_head", "--attention-backend", "CUSTOM"])
    assert (ea.quantization, ea.kv_cache_dtype) == ("mixprec", "int4_per_token_head")
    assert ea.create_model_config().quantization == "mixprec"


def test_checkpoint_selects_mixprec_without_flag(cpu_platform, tmp_path):
    ea = _engine_args(["--model", _tiny_llama(tmp_path, MIXPREC_CFG)])
    assert ea.create_model_config().quantization == "mixprec"


def test_mixprec_flag_on_gptq_checkpoint_is_refused(cpu_platform, tmp_path):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    ea = _engine_args(["--model", _tiny_llama(tmp_path, gptq), "--quantization", "mixprec"])
    with pytest.raises(ValueError, match="does not match"):
        ea.create_model_config()
