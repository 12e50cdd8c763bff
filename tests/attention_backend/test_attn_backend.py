"""The backend's contract with vLLM 0.26, and the builder + impl driven step by step."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

from vllm_mixprec import formats as F
from vllm_mixprec import reference as ref
from vllm_mixprec.attention_backend import residual as R
from vllm_mixprec.attention_backend.backend import MixPrecAttentionBackend as Backend
from vllm_mixprec.attention_backend.impl import (ENV_PREFILL_EXACT, MixPrecAttentionImpl,
                                                 prefill_exact)
from vllm_mixprec.attention_backend.metadata import MixPrecAttentionMetadataBuilder
from vllm_mixprec.kernels.chunk_attention import ENV_CHUNK, chunk_setting, select_chunk_impl

from attn_helpers import DEVICE, cpu_k_bias, make_k_bias, tolerance, use_tail

CARRIERS = ("int4_per_token_head", "int8_per_token_head")


def test_names_and_dtypes():
    assert Backend.get_name() == "CUSTOM"
    assert Backend.supported_dtypes == [torch.float16, torch.bfloat16]
    assert Backend.supported_kv_cache_dtypes == list(CARRIERS)
    assert Backend.get_supported_head_sizes() == [64, 128, 256]
    assert Backend.forward_includes_kv_cache_update is False
    assert Backend.get_kv_cache_stride_order() == (0, 1, 2, 3)
    assert Backend.get_kv_cache_block_dim(16, 8, 128, "int4_per_token_head") == 0
    assert not Backend.indexes_kv_by_block_stride()
    assert (MixPrecAttentionMetadataBuilder.get_cudagraph_support(None, None)
            == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)


def test_registry_resolves_our_class():
    import vllm_mixprec
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_mixprec.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is Backend
    assert AttentionBackendEnum[Backend.get_name()] is AttentionBackendEnum.CUSTOM


@pytest.mark.parametrize("carrier", CARRIERS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size,heads", [(16, 1), (16, 8), (32, 4), (128, 2)])
def test_page_bytes_equal_vllm_spec(carrier, head_dim, block_size, heads):
    """prod(shape) * itemsize == vLLM's page budget (incl. the 2*B*H*4 scale bytes), and the
    runner's raw.view(dtype).view(shape) yields a cache our planes can be carved from."""
    dtype = STR_DTYPE_TO_TORCH_DTYPE[carrier]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_dim,
                             head_size_v=head_dim, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(carrier))
    nb = 3
    shape = Backend.get_kv_cache_shape(nb, block_size, heads, head_dim, carrier)
    assert math.prod(shape) * dtype.itemsize == nb * spec.page_size_bytes
    layout = F.KVPageLayout(F.KV_SCHEME_OF_CARRIER[carrier], head_dim, block_size)
    assert shape == layout.cache_shape(nb, heads) and layout.storage_dtype() == dtype
    # same budget TRITON_ATTN fills for this carrier
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    tri = TritonAttentionBackend.get_kv_cache_shape(nb, block_size, heads, head_dim, carrier)
    assert math.prod(tri) == math.prod(shape)
    raw = torch.zeros(nb * spec.page_size_bytes, dtype=torch.int8)
    cache = raw.view(dtype).view(shape)
    planes = F.kv_planes(cache, layout)
    assert planes["k_codes"].shape == (nb, heads, block_size, layout.code_bytes_per_token)


def test_kv4_capacity():
    ratio = F.kv_capacity_ratio("kv4", 128)
    assert F.KVPageLayout("kv4", 128, 16).row_bytes == 136
    assert ratio == pytest.approx(512 / 136) and ratio >= 3.5
    assert F.kv_capacity_ratio("kv8", 128) == pytest.approx(512 / 264)


def test_kv_cache_shape_rejects_other_dtypes():
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'.*--kv-cache-dtype"):
        Backend.get_kv_cache_shape(4, 16, 8, 128, "auto")
    with pytest.raises(ValueError, match="head_size=96"):
        Backend.get_kv_cache_shape(4, 16, 8, 96, "int4_per_token_head")
    with pytest.raises(ValueError, match="block_size=48"):
        Backend.get_kv_cache_shape(4, 48, 8, 128, "int4_per_token_head")
    assert Backend.supports_block_size(256) and not Backend.supports_block_size(24)


