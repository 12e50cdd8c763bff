"""Fused quantize-and-store of K/V into the packed KV pages (formats.KVPageLayout).

One program per (token, kv head): load the 16-bit row, optionally subtract the rotated k
bias RoPE_p(b) at the token's cache position p (bias-aware K, formats.KRopeBias), then
divide K by the SmoothAttention scale, quantise per (token, head) exactly as
reference.quantize_kv, store codes and scale/zero into the (block, head) slab, and, when the
block owns a residual slot, a 16-bit copy (of the same transformed K) into the residual pool
(attention_backend/residual.py). Slots < 0 are skipped.

The @triton.jit helpers `round_half_even`, `meta_index`, `slab_offset` and `rope_angle` are
shared with the attention kernels, so that the page addressing and the rotary angle live in
one place.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import formats as F

# fp32 values below 2**22: adding and removing 1.5*2**23 rounds to nearest-even, which is
# torch.round's rule (libdevice.rint is not available in the CPU interpreter).
_RNE_MAGIC = tl.constexpr(12582912.0)
_INF = tl.constexpr(float("inf"))
_TWO_PI_2M32 = tl.constexpr(2 * math.pi / 2 ** F.ROPE_PHASE_BITS)  # radians per phase unit
# No NaN global: Triton re-checks globals by ==, and NaN != NaN fails every launch.


class KVResidual(NamedTuple):
    """The residual pool of one layer plus the group's slot directory (see residual.py).

    k, v: [P*B, H, D] in the model dtype; slot_of_block: int32 [num_blocks + 1];
    tags: int32 [P + 1, B]; tokens: R, the size of the high-precision window.
    """

    k: torch.Tensor
    v: torch.Tensor
    slot_of_block: torch.Tensor
    tags: torch.Tensor
    tokens: int


@triton.jit
def round_half_even(x):
    return (x + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def rope_angle(pos, steps):
    """Rotary angle (fp32 radians in [-pi, pi)) at cache positions `pos` of the pairs with
    phase steps `steps` (int64, formats.rope_phase_steps): p * step mod 2**32 units of 2**-32
    turns, exact in integers (the int32 cast keeps the low 32 bits: the phase centred on 0)."""
    ph = (steps * pos).to(tl.int32)  # int64 product (steps are int64): no overflow
    return ph.to(tl.float32) * _TWO_PI_2M32


@triton.jit
def _rope_bias_at(kb_ptr, steps_ptr, pos, d, D: tl.constexpr):
    """RoPE_pos(b)[d] (fp32) of one head's k bias at kb_ptr, for channel indices d (neox
    pairing d <-> d +- D/2: b[d] cos + rot(b)[d] sin, rot(b) = cat(-b[D/2:], b[:D/2]))."""
    HALF: tl.constexpr = D // 2
    lo = d < HALF
    ang = rope_angle(pos, tl.load(steps_ptr + tl.where(lo, d, d - HALF)))
    partner = tl.load(kb_ptr + tl.where(lo, d + HALF, d - HALF))
    return tl.load(kb_ptr + d) * tl.cos(ang) + tl.where(lo, -partner, partner) * tl.sin(ang)


@triton.jit
def slab_offset(blk, head, stride_blk, stride_head):
    """Byte offset of the (block, head) slab; blk is int64 so that big caches do not wrap."""
    return blk * stride_blk + head * stride_head


@triton.jit
def meta_index(slab, off, plane: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
               MB: tl.constexpr):
    """Element index (in MB-byte units) of token `off`'s entry of metadata plane `plane`.

    Planes follow the codes (2*B*C bytes): kv4 k_scale, k_zero, v_scale, v_zero (f16);
    kv8 k_scale, v_scale (f32). Each plane holds B entries.
    """
    return slab // MB + (2 * B * C) // MB + plane * B + off


@triton.jit
def _quantize_store_row(src_ptr, smooth_ptr, kb_ptr, steps_ptr, pos, codes_ptr, meta_ptr, slab,
                        off, code_plane: tl.constexpr, meta_plane: tl.constexpr,
                        res_ptr, res_row, res_ok,
                        B: tl.constexpr, D: tl.constexpr, KV4: tl.constexpr,
                        HAS_SMOOTH: tl.constexpr, HAS_KB: tl.constexpr, HAS_RES: tl.constexpr):
    """Quantise one [D] row at src_ptr and store it; K and V share this code. K is first
    reduced by RoPE_pos(b) (HAS_KB), then divided by k_smooth (HAS_SMOOTH)."""
    if KV4:
        C: tl.constexpr = D // 2
        c = tl.arange(0, C)
        xa = tl.load(src_ptr + 2 * c).to(tl.float32)      # even d -> low nibble
        xb = tl.load(src_ptr + 2 * c + 1).to(tl.float32)  # odd d -> high nibble
        if HAS_KB:
            xa = xa - _rope_bias_at(kb_ptr, steps_ptr, pos, 2 * c, D)
            xb = xb - _rope_bias_at(kb_ptr, steps_ptr, pos, 2 * c + 1, D)
        if HAS_SMOOTH:
            xa = tl.math.div_rn(xa, tl.load(smooth_ptr + 2 * c).to(tl.float32))
            xb = tl.math.div_rn(xb, tl.load(smooth_ptr + 2 * c + 1).to(tl.float32))
        mn = tl.minimum(tl.min(xa, 0), tl.min(xb, 0))
        mx = tl.maximum(tl.max(xa, 0), tl.max(xb, 0))
        # a row with a NaN/Inf is stored with NaN scale and zero and zero codes (reference:
        # _poison_nonfinite); GPU min/max reductions drop NaN, hence the explicit count
        ok = (tl.sum(tl.where(tl.abs(xa) < _INF, 0, 1).to(tl.int32))
              + tl.sum(tl.where(tl.abs(xb) < _INF, 0, 1).to(tl.int32))) == 0
        scale = tl.maximum(tl.math.div_rn(mx - mn, 15.0), 1e-4)
        scale = tl.where(ok, scale, float("nan")).to(tl.float16)
        zero = tl.where(ok, mn, float("nan")).to(tl.float16)
        s32 = scale.to(tl.float32)
        z32 = zero.to(tl.float32)
        qa = tl.clamp(round_half_even(tl.math.div_rn(xa - z32, s32)), 0.0, 15.0)
        qb = tl.clamp(round_half_even(tl.math.div_rn(xb - z32, s32)), 0.0, 15.0)
        qa = tl.where(ok, qa, 0.0).to(tl.uint8)
        qb = tl.where(ok, qb, 0.0).to(tl.uint8)
        tl.store(codes_ptr + slab + code_plane * B * C + off * C + c, qa | (qb << 4))
        tl.store(meta_ptr + meta_index(slab, off, 2 * meta_plane, B, C, 2), scale)
        tl.store(meta_ptr + meta_index(slab, off, 2 * meta_plane + 1, B, C, 2), zero)
        if HAS_RES:  # the 16-bit copy of a non-finite row is all NaN, like its page entry
            dst = res_ptr + res_row + 2 * c
            ra = tl.where(ok, xa, float("nan")).to(res_ptr.dtype.element_ty)
            rb = tl.where(ok, xb, float("nan")).to(res_ptr.dtype.element_ty)
            tl.store(dst, ra, mask=res_ok)
            tl.store(dst + 1, rb, mask=res_ok)
    else:
        d = tl.arange(0, D)
        x = tl.load(src_ptr + d).to(tl.float32)
        if HAS_KB:
            x = x - _rope_bias_at(kb_ptr, steps_ptr, pos, d, D)
        if HAS_SMOOTH:
            x = tl.math.div_rn(x, tl.load(smooth_ptr + d).to(tl.float32))
        ok = tl.sum(tl.where(tl.abs(x) < _INF, 0, 1).to(tl.int32)) == 0  # see kv4
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), 127.0), 1e-8)
        scale = tl.where(ok, scale, float("nan"))
        q = tl.clamp(round_half_even(tl.math.div_rn(x, scale)), -127.0, 127.0)
        q = tl.where(ok, q, 0.0)
        tl.store(codes_ptr + slab + code_plane * B * D + off * D + d, q.to(tl.int8))
        tl.store(meta_ptr + meta_index(slab, off, meta_plane, B, D, 4), scale)
        if HAS_RES:  # see kv4
            rx = tl.where(ok, x, float("nan")).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + res_row + d, rx, mask=res_ok)


@triton.jit
def _quantize_store_kernel(key_ptr, value_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                           slot_ptr, codes_ptr, meta_ptr, stride_cb, stride_ch,
                           smooth_ptr, kb_ptr, steps_ptr, pos_ptr,
                           res_k_ptr, res_v_ptr, stride_rt, stride_rh, slot_of_block_ptr,
                           B: tl.constexpr, D: tl.constexpr, KV4: tl.constexpr,
                           HAS_SMOOTH: tl.constexpr, HAS_KB: tl.constexpr,
                           HAS_RES: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # PAD_SLOT_ID
        return
    blk = slot // B
    off = slot % B
    slab = slab_offset(blk, head, stride_cb, stride_ch)
    res_row = 0
    res_ok = False
    if HAS_RES:
        rslot = tl.load(slot_of_block_ptr + blk).to(tl.int64)
        res_ok = rslot >= 0
        res_row = (rslot * B + off) * stride_rt + head * stride_rh
    pos = 0
    if HAS_KB:
        pos = tl.load(pos_ptr + tok)
    _quantize_store_row(key_ptr + tok * stride_kt + head * stride_kh, smooth_ptr + head * D,
                        kb_ptr + head * D, steps_ptr, pos, codes_ptr, meta_ptr, slab, off, 0, 0,
                        res_k_ptr, res_row, res_ok, B, D, KV4, HAS_SMOOTH, HAS_KB, HAS_RES)
    _quantize_store_row(value_ptr + tok * stride_vt + head * stride_vh, smooth_ptr, kb_ptr,
                        steps_ptr, pos, codes_ptr, meta_ptr, slab, off, 1, 1,
                        res_v_ptr, res_row, res_ok, B, D, KV4, False, False, HAS_RES)


def cache_views(cache: torch.Tensor, layout: F.KVPageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, meta) typed views of one (num_blocks, H, B, row_bytes) cache, no copies."""
    nb, h, b, row = cache.shape
    if b != layout.block_size or row != layout.row_bytes:
        raise ValueError(f"cache shape {tuple(cache.shape)} does not match {layout}")
    if cache.stride(-1) != 1 or cache.stride(-2) != row or cache.stride(1) != b * row:
        raise ValueError("each (block, head) slab of the KV cache must be contiguous "
                         f"(got strides {cache.stride()})")
    raw = cache.view(torch.uint8)
    codes = raw if layout.scheme == "kv4" else raw.view(torch.int8)
    meta = raw.view(torch.float16 if layout.scheme == "kv4" else torch.float32)
    return codes, meta


