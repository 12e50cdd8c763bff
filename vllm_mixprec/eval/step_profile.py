"""Where one decode step's GPU time goes, per A/B arm (issue #6: "a per-op profile of one decode step").

  python -m vllm_mixprec.eval.step_profile --ckpt DIR --arm w4a8kv4 --batch 256 --context 1024 --out OUT
  python -m vllm_mixprec.eval.step_profile --compare OUT/step_profile-w4a8kv4.json OUT/step_profile-fp8.json
  python -m vllm_mixprec.eval.step_profile --parse-trace TRACE.json.gz --arm fp8 --out OUT   # no GPU

The arm (eval/ab.py's ARMS: bf16, marlin, machete, fp8, w4a8, w4a8kv4, marlin-int8) gives the vLLM
flags; they are read by vLLM's own EngineArgs parser, as eval/longctx.py does, so they apply
exactly as on the `vllm bench` command lines. --ckpt is the arm's checkpoint folder, or the harness's
--work folder (then WORK/<shape>-L<layers>/<kind> is used, as `scripts/gpu_ab.sh ckpt` builds it).
vLLM runs with its defaults (torch.compile, CUDA graphs), --max-num-seqs BATCH, prefix caching off.

How one decode step is isolated: BATCH requests of CONTEXT random tokens are added to the engine
(ignore_eos); the engine is stepped until every request has its first token (prefill done), so
from then on every step decodes all BATCH requests. --timed-steps such steps are timed without the
profiler. Then vLLM's own profiler (ProfilerConfig: profiler="torch", delay_iterations=1,
max_iterations=STEPS) records exactly STEPS worker steps, and the worker writes a Chrome trace.
That trace is read here (analyze_trace): GPU kernels (and memcpy/memset) are assigned to the step
during which their launch happened, sampling included (the V2 model runner, vLLM 0.26's default for
Llama, runs the logits and the sampler in sample_tokens, after the step's annotation), summed per op
class (classify(), an ordered regex table), and divided by the number of steps.
OUT/step_profile-<arm>.json holds the result; a table is printed. docs/AB.md has more.
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import datetime
import glob
import gzip
import json
import os
import random
import re
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

from . import ab

# --- op classes -------------------------------------------------------------------------------

OP_CLASSES = ("linear", "lm_head", "act_quant", "attention", "norm", "norm+quant", "rotary", "activation",
              "activation+quant", "sampling", "memcpy", "comm", "other")
CLASS_WHAT = {
    "linear": "the decoder's linear GEMMs (mixprec W4A8, CUTLASS FP8, Marlin, Machete, cuBLAS)",
    "lm_head": "the logits GEMM (a linear-class kernel launched where vLLM computes the logits: the V1 "
               "runner's postprocess scope, the V2 runner's sample_tokens; else outside the CUDA graphs)",
    "act_quant": "activation quantization before a GEMM (mixprec quantize_act, vLLM fp8/int8 quant)",
    "attention": "attention and the KV-cache store (FlashAttention, mixprec paged/decode kernels, "
                 "reshape_and_cache, mixprec quantize-store)",
    "norm": "RMSNorm (vLLM kernels, Inductor triton_* with rsqrt)",
    "norm+quant": "RMSNorm fused with activation quantization",
    "rotary": "rotary embedding",
    "activation": "SiLU-and-mul",
    "activation+quant": "SiLU-and-mul fused with activation quantization",
    "sampling": "logits processing and sampling (softmax, argmax, top-k, sort, exponential), and the rest "
                "of what runs with the logits and the sampler (SAMPLING_PHASES), copies excepted",
    "memcpy": "memcpy and memset",
    "comm": "collectives (NCCL, custom all-reduce)",
    "other": "everything else (embedding, elementwise, input preparation)",
}

_Q = r"(quant|amax|clamp|(?<![a-z])round)"  # quantization in a fused kernel's name (not CUTLASS's FloatRoundStyle)
# RMSNorm: vLLM's kernels, or Inductor's ops (sorted names: "_mean_mul_pow_rsqrt"; rsqrt may be
# cut off by Inductor's kernel_name_max_ops, mean+pow remain)
_NORM = r"(rms_?norm|layer_?norm|rsqrt|_mean_\w*pow)"
_ACT = r"(silu|gelu|act_and_mul|swiglu|sigmoid)"

# Ordered: the first rule whose regex matches (re.search, case-insensitive) gives the class. Names
# are CUDA kernel names as the trace shows them (demangled, "void ns::kernel<...>(args)"), Triton
# kernel names (the @triton.jit function: vllm_mixprec/kernels/triton/*.py) and Inductor's
# generated triton_{poi,red,per}_fused_<aten ops>_<n> (the op names tell what was fused).
CLASS_RULES: tuple[tuple[str, str], ...] = (
    (r"^(memcpy|memset)\b", "memcpy"),
    (r"nccl|all_?reduce|all_?gather|reduce_?scatter|cross_device", "comm"),
    # before the GEMM rules: FlashAttention-3's kernels are cutlass::device_kernel<flash::...>
    (r"flash|fmha|attn|attention|_decode_finish_kernel|reshape_and_cache|concat_and_cache|"
     r"_quantize_store_kernel|_gather_context_kernel|_residual_assign_kernel|decode_kv4_pages", "attention"),
    # mixprec GEMMs: csrc w4a8_{decode,tiled,wgmma}_kernel, Triton _lqq_gemm_kernel
    (r"w4a8|w4ax|wgmma|_lqq_gemm", "linear"),
    # mixprec activation quantization: csrc quantize_act_int8_kernel, Triton _quant_act_kernel
    (r"quantize_act|_quant_act", "act_quant"),
    (rf"^(?=.*{_NORM})(?=.*{_Q})", "norm+quant"),
    (rf"^(?=.*{_ACT})(?=.*{_Q})", "activation+quant"),
    # vLLM's scaled_fp8_quant (dynamic_scaled_fp8_quant_kernel + segmented_max_reduction, or the
    # per-token kernel), scaled_int8_quant, and Inductor's own quantization (amax and clamp)
    (r"fp8_quant|int8_quant|scaled_\w*quant|dynamic_\w*quant|per_token\w*quant|segmented_max_reduction|"
     r"^triton_(?=.*amax)(?=.*clamp)", "act_quant"),
    (_NORM, "norm"),
    (_ACT, "activation"),
    # vLLM's rotary_embedding kernel; Inductor's q/k rotation (cat of mul and sub/neg halves)
    (r"rotary|(?<![a-z])rope(?![a-z])|^triton_(?=.*_cat)(?=.*_mul)(?=.*_(sub|neg|index))", "rotary"),
    (r"gemm|gemv|nvjet|xmma|cublas|cutlass|marlin|machete|\bmma|_mma|splitk", "linear"),
    (r"softmax|argmax|argmin|topk|top_k|top_p|sort|radix|exponential|distribution|gumbel|sampl|"
     r"multinomial|logit|penalt|cumsum", "sampling"),
)
_COMPILED_RULES = tuple((re.compile(rx, re.IGNORECASE), cls) for rx, cls in CLASS_RULES)


def classify(name: str, rules=_COMPILED_RULES) -> str:
    """The op class of a GPU kernel name (the first matching rule of CLASS_RULES, else "other")."""
    name = name.strip()
    if name.startswith("void "):
        name = name[5:]
    for rx, cls in rules:
        if rx.search(name):
            return cls
    return "other"


def short_name(name: str, width: int = 96) -> str:
    """A kernel name for a table: a C++ kernel ("void ns::k<...>(params)") without "void " and its
    parameter list, cut to `width`."""
    n = name
    if n.startswith("void ") and n.endswith(")"):
        n, depth = n[5:], 0
        for i in range(len(n) - 1, -1, -1):  # the "(" that matches the final ")"
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                n = n[:i]
                break
    return n if len(n) <= width else n[:width - 1] + "…"


# --- the trace --------------------------------------------------------------------------------

STEP_RE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")  # gpu_worker.annotate_profile
PHASE_PREFIX = "gpu_model_runner: "  # vLLM's scopes with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# Host calls that wait for the GPU: with one of them in a step, vLLM's asynchronous scheduling
# cannot prepare the next step while the GPU runs this one.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
TRACE_GLOB = "*.pt.trace.json*"


def load_trace(path: str | Path) -> dict:
    """A Chrome trace as torch.profiler writes it (plain JSON, or gzip: vLLM's default)."""
    path = Path(path)
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    opener = gzip.open if gz else open
    with opener(path, "rt", encoding="utf-8") as f:
        d = json.load(f)
    return d if isinstance(d, dict) else {"traceEvents": d}


def find_trace(folder: str | Path) -> Path | None:
    """The newest torch.profiler trace under `folder` (vLLM names it <prefix>_<rank>.<ms>.pt.trace.json.gz)."""
    files = [Path(p) for p in glob.glob(os.path.join(str(folder), "**", TRACE_GLOB), recursive=True)]
    files = [p for p in files if p.is_file() and not p.name.endswith(".tmp")]
    return max(files, key=lambda p: (p.stat().st_mtime, p.name)) if files else None


@dataclasses.dataclass
class GpuOp:
    name: str
    cat: str
    ts: float  # µs, GPU start
    dur: float  # µs
    launch_ts: float | None  # µs, the CPU launch call's start (None: no launch event correlated)
    via: str  # "graph" (a cudaGraphLaunch), "direct" (a kernel launch call) or "unmatched"
    cls: str = "other"
    step: int = -1
    phase: str | None = None


def _is_graph_launch(name: str) -> bool:
    return "graphlaunch" in name.lower()


def _x_events(trace: dict):
    for e in trace.get("traceEvents") or []:
        if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e:
            yield e


def analyze_trace(trace: dict, expected_steps: int | None = None, batch: int | None = None,
                  top: int = 25) -> dict:
    """Per-step GPU time by op class from a torch.profiler Chrome trace of vLLM worker steps.

    Steps are the worker's "execute_context_C(c)_generation_G(g)" annotations (one per
    execute_model): a GPU op belongs to the step during which its launch call ran (the
    correlation id of a kernel leads to its cudaLaunchKernel / cuLaunchKernel / cudaGraphLaunch;
    a kernel replayed from a CUDA graph carries the cudaGraphLaunch's id). Step k runs from its
    annotation's start to the next one's, so it includes sample_tokens. Ops launched before the
    first step are counted apart ("outside"). Without any step annotation the whole trace counts
    as `expected_steps` steps.
    """
    launches: dict = {}
    graph_launch_calls = 0
    steps: list[tuple[float, str, float]] = []  # (start, annotation, end) of each execute_model
    phases: list[tuple[float, float, str]] = []
    raw_gpu = []
    host_calls: list[tuple[float, float, str]] = []  # (start, duration, name) of runtime calls
    for e in _x_events(trace):
        cat, name = e.get("cat", ""), e.get("name", "")
        if cat in GPU_CATS:
            raw_gpu.append(e)
        elif cat in LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (float(e["ts"]), name)
            graph_launch_calls += _is_graph_launch(name)
            host_calls.append((float(e["ts"]), float(e.get("dur", 0)), name))
        elif cat == "user_annotation":
            if STEP_RE.match(name):
                steps.append((float(e["ts"]), name, float(e["ts"]) + float(e.get("dur", 0))))
            elif name.startswith(PHASE_PREFIX):
                phases.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), name[len(PHASE_PREFIX):]))
    steps.sort()
    phases.sort()
    step_starts = [st[0] for st in steps]
    phase_starts = [p[0] for p in phases]

    ops: list[GpuOp] = []
    for e in raw_gpu:
        args = e.get("args") or {}
        launch = launches.get(args.get("correlation"))
        via = "unmatched" if launch is None else ("graph" if _is_graph_launch(launch[1]) else "direct")
        cat, name = e.get("cat"), e.get("name", "")
        op = GpuOp(name=name, cat=cat, ts=float(e["ts"]), dur=float(e.get("dur", 0)),
                   launch_ts=None if launch is None else launch[0], via=via,
                   cls="memcpy" if cat != "kernel" else classify(name))
        t = op.launch_ts if op.launch_ts is not None else op.ts
        if steps:
            op.step = bisect.bisect_right(step_starts, t) - 1
        else:
            op.step = 0
        if op.launch_ts is not None:
            i = bisect.bisect_right(phase_starts, op.launch_ts) - 1
            if i >= 0 and op.launch_ts <= phases[i][1]:
                op.phase = phases[i][2]
            elif steps and op.step >= 0:
                op.phase = "execute_model" if op.launch_ts <= steps[op.step][2] else "sample_tokens"
        ops.append(op)

    n_steps = len(steps) if steps else (expected_steps or 1)
    inside = [o for o in ops if o.step >= 0]
    outside = [o for o in ops if o.step < 0]
    by_step: dict[int, list[GpuOp]] = defaultdict(list)
    for o in inside:
        by_step[o.step].append(o)
    lm_rule = _mark_lm_head(by_step)

    per_step = []
    for k in range(len(steps) or 1):
        so = sorted(by_step.get(k, []), key=lambda o: o.ts)
        row = {"index": k, "gpu_us": round(sum(o.dur for o in so), 3), "ops": len(so),
               "graph_kernels": sum(o.via == "graph" for o in so),
               "gpu_span_us": round(max(o.ts + o.dur for o in so) - so[0].ts, 3) if so else 0.0}
        if steps:
            m = STEP_RE.match(steps[k][1])
            row.update(annotation=steps[k][1], context_reqs=int(m.group(1)), context_tokens=int(m.group(2)),
                       generation_reqs=int(m.group(3)), generation_tokens=int(m.group(4)))
            if k + 1 < len(steps):
                row["wall_us"] = round(steps[k + 1][0] - steps[k][0], 3)
            # the last step: as long as the one before it (the trace goes on with teardown)
            end = (steps[k + 1][0] if k + 1 < len(steps)
                   else steps[k][0] + (steps[k][0] - steps[k - 1][0] if k else steps[k][2] - steps[k][0]))
            row.update(_host_row(host_calls, steps[k][0], end))
        per_step.append(row)

    classes: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    kernels: dict[str, list] = {}
    phase_us: dict[str, float] = defaultdict(float)
    for o in inside:
        classes[o.cls] += o.dur / n_steps
        counts[o.cls] += 1 / n_steps
        phase_us[o.phase or "(none)"] += o.dur / n_steps
        k = kernels.setdefault(o.name, [0.0, 0, o.cls])
        k[0] += o.dur
        k[1] += 1
        if o.cls == "lm_head":
            k[2] = "lm_head"
    total = sum(o.dur for o in inside) / n_steps
    top_k = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]

    walls = [r["wall_us"] for r in per_step if "wall_us" in r]
    notes = []
    pure = None
    if steps:
        pure = all(r["context_reqs"] == 0 and (batch is None or r["generation_reqs"] == batch) for r in per_step)
        if not pure:
            notes.append("NOT pure decode: some profiled steps scheduled prefill (context) requests or fewer "
                         f"than {batch} requests (preemption?): see steps[]")
        if expected_steps is not None and len(steps) != expected_steps:
            notes.append(f"the trace holds {len(steps)} steps, {expected_steps} were asked for")
    else:
        notes.append(f"no step annotations in the trace: the whole trace is counted as {n_steps} step(s)")
    graph = {"graph_launch_calls": graph_launch_calls,
             "kernels_from_graphs": sum(o.via == "graph" for o in ops),
             "kernels_direct": sum(o.via == "direct" for o in ops),
             "ops_unmatched": sum(o.via == "unmatched" for o in ops)}
    if graph_launch_calls and not graph["kernels_from_graphs"]:
        graph["note"] = (f"{graph_launch_calls} CUDA-graph launches but no kernel correlated to them: the "
                         "kernels replayed from graphs are missing from this trace, the totals undercount")
        notes.append("WARNING: " + graph["note"])
    elif graph["kernels_from_graphs"]:
        graph["note"] = (f"kernels replayed from CUDA graphs are in the trace: {graph['kernels_from_graphs']} "
                         f"kernels correlated to {graph_launch_calls} cudaGraphLaunch calls")
    else:
        graph["note"] = "no CUDA-graph launch in the profiled steps (eager, or this batch size not captured)"
    host = None
    if steps:
        host = {key: round(sum(r[key] for r in per_step) / len(per_step), 2)
                for key in ("host_syncs", "host_sync_us", "kernel_launch_calls")}
        to_graph = [r["us_to_graph_launch"] for r in per_step if r["us_to_graph_launch"] is not None]
        host["us_to_graph_launch"] = round(sum(to_graph) / len(to_graph), 1) if to_graph else None
        if host["host_syncs"]:
            notes.append(f"{host['host_syncs']:g} host synchronisations a step "
                         f"({', '.join(sorted({n for r in per_step for n in r['sync_calls']}))}): the "
                         "host waits for the GPU there, so it cannot prepare the next step while the "
                         "GPU runs this one (see steps[].sync_calls)")
    if graph["ops_unmatched"]:
        notes.append(f"{graph['ops_unmatched']} GPU ops had no launch event; they were placed by their GPU "
                     "start time")

    return {
        "steps_found": len(steps),
        "step_source": "annotations" if steps else "whole trace",
        "pure_decode": pure,
        "per_step_us": {"total_gpu": round(total, 3),
                        "classes": {c: round(classes[c], 3) for c in OP_CLASSES if classes.get(c)}},
        "ops_per_step": {c: round(counts[c], 2) for c in OP_CLASSES if counts.get(c)},
        "phases_us": {p: round(v, 3) for p, v in sorted(phase_us.items(), key=lambda kv: -kv[1])},
        "lm_head_rule": lm_rule,
        "top_kernels": [{"name": n, "class": c, "us_per_step": round(t / n_steps, 3),
                         "count_per_step": round(cnt / n_steps, 2),
                         "share": round(t / n_steps / total, 4) if total else 0.0}
                        for n, (t, cnt, c) in top_k],
        "wall_us_per_step_profiled": round(sum(walls) / len(walls), 3) if walls else None,
        "gpu_span_us_per_step": round(sum(r["gpu_span_us"] for r in per_step) / n_steps, 3),
        "steps": per_step,
        "outside_steps": {"ops": len(outside), "us": round(sum(o.dur for o in outside), 3)},
        "graph": graph,
        "host": host,
        "notes": notes,
    }


