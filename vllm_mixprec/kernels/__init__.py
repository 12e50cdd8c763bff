"""Python entry points of the ops, and the choice of kernel behind them.

Three implementations of every linear op share one signature:
  * "cuda":      csrc/ ops (TORCH_LIBRARY namespace `mixprec_C`), when the extension is built;
  * "triton":    kernels/triton, on any CUDA GPU of sm80+;
  * "reference": reference.py, pure torch (CPU, and the oracle of the tests).
The choice is made per layer, once, in prepare_linear (after weight loading), and is
logged at debug level. The ops are torch custom ops with fake implementations, so that
torch.compile and CUDA graphs in vLLM see opaque, shape-known calls.

Under torch.compile (vLLM's default) a W4A8 layer is traced as reference.quantize_act in
plain torch ops followed by the `mixprec::w4a8_gemm` op, so that Inductor fuses the activation
quantization into the op that produced x (RMSNorm, SiLU-and-mul, which vLLM compiles natively)
instead of launching a quantize kernel per layer. Eager runs (and MIXPREC_FUSE_ACT_QUANT=0) call
`mixprec::w4a8_linear`, whose quantize kernel does the same math in one pass. A W4Ax layer calls
`mixprec::w4ax_linear` compiled too: traced, its quantizer is 5-15 kernels, not one (w4ax_quant;
MIXPREC_W4AX_QUANT=traced traces it as quantize_act_w4ax + `w4ax_gemm`).
"""
from __future__ import annotations

import logging
import os

import torch

from .. import envs
from .. import formats as F
from .. import reference as ref
from . import cuda as _cuda

logger = logging.getLogger("vllm.mixprec")  # a child of vLLM's logger: its handler prints us

IMPLS = ("cuda", "triton", "reference")
_UNFORCE = "unset MIXPREC_KERNEL to let the plugin choose"


def forced_impl(environ=os.environ) -> str | None:
    """MIXPREC_KERNEL (tests and A/B runs: force one implementation), validated."""
    v = envs.get("MIXPREC_KERNEL", environ)
    if v is not None and v not in IMPLS:
        raise ValueError(f"MIXPREC_KERNEL={v!r} is not one of {IMPLS}; set one of them or {_UNFORCE}")
    return v


_FORCED = forced_impl()


def fuse_act_quant(environ=os.environ) -> bool:
    """MIXPREC_FUSE_ACT_QUANT: 1 (default, module docstring) or 0 (A/B runs)."""
    v = envs.get("MIXPREC_FUSE_ACT_QUANT", environ)
    if v not in ("0", "1"):
        raise ValueError(f"MIXPREC_FUSE_ACT_QUANT={v!r}: expected 1 (quantize activations in "
                         "torch ops that torch.compile fuses into the previous op; the default) "
                         "or 0 (always the opaque quantize kernel)")
    return v == "1"


_FUSE_ACT_QUANT = fuse_act_quant()

W4AX_QUANT_MODES = ("kernel", "traced")


def w4ax_quant(environ=os.environ) -> str:
    """MIXPREC_W4AX_QUANT: how a compiled W4Ax layer quantizes its activations. "kernel" (the
    default): the opaque mixprec::w4ax_linear, whose quantize kernel gathers, rotates and
    quantizes a row in one pass. "traced": reference.quantize_act_w4ax in torch ops, as W4A8's.
    Inductor cannot put the norm's row reduction, the per-block amaxes (reductions of another
    shape) and the rotation's butterfly stages (each reads values other threads wrote) in one
    kernel: it compiles 5 Triton kernels without a rotation, 15 with hadamard and 14 with
    hadamard64, with float32 [M, K] buffers between them (scripts/inductor_kernels.py, session 69)."""
    v = envs.get("MIXPREC_W4AX_QUANT", environ)
    if v not in W4AX_QUANT_MODES:
        raise ValueError(f"MIXPREC_W4AX_QUANT={v!r}: expected kernel (the default: compiled W4Ax "
                         "layers quantize in the one-pass Triton kernel) or traced (in torch ops "
                         "that torch.compile fuses into the previous op, in several kernels)")
    return v


