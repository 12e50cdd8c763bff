"""The real-model check's CPU side: the parts that carry models to the GPU host (eval/modelpack.py,
scripts/gpu_models.sh) and the comparisons of scripts/real_model_check.py (eval/realcheck.py) on
canned vLLM responses, without a server."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_mixprec.eval import modelpack as MP
from vllm_mixprec.eval import realcheck as RC
from vllm_mixprec.quantize.models import TEXTS as KNOWN_TEXTS

REPO = Path(__file__).resolve().parents[2]


# --- packing ------------------------------------------------------------------------------------

def _save_st(path: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _hf_from_gguf_rows(x: np.ndarray, n_head: int | None) -> np.ndarray:
    """transformers' reverse permutation of llama q/k rows, written as transformers writes it."""
    if n_head is None:
        return x
    w = x.reshape(n_head, x.shape[0] // n_head // 2, 2, *x.shape[1:])
    return w.swapaxes(2, 1).reshape(x.shape)


@pytest.fixture
def fake_models(tmp_path):
    """A GGUF, the bf16 folder converted from it (gguf-py dequantize + torch bf16, q/k rows
    permuted as transformers does), a second folder sharing tensors and a file, and a text."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_head_count(4)
    w.add_head_count_kv(2)
    hf = {}
    specs = [("model.embed_tokens.weight", "token_embd.weight", (96, 64), T.Q8_0, None),
             ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", (64, 64), T.Q4_1, 4),
             ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", (32, 64), T.Q4_1, 2),
             ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight", (64, 128), T.Q4_1, None)]
    for hf_name, g_name, shape, qt, heads in specs:
        q = quants.quantize(rng.standard_normal(shape).astype(np.float32), qt)
        w.add_tensor(g_name, q, raw_dtype=qt)
        hf[hf_name] = torch.from_numpy(_hf_from_gguf_rows(quants.dequantize(q, qt), heads).copy()).to(torch.bfloat16)
    norm = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    w.add_tensor("blk.0.attn_norm.weight", norm)
    hf["model.layers.0.input_layernorm.weight"] = torch.from_numpy(norm).to(torch.bfloat16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf["model.norm.weight"] = torch.randn(64).to(torch.bfloat16)  # not in the GGUF: stored raw
    bf16 = tmp_path / "src" / "bf16"
    bf16.mkdir(parents=True)
    _save_st(bf16 / "model.safetensors", hf)
    (bf16 / "config.json").write_text('{"model_type": "llama"}\n')
    (bf16 / "tokenizer.json").write_bytes(os.urandom(30000))
    demo = tmp_path / "src" / "demo"
    demo.mkdir()
    _save_st(demo / "model.safetensors", {
        "model.embed_tokens.weight": hf["model.embed_tokens.weight"],  # shared with bf16: a copy segment
        "model.layers.0.mlp.down_proj.qweight": torch.from_numpy(rng.integers(0, 255, (64, 64), dtype=np.uint8))})
    (demo / "config.json").write_text('{"quantization_config": {"quant_method": "mixprec"}}\n')
    (demo / "tokenizer.json").write_bytes((bf16 / "tokenizer.json").read_bytes())
    text = tmp_path / "src" / "t.txt"
    text.write_text("Some text.\n" * 500)
    items = [("text/t.txt", text), ("models/bf16", bf16), ("demo", demo)]
    return tmp_path, items, {"models/bf16": tmp_path / "m.gguf"}


def _pack(tmp_path, items, ggufs, part_mib=0.03):
    return MP.pack(items, tmp_path / "parts", part_mib=part_mib, ggufs=ggufs, preset=1,
                   manifest_room=12 * 1024, log=lambda *a: None)


def _stash_all(tmp_path, plan, dest, skip=()):
    for k in range(1, plan["parts"] + 1):
        if k not in skip:
            MP.stash(tmp_path / "parts" / f"part{k}", dest, log=lambda *a: None)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and ".parts" not in p.parts}


def test_pack_round_trip(fake_models):
    tmp_path, items, ggufs = fake_models
    plan = _pack(tmp_path, items, ggufs)
    assert plan["parts"] >= 3
    for k in range(1, plan["parts"] + 1):
        part = tmp_path / "parts" / f"part{k}"
        assert sum(p.stat().st_size for p in part.iterdir()) <= 0.03 * MP.MIB
        assert json.loads((part / MP.MANIFEST).read_text())["part"] == k
    dest = tmp_path / "host"
    _stash_all(tmp_path, plan, dest)
    _stash_all(tmp_path, plan, dest)  # again: nothing changes
    MP.assemble(dest, log=lambda *a: None)
    want = {}
    for d, src in items:
        want.update({f"{d}/{p}": b for p, b in _files(src).items()} if src.is_dir() else {d: src.read_bytes()})
    assert _files(dest) == want
    kinds = {e["path"]: [s[0] for s in e["segments"]] for e in plan["files"]}
    # every GGUF tensor is rebuilt from its blocks, q/k through the head permutation; the final
    # norm (not in the GGUF) is raw; the demo's embedding and tokenizer are copies
    assert kinds["models/bf16/model.safetensors"].count("ggml") == 5
    assert kinds["models/bf16/model.safetensors"].count("raw") == 2  # header + model.norm
    demo = kinds["demo/model.safetensors"]
    assert demo[0] == "raw" and sorted(demo[1:]) == ["copy", "raw"]
    assert kinds["demo/tokenizer.json"] == ["copy"]
    MP.assemble(dest, log=lambda *a: None)  # again: files already right are kept


def test_decode_ggml_matches_gguf_py_and_torch():
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    x = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32) * 3
    for qt, codec in ((T.Q4_1, "q4_1"), (T.Q8_0, "q8_0")):
        q = quants.quantize(x, qt)
        want = torch.from_numpy(quants.dequantize(q, qt)).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        assert MP.decode_ggml(codec, q.tobytes()) == want
    bf16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    assert MP.decode_ggml("f32", x.tobytes()) == bf16
    # K-quants (Qwen2.5's Q4_K_M): gguf-py cannot quantize them, so random blocks with finite d/dmin
    rng = np.random.default_rng(2)
    for qt, codec in ((T.Q4_K, "q4_k"), (T.Q6_K, "q6_k")):
        size = MP.GGML_BLOCK[codec][0]
        blocks = rng.integers(0, 256, (16, size), dtype=np.uint8)
        scales = (rng.standard_normal((16, 2)) * 0.01).astype("<f2").view(np.uint8)
        if codec == "q4_k":
            blocks[:, 0:4] = scales  # d, dmin
        else:
            blocks[:, 208:210] = scales[:, :2]
        want = torch.from_numpy(quants.dequantize(blocks, qt)).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        assert MP.decode_ggml(codec, blocks.tobytes()) == want, codec
    with pytest.raises(MP.PackError, match="whole number"):
        MP.decode_ggml("q4_1", b"\0" * 21)
    with pytest.raises(MP.PackError, match="unknown"):
        MP.decode_ggml("q5_k", b"")
    assert gguf  # imported for the skip


def test_a_tensor_the_gguf_does_not_reproduce_is_stored_raw(fake_models):
    tmp_path, items, ggufs = fake_models
    from safetensors.torch import load_file

    st = items[1][1] / "model.safetensors"
    t = load_file(str(st))
    t["model.layers.0.mlp.down_proj.weight"][0, 0] += 1  # no longer what the blocks decode to
    _save_st(st, t)
    plan = _pack(tmp_path, items, ggufs)
    segs = next(e for e in plan["files"] if e["path"] == "models/bf16/model.safetensors")["segments"]
    assert [s[0] for s in segs].count("ggml") == 4
    dest = tmp_path / "host"
    _stash_all(tmp_path, plan, dest)
    MP.assemble(dest, log=lambda *a: None)
    assert (dest / "models/bf16/model.safetensors").read_bytes() == st.read_bytes()


def test_missing_part_is_named(fake_models):
    tmp_path, items, ggufs = fake_models
    plan = _pack(tmp_path, items, ggufs)
    dest = tmp_path / "host"
    _stash_all(tmp_path, plan, dest, skip={2})
    with pytest.raises(MP.PackError, match=r"parts \[2\] of %d" % plan["parts"]):
        MP.assemble(dest, log=lambda *a: None)
    assert MP.main(["assemble", "--dest", str(dest)]) == 3
    with pytest.raises(MP.PackError, match="no manifest"):
        MP.assemble(tmp_path / "nothing-stashed", log=lambda *a: None)


def test_sha_mismatch_is_caught(fake_models):
    tmp_path, items, ggufs = fake_models
    plan = _pack(tmp_path, items, ggufs)
    part = tmp_path / "parts" / "part2"
    chunk = next(p for p in part.iterdir() if p.name != MP.MANIFEST)
    good = chunk.read_bytes()
    chunk.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(MP.PackError, match="sha256 differs"):
        MP.stash(part, tmp_path / "host", log=lambda *a: None)
    chunk.write_bytes(good)
    dest = tmp_path / "host"
    _stash_all(tmp_path, plan, dest)
    stored = dest / ".parts" / chunk.name  # corrupted on the host after the stash, same size
    stored.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(MP.PackError, match="sha256 differs from the manifest"):
        MP.assemble(dest, log=lambda *a: None)
    stored.write_bytes(good)
    m = json.loads((dest / ".parts" / MP.MANIFEST).read_text())  # a file that does not rebuild to its sha256
    m["files"][-1]["sha256"] = "0" * 64
    (dest / ".parts" / MP.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(MP.PackError, match="rebuilt file's sha256 differs"):
        MP.assemble(dest, log=lambda *a: None)


def test_a_part_of_another_pack_replaces_the_old_one(fake_models):
    tmp_path, items, ggufs = fake_models
    plan = _pack(tmp_path, items, ggufs)
    dest = tmp_path / "host"
    _stash_all(tmp_path, plan, dest)
    (items[0][1]).write_text("Other text.\n" * 400)
    plan2 = _pack(tmp_path, items, ggufs)
    assert plan2["pack_id"] != plan["pack_id"]
    msgs = []
    MP.stash(tmp_path / "parts" / "part1", dest, log=msgs.append)
    assert "replacing" in msgs[0]
    with pytest.raises(MP.PackError, match="were not stashed"):
        MP.assemble(dest, log=lambda *a: None)


def test_pack_arguments(tmp_path, fake_models):
    _, items, ggufs = fake_models
    with pytest.raises(MP.PackError, match="not an --item"):
        MP.pack(items, tmp_path / "o", ggufs={"elsewhere": Path("x.gguf")})
    with pytest.raises(MP.PackError, match="distinct relative"):
        MP.pack([("a", items[0][1]), ("a", items[0][1])], tmp_path / "o")
    with pytest.raises(MP.PackError, match="distinct relative"):
        MP.pack([("../a", items[0][1])], tmp_path / "o")
    with pytest.raises(MP.PackError, match="does not exist"):
        MP.pack([("a", tmp_path / "missing")], tmp_path / "o")
    with pytest.raises(MP.PackError, match="no room"):
        MP.pack(items, tmp_path / "o", part_mib=0.1)
    with pytest.raises(MP.PackError, match="not DEST=PATH"):
        MP._pairs(["nodest"], "--item")
    with pytest.raises(SystemExit):
        MP.main(["pack", "--out", str(tmp_path / "o")])


def _python3_shim(tmp_path: Path) -> dict:
    """gpu_models.sh calls `python3`: make it this interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MIXPREC_MODELS": str(tmp_path / "host")}


def test_gpu_models_sh_stash_and_assemble(fake_models):
    tmp_path, items, ggufs = fake_models
    plan = _pack(tmp_path, items, ggufs)
    env = _python3_shim(tmp_path)
    script = str(REPO / "scripts" / "gpu_models.sh")
    run = lambda *a: subprocess.run(["bash", script, *a], env=env, capture_output=True, text=True)  # noqa: E731
    for k in range(1, plan["parts"]):
        assert run("stash", str(tmp_path / "parts" / f"part{k}")).returncode == 0
    r = run("assemble")
    assert r.returncode == 3 and f"parts [{plan['parts']}]" in r.stderr
    r = run("stash", str(tmp_path / "parts" / f"part{plan['parts']}"))
    assert r.returncode == 0 and "missing: none" in r.stdout
    r = run("assemble")
    assert r.returncode == 0, r.stderr
    assert "models/bf16: 3 file(s)" in r.stdout
    assert run().returncode == 2
    assert run("stash").returncode != 0
    assert run("stash", str(tmp_path / "no-such-part")).returncode == 3


# --- greedy comparison -----------------------------------------------------------------------------

def completion(tokens: list[int], top: list[dict[int, float]] | None = None) -> dict:
    """/v1/completions as vLLM 0.26 answers with return_token_ids and return_tokens_as_token_ids."""
    top = top or [{t: -0.1} for t in tokens]
    return {"choices": [{"text": "x", "token_ids": tokens,
                         "logprobs": {"top_logprobs": [{f"token_id:{k}": v for k, v in s.items()} for s in top]}}]}


def test_greedy_identical_and_diverging():
    ref = [RC.parse_greedy(completion(list(range(64)))) for _ in range(3)]
    late = list(range(40)) + [999] + list(range(41, 64))  # diverges at 40: passes (>= 32)
    early = list(range(10)) + [7] + list(range(11, 64))
    top_ref = [{t: -0.1} for t in range(64)]
    top_ref[10] = {10: -0.6, 7: -0.9}
    top_early = [{t: -0.1} for t in early]
    top_early[10] = {7: -0.5, 10: -0.8}
    ref[2] = RC.parse_greedy(completion(list(range(64)), top_ref))
    got = [RC.parse_greedy(completion(list(range(64)))), RC.parse_greedy(completion(late)),
           RC.parse_greedy(completion(early, top_early))]
    c = RC.compare_greedy(ref, got)
    assert not c["pass"] and c["passed"] == 2 and c["prompts"] == 3
    r0, r1, r2 = c["per_prompt"]
    assert r0["first_diff"] is None and r0["agree"] == 64 and r0["pass"]
    assert r1["agree"] == 40 and r1["pass"] and r1["ref_gap"] is None  # 999 is outside the top-k
    assert r2["agree"] == 10 and not r2["pass"]
    assert (r2["ref_token"], r2["other_token"]) == (10, 7)
    assert r2["ref_gap"] == pytest.approx(0.3) and r2["other_gap"] == pytest.approx(0.3)
    assert RC.compare_greedy(ref[:2], got[:2])["pass"]
    assert not RC.compare_greedy([], [])["pass"]
    with pytest.raises(ValueError, match="reference completions"):
        RC.compare_greedy(ref, got[:2])


def test_greedy_short_answer_fails_the_minimum():
    ref = [RC.parse_greedy(completion(list(range(64))))]
    short = [RC.parse_greedy(completion(list(range(20))))]  # identical, but only 20 tokens to compare
    assert not RC.compare_greedy(ref, short)["pass"]


def test_parse_greedy_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="no token_ids"):
        RC.parse_greedy({"choices": [{"text": "x", "logprobs": {"top_logprobs": []}}]})
    bad = completion([1, 2])
    bad["choices"][0]["logprobs"]["top_logprobs"] = [{"hello": -0.1}, {"token_id:2": -0.1}]
    with pytest.raises(ValueError, match="token_id:N"):
        RC.parse_greedy(bad)
    bad = completion([1, 2])
    bad["choices"][0]["logprobs"]["top_logprobs"].pop()
    with pytest.raises(ValueError, match="2 tokens but 1"):
        RC.parse_greedy(bad)
    body = RC.greedy_body("m", "p")
    assert body["temperature"] == 0 and body["ignore_eos"] and body["max_tokens"] >= RC.MIN_AGREE
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]


