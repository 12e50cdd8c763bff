#!/usr/bin/env python3
"""A quantized layer as vLLM's torch.compile runs it: W4A8 with and without compile_passes.WgmmaActOrder
(--compare order, the default), or W4Ax against W4A8 (--compare w4ax).

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
largest CUDA graph (512 tokens) so, as in a saturated decode of 1000 requests. --input-fused adds
"wgmma_input_fused": input order with Inductor's realize_reads_threshold raised
(MIXPREC_X_WGMMA_ORDER=input_fused, the plugin's default), which keeps a piece's QKV quantizer in
its norm's kernel; --rule adds "wgmma_rule" (MIXPREC_X_WGMMA_ORDER=codes, the default before
session 73: the codes permuted where wgmma_order_pays). --rounds
R times every variant R times, the order reversed every other round (R = 3: an A-B-A of each pair).

--compare w4ax times W4Ax as it is served against W4A8 instead (issue #4's "W4Ax against W4A8,
honestly"): "w4a8" is the natural compile above; "w4ax_kernel" the same function over W4Ax
layers as the plugin compiles them by default (the op before, then the opaque
mixprec::w4ax_linear: the Triton quantize kernel, split as kernels.triton.gemm.w4ax_split_blocks_for
says or at --w4ax-split-blocks, and the Triton GEMM); "w4ax_traced" with MIXPREC_W4AX_QUANT=traced (the
quantizer in torch ops: Inductor compiles the op before, the channel gather, the 4-bit blocks'
rotation and both quantizations into 5-15 kernels, scripts/inductor_kernels.py). Every W4Ax
layer has --w4ax-share of its 128-channel blocks at 8 bits and --w4ax-rotation (the quantizer's
defaults).

  python benchmarks/bench_compiled_linear.py --out DIR [--ms 128 256 1024 4096] [--layers o_proj qkv_70b piece ...]
      [--code] [--vllm-inductor] [--input-fused] [--rule] [--rounds 3]
      [--compare order|w4ax [--w4ax-share 0.25] [--w4ax-rotation hadamard64] [--w4ax-split-blocks R]]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_act_quant as baq  # noqa: E402
from vllm_mixprec import compile_passes, kernels  # noqa: E402
from vllm_mixprec import formats as F  # noqa: E402
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


# Where the benchmark runs, and the W4A8 layers' implementation: the CPU test of main() sets
# "cpu" and "reference" (the timings then mean nothing; the plumbing and the checks run)
DEVICE = "cuda"
IMPL = "cuda"


def layer_of(n: int, k: int, gen: torch.Generator, w4ax: dict | None = None, device: str | None = None,
             impl: str | None = None) -> SimpleNamespace:
    """Random weights of the layer's shape, quantized on the device (the 70B ones are 0.5 G
    values). W4A8 with impl "cuda": packed for the csrc GEMM. w4ax={"share": s, "rotation": r,
    "perm": form}: a W4Ax layer (the Triton GEMM, or impl), its input channels in a random order
    (formats.random_act_perm), round(s * k / 128) blocks at 8 bits."""
    device, impl = device or DEVICE, impl or IMPL
    w = ref.quantize_weight_lqq(torch.randn(n, k, device=device, generator=gen) * 0.02, 128)
    names = ("qweight", "group_scale", "group_offset", "channel_scale")
    if w4ax is None:
        packed = cuda.pack_weights(*(w[name] for name in names)) if impl == "cuda" else {m: w[m] for m in names}
        return SimpleNamespace(**packed, mixprec_impl=impl, mixprec_scheme="w4a8", input_smooth=None)
    return SimpleNamespace(**{m: w[m] for m in names}, mixprec_impl="triton" if impl == "cuda" else impl,
                           mixprec_scheme="w4ax", input_smooth=None,
                           act_perm=F.random_act_perm(k, w4ax["perm"], gen, device),
                           mixprec_k8=F.ACT_BLOCK * round(w4ax["share"] * k / F.ACT_BLOCK),
                           mixprec_act_rotation=w4ax["rotation"])


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
    r = lambda *s: torch.randn(*s, device=DEVICE, dtype=torch.bfloat16)  # noqa: E731
    return {"norm": (r(m, k), r(m, k), r(k)), "none": (r(m, k),),
            "piece": (r(m, k), r(m, k), r(k), r(k))}.get(before, (r(m, 2 * k),))


class MixprecOps:
    """A post-grad pass that changes nothing: it counts the mixprec ops each compile of the
    graph launches (w4ax_gemm after a traced quantizer, w4ax_linear where it stayed opaque)."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def is_applicable_for_range(self, compile_range) -> bool:
        return True

    def uuid(self) -> str:
        return type(self).__name__

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            name = str(node.target) if node.op == "call_function" else ""
            if name.startswith("mixprec."):
                op = name.split(".")[1]
                self.counts[op] = self.counts.get(op, 0) + 1


