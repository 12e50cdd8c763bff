// Torch custom ops of vllm_mixprec (library namespace `mixprec_C`), loaded with
// torch.ops.load_library by vllm_mixprec/kernels/cuda.py. No Python API is used (abi3 build).
// Other csrc/ files add ops with TORCH_LIBRARY_FRAGMENT(mixprec_C, m).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/decode_kv4.h"
#include "gemm/w4a8_gemm.h"

namespace mixprec {

// sm_90a wgmma kernels (csrc/gemm/sm90/w4a8_gemm_wgmma.cu): kernel ids 4..8 of the w4a8_gemm op;
// same arguments and plan struct as the mma.sync kernels. Supported iff the current device is
// sm_90 and the build holds the sm_90a image.
bool w4a8_wgmma_supported();
// splits: -1 stream-K, -2 a cluster pair (a kernel id required), 0 choose (stream-K among the
// candidates iff stream_k_auto, a cluster pair iff pair_auto), > 0 forced.
const char* w4a8_wgmma_make_plan(int M, int N, int K, int group_size, int num_sms, int kernel, int splits,
                                 bool stream_k_auto, bool pair_auto, W4A8Plan* plan);
cudaError_t w4a8_wgmma_launch(const W4A8GemmArgs& args, const W4A8Plan& plan, cudaStream_t stream);

namespace {

OutKind kind_of(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kHalf: return OutKind::kHalf;
    case at::kBFloat16: return OutKind::kBFloat16;
    case at::kFloat: return OutKind::kFloat;
    default: TORCH_CHECK(false, what, " must be float16, bfloat16 or float32, got ", t);
  }
  return OutKind::kFloat;
}

constexpr int kMaxDevices = 64;

// A device attribute, queried once per device (0 = not queried yet; devices past kMaxDevices
// read device 0's).
template <cudaDeviceAttr kAttr>
int device_attribute(int device) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  if (device < 0 || device >= kMaxDevices) device = 0;
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, kAttr, device));
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

int num_sms(int device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }

// Launch options (set_launch_options; defaults chosen on the H100, csrc/gemm/NOTES.md "PDL").
// Read at each launch, so a CUDA graph keeps the options it was captured with.
struct LaunchOptions {
  std::atomic<bool> gemm_pdl{true};  // GEMMs (decode and wgmma) as programmatic dependent launches
  std::atomic<bool> act_quant_one_pass{true};
  // The one-pass quantizer's lean arithmetic (csrc/quant/quantize_act_int8.cu, pack_codes8_lean):
  // the same codes from 1 / scale; false keeps its per-element IEEE division (A/B timing, session 46).
  std::atomic<bool> act_quant_lean{true};
  // The wgmma planner may choose a stream-K launch (persistent grid: data-parallel waves, then the
  // rest of the tiles x K stages split evenly over the SMs). On since session 33; with session
  // 34's refit no pick of the 42 measured Llama rows loses 2 % to the classic grid
  // (csrc/gemm/NOTES.md "Stream-K").
  std::atomic<bool> gemm_stream_k{true};
  // The wgmma planner may choose a cluster pair (two K halves a tile in a cluster of 2 CTAs,
  // summed in shared memory) where the doubled grid is one wave, or for K >= 8192 after a wave of
  // whole tiles (csrc/gemm/NOTES.md "Session 47", "Session 48").
  std::atomic<bool> gemm_cluster_pair{true};
  // The decode kernels (M <= 32) keep the weight bytes unsigned (u8 x s8 MMA, no XOR per byte)
  // and subtract 128 * sum_k x; the same int32 sums. Off until timed (csrc/gemm/NOTES.md "Decode u8").
  std::atomic<bool> decode_u8{false};
  // At M = 1 the decode kernels run IDP.4A on the 4-bit codes (no dequant, no MMA); the same
  // int32 sums. On since session 56: faster on all 7 Llama rows at M = 1 (H200; csrc/gemm/NOTES.md
  // "Session 55", "Session 56").
  std::atomic<bool> decode_dp4a{true};
  // The decode kernels' build at M <= 16: 0, the planner picks the 2-CTA (<= 128 registers) or the
  // 3-CTA (<= 80) build with the kernel (csrc/gemm/NOTES.md "Decode occupancy"); 2 or 3 forces one.
  std::atomic<int> decode_ctas_per_sm{0};
  // The decode kernels read each warp's first batch of weight words before the PDL wait, at
  // M <= this (0: never; 32: every decode M in every build; 9-16: M = 9-16 in the 3-CTA build
  // only). 16: the linear was up to 5 % faster at M <= 8 on the H200 (session 37), and at M = 16
  // in the 3-CTA build (half a batch where a whole one spilled; session 39) but not in the 2-CTA
  // one (csrc/gemm/NOTES.md "Decode preload").
  std::atomic<int> decode_preload_max_m{16};
  // quantize_act splits a few long rows over CTAs of one chunk each (quantize_act_int8_split_kernel):
  // 0 never, 1 its rule (quantize_act_split_chunk: M = 9-32, K >= 8192, 4096 elements a CTA; csrc/gemm/
  // NOTES.md "Session 80"), 1024 / 2048 / 4096 that chunk at every M <= 64 (A/B timing).
  std::atomic<int> act_quant_split{1};
  // On sm_90 the quantizer ops (quantize_act, add_rms_norm_quantize_act, silu_mul_quantize_act) are
  // programmatic dependent launches, and the decode GEMM lets them launch once its CTAs are past
  // their own wait, so a norm or SiLU op after a GEMM is scheduled during the GEMM's last CTAs
  // instead of after it. The same outputs. On since session 88: 1.0-8.7 us faster a Llama decoder
  // piece at M = 1-64 on an H100 (csrc/gemm/NOTES.md "Session 88").
  std::atomic<bool> quant_ops_pdl{true};
};
LaunchOptions& launch_options() {
  static LaunchOptions opts;
  return opts;
}

