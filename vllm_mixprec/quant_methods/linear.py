"""MixPrecLinearMethod: W4A8 / W4Ax linear layers.

Checkpoint tensors keep the TP-shardable layout of formats.W4Layout ([N, K/2] codes and
[N, K/G] group parameters); kernel-specific repacking happens once, after loading.
"""
from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import (LinearMethodBase,
                                               register_weight_loader_v2_supported_method)
from vllm.model_executor.parameter import (BasevLLMParameter, ChannelQuantScaleParameter,
                                           GroupQuantScaleParameter, PackedvLLMParameter,
                                           RowvLLMParameter)

from .. import formats as F
from .. import kernels


def _checked_loader(prefix: str, name: str, loader):
    """vLLM's loaders assert on a shape mismatch; say which tensor and what was expected."""

    def load(param, loaded_weight, *args, **kwargs):
        want = param.dtype
        if loaded_weight.dtype != want:
            raise ValueError(
                f"{prefix}.{name}: checkpoint dtype {loaded_weight.dtype}, expected {want} "
                "(docs/FORMAT.md); re-export with `vllm-mixprec quantize`")
        try:
            return loader(param, loaded_weight, *args, **kwargs)
        except (AssertionError, RuntimeError) as e:  # vLLM asserts, or narrow() overruns
            raise ValueError(
                f"{prefix}.{name}: checkpoint shape {tuple(loaded_weight.shape)} does not fit the "
                f"layer's parameter {tuple(param.shape)} (shard {args[0] if args else None!r}); "
                "the checkpoint is truncated or was exported for another model") from e

    return load


@register_weight_loader_v2_supported_method
class MixPrecLinearMethod(LinearMethodBase):
    def __init__(self, quant_config, prefix: str = ""):
        self.quant_config = quant_config
        self.prefix = prefix
        self.scheme = quant_config.scheme

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs):
        k, n = input_size_per_partition, sum(output_partition_sizes)
        g = self.scheme.group_size
        if k % g:
            raise ValueError(
                f"{self.prefix}: input size per partition {k} is not divisible by "
                f"quantization_config.group_size={g}; use a group size that divides it or fewer TP ranks")
        is_row_parallel = input_size != input_size_per_partition
        if self.scheme.weight_scheme == "w4ax":
            if is_row_parallel:
                raise ValueError(f"{self.prefix}: weight_scheme 'w4ax' permutes all of K and does not "
                                 "support row-parallel sharding (tensor_parallel_size > 1) yet")
            F.W4ActLayout(k, 0)  # K must be a multiple of the 128-channel block
        wl = extra_weight_attrs["weight_loader"]

        def reg(name, param):
            param._weight_loader = _checked_loader(self.prefix, name, wl)
            layer.register_parameter(name, param)

        reg("qweight", PackedvLLMParameter(
            data=torch.empty(n, k // 2, dtype=torch.uint8), input_dim=1, output_dim=0,
            packed_dim=1, packed_factor=2, weight_loader=wl))
        for name in ("group_scale", "group_offset"):
            reg(name, GroupQuantScaleParameter(
                data=torch.empty(n, k // g, dtype=torch.uint8), input_dim=1, output_dim=0,
                weight_loader=wl))
        reg("channel_scale", ChannelQuantScaleParameter(
            data=torch.empty(n, dtype=torch.float32), output_dim=0, weight_loader=wl))
        if self.scheme.runtime_smooth:
            reg("input_smooth", RowvLLMParameter(
                data=torch.empty(k, dtype=torch.float32), input_dim=0, weight_loader=wl))
        if self.scheme.weight_scheme == "w4ax":
            reg("act_perm", BasevLLMParameter(data=torch.empty(k, dtype=torch.int32), weight_loader=wl))
            reg("a8_blocks", BasevLLMParameter(data=torch.empty(1, dtype=torch.int32), weight_loader=wl))
        layer.mixprec_in_features = k
        layer.mixprec_out_features = n

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._validate(layer)
        kernels.prepare_linear(layer, self.scheme.weight_scheme, self.prefix)

    def _validate(self, layer: torch.nn.Module) -> None:
        """Values a correct exporter never writes; catching them here beats wrong outputs."""
        gs = layer.group_scale.data
        if gs.numel() and (int(gs.min()) < 1 or int(gs.max()) > F.MAX_GROUP_STEP):
            raise ValueError(f"{self.prefix}.group_scale has values outside [1, {F.MAX_GROUP_STEP}]; "
                             "the checkpoint is corrupt or not LiquidQuant (docs/FORMAT.md)")
        go = layer.group_offset.data
        lo, hi = 128 - F.W8_PROTECT, 128 + F.W8_PROTECT
        if go.numel() and (int(go.min()) < lo or int(go.max()) > hi):
            raise ValueError(f"{self.prefix}.group_offset has values outside [{lo}, {hi}]; "
                             "the checkpoint is corrupt (docs/FORMAT.md)")
        cs = layer.channel_scale.data
        if not bool(torch.isfinite(cs).all()) or bool((cs <= 0).any()):
            raise ValueError(f"{self.prefix}.channel_scale has non-finite or non-positive values")
        if self.scheme.weight_scheme == "w4ax":
            k = layer.mixprec_in_features
            perm = layer.act_perm.data.long()
            if not torch.equal(torch.sort(perm).values, torch.arange(k, device=perm.device)):
                raise ValueError(f"{self.prefix}.act_perm is not a permutation of range({k})")
            F.W4ActLayout(k, int(layer.a8_blocks.data[0]))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        return kernels.apply_linear(layer, x, bias)
