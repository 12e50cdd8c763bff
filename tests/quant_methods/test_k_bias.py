"""Bias-aware K through vLLM's real classes: a Qwen2 attention block (q/k/v biases) with the
mixprec linear and KV-cache methods, loaded and post-processed by vLLM's own
process_weights_after_loading, then written and attended by the backend; plus the
refusals of RoPE variants bias-aware K does not model, and the knobs."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from linear_helpers import load_tensors
from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.quant_methods import k_bias as KB
from vllm_mixprec.quant_methods.config import MixPrecConfig

KV4 = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8", "weight_bits": 4,
       "act_bits": 8, "group_size": 64, "kv_scheme": "kv4"}
HIDDEN, HEADS, KV_HEADS, HEAD = 256, 4, 2, 64
PREFIX = "model.layers.0.self_attn"


class _ModelConfig(SimpleNamespace):
    """The parts of vLLM's ModelConfig these layers read (a real one needs a model folder)."""

    def __getattr__(self, name):
        return None


def _hf(**kw):
    from transformers import Qwen2Config
    return Qwen2Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       rope_theta=1e6, architectures=["Qwen2ForCausalLM"], **kw)


def _k_bias(gen) -> torch.Tensor:
    """Qwen2.5-layer-0-like: the slowest rotary pairs carry biases in the hundreds."""
    b = torch.randn(KV_HEADS, HEAD, generator=gen) * 0.5
    half = HEAD // 2
    b[:, [half - 1, HEAD - 1, half - 2]] = torch.tensor([354.0, -250.0, 120.0])
    return b


def _qwen2_block(monkeypatch, gen, cache_dtype="int4_per_token_head", quant=KV4, backend=None):
    """model.layers.0.self_attn = vLLM's Qwen2Attention with `--quantization mixprec`, its
    weights loaded through vLLM's weight loaders, then vLLM's process_weights_after_loading."""
    import vllm_mixprec
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import attention as attn_mod
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen2 import Qwen2Attention

    from vllm_mixprec.attention_backend.backend import MixPrecAttentionBackend

    vllm_mixprec.register()
    # the platform's selector (CPU here) would not pick CUSTOM; on a GPU the flag does
    backend = backend or MixPrecAttentionBackend
    monkeypatch.setattr(attn_mod, "get_attn_backend", lambda *a, **k: backend)
    hf = _hf()
    cc = CacheConfig(cache_dtype=cache_dtype)
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"), cache_config=cc)
    cfg.model_config = _ModelConfig(hf_config=hf, hf_text_config=hf, dtype=torch.float16,
                                    architectures=hf.architectures)
    cfg.quant_config = MixPrecConfig.from_config(quant)  # as `--quantization mixprec` sets it
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with set_current_vllm_config(cfg):
            root = nn.Module()
            root.model = nn.Module()
            root.model.layers = nn.ModuleList([nn.Module()])
            sa = Qwen2Attention(HIDDEN, HEADS, KV_HEADS, hf.rope_parameters, cache_config=cc,
                                quant_config=MixPrecConfig.from_config(quant), prefix=PREFIX)
            root.model.layers[0].self_attn = sa
            biases = {"q": torch.randn(HEADS * HEAD, generator=gen),
                      "k": _k_bias(gen).flatten(),
                      "v": torch.randn(KV_HEADS * HEAD, generator=gen)}
            for sid, n in (("q", HEADS * HEAD), ("k", KV_HEADS * HEAD), ("v", KV_HEADS * HEAD)):
                w = torch.randn(n, HIDDEN, generator=gen) * (0.02 if sid == "k" else 0.1)
                load_tensors(sa.qkv_proj, ref.quantize_weight_lqq(w, 64), sid)
                sa.qkv_proj.bias.weight_loader(sa.qkv_proj.bias, biases[sid].half(),
                                               sid)
            load_tensors(sa.o_proj, ref.quantize_weight_lqq(
                torch.randn(HIDDEN, HEADS * HEAD, generator=gen), 64), None)
            process_weights_after_loading(root, cfg.model_config, torch.device("cpu"))
    finally:
        torch.set_default_dtype(old)
    return sa, cfg, biases


