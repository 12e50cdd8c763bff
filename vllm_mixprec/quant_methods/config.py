"""MixPrecConfig: the `mixprec` QuantizationConfig (fields specified in docs/FORMAT.md)."""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from .. import formats as F
from ..attention_backend.residual import MAX_RESIDUAL_TOKENS as MAX_KV_RESIDUAL_TOKENS

FORMAT_VERSION = 1
REEXPORT = "re-export the checkpoint with `vllm-mixprec quantize`"


class MixPrecConfigError(ValueError):
    """A bad `quantization_config`; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class MixPrecScheme:
    """The validated content of a checkpoint's quantization_config."""

    weight_scheme: str = "w4a8"
    group_size: int = 64
    kv_scheme: str = "none"
    a8_fraction: float | None = None  # W4Ax only: share of 128-channel blocks kept at 8 bits
    ignored_layers: tuple[str, ...] = ()
    runtime_smooth: bool = False  # layers carry input_smooth [K] (smoothing not folded)
    kv_residual_tokens: int | None = None  # newest tokens the CUSTOM backend keeps in 16 bits
    act_rotation: str = "none"  # W4Ax only: formats.ACT_ROTATIONS, applied to each 4-bit block

    REQUIRED = ("quant_method", "format_version", "weight_scheme", "weight_bits", "act_bits",
                "group_size", "kv_scheme")
    OPTIONAL = ("a8_fraction", "ignored_layers", "runtime_smooth", "calibration", "kv_residual_tokens",
                "act_rotation")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "MixPrecScheme":
        if not isinstance(cfg, dict):
            raise MixPrecConfigError(f"quantization_config must be a JSON object, got {type(cfg).__name__}")
        missing = [k for k in cls.REQUIRED if k not in cfg]
        if missing:
            raise MixPrecConfigError(
                f"quantization_config is missing field(s) {missing}; docs/FORMAT.md lists them "
                "(re-export the checkpoint with `vllm-mixprec quantize`)")
        unknown = sorted(set(cfg) - set(cls.REQUIRED) - set(cls.OPTIONAL))
        if unknown:
            raise MixPrecConfigError(
                f"quantization_config has unknown field(s) {unknown}; this reader knows "
                f"{sorted(cls.REQUIRED + cls.OPTIONAL)}. Is the checkpoint from a newer "
                "vllm_mixprec? Upgrade vllm_mixprec, or remove the field if it was added by hand")
        if str(cfg["quant_method"]).lower() != "mixprec":
            raise MixPrecConfigError(
                f"quantization_config.quant_method={cfg['quant_method']!r}, expected 'mixprec'; serve "
                "this checkpoint without --quantization mixprec")
        if cfg["format_version"] != FORMAT_VERSION:
            raise MixPrecConfigError(
                f"quantization_config.format_version={cfg['format_version']!r}; this reader supports "
                f"{FORMAT_VERSION}: upgrade vllm_mixprec, or {REEXPORT}")
        ws = cfg["weight_scheme"]
        if ws not in F.WEIGHT_SCHEMES:
            raise MixPrecConfigError(f"quantization_config.weight_scheme={ws!r} is not one of "
                                     f"{F.WEIGHT_SCHEMES}; {REEXPORT} --scheme w4a8 (or w4ax)")
        if cfg["weight_bits"] != 4 or isinstance(cfg["weight_bits"], bool):
            raise MixPrecConfigError(f"quantization_config.weight_bits={cfg['weight_bits']!r}; mixprec "
                                     f"weights are 4-bit only: set it to 4 or {REEXPORT}")
        want_act = 8 if ws == "w4a8" else "4/8"
        if cfg["act_bits"] != want_act or isinstance(cfg["act_bits"], bool):
            raise MixPrecConfigError(
                f"quantization_config.act_bits={cfg['act_bits']!r}; weight_scheme {ws!r} needs "
                f"{want_act!r}: set it to {want_act!r} or {REEXPORT}")
        gs = cfg["group_size"]
        if gs not in F.SUPPORTED_GROUP_SIZES or not isinstance(gs, int) or isinstance(gs, bool):
            raise MixPrecConfigError(
                f"quantization_config.group_size={gs!r} is not one of {F.SUPPORTED_GROUP_SIZES}; "
                f"{REEXPORT} --group-size 64 (or 128)")
        kv = cfg["kv_scheme"]
        if kv not in F.KV_SCHEMES:
            raise MixPrecConfigError(f"quantization_config.kv_scheme={kv!r} is not one of "
                                     f"{F.KV_SCHEMES}; {REEXPORT} --kv none (or kv8, kv4)")
        frac = cfg.get("a8_fraction")
        if ws == "w4ax":
            if (not isinstance(frac, (int, float)) or isinstance(frac, bool)
                    or not 0.0 <= frac <= 1.0):
                raise MixPrecConfigError(
                    f"quantization_config.a8_fraction={frac!r}; weight_scheme 'w4ax' needs a number "
                    f"in [0, 1]: {REEXPORT} --scheme w4ax --a8-fraction 0.25")
        elif frac is not None:
            raise MixPrecConfigError("quantization_config.a8_fraction is only valid with weight_scheme "
                                     "'w4ax'; remove the field (or set weight_scheme to 'w4ax')")
        rot = cfg.get("act_rotation", "none")
        if rot not in F.ACT_ROTATIONS:
            raise MixPrecConfigError(f"quantization_config.act_rotation={rot!r} is not one of "
                                     f"{F.ACT_ROTATIONS}; {REEXPORT} --scheme w4ax "
                                     "--act-rotation hadamard (or hadamard64, or none)")
        if rot != "none" and ws != "w4ax":
            raise MixPrecConfigError(f"quantization_config.act_rotation={rot!r} is only valid with "
                                     "weight_scheme 'w4ax' (it rotates the 4-bit activation blocks); "
                                     "remove the field, or set it to 'none'")
        ignored = cfg.get("ignored_layers", [])
        if not isinstance(ignored, list) or not all(isinstance(x, str) for x in ignored):
            raise MixPrecConfigError(f"quantization_config.ignored_layers={ignored!r} must be a list of "
                                     'module-name patterns, e.g. ["lm_head"]')
        smooth = cfg.get("runtime_smooth", False)
        if not isinstance(smooth, bool):
            raise MixPrecConfigError(f"quantization_config.runtime_smooth={smooth!r} must be true or "
                                     "false (JSON booleans, not strings)")
        res = cfg.get("kv_residual_tokens")
        if res is not None and (not isinstance(res, int) or isinstance(res, bool)
                                or not 0 <= res <= MAX_KV_RESIDUAL_TOKENS):
            raise MixPrecConfigError(
                f"quantization_config.kv_residual_tokens={res!r} must be an integer in "
                f"[0, {MAX_KV_RESIDUAL_TOKENS}] (0 disables the 16-bit residual window); fix the "
                "field, or remove it to use the default (the KV block size)")
        return cls(ws, gs, kv, None if frac is None else float(frac), tuple(ignored), smooth, res, rot)

    def to_dict(self) -> dict[str, Any]:
        d = {"quant_method": "mixprec", "format_version": FORMAT_VERSION,
             "weight_scheme": self.weight_scheme, "weight_bits": 4,
             "act_bits": 8 if self.weight_scheme == "w4a8" else "4/8",
             "group_size": self.group_size, "kv_scheme": self.kv_scheme,
             "ignored_layers": list(self.ignored_layers), "runtime_smooth": self.runtime_smooth}
        if self.a8_fraction is not None:
            d["a8_fraction"] = self.a8_fraction
        if self.kv_residual_tokens is not None:
            d["kv_residual_tokens"] = self.kv_residual_tokens
        if self.act_rotation != "none":
            d["act_rotation"] = self.act_rotation
        return d


