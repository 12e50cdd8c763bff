"""Bounded child processes for vLLM: `vllm serve` on 127.0.0.1, `vllm bench ...`, engine scripts.

Used by `make demo` on a GPU machine, by scripts/e2e_serve.py on the GPU host, and by the A/B
harness (vllm_mixprec/eval/ab.py). Every child runs in its own process group (vLLM's engine
core and workers join it), so stopping it stops all of them; everything is bounded in time.
The group stays in the caller's session: a job runner that cleans up the session after a
killed call also ends a server we could not stop ourselves.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

VLLM_CLI = (sys.executable, "-m", "vllm.entrypoints.cli.main")
_NEW_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def start(cmd: Sequence[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `cmd` in a new process group, stdout and stderr to `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=None if env is None else {**os.environ, **env}, **_NEW_GROUP)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(pgid: int, grace: float = 30.0, poll=None) -> None:
    """SIGTERM to process group `pgid`, SIGKILL after `grace` s; returns once none of it is left.
    `poll` reaps the group leader when it is our child (a zombie still counts as a member)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t0 = time.time()
        while time.time() - t0 < wait:
            if poll is not None:
                poll()
            if not _group_alive(pgid):
                return
            time.sleep(0.2)


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """Stop a child started by start(), and every process of its group."""
    stop_group(proc.pid, grace, proc.poll)
    proc.poll()


def run_bounded(cmd: Sequence[str], log_path: str, timeout: float, env: dict[str, str] | None = None,
                on_start=None) -> tuple[int | None, float]:
    """Run to completion or until `timeout` s; returns (exit status or None on timeout, seconds)."""
    t0 = time.time()
    proc = start(cmd, log_path, env)
    if on_start is not None:
        on_start(proc)
    try:
        rc = proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        stop(proc)  # also reaps what the child left behind in its group
    return rc, time.time() - t0


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> str | None:
    """None once GET url/health answers; otherwise why not (exited, or not healthy in time)."""
    t0, pause = time.time(), 0.25
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return f"server exited with {proc.returncode}"
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return None
        except OSError:
            time.sleep(pause)
            pause = min(2 * pause, 2.0)
    return f"server not healthy in {timeout:.0f} s"


def serve_cmd(model_dir: str, port: int, extra: Sequence[str]) -> list[str]:
    return [*VLLM_CLI, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), *extra]


def log_facts(log_text: str) -> dict:
    """What a vLLM log says about the run: plugin registered, KV capacity, kernels chosen."""
    import re

    kv = re.search(r"GPU KV cache size: ([\d,]+) tokens", log_text)
    kernels = sorted(set(re.findall(r"(?:Using|Selected) (\w+Kernel\w*) for (\w+)", log_text)))
    backend = re.search(r"Using AttentionBackendEnum\.(\w+) backend", log_text)
    mixprec = re.search(r"vllm_mixprec kernels: ([^\n]+)", log_text)
    # compile_passes' lines: absent when the pass is off, or the graph came from the cache
    silu_quant = "SiLU-and-mul + quantize fused into" in log_text
    order = re.search(r"wgmma k order for batches of more than \d+ tokens \((\d+) GEMMs in the first "
                      r"graph; (\d+) quantizers permute their input\)", log_text)
    reads = re.search(r"realize_reads_threshold is (\d+)", log_text)  # MIXPREC_X_WGMMA_ORDER=input_fused
    return {"plugin_logged": "vllm_mixprec" in log_text and "registered" in log_text,
            "kv_cache_line": kv.group(0) if kv else None,
            "kv_cache_tokens": int(kv.group(1).replace(",", "")) if kv else None,
            "kernels": [f"{k} for {m}" for k, m in kernels],
            "attention_backend": backend.group(1) if backend else None,
            "mixprec_kernels": mixprec.group(1).strip() if mixprec else None,
            "silu_quant_fused": silu_quant,
            # [GEMMs in the wgmma k order, of them with the quantizer's input permuted] in the
            # first graph past 64 tokens: what tells the activation-order modes apart in a log
            "wgmma_order_first_graph": [int(order.group(1)), int(order.group(2))] if order else None,
            "realize_reads_threshold": int(reads.group(1)) if reads else None}


def serve_and_ask(model_dir: str, extra: list[str], log_path: str, port: int,
                  prompt: str = "def fibonacci(n):") -> dict:
    """Serve a checkpoint with `vllm serve` on 127.0.0.1 and ask it for one greedy completion."""
    cmd = serve_cmd(model_dir, port, ["--max-model-len", "2048", "--gpu-memory-utilization", "0.5", *extra])
    t0 = time.time()
    proc = start(cmd, log_path)
    result = {"cmd": " ".join(cmd[2:]), "ok": False}
    try:
        url = f"http://127.0.0.1:{port}"
        err = wait_healthy(proc, url, 300)
        if err:
            result["error"] = err
            return result
        result["startup_s"] = round(time.time() - t0, 1)
        body = json.dumps({"model": model_dir, "prompt": prompt, "max_tokens": 24,
                           "temperature": 0, "logprobs": 1}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        resp = json.load(urllib.request.urlopen(req, timeout=60))
        choice = resp["choices"][0]
        lps = [x for x in choice["logprobs"]["token_logprobs"] if x is not None]
        result.update(ok=True, text=choice["text"], n_tokens=resp["usage"]["completion_tokens"],
                      logprobs_finite=all(abs(x) < float("inf") for x in lps))
    finally:
        stop(proc)
    facts = log_facts(open(log_path).read())
    result["plugin_logged"] = facts["plugin_logged"]
    result["kv_cache_line"] = facts["kv_cache_line"]
    return result
