"""kernels.select_impl / prepare_linear: a forced kernel that this machine cannot run is
refused when the weights are loaded (start-up), naming MIXPREC_KERNEL and the fix, instead
of failing inside the first forward pass with a dispatcher error."""
import pytest
import torch

from vllm_mixprec import kernels
from vllm_mixprec import reference as ref
from vllm_mixprec.quant_methods.config import MixPrecConfig

CPU = torch.device("cpu")
BASE = {"quant_method": "mixprec", "format_version": 1, "weight_scheme": "w4a8", "weight_bits": 4,
        "act_bits": 8, "group_size": 64, "kv_scheme": "none"}


@pytest.mark.parametrize("value", ["cuda12", "Triton", "ref"])
def test_unknown_mixprec_kernel_value(value):
    with pytest.raises(ValueError, match=rf"MIXPREC_KERNEL='{value}' is not one of .*unset MIXPREC_KERNEL"):
        kernels.forced_impl({"MIXPREC_KERNEL": value})
    assert kernels.forced_impl({"MIXPREC_KERNEL": ""}) is None
    assert kernels.forced_impl({"MIXPREC_KERNEL": "triton"}) == "triton"


def test_forced_cuda_on_a_cpu_layer_is_refused_at_load(vllm_tp1, seeded, monkeypatch):
    """The csrc library loads on this machine (it is built), but the weights are on the CPU:
    the old check (`_cuda.available()` only) let it through and the first GEMM died in the
    dispatcher ("Could not run 'mixprec_C::quantize_act' with arguments from the 'CPU' backend")."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    monkeypatch.setattr(kernels, "_FORCED", "cuda")
    layer = RowParallelLinear(256, 128, bias=False, quant_config=MixPrecConfig.from_config(BASE),
                              params_dtype=torch.float16, prefix="model.layers.5.mlp.down_proj")
    for name, t in ref.quantize_weight_lqq(torch.randn(128, 256, generator=seeded), 64).items():
        getattr(layer, name).weight_loader(getattr(layer, name), t)
    with pytest.raises(RuntimeError) as e:
        layer.quant_method.process_weights_after_loading(layer)
    msg = str(e.value)
    assert "model.layers.5.mlp.down_proj: MIXPREC_KERNEL=cuda" in msg, msg
    assert "unset MIXPREC_KERNEL" in msg, msg
    if kernels._cuda.available():
        assert "weights are on cpu" in msg, msg
    else:
        assert "csrc ops are not built" in msg and "pip install -e ." in msg, msg


def test_forced_cuda_without_the_built_ops(monkeypatch):
    """As on a machine where the extension was never compiled (or fails to load)."""
    monkeypatch.setattr(kernels, "_FORCED", "cuda")
    monkeypatch.setattr(kernels._cuda, "available", lambda: False)
    monkeypatch.setattr(kernels._cuda, "load_error", lambda: "no vllm_mixprec/_C*.so")
    with pytest.raises(RuntimeError, match=r"MIXPREC_KERNEL=cuda but the csrc ops are not built "
                                           r"\(no vllm_mixprec/_C\*\.so\); rebuild with `pip install "
                                           r"-e \.`.*unset MIXPREC_KERNEL"):
        kernels.select_impl(CPU)


def test_forced_triton_needs_a_gpu_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "_FORCED", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match=r"MIXPREC_KERNEL=triton but the weights are on cpu.*"
                                           r"TRITON_INTERPRET=1.*unset MIXPREC_KERNEL"):
        kernels.select_impl(CPU, "lm")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.select_impl(CPU) == "triton"


def test_unforced_cpu_uses_the_reference(monkeypatch):
    monkeypatch.setattr(kernels, "_FORCED", None)
    assert kernels.select_impl(CPU) == "reference"


def test_gemm_op_x_wgmma_order_on_cpu_impls():
    """mixprec::w4a8_gemm's x_wgmma_order: the reference reads the wgmma k order (the csrc wgmma
    kernels' TMA path); the Triton kernels do not, and say so."""
    gen = torch.Generator().manual_seed(3)
    t = ref.quantize_weight_lqq(torch.randn(32, 128, generator=gen), 64)
    w = (t["qweight"], t["group_scale"], t["group_offset"], t["channel_scale"])
    xq, xs = ref.quantize_act(torch.randn(3, 128, generator=gen))
    natural = torch.ops.mixprec.w4a8_gemm(xq, xs, *w, None, torch.float32, "reference")
    xw = ref.to_wgmma_act_order(xq)
    assert torch.equal(torch.ops.mixprec.w4a8_gemm(xw, xs, *w, None, torch.float32, "reference", True), natural)
    with pytest.raises(ValueError, match="x_wgmma_order=True .* not by impl='triton'"):
        torch.ops.mixprec.w4a8_gemm(xw, xs, *w, None, torch.float32, "triton", True)