// Programmatic dependent launches (griddepcontrol) need sm_90; the kernels' code for them is
// compiled for sm_90 only.
bool is_sm90(int device) {
  return device >= 0 && device < kMaxDevices && device_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 9;
}

// quant_ops_pdl on a GPU that has programmatic dependent launches.
bool quant_ops_pdl_on(int device) { return launch_options().quant_ops_pdl.load() && is_sm90(device); }

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda(), "mixprec_C: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == like.device(), "mixprec_C: ", name, " is on ", t.device(), " but the inputs are on ",
              like.device());
}

// A contiguous copy when t is strided or not 16-byte aligned (vector loads need both).
at::Tensor aligned_contiguous(const at::Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// Split-K arrival counters. The kernels reset each tile's counter when its last split arrives,
// so one zeroed buffer per (device, stream) serves every launch on that stream; zeroing per
// launch cost 68 fills and 65 us a decode step (H100 profile, 2026-11-25). Buffers are never
// freed: a captured CUDA graph keeps the pointer it saw. A buffer is not created or grown while
// the stream captures (its fill would only run at replay). vLLM warms up on one stream and
// captures on another, so its graphs still zeroed their own: 64 fills, 62 us a decode step at
// batch 8 (H100 profile, 2026-11-26). A capture now takes the device's largest buffer instead,
// and zeroes its own only if none is large enough. Assumes, as vLLM does, that the model runs
// one launch at a time: graph replays and eager launches never overlap on the device.
at::Tensor split_counters(const at::Tensor& like, int64_t n, const c10::cuda::CUDAStream& stream) {
  struct Pool {
    std::mutex mu;
    std::map<std::pair<int, c10::StreamId>, at::Tensor> live;
    std::vector<at::Tensor> retired;
  };
  static Pool* pool = new Pool();  // leaked on purpose: outlives the CUDA context at exit
  const auto options = like.options().dtype(at::kInt);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capturing));
  const std::lock_guard<std::mutex> lock(pool->mu);
  const auto key = std::make_pair(static_cast<int>(stream.device_index()), stream.id());
  auto it = pool->live.find(key);
  if (it != pool->live.end() && it->second.numel() >= n) return it->second;
  if (capturing != cudaStreamCaptureStatusNone) {
    const at::Tensor* largest = nullptr;
    for (const auto& [stream_key, buffer] : pool->live) {
      if (stream_key.first == key.first && buffer.numel() >= n &&
          (largest == nullptr || buffer.numel() > largest->numel()))
        largest = &buffer;
    }
    return largest != nullptr ? *largest : at::zeros({n}, options);
  }
  at::Tensor fresh = at::zeros({std::max<int64_t>(n, 4096)}, options);
  if (it == pool->live.end()) {
    pool->live.emplace(key, fresh);
  } else {
    pool->retired.push_back(std::move(it->second));
    it->second = fresh;
  }
  return fresh;
}

std::tuple<at::Tensor, at::Tensor> quantize_act(const at::Tensor& x_in, const std::optional<at::Tensor>& smooth_in,
                                                bool wgmma_order) {
  TORCH_CHECK(x_in.is_cuda(), "mixprec_C::quantize_act: x must be a CUDA tensor, got ", x_in.device());
  TORCH_CHECK(x_in.dim() == 2, "mixprec_C::quantize_act: x must be 2-D [M, K], got shape ", x_in.sizes());
  const OutKind x_kind = kind_of(x_in.scalar_type(), "mixprec_C::quantize_act: x");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K > 0 && K < (int64_t{1} << 31) && M < (int64_t{1} << 31),
              "mixprec_C::quantize_act: unsupported shape ", x.sizes());
  TORCH_CHECK(!wgmma_order || K % 64 == 0, "mixprec_C::quantize_act: wgmma_order=True permutes 64-k chunks: K = ", K,
              " must be a multiple of 64");
  at::Tensor smooth;
  OutKind smooth_kind = OutKind::kFloat;
  if (smooth_in.has_value()) {
    smooth = smooth_in->contiguous();
    check_cuda(smooth, x, "smooth");
    TORCH_CHECK(smooth.dim() == 1 && smooth.size(0) == K, "mixprec_C::quantize_act: smooth must have shape [",
                K, "], got ", smooth.sizes());
    smooth_kind = kind_of(smooth.scalar_type(), "mixprec_C::quantize_act: smooth");
  }
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M}, x.options().dtype(at::kFloat));
  if (M == 0) return {q, scale};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  C10_CUDA_CHECK(quantize_act_int8_launch(x.data_ptr(), x_kind, x.stride(0),
                                          smooth.defined() ? smooth.data_ptr() : nullptr, smooth_kind,
                                          q.data_ptr<int8_t>(), scale.data_ptr<float>(), static_cast<int>(M),
                                          static_cast<int>(K), launch_options().act_quant_one_pass.load(),
                                          launch_options().act_quant_lean.load(),
                                          launch_options().act_quant_split.load(), wgmma_order,
                                          quant_ops_pdl_on(x.device().index()), stream));
  return {q, scale};
}

