"""The per-op decode-step profile (vllm_mixprec/eval/step_profile.py) on a CPU: the kernel-name
classifier, the trace parser on synthetic torch.profiler traces (gzip and plain, ops outside the
profiled steps, CUDA-graph replays), the compare table and plot, the engine flags and profiler
settings as vLLM 0.26 reads them, the stepping loop against a stand-in engine, the CLI's errors,
and the `profile` stage of scripts/gpu_ab.sh against a stand-in python3. One GPU test runs vLLM."""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_mixprec.eval import ab
from vllm_mixprec.eval import step_profile as sp

REPO = Path(__file__).resolve().parents[2]

# --- the classifier ------------------------------------------------------------------------------

KERNELS = [  # names as torch.profiler traces show them (H100, vLLM 0.26), and the class each must get
    ("void mixprec::(anonymous namespace)::w4a8_wgmma_kernel<2, 128, 4, __nv_bfloat16>"
     "(mixprec::(anonymous namespace)::WParams)", "linear"),
    ("_w4a8_wgmma_kernel_0d1d2d3d", "linear"),
    ("void mixprec::(anonymous namespace)::w4a8_tiled_kernel<4, 2, 2, 2, 3, __nv_bfloat16>(Params)", "linear"),
    ("void mixprec::(anonymous namespace)::w4a8_decode_kernel<1, 2, 4, __nv_bfloat16>(Params)", "linear"),
    ("_lqq_gemm_kernel", "linear"),
    ("void mixprec::(anonymous namespace)::quantize_act_int8_kernel<c10::BFloat16, float, true>"
     "(c10::BFloat16 const*, long, float const*, signed char*, float*, int, int)", "act_quant"),
    ("_quant_act_kernel", "act_quant"),
    ("_paged_attn_kernel", "attention"),
    ("_decode_finish_kernel", "attention"),
    ("_quantize_store_kernel", "attention"),
    ("_residual_assign_kernel", "attention"),
    ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t, cutlass::bfloat16_t, "
     "vllm::c3x::ScaledEpilogue, cute::tuple<cute::C<64>, cute::C<128>, cute::C<128> >, "
     "cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum, cutlass::FloatRoundStyle)2>::GemmKernel>"
     "(cutlass::gemm::kernel::GemmUniversal::Params)", "linear"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off"
     "_kernel__5x_cublas", "linear"),
    ("void marlin::Marlin<__nv_bfloat16, (vllm::ScalarTypeId)5, 256, 1, 8, 8, true, 4, 8, false>"
     "(int4 const*, int4 const*, int4*, int4*)", "linear"),
    ("void cutlass::device_kernel<machete::MacheteKernelTemplate<cutlass::bfloat16_t>::KernelType>(Params)", "linear"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NTN", "linear"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(Params)", "linear"),
    # FlashAttention-3 is a cutlass::device_kernel too: attention, not linear
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
     "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>>>>>>(Params)", "attention"),
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
     "cutlass::bfloat16_t>, false>(flash::Flash_fwd_params)", "attention"),
    ("flash_fwd_splitkv_kernel", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>"
     "(Params)", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(Params)", "norm"),
    ("void vllm::rms_norm_dynamic_per_token_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn, true>(P)", "norm+quant"),
    ("triton_red_fused__to_copy_abs_add_amax_clamp_div_mean_mul_pow_reciprocal_rsqrt_0", "norm+quant"),
    ("triton_red_fused__to_copy_abs_add_amax_clamp_div_mean_mul_pow_reciprocal_0", "norm+quant"),  # rsqrt cut off
    ("triton_poi_fused_mul_silu_slice_0", "activation"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>(P)", "activation"),
    ("triton_red_fused__to_copy_abs_amax_clamp_div_mul_silu_slice_0", "activation+quant"),
    ("void vllm::dynamic_scaled_fp8_quant_kernel_strided<c10::BFloat16, c10::Float8_e4m3fn>(P)", "act_quant"),
    ("void vllm::segmented_max_reduction_strided<c10::BFloat16, c10::Float8_e4m3fn>(P)", "act_quant"),
    ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn, true>(P)",
     "act_quant"),
    ("triton_poi_fused__to_copy_abs_amax_clamp_div_0", "act_quant"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(P)", "rotary"),
    ("triton_poi_fused_add_cat_index_select_mul_split_with_sizes_sub_0", "rotary"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
     "unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>>)", "sampling"),
    ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
     "at::native::templates::cuda::exponential_kernel>(int, P)", "sampling"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<Policy, false, float, long>(P)", "sampling"),
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclDevComm*, unsigned long, ncclWork*)", "comm"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(P)", "comm"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<int>, std::array<char*, 1ul>)", "other"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, "
     "2, 2, -2, true>(P)", "other"),
    ("triton_poi_fused_add_0", "other"),
]


