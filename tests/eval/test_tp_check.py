"""scripts/tp_check.py's verdict (issue #7, TP=2 against TP=1), on made-up completions: the rule
must pass identical runs and tie flips, and fail runs whose logprobs part from step 0."""
import pytest


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


def test_models_and_control_names(tp):
    assert set(tp.MODELS) == {"llama-none", "llama-kv4", "llama-bf16", "qwen2-none", "qwen2-kv4", "qwen2-bf16"}