# --- perplexity ---------------------------------------------------------------------------------

def prompt_logprobs_response(ids: list[int], lps: list[float], echo: list[int] | None = None) -> dict:
    """prompt_logprobs as vLLM serialises them: None first, then {str(id): Logprob} per position."""
    plp = [None] + [{str(t): {"logprob": lp, "rank": 1, "decoded_token": "x"}} for t, lp in zip(ids[1:], lps)]
    return {"choices": [{"text": "y", "prompt_logprobs": plp, "prompt_token_ids": echo if echo is not None else ids}]}


def test_window_nll():
    ids = [5, 6, 7, 8]
    nll, n = RC.window_nll(prompt_logprobs_response(ids, [-1.0, -2.0, -0.5]), ids)
    assert (nll, n) == (3.5, 3)
    body = RC.ppl_body("m", ids)
    assert body["prompt"] == ids and body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
    with pytest.raises(ValueError, match="a BOS added"):
        RC.window_nll(prompt_logprobs_response(ids, [-1.0] * 3, echo=[1, *ids]), ids)
    resp = prompt_logprobs_response(ids, [-1.0] * 3)
    resp["choices"][0]["prompt_logprobs"][2] = {"99": {"logprob": -1.0}}
    with pytest.raises(ValueError, match="no entry for token 7"):
        RC.window_nll(resp, ids)
    with pytest.raises(ValueError, match="-9999"):
        RC.window_nll(prompt_logprobs_response(ids, [-1.0, -9999.0, -1.0]), ids)
    resp = prompt_logprobs_response(ids, [-1.0] * 3)
    resp["choices"][0]["prompt_logprobs"].pop()
    with pytest.raises(ValueError, match="3 entries for 4 ids"):
        RC.window_nll(resp, ids)


