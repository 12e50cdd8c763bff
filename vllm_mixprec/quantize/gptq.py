"""GPTQ (Frantar et al.): quantize W column by column, pushing each column's error onto the
columns not yet quantized through the inverse Hessian H = X^T X of the layer input.

Two grids plug into the same solver:
  * `Int4Sym`: W4A16 g128 symmetric, the standard GPTQ checkpoint vLLM serves with Marlin;
  * `LqqGrid`: the W4A8 LiquidQuant grid (level-1 per-channel int8 scale fixed up front,
    level-2 group step/offset fitted at each group's first column), exported as mixprec.
A grid is (fit, fake): fit(W[:, g:g+G], cols) -> per-group params at the group's first column
(on the error-updated weights, as in GPTQ), fake(column, params) -> dequantized column.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import formats as F
from .. import reference as ref

GPTQ_BITS = 4
GPTQ_PACK = 32 // GPTQ_BITS  # int4 values per int32
GPTQ_ZERO = 8  # uint4b8: w = (q - 8) * scale


@dataclasses.dataclass(frozen=True)
class Int4Sym:
    """Symmetric int4 per group: scale = 2*max|w|/15 (GPTQ's sym convention), q in [0, 15]."""

    def fit(self, w: torch.Tensor, cols: slice) -> torch.Tensor:
        amax = w.abs().amax(1).clamp_min(1e-10)
        # rounded to fp16 now, because the checkpoint stores fp16 scales
        return (2 * amax / 15).to(torch.float16).to(torch.float64)

    def codes(self, col: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(col / scale) + GPTQ_ZERO, 0, 15)

    def fake(self, col: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (self.codes(col, scale) - GPTQ_ZERO) * scale


@dataclasses.dataclass(frozen=True)
class LqqGrid:
    """LiquidQuant: w_hat = lqq_dequant(encode(clamp(round(w / s1)))) * s1, s1 fixed per row."""

    channel_scale: torch.Tensor  # [N] float32, from the weights before GPTQ
    act_sq: torch.Tensor | None = None  # [K]: fit groups by lqq.search_group_params

    def w8(self, w: torch.Tensor) -> torch.Tensor:
        s1 = self.channel_scale.to(torch.float64).view(-1, *[1] * (w.dim() - 1))
        return torch.round(w / s1).clamp_(-F.W8_PROTECT, F.W8_PROTECT).to(torch.int8)

    def fit(self, w: torch.Tensor, cols: slice) -> tuple[torch.Tensor, ...]:
        """(step, offset) uint8 [N, 1] of the group at columns `cols`, plus float64 copies."""
        if self.act_sq is None:
            step, offset = ref.lqq_group_params(self.w8(w), w.shape[1])
        else:
            from .lqq import search_group_params
            step, offset = search_group_params(self.w8(w), w.shape[1], self.act_sq[cols])
        # GPTQ may push later columns past the fitted [min, max]; no lane can wrap anyway:
        # w8 <= 119 and q*step <= w8 - min + step/2, so q*step + a <= 119 + 8 + 128
        return step, offset, step[:, 0].to(torch.float64), offset[:, 0].to(torch.float64) - 128

    def fake(self, col: torch.Tensor, params) -> torch.Tensor:
        # lqq_encode + lqq_dequant_lanes written out in float64: this runs once per column,
        # so it is the solver's hot path (test_gptq checks it against the reference decode)
        _, _, step, mn = params
        s1 = self.channel_scale.to(torch.float64)
        w8 = torch.round(col / s1).clamp_(-F.W8_PROTECT, F.W8_PROTECT)
        q = torch.round((w8 - mn) / step).clamp_(0, F.W4_MAX)
        return (q * step + mn) * s1


def damped_hessian(h: torch.Tensor, w: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dead inputs (never active) get H_kk = 1 and W[:, k] = 0; then add percdamp * mean(diag)."""
    h = h.to(torch.float64).clone()
    w = w.to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h.diagonal().add_(percdamp * torch.diag(h).mean())
    return h, w


def gptq(w: torch.Tensor, h: torch.Tensor, grid, group_size: int, block_size: int = 128,
         percdamp: float = 0.01) -> tuple[torch.Tensor, list[Any]]:
    """GPTQ with lazy batch updates and a Cholesky inverse (desc_act off, static order).

    w [N, K], h [K, K] = sum x x^T. Returns (dequantized W_hat [N, K] float64, the per-group
    params in group order).
    """
    n, k = w.shape
    F.check_divisible("in_features", k, group_size)
    block_size = max(block_size // group_size, 1) * group_size  # groups never straddle blocks
    h, w = damped_hessian(h, w, percdamp)
    # upper Cholesky factor of H^-1: row i holds the update weights of column i onto i+1..K
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    params = []
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        wb = w[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        diag = hb.diagonal().tolist()
        for i in range(b1 - b0):
            if (b0 + i) % group_size == 0:
                params.append(grid.fit(wb[:, i:i + group_size], slice(b0 + i, b0 + i + group_size)))
            col = wb[:, i]
            qc = grid.fake(col, params[-1])
            q[:, b0 + i] = qc
            e = (col - qc) / diag[i]
            wb[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]  # the lazy part: one GEMM per block
    return q, params


# --- W4A16: the standard GPTQ checkpoint layout ------------------------------------------

def gptq_w4a16(w: torch.Tensor, h: torch.Tensor, group_size: int = 128, percdamp: float = 0.01
               ) -> dict[str, torch.Tensor]:
    """Quantize one linear; returns its GPTQ checkpoint tensors (see pack_gptq)."""
    grid = Int4Sym()
    w_hat, scales = gptq(w, h, grid, group_size, percdamp=percdamp)
    scale = torch.stack(scales, dim=1)  # [N, K/G]
    codes = grid.codes(w_hat, scale.repeat_interleave(group_size, dim=1))
    return pack_gptq(codes.to(torch.uint8), scale, group_size)


def pack_gptq(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """codes uint8 [N, K] in [0, 15], scale [N, K/G] -> the `quant_method: gptq` tensors.

    qweight int32 [K/8, N]: k = 8r + j sits in bits 4j..4j+3 of row r (packed along K);
    scales fp16 [K/G, N]; g_idx int32 [K] = k // G;
    qzeros int32 [K/G, N/8] packed along N, every nibble 7: checkpoint_format "gptq" (v1)
    stores zero - 1 (the kernels add 1 back). vLLM's Marlin path ignores qzeros for
    sym=true (uint4b8 has its zero fixed at 8), other GPTQ readers use it.
    """
    n, k = codes.shape
    F.check_divisible("in_features", k, GPTQ_PACK)
    F.check_divisible("out_features", n, GPTQ_PACK)
    c = codes.to(torch.int64).T.reshape(k // GPTQ_PACK, GPTQ_PACK, n)
    shifts = (torch.arange(GPTQ_PACK, dtype=torch.int64) * GPTQ_BITS)[None, :, None]
    qweight = (c << shifts).sum(1)
    zeros = torch.full((k // group_size, n // GPTQ_PACK, GPTQ_PACK), GPTQ_ZERO - 1, dtype=torch.int64)
    qzeros = (zeros << shifts.view(1, 1, -1)).sum(2)
    return {"qweight": _to_int32(qweight), "scales": scale.T.contiguous().to(torch.float16),
            "qzeros": _to_int32(qzeros), "g_idx": torch.arange(k, dtype=torch.int32) // group_size}


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def unpack_gptq(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> uint8 codes [N, K]; inverse of pack_gptq's qweight."""
    q = qweight.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(GPTQ_PACK, dtype=torch.int64) * GPTQ_BITS)[None, :, None]
    codes = (q[:, None, :] >> shifts) & 0xF  # [K/8, 8, N]
    return codes.reshape(-1, q.shape[1]).T.to(torch.uint8)


def dequantize_gptq(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """W_hat [N, K] float32 = (q - 8) * scale[g_idx] (sym, zero fixed at 8 like vLLM)."""
    codes = unpack_gptq(t["qweight"]).to(torch.float32)
    scale = t["scales"].to(torch.float32).T[:, t["g_idx"].long()]
    return (codes - GPTQ_ZERO) * scale


def gptq_quantize_config(group_size: int, percdamp: float) -> dict:
    return {"quant_method": "gptq", "bits": GPTQ_BITS, "group_size": group_size, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq", "static_groups": False,
            "true_sequential": False, "damp_percent": percdamp}


# --- W4A8: GPTQ on the LiquidQuant grid ----------------------------------------------------

def gptq_lqq(w: torch.Tensor, h: torch.Tensor, group_size: int, percdamp: float = 0.01,
             clip_ratio: torch.Tensor | float = 1.0, act_sq: torch.Tensor | None = None
             ) -> dict[str, torch.Tensor]:
    """W4A8 tensors (formats.W4Layout) with GPTQ error feedback on the two-level grid.

    The level-1 scale comes from the (optionally clipped) weights before GPTQ; GPTQ then
    compensates each column's two-level rounding error on the later columns.
    """
    from .lqq import quantize_lqq_clipped

    channel_scale = quantize_lqq_clipped(w, group_size, clip_ratio)["channel_scale"]
    grid = LqqGrid(channel_scale, act_sq)
    w_hat, params = gptq(w, h, grid, group_size, percdamp=percdamp)
    step = torch.cat([p[0] for p in params], dim=1)  # uint8 [N, K/G]
    offset = torch.cat([p[1] for p in params], dim=1)
    w8 = grid.w8(w_hat)  # exact: w_hat is w8_hat * s1 on the grid
    codes = ref.lqq_encode(w8, step, offset, group_size)
    return {"qweight": F.pack_nibbles(codes), "group_scale": step, "group_offset": offset,
            "channel_scale": channel_scale}


def gptq_naive(w: torch.Tensor, h: torch.Tensor, grid, group_size: int, percdamp: float = 0.01):
    """The straightforward OBS loop (no blocks, no Cholesky): the test oracle for gptq().

    After quantizing column j, the remaining columns move by -e_j * Hinv[j, :] / Hinv[j, j]
    and j is eliminated from the inverse Hessian by one Gauss-Jordan step.
    """
    h, w = damped_hessian(h, w, percdamp)
    hinv = torch.linalg.inv(h)
    q = torch.zeros_like(w)
    params = []
    for j in range(w.shape[1]):
        if j % group_size == 0:
            params.append(grid.fit(w[:, j:j + group_size], slice(j, j + group_size)))
        q[:, j] = grid.fake(w[:, j], params[-1])
        e = (w[:, j] - q[:, j]) / hinv[j, j]
        w[:, j:] -= e[:, None] * hinv[j, j:][None, :]
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return q, params
