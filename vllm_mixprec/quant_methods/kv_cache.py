"""The KV-cache side of `mixprec`: checks that a checkpoint asking for KV4/KV8 really gets it.

vLLM 0.26 fixes the KV dtype and the attention backend before it asks the quantization
config about the Attention layer, so the config cannot switch them itself. It can refuse
a mismatch, and it does: a KV4 checkpoint never silently runs with a bf16 cache.
"""
from __future__ import annotations

import torch
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

from .. import formats as F


def required_flags(kv_scheme: str) -> str:
    return f"--kv-cache-dtype {F.KV_CARRIER_DTYPE[kv_scheme]} --attention-backend CUSTOM"


class MixPrecKVCacheMethod(BaseKVCacheMethod):
    def __init__(self, quant_config, prefix: str = ""):
        super().__init__(quant_config)
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module) -> None:
        kv = self.quant_config.scheme.kv_scheme
        if kv == "none":
            return
        want = F.KV_CARRIER_DTYPE[kv]
        got = getattr(layer, "kv_cache_dtype", None)
        backend = getattr(getattr(layer, "attn_backend", None), "get_name", lambda: None)()
        if got != want or backend != "CUSTOM":
            raise ValueError(
                f"{self.prefix}: the checkpoint's quantization_config.kv_scheme is {kv!r}, but vLLM "
                f"was started with kv_cache_dtype={got!r} and attention backend {backend!r}. "
                f"Start it with `{required_flags(kv)}` (or re-export the checkpoint with "
                "kv_scheme 'none' to keep a 16-bit cache)")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # Scales are per (token, head) and computed when K/V are written: nothing to load.
        return
