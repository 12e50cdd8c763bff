"""Tensor parallelism on the GPU host (issue #7): the same mixprec checkpoint served by vLLM at
TP=1 and TP=2 (NCCL, one process per GPU) must give the same greedy tokens.

Run on nvidia-h200-x2 after the bundle and `gpu_check.sh env build`:
  python3 scripts/tp_check.py --out $OUT          # or: bash scripts/gpu_check.sh tp

Checkpoints (random weights, built here; RTN W4A8 g64 like scripts/e2e_serve.py):
  llama: hidden 1024, 4 layers, GQA 16/4 (the e2e shape);
  qwen2: hidden 1536, 4 layers, GQA 12/2, q/k/v biases, untied lm_head (Qwen2.5-1.5B's widths,
         so 2 KV heads split 1 per rank and down_proj's K = 8960 splits into 4480 = 70 groups);
each with a bf16 KV cache (`-none`) and with KV4 through the CUSTOM backend (`-kv4`); `-bf16` is
the control: the same bf16 model served unquantized at TP=1 and TP=2.
With --real DIR (a real bf16 Hugging Face folder: Qwen2.5-Coder-1.5B, assembled on the host by
scripts/gpu_models.sh), `real-none`, `real-kv4` and `real-bf16` are the same three for that model:
its RTN W4A8 g64 export (made here, in the same way) and the bf16 folder itself. On a real model
W4A8's greedy tokens part from TP=1 at bf16 ties (session 21: 1 of 8 identical), so
--ppl-text FILE also scores the perplexity of FILE at both TPs and judges by that (TP_PPL_RTOL)
and by finite logprobs, reporting greedy agreement. A child that wrote its results and then died
(exit status != 0) still has them compared, but fails the model (judge).
Random weights give flat logits, where a different all-reduce order may flip a near-tie: the
unquantized Qwen2 shape itself gave 4 of 8 identical completions at TP=2 (H100, 2026-11-25). And
W4A8 at TP=2 quantizes each rank's half of a row-parallel layer's input with its own per-token
scale, which TP=1 does not (unless MIXPREC_TP_ACT_SCALE=global, which the children inherit).
So a model passes when every prompt is identical, or diverges only at a near-tie (TP=1's logprob
gap between the two picks <= NEAR_TIE) with the logprobs of the shared prefix within
MAX_DLOGPROB of each other; a sharding bug puts the two runs' logprobs far
apart from step 0. The real models cannot reach the host (64 MiB per call) and SmolLM2's 9 heads
do not split in 2, so --real takes Qwen2.5-Coder-1.5B (12/2 heads), whose 22 parts travel
one call each (docs/GPU_HOST.md); docs/RELIABILITY.md has the results.

NVLink multicast stays off (device KINDS.md): NCCL_NVLS_ENABLE=0 and friends are forced in the
children's environment, and vLLM's custom all-reduce is disabled. The parent never touches CUDA.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
PROMPTS = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "class Stack:",
           "Once upon a time", "for i in range(10):", "SELECT * FROM", "# Sort a list in place"]
MAX_TOKENS = 32
TOPK = 5
NEAR_TIE = 0.25  # logprob gap at a divergence below which it counts as a tie flip
MAX_DLOGPROB = 0.25  # largest |logprob difference| of a token in both runs' top-5 on the shared prefix
TP_PPL_RTOL = 0.01  # --ppl-text: |ppl(TP=2) / ppl(TP=1) - 1| allowed; a wrong shard multiplies it
MODELS = tuple(f"{m}-{k}" for m in ("llama", "qwen2", "real") for k in ("none", "kv4", "bf16"))


def export_real(src: str, work: str, kvs: list[str]) -> dict[str, str]:
    """The real bf16 folder's RTN W4A8 export, once, and a folder per KV scheme that differs
    only in config.json (the weights linked)."""
    from pathlib import Path

    from vllm_mixprec.eval.realcheck import kv_scheme_copy
    from vllm_mixprec.quantize.rtn import export_rtn_folder

    base = os.path.join(work, "real-w4a8-none")
    if not os.path.exists(os.path.join(base, "config.json")):
        t0 = time.monotonic()
        export_rtn_folder(src, base, "none")
        print(f"exported {src} -> {base} in {time.monotonic() - t0:.0f} s", flush=True)
    return {f"real-{kv}": base if kv == "none" else
            str(kv_scheme_copy(Path(base), Path(work) / f"real-w4a8-{kv}", kv)) for kv in kvs}


def build(work: str, names: list[str], real: str | None = None) -> dict[str, str]:
    """name ("llama-none", "qwen2-kv4", "real-none", ...) -> checkpoint folder, built unless
    already there."""
    import shutil

    import torch
    from e2e_serve import E2E_SHAPE, export_mixprec, make_bf16_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    llama_src, qwen_src = os.path.join(work, "llama-bf16"), os.path.join(work, "qwen2-bf16")
    out = {n: (os.path.join(work, n) if n.endswith("-bf16") else
               os.path.join(work, f"{n.split('-')[0]}-w4a8-{n.split('-')[1]}")) for n in names}
    reals = [n for n in names if n.startswith("real-")]
    if reals:
        out["real-bf16"] = real
        out.update(export_real(real, work, [n.split("-")[1] for n in reals if n != "real-bf16"]))
        out = {n: out[n] for n in names}
    todo = [n for n in names if not os.path.exists(os.path.join(out[n], "config.json"))]
    models = {}
    if any(n.startswith("llama") for n in todo):
        models["llama"] = (make_bf16_model(llama_src, E2E_SHAPE), llama_src)
    if any(n.startswith("qwen2") for n in todo):
        if not os.path.exists(os.path.join(llama_src, "tokenizer.json")):
            make_bf16_model(llama_src, E2E_SHAPE)  # for its tokenizer
        os.makedirs(qwen_src, exist_ok=True)
        for f in os.listdir(llama_src):
            if f.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(llama_src, f), qwen_src)
        torch.manual_seed(1)
        cfg = Qwen2Config(vocab_size=8192, hidden_size=1536, intermediate_size=8960, num_hidden_layers=4,
                          num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
        qwen = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        with torch.no_grad():  # Qwen2's q/k/v biases are real and large; HF initialises them to 0
            for layer in qwen.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        qwen.save_pretrained(qwen_src)
        models["qwen2"] = (qwen, qwen_src)
    for n in todo:
        if n.endswith("-bf16"):
            continue  # the control serves the bf16 folder itself
        model, src = models[n.split("-")[0]]
        export_mixprec(model, src, out[n], n.split("-")[1])
    return out


def child(ckpt: str, tp: int, kv: str, out_file: str, ppl_text: str | None = None) -> None:
    from vllm import LLM, SamplingParams

    kwargs = dict(model=ckpt, tensor_parallel_size=tp, max_model_len=1024 + 16,  # a ppl window + 1 token
                  gpu_memory_utilization=0.5, disable_custom_all_reduce=True, seed=0)
    if os.environ.get("TP_CHECK_EAGER") == "1":  # split torch.compile / CUDA graphs from the kernels
        kwargs["enforce_eager"] = True
    if kv != "bf16":
        kwargs["quantization"] = "mixprec"
    if kv == "kv4":
        kwargs.update(kv_cache_dtype="int4_per_token_head", attention_backend="CUSTOM")
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOPK, ignore_eos=True)
    res = []
    for o in llm.generate(PROMPTS, params):
        c = o.outputs[0]
        res.append({"tokens": list(c.token_ids),
                    "top": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs]})
    with open(out_file, "w") as f:
        json.dump(res, f)
    if ppl_text:  # the windows and metric of real_model_check (eval/realcheck.py)
        from vllm.inputs import TokensPrompt

        from vllm_mixprec.eval.realcheck import token_windows
        ws = token_windows(ckpt, ppl_text)
        outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in ws],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
        # each window's target-token logprobs, kept so that two runs can be compared position by
        # position (session 30: eager TP=2 decoded TP=1's tokens bit for bit, yet its windows differed)
        positions = [[lp[t].logprob for t, lp in zip(w[1:], o.prompt_logprobs[1:])] for w, o in zip(ws, outs)]
        nll = -sum(sum(p) for p in positions)
        count = sum(len(w) - 1 for w in ws)
        with open(out_file + ".ppl.json", "w") as f:
            json.dump({"nll": nll, "tokens": count, "ppl": math.exp(nll / count), "positions": positions}, f)
    # A graceful engine shutdown (bounded) before interpreter exit, whose finalizer otherwise
    # stops the engine in abort mode: sessions 22 and 29 saw one TP=1 child in several abort in
    # that teardown ("terminate called without an active exception") after writing its results.
    # It does not avoid that: session 30 saw two more aborts after it, later, in interpreter
    # finalization. An abort still fails the run (judge: exit_ok).
    t0 = time.monotonic()
    llm.llm_engine.engine_core.shutdown(timeout=60)
    print(f"tp_check child: engine shut down in {time.monotonic() - t0:.1f} s", flush=True)


def ppl_verdict(p1: dict, p2: dict) -> dict:
    """Perplexity of the same windows at TP=1 and TP=2: a real model's criterion. W4A8 at TP=2
    quantizes each rank's half of a row-parallel input with its own scale, so greedy tokens part
    at bf16 ties (session 21), while a wrong shard of codes, scales or biases wrecks the ppl."""
    rel = p2["ppl"] / p1["ppl"] - 1
    out = {"ppl_tp1": round(p1["ppl"], 4), "ppl_tp2": round(p2["ppl"], 4), "ppl_rel": round(rel, 5),
           "ppl_pass": math.isfinite(rel) and abs(rel) <= TP_PPL_RTOL}
    if "positions" in p1 and "positions" in p2:  # where the windows part (reported, not judged)
        pairs = [list(zip(a, b)) for a, b in zip(p1["positions"], p2["positions"])]
        out["ppl_positions_equal"] = sum(x == y for w in pairs for x, y in w)
        out["ppl_positions"] = sum(len(w) for w in pairs)
        out["ppl_first_unequal"] = [next((i for i, (x, y) in enumerate(w) if x != y), None) for w in pairs]
    return out


def compare(a: list[dict], b: list[dict]) -> dict:
    """Per prompt: the first step where TP=1 and TP=2 pick different tokens, TP=1's logprob gap
    between the two picks there, and the largest difference of a top-5 logprob both runs list
    on the steps before it; `pass` by the rule of the module docstring."""
    rows = []
    for pa, pb in zip(a, b):
        # a NaN/Inf logprob fails the prompt: NaN compares False against every bound, and a run
        # of NaN logits greedily picks the same token at both TPs (session 21: real Qwen + KV4)
        bad = sum(not all(math.isfinite(x) for x in top.values()) for run in (pa, pb) for top in run["top"])
        step = next((i for i, (x, y) in enumerate(zip(pa["tokens"], pb["tokens"])) if x != y), None)
        shared = len(pa["tokens"]) if step is None else step + 1  # the diverging step's logprobs too
        dlp = max((abs(ta[t] - tb[t]) for ta, tb in zip(pa["top"][:shared], pb["top"][:shared])
                   for t in set(ta) & set(tb)), default=0.0)
        row = {"identical": step is None, "first_diff": step, "max_dlogprob": round(dlp, 4),
               "nonfinite_steps": bad}
        if step is not None:  # TP=1's logprobs of its own pick and of TP=2's pick at that step
            top = pa["top"][step]
            mine, theirs = top.get(str(pa["tokens"][step])), top.get(str(pb["tokens"][step]))
            row["gap"] = None if mine is None or theirs is None else mine - theirs
        tie = step is None or (row["gap"] is not None and row["gap"] <= NEAR_TIE)
        row["pass"] = tie and dlp <= MAX_DLOGPROB and bad == 0
        rows.append(row)
    return {"identical": sum(r["identical"] for r in rows), "prompts": len(rows),
            "nonfinite_prompts": sum(r["nonfinite_steps"] > 0 for r in rows),
            "pass": all(r["pass"] for r in rows), "max_dlogprob": max(r["max_dlogprob"] for r in rows),
            "per_prompt": rows}


def _load_json(path: str):
    """The JSON at path, or None if the child did not write it (whole)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def judge(runs: dict, ppls: dict | None) -> dict:
    """One model's entry from its two children: runs {tp: {"rc", "wall_s"[, "result"]}} and, with
    --ppl-text, ppls {tp: ppl dict or None}. Results a child wrote before dying are still compared
    and reported, but the model fails (exit_ok): session 22's TP=1 child aborted in its teardown
    ("terminate called without an active exception") after writing them."""
    entry = {f"tp{tp}": {k: v for k, v in r.items() if k != "result"} for tp, r in runs.items()}
    if not all("result" in r for r in runs.values()) or (ppls is not None and None in ppls.values()):
        entry["pass"] = False
        return entry
    entry.update(compare(runs[1]["result"], runs[2]["result"]))
    if ppls is not None:
        pv = ppl_verdict(ppls[1], ppls[2])
        entry.update(pv, greedy_pass=entry["pass"], **{"pass": pv["ppl_pass"] and entry["nonfinite_prompts"] == 0})
    entry["exit_ok"] = all(r["rc"] == 0 for r in runs.values())
    entry["pass"] = entry["pass"] and entry["exit_ok"]
    return entry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--work", default="/tmp/mixprec-tp")
    ap.add_argument("--models", default="llama-none,qwen2-none,llama-kv4,qwen2-kv4",
                    help="comma-separated {llama,qwen2,real}-{none,kv4,bf16} (-bf16: the unquantized "
                         "control); 1-5 min each (2 vLLM starts)")
    ap.add_argument("--real", help="a real bf16 model folder for the real-* models (Qwen2.5-Coder-1.5B)")
    ap.add_argument("--ppl-text", help="also the perplexity of this text file (4096 tokens, 1024-token "
                                       "windows) at TP=1 and TP=2; then a model passes by it (TP_PPL_RTOL) "
                                       "and by finite logprobs, and its greedy agreement is reported")
    ap.add_argument("--second-tp", type=int, choices=(1, 2), default=2,
                    help="the second run's TP size; 1 is the run-to-run control: TP=1 twice, each "
                         "compiled afresh (VLLM_DISABLE_COMPILE_CACHE, its own Inductor cache), "
                         "judged by the same rule")
    ap.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2], args.child[3], *args.child[4:5])
        return 0
    os.makedirs(args.out, exist_ok=True)
    names = args.models.split(",")
    bad = [n for n in names if n not in MODELS]
    if bad:
        ap.error(f"unknown --models {bad}: use {', '.join(MODELS)}")
    if any(n.startswith("real-") for n in names) and not (args.real and os.path.isfile(
            os.path.join(args.real, "config.json"))):
        ap.error(f"--models real-* needs --real, a model folder (got {args.real!r})")
    if args.ppl_text and not os.path.isfile(args.ppl_text):
        ap.error(f"--ppl-text {args.ppl_text!r} is not a file")
    os.makedirs(args.work, exist_ok=True)
    ckpts = build(args.work, names, args.real)
    # faulthandler: a child that aborts (session 22's TP=1 teardown) dumps every thread's Python stack
    env = {**os.environ, **NO_MULTICAST, "PYTHONFAULTHANDLER": "1"}
    summary, ok = {}, True
    for name, ckpt in ckpts.items():
        runs, ppls = {}, ({} if args.ppl_text else None)
        for run, tp in ((1, 1), (2, args.second_tp)):  # runs are keyed 1 and 2 (judge)
            child_env = env
            if args.second_tp == 1:  # the control: each run compiles afresh, caches of its own
                child_env = {**env, "VLLM_DISABLE_COMPILE_CACHE": "1",
                             "TORCHINDUCTOR_CACHE_DIR": os.path.join(args.work, f"inductor-{name}-{run}")}
                shutil.rmtree(child_env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
            res = os.path.join(args.out, f"{name}-run{run}-tp{tp}.json")  # kept for later comparisons
            for stale in (res, res + ".ppl.json"):  # only this run's files may be judged
                if os.path.exists(stale):
                    os.remove(stale)
            log = os.path.join(args.out, f"tp-{name}-run{run}-tp{tp}.log")
            t0 = time.monotonic()
            with open(log, "w") as f:
                rc = subprocess.run([sys.executable, __file__, "--child", ckpt, str(tp), name.split("-")[1], res,
                                     *([args.ppl_text] if args.ppl_text else [])],
                                    env=child_env, stdout=f, stderr=subprocess.STDOUT, timeout=420).returncode
            runs[run] = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "tp": tp}
            result = _load_json(res)
            if result is not None:
                runs[run]["result"] = result
            if ppls is not None:
                ppls[run] = _load_json(res + ".ppl.json")
        entry = judge(runs, ppls)
        entry["tp_act_scale"] = env.get("MIXPREC_TP_ACT_SCALE", "rank")  # kernels.tp_act_scale
        entry["tp_reduce"] = env.get("MIXPREC_TP_REDUCE", "model")  # kernels.tp_reduce
        entry["eager"] = env.get("TP_CHECK_EAGER") == "1"
        entry["inductor_deterministic"] = env.get("TORCHINDUCTOR_DETERMINISTIC") == "1"
        entry["emulate_precision_casts"] = env.get("TORCHINDUCTOR_EMULATE_PRECISION_CASTS") == "1"
        entry["second_tp"] = args.second_tp
        ok &= entry["pass"] or name.endswith("-bf16")  # the control is reported, not judged
        summary[name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k != "per_prompt"}), flush=True)
    with open(os.path.join(args.out, f"tp-{'_'.join(names)}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("TP", "PASS" if ok else "FAIL (see the JSON: first_diff, gap and max_dlogprob per prompt)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
