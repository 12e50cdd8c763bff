"""COMET FMPQ for W4Ax: outlier channels go to 8-bit blocks, the rest of K runs at 4 bits.

Activations are split only along K into 128-channel blocks (formats.ACT_BLOCK), each with
its own per-token scale. A permutation of K puts the outliers found on calibration data in the
first `a8_blocks` blocks, which are quantized to int8: whole original blocks (A8_SELECTIONS
"blocks", the default) or every channel sorted by magnitude ("channels"). The weight's K is
permuted the same way, so the GEMM is unchanged. Layers that share an input (q/k/v, gate/up) must share
the permutation, because vLLM fuses them into one GEMM.

With act_rotation "hadamard" each 4-bit block of the permuted K is also multiplied by an
orthonormal Hadamard matrix H (QuaRot's idea, inside a block): x_b H spreads a block's
largest values over all 128 channels, so the 16-level grid fits it far better, and the
exporter stores W_b H, so the product is unchanged.
"""
from __future__ import annotations

import torch

from .. import formats as F
from .. import reference as ref
from . import lqq


def num_a8_blocks(in_features: int, a8_fraction: float) -> int:
    """Blocks kept at 8 bits: round(fraction * K/128), validated by formats.W4ActLayout."""
    n_blocks = in_features // F.ACT_BLOCK
    n = int(round(a8_fraction * n_blocks))
    F.W4ActLayout(in_features, n)
    return n


# How a decoder layer's 8-bit blocks are spread (QuantOptions.a8_allocation, `quantize --a8-allocation`):
# "uniform": round(a8_fraction * K/128) in every linear; "layer": the layer's total spread over its
# input groups by block_gains, the budget in GEMM MACs (a block of a group costs its N);
# "layer-blocks": the same with the budget in blocks (each costs 1), so a8_fraction is the share
# of the layer's blocks by count, as issue #3 words its W4Ax target.
A8_ALLOCATIONS = ("uniform", "layer", "layer-blocks")
# `vllm-mixprec quantize --scheme w4ax`'s defaults: the recipe that met issue #3's W4Ax target
# (<= 1.25x W4A8's dppl with 25 % of the blocks at 8 bits) on Qwen2.5-1.5B at 32 and 64 x 512
# calibration tokens (docs/BENCHMARKS.md, sessions 44-45); uniform with the 128-point rotation
# missed it (1.14x / 1.88x).
W4AX_DEFAULT_ALLOCATION = "layer-blocks"
W4AX_DEFAULT_ROTATION = "hadamard64"


def block_gains(x: torch.Tensor, w: torch.Tensor, perm: torch.Tensor, act_rotation: str) -> torch.Tensor:
    """float64 [K/128]: what keeping block b (in permutation order) at 8 bits instead of 4
    saves in output error on these rows, (|D4_b W_b^T|^2 - |D8_b W_b^T|^2) / |x W^T|^2, with D
    the quantized minus the float x_b (4 bits in the rotated basis, mapped back). Every block
    has its own per-token scale, so a block's error does not depend on how many others are at
    8 bits; cross-block terms are left out (independent rounding). |D W^T|^2 = sum((D^T D) *
    (W^T W)) keeps the work to 128x128 Gram matrices. w [N, K]: a group's linears stacked."""
    x, w = x.double(), w.double()
    p = perm.long()
    blocks = lambda t: t[:, p].reshape(t.shape[0], -1, F.ACT_BLOCK)  # noqa: E731
    xb, wb = blocks(x), blocks(w)
    gram_w = torch.einsum("nbi,nbj->bij", wb, wb)
    err = lambda d: (torch.einsum("mbi,mbj->bij", d, d) * gram_w).sum((1, 2))  # noqa: E731
    m, k = x.shape
    xq = ref.w4ax_act_input(x, perm, 0, None, act_rotation)  # every block at 4 bits, rotated
    d4 = ref.dequantize_act_w4ax(*ref.quantize_act_w4ax(x, perm, 0, act_rotation=act_rotation)) - xq
    rotation = F.act_rotation_matrix(act_rotation)
    if rotation is not None:
        d4 = ref.rotate_a4_blocks(d4, 0, rotation.double().T)
    d8 = ref.dequantize_act_w4ax(*ref.quantize_act_w4ax(x, perm, k, act_rotation=act_rotation)) - x[:, p]
    y2 = (x @ w.T).pow(2).sum().clamp_min(torch.finfo(torch.float64).tiny)
    return (err(d4.reshape(m, -1, F.ACT_BLOCK)) - err(d8.reshape(m, -1, F.ACT_BLOCK))) / y2


