"""Exact prefill's context workspace: the cached context of each prefill row, dequantised to
16 bits, followed by the row's new K/V (formats.context_seqlens), so that one FlashAttention
varlen call (kernels.chunk_attention.context_attention) attends a whole extend chunk, its
cached context through the quantized pages and its own tokens in 16 bits, with no merge.

Why: our Triton prefill kernel reads the packed pages directly but reaches only ~1/3 of FA3's
rate on an extend chunk (BENCHMARKS, prefill micro-benchmark), and a short chunk with a long
context gives it only a handful of programs. Writing the context out in 16 bits costs one
memory-bound pass (4 bytes written per value read as half a byte), after which FA3 does the
compute-bound part at its own speed.

Grid (rows, position blocks, kv heads); every value is produced exactly as the attention
kernels see it: the page's codes times scale plus zero, or the residual pool's 16-bit entry
where its tag is valid, then times k_smooth and plus RoPE_j(b) for K (the pages hold
(K - RoPE_j(b)) / k_smooth), rounded once to the model dtype. reference.gather_context_kv is
the oracle with the same signature.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import formats as F
from .attention import _TL_DTYPE
from .kv_cache import KVResidual, _rope_bias_at, cache_views, kbias_args, meta_index, slab_offset

BLOCK_T = 64  # positions per program


@triton.jit
def _dequant_rows(codes_ptr, meta_ptr, slab, off, rmask, plane: tl.constexpr,
                  B: tl.constexpr, D: tl.constexpr, KV4: tl.constexpr):
    """Page rows [T, D] fp32 of plane 0 (K) or 1 (V) at token offsets `off` of slabs `slab`."""
    if KV4:
        C: tl.constexpr = D // 2
        c = tl.arange(0, C)
        codes = tl.load(codes_ptr + slab[:, None] + plane * B * C + off[:, None] * C + c[None, :],
                        mask=rmask[:, None], other=0)
        s = tl.load(meta_ptr + meta_index(slab, off, 2 * plane, B, C, 2), mask=rmask, other=0.0)
        z = tl.load(meta_ptr + meta_index(slab, off, 2 * plane + 1, B, C, 2), mask=rmask,
                    other=0.0)
        s = s.to(tl.float32)[:, None]
        z = z.to(tl.float32)[:, None]
        lo = (codes & 0xF).to(tl.float32) * s + z  # even d
        hi = (codes >> 4).to(tl.float32) * s + z   # odd d
        return tl.interleave(lo, hi)
    else:
        d = tl.arange(0, D)
        codes = tl.load(codes_ptr + slab[:, None] + plane * B * D + off[:, None] * D + d[None, :],
                        mask=rmask[:, None], other=0)
        s = tl.load(meta_ptr + meta_index(slab, off, plane, B, D, 4), mask=rmask, other=0.0)
        return codes.to(tl.float32) * s[:, None]


@triton.jit
def _gather_context_kernel(codes_ptr, meta_ptr, stride_cb, stride_ch, bt_ptr, stride_bt,
                           seq_lens_ptr, qsl_ptr, cuk_ptr,
                           key_ptr, val_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                           ok_ptr, ov_ptr, stride_ot, stride_oh,
                           smooth_ptr, kb_ptr, steps_ptr,
                           res_k_ptr, res_v_ptr, stride_rt, stride_rh, sob_ptr, tags_ptr, R,
                           B: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                           KV4: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_KB: tl.constexpr,
                           HAS_RES: tl.constexpr, DT: tl.constexpr):
    row = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK
    kvh = tl.program_id(2)
    k_start = tl.load(cuk_ptr + row)
    klen = tl.load(cuk_ptr + row + 1) - k_start
    if t0 >= klen:
        return
    q_start = tl.load(qsl_ptr + row)
    ctx = klen - (tl.load(qsl_ptr + row + 1) - q_start)
    pos = t0 + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    dst = (k_start + pos).to(tl.int64)[:, None] * stride_ot + kvh * stride_oh + d[None, :]
    if t0 < ctx:
        in_ctx = pos < ctx
        blk = tl.load(bt_ptr + row.to(tl.int64) * stride_bt + pos // B, mask=in_ctx,
                      other=0).to(tl.int64)
        off = pos % B
        slab = slab_offset(blk, kvh, stride_cb, stride_ch)
        k = _dequant_rows(codes_ptr, meta_ptr, slab, off, in_ctx, 0, B, D, KV4)
        v = _dequant_rows(codes_ptr, meta_ptr, slab, off, in_ctx, 1, B, D, KV4)
        if HAS_RES:  # the newest R positions of the sequence: the pool where its tag is valid
            win = in_ctx & (pos >= tl.load(seq_lens_ptr + row) - R)
            rslot = tl.load(sob_ptr + blk, mask=win, other=-1).to(tl.int64)
            tag = tl.load(tags_ptr + rslot * B + off, mask=win & (rslot >= 0), other=-1)
            use = win & (rslot >= 0) & (tag.to(tl.int64) == blk)
            rrow = ((rslot * B + off) * stride_rt + kvh * stride_rh)[:, None] + d[None, :]
            k = tl.where(use[:, None], tl.load(res_k_ptr + rrow, mask=use[:, None],
                                               other=0.0).to(tl.float32), k)
            v = tl.where(use[:, None], tl.load(res_v_ptr + rrow, mask=use[:, None],
                                               other=0.0).to(tl.float32), v)
        if HAS_SMOOTH:
            k = k * tl.load(smooth_ptr + kvh * D + d)[None, :]
        if HAS_KB:
            k = k + _rope_bias_at(kb_ptr + kvh * D, steps_ptr, pos[:, None], d[None, :], D)
        tl.store(ok_ptr + dst, k.to(DT), mask=in_ctx[:, None])
        tl.store(ov_ptr + dst, v.to(DT), mask=in_ctx[:, None])
    if t0 + BLOCK > ctx:  # the row's new tokens, copied as given
        new = (pos >= ctx) & (pos < klen)
        tok = (q_start + pos - ctx).to(tl.int64)[:, None]
        kn = tl.load(key_ptr + tok * stride_kt + kvh * stride_kh + d[None, :],
                     mask=new[:, None], other=0.0)
        vn = tl.load(val_ptr + tok * stride_vt + kvh * stride_vh + d[None, :],
                     mask=new[:, None], other=0.0)
        tl.store(ok_ptr + dst, kn, mask=new[:, None])
        tl.store(ov_ptr + dst, vn, mask=new[:, None])


def gather_context_kv(cache: torch.Tensor, layout: F.KVPageLayout, block_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out_k: torch.Tensor, out_v: torch.Tensor, num_rows: int,
                      max_seqlen_k: int, residual: KVResidual | None = None,
                      k_smooth: torch.Tensor | None = None,
                      k_bias: F.KRopeBias | None = None) -> None:
    """Triton twin of reference.gather_context_kv (module docstring). key/value [T, Hkv, D]
    may be strided views (unit stride on D); out_k/out_v [>= cu_seqlens_k[-1], Hkv, D] in
    key's dtype with equal strides; max_seqlen_k >= every row's length."""
    if num_rows == 0 or max_seqlen_k <= 0:
        return
    codes, meta = cache_views(cache, layout)
    num_kv_heads, head_dim = cache.shape[1], layout.head_dim
    for name, t in (("key", key), ("value", value), ("out_k", out_k), ("out_v", out_v)):
        if (t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim) or t.stride(-1) != 1
                or t.dtype != key.dtype):
            raise ValueError(f"{name} must be [T, {num_kv_heads}, {head_dim}] {key.dtype} with "
                             f"unit stride on D, got {tuple(t.shape)} {t.dtype}")
    if key.dtype not in _TL_DTYPE:
        raise ValueError(f"key dtype {key.dtype} is not float16/bfloat16")
    if out_k.stride() != out_v.stride():
        raise ValueError(f"out_k and out_v must have equal strides, got {out_k.stride()} and "
                         f"{out_v.stride()}")
    smooth = key if k_smooth is None else k_smooth.to(torch.float32).contiguous()
    kb, steps, _ = kbias_args(k_bias, num_kv_heads, head_dim, key)
    has_res = residual is not None and residual.tokens > 0
    if has_res:
        res = (residual.k, residual.v, residual.k.stride(0), residual.k.stride(1),
               residual.slot_of_block, residual.tags, int(residual.tokens))
    else:
        res = (key, value, 0, 0, key, key, 0)
    _gather_context_kernel[(num_rows, triton.cdiv(max_seqlen_k, BLOCK_T), num_kv_heads)](
        codes, meta, cache.stride(0), cache.stride(1), block_table, block_table.stride(0),
        seq_lens, query_start_loc, cu_seqlens_k,
        key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out_k, out_v, out_k.stride(0), out_k.stride(1), smooth, kb, steps, *res,
        B=layout.block_size, D=head_dim, BLOCK=BLOCK_T, KV4=layout.scheme == "kv4",
        HAS_SMOOTH=k_smooth is not None, HAS_KB=k_bias is not None, HAS_RES=has_res,
        DT=_TL_DTYPE[key.dtype], num_warps=4)


__all__ = ["gather_context_kv", "BLOCK_T"]
