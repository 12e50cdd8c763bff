#!/usr/bin/env python3
"""W4A8 GEMM benchmark: vllm_mixprec's kernels against what vLLM users run today.

Measured in the same run, on the same random data sizes:
  ours_triton        Triton w4a8_gemm alone (int8 activations already quantised)
  ours_triton_q      quantize_act + w4a8_gemm (what a linear layer costs)
  ours_cuda          torch.ops.mixprec.w4a8_linear with impl "cuda" on weights repacked once into
                     the csrc layout (quantize_act + the auto-selected kernel)
  ours_cuda_gemm     torch.ops.mixprec.w4a8_gemm, the csrc GEMM alone on int8 activations: what a
                     layer launches under vLLM's torch.compile, where Inductor fuses the
                     quantization into the RMSNorm / SiLU-and-mul before it (kernels/__init__.py)
  ours_cuda_gemm_xw  the same GEMM on activations in the wgmma k order where its plan is a wgmma
                     kernel (x by TMA; formats.wgmma_act_k_order), the natural order elsewhere: what
                     ours_cuda's quantizer hands it, and a compiled layer's where
                     compile_passes.wgmma_order_pays (all but an 8B-sized QKV: ours_cuda_gemm's)
  ours_cuda_quant    csrc quantize_act alone, in the order ours_cuda picks: with ours_cuda_gemm_xw it
                     shows how much of the linear is the quantizer and how much its hand-over
  ours_w4ax_triton_q Triton quantize_act_w4ax + w4ax_gemm, 25% of the 128-channel blocks at 8 bits
                     (W4Ax, COMET's FMPQ; Hopper widens the int4 blocks to int8 in registers;
                     --w4ax-a8-share sets the share)
  ours_w4ax_rot_triton_q  the same with act_rotation "hadamard" (--w4ax-rotation; the quantizer's
                     W4Ax default is "hadamard64"): the quantize kernel rotates each 4-bit block in
                     registers (a fast Hadamard transform), then quantizes it
  ours_w4ax_rot_torch_triton_q  the same with the rotation as session 33 ran it: torch ops
                     (float32 gather, divide, matmul, concatenate) before the quantize kernel
  ours_w4ax_rot_quant  ours_w4ax_rot_triton_q's quantizer alone (quantize_act_w4ax with the
                     rotation; --w4ax-split-blocks sets the blocks a program quantizes, 0 one
                     program a row, and then --w4ax-rotated-chunk-blocks the rotated blocks a pass holds)
  ours_w4ax_quant    ours_w4ax_triton_q's quantizer alone (no rotation; --w4ax-split-blocks as above)
                     (every ours_w4ax method permutes its input channels as --w4ax-perm says)
  marlin_w4a16       Marlin, uint4b8 group 128, fp16 activations (apply_gptq_marlin_linear)
  marlin_w4a8        Marlin with its own int8 activations (VLLM_MARLIN_INPUT_DTYPE=int8 path)
  machete_w4a16      Machete, uint4b8 group 128, fp16 activations
  cublas_bf16        torch.nn.functional.linear in bf16
  int8_mm            torch._int_mm (cuBLAS W8A8, M > 16 only)
  fp8_w8a8           what `--quantization fp8` runs on a bf16 checkpoint: dynamic per-tensor fp8
                     activation quant (scaled_fp8_quant) + CUTLASS cutlass_scaled_mm, bf16 out

Every callable is captured in a CUDA graph and its replays are timed with
triton.testing.do_bench(return_mode="median") (which also flushes L2 before each replay by
writing 256 MB; `--flush read` reads 256 MB instead, leaving the L2 clean).
When a method's weights fit in L2 (50 MB) the graph cycles through several copies of the
weights and inputs, so that no call finds its weights in cache; the time is per call.

Writes DIR/bench_gemm.json (device, versions, date, every time with TFLOP/s, GB/s and the
speedup over Marlin W4A16) and DIR/bench_gemm_speedup*.png. See benchmarks/NOTES-gemm.md.

  python benchmarks/bench_gemm.py --out results/gemm            # default set, < 4 min on an H100
  python benchmarks/bench_gemm.py --quick --out /tmp/g          # two shapes, four M
  python benchmarks/bench_gemm.py --shapes 8192x28672 --ms 1,16,1024 --sweep --out /tmp/s
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time

ALL_SHAPES = "4096x6144,4096x4096,4096x28672,14336x4096,8192x10240,8192x57344,28672x8192,8192x28672"
ALL_MS = "1,16,64,128,256,1024,4096,8192"
DEFAULT_MS = "1,16,64,256,1024,4096"
QUICK_SHAPES = "8192x28672,4096x4096"
QUICK_MS = "1,16,256,4096"
L2_BYTES = 50 * 2 ** 20
MAX_COPIES = 16
GROUP = 128  # Marlin/Machete group size (ours: --group-size, 128 by default, same bytes)

W4AX_QUANT_ONLY = ("ours_w4ax_rot_quant", "ours_w4ax_quant")  # quantize_act_w4ax alone, rotated or not
QUANT_ONLY = ("ours_cuda_quant",) + W4AX_QUANT_ONLY  # no GEMM: no TFLOP/s, no speed-up
METHODS = ("ours_triton", "ours_triton_q", "ours_cuda", "ours_cuda_gemm", "ours_cuda_gemm_xw", "ours_cuda_quant",
           "ours_w4ax_triton_q", "ours_w4ax_triton",
           "ours_w4ax_rot_triton_q", "ours_w4ax_rot_torch_triton_q", "ours_w4ax_rot_quant", "ours_w4ax_quant",
           "marlin_w4a16", "marlin_w4a8", "machete_w4a16", "cublas_bf16", "int8_mm",
           "fp8_w8a8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", default="bench_gemm_out", help="output directory (JSON + PNG)")
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated KxN (in x out features); default: {ALL_SHAPES}")
    p.add_argument("--ms", default=None,
                   help=f"comma-separated batch sizes M; default {DEFAULT_MS} (all: {ALL_MS})")
    p.add_argument("--quick", action="store_true",
                   help=f"shapes {QUICK_SHAPES}, M {QUICK_MS} (unless given)")
    p.add_argument("--methods", default=",".join(METHODS), help="subset of " + ",".join(METHODS))
    p.add_argument("--sweep", action="store_true",
                   help="also time a grid of Triton tile configs per point and report the best")
    p.add_argument("--sweep-method", choices=("ours_triton", "ours_w4ax_triton", "ours_w4ax_triton_q"),
                   default="ours_triton",
                   help="the Triton GEMM the sweep times: W4A8 alone, W4Ax alone, or W4Ax with its "
                        "quantization (at --w4ax-a8-share; the configs change the GEMM only)")
    p.add_argument("--group-size", type=int, default=128, choices=(64, 128),
                   help="LiquidQuant group size of ours (Marlin and Machete use 128)")
    p.add_argument("--rep-ms", type=int, default=60, help="do_bench rep time per measurement")
    p.add_argument("--w4ax-a8-share", type=float, default=0.25,
                   help="W4Ax methods: share of K's 128-channel blocks at 8 bits, rounded to whole "
                        "blocks (0: all 4-bit, 1: all 8-bit; the quantizer's --a8-allocation layer-blocks "
                        "and layer give each linear its own)")
    p.add_argument("--w4ax-rotation", choices=("hadamard", "hadamard64"), default="hadamard",
                   help="ours_w4ax_rot_triton_q's act_rotation (formats.ACT_ROTATIONS)")
    p.add_argument("--w4ax-perm", choices=W4AX_PERMS, default="blocks",
                   help="W4Ax methods' random act_perm: whole 128-channel blocks moved, as "
                        "`quantize --a8-select blocks` (the default) writes, held as a block table "
                        "(blocks) or as the channel table a checkpoint stores (blocks-as-channels: "
                        "the kernel's block path A/B); or any channel anywhere (channels, "
                        "--a8-select channels)")
    p.add_argument("--w4ax-rotated-chunk-blocks", type=int, default=None, metavar="R",
                   help="rotated 4-bit blocks the W4Ax quantizer holds in one pass (a power of two; "
                        "default: the kernel's ROTATED_CHUNK_BLOCKS): its tuning A/B")
    p.add_argument("--w4ax-split-blocks", type=int, default=None, metavar="R",
                   help="scale blocks each program of the W4Ax quantizer takes at every M (a power of "
                        "two, or 0: one program a row; default: the kernel's rule, "
                        "w4ax_split_blocks_for): its tuning A/B")
    p.add_argument("--flush", choices=("write", "read"), default="write",
                   help="L2 flush before each replay: do_bench's (writes 256 MB: the L2 is left full of "
                        "dirty lines, whose write-backs the timed kernel pays) or one that reads 256 MB "
                        "(clean lines, as after the previous layer in serving)")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="only redraw the table and plots of an earlier bench_gemm.json (no GPU)")
    args = p.parse_args(argv)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else ALL_SHAPES)
    args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in shapes.split(",") if s]
    args.ms = [int(v) for v in (args.ms or (QUICK_MS if args.quick else DEFAULT_MS)).split(",") if v]
    args.methods = [m for m in args.methods.split(",") if m]
    if not 0.0 <= args.w4ax_a8_share <= 1.0:
        p.error(f"--w4ax-a8-share={args.w4ax_a8_share}: expected a share in [0, 1]")
    r = args.w4ax_rotated_chunk_blocks
    if r is not None and (r < 1 or r & (r - 1)):
        p.error(f"--w4ax-rotated-chunk-blocks={r}: expected a power of two")
    r = args.w4ax_split_blocks
    if r is not None and (r < 0 or r & (r - 1)):
        p.error(f"--w4ax-split-blocks={r}: expected 0 or a power of two")
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}")
    return args


# --- timing -------------------------------------------------------------------------------

def n_copies(weight_bytes: int) -> int:
    """Copies to cycle through so that the weights of consecutive calls are not in L2."""
    if weight_bytes >= L2_BYTES:
        return 1
    return max(2, min(MAX_COPIES, math.ceil(2 * L2_BYTES / weight_bytes)))


FLUSH = "write"  # --flush


@functools.cache
def _read_flush_buffer():
    """256 MB of random int32 on the GPU, made once: what --flush read reads before each replay."""
    import torch
    buf = torch.empty(256 * 2 ** 20 // 4, dtype=torch.int32, device="cuda")
    return buf.random_()


def replay_ms_read_flush(fn, rep_ms: int) -> list[float]:
    """do_bench's loop with an L2 flush that reads 256 MB instead of writing it: the L2 then
    holds clean lines, as it does in serving after the previous layer's weights streamed
    through, and a kernel's misses cost no write-backs of the flush's dirty lines."""
    import torch
    buf = _read_flush_buffer()
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        buf.max()
        fn()
    torch.cuda.synchronize()
    n = max(10, int(rep_ms / max((time.perf_counter() - t0) * 1e3 / 5, 1e-3)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        buf.max()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(starts, ends)]


def time_calls(calls, rep_ms: int) -> float:
    """Median ms per call of `calls` (one per weight copy) captured back to back in a graph."""
    import statistics

    import torch
    import triton

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, allocator) outside the capture
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    if FLUSH == "write":
        ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")
    else:
        ms = statistics.median(replay_ms_read_flush(graph.replay, rep_ms))
    del graph
    return ms / len(calls)


# --- operands ----------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    K: int
    N: int
    M: int


def random_lqq(N: int, K: int, G: int, device):
    """Random but valid LiquidQuant tensors (every lane q*s + a <= 255)."""
    import torch
    step = torch.randint(1, 17, (N, K // G), dtype=torch.int32, device=device)
    off = (torch.rand(N, K // G, device=device) * (256 - 15 * step)).floor().to(torch.int32)
    return {
        "qweight": torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=device),
        "group_scale": step.to(torch.uint8),
        "group_offset": torch.minimum(off.clamp_(min=0), 255 - 15 * step).to(torch.uint8),
        "channel_scale": (torch.rand(N, device=device) + 0.5) / (127 * math.sqrt(K)),
    }


def setup_of(name: str) -> str:
    """The weight setup a method times: the Triton variants share "ours", the csrc ones
    "ours_cuda"."""
    if name in ("ours_triton", "ours_triton_q") or name.startswith("ours_w4ax"):
        return "ours"
    return "ours_cuda" if name in ("ours_cuda_gemm", "ours_cuda_gemm_xw", "ours_cuda_quant") else name


def _w4ax_quant_torch_rotation(x, perm, k8, smooth, act_rotation, ident):
    """quantize_act_w4ax with the rotation as session 33 ran it, for comparison: float32 torch
    ops (gather, divide, one matmul over the 4-bit blocks, concatenate), then the quantize
    kernel on the result (identity permutation, no smoothing)."""
    import torch
    from vllm_mixprec import formats as F
    from vllm_mixprec.kernels.triton import gemm as tg
    rotation = F.act_rotation_matrix(act_rotation).to(x.device)
    m, k = x.shape
    perm = F.act_channel_perm(perm, x.shape[1])
    xp = x.float()[:, perm]
    if smooth is not None:
        xp = xp / smooth.float()[perm]
    a4 = xp[:, k8:].reshape(m, (k - k8) // 128, 128) @ rotation
    xr = torch.cat([xp[:, :k8], a4.reshape(m, k - k8)], dim=1)
    return tg.quantize_act_w4ax(xr, ident, k8, None)


W4AX_PERMS = ("blocks", "blocks-as-channels", "channels")


def w4ax_perm(k: int, kind: str, device):
    """A random act_perm of a W4AX_PERMS kind, in the form the quantize kernel is handed."""
    import torch
    from vllm_mixprec import formats as F
    if kind == "blocks-as-channels":
        return F.act_channel_perm(F.random_act_perm(k, "blocks", device=device), k).to(torch.int32)
    return F.random_act_perm(k, kind, device=device)


class Methods:
    """Builds, per shape, each method's weights; per M, a callable per weight copy."""

    def __init__(self, K: int, N: int, wanted, errors: dict, group_size: int = GROUP,
                 w4ax_a8_share: float = 0.25, w4ax_rotation: str = "hadamard",
                 w4ax_perm: str = "blocks"):
        import torch
        self.K, self.N, self.dev, self.errors = K, N, "cuda", errors
        self.group_size = group_size
        self.w4ax_k8 = 128 * round(w4ax_a8_share * K / 128)
        self.w4ax_rotation = w4ax_rotation
        self.w4ax_perm = w4ax_perm
        self.wanted = wanted
        self.w16 = (torch.randn(N, K, device=self.dev) / math.sqrt(K)).half()  # [N, K]
        self.setups = {}
        for name, fn in (("ours", self._ours), ("ours_cuda", self._ours_cuda),
                         ("marlin_w4a16", self._marlin16),
                         ("marlin_w4a8", self._marlin8), ("machete_w4a16", self._machete),
                         ("cublas_bf16", self._bf16), ("int8_mm", self._int8),
                         ("fp8_w8a8", self._fp8)):
            if any(m.startswith(name) for m in wanted):
                try:
                    self.setups[name] = fn()
                except Exception as e:  # a baseline that does not run here is recorded, not fatal
                    errors[name] = f"setup: {type(e).__name__}: {str(e)[:300]}"

    # each returns (weight_bytes, [weights per copy])
    def _copies(self, tensors: dict, weight_bytes: int):
        n = n_copies(weight_bytes)
        return weight_bytes, [tensors] + [{k: v.clone() for k, v in tensors.items()} for _ in range(n - 1)]

    def _ours(self):
        t = random_lqq(self.N, self.K, self.group_size, self.dev)
        return self._copies(t, sum(v.numel() * v.element_size() for v in t.values()))

    def _ours_cuda(self):
        """The csrc kernel's layout, repacked once per copy (as process_weights_after_loading does)."""
        from vllm_mixprec.kernels import cuda as kcuda
        if not kcuda.available():
            raise RuntimeError(f"csrc ops not built: {kcuda.load_error()}")
        weight_bytes, copies = self._ours()
        return weight_bytes, [kcuda.pack_weights(t["qweight"], t["group_scale"], t["group_offset"],
                                                 t["channel_scale"]) for t in copies]

    def _marlin(self, act):
        import torch
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_act_int8_process_scales, marlin_make_workspace_new)
        from vllm.model_executor.layers.quantization.utils.marlin_utils_test import marlin_quantize
        from vllm.scalar_type import scalar_types
        _, q_w, s, g_idx, sort_idx, _ = marlin_quantize(self.w16.t().contiguous(), scalar_types.uint4b8,
                                                        GROUP, False, input_dtype=act)
        t = {"q_w": q_w, "s": s, "g_idx": g_idx, "sort_idx": sort_idx}
        if act == torch.int8:
            t["s"], t["gscale"] = marlin_act_int8_process_scales(s)
        t["ws"] = marlin_make_workspace_new(torch.device(self.dev))
        return self._copies(t, q_w.numel() * q_w.element_size() + s.numel() * s.element_size())

    def _marlin16(self):
        return self._marlin(None)

    def _marlin8(self):
        import torch
        return self._marlin(torch.int8)

    def _machete(self):
        import torch
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            pack_quantized_values_into_int32, quantize_weights)
        from vllm.scalar_type import scalar_types
        wt = scalar_types.uint4b8
        _, w_q, w_s, _ = quantize_weights(self.w16.t().contiguous(), wt, GROUP)
        packed = pack_quantized_values_into_int32(w_q, wt, packed_dim=0)  # [K/8, N]
        b_q = ops.machete_prepack_B(packed.t().contiguous().t(), a_type=torch.half, b_type=wt,
                                    group_scales_type=torch.half)
        t = {"b_q": b_q, "s": w_s.half().contiguous()}
        return self._copies(t, b_q.numel() * b_q.element_size() + t["s"].numel() * 2)

    def _bf16(self):
        w = self.w16.bfloat16()
        return self._copies({"w": w}, w.numel() * 2)

    def _int8(self):
        import torch
        w8 = torch.randint(-127, 128, (self.N, self.K), dtype=torch.int8, device=self.dev)
        return self._copies({"w8": w8}, w8.numel())

    def _fp8(self):
        import torch
        from vllm import _custom_ops as ops
        wq, ws = ops.scaled_fp8_quant(self.w16.bfloat16())  # per-tensor, as the online method does
        t = {"wt": wq.t(), "ws": ws}  # [K, N] column-major, cutlass_scaled_mm's B
        return self._copies(t, wq.numel())

    # --- per M -------------------------------------------------------------------------

    def calls(self, name: str, M: int, config=None):
        """[callable per weight copy] of method `name` at batch M (raises if unsupported)."""
        import torch
        from vllm_mixprec import formats as F
        from vllm_mixprec.kernels.triton import gemm as tg
        K, dev = self.K, self.dev
        base = setup_of(name)
        _, copies = self.setups[base]
        out = []
        for t in copies:
            x16 = torch.randn(M, K, device=dev, dtype=torch.float16)
            if name == "ours_triton":
                xq, xs = tg.quantize_act(x16)
                out.append(lambda t=t, xq=xq, xs=xs: tg.w4a8_gemm(
                    xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                    None, torch.bfloat16, config=config))
            elif name == "ours_triton_q":
                xb = x16.bfloat16()
                out.append(lambda t=t, xb=xb: tg.w4a8_gemm(
                    *tg.quantize_act(xb), t["qweight"], t["group_scale"], t["group_offset"],
                    t["channel_scale"], None, torch.bfloat16, config=config))
            elif name.startswith("ours_w4ax"):  # the same weights, K permuted
                if K % 128:
                    raise RuntimeError("W4Ax needs K to be a multiple of 128")
                xb = x16.bfloat16()
                perm = w4ax_perm(K, self.w4ax_perm, dev)
                k8 = self.w4ax_k8
                rot = ("none" if name in ("ours_w4ax_triton_q", "ours_w4ax_triton", "ours_w4ax_quant")
                       else self.w4ax_rotation)
                quant = tg.quantize_act_w4ax
                if name == "ours_w4ax_rot_torch_triton_q":
                    quant = functools.partial(_w4ax_quant_torch_rotation, ident=torch.arange(
                        K, device=dev, dtype=torch.int32))
                if name in W4AX_QUANT_ONLY:  # the quantizer alone (no weights read)
                    out.append(lambda xb=xb, perm=perm, k8=k8, rot=rot: quant(xb, perm, k8, None, rot))
                    continue
                if name == "ours_w4ax_triton":  # the GEMM alone, on codes quantized once
                    acts = quant(xb, perm, k8, None, rot)
                    out.append(lambda t=t, acts=acts: tg.w4ax_gemm(
                        *acts, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                        None, torch.bfloat16, config=config))
                    continue
                out.append(lambda t=t, xb=xb, perm=perm, k8=k8, rot=rot, quant=quant: tg.w4ax_gemm(
                    *quant(xb, perm, k8, None, rot), t["qweight"], t["group_scale"],
                    t["group_offset"], t["channel_scale"], None, torch.bfloat16, config=config))
            elif name == "ours_cuda":  # quantize_act + the auto-selected csrc GEMM, prepacked
                xb = x16.bfloat16()
                out.append(lambda t=t, xb=xb: torch.ops.mixprec.w4a8_linear(
                    xb, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                    None, None, "cuda"))
            elif name == "ours_cuda_gemm":  # the GEMM alone: what a compiled vLLM layer launches
                # once Inductor has fused the activation quantization into the op before it
                from vllm_mixprec import reference as ref
                xq, xs = ref.quantize_act(x16.bfloat16())
                out.append(lambda t=t, xq=xq, xs=xs: torch.ops.mixprec.w4a8_gemm(
                    xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                    None, torch.bfloat16, "cuda"))
            elif name == "ours_cuda_gemm_xw":  # the GEMM alone on the linear's activation order
                from vllm_mixprec import reference as ref
                from vllm_mixprec.kernels import cuda
                order = cuda.x_wgmma_order_for(M, self.N, self.K)
                xq, xs = ref.quantize_act(x16.bfloat16(), None, order)
                out.append(lambda t=t, xq=xq, xs=xs, order=order: torch.ops.mixprec.w4a8_gemm(
                    xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                    None, torch.bfloat16, "cuda", order))
            elif name == "ours_cuda_quant":  # the linear's quantizer alone (no weights read)
                from vllm_mixprec.kernels import cuda
                order = cuda.x_wgmma_order_for(M, self.N, self.K)
                xb = x16.bfloat16()
                out.append(lambda xb=xb, order=order: cuda.quantize_act(xb, None, order))
            elif name in ("marlin_w4a16", "marlin_w4a8"):
                out.append(self._marlin_call(t, x16, torch.int8 if name == "marlin_w4a8" else None))
            elif name == "machete_w4a16":
                from vllm import _custom_ops as ops
                from vllm.scalar_type import scalar_types
                out.append(lambda t=t, x=x16: ops.machete_mm(
                    a=x, b_q=t["b_q"], b_type=scalar_types.uint4b8, b_group_scales=t["s"],
                    b_group_size=GROUP))
            elif name == "cublas_bf16":
                xb = x16.bfloat16()
                out.append(lambda t=t, xb=xb: torch.nn.functional.linear(xb, t["w"]))
            elif name == "fp8_w8a8":
                from vllm import _custom_ops as ops
                xb = x16.bfloat16()

                def fp8_call(t=t, xb=xb):
                    xq, xs = ops.scaled_fp8_quant(xb)
                    return ops.cutlass_scaled_mm(xq, t["wt"], xs, t["ws"], torch.bfloat16)
                out.append(fp8_call)
            elif name == "int8_mm":
                if M <= 16:
                    raise RuntimeError("torch._int_mm needs M > 16")
                x8 = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
                out.append(lambda t=t, x8=x8: torch._int_mm(x8, t["w8"].t()))
        return out

    def _marlin_call(self, t, x16, act):
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            apply_gptq_marlin_linear, marlin_make_empty_g_idx)
        from vllm.scalar_type import scalar_types
        import torch
        empty = marlin_make_empty_g_idx(torch.device(self.dev))
        return lambda: apply_gptq_marlin_linear(
            x16, t["q_w"], t["s"], empty, t["g_idx"], t["sort_idx"], t["ws"], scalar_types.uint4b8,
            self.N, self.K, is_k_full=True, input_global_scale=t.get("gscale"), input_dtype=act)

    def _w4ax_row_code_bytes(self) -> int:
        """A row's W4Ax codes: int8 and packed int4, and a float32 scale a block."""
        return self.w4ax_k8 + (self.K - self.w4ax_k8) // 2 + self.K // 32

    def bytes_moved(self, name: str, M: int) -> int:
        """Weight bytes + activation bytes (input and output) of one call."""
        if name == "ours_cuda_quant":  # bf16 in, int8 codes and a float32 scale a row out
            return M * self.K * 3 + M * 4
        if name in W4AX_QUANT_ONLY:  # bf16 in, codes out
            return M * (self.K * 2 + self._w4ax_row_code_bytes())
        base = setup_of(name)
        wbytes = self.setups[base][0]
        if name == "ours_w4ax_triton":  # the GEMM alone reads the codes
            return wbytes + M * self._w4ax_row_code_bytes() + M * self.N * 2
        a_in = {"cublas_bf16": 2, "fp8_w8a8": 2, "marlin_w4a16": 2, "machete_w4a16": 2, "marlin_w4a8": 2,
                "ours_triton_q": 2, "ours_cuda": 2, "ours_w4ax_triton_q": 2,
                "ours_w4ax_rot_triton_q": 2, "ours_w4ax_rot_torch_triton_q": 2}.get(name, 1)
        a_out = 4 if name == "int8_mm" else 2
        return wbytes + M * self.K * a_in + M * self.N * a_out


