// Device helpers of the per-token int8 activation kernels (reference.quantize_act's math):
// 16-byte vector loads and conversions, the lean codes, the row reductions, the scale (the PDL
// trigger and wait: common/ptx.h). Shared by quantize_act_int8.cu, add_rms_norm_quantize_act.cu and
// silu_mul_quantize_act.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/ptx.h"  // allow_dependent_launch, wait_prior_grids

namespace mixprec {

// 8 input elements as loaded (16 bytes of half/bf16, 32 of float).
template <typename T>
struct Raw8 {
  uint4 u[sizeof(T) / 2];
};
__device__ __forceinline__ void to_float8(const Raw8<float>& r, float (&v)[8]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    v[4 * i] = __uint_as_float(r.u[i].x);
    v[4 * i + 1] = __uint_as_float(r.u[i].y);
    v[4 * i + 2] = __uint_as_float(r.u[i].z);
    v[4 * i + 3] = __uint_as_float(r.u[i].w);
  }
}
// A 16-bit dtype's pair type and its conversions from and to two floats (round to nearest even).
template <typename T>
struct Pair16;
template <>
struct Pair16<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type h) { return __half22float2(h); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};
template <>
struct Pair16<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type h) { return __bfloat1622float2(h); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <typename T>
__device__ __forceinline__ void to_float8(const Raw8<T>& r, float (&v)[8]) {
  const uint32_t w[4] = {r.u[0].x, r.u[0].y, r.u[0].z, r.u[0].w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    typename Pair16<T>::type h;
    memcpy(&h, &w[i], 4);
    const float2 f = Pair16<T>::to_float2(h);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
// v rounded to T in place (the dtype roundings of torch's 16-bit ops); its 16 bytes returned.
template <typename T>
__device__ __forceinline__ uint4 round8(float (&v)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const typename Pair16<T>::type h = Pair16<T>::from_floats(v[2 * i], v[2 * i + 1]);
    const float2 f = Pair16<T>::to_float2(h);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
    memcpy(&w[i], &h, 4);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T>
__device__ __forceinline__ Raw8<T> load_raw8(const T* p) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T)) / 2; ++i) r.u[i] = reinterpret_cast<const uint4*>(p)[i];
  return r;
}
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  to_float8(load_raw8(p), v);
}

// The one-pass kernel's codes, lean (session 46): q = rint(v * (1 / scale)) gives rint(v / scale) (the
// reference's IEEE division) wherever t = v * (1 / scale) lies more than 2^-14 from a half-integer:
// |t| <= 127 (+ rounding), so t is within 2^-16 + 2^-18 of fl(v / scale) and on the same side of
// every half-integer. Nearer (ties included), the division decides. No clamp: |rint| <= 127 since
// scale = amax / 127. A NaN scale (non-finite row) gives zero codes, as the reference. Why: the
// quantizer issues ~34 instructions an element (ncu, M = 1024), the division ~10 of them.
__device__ __forceinline__ uint2 pack_codes8_lean(const float (&v)[8], float sc, float inv_sc) {
  uint32_t packed[2] = {0u, 0u};
  if (sc == sc) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float t = v[j] * inv_sc;
      if (fabsf(t - rintf(t)) > 0.5f - 6.103515625e-05f) t = __fdiv_rn(v[j], sc);
      packed[j >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(__float2int_rn(t))) << (8 * (j & 3));
    }
  }
  return make_uint2(packed[0], packed[1]);
}

// max(a, |b|) with NaN propagated (one FMNMX.NAN): the lean amax; a NaN is mapped to +inf once a
// thread's vectors are done (nan_to_inf), since the block reduction's fmaxf drops NaN.
__device__ __forceinline__ float max_abs_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(fabsf(b)));
  return d;
}
__device__ __forceinline__ float nan_to_inf(float a) { return a == a ? a : __int_as_float(0x7f800000); }

// v / smooth (IEEE division, as the reference) where has_smooth, then amax = max(amax, |v|) over
// the 8 (max_abs_nan): the last steps of a fused kernel's row before its scale.
__device__ __forceinline__ float smooth_then_amax8(float (&v)[8], const Raw8<float>& smooth, bool has_smooth,
                                                   float amax) {
  if (has_smooth) {
    float s[8];
    to_float8(smooth, s);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = __fdiv_rn(v[e], s[e]);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) amax = max_abs_nan(amax, v[e]);
  return amax;
}

// A CTA's reduction of one float a thread (0 is op's identity), the result in every thread.
// s_red: 32 floats, which hold the result afterwards: a second reduction takes other ones.
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, float* s_red, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < (blockDim.x >> 5) ? s_red[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) s_red[0] = v;
  }
  __syncthreads();
  return s_red[0];
}
__device__ __forceinline__ float block_max(float v, float* s_red) { return block_reduce(v, s_red, MaxOp{}); }

// A row's scale from its amax; NaN marks a non-finite row.
__device__ __forceinline__ float scale_of_amax(float amax) {
  return isinf(amax) ? __int_as_float(0x7fffffff) : fmaxf(amax, 1e-8f) / 127.0f;
}

}  // namespace mixprec