@pytest.mark.parametrize("name,cls", KERNELS, ids=[f"{c}:{n[:40]}" for n, c in KERNELS])
def test_classify_real_kernel_names(name, cls):
    assert sp.classify(name) == cls


def test_rules_name_only_known_classes_and_compile():
    assert {c for _, c in sp.CLASS_RULES} <= set(sp.OP_CLASSES)
    assert set(sp.CLASS_WHAT) == set(sp.OP_CLASSES)
    for rx, _ in sp.CLASS_RULES:
        re.compile(rx)
    # the table is ordered: the first match wins, so moving the attention rule after the GEMM
    # rules would put FlashAttention-3 (a cutlass::device_kernel) into linear
    fa3 = "void cutlass::device_kernel<flash::FlashAttnFwdSm90<P>>(P)"
    swapped = [r for r in sp.CLASS_RULES if r[1] != "attention"] + [r for r in sp.CLASS_RULES if r[1] == "attention"]
    assert sp.classify(fa3) == "attention"
    assert sp.classify(fa3, tuple((re.compile(rx, re.I), c) for rx, c in swapped)) == "linear"


def _kernel_names_in_the_tree():
    """Every kernel the plugin launches: @triton.jit functions named *_kernel, csrc __global__s."""
    names = set()
    for f in (REPO / "vllm_mixprec" / "kernels" / "triton").glob("*.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\(", f.read_text()))
    for f in (REPO / "csrc").rglob("*.cu"):
        names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", f.read_text()))
    return sorted(names)


def test_every_plugin_kernel_has_a_class():
    names = _kernel_names_in_the_tree()
    assert {"_paged_attn_kernel", "_quantize_store_kernel", "w4a8_wgmma_kernel", "quantize_act_int8_kernel"} <= \
        set(names), names
    expect = {"gemm": "linear", "w4a8": "linear", "quant_act": "act_quant", "quantize_act": "act_quant",
              "attn": "attention", "decode_finish": "attention", "quantize_store": "attention",
              "gather_context": "attention", "residual_assign": "attention", "decode_kv4": "attention"}
    for n in names:
        want = next((c for k, c in expect.items() if k in n), None)
        got = sp.classify(n)
        assert got != "other", f"kernel {n} falls into 'other': add a rule to step_profile.CLASS_RULES"
        if want:
            assert got == want, (n, got)


def test_short_name():
    assert sp.short_name("void mixprec::(anonymous namespace)::w4a8_wgmma_kernel<2, __nv_bfloat16>(mixprec::W)") \
        == "mixprec::(anonymous namespace)::w4a8_wgmma_kernel<2, __nv_bfloat16>"
    assert sp.short_name("Memcpy HtoD (Pinned -> Device)") == "Memcpy HtoD (Pinned -> Device)"
    assert sp.short_name("void f<(a)>(int (*)(int), float)") == "f<(a)>"
    long = sp.short_name("x" * 300, width=50)
    assert len(long) == 50 and long.endswith("…")


# --- the trace parser ----------------------------------------------------------------------------

GEMM = "void mixprec::(anonymous namespace)::w4a8_wgmma_kernel<2, 128, 4, __nv_bfloat16>(mixprec::WParams)"
QUANT = "void mixprec::(anonymous namespace)::quantize_act_int8_kernel<c10::BFloat16, float, true>(P)"
LM_HEAD = "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NTN"
SOFTMAX = "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>(float*, float const*, int)"
CAST = "void at::native::vectorized_elementwise_kernel<4, at::native::CopyFunctor>(int, P)"