def _attend(sa, cfg, x, monkeypatch):
    """One prefill step of one request through the metadata builder and the impl."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from vllm_mixprec.attention_backend.backend import MixPrecAttentionBackend as Backend
    from vllm_mixprec.attention_backend.metadata import MixPrecAttentionMetadataBuilder

    t, b, carrier = x.shape[0], 16, sa.attn.kv_cache_dtype
    with torch.no_grad():
        qkv, _ = sa.qkv_proj(x)
    q, k, v = qkv.split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
    pos = torch.arange(t)
    q, k = sa.rotary_emb.forward_native(pos, q, k)
    q, k, v = q.view(t, HEADS, HEAD), k.view(t, KV_HEADS, HEAD), v.view(t, KV_HEADS, HEAD)
    nb = t // b + 2
    cache = torch.zeros(Backend.get_kv_cache_shape(nb, b, KV_HEADS, HEAD, carrier),
                        dtype=torch.uint8)
    sa.attn.kv_cache = cache
    spec = FullAttentionSpec(block_size=b, num_kv_heads=KV_HEADS, head_size=HEAD,
                             head_size_v=HEAD, dtype=cache.dtype,
                             kv_quant_mode=get_kv_quant_mode(carrier))
    builder = MixPrecAttentionMetadataBuilder(spec, [sa.attn.layer_name], cfg, torch.device("cpu"))
    bt = torch.randperm(nb)[: -(-t // b)].int()[None]
    sm = bt[0, pos // b].long() * b + pos % b
    qsl = torch.tensor([0, t], dtype=torch.int32)
    cm = CommonAttentionMetadata(query_start_loc=qsl, query_start_loc_cpu=qsl,
                                 seq_lens=torch.tensor([t], dtype=torch.int32), num_reqs=1,
                                 num_actual_tokens=t, max_query_len=t, max_seq_len=t,
                                 block_table_tensor=bt, slot_mapping=sm)
    md = builder.build(0, cm)
    impl = sa.attn.impl
    monkeypatch.setattr(impl, "_metadata_of", lambda _layer: md)
    impl.do_kv_cache_update(sa.attn, k, v, cache, sm)
    out = torch.full_like(q, float("nan"))
    impl.forward(sa.attn, q, k, v, cache, md, out)
    want = ref.attention(q, k, v, HEAD ** -0.5)
    return float((out.double() - want).norm() / want.norm()), md


def test_qwen2_block_gets_bias_aware_k_end_to_end(vllm_tp1, monkeypatch, caplog):
    """vLLM's loader processes qkv_proj before attn: the Attention layer ends up with this
    rank's k bias (the 16 largest pairs per head) and the model's RoPE frequencies, the
    builder hands out key positions, and the backend's output is as close to float attention
    as KV4 can be, where the same block without it is not. The one prefill step reads its keys
    back from the cache (exact prefill off: with it the chunk never touches the cache)."""
    monkeypatch.delenv(KB.ENV, raising=False)
    monkeypatch.setenv("MIXPREC_ATTN_PREFILL_EXACT", "0")
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="vllm.mixprec"):
        monkeypatch.setattr(KB, "_logged", False)
        sa, cfg, biases = _qwen2_block(monkeypatch, gen)
    kb = sa.attn.k_rope_bias
    assert isinstance(kb, F.KRopeBias)
    inv_freq = sa.rotary_emb._compute_inv_freq(sa.rotary_emb.base)
    assert torch.equal(kb.inv_freq, inv_freq)
    want = F.make_k_rope_bias(biases["k"].half().float().view(KV_HEADS, HEAD),
                              inv_freq, KB.DEFAULT_PAIRS)
    assert torch.equal(kb.bias, want.bias) and torch.equal(kb.pairs, want.pairs)
    assert kb.pairs.shape == (KV_HEADS, 16)
    assert sum("bias-aware K quantization" in r.getMessage() for r in caplog.records) == 1
    assert KB._qkv_k_bias == {}  # consumed

    x = torch.randn(40, HIDDEN, generator=gen).half()  # fp16: the CPU interpreter mangles bf16 dots
    aware, md = _attend(sa, cfg, x, monkeypatch)
    assert torch.equal(md.key_positions[:40].long(), torch.arange(40))

    monkeypatch.setenv(KB.ENV, "0")
    sa_off, cfg_off, _ = _qwen2_block(monkeypatch, torch.Generator().manual_seed(0))
    assert getattr(sa_off.attn, "k_rope_bias", None) is None
    plain, md_off = _attend(sa_off, cfg_off, x, monkeypatch)
    assert md_off.key_positions is None
    assert aware < 0.1 and plain > 5 * aware, (aware, plain)


def test_kv_not_quantized_gets_no_bias(vllm_tp1, monkeypatch):
    """kv_scheme 'none' with a 16-bit cache: the attention layer is not ours to change."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    sa, _, _ = _qwen2_block(monkeypatch, torch.Generator().manual_seed(1), cache_dtype="auto",
                            quant=dict(KV4, kv_scheme="none"), backend=TritonAttentionBackend)
    assert getattr(sa.attn, "k_rope_bias", None) is None
    assert KB._qkv_k_bias == {}


