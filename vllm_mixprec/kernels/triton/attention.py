"""Paged attention over the packed KV4/KV8 pages (formats.KVPageLayout), in Triton.

One kernel body serves both paths; it is specialised by constexprs:
  * decode (rows with query length 1): split-KV flash-decoding, grid (rows, kv_heads,
    splits). The G query heads of one kv head form the M side of a tensor-core tile
    (padded to 16 rows), so every page is read once per kv head. A small second kernel
    (_decode_finish_kernel) attends the residual tail and merges the splits by LSE, a few
    splits per load so that their loads are in flight together; splits with no page tiles
    (short rows) exit at once and are not merged. A batch of one row (and a KV4 batch of
    fewer (row, kv head) pairs than SMs) instead merges in the page kernel: the last program
    of a (row, kv head) to store its partial does it (MERGE_FUSED, decode_merge_mode), and
    the tail is a program of its own.
  * prefill / extend (rows with query length > 1): grid (rows, query blocks, kv_heads);
    BLOCK_M query tokens x G heads per tile, causal mask. Older tokens come from the same
    pages (and residual pool) as decode reads them; the chunk's own tokens (CHUNK_MODE)
    come from the pages they were written to just before (CHUNK_CACHE), from the step's
    16-bit K/V in a loop of this kernel (CHUNK_TRITON, exact prefill), or were attended
    already by FlashAttention, whose normalised output and log-sum-exp are the starting
    state of the online softmax (CHUNK_MERGE, exact prefill at FlashAttention's speed).

No K or V tile is dequantised to a float matrix. Scores use the codes directly:
    q . (code * s + z) = s * (q . code) + z * sum(q)          (kv4; kv8 has no z)
so the tensor cores multiply q by the raw nibbles (exact in fp16/bf16), and the scale and
zero are applied per column in fp32. For V, the per-token scale is folded into P:
    sum_n p_n (code_n * s_n + z_n) = (p * s) @ codes + sum_n p_n z_n.
Nibble d-order (even d low) is handled by splitting q and the output into even and odd
halves rather than interleaving registers.

The residual window (attention_backend/residual.py) is one extra "tail" tile of the newest
R positions: each column takes the 16-bit pool entry when its tag is valid, else the page.
On GPUs the codes are unpacked with a few PTX bit operations (see _ASM_NIBBLES).

Bias-aware K (HAS_KB, formats.KRopeBias): the pages hold K - RoPE_p(b) (over k_smooth), and
every score gets q . RoPE_p(b) back. With A_i = q_i b_i + q_{i+D/2} b_{i+D/2} and
B_i = q_{i+D/2} b_i - q_i b_{i+D/2} over the NP kept rotary pairs i (per query row, once per
program; the raw query, not the smoothed one), that term is
    sum_i A_i cos(p w_i) + B_i sin(p w_i).
For a tile of positions p0 + j*V + v (chunks j of V = KB_V columns), angle addition moves
the chunk start to the query side: (A, B) rotated by (p0 + jV) w_i (one cos/sin per pair and
chunk), then one fp16 tensor-core dot each with cos(v w_i) / sin(v w_i) [NP, V], tables that
depend on nothing but the offsets and are computed once per program. No cos/sin per
(key, channel), and nothing is loaded per key but the codes.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ... import envs
from ... import formats as F
from .. import cuda as cuda_ops
from . import capability_major
from .kv_cache import KVResidual, cache_views, kbias_args, meta_index, rope_angle, slab_offset

LOG2E = 1.4426950408889634
# prefill's CHUNK_MODE: where a row's own new tokens come from (module docstring); launches
# pass .value
CHUNK_CACHE, CHUNK_TRITON, CHUNK_MERGE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# Who attends a decode row's residual tail (decode_tail_mode): the finish kernel, after every
# split; the row's last writing split, after its pages; or a program of its own, launched as one
# more split beside the page splits, whose partial the finish kernel merges like theirs.
TAIL_FINISH, TAIL_LAST_SPLIT, TAIL_PROGRAM = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
TAIL_MODES = {"finish": TAIL_FINISH.value, "split": TAIL_LAST_SPLIT.value, "program": TAIL_PROGRAM.value}
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# --- shared helpers -----------------------------------------------------------------------

# Codes -> fp16 on GPUs: int->float conversions issue at 1/4 rate on sm80/sm90 and would make
# decode ALU-bound. Instead OR the code into the mantissa of 1024.0 (0x6400: ulp 1) and
# subtract 1024 with one packed f16x2 op: 4 codes per 32-bit register, ~1.5 ops per value.
# kv8 codes are signed: x ^ 0x80 = x + 128, so subtract 1152 (0x6480) instead.
_ASM_NIBBLES = tl.constexpr("""
{
.reg .b32 u_t0, u_t1, u_z, u_m, u_c;
mov.b32 u_z, 0;
mov.b32 u_m, 0x000F000F;
mov.b32 u_c, 0x64006400;
prmt.b32 u_t0, $4, u_z, 0x4140;
prmt.b32 u_t1, $4, u_z, 0x4342;
lop3.b32 $0, u_t0, u_m, u_c, 0xEA;
lop3.b32 $1, u_t1, u_m, u_c, 0xEA;
shr.b32 u_t0, u_t0, 4;
shr.b32 u_t1, u_t1, 4;
lop3.b32 $2, u_t0, u_m, u_c, 0xEA;
lop3.b32 $3, u_t1, u_m, u_c, 0xEA;
sub.f16x2 $0, $0, u_c;
sub.f16x2 $1, $1, u_c;
sub.f16x2 $2, $2, u_c;
sub.f16x2 $3, $3, u_c;
}
""")
_ASM_INT8 = tl.constexpr("""
{
.reg .b32 u_t0, u_t1, u_z, u_x, u_c, u_b;
mov.b32 u_z, 0;
mov.b32 u_x, 0x00800080;
mov.b32 u_c, 0x64006400;
mov.b32 u_b, 0x64806480;
prmt.b32 u_t0, $2, u_z, 0x4140;
prmt.b32 u_t1, $2, u_z, 0x4342;
lop3.b32 $0, u_t0, u_x, u_c, 0xBE;
lop3.b32 $1, u_t1, u_x, u_c, 0xBE;
sub.f16x2 $0, $0, u_b;
sub.f16x2 $1, $1, u_b;
}
""")


@triton.jit
def _unpack_nibbles(codes, FAST: tl.constexpr):
    """uint8 [N, C] -> (low, high) nibbles as fp16 (exact integers 0..15)."""
    if FAST:
        lo, hi = tl.inline_asm_elementwise(_ASM_NIBBLES, "=r,=r,=r,=r,r", [codes],
                                           dtype=(tl.float16, tl.float16), is_pure=True,
                                           pack=4)
        return lo, hi
    else:
        return ((codes & 0xF).to(tl.float32).to(tl.float16),
                (codes >> 4).to(tl.float32).to(tl.float16))


@triton.jit
def _unpack_int8(codes, FAST: tl.constexpr):
    """int8 [N, D] -> fp16 (exact integers -127..127)."""
    if FAST:
        return tl.inline_asm_elementwise(_ASM_INT8, "=r,=r,r", [codes], dtype=tl.float16,
                                         is_pure=True, pack=4)
    else:
        return codes.to(tl.float32).to(tl.float16)


@triton.jit
def _to_dot16(x, shift):
    """fp32 query values -> fp16 operands for the page dots; `shift` (a power of two, 1 for
    any realistic query) keeps bf16 queries beyond fp16's range finite."""
    return (x / shift[:, None]).to(tl.float16)


@triton.jit
def _load_q(q_ptr, tok, head, rmask, stride_qt, stride_qh, smooth_ptr,
            D: tl.constexpr, KV4: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr):
    """Query rows [M] -> (qa, qb, qa16, qb16, qsum, shift).

    kv4 splits d into even (qa) and odd (qb) halves (the nibble order); kv8 uses qa = qb =
    all of d. qa/qb are in the model dtype (residual dots), qa16/qb16 in fp16 (page dots,
    scaled by 1/shift); qsum = sum_d q as the page dots see it (multiplies the zero point).
    """
    base = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh
    HALF: tl.constexpr = D // 2 if KV4 else D
    STEP: tl.constexpr = 2 if KV4 else 1
    c = tl.arange(0, HALF)
    fa = tl.load(base + STEP * c[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    if KV4:
        fb = tl.load(base + 2 * c[None, :] + 1, mask=rmask[:, None], other=0.0).to(tl.float32)
    else:
        fb = fa
    if HAS_SMOOTH:  # the pages hold K / smooth, so q is multiplied by it
        fa = fa * tl.load(smooth_ptr + STEP * c)[None, :]
        if KV4:
            fb = fb * tl.load(smooth_ptr + 2 * c + 1)[None, :]
        else:
            fb = fa
    qa = fa.to(DT)
    qb = fb.to(DT)
    fa = qa.to(tl.float32)
    fb = qb.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(fa), 1), tl.max(tl.abs(fb), 1))
    shift = tl.math.exp2(tl.maximum(tl.ceil(tl.math.log2(amax)) - 14.0, 0.0))
    qa16 = _to_dot16(fa, shift)
    qb16 = _to_dot16(fb, shift)
    qsum = tl.sum(qa16.to(tl.float32), 1) * shift
    if KV4:
        qsum += tl.sum(qb16.to(tl.float32), 1) * shift
    return qa, qb, qa16, qb16, qsum, shift


