"""Lint for the Triton modules: a global a @triton.jit function reads must compare equal to
itself. Triton re-checks each global a kernel used on every launch with ==, so a NaN
constexpr global makes every launch after the first fail on the GPU ("Global variable ...
has changed since we compiled this kernel"), which the CPU interpreter does not check.
"""
import importlib
import math
import pkgutil

import triton.language as tl

import vllm_mixprec.kernels.triton as triton_pkg


def _modules():
    for info in pkgutil.iter_modules(triton_pkg.__path__):
        yield importlib.import_module(f"{triton_pkg.__name__}.{info.name}")


def test_no_nan_globals_in_triton_modules():
    mods = list(_modules())
    assert mods, "no Triton modules found"
    bad = []
    for mod in mods:
        for name, value in vars(mod).items():
            v = value.value if isinstance(value, tl.constexpr) else value
            if isinstance(v, float) and math.isnan(v):
                bad.append(f"{mod.__name__}.{name}")
    assert not bad, f"NaN globals break Triton's relaunch check; inline float('nan'): {bad}"
