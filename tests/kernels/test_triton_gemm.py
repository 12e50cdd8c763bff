"""Triton W4A8 / W4Ax kernels (vllm_mixprec/kernels/triton/gemm.py) against reference.py.

Without a GPU the kernels run in the Triton interpreter (conftest sets TRITON_INTERPRET)
on small shapes; `@pytest.mark.gpu` tests take realistic shapes, both output dtypes,
CUDA graphs and the PTX (inline asm) path.

Tolerances. The activation quantisers are bit-exact with the reference (correctly rounded
divisions, round half to even). The GEMMs are exact in int32 up to the epilogue, which
runs in fp32: against the float64 reference the error is at most one rounding of the
output dtype plus ~1e-6 of the output scale.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.kernels.triton import gemm as tg

from cuda_gemm_helpers import assert_norm_quant_close

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
_EPS_OUT = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}


# --- helpers ----------------------------------------------------------------------------

def _weights(n, k, g, gen, device=DEV):
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    t = ref.quantize_weight_lqq(w, g)
    return {name: v.to(device) for name, v in t.items()}


def _act(m, k, gen, dtype=torch.float32, device=DEV):
    # never zero; a few outlier channels, as in real activations
    x = torch.randn(m, k, generator=gen) + 0.01
    x[:, torch.randint(0, k, (max(1, k // 64),), generator=gen)] *= 20
    return x.to(dtype).to(device)


def _force_split(monkeypatch, blocks: int) -> None:
    """The W4Ax quantizer's rows split over programs of `blocks` blocks (0: one program a row)
    at every M and rotation (gemm.force_w4ax_split_blocks), for this test only."""
    monkeypatch.setattr(tg, "W4AX_SPLIT_BLOCKS", blocks)
    monkeypatch.setattr(tg, "W4AX_SPLIT_CHANNEL_GATHER_MAX_M", None)


def assert_close_to_f64(y, expect, out_dtype):
    """|y - r| <= one rounding of out_dtype + 1e-6 of the output scale, and no NaN/Inf."""
    assert y.dtype == out_dtype
    assert torch.isfinite(y).all(), "non-finite outputs (unwritten poisoned elements?)"
    r = expect.double().cpu()
    err = (y.double().cpu() - r).abs()
    tol = _EPS_OUT[out_dtype] * r.abs() + 1e-6 * r.abs().max()
    worst = float((err - tol).max())
    assert worst <= 0, f"max excess error {worst:.3g} (max err {float(err.max()):.3g})"
    assert float(err.norm() / r.norm()) < 1e-3 + _EPS_OUT[out_dtype]


def _captured(fn, static_x):
    """(CUDA graph of fn(static_x), its output), fn run once before on a side stream so that
    its kernels compile outside the capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(static_x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x)
    return graph, out


def _poisoned(m, n, dtype, device=DEV):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def _ref_w4a8(xq, xs, t, bias):
    cpu = {k: v.cpu() for k, v in t.items()}
    return ref.w4a8_gemm(xq.cpu(), xs.cpu(), cpu["qweight"], cpu["group_scale"], cpu["group_offset"],
                         cpu["channel_scale"], None if bias is None else bias.cpu(), torch.float64)


def _ref_w4ax(x8, s8, x4, s4, t, bias):
    cpu = {k: v.cpu() for k, v in t.items()}
    return ref.w4ax_gemm(x8.cpu(), s8.cpu(), x4.cpu(), s4.cpu(), cpu["qweight"], cpu["group_scale"],
                         cpu["group_offset"], cpu["channel_scale"],
                         None if bias is None else bias.cpu(), torch.float64)


def _run_w4a8(t, xq, xs, bias, out_dtype, config=None, poison=True):
    out = _poisoned(xq.shape[0], t["qweight"].shape[0], out_dtype, xq.device) if poison else None
    return tg.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"],
                        t["channel_scale"], bias, out_dtype, out=out, config=config)


# --- activation quantisation (CPU interpreter and GPU) ----------------------------------

@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("k", [128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("smooth", [False, True])
def test_quantize_act_bit_exact(m, k, dtype, smooth, seeded):
    x = _act(m, k, seeded, dtype)
    sm = (torch.rand(k, generator=seeded) + 0.5).to(dtype).to(DEV) if smooth else None
    q, s = tg.quantize_act(x, sm)
    q_ref, s_ref = ref.quantize_act(x.cpu(), None if sm is None else sm.cpu())
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu(), q_ref)


def test_quantize_act_ties_and_zero_rows():
    # exact halves after scaling (amax 127 -> scale 1) must round to even like torch.round;
    # an all-zero row takes the clamped scale
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0] * 2, [0.0] * 16],
                     device=DEV)
    q, s = tg.quantize_act(x)
    q_ref, s_ref = ref.quantize_act(x.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)


