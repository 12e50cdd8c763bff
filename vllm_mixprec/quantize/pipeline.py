"""quantize_model: HF folder in, quantized checkpoint folder out (what `vllm-mixprec quantize` runs).

Layer by layer (see calibration.py): collect input statistics of the float layer, fold
SmoothAttention and smoothing (float-invariant), quantize every linear, export its
tensors, then run the quantized layer to produce the next layer's inputs.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from .. import formats as F
from .. import reference as ref
from . import calibration as C
from . import fmpq, gptq, lqq
from . import smoothing as S
from .export import write_checkpoint
from .models import load_text
from .modules import MixPrecLinear, dense_linear, replace_module
from .smooth_attention import center_k_bias, fold_smooth_attention, smooth_attention_scales

SCHEMES = ("w4a8", "w4ax", "gptq-w4a16", "none")


class SourceError(ValueError):
    """The source model folder cannot be quantized; the message names the file or tensor and
    says how to fix it. `vllm-mixprec quantize` exits with status 2 on it."""


def _not_regular(path: Path) -> SourceError:
    return SourceError(f"{path} is not a regular file (a FIFO, device or folder would block or "
                       "fail the read); replace it with the real file from the original model")


def _read_json(path: Path) -> dict:
    try:
        if not path.is_file():  # reading a FIFO would hang
            raise _not_regular(path)
        text = path.read_text()
    except PermissionError as e:
        raise SourceError(f"{path}: permission denied; make it readable (chmod a+r {path}) or run "
                          "as its owner") from e
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: cannot be read ({type(e).__name__}: {e}); restore the file "
                          "from the original model") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SourceError(f"{path} is not valid JSON ({e}); the file is truncated or corrupt: "
                          "restore it from the original model") from e
    if not isinstance(data, dict):
        raise SourceError(f"{path} holds a JSON {type(data).__name__}, not an object; restore it "
                          "from the original model")
    return data


def check_source(model_dir: str | Path) -> None:
    """Cheap checks of a source folder before any work: readable JSON files, every shard the
    index names present, and safetensors headers that parse and cover their files."""
    from safetensors import safe_open

    d = Path(model_dir)
    _read_json(d / "config.json")
    index = d / "model.safetensors.index.json"
    if index.exists():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise SourceError(f"{index} has no weight_map; restore it from the original model")
        gone = sorted({f for f in wm.values() if not (d / f).is_file()})
        if gone:
            raise SourceError(f"{index} names shard(s) {gone} that are missing from {d}; "
                              "download the missing files again")
    files = sorted(d.glob("*.safetensors"))
    if not files and not any(d.glob("*.bin")):
        raise SourceError(f"{d} has no *.safetensors (or *.bin) weights; is the download complete?")
    for f in files:
        if not f.is_file():
            raise _not_regular(f)
        try:
            open(f, "rb").close()
        except PermissionError as e:
            raise SourceError(f"{f}: permission denied; make it readable (chmod a+r {f}) or run "
                              "as its owner") from e
        try:
            with safe_open(str(f), "pt") as h:
                h.keys()
        except Exception as e:  # noqa: BLE001 - SafetensorError has no importable base here
            raise SourceError(f"{f} is not a readable safetensors file ({e}); it is truncated or "
                              "corrupt: download or convert the model again") from e


def check_finite(tensors, what: str, fix: str = "repair or re-download the source model") -> None:
    """Refuse NaN/Inf in floating tensors, naming the first tensor that has them."""
    for name, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = ~torch.isfinite(t)
            raise SourceError(
                f"{name}: {int(bad.sum())} of {t.numel()} values are NaN or Inf "
                f"({int(torch.isnan(t).sum())} NaN) in {what}; the quantizer refuses non-finite "
                f"weights: {fix}")


# GPTQ calibration tokens per input channel below which quantize_model warns (see
# QuantOptions.gptq_calibration_warning): 4,096 tokens overfit at K = 1,536 and 8,960 on Qwen,
# 16,384 (10.7 per channel) did not at K = 1,536
GPTQ_TOKENS_PER_INPUT = 8
# W4Ax calibration tokens below which quantize_model warns (QuantOptions.w4ax_calibration_warning):
# the default recipe met 1.25x W4A8's dppl on Qwen2.5-1.5B with 32 and 64 x 512 tokens and missed
# it on botchan with 8 and 16 x 512 (docs/BENCHMARKS.md, session 45)
W4AX_MIN_CALIB_TOKENS = 32 * 512


@dataclasses.dataclass
class QuantOptions:
    weight_scheme: str = "w4a8"  # w4a8 | w4ax | gptq-w4a16 (standard GPTQ checkpoint) | none
    group_size: int = 64
    kv_scheme: str = "none"  # recorded in quantization_config (mixprec schemes only)
    smooth: bool = False  # SmoothQuant scales with a per-layer alpha search
    smooth_attention: bool = False  # QServe SmoothAttention folded into q/k_proj
    smooth_attention_alpha: float = 0.5  # λ = max|K|^alpha (QServe: 0.5)
    k_centering: bool = False  # subtract K's mean in RoPE's slowest channels (needs a k bias)
    gptq: bool = False  # w4a8/w4ax: GPTQ on the LiquidQuant grid
    clip: bool = False  # w4a8/w4ax: per-channel clip ratio + per-group range search
    a8_fraction: float = 0.25  # w4ax
    # w4ax: "uniform", every linear keeps round(a8_fraction * K/128) blocks at 8 bits; "layer",
    # a decoder layer's 8-bit MACs under uniform go to the input groups where they save most error;
    # "layer-blocks", the same with its 8-bit blocks counted (the CLI's default for w4ax)
    a8_allocation: str = "uniform"
    a8_select: str = "blocks"  # w4ax: fmpq.A8_SELECTIONS, how the 8-bit blocks are chosen
    act_rotation: str = "none"  # w4ax: formats.ACT_ROTATIONS, on each 4-bit block (the CLI's default: hadamard64)
    calib_text: str = "alice29"
    calib_samples: int = 64
    calib_seqlen: int = 512
    sample_rows: int = 1024  # rows kept per linear input for the alpha search
    # next layer's inputs: "quantized" (run the quantized layer, GPTQ style, exact reference
    # GEMMs) or "float" (the float layer's output, free: already computed for the stats)
    propagate: str = "quantized"
    alpha_grid: tuple[float, ...] = S.ALPHA_GRID
    percdamp: float = 0.01
    batch_size: int = 4
    progress: bool = True

    def gptq_calibration_warning(self, config, n_tokens: int) -> str | None:
        """A warning when GPTQ gets fewer than GPTQ_TOKENS_PER_INPUT calibration tokens per input
        channel of the widest linear: its Hessian X^T X is then nearly singular and GPTQ fits the
        calibration text instead of the layer (session 27, scripts/diag_gptq_heldout.py)."""
        if not self.needs_hessian():
            return None
        widest = max(k for _, k in linear_shapes(config).values())
        need = GPTQ_TOKENS_PER_INPUT * widest
        if n_tokens >= need:
            return None
        return (f"GPTQ with {n_tokens} calibration tokens for linears of up to {widest} input channels "
                f"(fewer than {GPTQ_TOKENS_PER_INPUT} per channel): it overfits the calibration text. "
                "On Qwen2.5-Coder-1.5B with 4,096 tokens, layer 3's down_proj error on held-out text "
                "was 1.7x round-to-nearest's (docs/BENCHMARKS.md, session 27). Raise --calib-samples "
                f"to at least {-(-need // self.calib_seqlen)} (x {self.calib_seqlen} tokens), or leave "
                "GPTQ out")

    def w4ax_calibration_warning(self, n_tokens: int) -> str | None:
        """A warning when W4Ax gets fewer calibration tokens than it was measured to need."""
        if self.weight_scheme != "w4ax" or n_tokens >= W4AX_MIN_CALIB_TOKENS:
            return None
        return (f"W4Ax with {n_tokens} calibration tokens: on Qwen2.5-Coder-1.5B its 8-bit block "
                "allocation and smoothing met 1.25x W4A8's perplexity increase with 32 and 64 x 512 "
                "tokens, but missed it on botchan with 8 and 16 x 512 (1.35x and 1.59x; "
                "docs/BENCHMARKS.md, session 45). Raise --calib-samples to at least "
                f"{-(-W4AX_MIN_CALIB_TOKENS // self.calib_seqlen)} (x {self.calib_seqlen} tokens)")

    def needs_hessian(self) -> bool:
        return self.weight_scheme == "gptq-w4a16" or (self.gptq and self.weight_scheme in ("w4a8", "w4ax"))

    def validate(self) -> None:
        if self.weight_scheme not in SCHEMES:
            raise ValueError(f"weight scheme {self.weight_scheme!r} is not one of {SCHEMES}")
        if self.kv_scheme not in F.KV_SCHEMES:
            raise ValueError(f"kv scheme {self.kv_scheme!r} is not one of {F.KV_SCHEMES}")
        if self.weight_scheme in ("w4a8", "w4ax") and self.group_size not in F.SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group size {self.group_size} is not one of {F.SUPPORTED_GROUP_SIZES} "
                             "(the mixprec checkpoint format)")
        if self.weight_scheme == "gptq-w4a16" and self.group_size not in (32, 64, 128):
            raise ValueError(f"group size {self.group_size}: Marlin GPTQ supports 32, 64 or 128")
        if self.weight_scheme in ("gptq-w4a16", "none") and self.kv_scheme != "none":
            raise ValueError("a KV scheme is recorded in a mixprec quantization_config; with weight scheme "
                             f"{self.weight_scheme!r} evaluate KV quantization with `eval --kv` instead")
        if self.weight_scheme in ("gptq-w4a16", "none") and (self.gptq or self.clip or self.smooth):
            raise ValueError("--gptq/--clip/--smooth apply to the w4a8 and w4ax schemes")
        if self.propagate not in ("quantized", "float"):
            raise ValueError(f"propagate {self.propagate!r} is not 'quantized' or 'float'")
        if not 0.0 <= self.a8_fraction <= 1.0:
            raise ValueError(f"a8 fraction {self.a8_fraction} is not in [0, 1]")
        if self.a8_allocation not in fmpq.A8_ALLOCATIONS:
            raise ValueError(f"a8 allocation {self.a8_allocation!r} is not one of {fmpq.A8_ALLOCATIONS}")
        if self.act_rotation not in F.ACT_ROTATIONS:
            raise ValueError(f"act rotation {self.act_rotation!r} is not one of {F.ACT_ROTATIONS}")
        if self.a8_select not in fmpq.A8_SELECTIONS:
            raise ValueError(f"a8 selection {self.a8_select!r} is not one of {fmpq.A8_SELECTIONS}")
        if self.a8_allocation != QuantOptions.a8_allocation and self.weight_scheme != "w4ax":
            raise ValueError(f"--a8-allocation {self.a8_allocation} applies to the w4ax scheme only")
        if self.a8_select != QuantOptions.a8_select and self.weight_scheme != "w4ax":
            raise ValueError(f"--a8-select {self.a8_select} applies to the w4ax scheme only")
        if not (0 < self.percdamp < float("inf")):
            raise ValueError(f"--percdamp {self.percdamp}: GPTQ's dampening must be a positive finite "
                             "fraction of mean(diag H) (GPTQ's default: 0.01)")
        if self.act_rotation != "none" and self.weight_scheme != "w4ax":
            raise ValueError(f"--act-rotation {self.act_rotation} applies to the w4ax scheme only "
                             "(it rotates the 4-bit activation blocks)")


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of every linear of a decoder layer."""
    d, hd = config.hidden_size, C.head_dim(config)
    q, kv, inter = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    return {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
            "self_attn.o_proj": (d, q), "mlp.gate_proj": (inter, d), "mlp.up_proj": (inter, d),
            "mlp.down_proj": (d, inter)}


