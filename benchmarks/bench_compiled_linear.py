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

--compare marlin times decode as served against Marlin (issue #4's M <= 16 target as a served
layer pays it): W4A8 compiled as the plugin compiles batches of at most 64 tokens (the quantizer
fused into the op before, its own kernel before o_proj) against the same function over Marlin W4A16
layers of the same float weights (vLLM's gptq_marlin path, bf16). Use it on the decoder pieces or
layers whose weights outgrow the L2: the replays do not flush it. --silu-op adds W4A8 with
MIXPREC_FUSE_SILU_QUANT=1's pass (opt-in). --decode-ops adds W4A8 with MIXPREC_DECODE_QUANT_OPS=1's
pass (compile_passes.DecodeQuantOps, the default since session 83: the quantizers as ops launched
for their batch, the ones after RMSNorm fused with it), over vLLM's IR norm as the served graph has
it; with --silu-op, also both passes. The "mixprec" arm is then MIXPREC_DECODE_QUANT_OPS=0
(Inductor's fused quantizers, the default before); "mixprec_decode_ops_triton_norm" is the
default with the norm op's Triton kernel in place of its csrc one (session 84);
"mixprec_decode_ops_silu_op" the default with MIXPREC_DECODE_SILU_OP=1 (the SiLU-and-mul and its
quantizer as one op, csrc where built; session 85) and "mixprec_decode_ops_triton_silu" that with
the SiLU op's Triton kernel (the two Triton arms with --triton-ops); --launch-arms OPTION=VALUE[,...] adds
the default with csrc launch options changed while its graphs are captured
("mixprec_decode_ops_decode_preload_max_m0": what the decode GEMM's weight preload hides in the
piece; its launched time pays two more host calls), and --launch-arms-silu-op each of those with the
SiLU op too ("mixprec_decode_ops_silu_op_quant_ops_pdl1"). --profile CALLS
adds every variant's kernels under the torch profiler: their device time a call, the GEMMs and the
ops between them summed.

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
      [--compare order|w4ax|marlin [--w4ax-share 0.25] [--w4ax-rotation hadamard64] [--w4ax-split-blocks R]]
      [--silu-op] [--decode-ops [--triton-ops] [--launch-arms OPTION=VALUE[,...] ...]] [--profile CALLS]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import types
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


def random_weight(n: int, k: int, gen: torch.Generator, device: str | None = None) -> torch.Tensor:
    """A layer's float weight [N, K] before quantization."""
    return torch.randn(n, k, device=device or DEVICE, generator=gen) * 0.02


def layer_of(n: int, k: int, gen: torch.Generator, w4ax: dict | None = None, device: str | None = None,
             impl: str | None = None, weight: torch.Tensor | None = None) -> SimpleNamespace:
    """Random weights of the layer's shape (or `weight`), quantized on the device (the 70B ones
    are 0.5 G values). W4A8 with impl "cuda": packed for the csrc GEMM. w4ax={"share": s,
    "rotation": r, "perm": form}: a W4Ax layer (the Triton GEMM, or impl), its input channels in a
    random order (formats.random_act_perm), round(s * k / 128) blocks at 8 bits."""
    device, impl = device or DEVICE, impl or IMPL
    w = ref.quantize_weight_lqq(random_weight(n, k, gen, device) if weight is None else weight, 128)
    names = ("qweight", "group_scale", "group_offset", "channel_scale")
    if w4ax is None:
        packed = cuda.pack_weights(*(w[name] for name in names)) if impl == "cuda" else {m: w[m] for m in names}
        return SimpleNamespace(**packed, mixprec_impl=impl, mixprec_scheme="w4a8", input_smooth=None)
    return SimpleNamespace(**{m: w[m] for m in names}, mixprec_impl="triton" if impl == "cuda" else impl,
                           mixprec_scheme="w4ax", input_smooth=None,
                           act_perm=F.random_act_perm(k, w4ax["perm"], gen, device),
                           mixprec_k8=F.ACT_BLOCK * round(w4ax["share"] * k / F.ACT_BLOCK),
                           mixprec_act_rotation=w4ax["rotation"])


def marlin_layer_of(weight: torch.Tensor) -> SimpleNamespace:
    """Marlin W4A16 of a float weight [N, K] (uint4b8, group 128, no act order: a GPTQ checkpoint
    as vLLM's gptq_marlin serves it, bf16 activations). w_ref is Marlin's own dequantized weight
    [K, N]; on the CPU marlin_apply multiplies by it (the plumbing runs, the times mean nothing)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
    from vllm.scalar_type import scalar_types

    n, k = weight.shape
    w_ref, q_w, s, g_idx, sort_idx, _ = marlin_quantize(weight.t().to(torch.bfloat16).contiguous(),
                                                        scalar_types.uint4b8, 128, False)
    layer = SimpleNamespace(n=n, k=k, w_ref=w_ref, q_w=None)
    if weight.is_cuda:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_make_empty_g_idx, marlin_make_workspace_new)
        layer.__dict__.update(q_w=q_w, s=s, g_idx=g_idx, sort_idx=sort_idx, zp=marlin_make_empty_g_idx(weight.device),
                              workspace=marlin_make_workspace_new(weight.device), w_ref=None)
    return layer


def marlin_apply(layer: SimpleNamespace, x: torch.Tensor, bias=None) -> torch.Tensor:
    """kernels.apply_linear's signature over a marlin_layer_of layer."""
    if layer.q_w is None:
        return x @ layer.w_ref + (0 if bias is None else bias)
    from vllm.model_executor.layers.quantization.utils.marlin_utils import apply_gptq_marlin_linear
    from vllm.scalar_type import scalar_types
    return apply_gptq_marlin_linear(x, layer.q_w, layer.s, layer.zp, layer.g_idx, layer.sort_idx, layer.workspace,
                                    scalar_types.uint4b8, layer.n, layer.k, is_k_full=True, bias=bias)


def layer_fn(before: str, layer, apply=None, add_rms_norm=baq.add_rms_norm):
    """The op before (module docstring) and the layer, through apply (kernels.apply_linear's
    signature; the default is it)."""
    apply = apply or kernels.apply_linear
    if before == "norm":
        def f(x, res, w):
            y, r = add_rms_norm(x, res, w)
            return apply(layer, y, None), r
    elif before == "none":
        def f(x):
            return apply(layer, x, None)
    else:
        def f(gu):
            return apply(layer, baq.silu_and_mul(gu), None)
    return f


def piece_fn(o_proj, gate_up, down, qkv, add_rms_norm=baq.add_rms_norm, apply=None):
    """Between two attentions of a Llama decoder (vLLM's piecewise graph): attention output and
    residual in, the next layer's QKV and residual out. apply: as in layer_fn; add_rms_norm: the
    norm's form (native torch, or vLLM's IR op: ir_add_rms_norm)."""
    apply = apply or kernels.apply_linear

    def f(attn, res, w_post, w_in):
        y, r = add_rms_norm(apply(o_proj, attn, None), res, w_post)
        d = apply(down, baq.silu_and_mul(apply(gate_up, y, None)), None)
        y, r = add_rms_norm(d, r, w_in)
        return apply(qkv, y, None), r
    return f


def ir_add_rms_norm(x, res, w):
    """vLLM's IR op, as the plugin's post-grad hook sees RMSNorm in vLLM 0.26 (vLLM lowers it to
    the native form after the hook; compile_passes.DecodeQuantOps matches it there)."""
    import vllm.ir.ops as ir_ops
    return ir_ops.fused_add_rms_norm(x, res, w, baq.EPS)


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


def own_code(fn, tag: str):
    """fn with a code object of its own. Dynamo keeps compiled code per code object: variants of
    one function (other passes or options) would share a cache. Until session 82 a reset before
    each compile kept them apart, and dropped the earlier variants' code, which Dynamo then
    compiled again at the first timed M, with that M as Inductor's size hint where vLLM's is
    8192 (the profiling run)."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compiled(fn, before: str, k: int, passes, code_path: str | None = None, options: dict | None = None,
             modes: dict | None = None, tag: str = "variant"):
    """fn compiled as vLLM would, as own_code(fn, tag); code_path: where to write the code
    Inductor generated for it; options: more Inductor options (vLLM's, --vllm-inductor); modes:
    the kernels module's settings to trace with (_W4AX_QUANT: MIXPREC_W4AX_QUANT), set again
    before each call, since Dynamo traces again on a new shape (M = 1 is specialized) and reads
    them then."""
    from torch._inductor.utils import run_and_get_code

    fn = own_code(fn, tag)
    options = {**(options or {}), compile_passes.HOOK: compile_passes.MixprecPostGrad(passes),
               "fx_graph_cache": False}
    # the traced quantizer, and the csrc norm op where built (the defaults)
    modes = {"_FUSE_ACT_QUANT": True, "_NORM_QUANT_CUDA": True, "_SILU_QUANT_CUDA": True, "_SILU_QUANT_PLAN": None,
             **(modes or {})}

    launch = modes.pop("launch_options", None)  # csrc launch options: a CUDA graph keeps those it was captured with

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
        if not launch:
            return f(*args)
        before = cuda.set_launch_options()  # it returns the options after the call: read them first
        cuda.set_launch_options(**launch)
        try:
            return f(*args)
        finally:
            cuda.set_launch_options(**{name: before[name] for name in launch})
    return call


def build(name: str, gen: torch.Generator, w4ax: dict | None = None, marlin: bool = False):
    """(op before, N, K, fn) of a layer or a decoder piece, over W4A8 or (w4ax) W4Ax layers;
    marlin: and fn over Marlin W4A16 layers of the same float weights, then fn over the same W4A8
    layers with vLLM's IR norm (ir_add_rms_norm), as a fifth and sixth item."""
    if name in PIECES:
        hidden, n_qkv, inter = PIECES[name]
        shapes = ((hidden, hidden), (2 * inter, hidden), (hidden, inter), (n_qkv, hidden))
        before, n, k = "piece", n_qkv, hidden
    else:
        before, n, k = CASES[name]
        shapes = ((n, k),)
    weights = [random_weight(n_, k_, gen) for n_, k_ in shapes]
    layers = [layer_of(n_, k_, gen, w4ax, weight=w) for (n_, k_), w in zip(shapes, weights)]
    def make(ls, apply=None, add_rms_norm=baq.add_rms_norm):
        return (piece_fn(*ls, add_rms_norm, apply) if before == "piece"
                else layer_fn(before, ls[0], apply, add_rms_norm))

    if not marlin:
        return before, n, k, make(layers)
    return (before, n, k, make(layers), make([marlin_layer_of(w) for w in weights], marlin_apply),
            make(layers, add_rms_norm=ir_add_rms_norm))


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


# The largest batch --compare marlin times: the served graphs up to it are compiled without the
# wgmma order pass (compile_passes.WGMMA_ORDER_AFTER_TOKENS, its compile range), as the arm is.
MARLIN_MAX_TOKENS = compile_passes.WGMMA_ORDER_AFTER_TOKENS


def marlin_variants(name: str, gen: torch.Generator, args) -> tuple:
    """Decode as served against Marlin W4A16 (--compare marlin): "mixprec" is the W4A8 layer or
    piece compiled as the plugin compiled batches of at most MARLIN_MAX_TOKENS until session 83
    (no pass of its own in that range: MIXPREC_DECODE_QUANT_OPS=0; Inductor's
    realize_reads_threshold as compile_passes.install sets it for every range), "marlin_w4a16" the
    same function over Marlin layers of the same float weights (marlin_layer_of), compiled with no
    plugin option; --decode-ops adds the default since session 83 (module docstring)."""
    before, n, k, fn, fn_marlin, fn_ir = build(name, gen, marlin=True)
    # the Inductor options compile_passes.install gives vLLM's config, its hook aside
    config = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=None)
    compile_passes.install(config)
    served = {key: v for key, v in config.inductor_compile_config.items() if key != compile_passes.HOOK}
    variants = {"mixprec": (fn, [], {}, served), "marlin_w4a16": (fn_marlin, [], {}, {})}
    extras = {"served": served, "has_silu": before in ("silu", "piece")}
    if args.silu_op:  # MIXPREC_FUSE_SILU_QUANT=1, opt-in: its pass in the graphs of <= 32 tokens
        extras["silu_op"] = compile_passes.SiluMulQuantFusion()
        variants["mixprec_silu_op"] = (fn, [extras["silu_op"]], {}, served)
    if args.decode_ops:  # MIXPREC_DECODE_QUANT_OPS=1, over the IR norm the pass matches when served
        norms = {"piece": 2, "norm": 1}.get(before, 0)
        quantizers = 4 if before == "piece" else 1
        silus = int(extras["has_silu"])
        # arm: (passes before it, DecodeQuantOps' silu, its (quantizers, norms, silus), kernel modes)
        arms = {"mixprec_decode_ops": ([], False, (quantizers, norms, 0), {})}
        if silus:  # MIXPREC_DECODE_SILU_OP=1 (opt-in): the SiLU-and-mul and its quantizer as one op
            arms["mixprec_decode_ops_silu_op"] = ([], True, (quantizers, norms, silus), {})
        # --triton-ops: the SiLU and norm ops' Triton kernels in place of the csrc ones (the same where not built)
        if silus and args.triton_ops:
            arms["mixprec_decode_ops_triton_silu"] = ([], True, (quantizers, norms, silus), {"_SILU_QUANT_CUDA": False})
        for max_cluster, cta_vecs in (args.silu_plans if silus else ()):  # the csrc SiLU op's other plans
            arms[f"mixprec_decode_ops_silu_op_c{max_cluster}v{cta_vecs}"] = (
                [], True, (quantizers, norms, silus), {"_SILU_QUANT_PLAN": (max_cluster, cta_vecs)})
        for launch in args.launch_arms:  # the default (and the SiLU op) with csrc launch options changed
            name = "_".join(f"{option}{value}" for option, value in launch.items())
            arms[f"mixprec_decode_ops_{name}"] = ([], False, (quantizers, norms, 0), {"launch_options": launch})
            if silus and args.launch_arms_silu_op:
                arms[f"mixprec_decode_ops_silu_op_{name}"] = ([], True, (quantizers, norms, silus),
                                                              {"launch_options": launch})
        if norms and args.triton_ops:
            arms["mixprec_decode_ops_triton_norm"] = ([], False, (quantizers, norms, 0), {"_NORM_QUANT_CUDA": False})
        if args.silu_op:  # both passes, as install() orders them: SiluMulQuantFusion takes the SiLU's quantizer
            arms["mixprec_decode_ops_silu"] = ([compile_passes.SiluMulQuantFusion()], False,
                                               (quantizers - silus, norms, 0), {})
        extras["decode_ops"], extras["decode_ops_expected"] = {}, {}
        for v, (before_ops, silu, expected, modes) in arms.items():
            ops = extras["decode_ops"][v] = compile_passes.DecodeQuantOps(silu=silu)
            extras["decode_ops_expected"][v] = expected
            variants[v] = (fn_ir, [*before_ops, ops], modes, served)
    return before, n, k, variants, extras


def marlin_fields(row: dict, extras: dict, outs: dict) -> str:
    want = outs["marlin_w4a16"]
    row.update({"served_inductor_options": extras["served"],
                "marlin_over_mixprec": row["marlin_w4a16_us"] / row["mixprec_us"],
                "marlin_over_mixprec_launched": row["marlin_w4a16_launch_us"] / row["mixprec_launch_us"],
                "mixprec_rel_err_vs_marlin": float((outs["mixprec"] - want).norm() / want.norm())})
    text = (f"Marlin / mixprec x{row['marlin_over_mixprec']:.3f} (launched x{row['marlin_over_mixprec_launched']:.3f})"
            f"  mixprec vs Marlin rel. err {row['mixprec_rel_err_vs_marlin']:.3f}")
    if "mixprec_silu_op" in outs:
        row["marlin_over_mixprec_silu_op"] = row["marlin_w4a16_us"] / row["mixprec_silu_op_us"]
        row.update({"silu_op_matched": extras["silu_op"].matched, "silu_op_expected": extras["has_silu"]})
        text += (f"  Marlin / mixprec with the SiLU op x{row['marlin_over_mixprec_silu_op']:.3f}"
                 f" (replaced {row['silu_op_matched']})")
    for v, ops in extras.get("decode_ops", {}).items():
        row[f"marlin_over_{v}"] = row["marlin_w4a16_us"] / row[f"{v}_us"]
        row[f"{v}_replaced"] = list(ops.last)  # (quantizers, of them with their norm, with their SiLU) in the last graph
        row[f"{v}_expected"] = list(extras["decode_ops_expected"][v])
        text += f"  Marlin / {v} x{row[f'marlin_over_{v}']:.3f} (replaced {ops.last})"
    return text


# Two 4-bit quantizations of one float weight differ by ~15 % of a layer's output (LQQ against
# uint4b8, each step about 1/16 of a group's range); through a Llama piece 0.30-0.35 (H100, session
# 82). A wrong layout or scale in either arm makes the outputs unrelated (relative difference ~1.4).
MARLIN_AGREEMENT = 0.5


def marlin_bad(row: dict) -> bool:
    """An arm further than 5 % from its eager function (the compiled norm rounds differently), the
    two arms' outputs further apart than MARLIN_AGREEMENT, a SiLU-op arm whose pass replaced
    nothing where there is a SiLU-and-mul (or something where there is none), or a decode-ops arm
    whose last graph had other quantizers or norms replaced than the layer or piece has."""
    decode_arms = [key.removesuffix("_replaced") for key in row if key.endswith("_replaced")]
    return (any(value > 0.05 for key, value in row.items() if key.endswith("_rel_err_vs_eager"))
            or not row["mixprec_rel_err_vs_marlin"] < MARLIN_AGREEMENT
            or ("silu_op_matched" in row and (row["silu_op_matched"] > 0) != row["silu_op_expected"])
            or any(row[f"{v}_replaced"] != row[f"{v}_expected"] for v in decode_arms))


# Kernels that are a layer's GEMM (ours: the csrc w4a8_*_kernel; Marlin's: marlin::Marlin<...>; on
# the CPU, the ops); the rest are the ops between them (norms, SiLU-and-mul, the quantizers,
# copies). Inductor's kernel names carry the GEMM nodes they were fused next to
# ("triton_red_fused_..._w4a8_gemm_where_5"), so the name must start with the C++ kernel's.
GEMM_KERNEL = re.compile(r"^void (mixprec::.*w4a8_\w*kernel|marlin::Marlin)|^mixprec::w4a8_gemm$")


def kernel_times(fn, x: tuple, calls: int) -> dict:
    """Per kernel name, its device time a call (µs) over `calls` launches of fn under the torch
    profiler (launched, not replayed: no PDL overlap, so each kernel's own time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = DEVICE == "cuda"
    fn(*x)
    if on_gpu:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn(*x)
        if on_gpu:
            torch.cuda.synchronize()
    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    times = {}
    for e in prof.key_averages():
        if e.device_type == kind:
            us = e.self_device_time_total if on_gpu else e.self_cpu_time_total
            times[e.key] = times.get(e.key, 0.0) + us / calls
    return times


def split_kernels(times: dict) -> tuple[float, float]:
    """kernel_times' sum over the GEMMs (GEMM_KERNEL) and over the rest."""
    gemm = sum(t for name, t in times.items() if GEMM_KERNEL.search(name))
    return gemm, sum(times.values()) - gemm


def profile_fields(row: dict, fns: dict, x: tuple, calls: int) -> str:
    """{v}_kernels_us (kernel_times), {v}_gemm_kernels_us and {v}_other_kernels_us (split_kernels)."""
    parts = []
    for v, f in fns.items():
        times = kernel_times(f, x, calls)
        gemm, other = split_kernels(times)
        row.update({f"{v}_kernels_us": times, f"{v}_gemm_kernels_us": gemm, f"{v}_other_kernels_us": other})
        parts.append(f"{v} GEMMs {gemm:.1f} + other {other:.1f} us")
    return "kernels a call: " + "; ".join(parts)


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
    time it compiled (Dynamo compiles a variant again for M = 1, and before session 82 after a
    later variant's reset: own_code), or ended further from the eager layer than the natural compile."""
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
           "w4ax": (w4ax_variants, w4ax_fields, w4ax_bad),
           "marlin": (marlin_variants, marlin_fields, marlin_bad)}


def silu_plan(v: str) -> tuple[int, int]:
    """--silu-plans' values, N/V: (max_cluster, cta_vecs) of the csrc silu_mul_quantize_act."""
    n, _, vecs = v.partition("/")
    if n.isdigit() and vecs.isdigit() and cuda.silu_quant_args_ok(int(n), int(vecs)):
        return int(n), int(vecs)
    raise argparse.ArgumentTypeError(
        f"{v!r}: expected N/V, N = 1 to {cuda.SILU_QUANT_MAX_CLUSTER} CTAs a row and V = 1 to "
        f"{cuda.SILU_QUANT_MAX_CTA_VECS} vectors a CTA")


def launch_arm(v: str) -> dict[str, int]:
    """--launch-arms' values, OPTION=VALUE[,OPTION=VALUE...]: options of kernels.cuda.ENV_LAUNCH_OPTIONS
    and values their variables allow."""
    allowed = {name: values for _, name, values in cuda.ENV_LAUNCH_OPTIONS}
    arm = {}
    for item in v.split(","):
        option, _, value = item.partition("=")
        if option not in allowed:
            raise argparse.ArgumentTypeError(f"{v!r}: expected OPTION=VALUE[,OPTION=VALUE...], OPTION one of "
                                             f"{', '.join(allowed)}")
        arm[option] = cuda.launch_option_value(value, allowed[option])
        if arm[option] is None:
            raise argparse.ArgumentTypeError(f"{v!r}: {option} takes {cuda.allowed_text(allowed[option])}")
    return arm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--ms", type=int, nargs="+", default=None,
                    help="batch sizes (default: 128 256 1024 4096; with --compare marlin 1 2 4 8 16 32 64)")
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
                    help="order: the wgmma k order A/B (default); w4ax: W4Ax served against W4A8; "
                         f"marlin: W4A8 as served at up to {MARLIN_MAX_TOKENS} tokens against Marlin W4A16")
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
    ap.add_argument("--silu-op", action="store_true",
                    help="--compare marlin: also mixprec with MIXPREC_FUSE_SILU_QUANT=1's pass "
                         "(mixprec::silu_mul_quantize_act before the down projection; opt-in)")
    ap.add_argument("--decode-ops", action="store_true",
                    help="--compare marlin: also mixprec with MIXPREC_DECODE_QUANT_OPS=1's pass "
                         "(mixprec::quantize_act and mixprec::add_rms_norm_quantize_act; with --silu-op "
                         "also both passes), over vLLM's IR norm as served")
    ap.add_argument("--triton-ops", action="store_true",
                    help="with --decode-ops: also the arms whose norm op and SiLU op take their Triton "
                         "kernels in place of the csrc ones")
    ap.add_argument("--silu-plans", type=silu_plan, nargs="+", default=[], metavar="N/V",
                    help="with --decode-ops: also the SiLU op's csrc kernel with a row over at most N CTAs "
                         "of about V vectors of 8 outputs each (mixprec_decode_ops_silu_op_cNvV arms)")
    ap.add_argument("--launch-arms", type=launch_arm, nargs="+", default=[], metavar="OPTION=VALUE[,...]",
                    help="with --decode-ops: also the default with csrc launch options changed while "
                         "its graphs are captured (mixprec_decode_ops_OPTIONVALUE arms), e.g. "
                         "decode_preload_max_m=0 or gemm_pdl=0,decode_dp4a=0")
    ap.add_argument("--launch-arms-silu-op", action="store_true",
                    help="with --launch-arms: each also with the SiLU op, where the layers have a "
                         "SiLU-and-mul (mixprec_decode_ops_silu_op_OPTIONVALUE arms)")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="also each variant's kernels under the torch profiler over CALLS launches: "
                         "device time a call per kernel, GEMMs and the rest summed")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}: expected at least 1")
    if args.ms is None:
        args.ms = [1, 2, 4, 8, 16, 32, 64] if args.compare == "marlin" else [128, 256, 1024, 4096]
    for flag in ("silu_op", "decode_ops"):
        if getattr(args, flag) and args.compare != "marlin":
            ap.error(f"--{flag.replace('_', '-')}: only with --compare marlin")
    for flag in ("triton_ops", "silu_plans", "launch_arms"):
        if getattr(args, flag) and not args.decode_ops:
            ap.error(f"--{flag.replace('_', '-')}: only with --decode-ops")
    if args.launch_arms_silu_op and not args.launch_arms:
        ap.error("--launch-arms-silu-op: only with --launch-arms")
    if args.silu_op and max(args.ms) > compile_passes.FUSE_MAX_TOKENS:
        ap.error(f"--ms {max(args.ms)} with --silu-op: expected at most {compile_passes.FUSE_MAX_TOKENS} tokens "
                 "(the pass is served in the graphs of at most that many)")
    if args.profile < 0:
        ap.error(f"--profile={args.profile}: expected a number of calls, 0 for none")
    if args.compare == "marlin" and max(args.ms) > MARLIN_MAX_TOKENS:
        ap.error(f"--ms {max(args.ms)} with --compare marlin: expected at most {MARLIN_MAX_TOKENS} tokens (larger "
                 "batches are served by graphs with the wgmma order pass, which this arm leaves out)")
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
        torch._dynamo.reset()  # the last layer's code
        fns = {v: compiled(fn, before, k, passes, code(v), {**options, **extra_options}, modes, tag=v)
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
            profiled = profile_fields(row, fns, x, args.profile) if args.profile else None
            rows.append(row)
            times = "  ".join(f"{v} {row[f'{v}_us']:8.2f} us" for v in fns)
            launched = "  ".join(f"{v} {row[f'{v}_launch_us']:8.2f} us" for v in fns)
            errs = " / ".join(f"{row[f'{v}_rel_err_vs_eager']:.1e}" for v in fns)
            drift = f"  drift {100 * row['drift']:.1f} %" if args.rounds > 1 else ""
            print(f"{name:11s} {n:>6}x{k:<6} M={m:<5d} {times}  {summary}  rel. err vs eager {errs}{drift}",
                  flush=True)
            print(f"{'':11s} launched, not replayed: {launched}", flush=True)
            if profiled:
                print(f"{'':11s} {profiled}", flush=True)
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
