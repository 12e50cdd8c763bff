"""Bias-aware K (formats.KRopeBias): the pages hold K - RoPE_p(b) and the readers add
q . RoPE_p(b) back. Kernels vs the torch reference (CPU interpreter, small shapes; bigger
ones with `pytest -m gpu`), the reference's RoPE vs vLLM's, and the point of it all: with
Qwen2-like k biases, bias-aware KV4 is far closer to float attention than plain KV4.
"""
from __future__ import annotations

import pytest
import torch

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.kernels.triton.attention import paged_attention
from vllm_mixprec.kernels.triton.kv_cache import KVResidual, quantize_and_store

from attn_helpers import DEVICE, make_batch, make_k_bias, rope_inv_freq, tolerance


def _vllm_rope(head_dim: int, theta: float, max_pos: int):
    """vLLM's default (neox, whole-head) RotaryEmbedding with an fp32 cos/sin cache."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return RotaryEmbedding(head_dim, head_dim, max_pos, theta, True, torch.float32)


def test_rope_matches_vllm_rotary_embedding():
    """reference.apply_rope (fixed-point phases) is vLLM's default neox RotaryEmbedding."""
    d, theta, hkv = 128, 1e6, 2
    rope = _vllm_rope(d, theta, 8192)
    inv_freq = rope._compute_inv_freq(theta)
    assert torch.equal(inv_freq, rope_inv_freq(d, theta))
    kb = F.make_k_rope_bias(torch.randn(hkv, d) * 50, inv_freq)
    pos = torch.tensor([0, 1, 2, 17, 1000, 4095, 8191])
    x = kb.bias[None].expand(len(pos), hkv, d).contiguous()
    _, want = rope.forward_static(pos, x.clone(), x.clone(), d, d, rope.cos_sin_cache, True)
    got = ref.rotate_k_bias(kb, pos)
    # vLLM's fp32 angles p * inv_freq carry p * 2**-24 rad of rounding; ours are exact.
    torch.testing.assert_close(got.float(), want.view(len(pos), hkv, d), atol=0.05, rtol=1e-4)
    torch.testing.assert_close(got[0], kb.bias.double())  # position 0: no rotation


def test_rope_phase_steps_are_exact_for_long_contexts():
    inv_freq = rope_inv_freq(64, 1e6)
    steps = F.rope_phase_steps(inv_freq)
    p = 1 << 20
    exact = torch.remainder(p * inv_freq.double(), 2 * torch.pi)
    ang = ref.apply_rope(torch.tensor([[[1.0] + [0.0] * 63]]), torch.tensor([p]), steps)[0, 0]
    torch.testing.assert_close(ang[0], torch.cos(exact[0]), atol=1e-3, rtol=0)
    assert steps.dtype == torch.int64 and int(steps.max()) < 1 << 32


# --- write path ---------------------------------------------------------------------------

def _dequantized_k(cache, layout):
    planes = F.kv_planes(cache.cpu(), layout)
    zero = planes["k_zero"] if layout.scheme == "kv4" else None
    return ref.dequantize_kv(planes["k_codes"], planes["k_scale"], zero, layout.scheme), \
        planes["k_scale"].float()


@pytest.mark.parametrize("scheme", ["kv4", "kv8"])
@pytest.mark.parametrize("head_dim,smooth", [(64, False), (128, True)])
def test_store_matches_reference(scheme, head_dim, smooth):
    """Pages and residual copy hold (K - RoPE_p(b)) / k_smooth; V is untouched (bit-exact).
    K may differ from the reference by one code where cos/sin round differently."""
    h, b, nb, t, dtype = 2, 16, 6, 40, torch.bfloat16
    layout = F.KVPageLayout(scheme, head_dim, b)
    kb = make_k_bias(h, head_dim, 300.0, "cpu")
    pos = torch.randint(0, 50000, (t,))
    key = (ref.rotate_k_bias(kb, pos) + torch.randn(t, h, head_dim)).to(dtype)
    value = torch.randn(t, h, head_dim).to(dtype)
    slots = torch.randperm(nb * b)[:t]
    slots[[3, 9]] = -1
    k_smooth = torch.rand(h, head_dim) + 0.5 if smooth else None
    slot_of_block = torch.tensor([1, -1, 0, 3, -1, 2, -1], dtype=torch.int32)
    want = torch.zeros(layout.cache_shape(nb, h), dtype=layout.storage_dtype())
    pool = [torch.full((4 * b, h, head_dim), float("nan"), dtype=dtype) for _ in range(4)]
    ref.reshape_and_cache(key, value, want, slots, layout, k_smooth, kb, pos)
    ref.store_kv_residual(key, value, pool[2], pool[3], slots, slot_of_block, b, k_smooth, kb,
                          pos)
    dev = [x.to(DEVICE) for x in (key, value, slots, pos, pool[0], pool[1], slot_of_block)]
    got = torch.zeros_like(want).to(DEVICE)
    kb_dev = F.KRopeBias(*(x.to(DEVICE) for x in kb))
    quantize_and_store(dev[0], dev[1], got, dev[2], layout,
                       None if k_smooth is None else k_smooth.to(DEVICE),
                       KVResidual(dev[4], dev[5], dev[6], torch.zeros(5, b, dtype=torch.int32,
                                                                      device=DEVICE), b),
                       kb_dev, dev[3])
    pw, pg = F.kv_planes(want, layout), F.kv_planes(got.cpu(), layout)
    for name in [n for n in pw if n.startswith("v_")]:
        assert torch.equal(pw[name], pg[name]), name
    kw, sw = _dequantized_k(want, layout)
    kg, _ = _dequantized_k(got, layout)
    assert ((kw - kg).abs() <= sw[..., None] * 1.01 + 1e-6).all()
    same = (pw["k_codes"] == pg["k_codes"]).float().mean()
    assert same > 0.99, same
    # the stored K is the small residual, not the bias: scales far below max|b| / 15
    assert float(sw[pw["k_scale"] > 0].max()) < 300.0 / 15
    torch.testing.assert_close(dev[4].cpu().float(), pool[2].float(), atol=2e-2, rtol=1e-2,
                               equal_nan=True)
    assert torch.equal(dev[5].cpu().nan_to_num(7.0), pool[3].nan_to_num(7.0))