def test_norm_quant_csrc_takes_what_its_kernel_reads():
    """cuda.norm_quant_supports: the csrc add_rms_norm_quantize_act's 16-byte rows (fp16/bf16, K % 8
    == 0, at most kNormMaxK, aligned), weight in x's dtype, float32 smoothing; the rest goes to
    Triton. Its bound is the header's and the Triton kernel's."""
    import re
    from pathlib import Path

    from vllm_mixprec.kernels import cuda
    from vllm_mixprec.kernels.triton import gemm as tg

    ok = cuda.norm_quant_supports
    x = torch.randn(3, 4096, dtype=torch.bfloat16)
    w, sm = torch.rand(4096, dtype=torch.bfloat16), torch.rand(4096)
    assert ok(x, x, w, sm) and ok(x, x, None, None) and ok(x.half(), x.half(), w.half(), None)
    assert not ok(x.float(), x.float(), None, None)
    assert not ok(x, x.half(), w, sm) and not ok(x, x[:2], w, sm)
    assert not ok(x, x, w.half(), sm) and not ok(x, x, w, sm.bfloat16())
    wide = torch.zeros(2, 4104, dtype=torch.bfloat16)
    assert ok(wide[:, 8:4104], wide[:, 8:4104], None, None)  # 16 bytes in: aligned
    assert not ok(wide[:, 4:4100], wide[:, 4:4100], None, None)  # 8 bytes in
    assert not ok(wide[:, :4100], wide[:, :4100], None, None)  # K % 8 != 0
    top = cuda.NORM_QUANT_MAX_K
    assert ok(torch.zeros(1, top, dtype=torch.bfloat16), torch.zeros(1, top, dtype=torch.bfloat16), None, None)
    assert not ok(torch.zeros(1, top + 8, dtype=torch.bfloat16), torch.zeros(1, top + 8, dtype=torch.bfloat16),
                  None, None)
    header = (Path(__file__).parents[2] / "csrc" / "gemm" / "w4a8_gemm.h").read_text()
    assert int(re.search(r"constexpr int kNormMaxK = (\d+);", header).group(1)) == top == tg.NORM_QUANT_MAX_K


