"""CPU perplexity path: KV fake quantization, checkpoint loading, the windowed metric."""
import math

import pytest
import torch

from vllm_mixprec import reference as ref
from vllm_mixprec.eval import perplexity as P
from vllm_mixprec.quantize.modules import MixPrecLinear
from vllm_mixprec.quantize.pipeline import QuantOptions, quantize_model
from vllm_mixprec.quantize.testing import VOCAB, calib_text_file, save_tiny


@pytest.mark.parametrize("scheme", ["kv4", "kv8"])
def test_fake_quant_kv_is_per_token_head(scheme):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 32, generator=g)  # [B, H, T, D]
    got = P.fake_quant_kv(x, scheme)
    for b in range(2):
        for t in range(5):
            codes, scale, zero = ref.quantize_kv(x[b, :, t][None], scheme)
            assert torch.equal(got[b, :, t], ref.dequantize_kv(codes, scale, zero, scheme)[0])
    err = (got - x).abs().max()
    assert err < (0.1 if scheme == "kv4" else 0.01) * x.abs().max()


@pytest.mark.parametrize("scheme", ["kv4", "kv8"])
def test_kv_attention_matches_reference_attention(scheme):
    from transformers import AttentionInterface

    name = P.register_kv_attention(scheme)
    fn = AttentionInterface._global_mapping[name]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 16, generator=g)
    k = torch.randn(1, 2, 6, 16, generator=g)
    v = torch.randn(1, 2, 6, 16, generator=g)

    class Mod(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    out, _ = fn(Mod(), q, k, v, None, scaling=0.25, dropout=0.0)
    kd, vd = P.fake_quant_kv(k, scheme), P.fake_quant_kv(v, scheme)
    want = ref.attention(q[0].transpose(0, 1), kd[0].transpose(0, 1), vd[0].transpose(0, 1), 0.25)
    assert torch.allclose(out[0].double(), want, atol=1e-5)


@pytest.mark.parametrize("config, want", [({"torch_dtype": "bfloat16"}, torch.bfloat16),
                                          ({"dtype": "float16"}, torch.float16),
                                          ({"torch_dtype": "float32"}, torch.bfloat16), ({}, torch.bfloat16)])
def test_served_dtype_is_vllm_auto(config, want):
    assert P.served_dtype(config) == want


def test_kv_attention_quantizes_kv_rounded_to_the_served_dtype():
    """The cache receives the served model's 16-bit K/V: the CPU path rounds them first, so
    its codes are those of the bf16 values (and differ from quantizing float32 K/V)."""
    from transformers import AttentionInterface

    fn = AttentionInterface._global_mapping[P.register_kv_attention("kv8", kv_dtype=torch.bfloat16)]
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, h, 9, 16, generator=g) * 3 for h in (4, 2, 2))

    class Mod(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2

    out, _ = fn(Mod(), q, k, v, None, scaling=0.25, dropout=0.0)
    kb, vb = k.bfloat16().float(), v.bfloat16().float()
    kd, vd = P.fake_quant_kv(kb, "kv8"), P.fake_quant_kv(vb, "kv8")
    tr = lambda t: t[0].transpose(0, 1)  # noqa: E731
    assert torch.allclose(out[0].double(), ref.attention(tr(q), tr(kd), tr(vd), 0.25), atol=1e-5)
    assert not torch.equal(kd, P.fake_quant_kv(k, "kv8"))


def test_windows():
    ids = torch.arange(10)
    w = P.windows(ids, 9, 4)
    assert [x.tolist() for x in w] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a 1-token tail predicts nothing


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("ppl")
    src = save_tiny(d / "src", "llama")
    text = calib_text_file(d / "calib.txt")
    out = {"src": src, "text": text}
    for name, kw in {"w4a8": dict(weight_scheme="w4a8", smooth=True),
                     "gptq": dict(weight_scheme="gptq-w4a16", group_size=64)}.items():
        opts = QuantOptions(calib_text=str(text), calib_samples=4, calib_seqlen=64, progress=False, **kw)
        out[name] = quantize_model(src, d / name, opts)["output"]
    return out


def test_bf16_folder_ppl_equals_hf_loss(folders):
    from transformers import AutoModelForCausalLM
    model, kind = P.load_model_cpu(folders["src"])
    assert kind == "bf16"
    ids = torch.randint(0, VOCAB, (130,), generator=torch.Generator().manual_seed(2))
    r = P.perplexity_cpu(model, ids, n_tokens=128, window=64)
    hf = AutoModelForCausalLM.from_pretrained(folders["src"], dtype=torch.float32)
    with torch.no_grad():
        losses = [float(hf(w[None], labels=w[None]).loss) for w in P.windows(ids, 128, 64)]
    assert r["tokens"] == 126
    assert r["ppl"] == pytest.approx(math.exp(sum(losses) / 2), rel=1e-4)


def test_mixprec_checkpoint_loads_as_reference_modules(folders):
    model, kind = P.load_model_cpu(folders["w4a8"])
    assert kind == "mixprec"
    lin = [m for m in model.modules() if isinstance(m, MixPrecLinear)]
    assert len(lin) == 2 * 7
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    ids = torch.randint(0, VOCAB, (129,), generator=torch.Generator().manual_seed(3))
    base, _ = P.load_model_cpu(folders["src"])
    r_q = P.perplexity_cpu(model, ids, 128, 64)["ppl"]
    r_f = P.perplexity_cpu(base, ids, 128, 64)["ppl"]
    assert abs(r_q / r_f - 1) < 0.1


def test_gptq_checkpoint_and_kv_override(folders):
    model, kind = P.load_model_cpu(folders["gptq"])
    assert kind == "gptq"
    res = P.evaluate(folders["gptq"], [str(folders["text"])], n_tokens=256, window=64)
    res8 = P.evaluate(folders["gptq"], [str(folders["text"])], n_tokens=256, window=64, kv_scheme="kv8")
    res4 = P.evaluate(folders["gptq"], [str(folders["text"])], n_tokens=256, window=64, kv_scheme="kv4")
    (p,), (p8,), (p4,) = (tuple(r.values()) for r in (res, res8, res4))
    assert p8["ppl"] != p["ppl"]
    assert abs(p8["ppl"] / p["ppl"] - 1) <= abs(p4["ppl"] / p["ppl"] - 1) + 1e-6


def test_residual_attention_limits():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 12, 16, generator=g)
    k = torch.randn(1, 2, 12, 16, generator=g)
    v = torch.randn(1, 2, 12, 16, generator=g)
    kq, vq = P.fake_quant_kv(k, "kv4"), P.fake_quant_kv(v, "kv4")
    tr = lambda t: t[0].transpose(0, 1)  # noqa: E731  [B,H,T,D] -> [T,H,D]
    # R = 0: everything quantized; R >= T: nothing quantized
    for r, kk, vv in ((0, kq, vq), (12, k, v)):
        got = P.residual_attention(q, k, v, kq, vq, 0.25, r)[0]
        assert torch.allclose(got.double(), ref.attention(tr(q), tr(kk), tr(vv), 0.25), atol=1e-5)
    # R = 3: query t sees keys t-2..t exact; check one query against a hand-built key set
    got = P.residual_attention(q, k, v, kq, vq, 0.25, 3)[0]
    t = 7
    kk = torch.cat([kq[:, :, :t - 2], k[:, :, t - 2:t + 1]], dim=2)
    vv = torch.cat([vq[:, :, :t - 2], v[:, :, t - 2:t + 1]], dim=2)
    want = ref.attention(tr(q)[t:t + 1], tr(kk), tr(vv), 0.25)
    assert torch.allclose(got[t].double(), want[0], atol=1e-5)


