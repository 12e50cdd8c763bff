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
from . import k_bias


REEXPORT = "re-export the checkpoint with `vllm-mixprec quantize`"


def _checked_loader(layer: torch.nn.Module, prefix: str, name: str, loader):
    """vLLM's loaders assert on a shape mismatch; say which tensor and what was expected.

    Every successful load is recorded in layer.mixprec_loaded[name] (the shard ids), because
    vLLM does not check that a quantized checkpoint provided every parameter: a missing
    tensor would otherwise be served as uninitialised memory (see _check_complete).
    """

    def load(param, loaded_weight, *args, **kwargs):
        want = param.dtype
        if loaded_weight.dtype != want:
            raise ValueError(
                f"{prefix}.{name}: checkpoint dtype {loaded_weight.dtype}, expected {want} "
                f"(docs/FORMAT.md); {REEXPORT}")
        shard = args[0] if args else kwargs.get("loaded_shard_id")
        try:
            out = loader(param, loaded_weight, *args, **kwargs)
        except (AssertionError, RuntimeError) as e:  # vLLM asserts, or narrow() overruns
            raise ValueError(
                f"{prefix}.{name}: checkpoint shape {tuple(loaded_weight.shape)} does not fit the "
                f"layer's parameter {tuple(param.shape)} (shard {shard!r}); "
                "the checkpoint is truncated or was exported for another model: "
                f"{REEXPORT} from the model you are serving") from e
        got = layer.mixprec_loaded.setdefault(name, set())
        got.update(shard if isinstance(shard, (tuple, list)) else (shard,))
        return out

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
                                 "support row-parallel sharding (tensor_parallel_size > 1) yet; serve "
                                 "it with --tensor-parallel-size 1, or re-export with --scheme w4a8")
            if k % F.ACT_BLOCK:
                raise ValueError(f"{self.prefix}: input size {k} is not a multiple of {F.ACT_BLOCK}, "
                                 "which weight_scheme 'w4ax' needs (activation blocks); re-export "
                                 "with --scheme w4a8")
        wl = extra_weight_attrs["weight_loader"]

        def reg(name, param):
            param._weight_loader = _checked_loader(layer, self.prefix, name, wl)
            layer.register_parameter(name, param)
            layer.mixprec_params.append(name)

        layer.mixprec_params, layer.mixprec_loaded = [], {}
        layer.mixprec_num_shards = len(output_partition_sizes)

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
        layer.mixprec_row_parallel = is_row_parallel  # a K slice: kernels.tp_act_scale applies
        layer.mixprec_out_features = n

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self._check_complete(layer)
        self._validate(layer)
        kernels.prepare_linear(layer, self.scheme.weight_scheme, self.prefix, self.scheme.act_rotation)
        k_bias.record_qkv_bias(layer, self.prefix)

    def _check_complete(self, layer: torch.nn.Module) -> None:
        """Every parameter (and, in a merged layer, every shard of it) came from the checkpoint.

        vLLM's loader only tracks missing weights for unquantized models, so without this a
        checkpoint lacking e.g. `k_proj.group_offset` would load and serve garbage."""
        loaded = layer.mixprec_loaded
        shards = layer.mixprec_num_shards
        missing = []
        for name in layer.mixprec_params:  # ours; vLLM's own (the bias) are not checked here
            got = loaded.get(name, set())
            if None in got or len(got) >= shards:
                continue
            missing.append(name if not got else f"{name} (shards loaded: {sorted(map(str, got))} "
                                                 f"of {shards})")
        if missing:
            hint = ("every linear layer that is not in quantization_config.ignored_layers needs "
                    "qweight, group_scale, group_offset and channel_scale (docs/FORMAT.md)")
            raise ValueError(
                f"{self.prefix}: tensor(s) {missing} were not in the checkpoint; {hint}. The "
                f"checkpoint is incomplete (a missing or truncated shard?): {REEXPORT}, or list "
                "the layer in ignored_layers if it was left in 16 bits")

    def _validate(self, layer: torch.nn.Module) -> None:
        """Values a correct exporter never writes; catching them here beats wrong outputs."""
        errs = F.lqq_param_errors(layer.qweight.data, layer.group_scale.data,
                                  layer.group_offset.data)
        cs = layer.channel_scale.data
        if not bool(torch.isfinite(cs).all()) or bool((cs <= 0).any()):
            errs.append("channel_scale has non-finite or non-positive values")
        if self.scheme.runtime_smooth:
            sm = layer.input_smooth.data
            if not bool(torch.isfinite(sm).all()) or bool((sm <= 0).any()):
                errs.append("input_smooth has non-finite or non-positive values (activations "
                            "are divided by it)")
        if self.scheme.weight_scheme == "w4ax":
            k = layer.mixprec_in_features
            perm = layer.act_perm.data.long()
            if not torch.equal(torch.sort(perm).values, torch.arange(k, device=perm.device)):
                errs.append(f"act_perm is not a permutation of range({k})")
            blocks = int(layer.a8_blocks.data[0])
            if not 0 <= blocks <= k // F.ACT_BLOCK:
                errs.append(f"a8_blocks={blocks} is outside [0, K/{F.ACT_BLOCK} = {k // F.ACT_BLOCK}]")
        if errs:
            raise ValueError(f"{self.prefix}: " + "; ".join(errs) + ". The checkpoint is corrupt "
                             f"or not mixprec format_version 1 (docs/FORMAT.md): {REEXPORT}")

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
              ) -> torch.Tensor:
        return kernels.apply_linear(layer, x, bias)
