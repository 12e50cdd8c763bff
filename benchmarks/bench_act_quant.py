#!/usr/bin/env python3
"""Activation quantisation as vLLM's torch.compile runs it: one Inductor kernel per layer input.

Under vLLM's default compile, a mixprec linear layer traces reference.quantize_act in plain torch
ops, and Inductor fuses it into the RMSNorm or SiLU-and-mul before it (kernels/__init__.py). This
times those fused kernels at decode sizes against the plain RMSNorm / SiLU-and-mul kernels that
a Marlin deployment runs in their place. Both quantisation formulations are timed:

  amax      reference.quantize_act: one reduction; a row's NaN/Inf is read off its amax
  3-reduce  session 12's form: amax plus two all(isfinite) passes (kept here, for the A/B only)
  amax+pass SiLU input only: compiled with compile_passes.SiluMulQuantFusion, which puts
            mixprec::silu_mul_quantize_act (one Triton kernel) in place of the pair, as the
            plugin does in vLLM ("fused" in the JSON counts the pairs it replaced)

Each function is compiled the way vLLM compiles the model: dynamic batch dimension, first call at
8192 tokens (vLLM's profiling run), so Inductor's size hint and first autotune see 8192 rows;
`--static` also compiles a static-shape max-autotune version of each at the timed M (what
`-cc.compile_sizes` asks for). Times are medians of CUDA-graph replays (do_bench_cudagraph).

`--inductor KEY=VALUE` sets an Inductor config option for every compile (e.g.
triton.force_cooperative_reductions=True: a row's reduction split over several programs).
`--vllm-norm-quant` adds vLLM's own CUDA kernel for add + RMSNorm + per-token int8
(`rms_norm_dynamic_per_token_quant`, what vLLM's int8 fusion pass puts in), uncompiled, with how
many of its codes differ from reference.quantize_act of the native norm ("vllm" rows).
`--norm-op W...` adds the plugin's own add + RMSNorm + quantizer op (mixprec::add_rms_norm_quantize_act,
what MIXPREC_DECODE_QUANT_OPS=1 serves), uncompiled, with the same code agreement: W = cuda is its
csrc kernel ("op-cuda" rows; what it takes where built), a number its Triton kernel at that many
warps a program ("op-wW" rows; 0: the Triton kernel's own choice).
`--silu-op ARM...` adds the plugin's SiLU-and-mul + quantizer op (mixprec::silu_mul_quantize_act, what
MIXPREC_DECODE_SILU_OP=1 serves), uncompiled, with the same code agreement against the reference of
the two torch ops: ARM = cudaN is its csrc kernel with a row over at most N CTAs of a cluster ("sop-cudaN"
rows), cuda the same with the op's own N for the M rows (cuda.silu_quant_cluster_for: what it takes
where built), cudaNvV with about V vectors of 8 outputs a CTA (512 otherwise), triton its Triton
kernel ("sop-triton"). The "op" rows
of the silu pattern are what MIXPREC_DECODE_SILU_OP=0 serves: Inductor's SiLU-and-mul, then the
quantizer op (mixprec::quantize_act, the csrc kernel where built).
`--hidden`/`--inter` set the row widths (default Llama-3-8B's; 8192 and 28672 for Llama-3-70B).

  python benchmarks/bench_act_quant.py --out DIR [--ms 1 8] [--static] [--inductor K=V ...]
      [--vllm-norm-quant] [--norm-op cuda 0 4 8 16] [--silu-op cuda1 cuda8 cuda16v128 triton] [--patterns norm silu quant]
      [--hidden 4096] [--inter 14336]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_mixprec import compile_passes  # noqa: E402
from vllm_mixprec import reference as ref  # noqa: E402

HIDDEN, INTER, EPS = 4096, 14336, 1e-5  # Llama-3-8B
PROFILE_TOKENS = 8192


def quant_amax(x):
    return ref.quantize_act(x, None)


def quant_op(x):
    """The quantizer as the op DecodeQuantOps puts in decode graphs (opaque to Inductor)."""
    from vllm_mixprec import kernels  # noqa: F401  (registers the op)
    return torch.ops.mixprec.quantize_act(x, None)


def quant_3reduce(x):
    """Session 12's traced form: the row's finiteness from all(isfinite), twice."""
    xf = x.float()
    ok = torch.isfinite(xf).all(-1)
    scale = torch.where(ok, xf.abs().amax(-1).clamp_min(1e-8) / torch.full_like(xf[:, 0], 127.0),
                        float("nan"))
    q = torch.round(xf / scale[:, None]).clamp(-127, 127)
    return torch.where(torch.isfinite(xf).all(-1)[:, None], q, 0).to(torch.int8), scale


def add_rms_norm(x, res, w):
    """vLLM's fused_add_rms_norm, native form (reference.add_rms_norm)."""
    return ref.add_rms_norm(x, res, w, EPS)


