"""CPU modules that run exported tensors through reference.py (the quantizer's propagation
path and the perplexity evaluator use the same ones)."""
from __future__ import annotations

import torch
from torch import nn

from .. import formats as F
from .. import reference as ref


class MixPrecLinear(nn.Module):
    """One exported `mixprec` linear layer, computed exactly as reference.py defines it."""

    def __init__(self, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                 weight_scheme: str = "w4a8", act_rotation: str = "none"):
        super().__init__()
        self.weight_scheme = weight_scheme
        for name, t in tensors.items():
            self.register_buffer(name, t.clone())
        self.act_rotation = act_rotation
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.out_features, self.in_features = self.qweight.shape[0], self.qweight.shape[1] * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        smooth = getattr(self, "input_smooth", None)
        if self.weight_scheme == "w4a8":
            return ref.w4a8_linear(x, self.qweight, self.group_scale, self.group_offset,
                                   self.channel_scale, self.bias, smooth)
        x2 = x.reshape(-1, x.shape[-1])
        k8 = int(self.a8_blocks[0]) * F.ACT_BLOCK
        x8, s8, x4, s4 = ref.quantize_act_w4ax(x2, self.act_perm, k8, smooth, self.act_rotation)
        y = ref.w4ax_gemm(x8, s8, x4, s4, self.qweight, self.group_scale, self.group_offset,
                          self.channel_scale, self.bias, x.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.weight_scheme}"


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A plain float32 nn.Linear (fake-quantized W4A16 weights, or float reference)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight.data = weight.detach().float().clone()
    if bias is not None:
        lin.bias.data = bias.detach().float().clone()
    lin.requires_grad_(False)
    return lin


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)
