"""W4A8 two-level (LiquidQuant) export: round-to-nearest with an optional clipping search.

The formats themselves live in reference.py; this file only decides *what* to quantize
(which clip ratio per output channel) and produces the checkpoint tensors.
"""
from __future__ import annotations

import torch

from .. import formats as F
from .. import reference as ref

CLIP_RATIOS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76)
GROUP_SHRINK = (0.0, 0.04, 0.08, 0.12, 0.16)  # share of a group's range cut at each end


def clip_rows(w: torch.Tensor, ratio: torch.Tensor | float) -> torch.Tensor:
    """W clipped to +-ratio*max|W_n| per row (float64); quantizing it makes
    quantize_w8_per_channel pick scale = ratio*max/119, so level 1 is not re-implemented."""
    w = w.detach().to(torch.float64)
    lim = w.abs().amax(1, keepdim=True) * torch.as_tensor(ratio, dtype=torch.float64).reshape(-1, 1)
    return torch.maximum(torch.minimum(w, lim), -lim)


def quantize_lqq_clipped(w: torch.Tensor, group_size: int, ratio: torch.Tensor | float = 1.0
                         ) -> dict[str, torch.Tensor]:
    """LQQ tensors of W clipped per row (ratio 1: plain RTN, reference.quantize_weight_lqq)."""
    if not torch.is_tensor(ratio) and ratio == 1.0:
        return ref.quantize_weight_lqq(w, group_size)
    return ref.quantize_weight_lqq(clip_rows(w, ratio), group_size)


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


def search_group_params(w8: torch.Tensor, group_size: int, act_sq: torch.Tensor,
                        shrink=GROUP_SHRINK) -> tuple[torch.Tensor, torch.Tensor]:
    """Level-2 (step, offset) per group minimising sum_k E[x_k^2] (w8 - w8_hat)^2.

    Candidates cut up to `shrink` of the group's [min, max] at either end, with the floor
    and ceil step; reference.lqq_group_params' choice is always among them. A clipped group
    may use code 15 for values beyond its grid, so only candidates whose whole grid stays
    in int8 (min + 15*step <= 127: every lane q*step + a <= 255) are allowed.
    """
    n, k = w8.shape
    # float32 is exact for the int8 grid arithmetic and halves the cost (large layers)
    g = w8.view(n, k // group_size, group_size).to(torch.float32)
    wt = act_sq.to(torch.float32).view(1, k // group_size, group_size)
    mn, mx = g.amin(-1), g.amax(-1)
    rng = mx - mn
    best_err = best_step = best_min = None
    for lo in shrink:
        for hi in shrink:
            cmin = mn + torch.round(lo * rng)
            cmax = torch.maximum(mx - torch.round(hi * rng), cmin)
            for rnd in (torch.ceil, torch.floor):
                step = rnd((cmax - cmin) / F.W4_MAX).clamp_(1, F.MAX_GROUP_STEP)
                q = torch.round((g - cmin[..., None]) / step[..., None]).clamp_(0, F.W4_MAX)
                err = (((q * step[..., None] + cmin[..., None]) - g) ** 2 * wt).sum(-1)
                if best_err is None:
                    best_err, best_step, best_min = err, step, cmin
                    continue
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_step = torch.where(better, step, best_step)
                best_min = torch.where(better, cmin, best_min)
    return best_step.to(torch.uint8), (128 + best_min).to(torch.uint8)


def quantize_lqq_searched(w: torch.Tensor, group_size: int, act_sq: torch.Tensor,
                          ratio: torch.Tensor | float = 1.0) -> dict[str, torch.Tensor]:
    """LQQ tensors with the level-1 clip `ratio` and level-2 params from search_group_params."""
    F.W4Layout(w.shape[0], w.shape[1], group_size)  # validates
    w8, channel_scale = ref.quantize_w8_per_channel(clip_rows(w, ratio))
    step, offset = search_group_params(w8, group_size, act_sq)
    q = ref.lqq_encode(w8, step, offset, group_size)
    return {"qweight": F.pack_nibbles(q), "group_scale": step, "group_offset": offset,
            "channel_scale": channel_scale}


def fake_weight_lqq(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """RTN LiquidQuant of W [N, K], dequantized to float32 without packing the codes: equal bit
    for bit to ref.dequantize_weight(**ref.quantize_weight_lqq(w, group_size)) (tested), which the
    smoothing searches called once per candidate. (q * step + offset) ^ 0x80 read as int8 is
    q * step + min; float32 holds those integers and the product with the float32 channel scale
    rounds once, as dequantize_weight's does."""
    w8, channel_scale = ref.quantize_w8_per_channel(w)
    step, offset = ref.lqq_group_params(w8, group_size)
    n, k = w8.shape
    q = ref.lqq_encode(w8, step, offset, group_size).view(n, k // group_size, group_size).to(torch.float32)
    w8_hat = q * step.to(torch.float32)[..., None] + (offset.to(torch.float32)[..., None] - 128)
    return w8_hat.view(n, k) * channel_scale[:, None]


def fake_w4a8(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float simulation of a W4A8 layer (RTN LQQ weights, per-token int8 activations)."""
    wq = fake_weight_lqq(w, group_size)
    xq, xs = ref.quantize_act(x)
    return (xq.float() * xs[:, None]) @ wq.T