def quantize_and_store(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor,
                       slot_mapping: torch.Tensor, layout: F.KVPageLayout,
                       k_smooth: torch.Tensor | None = None,
                       residual: KVResidual | None = None,
                       k_bias: F.KRopeBias | None = None,
                       positions: torch.Tensor | None = None) -> None:
    """Triton twin of reference.reshape_and_cache (+ reference.store_kv_residual).

    key/value [T, H, D] (any token/head strides, unit stride along D); slot_mapping [>=T].
    With k_bias, positions [>=T] (int32/int64) are the cache positions of the tokens.
    """
    num_tokens, num_heads, head_dim = key.shape
    if head_dim != layout.head_dim or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"key/value must be [T, H, {layout.head_dim}] with unit stride on D")
    num_tokens = min(num_tokens, slot_mapping.shape[0])
    if num_tokens == 0:
        return
    codes, meta = cache_views(cache, layout)
    # Absent optional tensors are replaced by `key`: the constexpr flags keep them unread.
    smooth = key if k_smooth is None else k_smooth.to(torch.float32).contiguous()
    kb, steps, _ = kbias_args(k_bias, num_heads, head_dim, key)
    if k_bias is not None and (positions is None or positions.shape[0] < num_tokens):
        raise ValueError(f"bias-aware K (k_bias) needs the cache positions of all {num_tokens} "
                         "tokens")
    pos = key if k_bias is None else positions
    res_k, res_v, sob = (key, value, slot_mapping) if residual is None else residual[:3]
    _quantize_store_kernel[(num_tokens, num_heads)](
        key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        slot_mapping, codes, meta, cache.stride(0), cache.stride(1),
        smooth, kb, steps, pos, res_k, res_v, res_k.stride(0), res_k.stride(1), sob,
        B=layout.block_size, D=head_dim, KV4=layout.scheme == "kv4",
        HAS_SMOOTH=k_smooth is not None, HAS_KB=k_bias is not None,
        HAS_RES=residual is not None, num_warps=1 if head_dim <= 128 else 2)


