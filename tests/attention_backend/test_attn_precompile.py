"""Parallel precompilation of the decode and residual-directory variants
(kernels/triton/precompile.py): it warms exactly the variants serving launches, compiles them
concurrently, and runs once per directory and layer."""
from __future__ import annotations

import threading

import pytest
import torch

from vllm_mixprec.attention_backend import residual as R
from vllm_mixprec.kernels.triton import attention as A
from vllm_mixprec.kernels.triton import precompile as P
from vllm_mixprec.kernels.triton import residual_directory as RD

from attn_helpers import DEVICE, make_batch


class _Recorder:
    """Stands in for a JITFunction: records launches (kernel[grid](...)) and warmups."""

    def __init__(self, name: str, log: dict):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log["launch"].append((self.name, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.log["warm"].append((self.name, args, kwargs))


def _signature(args) -> tuple:
    """What Triton specialises a launch on: tensors by address and dtype, ints by value."""
    return tuple((a.data_ptr(), a.dtype) if torch.is_tensor(a) else a for a in args)


def _variants(entries) -> set:
    return {(name, _signature(args), tuple(sorted(kw.items()))) for name, args, kw in entries}


@pytest.fixture
def recorders(monkeypatch):
    log = {"launch": [], "warm": []}
    monkeypatch.setattr(A, "_paged_attn_kernel", _Recorder("page", log))
    monkeypatch.setattr(A, "_decode_finish_kernel", _Recorder("finish", log))
    monkeypatch.setattr(RD, "_residual_assign_kernel", _Recorder("assign", log))
    monkeypatch.setattr(P, "compile_in_parallel",
                        lambda warmups, what="kernel": sum(1 for w in warmups if w() is None))
    return log


def test_precompile_decode_warms_exactly_what_serving_launches(recorders, monkeypatch):
    """Llama-3-8B's decode on an H100 (kv4 + 16-token residual, D 128, 8 kv heads, 132 SMs,
    max_num_seqs 1024): the variants warmed are the set launched by batches of 1..1024 rows
    with the builder's split counts, argument for argument; docs/STARTUP.md enumerated them
    from the H100's capture log as 7 page-kernel and 3 finish-kernel variants."""
    for env in ("MIXPREC_ATTN_MERGE", "MIXPREC_ATTN_TAIL", "MIXPREC_ATTN_TAIL_IN_SPLIT",
                "MIXPREC_ATTN_DECODE_CFG", "MIXPREC_ATTN_DECODE_MAXNREG"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(A, "_device_sms", lambda q: 132)
    monkeypatch.delenv("TRITON_INTERPRET")  # nothing runs; decode_maxnreg's GPU choice
    b = make_batch("kv4", torch.bfloat16, 128, 8, 4, [(1, 40), (1, 17)], residual_tokens=16)
    max_rows, sms = 1024, 132
    rows = A.decode_partials_rows(max_rows, 8, sms)
    part_o = torch.empty(rows, 32, 128, device=b.q.device)
    part_lse = torch.empty(rows, 32, device=b.q.device)
    counters = A.decode_merge_counters(max_rows, 8, b.q.device)
    args = (b.q, b.cache, b.layout, b.block_table, b.seq_lens, b.qsl, torch.empty_like(b.q),
            0.088)
    A.precompile_decode(*args, max_rows, part_o, part_lse, b.residual, None, None, counters)
    for n in range(1, max_rows + 1):
        A.decode_attention(*args, n, A.decode_splits(n, 8, sms, rows), part_o, part_lse,
                           b.residual, None, None, counters)
    warmed, launched = _variants(recorders["warm"]), _variants(recorders["launch"])
    assert warmed == launched
    assert len(recorders["warm"]) == len(warmed)  # each variant once
    names = [v[0] for v in warmed]
    assert (names.count("page"), names.count("finish")) == (7, 3)


def test_decode_splits_is_the_builders_count():
    """decode_splits halves the split count until the partials fit the buffer."""
    assert A.decode_splits(1, 8, 132, 10 ** 6) == A.decode_num_splits(1, 8, 132) == 32
    assert A.decode_splits(1, 8, 132, 33) == 32
    assert A.decode_splits(1, 8, 132, 32) == 16
    assert A.decode_splits(4, 8, 132, 0) == 1


def test_residual_assign_precompile_warms_every_tile(recorders):
    """Batches of 1..1024 rows with 2 window blocks a row select BLOCK_W 64, 256, 1024 and
    4096 (window_tile); each warmup has the launch's arguments but BLOCK_W."""
    d = R.ResidualDirectory(64, 40, 16, 16, torch.device(DEVICE), kernel=True)
    n = 3
    bt = torch.arange(n * 4, dtype=torch.int32, device=DEVICE).view(n, 4)
    seq = torch.tensor([5, 17, 33], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    sm = torch.tensor([4, 16 + 16, 2 * 64 + 32], dtype=torch.int64, device=DEVICE)
    scratch = torch.empty(4096 + 64, dtype=torch.int64, device=DEVICE)
    args = (bt, seq, qsl, sm, d.slot_of_block, d.block_of_slot, d.last_use, d.tags, d.step,
            scratch, 16, d.bpw)
    assert d.bpw == 2
    RD.precompile_residual_assign(*args, 1024)
    RD.residual_assign(*args)
    tiles = sorted(kw["BLOCK_W"] for _, _, kw in recorders["warm"])
    assert tiles == [64, 256, 1024, 4096]
    (_, l_args, l_kw), = recorders["launch"]
    for _, w_args, w_kw in recorders["warm"]:
        assert _signature(w_args) == _signature(l_args)
        assert {**w_kw, "BLOCK_W": 0} == {**l_kw, "BLOCK_W": 0}


def test_directory_precompiles_once_at_its_first_update(monkeypatch):
    """ResidualDirectory(max_rows=...) warms its variants before its first kernel update
    only, and not at all when MIXPREC_PRECOMPILE=0 or without max_rows."""
    calls = []
    monkeypatch.setattr(RD, "precompile_residual_assign", lambda *a: calls.append(a[-1]))
    monkeypatch.setattr(RD, "residual_assign", lambda *a: None)
    monkeypatch.setattr(P, "enabled", lambda: True)
    bt = torch.zeros(2, 4, dtype=torch.int32)
    seq, qsl = torch.ones(2, dtype=torch.int32), torch.arange(3, dtype=torch.int32)
    sm = torch.zeros(2, dtype=torch.int64)
    for max_rows, want in ((256, [256]), (0, [])):
        calls.clear()
        d = R.ResidualDirectory(16, 8, 16, 16, torch.device("cpu"), kernel=True,
                                max_rows=max_rows)
        for _ in range(3):
            d.assign(bt, seq, qsl, sm, 2)
        assert calls == want
    monkeypatch.setattr(P, "enabled", lambda: False)
    calls.clear()
    d = R.ResidualDirectory(16, 8, 16, 16, torch.device("cpu"), kernel=True, max_rows=256)
    d.assign(bt, seq, qsl, sm, 2)
    assert calls == []


def test_enabled_and_threads_read_the_environment(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(P.ENV_ON, raising=False)
    assert P.enabled()
    monkeypatch.setenv(P.ENV_ON, "0")
    assert not P.enabled()
    monkeypatch.setenv(P.ENV_ON, "yes")
    with pytest.raises(ValueError, match="MIXPREC_PRECOMPILE='yes'"):
        P.enabled()
    monkeypatch.setenv(P.ENV_ON, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not P.enabled()  # the interpreter compiles nothing
    monkeypatch.setenv(P.ENV_THREADS, "3")
    assert P.num_threads() == 3
    monkeypatch.setenv(P.ENV_THREADS, "0")
    with pytest.raises(ValueError, match="MIXPREC_PRECOMPILE_THREADS='0'"):
        P.num_threads()


def _async_job(barrier: threading.Barrier, done: list, key: str):
    """A warmup as Triton 3.6 runs one under AsyncCompileMode: it submits the compile."""
    from triton.runtime._async_compile import active_mode

    def compile_fn():
        barrier.wait()  # returns only when the other compile runs at the same time
        return key
    return lambda: active_mode.get().submit(key, compile_fn, done.append)


def test_compile_in_parallel_compiles_concurrently(monkeypatch):
    """Two compiles that each wait for the other finish only if they run at once; every
    compile is finalized before compile_in_parallel returns, and one thread deadlocks them
    into an error that is raised, not swallowed."""
    monkeypatch.setenv(P.ENV_THREADS, "2")
    done: list = []
    barrier = threading.Barrier(2, timeout=20)
    assert P.compile_in_parallel([_async_job(barrier, done, k) for k in ("a", "b")]) == 2
    assert sorted(done) == ["a", "b"]
    monkeypatch.setenv(P.ENV_THREADS, "1")
    barrier = threading.Barrier(2, timeout=0.5)
    with pytest.raises(threading.BrokenBarrierError):
        P.compile_in_parallel([_async_job(barrier, [], k) for k in ("c", "d")])
    assert P.compile_in_parallel([]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_precompiled_decode_launches_compile_nothing_gpu():
    """On the GPU: after precompile_decode and precompile_residual_assign for 1..64 rows,
    decode launches and directory updates of 1, 2, 3, 8, 17, 40 and 64 rows add no kernel
    to Triton's caches (the warmed keys are serving's), and decode is still exact."""
    from attn_helpers import tolerance
    torch.manual_seed(11)
    max_rows = 64
    rows = [(1, 30 + 37 * i) for i in range(max_rows)]
    b = make_batch("kv4", torch.bfloat16, 128, 8, 4, rows, residual_tokens=16)
    parts = A.decode_partials_rows(max_rows, 8)
    part_o = torch.empty(parts, 32, 128, device="cuda")
    part_lse = torch.empty(parts, 32, device="cuda")
    counters = A.decode_merge_counters(max_rows, 8, torch.device("cuda"))
    out = torch.full_like(b.q, float("nan"))
    args = (b.q, b.cache, b.layout, b.block_table, b.seq_lens, b.qsl, out, 128 ** -0.5)
    A.precompile_decode(*args, max_rows, part_o, part_lse, b.residual, None, None, counters)
    dev = torch.cuda.current_device()
    size = lambda k: len(k.device_caches[dev][0])  # noqa: E731
    kernels = (A._paged_attn_kernel, A._decode_finish_kernel)
    before = [size(k) for k in kernels]
    sms = A._num_sms(dev)
    for n in (1, 2, 3, 8, 17, 40, 64):
        A.decode_attention(b.q[:n], b.cache, b.layout, b.block_table[:n], b.seq_lens[:n],
                           b.qsl[:n + 1], out, 128 ** -0.5, n, A.decode_splits(n, 8, sms, parts),
                           part_o, part_lse, b.residual, None, None, counters)
    assert [size(k) for k in kernels] == before
    torch.testing.assert_close(out.double().cpu(), b.reference(128 ** -0.5),
                               **tolerance(torch.bfloat16))

    d = R.ResidualDirectory(b.cache.shape[0], max_rows * 2 + 16, 16, 16, torch.device("cuda"))
    sm = torch.arange(max_rows, dtype=torch.int64, device="cuda")
    scratch = torch.empty(RD.scratch_size(max_rows * d.bpw, d.num_slots), dtype=torch.int64,
                          device="cuda")
    dargs = (b.block_table, b.seq_lens, b.qsl, sm, d.slot_of_block, d.block_of_slot,
             d.last_use, d.tags, d.step, scratch, 16, d.bpw)
    RD.precompile_residual_assign(*dargs, max_rows)
    before = size(RD._residual_assign_kernel)
    for n in (1, 2, 3, 8, 17, 40, 64):
        RD.residual_assign(b.block_table[:n], b.seq_lens[:n], b.qsl[:n + 1], sm[:n], *dargs[4:])
    assert size(RD._residual_assign_kernel) == before
