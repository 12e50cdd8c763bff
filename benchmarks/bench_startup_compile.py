#!/usr/bin/env python
"""What the decode kernels' Triton compiles cost a server's start, with and without the
parallel precompile (kernels/triton/precompile.py; docs/STARTUP.md).

One process per mode, each with a fresh, empty TRITON_CACHE_DIR (a cold host):
  sequential  every batch size vLLM captures (512 .. 1, descending, as the FULL decode capture
              runs them) launches the residual-directory update and decode attention once:
              each new variant compiles at its first launch, one after another, as before;
  parallel    precompile_residual_assign and precompile_decode for 1..max_num_seqs rows
              first (what the backend now does at its first step), then the same launches.
Shapes: Llama-3-8B attention (32/8 heads, D 128), KV4, bf16, 16-token residual window,
SmoothAttention scales, max_num_seqs 1024 (vLLM 0.26's default on an 80 GB GPU), max_model_len
2048. Records the wall time of each phase and how many variants each kernel compiled.

  python benchmarks/bench_startup_compile.py --out DIR     # both modes, one subprocess each
Writes DIR/startup-compile.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HQ, HKV, D, B, RES, MAX_SEQS, MAX_LEN = 32, 8, 128, 16, 16, 1024, 2048


def capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM 0.26's cudagraph capture sizes for max_num_seqs 1024: 1, 2, 4, 8..256 step 8,
    272..512 step 16 (docs/STARTUP.md), largest first as the capture runs them."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_size + 1, 16))
    return sorted(sizes, reverse=True)


def run_mode(mode: str) -> dict:
    import torch

    from vllm_mixprec import formats as F
    from vllm_mixprec.attention_backend import residual as R
    from vllm_mixprec.kernels.triton import attention as A
    from vllm_mixprec.kernels.triton import residual_directory as RD
    from vllm_mixprec.kernels.triton.kv_cache import KVResidual

    dev = torch.device("cuda")
    torch.manual_seed(0)
    layout = F.KVPageLayout("kv4", D, B)
    width = MAX_LEN // B
    num_blocks = MAX_SEQS * 4
    cache = torch.randint(0, 255, layout.cache_shape(num_blocks, HKV), dtype=torch.uint8,
                          device=dev).view(layout.storage_dtype())
    n_max = MAX_SEQS
    block_table = torch.randint(0, num_blocks, (n_max, width), dtype=torch.int32, device=dev)
    seq_lens = torch.full((n_max,), 1, dtype=torch.int32, device=dev)
    qsl = torch.arange(n_max + 1, dtype=torch.int32, device=dev)
    slot_mapping = torch.arange(n_max, dtype=torch.int64, device=dev)
    qkv = torch.randn(n_max, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device=dev)
    q = qkv[:, :HQ * D].view(n_max, HQ, D)  # a view of the fused projection, as served
    out = torch.empty(n_max, HQ, D, dtype=torch.bfloat16, device=dev)
    k_smooth = torch.rand(HKV, D, device=dev) + 0.5
    slots = MAX_SEQS * R.window_blocks(RES, B) + max(16, MAX_SEQS // 4)  # residual_slots
    directory = R.ResidualDirectory(num_blocks, slots, B, RES, dev, kernel=True)
    pool_k, pool_v = R.allocate_pool(slots * B, HKV, D, torch.bfloat16, dev)
    residual = KVResidual(pool_k, pool_v, directory.slot_of_block, directory.tags, RES)
    parts = A.decode_partials_rows(MAX_SEQS, HKV)
    part_o = torch.empty(parts, HQ, D, dtype=torch.float32, device=dev)
    part_lse = torch.empty(parts, HQ, dtype=torch.float32, device=dev)
    counters = A.decode_merge_counters(MAX_SEQS, HKV, dev)
    scratch = torch.empty(RD.scratch_size(MAX_SEQS * directory.bpw, slots), dtype=torch.int64,
                          device=dev)
    sms = A._num_sms(dev.index or 0)
    torch.cuda.synchronize()

    def size(k):
        return len(k.device_caches[torch.cuda.current_device()][0]) if k.device_caches else 0

    kernels = {"page": A._paged_attn_kernel, "finish": A._decode_finish_kernel,
               "assign": RD._residual_assign_kernel}
    res = {"mode": mode, "device": torch.cuda.get_device_name(), "sms": sms,
           "cpu_count": os.cpu_count()}
    dargs = (block_table, seq_lens, qsl, slot_mapping, directory.slot_of_block,
             directory.block_of_slot, directory.last_use, directory.tags, directory.step,
             scratch, RES, directory.bpw)
    if mode == "parallel":
        t0 = time.perf_counter()
        res["assign_compiled"] = RD.precompile_residual_assign(*dargs, MAX_SEQS)
        t1 = time.perf_counter()
        res["decode_compiled"] = A.precompile_decode(
            q, cache, layout, block_table, seq_lens, qsl, out, D ** -0.5, MAX_SEQS, part_o,
            part_lse, residual, k_smooth, None, counters)
        t2 = time.perf_counter()
        res["precompile_assign_s"], res["precompile_decode_s"] = t1 - t0, t2 - t1
        res["after_precompile"] = {k: size(v) for k, v in kernels.items()}
    t0 = time.perf_counter()
    for n in capture_sizes():
        RD.residual_assign(block_table[:n], seq_lens[:n], qsl[:n + 1], slot_mapping[:n],
                           *dargs[4:])
        A.decode_attention(q[:n], cache, layout, block_table[:n], seq_lens[:n], qsl[:n + 1],
                           out, D ** -0.5, n, A.decode_splits(n, HKV, sms, parts), part_o,
                           part_lse, residual, k_smooth, None, counters)
    torch.cuda.synchronize()
    res["launch_loop_s"] = time.perf_counter() - t0
    res["variants"] = {k: size(v) for k, v in kernels.items()}
    res["total_s"] = res["launch_loop_s"] + res.get("precompile_assign_s", 0) + \
        res.get("precompile_decode_s", 0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--mode", choices=["sequential", "parallel"],
                    help="run one mode in this process (the driver starts one per mode)")
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode)))
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for mode in ("sequential", "parallel"):
        with tempfile.TemporaryDirectory(prefix="triton-cold-") as cache_dir:
            env = {**os.environ, "TRITON_CACHE_DIR": cache_dir}
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, "--mode", mode], env=env,
                               capture_output=True, text=True)
            if p.returncode:
                sys.stderr.write(p.stdout + p.stderr)
                raise SystemExit(f"{mode}: exit status {p.returncode}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["process_s"] = time.perf_counter() - t0
            results.append(r)
    with open(os.path.join(args.out, "startup-compile.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"{'mode':<11} {'precompile s':>13} {'launch loop s':>14} {'total s':>8}  variants")
    for r in results:
        pre = r.get("precompile_assign_s", 0) + r.get("precompile_decode_s", 0)
        print(f"{r['mode']:<11} {pre:>13.1f} {r['launch_loop_s']:>14.1f} {r['total_s']:>8.1f}  "
              f"{r['variants']}")


if __name__ == "__main__":
    main()