def allocate_a8_blocks(gains: dict[str, torch.Tensor], cost: dict[str, float], budget: float
                       ) -> dict[str, int]:
    """8-bit blocks per group within `budget` (in the units of `cost`, what one more 8-bit block
    of a group costs: its GEMM's N, the MACs per token and channel). Greedy: the next block of
    the group with the most gain per cost that still fits (a group's 8-bit blocks are a prefix
    of its permutation order). With N as the cost, 25 % of the budget means 25 % of the MACs
    at 8 bits, not 25 % of the blocks: a wide gate_up block costs 12x a down_proj one."""
    n = dict.fromkeys(gains, 0)
    left = budget
    while True:
        fits = [k for k in gains if n[k] < len(gains[k]) and cost[k] <= left + 1e-9]
        if not fits:
            return n
        best = max(fits, key=lambda k: float(gains[k][n[k]]) / cost[k])
        n[best] += 1
        left -= cost[best]


def outlier_permutation(act_absmax: torch.Tensor) -> torch.Tensor:
    """int32 [K]: channels by decreasing calibration max |x| (stable for ties).

    The first k8 positions are the outliers; sorting the 4-bit rest as well places channels
    of similar magnitude in the same weight group (QoQ's activation-aware reorder).
    """
    return torch.argsort(act_absmax.to(torch.float64), descending=True, stable=True).to(torch.int32)


def block_outlier_permutation(act_absmax: torch.Tensor) -> torch.Tensor:
    """int32 [K]: whole 128-channel blocks of the original order by decreasing calibration max |x|
    (stable for ties), each block's channels in their order. The first a8 blocks are then the
    blocks with the largest values at 8 bits, whatever their number, and every weight group (64 or
    128 channels, inside one block) keeps its channels: only whole blocks move."""
    a = act_absmax.to(torch.float64)
    if a.numel() % F.ACT_BLOCK:
        raise ValueError(f"block selection needs K a multiple of {F.ACT_BLOCK}, got {a.numel()}")
    order = torch.argsort(a.reshape(-1, F.ACT_BLOCK).amax(1), descending=True, stable=True)
    return F.act_channel_perm(order, a.numel()).to(torch.int32)


# How the 8-bit activation blocks are chosen (QuantOptions.a8_select, `quantize --a8-select`):
# "blocks" (the default) keeps the original 128-channel blocks and puts those with the largest
# max |x| at 8 bits (the Hadamard rotation inside each 4-bit block spreads the outliers the 4-bit
# blocks keep); "channels" sorts every channel by calibration max |x| (COMET's permutation: the
# outlier channels fill the first blocks). On Qwen2.5-Coder-1.5B "blocks" loses less on lcet10 and
# as much on botchan (docs/BENCHMARKS.md, session 31).
A8_SELECTIONS = ("channels", "blocks")


def act_permutation(act_absmax: torch.Tensor, select: str) -> torch.Tensor:
    """The activation channel permutation (checkpoint `act_perm`) of an A8_SELECTIONS choice."""
    if select == "channels":
        return outlier_permutation(act_absmax)
    if select == "blocks":
        return block_outlier_permutation(act_absmax)
    raise ValueError(f"a8 selection {select!r} is not one of {A8_SELECTIONS}")


def permute_weight(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> W[:, perm], so that x[:, perm] @ W[:, perm]^T == x @ W^T."""
    return w[:, perm.long()]


def weight_basis(w: torch.Tensor, perm: torch.Tensor, k8: int, rotation: torch.Tensor | None
                 ) -> torch.Tensor:
    """W [N, K] in the basis its activations are quantized in: K permuted, each 4-bit block
    times `rotation` (W_b H, so that (x_b H)(W_b H)^T = x_b W_b^T)."""
    return ref.rotate_a4_blocks(permute_weight(w, perm), k8, rotation)


def hessian_basis(h: torch.Tensor, perm: torch.Tensor, k8: int, rotation: torch.Tensor | None
                  ) -> torch.Tensor:
    """GPTQ's H = E[x^T x] [K, K] in the same basis: R^T H[perm][:, perm] R, R = blockdiag(I, rot...)."""
    p = perm.long()
    hr = ref.rotate_a4_blocks(h[p][:, p], k8, rotation)
    return ref.rotate_a4_blocks(hr.T.contiguous(), k8, rotation).T.contiguous()


def fake_w4ax(x: torch.Tensor, w: torch.Tensor, group_size: int, perm: torch.Tensor, k8: int,
              act_rotation: str = "none") -> torch.Tensor:
    """Float simulation of a W4Ax layer (RTN LQQ weights on permuted, rotated K)."""
    wq = lqq.fake_weight_lqq(weight_basis(w, perm, k8, F.act_rotation_matrix(act_rotation)), group_size)
    return ref.dequantize_act_w4ax(*ref.quantize_act_w4ax(x, perm, k8, act_rotation=act_rotation)) @ wq.T
