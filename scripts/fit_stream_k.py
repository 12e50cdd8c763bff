"""Refit the wgmma planner's stream-K estimate to the recorded stream-K times (CPU only).

  python scripts/fit_stream_k.py            # the fit, its error, the edge scan, the picks it changes

The planner (csrc/gemm/sm90/w4a8_gemm_wgmma.cu, w4a8_wgmma_make_plan) weighs each kernel's classic
launches (wgmma_estimate_us) against its stream-K launch (wgmma_sk_estimate_us / kStreamKEdge).
This file mirrors both estimates in Python, so that the constants can be refitted from the JSON
rows that benchmarks/results keeps (`bench_w4a8_cuda.py --stream-k-sweep` and the `stream_k_*`
stages of scripts/gpu_check.sh). tests/kernels/test_gemm_plan.py checks that the mirror picks as
the C++ planner does and that this fit reproduces the C++ constants, so neither drifts alone.

The fit (csrc/gemm/NOTES.md, "Stream-K"): each stream-K time is divided by its kernel's mean
measured / estimated ratio over the classic launches of the same rows, so that it is in the
classic estimate's units, as the planner compares them. Then, weighted by 1 / time, a linear
least-squares fit of: the data-parallel waves (as classic ones, times one scale), a stream-K
stage at a per-kernel scale of the classic stage, a fixed cost per launch, a cost per further
segment, and the finisher's sum per piece and 1024 tile elements.
"""
import argparse
import json
import os

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
# Every stream-K time on record, all on one H200 (132 SMs), group 128. Sessions 33-34 used the
# kernels of that time; session 42 the TMA-weight kernels of session 40.
SOURCES = ("2026-11-28-s33/stream_k_sweep.json", "2026-11-28-s33/stream_k_auto_m64.json",
           "2026-11-28-s34/stream_k_auto.json", "2026-12-01-s42/sk_sweep/sk_sweep.json")
AUTO_KERNELS = (4, 5, 7, 8)
SMS = 132

# Mirrors of the C++ constants (csrc/gemm/sm90/w4a8_gemm_wgmma.cu): m64 blocks per consumer
# warpgroup, tokens per CTA, the classic stage time (cfg_of).
SHAPES = {4: (2, 128, 0.912), 5: (2, 64, 0.615), 7: (1, 64, 0.48), 8: (1, 128, 0.65)}
WAVE_US = 2.89
# The fitted stream-K constants, as in wgmma_sk_estimate_us and cfg_of's sk_stage_scale.
SK = {"stage_scale": {4: 1.11, 5: 1.066, 7: 1.036, 8: 1.032}, "launch_us": 5.91, "segment_us": 1.82,
      "sum_us_per_kelem": 0.055, "dp_wave_scale": 0.98}
EDGE = 0.93  # kStreamKEdge


