"""The plugin's MIXPREC_* settings in vLLM's torch.compile cache keys.

Why a patch: vLLM keys its compile caches (the AOT-compiled forward under
torch_compile_cache/torch_aot_compile/<hash> and Inductor's artifacts) on its config and on
`vllm.envs.compile_factors()`, which hashes only the variables listed in
`vllm.envs.environment_variables`. Several MIXPREC_* variables change the traced graph
(MIXPREC_TP_ACT_SCALE adds an all-gather to every row-parallel layer, MIXPREC_FUSE_ACT_QUANT and
MIXPREC_KERNEL pick other ops), so without this a second run with another value silently loads
the first run's graph. That happened in session 26: three TP=2 reruns meant to vary
MIXPREC_TP_ACT_SCALE, MIXPREC_GEMM_PDL and MIXPREC_KERNEL all loaded the first run's compiled
forward (docs/RELIABILITY.md). vLLM has no hook for a plugin's factors, so register() adds one
entry, MIXPREC_COMPILE_FACTORS, whose value is every MIXPREC_* variable set in the
environment: any of them, set or changed, gives a new key.
"""
from __future__ import annotations

import os

FACTOR = "MIXPREC_COMPILE_FACTORS"
PREFIX = "MIXPREC_"


def mixprec_env(environ=os.environ) -> str:
    """The MIXPREC_* variables of `environ`, sorted, as one string ("" when none is set)."""
    return ";".join(f"{k}={v}" for k, v in sorted(environ.items())
                    if k.startswith(PREFIX) and k != FACTOR)


def install() -> bool:
    """Add FACTOR to vLLM's hashed environment variables (once). Returns whether it is there."""
    try:
        import vllm.envs as envs
    except ImportError:
        return False
    table = getattr(envs, "environment_variables", None)
    if not isinstance(table, dict) or not hasattr(envs, "compile_factors"):
        return False  # another vLLM layout: nothing to extend
    table.setdefault(FACTOR, mixprec_env)
    return True
