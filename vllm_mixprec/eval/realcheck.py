"""The real SmolLM2-135M through `vllm serve` on the GPU host (issues #5 and #6).

  python3 scripts/real_model_check.py --models-dir /root/mixprec-models --out $OUT [--arms ...] [--budget S]
  python3 scripts/real_model_check.py --cpu-reference REF.json     # here, on the CPU: the reference numbers

The models come to the host through `make gpu-models` / scripts/gpu_models.sh (eval/modelpack.py);
--models-dir has the layout of ~/.cache/vllm_mixprec (models/smollm2-135m, demo-smollm2-w4a8-kv8,
text/*.txt). Servers ("arms"), each one `vllm serve` on 127.0.0.1, one after the other:

  bf16      the bf16 folder, vLLM defaults (compiled, CUDA graphs, bf16 KV): the greedy reference,
            and perplexity `bf16`
  bf16-triton  the bf16 folder with vLLM's TRITON_ATTN instead of FlashAttention (compiled, bf16
            KV): greedy agreement reported, no pass criterion. The control for the KV arms: how
            often a different bf16 attention kernel alone flips a near-tied greedy token
  bf16-kv8  + --kv-cache-dtype int8_per_token_head --attention-backend CUSTOM (compiled): greedy
            tokens must equal bf16's for >= MIN_AGREE tokens of every prompt (issue #5)
  bf16-kv4  the same with int4_per_token_head, --enforce-eager (saves a compile): greedy agreement
            reported, no pass criterion
  w4a8-kv8  the mixprec W4A8 demo checkpoint with its KV8 (--quantization mixprec + the KV8
            flags, --enforce-eager, MIXPREC_KV_RESIDUAL=0 MIXPREC_ATTN_PREFILL_EXACT=0):
            perplexity `w4a8-kv8`
  w4a8      the same weights with a 16-bit KV cache (a copy of the folder whose config says
            kv_scheme none; --enforce-eager): perplexity `w4a8`
  qwen-bf16 the real Qwen2.5-Coder-1.5B (bf16, compiled, CUDA graphs): perplexity `qwen-bf16`, and
            the greedy reference of the qwen arms
  qwen-kv8  the same with KV8 as `w4a8-kv8` serves it (eager, every key quantized): perplexity
            `qwen-kv8`. Qwen's k_proj biases (up to 354) are the hard case for the KV cache
            (docs/BENCHMARKS.md); without `--quantization mixprec` there is no bias-aware K
  qwen-w4a8-kv4  the product on the real Qwen: its RTN W4A8 export (DERIVED: made on the host
            from the bf16 folder, ~20 s, the same bytes as here) with KV4, bias-aware K (the
            served default for its biases), compiled with CUDA graphs, every key quantized:
            perplexity `qwen-w4a8-kv4`
  qwen-sakc-kv8  KV8 alone as issue #3 recommends it for Qwen: the bf16 folder with K centering
            and SmoothAttention folded into q/k_proj (DERIVED: `vllm-mixprec quantize --scheme
            none --k-centering --smooth-attention`, 8 x 512 calibration tokens of alice29, made
            on the host, ~3 min on 2 cores) served with vLLM's run-time KV8 flags (eager, every
            key quantized): perplexity `qwen-sakc-kv8`, against `qwen-bf16` for issue #3's
            KV8 <= 0.3 % target

A greedy arm is compared with the reference arm of its own model. `rest` runs the arms not yet
run on this host whose model folder is there (the Qwen parts are optional: docs/GPU_HOST.md).

Perplexity (issue #6): prompt logprobs (`prompt_logprobs: 0`, `max_tokens: 1`) of the very token
windows the CPU path (eval/perplexity.py: tokenize + windows) scores, sent as token ids, so no
BOS or other special token is added; the server's echoed `prompt_token_ids` are checked. The CPU
numbers come from REF.json (written by --cpu-reference with `evaluate()`, the code behind
`vllm-mixprec eval`), which also pins the checkpoint files and the token ids by sha256. PASS
within PPL_RTOL relative. The KV8 perplexity arm turns off exact prefill and the residual window,
because the CPU path quantizes every key (kv_residual 0): by default a prefill chunk attends its
own tokens in 16 bits (so prompt logprobs would not see the cache at all), and the window keeps
a chunk's last 16 keys in 16 bits.

Results of every arm run on this host are merged into MODELS_DIR/.results/real_model_check.json,
so the check may be split over several device calls (--arms); each call writes the merged record
to OUT/real_model_check.json, a readable OUT/real_model_check.log and OUT/serve-ARM.log. Exit 0
when every criterion of the arms run in this call holds, 1 on a failure, 3 when the budget left
an arm out. The parent process never touches CUDA.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .. import envs
from ..quantize.models import sha256_file

TEXTS = ("lcet10", "botchan")
N_TOKENS = 4096
WINDOW = 1024
QWEN_RTN = "qwen2.5-coder-1.5b-w4a8-rtn-kv4"
QWEN_SAKC = "qwen2.5-coder-1.5b-sa-kc"
MODELS = {"smollm2-135m": "models/smollm2-135m", "demo-smollm2-w4a8-kv8": "demo-smollm2-w4a8-kv8",
          "qwen2.5-coder-1.5b": "models/qwen2.5-coder-1.5b", QWEN_RTN: f"derived/{QWEN_RTN}",
          QWEN_SAKC: f"derived/{QWEN_SAKC}"}
# Made where they are needed from another MODELS entry (name -> (source, recipe)), so that the
# Qwen parts carry the bf16 folder only: the RTN W4A8 export (quantize/rtn.py, with this KV
# scheme), or the quantizer's CLI arguments (the calibration text must be in the models dir). The
# CPU reference pins the bytes made here; check_inputs refuses a host whose build differs
# (`gpu_models.sh check-host-ref` then checks against a reference computed on that host).
DERIVED = {QWEN_RTN: ("qwen2.5-coder-1.5b", "kv4"),
           QWEN_SAKC: ("qwen2.5-coder-1.5b", ("--scheme", "none", "--k-centering", "--smooth-attention",
                                              "--calib-samples", "8", "--calib-seqlen", "512"))}
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n\n", "Water boils at",
           "The best way to learn a new language is", "In 1969, Neil Armstrong")
GREEDY_TOKENS = 64
MIN_AGREE = 32
TOPK = 5
PPL_RTOL = 0.01
MAX_MODEL_LEN = 2048
REQUEST_TIMEOUT_S = 120.0
STARTUP_LIMIT_S = 300.0
STOP_S = 45.0  # serve.stop: 30 s SIGTERM grace, then SIGKILL
DEFAULT_REFERENCE = Path(__file__).resolve().parents[2] / "benchmarks/results/cpu-reference/real-models-ppl.json"
KV_NONE_DIR = Path("/tmp/mixprec-realcheck")  # the kv_scheme-none copies (links and a config)
KV8 = ("--kv-cache-dtype", "int8_per_token_head", "--attention-backend", "CUSTOM")
KV4 = ("--kv-cache-dtype", "int4_per_token_head", "--attention-backend", "CUSTOM")
ALL_KEYS_QUANTIZED = (("MIXPREC_KV_RESIDUAL", "0"), ("MIXPREC_ATTN_PREFILL_EXACT", "0"))  # as the CPU path


@dataclasses.dataclass(frozen=True)
class PplRun:
    name: str
    model: str  # key of MODELS
    kv: str  # the KV scheme the CPU path fake-quantizes
    # K quantized around RoPE_p(k_proj.bias) as the backend serves a model with large k biases
    # (quant_methods/k_bias.py; the CPU path: perplexity.evaluate(kv_bias_aware=True))
    bias_aware: bool = False


PPL_RUNS = {r.name: r for r in (PplRun("bf16", "smollm2-135m", "none"),
                                  PplRun("w4a8-kv8", "demo-smollm2-w4a8-kv8", "kv8"),
                                  PplRun("w4a8", "demo-smollm2-w4a8-kv8", "none"),
                                  PplRun("qwen-bf16", "qwen2.5-coder-1.5b", "none"),
                                  PplRun("qwen-kv8", "qwen2.5-coder-1.5b", "kv8"),
                                  PplRun("qwen-w4a8-kv4", QWEN_RTN, "kv4", bias_aware=True),
                                  PplRun("qwen-sakc-kv8", QWEN_SAKC, "kv8"))}


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    model: str  # key of MODELS
    flags: tuple[str, ...] = ()
    eager: bool = False
    env: tuple[tuple[str, str], ...] = ()
    greedy: str | None = None  # "reference", "criterion" (>= MIN_AGREE) or "report"
    ppl: str | None = None  # a PPL_RUNS name
    kv_none_copy: bool = False  # serve a copy of the folder whose config says kv_scheme none
    est_s: float = 180.0  # start-up (torch.compile, CUDA graphs) + requests + stop, for the budget

    def cmd_flags(self) -> list[str]:
        return [*self.flags, *(["--enforce-eager"] if self.eager else [])]


ARMS = {a.name: a for a in (
    Arm("bf16", "smollm2-135m", greedy="reference", ppl="bf16"),
    Arm("bf16-triton", "smollm2-135m", ("--attention-backend", "TRITON_ATTN"), greedy="report"),
    Arm("bf16-kv8", "smollm2-135m", KV8, greedy="criterion"),
    Arm("bf16-kv4", "smollm2-135m", KV4, eager=True, greedy="report", est_s=110.0),
    Arm("w4a8-kv8", "demo-smollm2-w4a8-kv8", ("--quantization", "mixprec", *KV8), eager=True,
        env=ALL_KEYS_QUANTIZED, ppl="w4a8-kv8", est_s=110.0),
    Arm("w4a8", "demo-smollm2-w4a8-kv8", ("--quantization", "mixprec"), eager=True, ppl="w4a8",
        kv_none_copy=True, est_s=110.0),
    Arm("qwen-bf16", "qwen2.5-coder-1.5b", greedy="reference", ppl="qwen-bf16", est_s=240.0),
    Arm("qwen-kv8", "qwen2.5-coder-1.5b", KV8, eager=True, env=ALL_KEYS_QUANTIZED, ppl="qwen-kv8",
        est_s=150.0),
    # compiled with CUDA graphs: the path of session 22's padding-row NaN (docs/RELIABILITY.md)
    Arm("qwen-w4a8-kv4", QWEN_RTN, ("--quantization", "mixprec", *KV4), env=ALL_KEYS_QUANTIZED,
        ppl="qwen-w4a8-kv4", est_s=240.0),
    Arm("qwen-sakc-kv8", QWEN_SAKC, KV8, eager=True, env=ALL_KEYS_QUANTIZED, ppl="qwen-sakc-kv8",
        est_s=150.0),
)}


def greedy_reference(arm: Arm) -> str:
    """The arm whose greedy completions `arm`'s are compared with: its model's reference arm."""
    return next(a.name for a in ARMS.values() if a.model == arm.model and a.greedy == "reference")


def ids_sha256(windows: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(windows, separators=(",", ":")).encode()).hexdigest()


def token_windows(model_dir: str | Path, text: str, n_tokens: int = N_TOKENS, window: int = WINDOW) -> list[list[int]]:
    """The windows the CPU path scores: the folder's tokenizer, no special tokens (perplexity.evaluate)."""
    from transformers import AutoTokenizer

    from ..quantize.models import load_text
    from .perplexity import tokenize, windows

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [w.tolist() for w in windows(tokenize(tok, load_text(text)), n_tokens, window)]