def kbias_args(k_bias: F.KRopeBias | None, num_kv_heads: int, head_dim: int,
               dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bias, steps, pairs) kernel arguments of a KRopeBias; `dummy` three times without one
    (the HAS_KB constexpr keeps them unread)."""
    if k_bias is None:
        return dummy, dummy, dummy
    np_ = k_bias.pairs.shape[-1]
    if tuple(k_bias.bias.shape) != (num_kv_heads, head_dim) or \
            tuple(k_bias.steps.shape) != (head_dim // 2,) or \
            tuple(k_bias.pairs.shape) != (num_kv_heads, np_) or \
            np_ < F.MIN_BIAS_PAIRS or np_ & (np_ - 1):
        raise ValueError(f"k_bias has bias {tuple(k_bias.bias.shape)}, steps "
                         f"{tuple(k_bias.steps.shape)} and pairs {tuple(k_bias.pairs.shape)}; "
                         f"expected ({num_kv_heads}, {head_dim}), ({head_dim // 2},) and "
                         f"({num_kv_heads}, P), P a power of two >= {F.MIN_BIAS_PAIRS} "
                         "(formats.make_k_rope_bias)")
    return (k_bias.bias.to(torch.float32).contiguous(), k_bias.steps.to(torch.int64).contiguous(),
            k_bias.pairs.to(torch.int32).contiguous())