// reference.add_rms_norm_quantize_act: (codes [M, K] int8, scales [M] float32, residual [M, K] in x's
// dtype). Rows as add_rms_norm_quantize_act_launch takes them (kernels/cuda.py:norm_quant_supports).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_quantize_act(
    const at::Tensor& x_in, const at::Tensor& residual_in, const std::optional<at::Tensor>& weight_in, double epsilon,
    const std::optional<at::Tensor>& smooth_in) {
  constexpr const char* op = "mixprec_C::add_rms_norm_quantize_act: ";
  TORCH_CHECK(x_in.is_cuda(), op, "x must be a CUDA tensor, got ", x_in.device());
  TORCH_CHECK(x_in.dim() == 2, op, "x must be 2-D [M, K], got shape ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kHalf || x_in.scalar_type() == at::kBFloat16, op,
              "x must be float16 or bfloat16, got ", x_in.scalar_type());
  check_cuda(residual_in, x_in, "residual");
  TORCH_CHECK(residual_in.sizes() == x_in.sizes() && residual_in.scalar_type() == x_in.scalar_type(), op,
              "residual must match x (", x_in.sizes(), " ", x_in.scalar_type(), "), got ", residual_in.sizes(), " ",
              residual_in.scalar_type());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor residual = residual_in.stride(1) == 1 ? residual_in : residual_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M < (int64_t{1} << 31) && K < (int64_t{1} << 31) && add_rms_norm_quantize_act_supports(static_cast<int>(K)),
              op, "rows of K % 8 == 0 and at most ", kNormMaxK, " columns, got K = ", K);
  at::Tensor weight, smooth;
  if (weight_in.has_value()) {
    weight = weight_in->contiguous();
    check_cuda(weight, x, "weight");
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == K && weight.scalar_type() == x.scalar_type(), op,
                "weight must be [", K, "] of x's dtype ", x.scalar_type(), ", got ", weight.sizes(), " ",
                weight.scalar_type());
  }
  if (smooth_in.has_value()) {
    smooth = smooth_in->contiguous();
    check_cuda(smooth, x, "smooth");
    TORCH_CHECK(smooth.dim() == 1 && smooth.size(0) == K && smooth.scalar_type() == at::kFloat, op,
                "smooth must be [", K, "] float32, got ", smooth.sizes(), " ", smooth.scalar_type());
  }
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M}, x.options().dtype(at::kFloat));
  at::Tensor res_out = at::empty({M, K}, x.options());
  if (M == 0) return {q, scale, res_out};
  const NormQuantArgs args{x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0),
                           weight.defined() ? weight.data_ptr() : nullptr,
                           smooth.defined() ? smooth.data_ptr<float>() : nullptr, q.data_ptr<int8_t>(),
                           scale.data_ptr<float>(), res_out.data_ptr(), static_cast<int>(M), static_cast<int>(K),
                           static_cast<float>(epsilon), kind_of(x.scalar_type(), op),
                           quant_ops_pdl_on(x.device().index())};
  const cudaError_t err =
      add_rms_norm_quantize_act_launch(args, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err != cudaErrorInvalidValue, op, "x's and residual's rows, weight and smooth must start on 16-byte ",
              "boundaries (x row stride ", x.stride(0), ", residual row stride ", residual.stride(0), ")");
  C10_CUDA_CHECK(err);
  return {q, scale, res_out};
}

// reference.silu_mul_quantize_act: gate_up [M, 2K] -> (codes [M, K] int8, scales [M] float32). A row
// over a cluster of at most max_cluster CTAs of about cta_vecs 8-element vectors each (one CTA on
// GPUs before sm_90; kernels/cuda.py:silu_quant_supports).
std::tuple<at::Tensor, at::Tensor> silu_mul_quantize_act(const at::Tensor& gate_up_in,
                                                         const std::optional<at::Tensor>& smooth_in, int64_t max_cluster,
                                                         int64_t cta_vecs) {
  constexpr const char* op = "mixprec_C::silu_mul_quantize_act: ";
  TORCH_CHECK(gate_up_in.is_cuda(), op, "gate_up must be a CUDA tensor, got ", gate_up_in.device());
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0, op, "gate_up must be 2-D [M, 2K], got shape ",
              gate_up_in.sizes());
  TORCH_CHECK(gate_up_in.scalar_type() == at::kHalf || gate_up_in.scalar_type() == at::kBFloat16, op,
              "gate_up must be float16 or bfloat16, got ", gate_up_in.scalar_type());
  const c10::cuda::CUDAGuard guard(gate_up_in.device());
  const at::Tensor gate_up = gate_up_in.stride(1) == 1 ? gate_up_in : gate_up_in.contiguous();
  const int64_t M = gate_up.size(0), K = gate_up.size(1) / 2;
  TORCH_CHECK(max_cluster >= 1 && max_cluster <= kSiluQuantMaxCluster, op, "max_cluster must be 1 to ",
              kSiluQuantMaxCluster, ", got ", max_cluster);
  TORCH_CHECK(cta_vecs >= 1 && cta_vecs <= kSiluQuantMaxThreads * kSiluQuantMaxVecs, op, "cta_vecs must be 1 to ",
              kSiluQuantMaxThreads * kSiluQuantMaxVecs, ", got ", cta_vecs);
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, gate_up.device().index()));
  const bool clusters = major >= 9;
  SiluQuantPlan plan{};
  TORCH_CHECK(M <= kSiluQuantMaxRows && K < (int64_t{1} << 31) &&
                  silu_mul_quantize_act_plan(static_cast<int>(K), clusters ? static_cast<int>(max_cluster) : 1,
                                             static_cast<int>(cta_vecs), &plan),
              op, "rows of K % 8 == 0 outputs, at most ", (clusters ? max_cluster : 1) * kSiluQuantMaxThreads *
              kSiluQuantMaxVecs * 8, " (", clusters ? "max_cluster" : "one CTA before sm_90", "), and at most ",
              kSiluQuantMaxRows, " rows; got M = ", M, ", K = ", K);
  at::Tensor smooth;
  if (smooth_in.has_value()) {
    smooth = smooth_in->contiguous();
    check_cuda(smooth, gate_up, "smooth");
    TORCH_CHECK(smooth.dim() == 1 && smooth.size(0) == K && smooth.scalar_type() == at::kFloat, op,
                "smooth must be [", K, "] float32, got ", smooth.sizes(), " ", smooth.scalar_type());
  }
  at::Tensor q = at::empty({M, K}, gate_up.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M}, gate_up.options().dtype(at::kFloat));
  if (M == 0) return {q, scale};
  const SiluQuantArgs args{gate_up.data_ptr(), gate_up.stride(0), smooth.defined() ? smooth.data_ptr<float>() : nullptr,
                           q.data_ptr<int8_t>(), scale.data_ptr<float>(), static_cast<int>(M), static_cast<int>(K),
                           kind_of(gate_up.scalar_type(), op), quant_ops_pdl_on(gate_up.device().index())};
  const cudaError_t err =
      silu_mul_quantize_act_launch(args, plan, c10::cuda::getCurrentCUDAStream(gate_up.device().index()).stream());
  TORCH_CHECK(err != cudaErrorInvalidValue, op, "gate_up's rows and smooth must start on 16-byte boundaries ",
              "(gate_up row stride ", gate_up.stride(0), ")");
  C10_CUDA_CHECK(err);
  return {q, scale};
}