def test_compare_ppl():
    ref = {"a": {"nll": 4000 * math.log(30.0), "tokens": 4000}, "b": {"nll": 4000 * math.log(20.0), "tokens": 4000}}
    near = {"a": {"nll": 4000 * math.log(30.0 * 1.009), "tokens": 4000},
            "b": {"nll": 4000 * math.log(19.9), "tokens": 4000}}
    c = RC.compare_ppl(near, ref)
    assert c["pass"] and c["texts"]["a"]["rel"] == pytest.approx(0.009)
    far = {**near, "b": {"nll": 4000 * math.log(20.0 * 1.02), "tokens": 4000}}
    c = RC.compare_ppl(far, ref)
    assert not c["pass"] and c["texts"]["a"]["pass"] and not c["texts"]["b"]["pass"]
    c = RC.compare_ppl({**near, "b": {"nll": 1.0, "tokens": 3999}}, ref)
    assert not c["pass"] and "3999 tokens" in c["texts"]["b"]["error"]
    c = RC.compare_ppl({"a": near["a"]}, ref)
    assert not c["pass"] and c["texts"]["b"]["error"] == "not measured"


def test_token_windows_are_the_cpu_paths(tmp_path):
    from vllm_mixprec.eval import perplexity as P
    from vllm_mixprec.quantize.testing import char_tokenizer

    folder = tmp_path / "tok"
    char_tokenizer().save_pretrained(str(folder))
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 200)
    ws = RC.token_windows(folder, str(text), n_tokens=1000, window=300)
    from transformers import AutoTokenizer

    from vllm_mixprec.quantize.models import load_text
    want = P.windows(P.tokenize(AutoTokenizer.from_pretrained(str(folder)), load_text(str(text))), 1000, 300)
    assert ws == [w.tolist() for w in want] and [len(w) for w in ws] == [300, 300, 300, 100]
    assert RC.ids_sha256(ws) != RC.ids_sha256(ws[:-1])