def test_store_needs_positions():
    layout = F.KVPageLayout("kv4", 64, 16)
    k = torch.randn(3, 1, 64, dtype=torch.float16, device=DEVICE)
    cache = torch.zeros(layout.cache_shape(2, 1), dtype=torch.uint8, device=DEVICE)
    sm = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="cache positions"):
        quantize_and_store(k, k, cache, sm, layout, k_bias=make_k_bias(1, 64, 10.0))
    with pytest.raises(ValueError, match=r"k_bias has bias \(2, 64\)"):
        quantize_and_store(k, k, cache, sm, layout, k_bias=make_k_bias(2, 64, 10.0),
                           positions=sm)


# --- read path ----------------------------------------------------------------------------

CASES = [
    # (scheme, dtype, head_dim, kv_heads, group, rows, residual, smooth, splits, pairs)
    ("kv4", torch.float16, 64, 2, 4, [(1, 37), (6, 21), (1, 3), (17, 17), (0, 5)], 0, False, 1,
     None),
    ("kv4", torch.bfloat16, 128, 1, 8, [(1, 70), (3, 40), (1, 16)], 16, True, 4, 16),
    ("kv4", torch.float16, 128, 2, 2, [(1, 150), (20, 29)], 0, False, 2, 32),
    ("kv8", torch.bfloat16, 64, 2, 4, [(1, 52), (5, 5), (1, 17), (2, 33)], 16, False, 2, 16),
    ("kv8", torch.float16, 128, 1, 8, [(1, 29), (12, 40)], 16, True, 1, None),
]


def _run(batch, scale, splits, exact=False):
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(batch.q, batch.cache, batch.layout, batch.block_table, batch.seq_lens,
                    batch.qsl, scale, batch.residual, batch.k_smooth, num_splits=splits,
                    out=out, k_bias=batch.k_bias, chunk_kv=batch.chunk_kv() if exact else None,
                    chunk_impl=exact if exact in ("flash", "triton", "gather") else "triton")
    assert not out.isnan().any(), "a query row was not written"
    return out


@pytest.mark.parametrize("exact", [False, True, "flash", "gather"],
                         ids=["cached", "exact", "flash", "gather"])
@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{c[0]}-{c[1]}-d{c[2]}-g{c[4]}-r{c[6]}-p{c[9]}")
def test_paged_attention_matches_reference(case, exact):
    """exact: the new tokens of prefill rows hold their bias in the raw K (no bias term);
    "gather": the context workspace adds RoPE_j(b) back to the dequantised K."""
    scheme, dtype, d, hkv, g, rows, res, smooth, splits, pairs = case
    kb = make_k_bias(hkv, d, 8.0, num_pairs=pairs)
    batch = make_batch(scheme, dtype, d, hkv, g, rows, residual_tokens=res, smooth=smooth,
                       writer=quantize_and_store, k_bias=kb)
    out = _run(batch, d ** -0.5, splits, exact)
    torch.testing.assert_close(out.double().cpu(), batch.reference(d ** -0.5, exact),
                               **tolerance(dtype))


# --- the point: reference vs float attention -----------------------------------------------