def _host_row(calls: list[tuple[float, float, str]], start: float, end: float) -> dict:
    """Host-side figures of one step from its runtime/driver calls in [start, end)."""
    inside = [c for c in calls if start <= c[0] < end]
    syncs = [c for c in inside if c[2] in SYNC_CALLS]
    graph = [c[0] for c in inside if _is_graph_launch(c[2])]
    return {"host_syncs": len(syncs), "host_sync_us": round(sum(c[1] for c in syncs), 3),
            "sync_calls": sorted({c[2] for c in syncs}),
            "kernel_launch_calls": sum("LaunchKernel" in c[2] for c in inside),
            "us_to_graph_launch": round(min(graph) - start, 3) if graph else None}


# Where vLLM 0.26 computes the logits and samples: the V1 model runner in execute_model (its
# "postprocess" and "sample" scopes), the V2 runner (the default for dense Llama) in sample_tokens,
# which runs after the step's execute_model annotation ends.
LOGITS_PHASES = ("postprocess", "sample_tokens")
SAMPLING_PHASES = ("postprocess", "sample", "sample_tokens")


def _mark_lm_head(by_step: dict[int, list[GpuOp]]) -> str | None:
    """Relabel the logits GEMM of each step as lm_head; returns the rule that found it.

    The logits are computed eagerly after the model's forward: a linear kernel launched in a
    LOGITS_PHASES phase is the lm_head (and what else runs in SAMPLING_PHASES, e.g. the gather of
    the sampled rows, the float cast, the sampler's bookkeeping, counts as sampling/logits, except
    copies). Without phases, when the forward ran as CUDA graphs: the linear kernels launched
    directly; else the step's last linear kernel."""
    rule = None
    for ops in by_step.values():
        for o in ops:
            if o.phase in SAMPLING_PHASES and o.cls == "other":
                o.cls = "sampling"
        lin = [o for o in ops if o.cls == "linear"]
        pick, r = [o for o in lin if o.phase in LOGITS_PHASES], "launched where vLLM computes the logits"
        if not pick and any(o.via == "graph" for o in ops):
            pick, r = [o for o in lin if o.via == "direct"], "launched outside the CUDA graphs"
        elif not pick and lin:
            pick, r = [max(lin, key=lambda o: o.ts)], "last linear kernel of the step"
        for o in pick:
            o.cls = "lm_head"
        rule = rule or (r if pick else None)
    return rule


