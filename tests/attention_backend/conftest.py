"""Shared set-up of the attention-backend tests.

Triton 3.6's CPU interpreter gets bfloat16 wrong in two places the kernels rely on:
  * create_dot multiplies bf16 operands as their raw uint16 bits: widen them to fp32 first
    (exact: bf16 is a prefix of fp32);
  * fp32 -> bf16 casts truncate, where GPUs round to nearest-even: round them.
With both fixed the interpreter computes what the GPU computes. The fix is applied around
each test of this directory only (autouse fixture), not to the rest of the session.
"""
import os
import sys

import numpy as np
import pytest

# --import-mode=importlib puts no test directory on sys.path; our helpers live here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _bf16_faithful(monkeypatch) -> None:
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    orig_dot, orig_cast = builder.create_dot, builder.cast_impl

    def widen(h):
        if h.dtype == tl.bfloat16:
            data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return orig_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):  # create_fp_trunc & co. dispatch through this
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = np.ascontiguousarray(src.data, dtype=np.float32)
            u = f.view(np.uint32).astype(np.uint64)
            rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round half to even on the cut bits
            out = np.where(np.isnan(f), (u >> 16) | 0x40, rne).astype(np.uint16)
            return interp.TensorHandle(out.reshape(np.shape(src.data)), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    monkeypatch.setattr(builder, "cast_impl", cast_impl)


@pytest.fixture(autouse=True)
def _attn_test_env(monkeypatch):
    import torch
    torch.manual_seed(0)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _bf16_faithful(monkeypatch)
