"""The 16-bit residual window of the KV4/KV8 cache: which tokens have a high-precision copy.

Design (docs/ATTENTION-draft.md has the long form)
-------------------------------------------------
* Every token is ALWAYS quantised into its page when written. Pages are therefore complete
  and immutable once written, which is what prefix caching, preemption/recompute and
  abort need; the residual is only a side copy that may be lost without harm.
* A small per-layer pool holds P "slots" of B tokens (16-bit K and V). A slot belongs to a
  physical block. A slot directory, shared by the layers of a KV-cache group, says who
  owns what:
      slot_of_block [num_blocks + 1] int32   (-1: none; the last entry is a write sink)
      block_of_slot [P + 1] int32            (-1: free)
      last_use      [P + 1] int64            (build step of the last use; LRU eviction)
      tags          [P + 1, B] int32         tags[p, off] == blk  <=>  row p*B+off holds
                                             the 16-bit copy of the latest write of slot
                                             (blk, off)
* Once per step (metadata build, eager, before the layers run) `ResidualDirectory.assign`:
    1. lists the window blocks of every scheduled row: the blocks holding its newest R
       positions [L - R, L), L = seq_len after this step;
    2. keeps the slots those blocks already own, and gives each one without a slot the
       least recently used slot not needed in this step (its old owner loses it; the
       slot's tags are cleared);
    3. for every token written in this step whose block owns a slot, sets the tag.
  Each layer's writer then copies the 16-bit K/V of every written token whose block owns
  a slot (kernels/triton/kv_cache.py), and its reader takes key position j from the pool
  iff j >= L - R and the tag is valid, else from the page (kernels/triton/attention.py).
* Invariant: tags[p, off] == blk and slot_of_block[blk] == p  =>  pool row p*B+off holds
  the 16-bit value of the latest write of (blk, off). Tags are set only together with a
  write that every layer mirrors into the pool; a slot's tags are cleared whenever it
  changes owner. So a stale or evicted entry can only ever fall back to the page, which
  is always correct. Blocks freed/reallocated by the scheduler (abort, preemption) need
  no notice: their next write refreshes the tag, and positions are only read once written.
* P = max_num_seqs * (window blocks per row) + slack, so every row of a step always gets
  its window (eviction only hits rows that are not scheduled in the step).
* Everything here is fixed-shape torch on the device: no host sync, and the tensors are
  persistent, so decode CUDA graphs read them at fixed addresses. No Python scalar is ever
  assigned through indexing (`t[i] = -1`): torch lifts it into a CPU tensor and copies it
  over, and that pageable copy synchronises the stream. Ten of them per step made every
  decode step wait for the previous one to finish before the host could prepare it (H100
  trace, 2026-11-25: 0.43 ms in the first); `index_fill_` and `fill_` take the scalar as
  a kernel argument instead. The step counter is a device tensor for the same reason.
* The update is ~60 small torch ops: ~1 ms of host time a step, more than a batch-1
  decode step of the GPU (H100 profile, 2026-11-25: the host took 5.1 ms a step for a
  4.0 ms GPU step). On CUDA, decode-only steps therefore replay it from a CUDA graph
  captured per input shape (`StepGraphs`) over static copies of the inputs: five launches.
  MIXPREC_KV_RESIDUAL_GRAPHS=0 runs it eagerly. On CUDA the default is neither: one Triton
  program (kernels/triton/residual_directory.py) runs the update every step, ~42 us a call
  against ~185 us from the graph (H100, 2026-11-25); MIXPREC_KV_RESIDUAL_KERNEL=0 turns it off.

Limits: page writes that bypass our writer (KV connectors / offloading) would break the
invariant, so they are refused at start-up with the residual on; so are cross-layer KV
sharing and decode context parallelism.
"""
from __future__ import annotations

import logging

import torch

from .. import envs
from ..kernels.triton import precompile
from ..kernels.triton import residual_directory as _kernel