def compiled(fn, before: str, k: int, passes, code_path: str | None = None, options: dict | None = None,
             modes: dict | None = None):
    """fn compiled as vLLM would; code_path: where to write the code Inductor generated for it;
    options: more Inductor options (vLLM's, --vllm-inductor); modes: the kernels module's
    settings to trace with (_W4AX_QUANT: MIXPREC_W4AX_QUANT), set again before each call, since
    Dynamo traces again after a reset or on a new shape and reads them then."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    options = {**(options or {}), compile_passes.HOOK: compile_passes.MixprecPostGrad(passes),
               "fx_graph_cache": False}
    modes = {"_FUSE_ACT_QUANT": True, **(modes or {})}  # the traced quantizer (the default)

    def set_modes():
        for name, value in modes.items():
            setattr(kernels, name, value)

    set_modes()
    if code_path is None:
        f = baq.compile_dynamic(fn, inputs(before, baq.PROFILE_TOKENS, k), options)
    else:
        f, code = run_and_get_code(baq.compile_dynamic, fn, inputs(before, baq.PROFILE_TOKENS, k), options)
        with open(code_path, "w") as out:
            out.write("\n\n# ---- next module ----\n\n".join(code))

    def call(*args):
        set_modes()
        return f(*args)
    return call


def build(name: str, gen: torch.Generator, w4ax: dict | None = None):
    """(op before, N, K, fn) of a layer or a decoder piece, over W4A8 or (w4ax) W4Ax layers."""
    if name in PIECES:
        hidden, n_qkv, inter = PIECES[name]
        layers = [layer_of(n_, k_, gen, w4ax) for n_, k_ in
                  ((hidden, hidden), (2 * inter, hidden), (hidden, inter), (n_qkv, hidden))]
        return "piece", n_qkv, hidden, piece_fn(*layers)
    before, n, k = CASES[name]
    return before, n, k, layer_fn(before, layer_of(n, k, gen, w4ax))


def order_variants(name: str, gen: torch.Generator, args) -> tuple:
    """The wgmma k order A/B: (op before, N, K, {variant: (fn, passes, modes, Inductor options)},
    extras). --input-fused adds MIXPREC_X_WGMMA_ORDER=input_fused's compile."""
    before, n, k, fn = build(name, gen)
    # the A/B on every shape, the pass's rule aside; the codes permuted, or the quantizer's input
    order = compile_passes.WgmmaActOrder(all_shapes=True)
    input_order = compile_passes.WgmmaActOrder(all_shapes=True, input_order=True)
    variants = {"natural": (fn, [], {}, {}), "wgmma_order": (fn, [order], {}, {}),
                "wgmma_input_order": (fn, [input_order], {}, {})}
    extras = {"wgmma_order": order, "wgmma_input_order": input_order}
    if args.input_fused:
        extras["wgmma_input_fused"] = compile_passes.WgmmaActOrder(all_shapes=True, input_order=True)
        variants["wgmma_input_fused"] = (fn, [extras["wgmma_input_fused"]], {},
                                         {"realize_reads_threshold": compile_passes.INPUT_FUSED_REALIZE_READS})
    if args.rule:  # MIXPREC_X_WGMMA_ORDER=codes, the default before session 73
        # (the codes permuted where wgmma_order_pays)
        extras["wgmma_rule"] = compile_passes.WgmmaActOrder()
        variants["wgmma_rule"] = (fn, [extras["wgmma_rule"]], {}, {})
    return before, n, k, variants, extras


