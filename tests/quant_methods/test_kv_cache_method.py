"""Start-up refusals of KV-cache configurations, through vLLM's real Attention layer and
VllmConfig: a KV4/KV8 checkpoint never silently runs on a cache it was not made for, and the
16-bit residual window never runs next to a prefix-cache offloader it cannot track."""
import pytest
import torch

from vllm_mixprec.quant_methods.config import MixPrecConfig

KV4 = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8", "weight_bits": 4,
       "act_bits": 8, "group_size": 64, "kv_scheme": "kv4"}


def _attention(cache_dtype, backend, quant=KV4, prefix="model.layers.0.self_attn.attn"):
    import vllm_mixprec
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    vllm_mixprec.register()
    cc = CacheConfig(cache_dtype=cache_dtype)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"),
                                            cache_config=cc)):
        return Attention(8, 64, 0.125, 2, cache_config=cc, quant_config=MixPrecConfig.from_config(quant),
                         prefix=prefix, attn_backend=backend)


def _backend(name):
    if name == "CUSTOM":
        from vllm_mixprec.attention_backend.backend import MixPrecAttentionBackend
        return MixPrecAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    return TritonAttentionBackend


@pytest.mark.parametrize("cache_dtype,backend,kv", [
    ("int8_per_token_head", "CUSTOM", "kv4"),       # the other carrier: KV8 pages for a KV4 model
    ("int4_per_token_head", "TRITON_ATTN", "kv4"),  # right bytes, vLLM's own int4 backend
    ("auto", "TRITON_ATTN", "kv4"),                 # no flags at all: a bf16 cache
    ("int4_per_token_head", "CUSTOM", "kv8"),
])
def test_kv_scheme_needs_its_dtype_and_backend(cache_dtype, backend, kv):
    with pytest.raises(ValueError) as e:
        _attention(cache_dtype, _backend(backend), dict(KV4, kv_scheme=kv))
    msg = str(e.value)
    want = {"kv4": "int4_per_token_head", "kv8": "int8_per_token_head"}[kv]
    assert f"kv_scheme is '{kv}'" in msg and f"kv_cache_dtype='{cache_dtype}'" in msg, msg
    assert f"--kv-cache-dtype {want} --attention-backend CUSTOM" in msg, msg
    assert "re-export the checkpoint with kv_scheme 'none'" in msg, msg


def test_matching_flags_start():
    layer = _attention("int4_per_token_head", _backend("CUSTOM"), prefix="model.layers.1.self_attn.attn")
    assert layer.kv_cache_dtype == "int4_per_token_head" and layer.attn_backend.get_name() == "CUSTOM"


def test_custom_backend_refuses_fp8_cache():
    """--attention-backend CUSTOM with a KV dtype it has no page layout for."""
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' is not supported by the mixprec "
                                         r"\(CUSTOM\).*--kv-cache-dtype int4_per_token_head"):
        _attention("fp8", _backend("CUSTOM"), dict(KV4, kv_scheme="none"),
                   prefix="model.layers.2.self_attn.attn")


def _offloading_config(monkeypatch, residual: str):
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    from vllm_mixprec.attention_backend import residual as R
    monkeypatch.setenv(R.ENV_TOKENS, residual)
    # --enable-prefix-caching --kv-offloading-size 1: vLLM's native CPU prefix-cache offload
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"),
                     cache_config=CacheConfig(enable_prefix_caching=True, kv_offloading_size=1.0,
                                              cache_dtype="int4_per_token_head"))
    assert cfg.kv_transfer_config is not None  # vLLM turned the offload into a connector
    return cfg


def test_prefix_cache_offload_with_residual_is_refused(monkeypatch):
    """Offloaded prefix blocks come back into the pages without passing through our writer,
    so a still-valid residual tag would serve the 16-bit copy of a different token. Refused
    at start-up (metadata builder), with the fix."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from vllm_mixprec.attention_backend.metadata import MixPrecAttentionMetadataBuilder

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    cfg = _offloading_config(monkeypatch, "16")
    with set_current_vllm_config(cfg):  # the model's layer, as the runner would have built it
        Attention(8, 64, 0.125, 2, cache_config=cfg.cache_config,
                  quant_config=MixPrecConfig.from_config(KV4),
                  prefix="model.layers.0.self_attn.attn", attn_backend=_backend("CUSTOM"))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, head_size_v=64,
                             dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode("int4_per_token_head"))
    with pytest.raises(ValueError, match="KV connectors/offloading.*set MIXPREC_KV_RESIDUAL=0"):
        MixPrecAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], cfg,
                                        torch.device("cpu"))


def test_prefix_cache_offload_without_residual_is_allowed(monkeypatch):
    from vllm_mixprec.attention_backend import residual as R

    cfg = _offloading_config(monkeypatch, "0")
    assert R.residual_tokens(cfg, 16) == 0
    R.check_supported(cfg, R.residual_tokens(cfg, 16))  # pages alone are complete: no refusal
