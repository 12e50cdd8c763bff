"""Load on loopback (issue #7) on the GPU host: `vllm serve` with mixprec W4A8 + KV4 under
256 concurrent streaming requests x 3 rounds (vllm_mixprec/eval/load.py says what is checked).

The checkpoint is scripts/e2e_serve.py's random-weight Llama (E2E_SHAPE, tokenizer trained on
the host, RTN W4A8, kv_scheme kv4); the server runs on 127.0.0.1 with the KV4 flags of the A/B
harness's w4a8kv4 arm. Everything fits --budget seconds (one 10-minute device call):

  python3 scripts/load_serve.py --out $OUT        # or: bash scripts/gpu_check.sh load

Writes $OUT/load.json (the load summary plus the server's facts) and $OUT/serve-load.log.
The parent process never touches CUDA (vLLM spawns). Exit status 0 on PASS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time

from e2e_serve import E2E_SHAPE, export_mixprec, make_bf16_model

from vllm_mixprec.eval import load as L
from vllm_mixprec.eval.ab import ARMS, free_port
from vllm_mixprec.eval.serve import log_facts, serve_cmd, start, stop, wait_healthy

MAX_MODEL_LEN = E2E_SHAPE.max_pos  # 4096; the plan's longest request is checked against it
STARTUP_LIMIT_S = 300  # e2e startups took 100-120 s (torch.compile + CUDA graphs)
REQUEST_TIMEOUT_S = 45.0  # also the bound of each greedy set
STOP_S = 45  # stop(): 30 s SIGTERM grace, then SIGKILL
RESERVE_S = 2 * REQUEST_TIMEOUT_S + L.LoadConfig.settle_s + STOP_S  # what must be left after the rounds
MIN_ROUND_S = 30
MAX_ROUND_S = 120


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    raise Interrupted(f"signal {signum}")  # unwinds to the finally that stops the server


def server_flags(concurrency: int) -> list[str]:
    return [*ARMS["w4a8kv4"].flags, "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(concurrency), "--gpu-memory-utilization", "0.5"]


def build_checkpoint(work: str, ckpt: str) -> None:
    bf16 = os.path.join(work, "bf16")
    export_mixprec(make_bf16_model(bf16), bf16, ckpt, "kv4")


def round_wall_for(remaining_s: float, rounds: int) -> float:
    """What is left after the greedy sets and the stop, shared by the rounds."""
    per_round = min(MAX_ROUND_S, (remaining_s - RESERVE_S) / rounds)
    if per_round < MIN_ROUND_S:
        raise TimeoutError(f"{remaining_s:.0f} s left: less than {MIN_ROUND_S} s per round")
    return per_round


def server_facts(log_path: str) -> dict:
    text = open(log_path, errors="replace").read()
    errors = [ln for ln in text.splitlines() if " ERROR " in ln or ln.startswith("Traceback")]
    return {**log_facts(text), "error_lines": len(errors), "first_errors": errors[:5]}


def serve_and_load(cfg: L.LoadConfig, ckpt: str, port: int, log_path: str, deadline: float) -> dict:
    """Start the server, run the load within the deadline, stop the server."""
    cmd = serve_cmd(ckpt, port, server_flags(cfg.concurrency))
    server: dict = {"cmd": " ".join(cmd[2:])}
    t0 = time.monotonic()
    proc = start(cmd, log_path)
    try:
        remaining = deadline - time.monotonic()
        err = wait_healthy(proc, f"http://127.0.0.1:{port}", min(STARTUP_LIMIT_S, remaining - RESERVE_S))
        if err:
            return {"verdict": "FAIL", "reasons": [f"server: {err}"], "server": server}
        server["startup_s"] = round(time.monotonic() - t0, 1)
        wall = round_wall_for(deadline - time.monotonic(), cfg.rounds)
        summary = L.run_load(dataclasses.replace(cfg, round_wall_s=wall))
        server["alive_after_load"] = proc.poll() is None
    except (TimeoutError, Interrupted) as e:
        summary = {"verdict": "FAIL", "reasons": [f"load not finished: {e}"]}
    finally:
        stop(proc)
    summary["server"] = server
    if server.get("alive_after_load") is False:
        summary["verdict"] = "FAIL"
        summary["reasons"].append(f"server exited during the load with {proc.returncode}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--work", default="/tmp/mixprec-load")
    ap.add_argument("--budget", type=float, default=540, help="seconds for everything")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=256, help="also the requests per round")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.budget
    os.makedirs(args.out, exist_ok=True)
    port, ckpt = free_port(), os.path.join(args.work, "w4a8-kv4")
    cfg = L.LoadConfig(url=f"http://127.0.0.1:{port}", model=ckpt, rounds=args.rounds,
                       requests=args.concurrency, concurrency=args.concurrency, seed=args.seed,
                       request_timeout_s=REQUEST_TIMEOUT_S, round_wall_s=MAX_ROUND_S)
    L.check_fits(cfg, MAX_MODEL_LEN)  # before minutes of building and starting
    build_checkpoint(args.work, ckpt)
    log_path = os.path.join(args.out, "serve-load.log")
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        summary = serve_and_load(cfg, ckpt, port, log_path, deadline)
    finally:
        for s, f in old.items():
            signal.signal(s, f)
    summary["server"].update(server_facts(log_path))
    if "rounds" in summary:
        print(L.format_table(summary))
    else:
        print("LOAD FAIL", json.dumps(summary, indent=1))
    print("wrote", L.write_summary(summary, args.out), flush=True)
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
