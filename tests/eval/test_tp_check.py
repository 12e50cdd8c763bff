"""scripts/tp_check.py's verdict (issue #7, TP=2 against TP=1), on made-up completions: the rule
must pass identical runs and tie flips, and fail runs whose logprobs part from step 0."""
import pytest
import torch


@pytest.fixture
def tp(repo_module):
    return repo_module("scripts/tp_check.py")


def _run(tokens, tops):
    return {"tokens": tokens, "top": [{str(t): lp for t, lp in top.items()} for top in tops]}


def test_identical_runs_pass(tp):
    a = [_run([5, 6], [{5: -0.1, 7: -2.0}, {6: -0.3, 8: -1.5}])]
    b = [_run([5, 6], [{5: -0.12, 7: -2.01}, {6: -0.31, 8: -1.49}])]
    got = tp.compare(a, b)
    assert got["pass"] and got["identical"] == 1 and got["max_dlogprob"] == pytest.approx(0.02)


def test_tie_flip_passes(tp):
    a = [_run([5, 6, 9], [{5: -0.1}, {6: -0.70, 8: -0.72}, {9: -0.2}])]
    b = [_run([5, 8, 1], [{5: -0.1}, {8: -0.69, 6: -0.71}, {1: -0.2}])]
    row = tp.compare(a, b)["per_prompt"][0]
    assert row["first_diff"] == 1 and row["gap"] == pytest.approx(0.02) and row["pass"]


def test_wide_divergence_fails(tp):
    # a sharding bug: the runs disagree from the first token, far from a tie
    a = [_run([5], [{5: -0.1, 7: -3.0}])]
    b = [_run([7], [{7: -0.1, 5: -3.0}])]
    got = tp.compare(a, b)
    assert not got["pass"] and got["per_prompt"][0]["gap"] == pytest.approx(2.9)


def test_drifting_logprobs_fail_even_with_equal_tokens(tp):
    a = [_run([5, 6], [{5: -0.1}, {6: -0.2}])]
    b = [_run([5, 6], [{5: -0.6}, {6: -0.2}])]
    got = tp.compare(a, b)
    assert got["identical"] == 1 and not got["pass"]


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_nonfinite_logprobs_fail_even_when_identical(tp, bad):
    """Session 21: NaN logits pick the same token at TP=1 and TP=2, so 'identical' alone passed
    them (NaN compares False against every bound)."""
    a = [_run([5, 5], [{5: bad, 1: bad}, {5: bad}]), _run([6], [{6: -0.1}])]
    b = [_run([5, 5], [{5: bad, 1: bad}, {5: bad}]), _run([6], [{6: -0.1}])]
    got = tp.compare(a, b)
    assert got["identical"] == 2 and not got["pass"] and got["nonfinite_prompts"] == 1
    assert [r["pass"] for r in got["per_prompt"]] == [False, True]
    assert got["per_prompt"][0]["nonfinite_steps"] == 4


def test_models_and_control_names(tp):
    assert set(tp.MODELS) == {"llama-none", "llama-kv4", "llama-bf16", "qwen2-none", "qwen2-kv4", "qwen2-bf16",
                              "real-none", "real-kv4", "real-bf16"}


