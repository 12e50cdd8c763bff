"""Load on loopback (issue #7): many concurrent streaming completions against `vllm serve`.

  python -m vllm_mixprec.eval.load --url http://127.0.0.1:PORT --model NAME --rounds 3 \
      --concurrency 256 --out DIR

Each round sends a seeded plan of streaming `/v1/completions` requests (mixed prompt lengths
and max_tokens, `logprobs: 1`, temperature 0, `ignore_eos`), at most --concurrency at once;
a fraction of them is closed by the client after a few streamed chunks (planned aborts). Every
streamed logprob must be finite, every other request must end with its full token count.
Around the load, a fixed prompt set is asked greedily (non-streaming, one at a time) before
and after: the texts must be identical. GPU memory (nvidia-smi, the server is another
process) is sampled after each round and must stay flat. Writes DIR/load.json and prints a
table; exit status 0 on PASS.

Bounded: loopback hosts only, a per-request timeout, a per-round wall limit, a concurrency
limit and a cap on the total number of requests. scripts/load_serve.py runs it on the GPU host.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")
MAX_TOTAL_REQUESTS = 4096
MAX_CONCURRENCY = 1024
VLLM_NEG_INF = -9999.0  # vLLM writes a -inf logprob as this; NaN and +inf as null
PROMPT_TOKEN_MARGIN = 8  # special tokens the server may add to a prompt
MEM_TOLERANCE_FRACTION = 0.02
MEM_TOLERANCE_MIN_MIB = 256

GREEDY_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "The quick brown fox",
    "for i in range(10):\n    print(",
    "# Parse the command line arguments\n",
    'if __name__ == "__main__":',
    "with open(path) as f:\n    data =",
)
# Python-flavoured words: the e2e tokenizer is trained on the standard library.
_WORDS = ("def", "return", "self", "import", "class", "for", "in", "range", "if", "else", "while",
          "value", "print", "list", "dict", "None", "True", "False", "path", "open", "file", "data",
          "result", "index", "key", "args", "kwargs", "lambda", "yield", "raise", "try", "except")

MemProbe = Callable[[], tuple[int | None, str | None]]


# --- the plan ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LoadConfig:
    url: str
    model: str
    rounds: int = 3
    requests: int = 256  # per round
    concurrency: int = 256
    seed: int = 0
    min_prompt_chars: int = 8
    max_prompt_chars: int = 2048
    max_tokens: int = 256
    abort_fraction: float = 1 / 8
    max_abort_after: int = 8  # chunks
    request_timeout_s: float = 60.0
    round_wall_s: float = 120.0
    greedy_max_tokens: int = 32
    greedy_prompts: tuple[str, ...] = GREEDY_PROMPTS
    # before the greedy set after the load: the server drops the streams we closed, so that
    # the set runs alone as it did before (batch composition can change greedy tokens)
    settle_s: float = 2.0

    def __post_init__(self) -> None:
        loopback_base(self.url)
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency {self.concurrency} not in [1, {MAX_CONCURRENCY}]")
        total = self.rounds * self.requests
        if self.rounds < 1 or self.requests < 1 or total > MAX_TOTAL_REQUESTS:
            raise ValueError(f"{self.rounds} rounds x {self.requests} requests: need >= 1 each and "
                             f"at most {MAX_TOTAL_REQUESTS} in all")
        if not 0 <= self.abort_fraction < 1:
            raise ValueError(f"abort_fraction {self.abort_fraction} not in [0, 1)")
        if not 1 <= self.min_prompt_chars <= self.max_prompt_chars:
            raise ValueError(f"prompt chars [{self.min_prompt_chars}, {self.max_prompt_chars}] is empty")
        if self.max_tokens < 2 or self.max_abort_after < 1:
            raise ValueError("max_tokens must be >= 2 and max_abort_after >= 1 (aborts need room)")
        if self.request_timeout_s <= 0 or self.round_wall_s <= 0 or not 0 <= self.settle_s <= 60:
            raise ValueError("timeouts must be > 0 and settle_s in [0, 60]")


def loopback_base(url: str) -> str:
    """`url` without a trailing slash; ValueError unless it is http:// on a loopback host."""
    parts = urlsplit(url)
    if parts.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"load generator targets {' or '.join(LOOPBACK_HOSTS)} only; "
                         f"refusing host {parts.hostname!r} in {url!r}")
    if parts.scheme != "http":
        raise ValueError(f"expected an http:// URL, got scheme {parts.scheme!r} in {url!r}")
    return url.rstrip("/")