# --- the CPU reference (run here, committed) ------------------------------------------------------

def ensure_derived(models_dir: Path, model: str, log=print) -> None:
    """Build a DERIVED model from its source folder unless it is there (or its source is not)."""
    if model not in DERIVED or (models_dir / MODELS[model] / "config.json").is_file():
        return
    src, recipe = DERIVED[model]
    if not (models_dir / MODELS[src] / "config.json").is_file():
        return
    t0 = time.time()
    if isinstance(recipe, str):
        from ..quantize.rtn import export_rtn_folder

        export_rtn_folder(models_dir / MODELS[src], models_dir / MODELS[model], recipe)
        log(f"{model}: RTN W4A8 export of {src} (kv_scheme {recipe}) in {time.time() - t0:.0f} s")
        return
    from ..cli import build_parser, main as cli_main

    argv = ["quantize", str(models_dir / MODELS[src]), str(models_dir / MODELS[model]), *recipe]
    # the calibration text the CLI will read; missing, load_text would try to download it
    calib = models_dir / "text" / f"{build_parser().parse_args(argv).calib_text}.txt"
    if not calib.is_file():
        raise RuntimeError(f"{model}: {calib} is missing (packs made before session 42 lack it: "
                           "make gpu-models QWEN=only)")
    if cli_main(argv) != 0:
        raise RuntimeError(f"{model}: `vllm-mixprec {' '.join(argv)}` failed (its output is above)")
    log(f"{model}: `vllm-mixprec {' '.join(argv)}` in {time.time() - t0:.0f} s")


