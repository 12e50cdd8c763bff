#!/usr/bin/env python3
"""The Triton quantize_act (and silu_mul_quantize_act) with rows split over programs (two passes,
split_rows) against one program a row, in one run: CUDA-graph medians (do_bench_cudagraph), the
outputs of both forms compared bit for bit first.

  python scripts/bench_triton_quantize_act.py --out DIR [--ks 4096 14336] [--ms 1 16 512]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--ks", type=int, nargs="+", default=[4096, 8192, 14336, 28672])
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 256, 512, 1024])
    p.add_argument("--rep-ms", type=int, default=25)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from vllm_mixprec.kernels.triton import gemm as tg

    rule = tg.split_rows
    report = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "split_rows_max_m": tg.SPLIT_ROWS_MAX_M, "split_rows_max_m_plain": tg.SPLIT_ROWS_MAX_M_PLAIN,
              "split_rows_min_values": tg.SPLIT_ROWS_MIN_VALUES, "split_rows_block": tg.SPLIT_ROWS_BLOCK,
              "timing": "CUDA-graph replays, median, us", "rows": []}
    torch.manual_seed(0)
    for op_name, op, gated in (("quantize_act", tg.quantize_act, False),
                               ("silu_mul_quantize_act", tg.silu_mul_quantize_act, True)):
        for k in args.ks:
            for m in args.ms:
                x = torch.randn(m, (1 + gated) * k, device="cuda", dtype=torch.bfloat16) * 3
                row = {"op": op_name, "K": k, "M": m}
                outs = {}
                for form in ("split", "one_program"):
                    tg.split_rows = lambda *a, forced=form == "split", **kw: forced  # read at each call
                    outs[form] = op(x)
                    row[form + "_us"] = 1e3 * triton.testing.do_bench_cudagraph(
                        lambda: op(x), rep=args.rep_ms, return_mode="median")
                tg.split_rows = rule
                row["bit_exact"] = all(torch.equal(a.nan_to_num(-1), b.nan_to_num(-1))
                                       for a, b in zip(outs["split"], outs["one_program"]))
                row["default"] = "split" if rule(m, k, gated) else "one_program"
                row["one_program_over_split"] = row["one_program_us"] / row["split_us"]
                report["rows"].append(row)
                print(f"{op_name:22s} K={k:6d} M={m:5d} split {row['split_us']:7.2f} us  one program "
                      f"{row['one_program_us']:7.2f} us  x{row['one_program_over_split']:.2f}  "
                      f"default {row['default']}  bit-exact {row['bit_exact']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_triton_quantize_act.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", path)
    return 0 if all(r["bit_exact"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
