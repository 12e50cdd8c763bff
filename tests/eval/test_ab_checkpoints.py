"""The A/B harness's random checkpoints (eval/synthetic.py) are what vLLM 0.26 and our loader expect:
config machinery, GPTQ create_weights shapes (AutoGPTQConfig, what `gptq`/`gptq_marlin` resolve to
in 0.26), mixprec create_weights + weight_loader + apply, and the kernel vLLM picks on sm_90."""
import json
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.eval import synthetic as syn
from vllm_mixprec.quantize import gptq

from ab_helpers import TINY


def _tensors(folder):
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def test_mixprec_tensors_are_valid_liquidquant():
    n, k, g = 96, 256, 64
    specs = {s.name.rsplit(".", 1)[1]: s for s in syn.mixprec_specs("p", n, k, g, seed=3)}
    layout = F.W4Layout(n, k, g).tensor_specs()
    assert {name: (s.shape, s.dtype) for name, s in specs.items()} == layout
    t = {name: s.fill(torch.device("cpu")) for name, s in specs.items()}
    step, off = t["group_scale"].int(), t["group_offset"].int()
    assert int(step.min()) >= 1 and int(step.max()) <= F.MAX_GROUP_STEP and len(step.unique()) > 8
    assert int(off.min()) >= 9 and int((F.W4_MAX * step + off).max()) <= 255  # no byte lane ever carries
    q = F.unpack_nibbles(t["qweight"]).int()
    assert len(q.unique()) == 16
    # the dequantised int8 weights are centred: the random model's activations stay finite
    w8 = (q * step.repeat_interleave(g, 1) + off.repeat_interleave(g, 1)) - 128
    assert abs(float(w8.float().mean())) < 2 and 20 < float(w8.float().std()) < 80
    assert torch.equal(F.lqq_dequant_lanes(q, step.repeat_interleave(g, 1), off.repeat_interleave(g, 1)).int(), w8)
    assert t["channel_scale"].dtype == torch.float32 and bool((t["channel_scale"] > 0).all())