@pytest.mark.parametrize("budget", [64, 256])
def test_quantize_act_two_pass(monkeypatch, budget, seeded):
    """Rows longer than the register budget take two passes; same bits. W4Ax chunks (one
    program a row) hold whole blocks: one per chunk (budget 64), or two with the last chunk
    half masked (256)."""
    monkeypatch.setattr(tg, "_MAX_ROW_VALUES", budget)
    _force_split(monkeypatch, 0)
    x = _act(3, 256, seeded, torch.float16)
    sm = (torch.rand(256, generator=seeded) + 0.5).to(DEV)
    q, s = tg.quantize_act(x, sm)
    q_ref, s_ref = ref.quantize_act(x.cpu(), sm.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    x = _act(3, 512, seeded, torch.float16)
    sm = (torch.rand(512, generator=seeded) + 0.5).to(DEV)
    perm = torch.randperm(512, generator=seeded).to(DEV)
    x[1, 7] = float("inf")  # a poisoned row: NaN in every block scale of both parts
    got = tg.quantize_act_w4ax(x, perm, 128, sm)
    want = ref.quantize_act_w4ax(x.cpu(), perm.cpu(), 128, sm.cpu())
    assert torch.isnan(want[1][1]).all() and torch.isnan(want[3][1]).all()
    for a, b in zip(got, want):
        assert torch.equal(a.cpu().nan_to_num(-1.0), b.nan_to_num(-1.0))


@pytest.mark.parametrize("m,k", [(1, 96), (5, 200)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("smooth", [False, True])
def test_silu_mul_quantize_act_bit_exact(m, k, dtype, smooth, seeded):
    """SiluAndMul then quantize_act in one kernel: the same codes and scales as the two torch
    ops, which round silu(gate) and the product to the input dtype. Row 1 holds an Inf.
    fp32: the kernel's expf and torch's may differ by an ulp (numpy's in the interpreter;
    ATen's fp32 silu on the H100 too), and nothing rounds it away, so a scale may differ by
    an ulp and a code by one. The 16-bit dtypes are bit-exact."""
    gate_up = (_act(m, 2 * k, seeded) * 0.5).to(dtype).to(DEV)
    if m > 1:
        gate_up[1, 3] = float("inf")
    sm = (torch.rand(k, generator=seeded) + 0.5).to(dtype).to(DEV) if smooth else None
    q, s = tg.silu_mul_quantize_act(gate_up, sm)
    q_ref, s_ref = ref.silu_mul_quantize_act(gate_up.cpu(), None if sm is None else sm.cpu())
    assert m == 1 or torch.isnan(s_ref[1])
    if dtype == torch.float32:
        torch.testing.assert_close(s.cpu(), s_ref, rtol=2.0 ** -22, atol=0, equal_nan=True)
        assert (q.cpu().int() - q_ref.int()).abs().max() <= 1
        return
    assert torch.equal(s.cpu().nan_to_num(-1.0), s_ref.nan_to_num(-1.0))
    assert torch.equal(q.cpu(), q_ref)


@pytest.mark.parametrize("pdl", ["0", "1"], ids=["plain", "pdl"])
@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("gated", [True, False], ids=["silu_mul", "plain"])
def test_quantize_act_split_rows(monkeypatch, m, smooth, pdl, gated, seeded):
    """Rows of few tokens are split over programs (two passes through an fp32 copy): the same
    bits, for silu_mul_quantize_act and quantize_act. 300 columns in 64-wide chunks, the last one
    partial; m = 5 is above the split limits (set to 3 here) and takes one program a row. Row 1
    holds a NaN. On an H100 the second pass is a programmatic dependent launch unless
    MIXPREC_QUANT_PDL=0 (elsewhere both ids run the plain launches)."""
    monkeypatch.setenv("MIXPREC_QUANT_PDL", pdl)
    monkeypatch.setattr(tg, "SPLIT_ROWS_BLOCK", 64)
    monkeypatch.setattr(tg, "SPLIT_ROWS_MAX_M", 3)
    monkeypatch.setattr(tg, "SPLIT_ROWS_MAX_M_PLAIN", 3)
    monkeypatch.setattr(tg, "SPLIT_ROWS_MIN_VALUES", 256)
    x = _act(m, 600 if gated else 300, seeded, torch.bfloat16)
    if m > 1:
        x[1, 450 if gated else 250] = float("nan")  # gated: in the up half
    sm = (torch.rand(300, generator=seeded) + 0.5).to(DEV) if smooth else None
    op, ref_op = ((tg.silu_mul_quantize_act, ref.silu_mul_quantize_act) if gated
                  else (tg.quantize_act, ref.quantize_act))
    q, s = op(x, sm)
    q_ref, s_ref = ref_op(x.cpu(), None if sm is None else sm.cpu())
    assert m == 1 or (torch.isnan(s_ref[1]) and (q_ref[1] == 0).all())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu().nan_to_num(-1.0), s_ref.nan_to_num(-1.0))


def test_split_rows_rule():
    """Split only rows of more than 8192 values read (K, or 2K gated), up to 32 tokens for
    quantize_act and for silu_mul_quantize_act on 8192 columns, up to 512 for
    silu_mul_quantize_act on more (session 79's H100 timings)."""
    assert tg.split_rows(1, 8960) and tg.split_rows(32, 14336) and not tg.split_rows(33, 14336)
    assert not tg.split_rows(1, 8192) and not tg.split_rows(0, 14336)
    assert tg.split_rows(1, 8192, gated=True) and tg.split_rows(512, 14336, gated=True)
    assert tg.split_rows(32, 8192, gated=True) and not tg.split_rows(64, 8192, gated=True)
    assert tg.split_rows(512, 8200, gated=True) and tg.split_rows(64, 11008, gated=True)
    assert not tg.split_rows(1, 4096, gated=True) and not tg.split_rows(513, 14336, gated=True)


def test_split_rows_pdl_env(monkeypatch):
    monkeypatch.setenv("MIXPREC_QUANT_PDL", "yes")
    with pytest.raises(ValueError, match=r"MIXPREC_QUANT_PDL='yes': expected 0 or 1"):
        tg.split_rows_pdl(torch.device("cpu"))
    monkeypatch.setenv("MIXPREC_QUANT_PDL", "1")
    assert not tg.split_rows_pdl(torch.device("cpu"))  # PDL needs a Hopper GPU


def test_silu_mul_quantize_act_two_pass_and_errors(monkeypatch, seeded):
    monkeypatch.setattr(tg, "_MAX_ROW_VALUES", 128)  # 300 columns: three chunks, two passes
    gate_up = _act(3, 600, seeded, torch.bfloat16)
    q, s = tg.silu_mul_quantize_act(gate_up)
    q_ref, s_ref = ref.silu_mul_quantize_act(gate_up.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    with pytest.raises(ValueError, match=r"gate_up must be 2-D \[M, 2K\]; got shape \(3, 5\)"):
        tg.silu_mul_quantize_act(gate_up[:, :5])
    with pytest.raises(ValueError, match="smooth"):
        tg.silu_mul_quantize_act(gate_up, torch.ones(600, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("m,k", [(1, 96), (5, 200), (3, 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weight,smooth", [(True, False), (True, True), (False, False)])
def test_add_rms_norm_quantize_act(m, k, dtype, weight, smooth, seeded):
    """vLLM's fused_add_rms_norm then quantize_act, in one program a row. Row 1 holds a NaN:
    its residual keeps it, its scale is NaN and its codes zero."""
    x, res = _act(m, k, seeded, dtype), _act(m, k, seeded, dtype)
    if m > 1:
        x[1, 7] = float("nan")
    w = (torch.rand(k, generator=seeded) + 0.5).to(dtype).to(DEV) if weight else None
    sm = (torch.rand(k, generator=seeded) + 0.5).to(DEV) if smooth else None  # float32, as served
    got = tg.add_rms_norm_quantize_act(x, res, w, 1e-6, sm)
    want = ref.add_rms_norm_quantize_act(*(None if t is None else t.cpu() for t in (x, res, w)), 1e-6,
                                         None if sm is None else sm.cpu())
    assert m == 1 or (torch.isnan(want[1][1]) and (want[0][1] == 0).all())
    assert_norm_quant_close(got, want)


def test_add_rms_norm_quantize_act_errors(monkeypatch, seeded):
    x = _act(2, 64, seeded, torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\]; got shape \(2, 8, 8\)"):
        tg.add_rms_norm_quantize_act(x.view(2, 8, 8), x.view(2, 8, 8), None, 1e-6)
    with pytest.raises(TypeError, match="residual has dtype torch.float16; expected torch.bfloat16"):
        tg.add_rms_norm_quantize_act(x, x.half(), None, 1e-6)
    with pytest.raises(ValueError, match=r"residual has shape \(1, 64\); expected \(2, 64\)"):
        tg.add_rms_norm_quantize_act(x, x[:1], None, 1e-6)
    with pytest.raises(ValueError, match=r"weight has shape \(32,\); expected \(64,\)"):
        tg.add_rms_norm_quantize_act(x, x, x[0, :32], 1e-6)
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        tg.add_rms_norm_quantize_act(x.float(), x.float(), None, 1e-6)
    q, s, r = tg.add_rms_norm_quantize_act(x[:0], x[:0], None, 1e-6)  # no rows: nothing launched
    assert (q.shape, s.shape, r.shape) == ((0, 64), (0,), (0, 64))
    monkeypatch.setattr(tg, "NORM_QUANT_MAX_K", 32)
    with pytest.raises(ValueError, match="x has 64 columns; .* at most NORM_QUANT_MAX_K = 32"):
        tg.add_rms_norm_quantize_act(x, x, None, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k", [4096, 8192])
def test_add_rms_norm_quantize_act_gpu(m, k, seeded):
    """Llama-3-8B / 70B hidden sizes, bf16, with weight and smoothing; outputs poisoned first
    (torch.empty's caching allocator hands back the poisoned blocks)."""
    for shape, dtype in (((m, k), torch.int8), ((m,), torch.float32), ((m, k), torch.bfloat16)):
        torch.full(shape, 77, dtype=dtype, device=DEV)  # freed at once, its block poisoned
    x, res = _act(m, k, seeded, torch.bfloat16), _act(m, k, seeded, torch.bfloat16)
    w = (torch.rand(k, generator=seeded) + 0.5).to(torch.bfloat16).to(DEV)
    sm = (torch.rand(k, generator=seeded) + 0.5).to(DEV)
    got = tg.add_rms_norm_quantize_act(x, res, w, 1e-5, sm)
    want = ref.add_rms_norm_quantize_act(x.cpu(), res.cpu(), w.cpu(), 1e-5, sm.cpu())
    assert_norm_quant_close(got, want)


@pytest.mark.parametrize("k,k8", [(256, 0), (256, 128), (256, 256), (384, 128)])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("rotation", ["none", "hadamard", "hadamard64"])
@pytest.mark.parametrize("split_blocks", [0, 1, 8])
def test_quantize_act_w4ax_bit_exact(k, k8, smooth, m, rotation, split_blocks, seeded, monkeypatch):
    """One program a row (0), and rows split over programs of 1 and 8 blocks."""
    _force_split(monkeypatch, split_blocks)
    x = _act(m, k, seeded, torch.bfloat16)
    perm = torch.randperm(k, generator=seeded).to(DEV)
    sm = (torch.rand(k, generator=seeded) + 0.5).to(DEV) if smooth else None
    got = tg.quantize_act_w4ax(x, perm, k8, sm, rotation)
    expect = ref.quantize_act_w4ax(x.cpu(), perm.cpu(), k8, None if sm is None else sm.cpu(), rotation)
    for name, a, b in zip(("x8", "s8", "x4", "s4"), got, expect):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("k,k8", [(384, 128), (512, 0)])
@pytest.mark.parametrize("rotation", ["none", "hadamard64"])
@pytest.mark.parametrize("split_blocks", [0, 2])
def test_quantize_act_w4ax_block_perm(k, k8, rotation, split_blocks, seeded, monkeypatch):
    """A permutation of whole blocks handed over as the block table (formats.act_block_perm,
    what a --a8-select blocks layer holds) and as its [K] channel table: the kernels' two reads
    of it give the reference's codes and scales bit for bit."""
    _force_split(monkeypatch, split_blocks)
    x = _act(3, k, seeded, torch.bfloat16)
    blocks = F.random_act_perm(k, "blocks", seeded)
    channels = F.act_channel_perm(blocks, k)
    assert torch.equal(F.act_block_perm(channels), blocks)
    sm = (torch.rand(k, generator=seeded) + 0.5).to(DEV)
    expect = ref.quantize_act_w4ax(x.cpu(), channels, k8, sm.cpu(), rotation)
    for perm in (blocks, channels):
        got = tg.quantize_act_w4ax(x, perm.to(DEV), k8, sm, rotation)
        for name, a, b in zip(("x8", "s8", "x4", "s4"), got, expect):
            assert torch.equal(a.cpu(), b), (name, perm.numel())


def test_quantize_act_w4ax_perm_shape_errors(seeded):
    """A perm of neither K nor K/ACT_BLOCK entries is refused by the kernel and the reference,
    naming both forms."""
    x = _act(2, 256, seeded, torch.bfloat16)
    for bad in (torch.arange(255), torch.arange(4), torch.arange(256).view(2, 128)):
        for call in (tg.quantize_act_w4ax, ref.quantize_act_w4ax):
            with pytest.raises(ValueError, match=r"expected \(256,\) channels or \(2,\) blocks"):
                call(x, bad.to(x.device), 128, None)


def test_quantize_act_w4ax_rotates_in_its_one_kernel(seeded, monkeypatch):
    """The rotation runs inside the quantize kernel (no float32 round trip; the split rows'
    second launch only poisons NaN rows), split or one program a row; a layer with no 4-bit
    block (k8 == K) has nothing to rotate, and its codes are the unrotated ones."""
    x = _act(3, 256, seeded, torch.bfloat16)
    perm = torch.randperm(256, generator=seeded).to(DEV)
    sm = (torch.rand(256, generator=seeded) + 0.5).to(DEV)
    _force_split(monkeypatch, 8)
    plain = tg.quantize_act_w4ax(x, perm, 256, sm)
    launches = []
    for name in ("_launch_quant", "_launch_quant_blocks"):
        real = getattr(tg, name)
        monkeypatch.setattr(tg, name, lambda *a, real=real, name=name, **kw:
                            launches.append((name, kw["rotation_size"])) or real(*a, **kw))
    for a, b in zip(tg.quantize_act_w4ax(x, perm, 256, sm, "hadamard"), plain):
        assert torch.equal(a, b)
    tg.quantize_act_w4ax(x, perm, 128, sm, "hadamard64")
    _force_split(monkeypatch, 0)
    tg.quantize_act_w4ax(x, perm, 128, sm, "hadamard64")
    assert launches == [("_launch_quant_blocks", 0), ("_launch_quant_blocks", 64),
                        ("_launch_quant", 64)]


@pytest.mark.parametrize("m,k8,rotation,perm,split", [
    (1, 128, "none", "channels", True), (64, 128, "none", "channels", True),
    (65, 128, "none", "channels", False), (4096, 0, "none", "channels", False),
    (65, 256, "hadamard64", "channels", False),  # every block at 8 bits: nothing rotated
    (4096, 128, "hadamard64", "channels", True), (1, 128, "hadamard64", "channels", True),
    (4096, 0, "none", "blocks", True), (65, 256, "hadamard64", "blocks", True),
])
def test_quantize_act_w4ax_split_rule(m, k8, rotation, perm, split, monkeypatch):
    """By default rows are split over programs of W4AX_SPLIT_BLOCKS blocks, except unrotated rows
    read through a channel permutation past W4AX_SPLIT_CHANNEL_GATHER_MAX_M tokens (one program a
    row there: session 71's A-B-A); force_w4ax_split_blocks splits at every M, or nowhere."""
    monkeypatch.setattr(tg, "W4AX_SPLIT_BLOCKS", 8)
    monkeypatch.setattr(tg, "W4AX_SPLIT_CHANNEL_GATHER_MAX_M", 64)
    launches = []
    for name in ("_launch_quant", "_launch_quant_blocks"):
        monkeypatch.setattr(tg, name, lambda *a, name=name, **kw: launches.append(name))
    x = torch.randn(m, 256, dtype=torch.bfloat16)
    tg.quantize_act_w4ax(x, F.random_act_perm(256, perm), k8, None, rotation)
    assert launches == ["_launch_quant_blocks" if split else "_launch_quant"]
    unit = F.ACT_BLOCK if perm == "blocks" else 1
    rotated = F.act_rotation_size(rotation) if k8 < 256 else 0
    assert tg.w4ax_split_blocks_for(m, rotated, unit) == 8 * split
    for forced in (8, 0):
        tg.force_w4ax_split_blocks(forced)
        assert (tg.W4AX_SPLIT_BLOCKS, tg.W4AX_SPLIT_CHANNEL_GATHER_MAX_M) == (forced, None)
        assert tg.w4ax_split_blocks_for(m, 0, 1) == forced  # (monkeypatch restores both)


@pytest.mark.parametrize("m,k,k8", [(1, 256, 0), (17, 384, 128), (5, 512, 256), (3, 256, 256),
                                    (2, 16512, 0), (2, 17408, 512)])
@pytest.mark.parametrize("rotation", ["hadamard", "hadamard64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_act_w4ax_rotated_every_dtype_and_pass(m, k, k8, rotation, dtype, seeded,
                                                        monkeypatch):
    """One program a row: the rotated codes and scales bit for bit, each input dtype, in one
    pass over the row and in two (more than ROTATED_CHUNK_BLOCKS 4-bit blocks: K - k8 > 16384);
    a row holding a NaN gets NaN scales and zero codes, as in the reference."""
    _force_split(monkeypatch, 0)
    x = _act(m, k, seeded, dtype)
    if m > 3:
        x[2, 7] = float("nan")
    perm = torch.randperm(k, generator=seeded).to(DEV)
    sm = (torch.rand(k, generator=seeded) + 0.5).to(DEV)
    consts, _ = tg._quant_launch_config(k, k8, True, rotation_size=F.act_rotation_size(rotation))
    assert consts["ONE_PASS"] == ((k - k8) // F.ACT_BLOCK <= tg.ROTATED_CHUNK_BLOCKS)
    got = tg.quantize_act_w4ax(x, perm, k8, sm, rotation)
    expect = ref.quantize_act_w4ax(x.cpu(), perm.cpu(), k8, sm.cpu(), rotation)
    for name, a, b in zip(("x8", "s8", "x4", "s4"), got, expect):
        assert torch.equal(a.cpu().nan_to_num(7.0), b.nan_to_num(7.0)), name
        assert torch.equal(a.cpu().isnan(), b.isnan()), name


@pytest.mark.parametrize("split_blocks", [2, 4, 16])
@pytest.mark.parametrize("rotation", ["none", "hadamard64"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_act_w4ax_split_rows_poison_whole_rows(split_blocks, rotation, dtype, seeded,
                                                        monkeypatch):
    """Rows split over programs of split_blocks blocks (the last chunk of each part partly
    masked): a NaN or Inf in one program's blocks still gives its whole row NaN scales and zero
    codes in both parts (the second pass), as in the reference; other rows are untouched."""
    _force_split(monkeypatch, split_blocks)
    m, k, k8 = 5, 2560, 640  # 5 8-bit blocks, 15 4-bit blocks
    x = _act(m, k, seeded, dtype)
    perm = torch.randperm(k, generator=seeded).to(DEV)
    sm = (torch.rand(k, generator=seeded) + 0.5).to(DEV)
    x[1, perm[3]] = float("nan")  # the first 8-bit block
    x[3, perm[k - 1]] = float("-inf")  # the last 4-bit block
    got = tg.quantize_act_w4ax(x, perm, k8, sm, rotation)
    want = ref.quantize_act_w4ax(x.cpu(), perm.cpu(), k8, sm.cpu(), rotation)
    for r in (1, 3):
        assert torch.isnan(want[1][r]).all() and torch.isnan(want[3][r]).all()
        assert not want[0][r].any() and not want[2][r].any()
    assert not torch.isnan(want[3][(0, 2, 4), :]).any()
    for name, a, b in zip(("x8", "s8", "x4", "s4"), got, want):
        assert torch.equal(a.cpu().nan_to_num(7.0), b.nan_to_num(7.0)), name
        assert torch.equal(a.cpu().isnan(), b.isnan()), name


def test_quantize_act_w4ax_rotation_errors_and_empty(seeded):
    x = _act(2, 256, seeded, torch.bfloat16)
    perm = torch.randperm(256, generator=seeded).to(DEV)
    assert [t.shape[0] for t in tg.quantize_act_w4ax(x[:0], perm, 128, None, "hadamard")] == [0] * 4
    for call in (tg.quantize_act_w4ax, ref.quantize_act_w4ax):
        with pytest.raises(ValueError, match="act_rotation 'givens' is not one of"):
            call(x, perm, 128, None, "givens")


@pytest.mark.parametrize("k,k8", [(4096, 0), (4096, 1024), (4096, 4096), (14336, 3584),
                                  (8192, 2048), (28672, 7168), (1536, 384)])
@pytest.mark.parametrize("w4ax", [False, "none", "hadamard64"])
def test_quant_launch_num_warps_is_power_of_two(k, k8, w4ax, monkeypatch):
    """The interpreter ignores num_warps; the GPU compiler refuses any that is not a power of
    two (found on the H100, 2026-11-23: K=4096 with 25% 8-bit blocks asked for 10 warps)."""
    seen = []

    class Capture:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw["num_warps"])

    monkeypatch.setattr(tg, "_quant_act_kernel", Capture())
    _force_split(monkeypatch, 0)  # the split rows' warps: test below
    monkeypatch.setattr(tg, "split_rows", lambda *a, **kw: False)  # W4A8: one program a row
    x = torch.randn(2, k, dtype=torch.bfloat16)
    if w4ax:
        tg.quantize_act_w4ax(x, torch.arange(k), k8, None, w4ax)
    else:
        tg.quantize_act(x)
    assert len(seen) == 1 and seen[0] in (1, 2, 4, 8, 16), seen


@pytest.mark.parametrize("split_blocks", [1, 2, 8, 16, 32])
def test_quant_blocks_num_warps_is_power_of_two(split_blocks, monkeypatch):
    _force_split(monkeypatch, split_blocks)
    consts, warps = tg._quant_blocks_config(64)
    assert consts["R"] == split_blocks and warps in (1, 2, 4, 8, 16)


@pytest.mark.parametrize("split_blocks", [3, -2])
def test_quant_blocks_rejects_other_than_powers_of_two(split_blocks, monkeypatch):
    _force_split(monkeypatch, split_blocks)
    x = torch.randn(2, 512, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=f"W4AX_SPLIT_BLOCKS={split_blocks}: expected a power"):
        tg.quantize_act_w4ax(x, torch.arange(512, device=DEV), 128)


# --- GEMM (CPU interpreter and GPU) -----------------------------------------------------

_CONFIGS = {
    "default": None,
    "swap_split3": tg.GemmConfig(16, 64, 64, split_k=3, swap_ab=True),
    "noswap_split2": tg.GemmConfig(16, 32, 128, split_k=2, swap_ab=False),
    "bk256_chunks": tg.GemmConfig(32, 64, 256, split_k=1, swap_ab=True),
}


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("n", [64, 72])
@pytest.mark.parametrize("k,g", [(128, 64), (192, 64), (256, 64), (256, 128)])
@pytest.mark.parametrize("cfg", list(_CONFIGS))
def test_w4a8_gemm_matches_reference(m, n, k, g, cfg, seeded):
    t = _weights(n, k, g, seeded)
    xq, xs = ref.quantize_act(_act(m, k, seeded).cpu())
    config = _CONFIGS[cfg]
    if config is not None and k % config.block_k:
        pytest.skip("block_k does not divide K")
    y = _run_w4a8(t, xq.to(DEV), xs.to(DEV), None, torch.float32, config)
    assert_close_to_f64(y, _ref_w4a8(xq, xs, t, None), torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.float16])
def test_w4a8_gemm_bias_and_dtypes(out_dtype, bias_dtype, seeded):
    m, n, k, g = 5, 70, 256, 64  # N not a multiple of 8
    t = _weights(n, k, g, seeded)
    xq, xs = ref.quantize_act(_act(m, k, seeded).cpu())
    bias = None if bias_dtype is None else torch.randn(n, generator=seeded).to(bias_dtype).to(DEV)
    for config in (None, _CONFIGS["swap_split3"]):
        y = _run_w4a8(t, xq.to(DEV), xs.to(DEV), bias, out_dtype, config)
        assert_close_to_f64(y, _ref_w4a8(xq, xs, t, bias), out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cfg", [None, "swap_split3"])
def test_w4a8_epilogue_is_the_kernels(out_dtype, cfg, seeded):
    """MIXPREC_TP_REDUCE=exact runs the GEMM with unit scales (its integer sums, float32) and
    reference.w4a8_epilogue after the all-reduce: TP=1's output bit for bit only if that
    epilogue rounds as the kernel's own does."""
    if out_dtype == torch.bfloat16 and not HAS_CUDA:
        pytest.skip("the Triton interpreter truncates float32 -> bfloat16; the GPU rounds to "
                    "nearest even, as torch does (float32 covers the epilogue's arithmetic here)")
    m, n, k, g = 5, 72, 256, 64
    t = _weights(n, k, g, seeded)
    xq, xs = ref.quantize_act(_act(m, k, seeded).cpu())
    xq, xs = xq.to(DEV), xs.to(DEV)
    config = None if cfg is None else _CONFIGS[cfg]
    y = _run_w4a8(t, xq, xs, None, out_dtype, config)
    unit = dict(t, channel_scale=torch.ones_like(t["channel_scale"]))
    acc = _run_w4a8(unit, xq, torch.ones_like(xs), None, torch.float32, config)
    assert torch.equal(acc.double().cpu(), ref._int_gemm(xq.cpu(), ref.dequantize_weight_w8(
        t["qweight"].cpu(), t["group_scale"].cpu(), t["group_offset"].cpu())))
    assert torch.equal(ref.w4a8_epilogue(acc, xs, t["channel_scale"], None, out_dtype), y)


def test_w4a8_gemm_extreme_lanes(seeded):
    """Byte lanes at their limits: (q*step + offset) up to 249 with step 16 and up to 255
    with offset 240; the int8 weights reach both -119 and 127."""
    n, k, g = 64, 128, 64
    q = torch.randint(0, 16, (n, k), generator=seeded, dtype=torch.uint8)
    q[:, ::7], q[:, 3::7] = 15, 0
    big = (torch.arange(n)[:, None] + torch.arange(k // g)[None, :]) % 2 == 0
    step = torch.where(big, 16, 1).to(torch.uint8)
    off = torch.where(big, 9, 240).to(torch.uint8)
    w8 = ref.dequantize_weight_w8(F.pack_nibbles(q), step, off)
    assert int(w8.min()) == -119 and int(w8.max()) == 127
    t = {"qweight": F.pack_nibbles(q), "group_scale": step, "group_offset": off,
         "channel_scale": torch.rand(n, generator=seeded) + 0.5}
    t = {name: v.to(DEV) for name, v in t.items()}
    xq = torch.randint(-127, 128, (3, k), generator=seeded, dtype=torch.int8)
    xs = torch.rand(3, generator=seeded) + 0.1
    for config in (None, _CONFIGS["noswap_split2"]):
        y = _run_w4a8(t, xq.to(DEV), xs.to(DEV), None, torch.float32, config)
        assert_close_to_f64(y, _ref_w4a8(xq, xs, t, None), torch.float32)


@pytest.mark.parametrize("k8", [0, 128, 256])
@pytest.mark.parametrize("cfg", ["default", "swap_split3", "noswap_split2"])
@pytest.mark.parametrize("bias", [False, True])
def test_w4ax_gemm_matches_reference(k8, cfg, bias, seeded):
    m, n, k, g = 5, 72, 256, 64
    t = _weights(n, k, g, seeded)
    perm = torch.randperm(k, generator=seeded)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(_act(m, k, seeded).cpu(), perm, k8)
    b = torch.randn(n, generator=seeded).to(DEV) if bias else None
    out = _poisoned(m, n, torch.float16)
    y = tg.w4ax_gemm(x8.to(DEV), s8.to(DEV), x4.to(DEV), s4.to(DEV), t["qweight"],
                     t["group_scale"], t["group_offset"], t["channel_scale"], b, torch.float16,
                     out=out, config=_CONFIGS[cfg])
    assert y.data_ptr() == out.data_ptr()
    assert_close_to_f64(y, _ref_w4ax(x8, s8, x4, s4, t, b), torch.float16)


@pytest.mark.parametrize("tile", [None, "W4AX_WIDE_TILE"])
def test_w4ax_gemm_default_tile_above_64_tokens(tile, seeded):
    """M > 64 takes W4Ax's own tiles, not swapped: 128 tokens x 64 channels (here, the default)
    or x 128 channels on 8 warps (default from 6 tiles an SM; passed here): partial tiles on
    both sides, an 8-bit and two 4-bit blocks."""
    m, n, k, k8, g = 130, 72, 384, 128, 64
    assert tg.default_config(m, n, k, 128, num_sms=132, block_scales=True) == tg.W4AX_TILE
    t = _weights(n, k, g, seeded)
    perm = torch.randperm(k, generator=seeded)
    x8, s8, x4, s4 = ref.quantize_act_w4ax(_act(m, k, seeded).cpu(), perm, k8)
    out = _poisoned(m, n, torch.float16)
    y = tg.w4ax_gemm(x8.to(DEV), s8.to(DEV), x4.to(DEV), s4.to(DEV), t["qweight"],
                     t["group_scale"], t["group_offset"], t["channel_scale"], None, torch.float16,
                     out=out, config=getattr(tg, tile) if tile else None)
    assert_close_to_f64(y, _ref_w4ax(x8, s8, x4, s4, t, None), torch.float16)


@pytest.mark.parametrize("cfg", ["default", "swap_split3", "noswap_split2"])
def test_w4ax_block_scales_keep_small_blocks(cfg, seeded):
    """Quantize + GEMM on 4-bit blocks 10^4 apart in magnitude, weights zero on the large one:
    each block's own scale keeps the small block's 4-bit resolution (one scale per token
    rounded it to zero). Split-K sums fp32 partials in split order: same bits every run."""
    m, n, k = 5, 72, 3 * F.ACT_BLOCK
    x = torch.randn(m, k, generator=seeded, dtype=torch.float64)
    x[:, F.ACT_BLOCK:2 * F.ACT_BLOCK] *= 1e4
    w = torch.randn(n, k, generator=seeded, dtype=torch.float64)
    w[:, F.ACT_BLOCK:2 * F.ACT_BLOCK] = 0
    t = {name: v.to(DEV) for name, v in ref.quantize_weight_lqq(w, 64).items()}
    perm = torch.arange(k, device=DEV)
    xa = x.to(DEV, torch.float32)
    x8, s8, x4, s4 = tg.quantize_act_w4ax(xa, perm, F.ACT_BLOCK)
    assert s8.shape == (m, 1) and s4.shape == (m, 2)

    def run():
        return tg.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                            t["channel_scale"], None, torch.float32, config=_CONFIGS[cfg])

    y = run()
    assert torch.equal(y, run())
    assert_close_to_f64(y, _ref_w4ax(x8, s8, x4, s4, t, None), torch.float32)
    cpu = {k_: v.cpu() for k_, v in t.items()}
    w_hat = ref.dequantize_weight(cpu["qweight"], cpu["group_scale"], cpu["group_offset"],
                                  cpu["channel_scale"], torch.float64)
    exact = x @ w_hat.T
    assert float((y.cpu().double() - exact).norm() / exact.norm()) < 0.2


def test_w4a8_gemm_strided_views(seeded):
    """Row-strided views (a shard of a larger buffer) for xq, qweight and out."""
    m, n, k, g = 5, 64, 256, 64
    t = _weights(n, k, g, seeded)
    xq, xs = ref.quantize_act(_act(m, k, seeded).cpu())
    big_x = torch.zeros(m, k + 64, dtype=torch.int8, device=DEV)
    big_x[:, 32:32 + k] = xq.to(DEV)
    big_w = torch.zeros(n, k // 2 + 16, dtype=torch.uint8, device=DEV)
    big_w[:, :k // 2] = t["qweight"]
    big_out = torch.full((m, n + 8), float("nan"), device=DEV)
    views = dict(t, qweight=big_w[:, :k // 2])
    y = tg.w4a8_gemm(big_x[:, 32:32 + k], xs.to(DEV), views["qweight"], t["group_scale"],
                     t["group_offset"], t["channel_scale"], None, torch.float32,
                     out=big_out[:, :n], config=_CONFIGS["swap_split3"])
    assert_close_to_f64(y, _ref_w4a8(xq, xs, t, None), torch.float32)
    assert torch.isnan(big_out[:, n:]).all()  # nothing written outside the view


def test_linear_pipeline_matches_reference(seeded):
    """quantize_act + w4a8_gemm == reference.w4a8_linear (the quantised codes are identical)."""
    m, n, k, g = 4, 72, 256, 128
    t = _weights(n, k, g, seeded)
    x = _act(m, k, seeded, torch.float16)
    sm = (torch.rand(k, generator=seeded) + 0.5).to(DEV)
    xq, xs = tg.quantize_act(x, sm)
    y = tg.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"],
                     t["channel_scale"], None, torch.float16)
    cpu = {k_: v.cpu() for k_, v in t.items()}
    expect = ref.w4a8_linear(x.cpu().double(), cpu["qweight"], cpu["group_scale"],
                             cpu["group_offset"], cpu["channel_scale"], None, sm.cpu())
    xq_ref, xs_ref = ref.quantize_act(x.cpu(), sm.cpu())
    assert torch.equal(xq.cpu(), xq_ref)
    assert_close_to_f64(y, _ref_w4a8(xq_ref, xs_ref, t, None), torch.float16)
    assert float((y.cpu().double() - expect).norm() / expect.norm()) < 1e-2


def test_empty_batch(seeded):
    t = _weights(64, 128, 64, seeded)
    xq, xs = torch.empty(0, 128, dtype=torch.int8, device=DEV), torch.empty(0, device=DEV)
    y = tg.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    assert y.shape == (0, 64)
    q, s = tg.quantize_act(torch.empty(0, 128, device=DEV))
    assert q.shape == (0, 128) and s.shape == (0,)


# --- configuration ------------------------------------------------------------------------

H100_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240),
               (8192, 57344), (28672, 8192), (8192, 28672)]


@pytest.mark.parametrize("k,n", H100_SHAPES)
@pytest.mark.parametrize("m", [1, 16, 64, 128, 256, 1024, 4096, 8192])
@pytest.mark.parametrize("block_scales", [False, True], ids=["w4a8", "w4ax"])
def test_default_config_is_valid(k, n, m, block_scales):
    c = tg.default_config(m, n, k, 128 if block_scales else k, num_sms=132, block_scales=block_scales)
    if block_scales:
        assert 128 % c.block_k == 0  # one activation block's scale a k-step
    iters = k // c.block_k
    assert k % c.block_k == 0 and c.block_k % 64 == 0
    assert 1 <= c.split_k <= iters
    chunk = -(-iters // c.split_k)
    assert (c.split_k - 1) * chunk < iters  # no empty split
    tiles = -(-m // c.block_m) * -(-n // c.block_n)
    if c.block_m == 64 and not block_scales and c.split_k == 1:
        # W4A8's 64-token tile does not split K once its tiles fill half the SMs (the H100 sweeps)
        assert tiles >= tg.W4A8_64_SPLIT_BELOW_TILES_PER_SM * 132
    else:
        assert tiles * c.split_k >= 132  # every SM has work (weight-bound sizes: several CTAs)


def _h100_sweep_points(paths, method: str) -> list[dict]:
    """The `bench_gemm.py --sweep` points of these H100 runs, each of the sweep method given."""
    points = []
    for path in paths:
        report = json.loads(path.read_text())
        assert report["device"].startswith("NVIDIA H100"), path
        points += report["sweep"]
    assert all(p["method"] == method for p in points)
    return points


def _timed_tiles(point) -> dict:
    """A sweep point's tiles that ran, each with its time (ms)."""
    return {tg.GemmConfig(**r["config"]): r["ms"] for r in point["configs"] if "ms" in r}


def _assert_faster(points, fast_for, slow_for, factor: float) -> None:
    """At every point fast_for(K, N, M)'s tile took at most 1 / factor of slow_for's time."""
    for point in points:
        k, n, m = point["K"], point["N"], point["M"]
        timed = _timed_tiles(point)
        assert timed[fast_for(k, n, m)] * factor <= timed[slow_for(k, n, m)], (k, n, m)


def _assert_default_near_fastest(points, default_for, factor: float) -> None:
    """At every point the default tile (default_for(K, N, M)) is one the sweep timed, at most
    factor x the fastest."""
    for point in points:
        k, n, m = point["K"], point["N"], point["M"]
        timed = _timed_tiles(point)
        c = default_for(k, n, m)
        assert c in timed, (k, n, m, c)
        assert timed[c] <= factor * min(timed.values()), (k, n, m, c, timed[c], min(timed.values()))


# H100, session 75: `bench_gemm.py --sweep --sweep-method ours_triton`, 13 tiles a point; the rule
# was set from the first (M = 256 / 1024 / 4096) and checked on the second (M = 128 / 512)
S75 = Path(__file__).parents[2] / "benchmarks/results/2026-12-06-s75"
TILES_SWEEPS_H100 = [S75 / "triton-tiles/bench_gemm.json",
                     S75 / "triton-tiles-m128-512/a/bench_gemm.json",
                     S75 / "triton-tiles-m128-512/b/bench_gemm.json"]


def test_default_config_past_64_tokens_against_the_h100_sweeps():
    """The W4A8 tile past 64 tokens (LARGE_M_TILES) against the sweeps: at each of the 25 points
    timed the default is a tile the sweep timed, at most 13 % slower than the fastest (20 within
    1 %; 1.07-1.13x at M = 512 on 4096x28672, 14336x4096 and 8192x28672, where 128x64 won). The
    rule it replaced (always 128x128, split-K up to 2 CTAs an SM) was up to 2.37x off."""
    points = _h100_sweep_points(TILES_SWEEPS_H100, "ours_triton")
    assert len(points) == 25
    _assert_default_near_fastest(points, lambda k, n, m: tg.default_config(m, n, k, k, num_sms=132), 1.13)


# H100: `bench_gemm.py --sweep --sweep-method ours_w4ax_triton` (the W4Ax GEMM alone), session 76 on
# three 8B shapes (the rule's wide tile was set there) and session 77 on four 70B shapes (checked)
W4AX_TILES_SWEEPS_H100 = [Path(__file__).parents[2] / "benchmarks/results" / run / "bench_gemm.json"
                          for run in ("2026-12-06-s76/triton-tiles-w4ax",
                                      "2026-12-06-s77/triton-tiles-w4ax-70b")]


def test_default_config_w4ax_past_64_tokens_against_the_h100_sweeps():
    """W4Ax's tile past 64 tokens (128x64 on 4 warps; 128x128 on 8 warps from 6 tiles an SM)
    against the 13 tiles the sweeps timed at 24 points, M = 128-4096: at most 1.10x off the fastest
    (1.094x at worst, on 8192x10240 at M = 768). The wide tile is the one picked at the 11 points
    where it makes >= 6 tiles an SM, and there it was 0-9 % faster than 128x64 on 4 warps."""
    points = _h100_sweep_points(W4AX_TILES_SWEEPS_H100, "ours_w4ax_triton")
    assert len(points) == 24
    default_for = lambda k, n, m: tg.default_config(m, n, k, 128, num_sms=132, block_scales=True)
    _assert_default_near_fastest(points, default_for, 1.10)
    wide = [p for p in points if default_for(p["K"], p["N"], p["M"]) == tg.W4AX_WIDE_TILE]
    assert len(wide) == 11
    _assert_faster(wide, lambda k, n, m: tg.W4AX_WIDE_TILE, lambda k, n, m: tg.W4AX_TILE, 1.0)


# H100, session 78: the same sweeps at 1-64 tokens (5-8 tiles a point). The 64-token rule was set
# from the first file of each list and checked on the others (new Ms, then five new shapes).
S78 = Path(__file__).parents[2] / "benchmarks/results/2026-12-06-s78"
TILES_64_SWEEPS_H100 = [S78 / run / "bench_gemm.json" for run in
                        ("triton-tiles-m48-64", "triton-tiles-m40-56", "triton-tiles-m48-64-oos")]
W4AX_TILES_64_SWEEPS_H100 = [S78 / run / "bench_gemm.json" for run in
                             ("triton-tiles-w4ax-decode", "triton-tiles-w4ax-m40-64",
                              "triton-tiles-w4ax-m48-64-oos")]


def _old_64_token_tile(m, n, k, k_align):
    """The tile default_config took at 33-64 tokens before session 78: 64 x 128 swapped, K 128
    deep, split-K up to 2 CTAs an SM."""
    c = tg.GemmConfig(block_m=64, block_n=128, block_k=tg._largest_block_k(k_align, 128),
                      num_warps=4, num_stages=4)
    return dataclasses.replace(c, split_k=tg.choose_split(m, n, k, c, 2 * 132))


def test_default_config_64_token_tile_against_the_h100_sweeps():
    """W4A8 at 33-64 tokens (64 x 64 swapped, K 256 deep, split-K only under half the SMs'
    worth of tiles) at 32 points: at most 1.12x off the fastest (13824x5120, where split-K at 80
    tiles won, and 18944x3584, where K 512 deep won), the fastest at 15, and 1.05-1.78x faster
    than the old tile (1.09-1.83x off)."""
    points = _h100_sweep_points(TILES_64_SWEEPS_H100, "ours_triton")
    assert len(points) == 32 and all(33 <= p["M"] <= 64 for p in points)
    default_for = lambda k, n, m: tg.default_config(m, n, k, k, num_sms=132)
    _assert_default_near_fastest(points, default_for, 1.12)
    _assert_faster(points, default_for, lambda k, n, m: _old_64_token_tile(m, n, k, k), 1.04)


def test_default_config_w4ax_up_to_64_tokens_against_the_h100_sweeps():
    """W4Ax at 1-64 tokens: at 33-64 tokens 64 x 64 unswapped, the fastest tile timed at all 28
    such points and 1.03-1.45x faster than the old 64 x 128 swapped; at 1-32 tokens (the
    unchanged rule) within 1.04x of the fastest at 18 points."""
    points = _h100_sweep_points(W4AX_TILES_64_SWEEPS_H100, "ours_w4ax_triton")
    assert len(points) == 46
    default_for = lambda k, n, m: tg.default_config(m, n, k, 128, num_sms=132, block_scales=True)
    _assert_default_near_fastest(points, default_for, 1.04)
    tile_64 = [p for p in points if p["M"] > 32]
    assert len(tile_64) == 28
    _assert_default_near_fastest(tile_64, default_for, 1.0)
    _assert_faster(tile_64, default_for, lambda k, n, m: _old_64_token_tile(m, n, k, 128), 1.02)


# H100, session 79: W4A8 at 1-32 tokens (8-11 tiles a point). The 3-stage rule was set from the
# first file and checked on the second; the unswapped long-K rule was set from the first two and
# the third (where it was still 4 stages) and checked on the fourth.
S79 = Path(__file__).parents[2] / "benchmarks/results/2026-12-06-s79"
TILES_DECODE_SWEEPS_H100 = [S79 / run / "bench_gemm.json" for run in
                            ("triton-tiles-decode", "triton-tiles-decode-oos",
                             "triton-tiles-decode-longk", "triton-tiles-decode-longk-oos")]


def _old_decode_tile(m, n, k):
    """default_config's W4A8 tile at 1-32 tokens before session 79: swapped, 4 stages."""
    c = tg.GemmConfig(block_m=16 if m <= 16 else 32, block_n=64,
                      block_k=tg._largest_block_k(k, 256), num_warps=4, num_stages=4)
    return dataclasses.replace(c, split_k=tg.choose_split(m, n, k, c, 2 * 132))


def test_default_config_decode_tile_against_the_h100_sweeps():
    """W4A8 at 1-32 tokens: 3 stages, and unswapped at 1-16 tokens where K >= 10240 with
    K-256 tiles. Of 61 points the default was timed at 53 (the first two runs did not time
    the unswapped tile on 3 stages): there it is 1.007-1.34x faster than the old tile, within
    1.04x of the fastest at 1-16 tokens (the fastest at 33 of 40) and 1.14x at 32 tokens
    (split-K or K depth would win there). 3 stages beat 4 on the swapped tile at all 39 points
    of the first two runs; unswapped beat swapped (both on 3 stages) by 1.036-1.34x at all 19
    points where the rule takes it and the default was timed."""
    points = _h100_sweep_points(TILES_DECODE_SWEEPS_H100, "ours_triton")
    assert len(points) == 61 and all(p["M"] <= 32 for p in points)
    default_for = lambda k, n, m: tg.default_config(m, n, k, k, num_sms=132)
    timed = [p for p in points if default_for(p["K"], p["N"], p["M"]) in _timed_tiles(p)]
    assert len(timed) == 53
    _assert_faster(timed, default_for, lambda k, n, m: _old_decode_tile(m, n, k), 1.005)
    _assert_default_near_fastest([p for p in timed if p["M"] <= 16], default_for, 1.04)
    _assert_default_near_fastest(timed, default_for, 1.14)
    swapped_on = lambda stages: lambda k, n, m: dataclasses.replace(
        _old_decode_tile(m, n, k), num_stages=stages)
    _assert_faster(points[:39], swapped_on(3), swapped_on(4), 1.0)
    unswapped = [p for p in timed if not default_for(p["K"], p["N"], p["M"]).swap_ab]
    assert len(unswapped) == 19
    _assert_faster(unswapped, default_for, swapped_on(3), 1.03)


def test_default_config_32_token_tile_keeps_4_stages_before_hopper():
    """3 stages spill the swapped 32-token tile on sm_80 (test_triton_gemm_compile.py), and
    nothing timed them there; 16-token tiles take 3 stages on every arch."""
    for k, n in ((4096, 28672), (14336, 4096)):
        assert tg.default_config(32, n, k, k, 108, sm_major=8).num_stages == 4
        assert tg.default_config(32, n, k, k, 132, sm_major=9).num_stages == 3
        assert tg.default_config(16, n, k, k, 108, sm_major=8).num_stages == 3


def test_default_config_w4ax_block_k_divides_k8():
    c = tg.default_config(1, 4096, 4096, 128, num_sms=132)  # gcd(K, k8) = 128
    assert c.block_k == 128


# --- errors -------------------------------------------------------------------------------

def _good(seeded, m=3, n=64, k=256, g=64):
    t = _weights(n, k, g, seeded)
    xq, xs = ref.quantize_act(_act(m, k, seeded).cpu())
    return t, xq.to(DEV), xs.to(DEV)


def test_group_size_errors(seeded):
    t, xq, xs = _good(seeded)
    bad = t["group_scale"][:, :3].contiguous()  # 256 / 3 groups: K not a multiple of G
    with pytest.raises(ValueError, match="group_scale"):
        tg.w4a8_gemm(xq, xs, t["qweight"], bad, t["group_offset"][:, :3].contiguous(),
                     t["channel_scale"])
    g32 = t["group_scale"].repeat(1, 2)  # 8 groups of 32: unsupported group size
    with pytest.raises(ValueError, match="group_scale"):
        tg.w4a8_gemm(xq, xs, t["qweight"], g32, t["group_offset"].repeat(1, 2), t["channel_scale"])
    with pytest.raises(ValueError, match="group_offset"):
        tg.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"][:, :2].contiguous(),
                     t["channel_scale"])


def test_shape_errors(seeded):
    t, xq, xs = _good(seeded)
    with pytest.raises(ValueError, match="qweight"):
        tg.w4a8_gemm(xq[:, :128], xs, t["qweight"], t["group_scale"][:, :2], t["group_offset"][:, :2],
                     t["channel_scale"])
    with pytest.raises(ValueError, match="x_scale"):
        tg.w4a8_gemm(xq, xs[:2], t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    with pytest.raises(ValueError, match="bias"):
        tg.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                     torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="block_k"):
        tg.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                     config=tg.GemmConfig(16, 64, 96))
    with pytest.raises(ValueError, match="k8"):
        tg.quantize_act_w4ax(torch.randn(2, 256, device=DEV), torch.arange(256, device=DEV), 300)
    with pytest.raises(ValueError, match="x8"):
        tg.w4ax_gemm(xq[:, :64], xs, xq[:, :96].view(torch.uint8), xs, t["qweight"],
                     t["group_scale"], t["group_offset"], t["channel_scale"])
    x8, s8, x4, s4 = tg.quantize_act_w4ax(xq.float(), torch.arange(256, device=DEV), 128)
    w4ax_w = (t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    with pytest.raises(ValueError, match="s8"):  # one scale per token: the old format
        tg.w4ax_gemm(x8, s8[:, 0], x4, s4, *w4ax_w)
    with pytest.raises(ValueError, match="s4"):
        tg.w4ax_gemm(x8, s8, x4, torch.cat([s4, s4], 1), *w4ax_w)
    with pytest.raises(ValueError, match="block_k"):  # a k-iteration must lie in one block
        tg.w4ax_gemm(x8, s8, x4, s4, *w4ax_w, config=tg.GemmConfig(16, 64, 256))


def test_dtype_errors(seeded):
    t, xq, xs = _good(seeded)
    args = [xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"]]
    for i, name, bad in [(0, "xq", xq.float()), (1, "x_scale", xs.half()),
                         (2, "qweight", t["qweight"].view(torch.int8)),
                         (3, "group_scale", t["group_scale"].int()),
                         (5, "channel_scale", t["channel_scale"].half())]:
        a = list(args)
        a[i] = bad
        with pytest.raises(TypeError, match=name):
            tg.w4a8_gemm(*a)
    with pytest.raises(TypeError, match="out_dtype"):
        tg.w4a8_gemm(*args, None, torch.int32)
    with pytest.raises(TypeError, match="out"):
        tg.w4a8_gemm(*args, out=torch.empty(3, 64, dtype=torch.float32, device=DEV))
    with pytest.raises(TypeError, match="x"):
        tg.quantize_act(torch.ones(2, 128, dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="perm"):
        tg.quantize_act_w4ax(torch.randn(2, 256, device=DEV), torch.arange(256.0, device=DEV), 128)


# --- GPU: realistic shapes, graphs, PTX path ------------------------------------------------

def _gpu_case(m, n, k, g, seed):
    gen = torch.Generator().manual_seed(seed)
    t = _weights(n, k, g, gen, "cuda")
    x = _act(m, k, gen, torch.bfloat16, "cuda")
    return t, x


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 33, 100, 257, 1000, 4096])
@pytest.mark.parametrize("n,k,g", [(4096 + 64, 4096, 128), (1000, 4096 + 64, 64), (4096, 14336, 64)])
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_gpu_w4a8_shapes(m, n, k, g, out_dtype):
    t, x = _gpu_case(m, n, k, g, seed=m * 7 + n)
    xq, xs = tg.quantize_act(x)
    q_ref, s_ref = ref.quantize_act(x)
    assert torch.equal(xq, q_ref) and torch.equal(xs, s_ref)
    bias = torch.randn(n, device="cuda", dtype=out_dtype)
    y = _run_w4a8(t, xq, xs, bias, out_dtype)
    assert_close_to_f64(y, ref.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"],
                                         t["channel_scale"], bias, torch.float64), out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    tg.GemmConfig(16, 64, 256, split_k=4), tg.GemmConfig(16, 64, 128, split_k=7, swap_ab=False),
    tg.GemmConfig(64, 128, 128, split_k=2), tg.GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
    tg.GemmConfig(128, 128, 128, num_warps=8, num_stages=3, swap_ab=False),
    tg.GemmConfig(256, 128, 128, num_warps=8, num_stages=3), tg.GemmConfig(128, 256, 64, num_warps=8)])
@pytest.mark.parametrize("asm", [True, False])
def test_gpu_w4a8_configs_and_portable_path(config, asm, monkeypatch):
    """Every benchmarked tile shape, with the PRMT asm and with the portable byte shuffle."""
    monkeypatch.setattr(tg, "_interpreting", lambda: not asm)
    m, n, k = 300, 4096 + 64, 4096
    t, x = _gpu_case(m, n, k, 64, seed=1)
    xq, xs = tg.quantize_act(x)
    y = _run_w4a8(t, xq, xs, None, torch.bfloat16, config)
    assert_close_to_f64(y, ref.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"],
                                         t["channel_scale"], None, torch.float64), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 257, 600])
@pytest.mark.parametrize("k", [8960, 14336, 28672])  # Qwen2.5-1.5B, Llama-3-8B, -70B (two passes)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gated", [True, False], ids=["silu_mul", "plain"])
def test_gpu_quantize_act_long_rows(m, k, dtype, gated):
    """silu_mul_quantize_act bit for bit the two torch ops, and quantize_act the reference, on the
    GPU, a NaN row included (H100, 2026-11-26: bf16 lost the NaN, to -0, before _rounded_as kept
    NaN apart). m = 1 and 8 take the split-row kernels (split_rows), m = 257 too when gated,
    m = 600 one program a row (28672 columns: two passes)."""
    gen = torch.Generator().manual_seed(m + k)
    x = (_act(m, (1 + gated) * k, gen) * 0.5).to(dtype).cuda()
    x[-1, 5] = float("nan")
    op, ref_op = ((tg.silu_mul_quantize_act, ref.silu_mul_quantize_act) if gated
                  else (tg.quantize_act, ref.quantize_act))
    q, s = op(x)
    q_ref, s_ref = ref_op(x)
    assert torch.isnan(s[-1]) and not torch.isnan(s[:-1]).any()
    assert torch.equal(s.nan_to_num(-1.0), s_ref.nan_to_num(-1.0))
    assert torch.equal(q, q_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k8,rotation", [(1, 0, "none"), (16, 512, "none"), (48, 1024, "none"),
                                            (200, 1024, "none"),
                                            (1000, 4096, "none"), (1, 1024, "hadamard"),
                                            (200, 1024, "hadamard"), (1, 0, "hadamard64"),
                                            (1000, 2048, "hadamard64")])
@pytest.mark.parametrize("split_blocks", [0, 8])
def test_gpu_w4ax(m, k8, rotation, split_blocks, monkeypatch):
    """Codes and scales bit for bit (the fast Hadamard transform inside the quantize kernel
    against the reference's torch ops on the GPU; one program a row, and rows split over
    programs), then the GEMM against float64."""
    _force_split(monkeypatch, split_blocks)
    n, k, g = 4096 + 64, 4096, 128
    t, x = _gpu_case(m, n, k, g, seed=m)
    perm = torch.randperm(k, device="cuda")
    x8, s8, x4, s4 = tg.quantize_act_w4ax(x, perm, k8, None, rotation)
    for a, b in zip((x8, s8, x4, s4), ref.quantize_act_w4ax(x, perm, k8, None, rotation)):
        assert torch.equal(a, b)
    y = tg.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                     t["channel_scale"], None, torch.float16, out=_poisoned(m, n, torch.float16))
    assert_close_to_f64(y, ref.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"],
                                         t["group_offset"], t["channel_scale"], None, torch.float64),
                        torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("k,k8", [(14336, 0), (14336, 3584), (28672, 0), (1536, 384)])
@pytest.mark.parametrize("rotation", ["hadamard", "hadamard64"])
@pytest.mark.parametrize("split_blocks", [0, 8])
@pytest.mark.parametrize("perm_form", F.ACT_PERM_FORMS)
def test_gpu_w4ax_rotation_long_rows(m, k, k8, rotation, split_blocks, perm_form, monkeypatch):
    """The rotation in the compiled kernels: one program a row on a row of more than
    ROTATED_CHUNK_BLOCKS 4-bit blocks (K = 28672: two passes, the second from L2), long rows in
    one pass (K = 14336) and a short one; rows split over programs (a programmatic dependent
    second pass on Hopper); the permutation a block table or a channel one; a NaN row included:
    bit for bit the reference's torch ops."""
    _force_split(monkeypatch, split_blocks)
    gen = torch.Generator().manual_seed(m + k + k8)
    x = _act(m, k, gen, torch.bfloat16).cuda()
    x[-1, 3] = float("nan")
    perm = F.random_act_perm(k, perm_form, gen).cuda()
    smooth = (torch.rand(k, generator=gen) + 0.5).cuda()
    for a, b in zip(tg.quantize_act_w4ax(x, perm, k8, smooth, rotation),
                    ref.quantize_act_w4ax(x, perm, k8, smooth, rotation)):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_gpu_cuda_graph_replay_and_determinism(m):
    """quantize + GEMM captured in a graph: replays with new inputs match eager, bit for bit
    (split-K included: its workspace is re-zeroed inside the graph)."""
    n, k = 4096, 4096
    t, x = _gpu_case(m, n, k, 64, seed=5)
    static_x = x.clone()

    def layer(inp):
        xq, xs = tg.quantize_act(inp)
        return tg.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"],
                            t["channel_scale"], None, torch.bfloat16)

    eager = layer(static_x)
    assert torch.equal(eager, layer(static_x))  # deterministic (split-K is integer)
    graph, static_y = _captured(layer, static_x)
    for seed in (11, 12):
        new = _act(m, k, torch.Generator().manual_seed(seed), torch.bfloat16, "cuda")
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, layer(new))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 300])
@pytest.mark.parametrize("perm_form", F.ACT_PERM_FORMS)
def test_gpu_w4ax_cuda_graph_replay(m, perm_form, monkeypatch):
    """The W4Ax quantizer's split rows (two launches, the second a programmatic dependent one on
    Hopper) and the GEMM captured in a graph: replays with new inputs, a NaN row included,
    match eager bit for bit."""
    n, k, k8 = 4096, 4096, 1024
    t, x = _gpu_case(m, n, k, 128, seed=6)
    perm = F.random_act_perm(k, perm_form, device="cuda")
    static_x = x.clone()
    _force_split(monkeypatch, 8)

    def layer(inp):
        q = tg.quantize_act_w4ax(inp, perm, k8, None, "hadamard64")
        return q, tg.w4ax_gemm(*q, t["qweight"], t["group_scale"], t["group_offset"],
                               t["channel_scale"], None, torch.bfloat16)

    graph, (static_q, static_y) = _captured(layer, static_x)
    for seed in (11, 12):
        new = _act(m, k, torch.Generator().manual_seed(seed), torch.bfloat16, "cuda")
        new[-1, seed] = float("nan")
        static_x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want_q, want_y = layer(new)
        for a, b in zip(static_q, want_q):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        assert torch.equal(static_y.nan_to_num(7.0), want_y.nan_to_num(7.0))
        assert torch.isnan(static_y[-1]).all() and not torch.isnan(static_y[:-1]).any()


def test_bench_gemm_imports_without_gpu(repo_module):
    """benchmarks/bench_gemm.py keeps its CUDA-only imports inside main()."""
    mod = repo_module("benchmarks/bench_gemm.py")
    args = mod.parse_args(["--quick", "--out", "/tmp/x"])
    assert args.shapes == [(8192, 28672), (4096, 4096)] and args.ms == [1, 16, 256, 4096]
    assert mod.n_copies(4096 * 4096 // 2) >= 2 and mod.n_copies(8192 * 28672 // 2) == 1


def test_bench_gemm_w4ax_options_and_bad_share(repo_module, capsys):
    mod = repo_module("benchmarks/bench_gemm.py")
    args = mod.parse_args(["--w4ax-a8-share", "0.457", "--w4ax-rotation", "hadamard64"])
    assert (args.w4ax_a8_share, args.w4ax_rotation) == (0.457, "hadamard64")
    assert mod.parse_args([]).w4ax_a8_share == 0.25
    with pytest.raises(SystemExit):
        mod.parse_args(["--w4ax-a8-share", "1.5"])
    assert "--w4ax-a8-share=1.5: expected a share in [0, 1]" in capsys.readouterr().err
    assert mod.parse_args(["--w4ax-rotated-chunk-blocks", "128"]).w4ax_rotated_chunk_blocks == 128
    with pytest.raises(SystemExit):
        mod.parse_args(["--w4ax-rotated-chunk-blocks", "96"])
    assert "--w4ax-rotated-chunk-blocks=96: expected a power of two" in capsys.readouterr().err
    assert mod.parse_args(["--w4ax-split-blocks", "0"]).w4ax_split_blocks == 0
    assert mod.parse_args([]).w4ax_split_blocks is None
    with pytest.raises(SystemExit):
        mod.parse_args(["--w4ax-split-blocks", "12"])
    assert "--w4ax-split-blocks=12: expected 0 or a power of two" in capsys.readouterr().err
    # the W4Ax methods' permutation: by default a block table, as a default checkpoint runs
    assert mod.parse_args([]).w4ax_perm == "blocks"
    k = 512
    perms = {kind: mod.w4ax_perm(k, kind, "cpu") for kind in mod.W4AX_PERMS}
    assert [F.act_perm_unit(perms[kind], k) for kind in mod.W4AX_PERMS] == [F.ACT_BLOCK, 1, 1]
    assert F.act_block_perm(perms["blocks-as-channels"]) is not None
    assert F.act_block_perm(perms["channels"]) is None
    with pytest.raises(SystemExit):
        mod.parse_args(["--w4ax-perm", "rows"])


def test_bench_gemm_replot_skips_methods_not_run(repo_module, tmp_path):
    """--replot of a run without the Triton linear draws the csrc figure only (no empty one)."""
    pytest.importorskip("matplotlib")
    mod = repo_module("benchmarks/bench_gemm.py")
    row = {"K": 4096, "N": 4096, "M": 16, "methods": {
        "ours_cuda": {"ms": 0.008, "speedup_vs_marlin_w4a16": 1.25}, "marlin_w4a16": {"ms": 0.010}}}
    report = tmp_path / "bench_gemm.json"
    report.write_text(json.dumps({"device": "test", "results": [row]}))
    assert mod.main(["--replot", str(report), "--out", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["bench_gemm_speedup.png"]


def test_bench_gemm_quantizer_column(repo_module, tmp_path, capsys):
    """ours_cuda_quant (the linear's quantizer alone) reads no weights, counts bf16 in and int8 +
    a scale a row out, and shows in the table as cuda-q without a speed-up over Marlin."""
    mod = repo_module("benchmarks/bench_gemm.py")
    assert "ours_cuda_quant" in mod.parse_args([]).methods and mod.setup_of("ours_cuda_quant") == "ours_cuda"
    meth = object.__new__(mod.Methods)
    meth.K = 4096
    assert meth.bytes_moved("ours_cuda_quant", 16) == 16 * 4096 * 3 + 16 * 4
    meth.w4ax_k8 = 1024  # W4Ax's quantizer: bf16 in, 1024 int8 + 3072 4-bit codes, 32 scales out
    assert meth.bytes_moved("ours_w4ax_rot_quant", 2) == 2 * (4096 * 2 + 1024 + 1536 + 32 * 4)
    assert meth.bytes_moved("ours_w4ax_quant", 2) == meth.bytes_moved("ours_w4ax_rot_quant", 2)
    assert {"ours_w4ax_quant", "ours_w4ax_rot_quant"} <= set(mod.QUANT_ONLY)
    row = {"K": 4096, "N": 4096, "M": 16, "methods": {
        "ours_cuda": {"ms": 0.008, "speedup_vs_marlin_w4a16": 1.25}, "ours_cuda_quant": {"ms": 0.002},
        "marlin_w4a16": {"ms": 0.010}}}
    report = tmp_path / "bench_gemm.json"
    report.write_text(json.dumps({"device": "test", "results": [row]}))
    assert mod.main(["--replot", str(report), "--out", str(tmp_path / "plots")]) == 0
    head, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "cuda-q" in head and "2.0" in line.split()


def test_bench_gemm_w4ax_gemm_alone(repo_module):
    """ours_w4ax_triton (the W4Ax GEMM on codes quantized once: what --sweep-method
    ours_w4ax_triton times) shares the Triton weights and counts the codes it reads, not bf16."""
    mod = repo_module("benchmarks/bench_gemm.py")
    assert mod.setup_of("ours_w4ax_triton") == "ours" and "ours_w4ax_triton" not in mod.QUANT_ONLY
    assert mod.parse_args(["--sweep", "--sweep-method", "ours_w4ax_triton"]).sweep_method == "ours_w4ax_triton"
    meth = object.__new__(mod.Methods)
    meth.K, meth.N, meth.w4ax_k8 = 4096, 1024, 1024
    meth.setups = {"ours": (1000, [])}  # weight bytes, copies
    codes = 1024 + 3072 // 2 + 32 * 4  # a row: int8, packed int4, a float32 scale a block
    assert meth.bytes_moved("ours_w4ax_triton", 2) == 1000 + 2 * codes + 2 * 1024 * 2
    assert meth.bytes_moved("ours_w4ax_triton_q", 2) == 1000 + 2 * 4096 * 2 + 2 * 1024 * 2
