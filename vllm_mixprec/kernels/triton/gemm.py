"""Triton kernels of the W4A8 and W4Ax linear layers: the portable path (sm80+), and what
the CPU interpreter tests.

Every public function has the signature of its reference.py twin, plus keyword-only
`out=` (write into a given tensor) and `config=` (a GemmConfig instead of the shape-based
default; tests and benchmark sweeps use it).

GEMM design (LiquidGEMM's recipe, within what Triton controls):
  * weights stay packed in HBM (qweight uint8 [N, K/2], read as int32 words of 8 nibbles);
    they are dequantized to exact int8 in registers with LiquidQuant's lane arithmetic:
    per 32-bit word, 4 byte lanes at a time, (q * s + a) ^ 0x80 (formats.py). No lane
    carries, so one IMAD and one XOR serve four weights;
  * int8 x int8 -> int32 tensor-core dots: the group parameters make the weights exact
    int8, so no per-group float rescaling is needed in the main loop. W4A8 sums over the
    whole of K in int32 and its epilogue applies x_scale[m] * channel_scale[n] (+ bias) once;
  * by default the weight tile is the left operand (Y^T = W X^T, "swap AB"): the tokens
    become the narrow MMA dimension (16 at decode), and on Hopper the dequantized weights
    can feed wgmma from registers;
  * split-K for small M: the last CTA of a tile (per-tile arrival counter) applies the
    epilogue. W4A8 adds its int32 partial sums with integer atomics into a zeroed workspace;
    W4Ax stores one fp32 partial plane per split, which the last CTA sums in split order.
    Either way the result does not depend on the arrival order: deterministic, bit for bit.
W4Ax is the same kernel with a second K range whose activations are int4 (moved to the high
nibble of int8 lanes in registers) and one activation scale per (token, ACT_BLOCK-channel
block) (COMET): BK divides ACT_BLOCK, so each k-iteration's exact int32 partial lies in one
block, and the K loop converts it to fp32 and multiplies it by its rows' block scale into
an fp32 accumulator; the epilogue applies channel_scale[n] (+ bias).

Everything is CUDA-graph capturable: no host syncs, only shape arithmetic on the host.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ... import envs
from ... import formats as F
from ... import reference as ref
from . import capability_major

_EPS = tl.constexpr(1e-8)  # reference._EPS
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ACT_BLOCK = tl.constexpr(F.ACT_BLOCK)
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# 1.5 * 2**23: in fp32, (v + M) - M rounds |v| < 2**22 half to even, like torch.round
_ROUND_MAGIC = tl.constexpr(12582912.0)
_INF = tl.constexpr(float("inf"))
# No NaN global: Triton re-checks globals by ==, and NaN != NaN fails every launch.


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


# ======================================================================================
# Triton helpers (shared by the W4A8 and W4Ax paths)
# ======================================================================================

@triton.jit
def _word_pair_bytes(a, b):
    """uint32 [..., W] words a, b -> int8 [..., W, 2, 2, 2]: flattens to the bytes of a
    (low first), then those of b. LLVM folds this to a register bitcast."""
    e0 = tl.join(a.to(tl.int8), b.to(tl.int8))
    e1 = tl.join((a >> 8).to(tl.int8), (b >> 8).to(tl.int8))
    e2 = tl.join((a >> 16).to(tl.int8), (b >> 16).to(tl.int8))
    e3 = tl.join((a >> 24).to(tl.int8), (b >> 24).to(tl.int8))
    return tl.join(tl.join(e0, e2), tl.join(e1, e3))


@triton.jit
def _interleave_lanes(lo, hi, USE_ASM: tl.constexpr):
    """Byte lanes lo = (k0, k2, k4, k6), hi = (k1, k3, k5, k7) -> words (k0..k3), (k4..k7).

    On the GPU one PRMT each: LLVM turns the portable shift/mask form into ~6 SHF/PRMT per
    word. The interpreter (no PTX) runs the portable form; both are exact."""
    if USE_ASM:
        a = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5140;", "=r,r,r", [lo, hi],
                                      dtype=tl.uint32, is_pure=True, pack=1)
        b = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7362;", "=r,r,r", [lo, hi],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    else:
        a = (lo & 0xFF) | ((hi & 0xFF) << 8) | ((lo & 0xFF00) << 8) | ((hi & 0xFF00) << 16)
        b = ((lo >> 16) & 0xFF) | ((hi >> 8) & 0xFF00) | ((lo >> 8) & 0xFF0000) | (hi & 0xFF000000)
    return a, b


@triton.jit
def _lqq_dequant_words(words, step, offset, USE_ASM: tl.constexpr):
    """LiquidQuant level 2 on whole words: int32 [..., W] of 8 nibbles (even k low) with
    step/offset broadcastable to it -> int8 [..., W, 2, 2, 2] (flattens to k order).

    Lane-exact: q <= 15, s <= 16, q*s + a <= 255 in every byte lane (formats.py), so the
    32-bit multiply-add never carries between lanes."""
    w = words.to(tl.uint32, bitcast=True)
    s = step.to(tl.uint32)
    a4 = offset.to(tl.uint32) * 0x01010101
    lo = ((w & 0x0F0F0F0F) * s + a4) ^ 0x80808080
    hi = (((w >> 4) & 0x0F0F0F0F) * s + a4) ^ 0x80808080
    return _word_pair_bytes(*_interleave_lanes(lo, hi, USE_ASM))


@triton.jit
def _group_params(gs_ptr, go_ptr, rows, n_mask, k0, K, stride_g,
                  BK: tl.constexpr, G: tl.constexpr):
    """(step, offset) uint8 [BN, BK / CH] of the column chunks k0 .. k0+BK (clamped in K)."""
    CH: tl.constexpr = BK if BK < G else G  # columns sharing one (step, offset)
    c = tl.arange(0, BK // CH)
    k0 = min(k0, K - BK)
    gp = rows[:, None] * stride_g + ((k0 + c * CH) // G)[None, :]
    step = tl.load(gs_ptr + gp, mask=n_mask[:, None], other=0)
    off = tl.load(go_ptr + gp, mask=n_mask[:, None], other=128)
    return step, off


@triton.jit
def _weight_tile(qw_ptr, step, off, rows, n_mask, k0, stride_qw,
                 BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr):
    """Exact int8 weights [BN, BK] of rows `rows`, columns k0 .. k0+BK."""
    CH: tl.constexpr = BK if BK < G else G
    CHW: tl.constexpr = CH // 8  # int32 words per chunk
    c = tl.arange(0, BK // CH)
    kw = k0 // 8 + c[None, :, None] * CHW + tl.arange(0, CHW)[None, None, :]
    words = tl.load(qw_ptr + rows[:, None, None] * stride_qw + kw, mask=n_mask[:, None, None],
                    other=0)
    w8 = _lqq_dequant_words(words, step[:, :, None], off[:, :, None], USE_ASM)
    return tl.reshape(w8, (BN, BK))


@triton.jit
def _act_tile(x_ptr, stride_x, offs_m, m_mask, kx, BM: tl.constexpr, BK: tl.constexpr,
              INT4: tl.constexpr, USE_ASM: tl.constexpr):
    """int8 activations [BM, BK] at column kx.

    INT4: x_ptr holds int32 words of 8 two's complement nibbles q (even k low), each standing
    for q + 1/2 (formats.A4_TOP). Each nibble is moved to the high half of its byte lane and
    the low half set to 8, which makes the byte 16 q + 8 = 16 (q + 1/2) (COMET's zero-extension
    trick plus one OR; 5 instructions per 8 values); the epilogue divides by 16."""
    rows = offs_m.to(tl.int64)[:, None] * stride_x
    if INT4:
        w = tl.load(x_ptr + rows + (kx // 8 + tl.arange(0, BK // 8))[None, :],
                    mask=m_mask[:, None], other=0).to(tl.uint32, bitcast=True)
        x = _word_pair_bytes(*_interleave_lanes(((w << 4) & 0xF0F0F0F0) | 0x08080808,
                                                (w & 0xF0F0F0F0) | 0x08080808, USE_ASM))
        x = tl.reshape(x, (BM, BK))
    else:
        x = tl.load(x_ptr + rows + (kx + tl.arange(0, BK))[None, :], mask=m_mask[:, None], other=0)
    return x


@triton.jit
def _k_loop(acc, x_ptr, stride_x, s_ptr, stride_s, it_lo, it_hi, it_x0, qw_ptr, gs_ptr, go_ptr,
            offs_m, m_mask, offs_n, n_mask, K, stride_qw, stride_g,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr,
            INT4: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_SCALES: tl.constexpr,
            USE_ASM: tl.constexpr):
    """acc += GEMM over weight k-iterations [it_lo, it_hi); activation iteration it - it_x0.

    BLOCK_SCALES=False (W4A8): acc is int32, the exact sum over the iterations.
    BLOCK_SCALES=True (W4Ax): acc is fp32; each iteration's exact int32 partial lies in one
    activation block (BK divides ACT_BLOCK) and is added times its rows' scale of that block,
    s[m, (it - it_x0) * BK / ACT_BLOCK] (/ 16 for INT4: the codes are 16 * value)."""
    rows = offs_n.to(tl.int64)
    step, off = _group_params(gs_ptr, go_ptr, rows, n_mask, it_lo * BK, K, stride_g, BK, G)
    for it in range(it_lo, it_hi):
        # group params are 1-byte loads, too narrow for the async-copy pipeline that
        # carries the weights: fetch them one iteration ahead by hand
        nstep, noff = _group_params(gs_ptr, go_ptr, rows, n_mask, (it + 1) * BK, K, stride_g,
                                    BK, G)
        w = _weight_tile(qw_ptr, step, off, rows, n_mask, it * BK, stride_qw, BN, BK, G, USE_ASM)
        x = _act_tile(x_ptr, stride_x, offs_m, m_mask, (it - it_x0) * BK, BM, BK, INT4, USE_ASM)
        if BLOCK_SCALES:
            sc = tl.load(s_ptr + offs_m.to(tl.int64) * stride_s + (it - it_x0) * BK // _ACT_BLOCK,
                         mask=m_mask, other=0.0)
            if INT4:
                sc = sc * 0.0625
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(x), out_dtype=tl.int32).to(tl.float32) * sc[None, :]
            else:
                acc += tl.dot(x, tl.trans(w), out_dtype=tl.int32).to(tl.float32) * sc[:, None]
        elif SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.int32)  # [BN, BM]
        else:
            acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)  # [BM, BN]
        step, off = nstep, noff
    return acc


@triton.jit
def _store_output(acc, mm, nn, mask, s8_ptr, cs_ptr, bias_ptr, out_ptr, stride_out,
                  BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y = acc * channel_scale[n] + bias[n] -> out dtype. W4A8 (int32 acc) first multiplies
    by the token scale s8[m]; W4Ax's fp32 acc already holds its block scales."""
    if BLOCK_SCALES:
        y = acc
    else:
        y = acc.to(tl.float32) * tl.load(s8_ptr + mm, mask=mask, other=0.0)
    y = y * tl.load(cs_ptr + nn, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + nn, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + mm.to(tl.int64) * stride_out + nn, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: GROUP_M row tiles share each weight tile while it is in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid, pid_m, pid_n


@triton.jit
def _lqq_gemm_kernel(
        x8_ptr, s8_ptr, x4_ptr, s4_ptr, qw_ptr, gs_ptr, go_ptr, cs_ptr, bias_ptr, out_ptr, ws_ptr,
        cnt_ptr, M, N, K, K8, stride_x8, stride_x4, stride_s8, stride_s4, stride_out, stride_qw,
        stride_g, G: tl.constexpr, HAS_A4: tl.constexpr, BLOCK_SCALES: tl.constexpr,
        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr, GROUP_M: tl.constexpr,
        USE_ASM: tl.constexpr):
    """Y[M, N] from int8 activations on k < K8 (x8) and int4 ones on k >= K8 (x4, as int32
    words; W4Ax only). Grid: (tiles, SPLIT_K)."""
    pid, pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N

    # this split's k-iterations; [0, T8) read x8, [T8, T) read x4
    T = K // BK
    T8 = K8 // BK
    chunk = tl.cdiv(T, SPLIT_K)
    it0 = tl.program_id(1) * chunk
    it1 = min(it0 + chunk, T)

    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=tl.int32)
        mm = offs_m[None, :]
        nn = offs_n[:, None]
    else:
        acc = tl.zeros((BM, BN), dtype=tl.int32)
        mm = offs_m[:, None]
        nn = offs_n[None, :]
    mask = (mm < M) & (nn < N)
    if BLOCK_SCALES:
        acc = acc.to(tl.float32)
    acc = _k_loop(acc, x8_ptr, stride_x8, s8_ptr, stride_s8, it0, min(it1, T8), 0, qw_ptr,
                  gs_ptr, go_ptr, offs_m, m_mask, offs_n, n_mask, K, stride_qw, stride_g,
                  BM, BN, BK, G, False, SWAP_AB, BLOCK_SCALES, USE_ASM)
    if HAS_A4:
        acc = _k_loop(acc, x4_ptr, stride_x4, s4_ptr, stride_s4, max(it0, T8), it1, T8, qw_ptr,
                      gs_ptr, go_ptr, offs_m, m_mask, offs_n, n_mask, K, stride_qw, stride_g,
                      BM, BN, BK, G, True, SWAP_AB, BLOCK_SCALES, USE_ASM)

    if SPLIT_K == 1:
        _store_output(acc, mm, nn, mask, s8_ptr, cs_ptr, bias_ptr, out_ptr, stride_out,
                      BLOCK_SCALES, HAS_BIAS)
    else:
        # partials into the workspace; the last CTA of the tile to arrive owns the epilogue.
        # W4A8: exact int32 atomics into one zeroed plane. W4Ax: one fp32 plane per split,
        # summed in split order. Neither result depends on the arrival order.
        tile = mm.to(tl.int64) * N + nn
        if BLOCK_SCALES:
            tl.store(ws_ptr + tile + tl.program_id(1).to(tl.int64) * M * N, acc, mask=mask)
        else:
            tl.atomic_add(ws_ptr + tile, acc, mask=mask, sem="relaxed")
        tl.debug_barrier()  # all of this CTA's partials are issued before it arrives
        if tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1:
            if BLOCK_SCALES:
                acc = tl.zeros_like(acc)
                part = ws_ptr + tile
                for _ in range(SPLIT_K):
                    acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")  # from L2
                    part += M * N
            else:
                acc = tl.load(ws_ptr + tile, mask=mask, other=0, cache_modifier=".cg")
            _store_output(acc, mm, nn, mask, s8_ptr, cs_ptr, bias_ptr, out_ptr, stride_out,
                          BLOCK_SCALES, HAS_BIAS)


