"""Perplexity of a checkpoint folder over the first N tokens of a text, in fixed windows.

Two paths:
  * `cpu`:  a transformers model in float32 in which every quantized linear is a
            quantize.modules.MixPrecLinear (reference.py, bit-exact to the format) or, for a
            GPTQ checkpoint, a dense linear with the dequantized weights; K/V are
            fake-quantized per (token, head) with reference.quantize_kv/dequantize_kv after
            RoPE when a KV scheme is evaluated (what the paged cache stores), from K/V rounded
            to the dtype vLLM serves the model in (kv_dtype "served"), as the cache receives them;
  * `vllm`: vLLM prompt logprobs on a GPU (KV schemes through the CUSTOM backend).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .. import formats as F
from .. import reference as ref


def fake_quant_kv(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x [B, H, T, D] -> quantize_kv/dequantize_kv per (token, head), same shape and dtype."""
    b, h, t, d = x.shape
    flat = x.permute(0, 2, 1, 3).reshape(b * t, h, d)
    codes, scale, zero = ref.quantize_kv(flat, scheme)
    deq = ref.dequantize_kv(codes, scale, zero, scheme)
    return deq.view(b, t, h, d).permute(0, 2, 1, 3).to(x.dtype)


def residual_attention(query, key, value, key_q, value_q, scaling: float, residual: int,
                       chunk: int = 0) -> torch.Tensor:
    """Causal attention where query t reads keys t-R+1..t in 16 bits and older ones quantized.

    This is what decoding with the backend's residual window (the newest R tokens kept in
    16 bits) computes for every position; [B, H, T, D] inputs, GQA by repeat. With chunk
    C > 0, query t also reads every key of its own C-token chunk in 16 bits: a prompt
    prefilled in chunks of C with exact prefill (the backend's default).
    """
    rep = query.shape[1] // key.shape[1]
    k, v, kq, vq = (t.repeat_interleave(rep, dim=1).float() for t in (key, value, key_q, value_q))
    q = query.float() * scaling
    t = query.shape[2]
    pos = torch.arange(t)
    dist = pos[:, None] - pos[None, :]  # query i, key j: i - j
    recent = (dist >= 0) & (dist < residual)
    if chunk > 0:
        recent |= (dist >= 0) & (pos[:, None] // chunk == pos[None, :] // chunk)
    s = torch.where(recent, q @ k.transpose(-1, -2), q @ kq.transpose(-1, -2))
    s = s.masked_fill(dist < 0, float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.where(recent, p, 0) @ v + torch.where(recent, 0, p) @ vq
    return out.transpose(1, 2).to(query.dtype)


def rotated_k_bias(bias: torch.Tensor, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE_p(b) for every position: k_proj's bias [Hkv * D] rotated by cos/sin [T, D]
    (rotate-half convention) -> [1, Hkv, T, D] float32."""
    b = bias.float().view(-1, 1, head_dim)
    half = head_dim // 2
    rot = torch.cat([-b[..., half:], b[..., :half]], dim=-1)
    return (b * cos.float()[None] + rot * sin.float()[None])[None]


def served_k_bias(bias: torch.Tensor | None, head_dim: int) -> torch.Tensor | None:
    """The part of k_proj's bias that the backend quantizes around (quant_methods/k_bias.py,
    under the same MIXPREC_KV_BIAS_MIN / MIXPREC_KV_BIAS_PAIRS settings): None on a layer
    whose largest bias pair is below the threshold, else the bias with only the kept
    rotary pairs (the others stay in K)."""
    from ..quant_methods import k_bias as KB

    if bias is None:
        return None
    b = bias.detach().float().reshape(-1, head_dim)
    if KB.largest_pair_norm(b) < KB.min_norm():
        return None
    return F.make_k_rope_bias(b, torch.ones(head_dim // 2), KB.num_pairs(head_dim)).bias.reshape(-1)


KV_DTYPES = ("served", "float32")


def served_dtype(config: dict) -> torch.dtype:
    """The dtype vLLM's dtype="auto" serves a checkpoint in: float16 stays float16, anything
    else (bfloat16, float32) is bfloat16 on the GPUs this targets."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return torch.float16 if name in ("float16", "half") else torch.bfloat16


def register_kv_attention(scheme: str, residual: int = 0, skip_layers: tuple[int, ...] = (),
                          rotary=None, chunk: int = 0, kv_dtype: torch.dtype | None = None) -> str:
    """An attention implementation that fake-quantizes K and V, then runs SDPA
    (or, with residual > 0, keeps each query's newest `residual` keys in 16 bits).
    Layers in skip_layers keep their whole K and V in 16 bits (a per-layer KV precision
    experiment: the backend has no such option yet). With `rotary` (the model's rotary
    embedding), K is quantized bias-aware: K - RoPE_p(b), b = k_proj's bias, and RoPE_p(b) is
    added back exactly after dequantization, as the backend's kernels add q.RoPE_p(b);
    positions are 0..T-1 of each window. chunk > 0: residual_attention's exact-prefill chunks.
    kv_dtype: the K and V that get quantized are rounded to it first (the served model hands
    the cache bf16/fp16 K/V; Qwen's KV8 ppl moves by 1.3 % between float32 and bf16 inputs).
    Keys read in 16 bits (residual, chunk) stay float32, as in the kv-none run the deltas are
    taken against. None: quantize the float32 K/V as they are."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    skip = frozenset(skip_layers)
    name = (f"mixprec_{scheme}_r{residual}_c{chunk}_skip{'-'.join(map(str, sorted(skip)))}"
            f"{'_biasaware' if rotary is not None else ''}_{str(kv_dtype).replace('torch.', '')}")

    def quant_k(module, key):
        bias = served_k_bias(getattr(getattr(module, "k_proj", None), "bias", None), key.shape[-1])
        if rotary is None or bias is None:
            return fake_quant_kv(key, scheme)
        cos, sin = rotary(key, torch.arange(key.shape[2])[None])
        rb = rotated_k_bias(bias, key.shape[-1], cos[0], sin[0])
        return (fake_quant_kv((key.float() - rb).to(key.dtype), scheme).float() + rb).to(key.dtype)

    def attention(module, query, key, value, attention_mask, **kwargs):
        if getattr(module, "layer_idx", None) in skip:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        kc, vc = key, value
        if kv_dtype is not None:  # what the cache receives; 16-bit reads stay as the kv-none run has them
            kc, vc = key.to(kv_dtype).to(key.dtype), value.to(kv_dtype).to(value.dtype)
        kq, vq = quant_k(module, kc), fake_quant_kv(vc, scheme)
        if residual <= 0 and chunk <= 0:
            return sdpa_attention_forward(module, query, kq, vq, attention_mask, **kwargs)
        if attention_mask is not None:
            raise ValueError("the residual-window and chunk evaluations support unpadded causal "
                             "windows only")
        return residual_attention(query, key, value, kq, vq, kwargs["scaling"], residual,
                                  chunk), None

    AttentionInterface.register(name, attention)
    return name


def set_kv_scheme(model, scheme: str, residual: int = 0, skip_layers: tuple[int, ...] = (),
                  bias_aware: bool = False, chunk: int = 0, kv_dtype: torch.dtype | None = None) -> None:
    if scheme not in F.KV_SCHEMES:
        raise ValueError(f"kv scheme {scheme!r} is not one of {F.KV_SCHEMES}")
    n_layers = model.config.num_hidden_layers
    bad = [i for i in skip_layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"kv skip layers {bad} are not layers of this model (0..{n_layers - 1})")
    rotary = model.model.rotary_emb if bias_aware else None
    model.config._attn_implementation = ("sdpa" if scheme == "none"
                                         else register_kv_attention(scheme, residual, tuple(skip_layers), rotary,
                                                                    chunk, kv_dtype))


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json (not a model folder)")
    return json.loads(path.read_text())


def _load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_model_cpu(folder: str | Path):
    """float32 CPU model of a bf16, mixprec or GPTQ checkpoint folder; returns (model, kind)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..quantize.gptq import dequantize_gptq
    from ..quantize.modules import MixPrecLinear, dense_linear, replace_module

    folder = Path(folder)
    qc = read_config(folder).get("quantization_config")
    if qc is None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        return model.eval().requires_grad_(False), "bf16"
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("mixprec", "gptq"):
        raise ValueError(f"{folder}: quant_method {method!r} is not mixprec or gptq")
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # else transformers would try to quantize on its own
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    tensors = _load_tensors(folder)
    marker = ".qweight"
    for prefix in sorted(k[: -len(marker)] for k in tensors if k.endswith(marker)):
        own = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
        bias = own.pop("bias", None)
        if method == "gptq":
            new = dense_linear(dequantize_gptq(own), bias)
        else:
            new = MixPrecLinear(own, bias, qc["weight_scheme"], qc.get("act_rotation", "none"))
        replace_module(model, prefix, new)
        for k in list(tensors):
            if k.startswith(prefix + "."):
                del tensors[k]
    for name, t in tensors.items():
        mod_name, _, pname = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        mod._parameters[pname] = torch.nn.Parameter(t.float(), requires_grad=False)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"{folder}: checkpoint has no tensor for {meta[:5]}")
    return model.eval().requires_grad_(False), method


def tokenize(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def windows(ids: torch.Tensor, n_tokens: int, window: int) -> list[torch.Tensor]:
    """Non-overlapping windows over the first n_tokens (the last one may be shorter)."""
    ids = ids[:n_tokens]
    return [ids[i:i + window] for i in range(0, ids.numel(), window) if ids[i:i + window].numel() > 1]


@torch.no_grad()
def perplexity_cpu(model, ids: torch.Tensor, n_tokens: int = 4096, window: int = 1024,
                   progress: bool = False) -> dict:
    from tqdm import tqdm

    nll, count = 0.0, 0
    for w in tqdm(windows(ids, n_tokens, window), desc="windows", disable=not progress):
        logits = model(w[None]).logits[0].double()
        nll += float(torch.nn.functional.cross_entropy(logits[:-1], w[1:], reduction="sum"))
        count += w.numel() - 1
    return {"ppl": math.exp(nll / count), "nll": nll, "tokens": count}


def perplexity_vllm(folder: str | Path, ids: torch.Tensor, n_tokens: int = 4096, window: int = 1024,
                    kv_scheme: str = "none", **llm_kwargs) -> dict:
    """The same numbers from vLLM (GPU): prompt logprobs of each window."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=str(folder), max_model_len=window + 16, enforce_eager=True, seed=0)
    if kv_scheme != "none":
        kwargs.update(kv_cache_dtype=F.KV_CARRIER_DTYPE[kv_scheme], attention_backend="CUSTOM")
    kwargs.update(llm_kwargs)
    llm = LLM(**kwargs)
    ws = windows(ids, n_tokens, window)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w.tolist()) for w in ws],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    nll, count = 0.0, 0
    for w, o in zip(ws, outs):
        for tok, lp in zip(w[1:].tolist(), o.prompt_logprobs[1:]):
            nll -= lp[tok].logprob
            count += 1
    return {"ppl": math.exp(nll / count), "nll": nll, "tokens": count}


def evaluate(folder: str | Path, texts: list[str], n_tokens: int = 4096, window: int = 1024,
             kv_scheme: str | None = None, backend: str = "cpu", progress: bool = False,
             tokenizer_dir: str | Path | None = None, kv_residual: int = 0,
             kv_skip_layers: tuple[int, ...] = (), kv_bias_aware: bool = False,
             kv_chunk: int = 0, kv_dtype: str = "served") -> dict[str, dict]:
    """Perplexity of a folder on each text; kv_scheme None = the checkpoint's own.

    kv_residual R > 0 (cpu only): every position reads its newest R keys in 16 bits, as
    decoding with the attention backend's residual window does; 0: all keys quantized, as
    a prefill does (the backend's pages). kv_skip_layers (cpu only): layers whose K and V
    stay in 16 bits. kv_bias_aware (cpu only): K quantized as K - RoPE_p(k_proj.bias), the
    rotated bias added back after dequantization. kv_chunk C > 0 (cpu only): each window is
    a prompt prefilled in chunks of C tokens with exact prefill (the backend's default): a
    position reads its own chunk's keys in 16 bits, older ones quantized. kv_dtype (cpu
    only): "served" rounds K/V to the dtype vLLM serves the folder in before quantizing them
    (what the cache receives; served_dtype), "float32" quantizes the float32 model's K/V.
    """
    from transformers import AutoTokenizer

    from ..quantize.models import load_text

    folder = Path(folder)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {KV_DTYPES}")
    config = read_config(folder)
    qc = config.get("quantization_config") or {}
    kv = kv_scheme or qc.get("kv_scheme", "none")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir or folder)
    ids = {t: tokenize(tok, load_text(t)) for t in texts}
    if backend == "vllm":
        if kv_residual or kv_skip_layers or kv_bias_aware or kv_chunk or kv_dtype != "served":
            raise ValueError("kv_residual, kv_skip_layers, kv_bias_aware, kv_chunk and kv_dtype='float32' are "
                             "CPU-path options (backend='cpu')")
        return {t: perplexity_vllm(folder, ids[t], n_tokens, window, kv) for t in texts}
    if backend != "cpu":
        raise ValueError(f"backend {backend!r} is not 'cpu' or 'vllm'")
    model, _ = load_model_cpu(folder)
    if kv_chunk < 0 or kv_residual < 0:
        raise ValueError(f"kv_chunk={kv_chunk} and kv_residual={kv_residual} must be >= 0")
    set_kv_scheme(model, kv, kv_residual, tuple(kv_skip_layers), kv_bias_aware, kv_chunk,
                  served_dtype(config) if kv_dtype == "served" else None)
    return {t: perplexity_cpu(model, ids[t], n_tokens, window, progress) for t in texts}