def model_files(models_dir: Path, model: str) -> dict[str, str]:
    """sha256 of the files a run reads: config, tokenizer and every safetensors file (a
    quantizer export may be sharded, with its index)."""
    folder = models_dir / MODELS[model]
    names = ["config.json", "tokenizer.json", *sorted(p.name for p in folder.glob("*.safetensors")),
             *sorted(p.name for p in folder.glob("*.safetensors.index.json"))]
    return {f: sha256_file(folder / f) for f in names}


def cpu_reference(models_dir: Path, out: Path, runs: list[str], command: str) -> dict:
    import torch
    import transformers

    from ..quantize.models import TEXTS as KNOWN_TEXTS
    from .perplexity import evaluate

    for m in {PPL_RUNS[r].model for r in runs}:
        ensure_derived(models_dir, m)
    ref = {"about": "CPU reference perplexity (vllm_mixprec.eval.perplexity.evaluate, the code of "
                    "`vllm-mixprec eval`) for scripts/real_model_check.py",
           "command": command, "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "transformers": transformers.__version__,
           "n_tokens": N_TOKENS, "window": WINDOW,
           "texts": {t: KNOWN_TEXTS[t].sha256 for t in TEXTS},
           "models": {m: model_files(models_dir, m) for m in sorted({PPL_RUNS[r].model for r in runs})},
           "runs": {}}
    old = json.loads(out.read_text()) if out.is_file() else None
    if old and all(old.get(k) == ref[k] for k in ("n_tokens", "window", "texts")):
        # keep the other runs (each run records its own date, command and versions)
        ref["models"] = {**old.get("models", {}), **ref["models"]}
        ref["runs"] = {r: v for r, v in old.get("runs", {}).items() if r not in runs}
    for name in runs:
        run = PPL_RUNS[name]
        folder = models_dir / MODELS[run.model]
        t0 = time.time()
        res = evaluate(folder, list(TEXTS), N_TOKENS, WINDOW, kv_scheme=run.kv,
                       kv_bias_aware=run.bias_aware)
        ref["runs"][name] = {
            "model": run.model, "kv": run.kv, "kv_dtype": "served" if run.kv != "none" else None,
            "kv_bias_aware": run.bias_aware,
            "seconds": round(time.time() - t0, 1), "date": ref["date"],
            "command": command, "torch": ref["torch"], "transformers": ref["transformers"],
            "texts": {t: {**res[t], "ids_sha256": ids_sha256(token_windows(folder, t))} for t in TEXTS}}
        print(name, {t: round(r["ppl"], 4) for t, r in res.items()}, flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(ref, indent=1) + "\n")  # after each run: a long one may be stopped
    return ref