# --- activation quantisation ----------------------------------------------------------

@triton.jit
def _silu_libdevice(g):
    """torch's silu in fp32, bit for bit: g / (1 + expf(-g)), expf from libdevice as in ATen."""
    return tl.math.div_rn(g, 1.0 + libdevice.exp(-g))


@triton.jit
def _silu_interpreted(g):
    """The CPU interpreter has no libdevice; its tl.exp is numpy's expf."""
    return tl.math.div_rn(g, 1.0 + tl.exp(-g))


_silu = _silu_interpreted if _interpreting() else _silu_libdevice


@triton.jit
def _rounded_as(v, like):
    """fp32 v rounded to like's dtype (nearest even), back in fp32. bf16 is rounded in the
    bits, since the CPU interpreter's bf16 cast truncates; NaN is kept apart (the GPU's NaN,
    0x7FFFFFFF, would carry into the sign bit and come out as -0)."""
    if like.dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return tl.where(v == v, b.to(tl.float32, bitcast=True), v)
    return v.to(like.dtype).to(tl.float32)


@triton.jit
def _act_values(xrow, perm_ptr, smooth_ptr, j, mask, up, PERM_UNIT: tl.constexpr,
                HAS_SMOOTH: tl.constexpr, GATED: tl.constexpr):
    """fp32 values of (permuted) columns j of one row, divided by smooth (as the reference).
    PERM_UNIT: 0 no permutation, else the channels of one perm_ptr entry (1, or ACT_BLOCK for
    a block permutation). GATED: the row is [gate | up] (up at column offset `up`) and the
    value is vLLM's SiluAndMul, silu(gate) * up, rounded to the row's dtype after each op as
    torch does."""
    if PERM_UNIT == 0:  # no permutation
        c = j
    elif PERM_UNIT == 1:  # an entry a channel
        c = tl.load(perm_ptr + j, mask=mask, other=0)
    else:  # an entry a block of PERM_UNIT channels (formats.act_block_perm): a broadcast load
        c = tl.load(perm_ptr + j // PERM_UNIT, mask=mask, other=0) * PERM_UNIT + j % PERM_UNIT
    v = tl.load(xrow + c, mask=mask, other=0.0)
    if GATED:
        u = tl.load(xrow + up + c, mask=mask, other=0.0)
        v = _rounded_as(_rounded_as(_silu(v.to(tl.float32)), u) * u.to(tl.float32), u)
    v = v.to(tl.float32)
    if HAS_SMOOTH:
        v = tl.math.div_rn(v, tl.load(smooth_ptr + c, mask=mask, other=1.0).to(tl.float32))
    return v


@triton.jit
def _codes(v, scale, QMAX: tl.constexpr, HALF: tl.constexpr):
    """round(v / scale) half to even, clamped to [-QMAX, QMAX]; bit-exact with torch. HALF
    (formats.A4_TOP, QMAX = 7.5): floor(v / scale) in [-QMAX - 1/2, QMAX - 1/2], the nibble
    of the nearest half-integer (reference._quantize_sym(half=True)). A NaN scale (non-finite
    row) gives zero codes, as in the reference."""
    q = tl.math.div_rn(v, scale)
    if HALF:
        q = tl.minimum(tl.maximum(tl.floor(q), -QMAX - 0.5), QMAX - 0.5)
    else:
        q = (q + _ROUND_MAGIC) - _ROUND_MAGIC
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    return tl.where(scale == scale, q, 0.0).to(tl.int8)


@triton.jit
def _num_nonfinite(v0, v1):
    """Count of NaN/Inf values in two tiles. GPU max reductions drop NaN (max.f32), so the
    amax alone cannot see it; an integer sum can."""
    return (tl.sum(tl.where(tl.abs(v0) < _INF, 0, 1).to(tl.int32))
            + tl.sum(tl.where(tl.abs(v1) < _INF, 0, 1).to(tl.int32)))


@triton.jit
def _scale_of(amax, nonfinite, QMAX: tl.constexpr):
    """amax / QMAX, or NaN for a row holding a NaN/Inf (reference._poison_nonfinite)."""
    s = tl.math.div_rn(tl.maximum(amax, _EPS), QMAX * 1.0)
    return tl.where(nonfinite == 0, s, float("nan"))


@triton.jit
def _segment_values(xrow, perm_ptr, smooth_ptr, j0, bb, mask, up, PAIRS: tl.constexpr,
                    PERM_UNIT: tl.constexpr, HAS_SMOOTH: tl.constexpr, GATED: tl.constexpr):
    """Values behind output bytes bb: columns j0+2bb and j0+2bb+1 (PAIRS), else j0+bb twice."""
    if PAIRS:
        v0 = _act_values(xrow, perm_ptr, smooth_ptr, j0 + 2 * bb, mask, up, PERM_UNIT,
                         HAS_SMOOTH, GATED)
        v1 = _act_values(xrow, perm_ptr, smooth_ptr, j0 + 2 * bb + 1, mask, up, PERM_UNIT,
                         HAS_SMOOTH, GATED)
    else:
        v0 = _act_values(xrow, perm_ptr, smooth_ptr, j0 + bb, mask, up, PERM_UNIT, HAS_SMOOTH,
                         GATED)
        v1 = v0
    return v0, v1


@triton.jit
def _encode(v0, v1, scale, QMAX: tl.constexpr, PAIRS: tl.constexpr):
    """Output bytes: int8 codes of v0, or the 4-bit nibbles (half-integer grid) of (v0, v1)
    packed low/high."""
    q = _codes(v0, scale, QMAX, PAIRS)
    if PAIRS:
        q = (q & 0xF) | (_codes(v1, scale, QMAX, PAIRS) << 4)
    return q


@triton.jit
def _amax(v0, v1):
    return tl.maximum(tl.max(tl.abs(v0)), tl.max(tl.abs(v1)))


@triton.jit
def _butterflies(v, BM: tl.constexpr, BLOCK: tl.constexpr, LOG2_N: tl.constexpr):
    """reference.hadamard_a4_blocks' butterflies on v float32 [BM, BLOCK]: (a + b, a - b) on the
    channel pairs (i, i + s), s = 1, 2, .., 2^(LOG2_N - 1); the same float32 operations in the
    same order, so the same bits (the norm's multiply is the caller's)."""
    for i in tl.static_range(LOG2_N):
        pairs = tl.permute(tl.reshape(v, (BM, BLOCK // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(pairs)
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BM, BLOCK))
    return v


@triton.jit
def _hadamard_pairs(v0, v1, R: tl.constexpr, BB: tl.constexpr, LOG2_N: tl.constexpr,
                    NORM: tl.constexpr):
    """reference.hadamard_a4_blocks on blocks held as their even (v0) and odd (v1) channels,
    [R, BB] each, a block a row: the stride-1 butterfly pairs v0 with v1, and the stride-s ones
    (s >= 2) pair channel j with j + s/2 within each."""
    return (_butterflies(v0 + v1, R, BB, LOG2_N - 1) * NORM,
            _butterflies(v0 - v1, R, BB, LOG2_N - 1) * NORM)


@triton.jit
def _chunk_values(xrow, perm_ptr, smooth_ptr, j0, nb, c, up, R: tl.constexpr, BB: tl.constexpr,
                  PAIRS: tl.constexpr, PERM_UNIT: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                  GATED: tl.constexpr, ROT_LOG2: tl.constexpr, ROT_NORM: tl.constexpr):
    """Chunk c of a segment of nb output bytes at column j0: R rows of BB bytes. Returns the
    values behind the bytes (v0, v1 [R, BB], zero where masked), the byte offsets and mask.
    ROT_LOG2 > 0 (4-bit pairs, a row a block): each block rotated (_hadamard_pairs)."""
    bb = (c * R + tl.arange(0, R))[:, None] * BB + tl.arange(0, BB)[None, :]
    mask = bb < nb
    v0, v1 = _segment_values(xrow, perm_ptr, smooth_ptr, j0, bb, mask, up, PAIRS, PERM_UNIT,
                             HAS_SMOOTH, GATED)
    if PAIRS and ROT_LOG2 > 0:
        v0, v1 = _hadamard_pairs(v0, v1, R, BB, ROT_LOG2, ROT_NORM)
    return v0, v1, bb, mask


@triton.jit
def _segment_stats(xrow, perm_ptr, smooth_ptr, j0, nb, up, R: tl.constexpr, BB: tl.constexpr,
                   NCHUNK: tl.constexpr, PAIRS: tl.constexpr, PERM_UNIT: tl.constexpr,
                   HAS_SMOOTH: tl.constexpr, GATED: tl.constexpr, ROT_LOG2: tl.constexpr,
                   ROT_NORM: tl.constexpr):
    """(max |x|, number of NaN/Inf) over a whole segment, chunk by chunk."""
    amax = 0.0
    bad = 0
    for c in range(NCHUNK):
        v0, v1, bb, mask = _chunk_values(xrow, perm_ptr, smooth_ptr, j0, nb, c, up, R, BB,
                                         PAIRS, PERM_UNIT, HAS_SMOOTH, GATED, ROT_LOG2, ROT_NORM)
        amax = tl.maximum(amax, _amax(v0, v1))
        bad += _num_nonfinite(v0, v1)
    return amax, bad


@triton.jit
def _encode_chunk(v0, v1, bb, mask, c, nb, qrow, srow, amax, bad, QMAX: tl.constexpr,
                  PAIRS: tl.constexpr, PER_BLOCK: tl.constexpr, R: tl.constexpr,
                  BB: tl.constexpr):
    """Codes of chunk c (_chunk_values) -> qrow, and its scales -> srow.

    PER_BLOCK: each row of the chunk is one activation block with its own scale (its max |x|),
    stored at srow[block]. Else one scale for the segment, from `amax` (over all of it), at
    srow[0]. `bad` counts the NaN/Inf values of the token's whole row: any makes every scale
    NaN and every code zero (reference._quantize_sym)."""
    if PER_BLOCK:
        blk = c * R + tl.arange(0, R)
        scale = _scale_of(tl.maximum(tl.max(tl.abs(v0), axis=1), tl.max(tl.abs(v1), axis=1)),
                          bad, QMAX)
        tl.store(srow + blk, scale, mask=blk * BB < nb)
        scale = scale[:, None]
    else:
        scale = _scale_of(amax, bad, QMAX)
        tl.store(srow, scale)
    tl.store(qrow + bb, _encode(v0, v1, scale, QMAX, PAIRS), mask=mask)


@triton.jit
def _encode_segment(xrow, perm_ptr, smooth_ptr, j0, nb, qrow, srow, amax, bad, up,
                    QMAX: tl.constexpr, PAIRS: tl.constexpr, PER_BLOCK: tl.constexpr,
                    R: tl.constexpr, BB: tl.constexpr, NCHUNK: tl.constexpr,
                    PERM_UNIT: tl.constexpr, HAS_SMOOTH: tl.constexpr, GATED: tl.constexpr,
                    ROT_LOG2: tl.constexpr, ROT_NORM: tl.constexpr):
    """_encode_chunk over a whole segment, reading it chunk by chunk."""
    for c in range(NCHUNK):
        v0, v1, bb, mask = _chunk_values(xrow, perm_ptr, smooth_ptr, j0, nb, c, up, R, BB,
                                         PAIRS, PERM_UNIT, HAS_SMOOTH, GATED, ROT_LOG2, ROT_NORM)
        _encode_chunk(v0, v1, bb, mask, c, nb, qrow, srow, amax, bad, QMAX, PAIRS, PER_BLOCK,
                      R, BB)


@triton.jit
def _quant_act_kernel(x_ptr, perm_ptr, smooth_ptr, x8_ptr, s8_ptr, x4_ptr, s4_ptr,
                      K, K8, stride_x, stride_x8, stride_x4, stride_s8, stride_s4,
                      PERM_UNIT: tl.constexpr, HAS_SMOOTH: tl.constexpr, GATED: tl.constexpr,
                      HAS_A8: tl.constexpr, HAS_A4: tl.constexpr, PER_BLOCK: tl.constexpr,
                      ONE_PASS: tl.constexpr, R8: tl.constexpr, BB8: tl.constexpr,
                      NCHUNK8: tl.constexpr, R4: tl.constexpr, BB4: tl.constexpr,
                      NCHUNK4: tl.constexpr, ROT_LOG2: tl.constexpr, ROT_NORM: tl.constexpr):
    """One row per program: columns [0, K8) -> int8 (x8, s8), [K8, K) -> packed int4 (x4, s4).

    Scales: one per segment (quantize_act), or one per ACT_BLOCK-channel block (PER_BLOCK,
    W4Ax: chunk rows are blocks). ONE_PASS keeps the whole row in registers (x is read once);
    longer rows are read twice, the second time mostly from L2. GATED: x rows are [gate | up]
    of width 2K, quantized as SiluAndMul(x) (_act_values). ROT_LOG2 > 0 (W4Ax act_rotation):
    each 4-bit block rotated by Hadamard transforms of width 2^ROT_LOG2, norm ROT_NORM."""
    row = tl.program_id(0).to(tl.int64)
    xrow = x_ptr + row * stride_x
    q8 = x8_ptr + row * stride_x8
    q4 = x4_ptr + row * stride_x4
    sr8 = s8_ptr + row * stride_s8
    sr4 = s4_ptr + row * stride_s4
    N4 = (K - K8) // 2  # bytes of the int4 part
    amax8 = 0.0
    amax4 = 0.0
    bad = 0
    if ONE_PASS:
        if HAS_A8:
            a0, a1, ab, am = _chunk_values(xrow, perm_ptr, smooth_ptr, 0, K8, 0, K, R8, BB8,
                                           False, PERM_UNIT, HAS_SMOOTH, GATED, 0, 1.0)
            amax8 = _amax(a0, a1)
            bad += _num_nonfinite(a0, a1)
        if HAS_A4:
            b0, b1, bb, bm = _chunk_values(xrow, perm_ptr, smooth_ptr, K8, N4, 0, K, R4, BB4,
                                           True, PERM_UNIT, HAS_SMOOTH, GATED, ROT_LOG2, ROT_NORM)
            amax4 = _amax(b0, b1)
            bad += _num_nonfinite(b0, b1)
        if HAS_A8:
            _encode_chunk(a0, a1, ab, am, 0, K8, q8, sr8, amax8, bad, 127, False, PER_BLOCK,
                          R8, BB8)
        if HAS_A4:
            _encode_chunk(b0, b1, bb, bm, 0, N4, q4, sr4, amax4, bad, 7.5, True, PER_BLOCK, R4,
                          BB4)  # 7.5: formats.A4_TOP
    else:
        if HAS_A8:
            amax8, bad8 = _segment_stats(xrow, perm_ptr, smooth_ptr, 0, K8, K, R8, BB8, NCHUNK8,
                                         False, PERM_UNIT, HAS_SMOOTH, GATED, 0, 1.0)
            bad += bad8
        if HAS_A4:
            amax4, bad4 = _segment_stats(xrow, perm_ptr, smooth_ptr, K8, N4, K, R4, BB4, NCHUNK4,
                                         True, PERM_UNIT, HAS_SMOOTH, GATED, ROT_LOG2, ROT_NORM)
            bad += bad4
        if HAS_A8:
            _encode_segment(xrow, perm_ptr, smooth_ptr, 0, K8, q8, sr8, amax8, bad, K, 127,
                            False, PER_BLOCK, R8, BB8, NCHUNK8, PERM_UNIT, HAS_SMOOTH, GATED, 0, 1.0)
        if HAS_A4:
            _encode_segment(xrow, perm_ptr, smooth_ptr, K8, N4, q4, sr4, amax4, bad, K, 7.5, True,
                            PER_BLOCK, R4, BB4, NCHUNK4, PERM_UNIT, HAS_SMOOTH, GATED, ROT_LOG2,
                            ROT_NORM)


@triton.jit
def _quant_act_blocks_kernel(x_ptr, perm_ptr, smooth_ptr, x8_ptr, s8_ptr, x4_ptr, s4_ptr, bad_ptr,
                             K, K8, CHUNKS8, CHUNKS, stride_x, stride_x8, stride_x4, stride_s8,
                             stride_s4, PERM_UNIT: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                             R: tl.constexpr, BB8: tl.constexpr, BB4: tl.constexpr,
                             ROT_LOG2: tl.constexpr, ROT_NORM: tl.constexpr, PDL: tl.constexpr):
    """W4Ax split rows, pass 1, grid (M, CHUNKS): program c quantizes R scale blocks of a row,
    the 8-bit ones first (c < CHUNKS8), and stores its count of NaN/Inf values to bad
    [M, CHUNKS]. Blocks have their own scales, so programs share nothing but the row's
    poisoning, which pass 2 (_quant_act_blocks_poison_kernel) applies."""
    if PDL:  # pass 2 may be scheduled now; it waits for this grid before reading (split_rows_pdl)
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    xrow = x_ptr + row * stride_x
    if c < CHUNKS8:
        v0, v1, bb, mask = _chunk_values(xrow, perm_ptr, smooth_ptr, 0, K8, c, K, R, BB8, False,
                                         PERM_UNIT, HAS_SMOOTH, False, 0, 1.0)
        bad = _num_nonfinite(v0, v1)
        _encode_chunk(v0, v1, bb, mask, c, K8, x8_ptr + row * stride_x8,
                      s8_ptr + row * stride_s8, 0.0, bad, 127, False, True, R, BB8)
    else:
        n4 = (K - K8) // 2
        # other names than the 8-bit branch's: Triton merges same-named values of the branches
        b0, b1, bb4, mask4 = _chunk_values(xrow, perm_ptr, smooth_ptr, K8, n4, c - CHUNKS8, K,
                                           R, BB4, True, PERM_UNIT, HAS_SMOOTH, False,
                                           ROT_LOG2, ROT_NORM)
        bad = _num_nonfinite(b0, b1)
        _encode_chunk(b0, b1, bb4, mask4, c - CHUNKS8, n4, x4_ptr + row * stride_x4,
                      s4_ptr + row * stride_s4, 0.0, bad, 7.5, True, True, R, BB4)
    tl.store(bad_ptr + row * CHUNKS + c, bad)


@triton.jit
def _poison_row(qrow, srow, n_bytes, n_scales, BLOCK: tl.constexpr):
    """Zero codes and NaN scales over a row's segment (reference._quantize_sym)."""
    j = tl.arange(0, BLOCK)
    for j0 in range(0, n_bytes, BLOCK):
        tl.store(qrow + j0 + j, tl.zeros([BLOCK], dtype=qrow.dtype.element_ty),
                 mask=j0 + j < n_bytes)
    for j0 in range(0, n_scales, BLOCK):
        tl.store(srow + j0 + j, tl.full([BLOCK], float("nan"), tl.float32),
                 mask=j0 + j < n_scales)


@triton.jit
def _quant_act_blocks_poison_kernel(bad_ptr, x8_ptr, s8_ptr, x4_ptr, s4_ptr, K, K8, CHUNKS,
                                    stride_x8, stride_x4, stride_s8, stride_s4,
                                    ACT_BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr,
                                    BLOCK: tl.constexpr, PDL: tl.constexpr):
    """W4Ax split rows, pass 2, grid (M,): a row with a NaN/Inf anywhere gets NaN in every
    scale and zero codes, as the reference (and the one-program kernel) give it; other rows
    read CHUNKS counts and stop."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, CHUNKS_P2)
    bad = tl.sum(tl.load(bad_ptr + row * CHUNKS + k, mask=k < CHUNKS, other=0))
    if bad > 0:
        _poison_row(x8_ptr + row * stride_x8, s8_ptr + row * stride_s8, K8, K8 // ACT_BLOCK,
                    BLOCK)
        _poison_row(x4_ptr + row * stride_x4, s4_ptr + row * stride_s4, (K - K8) // 2,
                    (K - K8) // ACT_BLOCK, BLOCK)


@triton.jit
def _quant_act_chunk_stats_kernel(x_ptr, smooth_ptr, v_ptr, stats_ptr, K, stride_x, stride_v,
                                  CHUNKS, BLOCK: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                                  GATED: tl.constexpr, PDL: tl.constexpr):
    """Split rows, pass 1, grid (M, CHUNKS): chunk c's values (_act_values) to v [M, K] fp32
    and its (max |v|, NaN/Inf count) to stats [M, CHUNKS, 2]. A few programs per row instead
    of one: at decode M one program per row leaves the GPU idle (compile_passes.py)."""
    if PDL:  # pass 2 may be scheduled now; it waits for this grid before reading (split_rows_pdl)
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    v = _act_values(x_ptr + row * stride_x, x_ptr, smooth_ptr, cols, mask, K, False, HAS_SMOOTH,
                    GATED)
    tl.store(v_ptr + row * stride_v + cols, v, mask=mask)
    st = stats_ptr + (row * CHUNKS + c) * 2
    tl.store(st, tl.max(tl.abs(v)))
    tl.store(st + 1, _num_nonfinite(v, v).to(tl.float32))


@triton.jit
def _quant_act_chunk_codes_kernel(v_ptr, stats_ptr, q_ptr, s_ptr, K, stride_v, stride_q,
                                  CHUNKS, BLOCK: tl.constexpr, CHUNKS_P2: tl.constexpr,
                                  PDL: tl.constexpr):
    """Split rows, pass 2, grid (M, CHUNKS): the row's scale from every chunk's stats, then
    chunk c's int8 codes; chunk 0 stores the scale. Same values and rounding as one pass."""
    if PDL:
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k = tl.arange(0, CHUNKS_P2)
    st = stats_ptr + (row * CHUNKS + k) * 2
    amax = tl.max(tl.load(st, mask=k < CHUNKS, other=0.0))
    bad = tl.sum(tl.load(st + 1, mask=k < CHUNKS, other=0.0))
    scale = _scale_of(amax, bad, 127)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    v = tl.load(v_ptr + row * stride_v + cols, mask=mask, other=0.0)
    tl.store(q_ptr + row * stride_q + cols, _codes(v, scale, 127, False), mask=mask)
    if c == 0:
        tl.store(s_ptr + row, scale)


@triton.jit
def _rsqrt_libdevice(v):
    return libdevice.rsqrt(v)  # as Inductor lowers torch.rsqrt


@triton.jit
def _rsqrt_interpreted(v):
    """The CPU interpreter has no libdevice."""
    return 1.0 / tl.sqrt(v)


_rsqrt = _rsqrt_interpreted if _interpreting() else _rsqrt_libdevice


@triton.jit
def _add_rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, smooth_ptr, q_ptr, s_ptr, res_out_ptr, K, eps,
                               stride_x, stride_r, stride_ro, stride_q, BLOCK: tl.constexpr,
                               HAS_WEIGHT: tl.constexpr, HAS_SMOOTH: tl.constexpr, PDL: tl.constexpr):
    """reference.add_rms_norm_quantize_act, grid (M,): one program holds a row in registers
    (BLOCK >= K), so the row is read once where Inductor's looped reduction reads it three times
    (the sum of squares, the amax, the codes). Roundings as vLLM's native norm: the residual and
    the normed row in x's dtype, the weight's product in its dtype."""
    if PDL:  # the GEMM after (a programmatic dependent launch) may set up now; it waits for us
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    h = x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    # (rounded first: the interpreter's bf16 cast truncates)
    tl.store(res_out_ptr + row * stride_ro + cols, _rounded_as(h, x).to(x.dtype), mask=mask)
    y = h * _rsqrt(tl.sum(h * h) / K + eps)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = _rounded_as(_rounded_as(y, w) * w.to(tl.float32), w)
    y = _rounded_as(y, x)
    if HAS_SMOOTH:
        y = tl.math.div_rn(y, tl.load(smooth_ptr + cols, mask=mask, other=1.0).to(tl.float32))
    scale = _scale_of(tl.max(tl.abs(y)), _num_nonfinite(y, y), 127)
    tl.store(q_ptr + row * stride_q + cols, _codes(y, scale, 127, False), mask=mask)
    tl.store(s_ptr + row, scale)


# ======================================================================================
# Host side
# ======================================================================================

@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of _lqq_gemm_kernel (block_m: tokens, block_n:
    output channels). split_k > 1 adds int32 partials atomically (deterministic)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    swap_ab: bool = True
    num_warps: int = 4
    num_stages: int = 4
    group_m: int = 8


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: small, so that the default path exercises split-K


def _sm_major(device: torch.device) -> int:
    return capability_major(device) if device.type == "cuda" else 9  # the interpreter: Hopper's rule


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(v))


