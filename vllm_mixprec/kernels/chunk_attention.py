"""Exact prefill through vLLM's own FlashAttention (`vllm.vllm_flash_attn`, varlen: FA3 on
Hopper, FA2 on Ampere) rather than a loop of our Triton kernel:
  * context_attention: each row's queries over its 16-bit context workspace (its cached
    context dequantised, then its new tokens: kernels/triton/context.py). One call does a
    whole extend chunk; the backend's default when the workspace fits.
  * chunk_attention: each row's queries over its own new tokens only (cu_seqlens_k =
    cu_seqlens_q), and the log-sum-exp that the prefill kernel then merges the cached
    context into (kernels/triton/attention.py, CHUNK_MERGE); also what a prompt processed
    in one chunk needs, at FLASH_ATTN's cost.
CPU tensors use reference.varlen_attention / chunk_attention, the oracles with the same
signatures.

MIXPREC_ATTN_CHUNK picks the implementation:
  auto    (default) flash where vLLM's FlashAttention 2 or 3 runs on this GPU, else triton
  flash   FlashAttention; an error at the first forward where it is unavailable
  triton  the chunk loop inside our prefill kernel (CHUNK_TRITON)
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from .. import envs
from .. import reference as ref

logger = logging.getLogger("vllm.mixprec")

ENV_CHUNK = "MIXPREC_ATTN_CHUNK"
CHUNK_CHOICES = ("auto", "flash", "triton")


def chunk_setting(environ=os.environ) -> str:
    """MIXPREC_ATTN_CHUNK, validated (module docstring)."""
    v = envs.get(ENV_CHUNK, environ)
    if v not in CHUNK_CHOICES:
        raise ValueError(f"{ENV_CHUNK}={v!r}: expected one of {CHUNK_CHOICES} (auto: vLLM's "
                         "FlashAttention for a prefill chunk's own tokens where it runs, else "
                         "the Triton kernel)")
    return v


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def flash_version(device_index: int, head_dim: int) -> int | None:
    """2 or 3: the FlashAttention vLLM would run for this head size on this GPU; None if
    neither is there (FA4 needs the CuTe DSL, which the plugin does not rely on)."""
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        with torch.cuda.device(device_index):
            v = get_flash_attn_version(head_size=head_dim)
    except Exception as e:  # noqa: BLE001 - no vllm_flash_attn build for this platform
        logger.debug("mixprec: vLLM's FlashAttention unavailable: %s", e)
        return None
    return v if v in (2, 3) else None


def select_chunk_impl(device: torch.device, head_dim: int, setting: str | None = None) -> str:
    """"flash" or "triton" for exact prefill's chunk on `device` (CPU tensors: "flash" means
    the reference, the oracle of both)."""
    setting = chunk_setting() if setting is None else setting
    if setting == "triton" or device.type != "cuda":
        return setting if setting != "auto" else "triton"
    idx = _index(device)
    if flash_version(idx, head_dim) is not None:
        return "flash"
    if setting == "flash":
        raise RuntimeError(f"{ENV_CHUNK}=flash but vLLM's FlashAttention (2 or 3) does not run "
                           f"head size {head_dim} on {torch.cuda.get_device_name(idx)}; set "
                           f"{ENV_CHUNK}=triton or unset it")
    return "triton"


def _flash_varlen(q, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  scale, out, return_lse: bool):
    """vLLM's flash_attn_varlen_func, causal, in the FlashAttention version of this GPU."""
    version = flash_version(_index(q.device), q.shape[-1])
    if version is None:
        raise RuntimeError("vLLM's FlashAttention is unavailable here: exact prefill must use "
                           f"the Triton chunk ({ENV_CHUNK}=triton)")
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func(
        q=q, k=key, v=value, out=out, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale,
        causal=True, return_softmax_lse=return_lse, fa_version=version)


def context_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, scale: float, out: torch.Tensor) -> None:
    """reference.varlen_attention's contract without the log-sum-exp: causal attention of
    row i's queries (the last positions of its keys) over key/value[cu_k[i]:cu_k[i+1]] into
    `out` [T, Hq, D]; the max_seqlen_* may be upper bounds."""
    if not q.is_cuda:
        ref.varlen_attention(q, key, value, cu_seqlens_q, cu_seqlens_k, scale, out)
        return
    _flash_varlen(q, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                  out, return_lse=False)


def chunk_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                    out: torch.Tensor) -> torch.Tensor:
    """reference.chunk_attention's contract: causal attention of each row over its own new
    tokens into `out` [T, Hq, D]; returns the natural log-sum-exp [Hq, T] fp32. key/value
    [>= T, Hkv, D] may be strided views of the fused qkv tensor (unit stride on D)."""
    if not q.is_cuda:
        return ref.chunk_attention(q, key, value, query_start_loc, max_query_len, scale, out)
    _, lse = _flash_varlen(q, key, value, query_start_loc, query_start_loc, max_query_len,
                           max_query_len, scale, out, return_lse=True)
    return lse


__all__ = ["context_attention", "chunk_attention", "chunk_setting", "select_chunk_impl",
           "flash_version", "ENV_CHUNK", "CHUNK_CHOICES"]