def test_silu_quant_csrc_takes_what_its_kernel_reads():
    """cuda.silu_quant_supports: the csrc silu_mul_quantize_act's 16-byte rows of [gate | up]
    (fp16/bf16, K % 8 == 0, aligned), float32 smoothing, K within one cluster (one CTA without
    clusters); the rest goes to Triton. cuda.silu_quant_plan's constants are the header's, and
    its plan the launcher's where the extension is built."""
    import re
    from pathlib import Path

    from vllm_mixprec.kernels import cuda

    def ok(gate_up, smooth=None, clusters=True):
        return cuda.silu_quant_supports(gate_up, smooth, clusters)

    gu = torch.randn(3, 2 * 4096, dtype=torch.bfloat16)
    assert ok(gu) and ok(gu.half(), torch.rand(4096)) and ok(gu, None, False)
    assert not ok(gu.float()) and not ok(gu, torch.rand(4096).bfloat16()) and not ok(gu[0])
    assert not ok(gu[:, :8190]) and not ok(gu[:, :8191])  # K % 8 != 0; an odd width
    wide = torch.zeros(2, 2 * 4096 + 8, dtype=torch.bfloat16)
    assert ok(wide[:, 8:]) and not ok(wide[:, 4:-4]) and not ok(wide[:, :2 * 4092])  # 16 bytes in; 8; K % 8
    assert not ok(gu, torch.rand(4097)[1:])  # smoothing 4 bytes in
    assert not ok(torch.zeros(cuda.SILU_QUANT_MAX_ROWS + 1, 16, dtype=torch.bfloat16))
    # clusters of 8 CTAs (the default) of 1024 threads x 2 vectors of 8 outputs; one such CTA without clusters
    top = cuda.SILU_QUANT_CLUSTER * cuda.SILU_QUANT_MAX_THREADS * cuda.SILU_QUANT_MAX_VECS * 8
    assert ok(torch.zeros(1, 2 * top, dtype=torch.bfloat16)) and not ok(torch.zeros(1, 2 * top + 16, dtype=torch.bfloat16))
    assert ok(torch.zeros(1, 2 * 16384, dtype=torch.bfloat16), None, False)
    assert not ok(torch.zeros(1, 2 * 28672, dtype=torch.bfloat16), None, False)
    # the served rows: Llama-3-8B's 14336 outputs over 4 CTAs, Llama-3-70B's 28672 over 7
    assert cuda.silu_quant_plan(14336) == (4, 448, 1) and cuda.silu_quant_plan(28672) == (7, 512, 1)
    assert cuda.silu_quant_plan(4096) == (1, 512, 1) and cuda.silu_quant_plan(14336, 1) == (1, 896, 2)
    # Hopper's non-portable clusters of up to 16 CTAs, and smaller CTAs
    assert cuda.silu_quant_plan(28672, 16, 128) == (16, 224, 1) and cuda.silu_quant_plan(14336, 16, 128) == (14, 128, 1)
    assert cuda.silu_quant_plan(2 * top, 16) == (16, 1024, 2) and cuda.silu_quant_plan(2 * top + 8, 16) is None
    for bad in ((4096, 17), (4096, 0), (4096, 8, 0), (4096, 8, 2049)):
        assert cuda.silu_quant_plan(*bad) is None, bad
    # the op's cluster size for M rows: about 64 CTAs in all, at least 2 and what the row needs
    assert [cuda.silu_quant_cluster_for(m, 28672) for m in (1, 4, 8, 16, 32, 64, 512)] == [8, 8, 8, 4, 2, 2, 2]
    assert [cuda.silu_quant_cluster_for(m, 14336) for m in (0, 1, 16, 64, 65)] == [8, 8, 4, 2, 2]
    assert cuda.silu_quant_cluster_for(64, 8 * top) == 8  # fits no cluster: the default (the op says why)
    header = (Path(__file__).parents[2] / "csrc" / "gemm" / "w4a8_gemm.h").read_text()
    for name in ("MAX_CLUSTER", "CLUSTER", "CTA_VECS", "MAX_THREADS", "MAX_VECS", "MAX_ROWS"):
        camel = "".join(w.capitalize() for w in name.split("_"))
        value = int(re.search(rf"constexpr int kSiluQuant{camel} = (\d+);", header).group(1))
        assert value == getattr(cuda, f"SILU_QUANT_{name}"), name
    if cuda.has_silu_quant():  # the launcher's own plan, where the extension is built
        plan_of = torch.ops.mixprec_C.silu_mul_quantize_act_plan
        for k in [*range(8, 70000, 8 * 37), 16384, 16392, 28672, top, top + 8, 2 * top, 2 * top + 8, 100, 0]:
            for max_cluster in range(0, 18):
                for cta_vecs in (0, 1, 100, 128, 512, 2048, 2049):
                    want = cuda.silu_quant_plan(k, max_cluster, cta_vecs)
                    assert plan_of(k, max_cluster, cta_vecs) == (list(want) if want else []), (k, max_cluster, cta_vecs)
        # the schema's defaults are cuda's
        args = {a.name: a.default_value for a in torch.ops.mixprec_C.silu_mul_quantize_act.default._schema.arguments}
        assert (args["max_cluster"], args["cta_vecs"]) == (cuda.SILU_QUANT_CLUSTER, cuda.SILU_QUANT_CTA_VECS)


def test_norm_and_silu_quant_ops_trace_on_meta_tensors():
    """Both ops' fakes (torch.compile traces them): the plugin op, and the csrc one where built;
    the same for silu_mul_quantize_act."""
    from vllm_mixprec.kernels import cuda

    x = torch.empty(5, 4096, dtype=torch.bfloat16, device="meta")
    w, sm = torch.empty(4096, dtype=torch.bfloat16, device="meta"), torch.empty(4096, device="meta")
    ops = [torch.ops.mixprec.add_rms_norm_quantize_act]
    if cuda.has_norm_quant():
        ops.append(torch.ops.mixprec_C.add_rms_norm_quantize_act)
    for op in ops:
        q, s, r = op(x, x, w, 1e-5, sm)
        assert (q.shape, q.dtype, s.shape, s.dtype, r.shape, r.dtype) == (
            (5, 4096), torch.int8, (5,), torch.float32, (5, 4096), torch.bfloat16)
    gate_up = torch.empty(5, 2 * 4096, dtype=torch.bfloat16, device="meta")
    ops = [torch.ops.mixprec.silu_mul_quantize_act]
    if cuda.has_silu_quant():
        ops.append(torch.ops.mixprec_C.silu_mul_quantize_act)
    for op in ops:
        q, s = op(gate_up, sm)
        assert (q.shape, q.dtype, s.shape, s.dtype) == ((5, 4096), torch.int8, (5,), torch.float32)

