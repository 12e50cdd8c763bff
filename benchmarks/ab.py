#!/usr/bin/env python3
"""The A/B harness of issue #6: bf16, GPTQ-Marlin, GPTQ-Machete, FP8 and mixprec through vLLM 0.26.

The same program as `vllm-mixprec ab`; the code is vllm_mixprec/eval/ab.py (importable, so the CLI
can reach it), the checkpoints eval/synthetic.py, the table and plots eval/ab_report.py. docs/AB.md
describes the offline GPU-host workflow (scripts/gpu_ab.sh) and what each arm means.

  python3 benchmarks/ab.py --arms w4a8kv4,marlin --workloads throughput --out out/ab
  python3 benchmarks/ab.py --replot out/ab           # table and PNGs, no GPU needed
  python3 benchmarks/ab.py --help
"""
import sys

from vllm_mixprec.eval.ab import main

if __name__ == "__main__":  # vLLM spawns its engines: nothing runs at import time
    sys.exit(main())
