"""The A/B harness (eval/ab.py, eval/ab_report.py) on a CPU: the arm table, its command lines as
vLLM 0.26's own parsers read them, the JSONL results and --resume, the table and plots, and whole
runs against a stand-in vLLM (fake_vllm.py): time limits, budgets, interruption, no leaked process."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from vllm_mixprec.eval import ab
from vllm_mixprec.eval import ab_report as R
from vllm_mixprec.eval import serve as S
from vllm_mixprec.eval import synthetic as syn


FAKE = str(Path(__file__).with_name("fake_vllm.py"))


# --- the arm table and its command lines ---------------------------------------------------

def test_arm_table():
    from vllm_mixprec.quant_methods.kv_cache import required_flags

    assert ab.DEFAULT_ARMS == ("bf16", "marlin", "machete", "fp8", "w4a8", "w4a8kv4")
    a = ab.ARMS
    assert (a["bf16"].ckpt, a["bf16"].flags) == ("bf16", ())
    assert (a["fp8"].ckpt, a["fp8"].flags) == ("bf16", ("--quantization", "fp8"))
    assert (a["marlin"].ckpt, a["marlin"].flags, a["marlin"].kernel) == \
           ("gptq", ("--linear-backend", "marlin"), "MarlinLinearKernel")
    assert (a["machete"].ckpt, a["machete"].flags, a["machete"].kernel) == ("gptq", (), "MacheteLinearKernel")
    assert (a["w4a8"].ckpt, a["w4a8"].flags) == ("mixprec", ("--quantization", "mixprec"))
    assert a["w4a8kv4"].ckpt == "mixprec-kv4"
    assert a["w4a8kv4"].flags == ("--quantization", "mixprec", *required_flags("kv4").split())
    assert dict(a["marlin-int8"].env) == {"VLLM_MARLIN_INPUT_DTYPE": "int8"}
    assert a["w4a8kv4-mergectx"].flags == a["w4a8kv4"].flags
    assert dict(a["w4a8kv4-mergectx"].env) == {"MIXPREC_ATTN_CONTEXT_TOKENS": "0"}
    assert a["w4a8kv4-pdl"].flags == a["w4a8kv4"].flags
    assert dict(a["w4a8kv4-pdl"].env) == {"MIXPREC_ATTN_PDL": "1"}
    assert dict(a["w4a8kv4-tailprog"].env) == {"MIXPREC_ATTN_TAIL": "program"}
    assert dict(a["w4a8kv4-mergekernel"].env) == {"MIXPREC_ATTN_MERGE": "kernel"}
    assert dict(a["w4a8kv4-siluquant"].env) == {"MIXPREC_FUSE_SILU_QUANT": "1"}
    assert dict(a["w4a8kv4-inductorquant"].env) == {"MIXPREC_DECODE_QUANT_OPS": "0"}
    assert dict(a["w4a8kv4-siluop"].env) == {"MIXPREC_DECODE_SILU_OP": "1"}
    assert dict(a["w4a8kv4-noquantpdl"].env) == {"MIXPREC_QUANT_OPS_PDL": "0"}
    assert a["w4a8kv4-naturalorder"].flags == a["w4a8kv4"].flags
    assert dict(a["w4a8kv4-naturalorder"].env) == {"MIXPREC_X_WGMMA_ORDER": "0"}
    assert dict(a["w4a8kv4-inputorder"].env) == {"MIXPREC_X_WGMMA_ORDER": "input"}
    assert dict(a["w4a8kv4-codesorder"].env) == {"MIXPREC_X_WGMMA_ORDER": "codes"}
    assert all(arm.ckpt in syn.CKPT_KINDS for arm in a.values())


@pytest.fixture(scope="module")
def vllm_parsers():
    """vLLM 0.26's own parsers of `vllm bench throughput`, `vllm serve`, `vllm bench serve`, built
    as the CLI builds them (with the CPU platform `vllm bench` switches to)."""
    import vllm_mixprec
    from vllm import platforms
    from vllm.benchmarks import serve as bserve
    from vllm.benchmarks import throughput as bthroughput
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_mixprec.eval import longctx

    vllm_mixprec.register()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(platforms, "current_platform", CpuPlatform())
        tp = FlexibleArgumentParser()
        bthroughput.add_cli_args(tp)
        bs = FlexibleArgumentParser()
        bserve.add_cli_args(bs)
        return {("bench", "throughput"): (tp, bthroughput.validate_args), ("serve",): (make_arg_parser(
            FlexibleArgumentParser()), None), ("bench", "serve"): (bs, None), "longctx": (longctx.build_parser(), None)}


def _parse(parsers, cmd):
    n = len(S.VLLM_CLI)
    if tuple(cmd[:n]) == S.VLLM_CLI:
        sub = ("bench", cmd[n + 1]) if cmd[n] == "bench" else (cmd[n],)
        parser, validate = parsers[sub]
        ns = parser.parse_args(cmd[n + len(sub):])
    else:
        assert tuple(cmd[:len(ab.LONGCTX_CLI)]) == ab.LONGCTX_CLI
        parser, validate = parsers["longctx"]
        ns = parser.parse_args(cmd[len(ab.LONGCTX_CLI):])
    if validate:
        validate(ns)
    return ns


ARM_EXPECT = {  # what vLLM must read from each arm's flags
    "bf16": dict(quantization=None, kv_cache_dtype="auto", attention_backend=None, linear_backend="auto"),
    "fp8": dict(quantization="fp8", kv_cache_dtype="auto", attention_backend=None, linear_backend="auto"),
    "marlin": dict(quantization=None, kv_cache_dtype="auto", attention_backend=None, linear_backend="marlin"),
    "machete": dict(quantization=None, kv_cache_dtype="auto", attention_backend=None, linear_backend="auto"),
    "w4a8": dict(quantization="mixprec", kv_cache_dtype="auto", attention_backend=None, linear_backend="auto"),
    "w4a8kv4": dict(quantization="mixprec", kv_cache_dtype="int4_per_token_head", attention_backend="CUSTOM",
                    linear_backend="auto"),
}


@pytest.mark.parametrize("arm", sorted(ARM_EXPECT))
def test_command_lines_parse_with_vllms_own_parsers(vllm_parsers, arm, tiny_ckpts):
    a, o = ab.ARMS[arm], ab.Options(concurrency=(1, 256), vllm_args=("--max-num-seqs", "512"))
    ckpt = str(tiny_ckpts[1][a.ckpt])

    def check(ns):
        for k, v in ARM_EXPECT[arm].items():
            got = getattr(ns, k)
            assert (got if not hasattr(got, "name") else got.name) == v or (v == "auto" and got is None), (k, got)
        assert ns.max_num_seqs == 512

    ns = _parse(vllm_parsers, ab.throughput_cmd(a, ckpt, o, "/x/t.json"))
    check(ns)
    assert (ns.model, ns.dataset_name, ns.random_input_len, ns.random_output_len, ns.num_prompts, ns.output_json) == \
           (ckpt, "random", 1024, 512, 1000, "/x/t.json")
    assert ns.enable_prefix_caching is False and ns.max_model_len == 2048

    ns = _parse(vllm_parsers, ab.server_cmd(a, ckpt, o, 8123))
    check(ns)
    assert (ns.model_tag, ns.host, ns.port, ns.enable_prefix_caching) == (ckpt, "127.0.0.1", 8123, False)

    ns = _parse(vllm_parsers, ab.bench_serve_cmd(ckpt, o, 8123, 256, "/r", "c256.json"))
    assert (ns.model, ns.port, ns.max_concurrency, ns.num_prompts, ns.ignore_eos, ns.save_result, ns.save_detailed,
            ns.result_dir, ns.result_filename, ns.request_rate) == \
           (ckpt, 8123, 256, 512, True, True, True, "/r", "c256.json", float("inf"))
    assert ns.percentile_metrics == "ttft,tpot,itl,e2el" and ns.dataset_name == "random"

    ns = _parse(vllm_parsers, ab.longctx_cmd(a, ckpt, o, "/x/l.json"))
    check(ns)
    assert (ns.batch, ns.prompt_len, ns.output_len, ns.max_model_len, ns.gpu_memory_utilization) == \
           (64, 8192, 256, 16384, 0.85)
    assert ns.enable_prefix_caching is False and ns.out_json == "/x/l.json"


def test_cli_ab_subcommand(capsys):
    from vllm_mixprec import cli

    assert cli.main(["ab", "--dry-run", "--arms", "marlin", "--workloads", "throughput", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "vllm bench throughput --model /tmp/mixprec-ab/llama3-8b-L4/gptq-w4a16-g128" in out
    assert "--linear-backend marlin" in out
    with pytest.raises(SystemExit):
        cli.main(["ab", "--arms", "nope", "--dry-run"])


# --- parsing, results, report ------------------------------------------------------------

def test_log_facts():
    text = ("INFO 11-22 [__init__.py:30] vllm_mixprec 0.1.0 registered: --quantization mixprec\n"
            "(EngineCore pid=1) INFO [auto_gptq.py:356] Using MacheteLinearKernel for AutoGPTQLinearMethod\n"
            "(EngineCore pid=1) INFO [__init__.py:45] vllm_mixprec kernels: csrc ops loaded; triton available\n"
            "(EngineCore pid=1) INFO [cuda.py:422] Using AttentionBackendEnum.CUSTOM backend.\n"
            "(EngineCore pid=1) INFO [kv_cache_utils.py:2177] GPU KV cache size: 36,345,136 tokens\n")
    f = S.log_facts(text)
    assert f["silu_quant_fused"] is False
    assert f["wgmma_order_first_graph"] is None and f["realize_reads_threshold"] is None
    g = S.log_facts(text + (  # compile_passes' lines as session 73's served input_fused arm logged them
        "(EngineCore pid=1499) INFO 12-05 18:38:53 [compile_passes.py:448] vllm_mixprec: "
        "MIXPREC_X_WGMMA_ORDER=input_fused: Inductor's realize_reads_threshold is 16 "
        "(compile_passes.INPUT_FUSED_REALIZE_READS)\n"
        "(EngineCore pid=1499) INFO 12-05 18:39:17 [compile_passes.py:352] vllm_mixprec: W4A8 activations "
        "in the wgmma k order for batches of more than 64 tokens (1 GEMMs in the first graph; 1 "
        "quantizers permute their input)\n"))
    assert g["wgmma_order_first_graph"] == [1, 1] and g["realize_reads_threshold"] == 16
    assert S.log_facts(text + "INFO [compile_passes.py:120] vllm_mixprec: SiLU-and-mul + quantize "
                       "fused into mixprec::silu_mul_quantize_act (1 in the first graph)\n"
                       )["silu_quant_fused"] is True
    assert f["kernels"] == ["MacheteLinearKernel for AutoGPTQLinearMethod"]
    assert (f["kv_cache_tokens"], f["attention_backend"], f["plugin_logged"]) == (36345136, "CUSTOM", True)
    assert f["mixprec_kernels"].startswith("csrc ops loaded")


def test_parse_bench_serve_computes_tpot_and_trims(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"completed": 2, "failed": 1, "output_throughput": 10.5, "median_tpot_ms": 20.0,
                             "p99_ttft_ms": 9.0, "ttfts": [0.1, 0.2, 0.0], "output_lens": [5, 3, 0],
                             "itls": [[0.01] * 4, [0.02, 0.04], []], "generated_texts": ["a", "b", ""],
                             "errors": ["", "", "boom"], "start_times": [0, 0, 0]}))
    m, s = ab.parse_bench_serve(str(p))
    assert m == {"completed": 2, "failed": 1, "output_throughput": 10.5, "median_tpot_ms": 20.0, "p99_ttft_ms": 9.0}
    assert s == {"ttft_ms": [100.0, 200.0], "tpot_ms": [10.0, 30.0]}
    raw = json.loads(p.read_text())
    assert "generated_texts" not in raw and "itls" not in raw and raw["errors"] == ["boom"]


def _e(model, arm, wl, c=None, status="ok", **metrics):
    return {"key": ab.entry_key(model, arm, wl, c), "model": model, "arm": arm, "workload": wl, "concurrency": c,
            "status": status, "metrics": metrics, "facts": {"kernels": [], "kv_cache_tokens": 1000}}


def test_results_jsonl_resume_and_prior(tmp_path):
    r = ab.Results(tmp_path / "out", tmp_path / "mirror")
    (tmp_path / "out").mkdir()
    r.append(_e("m", "bf16", "throughput", status="failed"))
    r.append(_e("m", "marlin", "throughput"))
    with open(r.path, "a") as f:
        f.write('{"key": "m|bf16|serve|1", "stat')  # a line cut short by a kill
    r2 = ab.Results(tmp_path / "out")
    assert len(r2.entries) == 2
    assert r2.done(ab.entry_key("m", "marlin", "throughput"))
    assert not r2.done(ab.entry_key("m", "bf16", "throughput"))
    assert r2.done(ab.entry_key("m", "bf16", "throughput"), skip_failed=True)
    r2.append(_e("m", "bf16", "throughput"))  # a rerun replaces the failure
    assert ab.Results(tmp_path / "out").done(ab.entry_key("m", "bf16", "throughput"))
    prior = tmp_path / "prior.jsonl"
    prior.write_text(json.dumps(_e("m", "fp8", "throughput")) + "\n" + json.dumps(_e("m", "marlin", "longctx")) + "\n")
    assert r2.merge(prior) == 2 and r2.merge(prior) == 0
    assert sorted((tmp_path / "mirror").iterdir()) == [tmp_path / "mirror" / "ab-logs.tar.gz",
                                                       tmp_path / "mirror" / "ab.jsonl"]


def _synthetic_results(model="llama3-8b-L32"):
    es = []
    for arm, tps in (("bf16", 3000.0), ("fp8", 4000.0), ("marlin", 3200.0), ("machete", 3500.0),
                     ("w4a8", 5200.0), ("w4a8kv4", 5000.0)):
        es.append(_e(model, arm, "throughput", output_tokens_per_second=tps, tokens_per_second=3 * tps,
                     requests_per_second=tps / 512))
        es.append(_e(model, arm, "longctx", out_tok_per_s=tps / 2, total_tok_per_s=tps * 10, seconds=5.0))
        for c in (1, 8, 32):
            tpot = {"marlin": 7.0, "w4a8kv4": 6.5}.get(arm, 8.0) + c / 10
            e = _e(model, arm, "serve", c, output_throughput=c * 1000 / tpot, median_tpot_ms=tpot,
                   p99_tpot_ms=tpot * 1.3, median_ttft_ms=40.0 + c, p99_ttft_ms=80.0 + c)
            e["samples"] = {"ttft_ms": [40.0 + c + i for i in range(20)],
                            "tpot_ms": [tpot + i / 100 for i in range(20)]}
            es.append(e)
    es.append(_e(model, "w4a8", "serve", 256, status="timeout"))
    return es


def test_table_targets_and_summary(tmp_path):
    es = _synthetic_results()
    text = R.render(es)
    for needle in ("Saturation throughput", "Serving sweep", "Long context", "Issue #6 targets", "1.56x"):
        assert needle in text, needle
    t = {x["target"]: x for x in R.targets(es)}
    assert t["saturation throughput, w4a8kv4 / marlin"]["ratio"] == pytest.approx(5000 / 3200)
    assert t["saturation throughput, w4a8kv4 / marlin"]["met"] is True
    assert t["saturation throughput, w4a8kv4 / fp8"]["ratio"] == pytest.approx(1.25)
    assert t["median TPOT at concurrency 1, marlin / w4a8kv4"]["ratio"] == pytest.approx(7.1 / 6.6)
    assert t["long context, w4a8kv4 / bf16 (FA3)"]["met"] is True
    es.append(_e("llama3-8b-L32", "w4a8kv4", "throughput", output_tokens_per_second=3500.0))  # a rerun, slower
    t = {x["target"]: x for x in R.targets(es)}
    assert t["saturation throughput, w4a8kv4 / marlin"]["met"] is False
    assert "MISSED by 27%" in R.render(es)
    R.write_summary(es, tmp_path / "ab.json")
    s = json.loads((tmp_path / "ab.json").read_text())
    assert len(s["entries"]) == 6 * 5 + 1 and all("samples" not in e for e in s["entries"])


def test_plots_and_replot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "ab.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _synthetic_results()))
    assert ab.main(["--replot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Issue #6 targets" in out
    for name in ("ab_serve.png", "ab_latency.png", "ab_throughput.png"):
        assert (tmp_path / name).stat().st_size > 10_000, name


# --- whole runs against a stand-in vLLM -----------------------------------------------------

@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    monkeypatch.setattr(S, "VLLM_CLI", (sys.executable, FAKE))
    monkeypatch.setattr(ab, "LONGCTX_CLI", (sys.executable, FAKE, "longctx"))
    pids = tmp_path / "fake-pids"
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(pids))
    work = tmp_path / "work"
    shape = dataclasses.replace(syn.LLAMA3_8B, layers=2)
    for kind in syn.CKPT_KINDS:  # --no-build: folders that look built
        d = syn.ckpt_dir(work, shape, kind, syn.MIXPREC_GROUP if kind.startswith("mixprec") else None)
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
    return pids, work


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _args(tmp_path, work, *extra):
    return ["--out", str(tmp_path / "out"), "--work", str(work), "--layers", "2", "--no-build", "--min-run", "1",
            "--concurrency", "1,8", "--num-prompts", "16", *extra]


def test_full_run_resume_and_mirror(fake_vllm, tmp_path, capsys):
    pids, work = fake_vllm
    args = _args(tmp_path, work, "--arms", "bf16,marlin,machete,w4a8kv4", "--mirror", str(tmp_path / "mirror"))
    assert ab.main(args) == 0
    out = capsys.readouterr().out
    es = R.load_jsonl(tmp_path / "out" / "ab.jsonl")
    assert len(es) == 4 * (1 + 2 + 1) and all(e["status"] == "ok" for e in es), out
    assert not any(e.get("warnings") for e in es)
    by = {(e["arm"], e["workload"], e["concurrency"]): e for e in es}
    assert by[("marlin", "throughput", None)]["facts"]["kernels"] == ["MarlinLinearKernel for AutoGPTQLinearMethod"]
    assert by[("machete", "serve", 8)]["facts"]["kernels"] == ["MacheteLinearKernel for AutoGPTQLinearMethod"]
    assert by[("w4a8kv4", "longctx", None)]["facts"]["attention_backend"] == "CUSTOM"
    assert by[("bf16", "throughput", None)]["metrics"]["output_tokens_per_second"] == 5120.0
    assert by[("bf16", "throughput", None)]["cmd"].startswith("vllm bench throughput --model ")
    s = by[("w4a8kv4", "serve", 8)]["samples"]
    assert len(s["ttft_ms"]) == 16 and s["tpot_ms"][0] == pytest.approx(10.8)
    assert len(by[("w4a8kv4", "serve", 1)]["samples"]["tpot_ms"]) == 8
    assert "Issue #6 targets" in out and "not measured" in out  # fp8 was not run
    mirror = sorted(p.name for p in (tmp_path / "mirror").iterdir())
    assert mirror == ["ab-logs.tar.gz", "ab.json", "ab.jsonl"]
    with tarfile.open(tmp_path / "mirror" / "ab-logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/llama3-8b-L2-marlin-serve.log" in names and "raw/llama3-8b-L2-w4a8kv4-serve-c8.json" in names
    assert not any(_alive(int(p)) for p in pids.read_text().split())  # servers and children all stopped
    assert (tmp_path / "out" / "ab.pids").read_text() == ""
    # --resume: nothing left to do, nothing appended
    assert ab.main(args + ["--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert len(R.load_jsonl(tmp_path / "out" / "ab.jsonl")) == len(es)


def test_time_limit_stops_a_hung_run(fake_vllm, tmp_path, monkeypatch):
    pids, work = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_HANG", "throughput")
    t0 = time.time()
    assert ab.main(_args(tmp_path, work, "--arms", "bf16", "--workloads", "throughput,longctx",
                         "--time-limit", "3")) == 1
    assert time.time() - t0 < 30
    es = {e["workload"]: e for e in R.load_jsonl(tmp_path / "out" / "ab.jsonl")}
    assert es["throughput"]["status"] == "timeout" and "GPU KV cache size" in es["throughput"]["log_tail"]
    assert es["longctx"]["status"] == "ok"  # the next run still happens
    assert not any(_alive(int(p)) for p in pids.read_text().split())


def test_server_that_never_gets_healthy(fake_vllm, tmp_path, monkeypatch):
    pids, work = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_HANG", "serve")
    assert ab.main(_args(tmp_path, work, "--arms", "w4a8", "--workloads", "serve", "--startup-timeout", "3")) == 1
    es = R.load_jsonl(tmp_path / "out" / "ab.jsonl")
    assert [(e["concurrency"], e["status"]) for e in es] == [(1, "failed"), (8, "failed")]
    assert "not healthy in 3 s" in es[0]["error"]
    assert not any(_alive(int(p)) for p in pids.read_text().split())


def test_budget_too_small_starts_nothing(fake_vllm, tmp_path, capsys):
    pids, work = fake_vllm
    assert ab.main(_args(tmp_path, work, "--arms", "bf16", "--workloads", "throughput", "--budget", "10",
                         "--min-run", "60")) == 3
    assert "budget exhausted" in capsys.readouterr().out
    assert not (tmp_path / "out" / "ab.jsonl").exists() and not pids.exists()


def test_sigterm_stops_children_and_keeps_results(fake_vllm, tmp_path):
    """What a 10-minute limit does to a call: the harness is killed mid-run."""
    pids, work = fake_vllm
    code = (f"import sys; from vllm_mixprec.eval import ab, serve as S; S.VLLM_CLI = ({sys.executable!r}, {FAKE!r}); "
            f"ab.LONGCTX_CLI = ({sys.executable!r}, {FAKE!r}, 'longctx'); "
            f"sys.exit(ab.main({_args(tmp_path, work, '--arms', 'bf16,fp8', '--workloads', 'throughput')!r}))")
    env = {**os.environ, "FAKE_VLLM_HANG": "throughput"}
    env.pop("PYTEST_CURRENT_TEST", None)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    t0 = time.time()
    while not (pids.exists() and pids.read_text().strip()) and time.time() - t0 < 60:
        time.sleep(0.2)
    assert pids.exists(), proc.communicate()[0]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert "interrupted" in out and proc.returncode != 0
    assert not any(_alive(int(p)) for p in pids.read_text().split())


def test_aba_report(tmp_path, capsys):
    """gpu_ab.sh aba's table: each arm against the mean of the first arm's rounds at the same
    model, workload and concurrency, with that arm's drift and a serve row's median TPOT; a round
    not run yet is named."""
    rounds = [[_e("m", "w4a8kv4-codesorder", "throughput", output_tokens_per_second=1000.0),
               _e("m", "w4a8kv4-codesorder", "serve", 1, output_throughput=100.0, median_tpot_ms=9.876)],
              [_e("m", "w4a8kv4", "throughput", output_tokens_per_second=990.0),
               _e("m", "w4a8kv4", "throughput", status="failed")],  # the last line of a key counts
              [_e("m", "w4a8kv4-codesorder", "throughput", output_tokens_per_second=1020.0)]]
    rounds[1] = rounds[1][::-1]  # the ok one last
    rows = R.aba(rounds)
    assert [(r["round"], r["arm"], r["workload"]) for r in rows] == [
        (1, "w4a8kv4-codesorder", "throughput"), (1, "w4a8kv4-codesorder", "serve"),
        (2, "w4a8kv4", "throughput"), (3, "w4a8kv4-codesorder", "throughput")]
    assert rows[2]["vs_first"] == pytest.approx(990 / 1010)
    assert rows[0]["drift"] == pytest.approx(0.02) and rows[2]["drift"] == pytest.approx(0.02)
    assert rows[1]["drift"] is None and rows[1]["tpot_ms"] == 9.876 and rows[0]["tpot_ms"] is None
    dirs = []
    for i, entries in enumerate(rounds[:2], 1):
        d = tmp_path / f"aba-{i}"
        d.mkdir()
        (d / "ab.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
        dirs.append(str(d))
    assert ab.main(["--aba-report", *dirs, str(tmp_path / "aba-3")]) == 0
    out = capsys.readouterr().out
    assert "0.990x" in out and "9.88" in out and "round 3" in out and "no results yet" in out
    with pytest.raises(SystemExit, match="no results"):
        ab.main(["--aba-report", str(tmp_path / "aba-3")])