def test_ignored_qkv_proj_still_records_its_bias(vllm_tp1):
    from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod

    cfg = MixPrecConfig.from_config(dict(KV4, ignored_layers=["model.layers.3.self_attn.qkv_proj"]))
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=True, quant_config=cfg,
                              params_dtype=torch.float16, prefix="model.layers.3.self_attn.qkv_proj")
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    layer.bias.data.copy_(torch.arange(layer.bias.numel(), dtype=torch.float16))
    layer.quant_method.process_weights_after_loading(layer)
    got = KB._qkv_k_bias.pop("model.layers.3.self_attn")
    q_size = HEADS * HEAD
    assert torch.equal(got.flatten(), layer.bias.data[q_size:q_size + KV_HEADS * HEAD].float())


def test_qkv_without_bias_records_none(vllm_tp1):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, params_dtype=torch.float16)
    KB._qkv_k_bias["model.layers.5.self_attn"] = torch.ones(2, 64)  # stale, from another model
    KB.record_qkv_bias(layer, "model.layers.5.self_attn.qkv_proj")
    attn = SimpleNamespace(kv_cache_dtype="int4_per_token_head", num_kv_heads=2, head_size=64,
                           attn_backend=SimpleNamespace(get_name=lambda: "CUSTOM"))
    KB.attach(attn, "model.layers.5.self_attn.attn", None)
    assert not hasattr(attn, "k_rope_bias") and "model.layers.5.self_attn" not in KB._qkv_k_bias


def _attach(bias, hf=None, archs=("Qwen2ForCausalLM",), prefix="model.layers.7.self_attn"):
    KB._qkv_k_bias[prefix] = bias
    attn = SimpleNamespace(kv_cache_dtype="int8_per_token_head", num_kv_heads=bias.shape[0],
                           head_size=bias.shape[1],
                           attn_backend=SimpleNamespace(get_name=lambda: "CUSTOM"))
    hf = hf or _hf()
    KB.attach(attn, prefix + ".attn",
              _ModelConfig(hf_config=hf, hf_text_config=hf, architectures=list(archs)))
    return getattr(attn, "k_rope_bias", None)


def test_small_biases_and_the_knobs(monkeypatch):
    for env in (KB.ENV, KB.ENV_MIN, KB.ENV_PAIRS):
        monkeypatch.delenv(env, raising=False)
    small = torch.randn(2, 64) * 2  # Qwen2.5's layers >= 2: the bias is K's own size
    assert _attach(small) is None
    monkeypatch.setenv(KB.ENV_MIN, "0")
    assert _attach(small).pairs.shape == (2, 16)
    monkeypatch.setenv(KB.ENV_PAIRS, "all")
    kb = _attach(small)
    assert kb.pairs.shape == (2, 32) and torch.equal(kb.bias, small)
    monkeypatch.setenv(KB.ENV_PAIRS, "32")
    assert _attach(small).pairs.shape == (2, 32)
    for env, bad, match in ((KB.ENV_PAIRS, "24", "power of two"), (KB.ENV_MIN, "-1", ">= 0"),
                            (KB.ENV, "maybe", "0 \\(off\\), 1 \\(on\\) or auto")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=f"{env}=.*{match}"):
            _attach(small)
        monkeypatch.delenv(env)


@pytest.mark.parametrize("hf_kw,field", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 32768}),
     "rope_parameters.rope_type='yarn'"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12]}),
     "rope_parameters.mrope_section"),
    (dict(dual_chunk_attention_config={"chunk_size": 8192}), "dual_chunk_attention_config"),
])
def test_unsupported_rope_is_refused(hf_kw, field, monkeypatch):
    monkeypatch.delenv(KB.ENV, raising=False)
    big = _k_bias(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="bias-aware K") as e:
        _attach(big, _hf(**hf_kw))
    assert field in str(e.value) and f"{KB.ENV}=0" in str(e.value), str(e.value)
    monkeypatch.setenv(KB.ENV, "0")
    assert _attach(big, _hf(**hf_kw)) is None  # the documented way out