# --- the verdict and main(), with canned arms -----------------------------------------------------

def _reference(ppl: dict[str, float]) -> dict:
    kv = lambda name: RC.PPL_RUNS[name].kv if name in RC.PPL_RUNS else "none"  # noqa: E731
    return {"models": {}, "command": "test", "runs": {
        name: {"kv": kv(name), "kv_dtype": None if kv(name) == "none" else "served",
               "kv_bias_aware": name in RC.PPL_RUNS and RC.PPL_RUNS[name].bias_aware,
               "texts": {t: {"nll": 100 * math.log(p), "tokens": 100, "ppl": p, "ids_sha256": "h"} for t in RC.TEXTS}}
        for name, p in ppl.items()}}


def _arm_result(name: str, greedy_tokens=None, ppl=None) -> dict:
    res = {"cmd": name, "mode": "test"}
    if greedy_tokens is not None:
        res["greedy"] = [{"tokens": greedy_tokens, "top": [{t: -0.1} for t in greedy_tokens]} for _ in RC.PROMPTS]
    if ppl is not None:
        res["ppl"] = {t: {"nll": 100 * math.log(ppl), "tokens": 100} for t in RC.TEXTS}
    return res


def test_verdict():
    ref = _reference({"bf16": 30.0, "w4a8-kv8": 45.0, "w4a8": 44.0})
    toks = list(range(64))
    arms = {"bf16": _arm_result("bf16", toks, 30.1), "bf16-kv8": _arm_result("bf16-kv8", toks),
            "bf16-kv4": _arm_result("bf16-kv4", [0] * 64), "w4a8-kv8": _arm_result("w4a8-kv8", ppl=45.9),
            "bf16-triton": _arm_result("bf16-triton", toks[:40] + [0] * 24),
            "w4a8": {"error": "server exited with 1"}}
    v = RC.verdict(arms, ref, list(RC.ARMS))
    by = {(c["arm"], c["what"]): c for c in v["checks"]}
    assert by[("bf16", "ppl")]["pass"] and by[("bf16-kv8", "greedy")]["pass"]
    assert not by[("bf16-kv4", "greedy")]["pass"] and not by[("bf16-kv4", "greedy")]["criterion"]  # reported only
    assert by[("bf16-triton", "greedy")]["passed"] == len(RC.PROMPTS)  # 40 identical tokens
    assert not by[("bf16-triton", "greedy")]["criterion"]
    assert not by[("w4a8-kv8", "ppl")]["pass"]  # +2%
    assert not by[("w4a8", "server")]["pass"]
    assert not v["pass"]
    assert RC.verdict(arms, ref, ["bf16", "bf16-kv8", "bf16-kv4"])["pass"]
    lines = "\n".join(RC.report_lines(v, arms))
    assert "[info] bf16-kv4" in lines and "[FAIL] w4a8-kv8" in lines and "server exited" in lines
    no_ref = RC.verdict({"bf16-kv8": arms["bf16-kv8"]}, ref, ["bf16-kv8"])
    assert not no_ref["pass"] and "no bf16 reference" in no_ref["checks"][0]["error"]


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A models dir with stand-in folders and texts, a reference, and run_arm answering canned results."""
    models = tmp_path / "models"
    for rel in RC.MODELS.values():
        (models / rel).mkdir(parents=True)
        (models / rel / "config.json").write_text("{}")
    (models / "text").mkdir()
    for t in RC.TEXTS:
        (models / "text" / f"{t}.txt").write_text("x")
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(_reference({"bf16": 30.0, "w4a8-kv8": 45.0, "w4a8": 44.0, "qwen-bf16": 15.0,
                                          "qwen-kv8": 15.3, "qwen-w4a8-kv4": 17.0, "qwen-sakc-kv8": 15.02})))
    monkeypatch.setattr(RC, "token_windows", lambda folder, text: [[1, 2]])
    monkeypatch.setattr(RC, "ids_sha256", lambda ws: "h")
    canned = {"bf16": _arm_result("bf16", list(range(64)), 30.0), "bf16-kv8": _arm_result("bf16-kv8", list(range(64))),
              "bf16-kv4": _arm_result("bf16-kv4", list(range(64))), "w4a8-kv8": _arm_result("w4a8-kv8", ppl=45.2),
              "bf16-triton": _arm_result("bf16-triton", list(range(64))),
              "qwen-bf16": _arm_result("qwen-bf16", list(range(64)), 15.0), "qwen-kv8": _arm_result("qwen-kv8", ppl=15.2),
              "qwen-w4a8-kv4": _arm_result("qwen-w4a8-kv4", ppl=17.1), "w4a8": _arm_result("w4a8", ppl=44.1),
              "qwen-sakc-kv8": _arm_result("qwen-sakc-kv8", ppl=15.03)}
    started = []

    def fake_run_arm(arm, folder, out, windows, deadline, log=print):
        started.append(arm.name)
        assert folder.is_dir() and (arm.ppl is None) == (windows == {})
        return {**canned[arm.name], "wall_s": 1.0}

    monkeypatch.setattr(RC, "run_arm", fake_run_arm)
    monkeypatch.setattr(RC, "kv_none_copy", lambda folder, dst: folder)
    return models, ref, canned, started, tmp_path


def test_main_split_over_calls(host):
    models, ref, canned, started, tmp = host
    base = ["--models-dir", str(models), "--reference", str(ref)]
    assert RC.main([*base, "--out", str(tmp / "o1"), "--arms", "bf16,bf16-triton,bf16-kv8,bf16-kv4"]) == 0
    s = json.loads((tmp / "o1" / "real_model_check.json").read_text())
    assert s["status"] == "PASS" and s["all_arms_on_this_host"]["missing"] == ["w4a8-kv8", "w4a8", "qwen-bf16",
                                                                               "qwen-kv8", "qwen-w4a8-kv4",
                                                                               "qwen-sakc-kv8"]
    assert RC.main([*base, "--out", str(tmp / "o2"), "--arms", "rest"]) == 0
    assert started == list(RC.ARMS)
    s = json.loads((tmp / "o2" / "real_model_check.json").read_text())
    assert s["all_arms_on_this_host"]["status"] == "PASS" and set(s["arms"]) == set(RC.ARMS)
    assert "REAL MODEL CHECK PASS" in (tmp / "o2" / "real_model_check.log").read_text()
    assert RC.main([*base, "--out", str(tmp / "o3"), "--arms", "rest"]) == 0  # nothing left: the whole verdict
    assert started == list(RC.ARMS)


def test_main_fails_and_budget_skips(host):
    models, ref, canned, started, tmp = host
    base = ["--models-dir", str(models), "--reference", str(ref), "--fresh"]
    canned["bf16-kv8"]["greedy"][3] = {"tokens": [0] * 64, "top": [{0: -0.1}] * 64}
    assert RC.main([*base, "--out", str(tmp / "o1"), "--arms", "bf16,bf16-kv8"]) == 1
    s = json.loads((tmp / "o1" / "real_model_check.json").read_text())
    assert s["status"] == "FAIL"
    assert RC.main([*base, "--out", str(tmp / "o2"), "--arms", "bf16,w4a8", "--budget", "120"]) == 3
    s = json.loads((tmp / "o2" / "real_model_check.json").read_text())
    assert s["status"] == "INCOMPLETE" and s["skipped"] == ["bf16"] and s["arms_this_call"] == ["w4a8"]


def test_main_refuses_other_checkpoints_and_missing_inputs(host):
    models, ref, canned, started, tmp = host
    r = json.loads(ref.read_text())
    r["models"] = {"smollm2-135m": {"config.json": "0" * 64}}
    ref.write_text(json.dumps(r))
    base = ["--models-dir", str(models), "--reference", str(ref), "--out", str(tmp / "o")]
    assert RC.main([*base, "--arms", "bf16"]) == 1
    assert "not the file the CPU reference used" in (tmp / "o" / "real_model_check.log").read_text()
    assert RC.main([*base[:2], "--reference", str(tmp / "none.json"), *base[4:]]) == 1
    r["models"] = {}
    ref.write_text(json.dumps(r))
    (models / "text" / "botchan.txt").unlink()
    assert RC.main([*base, "--arms", "bf16-kv8"]) == 1  # runs (greedy needs no text), but has no bf16 to compare with
    assert "no bf16 reference" in (tmp / "o" / "real_model_check.log").read_text()
    assert RC.main([*base, "--arms", "w4a8"]) == 1
    assert "botchan.txt is missing" in (tmp / "o" / "real_model_check.log").read_text()
    assert started == ["bf16-kv8"]


def test_main_refuses_a_kv_reference_computed_from_float32_kv(host):
    """A KV run pinned before the CPU path rounded K/V to the served dtype is stale: refused by name."""
    models, ref, canned, started, tmp = host
    r = json.loads(ref.read_text())
    del r["runs"]["qwen-kv8"]["kv_dtype"]
    ref.write_text(json.dumps(r))
    base = ["--models-dir", str(models), "--reference", str(ref), "--fresh", "--out", str(tmp / "o")]
    assert RC.main([*base, "--arms", "qwen-bf16,qwen-kv8"]) == 1
    assert "the CPU reference of qwen-kv8 quantized float32 K/V" in (tmp / "o" / "real_model_check.log").read_text()
    assert started == []
    assert RC.main([*base, "--arms", "qwen-bf16"]) == 0  # a 16-bit KV run does not care


def test_main_refuses_a_kv4_reference_without_bias_aware_k(host):
    """The backend serves the real Qwen's KV4 bias-aware (its k biases reach 354): a CPU reference
    that quantized K as it is would not be the served model's, and is refused by name."""
    models, ref, canned, started, tmp = host
    r = json.loads(ref.read_text())
    assert RC.PPL_RUNS["qwen-w4a8-kv4"].bias_aware and r["runs"]["qwen-w4a8-kv4"]["kv_bias_aware"]
    r["runs"]["qwen-w4a8-kv4"]["kv_bias_aware"] = False
    ref.write_text(json.dumps(r))
    base = ["--models-dir", str(models), "--reference", str(ref), "--fresh", "--out", str(tmp / "o")]
    assert RC.main([*base, "--arms", "qwen-bf16,qwen-w4a8-kv4"]) == 1
    assert "the CPU reference of qwen-w4a8-kv4 has kv_bias_aware=False" in \
        (tmp / "o" / "real_model_check.log").read_text()
    assert started == []


