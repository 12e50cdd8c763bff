"""scripts/inductor_kernels.py: the Triton kernels Inductor generates for a compiled layer, read
on the CPU, checked against Inductor code kept from GPU runs. kernels.w4ax_quant's default and
compile_passes.INPUT_FUSED_REALIZE_READS rest on these counts; their docstrings give them."""
import pathlib
import re
import tarfile

import pytest
import torch

from vllm_mixprec import compile_passes as cp
from vllm_mixprec import kernels

# Inductor's code for six layers compiled three ways on an H200 (session 65, bench_compiled_linear)
S65_CODE = (pathlib.Path(__file__).resolve().parents[1]
            / "benchmarks/results/2026-12-04-s65/compiled-3way/inductor-code.tgz")
# vLLM's compile cache from session 67's served input-order arm (H200): its Dynamo graph and
# Inductor's code for it
S67_SERVED = (pathlib.Path(__file__).resolve().parents[1]
              / "benchmarks/results/2026-12-05-s67/serve/compile-code.tgz")


@pytest.fixture
def tool(repo_module, monkeypatch):
    monkeypatch.setattr(kernels, "_FUSE_ACT_QUANT", True)
    return repo_module("scripts/inductor_kernels.py"), repo_module("benchmarks/bench_compiled_linear.py")


def _launches(tool, seeded, w4ax):
    script, bench = tool
    layer = bench.layer_of(128, 1024, seeded, w4ax, device="cpu", impl="reference")
    x, res = ((torch.randn(5, 1024, generator=seeded)).to(torch.bfloat16) for _ in range(2))
    w = (torch.rand(1024, generator=seeded) + 0.5).to(torch.bfloat16)
    wrapper = script.triton_wrapper(bench.layer_fn("norm", layer), x, res, w)
    return script.launches(wrapper), wrapper


def test_w4a8_quantizer_is_fused_into_the_norm(tool, seeded):
    """As in session 65's GPU code: add + RMSNorm + quantize in one kernel."""
    found, wrapper = _launches(tool, seeded, None)
    assert len(found) == 1 and "rsqrt" in found[0] and "amax" in found[0], found
    assert "torch.ops.mixprec.w4a8_gemm.default(" in wrapper


@pytest.mark.parametrize("perm", ["blocks", "channels"])
@pytest.mark.parametrize("rotation, kernels_traced", [("none", 5), ("hadamard", 15), ("hadamard64", 14)])
def test_w4ax_quantizer_traced_is_many_kernels(tool, seeded, monkeypatch, rotation, kernels_traced,
                                               perm):
    """Traced, the W4Ax quantizer is 5-15 kernels (the gather, the per-block amaxes, one per
    butterfly stage), whichever form its permutation has; by default a compiled W4Ax layer is
    the norm's kernel plus w4ax_linear."""
    w4ax = {"share": 0.25, "rotation": rotation, "perm": perm}
    monkeypatch.setattr(kernels, "_W4AX_QUANT", "traced")
    found, wrapper = _launches(tool, seeded, w4ax)
    assert len(found) == kernels_traced and "torch.ops.mixprec.w4ax_gemm.default(" in wrapper, found
    monkeypatch.setattr(kernels, "_W4AX_QUANT", "kernel")
    found, wrapper = _launches(tool, seeded, w4ax)
    assert len(found) == 1 and "torch.ops.mixprec.w4ax_linear.default(" in wrapper, found


def _kinds(names):
    """triton_red / triton_per / triton_poi of each kernel, in launch order."""
    return [n.split("_fused")[0] for n in names]


@pytest.mark.parametrize("name", ["qkv", "down", "o_proj"])
@pytest.mark.parametrize("variant", ["natural", "wgmma_order", "wgmma_input_order"])
def test_tool_matches_a_gpu_compile(tool, seeded, name, variant):
    """The tool against what Inductor generated on an H200 for the same function (session 65's
    stored code): as many kernels, of the same kinds (red / per / poi), in the same order, the
    first (the fused quantizer) of the same name. The batch dimension is dynamic, as there. (A
    second kernel's name may differ by an op: the GPU's down projection codes kernel has a
    `_to_copy` this one has not.)"""
    script, bench = tool
    before, _, k = bench.CASES[name]
    layer = bench.layer_of(128, k, seeded, None, device="cpu", impl="reference")
    r = lambda *shape: torch.randn(*shape, generator=seeded).to(torch.bfloat16)  # noqa: E731
    x = {"norm": (r(80, k), r(80, k), r(k)), "none": (r(80, k),), "silu": (r(80, 2 * k),)}[before]
    for t in x:
        if t.dim() == 2:
            torch._dynamo.mark_dynamic(t, 0)
    passes = [] if variant == "natural" else [cp.WgmmaActOrder(
        impls=("reference",), all_shapes=True, input_order=variant == "wgmma_input_order")]
    found = script.launches(script.triton_wrapper(bench.layer_fn(before, layer), *x,
                                                  options={cp.HOOK: cp.MixprecPostGrad(passes)}))
    with tarfile.open(S65_CODE) as tar:
        gpu = tar.extractfile(f"inductor-code/{name}_{variant}.py").read().decode()
    gpu = script.launches(gpu)
    assert _kinds(found) == _kinds(gpu), (found, gpu)
    strip = lambda n: re.sub(r"(_to_copy_|_w4a8_gemm|_\d+$)", "", n)  # noqa: E731
    assert [strip(n) for n in found][:1] == [strip(n) for n in gpu][:1], (found, gpu)


