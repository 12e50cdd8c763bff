"""The KV-cache side of `mixprec`: checks that a checkpoint asking for KV4/KV8 really gets it,
and hands the backend what bias-aware K quantization needs.

vLLM 0.26 fixes the KV dtype and the attention backend before it asks the quantization
config about the Attention layer, so the config cannot switch them itself. It can refuse
a mismatch, and it does: a KV4 checkpoint never silently runs with a bf16 cache.

After loading, a layer whose qkv_proj has a k bias gets `layer.k_rope_bias` when its KV is
quantized (k_bias.py; the backend reads it as it reads `layer.k_smooth`).
"""
from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

from .. import formats as F
from . import k_bias


def required_flags(kv_scheme: str) -> str:
    return f"--kv-cache-dtype {F.KV_CARRIER_DTYPE[kv_scheme]} --attention-backend CUSTOM"


class MixPrecKVCacheMethod(BaseKVCacheMethod):
    def __init__(self, quant_config, prefix: str = ""):
        super().__init__(quant_config)
        self.prefix = prefix
        self.model_config = None

    def create_weights(self, layer: torch.nn.Module) -> None:
        cfg = get_current_vllm_config_or_none()  # set while vLLM builds the model
        self.model_config = getattr(cfg, "model_config", None)
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
        # vLLM processes this layer's qkv_proj first (named_modules order), which recorded
        # its k bias, if any.
        model_config = self.model_config
        if model_config is None:
            model_config = getattr(get_current_vllm_config_or_none(), "model_config", None)
        k_bias.attach(layer, self.prefix, model_config)
