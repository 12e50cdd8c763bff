"""The csrc/ ops (TORCH_LIBRARY namespace `mixprec_C`), loaded from vllm_mixprec/_C*.so.

Loading the library does not initialise CUDA. Every function here has the signature of
its counterpart in reference.py.
"""
from __future__ import annotations

import glob
import os

import torch

_LIB_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_state: dict = {}


def _load() -> None:
    if _state:
        return
    libs = sorted(glob.glob(os.path.join(_LIB_DIR, "_C*.so")))
    if not libs:
        _state["error"] = "no vllm_mixprec/_C*.so: build with `pip install -e .` where nvcc is present"
        return
    try:
        torch.ops.load_library(libs[0])
        _state["path"] = libs[0]
    except OSError as e:  # e.g. the CUDA runtime is missing on this machine
        _state["error"] = f"{libs[0]} failed to load: {e}"


def available() -> bool:
    _load()
    return "path" in _state


def load_error() -> str | None:
    _load()
    return _state.get("error")


def supports_device(device: torch.device) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def has_w4ax() -> bool:
    return available() and hasattr(torch.ops.mixprec_C, "w4ax_gemm")


def prepare_weights(layer: torch.nn.Module) -> None:
    raise NotImplementedError("csrc W4A8 GEMM: not written yet")


def quantize_act(x, smooth=None):
    raise NotImplementedError("csrc quantize_act: not written yet")


def w4a8_gemm(xq, x_scale, qweight, group_scale, group_offset, channel_scale, bias=None,
              out_dtype=torch.float16):
    raise NotImplementedError("csrc w4a8_gemm: not written yet")