def _largest_block_k(k_align: int, want: int) -> int:
    """The largest of want, want/2, ... >= 64 that divides k_align (K, or gcd with k8)."""
    bk = want
    while bk > 64 and k_align % bk:
        bk //= 2
    return bk


# W4A8 tiles past 64 tokens, largest first: default_config takes the first that makes at least
# LARGE_M_MIN_TILES_PER_SM tiles an SM. H100, session 75 (`gpu_check.sh triton_tiles`, 13 tiles
# at M = 256 / 1024 / 4096 on three shapes): 128x128 was best or within 6 % wherever it made
# >= 448 tiles, and 1.2-2.4x slower than the smaller tiles where it made <= 384 (split-K did not
# make up for it). Checked at M = 128 / 512 on the eight Llama shapes: within 1 % of the fastest
# tile at 20 of the 25 points, 1.13x at worst (docs/BENCHMARKS.md, "W4A8 GEMM, Triton kernel").
LARGE_M_TILES = (
    GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=4, num_stages=3),
    GemmConfig(block_m=128, block_n=64, block_k=128, swap_ab=False, num_warps=4, num_stages=4),
    GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4),
)
LARGE_M_MIN_TILES_PER_SM = 3

# W4Ax past 64 tokens, tokens on the MMA's M side (its fp32 block sum beside each k-step's int32
# dot doubles the accumulator registers). H100 (`gpu_check.sh triton_tiles_w4ax`, 13 tiles a
# point): 128x64 on 4 warps was the fastest or within 1.10x at 12 points on three 8B shapes
# (session 76); 128x128 on 8 warps (no spill) 3-9 % faster wherever it makes >= 6 tiles an SM:
# the rule was set at those 5 points and held at all 6 such points of 12 on four 70B shapes
# (session 77: 0-9 % faster).
# Below that it won at 7 of 13 points (by up to 9 %) and lost at 6 (by up to 28 %).
W4AX_TILE = GemmConfig(block_m=128, block_n=64, block_k=128, swap_ab=False, num_warps=4, num_stages=4)
W4AX_WIDE_TILE = GemmConfig(block_m=128, block_n=128, block_k=128, swap_ab=False, num_warps=8,
                            num_stages=3)