def test_real_exports_once_and_links_per_kv_scheme(tp, tmp_path, monkeypatch):
    """--real: the real folder's RTN W4A8 export is made once; the kv4 folder differs only in its
    config (weights linked); real-bf16 is the folder itself."""
    import json
    import pathlib

    from safetensors.torch import load_file

    from vllm_mixprec import reference as ref
    from vllm_mixprec.quant_methods.config import MixPrecScheme
    from vllm_mixprec.quantize.testing import save_tiny

    monkeypatch.syspath_prepend(str(pathlib.Path(tp.__file__).parent))
    src = save_tiny(tmp_path / "qwen", "qwen2")
    out = tp.build(str(tmp_path / "work"), ["real-none", "real-kv4", "real-bf16"], str(src))
    assert out["real-bf16"] == str(src)
    none, kv4 = (pathlib.Path(out[n]) for n in ("real-none", "real-kv4"))
    assert (kv4 / "model.safetensors").is_symlink()
    assert (kv4 / "model.safetensors").resolve() == (none / "model.safetensors").resolve()
    cfgs = [json.loads((d / "config.json").read_text())["quantization_config"] for d in (none, kv4)]
    assert [MixPrecScheme.from_dict(c).kv_scheme for c in cfgs] == ["none", "kv4"]
    got = load_file(str(none / "model.safetensors"))
    w = load_file(str(src / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    want = ref.quantize_weight_lqq(w.float(), 64)
    assert all(torch.equal(got[f"model.layers.0.mlp.down_proj.{k}"], v) for k, v in want.items())
    assert "model.layers.0.self_attn.k_proj.bias" in got  # Qwen2's biases travel as they are
    mtime = (none / "model.safetensors").stat().st_mtime
    tp.build(str(tmp_path / "work"), ["real-kv4"], str(src))  # reused, not exported again
    assert (none / "model.safetensors").stat().st_mtime == mtime


def test_real_models_need_a_folder(tp, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["tp_check.py", "--models", "real-none"])
    with pytest.raises(SystemExit) as e:
        tp.main()
    assert e.value.code == 2 and "--models real-* needs --real" in capsys.readouterr().err


def test_ppl_verdict(tp):
    """--ppl-text judges a real model by its perplexity at TP=2 against TP=1."""
    import math
    one = {"ppl": 20.0}
    assert tp.ppl_verdict(one, {"ppl": 20.1})["ppl_pass"]  # +0.5 %
    got = tp.ppl_verdict(one, {"ppl": 20.5})
    assert not got["ppl_pass"] and got["ppl_rel"] == pytest.approx(0.025)
    assert not tp.ppl_verdict(one, {"ppl": math.nan})["ppl_pass"]
    assert "ppl_positions" not in got  # older results carry no positions
    a = {"ppl": 20.0, "positions": [[-1.0, -2.0, -3.0], [-0.5, -0.25]]}
    b = {"ppl": 20.0, "positions": [[-1.0, -2.5, -3.0], [-0.5, -0.25]]}
    got = tp.ppl_verdict(a, b)
    assert (got["ppl_positions_equal"], got["ppl_positions"], got["ppl_first_unequal"]) == (4, 5, [1, None])


def test_ppl_text_must_be_a_file(tp, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["tp_check.py", "--models", "llama-none", "--ppl-text", "/nonexistent.txt"])
    with pytest.raises(SystemExit) as e:
        tp.main()
    assert e.value.code == 2 and "is not a file" in capsys.readouterr().err


def test_judge_fails_a_child_that_died_after_writing(tp):
    """A child's results are compared even when it then died (session 22: TP=1 aborted in vLLM's
    teardown), but the model fails on its exit status; a missing result or ppl fails it too."""
    a = [_run([5, 6], [{5: -0.1}, {6: -0.2}])]
    ok = {1: {"rc": 0, "wall_s": 1.0, "result": a}, 2: {"rc": 0, "wall_s": 1.0, "result": a}}
    got = tp.judge(ok, None)
    assert got["pass"] and got["exit_ok"] and got["identical"] == 1 and "result" not in got["tp1"]
    died = {**ok, 1: {**ok[1], "rc": -6}}
    got = tp.judge(died, None)
    assert not got["pass"] and not got["exit_ok"] and got["identical"] == 1 and got["tp1"]["rc"] == -6
    ppl = {"ppl": 20.0}
    assert tp.judge(ok, {1: ppl, 2: {"ppl": 20.05}})["pass"]
    assert not tp.judge(died, {1: ppl, 2: ppl})["pass"]
    assert not tp.judge(ok, {1: ppl, 2: None})["pass"]
    missing = {1: ok[1], 2: {"rc": 1, "wall_s": 1.0}}
    got = tp.judge(missing, None)
    assert not got["pass"] and "identical" not in got


def test_load_json_reads_only_whole_files(tp, tmp_path):
    (tmp_path / "whole.json").write_text('{"ppl": 3.0}')
    (tmp_path / "cut.json").write_text('{"ppl": 3.')
    assert tp._load_json(str(tmp_path / "whole.json")) == {"ppl": 3.0}
    assert tp._load_json(str(tmp_path / "cut.json")) is None
    assert tp._load_json(str(tmp_path / "absent.json")) is None
