"""The csrc GEMM planner (`mixprec_C::w4a8_plan`, the choice w4a8_gemm makes with kernel_id=-1
and splits=0) on the CPU: it is host code, so these tests run wherever the extension is built.

The wgmma tile x split choice is checked against measured times: the 144-point sweep of
2026-11-23 on the H100 (`bash scripts/gpu_check.sh sweep_splits`, kernels 4-6) and the
105-point one of 2026-11-28 (`bash scripts/gpu_check.sh small_tiles_sweep`, kernels 4-8), kept in
benchmarks/results;
the decode (mma.sync, M <= 32) choice against the decode sweep of 2026-11-27
(`bash scripts/gpu_check.sh decode_sweep`).
"""
import json
import math
import os

import pytest
import torch

from vllm_mixprec.kernels import cuda

SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "2026-11-23-h100",
                     "session4", "splits_sweep.json")
S23 = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "2026-11-27-s23")
DECODE_SWEEP = os.path.join(S23, "decode-sweep", "decode_sweep.json")
TILES_SWEEP = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results", "2026-11-28-s27",
                           "h100x2-small-tiles", "tiles_sweep.json")
# The run after it (kernels 0 and 1 forced, one split each, on 5 shapes incl. 28672 x 8192)
DECODE_AUTO = os.path.join(S23, "decode-plan", "decode_auto.json")
H100_SMS = 132
LLAMA_SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192),
                (8192, 28672))  # K x N
STREAM_K_DEFAULT = 1  # set_launch_options' gemm_stream_k: on since session 33
DECODE_U8_DEFAULT = 0  # set_launch_options' decode_u8: off until timed on a GPU (session 35)


@pytest.fixture(autouse=True)
def _need_ops():
    if not cuda.available():
        pytest.skip(f"csrc ops not built: {cuda.load_error()}")


@pytest.fixture(autouse=True)
def _classic_planner(_need_ops):
    """The sweeps below timed the tiles x splits grid only: check that choice with stream-K off."""
    saved = cuda.set_launch_options()
    cuda.set_launch_options(gemm_stream_k=0)
    yield saved
    cuda.set_launch_options(**saved)


def plan(m, n, k, g=64, sms=H100_SMS, kernel=-1, splits=0, wgmma=True):
    return tuple(torch.ops.mixprec_C.w4a8_plan(m, n, k, g, sms, kernel, splits, wgmma))


def _sweep():
    with open(SWEEP) as f:
        return json.load(f)


def _measured(row):
    return {(k, s): row[f"gemm_k{k}_s{s}_us"] for k in cuda.WGMMA_KERNELS for s in (1, 2, 4)
            if f"gemm_k{k}_s{s}_us" in row}


def _tiles_sweep():
    with open(TILES_SWEEP) as f:
        return {(r["K"], r["N"], r["M"]): r for r in json.load(f)}


def test_sweep_choice_is_near_the_measured_best():
    """Every shape of the 2023 sweep: the pick is within 20% of the best of the 9 measured (tile,
    split) pairs, and all picks together within 3%. The old SM-fill rule lost 2.8x at 4096 x 6144,
    M = 256. A pick of kernel 7 or 8 (not in that sweep) is timed by the 2026-11-28 sweep of the
    same shape (group 128, not 64) when it has one; a pick no sweep timed (a split count other than
    1, 2, 4, or a shape the second sweep did not reach) by the first sweep's auto column when the
    old rule made the same pick. At most three picks may go untimed."""
    picked = best = 0.0
    untimed = []
    rows = _sweep()
    tiles = _tiles_sweep()
    assert len(rows) == 16
    for row in rows:
        times = _measured(row)
        pick = plan(row["M"], row["N"], row["K"])
        got = times.get(pick, row["gemm_k-1_us"] if pick == _old_rule(row) else None)
        second = tiles.get((row["K"], row["N"], row["M"]))
        if got is None and second is not None and pick[0] in (7, 8):
            got = _measured(second).get(pick)
            times = {**times, **{p: t for p, t in _measured(second).items() if p[0] in (7, 8)}}
        if got is None:
            untimed.append((row["K"], row["N"], row["M"], pick))
            continue
        fastest = min(times.values())
        assert got <= 1.2 * fastest, (row["K"], row["N"], row["M"], pick, got, fastest)
        picked += got
        best += fastest
    assert len(untimed) <= 3, untimed
    assert picked <= 1.03 * best, (picked, best)


