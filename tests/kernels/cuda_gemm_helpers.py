"""Shared helpers of the csrc GEMM GPU tests (test_cuda_gemm.py, test_cuda_gemm_wgmma.py), of the
add_rms_norm_quantize_act tests (test_triton_gemm.py) and of scripts/sanitize_cuda_driver.py."""
import torch

DEV = "cuda"
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}


def skip_without_csrc_ops():
    """pytest.skip unless there is a CUDA GPU (sm80+) and the csrc ops are built."""
    import pytest

    from vllm_mixprec.kernels import cuda

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not cuda.available():
        pytest.skip(f"csrc ops not built: {cuda.load_error()}")
    if not cuda.supports_device(torch.device(DEV)):
        pytest.skip("the csrc ops need sm80+")


def capture_after_warmup(f, x, graph=None, same_stream=False):
    """f(x) twice on a side stream (lazy set-up settles outside the capture), then f(x) captured
    into graph (a new CUDAGraph by default), on that side stream if same_stream. Returns
    (graph, the captured output, the side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            f(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = graph if graph is not None else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side if same_stream else None):
        y = f(x)
    return graph, y, side


def replays_with_new_inputs(graph, x_static, seed, trials=3):
    """For each trial: a fresh random input copied into x_static, the graph replayed and the
    device synchronised; yields the input."""
    for trial in range(trials):
        x_new = torch.randn(x_static.shape, device=DEV, dtype=x_static.dtype, generator=_gen(seed + trial))
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        yield x_new


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def random_lqq(n, k, g, gen):
    """Valid LiquidQuant tensors drawn directly (q * s + a <= 255, a >= 9), on the GPU."""
    q = torch.randint(0, 16, (n, k), generator=gen, device=DEV, dtype=torch.int32)
    s = torch.randint(1, 17, (n, k // g), generator=gen, device=DEV, dtype=torch.int32)
    room = 255 - 15 * s - 9  # offsets 9 .. 255 - 15 s
    a = 9 + (torch.rand((n, k // g), generator=gen, device=DEV) * (room + 1)).floor().to(torch.int32).clamp_max(room)
    qw = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    cs = torch.rand(n, generator=gen, device=DEV) * 0.002 + 0.0001  # fp16 outputs stay finite
    return qw, s.to(torch.uint8), a.to(torch.uint8), cs


def random_act(m, k, gen):
    xq = torch.randint(-127, 128, (m, k), generator=gen, device=DEV, dtype=torch.int32).to(torch.int8)
    xs = torch.rand(m, generator=gen, device=DEV) + 0.01
    return xq, xs


def poison(numel, dtype):
    """Leave NaN (or 0x7F.. for ints) in the allocator block the next output will reuse."""
    t = torch.empty(numel, dtype=dtype, device=DEV)
    t.fill_(float("nan") if dtype.is_floating_point else 0x7F)
    del t


def check_close(y, y_ref, out_dtype, check_rel=True):
    assert y.dtype == out_dtype and y.shape == y_ref.shape
    assert bool(torch.isfinite(y).all()), "non-finite output (unwritten or overflow)"
    diff = (y.double() - y_ref).abs()
    bound = EPS[out_dtype] * y_ref.abs() + 1e-6 * float(y_ref.abs().max()) + 1e-30
    bad = int((diff > bound).sum())
    assert bad == 0, f"{bad} elements off; max diff {float(diff.max()):.3g}"
    if check_rel:
        rel = float((y.double() - y_ref).norm() / y_ref.norm().clamp_min(1e-30))
        assert rel < 1e-3 + EPS[out_dtype], rel


def assert_norm_quant_close(got, want):
    """add_rms_norm_quantize_act against the reference: the residual bit for bit; the sum of
    squares is added in another order (and rsqrt may differ by an ulp), which can move a normed
    value by one rounding of its dtype, hence a scale by 2^-7 and a few codes by one."""
    (q, s, r), (q_ref, s_ref, r_ref) = [tuple(t.cpu() for t in ts) for ts in (got, want)]
    torch.testing.assert_close(r, r_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(s, s_ref, rtol=2.0 ** -7, atol=0, equal_nan=True)
    diff = (q.int() - q_ref.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01


def decoder_chain(layers, xq, xs, residual, weight):
    """A decoder layer's decode ops as the compiled graphs chain them: GEMM, add + RMSNorm +
    quantizer, GEMM, SiLU-and-mul + quantizer, GEMM, quantizer; every op reads the one before."""
    from vllm_mixprec.kernels import cuda

    gemm = torch.ops.mixprec_C.w4a8_gemm
    (pq1, gp1, cs1), (pq2, gp2, cs2), (pq3, gp3, cs3) = layers
    y1 = gemm(xq, xs, pq1, gp1, cs1, None, torch.bfloat16)
    q1, s1, r1 = cuda.add_rms_norm_quantize_act(y1, residual, weight, 1e-5, None)
    y2 = gemm(q1, s1, pq2, gp2, cs2, None, torch.bfloat16)
    q2, s2 = cuda.silu_mul_quantize_act(y2)
    y3 = gemm(q2, s2, pq3, gp3, cs3, None, torch.bfloat16)
    q3, s3 = cuda.quantize_act(y3)
    return y1, q1, s1, r1, y2, q2, s2, y3, q3, s3
