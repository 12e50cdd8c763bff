"""compile_passes.SiluMulQuantFusion: under torch.compile (Inductor, CPU here) the down
projection's SiluAndMul + traced quantize_act become mixprec::silu_mul_quantize_act, with
the same numbers; other producers and other splits are left alone. WgmmaActOrder: the GEMM
reads its activations in the wgmma k order, permuted in the graph, with the same numbers.
DecodeQuantOps: the decode graphs' traced quantizers become mixprec::quantize_act, and those after
vLLM's add + RMSNorm mixprec::add_rms_norm_quantize_act with it. install() puts the wanted passes
in vLLM's post-grad hook once (the fusion if MIXPREC_FUSE_SILU_QUANT=1: it is slower than
Inductor's kernel on the H100; the decode ops unless MIXPREC_DECODE_QUANT_OPS=0; the order where
the GPU runs the wgmma kernels), and leaves a user's pass in place."""
import logging
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as Fn

from vllm_mixprec import compile_passes as cp
from vllm_mixprec import formats as F
from vllm_mixprec import kernels
from vllm_mixprec import reference as ref


def _layer(seeded, n=48, k=64, smooth=False, device="cpu"):
    w = ref.quantize_weight_lqq(torch.randn(n, k, generator=seeded), 64)
    sm = (torch.rand(k, generator=seeded) + 0.5) if smooth else None
    return SimpleNamespace(**{name: t.to(device) for name, t in w.items()},
                           mixprec_impl="reference" if device == "cpu" else "triton",
                           mixprec_scheme="w4a8", input_smooth=None if sm is None else sm.to(device))


def _compiled(fn, *args, fusion=None):
    """fn compiled by Inductor with `fusion` (default a fresh SiluMulQuantFusion) as the post-grad
    pass (dynamic batch, as vLLM)."""
    fusion = cp.SiluMulQuantFusion() if fusion is None else fusion
    torch._dynamo.reset()
    for a in args:
        torch._dynamo.mark_dynamic(a, 0)
    out = torch.compile(fn, fullgraph=True,
                        options={cp.HOOK: fusion, "fx_graph_cache": False})(*args)
    return out, fusion