def test_qwen_w4a8_kv4_arm_is_compiled_and_reads_every_key_from_the_cache():
    """The product on the real Qwen, compiled with CUDA graphs (the path of session 22's
    padding-row NaN), every key through the KV4 pages as its CPU reference quantizes them."""
    from vllm_mixprec.attention_backend import residual as R
    from vllm_mixprec.attention_backend.impl import ENV_PREFILL_EXACT

    arm = RC.ARMS["qwen-w4a8-kv4"]
    assert RC.PPL_RUNS[arm.ppl].kv == "kv4" and "--enforce-eager" not in arm.cmd_flags()
    assert arm.flags[:2] == ("--quantization", "mixprec") and "int4_per_token_head" in arm.flags
    assert dict(arm.env) == {R.ENV_TOKENS: "0", ENV_PREFILL_EXACT: "0"}
    assert RC.DERIVED[arm.model] == ("qwen2.5-coder-1.5b", "kv4")


def test_derived_model_is_built_from_its_source_once(tmp_path, monkeypatch):
    """The RTN export is made where the check needs it, only when its source is there, once."""
    from vllm_mixprec.quantize import rtn

    calls = []

    def fake_export(src, dst, kv):
        calls.append((src, dst, kv))
        dst.mkdir(parents=True)
        (dst / "config.json").write_text("{}")
    monkeypatch.setattr(rtn, "export_rtn_folder", fake_export)
    RC.ensure_derived(tmp_path, RC.QWEN_RTN, log=lambda m: None)
    assert calls == []  # no source folder: nothing to build from
    src = tmp_path / RC.MODELS["qwen2.5-coder-1.5b"]
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    RC.ensure_derived(tmp_path, RC.QWEN_RTN, log=lambda m: None)
    RC.ensure_derived(tmp_path, RC.QWEN_RTN, log=lambda m: None)
    assert calls == [(src, tmp_path / RC.MODELS[RC.QWEN_RTN], "kv4")]
    RC.ensure_derived(tmp_path, "smollm2-135m")  # not derived: untouched


