"""Compile the attention kernels for sm_90 and sm_80 without a GPU (aot_helpers): the CPU
interpreter never sees the GPU-only code (the inline PTX unpack, layouts, software pipelining)."""
from __future__ import annotations

import textwrap

import pytest
from aot_helpers import ptxas_available, run_aot

SCRIPT = textwrap.dedent(r'''
    import sys
    import triton
    import triton.language as tl
    from triton_aot import attn_ptrs, compile_kernel as compile_
    from vllm_mixprec.kernels.triton import attention as A, kv_cache as K

    DT = {"fp16": tl.float16, "bf16": tl.bfloat16}
    arch = int(sys.argv[1])
    for kv4, dt, decode, d, g, kb in [
            (True, "bf16", True, 128, 4, False), (False, "bf16", True, 128, 8, False),
            (True, "fp16", False, 64, 4, False), (False, "fp16", False, 256, 1, False),
            (True, "bf16", True, 128, 6, True), (True, "bf16", False, 128, 6, True),
            (False, "fp16", True, 256, 4, True)]:
        gpad = max(16, triton.next_power_of_2(g)) if decode else triton.next_power_of_2(g)
        block_n = 64 if d <= 128 else 32
        common = dict(B=16, D=d, G=g, G_PAD=gpad, BLOCK_R=16, NUM_SPLITS=4 if decode else 1,
                      KV4=kv4, HAS_SMOOTH=True, HAS_KB=kb, NP=16, KB_V=min(block_n, 64),
                      HAS_RES=True, DT=DT[dt], TAIL=A.TAIL_FINISH.value)
        main = dict(common, BLOCK_M=1 if decode else max(1, 64 // gpad),
                    BLOCK_N=block_n, DECODE=decode, FAST_UNPACK=True)
        # prefill: the chunk in our loop, and merged from FlashAttention's output
        for mode in ([A.CHUNK_CACHE] if decode else [A.CHUNK_TRITON, A.CHUNK_MERGE]):
            compile_(A._paged_attn_kernel, attn_ptrs(kv4, dt), dict(main, CHUNK_MODE=mode.value), arch,
                     ("qk_scale",), num_warps=4, num_stages=3)
        if decode:
            compile_(A._decode_finish_kernel, attn_ptrs(kv4, dt),
                     dict(common, BLOCK_N=block_n, G_ROWS=triton.next_power_of_2(g)),
                     arch, ("qk_scale",),
                     num_warps=4)
    # the tuned decode tile under a register cap (attention.decode_maxnreg) reaches ptxas
    common = dict(B=16, D=128, G=4, G_PAD=16, BLOCK_R=16, NUM_SPLITS=2, KV4=True,
                  HAS_SMOOTH=False, HAS_KB=False, NP=16, KB_V=64, HAS_RES=True, DT=tl.bfloat16,
                  TAIL=A.TAIL_FINISH.value)
    capped = compile_(A._paged_attn_kernel, attn_ptrs(True, "bf16"),
                      dict(common, BLOCK_M=1, BLOCK_N=128, DECODE=True, FAST_UNPACK=True,
                           CHUNK_MODE=A.CHUNK_CACHE.value), arch,
                      ("qk_scale",), num_warps=2, num_stages=2, maxnreg=128)
    assert ".maxnreg 128" in capped.asm["ptx"], "maxnreg did not reach the PTX"
    # the default big-batch decode tile must not spill (docs/ATTENTION.md, decode registers)
    from triton_aot import ptxas_usage
    tuned = compile_(A._paged_attn_kernel, attn_ptrs(True, "bf16"),
                     dict(common, BLOCK_M=1, BLOCK_N=128, DECODE=True, FAST_UNPACK=True,
                          CHUNK_MODE=A.CHUNK_CACHE.value), arch, ("qk_scale",), num_warps=2, num_stages=2)
    assert ptxas_usage(tuned, arch)[1] == 0, ptxas_usage(tuned, arch)
    # the page loop's SASS as docs/ATTENTION.md counts it (scripts/triton_aot.py --loop)
    from triton_aot import sass_loop_profile
    loop = sass_loop_profile(tuned)
    hmma = loop["opcodes"].get("HMMA", 0)
    assert hmma > 0 and (arch != 90 or hmma == 128), loop["opcodes"]
    assert 1000 < loop["instructions"] < 4000, loop["instructions"]
    def decode_pair(consts, kv4, finish_g_pad):
        """The decode page kernel (64-token tiles) and the finish kernel that follows it."""
        page = compile_(A._paged_attn_kernel, attn_ptrs(kv4, "bf16"),
                        dict(consts, BLOCK_M=1, BLOCK_N=64, DECODE=True, FAST_UNPACK=True,
                             CHUNK_MODE=A.CHUNK_CACHE.value), arch, ("qk_scale",),
                        num_warps=4, num_stages=3)
        fin = compile_(A._decode_finish_kernel, attn_ptrs(kv4, "bf16"),
                       dict(consts, BLOCK_N=64, G_PAD=finish_g_pad, G_ROWS=4), arch, ("qk_scale",),
                       num_warps=4)
        return page, fin

    # nor the small-batch tile that attends the residual tail in its last split or as a
    # program of its own, nor the merge-only finish kernel after it (attention.decode_tail_mode)
    for kv4 in (True, False):
        for tail in (A.TAIL_LAST_SPLIT, A.TAIL_PROGRAM):
            small, merge = decode_pair(dict(common, NUM_SPLITS=32, KV4=kv4, TAIL=tail.value), kv4, 4)
            for k in (small, merge):
                assert ptxas_usage(k, arch)[1] == 0, ptxas_usage(k, arch)
            assert "griddepcontrol" not in small.asm["ptx"] + merge.asm["ptx"]  # PDL off
    # MIXPREC_ATTN_MERGE=fused: the page kernel counts its stored partial with one thread's
    # acq_rel atomic after a barrier, and the last program merges (attention.decode_merge_mode)
    for kv4 in (True, False):
        for tail in (A.TAIL_LAST_SPLIT, A.TAIL_PROGRAM):
            fused = compile_(A._paged_attn_kernel, attn_ptrs(kv4, "bf16"),
                             dict(common, NUM_SPLITS=32, KV4=kv4, TAIL=tail.value, BLOCK_M=1,
                                  BLOCK_N=64, DECODE=True, FAST_UNPACK=True,
                                  CHUNK_MODE=A.CHUNK_CACHE.value, MERGE_FUSED=True, G_ROWS=4),
                             arch, ("qk_scale",), num_warps=4, num_stages=3)
            ptx = fused.asm["ptx"]
            assert ptx.count("atom.global.gpu.acq_rel.add") == 1, "one counted arrival"
            assert "ld.global.cg" in ptx  # the partials of other SMs, read past L1
            assert ptxas_usage(fused, arch)[1] == 0, ptxas_usage(fused, arch)
    # ...and the multi-row default, kv4 + tail program under the register cap, does not spill
    capped = compile_(A._paged_attn_kernel, attn_ptrs(True, "bf16"),
                      dict(common, NUM_SPLITS=16, TAIL=A.TAIL_PROGRAM.value, BLOCK_M=1,
                           BLOCK_N=64, DECODE=True, FAST_UNPACK=True,
                           CHUNK_MODE=A.CHUNK_CACHE.value, MERGE_FUSED=True, G_ROWS=4),
                      arch, ("qk_scale",), num_warps=4, num_stages=3,
                      maxnreg=A.FUSED_ROWS_MAXNREG)
    regs, spill = ptxas_usage(capped, arch)
    assert regs <= A.FUSED_ROWS_MAXNREG and spill == 0, (regs, spill)
    # MIXPREC_ATTN_PDL (sm_90+): the page kernel lets the finish kernel launch, which waits
    # for it before reading a partial (attention.decode_pdl)
    if arch >= 90:
        for tail in (A.TAIL_FINISH, A.TAIL_LAST_SPLIT):
            page, fin = decode_pair(dict(common, NUM_SPLITS=16, TAIL=tail.value, PDL=True),
                                    True, 16 if tail == A.TAIL_FINISH else 4)
            assert "griddepcontrol.launch_dependents" in page.asm["ptx"]
            assert "griddepcontrol.wait" in fin.asm["ptx"]
    # the residual directory's one-program update (kernels/triton/residual_directory.py)
    from vllm_mixprec.kernels.triton import residual_directory as RD
    rd_ptrs = {"bt_ptr": "*i32", "seq_ptr": "*i32", "qsl_ptr": "*i32", "sm_ptr": "*i64",
               "sob_ptr": "*i32", "bos_ptr": "*i32", "last_ptr": "*i64", "tags_ptr": "*i32",
               "step_ptr": "*i64", "scratch_ptr": "*i64"}
    rd = compile_(RD._residual_assign_kernel, rd_ptrs, dict(R=16, B=16, BPW=2, BLOCK_W=4096,
                  BLOCK_P=1024, BLOCK_T=1024), arch, num_warps=8)
    assert ptxas_usage(rd, arch)[1] == 0, ptxas_usage(rd, arch)
    for kv4 in (True, False):
        ptrs = {"key_ptr": "*bf16", "value_ptr": "*bf16", "slot_ptr": "*i64",
                "codes_ptr": "*u8" if kv4 else "*i8", "meta_ptr": "*fp16" if kv4 else "*fp32",
                "smooth_ptr": "*fp32", "kb_ptr": "*fp32", "steps_ptr": "*i64", "pos_ptr": "*i32",
                "res_k_ptr": "*bf16", "res_v_ptr": "*bf16", "slot_of_block_ptr": "*i32"}
        for kb in (False, True):
            compile_(K._quantize_store_kernel, ptrs, dict(B=16, D=128, KV4=kv4, HAS_SMOOTH=True,
                                                          HAS_KB=kb, HAS_RES=True),
                     arch, num_warps=1)
    print("compiled")
''')


@pytest.mark.skipif(not ptxas_available(), reason="triton's bundled ptxas is missing")
@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_for_gpu(arch):
    run_aot(SCRIPT, arch)
