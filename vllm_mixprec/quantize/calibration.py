"""Calibration: token batches, per-layer execution, and statistics of every linear input.

The quantizer walks the decoder layers one at a time (GPTQ style): the hidden states of
the calibration tokens go through layer i, hooks record what each linear sees, the layer
is quantized, and the *quantized* layer produces the inputs of layer i+1, so later layers
are calibrated on the error they will really receive.
"""
from __future__ import annotations

import dataclasses

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")

# Linear layers of one decoder layer, grouped by the input they share. `prev` is where a
# SmoothQuant scale of that input folds into ("norm" for an RMSNorm, else a linear's rows).
LINEAR_GROUPS = {
    "qkv": dict(linears=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                prev="input_layernorm"),
    "o": dict(linears=("self_attn.o_proj",), prev="self_attn.v_proj"),
    "gate_up": dict(linears=("mlp.gate_proj", "mlp.up_proj"), prev="post_attention_layernorm"),
    "down": dict(linears=("mlp.down_proj",), prev="mlp.up_proj"),
}
LINEAR_NAMES = tuple(n for g in LINEAR_GROUPS.values() for n in g["linears"])


class UnsupportedModelError(ValueError):
    pass


def check_architecture_names(archs) -> None:
    archs = list(archs or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(
            f"architecture {archs or '(none in config.json)'} is not supported; "
            f"vllm-mixprec quantize supports {list(SUPPORTED_ARCHITECTURES)}")


def check_architecture(config) -> None:
    check_architecture_names(getattr(config, "architectures", None))
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % kv:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def calibration_batches(tokenizer, text: str, n_samples: int, seqlen: int) -> torch.Tensor:
    """Consecutive, non-overlapping seqlen-token chunks of text: LongTensor [n, seqlen]."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = min(n_samples, ids.numel() // seqlen)
    if n == 0:
        raise ValueError(f"calibration text has {ids.numel()} tokens, fewer than one {seqlen}-token sample")
    return ids[: n * seqlen].view(n, seqlen)


def decoder_kwargs(model, seqlen: int) -> dict:
    """What a decoder layer needs besides hidden states (causal via SDPA with no mask)."""
    pos = torch.arange(seqlen)[None]
    dummy = torch.zeros(1, seqlen, model.config.hidden_size)
    return dict(attention_mask=None, position_ids=pos,
                position_embeddings=model.model.rotary_emb(dummy, position_ids=pos))


@torch.no_grad()
def run_layer(layer, hidden: torch.Tensor, kwargs: dict, batch_size: int = 4) -> torch.Tensor:
    out = torch.empty_like(hidden)
    for i in range(0, hidden.shape[0], batch_size):
        y = layer(hidden[i:i + batch_size], **kwargs)
        out[i:i + batch_size] = y[0] if isinstance(y, tuple) else y
    return out


@dataclasses.dataclass
class LinearStats:
    """What the quantizer needs to know about one linear's input X [tokens, K]."""

    absmax: torch.Tensor  # [K] float64, max |X| per channel
    hessian: torch.Tensor | None  # [K, K] float64, sum of x x^T (GPTQ), or None
    rows: int
    sample: torch.Tensor  # [S, K] float32, a fixed random subset of rows (grid searches)

    def scaled(self, s: torch.Tensor) -> "LinearStats":
        """Statistics of X / s (a SmoothQuant scale folded in front of this linear)."""
        s64 = s.to(torch.float64)
        h = None if self.hessian is None else self.hessian / (s64[:, None] * s64[None, :])
        return LinearStats(self.absmax / s64, h, self.rows, (self.sample / s.float()))


@torch.no_grad()
def collect_stats(layer, hidden: torch.Tensor, kwargs: dict, *, hessian: bool, sample_rows: int,
                  batch_size: int = 4, seed: int = 0) -> tuple[dict[str, LinearStats], dict, torch.Tensor]:
    """Run the float layer on hidden [n, T, d] with hooks on every linear.

    Returns (stats per linear name, k_proj output stats {"max", "min", "mean"} [Hkv*D], layer output).
    Linears that share an input (q/k/v, gate/up) get one shared LinearStats object.
    """
    n, t, _ = hidden.shape
    gen = torch.Generator().manual_seed(seed)
    keep = torch.randperm(n * t, generator=gen)[:sample_rows].sort().values  # rows for the sample
    acc: dict[str, dict] = {}
    k_stats = {"max": None, "min": None, "sum": 0.0, "rows": 0}
    offset = [0]

    def pre_hook(name):
        def hook(mod, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            a = acc.setdefault(name, dict(absmax=None, h=None, rows=0, sample=[]))
            am = x.abs().amax(0).double()
            a["absmax"] = am if a["absmax"] is None else torch.maximum(a["absmax"], am)
            if hessian:  # fp32 GEMM per batch (the cost), float64 running sum
                xtx = (x.T @ x).double()
                a["h"] = xtx if a["h"] is None else a["h"].add_(xtx)
            lo = offset[0]
            sel = keep[(keep >= lo) & (keep < lo + x.shape[0])] - lo
            a["sample"].append(x[sel].clone())
            a["rows"] += x.shape[0]
        return hook

    def k_hook(mod, args, out):
        o = out.reshape(-1, out.shape[-1]).double()
        mx, mn = o.amax(0), o.amin(0)
        k_stats["max"] = mx if k_stats["max"] is None else torch.maximum(k_stats["max"], mx)
        k_stats["min"] = mn if k_stats["min"] is None else torch.minimum(k_stats["min"], mn)
        k_stats["sum"] = k_stats["sum"] + o.sum(0)
        k_stats["rows"] += o.shape[0]

    # one hook per distinct input: the first linear of each group
    handles = [layer.get_submodule(g["linears"][0]).register_forward_pre_hook(pre_hook(key))
               for key, g in LINEAR_GROUPS.items()]
    handles.append(layer.get_submodule("self_attn.k_proj").register_forward_hook(k_hook))
    out = torch.empty_like(hidden)
    try:
        for i in range(0, n, batch_size):
            offset[0] = i * t
            y = layer(hidden[i:i + batch_size], **kwargs)
            out[i:i + batch_size] = y[0] if isinstance(y, tuple) else y
    finally:
        for h in handles:
            h.remove()
    stats = {}
    for key, g in LINEAR_GROUPS.items():
        a = acc[key]
        st = LinearStats(a["absmax"], a["h"], a["rows"], torch.cat(a["sample"]))
        for name in g["linears"]:
            stats[name] = st
    k = {"max": k_stats["max"], "min": k_stats["min"], "mean": k_stats["sum"] / k_stats["rows"]}
    return stats, k, out