silu_and_mul = ref.silu_and_mul  # vLLM's SiluAndMul.forward_native


def pattern(name, quant):
    """The function Inductor compiles for one layer input, with quantisation `quant` (or none)."""
    if name == "norm":
        def f(x, res, w):
            y, r = add_rms_norm(x, res, w)
            return (*quant(y), r) if quant else (y, r)
    elif name == "silu":
        def f(gu):
            y = silu_and_mul(gu)
            return quant(y) if quant else y
    else:  # the attention output feeding o_proj: nothing to fuse into
        def f(x):
            return quant(x)
    return f


def vllm_norm_quant(x, res, w):
    """vLLM's fused add + RMSNorm + dynamic per-token int8 (one CUDA kernel; the residual is
    updated in place, as vLLM's fused_add_rms_norm does): codes, scales [M, 1]."""
    from vllm import _custom_ops as ops
    return ops.rms_norm_dynamic_per_token_quant(x, w, EPS, torch.int8, residual=res)


def norm_op(x, res, w):
    """mixprec::add_rms_norm_quantize_act (the op compile_passes.DecodeQuantOps puts in decode
    graphs), uncompiled: codes, scales, residual."""
    from vllm_mixprec import kernels  # noqa: F401  (registers the op)
    return torch.ops.mixprec.add_rms_norm_quantize_act(x, res, w, EPS, None)


def silu_op(arm: tuple[str, int | None, int | None]):
    """mixprec::silu_mul_quantize_act's kernel for a --silu-op arm (silu_op_arm), uncompiled:
    gate_up -> codes, scales."""
    from vllm_mixprec import kernels
    from vllm_mixprec.kernels.triton import gemm as tg
    kind, max_cluster, cta_vecs = arm
    if kind == "triton":
        return lambda gu: tg.silu_mul_quantize_act(gu, None)
    return lambda gu: kernels._cuda.silu_mul_quantize_act(gu, None, max_cluster, cta_vecs)


def code_agreement(fn, m: int, name: str = "norm") -> dict:
    """fn (vllm_norm_quant or norm_op; silu_op's if name is "silu") against reference.quantize_act
    of the native add + RMSNorm (of SiLU-and-mul), on one input: the share of codes that differ,
    the largest code difference, and the scales' largest relative difference."""
    if name == "silu":
        (gate_up,) = inputs("silu", m)
        want_q, want_s = ref.silu_mul_quantize_act(gate_up, None)
        got_q, got_s = fn(gate_up)
    else:
        x, res, w = inputs("norm", m)
        want_q, want_s = ref.quantize_act(add_rms_norm(x, res, w)[0], None)
        got_q, got_s = fn(x, res.clone(), w)[:2]
    diff = (got_q.int() - want_q.int()).abs()
    return {"codes_differ": float((diff > 0).float().mean()), "max_code_diff": int(diff.max()),
            "scale_rel_diff": float(((got_s.view(-1) - want_s.view(-1)).abs() / want_s.view(-1)).max())}


def inputs(name, m):
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return {"norm": (r(m, HIDDEN), r(m, HIDDEN), r(HIDDEN)), "silu": (r(m, 2 * INTER),),
            "quant": (r(m, HIDDEN),)}[name]


def silu_op_arm(v: str) -> tuple[str, int | None, int | None]:
    """--silu-op's values: triton, cuda (the op's own cluster size for M rows), cudaN (up to N CTAs a
    row) or cudaNvV (about V vectors a CTA): (kind, max_cluster or None, cta_vecs)."""
    from vllm_mixprec.kernels import cuda
    if v == "triton":
        return v, None, None
    got = re.fullmatch(r"cuda(\d+)?(?:v(\d+))?", v)
    if got:
        max_cluster, cta_vecs = int(got[1]) if got[1] else None, int(got[2] or cuda.SILU_QUANT_CTA_VECS)
        if cuda.silu_quant_args_ok(1 if max_cluster is None else max_cluster, cta_vecs):
            return "cuda", max_cluster, cta_vecs
    raise argparse.ArgumentTypeError(
        f"{v!r}: expected triton, cuda, cudaN or cudaNvV with N = 1 to {cuda.SILU_QUANT_MAX_CLUSTER} (a row's "
        f"CTAs at most) and V = 1 to {cuda.SILU_QUANT_MAX_CTA_VECS} (vectors a CTA)")


