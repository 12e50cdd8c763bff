"""Every environment variable the plugin reads, in one table, and the one way to read them.

Why a table: the knobs grew one A/B at a time and were read in a dozen modules, each with its own
parsing. A typo (MIXPREC_KERNAL=triton) changed nothing and said nothing, and some values were
parsed by a bare int() whose error did not name the variable. Now:
- every read goes through get() (or flag() / integer() on top of it), which refuses an undeclared
  name, so the table cannot fall behind the code (tests/test_envs.py also scans the package);
- an empty value counts as unset, and the default lives here only;
- a bad value raises ValueError("NAME='value': expected ...");
- register() warns once per process about any MIXPREC_* variable this table does not know,
  naming the closest known one;
- docs/ENVIRONMENT.md is this table as Markdown (`python -m vllm_mixprec.envs --write
  docs/ENVIRONMENT.md`; a test keeps it current).

Validation of each knob's values stays with the code that uses it (the allowed values are
that module's constants); `accepts` here is what the documentation says.
"""
from __future__ import annotations

import difflib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Mapping

logger = logging.getLogger("vllm.mixprec")

PREFIX = "MIXPREC_"


@dataclass(frozen=True)
class Knob:
    name: str
    group: str
    default: str | None  # the value used when unset or empty; None: a rule, said by `unset`
    accepts: str
    doc: str
    unset: str = ""  # what happens when unset, where default is None
    reader: str = ""  # who reads it, where not the package (setup.py, the GPU-host scripts)


SERVING = "Serving: kernels and the linear layer"
COMPILE = "Serving: torch.compile"
TP = "Serving: tensor parallel"
ATTN = "Serving: attention and the KV cache"
LAUNCH = "csrc launch options (read when the extension loads; A/B and tuning)"
TUNING = "Tuning overrides (benchmarks and sweeps only)"
TOOLS = "Build, tools and internals"
GROUPS = (SERVING, COMPILE, TP, ATTN, LAUNCH, TUNING, TOOLS)  # the order of docs/ENVIRONMENT.md