# --- tables and plots ---------------------------------------------------------------------------

def _fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def render(res: dict, top: int = 25) -> str:
    from ..cli import _table

    s = res.get("settings", {})
    pu = res["per_step_us"]
    total = pu["total_gpu"] or 1.0
    rows = [[c, _fmt(us), f"{100 * us / total:.1f}", _fmt(res["ops_per_step"].get(c), 1)]
            for c, us in sorted(pu["classes"].items(), key=lambda kv: -kv[1])]
    rows.append(["total GPU", _fmt(pu["total_gpu"]), "100.0", _fmt(sum(res["ops_per_step"].values()), 1)])
    head = (f"{res.get('arm')}: one decode step at batch {s.get('batch')}, context {s.get('context')} "
            f"({res.get('steps_found')} profiled steps; {res.get('device') or 'device ?'})")
    out = [head, _table(rows, ["class", "µs/step", "% GPU", "ops/step"])]
    out.append(f"wall per step: profiled {_fmt(res.get('wall_us_per_step_profiled'))} µs, unprofiled "
               f"{_fmt(res.get('wall_us_per_step_unprofiled'))} µs; "
               f"GPU span {_fmt(res.get('gpu_span_us_per_step'))} µs")
    if res.get("phases_us"):
        out.append("by vLLM phase (µs/step): " + ", ".join(f"{p} {_fmt(v)}" for p, v in res["phases_us"].items()))
    h = res.get("host")
    if h:
        out.append(f"host per step: {_fmt(h['kernel_launch_calls'], 1)} kernel-launch calls, "
                   f"{_fmt(h['host_syncs'], 1)} synchronisations ({_fmt(h['host_sync_us'])} µs), "
                   f"CUDA graph launched {_fmt(h['us_to_graph_launch'])} µs into the step")
    out.append("CUDA graphs: " + res["graph"]["note"])
    krow = [[short_name(k["name"]), k["class"], _fmt(k["us_per_step"]), _fmt(k["count_per_step"], 1),
             f"{100 * k['share']:.1f}"] for k in res["top_kernels"][:top]]
    out.append(_table(krow, ["kernel", "class", "µs/step", "n/step", "%"]))
    out += [f"note: {n}" for n in res.get("notes", [])]
    return "\n".join(out)


