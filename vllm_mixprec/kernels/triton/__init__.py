"""Triton kernels: the portable path (sm80+), and what the CPU interpreter tests."""
from __future__ import annotations

import functools

import torch


def capability_major(device: torch.device) -> int:
    """A CUDA device's compute capability major, cached: the launch paths ask on every call."""
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]
