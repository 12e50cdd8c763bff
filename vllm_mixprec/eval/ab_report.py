"""Tables, issue-#6 target checks and PNG plots from the A/B harness's ab.jsonl (eval/ab.py).

Needs no GPU and no vLLM: `vllm-mixprec ab --replot OUT` runs it where matplotlib is installed.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..cli import _table

ARM_ORDER = ("bf16", "fp8", "marlin", "marlin-int8", "machete", "w4a8", "w4a8kv4")
COLORS = {"bf16": "#555555", "fp8": "#9467bd", "marlin": "#d62728", "marlin-int8": "#ff9896",
          "machete": "#ff7f0e", "w4a8": "#1f77b4", "w4a8kv4": "#2ca02c"}
OURS = "w4a8kv4"


def load_jsonl(path: str | Path) -> list[dict]:
    """Entries of an ab.jsonl; a line cut short by a kill is skipped, the rest still count."""
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def latest(entries: list[dict]) -> dict[str, dict]:
    """key -> the last entry of that key (a rerun replaces an earlier result)."""
    d = {}
    for e in entries:
        if "key" in e:
            d[e["key"]] = e
    return d


def _arm_rank(arm: str) -> tuple:
    return (ARM_ORDER.index(arm) if arm in ARM_ORDER else len(ARM_ORDER), arm)


def _by(entries: list[dict], workload: str, ok_only: bool = False) -> list[dict]:
    rows = [e for e in latest(entries).values() if e.get("workload") == workload
            and (not ok_only or e.get("status") == "ok")]
    return sorted(rows, key=lambda e: (e.get("model", ""), _arm_rank(e["arm"]), e.get("concurrency") or 0))


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def _kernel(e: dict) -> str:
    facts = e.get("facts") or {}
    ks = [k.split(" for ")[0] for k in facts.get("kernels") or []]
    if facts.get("attention_backend") == "CUSTOM":
        ks.append("CUSTOM attn")
    return ",".join(dict.fromkeys(ks)) or "-"


def _status(e: dict) -> str:
    s = e.get("status", "?")
    if s != "ok":
        s += f" ({e.get('error', '')})"[:60]
    if e.get("warnings"):
        s += " [!]"
    return s


def out_tps(e: dict | None) -> float | None:
    """Output tokens per second of a throughput, serve or longctx entry."""
    if not e or e.get("status") != "ok":
        return None
    m = e.get("metrics") or {}
    for k in ("output_tokens_per_second", "output_throughput", "out_tok_per_s"):
        if m.get(k) is not None:
            return float(m[k])
    return None


def _find(entries, workload, arm, concurrency=None, model=None) -> dict | None:
    for e in _by(entries, workload):
        if e["arm"] == arm and e.get("concurrency") == concurrency and (model is None or e.get("model") == model):
            return e
    return None


def targets(entries: list[dict]) -> list[dict]:
    """The issue's targets, each with its measured ratio where both sides were measured."""
    out = []
    models = sorted({e.get("model") for e in latest(entries).values()})
    for model in models:
        def ratio(wl, a, b, c=None, metric=out_tps, invert=False):
            x, y = metric(_find(entries, wl, a, c, model)), metric(_find(entries, wl, b, c, model))
            if x is None or y is None or not y:
                return None
            return y / x if invert else x / y

        def tpot(e):
            return None if not e or e.get("status") != "ok" else (e.get("metrics") or {}).get("median_tpot_ms")

        checks = [("saturation throughput, w4a8kv4 / marlin", ratio("throughput", OURS, "marlin"), 1.5),
                  ("saturation throughput, w4a8kv4 / fp8", ratio("throughput", OURS, "fp8"), 1.2)]
        for c in (1, 8):
            # TPOT no worse than Marlin's: marlin TPOT / ours >= 1
            checks.append((f"median TPOT at concurrency {c}, marlin / w4a8kv4",
                           ratio("serve", OURS, "marlin", c, tpot, invert=True), 1.0))
        checks.append(("long context, w4a8kv4 / bf16 (FA3)", ratio("longctx", OURS, "bf16"), 1.0))
        for name, r, goal in checks:
            out.append({"model": model, "target": name, "goal": goal, "ratio": r,
                        "met": None if r is None else r >= goal})
    return out


