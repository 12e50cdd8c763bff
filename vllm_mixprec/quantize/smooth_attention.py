"""QServe SmoothAttention: divide K's outlier channels out, multiply them into Q.

(Q Λ)(K Λ^-1)^T = Q K^T, so the float model is unchanged, and per-(token, head) KV4 codes
see a flatter K. HF Llama/Qwen2 RoPE (rotate_half) rotates channel i with i + D/2 of
each head, so λ_i = λ_{i+D/2} is required for Λ to commute with RoPE.
"""
from __future__ import annotations

import torch
from torch import nn


def smooth_attention_scales(k_absmax: torch.Tensor, head_dim: int, alpha: float = 0.5,
                            eps: float = 1e-5) -> torch.Tensor:
    """λ [Hkv*D] = max(max|K_i|, max|K_{i+D/2}|)^alpha per kv head, from k_proj output stats."""
    a = k_absmax.to(torch.float64).view(-1, 2, head_dim // 2)  # [Hkv, half, D/2]: i and i+D/2
    pair = a.amax(1, keepdim=True).expand_as(a)
    return pair.reshape(-1).clamp_min(eps).pow(alpha)


def expand_kv_to_q(v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[Hkv*D] per kv head -> [Hq*D]: query head h uses kv head h // (Hq/Hkv) (HF GQA)."""
    return v.view(num_kv_heads, -1).repeat_interleave(num_heads // num_kv_heads, dim=0).reshape(-1)


@torch.no_grad()
def fold_smooth_attention(q_proj: nn.Linear, k_proj: nn.Linear, lam: torch.Tensor,
                          num_heads: int, num_kv_heads: int) -> None:
    """W_q rows × λ (per query head, via its kv head), W_k rows ÷ λ; biases likewise."""
    lam_q = expand_kv_to_q(lam, num_heads, num_kv_heads)
    for lin, s in ((q_proj, lam_q), (k_proj, 1.0 / lam)):
        lin.weight.mul_(s.to(lin.weight.dtype)[:, None])
        if lin.bias is not None:
            lin.bias.mul_(s.to(lin.bias.dtype))


def rope_frequencies(head_dim: int, rope_theta: float) -> torch.Tensor:
    """θ_i of HF default RoPE for the pair (i, i + D/2), i < D/2 (radians per position)."""
    return rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


@torch.no_grad()
def center_k_bias(k_proj: nn.Linear, k_mean: torch.Tensor, head_dim: int, rope_theta: float,
                  max_positions: int, max_angle: float = 0.1) -> torch.Tensor:
    """Subtract K's calibration mean from k_proj's bias in channels RoPE barely rotates.

    q . (k - c) differs from q . k by q . R c, which is the same for every key when the
    rotation R is the identity, so softmax ignores it. RoPE rotates channel pair i by
    θ_i per position; where θ_i * max_positions <= max_angle the drift is negligible
    (Qwen2 keeps biases of ~300 there, which wreck per-token 4-bit K). Not exact: the
    residual drift is bounded by |q_i||c_i| * max_angle. Returns the c subtracted [Hkv*D].
    """
    slow = rope_frequencies(head_dim, rope_theta) * max_positions <= max_angle
    mask = torch.cat([slow, slow]).repeat(k_mean.numel() // head_dim)
    c = torch.where(mask, k_mean.to(torch.float64), 0.0)
    k_proj.bias.sub_(c.to(k_proj.bias.dtype))
    return c