// silu_mul_quantize_act's plan for rows of K outputs: [ctas, threads, vectors a thread], or [] where
// the row does not fit or an argument is out of range (kernels/cuda.py mirrors the rule; its tests
// compare the two).
std::vector<int64_t> silu_mul_quantize_act_plan_of(int64_t K, int64_t max_cluster, int64_t cta_vecs) {
  SiluQuantPlan plan{};
  const auto fits_int = [](int64_t v) { return v > 0 && v < (int64_t{1} << 31); };
  if (!fits_int(K) || !fits_int(max_cluster) || !fits_int(cta_vecs) ||
      !silu_mul_quantize_act_plan(static_cast<int>(K), static_cast<int>(max_cluster), static_cast<int>(cta_vecs), &plan))
    return {};
  return {plan.ctas, plan.threads, plan.vecs};
}

at::Tensor w4a8_gemm(const at::Tensor& xq_in, const at::Tensor& x_scale_in, const at::Tensor& qweight,
                     const at::Tensor& gparams, const at::Tensor& channel_scale_in,
                     const std::optional<at::Tensor>& bias_in, at::ScalarType out_dtype, int64_t kernel,
                     int64_t splits, bool x_wgmma_order) {
  constexpr const char* op = "mixprec_C::w4a8_gemm: ";
  TORCH_CHECK(xq_in.is_cuda(), op, "xq must be a CUDA tensor, got ", xq_in.device());
  TORCH_CHECK(xq_in.scalar_type() == at::kChar && xq_in.dim() == 2, op, "xq must be int8 [M, K], got ",
              xq_in.scalar_type(), " ", xq_in.sizes());
  const c10::cuda::CUDAGuard guard(xq_in.device());
  const int64_t M = xq_in.size(0), K = xq_in.size(1);
  const OutKind out_kind = kind_of(out_dtype, "mixprec_C::w4a8_gemm: out_dtype");

  check_cuda(x_scale_in, xq_in, "x_scale");
  TORCH_CHECK(x_scale_in.scalar_type() == at::kFloat && x_scale_in.dim() == 1 && x_scale_in.size(0) == M, op,
              "x_scale must be float32 [M=", M, "], got ", x_scale_in.scalar_type(), " ", x_scale_in.sizes());
  check_cuda(channel_scale_in, xq_in, "channel_scale");
  TORCH_CHECK(channel_scale_in.scalar_type() == at::kFloat && channel_scale_in.dim() == 1, op,
              "channel_scale must be float32 [N], got ", channel_scale_in.scalar_type(), " ",
              channel_scale_in.sizes());
  const int64_t N = channel_scale_in.size(0);
  TORCH_CHECK(N % 16 == 0 && N > 0, op, "N (output features) = ", N,
              " must be a positive multiple of 16 (pad the layer or use the Triton kernel)");
  TORCH_CHECK(K % 64 == 0 && K > 0, op, "K (input features) = ", K, " must be a positive multiple of 64");
  TORCH_CHECK(M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31), op, "shape too large");

  check_cuda(qweight, xq_in, "qweight");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.size(0) == N / 16 &&
                  qweight.size(1) == 8 * K && qweight.is_contiguous(),
              op, "qweight must be the packed uint8 [N/16, 8K] = [", N / 16, ", ", 8 * K,
              "] of kernels/cuda.py:repack_w4a8 (contiguous), got ", qweight.scalar_type(), " ", qweight.sizes());
  check_cuda(gparams, xq_in, "gparams");
  TORCH_CHECK(gparams.scalar_type() == at::kInt && gparams.dim() == 3 && gparams.size(0) == N / 16 &&
                  gparams.size(2) == 8 && gparams.size(1) > 0 && gparams.is_contiguous(),
              op, "gparams must be the packed int32 [N/16, K/G, 8] of kernels/cuda.py:repack_w4a8, got ",
              gparams.scalar_type(), " ", gparams.sizes());
  const int64_t groups = gparams.size(1);
  TORCH_CHECK(K % groups == 0, op, "K = ", K, " is not a multiple of the number of groups ", groups);
  const int64_t group_size = K / groups;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(gparams.data_ptr()) % 16 == 0,
              op, "qweight and gparams must be 16-byte aligned");

  at::Tensor bias;
  BiasKind bias_kind = BiasKind::kNone;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    check_cuda(bias, xq_in, "bias");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, op, "bias must have shape [N=", N, "], got ", bias.sizes());
    if (bias.scalar_type() == out_dtype) {
      bias_kind = BiasKind::kSameAsOut;
    } else {
      // float32 holds every fp16/bf16 value exactly: no second rounding of the bias
      kind_of(bias.scalar_type(), "mixprec_C::w4a8_gemm: bias");
      if (bias.scalar_type() != at::kFloat) bias = bias.to(at::kFloat);
      bias_kind = BiasKind::kFloat;
    }
  }

  at::Tensor out = at::empty({M, N}, xq_in.options().dtype(out_dtype));
  if (M == 0) return out;
  const at::Tensor xq = aligned_contiguous(xq_in);
  const at::Tensor x_scale = x_scale_in.contiguous();
  const at::Tensor channel_scale = aligned_contiguous(channel_scale_in);

  // kernel: -2 auto over the mma.sync kernels; -1 auto (on sm90 the wgmma kernels, but for the
  // decode kernels' M: w4a8_auto_prefers_decode); 0..3 mma.sync kernels; 4..8 wgmma kernels
  // (sm_90a build on an sm_90 GPU only). The choice is made here rather than in Python so that a
  // dynamic M (torch.compile, CUDA graphs per batch size) never branches in traced code.
  TORCH_CHECK(kernel >= -2 && kernel <= 8, op, "kernel must be -2, -1 (auto) or 0..8, got ", kernel);
  const int num_sm = num_sms(xq.device().index());
  const bool wants_wgmma =
      kernel >= 4 ||
      (kernel == -1 && !w4a8_auto_prefers_decode(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), num_sm));
  const bool use_wgmma = wants_wgmma && w4a8_wgmma_supported();
  TORCH_CHECK(splits >= -2, op,
              "splits must be -2 (a cluster pair), -1 (stream-K), 0 (choose) or a split count, got ", splits);
  TORCH_CHECK(splits >= 0 || use_wgmma, op, "splits=", splits,
              " (-1: stream-K, -2: a cluster pair) runs on the wgmma kernels only: kernel 4..8, or -1 past the "
              "decode kernels' M, on an sm_90 GPU with an sm_90a build (M=", M, ", kernel=", kernel, ")");
  TORCH_CHECK(use_wgmma || !x_wgmma_order, op,
              "x_wgmma_order=True (xq in the wgmma k order) needs a wgmma kernel, and this call runs a decode or "
              "mma.sync kernel (M=", M, ", kernel=", kernel, "): quantize x in its natural order "
              "(kernels/cuda.py: x_wgmma_order_for)");
  TORCH_CHECK(use_wgmma || kernel < 4, op, "kernel ", kernel,
              " is a wgmma kernel: it needs an sm_90 GPU (H100/H200) and a build with sm_90a in "
              "MIXPREC_CUDA_ARCHS; this device or build has no wgmma kernel (use -1 or 0..3)");
  W4A8Plan plan{};
  const char* err =
      use_wgmma ? w4a8_wgmma_make_plan(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                                       static_cast<int>(group_size), num_sm, static_cast<int>(kernel),
                                       static_cast<int>(splits), launch_options().gemm_stream_k.load(),
                                       launch_options().gemm_cluster_pair.load(), &plan)
                : w4a8_make_plan(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                                 static_cast<int>(group_size), num_sm, kernel == -2 ? -1 : static_cast<int>(kernel),
                                 static_cast<int>(splits), launch_options().decode_ctas_per_sm.load(), &plan);
  TORCH_CHECK(err == nullptr, err ? err : "", " (M=", M, ", N=", N, ", K=", K, ", G=", group_size,
              ", kernel=", kernel, ", splits=", splits, ")");

  const c10::cuda::CUDAStream cuda_stream = c10::cuda::getCurrentCUDAStream(xq.device().index());
  at::Tensor workspace, counters;
  if (plan.workspace_elems > 0) {  // split-K or stream-K partials
    workspace = at::empty({static_cast<int64_t>(plan.workspace_elems)}, xq.options().dtype(at::kInt));
    counters = split_counters(xq, plan.num_counters, cuda_stream);
  }
  W4A8GemmArgs args{};
  args.xq = xq.data_ptr<int8_t>();
  args.x_scale = x_scale.data_ptr<float>();
  args.qweight = qweight.data_ptr<uint8_t>();
  args.gparams = reinterpret_cast<const uint32_t*>(gparams.data_ptr<int32_t>());
  args.channel_scale = channel_scale.data_ptr<float>();
  args.bias = bias.defined() ? bias.data_ptr() : nullptr;
  args.bias_kind = bias_kind;
  args.out = out.data_ptr();
  args.out_kind = out_kind;
  args.workspace = workspace.defined() ? workspace.data_ptr<int32_t>() : nullptr;
  args.counters = counters.defined() ? counters.data_ptr<int32_t>() : nullptr;
  args.M = static_cast<int>(M);
  args.N = static_cast<int>(N);
  args.K = static_cast<int>(K);
  args.group_size = static_cast<int>(group_size);
  args.pdl = launch_options().gemm_pdl.load() && is_sm90(xq.device().index());
  args.decode_u8 = launch_options().decode_u8.load();
  args.decode_dp4a = launch_options().decode_dp4a.load();  // the launcher applies it at M = 1 only
  args.trigger_dependents = quant_ops_pdl_on(xq.device().index());
  args.x_wgmma_order = x_wgmma_order;
  // Two token tiles (M = 9-16) gained from the preload only in the 3-CTA build; in the 2-CTA one it
  // was -3 to +4 % (NOTES.md "Decode preload"), so there only a bound above 16 asks for it.
  const int preload_max_m = launch_options().decode_preload_max_m.load();
  args.decode_preload = M <= preload_max_m && (M <= 8 || preload_max_m > 16 || plan.decode_ctas == 3);
  const cudaStream_t stream = cuda_stream.stream();
  C10_CUDA_CHECK(use_wgmma ? w4a8_wgmma_launch(args, plan, stream) : w4a8_gemm_launch(args, plan, stream));
  return out;
}