def make_trace(n_steps=3, batch=8, outside=True, graph=True, phases=True, graph_kernels=True, context_step=None,
               v2=False, t0=1000.0, period=1000.0, syncs=0):
    """A torch.profiler Chrome trace shaped like vLLM 0.26's worker traces: one annotation per
    execute_model, phase scopes, one cudaGraphLaunch per forward whose kernels carry its
    correlation id, the eager logits GEMM (in execute_model as the V1 model runner, or with `v2` in
    sample_tokens, after the annotation, as the V2 runner), sampling, a device-to-host copy; plus ops of the step
    before the profiled ones (`outside`), flow events and metadata that the parser must skip.
    Per step: linear 2x100, act_quant 2x10, attention 40, norm 5 = 265 in the graph, lm_head 60,
    cast 4, softmax 8, memcpy 3: 340 µs. `syncs` cudaStreamSynchronize calls (3 µs) per step, before
    the graph launch, as the metadata build's pageable scalar copies made them."""
    ev = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}}]
    corr = [100]

    def launch(name, ts, cat="cuda_runtime"):
        corr[0] += 1
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 3.0,
                   "args": {"correlation": corr[0]}})
        ev.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": corr[0], "pid": 1, "tid": 1, "ts": ts})
        return corr[0]

    def gpu(name, ts, dur, k, cat="kernel"):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
                   "args": {"correlation": k, "stream": 7, "device": 0}})

    if outside:  # the tail of the step before: launched before the first annotation
        k = launch("cudaLaunchKernel", t0 - 300)
        gpu(SOFTMAX, t0 - 100, 50.0, k)
        k = launch("cudaMemcpyAsync", t0 - 200)
        gpu("Memcpy DtoH (Device -> Pinned)", t0 + 5, 7.0, k, cat="gpu_memcpy")  # runs after it: still outside
    for s in range(n_steps):
        t = t0 + s * period
        ctx = 2 if s == context_step else 0
        ev.append({"ph": "X", "cat": "user_annotation", "name":
                   f"execute_context_{ctx}({ctx * 64})_generation_{batch - ctx}({batch - ctx})",
                   "pid": 1, "tid": 1, "ts": t, "dur": 600.0})
        ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_0(0)_generation_8(8)",
                   "pid": 0, "tid": 7, "ts": t + 30, "dur": 500.0})
        if phases:
            for nm, a, b in (("preprocess", 1, 9), ("forward", 10, 300), ("postprocess", 310, 400),
                             ("sample", 700, 800)):
                ev.append({"ph": "X", "cat": "user_annotation", "name": "gpu_model_runner: " + nm,
                           "pid": 1, "tid": 1, "ts": t + a, "dur": b - a})
        for i in range(syncs):
            launch("cudaStreamSynchronize", t + 12 + i)
        fwd = [(GEMM, 100.0), (QUANT, 10.0), ("_paged_attn_kernel", 40.0),
               ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 5.0), (QUANT, 10.0), (GEMM, 100.0)]
        if graph:
            g = launch("cudaGraphLaunch", t + 20)
            ks = [g if graph_kernels else 10**6 + s] * len(fwd)
        else:
            ks = [launch("cuLaunchKernel", t + 20 + i, cat="cuda_driver") for i in range(len(fwd))]
        ts = t + 30
        for (name, dur), k in zip(fwd, ks):
            gpu(name, ts, dur, k)
            ts += dur
        k = launch("cudaLaunchKernel", t + (650 if v2 else 320))
        gpu(LM_HEAD, ts + 5, 60.0, k)
        k = launch("cudaLaunchKernel", t + (660 if v2 else 330))
        gpu(CAST, ts + 70, 4.0, k)
        k = launch("cuLaunchKernel", t + 720, cat="cuda_driver")
        gpu(SOFTMAX, ts + 80, 8.0, k)
        k = launch("cudaMemcpyAsync", t + 790)
        gpu("Memcpy DtoH (Device -> Pinned)", ts + 90, 3.0, k, cat="gpu_memcpy")
    return {"schemaVersion": 1, "deviceProperties": [{"name": "NVIDIA H100 80GB HBM3"}], "traceEvents": ev}


def _write(trace, path: Path, gz: bool) -> Path:
    data = json.dumps(trace).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_parse_trace_file(tmp_path, gz):
    path = _write(make_trace(), tmp_path / f"x.pt.trace.json{'.gz' if gz else ''}", gz)
    r = sp.analyze_trace(sp.load_trace(path), expected_steps=3, batch=8)
    assert r["steps_found"] == 3 and r["step_source"] == "annotations" and r["pure_decode"] is True
    c = r["per_step_us"]["classes"]
    assert c == {"linear": 200.0, "lm_head": 60.0, "act_quant": 20.0, "attention": 40.0, "norm": 5.0,
                 "sampling": 12.0, "memcpy": 3.0}
    assert r["per_step_us"]["total_gpu"] == 340.0  # the 50 µs softmax and 7 µs copy launched before are not in it
    assert r["outside_steps"] == {"ops": 2, "us": 57.0}
    assert r["ops_per_step"]["linear"] == 2 and r["ops_per_step"]["act_quant"] == 2
    assert r["lm_head_rule"] == "launched where vLLM computes the logits"
    assert r["phases_us"] == {"forward": 265.0, "postprocess": 64.0, "sample": 11.0}
    assert r["wall_us_per_step_profiled"] == 1000.0
    g = r["graph"]
    assert (g["graph_launch_calls"], g["kernels_from_graphs"], g["ops_unmatched"]) == (3, 18, 0)
    # host: cudaLaunchKernel x2 + cuLaunchKernel per step, the graph launched 20 µs in, no sync
    assert r["host"] == {"host_syncs": 0, "host_sync_us": 0, "kernel_launch_calls": 3, "us_to_graph_launch": 20.0}
    assert not [n for n in r["notes"] if "synchronisation" in n]
    assert "kernels replayed from CUDA graphs are in the trace" in g["note"]
    top = {k["name"]: k for k in r["top_kernels"]}
    assert top[GEMM]["us_per_step"] == 200.0 and top[GEMM]["count_per_step"] == 2.0 and top[GEMM]["class"] == "linear"
    assert top[LM_HEAD]["class"] == "lm_head" and top[CAST]["class"] == "sampling"
    assert r["top_kernels"][0]["name"] == GEMM and abs(top[GEMM]["share"] - 200 / 340) < 1e-3
    assert [s["generation_reqs"] for s in r["steps"]] == [8, 8, 8] and r["notes"] == []
    assert sp.analyze_trace(sp.load_trace(path), top=2)["top_kernels"][1]["name"] == LM_HEAD