def _rows_of(res: dict) -> dict[str, float | None]:
    d = dict(res["per_step_us"]["classes"])
    d["total GPU"] = res["per_step_us"]["total_gpu"]
    d["wall (profiled)"] = res.get("wall_us_per_step_profiled")
    d["wall (unprofiled)"] = res.get("wall_us_per_step_unprofiled")
    return d


def compare_table(results: list[dict]) -> str:
    """One row per op class (µs per decode step), one column per arm, then each arm's ratio and
    difference to the first arm (the reference)."""
    from ..cli import _table

    names = [r.get("arm", f"#{i}") for i, r in enumerate(results)]
    vals = [_rows_of(r) for r in results]
    present = [c for c in OP_CLASSES if any(v.get(c) for v in vals)]
    keys = present + ["total GPU", "wall (profiled)", "wall (unprofiled)"]
    ref = vals[0]
    header = ["µs per decode step", *names]
    header += [f"{n}/{names[0]}" for n in names[1:]] + [f"{n}-{names[0]}" for n in names[1:]]
    rows = []
    for k in keys:
        row = [k] + [_fmt(v.get(k, 0.0) if k in present else v.get(k)) for v in vals]
        for v in vals[1:]:
            a, b = ref.get(k, 0.0 if k in present else None), v.get(k, 0.0 if k in present else None)
            row.append("-" if a in (None, 0) or b is None else f"{b / a:.2f}")
        for v in vals[1:]:
            a, b = ref.get(k, 0.0 if k in present else None), v.get(k, 0.0 if k in present else None)
            row.append("-" if a is None or b is None else f"{b - a:+,.1f}")
        rows.append(row)
    tps = []
    for r in results:
        w, b = r.get("wall_us_per_step_unprofiled"), (r.get("settings") or {}).get("batch")
        tps.append(f"{b * 1e6 / w:,.0f}" if w and b else "-")
    rows.append(["decode tok/s (unprofiled)", *tps] + [""] * (2 * (len(results) - 1)))
    out = [_table(rows, header)]
    sets = {json.dumps({k: (r.get("settings") or {}).get(k) for k in ("batch", "context", "layers")})
            for r in results}
    if len(sets) > 1:
        out.append("note: the files differ in batch/context/layers: " + "; ".join(sorted(sets)))
    devs = {r.get("device") for r in results}
    if len(devs) > 1:
        out.append(f"note: measured on different devices: {sorted(map(str, devs))}")
    for r, n in zip(results, names):
        for note in r.get("notes", []):
            out.append(f"note ({n}): {note}")
    return "\n".join(out)