def test_sakc_kv8_arm_serves_the_quantizers_kv8_recipe_for_qwen(tmp_path, monkeypatch):
    """Issue #3's KV8 recipe for Qwen (K centering + SmoothAttention folded into the bf16 weights)
    through vLLM's run-time KV8, every key from the cache as the CPU reference quantizes them; the
    folder is made on the host by the quantizer's own CLI from the bf16 folder, once."""
    from vllm_mixprec import cli
    from vllm_mixprec.attention_backend import residual as R
    from vllm_mixprec.attention_backend.impl import ENV_PREFILL_EXACT

    arm = RC.ARMS["qwen-sakc-kv8"]
    assert arm.model == RC.QWEN_SAKC and RC.PPL_RUNS[arm.ppl].kv == "kv8" and not RC.PPL_RUNS[arm.ppl].bias_aware
    assert arm.flags == RC.KV8 and "--quantization" not in arm.flags and "--enforce-eager" in arm.cmd_flags()
    assert dict(arm.env) == {R.ENV_TOKENS: "0", ENV_PREFILL_EXACT: "0"}
    src_name, recipe = RC.DERIVED[RC.QWEN_SAKC]
    args = cli.build_parser().parse_args(["quantize", "src", "dst", *recipe])
    assert (args.scheme, args.kv, args.k_centering, args.smooth_attention) == ("none", "none", True, True)
    calls = []

    def fake_cli(argv):
        calls.append(argv)
        dst = Path(argv[2])
        dst.mkdir(parents=True)
        (dst / "config.json").write_text("{}")
        return 0
    monkeypatch.setattr(cli, "main", fake_cli)
    src = tmp_path / RC.MODELS[src_name]
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="alice29.txt is missing"):  # the calibration text
        RC.ensure_derived(tmp_path, RC.QWEN_SAKC, log=lambda m: None)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "alice29.txt").write_text("x")
    RC.ensure_derived(tmp_path, RC.QWEN_SAKC, log=lambda m: None)
    RC.ensure_derived(tmp_path, RC.QWEN_SAKC, log=lambda m: None)
    assert calls == [["quantize", str(src), str(tmp_path / RC.MODELS[RC.QWEN_SAKC]), *recipe]]
    monkeypatch.setattr(cli, "main", lambda argv: 1)
    shutil.rmtree(tmp_path / RC.MODELS[RC.QWEN_SAKC])
    with pytest.raises(RuntimeError, match="failed"):
        RC.ensure_derived(tmp_path, RC.QWEN_SAKC, log=lambda m: None)


def test_model_files_pin_every_safetensors_shard(tmp_path):
    """A quantizer export may be sharded: every shard and the index are pinned, not a fixed name."""
    folder = tmp_path / RC.MODELS[RC.QWEN_SAKC]
    folder.mkdir(parents=True)
    for f in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors", "model.safetensors.index.json", "notes.txt"):
        (folder / f).write_text(f)
    assert sorted(RC.model_files(tmp_path, RC.QWEN_SAKC)) == sorted(
        ["config.json", "tokenizer.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
         "model.safetensors.index.json"])


