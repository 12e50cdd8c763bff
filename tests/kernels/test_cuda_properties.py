"""Property-based tests (hypothesis): the csrc ops against reference.py, on the GPU.

The Triton twins of these properties are in test_triton_properties.py (they also run on the
CPU); the csrc ops exist only on a GPU, so this file is `gpu`-marked. Run on the GPU host with
`bash scripts/gpu_check.sh property` (hypothesis is not part of the host's wheels: the stage
puts a copy carried in .gpu/pyextra on the path).

Properties:
  * quantize_act is bit-exact with the reference over every value distribution of
    mixprec_strategies (all-equal rows, +-max, denormals, zeros, mixed magnitudes), with
    and without a smoothing scale; a row holding a NaN or an Inf gets a NaN scale and zero codes;
  * w4a8_gemm, on every kernel family (mma.sync 0..3, wgmma 4..6 on sm_90) and split count,
    equals the float64 reference within one rounding of the output dtype, writes every
    element (outputs are poisoned first), and a NaN activation scale gives a NaN output row
    while leaving the other rows untouched.
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from cuda_gemm_helpers import skip_without_csrc_ops  # noqa: E402
from mixprec_strategies import activations, float_tensor  # noqa: E402

from vllm_mixprec import reference as ref  # noqa: E402
from vllm_mixprec.kernels import cuda  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
_EPS_OUT = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}


@pytest.fixture(autouse=True)
def _need_ops():
    skip_without_csrc_ops()


def _kernels() -> list[int]:
    """-1 (auto), the mma.sync kernels, and the wgmma kernels where this GPU and build have them."""
    return [-1, 0, 1, 2, 3] + ([4, 5, 6] if torch.cuda.is_available() and cuda.has_wgmma() else [])


@settings(max_examples=150)
@given(activations(st.integers(1, 40), st.integers(1, 12).map(lambda i: 64 * i)))
def test_quantize_act_matches_reference(xbs):
    x, bad, smooth = xbs
    want_q, want_s = ref.quantize_act(x, smooth)
    got_q, got_s = cuda.quantize_act(x.to(DEV), None if smooth is None else smooth.to(DEV))
    got_q, got_s = got_q.cpu(), got_s.cpu()
    assert torch.equal(torch.isnan(got_s), torch.isnan(want_s)), (got_s, want_s)
    assert torch.equal(torch.nan_to_num(got_s), torch.nan_to_num(want_s)), (got_s, want_s)
    assert torch.equal(got_q, want_q)
    assert torch.isnan(got_s[bad]).all() and (got_q[bad] == 0).all()


@st.composite
def gemm_case(draw):
    m = draw(st.sampled_from([1, 2, 7, 16, 33, 64, 65, 130, 257]))
    n = 16 * draw(st.integers(1, 40))
    g = draw(st.sampled_from([64, 128]))
    k = g * draw(st.integers(1, 24 if g == 64 else 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    wdist = draw(st.sampled_from(["normal", "constant", "mixed", "extremes"]))
    w = float_tensor(draw, (n, k), torch.float32, wdist)
    t = ref.quantize_weight_lqq(w, g)
    t["channel_scale"] = t["channel_scale"].clamp_max(1e-3)  # fp16 outputs stay finite
    xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int32).to(torch.int8)
    xs = torch.rand(m, generator=gen) + 0.01
    bad = torch.zeros(m, dtype=torch.bool)
    if draw(st.booleans()):  # a token row whose activations held a NaN (quantize_act's policy)
        bad[draw(st.integers(0, m - 1))] = True
        xs[bad] = float("nan")
        xq[bad] = 0
    bias = torch.randn(n, generator=gen).half() if draw(st.booleans()) else None
    out_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    kernel = draw(st.sampled_from(_kernels()))
    splits = draw(st.sampled_from([0, 1, 2, 3])) if kernel >= 4 else 0
    return xq, xs, bad, t, bias, out_dtype, kernel, splits


@settings(max_examples=250)
@given(gemm_case())
def test_w4a8_gemm_matches_reference(case):
    xq, xs, bad, t, bias, out_dtype, kernel, splits = case
    want = ref.w4a8_gemm(xq, xs, t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"],
                         bias, torch.float64)
    d = {k: v.to(DEV) for k, v in t.items()}
    packed, gparams = cuda.repack_w4a8(d["qweight"], d["group_scale"], d["group_offset"])
    m, n = want.shape
    poison = torch.full((m * n,), float("nan"), dtype=out_dtype, device=DEV)  # the output reuses it
    del poison
    args = (xq.to(DEV), xs.to(DEV), packed, gparams, d["channel_scale"].float(),
            None if bias is None else bias.to(DEV), out_dtype, kernel, splits)
    if kernel in (0, 1) and m > 64:  # a forced decode kernel refuses a prefill M by name
        with pytest.raises(RuntimeError, match=r"decode kernels \(0, 1\) need M <= 64"):
            torch.ops.mixprec_C.w4a8_gemm(*args)
        return
    got = torch.ops.mixprec_C.w4a8_gemm(*args).cpu()
    assert got.shape == want.shape and got.dtype == out_dtype
    assert torch.isnan(got[bad]).all()
    g, w = got[~bad].double(), want[~bad]
    assert torch.isfinite(g).all(), "an output element left unwritten (poison) or overflowed"
    bound = _EPS_OUT[out_dtype] * w.abs() + 1e-6 * (float(w.abs().max()) if w.numel() else 0.0) + 1e-30
    off = int(((g - w).abs() > bound).sum())
    assert off == 0, f"kernel {kernel} splits {splits}: {off} elements off, max {float((g - w).abs().max()):.3g}"
