"""The CUDA KV4 decode page kernel (csrc/attention/sm80/decode_kv4_mma.cu) and its selection
(kernels/triton/attention.py: decode_impl, cuda_decode_unsupported).

GPU tests compare it with reference.paged_attention_residual (float64 on CPU copies) and with
the Triton page kernel on ragged rows, GQA groups 1..8, both dtypes, k_smooth, the residual
window and split counts; CPU tests cover the selection rules and their errors."""
from __future__ import annotations

import pytest
import torch

from attn_helpers import (capture_graph, decode_graph_buffers, make_batch, refill_decode_batch,
                          tolerance)
from vllm_mixprec import formats as F
from vllm_mixprec.kernels.triton import attention as A
from vllm_mixprec.kernels.triton.kv_cache import quantize_and_store

gpu = pytest.mark.gpu
SCALE = 128 ** -0.5
# ragged rows: shorter than a page, page-aligned, one past, several tiles, a long one
ROWS = [(1, 1), (1, 16), (1, 17), (1, 129), (1, 1000), (1, 3000)]


def _writer(k, v, cache, sm, layout, k_smooth, residual, **kw):
    quantize_and_store(k, v, cache, sm, layout, k_smooth, residual, **kw)


def _need_cuda_kernel():
    from vllm_mixprec.kernels import cuda
    if not cuda.has_decode_kv4():
        pytest.skip(f"csrc build without decode_kv4_pages: {cuda.load_error()}")


def _run(batch, impl, monkeypatch, num_splits=None):
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", impl)
    return A.paged_attention(batch.q, batch.cache, batch.layout, batch.block_table, batch.seq_lens,
                             batch.qsl, SCALE, batch.residual, batch.k_smooth,
                             num_splits=num_splits)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("residual_tokens,smooth", [(0, False), (16, False), (0, True), (16, True)],
                         ids=["plain", "r16", "smooth", "r16-smooth"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_decode_matches_reference(dtype, group, residual_tokens, smooth, num_splits,
                                       monkeypatch):
    """Within the dtype's tolerance of the float64 reference, and close to the Triton kernel
    (both feed fp16 codes, queries and P * scale to the tensor cores)."""
    _need_cuda_kernel()
    torch.manual_seed(100 * group + residual_tokens + num_splits)
    batch = make_batch("kv4", dtype, 128, 2, group, ROWS, residual_tokens=residual_tokens,
                       smooth=smooth, writer=_writer)
    got = _run(batch, "cuda", monkeypatch, num_splits)
    want = batch.reference(SCALE)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double().cpu(), want, **tolerance(dtype))
    triton_out = _run(batch, "triton", monkeypatch, num_splits)
    err = (got.float() - triton_out.float()).norm() / triton_out.float().norm()
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), float(err)


@gpu
def test_cuda_decode_large_queries_and_prefill_rows_untouched(monkeypatch):
    """bf16 queries beyond fp16's range go through the power-of-two shift; rows of query
    length > 1 are left to the prefill kernel (their output is not written by decode)."""
    _need_cuda_kernel()
    torch.manual_seed(7)
    batch = make_batch("kv4", torch.bfloat16, 128, 2, 4, [(1, 300), (5, 40), (1, 64)],
                       writer=_writer)
    batch.q[:1] *= 3e5  # |q| ~ 1e6 > fp16 max
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "cuda")
    out = torch.full_like(batch.q, float("nan"))
    A.decode_attention(batch.q, batch.cache, batch.layout, batch.block_table, batch.seq_lens,
                       batch.qsl, out, SCALE, 3, 1)
    want = batch.reference(SCALE)
    decode_tokens = [0, 6]
    torch.testing.assert_close(out[decode_tokens].double().cpu(), want[decode_tokens],
                               **tolerance(torch.bfloat16))
    assert torch.isnan(out[1:6]).all()