def test_rest_runs_only_the_models_on_this_host(host):
    """Qwen's parts are optional: without its folder, `rest` leaves its arms out and says so."""
    models, ref, canned, started, tmp = host
    shutil.rmtree(models / RC.MODELS["qwen2.5-coder-1.5b"])
    for derived in (RC.QWEN_RTN, RC.QWEN_SAKC):  # made from the bf16 folder: not without it
        shutil.rmtree(models / RC.MODELS[derived])
    base = ["--models-dir", str(models), "--reference", str(ref), "--fresh", "--out", str(tmp / "o")]
    assert RC.main([*base, "--arms", "rest"]) == 0
    assert started == [n for n in RC.ARMS if not n.startswith("qwen")]
    log = (tmp / "o" / "real_model_check.log").read_text()
    assert "(no qwen2.5-coder-1.5b here)" in log
    s = json.loads((tmp / "o" / "real_model_check.json").read_text())
    assert s["status"] == "PASS" and s["all_arms_on_this_host"]["missing"] == ["qwen-bf16", "qwen-kv8", "qwen-w4a8-kv4",
                                                                               "qwen-sakc-kv8"]
    assert RC.main([*base, "--arms", "qwen-kv8"]) == 1  # asked for by name: refused, naming the folder
    assert "qwen2.5-coder-1.5b is not a model folder" in (tmp / "o" / "real_model_check.log").read_text()


def test_a_derived_model_that_cannot_be_made_leaves_the_other_arms_running(host, monkeypatch):
    """A pack without the calibration text (made before session 42): `rest` says why the folded
    Qwen is missing and runs every other arm; asked for by name, its arm is refused."""
    models, ref, canned, started, tmp = host
    shutil.rmtree(models / RC.MODELS[RC.QWEN_SAKC])
    base = ["--models-dir", str(models), "--reference", str(ref), "--fresh", "--out", str(tmp / "o")]
    assert RC.main([*base, "--arms", "rest"]) == 0
    assert started == [n for n in RC.ARMS if n != "qwen-sakc-kv8"]
    log = (tmp / "o" / "real_model_check.log").read_text()
    assert "FAIL: qwen2.5-coder-1.5b-sa-kc could not be made" in log and "alice29.txt is missing" in log
    assert RC.main([*base, "--arms", "qwen-sakc-kv8"]) == 1
    assert "qwen2.5-coder-1.5b-sa-kc is not a model folder" in (tmp / "o" / "real_model_check.log").read_text()


def test_greedy_is_compared_with_the_reference_of_its_own_model():
    assert RC.greedy_reference(RC.ARMS["bf16-kv8"]) == "bf16"
    assert RC.greedy_reference(RC.ARMS["qwen-kv8"]) == "qwen-bf16"


def test_cpu_reference_adds_runs_to_an_existing_file(tmp_path, monkeypatch):
    """--runs qwen-... keeps the SmolLM2 runs already in the file (they took their own CPU time)."""
    from vllm_mixprec.eval import perplexity

    out = tmp_path / "ref.json"
    texts = {t: KNOWN_TEXTS[t].sha256 for t in RC.TEXTS}
    old = {"n_tokens": RC.N_TOKENS, "window": RC.WINDOW, "texts": texts,
           "models": {"smollm2-135m": {"config.json": "a"}}, "runs": {"bf16": {"model": "smollm2-135m"}}}
    out.write_text(json.dumps(old))
    monkeypatch.setattr(perplexity, "evaluate", lambda folder, texts, n, w, kv_scheme, kv_dtype="served",
                        kv_bias_aware=False: {
        t: {"ppl": 15.0, "nll": 1.0, "tokens": 1} for t in texts})
    monkeypatch.setattr(RC, "model_files", lambda d, m: {"config.json": m})
    monkeypatch.setattr(RC, "token_windows", lambda folder, text: [[1, 2]])
    RC.cpu_reference(tmp_path, out, ["qwen-bf16"], "cmd")
    got = json.loads(out.read_text())
    assert set(got["runs"]) == {"bf16", "qwen-bf16"} and got["runs"]["bf16"] == {"model": "smollm2-135m"}
    assert got["models"] == {"smollm2-135m": {"config.json": "a"},
                             "qwen2.5-coder-1.5b": {"config.json": "qwen2.5-coder-1.5b"}}
    assert got["runs"]["qwen-bf16"]["command"] == "cmd" and got["runs"]["qwen-bf16"]["kv"] == "none"


@pytest.mark.parametrize("argv, msg", [
    (["--out", "o"], "--models-dir and --out are required"),
    (["--models-dir", "m"], "--models-dir and --out are required"),
    (["--models-dir", "m", "--out", "o", "--arms", "bf16,nope"], "unknown --arms"),
    (["--models-dir", "m", "--out", "o", "--arms", ","], "unknown --arms"),
    (["--models-dir", "m", "--out", "o", "--budget", "0"], "--budget must be positive"),
    (["--cpu-reference", "r.json", "--runs", "bf16,kv2"], "unknown --runs"),
])
def test_argument_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        RC.parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_committed_reference_matches_the_check():
    ref = json.loads(RC.DEFAULT_REFERENCE.read_text())
    assert ref["n_tokens"] == RC.N_TOKENS and ref["window"] == RC.WINDOW
    assert set(ref["runs"]) == set(RC.PPL_RUNS)
    for name, run in ref["runs"].items():
        assert run["kv"] == RC.PPL_RUNS[name].kv and set(run["texts"]) == set(RC.TEXTS)
        assert run.get("kv_dtype") == (None if run["kv"] == "none" else "served"), name
        assert bool(run.get("kv_bias_aware")) == RC.PPL_RUNS[name].bias_aware, name
        for t in run["texts"].values():
            assert t["tokens"] == RC.N_TOKENS - RC.N_TOKENS // RC.WINDOW
            assert t["ppl"] == pytest.approx(math.exp(t["nll"] / t["tokens"]))
    assert ref["runs"]["bf16"]["texts"]["lcet10"]["ppl"] == pytest.approx(31.36, abs=0.01)  # docs/BENCHMARKS.md


# --- run_arm against a stand-in `vllm serve` ------------------------------------------------------

