#!/usr/bin/env python3
"""Activation-only error of W4Ax on a real model's linears (CPU): per-token int8 (W4A8)
against W4Ax with 25% of the 128-channel blocks at 8 bits, and variants of the 4-bit part:

  W4Ax25    the format up to session 29: outlier blocks by calibration max|x|, the rest sorted
            by it, 4-bit codes on the integers -7..7 (every variant below but *-h16 keeps them)
  +rot      a 128-point Hadamard rotation inside each 4-bit block (QuaRot-style; folded into
            the weight offline, applied to x online)
  sens      8-bit blocks chosen by max|x_c| * |W[:, c]| (the channel's weight on the output)
  clip      4-bit scale alpha * max|block|, alpha searched on the calibration half
  g32       4-bit scales per 32 channels instead of 128 (a format change)
  +rot-g32, +rot-g64  (--ppl only) +rot with the 4-bit scales per 32 / 64 channels of the
            rotated block (a format change; session 29)
  +rot-a90, +rot-a80  (--ppl only) +rot with the 4-bit scale at 0.9 / 0.8 of the block's max:
            one fixed clip ratio for the near-Gaussian rotated blocks, not fitted per linear
  +rot-h16  (--ppl only) +rot with the 4-bit codes on the 16 half-integers -7.5..7.5 (scale
            max/7.5) instead of the 15 integers -7..7: every 4-bit pattern used, none on zero.
            The format since session 30 (formats.A4_TOP)
  +rrot-h16 (--ppl only) the same after D H (+rrot's seed): the seeds' spread is larger than
            the grid's effect could be, so the two grids are compared over seeds
  +rrot     (--ppl only) +rot with random signs: D H, D a fixed random +-1 diagonal (seed
            $DIAG_RROT_SEED, default 0),
            QuaRot's randomized Hadamard; the weights are rounded in that basis too
  +rrot-cal (--ppl only) D H with D chosen per linear among SIGN_CANDIDATES seeds by the output
            error on the calibration tokens (activations and RTN weights in that basis); each
            linear chooses alone (a served merged qkv / gate_up would need one choice)
  all       sens + clip + rot
  budget    (--ppl only) +rot, but the 8-bit blocks spread unevenly over a decoder layer's 4
            input groups (qkv, o, gate_up, down) within the 8-bit MACs of 25% each (a block
            costs its group's N): greedy on gain per MAC of each group's next block,
            fmpq.block_gains on the calibration tokens (W: the group's linears stacked along N);
            what `quantize --a8-allocation layer` does
  budget-global  (--ppl only) the same with one MAC budget for the whole model
  +rot-h16-keep    (--ppl only) +rot-h16 with the 4-bit channels left in their original order
            (the 8-bit ones still the largest by calibration max|x|): the weights' groups keep
            their neighbours (session 31)
  +rot-h16-blocks  (--ppl only) +rot-h16 without a channel permutation: the 8-bit blocks are the
            original 128-channel blocks of largest calibration max|x|, every block keeps its
            channels and order (session 31)
  W4, W4-perm, W4-perm-rot, W4-blocks-rot  (--ppl --weights only) activations in float, the
            weights rounded to RTN W4 g64 in the original basis (W4A16), in W4Ax25's permuted basis,
            in +rot's permuted and rotated one, and in +rot-h16-blocks' one: what the basis alone
            costs the weights (session 31)
  +rot64-h16-blocks, W4-blocks-rot64  (--ppl only) +rot-h16-blocks / W4-blocks-rot with a 64-point
            Hadamard on each half of a 4-bit block instead of the 128-point one (one 4-bit scale per
            128 channels still): the rotation then never mixes two weight groups (g64), whose steps
            differ (session 32)
Session 21, with the budget in blocks instead of MACs: budget +9.65 %, budget-global +9.06 %
(+rot +10.02 %, A8 +8.42 %), but both moved gate_up (N 17920) to nearly all 8-bit, 2-3x the
8-bit MACs of uniform 25 %: hence the MAC budget.

Weights stay in float64, so the numbers isolate the activation quantization. Calibration (the
permutation, alpha) on the first half of the tokens, error on the second:
rel = |x_q W^T - x W^T| / |x W^T|. Diagnostic behind BENCHMARKS.md rows:
  python scripts/diag_w4ax_act_error.py [--tokens 512] [LINEAR_NAME ...]

--ppl: the same activation variants in every decoder linear at once, weights in float, as a
perplexity (eval text lcet10, calibration on alice29: disjoint). Each linear calibrates its
own permutation and clip ratio on --tokens alice29 tokens. What 4-bit activations cost the
model end to end, apart from weight quantization:
  python scripts/diag_w4ax_act_error.py --ppl [--eval-tokens 2048] [--eval-text lcet10] [--variants A8,W4Ax25,+rot,all]
--weights: each variant also rounds the weights to LiquidQuant W4 (round to nearest, group 64)
in its own basis (permuted, and for +rot/all rotated in the 4-bit blocks), so A8 is W4A8:
the whole formats, without smoothing or GPTQ.
"""
from __future__ import annotations

