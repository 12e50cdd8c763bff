"""Exported checkpoints load through vLLM's real create_weights + weight_loader and compute
what the reference modules compute; the export itself is atomic."""
import json

import pytest
import torch
from safetensors.torch import load_file

from vllm_mixprec import formats as F
from vllm_mixprec.quantize import export
from vllm_mixprec.quantize.modules import MixPrecLinear
from vllm_mixprec.quantize.pipeline import QuantOptions, quantize_model
from vllm_mixprec.quantize.testing import calib_text_file, save_tiny

SCHEMES = {
    "w4a8-llama": ("llama", dict(weight_scheme="w4a8", smooth=True, gptq=True, clip=True,
                                 smooth_attention=True, kv_scheme="kv4")),
    "w4ax-qwen2": ("qwen2", dict(weight_scheme="w4ax", smooth=True, a8_fraction=0.5, group_size=128)),
    # GPTQ on the rotated basis (fmpq.hessian_basis); 0.25 of one or two blocks rounds to none at 8 bits
    "w4ax-rot-llama": ("llama", dict(weight_scheme="w4ax", act_rotation="hadamard", gptq=True,
                                     a8_fraction=0.25)),
    # each 64-channel half rotated alone (formats: act_rotation "hadamard64")
    "w4ax-rot64-qwen2": ("qwen2", dict(weight_scheme="w4ax", act_rotation="hadamard64", smooth=True,
                                       a8_fraction=0.25)),
}


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def exported(request, tmp_path_factory):
    arch, kw = SCHEMES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    src = save_tiny(d / "src", arch)
    text = calib_text_file(d / "calib.txt")
    opts = QuantOptions(calib_text=str(text), calib_samples=4, calib_seqlen=64, sample_rows=128,
                        progress=False, **kw)
    summary = quantize_model(src, d / "out", opts)
    return arch, d / "out", summary, kw


