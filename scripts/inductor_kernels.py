#!/usr/bin/env python3
"""Which Triton kernels Inductor generates for a compiled layer, without a GPU.

Inductor partitions a graph into kernels in its scheduler, before any kernel is compiled. With
`cpu_backend="triton"` a CPU compile goes through the Triton scheduling a CUDA one does, and the
generated wrapper shows the kernels a GPU compile launches; only compiling them needs a driver.
This module keeps the wrapper's source and lets the compile fail. What it stubs for the
duration: the Triton backend's hash (needs a driver), and Inductor's CPU-only heuristics, which
GPU compiles skip (a reused exp or sigmoid, SiLU's, is realized rather than recomputed; no loop
reordering in fusion). Left as it is: mix-order reduction fusion, which Inductor allows on CUDA
only.

Checked against the GPU: for the six layers session 65 compiled three ways on an H200
(bench_compiled_linear, code kept), the same kernels of the same kinds in the same order
(tests/test_inductor_kernels.py); for the decoder piece vLLM served with MIXPREC_X_WGMMA_ORDER=
input in session 67, the same split of the QKV's quantizer from its add + RMSNorm.

  python scripts/inductor_kernels.py [--rotation none|hadamard|hadamard64] [--k 1024] [--m 7]
  python scripts/inductor_kernels.py --served-graph benchmarks/results/2026-12-05-s67/serve/compile-code.tgz \
      --m 256 [--bytes]

The first prints the kernels of a W4A8 layer and of a W4Ax layer, traced and as compiled by
default, after add + RMSNorm; the second those of a piece of the graph vLLM served (its Dynamo
graph, kept in its compile cache) in each MIXPREC_X_WGMMA_ORDER mode at --m tokens (the order
pass only past 64, as vLLM's compile ranges have it), or with --bytes Inductor's estimate of the
bytes its kernels move. torch is pinned (2.11); the names stubbed are private to it.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import warnings
from unittest import mock

import torch

LAUNCH = re.compile(r"^\s+(triton_\w+)\.run\(", re.M)
NUM_GB = re.compile(r"'kernel_num_gb': ([0-9.e+-]+)")


@contextlib.contextmanager
def _gpu_scheduling_on_the_cpu():
    import torch._inductor.codegen.triton as codegen_triton
    import torch._inductor.config as inductor_config
    import torch._inductor.ir as inductor_ir
    import torch._inductor.scheduler as inductor_scheduler
    import torch.utils._triton as utils_triton

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(cpu_backend="triton"))
        # the CPU-only heuristics GPU compiles skip: realizing a reused exp/sigmoid (SiLU) instead
        # of recomputing it, and no loop reordering or index inversion in fusion
        stack.enter_context(mock.patch.object(inductor_ir, "is_cpu", lambda x: False))
        stack.enter_context(mock.patch.object(inductor_scheduler.BaseSchedulerNode, "is_cpu",
                                              lambda self: False))
        # the kernels' compile fails by design; Inductor logs it as an error
        quiet = logging.getLogger("torch._inductor.runtime.triton_heuristics")
        stack.callback(quiet.setLevel, quiet.level)
        quiet.setLevel(logging.CRITICAL)
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Could not find an active CPU backend")
        for module in (utils_triton, codegen_triton):
            if hasattr(module, "triton_hash_with_backend"):
                stack.enter_context(mock.patch.object(module, "triton_hash_with_backend",
                                                      lambda: "no-driver"))
        yield


def triton_wrapper(fn, *args, options: dict | None = None) -> str:
    """The Python wrapper Inductor generates for fn(*args) (CPU tensors) with Triton kernels;
    options: more Inductor options (a post-grad pass)."""
    from torch._inductor import graph

    sources = []
    codegen = graph.GraphLowering.codegen

    def keep(self, *a, **k):
        out = codegen(self, *a, **k)
        src = out[0] if isinstance(out, tuple) else out
        sources.append(str(getattr(src, "value", src)))
        return out

    torch._dynamo.reset()
    with _gpu_scheduling_on_the_cpu(), mock.patch.object(graph.GraphLowering, "codegen", keep):
        try:
            torch.compile(fn, fullgraph=True, options={**(options or {}), "fx_graph_cache": False})(*args)
        except Exception:  # compiling the kernels needs a driver; the source is what we want
            if not sources:
                raise
    torch._dynamo.reset()
    return "\n".join(sources)


def launches(wrapper: str) -> list[str]:
    """The Triton kernels the wrapper launches, in order."""
    return LAUNCH.findall(wrapper)


def estimated_mb(wrapper: str) -> list[float]:
    """Inductor's estimate of the bytes each Triton kernel reads and writes (MB, at the example
    inputs' sizes), from the kernels' inductor_meta. Needs the Inductor option
    benchmark_kernel=True, which also adds a benchmark harness to every kernel: launches() then
    counts each kernel twice."""
    return [1e3 * float(gb) for gb in NUM_GB.findall(wrapper)]


DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "u8": torch.uint8,
          "i8": torch.int8, "i32": torch.int32, "i64": torch.int64}


def served_submodule(path: str, index: int, tokens: int = 80):
    """vLLM's piecewise submodule `submod_{index}` from the Dynamo graph it keeps in its compile
    cache (backbone/computation_graph.py, in a folder or a .tgz of one), made to compile on the
    CPU: vLLM IR ops called as their native implementations (what vLLM's lowering pass does with
    the native provider), tensors on the CPU. Returns (forward, args): random CPU tensors of the
    annotated shapes, `tokens` rows where the batch is symbolic (marked dynamic)."""
    import inspect
    import tarfile
    import textwrap

    import vllm.ir.ops as ir_ops

    if path.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("backbone/computation_graph.py"))
            source = tar.extractfile(member).read().decode()
    else:
        with open(os.path.join(path, "computation_graph.py") if os.path.isdir(path) else path) as f:
            source = f.read()
    start = source.index(f"    class submod_{index}(torch.nn.Module):")
    end = source.find("    class submod_", start + 1)
    body = textwrap.dedent(source[start:end if end > 0 else len(source)])
    body = re.sub(r"torch\._C\._autograd\._get_data_attr\((\w+)\)", r"\1", body)  # .data
    body = re.sub(r"device\(type='cuda', index=\d+\)", "'cpu'", body)
    body = re.sub(r"torch\.ops\.vllm_ir\.(\w+)(?:\.\w+)?\(", r"_vllm_ir_native['\1'](", body)
    native = {name: getattr(ir_ops, name).impls["native"].impl_fn
              for name in set(re.findall(r"_vllm_ir_native\['(\w+)'\]", body))}
    body = re.sub(r"(?<![\w.'\"])(nan|inf)(?![\w'\"])", r"float('\1')", body)  # printed floats
    scope = {"torch": torch, "_vllm_ir_native": native}
    exec("from __future__ import annotations\n" + body, scope)  # Python that vLLM's cache holds
    module = scope[f"submod_{index}"]()
    args = []
    for name, param in inspect.signature(module.forward).parameters.items():
        note = str(param.annotation).strip("'\"")
        if note.startswith("Sym("):
            args.append(tokens)
            continue
        m = re.fullmatch(r"(\w+)\[(.*)\]", note)
        if m is None or m.group(1) not in DTYPES:
            raise ValueError(f"submod_{index}: argument {name} has annotation {note!r}, not a tensor "
                             f"of {sorted(DTYPES)}")
        sizes = [d.strip() for d in m.group(2).split(",") if d.strip()]  # "f32[]": a scalar
        dims = [int(d) if d.isdigit() else tokens for d in sizes]
        dtype = DTYPES[m.group(1)]
        t = torch.randn(*dims).to(dtype) if dtype.is_floating_point else torch.randint(0, 100, dims, dtype=dtype)
        if sizes and not sizes[0].isdigit():
            torch._dynamo.mark_dynamic(t, 0)
        args.append(t)
    return module.forward, args


def order_modes(cp, tokens: int | None = None) -> list:
    """(MIXPREC_X_WGMMA_ORDER mode, post-grad passes, Inductor options), as compile_passes.install
    sets them on a GPU that runs the wgmma kernels. Given the batch's tokens, the passes only
    past WGMMA_ORDER_AFTER_TOKENS, as vLLM's compile ranges run them."""
    modes = [("0", [], {}), ("codes", [cp.WgmmaActOrder()], {}),
             ("input", [cp.WgmmaActOrder(all_shapes=True, input_order=True)], {}),
             ("input_fused", [cp.WgmmaActOrder(all_shapes=True, input_order=True)],
              {"realize_reads_threshold": cp.INPUT_FUSED_REALIZE_READS})]
    if tokens is not None and tokens <= cp.WGMMA_ORDER_AFTER_TOKENS:
        modes = [(mode, [], options) for mode, _, options in modes]
    return modes


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_compiled_linear as bench
    from vllm_mixprec import formats as F
    from vllm_mixprec import kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=1024, help="input channels (a multiple of 128)")
    ap.add_argument("--m", type=int, default=7, help="tokens")
    ap.add_argument("--rotation", choices=F.ACT_ROTATIONS, default="hadamard64",
                    help="the W4Ax layer's 4-bit blocks' rotation")
    ap.add_argument("--perm", choices=F.ACT_PERM_FORMS, default="blocks",
                    help="the W4Ax layer's act_perm: whole blocks moved (a default checkpoint) or "
                         "any channel anywhere (--a8-select channels)")
    ap.add_argument("--code", help="write the wrappers to this prefix (PREFIX_w4a8.py, ...)")
    ap.add_argument("--served-graph", metavar="PATH",
                    help="instead: vLLM's compile cache (a folder or .tgz with backbone/"
                         "computation_graph.py); prints submodule --submod's kernels per "
                         "MIXPREC_X_WGMMA_ORDER mode")
    ap.add_argument("--submod", type=int, default=2, help="the piecewise submodule (2: layer 0's "
                    "o_proj .. layer 1's QKV in a Llama)")
    ap.add_argument("--bytes", action="store_true", help="--served-graph: print Inductor's estimate "
                    "of the bytes each mode's Triton kernels move (MB) instead of the kernels")
    args = ap.parse_args()
    if args.served_graph:
        from vllm_mixprec import compile_passes as cp
        fn, inputs = served_submodule(args.served_graph, args.submod, args.m)
        for mode, passes, options in order_modes(cp, args.m):
            options = {**options, cp.HOOK: cp.MixprecPostGrad(passes)}
            if args.bytes:
                mb = estimated_mb(triton_wrapper(fn, *inputs, options={**options, "benchmark_kernel": True}))
                print(f"{mode:12s} {sum(mb):8.3f} MB: {' '.join(f'{x:.3f}' for x in mb)}")
                continue
            found = launches(triton_wrapper(fn, *inputs, options=options))
            print(f"{mode:12s} {len(found):2d} Triton kernels: {' '.join(found)}")
        return 0
    gen = torch.Generator().manual_seed(0)
    x, res = ((torch.randn(args.m, args.k, generator=gen)).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(args.k, generator=gen) + 0.5).to(torch.bfloat16)
    kernels._FUSE_ACT_QUANT = True
    w4ax_args = {"share": 0.25, "rotation": args.rotation, "perm": args.perm}
    for name, w4ax, mode in (("w4a8", None, "traced"), ("w4ax_traced", w4ax_args, "traced"),
                             ("w4ax_kernel", w4ax_args, "kernel")):
        kernels._W4AX_QUANT = mode
        layer = bench.layer_of(256, args.k, gen, w4ax, device="cpu", impl="reference")
        wrapper = triton_wrapper(bench.layer_fn("norm", layer), x, res, w)
        ops = sorted(set(re.findall(r"torch\.ops\.mixprec\.(\w+)\.default\(", wrapper)))
        found = launches(wrapper)
        print(f"{name:12s} {len(found):2d} Triton kernels, then {' '.join(ops)}: {' '.join(found)}")
        if args.code:
            with open(f"{args.code}_{name}.py", "w") as f:
                f.write(wrapper)
    return 0


if __name__ == "__main__":
    sys.exit(main())