def test_host_syncs_are_counted_and_reported():
    """Host waits inside a step (the 10 of each decode step in the H100 trace of 2026-11-25)."""
    r = sp.analyze_trace(make_trace(syncs=2), expected_steps=3, batch=8)
    assert r["host"]["host_syncs"] == 2 and r["host"]["host_sync_us"] == 6.0
    assert all(row["sync_calls"] == ["cudaStreamSynchronize"] for row in r["steps"])
    assert [n for n in r["notes"] if n.startswith("2 host synchronisations a step (cudaStreamSynchronize)")]
    assert "2.0 synchronisations (6.0 µs)" in sp.render(r)


def test_parse_trace_as_a_bare_event_list(tmp_path):
    path = _write(make_trace()["traceEvents"], tmp_path / "list.json", gz=False)
    assert sp.analyze_trace(sp.load_trace(path))["per_step_us"]["total_gpu"] == 340.0


def test_lm_head_without_phase_scopes_and_without_graphs():
    # the V2 model runner: no scopes, the logits and the sampler in sample_tokens
    r = sp.analyze_trace(make_trace(phases=False, v2=True))
    assert r["lm_head_rule"] == "launched where vLLM computes the logits"
    assert r["per_step_us"]["classes"]["lm_head"] == 60.0 and r["per_step_us"]["classes"]["sampling"] == 12.0
    assert r["phases_us"] == {"execute_model": 265.0, "sample_tokens": 75.0}
    # V1 without scopes: the logits GEMM is in execute_model, outside the graphs
    r = sp.analyze_trace(make_trace(phases=False))
    assert r["lm_head_rule"] == "launched outside the CUDA graphs"
    assert r["per_step_us"]["classes"]["lm_head"] == 60.0 and r["per_step_us"]["classes"]["other"] == 4.0
    r = sp.analyze_trace(make_trace(phases=False, graph=False))
    assert r["lm_head_rule"] == "last linear kernel of the step"
    assert r["per_step_us"]["classes"]["lm_head"] == 60.0 and r["per_step_us"]["classes"]["linear"] == 200.0
    assert "no CUDA-graph launch" in r["graph"]["note"]


def test_graph_launches_without_their_kernels_are_flagged():
    r = sp.analyze_trace(make_trace(graph_kernels=False), expected_steps=3)
    assert r["graph"]["kernels_from_graphs"] == 0 and r["graph"]["ops_unmatched"] == 18
    assert any("no kernel correlated to them" in n for n in r["notes"])
    # placed by their GPU start time, still within their own steps
    assert r["per_step_us"]["classes"]["linear"] == 200.0


def test_steps_that_are_not_pure_decode_and_a_wrong_step_count():
    r = sp.analyze_trace(make_trace(context_step=1), expected_steps=5, batch=8)
    assert r["pure_decode"] is False and r["steps"][1]["context_reqs"] == 2
    assert any("NOT pure decode" in n for n in r["notes"]) and any("5 were asked for" in n for n in r["notes"])


def test_trace_without_step_annotations_counts_as_the_asked_steps():
    t = make_trace(outside=False)
    t["traceEvents"] = [e for e in t["traceEvents"] if not str(e.get("name", "")).startswith("execute_")]
    r = sp.analyze_trace(t, expected_steps=3)
    assert r["step_source"] == "whole trace" and r["pure_decode"] is None
    assert r["per_step_us"]["total_gpu"] == 340.0 and len(r["steps"]) == 1


def test_find_trace_takes_the_newest(tmp_path):
    assert sp.find_trace(tmp_path) is None
    (tmp_path / "sub").mkdir()
    a = _write(make_trace(), tmp_path / "w_rank0.1.pt.trace.json.gz", True)
    b = _write(make_trace(), tmp_path / "sub" / "w_rank0.2.pt.trace.json.gz", True)
    os.utime(a, (1, 1))
    assert sp.find_trace(tmp_path) == b
    (tmp_path / "profiler_out_0.txt").write_text("table")
    assert sp.find_trace(tmp_path) == b


# --- results, the table, the comparison ------------------------------------------------------

def _result(arm, trace=None, wall=None, batch=8, **settings):
    r = sp.analyze_trace(trace or make_trace(), expected_steps=3, batch=batch)
    r.update(arm=arm, settings={"batch": batch, "context": 64, "layers": 2, **settings},
             wall_us_per_step_unprofiled=wall, device="NVIDIA H100 80GB HBM3")
    return r