def render(entries: list[dict]) -> str:
    parts = []
    rows = []
    marl = {e.get("model"): out_tps(e) for e in _by(entries, "throughput") if e["arm"] == "marlin"}
    for e in _by(entries, "throughput"):
        m = e.get("metrics") or {}
        base = marl.get(e.get("model"))
        x = out_tps(e)
        rows.append([e.get("model"), e["arm"], _f(x), _f(m.get("tokens_per_second")),
                     _f(m.get("requests_per_second"), 2), "-" if not (x and base) else f"{x / base:.2f}x",
                     _f((e.get("facts") or {}).get("kv_cache_tokens"), 0), _kernel(e), _status(e)])
    if rows:
        parts.append("Saturation throughput (vllm bench throughput)\n" + _table(
            rows, ["model", "arm", "out tok/s", "total tok/s", "req/s", "vs marlin", "KV tokens", "kernel", "status"]))
    rows = []
    for e in _by(entries, "serve"):
        m = e.get("metrics") or {}
        rows.append([e.get("model"), e["arm"], e.get("concurrency"), _f(out_tps(e)),
                     _f(m.get("median_ttft_ms")), _f(m.get("p99_ttft_ms")), _f(m.get("median_tpot_ms"), 2),
                     _f(m.get("p99_tpot_ms"), 2), _status(e)])
    if rows:
        parts.append("Serving sweep (vllm serve + vllm bench serve)\n" + _table(
            rows, ["model", "arm", "conc", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                   "status"]))
    rows = []
    bf = {e.get("model"): out_tps(e) for e in _by(entries, "longctx") if e["arm"] == "bf16"}
    for e in _by(entries, "longctx"):
        m = e.get("metrics") or {}
        x, base = out_tps(e), bf.get(e.get("model"))
        rows.append([e.get("model"), e["arm"], _f(x), _f(m.get("total_tok_per_s")), _f(m.get("seconds"), 2),
                     "-" if not (x and base) else f"{x / base:.2f}x",
                     _f((e.get("facts") or {}).get("kv_cache_tokens"), 0), _status(e)])
    if rows:
        parts.append("Long context (kv_baseline.py's run: 64 x 8192 in, 256 out)\n" + _table(
            rows, ["model", "arm", "out tok/s", "total tok/s", "seconds", "vs bf16", "KV tokens", "status"]))
    rows = [[t["model"], t["target"], f">= {t['goal']:.1f}x", "-" if t["ratio"] is None else f"{t['ratio']:.2f}x",
             "not measured" if t["met"] is None else ("met" if t["met"] else
                                                      f"MISSED by {100 * (1 - t['ratio'] / t['goal']):.0f}%")]
            for t in targets(entries)]
    if rows:
        parts.append("Issue #6 targets\n" + _table(rows, ["model", "target", "goal", "measured", "verdict"]))
    warn = [f"{e['arm']}/{e['workload']}: {w}" for e in latest(entries).values() for w in e.get("warnings", [])]
    if warn:
        parts.append("Warnings\n" + "\n".join(warn))
    return "\n\n".join(parts)


def aba(rounds: list[list[dict]]) -> list[dict]:
    """An A-B-A from results folders run one after another on one host (gpu_ab.sh aba): rounds[i]
    holds round i's entries. Every ok entry becomes a row (round, model, workload, concurrency,
    arm, out tok/s, median TPOT where `serve` measured one); "vs_first" divides the tokens/s by
    the mean of the rounds of the first round's arm at the same model, workload and concurrency,
    and "drift" is that arm's spread (max / min - 1) over its rounds: a gain smaller than the
    drift is not one."""
    rows = []
    for i, entries in enumerate(rounds, 1):
        for e in latest(entries).values():
            if e.get("status") == "ok" and out_tps(e) is not None:
                rows.append({"round": i, "model": e.get("model"), "workload": e.get("workload"),
                             "concurrency": e.get("concurrency"), "arm": e["arm"], "out_tps": out_tps(e),
                             "tpot_ms": (e.get("metrics") or {}).get("median_tpot_ms")})
    for r in rows:
        same = [x for x in rows if (x["model"], x["workload"], x["concurrency"])
                == (r["model"], r["workload"], r["concurrency"])]
        first = min(same, key=lambda x: x["round"])["arm"]
        ref = [x["out_tps"] for x in same if x["arm"] == first]
        r["vs_first"] = r["out_tps"] / (sum(ref) / len(ref))
        r["drift"] = max(ref) / min(ref) - 1 if len(ref) > 1 else None
    return rows


def render_aba(rows: list[dict]) -> str:
    if not rows:
        return "A-B-A: no finished run in these folders"
    table = [[r["round"], r["model"], r["workload"], "-" if r["concurrency"] is None else r["concurrency"],
              r["arm"], _f(r["out_tps"]), _f(r.get("tpot_ms"), 2), f"{r['vs_first']:.3f}x",
              "-" if r["drift"] is None else f"{100 * r['drift']:.1f} %"] for r in rows]
    return ("A-B-A (vs A: out tok/s over the mean of A's rounds; drift: A's spread over its rounds)\n"
            + _table(table, ["round", "model", "workload", "conc", "arm", "out tok/s", "median TPOT ms",
                             "vs A", "A drift"]))