def check_shapes(config, opts: QuantOptions) -> None:
    """Clear errors for shapes the chosen format cannot hold (before any work is done)."""
    for name, (n, k) in linear_shapes(config).items():
        if opts.weight_scheme == "none":
            continue
        if k % opts.group_size:
            raise ValueError(f"{name}: in_features={k} is not divisible by group size {opts.group_size}; "
                             "pick a group size that divides every layer's input size")
        if opts.weight_scheme == "w4ax" and k % F.ACT_BLOCK:
            raise ValueError(f"{name}: in_features={k} is not a multiple of {F.ACT_BLOCK}, "
                             "which the W4Ax activation blocks need")
        if opts.weight_scheme == "gptq-w4a16" and n % gptq.GPTQ_PACK:
            raise ValueError(f"{name}: out_features={n} is not a multiple of {gptq.GPTQ_PACK} (GPTQ qzeros packing)")


def quantization_config(opts: QuantOptions) -> dict | None:
    if opts.weight_scheme == "none":
        return None
    if opts.weight_scheme == "gptq-w4a16":
        return gptq.gptq_quantize_config(opts.group_size, opts.percdamp)
    from ..quant_methods.config import MixPrecScheme

    frac = opts.a8_fraction if opts.weight_scheme == "w4ax" else None
    cfg = MixPrecScheme(opts.weight_scheme, opts.group_size, opts.kv_scheme, frac,
                        act_rotation=opts.act_rotation).to_dict()
    cfg["calibration"] = {"text": opts.calib_text, "samples": opts.calib_samples, "seqlen": opts.calib_seqlen,
                          "smooth": opts.smooth,
                          "smooth_attention_alpha": opts.smooth_attention_alpha if opts.smooth_attention else None,
                          "k_centering": opts.k_centering, "gptq": opts.gptq, "clip": opts.clip}
    if opts.weight_scheme == "w4ax":
        cfg["calibration"]["a8_allocation"] = opts.a8_allocation
        cfg["calibration"]["a8_select"] = opts.a8_select
    return cfg