// Whether kernels 4..8 (and the auto choice of them) run on this device.
bool w4a8_wgmma_available(int64_t device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (device < 0 || device >= count) return false;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  return w4a8_wgmma_supported();
}

// The (kernel, splits, decode build) that w4a8_gemm would launch for a problem, without a GPU:
// tests check the planner on the CPU and benchmarks record it. wgmma picks between the wgmma
// kernels (ids 4..8), otherwise the mma.sync ones (0..3); kernel/splits as in w4a8_gemm (-1 and 0
// choose), the launch options as set. A returned split count of -1 is a stream-K launch (one CTA
// per SM over all tiles x K stages), -2 a cluster pair (two K halves a tile); the decode build is
// 2 or 3 CTAs per SM for kernels 0 and 1, else 0.
std::vector<int64_t> w4a8_plan(int64_t M, int64_t N, int64_t K, int64_t group_size, int64_t num_sms,
                               int64_t kernel, int64_t splits, bool wgmma) {
  W4A8Plan plan{};
  const char* err = wgmma ? w4a8_wgmma_make_plan(M, N, K, group_size, num_sms, kernel, splits,
                                                 launch_options().gemm_stream_k.load(),
                                                 launch_options().gemm_cluster_pair.load(), &plan)
                          : w4a8_make_plan(M, N, K, group_size, num_sms, kernel, splits,
                                           launch_options().decode_ctas_per_sm.load(), &plan);
  TORCH_CHECK(err == nullptr, "mixprec_C::w4a8_plan: ", err ? err : "");
  return {static_cast<int64_t>(plan.kernel), plan.splits, plan.decode_ctas};
}

