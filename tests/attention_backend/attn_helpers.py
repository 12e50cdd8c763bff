"""Builders of random paged batches shared by the attention-backend tests."""
from __future__ import annotations

import dataclasses

import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.attention_backend import residual as R
from vllm_mixprec.kernels.triton.kv_cache import KVResidual

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass
class Batch:
    layout: F.KVPageLayout
    cache: torch.Tensor          # packed pages
    block_table: torch.Tensor    # int32 [rows, max_blocks], random physical blocks
    seq_lens: torch.Tensor       # int32 [rows]
    qsl: torch.Tensor            # int32 [rows + 1]
    q: torch.Tensor              # [T, Hq, D]
    k: list[torch.Tensor]        # per row, 16-bit K [L, Hkv, D] as written
    v: list[torch.Tensor]
    residual: KVResidual | None = None
    k_smooth: torch.Tensor | None = None
    k_bias: F.KRopeBias | None = None

    def ref_residual(self):
        r = self.residual
        return None if r is None else tuple(x.cpu() if torch.is_tensor(x) else x for x in r)

    def chunk_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) [T, Hkv, D] of this step's tokens, laid out like q (the K/V a
        forward is given): row i's last qlen tokens."""
        qlens = (self.qsl[1:] - self.qsl[:-1]).tolist()
        key = torch.cat([k[len(k) - n:] for k, n in zip(self.k, qlens)])
        value = torch.cat([v[len(v) - n:] for v, n in zip(self.v, qlens)])
        return key, value

    def reference(self, scale: float, exact_chunk: bool | str = False) -> torch.Tensor:
        """reference.paged_attention_residual on CPU copies. exact_chunk: with chunk_kv
        (True or "triton"), or with chunk_kv scored by the raw query ("flash": the chunk
        attended by FlashAttention, then merged; "gather": context workspace and one
        FlashAttention call)."""
        chunk = tuple(t.cpu() for t in self.chunk_kv()) if exact_chunk else None
        return ref.paged_attention_residual(
            self.q.cpu(), self.cache.cpu(), self.layout, self.block_table.cpu(),
            self.seq_lens.cpu(), self.qsl.cpu(), scale, self.ref_residual(),
            None if self.k_smooth is None else self.k_smooth.cpu(), cpu_k_bias(self.k_bias),
            chunk, chunk_raw=exact_chunk in ("flash", "gather"))


def rope_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """vLLM's RotaryEmbedding._compute_inv_freq (default rope, whole head)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def make_k_bias(num_kv_heads: int, head_dim: int, big: float, device=DEVICE,
                theta: float = 10000.0, num_pairs: int | None = None) -> F.KRopeBias:
    """A Qwen2-like k bias: small everywhere but a few channels per head of size ~`big`
    (both halves of the rotary pairs, either sign); num_pairs: make_k_rope_bias's."""
    bias = torch.randn(num_kv_heads, head_dim)
    idx = torch.randint(0, head_dim, (num_kv_heads, 4))
    bias.scatter_(1, idx, big * (torch.rand(num_kv_heads, 4) + 0.5)
                  * torch.where(torch.rand(num_kv_heads, 4) < 0.5, -1.0, 1.0))
    return F.make_k_rope_bias(bias.to(device), rope_inv_freq(head_dim, theta).to(device),
                              num_pairs)


def cpu_k_bias(k_bias: F.KRopeBias | None) -> F.KRopeBias | None:
    return None if k_bias is None else F.KRopeBias(*(t.cpu() for t in k_bias))