_W4AX_QUANT = w4ax_quant()


def tp_act_scale(environ=os.environ) -> str:
    """MIXPREC_TP_ACT_SCALE: the per-token activation scale of a row-parallel layer (o_proj,
    down_proj) at TP > 1, where each rank holds a slice of every token's channels.
    "rank" (default): each rank scales its slice by the slice's own max; no communication, but
    the codes differ from TP=1's. "global": the ranks all-gather their row maxima first (one
    [M, TP] float32 all-gather per layer), so codes and scales are TP=1's bit for bit and the
    TP=2 output differs from TP=1's only by the 16-bit rounding of the partial sums."""
    v = envs.get("MIXPREC_TP_ACT_SCALE", environ)
    if v not in ("rank", "global"):
        raise ValueError(f"MIXPREC_TP_ACT_SCALE={v!r}: expected rank (each rank's own per-token "
                         "max; the default) or global (the max over all ranks: TP=1's codes, one "
                         "all-gather per row-parallel layer)")
    return v


def tp_reduce(environ=os.environ) -> str:
    """MIXPREC_TP_REDUCE: how a row-parallel layer (o_proj, down_proj) sums its ranks' partial
    outputs at TP > 1. "model" (default): vLLM's all-reduce of each rank's output, rounded to the
    model dtype. "exact": TP=1's output bit for bit (no bias; with one, within a rounding):
    the whole row's activation codes and scale (as MIXPREC_TP_ACT_SCALE=global), each rank's
    integer dot products all-reduced as float32 (exact below 2^24), then the kernels' epilogue
    once (reference.w4a8_epilogue); one [M, N] float32 all-reduce in place of a 16-bit one and an
    [M, TP] all-gather. Any rounding difference, even float32's, is amplified by the next layers'
    dynamic int8 codes into different greedy tokens (session 29, scripts/diag_tp_rounding.py)."""
    v = envs.get("MIXPREC_TP_REDUCE", environ)
    if v not in ("model", "exact"):
        raise ValueError(f"MIXPREC_TP_REDUCE={v!r}: expected model (vLLM's all-reduce of 16-bit "
                         "partial outputs; the default) or exact (the integer dot products "
                         "all-reduced: TP=1's output bit for bit)")
    if v == "exact" and envs.explicit("MIXPREC_TP_ACT_SCALE", environ) == "rank":
        raise ValueError("MIXPREC_TP_REDUCE=exact sums the ranks' integer dot products, which "
                         "needs one activation scale per token across ranks; it cannot be "
                         "combined with MIXPREC_TP_ACT_SCALE=rank (unset it, or set global)")
    return v


def quantize_act_tp(x: torch.Tensor, smooth: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.quantize_act of the whole rows that x [M, K/TP] is this rank's slice of: the
    maxima of every rank's slice are all-gathered (vLLM's all_gather op, which torch.compile and
    CUDA graphs trace) and their max scales the codes. Torch ops: Inductor fuses them."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_gather

    def whole_row_amax(amax: torch.Tensor) -> torch.Tensor:  # amax keeps a NaN: the row is NaN
        # Along dim 0 only: vLLM's gather along the last dim returns a strided view of its buffer
        # ([M, TP] with strides (1, M)) while the op's fake output is contiguous, and compiled
        # code reads it by the fake's strides: other rows' and padding rows' maxima, NaN at TP=2
        # (session 26-27). Rank-major [TP * M] is contiguous in both.
        tp = get_tensor_model_parallel_world_size()
        return tensor_model_parallel_all_gather(amax.contiguous(), dim=0).view(tp, -1).amax(dim=0)

    return ref.quantize_act_slice(x, smooth, whole_row_amax)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except ImportError:
        return False