def _qwen_like_layer(with_bias: bool):
    """q, k, v of one sequence as Qwen2.5's layer 0 makes them: pre-RoPE keys x + b with
    std-2.3 x and a few channels of b in the hundreds, rotated by vLLM's RotaryEmbedding."""
    torch.manual_seed(0)
    d, hkv, g, n, theta = 128, 2, 6, 96, 1e6
    rope = _vllm_rope(d, theta, 4096)
    bias = torch.randn(hkv, d) * 0.5
    bias[:, [63, 127, 62, 100]] = torch.tensor([354.0, -250.0, 120.0, 60.0])
    pos = torch.arange(n)
    pre = torch.randn(n, hkv, d) * 2.3 + (bias if with_bias else 0)
    q, k = rope.forward_static(pos, torch.randn(n, hkv * g, d), pre, d, d,
                               rope.cos_sin_cache, True)
    v = torch.randn(n, hkv, d)
    q, k, v = (t.reshape(n, -1, d).to(torch.bfloat16) for t in (q, k, v))
    return q, k, v, bias, rope._compute_inv_freq(theta)


def _kv_attention(scheme, q, k, v, kb, kernels=False):
    n, hkv, d = k.shape
    b = 16
    layout = F.KVPageLayout(scheme, d, b)
    bt = torch.randperm(n // b + 2)[: n // b].int()
    pos = torch.arange(n)
    sm = bt[pos // b].long() * b + pos % b
    qsl, seq = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    cache = torch.zeros(layout.cache_shape(n // b + 2, hkv), dtype=layout.storage_dtype())
    if not kernels:
        ref.reshape_and_cache(k, v, cache, sm, layout, None, kb, pos)
        return ref.paged_attention_residual(q, cache, layout, bt[None], seq, qsl, d ** -0.5,
                                            None, None, kb)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    kb = None if kb is None else F.KRopeBias(*map(dev, kb))
    cache = dev(cache)
    quantize_and_store(dev(k), dev(v), cache, dev(sm), layout, None, None, kb, dev(pos))
    return paged_attention(dev(q), cache, layout, dev(bt[None]), dev(seq), dev(qsl), d ** -0.5,
                           None, None, num_splits=2, k_bias=kb).double().cpu()


@pytest.mark.parametrize("scheme", ["kv4", "kv8"])
def test_bias_aware_is_close_to_float_attention(scheme):
    """Qwen2.5 layer 0: plain per-token KV4 spends its 16 levels on the bias (step ~ 50) and
    the output is lost; bias-aware K quantises only the small part and is as close to float
    attention as KV on a model without the bias, with every pair or with the 16 largest, in
    the reference and in the kernels."""
    q, k, v, bias, inv_freq = _qwen_like_layer(True)
    err = lambda out, want: float((out - want).norm() / want.norm())  # noqa: E731
    want = ref.attention(q, k, v, 128 ** -0.5)
    plain = err(_kv_attention(scheme, q, k, v, None), want)
    aware = err(_kv_attention(scheme, q, k, v, F.make_k_rope_bias(bias, inv_freq)), want)
    kb16 = F.make_k_rope_bias(bias, inv_freq, 16)
    aware16 = err(_kv_attention(scheme, q, k, v, kb16), want)
    kern16 = err(_kv_attention(scheme, q, k, v, kb16, kernels=True), want)
    q0, k0, v0, _, _ = _qwen_like_layer(False)
    free = err(_kv_attention(scheme, q0, k0, v0, None), ref.attention(q0, k0, v0, 128 ** -0.5))
    errs = dict(plain=plain, aware=aware, aware16=aware16, kernel16=kern16, no_bias_model=free)
    assert plain > 5 * aware, errs
    assert max(aware, aware16) < 1.5 * free and kern16 < 1.25 * aware16, errs


# --- GPU: bigger shapes ---------------------------------------------------------------------

GPU_CASES = [
    # (scheme, dtype, group, head_dim, pairs, MIXPREC_ATTN_DECODE_CFG or None)
    ("kv4", torch.bfloat16, 6, 128, 16, None),
    ("kv4", torch.bfloat16, 6, 128, 16, "128,2,2"),
    ("kv4", torch.float16, 4, 128, None, "64,4,3"),
    ("kv4", torch.bfloat16, 1, 64, 32, None),
    ("kv4", torch.float16, 8, 256, 16, None),
    ("kv8", torch.bfloat16, 4, 128, 16, None),
    ("kv8", torch.float16, 8, 64, None, "128,2,2"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_paged_attention_gpu(case, monkeypatch):
    scheme, dtype, group, head_dim, pairs, cfg = case
    if cfg:
        monkeypatch.setenv("MIXPREC_ATTN_DECODE_CFG", cfg)
    torch.manual_seed(1)
    rows = [(1, 3000), (1, 17), (250, 700), (1, 1025), (64, 64), (1, 4096)]
    kb = make_k_bias(4, head_dim, 8.0, num_pairs=pairs)
    batch = make_batch(scheme, dtype, head_dim, 4, group, rows, residual_tokens=16,
                       smooth=group == 4, writer=quantize_and_store, k_bias=kb)
    for exact in (False, True):
        out = _run(batch, head_dim ** -0.5, None, exact)
        torch.testing.assert_close(out.double().cpu(), batch.reference(head_dim ** -0.5, exact),
                                   **tolerance(dtype))
