"""Round-to-nearest W4A8 export: no calibration, for checks and tests (the quantizer does better).

LiquidQuant codes of every decoder linear weight (reference.quantize_weight_lqq), every other
tensor as it is. Deterministic: per-channel and per-group min/max, no sums, so two machines
write the same bytes: the GPU host builds the real Qwen's export from its bf16 folder, and
eval/realcheck.py pins it by sha256 against the one its CPU reference scored here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import reference as ref
from .calibration import LINEAR_NAMES

LINEARS = tuple(n.rsplit(".", 1)[1] for n in LINEAR_NAMES)  # q_proj ... down_proj


def rtn_w4a8_tensors(state: dict[str, torch.Tensor], group_size: int = 64) -> dict[str, torch.Tensor]:
    """`state` with each `*.{LINEARS}.weight` [N, K] replaced by its four W4A8 tensors."""
    out = {}
    for name, t in state.items():
        mod = name.rsplit(".", 2)
        if len(mod) == 3 and mod[1] in LINEARS and mod[2] == "weight":
            prefix = name[: -len(".weight")]
            for k, v in ref.quantize_weight_lqq(t.float(), group_size).items():
                out[f"{prefix}.{k}"] = v.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def export_rtn_folder(src: str | Path, dst: str | Path, kv_scheme: str = "none",
                      group_size: int = 64) -> Path:
    """The 16-bit folder src's RTN W4A8 export (quantization_config with `kv_scheme`) into dst,
    written atomically (export.write_checkpoint); dst must not exist."""
    from safetensors.torch import load_file

    from ..quant_methods.config import MixPrecScheme
    from .export import write_checkpoint

    src = Path(src)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    config = json.loads((src / "config.json").read_text())
    qc = MixPrecScheme(group_size=group_size, kv_scheme=kv_scheme).to_dict()
    return write_checkpoint(dst, rtn_w4a8_tensors(state, group_size), config, src, qc)


__all__ = ["LINEARS", "rtn_w4a8_tensors", "export_rtn_folder"]