def test_render_table():
    out = sp.render(_result("w4a8kv4", wall=900.0))
    assert "w4a8kv4: one decode step at batch 8, context 64 (3 profiled steps; NVIDIA H100" in out
    assert re.search(r"^linear\s+200\.0\s+58\.8\s+2\.0", out, re.M)
    assert re.search(r"^total GPU\s+340\.0\s+100\.0", out, re.M)
    assert "profiled 1,000.0 µs, unprofiled 900.0 µs" in out
    assert "mixprec::(anonymous namespace)::w4a8_wgmma_kernel<2, 128, 4, __nv_bfloat16>" in out
    assert "kernels replayed from CUDA graphs are in the trace" in out


def test_compare_table_ratios_and_differences():
    slow = make_trace()
    for e in slow["traceEvents"]:
        if e.get("name") == GEMM:
            e["dur"] = 150.0
    a, b = _result("w4a8kv4", wall=1000.0), _result("fp8", slow, wall=1100.0)
    out = sp.compare_table([a, b])
    lines = out.splitlines()
    assert lines[0].split() == ["µs", "per", "decode", "step", "w4a8kv4", "fp8", "fp8/w4a8kv4", "fp8-w4a8kv4"]
    row = next(x for x in lines if x.startswith("linear "))
    assert row.split()[1:] == ["200.0", "300.0", "1.50", "+100.0"]
    row = next(x for x in lines if x.startswith("total GPU"))
    assert row.split()[2:] == ["340.0", "440.0", "1.29", "+100.0"]
    row = next(x for x in lines if x.startswith("decode tok/s"))
    assert row.split()[3:5] == ["8,000", "7,273"]
    assert "differ" not in out
    c = _result("marlin", wall=None, batch=16)
    out = sp.compare_table([a, b, c])
    assert "note: the files differ in batch/context/layers" in out
    assert next(x for x in out.splitlines() if x.startswith("wall (unprofiled)")).split()[2:] == \
        ["1,000.0", "1,100.0", "-", "1.10", "-", "+100.0", "-"]


def test_compare_plot(tmp_path):
    pytest.importorskip("matplotlib")
    p = sp.plot_compare([_result("w4a8kv4", wall=1000.0), _result("fp8", wall=1100.0)], tmp_path / "d" / "c.png")
    assert p.exists() and p.read_bytes()[:4] == b"\x89PNG"