import argparse
import functools
import os
import re

import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.eval.perplexity import load_model_cpu
from vllm_mixprec.quantize import models as M
from vllm_mixprec.quantize.calibration import LINEAR_GROUPS
from vllm_mixprec.quantize import fmpq
from vllm_mixprec.quantize.fmpq import num_a8_blocks, outlier_permutation

DEFAULT = ("model.layers.3.self_attn.q_proj", "model.layers.3.mlp.down_proj",
           "model.layers.14.mlp.gate_proj", "model.layers.14.self_attn.o_proj",
           "model.layers.25.mlp.down_proj")
ALPHAS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
BUDGET_VARIANTS = ("budget", "budget-global")
GROUP4 = {"g32": 32, "+rot-g32": 32, "+rot-g64": 64}  # the 4-bit scale group; else ACT_BLOCK
FIXED_ALPHA = {"+rot-a90": 0.9, "+rot-a80": 0.8}  # a clip ratio for every linear
HALF_GRID = ("+rot-h16", "+rrot-h16", "+rot-h16-keep", "+rot-h16-blocks", "+rot64-h16-blocks")  # 4-bit codes on the half-integers
WEIGHT_ONLY = ("W4", "W4-perm", "W4-perm-rot", "W4-blocks-rot", "W4-blocks-rot64")  # float activations, RTN weights in a basis
SIGN_CANDIDATES = 4
PPL_VARIANTS = ("A8", "W4Ax25", "+rot", "g32", "+rot-g32", "+rot-g64", "+rrot", "+rrot-cal", "all") + \
    tuple(FIXED_ALPHA) + HALF_GRID + BUDGET_VARIANTS + WEIGHT_ONLY


@functools.lru_cache(maxsize=None)
def signed_hadamard(seed: int) -> torch.Tensor:
    """D H (float64), D a random +-1 diagonal drawn with `seed`: orthogonal."""
    d = 1 - 2 * torch.randint(0, 2, (F.ACT_BLOCK,), generator=torch.Generator().manual_seed(seed))
    return d.double()[:, None] * F.hadamard().double()


def fake_sym(blocks: torch.Tensor, qmax: int, alpha: float = 1.0, half: bool = False) -> torch.Tensor:
    """Symmetric fake quantization per last-dim block: integers -qmax..qmax, or with `half` the
    2 qmax + 2 half-integers -(qmax + .5)..qmax + .5 (the same bits, no code on zero)."""
    top = qmax + 0.5 if half else qmax
    s = blocks.abs().amax(-1, keepdim=True) * alpha / top
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (blocks / s).floor() + 0.5 if half else (blocks / s).round()
    return q.clamp(-top, top) * s


def w4ax_fake(x: torch.Tensor, perm: torch.Tensor, nb8: int, rot: torch.Tensor | None = None,
              alpha: float = 1.0, group4: int = F.ACT_BLOCK, half: bool = False) -> torch.Tensor:
    m, k = x.shape
    k8 = nb8 * F.ACT_BLOCK
    xp = x[:, perm]
    hi = fake_sym(xp[:, :k8].reshape(m, -1, F.ACT_BLOCK), F.A8_MAX).reshape(m, k8)
    lo = xp[:, k8:].reshape(m, -1, F.ACT_BLOCK)
    lo = lo @ rot if rot is not None else lo
    lo = fake_sym(lo.reshape(m, -1, group4), F.A4_MAX, alpha, half).reshape(m, -1, F.ACT_BLOCK)
    lo = lo @ rot.T if rot is not None else lo
    out = torch.empty_like(x)
    out[:, perm] = torch.cat([hi, lo.reshape(m, k - k8)], 1)
    return out


