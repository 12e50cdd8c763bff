"""FMPQ (W4Ax): outlier channels land in the 8-bit blocks, the permuted layer is the same GEMM."""
import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.quantize import fmpq, lqq
from vllm_mixprec.quantize.modules import MixPrecLinear


def test_num_a8_blocks():
    assert fmpq.num_a8_blocks(1536, 0.25) == 3
    assert fmpq.num_a8_blocks(1536, 0.0) == 0 and fmpq.num_a8_blocks(1536, 1.0) == 12
    with pytest.raises(ValueError):
        fmpq.num_a8_blocks(576, 0.25)  # 576 is not a multiple of 128


def test_outliers_go_to_the_8bit_blocks():
    g = torch.Generator().manual_seed(0)
    k = 512
    absmax = torch.rand(k, generator=g, dtype=torch.float64)
    outliers = torch.randperm(k, generator=g)[:20]
    absmax[outliers] = 50 + torch.rand(20, generator=g, dtype=torch.float64)
    perm = fmpq.outlier_permutation(absmax)
    assert perm.dtype == torch.int32 and torch.equal(perm.sort().values, torch.arange(k, dtype=torch.int32))
    k8 = fmpq.num_a8_blocks(k, 0.25) * F.ACT_BLOCK
    assert set(outliers.tolist()) <= set(perm[:k8].tolist())
    assert bool((absmax[perm.long()].diff() <= 0).all())


def test_permuted_layer_is_the_same_gemm_and_matches_float64():
    g = torch.Generator().manual_seed(1)
    n, k, gs = 32, 512, 64
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
    x = torch.randn(9, k, generator=g)
    x[:, [3, 77, 200]] *= 60
    x[:, 300:] *= 0.1  # 4-bit blocks of different magnitudes after the permutation
    perm = fmpq.outlier_permutation(x.abs().amax(0))
    wp = fmpq.permute_weight(w, perm)
    assert torch.allclose(x.double()[:, perm.long()] @ wp.T, x.double() @ w.T)
    t = ref.quantize_weight_lqq(wp, gs)
    t.update(act_perm=perm, a8_blocks=torch.tensor([1], dtype=torch.int32))
    mod = MixPrecLinear(t, None, "w4ax")
    y = mod(x).double()
    # float64 oracle written out: dequantized weights times fake-quantized activations, one
    # scale per (token, 128-channel block): the first block 8-bit, the other three 4-bit
    wq = lqq.dequantize(t)
    xb = x.double()[:, perm.long()].view(9, k // 128, 128)
    qmax = torch.tensor([127.0, 7.0, 7.0, 7.0], dtype=torch.float64)[:, None]
    s = (xb.abs().amax(-1, keepdim=True).float().double() / qmax).float().double()
    want = (torch.round(xb / s).clamp(-qmax, qmax) * s).view(9, k) @ wq.T
    assert torch.allclose(y, want, rtol=1e-4, atol=1e-4)
    # the outliers in 8 bits beat all-4-bit activations by a wide margin
    all4 = MixPrecLinear({**t, "a8_blocks": torch.tensor([0], dtype=torch.int32)}, None, "w4ax")(x).double()
    exact = x.double() @ w.T
    assert ((y - exact) ** 2).sum() < 0.5 * ((all4 - exact) ** 2).sum()
    # fake_w4ax (the alpha search's simulation) agrees with the module
    assert torch.allclose(fmpq.fake_w4ax(x, w, gs, perm, 128).double(), y, rtol=1e-4, atol=1e-4)


def test_basis_changes_keep_the_product_and_the_hessian():
    """weight_basis and hessian_basis put W and E[x^T x] in the basis w4ax_act_input gives x."""
    g = torch.Generator().manual_seed(2)
    n, k, k8 = 24, 512, 128
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    x = torch.randn(40, k, generator=g, dtype=torch.float64)
    perm = torch.randperm(k, generator=g).to(torch.int32)
    rot = F.act_rotation_matrix("hadamard").double()
    xb = ref.rotate_a4_blocks(x[:, perm.long()], k8, rot)  # float64 (w4ax_act_input: float32)
    assert torch.allclose(xb @ fmpq.weight_basis(w, perm, k8, rot).T, x @ w.T, atol=1e-5)  # H from float32
    assert torch.allclose(fmpq.hessian_basis(x.T @ x, perm, k8, rot), xb.T @ xb, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("use_gptq", [False, True])
def test_quantize_linear_exports_the_rotated_basis(use_gptq):
    """pipeline.quantize_linear with act_rotation: the exported tensors, read with the same
    rotation, compute x W^T; read without it they do not (so the basis really changed)."""
    from vllm_mixprec.quantize import calibration as C
    from vllm_mixprec.quantize.pipeline import QuantOptions, quantize_linear

    g = torch.Generator().manual_seed(3)
    n, k = 64, 512
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(256, k, generator=g)
    x[:, [5, 300]] *= 40
    spikes = torch.randint(0, k, (256, 8), generator=g)  # per-token spikes the permutation can't isolate
    x.scatter_(1, spikes, 12.0)
    x64 = x.double()
    st = C.LinearStats(x64.abs().amax(0), x64.T @ x64 if use_gptq else None, 256, x)
    exact = x64 @ w.double().T
    errs = {}
    for rot in ("none", "hadamard"):
        opts = QuantOptions(weight_scheme="w4ax", a8_fraction=0.25, act_rotation=rot, gptq=use_gptq)
        t = quantize_linear(w, st, opts)
        y = MixPrecLinear(t, None, "w4ax", rot)(x).double()
        errs[rot] = float((y - exact).norm() / exact.norm())
        if rot == "hadamard":
            wrong = MixPrecLinear(t, None, "w4ax", "none")(x).double()
            assert float((wrong - exact).norm() / exact.norm()) > 0.5
    assert errs["hadamard"] < 0.7 * errs["none"], errs
