"""Bias-aware K quantization: hands k_proj's bias and the model's RoPE to the KV backend.

A model whose k projection has a bias (Qwen2: q/k/v biases) can have K channels that are
nearly constant and huge (Qwen2.5-Coder-1.5B layer 0: a rotary pair of norm 456, against a
K std of 2.3), which wrecks per-(token, head) KV4/KV8 codes. The backend then stores
K - RoPE_p(b) and adds q . RoPE_p(b) back when attending (formats.KRopeBias,
docs/ATTENTION.md). It needs no checkpoint change: b is k_proj's bias, already loaded.

How b reaches the Attention layer (vLLM 0.26, --quantization mixprec):
  * vLLM's loader calls process_weights_after_loading on every module in named_modules()
    order (model_loader/utils.py), so a layer's `self_attn.qkv_proj` (registered before
    `self_attn.attn` by every vLLM model that has both) is processed before its Attention;
  * the linear methods (ours, and the unquantized one of ignored layers) call
    record_qkv_bias: this rank's K slice [q_size : q_size + kv_size] of the (TP-sharded)
    bias, keyed by the parent prefix "model.layers.N.self_attn";
  * MixPrecKVCacheMethod.process_weights_after_loading calls attach, which takes that bias,
    checks the model's RoPE (hf_config) and sets `layer.k_rope_bias` (a formats.KRopeBias)
    when KV is quantized; the backend reads it like `layer.k_smooth`.

Without --quantization mixprec nothing hands the bias over, and KV4 of such a model is refused
at start-up (check_plain_kv4; MIXPREC_KV4_PLAIN_K_BIAS=1 serves it anyway). KV8 is served: it
costs Qwen2.5-Coder-1.5B +2 % perplexity without bias-aware K.

Knobs (environment):
  MIXPREC_KV_BIAS_AWARE  unset/"auto": on for the layers whose k bias has a rotary pair of
                         norm >= MIXPREC_KV_BIAS_MIN, for known neox-RoPE architectures;
                         "0": off; "1": also for architectures not in NEOX_ARCHITECTURES.
  MIXPREC_KV_BIAS_MIN    that threshold (default 16; 0: every layer with a k bias).
  MIXPREC_KV_BIAS_PAIRS  rotary pairs per head kept (largest bias first; default 16, the
                         cheapest; "all" keeps every pair). Qwen2.5's 17th largest pair has
                         norm <= 4.3 in every layer, the same order as K's own spread.
"""
from __future__ import annotations

import logging
import os

import torch
from vllm.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod

from .. import envs
from .. import formats as F

logger = logging.getLogger("vllm.mixprec")

ENV = "MIXPREC_KV_BIAS_AWARE"
ENV_MIN = "MIXPREC_KV_BIAS_MIN"
ENV_PAIRS = "MIXPREC_KV_BIAS_PAIRS"
ENV_PLAIN_KV4 = "MIXPREC_KV4_PLAIN_K_BIAS"  # 1: KV4 with the k bias quantized in (check_plain_kv4)
# model types whose k projection always has a bias (others say so in attention_bias / qkv_bias)
K_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe"})
DEFAULT_MIN_NORM = float(envs.BY_NAME[ENV_MIN].default)
DEFAULT_PAIRS = int(envs.BY_NAME[ENV_PAIRS].default)
# vLLM models known to build full-head neox-style (rotate-half) RoPE with get_rope's defaults.
NEOX_ARCHITECTURES = frozenset({
    "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
    "LlamaForCausalLM", "MistralForCausalLM"})

# parent prefix ("model.layers.N.self_attn") -> this rank's k bias [H_kv, D] float32, or None
# for a QKV layer without bias. Filled by record_qkv_bias, emptied by attach.
_qkv_k_bias: dict[str, torch.Tensor | None] = {}
_logged = False


def _parent(prefix: str) -> str:
    return prefix.rsplit(".", 1)[0] if "." in prefix else ""


def record_qkv_bias(layer: torch.nn.Module, prefix: str) -> None:
    """Remember the K part of a merged QKV layer's bias (this TP rank's kv heads)."""
    if not isinstance(layer, QKVParallelLinear):
        return
    bias = getattr(layer, "bias", None)
    if bias is None:
        _qkv_k_bias[_parent(prefix)] = None  # overwrite a stale entry of an earlier model
        return
    q_size = layer.num_heads * layer.head_size
    kv_size = layer.num_kv_heads * layer.head_size
    k = bias.detach()[q_size:q_size + kv_size].to(torch.float32)
    _qkv_k_bias[_parent(prefix)] = k.reshape(layer.num_kv_heads, layer.head_size).clone()


