"""The residual slot directory's per-step update as one Triton program.

The torch version (`attention_backend.residual.ResidualDirectory._assign`, the reference) is ~60
small ops: about 185 us of GPU time a step even when replayed from a CUDA graph (H100,
2026-11-25), because every op is a launch of its own. Here the whole update runs in one CTA:
the window blocks are sorted and deduplicated in registers, the least-recently-used order of the
slots is a sort of (last_use + 1) * BLOCK_P + slot keys (stable, as torch's stable sort), and
every table write is a scatter, with a CTA barrier wherever a later phase reads what an earlier
one wrote. Neighbour and gather-by-rank reads go through a small scratch buffer. The results are
table-for-table identical to the reference (tests/attention_backend/test_attn_residual.py).

The directory uses it on CUDA unless MIXPREC_KV_RESIDUAL_KERNEL=0. H100, 2026-11-25: equal to
the reference table for table (`test_kernel_update_matches_reference_gpu`), ~42 us a call
against ~185 us for the reference replayed from a CUDA graph (`bench_attention.py`'s
`residual_assign_*_us`, host wall time per call, back to back). Both ran before the launch
changed to the fixed tiles below; since then only the interpreter test and a served run have
checked it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_PAD_KEY = tl.constexpr(2 ** 62)  # sorts after every real (last_use + 1) * BLOCK_P + slot


# The batch's sizes change every step: specialising on their values (== 1, % 16) compiled new
# variants mid-serving (vLLM's JIT monitor, H100, 2026-11-25: 5 s TTFT at concurrency 8).
@triton.jit(do_not_specialize=["stride_bt", "num_reqs", "width", "num_tokens"])
def _residual_assign_kernel(
        bt_ptr, stride_bt, seq_ptr, qsl_ptr, sm_ptr, num_reqs, width, num_tokens,
        sob_ptr, bos_ptr, last_ptr, tags_ptr, step_ptr, scratch_ptr, num_blocks, num_slots,
        R: tl.constexpr, B: tl.constexpr, BPW: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr):
    step = tl.load(step_ptr) + 1
    tl.store(step_ptr, step)
    o = tl.arange(0, B)

    # 1. window blocks of each row: logical blocks of positions [L - R, L), sorted, deduplicated
    e = tl.arange(0, BLOCK_W)
    live = e < num_reqs * BPW
    row = e // BPW
    seq = tl.load(seq_ptr + row, mask=live, other=0).to(tl.int64)
    qlen = tl.load(qsl_ptr + row + 1, mask=live, other=0) - tl.load(qsl_ptr + row, mask=live, other=0)
    j = tl.maximum(seq - R, 0) // B + e % BPW
    j_last = tl.maximum(seq - 1, 0) // B
    ok = live & (qlen > 0) & (seq > 0) & (j <= j_last)
    col = tl.minimum(tl.maximum(tl.minimum(j, j_last), 0), width - 1)
    blk = tl.load(bt_ptr + row.to(tl.int64) * stride_bt + col, mask=live, other=-1).to(tl.int64)
    blk = tl.sort(tl.where(ok & (blk >= 0) & (blk < num_blocks), blk, -1))
    tl.store(scratch_ptr + e, blk)
    tl.debug_barrier()
    prev = tl.load(scratch_ptr + e - 1, mask=e > 0, other=-2)
    need = (blk != prev) & (blk >= 0)
    blk_safe = tl.where(need, blk, num_blocks)

    # 2. keep owned slots, allocate the rest least-recently-used first
    cur = tl.load(sob_ptr + blk_safe).to(tl.int64)
    has = need & (cur >= 0)
    has = has & (tl.load(bos_ptr + tl.where(has, cur, num_slots)).to(tl.int64) == blk_safe)
    tl.store(last_ptr + tl.where(has, cur, num_slots), step)
    tl.debug_barrier()
    missing = need & ~has
    rank = tl.cumsum(missing.to(tl.int32), 0) - 1
    s = tl.arange(0, BLOCK_P)
    in_p = s < num_slots
    lu = tl.load(last_ptr + s, mask=in_p, other=0)
    free = tl.sum((in_p & (lu < step)).to(tl.int32), 0)
    order = tl.sort(tl.where(in_p, (lu + 1) * BLOCK_P + s, _PAD_KEY)) % BLOCK_P
    tl.store(scratch_ptr + BLOCK_W + s, order)
    tl.debug_barrier()
    got = missing & (rank < free)
    pick = tl.minimum(tl.maximum(rank, 0), num_slots - 1)
    victim = tl.where(got, tl.load(scratch_ptr + BLOCK_W + pick), num_slots)
    old = tl.load(bos_ptr + victim).to(tl.int64)
    old_mapped = got & (old >= 0)
    old_mapped = old_mapped & (
        tl.load(sob_ptr + tl.where(old_mapped, old, num_blocks)).to(tl.int64) == victim)
    tl.debug_barrier()
    tl.store(sob_ptr + tl.where(old_mapped, old, num_blocks), -1)
    tl.debug_barrier()
    tl.store(bos_ptr + victim, tl.where(got, blk_safe, -1).to(tl.int32))
    tl.store(sob_ptr + tl.where(got, blk_safe, num_blocks), victim.to(tl.int32))
    tl.store(last_ptr + victim, step)
    tl.store(tags_ptr + victim[:, None] * B + o[None, :], tl.full([BLOCK_W, B], -1, tl.int32),
             mask=got[:, None])
    tl.debug_barrier()
    _reset_sinks(sob_ptr, bos_ptr, last_ptr, tags_ptr, num_blocks, num_slots, o, B)
    tl.debug_barrier()

    # 3. tag every write of this step that lands in a block owning a slot
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        sm = tl.load(sm_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
        wblk = tl.minimum(tl.where(sm >= 0, sm // B, num_blocks), num_blocks)
        slot = tl.load(sob_ptr + wblk).to(tl.int64)
        claim = (sm >= 0) & (slot >= 0)
        tl.store(tags_ptr + tl.where(claim, slot, num_slots) * B + tl.where(claim, sm % B, 0),
                 tl.where(claim, wblk, -1).to(tl.int32))
    tl.debug_barrier()
    _reset_sinks(sob_ptr, bos_ptr, last_ptr, tags_ptr, num_blocks, num_slots, o, B)


@triton.jit
def _reset_sinks(sob_ptr, bos_ptr, last_ptr, tags_ptr, num_blocks, num_slots, o, B: tl.constexpr):
    tl.store(sob_ptr + num_blocks, -1)
    tl.store(bos_ptr + num_slots, -1)
    tl.store(last_ptr + num_slots, tl.full([], -1, tl.int64))
    tl.store(tags_ptr + num_slots * B + o, tl.full([B], -1, tl.int32))


TOKEN_TILE = 1024  # this step's slot_mapping, a tile at a time (one compiled variant)


def window_tile(entries: int) -> int:
    """BLOCK_W for `entries` window blocks: a power of 4 from 64, so that the batch sizes of a
    server compile a handful of variants (each took seconds; vLLM warms up 51 batch sizes)."""
    tile = 64
    while tile < entries:
        tile *= 4
    return tile


def scratch_size(max_window_entries: int, num_slots: int) -> int:
    """int64 entries of the scratch buffer residual_assign needs."""
    return window_tile(max_window_entries) + triton.next_power_of_2(num_slots)


def residual_assign(block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                    slot_of_block: torch.Tensor, block_of_slot: torch.Tensor,
                    last_use: torch.Tensor, tags: torch.Tensor, step: torch.Tensor,
                    scratch: torch.Tensor, tokens: int, window_blocks: int) -> None:
    """ResidualDirectory._assign's update, in place, for rows block_table[n, W], seq_lens[n],
    query_start_loc[n + 1] and this step's slot_mapping[T]."""
    n = block_table.shape[0]
    block_w = window_tile(n * window_blocks)
    block_p = triton.next_power_of_2(tags.shape[0] - 1)
    if scratch.numel() < block_w + block_p or scratch.dtype != torch.int64:
        raise ValueError(f"scratch must be int64 with >= {block_w + block_p} entries, got "
                         f"{scratch.numel()} {scratch.dtype}")
    args, kwargs = _assign_args(block_table, seq_lens, query_start_loc, slot_mapping,
                                slot_of_block, block_of_slot, last_use, tags, step, scratch,
                                tokens, window_blocks, block_w)
    _residual_assign_kernel[(1,)](*args, **kwargs)