def describe() -> str:
    cuda = "csrc ops loaded" if _cuda.available() else f"csrc ops not built ({_cuda.load_error()})"
    tri = "triton available" if _triton_available() else "triton missing"
    forced = f"; forced by MIXPREC_KERNEL={_FORCED}" if _FORCED else ""
    return f"{cuda}; {tri}; CPU tensors use the torch reference{forced}"


logger.info("vllm_mixprec kernels: %s", describe())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def select_impl(device: torch.device, prefix: str = "") -> str:
    """The implementation a layer on `device` will use (at load time: errors come at start-up)."""
    where = f"{prefix}: " if prefix else ""
    if _FORCED == "cuda":
        if not _cuda.available():
            raise RuntimeError(f"{where}MIXPREC_KERNEL=cuda but the csrc ops are not built "
                               f"({_cuda.load_error()}); rebuild with `pip install -e .` where nvcc "
                               f"is present, or {_UNFORCE}")
        if device.type != "cuda":
            raise RuntimeError(f"{where}MIXPREC_KERNEL=cuda but the weights are on {device}; the "
                               f"csrc ops run on CUDA GPUs only: {_UNFORCE}")
        if not _cuda.supports_device(device):
            raise RuntimeError(f"{where}MIXPREC_KERNEL=cuda but {device} is below sm80, which the "
                               f"csrc ops need: {_UNFORCE}")
    if _FORCED == "triton":
        if not _triton_available():
            raise RuntimeError(f"{where}MIXPREC_KERNEL=triton but Triton is not installed: "
                               f"`pip install triton`, or {_UNFORCE}")
        if device.type != "cuda" and not _interpreting():
            raise RuntimeError(f"{where}MIXPREC_KERNEL=triton but the weights are on {device}; "
                               "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 for "
                               f"debugging): {_UNFORCE}")
    if _FORCED is not None:
        return _FORCED
    if device.type != "cuda":
        return "reference"
    if _cuda.available() and _cuda.supports_device(device):
        return "cuda"
    if _triton_available():
        return "triton"
    raise RuntimeError("vllm_mixprec: a CUDA tensor but neither the csrc ops nor Triton are available")


def _triton():
    from .triton import gemm
    return gemm


# --- custom ops -------------------------------------------------------------------------

def _impl_module(impl: str):
    return ref if impl == "reference" else (_cuda if impl == "cuda" else _triton())


@torch.library.custom_op("mixprec::w4a8_linear", mutates_args=())
def w4a8_linear(x: torch.Tensor, qweight: torch.Tensor, group_scale: torch.Tensor,
                group_offset: torch.Tensor, channel_scale: torch.Tensor,
                bias: torch.Tensor | None, smooth: torch.Tensor | None, impl: str) -> torch.Tensor:
    """x [M, K] (fp16/bf16) -> [M, N] in x's dtype: quantize_act then w4a8_gemm (csrc: with the
    activations in the wgmma k order where the GEMM runs a wgmma kernel)."""
    if impl == "cuda":
        return _cuda.w4a8_linear(x, qweight, group_scale, group_offset, channel_scale, bias, smooth)
    mod = _impl_module(impl)
    xq, xs = mod.quantize_act(x, smooth)
    return mod.w4a8_gemm(xq, xs, qweight, group_scale, group_offset, channel_scale, bias, x.dtype)


@w4a8_linear.register_fake
def _(x, qweight, group_scale, group_offset, channel_scale, bias, smooth, impl):
    return x.new_empty((x.shape[0], channel_scale.shape[0]))