def rtn_weight(w: torch.Tensor, perm: torch.Tensor | None = None, nb8: int = 0,
               rot: torch.Tensor | None = None) -> torch.Tensor:
    """W rounded to LiquidQuant W4 (RTN, group 64) in the basis the activations are quantized in
    (columns permuted, the 4-bit blocks rotated), then brought back to the original basis."""
    k8 = nb8 * F.ACT_BLOCK
    wp = w.double() if perm is None else w.double()[:, perm]
    if rot is not None:
        wp = ref.rotate_a4_blocks(wp, k8, rot)
    t = ref.quantize_weight_lqq(wp, 64)
    wq = ref.dequantize_weight(t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"], torch.float64)
    if rot is not None:
        wq = ref.rotate_a4_blocks(wq, k8, rot.T)
    if perm is None:
        return wq.to(w.dtype)
    out = torch.empty_like(wq)
    out[:, perm] = wq
    return out.to(w.dtype)


def keep_order_permutation(amax: torch.Tensor, nb8: int) -> torch.Tensor:
    """The nb8 * 128 channels of largest max|x| first (by it), then the rest in original order."""
    top = torch.argsort(amax, descending=True, stable=True)[:nb8 * F.ACT_BLOCK]
    rest = torch.ones_like(amax, dtype=torch.bool)
    rest[top] = False
    return torch.cat([top, torch.nonzero(rest).flatten()])


def sensitive_permutation(amax: torch.Tensor, w: torch.Tensor, nb8: int) -> torch.Tensor:
    """8-bit channels by max|x_c| * |W[:, c]|; within and after them, by max|x_c|."""
    top = torch.argsort(amax * w.norm(dim=0), descending=True, stable=True)[:nb8 * F.ACT_BLOCK]
    rest = torch.ones_like(amax, dtype=torch.bool)
    rest[top] = False
    rest = torch.nonzero(rest).flatten()
    by_max = lambda idx: idx[torch.argsort(amax[idx], descending=True, stable=True)]  # noqa: E731
    return torch.cat([by_max(top), by_max(rest)])


class ActQuant:
    """One decoder linear's activation variants, calibrated on that linear's own input."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, with_alpha: bool = True,
                 with_gains: bool = False, with_signs: bool = False):
        # as the model holds it (--weights puts it back after each variant); in bf16 when that
        # is exact (bf16 checkpoints), so that swapping in the RTN weights does not hold two
        # float32 copies of every linear (24 GB machines run out of memory)
        wb = w.to(torch.bfloat16)
        self._w, self._dtype = (wb if torch.equal(wb.to(w.dtype), w) else w), w.dtype
        x, wd = x.double(), w.double()
        amax = x.abs().amax(0)
        self.nb8 = num_a8_blocks(x.shape[1], 0.25)
        self.nb8_of = {}  # budget variants: set by ppl_main once every linear is calibrated
        self.perm = outlier_permutation(amax).long()
        self.sens = sensitive_permutation(amax, wd, self.nb8)
        self.keep = keep_order_permutation(amax, self.nb8)
        self.bperm = fmpq.block_outlier_permutation(amax).long()
        self.rot = F.hadamard().double()
        self.rot64 = F.act_rotation_matrix("hadamard64").double()  # each 64-channel half alone
        self.rrot = signed_hadamard(int(os.environ.get("DIAG_RROT_SEED", "0")))
        self.crot = self.rot
        self.alpha = 1.0
        if with_signs:  # +rrot-cal
            y = x @ wd.T

            def err(rot):
                xq = w4ax_fake(x, self.perm, self.nb8, rot)
                return float((xq @ rtn_weight(wd, self.perm, self.nb8, rot).T - y).norm() / y.norm())
            self.crot = min((signed_hadamard(s) for s in range(SIGN_CANDIDATES)), key=err)
        if with_gains:  # un-normalised, so that a group's linears add up (set_budget_blocks)
            self.y2 = float((x @ wd.T).pow(2).sum())
            self.gain = fmpq.block_gains(x, wd, self.perm, self.rot) * self.y2
            self.n_out = w.shape[0]
        if not with_alpha:
            return
        y = x @ wd.T
        err = lambda xq: float((xq @ wd.T - y).norm() / y.norm())  # noqa: E731
        self.alpha = min(ALPHAS, key=lambda al: err(w4ax_fake(x, self.sens, self.nb8, self.rot, al)))

    @property
    def w(self) -> torch.Tensor:
        return self._w.to(self._dtype)

    def basis(self, variant: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(channel permutation, rotation of the 4-bit blocks) of a W4Ax variant."""
        return {"W4Ax25": (self.perm, None), "g32": (self.perm, None), "+rot": (self.perm, self.rot),
                "all": (self.sens, self.rot), "budget": (self.perm, self.rot),
                "budget-global": (self.perm, self.rot), "+rrot": (self.perm, self.rrot),
                "+rrot-cal": (self.perm, self.crot), "+rrot-h16": (self.perm, self.rrot),
                "W4": (None, None), "W4-perm": (self.perm, None), "W4-perm-rot": (self.perm, self.rot),
                "+rot-h16-keep": (self.keep, self.rot), "+rot-h16-blocks": (self.bperm, self.rot),
                "W4-blocks-rot": (self.bperm, self.rot),
                "+rot64-h16-blocks": (self.bperm, self.rot64), "W4-blocks-rot64": (self.bperm, self.rot64),
                **{v: (self.perm, self.rot) for v in (*GROUP4, *FIXED_ALPHA, "+rot-h16") if v.startswith("+rot")}
                }[variant]

    def blocks(self, variant: str) -> int:
        return self.nb8_of.get(variant, self.nb8)

    def __call__(self, variant: str, x: torch.Tensor) -> torch.Tensor:
        xd = x.reshape(-1, x.shape[-1]).double()
        if variant in WEIGHT_ONLY:
            return x
        if variant == "A8":
            q = fake_sym(xd, F.A8_MAX)
        else:
            perm, rot = self.basis(variant)
            alpha = self.alpha if variant == "all" else FIXED_ALPHA.get(variant, 1.0)
            q = w4ax_fake(xd, perm, self.blocks(variant), rot, alpha, GROUP4.get(variant, F.ACT_BLOCK),
                          variant in HALF_GRID)
        return q.to(x.dtype).reshape(x.shape)

    def weight(self, variant: str) -> torch.Tensor:
        """The RTN W4 weight of `variant`'s basis (--weights)."""
        if variant in ("A8", "W4"):
            return rtn_weight(self.w)
        perm, rot = self.basis(variant)
        return rtn_weight(self.w, perm, self.blocks(variant), rot)


def decoder_linears(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


def set_budget_blocks(quant: dict[str, ActQuant], variants: list[str]) -> None:
    """The budget variants' nb8 per input group (the linears of a group share their input, so
    one nb8), from the gains every linear measured on the calibration tokens; printed."""
    groups = {}  # (layer index, group) -> its linears' ActQuant
    for name, q in quant.items():
        layer, lin = re.fullmatch(r".*\.layers\.(\d+)\.(.*)", name).groups()
        g = next(g for g, d in LINEAR_GROUPS.items() if lin in d["linears"])
        groups.setdefault((int(layer), g), []).append(q)
    gains = {k: sum(q.gain for q in qs) / sum(q.y2 for q in qs) for k, qs in groups.items()}
    cost = {k: float(sum(q.n_out for q in qs)) for k, qs in groups.items()}  # a block's MACs / 128
    uniform = {k: qs[0].nb8 for k, qs in groups.items()}
    layers = sorted({k[0] for k in groups})
    macs = lambda nb8: sum(nb8[k] * cost[k] for k in groups)  # noqa: E731
    for v in (v for v in BUDGET_VARIANTS if v in variants):
        if v == "budget":
            nb8 = {}
            for i in layers:
                ks = [k for k in groups if k[0] == i]
                nb8.update(fmpq.allocate_a8_blocks({k: gains[k] for k in ks}, cost,
                                                   sum(uniform[k] * cost[k] for k in ks)))
        else:
            nb8 = fmpq.allocate_a8_blocks(gains, cost, macs(uniform))
        for k, qs in groups.items():
            for q in qs:
                q.nb8_of[v] = nb8[k]
        print(f"{v}: 8-bit blocks per input group (uniform: "
              + ", ".join(f"{g} {uniform[(layers[0], g)]}" for g in LINEAR_GROUPS)
              + f"); 8-bit MACs {macs(nb8) / macs(uniform):.3f}x uniform's, 8-bit blocks "
              f"{sum(nb8.values()) / sum(uniform.values()):.3f}x")
        print(f"  {'layer':8}" + "".join(f"{i:>3}" for i in layers))
        for g in LINEAR_GROUPS:
            print(f"  {g:8}" + "".join(f"{nb8[(i, g)]:>3}" for i in layers))
        print(f"  {'total':8}" + "".join(f"{sum(nb8[(i, g)] for g in LINEAR_GROUPS):>3}" for i in layers),
              flush=True)


def ppl_main(a, model, folder: str, cal_ids: torch.Tensor) -> None:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from vllm_mixprec.eval.perplexity import perplexity_cpu, tokenize, windows

    variants = a.variants.split(",")
    lins, quant = decoder_linears(model), {}
    bar = tqdm(total=len(lins), desc="calibrating linears")

    def calibrate(m, inp, name):
        quant[name] = ActQuant(inp[0].reshape(-1, inp[0].shape[-1]), m.weight.detach(), "all" in variants,
                               any(v in BUDGET_VARIANTS for v in variants), "+rrot-cal" in variants)
        bar.update()

    hooks = [m.register_forward_pre_hook(lambda m, i, n=n: calibrate(m, i, n)) for n, m in lins.items()]
    with torch.no_grad():
        model(cal_ids)
    for h in hooks:
        h.remove()
    bar.close()
    if any(v in BUDGET_VARIANTS for v in variants):
        set_budget_blocks(quant, variants)
    ev = tokenize(AutoTokenizer.from_pretrained(folder), M.load_text(a.eval_text))
    print(f"eval: {a.eval_text}, {a.eval_tokens} tokens in {len(windows(ev, a.eval_tokens, 1024))} windows of 1024; "
          f"calibration: alice29, {cal_ids.shape[1]} tokens; weights "
          f"{'RTN LiquidQuant W4 g64 in each basis' if a.weights else 'in float32'}; 25% of blocks at 8 bits")
    base = perplexity_cpu(model, ev, a.eval_tokens, 1024)["ppl"]
    print(f"{'float (no quantization)':24} ppl {base:8.4f}", flush=True)
    for v in variants:
        hooks = [m.register_forward_pre_hook(lambda m, i, n=n, v=v: (quant[n](v, i[0]),))
                 for n, m in lins.items()]
        if a.weights:
            for n, m in tqdm(lins.items(), desc=f"{v}: weights"):
                m.weight.data = quant[n].weight(v)
        ppl = perplexity_cpu(model, ev, a.eval_tokens, 1024, progress=True)["ppl"]
        for h in hooks:
            h.remove()
        if a.weights:
            for n, m in lins.items():
                m.weight.data = quant[n].w
        print(f"{v:24} ppl {ppl:8.4f}  {100 * (ppl / base - 1):+6.2f} %", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=list(DEFAULT))
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--ppl", action="store_true", help="perplexity with every decoder linear's input quantized")
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--eval-text", default="lcet10", help="--ppl: the evaluation text (calibration is alice29)")
    p.add_argument("--variants", default="A8,W4Ax25,+rot,all")
    p.add_argument("--weights", action="store_true", help="--ppl: RTN W4 weights too (W4A8 / W4Ax)")
    a = p.parse_args()
    for v in a.variants.split(",") if a.ppl else ():  # before the model loads
        if v not in PPL_VARIANTS:
            raise SystemExit(f"--variants: unknown {v!r} (one of {', '.join(PPL_VARIANTS)})")
        if v in WEIGHT_ONLY and not a.weights:
            raise SystemExit(f"--variants: {v} rounds only the weights; it needs --weights")
    torch.set_num_threads(1)
    folder = M.cached_model(a.model) or M.fetch_model(a.model)
    model, _ = load_model_cpu(folder)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(folder)(M.load_text("alice29"), return_tensors="pt",
                                                add_special_tokens=False).input_ids[:, :a.tokens]
    if a.ppl:
        return ppl_main(a, model, folder, ids)
    mods, acts = dict(model.named_modules()), {}
    for n in a.names:
        mods[n].register_forward_hook(lambda m, i, o, n=n: acts.__setitem__(n, i[0].reshape(-1, i[0].shape[-1])))
    with torch.no_grad():
        model(ids)
    rot = F.hadamard().double()
    cols = ("A8", "W4Ax25", "+rot", "sens", "clip", "g32", "all")
    print(f"{'linear':40} " + " ".join(f"{c:>7}" for c in cols))
    for n in a.names:
        x, w = acts[n].double(), mods[n].weight.detach().double()
        half = x.shape[0] // 2
        cal, ev = x[:half], x[half:]
        amax = cal.abs().amax(0)
        perm = outlier_permutation(amax).long()
        nb8 = num_a8_blocks(x.shape[1], 0.25)
        sens = sensitive_permutation(amax, w, nb8)

        def rel(xq, xr=ev):
            y = xr @ w.T
            return float((xq @ w.T - y).norm() / y.norm())

        def alpha(pm, r=None):  # the clip ratio that is best on the calibration half
            return min(ALPHAS, key=lambda al: rel(w4ax_fake(cal, pm, nb8, r, al), cal))

        errs = (rel(fake_sym(ev, F.A8_MAX)), rel(w4ax_fake(ev, perm, nb8)),
                rel(w4ax_fake(ev, perm, nb8, rot)), rel(w4ax_fake(ev, sens, nb8)),
                rel(w4ax_fake(ev, perm, nb8, None, alpha(perm))),
                rel(w4ax_fake(ev, perm, nb8, group4=32)),
                rel(w4ax_fake(ev, sens, nb8, rot, alpha(sens, rot))))
        print(f"{n:40} " + " ".join(f"{e:7.4f}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
