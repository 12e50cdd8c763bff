"""The residual slot directory under a simulated scheduler (pure torch, no kernels).

A toy scheduler runs requests through chunked prefill and decode, aborts and preempts
them (their blocks go back to a free list and are reused), and shares full prefix blocks
between requests, as vLLM's block manager does. Every write is mirrored into a model of
the pool (reference.store_kv_residual on write ids). Checked after every step:
  * the invariant: a valid tag always points at the latest write of that position;
  * coverage: with enough slots, every scheduled row has its whole window in 16 bits
    (except positions of prefix-shared blocks written before they entered a window).
"""
from __future__ import annotations

import os

import random

import pytest
import torch

from vllm_mixprec import reference as ref
from vllm_mixprec.attention_backend import residual as R

B = 16


class ToyScheduler:
    def __init__(self, num_blocks: int, directory: R.ResidualDirectory, seed: int,
                 width: int | None = None):
        self.width = width  # block-table columns; None: the longest row's
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)
        self.d = directory
        self.reqs: dict[int, dict] = {}
        self.refs: dict[int, int] = {}  # block reference counts (prefix sharing)
        self.next_id = 0
        self.write_id = 0
        self.latest = {}  # (blk, off) -> id of the latest write
        slots = directory.num_slots
        self.pool = torch.full((slots * B, 1, 1), -1.0, dtype=torch.float64)
        self.shared_ok: set[tuple[int, int]] = set()  # positions allowed to miss coverage

    def add(self, prompt: int, share_from: int | None = None):
        rid = self.next_id
        self.next_id += 1
        blocks, done = [], 0
        if share_from is not None and share_from in self.reqs:
            src = self.reqs[share_from]
            full = min(src["done"], prompt - 1) // B
            blocks = src["blocks"][:full]
            done = full * B
            for blk in blocks:
                self.refs[blk] += 1
            for j in range(full):  # tokens written by another request, maybe never windowed
                self.shared_ok |= {(blocks[j], o) for o in range(B)}
        self.reqs[rid] = {"blocks": list(blocks), "done": done, "prompt": prompt}
        return rid

    def release(self, rid: int):
        for blk in self.reqs.pop(rid)["blocks"]:
            self.refs[blk] -= 1
            if self.refs[blk] == 0:
                self.free.append(blk)

    def step(self, budget: int, check_coverage: bool):
        rows, slot_mapping, qlens, lens = [], [], [], []
        for rid, r in list(self.reqs.items()):
            if budget <= 0:
                break
            want = r["prompt"] - r["done"] if r["done"] < r["prompt"] else 1
            q = min(want, budget, self.rng.choice([1, 7, 33, 100]) if want > 1 else 1)
            end = r["done"] + q
            while len(r["blocks"]) * B < end:
                if not self.free:
                    return None
                r["blocks"].append(self.free.pop())
                self.refs[r["blocks"][-1]] = 1
            pos = torch.arange(r["done"], end)
            blk = torch.tensor(r["blocks"])[pos // B]
            slot_mapping.append(blk * B + pos % B)
            rows.append(rid)
            qlens.append(q)
            lens.append(end)
            budget -= q
        if not rows:
            return None
        width = self.width or max(len(self.reqs[rid]["blocks"]) for rid in rows)
        bt = torch.full((len(rows), width), 0, dtype=torch.int32)
        for i, rid in enumerate(rows):
            bl = self.reqs[rid]["blocks"]
            bt[i, :len(bl)] = torch.tensor(bl, dtype=torch.int32)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        sm = torch.cat(slot_mapping)
        sm = torch.cat([sm, torch.full((3,), -1)])  # CUDA-graph style padding
        self.d.assign(bt, seq_lens, qsl, sm, len(rows))
        # Every layer's writer: pages (modelled by `latest`) and the pool mirror.
        ids = torch.arange(self.write_id, self.write_id + sm.shape[0], dtype=torch.float64)
        self.write_id += sm.shape[0]
        for s, i in zip(sm.tolist(), ids.tolist()):
            if s >= 0:
                self.latest[(s // B, s % B)] = i
        vals = ids.view(-1, 1, 1)
        ref.store_kv_residual(vals, vals, self.pool, self.pool.clone(), sm,
                              self.d.slot_of_block, B)
        for rid, q, L in zip(rows, qlens, lens):
            self.reqs[rid]["done"] = L
        self.check_invariant()
        if check_coverage:
            self.check_coverage(rows, lens)
        return rows

    def check_invariant(self):
        sob, tags = self.d.slot_of_block, self.d.tags
        for p in range(self.d.num_slots):
            for off in range(B):
                blk = int(tags[p, off])
                if blk >= 0 and int(sob[blk]) == p:
                    assert self.pool[p * B + off, 0, 0].item() == self.latest[(blk, off)], \
                        f"stale residual at slot {p} offset {off} (block {blk})"

    def check_coverage(self, rows, lens):
        r, sob, tags = self.d.tokens, self.d.slot_of_block, self.d.tags
        for rid, L in zip(rows, lens):
            bl = self.reqs[rid]["blocks"]
            for pos in range(max(L - r, 0), L):
                blk, off = bl[pos // B], pos % B
                p = int(sob[blk])
                ok = p >= 0 and int(tags[p, off]) == blk
                assert ok or (blk, off) in self.shared_ok, f"request {rid} lost position {pos}"


@pytest.mark.parametrize("tokens", [16, 5, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_directory_invariant_and_coverage(tokens, seed):
    """Slots enough for every row: the full window is always 16-bit (no eviction loss)."""
    max_seqs, nblocks = 6, 96
    d = R.ResidualDirectory(nblocks, max_seqs * R.window_blocks(tokens, B) + 2, B, tokens,
                            torch.device("cpu"))
    sched = ToyScheduler(nblocks, d, seed)
    rng = random.Random(seed)
    for it in range(60):
        while len(sched.reqs) < max_seqs and rng.random() < 0.5:
            share = rng.choice(list(sched.reqs)) if sched.reqs and rng.random() < 0.3 else None
            sched.add(rng.randint(1, 120), share)
        for rid in list(sched.reqs):
            r = sched.reqs[rid]
            if r["done"] > r["prompt"] + 20 or rng.random() < 0.03:  # finish / abort
                sched.release(rid)
        sched.step(budget=10_000, check_coverage=True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_directory_invariant_under_pressure(seed):
    """Too few slots, preemption (blocks freed and later recomputed), partial scheduling:
    windows may be lost, but a valid tag never points at stale data."""
    max_seqs, nblocks, tokens = 8, 80, 16
    d = R.ResidualDirectory(nblocks, 5, B, tokens, torch.device("cpu"))
    sched = ToyScheduler(nblocks, d, seed)
    rng = random.Random(100 + seed)
    for it in range(80):
        while len(sched.reqs) < max_seqs and rng.random() < 0.6:
            share = rng.choice(list(sched.reqs)) if sched.reqs and rng.random() < 0.3 else None
            sched.add(rng.randint(1, 90), share)
        for rid in list(sched.reqs):
            r = sched.reqs[rid]
            if rng.random() < 0.05:  # preempt: free everything, recompute from scratch
                prompt = r["done"]
                sched.release(rid)
                if prompt:
                    sched.add(prompt)
            elif r["done"] > r["prompt"] + 10:
                sched.release(rid)
        if sched.step(budget=rng.choice([40, 200, 10_000]), check_coverage=False) is None:
            for rid in list(sched.reqs)[: len(sched.reqs) // 2]:
                sched.release(rid)


def test_directory_update_lifts_no_python_scalar():
    """No `t[idx] = scalar` in a step: torch turns the scalar into a CPU tensor
    (aten.lift_fresh) and copies it to the GPU, a pageable copy that synchronises the
    stream, so the host could not prepare a step while the GPU runs the previous one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    d = R.ResidualDirectory(40, 3, B, 16, torch.device("cpu"))
    sched = ToyScheduler(40, d, seed=0)
    for _ in range(6):
        sched.add(30)
    ops, assign = Ops(), d.assign

    def recorded(*args):
        with ops:
            assign(*args)

    d.assign = recorded  # eviction (3 slots, 6 rows), tagging and the sinks all run
    sched.step(budget=10_000, check_coverage=False)
    assert "index_fill_.int_Scalar" in ops.names, "the step did not reach the eviction path"
    assert not [n for n in ops.names if n.startswith("lift_fresh")], ops.names


def test_window_blocks_and_slots():
    assert R.window_blocks(0, 16) == 0
    assert R.window_blocks(1, 16) == 1
    assert R.window_blocks(16, 16) == 2
    assert R.window_blocks(17, 16) == 2
    assert R.window_blocks(33, 16) == 3


def test_residual_tokens_env(monkeypatch):
    monkeypatch.setenv(R.ENV_TOKENS, "0")
    assert R.residual_tokens(None, 16) == 0
    monkeypatch.setenv(R.ENV_TOKENS, "999")
    with pytest.raises(ValueError, match=R.ENV_TOKENS):
        R.residual_tokens(None, 16)
    monkeypatch.delenv(R.ENV_TOKENS)
    assert R.residual_tokens(None, 32) == 32


def test_graphs_are_on_for_cuda_unless_the_env_says_0(monkeypatch):
    monkeypatch.delenv(R.ENV_GRAPHS, raising=False)
    assert R.graphs_by_default(torch.device("cuda"))
    assert not R.graphs_by_default(torch.device("cpu"))
    assert R.ResidualDirectory(8, 2, B, 16, torch.device("cpu")).graphs is None
    monkeypatch.setenv(R.ENV_GRAPHS, "0")
    assert not R.graphs_by_default(torch.device("cuda"))


def test_kernel_is_on_for_cuda_unless_the_env_says_0(monkeypatch):
    monkeypatch.delenv(R.ENV_KERNEL, raising=False)
    assert R.kernel_by_default(torch.device("cuda"))
    assert not R.kernel_by_default(torch.device("cpu"))
    assert not R.ResidualDirectory(8, 2, B, 16, torch.device("cpu")).kernel
    monkeypatch.setenv(R.ENV_KERNEL, "0")
    assert not R.kernel_by_default(torch.device("cuda"))


class _Twin:
    """Two directories fed the same steps: `ref`, the eager torch update, and `test`, built
    with test_kw (CUDA graphs, or the Triton kernel). Their tables must match after every
    step. Exposes CPU copies of the tested one's tables to ToyScheduler's checks."""
    TABLES = ("slot_of_block", "block_of_slot", "last_use", "tags", "step")

    def __init__(self, *args, device: str, **test_kw):
        self.dev = torch.device(device)
        self.ref = R.ResidualDirectory(*args, self.dev, graphs=False, kernel=False)
        self.test = R.ResidualDirectory(*args, self.dev, **test_kw)
        self.num_slots, self.tokens = self.ref.num_slots, self.ref.tokens
        self.decode_steps = 0
        self._sync()

    def _sync(self):
        for name in self.TABLES:
            want, got = getattr(self.ref, name), getattr(self.test, name)
            assert torch.equal(want, got), f"{name} differs from the eager update's"
            setattr(self, name, got.cpu())

    def assign(self, bt, seq_lens, qsl, sm, n):
        decode = bool((qsl[1:n + 1] - qsl[:n]).max() <= 1)
        self.decode_steps += decode
        args = [t.to(self.dev) for t in (bt, seq_lens, qsl, sm)]
        self.ref.assign(*args, n, decode_only=decode)
        self.test.assign(*args, n, decode_only=decode)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        self._sync()


def _run_twin(twin: _Twin, seed: int, steps: int, max_seqs: int = 6,
              arrival: float = 0.1) -> None:
    """Requests arrive, prefill in chunks and decode for up to 60 tokens. With fewer slots
    than max_seqs rows of 2 window blocks need, slots are evicted, and with few enough some
    windows get none."""
    sched = ToyScheduler(200, twin, seed, width=16)
    rng = random.Random(seed)
    for it in range(steps):
        while len(sched.reqs) < max_seqs and rng.random() < arrival:
            sched.add(rng.randint(1, 40))
        for rid in list(sched.reqs):
            if sched.reqs[rid]["done"] > sched.reqs[rid]["prompt"] + 60:
                sched.release(rid)
        sched.step(budget=10_000, check_coverage=False)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_graphed_update_matches_eager(seed):
    """Decode steps replayed from CUDA graphs (fixed block-table width, as vLLM's runner
    gives) update the directory exactly as the eager ops do, under eviction pressure."""
    twin = _Twin(200, 9, B, 16, device="cuda", graphs=True, kernel=False)
    _run_twin(twin, seed, 120)
    assert twin.decode_steps >= 40, twin.decode_steps
    assert twin.test.graphs.replays >= 20, twin.test.graphs.replays


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors need the Triton interpreter; the _gpu twin runs on CUDA")
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_update_matches_reference(seed):
    """The one-program Triton update (interpreter) leaves every table exactly as the
    torch ops do, prefill and decode steps, under eviction pressure."""
    for slots, max_seqs in ((9, 6), (5, 8)):
        twin = _Twin(200, slots, B, 16, device="cpu", kernel=True)
        _run_twin(twin, seed, 60, max_seqs, arrival=0.3)
        assert twin.test.kernel and twin.decode_steps >= 10, twin.decode_steps


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_update_matches_reference_gpu(seed):
    for slots, max_seqs in ((9, 6), (5, 8)):
        twin = _Twin(200, slots, B, 16, device="cuda", kernel=True)
        _run_twin(twin, seed, 120, max_seqs, arrival=0.3)


def test_step_graphs_replay_static_copies_of_each_call(monkeypatch):
    """StepGraphs' bookkeeping on the CPU (a fake graph replays fn over the views it was
    captured with): each call's inputs reach fn, a shape's first call is eager, buffers grow
    to a power of two and growing re-captures."""
    seen = []
    sg = R.StepGraphs(lambda *t: seen.append([x.clone() for x in t]))

    class FakeGraph:
        def __init__(self, views):
            self.views = views

        def replay(self):
            sg.fn(*self.views)

    captured = []
    monkeypatch.setattr(sg, "_capture", lambda views: captured.append(views) or FakeGraph(views))
    calls = [(torch.arange(3), torch.rand(3, 2)), (torch.arange(3) + 10, torch.rand(3, 2)),
             (torch.arange(3) + 20, torch.rand(3, 2)), (torch.arange(5), torch.rand(5, 2)),
             (torch.arange(5) + 1, torch.rand(5, 2)), (torch.arange(3) + 30, torch.rand(3, 2))]
    for args in calls:
        sg.run(*args)
    for got, args in zip(seen, calls):
        assert all(torch.equal(g, a) for g, a in zip(got, args))
    # eager: calls 0 and 3; captures: 1 (3 rows), 4 (5 rows: buffers 4 -> 8), 5 (re-capture)
    assert len(captured) == 3 and sg.replays == 4
    assert [s.shape[0] for s in sg.static] == [8, 8]
    assert captured[-1][0].data_ptr() == sg.static[0].data_ptr()


def test_kernel_compiles_a_handful_of_variants():
    """Every constexpr of the directory kernel is fixed per directory except BLOCK_W, which
    takes a power of 4 (a server's batch sizes each compiled a variant, seconds apiece)."""
    from vllm_mixprec.kernels.triton import residual_directory as RD
    tiles = {RD.window_tile(n) for n in range(0, 4097)}
    assert tiles == {64, 256, 1024, 4096}
    assert all(RD.window_tile(n) >= n for n in range(0, 4097))
    assert RD.scratch_size(300, 20) == 1024 + 32
