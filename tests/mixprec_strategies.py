"""Hypothesis strategies shared by the property-based tests (tests/**/test_*_properties.py).

Float inputs come in "distributions" chosen to hit the edges of the quantizers:
  normal    N(0, 1) with a few outlier channels (like real activations)
  constant  every value of a row equal (all-equal groups: range 0)
  extremes  only +-max of the dtype (and, for fp32/bf16, +-1e38)
  denormal  subnormal magnitudes of the dtype (scales hit their clamps)
  zeros     all zero
  mixed     rows of wildly different magnitudes (1e-30 .. 1e30, clipped to the dtype)
and, when asked, NaN / +Inf / -Inf poked into random rows ("poisoned" rows).
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

DISTRIBUTIONS = ("normal", "constant", "extremes", "denormal", "zeros", "mixed")
NONFINITE = (float("nan"), float("inf"), float("-inf"))


def _gen(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def float_tensor(draw, shape: tuple[int, ...], dtype: torch.dtype, dist: str | None = None
                 ) -> torch.Tensor:
    """A finite tensor of `shape` (rows along dim 0 .. -2, values along -1) in `dtype`."""
    dist = dist or draw(st.sampled_from(DISTRIBUTIONS))
    g = _gen(draw)
    fi = torch.finfo(dtype)
    big = fi.max if dtype == torch.float16 else min(fi.max, 1e38)
    if dist == "normal":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        cols = torch.randint(0, shape[-1], (max(1, shape[-1] // 32),), generator=g)
        x[..., cols] *= 30
    elif dist == "constant":
        v = draw(st.sampled_from([0.5, -3.0, 1e-3, 7.0]))
        x = torch.full(shape, v, dtype=torch.float64)
    elif dist == "extremes":
        x = torch.where(torch.rand(shape, generator=g) < 0.5, -big, big).to(torch.float64)
    elif dist == "denormal":
        x = torch.randn(shape, generator=g, dtype=torch.float64) * fi.smallest_normal * 0.25
    elif dist == "zeros":
        x = torch.zeros(shape, dtype=torch.float64)
    else:  # mixed magnitudes, one per row
        mag = 10.0 ** torch.randint(-30, 31, (*shape[:-1], 1), generator=g).double()
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * mag).clamp(-big, big)
    return x.to(dtype)


@st.composite
def activations(draw, rows, cols):
    """(x [M, K], poisoned-row mask, optional smoothing scale [K]) for the activation
    quantizers; rows and cols are strategies for M and K."""
    m, k = draw(rows), draw(cols)
    x = float_tensor(draw, (m, k), draw(st.sampled_from((torch.float16, torch.bfloat16, torch.float32))))
    bad = poison_rows(draw, x)
    smooth = None
    if draw(st.booleans()):
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        smooth = (torch.rand(k, generator=g) * 4 + 0.25).to(x.dtype)
    return x, bad, smooth


def poison_rows(draw, x: torch.Tensor) -> torch.Tensor:
    """Maybe put NaN/Inf values into some rows (dim 0 of a [M, K] or [T, H, D] tensor);
    returns the bool mask of poisoned rows (shape x.shape[:-1])."""
    bad = torch.zeros(x.shape[:-1], dtype=torch.bool)
    if not draw(st.booleans()):
        return bad
    flat = x.view(-1, x.shape[-1])
    badf = bad.view(-1)
    for _ in range(draw(st.integers(1, max(1, min(3, flat.shape[0]))))):
        r = draw(st.integers(0, flat.shape[0] - 1))
        c = draw(st.integers(0, flat.shape[1] - 1))
        flat[r, c] = draw(st.sampled_from(NONFINITE))
        badf[r] = True
    return bad
