"""The load-on-loopback harness (eval/load.py) against an in-process fake of vLLM 0.26's
/v1/completions (aiohttp on 127.0.0.1, an ephemeral port, its own thread): a clean run passes;
NaN logprobs, HTTP errors, stalls and dropped connections are reported; planned aborts are not
failures; only loopback hosts are accepted; the plan is seeded; greedy drift is caught."""
import asyncio
import contextlib
import json
import threading

import pytest
from aiohttp import web

from vllm_mixprec.eval import load as L


class FakeCompletions:
    """/v1/completions as vLLM 0.26 streams it: one token per chunk with `logprobs`, the finish
    reason on the last, a usage chunk, then [DONE]. NaN and +inf logprobs come as null there
    (pydantic), so `nan_on` sends null. Streams are numbered in arrival order."""

    def __init__(self, nan_on=(), http500_on=(), stall_on=(), drop_on=(), greedy_drift=False):
        self.nan_on, self.http500_on = set(nan_on), set(http500_on)
        self.stall_on, self.drop_on = set(stall_on), set(drop_on)
        self.greedy_drift = greedy_drift
        self.streams = 0
        self.disconnects = 0
        self.greedy_asked = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        # handler_cancellation: a stalled handler ends when the client gives up on it
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self):
        await self.runner.cleanup()

    async def completions(self, request: web.Request):
        body = await request.json()
        if not body.get("stream"):
            return self.greedy(body)
        n, self.streams = self.streams, self.streams + 1
        if n in self.http500_on:
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if n in self.stall_on:
                await asyncio.sleep(3600)
            await self.stream_tokens(request, resp, n, body)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp

    async def stream_tokens(self, request, resp, n, body):
        max_tokens = body["max_tokens"]
        for i in range(max_tokens):
            lp = None if (n in self.nan_on and i == 0) else -0.5
            choice = {"index": 0, "text": "t", "finish_reason": "length" if i == max_tokens - 1 else None,
                      "logprobs": {"text_offset": [i], "token_logprobs": [lp], "tokens": ["t"],
                                   "top_logprobs": [{"t": lp}]}}
            if n in self.drop_on:  # headers sent, then the connection goes
                request.transport.close()
                return
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            await asyncio.sleep(0.002)
        usage = {"prompt_tokens": 5, "completion_tokens": max_tokens, "total_tokens": 5 + max_tokens}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")

    def greedy(self, body):
        self.greedy_asked += 1
        text = "greedy " + body["prompt"][::-1][: body["max_tokens"]]
        if self.greedy_drift and self.streams > 0:
            text += "~"
        return web.json_response({"choices": [{"index": 0, "text": text, "finish_reason": "length"}]})


@contextlib.contextmanager
def fake_server(**behaviour):
    fake = FakeCompletions(**behaviour)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve():
        loop.run_until_complete(fake.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def small_config(port, **kw) -> L.LoadConfig:
    base = dict(url=f"http://127.0.0.1:{port}", model="fake", rounds=2, requests=40, concurrency=16,
                max_prompt_chars=64, max_tokens=16, request_timeout_s=5.0, round_wall_s=20.0,
                greedy_max_tokens=8, settle_s=0.0)
    return L.LoadConfig(**{**base, **kw})


def no_gpu():
    return None, "not measured in tests"


def planned_aborts(cfg):
    return sum(r.abort_after is not None for rnd in range(cfg.rounds) for r in L.plan_round(cfg, rnd))


# --- the plan and its bounds ---------------------------------------------------------------

def test_plan_is_seeded_mixed_and_aborts_one_in_eight():
    cfg = L.LoadConfig(url="http://127.0.0.1:1", model="m", requests=256)
    a, b = L.plan_round(cfg, 0), L.plan_round(cfg, 0)
    assert a == b
    assert L.plan_round(cfg, 1) != a
    assert L.plan_round(L.LoadConfig(url=cfg.url, model="m", seed=1), 0) != a
    assert sum(r.abort_after is not None for r in a) == 32
    for r in a:
        assert cfg.min_prompt_chars <= len(r.prompt) <= cfg.max_prompt_chars and r.prompt.isascii()
        assert 1 <= r.max_tokens <= cfg.max_tokens
        if r.abort_after is not None:  # the stream must outlive the abort point
            assert 1 <= r.abort_after <= cfg.max_abort_after < r.max_tokens
    lengths, budgets = sorted(len(r.prompt) for r in a), sorted(r.max_tokens for r in a)
    assert lengths[25] < 64 and lengths[-25] > 512  # short ones and long ones
    assert budgets[25] < 8 and budgets[-25] > 128


def test_plan_fits_the_context():
    cfg = L.LoadConfig(url="http://127.0.0.1:1", model="m")
    L.check_fits(cfg, 4096)
    with pytest.raises(ValueError, match="max_model_len 2048"):
        L.check_fits(cfg, 2048)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com:8000", "http://127.0.0.2:80",
                                 "http://0.0.0.0:8000", "http://[::1]:8000"])