@pytest.fixture
def fused_act_quant(monkeypatch):
    monkeypatch.setattr(kernels, "_FUSE_ACT_QUANT", True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("smooth", [False, True])
def test_down_projection_input_becomes_one_op(seeded, fused_act_quant, smooth, device):
    """On CUDA the op is the Triton kernel, bit for bit the eager torch ops."""
    from vllm.model_executor.layers.activation import SiluAndMul

    layer = _layer(seeded, smooth=smooth, device=device)
    gate_up = (torch.randn(5, 128, generator=seeded) * 2).to(torch.bfloat16).to(device)

    def mlp_down(gu):
        return kernels.apply_linear(layer, SiluAndMul.forward_native(gu), None)

    out, fusion = _compiled(mlp_down, gate_up)
    assert fusion.matched == 1
    torch.testing.assert_close(out, mlp_down(gate_up), rtol=0, atol=0)


def test_other_producers_and_other_splits_are_left_alone(seeded, fused_act_quant):
    layer = _layer(seeded)

    def norm_then_linear(x):  # RMSNorm's quantization stays Inductor's
        h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return kernels.apply_linear(layer, h, None)

    def thirds(x):  # silu(x[:, :d]) * x[:, d:2d] of a 3d-wide x: not SiluAndMul
        return kernels.apply_linear(layer, Fn.silu(x[:, :64]) * x[:, 64:128], None)

    x = torch.randn(4, 64, generator=seeded).to(torch.bfloat16)
    assert _compiled(norm_then_linear, x)[1].matched == 0
    x3 = torch.randn(4, 192, generator=seeded).to(torch.bfloat16)
    out, fusion = _compiled(thirds, x3)
    assert fusion.matched == 0
    want = thirds(x3).float()  # Inductor skips the eager bf16 roundings: a few codes move
    assert float((out.float() - want).norm() / want.norm()) < 0.02


def test_op_reference_and_fake(seeded):
    gate_up = torch.randn(3, 32, generator=seeded).to(torch.float16)
    q, s = torch.ops.mixprec.silu_mul_quantize_act(gate_up, None)
    q_ref, s_ref = ref.quantize_act(Fn.silu(gate_up[:, :16]) * gate_up[:, 16:])
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fs = torch.ops.mixprec.silu_mul_quantize_act(mode.from_tensor(gate_up), None)
    assert (fq.shape, fq.dtype, fs.shape, fs.dtype) == ((3, 16), torch.int8, (3,), torch.float32)


def test_install_once_and_respects_a_users_pass(monkeypatch, caplog):
    monkeypatch.delenv("MIXPREC_FUSE_SILU_QUANT", raising=False)
    monkeypatch.setenv("MIXPREC_DECODE_QUANT_OPS", "0")  # (on by default: test_install_decode_quant_ops)
    monkeypatch.setattr(cp, "_wgmma_order_applies", lambda: False)  # (a CPU machine: no wgmma)
    off = SimpleNamespace(inductor_compile_config={})
    assert not cp.wanted() and not cp.install(off) and cp.HOOK not in off.inductor_compile_config  # opt-in
    monkeypatch.setenv("MIXPREC_FUSE_SILU_QUANT", "1")
    cc = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.wanted() and cp.install(cc)
    hook = cc.inductor_compile_config[cp.HOOK]
    assert isinstance(hook, cp.MixprecPostGrad) and [type(p) for p in hook.passes] == [cp.SiluMulQuantFusion]
    assert cc.compile_ranges_endpoints == [cp.FUSE_MAX_TOKENS, 8192]  # a graph for each side
    assert cp.install(cc) and cc.inductor_compile_config[cp.HOOK] is hook
    users = SimpleNamespace(inductor_compile_config={cp.HOOK: "user pass"})
    with caplog.at_level(logging.WARNING, logger="vllm.mixprec"):
        assert not cp.install(users)
    assert users.inductor_compile_config[cp.HOOK] == "user pass"
    assert "passes (SiluMulQuantFusion) are left out" in caplog.text
    monkeypatch.setenv("MIXPREC_FUSE_SILU_QUANT", "0")
    assert not cp.install(off) and cp.HOOK not in off.inductor_compile_config
    monkeypatch.setenv("MIXPREC_FUSE_SILU_QUANT", "yes")
    with pytest.raises(ValueError, match="MIXPREC_FUSE_SILU_QUANT='yes': expected 0"):
        cp.install(off)


def test_pass_applies_up_to_its_compile_range_end():
    """vLLM's pass manager skips the pass on graphs for batches above FUSE_MAX_TOKENS, and
    install() splits the compile ranges there only when a range crosses it."""
    from vllm.config.utils import Range
    fusion = cp.SiluMulQuantFusion()
    end = cp.FUSE_MAX_TOKENS
    assert fusion.is_applicable_for_range(Range(1, end))
    assert fusion.is_applicable_for_range(Range(8, 8))  # a compile size
    assert not fusion.is_applicable_for_range(Range(end + 1, 8192))
    assert not fusion.is_applicable_for_range(Range(1, 8192))
    for before, after in (([8192], [end, 8192]), ([16, 8192], [16, end, 8192]),
                          ([end, 8192], [end, 8192]), ([16], [16]), ([], []), (None, None)):
        cc = SimpleNamespace(compile_ranges_endpoints=before)
        cp._add_compile_range_end(cc, end)
        assert cc.compile_ranges_endpoints == after, before


def test_act_quant_benchmark_fuses_its_silu_pattern(seeded, repo_module):
    """bench_act_quant's "amax+pass" row times the fused op: the pass matches its function."""
    bench = repo_module("benchmarks/bench_act_quant.py")
    gate_up = torch.randn(3, 96, generator=seeded).to(torch.bfloat16)
    (q, s), fusion = _compiled(bench.pattern("silu", bench.quant_amax), gate_up)
    assert fusion.matched == 1
    q_ref, s_ref = ref.silu_mul_quantize_act(gate_up)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_act_quant_benchmark_times_the_norm_op_it_checks(seeded, repo_module, monkeypatch):
    """bench_act_quant --norm-op: norm_op is the plugin's add + RMSNorm + quantizer op, and
    code_agreement compares its codes with the reference of the native norm (on the CPU the op is
    that reference: no code differs)."""
    bench = repo_module("benchmarks/bench_act_quant.py")
    monkeypatch.setattr(bench, "HIDDEN", 128)
    cpu = lambda name, m: tuple(t.cpu() for t in (torch.randn(m, 128, generator=seeded).to(torch.bfloat16),  # noqa: E731
                                                  torch.randn(m, 128, generator=seeded).to(torch.bfloat16),
                                                  torch.rand(128, generator=seeded).to(torch.bfloat16) + 0.5))
    monkeypatch.setattr(bench, "inputs", cpu)
    assert bench.code_agreement(bench.norm_op, 3) == {"codes_differ": 0.0, "max_code_diff": 0, "scale_rel_diff": 0.0}
    x, res, w = cpu("norm", 2)
    q, s, r = bench.norm_op(x, res, w)
    want = ref.add_rms_norm_quantize_act(x, res, w, bench.EPS)
    assert torch.equal(q, want[0]) and torch.equal(s, want[1]) and torch.equal(r, want[2])


def test_act_quant_benchmark_norm_op_arms(repo_module):
    """--norm-op: cuda (the csrc kernel) or the Triton kernel's warps; anything else is refused
    with what it takes."""
    import argparse

    bench = repo_module("benchmarks/bench_act_quant.py")
    assert [bench.norm_op_arm(v) for v in ("cuda", "0", "16")] == ["cuda", 0, 16]
    for bad in ("3", "32", "csrc", "-8"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"'{bad}': expected cuda or a number of warps"):
            bench.norm_op_arm(bad)


def test_act_quant_benchmark_silu_op_arms(seeded, repo_module, monkeypatch):
    """--silu-op: triton, cuda (the op's own cluster size), cudaN (N CTAs a row at most) or cudaNvV
    (about V vectors a CTA); anything else is refused with what it takes. code_agreement's silu form compares with the two torch ops' reference (the
    reference itself agrees with it on the CPU)."""
    import argparse

    bench = repo_module("benchmarks/bench_act_quant.py")
    assert [bench.silu_op_arm(v) for v in ("triton", "cuda", "cuda1", "cuda3", "cuda16v128", "cudav64")] == [
        ("triton", None, None), ("cuda", None, 512), ("cuda", 1, 512), ("cuda", 3, 512), ("cuda", 16, 128),
        ("cuda", None, 64)]
    for bad in ("cuda17", "cuda0", "cuda8v0", "cuda8v2049", "cuda8v", "csrc", "8"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"'{bad}': expected triton, cuda, cudaN or cudaNvV"):
            bench.silu_op_arm(bad)
    monkeypatch.setattr(bench, "inputs", lambda name, m: (torch.randn(m, 64, generator=seeded).to(torch.bfloat16),))
    assert bench.code_agreement(lambda gu: ref.silu_mul_quantize_act(gu, None), 3, "silu") == {
        "codes_differ": 0.0, "max_code_diff": 0, "scale_rel_diff": 0.0}


def test_install_with_the_wgmma_order(monkeypatch):
    """Where the GPU runs the wgmma kernels, install() puts WgmmaActOrder in the hook (with the
    fusion when that is asked for too) and splits the ranges after 64 tokens; the hook runs each
    pass on its own ranges. MIXPREC_X_WGMMA_ORDER=input asks for the permuted input on every
    shape; the default (1, input_fused) does too and raises Inductor's realize_reads_threshold;
    codes permutes the codes on wgmma_order_pays's shapes; 0 leaves the pass out; other values
    are refused."""
    from vllm.config.utils import Range
    monkeypatch.delenv("MIXPREC_FUSE_SILU_QUANT", raising=False)
    monkeypatch.setenv("MIXPREC_DECODE_QUANT_OPS", "0")  # (on by default: test_install_decode_quant_ops)
    monkeypatch.delenv("MIXPREC_KERNEL", raising=False)
    monkeypatch.delenv("MIXPREC_X_WGMMA_ORDER", raising=False)
    from vllm_mixprec.kernels import cuda
    monkeypatch.setattr(cuda, "has_wgmma", lambda device=None: True)
    monkeypatch.setattr(cuda, "x_wgmma_order_for", lambda m, n, k, device=None: m > 64)
    assert cp._wgmma_order_applies()
    cc = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.install(cc)
    hook = cc.inductor_compile_config[cp.HOOK]
    assert [type(p) for p in hook.passes] == [cp.WgmmaActOrder]
    assert cc.compile_ranges_endpoints == [cp.WGMMA_ORDER_AFTER_TOKENS, 8192]
    assert hook.is_applicable_for_range(Range(65, 8192)) and hook.is_applicable_for_range(Range(128, 128))
    assert not hook.is_applicable_for_range(Range(1, 64))
    monkeypatch.setenv("MIXPREC_FUSE_SILU_QUANT", "1")
    both = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.install(both)
    assert [type(p) for p in both.inductor_compile_config[cp.HOOK].passes] == [cp.SiluMulQuantFusion,
                                                                             cp.WgmmaActOrder]
    assert both.compile_ranges_endpoints == [cp.FUSE_MAX_TOKENS, cp.WGMMA_ORDER_AFTER_TOKENS, 8192]
    assert not both.inductor_compile_config[cp.HOOK].is_applicable_for_range(Range(33, 64))
    monkeypatch.setenv("MIXPREC_KERNEL", "triton")  # no csrc GEMM to rewrite: no extra compile range
    assert not cp._wgmma_order_applies()
    monkeypatch.setenv("MIXPREC_KERNEL", "cuda")
    assert cp._wgmma_order_applies()
    assert hook.passes[0].input_order and hook.passes[0].all_shapes  # the default: input_fused
    assert cc.inductor_compile_config["realize_reads_threshold"] == cp.INPUT_FUSED_REALIZE_READS
    monkeypatch.setenv("MIXPREC_X_WGMMA_ORDER", "codes")
    cc = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.install(cc)
    assert not (cc.inductor_compile_config[cp.HOOK].passes[-1].input_order
                or cc.inductor_compile_config[cp.HOOK].passes[-1].all_shapes)
    assert "realize_reads_threshold" not in cc.inductor_compile_config
    monkeypatch.setenv("MIXPREC_X_WGMMA_ORDER", "input")
    cc = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.install(cc) and cc.inductor_compile_config[cp.HOOK].passes[-1].input_order
    assert cc.inductor_compile_config[cp.HOOK].passes[-1].all_shapes
    assert "realize_reads_threshold" not in cc.inductor_compile_config
    monkeypatch.setenv("MIXPREC_X_WGMMA_ORDER", "input_fused")  # input order, and Inductor's option
    cc = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.install(cc) and cc.inductor_compile_config[cp.HOOK].passes[-1].input_order
    assert cc.inductor_compile_config["realize_reads_threshold"] == cp.INPUT_FUSED_REALIZE_READS
    cc = SimpleNamespace(inductor_compile_config={"realize_reads_threshold": 8}, compile_ranges_endpoints=[8192])
    assert cp.install(cc) and cc.inductor_compile_config["realize_reads_threshold"] == 8  # the user's stays
    monkeypatch.setenv("MIXPREC_X_WGMMA_ORDER", "0")
    assert not cp._wgmma_order_applies()
    monkeypatch.setenv("MIXPREC_X_WGMMA_ORDER", "on")
    with pytest.raises(ValueError, match="MIXPREC_X_WGMMA_ORDER='on': expected 1 or input_fused"):
        cp._wgmma_order_applies()


def test_compile_cache_key_follows_the_wgmma_order_mode(monkeypatch):
    """The hook's uuid is part of vLLM's CompilationConfig.compute_hash() and of Inductor's FX-graph
    key (which, under plain torch.compile, has no MIXPREC_* environment factor beside it:
    compile_cache.py adds that in vLLM only): each MIXPREC_X_WGMMA_ORDER mode must key its own
    graphs (the same source compiles differently per mode), and a mode must key the same graphs in
    every process."""
    from vllm.config import CompilationConfig
    monkeypatch.delenv("MIXPREC_FUSE_SILU_QUANT", raising=False)
    monkeypatch.delenv("MIXPREC_KERNEL", raising=False)
    monkeypatch.delenv("MIXPREC_X_WGMMA_ORDER", raising=False)
    from vllm_mixprec.kernels import cuda
    monkeypatch.setattr(cuda, "has_wgmma", lambda device=None: True)
    monkeypatch.setattr(cuda, "x_wgmma_order_for", lambda m, n, k, device=None: m > 64)

    def key(mode):
        monkeypatch.setenv("MIXPREC_X_WGMMA_ORDER", mode)
        cc = CompilationConfig(compile_ranges_endpoints=[8192])
        cp.install(cc)
        return cc.compute_hash()

    keys = {mode: key(mode) for mode in ("1", "codes", "input", "0")}
    assert len(set(keys.values())) == 4, keys
    assert key("input") == keys["input"] and key("1") == keys["1"] and key("input_fused") == keys["1"]
    orders = [cp.WgmmaActOrder(), cp.WgmmaActOrder(all_shapes=True), cp.WgmmaActOrder(input_order=True),
              cp.WgmmaActOrder(impls=("cuda", "reference"))]
    assert len({p.uuid() for p in orders}) == len(orders)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("smooth", [False, True])
def test_wgmma_order_pass_keeps_the_numbers(seeded, fused_act_quant, smooth, device):
    """RMSNorm + the traced quantizer + the GEMM, compiled with WgmmaActOrder: the GEMM node reads
    the permuted codes with x_wgmma_order=True (the CPU reference reads them back; on an sm_90 GPU
    the csrc wgmma kernel by TMA), and the outputs are the eager ones bit for bit."""
    if device == "cuda":
        from vllm_mixprec.kernels import cuda
        if not cuda.has_wgmma():
            pytest.skip("no wgmma kernel here (needs an sm_90 GPU and an sm_90a build)")
    layer = _layer(seeded, n=64, k=256, smooth=smooth, device=device)  # K >= N: wgmma_order_pays
    impl = layer.mixprec_impl = "reference" if device == "cpu" else "cuda"  # (cuda: repacked per call)

    def norm_then_linear(x):
        h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return kernels.apply_linear(layer, h, None)

    x = (torch.randn(96, 256, generator=seeded) * 2).to(torch.bfloat16).to(device)
    order = cp.WgmmaActOrder(impls=(impl,))
    out, _ = _compiled(norm_then_linear, x, fusion=cp.MixprecPostGrad([order]))
    assert order.rewritten == 1
    want = norm_then_linear(x).float()  # eager: natural order; Inductor may skip a bf16 rounding
    assert float((out.float() - want).norm() / want.norm()) < 0.02
    plain, _ = _compiled(norm_then_linear, x, fusion=cp.MixprecPostGrad([]))
    torch.testing.assert_close(out, plain, rtol=0, atol=0)  # the same graph without the pass


def test_wgmma_order_only_where_it_was_measured_to_pay(seeded, fused_act_quant):
    """wgmma_order_pays: K >= N (o_proj, down) and N >= 8192 (gate_up, the 70B QKV); a QKV of
    Llama-3-8B's size (K < N < 8192) keeps the natural order (0.96-1.03x on the H200: its compiled
    quantizer, fused into RMSNorm, reads the row twice). A skipped layer's graph is untouched."""
    assert cp.wgmma_order_pays(28672, 4096) and cp.wgmma_order_pays(4096, 14336)
    assert cp.wgmma_order_pays(57344, 8192) and cp.wgmma_order_pays(8192, 28672)  # Llama-3-70B
    assert cp.wgmma_order_pays(4096, 4096) and cp.wgmma_order_pays(8192, 8192)  # o_proj
    assert cp.wgmma_order_pays(10240, 8192)  # Llama-3-70B's QKV
    assert not cp.wgmma_order_pays(6144, 4096) and not cp.wgmma_order_pays(4097, 4096)
    assert not cp.wgmma_order_pays(8191, 4096)
    layer = _layer(seeded, n=192, k=128)  # K < N < 8192: natural

    def quant_then_linear(x):
        return kernels.apply_linear(layer, x * 2, None)

    x = torch.randn(80, 128, generator=seeded).to(torch.bfloat16)
    order = cp.WgmmaActOrder(impls=("reference",))
    out, _ = _compiled(quant_then_linear, x, fusion=cp.MixprecPostGrad([order]))
    assert order.rewritten == 0
    forced = cp.WgmmaActOrder(impls=("reference",), all_shapes=True)
    out_forced, _ = _compiled(quant_then_linear, x, fusion=cp.MixprecPostGrad([forced]))
    assert forced.rewritten == 1
    torch.testing.assert_close(out_forced, out, rtol=0, atol=0)


class _PermuteDtypes:
    """A pass after the plugin's that records the dtype of every tensor the graph permutes."""

    def __init__(self):
        self.dtypes = []

    def is_applicable_for_range(self, compile_range):
        return True

    def __call__(self, graph):
        self.dtypes = [n.args[0].meta["val"].dtype for n in graph.nodes
                       if n.op == "call_function" and n.target == torch.ops.aten.permute.default]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("before", ["norm", "silu"])
@pytest.mark.parametrize("smooth", [False, True])
def test_wgmma_input_order_moves_the_permutation_before_the_quantizer(seeded, fused_act_quant, smooth,
                                                                      before, device):
    """input_order: the traced quantizer permutes its float input instead of its int8 codes (one
    fused kernel on the GPU instead of float codes written for a second one), with the very same
    codes, so the outputs equal the codes-permuting compile's bit for bit."""
    if device == "cuda":
        from vllm_mixprec.kernels import cuda
        if not cuda.has_wgmma():
            pytest.skip("no wgmma kernel here (needs an sm_90 GPU and an sm_90a build)")
    layer = _layer(seeded, n=64, k=256, smooth=smooth, device=device)
    impl = layer.mixprec_impl = "reference" if device == "cpu" else "cuda"

    def norm_then_linear(x):
        h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return kernels.apply_linear(layer, h, None)

    def silu_then_linear(gate_up):
        return kernels.apply_linear(layer, ref.silu_and_mul(gate_up), None)

    fn, width = (norm_then_linear, 256) if before == "norm" else (silu_then_linear, 512)
    x = (torch.randn(96, width, generator=seeded) * 2).to(torch.bfloat16).to(device)
    outs = {}
    for input_order in (False, True):
        order = cp.WgmmaActOrder(impls=(impl,), all_shapes=True, input_order=input_order)
        seen = _PermuteDtypes()
        outs[input_order], _ = _compiled(fn, x, fusion=cp.MixprecPostGrad([order, seen]))
        assert order.rewritten == 1 and order.input_ordered == int(input_order)
        # the quantizer's float32 input (after the smoothing division), or else its int8 codes
        assert seen.dtypes == [torch.float32 if input_order else torch.int8]
    torch.testing.assert_close(outs[True], outs[False], rtol=0, atol=0)
    want = fn(x).float()
    assert float((outs[True].float() - want).norm() / want.norm()) < 0.02


class _Repermute:
    """After WgmmaActOrder (codes): give its permute node other dims (K = 256: all of them size 4,
    so the shapes stay), then apply the order patterns if asked."""

    def __init__(self, dims, apply=True):
        self.dims, self.apply, self.matched = list(dims), apply, 0

    def is_applicable_for_range(self, compile_range):
        return True

    def __call__(self, graph):
        for n in graph.nodes:
            if n.op == "call_function" and n.target == torch.ops.aten.permute.default:
                n.args = (n.args[0], self.dims)
        if self.apply:
            self.matched += cp._order_patterns().apply(graph)


def test_wgmma_input_order_leaves_other_permutations_alone(seeded, fused_act_quant):
    """The pattern ignores integers: the same ops permuting the codes some other way (here the
    64-k chunks swapped with the rows of 4-byte units) are not the wgmma order (_is_wgmma_order),
    and stay as they are; the wgmma one is moved."""
    layer = _layer(seeded, n=64, k=256)

    def linear(x):
        return kernels.apply_linear(layer, x * 2, None)

    x = torch.randn(80, 256, generator=seeded).to(torch.bfloat16)
    outs = {}
    for dims, apply in (([0, 2, 1, 3, 4], True), ([0, 2, 1, 3, 4], False), (F.WGMMA_ORDER_ROWS_PERMUTE, True)):
        order = cp.WgmmaActOrder(impls=("reference",), all_shapes=True)
        again = _Repermute(dims, apply)
        outs[tuple(dims), apply], _ = _compiled(linear, x, fusion=cp.MixprecPostGrad([order, again]))
        assert order.rewritten == 1 and again.matched == int(dims == F.WGMMA_ORDER_ROWS_PERMUTE)
    torch.testing.assert_close(outs[(0, 2, 1, 3, 4), True], outs[(0, 2, 1, 3, 4), False], rtol=0, atol=0)
    want = linear(x).float()  # the wgmma order moved before the quantizer: the layer's numbers
    assert float((outs[tuple(F.WGMMA_ORDER_ROWS_PERMUTE), True].float() - want).norm() / want.norm()) < 0.02


def test_wgmma_input_order_after_vllms_ir_rms_norm(seeded, fused_act_quant):
    """In vLLM 0.26 the plugin's passes see RMSNorm as the vLLM IR op (vllm_ir.fused_add_rms_norm,
    lowered after them): the quantizer after it is matched all the same, and the permutation
    reads the op's output (the smoothing division included)."""
    import vllm.ir.ops as ir_ops

    layer = _layer(seeded, n=64, k=256, smooth=True)

    def add_norm_then_linear(x, res, w):
        y, r = ir_ops.fused_add_rms_norm(x, res, w, 1e-6)
        return kernels.apply_linear(layer, y, None), r

    args = [(torch.randn(96, 256, generator=seeded) * 2).to(torch.bfloat16) for _ in range(2)]
    w = torch.randn(256, generator=seeded).to(torch.bfloat16)
    order = cp.WgmmaActOrder(impls=("reference",), all_shapes=True, input_order=True)
    seen = _PermuteDtypes()
    torch._dynamo.reset()
    for a in args:
        torch._dynamo.mark_dynamic(a, 0)
    out, res = torch.compile(add_norm_then_linear, fullgraph=True, options={
        cp.HOOK: cp.MixprecPostGrad([order, seen]), "fx_graph_cache": False})(*args, w)
    assert (order.rewritten, order.input_ordered, seen.dtypes) == (1, 1, [torch.float32])
    want, want_res = add_norm_then_linear(*args, w)
    torch.testing.assert_close(res, want_res, rtol=0, atol=0)
    assert float((out.float() - want.float()).norm() / want.float().norm()) < 0.02


def test_wgmma_input_order_says_which_quantizers_it_could_not_move(seeded, fused_act_quant, caplog):
    """A quantizer the pattern cannot see (here mixprec::silu_mul_quantize_act, an opaque op)
    keeps the permuted codes, with the layer's numbers, and the pass warns, once, how many of a
    graph's quantizers were left so: no silent fallback to the other mode. The traced quantizer
    beside it is moved."""
    layer = _layer(seeded, n=64, k=256)
    weights = (layer.qweight, layer.group_scale, layer.group_offset, layer.channel_scale)

    def opaque_and_traced(gate_up):
        q, s = torch.ops.mixprec.silu_mul_quantize_act(gate_up, None)
        y = torch.ops.mixprec.w4a8_gemm(q, s, *weights, None, gate_up.dtype, "reference")
        return y, kernels.apply_linear(layer, gate_up[:, :256] * 2, None)

    gate_up = torch.randn(80, 512, generator=seeded).to(torch.bfloat16)
    order = cp.WgmmaActOrder(impls=("reference",), all_shapes=True, input_order=True)
    seen = _PermuteDtypes()
    with caplog.at_level(logging.WARNING, logger="vllm.mixprec"):
        outs, _ = _compiled(opaque_and_traced, gate_up, fusion=cp.MixprecPostGrad([order, seen]))
    assert (order.rewritten, order.input_ordered) == (2, 1)
    assert sorted(map(str, seen.dtypes)) == ["torch.float32", "torch.int8"]
    assert "MIXPREC_X_WGMMA_ORDER=input: 1 of 2 quantizers in a graph still permute their codes" in caplog.text
    want = opaque_and_traced(gate_up)
    torch.testing.assert_close(outs[0], want[0], rtol=0, atol=0)
    assert float((outs[1].float() - want[1].float()).norm() / want[1].float().norm()) < 0.02


@pytest.mark.parametrize("norm", ["native", "vllm_ir"])
def test_wgmma_input_order_on_a_decoder_piece(seeded, fused_act_quant, repo_module, norm):
    """What vLLM compiles between two attentions of a Llama decoder (bench_compiled_linear's
    piece: o_proj, add + RMSNorm, gate_up, SiLU-and-mul, down, add + RMSNorm, QKV): all four GEMMs
    read the wgmma order and all four quantizers permute their input (the standalone one of o_proj
    and the three fused ones), with the codes-permuting compile's numbers bit for bit; so does
    input_fused (Inductor's realize_reads_threshold raised: the same ops, fused further)."""
    import vllm.ir.ops as ir_ops

    bench = repo_module("benchmarks/bench_compiled_linear.py")
    hidden, n_qkv, inter = 256, 384, 512
    layers = [_layer(seeded, n=n, k=k) for n, k in
              ((hidden, hidden), (2 * inter, hidden), (hidden, inter), (n_qkv, hidden))]
    fn = (bench.piece_fn(*layers) if norm == "native" else
          bench.piece_fn(*layers, add_rms_norm=lambda x, r, w: ir_ops.fused_add_rms_norm(x, r, w, 1e-6)))
    x = [(torch.randn(80, hidden, generator=seeded) * 2).to(torch.bfloat16) for _ in range(2)]
    w = [(torch.rand(hidden, generator=seeded) + 0.5).to(torch.bfloat16) for _ in range(2)]
    outs = {}
    for mode in ("codes", "input", "input_fused"):
        input_order = mode != "codes"
        order = cp.WgmmaActOrder(impls=("reference",), all_shapes=True, input_order=input_order)
        seen = _PermuteDtypes()
        torch._dynamo.reset()
        for a in x:
            torch._dynamo.mark_dynamic(a, 0)
        options = {cp.HOOK: cp.MixprecPostGrad([order, seen]), "fx_graph_cache": False}
        if mode == "input_fused":
            options["realize_reads_threshold"] = cp.INPUT_FUSED_REALIZE_READS
        outs[mode] = torch.compile(fn, fullgraph=True, options=options)(*x, *w)
        assert (order.rewritten, order.input_ordered) == (4, 4 if input_order else 0)
        assert seen.dtypes == [torch.float32 if input_order else torch.int8] * 4
    for mode in ("input", "input_fused"):
        for got, codes in zip(outs[mode], outs["codes"]):
            torch.testing.assert_close(got, codes, rtol=0, atol=0)
    for got, want in zip(outs["input"], fn(*x, *w)):  # eager: the same numbers up to codes moved by one
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.05  # (1-2 % seen)


def test_compiled_linear_benchmark_flags_marlin_rows_and_refuses_prefill_batches(repo_module, tmp_path, capsys):
    """--compare marlin (marlin_bad): a row is bad when an arm is far from its eager function, the
    two arms' outputs are unrelated (a wrong layout: ~1.4), or the SiLU-op arm's pass replaced
    nothing where a SiLU-and-mul is (or something where none is); --profile's split counts the
    C++ GEMM kernels only; and bad flags (--ms past the graphs compiled without the wgmma order
    pass, --silu-op past its compile range or without --compare marlin, --profile < 0) are
    refused, each naming itself."""
    bench = repo_module("benchmarks/bench_compiled_linear.py")
    good = {"mixprec_rel_err_vs_eager": 1e-3, "marlin_w4a16_rel_err_vs_eager": 0.0, "mixprec_rel_err_vs_marlin": 0.12}
    assert not bench.marlin_bad(good)
    silu = {"mixprec_silu_op_rel_err_vs_eager": 1e-3, "silu_op_matched": 1, "silu_op_expected": True}
    assert not bench.marlin_bad({**good, **silu})
    assert not bench.marlin_bad({**good, **silu, "silu_op_matched": 0, "silu_op_expected": False})
    ops = {"mixprec_decode_ops_rel_err_vs_eager": 1e-3, "mixprec_decode_ops_replaced": [4, 2, 1],
           "mixprec_decode_ops_expected": [4, 2, 1]}
    assert not bench.marlin_bad({**good, **ops})
    for change in ({"mixprec_decode_ops_replaced": [4, 0, 1]}, {"mixprec_decode_ops_replaced": [0, 0, 0]},
                   {"mixprec_decode_ops_replaced": [4, 2, 0]}, {"mixprec_decode_ops_rel_err_vs_eager": 0.2}):
        assert bench.marlin_bad({**good, **ops, **change}), change
    for change in ({"mixprec_rel_err_vs_eager": 0.2}, {"marlin_w4a16_rel_err_vs_eager": 0.2},
                   {"mixprec_rel_err_vs_marlin": 1.4}, {"mixprec_rel_err_vs_marlin": float("nan")},
                   {**silu, "mixprec_silu_op_rel_err_vs_eager": 0.2}, {**silu, "silu_op_matched": 0},
                   {**silu, "silu_op_expected": False}):
        assert bench.marlin_bad({**good, **change}), change
    # --profile's split: the C++ GEMM kernels, not Inductor's kernels named after the GEMM node
    # they were fused next to (session 82's first profile counted those as GEMMs)
    times = {"void mixprec::(anonymous namespace)::w4a8_decode_kernel<1, 1, 2, 4>(mixprec::W4A8KernelParams)": 20.0,
             "void marlin::Marlin<1125899906909960l, 256, 1>(int4 const*)": 30.0,
             "triton_red_fused__to_copy_abs_amax_mean_w4a8_gemm_where_5": 4.0,
             "triton_poi_fused_marlin_gemm_mul_silu_slice_1": 1.5, "_quant_act_chunk_codes_kernel": 2.0}
    assert bench.split_kernels(times) == (50.0, 7.5)
    for argv, message in ((["--compare", "marlin", "--ms", "16", "128"], "--ms 128 with --compare marlin"),
                          (["--compare", "marlin", "--silu-op", "--ms", "64"], "--ms 64 with --silu-op"),
                          (["--silu-op"], "--silu-op: only with --compare marlin"),
                          (["--decode-ops"], "--decode-ops: only with --compare marlin"),
                          (["--compare", "marlin", "--triton-ops"], "--triton-ops: only with --decode-ops"),
                          (["--compare", "marlin", "--silu-plans", "16/128"], "--silu-plans: only with --decode-ops"),
                          (["--compare", "marlin", "--decode-ops", "--silu-plans", "17/128"], "'17/128': expected N/V"),
                          (["--compare", "marlin", "--decode-ops", "--silu-plans", "8"], "'8': expected N/V"),
                          (["--compare", "marlin", "--launch-arms", "gemm_pdl=0"], "--launch-arms: only with --decode-ops"),
                          (["--compare", "marlin", "--decode-ops", "--launch-arms", "decode_preload=0"],
                           "OPTION one of gemm_pdl"),
                          (["--compare", "marlin", "--decode-ops", "--launch-arms", "decode_preload_max_m=33"],
                           "decode_preload_max_m takes an integer from 0 to 32"),
                          (["--compare", "marlin", "--decode-ops", "--launch-arms", "gemm_pdl"], "gemm_pdl takes 0 or 1"),
                          (["--compare", "marlin", "--decode-ops", "--launch-arms-silu-op"],
                           "--launch-arms-silu-op: only with --launch-arms"),
                          (["--compare", "marlin", "--profile", "-1"], "--profile=-1")):
        with pytest.raises(SystemExit) as e:
            bench.main(["--out", str(tmp_path), *argv])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_served_pieces_against_marlin_on_the_h100(repo_module):
    """Session 82's decode as served (bench_compiled_linear --compare marlin, run 4: every arm
    compiled once at vLLM's size hint), read from its files as docs/BENCHMARKS.md reads them: at
    M <= 16 the four GEMMs are >= 1.2x Marlin's on both pieces, the pieces less (the 70B one
    1.06-1.13x), because the kernels between the GEMMs cost over twice Marlin's; the SiLU op
    (MIXPREC_FUSE_SILU_QUANT=1) is faster on both pieces at M <= 8."""
    import json
    import pathlib

    bench = repo_module("benchmarks/bench_compiled_linear.py")
    run = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-06-s82/run4"
    rows = [r for f in ("served-marlin", "served-marlin-70b")
            for r in json.loads((run / f / "bench_compiled_marlin.json").read_text())["rows"] if r["M"] <= 16]
    assert sorted({(r["layer"], r["M"]) for r in rows}) == [(p, m) for p in ("piece", "piece_70b")
                                                             for m in (1, 2, 4, 8, 16)]
    for r in rows:
        ours, marlin = (bench.split_kernels(r[f"{v}_kernels_us"]) for v in ("mixprec", "marlin_w4a16"))
        assert marlin[0] / ours[0] >= 1.2 and ours[1] > 2.3 * marlin[1], r["M"]
        assert not bench.marlin_bad(r) and r["silu_op_matched"] > 0
        if r["M"] <= 8:
            assert r["mixprec_silu_op_us"] < r["mixprec_us"], (r["layer"], r["M"])
    ratio = {p: [r["marlin_over_mixprec"] for r in rows if r["layer"] == p] for p in ("piece", "piece_70b")}
    assert 1.17 <= min(ratio["piece"]) and max(ratio["piece"]) < 1.32
    assert 1.06 <= min(ratio["piece_70b"]) and max(ratio["piece_70b"]) < 1.14


def test_decode_ops_against_marlin_on_the_h100(repo_module):
    """Session 83's runs, read from their files as docs/BENCHMARKS.md "Session 83 (H100)" reads them.
    Run 1 (bench_compiled_linear --compare marlin --silu-op --decode-ops): the decode ops replaced all
    four quantizers and both norms of each piece and made both pieces faster at every M; at M <= 16
    the 8B piece is 1.26-1.43x Marlin's and the 70B piece 1.17-1.19x (short of 1.2x). Run 2: served,
    the pass matched vLLM's pieces alike; the norm op alone has the reference's codes and is slower
    than Inductor's fused kernel (its gain is the GEMM it starts early)."""
    import json
    import pathlib

    bench = repo_module("benchmarks/bench_compiled_linear.py")
    run = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-06-s83/run1"
    rows = [r for f in ("served-marlin", "served-marlin-70b")
            for r in json.loads((run / f / "bench_compiled_marlin.json").read_text())["rows"]]
    assert sorted({(r["layer"], r["M"]) for r in rows}) == [(p, m) for p in ("piece", "piece_70b")
                                                             for m in (1, 2, 4, 8, 16, 32)]
    for r in rows:
        assert not bench.marlin_bad(r) and r["mixprec_decode_ops_replaced"] == [4, 2], (r["layer"], r["M"])
        assert r["mixprec_decode_ops_us"] < r["mixprec_us"], (r["layer"], r["M"])
    ratio = {p: [r["marlin_over_mixprec_decode_ops"] for r in rows if r["layer"] == p and r["M"] <= 16]
             for p in ("piece", "piece_70b")}
    assert 1.26 <= min(ratio["piece"]) and max(ratio["piece"]) < 1.44
    assert 1.165 <= min(ratio["piece_70b"]) and max(ratio["piece_70b"]) < 1.2
    # run 2: served, the pass matched vLLM's pieces as the benchmark's (the middle ones: 4 and 2)
    log = (run.parent / "run2/decode-ops-serve/serve-w4a8.log").read_text()
    kinds = re.findall(r"(\d+) traced quantizers became mixprec::quantize_act, (\d+) of them fused", log)
    assert sorted(kinds) == [("1", "0"), ("3", "1"), ("4", "2")]
    # and alone, the norm op gives the reference's codes but is no faster than Inductor's fusion
    for width in ("8b", "70b"):
        alone = json.loads((run.parent / f"run2/act-quant-{width}/bench_act_quant.json").read_text())["rows"]
        inductor = {r["M"]: r["dynamic_us"] for r in alone if r["quant"] == "amax"}
        ops = [r for r in alone if r["quant"].startswith("op-")]
        assert len(ops) == 6 and all(r["codes_differ"] == 0.0 for r in ops)
        assert all(r["dynamic_us"] > inductor[r["M"]] for r in ops), width


def test_csrc_norm_op_and_served_decode_ops_on_the_h100(repo_module):
    """Session 84's run, read from its files as docs/BENCHMARKS.md "Session 84 (H100)" reads them. Alone,
    the csrc norm op has the reference's codes and beats the Triton kernel at every M and width. In the
    pieces the default (csrc op) is faster than with the Triton op at every M: 8B 1.28-1.44x Marlin's at
    M <= 16, 70B 1.21x at M = 1 and under 1.2x at 2-16. Served A-B-A: both rounds of the decode ops have
    a lower median TPOT than Inductor's quantizers at concurrency 1 and 8."""
    import json
    import pathlib

    bench = repo_module("benchmarks/bench_compiled_linear.py")
    run = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-06-s84"
    rows = [r for f in ("served-marlin", "served-marlin-70b")
            for r in json.loads((run / "run1" / f / "bench_compiled_marlin.json").read_text())["rows"]]
    assert sorted({(r["layer"], r["M"]) for r in rows}) == [(p, m) for p in ("piece", "piece_70b")
                                                             for m in (1, 2, 4, 8, 16, 32)]
    for r in rows:
        assert not bench.marlin_bad(r) and r["mixprec_decode_ops_triton_norm_replaced"] == [4, 2], (r["layer"], r["M"])
        assert r["mixprec_decode_ops_us"] < r["mixprec_decode_ops_triton_norm_us"] < r["mixprec_us"], (r["layer"], r["M"])
    ratio = {(r["layer"], r["M"]): r["marlin_over_mixprec_decode_ops"] for r in rows}
    small = (1, 2, 4, 8, 16)
    assert 1.275 <= min(ratio["piece", m] for m in small) and max(ratio["piece", m] for m in small) < 1.45
    assert ratio["piece_70b", 1] >= 1.2 and all(1.18 <= ratio["piece_70b", m] < 1.2 for m in small[1:])
    for width in ("8b", "70b"):
        alone = json.loads((run / f"run1/act-quant-{width}/bench_act_quant.json").read_text())["rows"]
        triton = {r["M"]: r["dynamic_us"] for r in alone if r["quant"] == "op-w0"}
        csrc = [r for r in alone if r["quant"] == "op-cuda"]
        assert len(csrc) == 3 and all(r["codes_differ"] == 0.0 and r["dynamic_us"] < triton[r["M"]] for r in csrc)
    served = [json.loads(line) for n in (1, 2, 3)
              for line in (run / f"serve-aba/results/aba-{n}/ab.jsonl").read_text().splitlines()]
    for conc in (1, 8):
        tpot = {}
        for r in served:
            if r["concurrency"] == conc and r["status"] == "ok":
                tpot.setdefault(r["arm"], []).append(r["metrics"]["median_tpot_ms"])
        assert len(tpot["w4a8kv4"]) == 2 and max(tpot["w4a8kv4"]) < min(tpot["w4a8kv4-inductorquant"]), conc


def test_csrc_silu_op_on_the_h100(repo_module):
    """Session 86's run of session 85's SiLU-and-mul + quantizer op, read from its files as
    docs/BENCHMARKS.md "Session 86 (H100)" reads them. Its GPU tests passed (bit for bit the
    reference's two torch ops). Alone, at every cluster size, it has the reference's codes; Triton's
    split rows beat it at M = 1 and 16 on both widths, clusters of 2 beat Triton at M = 64; and
    cuda.silu_quant_cluster_for's choice is within 0.05 us of the fastest cluster size at every
    point (in sample: the rule was set from these rows). In the 70B piece it saves 0.8 us or more
    at M = 1 and 4, and is within 0.5 us at 16."""
    import json
    import pathlib
    import xml.etree.ElementTree as ET

    from vllm_mixprec.kernels import cuda

    run = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-07-s86"
    cases = ET.parse(run / "run1-ops/pytest-gpu-decode-ops.xml").getroot().iter("testcase")
    silu = [c for c in cases if "silu_mul_quantize_act" in c.get("name")]
    passed = [c for c in silu if not any(c.find(t) is not None for t in ("failure", "error", "skipped"))]
    assert len(passed) >= 60 and not any(c.find(t) is not None for c in silu for t in ("failure", "error"))
    for width, k in (("8b", 14336), ("70b", 28672)):
        rows = json.loads((run / f"run1-ops/act-quant-{width}/bench_act_quant.json").read_text())["rows"]
        ops = [r for r in rows if r["quant"].startswith("sop-")]
        assert ops and all(r["codes_differ"] == 0.0 and r["max_code_diff"] == 0 for r in ops)
        triton = {r["M"]: r["dynamic_us"] for r in ops if r["quant"] == "sop-triton"}
        by_cluster = {}
        for r in ops:
            if r["quant"] != "sop-triton":
                by_cluster.setdefault(r["M"], {})[r["max_cluster"]] = r["dynamic_us"]
        assert sorted(by_cluster) == [1, 16, 64] and sorted(triton) == [1, 16, 64]
        for m, times in by_cluster.items():
            assert (min(times.values()) > triton[m]) == (m <= 16), (width, m)
            assert times[cuda.silu_quant_cluster_for(m, k)] <= min(times.values()) + 0.05, (width, m)
    piece = json.loads((run / "run2-piece70b/served-marlin-70b/bench_compiled_marlin.json").read_text())["rows"]
    saved = {r["M"]: r["mixprec_decode_ops_us"] - r["mixprec_decode_ops_silu_op_us"] for r in piece
             if r["mixprec_decode_ops_silu_op_replaced"] == [4, 2, 1]}
    assert sorted(saved) == [1, 4, 16] and min(saved[1], saved[4]) >= 0.8 and abs(saved[16]) < 0.5, saved


def test_piece_launch_options_and_silu_plans_on_the_h100():
    """Session 87's two runs (benchmarks/results/2026-12-07-s87/), read as docs/BENCHMARKS.md
    "Session 87 (H100)" reads them (each arm's mean over three rounds minus the default's). Run 1:
    the SiLU op's 16-CTA plans launch and match the reference's codes; alone, Triton's split rows
    still beat every csrc plan at M <= 16 on both widths; in the 70B piece the csrc op beats its
    Triton kernels at M = 1 and the 16/128 plan gains nothing; the weight preload is worth over 3 us
    at M = 1, under 1 at 16, where preloading in every build does not pay. Run 2 (steady rounds):
    PDL is worth over 5 us a piece at M = 1 and 4 alike, with IDP.4A on or off at M = 1, and IDP.4A
    about 2 us at M = 1; the default is within 1.18-1.19x Marlin at M = 4."""
    import json
    import pathlib
    import statistics

    run = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-07-s87"

    def costs(path):
        rows = json.loads((run / path / "served-marlin-70b/bench_compiled_marlin.json").read_text())["rows"]
        assert all(v == [4, 2, int("silu" in k)] for r in rows for k, v in r.items() if k.endswith("_replaced"))
        return {r["M"]: {v.removeprefix("mixprec_decode_ops_"): statistics.mean(r[f"{v}_us_rounds"])
                         - statistics.mean(r["mixprec_decode_ops_us_rounds"])
                         for v in (key.removesuffix("_us_rounds") for key in r if key.endswith("_us_rounds"))
                         if v.startswith("mixprec_decode_ops_")} for r in rows}, {r["M"]: r for r in rows}

    assert "119 passed" in (run / "run1/pytest-silu.log").read_text()
    for width in ("8b", "70b"):
        rows = json.loads((run / f"run1/act-quant-{width}/bench_act_quant.json").read_text())["rows"]
        ops = [r for r in rows if r["quant"].startswith("sop-")]
        assert ops and all(r["codes_differ"] == 0.0 and r["max_code_diff"] == 0 for r in ops)
        assert any(r["quant"] == "sop-cuda16v128" for r in ops)
        triton = {r["M"]: r["dynamic_us"] for r in ops if r["quant"] == "sop-triton"}
        for m in (1, 4, 16):
            assert min(r["dynamic_us"] for r in ops if r["M"] == m and r["quant"] != "sop-triton") > triton[m]
        assert min(r["dynamic_us"] for r in ops if r["M"] == 64) < triton[64]
    cost, _ = costs("run1")
    assert sorted(cost) == [1, 4, 16]
    assert cost[1]["triton_silu"] - cost[1]["silu_op"] > 1.5
    assert all(cost[m]["silu_op_c16v128"] > cost[m]["silu_op"] - 0.3 for m in cost)
    assert cost[1]["gemm_pdl0"] > 5.0 and cost[1]["decode_preload_max_m0"] > 3.0  # (its M = 4 row: noise)
    assert 0.0 < cost[16]["decode_preload_max_m0"] < 1.0 and cost[16]["decode_preload_max_m32"] > 0.0
    cost, rows = costs("run2")
    assert sorted(cost) == [1, 4] and rows[4]["drift"] < 0.01
    assert min(cost[1]["gemm_pdl0"], cost[4]["gemm_pdl0"]) > 5.0
    assert 1.5 < cost[1]["decode_dp4a0"] < 3.0 and cost[1]["gemm_pdl0_decode_dp4a0"] - cost[1]["gemm_pdl0"] > 1.0
    assert 1.18 < rows[4]["marlin_w4a16_us"] / rows[4]["mixprec_decode_ops_us"] < 1.19
    assert all(cost[m]["silu_op"] < -0.5 for m in cost)


def _piece_rows(folder):
    """A bench_compiled_linear --compare marlin run's rows by M, each arm's pass having replaced the
    piece's 4 quantizers, 2 norms and (SiLU-op arms) 1 SiLU-and-mul."""
    import json

    got = json.loads((folder / "bench_compiled_marlin.json").read_text())["rows"]
    assert all(v == [4, 2, int("silu" in k)] for r in got for k, v in r.items() if k.endswith("_replaced"))
    return {r["M"]: r for r in got}


def test_quant_ops_as_dependents_in_the_pieces_on_the_h100():
    """Session 88's runs 2 and 3 (benchmarks/results/2026-12-07-s88/), read as docs/BENCHMARKS.md
    "Session 88 (H100)" reads them: quant_ops_pdl (the quantizer ops as programmatic dependents of
    the decode GEMM before them, which lets them launch once its CTAs are past their own wait) is
    faster than the default of then in every round at every M of the 70B piece (1-64), by 1.6-9.9 us
    a round, and on the 8B piece by 1.0-2.3 us on the mean at M = 1, 4, 16; its GPU tests passed and
    memcheck found nothing, and each arm's error against the eager piece is the same with it; with
    the SiLU op too the 70B piece is >= 1.2x Marlin at every M <= 16. So it is the default now."""
    import pathlib
    import statistics

    from vllm_mixprec.kernels import cuda

    run = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-07-s88"
    assert "346 passed" in (run / "run2-quant-ops-pdl/pytest-gpu-quant-ops-pdl.log").read_text()
    assert "ERROR SUMMARY: 0 errors" in (run / "run2-quant-ops-pdl/sanitize/summary.txt").read_text()

    def gain(r, arm):  # the arm's rounds minus the default's, round by round
        return [a - b for a, b in zip(r[f"mixprec_decode_ops_{arm}_us_rounds"], r["mixprec_decode_ops_us_rounds"])]

    big = {**_piece_rows(run / "run2-quant-ops-pdl/served-marlin-70b"),
           **_piece_rows(run / "run3-quant-ops-pdl-more/served-marlin-70b")}
    assert sorted(big) == [1, 2, 4, 8, 16, 32, 64]
    for m, r in big.items():
        assert max(gain(r, "quant_ops_pdl1")) < -1.5, m
        for arm in ("", "_silu_op"):  # the same outputs: each arm's error against eager is unchanged
            assert r[f"mixprec_decode_ops{arm}_quant_ops_pdl1_rel_err_vs_eager"] == pytest.approx(
                r[f"mixprec_decode_ops{arm}_rel_err_vs_eager"], rel=1e-3, abs=1e-6), (m, arm)
        if m <= 16:
            both = statistics.mean(r["marlin_w4a16_us_rounds"]) / statistics.mean(
                r["mixprec_decode_ops_silu_op_quant_ops_pdl1_us_rounds"])
            assert both >= 1.2, (m, both)
    small = _piece_rows(run / "run3-quant-ops-pdl-more/served-marlin-8b")
    assert sorted(small) == [1, 4, 16]
    assert all(statistics.mean(gain(r, "quant_ops_pdl1")) < -0.9 for r in small.values())
    if cuda.available():  # the built library's default
        assert cuda.set_launch_options()["quant_ops_pdl"] == 1


def test_default_pieces_and_the_silu_op_served_on_the_h100():
    """Session 89's runs (benchmarks/results/2026-12-07-s89/), read as docs/BENCHMARKS.md
    "Session 89 (H100)" reads them. With session 88's default compiled in, the csrc GEMM tests, the
    decode ops' tests and the compile passes' GPU tests passed. The default is >= 1.2x Marlin W4A16
    at every M <= 16 on the 70B piece (means of three rounds; M = 2, 4 again in a second run), and
    turning quant_ops_pdl off is slower in every round. The SiLU op is 0.3-2.3 us faster on the
    70B piece, 0.1-0.7 us slower on the 8B piece, and served (8B shape, A-B-A) it ties the
    default within the A rounds' drift: it stays opt-in."""
    import json
    import pathlib
    import statistics

    run = pathlib.Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-07-s89"
    tests = run / "run1-tests-pieces"
    assert "2604 passed" in (tests / "pytest-gpu-csrc.log").read_text()
    assert "169 passed" in (tests / "pytest-gpu-decode-ops.log").read_text()
    assert "13 passed" in (tests / "pytest-gpu-compile-passes.log").read_text()
    for log in tests.glob("pytest-gpu-*.log"):
        assert " failed" not in log.read_text(), log.name

    def mean(r, arm):
        return statistics.mean(r[f"{arm}_us_rounds"])

    for path, ms in (("run1-tests-pieces/served-marlin-70b", [1, 2, 4, 8, 16]),
                     ("run2-pieces-again/served-marlin-70b-again", [2, 4])):
        big = _piece_rows(run / path)
        assert sorted(big) == ms
        for m, r in big.items():
            assert mean(r, "marlin_w4a16") / mean(r, "mixprec_decode_ops") >= 1.2, (path, m)
            assert min(a - b for a, b in zip(r["mixprec_decode_ops_quant_ops_pdl0_us_rounds"],
                                             r["mixprec_decode_ops_us_rounds"])) > 0.8, (path, m)
            assert mean(r, "mixprec_decode_ops_silu_op") < mean(r, "mixprec_decode_ops"), (path, m)
    small = _piece_rows(run / "run2-pieces-again/served-marlin-8b")
    assert sorted(small) == [1, 4, 16]
    assert all(mean(r, "mixprec_decode_ops_silu_op") > mean(r, "mixprec_decode_ops") for r in small.values())

    served = {}  # (round, concurrency) -> (arm, output tokens/s)
    for i in (1, 2, 3):
        for line in (run / f"serve-aba/results/aba-{i}/ab.jsonl").read_text().splitlines():
            rec = json.loads(line)
            assert rec["status"] == "ok" and rec["metrics"]["failed"] == 0
            served[i, rec["concurrency"]] = (rec["arm"], rec["metrics"]["output_throughput"])
    assert sorted(served) == [(i, c) for i in (1, 2, 3) for c in (1, 8)]
    for c in (1, 8):
        a = [served[i, c][1] for i in (1, 3)]
        assert served[1, c][0] == served[3, c][0] == "w4a8kv4" and served[2, c][0] == "w4a8kv4-siluop"
        drift = (max(a) - min(a)) / statistics.mean(a)
        assert abs(served[2, c][1] / statistics.mean(a) - 1) <= drift, c  # a tie: within the A rounds' drift
    assert not cp.decode_silu_op({})  # so the default stays off


def test_compiled_linear_benchmark_flags_orders_not_timed_as_meant(repo_module):
    """bench_compiled_linear's order A/B (order_bad): a row is bad when a compile rewrote not every
    GEMM, moved not every quantizer, or ended further from the eager layer than the natural one."""
    bench = repo_module("benchmarks/bench_compiled_linear.py")
    good = {"gemms": 4, "rewritten": 8, "input_rewritten": 8, "input_ordered": 8,
            "natural_rel_err_vs_eager": 0.01, "wgmma_order_rel_err_vs_eager": 0.012,
            "wgmma_input_order_rel_err_vs_eager": 0.0}
    assert not bench.order_bad(good)
    for change in ({"rewritten": 0, "input_rewritten": 0, "input_ordered": 0}, {"rewritten": 6},
                   {"input_ordered": 4}, {"input_rewritten": 6, "input_ordered": 6},
                   {"wgmma_order_rel_err_vs_eager": 0.03}, {"wgmma_input_order_rel_err_vs_eager": 0.5}):
        assert bench.order_bad({**good, **change}), change
    # a variant compiled once where another compiled twice (Dynamo resets between compiles)
    assert not bench.order_bad({**good, "input_rewritten": 4, "input_ordered": 4})
    fused = {**good, "fused_rewritten": 4, "fused_input_ordered": 4, "wgmma_input_fused_rel_err_vs_eager": 0.0}
    assert not bench.order_bad(fused)  # --input-fused
    for change in ({"fused_input_ordered": 0}, {"fused_rewritten": 2, "fused_input_ordered": 2},
                   {"wgmma_input_fused_rel_err_vs_eager": 0.2}):
        assert bench.order_bad({**fused, **change}), change
    rule = {**good, "rule_rewritten": 3, "wgmma_rule_rel_err_vs_eager": 0.01}  # --rule: some GEMMs only
    assert not bench.order_bad(rule)
    assert bench.order_bad({**rule, "wgmma_rule_rel_err_vs_eager": 0.2})


@pytest.mark.parametrize("layers, extra", [(["qkv", "piece"], ["--input-fused", "--rule", "--rounds", "3"]),
                                          (["down"], ["--compare", "w4ax"]),
                                          (["qkv", "piece"], ["--compare", "marlin", "--ms", "5", "--silu-op",
                                                              "--decode-ops", "--triton-ops", "--silu-plans", "16/128",
                                                              "--launch-arms", "decode_preload_max_m=0",
                                                              "gemm_pdl=0,decode_preload_max_m=0",
                                                              "--launch-arms-silu-op", "--profile", "2"])])
def test_compiled_linear_benchmark_runs_end_to_end_on_the_cpu(repo_module, monkeypatch, tmp_path, layers, extra):
    """bench_compiled_linear's main() on the CPU at small shapes, its GPU parts stubbed (the
    reference GEMM, a 1 us timer): every variant compiles, runs, is compared and checked, and
    the JSON is written, so that a GPU session does not find a broken script."""
    import functools
    import json

    import triton

    bench = repo_module("benchmarks/bench_compiled_linear.py")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "IMPL", "reference")
    monkeypatch.setattr(bench, "gpu_ready", lambda: True)
    monkeypatch.setattr(bench, "CASES", {"qkv": ("norm", 384, 256), "down": ("silu", 256, 512)})
    monkeypatch.setattr(bench, "PIECES", {"piece": (256, 384, 512)})
    monkeypatch.setattr(bench.baq, "PROFILE_TOKENS", 96)
    monkeypatch.setattr(bench.baq, "time_us", lambda f, x: (f(*x), 1.0)[1])
    monkeypatch.setattr(triton.testing, "do_bench", lambda f, **kw: (f(), 1e-3)[1])
    monkeypatch.setattr(cp, "WgmmaActOrder", functools.partial(cp.WgmmaActOrder, impls=("reference",)))
    monkeypatch.setattr(kernels, "_W4AX_QUANT", kernels._W4AX_QUANT)  # the W4Ax arms set these
    monkeypatch.setattr(kernels, "_FUSE_ACT_QUANT", kernels._FUSE_ACT_QUANT)
    for mode in ("_NORM_QUANT_CUDA", "_SILU_QUANT_CUDA", "_SILU_QUANT_PLAN"):  # and the decode-ops arms these
        monkeypatch.setattr(kernels, mode, getattr(kernels, mode))
    options = {"decode_preload_max_m": 16, "gemm_pdl": 1}  # csrc's launch options, as --launch-arms sees them
    launches = []

    def set_launch_options(**changed):
        if changed:
            launches.append(changed)
        options.update(changed)
        return dict(options)
    monkeypatch.setattr(bench.cuda, "set_launch_options", set_launch_options)
    assert bench.main(["--out", str(tmp_path), "--ms", "80", "--layers", *layers, *extra]) == 0
    report = json.loads(next(tmp_path.glob("bench_compiled_*.json")).read_text())
    rows = report["rows"]
    assert report["device"] == "cpu" and [r["layer"] for r in rows] == layers
    if "w4ax" in extra:
        assert set(rows[0]["w4ax_kernel_ops"]) == {"w4ax_linear"} and set(rows[0]["w4ax_traced_ops"]) == {"w4ax_gemm"}
    elif "marlin" in extra:
        # the CPU's Marlin arm multiplies by Marlin's own dequantized weight: two 4-bit
        # quantizations of one float weight, close but not equal
        assert all(r["M"] == 5 and 0.0 < r["mixprec_rel_err_vs_marlin"] < bench.MARLIN_AGREEMENT
                   and r["marlin_over_mixprec"] == r["marlin_over_mixprec_silu_op"] == 1.0 for r in rows), rows
        assert [r["silu_op_matched"] > 0 for r in rows] == [False, True]  # the piece has the SiLU-and-mul
        # the decode ops replaced every quantizer, those after the two norms with them, the SiLU's
        # with it unless the arm says not (with SiluMulQuantFusion first, the SiLU's is that pass's);
        # the SiLU arms only where there is a SiLU-and-mul
        names = ("mixprec_decode_ops", "mixprec_decode_ops_silu_op", "mixprec_decode_ops_triton_silu",
                 "mixprec_decode_ops_triton_norm", "mixprec_decode_ops_silu", "mixprec_decode_ops_silu_op_c16v128",
                 "mixprec_decode_ops_decode_preload_max_m0", "mixprec_decode_ops_gemm_pdl0_decode_preload_max_m0",
                 "mixprec_decode_ops_silu_op_decode_preload_max_m0",
                 "mixprec_decode_ops_silu_op_gemm_pdl0_decode_preload_max_m0")
        arms = [{v: r.get(f"{v}_replaced") for v in names} for r in rows]
        assert arms == [
            {"mixprec_decode_ops": [1, 1, 0], "mixprec_decode_ops_silu_op": None, "mixprec_decode_ops_triton_silu": None,
             "mixprec_decode_ops_triton_norm": [1, 1, 0], "mixprec_decode_ops_silu": [1, 1, 0],
             "mixprec_decode_ops_silu_op_c16v128": None, "mixprec_decode_ops_decode_preload_max_m0": [1, 1, 0],
             "mixprec_decode_ops_gemm_pdl0_decode_preload_max_m0": [1, 1, 0],
             "mixprec_decode_ops_silu_op_decode_preload_max_m0": None,
             "mixprec_decode_ops_silu_op_gemm_pdl0_decode_preload_max_m0": None},
            {"mixprec_decode_ops": [4, 2, 0], "mixprec_decode_ops_silu_op": [4, 2, 1],
             "mixprec_decode_ops_triton_silu": [4, 2, 1], "mixprec_decode_ops_triton_norm": [4, 2, 0],
             "mixprec_decode_ops_silu": [3, 2, 0], "mixprec_decode_ops_silu_op_c16v128": [4, 2, 1],
             "mixprec_decode_ops_decode_preload_max_m0": [4, 2, 0],
             "mixprec_decode_ops_gemm_pdl0_decode_preload_max_m0": [4, 2, 0],
             "mixprec_decode_ops_silu_op_decode_preload_max_m0": [4, 2, 1],
             "mixprec_decode_ops_silu_op_gemm_pdl0_decode_preload_max_m0": [4, 2, 1]}], arms
        # each call of a launch-option arm set its options, then put back the defaults of those same options
        sets, restores = launches[0::2], launches[1::2]
        assert len(sets) == len(restores) and {str(c) for c in sets} == {str({"decode_preload_max_m": 0}),
                                                                       str({"gemm_pdl": 0, "decode_preload_max_m": 0})}
        assert all(r == {name: {"decode_preload_max_m": 16, "gemm_pdl": 1}[name] for name in c}
                   for c, r in zip(sets, restores)), launches
        assert options == {"decode_preload_max_m": 16, "gemm_pdl": 1}
        # the profiler saw each variant's ops (on the CPU: aten and mixprec ops, not kernels)
        assert all(r[f"{v}_kernels_us"] and r[f"{v}_other_kernels_us"] >= 0.0
                   for r in rows for v in ("mixprec", "marlin_w4a16", "mixprec_silu_op", *names)
                   if f"{v}_us" in r), rows
    else:
        # each variant compiled once, at the profiling run's size: none again at the timed M
        # (a reset before each compile used to drop the earlier variants' code: own_code)
        assert all(r[f] == r["gemms"] for r in rows
                   for f in ("rewritten", "input_rewritten", "fused_rewritten")), rows
        assert all("input_fused_speedup" in r for r in rows)
        # the rule (K >= N or N >= 8192) permutes the piece's o_proj and down only at these sizes
        assert [r["rule_rewritten"] for r in rows] == [0, 2]
        assert all(len(r["wgmma_rule_us_rounds"]) == 3 and r["drift"] == 0.0 for r in rows)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("norm,silu", [("vllm_ir", "off"), ("vllm_ir", "decode_ops"), ("vllm_ir", "pass"),
                                       ("native", "off"), ("native", "decode_ops")])
