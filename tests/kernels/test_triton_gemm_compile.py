"""The W4Ax quantize kernel with its rotation, compiled for sm_90 and sm_80 without a GPU
(aot_helpers): the fast Hadamard transform reshapes, permutes, splits and joins register tiles,
layouts the CPU interpreter never builds; the split-row kernel's two branches hold tiles of
different shapes, which only the compiler checks."""
from __future__ import annotations

import textwrap

import pytest
from aot_helpers import ptxas_available, run_aot

SCRIPT = textwrap.dedent(r'''
    import sys
    from triton_aot import compile_kernel, ptxas_usage
    from vllm_mixprec import formats as F
    from vllm_mixprec.kernels.triton import gemm as G

    arch = int(sys.argv[1])
    ptrs = {"x_ptr": "*bf16", "perm_ptr": "*i32", "smooth_ptr": "*bf16", "x8_ptr": "*i8",
            "s8_ptr": "*fp32", "x4_ptr": "*u8", "s4_ptr": "*fp32"}
    # Llama-3-70B's down input all 4-bit (two passes), Llama-3-8B's down (the longest row in one
    # pass) and QKV inputs, all 4-bit and a quarter at 8 bits, and a short row
    for k, k8 in ((28672, 0), (14336, 0), (4096, 1024), (1536, 384)):
        # the permutation read a channel an entry, and (default layers) a block an entry
        for rotation, unit in (("hadamard", 1), ("hadamard64", 1), ("hadamard64", F.ACT_BLOCK)):
            consts, warps = G._quant_launch_config(k, k8, True,
                                                   rotation_size=F.act_rotation_size(rotation))
            assert consts["ONE_PASS"] == (k != 28672), (k, k8, consts)
            kern = compile_kernel(G._quant_act_kernel, ptrs, dict(consts, PERM_UNIT=unit, HAS_SMOOTH=True),
                                  arch, num_warps=warps)
            assert ptxas_usage(kern, arch)[1] == 0, (k, k8, rotation, unit, ptxas_usage(kern, arch))
            ptx = kern.asm["ptx"]
            # the transform's bits are the reference's: additions, then one multiply, no FMA
            assert "fma" not in ptx and ptx.count("sub.f32") > 0, (k, k8, rotation)
    # the split rows (W4AX_SPLIT_BLOCKS blocks a program) and their poisoning pass
    for r in (4, 8, 16):
        G.W4AX_SPLIT_BLOCKS = r
        for rotation in ("none", "hadamard64"):
            consts, warps = G._quant_blocks_config(F.act_rotation_size(rotation))
            for unit in (1, F.ACT_BLOCK) if r == 8 else (F.ACT_BLOCK,):
                kern = compile_kernel(G._quant_act_blocks_kernel, dict(ptrs, bad_ptr="*i32"),
                                      dict(consts, PERM_UNIT=unit, HAS_SMOOTH=True, PDL=arch >= 90),
                                      arch, num_warps=warps)
                assert ptxas_usage(kern, arch)[1] == 0, (r, rotation, unit, ptxas_usage(kern, arch))
    kern = compile_kernel(G._quant_act_blocks_poison_kernel, dict(ptrs, bad_ptr="*i32"),
                          dict(ACT_BLOCK=F.ACT_BLOCK, CHUNKS_P2=32, BLOCK=1024, PDL=arch >= 90),
                          arch, num_warps=1)
    assert "st.global" in kern.asm["ptx"]
    print("compiled")
''')


@pytest.mark.skipif(not ptxas_available(), reason="triton's bundled ptxas is missing")
@pytest.mark.parametrize("arch", [90, 80])
def test_w4ax_quantize_with_rotation_compiles_for_gpu(arch):
    run_aot(SCRIPT, arch)


GEMM_SCRIPT = textwrap.dedent(r'''
    import sys
    from triton_gemm_tiles import tile_usage
    from vllm_mixprec.kernels.triton import gemm as G

    arch = int(sys.argv[1])
    # the default tiles (default_config) of the Llama-3-8B down and 70B QKV-sized shapes, W4A8 and
    # W4Ax, at 1-16 and 32 tokens, at 33-64 and past 64 tokens (W4A8: 64x64, 128x64 and 128x128;
    # W4Ax: 128x64 and 128x128 on 8 warps), with their split-K epilogues, as that arch picks them
    for w4ax in (False, True):
        for m in (1, 16, 32, 48, 256, 1024):
            for k, n in ((14336, 4096), (4096, 28672)):
                c = G.default_config(m, n, k, 128 if w4ax else k, 132, w4ax, sm_major=arch // 10)
                r = tile_usage(c, arch, w4ax, group=128)
                print(w4ax, m, k, n, c, r["registers"], r["spill_bytes"])
                # the weight-bound decode tiles, 64 channels wide up to 64 tokens since session 78,
                # must not spill; the large tiles may: on the H100 two CTAs an SM outweighed the
                # spill (session 75, benchmarks/NOTES-gemm.md, "Tile choices")
                assert m > 64 or r["spill_bytes"] == 0, (w4ax, m, k, n, r)
    print("compiled")
''')


@pytest.mark.skipif(not ptxas_available(), reason="triton's bundled ptxas is missing")
@pytest.mark.parametrize("arch", [90, 80])
def test_gemm_default_tiles_compile_for_gpu(arch):
    """The W4A8/W4Ax GEMM's default tiles through Triton's GPU compiler (wgmma layouts on sm_90,
    mma.sync on sm_80): the interpreter builds none of it."""
    run_aot(GEMM_SCRIPT, arch)
