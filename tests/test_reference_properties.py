"""Property-based tests (hypothesis) of reference.py, the CPU path and oracle of every kernel,
including its non-finite policy (docs/RELIABILITY.md):
  * the offline quantizer refuses NaN/Inf weights;
  * a NaN/Inf activation row gets a NaN scale and zero codes, so the linear layer's output
    row is NaN (visibly), and the other rows are exactly what they would be without it;
  * a NaN/Inf K or V row is stored with a NaN scale (kv4: and zero) and zero codes.
"""
from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from mixprec_strategies import float_tensor, poison_rows  # noqa: E402

from vllm_mixprec import formats as F  # noqa: E402
from vllm_mixprec import kernels  # noqa: E402,F401  (registers torch.ops.mixprec.*)
from vllm_mixprec import reference as ref  # noqa: E402

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- weights --------------------------------------------------------------------------------

@st.composite
def weights(draw):
    g = draw(st.sampled_from(F.SUPPORTED_GROUP_SIZES))
    n, k = draw(st.integers(1, 6)), g * draw(st.integers(1, 3))
    w = float_tensor(draw, (n, k), torch.float32).double()
    if draw(st.booleans()):  # one all-equal group inside an otherwise random row
        r, c = draw(st.integers(0, n - 1)), draw(st.integers(0, k // g - 1))
        w[r, c * g:(c + 1) * g] = w[r, c * g]
    return w, g


@settings(max_examples=100)
@given(weights())
def test_lqq_quantize_properties(wg):
    w, g = wg
    t = ref.quantize_weight_lqq(w, g)
    assert F.lqq_param_errors(t["qweight"], t["group_scale"], t["group_offset"]) == []
    cs = t["channel_scale"]
    assert bool(torch.isfinite(cs).all()) and bool((cs > 0).all())
    w8, _ = ref.quantize_w8_per_channel(w)
    w8_hat = ref.dequantize_weight_w8(t["qweight"], t["group_scale"], t["group_offset"])
    n, k = w.shape
    err = (w8_hat.int() - w8.int()).view(n, k // g, g).double()
    grp = w8.int().view(n, k // g, g)
    rng = (grp.amax(-1) - grp.amin(-1)).double()
    const = rng == 0
    assert (err[const] == 0).all()  # all-equal groups are exact
    ceil_step = torch.ceil(rng / F.W4_MAX).clamp(1, F.MAX_GROUP_STEP)
    # the chosen step is at least as good as ceil(range/15), whose error is <= step/2 per weight
    assert ((err ** 2).sum(-1) <= g * (ceil_step / 2) ** 2 + 1e-9).all()
    # level 1 rounds W to the channel's int8 grid (never clipped: s1 = max|W| / 119)
    s1 = cs.double()[:, None]
    assert (w8.abs() <= F.W8_PROTECT).all()
    assert ((w - w8.double() * s1).abs() <= 0.5 * s1 * (1 + 1e-4)).all()  # s1 rounded to fp32
    # and the dequantized weights are level 1 plus the level-2 error, in exact integers
    w_hat = ref.dequantize_weight(t["qweight"], t["group_scale"], t["group_offset"], cs, torch.float64)
    assert torch.equal(w_hat, w8_hat.double() * s1)


@settings(max_examples=30)
@given(data=st.data(), wg=weights())
def test_lqq_quantize_refuses_nonfinite(data, wg):
    w, g = wg
    r, c = data.draw(st.integers(0, w.shape[0] - 1)), data.draw(st.integers(0, w.shape[1] - 1))
    w[r, c] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    with pytest.raises(ValueError, match=rf"NaN/Inf values in row\(s\) \[{r}\]"):
        ref.quantize_weight_lqq(w, g)


# --- activations --------------------------------------------------------------------------

@st.composite
def activations(draw, k_choices=(64, 128, 192, 256)):
    m, k = draw(st.integers(1, 5)), draw(st.sampled_from(k_choices))
    dtype = draw(st.sampled_from(ACT_DTYPES))
    x = float_tensor(draw, (m, k), dtype)
    bad = poison_rows(draw, x)
    return x, bad


@settings(max_examples=100)
@given(activations())
def test_quantize_act_properties(xb):
    x, bad = xb
    q, s = ref.quantize_act(x)
    xf = x.float()
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert torch.isnan(s[bad]).all() and (q[bad] == 0).all()  # poisoned rows: visible NaN scale
    good = ~bad
    if good.any():
        amax = xf[good].abs().amax(-1).double().clamp_min(1e-8)
        assert torch.equal(s[good], (amax / 127).float())  # correctly rounded
        assert (q[good].abs() <= 127).all()
        err = (xf[good].double() - q[good].double() * s[good].double()[:, None]).abs()
        assert (err <= 0.5 * s[good].double()[:, None] * (1 + 1e-5)).all()


@settings(max_examples=60)
@given(xb=activations((128, 256, 384)), seed=st.integers(0, 2**16))
def test_quantize_act_w4ax_properties(xb, seed):
    """One symmetric scale per (token, 128-channel block): max|block| / 127 (8-bit part) or
    / 7.5 (4-bit part: nibble q stands for q + 1/2), correctly rounded; a poisoned row has NaN
    in every scale of both parts and zero codes."""
    x, bad = xb
    m, k = x.shape
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(k, generator=g).to(torch.int32)
    b8 = int(torch.randint(0, k // F.ACT_BLOCK + 1, (1,), generator=g))  # 8-bit blocks
    x8, s8, x4, s4 = ref.quantize_act_w4ax(x, perm, b8 * F.ACT_BLOCK)
    assert s8.shape == (m, b8) and s4.shape == (m, k // F.ACT_BLOCK - b8)
    nib = F.unpack_int4(x4).double()
    q = torch.cat([x8.double(), nib + 0.5], 1)  # the levels, in units of each block's scale
    s = torch.cat([s8, s4], 1)
    nb = k // F.ACT_BLOCK
    qmax = torch.tensor([F.A8_MAX] * b8 + [F.A4_TOP] * (nb - b8), dtype=torch.float64)
    assert torch.isnan(s[bad]).all() and (x8[bad] == 0).all() and (nib[bad] == 0).all()
    good = ~bad
    if good.any():
        xp = x.float()[good][:, perm.long()].double()
        eps = float(torch.tensor(1e-8, dtype=torch.float32))  # the clamp is applied in fp32
        amax = xp.view(xp.shape[0], -1, F.ACT_BLOCK).abs().amax(-1).clamp_min(eps)
        assert torch.equal(s[good], (amax / qmax).float())  # correctly rounded
        step = s[good].double().repeat_interleave(F.ACT_BLOCK, 1)
        assert (q[good].abs() <= qmax.repeat_interleave(F.ACT_BLOCK)).all()
        assert ((xp - q[good] * step).abs() <= 0.5 * step * (1 + 1e-5)).all()


@settings(max_examples=60)
@given(data=st.data(), seed=st.integers(0, 2**16), w4ax=st.booleans())
def test_linear_op_nonfinite_rows_become_nan(data, seed, w4ax):
    """The CPU linear path (the registered torch op, impl 'reference'): a poisoned row's
    output is NaN in every column; every other row equals its output without the poisoned
    rows in the batch (bit for bit)."""
    x, bad = data.draw(activations((128, 256) if w4ax else (64, 128, 192, 256)))
    x = x.to(torch.float16 if x.dtype == torch.float32 else x.dtype)
    bad = bad | ~torch.isfinite(x).all(-1)  # fp16 may overflow a huge finite value to inf
    m, k = x.shape
    g = torch.Generator().manual_seed(seed)
    n = 32
    t = ref.quantize_weight_lqq(torch.randn(n, k, generator=g), 64)
    args = (t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    perm = torch.randperm(k, generator=g).to(torch.int32)
    k8 = 128 * int(torch.randint(0, k // 128 + 1, (1,), generator=g))

    def run(v):
        if w4ax:
            return torch.ops.mixprec.w4ax_linear(v, *args, perm, k8, None, None, "none", "reference")
        return torch.ops.mixprec.w4a8_linear(v, *args, None, None, "reference")

    y = run(x)
    assert y.shape == (m, n) and y.dtype == x.dtype
    assert torch.isnan(y[bad]).all()
    if (~bad).any():
        alone = run(x[~bad])
        assert torch.equal(y[~bad].view(torch.int16), alone.view(torch.int16))


# --- KV cache ---------------------------------------------------------------------------

@st.composite
def kv_rows(draw):
    t, h = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([64, 128]))
    x = float_tensor(draw, (t, h, d), draw(st.sampled_from((torch.float16, torch.bfloat16))))
    return x, poison_rows(draw, x)


@settings(max_examples=100)
@given(xb=kv_rows(), scheme=st.sampled_from(["kv4", "kv8"]))
def test_quantize_kv_properties(xb, scheme):
    x, bad = xb
    codes, scale, zero = ref.quantize_kv(x, scheme)
    assert torch.isnan(scale[bad]).all() and (codes[bad] == 0).all()
    if scheme == "kv4":
        assert torch.isnan(zero[bad]).all()
    good = ~bad
    if not good.any():
        return
    xf = x.float()[good].double()
    back = ref.dequantize_kv(codes[good], scale[good], None if zero is None else zero[good], scheme)
    s = scale[good].double()[..., None]
    if scheme == "kv8":
        tol = 0.5 * s * (1 + 1e-5)
    else:  # fp16 scale and zero are rounded before the codes are computed
        mn = xf.amin(-1, keepdim=True)
        tol = 0.5 * s + 15 * s * 2.0 ** -10 + (mn - zero[good].double()[..., None]).abs()
        tol = tol + 1e-6 * xf.abs().amax(-1, keepdim=True)
    fin = torch.isfinite(s)  # a bf16 row beyond fp16 range overflows the fp16 kv4 scale
    assert ((back.double() - xf).abs() <= tol)[fin.expand_as(xf)].all()