# --- one linear -------------------------------------------------------------------------

def a8_blocks_per_group(layer, stats: dict[str, C.LinearStats], opts: QuantOptions) -> dict[str, int]:
    """W4Ax: 8-bit activation blocks of each input group of a decoder layer (its linears share
    the input, so one count). "uniform": round(a8_fraction * K/128) each; "layer": the same total
    spread by fmpq.block_gains on the calibration sample (COMET keeps the blocks that hold
    outliers at 8 bits, so its share varies by layer too). The budget is in MACs (a block of a
    group costs its N), so the layer's 8-bit share of the GEMM work stays uniform's;
    "layer-blocks": in blocks, so the layer's 8-bit share of its blocks by count stays uniform's."""
    first = {g: d["linears"][0] for g, d in C.LINEAR_GROUPS.items()}
    uniform = {g: fmpq.num_a8_blocks(stats[n].absmax.numel(), opts.a8_fraction) for g, n in first.items()}
    if opts.a8_allocation == "uniform":
        return uniform
    gains, cost = {}, {}
    for g, d in C.LINEAR_GROUPS.items():
        st = stats[first[g]]
        w = torch.cat([layer.get_submodule(n).weight.detach() for n in d["linears"]])
        gains[g] = fmpq.block_gains(st.sample, w, fmpq.act_permutation(st.absmax, opts.a8_select),
                                    opts.act_rotation)
        cost[g] = float(w.shape[0]) if opts.a8_allocation == "layer" else 1.0
    return fmpq.allocate_a8_blocks(gains, cost, sum(uniform[g] * cost[g] for g in uniform))