def test_decode_quant_ops_on_a_decoder_piece(seeded, fused_act_quant, repo_module, norm, silu, device):
    """DecodeQuantOps on bench_compiled_linear's piece (o_proj, add + RMSNorm, gate_up, SiLU-and-mul,
    down, add + RMSNorm, QKV): every traced quantizer becomes an op, the two after vLLM's IR norm
    mixprec::add_rms_norm_quantize_act with it (none after the native norm, which the pass does not
    match), the SiLU's mixprec::silu_mul_quantize_act with the SiLU-and-mul where the pass's `silu`
    is on (MIXPREC_DECODE_SILU_OP), and the rest mixprec::quantize_act. With SiluMulQuantFusion
    first, the SiLU's quantizer is that pass's. The residual and the QKV output are within 5 % of
    eager's (Inductor's SiLU-and-mul skips a bf16 rounding: a code may move by one, and the down
    projection with it). On CUDA the GEMMs are the Triton ones and the ops the csrc kernels where
    built (else Triton's)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    bench = repo_module("benchmarks/bench_compiled_linear.py")
    hidden, n_qkv, inter = 256, 384, 512
    layers = [_layer(seeded, n=n, k=k, smooth=i == 1, device=device) for i, (n, k) in
              enumerate(((hidden, hidden), (2 * inter, hidden), (hidden, inter), (n_qkv, hidden)))]
    fn = bench.piece_fn(*layers, **({"add_rms_norm": bench.ir_add_rms_norm} if norm == "vllm_ir" else {}))
    x = [(torch.randn(24, hidden, generator=seeded) * 2).to(torch.bfloat16).to(device) for _ in range(2)]
    w = [(torch.rand(hidden, generator=seeded) + 0.5).to(torch.bfloat16).to(device) for _ in range(2)]
    ops, silu_pass = cp.DecodeQuantOps(silu=silu != "off"), cp.SiluMulQuantFusion()
    torch._dynamo.reset()
    for a in x:
        torch._dynamo.mark_dynamic(a, 0)
    hook = cp.MixprecPostGrad([silu_pass, ops] if silu == "pass" else [ops])
    out, res = torch.compile(fn, fullgraph=True, options={cp.HOOK: hook, "fx_graph_cache": False})(*x, *w)
    fused = 2 if norm == "vllm_ir" else 0
    want = {"off": (0, 4, fused, 0), "decode_ops": (0, 4, fused, 1), "pass": (1, 3, fused, 0)}[silu]
    assert (silu_pass.matched, ops.quantizers, ops.norms, ops.silus) == want
    assert ops.last == want[1:]
    for got, want in zip((out, res), fn(*x, *w)):  # (0.5-2.1 % seen)
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.05


def test_decode_quant_ops_leave_a_norm_read_elsewhere(seeded, fused_act_quant):
    """A normed row that something besides the quantizer reads stays vLLM's norm (the quantizer
    still becomes the op); so does a norm with variance_size. Numbers as eager."""
    import vllm.ir.ops as ir_ops

    layer = _layer(seeded, n=64, k=256)

    def read_twice(x, res, w):
        y, r = ir_ops.fused_add_rms_norm(x, res, w, 1e-6)
        return kernels.apply_linear(layer, y, None), r, y * 2

    def partial_variance(x, res, w):
        y, r = ir_ops.fused_add_rms_norm(x, res, w, 1e-6, 128)
        return kernels.apply_linear(layer, y, None), r

    args = [(torch.randn(8, 256, generator=seeded) * 2).to(torch.bfloat16) for _ in range(2)]
    w = (torch.rand(256, generator=seeded) + 0.5).to(torch.bfloat16)
    for fn in (read_twice, partial_variance):
        ops = cp.DecodeQuantOps()
        torch._dynamo.reset()
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        outs = torch.compile(fn, fullgraph=True, options={
            cp.HOOK: cp.MixprecPostGrad([ops]), "fx_graph_cache": False})(*args, w)
        assert (ops.quantizers, ops.norms) == (1, 0), fn.__name__
        for got, want in zip(outs, fn(*args, w)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_decode_quant_ops_reference_and_fake(seeded):
    """On CPU tensors the two ops are the reference's functions; their fakes give the shapes."""
    x, res = (torch.randn(3, 64, generator=seeded).to(torch.bfloat16) for _ in range(2))
    w, sm = torch.rand(64, generator=seeded).to(torch.bfloat16) + 0.5, torch.rand(64, generator=seeded) + 0.5
    for got, want in ((torch.ops.mixprec.quantize_act(x, sm), ref.quantize_act(x, sm)),
                      (torch.ops.mixprec.add_rms_norm_quantize_act(x, res, w, 1e-5, sm),
                       ref.add_rms_norm_quantize_act(x, res, w, 1e-5, sm))):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fres = mode.from_tensor(x), mode.from_tensor(res)
        q, s = torch.ops.mixprec.quantize_act(fx, None)
        q2, s2, r2 = torch.ops.mixprec.add_rms_norm_quantize_act(fx, fres, None, 1e-5, None)
    assert [(t.shape, t.dtype) for t in (q, s, q2, s2, r2)] == [
        ((3, 64), torch.int8), ((3,), torch.float32), ((3, 64), torch.int8), ((3,), torch.float32),
        ((3, 64), torch.bfloat16)]