class RecordingUnquantizedLinearMethod(UnquantizedLinearMethod):
    """vLLM's 16-bit linear method (layers in ignored_layers) that also records a QKV layer's
    k bias."""

    def __init__(self, prefix: str = ""):
        super().__init__()
        self.prefix = prefix

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        record_qkv_bias(layer, self.prefix)


def mode(environ=os.environ) -> str:
    """'auto', 'off' or 'force' from MIXPREC_KV_BIAS_AWARE."""
    raw = envs.get(ENV, environ)
    v = raw.lower()
    if v == "auto":
        return "auto"
    if v in ("0", "false", "off", "no"):
        return "off"
    if v in ("1", "true", "on", "yes"):
        return "force"
    raise ValueError(f"{ENV}={raw!r}: expected 0 (off), 1 (on) or auto")


def min_norm(environ=os.environ) -> float:
    """The smallest largest-pair norm that turns bias-aware K on (MIXPREC_KV_BIAS_MIN)."""
    v = envs.get(ENV_MIN, environ)
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not x >= 0:
        raise ValueError(f"{ENV_MIN}={v!r}: expected a number >= 0 (the smallest k-bias pair "
                         f"norm that turns bias-aware K on; default {DEFAULT_MIN_NORM:g})")
    return x


def num_pairs(head_dim: int, environ=os.environ) -> int | None:
    """Pairs per head (None: all) from MIXPREC_KV_BIAS_PAIRS."""
    v = envs.get(ENV_PAIRS, environ).lower()
    if v == "all" or (v.isdigit() and int(v) >= head_dim // 2):
        return None
    n = int(v) if v.isdigit() else -1
    if n < F.MIN_BIAS_PAIRS or n & (n - 1):
        raise ValueError(f"{ENV_PAIRS}={v!r}: expected a power of two >= {F.MIN_BIAS_PAIRS} "
                         f"or 'all' (default {DEFAULT_PAIRS})")
    return n


def model_has_k_bias(hf_config) -> bool:
    """Whether the model's k projection has a bias, from its config alone (Qwen2 always has one;
    Llama-style configs say attention_bias, some others qkv_bias)."""
    return (getattr(hf_config, "model_type", None) in K_BIAS_MODEL_TYPES
            or bool(getattr(hf_config, "attention_bias", False))
            or bool(getattr(hf_config, "qkv_bias", False)))


def check_plain_kv4(vllm_config, kv_cache_dtype: str, environ=os.environ) -> None:
    """Refuse KV4 pages for a model whose k projection has a bias when bias-aware K cannot apply:
    it needs the bias, which only the mixprec linear methods hand over (attach), so without
    --quantization mixprec K would be quantized to 4 bits with the bias in it. ENV_PLAIN_KV4=1
    serves it anyway."""
    if vllm_config is None or F.KV_SCHEME_OF_CARRIER.get(kv_cache_dtype) != "kv4":
        return
    quant = getattr(vllm_config, "quant_config", None)
    if quant is not None and quant.get_name() == "mixprec":
        return
    mc = getattr(vllm_config, "model_config", None)
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    if hf is None or not model_has_k_bias(hf):
        return
    v = envs.get(ENV_PLAIN_KV4, environ)
    if v not in ("0", "1"):
        raise ValueError(f"{ENV_PLAIN_KV4}={v!r}: expected 0 (the default: refuse) or 1")
    if v == "1":
        return
    raise ValueError(
        f"--kv-cache-dtype {kv_cache_dtype} without --quantization mixprec on a "
        f"{getattr(hf, 'model_type', '?')} model, whose k projection has a bias: K would be "
        "quantized to 4 bits with the bias in it, which wrecks such models (Qwen2.5-Coder-1.5B: "
        "perplexity 256587 with every key from KV4 pages, 19.9 in 16 bits; docs/BENCHMARKS.md). "
        "Bias-aware K needs a mixprec checkpoint (vllm-mixprec quantize MODEL OUT --kv kv4); or "
        f"use --kv-cache-dtype {F.KV_CARRIER_DTYPE['kv8']}; or set {ENV_PLAIN_KV4}=1 to serve it "
        "anyway")


def largest_pair_norm(k_bias: torch.Tensor) -> float:
    """The largest rotary-pair norm |(b_i, b_{i+D/2})| of a k bias [H_kv, D]."""
    half = k_bias.shape[1] // 2
    return float((k_bias[:, :half].square() + k_bias[:, half:].square()).sqrt().max())


def rope_inv_freq(hf_config, head_dim: int, architectures=(), forced: bool = False
                  ) -> torch.Tensor:
    """The inverse frequencies [head_dim/2] of vLLM's default RotaryEmbedding for this model,
    or ValueError naming the config field that asks for a RoPE bias-aware K does not model."""
    off = f"set {ENV}=0 to quantize K without the bias"
    rp = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not rp:  # configs vLLM did not standardize
        rp = dict(getattr(hf_config, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    bad = []
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind not in (None, "default"):
        bad.append(f"rope_parameters.rope_type={kind!r} (only the default, unscaled RoPE: "
                   "scaled variants change the frequencies or multiply cos/sin by an mscale)")
    for key in ("mrope_section", "use_fope"):
        if rp.get(key):
            bad.append(f"rope_parameters.{key}={rp[key]!r}")
    factor = rp.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        bad.append(f"partial_rotary_factor={factor!r} (partial rotary)")
    dim = rp.get("rope_dim")
    if dim not in (None, head_dim):
        bad.append(f"rope_parameters.rope_dim={dim!r} (partial rotary; head_dim={head_dim})")
    if getattr(hf_config, "dual_chunk_attention_config", None):
        bad.append("dual_chunk_attention_config (dual-chunk RoPE)")
    archs = [a for a in (architectures or []) if a]
    if not forced and not any(a in NEOX_ARCHITECTURES for a in archs):
        bad.append(f"architectures={archs!r} is not known to use full-head neox-style "
                   f"(rotate-half) RoPE (known: {sorted(NEOX_ARCHITECTURES)}; set {ENV}=1 "
                   "if it does)")
    if bad:
        raise ValueError("bias-aware K quantization (the k projection has a bias and KV is "
                         "quantized) supports the default neox-style RoPE over the whole "
                         f"head only; this model has {'; '.join(bad)}. {off}")
    base = float(rp.get("rope_theta", 10000.0))
    # vLLM's RotaryEmbeddingBase._compute_inv_freq, bit for bit
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def attach(layer: torch.nn.Module, prefix: str, model_config) -> None:
    """Set layer.k_rope_bias (formats.KRopeBias) if this Attention layer's K should be
    quantized bias-aware: KV quantized by the mixprec backend, k_proj with a large bias."""
    global _logged
    k_bias = _qkv_k_bias.pop(_parent(prefix), None)
    m = mode()
    backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: None)()
    if k_bias is None or m == "off" or backend != "CUSTOM" or \
            F.KV_SCHEME_OF_CARRIER.get(getattr(layer, "kv_cache_dtype", None)) is None:
        return
    norm = largest_pair_norm(k_bias)
    threshold = min_norm()
    if norm < threshold:
        logger.debug("%s: k bias pair norm %.1f < %s=%g: K quantized as is", prefix, norm,
                     ENV_MIN, threshold)
        return
    heads = getattr(layer, "num_kv_heads", k_bias.shape[0])
    if tuple(k_bias.shape) != (heads, layer.head_size):
        raise ValueError(f"{prefix}: the qkv_proj k bias has shape {tuple(k_bias.shape)}, the "
                         f"attention layer ({heads}, {layer.head_size}) kv heads x head_dim")
    if model_config is None:
        raise ValueError(f"{prefix}: bias-aware K quantization needs the model config (RoPE "
                         f"parameters), and none is set; set {ENV}=0 to quantize K without it")
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    archs = getattr(model_config, "architectures", None) or \
        getattr(model_config.hf_config, "architectures", None) or []
    inv_freq = rope_inv_freq(hf, layer.head_size, archs, forced=m == "force")
    pairs = num_pairs(layer.head_size)
    layer.k_rope_bias = F.make_k_rope_bias(k_bias, inv_freq, pairs)
    if not _logged:
        _logged = True
        logger.info("mixprec: the k projection has a bias and KV is quantized: bias-aware K "
                    "quantization (K - RoPE_p(b) stored, q.RoPE_p(b) added back) on the layers "
                    "whose largest k-bias pair norm is >= %g (%s), %s rotary pairs per head "
                    "(%s); %s=0 turns it off", threshold, ENV_MIN, pairs or "all", ENV_PAIRS,
                    ENV)
    logger.debug("%s: bias-aware K, largest k-bias pair norm %.1f", prefix, norm)