logger = logging.getLogger("vllm.mixprec")

ENV_TOKENS = "MIXPREC_KV_RESIDUAL"        # R, the window in tokens; 0 disables the residual
ENV_SLOTS = "MIXPREC_KV_RESIDUAL_SLOTS"   # P override (slots of B tokens per layer)
ENV_GRAPHS = "MIXPREC_KV_RESIDUAL_GRAPHS"  # 0: the per-step update runs eagerly on CUDA too
ENV_KERNEL = "MIXPREC_KV_RESIDUAL_KERNEL"  # 0: the torch ops instead of the Triton program on CUDA
MAX_RESIDUAL_TOKENS = 128                 # one tail tile of the attention kernels


def residual_tokens(vllm_config, block_size: int) -> int:
    """R: env MIXPREC_KV_RESIDUAL, else the quant config's kv_residual_tokens, else B."""
    r = envs.integer(ENV_TOKENS, 0, MAX_RESIDUAL_TOKENS)
    if r is not None:
        src = f"{ENV_TOKENS}={r}"
    else:
        quant = getattr(vllm_config, "quant_config", None) if vllm_config is not None else None
        r = getattr(quant, "kv_residual_tokens", None)
        src = "quantization_config.kv_residual_tokens"
        if r is None:
            r, src = block_size, "default (= block_size)"
    r = int(r)
    if not 0 <= r <= MAX_RESIDUAL_TOKENS:
        raise ValueError(f"KV residual window {r} tokens (from {src}) is not in "
                         f"[0, {MAX_RESIDUAL_TOKENS}]; set {ENV_TOKENS}=0 to disable it")
    return r


def window_blocks(r: int, block_size: int) -> int:
    """Most blocks R consecutive positions can touch."""
    return 0 if r <= 0 else 1 + (r - 1 + block_size - 1) // block_size