def test_install_decode_quant_ops(monkeypatch):
    """DecodeQuantOps is on by default (MIXPREC_DECODE_QUANT_OPS=1), alone or after
    SiluMulQuantFusion, split at 64 tokens and applied up to there, with the wgmma order past it;
    0 leaves it out; a bad value names the variable."""
    from vllm.config.utils import Range
    monkeypatch.setattr(cp, "_wgmma_order_applies", lambda: False)
    monkeypatch.delenv("MIXPREC_DECODE_QUANT_OPS", raising=False)
    monkeypatch.delenv("MIXPREC_FUSE_SILU_QUANT", raising=False)
    assert cp.decode_quant_ops() and cp.wanted()
    alone = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.install(alone) and [type(p) for p in alone.inductor_compile_config[cp.HOOK].passes] == [
        cp.DecodeQuantOps]
    assert alone.compile_ranges_endpoints == [cp.DECODE_OPS_MAX_TOKENS, 8192]
    monkeypatch.setattr(cp, "_wgmma_order_applies", lambda: True)  # an H100 with the csrc build
    both = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.install(both) and [type(p) for p in both.inductor_compile_config[cp.HOOK].passes] == [
        cp.DecodeQuantOps, cp.WgmmaActOrder]
    assert both.compile_ranges_endpoints == [cp.DECODE_OPS_MAX_TOKENS, 8192]  # one split serves both
    monkeypatch.setattr(cp, "_wgmma_order_applies", lambda: False)
    monkeypatch.setenv("MIXPREC_FUSE_SILU_QUANT", "1")
    cc = SimpleNamespace(inductor_compile_config={}, compile_ranges_endpoints=[8192])
    assert cp.wanted() and cp.install(cc)
    hook = cc.inductor_compile_config[cp.HOOK]
    assert [type(p) for p in hook.passes] == [cp.SiluMulQuantFusion, cp.DecodeQuantOps]
    assert cc.compile_ranges_endpoints == [cp.FUSE_MAX_TOKENS, cp.DECODE_OPS_MAX_TOKENS, 8192]
    ops = hook.get(cp.DecodeQuantOps)
    assert ops.is_applicable_for_range(Range(1, 64)) and ops.is_applicable_for_range(Range(33, 64))
    assert not ops.is_applicable_for_range(Range(65, 8192))
    monkeypatch.setenv("MIXPREC_DECODE_QUANT_OPS", "0")
    monkeypatch.setenv("MIXPREC_FUSE_SILU_QUANT", "0")
    assert not cp.wanted() and not cp.install(SimpleNamespace(inductor_compile_config={}))
    monkeypatch.setenv("MIXPREC_DECODE_QUANT_OPS", "on")
    with pytest.raises(ValueError, match="MIXPREC_DECODE_QUANT_OPS='on': expected 1"):
        cp.install(SimpleNamespace(inductor_compile_config={}))


def test_decode_silu_op_setting(monkeypatch):
    """MIXPREC_DECODE_SILU_OP (off by default) sets DecodeQuantOps' `silu`, which is in its uuid
    (vLLM's compile cache keeps one graph a setting); a bad value names the variable."""
    monkeypatch.delenv("MIXPREC_DECODE_SILU_OP", raising=False)
    assert not cp.decode_silu_op() and not cp.DecodeQuantOps().silu
    monkeypatch.setenv("MIXPREC_DECODE_SILU_OP", "1")
    assert cp.DecodeQuantOps().silu and not cp.DecodeQuantOps(silu=False).silu
    assert cp.DecodeQuantOps().uuid() != cp.DecodeQuantOps(silu=False).uuid()
    monkeypatch.setenv("MIXPREC_DECODE_SILU_OP", "yes")
    with pytest.raises(ValueError, match="MIXPREC_DECODE_SILU_OP='yes': expected 0"):
        cp.DecodeQuantOps()
