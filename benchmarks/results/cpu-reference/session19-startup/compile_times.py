"""Time triton.compile (sm_90, no GPU) of the variants FULL decode capture needs.
Usage: python compile_times.py NAME...   (fresh TRITON_CACHE_DIR per process: cold compiles)"""
import os, sys, time, json, subprocess, tempfile
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/scripts")
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_aot import attn_ptrs, compile_kernel, ptxas_usage
from vllm_mixprec.kernels.triton import attention as A, residual_directory as RD, kv_cache as K

ARCH = 90
common = dict(B=16, D=128, G=4, G_PAD=16, BLOCK_R=16, KV4=True, HAS_SMOOTH=False, HAS_KB=False,
              NP=16, HAS_RES=True, DT=tl.bfloat16, MIN_TILES=1)

def page(s, bn, w, st, tail, fused, maxnreg):
    c = dict(common, NUM_SPLITS=s, BLOCK_N=bn, KB_V=min(bn, 64), TAIL=tail, BLOCK_M=1, DECODE=True,
             FAST_UNPACK=True, CHUNK_MODE=A.CHUNK_CACHE.value, PDL=False, MERGE_FUSED=fused, G_ROWS=4)
    o = dict(num_warps=w, num_stages=st, **({"maxnreg": maxnreg} if maxnreg else {}))
    return lambda: compile_kernel(A._paged_attn_kernel, attn_ptrs(True, "bf16"), c, ARCH, ("qk_scale",), **o)

def finish(s, bn, tail):
    c = dict(common, NUM_SPLITS=s, BLOCK_N=bn, KB_V=min(bn, 64), TAIL=tail, G_ROWS=4, PDL=False)
    return lambda: compile_kernel(A._decode_finish_kernel, attn_ptrs(True, "bf16"), c, ARCH, ("qk_scale",), num_warps=4)

def assign(bw, bp=4096):
    fn = RD._residual_assign_kernel
    ptrs = {"bt_ptr": "*i32", "seq_ptr": "*i32", "qsl_ptr": "*i32", "sm_ptr": "*i64", "sob_ptr": "*i32",
            "bos_ptr": "*i32", "last_ptr": "*i64", "tags_ptr": "*i32", "step_ptr": "*i64", "scratch_ptr": "*i64"}
    c = dict(R=16, B=16, BPW=2, BLOCK_W=bw, BLOCK_P=bp, BLOCK_T=RD.TOKEN_TILE)
    return lambda: compile_kernel(fn, ptrs, c, ARCH, num_warps=8)

def store():
    fn = K._quantize_store_kernel
    ptrs = {n: "*bf16" for n in ("key_ptr", "value_ptr", "res_k_ptr", "res_v_ptr")}
    ptrs.update(slot_ptr="*i64", codes_ptr="*u8", meta_ptr="*fp16", smooth_ptr="*bf16", kb_ptr="*fp32",
                steps_ptr="*i64", pos_ptr="*bf16", slot_of_block_ptr="*i32")
    c = dict(B=16, D=128, KV4=True, HAS_SMOOTH=False, HAS_KB=False, HAS_RES=True)
    return lambda: compile_kernel(fn, ptrs, c, ARCH, num_warps=1)

F, P = A.TAIL_FINISH.value, A.TAIL_PROGRAM.value
V = {"P1": page(1, 128, 2, 2, F, False, 0), "F1": finish(1, 128, F),
     "P2": page(2, 128, 2, 2, F, False, 0), "F2": finish(2, 128, F),
     "P4": page(4, 128, 2, 2, F, False, 0), "F4": finish(4, 128, F),
     "P8f": page(8, 64, 4, 3, P, True, 168), "P16f": page(16, 64, 4, 3, P, True, 168),
     "P32f": page(32, 64, 4, 3, P, True, 168), "P32f_nocap": page(32, 64, 4, 3, P, True, 0),
     "A1024": assign(1024), "A256": assign(256), "A64": assign(64), "Q": store(),
     # candidate fixes
     "A4096": assign(4096), "A1024_p1024": assign(1024, 1024), "A64_p1024": assign(64, 1024),
     "F32": finish(32, 64, F), "P32_kern": page(32, 64, 4, 3, F, False, 0),
     "P8_kern_128": page(8, 128, 2, 2, F, False, 0)}

if __name__ == "__main__":
    for name in sys.argv[1:]:
        t = time.perf_counter(); k = V[name](); dt = time.perf_counter() - t
        ptx = k.asm["ptx"]
        t2 = time.perf_counter(); regs, spill = ptxas_usage(k, ARCH); dptx = time.perf_counter() - t2
        print(json.dumps(dict(name=name, compile_s=round(dt, 2), ptxas_rerun_s=round(dptx, 2), regs=regs,
                              spill=spill, ptx_lines=ptx.count("\n"))), flush=True)