def residual_slots(vllm_config, r: int, block_size: int) -> int:
    """P: every scheduled row's window fits, plus slack for rows not scheduled in a step."""
    if r <= 0:
        return 0
    p = envs.integer(ENV_SLOTS, 1)
    max_seqs = vllm_config.scheduler_config.max_num_seqs
    need = max_seqs * window_blocks(r, block_size)
    if p is not None:
        if p < need:
            raise ValueError(f"{ENV_SLOTS}={p} is below max_num_seqs * window blocks = {need}")
        return p
    return need + max(16, max_seqs // 4)


def graphs_by_default(device: torch.device) -> bool:
    """Whether decode steps replay the directory update from CUDA graphs (StepGraphs)."""
    return envs.flag(ENV_GRAPHS) and device.type == "cuda"


def kernel_by_default(device: torch.device) -> bool:
    """Whether the update runs as one Triton program (CUDA; MIXPREC_KV_RESIDUAL_KERNEL=0: the
    torch ops). H100, 2026-11-25: ~42 us a call against ~185 us replayed from its graph."""
    return envs.flag(ENV_KERNEL) and device.type == "cuda"


def check_supported(vllm_config, r: int) -> None:
    """Refuse, at start-up, the features that would break the residual invariant."""
    if r <= 0 or vllm_config is None:
        return
    fix = f"set {ENV_TOKENS}=0 to run without the 16-bit residual window"
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ValueError("KV connectors/offloading write KV pages outside the attention "
                         f"backend, which the mixprec residual window cannot track; {fix}")
    par = vllm_config.parallel_config
    if getattr(par, "decode_context_parallel_size", 1) > 1:
        raise ValueError(f"decode context parallelism is not supported by the mixprec "
                         f"backend; set --decode-context-parallel-size 1")


class ResidualDirectory:
    """The slot directory of one KV-cache group (see the module docstring)."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, tokens: int,
                 device: torch.device, graphs: bool | None = None,
                 kernel: bool | None = None, max_rows: int = 0):
        self.num_blocks, self.num_slots, self.block_size, self.tokens = (
            num_blocks, num_slots, block_size, tokens)
        self.bpw = window_blocks(tokens, block_size)
        # The extra last entry of each table absorbs masked-out scatter writes.
        self.slot_of_block = torch.full((num_blocks + 1,), -1, dtype=torch.int32, device=device)
        self.block_of_slot = torch.full((num_slots + 1,), -1, dtype=torch.int32, device=device)
        self.last_use = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=device)
        self.tags = torch.full((num_slots + 1, block_size), -1, dtype=torch.int32, device=device)
        self.step = torch.zeros(1, dtype=torch.int64, device=device)  # steps assigned so far
        if kernel is None:
            kernel = kernel_by_default(device)
        self.kernel = kernel
        self.scratch = torch.empty(0, dtype=torch.int64, device=device)
        # batches of up to max_rows rows: their kernel variants compile in parallel at the
        # first update (kernels/triton/precompile.py); 0: each at its first batch size
        self.precompile_rows = max_rows
        if graphs is None:
            graphs = graphs_by_default(device)
        self.graphs = StepGraphs(self._assign) if graphs else None  # unused while kernel

    def assign(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, num_reqs: int,
               decode_only: bool = False) -> None:
        """One scheduling step: give window blocks slots, then tag this step's writes.
        decode_only (every row's query length <= 1) lets a CUDA graph run it."""
        if num_reqs == 0:
            return
        args = (block_table[:num_reqs], seq_lens[:num_reqs],
                query_start_loc[:num_reqs + 1], slot_mapping)
        if self.kernel:
            self._assign_kernel(*args)
        elif (self.graphs is not None and decode_only
                and not torch.cuda.is_current_stream_capturing()):
            self.graphs.run(*args)
        else:
            self._assign(*args)

    def _assign_kernel(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        need = _kernel.scratch_size(block_table.shape[0] * self.bpw, self.num_slots)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.int64, device=self.scratch.device)
        args = (block_table, seq_lens, query_start_loc, slot_mapping, self.slot_of_block,
                self.block_of_slot, self.last_use, self.tags, self.step, self.scratch,
                self.tokens, self.bpw)
        if self.precompile_rows and precompile.enabled():
            _kernel.precompile_residual_assign(*args, self.precompile_rows)
        self.precompile_rows = 0
        _kernel.residual_assign(*args)

    def _assign(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.step += 1
        step, b, r, nb, p = self.step, self.block_size, self.tokens, self.num_blocks, self.num_slots
        dev = self.slot_of_block.device
        bt = block_table.long()
        seq = seq_lens.long()
        qlen = (query_start_loc[1:] - query_start_loc[:-1]).long()

        # 1. window blocks of each row: logical blocks of positions [L - R, L).
        j = ((seq - r).clamp_min(0) // b)[:, None] + torch.arange(self.bpw, device=dev)
        j_last = ((seq - 1).clamp_min(0) // b)[:, None]
        ok = ((qlen > 0) & (seq > 0))[:, None] & (j <= j_last)
        blk = torch.gather(bt, 1, torch.minimum(j, j_last).clamp(0, bt.shape[1] - 1))
        blk = torch.where(ok & (blk >= 0) & (blk < nb), blk, -1).flatten()
        blk, _ = torch.sort(blk)  # deduplicate: prefix-shared blocks appear in several rows
        first = torch.ones_like(blk, dtype=torch.bool)
        first[1:] = blk[1:] != blk[:-1]
        need = first & (blk >= 0)
        blk_safe = torch.where(need, blk, nb)

        # 2. keep owned slots, allocate the rest least-recently-used first.
        cur = self.slot_of_block[blk_safe].long()
        has = need & (cur >= 0)
        has &= self.block_of_slot[torch.where(has, cur, p)].long() == blk_safe
        self.last_use[torch.where(has, cur, p)] = step
        missing = need & ~has
        rank = torch.cumsum(missing.long(), 0) - 1
        order = torch.sort(self.last_use[:p], stable=True).indices
        free = (self.last_use[:p] < step).sum()
        got = missing & (rank < free)
        victim = torch.where(got, order[rank.clamp(0, p - 1)], p)
        old = self.block_of_slot[victim].long()
        old_mapped = got & (old >= 0)
        old_mapped &= self.slot_of_block[torch.where(old_mapped, old, nb)].long() == victim
        self.slot_of_block.index_fill_(0, torch.where(old_mapped, old, nb), -1)
        self.block_of_slot[victim] = torch.where(got, blk_safe, -1).int()
        self.slot_of_block[torch.where(got, blk_safe, nb)] = victim.int()
        self.last_use[victim] = step
        self.tags.index_fill_(0, victim, -1)
        self._reset_sinks()

        # 3. tag every write of this step that lands in a block owning a slot.
        sm = slot_mapping.long()
        wblk = torch.where(sm >= 0, sm // b, nb).clamp_max(nb)
        s = self.slot_of_block[wblk].long()
        claim = (sm >= 0) & (s >= 0)
        self.tags[torch.where(claim, s, p), torch.where(claim, sm % b, 0)] = \
            torch.where(claim, wblk, -1).int()
        self._reset_sinks()

    def _reset_sinks(self) -> None:
        for table in (self.slot_of_block, self.block_of_slot, self.last_use, self.tags):
            table[-1:].fill_(-1)


class StepGraphs:
    """Runs fn(*inputs) from a CUDA graph per input shape and dtype. The graphs read static
    copies of the inputs (one buffer per argument, grown to a power of two of rows; growing
    drops the graphs); a shape's first call runs eagerly, its second captures. fn must be
    capturable: fixed shapes, no host sync."""

    def __init__(self, fn):
        self.fn = fn
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.seen: set[tuple] = set()
        self.static: list[torch.Tensor] = []
        self.pool = None
        self.replays = 0

    def _views(self, inputs) -> list[torch.Tensor]:
        """Static views shaped like `inputs`, (re)allocating the buffers they need."""
        def fits(i, t):
            return (i < len(self.static) and self.static[i].dtype == t.dtype
                    and self.static[i].shape[1:] == t.shape[1:])
        if len(self.static) != len(inputs) or any(
                not fits(i, t) or self.static[i].shape[0] < t.shape[0]
                for i, t in enumerate(inputs)):
            rows = [max(t.shape[0], self.static[i].shape[0] if fits(i, t) else 0)
                    for i, t in enumerate(inputs)]
            self.static = [torch.empty((1 << max(n - 1, 0).bit_length(), *t.shape[1:]),
                                       dtype=t.dtype, device=t.device)
                           for n, t in zip(rows, inputs)]
            # the graphs read the old buffers; their pool dies with the last of them
            self.graphs.clear()
            self.pool = None
        return [s[:t.shape[0]] for s, t in zip(self.static, inputs)]

    def run(self, *inputs: torch.Tensor) -> None:
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        if key not in self.seen:  # first sight: eager (lazy initialisation, workspaces)
            self.seen.add(key)
            self.fn(*inputs)
            return
        views = self._views(inputs)
        for v, t in zip(views, inputs):
            v.copy_(t, non_blocking=True)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(views)
            self.graphs[key] = graph
        graph.replay()
        self.replays += 1

    def _capture(self, views: list[torch.Tensor]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream(main.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            # thread_local: vLLM's other threads may call CUDA while this captures
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                self.fn(*views)
            finally:
                graph.capture_end()
        main.wait_stream(side)
        if self.pool is None:
            self.pool = graph.pool()
        logger.debug("mixprec KV residual: captured the step update for %s",
                     [tuple(v.shape) for v in views])
        return graph


def allocate_pool(rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16-bit K and V pool of one layer: [rows = P*B, H, D] each."""
    shape = (rows, num_kv_heads, head_dim)
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device))
