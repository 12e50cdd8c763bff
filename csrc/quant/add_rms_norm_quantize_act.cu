// add + RMSNorm + per-token int8 (reference.add_rms_norm_quantize_act): the input of a layer after
// vLLM's fused_add_rms_norm, which compile_passes.DecodeQuantOps replaces in decode graphs.
//   h = x + residual (float32; the new residual is h in x's dtype),
//   y = h * (1 / sqrt(mean(h^2) + eps)), rounded to x's dtype, times weight, rounded again,
//   then reference.quantize_act(y, smooth): one scale a row, codes from the lean arithmetic.
// One CTA a row, the row read once into registers (1024 threads, one or two 16-byte vectors of
// x and of the residual each). Why beside Triton's kernel: at decode sizes a row is one CTA on one
// SM, so the instructions an element show in the time. This one rounds by cvt.rn.bf16x2 and takes
// the codes from 1 / scale (pack_codes8_lean) where Triton's rounds bf16 in the bits (for the
// interpreter) and divides every code; alone it was 0.8-1.3 us faster on an H100
// (csrc/gemm/NOTES.md "Session 84").
// On sm_90 it lets the decode GEMM after it launch at once (allow_dependent_launch), as the
// quantizer does; with quant_ops_pdl it is itself a programmatic dependent of the GEMM before it
// (NormQuantArgs::pdl).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/device.h"
#include "common/launch.h"
#include "gemm/w4a8_gemm.h"
#include "quant/act_int8.cuh"

namespace mixprec {
namespace {

constexpr int kNormThreads = 1024;

// kVecs: 16-byte vectors a thread (K <= kVecs * 8 * kNormThreads). weight (x's dtype) and
// smooth (float32) may be null. K % 8 == 0 and 16-byte aligned rows (the launcher checks).
template <typename T, int kVecs>
__global__ void __launch_bounds__(kNormThreads, 1) add_rms_norm_quantize_act_kernel(
    const T* __restrict__ x, int64_t x_row_stride, const T* __restrict__ residual, int64_t r_row_stride,
    const T* __restrict__ weight, const float* __restrict__ smooth, int8_t* __restrict__ q,
    float* __restrict__ scale, T* __restrict__ res_out, int K, float eps) {
  __shared__ float s_sum[32], s_max[32];
  allow_dependent_launch();
  const int64_t row = blockIdx.x;
  const int vecs = K / 8;
  const T* xr = x + row * x_row_stride;
  const T* rr = residual + row * r_row_stride;

  // (A programmatic dependent waits before any load: a compiled graph may compute the weight in
  // the kernel just before, whose writes only the wait makes visible.)
  wait_prior_grids();

  // Every load first: one memory latency for the row, the weight and the smoothing vector.
  Raw8<T> xa[kVecs], ra[kVecs], wa[kVecs];
  Raw8<float> sa[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < vecs) {
      xa[j] = load_raw8(xr + vi * 8);
      ra[j] = load_raw8(rr + vi * 8);
      if (weight != nullptr) wa[j] = load_raw8(weight + vi * 8);
      if (smooth != nullptr) sa[j] = load_raw8(smooth + vi * 8);
    }
  }

  float v[kVecs][8];
  float sumsq = 0.f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < vecs) {
      float r[8];
      to_float8(xa[j], v[j]);
      to_float8(ra[j], r);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[j][e] += r[e];
        sumsq = fmaf(v[j][e], v[j][e], sumsq);
        r[e] = v[j][e];
      }
      *reinterpret_cast<uint4*>(res_out + row * K + vi * 8) = round8<T>(r);
    }
  }
  // IEEE sqrt and division: the CPU reference's two roundings (torch.rsqrt there is 1 / sqrt).
  const float rstd = 1.0f / sqrtf(block_reduce(sumsq, s_sum, SumOp{}) / static_cast<float>(K) + eps);

  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < vecs) {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[j][e] *= rstd;
      round8<T>(v[j]);
      if (weight != nullptr) {
        float w[8];
        to_float8(wa[j], w);
#pragma unroll
        for (int e = 0; e < 8; ++e) v[j][e] *= w[e];
        round8<T>(v[j]);
      }
      amax = smooth_then_amax8(v[j], sa[j], smooth != nullptr, amax);
    }
  }
  const float sc = scale_of_amax(block_reduce(nan_to_inf(amax), s_max, MaxOp{}));
  if (threadIdx.x == 0) scale[row] = sc;
  const float inv_sc = 1.0f / sc;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < vecs) *reinterpret_cast<uint2*>(q + row * K + vi * 8) = pack_codes8_lean(v[j], sc, inv_sc);
  }
}

template <auto kKernel, typename T>
cudaError_t launch_kernel_for(const NormQuantArgs& a, int threads, cudaStream_t stream) {
  return launch_kernel<kKernel>(dim3(a.M), dim3(threads), 0, a.pdl, stream, static_cast<const T*>(a.x),
                                a.x_row_stride, static_cast<const T*>(a.residual), a.residual_row_stride,
                                static_cast<const T*>(a.weight), a.smooth, a.q, a.scale, static_cast<T*>(a.res_out),
                                a.K, a.epsilon);
}

template <typename T>
cudaError_t launch_for(const NormQuantArgs& a, cudaStream_t stream) {
  const int vecs = a.K / 8;
  const int threads = vecs <= kNormThreads ? ((vecs + 31) / 32) * 32 : kNormThreads;
  if (vecs <= kNormThreads) return launch_kernel_for<add_rms_norm_quantize_act_kernel<T, 1>, T>(a, threads, stream);
  return launch_kernel_for<add_rms_norm_quantize_act_kernel<T, 2>, T>(a, threads, stream);
}

}  // namespace

bool add_rms_norm_quantize_act_supports(int K) { return K > 0 && K % 8 == 0 && K <= kNormMaxK; }

cudaError_t add_rms_norm_quantize_act_launch(const NormQuantArgs& a, cudaStream_t stream) {
  if (a.M == 0) return cudaSuccess;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!add_rms_norm_quantize_act_supports(a.K) || a.x_row_stride % 8 != 0 || a.residual_row_stride % 8 != 0 ||
      !aligned(a.x) || !aligned(a.residual) || !aligned(a.res_out) || !aligned(a.q) ||
      (a.weight != nullptr && !aligned(a.weight)) || (a.smooth != nullptr && !aligned(a.smooth)))
    return cudaErrorInvalidValue;
  return a.kind == OutKind::kHalf ? launch_for<__half>(a, stream) : launch_for<__nv_bfloat16>(a, stream);
}

}  // namespace mixprec
