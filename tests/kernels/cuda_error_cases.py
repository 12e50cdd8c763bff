"""The csrc ops' error paths, run in a child process by test_cuda_gemm.py and scripts/gpu_check.sh.

Each case must raise a Python exception that names the problem. A C++ exception that does
not reach Python (a crash in the unwinder, an ABI mismatch of the host compiler) kills
the process: running the cases in a child turns that into one failed test with the name
of the case that crashed, instead of a dead test session.

    python tests/kernels/cuda_error_cases.py   # prints one line per case; exit 0 iff all pass
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# the helpers beside it, and the checkout: a child of pytest or a host without the package installed
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

from vllm_mixprec.kernels import cuda  # noqa: E402

from cuda_gemm_helpers import DEV, _gen, random_act, random_lqq  # noqa: E402


def _op_args(m=2, n=32, k=128, g=64):
    qw, gs, go, cs = random_lqq(n, k, g, _gen(1))
    pq, gp = cuda.repack_w4a8(qw, gs, go)
    xq, xs = random_act(m, k, _gen(2))
    return [xq, xs, pq, gp, cs, None, torch.float16]


def cases():
    """(name, expected exception type, message fragment, thunk)."""
    op = torch.ops.mixprec_C.w4a8_gemm
    a = _op_args()
    b = _op_args(m=72)
    qw, gs, go, cs = random_lqq(32, 128, 64, _gen(3))
    half = torch.float16
    return [
        ("N not a multiple of 16", RuntimeError, "multiple of 16",
         lambda: op(a[0], a[1], a[2], a[3], torch.ones(24, device=DEV), None, half)),
        ("K not a multiple of 64", RuntimeError, "multiple of 64",
         lambda: op(a[0][:, :96].contiguous(), a[1], a[2], a[3], a[4], None, half)),
        ("xq not int8", RuntimeError, "xq must be int8", lambda: op(a[0].float(), *a[1:])),
        ("xq on the CPU", RuntimeError, "CUDA tensor", lambda: op(a[0].cpu(), *a[1:])),
        ("qweight truncated", RuntimeError, "qweight must be the packed",
         lambda: op(a[0], a[1], a[2][:, :-16], *a[3:])),
        ("x_scale wrong length", RuntimeError, "x_scale must be float32", lambda: op(a[0], a[1][:1], *a[2:])),
        ("bias wrong length", RuntimeError, "bias must have shape",
         lambda: op(*a[:5], torch.ones(7, device=DEV), half)),
        ("int32 out_dtype", RuntimeError, "out_dtype", lambda: op(*a[:6], torch.int32)),
        ("decode kernel for M=72", RuntimeError, "decode kernels \\(0, 1\\) need M <= 64", lambda: op(*b, 0, 0)),
        ("python wrapper, N % 16", ValueError, "N \\(out_features\\) % 16",
         lambda: cuda.w4a8_gemm(a[0], a[1], qw[:24], gs[:24], go[:24], cs[:24])),
        ("quantize_act 3-D", RuntimeError, "quantize_act: x must be 2-D",
         lambda: cuda.quantize_act(torch.randn(2, 3, 64, device=DEV, dtype=half))),
        ("quantize_act smooth length", RuntimeError, "smooth must have shape",
         lambda: cuda.quantize_act(torch.randn(2, 64, device=DEV, dtype=half), torch.ones(32, device=DEV))),
    ]


def main() -> int:
    import re

    if not cuda.available():
        print(f"SKIP csrc ops not built: {cuda.load_error()}")
        return 0
    failed = 0
    for name, exc_type, pattern, thunk in cases():
        print(f"case: {name}", flush=True)  # the last line before a crash names the case
        try:
            thunk()
            torch.cuda.synchronize()
        except exc_type as e:
            if re.search(pattern, str(e)):
                print(f"  ok: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            print(f"  FAIL: message does not match {pattern!r}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 - report any other type as a failure
            print(f"  FAIL: {type(e).__name__}: {e}", flush=True)
        else:
            print("  FAIL: no exception", flush=True)
        failed += 1
    # the CUDA context survives the errors: a real call still works
    y = torch.ops.mixprec_C.w4a8_gemm(*_op_args())
    torch.cuda.synchronize()
    print(f"after the errors: w4a8_gemm -> {tuple(y.shape)} finite={bool(torch.isfinite(y).all())}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