FAKE_SERVE = r'''
import http.server, json, sys
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
print("INFO vllm_mixprec 0.1.0 registered: --quantization mixprec, --attention-backend CUSTOM", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("prompt_logprobs") is not None:
            ids = body["prompt"]
            plp = [None] + [{str(t): {"logprob": -2.0, "rank": 1, "decoded_token": "x"}} for t in ids[1:]]
            choice = {"text": "", "prompt_token_ids": ids, "prompt_logprobs": plp}
        else:
            toks = list(range(100, 100 + body["max_tokens"]))
            choice = {"text": "x", "token_ids": toks,
                      "logprobs": {"top_logprobs": [{f"token_id:{t}": -0.5} for t in toks]}}
        data = json.dumps({"choices": [choice]}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_run_arm_against_a_stand_in_server(tmp_path, monkeypatch):
    import time

    from vllm_mixprec.eval import serve as S

    fake = tmp_path / "fake_serve.py"
    fake.write_text(FAKE_SERVE)
    monkeypatch.setattr(S, "VLLM_CLI", (sys.executable, str(fake)))
    arm = RC.ARMS["bf16"]
    windows = {"lcet10": [[1, 2, 3], [4, 5]], "botchan": [[6, 7, 8, 9]]}
    res = RC.run_arm(arm, tmp_path, tmp_path, windows, time.time() + 120, log=lambda *a: None)
    assert "error" not in res, res
    assert len(res["greedy"]) == len(RC.PROMPTS) and res["greedy"][0]["tokens"][:2] == [100, 101]
    assert len(res["greedy"][0]["tokens"]) == RC.GREEDY_TOKENS
    assert res["ppl"]["lcet10"] == {"nll": 6.0, "tokens": 3, "ppl": pytest.approx(math.exp(2.0))}
    assert res["ppl"]["botchan"]["tokens"] == 3
    assert res["mode"] == "compiled + CUDA graphs" and res["facts"]["plugin_logged"]
    assert "--enforce-eager" in RC.ARMS["w4a8"].cmd_flags() and "--enforce-eager" not in arm.cmd_flags()
    fake.write_text("import sys; sys.exit(4)\n")  # a server that dies at start
    res = RC.run_arm(arm, tmp_path, tmp_path, windows, time.time() + 120, log=lambda *a: None)
    assert res["error"] == "server exited with 4"


def test_requests_and_responses_through_vllms_own_protocol():
    """The bodies are valid vLLM 0.26 CompletionRequests with the intended sampling parameters, and
    the parsers read CompletionResponse JSON as vLLM's pydantic models write it."""
    from vllm.entrypoints.openai.completion.protocol import (CompletionLogProbs, CompletionRequest,
                                                               CompletionResponse, CompletionResponseChoice)
    from vllm.logprobs import Logprob

    sp = CompletionRequest(**RC.ppl_body("m", [5, 6, 7])).to_sampling_params(max_tokens=1, default_sampling_params={})
    assert sp.prompt_logprobs == 0 and sp.max_tokens == 1 and sp.temperature == 0.0 and sp.skip_reading_prefix_cache
    sp = CompletionRequest(**RC.greedy_body("m", "hi")).to_sampling_params(max_tokens=RC.GREEDY_TOKENS,
                                                                          default_sampling_params={})
    assert sp.temperature == 0.0 and sp.ignore_eos and sp.logprobs == RC.TOPK and sp.max_tokens == RC.GREEDY_TOKENS
    plp = [None, {6: Logprob(logprob=-1.5, rank=3, decoded_token="a")}, {7: Logprob(logprob=-0.5, rank=1)}]
    top = CompletionLogProbs(text_offset=[0], token_logprobs=[-0.1], tokens=["token_id:9"],
                             top_logprobs=[{"token_id:9": -0.1, "token_id:3": -2.0}])
    choice = CompletionResponseChoice(index=0, text="x", prompt_logprobs=plp, prompt_token_ids=[5, 6, 7],
                                      token_ids=[9], logprobs=top)
    resp = json.loads(CompletionResponse(id="1", model="m", choices=[choice], usage={
        "prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}).model_dump_json())
    assert RC.window_nll(resp, [5, 6, 7]) == (2.0, 2)
    assert RC.parse_greedy(resp)["top"] == [{9: -0.1, 3: -2.0}]


def test_kv_none_copy(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    qc = {"quant_method": "mixprec", "kv_scheme": "kv8"}
    (src / "config.json").write_text(json.dumps({"quantization_config": qc}))
    (src / "model.safetensors").write_bytes(b"weights")
    dst = RC.kv_none_copy(src, tmp_path / "copy")
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == {"quant_method": "mixprec",
                                                                                    "kv_scheme": "none"}
    assert (dst / "model.safetensors").is_symlink() and (dst / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text())["quantization_config"]["kv_scheme"] == "kv8"
    RC.kv_none_copy(src, tmp_path / "copy")  # again


def test_main_leaves_the_cache_env_as_it_found_it(tmp_path, monkeypatch):
    """main() points VLLM_MIXPREC_CACHE at --models-dir while it runs; a value leaked past
    it sent later tests in the same process to a fake text cache (CI, 2026-11-23)."""
    monkeypatch.delenv("VLLM_MIXPREC_CACHE", raising=False)
    RC.main(["--models-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--arms", "bf16",
             "--reference", str(tmp_path / "none.json")])
    assert "VLLM_MIXPREC_CACHE" not in os.environ
    monkeypatch.setenv("VLLM_MIXPREC_CACHE", "/somewhere")
    RC.main(["--models-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--arms", "bf16",
             "--reference", str(tmp_path / "none.json")])
    assert os.environ["VLLM_MIXPREC_CACHE"] == "/somewhere"


def test_kv_perplexity_arm_reads_every_key_from_the_cache():
    """The CPU reference of the KV8 perplexity arm quantizes every key; the served arm must do
    the same: no residual window and no exact prefill (a one-chunk prompt would otherwise never
    read the cache, and the check would not test KV8 at all)."""
    from vllm_mixprec.attention_backend import residual as R
    from vllm_mixprec.attention_backend.impl import ENV_PREFILL_EXACT

    arm = RC.ARMS["w4a8-kv8"]
    assert RC.PPL_RUNS[arm.ppl].kv == "kv8"
    assert dict(arm.env) == {R.ENV_TOKENS: "0", ENV_PREFILL_EXACT: "0"}