def w4ax_variants(name: str, gen: torch.Generator, args) -> tuple:
    """W4Ax as served against W4A8 (module docstring), each compile with its op counter (the
    extras)."""
    before, n, k, fn = build(name, gen)
    _, _, _, fn_x = build(name, gen, {"share": args.w4ax_share, "rotation": args.w4ax_rotation,
                                      "perm": args.w4ax_perm})
    ops = {v: MixprecOps() for v in ("w4a8", "w4ax_kernel", "w4ax_traced")}
    return before, n, k, {"w4a8": (fn, [ops["w4a8"]], {}, {}),
                          "w4ax_kernel": (fn_x, [ops["w4ax_kernel"]], {"_W4AX_QUANT": "kernel"}, {}),
                          "w4ax_traced": (fn_x, [ops["w4ax_traced"]], {"_W4AX_QUANT": "traced"}, {})}, ops


def order_fields(row: dict, extras, outs: dict) -> str:
    order, input_order = extras["wgmma_order"], extras["wgmma_input_order"]
    same = torch.equal(outs["natural"], outs["wgmma_order"])
    row.update({"rewritten": order.rewritten, "input_rewritten": input_order.rewritten, "equal": same,
                "input_ordered": input_order.input_ordered,
                "input_order_equal": torch.equal(outs["wgmma_order"], outs["wgmma_input_order"]),
                "speedup": row["natural_us"] / row["wgmma_order_us"],
                "input_order_speedup": row["natural_us"] / row["wgmma_input_order_us"],
                "launch_input_over_codes": row["wgmma_order_launch_us"] / row["wgmma_input_order_launch_us"]})
    fused = extras.get("wgmma_input_fused")
    if fused is not None:
        row.update({"fused_rewritten": fused.rewritten, "fused_input_ordered": fused.input_ordered,
                    "input_fused_equal": torch.equal(outs["wgmma_order"], outs["wgmma_input_fused"]),
                    "input_fused_speedup": row["natural_us"] / row["wgmma_input_fused_us"]})
    rule = extras.get("wgmma_rule")
    if rule is not None:
        row.update({"rule_rewritten": rule.rewritten, "rule_speedup": row["natural_us"] / row["wgmma_rule_us"]})
    return (f"x{row['speedup']:.3f} / x{row['input_order_speedup']:.3f}"
            + (f" / x{row['input_fused_speedup']:.3f}" if fused is not None else "")
            + (f" / rule x{row['rule_speedup']:.3f}" if rule is not None else "")
            + f"  equal={same}/{row['input_order_equal']} "
            f"rewritten={order.rewritten}/{input_order.rewritten} input_ordered={input_order.input_ordered}")


def order_bad(row: dict) -> bool:
    """A compile that did not rewrite every GEMM, or (input order) move every quantizer, each
    time it compiled (Dynamo may compile a variant twice: a later variant's reset drops its code),
    or ended further from the eager layer than the natural compile."""
    def all_gemms(n: int) -> bool:
        return n > 0 and n % row["gemms"] == 0
    fused = "fused_rewritten" in row
    return (not all_gemms(row["rewritten"])
            or not (all_gemms(row["input_rewritten"]) and row["input_ordered"] == row["input_rewritten"])
            or (fused and not (all_gemms(row["fused_rewritten"])
                               and row["fused_input_ordered"] == row["fused_rewritten"]))
            or any(row[f"{v}_rel_err_vs_eager"] > min(5e-2, 2 * row["natural_rel_err_vs_eager"] + 1e-4)
                   for v in ("wgmma_order", "wgmma_input_order") + (("wgmma_input_fused",) if fused else ())
                   + (("wgmma_rule",) if "rule_rewritten" in row else ())))