@triton.jit
def _tile_meta(meta_ptr, bt_row, it, kvh, stride_cb, stride_ch, page_end,
               B: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr, KV4: tl.constexpr):
    """(k_scale, k_zero, v_scale, v_zero) [BLOCK_N] fp32 of a block-aligned page tile.

    Loaded as one [chunks, planes, tokens] tile of contiguous runs (each page keeps a plane's
    B entries together), so that the loads are vectorised and software-pipelined; kv8 has
    no zeros (returned as the scales, unused).
    """
    TPB: tl.constexpr = B if B < BLOCK_N else BLOCK_N
    NCH: tl.constexpr = BLOCK_N // TPB
    P: tl.constexpr = 4 if KV4 else 2
    MB: tl.constexpr = 2 if KV4 else 4
    start = it * BLOCK_N + tl.arange(0, NCH) * TPB
    cblk = tl.load(bt_row + start // B, mask=start < page_end, other=0).to(tl.int64)
    base = meta_index(slab_offset(cblk, kvh, stride_cb, stride_ch), start % B, 0, B, C, MB)
    t = tl.arange(0, TPB)
    ptr = meta_ptr + base[:, None, None] + tl.arange(0, P)[None, :, None] * B + t[None, None, :]
    # Mask whole pages only (a page of the table is allocated even past the sequence end):
    # a per-token mask would defeat vector loads and hence the pipelining of this load.
    vals = tl.load(ptr, mask=(start < page_end)[:, None, None], other=0.0).to(tl.float32)
    # ...but zero what lies past the end: garbage scales times p = 0 could still make NaNs.
    vals = tl.where((start[:, None, None] + t[None, None, :]) < page_end, vals, 0.0)
    vals = tl.reshape(tl.permute(vals, (0, 2, 1)), [BLOCK_N, P])
    if KV4:  # planes 0..3 = (a, b) in [2, 2]: split b, then a
        sv, zs = tl.split(tl.reshape(vals, [BLOCK_N, 2, 2]))
        ks, vs = tl.split(sv)
        kz, vz = tl.split(zs)
        return ks, kz, vs, vz
    else:
        ks, vs = tl.split(vals)
        return ks, ks, vs, vs


@triton.jit
def _token_meta(meta_ptr, slab, off, col, B: tl.constexpr, C: tl.constexpr, KV4: tl.constexpr):
    """The same four vectors for arbitrary (unaligned) token positions: gathers."""
    if KV4:
        ks = tl.load(meta_ptr + meta_index(slab, off, 0, B, C, 2), mask=col, other=0.0)
        kz = tl.load(meta_ptr + meta_index(slab, off, 1, B, C, 2), mask=col, other=0.0)
        vs = tl.load(meta_ptr + meta_index(slab, off, 2, B, C, 2), mask=col, other=0.0)
        vz = tl.load(meta_ptr + meta_index(slab, off, 3, B, C, 2), mask=col, other=0.0)
        return ks.to(tl.float32), kz.to(tl.float32), vs.to(tl.float32), vz.to(tl.float32)
    else:
        ks = tl.load(meta_ptr + meta_index(slab, off, 0, B, C, 4), mask=col, other=0.0)
        vs = tl.load(meta_ptr + meta_index(slab, off, 1, B, C, 4), mask=col, other=0.0)
        return ks, ks, vs, vs


@triton.jit
def _page_scores(qa16, qb16, qsum, shift, ks, kz, codes_ptr, slab, off, col,
                 B: tl.constexpr, D: tl.constexpr, KV4: tl.constexpr, FAST: tl.constexpr):
    """q . k_hat for N page tokens -> [M, N] fp32 (masked columns give 0)."""
    if KV4:
        C: tl.constexpr = D // 2
        c = tl.arange(0, C)
        kc = tl.load(codes_ptr + slab[:, None] + off[:, None] * C + c[None, :],
                     mask=col[:, None], other=0)
        lo, hi = _unpack_nibbles(kc, FAST)
        s = tl.dot(qa16, tl.trans(lo))
        s = tl.dot(qb16, tl.trans(hi), s)
        return (s * shift[:, None]) * ks[None, :] + qsum[:, None] * kz[None, :]
    else:
        d = tl.arange(0, D)
        kc = tl.load(codes_ptr + slab[:, None] + off[:, None] * D + d[None, :],
                     mask=col[:, None], other=0)
        s = tl.dot(qa16, tl.trans(_unpack_int8(kc, FAST)))
        return (s * shift[:, None]) * ks[None, :]


@triton.jit
def _page_pv(p, acc_a, acc_b, acc_z, vs, vz, codes_ptr, slab, off, col,
             B: tl.constexpr, D: tl.constexpr, KV4: tl.constexpr, FAST: tl.constexpr):
    """acc += p @ v_hat for N page tokens (kv4: even/odd halves + the zero-point column).

    p * scale is fed to the tensor cores as fp16 whatever the model dtype: it lies in
    [0, scale], the codes are exact in fp16, and fp16 keeps 3 more bits than bf16.
    """
    if KV4:
        C: tl.constexpr = D // 2
        c = tl.arange(0, C)
        vc = tl.load(codes_ptr + slab[:, None] + B * C + off[:, None] * C + c[None, :],
                     mask=col[:, None], other=0)
        lo, hi = _unpack_nibbles(vc, FAST)
        pv = (p * vs[None, :]).to(tl.float16)
        acc_a = tl.dot(pv, lo, acc_a)
        acc_b = tl.dot(pv, hi, acc_b)
        acc_z = acc_z + tl.sum(p * vz[None, :], 1)
    else:
        d = tl.arange(0, D)
        vc = tl.load(codes_ptr + slab[:, None] + B * D + off[:, None] * D + d[None, :],
                     mask=col[:, None], other=0)
        acc_a = tl.dot((p * vs[None, :]).to(tl.float16), _unpack_int8(vc, FAST), acc_a)
    return acc_a, acc_b, acc_z


@triton.jit
def _res_rows(res_ptr, rrow, use, D: tl.constexpr, KV4: tl.constexpr, DT: tl.constexpr):
    """16-bit residual rows [N, D] -> (even, odd) halves (kv4) or (full, full) (kv8), as DT."""
    if KV4:
        c = tl.arange(0, D // 2)
        a = tl.load(res_ptr + rrow[:, None] + 2 * c[None, :], mask=use[:, None], other=0.0)
        b = tl.load(res_ptr + rrow[:, None] + 2 * c[None, :] + 1, mask=use[:, None], other=0.0)
        return a.to(tl.float32).to(DT), b.to(tl.float32).to(DT)
    else:
        d = tl.arange(0, D)
        a = tl.load(res_ptr + rrow[:, None] + d[None, :], mask=use[:, None], other=0.0)
        a = a.to(tl.float32).to(DT)
        return a, a


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One flash-attention step in base 2: returns (p, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _finite_rows(x):
    """[N, C] -> [N] bool: the row holds no NaN and no Inf."""
    return tl.sum(tl.where(tl.abs(x.to(tl.float32)) < float("inf"), 0, 1), 1) == 0


@triton.jit
def _first_rows(x, R: tl.constexpr):
    """x [M, H] (M a multiple of R) -> x[:R] [R, H], as a masked sum over the M // R row
    blocks (Triton has no slicing)."""
    M: tl.constexpr = x.shape[0]
    H: tl.constexpr = x.shape[1]
    blocks = tl.reshape(x, [M // R, R, H])
    first = tl.arange(0, M // R)[:, None, None] == 0
    return tl.sum(tl.where(first, blocks, 0.0), 0)


@triton.jit
def _first_entries(v, R: tl.constexpr):
    """v [M] -> v[:R] (_first_rows of a vector)."""
    return tl.reshape(_first_rows(v[:, None], R), [R])


@triton.jit
def _poison_scores(s, bad):
    """NaN in the scores of bad key columns [N]: the queries that attend them (causally; the
    mask applied after this turns the others' into -inf) return NaN, while the bad rows' V is
    zeroed by the caller, so that p = 0 times NaN cannot reach the queries that do not."""
    return tl.where(bad[None, :], float("nan"), s)


@triton.jit
def _kbias_query(q_ptr, tok, head, rmask, stride_qt, stride_qh, kb_ptr, pairs_ptr, steps_ptr,
                 D: tl.constexpr, NP: tl.constexpr):
    """The query side of this kv head's bias term over its NP kept pairs (module docstring):
    (A, B) [M, NP] fp32 from the raw query rows, kshift [M], a power of two that keeps their
    rotations in fp16 range (a rotation keeps |(A_i, B_i)|), and the pairs' phase steps."""
    HALF: tl.constexpr = D // 2
    i = tl.load(pairs_ptr + tl.arange(0, NP))
    base = q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + i[None, :]
    q1 = tl.load(base, mask=rmask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(base + HALF, mask=rmask[:, None], other=0.0).to(tl.float32)
    b1 = tl.load(kb_ptr + i)[None, :]
    b2 = tl.load(kb_ptr + HALF + i)[None, :]
    a = q1 * b1 + q2 * b2
    b = q2 * b1 - q1 * b2
    amax = tl.max(tl.sqrt(a * a + b * b), 1)
    kshift = tl.math.exp2(tl.maximum(tl.ceil(tl.math.log2(amax)) - 14.0, 0.0))
    return a, b, kshift, tl.load(steps_ptr + i)


@triton.jit
def _kbias_tables(steps, V: tl.constexpr):
    """cos, sin [NP, V] fp16 of the angles of position offsets 0..V-1 (steps [NP])."""
    ang = rope_angle(tl.arange(0, V)[None, :], steps[:, None])
    return tl.cos(ang).to(tl.float16), tl.sin(ang).to(tl.float16)


@triton.jit
def _kbias_scores(a, b, kshift, tab_c, tab_s, p0, steps, N: tl.constexpr, V: tl.constexpr):
    """q . RoPE_p(b) [M, N] fp32 for the positions p = p0 + n, n < N, in chunks of V columns
    (tables of _kbias_tables(V)); the module docstring has the algebra."""
    M: tl.constexpr = a.shape[0]
    NP: tl.constexpr = a.shape[1]
    J: tl.constexpr = N // V
    inv = 1.0 / kshift
    if J == 1:
        ang = rope_angle(p0, steps)[None, :]
        c = tl.cos(ang)
        s = tl.sin(ang)
        ra = ((a * c + b * s) * inv[:, None]).to(tl.float16)
        rb = ((b * c - a * s) * inv[:, None]).to(tl.float16)
        r = tl.dot(ra, tab_c)
        r = tl.dot(rb, tab_s, r)
    else:
        ang = rope_angle(p0 + V * tl.arange(0, J)[:, None], steps[None, :])[None, :, :]
        c = tl.cos(ang)
        s = tl.sin(ang)
        a3 = a[:, None, :]
        b3 = b[:, None, :]
        i3 = inv[:, None, None]
        ra = tl.reshape(((a3 * c + b3 * s) * i3).to(tl.float16), [M * J, NP])
        rb = tl.reshape(((b3 * c - a3 * s) * i3).to(tl.float16), [M * J, NP])
        r = tl.dot(ra, tab_c)
        r = tl.dot(rb, tab_s, r)
        r = tl.reshape(r, [M, N])
    return r * kshift[:, None]


# --- attention over a range of pages, and over the residual tail ---------------------------

@triton.jit
def _attend_pages(qa16, qb16, qsum, shift, qpos, m_i, l_i, acc_a, acc_b, acc_z, t0, t1, page_end,
                  bt_row, kvh, codes_ptr, meta_ptr, stride_cb, stride_ch, qk_scale,
                  kb_a, kb_b, kshift, tab_c, tab_s, kb_steps,
                  B: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, KV4: tl.constexpr,
                  FAST: tl.constexpr, HAS_KB: tl.constexpr, KB_V: tl.constexpr,
                  CAUSAL_TILES: tl.constexpr):
    """Online softmax over the page tiles [t0, t1) of BLOCK_N block-aligned positions.
    CAUSAL_TILES (prefill): a tile may hold keys that some of its queries do not attend, so a
    poisoned V row (NaN scale) is kept from them (_poison_scores); decode attends every key."""
    C: tl.constexpr = D // 2 if KV4 else D
    for it in range(t0, t1):
        pos = it * BLOCK_N + tl.arange(0, BLOCK_N)
        col = pos < page_end
        blk = tl.load(bt_row + pos // B, mask=col, other=0).to(tl.int64)
        off = pos % B
        slab = slab_offset(blk, kvh, stride_cb, stride_ch)
        ks, kz, vs, vz = _tile_meta(meta_ptr, bt_row, it, kvh, stride_cb, stride_ch, page_end,
                                    B, C, BLOCK_N, KV4)
        s = _page_scores(qa16, qb16, qsum, shift, ks, kz, codes_ptr, slab, off, col,
                         B, D, KV4, FAST)
        if HAS_KB:
            s += _kbias_scores(kb_a, kb_b, kshift, tab_c, tab_s, it * BLOCK_N, kb_steps,
                               BLOCK_N, KB_V)
        if CAUSAL_TILES:
            bad = vs != vs
            s = _poison_scores(s, bad)
            vs = tl.where(bad, 0.0, vs)
            vz = tl.where(bad, 0.0, vz)
        s = tl.where(col[None, :] & (pos[None, :] <= qpos[:, None]), s * qk_scale, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
        acc_z = acc_z * alpha
        acc_a, acc_b, acc_z = _page_pv(p, acc_a, acc_b, acc_z, vs, vz, codes_ptr, slab, off,
                                       col, B, D, KV4, FAST)
    return m_i, l_i, acc_a, acc_b, acc_z


@triton.jit
def _attend_tail(qa, qb, qa16, qb16, qsum, shift, qpos, m_i, l_i, acc_a, acc_b, acc_z,
                 win, kv_end, bt_row, kvh, codes_ptr, meta_ptr, stride_cb, stride_ch,
                 res_k_ptr, res_v_ptr, stride_rt, stride_rh, sob_ptr, tags_ptr, qk_scale,
                 kb_a, kb_b, kshift, kb_steps,
                 B: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, KV4: tl.constexpr,
                 DT: tl.constexpr, HAS_KB: tl.constexpr):
    """Positions [win, kv_end) (the newest R): each column takes the 16-bit pool entry when
    its tag is valid, else the page (plain unpack: a tail tile can hold fewer than 4 codes
    per thread)."""
    C: tl.constexpr = D // 2 if KV4 else D
    pos = win + tl.arange(0, BLOCK_R)
    col = pos < kv_end
    blk = tl.load(bt_row + pos // B, mask=col, other=0).to(tl.int64)
    off = pos % B
    slab = slab_offset(blk, kvh, stride_cb, stride_ch)
    rslot = tl.load(sob_ptr + blk, mask=col, other=-1).to(tl.int64)
    tag = tl.load(tags_ptr + rslot * B + off, mask=col & (rslot >= 0), other=-1)
    use = col & (rslot >= 0) & (tag.to(tl.int64) == blk)
    page = col & ~use
    rrow = (rslot * B + off) * stride_rt + kvh * stride_rh
    ka, kb = _res_rows(res_k_ptr, rrow, use, D, KV4, DT)
    s_res = tl.dot(qa, tl.trans(ka))
    if KV4:
        s_res = tl.dot(qb, tl.trans(kb), s_res)
    ks, kz, vs, vz = _token_meta(meta_ptr, slab, off, page, B, C, KV4)
    s_pg = _page_scores(qa16, qb16, qsum, shift, ks, kz, codes_ptr, slab, off, page,
                        B, D, KV4, False)
    s = tl.where(use[None, :], s_res, s_pg)
    if HAS_KB:  # pool and page columns both hold K - RoPE_p(b)
        tab_c, tab_s = _kbias_tables(kb_steps, BLOCK_R)
        s += _kbias_scores(kb_a, kb_b, kshift, tab_c, tab_s, win, kb_steps, BLOCK_R, BLOCK_R)
    # a poisoned V row: NaN scale in the page, all NaN in the pool (one element tells)
    v0 = tl.load(res_v_ptr + rrow, mask=use, other=0.0).to(tl.float32)
    bad = (vs != vs) | (v0 != v0)
    s = _poison_scores(s, bad)
    vs = tl.where(bad, 0.0, vs)
    vz = tl.where(bad, 0.0, vz)
    s = s * qk_scale
    s = tl.where(col[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
    acc_a = acc_a * alpha[:, None]
    acc_b = acc_b * alpha[:, None]
    acc_z = acc_z * alpha
    acc_a, acc_b, acc_z = _page_pv(tl.where(use[None, :], 0.0, p), acc_a, acc_b, acc_z, vs, vz,
                                   codes_ptr, slab, off, page, B, D, KV4, False)
    va, vb = _res_rows(res_v_ptr, rrow, use & ~bad, D, KV4, DT)
    p_res = tl.where(use[None, :], p, 0.0).to(DT)
    acc_a = tl.dot(p_res, va, acc_a)
    if KV4:
        acc_b = tl.dot(p_res, vb, acc_b)
    return m_i, l_i, acc_a, acc_b, acc_z


@triton.jit
def _attend_chunk(qa, qb, qpos, m_i, l_i, acc_a, acc_b, acc_z, q_start, ctx, kv_end, kvh,
                  key_ptr, val_ptr, stride_kt, stride_kh, stride_vt, stride_vh, smooth_ptr,
                  qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr, KV4: tl.constexpr,
                  HAS_SMOOTH: tl.constexpr, DT: tl.constexpr):
    """Positions [ctx, kv_end): the row's own new tokens, read in 16 bits from the K/V this
    step was given (exact prefill). They carry the raw K, bias included, so no bias term;
    with SmoothAttention K is divided by k_smooth (rounded to DT, as the pool holds it) to
    meet the smoothed query."""
    HALF: tl.constexpr = D // 2 if KV4 else D
    STEP: tl.constexpr = 2 if KV4 else 1
    c = tl.arange(0, HALF)
    ks_a = tl.full([HALF], 1.0, tl.float32)
    ks_b = ks_a
    if HAS_SMOOTH:
        ks_a = tl.load(smooth_ptr + STEP * c)
        ks_b = tl.load(smooth_ptr + 2 * c + 1) if KV4 else ks_a
    for start in range(ctx, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        col = pos < kv_end
        tok = (q_start + pos - ctx).to(tl.int64)
        ka, kb = _res_rows(key_ptr, tok * stride_kt + kvh * stride_kh, col, D, KV4, DT)
        if HAS_SMOOTH:
            ka = tl.math.div_rn(ka.to(tl.float32), tl.broadcast_to(ks_a[None, :], (BLOCK_N, HALF))
                                ).to(DT)
            if KV4:
                kb = tl.math.div_rn(kb.to(tl.float32),
                                    tl.broadcast_to(ks_b[None, :], (BLOCK_N, HALF))).to(DT)
        s = tl.dot(qa, tl.trans(ka))
        if KV4:
            s = tl.dot(qb, tl.trans(kb), s)
        va, vb = _res_rows(val_ptr, tok * stride_vt + kvh * stride_vh, col, D, KV4, DT)
        # a non-finite K or V row: NaN for exactly the queries attending it (_poison_scores)
        bad = ~(_finite_rows(ka) & _finite_rows(va))
        if KV4:
            bad = bad | ~(_finite_rows(kb) & _finite_rows(vb))
        s = _poison_scores(s, bad)
        va = tl.where(bad[:, None], 0.0, va).to(DT)
        vb = tl.where(bad[:, None], 0.0, vb).to(DT)
        s = tl.where(col[None, :] & (pos[None, :] <= qpos[:, None]), s * qk_scale, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
        acc_z = acc_z * alpha
        pd = p.to(DT)
        acc_a = tl.dot(pd, va, acc_a)
        if KV4:
            acc_b = tl.dot(pd, vb, acc_b)
    return m_i, l_i, acc_a, acc_b, acc_z


@triton.jit
def _chunk_state(out_row, lse_row, rmask, D: tl.constexpr, KV4: tl.constexpr):
    """CHUNK_MERGE: the online-softmax state (m, l, acc_a, acc_b) of rows whose chunk was
    attended by FlashAttention: its normalised output [M, D] (at row pointers out_row) with
    l = 1 and m = its natural log-sum-exp in this kernel's base 2."""
    HALF: tl.constexpr = D // 2 if KV4 else D
    STEP: tl.constexpr = 2 if KV4 else 1
    src = out_row[:, None] + STEP * tl.arange(0, HALF)[None, :]
    acc_a = tl.load(src, mask=rmask[:, None], other=0.0).to(tl.float32)
    acc_b = acc_a
    if KV4:
        acc_b = tl.load(src + 1, mask=rmask[:, None], other=0.0).to(tl.float32)
    m_i = tl.load(lse_row, mask=rmask, other=0.0) * 1.4426950408889634
    return m_i, tl.where(rmask, 1.0, 0.0), acc_a, acc_b


@triton.jit
def _store_rows(dst_row, acc_a, acc_b, acc_z, l_i, rmask, D: tl.constexpr, KV4: tl.constexpr):
    """Normalise and store [M, D] rows at row pointers dst_row [M] (re-interleaving kv4's
    even/odd halves and adding its V zero-point column)."""
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    HALF: tl.constexpr = D // 2 if KV4 else D
    STEP: tl.constexpr = 2 if KV4 else 1
    dst = dst_row[:, None] + STEP * tl.arange(0, HALF)[None, :]
    tl.store(dst, ((acc_a + acc_z[:, None]) * inv[:, None]).to(dst.dtype.element_ty),
             mask=rmask[:, None])
    if KV4:
        tl.store(dst + 1, ((acc_b + acc_z[:, None]) * inv[:, None]).to(dst.dtype.element_ty),
                 mask=rmask[:, None])


@triton.jit
def _decode_tiles(seq_len, res_tokens, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  HAS_RES: tl.constexpr, TAIL: tl.constexpr, MIN_TILES: tl.constexpr):
    """A decode row's page tiles (all but the newest res_tokens positions, the residual
    tail's) in runs of whole tiles per split: (tiles, tiles per split, page splits that write
    a partial). With TAIL_LAST_SPLIT the last of those also attends the tail, so a row without
    page tiles still has one. The paged and finish kernels both partition with it."""
    win = seq_len
    if HAS_RES:
        win = tl.maximum(seq_len - res_tokens, 0)
    n_tiles = tl.cdiv(win, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(n_tiles, NUM_SPLITS), MIN_TILES)  # (decode_min_tiles)
    writers = tl.cdiv(n_tiles, per_split)
    if TAIL == TAIL_LAST_SPLIT:
        writers = tl.maximum(writers, 1)
    return n_tiles, per_split, writers


@triton.jit
def _query_tile(q_ptr, stride_qt, stride_qh, smooth_ptr, qsl_ptr, seq_lens_ptr, row, kvh, mb,
                D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                KV4: tl.constexpr, HAS_SMOOTH: tl.constexpr, DT: tl.constexpr):
    """The M = BLOCK_M * G_PAD (query token, head) rows of a program and their positions."""
    q_start = tl.load(qsl_ptr + row)
    qlen = tl.load(qsl_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    r = tl.arange(0, BLOCK_M * G_PAD)
    tq = mb * BLOCK_M + r // G_PAD
    g = r % G_PAD
    rmask = (tq < qlen) & (g < G)
    tok = (q_start + tq).to(tl.int64)
    head = kvh * G + g
    qpos = seq_len - qlen + tq
    qa, qb, qa16, qb16, qsum, shift = _load_q(q_ptr, tok, head, rmask, stride_qt, stride_qh,
                                              smooth_ptr + kvh * D, D, KV4, HAS_SMOOTH, DT)
    return qa, qb, qa16, qb16, qsum, shift, tok, head, rmask, qpos, qlen, seq_len


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, row, head, rmask, writers, m_i, l_i, acc_a, acc_b,
                  num_q_heads, D: tl.constexpr, KV4: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  SLOTS: tl.constexpr):
    """Fold the split partials of a decode row (slots < writers, and a tail program's slot
    NUM_SPLITS) into the (m_i, l_i, acc) state of its [R] query heads, by log-sum-exp.
    Unrolled over the slots with masked loads that do not depend on each other, so they are
    all in flight at once and no cross-warp reduction is needed. The loads bypass L1 (.cg):
    with MERGE_FUSED the partials were written by other SMs during this launch."""
    HALF: tl.constexpr = D // 2 if KV4 else D
    STEP: tl.constexpr = 2 if KV4 else 1
    hh = tl.arange(0, HALF)
    for s in tl.static_range(SLOTS):
        live = rmask & (s < writers)
        if s == NUM_SPLITS:  # the tail program's partial (lse -inf when the row has no tail)
            live = rmask
        pidx = ((row * SLOTS + s) * num_q_heads + head).to(tl.int64)
        lse = tl.load(part_lse_ptr + pidx, mask=live, other=float("-inf"), cache_modifier=".cg")
        src = part_o_ptr + pidx[:, None] * D + STEP * hh[None, :]
        part_a = tl.load(src, mask=live[:, None], other=0.0, cache_modifier=".cg")
        part_b = part_a
        if KV4:
            part_b = tl.load(src + 1, mask=live[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        beta = tl.math.exp2(lse - m_safe)
        acc_a = acc_a * alpha[:, None] + beta[:, None] * part_a
        if KV4:
            acc_b = acc_b * alpha[:, None] + beta[:, None] * part_b
        l_i = l_i * alpha + beta
        m_i = m_new
    return acc_a, acc_b, l_i


# --- the kernels -----------------------------------------------------------------------------

# stride_lse_h is FlashAttention's token count, new every step: specializing on its value
# (== 1, % 16) would recompile the kernel mid-serving (seen on the H100, 2026-11-25)
@triton.jit(do_not_specialize=["stride_lse_h"])
def _paged_attn_kernel(
        q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, part_o_ptr, part_lse_ptr,
        merge_cnt_ptr,
        codes_ptr, meta_ptr, stride_cb, stride_ch,
        bt_ptr, stride_bt, seq_lens_ptr, qsl_ptr,
        smooth_ptr, kb_ptr, steps_ptr, pairs_ptr,
        res_k_ptr, res_v_ptr, stride_rt, stride_rh, sob_ptr, tags_ptr, res_tokens,
        key_ptr, val_ptr, stride_kt, stride_kh, stride_vt, stride_vh, lse_ptr, stride_lse_h,
        num_q_heads, qk_scale,
        B: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DECODE: tl.constexpr, KV4: tl.constexpr,
        HAS_SMOOTH: tl.constexpr, HAS_KB: tl.constexpr, NP: tl.constexpr, KB_V: tl.constexpr,
        HAS_RES: tl.constexpr, DT: tl.constexpr, FAST_UNPACK: tl.constexpr,
        CHUNK_MODE: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr = False,
        MIN_TILES: tl.constexpr = 1, MERGE_FUSED: tl.constexpr = False,
        G_ROWS: tl.constexpr = 1):
    """Decode (grid rows x kv_heads x splits; rows of query length 1) or prefill/extend
    (grid rows x kv_heads x query blocks; rows of query length > 1). Decode writes split
    partials when _decode_finish_kernel follows; the residual tail is attended as TAIL says:
    by the finish kernel, the last writing split, or (TAIL_PROGRAM) one more program (grid
    z = 0, partial slot NUM_SPLITS) that attends no pages.
    MERGE_FUSED (decode_merge_mode "fused"): no finish kernel; each writer counts itself in
    merge_cnt_ptr[row, kv head] once its partial is stored, and the last to arrive merges
    the row's partials (_merge_splits, over the group's G_ROWS) and resets the count.
    Prefill: the older tokens come from the pages (and the residual pool) as decode reads
    them, the row's own new tokens as CHUNK_MODE says (module docstring)."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    x = tl.program_id(2)  # decode: split index; prefill: query block
    if DECODE and TAIL == TAIL_PROGRAM:  # the tail program at z = 0: the grid's z-slices are
        x = (x + NUM_SPLITS) % (NUM_SPLITS + 1)  # dispatched in order, so it overlaps the pages
    if PDL:  # the finish kernel may start its tail while the splits run (decode_pdl)
        gdc_launch_dependents()
    qlen = tl.load(qsl_ptr + row + 1) - tl.load(qsl_ptr + row)
    if DECODE:
        if qlen != 1:
            return
        mb = 0
        n_tiles, per_split, writers = _decode_tiles(tl.load(seq_lens_ptr + row), res_tokens,
                                                    BLOCK_N, NUM_SPLITS, HAS_RES, TAIL, MIN_TILES)
        if x >= writers and NUM_SPLITS > 1 and x < NUM_SPLITS:  # a split past the row's tiles
            return                                   # writes nothing; the finish kernel skips it
    else:
        if qlen <= 1:
            return
        mb = x
        writers = x + 1  # (each query block attends its own tail)
        if mb * BLOCK_M >= qlen:
            return
        if CHUNK_MODE == CHUNK_MERGE:  # nothing cached: FlashAttention's output is final
            if tl.load(seq_lens_ptr + row) == qlen:
                return
    qa, qb, qa16, qb16, qsum, shift, tok, head, rmask, qpos, qlen, seq_len = _query_tile(
        q_ptr, stride_qt, stride_qh, smooth_ptr, qsl_ptr, seq_lens_ptr, row, kvh, mb,
        D, G, G_PAD, BLOCK_M, KV4, HAS_SMOOTH, DT)
    kb_a, kb_b, kshift, kb_steps, tab_c, tab_s = qsum, qsum, shift, qsum, qsum, qsum
    if HAS_KB:  # (dummies above: unread without HAS_KB)
        kb_a, kb_b, kshift, kb_steps = _kbias_query(
            q_ptr, tok, head, rmask, stride_qt, stride_qh, kb_ptr + kvh * D,
            pairs_ptr + kvh * NP, steps_ptr, D, NP)
        tab_c, tab_s = _kbias_tables(kb_steps, KB_V)

    ctx = seq_len - qlen  # tokens cached before this step
    kv_end = tl.minimum(seq_len, ctx + mb * BLOCK_M + BLOCK_M)
    old_end = kv_end  # positions below it come from the cache
    if CHUNK_MODE != CHUNK_CACHE and not DECODE:
        old_end = ctx
    win = seq_len
    if HAS_RES:
        win = tl.maximum(seq_len - res_tokens, 0)
    page_end = tl.minimum(old_end, win)
    t0 = 0
    t1 = tl.cdiv(page_end, BLOCK_N)
    if DECODE:  # the split's run of the tiles _decode_tiles cut above (page_end == win)
        t0 = x * per_split
        t1 = tl.minimum(t0 + per_split, n_tiles)
        if x == NUM_SPLITS:  # TAIL_PROGRAM's tail program: no pages
            t1 = t0

    HALF: tl.constexpr = D // 2 if KV4 else D
    M: tl.constexpr = BLOCK_M * G_PAD
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc_a = tl.zeros([M, HALF], tl.float32)
    acc_b = tl.zeros([M, HALF], tl.float32)
    acc_z = tl.zeros([M], tl.float32)
    if CHUNK_MODE == CHUNK_MERGE and not DECODE:
        m_i, l_i, acc_a, acc_b = _chunk_state(out_ptr + tok * stride_ot + head * stride_oh,
                                              lse_ptr + head * stride_lse_h + tok, rmask,
                                              D, KV4)
    bt_row = bt_ptr + row.to(tl.int64) * stride_bt
    m_i, l_i, acc_a, acc_b, acc_z = _attend_pages(
        qa16, qb16, qsum, shift, qpos, m_i, l_i, acc_a, acc_b, acc_z, t0, t1, page_end,
        bt_row, kvh, codes_ptr, meta_ptr, stride_cb, stride_ch, qk_scale,
        kb_a, kb_b, kshift, tab_c, tab_s, kb_steps,
        B, D, BLOCK_N, KV4, FAST_UNPACK, HAS_KB, KB_V, not DECODE)
    if HAS_RES and (TAIL != TAIL_FINISH or not DECODE):
        tail_here = x == writers - 1  # prefill: every query block (writers = x + 1)
        if DECODE and TAIL == TAIL_PROGRAM:
            tail_here = x == NUM_SPLITS
        if win < old_end and tail_here:
            m_i, l_i, acc_a, acc_b, acc_z = _attend_tail(
                qa, qb, qa16, qb16, qsum, shift, qpos, m_i, l_i, acc_a, acc_b, acc_z,
                win, old_end, bt_row, kvh, codes_ptr, meta_ptr, stride_cb, stride_ch,
                res_k_ptr, res_v_ptr, stride_rt, stride_rh, sob_ptr, tags_ptr, qk_scale,
                kb_a, kb_b, kshift, kb_steps, B, D, BLOCK_R, KV4, DT, HAS_KB)
    if CHUNK_MODE == CHUNK_TRITON and not DECODE:
        m_i, l_i, acc_a, acc_b, acc_z = _attend_chunk(
            qa, qb, qpos, m_i, l_i, acc_a, acc_b, acc_z, tl.load(qsl_ptr + row), ctx, kv_end,
            kvh, key_ptr, val_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
            smooth_ptr + kvh * D, qk_scale, D, BLOCK_N, KV4, HAS_SMOOTH, DT)

    if DECODE and (NUM_SPLITS > 1 or (HAS_RES and TAIL != TAIL_LAST_SPLIT)):  # finish kernel's
        SLOTS: tl.constexpr = NUM_SPLITS + 1 if TAIL == TAIL_PROGRAM else NUM_SPLITS
        pidx = ((row * SLOTS + x) * num_q_heads + head).to(tl.int64)
        has = l_i > 0.0
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + pidx, lse, mask=rmask)
        _store_rows(part_o_ptr + pidx * D, acc_a, acc_b, acc_z, l_i, rmask, D, KV4)
        if MERGE_FUSED:
            # Every thread's stores come before the count (bar.sync, then one thread's
            # acq_rel atomic: release for this partial, acquire of the others' for the last).
            tl.debug_barrier()
            cnt = merge_cnt_ptr + row * tl.num_programs(1) + kvh
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            last = writers - 1
            if TAIL == TAIL_PROGRAM:  # its slot NUM_SPLITS is one more writer
                last = writers
            if arrived == last:
                tl.store(cnt, 0)  # ready for the next launch (stream order)
                gr = tl.arange(0, G_ROWS)
                mrow = gr < G
                mhead = kvh * G + gr
                zero = tl.zeros([G_ROWS], tl.float32)
                m_a = tl.zeros([G_ROWS, HALF], tl.float32)
                m_a, m_b, m_l = _merge_splits(part_o_ptr, part_lse_ptr, row, mhead, mrow, writers,
                                              zero - float("inf"), zero, m_a, m_a, num_q_heads,
                                              D, KV4, NUM_SPLITS, SLOTS)
                dst = out_ptr + tl.load(qsl_ptr + row).to(tl.int64) * stride_ot + mhead * stride_oh
                _store_rows(dst, m_a, m_b, zero, m_l, mrow, D, KV4)
    else:
        _store_rows(out_ptr + tok * stride_ot + head * stride_oh, acc_a, acc_b, acc_z, l_i,
                    rmask, D, KV4)


@triton.jit
def _decode_finish_kernel(
        q_ptr, stride_qt, stride_qh, out_ptr, stride_ot, stride_oh, part_o_ptr, part_lse_ptr,
        merge_cnt_ptr,
        codes_ptr, meta_ptr, stride_cb, stride_ch,
        bt_ptr, stride_bt, seq_lens_ptr, qsl_ptr,
        smooth_ptr, kb_ptr, steps_ptr, pairs_ptr,
        res_k_ptr, res_v_ptr, stride_rt, stride_rh, sob_ptr, tags_ptr, res_tokens,
        key_ptr, val_ptr, stride_kt, stride_kh, stride_vt, stride_vh, lse_ptr, stride_lse_h,
        num_q_heads, qk_scale,
        B: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr,
        KV4: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_KB: tl.constexpr, NP: tl.constexpr,
        KB_V: tl.constexpr, HAS_RES: tl.constexpr, DT: tl.constexpr,
        TAIL: tl.constexpr, G_ROWS: tl.constexpr, PDL: tl.constexpr = False,
        MIN_TILES: tl.constexpr = 1):
    """Decode epilogue, grid (rows, kv_heads): attend the residual tail (TAIL_FINISH; else a
    program of the page kernel did), then merge it with the partials of the splits that wrote one
    (log-sum-exp) and write the output. The merge is unrolled over NUM_SPLITS with masked
    [G_PAD, D/2] loads that do not depend on each other, so they are all in flight at once
    and no cross-warp reduction (shared memory) is needed. A loop of [SC, 16, D/2] loads
    reduced over the splits took 11.6 us a layer at batch 1 to merge 16 splits (H100 step
    profile, 2026-11-25), and racecheck flagged its reductions (docs/RELIABILITY.md).
    The merge runs over G_ROWS = the group rounded up to a power of two, not tl.dot's 16
    (G_PAD, which only the tail here uses). PDL (a programmatic dependent launch after the page kernel): the tail is
    attended while the splits still run; every program waits for them before it reads a
    partial or exits, so the kernels after this one also come after the splits."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    q_start = tl.load(qsl_ptr + row)
    if tl.load(qsl_ptr + row + 1) - q_start != 1:
        if PDL:
            gdc_wait()
        return
    HALF: tl.constexpr = D // 2 if KV4 else D
    # the tail's tl.dot needs G_PAD rows; the merge runs over G_ROWS
    ROWS: tl.constexpr = G_ROWS if TAIL != TAIL_FINISH or not HAS_RES else G_PAD
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc_a = tl.zeros([ROWS, HALF], tl.float32)
    acc_b = tl.zeros([ROWS, HALF], tl.float32)
    acc_z = tl.zeros([ROWS], tl.float32)
    g = tl.arange(0, G_ROWS)
    rmask = g < G
    head = kvh * G + g
    tok = q_start.to(tl.int64)
    if TAIL != TAIL_FINISH or not HAS_RES:  # merge only: no query needed
        seq_len = tl.load(seq_lens_ptr + row)
    else:
        qa, qb, qa16, qb16, qsum, shift, q_tok, q_head, q_rmask, qpos, qlen, seq_len = _query_tile(
            q_ptr, stride_qt, stride_qh, smooth_ptr, qsl_ptr, seq_lens_ptr, row, kvh, 0,
            D, G, G_PAD, 1, KV4, HAS_SMOOTH, DT)
        win = tl.maximum(seq_len - res_tokens, 0)
        if win < seq_len:
            kb_a, kb_b, kshift, kb_steps = qsum, qsum, shift, qsum  # unread without HAS_KB
            if HAS_KB:
                kb_a, kb_b, kshift, kb_steps = _kbias_query(
                    q_ptr, q_tok, q_head, q_rmask, stride_qt, stride_qh, kb_ptr + kvh * D,
                    pairs_ptr + kvh * NP, steps_ptr, D, NP)
            m_i, l_i, acc_a, acc_b, acc_z = _attend_tail(
                qa, qb, qa16, qb16, qsum, shift, qpos, m_i, l_i, acc_a, acc_b, acc_z,
                win, seq_len, bt_ptr + row.to(tl.int64) * stride_bt, kvh, codes_ptr, meta_ptr,
                stride_cb, stride_ch, res_k_ptr, res_v_ptr, stride_rt, stride_rh, sob_ptr,
                tags_ptr, qk_scale, kb_a, kb_b, kshift, kb_steps, B, D, BLOCK_R, KV4, DT,
                HAS_KB)
        # tl.dot's 16 rows down to the group's G_ROWS: the merge below is unrolled over the
        # splits, and its registers and loads grow with the rows (at G = 4, 4x fewer)
        m_i = _first_entries(m_i, G_ROWS)
        l_i = _first_entries(l_i, G_ROWS)
        acc_z = _first_entries(acc_z, G_ROWS)
        acc_a = _first_rows(acc_a, G_ROWS)
        acc_b = _first_rows(acc_b, G_ROWS)
    # Fold the V zero column in now: split partials are complete (normalised) outputs.
    acc_a = acc_a + acc_z[:, None]
    acc_b = acc_b + acc_z[:, None]
    n_tiles, per_split, writers = _decode_tiles(seq_len, res_tokens, BLOCK_N, NUM_SPLITS,
                                                HAS_RES, TAIL, MIN_TILES)
    if PDL:
        gdc_wait()
    SLOTS: tl.constexpr = NUM_SPLITS + 1 if TAIL == TAIL_PROGRAM else NUM_SPLITS
    acc_a, acc_b, l_i = _merge_splits(part_o_ptr, part_lse_ptr, row, head, rmask, writers, m_i,
                                      l_i, acc_a, acc_b, num_q_heads, D, KV4, NUM_SPLITS, SLOTS)
    _store_rows(out_ptr + tok * stride_ot + head * stride_oh, acc_a, acc_b, acc_z * 0.0, l_i,
                rmask, D, KV4)


# --- launch configuration ------------------------------------------------------------------

def decode_config(head_dim: int, scheme: str = "kv4", num_rows: int = 0,
                  num_kv_heads: int = 1, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel; a function of the batch, not of
    the lengths, so that a captured CUDA graph stays valid.

    KV4, D <= 128, at least one (row, kv head) per SM: (128, 2, 2), from `bench_attention.py
    --tune` on the H100 (2026-11-23): 64 x 8K 0.360 ms against 0.521 ms for (64, 4, 3).
    Fewer rows keep (64, 4, 3): 1 x 1K 23.7 us against 26.9 us (1 x 32K: equal). KV8 and
    D = 256 keep the untuned defaults."""
    cfg = envs.integers("MIXPREC_ATTN_DECODE_CFG", 3)  # tuning runs: "BLOCK_N,warps,stages"
    if cfg:
        return cfg
    if head_dim > 128:
        return 32, 4, 3
    if scheme == "kv4" and num_rows * num_kv_heads >= num_sms:
        return 128, 2, 2
    return 64, 4, 3


def _forced_tail() -> str:
    """The tail placement the environment forces (decode_tail_mode), or "" for the default:
    MIXPREC_ATTN_TAIL, or the older MIXPREC_ATTN_TAIL_IN_SPLIT=0/1 (finish/split)."""
    v = envs.get("MIXPREC_ATTN_TAIL") or ""
    old = envs.get("MIXPREC_ATTN_TAIL_IN_SPLIT") or ""
    if v and v not in TAIL_MODES:
        raise ValueError(f"MIXPREC_ATTN_TAIL={v!r}: expected one of {sorted(TAIL_MODES)}")
    if old and old not in ("0", "1"):
        raise ValueError(f"MIXPREC_ATTN_TAIL_IN_SPLIT={old!r}: expected 0 or 1")
    if v and old:
        raise ValueError("MIXPREC_ATTN_TAIL and MIXPREC_ATTN_TAIL_IN_SPLIT are both set: "
                         "unset MIXPREC_ATTN_TAIL_IN_SPLIT (MIXPREC_ATTN_TAIL=split is its 1)")
    if old:
        return "split" if old == "1" else "finish"
    return v


def decode_merge_mode(num_rows: int = 1, scheme: str = "kv4", head_dim: int = 128,
                      num_kv_heads: int = 1, num_sms: int = 132) -> str:
    """Who merges a decode row's split partials: "kernel", the finish kernel launched after
    the page kernel, or "fused", the last page-kernel program of the (row, kv head) to store
    its partial (an atomic count per pair, reset by that program): one launch fewer, no
    finish kernel, and the residual tail in a program of its own (decode_tail_mode).
    Default (unless the tail is forced into the finish kernel): "fused" for a batch of one
    row, and for KV4 (D <= 128) batches of fewer (row, kv head) pairs than SMs, which then
    also cap the page kernel's registers (decode_maxnreg); "kernel" otherwise.
    H100, kv4 + 16-token residual, D = 128, 8 kv heads, us. 2026-11-26 (session 16), finish
    kernel / fused, tail in the last split / fused, tail program: 1 x 1K 18.8 / 17.0 / 15.4
    (FA3 14.8), 1 x 8K 29.7 / 26.3 / 23.5 (FA3 28.7); 8 x 1K 33.2 / 38.3 / 37.5, 8 x 8K
    93.2 / 108.5 / 108.3; 64 x 1K 78.6 / 76.4 / 78.7, 64 x 8K 383 / 380 / 383. Session 17,
    finish kernel / fused + tail program / the same capped at 168 registers: 2 x 1K
    21.9 / 18.8 / 17.5, 4 x 1K 26.8 / 24.9 / 24.1, 8 x 1K 33.1 / 37.4 / 30.5, 2 x 8K
    42.0 / 37.4 / 38.2, 4 x 8K 59.9 / 66.1 / 58.0, 8 x 8K 92.4 / 107.3 / 89.8; 1 x 1K
    15.3 / 15.4 / 16.3; 64 x 8K 374.9 / 381.8 / 530 (the cap halves the big tile's warps'
    registers into spills there). MIXPREC_ATTN_MERGE=kernel|fused forces one. A function of
    the batch and the environment only, so captured CUDA graphs stay valid."""
    v = envs.get("MIXPREC_ATTN_MERGE") or ""
    if v not in ("", "kernel", "fused"):
        raise ValueError(f"MIXPREC_ATTN_MERGE={v!r}: expected 'kernel' or 'fused'")
    if v:
        return v
    if _forced_tail() == "finish":
        return "kernel"
    if num_rows == 1 or _fused_rows(num_rows, scheme, head_dim, num_kv_heads, num_sms):
        return "fused"
    return "kernel"


def _fused_rows(num_rows: int, scheme: str, head_dim: int, num_kv_heads: int, num_sms: int) -> bool:
    """A multi-row batch that merges in the page kernel under the register cap by default:
    KV4, D <= 128, fewer (row, kv head) pairs than SMs (the split (64, 4, 3) tile of
    decode_config), the case timed in session 17."""
    return (num_rows > 1 and scheme == "kv4" and head_dim <= 128
            and num_rows * num_kv_heads < num_sms)


def decode_merge_counters(num_rows: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """The zeroed int32 counts MERGE_FUSED needs, one per (row, kv head); each launch leaves
    them zero again, so one buffer serves every launch of a stream (the metadata builder keeps
    one per layer group, sized for max_num_seqs)."""
    return torch.zeros(max(1, num_rows * num_kv_heads), dtype=torch.int32, device=device)


def decode_tail_mode(num_rows: int, merge: str = "kernel") -> str:
    """Who attends a decode row's residual tail (TAIL_MODES). With the finish kernel's merge
    (merge "kernel"): "split", the row's last writing split, for single-row batches;
    "finish", the finish kernel after every split, otherwise. With the merge in the page
    kernel (merge "fused", decode_merge_mode: the batch-1 default) there is no finish kernel:
    "program" unless "split" is asked for; "finish" is refused.
    H100, 2026-11-25, kv4 + 16-token residual, D = 128, 8 kv heads, split against finish:
    batch 1 25.9/26.6 us (1K), 43.2/46.3 (8K), 73.8/77.3 (32K); batch 8 44.9/42.0,
    114.7/102.0, 333.8/288.7 (the last split's longer run, and its 208 registers, cost more
    than the finish kernel's tail). Both put the tail on the critical path: at batch 8 x 1K it
    costs 11.5 us a layer (session 13). "program" launches it as one more split (dispatched
    first), concurrent with the page splits: exact, but mixed on the H100 (2026-11-26) against
    the default: 17.4/19.7 us (b1 1K), 26.2/30.0 (b1 8K), 36.1/39.6 (b8 1K), 108.7/99.1 (b8 8K),
    79.7/79.9 (b64 1K), 384.4/375.4 (b64 8K); served TPOT 3.66/3.65 ms (C=1), 4.28/4.22 (C=8).
    So not a default with the kernel merge. Since the finish kernel merges over the group's rows (G_ROWS), batch 8
    with the tail there takes 33.2 us at 1K and 91.5 at 8K, against 36.3 and 108.4 for
    "program" (H100, 2026-11-26).
    MIXPREC_ATTN_TAIL=finish|split|program forces one (MIXPREC_ATTN_TAIL_IN_SPLIT=0/1, the
    older knob, means finish/split)."""
    v = _forced_tail()
    if merge == "fused":
        if v == "finish":
            raise ValueError("MIXPREC_ATTN_MERGE=fused has no finish kernel to attend the "
                             "residual tail in: unset MIXPREC_ATTN_TAIL (or "
                             "MIXPREC_ATTN_TAIL_IN_SPLIT), or set it to split or program")
        return v or "program"
    return v or ("split" if num_rows == 1 else "finish")


def decode_min_tiles() -> int:
    """Page tiles a decode split attends at least (MIXPREC_ATTN_MIN_TILES, default 1): a row
    of few tiles then fills fewer splits, leaving the finish kernel fewer partials to merge.
    Not worth a default on the H100 (2026-11-26, kv4 + 16-token residual, 1 / 2 / 4 tiles):
    batch 1 x 1K 18.9 / 20.4 / 24.2 us, 8 x 1K 33.2 / 31.4 / 30.1, 8 x 2K 41.5 / 41.5 / 41.6,
    8 x 8K 91.4 / 92.9 / 92.9.
    A function of nothing but the environment, so captured CUDA graphs stay valid for any
    length (the split count stays a function of the batch)."""
    return envs.integer("MIXPREC_ATTN_MIN_TILES", 1, 64)


CUDA_TILE_TOKENS = 128  # the CUDA page kernel's split granularity (the finish kernel's BLOCK_N)
CUDA_MIN_PAIRS = 32  # (row, kv head) pairs from which decode_impl picks the CUDA page kernel
CUDA_PREFETCH_PAGES = int(envs.BY_NAME["MIXPREC_ATTN_CUDA_PREFETCH"].default)  # cuda_decode_prefetch's default


def cuda_decode_unsupported(layout: F.KVPageLayout, group: int, device: torch.device,
                            has_k_bias: bool, index_dtype: torch.dtype = torch.int32) -> str:
    """Why the CUDA KV4 page kernel (kernels.cuda.decode_kv4_pages) cannot run this decode, or
    "" when it can: KV4, head_dim 128, 16-token pages, <= 8 query heads per kv head, no
    bias-aware K, int32 block tables, an sm_80+ GPU, and a build that holds the kernel."""
    if layout.scheme != "kv4" or layout.head_dim != 128 or layout.block_size != 16:
        return (f"it handles kv4 with head_dim 128 and 16-token pages, not {layout.scheme} "
                f"with head_dim {layout.head_dim} and {layout.block_size}-token pages")
    if group > 8:
        return f"it handles at most 8 query heads per kv head, not {group}"
    if has_k_bias:
        return "it does not add the bias-aware K term (formats.KRopeBias)"
    if index_dtype != torch.int32:
        return f"it reads int32 block tables and lengths, not {index_dtype}"
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "it needs a CUDA device (not the Triton interpreter)"
    if not cuda_ops.has_decode_kv4():
        return f"the csrc/ build lacks it ({cuda_ops.load_error() or 'built before the kernel'})"
    if capability_major(device) < 8:  # (decode_impl runs per layer and step: cached)
        return "it needs sm_80 or newer (mma.sync m16n8k16, movmatrix)"
    return ""


def decode_impl(num_rows: int, layout: F.KVPageLayout, group: int, device: torch.device,
                has_k_bias: bool = False, num_kv_heads: int = 1, num_sms: int = 132,
                index_dtype: torch.dtype = torch.int32) -> str:
    """Which page kernel a decode batch runs: "cuda" (csrc/attention/sm80/decode_kv4_mma.cu,
    its residual tail and split merge in the Triton finish kernel) or "triton" (this file).
    Default: "cuda" where it runs (cuda_decode_unsupported) for batches of at least
    CUDA_MIN_PAIRS (row, kv head) pairs; smaller ones keep the Triton kernel, whose fused merge
    and tail program need no finish kernel. H100, GQA 32/8, D 128, µs a layer, Triton / CUDA
    (2026-11-27, docs/BENCHMARKS.md "Session 25"), kv4 + 16-token residual: batch 1 15.7 / 24.4
    (1K), 23.4 / 28.7 (8K), 55.1 / 42.0 (32K); batch 2 17.5 / 25.3, 38.2 / 32.6, 100.6 / 57.9;
    batch 4 24.4 / 26.0, 57.6 / 41.0, 158.6 / 87.7; batch 8 30.8 / 28.3, 89.4 / 56.1,
    288.8 / 142.0; batch 64 78.5 / 60.8, 385.8 / 246.0, 1434.9 / 829.8.
    MIXPREC_ATTN_DECODE_IMPL=cuda|triton forces one ("cuda" where it cannot run is an
    error, as is "cuda" with a forced fused merge or a tail outside the finish kernel). A
    function of the batch and the environment only, so captured CUDA graphs stay valid."""
    v = envs.get("MIXPREC_ATTN_DECODE_IMPL") or ""
    if v not in ("", "cuda", "triton"):
        raise ValueError(f"MIXPREC_ATTN_DECODE_IMPL={v!r}: expected 'cuda' or 'triton'")
    if v == "triton":
        return v
    why = cuda_decode_unsupported(layout, group, device, has_k_bias, index_dtype)
    keeps = {"MIXPREC_ATTN_MERGE": "kernel", "MIXPREC_ATTN_TAIL": "finish", "MIXPREC_ATTN_TAIL_IN_SPLIT": "0"}
    values = {k: envs.get(k) for k in keeps}  # each read once
    forced = [f"{k}={x}" for k, x in values.items() if x not in (None, keeps[k])]
    if v == "cuda":
        if why:
            raise ValueError(f"MIXPREC_ATTN_DECODE_IMPL=cuda, but the CUDA decode kernel cannot "
                             f"run here: {why}")
        if forced:
            raise ValueError(f"MIXPREC_ATTN_DECODE_IMPL=cuda merges in the finish kernel and "
                             f"attends the residual tail there; unset {', '.join(forced)}")
        return v
    if why or forced or num_rows * num_kv_heads < CUDA_MIN_PAIRS:
        return "triton"
    return "cuda"


CUDA_CTAS_PER_SM = 4  # the CUDA page kernel's residency (128 threads, 128 registers)


def cuda_decode_splits(num_rows: int, num_kv_heads: int, num_sms: int, num_splits: int) -> int:
    """The CUDA page kernel's split count: num_splits (decode_num_splits: ~4 programs an SM),
    cut so that the grid fits one wave of CUDA_CTAS_PER_SM CTAs an SM. Its CTAs are long-lived
    and even (4 warps walk a split's pages side by side), so a second, partial wave is pure
    tail. MIXPREC_ATTN_CUDA_WAVE=0 keeps num_splits. H100, kv4, batch 8 / 64 x 8K, 8 / 64 x
    32K, µs (2026-11-27, no prefetch): 46.1 / 235.0 / 130.9 / 836.8 capped, 55.9 / 246.9 /
    140.4 / 849.5 with num_splits. A function of the batch only."""
    if not envs.flag("MIXPREC_ATTN_CUDA_WAVE"):
        return num_splits
    return max(1, min(num_splits, CUDA_CTAS_PER_SM * num_sms // max(1, num_rows * num_kv_heads)))


def cuda_decode_prefetch() -> int:
    """Pages ahead that each warp of the CUDA page kernel asks into L2
    (MIXPREC_ATTN_CUDA_PREFETCH, 0: none). H100, kv4, µs at batch 8 / 64 x 8K and 8 / 64 x 32K
    (2026-11-27, benchmarks/results/2026-11-27-s25/h100-tune): 0 pages 46.1 / 235.0 / 130.9 /
    836.8, 4 pages 50.4 / 230.4 / 135.2 / 816.9, 8 pages 55.4 / 263.3 / 150.7 / 951.5."""
    return envs.integer("MIXPREC_ATTN_CUDA_PREFETCH", 0, 31)


class _CudaPageLaunch:
    """The CUDA page kernel as an entry of _decode_launches' list: kernel[grid](*args, **kw)
    runs it (the Triton arguments are ignored); nothing to precompile."""

    def __init__(self, **op_args):
        self.op_args = op_args

    def __getitem__(self, grid):
        return lambda *args, **kwargs: cuda_ops.decode_kv4_pages(**self.op_args)


FUSED_ROWS_MAXNREG = 168  # the page kernel's cap with the fused merge of a multi-row batch


def decode_maxnreg(num_rows: int = 0, merge: str = "kernel", scheme: str = "kv4",
                   head_dim: int = 128, num_kv_heads: int = 1, num_sms: int = 132) -> dict:
    """Launch option capping the decode kernel's registers per thread. Default: 168 for the
    fused merge of a multi-row batch (decode_merge_mode; ptxas, sm_90a, kv4 + tail program:
    180 registers uncapped = 2 CTAs of 4 warps an SM, 165 capped without spills = 3 CTAs),
    the compiler's choice otherwise.
    MIXPREC_ATTN_DECODE_MAXNREG overrides it for every launch (0: the compiler's choice).
    The (128, 2, 2) config uses 255, which holds an SM to 4 CTAs = 8 warps (ncu, 64 x 8K,
    2026-11-23: 12.5 % occupancy, 38 % DRAM throughput): `bench_attention.py --tune` weighs a
    cap (more warps in flight) against the spills it costs."""
    v = envs.get("MIXPREC_ATTN_DECODE_MAXNREG")
    if v:
        if not v.isdigit() or not (v == "0" or 24 <= int(v) <= 255):
            raise ValueError(f"MIXPREC_ATTN_DECODE_MAXNREG={v!r}: expected 0 (compiler's "
                             "choice) or a register count in [24, 255]")
        cap = int(v)
    elif merge == "fused" and _fused_rows(num_rows, scheme, head_dim, num_kv_heads, num_sms):
        cap = FUSED_ROWS_MAXNREG
    else:
        cap = 0
    return {} if not cap or os.environ.get("TRITON_INTERPRET") == "1" else {"maxnreg": cap}


def prefill_config(head_dim: int, group: int) -> tuple[int, int, int, int]:
    """(BLOCK_M query tokens, BLOCK_N, num_warps, num_stages) of the prefill kernel."""
    cfg = envs.integers("MIXPREC_ATTN_PREFILL_CFG", 4)  # tuning runs
    if cfg:
        return cfg
    rows = 64 if head_dim <= 128 else 32  # BLOCK_M * G_PAD
    return max(1, rows // triton.next_power_of_2(group)), 64 if head_dim <= 128 else 32, 4, 2


def decode_pdl(device: torch.device) -> bool:
    """Whether the finish kernel is a programmatic dependent launch after the page kernel
    (Hopper and later): it can start, and attend the residual tail, while the splits still
    run. MIXPREC_ATTN_PDL=1 turns it on. Off by default: exact on the H100, but timed there it
    saved 0.5-2.8 us at batch 1 and 8 x 8K and cost 5.2 us at batch 8 x 1K (BENCHMARKS, session 13).
    With the merge over G_ROWS (2026-11-26) it saved 0.5-6.9 us at all of batch 1/8 x 1K/2K/8K,
    but served TPOT did not move beyond the host-to-host spread; batch 64 not yet timed."""
    return (envs.flag("MIXPREC_ATTN_PDL") and device.type == "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"
            and capability_major(device) >= 9)


def fast_unpack(device: torch.device) -> bool:
    """PTX code unpacking (GPU only); MIXPREC_ATTN_FAST_UNPACK=0 selects the plain
    conversions (same values, slower) should the inline assembly ever misbehave."""
    return (envs.flag("MIXPREC_ATTN_FAST_UNPACK") and device.type == "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_rows: int, num_kv_heads: int, num_sms: int | None = None,
                      max_splits: int = 32) -> int:
    """Splits per (row, kv head) so that ~4 programs per SM exist; a function of the batch
    only, so that a CUDA graph captured for a batch size stays valid for any length."""
    if num_sms is None:
        num_sms = _num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else 8
    want = -(-4 * num_sms // max(1, num_rows * num_kv_heads))
    return max(1, min(max_splits, triton.next_power_of_2(want)))


def decode_partials_rows(max_rows: int, num_kv_heads: int, num_sms: int | None = None) -> int:
    """Rows (row * slot) of the partial-output buffer that any batch <= max_rows needs: a slot
    per split and one for a tail program (decode_tail_mode; with the residual window even
    one split writes a partial)."""
    return max((n * (decode_num_splits(n, num_kv_heads, num_sms) + 1)
                for n in range(1, max_rows + 1)), default=0)


# --- Python entry points -------------------------------------------------------------------

def kbias_chunk(block_n: int) -> int:
    """KB_V, the columns per chunk of the bias term's tables ([pairs, KB_V] cos and sin kept
    for the whole program): the whole tile up to 64 columns, else chunks of 64.
    MIXPREC_ATTN_KBIAS_CHUNK overrides it (tuning runs; a power of two >= 16)."""
    v = envs.integer("MIXPREC_ATTN_KBIAS_CHUNK", 16)
    if v & (v - 1):
        raise ValueError(f"MIXPREC_ATTN_KBIAS_CHUNK={v}: expected a power of two >= 16")
    return min(block_n, v)


def _num_pairs(k_bias: F.KRopeBias | None) -> int:
    return F.MIN_BIAS_PAIRS if k_bias is None else int(k_bias.pairs.shape[-1])


def _common_args(q, cache, layout, residual, k_smooth, k_bias):
    codes, meta = cache_views(cache, layout)
    if q.dtype not in _TL_DTYPE:
        raise ValueError(f"query dtype {q.dtype} is not float16/bfloat16")
    if q.shape[-1] != layout.head_dim or q.stride(-1) != 1:
        raise ValueError(f"query must be [T, Hq, {layout.head_dim}] with unit stride on D")
    smooth = q if k_smooth is None else k_smooth.to(torch.float32).contiguous()
    kb = kbias_args(k_bias, cache.shape[1], layout.head_dim, q)
    if residual is None:
        res = (q, q, 0, 0, q, q, 0)
    else:
        res = (residual.k, residual.v, residual.k.stride(0), residual.k.stride(1),
               residual.slot_of_block, residual.tags, int(residual.tokens))
    has_res = residual is not None and residual.tokens > 0
    block_r = max(16, triton.next_power_of_2(residual.tokens)) if has_res else 16
    return (codes, meta, cache.stride(0), cache.stride(1)), (smooth, *kb), res, has_res, block_r


def _chunk_args(q: torch.Tensor, chunk_kv, num_kv_heads: int,
                chunk_lse: torch.Tensor | None = None) -> tuple:
    """(key, value, their token and head strides, lse, its head stride) for the CHUNK_MODEs
    (kernel docstring); q as an unread dummy."""
    if chunk_lse is not None:
        if chunk_kv is not None:
            raise ValueError("give chunk_kv (the kernel attends the chunk) or chunk_lse (out "
                             "holds FlashAttention's chunk attention), not both")
        if (chunk_lse.dim() != 2 or chunk_lse.shape[0] != q.shape[1]
                or chunk_lse.shape[1] < q.shape[0] or chunk_lse.stride(1) != 1
                or chunk_lse.dtype != torch.float32):
            raise ValueError(f"chunk_lse must be [{q.shape[1]}, >= {q.shape[0]}] float32 with "
                             f"unit token stride, got {tuple(chunk_lse.shape)} {chunk_lse.dtype}")
        return q, q, 0, 0, 0, 0, chunk_lse, chunk_lse.stride(0)
    if chunk_kv is None:
        return q, q, 0, 0, 0, 0, q, 0
    key, value = chunk_kv
    for name, t in (("key", key), ("value", value)):
        if (t.dim() != 3 or t.shape[0] < q.shape[0] or tuple(t.shape[1:]) != (num_kv_heads, q.shape[2])
                or t.stride(-1) != 1 or t.dtype != q.dtype):
            raise ValueError(f"chunk_kv {name} must be [>= {q.shape[0]}, {num_kv_heads}, "
                             f"{q.shape[2]}] {q.dtype} with unit stride on D, got "
                             f"{tuple(t.shape)} {t.dtype}")
    return key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1), q, 0


def decode_attention(q: torch.Tensor, cache: torch.Tensor, layout: F.KVPageLayout,
                     block_table: torch.Tensor, seq_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, out: torch.Tensor, sm_scale: float,
                     num_rows: int, num_splits: int = 1, part_o: torch.Tensor | None = None,
                     part_lse: torch.Tensor | None = None, residual: KVResidual | None = None,
                     k_smooth: torch.Tensor | None = None,
                     k_bias: F.KRopeBias | None = None,
                     merge_counters: torch.Tensor | None = None) -> None:
    """Attention of the rows of query length 1 (others are left untouched) into `out`.

    part_o [>= num_rows*num_splits, Hq, D] fp32 and part_lse [>= ..., Hq] fp32 are needed
    when num_splits > 1 or with a residual: the page kernel then writes per-split partials
    and _decode_finish_kernel adds the residual tail and merges (with the tail as its own
    program, decode_tail_mode "program": num_rows*(num_splits + 1) rows, the tail's partial last). Launch parameters depend
    only on shapes and num_rows (CUDA graphs). With decode_merge_mode "fused" the page kernel
    merges instead, counting in merge_counters (>= num_rows * kv_heads zeroed int32, left zero;
    decode_merge_counters; allocated here when None).
    """
    if num_rows == 0:
        return
    for kernel, grid, args, kwargs in _decode_launches(
            q, cache, layout, block_table, seq_lens, query_start_loc, out, sm_scale, num_rows,
            num_splits, part_o, part_lse, residual, k_smooth, k_bias, merge_counters,
            _device_sms(q)):
        kernel[grid](*args, **kwargs)


def precompile_decode(q: torch.Tensor, cache: torch.Tensor, layout: F.KVPageLayout,
                      block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, out: torch.Tensor, sm_scale: float,
                      max_rows: int, part_o: torch.Tensor, part_lse: torch.Tensor,
                      residual: KVResidual | None = None, k_smooth: torch.Tensor | None = None,
                      k_bias: F.KRopeBias | None = None,
                      merge_counters: torch.Tensor | None = None,
                      num_sms: int | None = None) -> int:
    """Compile, in parallel (precompile.compile_in_parallel), every decode variant that a batch
    of 1..max_rows rows selects, for launches on these tensors (decode_attention's arguments
    of one real step: the ints and alignments Triton specialises on are serving's). Without
    it each variant compiled at its first batch size, one after another, mostly inside
    vLLM's CUDA-graph capture (docs/STARTUP.md). Returns how many compiled."""
    from .precompile import compile_in_parallel
    num_kv_heads = cache.shape[1]
    sms = _device_sms(q) if num_sms is None else num_sms
    cap = part_o.shape[0]
    has_res = residual is not None
    seen, launches, selections = set(), [], set()
    for n in range(1, max_rows + 1):
        splits = decode_splits(n, num_kv_heads, sms, cap)
        # building a batch's launches costs ~100x its selection; every layer runs this loop
        sel = _decode_selection(n, splits, layout, num_kv_heads, sms, has_res,
                                decode_impl(n, layout, q.shape[1] // num_kv_heads, q.device,
                                            k_bias is not None, num_kv_heads, sms,
                                            block_table.dtype))
        if sel in selections:
            continue
        selections.add(sel)
        for kernel, grid, args, kwargs in _decode_launches(
                q, cache, layout, block_table, seq_lens, query_start_loc, out, sm_scale, n,
                splits, part_o, part_lse, residual, k_smooth, k_bias, merge_counters, sms):
            if not hasattr(kernel, "warmup"):  # the CUDA page kernel: compiled already
                continue
            key = (kernel, tuple(sorted(kwargs.items())))  # the grid is not compiled in
            if key not in seen:
                seen.add(key)
                launches.append((kernel, grid, args, kwargs))
    return compile_in_parallel([functools.partial(k.warmup, *a, grid=g, **kw)
                                for k, g, a, kw in launches], "decode-attention")


def _decode_selection(num_rows: int, num_splits: int, layout: F.KVPageLayout, num_kv_heads: int,
                      sms: int, has_res: bool, impl: str = "triton") -> tuple:
    """Every choice _decode_launches makes from the row count: batches with equal selections
    launch the same variants (test_attn_precompile checks it over 1..1024 rows)."""
    shape = dict(scheme=layout.scheme, head_dim=layout.head_dim, num_kv_heads=num_kv_heads,
                 num_sms=sms)
    if impl == "cuda":  # (_decode_launches: the finish kernel's tile, merge and tail)
        return (cuda_decode_splits(num_rows, num_kv_heads, sms, num_splits), impl, has_res)
    merge = decode_merge_mode(num_rows, **shape)
    return (num_splits, decode_config(layout.head_dim, layout.scheme, num_rows, num_kv_heads, sms),
            merge, decode_tail_mode(num_rows, merge) if has_res else None,
            tuple(sorted(decode_maxnreg(num_rows, merge, **shape).items())))


def _device_sms(q: torch.Tensor) -> int:
    """The SM count the decode selectors plan for (8 off the GPU: interpreter tests)."""
    if not q.is_cuda:
        return 8
    return _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())


def decode_splits(num_rows: int, num_kv_heads: int, num_sms: int, partial_rows: int) -> int:
    """decode_num_splits, halved until num_rows*(splits + 1) partials fit partial_rows (the
    metadata builder's buffer; + 1: a tail program's partial)."""
    s = decode_num_splits(num_rows, num_kv_heads, num_sms)
    while s > 1 and num_rows * (s + 1) > partial_rows:
        s //= 2
    return s


def _decode_launches(q, cache, layout, block_table, seq_lens, query_start_loc, out, sm_scale,
                     num_rows, num_splits, part_o, part_lse, residual, k_smooth, k_bias,
                     merge_counters, sms: int) -> list[tuple]:
    """decode_attention's launches as (kernel, grid, args, kwargs): one list for the launch
    and for precompile_decode, so that the variants warmed are the ones launched."""
    num_q_heads, num_kv_heads = q.shape[1], cache.shape[1]
    group = num_q_heads // num_kv_heads
    cache_args, opt, res, has_res, block_r = _common_args(q, cache, layout, residual, k_smooth,
                                                          k_bias)
    block_n, warps, stages = decode_config(layout.head_dim, layout.scheme, num_rows, num_kv_heads, sms)
    shape = dict(scheme=layout.scheme, head_dim=layout.head_dim, num_kv_heads=num_kv_heads,
                 num_sms=sms)
    impl = decode_impl(num_rows, layout, group, q.device, k_bias is not None, num_kv_heads, sms,
                       block_table.dtype)
    if impl == "cuda":  # its partials are merged, and its tail attended, by the finish kernel
        block_n, merge, tail = CUDA_TILE_TOKENS, "kernel", TAIL_FINISH.value
        num_splits = cuda_decode_splits(num_rows, num_kv_heads, sms, num_splits)
    else:
        merge = decode_merge_mode(num_rows, **shape)
        tail = TAIL_MODES[decode_tail_mode(num_rows, merge)] if has_res else TAIL_FINISH.value
    slots = num_splits + (tail == TAIL_PROGRAM.value)  # the tail program writes one more partial
    partials = num_splits > 1 or (has_res and tail != TAIL_LAST_SPLIT.value)
    fused = partials and merge == "fused"
    finish = partials and not fused
    pdl = finish and decode_pdl(q.device)
    if partials and (part_o is None or part_lse is None or part_o.shape[0] < num_rows * slots):
        raise ValueError(f"num_splits > 1 or a residual needs part_o/part_lse with "
                         f"num_rows*(num_splits{' + 1' if slots > num_splits else ''}) = "
                         f"{num_rows * slots} rows")
    if fused and merge_counters is None:
        merge_counters = decode_merge_counters(num_rows, num_kv_heads, q.device)
    if fused and (merge_counters.dtype != torch.int32 or not merge_counters.is_contiguous()
                  or merge_counters.numel() < num_rows * num_kv_heads):
        raise ValueError(f"merge_counters must be >= {num_rows * num_kv_heads} contiguous int32 "
                         f"(rows x kv heads), got {tuple(merge_counters.shape)} "
                         f"{merge_counters.dtype}")
    args = (q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1),
            part_o if partials else q, part_lse if partials else q,
            merge_counters if fused else q,
            *cache_args, block_table, block_table.stride(0), seq_lens, query_start_loc,
            *opt, *res, *_chunk_args(q, None, num_kv_heads), num_q_heads, sm_scale * LOG2E)
    g_rows = triton.next_power_of_2(group)  # the merge's rows (tl.dot's need 16: G_PAD)
    common = dict(B=layout.block_size, D=layout.head_dim, G=group,
                  G_PAD=max(16, triton.next_power_of_2(group)), BLOCK_R=block_r,
                  NUM_SPLITS=num_splits, KV4=layout.scheme == "kv4",
                  HAS_SMOOTH=k_smooth is not None, HAS_KB=k_bias is not None,
                  NP=_num_pairs(k_bias), KB_V=kbias_chunk(block_n), HAS_RES=has_res,
                  DT=_TL_DTYPE[q.dtype], TAIL=tail, MIN_TILES=decode_min_tiles())
    if impl == "cuda":
        page_launch = _CudaPageLaunch(
            q=q, cache=cache, block_table=block_table, seq_lens=seq_lens,
            query_start_loc=query_start_loc, out=out, part_o=part_o if partials else None,
            part_lse=part_lse if partials else None,
            k_smooth=None if k_smooth is None else opt[0], qk_scale=sm_scale * LOG2E,
            num_rows=num_rows, num_splits=num_splits, slots=slots,
            res_tokens=res[-1] if has_res else 0, tile_tokens=block_n,
            min_tiles=decode_min_tiles(), prefetch_pages=cuda_decode_prefetch())
        launches = [(page_launch, (num_rows, num_kv_heads, slots), args, {})]
    else:
        launches = [(_paged_attn_kernel, (num_rows, num_kv_heads, slots), args, dict(
            BLOCK_M=1, BLOCK_N=block_n, DECODE=True, FAST_UNPACK=fast_unpack(q.device),
            CHUNK_MODE=CHUNK_CACHE.value, PDL=pdl, MERGE_FUSED=fused, G_ROWS=g_rows,
            num_warps=warps, num_stages=stages, **decode_maxnreg(num_rows, merge, **shape),
            **common))]
    if finish:
        pdl_launch = {"launch_pdl": True} if pdl else {}
        launches.append((_decode_finish_kernel, (num_rows, num_kv_heads), args, dict(
            BLOCK_N=block_n, PDL=pdl, G_ROWS=g_rows, num_warps=4, **pdl_launch, **common)))
    return launches


def prefill_attention(q: torch.Tensor, cache: torch.Tensor, layout: F.KVPageLayout,
                      block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, out: torch.Tensor, sm_scale: float,
                      num_rows: int, max_query_len: int, residual: KVResidual | None = None,
                      k_smooth: torch.Tensor | None = None,
                      k_bias: F.KRopeBias | None = None,
                      chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                      chunk_lse: torch.Tensor | None = None) -> None:
    """Causal attention of the rows of query length > 1 (others untouched) into `out`.

    Exact prefill: each row attends its own new tokens in 16 bits and only its older tokens
    through the cache, either
      * chunk_kv = (key, value) [T, Hkv, D], the 16-bit K/V of this step's tokens (laid out
        like q), attended by this kernel; or
      * chunk_lse [Hq, >= T] fp32: `out` already holds each row's attention over its own new
        tokens (kernels.chunk_attention: FlashAttention), with this natural log-sum-exp;
        the kernel merges the cached context into it in place.
    Neither: every key comes from the cache."""
    if num_rows == 0 or max_query_len <= 1:
        return
    num_q_heads, num_kv_heads = q.shape[1], cache.shape[1]
    group = num_q_heads // num_kv_heads
    cache_args, opt, res, has_res, block_r = _common_args(q, cache, layout, residual, k_smooth,
                                                          k_bias)
    block_m, block_n, warps, stages = prefill_config(layout.head_dim, group)
    g_pad = triton.next_power_of_2(group)
    block_m = max(block_m, -(-16 // g_pad))  # tl.dot needs >= 16 rows
    _paged_attn_kernel[(num_rows, num_kv_heads, triton.cdiv(max_query_len, block_m))](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), q, q, q,
        *cache_args, block_table, block_table.stride(0), seq_lens, query_start_loc,
        *opt, *res, *_chunk_args(q, chunk_kv, num_kv_heads, chunk_lse), num_q_heads,
        sm_scale * LOG2E,
        B=layout.block_size, D=layout.head_dim, G=group, G_PAD=g_pad, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_R=block_r, NUM_SPLITS=1, DECODE=False,
        KV4=layout.scheme == "kv4", HAS_SMOOTH=k_smooth is not None,
        HAS_KB=k_bias is not None, NP=_num_pairs(k_bias), KB_V=kbias_chunk(block_n),
        HAS_RES=has_res, TAIL=TAIL_FINISH.value,
        DT=_TL_DTYPE[q.dtype], FAST_UNPACK=fast_unpack(q.device),
        CHUNK_MODE=(CHUNK_MERGE if chunk_lse is not None else
                    CHUNK_TRITON if chunk_kv is not None else CHUNK_CACHE).value,
        num_warps=warps, num_stages=stages)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, layout: F.KVPageLayout,
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, sm_scale: float,
                    residual: KVResidual | None = None, k_smooth: torch.Tensor | None = None,
                    num_splits: int | None = None, out: torch.Tensor | None = None,
                    k_bias: F.KRopeBias | None = None,
                    chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    chunk_impl: str = "triton") -> torch.Tensor:
    """Both paths on a ragged batch (tests, benchmarks) in the order the backend runs them:
    the twin of reference.paged_attention_residual. Reads query_start_loc on the host.
    chunk_kv's exact prefill by chunk_impl:
      "triton"  this kernel attends the chunk (CHUNK_TRITON);
      "flash"   kernels.chunk_attention (FlashAttention; the reference on CPU) attends it and
                this kernel merges the cached context in (the reference's chunk_raw);
      "gather"  the context workspace (kernels/triton/context.py) and one FlashAttention
                call over context and chunk (kernels.chunk_attention.context_attention)."""
    from .. import chunk_attention as CA
    from .context import gather_context_kv
    if chunk_impl not in ("flash", "triton", "gather"):
        raise ValueError(f"chunk_impl={chunk_impl!r}: expected 'flash', 'triton' or 'gather'")
    qsl = query_start_loc.cpu()
    qlens = qsl[1:] - qsl[:-1]
    num_rows = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    max_q = int(qlens.max()) if num_rows else 0
    chunk_lse = None
    prefill_done = False
    if chunk_kv is not None and chunk_impl != "triton" and max_q > 1:
        n = int(qsl[-1])  # FlashAttention writes every row's; decode then overwrites its own
        key, value = chunk_kv
        if chunk_impl == "gather":
            cu_k = F.context_seqlens(seq_lens, query_start_loc, num_rows)
            klens = (cu_k[1:] - cu_k[:-1]).cpu()
            max_k = int(klens.max())
            ws_k = torch.empty(int(klens.sum()), *key.shape[1:], dtype=key.dtype,
                               device=key.device)
            ws_v = torch.empty_like(ws_k)
            gather_context_kv(cache, layout, block_table, seq_lens, query_start_loc, cu_k, key,
                              value, ws_k, ws_v, num_rows, max_k, residual, k_smooth, k_bias)
            CA.context_attention(q[:n], ws_k, ws_v, query_start_loc, cu_k, max_q, max_k,
                                 sm_scale, out[:n])
            prefill_done = True
        else:
            chunk_lse = CA.chunk_attention(q[:n], key, value, query_start_loc, max_q, sm_scale,
                                           out[:n])
        chunk_kv = None
    if int((qlens == 1).sum()):
        splits = num_splits or decode_num_splits(num_rows, cache.shape[1])
        part_o = part_lse = None
        if splits > 1 or (residual is not None and residual.tokens > 0):
            slots = num_rows * (splits + 1)  # + 1: a tail program's partial (decode_tail_mode)
            part_o = torch.empty(slots, q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
            part_lse = torch.empty(slots, q.shape[1], dtype=torch.float32, device=q.device)
        decode_attention(q, cache, layout, block_table, seq_lens, query_start_loc, out,
                         sm_scale, num_rows, splits, part_o, part_lse, residual, k_smooth,
                         k_bias)
    if prefill_done:
        return out
    if chunk_lse is not None:
        q, out = q[:chunk_lse.shape[1]], out[:chunk_lse.shape[1]]
    prefill_attention(q, cache, layout, block_table, seq_lens, query_start_loc, out, sm_scale,
                      num_rows, max_q, residual, k_smooth, k_bias, chunk_kv, chunk_lse)
    return out


__all__ = ["decode_attention", "prefill_attention", "paged_attention", "decode_num_splits",
           "decode_splits", "precompile_decode",
           "decode_partials_rows", "decode_config", "prefill_config", "KVResidual"]
