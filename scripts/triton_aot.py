#!/usr/bin/env python3
"""Compile the Triton attention kernels for a GPU architecture without a GPU, and read their
register use from ptxas (both ship with Triton). Used by tests/attention_backend/
test_attn_compile.py; run alone it prints the KV4 decode kernel's registers per launch config
(docs/ATTENTION.md, "Decode registers per config"), or with --loop the SASS opcode counts of
one config's page loop (docs/ATTENTION.md, "the decode loop is instruction-bound"):

  python scripts/triton_aot.py [--arch 90] [--loop 128,2,2]

TRITON_INTERPRET must be unset (the interpreter does not compile).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

DT = {"fp16": tl.float16, "bf16": tl.bfloat16}


def compile_kernel(fn, ptrs: dict, consts: dict, arch: int, floats=(), **opts):
    """triton.compile of a @triton.jit fn: `ptrs` name -> pointer type, `floats` the fp32
    scalars, every other non-constexpr argument i32; pointers and strides 16-divisible.
    Constexprs left out of `consts` take their defaults, as a launch would give them."""
    consts = {**{p.name: p.default for p in fn.params
                 if p.is_constexpr and p.has_default and p.name not in consts}, **consts}
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
    hint = [(i,) for i, n in enumerate(fn.arg_names) if n in ptrs or n.startswith("stride")]
    attrs = {k: [["tt.divisibility", 16]] for k in hint}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", arch, 32),
                          options=opts)


def attn_ptrs(kv4: bool, dt: str) -> dict:
    """Pointer types of the paged-attention kernels' arguments."""
    return {"q_ptr": f"*{dt}", "out_ptr": f"*{dt}", "part_o_ptr": "*fp32",
            "part_lse_ptr": "*fp32", "merge_cnt_ptr": "*i32",
            "codes_ptr": "*u8" if kv4 else "*i8",
            "meta_ptr": "*fp16" if kv4 else "*fp32", "bt_ptr": "*i32",
            "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "smooth_ptr": "*fp32",
            "kb_ptr": "*fp32", "steps_ptr": "*i64", "pairs_ptr": "*i32",
            "res_k_ptr": f"*{dt}", "res_v_ptr": f"*{dt}", "sob_ptr": "*i32",
            "tags_ptr": "*i32", "key_ptr": f"*{dt}", "val_ptr": f"*{dt}", "lse_ptr": "*fp32"}


def ptxas_usage(kernel, arch: int) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) that Triton's ptxas reports for the PTX."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        err = subprocess.run([ptxas, f"-arch=sm_{arch}{'a' if arch >= 90 else ''}", "-v", f.name,
                              "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", err)
    spill = re.search(r"(\d+) bytes spill stores", err)
    return int(regs.group(1)), int(spill.group(1)) if spill else 0


def sass_loop_profile(kernel) -> dict:
    """Opcode counts of the kernel's longest loop (the SASS between a backward branch and its
    target), from Triton's own cuobjdump: the instructions one warp issues per iteration.
    Returns {"instructions": n, "opcodes": {opcode: count}} (opcode without modifiers)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    line = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
    ins = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in line.finditer(sass)]
    loops = []  # (target, branch) of every backward branch
    for addr, op, args in ins:
        target = re.match(r"\s*0x([0-9a-f]+)", args)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    if not loops:
        return {"instructions": 0, "opcodes": {}}
    lo, hi = max(loops, key=lambda loop: loop[1] - loop[0])
    body = Counter(op.split(".")[0] for a, op, _ in ins if lo <= a <= hi)
    return {"instructions": sum(body.values()), "opcodes": dict(body.most_common())}


def decode_common(A) -> dict:
    """Constexprs of the KV4 decode page kernel as the backend launches it at D = 128, G = 4."""
    return dict(B=16, D=128, G=4, G_PAD=16, BLOCK_R=16, NUM_SPLITS=2, KV4=True,
                HAS_SMOOTH=False, HAS_KB=False, NP=16, KB_V=64, HAS_RES=True, DT=tl.bfloat16,
                BLOCK_M=1, DECODE=True, FAST_UNPACK=True, CHUNK_MODE=A.CHUNK_CACHE.value,
                TAIL=A.TAIL_FINISH.value)


def main(argv=None) -> None:
    from vllm_mixprec.kernels.triton import attention as A

    p = argparse.ArgumentParser(description="KV4 decode kernel registers per launch config")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--loop", metavar="BLOCK_N,WARPS,STAGES", default=None,
                   help="print the SASS opcode counts of one config's page loop instead")
    args = p.parse_args(argv)
    common = decode_common(A)
    if args.loop:
        bn, warps, stages = (int(v) for v in args.loop.split(","))
        k = compile_kernel(A._paged_attn_kernel, attn_ptrs(True, "bf16"), dict(common, BLOCK_N=bn),
                           args.arch, ("qk_scale",), num_warps=warps, num_stages=stages)
        prof = sass_loop_profile(k)
        print(f"({bn}, {warps}, {stages}): {prof['instructions']} instructions per warp per "
              f"{bn}-token tile; registers {ptxas_usage(k, args.arch)[0]}")
        print("  " + ", ".join(f"{op} {n}" for op, n in prof["opcodes"].items()))
        return
    print("BLOCK_N warps stages cap  registers spill_B warps/SM")
    for bn in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3):
                for cap in (0, 128, 168):
                    opts = dict(num_warps=warps, num_stages=stages, **({"maxnreg": cap} if cap else {}))
                    k = compile_kernel(A._paged_attn_kernel, attn_ptrs(True, "bf16"),
                                       dict(common, BLOCK_N=bn), args.arch, ("qk_scale",), **opts)
                    regs, spill = ptxas_usage(k, args.arch)
                    held = (65536 // (regs * 32 * warps)) * warps  # whole CTAs
                    print(f"{bn:7d} {warps:5d} {stages:6d} {cap or '-':>4} {regs:10d} {spill:7d} "
                          f"{min(held, 64):8d}", flush=True)


if __name__ == "__main__":
    main()