def test_piece_with_input_order_splits_the_qkv_quantizer(tool, seeded):
    """A decoder piece (o_proj .. QKV) with the quantizers' input permuted: the QKV's quantizer
    is not fused into the add + RMSNorm before it (the norm writes the permuted float32 values,
    a second kernel quantizes them), as in the graph vLLM served in session 67. With Inductor's
    realize_reads_threshold at compile_passes.INPUT_FUSED_REALIZE_READS (MIXPREC_X_WGMMA_ORDER=
    input_fused) it is, and the piece has the natural order's four kernels; the codes order
    takes seven."""
    script, bench = tool
    hidden, n_qkv, inter = 256, 384, 512
    fn = bench.piece_fn(*(bench.layer_of(n, k, seeded, None, device="cpu", impl="reference") for n, k in
                          ((hidden, hidden), (2 * inter, hidden), (hidden, inter), (n_qkv, hidden))))
    x = [(torch.randn(80, hidden, generator=seeded)).to(torch.bfloat16) for _ in range(2)]
    w = [(torch.rand(hidden, generator=seeded) + 0.5).to(torch.bfloat16) for _ in range(2)]
    found = {}
    for variant in ("natural", "wgmma_order", "wgmma_input_order", "input_fused"):
        passes = [] if variant == "natural" else [cp.WgmmaActOrder(
            impls=("reference",), all_shapes=True, input_order=variant != "wgmma_order")]
        options = {cp.HOOK: cp.MixprecPostGrad(passes)}
        if variant == "input_fused":
            options["realize_reads_threshold"] = cp.INPUT_FUSED_REALIZE_READS
        found[variant] = script.launches(script.triton_wrapper(fn, *x, *w, options=options))
    assert {v: len(f) for v, f in found.items()} == {
        "natural": 4, "wgmma_order": 7, "wgmma_input_order": 5, "input_fused": 4}, found
    split = found["wgmma_input_order"][3]  # the second norm alone: no amax, no codes
    assert "amax" not in split and "rsqrt" in split, found


def test_served_piece_per_order_mode(tool):
    """The piece of the graph vLLM served (layer 0's o_proj .. layer 1's QKV and rotary, vLLM's
    own norm and SiLU-and-mul) in each MIXPREC_X_WGMMA_ORDER mode: natural 6 kernels, the codes
    order by the shape rule 8, input order 7, input_fused (the default) 6. Input order's kernels
    are those the H200 compiled for it when it was served: the same kinds in the same order."""
    script, _ = tool
    fn, args = script.served_submodule(str(S67_SERVED), 2)
    found = {mode: script.launches(script.triton_wrapper(
        fn, *args, options={**options, cp.HOOK: cp.MixprecPostGrad(passes)}))
        for mode, passes, options in script.order_modes(cp)}
    assert {mode: len(f) for mode, f in found.items()} == {"0": 6, "codes": 8, "input": 7, "input_fused": 6}, found
    with tarfile.open(S67_SERVED) as tar:
        codes = [tar.extractfile(m).read().decode() for m in tar.getmembers()
                 if m.isfile() and "/inductor_cache/" in m.name and m.name.endswith(".py")]
    served = next(f for f in map(script.launches, codes)  # the wrapper, not a kernel's own file
                  if "triton_red_fused__to_copy_fused_add_rms_norm_3" in f)
    assert _kinds(found["input"]) == _kinds(served[:7]), (found["input"], served)


def test_input_fused_threshold_keeps_the_decode_kernels(tool):
    """MIXPREC_X_WGMMA_ORDER=input_fused (the default) raises realize_reads_threshold for the
    whole compile, so the decode range (<= 64 tokens, no order pass) sees it too: the served
    piece at 16 tokens keeps the same six kernels (the second add + RMSNorm recomputes the first
    residual instead of writing float32 buffers for it)."""
    script, _ = tool
    fn, args = script.served_submodule(str(S67_SERVED), 2, tokens=16)
    found = {reads: script.launches(script.triton_wrapper(
        fn, *args, options={cp.HOOK: cp.MixprecPostGrad([]),
                            **({"realize_reads_threshold": reads} if reads else {})}))
        for reads in (None, cp.INPUT_FUSED_REALIZE_READS)}
    assert len(found[None]) == 6 and found[None] == found[cp.INPUT_FUSED_REALIZE_READS], found


@pytest.mark.parametrize("tokens", [16, 256])
def test_input_fused_moves_fewer_bytes(tool, tokens):
    """Inductor's own estimate of the bytes the served piece's Triton kernels move: the default
    (input_fused) against the codes rule it replaced, in the decode range (no order pass; only the
    threshold differs: the second norm recomputes the first residual instead of writing it) and
    past 64 tokens (the order pass). On the CPU: 3.03 -> 2.77 MB at 16 tokens, 64.0 -> 44.1 MB at
    256; what the GPU makes of it at decode sizes is unmeasured."""
    script, _ = tool
    fn, args = script.served_submodule(str(S67_SERVED), 2, tokens=tokens)
    modes = {mode: (passes, options) for mode, passes, options in script.order_modes(cp, tokens)}
    mb = {}
    for mode in ("codes", "input_fused"):
        passes, options = modes[mode]
        mb[mode] = script.estimated_mb(script.triton_wrapper(fn, *args, options={
            **options, "benchmark_kernel": True, cp.HOOK: cp.MixprecPostGrad(passes)}))
    assert len(mb["input_fused"]) == 6 and len(mb["codes"]) == (6 if tokens <= 64 else 8), mb
    assert sum(mb["input_fused"]) < (0.95 if tokens <= 64 else 0.8) * sum(mb["codes"]), mb
