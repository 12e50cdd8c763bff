"""Property-based tests (hypothesis): the Triton W4A8/W4Ax kernels against reference.py.

On the CPU they run in the Triton interpreter, with GPU NaN semantics (the
`gpu_float_semantics` fixture: tl.maximum/tl.clamp drop NaN as PTX max.f32 does); shapes are
kept small because the interpreter is slow. On a GPU the same tests run on the device
(`pytest -m gpu` is not needed: they are not marked, the shapes are tiny either way).

Properties:
  * quantize_act / quantize_act_w4ax are bit-exact with the reference, including the
    non-finite policy (NaN scale, W4Ax: NaN in every block scale, and zero codes for a row
    holding a NaN or an Inf);
  * the GEMMs equal the float64 reference within one rounding of the output dtype, a
    poisoned activation row gives a NaN output row, and the other rows are untouched.
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mixprec_strategies import activations, float_tensor, poison_rows  # noqa: E402

from vllm_mixprec import formats as F  # noqa: E402
from vllm_mixprec import reference as ref  # noqa: E402
from vllm_mixprec.kernels.triton import gemm as tg  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_EPS_OUT = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}
SMALL = tg.GemmConfig(block_m=16, block_n=32, block_k=64, split_k=1)


@pytest.fixture(autouse=True)
def _nan_like_gpu(gpu_float_semantics):
    return


def _same_codes_and_scales(got, want, bad):
    """Bit-exact codes and scales; NaN scales exactly where the reference has them."""
    for g, w in zip(got, want):
        g = g.cpu()
        if g.is_floating_point():
            assert torch.equal(torch.isnan(g), torch.isnan(w)), (g, w)
            assert torch.equal(torch.nan_to_num(g), torch.nan_to_num(w)), (g, w)
        else:
            assert torch.equal(g, w), (g, w)


@settings(max_examples=80)
@given(activations(st.integers(1, 4), st.sampled_from((64, 128, 192, 256, 320))))
def test_quantize_act_matches_reference(xbs):
    x, bad, smooth = xbs
    want = ref.quantize_act(x, smooth)
    got = tg.quantize_act(x.to(DEV), None if smooth is None else smooth.to(DEV))
    _same_codes_and_scales(got, want, bad)
    assert torch.isnan(got[1].cpu()[bad]).all()


@settings(max_examples=40)
@given(xbs=activations(st.integers(1, 4), st.sampled_from((128, 256, 384))),
       seed=st.integers(0, 2**16), rotation=st.sampled_from(F.ACT_ROTATIONS))
def test_quantize_act_w4ax_matches_reference(xbs, seed, rotation):
    x, bad, smooth = xbs
    k = x.shape[1]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(k, generator=g).to(torch.int32)
    k8 = 128 * int(torch.randint(0, k // 128 + 1, (1,), generator=g))
    want = ref.quantize_act_w4ax(x, perm, k8, smooth, rotation)
    got = tg.quantize_act_w4ax(x.to(DEV), perm.to(DEV), k8, None if smooth is None else smooth.to(DEV),
                               rotation)
    # one scale per (token, 128-channel block); a poisoned row: NaN in all of them
    assert got[1].shape == (x.shape[0], k8 // 128) and got[3].shape == (x.shape[0], (k - k8) // 128)
    _same_codes_and_scales(got, want, bad)
    assert torch.isnan(torch.cat([got[1], got[3]], 1).cpu()[bad]).all()


def _close_to_f64(y, r, out_dtype):
    """One rounding of out_dtype (relative, plus one subnormal step: found by these tests,
    denormal outputs round in absolute steps) and 1e-6 of the output scale (fp32 epilogue)."""
    fi = torch.finfo(out_dtype)
    over = r.abs() > fi.max * (1 + _EPS_OUT[out_dtype] / 2)  # beyond the dtype: must be +-inf
    assert torch.equal(y.double()[over], r.to(out_dtype).double()[over])
    y, r = y.double()[~over], r[~over]
    if r.numel():
        err = (y - r).abs()
        tol = _EPS_OUT[out_dtype] * r.abs() + 1e-6 * r.abs().max() + fi.smallest_normal * fi.eps
        assert (err <= tol).all(), float((err - tol).max())


@st.composite
def gemm_case(draw, k_choices):
    m, k = draw(st.integers(1, 5)), draw(st.sampled_from(k_choices))
    n = 32 * draw(st.integers(1, 2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    wdist = draw(st.sampled_from(["normal", "constant", "mixed", "extremes"]))
    w = float_tensor(draw, (n, k), torch.float32, wdist)
    t = ref.quantize_weight_lqq(w, draw(st.sampled_from([64, 128])) if k % 128 == 0 else 64)
    if draw(st.booleans()):  # denormal channel scales (a tiny layer, or a corrupt-ish one)
        t["channel_scale"] = t["channel_scale"] * 0 + torch.finfo(torch.float32).smallest_normal / 8
    x = float_tensor(draw, (m, k), torch.float16, draw(st.sampled_from(["normal", "constant", "denormal"])))
    bad = poison_rows(draw, x)
    bias = torch.randn(n, generator=g).half() if draw(st.booleans()) else None
    out_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    return x, bad, t, bias, out_dtype


@settings(max_examples=40)
@given(gemm_case((64, 128, 256)))
def test_w4a8_gemm_matches_reference(case):
    x, bad, t, bias, out_dtype = case
    xq, xs = ref.quantize_act(x)
    r = ref.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                      bias, torch.float64)
    d = {k: v.to(DEV) for k, v in t.items()}
    y = tg.w4a8_gemm(xq.to(DEV), xs.to(DEV), d["qweight"], d["group_scale"], d["group_offset"],
                     d["channel_scale"], None if bias is None else bias.to(DEV), out_dtype,
                     config=SMALL).cpu()
    assert torch.isnan(y[bad]).all() and torch.isnan(r[bad]).all()
    _close_to_f64(y[~bad], r[~bad], out_dtype)


@settings(max_examples=20)
@given(case=gemm_case((128, 256)), seed=st.integers(0, 2**16))
def test_w4ax_gemm_matches_reference(case, seed):
    x, bad, t, bias, out_dtype = case
    k = x.shape[1]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(k, generator=g).to(torch.int32)
    k8 = 128 * int(torch.randint(0, k // 128 + 1, (1,), generator=g))
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, k8)
    r = ref.w4ax_gemm(x8, s8, x4, s4, t["qweight"], t["group_scale"], t["group_offset"],
                      t["channel_scale"], bias, torch.float64)
    d = {k_: v.to(DEV) for k_, v in t.items()}
    y = tg.w4ax_gemm(x8.to(DEV), s8.to(DEV), x4.to(DEV), s4.to(DEV), d["qweight"], d["group_scale"],
                     d["group_offset"], d["channel_scale"], None if bias is None else bias.to(DEV),
                     out_dtype, config=SMALL).cpu()
    assert torch.isnan(y[bad]).all() and torch.isnan(r[bad]).all()
    _close_to_f64(y[~bad], r[~bad], out_dtype)