// Whether the auto plan (kernel -1) of M tokens on an N x K weight takes the decode kernels where the
// wgmma kernels are available (kernels/cuda.py:auto_gemm_kernel_family).
bool w4a8_auto_decode(int64_t M, int64_t N, int64_t K, int64_t num_sms) {
  return w4a8_auto_prefers_decode(static_cast<int>(M), static_cast<int>(N), static_cast<int>(K),
                                  static_cast<int>(num_sms));
}

// quantize_act's split chunk (0: one CTA a row) for M unsmoothed, aligned rows of K under the current
// act_quant_split option (kernels/cuda.py:quantize_act_split_chunk).
int64_t quantize_act_split_chunk_now(int64_t M, int64_t K) {
  TORCH_CHECK(M >= 0 && K > 0 && M < (int64_t{1} << 31) && K < (int64_t{1} << 31),
              "mixprec_C::quantize_act_split_chunk: unsupported M = ", M, ", K = ", K);
  return quantize_act_split_chunk(launch_options().act_quant_split.load(), static_cast<int>(M), static_cast<int>(K));
}

// The page part of KV4 decode attention (csrc/attention/sm80/decode_kv4_mma.cu): the rows of
// query length 1 attend their pages [0, seq_len - res_tokens), split num_splits ways as
// vllm_mixprec/kernels/triton/attention.py's _decode_tiles splits them. With part_o/part_lse
// each split writes its normalised output and base-2 LSE at row (row * slots + split) (the
// Triton finish kernel merges them and attends the residual tail); without them (one split, no
// residual) the row's output goes straight to `out`.
void decode_kv4_pages(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, const at::Tensor& query_start_loc, at::Tensor& out,
                      const std::optional<at::Tensor>& part_o, const std::optional<at::Tensor>& part_lse,
                      const std::optional<at::Tensor>& k_smooth, double qk_scale, int64_t num_rows,
                      int64_t num_splits, int64_t slots, int64_t res_tokens, int64_t tile_tokens,
                      int64_t min_tiles, int64_t prefetch_pages) {
  const char* op = "mixprec_C::decode_kv4_pages: ";
  const c10::cuda::CUDAGuard guard(q.device());
  check_cuda(q, q, "q");
  check_cuda(cache, q, "cache");
  check_cuda(out, q, "out");
  check_cuda(block_table, q, "block_table");
  check_cuda(seq_lens, q, "seq_lens");
  check_cuda(query_start_loc, q, "query_start_loc");
  if (part_o) check_cuda(*part_o, q, "part_o");
  if (part_lse) check_cuda(*part_lse, q, "part_lse");
  if (k_smooth) check_cuda(*k_smooth, q, "k_smooth");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kDecodeKV4HeadDim && q.stride(2) == 1, op,
              "q must be [T, Hq, ", kDecodeKV4HeadDim, "] tensor with unit stride on D, got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
              "q must be float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.dim() == 3 && out.size(0) >= q.size(0) &&
                  out.size(1) == q.size(1) && out.size(2) == q.size(2) && out.stride(2) == 1,
              op, "out must be [>= T, Hq, D] in q's dtype with unit stride on D, got ", out.sizes(),
              " ", out.scalar_type(), " for q ", q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 && q.stride(0) % 8 == 0 && q.stride(1) % 8 == 0, op,
              "q rows must be 16-byte aligned (strides multiples of 8 elements)");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0 && out.stride(0) % 4 == 0 && out.stride(1) % 4 == 0,
              op, "out rows must be 8-byte aligned (strides multiples of 4 elements)");
  const int64_t row_bytes = 2 * (kDecodeKV4HeadDim / 2) + 8;
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) == kDecodeKV4BlockSize && cache.size(3) == row_bytes &&
                  cache.element_size() == 1 && cache.stride(3) == 1 && cache.stride(2) == row_bytes &&
                  cache.stride(1) == kDecodeKV4BlockSize * row_bytes && cache.stride(0) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0,
              op, "cache must be a 16-byte aligned (blocks, Hkv, ", kDecodeKV4BlockSize, ", ", row_bytes,
              ") byte tensor with contiguous (block, head) slabs, got ", cache.sizes(), " strides ",
              cache.strides());
  const int64_t hq = q.size(1), hkv = cache.size(1);
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && hq / hkv <= kDecodeKV4MaxGroup, op, "query heads (", hq,
              ") must be a multiple of kv heads (", hkv, ") by at most ", kDecodeKV4MaxGroup);
  for (const auto* t : {&block_table, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1, op,
                "block_table, seq_lens and query_start_loc must be int32 with unit last stride");
  }
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= num_rows && seq_lens.numel() >= num_rows &&
                  query_start_loc.numel() > num_rows,
              op, "block_table/seq_lens/query_start_loc hold fewer than num_rows = ", num_rows, " rows");
  TORCH_CHECK(num_splits >= 1 && num_splits <= 65535 && slots >= num_splits && tile_tokens > 0 &&
                  tile_tokens % kDecodeKV4BlockSize == 0 && min_tiles >= 1 && res_tokens >= 0,
              op, "bad partition: num_splits ", num_splits, ", slots ", slots, ", tile_tokens ", tile_tokens,
              ", min_tiles ", min_tiles, ", res_tokens ", res_tokens);
  TORCH_CHECK(prefetch_pages >= 0 && prefetch_pages < 32, op, "prefetch_pages must be in [0, 32), got ",
              prefetch_pages);
  TORCH_CHECK(part_o.has_value() == part_lse.has_value(), op, "give both part_o and part_lse or neither");
  if (part_o) {
    TORCH_CHECK(part_o->scalar_type() == at::kFloat && part_o->is_contiguous() && part_o->dim() == 3 &&
                    part_o->size(0) >= num_rows * slots && part_o->size(1) == hq &&
                    part_o->size(2) == kDecodeKV4HeadDim,
                op, "part_o must be contiguous float32 [>= num_rows * slots = ", num_rows * slots, ", ", hq, ", ",
                kDecodeKV4HeadDim, "], got ", part_o->sizes());
    TORCH_CHECK(part_lse->scalar_type() == at::kFloat && part_lse->is_contiguous() && part_lse->dim() == 2 &&
                    part_lse->size(0) >= num_rows * slots && part_lse->size(1) == hq,
                op, "part_lse must be contiguous float32 [>= num_rows * slots, ", hq, "], got ", part_lse->sizes());
  } else {
    TORCH_CHECK(num_splits == 1 && res_tokens == 0, op,
                "several splits or a residual tail need part_o/part_lse (the finish kernel merges them)");
  }
  if (k_smooth) {
    TORCH_CHECK(k_smooth->scalar_type() == at::kFloat && k_smooth->is_contiguous() &&
                    k_smooth->numel() == hkv * kDecodeKV4HeadDim,
                op, "k_smooth must be contiguous float32 [", hkv, ", ", kDecodeKV4HeadDim, "]");
  }
  if (num_rows == 0) return;
  TORCH_CHECK(num_rows <= INT32_MAX && hkv <= 65535, op, "too many rows or kv heads for the grid");
  DecodeKV4Args a{};
  a.q = q.data_ptr();
  a.q_stride_t = q.stride(0);
  a.q_stride_h = q.stride(1);
  a.out = out.data_ptr();
  a.out_stride_t = out.stride(0);
  a.out_stride_h = out.stride(1);
  a.part_o = part_o ? part_o->data_ptr<float>() : nullptr;
  a.part_lse = part_lse ? part_lse->data_ptr<float>() : nullptr;
  a.cache = static_cast<const uint8_t*>(cache.data_ptr());
  a.stride_block = cache.stride(0);
  a.stride_head = cache.stride(1);
  a.block_table = block_table.data_ptr<int32_t>();
  a.block_table_stride = block_table.stride(0);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.k_smooth = k_smooth ? k_smooth->data_ptr<float>() : nullptr;
  a.qk_scale = static_cast<float>(qk_scale);
  a.num_rows = static_cast<int>(num_rows);
  a.num_q_heads = static_cast<int>(hq);
  a.num_kv_heads = static_cast<int>(hkv);
  a.num_splits = static_cast<int>(num_splits);
  a.slots = static_cast<int>(slots);
  a.res_tokens = static_cast<int>(res_tokens);
  a.tile_tokens = static_cast<int>(tile_tokens);
  a.min_tiles = static_cast<int>(min_tiles);
  a.prefetch_pages = static_cast<int>(prefetch_pages);
  a.bf16 = q.scalar_type() == at::kBFloat16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  C10_CUDA_CHECK(decode_kv4_pages_launch(a, stream));
}