def _validate(**over):
    args = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="int4_per_token_head",
                block_size=16, use_mla=False, has_sink=False, use_sparse=False,
                use_mm_prefix=False, use_per_head_quant_scales=False, device_capability=None,
                attn_type="decoder")
    args.update(over)
    return Backend.validate_configuration(**args)


def test_validate_configuration_names_the_field():
    assert _validate() == []
    assert _validate(kv_cache_dtype="int8_per_token_head") == []
    cases = {"head_size": 80, "dtype": torch.float32, "kv_cache_dtype": "auto",
             "block_size": 24, "use_mla": True, "has_sink": True, "attn_type": "encoder",
             "has_sliding_window": True}
    for field, value in cases.items():
        errs = _validate(**{field: value})
        assert len(errs) == 1 and field in errs[0], (field, errs)
    from vllm.platforms.interface import DeviceCapability
    assert "device_capability" in _validate(device_capability=DeviceCapability(7, 5))[0]


def test_impl_rejects_unsupported_features():
    with pytest.raises(ValueError, match="sliding_window"):
        MixPrecAttentionImpl(8, 128, 0.1, 2, None, 4096, "int4_per_token_head")
    with pytest.raises(ValueError, match="sinks"):
        MixPrecAttentionImpl(8, 128, 0.1, 2, None, None, "int4_per_token_head", sinks=torch.ones(8))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
        MixPrecAttentionImpl(8, 128, 0.1, 2, None, None, "fp8")
    with pytest.raises(ValueError, match="KV sharing"):
        MixPrecAttentionImpl(8, 128, 0.1, 2, None, None, "int4_per_token_head",
                             kv_sharing_target_layer_name="model.layers.0.attn")


def test_residual_refuses_kv_connectors():
    cfg = SimpleNamespace(kv_transfer_config=object(),
                          parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    with pytest.raises(ValueError, match=R.ENV_TOKENS):
        R.check_supported(cfg, 16)
    R.check_supported(cfg, 0)


# --- builder + impl, step by step ---------------------------------------------------------

def _fake_vllm_config(cache, num_q_heads, block_size, max_num_seqs=4, k_rope_bias=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(get_num_attention_heads=lambda pc: num_q_heads),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, use_ubatching=False),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs), speculative_config=None,
        compilation_config=SimpleNamespace(
            static_forward_context={"l0": SimpleNamespace(kv_cache=cache,
                                                          k_rope_bias=k_rope_bias)}),
        cache_config=SimpleNamespace(block_size=block_size), kv_transfer_config=None,
        quant_config=None)


def _finite_kv(fn):
    """fn (a FlashAttention entry point) that first checks that every row of its key and
    value is finite: FlashAttention loads whole K/V tiles past a sequence's end and masks
    their scores, so a NaN row anywhere in the tensors it is given (vLLM's padding rows,
    session 22) turns the masked 0 * NaN into NaN outputs."""
    def checked(q, key, value, *args, **kwargs):
        assert torch.isfinite(key).all() and torch.isfinite(value).all(), \
            "a non-finite K/V row (padding?) reached FlashAttention"
        return fn(q, key, value, *args, **kwargs)
    return checked


PAD = 3  # rows past num_actual_tokens, as vLLM pads a batch to a CUDA-graph size: NaN here


@pytest.mark.parametrize("carrier,dtype,res,bias,exact", [
    ("int4_per_token_head", torch.float16, 16, False, "1"),
    ("int8_per_token_head", torch.bfloat16, 16, False, "0"),
    ("int4_per_token_head", torch.bfloat16, 0, False, "1"),
    ("int4_per_token_head", torch.bfloat16, 0, False, "0"),
    ("int4_per_token_head", torch.bfloat16, 16, True, "1"),   # bias-aware K
    ("int4_per_token_head", torch.bfloat16, 16, True, "0"),
    ("int8_per_token_head", torch.float16, 0, True, "1"),
    # the chunk through kernels.chunk_attention (FlashAttention; here its reference), merged
    ("int4_per_token_head", torch.float16, 16, False, "flash"),
    ("int8_per_token_head", torch.bfloat16, 0, True, "flash"),
    # the context workspace, then one FlashAttention call (here the reference)
    ("int4_per_token_head", torch.float16, 16, False, "gather"),
    ("int4_per_token_head", torch.bfloat16, 16, True, "gather"),
    ("int8_per_token_head", torch.bfloat16, 0, False, "gather"),
    # a workspace too small for the second step: that step merges instead
    ("int4_per_token_head", torch.float16, 16, False, "gather-overflow"),
    # the decode's residual tail in a program of its own (the builder's part_o has its slot)
    ("int4_per_token_head", torch.bfloat16, 16, True, "1-tailprog")])
