#!/usr/bin/env python3
"""Registers and spills of every tile that `bench_gemm.py --sweep` times for the Triton W4A8 GEMM
(`_lqq_gemm_kernel`), read from ptxas without a GPU (scripts/triton_aot.py). The GPU sweep
(`gpu_check.sh triton_tiles`) says which tile is fastest; this says which ones spill, so that its
table can be read (benchmarks/NOTES-gemm.md, "Tile choices").

  python scripts/triton_gemm_tiles.py [--arch 90 80] [--ms 16 256] [--w4ax] [--json PATH]

TRITON_INTERPRET must be unset (the interpreter does not compile).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "benchmarks"), os.path.join(HERE, "..")]

PTRS = {"x8_ptr": "*i8", "s8_ptr": "*fp32", "x4_ptr": "*i32", "s4_ptr": "*fp32", "qw_ptr": "*i32",
        "gs_ptr": "*u8", "go_ptr": "*u8", "cs_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16",
        "ws_ptr": "*i32", "cnt_ptr": "*i32"}


def tile_usage(config, arch: int, w4ax: bool = False, group: int = 64) -> dict:
    """ptxas's registers and spill stores (bytes a thread) of one GemmConfig."""
    from triton_aot import compile_kernel, ptxas_usage
    from vllm_mixprec.kernels.triton import gemm as G

    # split_k 0 (the sweep's "the rule decides") compiles as one split
    consts = dict(G=group, HAS_A4=w4ax, BLOCK_SCALES=w4ax, HAS_BIAS=False, BM=config.block_m,
                  BN=config.block_n, BK=min(config.block_k, 128) if w4ax else config.block_k,
                  SPLIT_K=max(1, config.split_k), SWAP_AB=config.swap_ab, GROUP_M=config.group_m,
                  USE_ASM=True)
    kern = compile_kernel(G._lqq_gemm_kernel, PTRS, consts, arch, num_warps=config.num_warps,
                          num_stages=config.num_stages)
    regs, spill = ptxas_usage(kern, arch)
    return {"config": dataclasses.asdict(config), "arch": arch, "group": group, "registers": regs,
            "spill_bytes": spill, "shared_bytes": kern.metadata.shared}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    p.add_argument("--ms", type=int, nargs="+", default=[256],
                   help="M values whose sweep tiles to compile (M > 64: the large-M tiles)")
    p.add_argument("--w4ax", action="store_true", help="the W4Ax variant (per-block scales, int4 words)")
    p.add_argument("--group", type=int, nargs="+", default=[64, 128], help="weight group sizes")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    from bench_gemm import sweep_configs

    rows = []
    print(f"{'arch':>4} {'G':>4} {'BM':>4} {'BN':>4} {'BK':>4} {'swap':>5} {'warps':>5} {'stages':>6} "
          f"{'regs':>5} {'spill B':>8} {'smem KB':>8}")
    for m in args.ms:
        for c in dict.fromkeys(sweep_configs(m)):
            for arch in args.arch:
                for group in args.group:
                    r = tile_usage(c, arch, args.w4ax, group)
                    rows.append(dict(r, m=m))
                    print(f"{arch:>4} {group:>4} {c.block_m:>4} {c.block_n:>4} {c.block_k:>4} "
                          f"{str(c.swap_ab):>5} {c.num_warps:>5} {c.num_stages:>6} {r['registers']:>5} "
                          f"{r['spill_bytes']:>8} {r['shared_bytes'] / 1024:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