W4AX_WIDE_MIN_TILES_PER_SM = 6

# 33-64 tokens (a 64-token tile), H100, session 78 (`gpu_check.sh triton_tiles[_w4ax]`, 5-8 tiles a
# point, docs/BENCHMARKS.md "Session 78"): 64 channels a tile, not 128 (that was 1.09-1.83x off the
# fastest tile for W4A8 at 32 points, 1.03-1.45x for W4Ax at 28). W4Ax unswapped (137 registers
# against 255 and a spill): the fastest at all 28. W4A8 swapped, K 256 deep, and split-K only where
# the tiles fill under half the SMs, since its int32 atomics grow with the tokens: at 96-160 tiles
# no split was 1.16-1.40x faster than 2-3 splits; at most 1.12x off the fastest at the 32 points.
W4A8_64_SPLIT_BELOW_TILES_PER_SM = 0.5
# 1-32 tokens, H100, session 79 (`TRITON_TILES_MS=1,16,32 gpu_check.sh triton_tiles`): W4A8's
# K-256 tile on 3 stages, not 4, was faster at all 39 points (1.004-1.17x). W4Ax (K 128 deep) was
# not (0.97-1.01x in session 78's sweep) and keeps 4. Before Hopper the 32-token tile keeps 4:
# on 3, ptxas spills 8 B of it on sm_80 (168 registers), and no sm_80 timing says 3 pays there.
W4A8_DECODE_STAGES = 3
# At 1-16 tokens with long K (K-256 tiles) the unswapped tile wins: 1.12-1.22x at 8 points on 4
# shapes with K >= 13824 (4 stages), 1.04-1.34x at 19 points with K >= 11008 (3 stages); at
# K <= 8192 it lost at 14 of 16 points, and at 29568x8192, whose K allows only 128-deep tiles.
# The bound sits between K = 8192 and 11008 (docs/BENCHMARKS.md, "Session 79").
W4A8_DECODE_UNSWAPPED_MIN_K = 10240


