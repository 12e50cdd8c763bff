// SiLU-and-mul + per-token int8 (reference.silu_mul_quantize_act): the down projection's input,
// which compile_passes.DecodeQuantOps puts in decode graphs in place of vLLM's SiluAndMul and the
// quantizer after it where MIXPREC_DECODE_SILU_OP=1 (opt-in; csrc/gemm/NOTES.md "Session 86", "Session 87":
// 16-CTA clusters and smaller CTAs are faster alone at M <= 4, not in the 70B piece).
//   y = silu(gate) rounded to the row's dtype, times up, rounded again (torch's two ops; silu in
//   float32 as ATen computes it, g / (1 + expf(-g)), IEEE division),
//   then reference.quantize_act(y, smooth): one scale a row, codes from the lean arithmetic.
// A row's K outputs are split over a thread block cluster of up to 16 CTAs (silu_mul_quantize_act_plan:
// CTAs of about 4096 outputs by default; kernels/cuda.py picks at most 8 by the batch), one or two 16-byte vectors of gate and of up a thread, every load issued
// first. Each CTA reduces its share's amax; the cluster exchanges them through distributed shared
// memory, so y never reaches memory and the row is one launch. Why: served, the SiLU-and-mul (an
// Inductor kernel) and the csrc quantizer were two launches over the 28672-wide row of Llama-3-70B,
// and the quantizer coded it on one SM (4.9 us at M = 1 on an H100, csrc/gemm/NOTES.md "Session 84").
// On sm_80 (no clusters) a row is one CTA: rows of at most 16384 outputs.
// On sm_90 it lets the decode GEMM after it launch at once (allow_dependent_launch), as the quantizer
// does; with quant_ops_pdl it is itself a programmatic dependent of the GEMM before it
// (SiluQuantArgs::pdl).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/device.h"
#include "common/launch.h"
#include "gemm/w4a8_gemm.h"
#include "quant/act_int8.cuh"

namespace mixprec {
namespace {

// ATen's silu in float32 (ActivationSiluKernel.cu): expf and the division as nvcc compiles them
// without fast math, so the values are torch's bit for bit.
__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() { asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory"); }
#endif

// grid (plan.ctas, M), clusters of plan.ctas CTAs along x (CTA rank = blockIdx.x). Thread t of CTA c
// holds vectors c * blockDim.x * kVecs + j * blockDim.x + t, j < kVecs, of its row's K / 8.
// smooth (float32) may be null. K % 8 == 0 and 16-byte aligned rows (the launcher checks).
template <typename T, int kVecs>
__global__ void __launch_bounds__(kSiluQuantMaxThreads, 1) silu_mul_quantize_act_kernel(
    const T* __restrict__ gate_up, int64_t row_stride, const float* __restrict__ smooth, int8_t* __restrict__ q,
    float* __restrict__ scale, int K) {
  __shared__ float s_max[32];
  allow_dependent_launch();
  wait_prior_grids();
  const int64_t row = blockIdx.y;
  const int vecs = K / 8;
  const int first = blockIdx.x * blockDim.x * kVecs + threadIdx.x;
  const T* gate = gate_up + row * row_stride;
  const T* up = gate + K;

  Raw8<T> ga[kVecs], ua[kVecs];
  Raw8<float> sa[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = first + j * blockDim.x;
    if (vi < vecs) {
      ga[j] = load_raw8(gate + vi * 8);
      ua[j] = load_raw8(up + vi * 8);
      if (smooth != nullptr) sa[j] = load_raw8(smooth + vi * 8);
    }
  }

  float v[kVecs][8];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = first + j * blockDim.x;
    if (vi < vecs) {
      float u[8];
      to_float8(ga[j], v[j]);
      to_float8(ua[j], u);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[j][e] = silu(v[j][e]);
      round8<T>(v[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[j][e] *= u[e];
      round8<T>(v[j]);
      amax = smooth_then_amax8(v[j], sa[j], smooth != nullptr, amax);
    }
  }
  // this CTA's amax, left in s_max[0] for the cluster's other CTAs
  float row_amax = block_reduce(nan_to_inf(amax), s_max, MaxOp{});
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned ctas = gridDim.x;
  if (ctas > 1) {
    cluster_arrive_release();  // every CTA's s_max[0] is written
    cluster_wait_acquire();
    for (unsigned r = 0; r < ctas; ++r)
      if (r != blockIdx.x) row_amax = fmaxf(row_amax, *static_cast<const float*>(__cluster_map_shared_rank(s_max, r)));
    cluster_arrive_release();  // its loads of the others done (release orders them); waited on before exit
  }
#endif
  const float sc = scale_of_amax(row_amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[row] = sc;
  const float inv_sc = 1.0f / sc;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = first + j * blockDim.x;
    if (vi < vecs) *reinterpret_cast<uint2*>(q + row * K + vi * 8) = pack_codes8_lean(v[j], sc, inv_sc);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (ctas > 1) cluster_wait_acquire();  // no CTA exits while another may read its s_max
#endif
}

template <typename T>
cudaError_t launch_for(const SiluQuantArgs& a, const SiluQuantPlan& p, cudaStream_t stream) {
  const dim3 grid(p.ctas, a.M), block(p.threads), cluster(p.ctas, 1, 1);
  const T* gate_up = static_cast<const T*>(a.gate_up);
  if (p.vecs == 1)
    return launch_kernel_clustered<silu_mul_quantize_act_kernel<T, 1>>(grid, block, 0, a.pdl, cluster, stream, gate_up,
                                                                       a.row_stride, a.smooth, a.q, a.scale, a.K);
  return launch_kernel_clustered<silu_mul_quantize_act_kernel<T, 2>>(grid, block, 0, a.pdl, cluster, stream, gate_up,
                                                                     a.row_stride, a.smooth, a.q, a.scale, a.K);
}

}  // namespace

bool silu_mul_quantize_act_plan(int K, int max_cluster, int cta_vecs, SiluQuantPlan* plan) {
  if (K <= 0 || K % 8 != 0 || max_cluster < 1 || max_cluster > kSiluQuantMaxCluster || cta_vecs < 1 ||
      cta_vecs > kSiluQuantMaxThreads * kSiluQuantMaxVecs)
    return false;
  const int vecs = K / 8;
  const int ctas = std::min(max_cluster, ceil_div(vecs, cta_vecs));
  const int per_cta = ceil_div(vecs, ctas);
  const int per_thread = ceil_div(per_cta, kSiluQuantMaxThreads);
  if (per_thread > kSiluQuantMaxVecs) return false;
  plan->ctas = ctas;
  plan->vecs = per_thread;
  plan->threads = ceil_div(ceil_div(per_cta, per_thread), 32) * 32;
  return true;
}

cudaError_t silu_mul_quantize_act_launch(const SiluQuantArgs& a, const SiluQuantPlan& p, cudaStream_t stream) {
  if (a.M == 0) return cudaSuccess;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (a.K % 8 != 0 || a.row_stride % 8 != 0 || !aligned(a.gate_up) || !aligned(a.q) ||
      (a.smooth != nullptr && !aligned(a.smooth)) || a.M > kSiluQuantMaxRows)
    return cudaErrorInvalidValue;
  return a.kind == OutKind::kHalf ? launch_for<__half>(a, p, stream) : launch_for<__nv_bfloat16>(a, p, stream);
}

}  // namespace mixprec
