"""Shared test set-up.

Without a GPU, Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be set
before any kernel module is imported, so it is set here, first.
"""
import os
import sys
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"

# --import-mode=importlib puts no test directory on sys.path; shared helpers (the hypothesis
# strategies in mixprec_strategies.py) live here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Property-based tests (hypothesis): one fixed, derandomized profile, so that CI runs the
# same examples every time and a failure reproduces. No example database is written.
# HYPOTHESIS_PROFILE=explore draws fresh random examples (for local bug hunting).
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "ci", derandomize=True, deadline=None, database=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile(
        "explore", derandomize=False, deadline=None, database=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a dev dependency; the property tests importorskip it
    pass


@pytest.fixture
def repo_module(monkeypatch):
    """Load a script or benchmark of the repository by path (they are not a package):
    repo_module("benchmarks/bench_gemm.py"). It is registered in sys.modules for the test, since
    dataclasses look their module up there."""
    import importlib.util
    import pathlib

    def load(relpath: str):
        path = pathlib.Path(__file__).resolve().parents[1] / relpath
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, path.stem, mod)
        spec.loader.exec_module(mod)
        return mod
    return load


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_tp1():
    """vLLM's TP group at world size 1 over gloo: vLLM parameters need it to exist."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (init_distributed_environment, initialize_model_parallel)
    from vllm.distributed import parallel_state

    from vllm.config import DeviceConfig

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(cfg):
        if parallel_state._TP is None:
            path = os.path.join(tempfile.mkdtemp(), "dist_init")
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{path}", backend="gloo")
            initialize_model_parallel(1, 1)
        yield cfg


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    return torch.Generator().manual_seed(0)


@pytest.fixture
def gpu_float_semantics(monkeypatch):
    """Make the Triton interpreter round and compare floats as GPUs do, so that CPU tests
    see GPU behaviour (the property tests use it; tests/attention_backend/conftest.py has
    the bf16 part for its whole directory).

    * On a GPU, tl.maximum/tl.minimum (propagate_nan=NONE) and tl.clamp lower to IEEE
      maxNum/minNum (PTX max.f32), which return the non-NaN operand; the interpreter used
      np.maximum/np.clip, which propagate NaN, and so hid kernels that turn NaN into finite
      codes. (Its max/min reductions already use np.nanmax, like the GPU.)
    * fp32 -> bf16 casts: the interpreter truncates, and mangles subnormals (found by the
      property tests: a subnormal fp32 output became a wrong bf16 value); GPUs round to
      nearest-even (cvt.rn.bf16.f32), which the bit recipe below reproduces.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    b = interp.InterpreterBuilder
    monkeypatch.setattr(b, "create_maxnumf", lambda self, x, y: self.binary_op(x, y, np.fmax))
    monkeypatch.setattr(b, "create_minnumf", lambda self, x, y: self.binary_op(x, y, np.fmin))
    orig_clamp, orig_cast = b.create_clampf, b.cast_impl

    def clampf(self, arg, lo, hi, propagate_nans):
        if propagate_nans == tl.PropagateNan.ALL:
            return orig_clamp(self, arg, lo, hi, propagate_nans)
        return self.ternary_op(arg, lo, hi, lambda x, a, c: np.fmin(np.fmax(x, a), c))

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = np.ascontiguousarray(src.data, dtype=np.float32)
            u = f.view(np.uint32).astype(np.uint64)
            rne = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            out = np.where(np.isnan(f), (u >> 16) | 0x40, rne).astype(np.uint16)
            return interp.TensorHandle(out.reshape(np.shape(src.data)), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    monkeypatch.setattr(b, "create_clampf", clampf)
    monkeypatch.setattr(b, "cast_impl", cast_impl)
