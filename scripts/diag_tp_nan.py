"""Where TP=2 turns the random Qwen2 shape's logits into NaN (GPU host, 2 GPUs; diagnostic).

Session 26 (H200 x2): tp_check.py's `qwen2-none` (RTN W4A8 g64, bf16 KV, compiled with CUDA
graphs) gave NaN logprobs at TP=2 from the first token on, for every prompt, while TP=1 was
finite; neither MIXPREC_TP_ACT_SCALE, PDL nor the Triton GEMM changed that (docs/RELIABILITY.md).
This serves one vLLM per variant and reports its NaN prompts; in the eager variants every module
of every rank carries a forward hook (installed through LLM.collective_rpc, so it runs inside the
TP workers) that records the first calls whose output holds a NaN or an Inf, with their input's
state and bad rows, and each module's largest |output| in the first prefill, so that the layer
and the op that make the NaN are named, and TP=1's magnitudes can be set beside TP=2's:

  python3 scripts/diag_tp_nan.py --out $OUT [--variants ours-tp2-eager,bf16-tp2,...]

Checkpoints come from tp_check.build (the same recipe, in --work).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# name -> (tp_check model, TP, mode): eager (hooks), nograph (compiled, no CUDA graphs), compiled
VARIANTS = {
    "ours-tp2-eager": ("qwen2-none", 2, "eager"),
    "ours-tp1-eager": ("qwen2-none", 1, "eager"),
    "bf16-tp2": ("qwen2-bf16", 2, "compiled"),
    "bf16-tp2-eager": ("qwen2-bf16", 2, "eager"),
    "ours-tp2-nograph": ("qwen2-none", 2, "nograph"),
    "ours-tp2": ("qwen2-none", 2, "compiled"),
    "llama-tp2": ("llama-none", 2, "compiled"),
}
MAX_BAD = 40  # non-finite module calls kept per rank
GEN_TOKENS = 4


def tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError):  # no TP group (a CPU try of the hooks)
        return 0


def finite_absmax(t) -> float:
    """Largest |value| of t over its finite entries (0 when none is)."""
    import torch

    f = t.detach().float().abs()
    return float(torch.where(torch.isfinite(f), f, torch.zeros_like(f)).max())


def install_hooks(model):
    """Forward hooks on every module (runs in each worker)."""
    import torch

    state = {"rank": tp_rank(), "step": 0, "bad": [], "first_prefill": []}

    def floats(xs):
        return [x for x in xs if torch.is_tensor(x) and x.is_floating_point() and x.numel()]

    def describe(t):
        bad = ~torch.isfinite(t)
        rows = (bad.reshape(t.shape[0], -1).any(-1) if t.dim() > 1 else bad).nonzero().flatten()
        return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                "nonfinite": int(bad.sum()), "bad_rows": rows[:8].tolist(), "n_bad_rows": int(rows.numel()),
                "absmax": finite_absmax(t)}

    def pre(mod, args, kwargs):
        state["step"] += 1

    def make(name):
        def hook(mod, args, kwargs, out):
            outs = floats(out if isinstance(out, (tuple, list)) else (out,))
            if not outs:
                return
            ins = floats(list(args) + list(kwargs.values()))
            out_ok = all(bool(torch.isfinite(o).all()) for o in outs)
            if state["step"] == 1:
                state["first_prefill"].append({
                    "module": name, "out_absmax": max(finite_absmax(o) for o in outs),
                    "in_absmax": max((finite_absmax(i) for i in ins), default=None)})
            if not out_ok and len(state["bad"]) < MAX_BAD:
                state["bad"].append({"step": state["step"], "module": name, "type": type(mod).__name__,
                                     "inputs": [describe(i) for i in ins[:3]],
                                     "outputs": [describe(o) for o in outs[:2]]})
        return hook

    model.register_forward_pre_hook(pre, with_kwargs=True)
    for name, mod in model.named_modules():
        mod.register_forward_hook(make(name or "<model>"), with_kwargs=True)
    model._mixprec_diag = state
    return state["rank"]


def scan_params(model):
    """Every floating parameter and buffer of this rank: shape, largest |value|, and the count
    of NaN/Inf (a shard left unloaded in torch.empty memory shows here)."""
    import torch

    rows = [{"name": name, "shape": list(t.shape), "nonfinite": int((~torch.isfinite(t)).sum()),
             "absmax": finite_absmax(t)}
            for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.is_floating_point() and t.numel()]
    return {"rank": tp_rank(), "params": rows}


def collect(model):
    return model._mixprec_diag


def on_model(fn):
    """fn(model) on every worker through collective_rpc with a callable, which vLLM cloudpickles
    by value at each hop (LLM.apply_model passes fn as an argument, which the engine process
    re-pickles by reference to __main__ and fails at TP > 1: 2026-11-28)."""
    def rpc(worker):
        return fn(worker.model_runner.get_model())
    return rpc


def try_rpc(llm, fn, errors: list):
    """The RPC's per-worker results, or None with the error recorded: the generation after it
    still runs, so the NaN verdict is kept either way."""
    try:
        return llm.collective_rpc(on_model(fn))
    except Exception as e:  # noqa: BLE001
        errors.append(f"{fn.__name__}: {type(e).__name__}: {str(e)[:300]}")
        return None


def child(ckpt: str, tp: int, mode: str, quantized: bool, out_file: str) -> None:
    from vllm import LLM, SamplingParams

    from tp_check import PROMPTS

    kwargs = dict(model=ckpt, tensor_parallel_size=tp, max_model_len=1040, gpu_memory_utilization=0.5,
                  disable_custom_all_reduce=True, seed=0)
    if mode == "eager":
        kwargs["enforce_eager"] = True
    elif mode == "nograph":
        kwargs["compilation_config"] = {"cudagraph_mode": "NONE"}
    if quantized:
        kwargs["quantization"] = "mixprec"
    llm = LLM(**kwargs)
    errors: list[str] = []
    scans = try_rpc(llm, scan_params, errors) or []
    if mode == "eager":
        try_rpc(llm, install_hooks, errors)
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, logprobs=1, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    nan_prompts = [i for i, o in enumerate(outs)
                   if any(not all(abs(lp.logprob) < float("inf") for lp in step.values())
                          for step in o.outputs[0].logprobs)]
    res = {"nan_prompts": nan_prompts, "tokens": [list(o.outputs[0].token_ids) for o in outs],
           "param_scans": scans, "errors": errors}
    if mode == "eager":
        res["ranks"] = try_rpc(llm, collect, errors) or []
    with open(out_file, "w") as f:
        json.dump(res, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--work", default="/tmp/mixprec-tp")
    ap.add_argument("--variants", default="ours-tp2-eager,bf16-tp2,ours-tp2,ours-tp2-nograph")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        ckpt, tp, mode, quantized, out_file = args.child
        child(ckpt, int(tp), mode, quantized == "1", out_file)
        return 0
    names = args.variants.split(",")
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"unknown --variants {bad}: use {', '.join(VARIANTS)}")
    from tp_check import NO_MULTICAST, build

    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    ckpts = build(args.work, sorted({VARIANTS[n][0] for n in names}))
    env = {**os.environ, **NO_MULTICAST, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    summary = {}
    for name in names:
        model, tp, mode = VARIANTS[name]
        res_file = os.path.join(args.out, f"diag-{name}.json")
        if os.path.exists(res_file):
            os.remove(res_file)
        t0 = time.monotonic()
        with open(os.path.join(args.out, f"diag-{name}.log"), "w") as f:
            rc = subprocess.run([sys.executable, __file__, "--child", ckpts[model], str(tp), mode,
                                 "0" if model.endswith("-bf16") else "1", res_file],
                                env=env, stdout=f, stderr=subprocess.STDOUT, timeout=300).returncode
        entry = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1)}
        if os.path.exists(res_file):
            with open(res_file) as f:
                res = json.load(f)
            entry["nan_prompts"] = res["nan_prompts"]
            entry["errors"] = res.get("errors")
            entry["nonfinite_params"] = [f"rank{sc['rank']}:{p['name']}:{p['nonfinite']}"
                                         for sc in res["param_scans"] for p in sc["params"] if p["nonfinite"]]
            for r in res.get("ranks", []):
                first = r["bad"][0] if r["bad"] else None
                keep = ("step", "module", "type")
                entry[f"rank{r['rank']}_first_bad"] = first and {k: first[k] for k in keep}
        summary[name] = entry
        print(name, json.dumps(entry), flush=True)
    with open(os.path.join(args.out, "diag-tp-nan.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
