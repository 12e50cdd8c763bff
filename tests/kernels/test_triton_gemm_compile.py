"""The W4Ax activation kernel compiled for sm_90 and sm_80 without a GPU (aot_helpers): its fast
Hadamard transform reshapes, permutes, splits and joins register tiles, layouts the CPU
interpreter never builds."""
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
    for rotation in ("hadamard", "hadamard64"):
        n = F.act_rotation_size(rotation)
        for dt in ("bf16", "fp32"):
            k = compile_kernel(G._w4ax_act_input_kernel,
                               {"x_ptr": f"*{dt}", "perm_ptr": "*i32", "smooth_ptr": "*fp32", "out_ptr": "*fp32"},
                               dict(HAS_SMOOTH=True, BM=G.W4AX_INPUT_ROWS, BLOCK=F.ACT_BLOCK,
                                    LOG2_N=n.bit_length() - 1, NORM=F.hadamard_norm(n)), arch, num_warps=4)
            assert ptxas_usage(k, arch)[1] == 0, ptxas_usage(k, arch)
            ptx = k.asm["ptx"]
            # the transform's bits are the reference's: additions, then one multiply, no FMA
            assert "fma" not in ptx and ptx.count("add.f32") == ptx.count("sub.f32") > 0, rotation
    print("compiled")
''')


@pytest.mark.skipif(not ptxas_available(), reason="triton's bundled ptxas is missing")
@pytest.mark.parametrize("arch", [90, 80])
def test_w4ax_act_input_compiles_for_gpu(arch):
    run_aot(SCRIPT, arch)
