"""Serve a checkpoint with `vllm serve` on 127.0.0.1 and ask it for one greedy completion.

Used by `make demo` on a GPU machine and by scripts/e2e_serve.py on the GPU host. The server
runs in its own process session and is always stopped; everything is bounded in time.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def serve_and_ask(model_dir: str, extra: list[str], log_path: str, port: int,
                  prompt: str = "def fibonacci(n):") -> dict:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "2048", "--gpu-memory-utilization", "0.5"] + extra
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    result = {"cmd": " ".join(cmd[2:]), "ok": False}
    try:
        url = f"http://127.0.0.1:{port}"
        while time.time() - t0 < 300:
            if proc.poll() is not None:
                result["error"] = f"server exited with {proc.returncode}"
                return result
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        else:
            result["error"] = "server not healthy in 300 s"
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
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    log_text = open(log_path).read()
    result["plugin_logged"] = "vllm_mixprec" in log_text and "registered" in log_text
    result["kv_cache_line"] = next((l.strip() for l in log_text.splitlines() if "KV cache size" in l), None)
    return result