def check_fits(cfg: LoadConfig, max_model_len: int) -> None:
    """ValueError if the longest request could exceed the server's context. A prompt is ASCII
    and the tokenizer byte-level BPE, so a prompt has at most one token per character."""
    load = cfg.max_prompt_chars + cfg.max_tokens
    greedy = max(len(p.encode()) for p in cfg.greedy_prompts) + cfg.greedy_max_tokens
    longest = max(load, greedy) + PROMPT_TOKEN_MARGIN
    if longest > max_model_len:
        raise ValueError(f"a request may need {longest} tokens (prompt chars + max_tokens + "
                         f"{PROMPT_TOKEN_MARGIN}) > max_model_len {max_model_len}")


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    round: int
    index: int
    prompt: str
    max_tokens: int
    abort_after: int | None  # the client closes the stream after this many chunks


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    # many short requests and a tail of long ones, as real traffic has
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_prompt(rng: random.Random, n_chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < n_chars:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:n_chars]


def plan_round(cfg: LoadConfig, round_idx: int) -> list[PlannedRequest]:
    """The requests of one round: the same for the same (seed, round); exactly
    round(requests * abort_fraction) of them are aborted, with max_tokens long enough."""
    rng = random.Random(f"{cfg.seed}:{round_idx}")
    aborted = set(rng.sample(range(cfg.requests), round(cfg.requests * cfg.abort_fraction)))
    longest_abort = min(cfg.max_abort_after, cfg.max_tokens // 2)
    plan = []
    for i in range(cfg.requests):
        prompt = make_prompt(rng, _log_uniform(rng, cfg.min_prompt_chars, cfg.max_prompt_chars))
        if i in aborted:
            plan.append(PlannedRequest(round_idx, i, prompt, cfg.max_tokens, rng.randint(1, longest_abort)))
        else:
            plan.append(PlannedRequest(round_idx, i, prompt, _log_uniform(rng, 1, cfg.max_tokens), None))
    return plan


# --- one streamed request --------------------------------------------------------------------

class StreamError(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclasses.dataclass
class StreamTally:
    chunks: int = 0  # events that carried a choice
    tokens: int = 0
    nonfinite: int = 0
    finish_reason: str | None = None
    usage_tokens: int | None = None
    done: bool = False


def is_bad_logprob(x: object) -> bool:
    """NaN/Inf in a vLLM stream: NaN and +inf arrive as null, -inf as -9999.0."""
    if x is None:
        return True
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        raise StreamError("malformed", f"logprob {x!r}")
    return not math.isfinite(x) or x <= VLLM_NEG_INF


def count_logprobs(logprobs: object, tally: StreamTally) -> None:
    if not isinstance(logprobs, dict) or not isinstance(logprobs.get("token_logprobs"), list):
        raise StreamError("malformed", f"no logprobs in a chunk: {str(logprobs)[:120]}")
    values = list(logprobs["token_logprobs"])
    for top in logprobs.get("top_logprobs") or []:
        values.extend((top or {}).values())
    tally.tokens += len(logprobs["token_logprobs"])
    tally.nonfinite += sum(is_bad_logprob(v) for v in values)


def read_event(line: bytes, tally: StreamTally) -> None:
    """Account one SSE line of a vLLM completions stream; StreamError on an error or garbage."""
    text = line.decode("utf-8").strip()
    if not text.startswith("data:"):
        return  # blank separators, comments, other SSE fields
    data = text[len("data:"):].strip()
    if data == "[DONE]":
        tally.done = True
        return
    try:
        event = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError("malformed", f"{e}: {data[:120]}") from None
    if "error" in event:
        raise StreamError("stream_error", json.dumps(event["error"])[:200])
    if event.get("usage"):
        tally.usage_tokens = event["usage"].get("completion_tokens")
    for choice in event.get("choices", []):
        tally.chunks += 1
        count_logprobs(choice.get("logprobs"), tally)
        if choice.get("finish_reason") is not None:
            tally.finish_reason = choice["finish_reason"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # completed | aborted | failed
    reason: str | None = None
    detail: str = ""
    tokens: int = 0
    nonfinite: int = 0
    abort_missed: bool = False  # planned abort, but the stream ended first


def _failed(reason: str, detail: str, tally: StreamTally) -> Outcome:
    return Outcome("failed", reason, detail[:300], tally.tokens, tally.nonfinite)


def judge_finished_stream(req: PlannedRequest, tally: StreamTally) -> Outcome:
    """A stream the server ended: complete, with [DONE], a normal finish and every token."""
    if not tally.done:
        return _failed("stream_truncated", "no [DONE]", tally)
    if tally.finish_reason not in ("length", "stop"):
        return _failed("bad_finish", f"finish_reason {tally.finish_reason!r}", tally)
    if tally.tokens != req.max_tokens:  # ignore_eos: anything shorter was cut off
        return _failed("token_count", f"{tally.tokens} tokens, asked {req.max_tokens}", tally)
    if tally.usage_tokens is not None and tally.usage_tokens != tally.tokens:
        return _failed("token_count", f"usage says {tally.usage_tokens}, streamed {tally.tokens}", tally)
    return Outcome("completed", tokens=tally.tokens, nonfinite=tally.nonfinite,
                   abort_missed=req.abort_after is not None)


def request_body(model: str, req: PlannedRequest) -> dict:
    return {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "logprobs": 1, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


async def _stream(session: aiohttp.ClientSession, base: str, model: str, req: PlannedRequest,
                  tally: StreamTally) -> Outcome:
    async with session.post(base + "/v1/completions", json=request_body(model, req)) as resp:
        if resp.status != 200:
            return _failed(f"http_{resp.status}", (await resp.text())[:300], tally)
        if not resp.content_type.startswith("text/event-stream"):
            return _failed("malformed", f"content type {resp.content_type}", tally)
        async for line in resp.content:
            read_event(line, tally)
            planned_stop = req.abort_after is not None and tally.chunks >= req.abort_after
            if planned_stop and tally.finish_reason is None:
                resp.close()  # drops the connection: the server must abort the request
                return Outcome("aborted", tokens=tally.tokens, nonfinite=tally.nonfinite)
            if tally.done:
                break
    return judge_finished_stream(req, tally)


async def stream_request(session: aiohttp.ClientSession, base: str, model: str, req: PlannedRequest,
                         timeout_s: float) -> Outcome:
    """One planned request, bounded by `timeout_s`; every way it can go wrong is an Outcome."""
    tally = StreamTally()
    try:
        async with asyncio.timeout(timeout_s):
            return await _stream(session, base, model, req, tally)
    except TimeoutError:
        return _failed("timeout", f"after {timeout_s:.0f} s, {tally.chunks} chunks", tally)
    except StreamError as e:
        return _failed(e.reason, e.detail, tally)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
        return _failed("server_disconnect", repr(e), tally)
    except aiohttp.ClientConnectionError as e:
        return _failed("connection_error", repr(e), tally)
    except (aiohttp.ClientError, UnicodeDecodeError, ValueError) as e:
        return _failed("client_error", repr(e), tally)


# --- rounds, greedy set, GPU memory ----------------------------------------------------------

async def run_round(session: aiohttp.ClientSession, cfg: LoadConfig, plan: list[PlannedRequest]
                    ) -> tuple[list[Outcome], float]:
    """All requests of a round, at most cfg.concurrency at once, within cfg.round_wall_s."""
    base = loopback_base(cfg.url)
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(req: PlannedRequest) -> Outcome:
        async with gate:
            return await stream_request(session, base, cfg.model, req, cfg.request_timeout_s)

    t0 = time.monotonic()
    tasks = [asyncio.create_task(one(r)) for r in plan]
    done, pending = await asyncio.wait(tasks, timeout=cfg.round_wall_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - t0
    cut = Outcome("failed", "round_wall_limit", f"unfinished after {cfg.round_wall_s:.0f} s")
    return [t.result() if t in done else cut for t in tasks], wall


def summarize_round(round_idx: int, outcomes: list[Outcome], wall_s: float, mem_mib: int | None) -> dict:
    failed = [o for o in outcomes if o.status == "failed"]
    tokens = sum(o.tokens for o in outcomes)
    examples = {}
    for o in failed:  # the first detail of each reason, to read in load.json
        examples.setdefault(o.reason, o.detail)
    return {"round": round_idx, "requests": len(outcomes),
            "completed": sum(o.status == "completed" for o in outcomes),
            "aborted_as_planned": sum(o.status == "aborted" for o in outcomes),
            "abort_missed": sum(o.abort_missed for o in outcomes),
            "failed": len(failed), "failures_by_reason": dict(Counter(o.reason for o in failed)),
            "failure_examples": examples,
            "nonfinite_logprobs": sum(o.nonfinite for o in outcomes), "tokens": tokens,
            "wall_s": round(wall_s, 2), "tok_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
            "gpu_mem_mib": mem_mib}


async def ask_greedy(session: aiohttp.ClientSession, cfg: LoadConfig, salt: str) -> list[str]:
    """The fixed prompt set, one at a time (the same batch both times), non-streaming, all within
    one request timeout. A fresh cache_salt keeps the prefix cache from serving the second
    asking from the first (a prefix-cache hit takes another code path, with its own rounding)."""
    base, texts = loopback_base(cfg.url), []
    async with asyncio.timeout(cfg.request_timeout_s):
        for prompt in cfg.greedy_prompts:
            body = {"model": cfg.model, "prompt": prompt, "max_tokens": cfg.greedy_max_tokens,
                    "temperature": 0, "cache_salt": salt}
            async with session.post(base + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise StreamError(f"http_{resp.status}", (await resp.text())[:300])
                texts.append((await resp.json())["choices"][0]["text"])
    return texts


# what a greedy asking can fail with: reported, not raised
_GREEDY_ERRORS = (StreamError, TimeoutError, aiohttp.ClientError, KeyError, IndexError, TypeError,
                  ValueError)


def greedy_mismatches(before: list[str], after: list[str]) -> list[int]:
    if len(before) != len(after):
        raise ValueError(f"{len(before)} greedy answers before, {len(after)} after")
    return [i for i, (a, b) in enumerate(zip(before, after)) if a != b]


def gpu_memory_mib() -> tuple[int | None, str | None]:
    """GPU memory in use on the host (MiB, summed over GPUs), or None and why not."""
    cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return None, "nvidia-smi not found: GPU memory not measured"
    except subprocess.TimeoutExpired:
        return None, "nvidia-smi timed out"
    if r.returncode != 0:
        return None, f"nvidia-smi exited {r.returncode}: {r.stderr.strip()[:200]}"
    try:
        return sum(int(x) for x in r.stdout.split()), None
    except ValueError:
        return None, f"nvidia-smi output not understood: {r.stdout.strip()[:200]}"


def memory_flatness(samples: list[int | None]) -> dict:
    """Flat = max - min <= max(2% of the first sample, 256 MiB); None when not measured."""
    if len(samples) < 2 or any(s is None for s in samples):
        return {"flat": None, "spread_mib": None, "tolerance_mib": None}
    tol = max(MEM_TOLERANCE_FRACTION * samples[0], MEM_TOLERANCE_MIN_MIB)
    spread = max(samples) - min(samples)
    return {"flat": spread <= tol, "spread_mib": spread, "tolerance_mib": round(tol)}


# --- the run --------------------------------------------------------------------------------

def verdict(rounds: list[dict], greedy: dict, memory: dict) -> tuple[str, list[str]]:
    reasons = []
    for r in rounds:
        if r["failed"]:
            reasons.append(f"round {r['round']}: {r['failed']} failed {r['failures_by_reason']}")
        if r["nonfinite_logprobs"]:
            reasons.append(f"round {r['round']}: {r['nonfinite_logprobs']} NaN/Inf logprobs")
        if r["completed"] == 0:
            reasons.append(f"round {r['round']}: no request completed")
    if greedy.get("error"):
        reasons.append(f"greedy set: {greedy['error']}")
    elif not greedy["identical"]:
        reasons.append(f"greedy outputs changed after the load: prompts {greedy['mismatches']}")
    if memory["flat"] is False:
        reasons.append(f"GPU memory not flat: spread {memory['spread_mib']} MiB "
                       f"> {memory['tolerance_mib']} MiB")
    return ("FAIL" if reasons else "PASS"), reasons


async def run_load_async(cfg: LoadConfig, probe: MemProbe = gpu_memory_mib) -> dict:
    notes: list[str] = []

    def sample() -> int | None:
        mib, why = probe()
        if why and why not in notes:
            notes.append(why)
        return mib

    greedy: dict = {"identical": False, "mismatches": []}
    rounds = []
    # our own bounds apply (asyncio.timeout), not aiohttp's default 300 s; no proxy from the env
    connector = aiohttp.TCPConnector(limit=cfg.concurrency, limit_per_host=cfg.concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                     trust_env=False) as session:
        mem_before = sample()
        try:
            greedy["before"] = await ask_greedy(session, cfg, "greedy-before")
        except _GREEDY_ERRORS as e:
            greedy["error"] = f"before the load: {e!r}"
        for r in range(cfg.rounds):
            outcomes, wall = await run_round(session, cfg, plan_round(cfg, r))
            rounds.append(summarize_round(r, outcomes, wall, sample()))
        if "error" not in greedy:
            await asyncio.sleep(cfg.settle_s)
            try:
                greedy["after"] = await ask_greedy(session, cfg, "greedy-after")
                greedy["mismatches"] = greedy_mismatches(greedy["before"], greedy["after"])
                greedy["identical"] = not greedy["mismatches"]
            except _GREEDY_ERRORS as e:
                greedy["error"] = f"after the load: {e!r}"
    memory = {"before_load_mib": mem_before, **memory_flatness([r["gpu_mem_mib"] for r in rounds])}
    if cfg.abort_fraction > 0 and not sum(r["aborted_as_planned"] for r in rounds):
        notes.append("no planned abort happened: the abort path was not exercised")
    result, reasons = verdict(rounds, greedy, memory)
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "greedy_prompts"}
    return {"config": config, "rounds": rounds, "greedy_identical": greedy["identical"], "greedy": greedy,
            "memory": memory, "memory_flat": memory["flat"], "notes": notes, "verdict": result,
            "reasons": reasons}


def run_load(cfg: LoadConfig, probe: MemProbe = gpu_memory_mib) -> dict:
    return asyncio.run(run_load_async(cfg, probe))


def format_table(summary: dict) -> str:
    cols = ("round", "requests", "completed", "aborted_as_planned", "failed", "nonfinite_logprobs",
            "tokens", "wall_s", "tok_per_s", "gpu_mem_mib")
    heads = ("round", "reqs", "done", "aborted", "failed", "nan/inf", "tokens", "wall s", "tok/s", "GPU MiB")
    rows = [heads] + [tuple("-" if r[c] is None else str(r[c]) for c in cols) for r in summary["rounds"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    for r in summary["rounds"]:
        if r["failures_by_reason"]:
            lines.append(f"round {r['round']} failures: {r['failures_by_reason']}")
    mem, greedy_error = summary["memory"], summary["greedy"].get("error")
    lines.append(f"greedy identical: {summary['greedy_identical']}"
                 + (f" ({greedy_error})" if greedy_error else ""))
    lines.append("memory flat: not measured" if mem["flat"] is None else
                 f"memory flat: {mem['flat']} (spread {mem['spread_mib']} MiB, "
                 f"tolerance {mem['tolerance_mib']} MiB)")
    lines += [f"note: {n}" for n in summary["notes"]]
    lines.append(f"LOAD {summary['verdict']}" + "".join(f"\n  - {r}" for r in summary["reasons"]))
    return "\n".join(lines)


def write_summary(summary: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "load.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    return path


_CLI_FIELDS = ("rounds", "requests", "concurrency", "seed", "max_prompt_chars", "max_tokens",
               "abort_fraction", "request_timeout_s", "round_wall_s", "settle_s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    fields = LoadConfig.__dataclass_fields__
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True, help="http://127.0.0.1:PORT (loopback only)")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--out", required=True)
    for name in _CLI_FIELDS:
        default = fields[name].default
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    ap.add_argument("--max-model-len", type=int, help="refuse a plan that could exceed it")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = LoadConfig(url=a.url, model=a.model, **{name: getattr(a, name) for name in _CLI_FIELDS})
    if a.max_model_len is not None:
        check_fits(cfg, a.max_model_len)
    summary = run_load(cfg)
    print(format_table(summary))
    print("wrote", write_summary(summary, a.out))
    return 0 if summary["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