def test_builder_and_impl_over_steps(carrier, dtype, res, bias, exact, monkeypatch):
    """Chunked prefill then decodes of two requests (rows not ordered decode-first):
    the output equals attention over the pages, with the newest R tokens in 16 bits and,
    with exact prefill, a prefill row's own new tokens too, and NaN in the rows vLLM pads a
    batch with reaches neither the output nor FlashAttention. With a k bias, the builder gives
    the writer each token's cache position, the pages hold K - RoPE_p(b), and the output is
    attention over those plus RoPE_p(b)."""
    import vllm_mixprec.attention_backend.impl as impl_mod
    if exact.endswith("-tailprog"):
        exact = exact.removesuffix("-tailprog")
        use_tail(monkeypatch, "program")
    monkeypatch.setenv(R.ENV_TOKENS, str(res))
    monkeypatch.setenv(ENV_PREFILL_EXACT, "0" if exact == "0" else "1")
    monkeypatch.setenv(ENV_CHUNK, "triton" if exact in ("0", "1") else "flash")
    monkeypatch.setenv(impl_mod.ENV_CONTEXT_TOKENS,
                       {"gather": "64", "gather-overflow": "16"}.get(exact, "0"))
    gathered = []
    real_gather = impl_mod.gather_context_kv
    monkeypatch.setattr(impl_mod, "gather_context_kv",
                        lambda *a, **k: gathered.append(a[5].tolist()) or real_gather(*a, **k))
    for name in ("chunk_attention", "context_attention"):
        monkeypatch.setattr(impl_mod, name, _finite_kv(getattr(impl_mod, name)))
    hkv, g, d, b, nb = 2, 4, 64, 16, 12
    layout = F.KVPageLayout(F.KV_SCHEME_OF_CARRIER[carrier], d, b)
    cache = torch.zeros(Backend.get_kv_cache_shape(nb, b, hkv, d, carrier),
                        dtype=STR_DTYPE_TO_TORCH_DTYPE[carrier], device=DEVICE)
    kb = make_k_bias(hkv, d, 8.0, num_pairs=16) if bias else None
    cfg = _fake_vllm_config(cache, hkv * g, b, k_rope_bias=kb)
    spec = FullAttentionSpec(block_size=b, num_kv_heads=hkv, head_size=d, head_size_v=d,
                             dtype=cache.dtype, kv_quant_mode=get_kv_quant_mode(carrier))
    builder = MixPrecAttentionMetadataBuilder(spec, ["l0"], cfg, torch.device(DEVICE))
    impl = MixPrecAttentionImpl(hkv * g, d, d ** -0.5, hkv, None, None, carrier)
    impl.vllm_config = cfg
    layer = SimpleNamespace(layer_name="l0", k_rope_bias=kb)
    blocks = {0: [7, 2, 9], 1: [4, 11, 0], 2: [3, 5, 8]}
    hist = {r: ([], []) for r in blocks}
    done = dict.fromkeys(blocks, 0)
    # (request, query length) rows per step; request 1 decodes before request 0 finishes, and
    # request 2 arrives as a fresh prefill behind two decodes (vLLM's order; session 21's
    # real-Qwen KV4 NaN came with such batches)
    steps = [[(0, 20), (1, 5)], [(1, 1), (0, 13)], [(0, 1), (1, 1), (2, 7)], [(1, 1), (0, 1), (2, 1)],
             [(0, 1), (1, 1), (2, 1)]]
    for rows in steps:
        qlens = [q for _, q in rows]
        seq = [done[r] + q for r, q in rows]
        qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor(qlens), 0)), dtype=torch.int32)
        bt = torch.tensor([blocks[r] for r, _ in rows], dtype=torch.int32)
        sm = torch.cat([bt[i, torch.arange(done[r], done[r] + q) // b].long() * b
                        + torch.arange(done[r], done[r] + q) % b for i, (r, q) in enumerate(rows)])
        t = int(qsl[-1])
        cm = CommonAttentionMetadata(
            query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=DEVICE), num_reqs=len(rows),
            num_actual_tokens=t, max_query_len=max(qlens), max_seq_len=max(seq),
            block_table_tensor=bt.to(DEVICE), slot_mapping=sm.to(DEVICE),
            seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32))
        md = builder.build(0, cm)
        # the first step's chunks have nothing cached: FlashAttention's output is final
        assert md.prefill_has_context == any(q > 1 and done[r] for r, q in rows)
        assert md.num_decodes == qlens.count(1) and md.num_prefills == len(rows) - md.num_decodes
        pos = torch.cat([torch.arange(done[r], done[r] + q) for r, q in rows])
        assert (md.key_positions is None) == (not bias)
        if bias:
            assert torch.equal(md.key_positions[:t].cpu().long(), pos)
        q = torch.randn(t, hkv * g, d).to(dtype)
        k = torch.randn(t, hkv, d)
        if bias:  # what a model with this k bias produces: RoPE_p(x + b)
            k = ref.apply_rope(k + kb.bias.cpu(), pos, kb.steps.cpu())
        k = k.to(dtype)
        v = torch.randn(t, hkv, d).to(dtype)
        impl._metadata_of = lambda _layer, md=md: md

        def padded(x):  # PAD rows of NaN after the step's tokens, on the device
            return torch.cat([x, torch.full((PAD, *x.shape[1:]), float("nan"), dtype=x.dtype)]
                             ).to(DEVICE)
        sm_pad = torch.cat([sm, torch.full((PAD,), -1, dtype=sm.dtype)]).to(DEVICE)
        impl.do_kv_cache_update(layer, padded(k), padded(v), cache, sm_pad)
        out = padded(torch.full_like(q, float("nan")))
        impl.forward(layer, padded(q), padded(k), padded(v), cache, md, out)
        out, cache_cpu = out[:t].cpu(), cache.cpu()
        for i, (r, qn) in enumerate(rows):
            s, e = int(qsl[i]), int(qsl[i + 1])
            hist[r][0].append(k[s:e])
            hist[r][1].append(v[s:e])
            done[r] += qn
            # Ideal: pages everywhere except the newest `res` tokens, which are 16-bit exact.
            kk, vv = ref.gather_kv(cache_cpu, layout, bt[i], done[r])
            rot = 0
            if bias:  # the pages hold K - RoPE_p(b) (so does the 16-bit copy, rounded)
                rot = ref.rotate_k_bias(cpu_k_bias(kb), torch.arange(done[r]))
                kk = kk.double() + rot
            if res:
                rr = rot[-res:] if bias else 0
                kk[-res:] = ((torch.cat(hist[r][0])[-res:].double() - rr).to(dtype).double()
                             + rr).to(kk.dtype)
                vv[-res:] = torch.cat(hist[r][1]).float()[-res:]
            if exact != "0" and qn > 1:  # the chunk's own tokens as given, bias included
                kk[-qn:] = k[s:e].to(kk.dtype)
                vv[-qn:] = v[s:e].float()
            want = ref.attention(q[s:e], kk, vv, d ** -0.5)
            torch.testing.assert_close(out[s:e].double(), want, **tolerance(dtype))
    # only the second step has a prefill row with cached context: [(1, 1), (0, 13 after 20)]
    assert gathered == ([[0, 1, 34]] if exact == "gather" else [])


