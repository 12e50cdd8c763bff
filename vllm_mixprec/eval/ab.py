"""A/B harness (issue #6): the same vLLM workloads on bf16, GPTQ-Marlin, GPTQ-Machete, FP8 and mixprec.

  vllm-mixprec ab --out OUT [--arms bf16,marlin,...] [--workloads throughput,serve,longctx] [--layers 32]
  python benchmarks/ab.py ...                      # the same program
  vllm-mixprec ab --replot OUT                     # table and PNGs from OUT/ab.jsonl (no GPU needed)

Checkpoints of Llama-3-8B shape with random weights are built first, in a child process, under
--work (vllm_mixprec/eval/synthetic.py): bf16, GPTQ W4A16 g128, mixprec W4A8 and its KV4 variant.
Arms (docs/AB.md says what each one measures):

  bf16      the bf16 checkpoint, vLLM defaults (FlashAttention-3, bf16 KV)
  marlin    the GPTQ checkpoint with --linear-backend marlin (MarlinLinearKernel)
  machete   the GPTQ checkpoint with vLLM's own choice: MacheteLinearKernel on sm_90
  fp8       the bf16 checkpoint with --quantization fp8 (W8A8, weights quantized at load)
  w4a8      the mixprec checkpoint, --quantization mixprec, bf16 KV
  w4a8kv4   the mixprec KV4 checkpoint, + --kv-cache-dtype int4_per_token_head --attention-backend CUSTOM
  marlin-int8 (only when asked for) Marlin's own W4A8, VLLM_MARLIN_INPUT_DTYPE=int8

Workloads, each in child processes (vLLM spawns; this process never touches CUDA):

  throughput  `vllm bench throughput`, random dataset, 1024 in / 512 out, --num-prompts at once
  serve       `vllm serve` on 127.0.0.1 and `vllm bench serve` (random dataset, --ignore-eos,
              --save-result --save-detailed) at each --concurrency: TTFT, TPOT, ITL, throughput
  longctx     shared/baselines/kv_baseline.py's long-context run (vllm_mixprec/eval/longctx.py)

Every finished (arm, workload[, concurrency]) is appended to OUT/ab.jsonl at once (and copied to
--mirror), so a run killed at a time limit keeps what it finished; --resume skips what is done;
--budget stops starting work that cannot finish in time. The end prints the table (and the
issue's targets) and writes OUT/ab.json; --plot also draws the PNGs when matplotlib is present.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from . import ab_report as R
from . import serve as S
from . import synthetic as syn

WORKLOADS = ("throughput", "serve", "longctx")
LONGCTX_CLI = (sys.executable, "-m", "vllm_mixprec.eval.longctx")
SYNTHETIC_CLI = (sys.executable, "-m", "vllm_mixprec.eval.synthetic")
DEFAULT_CONCURRENCY = (1, 8, 32, 128, 256)
PIDFILE = "ab.pids"


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    ckpt: str  # synthetic checkpoint kind
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kernel: str | None = None  # the MPLinearKernel vLLM must log choosing ("Using X for ...")
    attention_backend: str | None = None  # the backend vLLM must log using
    what: str = ""


def _kv4_flags() -> tuple[str, ...]:
    # the flags quant_methods/kv_cache.required_flags("kv4") names (a test keeps them equal); built
    # from formats here so that this process does not import vLLM
    from .. import formats as F
    return ("--kv-cache-dtype", F.KV_CARRIER_DTYPE["kv4"], "--attention-backend", "CUSTOM")


def _w4a8kv4_with(suffix: str, env_name: str, env_value: str, what: str) -> Arm:
    """w4a8kv4 with one environment switch set: what one of our defaults is worth."""
    return Arm(f"w4a8kv4-{suffix}", "mixprec-kv4", ("--quantization", "mixprec", *_kv4_flags()),
               ((env_name, env_value),), attention_backend="CUSTOM", what=what)


ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("bf16", "bf16", what="bf16 weights and KV cache, vLLM defaults (FlashAttention-3)"),
    Arm("marlin", "gptq", ("--linear-backend", "marlin"), kernel="MarlinLinearKernel",
        what="GPTQ W4A16 g128, Marlin forced with --linear-backend marlin"),
    Arm("machete", "gptq", kernel="MacheteLinearKernel",
        what="GPTQ W4A16 g128, vLLM's default kernel choice (Machete on sm_90)"),
    Arm("fp8", "bf16", ("--quantization", "fp8"), what="FP8 W8A8, bf16 checkpoint quantized at load"),
    Arm("w4a8", "mixprec", ("--quantization", "mixprec"), what="mixprec W4A8, bf16 KV cache"),
    Arm("w4a8kv4", "mixprec-kv4", ("--quantization", "mixprec", *_kv4_flags()), attention_backend="CUSTOM",
        what="mixprec W4A8 + INT4 KV cache through the CUSTOM backend"),
    Arm("marlin-int8", "gptq", ("--linear-backend", "marlin"), (("VLLM_MARLIN_INPUT_DTYPE", "int8"),),
        kernel="MarlinLinearKernel", what="GPTQ through Marlin's own W4A8 (int8 activations)"),
    # what each of our defaults is worth, against w4a8kv4
    _w4a8kv4_with("unfused", "MIXPREC_FUSE_ACT_QUANT", "0",
        what="w4a8kv4 with the separate activation-quantize kernel (no Inductor fusion)"),
    _w4a8kv4_with("siluquant", "MIXPREC_FUSE_SILU_QUANT", "1",
        what="w4a8kv4 whose down projection takes mixprec::silu_mul_quantize_act in place of "
             "Inductor's SiLU-and-mul + quantize kernel (compile_passes.py)"),
    _w4a8kv4_with("inductorquant", "MIXPREC_DECODE_QUANT_OPS", "0",
        what="w4a8kv4 whose decode graphs (batches of at most 64 tokens) keep Inductor's fused "
             "quantizers instead of mixprec::quantize_act and mixprec::add_rms_norm_quantize_act "
             "(compile_passes.DecodeQuantOps): what the decode ops are worth served"),
    _w4a8kv4_with("siluop", "MIXPREC_DECODE_SILU_OP", "1",
        what="w4a8kv4 whose decode graphs take mixprec::silu_mul_quantize_act (one csrc kernel) in "
             "place of Inductor's SiLU-and-mul + mixprec::quantize_act before the down projection "
             "(compile_passes.DecodeQuantOps): what the SiLU op is worth served"),
    _w4a8kv4_with("noquantpdl", "MIXPREC_QUANT_OPS_PDL", "0",
        what="w4a8kv4 whose quantizer ops are plain launches, started only once the decode GEMM "
             "before them has ended (not programmatic dependents of it): what quant_ops_pdl is "
             "worth served"),
    _w4a8kv4_with("naturalorder", "MIXPREC_X_WGMMA_ORDER", "0",
        what="w4a8kv4 whose compiled graphs quantize every layer's activations in the natural k "
             "order (compile_passes.WgmmaActOrder off): what the wgmma order is worth served"),
    _w4a8kv4_with("inputorder", "MIXPREC_X_WGMMA_ORDER", "input",
        what="w4a8kv4 with Inductor's realize_reads_threshold left at its default, so that the QKV's "
             "quantizer is split from the second add + RMSNorm (compile_passes.py)"),
    _w4a8kv4_with("codesorder", "MIXPREC_X_WGMMA_ORDER", "codes",
        what="w4a8kv4 whose compiled graphs past 64 tokens permute the quantizer's codes, on the "
             "layers of compile_passes.wgmma_order_pays (the default before session 73)"),
    _w4a8kv4_with("cachedprefill", "MIXPREC_ATTN_PREFILL_EXACT", "0",
        what="w4a8kv4 whose prefill reads the chunk's own keys back from the KV4 pages"),
    _w4a8kv4_with("tritonchunk", "MIXPREC_ATTN_CHUNK", "triton",
        what="w4a8kv4 whose exact prefill attends the chunk in our Triton kernel, not FlashAttention"),
    _w4a8kv4_with("pdl", "MIXPREC_ATTN_PDL", "1",
        what="w4a8kv4 with the decode finish kernel as a programmatic dependent launch (sm_90+)"),
    _w4a8kv4_with("tailprog", "MIXPREC_ATTN_TAIL", "program",
        what="w4a8kv4 whose decode attends the residual tail in a program of its own, beside "
             "the page splits"),
    _w4a8kv4_with("mergekernel", "MIXPREC_ATTN_MERGE", "kernel",
        what="w4a8kv4 whose batch-1 decode merges its split partials in the finish kernel "
             "(the default before 2026-11-26), not in the last page program"),
    _w4a8kv4_with("mergectx", "MIXPREC_ATTN_CONTEXT_TOKENS", "0",
        what="w4a8kv4 without the 16-bit context workspace: our Triton kernel merges a chunk's "
             "cached context into FlashAttention's output (session 8's path)"),
)}
DEFAULT_ARMS = ("bf16", "marlin", "machete", "fp8", "w4a8", "w4a8kv4")


@dataclasses.dataclass
class Options:
    input_len: int = 1024
    output_len: int = 512
    num_prompts: int = 1000
    warmups: int = 8
    max_model_len: int = 2048
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    serve_waves: int = 2  # prompts per concurrency level = max(serve_min_prompts, waves * c)
    serve_min_prompts: int = 8
    long_batch: int = 64
    long_prompt: int = 8192
    long_output: int = 256
    vllm_args: tuple[str, ...] = ()

    def serve_prompts(self, c: int) -> int:
        return max(self.serve_min_prompts, self.serve_waves * c)


# --- command lines -----------------------------------------------------------------------------

def throughput_cmd(arm: Arm, ckpt: str, o: Options, out_json: str) -> list[str]:
    return [*S.VLLM_CLI, "bench", "throughput", "--model", ckpt, "--dataset-name", "random",
            "--random-input-len", str(o.input_len), "--random-output-len", str(o.output_len),
            "--random-range-ratio", "0", "--num-prompts", str(o.num_prompts), "--num-warmups", str(o.warmups),
            "--max-model-len", str(o.max_model_len), "--no-enable-prefix-caching", "--output-json", out_json,
            *arm.flags, *o.vllm_args]


def server_cmd(arm: Arm, ckpt: str, o: Options, port: int) -> list[str]:
    return S.serve_cmd(ckpt, port, ["--max-model-len", str(o.max_model_len), "--no-enable-prefix-caching",
                                    *arm.flags, *o.vllm_args])


def bench_serve_cmd(ckpt: str, o: Options, port: int, c: int, result_dir: str, result_file: str,
                    warmups: int = 0) -> list[str]:
    return [*S.VLLM_CLI, "bench", "serve", "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port),
            "--model", ckpt, "--dataset-name", "random", "--random-input-len", str(o.input_len),
            "--random-output-len", str(o.output_len), "--random-range-ratio", "0", "--ignore-eos",
            "--num-prompts", str(o.serve_prompts(c)), "--max-concurrency", str(c), "--request-rate", "inf",
            "--num-warmups", str(warmups), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--seed", "0", "--disable-tqdm", "--save-result",
            "--save-detailed", "--result-dir", result_dir, "--result-filename", result_file]


def longctx_cmd(arm: Arm, ckpt: str, o: Options, out_json: str) -> list[str]:
    return [*LONGCTX_CLI, "--model", ckpt, "--out-json", out_json,
            "--batch", str(o.long_batch), "--prompt-len", str(o.long_prompt), "--output-len", str(o.long_output),
            *arm.flags, *o.vllm_args]


def show(cmd: list[str]) -> str:
    """A command line as a person would type it (`vllm bench ...`, `python3 -m ...`)."""
    if tuple(cmd[:len(S.VLLM_CLI)]) == S.VLLM_CLI:
        return "vllm " + shlex.join(cmd[len(S.VLLM_CLI):])
    if cmd and cmd[0] == sys.executable:
        return "python3 " + shlex.join(cmd[1:])
    return shlex.join(cmd)


# --- parsing what the children wrote -----------------------------------------------------------

def parse_throughput(out_json: str, log_text: str) -> dict:
    import re

    r = json.loads(Path(out_json).read_text())
    m = re.search(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s", log_text)
    out = {k: r[k] for k in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
                             "tokens_per_second") if k in r}
    if m:
        out["output_tokens_per_second"] = float(m.group(3))
    return out


SERVE_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
              "request_throughput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
              "max_concurrent_requests")


def parse_bench_serve(result_path: str) -> tuple[dict, dict]:
    """(metrics, per-request samples in ms) from `vllm bench serve --save-result --save-detailed`.

    The raw file is rewritten without the generated texts and inter-token latencies (megabytes);
    TPOT per request is vLLM's definition, (latency - TTFT) / (output tokens - 1).
    """
    r = json.loads(Path(result_path).read_text())
    metrics = {k: r[k] for k in SERVE_KEYS if k in r}
    metrics.update({k: v for k, v in r.items() if k.endswith("_ms") and isinstance(v, (int, float))})
    ttfts, itls, outs = r.get("ttfts") or [], r.get("itls") or [], r.get("output_lens") or []
    samples = {"ttft_ms": [], "tpot_ms": []}
    for i, ttft in enumerate(ttfts):
        if ttft is None or not ttft > 0:
            continue  # a failed request
        samples["ttft_ms"].append(round(1000 * ttft, 3))
        if i < len(outs) and i < len(itls) and outs[i] and outs[i] > 1:
            samples["tpot_ms"].append(round(1000 * sum(itls[i]) / (outs[i] - 1), 4))
    for k in ("generated_texts", "itls", "start_times"):
        r.pop(k, None)
    r["errors"] = [e for e in r.get("errors", []) if e]
    Path(result_path).write_text(json.dumps(r) + "\n")
    return metrics, samples


# --- results: one JSON line per finished (arm, workload[, concurrency]) -----------------------

def entry_key(model: str, arm: str, workload: str, concurrency: int | None = None) -> str:
    return f"{model}|{arm}|{workload}|{'' if concurrency is None else concurrency}"


class Results:
    """OUT/ab.jsonl, appended line by line; the last line of a key is the one that counts."""

    def __init__(self, out: Path, mirror: Path | None = None):
        self.path = out / "ab.jsonl"
        self.out, self.mirror = out, mirror
        self.entries = R.load_jsonl(self.path)

    def latest(self) -> dict[str, dict]:
        return R.latest(self.entries)

    def done(self, key: str, skip_failed: bool = False) -> bool:
        e = self.latest().get(key)
        return e is not None and (e["status"] == "ok" or skip_failed)

    def merge(self, prior: Path) -> int:
        have = self.latest()
        new = [e for e in R.load_jsonl(prior) if e.get("key") not in have]
        for e in R.latest(new).values():
            self.append(e, mirror=False)
        return len(new)

    def append(self, entry: dict, mirror: bool = True) -> None:
        cut = self.path.exists() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n")
        with open(self.path, "a") as f:
            f.write(("\n" if cut else "") + json.dumps(entry) + "\n")  # after a line a kill cut short
            f.flush()
            os.fsync(f.fileno())
        self.entries.append(entry)
        if mirror:
            self.sync_mirror()

    def sync_mirror(self) -> None:
        """Copy ab.jsonl and one tarball of logs and raw results to --mirror (few files: the
        device tool brings back at most 8)."""
        if self.mirror is None:
            return
        self.mirror.mkdir(parents=True, exist_ok=True)
        for name in ("ab.jsonl", "ab.json"):
            if (self.out / name).exists():
                (self.mirror / name).write_bytes((self.out / name).read_bytes())
        tmp = self.mirror / ".ab-logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for sub in ("logs", "raw"):
                if (self.out / sub).is_dir():
                    tar.add(self.out / sub, arcname=sub)
        tmp.rename(self.mirror / "ab-logs.tar.gz")


# --- running ------------------------------------------------------------------------------------

class Interrupted(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    raise Interrupted(f"signal {signum}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_name() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _group_cmdlines(pgid: int) -> list[bytes]:
    """Command lines of the live processes of group `pgid` (from /proc; empty elsewhere)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # after "pid (comm)": state, ppid, pgrp
                out.append((stat.parent / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return out


def _parsed(parse, *args):
    """(parse(*args), None), or (None, why) when the child's output cannot be read."""
    try:
        return parse(*args), None
    except Exception as e:  # noqa: BLE001 - one bad result must not end the session
        return None, f"cannot read the result: {type(e).__name__}: {e}"


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Harness:
    def __init__(self, args, o: Options):
        self.args, self.o = args, o
        self.out = Path(args.out)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.out / "raw").mkdir(parents=True, exist_ok=True)
        self.results = Results(self.out, Path(args.mirror) if args.mirror else None)
        self.shape = dataclasses.replace(syn.LLAMA3_8B, layers=args.layers)
        self.model = self.shape.tag
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget if args.budget else None
        self.device = None
        self.failed = 0
        self.skipped = False

    # budget
    def time_left(self) -> float:
        lim = float(self.args.time_limit)
        if self.deadline is not None:
            lim = min(lim, self.deadline - time.time() - 20)  # 20 s to stop and write up
        return lim

    def limit(self) -> float | None:
        """Seconds the next run may take, or None when too little budget is left to start it."""
        lim = self.time_left()
        return lim if lim >= self.args.min_run else None

    # process bookkeeping: a killed harness leaves a pid file; the next one stops those groups
    def _pids(self, add: int | None = None, remove: int | None = None) -> None:
        p = self.out / PIDFILE
        cur = set(int(x) for x in p.read_text().split()) if p.exists() else set()
        if add:
            cur.add(add)
        if remove:
            cur.discard(remove)
        p.write_text("".join(f"{x}\n" for x in sorted(cur)))

    def reap_stale(self) -> None:
        p = self.out / PIDFILE
        if not p.exists():
            return
        for pgid in (int(x) for x in p.read_text().split()):
            if any(b"vllm" in cmd for cmd in _group_cmdlines(pgid)):
                print(f"[ab] stopping process group {pgid} left by an earlier run", flush=True)
                S.stop_group(pgid)
        p.unlink()

    def run_child(self, cmd, log: Path, timeout: float, env: dict | None = None):
        started = []
        try:
            return S.run_bounded(cmd, str(log), timeout, env,
                                 on_start=lambda p: (started.append(p.pid), self._pids(add=p.pid)))
        finally:
            for pid in started:
                self._pids(remove=pid)

    def entry(self, arm: Arm, workload: str, ckpt: str, status: str, concurrency: int | None = None, **kw) -> dict:
        e = {"key": entry_key(self.model, arm.name, workload, concurrency), "model": self.model,
             "arm": arm.name, "workload": workload, "concurrency": concurrency, "status": status,
             "time": datetime.datetime.now().isoformat(timespec="seconds"), "device": self.device,
             "ckpt": ckpt, "flags": list(arm.flags), "env": dict(arm.env),
             "settings": {"input_len": self.o.input_len, "output_len": self.o.output_len,
                          "num_prompts": self.o.num_prompts, "vllm_args": list(self.o.vllm_args)}}
        e.update(kw)
        facts = e.get("facts") or {}
        warn = []
        if arm.kernel and facts and not any(k.startswith(arm.kernel + " ") for k in facts.get("kernels", [])):
            warn.append(f"expected {arm.kernel} in the log, saw {facts.get('kernels')}")
        if arm.attention_backend and facts and facts.get("attention_backend") != arm.attention_backend:
            warn.append(f"expected attention backend {arm.attention_backend}, saw {facts.get('attention_backend')}")
        mk = facts.get("mixprec_kernels")
        if arm.ckpt.startswith("mixprec") and mk and "csrc ops loaded" not in mk:
            warn.append(f"mixprec ran without its csrc kernels ({mk}): build them first (gpu_check.sh build)")
        if warn:
            e["warnings"] = warn
        if status != "ok":
            self.failed += 1
        return e

    def report_entry(self, e: dict) -> None:
        m = e.get("metrics") or {}
        brief = {k: round(v, 2) for k, v in m.items() if isinstance(v, float) and k in (
            "output_tokens_per_second", "output_throughput", "median_ttft_ms", "median_tpot_ms",
            "out_tok_per_s")}
        print(f"[ab] {e['arm']:12s} {e['workload']:10s} c={e['concurrency']} {e['status']} "
              f"{e.get('error', '')}{brief} {e.get('warnings', '')}", flush=True)
        self.results.append(e)

    def build_checkpoints(self, arms: list[Arm]) -> dict[str, str]:
        kinds = sorted({a.ckpt for a in arms}, key=syn.CKPT_KINDS.index)
        dirs = {k: str(syn.ckpt_dir(self.args.work, self.shape, k, self.args.mixprec_group
                                    if k.startswith("mixprec") else None)) for k in kinds}
        if self.args.no_build:
            missing = [d for d in dirs.values() if not (Path(d) / "config.json").exists()]
            if missing:
                raise SystemExit(f"--no-build: missing checkpoint(s) {missing}")
            return dirs
        lim = self.time_left()  # a current checkpoint is only checked: seconds
        if lim < 30:
            raise SystemExit("no budget left to build the checkpoints")
        cmd = [*SYNTHETIC_CLI, "--work", self.args.work, "--layers",
               str(self.args.layers), "--ckpts", ",".join(kinds), "--mixprec-group", str(self.args.mixprec_group),
               "--device", self.args.gen_device]
        log = self.out / "logs" / f"{self.model}-ckpt.log"
        print(f"[ab] checkpoints: {show(cmd)}", flush=True)
        rc, secs = self.run_child(cmd, log, lim)
        print(_tail(log, 2000), flush=True)
        if rc != 0:
            raise SystemExit(f"checkpoint build failed ({'timeout' if rc is None else f'exit {rc}'}); see {log}")
        print(f"[ab] checkpoints ready in {secs:.0f} s", flush=True)
        return dirs

    # workloads
    def run_throughput(self, arm: Arm, ckpt: str, lim: float) -> None:
        self._run_json_workload(arm, ckpt, lim, "throughput", throughput_cmd, parse_throughput)

    def run_longctx(self, arm: Arm, ckpt: str, lim: float) -> None:
        self._run_json_workload(arm, ckpt, lim, "longctx", longctx_cmd,
                                lambda path, _text: json.loads(Path(path).read_text()))

    def _run_json_workload(self, arm: Arm, ckpt: str, lim: float, workload: str, make_cmd, parse) -> None:
        """One child that writes a JSON result: run it, parse(json_path, log_text), record the entry."""
        name = f"{self.model}-{arm.name}-{workload}"
        log, out_json = self.out / "logs" / f"{name}.log", self.out / "raw" / f"{name}.json"
        out_json.unlink(missing_ok=True)
        cmd = make_cmd(arm, ckpt, self.o, str(out_json))
        rc, secs = self.run_child(cmd, log, lim, dict(arm.env))
        text = _tail(log, 10**7)
        kw = dict(cmd=show(cmd), wall_s=round(secs, 1), facts=S.log_facts(text), log=f"logs/{log.name}")
        metrics, err = _parsed(parse, str(out_json), text) if rc == 0 and out_json.exists() else (None, None)
        if metrics is not None:
            e = self.entry(arm, workload, ckpt, "ok", metrics=metrics, **kw)
        elif err:
            e = self.entry(arm, workload, ckpt, "failed", error=err, log_tail=_tail(log), **kw)
        else:
            e = self.entry(arm, workload, ckpt, "timeout" if rc is None else "failed",
                           error=f"timeout after {lim:.0f} s" if rc is None else f"exit {rc}",
                           log_tail=_tail(log), **kw)
        self.report_entry(e)

    def run_serve(self, arm: Arm, ckpt: str, lim: float, todo: list[int]) -> None:
        name = f"{self.model}-{arm.name}-serve"
        log = self.out / "logs" / f"{name}.log"
        port = free_port()
        cmd = server_cmd(arm, ckpt, self.o, port)
        t0 = time.time()
        proc = S.start(cmd, str(log), dict(arm.env))
        self._pids(add=proc.pid)
        base = dict(server_cmd=show(cmd), log=f"logs/{log.name}")
        try:
            err = S.wait_healthy(proc, f"http://127.0.0.1:{port}", min(lim, self.args.startup_timeout))
            startup = round(time.time() - t0, 1)
            facts = S.log_facts(_tail(log, 10**7))
            if err:
                for c in todo:
                    self.report_entry(self.entry(arm, "serve", ckpt, "failed", c, error=err, startup_s=startup,
                                                 facts=facts, log_tail=_tail(log), **base))
                return
            print(f"[ab] {arm.name}: server up in {startup:.0f} s ({facts.get('kv_cache_line')})", flush=True)
            for c in todo:
                left = lim - (time.time() - t0)
                if left < 15:
                    self.report_entry(self.entry(arm, "serve", ckpt, "timeout", c, startup_s=startup, facts=facts,
                                                 error=f"arm time limit ({lim:.0f} s) reached before this level",
                                                 **base))
                    continue
                fname = f"{name}-c{c}.json"
                (self.out / "raw" / fname).unlink(missing_ok=True)
                # the server's first requests warm it up (CUDA graphs are captured at start-up)
                bcmd = bench_serve_cmd(ckpt, self.o, port, c, str(self.out / "raw"), fname,
                                       warmups=2 if c == todo[0] else 0)
                blog = self.out / "logs" / f"{name}-c{c}.log"
                rc, secs = self.run_child(bcmd, blog, left)
                kw = dict(cmd=show(bcmd), wall_s=round(secs, 1), startup_s=startup, facts=facts,
                          bench_log=f"logs/{blog.name}", **base)
                got, err = _parsed(parse_bench_serve, str(self.out / "raw" / fname)) \
                    if rc == 0 and (self.out / "raw" / fname).exists() else (None, None)
                if got is not None:
                    metrics, samples = got
                    status = "ok" if metrics.get("completed") and not metrics.get("failed") else "failed"
                    extra = {} if status == "ok" else {"error": f"{metrics.get('failed')} failed requests"}
                    e = self.entry(arm, "serve", ckpt, status, c, metrics=metrics, samples=samples, **extra, **kw)
                elif err:
                    e = self.entry(arm, "serve", ckpt, "failed", c, error=err, log_tail=_tail(blog), **kw)
                else:
                    e = self.entry(arm, "serve", ckpt, "timeout" if rc is None else "failed", c,
                                   error=f"timeout after {left:.0f} s" if rc is None else f"exit {rc}",
                                   log_tail=_tail(blog), server_log_tail=_tail(log, 2000), **kw)
                self.report_entry(e)
                if proc.poll() is not None:
                    print(f"[ab] {arm.name}: the server exited ({proc.returncode})", flush=True)
                    break
        finally:
            S.stop(proc)
            self._pids(remove=proc.pid)

    def run(self, arms: list[Arm], workloads: list[str]) -> int:
        self.reap_stale()
        if self.args.prior:
            print(f"[ab] merged {self.results.merge(Path(self.args.prior))} entries from {self.args.prior}")
        self.device = device_name()
        print(f"[ab] {self.model} on {self.device}; arms {[a.name for a in arms]}; workloads {workloads}; "
              f"results -> {self.results.path}", flush=True)
        skip = self.args.skip_failed

        def done(arm, wl, c=None):
            return self.args.resume and self.results.done(entry_key(self.model, arm.name, wl, c), skip)

        pending = [(a, wl) for wl in workloads for a in arms
                   if not (all(done(a, wl, c) for c in self.o.concurrency) if wl == "serve" else done(a, wl))]
        if not pending:
            print("[ab] nothing to do (everything asked for is in the results; drop --resume to rerun)")
            return 0
        dirs = self.build_checkpoints(sorted({a for a, _ in pending}, key=lambda a: a.name))
        for arm, wl in pending:
            lim = self.limit()
            if lim is None:
                print(f"[ab] budget exhausted: {arm.name}/{wl} and what follows not started "
                      "(run again with --resume)", flush=True)
                self.skipped = True
                break
            ckpt = dirs[arm.ckpt]
            if wl == "throughput":
                self.run_throughput(arm, ckpt, lim)
            elif wl == "longctx":
                self.run_longctx(arm, ckpt, lim)
            else:
                self.run_serve(arm, ckpt, lim, [c for c in self.o.concurrency if not done(arm, wl, c)])
        return 1 if self.failed else (3 if self.skipped else 0)


# --- command line -------------------------------------------------------------------------------

def _csv(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-mixprec ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="arms: " + "; ".join(f"{a.name}: {a.what}" for a in ARMS.values()))
    p.add_argument("--out", default="out/ab", help="results: ab.jsonl, ab.json, logs/, raw/ (default out/ab)")
    p.add_argument("--work", default="/tmp/mixprec-ab", help="checkpoints (tens of GB at 32 layers)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma list of {sorted(ARMS)}, or 'all'")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {WORKLOADS}")
    p.add_argument("--layers", type=int, default=syn.LLAMA3_8B.layers, help="decoder layers (Llama-3-8B: 32)")
    p.add_argument("--num-prompts", type=int, default=1000, help="throughput workload prompts")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--warmups", type=int, default=8, help="throughput warm-up prompts")
    p.add_argument("--concurrency", default=",".join(map(str, DEFAULT_CONCURRENCY)), help="serve sweep")
    p.add_argument("--serve-waves", type=int, default=2, help="serve prompts per level = max(min, waves * c)")
    p.add_argument("--serve-min-prompts", type=int, default=8)
    p.add_argument("--long-batch", type=int, default=64, help="longctx requests (kv_baseline.py: 64)")
    p.add_argument("--long-prompt", type=int, default=8192, help="longctx prompt tokens (kv_baseline.py: 8192)")
    p.add_argument("--long-output", type=int, default=256, help="longctx output tokens (kv_baseline.py: 256)")
    p.add_argument("--vllm-args", default="",
                   help="extra flags for every vLLM engine, given with '=': --vllm-args='--max-num-seqs 256'")
    p.add_argument("--time-limit", type=float, default=540, help="seconds per arm and workload (serve: the sweep)")
    p.add_argument("--budget", type=float, default=0, help="seconds for this whole call; 0 = none")
    p.add_argument("--min-run", type=float, default=270,
                   help="do not start a run with less time than this left (the throughput workload on "
                        "32 layers took 208-257 s on an H200 with its compile, 2026-12-04; runs started "
                        "with 233 and 245 s left timed out)")
    p.add_argument("--startup-timeout", type=float, default=420, help="seconds for `vllm serve` to get healthy")
    p.add_argument("--resume", action="store_true", help="skip what ab.jsonl already has as ok")
    p.add_argument("--skip-failed", action="store_true", help="with --resume: skip failed/timed-out ones too")
    p.add_argument("--prior", help="another ab.jsonl (an earlier host's) merged in first")
    p.add_argument("--mirror", help="copy ab.jsonl, ab.json and a logs tarball here after every result")
    p.add_argument("--no-build", action="store_true", help="use existing checkpoints only")
    p.add_argument("--gen-device", default="auto", help="where random weights are drawn (auto: cuda when present)")
    p.add_argument("--mixprec-group", type=int, default=syn.MIXPREC_GROUP, choices=(64, 128))
    p.add_argument("--plot", action="store_true", help="draw the PNGs at the end (needs matplotlib)")
    p.add_argument("--dry-run", action="store_true", help="print each arm's command lines and exit")
    p.add_argument("--replot", metavar="OUT_DIR", help="table and PNGs from OUT_DIR/ab.jsonl; runs nothing")
    p.add_argument("--aba-report", nargs="+", metavar="OUT_DIR",
                   help="the A-B-A table of these results folders, in the order they ran (gpu_ab.sh aba); "
                        "runs nothing")
    return p


def options_from(args) -> Options:
    return Options(input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                   warmups=args.warmups, max_model_len=max(2048, args.input_len + args.output_len),
                   concurrency=tuple(int(c) for c in _csv(args.concurrency)), serve_waves=args.serve_waves,
                   serve_min_prompts=args.serve_min_prompts, long_batch=args.long_batch,
                   long_prompt=args.long_prompt, long_output=args.long_output,
                   vllm_args=tuple(shlex.split(args.vllm_args)))


def select_arms(spec: str) -> list[Arm]:
    names = list(ARMS) if spec == "all" else _csv(spec)
    bad = [n for n in names if n not in ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {sorted(ARMS)}")
    return [ARMS[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.aba_report:
        rounds = [R.load_jsonl(Path(d) / "ab.jsonl") for d in args.aba_report]  # [] where none yet
        if not any(rounds):
            raise SystemExit(f"--aba-report: no results in {', '.join(args.aba_report)}")
        print(R.render_aba(R.aba(rounds)))
        for i, (d, entries) in enumerate(zip(args.aba_report, rounds), 1):
            if not entries:
                print(f"round {i} ({d}): no results yet")
        return 0
    if args.replot:
        src = Path(args.replot)
        entries = R.load_jsonl(src if src.is_file() else src / "ab.jsonl")
        if not entries:
            raise SystemExit(f"no results in {src}")
        folder = src.parent if src.is_file() else src
        print(R.render(entries))
        for path in R.plot(entries, folder):
            print("wrote", path)
        return 0
    arms = select_arms(args.arms)
    workloads = _csv(args.workloads)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workload(s) {bad}; choose from {WORKLOADS}")
    o = options_from(args)
    if args.dry_run:
        shape = dataclasses.replace(syn.LLAMA3_8B, layers=args.layers)
        for a in arms:
            group = args.mixprec_group if a.ckpt.startswith("mixprec") else None
            ckpt = str(syn.ckpt_dir(args.work, shape, a.ckpt, group))
            env = " ".join(f"{k}={v}" for k, v in a.env)
            print(f"# {a.name}: {a.what}")
            if "throughput" in workloads:
                print(env, show(throughput_cmd(a, ckpt, o, "OUT.json")))
            if "serve" in workloads:
                print(env, show(server_cmd(a, ckpt, o, 8000)))
                for c in o.concurrency:
                    print("  ", show(bench_serve_cmd(ckpt, o, 8000, c, "DIR", f"c{c}.json",
                                                     2 if c == o.concurrency[0] else 0)))
            if "longctx" in workloads:
                print(env, show(longctx_cmd(a, ckpt, o, "OUT.json")))
        return 0
    h = Harness(args, o)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    rc = 1
    try:
        rc = h.run(arms, workloads)
    except Interrupted as e:
        print(f"[ab] interrupted ({e}); finished results are in {h.results.path}", flush=True)
    finally:
        for s, f in old.items():
            signal.signal(s, f)
        entries = h.results.entries
        if entries:
            print(R.render(entries), flush=True)
            R.write_summary(entries, h.out / "ab.json")
            h.results.sync_mirror()
            if args.plot:
                for path in R.plot(entries, h.out):
                    print("wrote", path)
    return rc
