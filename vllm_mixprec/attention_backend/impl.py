"""MixPrecAttentionImpl: the per-layer write (quantise + store) and read (attention) paths.

vLLM calls, per layer and step: do_kv_cache_update (fused quantise-and-store of this
step's K/V into the packed pages, plus the 16-bit residual copy), then forward (the decode
kernel for rows of query length 1, the prefill/extend kernel for the others, both over
the packed pages). With attn_metadata None (memory-profiling run) forward allocates the
residual pool, so that vLLM counts it before sizing the KV cache, and returns zeros.

SmoothAttention: if the Attention layer carries `k_smooth` [num_kv_heads, head_dim] (set
by the quantization method), K is divided by it before quantisation and Q multiplied by it
in the kernels; the product q.k is unchanged. Folding it into k_proj/q_proj offline makes
it free and needs nothing here.

Exact prefill (MIXPREC_ATTN_PREFILL_EXACT, default 1): a prefill/extend row attends its own
new tokens from the 16-bit key/value this step was given and only its older tokens through
the cache, as KIVI and QServe do; the cache then holds K/V computed from unquantized attention
of the whole chunk. 0: every key through the cache (what decode reads), e.g. to check the
cache's numbers through prompt logprobs. The chunk's own part is plain 16-bit attention, so
by default vLLM's FlashAttention computes it and the prefill kernel merges the cached context
into its output (kernels/chunk_attention.py, MIXPREC_ATTN_CHUNK=auto|flash|triton).

Bias-aware K: if the layer carries `k_rope_bias` (formats.KRopeBias, set after loading by
quant_methods/k_bias.py when k_proj has a bias), the writer stores
(K - RoPE_p(b)) / k_smooth at each token's cache position p (metadata.key_positions) and
the kernels add q . RoPE_p(b) back to every score. No checkpoint change: b is k_proj's bias.
"""
from __future__ import annotations

import logging
import os

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from .. import formats as F
from ..kernels.chunk_attention import chunk_attention, chunk_setting, select_chunk_impl
from ..kernels.triton.attention import decode_attention, prefill_attention
from ..kernels.triton.kv_cache import KVResidual, quantize_and_store
from . import residual as R
from .backend import page_layout
from .metadata import MixPrecAttentionMetadata

logger = logging.getLogger("vllm.mixprec")


ENV_PREFILL_EXACT = "MIXPREC_ATTN_PREFILL_EXACT"
_LOGGED_CHUNK_IMPLS: set[str] = set()


def prefill_exact() -> bool:
    """MIXPREC_ATTN_PREFILL_EXACT: 1 (default) or 0 (module docstring)."""
    v = os.environ.get(ENV_PREFILL_EXACT, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV_PREFILL_EXACT}={v!r}: expected 1 (a prefill chunk's new tokens "
                         "attend each other in 16 bits; the default) or 0 (every key through "
                         "the quantized cache)")
    return v == "1"


def _is_unset(v) -> bool:
    """None, or a scalar default meaning "off" (False, 0, -1) of an optional feature."""
    return v is None or (isinstance(v, (bool, int, float)) and v in (False, 0, -1))


