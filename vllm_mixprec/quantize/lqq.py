"""W4A8 two-level (LiquidQuant) export: round-to-nearest with an optional clipping search.

The formats themselves live in reference.py; this file only decides *what* to quantize
(which clip ratio per output channel) and produces the checkpoint tensors.
"""
from __future__ import annotations

import torch

from .. import reference as ref

CLIP_RATIOS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76)


def quantize_lqq_clipped(w: torch.Tensor, group_size: int, ratio: torch.Tensor | float = 1.0
                         ) -> dict[str, torch.Tensor]:
    """LQQ tensors of W clipped to +-ratio*max|W_n| per row (ratio 1: plain RTN).

    Clipping the weight first makes quantize_w8_per_channel pick scale = ratio*max/119,
    so no level-1 code is re-implemented here.
    """
    if not torch.is_tensor(ratio) and ratio == 1.0:
        return ref.quantize_weight_lqq(w, group_size)
    w = w.detach().to(torch.float64)
    lim = w.abs().amax(1, keepdim=True) * torch.as_tensor(ratio, dtype=torch.float64).reshape(-1, 1)
    return ref.quantize_weight_lqq(torch.maximum(torch.minimum(w, lim), -lim), group_size)


def dequantize(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return ref.dequantize_weight(t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                                 torch.float64)


def clip_search(w: torch.Tensor, group_size: int, act_sq: torch.Tensor,
                ratios=CLIP_RATIOS) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per output channel, the clip ratio minimising sum_k E[x_k^2] (w_nk - w_hat_nk)^2.

    act_sq [K] is the mean squared input per channel (the Hessian diagonal): the output
    error of a row with the cross terms dropped. Returns (tensors, chosen ratio per row).
    """
    w64 = w.detach().to(torch.float64)
    weight = act_sq.to(torch.float64)[None, :]
    best, best_err, best_ratio = None, None, None
    for r in ratios:
        t = quantize_lqq_clipped(w64, group_size, r)
        err = (((w64 - dequantize(t)) ** 2) * weight).sum(1)
        if best is None:
            best, best_err = t, err
            best_ratio = torch.full_like(err, r)
            continue
        better = err < best_err
        best = {k: torch.where(better.view(-1, *[1] * (v.dim() - 1)), t[k], v) for k, v in best.items()}
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(err, r), best_ratio)
    return best, best_ratio


def fake_w4a8(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float simulation of a W4A8 layer (RTN LQQ weights, per-token int8 activations)."""
    wq = dequantize(ref.quantize_weight_lqq(w, group_size)).float()
    xq, xs = ref.quantize_act(x)
    return (xq.float() * xs[:, None]) @ wq.T