@gpu
def test_cuda_decode_cuda_graph_replay(monkeypatch):
    """Captured once with the residual window and 4 splits; replays with new lengths, tables,
    queries and pages match the eager Triton kernel."""
    _need_cuda_kernel()
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "cuda")
    torch.manual_seed(3)
    n, splits = 6, 4
    layout = F.KVPageLayout("kv4", 128, 16)
    buf = decode_graph_buffers(layout, n, 4, 4, 40, splits, torch.bfloat16)
    q, cache, bt, seq_lens, qsl, out = buf.q, buf.cache, buf.block_table, buf.seq_lens, buf.qsl, buf.out
    part_o, part_lse, directory, res = buf.part_o, buf.part_lse, buf.directory, buf.residual

    def launch():
        A.decode_attention(q, cache, layout, bt, seq_lens, qsl, out, SCALE, n, splits, part_o,
                           part_lse, res)

    graph = capture_graph(launch)
    for trial in range(3):
        refill_decode_batch(trial, bt, seq_lens, qsl, cache, layout, directory, res)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "triton")
        launch()
        monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "cuda")
        torch.testing.assert_close(got, out, atol=2e-2, rtol=2e-2, msg=f"replay {trial}")


@gpu
def test_cuda_decode_op_rejects_bad_arguments():
    """The op names what is wrong instead of reading out of bounds."""
    _need_cuda_kernel()
    batch = make_batch("kv4", torch.bfloat16, 128, 2, 4, [(1, 40)], writer=_writer)
    op = torch.ops.mixprec_C.decode_kv4_pages
    out = torch.empty_like(batch.q)
    args = dict(q=batch.q, cache=batch.cache, block_table=batch.block_table,
                seq_lens=batch.seq_lens, query_start_loc=batch.qsl, out=out, part_o=None,
                part_lse=None, k_smooth=None, qk_scale=0.1, num_rows=1, num_splits=1, slots=1,
                res_tokens=0, tile_tokens=128, min_tiles=1)
    op(**args)  # the good call runs
    op(**{**args, "out": torch.empty(5, *out.shape[1:], dtype=out.dtype, device=out.device)})  # more rows
    bad = [
        (dict(num_splits=2, slots=2), "part_o/part_lse"),
        (dict(tile_tokens=100), "bad partition"),
        (dict(block_table=batch.block_table.long()), "int32"),
        (dict(q=batch.q[:, :3], out=out[:, :3]), "multiple of kv heads"),
        (dict(prefetch_pages=32), "prefetch_pages"),
        (dict(cache=batch.cache[..., :72]), "cache must be"),
        (dict(out=out.float()), "out must be"),
        (dict(out=out[:, :4]), "out must be"),
        (dict(num_rows=5), "fewer than num_rows"),
    ]
    for change, match in bad:
        with pytest.raises(RuntimeError, match=match):
            op(**{**args, **change})


# --- selection (CPU) ---------------------------------------------------------------------------

LAYOUT = F.KVPageLayout("kv4", 128, 16)


@pytest.fixture
def supported(monkeypatch):
    """Pretend the CUDA kernel runs here (the selection rules, not the kernel, are tested)."""
    for env in ("MIXPREC_ATTN_DECODE_IMPL", "MIXPREC_ATTN_MERGE", "MIXPREC_ATTN_TAIL",
                "MIXPREC_ATTN_TAIL_IN_SPLIT"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(A, "cuda_decode_unsupported", lambda *a, **k: "")


def test_decode_impl_default_is_cuda_from_32_pairs(supported):
    dev = torch.device("cuda")
    assert A.CUDA_MIN_PAIRS == 32
    assert A.decode_impl(64, LAYOUT, 4, dev, num_kv_heads=8, num_sms=132) == "cuda"
    assert A.decode_impl(4, LAYOUT, 4, dev, num_kv_heads=8, num_sms=132) == "cuda"
    assert A.decode_impl(3, LAYOUT, 4, dev, num_kv_heads=8, num_sms=132) == "triton"
    assert A.decode_impl(32, LAYOUT, 8, dev, num_kv_heads=1, num_sms=132) == "cuda"
    assert A.decode_impl(1, LAYOUT, 4, dev, num_kv_heads=8, num_sms=132) == "triton"


def test_decode_impl_env(supported, monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "cuda")
    assert A.decode_impl(1, LAYOUT, 4, dev, num_kv_heads=8) == "cuda"
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "triton")
    assert A.decode_impl(64, LAYOUT, 4, dev, num_kv_heads=8) == "triton"
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "fast")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_DECODE_IMPL='fast'"):
        A.decode_impl(64, LAYOUT, 4, dev, num_kv_heads=8)


