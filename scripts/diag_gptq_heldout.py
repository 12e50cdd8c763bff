"""Does GPTQ on the LiquidQuant grid generalise past its calibration tokens? (CPU; issue #3)

Sessions 21-26 ran every Qwen2.5-Coder-1.5B GPTQ export with `--calib-samples 8 --calib-seqlen
512`: 4,096 calibration tokens, fewer than down_proj's K = 8,960, so its Hessian X^T X has rank
<= 4,096 and GPTQ may push rounding error into directions the calibration never saw. End to end
GPTQ W4A16 g128 gave +21.3 % on lcet10 and GPTQ made W4Ax worse (+9.94 % -> +14.20 %).

This takes a few decoder linears of the float model, their inputs on N calibration tokens of
alice29 (the quantizer's calibration text) and on held-out lcet10 tokens (its evaluation text),
and reports the relative output error ||X (W - W_hat)^T|| / ||X W^T|| of RTN and of GPTQ fitted on
each calibration size, on the calibration tokens and on the held-out ones:

  python scripts/diag_gptq_heldout.py [--layer 3] [--calib 4096 16384] [--percdamp 0.01 0.1]
      [--skip-first]

--skip-first leaves each 512-token sequence's first token out of the Hessian (its hidden state
carries Qwen's massive activations) and reports the held-out error without those tokens too.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from vllm_mixprec.quantize import gptq, lqq
from vllm_mixprec.quantize import models as M
from vllm_mixprec.quantize.calibration import calibration_batches

LINEARS = {"qkv_in (q_proj)": "self_attn.q_proj", "o_proj": "self_attn.o_proj",
           "gate_proj": "mlp.gate_proj", "down_proj": "mlp.down_proj"}


@torch.no_grad()
def linear_inputs(model, layer: int, batches: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: X [tokens, K] float32} of layer `layer`'s linears on every batch row."""
    got: dict[str, list[torch.Tensor]] = {n: [] for n in LINEARS}
    blocks = model.model.layers[layer]
    hooks = [blocks.get_submodule(path).register_forward_pre_hook(
        lambda mod, args, n=name: got[n].append(args[0].reshape(-1, args[0].shape[-1]).float()))
        for name, path in LINEARS.items()]
    keep = model.model.layers
    model.model.layers = keep[:layer + 1]  # nothing after the layer is needed
    try:
        for row in batches:
            model.model(input_ids=row[None])
    finally:
        model.model.layers = keep
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in got.items()}


def quantize(w: torch.Tensor, h: torch.Tensor | None, a, damp: float = 0.01) -> torch.Tensor:
    """W_hat on a.grid: RTN when h is None, else GPTQ with Hessian h."""
    if a.grid == "lqq":
        t = lqq.quantize_lqq_clipped(w, a.group_size) if h is None else gptq.gptq_lqq(w, h, a.group_size, damp)
        return lqq.dequantize(t)
    if h is None:  # GPTQ's grid without error feedback: identity Hessian
        h = torch.eye(w.shape[1], dtype=torch.float64)
    return gptq.dequantize_gptq(gptq.gptq_w4a16(w, h, a.group_size, damp)).double()


def rel_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    x = x.double()
    return float((x @ (w - w_hat).T).norm() / (x @ w.T).norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--calib", type=int, nargs="+", default=[4096, 16384], help="calibration token counts")
    p.add_argument("--heldout", type=int, default=2048)
    p.add_argument("--percdamp", type=float, nargs="+", default=[0.01])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--linears", default=",".join(LINEARS))
    p.add_argument("--grid", choices=("lqq", "w4a16"), default="lqq",
                   help="lqq: the W4A8 LiquidQuant grid (group --group-size); w4a16: the GPTQ W4A16 "
                        "symmetric int4 grid the Marlin baseline uses (group 128 unless --group-size)")
    p.add_argument("--skip-first", action="store_true",
                   help="leave each sequence's first token out of the Hessian; held-out error also without them")
    p.add_argument("--out", default=None, help="JSON file for the table")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = M.fetch_model(a.model)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    seqlen = 512
    cal = calibration_batches(tok, M.load_text("alice29"), max(a.calib) // seqlen, seqlen)
    held = calibration_batches(tok, M.load_text("lcet10"), a.heldout // seqlen, seqlen)
    t0 = time.monotonic()
    x_cal, x_held = linear_inputs(model, a.layer, cal), linear_inputs(model, a.layer, held)
    print(f"inputs of layer {a.layer}: {x_cal['down_proj'].shape[0]} calibration + "
          f"{x_held['down_proj'].shape[0]} held-out tokens in {time.monotonic() - t0:.0f} s", flush=True)
    rows = []
    for name in a.linears.split(","):
        w = model.model.layers[a.layer].get_submodule(LINEARS[name]).weight.detach().double()
        rtn = quantize(w, None, a)
        n_cal = min(a.calib)
        later = torch.arange(x_held[name].shape[0]) % seqlen != 0
        row = {"linear": name, "K": w.shape[1], "rtn_calib": rel_err(x_cal[name][:n_cal], w, rtn),
               "rtn_heldout": rel_err(x_held[name], w, rtn)}
        if a.skip_first:
            row["rtn_heldout_later"] = rel_err(x_held[name][later], w, rtn)
        for n in a.calib:
            x = x_cal[name][:n].double()
            if a.skip_first:
                x = x[torch.arange(n) % seqlen != 0]
            h = x.T @ x
            for damp in a.percdamp:
                t1 = time.monotonic()
                w_hat = quantize(w, h, a, damp)
                key = f"gptq{n}_d{damp:g}"
                row[key + "_calib"] = rel_err(x, w, w_hat)
                row[key + "_heldout"] = rel_err(x_held[name], w, w_hat)
                if a.skip_first:
                    row[key + "_heldout_later"] = rel_err(x_held[name][later], w, w_hat)
                row[key + "_s"] = round(time.monotonic() - t1, 1)
        rows.append(row)
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
