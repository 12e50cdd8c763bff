"""Smoothing and SmoothAttention folds leave the float model unchanged (tiny Llama/Qwen2, GQA)."""
import pytest
import torch

from vllm_mixprec.quantize import calibration as C
from vllm_mixprec.quantize import lqq
from vllm_mixprec.quantize import smoothing as S
from vllm_mixprec.quantize.smooth_attention import (expand_kv_to_q, fold_smooth_attention,
                                                    smooth_attention_scales)
from vllm_mixprec.quantize.testing import VOCAB, tiny_model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_folds_are_float_invariant(arch):
    model = tiny_model(arch).double()
    cfg = model.config
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)
    g = torch.Generator().manual_seed(1)
    hd, hq, hkv = C.head_dim(cfg), cfg.num_attention_heads, cfg.num_key_value_heads
    rnd = lambda n: torch.exp(torch.randn(n, generator=g, dtype=torch.float64))  # noqa: E731
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        lam = smooth_attention_scales(rnd(hkv * hd), hd)
        fold_smooth_attention(attn.q_proj, attn.k_proj, lam, hq, hkv)
        S.fold_into_norm(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], rnd(cfg.hidden_size),
                         storage_dtype=torch.float64)
        s_kv = rnd(hkv * hd)
        S.fold_into_rows(attn.v_proj, [attn.o_proj], s_kv, S.Gqa(hq, hkv).expand(s_kv))
        S.fold_into_norm(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], rnd(cfg.hidden_size),
                         storage_dtype=torch.float64)
        s_i = rnd(cfg.intermediate_size)
        S.fold_into_rows(mlp.up_proj, [mlp.down_proj], s_i, s_i)
    after = logits(model, ids)
    assert torch.allclose(after, before, rtol=1e-9, atol=1e-9)


def test_smooth_attention_respects_rope_pairs_and_flattens_k():
    hd = 8
    k_absmax = torch.tensor([1, 2, 30, 4, 5, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3], dtype=torch.float64)
    lam = smooth_attention_scales(k_absmax, hd, alpha=0.5)
    for h in range(2):
        for i in range(hd // 2):
            a, b = h * hd + i, h * hd + i + hd // 2
            assert lam[a] == lam[b] == max(k_absmax[a], k_absmax[b]) ** 0.5
    assert (k_absmax / lam).max() < k_absmax.max()


def test_fold_into_norm_is_exact_after_bf16_storage():
    norm = torch.nn.RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    lin = torch.nn.Linear(16, 4, bias=False)
    x = torch.randn(5, 16)
    want = lin(norm(x)).double()
    s = torch.rand(16, dtype=torch.float64) * 3 + 0.2
    S.fold_into_norm(norm, [lin], s)  # rounds the norm to bf16, compensates in W
    assert torch.equal(norm.weight.data, norm.weight.data.bfloat16().float())
    assert torch.allclose(lin(norm(x)).double(), want, rtol=1e-5, atol=1e-6)


def test_smooth_scales_formula():
    a = torch.tensor([1.0, 10.0, 0.5, 4.0], dtype=torch.float64)
    w = torch.tensor([0.2, 0.1, 0.4, 1.0], dtype=torch.float64)
    for alpha in (0.0, 0.3, 0.5, 1.0):
        s = S.smooth_scales(a, w, alpha)
        raw = a**alpha / w ** (1 - alpha)
        want = raw / torch.exp(torch.log(raw).mean())
        assert torch.allclose(s, want, rtol=1e-12)


def test_gqa_reduce_and_expand_follow_hf_repeat_kv():
    gqa = S.Gqa(num_heads=6, num_kv_heads=2)
    v = torch.arange(12.0)  # 2 kv heads x D=6
    e = gqa.expand(v)
    assert e.shape == (36,)
    # query head h reads kv head h // 3
    for h in range(6):
        assert torch.equal(e[h * 6:(h + 1) * 6], v[(h // 3) * 6:(h // 3 + 1) * 6])
    assert torch.equal(gqa.reduce(e), v)
    assert torch.equal(expand_kv_to_q(v, 6, 2), e)


def test_search_alpha_picks_the_grid_minimum_and_helps_outliers():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    x[:, :4] *= 40  # outlier channels: per-token int8 suffers
    w = torch.randn(64, 128, generator=g) * 0.05
    fake = lambda xx, ww: lqq.fake_w4a8(xx, ww, 64)  # noqa: E731
    alpha, s, errs = S.search_alpha(x, [w], x.abs().amax(0), fake)
    assert errs[alpha] == min(errs.values())
    assert alpha is not None and errs[alpha] < 0.7 * errs[None]
    # brute force of the same objective at the chosen alpha
    sf = s.float()
    brute = float(((fake(x / sf, w * sf) - x @ w.T) ** 2).sum())
    assert brute == pytest.approx(errs[alpha], rel=1e-6)


def test_k_centering_touches_only_slow_rope_channels_and_keeps_the_model():
    from vllm_mixprec.quantize.smooth_attention import center_k_bias, rope_frequencies

    model = tiny_model("qwen2", rope_theta=1e6).double()
    cfg = model.config
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    hd = C.head_dim(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # Qwen2-like: a huge constant K offset in slow channels
            layer.self_attn.k_proj.bias[hd // 2 - 1::hd // 2] = 300.0
    before = logits(model, ids)
    slow = rope_frequencies(hd, 1e6) * 512 <= 0.1
    assert slow.any() and not slow.all()
    for layer in model.model.layers:
        k = layer.self_attn.k_proj
        mean = k.bias.detach().clone() + 1.0
        c = center_k_bias(k, mean, hd, 1e6, max_positions=512)
        mask = torch.cat([slow, slow]).repeat(cfg.num_key_value_heads)
        assert torch.equal(c != 0, mask)
    after = logits(model, ids)
    # not exact (RoPE still turns slow channels a little), but far below the offset's scale
    assert (after - before).abs().max() < 1e-2
    # the same offset moved into a fast channel is not removable this way: it changes the model
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.bias[0] += 300.0
    assert (logits(model, ids) - before).abs().max() > 10 * (after - before).abs().max()