def test_decode_impl_forced_merge_or_tail(supported, monkeypatch):
    """A forced fused merge or tail placement keeps the Triton kernel by default, and is an
    error together with MIXPREC_ATTN_DECODE_IMPL=cuda."""
    dev = torch.device("cuda")
    monkeypatch.setenv("MIXPREC_ATTN_TAIL", "program")
    assert A.decode_impl(64, LAYOUT, 4, dev, num_kv_heads=8) == "triton"
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "cuda")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_TAIL=program"):
        A.decode_impl(64, LAYOUT, 4, dev, num_kv_heads=8)
    monkeypatch.setenv("MIXPREC_ATTN_TAIL", "finish")
    monkeypatch.setenv("MIXPREC_ATTN_MERGE", "fused")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_MERGE=fused"):
        A.decode_impl(64, LAYOUT, 4, dev, num_kv_heads=8)


@pytest.mark.parametrize("layout,group,k_bias,dtype,match", [
    (F.KVPageLayout("kv8", 128, 16), 4, False, torch.int32, "kv4 with head_dim 128"),
    (F.KVPageLayout("kv4", 64, 16), 4, False, torch.int32, "head_dim 64"),
    (F.KVPageLayout("kv4", 128, 32), 4, False, torch.int32, "32-token pages"),
    (LAYOUT, 16, False, torch.int32, "at most 8 query heads"),
    (LAYOUT, 4, True, torch.int32, "bias-aware K"),
    (LAYOUT, 4, False, torch.int64, "int32 block tables"),
])
def test_cuda_decode_unsupported_names_the_reason(layout, group, k_bias, dtype, match,
                                                  monkeypatch):
    monkeypatch.delenv("MIXPREC_ATTN_DECODE_IMPL", raising=False)
    why = A.cuda_decode_unsupported(layout, group, torch.device("cuda"), k_bias, dtype)
    assert match in why
    assert A.decode_impl(64, layout, group, torch.device("cuda"), k_bias, 8, 132, dtype) == "triton"
    monkeypatch.setenv("MIXPREC_ATTN_DECODE_IMPL", "cuda")
    with pytest.raises(ValueError, match="cannot run here: .*" + match):
        A.decode_impl(64, layout, group, torch.device("cuda"), k_bias, 8, 132, dtype)


def test_cuda_decode_splits_fit_one_wave(monkeypatch):
    """4 CTAs an SM: at most 4 * SMs (row, kv head, split) programs, never fewer than one split;
    MIXPREC_ATTN_CUDA_WAVE=0 keeps the Triton kernel's count."""
    monkeypatch.delenv("MIXPREC_ATTN_CUDA_WAVE", raising=False)
    assert A.cuda_decode_splits(64, 8, 132, 2) == 1   # 512 pairs: one wave of 528
    assert A.cuda_decode_splits(8, 8, 132, 16) == 8   # 64 pairs x 8 = 512
    assert A.cuda_decode_splits(1, 8, 132, 32) == 32
    assert A.cuda_decode_splits(1024, 8, 132, 1) == 1
    monkeypatch.setenv("MIXPREC_ATTN_CUDA_WAVE", "0")
    assert A.cuda_decode_splits(64, 8, 132, 2) == 2
    monkeypatch.setenv("MIXPREC_ATTN_CUDA_WAVE", "yes")
    with pytest.raises(ValueError, match="MIXPREC_ATTN_CUDA_WAVE"):
        A.cuda_decode_splits(64, 8, 132, 2)


def test_cuda_decode_prefetch_env(monkeypatch):
    monkeypatch.delenv("MIXPREC_ATTN_CUDA_PREFETCH", raising=False)
    assert A.cuda_decode_prefetch() == A.CUDA_PREFETCH_PAGES == 4
    monkeypatch.setenv("MIXPREC_ATTN_CUDA_PREFETCH", "4")
    assert A.cuda_decode_prefetch() == 4
    for bad in ("-1", "32", "x"):
        monkeypatch.setenv("MIXPREC_ATTN_CUDA_PREFETCH", bad)
        with pytest.raises(ValueError, match="MIXPREC_ATTN_CUDA_PREFETCH"):
            A.cuda_decode_prefetch()


def test_cuda_decode_unsupported_off_gpu():
    assert "CUDA device" in A.cuda_decode_unsupported(LAYOUT, 4, torch.device("cpu"), False)
