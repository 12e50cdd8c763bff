"""Compile a server's Triton kernel variants in parallel, before their first launch.

The decode attention and residual-directory kernels take a different constexpr variant at
different batch sizes (split count, tile, merge mode). Compiled at first use, they compile one
after another inside vLLM's CUDA-graph capture: 14 variants, about 100 s on a cold cache on the
H100 host (docs/STARTUP.md). Triton releases the GIL while it compiles, and Triton 3.6's
AsyncCompileMode lets `JITFunction.warmup` hand each compile to an executor, so threads of
this process compile them side by side and fill Triton's in-memory and disk caches under the
keys the later launches compute.

MIXPREC_PRECOMPILE=0 turns it off (each variant then compiles at its first launch, as before);
MIXPREC_PRECOMPILE_THREADS sets the thread count (default: the CPU count, at most 16).
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ... import envs

logger = logging.getLogger("vllm.mixprec")

ENV_ON = "MIXPREC_PRECOMPILE"
ENV_THREADS = "MIXPREC_PRECOMPILE_THREADS"


def enabled() -> bool:
    """Whether precompilation runs: on unless MIXPREC_PRECOMPILE=0, never in the interpreter
    (which compiles nothing)."""
    v = envs.get(ENV_ON)
    if v not in ("0", "1"):
        raise ValueError(f"{ENV_ON}={v!r}: expected 0 or 1")
    return v == "1" and os.environ.get("TRITON_INTERPRET") != "1"


def num_threads() -> int:
    n = envs.integer(ENV_THREADS, 1)
    return n if n is not None else max(1, min(16, os.cpu_count() or 1))


def compile_in_parallel(warmups: list[Callable[[], object]], what: str = "kernel") -> int:
    """Run `warmups` (calls of JITFunction.warmup) under AsyncCompileMode on a thread pool
    and wait for every compile; returns how many compiled (variants already in Triton's
    in-memory cache cost a lookup). A compile error is raised here, as the launch would have
    raised it."""
    from triton.runtime._async_compile import AsyncCompileMode
    if not warmups:
        return 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=num_threads(), thread_name_prefix="mixprec-compile") \
            as pool, AsyncCompileMode(pool) as mode:
        for warm in warmups:
            warm()
        compiled = len(mode.raw_futures)
    if compiled:
        logger.info("mixprec: compiled %d %s variants in parallel in %.1f s (%d threads)",
                    compiled, what, time.perf_counter() - t0, num_threads())
    return compiled
