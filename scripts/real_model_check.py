"""The real SmolLM2-135M through `vllm serve` on the GPU host: greedy KV8 vs bf16 (issue #5) and
perplexity from prompt logprobs vs the CPU reference path (issue #6).

On the host, after the vLLM bundle, `gpu_check.sh env` and `gpu_models.sh assemble`
(docs/GPU_HOST.md has the whole call sequence):
  python3 scripts/real_model_check.py --models-dir /root/mixprec-models --out $OUT [--arms A,B] [--budget S]
Here, to (re)write the committed CPU reference numbers:
  python3 scripts/real_model_check.py --cpu-reference benchmarks/results/cpu-reference/real-models-ppl.json

The code is vllm_mixprec/eval/realcheck.py (its docstring says what each arm checks).
"""
import sys

from vllm_mixprec.eval.realcheck import main

if __name__ == "__main__":
    sys.exit(main())