KNOBS: tuple[Knob, ...] = (
    # --- kernels and the linear layer ------------------------------------------------------
    Knob("MIXPREC_KERNEL", SERVING, None, "cuda, triton or reference",
         "Forces one kernel family for every mixprec layer (A/B runs, debugging); a family that "
         "cannot run on the layer's device is a start-up error.",
         unset="the csrc ops where built and the GPU runs them, else Triton; CPU tensors use the "
               "torch reference"),
    Knob("MIXPREC_FUSE_ACT_QUANT", SERVING, "1", "1 or 0",
         "1: under torch.compile a W4A8 layer's activation quantization is traced as torch ops, "
         "which Inductor fuses into the RMSNorm or SiLU-and-mul before it. 0: always the separate "
         "quantize kernel (A/B). --enforce-eager always uses the kernel."),
    Knob("MIXPREC_W4AX_QUANT", SERVING, "kernel", "kernel or traced",
         "How a compiled W4Ax layer quantizes its activations: the one-pass Triton kernel "
         "(gather, rotate, quantize), or torch ops that Inductor compiles into 5-15 kernels."),
    Knob("MIXPREC_QUANT_PDL", SERVING, "1", "1 or 0",
         "0: the Triton quantize kernel's second pass over split rows (M <= 512) is not a "
         "programmatic dependent launch (Hopper)."),
    Knob("MIXPREC_W4A8_KERNEL", TUNING, "-1", "an integer from -2 to 8",
         "Forces a csrc W4A8 GEMM kernel: -1 auto, -2 auto over the mma.sync kernels only, "
         "0/1 decode (16/32 channels a CTA), 2/3 tiled (64/128 tokens), 4-8 the sm_90a wgmma "
         "tiles (kernels/cuda.py)."),
    Knob("MIXPREC_W4A8_WGMMA", TUNING, "1", "0 or 1",
         "0: the auto choice never takes the sm_90a wgmma kernels (the same as "
         "MIXPREC_W4A8_KERNEL=-2)."),
    Knob("MIXPREC_W4A8_SPLITS", TUNING, "0", "an integer >= -2",
         "Forces the csrc GEMM's K split: 0 lets the planner choose, -1 stream-K and -2 a cluster "
         "pair (wgmma kernels only), n a split count (the planners clamp it)."),
    # --- torch.compile ---------------------------------------------------------------------
    Knob("MIXPREC_X_WGMMA_ORDER", COMPILE, "1", "1 or input_fused, input, codes, or 0",
         "On an sm_90 GPU, graphs for batches past 64 tokens quantize W4A8 activations in the "
         "wgmma k order, which the GEMM copies by TMA. input_fused (the default, also 1): each "
         "quantizer permutes its input inside its norm's kernel and Inductor's "
         "realize_reads_threshold is raised to 16; input: the same, threshold left alone; "
         "codes: the codes permuted, on the layers where that paid (the default before session "
         "73); 0: the natural order (compile_passes.py)."),
    Knob("MIXPREC_DECODE_QUANT_OPS", COMPILE, "1", "0 or 1",
         "1: in graphs for batches of at most 64 tokens, each traced activation quantizer becomes "
         "mixprec::quantize_act, and one after vLLM's fused_add_rms_norm becomes "
         "mixprec::add_rms_norm_quantize_act with the norm (a post-grad pass): kernels launched "
         "for the batch they get, which let the decode GEMM after them start at once (Inductor's "
         "fused quantizers are tuned for its 8192-token size hint). 0: Inductor's, as before "
         "session 83."),
    Knob("MIXPREC_DECODE_SILU_OP", COMPILE, "0", "0 or 1",
         "With MIXPREC_DECODE_QUANT_OPS=1: 1: in the same graphs, the down projection's "
         "SiLU-and-mul and its quantizer become mixprec::silu_mul_quantize_act (one csrc kernel, a "
         "row over a cluster of CTAs on sm_90). 0: the SiLU-and-mul stays Inductor's and its "
         "quantizer is mixprec::quantize_act. Opt-in: on an H100 it is bit-exact, 0.3-3.0 us faster "
         "a Llama-3-70B decoder piece at 1-16 tokens and 0.1-0.7 us slower an 8B one, and served "
         "(8B shape, session 89) it tied the default."),
    Knob("MIXPREC_FUSE_SILU_QUANT", COMPILE, "0", "0 or 1",
         "1: mixprec::silu_mul_quantize_act replaces the down projection's SiLU-and-mul + "
         "quantization in graphs for batches of at most 32 tokens (a post-grad pass); served TPOT "
         "did not move beyond noise, so it is off."),
    # --- tensor parallel -------------------------------------------------------------------
    Knob("MIXPREC_TP_ACT_SCALE", TP, "rank", "rank or global",
         "A row-parallel layer's per-token activation scale at TP > 1: each rank's own slice "
         "max (no communication), or the max over the ranks (one [tokens, TP] all-gather a "
         "layer; TP=1's codes bit for bit)."),
    Knob("MIXPREC_TP_REDUCE", TP, "model", "model or exact",
         "model: vLLM's all-reduce of 16-bit partial outputs. exact: the ranks' integer dot "
         "products all-reduced as float32, then the epilogue once: TP=1's output bit for bit "
         "(needs the global scale; cannot be combined with MIXPREC_TP_ACT_SCALE=rank)."),
    # --- attention and the KV cache --------------------------------------------------------
    Knob("MIXPREC_ATTN_PREFILL_EXACT", ATTN, "1", "1 or 0",
         "1: a prefill chunk's new tokens attend each other in 16 bits, older tokens through the "
         "KV4/KV8 cache. 0: every key through the quantized cache (docs/ATTENTION.md)."),
    Knob("MIXPREC_ATTN_CHUNK", ATTN, "auto", "auto, flash or triton",
         "Who attends a prefill chunk: vLLM's FlashAttention where it runs (auto), or the Triton "
         "kernel."),
    Knob("MIXPREC_ATTN_CONTEXT_TOKENS", ATTN, None, "a token count >= 0",
         "Rows of the 16-bit context workspace that exact prefill dequantizes a chunk's cached "
         "context into, reserved at start-up; 0 turns it off.",
         unset="max_num_batched_tokens + max_model_len, at most 262144"),
    Knob("MIXPREC_ATTN_DECODE_IMPL", ATTN, None, "cuda or triton",
         "Forces the KV4 decode page kernel: the CUDA one (an error where it cannot run) or the "
         "Triton one.",
         unset="the CUDA kernel for KV4, head_dim 128, <= 8 query heads a kv head, no bias-aware "
               "K and at least 32 (row, kv head) pairs; Triton otherwise"),
    Knob("MIXPREC_ATTN_MERGE", ATTN, None, "kernel or fused",
         "Where a Triton decode merges its split partials: a finish kernel, or the last page "
         "program of each (row, kv head).",
         unset="fused for batch 1 and small KV4 batches, the finish kernel otherwise"),
    Knob("MIXPREC_ATTN_TAIL", ATTN, None, "finish, split or program",
         "Where the Triton decode attends the fp16 residual tail.",
         unset="chosen per batch (kernels/triton/attention.py, decode_tail_mode)"),
    Knob("MIXPREC_ATTN_TAIL_IN_SPLIT", ATTN, None, "0 or 1",
         "The older spelling of MIXPREC_ATTN_TAIL: 1 is split, 0 is finish; not both.",
         unset="MIXPREC_ATTN_TAIL decides"),
    Knob("MIXPREC_ATTN_PDL", ATTN, "0", "0 or 1",
         "1: the decode finish kernel is a programmatic dependent launch on Hopper (exact; served "
         "TPOT did not move beyond noise)."),
    Knob("MIXPREC_ATTN_FAST_UNPACK", ATTN, "1", "1 or 0",
         "0: the decode kernels unpack KV codes with plain conversions instead of inline PTX "
         "(same values, slower), should the assembly ever misbehave."),
    Knob("MIXPREC_ATTN_CUDA_WAVE", ATTN, "1", "1 or 0",
         "1: the CUDA page kernel's split count is cut to one wave of CTAs. 0: the Triton "
         "kernel's split count."),
    Knob("MIXPREC_ATTN_CUDA_PREFETCH", ATTN, "4", "a page count from 0 to 31",
         "Pages ahead that each warp of the CUDA page kernel asks into L2 (0: none)."),
    Knob("MIXPREC_KV_RESIDUAL", ATTN, None, "a token count from 0 to 128",
         "The fp16 residual window of recent tokens kept beside the KV4/KV8 cache; 0 turns it "
         "off.",
         unset="the checkpoint's kv_residual_tokens, else the block size"),
    Knob("MIXPREC_KV_RESIDUAL_SLOTS", ATTN, None, "an integer >= max_num_seqs x window blocks",
         "Slots of the residual pool per layer.",
         unset="max_num_seqs x window blocks + max(16, max_num_seqs / 4)"),
    Knob("MIXPREC_KV_RESIDUAL_GRAPHS", ATTN, "1", "1 or 0",
         "0: the residual window's per-step directory update runs eagerly on CUDA instead of "
         "from CUDA graphs (where the Triton program is off)."),
    Knob("MIXPREC_KV_RESIDUAL_KERNEL", ATTN, "1", "1 or 0",
         "0: the residual directory update runs as torch ops instead of one Triton program on "
         "CUDA."),
    Knob("MIXPREC_KV_BIAS_AWARE", ATTN, "auto", "auto, 0 (also off, false, no) or 1 (also on, "
         "true, yes)",
         "Bias-aware K for KV4/KV8: auto turns it on for the layers whose k bias has a rotary "
         "pair of norm >= MIXPREC_KV_BIAS_MIN (neox-RoPE models); 0 never; 1 every layer with a "
         "k bias."),
    Knob("MIXPREC_KV_BIAS_MIN", ATTN, "16", "a number >= 0",
         "The smallest largest-pair k-bias norm that turns bias-aware K on (0: every layer with "
         "a k bias)."),
    Knob("MIXPREC_KV_BIAS_PAIRS", ATTN, "16", "a power of two >= 16, or all",
         "Rotary pairs a head keeps for bias-aware K, largest bias first."),
    Knob("MIXPREC_KV4_PLAIN_K_BIAS", ATTN, "0", "0 or 1",
         "1: serve KV4 for a model whose k projection has a bias without --quantization mixprec "
         "(K quantized with the bias in it; refused by default because it collapses such "
         "models)."),
    Knob("MIXPREC_PRECOMPILE", ATTN, "1", "1 or 0",
         "1: the attention kernels' Triton variants compile at start-up on a thread pool; 0: "
         "each at its first launch."),
    Knob("MIXPREC_PRECOMPILE_THREADS", ATTN, None, "a thread count >= 1",
         "Threads of that start-up compile.", unset="the CPU count, at most 16"),
    # --- csrc launch options ---------------------------------------------------------------
    Knob("MIXPREC_GEMM_PDL", LAUNCH, None, "0 or 1",
         "The csrc GEMMs as programmatic dependent launches on sm_90, started while quantize_act "
         "runs.", unset="on"),
    Knob("MIXPREC_GEMM_STREAM_K", LAUNCH, None, "0 or 1",
         "The wgmma planner may pick a stream-K grid where it estimates it 8 % faster.",
         unset="on"),
    Knob("MIXPREC_GEMM_CLUSTER_PAIR", LAUNCH, None, "0 or 1",
         "The wgmma planner may run a tile's two K halves in a cluster of 2 CTAs.", unset="on"),
    Knob("MIXPREC_GEMM_DECODE_U8", LAUNCH, None, "0 or 1",
         "The decode GEMM multiplies unsigned weight bytes (u8 x s8) and subtracts 128 sum x.",
         unset="off"),
    Knob("MIXPREC_GEMM_DECODE_CTAS_PER_SM", LAUNCH, None, "0, 2 or 3",
         "The decode kernels' build at M <= 16: 2 or 3 CTAs an SM; 0 lets the planner pick.",
         unset="0"),
    Knob("MIXPREC_GEMM_DECODE_PRELOAD_MAX_M", LAUNCH, None, "an integer from 0 to 32",
         "Up to this M a decode warp reads its first weights before the PDL wait.", unset="16"),
    Knob("MIXPREC_GEMM_DECODE_DP4A", LAUNCH, None, "0 or 1",
         "At M = 1 the decode kernels multiply the 4-bit codes by IDP.4A (no dequant, no MMA).",
         unset="on"),
    Knob("MIXPREC_ACT_QUANT_SPLIT", LAUNCH, None, "0, 1, 1024, 2048 or 4096",
         "quantize_act splits long rows over CTAs: 0 never, 1 its rule, else that chunk at M <= 64.",
         unset="1"),
    Knob("MIXPREC_QUANT_OPS_PDL", LAUNCH, None, "0 or 1",
         "The quantizer ops are programmatic dependents of the kernel before them on sm_90 (the "
         "decode GEMM lets them start during its last CTAs).", unset="on"),
    # --- tuning overrides ------------------------------------------------------------------
    Knob("MIXPREC_ATTN_DECODE_CFG", TUNING, None, "three comma-separated integers",
         "BLOCK_N,num_warps,num_stages of the Triton decode kernel.",
         unset="the tuned table (kernels/triton/attention.py, decode_config)"),
    Knob("MIXPREC_ATTN_PREFILL_CFG", TUNING, None, "four comma-separated integers",
         "BLOCK_M,BLOCK_N,num_warps,num_stages of the Triton prefill kernel.",
         unset="prefill_config's rule"),
    Knob("MIXPREC_ATTN_DECODE_MAXNREG", TUNING, None, "0 or a register count from 24 to 255",
         "Caps the decode kernel's registers a thread for every launch (0: the compiler's "
         "choice).", unset="168 for the fused merge of a multi-row batch, else the compiler's"),
    Knob("MIXPREC_ATTN_MIN_TILES", TUNING, "1", "a tile count from 1 to 64",
         "Page tiles a decode split attends at least."),
    Knob("MIXPREC_ATTN_KBIAS_CHUNK", TUNING, "64", "a power of two >= 16",
         "Columns per chunk of the bias-aware K tables in the decode kernel (at most the tile)."),
    # --- build, tools, internals -----------------------------------------------------------
    Knob("MIXPREC_BUILD_CUDA", TOOLS, "auto", "auto, 0 or 1",
         "Whether `pip install` compiles csrc/: auto where nvcc and a CUDA torch are present; 1 "
         "makes a missing toolchain an error.", reader="setup.py"),
    Knob("MIXPREC_CUDA_ARCHS", TOOLS, "80;90a", "';'-separated CUDA architectures",
         "The architectures csrc/ is compiled for.", reader="setup.py"),
    Knob("VLLM_MIXPREC_CACHE", TOOLS, None, "a directory",
         "Where `vllm-mixprec fetch` and `make demo` keep models and texts.",
         unset="~/.cache/vllm_mixprec"),
    Knob("MIXPREC_MODELS", TOOLS, None, "a directory",
         "Where the GPU-host scripts assemble the real models.", unset="/root/mixprec-models",
         reader="scripts/gpu_check.sh, scripts/gpu_models.sh"),
    Knob("MIXPREC_COMPILE_FACTORS", TOOLS, None, "(set by the plugin, not by users)",
         "vLLM hashes this entry into its torch.compile cache keys: its value is every MIXPREC_* "
         "variable set (compile_cache.py).", unset="the plugin adds it to vLLM's table"),
)

BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


def _knob(name: str) -> Knob:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in vllm_mixprec/envs.py: add a Knob for it") from None


def explicit(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """NAME's value, stripped, where it is set and not empty; else None (no default)."""
    _knob(name)
    v = (os.environ if environ is None else environ).get(name, "").strip()
    return v or None


def get(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """NAME's value, stripped; an unset or empty variable gives the declared default."""
    v = explicit(name, environ)
    return v if v is not None else BY_NAME[name].default


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """A 0/1 variable as a bool; anything else raises, naming the variable."""
    v = get(name, environ)
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"


def integer(name: str, lo: int, hi: int | None = None,
            environ: Mapping[str, str] | None = None) -> int | None:
    """An integer variable in [lo, hi] (None where unset and without a default)."""
    v = get(name, environ)
    if v is None:
        return None
    s = v[1:] if v.startswith("-") else v
    if not (s.isascii() and s.isdigit()) or int(v) < lo or (hi is not None and int(v) > hi):
        span = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={v!r}: expected an integer {span}")
    return int(v)


def integers(name: str, n: int, environ: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """n comma-separated positive integers (tuning overrides), or None where unset."""
    v = get(name, environ)
    if v is None:
        return None
    parts = [p.strip() for p in v.split(",")]
    if len(parts) != n or not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{name}={v!r}: expected {n} comma-separated integers > 0")
    return tuple(int(p) for p in parts)


def unknown(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The MIXPREC_* variables set that no Knob declares, each with the closest declared name."""
    names = sorted(k for k in (os.environ if environ is None else environ)
                   if k.startswith(PREFIX) and k not in BY_NAME)
    return [(k, next(iter(difflib.get_close_matches(k, BY_NAME, n=1, cutoff=0.75)), None))
            for k in names]


_warned: set[str] = set()


def warn_unknown(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log a warning for each unknown MIXPREC_* variable (once a process); returns the lines."""
    lines = []
    for name, close in unknown(environ):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f" (did you mean {close}?)" if close else ""
        lines.append(f"vllm_mixprec: {name} is set but no MIXPREC_* setting has that name{hint}; "
                     "it changes nothing (docs/ENVIRONMENT.md lists them)")
        logger.warning(lines[-1])
    return lines


def describe(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per plugin variable set in `environ`: its value against the default, and the
    unknown names (`vllm-mixprec env`)."""
    env = os.environ if environ is None else environ
    lines = []
    for k in KNOBS:
        v = explicit(k.name, env)
        if v is not None:
            default = k.default if k.default is not None else f"unset: {k.unset}"
            lines.append(f"{k.name}={v}  (default {default}; {k.group})")
    for name, close in unknown(env):
        hint = f"; did you mean {close}?" if close else ""
        lines.append(f"{name}={env[name]}  (unknown: changes nothing{hint})")
    return lines


def markdown() -> str:
    """docs/ENVIRONMENT.md: the table, grouped."""
    out = ["# Environment variables",
           "",
           "Generated from `vllm_mixprec/envs.py` (`python -m vllm_mixprec.envs --write "
           "docs/ENVIRONMENT.md`); `tests/test_envs.py` fails when the two differ. An empty "
           "value counts as unset. A bad value is an error that names the variable (raised where the "
           "setting is first read, mostly at start-up); a `MIXPREC_*` name that is not here gets a "
           "warning, since it changes nothing.",
           "",
           "Only the serving groups are meant for deployments; their defaults are what measured "
           "fastest, or kept accuracy (docs/BENCHMARKS.md). The rest exist for A/B runs, tuning "
           "and the GPU-host scripts.",
           ""]
    for group in GROUPS:
        out += [f"## {group}", "", "| variable | default | accepts | what it does |",
                "|---|---|---|---|"]
        for k in KNOBS:
            if k.group != group:
                continue
            default = f"`{k.default}`" if k.default is not None else k.unset
            doc = k.doc + (f" Read by {k.reader}." if k.reader else "")
            out.append(f"| `{k.name}` | {default} | {k.accepts} | {doc} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"] and len(argv) == 2:
        with open(argv[1], "w") as f:
            f.write(markdown())
        return 0
    if argv:
        print("usage: python -m vllm_mixprec.envs [--write PATH]", file=sys.stderr)
        return 2
    print(markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