class MixPrecAttentionImpl(AttentionImpl[MixPrecAttentionMetadata]):
    supports_dcp = False
    supports_pcp = False

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **unsupported):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        page_layout(kv_cache_dtype, head_size, 16)  # validates dtype and head size
        given = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                 "logits_soft_cap": logits_soft_cap or None, "sinks": sinks, **unsupported}
        bad = [k for k, v in given.items() if not _is_unset(v)]
        if bad:
            raise ValueError(f"the mixprec attention backend does not support {bad}; use "
                             "another --attention-backend for this model")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"attn_type={attn_type!r}: the mixprec backend is decoder-only")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        self.vllm_config = get_current_vllm_config_or_none()
        block = self.vllm_config.cache_config.block_size if self.vllm_config else 16
        res = R.residual_tokens(self.vllm_config, block)
        if res and kv_sharing_target_layer_name is not None:
            raise ValueError(f"cross-layer KV sharing ({kv_sharing_target_layer_name}) is not "
                             f"supported with the residual window; set {R.ENV_TOKENS}=0")
        self._layouts: dict[int, F.KVPageLayout] = {}
        self._pool: tuple[torch.Tensor, torch.Tensor] | None = None
        self._k_smooth: torch.Tensor | None = None
        self._k_bias: F.KRopeBias | None = None
        self._prefill_exact = prefill_exact()
        self._chunk_setting = chunk_setting()  # validated at start-up
        self._chunk_impl: str | None = None    # "flash" or "triton", chosen at the first use

    # --- helpers ---------------------------------------------------------------------------

    def _layout(self, kv_cache: torch.Tensor) -> F.KVPageLayout:
        b = kv_cache.shape[2]
        if b not in self._layouts:
            self._layouts[b] = page_layout(self.kv_cache_dtype, self.head_size, b)
        return self._layouts[b]

    def _ensure_pool(self, rows: int, dtype: torch.dtype, device: torch.device) -> bool:
        """(Re)allocate the 16-bit pool if too small; True if its contents were lost."""
        if self._pool is None or self._pool[0].shape[0] < rows or self._pool[0].dtype != dtype:
            lost = self._pool is not None
            if lost:
                logger.warning("mixprec: re-allocating the KV residual pool (%d rows)", rows)
            self._pool = R.allocate_pool(rows, self.num_kv_heads, self.head_size, dtype, device)
            return lost
        return False

    def _profile_allocation(self, query: torch.Tensor) -> None:
        """Allocate the pool during the profiling run so that vLLM accounts for it."""
        cfg = self.vllm_config
        if cfg is None or self._pool is not None:
            return
        b = cfg.cache_config.block_size
        r = R.residual_tokens(cfg, b)
        if r:
            self._ensure_pool(R.residual_slots(cfg, r, b) * b, query.dtype, query.device)

    def _residual(self, md: MixPrecAttentionMetadata | None, dtype, device) -> KVResidual | None:
        d = None if md is None else md.residual
        if d is None:
            return None
        if self._ensure_pool(d.num_slots * d.block_size, dtype, device):
            d.tags.fill_(-1)  # stale tags would point at the zeroed pool: fall back to pages
        k, v = self._pool
        return KVResidual(k, v, d.slot_of_block, d.tags, d.tokens)

    def _smooth(self, layer) -> torch.Tensor | None:
        """layer.k_smooth as contiguous fp32 [num_kv_heads, head_dim] (converted once)."""
        ks = getattr(layer, "k_smooth", None)
        if ks is None:
            return None
        if self._k_smooth is None or self._k_smooth.device != ks.device:
            if tuple(ks.shape) != (self.num_kv_heads, self.head_size):
                raise ValueError(f"k_smooth has shape {tuple(ks.shape)}, expected "
                                 f"({self.num_kv_heads}, {self.head_size}) (this rank's kv heads)")
            self._k_smooth = ks.detach().to(torch.float32).contiguous()
        return self._k_smooth

    def _rope_bias(self, layer, device: torch.device) -> F.KRopeBias | None:
        """layer.k_rope_bias on `device` (moved once; persistent for CUDA graphs)."""
        kb = getattr(layer, "k_rope_bias", None)
        if kb is None:
            return None
        if self._k_bias is None or self._k_bias.bias.device != device:
            if tuple(kb.bias.shape) != (self.num_kv_heads, self.head_size):
                raise ValueError(f"k_rope_bias has bias {tuple(kb.bias.shape)}, expected "
                                 f"({self.num_kv_heads}, {self.head_size}) (this rank's kv heads)")
            self._k_bias = F.KRopeBias(*(t.to(device).contiguous() for t in kb))
        return self._k_bias

    def _chunk(self, query: torch.Tensor) -> str:
        if self._chunk_impl is None:
            self._chunk_impl = select_chunk_impl(query.device, self.head_size, self._chunk_setting)
            if self._chunk_impl not in _LOGGED_CHUNK_IMPLS:  # once per process, not per layer
                _LOGGED_CHUNK_IMPLS.add(self._chunk_impl)
                logger.info("mixprec: exact prefill attends a chunk's own tokens with %s",
                            "vLLM's FlashAttention" if self._chunk_impl == "flash"
                            else "the Triton prefill kernel")
        return self._chunk_impl

    @staticmethod
    def _metadata_of(layer) -> MixPrecAttentionMetadata | None:
        if not is_forward_context_available():
            return None
        md = get_forward_context().attn_metadata
        if isinstance(md, list):  # speculative decoding: [0] is the target model's
            md = md[0] if md else None
        if isinstance(md, dict):
            md = md.get(getattr(layer, "layer_name", None))
        return md if isinstance(md, MixPrecAttentionMetadata) else None

    # --- vLLM entry points -----------------------------------------------------------------

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if kv_cache.numel() == 0 or slot_mapping is None:
            return
        md = self._metadata_of(layer)
        k_bias = self._rope_bias(layer, key.device)
        positions = None
        if k_bias is not None:
            if md is None:  # a dummy run: nothing will read these slots
                return
            positions = md.key_positions
            if positions is None:
                raise RuntimeError(f"mixprec: {getattr(layer, 'layer_name', 'a layer')} is "
                                   "bias-aware but the metadata has no key positions")
        residual = self._residual(md, key.dtype, key.device)
        quantize_and_store(key, value, kv_cache, slot_mapping, self._layout(kv_cache),
                           self._smooth(layer), residual, k_bias, positions)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: MixPrecAttentionMetadata,
                output: torch.Tensor, output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by mixprec")
        if attn_metadata is None:  # memory-profiling run
            self._profile_allocation(query)
            return output.fill_(0)
        md = attn_metadata
        layout = self._layout(kv_cache)
        residual = self._residual(md, query.dtype, query.device)
        k_smooth = self._smooth(layer)
        k_bias = self._rope_bias(layer, query.device)
        # key/value are None only on a layer sharing another's cache: it reads the cache
        chunk = (key, value) if md.num_prefills and self._prefill_exact and key is not None \
            and value is not None else None
        chunk_lse = None
        q, out = query, output
        if chunk is not None and self._chunk(query) == "flash":
            # Before decode: FlashAttention writes every row, decode then overwrites its own.
            n = md.num_actual_tokens
            q, out = query[:n], output[:n]
            chunk_lse = chunk_attention(q, key, value, md.query_start_loc, md.max_query_len,
                                        self.scale, out)
            chunk = None
        if md.num_decodes:
            decode_attention(query, kv_cache, layout, md.block_table, md.seq_lens,
                             md.query_start_loc, output, self.scale, md.num_reqs,
                             md.num_splits, md.part_o, md.part_lse, residual, k_smooth, k_bias)
        if md.num_prefills and (chunk_lse is None or md.prefill_has_context):
            prefill_attention(q, kv_cache, layout, md.block_table, md.seq_lens,
                              md.query_start_loc, out, self.scale, md.num_reqs,
                              md.max_query_len, residual, k_smooth, k_bias, chunk, chunk_lse)
        return output