// Sets the launch options (a negative value keeps one) and returns them all:
// [gemm_pdl, act_quant_one_pass, gemm_stream_k, decode_u8, decode_ctas_per_sm, decode_preload_max_m,
//  act_quant_lean, gemm_cluster_pair, decode_dp4a, act_quant_split, quant_ops_pdl].
// For A/B timing and tests; the defaults are the measured best (csrc/gemm/NOTES.md, "PDL", "Stream-K",
// "Decode u8", "Decode occupancy", "Decode preload", "quantize_act").
std::vector<int64_t> set_launch_options(int64_t gemm_pdl, int64_t act_quant_one_pass, int64_t gemm_stream_k,
                                        int64_t decode_u8, int64_t decode_ctas_per_sm, int64_t decode_preload_max_m,
                                        int64_t act_quant_lean, int64_t gemm_cluster_pair, int64_t decode_dp4a,
                                        int64_t act_quant_split, int64_t quant_ops_pdl) {
  TORCH_CHECK(gemm_pdl <= 1 && act_quant_one_pass <= 1 && gemm_stream_k <= 1 && decode_u8 <= 1,
              "mixprec_C::set_launch_options: gemm_pdl, act_quant_one_pass, gemm_stream_k and decode_u8 take 0, 1 or "
              "-1 (keep); got ", gemm_pdl, ", ", act_quant_one_pass, ", ", gemm_stream_k, ", ", decode_u8);
  TORCH_CHECK(decode_ctas_per_sm <= 0 || decode_ctas_per_sm == 2 || decode_ctas_per_sm == 3,
              "mixprec_C::set_launch_options: decode_ctas_per_sm takes 0 (the planner picks), 2, 3 or -1 (keep); got ",
              decode_ctas_per_sm);
  TORCH_CHECK(decode_preload_max_m <= 32,
              "mixprec_C::set_launch_options: decode_preload_max_m takes 0 (never) to 32 (every decode M) or -1 "
              "(keep); got ", decode_preload_max_m);
  TORCH_CHECK(act_quant_lean <= 1, "mixprec_C::set_launch_options: act_quant_lean takes 0, 1 or -1 (keep); got ",
              act_quant_lean);
  TORCH_CHECK(gemm_cluster_pair <= 1,
              "mixprec_C::set_launch_options: gemm_cluster_pair takes 0, 1 or -1 (keep); got ", gemm_cluster_pair);
  TORCH_CHECK(decode_dp4a <= 1, "mixprec_C::set_launch_options: decode_dp4a takes 0, 1 or -1 (keep); got ",
              decode_dp4a);
  TORCH_CHECK(act_quant_split <= 1 || act_quant_split == 1024 || act_quant_split == 2048 || act_quant_split == 4096,
              "mixprec_C::set_launch_options: act_quant_split takes 0 (never), 1 (the rule), 1024, 2048, 4096 (that "
              "chunk at every M <= 64) or -1 (keep); got ", act_quant_split);
  TORCH_CHECK(quant_ops_pdl <= 1, "mixprec_C::set_launch_options: quant_ops_pdl takes 0, 1 or -1 (keep); got ",
              quant_ops_pdl);
  LaunchOptions& o = launch_options();
  if (gemm_pdl >= 0) o.gemm_pdl.store(gemm_pdl == 1);
  if (act_quant_one_pass >= 0) o.act_quant_one_pass.store(act_quant_one_pass == 1);
  if (gemm_stream_k >= 0) o.gemm_stream_k.store(gemm_stream_k == 1);
  if (decode_u8 >= 0) o.decode_u8.store(decode_u8 == 1);
  if (decode_ctas_per_sm >= 0) o.decode_ctas_per_sm.store(static_cast<int>(decode_ctas_per_sm));
  if (decode_preload_max_m >= 0) o.decode_preload_max_m.store(static_cast<int>(decode_preload_max_m));
  if (act_quant_lean >= 0) o.act_quant_lean.store(act_quant_lean == 1);
  if (gemm_cluster_pair >= 0) o.gemm_cluster_pair.store(gemm_cluster_pair == 1);
  if (decode_dp4a >= 0) o.decode_dp4a.store(decode_dp4a == 1);
  if (act_quant_split >= 0) o.act_quant_split.store(static_cast<int>(act_quant_split));
  if (quant_ops_pdl >= 0) o.quant_ops_pdl.store(quant_ops_pdl == 1);
  return {o.gemm_pdl.load() ? 1 : 0, o.act_quant_one_pass.load() ? 1 : 0, o.gemm_stream_k.load() ? 1 : 0,
          o.decode_u8.load() ? 1 : 0, o.decode_ctas_per_sm.load(), o.decode_preload_max_m.load(),
          o.act_quant_lean.load() ? 1 : 0, o.gemm_cluster_pair.load() ? 1 : 0, o.decode_dp4a.load() ? 1 : 0,
          o.act_quant_split.load(), o.quant_ops_pdl.load() ? 1 : 0};
}

}  // namespace
}  // namespace mixprec