def test_context_tokens_setting(monkeypatch):
    """MIXPREC_ATTN_CONTEXT_TOKENS, else one step's tokens plus a full row, capped."""
    from vllm_mixprec.attention_backend.impl import (ENV_CONTEXT_TOKENS,
                                                     MAX_DEFAULT_CONTEXT_TOKENS, context_tokens)
    cfg = lambda b, m: SimpleNamespace(  # noqa: E731
        scheduler_config=SimpleNamespace(max_num_batched_tokens=b),
        model_config=SimpleNamespace(max_model_len=m))
    monkeypatch.delenv(ENV_CONTEXT_TOKENS, raising=False)
    assert context_tokens(cfg(16384, 16384)) == 32768
    assert context_tokens(cfg(8192, 1 << 20)) == MAX_DEFAULT_CONTEXT_TOKENS
    assert context_tokens(None) == 0
    monkeypatch.setenv(ENV_CONTEXT_TOKENS, "0")
    assert context_tokens(cfg(16384, 16384)) == 0
    monkeypatch.setenv(ENV_CONTEXT_TOKENS, "-5")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_CONTEXT_TOKENS='-5'"):
        context_tokens(cfg(16384, 16384))


def test_chunk_impl_env_and_choice(monkeypatch):
    """MIXPREC_ATTN_CHUNK is validated at start-up; CPU tensors never pick FlashAttention by
    themselves (auto: the Triton kernel) but honour a forced "flash" with the reference."""
    monkeypatch.delenv(ENV_CHUNK, raising=False)
    assert chunk_setting() == "auto"
    assert select_chunk_impl(torch.device("cpu"), 128) == "triton"
    for v in ("flash", "triton"):
        monkeypatch.setenv(ENV_CHUNK, v)
        assert select_chunk_impl(torch.device("cpu"), 128) == v
    monkeypatch.setenv(ENV_CHUNK, "fa3")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_CHUNK='fa3': expected one of"):
        MixPrecAttentionImpl(8, 64, 0.125, 2, None, None, "int4_per_token_head")