def norm_op_arm(v: str) -> str | int:
    """--norm-op's values: cuda, or a number of warps (0 or a power of two up to 16)."""
    if v == "cuda":
        return v
    if v.isdigit() and int(v) in (0, 1, 2, 4, 8, 16):
        return int(v)
    raise argparse.ArgumentTypeError(f"{v!r}: expected cuda or a number of warps (0, 1, 2, 4, 8 or 16)")


def time_us(fn, args) -> float:
    import triton

    fn(*args)
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(lambda: fn(*args), rep=50, return_mode="median") * 1e3


INDUCTOR_OPTIONS: dict = {}  # --inductor


def inductor_option(text: str) -> tuple[str, object]:
    """KEY=VALUE -> (KEY, VALUE as bool/int/float/str)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--inductor {text!r}: expected KEY=VALUE")
    low = raw.lower()
    if low in ("true", "false"):
        return key, low == "true"
    for cast in (int, float):
        try:
            return key, cast(raw)
        except ValueError:
            pass
    return key, raw


def compiled(fn, name, static_m: int | None, fusion=None):
    torch._dynamo.reset()
    opts = dict(INDUCTOR_OPTIONS)
    if fusion is not None:
        opts[compile_passes.HOOK] = fusion
    if static_m is not None:
        return torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False,
                             options=opts or None)
    return compile_dynamic(fn, inputs(name, PROFILE_TOKENS), opts or None)


def compile_dynamic(fn, big, options):
    """fn compiled as vLLM compiles the model: the batch dimension of the 2-D inputs dynamic, the
    first call on `big` (PROFILE_TOKENS rows: vLLM's profiling run)."""
    f = torch.compile(fn, options=options)
    for t in big:
        if t.dim() == 2:
            torch._dynamo.mark_dynamic(t, 0)
    f(*big)
    return f


def main() -> int:
    global HIDDEN, INTER
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--static", action="store_true", help="also static-shape max-autotune compiles")
    ap.add_argument("--inductor", type=inductor_option, action="append", default=[],
                    metavar="KEY=VALUE", help="an Inductor config option for every compile")
    ap.add_argument("--vllm-norm-quant", action="store_true",
                    help="also vLLM's rms_norm_dynamic_per_token_quant kernel (module docstring)")
    ap.add_argument("--patterns", nargs="*", choices=("norm", "silu", "quant"), default=("norm", "silu", "quant"),
                    help="the compiled patterns to time (default: all three; none: only the ops asked for)")
    ap.add_argument("--norm-op", type=norm_op_arm, nargs="+", metavar="cuda|WARPS",
                    help="also mixprec::add_rms_norm_quantize_act, uncompiled: its csrc kernel (cuda), "
                         "its Triton kernel at each number of warps a program (0: its own choice)")
    ap.add_argument("--silu-op", type=silu_op_arm, nargs="+", metavar="triton|cuda|cudaN|cudaNvV",
                    help="also mixprec::silu_mul_quantize_act, uncompiled: its csrc kernel (cuda: a row over "
                         "the op's own cluster size for M rows; cudaN: up to N CTAs; vV: about V vectors a "
                         "CTA), its Triton kernel (triton)")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="the norm's row width (default: %(default)s)")
    ap.add_argument("--inter", type=int, default=INTER, help="SiLU-and-mul's output width (default: %(default)s)")
    args = ap.parse_args()
    HIDDEN, INTER = args.hidden, args.inter
    INDUCTOR_OPTIONS.update(args.inductor)
    if not torch.cuda.is_available():
        raise SystemExit("bench_act_quant needs a CUDA GPU")
    variants = [("norm", None, "plain"), ("norm", quant_amax, "amax"), ("norm", quant_3reduce, "3-reduce"),
                ("silu", None, "plain"), ("silu", quant_amax, "amax"), ("silu", quant_3reduce, "3-reduce"),
                ("silu", quant_amax, "amax+pass"), ("silu", quant_op, "op"),
                ("quant", quant_amax, "amax"), ("quant", quant_3reduce, "3-reduce")]
    rows = []
    for name, quant, form in variants:
        if name not in args.patterns:
            continue
        for m in args.ms:
            fusion = compile_passes.SiluMulQuantFusion() if form.endswith("+pass") else None
            row = {"pattern": name, "quant": form, "M": m,
                   "dynamic_us": time_us(compiled(pattern(name, quant), name, None, fusion),
                                         inputs(name, m))}
            if args.static:
                row["static_autotune_us"] = time_us(compiled(pattern(name, quant), name, m, fusion),
                                                    inputs(name, m))
            if fusion is not None:
                row["fused"] = fusion.matched
            rows.append(row)
            print(f"{name:6s} {form:9s} M={m:<5d} dynamic {row['dynamic_us']:7.2f} us"
                  + (f"   static max-autotune {row['static_autotune_us']:7.2f} us" if args.static else ""),
                  flush=True)
    if args.vllm_norm_quant:
        for m in args.ms:
            row = {"pattern": "norm", "quant": "vllm", "M": m, "dynamic_us": time_us(vllm_norm_quant, inputs("norm", m)),
                   **code_agreement(vllm_norm_quant, m)}
            rows.append(row)
            print(f"norm   vllm      M={m:<5d} uncompiled {row['dynamic_us']:7.2f} us   codes differing "
                  f"{100 * row['codes_differ']:.3f} % (at most {row['max_code_diff']}), scales up to "
                  f"{row['scale_rel_diff']:.1e} apart", flush=True)
    for arm in args.norm_op or ():
        from vllm_mixprec import kernels
        from vllm_mixprec.kernels.triton import gemm as tg
        if arm == "cuda" and not kernels._cuda.has_norm_quant():
            raise SystemExit(f"--norm-op cuda: the csrc ops are not built ({kernels._cuda.load_error()})")
        kernels._NORM_QUANT_CUDA = arm == "cuda"
        tg.NORM_QUANT_WARPS = None if arm == "cuda" else arm or None
        form = "op-cuda" if arm == "cuda" else f"op-w{arm}"
        for m in args.ms:
            row = {"pattern": "norm", "quant": form, "M": m, "warps": None if arm == "cuda" else arm,
                   "dynamic_us": time_us(norm_op, inputs("norm", m)), **code_agreement(norm_op, m)}
            rows.append(row)
            print(f"norm   {form:9s} M={m:<5d} uncompiled {row['dynamic_us']:7.2f} us   codes differing "
                  f"{100 * row['codes_differ']:.3f} % (at most {row['max_code_diff']}), scales up to "
                  f"{row['scale_rel_diff']:.1e} apart", flush=True)
        kernels._NORM_QUANT_CUDA, tg.NORM_QUANT_WARPS = True, None
    for arm in args.silu_op or ():
        from vllm_mixprec import kernels
        if arm[0] == "cuda" and not kernels._cuda.has_silu_quant():
            raise SystemExit(f"--silu-op cuda: the csrc ops are not built ({kernels._cuda.load_error()})")
        form = f"sop-{arm[0]}{arm[1] or ''}"
        if arm[0] == "cuda" and arm[2] != kernels._cuda.SILU_QUANT_CTA_VECS:
            form += f"v{arm[2]}"
        if arm[0] == "cuda" and arm[1] and kernels._cuda.silu_quant_plan(INTER, arm[1], arm[2]) is None:
            print(f"silu   {form:9s} skipped: rows of {INTER} do not fit {arm[1]} CTAs", flush=True)
            continue
        fn = silu_op(arm)
        for m in args.ms:
            max_cluster = (arm[1] or kernels._cuda.silu_quant_cluster_for(m, INTER)) if arm[0] == "cuda" else None
            plan = kernels._cuda.silu_quant_plan(INTER, max_cluster, arm[2]) if max_cluster else None
            row = {"pattern": "silu", "quant": form, "M": m, "max_cluster": max_cluster, "cta_vecs": arm[2], "plan": plan,
                   "dynamic_us": time_us(fn, inputs("silu", m)), **code_agreement(fn, m, "silu")}
            rows.append(row)
            print(f"silu   {form:9s} M={m:<5d} uncompiled {row['dynamic_us']:7.2f} us   codes differing "
                  f"{100 * row['codes_differ']:.3f} % (at most {row['max_code_diff']}), scales up to "
                  f"{row['scale_rel_diff']:.1e} apart", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_act_quant.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": HIDDEN, "inter": INTER,
                   "date": datetime.datetime.now().isoformat(timespec="seconds"),
                   "inductor_options": INDUCTOR_OPTIONS, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