def test_small_tile_sweep_choice_is_the_measured_best():
    """The 2026-11-28 sweep (kernels 4-8 x 1, 2, 4 splits, where the 128-channel tiles 7 and 8
    fill the SMs that 4 and 5 leave idle): every pick it timed is within 5% of the best of its 15
    pairs (at 4096 x 4096, M = 64, the auto kernel took 21.6 us and kernel 7 with 4 splits 14.2)."""
    timed = 0
    for (k, n, m), row in _tiles_sweep().items():
        times = _measured(row)
        assert len(times) == 15, (k, n, m)
        pick = plan(m, n, k, g=row["G"])
        if pick not in times:
            continue
        timed += 1
        assert times[pick] <= 1.05 * min(times.values()), ((k, n, m), pick, times[pick], min(times.values()))
    assert timed >= 6


def _old_rule(row):
    """The session-3 rule the sweep's `gemm_k-1` column measured (kernel 5 up to M = 64, else 4;
    fewest splits that fill 80% of the SM slots)."""
    m, n, k = row["M"], row["N"], row["K"]
    kern = 5 if m <= 64 else 4
    ctas = math.ceil(m / (64 if kern == 5 else 128)) * math.ceil(n / 256)
    stages = math.ceil(k / 128)
    best, splits = -1.0, 1
    for s in range(1, max(1, min(16, stages // 4)) + 1):
        fill = ctas * s / (math.ceil(ctas * s / H100_SMS) * H100_SMS)
        if fill > best + 1e-9:
            best, splits = fill, s
        if fill >= 0.8:
            break
    return kern, splits


@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (8192, 57344), (28672, 8192), (14336, 4096)])
@pytest.mark.parametrize("m", [64, 128, 256, 512, 1024, 4096, 8192])
def test_choice_is_a_valid_plan(m, n, k):
    kern, splits = plan(m, n, k)
    assert kern in (4, 5, 7, 8), "6 never won a sweep"
    stages = k // 128
    assert 1 <= splits <= max(1, stages // 4), "at least 4 K stages (512 k) per split"
    if m >= 1024:
        assert splits == 1 and kern == 4, "large M fills the GPU without split-K partials"


def test_explicit_kernel_and_splits_are_kept():
    assert plan(256, 4096, 4096, kernel=6)[0] == 6
    assert plan(256, 4096, 4096, kernel=7)[0] == 7 and plan(256, 4096, 4096, kernel=8)[0] == 8
    assert plan(256, 4096, 4096, kernel=4, splits=3) == (4, 3)
    assert plan(64, 4096, 512, kernel=5, splits=64) == (5, 4), "clamped to the 4 K stages there are"
    assert plan(1024, 4096, 1536, kernel=5, splits=5) == (5, 4), "no empty split: 12 stages in 4 x 3"


def _decode_times(row):
    """(kernel, splits) -> us of one decode-sweep row (kernels 0 and 1, forced splits)."""
    out = {}
    for key, us in row.items():
        if key.startswith("gemm_k") and "_s" in key:
            kern, splits = key[len("gemm_k"):-len("_us")].split("_s")
            out[(int(kern), int(splits))] = us
    return out


def _decode_rows():
    """(row, {(kernel, splits): us}) of both H100 decode runs of 2026-11-27."""
    with open(DECODE_SWEEP) as f:
        sweep = json.load(f)
    with open(DECODE_AUTO) as f:
        auto = json.load(f)
    assert len(sweep) >= 14 and len(auto) == 10
    out = [(row, _decode_times(row)) for row in sweep]
    assert all(len(times) >= 14 for _, times in out)
    # forced kernels 0 and 1 with splits left to the planner, which gave one on every row there
    out += [(row, {(0, 1): row["gemm_k0_us"], (1, 1): row["gemm_k1_us"]}) for row in auto]
    return out


def test_decode_choice_is_near_the_measured_best():
    """Every measured decode row (6 Llama shapes x M = 1, 16, 32 on the H100): the pick is
    never split, within 5% of the best measured (kernel, splits), and all picks together within
    2%. The old rule (32 channels from 2 CTAs per SM, splits to fill 2 CTAs per SM) picked
    4096x4096 at M = 1 with 2 splits: 8.1 us against 5.3; and 16 channels at 28672 x 8192,
    M = 1: 47.5 us against 41.5."""
    picked = best = 0.0
    for row, times in _decode_rows():
        pick = plan(row["M"], row["N"], row["K"], wgmma=False)
        assert pick[1] == 1, (row["K"], row["N"], row["M"], pick)
        fastest = min(times.values())
        assert times[pick] <= 1.05 * fastest, (row["K"], row["N"], row["M"], pick, times[pick], fastest)
        picked += times[pick]
        best += fastest
    assert picked <= 1.02 * best, (picked, best)


@pytest.mark.parametrize("n,sms,splits", [(4096, 132, 1), (512, 132, 3), (1024, 132, 2), (4096, 108, 1)])
def test_decode_splits_only_to_reach_half_the_sms(n, sms, splits):
    """16-channel decode CTAs = N / 16; K is split only while they cover under half the SMs."""
    assert plan(1, n, 8192, sms=sms, wgmma=False) == (0, splits)


def test_mma_planner_still_answers():
    k, s = plan(1, 28672, 8192, wgmma=False)
    assert 0 <= k <= 3 and s >= 1


@pytest.mark.parametrize("args,match", [
    (dict(m=64, n=100, k=4096), "multiple of 16"),
    (dict(m=64, n=4096, k=100), "multiple of 64"),
    (dict(m=64, n=4096, k=4096, g=96), "group size"),
    (dict(m=64, n=4096, k=4096, kernel=3), "wgmma kernels are 4 to 8"),
    (dict(m=64, n=4096, k=4096, kernel=9), "wgmma kernels are 4 to 8"),
    (dict(m=0, n=4096, k=4096), "positive"),
])
def test_bad_problems_raise(args, match):
    with pytest.raises(RuntimeError, match=match):
        plan(**args)


def test_launch_options_round_trip_and_errors(_classic_planner):
    """set_launch_options (host state, no GPU needed): -1 keeps a value; a bad value names the fields."""
    assert _classic_planner == {"gemm_pdl": 1, "act_quant_one_pass": 1, "gemm_stream_k": STREAM_K_DEFAULT,
                                "decode_u8": DECODE_U8_DEFAULT}
    saved = cuda.set_launch_options()
    try:
        assert set(saved) == set(cuda.LAUNCH_OPTIONS)
        want = dict(saved)
        for option in ("gemm_pdl", "act_quant_one_pass", "gemm_stream_k", "decode_u8", "gemm_pdl"):
            want[option] = 1 - want[option]
            assert cuda.set_launch_options(**{option: want[option]}) == want, option
        with pytest.raises(RuntimeError, match="gemm_pdl, act_quant_one_pass, gemm_stream_k and decode_u8 take "
                                               "0, 1 or -1"):
            cuda.set_launch_options(gemm_pdl=2)
        with pytest.raises(RuntimeError, match="got -1, -1, 5, -1"):
            cuda.set_launch_options(gemm_stream_k=5)
        with pytest.raises(RuntimeError, match="got -1, -1, -1, 3"):
            cuda.set_launch_options(decode_u8=3)
    finally:
        cuda.set_launch_options(**saved)
    assert cuda.set_launch_options() == saved


@pytest.fixture
def stream_k_option():
    saved = cuda.set_launch_options()
    yield lambda on: cuda.set_launch_options(gemm_stream_k=on)
    cuda.set_launch_options(**saved)


def test_stream_k_forced_and_refused():
    assert plan(1024, 6144, 4096, kernel=4, splits=-1) == (4, -1)
    assert plan(256, 4096, 4096, splits=-1)[1] == -1, "auto kernel, stream-K launch"
    with pytest.raises(RuntimeError, match="stream-K"):
        plan(1, 4096, 4096, splits=-1, wgmma=False)
    with pytest.raises(RuntimeError, match="splits must be -1"):
        plan(256, 4096, 4096, splits=-2)


def test_stream_k_only_chosen_when_allowed(stream_k_option):
    """With the option off the planner never picks stream-K; on, it may, and a forced split
    count still wins over it."""
    stream_k_option(0)
    shapes = [(k, n) for k, n in LLAMA_SHAPES]
    assert all(plan(m, n, k)[1] >= 1 for m in (64, 256, 1024, 4096) for k, n in shapes)
    stream_k_option(1)
    picks = {(m, k, n): plan(m, n, k) for m in (64, 256, 1024, 4096) for k, n in shapes}
    assert all(s >= 1 or s == -1 for _, s in picks.values())
    assert plan(1024, 6144, 4096, kernel=4, splits=2) == (4, 2)


RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")


def _stream_k_rows():
    """Every auto-plan row timed with stream-K off and on, on one H200 (132 SMs, group 128):
    session 33's sweep at M = 256 and 1024 (each wgmma kernel's stream-K time too) and its M = 64
    rows, and session 34's M = 128, 384 and 768 rows plus the 70B shapes at M = 64
    (`bash scripts/gpu_check.sh stream_k_verify`)."""
    rows = []
    for name in ("2026-11-28-s33/stream_k_sweep.json", "2026-11-28-s33/stream_k_auto_m64.json",
                 "2026-11-28-s34/stream_k_auto.json"):
        with open(os.path.join(RESULTS, name)) as f:
            rows += json.load(f)
    return rows


def test_stream_k_picks_never_lose_on_the_measured_rows(stream_k_option):
    """With stream-K allowed (the default), the pick on each of the 42 rows is one the row timed,
    within 2 % of the classic planner's pick, and 6 % faster or more on at least 10 of them
    (8192 x 10240 at M = 256: 1.21x; 4096 x 6144 at M = 768: 1.41x). Session 33's estimate and
    5 % edge picked stream-K on 4096 x 6144 at M = 128, 11.5 % slower; the estimate was refitted
    on all of these rows, so this test checks the fit, not an out-of-sample prediction."""
    stream_k_option(1)
    rows = _stream_k_rows()
    assert len(rows) == 42
    gains = {}
    for row in rows:
        key = (row["K"], row["N"], row["M"])
        pick = plan(row["M"], row["N"], row["K"], g=row["G"])
        timed = {tuple(row["plan_auto_sk0"]): row["gemm_auto_sk0_us"],
                 tuple(row["plan_auto_sk1"]): row["gemm_auto_sk1_us"]}
        timed.update({(k, -1): row[f"gemm_k{k}_sk_us"] for k in cuda.WGMMA_KERNELS if f"gemm_k{k}_sk_us" in row})
        assert pick in timed, (key, pick, "a pick the rows did not time")
        assert timed[pick] <= 1.02 * row["gemm_auto_sk0_us"], (key, pick, timed[pick], row["gemm_auto_sk0_us"])
        gains[key] = row["gemm_auto_sk0_us"] / timed[pick]
    assert sum(g >= 1.06 for g in gains.values()) >= 10, gains
    assert gains[(8192, 10240, 256)] >= 1.15, gains
    assert gains[(4096, 6144, 768)] >= 1.3, gains


def test_describe_plans_names_the_launch(monkeypatch, stream_k_option):
    """The linear method's debug log of the csrc plans (kernels.prepare_linear) reads the same
    planner the op runs: stream-K where the session-33 sweep measured it faster."""
    stream_k_option(1)
    monkeypatch.setattr(cuda, "auto_gemm_kernel_family",
                        lambda m, device=None: "wgmma" if m >= 64 else ("decode" if m <= 32 else "mma"))
    text = cuda.describe_plans(6144, 4096, 128, ms=(16, 1024, 4096), num_sms=H100_SMS)
    assert text.startswith("M=16 decode k"), text
    assert "M=1024 wgmma k4 stream-K" in text and "M=4096 wgmma k4 1 split" in text, text
    stream_k_option(0)
    assert "stream-K" not in cuda.describe_plans(6144, 4096, 128, ms=(1024,), num_sms=H100_SMS)
