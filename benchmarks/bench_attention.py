#!/usr/bin/env python
"""Decode attention micro-benchmark: mixprec KV4/KV8 vs FA3 bf16 vs vLLM TRITON_ATTN int4/int8.

Every method reads a paged cache holding the same random K/V (block size 16, a random
block table per sequence), written by its own writer:
  fa3-bf16      vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3), bf16 pages,
                AOT scheduler metadata as vLLM's FLASH_ATTN backend computes it;
  triton-int4/8 vLLM's TRITON_ATTN per-token-head path: TritonAttentionImpl.do_kv_cache_update
                writes the cache, v1/attention/ops/triton_unified_attention.unified_attention
                (which dispatches int4 to unified_attention_int4) reads it;
  mixprec-kv4/8 vllm_mixprec.kernels.triton.attention.decode_attention (+ split merge);
  mixprec-kv4-r16  the same with the 16-token bf16 residual window (the backend default).
  ...-cuda / ...-triton  a mixprec method with its page kernel forced (decode_impl): the CUDA
                kernel of csrc/attention/ or the Triton one (e.g. mixprec-kv4-r16-cuda).
Each call is captured in a CUDA graph and timed with triton.testing.do_bench (median,
L2 flushed between replays). Outputs are checked against FA3 (relative L2 error).

  python benchmarks/bench_attention.py            # full grid: batch {1,8,64} x ctx {1K,8K,32K}
  python benchmarks/bench_attention.py --quick    # batch {1,64} x ctx {1K,8K}
  python benchmarks/bench_attention.py --tune     # sweep mixprec decode configs (BLOCK_N,
                                                  # warps, stages, splits) on two shapes
  python benchmarks/bench_attention.py --tune-prefill  # sweep the prefill kernel's configs
                                                       # (BLOCK_M, BLOCK_N, warps, stages)
  python benchmarks/bench_attention.py --prefill  # prefill/extend: FA3 vs mixprec KV4/KV8,
                                                  # chunk read from the pages or exact (16-bit,
                                                  # in our kernel, FlashAttention + merge, or
                                                  # context workspace + FlashAttention)
Writes <out>/attention-<device>.json and .png and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HQ, HKV, D, B = 32, 8, 128, 16
BYTES_PER_TOKEN_HEAD = {"fa3-bf16": 4 * D, "triton-int4": D + 8, "triton-int8": 2 * D + 8,
                        "mixprec-kv4": D + 8, "mixprec-kv8": 2 * D + 8, "mixprec-kv4-r16": D + 8}
ALL_METHODS = tuple(BYTES_PER_TOKEN_HEAD)
IMPL_SUFFIXES = ("-cuda", "-triton")  # MIXPREC_ATTN_DECODE_IMPL for a mixprec method


def split_impl(method: str) -> tuple[str, str | None]:
    """"mixprec-kv4-r16-cuda" -> ("mixprec-kv4-r16", "cuda"); no suffix -> (method, None)."""
    for suffix in IMPL_SUFFIXES:
        if method.startswith("mixprec-") and method.endswith(suffix):
            return method[:-len(suffix)], suffix[1:]
    return method, None
# (batch, ctx, chunk): `chunk` new tokens per sequence after ctx - chunk cached ones
PREFILL_GRID = ((1, 8192, 8192), (8, 2048, 2048), (4, 8192, 1024), (16, 4096, 512),
                (2, 8192, 128))
# -exact: the chunk's own tokens in 16 bits in our Triton kernel; -flash: by FlashAttention,
# then merged with the cached context by our kernel; -gather: the context dequantised into a
# 16-bit workspace, then one FlashAttention call (the backend's default on sm80+)
PREFILL_METHODS = ("fa3-bf16", "mixprec-kv4", "mixprec-kv4-exact", "mixprec-kv4-flash",
                   "mixprec-kv4-gather", "mixprec-kv8", "mixprec-kv8-exact",
                   "mixprec-kv8-flash", "mixprec-kv8-gather")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--methods", nargs="+", choices=sorted(set(
        ALL_METHODS + PREFILL_METHODS + tuple(m + x for m in ALL_METHODS if m.startswith("mixprec-")
                                              for x in IMPL_SUFFIXES))),
                   help="default: every decode method, or with --prefill every prefill one")
    p.add_argument("--quick", action="store_true", help="batch {1,64} x ctx {1K,8K}, short reps")
    p.add_argument("--tune", action="store_true", help="sweep the mixprec decode configs")
    p.add_argument("--tune-prefill", action="store_true",
                   help="sweep the prefill kernel's configs on the context-bound shapes")
    p.add_argument("--prefill", action="store_true",
                   help="prefill/extend grid (PREFILL_GRID) instead of decode")
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench rep time per method")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.ctx, args.rep_ms = [1, 64], [1024, 8192], 50
    if args.methods is None:
        args.methods = list(PREFILL_METHODS if args.prefill else ALL_METHODS)
    return args


# --- set-up ----------------------------------------------------------------------------

class Shape:
    """One grid point: a batch of `batch` sequences of `ctx` tokens, the last `q_len` of
    each being this step's queries (1: decode)."""

    def __init__(self, batch: int, ctx: int, seed: int, q_len: int = 1):
        import torch
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.batch, self.ctx, self.q_len = batch, ctx, q_len
        self.blocks_per_seq = -(-ctx // B)
        self.num_blocks = batch * self.blocks_per_seq + 1
        perm = torch.randperm(self.num_blocks - 1, device="cuda", generator=g) + 1
        self.block_table = perm.view(batch, self.blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
        self.q = torch.randn(batch * q_len, HQ, D, dtype=torch.bfloat16, device="cuda",
                             generator=g)
        # the new tokens' 16-bit K/V, as a layer's forward gets them (filled by chunks())
        self.new_k = torch.empty(batch * q_len, HKV, D, dtype=torch.bfloat16, device="cuda")
        self.new_v = torch.empty_like(self.new_k)
        self.scale = D ** -0.5
        self.gen = g

    def chunks(self, tokens_per_chunk: int = 1 << 18):
        """(slot_mapping, k, v) chunks covering every token of every sequence."""
        import torch
        pos = torch.arange(self.ctx, device="cuda")
        seqs_per_chunk = max(1, tokens_per_chunk // self.ctx)
        for s0 in range(0, self.batch, seqs_per_chunk):
            rows = self.block_table[s0:s0 + seqs_per_chunk].long()
            slots = (rows[:, pos // B] * B + pos % B).flatten()
            k = torch.randn(slots.shape[0], HKV, D, dtype=torch.bfloat16, device="cuda",
                            generator=self.gen)
            v = torch.randn(k.shape, dtype=torch.bfloat16, device="cuda", generator=self.gen)
            n = rows.shape[0]
            new = slice(s0 * self.q_len, (s0 + n) * self.q_len)
            self.new_k[new] = k.view(n, self.ctx, HKV, D)[:, self.ctx - self.q_len:].flatten(0, 1)
            self.new_v[new] = v.view(n, self.ctx, HKV, D)[:, self.ctx - self.q_len:].flatten(0, 1)
            yield slots, k, v

    def attention_flops(self) -> float:
        """2 GEMMs x 2 flops per causal (query, key) pair and head dim element."""
        pairs = self.q_len * (self.ctx - self.q_len) + self.q_len * (self.q_len + 1) / 2
        return 4.0 * self.batch * HQ * D * pairs


def setup_fa3(shape: Shape):
    import torch
    from vllm.vllm_flash_attn.flash_attn_interface import (flash_attn_varlen_func,
                                                           get_scheduler_metadata)
    k_cache = torch.empty(shape.num_blocks, B, HKV, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    writers = [lambda s, k, v: (k_cache.view(-1, HKV, D).index_copy_(0, s, k),
                                v_cache.view(-1, HKV, D).index_copy_(0, s, v))]
    out = torch.empty_like(shape.q)
    sched = get_scheduler_metadata(batch_size=shape.batch, max_seqlen_q=shape.q_len,
                                   max_seqlen_k=shape.ctx, num_heads_q=HQ, num_heads_kv=HKV,
                                   headdim=D, cache_seqlens=shape.seq_lens,
                                   qkv_dtype=torch.bfloat16, cu_seqlens_q=shape.qsl,
                                   page_size=B, causal=True)

    def run():
        flash_attn_varlen_func(shape.q, k_cache, v_cache, max_seqlen_q=shape.q_len,
                               cu_seqlens_q=shape.qsl, max_seqlen_k=shape.ctx,
                               seqused_k=shape.seq_lens, softmax_scale=shape.scale, causal=True,
                               block_table=shape.block_table, out=out,
                               scheduler_metadata=sched, fa_version=3)
    return writers, run, out


def setup_triton(shape: Shape, carrier: str):
    """vLLM's TRITON_ATTN per-token-head path, with its default NHD physical layout."""
    import torch
    from vllm.triton_utils import triton
    from vllm.v1.attention.backends.triton_attn import (MIN_LAUNCH_GRID_SIZE_2D,
                                                        NUM_PAR_SOFTMAX_SEGMENTS,
                                                        TritonAttentionBackend,
                                                        TritonAttentionImpl)
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import get_kv_quant_mode
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    shp = TritonAttentionBackend.get_kv_cache_shape(shape.num_blocks, B, HKV, D, carrier)
    order = TritonAttentionBackend.get_kv_cache_stride_order()
    phys = torch.zeros([shp[i] for i in order], dtype=STR_DTYPE_TO_TORCH_DTYPE[carrier],
                       device="cuda")
    kv_cache = phys.permute(*[order.index(i) for i in range(4)])
    impl = TritonAttentionImpl(HQ, D, shape.scale, HKV, None, None, carrier)
    key_cache, value_cache = impl._pth_key_value_caches(kv_cache)
    writers = [lambda s, k, v: impl.do_kv_cache_update(None, k, v, kv_cache, s)]
    thr = MIN_LAUNCH_GRID_SIZE_2D // HKV
    seg = NUM_PAR_SOFTMAX_SEGMENTS
    segm_o = torch.empty(thr, HQ, seg, triton.next_power_of_2(D), dtype=torch.float32,
                         device="cuda")
    segm_m = torch.empty(thr, HQ, seg, dtype=torch.float32, device="cuda")
    segm_e = torch.empty_like(segm_m)
    out = torch.empty_like(shape.q)

    def run():
        unified_attention(q=shape.q, k=key_cache, v=value_cache, out=out,
                          cu_seqlens_q=shape.qsl, max_seqlen_q=1, seqused_k=shape.seq_lens,
                          max_seqlen_k=shape.ctx, softmax_scale=shape.scale, causal=True,
                          window_size=(-1, -1), block_table=shape.block_table, softcap=0,
                          q_descale=None, k_descale=None, v_descale=None,
                          seq_threshold_3D=thr, num_par_softmax_segments=seg,
                          softmax_segm_output=segm_o, softmax_segm_max=segm_m,
                          softmax_segm_expsum=segm_e, kv_quant_mode=get_kv_quant_mode(carrier),
                          k_scale_cache=impl._k_scale_cache, v_scale_cache=impl._v_scale_cache)
    return writers, run, out


def setup_mixprec(shape: Shape, scheme: str, residual_tokens: int = 0, splits: int | None = None,
                  chunk: str | None = None, impl: str | None = None):
    import torch
    from vllm_mixprec import formats as F
    from vllm_mixprec.attention_backend import residual as R
    from vllm_mixprec.kernels.chunk_attention import chunk_attention, context_attention
    from vllm_mixprec.kernels.triton.attention import (decode_attention, decode_merge_counters,
                                                       decode_num_splits,
                                                       prefill_attention)
    from vllm_mixprec.kernels.triton.context import gather_context_kv
    from vllm_mixprec.kernels.triton.kv_cache import KVResidual, quantize_and_store

    layout = F.KVPageLayout(scheme, D, B)
    cache = torch.zeros(layout.cache_shape(shape.num_blocks, HKV), dtype=layout.storage_dtype(),
                        device="cuda")
    res = directory = None
    if residual_tokens:
        slots = shape.batch * R.window_blocks(residual_tokens, B) + 16
        directory = R.ResidualDirectory(shape.num_blocks, slots, B, residual_tokens,
                                        torch.device("cuda"), graphs=True)
        directory.assign(shape.block_table, shape.seq_lens, shape.qsl,
                         torch.full((shape.batch,), -1, device="cuda"), shape.batch)
        res = KVResidual(*R.allocate_pool(slots * B, HKV, D, torch.bfloat16,
                                          torch.device("cuda")),
                         directory.slot_of_block, directory.tags, residual_tokens)

    def write(s, k, v):
        if directory is not None:  # tag the window positions as the builder would
            sob = directory.slot_of_block[s // B].long()
            ok = sob >= 0
            directory.tags[sob[ok], (s % B)[ok]] = (s // B)[ok].int()
        quantize_and_store(k, v, cache, s, layout, None, res)

    max_splits = max(splits or 1, 2 * decode_num_splits(shape.batch, HKV))
    part_o = torch.empty(shape.batch * max_splits, HQ, D, dtype=torch.float32, device="cuda")
    part_lse = torch.empty(part_o.shape[:2], dtype=torch.float32, device="cuda")
    counters = decode_merge_counters(shape.batch, HKV, torch.device("cuda"))  # as the backend's
    out = torch.empty_like(shape.q)
    cu_k = F.context_seqlens(shape.seq_lens, shape.qsl, shape.batch)
    ws = None
    if chunk == "gather":  # the backend's workspace, sized for this step
        ws = [torch.empty(shape.batch * shape.ctx, HKV, D, dtype=torch.bfloat16, device="cuda")
              for _ in range(2)]

    def run():
        if shape.q_len > 1 and ws is not None:  # as the backend runs it by default
            gather_context_kv(cache, layout, shape.block_table, shape.seq_lens, shape.qsl, cu_k,
                              shape.new_k, shape.new_v, ws[0], ws[1], shape.batch, shape.ctx,
                              res)
            context_attention(shape.q, ws[0], ws[1], shape.qsl, cu_k, shape.q_len, shape.ctx,
                              shape.scale, out)
        elif shape.q_len > 1:
            lse = None
            if chunk == "flash":  # FlashAttention over the chunk, then the merge
                lse = chunk_attention(shape.q, shape.new_k, shape.new_v, shape.qsl, shape.q_len,
                                      shape.scale, out)
            prefill_attention(shape.q, cache, layout, shape.block_table, shape.seq_lens,
                              shape.qsl, out, shape.scale, shape.batch, shape.q_len, res,
                              chunk_kv=(shape.new_k, shape.new_v) if chunk == "triton" else None,
                              chunk_lse=lse)
        else:
            saved = os.environ.get("MIXPREC_ATTN_DECODE_IMPL")
            if impl:  # read at launch, i.e. when the graph is captured
                os.environ["MIXPREC_ATTN_DECODE_IMPL"] = impl
            try:
                decode_attention(shape.q, cache, layout, shape.block_table, shape.seq_lens,
                                 shape.qsl, out, shape.scale, shape.batch, run.splits, part_o,
                                 part_lse, res, merge_counters=counters)
            finally:
                if impl:
                    os.environ.pop("MIXPREC_ATTN_DECODE_IMPL")
                    if saved is not None:
                        os.environ["MIXPREC_ATTN_DECODE_IMPL"] = saved
    run.splits = splits or decode_num_splits(shape.batch, HKV)  # --tune changes it
    run.directory = directory
    return [write], run, out


def setup(method: str, shape: Shape, **kw):
    if method == "fa3-bf16":
        return setup_fa3(shape)
    if method.startswith("triton-"):
        return setup_triton(shape, {"triton-int4": "int4_per_token_head",
                                    "triton-int8": "int8_per_token_head"}[method])
    method, impl = split_impl(method)
    if impl:
        kw["impl"] = impl
    scheme = "kv4" if "kv4" in method else "kv8"
    chunk = {"exact": "triton", "flash": "flash", "gather": "gather"}.get(
        method.rsplit("-", 1)[-1])
    return setup_mixprec(shape, scheme, 16 if method.endswith("-r16") else 0, chunk=chunk, **kw)


# --- timing ----------------------------------------------------------------------------

def time_graph(fn, rep_ms: int) -> float:
    """Median ms of one replay of a CUDA graph holding fn (L2 flushed by do_bench)."""
    import torch
    import triton
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile / autotune outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def run_shape(shape: Shape, methods, rep_ms: int) -> list[dict]:
    import torch
    built = {m: setup(m, shape) for m in methods}
    for chunk in shape.chunks():
        for writers, _, _ in built.values():
            for w in writers:
                w(*chunk)
    torch.cuda.synchronize()
    rows = []
    for m, (_, run, out) in built.items():
        ms = time_graph(run, rep_ms)
        row = dict(batch=shape.batch, ctx=shape.ctx, q_len=shape.q_len, method=m, ms=ms)
        if shape.q_len == 1:
            row["gb_per_s"] = (shape.batch * shape.ctx * HKV * BYTES_PER_TOKEN_HEAD[split_impl(m)[0]]
                               / ms / 1e6)
        else:
            row["tflop_per_s"] = shape.attention_flops() / ms / 1e9
        rows.append(row)
    ref = built.get("fa3-bf16")
    for r in rows:
        if ref is not None:
            r["rel_err_vs_fa3"] = rel_err(built[r["method"]][2], ref[2])
            fa = next(x["ms"] for x in rows if x["method"] == "fa3-bf16")
            r["speedup_vs_fa3"] = fa / r["ms"]
        directory = getattr(built[r["method"]][1], "directory", None)
        if directory is not None:  # per-step host+device cost of the residual bookkeeping
            sm = torch.full((shape.batch,), -1, device="cuda")
            for key, graphed, kernel in (("residual_assign_eager_us", False, False),
                                         ("residual_assign_us", True, False),
                                         ("residual_assign_kernel_us", True, True)):
                directory.kernel = kernel  # the one-program Triton update (residual_directory.py)
                for _ in range(2):  # a graphed shape's first call runs eagerly, its second captures
                    directory.assign(shape.block_table, shape.seq_lens, shape.qsl, sm, shape.batch,
                                     decode_only=graphed)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    directory.assign(shape.block_table, shape.seq_lens, shape.qsl, sm, shape.batch,
                                     decode_only=graphed)
                torch.cuda.synchronize()
                r[key] = (time.perf_counter() - t0) / 20 * 1e6
            directory.kernel = False
    del built
    torch.cuda.empty_cache()
    return rows


def _time_config(run, env: dict[str, str], label: str) -> float | None:
    """Median ms of `run` with the tuning variables `env` set (removed afterwards); None
    (printed) when the config cannot run, e.g. out of shared memory for big tiles."""
    os.environ.update(env)
    try:
        ms = time_graph(run, 30)
    except Exception as e:  # noqa: BLE001
        print(f"  {label}: {type(e).__name__}: {e}")
        return None
    finally:
        for k in env:
            os.environ.pop(k, None)
    print(f"  {label}: {ms:.4f} ms")
    return ms


def _best(results: list[dict], key: tuple) -> None:
    best = min((r for r in results if r["shape"] == key), key=lambda r: r["ms"], default=None)
    print(f"best for {key}: {best}")


def tune(args) -> list[dict]:
    """Sweep (BLOCK_N, warps, stages) x splits of the KV4 decode kernel on two shapes
    (one cache per shape; each config compiles once)."""
    from vllm_mixprec.kernels.triton.attention import decode_num_splits
    results = []
    for batch, ctx in ((64, 8192), (1, 32768)):
        shape = Shape(batch, ctx, args.seed)
        writers, run, _ = setup_mixprec(shape, "kv4")
        for chunk in shape.chunks():
            writers[0](*chunk)
        base = decode_num_splits(batch, HKV)
        for splits in sorted({max(1, base // 2), base, base * 2}):
            run.splits = splits
            # (BLOCK_N, warps, stages, register cap; 0 = none): the grid, then register caps
            # on the occupancy-limited tiles (attention.decode_maxnreg)
            cfgs = [(bn, w, s, 0) for bn in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3)]
            cfgs += [(128, 2, 2, r) for r in (128, 168)] + [(128, 4, 2, 128), (64, 2, 2, 128)]
            for cfg in cfgs:
                ms = _time_config(run, {"MIXPREC_ATTN_DECODE_CFG": ",".join(map(str, cfg[:3])),
                                        "MIXPREC_ATTN_DECODE_MAXNREG": str(cfg[3])},
                                  f"{batch}x{ctx} splits={splits} BLOCK_N,warps,stages,maxnreg={cfg}")
                if ms is not None:
                    results.append(dict(shape=(batch, ctx), batch=batch, ctx=ctx, splits=splits,
                                        cfg=cfg, ms=ms))
        _best(results, (batch, ctx))
    return results


def tune_prefill(args) -> list[dict]:
    """Sweep (BLOCK_M query tokens, BLOCK_N, warps, stages) of the prefill kernel's page part
    (MIXPREC_ATTN_PREFILL_CFG), as the backend runs it by default (the chunk by
    FlashAttention, the cached context merged by our kernel), on the two context-bound
    PREFILL_GRID shapes, KV4 and KV8."""
    results = []
    for batch, ctx, q_len in ((4, 8192, 1024), (16, 4096, 512)):
        shape = Shape(batch, ctx, args.seed, q_len)
        built = {m: setup(m, shape) for m in ("mixprec-kv4-flash", "mixprec-kv8-flash")}
        for chunk in shape.chunks():
            for writers, _, _ in built.values():
                writers[0](*chunk)
        for method, (_, run, _) in built.items():
            key = (batch, ctx, q_len, method)
            for cfg in [(bm, bn, w, s) for bm in (16, 32) for bn in (32, 64, 128)
                        for w in (4, 8) for s in (2, 3)]:
                ms = _time_config(run, {"MIXPREC_ATTN_PREFILL_CFG": ",".join(map(str, cfg))},
                                  f"{key} BLOCK_M,BLOCK_N,warps,stages={cfg}")
                if ms is not None:
                    results.append(dict(shape=key, batch=batch, ctx=ctx, q_len=q_len,
                                        method=method, cfg=cfg, ms=ms,
                                        tflop_per_s=shape.attention_flops() / ms / 1e9))
            _best(results, key)
        del built
    return results


# --- reporting ---------------------------------------------------------------------------

def print_table(rows):
    hdr = (f"{'batch':>5} {'ctx':>6} {'q_len':>5} {'method':<18} {'ms':>9} {'GB/s|TF/s':>9} "
           f"{'x FA3':>6} {'relerr':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        rate = r.get("gb_per_s", r.get("tflop_per_s", float("nan")))
        print(f"{r['batch']:>5} {r['ctx']:>6} {r.get('q_len', 1):>5} {r['method']:<18} "
              f"{r['ms']:>9.4f} {rate:>9.0f} {r.get('speedup_vs_fa3', float('nan')):>6.2f} "
              f"{r.get('rel_err_vs_fa3', float('nan')):>7.4f}")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    ctxs = sorted({r["ctx"] for r in rows})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["batch"], r["ms"]) for r in rows
                         if r["ctx"] == ctx and r["method"] == m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="ms / decode step (1 layer)",
               title=f"context {ctx}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    import triton
    import vllm
    torch.manual_seed(args.seed)
    dev = torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    tag = dev.replace(" ", "_").replace("/", "_")
    meta = dict(device=dev, capability=list(torch.cuda.get_device_capability()),
                torch=torch.__version__, triton=triton.__version__, vllm=vllm.__version__,
                shape=dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=B),
                timing="CUDA graph replay, triton.testing.do_bench median, L2 flushed")
    def write(name, results):
        path = os.path.join(args.out, f"{name}-{tag}.json")
        with open(path, "w") as f:
            json.dump(dict(meta, results=results), f, indent=1)
        print(f"wrote {path}")

    if args.tune:
        write("attention-tune", tune(args))
        return
    if args.tune_prefill:
        write("attention-tune-prefill", tune_prefill(args))
        return
    rows = []
    if args.prefill:
        for batch, ctx, q_len in PREFILL_GRID:
            rows += run_shape(Shape(batch, ctx, args.seed, q_len), args.methods, args.rep_ms)
            print_table(rows[-len(args.methods):])
    else:
        from vllm.config import VllmConfig, set_current_vllm_config
        with set_current_vllm_config(VllmConfig()):  # TRITON_ATTN reads the KV layout from it
            for ctx in args.ctx:
                for batch in args.batch:
                    rows += run_shape(Shape(batch, ctx, args.seed), args.methods, args.rep_ms)
                    print_table(rows[-len(args.methods):])
    print()
    print_table(rows)
    write("attention-prefill" if args.prefill else "attention", rows)
    if not args.prefill:
        plot(rows, os.path.join(args.out, f"attention-{tag}.png"))


if __name__ == "__main__":
    main()
