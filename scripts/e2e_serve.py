"""End to end on the GPU host: a random-weight Llama checkpoint of real layout, quantized to
mixprec W4A8, served by `vllm serve --quantization mixprec` on 127.0.0.1, asked for a
completion. Arms: W4A8 with the default 16-bit KV cache, and W4A8 + KV4/KV8 through our
CUSTOM backend when it is available.

The host has no network: the tokenizer is trained there on local files (as in
shared/baselines/kv_baseline.py; the helper is shared with the A/B harness in
vllm_mixprec/eval/synthetic.py). The parent process never touches CUDA (vLLM spawns).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from vllm_mixprec.eval.serve import serve_and_ask
from vllm_mixprec.eval.synthetic import LlamaShape, llama_config, train_tokenizer
from vllm_mixprec.quantize.rtn import rtn_w4a8_tensors
from vllm_mixprec.quant_methods.config import MixPrecScheme

E2E_SHAPE = LlamaShape(hidden=1024, layers=4, heads=16, kv_heads=4, inter=2816, vocab=8192, max_pos=4096,
                       name="e2e")


def make_bf16_model(path: str, shape: LlamaShape = E2E_SHAPE):
    from transformers import LlamaForCausalLM

    train_tokenizer(path, shape.vocab)
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(shape)).to(torch.bfloat16)
    model.save_pretrained(path)
    return model


def export_mixprec(model, src: str, dst: str, kv_scheme: str, group_size: int = 64):
    """Round-to-nearest LiquidQuant export of every decoder linear (the quantizer does better)."""
    from safetensors.torch import save_file

    state = rtn_w4a8_tensors(model.state_dict(), group_size)
    os.makedirs(dst, exist_ok=True)
    save_file(state, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = MixPrecScheme(group_size=group_size, kv_scheme=kv_scheme).to_dict()
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
    for f in os.listdir(src):
        if f.startswith(("tokenizer", "special_tokens", "generation_config")):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--work", default="/tmp/mixprec-e2e")
    ap.add_argument("--arms", default="w4a8,w4a8-kv8,w4a8-kv4")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    bf16 = os.path.join(args.work, "bf16")
    model = make_bf16_model(bf16)
    arms = {"w4a8": ("none", []),
            "w4a8-kv8": ("kv8", ["--kv-cache-dtype", "int8_per_token_head", "--attention-backend", "CUSTOM"]),
            "w4a8-kv4": ("kv4", ["--kv-cache-dtype", "int4_per_token_head", "--attention-backend", "CUSTOM"])}
    results = {}
    for i, arm in enumerate(args.arms.split(",")):
        kv, flags = arms[arm]
        ckpt = os.path.join(args.work, arm)
        export_mixprec(model, bf16, ckpt, kv)
        res = serve_and_ask(ckpt, ["--quantization", "mixprec"] + flags,
                            os.path.join(args.out, f"serve-{arm}.log"), 8100 + i)
        results[arm] = res
        print(arm, json.dumps(res), flush=True)
    json.dump(results, open(os.path.join(args.out, "e2e.json"), "w"), indent=1)
    ok = all(r["ok"] and r.get("plugin_logged") for r in results.values())
    print("E2E", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
