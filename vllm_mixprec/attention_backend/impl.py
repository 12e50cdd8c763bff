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
cache's numbers through prompt logprobs. Where vLLM's FlashAttention runs
(kernels/chunk_attention.py, MIXPREC_ATTN_CHUNK=auto|flash|triton) it does the attention:
the rows' cached context is dequantised into a 16-bit workspace ahead of their new K/V
(kernels/triton/context.py) and one varlen call attends it all. The workspace is reserved at
the memory-profiling run, MIXPREC_ATTN_CONTEXT_TOKENS tokens (default: max_num_batched_tokens
+ max_model_len, at most 256K); a step whose rows need more (or 0) falls back to
FlashAttention over the new tokens merged with the context by our prefill kernel (slower on
long contexts, same numbers up to rounding), logged once.

Bias-aware K: if the layer carries `k_rope_bias` (formats.KRopeBias, set after loading by
quant_methods/k_bias.py when k_proj has a bias), the writer stores
(K - RoPE_p(b)) / k_smooth at each token's cache position p (metadata.key_positions) and
the kernels add q . RoPE_p(b) back to every score. No checkpoint change: b is k_proj's bias.
"""
from __future__ import annotations

import logging

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from .. import envs
from .. import formats as F
from ..kernels.chunk_attention import (chunk_attention, chunk_setting, context_attention,
                                       select_chunk_impl)
from ..kernels.triton.context import gather_context_kv
from ..kernels.triton import precompile
from ..kernels.triton.attention import decode_attention, precompile_decode, prefill_attention
from ..kernels.triton.kv_cache import KVResidual, quantize_and_store
from ..quant_methods import k_bias
from . import residual as R
from .backend import page_layout
from .metadata import MixPrecAttentionMetadata

logger = logging.getLogger("vllm.mixprec")


ENV_PREFILL_EXACT = "MIXPREC_ATTN_PREFILL_EXACT"
ENV_CONTEXT_TOKENS = "MIXPREC_ATTN_CONTEXT_TOKENS"
MAX_DEFAULT_CONTEXT_TOKENS = 1 << 18
_LOGGED_ONCE: set[str] = set()  # messages logged once per process, not per layer
# (device, dtype, kv heads, head dim) -> (K, V) [tokens, Hkv, D]: one per process, shared by
# the layers (they run one after the other)
_CONTEXT_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def prefill_exact() -> bool:
    """MIXPREC_ATTN_PREFILL_EXACT: 1 (default) or 0 (module docstring)."""
    v = envs.get(ENV_PREFILL_EXACT)
    if v not in ("0", "1"):
        raise ValueError(f"{ENV_PREFILL_EXACT}={v!r}: expected 1 (a prefill chunk's new tokens "
                         "attend each other in 16 bits; the default) or 0 (every key through "
                         "the quantized cache)")
    return v == "1"


def context_tokens(vllm_config) -> int:
    """MIXPREC_ATTN_CONTEXT_TOKENS, else max_num_batched_tokens + max_model_len (one step's
    new tokens plus a full-length row's context), at most MAX_DEFAULT_CONTEXT_TOKENS; 0
    turns the context workspace off (module docstring)."""
    n = envs.integer(ENV_CONTEXT_TOKENS, 0)
    if n is not None:
        return n
    if vllm_config is None:
        return 0
    batched = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None) or 8192
    model_len = getattr(vllm_config.model_config, "max_model_len", None) or 8192
    return min(int(batched) + int(model_len), MAX_DEFAULT_CONTEXT_TOKENS)


def context_workspace(tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The process's (K, V) context workspace of at least `tokens` rows (grown, never shrunk)."""
    key = (device, dtype, num_kv_heads, head_dim)
    ws = _CONTEXT_WORKSPACES.get(key)
    if ws is None or ws[0].shape[0] < tokens:
        shape = (tokens, num_kv_heads, head_dim)
        ws = (torch.empty(shape, dtype=dtype, device=device),
              torch.empty(shape, dtype=dtype, device=device))
        _CONTEXT_WORKSPACES[key] = ws
        logger.info("mixprec: exact prefill's 16-bit context workspace: %d tokens (%.0f MiB)",
                    tokens, 2 * ws[0].numel() * ws[0].element_size() / 2 ** 20)
    return ws


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
        k_bias.check_plain_kv4(self.vllm_config, kv_cache_dtype)
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
        self._context_tokens = context_tokens(self.vllm_config)
        # the decode variants of batches up to max_num_seqs compile at the first decode step
        self._precompile_rows = (self.vllm_config.scheduler_config.max_num_seqs
                                 if self.vllm_config else 0)

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

    def _profile_allocation(self, layer, query: torch.Tensor, key, value) -> None:
        """Allocate the pool and the context workspace during the profiling run so that vLLM
        accounts for them, and compile the workspace kernel (else its first use, a request
        with cached context, would compile it in the middle of serving)."""
        cfg = self.vllm_config
        if cfg is None or self._pool is not None:
            return
        b = cfg.cache_config.block_size
        r = R.residual_tokens(cfg, b)
        if r:
            self._ensure_pool(R.residual_slots(cfg, r, b) * b, query.dtype, query.device)
        if self._prefill_exact and self._context_tokens and self._chunk(query) == "flash":
            ws = context_workspace(self._context_tokens, self.num_kv_heads, self.head_size,
                                   query.dtype, query.device)
            if key is not None and value is not None:
                self._compile_gather(layer, cfg, b, key, value, ws,
                                     self._residual_for_compile(r, b))

    def _residual_for_compile(self, r: int, b: int) -> KVResidual | None:
        if not r or self._pool is None:
            return None
        dev = self._pool[0].device
        return KVResidual(*self._pool, torch.full((2,), -1, dtype=torch.int32, device=dev),
                          torch.full((1, b), -1, dtype=torch.int32, device=dev), r)

    def _compile_gather(self, layer, cfg, b: int, key, value, ws, residual) -> None:
        """One launch whose rows are all empty (every program exits at once), on tensors
        shaped and strided as serving's, so that Triton compiles the variant serving uses."""
        layout = page_layout(self.kv_cache_dtype, self.head_size, b)
        dev = key.device
        cache = torch.zeros(layout.cache_shape(1, self.num_kv_heads),
                            dtype=layout.storage_dtype(), device=dev)
        width = -(-int(getattr(cfg.model_config, "max_model_len", None) or b) // b)
        zeros = torch.zeros(2, dtype=torch.int32, device=dev)
        gather_context_kv(cache, layout, torch.zeros(1, width, dtype=torch.int32, device=dev),
                          zeros[:1], zeros, zeros, key, value, ws[0], ws[1], 1, 1, residual,
                          self._smooth(layer), self._rope_bias(layer, dev))

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
            if self._chunk_impl not in _LOGGED_ONCE:
                _LOGGED_ONCE.add(self._chunk_impl)
                logger.info("mixprec: exact prefill attends a chunk's own tokens with %s",
                            "vLLM's FlashAttention" if self._chunk_impl == "flash"
                            else "the Triton prefill kernel")
        return self._chunk_impl

    def _workspace(self, md: MixPrecAttentionMetadata, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The context workspace if this step's rows fit it, else None (merge path)."""
        need = md.context_total_k
        if need is None or md.context_cu_k is None:
            return None
        if need > self._context_tokens:
            if "overflow" not in _LOGGED_ONCE:
                _LOGGED_ONCE.add("overflow")
                logger.info("mixprec: a step's prefill rows need %d context-workspace tokens, "
                            "over %s=%d: such steps merge the cached context in the Triton "
                            "prefill kernel instead (slower; raise it to avoid)", need,
                            ENV_CONTEXT_TOKENS, self._context_tokens)
            return None
        k, v = context_workspace(self._context_tokens, self.num_kv_heads, self.head_size,
                                 dtype, device)
        return k[:need], v[:need]

    def _precompile_decode(self, query, kv_cache, layout, md, output, residual, k_smooth,
                           k_bias) -> None:
        """Every decode variant of this layer's settings, compiled in parallel before the
        first decode launch (kernels/triton/precompile.py; the later layers find them)."""
        rows, self._precompile_rows = self._precompile_rows, 0
        if md.part_o is None or not query.is_cuda or not precompile.enabled():
            return
        precompile_decode(query, kv_cache, layout, md.block_table, md.seq_lens,
                          md.query_start_loc, output, self.scale, rows, md.part_o,
                          md.part_lse, residual, k_smooth, k_bias, md.merge_counters)

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
            self._profile_allocation(layer, query, key, value)
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
        prefill_done = False
        q, out = query, output
        if chunk is not None and self._chunk(query) == "flash":
            # Before decode: FlashAttention writes every row, decode then overwrites its own.
            # Only the step's real tokens: vLLM pads a batch to a CUDA-graph size, and the
            # padded rows hold whatever the graph left there, NaN included. FlashAttention
            # loads whole K/V tiles past a sequence's end and masks their scores, and 0 * NaN
            # is NaN: a NaN row anywhere in its K/V poisons every sequence whose tile reaches
            # it (session 22: every prompt of a compiled Qwen2.5 KV4 batch). Our kernels mask
            # their loads instead.
            n = md.num_actual_tokens
            q, out, chunk = query[:n], output[:n], (key[:n], value[:n])
            ws = self._workspace(md, key.dtype, key.device) if md.prefill_has_context else None
            qsl = md.query_start_loc[:md.num_reqs + 1]
            if ws is not None:
                gather_context_kv(kv_cache, layout, md.block_table, md.seq_lens, qsl,
                                  md.context_cu_k, *chunk, ws[0], ws[1], md.num_reqs,
                                  md.context_max_k, residual, k_smooth, k_bias)
                context_attention(q, ws[0], ws[1], qsl, md.context_cu_k, md.max_query_len,
                                  md.context_max_k, self.scale, out)
                prefill_done = True
            else:
                chunk_lse = chunk_attention(q, *chunk, qsl, md.max_query_len, self.scale, out)
            chunk = None
        if md.num_decodes:
            if self._precompile_rows:
                self._precompile_decode(query, kv_cache, layout, md, output, residual,
                                        k_smooth, k_bias)
            decode_attention(query, kv_cache, layout, md.block_table, md.seq_lens,
                             md.query_start_loc, output, self.scale, md.num_reqs,
                             md.num_splits, md.part_o, md.part_lse, residual, k_smooth, k_bias,
                             md.merge_counters)
        if md.num_prefills and not prefill_done and (chunk_lse is None
                                                      or md.prefill_has_context):
            prefill_attention(q, kv_cache, layout, md.block_table, md.seq_lens,
                              md.query_start_loc, out, self.scale, md.num_reqs,
                              md.max_query_len, residual, k_smooth, k_bias, chunk, chunk_lse)
        return output