def cdiv(a, b):
    return -(-a // b)


def n_stages_of(k):
    return cdiv(k // 64, 2)


def tile_elems(kernel):
    blocks, tok, _ = SHAPES[kernel]
    return 16 * 8 * blocks * tok


def tiles_of(kernel, m, n):
    blocks, tok, _ = SHAPES[kernel]
    return cdiv(m, tok) * cdiv(n // 16, 8 * blocks)


def classic_us(kernel, splits, m, n, k, sms=SMS):
    """wgmma_estimate_us."""
    stage_us = SHAPES[kernel][2]
    ns = n_stages_of(k)
    us = cdiv(tiles_of(kernel, m, n) * splits, sms) * (cdiv(ns, splits) * stage_us + WAVE_US)
    if splits > 1:
        us += 1.0 + 0.1 * splits * tile_elems(kernel) / 1024 + 2.0 * splits * m * n * 4 / 2.56e6
    return us


def dp_tiles_of(tiles, ctas):
    return (tiles // ctas - 1) * ctas if tiles >= 2 * ctas else 0


def slots_of(tiles, ns, ctas):
    """sk_slots_of: the most pieces - 1 that any tile is cut into."""
    units = (tiles - dp_tiles_of(tiles, ctas)) * ns
    most = run = 0
    run_tile = -1
    for c in range(1, ctas):
        tile, at = divmod(c * units // ctas, ns)
        if at:
            run = run + 1 if tile == run_tile else 1
            run_tile = tile
            most = max(most, run)
    return most


def sk_terms(kernel, m, n, k, sms=SMS):
    """The stream-K estimate's terms: (data-parallel waves' classic time, stream-K stages x the
    classic stage time, further segments, pieces x 1024 tile elements)."""
    ns, tiles = n_stages_of(k), tiles_of(kernel, m, n)
    ctas = min(sms, tiles * ns)
    slots = slots_of(tiles, ns, ctas)
    stage_us = SHAPES[kernel][2]
    dp_waves = dp_tiles_of(tiles, ctas) // ctas
    per_cta = cdiv((tiles - dp_waves * ctas) * ns, ctas)
    segments = cdiv(per_cta, ns) + (1 if slots else 0)
    return (dp_waves * (ns * stage_us + WAVE_US), per_cta * stage_us, segments - 1,
            slots * tile_elems(kernel) / 1024 if slots else 0.0)


def sk_us(kernel, m, n, k, sk=SK, sms=SMS):
    """wgmma_sk_estimate_us."""
    dp, stages, segs, pieces = sk_terms(kernel, m, n, k, sms)
    return (sk["dp_wave_scale"] * dp + sk["stage_scale"][kernel] * stages + sk["launch_us"] +
            segs * sk["segment_us"] + sk["sum_us_per_kelem"] * pieces)


def candidates(m, n, k, sk=SK, edge=EDGE, sms=SMS):
    """{(kernel, splits): the planner's weighed estimate}; splits -1 is stream-K."""
    ns = n_stages_of(k)
    most = max(1, min(16, ns // 4))
    out = {}
    for kern in AUTO_KERNELS:
        for s in range(1, most + 1):
            out[(kern, s)] = classic_us(kern, s, m, n, k, sms)
        out[(kern, -1)] = sk_us(kern, m, n, k, sk, sms) / edge
    return out


def pick(m, n, k, sk=SK, edge=EDGE, sms=SMS):
    c = candidates(m, n, k, sk, edge, sms)
    return min(c, key=c.get)  # ties: the first, as the C++ loop keeps the first least


def load_rows(sources=SOURCES):
    rows = []
    for name in sources:
        with open(os.path.join(RESULTS, name)) as f:
            rows += [dict(r, source=name) for r in json.load(f)]
    return rows


def timed_plans(row):
    """{(kernel, splits): measured µs} of every plan the row timed."""
    t = {tuple(row["plan_auto_sk0"][:2]): row["gemm_auto_sk0_us"],
         tuple(row["plan_auto_sk1"][:2]): row["gemm_auto_sk1_us"]}
    for kern in AUTO_KERNELS:
        if f"gemm_k{kern}_sk_us" in row:
            t[(kern, -1)] = row[f"gemm_k{kern}_sk_us"]
        if f"gemm_k{kern}_planned_us" in row:
            t[tuple(row[f"plan_k{kern}"][:2])] = row[f"gemm_k{kern}_planned_us"]
    return t


def classic_ratios(rows):
    """Per kernel: the mean measured / wgmma_estimate_us over every classic launch timed."""
    acc = {kern: [] for kern in AUTO_KERNELS}
    for r in rows:
        for (kern, s), us in timed_plans(r).items():
            if s >= 1:
                acc[kern].append(us / classic_us(kern, s, r["M"], r["N"], r["K"]))
    return {kern: float(np.mean(v)) for kern, v in acc.items()}


def fit(rows):
    """(the fitted constants, relative errors of the fit, number of points)."""
    ratio = classic_ratios(rows)
    a, y = [], []
    for r in rows:
        for (kern, s), us in timed_plans(r).items():
            if s != -1:
                continue
            dp, stages, segs, pieces = sk_terms(kern, r["M"], r["N"], r["K"])
            a.append([stages if kk == kern else 0.0 for kk in AUTO_KERNELS] + [1.0, segs, pieces, dp])
            y.append(us / ratio[kern])
    a, y = np.array(a), np.array(y)
    w = 1.0 / y
    p, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    rel = a @ p / y - 1
    sk = {"stage_scale": {kern: float(p[i]) for i, kern in enumerate(AUTO_KERNELS)}, "launch_us": float(p[4]),
          "segment_us": float(p[5]), "sum_us_per_kelem": float(p[6]), "dp_wave_scale": float(p[7])}
    return sk, rel, len(y)


def pick_losses(rows, sk=SK, edge=EDGE):
    """Per row: (row, pick, its time / the classic planner's pick's time, / the best timed plan).
    A pick the row did not time gives None times."""
    out = []
    for r in rows:
        t = timed_plans(r)
        p = pick(r["M"], r["N"], r["K"], sk, edge)
        us = t.get(p)
        out.append((r, p, None if us is None else us / r["gemm_auto_sk0_us"],
                    None if us is None else us / min(t.values())))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", type=float, nargs="+", default=[0.90, 0.92, 0.93, 0.94, 0.95, 0.96])
    args = ap.parse_args()
    rows = load_rows()
    sk, rel, n = fit(rows)
    print(f"{len(rows)} rows, {n} stream-K times; classic ratios "
          + ", ".join(f"k{k} {v:.3f}" for k, v in classic_ratios(rows).items()))
    print("fit: stage scales " + ", ".join(f"k{k} {v:.3f}" for k, v in sk["stage_scale"].items())
          + f"; launch {sk['launch_us']:.2f} µs, segment {sk['segment_us']:.2f} µs, sum {sk['sum_us_per_kelem']:.3f}"
          f" µs/piece/1024 elems, data-parallel waves x{sk['dp_wave_scale']:.3f}")
    print(f"     rms {np.sqrt(np.mean(rel ** 2)) * 100:.1f} %, "
          f"worst {rel.max() * 100:+.1f} % / {rel.min() * 100:+.1f} %")
    print("edge | rows whose pick is > 2 % slower than the classic planner's | > 2 % slower than the best timed"
          " | picks >= 6 % faster than the classic planner's | untimed picks")
    for e in args.edges:
        res = pick_losses(rows, SK, e)
        vs_classic = [(r["K"], r["N"], r["M"], p) for r, p, c, b in res if c is not None and c > 1.02]
        vs_best = [(r["K"], r["N"], r["M"], p, round((b - 1) * 100, 1))
                   for r, p, c, b in res if b is not None and b > 1.02]
        gains = sum(c is not None and c <= 1 / 1.06 for _, _, c, _ in res)
        untimed = sum(c is None for _, _, c, _ in res)
        print(f"{e:.3f} | {vs_classic} | {vs_best} | {gains} | {untimed}")


if __name__ == "__main__":
    main()
