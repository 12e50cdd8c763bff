"""Why W4A8 parts from TP=1 at TP=2 more often than bf16 does (issue #7), on the CPU.

At TP=2 a row-parallel layer (o_proj, down_proj) sums two half-K partial outputs, each rounded to
bf16 by its rank's GEMM, in a bf16 all-reduce; TP=1 rounds the whole sum once. This script puts
only that difference into the float32 CPU model (eval/perplexity.py's `load_model_cpu`) of a bf16
folder and of its RTN W4A8 export (the checkpoint tp_check serves), and measures how far it moves
the next-token logprobs of a text, teacher-forced:
  tp1          every row-parallel output rounded to bf16 once (the reference);
  tp2          the two halves rounded to bf16, then their sum rounded (W4A8: the activation codes
               and scales of the whole row, MIXPREC_TP_ACT_SCALE=global);
  tp2-rank     W4A8 only: each half quantized with its own per-token scale (the default `rank`);
  tp2-fp32     W4A8 only: as tp2, but the halves stay float32 and their sum is rounded once:
               a float32 all-reduce. It moves the logprobs almost as much as tp2 (session 29):
               any rounding difference is amplified, which is why MIXPREC_TP_REDUCE=exact
               all-reduces the integer dot products instead;
  tp2-bad-shard  W4A8 only, a control: as tp2, but rank 1 reads its weight codes with rank 0's
               group scales and offsets (a wrong shard of the scales), to show what a sharding
               bug does to the perplexity that tp_check judges real models by.
Nothing else differs, so a W4A8 difference much larger than bf16's is dynamic activation
quantization amplifying the all-reduce's rounding (an int8 code flips when its input moves by
one bf16 step near a rounding boundary), not a sharding bug.

  python scripts/diag_tp_rounding.py --out benchmarks/results/cpu-reference/session28-tp-rounding
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_mixprec import reference as ref  # noqa: E402
from vllm_mixprec.quantize.modules import MixPrecLinear  # noqa: E402

ROW_PARALLEL = ("o_proj", "down_proj")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _halves(k: int) -> tuple[slice, slice]:
    return slice(0, k // 2), slice(k // 2, k)


def w4a8_partials(mod: MixPrecLinear, x: torch.Tensor, per_rank_scale: bool,
                  bad_shard: bool = False) -> list[torch.Tensor]:
    """Each rank's float64 partial output of a W4A8 row-parallel linear: reference.w4a8_gemm on
    its half of K and of the groups (bias on rank 0). bad_shard: rank 1 reads its codes with
    rank 0's group scales and offsets."""
    smooth = getattr(mod, "input_smooth", None)
    if not per_rank_scale:
        xq, xs = ref.quantize_act(x, smooth)
    if mod.group_scale.shape[1] % 2:
        raise ValueError(f"{mod.group_scale.shape[1]} groups do not split into two ranks' halves")
    groups = _halves(mod.group_scale.shape[1])
    outs = []
    for r, h in enumerate(_halves(x.shape[-1])):
        if per_rank_scale:
            xq_r, xs_r = ref.quantize_act(x[:, h], None if smooth is None else smooth[h])
        else:
            xq_r, xs_r = xq[:, h], xs
        g = groups[0 if bad_shard else r]
        outs.append(ref.w4a8_gemm(xq_r, xs_r, mod.qweight[:, h.start // 2:h.stop // 2], mod.group_scale[:, g],
                                  mod.group_offset[:, g], mod.channel_scale, mod.bias if r == 0 else None,
                                  torch.float64))
    return outs


def dense_partials(mod: nn.Linear, x: torch.Tensor) -> list[torch.Tensor]:
    outs = []
    for r, h in enumerate(_halves(x.shape[-1])):
        y = x[:, h].double() @ mod.weight[:, h].double().T
        if r == 0 and mod.bias is not None:
            y = y + mod.bias.double()
        outs.append(y)
    return outs


class RowParallelEmulation(nn.Module):
    """A row-parallel linear whose output is rounded as TP=1 (`tp1`) or TP=2 (`tp2`, `tp2-rank`,
    `tp2-fp32`, `tp2-bad-shard`) would round it; the mode is set on the instance between forwards."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.mode = inner, "tp1"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.mode == "tp1":
            y = _bf16(self.inner(x2).float())
        else:
            if isinstance(self.inner, MixPrecLinear):
                parts = w4a8_partials(self.inner, x2, per_rank_scale=self.mode == "tp2-rank",
                                      bad_shard=self.mode == "tp2-bad-shard")
            else:
                parts = dense_partials(self.inner, x2)
            if self.mode == "tp2-fp32":
                y = _bf16(sum(p.float() for p in parts))
            else:
                y = _bf16(sum(_bf16(p.float()) for p in parts))
        return y.reshape(*shape[:-1], y.shape[-1])


def wrap(model: nn.Module) -> list[RowParallelEmulation]:
    wrapped = []
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            w = RowParallelEmulation(getattr(parent, name))
            setattr(parent, name, w)
            wrapped.append(w)
    return wrapped


@torch.no_grad()
def logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(model(ids[None]).logits[0].double(), -1)


def compare(ref_lp: torch.Tensor, lp: torch.Tensor, ids: torch.Tensor) -> dict:
    """Teacher-forced differences over the positions of one window."""
    tgt = ids[1:]
    base, cur = ref_lp[:-1], lp[:-1]
    d_tgt = (cur.gather(1, tgt[:, None]) - base.gather(1, tgt[:, None])).squeeze(1)
    abs_d = d_tgt.abs()
    top5 = base.topk(5, -1)
    d_top5 = (cur.gather(1, top5.indices) - top5.values).abs().amax(1)
    a, b = base.argmax(-1), cur.argmax(-1)
    gap = top5.values[:, 0] - top5.values[:, 1]
    return {"positions": int(tgt.numel()), "ppl_ratio": math.exp(-float(d_tgt.mean())),
            "target_dlogprob_mean": float(abs_d.mean()), "target_dlogprob_p99": float(abs_d.quantile(0.99)),
            "target_dlogprob_max": float(abs_d.max()), "top5_dlogprob_max": float(d_top5.max()),
            "argmax_flips": int((a != b).sum()),
            "flip_gaps": [round(float(g), 4) for g in gap[a != b]]}


def main() -> int:
    from vllm_mixprec.eval.perplexity import load_model_cpu, tokenize
    from vllm_mixprec.quantize import models as M

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="a known model name or a bf16 folder")
    ap.add_argument("--w4a8", default="/tmp/mixprec-tp-rounding/real-w4a8-none",
                    help="its RTN W4A8 g64 export (made here if missing, as tp_check makes it)")
    ap.add_argument("--text", default="lcet10")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--runs", default="all",
                    help="comma-separated 'kind mode' names to run (e.g. 'w4a8 tp2-fp32'), or all")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    src = Path(args.model) if Path(args.model).is_dir() else M.fetch_model(args.model)
    if not (Path(args.w4a8) / "config.json").is_file():
        from vllm_mixprec.quantize.rtn import export_rtn_folder
        t0 = time.monotonic()
        export_rtn_folder(src, args.w4a8, "none")
        print(f"exported {src} -> {args.w4a8} in {time.monotonic() - t0:.0f} s", flush=True)
    from transformers import AutoTokenizer
    ids = tokenize(AutoTokenizer.from_pretrained(src), M.fetch_text(args.text).read_text())[: args.tokens]
    os.makedirs(args.out, exist_ok=True)
    result = {"model": str(src), "text": args.text, "tokens": int(ids.numel()), "runs": {}}
    for kind, folder, modes in (("bf16", src, ("tp2",)), ("w4a8", args.w4a8, ("tp2", "tp2-rank", "tp2-fp32", "tp2-bad-shard"))):
        wanted = [m for m in modes if args.runs == "all" or f"{kind} {m}" in args.runs.split(",")]
        if not wanted:
            continue
        t0 = time.monotonic()
        model, _ = load_model_cpu(folder)
        emus = wrap(model)
        base = logprobs(model, ids)
        for mode in wanted:
            for e in emus:
                e.mode = mode
            result["runs"][f"{kind} {mode}"] = r = compare(base, logprobs(model, ids), ids)
            print(f"{kind:5} {mode:9} " + json.dumps({k: v for k, v in r.items() if k != "flip_gaps"}), flush=True)
        print(f"{kind}: {time.monotonic() - t0:.0f} s", flush=True)
        del model, emus
    with open(os.path.join(args.out, "tp_rounding.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
