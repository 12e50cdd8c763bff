"""Does rounding K/V to bf16 before KV8 fake quantization (as the GPU path quantizes bf16 K/V)
move the CPU perplexity of qwen-kv8 toward vLLM's? Same windows as real_model_check."""
import sys, torch
from vllm_mixprec.eval import perplexity as P
from vllm_mixprec.eval.realcheck import TEXTS, N_TOKENS, WINDOW
orig = P.fake_quant_kv
mode = sys.argv[1]
def fq(x, scheme):
    if mode == "bf16":
        return orig(x.to(torch.bfloat16).float(), scheme).to(x.dtype)
    return orig(x, scheme)
P.fake_quant_kv = fq
folder = "/root/.cache/vllm_mixprec/models/qwen2.5-coder-1.5b"
res = P.evaluate(folder, list(TEXTS), N_TOKENS, WINDOW, kv_scheme="kv8")
print(mode, {t: round(r["ppl"], 4) for t, r in res.items()}, flush=True)
