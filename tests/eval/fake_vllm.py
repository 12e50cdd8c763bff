"""A stand-in for `python -m vllm.entrypoints.cli.main` and the longctx script in the A/B harness
tests: it answers like vLLM 0.26 does (log lines, result files, /health) in milliseconds.

FAKE_VLLM_HANG=<workload> makes that workload hang (the harness must time it out and stop it);
FAKE_VLLM_PIDS=<file> gets one pid per line from every process started, for leak checks.
"""
import http.server
import json
import os
import sys
import time


def _flag(argv, name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def _log_kernel(argv):
    model = _flag(argv, "--model") or (argv[0] if argv else "")
    print("INFO [__init__.py:30] vllm_mixprec 0.1.0 registered: --quantization mixprec, --attention-backend CUSTOM")
    if "gptq" in model:
        k = "MarlinLinearKernel" if _flag(argv, "--linear-backend") == "marlin" else "MacheteLinearKernel"
        print(f"INFO [auto_gptq.py:356] Using {k} for AutoGPTQLinearMethod")
    if _flag(argv, "--attention-backend") == "CUSTOM":
        print("INFO [cuda.py:422] Using AttentionBackendEnum.CUSTOM backend.")
    else:
        print("INFO [cuda.py:422] Using AttentionBackendEnum.FLASH_ATTN backend.")
    print("INFO [kv_cache_utils.py:2177] GPU KV cache size: 1,234,567 tokens", flush=True)


def _hang(workload):
    if os.environ.get("FAKE_VLLM_HANG") == workload:
        time.sleep(3600)


def throughput(argv):
    _log_kernel(argv)
    _hang("throughput")
    n = int(_flag(argv, "--num-prompts"))
    quant = 2.0 if "--quantization" in argv else 1.0
    rps = 10.0 * quant
    print(f"Throughput: {rps:.2f} requests/s, {rps * 1536:.2f} total tokens/s, {rps * 512:.2f} output tokens/s")
    json.dump({"elapsed_time": n / rps, "num_requests": n, "total_num_tokens": n * 1536,
               "requests_per_second": rps, "tokens_per_second": rps * 1536}, open(_flag(argv, "--output-json"), "w"))


def serve(argv):
    _log_kernel(argv)
    _hang("serve")
    port = int(_flag(argv, "--port"))

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()


def bench_serve(argv):
    _hang("bench_serve")
    n, c = int(_flag(argv, "--num-prompts")), int(_flag(argv, "--max-concurrency"))
    out_len = int(_flag(argv, "--random-output-len"))
    tpot = 0.010 + 0.0001 * c
    r = {"duration": 1.0, "completed": n, "failed": 0, "total_input_tokens": n * 1024,
         "total_output_tokens": n * out_len, "request_throughput": n / 1.0, "output_throughput": 100.0 * c,
         "total_token_throughput": 300.0 * c, "max_output_tokens_per_s": 120.0 * c, "max_concurrent_requests": c,
         "median_ttft_ms": 50.0, "p99_ttft_ms": 90.0, "median_tpot_ms": 1000 * tpot, "p99_tpot_ms": 1200 * tpot,
         "input_lens": [1024] * n, "output_lens": [out_len] * n, "ttfts": [0.05 + 0.001 * i for i in range(n)],
         "itls": [[tpot] * (out_len - 1) for _ in range(n)], "start_times": [0.0] * n,
         "generated_texts": ["x" * 100] * n, "errors": [""] * n}
    os.makedirs(_flag(argv, "--result-dir"), exist_ok=True)
    json.dump(r, open(os.path.join(_flag(argv, "--result-dir"), _flag(argv, "--result-filename")), "w"))
    print("============ Serving Benchmark Result ============")


def longctx(argv):
    _log_kernel(argv)
    _hang("longctx")
    b, n_in, n_out = (int(_flag(argv, k)) for k in ("--batch", "--prompt-len", "--output-len"))
    res = {"kv": _flag(argv, "--kv-cache-dtype", "auto"), "batch": b, "prompt": n_in, "out": n_out, "seconds": 2.0,
           "out_tok_per_s": b * n_out / 2.0 * (1.5 if "--kv-cache-dtype" in argv else 1.0),
           "total_tok_per_s": b * (n_in + n_out) / 2.0}
    print("RESULT", json.dumps(res), flush=True)
    json.dump(res, open(_flag(argv, "--out-json"), "w"))


if __name__ == "__main__":
    if os.environ.get("FAKE_VLLM_PIDS"):
        with open(os.environ["FAKE_VLLM_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
    a = sys.argv[1:]
    if a[0] == "longctx":
        longctx(a[1:])
    elif a[:2] == ["bench", "throughput"]:
        throughput(a[2:])
    elif a[:2] == ["bench", "serve"]:
        bench_serve(a[2:])
    elif a[0] == "serve":
        serve(a[1:])
    else:
        sys.exit(f"fake vllm: unknown command {a}")