def test_config_and_tensor_specs(exported):
    arch, out, _, kw = exported
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    from vllm_mixprec.quant_methods.config import MixPrecScheme
    scheme = MixPrecScheme.from_dict(qc)  # the loader accepts it
    assert qc.get("act_rotation", "none") == kw.get("act_rotation", "none")
    assert cfg["rope_theta"] and cfg["torch_dtype"]
    assert (out / "tokenizer.json").exists()
    t = load_file(str(out / "model.safetensors"))
    shapes = {"q_proj": (128, 128), "o_proj": (128, 128), "down_proj": (128, 256), "gate_proj": (256, 128)}
    for name, (n, k) in shapes.items():
        sub = "self_attn" if "proj" in name and name[0] in "qkvo" else "mlp"
        p = f"model.layers.1.{sub}.{name}"
        for tname, (shape, dtype) in F.W4Layout(n, k, scheme.group_size).tensor_specs().items():
            assert t[f"{p}.{tname}"].shape == shape and t[f"{p}.{tname}"].dtype == dtype
        if scheme.weight_scheme == "w4ax":
            perm = t[f"{p}.act_perm"]
            assert perm.dtype == torch.int32 and torch.equal(perm.sort().values, torch.arange(k, dtype=torch.int32))
            assert t[f"{p}.a8_blocks"].dtype == torch.int32 and t[f"{p}.a8_blocks"].shape == (1,)
    if scheme.weight_scheme == "w4ax":  # fused layers share their permutation
        pre = "model.layers.0."
        assert torch.equal(t[pre + "self_attn.q_proj.act_perm"], t[pre + "self_attn.v_proj.act_perm"])
        assert torch.equal(t[pre + "mlp.gate_proj.act_perm"], t[pre + "mlp.up_proj.act_perm"])
    assert ("lm_head.weight" in t) == (arch == "qwen2")  # tied for the Llama
    assert t["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16


def _vllm_layer(kind, cfg, quant_config, prefix):
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
    hd = cfg["head_dim"]
    kw = dict(params_dtype=torch.bfloat16, quant_config=quant_config, prefix=prefix)
    if kind == "qkv":
        return QKVParallelLinear(cfg["hidden_size"], hd, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                 bias=cfg["model_type"] == "qwen2", **kw)
    if kind == "gate_up":
        return MergedColumnParallelLinear(cfg["hidden_size"], [cfg["intermediate_size"]] * 2, bias=False, **kw)
    if kind == "o":
        return RowParallelLinear(cfg["num_attention_heads"] * hd, cfg["hidden_size"], bias=False, **kw)
    return RowParallelLinear(cfg["intermediate_size"], cfg["hidden_size"], bias=False, **kw)


FUSED = {"qkv": ("self_attn", [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]),
         "gate_up": ("mlp", [("gate_proj", 0), ("up_proj", 1)]),
         "o": ("self_attn", [("o_proj", None)]), "down": ("mlp", [("down_proj", None)])}


@pytest.mark.parametrize("kind", sorted(FUSED))
def test_loads_through_vllm_and_matches_reference(exported, kind, vllm_tp1):
    from vllm.config import set_current_vllm_config
    from vllm_mixprec.quant_methods.config import MixPrecConfig

    arch, out, _, _ = exported
    cfg = json.loads((out / "config.json").read_text())
    qcfg = MixPrecConfig.from_config(cfg["quantization_config"])
    t = load_file(str(out / "model.safetensors"))
    sub, shards = FUSED[kind]
    with set_current_vllm_config(vllm_tp1):
        layer = _vllm_layer(kind, cfg, qcfg, f"model.layers.0.{sub}.{kind}_proj")
        refs = []
        for name, shard in shards:
            prefix = f"model.layers.0.{sub}.{name}"
            own = {k[len(prefix) + 1:]: v for k, v in t.items() if k.startswith(prefix + ".")}
            for pname, tensor in own.items():
                param = getattr(layer, pname)
                args = () if shard is None else (shard,)
                param.weight_loader(param, tensor, *args)
            bias = own.pop("bias", None)
            refs.append(MixPrecLinear(own, bias, qcfg.scheme.weight_scheme, qcfg.scheme.act_rotation))
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.randn(7, layer.input_size, generator=torch.Generator().manual_seed(0)).bfloat16()
        got = layer(x)
        got = got[0] if isinstance(got, tuple) else got
    want = torch.cat([m(x) for m in refs], dim=-1)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_summary_reports_time(exported):
    _, _, summary, _ = exported
    assert summary["seconds_quantize"] > 0 and len(summary["layers"]) == 2


def test_summary_warns_when_calibration_is_short(exported):
    """The tiny models get 4 x 64 calibration tokens: GPTQ's and W4Ax's exports carry a warning
    each, the others none."""
    _, _, summary, kw = exported
    want = [w for w, on in (("GPTQ with 256", kw.get("gptq")),
                            ("W4Ax with 256", kw["weight_scheme"] == "w4ax")) if on]
    assert [w[:13] for w in summary["warnings"]] == want
    assert all("--calib-samples" in w for w in summary["warnings"])


@pytest.mark.parametrize("scheme,gptq_flag,tokens,warns", [
    ("w4a8", True, 4096, True), ("w4a8", True, 8 * 8960, False), ("w4a8", False, 4096, False),
    ("gptq-w4a16", False, 32768, True), ("w4ax", True, 100_000, False)])
def test_gptq_calibration_warning(scheme, gptq_flag, tokens, warns):
    from types import SimpleNamespace
    qwen = SimpleNamespace(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                           num_key_value_heads=2)
    opts = QuantOptions(weight_scheme=scheme, gptq=gptq_flag, calib_seqlen=512)
    msg = opts.gptq_calibration_warning(qwen, tokens)
    assert (msg is not None) == warns
    if warns:  # names the count, the widest input and the fix
        assert f"{tokens} calibration tokens" in msg and "8960 input channels" in msg
        assert "--calib-samples to at least 140" in msg


@pytest.mark.parametrize("scheme,tokens,warns", [
    ("w4ax", 8 * 512, True), ("w4ax", 16 * 512, True), ("w4ax", 32 * 512, False), ("w4a8", 4096, False)])
def test_w4ax_calibration_warning(scheme, tokens, warns):
    msg = QuantOptions(weight_scheme=scheme, calib_seqlen=512).w4ax_calibration_warning(tokens)
    assert (msg is not None) == warns
    if warns:  # names the count, the measured misses and the fix
        assert f"{tokens} calibration tokens" in msg and "1.59x" in msg
        assert "--calib-samples to at least 32" in msg


@pytest.mark.parametrize("percdamp", [0.0, -0.01, float("nan"), float("inf")])
def test_bad_percdamp_is_refused(percdamp):
    with pytest.raises(ValueError, match="--percdamp .*positive finite"):
        QuantOptions(weight_scheme="w4a8", gptq=True, percdamp=percdamp).validate()


def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch):
    calls = []

    def boom(*a, **k):
        calls.append(1)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_file", boom)
    with pytest.raises(OSError):
        export.write_checkpoint(tmp_path / "out", {"a": torch.zeros(3)}, {"architectures": ["X"]},
                                tmp_path, None)
    assert calls and not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no temp folder left either


def test_disk_space_checked_first(tmp_path, monkeypatch):
    import collections
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(export.shutil, "disk_usage", lambda p: usage(10, 10, 1000))
    with pytest.raises(export.ExportError, match="not enough disk space"):
        export.write_checkpoint(tmp_path / "out", {"a": torch.zeros(1000)}, {}, tmp_path, None)
    assert not (tmp_path / "out").exists()


def test_sharded_write_has_index(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(4)}
    out = export.write_checkpoint(tmp_path / "out", tensors, {"architectures": ["X"]}, tmp_path, None,
                                  shard_bytes=2048)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    loaded = {}
    for fn in set(index["weight_map"].values()):
        loaded.update(load_file(str(out / fn)))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