def test_gptq_tensors_match_the_quantizers_layout():
    n, k, g = 64, 256, 128
    specs = {s.name.rsplit(".", 1)[1]: s for s in syn.gptq_specs("p", n, k, g, seed=1)}
    t = {name: s.fill(torch.device("cpu")) for name, s in specs.items()}
    packed = gptq.pack_gptq(torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, k // g), g)
    assert {name: (tuple(v.shape), v.dtype) for name, v in t.items()} == \
           {name: (tuple(v.shape), v.dtype) for name, v in packed.items()}
    assert torch.equal(t["qzeros"], packed["qzeros"]) and torch.equal(t["g_idx"], packed["g_idx"])
    codes = gptq.unpack_gptq(t["qweight"])
    assert codes.shape == (n, k) and len(codes.unique()) == 16  # every nibble, the top one too
    assert torch.isfinite(gptq.dequantize_gptq(t)).all()


def test_streaming_writer_shards_and_index(tmp_path):
    specs = syn.checkpoint_specs(TINY, "bf16", seed=5)
    syn.write_shards(tmp_path, specs, torch.device("cpu"), shard_bytes=300_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
    got = _tensors(tmp_path)
    assert list(got) != [] and set(got) == {s.name for s in specs}
    for s in specs:  # every tensor regenerates bit for bit (seeded per name)
        assert torch.equal(got[s.name], s.fill(torch.device("cpu"))), s.name
    with safe_open(str(tmp_path / files[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_checkpoint_folders(tiny_ckpts):
    work, dirs = tiny_ckpts
    assert set(dirs) == set(syn.CKPT_KINDS)
    for kind, d in dirs.items():
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["num_hidden_layers"] == TINY.layers and cfg["rope_theta"] == TINY.rope_theta
        assert cfg["torch_dtype"] == "bfloat16" and (d / "tokenizer.json").exists()
        assert ("quantization_config" in cfg) == (kind != "bf16")
    assert (dirs["gptq"] / "quantize_config.json").exists()
    q = json.loads((dirs["gptq"] / "config.json").read_text())["quantization_config"]
    assert q == gptq.gptq_quantize_config(128, 0.01)
    kv4 = json.loads((dirs["mixprec-kv4"] / "config.json").read_text())["quantization_config"]
    w4 = json.loads((dirs["mixprec"] / "config.json").read_text())["quantization_config"]
    assert kv4.pop("kv_scheme") == "kv4" and w4.pop("kv_scheme") == "none" and kv4 == w4
    st = [f for f in os.listdir(dirs["mixprec"]) if f.endswith(".safetensors")]
    for f in st:  # the KV4 variant shares the W4A8 tensors, it does not copy them
        assert os.stat(dirs["mixprec"] / f).st_ino == os.stat(dirs["mixprec-kv4"] / f).st_ino
    # the non-linear tensors are the same in every checkpoint (same seeds)
    a, b = _tensors(dirs["bf16"]), _tensors(dirs["gptq"])
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert 0.015 < float(a["model.layers.1.mlp.up_proj.weight"].float().std()) < 0.025
    # built once: a second call finds them current; a changed recipe rebuilds
    log = []
    syn.ensure_checkpoints(work, TINY, ["bf16"], log=log.append)
    assert "up to date" in log[-1]
    assert not syn.is_current(dirs["bf16"], syn._marker(TINY, "bf16", seed=1, group_size=None))


@pytest.mark.parametrize("kind,flags,quant", [
    ("bf16", [], None),
    ("bf16", ["--quantization", "fp8"], "fp8"),
    ("gptq", [], "auto_gptq"),
    ("gptq", ["--linear-backend", "marlin"], "auto_gptq"),
    ("mixprec", ["--quantization", "mixprec"], "mixprec"),
    ("mixprec-kv4", ["--quantization", "mixprec", "--kv-cache-dtype", "int4_per_token_head",
                     "--attention-backend", "CUSTOM"], "mixprec"),
])
def test_vllm_model_config_accepts(tiny_ckpts, cpu_platform, kind, flags, quant):
    import vllm_mixprec
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_mixprec.register()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ea = EngineArgs.from_cli_args(parser.parse_args(["--model", str(tiny_ckpts[1][kind]), *flags]))
    mc = ea.create_model_config()
    assert mc.quantization == quant and mc.hf_config.num_hidden_layers == TINY.layers


class _RecordingKernel:
    """Stands in for the MPLinearKernel vLLM would pick on a GPU; records its layer config."""
    configs = []

    def __init__(self, c, **kw):
        self.configs.append(c)

    def process_weights_after_loading(self, layer):
        pass


def _linear_layers(shape, quant_config):
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                                   RowParallelLinear)
    kw = dict(bias=False, params_dtype=torch.bfloat16, quant_config=quant_config)
    return {
        "qkv": (QKVParallelLinear(shape.hidden, shape.head_dim, shape.heads, shape.kv_heads,
                                  prefix="model.layers.0.self_attn.qkv_proj", **kw),
                [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")]),
        "o": (RowParallelLinear(shape.hidden, shape.hidden, prefix="model.layers.0.self_attn.o_proj", **kw),
              [("self_attn.o_proj", None)]),
        "gate_up": (MergedColumnParallelLinear(shape.hidden, [shape.inter] * 2,
                                               prefix="model.layers.0.mlp.gate_up_proj", **kw),
                    [("mlp.gate_proj", 0), ("mlp.up_proj", 1)]),
        "down": (RowParallelLinear(shape.inter, shape.hidden, prefix="model.layers.0.mlp.down_proj", **kw),
                 [("mlp.down_proj", None)]),
    }


def _load(layer, shards, t):
    """Feed the checkpoint's tensors through vLLM's weight loaders; returns them per shard."""
    got = []
    for name, sid in shards:
        prefix = f"model.layers.0.{name}"
        own = {k[len(prefix) + 1:]: v for k, v in t.items() if k.startswith(prefix + ".")}
        for pname, tensor in own.items():
            p = getattr(layer, pname)
            p.weight_loader(p, tensor, *(() if sid is None else (sid,)))
        got.append(own)
    return got


def test_gptq_checkpoint_loads_through_autogptq(tiny_ckpts, vllm_tp1, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization import auto_gptq
    from vllm.scalar_type import scalar_types

    d = tiny_ckpts[1]["gptq"]
    cfg = json.loads((d / "config.json").read_text())
    qc = auto_gptq.AutoGPTQConfig.from_config(cfg["quantization_config"])
    assert auto_gptq.AutoGPTQConfig.override_quantization_method(cfg["quantization_config"], "gptq_marlin") \
        == "auto_gptq"
    qc.maybe_update_config(str(d))  # vLLM reads which layers are quantized from the safetensors headers
    from vllm.model_executor.models.llama import LlamaForCausalLM
    qc.packed_modules_mapping = dict(LlamaForCausalLM.packed_modules_mapping)  # set by vLLM's model init
    assert "model.layers.1.mlp.down_proj" in qc.modules_in_block_to_quantize
    assert not any("embed" in m or "lm_head" in m or "norm" in m for m in qc.modules_in_block_to_quantize)
    # no Marlin/Machete on a CPU: record the layer config the kernel would get instead
    monkeypatch.setattr(auto_gptq, "verify_marlin_supported", lambda **kw: None)
    monkeypatch.setattr(auto_gptq, "choose_mp_linear_kernel", lambda c: _RecordingKernel)
    _RecordingKernel.configs.clear()
    t = _tensors(d)
    with set_current_vllm_config(vllm_tp1):
        for kind, (layer, shards) in _linear_layers(TINY, qc).items():
            assert type(layer.quant_method).__name__ == "AutoGPTQLinearMethod", kind
            own = _load(layer, shards, t)
            for pname, dim in (("qweight", 1), ("scales", 1), ("qzeros", 1)):
                want = torch.cat([o[pname] for o in own], dim=dim)
                assert getattr(layer, pname).shape == want.shape, (kind, pname)
                assert torch.equal(getattr(layer, pname).data, want.to(getattr(layer, pname).dtype)), (kind, pname)
            assert torch.equal(layer.g_idx.data, own[0]["g_idx"])
    c = _RecordingKernel.configs[0]
    assert (c.weight_type, c.group_size, c.zero_points, c.has_g_idx, c.act_type) == \
           (scalar_types.uint4b8, 128, False, False, torch.bfloat16)


def test_mixprec_checkpoint_loads_through_mixprec_config(tiny_ckpts, vllm_tp1):
    from vllm.config import set_current_vllm_config
    from vllm_mixprec.quant_methods.config import MixPrecConfig

    d = tiny_ckpts[1]["mixprec-kv4"]
    qc = MixPrecConfig.from_config(json.loads((d / "config.json").read_text())["quantization_config"])
    assert qc.scheme.kv_scheme == "kv4" and qc.scheme.group_size == syn.MIXPREC_GROUP
    t = _tensors(d)
    g = torch.Generator().manual_seed(0)
    with set_current_vllm_config(vllm_tp1):
        for kind, (layer, shards) in _linear_layers(TINY, qc).items():
            own = _load(layer, shards, t)
            layer.quant_method.process_weights_after_loading(layer)
            x = (torch.randn(3, layer.input_size, generator=g)).bfloat16()
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
            cat = {k: torch.cat([o[k] for o in own]) for k in own[0]}
            xq, xs = ref.quantize_act(x)
            want = ref.w4a8_gemm(xq, xs, cat["qweight"], cat["group_scale"], cat["group_offset"],
                                 cat["channel_scale"], out_dtype=torch.float64)
            assert y.shape == want.shape and bool(torch.isfinite(y).all()), kind
            assert float((y.double() - want).norm() / want.norm()) < 1e-2, kind
            # a random model of real scale: outputs of the order of a bf16 model's (std 0.02 weights)
            assert 0.1 < float(want.std()) / (0.02 * layer.input_size ** 0.5) < 10, kind


def test_vllm_picks_machete_by_default_and_marlin_when_forced_on_sm90(monkeypatch):
    """choose_mp_linear_kernel (kernels/linear/__init__.py) with the platform made to look like an
    H100: GPTQ W4A16 g128 gets MacheteLinearKernel, and MarlinLinearKernel under --linear-backend marlin
    (or with VLLM_DISABLED_KERNELS=MacheteLinearKernel; AllSpark, between them, is Ampere-only)."""
    from vllm.config import DeviceConfig, KernelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.linear import MPLinearLayerConfig, choose_mp_linear_kernel
    from vllm.platforms import PlatformEnum
    from vllm.platforms.interface import DeviceCapability, UnspecifiedPlatform
    from vllm.scalar_type import scalar_types

    class H100(UnspecifiedPlatform):
        _enum = PlatformEnum.CUDA
        device_type = "cuda"

        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(9, 0)

    fake = H100()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm.") and hasattr(mod, "current_platform"):
            monkeypatch.setattr(mod, "current_platform", fake, raising=False)
    shapes = [(k, n) for n, k in syn.LLAMA3_8B.linear_shapes().values()]
    for backend, disabled, want in (("auto", "", "MacheteLinearKernel"), ("marlin", "", "MarlinLinearKernel"),
                                    ("auto", "MacheteLinearKernel", "MarlinLinearKernel")):
        monkeypatch.setenv("VLLM_DISABLED_KERNELS", disabled)
        cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), kernel_config=KernelConfig(linear_backend=backend))
        with set_current_vllm_config(cfg):
            for k, n in shapes:
                c = MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n),
                                        weight_type=scalar_types.uint4b8, act_type=torch.bfloat16,
                                        group_size=128, zero_points=False, has_g_idx=False)
                assert choose_mp_linear_kernel(c).__name__ == want, (backend, k, n)
