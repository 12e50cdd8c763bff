"""Tensor parallelism at TP=2 on the CPU: two processes in vLLM's TP group over gloo
(tests/tp2_worker.py), vLLM's real QKV / gate_up / down layers with the mixprec method.

Each rank is handed the whole checkpoint tensors, as vLLM's model loader does; the weight
loaders must cut that rank's shard of the packed codes, the group scales and offsets and the
channel scales. What each rank computes is checked against the reference on exactly that shard,
so a wrong slice of any one tensor fails. The GPU half (greedy outputs of a served model at TP=2
against TP=1, NCCL) is scripts/tp_check.py on nvidia-h200-x2.
"""
import os
import subprocess
import sys

import pytest
import torch

import tp2_worker as W
from vllm_mixprec import reference as ref

WORLD = 2
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp2")
    init = str(d / "dist_init")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "..", "tp2_worker.py"), str(r), str(WORLD),
                               init, str(d / f"rank{r}.pt")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-3000:]}"
    return [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]


def _ref(x, t):
    xq, xs = ref.quantize_act(x)
    return ref.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                         out_dtype=torch.float64)


def _rows(t, lo, hi):
    """Output channels lo:hi of a layer's tensors (a column-parallel shard)."""
    return {k: v[lo:hi] for k, v in t.items()}