@torch.library.custom_op("mixprec::w4a8_gemm", mutates_args=())
def w4a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
              group_scale: torch.Tensor, group_offset: torch.Tensor, channel_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, impl: str,
              x_wgmma_order: bool = False) -> torch.Tensor:
    """int8 xq [M, K] and float32 x_scale [M] (reference.quantize_act) -> [M, N] out_dtype.
    x_wgmma_order: xq in the wgmma k order (cuda.x_wgmma_order_for; csrc and reference only)."""
    if x_wgmma_order and impl == "triton":
        raise ValueError("mixprec::w4a8_gemm: x_wgmma_order=True (activations in the wgmma k "
                         "order) is read by the csrc wgmma kernels and the reference only, not "
                         "by impl='triton'")
    order = {"x_wgmma_order": True} if x_wgmma_order else {}  # (the Triton GEMM has no such argument)
    return _impl_module(impl).w4a8_gemm(xq, x_scale, qweight, group_scale, group_offset,
                                        channel_scale, bias, out_dtype, **order)


@w4a8_gemm.register_fake
def _(xq, x_scale, qweight, group_scale, group_offset, channel_scale, bias, out_dtype, impl,
      x_wgmma_order=False):
    return xq.new_empty((xq.shape[0], channel_scale.shape[0]), dtype=out_dtype)


@torch.library.custom_op("mixprec::w4a8_epilogue", mutates_args=())
def w4a8_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, channel_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """reference.w4a8_epilogue as an op that Inductor cannot fuse: MIXPREC_TP_REDUCE=exact's
    row-parallel output is then a tensor rounded to out_dtype, as TP=1's GEMM kernel writes it,
    and the kernels after it see TP=1's graph. Traced as torch ops, Inductor may fuse it into
    the residual add and RMSNorm after it and keep its value in float32. Session 30, real Qwen:
    TP=2 kept 8 of 8 greedy outputs eager, 1 of 8 compiled, 7 of 8 compiled with Inductor
    emulating eager's casts; the effect of this op on the GPU is not measured yet."""
    return ref.w4a8_epilogue(acc, x_scale, channel_scale, bias, out_dtype)


@w4a8_epilogue.register_fake
def _(acc, x_scale, channel_scale, bias, out_dtype):
    return acc.new_empty(acc.shape, dtype=out_dtype)


@torch.library.custom_op("mixprec::w4ax_linear", mutates_args=())
def w4ax_linear(x: torch.Tensor, qweight: torch.Tensor, group_scale: torch.Tensor,
                group_offset: torch.Tensor, channel_scale: torch.Tensor, act_perm: torch.Tensor,
                k8: int, bias: torch.Tensor | None, smooth: torch.Tensor | None,
                act_rotation: str, impl: str) -> torch.Tensor:
    """W4Ax: permute (act_perm: [K] channels or [K/ACT_BLOCK] blocks, formats.act_perm_unit;
    and rotate the 4-bit blocks, formats.ACT_ROTATIONS), split 8/4-bit activations, two integer
    GEMMs, one epilogue."""
    mod = _impl_module(impl)
    x8, s8, x4, s4 = mod.quantize_act_w4ax(x, act_perm, k8, smooth, act_rotation)
    return mod.w4ax_gemm(x8, s8, x4, s4, qweight, group_scale, group_offset, channel_scale,
                         bias, x.dtype)


@w4ax_linear.register_fake
def _(x, qweight, group_scale, group_offset, channel_scale, act_perm, k8, bias, smooth,
      act_rotation, impl):
    return x.new_empty((x.shape[0], channel_scale.shape[0]))


@torch.library.custom_op("mixprec::w4ax_gemm", mutates_args=())
def w4ax_gemm(x8: torch.Tensor, s8: torch.Tensor, x4: torch.Tensor, s4: torch.Tensor,
              qweight: torch.Tensor, group_scale: torch.Tensor, group_offset: torch.Tensor,
              channel_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
              impl: str) -> torch.Tensor:
    """reference.quantize_act_w4ax's four tensors -> [M, N] out_dtype."""
    return _impl_module(impl).w4ax_gemm(x8, s8, x4, s4, qweight, group_scale, group_offset,
                                        channel_scale, bias, out_dtype)


@w4ax_gemm.register_fake
def _(x8, s8, x4, s4, qweight, group_scale, group_offset, channel_scale, bias, out_dtype, impl):
    return x8.new_empty((x8.shape[0], channel_scale.shape[0]), dtype=out_dtype)