def plot_compare(results: list[dict], path: str | Path) -> Path | None:
    """A stacked bar per arm: µs per decode step by op class; a tick at the unprofiled wall time."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed here: no plot")
        return None
    names = [r.get("arm", f"#{i}") for i, r in enumerate(results)]
    present = [c for c in OP_CLASSES if any(r["per_step_us"]["classes"].get(c) for r in results)]
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * len(results), 5.5))
    bottom = [0.0] * len(results)
    for i, c in enumerate(present):
        h = [r["per_step_us"]["classes"].get(c, 0.0) / 1000 for r in results]
        ax.bar(names, h, bottom=bottom, label=c, color=cmap(i % 20))
        bottom = [b + x for b, x in zip(bottom, h)]
    walls = [(j, r["wall_us_per_step_unprofiled"]) for j, r in enumerate(results)
             if r.get("wall_us_per_step_unprofiled")]
    for n, (j, w) in enumerate(walls):
        ax.plot([j - 0.4, j + 0.4], [w / 1000] * 2, color="black", lw=2, label=None if n else "wall, unprofiled")
    s = results[0].get("settings", {})
    ax.set_ylabel("ms per decode step (GPU kernel time)")
    ax.set_title(f"one decode step, batch {s.get('batch')}, context {s.get('context')}\n"
                 f"{results[0].get('model', '')} {results[0].get('device') or ''}".strip(), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the run on the GPU -------------------------------------------------------------------------

class StepProfileError(SystemExit):
    """A clear message and a non-zero exit (argparse-style)."""

    def __init__(self, msg: str):
        super().__init__(f"step_profile: {msg}")


def resolve_ckpt(ckpt: str, arm: ab.Arm, layers: int, group: int | None = None) -> Path:
    """The arm's model folder: `ckpt` itself when it holds a config.json, else the harness's
    checkpoint under the --work folder `ckpt`. A synthetic checkpoint of another kind is refused."""
    from . import synthetic as syn

    p = Path(ckpt)
    if not p.is_dir():
        raise StepProfileError(f"checkpoint folder {ckpt} does not exist (build it: python -m "
                               "vllm_mixprec.eval.synthetic --work DIR, or bash scripts/gpu_ab.sh ckpt)")
    if not (p / "config.json").is_file():
        shape = dataclasses.replace(syn.LLAMA3_8B, layers=layers)
        q = syn.ckpt_dir(p, shape, arm.ckpt, group)
        if not (q / "config.json").is_file():
            raise StepProfileError(f"{ckpt} has no config.json, and no {arm.ckpt} checkpoint at {q} "
                                   f"(arm {arm.name} needs one: python -m vllm_mixprec.eval.synthetic --work {ckpt} "
                                   f"--layers {layers} --ckpts {arm.ckpt})")
        p = q
    marker = p / syn.MARKER
    if marker.is_file():
        kind = json.loads(marker.read_text()).get("kind")
        if kind and kind != arm.ckpt:
            raise StepProfileError(f"{p} is a {kind!r} checkpoint; arm {arm.name} runs on {arm.ckpt!r} ones")
    return p


def max_tokens_for(o) -> int:
    """Output tokens per request: enough for every step this run can take before it aborts them
    (first token, warm-up, timed and profiled steps, and the steps the engine runs ahead)."""
    return 1 + o.warmup_steps + o.timed_steps + o.delay + o.steps + o.margin


def engine_argv(arm: ab.Arm, ckpt: str | Path, batch: int, max_model_len: int,
                extra: tuple[str, ...] = ()) -> list[str]:
    """The vLLM engine flags of one profile run, as a command line (vLLM's parser reads it)."""
    return ["--model", str(ckpt), "--max-num-seqs", str(batch), "--max-model-len", str(max_model_len),
            "--no-enable-prefix-caching", *arm.flags, *extra]


def profiler_config(trace_dir: str | Path, steps: int, delay: int) -> dict:
    """vLLM 0.26's ProfilerConfig (vllm/config/profiler.py), as keyword arguments.

    delay_iterations/max_iterations rather than timing start_profile()/stop_profile() calls: the
    engine core runs in its own process and keeps stepping while this one reads outputs, so the
    number of steps between two calls from here is not known. The worker counts its own steps
    (gpu_worker.annotate_profile -> WorkerProfiler.step, once per execute_model): with delay D it
    starts the torch profiler at the D-th step after start_profile(), right before that step's
    execute_model (a step boundary: nothing of the previous step is launched inside the trace), and
    with max_iterations N it stops at the start of step D+N and writes the trace then, after a
    device synchronize (torch.autograd.profiler.profile.__exit__), so exactly N whole steps
    (execute_model + sample_tokens) are in it. ignore_frontend: the LLM class has no front-end
    profiler, and with delay/max the front-end one would only add overhead.
    """
    return dict(profiler="torch", torch_profiler_dir=str(Path(trace_dir).absolute()),
                torch_profiler_with_stack=False, torch_profiler_with_flops=False, torch_profiler_use_gzip=True,
                torch_profiler_dump_cuda_time_total=False, torch_profiler_record_shapes=False,
                torch_profiler_with_memory=False, ignore_frontend=True, delay_iterations=delay,
                max_iterations=steps)


def build_engine_args(argv: list[str], prof: dict):
    """vLLM's EngineArgs from `argv` through vLLM's own CLI parser (as eval/longctx.py), with the
    profiler set; LLM.from_engine_args(result) passes every field on to LLM(...)."""
    from vllm.config import ProfilerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="step_profile engine flags"))
    ea = EngineArgs.from_cli_args(p.parse_args(argv))
    ea.profiler_config = ProfilerConfig(**prof)
    return ea