def default_config(M: int, N: int, K: int, k_align: int, num_sms: int,
                   block_scales: bool = False, sm_major: int = 9) -> GemmConfig:
    """Shape-based tile choice (no autotuning: CUDA-graph capture never compiles twice).

    * M <= 64 is weight-bandwidth bound: narrow token tiles, 64 channels, deep K tiles, and
      split-K until there are ~2 CTAs per SM, so that every SM keeps weight loads in flight;
      at 33-64 tokens W4Ax is unswapped and W4A8 splits only under half the SMs' worth of tiles
      (W4A8_64_SPLIT_BELOW_TILES_PER_SM); W4A8 at 1-32 tokens runs 3 stages (W4A8_DECODE_STAGES)
      and at 1-16 is unswapped where K is long (W4A8_DECODE_UNSWAPPED_MIN_K).
    * larger M is tensor-core bound: 128x128 tiles on one warpgroup, so that two CTAs fit
      per SM and one dequantizes while the other's wgmma runs (Triton waits on each wgmma),
      where that makes enough tiles; otherwise 128x64, then 64x64 (LARGE_M_TILES).
    * W4Ax (block_scales) at larger M: 128 tokens x 64 channels, tokens on the MMA's M side,
      and 128x128 on 8 warps where that makes >= 6 tiles an SM (W4AX_TILE, W4AX_WIDE_TILE).
      Its fp32 sum beside each k-step's int32 dot doubles the accumulator registers: the
      one-warpgroup 128x128 was 2.0-2.7x slower on an H200 (docs/BENCHMARKS.md, session 45).
    sm_major is the GPU's compute capability major (9 for the CPU interpreter).
    benchmarks/NOTES-gemm.md has the reasoning and the numbers to expect.
    """
    if M <= 64:
        bm = _pow2_at_least(M, 16)
        bk = _largest_block_k(k_align, 256)
        if block_scales:
            unswapped = bm == 64
        else:
            unswapped = M <= 16 and K >= W4A8_DECODE_UNSWAPPED_MIN_K and bk == 256
        fewer_stages = not block_scales and (bm == 16 or (bm == 32 and sm_major >= 9))
        stages = W4A8_DECODE_STAGES if fewer_stages else 4
        cfg = GemmConfig(block_m=bm, block_n=64, block_k=bk,
                         swap_ab=not unswapped, num_warps=4, num_stages=stages)
    elif block_scales:
        wide = _tiles(M, N, W4AX_WIDE_TILE) >= W4AX_WIDE_MIN_TILES_PER_SM * num_sms
        cfg = W4AX_WIDE_TILE if wide else W4AX_TILE
    else:
        cfg = next((c for c in LARGE_M_TILES
                    if _tiles(M, N, c) >= LARGE_M_MIN_TILES_PER_SM * num_sms), LARGE_M_TILES[-1])
    cfg = dataclasses.replace(cfg, block_k=_largest_block_k(k_align, cfg.block_k))
    split = choose_split(M, N, K, cfg, 2 * num_sms)
    if (32 < M <= 64 and not block_scales
            and _tiles(M, N, cfg) >= W4A8_64_SPLIT_BELOW_TILES_PER_SM * num_sms):
        split = 1  # W4A8's int32 split-K atomics grow with the tokens
    return dataclasses.replace(cfg, split_k=split)


def _tiles(M: int, N: int, cfg: GemmConfig) -> int:
    return triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)