def _cols(t, lo, hi, g=W.GROUP):
    """Input channels lo:hi (a row-parallel shard): codes hold 2 per byte, group params 1 per group."""
    return {"qweight": t["qweight"][:, lo // 2:hi // 2], "group_scale": t["group_scale"][:, lo // g:hi // g],
            "group_offset": t["group_offset"][:, lo // g:hi // g], "channel_scale": t["channel_scale"]}


def _close(got, want, tol=1e-3):
    assert got.shape == want.shape, (got.shape, want.shape)
    rel = float((got.double() - want).norm() / want.norm())
    assert rel < tol + torch.finfo(torch.float16).eps, rel


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_qkv_shards(ranks, kv_heads):
    case = W.make_case(kv_heads)
    q_per, kv_rep = W.HEADS // WORLD * W.HEAD, max(1, WORLD // kv_heads)
    kv_per = max(1, kv_heads // WORLD) * W.HEAD
    for r, out in enumerate(ranks):
        kv_rank = r // kv_rep  # replicated KV heads: ranks 0 and 1 both hold head 0 when kv_heads = 1
        parts = [_rows(case["qkv"]["q"], r * q_per, (r + 1) * q_per),
                 _rows(case["qkv"]["k"], kv_rank * kv_per, (kv_rank + 1) * kv_per),
                 _rows(case["qkv"]["v"], kv_rank * kv_per, (kv_rank + 1) * kv_per)]
        cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        _close(out[f"qkv_kv{kv_heads}"], _ref(case["x"], cat))
        assert out[f"shapes_kv{kv_heads}"]["qweight"] == (q_per + 2 * kv_per, W.HIDDEN // 2)
        assert out[f"shapes_kv{kv_heads}"]["group_scale"] == (q_per + 2 * kv_per, W.HIDDEN // W.GROUP)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_k_bias_shards(ranks, kv_heads):
    """Bias-aware K (quant_methods/k_bias.py) gets each rank's own kv heads of k_proj's bias:
    the K slice of the rank's qkv bias, the replicated head on both ranks when kv_heads = 1."""
    case = W.make_case(kv_heads)
    kv_rep, kv_per = max(1, WORLD // kv_heads), max(1, kv_heads // WORLD)
    for r, out in enumerate(ranks):
        kv_rank = r // kv_rep
        want = case["qkv_bias"]["k"].view(kv_heads, W.HEAD)[kv_rank * kv_per:(kv_rank + 1) * kv_per]
        assert torch.equal(out[f"k_bias_kv{kv_heads}"], want.float()), r


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gate_up_shards(ranks, kv_heads):
    case = W.make_case(kv_heads)
    per = W.INTER // WORLD
    for r, out in enumerate(ranks):
        parts = [_rows(t, r * per, (r + 1) * per) for t in case["gate_up"]]
        cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        _close(out[f"gate_up_kv{kv_heads}"], _ref(case["x"], cat))


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_down_shards_and_their_sum(ranks, kv_heads):
    case = W.make_case(kv_heads)
    per = W.INTER // WORLD
    total = 0
    for r, out in enumerate(ranks):
        x_r = case["x_down"][:, r * per:(r + 1) * per]
        _close(out[f"down_kv{kv_heads}"], _ref(x_r, _cols(case["down"], r * per, (r + 1) * per)))
        total = total + out[f"down_kv{kv_heads}"].double()
    # the all-reduced output against TP=1: each rank quantizes its own half of the activations
    # (per-token scales over 192 channels, not 384), so they agree to int8 rounding, not exactly
    _close(total, _ref(case["x_down"], case["down"]), tol=2e-2)


def test_global_act_scale_gives_tp1_codes(ranks):
    """MIXPREC_TP_ACT_SCALE=global: each rank's codes and scales are exactly TP=1's on its slice,
    so the all-reduced output is TP=1's up to the 16-bit rounding of the two partial sums."""
    case = W.make_case(2)
    per = W.INTER // WORLD
    xq, xs = ref.quantize_act(case["x_down"])
    total = 0
    for r, out in enumerate(ranks):
        q_r, s_r = out["act_global"]
        assert torch.equal(q_r, xq[:, r * per:(r + 1) * per]), r
        assert torch.equal(s_r, xs), r
        total = total + out["down_global"].double()
    _close(total, _ref(case["x_down"], case["down"]), tol=1e-3)
    # a NaN on rank 0's slice of row 1 makes row 1 NaN on both ranks; the other rows are untouched
    for r, out in enumerate(ranks):
        q_r, s_r = out["act_global_nan"]
        assert torch.isnan(s_r[1]) and not bool(q_r[1].any()), r
        assert torch.equal(s_r[[0, 2]], xs[[0, 2]]), r


@pytest.mark.parametrize("bias", [False, True])
def test_exact_reduce_is_tp1_bit_for_bit(ranks, bias):
    """MIXPREC_TP_REDUCE=exact through vLLM's RowParallelLinear.forward, reduction included: the
    output is what the kernels' epilogue makes of TP=1's whole-K accumulator, bit for bit, on
    both ranks, with the bias added once (vLLM hands it to rank 0 only). vLLM's own reduction of
    16-bit partials rounds many elements differently; reducing twice would double them."""
    case = W.make_case(2)
    d = case["down"]
    xq, xs = ref.quantize_act(case["x_down"])
    acc = ref._int_gemm(xq, ref.dequantize_weight_w8(d["qweight"], d["group_scale"], d["group_offset"]))
    tp1 = ref.w4a8_epilogue(acc, xs, d["channel_scale"], case["down_bias"] if bias else None,
                            torch.float16)
    for out in ranks:
        assert out[f"down_exact_flags_{bias}"] == (False, True)  # vLLM's reduction off, the layer's on
        assert torch.equal(out[f"down_exact_{bias}"], tp1)
    if not bias:
        model = ranks[0]["down_global_model"]
        assert int((model != tp1).sum()) > 0.05 * tp1.numel(), \
            "vLLM's 16-bit reduction should round visibly differently; the comparison lost its power"


def test_global_act_scale_survives_compiled_strides(monkeypatch):
    """Compiled code reads a custom op's output by its fake's strides (contiguous). vLLM's
    all_gather builds its output with reshape/movedim, a strided view for any dim but 0, so the
    gather must be one whose real layout is contiguous too: here the gather is vLLM's layout
    logic (DeviceCommunicatorBase.all_gather) over two ranks' inputs, read back contiguously as
    Inductor would. Along dim -1 (session 26's code) rows took other rows' maxima: the TP=2 NaN
    of the compiled Qwen2 shape."""
    import vllm.distributed as dist

    from vllm_mixprec import kernels

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=gen) * torch.rand(7, 1, generator=gen) * 10  # rows of other ranges
    x0, x1 = x[:, :32], x[:, 32:]
    peer = {}

    def gather_as_compiled(inp, dim=-1):
        other = peer["amax"].reshape(inp.shape)
        d = dim + inp.dim() if dim < 0 else dim
        buf = torch.cat([inp.reshape(-1), other.reshape(-1)])  # all_gather_into_tensor: rank-major
        real = buf.reshape((2,) + tuple(inp.shape)).movedim(0, d).reshape(
            tuple(inp.shape[:d]) + (2 * inp.shape[d],) + tuple(inp.shape[d + 1:]))
        return torch.as_strided(buf, real.shape, torch.empty(real.shape).stride())  # the fake's strides

    monkeypatch.setattr(dist, "tensor_model_parallel_all_gather", gather_as_compiled)
    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: 2)
    peer["amax"] = x1.abs().amax(dim=-1)
    q, s = kernels.quantize_act_tp(x0, None)
    xq, xs = ref.quantize_act(x)
    assert torch.equal(s, xs) and torch.equal(q, xq[:, :32])


def _check_env_choice(read, var, value, ok, refusal):
    """read(env) with `var` unset (value None) or set: `ok`, or a ValueError matching `refusal`."""
    env = {} if value is None else {var: value}
    if ok is None:
        with pytest.raises(ValueError, match=refusal):
            read(env)
    else:
        assert read(env) == ok


@pytest.mark.parametrize("value,ok", [(None, "rank"), ("", "rank"), ("rank", "rank"),
                                      ("global", "global"), ("all", None), ("GLOBAL", None)])
def test_tp_act_scale_env(value, ok):
    from vllm_mixprec import kernels
    _check_env_choice(kernels.tp_act_scale, "MIXPREC_TP_ACT_SCALE", value, ok,
                      "MIXPREC_TP_ACT_SCALE=.*expected rank")


@pytest.mark.parametrize("value,ok", [(None, "model"), ("", "model"), ("model", "model"),
                                      ("exact", "exact"), ("fp32", None), ("EXACT", None)])
def test_tp_reduce_env(value, ok):
    from vllm_mixprec import kernels
    _check_env_choice(kernels.tp_reduce, "MIXPREC_TP_REDUCE", value, ok,
                      "MIXPREC_TP_REDUCE=.*expected model")
    assert kernels.tp_reduce({"MIXPREC_TP_REDUCE": "exact", "MIXPREC_TP_ACT_SCALE": "global"}) == "exact"
    with pytest.raises(ValueError, match="cannot be combined with MIXPREC_TP_ACT_SCALE=rank"):
        kernels.tp_reduce({"MIXPREC_TP_REDUCE": "exact", "MIXPREC_TP_ACT_SCALE": "rank"})


def test_unshardable_configs_are_refused(ranks):
    for out in ranks:
        assert "does not support row-parallel sharding" in out["w4ax_row"], out["w4ax_row"]
        assert "input size per partition 192 is not divisible by quantization_config.group_size=128" \
            in out["g128_row"], out["g128_row"]