# --- talking to a server --------------------------------------------------------------------------

def post_json(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code} from {url}: {e.read()[:500]!r}") from e


def greedy_body(model: str, prompt: str, max_tokens: int = GREEDY_TOKENS) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": TOPK, "return_token_ids": True, "return_tokens_as_token_ids": True}


def parse_greedy(resp: dict) -> dict:
    """One greedy completion -> {"tokens": [ids], "top": [{id: logprob}] per step}."""
    choice = resp["choices"][0]
    tokens = choice.get("token_ids")
    lp = choice.get("logprobs") or {}
    top = lp.get("top_logprobs")
    if tokens is None or top is None:
        raise ValueError("the response has no token_ids or top_logprobs (return_token_ids / logprobs ignored?)")
    if len(top) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(top)} top_logprobs entries")
    steps = []
    for entry in top:
        step = {}
        for key, val in (entry or {}).items():
            if not key.startswith("token_id:"):
                raise ValueError(f"top_logprobs key {key!r} is not 'token_id:N' (return_tokens_as_token_ids ignored?)")
            step[int(key.split(":", 1)[1])] = float(val)
        steps.append(step)
    return {"tokens": [int(t) for t in tokens], "top": steps, "text": choice.get("text", "")}


def compare_greedy(ref: list[dict], other: list[dict], min_agree: int = MIN_AGREE) -> dict:
    """Per prompt: identical leading tokens, the first divergence and the logprob gap there
    (each side's logprob of its own pick minus its logprob of the other side's pick; None when
    that token is outside the side's top-k)."""
    if len(ref) != len(other):
        raise ValueError(f"{len(ref)} reference completions but {len(other)} to compare")
    rows = []
    for i, (a, b) in enumerate(zip(ref, other)):
        n = min(len(a["tokens"]), len(b["tokens"]))
        step = next((j for j in range(n) if a["tokens"][j] != b["tokens"][j]), None)
        row = {"prompt": i, "agree": n if step is None else step, "compared": n, "first_diff": step}
        if step is not None:
            ta, tb = a["tokens"][step], b["tokens"][step]
            row.update(ref_token=ta, other_token=tb,
                       ref_gap=_gap(a["top"][step], ta, tb), other_gap=_gap(b["top"][step], tb, ta))
        row["pass"] = row["agree"] >= min_agree
        rows.append(row)
    return {"min_agree": min_agree, "prompts": len(rows), "passed": sum(r["pass"] for r in rows),
            "pass": bool(rows) and all(r["pass"] for r in rows), "per_prompt": rows}