TORCH_LIBRARY(mixprec_C, m) {
  // wgmma_order / x_wgmma_order: xq in the wgmma kernels' k order (formats.py wgmma_act_k_order).
  m.def("quantize_act(Tensor x, Tensor? smooth, bool wgmma_order=False) -> (Tensor, Tensor)");
  m.def("add_rms_norm_quantize_act(Tensor x, Tensor residual, Tensor? weight, float epsilon, Tensor? smooth) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("silu_mul_quantize_act(Tensor gate_up, Tensor? smooth, int max_cluster=8, int cta_vecs=512) -> (Tensor, Tensor)");
  m.def("silu_mul_quantize_act_plan(int K, int max_cluster, int cta_vecs=512) -> int[]", &mixprec::silu_mul_quantize_act_plan_of);
  m.def(
      "w4a8_gemm(Tensor xq, Tensor x_scale, Tensor qweight, Tensor gparams, Tensor channel_scale, "
      // kernel_id, not kernel: Inductor's FallbackKernel.create() takes a `kernel` argument itself.
      "Tensor? bias, ScalarType out_dtype, int kernel_id=-1, int splits=0, bool x_wgmma_order=False) -> Tensor");
  // No tensor arguments: registered with its (device-independent) kernel directly.
  m.def("w4a8_wgmma_available(int device) -> bool", &mixprec::w4a8_wgmma_available);
  m.def("w4a8_plan(int M, int N, int K, int group_size, int num_sms, int kernel_id, int splits, bool wgmma) -> int[]",
        &mixprec::w4a8_plan);
  m.def("w4a8_auto_decode(int M, int N, int K, int num_sms) -> bool", &mixprec::w4a8_auto_decode);
  m.def("quantize_act_split_chunk(int M, int K) -> int", &mixprec::quantize_act_split_chunk_now);
  m.def(
      "decode_kv4_pages(Tensor q, Tensor cache, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "
      "Tensor(a!) out, Tensor(b!)? part_o, Tensor(c!)? part_lse, Tensor? k_smooth, float qk_scale, int num_rows, "
      "int num_splits, int slots, int res_tokens, int tile_tokens, int min_tiles, int prefetch_pages=0) -> ()");
  m.def(
      "set_launch_options(int gemm_pdl=-1, int act_quant_one_pass=-1, int gemm_stream_k=-1, int decode_u8=-1, "
      "int decode_ctas_per_sm=-1, int decode_preload_max_m=-1, int act_quant_lean=-1, int gemm_cluster_pair=-1, "
      "int decode_dp4a=-1, int act_quant_split=-1, int quant_ops_pdl=-1) "
      "-> int[]",
      &mixprec::set_launch_options);
}

TORCH_LIBRARY_IMPL(mixprec_C, CUDA, m) {
  m.impl("quantize_act", &mixprec::quantize_act);
  m.impl("add_rms_norm_quantize_act", &mixprec::add_rms_norm_quantize_act);
  m.impl("silu_mul_quantize_act", &mixprec::silu_mul_quantize_act);
  m.impl("w4a8_gemm", &mixprec::w4a8_gemm);
  m.impl("decode_kv4_pages", &mixprec::decode_kv4_pages);
}