def slots_of(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int):
    return block_table_row[positions // block_size].long() * block_size + positions % block_size


def make_batch(scheme: str, dtype: torch.dtype, head_dim: int, num_kv_heads: int, group: int,
               rows: list[tuple[int, int]], block_size: int = 16, residual_tokens: int = 0,
               smooth: bool = False, writer=None, device: str = DEVICE,
               spare_blocks: int = 3, k_bias: F.KRopeBias | None = None) -> Batch:
    """rows: (query_len, seq_len) per row; every token of every row is written with `writer`
    (quantize_and_store signature; reference.reshape_and_cache + store_kv_residual if None).
    With residual_tokens > 0, a directory assigns slots exactly as the builder would. With
    k_bias (bias-aware K), K is what a model with that k bias would produce: RoPE_p(x + b),
    x ~ N(0.3, 2), and the writer gets the cache positions."""
    layout = F.KVPageLayout(scheme, head_dim, block_size)
    max_blocks = max(-(-s // block_size) for _, s in rows) + 1
    nb = len(rows) * max_blocks + spare_blocks
    perm = torch.randperm(nb)[: len(rows) * max_blocks]
    bt = perm.view(len(rows), max_blocks).to(torch.int32).to(device)
    cache = torch.zeros(layout.cache_shape(nb, num_kv_heads), dtype=layout.storage_dtype(),
                        device=device)
    # Poison: bytes nobody writes must never be read.
    cache.view(torch.uint8).fill_(0x7B)
    seq_lens = torch.tensor([s for _, s in rows], dtype=torch.int32, device=device)
    qlens = torch.tensor([q for q, _ in rows])
    qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    qsl = qsl.to(device)
    k_smooth = (torch.rand(num_kv_heads, head_dim) + 0.5).to(device) if smooth else None
    residual = None
    if residual_tokens:
        slots = len(rows) * R.window_blocks(residual_tokens, block_size) + 2
        d = R.ResidualDirectory(nb, slots, block_size, residual_tokens, torch.device(device))
        pool_k, pool_v = R.allocate_pool(slots * block_size, num_kv_heads, head_dim, dtype,
                                         torch.device(device))
        pool_k.fill_(float("nan"))
        pool_v.fill_(float("nan"))
        # One "step" writing every token of every row: all windows get slots.
        all_sm = torch.cat([slots_of(bt[i], torch.arange(s, device=device), block_size)
                            for i, (_, s) in enumerate(rows)])
        d.assign(bt, seq_lens, qsl, all_sm, len(rows))
        residual = KVResidual(pool_k, pool_v, d.slot_of_block, d.tags, residual_tokens)
    ks, vs = [], []
    for i, (_, s) in enumerate(rows):
        k = torch.randn(s, num_kv_heads, head_dim) * 2 + 0.3
        pos = torch.arange(s, device=device)
        if k_bias is not None:  # K = RoPE_p(x + b)
            k = ref.apply_rope(k + k_bias.bias.cpu(), pos.cpu(), k_bias.steps.cpu())
        k = k.to(dtype).to(device)
        v = torch.randn(s, num_kv_heads, head_dim).to(dtype).to(device)
        sm = slots_of(bt[i], pos, block_size)
        kb_args = {} if k_bias is None else dict(k_bias=k_bias, positions=pos)
        if writer is None:
            kb_cpu = {k_: (v_.cpu() if torch.is_tensor(v_) else cpu_k_bias(v_))
                      for k_, v_ in kb_args.items()}
            ref.reshape_and_cache(k.cpu(), v.cpu(), cache_cpu := cache.cpu(), sm.cpu(), layout,
                                  None if k_smooth is None else k_smooth.cpu(), **kb_cpu)
            cache.copy_(cache_cpu)
            if residual is not None:
                rk, rv = residual.k.cpu(), residual.v.cpu()
                ref.store_kv_residual(k.cpu(), v.cpu(), rk, rv, sm.cpu(),
                                      residual.slot_of_block.cpu(), block_size,
                                      None if k_smooth is None else k_smooth.cpu(), **kb_cpu)
                residual.k.copy_(rk)
                residual.v.copy_(rv)
        else:
            writer(k, v, cache, sm, layout, k_smooth, residual, **kb_args)
        ks.append(k)
        vs.append(v)
    q = torch.randn(int(qlens.sum()), num_kv_heads * group, head_dim).to(dtype).to(device)
    return Batch(layout, cache, bt, seq_lens, qsl, q, ks, vs, residual, k_smooth, k_bias)


@dataclasses.dataclass
class DecodeGraphBuffers:
    """Fixed tensors of a decode step captured once in a CUDA graph (refill_decode_batch
    rewrites their contents between replays)."""
    cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    qsl: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    directory: object            # residual.ResidualDirectory
    residual: KVResidual


def decode_graph_buffers(layout: F.KVPageLayout, rows: int, num_kv_heads: int, group: int,
                         max_blocks: int, splits: int, dtype: torch.dtype,
                         spare_blocks: int = 4, device: str = "cuda") -> DecodeGraphBuffers:
    """One decode row per batch row, a 16-token residual window, partials for `splits`."""
    d, b = layout.head_dim, layout.block_size
    nb = rows * max_blocks + spare_blocks
    hq = num_kv_heads * group
    dev = torch.device(device)
    slots = rows * R.window_blocks(16, b) + 4
    directory = R.ResidualDirectory(nb, slots, b, 16, dev)
    res = KVResidual(*R.allocate_pool(slots * b, num_kv_heads, d, dtype, dev),
                     directory.slot_of_block, directory.tags, 16)
    q = torch.zeros(rows, hq, d, dtype=dtype, device=device)
    return DecodeGraphBuffers(
        torch.zeros(layout.cache_shape(nb, num_kv_heads), dtype=layout.storage_dtype(), device=device),
        torch.zeros(rows, max_blocks, dtype=torch.int32, device=device),
        torch.ones(rows, dtype=torch.int32, device=device),
        torch.arange(rows + 1, dtype=torch.int32, device=device), q, torch.zeros_like(q),
        torch.empty(rows * (splits + 1), hq, d, dtype=torch.float32, device=device),
        torch.empty(rows * (splits + 1), hq, dtype=torch.float32, device=device), directory, res)


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """fn run once eagerly (compiles outside the capture), then captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def refill_decode_batch(trial: int, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        qsl: torch.Tensor, cache: torch.Tensor, layout: F.KVPageLayout,
                        directory, residual: KVResidual) -> None:
    """New lengths (row 0 near the table's end), a new random block table and freshly written
    pages and residual window, in place: what a captured decode graph replays over."""
    from vllm_mixprec.kernels.triton.kv_cache import quantize_and_store
    n, max_blocks = block_table.shape
    b, nb = layout.block_size, cache.shape[0]
    hkv, d = cache.shape[1], layout.head_dim
    lens = torch.randint(1, max_blocks * b, (n,), dtype=torch.int32)
    lens[0] = max_blocks * b - trial
    seq_lens.copy_(lens)
    block_table.copy_(torch.randperm(nb)[: n * max_blocks].view(n, max_blocks).int())
    cache.view(torch.uint8).fill_(0)
    slots = [slots_of(block_table[i], torch.arange(int(lens[i]), device=cache.device), b)
             for i in range(n)]
    directory.assign(block_table, seq_lens, qsl, torch.cat(slots), n)
    for i in range(n):
        k = torch.randn(int(lens[i]), hkv, d, dtype=residual.k.dtype, device=cache.device)
        quantize_and_store(k, torch.randn_like(k), cache, slots[i], layout, None, residual)


def use_tail(monkeypatch, mode: str) -> None:
    """Force the decode tail placement (attention.decode_tail_mode; "" = the default)."""
    monkeypatch.delenv("MIXPREC_ATTN_TAIL_IN_SPLIT", raising=False)
    monkeypatch.setenv("MIXPREC_ATTN_TAIL", mode)


def tolerance(dtype: torch.dtype) -> dict:
    # Output rounding plus fp32 accumulation; bf16 keeps 8 significant bits.
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-3, rtol=3e-3)