def test_unknown_architecture_needs_the_force_flag(monkeypatch):
    monkeypatch.delenv(KB.ENV, raising=False)
    big = _k_bias(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"architectures=\['GPTJForCausalLM'\] is not known"):
        _attach(big, archs=["GPTJForCausalLM"])
    monkeypatch.setenv(KB.ENV, "1")
    kb = _attach(big, archs=["GPTJForCausalLM"])
    assert torch.equal(kb.inv_freq, 1.0 / (1e6 ** (torch.arange(0, 64, 2).float() / 64)))


def test_head_count_mismatch_is_named(monkeypatch):
    monkeypatch.delenv(KB.ENV, raising=False)
    KB._qkv_k_bias["model.layers.9.self_attn"] = _k_bias(torch.Generator().manual_seed(0))
    attn = SimpleNamespace(kv_cache_dtype="int4_per_token_head", num_kv_heads=1, head_size=64,
                           attn_backend=SimpleNamespace(get_name=lambda: "CUSTOM"))
    with pytest.raises(ValueError, match=r"k bias has shape \(2, 64\).*\(1, 64\)"):
        KB.attach(attn, "model.layers.9.self_attn.attn", None)


# --- KV4 without --quantization mixprec: nothing hands the k bias over ---------------------------

def _vllm_config(hf, quant=None):
    return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=hf, hf_config=hf), quant_config=quant)


def test_plain_kv4_of_a_k_bias_model_is_refused(monkeypatch):
    """A bf16 Qwen2 with --kv-cache-dtype int4_per_token_head (vLLM's own linears) would quantize
    K with biases in the hundreds: refused at start-up, naming the flag and the ways out."""
    monkeypatch.delenv(KB.ENV_PLAIN_KV4, raising=False)
    cfg = _vllm_config(_hf())
    with pytest.raises(ValueError, match="--kv-cache-dtype int4_per_token_head without --quantization mixprec "
                                         "on a qwen2 model") as e:
        KB.check_plain_kv4(cfg, "int4_per_token_head")
    assert KB.ENV_PLAIN_KV4 in str(e.value) and "int8_per_token_head" in str(e.value)
    from vllm_mixprec.attention_backend.impl import MixPrecAttentionImpl
    monkeypatch.setattr("vllm_mixprec.attention_backend.impl.get_current_vllm_config_or_none", lambda: cfg)
    with pytest.raises(ValueError, match="without --quantization mixprec"):
        MixPrecAttentionImpl(HEADS, HEAD, HEAD ** -0.5, KV_HEADS, None, None, "int4_per_token_head")


def test_plain_kv4_refusal_spares_what_is_served_well(monkeypatch):
    monkeypatch.delenv(KB.ENV_PLAIN_KV4, raising=False)
    qwen = _hf()
    mixprec = MixPrecConfig.from_config(KV4)
    KB.check_plain_kv4(_vllm_config(qwen, mixprec), "int4_per_token_head")  # bias-aware K applies
    KB.check_plain_kv4(_vllm_config(qwen), "int8_per_token_head")  # KV8: +2 % without it
    KB.check_plain_kv4(None, "int4_per_token_head")  # no config (unit tests of the backend)
    from transformers import LlamaConfig
    KB.check_plain_kv4(_vllm_config(LlamaConfig()), "int4_per_token_head")  # no k bias
    with pytest.raises(ValueError, match="qwen2|llama"):
        KB.check_plain_kv4(_vllm_config(LlamaConfig(attention_bias=True)), "int4_per_token_head")
    monkeypatch.setenv(KB.ENV_PLAIN_KV4, "1")
    KB.check_plain_kv4(_vllm_config(qwen), "int4_per_token_head")  # the user's call
    monkeypatch.setenv(KB.ENV_PLAIN_KV4, "yes")
    with pytest.raises(ValueError, match="MIXPREC_KV4_PLAIN_K_BIAS='yes': expected 0"):
        KB.check_plain_kv4(_vllm_config(qwen), "int4_per_token_head")
