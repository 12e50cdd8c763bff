"""The plugin's torch.compile pass: SiLU-and-mul + activation quantization in one kernel.

Under vLLM's compile a mixprec layer quantizes its input in traced torch ops (kernels/
__init__.py) that Inductor fuses into the op before it. For the down projection that op is
SiluAndMul, and Inductor's fused reduction walks the 14336-wide row twice in 2048-wide steps
on one program per token: 5.6 us at batch 1 on an H100, where SiluAndMul alone takes 1.4
(docs/BENCHMARKS.md, session 13). This pass replaces the pair with
`mixprec::silu_mul_quantize_act`, whose rows are split over many programs (gemm.py:
SPLIT_ROWS_MAX_M), so that a batch of a few tokens does not wait on one SM per row.

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

from . import reference as ref

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
    v = environ.get("MIXPREC_FUSE_SILU_QUANT", "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"MIXPREC_FUSE_SILU_QUANT={v!r}: expected 0 (the default: Inductor fuses "
                         "the down projection's input quantization into SiLU-and-mul) or 1 "
                         "(mixprec::silu_mul_quantize_act in their place for batches of at most "
                         "32 tokens; see compile_passes.py)")
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
    from torch._inductor.pattern_matcher import (PatternMatcherPass, gen_pattern,
                                                 register_replacement)

    patterns = PatternMatcherPass(pass_name="mixprec_silu_mul_quant")
    gate_up = torch.randn(4, 16, dtype=torch.bfloat16)
    smooth = torch.rand(8) + 0.5  # float32, as the linear method registers input_smooth
    for search, replace, args in ((_search, _replace, [gate_up]),
                                  (_search_smooth, _replace_smooth, [gate_up, smooth])):
        register_replacement(search, replace, args, _trace, patterns,
                             extra_check=_halves_of_gate_up,
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

    def uuid(self) -> str:  # Inductor's cache key: this file's source
        import hashlib
        import inspect
        import sys
        return hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()


def install(compilation_config) -> bool:
    """Put SiluMulQuantFusion in vLLM's custom post-grad hook (once). Returns whether it is
    there. A pass the user set keeps the hook: ours is then left out, with a warning."""
    if not enabled():
        return False
    cfg = compilation_config.inductor_compile_config
    current = cfg.get(HOOK)
    if isinstance(current, SiluMulQuantFusion):
        return True
    if current is not None:
        logger.warning("vllm_mixprec: compilation_config.inductor_compile_config[%r] is already "
                       "%r; the SiLU-and-mul + quantize fusion is left out (the down projection "
                       "quantizes its input in Inductor's kernel)", HOOK, current)
        return False
    cfg[HOOK] = SiluMulQuantFusion()
    _add_compile_range_end(compilation_config, FUSE_MAX_TOKENS)
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
    logger.info("vllm_mixprec: compile ranges split at %d tokens (the SiLU-and-mul + quantize "
                "fusion applies up to there): endpoints %s", end,
                compilation_config.compile_ranges_endpoints)