def test_cli_parse_trace_and_compare(tmp_path, capsys):
    trace = _write(make_trace(), tmp_path / "t.pt.trace.json.gz", True)
    out = tmp_path / "out"
    argv = ["--parse-trace", str(trace), "--arm", "fp8", "--steps", "3", "--batch", "8", "--out", str(out)]
    assert sp.main(argv) == 0
    res = json.loads((out / "step_profile-fp8.json").read_text())
    assert res["arm"] == "fp8" and res["flags"] == ["--quantization", "fp8"] and res["trace"] == str(trace)
    assert res["per_step_us"]["total_gpu"] == 340.0 and res["settings"]["batch"] == 8 and res["date"]
    assert "wrote" in capsys.readouterr().out
    assert sp.main(["--parse-trace", str(tmp_path), "--arm", "w4a8kv4", "--steps", "3", "--out", str(out)]) == 0
    assert sp.main(["--compare", str(out / "step_profile-w4a8kv4.json"), str(out / "step_profile-fp8.json"),
                    "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fp8/w4a8kv4" in text and re.search(r"^linear\s+200\.0\s+200\.0\s+1\.00", text, re.M)
    with pytest.raises(SystemExit, match="cannot read"):
        sp.main(["--compare", str(tmp_path / "missing.json")])


# --- the CLI's errors -------------------------------------------------------------------------

def test_cli_errors_in_process(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown arm 'nope'; choose from \['bf16', "):
        sp.main(["--ckpt", str(tmp_path), "--arm", "nope"])
    with pytest.raises(SystemExit, match="--arm is required"):
        sp.main(["--ckpt", str(tmp_path)])
    with pytest.raises(SystemExit, match="--ckpt is required"):
        sp.main(["--arm", "fp8"])
    with pytest.raises(SystemExit, match=re.escape(f"checkpoint folder {tmp_path / 'none'} does not exist")):
        sp.main(["--ckpt", str(tmp_path / "none"), "--arm", "fp8"])
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        sp.main(["--ckpt", str(tmp_path), "--arm", "fp8", "--steps", "0"])
    with pytest.raises(SystemExit, match="no trace at"):
        sp.main(["--parse-trace", str(tmp_path), "--arm", "fp8"])


@pytest.mark.parametrize("argv,message", [
    (["--ckpt", "/nonexistent/ckpt", "--arm", "w4a8kv4"], "checkpoint folder /nonexistent/ckpt does not exist"),
    (["--ckpt", "/tmp", "--arm", "int3"], "unknown arm 'int3'"),
])
def test_cli_errors_exit_non_zero_with_a_message(argv, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "vllm_mixprec.eval.step_profile", *argv, "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode != 0
    assert f"step_profile: {message}" in r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.iterdir())


def _fake_work(tmp_path, layers, kinds):
    from vllm_mixprec.eval import synthetic as syn

    shape = syn.LLAMA3_8B.__class__(layers=layers)
    for kind in kinds:
        d = syn.ckpt_dir(tmp_path, shape, kind)
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        (d / syn.MARKER).write_text(json.dumps({"kind": kind}))
    return shape


def test_resolve_checkpoint_from_the_work_folder(tmp_path):
    _fake_work(tmp_path, 2, ["bf16", "mixprec-kv4"])
    got = sp.resolve_ckpt(str(tmp_path), ab.ARMS["fp8"], layers=2)
    assert got == tmp_path / "llama3-8b-L2" / "bf16"
    assert sp.resolve_ckpt(str(got), ab.ARMS["bf16"], layers=99) == got  # a model folder is taken as it is
    assert sp.resolve_ckpt(str(tmp_path), ab.ARMS["w4a8kv4"], layers=2).name == "mixprec-w4a8kv4-g64"
    with pytest.raises(SystemExit, match="no gptq checkpoint at .*gptq-w4a16-g128 .*--ckpts gptq"):
        sp.resolve_ckpt(str(tmp_path), ab.ARMS["marlin"], layers=2)
    with pytest.raises(SystemExit, match="no bf16 checkpoint at .*llama3-8b-L32"):
        sp.resolve_ckpt(str(tmp_path), ab.ARMS["fp8"], layers=32)
    with pytest.raises(SystemExit, match="is a 'bf16' checkpoint; arm w4a8kv4 runs on 'mixprec-kv4' ones"):
        sp.resolve_ckpt(str(got), ab.ARMS["w4a8kv4"], layers=2)


# --- the engine flags and the profiler settings, as vLLM 0.26 reads them --------------------

ENGINE_EXPECT = {  # as test_ab_harness.ARM_EXPECT: what vLLM must read from each arm's flags
    "fp8": dict(quantization="fp8", kv_cache_dtype="auto", attention_backend=None, linear_backend="auto"),
    "marlin": dict(quantization=None, kv_cache_dtype="auto", attention_backend=None, linear_backend="marlin"),
    "w4a8kv4": dict(quantization="mixprec", kv_cache_dtype="int4_per_token_head", attention_backend="CUSTOM",
                    linear_backend="auto"),
}


@pytest.mark.parametrize("arm", sorted(ENGINE_EXPECT))
def test_engine_args_and_profiler_config(arm, cpu_platform, tmp_path):
    o = sp.DriveOptions(batch=256, context=1024, steps=5)
    mml = o.context + sp.max_tokens_for(o)
    argv = sp.engine_argv(ab.ARMS[arm], "/ckpt", o.batch, mml, ("--max-num-batched-tokens", "8192"))
    ea = sp.build_engine_args(argv, sp.profiler_config(tmp_path / "tr", o.steps, o.delay))
    for k, v in ENGINE_EXPECT[arm].items():
        got = getattr(ea, k)
        assert (got if not hasattr(got, "name") else got.name) == v or (v == "auto" and got is None), (k, got)
    assert (ea.model, ea.max_num_seqs, ea.max_model_len, ea.enable_prefix_caching, ea.max_num_batched_tokens) == \
        ("/ckpt", 256, 1024 + 1 + 2 + 16 + 1 + 5 + 128, False, 8192)
    assert ea.enforce_eager is False  # vLLM's default torch.compile and CUDA graphs
    pc = ea.profiler_config
    assert (pc.profiler, pc.torch_profiler_dir, pc.torch_profiler_with_stack, pc.delay_iterations,
            pc.max_iterations, pc.ignore_frontend, pc.warmup_iterations) == \
        ("torch", str(tmp_path / "tr"), False, 1, 5, True, 0)
    # LLM.from_engine_args is LLM(**vars(ea)): the profiler config reaches the engine as it is
    assert vars(ea)["profiler_config"] is pc


# --- the stepping loop, against a stand-in engine -------------------------------------------

class FakeLLM:
    """vllm.LLM as drive() uses it: requests get their first token after a staggered prefill,
    then one token per step; start_profile() makes the worker write a trace `delay + steps`
    steps later (it counts its own steps)."""

    def __init__(self, trace_dir, delay=1, steps=3, prefill_steps=4, write_trace=True):
        self.trace_dir, self.delay, self.steps, self.prefill = Path(trace_dir), delay, steps, prefill_steps
        self.write_trace = write_trace
        self.reqs, self.n, self.countdown, self.calls = {}, 0, None, []
        self.llm_engine = self

    # LLMEngine
    def add_request(self, rid, prompt, params):
        assert len(prompt["prompt_token_ids"]) > 0
        self.reqs[rid] = [0, params.max_tokens, len(self.reqs) % self.prefill + 1]

    def has_unfinished_requests(self):
        return any(n < m for n, m, _ in self.reqs.values())

    def step(self):
        self.n += 1
        outs = []
        for rid, r in self.reqs.items():
            if self.n >= r[2] and r[0] < r[1]:
                r[0] += 1
                outs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=[7])],
                                            finished=r[0] == r[1]))
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown == 0 and self.write_trace:
                _write(make_trace(self.steps), self.trace_dir / "step_profile-x_rank0.5.pt.trace.json.gz", True)
        return outs

    def abort_request(self, ids):
        self.calls.append(("abort", len(ids)))
        for rid in ids:
            self.reqs.pop(rid, None)

    # LLM
    def start_profile(self, prefix):
        self.calls.append(("start", prefix))
        self.countdown = self.delay + self.steps

    def stop_profile(self):
        self.calls.append(("stop",))