def w4ax_fields(row: dict, ops: dict, outs: dict) -> str:
    row.update({f"{v}_ops": dict(c.counts) for v, c in ops.items()})
    row["w4ax_over_w4a8"] = row["w4ax_kernel_us"] / row["w4a8_us"]
    row["traced_over_kernel"] = row["w4ax_traced_us"] / row["w4ax_kernel_us"]
    return f"W4Ax / W4A8 x{row['w4ax_over_w4a8']:.2f}  traced / kernel x{row['traced_over_kernel']:.2f}"


def w4ax_bad(row: dict) -> bool:
    """The kernel-mode W4Ax compile must launch w4ax_linear only, the traced one w4ax_gemm after
    its traced quantizer only, and each stay within 10 % of its eager layer: the compiled norm
    rounds differently and 4-bit codes move by one (3.4 % on a CPU piece), where a wrong channel
    order or rotation is off by order 1."""
    kernel, traced = row["w4ax_kernel_ops"], row["w4ax_traced_ops"]
    return (not kernel.get("w4ax_linear") or "w4ax_gemm" in kernel
            or not traced.get("w4ax_gemm") or "w4ax_linear" in traced
            or any(row[f"{v}_rel_err_vs_eager"] > 0.1 for v in ("w4a8", "w4ax_kernel", "w4ax_traced")))


def time_rounds(row: dict, fns: dict, x: tuple, rounds: int) -> None:
    """Each variant timed `rounds` times, the order reversed every other round (A-B-C, C-B-A, ...),
    so that a clock or thermal drift over the run reaches every variant alike: {v}_us and
    {v}_launch_us are the medians over the rounds, {v}_us_rounds the rounds' medians, and
    "drift" the largest spread (max / min - 1) of any variant's rounds."""
    names = list(fns)
    replayed = {v: [] for v in names}
    launched = {v: [] for v in names}
    for r in range(rounds):
        for v in (names if r % 2 == 0 else names[::-1]):
            f = fns[v]
            replayed[v].append(baq.time_us(f, x))
            launched[v].append(triton.testing.do_bench(lambda: f(*x), rep=50, return_mode="median") * 1e3)
    for v in names:
        row[f"{v}_us"] = statistics.median(replayed[v])
        row[f"{v}_launch_us"] = statistics.median(launched[v])
        if rounds > 1:
            row[f"{v}_us_rounds"] = replayed[v]
    row["drift"] = max(max(t) / min(t) - 1 for t in replayed.values())


def gpu_ready() -> bool:
    return torch.cuda.is_available() and cuda.has_wgmma()


COMPARE = {"order": (order_variants, order_fields, order_bad),
           "w4ax": (w4ax_variants, w4ax_fields, w4ax_bad)}


