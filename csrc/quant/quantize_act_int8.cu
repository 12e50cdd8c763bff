// Per-token symmetric int8 activations for the W4A8 GEMM (reference.quantize_act):
//   v = x / smooth (float32, IEEE division), scale = max(amax|v|, 1e-8) / 127,
//   q = clamp(rint_half_even(v / scale), -127, 127).
//   A row holding NaN or +-Inf gets scale NaN and zero codes (reference._poison_nonfinite).
// One CTA per token row; 16-byte loads; the second pass re-reads the row from L1/L2.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gemm/w4a8_gemm.h"

namespace mixprec {
namespace {

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
__device__ __forceinline__ void load8(const __half* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// v = x / smooth (IEEE division, as the reference), 8 elements from i or one.
template <typename T, typename S>
__device__ __forceinline__ void load_input8(const T* xr, const S* smooth, int i, float (&v)[8]) {
  load8(xr + i, v);
  if (smooth != nullptr) {
    float s[8];
    load8(smooth + i, s);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = v[j] / s[j];
  }
}
template <typename T, typename S>
__device__ __forceinline__ float load_input1(const T* xr, const S* smooth, int i) {
  const float v = load1(xr + i);
  return smooth != nullptr ? v / load1(smooth + i) : v;
}

// |v|, with NaN mapped to +inf: fmaxf drops NaN, so a row holding one would otherwise get a
// finite scale and finite garbage outputs. An infinite amax marks the row non-finite.
__device__ __forceinline__ float abs_or_inf(float v) {
  const float a = fabsf(v);
  return a <= 3.402823466e38f ? a : __int_as_float(0x7f800000);
}

__device__ __forceinline__ int8_t quantize_one(float v, float scale) {
  if (scale != scale) return 0;  // non-finite row (reference._poison_nonfinite): NaN scale, zero codes
  int q = __float2int_rn(v / scale);  // round half to even, like torch.round
  q = q > 127 ? 127 : (q < -127 ? -127 : q);
  return static_cast<int8_t>(q);
}

__device__ __forceinline__ float block_max(float v, float* s_red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x >> 5) ? s_red[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) s_red[0] = v;
  }
  __syncthreads();
  return s_red[0];
}

// kVec: K % 8 == 0 and 16-byte aligned rows (8 elements per access); otherwise scalar.
template <typename T, typename S, bool kVec>
__global__ void quantize_act_int8_kernel(const T* __restrict__ x, int64_t x_row_stride,
                                         const S* __restrict__ smooth, int8_t* __restrict__ q,
                                         float* __restrict__ scale, int K) {
  __shared__ float s_red[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_row_stride;
  int8_t* qr = q + row * K;

  float amax = 0.f;
  if constexpr (kVec) {
    for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8) {
      float v[8];
      load_input8(xr, smooth, i, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, abs_or_inf(v[j]));
    }
  } else {
    for (int i = threadIdx.x; i < K; i += blockDim.x) amax = fmaxf(amax, abs_or_inf(load_input1(xr, smooth, i)));
  }
  amax = block_max(amax, s_red);
  const float sc = isinf(amax) ? __int_as_float(0x7fffffff) : fmaxf(amax, 1e-8f) / 127.0f;
  if (threadIdx.x == 0) scale[row] = sc;

  if constexpr (kVec) {
    for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8) {
      float v[8];
      load_input8(xr, smooth, i, v);
      uint32_t packed[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; ++j)
        packed[j >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(quantize_one(v[j], sc))) << (8 * (j & 3));
      *reinterpret_cast<uint2*>(qr + i) = make_uint2(packed[0], packed[1]);
    }
  } else {
    for (int i = threadIdx.x; i < K; i += blockDim.x) qr[i] = quantize_one(load_input1(xr, smooth, i), sc);
  }
}

template <typename T, typename S>
void launch_row_kernel(const T* x, int64_t stride, const S* smooth, int8_t* q, float* scale, int M, int K,
                       bool vec, cudaStream_t stream) {
  const int work = vec ? (K + 7) / 8 : K;
  int threads = ((work + 31) / 32) * 32;
  threads = threads < 32 ? 32 : (threads > 512 ? 512 : threads);
  if (vec)
    quantize_act_int8_kernel<T, S, true><<<M, threads, 0, stream>>>(x, stride, smooth, q, scale, K);
  else
    quantize_act_int8_kernel<T, S, false><<<M, threads, 0, stream>>>(x, stride, smooth, q, scale, K);
}

template <typename T>
void launch_for_x(const void* x, int64_t stride, const void* smooth, OutKind smooth_kind, int8_t* q,
                  float* scale, int M, int K, bool vec, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  if (smooth == nullptr || smooth_kind == OutKind::kFloat)
    launch_row_kernel<T, float>(xt, stride, static_cast<const float*>(smooth), q, scale, M, K, vec, stream);
  else if (smooth_kind == OutKind::kHalf)
    launch_row_kernel<T, __half>(xt, stride, static_cast<const __half*>(smooth), q, scale, M, K, vec, stream);
  else
    launch_row_kernel<T, __nv_bfloat16>(xt, stride, static_cast<const __nv_bfloat16*>(smooth), q, scale, M,
                                        K, vec, stream);
}

}  // namespace

cudaError_t quantize_act_int8_launch(const void* x, OutKind x_kind, int64_t x_row_stride, const void* smooth,
                                     OutKind smooth_kind, int8_t* q, float* scale, int M, int K,
                                     cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  // 8 elements per access: rows must start on 16-byte boundaries (x) and 8-byte ones (q).
  const bool vec = K % 8 == 0 && (x_row_stride % 8) == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   (smooth == nullptr || reinterpret_cast<uintptr_t>(smooth) % 16 == 0) &&
                   reinterpret_cast<uintptr_t>(q) % 8 == 0;
  switch (x_kind) {
    case OutKind::kHalf: launch_for_x<__half>(x, x_row_stride, smooth, smooth_kind, q, scale, M, K, vec, stream); break;
    case OutKind::kBFloat16:
      launch_for_x<__nv_bfloat16>(x, x_row_stride, smooth, smooth_kind, q, scale, M, K, vec, stream);
      break;
    default: launch_for_x<float>(x, x_row_stride, smooth, smooth_kind, q, scale, M, K, vec, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace mixprec