def _gap(top: dict[int, float], mine: int, theirs: int) -> float | None:
    if mine not in top or theirs not in top:
        return None
    return top[mine] - top[theirs]


def ppl_body(model: str, ids: list[int]) -> dict:
    return {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0,
            "return_token_ids": True}


def window_nll(resp: dict, ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(ids[t] | ids[:t]) over t >= 1 from a prompt_logprobs response, and the count."""
    choice = resp["choices"][0]
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != list(ids):
        where = next((i for i, (x, y) in enumerate(zip(echoed, ids)) if x != y), min(len(echoed), len(ids)))
        raise ValueError(f"the server scored other token ids than sent ({len(echoed)} vs {len(ids)} ids, first "
                         f"difference at {where}; a BOS added?)")
    plp = choice.get("prompt_logprobs")
    if plp is None or len(plp) != len(ids):
        raise ValueError(f"prompt_logprobs has {None if plp is None else len(plp)} entries for {len(ids)} ids")
    nll = 0.0
    for t in range(1, len(ids)):
        entry = plp[t] or {}
        val = entry.get(str(ids[t]), entry.get(ids[t]))
        if val is None:
            raise ValueError(f"prompt_logprobs[{t}] has no entry for token {ids[t]}")
        lp = float(val["logprob"] if isinstance(val, dict) else val)
        if not math.isfinite(lp) or lp <= -9999.0:
            raise ValueError(f"prompt_logprobs[{t}] of token {ids[t]} is {lp}")
        nll -= lp
    return nll, len(ids) - 1


def compare_ppl(got: dict[str, dict], ref: dict[str, dict], rtol: float = PPL_RTOL) -> dict:
    """got/ref: text -> {"nll", "tokens"} ({"ppl"} optional). Relative difference of the perplexities."""
    rows, ok = {}, True
    for text, r in ref.items():
        g = got.get(text)
        if g is None:
            rows[text] = {"pass": False, "error": "not measured"}
            ok = False
            continue
        if g["tokens"] != r["tokens"]:
            rows[text] = {"pass": False, "error": f"{g['tokens']} tokens scored, the reference {r['tokens']}"}
            ok = False
            continue
        p_got, p_ref = math.exp(g["nll"] / g["tokens"]), math.exp(r["nll"] / r["tokens"])
        rel = p_got / p_ref - 1
        rows[text] = {"ppl_vllm": p_got, "ppl_cpu": p_ref, "rel": rel, "tokens": g["tokens"], "pass": abs(rel) <= rtol}
        ok &= rows[text]["pass"]
    return {"rtol": rtol, "pass": ok and bool(rows), "texts": rows}


# --- one arm --------------------------------------------------------------------------------------

def kv_scheme_copy(folder: Path, dst: Path, kv_scheme: str) -> Path:
    """A folder with the same files (links) whose config says kv_scheme `kv_scheme`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        target = dst / f.name
        if f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["quantization_config"]["kv_scheme"] = kv_scheme
            target.write_text(json.dumps(cfg, indent=1) + "\n")
        elif not target.exists():
            target.symlink_to(f.resolve())
    return dst


def kv_none_copy(folder: Path, dst: Path) -> Path:
    """kv_scheme_copy with kv_scheme none (a 16-bit KV cache)."""
    return kv_scheme_copy(folder, dst, "none")


def run_arm(arm: Arm, folder: Path, out: Path, windows: dict[str, list[list[int]]], deadline: float,
            log=print) -> dict:
    from . import serve as S
    from .ab import free_port

    port = free_port()
    extra = ["--max-model-len", str(MAX_MODEL_LEN), "--gpu-memory-utilization", "0.5", *arm.cmd_flags()]
    cmd = S.serve_cmd(str(folder), port, extra)
    log_path = out / f"serve-{arm.name}.log"
    res = {"cmd": " ".join(cmd[2:]), "env": dict(arm.env), "mode": "eager" if arm.eager else "compiled + CUDA graphs"}
    t0 = time.time()
    proc = S.start(cmd, str(log_path), dict(arm.env))
    try:
        url = f"http://127.0.0.1:{port}"
        err = S.wait_healthy(proc, url, max(10.0, min(STARTUP_LIMIT_S, deadline - time.time() - STOP_S)))
        if err:
            res["error"] = err
            return res
        res["startup_s"] = round(time.time() - t0, 1)
        log(f"  {arm.name}: healthy after {res['startup_s']} s")
        if arm.greedy:
            res["greedy"] = [parse_greedy(post_json(url + "/v1/completions", greedy_body(str(folder), p)))
                             for p in PROMPTS]
        if arm.ppl:
            ppl = {}
            for text, ws in windows.items():
                nll, count = 0.0, 0
                for w in ws:
                    a, b = window_nll(post_json(url + "/v1/completions", ppl_body(str(folder), w)), w)
                    nll, count = nll + a, count + b
                ppl[text] = {"nll": nll, "tokens": count, "ppl": math.exp(nll / count)}
            res["ppl"] = ppl
        res["requests_s"] = round(time.time() - t0 - res["startup_s"], 1)
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        S.stop(proc)
        res["wall_s"] = round(time.time() - t0, 1)
        try:
            res["facts"] = S.log_facts(log_path.read_text(errors="replace"))
        except OSError:
            pass
    return res


# --- the verdict ----------------------------------------------------------------------------------

def verdict(arms: dict[str, dict], reference: dict, names: list[str]) -> dict:
    """Criteria of the arms `names` from the merged arm results: greedy and perplexity rows."""
    checks = []
    for name in names:
        arm, res = ARMS[name], arms.get(name) or {}
        if "error" in res:
            checks.append({"arm": name, "what": "server", "criterion": True, "pass": False, "error": res["error"]})
            continue
        if arm.greedy in ("criterion", "report"):
            ref_name = greedy_reference(arm)
            ref_greedy = (arms.get(ref_name) or {}).get("greedy")
            if ref_greedy is None or "greedy" not in res:
                checks.append({"arm": name, "what": "greedy", "criterion": arm.greedy == "criterion", "pass": False,
                               "error": (f"no {ref_name} reference completions" if ref_greedy is None
                                         else "not measured")})
            else:
                checks.append({"arm": name, "what": "greedy", "criterion": arm.greedy == "criterion",
                               **compare_greedy(ref_greedy, res["greedy"])})
        if arm.ppl:
            cpu = reference["runs"].get(arm.ppl)
            if cpu is None:
                checks.append({"arm": name, "what": "ppl", "criterion": True, "pass": False,
                               "error": f"the CPU reference has no run {arm.ppl!r}"})
            else:
                want = {t: {"nll": v["nll"], "tokens": v["tokens"]} for t, v in cpu["texts"].items()}
                checks.append({"arm": name, "what": "ppl", "criterion": True,
                               **compare_ppl(res.get("ppl") or {}, want)})
    failed = [c for c in checks if c["criterion"] and not c["pass"]]
    return {"pass": not failed, "checks": checks}


def report_lines(v: dict, arms: dict[str, dict]) -> list[str]:
    lines = []
    for c in v["checks"]:
        tag = ("PASS" if c["pass"] else "FAIL") if c["criterion"] else "info"
        res = arms.get(c["arm"]) or {}
        head = f"[{tag}] {c['arm']:9s} {c['what']:6s}"
        if "error" in c:
            lines.append(f"{head} {c['error']}")
        elif c["what"] == "greedy":
            lines.append(f"{head} {c['passed']}/{c['prompts']} prompts agree with bf16 for >= {c['min_agree']} "
                         f"tokens ({res.get('mode')})")
            for r in c["per_prompt"]:
                if r["first_diff"] is None:
                    lines.append(f"      prompt {r['prompt']}: identical for all {r['compared']} tokens")
                else:
                    lines.append(f"      prompt {r['prompt']}: {r['agree']} identical, then {r['ref_token']} (bf16) vs "
                                 f"{r['other_token']}; gap bf16 {_fmt(r['ref_gap'])}, this arm {_fmt(r['other_gap'])}")
        else:
            for text, r in c["texts"].items():
                if "error" in r:
                    lines.append(f"{head} {text}: {r['error']}")
                else:
                    lines.append(f"{head} {text}: vLLM {r['ppl_vllm']:.4f} vs CPU {r['ppl_cpu']:.4f} "
                                 f"({100 * r['rel']:+.3f}%, {r['tokens']} tokens, {res.get('mode')})")
    return lines


def _fmt(x: float | None) -> str:
    return "n/a (outside top-%d)" % TOPK if x is None else f"{x:.3f}"


# --- main -----------------------------------------------------------------------------------------

def call_status(passed: bool, incomplete: bool) -> str:
    return "FAIL" if not passed else ("INCOMPLETE" if incomplete else "PASS")


def check_inputs(models_dir: Path, reference: dict, names: list[str]) -> list[str]:
    """Everything the arms need is there, and is what the CPU reference was computed on."""
    problems = []
    for m in sorted({ARMS[n].model for n in names}):
        folder = models_dir / MODELS[m]
        if not (folder / "config.json").is_file():
            problems.append(f"{folder} is not a model folder (run scripts/gpu_models.sh assemble)")
            continue
        for f, sha in reference.get("models", {}).get(m, {}).items():
            if not (folder / f).is_file() or sha256_file(folder / f) != sha:
                problems.append(f"{folder / f} is not the file the CPU reference used (sha256 differs)")
    for n in names:  # a KV run pinned before session 21 quantized float32 K/V, not what vLLM serves
        run = reference.get("runs", {}).get(ARMS[n].ppl or "", {})
        if run.get("kv", "none") != "none" and run.get("kv_dtype") != "served":
            problems.append(f"the CPU reference of {ARMS[n].ppl} quantized float32 K/V (recompute it: "
                            f"--cpu-reference ... --runs {ARMS[n].ppl})")
        if ARMS[n].ppl and run and bool(run.get("kv_bias_aware")) != PPL_RUNS[ARMS[n].ppl].bias_aware:
            problems.append(f"the CPU reference of {ARMS[n].ppl} has kv_bias_aware="
                            f"{run.get('kv_bias_aware')}, the arm serves "
                            f"{PPL_RUNS[ARMS[n].ppl].bias_aware} (recompute it: --cpu-reference ... "
                            f"--runs {ARMS[n].ppl})")
    if any(ARMS[n].ppl for n in names):
        problems += [f"{models_dir / 'text' / t}.txt is missing" for t in TEXTS
                     if not (models_dir / "text" / f"{t}.txt").is_file()]
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="real_model_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--models-dir", type=Path, help="the assembled models (default ~/.cache/vllm_mixprec)")
    p.add_argument("--out", type=Path, help="where the JSON, the log and the server logs go")
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"comma-separated, in order, of {', '.join(ARMS)}; or `rest`: those not yet run on this host")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for the whole call: an arm that cannot finish in what is left is not started")
    p.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE, help="the CPU reference JSON")
    p.add_argument("--fresh", action="store_true", help="forget the arm results merged on this host before")
    p.add_argument("--cpu-reference", type=Path, metavar="JSON",
                   help="instead: compute the CPU reference perplexities here and write them to JSON")
    p.add_argument("--runs", default=",".join(PPL_RUNS), help="with --cpu-reference: which runs")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.cpu_reference is None:
        if args.out is None or args.models_dir is None:
            p.error("--models-dir and --out are required (or --cpu-reference JSON)")
        args.arm_list = [a for a in args.arms.split(",") if a]
        bad = [a for a in args.arm_list if a not in ARMS] if args.arm_list != ["rest"] else []
        if bad or not args.arm_list:
            p.error(f"unknown --arms {bad}: known {', '.join(ARMS)}")
        if args.budget <= 0:
            p.error("--budget must be positive")
    else:
        args.run_list = [r for r in args.runs.split(",") if r]
        bad = [r for r in args.run_list if r not in PPL_RUNS]
        if bad or not args.run_list:
            p.error(f"unknown --runs {bad}: known {', '.join(PPL_RUNS)}")
    if args.models_dir is None:
        from ..quantize.models import cache_dir
        args.models_dir = cache_dir()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models_dir = args.models_dir.resolve()
    # load_text finds (and sha-checks) text/NAME.txt there. Restored on return: tests call
    # main() in-process, and a leaked value sent later tests to a fake cache (CI, 2026-11-23).
    old = envs.explicit("VLLM_MIXPREC_CACHE")
    os.environ["VLLM_MIXPREC_CACHE"] = str(models_dir)
    try:
        return _run(args, argv, models_dir)
    finally:
        if old is None:
            os.environ.pop("VLLM_MIXPREC_CACHE", None)
        else:
            os.environ["VLLM_MIXPREC_CACHE"] = old


