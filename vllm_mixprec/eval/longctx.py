"""Long-context decode throughput of one vLLM configuration (one A/B arm), in its own process.

Ported from shared/baselines/kv_baseline.py, the 2026-11-22 KV-cache anchor (vLLM 0.26 built-in
KV options on the H100, 8-layer Llama-3-8B shape): BATCH requests of PROMPT random token ids
(random.seed(0), ids in [3, 8192)), OUTPUT tokens each with ignore_eos and temperature 0, prefix
caching off, max_model_len 16384, gpu_memory_utilization 0.85, a 2-prompt warm-up of 8 tokens,
then one timed LLM.generate. Same measurement, same result fields (out_tok_per_s = generated
tokens / wall seconds of the generate call, prefill included), so the numbers line up with
shared/baselines/2026-11-22-h100-vllm-kv-baseline.jsonl. What differs: the model folder and the
engine flags come from the command line, parsed by vLLM's own EngineArgs parser, so an arm's
flags (--quantization, --kv-cache-dtype, --attention-backend, --linear-backend) apply unchanged.

  python -m vllm_mixprec.eval.longctx --model CKPT --out-json R.json [engine flags ...]

vLLM starts its engine with spawn: everything runs under `if __name__ == "__main__"`, and this
process touches CUDA only through vLLM.
"""
from __future__ import annotations

import json
import random
import sys
import time

BATCH, PROMPT, OUTPUT = 64, 8192, 256
ENGINE_DEFAULTS = {"max_model_len": 16384, "gpu_memory_utilization": 0.85, "enable_prefix_caching": False}


def build_parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(description="long-context decode throughput (kv_baseline.py's run)")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--prompt-len", type=int, default=PROMPT)
    p.add_argument("--output-len", type=int, default=OUTPUT)
    p.add_argument("--out-json", required=True, help="the result object is written here")
    p = EngineArgs.add_cli_args(p)
    p.set_defaults(**ENGINE_DEFAULTS)
    return p


def main(argv: list[str] | None = None) -> int:
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    args = build_parser().parse_args(argv)
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    random.seed(0)
    b, n_in, n_out = args.batch, args.prompt_len, args.output_len
    prompts = [TokensPrompt(prompt_token_ids=[random.randrange(3, 8192) for _ in range(n_in)]) for _ in range(b)]
    sp = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    t = time.time()
    outs = llm.generate(prompts, sp)
    dt = time.time() - t
    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    res = dict(kv=args.kv_cache_dtype, batch=b, prompt=n_in, out=n_out, seconds=dt, out_tok_per_s=n_gen / dt,
               total_tok_per_s=(n_gen + b * n_in) / dt, generated_tokens=n_gen)
    print("RESULT", json.dumps(res), flush=True)
    with open(args.out_json, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine: keep work out of import time
    sys.exit(main())