@torch.library.custom_op("mixprec::silu_mul_quantize_act", mutates_args=())
def silu_mul_quantize_act(gate_up: torch.Tensor, smooth: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.silu_mul_quantize_act in one kernel: what compile_passes puts in place of
    SiluAndMul + the traced quantizer (DecodeQuantOps in decode graphs; SiluMulQuantFusion where
    opted in). The csrc kernel where built and it takes the tensors (cuda.silu_quant_supports:
    fp16/bf16, float32 smoothing, K % 8 == 0, a row's outputs over a cluster of CTAs on sm_90,
    one CTA before), else Triton's (_log_kernel_choice logs which, once a kind). CPU tensors (and
    MIXPREC_KERNEL=reference) take the reference."""
    if gate_up.device.type == "cuda" and _FORCED != "reference":
        use_cuda = (_SILU_QUANT_CUDA and _FORCED != "triton" and _cuda.has_silu_quant()
                    and _cuda.supports_device(gate_up.device) and _cuda.silu_quant_supports(gate_up, smooth))
        _log_kernel_choice("silu_mul_quantize_act", use_cuda, gate_up, smooth)
        if use_cuda:
            return _cuda.silu_mul_quantize_act(gate_up, smooth, *(_SILU_QUANT_PLAN or ()))
        return _triton().silu_mul_quantize_act(gate_up, smooth)
    return (_triton() if _interpreting() and _FORCED != "reference" else ref).silu_mul_quantize_act(gate_up, smooth)


@silu_mul_quantize_act.register_fake
def _(gate_up, smooth):
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    return (gate_up.new_empty((m, k), dtype=torch.int8),
            gate_up.new_empty((m,), dtype=torch.float32))


@torch.library.custom_op("mixprec::quantize_act", mutates_args=())
def quantize_act(x: torch.Tensor, smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.quantize_act as one kernel whose launch is chosen by M when it runs (csrc where
    built, else Triton): what compile_passes.DecodeQuantOps puts in place of the traced
    quantizer in decode graphs. CPU tensors (and MIXPREC_KERNEL=reference) take the reference."""
    if x.device.type == "cuda" and _FORCED != "reference":
        use_cuda = _FORCED != "triton" and _cuda.available() and _cuda.supports_device(x.device)
        return (_cuda if use_cuda else _triton()).quantize_act(x, smooth)
    return (_triton() if _interpreting() and _FORCED != "reference" else ref).quantize_act(x, smooth)


@quantize_act.register_fake
def _(x, smooth):
    return (x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32))