class Params(SimpleNamespace):
    pass


def _drive(tmp_path, llm, o, clock=None):
    logs = []
    got = sp.drive(llm, sp.random_prompts(o.batch, o.context, seed=1), Params(max_tokens=sp.max_tokens_for(o)), o,
                   tmp_path, "step_profile-x", clock=clock or (lambda: llm.n * 0.02), log=logs.append)
    return got, logs


def test_drive_prefills_times_and_profiles(tmp_path):
    llm = FakeLLM(tmp_path, steps=3)
    o = sp.DriveOptions(batch=6, context=16, steps=3, timed_steps=5)
    got, logs = _drive(tmp_path, llm, o)
    assert got["wall_us_per_step_unprofiled"] == pytest.approx(20000.0)  # 20 ms a step on the fake clock
    assert got["timed_steps"] == 5
    assert got["prefill_s"] == pytest.approx(0.08)  # the last request's first token came at step 4
    assert Path(got["trace"]).name == "step_profile-x_rank0.5.pt.trace.json.gz"
    assert [c[0] for c in llm.calls] == ["start", "stop", "abort"] and llm.calls[0][1] == "step_profile-x"
    assert llm.calls[2] == ("abort", 6)
    # every request was past its prefill before the timing began, and none finished
    assert got["tokens_per_request_at_end"] >= 1 + o.warmup_steps + o.timed_steps + o.delay + o.steps
    assert any("prefill of 6 x 16 tokens" in line for line in logs)
    assert sp.analyze_trace(sp.load_trace(got["trace"]), expected_steps=3)["steps_found"] == 3


def test_drive_adds_prompts_rendered_as_llm_generate_does(tmp_path):
    class Rendering(FakeLLM):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.added = []

        def _preprocess_cmpl(self, prompts):
            return [{"type": "token", **p} for p in prompts]

        def add_request(self, rid, prompt, params):
            self.added.append(prompt)
            super().add_request(rid, prompt, params)

    llm = Rendering(tmp_path, steps=2)
    _drive(tmp_path, llm, sp.DriveOptions(batch=3, context=5, steps=2, timed_steps=2))
    assert [p["type"] for p in llm.added] == ["token"] * 3 and len(llm.added[0]["prompt_token_ids"]) == 5


def test_drive_stops_when_requests_would_finish_first(tmp_path):
    llm = FakeLLM(tmp_path, steps=3, write_trace=False)
    o = sp.DriveOptions(batch=4, context=8, steps=3, timed_steps=2, margin=5)
    with pytest.raises(SystemExit, match="finished before the profile did"):
        _drive(tmp_path, llm, o)
    assert llm.calls[-1] == ("abort", 4)


def test_drive_times_out(tmp_path):
    llm = FakeLLM(tmp_path, steps=3, write_trace=False)
    o = sp.DriveOptions(batch=4, context=8, steps=3, timed_steps=2, margin=10**6, timeout=30.0)
    with pytest.raises(SystemExit, match="timed out after 30 s waiting for the profiler's trace"):
        _drive(tmp_path, llm, o)
    assert llm.calls[-1] == ("abort", 4)


def test_random_prompts_are_reproducible():
    a, b = sp.random_prompts(3, 10, seed=5), sp.random_prompts(3, 10, seed=5)
    assert a == b and len(a) == 3 and all(len(p["prompt_token_ids"]) == 10 for p in a)
    assert all(3 <= t < 8192 for p in a for t in p["prompt_token_ids"])


# --- scripts/gpu_ab.sh profile, against a stand-in python3 ---------------------------------