def write_summary(entries: list[dict], path: str | Path) -> None:
    """One JSON: the latest entry of every key (without per-request samples) and the targets."""
    slim = [{k: v for k, v in e.items() if k not in ("samples", "log_tail", "server_log_tail")}
            for e in latest(entries).values()]
    devices = sorted({e.get("device") for e in slim if e.get("device")})
    summary = {"devices": devices, "entries": slim, "targets": targets(entries)}
    Path(path).write_text(json.dumps(summary, indent=1) + "\n")


def plot(entries: list[dict], folder: str | Path) -> list[Path]:
    """ab_serve.png (throughput and TPOT against concurrency), ab_latency.png (TTFT and TPOT
    distributions per arm and level), ab_throughput.png (saturation and long-context bars)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed here: run `vllm-mixprec ab --replot OUT` where it is")
        return []
    folder = Path(folder)
    written = []
    models = sorted({e.get("model") for e in latest(entries).values() if e.get("model")})
    title = " / ".join(models) + (f" on {entries[-1].get('device')}" if entries[-1].get("device") else "")

    serve = _by(entries, "serve", ok_only=True)
    if serve:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        for (model, arm) in sorted({(e.get("model"), e["arm"]) for e in serve}, key=lambda x: (x[0], _arm_rank(x[1]))):
            es = [e for e in serve if e["arm"] == arm and e.get("model") == model]
            cs = [e["concurrency"] for e in es]
            label = arm if len(models) == 1 else f"{arm} ({model})"
            kw = dict(marker="o", label=label, color=COLORS.get(arm))
            axes[0].plot(cs, [out_tps(e) for e in es], **kw)
            axes[1].plot(cs, [(e["metrics"] or {}).get("median_tpot_ms") for e in es], **kw)
            axes[2].plot(cs, [(e["metrics"] or {}).get("median_ttft_ms") for e in es], **kw)
        levels = sorted({e["concurrency"] for e in serve})
        for ax, yl in zip(axes, ("output tokens/s", "median TPOT (ms)", "median TTFT (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.set_xlabel("concurrency")
            ax.set_ylabel(yl)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"vllm bench serve, throughput and latency against concurrency — {title}", fontsize=10)
        fig.tight_layout()
        written.append(folder / "ab_serve.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

        arms = sorted({e["arm"] for e in serve}, key=_arm_rank)
        fig, axes = plt.subplots(2, len(levels), figsize=(max(4.2 * len(levels), 6), 7.5), squeeze=False)
        for j, c in enumerate(levels):
            for i, (metric, name) in enumerate((("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"))):
                ax = axes[i][j]
                data, labels, colors = [], [], []
                for arm in arms:
                    e = next((x for x in serve if x["arm"] == arm and x["concurrency"] == c), None)
                    if e is None:
                        continue
                    xs = (e.get("samples") or {}).get(metric) or []
                    if not xs:  # no per-request samples: the percentiles vLLM reported
                        m = e.get("metrics") or {}
                        xs = [m[k] for k in (f"p50_{metric}", f"p90_{metric}", f"p99_{metric}") if m.get(k) is not None]
                    if xs:
                        data.append(xs)
                        labels.append(arm)
                        colors.append(COLORS.get(arm, "#888888"))
                if not data:
                    ax.set_visible(False)
                    continue
                bp = ax.boxplot(data, whis=(1, 99), showfliers=False, patch_artist=True)
                for patch, col in zip(bp["boxes"], colors):
                    patch.set_facecolor(col)
                    patch.set_alpha(0.6)
                ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30, fontsize=8)
                ax.set_title(f"{name}, concurrency {c}", fontsize=9)
                ax.grid(alpha=0.3, axis="y")
        fig.suptitle(f"per-request latency distributions (box: quartiles, whiskers: p1-p99) — {title}", fontsize=10)
        fig.tight_layout()
        written.append(folder / "ab_latency.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    bars = [(wl, _by(entries, wl, ok_only=True)) for wl in ("throughput", "longctx")]
    bars = [(wl, es) for wl, es in bars if es]
    if bars:
        fig, axes = plt.subplots(1, len(bars), figsize=(6.5 * len(bars), 4.6), squeeze=False)
        for ax, (wl, es) in zip(axes[0], bars):
            labels = [e["arm"] if len(models) == 1 else f"{e['arm']}\n{e.get('model')}" for e in es]
            vals = [out_tps(e) or 0.0 for e in es]
            ax.bar(range(len(es)), vals, color=[COLORS.get(e["arm"], "#888888") for e in es])
            for k, v in enumerate(vals):
                ax.annotate(f"{v:,.0f}", (k, v), ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(es)), labels, rotation=30, fontsize=8)
            ax.set_ylabel("output tokens/s")
            ax.set_title("saturation, 1024 in / 512 out (vllm bench throughput)" if wl == "throughput"
                         else "long context, 64 x 8192 in / 256 out", fontsize=9)
            ax.grid(alpha=0.3, axis="y")
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        written.append(folder / "ab_throughput.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
