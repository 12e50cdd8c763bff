#!/usr/bin/env python3
"""A W4A8 layer as vLLM's torch.compile runs it, with and without compile_passes.WgmmaActOrder.

Each case is the op before the layer (vLLM's fused_add_rms_norm, or SiLU-and-mul for the down
projection) + kernels.apply_linear on prepared csrc weights: Inductor fuses the traced activation
quantizer into that op, then the csrc GEMM runs (on an sm_90 GPU past 64 tokens, a wgmma kernel).
"natural" compiles it with an empty plugin hook; "wgmma_order" with WgmmaActOrder on every shape
(all_shapes: the A/B behind its wgmma_order_pays rule), which makes the fused quantizer write the
wgmma k order and the GEMM copy it by TMA; "wgmma_input_order" the same with input_order (the
quantizer permutes its input, not its codes: the same codes, compiled differently). All are
compiled the way vLLM compiles the model (dynamic batch dimension, first call at 8192 tokens) and
timed in the same run: medians of CUDA-graph replays (do_bench_cudagraph), one weight copy (it stays in the L2 on
the smaller layers: the A/B is like for like, not the issue #4 table's method). Each output is
compared with the eager layer's (relative error): the compiles may fuse the op before
differently, and Inductor may then skip a bf16 rounding in one of them (a few codes move by one),
so they are not required to be bit-identical to each other.

A "piece" is what vLLM compiles between two attentions of a Llama decoder: o_proj, add + RMSNorm,
gate_up, SiLU-and-mul, down, add + RMSNorm, QKV (four GEMMs, three fused quantizers and one
standalone). --vllm-inductor compiles with vLLM's own Inductor options (combo kernels among them),
and every row is also timed launched, not replayed ("launch_us"): vLLM runs batches past its
largest CUDA graph (512 tokens) so, as in a saturated decode of 1000 requests.

  python benchmarks/bench_compiled_linear.py --out DIR [--ms 128 256 1024 4096] [--layers o_proj qkv_70b piece ...]
      [--code] [--vllm-inductor]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_act_quant as baq  # noqa: E402
from vllm_mixprec import compile_passes, kernels  # noqa: E402
from vllm_mixprec import reference as ref  # noqa: E402
from vllm_mixprec.kernels import cuda  # noqa: E402

# (name, the op before the layer, N, K): Llama-3-8B's QKV and gate_up after RMSNorm, down after
# SiLU-and-mul, o_proj after the attention (nothing to fuse into: "none"); then Llama-3-70B's.
CASES = {"qkv": ("norm", 6144, 4096), "gate_up": ("norm", 28672, 4096), "down": ("silu", 4096, 14336),
         "o_proj": ("none", 4096, 4096), "qkv_70b": ("norm", 10240, 8192), "gate_up_70b": ("norm", 57344, 8192),
         "down_70b": ("silu", 8192, 28672), "o_proj_70b": ("none", 8192, 8192)}
MEASURED = ("qkv", "gate_up", "down")  # session 63's run
# Llama decoder pieces (module docstring): hidden size, QKV's N, intermediate size
PIECES = {"piece": (4096, 6144, 14336), "piece_70b": (8192, 10240, 28672)}


def layer_of(n: int, k: int, gen: torch.Generator) -> SimpleNamespace:
    """Random weights of the layer's shape, quantized on the GPU (the 70B ones are 0.5 G values)."""
    w = ref.quantize_weight_lqq(torch.randn(n, k, device="cuda", generator=gen) * 0.02, 128)
    packed = cuda.pack_weights(*(w[name] for name in ("qweight", "group_scale", "group_offset", "channel_scale")))
    return SimpleNamespace(**packed, mixprec_impl="cuda", mixprec_scheme="w4a8", input_smooth=None)


def layer_fn(before: str, layer):
    if before == "norm":
        def f(x, res, w):
            y, r = baq.add_rms_norm(x, res, w)
            return kernels.apply_linear(layer, y, None), r
    elif before == "none":
        def f(x):
            return kernels.apply_linear(layer, x, None)
    else:
        def f(gu):
            return kernels.apply_linear(layer, baq.silu_and_mul(gu), None)
    return f


def piece_fn(o_proj, gate_up, down, qkv, add_rms_norm=baq.add_rms_norm):
    """Between two attentions of a Llama decoder (vLLM's piecewise graph): attention output and
    residual in, the next layer's QKV and residual out."""
    def f(attn, res, w_post, w_in):
        y, r = add_rms_norm(kernels.apply_linear(o_proj, attn, None), res, w_post)
        d = kernels.apply_linear(down, baq.silu_and_mul(kernels.apply_linear(gate_up, y, None)), None)
        y, r = add_rms_norm(d, r, w_in)
        return kernels.apply_linear(qkv, y, None), r
    return f


def inputs(before: str, m: int, k: int):
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return {"norm": (r(m, k), r(m, k), r(k)), "none": (r(m, k),),
            "piece": (r(m, k), r(m, k), r(k), r(k))}.get(before, (r(m, 2 * k),))