def test_chunk_attention_limits():
    """chunk >= T: a one-chunk prefill, nothing quantized; chunk 4: query t reads its own
    chunk exactly and older keys quantized (and the residual window adds to that)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 12, 16, generator=g)
    k = torch.randn(1, 2, 12, 16, generator=g)
    v = torch.randn(1, 2, 12, 16, generator=g)
    kq, vq = P.fake_quant_kv(k, "kv4"), P.fake_quant_kv(v, "kv4")
    tr = lambda t: t[0].transpose(0, 1)  # noqa: E731
    got = P.residual_attention(q, k, v, kq, vq, 0.25, 0, chunk=12)[0]
    assert torch.allclose(got.double(), ref.attention(tr(q), tr(k), tr(v), 0.25), atol=1e-5)
    for r, exact_from in ((0, 8), (3, 7)):  # query 9: chunk [8, 12), window of 3 from 7
        got = P.residual_attention(q, k, v, kq, vq, 0.25, r, chunk=4)[0]
        t = 9
        kk = torch.cat([kq[:, :, :exact_from], k[:, :, exact_from:t + 1]], dim=2)
        vv = torch.cat([vq[:, :, :exact_from], v[:, :, exact_from:t + 1]], dim=2)
        want = ref.attention(tr(q)[t:t + 1], tr(kk), tr(vv), 0.25)
        assert torch.allclose(got[t].double(), want[0], atol=1e-5), r


def test_kv_chunk_of_a_whole_window_is_16_bit(folders):
    text = [str(folders["text"])]
    run = lambda **kw: next(iter(P.evaluate(folders["src"], text, n_tokens=256, window=64, **kw).values()))["ppl"]  # noqa: E731
    full, kv4, chunked = run(), run(kv_scheme="kv4"), run(kv_scheme="kv4", kv_chunk=16)
    assert run(kv_scheme="kv4", kv_chunk=64) == pytest.approx(full, rel=1e-5)
    assert abs(chunked / full - 1) < abs(kv4 / full - 1)
    with pytest.raises(ValueError, match="kv_chunk=-1"):
        run(kv_scheme="kv4", kv_chunk=-1)


def test_kv_dtype_option(folders):
    """served (the default) and float32 inputs give different KV8 perplexities of the same
    model; the option is CPU-only and validated."""
    text = [str(folders["text"])]
    run = lambda **kw: next(iter(P.evaluate(folders["src"], text, n_tokens=256, window=64, **kw).values()))["ppl"]  # noqa: E731
    served, f32 = run(kv_scheme="kv8"), run(kv_scheme="kv8", kv_dtype="float32")
    assert served != f32 and served == pytest.approx(f32, rel=0.05)
    with pytest.raises(ValueError, match="kv_dtype 'float16' is not one of"):
        run(kv_scheme="kv8", kv_dtype="float16")
    with pytest.raises(ValueError, match="CPU-path options"):
        P.evaluate(folders["src"], text, n_tokens=256, window=64, kv_scheme="kv8", backend="vllm",
                   kv_dtype="float32")


def test_kv_skip_layers(folders):
    """Skipping every layer is the 16-bit result; skipping some lies strictly between."""
    text = [str(folders["text"])]
    run = lambda **kw: next(iter(P.evaluate(folders["src"], text, n_tokens=256, window=64, **kw).values()))["ppl"]  # noqa: E731
    full, kv4 = run(), run(kv_scheme="kv4")
    assert run(kv_scheme="kv4", kv_skip_layers=(0, 1)) == pytest.approx(full, rel=1e-6)
    part = run(kv_scheme="kv4", kv_skip_layers=(1,))
    assert part not in (pytest.approx(full, rel=1e-6), pytest.approx(kv4, rel=1e-6))
    with pytest.raises(ValueError, match=r"kv skip layers \[2\] are not layers of this model \(0..1\)"):
        run(kv_scheme="kv4", kv_skip_layers=(2,))
    with pytest.raises(ValueError, match="CPU-path options"):
        P.evaluate(folders["src"], text, n_tokens=256, window=64, kv_scheme="kv4", backend="vllm",
                   kv_skip_layers=(0,))


def test_rotated_k_bias_is_hf_rope_of_the_bias():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    from vllm_mixprec.quantize.testing import tiny_model
    model = tiny_model("qwen2")
    rot = model.model.rotary_emb
    bias = torch.randn(2 * 32, generator=torch.Generator().manual_seed(5))
    b = bias.view(1, 2, 1, 32).expand(1, 2, 7, 32)
    cos, sin = rot(b, torch.arange(7)[None])
    _, want = apply_rotary_pos_emb(b, b, cos, sin)
    got = P.rotated_k_bias(bias, 32, cos[0], sin[0])
    assert torch.allclose(got, want.float(), atol=1e-6)


def test_kv_bias_aware_rescues_large_k_biases(tmp_path):
    """k_proj biases 100x the signal break per-(token, head) KV4; quantizing K - RoPE_p(b)
    and adding it back (what --kv-bias-aware models) brings the ppl back near 16 bits."""
    from vllm_mixprec.quantize.testing import calib_text_file, char_tokenizer, tiny_model
    model = tiny_model("qwen2")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0, 30.0)
    src = tmp_path / "q"
    model.to(torch.bfloat16).save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    text = [str(calib_text_file(tmp_path / "t.txt"))]
    run = lambda **kw: next(iter(P.evaluate(src, text, n_tokens=256, window=128, **kw).values()))["ppl"]  # noqa: E731
    full, kv4, aware = run(), run(kv_scheme="kv4"), run(kv_scheme="kv4", kv_bias_aware=True)
    assert abs(aware / full - 1) < 0.25 * abs(kv4 / full - 1), (full, kv4, aware)


def test_served_k_bias_mirrors_the_backend_defaults(monkeypatch):
    """The eval quantizes around exactly the bias the backend would: nothing below
    MIXPREC_KV_BIAS_MIN, and only the MIXPREC_KV_BIAS_PAIRS largest rotary pairs."""
    from vllm_mixprec.eval.perplexity import served_k_bias

    d, half = 128, 64
    b = torch.full((2, d), 0.5)
    assert served_k_bias(b.reshape(-1), d) is None  # largest pair norm 0.7 < 16
    b[0, 3], b[1, half + 9] = 300.0, -40.0
    kept = served_k_bias(b.reshape(-1), d).reshape(2, d)
    norm = kept[:, :half].square() + kept[:, half:].square()
    assert ((norm > 0).sum(1) == 16).all()
    assert kept[0, 3] == 300.0 and kept[1, half + 9] == -40.0
    monkeypatch.setenv("MIXPREC_KV_BIAS_PAIRS", "all")
    monkeypatch.setenv("MIXPREC_KV_BIAS_MIN", "0")
    assert torch.equal(served_k_bias(b.reshape(-1), d).reshape(2, d), b)