# --- checks ------------------------------------------------------------------------------

def check_ours(meth: Methods, M: int, config=None, w4ax: bool = False) -> float:
    """Relative error of the Triton GEMM (W4A8, or W4Ax at the run's 8-bit share with the
    identity permutation) against reference.py in float64 on up to 64 rows."""
    import torch
    from vllm_mixprec import reference as ref
    from vllm_mixprec.kernels.triton import gemm as tg
    t = meth.setups["ours"][1][0]
    w = (t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"], None)
    x = torch.randn(M, meth.K, device="cuda", dtype=torch.bfloat16)
    if w4ax:
        ident = torch.arange(meth.K, device="cuda", dtype=torch.int32)
        acts = tg.quantize_act_w4ax(x, ident, meth.w4ax_k8)
        gemm, ref_gemm = tg.w4ax_gemm, ref.w4ax_gemm
    else:
        acts = tg.quantize_act(x)
        gemm, ref_gemm = tg.w4a8_gemm, ref.w4a8_gemm
    y = gemm(*acts, *w, torch.bfloat16, config=config)
    rows = torch.unique(torch.tensor([0, M // 2, M - 1] + list(range(min(M, 61))), device="cuda"))
    r = ref_gemm(*(a[rows] for a in acts), *w, torch.float64)
    assert torch.isfinite(y).all(), "non-finite output"
    return float((y[rows].double() - r).norm() / r.norm())


def sweep_configs(M: int):
    from vllm_mixprec.kernels.triton.gemm import GemmConfig as C
    if M <= 64:
        bm = max(16, 1 << (M - 1).bit_length())
        return [C(bm, 64, 256, 0), C(bm, 64, 128, 0), C(bm, 128, 128, 0), C(bm, 128, 256, 0, num_stages=3),
                C(bm, 64, 256, 1), C(bm, 64, 256, 0, swap_ab=False), C(bm, 64, 256, 0, num_stages=3),
                C(bm, 64, 512, 0, num_stages=3), C(bm, 64, 256, 0, swap_ab=False, num_stages=3)]
    return [C(128, 128, 128, 0, num_warps=4, num_stages=3), C(128, 128, 128, 0, num_warps=8, num_stages=3),
            C(128, 128, 128, 0, swap_ab=False, num_warps=8, num_stages=3),
            C(128, 128, 64, 0, num_warps=4, num_stages=4), C(256, 128, 128, 0, num_warps=8, num_stages=3),
            C(256, 64, 128, 0, num_warps=4, num_stages=2), C(128, 256, 64, 0, num_warps=8, num_stages=3),
            C(64, 128, 128, 0, num_warps=4, num_stages=4), C(128, 64, 128, 0, swap_ab=False),
            # fewer accumulator registers a thread: W4Ax keeps an fp32 sum beside each block's int32 dot
            C(64, 128, 128, 0, num_warps=4, num_stages=3), C(64, 256, 128, 0, num_warps=8, num_stages=3),
            C(128, 128, 128, 0, num_warps=8, num_stages=4), C(64, 64, 128, 0, num_warps=4, num_stages=4)]


# --- main ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            report = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        print_table(report)
        plot(report, args.out)
        return 0
    global FLUSH
    FLUSH = args.flush
    import torch
    if not torch.cuda.is_available():
        print("bench_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    import vllm
    import vllm_mixprec  # noqa: F401  (registers torch.ops.mixprec)
    import vllm_mixprec.kernels  # noqa: F401
    from vllm_mixprec import formats as F
    from vllm_mixprec.kernels.triton import gemm as tg

    os.makedirs(args.out, exist_ok=True)
    if args.w4ax_rotated_chunk_blocks:
        tg.ROTATED_CHUNK_BLOCKS = args.w4ax_rotated_chunk_blocks  # read at each launch
    if args.w4ax_split_blocks is not None:
        tg.force_w4ax_split_blocks(args.w4ax_split_blocks)  # read at each launch
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    report = {"device": dev, "torch": torch.__version__, "vllm": vllm.__version__,
              "triton": triton.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "timing": "CUDA graph replays, median, L2 flushed before each replay; ms per call",
              "flush": args.flush,
              "dtypes": {"ours": "bf16 in/out, int8 x int4 (LiquidQuant)", "marlin/machete": "fp16",
                         "cublas": "bf16", "int8_mm": "int8 -> int32"},
              "group_size": {"ours": args.group_size, "marlin/machete": GROUP},
              "w4ax": {"a8_share": args.w4ax_a8_share, "rotation": args.w4ax_rotation,
                       "perm": args.w4ax_perm,
                       "rotated_chunk_blocks": tg.ROTATED_CHUNK_BLOCKS,
                       "split_blocks": tg.W4AX_SPLIT_BLOCKS,
                       "split_channel_gather_max_m": tg.W4AX_SPLIT_CHANNEL_GATHER_MAX_M},
              "results": [], "sweep": []}
    t_start = time.time()
    for K, N in args.shapes:
        errors: dict = {}
        meth = Methods(K, N, args.methods, errors, args.group_size, args.w4ax_a8_share,
                       args.w4ax_rotation, args.w4ax_perm)
        for M in args.ms:
            row = {"K": K, "N": N, "M": M, "flop": 2 * M * N * K, "methods": {}}
            if "ours" in meth.setups:
                sms, sm = tg._num_sms(torch.device("cuda")), tg._sm_major(torch.device("cuda"))
                row["ours_config"] = dataclasses.asdict(tg.default_config(M, N, K, K, sms, sm_major=sm))
                if any(m.startswith("ours_w4ax") for m in args.methods):
                    row["ours_w4ax_config"] = dataclasses.asdict(tg.default_config(
                        M, N, K, F.ACT_BLOCK, sms, True))  # as w4ax_gemm picks it
                try:
                    row["ours_rel_err"] = check_ours(meth, M)
                except Exception as e:
                    row["ours_check_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for name in args.methods:
                base = setup_of(name)
                if base not in meth.setups:
                    row["methods"][name] = {"error": errors.get(base, "not set up")}
                    continue
                try:
                    ms = time_calls(meth.calls(name, M), args.rep_ms)
                    nbytes = meth.bytes_moved(name, M)
                    row["methods"][name] = {"ms": ms, "gbs": nbytes / ms / 1e6, "bytes": nbytes}
                    if name not in QUANT_ONLY:  # a GEMM's rate, not the quantizer's
                        row["methods"][name]["tflops"] = row["flop"] / ms / 1e9
                except Exception as e:
                    row["methods"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                torch.cuda.empty_cache()
            base_ms = row["methods"].get("marlin_w4a16", {}).get("ms")
            for name, v in row["methods"].items():
                if base_ms and "ms" in v and name not in QUANT_ONLY:
                    v["speedup_vs_marlin_w4a16"] = base_ms / v["ms"]
            if args.sweep and "ours" in meth.setups:
                report["sweep"].append(run_sweep(meth, K, N, M, args.rep_ms, base_ms, args.sweep_method))
            report["results"].append(row)
            print(format_row(row), flush=True)
        del meth
        torch.cuda.empty_cache()
    report["wall_s"] = round(time.time() - t_start, 1)
    path = os.path.join(args.out, "bench_gemm.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)
    plot(report, args.out)
    print(f"wrote {path} ({report['wall_s']} s)")
    return 0


def run_sweep(meth: Methods, K, N, M, rep_ms, marlin_ms, method="ours_triton"):
    from vllm_mixprec.kernels.triton import gemm as tg
    import torch
    w4ax = method != "ours_triton"
    out = {"K": K, "N": N, "M": M, "method": method, "configs": []}
    iters_cfgs = []
    for c in sweep_configs(M):
        bk = min(c.block_k, 128 if w4ax else K)  # W4Ax: one activation block's scale a k-step
        while K % bk or (w4ax and meth.w4ax_k8 % bk):
            bk //= 2
        c = dataclasses.replace(c, block_k=bk)
        if c.split_k == 0:  # 0: the default rule's split for this tile shape
            c = dataclasses.replace(c, split_k=tg.choose_split(
                M, N, K, c, 2 * tg._num_sms(torch.device("cuda"))))
        iters_cfgs.append(c)
    if M <= 64:  # the default tile at half and twice its split: is ~2 CTAs an SM the right target?
        c0 = iters_cfgs[0]
        iters = K // c0.block_k
        iters_cfgs += [dataclasses.replace(c0, split_k=tg._effective_split(iters, s))
                       for s in (c0.split_k // 2, min(2 * c0.split_k, iters // 2)) if s >= 1]
    for c in dict.fromkeys(iters_cfgs):
        rec = {"config": dataclasses.asdict(c)}
        try:
            rec["rel_err"] = check_ours(meth, M, c, w4ax)
            rec["ms"] = time_calls(meth.calls(method, M, c), rep_ms)
            if marlin_ms:
                rec["speedup_vs_marlin_w4a16"] = marlin_ms / rec["ms"]
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["configs"].append(rec)
    ok = [r for r in out["configs"] if "ms" in r]
    if ok:
        best = min(ok, key=lambda r: r["ms"])
        out["best"] = best
        print(f"   sweep K={K} N={N} M={M}: best {best['ms'] * 1e3:.1f} us {best['config']}", flush=True)
    return out


# --- output ----------------------------------------------------------------------------------

_SHORT = {"ours_triton": "tri", "ours_triton_q": "tri+q", "ours_cuda": "cuda", "ours_cuda_gemm": "cuda-g",
          "ours_cuda_gemm_xw": "cuda-gx", "ours_cuda_quant": "cuda-q",
          "ours_w4ax_triton_q": "w4ax", "ours_w4ax_triton": "w4ax-g", "ours_w4ax_rot_triton_q": "w4ax+rot",
          "ours_w4ax_rot_torch_triton_q": "w4ax+rot(torch)", "ours_w4ax_rot_quant": "w4ax-rq",
          "ours_w4ax_quant": "w4ax-q",
          "marlin_w4a16": "mar16",
          "marlin_w4a8": "mar8", "machete_w4a16": "mach", "cublas_bf16": "bf16", "int8_mm": "i8mm", "fp8_w8a8": "fp8"}
_RATIOS = (("ours_cuda", "marlin_w4a16"), ("ours_cuda_gemm", "marlin_w4a16"), ("ours_cuda", "fp8_w8a8"),
           ("ours_triton_q", "marlin_w4a16"))


def _ratio(row, ours: str, other: str):
    """other's time / ours (> 1: ours is faster), or None where either did not run."""
    a, b = row["methods"].get(ours, {}).get("ms"), row["methods"].get(other, {}).get("ms")
    return b / a if a and b else None


def format_row(row) -> str:
    cells = []
    for name, v in row["methods"].items():
        cells.append(f"{_SHORT[name]}={v['ms'] * 1e3:7.1f}us" if "ms" in v else f"{_SHORT[name]}=   n/a  ")
    err = row.get("ours_rel_err")
    sp = _ratio(row, "ours_cuda", "marlin_w4a16") or _ratio(row, "ours_triton", "marlin_w4a16")
    tail = (f" err={err:.1e}" if err is not None else "") + (f" x{sp:.2f}" if sp else "")
    return f"K={row['K']:5d} N={row['N']:5d} M={row['M']:5d} " + " ".join(cells) + tail


def print_table(report) -> None:
    names = [n for n in METHODS if any(n in r["methods"] for r in report["results"])]
    head = (f"{'KxN':>12} {'M':>5} " + " ".join(f"{_SHORT[n]:>8}" for n in names) + "  "
            + " ".join(f"{_SHORT[a] + '/' + _SHORT[b]:>10}" for a, b in _RATIOS))
    print(f"\n{report['device']}: time per call in us (CUDA graphs, median)\n{head}")
    for r in report["results"]:
        cells = []
        for n in names:
            v = r["methods"].get(n, {})
            cells.append(f"{v['ms'] * 1e3:8.1f}" if "ms" in v else f"{'-':>8}")
        sp = [_ratio(r, a, b) for a, b in _RATIOS]
        sps = " ".join(f"{s:9.2f}x" if s else f"{'-':>10}" for s in sp)
        print(f"{r['K']:>5}x{r['N']:<6} {r['M']:>5} " + " ".join(cells) + "  " + sps)


def plot(report, out_dir) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots")
        return
    # the csrc linear is what vLLM runs on sm_90; the Triton linear is the portable path
    for name, suffix in (("ours_cuda", ""), ("ours_triton_q", "_triton")):
        shapes = sorted({(r["K"], r["N"]) for r in report["results"]})
        curves = {}
        for K, N in shapes:
            pts = [(r["M"], r["methods"].get(name, {}).get("speedup_vs_marlin_w4a16"))
                   for r in report["results"] if (r["K"], r["N"]) == (K, N)]
            pts = [(m, s) for m, s in pts if s]
            if pts:
                curves[f"K={K} N={N}"] = pts
        if not curves:  # the method (or Marlin) was not run: no empty figure
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, pts in curves.items():
            ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("speedup over Marlin W4A16")
        ax.set_title(f"{name} vs Marlin W4A16, {report['device']}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"bench_gemm_speedup{suffix}.png"), dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