@dataclasses.dataclass
class DriveOptions:
    batch: int = 256
    context: int = 1024
    steps: int = 5
    delay: int = 1
    warmup_steps: int = 2  # decode steps after the prefill, not timed
    timed_steps: int = 16  # decode steps timed without the profiler
    margin: int = 128  # output tokens to spare (the engine runs ahead of this process)
    timeout: float = 600.0
    seed: int = 0


class _Progress:
    """Tokens per request as LLMEngine.step() hands out DELTA outputs."""

    def __init__(self, engine, ids: list[str]):
        self.engine, self.got = engine, dict.fromkeys(ids, 0)
        self.finished = 0

    def pump(self) -> None:
        if not self.engine.has_unfinished_requests():
            raise StepProfileError("the requests finished before the profile did (raise --margin)")
        for out in self.engine.step():
            if out.request_id in self.got:
                self.got[out.request_id] += sum(len(c.token_ids) for c in out.outputs)
                self.finished += bool(out.finished)
        if self.finished:
            raise StepProfileError(f"{self.finished} request(s) finished before the profile did (raise --margin)")

    @property
    def least(self) -> int:
        return min(self.got.values())

    @property
    def total(self) -> int:
        return sum(self.got.values())


def drive(llm, prompts: list, params, o: DriveOptions, trace_dir: str | Path, prefix: str,
          clock=time.perf_counter, log=print) -> dict:
    """Prefill every request, time `timed_steps` pure decode steps, then profile `steps` of them.

    `llm` is a vllm.LLM built with profiler_config(trace_dir, o.steps, o.delay); returns the
    timings and the trace's path. Every request is aborted at the end."""
    eng = llm.llm_engine
    ids = [f"sp{i}" for i in range(len(prompts))]
    t0 = clock()
    deadline = t0 + o.timeout

    def check(what):
        if clock() > deadline:
            raise StepProfileError(f"timed out after {o.timeout:.0f} s {what}")

    # LLM.generate renders prompts with LLM._preprocess_cmpl before LLMEngine.add_request (raw
    # prompts still work in 0.26, with a deprecation warning); LLM.generate itself would force
    # FINAL_ONLY outputs, and the steps must be seen one by one
    render = getattr(llm, "_preprocess_cmpl", None)
    if render is not None:
        try:
            prompts = list(render(prompts))
        except Exception as e:  # noqa: BLE001
            log(f"[step_profile] LLM._preprocess_cmpl failed ({type(e).__name__}: {e}); adding raw prompts")
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    pr = _Progress(eng, ids)
    try:
        while pr.least < 1:  # prefill (chunked): some requests decode while others prefill
            pr.pump()
            check("in the prefill")
        t_prefill = clock() - t0
        log(f"[step_profile] prefill of {len(ids)} x {o.context} tokens done in {t_prefill:.1f} s")
        while pr.least < 1 + o.warmup_steps:
            pr.pump()
            check("in the warm-up steps")
        # timed: from one output's arrival to a later one's, over whole steps of all requests
        t_a, n_a = clock(), pr.total
        while pr.total - n_a < o.timed_steps * len(ids):
            pr.pump()
            check("in the timed steps")
        t_b, n_b = clock(), pr.total
        unprof = (t_b - t_a) / ((n_b - n_a) / len(ids)) * 1e6
        log(f"[step_profile] unprofiled decode step: {unprof:,.0f} µs ({(n_b - n_a) / len(ids):.0f} steps)")

        before = {str(p) for p in Path(trace_dir).glob(TRACE_GLOB)}
        t_p = clock()
        llm.start_profile(prefix)
        trace = None
        while trace is None:
            pr.pump()
            check("waiting for the profiler's trace")
            new = [p for p in Path(trace_dir).glob(TRACE_GLOB) if str(p) not in before]
            trace = max(new, key=lambda p: p.stat().st_mtime) if new else None
        # The engine core writes the trace inside a step, and answers this call only after it.
        llm.stop_profile()
        t_done = clock()
        log(f"[step_profile] trace written in {t_done - t_p:.1f} s: {trace}")
    finally:
        try:
            eng.abort_request(ids)
        except Exception as e:  # noqa: BLE001 - the result matters more than a clean abort
            log(f"[step_profile] abort failed: {type(e).__name__}: {e}")
    return {"trace": str(trace), "prefill_s": round(t_prefill, 2), "wall_us_per_step_unprofiled": round(unprof, 1),
            "timed_steps": round((n_b - n_a) / len(ids), 2), "profile_call_s": round(t_done - t_p, 2),
            "tokens_per_request_at_end": pr.least}


