"""Time the csrc W4A8 GEMM (every kernel variant that applies) against Marlin W4A16, on the GPU host.

  python scripts/bench_w4a8_cuda.py [--full] [--no-marlin] [--out $OUT/bench_w4a8_cuda.json]

Median of triton.testing.do_bench_cudagraph: each variant is captured in a CUDA graph, so
small shapes are timed on the GPU, not on the launch path (--no-graph: plain do_bench, the way
/work/shared/baselines/marlin_bench.py timed the baselines). Shapes whose weights fit in L2 rotate over several weight copies. Prints a table
last: time in us, achieved weight-stream bandwidth, and speed-up over Marlin W4A16.
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_mixprec.kernels import cuda

DEV = "cuda"
L2_BYTES = 50 * 2 ** 20


def lqq(n, k, g, gen):
    q = torch.randint(0, 16, (n, k // 2), generator=gen, device=DEV, dtype=torch.int32)
    qw = (q | (torch.randint(0, 16, (n, k // 2), generator=gen, device=DEV, dtype=torch.int32) << 4)).to(torch.uint8)
    s = torch.randint(1, 17, (n, k // g), generator=gen, device=DEV, dtype=torch.int32)
    a = torch.minimum(9 + (torch.rand((n, k // g), generator=gen, device=DEV) * 100).to(torch.int32), 255 - 15 * s)
    cs = torch.rand(n, generator=gen, device=DEV) * 1e-3 + 1e-4
    return qw, s.to(torch.uint8), a.to(torch.uint8), cs


USE_GRAPHS = True
DECODE_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)  # --splits-sweep, decode kernels 0 and 1
# --option-ab: launch option -> (JSON key tag, values timed in this order, largest M it acts on or
# None, what it changes: "gemm" (timed: the plan, the GEMM, the linear) or "quant" (quantize_act,
# the linear)). A value timed again (A-B-A) gets keys ending in "_again".
OPTION_AB = {"decode_ctas_per_sm": ("c", (0, 2), 32, "gemm"),
             "decode_preload_max_m": ("pre", (0, 8, 16, 32), 32, "gemm"),
             "act_quant_one_pass": ("op", (0, 1), None, "quant"),
             "act_quant_lean": ("ql", (0, 1), None, "quant"),
             "gemm_cluster_pair": ("cp", (0, 1), None, "gemm"),
             "gemm_pdl": ("pdl", (0, 1), None, "gemm"),
             "decode_dp4a": ("d4", (0, 1, 0), 1, "gemm"),
             "act_quant_split": ("qs", (0, 1024, 2048, 4096, 1, 0), 64, "quant"),
             "quant_ops_pdl": ("qp", (0, 1, 0), None, "quant")}


def bench(fn):
    if USE_GRAPHS:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3  # us
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def each_option(option, values):
    """Sets one csrc launch option to each value in turn (the others as they are), yielding the
    value; restores every option after."""
    defaults = cuda.set_launch_options()
    try:
        for value in values:
            cuda.set_launch_options(**{option: value})
            yield value
    finally:
        cuda.set_launch_options(**defaults)


def marlin_setup(k, n):
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        apply_gptq_marlin_linear, marlin_make_empty_g_idx, marlin_make_workspace_new)
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
    from vllm.scalar_type import scalar_types
    w = torch.randn(k, n, dtype=torch.half, device=DEV)
    _, q_w, s, g_idx, sort_idx, _ = marlin_quantize(w, scalar_types.uint4b8, 128, False)
    ws = marlin_make_workspace_new(w.device)
    empty = marlin_make_empty_g_idx(w.device)

    def run(x):
        return apply_gptq_marlin_linear(x, q_w, s, empty, g_idx, sort_idx, ws, scalar_types.uint4b8, n, k,
                                        is_k_full=True)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="all shapes (default: the 70B up-projection only)")
    ap.add_argument("--no-marlin", action="store_true")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128, 256, 1024, 4096])
    ap.add_argument("--no-graph", action="store_true", help="time with do_bench instead of CUDA graphs")
    ap.add_argument("--splits-sweep", action="store_true",
                    help="also time the decode kernels (0, 1) at M <= 32 with 1..16 K splits, and the "
                         "wgmma kernels 4, 5, 6 at M >= 64 with 1, 2, 4 splits (the wgmma tile/split heuristic)")
    ap.add_argument("--decode-options-sweep", action="store_true",
                    help="M <= 32: the decode GEMMs (auto, kernels 0 and 1) and the linear under each of "
                         "decode_u8 0, 1 x decode_ctas_per_sm 2, 3 (3 at M <= 16 only), all in this "
                         "run; with --splits-sweep also kernels 0 and 1 x DECODE_SPLITS under each "
                         "(csrc/gemm/NOTES.md 'Decode u8', 'Decode occupancy')")
    ap.add_argument("--option-ab", nargs="+", choices=sorted(OPTION_AB), default=[], metavar="OPTION",
                    help="also the linear, and the plan and the auto GEMM (back to back) or quantize_act, "
                         "whichever the option changes, under each value of these launch options, this run, at "
                         "the M each acts on: decode_ctas_per_sm 0 "
                         "(the planner's build) and 2 (the plan before session 36), M <= 32; decode_preload_max_m "
                         "0 (never), 8, 16 (M = 9-16: the 3-CTA build only) and 32 (every M), M <= 32; "
                         "act_quant_one_pass 0 (the two-pass loop) and 1; act_quant_lean 0 (the one-pass "
                         "kernel's per-element division) and 1; decode_dp4a 0, 1, 0 again (IDP.4A on the codes), "
                         "M = 1; quant_ops_pdl 0, 1, 0 again (the quantizer a programmatic dependent)")
    ap.add_argument("--cublas-gemv", action="store_true",
                    help="M <= 32: also cuBLAS bf16 on the same shape (the weight's N x K bf16, >= 2x the L2), "
                         "the HBM bandwidth a GEMV reaches on this GPU (cublas_bf16_TBps)")
    ap.add_argument("--launch-sweep", action="store_true",
                    help="also time quantize_act, the linear (quantize_act + auto GEMM) and back-to-back "
                         "GEMMs with gemm_pdl and act_quant_one_pass off and on (cuda.set_launch_options), "
                         "all in this run")
    ap.add_argument("--stream-k-sweep", action="store_true",
                    help="at M >= 64: each auto wgmma kernel (4, 5, 7, 8) as the classic planner splits it "
                         "and as a stream-K launch (splits=-1), and the auto GEMM and linear with the "
                         "planner's stream-K option off and on, all in this run (csrc/gemm/NOTES.md, 'Stream-K')")
    ap.add_argument("--sk-kernels", type=int, nargs="*", default=[4, 5, 7, 8], metavar="K",
                    help="--stream-k-sweep: the wgmma kernels to time one by one (none: the auto plans only)")
    ap.add_argument("--kernels", type=int, nargs="+", metavar="K",
                    help="time the auto pick and these kernel ids (the planner's splits) instead of the "
                         "default forced variants, at every M, e.g. wgmma kernels 5 and 8 at M >= 64")
    ap.add_argument("--pair", action="store_true",
                    help="at M >= 64 also time each wgmma kernel (--kernels, or 4, 5, 7, 8) as a cluster pair "
                         "(splits=-2: two K halves a tile, summed in shared memory)")
    ap.add_argument("--auto-only", action="store_true",
                    help="time only the auto-selected GEMM (no forced mma.sync variants) and the linear")
    ap.add_argument("--quant-only", action="store_true",
                    help="time only quantize_act (bf16 rows of each shape's K), under each value of --option-ab's "
                         "quantizer options, with its bytes moved per second; no weights, no GEMMs")
    ap.add_argument("--shapes", nargs="+", metavar="KxN",
                    help="K x N shapes to time instead of the default/--full set, e.g. 4096x6144")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "bench_w4a8_cuda.json"))
    args = ap.parse_args()
    global USE_GRAPHS
    USE_GRAPHS = not args.no_graph
    assert cuda.available(), cuda.load_error()
    shapes = [(8192, 28672)]  # (K, N)
    if args.full:
        shapes += [(4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096), (28672, 8192)]
    if args.shapes:
        try:
            shapes = [tuple(int(v) for v in sh.lower().split("x")) for sh in args.shapes]
        except ValueError:
            ap.error(f"--shapes: expected KxN integers, got {args.shapes}")
        if any(len(sh) != 2 for sh in shapes):
            ap.error(f"--shapes: expected KxN, got {args.shapes}")
    if any(k not in cuda.WGMMA_KERNELS for k in args.sk_kernels):
        ap.error(f"--sk-kernels: the wgmma kernels are {sorted(cuda.WGMMA_KERNELS)}, got {args.sk_kernels}")
    ms = args.ms
    out = os.path.join(args.out, "bench_w4a8_cuda.json") if os.path.isdir(args.out) else args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    gen = torch.Generator(device=DEV).manual_seed(0)
    if args.quant_only:
        return quant_only(sorted({k for k, _ in shapes}), ms, args.option_ab, out, gen)
    rows = []
    for k, n in shapes:
        g = args.group
        weight_bytes = n * k // 2 + n * (k // g) * 2
        copies = max(1, -(-4 * L2_BYTES // weight_bytes))
        layers = []
        for _ in range(copies):
            qw, gs, go, cs = lqq(n, k, g, gen)
            pq, gp = cuda.repack_w4a8(qw, gs, go)
            layers.append((pq, gp, cs))
        marlin = None
        if not args.no_marlin:
            try:
                marlin = marlin_setup(k, n)
            except Exception as e:  # noqa: BLE001
                print("marlin unavailable:", repr(e)[:200])
        # no bf16 copies to rotate: one N x K bf16 weight of >= 2x the L2 streams from HBM
        bf16_weight = (torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen)
                       if args.cublas_gemv and n * k * 2 >= 2 * L2_BYTES else None)
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.float16)
            xq, xs = cuda.quantize_act(x)
            # where the auto GEMM is a wgmma kernel, the linear quantizes into the wgmma k order
            x_order = cuda.x_wgmma_order_for(m, n, k)
            decode_forced = m <= 32 and not args.decode_options_sweep  # that sweep times kernels 0, 1 itself
            tiled_forced = not (m <= 32 and (args.launch_sweep or args.decode_options_sweep))
            variants = [-1] + ([0, 1] if decode_forced else []) + ([2, 3] if tiled_forced else [])
            if (args.stream_k_sweep and m >= 64) or args.auto_only:
                variants = [-1]  # (the stream-K sweep times its own variants; the mma.sync tiles never win there)
            if args.kernels:
                variants = [-1] + args.kernels
            row = {"K": k, "N": n, "M": m, "G": g, "device": torch.cuda.get_device_name()}
            it = {"i": 0}

            def gemm(kernel, splits=0, x_wgmma=None):  # x_wgmma: codes in the wgmma k order
                pq, gp, cs = layers[it["i"] % copies]
                it["i"] += 1
                if x_wgmma is not None:
                    return torch.ops.mixprec_C.w4a8_gemm(x_wgmma, xs, pq, gp, cs, None, torch.float16, kernel,
                                                         splits, True)
                return torch.ops.mixprec_C.w4a8_gemm(xq, xs, pq, gp, cs, None, torch.float16, kernel, splits)

            sms = torch.cuda.get_device_properties(0).multi_processor_count

            def plan(kernel, wgmma):  # what the op launches: [kernel, splits, decode build]
                return list(torch.ops.mixprec_C.w4a8_plan(m, n, k, g, sms, kernel, 0, wgmma))

            row["plan_auto"] = plan(-1, cuda.auto_gemm_kernel_family(m, n, k) == "wgmma")  # what gemm_k-1 times
            for kernel in variants:
                row[f"gemm_k{kernel}_us"] = bench(lambda: gemm(kernel))
            if x_order:  # the auto plan on x in the wgmma k order (by TMA), against gemm_k-1 (cp.async)
                xw = cuda.quantize_act(x, None, True)[0]
                row["gemm_k-1_xw_us"] = bench(lambda: gemm(-1, 0, xw))
            if args.pair and m >= 64 and cuda.has_wgmma():  # two K halves a tile in a cluster of 2
                for kernel in args.kernels or (4, 5, 7, 8):
                    row[f"gemm_k{kernel}_pair_us"] = bench(lambda: gemm(kernel, -2))
            if args.splits_sweep and m <= 32 and not args.decode_options_sweep:  # the decode kernels' range
                for kernel in (0, 1):
                    for splits in DECODE_SPLITS:
                        if splits <= k // 64:  # the op clamps to the chunk count
                            row[f"gemm_k{kernel}_s{splits}_us"] = bench(lambda: gemm(kernel, splits))
            if args.splits_sweep and m >= 64 and cuda.has_wgmma():  # every wgmma tile x split count
                for kernel in cuda.WGMMA_KERNELS:
                    for splits in (1, 2, 4):
                        row[f"gemm_k{kernel}_s{splits}_us"] = bench(lambda: gemm(kernel, splits))
            if args.stream_k_sweep and m >= 64 and cuda.has_wgmma():
                for sk in each_option("gemm_stream_k", (0, 1)):
                    row[f"plan_auto_sk{sk}"] = plan(-1, True)
                    row[f"gemm_auto_sk{sk}_us"] = bench(lambda: gemm(-1))
                for _ in each_option("gemm_stream_k", (0,)):
                    for kernel in args.sk_kernels:
                        row[f"plan_k{kernel}"] = plan(kernel, True)
                        row[f"gemm_k{kernel}_planned_us"] = bench(lambda: gemm(kernel))
                        row[f"gemm_k{kernel}_sk_us"] = bench(lambda: gemm(kernel, -1))
            row["quantize_act_us"] = bench(lambda: cuda.quantize_act(x))

            def linear(order=x_order):  # what the layer runs: quantize, then the auto-selected GEMM
                xq2, xs2 = cuda.quantize_act(x, None, order)
                pq, gp, cs = layers[it["i"] % copies]
                it["i"] += 1
                return torch.ops.mixprec_C.w4a8_gemm(xq2, xs2, pq, gp, cs, None, torch.float16, -1, 0, order)

            row["linear_auto_us"] = bench(linear)
            if x_order:
                row["linear_natural_us"] = bench(lambda: linear(False))
            if args.stream_k_sweep and m >= 64 and cuda.has_wgmma():
                for sk in each_option("gemm_stream_k", (0, 1)):
                    row[f"linear_sk{sk}_us"] = bench(linear)
            if args.decode_options_sweep and m <= 32:  # the decode GEMM and the linear under each build, this run
                row["plan_auto"] = plan(-1, False)
                for u8 in each_option("decode_u8", (0, 1)):
                    # the 3-CTA build covers M <= 16 only
                    for ctas in each_option("decode_ctas_per_sm", (2, 3) if m <= 16 else (2,)):
                        tag = f"u8{u8}_c{ctas}"
                        for kernel in (-1, 0, 1):
                            row[f"gemm_k{kernel}_{tag}_us"] = bench(lambda: gemm(kernel))
                        row[f"linear_{tag}_us"] = bench(linear)
                        for kernel in (0, 1) if args.splits_sweep else ():
                            for splits in DECODE_SPLITS:
                                if splits <= k // 64:
                                    row[f"gemm_k{kernel}_s{splits}_{tag}_us"] = bench(lambda: gemm(kernel, splits))
            for option in args.option_ab:
                tag, values, max_m, changes = OPTION_AB[option]
                if max_m is not None and m > max_m:
                    continue
                for i, value in enumerate(each_option(option, values)):
                    key = f"{tag}{value}" + ("_again" if value in values[:i] else "")  # A-B-A: the repeat's own key
                    if changes == "quant":
                        row[f"quantize_act_{key}_us"] = bench(lambda: cuda.quantize_act(x))
                    else:
                        row[f"plan_{key}"] = plan(-1, cuda.auto_gemm_kernel_family(m, n, k) == "wgmma")
                        row[f"gemm_auto_{key}_us"] = bench(lambda: gemm(-1))
                    row[f"linear_{key}_us"] = bench(linear)
            if bf16_weight is not None and m <= 32:  # cuBLAS streaming the bf16 weight: the HBM a GEMV reaches here
                xb = x.to(torch.bfloat16)
                row["cublas_bf16_us"] = bench(lambda: xb @ bf16_weight.t())
                row["cublas_bf16_TBps"] = n * k * 2 / (row["cublas_bf16_us"] * 1e-6) / 1e12
            # (Session 24 also swept an L2 prefetch of the weights before the GEMM's wait and a cluster
            # of CTAs per quantizer row: both removed, csrc/gemm/NOTES.md "PDL".)
            if args.launch_sweep:  # every M: the wgmma kernels (M >= 64) are dependents too since session 31
                for one_pass in each_option("act_quant_one_pass", (0, 1)):
                    row[f"quantize_act_op{one_pass}_us"] = bench(lambda: cuda.quantize_act(x))
                for pdl in each_option("gemm_pdl", (0, 1)):  # (0, 0) is the launch before session 24
                    for one_pass in each_option("act_quant_one_pass", (0, 1)):
                        row[f"linear_pdl{pdl}_op{one_pass}_us"] = bench(linear)
                for pdl in each_option("gemm_pdl", (0, 1)):  # back-to-back GEMMs: PDL with no early trigger
                    row[f"gemm_pdl{pdl}_us"] = bench(lambda: gemm(-1))
            best = min(row[f"gemm_k{v}_us"] for v in variants)
            row["best_gemm_us"] = best
            row["weight_GBps_auto"] = weight_bytes / (row["gemm_k-1_us"] * 1e-6) / 1e9
            if marlin is not None:
                row["marlin_w4a16_us"] = bench(lambda: marlin(x))
                row["speedup_linear_vs_marlin"] = row["marlin_w4a16_us"] / row["linear_auto_us"]
            rows.append(row)
            print(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
            with open(out, "w") as f:  # after every row: a run cut short by its time limit keeps them
                json.dump(rows, f, indent=1)
    print(f"\n{'K':>6} {'N':>6} {'M':>5} | {'auto us':>8} {'best us':>8} {'xw us':>8} {'GB/s':>6} | "
          f"{'q+gemm':>8} {'marlin':>8} {'x':>5}")
    for r in rows:  # xw: the auto GEMM on x in the wgmma k order (TMA), where it is a wgmma plan
        print(f"{r['K']:>6} {r['N']:>6} {r['M']:>5} | {r['gemm_k-1_us']:8.1f} {r['best_gemm_us']:8.1f} "
              f"{r.get('gemm_k-1_xw_us', float('nan')):8.1f} "
              f"{r['weight_GBps_auto']:6.0f} | {r['linear_auto_us']:8.1f} {r.get('marlin_w4a16_us', float('nan')):8.1f} "
              f"{r.get('speedup_linear_vs_marlin', float('nan')):5.2f}")


def quant_only(ks, ms, options, out, gen):
    """quantize_act alone on bf16 [M, K] rows (in L2 where they fit, as after the kernel that
    wrote them), under each value of each option; GB/s counts the bf16 read and the int8 write."""
    rows = []
    for k in ks:
        for m in ms:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
            row = {"K": k, "M": m, "device": torch.cuda.get_device_name(),
                   "quantize_act_us": bench(lambda: cuda.quantize_act(x))}
            for option in options:
                tag, values, _, changes = OPTION_AB[option]
                if changes != "quant":  # a GEMM option leaves the quantizer as it is
                    continue
                for value in each_option(option, values):
                    row[f"quantize_act_{tag}{value}_us"] = us = bench(lambda: cuda.quantize_act(x))
                    row[f"quantize_act_{tag}{value}_GBps"] = 3 * m * k / (us * 1e-6) / 1e9
            rows.append(row)
            print(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}), flush=True)
            with open(out, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
