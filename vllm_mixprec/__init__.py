"""vllm_mixprec: W4A8 / W4Ax linear layers and an INT4/INT8 KV-cache attention backend for vLLM.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process (API
server, engine core, each worker), sometimes more than once, so it is idempotent, cheap,
and never touches CUDA.
"""
from __future__ import annotations

import logging

__version__ = "0.1.0"

logger = logging.getLogger("vllm.mixprec")  # a child of vLLM's logger: its handler prints us

BACKEND_CLASS_PATH = "vllm_mixprec.attention_backend.backend.MixPrecAttentionBackend"
_registered = False


def register() -> None:
    """Register the `mixprec` quantization method and the CUSTOM attention backend."""
    global _registered
    from . import envs

    envs.warn_unknown()  # a mistyped MIXPREC_* name would change nothing, silently
    if _registered:
        return
    # Importing the module runs @register_quantization_config("mixprec").
    from .quant_methods import config  # noqa: F401
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
    from . import compile_cache

    compile_cache.install()  # MIXPREC_* settings in the torch.compile cache keys
    _registered = True
    logger.info("vllm_mixprec %s registered: --quantization mixprec, --attention-backend CUSTOM",
                __version__)