def quantize_linear(w: torch.Tensor, st: C.LinearStats, opts: QuantOptions,
                    a8_blocks: int | None = None) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one linear (without bias) for opts.weight_scheme; a8_blocks (w4ax):
    its 8-bit blocks, by default round(a8_fraction * K/128)."""
    g = opts.group_size
    if opts.weight_scheme == "gptq-w4a16":
        return gptq.gptq_w4a16(w, st.hessian, g, opts.percdamp)
    extra, h = {}, st.hessian
    act_sq = st.sample.double().pow(2).mean(0)
    if opts.weight_scheme == "w4ax":
        perm = fmpq.act_permutation(st.absmax, opts.a8_select)
        blocks = fmpq.num_a8_blocks(w.shape[1], opts.a8_fraction) if a8_blocks is None else a8_blocks
        k8, rot = blocks * F.ACT_BLOCK, F.act_rotation_matrix(opts.act_rotation)
        w = fmpq.weight_basis(w, perm, k8, rot)
        act_sq = ref.w4ax_act_input(st.sample.double(), perm, k8, None, opts.act_rotation).pow(2).mean(0)
        h = None if h is None else fmpq.hessian_basis(h, perm, k8, rot)
        extra = {"act_perm": perm, "a8_blocks": torch.tensor([blocks], dtype=torch.int32)}
    ratio = lqq.clip_search(w, g, act_sq)[1] if opts.clip else 1.0
    if opts.gptq:
        t = gptq.gptq_lqq(w, h, g, opts.percdamp, ratio, act_sq if opts.clip else None)
    elif opts.clip:
        t = lqq.quantize_lqq_searched(w, g, act_sq, ratio)
    else:
        t = lqq.quantize_lqq_clipped(w, g, ratio)
    return {**t, **extra}


def fake_quant_fn(opts: QuantOptions):
    """The layer simulation the alpha search minimises the error of."""
    if opts.weight_scheme == "w4ax":
        def fake(x, w):
            perm = fmpq.act_permutation(x.abs().amax(0), opts.a8_select)
            k8 = fmpq.num_a8_blocks(x.shape[1], opts.a8_fraction) * F.ACT_BLOCK
            return fmpq.fake_w4ax(x, w, opts.group_size, perm, k8, opts.act_rotation)
        return fake
    return lambda x, w: lqq.fake_w4a8(x, w, opts.group_size)


# --- one decoder layer ------------------------------------------------------------------

def smooth_layer(layer, stats: dict[str, C.LinearStats], config, opts: QuantOptions) -> dict:
    """Search and fold smoothing scales for the four input groups; updates stats in place."""
    gqa = S.Gqa(config.num_attention_heads, config.num_key_value_heads)
    fake = fake_quant_fn(opts)
    alphas = {}
    # o and down fold into v_proj/up_proj rows: do them before qkv/gate_up quantize those rows' inputs
    for key in ("o", "down", "qkv", "gate_up"):
        grp = C.LINEAR_GROUPS[key]
        lins = [layer.get_submodule(n) for n in grp["linears"]]
        st = stats[grp["linears"][0]]
        g = gqa if key == "o" else None
        alpha, s, _ = S.search_alpha(st.sample, [l.weight for l in lins], st.absmax, fake, opts.alpha_grid, g)
        alphas[key] = alpha
        if alpha is None:
            continue
        prev = layer.get_submodule(grp["prev"])
        if key in ("qkv", "gate_up"):
            s_k = S.fold_into_norm(prev, lins, s)
        else:
            s_k = gqa.expand(s) if g else s
            S.fold_into_rows(prev, lins, s, s_k)
        new = st.scaled(s_k)
        for n in grp["linears"]:
            stats[n] = new
    return alphas


def quantize_layer(layer, i: int, hidden: torch.Tensor, kwargs: dict, config, opts: QuantOptions
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
    """Quantize decoder layer i in place; returns (export tensors, next hidden, info)."""
    t0 = time.time()
    layer.float()
    stats, k_stats, float_out = C.collect_stats(layer, hidden, kwargs, hessian=opts.needs_hessian(),
                                         sample_rows=opts.sample_rows, batch_size=opts.batch_size, seed=i)
    info = {"layer": i}
    c = 0.0
    if opts.k_centering:
        k_proj = layer.self_attn.k_proj
        if k_proj.bias is None:
            raise ValueError("k centering folds into k_proj's bias, and this model has none")
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or config.rope_theta
        c = center_k_bias(k_proj, k_stats["mean"], C.head_dim(config), theta,
                          config.max_position_embeddings)
        info["k_centered_max"] = float(c.abs().max())
    k_absmax = torch.maximum(k_stats["max"] - c, c - k_stats["min"])  # of k - c
    if opts.smooth_attention:
        lam = smooth_attention_scales(k_absmax, C.head_dim(config), opts.smooth_attention_alpha)
        fold_smooth_attention(layer.self_attn.q_proj, layer.self_attn.k_proj, lam,
                              config.num_attention_heads, config.num_key_value_heads)
        info["k_absmax_before_after"] = (float(k_absmax.max()), float((k_absmax / lam).max()))
    if opts.smooth:
        info["alpha"] = smooth_layer(layer, stats, config, opts)
    prefix = f"model.layers.{i}."
    out: dict[str, torch.Tensor] = {}
    blocks = {}
    if opts.weight_scheme == "w4ax":
        info["a8_blocks"] = a8_blocks_per_group(layer, stats, opts)
        blocks = {n: b for g, b in info["a8_blocks"].items() for n in C.LINEAR_GROUPS[g]["linears"]}
    for name in C.LINEAR_NAMES:
        lin = layer.get_submodule(name)
        bias = None if lin.bias is None else lin.bias.detach()
        if bias is not None:
            out[prefix + name + ".bias"] = bias.to(torch.bfloat16)
        if opts.weight_scheme == "none":
            out[prefix + name + ".weight"] = lin.weight.detach().to(torch.bfloat16)
            continue
        t = quantize_linear(lin.weight.detach(), stats[name], opts, blocks.get(name))
        out.update({prefix + name + "." + k: v for k, v in t.items()})
        if opts.weight_scheme == "gptq-w4a16":
            new = dense_linear(gptq.dequantize_gptq(t), bias)
        else:
            new = MixPrecLinear(t, bias, opts.weight_scheme, opts.act_rotation)
        replace_module(layer, name, new)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[prefix + norm + ".weight"] = layer.get_submodule(norm).weight.detach().to(torch.bfloat16)
    nxt = float_out if opts.propagate == "float" else C.run_layer(layer, hidden, kwargs, opts.batch_size)
    info["seconds"] = time.time() - t0
    return out, nxt, info


# --- whole model ------------------------------------------------------------------------

def load_config(model_dir: str | Path):
    """The HF config of a supported model folder (clear errors otherwise)."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json (not a Hugging Face model folder)")
    # before AutoConfig, which has its own (less helpful) error for unknown model types
    C.check_architecture_names(_read_json(model_dir / "config.json").get("architectures"))
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, TypeError, KeyError, OSError) as e:
        raise SourceError(f"{model_dir / 'config.json'}: transformers cannot read it "
                          f"({type(e).__name__}: {e}); fix the field it names or restore the "
                          "file from the original model") from e
    C.check_architecture(config)
    return config


