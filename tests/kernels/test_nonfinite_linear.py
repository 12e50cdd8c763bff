"""The runtime non-finite policy of the linear ops, per kernel implementation
(docs/RELIABILITY.md): a token row holding a NaN or an Inf gives a NaN output row; the other
rows are unchanged. On the CPU: the reference and the Triton interpreter (with GPU float
semantics); on a GPU (`-m gpu`): Triton and the csrc ops on the device.
"""
import pytest
import torch

from vllm_mixprec import kernels  # noqa: F401  (registers torch.ops.mixprec.*)
from vllm_mixprec import reference as ref

HAS_CUDA = torch.cuda.is_available()
IMPLS = [pytest.param("reference", "cpu", id="reference-cpu"),
         pytest.param("triton", "cpu", id="triton-interpreter",
                      marks=pytest.mark.skipif(HAS_CUDA, reason="the GPU runs triton-cuda")),
         pytest.param("triton", "cuda", id="triton-cuda", marks=pytest.mark.gpu),
         pytest.param("cuda", "cuda", id="csrc-cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _gpu_semantics(request):
    if not HAS_CUDA:
        request.getfixturevalue("gpu_float_semantics")


@pytest.mark.parametrize("impl,device", IMPLS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a8_linear_nonfinite_row_is_nan(impl, device, value, dtype):
    g = torch.Generator().manual_seed(0)
    m, k, n = 5, 256, 64
    t = ref.quantize_weight_lqq(torch.randn(n, k, generator=g), 64)
    x = torch.randn(m, k, generator=g).to(dtype)
    x[1, 17] = value
    x[3, 0] = value
    x[3, 200] = 1.0
    dev = {name: v.to(device) for name, v in t.items()}
    if impl == "cuda":
        from vllm_mixprec.kernels import cuda as csrc
        if not csrc.available():
            pytest.skip(f"csrc ops not built: {csrc.load_error()}")

    def run(v):
        return torch.ops.mixprec.w4a8_linear(v.to(device), dev["qweight"], dev["group_scale"],
                                             dev["group_offset"], dev["channel_scale"], None, None,
                                             impl).cpu()

    y = run(x)
    bad = torch.tensor([False, True, False, True, False])
    assert torch.isnan(y[bad]).all(), y[bad]
    assert torch.isfinite(y[~bad]).all()
    assert torch.equal(y[~bad], run(x[~bad]))