def _run(args, argv: list[str] | None, models_dir: Path) -> int:
    if args.cpu_reference is not None:
        command = "python3 scripts/real_model_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
        cpu_reference(models_dir, args.cpu_reference, args.run_list, command)
        return 0
    t_start = time.time()
    deadline = t_start + args.budget
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "real_model_check.log", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    if not args.reference.is_file():
        log(f"FAIL: no CPU reference at {args.reference}")
        return 1
    reference = json.loads(args.reference.read_text())
    store = models_dir / ".results" / "real_model_check.json"
    merged = {} if args.fresh or not store.is_file() else json.loads(store.read_text()).get("arms", {})
    for m in sorted({ARMS[n].model for n in ARMS} if args.arm_list == ["rest"]
                    else {ARMS[n].model for n in args.arm_list}):
        try:
            ensure_derived(models_dir, m, log)
        except Exception as e:  # noqa: BLE001 - the other arms still run; this one is refused below
            log(f"FAIL: {m} could not be made: {type(e).__name__}: {e}")
    if args.arm_list == ["rest"]:
        here = {m for m, rel in MODELS.items() if (models_dir / rel / "config.json").is_file()}
        args.arm_list = [n for n in ARMS if n not in merged and ARMS[n].model in here]
        log(f"arms not yet run on this host: {', '.join(args.arm_list) or 'none'}"
            + "".join(f" (no {m} here)" for m in sorted(set(MODELS) - here)))
    problems = check_inputs(models_dir, reference, args.arm_list)
    if problems:
        for msg in problems:
            log(f"FAIL: {msg}")
        return 1
    windows = {}
    for name in args.arm_list:
        arm = ARMS[name]
        if arm.ppl and arm.ppl not in windows:
            folder = models_dir / MODELS[arm.model]
            ws = {t: token_windows(folder, t) for t in TEXTS}
            cpu = reference["runs"].get(arm.ppl, {}).get("texts", {})
            for t, w in ws.items():
                if t in cpu and ids_sha256(w) != cpu[t]["ids_sha256"]:
                    log(f"FAIL: the {t} token ids of {arm.ppl} differ from the ones the CPU reference scored "
                        "(another tokenizer version?)")
                    return 1
            windows[arm.ppl] = ws
    skipped = []
    for name in args.arm_list:
        arm = ARMS[name]
        left = deadline - time.time()
        if left < arm.est_s:
            log(f"{name}: not started, {left:.0f} s left of --budget and it needs ~{arm.est_s:.0f} s")
            skipped.append(name)
            continue
        folder = models_dir / MODELS[arm.model]
        if arm.kv_none_copy:
            folder = kv_none_copy(folder, KV_NONE_DIR / f"{folder.name}-kvnone")
        log(f"{name}: vllm serve {folder} {' '.join(arm.cmd_flags())}")
        res = run_arm(arm, folder, out, windows.get(arm.ppl, {}) if arm.ppl else {}, deadline, log)
        res["date"] = datetime.datetime.now().isoformat(timespec="seconds")
        merged[name] = res
        store.parent.mkdir(parents=True, exist_ok=True)
        store.write_text(json.dumps({"arms": merged}, indent=1) + "\n")
        log(f"{name}: {'ERROR ' + res['error'] if 'error' in res else 'done'} in {res['wall_s']} s")
    ran = [n for n in args.arm_list if n not in skipped]
    missing = [n for n in ARMS if n not in merged]
    v_all = verdict(merged, reference, [n for n in ARMS if n in merged])
    v = verdict(merged, reference, ran) if ran else v_all  # nothing ran: say where the whole check stands
    for line in report_lines(v, merged):
        log(line)
    status = call_status(v["pass"], bool(skipped or (not ran and missing)))
    summary = {"status": status, "arms_this_call": ran, "skipped": skipped, "seconds": round(time.time() - t_start, 1),
               "verdict": v, "all_arms_on_this_host": {"status": call_status(v_all["pass"], bool(missing)),
                                                        "missing": missing, "verdict": v_all},
               "reference": {"path": str(args.reference), "command": reference.get("command")},
               "criteria": {"greedy_min_agree": MIN_AGREE, "greedy_tokens": GREEDY_TOKENS, "ppl_rtol": PPL_RTOL},
               "arms": merged}
    (out / "real_model_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"REAL MODEL CHECK {status} (this call: {', '.join(ran) or 'nothing'}); all arms on this host: "
        f"{summary['all_arms_on_this_host']['status']}" + (f", not run yet: {', '.join(missing)}" if missing else ""))
    return {"PASS": 0, "FAIL": 1, "INCOMPLETE": 3}[status]
