"""Which setting makes mixprec W4A8 + KV4 emit NaN logprobs (GPU host; diagnostic).

Session 21 (H200, tp_check.py --real): the real Qwen2.5-Coder-1.5B, RTN W4A8 + KV4 through the
CUSTOM backend, gave NaN logprobs from the first generated token on for 7 of 8 prompts generated
as one batch (prompt 0 was fine), at TP=1 and at TP=2; with a 16-bit KV cache it did not. Its k
biases (up to 354) turn bias-aware K on (quant_methods/k_bias.py), which the random Qwen2 shape
of tp_check.py (biases ~N(0, 0.5)) never does. This serves tp_check's random Qwen2 W4A8 + KV4
with its small biases and with large ones (N(0, BIG_BIAS) on k_proj, on every layer or on some)
under several settings, one vLLM per variant, and prints which prompts carry NaN. Session 21
(H100): big, small, big-noaware, big-noexact and big-nores, all eager, gave no NaN; mixed and
the compiled variants did not run (the device budget ran out):

  python3 scripts/diag_kv_nan.py --out $OUT [--variants big,small,big-noaware,...] [--budget S]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

BIG_BIAS = 80.0
VARIANTS = {  # name -> (k bias, env, eager)
    "big": ("big", {}, True),
    # the real model's pattern: bias-aware K on some layers only (Qwen: 0, 1, 7, 15 of 28)
    "mixed": ("mixed", {}, True),
    "mixed-compiled": ("mixed", {}, False),
    "small": ("small", {}, True),
    "big-noaware": ("big", {"MIXPREC_KV_BIAS_AWARE": "0"}, True),
    "big-noexact": ("big", {"MIXPREC_ATTN_PREFILL_EXACT": "0"}, True),
    "big-nores": ("big", {"MIXPREC_KV_RESIDUAL": "0"}, True),
    "big-kv8": ("big", {"KV": "kv8"}, True),
    "big-compiled": ("big", {}, False),
}
CARRIER = {"kv4": "int4_per_token_head", "kv8": "int8_per_token_head"}


def big_bias_copy(src: str, dst: str, std: float, layers: tuple[int, ...] | None = None) -> str:
    """src's checkpoint with the k_proj biases of `layers` (None: all) drawn from N(0, std)
    (other files linked)."""
    import torch
    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(dst, "config.json")):
        return dst
    os.makedirs(dst, exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for k, v in state.items():
        if k.endswith("self_attn.k_proj.bias") and (layers is None or int(k.split(".")[2]) in layers):
            state[k] = (torch.randn(v.shape, generator=g) * std).to(v.dtype)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(src):
        if f != "model.safetensors":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    return dst


def child(ckpt: str, kv: str, eager: bool, out_file: str) -> None:
    from vllm import LLM, SamplingParams

    from tp_check import PROMPTS

    llm = LLM(model=ckpt, quantization="mixprec", kv_cache_dtype=CARRIER[kv], attention_backend="CUSTOM",
              max_model_len=1024, gpu_memory_utilization=0.4, enforce_eager=eager, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    res = []
    for o in llm.generate(PROMPTS, params):
        c = o.outputs[0]
        lps = [max(lp.logprob for lp in step.values()) for step in c.logprobs]
        res.append({"tokens": list(c.token_ids), "nan_steps": [i for i, x in enumerate(lps) if math.isnan(x)],
                    "prompt_tokens": len(o.prompt_token_ids)})
    json.dump(res, open(out_file, "w"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--work", default="/tmp/mixprec-nan")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.child[2] == "1", a.child[3])
        return 0
    t_end = time.monotonic() + a.budget
    import tp_check
    os.makedirs(a.out, exist_ok=True)
    small = tp_check.build(a.work, ["qwen2-kv4"])["qwen2-kv4"]
    ckpts = {"small": small, "big": big_bias_copy(small, os.path.join(a.work, "qwen2-w4a8-kv4-bigbias"), BIG_BIAS),
             "mixed": big_bias_copy(small, os.path.join(a.work, "qwen2-w4a8-kv4-mixedbias"), BIG_BIAS, (0, 2))}
    summary = {}
    for name in a.variants.split(","):
        left = t_end - time.monotonic()
        if left < 60:
            summary[name] = "skipped (budget)"
            continue
        bias, env, eager = VARIANTS[name]
        env = dict(env)
        kv = env.pop("KV", "kv4")
        res = os.path.join(a.work, f"{name}.json")
        t0 = time.monotonic()
        with open(os.path.join(a.out, f"nan-{name}.log"), "w") as f:
            try:
                rc = subprocess.run([sys.executable, __file__, "--child", ckpts[bias], kv, "1" if eager else "0", res],
                                    env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=left - 10).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc == 0:
            r = json.load(open(res))
            summary[name] = {"nan_prompts": [i for i, p in enumerate(r) if p["nan_steps"]],
                             "first_nan_step": [p["nan_steps"][:1] for p in r],
                             "prompt_tokens": [p["prompt_tokens"] for p in r],
                             "tokens": [p["tokens"][:4] for p in r], "wall_s": round(time.monotonic() - t0)}
        else:
            summary[name] = f"rc={rc}"
        print(name, json.dumps(summary[name]), flush=True)
    json.dump(summary, open(os.path.join(a.out, "nan-summary.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