def quantize_model(model_dir: str | Path, out_dir: str | Path, opts: QuantOptions,
                   overwrite: bool = False) -> dict:
    """Returns a summary dict (timings, per-layer info, output path)."""
    from tqdm import tqdm

    opts.validate()
    model_dir = Path(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_config(model_dir)
    check_shapes(config, opts)
    if Path(out_dir).exists() and not overwrite:
        raise FileExistsError(f"output {out_dir} already exists (pass --overwrite to replace it)")
    t_start = time.time()
    check_source(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise SourceError(f"{model_dir}: transformers cannot load the weights "
                          f"({type(e).__name__}: {e}); the checkpoint does not match its "
                          "config.json or is corrupt: download or convert it again") from e
    missing = sorted(set(info.get("missing_keys") or []) | set(info.get("mismatched_keys") or []))
    if missing:  # transformers would fill them with random values: never quantize those
        raise SourceError(f"{model_dir}: tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                          "are missing from the checkpoint (or have the wrong shape); download "
                          "or convert the model again")
    check_finite(model.state_dict().items(), f"the source checkpoint {model_dir}")
    model.eval().requires_grad_(False)
    tokens = C.calibration_batches(tok, load_text(opts.calib_text), opts.calib_samples, opts.calib_seqlen)
    warnings = [w for w in (opts.gptq_calibration_warning(config, tokens.numel()),
                            opts.w4ax_calibration_warning(tokens.numel())) if w]
    for warning in warnings:
        print(f"vllm-mixprec quantize: warning: {warning}", file=sys.stderr, flush=True)
    kwargs = C.decoder_kwargs(model, tokens.shape[1])
    with torch.no_grad():
        hidden = model.model.embed_tokens(tokens).float()
    t_load = time.time() - t_start
    tensors: dict[str, torch.Tensor] = {}
    infos = []
    layers = model.model.layers
    bar = tqdm(range(len(layers)), desc="quantizing layers", unit="layer", disable=not opts.progress)
    for i in bar:
        with torch.no_grad():
            t, hidden, info = quantize_layer(layers[i], i, hidden, kwargs, config, opts)
        try:  # finite inputs, non-finite outputs: degenerate calibration statistics
            check_finite(t.items(), f"the quantized output of layer {i}",
                         "retry without --smooth/--smooth-attention, or with more --calib-samples")
        except SourceError as e:
            raise RuntimeError(str(e)) from None
        tensors.update(t)
        infos.append(info)
        layers[i] = torch.nn.Identity()  # done: free its memory
        bar.set_postfix(last=f"{info['seconds']:.1f}s")
    for name, p in model.state_dict().items():
        if name.startswith("model.layers."):
            continue
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        tensors[name] = p.detach().to(torch.bfloat16)
    t_quant = time.time() - t_start - t_load
    src_cfg = _read_json(model_dir / "config.json")
    path = write_checkpoint(out_dir, tensors, src_cfg, model_dir, quantization_config(opts), overwrite)
    return {"output": str(path), "layers": infos, "calibration_tokens": int(tokens.numel()),
            "warnings": warnings,
            "seconds_load": t_load, "seconds_quantize": t_quant,
            "seconds_total": time.time() - t_start, "options": dataclasses.asdict(opts)}