@torch.library.custom_op("mixprec::add_rms_norm_quantize_act", mutates_args=())
def add_rms_norm_quantize_act(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                              epsilon: float, smooth: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm_quantize_act in one kernel: what compile_passes.DecodeQuantOps puts in
    place of vLLM's fused_add_rms_norm + the traced quantizer in decode graphs. The csrc kernel
    where built and it takes the tensors (cuda.norm_quant_supports: fp16/bf16, weight in x's
    dtype, float32 smoothing, K % 8 == 0 up to 16384), else Triton's (_log_kernel_choice
    logs which, once a kind). CPU tensors (and MIXPREC_KERNEL=reference) take the reference."""
    if x.device.type == "cuda" and _FORCED != "reference":
        use_cuda = (_NORM_QUANT_CUDA and _FORCED != "triton" and _cuda.has_norm_quant()
                    and _cuda.supports_device(x.device) and _cuda.norm_quant_supports(x, residual, weight, smooth))
        _log_kernel_choice("add_rms_norm_quantize_act", use_cuda, x, weight, smooth)
        mod = _cuda if use_cuda else _triton()
    else:
        mod = _triton() if _interpreting() and _FORCED != "reference" else ref
    return mod.add_rms_norm_quantize_act(x, residual, weight, epsilon, smooth)


# False: the op takes the Triton kernel even where the csrc one applies (the benchmarks' A/B
# arms; not user settings).
_NORM_QUANT_CUDA = True
_SILU_QUANT_CUDA = True
# (max_cluster, cta_vecs) for the csrc silu_mul_quantize_act; None: the op's own
# (cuda.silu_quant_cluster_for, 512 vectors a CTA). Benchmark arms, not a user setting.
_SILU_QUANT_PLAN: tuple[int, int] | None = None
_KERNEL_CHOICES_LOGGED: set = set()


def _log_kernel_choice(op: str, use_cuda: bool, x, *others) -> None:
    """Debug log, once per kind of call, of the kernel an op (add_rms_norm_quantize_act,
    silu_mul_quantize_act) takes: rows of x, and the dtypes of its other tensors (None: absent)."""
    key = (op, use_cuda, x.dtype, x.shape[-1], *(None if t is None else t.dtype for t in others))
    if key not in _KERNEL_CHOICES_LOGGED:
        _KERNEL_CHOICES_LOGGED.add(key)
        logger.debug("vllm_mixprec: %s on %s rows of %d (other tensors %s): %s kernel", op, x.dtype,
                     x.shape[-1], key[4:], "csrc" if use_cuda else "Triton")


@add_rms_norm_quantize_act.register_fake
def _(x, residual, weight, epsilon, smooth):
    return (x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32),
            x.new_empty(x.shape))


# --- what the linear method calls -------------------------------------------------------

_PARAMS = ("qweight", "group_scale", "group_offset", "channel_scale", "input_smooth", "act_perm")


def prepare_linear(layer: torch.nn.Module, weight_scheme: str, prefix: str,
                   act_rotation: str = "none") -> None:
    """After loading: pick the kernel, repack for it, and swap vLLM parameters for plain ones.
    act_rotation (W4Ax, formats.ACT_ROTATIONS): the 4-bit blocks' rotation, kept as
    layer.mixprec_act_rotation."""
    impl = select_impl(layer.qweight.device, prefix)
    if weight_scheme == "w4ax" and impl == "cuda" and not _cuda.has_w4ax():
        if _FORCED == "cuda":
            logger.warning("vllm_mixprec: %s: MIXPREC_KERNEL=cuda, but the csrc build has no "
                           "w4ax GEMM; this layer uses the Triton kernel", prefix)
        impl = "triton"
    for name in _PARAMS:
        if hasattr(layer, name):
            data = getattr(layer, name).data
            delattr(layer, name)
            layer.register_parameter(name, torch.nn.Parameter(data, requires_grad=False))
    if weight_scheme == "w4ax":
        layer.mixprec_k8 = int(layer.a8_blocks.data[0]) * F.ACT_BLOCK
        del layer.a8_blocks
        layer.mixprec_act_rotation = act_rotation
        # a permutation of whole blocks (--a8-select blocks) is read once a block, not a channel
        blocks = F.act_block_perm(layer.act_perm.data)
        if blocks is not None:
            layer.act_perm = torch.nn.Parameter(blocks, requires_grad=False)
        logger.debug("vllm_mixprec: %s act_perm: %s", prefix,
                     "whole blocks" if blocks is not None else "channels")
    group_size = layer.mixprec_in_features // layer.group_scale.shape[-1]  # checkpoint layout [N, K/G]
    if impl == "cuda":
        _cuda.prepare_weights(layer)
    # read per layer (validated at any TP); create_weights refuses W4Ax on a row-parallel
    # shard, so this is W4A8 only
    global_scale = tp_act_scale() == "global"
    row_parallel = getattr(layer, "mixprec_row_parallel", False)
    layer.mixprec_act_scale_tp = global_scale and row_parallel
    # RowParallelLinear.forward all-reduces apply()'s output only while reduce_results is set
    # (its documented switch): with MIXPREC_TP_REDUCE=exact apply() does that reduction itself
    layer.mixprec_reduce_exact = (row_parallel and tp_reduce() == "exact"
                                  and getattr(layer, "reduce_results", False))
    if layer.mixprec_reduce_exact:
        layer.reduce_results = False
        layer.register_buffer("mixprec_unit_scale", torch.ones_like(layer.channel_scale),
                              persistent=False)
    layer.mixprec_impl = impl
    layer.mixprec_scheme = weight_scheme
    logger.debug("vllm_mixprec: %s -> %s %s kernel (N=%d, K=%d)", prefix, impl, weight_scheme,
                 layer.mixprec_out_features, layer.mixprec_in_features)
    if impl == "cuda" and weight_scheme == "w4a8" and logger.isEnabledFor(logging.DEBUG):
        logger.debug("vllm_mixprec: %s csrc plans: %s", prefix,
                     _cuda.describe_plans(layer.mixprec_out_features, layer.mixprec_in_features,
                                          group_size, layer.qweight.device))


def _row_parallel_exact(layer: torch.nn.Module, x2: torch.Tensor, smooth: torch.Tensor | None
                        ) -> torch.Tensor:
    """MIXPREC_TP_REDUCE=exact (tp_reduce): the GEMM with unit scales writes this rank's integer
    dot products as float32; their all-reduced sum is TP=1's accumulator, and the epilogue runs
    on it once. The bias is the layer's own on every rank (vLLM hands it to rank 0 only, since
    it adds it before its reduction)."""
    from vllm.distributed import tensor_model_parallel_all_reduce
    xq, xs = quantize_act_tp(x2, smooth)
    unit = layer.mixprec_unit_scale
    acc = torch.ops.mixprec.w4a8_gemm(xq, unit.new_ones(xs.shape), layer.qweight, layer.group_scale,
                                      layer.group_offset, unit, None, torch.float32,
                                      layer.mixprec_impl)
    bias = None if layer.skip_bias_add else layer.bias
    return torch.ops.mixprec.w4a8_epilogue(tensor_model_parallel_all_reduce(acc), xs,
                                           layer.channel_scale, bias, x2.dtype)


def apply_linear(layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    smooth = getattr(layer, "input_smooth", None)
    weights = (layer.qweight, layer.group_scale, layer.group_offset, layer.channel_scale)
    fused = _FUSE_ACT_QUANT and torch.compiler.is_compiling()  # torch ops Inductor can fuse
    if getattr(layer, "mixprec_reduce_exact", False):  # MIXPREC_TP_REDUCE=exact, row-parallel W4A8
        y = _row_parallel_exact(layer, x2, smooth)
    elif getattr(layer, "mixprec_act_scale_tp", False):  # MIXPREC_TP_ACT_SCALE=global, row-parallel
        y = torch.ops.mixprec.w4a8_gemm(*quantize_act_tp(x2, smooth), *weights, bias, x2.dtype,
                                        layer.mixprec_impl)
    elif layer.mixprec_scheme == "w4a8" and fused:
        y = torch.ops.mixprec.w4a8_gemm(*ref.quantize_act(x2, smooth), *weights, bias, x2.dtype,
                                        layer.mixprec_impl)
    elif layer.mixprec_scheme == "w4a8":
        y = torch.ops.mixprec.w4a8_linear(x2, *weights, bias, smooth, layer.mixprec_impl)
    elif fused and _W4AX_QUANT == "traced":
        y = torch.ops.mixprec.w4ax_gemm(
            *ref.quantize_act_w4ax(x2, layer.act_perm, layer.mixprec_k8, smooth, layer.mixprec_act_rotation),
            *weights, bias, x2.dtype, layer.mixprec_impl)
    else:
        y = torch.ops.mixprec.w4ax_linear(x2, *weights, layer.act_perm, layer.mixprec_k8, bias,
                                          smooth, layer.mixprec_act_rotation, layer.mixprec_impl)
    return y.reshape(*shape[:-1], y.shape[-1])
