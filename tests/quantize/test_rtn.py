"""quantize/rtn.py: the round-to-nearest W4A8 export the GPU host rebuilds from the real Qwen's bf16
folder, whose bytes real_model_check pins by sha256 against the one scored on the CPU."""
import hashlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_mixprec import reference as ref
from vllm_mixprec.quantize.rtn import export_rtn_folder, rtn_w4a8_tensors


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def bf16_folder(tmp_path):
    g = torch.Generator().manual_seed(0)
    src = tmp_path / "src"
    src.mkdir()
    state = {"model.embed_tokens.weight": torch.randn(32, 128, generator=g).to(torch.bfloat16),
             "model.layers.0.self_attn.k_proj.weight": torch.randn(64, 128, generator=g).to(torch.bfloat16),
             "model.layers.0.self_attn.k_proj.bias": torch.randn(64, generator=g).to(torch.bfloat16),
             "model.layers.0.mlp.down_proj.weight": torch.randn(128, 256, generator=g).to(torch.bfloat16)}
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                                 "torch_dtype": "bfloat16", "rope_theta": 1e6}))
    (src / "tokenizer.json").write_text("{}")
    return src, state


def test_linears_become_w4a8_and_the_rest_stays(bf16_folder):
    _, state = bf16_folder
    got = rtn_w4a8_tensors(state, 64)
    assert torch.equal(got["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(got["model.layers.0.self_attn.k_proj.bias"], state["model.layers.0.self_attn.k_proj.bias"])
    for lin in ("self_attn.k_proj", "mlp.down_proj"):
        assert f"model.layers.0.{lin}.weight" not in got
        want = ref.quantize_weight_lqq(state[f"model.layers.0.{lin}.weight"].float(), 64)
        assert all(torch.equal(got[f"model.layers.0.{lin}.{k}"], v) for k, v in want.items())


def test_export_is_byte_for_byte_repeatable(bf16_folder, tmp_path):
    src, _ = bf16_folder
    a = export_rtn_folder(src, tmp_path / "a", "kv4")
    b = export_rtn_folder(src, tmp_path / "b", "kv4")
    for f in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _sha(a / f) == _sha(b / f), f
    qc = json.loads((a / "config.json").read_text())["quantization_config"]
    assert qc["kv_scheme"] == "kv4" and qc["group_size"] == 64
    assert "model.layers.0.mlp.down_proj.qweight" in load_file(str(a / "model.safetensors"))
    with pytest.raises(Exception, match="already exists"):
        export_rtn_folder(src, tmp_path / "a", "kv4")


def test_export_needs_safetensors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        export_rtn_folder(tmp_path / "empty", tmp_path / "out")
