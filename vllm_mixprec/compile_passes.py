"""The plugin's torch.compile passes: SiLU-and-mul + activation quantization in one kernel
(SiluMulQuantFusion, opt-in), the decode graphs' quantizers as ops launched for their batch, the
SiLU's with its SiLU-and-mul where opted in (DecodeQuantOps, on by default), and the activations
in the wgmma k order for batches past 64 tokens (WgmmaActOrder, on where the GPU runs the wgmma
kernels). All go in vLLM's one custom post-grad hook, as MixprecPostGrad.

Under vLLM's compile a mixprec layer quantizes its input in traced torch ops (kernels/
__init__.py) that Inductor fuses into the op before it. For the down projection that op is
SiluAndMul, and Inductor's fused reduction walks the 14336-wide row twice in 2048-wide steps
on one program per token: 5.6 us at batch 1 on an H100, where SiluAndMul alone takes 1.4
(docs/BENCHMARKS.md, session 13). This pass replaces the pair with
`mixprec::silu_mul_quantize_act`, whose rows are split over many programs (gemm.py:
split_rows), so that a batch of a few tokens does not wait on one SM per row.

It is installed through vLLM's hook for custom post-grad passes
(compilation_config.inductor_compile_config["post_grad_custom_post_pass"], which vLLM's pass
manager runs after its own passes) when the quantization method first builds a layer, if
MIXPREC_FUSE_SILU_QUANT=1 (enabled()). It rewrites only graphs compiled for at most
FUSE_MAX_TOKENS tokens, where its kernel is the faster one: install() adds that endpoint to
vLLM's compile ranges (compilation_config.compile_ranges_endpoints), so that the larger
batches get a graph of their own, compiled without it.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from . import envs
from . import formats as F
from . import reference as ref
from .kernels.cuda import DECODE_MAX_M

logger = logging.getLogger("vllm.mixprec")

HOOK = "post_grad_custom_post_pass"
# The largest batch whose graph the pass rewrites. H100, 2026-11-26, Llama-3-8B's 14336-wide
# row, CUDA graphs: the op (split rows, PDL) 3.75 / 4.03 / 4.42 / 4.91 / 6.12 / 31.3 us at
# M = 1 / 8 / 16 / 32 / 64 / 512 against Inductor's 5.28 / 5.24 / - / - / 5.48 / 17.5.
FUSE_MAX_TOKENS = 32


def enabled(environ=os.environ) -> bool:
    """MIXPREC_FUSE_SILU_QUANT: 0 (default: Inductor's fused kernel) or 1 (this pass).

    Off by default until served with its compile range (FUSE_MAX_TOKENS): on all sizes it
    matched Marlin's TPOT at concurrency 1 on the H100 (3.52 ms each, 2026-11-26) but would
    cost large batches, where Inductor's kernel is faster."""
    v = envs.get("MIXPREC_FUSE_SILU_QUANT", environ)
    if v not in ("0", "1"):
        raise ValueError(f"MIXPREC_FUSE_SILU_QUANT={v!r}: expected 0 (the default: Inductor fuses the down "
                         "projection's input quantization into SiLU-and-mul) or 1 "
                         "(mixprec::silu_mul_quantize_act in their place for batches of at most 32 tokens; "
                         "see compile_passes.py)")
    return v == "1"


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The graph vLLM traces for SiluAndMul (its native form; custom ops are off under
    Inductor), or reference.silu_and_mul where vLLM is absent."""
    try:
        from vllm.model_executor.layers.activation import SiluAndMul
    except ImportError:
        return ref.silu_and_mul(gate_up)
    return SiluAndMul.forward_native(gate_up)


def _search(gate_up):
    return ref.quantize_act(_silu_and_mul(gate_up), None)


def _search_smooth(gate_up, smooth):
    return ref.quantize_act(_silu_and_mul(gate_up), smooth)


def _replace(gate_up):
    return torch.ops.mixprec.silu_mul_quantize_act(gate_up, None)


def _replace_smooth(gate_up, smooth):
    return torch.ops.mixprec.silu_mul_quantize_act(gate_up, smooth)


def _trace(fn, args):
    """A pattern's graph as the model's reaches post-grad passes: Inductor's forward trace,
    then the joint-graph pass that turns uniform constants (where's scalar 0) into full()."""
    from torch._inductor.fx_passes.joint_graph import constant_fold_uniform_value
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(fn, args)
    constant_fold_uniform_value(gm)
    return gm


def _halves_of_gate_up(match) -> bool:
    """The pattern ignores integer arguments (sizes are symbolic in the model's graph), so
    check here that the two slices are gate_up[..., :d] and gate_up[..., d:] with 2d its width."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    gate_up = match.kwargs["gate_up"]
    slices = [n for n in match.nodes if n.target == torch.ops.aten.slice.Tensor
              and n.args[0] is gate_up]
    if len(slices) != 2:
        return False
    width = gate_up.meta["val"].shape[-1]
    ndim = gate_up.meta["val"].dim()
    (lo, hi) = sorted(slices, key=lambda n: 0 if n.args[2] == 0 else 1)
    for n in (lo, hi):
        if n.args[1] not in (-1, ndim - 1) or (len(n.args) > 4 and n.args[4] != 1):
            return False
    d = lo.meta["val"].shape[-1]
    return (lo.args[2] == 0
            and (hi.args[2] is lo.args[3] or statically_known_true(hi.args[2] == lo.args[3]))
            and statically_known_true(2 * d == width)
            and statically_known_true(hi.meta["val"].shape[-1] == d))


@functools.lru_cache(maxsize=None)
def _patterns():
    """The pattern pass, built once: tracing the patterns runs the ops on small CPU tensors.

    Each pattern is traced once with integers as wildcards and given to Inductor pre-traced:
    its own re-trace at the match's symbolic shapes would not reproduce vLLM's graph (the
    split point is a SymInt expression there), so _halves_of_gate_up checks the sizes."""
    return _smoothed_pattern_pass("mixprec_silu_mul_quant", ((_search, _replace), (_search_smooth, _replace_smooth)),
                                  torch.randn(4, 16, dtype=torch.bfloat16), 8, _halves_of_gate_up)


def _smoothed_pattern_pass(name: str, pairs, x: torch.Tensor, width: int, check):
    """A pattern pass of pairs ((search, replace), (search_smooth, replace_smooth)), traced on x
    and on x with a float32 smoothing vector (as the linear method registers input_smooth) of the
    quantizer's width."""
    from torch._inductor.pattern_matcher import (PatternMatcherPass, gen_pattern,
                                                 register_replacement)

    patterns = PatternMatcherPass(pass_name=name)
    for (search, replace), args in zip(pairs, ([x], [x, torch.rand(width) + 0.5])):
        register_replacement(search, replace, args, _trace, patterns, extra_check=check,
                             search_fn_pattern=gen_pattern(search, args, _trace))
    return patterns


def _pass_base():
    try:
        from vllm.compilation.passes.inductor_pass import InductorPass
        return InductorPass
    except ImportError:  # torch alone (tests): Inductor's own base
        from torch._inductor.custom_graph_pass import CustomGraphPass
        return CustomGraphPass


class SiluMulQuantFusion(_pass_base()):
    """Post-grad pass: quantize_act(SiluAndMul(x)) -> mixprec::silu_mul_quantize_act(x)."""

    def __init__(self):
        # Register the op (which _patterns' replacements call) now: on a compile-cache hit
        # the pass never runs, but the cached code calls the op (bench_act_quant's second
        # run failed so on the H100, 2026-11-26).
        from . import kernels  # noqa: F401
        self.matched = 0  # replacements made, over every graph this pass has seen

    def __call__(self, graph: torch.fx.Graph) -> None:
        n = _patterns().apply(graph)
        if n and not self.matched:  # once a process (a compile-cache hit runs no pass)
            logger.info("vllm_mixprec: SiLU-and-mul + quantize fused into "
                        "mixprec::silu_mul_quantize_act (%d in the first graph)", n)
        self.matched += n

    def is_applicable_for_range(self, compile_range) -> bool:
        """vLLM's pass manager asks this for each compile range (vllm Range, end inclusive)."""
        return compile_range.end <= FUSE_MAX_TOKENS

    def uuid(self) -> str:
        return _source_hash()


# The largest batch whose graph DecodeQuantOps rewrites: the range below the wgmma order's.
DECODE_OPS_MAX_TOKENS = DECODE_MAX_M


def decode_quant_ops(environ=os.environ) -> bool:
    """MIXPREC_DECODE_QUANT_OPS: 1 (the default: DecodeQuantOps in graphs of at most
    DECODE_OPS_MAX_TOKENS tokens) or 0 (Inductor compiles the traced quantizers there too).

    On since session 83: the Llama decoder pieces as vLLM compiles them, H100, M = 1-16, went from
    1.18-1.31x to 1.26-1.43x Marlin W4A16's (8B) and from 1.06-1.13x to 1.17-1.19x (70B)
    (docs/BENCHMARKS.md "Session 83 (H100)"). Served A-B-A against ab.py's w4a8kv4-inductorquant
    arm (session 84, H100, 8B shape): 1.072x / 1.063x the output tokens/s at concurrency 1 / 8
    (docs/BENCHMARKS.md "Session 84 (H100)")."""
    v = envs.get("MIXPREC_DECODE_QUANT_OPS", environ)
    if v not in ("0", "1"):
        raise ValueError(f"MIXPREC_DECODE_QUANT_OPS={v!r}: expected 1 (the default: in graphs for batches "
                         f"of at most {DECODE_OPS_MAX_TOKENS} tokens, mixprec::quantize_act and "
                         "mixprec::add_rms_norm_quantize_act in place of the traced activation quantizers; "
                         "see compile_passes.py) or 0 (Inductor fuses them into the ops before them)")
    return v == "1"


def decode_silu_op(environ=os.environ) -> bool:
    """MIXPREC_DECODE_SILU_OP: 0 (the default: the down projection's SiLU-and-mul stays Inductor's,
    its quantizer becomes mixprec::quantize_act) or 1 (DecodeQuantOps puts mixprec::silu_mul_quantize_act
    in place of the pair). Opt-in: on an H100 the op is bit-exact; with it the 70B decoder piece
    is 0.3-3.0 us faster at 1-16 tokens and the 8B piece 0.1-0.7 us slower, and served (8B
    shape, A-B-A, session 89) it tied the default within the A rounds' drift."""
    v = envs.get("MIXPREC_DECODE_SILU_OP", environ)
    if v not in ("0", "1"):
        raise ValueError(f"MIXPREC_DECODE_SILU_OP={v!r}: expected 0 (the default: with the decode ops, "
                         "Inductor's SiLU-and-mul, then mixprec::quantize_act) or 1 (SiLU-and-mul + its "
                         "quantizer as mixprec::silu_mul_quantize_act; see compile_passes.py)")
    return v == "1"


def _quantize(x):
    return ref.quantize_act(x, None)


def _quantize_smooth(x, smooth):
    return ref.quantize_act(x, smooth)


def _quantize_op(x):
    return torch.ops.mixprec.quantize_act(x, None)


def _quantize_op_smooth(x, smooth):
    return torch.ops.mixprec.quantize_act(x, smooth)


def _half_rows(match) -> bool:
    """The quantizer's input is 2-D fp16/bf16 (the op's contract)."""
    val = match.kwargs["x"].meta.get("val")
    return val is not None and val.dim() == 2 and val.dtype in (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _quantizer_patterns():
    """The traced quantizer (kernels.apply_linear under compile) -> mixprec::quantize_act."""
    return _smoothed_pattern_pass("mixprec_decode_quantize_act",
                                  ((_quantize, _quantize_op), (_quantize_smooth, _quantize_op_smooth)),
                                  torch.randn(4, 16, dtype=torch.bfloat16), 16, _half_rows)


def _vllm_add_rms_norm():
    """vLLM's IR op (vllm/ir/ops/layernorm.py), as the plugin's hook sees RMSNorm with a residual:
    vLLM lowers IR ops after the custom post-grad passes. None without vLLM."""
    try:
        return torch.ops.vllm_ir.fused_add_rms_norm.default
    except AttributeError:
        return None


def _fuse_norm_into(quant: torch.fx.Node, norm_op) -> bool:
    """quant = mixprec::quantize_act(fused_add_rms_norm(x, res, w, eps)[0], smooth), the normed
    row read by nothing else -> mixprec::add_rms_norm_quantize_act(x, res, w, eps, smooth) in
    the norm's place, giving the codes, the scales and the residual. False where it does not fit."""
    import operator

    from .kernels.triton.gemm import NORM_QUANT_MAX_K
    y, smooth = quant.args
    if not (isinstance(y, torch.fx.Node) and y.target is operator.getitem and y.args[1] == 0
            and len(y.users) == 1):
        return False
    norm = y.args[0]
    if not (isinstance(norm, torch.fx.Node) and norm.target is norm_op and not norm.kwargs):
        return False
    x, res, w, eps, *rest = norm.args
    if any(r is not None for r in rest):  # variance_size
        return False
    if any(n.meta.get("val") is None for n in (quant, y, norm)):
        return False  # no fake values to give the fused op's outputs
    k = y.meta["val"].shape[-1]
    if not isinstance(k, int) or k > NORM_QUANT_MAX_K:
        return False
    order = {n: i for i, n in enumerate(norm.graph.nodes)}
    if isinstance(smooth, torch.fx.Node) and order[smooth] > order[norm]:
        return False  # the fused op goes where the norm is, before the norm's other users
    if any(u.target is not operator.getitem for u in quant.users) or any(
            u.target is not operator.getitem or u.args[1] != 1 for u in norm.users if u is not y):
        return False
    graph = norm.graph
    vals = (*quant.meta["val"], norm.meta["val"][1])  # codes, scales, residual
    with graph.inserting_after(norm):
        fused = graph.call_function(torch.ops.mixprec.add_rms_norm_quantize_act.default,
                                    (x, res, w, eps, smooth))
    fused.meta["val"] = vals
    fake = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a  # noqa: E731
    fused.meta["eager_input_vals"] = (tuple(fake(a) for a in fused.args), {})
    gets = {}
    with graph.inserting_after(fused):
        for i in range(3):
            gets[i] = graph.call_function(operator.getitem, (fused, i))
            gets[i].meta["val"] = vals[i]
    for u in list(quant.users):  # the codes and the scales
        u.replace_all_uses_with(gets[u.args[1]])
        graph.erase_node(u)
    for u in list(norm.users):  # the residual
        if u is not y:
            u.replace_all_uses_with(gets[2])
            graph.erase_node(u)
    for n in (quant, y, norm):
        graph.erase_node(n)
    return True


class DecodeQuantOps(_pass_base()):
    """Post-grad pass for graphs of at most DECODE_OPS_MAX_TOKENS tokens: each traced quantizer
    -> mixprec::quantize_act, and where that reads vLLM's fused_add_rms_norm, the pair ->
    mixprec::add_rms_norm_quantize_act; with `silu` (MIXPREC_DECODE_SILU_OP=1, opt-in), first
    SiLU-and-mul + its quantizer -> mixprec::silu_mul_quantize_act. Inductor tunes its fused
    quantizers for the size hint of the batch dimension, and vLLM keeps the profiling run's (8192)
    for every compile range: on the H100 the 70B piece's norm + quantizer kernels took 7.24 and
    4.87 us at 16 tokens where vLLM's norm alone takes 3.04 and 2.42 (docs/BENCHMARKS.md "Session
    82"). These ops launch for the batch they get, and all let the csrc decode GEMM after them (a
    programmatic dependent launch) start while they run, which Inductor's kernels do not: most of
    what they save (docs/BENCHMARKS.md "Session 83 (H100)"). Runs after SiluMulQuantFusion where
    both are on (that one then takes the SiLU's quantizer)."""

    def __init__(self, silu: bool | None = None):
        from . import kernels  # noqa: F401  (the ops, on a compile-cache hit too)
        self.silu = decode_silu_op() if silu is None else silu
        self.quantizers = 0  # traced quantizers replaced, over every graph this pass has seen
        self.norms = 0  # of them, those fused with their RMSNorm
        self.silus = 0  # of them, those fused with their SiLU-and-mul
        self.last = (0, 0, 0)  # (quantizers, norms, silus) in the last graph
        self.seen: set[tuple[int, int, int]] = set()  # the (quantizers, norms, silus) logged

    def __call__(self, graph: torch.fx.Graph) -> None:
        silus = _patterns().apply(graph) if self.silu else 0
        n = _quantizer_patterns().apply(graph) + silus
        norm_op = _vllm_add_rms_norm()
        fused = 0
        if n and norm_op is not None:
            for node in list(graph.nodes):
                if node.target is torch.ops.mixprec.quantize_act.default:
                    fused += _fuse_norm_into(node, norm_op)
        last = (n, fused, silus)
        if n and last not in self.seen:  # once a kind of graph: vLLM's pieces differ
            self.seen.add(last)
            logger.info("vllm_mixprec: decode graphs (<= %d tokens): %d traced quantizers became ops in a "
                        "graph: %d fused with their add + RMSNorm (mixprec::add_rms_norm_quantize_act), %d "
                        "with their SiLU-and-mul (mixprec::silu_mul_quantize_act), the rest "
                        "mixprec::quantize_act", DECODE_OPS_MAX_TOKENS, *last)
        self.quantizers += n
        self.norms += fused
        self.silus += silus
        self.last = last

    def is_applicable_for_range(self, compile_range) -> bool:
        return compile_range.end <= DECODE_OPS_MAX_TOKENS

    def uuid(self) -> str:
        return _source_hash(f"silu={self.silu}")


def _codes_in_order(y):
    q, s = ref.quantize_act(y, None)
    return ref.to_wgmma_act_order(q), s


def _input_in_order(y):
    return ref.quantize_act(ref.to_wgmma_act_order(y), None)


def _is_wgmma_order(match) -> bool:
    """The pattern ignores integer arguments: check that the codes' permutation is the wgmma
    one (a view to [M, K/64, 4, 4, 4], permute (0, 1, 3, 2, 4), back to [M, K])."""
    aten = torch.ops.aten
    vals = {n: n.args[0].meta.get("val") for n in match.nodes if n.target == aten.view.default}
    if any(v is None for v in vals.values()):
        return False  # no fake values to check the shapes with: leave it
    perms = [n for n in match.nodes if n.target == aten.permute.default]
    views = [n for n, v in vals.items() if v.dim() == 2]  # the codes [M, K] -> [M, K/64, 4, 4, 4]
    if len(perms) != 1 or tuple(perms[0].args[1]) != F.WGMMA_ORDER_ROWS_PERMUTE or len(views) != 1:
        return False
    k = vals[views[0]].shape[-1]
    return (isinstance(k, int) and k % F.WGMMA_ORDER_CHUNK == 0
            and list(views[0].args[1][1:]) == list(F.wgmma_order_view(k)))


@functools.lru_cache(maxsize=None)
def _order_patterns():
    """The permuted codes of the traced quantizer -> the traced quantizer of the permuted input.
    The two are equal (the row's amax does not depend on the order; everything else is per
    element), but Inductor compiles them differently where the quantizer is fused into RMSNorm
    or SiLU-and-mul: a permutation after the amax cannot join the fused kernel's loop, so
    Inductor writes the float codes to memory and gathers them in a second kernel (H200,
    session 64's generated code); before the amax it is a gathered load in the same kernel."""
    from torch._inductor.pattern_matcher import (PatternMatcherPass, gen_pattern,
                                                 register_replacement)

    patterns = PatternMatcherPass(pass_name="mixprec_wgmma_order_input")
    # y in float32: the pattern is the quantizer after its input's conversion to float32 and its
    # division by the smoothing vector, so it matches with or without either (Inductor removes the
    # conversion where the input is a float32 -> bf16 -> float32 chain); y is then that float32
    # row, and the permutation reads through whatever computes it.
    y = torch.randn(4, 128)
    register_replacement(_codes_in_order, _input_in_order, [y], _trace, patterns,
                         extra_check=_is_wgmma_order,
                         search_fn_pattern=gen_pattern(_codes_in_order, [y], _trace))
    return patterns


# Batches of more than this many tokens run a wgmma kernel on an sm_90 GPU (the decode kernels
# take M <= DECODE_MAX_M), which copies x by TMA when the quantizer wrote it in the wgmma k order:
# 10-18 % faster GEMMs at M >= 256 (H200, csrc/gemm/NOTES.md "Session 63").
WGMMA_ORDER_AFTER_TOKENS = DECODE_MAX_M


# MIXPREC_X_WGMMA_ORDER's values. The default (1, input_fused) served +4.5 % and +5.4 % output
# tokens/s over the codes rule in an A-B-A and a B-A-B on one H100, against 0.4-0.7 % drift
# (gpu_ab.sh aba throughput, docs/BENCHMARKS.md "Session 73"); "codes" was the default before.
WGMMA_ORDER_MODES = {"1": "input_fused", "input_fused": "input_fused", "codes": "codes",
                     "input": "input", "0": None}
# Inductor's realize_reads_threshold for MIXPREC_X_WGMMA_ORDER=input_fused (Inductor's default: 4).
# In vLLM's decoder piece the second add + RMSNorm recomputes the first one's residual, so its
# output, read at permuted places by the QKV's quantizer, reads more buffers than 4 and Inductor
# writes it out: one more kernel and a float32 [M, K] round trip. At 16 the piece compiles to as
# many kernels as the natural order (scripts/inductor_kernels.py on session 67's served graph:
# natural 6, codes by the rule 8, input 7, input_fused 6; the H100's code for a piece: 4, 7, 5, 4
# as the tool said). Global to the compile: the decode range keeps its kernels, its second norm
# recomputing the first residual instead of writing float32 buffers: Inductor's estimate of the
# piece's bytes at 16 tokens drops from 3.03 to 2.77 MB (test_inductor_kernels.py); that range
# is untimed on the GPU (the throughput A-B-A's batches are mostly past 64 tokens).
INPUT_FUSED_REALIZE_READS = 16


def wgmma_order_mode(environ=os.environ) -> str | None:
    """MIXPREC_X_WGMMA_ORDER: 1 or input_fused (the default: WgmmaActOrder permutes the traced
    quantizer's input on every shape, and Inductor's realize_reads_threshold is
    INPUT_FUSED_REALIZE_READS), input (the same, Inductor's threshold left alone), codes (the
    quantizer's codes permuted, on the shapes of wgmma_order_pays: the default before session 73)
    or 0 (None: the natural order)."""
    v = envs.get("MIXPREC_X_WGMMA_ORDER", environ)
    if v not in WGMMA_ORDER_MODES:
        raise ValueError(
            f"MIXPREC_X_WGMMA_ORDER={v!r}: expected 1 or input_fused (the default: compiled graphs for "
            "batches of more than 64 tokens quantize the W4A8 activations in the wgmma k order, which "
            "the sm_90a GEMM copies by TMA, each quantizer permuting its input inside its norm's "
            "kernel; compile_passes.py), input (the same, Inductor's realize_reads_threshold left "
            "alone), codes (the quantizer's codes permuted, on the layers of wgmma_order_pays) or 0 "
            "(the natural order everywhere)")
    return WGMMA_ORDER_MODES[v]


def _wgmma_order_applies() -> bool:
    """The pass is wanted (MIXPREC_X_WGMMA_ORDER) and this process's GPU runs the wgmma kernels
    for batches past 64 tokens (an sm_90 GPU, an sm_90a build, no override to other kernels or to
    another implementation: its compile range would then be compiled for nothing)."""
    from . import kernels
    from .kernels import cuda
    return (wgmma_order_mode() is not None and kernels.forced_impl() in (None, "cuda") and cuda.has_wgmma()
            and cuda.x_wgmma_order_for(WGMMA_ORDER_AFTER_TOKENS + 1, 4096, 4096))


def wgmma_order_pays(n: int, k: int) -> bool:
    """MIXPREC_X_WGMMA_ORDER=codes: whether an N x K layer's compiled quantizer should write the
    wgmma k order (the default, input_fused, permutes every layer's input). Where Inductor
    fuses it into RMSNorm or SiLU-and-mul, the permuted codes cannot be stored from the fused
    kernel: it writes them as float32 and a second kernel gathers them (session 64's generated
    code), a cost that grows with M x K while the GEMM's gain grows with M x N x K. Measured (H200,
    benchmarks/bench_compiled_linear.py, docs/BENCHMARKS.md "Session 63", "Session 64"), compiled
    layer natural -> wgmma order at M = 128-4096:
    - after RMSNorm: QKV 6144 x 4096 0.96-1.03x; QKV 10240 x 8192 1.01-1.06x; gate_up 28672 x
      4096 1.06-1.11x, 57344 x 8192 1.13-1.14x;
    - nothing to fuse (o_proj 4096 x 4096 1.03-1.13x, 8192 x 8192 1.11-1.17x) or SiLU-and-mul
      (down 4096 x 14336 1.10-1.15x, 8192 x 28672 1.07-1.10x): none, or a longer GEMM to pay it.
    The pass does not see which op the quantizer is fused into; in Llama-like models the layers
    after RMSNorm (QKV, gate_up) are the ones with N > K. So: K >= N (o_proj, down), or N >= 8192
    (the RMSNorm layers whose GEMM gain outweighs the extra kernel); the 8B-sized QKV stays
    natural. input_order (WgmmaActOrder) keeps one kernel on each layer alone and needs no rule
    (session 65); in a decoder piece the QKV's quantizer after the second add + RMSNorm is a
    kernel of its own (session 67's served graph; scripts/inductor_kernels.py shows why)."""
    return k >= n or n >= 8192


class WgmmaActOrder(_pass_base()):
    """Post-grad pass for graphs of more than 64 tokens: mixprec::w4a8_gemm(xq, ..., impl) ->
    mixprec::w4a8_gemm(wgmma_order(xq), ..., impl, True) where wgmma_order_pays. The permutation
    is a view, a permute and a clone. Inductor folds it into a quantizer that stands alone (one
    kernel, a gathered load); a quantizer fused into the op before it instead writes float32
    codes for a second kernel to permute (wgmma_order_pays). impls: the nodes it rewrites (the
    csrc op; the tests add "reference"); all_shapes: ignore wgmma_order_pays.
    input_order: then move the permutation before the traced quantizer (_order_patterns), so
    that a quantizer fused into RMSNorm or SiLU-and-mul gathers its input in one kernel instead
    of writing float codes for a second kernel to permute: 1.00-1.31x natural and 0.99-1.38x the
    codes permutation on six compiled layers (H200, docs/BENCHMARKS.md "Session 65"); with
    INPUT_FUSED_REALIZE_READS, the default (wgmma_order_mode)."""

    def __init__(self, impls=("cuda",), all_shapes: bool = False, input_order: bool = False):
        from . import kernels  # noqa: F401  (the op, on a compile-cache hit too)
        self.impls = tuple(impls)
        self.all_shapes = all_shapes
        self.input_order = input_order
        self.rewritten = 0  # GEMMs rewritten, over every graph this pass has seen
        self.input_ordered = 0  # of their quantizers, those that now permute their input
        self.warned_unmoved = False

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        n_done = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.mixprec.w4a8_gemm.default:
                continue
            args = list(node.args)
            if "x_wgmma_order" in node.kwargs:
                args.append(node.kwargs["x_wgmma_order"])
            if len(args) < 9 or args[8] not in self.impls or (len(args) > 9 and args[9]):
                continue
            xq = args[0]
            val = xq.meta.get("val") if isinstance(xq, torch.fx.Node) else None
            if val is None or val.dim() != 2 or not isinstance(val.shape[1], int) or val.shape[1] % 64:
                continue  # a K that is not a static multiple of 64: the GEMM op refuses it anyway
            view_shape = [-1, *F.wgmma_order_view(val.shape[1])]  # [M, chunks, 4, 4, 4]
            permute = list(F.WGMMA_ORDER_ROWS_PERMUTE)
            k = val.shape[1]
            cs = args[5].meta.get("val") if isinstance(args[5], torch.fx.Node) else None
            if cs is None or not isinstance(cs.shape[0], int):
                continue
            if not (self.all_shapes or wgmma_order_pays(cs.shape[0], k)):
                continue
            with graph.inserting_before(node):
                view = graph.call_function(aten.view.default, (xq, view_shape))
                perm = graph.call_function(aten.permute.default, (view, permute))
                copy = graph.call_function(aten.clone.default, (perm,),
                                           {"memory_format": torch.contiguous_format})
                xw = graph.call_function(aten.view.default, (copy, [-1, k]))
            view.meta["val"] = val.view(view_shape)
            perm.meta["val"] = view.meta["val"].permute(permute)
            copy.meta["val"] = perm.meta["val"].clone(memory_format=torch.contiguous_format)
            xw.meta["val"] = copy.meta["val"].view(-1, k)
            node.args = (xw, *args[1:9], True)
            node.kwargs = {}
            if "eager_input_vals" in node.meta:  # the fake arguments Inductor lowers the op with
                fake_args, _ = node.meta["eager_input_vals"]
                node.meta["eager_input_vals"] = ((xw.meta["val"], *fake_args[1:9], True), {})
            n_done += 1
        moved = _order_patterns().apply(graph) if n_done and self.input_order else 0
        if n_done and not self.rewritten:
            logger.info("vllm_mixprec: W4A8 activations in the wgmma k order for batches of more "
                        "than %d tokens (%d GEMMs in the first graph; %d quantizers permute their "
                        "input)", WGMMA_ORDER_AFTER_TOKENS, n_done, moved)
        if self.input_order and moved < n_done and not self.warned_unmoved:
            self.warned_unmoved = True  # once a process; the count is per graph
            logger.warning("vllm_mixprec: MIXPREC_X_WGMMA_ORDER=input: %d of %d quantizers in a graph "
                           "still permute their codes (the input-order pattern did not match them: "
                           "compile_passes._order_patterns)", n_done - moved, n_done)
        logger.debug("vllm_mixprec: wgmma order: %d GEMMs rewritten in this graph, %d of their "
                     "quantizers permute their input", n_done, moved)
        self.input_ordered += moved
        self.rewritten += n_done

    def is_applicable_for_range(self, compile_range) -> bool:
        return compile_range.start > WGMMA_ORDER_AFTER_TOKENS

    def uuid(self) -> str:
        # The settings change the compiled code, and Inductor's FX-graph cache key holds this uuid
        # (vLLM's keys also hold the MIXPREC_* variables: compile_cache.py; plain torch.compile's not).
        return _source_hash(f"impls={self.impls} all_shapes={self.all_shapes} input_order={self.input_order}")


@functools.lru_cache(maxsize=None)
def _source() -> str:  # read once: the hook's uuid asks each pass's, on every graph vLLM compiles
    import inspect
    import sys
    return inspect.getsource(sys.modules[__name__])


def _source_hash(settings: str = "") -> str:
    """A pass's uuid (in Inductor's and vLLM's compile-cache keys): this file's source and the
    pass's settings."""
    import hashlib
    return hashlib.sha256((_source() + settings).encode()).hexdigest()


def _compile_range():
    """The compile range vLLM's pass manager is compiling for (None outside vLLM's compile)."""
    try:
        from vllm.compilation.passes.inductor_pass import get_pass_context
        return get_pass_context().compile_range
    except (ImportError, AssertionError):  # no vLLM, or no pass context (plain torch.compile)
        return None


class MixprecPostGrad(_pass_base()):
    """The plugin's passes in vLLM's one custom post-grad hook, each on the compile ranges it
    says it applies to (under plain torch.compile, with no range, all of them)."""

    def __init__(self, passes):
        self.passes = list(passes)

    def __call__(self, graph: torch.fx.Graph) -> None:
        compile_range = _compile_range()
        for p in self.passes:
            if compile_range is None or p.is_applicable_for_range(compile_range):
                p(graph)

    def is_applicable_for_range(self, compile_range) -> bool:
        return any(p.is_applicable_for_range(compile_range) for p in self.passes)

    def get(self, kind):
        return next((p for p in self.passes if isinstance(p, kind)), None)

    def uuid(self) -> str:
        return _source_hash(" ".join(f"{type(p).__name__}:{p.uuid()}" for p in self.passes))


def wanted() -> bool:
    """Whether install() has a pass to put in place (config.py asks before building a layer)."""
    return enabled() or decode_quant_ops() or _wgmma_order_applies()


def install(compilation_config) -> bool:
    """Put the wanted passes (SiluMulQuantFusion if MIXPREC_FUSE_SILU_QUANT=1, DecodeQuantOps unless
    MIXPREC_DECODE_QUANT_OPS=0, WgmmaActOrder where it applies) in vLLM's custom post-grad hook,
    once, and split the compile ranges where they stop applying. Returns whether they are there. A
    pass the user set keeps the hook: ours are then left out, with a warning."""
    mode = wgmma_order_mode()
    order = mode in ("input", "input_fused")
    order_applies = _wgmma_order_applies()
    # (wanted, the pass, the compile range end it applies up to or after)
    wants = ((enabled(), SiluMulQuantFusion, FUSE_MAX_TOKENS),
             (decode_quant_ops(), DecodeQuantOps, DECODE_OPS_MAX_TOKENS),
             (order_applies, functools.partial(WgmmaActOrder, all_shapes=order, input_order=order),
              WGMMA_ORDER_AFTER_TOKENS))
    passes = [make() for want, make, _ in wants if want]
    if not passes:
        return False
    cfg = compilation_config.inductor_compile_config
    current = cfg.get(HOOK)
    if isinstance(current, MixprecPostGrad):
        return True
    if current is not None:
        logger.warning("vllm_mixprec: compilation_config.inductor_compile_config[%r] is already "
                       "%r; the plugin's passes (%s) are left out (compile_passes.py)", HOOK, current,
                       ", ".join(type(p).__name__ for p in passes))
        return False
    cfg[HOOK] = MixprecPostGrad(passes)
    if mode == "input_fused" and order_applies:
        reads = cfg.setdefault("realize_reads_threshold", INPUT_FUSED_REALIZE_READS)  # a user's stays
        logger.info("vllm_mixprec: wgmma order input_fused (MIXPREC_X_WGMMA_ORDER): Inductor's "
                    "realize_reads_threshold is %s (compile_passes.INPUT_FUSED_REALIZE_READS)", reads)
    for want, _, end in wants:
        if want:
            _add_compile_range_end(compilation_config, end)
    return True


def _add_compile_range_end(compilation_config, end: int) -> None:
    """Split vLLM's compile ranges at `end` (vLLM sorted them, its largest being
    max_num_batched_tokens, when it built the config; the compile backend reads them after
    the model is built, which is when install() runs). Nothing to split when every batch is
    at most `end` tokens, or when there are no ranges (no compilation)."""
    ends = list(getattr(compilation_config, "compile_ranges_endpoints", None) or [])
    if not ends or end >= max(ends) or end in ends:
        return
    compilation_config.compile_ranges_endpoints = sorted(ends + [end])
    logger.info("vllm_mixprec: compile ranges split at %d tokens (a pass of the plugin's applies "
                "on one side only: compile_passes.py): endpoints %s", end,
                compilation_config.compile_ranges_endpoints)