def random_prompts(n: int, length: int, vocab_hi: int = 8192, seed: int = 0) -> list[dict]:
    """`n` TokensPrompts of `length` ids drawn in [3, vocab_hi) (longctx.py's draw)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_hi) for _ in range(length)]} for _ in range(n)]


def _versions() -> dict:
    out = {}
    for mod in ("vllm", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def run_arm(args, arm: ab.Arm, ckpt: Path, out: Path) -> dict:
    """Start vLLM for `arm` and profile; returns the timing part of the result."""
    o = DriveOptions(batch=args.batch, context=args.context, steps=args.steps, delay=args.delay,
                     warmup_steps=args.warmup_steps, timed_steps=args.timed_steps, margin=args.margin,
                     timeout=args.timeout, seed=args.seed)
    trace_dir = out / f"traces-{arm.name}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    for old in trace_dir.glob(TRACE_GLOB):
        old.unlink()
    max_tokens = max_tokens_for(o)
    argv = engine_argv(arm, ckpt, o.batch, o.context + max_tokens, tuple(shlex.split(args.vllm_args)))
    for k, v in arm.env:
        os.environ[k] = v
    # vLLM's phase scopes (preprocess/forward/postprocess/sample) in the trace: they find the
    # lm_head GEMM; they cost a record_function each, a few per step
    os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")
    print(f"[step_profile] {arm.name}: vLLM {shlex.join(argv)}", flush=True)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    t0 = time.time()
    llm = LLM.from_engine_args(build_engine_args(argv, profiler_config(trace_dir, o.steps, o.delay)))
    startup = time.time() - t0
    print(f"[step_profile] {arm.name}: engine up in {startup:.0f} s", flush=True)
    # `vllm bench throughput`'s sampling (temperature 1, top_p 1), no detokenization, new tokens only
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, top_p=1.0, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    try:  # prompt ids must exist in the tokenizer (the toy checkpoints' has 1024)
        hi = min(8192, len(llm.get_tokenizer()))
    except Exception:  # noqa: BLE001
        hi = 8192
    got = drive(llm, random_prompts(o.batch, o.context, hi, o.seed), sp, o, trace_dir, f"step_profile-{arm.name}")
    cc = llm.llm_engine.vllm_config.cache_config
    blocks = getattr(cc, "num_gpu_blocks", None)
    got.update(startup_s=round(startup, 1), max_model_len=o.context + max_tokens, max_tokens=max_tokens,
               kv_cache_tokens=blocks * cc.block_size if blocks else None, engine_argv=argv,
               model_runner="v2" if getattr(llm.llm_engine.vllm_config, "use_v2_model_runner", False) else "v1")
    try:  # the engine core process ends here rather than at interpreter exit
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        print(f"[step_profile] engine shutdown: {type(e).__name__}: {e}", flush=True)
    return got


def write_result(res: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_profile-{res['arm']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.rename(path)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_mixprec.eval.step_profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="arms: " + "; ".join(f"{a.name}: {a.what}" for a in ab.ARMS.values()))
    p.add_argument("--ckpt", help="the arm's checkpoint folder, or the harness's --work folder")
    p.add_argument("--arm", help=f"one of {sorted(ab.ARMS)}")
    p.add_argument("--layers", type=int, default=32, help="with a --work folder as --ckpt: which model (default 32)")
    p.add_argument("--batch", type=int, default=256, help="decoding requests (= --max-num-seqs)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=5, help="decode steps profiled")
    p.add_argument("--delay", type=int, default=1, help="ProfilerConfig.delay_iterations (>= 1)")
    p.add_argument("--warmup-steps", type=int, default=2, help="decode steps after the prefill, not timed")
    p.add_argument("--timed-steps", type=int, default=16, help="decode steps timed without the profiler")
    p.add_argument("--margin", type=int, default=128, help="spare output tokens per request")
    p.add_argument("--timeout", type=float, default=600, help="seconds from the first request to the trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-args", default="",
                   help="more engine flags, given with '=': --vllm-args='--max-num-batched-tokens 8192'")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--out", default="out/step_profile", help="OUT/step_profile-<arm>.json, OUT/traces-<arm>/")
    p.add_argument("--parse-trace", metavar="TRACE", help="analyse this trace (file or folder) instead of running vLLM")
    p.add_argument("--compare", nargs="+", metavar="JSON",
                   help="one table of these results; writes OUT/step_profile-compare.png")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        results = []
        for f in args.compare:
            try:
                results.append(json.loads(Path(f).read_text()))
            except (OSError, ValueError) as e:
                raise StepProfileError(f"cannot read {f}: {e}") from None
        print(compare_table(results))
        png = plot_compare(results, Path(args.out) / "step_profile-compare.png") if args.out else None
        if png:
            print("wrote", png)
        return 0
    if not args.arm or args.arm not in ab.ARMS:
        raise StepProfileError(f"unknown arm {args.arm!r}; choose from {sorted(ab.ARMS)}" if args.arm
                               else f"--arm is required; choose from {sorted(ab.ARMS)}")
    arm = ab.ARMS[args.arm]
    for k in ("batch", "context", "steps", "delay"):
        if getattr(args, k) < 1:
            raise StepProfileError(f"--{k} must be >= 1")
    out = Path(args.out)
    settings = {"batch": args.batch, "context": args.context, "steps": args.steps, "delay_iterations": args.delay,
                "warmup_steps": args.warmup_steps, "timed_steps": args.timed_steps, "layers": args.layers,
                "vllm_args": shlex.split(args.vllm_args)}
    res = {"tool": "step_profile", "arm": arm.name, "what": arm.what, "flags": list(arm.flags), "env": dict(arm.env),
           "settings": settings, "date": datetime.datetime.now().isoformat(timespec="seconds")}
    if args.parse_trace:
        src = Path(args.parse_trace)
        trace = find_trace(src) if src.is_dir() else src
        if trace is None or not trace.is_file():
            raise StepProfileError(f"no trace at {src}")
        res.update(device=None, trace=str(trace))
    else:
        if not args.ckpt:
            raise StepProfileError("--ckpt is required (or --parse-trace / --compare)")
        ckpt = resolve_ckpt(args.ckpt, arm, args.layers)
        res.update(ckpt=str(ckpt), model=ckpt.parent.name, device=ab.device_name(), versions=_versions())
        res.update(run_arm(args, arm, ckpt, out))
        trace = Path(res["trace"])
    t = time.time()
    res.update(analyze_trace(load_trace(trace), expected_steps=args.steps, batch=args.batch, top=args.top))
    res["parse_s"] = round(time.time() - t, 1)
    path = write_result(res, out)
    print(render(res, args.top))
    print("wrote", path)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine: nothing runs at import time
    sys.exit(main())