def main(argv=None) -> int:
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
    ap.add_argument("--input-fused", action="store_true",
                    help="--compare order: also MIXPREC_X_WGMMA_ORDER=input_fused's compile, the default "
                         "(input order, Inductor's realize_reads_threshold raised; compile_passes.py)")
    ap.add_argument("--rule", action="store_true",
                    help="--compare order: also MIXPREC_X_WGMMA_ORDER=codes's compile (\"wgmma_rule\": the "
                         "codes permuted where compile_passes.wgmma_order_pays)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant this many times, the order reversed every other round "
                         "(A-B-C, C-B-A: 3 for an A-B-A of each pair); medians over the rounds")
    ap.add_argument("--compare", choices=sorted(COMPARE), default="order",
                    help="order: the wgmma k order A/B (default); w4ax: W4Ax served against W4A8")
    ap.add_argument("--w4ax-share", type=float, default=0.25,
                    help="--compare w4ax: the share of each layer's 128-channel blocks at 8 bits")
    ap.add_argument("--w4ax-rotation", choices=F.ACT_ROTATIONS, default="hadamard64",
                    help="--compare w4ax: the 4-bit blocks' rotation (the quantizer's default)")
    ap.add_argument("--w4ax-perm", choices=F.ACT_PERM_FORMS, default="blocks",
                    help="--compare w4ax: the layers' random act_perm, whole 128-channel blocks moved "
                         "(a `quantize --a8-select blocks` checkpoint, the default) or any channel "
                         "anywhere (--a8-select channels)")
    ap.add_argument("--w4ax-split-blocks", type=int, default=None, metavar="R",
                    help="--compare w4ax: the kernel arm's split at every M (0: one program a row; "
                         "a power of two: R blocks a program; default: w4ax_split_blocks_for)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}: expected at least 1")
    if not 0.0 <= args.w4ax_share <= 1.0:
        ap.error(f"--w4ax-share={args.w4ax_share}: expected a share in [0, 1]")
    r = args.w4ax_split_blocks
    if r is not None and (r < 0 or r & (r - 1)):
        ap.error(f"--w4ax-split-blocks={r}: expected 0 or a power of two")
    if r is not None:
        from vllm_mixprec.kernels.triton import gemm as tg
        tg.force_w4ax_split_blocks(r)  # read at each launch
    options = {}
    if args.vllm_inductor:
        from vllm.config import CompilationConfig
        options = dict(CompilationConfig().inductor_compile_config)
        print(f"vLLM's Inductor options: {options}", flush=True)
    code_dir = os.path.join(args.out, "inductor-code")
    if args.code:
        os.makedirs(code_dir, exist_ok=True)
    if not gpu_ready():
        raise SystemExit("bench_compiled_linear needs an sm_90 GPU and a csrc build with sm_90a")
    variants_of, fields, is_bad = COMPARE[args.compare]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for name in args.layers:
        before, n, k, variants, extras = variants_of(name, gen, args)
        code = (lambda v: os.path.join(code_dir, f"{name}_{v}.py") if args.code else None)  # noqa: E731
        fns = {v: compiled(fn, before, k, passes, code(v), {**options, **extra_options}, modes)
               for v, (fn, passes, modes, extra_options) in variants.items()}
        for m in args.ms:
            x = inputs(before, m, k)
            first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
            outs = {v: first(f(*x)).double() for v, f in fns.items()}
            row = {"layer": name, "N": n, "K": k, "M": m, "gemms": 4 if before == "piece" else 1}
            eager = {}  # one eager run per function (the variants of a scheme share one)
            for v, (fn, *_) in variants.items():
                if id(fn) not in eager:
                    eager[id(fn)] = first(fn(*x)).double()
                want = eager[id(fn)]
                row[f"{v}_rel_err_vs_eager"] = float((outs[v] - want).norm() / want.norm())
            time_rounds(row, fns, x, args.rounds)
            summary = fields(row, extras, outs)
            rows.append(row)
            times = "  ".join(f"{v} {row[f'{v}_us']:8.2f} us" for v in fns)
            launched = "  ".join(f"{v} {row[f'{v}_launch_us']:8.2f} us" for v in fns)
            errs = " / ".join(f"{row[f'{v}_rel_err_vs_eager']:.1e}" for v in fns)
            drift = f"  drift {100 * row['drift']:.1f} %" if args.rounds > 1 else ""
            print(f"{name:11s} {n:>6}x{k:<6} M={m:<5d} {times}  {summary}  rel. err vs eager {errs}{drift}",
                  flush=True)
            print(f"{'':11s} launched, not replayed: {launched}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    out_name = "bench_compiled_linear.json" if args.compare == "order" else f"bench_compiled_{args.compare}.json"
    with open(os.path.join(args.out, out_name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__, "inductor_options": options,
                   "compare": args.compare, "args": vars(args),
                   "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": rows}, f, indent=1)
    # a wrong permutation or GEMM reads scrambled k: errors of order 1, not a rounding's 1e-3
    bad = [r for r in rows if is_bad(r)]
    if bad:
        print(f"FAILED: {len(bad)} rows not compiled as expected, or further from the eager layer", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