def precompile_residual_assign(block_table: torch.Tensor, seq_lens: torch.Tensor,
                               query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                               slot_of_block: torch.Tensor, block_of_slot: torch.Tensor,
                               last_use: torch.Tensor, tags: torch.Tensor, step: torch.Tensor,
                               scratch: torch.Tensor, tokens: int, window_blocks: int,
                               max_rows: int) -> int:
    """Compile, in parallel, the BLOCK_W variant of every batch of 1..max_rows rows
    (residual_assign's arguments of one real step; nothing runs). Returns how many compiled."""
    from .precompile import compile_in_parallel
    tiles = sorted({window_tile(n * window_blocks) for n in range(1, max_rows + 1)})
    warm = []
    for block_w in tiles:
        args, kwargs = _assign_args(block_table, seq_lens, query_start_loc, slot_mapping,
                                    slot_of_block, block_of_slot, last_use, tags, step, scratch,
                                    tokens, window_blocks, block_w)
        warm.append(lambda a=args, kw=kwargs: _residual_assign_kernel.warmup(*a, grid=(1,), **kw))
    return compile_in_parallel(warm, "residual-directory")


def _assign_args(block_table, seq_lens, query_start_loc, slot_mapping, slot_of_block,
                 block_of_slot, last_use, tags, step, scratch, tokens, window_blocks, block_w):
    """The kernel's arguments (one list for the launch and the precompile)."""
    n, width = block_table.shape
    num_slots, block_size = tags.shape[0] - 1, tags.shape[1]
    if block_table.stride(1) != 1:
        raise ValueError("block_table must have unit stride along its columns")
    args = (block_table, block_table.stride(0), seq_lens, query_start_loc, slot_mapping, n,
            width, slot_mapping.shape[0], slot_of_block, block_of_slot, last_use, tags, step,
            scratch, slot_of_block.shape[0] - 1, num_slots)
    return args, dict(R=tokens, B=block_size, BPW=window_blocks, BLOCK_W=block_w,
                      BLOCK_P=triton.next_power_of_2(num_slots), BLOCK_T=TOKEN_TILE,
                      num_warps=8)
