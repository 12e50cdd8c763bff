"""Served A/B of the KV4 decode page kernels: the same greedy generation through vLLM with
MIXPREC_ATTN_DECODE_IMPL=triton and =cuda (kernels/triton/attention.py: decode_impl), each in
its own process, compared token for token and by the logprob of each chosen token.

    python3 scripts/decode_impl_ab.py --model CKPT --out DIR [--prompts 16 --prompt-len 1500]

CKPT: a mixprec W4A8 + KV4 checkpoint of head_dim 128 (e.g. the A/B harness's
/tmp/mixprec-ab/llama3-8b-L8/mixprec-w4a8kv4-g64), so that the CUDA kernel can run; forcing it
where it cannot is an error, so the cuda arm proves it ran. Writes DIR/decode_impl_ab.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def worker(args) -> None:
    import torch
    from vllm import LLM, SamplingParams
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [{"prompt_token_ids": torch.randint(10, args.vocab - 10, (args.prompt_len,),
                                                  generator=gen).tolist()}
               for _ in range(args.prompts)]
    llm = LLM(args.model, quantization="mixprec", kv_cache_dtype="int4_per_token_head",
              attention_backend="CUSTOM", max_model_len=args.prompt_len + 64,
              gpu_memory_utilization=0.5, enable_prefix_caching=False, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, logprobs=1)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append(dict(tokens=list(c.token_ids),
                         logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    with open(args.worker_out, "w") as f:
        json.dump(dict(impl=os.environ.get("MIXPREC_ATTN_DECODE_IMPL"), seconds=time.perf_counter() - t0,
                       rows=rows), f)


def compare(a: dict, b: dict) -> dict:
    same, gaps = [], []
    for ra, rb in zip(a["rows"], b["rows"]):
        n = 0
        while n < min(len(ra["tokens"]), len(rb["tokens"])) and ra["tokens"][n] == rb["tokens"][n]:
            n += 1
        same.append(n)
        gaps.append(max((abs(x - y) for x, y in zip(ra["logprobs"][:n], rb["logprobs"][:n])), default=0.0))
    return dict(identical_prefix=same, max_abs_logprob_diff=gaps,
                prompts_fully_identical=sum(n == len(r["tokens"]) for n, r in zip(same, a["rows"])))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1500)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impls", default="triton,cuda",
                   help="the two arms (triton,triton: the run-to-run control)")
    p.add_argument("--worker", choices=["triton", "cuda"])
    p.add_argument("--worker-out")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    results = []
    impls = args.impls.split(",")
    if len(impls) != 2 or not set(impls) <= {"triton", "cuda"}:
        p.error(f"--impls {args.impls!r}: expected two of triton, cuda")
    for arm, impl in enumerate(impls):
        path = os.path.join(args.out, f"decode_impl_{arm}_{impl}.json")
        log = os.path.join(args.out, f"decode_impl_{arm}_{impl}.log")
        cmd = [sys.executable, __file__, *(argv or sys.argv[1:]), "--worker", impl, "--worker-out", path]
        with open(log, "w") as f:
            rc = subprocess.call(cmd, env=dict(os.environ, MIXPREC_ATTN_DECODE_IMPL=impl),
                                 stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            print(f"{impl}: worker failed (rc {rc}); see {log}")
            return 1
        results.append(json.load(open(path)))
    summary = dict(model=args.model, impls=impls, prompts=args.prompts, prompt_len=args.prompt_len,
                   tokens=args.tokens, seconds=[r["seconds"] for r in results],
                   **compare(*results))
    with open(os.path.join(args.out, f"decode_impl_ab_{'_'.join(impls)}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
