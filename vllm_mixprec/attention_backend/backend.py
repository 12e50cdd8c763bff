"""MixPrecAttentionBackend: vLLM's view of the KV4/KV8 paged attention backend.

Selected with `--attention-backend CUSTOM --kv-cache-dtype int4_per_token_head` (KV4) or
`int8_per_token_head` (KV8) after vllm_mixprec.register(). vLLM sizes each page from the
carrier dtype (B*H*(D + 8) bytes for KV4, B*H*(2D + 8) for KV8, see
FullAttentionSpec.page_size_bytes); get_kv_cache_shape hands exactly that back, in the
(num_blocks, H, B, row_bytes) shape of formats.KVPageLayout, whose (block, head) slabs hold
our planes.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf

from .. import formats as F

SUPPORTED_HEAD_SIZES = (64, 128, 256)
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)  # powers of two: page tiles are block-aligned


def _block_size_ok(block_size: int) -> bool:
    return block_size >= 16 and block_size & (block_size - 1) == 0


def page_layout(cache_dtype_str: str, head_size: int, block_size: int) -> F.KVPageLayout:
    """The KVPageLayout behind a vLLM kv-cache dtype string (ValueError names the field)."""
    scheme = F.KV_SCHEME_OF_CARRIER.get(cache_dtype_str)
    if scheme is None:
        raise ValueError(
            f"kv_cache_dtype={cache_dtype_str!r} is not supported by the mixprec (CUSTOM) "
            f"attention backend; start vLLM with --kv-cache-dtype "
            f"{F.KV_CARRIER_DTYPE['kv4']} (KV4) or {F.KV_CARRIER_DTYPE['kv8']} (KV8)")
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head_size={head_size} is not one of {list(SUPPORTED_HEAD_SIZES)}")
    if not _block_size_ok(block_size):
        raise ValueError(f"block_size={block_size} is not a power of two >= 16")
    return F.KVPageLayout(scheme, head_size, block_size)


class MixPrecAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(F.KV_CARRIER_DTYPE.values())
    # vLLM calls impl.do_kv_cache_update (quantise + store) before impl.forward.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        # Attention.__init__ looks the backend up as AttentionBackendEnum[get_name()].
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        from .impl import MixPrecAttentionImpl
        return MixPrecAttentionImpl

    @staticmethod
    def get_builder_cls():
        from .metadata import MixPrecAttentionMetadataBuilder
        return MixPrecAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # vLLM splits larger blocks (e.g. --block-size 256) into kernel blocks of these.
        return list(KERNEL_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return page_layout(cache_dtype_str, head_size, block_size).cache_shape(
            num_blocks, num_kv_heads)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        # Identity: each (block, head) slab must stay contiguous (the kernels address planes
        # inside it). With a layers dimension, layers stay outermost (no cross-layer blocks).
        return (0, 1, 2, 3, 4) if include_num_layers_dimension else (0, 1, 2, 3)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is None or capability.major >= 8  # bf16 tensor cores in Triton

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                               has_sink, use_sparse, use_mm_prefix, use_per_head_quant_scales,
                               device_capability, attn_type, has_sliding_window=False,
                               use_non_causal=False, use_batch_invariant=False,
                               use_kv_connector=False, use_pcp=False) -> list[str]:
        """Reasons this configuration cannot run, each naming the field and what to change."""
        bad = []
        if head_size not in SUPPORTED_HEAD_SIZES:
            bad.append(f"head_size={head_size} is not one of {list(SUPPORTED_HEAD_SIZES)}")
        if dtype not in cls.supported_dtypes:
            bad.append(f"dtype={dtype} is not float16/bfloat16 (set --dtype)")
        if kv_cache_dtype is not None and kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            bad.append(f"kv_cache_dtype={kv_cache_dtype!r} is not one of "
                       f"{cls.supported_kv_cache_dtypes} (set --kv-cache-dtype)")
        if block_size is not None and not cls.supports_block_size(block_size):
            bad.append(f"block_size={block_size} is not a multiple of any of "
                       f"{list(KERNEL_BLOCK_SIZES)} (set --block-size)")
        flags = {"use_mla": use_mla, "has_sink": has_sink, "use_sparse": use_sparse,
                 "use_mm_prefix": use_mm_prefix,
                 "use_per_head_quant_scales": use_per_head_quant_scales,
                 "has_sliding_window": has_sliding_window, "use_non_causal": use_non_causal,
                 "use_batch_invariant": use_batch_invariant, "use_pcp": use_pcp}
        bad += [f"{k}=True is not supported" for k, v in flags.items() if v]
        if not cls.supports_compute_capability(device_capability):
            bad.append(f"device_capability={device_capability} is below 8.0")
        if attn_type != AttentionType.DECODER:
            bad.append(f"attn_type={attn_type!r} is not supported (decoder only)")
        return bad
