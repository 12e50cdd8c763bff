"""Shared test set-up.

Without a GPU, Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be set
before any kernel module is imported, so it is set here, first.
"""
import os
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


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
