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
    top = torch.tensor([127.0, 7.5, 7.5, 7.5], dtype=torch.float64)[:, None]
    s = (xb.abs().amax(-1, keepdim=True).float().double() / top).float().double()
    q8 = torch.round(xb[:, :1] / s[:, :1]).clamp(-127, 127)
    q4 = torch.floor(xb[:, 1:] / s[:, 1:]).clamp(-8, 7) + 0.5  # formats.A4_TOP's half-integers
    want = (torch.cat([q8, q4], 1) * s).view(9, k) @ wq.T
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
    xb = ref.rotate_a4_blocks(x[:, perm.long()], k8, rot)  # float64 (w4ax_act_input: float32, fast)
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


@pytest.mark.parametrize("rot", ["none", "hadamard", "hadamard64"])
def test_block_gains_match_the_per_block_errors_written_out(rot):
    """block_gains (Gram matrices) against each block's output error computed with explicit
    matmuls: 4-bit (rotated, mapped back) minus 8-bit, over |x W^T|^2."""
    g = torch.Generator().manual_seed(4)
    n, k = 24, 512
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    x = torch.randn(48, k, generator=g)
    x[:, [7, 260]] *= 30
    perm = fmpq.outlier_permutation(x.abs().amax(0))
    r = F.act_rotation_matrix(rot)
    got = fmpq.block_gains(x, w, perm, rot)
    p = perm.long()
    xp, wp = x.double()[:, p], w[:, p]
    y2 = float((x.double() @ w.T).pow(2).sum())
    for b in range(k // 128):
        cols = slice(128 * b, 128 * (b + 1))
        xb = xp[:, cols]
        s8 = xb.abs().amax(1, keepdim=True).float().double() / 127
        d8 = torch.round(xb / s8).clamp(-127, 127) * s8 - xb
        xr = xb if r is None else xb @ r.double()
        s4 = xr.abs().amax(1, keepdim=True).float().double() / 7.5  # the half-integer grid
        q4 = (torch.floor(xr / s4).clamp(-8, 7) + 0.5) * s4
        d4 = (q4 if r is None else q4 @ r.double().T) - xb
        want = ((d4 @ wp[:, cols].T).pow(2).sum() - (d8 @ wp[:, cols].T).pow(2).sum()) / y2
        assert float(got[b]) == pytest.approx(float(want), rel=2e-3, abs=1e-9), b
    assert float(got[0]) > float(got[-1])  # the outlier block gains most from 8 bits


def test_allocate_a8_blocks_is_greedy_over_prefixes_by_gain_per_cost():
    gains = {"a": torch.tensor([5.0, 1.0, 0.5]), "b": torch.tensor([4.0, 3.0, 2.0, 0.1])}
    one = {"a": 1.0, "b": 1.0}
    assert fmpq.allocate_a8_blocks(gains, one, 0) == {"a": 0, "b": 0}
    assert fmpq.allocate_a8_blocks(gains, one, 3) == {"a": 1, "b": 2}
    assert fmpq.allocate_a8_blocks(gains, one, 5) == {"a": 2, "b": 3}
    assert fmpq.allocate_a8_blocks(gains, one, 99) == {"a": 3, "b": 4}  # capped at every block
    # "a" blocks cost 4: b's gain per cost wins until a's 5/4 beats b's third block (2/1 does not)
    wide = {"a": 4.0, "b": 1.0}
    assert fmpq.allocate_a8_blocks(gains, wide, 3) == {"a": 0, "b": 3}
    assert fmpq.allocate_a8_blocks(gains, wide, 7) == {"a": 1, "b": 3}
    assert fmpq.allocate_a8_blocks(gains, wide, 6.5) == {"a": 0, "b": 4}  # a does not fit after b's 3


@pytest.mark.parametrize("allocation", ["layer", "layer-blocks"])
def test_layer_allocation_keeps_each_layers_total(tmp_path, allocation):
    """--a8-allocation layer (layer-blocks): per decoder layer the 8-bit MACs (blocks) stay within
    the uniform ones, the count is shared by the linears of an input group, recorded, and the
    checkpoint evaluates."""
    from vllm_mixprec.eval.perplexity import evaluate
    from vllm_mixprec.quantize.pipeline import QuantOptions, quantize_model
    from vllm_mixprec.quantize.testing import calib_text_file, save_tiny
    from safetensors.torch import load_file
    import json

    src = save_tiny(tmp_path / "src", "qwen2", hidden_size=256, intermediate_size=512,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    text = calib_text_file(tmp_path / "calib.txt")
    opts = QuantOptions(weight_scheme="w4ax", a8_fraction=0.5, a8_allocation=allocation, act_rotation="hadamard",
                        calib_text=str(text), calib_samples=4, calib_seqlen=64, progress=False)
    summary = quantize_model(src, tmp_path / "out", opts)
    t = load_file(str(tmp_path / "out" / "model.safetensors"))
    for info in summary["layers"]:
        i, blocks = info["layer"], info["a8_blocks"]
        n_out = {"qkv": 256 + 2 * 128, "o": 256, "gate_up": 2 * 512, "down": 256}
        uniform = {"qkv": 1, "o": 1, "gate_up": 1, "down": 2}  # round(0.5 * K/128): of 2, 2, 2, 4
        cost = n_out if allocation == "layer" else dict.fromkeys(n_out, 1)
        assert sum(blocks[g] * cost[g] for g in n_out) <= sum(uniform[g] * cost[g] for g in n_out)
        for name, want in (("self_attn.q_proj", "qkv"), ("self_attn.v_proj", "qkv"), ("mlp.up_proj", "gate_up"),
                           ("mlp.down_proj", "down")):
            assert int(t[f"model.layers.{i}.{name}.a8_blocks"][0]) == blocks[want]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["a8_fraction"] == 0.5 and cfg["calibration"]["a8_allocation"] == allocation
    ppl = next(iter(evaluate(tmp_path / "out", [str(text)], n_tokens=128, window=64).values()))["ppl"]
    assert ppl == ppl and ppl < 1e4
    with pytest.raises(ValueError, match="a8 allocation 'global' is not one of"):
        QuantOptions(weight_scheme="w4ax", a8_allocation="global").validate()


def test_block_selection_moves_whole_blocks():
    """--a8-select blocks: the original 128-channel blocks by decreasing max |x|, each block's
    channels in place, so the first a8 blocks are the blocks holding the largest values and every
    64- or 128-channel weight group keeps its columns."""
    g = torch.Generator().manual_seed(3)
    k = 512
    absmax = torch.rand(k, generator=g, dtype=torch.float64)
    absmax[300], absmax[5], absmax[400] = 80.0, 40.0, 20.0  # blocks 2, 0, 3; block 1 has none
    perm = fmpq.block_outlier_permutation(absmax)
    assert perm.dtype == torch.int32 and torch.equal(perm.sort().values, torch.arange(k, dtype=torch.int32))
    rows = perm.long().reshape(-1, F.ACT_BLOCK)
    assert torch.equal(rows - rows[:, :1], torch.arange(F.ACT_BLOCK).expand_as(rows))  # whole blocks, in order
    assert rows[:, 0].tolist() == [256, 0, 384, 128]
    for gs in (64, 128):  # every weight group of the permuted K is one original group
        starts = perm.long().reshape(-1, gs)[:, 0]
        assert bool((starts % gs == 0).all())
    assert torch.equal(fmpq.act_permutation(absmax, "blocks"), perm)
    assert torch.equal(fmpq.act_permutation(absmax, "channels"), fmpq.outlier_permutation(absmax))
    with pytest.raises(ValueError, match="a8 selection 'rows' is not one of"):
        fmpq.act_permutation(absmax, "rows")
    with pytest.raises(ValueError, match="needs K a multiple of 128"):
        fmpq.block_outlier_permutation(absmax[:320])


def test_block_selection_through_the_quantizer(tmp_path):
    """quantize with a8_select="blocks": every linear's act_perm is a block permutation with its
    8-bit blocks first by max |x|, the choice is recorded, the checkpoint evaluates; the option is
    refused outside w4ax and when unknown."""
    from vllm_mixprec.eval.perplexity import evaluate
    from vllm_mixprec.quantize.pipeline import QuantOptions, quantize_model
    from vllm_mixprec.quantize.testing import calib_text_file, save_tiny
    from safetensors.torch import load_file
    import json

    src = save_tiny(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    text = calib_text_file(tmp_path / "calib.txt")
    opts = QuantOptions(weight_scheme="w4ax", a8_fraction=0.5, a8_select="blocks", act_rotation="hadamard",
                        calib_text=str(text), calib_samples=4, calib_seqlen=64, progress=False)
    quantize_model(src, tmp_path / "out", opts)
    t = load_file(str(tmp_path / "out" / "model.safetensors"))
    perms = {n: p for n, p in t.items() if n.endswith(".act_perm")}
    assert len(perms) == 7 * 2  # 7 linears in each of the tiny model's 2 layers
    for name, p in perms.items():
        rows = p.long().reshape(-1, F.ACT_BLOCK)
        assert torch.equal(rows - rows[:, :1], torch.arange(F.ACT_BLOCK).expand_as(rows)), name
        assert bool((rows[:, 0] % F.ACT_BLOCK == 0).all()), name
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert cfg["calibration"]["a8_select"] == "blocks"
    ppl = next(iter(evaluate(tmp_path / "out", [str(text)], n_tokens=128, window=64).values()))["ppl"]
    assert ppl == ppl and ppl < 1e4
    assert QuantOptions().a8_select == "blocks"  # the default; other schemes ignore it
    QuantOptions(weight_scheme="w4a8").validate()
    with pytest.raises(ValueError, match="--a8-select channels applies to the w4ax scheme only"):
        QuantOptions(weight_scheme="w4a8", a8_select="channels").validate()
    with pytest.raises(ValueError, match="a8 selection 'rows' is not one of"):
        QuantOptions(weight_scheme="w4ax", a8_select="rows").validate()
