"""Which setting makes mixprec W4A8 + KV4 emit NaN logprobs (GPU host; diagnostic).

Session 21 (H200, tp_check.py --real): the real Qwen2.5-Coder-1.5B, RTN W4A8 + KV4 through the
CUSTOM backend, gave NaN logprobs from the first generated token on for 7 of 8 prompts generated
as one batch (prompt 0 was fine), at TP=1 and at TP=2; with a 16-bit KV cache it did not. Its k
biases (up to 354) turn bias-aware K on (quant_methods/k_bias.py), which the random Qwen2 shape
of tp_check.py (biases ~N(0, 0.5)) never does. This serves tp_check's random Qwen2 W4A8 + KV4
with its small biases and with large ones (N(0, BIG_BIAS) on k_proj, on every layer or on some)
under several settings, one vLLM per variant, and prints which prompts carry NaN. Session 21
(H100): big, small, big-noaware, big-noexact and big-nores, all eager, gave no NaN; mixed and
the compiled variants did not run (the device budget ran out). Session 22 (real-* below): the
real model gave NaN compiled only, from vLLM's padding rows in FlashAttention, fixed in
attention_backend/impl.py (docs/RELIABILITY.md):

  python3 scripts/diag_kv_nan.py --out $OUT [--variants big,small,big-noaware,...] [--budget S]

The real-* variants serve the real Qwen2.5-Coder-1.5B's RTN W4A8 export (tp_check.export_real of
--real DIR, the bf16 folder) with KV4, or KV8 (real-kv8). Every child runs the engine in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) with the backend instrumented (instrument()): each attention
call checks its inputs and, after every kernel it launches, the rows that kernel wrote for
non-finite values, and the result file lists the first calls where any appears (layer, step,
phase, bad rows and their requests), so a NaN is traced to the launch that made it:

  python3 scripts/diag_kv_nan.py --out $OUT --real /root/mixprec-models/models/qwen2.5-coder-1.5b \
      --variants real,real-compiled,real-noaware,real-triton
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
    "real": ("real", {}, True),
    "real-compiled": ("real", {}, False),
    "real-noaware": ("real", {"MIXPREC_KV_BIAS_AWARE": "0"}, True),
    "real-triton": ("real", {"MIXPREC_ATTN_CHUNK": "triton"}, True),
    "real-nores": ("real", {"MIXPREC_KV_RESIDUAL": "0"}, True),
    "real-noexact": ("real", {"MIXPREC_ATTN_PREFILL_EXACT": "0"}, True),
    "real-kv8": ("real", {"KV": "kv8"}, True),
    "real-single": ("real", {"DIAG_ONE_PROMPT": "1"}, True),
}
MAX_RECORDS = 80  # instrumented calls kept per child (the first with a non-finite value)
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


def instrument(log: list) -> None:
    """Wrap MixPrecAttentionImpl.forward and the kernels it launches (names in its module) so
    that every call outside CUDA-graph capture appends to `log` what was non-finite: inputs
    (q/k/v rows), each launch's output rows, the final output rows. Layer 0's first 3 steps
    are kept whole (metadata included), then only calls with a non-finite value, at most
    MAX_RECORDS."""
    import torch

    from vllm_mixprec.attention_backend import impl as I

    st = {"step": -1, "cur": None}

    def bad(t, n):
        if t is None:
            return None
        n = min(n, t.shape[0])
        x = t[:n].reshape(n, -1)
        return torch.nonzero(~torch.isfinite(x).all(1)).flatten().tolist()

    def capturing():
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    def live():
        return st["cur"] is not None and not capturing()

    def wrap(name, *out_args):
        f = getattr(I, name)

        def w(*a, **k):
            r = f(*a, **k)
            if live():
                cur = st["cur"]
                n = cur["n"] if name != "gather_context_kv" else cur.get("context_total_k") or 0
                cur["phases"].append({name: [bad(a[i], n)[:12] for i in out_args]})
            return r
        setattr(I, name, w)

    wrap("chunk_attention", 6)
    chunk = I.chunk_attention

    def chunk_probe(q, key, value, qsl, max_q, scale, out):
        """chunk_attention, then, where its output has a non-finite row, the same call on
        contiguous copies and a float32 torch oracle (strides or values?)."""
        lse = chunk(q, key, value, qsl, max_q, scale, out)
        cur = st["cur"]
        if not live() or cur.get("probe") is not None or not bad(out, cur["n"]):
            return lse
        n = cur["n"]
        desc = {nm: {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
                     "absmax": float(t[:n].float().abs().max())}
                for nm, t in (("q", q), ("k", key), ("v", value), ("out", out))}
        out2 = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        chunk(q.contiguous(), key[:q.shape[0]].contiguous(), value[:q.shape[0]].contiguous(), qsl,
              max_q, scale, out2)
        locs = qsl.tolist()
        g = q.shape[1] // key.shape[1]
        ref = torch.empty(out[:n].shape, dtype=torch.float32, device=out.device)
        for a0, a1 in zip(locs[:-1], locs[1:]):
            qq = q[a0:a1].float().transpose(0, 1)
            kk = key[a0:a1].float().repeat_interleave(g, 1).transpose(0, 1)
            vv = value[a0:a1].float().repeat_interleave(g, 1).transpose(0, 1)
            s_ = qq @ kk.transpose(1, 2) * scale
            s_ = s_.masked_fill(torch.ones_like(s_, dtype=torch.bool).triu(1), float("-inf"))
            ref[a0:a1] = (s_.softmax(-1) @ vv).transpose(0, 1)
        cur["probe"] = {"tensors": desc, "qsl": locs, "max_query_len": max_q, "scale": scale,
                        "contiguous_rerun_bad": bad(out2, n)[:12],
                        "contiguous_rerun_err": float((out2[:n].float() - ref).abs().max()),
                        "ref_bad": bad(ref, n)[:12], "ref_absmax": float(ref.abs().max()),
                        "out_bad_count": len(bad(out, n))}
        return lse

    I.chunk_attention = chunk_probe
    wrap("context_attention", 8)
    wrap("decode_attention", 6)
    wrap("prefill_attention", 6)
    wrap("gather_context_kv", 8, 9)
    orig = I.MixPrecAttentionImpl.forward

    def forward(self, layer, query, key, value, kv_cache, md, output, *a, **k):
        if md is None or capturing():
            return orig(self, layer, query, key, value, kv_cache, md, output, *a, **k)
        name = getattr(layer, "layer_name", "?")
        idx = int(name.split(".")[2]) if name.count(".") > 2 else -1
        if idx == 0:
            st["step"] += 1
        n = md.num_actual_tokens
        qsl = md.query_start_loc[:md.num_reqs + 1].tolist()
        cur = {"step": st["step"], "layer": idx, "n": n, "num_reqs": md.num_reqs,
               "decodes": md.num_decodes, "prefills": md.num_prefills,
               "context_total_k": md.context_total_k, "phases": [],
               "q_bad": bad(query, n)[:12], "k_bad": bad(key, n)[:12], "v_bad": bad(value, n)[:12]}
        if idx == 0 and st["step"] < 3:
            cur.update(qsl=qsl, seq_lens=md.seq_lens[:md.num_reqs].tolist(),
                       has_ctx=md.prefill_has_context, q_shape=list(query.shape),
                       k_stride=list(key.stride()) if key is not None else None,
                       k_absmax=float(key[:n].abs().max()) if key is not None else None,
                       bias_aware=getattr(layer, "k_rope_bias", None) is not None,
                       key_positions=None if md.key_positions is None
                       else md.key_positions[:n].tolist())
        st["cur"] = cur
        try:
            r = orig(self, layer, query, key, value, kv_cache, md, output, *a, **k)
        finally:
            st["cur"] = None
        cur["out_bad"] = bad(output, n)[:12]
        cur["bias_aware"] = getattr(layer, "k_rope_bias", None) is not None
        any_bad = cur["out_bad"] or cur["q_bad"] or cur["k_bad"] or cur["v_bad"] or any(
            x for ph in cur["phases"] for v in ph.values() for x in v)
        if any_bad:  # which request each bad row belongs to
            import bisect
            cur["out_bad_reqs"] = sorted({bisect.bisect_right(qsl, t) - 1 for t in cur["out_bad"]})
        if (idx == 0 and cur["step"] < 3) or (any_bad and len(log) < MAX_RECORDS):
            log.append(cur)
        return r

    I.MixPrecAttentionImpl.forward = forward


def child(ckpt: str, kv: str, eager: bool, out_file: str) -> None:
    from vllm import LLM, SamplingParams

    from tp_check import PROMPTS

    log: list = []
    instrument(log)
    prompts = PROMPTS[:1] if os.environ.get("DIAG_ONE_PROMPT") == "1" else PROMPTS

    llm = LLM(model=ckpt, quantization="mixprec", kv_cache_dtype=CARRIER[kv], attention_backend="CUSTOM",
              max_model_len=1024, gpu_memory_utilization=0.4, enforce_eager=eager, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True)
    res = []
    for o in llm.generate(prompts, params):
        c = o.outputs[0]
        lps = [max(lp.logprob for lp in step.values()) for step in c.logprobs]
        res.append({"tokens": list(c.token_ids), "nan_steps": [i for i, x in enumerate(lps) if math.isnan(x)],
                    "prompt_tokens": len(o.prompt_token_ids)})
    json.dump({"prompts": res, "log": log}, open(out_file, "w"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--work", default="/tmp/mixprec-nan")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--real", help="the real Qwen2.5-Coder-1.5B bf16 folder (real-* variants)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.child[2] == "1", a.child[3])
        return 0
    t_end = time.monotonic() + a.budget
    import tp_check
    os.makedirs(a.out, exist_ok=True)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {list(VARIANTS)}")
    ckpts = {}
    if any(VARIANTS[n][0] != "real" for n in names):
        small = tp_check.build(a.work, ["qwen2-kv4"])["qwen2-kv4"]
        ckpts = {"small": small,
                 "big": big_bias_copy(small, os.path.join(a.work, "qwen2-w4a8-kv4-bigbias"), BIG_BIAS),
                 "mixed": big_bias_copy(small, os.path.join(a.work, "qwen2-w4a8-kv4-mixedbias"), BIG_BIAS, (0, 2))}
    if any(VARIANTS[n][0] == "real" for n in names):
        if not a.real:
            ap.error("the real-* variants need --real (the bf16 Qwen2.5-Coder-1.5B folder)")
        exported = tp_check.export_real(a.real, a.work, ["kv4", "kv8"])
        ckpts["real"], ckpts["real-kv8"] = exported["real-kv4"], exported["real-kv8"]
    summary = {}
    for name in names:
        left = t_end - time.monotonic()
        if left < 60:
            summary[name] = "skipped (budget)"
            continue
        bias, env, eager = VARIANTS[name]
        env = dict(env)
        kv = env.pop("KV", "kv4")
        ckpt = ckpts["real-kv8" if bias == "real" and kv == "kv8" else bias]
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the instrumented backend runs in this child
        res = os.path.join(a.work, f"{name}.json")
        t0 = time.monotonic()
        with open(os.path.join(a.out, f"nan-{name}.log"), "w") as f:
            try:
                rc = subprocess.run([sys.executable, __file__, "--child", ckpt, kv, "1" if eager else "0", res],
                                    env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=left - 10).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc == 0:
            full = json.load(open(res))
            r = full["prompts"]
            json.dump(full, open(os.path.join(a.out, f"nan-{name}.json"), "w"))
            summary[name] = {"first_bad_calls": [
                {k: c.get(k) for k in ("step", "layer", "bias_aware", "n", "num_reqs", "phases", "probe", "q_bad",
                                       "k_bad", "v_bad", "out_bad", "out_bad_reqs")}
                for c in full["log"] if c.get("out_bad") or c.get("q_bad")][:3],"nan_prompts": [i for i, p in enumerate(r) if p["nan_steps"]],
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