def test_refuses_a_host_other_than_loopback(url):
    host = url.split("//")[1].rsplit(":", 1)[0].strip("[]")
    with pytest.raises(ValueError, match=f"refusing host '{host}'"):
        L.LoadConfig(url=url, model="m")


def test_accepts_loopback_and_refuses_https_and_unbounded_plans():
    L.LoadConfig(url="http://localhost:8000/", model="m")
    with pytest.raises(ValueError, match="scheme 'https'"):
        L.LoadConfig(url="https://127.0.0.1:8000", model="m")
    with pytest.raises(ValueError, match="at most 4096"):
        L.LoadConfig(url="http://127.0.0.1:1", model="m", rounds=20, requests=256)
    with pytest.raises(ValueError, match="concurrency"):
        L.LoadConfig(url="http://127.0.0.1:1", model="m", concurrency=0)


# --- reading a stream -----------------------------------------------------------------------

@pytest.mark.parametrize("value, bad", [(-0.25, False), (-9998.0, False), (None, True), (-9999.0, True),
                                        ("NaN", True), ("Infinity", True), ("-Infinity", True)])
def test_bad_logprob_values(value, bad):
    raw = value if isinstance(value, str) else json.dumps(value)  # NaN literals as Python's json writes them
    line = ('data: {"choices": [{"index": 0, "text": "x", "logprobs": {"token_logprobs": [%s], '
            '"top_logprobs": [null]}}]}' % raw).encode()
    tally = L.StreamTally()
    L.read_event(line, tally)
    assert (tally.tokens, tally.nonfinite) == (1, int(bad))


def test_stream_errors_and_garbage_raise():
    with pytest.raises(L.StreamError, match="stream_error"):
        L.read_event(b'data: {"error": {"message": "engine dead", "code": 500}}', L.StreamTally())
    with pytest.raises(L.StreamError, match="malformed"):
        L.read_event(b"data: {not json", L.StreamTally())
    with pytest.raises(L.StreamError, match="no logprobs"):
        L.read_event(b'data: {"choices": [{"index": 0, "text": "x"}]}', L.StreamTally())
    tally = L.StreamTally()
    for line in (b"", b": keep-alive", b"data: [DONE]"):
        L.read_event(line, tally)
    assert tally.done and tally.chunks == 0


@pytest.mark.parametrize("tally, status, reason", [
    (dict(done=True, finish_reason="length", tokens=8, usage_tokens=8), "completed", None),
    (dict(done=False, finish_reason="length", tokens=8), "failed", "stream_truncated"),
    (dict(done=True, finish_reason="abort", tokens=8), "failed", "bad_finish"),
    (dict(done=True, finish_reason=None, tokens=8), "failed", "bad_finish"),
    (dict(done=True, finish_reason="length", tokens=5), "failed", "token_count"),
    (dict(done=True, finish_reason="length", tokens=8, usage_tokens=9), "failed", "token_count"),
])
def test_judging_a_finished_stream(tally, status, reason):
    req = L.PlannedRequest(0, 0, "p", max_tokens=8, abort_after=None)
    out = L.judge_finished_stream(req, L.StreamTally(**tally))
    assert (out.status, out.reason) == (status, reason)


def test_a_planned_abort_that_finished_first_is_completed_and_noted():
    req = L.PlannedRequest(0, 0, "p", max_tokens=8, abort_after=4)
    out = L.judge_finished_stream(req, L.StreamTally(chunks=1, tokens=8, done=True, finish_reason="length"))
    assert (out.status, out.abort_missed) == ("completed", True)


# --- whole runs against the fake server -----------------------------------------------------

def test_clean_run_passes_and_counts_planned_aborts(tmp_path, capsys):
    with fake_server() as fake:
        cfg = small_config(fake.port)
        s = L.run_load(cfg, probe=no_gpu)
    assert s["verdict"] == "PASS", s["reasons"]
    aborts = planned_aborts(cfg)
    assert aborts == 10  # 5 of 40 per round
    for r in s["rounds"]:  # the fake streams 16 chunks; aborts come after at most 8
        assert (r["requests"], r["completed"], r["aborted_as_planned"], r["abort_missed"]) == (40, 35, 5, 0)
        assert r["failed"] == 0 and r["nonfinite_logprobs"] == 0
    plans = [r for rnd in range(cfg.rounds) for r in L.plan_round(cfg, rnd)]
    streamed = sum(r.max_tokens if r.abort_after is None else r.abort_after for r in plans)
    assert sum(r["tokens"] for r in s["rounds"]) == streamed
    assert s["greedy_identical"] is True and len(s["greedy"]["before"]) == 8
    assert s["memory_flat"] is None and "not measured in tests" in s["notes"]
    assert fake.streams == 80 and fake.greedy_asked == 16
    assert fake.disconnects > 0  # the server saw the client close aborted streams