def choose_split(M: int, N: int, K: int, cfg: GemmConfig, target_ctas: int) -> int:
    """Split-K factor that brings the CTA count to ~target_ctas (each split >= 2 k-tiles)."""
    tiles = _tiles(M, N, cfg)
    iters = K // cfg.block_k
    split = 1
    if tiles < target_ctas:
        split = min(triton.cdiv(target_ctas, tiles), max(1, iters // 2), 16)
    return _effective_split(iters, split)


def _effective_split(iters: int, split: int) -> int:
    """No empty splits: ceil(iters / ceil(iters / split))."""
    return triton.cdiv(iters, triton.cdiv(iters, max(1, split)))


# --- validation -------------------------------------------------------------------------

def _check_dtype(name: str, t: torch.Tensor, dtypes) -> None:
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {' or '.join(map(str, dtypes))}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")


def _check_weights(K: int, qweight, group_scale, group_offset, channel_scale, bias) -> int:
    """Validates the packed W4 tensors against K; returns the group size."""
    _check_dtype("qweight", qweight, torch.uint8)
    _check_dtype("group_scale", group_scale, torch.uint8)
    _check_dtype("group_offset", group_offset, torch.uint8)
    _check_dtype("channel_scale", channel_scale, torch.float32)
    if qweight.dim() != 2 or group_scale.dim() != 2:
        raise ValueError("qweight and group_scale must be 2-D ([N, K/2] and [N, K/G])")
    N, ng = qweight.shape[0], group_scale.shape[1]
    _check_shape("qweight", qweight, (N, K // 2))
    if K % 2 or ng == 0 or K % ng:
        raise ValueError(f"group_scale: K={K} is not a multiple of the group size "
                         f"(group_scale has {ng} groups per row)")
    G = K // ng
    if G not in F.SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_scale: group size K/num_groups = {G} is not one of "
                         f"{F.SUPPORTED_GROUP_SIZES}")
    _check_shape("group_scale", group_scale, (N, ng))
    _check_shape("group_offset", group_offset, (N, ng))
    _check_shape("channel_scale", channel_scale, (N,))
    if bias is not None:
        _check_dtype("bias", bias, _OUT_DTYPES)
        _check_shape("bias", bias, (N,))
    return G


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _int32_words(t: torch.Tensor) -> torch.Tensor:
    """uint8 [M, B] (B % 4 == 0) as int32 [M, B/4], copying only if rows are misaligned."""
    if t.stride(-1) != 1 or t.stride(0) % 4 or t.storage_offset() % 4:
        t = t.contiguous()
    return t.view(torch.int32)


def _output(M: int, N: int, out_dtype, device, out) -> torch.Tensor:
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not one of {_OUT_DTYPES}")
    if out is None:
        return torch.empty((M, N), dtype=out_dtype, device=device)
    _check_dtype("out", out, out_dtype)
    _check_shape("out", out, (M, N))
    if out.stride(-1) != 1:
        raise ValueError("out must have a unit stride along N")
    return out


# --- GEMM launch ------------------------------------------------------------------------

def _launch_gemm(x8, s8, x4, s4, qweight, group_scale, group_offset, channel_scale, bias,
                 out, K8: int, G: int, config: GemmConfig | None, block_scales: bool
                 ) -> torch.Tensor:
    """block_scales: W4Ax (s8/s4 [M, blocks] per ACT_BLOCK-channel block), else W4A8 (K8 == K,
    s8 [M] per token)."""
    M, N = out.shape
    K = qweight.shape[1] * 2
    if M == 0 or N == 0:
        return out
    has_a4 = K8 < K
    qw32 = qweight.view(torch.int32)  # 8 nibbles per word (K % 64 == 0: rows stay aligned)
    # an empty part is never read, but the launcher wants a real pointer of the right type
    x8 = x8 if x8.numel() else x4.view(torch.int8)
    s8 = s8 if s8.numel() else s4
    x4w = _int32_words(x4) if has_a4 else qw32
    s4 = s4 if has_a4 else s8
    if config is None:
        config = default_config(M, N, K, F.ACT_BLOCK if block_scales else K, _num_sms(out.device),
                                block_scales, _sm_major(out.device))
    bk = config.block_k
    if K % bk or K8 % bk or bk % 64:
        raise ValueError(f"config.block_k={bk} must be a multiple of 64 dividing K={K} and k8={K8}")
    if block_scales and F.ACT_BLOCK % bk:
        raise ValueError(f"config.block_k={bk} must divide the W4Ax activation block "
                         f"({F.ACT_BLOCK}): each k-iteration takes one block's scale")
    iters = K // bk
    split = _effective_split(iters, config.split_k)
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    if split == 1:
        ws = cnt = channel_scale  # never dereferenced
    elif block_scales:  # one fp32 partial plane per split (each fully written) + counters
        ws = torch.empty(split * M * N, dtype=torch.float32, device=out.device)
        cnt = torch.zeros(tiles, dtype=torch.int32, device=out.device)
    else:  # one int32 partial plane + one arrival counter per tile, zeroed per call
        ws = torch.zeros(M * N + tiles, dtype=torch.int32, device=out.device)
        cnt = ws[M * N:]
    _lqq_gemm_kernel[(tiles, split)](
        x8, s8, x4w, s4, qw32, group_scale, group_offset, channel_scale,
        bias if bias is not None else channel_scale, out, ws, cnt,
        M, N, K, K8, x8.stride(0), x4w.stride(0), s8.stride(0), s4.stride(0), out.stride(0),
        qw32.stride(0), K // G,
        G=G, HAS_A4=has_a4, BLOCK_SCALES=block_scales, HAS_BIAS=bias is not None,
        BM=config.block_m, BN=config.block_n, BK=bk, SPLIT_K=split,
        SWAP_AB=config.swap_ab, GROUP_M=config.group_m, USE_ASM=not _interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def w4a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
              group_scale: torch.Tensor, group_offset: torch.Tensor, channel_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16, *,
              out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """y[m, n] = x_scale[m] * channel_scale[n] * sum_k xq[m, k] * w8[n, k] + bias[n]."""
    _check_dtype("xq", xq, torch.int8)
    _check_dtype("x_scale", x_scale, torch.float32)
    if xq.dim() != 2:
        raise ValueError(f"xq must be 2-D [M, K]; got shape {tuple(xq.shape)}")
    M, K = xq.shape
    _check_shape("x_scale", x_scale, (M,))
    G = _check_weights(K, qweight, group_scale, group_offset, channel_scale, bias)
    out = _output(M, qweight.shape[0], out_dtype, xq.device, out)
    xq = _row_major(xq)
    x_scale = x_scale.contiguous()
    return _launch_gemm(xq, x_scale, xq, x_scale, _row_major(qweight), group_scale.contiguous(),
                        group_offset.contiguous(), channel_scale.contiguous(),
                        None if bias is None else bias.contiguous(), out, K, G, config, False)


def w4ax_gemm(x8: torch.Tensor, s8: torch.Tensor, x4: torch.Tensor, s4: torch.Tensor,
              qweight: torch.Tensor, group_scale: torch.Tensor, group_offset: torch.Tensor,
              channel_scale: torch.Tensor, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.float16, *, out: torch.Tensor | None = None,
              config: GemmConfig | None = None) -> torch.Tensor:
    """W4Ax: int8 activations on the first k8 (permuted) channels, packed int4 on the rest;
    s8 [M, k8/128] and s4 [M, (K-k8)/128]: one scale per (token, ACT_BLOCK-channel block).
    config.block_k must divide ACT_BLOCK."""
    _check_dtype("x8", x8, torch.int8)
    _check_dtype("x4", x4, torch.uint8)
    _check_dtype("s8", s8, torch.float32)
    _check_dtype("s4", s4, torch.float32)
    if x8.dim() != 2 or x4.dim() != 2:
        raise ValueError("x8 and x4 must be 2-D ([M, k8] and [M, (K-k8)/2])")
    M, k8 = x8.shape
    K = k8 + 2 * x4.shape[1]
    _check_shape("x4", x4, (M, x4.shape[1]))
    if k8 % F.ACT_BLOCK:
        raise ValueError(f"x8: k8={k8} is not a multiple of {F.ACT_BLOCK} (W4Ax block)")
    lay = F.W4ActLayout.from_k8(K, k8)
    _check_shape("s8", s8, (M, lay.num_a8_blocks))
    _check_shape("s4", s4, (M, lay.num_a4_blocks))
    G = _check_weights(K, qweight, group_scale, group_offset, channel_scale, bias)
    out = _output(M, qweight.shape[0], out_dtype, x8.device, out)
    return _launch_gemm(_row_major(x8), s8.contiguous(), _row_major(x4), s4.contiguous(),
                        _row_major(qweight), group_scale.contiguous(), group_offset.contiguous(),
                        channel_scale.contiguous(), None if bias is None else bias.contiguous(),
                        out, k8, G, config, True)


# --- activation quantisation ------------------------------------------------------------

_MAX_ROW_VALUES = 32768  # values held in registers per chunk; longer rows take two passes
# 4-bit blocks a chunk holds when they are rotated: the butterflies move values between threads
# through shared memory (Triton's layout conversions: 32 KB at 128 blocks; sm_90 and sm_80 ptxas,
# no spill; 256 spills), so a row with more (K - k8 > 16384) takes two passes, the second mostly
# from L2. Session 66 had 64, which sent Llama-3-8B's down projection (K = 14336) through two passes.
ROTATED_CHUNK_BLOCKS = 128


def _segment_chunks(n_bytes: int, values_per_byte: int, block_bytes: int | None,
                    max_rows: int | None = None) -> tuple[int, int, int]:
    """(rows R, bytes per row BB, chunks) of a segment of n_bytes output bytes. block_bytes:
    a row is one scale block (W4Ax) and a chunk holds whole blocks, at most max_rows of them;
    None: one row per chunk."""
    budget = _MAX_ROW_VALUES // values_per_byte  # bytes
    if block_bytes is None:
        bb = min(_pow2_at_least(n_bytes, 16), budget)
        return 1, bb, max(1, triton.cdiv(n_bytes, bb))
    n_blocks = n_bytes // block_bytes
    r = max(1, min(_pow2_at_least(n_blocks, 1), budget // block_bytes,
                   max_rows or _MAX_ROW_VALUES))
    return r, block_bytes, max(1, triton.cdiv(n_blocks, r))


def _num_warps_for(values: int) -> int:
    """About 512 values per warp; Triton needs a power of two (a W4Ax chunk of 8-bit plus
    4-bit blocks can hold e.g. 5120 values)."""
    return 1 << max(0, min(4, (values // 512).bit_length() - 1))


def _quant_launch_config(K: int, k8: int, per_block: bool, gated: bool = False,
                         rotation_size: int = 0) -> tuple[dict, int]:
    """_quant_act_kernel's chunking constexprs and num_warps for rows of K values, the first k8
    of them int8 (tests/kernels/test_triton_gemm_compile.py compiles the kernel with them too)."""
    r8, b8, c8 = _segment_chunks(k8, 1 + gated, F.ACT_BLOCK if per_block else None)
    r4, b4, c4 = _segment_chunks((K - k8) // 2, 2 * (1 + gated),
                                 F.ACT_BLOCK // 2 if per_block else None,
                                 ROTATED_CHUNK_BLOCKS if rotation_size else None)
    # values loaded per chunk, of each segment (gated: gate and up)
    values = [(1 + gated) * r8 * b8] * (k8 > 0) + [2 * (1 + gated) * r4 * b4] * (k8 < K)
    one_pass = c8 == 1 and c4 == 1 and sum(values) <= _MAX_ROW_VALUES
    consts = dict(GATED=gated, HAS_A8=k8 > 0, HAS_A4=k8 < K, PER_BLOCK=per_block,
                  ONE_PASS=one_pass, R8=r8, BB8=b8, NCHUNK8=c8, R4=r4, BB4=b4, NCHUNK4=c4,
                  **_rotation_consts(rotation_size))
    return consts, _num_warps_for(sum(values) if one_pass else max(values))


def _rotation_consts(rotation_size: int) -> dict:
    """The quantize kernels' ROT_LOG2 and ROT_NORM for Hadamard transforms of rotation_size
    channels (0: no rotation)."""
    return dict(ROT_LOG2=max(rotation_size, 1).bit_length() - 1,
                ROT_NORM=F.hadamard_norm(rotation_size) if rotation_size else 1.0)


def _quant_blocks_config(rotation_size: int) -> tuple[dict, int]:
    """_quant_act_blocks_kernel's constexprs (but HAS_SMOOTH and PDL) and num_warps."""
    r = W4AX_SPLIT_BLOCKS
    if r < 1 or r & (r - 1):
        raise ValueError(f"W4AX_SPLIT_BLOCKS={r}: expected a power of two (a program's blocks "
                         "are one Triton tile), or 0 for one program a row")
    return (dict(R=r, BB8=F.ACT_BLOCK, BB4=F.ACT_BLOCK // 2,
                 **_rotation_consts(rotation_size)), _num_warps_for(r * F.ACT_BLOCK))


def _placeholders_for_empty(x8, s8, x4, s4):
    """(x8, s8, x4, s4) with an empty part replaced by the other's tensors: the kernels never
    read it, but the launcher wants a real pointer of the right type."""
    x8 = x8 if x8.numel() else x4.view(torch.int8)
    x4 = x4 if x4.numel() else x8.view(torch.uint8)
    s8 = s8 if s8.numel() else s4
    s4 = s4 if s4.numel() else s8
    return x8, s8, x4, s4


def _launch_quant(x, perm, smooth, k8, x8, s8, x4, s4, per_block: bool, gated: bool = False,
                  rotation_size: int = 0, perm_unit: int = 0) -> None:
    """gated: x is [M, 2K] = [gate | up], quantized as SiluAndMul(x) [M, K]. rotation_size
    (per_block): each 4-bit block rotated by Hadamard transforms of that width (0: none).
    perm_unit: channels an entry of perm stands for (formats.act_perm_unit; 0: no perm)."""
    M, K = x.shape
    K //= 1 + gated
    if M == 0:
        return
    consts, num_warps = _quant_launch_config(K, k8, per_block, gated, rotation_size)
    x8, s8, x4, s4 = _placeholders_for_empty(x8, s8, x4, s4)
    _quant_act_kernel[(M,)](
        x, perm if perm is not None else x, smooth if smooth is not None else x,
        x8, s8, x4, s4, K, k8, x.stride(0), x8.stride(0), x4.stride(0), s8.stride(0),
        s4.stride(0), PERM_UNIT=perm_unit, HAS_SMOOTH=smooth is not None, **consts,
        num_warps=num_warps)


def _check_act(x: torch.Tensor, smooth: torch.Tensor | None) -> torch.Tensor:
    _check_dtype("x", x, _ACT_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K]; got shape {tuple(x.shape)}")
    if smooth is not None:
        _check_dtype("smooth", smooth, _ACT_DTYPES)
        _check_shape("smooth", smooth, (x.shape[1],))
    return _row_major(x)


def quantize_act(x: torch.Tensor, smooth: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: (int8 [M, K], float32 scale [M]). One program a row, or, for
    a few long rows (split_rows), two passes over programs of SPLIT_ROWS_BLOCK columns.

    Bit-exact with reference.quantize_act: correctly rounded divisions (div_rn) and round
    half to even, like torch."""
    x = _check_act(x, smooth)
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    smooth = smooth.contiguous() if smooth is not None else None
    if split_rows(M, K):
        _launch_split_rows(x, smooth, K, q, s, gated=False)
    else:
        _launch_quant(x, None, smooth, K, q, s, q, s, per_block=False)
    return q, s


def silu_mul_quantize_act(gate_up: torch.Tensor, smooth: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act(SiluAndMul(gate_up), smooth) in one kernel: gate_up [M, 2K] -> (int8
    [M, K], float32 scale [M]). The row's silu(gate) * up never reaches memory; each value
    is rounded to gate_up's dtype as torch rounds it, so the codes are those of the two ops."""
    _check_dtype("gate_up", gate_up, _ACT_DTYPES)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be 2-D [M, 2K]; got shape {tuple(gate_up.shape)}")
    M, K = gate_up.shape[0], gate_up.shape[1] // 2
    if smooth is not None:
        _check_dtype("smooth", smooth, _ACT_DTYPES)
        _check_shape("smooth", smooth, (K,))
    q = torch.empty((M, K), dtype=torch.int8, device=gate_up.device)
    s = torch.empty((M,), dtype=torch.float32, device=gate_up.device)
    gate_up = _row_major(gate_up)
    smooth = smooth.contiguous() if smooth is not None else None
    if split_rows(M, K, gated=True):
        _launch_split_rows(gate_up, smooth, K, q, s)
    else:
        _launch_quant(gate_up, None, smooth, K, q, s, q, s, per_block=False, gated=True)
    return q, s


# add_rms_norm_quantize_act holds a row in one program's registers: rows of up to this many
# values (Llama-3-405B's hidden size is 16384).
NORM_QUANT_MAX_K = 16384
# Its warps a program; None: _num_warps_for the row (8 for 4096 columns, 16 for 8192). Benchmarks
# set it (bench_act_quant.py --norm-op).
NORM_QUANT_WARPS: int | None = None


def add_rms_norm_quantize_act(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                              epsilon: float, smooth: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.add_rms_norm_quantize_act in one kernel, one program a row: x, residual [M, K]
    (fp16/bf16, K <= NORM_QUANT_MAX_K) -> (int8 [M, K], float32 scale [M], x + residual [M, K]).
    Not bit-exact: the sum of squares is added in another order than torch's (a code may move
    by one)."""
    _check_dtype("x", x, (torch.float16, torch.bfloat16))
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K]; got shape {tuple(x.shape)}")
    M, K = x.shape
    if K > NORM_QUANT_MAX_K:
        raise ValueError(f"x has {K} columns; add_rms_norm_quantize_act holds a row in registers, "
                         f"at most NORM_QUANT_MAX_K = {NORM_QUANT_MAX_K}")
    _check_dtype("residual", residual, x.dtype)
    _check_shape("residual", residual, (M, K))
    for name, t in (("weight", weight), ("smooth", smooth)):
        if t is not None:
            _check_dtype(name, t, _ACT_DTYPES)
            _check_shape(name, t, (K,))
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    res_out = torch.empty((M, K), dtype=x.dtype, device=x.device)
    if M == 0:
        return q, s, res_out
    x, residual = _row_major(x), _row_major(residual)
    weight = weight.contiguous() if weight is not None else None
    smooth = smooth.contiguous() if smooth is not None else None
    block = _pow2_at_least(K, 16)
    _add_rms_norm_quant_kernel[(M,)](
        x, residual, weight if weight is not None else x, smooth if smooth is not None else x, q, s,
        res_out, K, float(epsilon), x.stride(0), residual.stride(0), res_out.stride(0), q.stride(0),
        BLOCK=block, HAS_WEIGHT=weight is not None, HAS_SMOOTH=smooth is not None,
        PDL=split_rows_pdl(x.device), num_warps=NORM_QUANT_WARPS or _num_warps_for(block))
    return q, s, res_out


# Rows of at most this many tokens are split over programs of SPLIT_ROWS_BLOCK columns (two
# launches); more rows keep one program each. H100, 2026-11-26, silu_mul_quantize_act, K = 14336,
# split / one program a row: 3.75 / 9.77 us (M = 1), 4.91 / 9.86 (32), 6.12 / 10.0 (64), 31.3 /
# 38.7 (512). quantize_act (session 79, scripts/bench_triton_quantize_act.py): split is 1.05-2.5x
# faster at M <= 32 on rows of 11008-28672 values, but slower at 64 tokens on 11008 (0.96x) and at
# 128 on 14336 / 28672 (0.89x / 0.85x), and on rows of 4096-8192 values at every M (0.70-0.92x),
# as silu_mul_quantize_act was on rows of 2 x 4096 (0.76-0.89x at M = 1-64). Hence a floor on a
# row's values read. The gated kernel's split still wins at M = 64-512 on 11008-28672 columns
# (1.18-1.85x); on 8192 it wins up to 32 tokens (1.11-1.24x) and loses from 64 (0.79-0.96x), so
# rows of at most SPLIT_ROWS_LONG_K columns split only up to SPLIT_ROWS_MAX_M_PLAIN tokens.
SPLIT_ROWS_MAX_M = 512  # silu_mul_quantize_act on rows of over SPLIT_ROWS_LONG_K columns
SPLIT_ROWS_MAX_M_PLAIN = 32  # quantize_act, and silu_mul_quantize_act up to SPLIT_ROWS_LONG_K
SPLIT_ROWS_LONG_K = 8192
SPLIT_ROWS_MIN_VALUES = 8192  # values read a row: K, or 2K gated
SPLIT_ROWS_BLOCK = 1024


def split_rows(M: int, K: int, gated: bool = False) -> bool:
    """Whether quantize_act (silu_mul_quantize_act if gated) splits its M rows of K columns
    over programs of SPLIT_ROWS_BLOCK columns."""
    max_m = SPLIT_ROWS_MAX_M if gated and K > SPLIT_ROWS_LONG_K else SPLIT_ROWS_MAX_M_PLAIN
    return 0 < M <= max_m and (1 + gated) * K > SPLIT_ROWS_MIN_VALUES and K > SPLIT_ROWS_BLOCK


def split_rows_pdl(device: torch.device) -> bool:
    """Whether the split rows' second pass is a programmatic dependent launch (Hopper and
    later): scheduled while the first runs, so the two cost about one launch. The same switch
    lets add_rms_norm_quantize_act's kernel launch the csrc GEMM after it at once.
    MIXPREC_QUANT_PDL=0 turns it off (on by default where it applies)."""
    return (envs.flag("MIXPREC_QUANT_PDL") and device.type == "cuda" and not _interpreting()
            and capability_major(device) >= 9)


def _launch_split_rows(x, smooth, K, q, s, gated: bool = True) -> None:
    """quantize_act's per-token int8 of x's rows (gated: of SiluAndMul(x)) in two passes over
    (M, ceil(K / SPLIT_ROWS_BLOCK)) programs, through an fp32 copy of the values."""
    M, block = x.shape[0], SPLIT_ROWS_BLOCK
    chunks = triton.cdiv(K, block)
    v = torch.empty((M, K), dtype=torch.float32, device=x.device)
    stats = torch.empty((M, chunks, 2), dtype=torch.float32, device=x.device)
    warps = _num_warps_for(block * (1 + gated))
    pdl = split_rows_pdl(x.device)
    _quant_act_chunk_stats_kernel[(M, chunks)](
        x, smooth if smooth is not None else x, v, stats, K, x.stride(0), v.stride(0), chunks,
        BLOCK=block, HAS_SMOOTH=smooth is not None, GATED=gated, PDL=pdl, num_warps=warps)
    _quant_act_chunk_codes_kernel[(M, chunks)](
        v, stats, q, s, K, v.stride(0), q.stride(0), chunks, BLOCK=block,
        CHUNKS_P2=_pow2_at_least(chunks, 2), PDL=pdl, num_warps=_num_warps_for(block),
        **({"launch_pdl": True} if pdl else {}))


# W4Ax rows are quantized by programs of this many scale blocks each (_launch_quant_blocks), or
# by one program a row when 0 (_quant_act_kernel). Session 67 (H200): one program a row took
# 19.3 / 22.9 us at M = 1 on the all-4-bit rows of 8960 / 14336 channels, the whole row on one SM.
# Session 69 (H100, docs/BENCHMARKS.md "Session 69 (H100)"): the split rows passed their GPU
# tests; at R = 8 the rotated quantizer was 1.3-7x faster at M <= 16 and within 6 % or faster at
# M >= 256, the rotated linear 1.46-1.59x faster at M <= 16 on the 8B and 70B down projections and
# faster or within 1.3 % everywhere, and the compiled W4Ax down / QKV 1.43-2.16x faster than
# traced (0.90x at M = 1 with one program a row). Session 71 (H100, A-B-A, benchmarks/results/
# 2026-12-05-s71): with a block permutation (the default checkpoint's) R = 8 beat one program a
# row at every M, rotated (the quantizer 1.25-6.5x, the linear 1.04-1.56x faster) or not (1.14-3.7x,
# 1.02-1.40x). With a channel permutation, unrotated rows past 64 tokens were 1.17-2.38x slower
# split (their linear 1.02-1.24x): a sector of the row is then fetched by up to 16 programs on
# other SMs instead of once into one program's L1.
W4AX_SPLIT_BLOCKS = 8
# Rows read through a channel permutation (--a8-select channels) with no rotated block (act_rotation
# "none", or every block at 8 bits) split only up to this many tokens; None: at every M
# (force_w4ax_split_blocks).
W4AX_SPLIT_CHANNEL_GATHER_MAX_M: int | None = 64


def w4ax_split_blocks_for(m: int, rotation_size: int, perm_unit: int) -> int:
    """The scale blocks a program of quantize_act_w4ax takes for m rows whose 4-bit blocks are
    rotated in rotation_size-channel groups (0: not rotated), read through a permutation of
    perm_unit channels an entry (formats.act_perm_unit); 0 is one program a row."""
    cap = W4AX_SPLIT_CHANNEL_GATHER_MAX_M
    gathered = rotation_size == 0 and perm_unit == 1
    return 0 if gathered and cap is not None and m > cap else W4AX_SPLIT_BLOCKS


def force_w4ax_split_blocks(r: int) -> None:
    """W4Ax rows split over programs of r blocks (0: one program a row) at every M and rotation:
    the benchmarks' A/B arms."""
    global W4AX_SPLIT_BLOCKS, W4AX_SPLIT_CHANNEL_GATHER_MAX_M
    W4AX_SPLIT_BLOCKS, W4AX_SPLIT_CHANNEL_GATHER_MAX_M = r, None


def _launch_quant_blocks(x, perm, smooth, k8, x8, s8, x4, s4, rotation_size: int,
                         perm_unit: int) -> None:
    """quantize_act_w4ax's kernels when W4AX_SPLIT_BLOCKS > 0: pass 1 over (M, chunks of
    W4AX_SPLIT_BLOCKS blocks), pass 2 over M rows (a programmatic dependent launch where
    split_rows_pdl says so)."""
    M, K = x.shape
    r = W4AX_SPLIT_BLOCKS
    chunks8 = triton.cdiv(k8 // F.ACT_BLOCK, r)
    chunks = chunks8 + triton.cdiv((K - k8) // F.ACT_BLOCK, r)
    bad = torch.empty((M, chunks), dtype=torch.int32, device=x.device)
    x8, s8, x4, s4 = _placeholders_for_empty(x8, s8, x4, s4)
    strides = (x8.stride(0), x4.stride(0), s8.stride(0), s4.stride(0))
    pdl = split_rows_pdl(x.device)
    consts, num_warps = _quant_blocks_config(rotation_size)
    _quant_act_blocks_kernel[(M, chunks)](
        x, perm, smooth if smooth is not None else x, x8, s8, x4, s4, bad, K, k8, chunks8,
        chunks, x.stride(0), *strides, PERM_UNIT=perm_unit, HAS_SMOOTH=smooth is not None,
        PDL=pdl, **consts,
        num_warps=num_warps)
    _quant_act_blocks_poison_kernel[(M,)](
        bad, x8, s8, x4, s4, K, k8, chunks, *strides, ACT_BLOCK=F.ACT_BLOCK,
        CHUNKS_P2=_pow2_at_least(chunks, 2), BLOCK=1024, PDL=pdl, num_warps=1,
        **({"launch_pdl": True} if pdl else {}))


def quantize_act_w4ax(x: torch.Tensor, perm: torch.Tensor, k8: int,
                      smooth: torch.Tensor | None = None, act_rotation: str = "none"
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """W4Ax activations: permute channels (perm: [K] channels, or [K/ACT_BLOCK] blocks,
    formats.act_block_perm, read once a block), first k8 to int8, the rest (each block rotated
    as act_rotation says, formats.ACT_ROTATIONS) to packed int4, one scale per (token,
    ACT_BLOCK-channel block); bit-exact with the reference.

    The rotation (reference.hadamard_a4_blocks' butterflies) runs on the 4-bit blocks in
    registers between the load and the amax (_hadamard_pairs); until session 66 a separate
    kernel built the rotated float32 input first. Rows are split over programs of
    w4ax_split_blocks_for(M, rotation, perm) blocks, and a second, tiny launch gives the rows
    holding a NaN/Inf their NaN scales and zero codes; 0 is one program a row.

    Returns (x8 int8 [M, k8], s8 float32 [M, k8/128], x4 uint8 [M, (K-k8)/2],
    s4 float32 [M, (K-k8)/128])."""
    x = _check_act(x, smooth)
    M, K = x.shape
    perm_unit = F.act_perm_unit(perm, K)  # raises on any other shape
    if perm.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"perm has dtype {perm.dtype}; expected torch.int32 or torch.int64")
    lay = F.W4ActLayout.from_k8(K, k8)
    n = F.act_rotation_size(act_rotation)
    dev = x.device
    x8 = torch.empty((M, k8), dtype=torch.int8, device=dev)
    x4 = torch.empty((M, lay.k4 // 2), dtype=torch.uint8, device=dev)
    s8 = torch.empty((M, lay.num_a8_blocks), dtype=torch.float32, device=dev)
    s4 = torch.empty((M, lay.num_a4_blocks), dtype=torch.float32, device=dev)
    if M == 0:
        return x8, s8, x4, s4
    rotation_size = n if k8 < K else 0
    launch = (_launch_quant_blocks if w4ax_split_blocks_for(M, rotation_size, perm_unit)
              else functools.partial(_launch_quant, per_block=True))
    launch(x, perm.contiguous(), smooth.contiguous() if smooth is not None else None, k8, x8, s8,
           x4, s4, rotation_size=rotation_size, perm_unit=perm_unit)
    return x8, s8, x4, s4
