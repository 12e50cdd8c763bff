"""Pure-torch references. Every fast kernel in vllm_mixprec matches one function here,
with the same signature, and the tests compare them.

The integer parts are exact: an int8 x int8 product summed over K <= 2**17 fits float64's
mantissa, so the float64 matmul below is an exact int32 GEMM.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import formats as F

_EPS = 1e-8
_NAN = float("nan")


def _poison_nonfinite(scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """NaN where a row of `rows` [..., K] holds a NaN or an Inf (docs/RELIABILITY.md).

    A non-finite activation or K/V row is never turned into finite codes: its scale becomes
    NaN, so everything computed from the row is NaN, visibly, and other rows are untouched.
    """
    return torch.where(torch.isfinite(rows).all(dim=-1), scale, torch.full_like(scale, _NAN))


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c, correctly rounded on every device: on CUDA, tensor / Python scalar multiplies by
    the rounded reciprocal, which the kernels (div_rn) would not reproduce."""
    return t / torch.full_like(t, c)


# --- weights: LiquidQuant two-level quantisation ---------------------------------------

def quantize_w8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Level 1: W [N, K] float -> (w8 int8 in [-119, 119], channel_scale float32 [N]).

    Non-finite weights are refused (ValueError): NaN would become arbitrary int8 codes."""
    w = w.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        rows = (~torch.isfinite(w)).any(1).nonzero().flatten().tolist()
        raise ValueError(f"weight has NaN/Inf values in row(s) {rows[:8]}; refusing to quantize it")
    scale = (w.abs().amax(dim=1) / F.W8_PROTECT).clamp_min(_EPS)
    w8 = torch.round(w / scale[:, None]).clamp_(-F.W8_PROTECT, F.W8_PROTECT)
    return w8.to(torch.int8), scale.to(torch.float32)


def lqq_group_params(w8: torch.Tensor, group_size: int, step_candidates: int = 2
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Level 2 parameters per group: (step uint8 in [1, 16], offset uint8 = 128 + min).

    The step is the one of {floor, ceil}(range / 15) (step_candidates=2) or ceil alone
    (step_candidates=1) that gives the smaller squared error. Any step in [1, 16] keeps
    q*step + offset <= 255 (FORMAT.md), so the choice is free.
    """
    n, k = w8.shape
    # float32 is exact here: integers below 2^24, and a quotient of two of them with a divisor
    # <= 16 is either exact or >= 1/32 away from a rounding boundary (float64 gives the same)
    g = w8.view(n, k // group_size, group_size).to(torch.float32)
    mn, mx = g.amin(-1), g.amax(-1)
    rng = mx - mn
    hi = torch.ceil(rng / F.W4_MAX).clamp_(1, F.MAX_GROUP_STEP)
    if step_candidates == 1:
        return hi.to(torch.uint8), (128 + mn).to(torch.uint8)
    lo = torch.floor(rng / F.W4_MAX).clamp_(1, F.MAX_GROUP_STEP)
    best_err, best = None, None
    for step in (hi, lo):
        q = torch.round((g - mn[..., None]) / step[..., None]).clamp_(0, F.W4_MAX)
        err = ((q * step[..., None] + mn[..., None] - g) ** 2).sum(-1)
        if best is None:
            best_err, best = err, step.clone()
        else:
            better = err < best_err
            best = torch.where(better, step, best)
            best_err = torch.where(better, err, best_err)
    return best.to(torch.uint8), (128 + mn).to(torch.uint8)


def lqq_encode(w8: torch.Tensor, group_step: torch.Tensor, group_offset: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """Level 2 codes: int8 w8 [N, K] -> uint8 q [N, K] in [0, 15] for the given group params."""
    n, k = w8.shape
    g = w8.view(n, k // group_size, group_size).to(torch.float32)  # exact: see lqq_group_params
    mn = group_offset.to(torch.float32)[..., None] - 128
    q = torch.round((g - mn) / group_step.to(torch.float32)[..., None]).clamp_(0, F.W4_MAX)
    return q.to(torch.uint8).view(n, k)


def quantize_weight_lqq(w: torch.Tensor, group_size: int = 64) -> dict[str, torch.Tensor]:
    """W [N, K] float -> the four checkpoint tensors of formats.W4Layout (round to nearest)."""
    F.W4Layout(w.shape[0], w.shape[1], group_size)  # validates
    w8, channel_scale = quantize_w8_per_channel(w)
    step, offset = lqq_group_params(w8, group_size)
    q = lqq_encode(w8, step, offset, group_size)
    return {"qweight": F.pack_nibbles(q), "group_scale": step, "group_offset": offset,
            "channel_scale": channel_scale}


def dequantize_weight_w8(qweight: torch.Tensor, group_scale: torch.Tensor,
                         group_offset: torch.Tensor) -> torch.Tensor:
    """Packed W4 -> the exact int8 weights [N, K] the GEMM multiplies, via the lane recipe."""
    q = F.unpack_nibbles(qweight)
    n, k = q.shape
    gs = k // group_scale.shape[1]
    step = group_scale.repeat_interleave(gs, dim=1)
    off = group_offset.repeat_interleave(gs, dim=1)
    return F.lqq_dequant_lanes(q, step, off)


def dequantize_weight(qweight, group_scale, group_offset, channel_scale,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    w8 = dequantize_weight_w8(qweight, group_scale, group_offset)
    if dtype == torch.float32 and channel_scale.dtype == torch.float32:
        # int8 x float32 is exact in float64, so one float32 multiply rounds it the same way
        return w8.to(torch.float32) * channel_scale[:, None]
    return (w8.to(torch.float64) * channel_scale.to(torch.float64)[:, None]).to(dtype)


# --- activations ------------------------------------------------------------------------

def _quantize_sym(xb: torch.Tensor, qmax: int, row_ok: torch.Tensor | None = None,
                  amax: torch.Tensor | None = None, half: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric codes of xb [M, B, L], one scale per (token, block): (float codes [M, B, L]
    in [-qmax, qmax], float32 scale [M, B] = max|block| / qmax). `amax` [M, B], when given,
    stands for max|block| (a block of which xb holds only a slice). `half`: the grid of
    formats.A4_TOP, codes q in [-qmax - 1, qmax] standing for (q + 1/2) * scale, scale =
    max|block| / (qmax + 1/2); floor picks the nearest half-integer.

    A row holding a NaN or an Inf gets NaN in all of its scales and zero codes, so everything
    computed from it is NaN. amax propagates both (NaN stays NaN, |Inf| is Inf), so with one
    block per row (row_ok None) the block's own amax tells: one reduction, where a separate
    all(isfinite) pass made torch.compile's fused RMSNorm/SiLU kernel carry three. With several
    blocks, row_ok [M] (whole row finite) comes from the caller.
    """
    amax = xb.abs().amax(dim=-1) if amax is None else amax
    ok = torch.isfinite(amax) if row_ok is None else row_ok[:, None]
    top = qmax + 0.5 if half else qmax
    scale = torch.where(ok, _div(amax.clamp_min(_EPS), top), torch.full_like(amax, _NAN))
    if half:
        q = torch.floor(xb / scale[..., None]).clamp(-qmax - 1, qmax)
    else:
        q = torch.round(xb / scale[..., None]).clamp(-qmax, qmax)  # not clamp_: compile_passes traces it
    return torch.where(ok[..., None], q, 0), scale


def _act_input(x: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
    """x in float32, divided by `smooth` [K] when given (SmoothQuant scale not folded offline)."""
    xf = x.to(torch.float32)
    return xf if smooth is None else xf / smooth.to(torch.float32)


def quantize_act(x: torch.Tensor, smooth: torch.Tensor | None = None, wgmma_order: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: x [M, K] -> (int8 [M, K], float32 scale [M]).

    `smooth` [K], when given, divides x first (SmoothQuant scale not folded offline).
    A row holding a NaN or an Inf gets a NaN scale and zero codes: its GEMM output row is NaN.
    wgmma_order: the codes in formats.wgmma_act_k_order (K % 64 == 0), for w4a8_gemm's
    x_wgmma_order.
    """
    q, scale = quantize_act_slice(x, smooth, None)
    return (to_wgmma_act_order(q) if wgmma_order else q), scale


def to_wgmma_act_order(rows: torch.Tensor) -> torch.Tensor:
    """[M, K] activations (or any rows) in formats.wgmma_act_k_order (its own inverse: also back
    again), as a view, a permute and a contiguous copy: the ops compile_passes.WgmmaActOrder puts
    in a compiled graph, and the form its patterns match."""
    k = rows.shape[-1]
    return (rows.contiguous().view(-1, *F.wgmma_order_view(k)).permute(F.WGMMA_ORDER_ROWS_PERMUTE)
            .clone(memory_format=torch.contiguous_format).view(-1, k))


def quantize_act_slice(x: torch.Tensor, smooth: torch.Tensor | None,
                       whole_row_amax: Callable[[torch.Tensor], torch.Tensor] | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act of x [M, K], a slice of longer rows: whole_row_amax maps the slice's row
    maxima max |x / smooth| [M] to the whole rows' (None: x is the whole row). A row-parallel
    layer at TP > 1 gathers them from every rank (kernels.quantize_act_tp), so that its codes and
    scales are TP=1's."""
    xf = _act_input(x, smooth)
    amax = None if whole_row_amax is None else whole_row_amax(xf.abs().amax(dim=-1))[:, None]
    q, scale = _quantize_sym(xf[:, None, :], F.A8_MAX, amax=amax)
    return q[:, 0].to(torch.int8), scale[:, 0]


def quantize_act_chunked(x: torch.Tensor, smooth: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per (token, A8_CHUNK channels): x [M, K] -> (int8 [M, K],
    float32 scale [M, K/A8_CHUNK]). The format a decode GEMM quantizing its activations in
    registers would use (csrc/gemm/NOTES.md: a chunk is one warp's four t-lanes, so the amax
    needs no other warp). Specified here first; no kernel produces it yet.
    A row holding a NaN or an Inf gets NaN in all of its scales and zero codes."""
    xf = _act_input(x, smooth)
    m, k = xf.shape
    if k % F.A8_CHUNK:
        raise ValueError(f"K={k} is not a multiple of the activation chunk {F.A8_CHUNK}")
    row_ok = torch.isfinite(xf.abs().amax(dim=-1))
    q, scale = _quantize_sym(xf.view(m, k // F.A8_CHUNK, F.A8_CHUNK), F.A8_MAX, row_ok)
    return q.reshape(m, k).to(torch.int8), scale


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """vLLM's SiluAndMul (its native form): [..., 2K] -> silu(gate) * up [..., K], in x's dtype."""
    d = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :d]) * gate_up[..., d:]


def silu_mul_quantize_act(gate_up: torch.Tensor, smooth: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act(silu_and_mul(gate_up), smooth): the down projection's input, [M, 2K] ->
    (int8 [M, K], float32 scale [M]). Fused kernels replace the pair under torch.compile
    (compile_passes.py)."""
    return quantize_act(silu_and_mul(gate_up), smooth)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused_add_rms_norm (vllm/ir/ops/layernorm.py, its native form, no variance_size):
    h = x + residual in float32; (rmsnorm(h) [* weight] in x's dtype, h in x's dtype)."""
    h = x.to(torch.float32) + residual.to(torch.float32)
    y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        y = y.to(weight.dtype) * weight
    return y.to(x.dtype), h.to(x.dtype)


def add_rms_norm_quantize_act(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                              epsilon: float, smooth: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_act(add_rms_norm(x, residual, weight, epsilon)[0], smooth) and the new residual:
    (int8 [M, K], float32 scale [M], residual [M, K] in x's dtype). The input of a layer after
    RMSNorm; a fused kernel replaces the pair in compiled decode graphs (compile_passes.py)."""
    y, h = add_rms_norm(x, residual, weight, epsilon)
    q, scale = quantize_act(y, smooth)
    return q, scale, h


def rotate_a4_blocks(xp: torch.Tensor, k8: int, rotation: torch.Tensor | None) -> torch.Tensor:
    """Permuted values [M, K] with each 4-bit block (channels k8 onward, in ACT_BLOCK-channel
    blocks) multiplied by a matrix `rotation` [ACT_BLOCK, ACT_BLOCK] (x_b @ R); the 8-bit part is
    returned as it is. rotation None, or no 4-bit block (k8 == K): xp itself. The products are
    summed in float64 and rounded once to xp's dtype. For the quantizer's weights and Hessians
    (any basis); activations go through hadamard_a4_blocks, the fast transform."""
    m, k = xp.shape
    if rotation is None or k8 == k:
        return xp
    a4 = (xp[:, k8:].reshape(m, (k - k8) // F.ACT_BLOCK, F.ACT_BLOCK).to(torch.float64)
          @ rotation.to(torch.float64)).to(xp.dtype)
    return a4.reshape(m, k) if k8 == 0 else torch.cat([xp[:, :k8], a4.reshape(m, k - k8)], dim=1)


def hadamard_a4_blocks(xp: torch.Tensor, k8: int, act_rotation: str) -> torch.Tensor:
    """float32 [M, K] (permuted) with each 4-bit block (channels k8 onward) times the matrix of
    act_rotation (formats.act_rotation_matrix), as the fast Walsh-Hadamard transform of width n
    (formats.act_rotation_size): float32 butterflies (a + b, a - b) on the channel pairs
    (i, i + s), i & s == 0, for s = 1, 2, .., n/2, then one multiply by formats.hadamard_norm(n).
    A fixed sequence of float32 operations, so the Triton kernel and Inductor's code from these
    ops give the same bits; within a few float32 ulps of x_b @ H in float64 (rotate_a4_blocks),
    for 7 additions an element instead of a 128-term product."""
    n = F.act_rotation_size(act_rotation)
    m, k = xp.shape
    if n == 0 or k8 == k:
        return xp
    v = xp[:, k8:].to(torch.float32)
    s = 1
    while s < n:
        pairs = v.reshape(m, -1, 2, s)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = torch.stack((a + b, a - b), dim=2)
        s *= 2
    a4 = v.reshape(m, k - k8) * F.hadamard_norm(n)
    return a4 if k8 == 0 else torch.cat([xp[:, :k8], a4], dim=1)


def w4ax_act_input(x: torch.Tensor, perm: torch.Tensor, k8: int, smooth: torch.Tensor | None,
                   act_rotation: str = "none") -> torch.Tensor:
    """The float32 values W4Ax quantizes: x / smooth, channels permuted (perm: [K] channels
    or [K/ACT_BLOCK] blocks, formats.act_channel_perm), 4-bit blocks rotated
    (hadamard_a4_blocks)."""
    perm = F.act_channel_perm(perm, x.shape[-1])
    return hadamard_a4_blocks(_act_input(x, smooth)[:, perm], k8, act_rotation)


def quantize_act_w4ax(x: torch.Tensor, perm: torch.Tensor, k8: int,
                      smooth: torch.Tensor | None = None, act_rotation: str = "none"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """W4Ax activations: permute channels (perm: [K] channels or [K/ACT_BLOCK] blocks), first
    k8 to int8, the rest (each block rotated as act_rotation says, formats.ACT_ROTATIONS) to
    packed int4 on the half-integer grid (formats.A4_TOP), with one symmetric scale per
    (token, ACT_BLOCK-channel block) (COMET's FMPQ: an outlier-free 4-bit block keeps its own
    resolution instead of sharing the token's largest 4-bit value).

    Returns (x8 int8 [M, k8], s8 float32 [M, k8/128], x4 uint8 [M, (K-k8)/2],
    s4 float32 [M, (K-k8)/128]). A row holding a NaN or an Inf gets NaN in all of its scales
    (both parts) and zero codes.
    """
    lay = F.W4ActLayout.from_k8(x.shape[-1], k8)
    xf = w4ax_act_input(x, perm, k8, smooth, act_rotation)
    m, k = xf.shape
    blocks = xf.view(m, k // F.ACT_BLOCK, F.ACT_BLOCK)
    row_ok = torch.isfinite(xf.abs().amax(dim=-1))
    q8, s8 = _quantize_sym(blocks[:, :lay.num_a8_blocks], F.A8_MAX, row_ok)
    q4, s4 = _quantize_sym(blocks[:, lay.num_a8_blocks:], F.A4_MAX, row_ok, half=True)
    return q8.reshape(m, k8).to(torch.int8), s8, F.pack_int4(q4.reshape(m, lay.k4)), s4


def _w4ax_codes_and_scales(x8: torch.Tensor, s8: torch.Tensor, x4: torch.Tensor,
                           s4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both parts of a W4Ax activation as one: (int8 codes [M, K], scales [M, K/ACT_BLOCK]).
    A nibble q stands for (q + 1/2) * s4: the code 2 q + 1 with the scale s4 / 2 (exact)."""
    return (torch.cat([x8, 2 * F.unpack_int4(x4) + 1], dim=1),
            torch.cat([s8, s4 / 2], dim=1))


def dequantize_act_w4ax(x8: torch.Tensor, s8: torch.Tensor, x4: torch.Tensor, s4: torch.Tensor
                        ) -> torch.Tensor:
    """Inverse of quantize_act_w4ax, float32 [M, K] in the permuted (and rotated) basis."""
    q, s = _w4ax_codes_and_scales(x8, s8, x4, s4)
    return q.to(torch.float32) * s.repeat_interleave(F.ACT_BLOCK, dim=1)


# --- GEMM -------------------------------------------------------------------------------

def _int_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer A [M, K] @ B[N, K]^T in float64."""
    return a.to(torch.float64) @ b.to(torch.float64).T


def w4a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
              group_scale: torch.Tensor, group_offset: torch.Tensor, channel_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
              x_wgmma_order: bool = False) -> torch.Tensor:
    """y[m, n] = x_scale[m] * channel_scale[n] * sum_k xq[m, k] * w8[n, k] + bias[n].
    x_wgmma_order: xq is in formats.wgmma_act_k_order (quantize_act(..., wgmma_order=True))."""
    if x_wgmma_order:
        xq = to_wgmma_act_order(xq)
    acc = _int_gemm(xq, dequantize_weight_w8(qweight, group_scale, group_offset))
    y = acc * x_scale.to(torch.float64)[:, None] * channel_scale.to(torch.float64)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype)


def w4a8_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, channel_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The float32 epilogue of every w4a8_gemm kernel (csrc and Triton), in their order:
    (float(acc[m, n]) * x_scale[m]) * channel_scale[n] (+ bias[n]), rounded once to out_dtype.
    w4a8_gemm above computes the same in float64, so the two may differ by one rounding."""
    y = acc.to(torch.float32) * x_scale.to(torch.float32)[:, None] * \
        channel_scale.to(torch.float32)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype)


def _block_scaled_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor,
                       channel_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """y[m, n] = channel_scale[n] * sum_b x_scale[m, b] * (sum_{k in block b} xq[m, k] w8[n, k])
    + bias[n]: each block's exact integer dot product (_int_gemm), times its activation scale,
    summed over the K / x_scale.shape[1] blocks in float64."""
    block = xq.shape[1] // x_scale.shape[1]
    xq, s, w8 = xq.to(torch.float64), x_scale.to(torch.float64), w8.to(torch.float64)
    y = torch.zeros(xq.shape[0], w8.shape[0], dtype=torch.float64, device=xq.device)
    for b in range(s.shape[1]):
        blk = slice(b * block, (b + 1) * block)
        y.addcmul_(xq[:, blk] @ w8[:, blk].T, s[:, b, None])
    y = y * channel_scale.to(torch.float64)[None, :]
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype)


def w4ax_gemm(x8: torch.Tensor, s8: torch.Tensor, x4: torch.Tensor, s4: torch.Tensor,
              qweight: torch.Tensor, group_scale: torch.Tensor, group_offset: torch.Tensor,
              channel_scale: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """W4Ax: y[m, n] = channel_scale[n] * sum_b s[m, b] * (sum_{k in block b} xq[m, k] w8[n, k])
    + bias[n], over the ACT_BLOCK-channel blocks b of both parts (s = [s8 | s4]): each block's
    exact integer dot product is scaled by its own activation scale, then the blocks are summed."""
    xq, s = _w4ax_codes_and_scales(x8, s8, x4, s4)
    return _block_scaled_gemm(xq, s, dequantize_weight_w8(qweight, group_scale, group_offset),
                              channel_scale, bias, out_dtype)


def w4a8_gemm_chunked(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
                      group_scale: torch.Tensor, group_offset: torch.Tensor,
                      channel_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """w4a8_gemm on quantize_act_chunked's activations: x_scale [M, K/A8_CHUNK], one scale per
    (token, chunk), each chunk's integer dot product scaled by its own."""
    return _block_scaled_gemm(xq, x_scale, dequantize_weight_w8(qweight, group_scale, group_offset),
                              channel_scale, bias, out_dtype)


def w4a8_linear(x: torch.Tensor, qweight, group_scale, group_offset, channel_scale,
                bias=None, smooth=None) -> torch.Tensor:
    """The whole linear layer: quantize_act then w4a8_gemm, output in x's dtype."""
    shape = x.shape
    xq, xs = quantize_act(x.reshape(-1, shape[-1]), smooth)
    y = w4a8_gemm(xq, xs, qweight, group_scale, group_offset, channel_scale, bias, x.dtype)
    return y.reshape(*shape[:-1], y.shape[-1])


# --- KV cache ---------------------------------------------------------------------------

def quantize_kv(x: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per (token, head) quantisation of K or V, x [T, H, D].

    kv4: asymmetric, returns (codes uint8 [T, H, D/2] packed, scale f16 [T, H], zero f16 [T, H]).
    kv8: symmetric, returns (codes int8 [T, H, D], scale f32 [T, H], None).
    Codes are computed from the stored (rounded) scale and zero, so that dequantisation
    reproduces exactly what the kernels see. A (token, head) row holding a NaN or an Inf is
    stored with a NaN scale and zero codes (and, kv4, a NaN zero): attention over it is NaN.
    """
    xf = x.to(torch.float32)
    finite = torch.isfinite(xf).all(-1, keepdim=True)
    if scheme == "kv4":
        mn, mx = xf.amin(-1), xf.amax(-1)
        scale = _poison_nonfinite(_div(mx - mn, 15).clamp_min(1e-4), xf).to(torch.float16)
        zero = _poison_nonfinite(mn, xf).to(torch.float16)
        q = torch.round((xf - zero.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
        q = torch.where(finite, q, 0)
        return F.pack_nibbles(q.to(torch.uint8)), scale, zero
    if scheme == "kv8":
        scale = _poison_nonfinite(_div(xf.abs().amax(-1), 127).clamp_min(1e-8), xf)
        q = torch.round(xf / scale[..., None]).clamp_(-127, 127)
        q = torch.where(finite, q, 0).to(torch.int8)
        return q, scale, None
    raise ValueError(f"kv scheme {scheme!r} is not one of ('kv4', 'kv8')")


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  scheme: str) -> torch.Tensor:
    """Inverse of quantize_kv, in float32."""
    if scheme == "kv4":
        return F.unpack_nibbles(codes).float() * scale.float()[..., None] + zero.float()[..., None]
    return codes.float() * scale.float()[..., None]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE of x [T, H, D] at positions [T] in float64: x[d] cos + rot(x)[d] sin,
    rot(x) = cat(-x[D/2:], x[:D/2]), the angle of pair i being p * steps[i] mod 2**32 in units
    of 2**-32 turns (formats.rope_phase_steps)."""
    x = x.to(device=positions.device, dtype=torch.float64)
    half = x.shape[-1] // 2
    wrap = 1 << F.ROPE_PHASE_BITS
    ph = (positions.long()[:, None] * steps.to(positions.device)[None, :]) % wrap
    ang = torch.where(ph >= wrap // 2, ph - wrap, ph).double() * (2 * math.pi / wrap)
    cos, sin = (torch.cat([t, t], -1)[:, None, :] for t in (ang.cos(), ang.sin()))
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rotate_k_bias(k_bias: F.KRopeBias, positions: torch.Tensor) -> torch.Tensor:
    """RoPE_p(b) [T, H, D] float64 of the k bias (formats.KRopeBias) at cache positions p [T]."""
    b = k_bias.bias[None].expand(positions.shape[0], *k_bias.bias.shape)
    return apply_rope(b, positions, k_bias.steps)


def page_key(key: torch.Tensor, k_smooth: torch.Tensor | None = None,
             k_bias: F.KRopeBias | None = None, positions: torch.Tensor | None = None
             ) -> torch.Tensor:
    """K as the pages and the residual pool hold it: (K - RoPE_p(b)) / k_smooth, in float32
    (each part only when given; positions [>=T] are the tokens' cache positions)."""
    if k_bias is not None:
        if positions is None:
            raise ValueError("bias-aware K (k_bias) needs the tokens' cache positions")
        key = key.float() - rotate_k_bias(k_bias, positions[:key.shape[0]]).float()
    if k_smooth is not None:
        key = key.float() / k_smooth.float()
    return key


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                      slot_mapping: torch.Tensor, layout: F.KVPageLayout,
                      k_smooth: torch.Tensor | None = None, k_bias: F.KRopeBias | None = None,
                      positions: torch.Tensor | None = None) -> None:
    """Quantise key/value [T, H, D] and store them at slot_mapping (block*B + offset).

    Slots < 0 (vLLM's PAD_SLOT_ID) are skipped. K is stored as page_key: reduced by the
    rotated k bias at the token's cache position (`k_bias`, bias-aware K), then divided by
    `k_smooth` [H, D] (SmoothAttention, when it was not folded into k_proj offline).
    """
    key = page_key(key, k_smooth, k_bias, positions)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // layout.block_size, slots % layout.block_size
    planes = F.kv_planes(cache, layout)
    for name, x in (("k", key[keep]), ("v", value[keep])):
        codes, scale, zero = quantize_kv(x, layout.scheme)
        # codes [T, H, C] -> plane [nb, H, B, C] at (blk, :, off)
        planes[f"{name}_codes"][blk, :, off] = codes
        planes[f"{name}_scale"][blk, :, off] = scale
        if zero is not None:
            planes[f"{name}_zero"][blk, :, off] = zero


def gather_kv(cache: torch.Tensor, layout: F.KVPageLayout, block_table: torch.Tensor,
              seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised K and V [seq_len, H, D] (float32) of one sequence."""
    planes = F.kv_planes(cache, layout)
    pos = torch.arange(seq_len, device=cache.device)
    blk = block_table[pos // layout.block_size].long()
    off = pos % layout.block_size
    out = []
    for name in ("k", "v"):
        codes = planes[f"{name}_codes"][blk, :, off]
        scale = planes[f"{name}_scale"][blk, :, off]
        zero = planes[f"{name}_zero"][blk, :, off] if layout.scheme == "kv4" else None
        out.append(dequantize_kv(codes, scale, zero, layout.scheme))
    return out[0], out[1]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              causal: bool = True) -> torch.Tensor:
    """Dense attention of one sequence in float64: q [Tq, Hq, D], k/v [Tk, Hkv, D].

    With causal=True the queries are the last Tq positions of the Tk keys. A key whose K or V
    row holds a NaN or an Inf makes exactly the queries that attend to it NaN
    (docs/RELIABILITY.md); the others are computed without it.
    """
    return attention_lse(q, k, v, scale, causal)[0]


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """attention() and the natural log-sum-exp of each query's scaled scores [Tq, Hq]."""
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    rep = hq // hkv
    qd, kd, vd = (t.to(torch.float64) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(rep, dim=1), vd.repeat_interleave(rep, dim=1)
    bad = ~(torch.isfinite(kd).all(-1) & torch.isfinite(vd).all(-1))  # [Tk, Hq]
    kd, vd = kd.masked_fill(bad[..., None], 0.0), vd.masked_fill(bad[..., None], 0.0)
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    s = s.masked_fill(bad.T[:, None, :], float("nan"))
    if causal:
        qpos = torch.arange(tk - tq, tk, device=s.device)[:, None]
        s = s.masked_fill(torch.arange(tk, device=s.device)[None, :] > qpos, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, vd), torch.logsumexp(s, dim=-1).T


def varlen_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, scale: float,
                     out: torch.Tensor) -> torch.Tensor:
    """FlashAttention's varlen causal attention: row i's queries q[cu_q[i]:cu_q[i+1]] are the
    last positions of its keys key/value[cu_k[i]:cu_k[i+1]] ([>= total, Hkv, D]). Writes
    `out` [T, Hq, D] and returns the natural log-sum-exp [Hq, T] fp32."""
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32,
                     device=q.device)
    for i in range(cu_seqlens_q.shape[0] - 1):
        s, e = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if e > s:
            o, l = attention_lse(q[s:e], key[ks:ke], value[ks:ke], scale, causal=True)
            out[s:e] = o.to(out.dtype)
            lse[:, s:e] = l.T.float()
    return lse


def chunk_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    """Causal attention of each row's queries over the row's own new tokens only (this step's
    16-bit K/V, laid out like q: key/value [>= T, Hkv, D]) into `out` [T, Hq, D]; returns the
    natural log-sum-exp [Hq, T] fp32. FlashAttention's varlen call with cu_seqlens_k =
    cu_seqlens_q computes this (kernels.chunk_attention): exact prefill then merges the
    cached context into it (prefill_attention's chunk_lse). max_query_len is unused here."""
    return varlen_attention(q, key, value, query_start_loc, query_start_loc, scale, out)


def gather_context_kv(cache: torch.Tensor, layout: F.KVPageLayout, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out_k: torch.Tensor, out_v: torch.Tensor, num_rows: int,
                      max_seqlen_k: int, residual=None, k_smooth: torch.Tensor | None = None,
                      k_bias: F.KRopeBias | None = None) -> None:
    """Exact prefill's 16-bit workspace (formats.context_seqlens): out_k/out_v[cu_k[i]:
    cu_k[i+1]] = row i's cached context (dequantised pages, valid residual entries
    substituted; K back in model space: times k_smooth, plus RoPE_j(b)), then its new tokens'
    key/value (laid out like the queries). varlen_attention over it is exact prefill with no
    merge. max_seqlen_k bounds the rows' lengths (the GPU kernel's grid); unused here."""
    for i in range(num_rows):
        s, e = int(query_start_loc[i]), int(query_start_loc[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        ctx = (ke - ks) - (e - s)
        if ctx > 0:
            k, v = gather_kv_residual(cache, layout, block_table[i], ctx + (e - s), residual)
            k, v = k[:ctx].double(), v[:ctx]
            if k_smooth is not None:
                k = k * k_smooth.double()
            if k_bias is not None:
                k = k + rotate_k_bias(k_bias, torch.arange(ctx, device=k.device))
            out_k[ks:ks + ctx] = k.to(out_k.dtype)
            out_v[ks:ks + ctx] = v.to(out_v.dtype)
        out_k[ks + ctx:ke] = key[s:e]
        out_v[ks + ctx:ke] = value[s:e]


def paged_attention(q: torch.Tensor, cache: torch.Tensor, layout: F.KVPageLayout,
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a ragged batch over the quantised paged cache.

    q [T, Hq, D] with sequence i's queries at query_start_loc[i]:query_start_loc[i+1],
    which are the last positions of its seq_lens[i] tokens (all already in the cache).
    """
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i in range(seq_lens.shape[0]):
        s, e = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if e == s:
            continue
        k, v = gather_kv(cache, layout, block_table[i], int(seq_lens[i]))
        out[s:e] = attention(q[s:e], k, v, scale, causal=True)
    return out


# --- KV residual window (attention_backend/residual.py) ----------------------------------
# Pages always hold every token quantised. In addition, blocks that own a slot of a small
# per-layer pool keep a 16-bit copy of what was written into them. When attending, key
# position j of a sequence of L tokens is read from the pool iff j >= L - R (the newest R
# tokens) and the pool entry is valid: slot_of_block[blk] = p >= 0 and tags[p, off] == blk.
# Everything else is read from the quantised pages.

def store_kv_residual(key: torch.Tensor, value: torch.Tensor, res_k: torch.Tensor,
                      res_v: torch.Tensor, slot_mapping: torch.Tensor,
                      slot_of_block: torch.Tensor, block_size: int,
                      k_smooth: torch.Tensor | None = None, k_bias: F.KRopeBias | None = None,
                      positions: torch.Tensor | None = None) -> None:
    """Copy the written K/V [T, H, D] of blocks that own a pool slot into res_k/res_v.

    res_k/res_v are [P*B, H, D]; the token at slot blk*B + off of a block with pool slot
    p = slot_of_block[blk] >= 0 goes to row p*B + off. K is stored as the pages see it
    (page_key), rounded to the pool dtype. A row holding a NaN or an Inf is
    stored as all NaN, as its page entry is (quantize_kv).
    """
    key = page_key(key, k_smooth, k_bias, positions)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    p = slot_of_block[blk].long()
    has = p >= 0
    rows = p[has] * block_size + off[has]

    def copy(x):  # a (token, head) row holding a NaN/Inf is copied as all NaN (quantize_kv)
        x = x[keep][has]
        return torch.where(torch.isfinite(x).all(-1, keepdim=True), x, _NAN)

    res_k[rows] = copy(key).to(res_k.dtype)
    res_v[rows] = copy(value).to(res_v.dtype)


def gather_kv_residual(cache: torch.Tensor, layout: F.KVPageLayout, block_table: torch.Tensor,
                       seq_len: int, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv, with the valid residual entries of the newest R tokens substituted.

    residual = (res_k, res_v, slot_of_block, tags, R) or None (pages only).
    """
    k, v = gather_kv(cache, layout, block_table, seq_len)
    if residual is None or residual[4] <= 0:
        return k, v
    res_k, res_v, slot_of_block, tags, r = residual
    b = layout.block_size
    pos = torch.arange(max(seq_len - r, 0), seq_len, device=block_table.device)
    blk = block_table[pos // b].long()
    off = pos % b
    p = slot_of_block[blk].long()
    rows = p.clamp_min(0) * b + off
    ok = (p >= 0) & (tags.reshape(-1)[rows].long() == blk)
    k[pos[ok]] = res_k[rows[ok]].float()
    v[pos[ok]] = res_v[rows[ok]].float()
    return k, v


def paged_attention_residual(q: torch.Tensor, cache: torch.Tensor, layout: F.KVPageLayout,
                             block_table: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, scale: float, residual=None,
                             k_smooth: torch.Tensor | None = None,
                             k_bias: F.KRopeBias | None = None,
                             chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                             chunk_raw: bool = False) -> torch.Tensor:
    """paged_attention with the residual window, SmoothAttention and bias-aware K.

    With k_smooth [Hkv, D] the pages hold K / k_smooth, so the query is multiplied by it
    (rounded back to q's dtype, as the kernels feed it to the tensor cores). With k_bias
    the pages hold (K - RoPE_j(b)) / k_smooth at key position j, and every score gets
    q . RoPE_j(b) back, computed with the unsmoothed query (the same as adding
    RoPE_j(b) / k_smooth to each dequantised K row, without the rounding of q * k_smooth).

    chunk_kv = (key, value) [T, Hkv, D] (exact prefill): rows of query length > 1 read their
    own new tokens from it, K as key / k_smooth rounded to q's dtype and with no bias term.
    chunk_raw: those tokens' scores are the raw q . key instead, without SmoothAttention's
    roundings (what FlashAttention computes on the step's q/k/v, chunk_attention).
    """
    q_raw = q
    if k_smooth is not None:
        rep = q.shape[1] // k_smooth.shape[0]
        q = (q.float() * k_smooth.float().repeat_interleave(rep, dim=0)).to(q.dtype)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for i in range(seq_lens.shape[0]):
        s, e = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if e == s:
            continue
        n = int(seq_lens[i])
        k, v = gather_kv_residual(cache, layout, block_table[i], n, residual)
        k_extra = None if k_bias is None else rotate_k_bias(k_bias, torch.arange(n, device=k.device))
        if chunk_kv is not None and e - s > 1:
            new = slice(n - (e - s), n)
            v[new] = chunk_kv[1][s:e].float()
            if chunk_raw:  # scored by the raw query in the extra columns below
                k_extra = torch.zeros_like(k, dtype=torch.float64) if k_extra is None else k_extra
                k[new] = 0.0
                k_extra[new] = chunk_kv[0][s:e].double()
            else:
                k[new] = page_key(chunk_kv[0][s:e], k_smooth).to(q.dtype).float()
                if k_extra is not None:
                    k_extra[new] = 0.0  # the raw K holds its bias
        qi = q[s:e]
        if k_extra is not None:  # extra columns: [q, q_raw] . [k, RoPE_j(b) or raw chunk K]
            qi = torch.cat([qi.double(), q_raw[s:e].double()], -1)
            k = torch.cat([k.double(), k_extra], -1)
        out[s:e] = attention(qi, k, v, scale, causal=True)
    return out
