#!/usr/bin/env python3
"""Activation-only error of W4Ax on a real model's linears (CPU): per-token int8 (W4A8)
against W4Ax with 25% of the 128-channel blocks at 8 bits, with and without a 128-point
Hadamard rotation inside each block (QuaRot-style; folded into the weight offline, applied
to x online). Weights stay in float64, so the numbers isolate the activation quantization.

Calibration (the outlier permutation) on the first half of the tokens, error on the second:
rel = |x_q W^T - x W^T| / |x W^T|. Throwaway-sized diagnostic behind a BENCHMARKS.md row:
  python scripts/diag_w4ax_act_error.py [--tokens 512] [LINEAR_NAME ...]
"""
from __future__ import annotations

import argparse

import torch

from vllm_mixprec import formats as F
from vllm_mixprec.eval.perplexity import load_model_cpu
from vllm_mixprec.quantize import models as M
from vllm_mixprec.quantize.fmpq import num_a8_blocks, outlier_permutation

DEFAULT = ("model.layers.3.self_attn.q_proj", "model.layers.3.mlp.down_proj",
           "model.layers.14.mlp.gate_proj", "model.layers.14.self_attn.o_proj",
           "model.layers.25.mlp.down_proj")


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def fake_sym(blocks: torch.Tensor, qmax: int) -> torch.Tensor:
    s = blocks.abs().amax(-1, keepdim=True) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (blocks / s).round().clamp(-qmax, qmax) * s


def w4ax_fake(x: torch.Tensor, perm: torch.Tensor, nb8: int, rot: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    b = x[:, perm].view(m, k // F.ACT_BLOCK, F.ACT_BLOCK)
    b = b @ rot if rot is not None else b
    q = torch.cat([fake_sym(b[:, :nb8], F.A8_MAX), fake_sym(b[:, nb8:], F.A4_MAX)], 1)
    q = q @ rot.T if rot is not None else q
    out = torch.empty_like(x)
    out[:, perm] = q.reshape(m, k)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=list(DEFAULT))
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--tokens", type=int, default=512)
    a = p.parse_args()
    torch.set_num_threads(1)
    folder = M.cached_model(a.model) or M.fetch_model(a.model)
    model, _ = load_model_cpu(folder)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(folder)(M.load_text("alice29"), return_tensors="pt",
                                                add_special_tokens=False).input_ids[:, :a.tokens]
    mods, acts = dict(model.named_modules()), {}
    for n in a.names:
        mods[n].register_forward_hook(lambda m, i, o, n=n: acts.__setitem__(n, i[0].reshape(-1, i[0].shape[-1])))
    with torch.no_grad():
        model(ids)
    rot = hadamard(F.ACT_BLOCK)
    print(f"{'linear':40} {'A8':>7} {'W4Ax25':>7} {'+rot':>7}")
    for n in a.names:
        x, w = acts[n].double(), mods[n].weight.detach().double()
        half = x.shape[0] // 2
        cal, ev = x[:half], x[half:]
        perm = outlier_permutation(cal.abs().amax(0)).long()
        nb8 = num_a8_blocks(x.shape[1], 0.25)
        y = ev @ w.T
        rel = lambda xq: float((xq @ w.T - y).norm() / y.norm())  # noqa: E731
        print(f"{n:40} {rel(fake_sym(ev, F.A8_MAX)):7.4f} {rel(w4ax_fake(ev, perm, nb8, None)):7.4f} "
              f"{rel(w4ax_fake(ev, perm, nb8, rot)):7.4f}")


if __name__ == "__main__":
    main()