@pytest.mark.gpu
def test_chunk_impl_auto_picks_flash_on_the_gpu(monkeypatch):
    """On an sm80+ GPU with vLLM's FlashAttention, auto means flash (the fast path is the
    default, not an option nobody turns on)."""
    monkeypatch.delenv(ENV_CHUNK, raising=False)
    assert select_chunk_impl(torch.device("cuda"), 128) == "flash"


def test_prefill_exact_env(monkeypatch):
    monkeypatch.delenv(ENV_PREFILL_EXACT, raising=False)
    assert prefill_exact()
    monkeypatch.setenv(ENV_PREFILL_EXACT, "0")
    assert not prefill_exact()
    monkeypatch.setenv(ENV_PREFILL_EXACT, "yes")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_PREFILL_EXACT='yes': expected 1"):
        MixPrecAttentionImpl(8, 64, 0.125, 2, None, None, "int4_per_token_head")


def test_profile_run_allocates_pool_and_returns_zeros(monkeypatch):
    monkeypatch.setenv(R.ENV_TOKENS, "16")
    impl = MixPrecAttentionImpl(8, 64, 0.125, 2, None, None, "int4_per_token_head")
    impl.vllm_config = _fake_vllm_config(None, 8, 16, max_num_seqs=3)
    q = torch.randn(5, 8, 64, dtype=torch.float16)
    out = torch.full_like(q, 3.0)
    impl.forward(SimpleNamespace(), q, q[:, :2], q[:, :2], torch.empty(0), None, out)
    assert (out == 0).all()
    slots = R.residual_slots(impl.vllm_config, 16, 16)
    assert impl._pool[0].shape == (slots * 16, 2, 64)


def test_profile_run_reserves_and_compiles_the_context_workspace(monkeypatch):
    """With exact prefill through FlashAttention, the profiling run reserves the context
    workspace (so vLLM counts it) and launches its kernel once on empty rows (so that Triton
    compiles it before serving, not at the first request with cached context)."""
    import vllm_mixprec.attention_backend.impl as impl_mod
    monkeypatch.setenv(R.ENV_TOKENS, "16")
    monkeypatch.setenv(ENV_CHUNK, "flash")
    monkeypatch.setenv(impl_mod.ENV_CONTEXT_TOKENS, "40")
    monkeypatch.setattr(impl_mod, "_CONTEXT_WORKSPACES", {})
    launches = []
    real = impl_mod.gather_context_kv
    monkeypatch.setattr(impl_mod, "gather_context_kv",
                        lambda *a, **k: launches.append((a[5].tolist(), a[11])) or real(*a, **k))
    impl = MixPrecAttentionImpl(8, 64, 0.125, 2, None, None, "int4_per_token_head")
    impl.vllm_config = _fake_vllm_config(None, 8, 16, max_num_seqs=3)
    qkv = torch.randn(5, 12, 64, dtype=torch.float16)
    out = torch.full_like(qkv[:, :8], 3.0)
    impl.forward(SimpleNamespace(), qkv[:, :8], qkv[:, 8:10], qkv[:, 10:], torch.empty(0),
                 None, out)
    assert (out == 0).all()
    (ws_k, ws_v), = impl_mod._CONTEXT_WORKSPACES.values()
    assert ws_k.shape == ws_v.shape == (40, 2, 64) and ws_k.dtype == torch.float16
    assert launches == [([0, 0], 1)]  # one row, empty