FAKE_PY = """#!/usr/bin/env bash
# python3 for gpu_ab.sh's profile stage: preflight checks pass; a profile run analyses $FAKE_TRACE
if [ "$1" = -c ]; then exit 0; fi
if [[ " $* " == *" --compare "* ]]; then exec {py} "$@"; fi
arm= out=
while [ $# -gt 0 ]; do case "$1" in --arm) arm=$2; shift;; --out) out=$2; shift;; esac; shift; done
echo "$arm" >> "$FAKE_CALLS"
echo "INFO 11-23 10:00:00 [llm.py:1] vLLM noise"
[ "$arm" = "${{FAKE_FAIL:-}}" ] && {{ echo "boom: $arm"; exit 1; }}
exec {py} -m vllm_mixprec.eval.step_profile --parse-trace "$FAKE_TRACE" --arm "$arm" --out "$out" --steps 3 --batch 8
"""


def _gpu_ab_profile(tmp_path, *arms, budget=540, fail=""):
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "python3").write_text(FAKE_PY.format(py=sys.executable))
    (bin_ / "python3").chmod(0o755)
    trace = _write(make_trace(), tmp_path / "t.pt.trace.json.gz", True)
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(out), "AB_WORK": str(tmp_path / "w"),
           "AB_BUDGET": str(budget), "FAKE_TRACE": str(trace), "FAKE_CALLS": str(tmp_path / "calls"),
           "FAKE_FAIL": fail, "PYTHONPATH": str(REPO)}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_ab.sh"), "profile", *arms], capture_output=True, text=True,
                       env=env, timeout=600)
    return r, out


def test_gpu_ab_profile_stage(tmp_path):
    r, out = _gpu_ab_profile(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "calls").read_text().split() == ["w4a8kv4", "fp8", "marlin"]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["step_profile-compare.png", "step_profile-compare.txt", "step_profile-fp8.json",
                     "step_profile-logs.tar.gz", "step_profile-marlin.json", "step_profile-w4a8kv4.json"]
    assert len(names) <= 8  # what the device tool brings back
    assert "fp8/w4a8kv4" in (out / "step_profile-compare.txt").read_text()
    assert "vLLM noise" not in r.stdout and "linear" in r.stdout
    res = tmp_path / "w" / "results" / "profile"
    assert "vLLM noise" in (res / "logs" / "step_profile-fp8.log").read_text()
    # again: nothing is rerun, the results are brought back again
    r, out = _gpu_ab_profile(tmp_path, "w4a8kv4", "fp8")
    assert r.returncode == 0 and "done earlier" in r.stdout
    assert (tmp_path / "calls").read_text().split() == ["w4a8kv4", "fp8", "marlin"]
    assert (out / "step_profile-fp8.json").exists()


def test_gpu_ab_profile_stage_budget_and_failure(tmp_path):
    r, out = _gpu_ab_profile(tmp_path, "bf16", budget=100)
    assert r.returncode == 3 and "not started" in r.stdout and not (tmp_path / "calls").exists()
    r, out = _gpu_ab_profile(tmp_path, "w4a8kv4", "fp8", fail="w4a8kv4")
    assert r.returncode == 1 and "profile w4a8kv4 FAILED" in r.stdout and "boom: w4a8kv4" in r.stdout
    assert (out / "step_profile-fp8.json").exists() and not (out / "step_profile-w4a8kv4.json").exists()


# --- on the GPU: vLLM itself ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("arm", ["bf16", "w4a8kv4"])
def test_step_profile_on_the_gpu(arm, tiny_ckpts, tmp_path):
    """A whole run on the 2-layer toy checkpoints: the trace has the profiled steps, all pure decode,
    the kernels replayed from CUDA graphs, and the arm's own kernels in their classes."""
    ckpt = tiny_ckpts[1][ab.ARMS[arm].ckpt]
    r = subprocess.run([sys.executable, "-m", "vllm_mixprec.eval.step_profile", "--ckpt", str(ckpt), "--arm", arm,
                        "--batch", "8", "--context", "64", "--steps", "3", "--timed-steps", "4", "--out", str(tmp_path),
                        "--vllm-args=--gpu-memory-utilization 0.3"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / f"step_profile-{arm}.json").read_text())
    assert res["steps_found"] == 3 and res["pure_decode"] is True, res["notes"]
    assert res["graph"]["kernels_from_graphs"] > 0, res["graph"]
    assert res["wall_us_per_step_unprofiled"] > 0 and res["per_step_us"]["total_gpu"] > 0
    classes = res["per_step_us"]["classes"]
    assert classes.get("linear", 0) > 0 and classes.get("attention", 0) > 0 and classes.get("lm_head", 0) > 0
    names = " ".join(k["name"] for k in res["top_kernels"])
    if arm == "w4a8kv4":
        assert "_paged_attn_kernel" in names or "_decode_finish_kernel" in names