@register_quantization_config("mixprec")
class MixPrecConfig(QuantizationConfig):
    """`--quantization mixprec`: W4A8 / W4Ax linear layers, optional KV4/KV8 cache."""

    def __init__(self, scheme: MixPrecScheme | None = None, raw: dict[str, Any] | None = None):
        super().__init__()
        self.scheme = scheme or MixPrecScheme()
        self.raw = raw or self.scheme.to_dict()

    def __repr__(self) -> str:
        return f"MixPrecConfig({self.scheme})"

    @property
    def kv_residual_tokens(self) -> int | None:
        """quantization_config.kv_residual_tokens, read by attention_backend/residual.py."""
        return self.scheme.kv_residual_tokens

    def get_name(self) -> str:
        return "mixprec"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # int8 mma / Triton int8 dot

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MixPrecConfig":
        return cls(MixPrecScheme.from_dict(config), dict(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        if str(hf_quant_cfg.get("quant_method", "")).lower() == "mixprec":
            return "mixprec"
        return None

    def is_layer_ignored(self, prefix: str) -> bool:
        """True when `prefix` (or, for a merged layer, every shard of it) matches ignored_layers."""
        pats = self.scheme.ignored_layers
        if not pats:
            return False
        names = [prefix]
        last = prefix.rsplit(".", 1)[-1]
        if last in self.packed_modules_mapping:
            base = prefix[: -len(last)]
            names = [base + s for s in self.packed_modules_mapping[last]]
        hits = [any(fnmatch.fnmatchcase(n, p) or n.endswith("." + p) or n == p for p in pats) for n in names]
        if any(hits) and not all(hits):
            raise MixPrecConfigError(
                f"ignored_layers covers only some shards of merged layer {prefix} ({names}); "
                "vLLM fuses them, so ignore all or none")
        return all(hits)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.attention import Attention

        if isinstance(layer, LinearBase):
            if self.is_layer_ignored(prefix):
                from .k_bias import RecordingUnquantizedLinearMethod
                return RecordingUnquantizedLinearMethod(prefix)
            from vllm.config import get_current_vllm_config

            from .. import compile_passes
            from .linear import MixPrecLinearMethod
            if compile_passes.wanted():  # installs once, later calls see it there
                compile_passes.install(get_current_vllm_config().compilation_config)
            return MixPrecLinearMethod(self, prefix)
        if isinstance(layer, Attention):
            from .kv_cache import MixPrecKVCacheMethod
            return MixPrecKVCacheMethod(self, prefix)
        return None