def compiled(fn, before: str, k: int, passes, code_path: str | None = None, options: dict | None = None):
    """fn compiled as vLLM would; code_path: where to write the code Inductor generated for it;
    options: more Inductor options (vLLM's, --vllm-inductor)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    options = {**(options or {}), compile_passes.HOOK: compile_passes.MixprecPostGrad(passes),
               "fx_graph_cache": False}
    if code_path is None:
        return baq.compile_dynamic(fn, inputs(before, baq.PROFILE_TOKENS, k), options)
    f, code = run_and_get_code(baq.compile_dynamic, fn, inputs(before, baq.PROFILE_TOKENS, k), options)
    with open(code_path, "w") as out:
        out.write("\n\n# ---- next module ----\n\n".join(code))
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--ms", type=int, nargs="+", default=[128, 256, 1024, 4096])
    ap.add_argument("--layers", nargs="+", default=list(MEASURED), choices=[*CASES, *PIECES],
                    help=f"which layers (default: {' '.join(MEASURED)}; also o_proj, the 70B ones and "
                         "the decoder pieces)")
    ap.add_argument("--code", action="store_true",
                    help="write the Triton code Inductor generated for each compile to OUT/inductor-code/")
    ap.add_argument("--vllm-inductor", action="store_true",
                    help="compile with vLLM's Inductor options (CompilationConfig's defaults on this GPU)")
    args = ap.parse_args()
    options = {}
    if args.vllm_inductor:
        from vllm.config import CompilationConfig
        options = dict(CompilationConfig().inductor_compile_config)
        print(f"vLLM's Inductor options: {options}", flush=True)
    code_dir = os.path.join(args.out, "inductor-code")
    if args.code:
        os.makedirs(code_dir, exist_ok=True)
    if not (torch.cuda.is_available() and cuda.has_wgmma()):
        raise SystemExit("bench_compiled_linear needs an sm_90 GPU and a csrc build with sm_90a")
    kernels._FUSE_ACT_QUANT = True  # the traced quantizer (the plugin's default under compile)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.layers:
        if name in PIECES:
            hidden, n_qkv, inter = PIECES[name]
            before, n, k = "piece", n_qkv, hidden
            fn = piece_fn(*(layer_of(n_, k_, gen) for n_, k_ in
                            ((hidden, hidden), (2 * inter, hidden), (hidden, inter), (n_qkv, hidden))))
        else:
            before, n, k = CASES[name]
            fn = layer_fn(before, layer_of(n, k, gen))
        # the A/B on every shape, the pass's rule aside; the codes permuted, or the quantizer's input
        order = compile_passes.WgmmaActOrder(all_shapes=True)
        input_order = compile_passes.WgmmaActOrder(all_shapes=True, input_order=True)
        code = (lambda v: os.path.join(code_dir, f"{name}_{v}.py") if args.code else None)  # noqa: E731
        fns = {v: compiled(fn, before, k, passes, code(v), options)
               for v, passes in (("natural", []), ("wgmma_order", [order]), ("wgmma_input_order", [input_order]))}
        for m in args.ms:
            x = inputs(before, m, k)
            first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
            eager = first(fn(*x)).double()
            outs = {v: first(f(*x)).double() for v, f in fns.items()}
            same = torch.equal(outs["natural"], outs["wgmma_order"])
            row = {"layer": name, "N": n, "K": k, "M": m, "gemms": 4 if before == "piece" else 1,
                   "rewritten": order.rewritten, "input_rewritten": input_order.rewritten, "equal": same,
                   "input_ordered": input_order.input_ordered,
                   "input_order_equal": torch.equal(outs["wgmma_order"], outs["wgmma_input_order"])}
            for v, y in outs.items():
                row[f"{v}_rel_err_vs_eager"] = float((y - eager).norm() / eager.norm())
            for v, f in fns.items():
                row[f"{v}_us"] = baq.time_us(f, x)
                row[f"{v}_launch_us"] = triton.testing.do_bench(lambda: f(*x), rep=50, return_mode="median") * 1e3
            row["speedup"] = row["natural_us"] / row["wgmma_order_us"]
            row["input_order_speedup"] = row["natural_us"] / row["wgmma_input_order_us"]
            row["launch_input_over_codes"] = row["wgmma_order_launch_us"] / row["wgmma_input_order_launch_us"]
            rows.append(row)
            print(f"{name:11s} {n:>6}x{k:<6} M={m:<5d} natural {row['natural_us']:8.2f} us  wgmma order "
                  f"{row['wgmma_order_us']:8.2f} us x{row['speedup']:.3f}  input order "
                  f"{row['wgmma_input_order_us']:8.2f} us x{row['input_order_speedup']:.3f}  equal={same}/"
                  f"{row['input_order_equal']} rel. err vs eager {row['natural_rel_err_vs_eager']:.1e} / "
                  f"{row['wgmma_order_rel_err_vs_eager']:.1e} / {row['wgmma_input_order_rel_err_vs_eager']:.1e} "
                  f"rewritten={order.rewritten}/{input_order.rewritten} input_ordered={input_order.input_ordered}",
                  flush=True)
            print(f"{'':11s} launched, not replayed: natural {row['natural_launch_us']:8.2f} us  wgmma order "
                  f"{row['wgmma_order_launch_us']:8.2f} us  input order {row['wgmma_input_order_launch_us']:8.2f} us "
                  f"(input / codes x{row['launch_input_over_codes']:.3f})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_compiled_linear.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "inductor_options": options,
                   "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": rows}, f, indent=1)
    # a wrong permutation or GEMM reads scrambled k: errors of order 1, not a rounding's 1e-3
    # every GEMM rewritten, every quantizer moved (once per compile: Dynamo may compile twice)
    bad = [r for r in rows if not (r["rewritten"] and r["rewritten"] % r["gemms"] == 0
                                   and r["input_ordered"] == r["input_rewritten"] == r["rewritten"])
           or any(r[f"{v}_rel_err_vs_eager"] > min(5e-2, 2 * r["natural_rel_err_vs_eager"] + 1e-4)
                  for v in ("wgmma_order", "wgmma_input_order"))]
    if bad:
        print(f"FAILED: {len(bad)} rows not rewritten or further from the eager layer", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