def test_nan_logprob_fails_the_verdict():
    with fake_server(nan_on={3, 17}) as fake:
        s = L.run_load(small_config(fake.port, rounds=1), probe=no_gpu)
    assert s["rounds"][0]["nonfinite_logprobs"] == 2 * 2  # token and top-1 value of each
    assert s["rounds"][0]["failed"] == 0
    assert s["verdict"] == "FAIL" and any("NaN/Inf" in r for r in s["reasons"])


def test_http_500_is_a_failure_with_its_reason():
    with fake_server(http500_on={0, 7}) as fake:
        s = L.run_load(small_config(fake.port, rounds=1), probe=no_gpu)
    r = s["rounds"][0]
    assert r["failed"] == 2 and r["failures_by_reason"] == {"http_500": 2}
    assert "boom" in r["failure_examples"]["http_500"]
    assert s["verdict"] == "FAIL" and "http_500" in s["reasons"][0]


def test_stalled_stream_hits_the_timeout():
    with fake_server(stall_on={5}) as fake:
        s = L.run_load(small_config(fake.port, rounds=1, request_timeout_s=1.0), probe=no_gpu)
    r = s["rounds"][0]
    assert r["failures_by_reason"] == {"timeout": 1}
    assert 1.0 <= r["wall_s"] < 5
    assert s["verdict"] == "FAIL"


def test_round_wall_limit_cuts_what_is_left():
    with fake_server(stall_on={1, 2}) as fake:
        cfg = small_config(fake.port, rounds=1, request_timeout_s=30, round_wall_s=1.0)
        s = L.run_load(cfg, probe=no_gpu)
    r = s["rounds"][0]
    assert r["failures_by_reason"] == {"round_wall_limit": 2} and r["wall_s"] < 3


def test_dropped_connection_is_a_server_disconnect():
    with fake_server(drop_on={4}) as fake:
        s = L.run_load(small_config(fake.port, rounds=1), probe=no_gpu)
    r = s["rounds"][0]
    assert r["failures_by_reason"] == {"server_disconnect": 1}
    assert s["verdict"] == "FAIL"


def test_greedy_drift_is_detected():
    with fake_server(greedy_drift=True) as fake:
        s = L.run_load(small_config(fake.port, rounds=1), probe=no_gpu)
    assert s["greedy_identical"] is False
    assert s["greedy"]["mismatches"] == list(range(8))
    assert s["verdict"] == "FAIL" and any("greedy outputs changed" in r for r in s["reasons"])


def test_growing_gpu_memory_fails_and_flat_memory_passes():
    samples = iter([40000, 40000, 41000])  # before the load, after round 0, after round 1
    with fake_server() as fake:
        s = L.run_load(small_config(fake.port), probe=lambda: (next(samples), None))
    assert s["memory"] == {"before_load_mib": 40000, "flat": False, "spread_mib": 1000, "tolerance_mib": 800}
    assert s["verdict"] == "FAIL" and "GPU memory not flat" in s["reasons"][0]
    assert L.memory_flatness([40000, 40500])["flat"] is True
    assert L.memory_flatness([1000, 1256])["flat"] is True  # the 256 MiB floor
    assert L.memory_flatness([1000, None])["flat"] is None


def test_memory_without_nvidia_smi_is_none_and_says_so(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert L.gpu_memory_mib() == (None, "nvidia-smi not found: GPU memory not measured")


def test_cli_writes_load_json_and_prints_the_table(tmp_path, capsys, monkeypatch):
    run_load = L.run_load
    monkeypatch.setattr(L, "run_load", lambda cfg: run_load(cfg, probe=no_gpu))
    with fake_server() as fake:
        rc = L.main(["--url", f"http://127.0.0.1:{fake.port}", "--model", "fake", "--rounds", "1",
                     "--requests", "24", "--concurrency", "8", "--max-prompt-chars", "32",
                     "--max-tokens", "8", "--settle-s", "0", "--out", str(tmp_path),
                     "--max-model-len", "128"])
    out = capsys.readouterr().out
    assert rc == 0 and "LOAD PASS" in out and "aborted" in out
    s = json.load(open(tmp_path / "load.json"))
    assert s["verdict"] == "PASS" and s["config"]["requests"] == 24 and s["rounds"][0]["requests"] == 24
    with pytest.raises(ValueError, match="max_model_len 32"):
        L.main(["--url", "http://127.0.0.1:1", "--model", "m", "--out", str(tmp_path),
                "--max-model-len", "32"])
