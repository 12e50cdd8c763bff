"""SmoothQuant-style smoothing with a per-layer strength search (OS+ / OmniQuant style).

X W^T = (X / s)(W s)^T. The division by s folds into whatever produced X:
  * qkv, gate_up: the preceding RMSNorm weight;
  * o_proj:  v_proj's output rows (attention output channel (h, d) is a mix of V[kv(h), d],
             so s must be equal across the query heads sharing a kv head: GQA groups);
  * down:    up_proj's output rows (silu(gate) * up is linear in up).
The strength alpha in s_j = max|X_j|^alpha / max|W_j|^(1-alpha) is chosen per layer by a
grid search minimising the output error of the quantized layer on calibration rows.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from torch import nn

from .smooth_attention import expand_kv_to_q

ALPHA_GRID = (0.1, 0.25, 0.4, 0.55, 0.7, 0.85)


def smooth_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float,
                  eps: float = 1e-5) -> torch.Tensor:
    """s = max|X|^alpha / max|W|^(1-alpha), normalised to geometric mean 1 (keeps norms O(1))."""
    a = act_absmax.to(torch.float64).clamp_min(eps)
    w = weight_absmax.to(torch.float64).clamp_min(eps)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    return (s / s.log().mean().exp()).clamp(1e-4, 1e4)


@dataclasses.dataclass(frozen=True)
class Gqa:
    """o_proj smoothing lives in kv-head space [Hkv*D], the rest in plain K space."""

    num_heads: int
    num_kv_heads: int

    def reduce(self, v: torch.Tensor) -> torch.Tensor:
        """[Hq*D] -> [Hkv*D]: max over the query heads that share a kv head."""
        rep = self.num_heads // self.num_kv_heads
        return v.view(self.num_kv_heads, rep, -1).amax(1).reshape(-1)

    def expand(self, v: torch.Tensor) -> torch.Tensor:
        return expand_kv_to_q(v, self.num_heads, self.num_kv_heads)


def weight_absmax(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """[K] max |W[:, k]| over all the linears that share the input."""
    return torch.stack([w.detach().abs().amax(0).to(torch.float64) for w in weights]).amax(0)


# fake_quant(x [M, K], w [N, K]) -> y [M, N]: the quantized layer being simulated
FakeQuant = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def search_alpha(x: torch.Tensor, weights: Sequence[torch.Tensor], act_absmax: torch.Tensor,
                 fake_quant: FakeQuant, grid: Sequence[float] = ALPHA_GRID, gqa: Gqa | None = None,
                 max_rows: int = 2048) -> tuple[float | None, torch.Tensor, dict]:
    """Pick alpha (or None = no smoothing) minimising sum ||fake_quant(X/s, W s) - X W^T||^2.

    The error is measured on at most max_rows output channels per weight (a fixed random
    subset): weight quantization is per row, so this is exact for those rows and cheap.
    Returns (alpha, s float64 in scale space: [K], or [Hkv*D] with gqa, {alpha: error}).
    """
    reduce = gqa.reduce if gqa else (lambda v: v)
    expand = gqa.expand if gqa else (lambda v: v)
    xf = x.float()
    a_red, w_red = reduce(act_absmax.to(torch.float64)), reduce(weight_absmax(weights))
    gen = torch.Generator().manual_seed(0)
    ws = [w.detach().float() if w.shape[0] <= max_rows else
          w.detach().float()[torch.randperm(w.shape[0], generator=gen)[:max_rows]] for w in weights]
    ref = [xf @ w.T for w in ws]
    errors, best_alpha, best_s = {}, None, torch.ones_like(a_red)
    for alpha in (None, *grid):
        s = torch.ones_like(a_red) if alpha is None else smooth_scales(a_red, w_red, alpha)
        sf = expand(s).float()
        errors[alpha] = sum(float(((fake_quant(xf / sf, w * sf) - y) ** 2).sum()) for w, y in zip(ws, ref))
        if errors[alpha] < errors[best_alpha]:
            best_alpha, best_s = alpha, s
    return best_alpha, best_s, errors


@torch.no_grad()
def fold_into_norm(norm: nn.Module, linears: Sequence[nn.Linear], s: torch.Tensor,
                   storage_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """norm.weight /= s and W[:, k] *= s. Returns the scale actually applied.

    The norm weight is rounded to its checkpoint dtype here and the linears get
    s_eff = old / rounded, so the fold stays exact after the norm is saved in bf16.
    """
    old = norm.weight.detach().to(torch.float64)
    new = (old / s).to(storage_dtype).to(torch.float64)
    s_eff = torch.where(new != 0, old / new, s)
    norm.weight.copy_(new.to(norm.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s_eff.to(lin.weight.dtype)[None, :])
    return s_eff


@torch.no_grad()
def fold_into_rows(prev: nn.Linear, linears: Sequence[nn.Linear], s_prev: torch.Tensor,
                   s_next: torch.Tensor) -> None:
    """prev's output rows (and bias) ÷ s_prev; the next linears' input columns × s_next.

    For v_proj -> o_proj s_prev is in kv-head space and s_next = Gqa.expand(s_prev).
    """
    prev.weight.div_(s_prev.to(prev.weight.dtype)[:, None])
    if prev.bias is not None:
        prev.bias.div_(s_prev.to(prev.bias.dtype))
    for lin in linears:
        lin.weight.mul_(s_next.to(lin.weight.dtype)[None, :])
