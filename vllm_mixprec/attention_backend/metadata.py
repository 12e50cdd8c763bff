"""Per-step attention metadata of the mixprec backend, and its builder.

Rows are not assumed to be ordered: vLLM's V2 model runner does not reorder the batch. The
decode kernel runs over all rows and keeps those of query length 1, the prefill kernel
those of query length > 1 (both read query_start_loc on the device). The builder only
counts them on the host (query_start_loc_cpu, no sync) to skip a launch that has no work.

CUDA graphs: a batch of single-token decodes (possibly padded with query-length-0 rows)
launches only the decode kernel (and the split merge), whose grid depends on the number
of rows alone, with every tensor it reads persistent (vLLM's runner buffers, our partial
buffers, the residual directory). Hence UNIFORM_SINGLE_TOKEN_DECODE. Mixed or multi-token
batches (spec decode, chunked prefill) run eagerly.

Bias-aware K (a layer of the group has `k_rope_bias`): the writer needs each new token's
cache position, seq_len - query_len + i in its row. build() computes them on the device
(no sync) into a persistent buffer, `key_positions`, which the store kernel reads (so a
captured graph reads it at a fixed address). They are derived from seq_lens and
query_start_loc rather than taken from vLLM's `positions`, because the readers add the
rotated bias at the cache index, which is what must match (the two agree for the models
bias-aware K accepts).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import numpy as np
import torch
from vllm.v1.attention.backend import (AttentionCGSupport, AttentionMetadataBuilder,
                                       CommonAttentionMetadata)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers

from .. import formats as F
from ..kernels.triton.attention import (decode_merge_counters, decode_partials_rows,
                                        decode_splits)
from . import residual as R

logger = logging.getLogger("vllm.mixprec")


@dataclasses.dataclass
class MixPrecAttentionMetadata:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32, device
    seq_lens: torch.Tensor          # [num_reqs] int32: tokens after this step's writes
    block_table: torch.Tensor       # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor      # [num_tokens] int64, -1 = padding
    num_decodes: int                # rows with query length 1
    num_prefills: int               # rows with query length > 1
    num_splits: int                 # decode split-KV factor (a function of num_reqs)
    part_o: torch.Tensor | None     # [rows*(splits+1), Hq, D] fp32 split (and tail) outputs
    part_lse: torch.Tensor | None   # [rows*(splits+1), Hq] fp32 their log2-sum-exp
    residual: R.ResidualDirectory | None
    # [max_num_seqs * Hkv] int32, zero between launches: MIXPREC_ATTN_MERGE=fused's counts
    merge_counters: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None  # [>= num tokens] int32 cache positions
    # a prefill row has tokens cached before this step (True when vLLM gives no CPU bound):
    # without one, exact prefill through FlashAttention needs no merge launch at all
    prefill_has_context: bool = True
    # exact prefill's context workspace (kernels/triton/context.py; formats.context_seqlens):
    # cu_seqlens_k [num_reqs + 1] int32 on the device and the host's bounds of its total and
    # row maximum; None when vLLM gives no CPU bound of the prefill rows' lengths
    context_cu_k: torch.Tensor | None = None
    context_total_k: int | None = None
    context_max_k: int = 0


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


class MixPrecAttentionMetadataBuilder(AttentionMetadataBuilder[MixPrecAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # V1 runner: decodes first (locality only)
        self.block_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_dim = kv_cache_spec.head_size
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self.num_q_heads = (get_num_attention_heads_from_layers(vllm_config, layer_names)
                            or mc.get_num_attention_heads(pc))
        self.num_sms = _num_sms(torch.device(device))
        rows = decode_partials_rows(vllm_config.scheduler_config.max_num_seqs,
                                    self.num_kv_heads, self.num_sms)
        self.part_o = self.part_lse = None
        if rows:
            self.part_o = torch.empty(rows, self.num_q_heads, self.head_dim,
                                      dtype=torch.float32, device=device)
            self.part_lse = torch.empty(rows, self.num_q_heads, dtype=torch.float32,
                                        device=device)
        # one zeroed buffer for every launch (each leaves it zero): graphs keep its pointer.
        # Micro-batches may run concurrently: then each launch zeroes its own (None).
        self.merge_counters = None if pc.use_ubatching else decode_merge_counters(
            vllm_config.scheduler_config.max_num_seqs, self.num_kv_heads, torch.device(device))
        self.res_tokens = R.residual_tokens(vllm_config, self.block_size)
        R.check_supported(vllm_config, self.res_tokens)
        if self.res_tokens and pc.use_ubatching:
            raise ValueError("micro-batching (--enable-dbo / ubatch_size > 1) builds one "
                             "metadata per micro-batch, which the mixprec residual window "
                             f"does not support; set {R.ENV_TOKENS}=0 or disable DBO")
        self.directory: R.ResidualDirectory | None = None
        self.key_positions: torch.Tensor | None = None
        self._k_bias_checked = False
        self._logged_no_bound = False

    def _directory(self) -> R.ResidualDirectory | None:
        """Created at the first build, when the KV cache (hence num_blocks) exists."""
        if self.res_tokens == 0 or self.directory is not None:
            return self.directory
        ctx = self.vllm_config.compilation_config.static_forward_context
        kv = getattr(ctx.get(self.layer_names[0]), "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
            raise RuntimeError(f"mixprec: cannot find the KV cache of {self.layer_names[0]} "
                               "to size the residual directory")
        slots = R.residual_slots(self.vllm_config, self.res_tokens, self.block_size)
        self.directory = R.ResidualDirectory(
            kv.shape[0], slots, self.block_size, self.res_tokens, torch.device(self.device),
            max_rows=self.vllm_config.scheduler_config.max_num_seqs)
        logger.info("mixprec KV residual: newest %d tokens kept in 16 bits, %d pool slots of "
                    "%d tokens per layer", self.res_tokens, slots, self.block_size)
        return self.directory

    def _key_positions(self, cm: CommonAttentionMetadata) -> torch.Tensor | None:
        """Cache positions of this step's tokens, if a layer of the group is bias-aware."""
        if not self._k_bias_checked:  # the layers are loaded before the first build
            self._k_bias_checked = True
            ctx = self.vllm_config.compilation_config.static_forward_context
            if any(getattr(ctx.get(n), "k_rope_bias", None) is not None
                   for n in self.layer_names):
                size = getattr(self.vllm_config.scheduler_config, "max_num_batched_tokens",
                               None) or 8192
                self.key_positions = torch.zeros(size, dtype=torch.int32, device=self.device)
        if self.key_positions is None:
            return None
        n_tok, n = cm.slot_mapping.shape[0], cm.num_reqs
        if n_tok > self.key_positions.shape[0]:  # eager batches only: graphs are smaller
            logger.warning("mixprec: growing the key-position buffer to %d tokens", n_tok)
            self.key_positions = torch.zeros(n_tok, dtype=torch.int32, device=self.device)
        if n_tok == 0 or n == 0:
            return self.key_positions
        qsl = cm.query_start_loc[:n + 1].to(torch.int32)
        t = torch.arange(n_tok, dtype=torch.int32, device=qsl.device)
        row = torch.searchsorted(qsl[1:], t, right=True).clamp_(max=n - 1)  # padding: any row
        self.key_positions[:n_tok] = t + cm.seq_lens[:n].to(torch.int32)[row] - qsl[row + 1]
        return self.key_positions

    def _splits(self, num_reqs: int) -> int:
        return decode_splits(num_reqs, self.num_kv_heads, self.num_sms,
                             0 if self.part_o is None else self.part_o.shape[0])

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MixPrecAttentionMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        qsl_cpu = cm.query_start_loc_cpu[:n + 1]
        qlens = np.diff(qsl_cpu.numpy()) if n else np.zeros(0, dtype=np.int64)
        has_ctx = True
        cu_k, total_k, max_k = None, None, 0
        bound = getattr(cm, "seq_lens_cpu_upper_bound", None)  # exact for prefill rows
        if bound is None and n and not self._logged_no_bound and (qlens > 1).any():
            self._logged_no_bound = True
            logger.info("mixprec: this model runner gives no CPU bound of the sequence "
                        "lengths: exact prefill merges the cached context in the Triton "
                        "prefill kernel (no 16-bit context workspace)")
        if bound is not None and n:
            pre = qlens > 1
            klens = np.where(pre, bound[:n].numpy(), qlens)
            has_ctx = bool((klens[pre] > qlens[pre]).any())
            if has_ctx:
                cu_k = F.context_seqlens(cm.seq_lens, cm.query_start_loc, n)
                total_k, max_k = int(klens.sum()), int(klens.max())
        directory = self._directory()
        if directory is not None:
            directory.assign(cm.block_table_tensor, cm.seq_lens, cm.query_start_loc,
                             cm.slot_mapping, n, decode_only=bool(n) and qlens.max() <= 1)
        return MixPrecAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens, num_reqs=n, max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len, query_start_loc=cm.query_start_loc,
            seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping, num_decodes=int((qlens == 1).sum()),
            num_prefills=int((qlens > 1).sum()), num_splits=self._splits(n),
            part_o=self.part_o, part_lse=self.part_lse, residual=directory,
            merge_counters=self.merge_counters,
            key_positions=self._key_positions(cm), prefill_has_context=has_ctx,
            context_cu_k=cu_k, context_total_k=total_k, context_max_k=max_k)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> MixPrecAttentionMetadata:
        md = self.build(0, common_attn_metadata)
        # Capture warm-up runs the kernels once: keep them short (lengths are device data).
        md.seq_lens.fill_(1)
        return md
