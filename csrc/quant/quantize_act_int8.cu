// Per-token symmetric int8 activations for the W4A8 GEMM (reference.quantize_act):
//   v = x / smooth (float32, IEEE division), scale = max(amax|v|, 1e-8) / 127,
//   q = clamp(rint_half_even(v / scale), -127, 127). The one-pass kernel gets the same q from
//   v * (1 / scale), dividing only near half-integers (pack_codes8_lean).
//   A row holding NaN or +-Inf gets scale NaN and zero codes (reference._poison_nonfinite).
// One CTA per token row, 16-byte loads. Rows of up to 32768 elements are read once into
// registers (one memory latency, then the reduction, then the stores): at M = 1 the kernel is
// latency-bound, and the two-pass loop it replaced took 2.1 / 4.2 / 6.5 us at K = 4096 / 14336 /
// 28672 on an H100. Longer rows and unaligned ones take the two-pass loops (the second pass
// re-reads the row from L1/L2). At 9-32 tokens a row of K >= 8192 is split over CTAs of 4096
// elements instead (quantize_act_int8_split_kernel, act_quant_split), each taking the row's amax
// itself: the codes' ~30 instructions an element no longer queue on one SM a row.
// On sm_90 the kernels let the next grid launch at once (griddepcontrol.launch_dependents):
// the decode GEMM, launched as a programmatic dependent, sets up meanwhile and waits for this
// grid before it reads the codes. (Splitting a row over a cluster of CTAs was measured too:
// csrc/gemm/NOTES.md, "PDL".) With quant_ops_pdl they are programmatic dependents themselves
// (QuantPaths::pdl), waiting for the grid before them ahead of any load.

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

__device__ __forceinline__ float load1(const float* p) { return *p; }
__device__ __forceinline__ float load1(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }

// v = x / smooth (IEEE division, as the reference): 8 elements at i (as loaded, or from
// memory) or one.
template <typename T, typename S>
__device__ __forceinline__ void unpack_input8(const Raw8<T>& r, const S* smooth, int i, float (&v)[8]) {
  to_float8(r, v);
  if (smooth != nullptr) {
    float s[8];
    load8(smooth + i, s);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = v[j] / s[j];
  }
}
template <typename T, typename S>
__device__ __forceinline__ void load_input8(const T* xr, const S* smooth, int i, float (&v)[8]) {
  unpack_input8(load_raw8(xr + i), smooth, i, v);
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

__device__ __forceinline__ uint2 pack_codes8(const float (&v)[8], float sc) {
  uint32_t packed[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < 8; ++j)
    packed[j >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(quantize_one(v[j], sc))) << (8 * (j & 3));
  return make_uint2(packed[0], packed[1]);
}

// 8 codes of a row at k = i (i % 8 == 0): one 8-byte store, or in the wgmma k order (wgmma_act_k)
// two 4-byte stores 16 bytes apart. A warp still fills whole 32-byte sectors.
__device__ __forceinline__ void store_codes8(int8_t* qr, int i, uint2 codes, bool wgmma_order) {
  if (wgmma_order) {
    *reinterpret_cast<uint32_t*>(qr + wgmma_act_k(i)) = codes.x;
    *reinterpret_cast<uint32_t*>(qr + wgmma_act_k(i + 4)) = codes.y;
  } else {
    *reinterpret_cast<uint2*>(qr + i) = codes;
  }
}

// What a CTA works on: its row of x, of the codes and of the scales. Every quantizer kernel
// first lets the dependent GEMM launch, then waits for the grid before it (see the top of this file).
template <typename T>
struct QuantRow {
  int64_t row;
  const T* x;
  int8_t* q;
};
template <typename T>
__device__ __forceinline__ QuantRow<T> begin_row(const T* x, int64_t x_row_stride, int8_t* q, int K,
                                                 int64_t row) {
  allow_dependent_launch();
  wait_prior_grids();
  return {row, x + row * x_row_stride, q + row * K};
}

// The row's scale from each thread's partial amax; thread 0 stores it.
__device__ __forceinline__ float row_scale(float amax, float* s_red, float* scale, int64_t row) {
  const float sc = scale_of_amax(block_max(amax, s_red));
  if (threadIdx.x == 0) scale[row] = sc;
  return sc;
}

// The one-pass kernel: up to 1024 threads x 4 vectors of 8 elements (K <= 32768). At 8 vectors
// ptxas spills under the 64-register cap of 1024-thread CTAs (it keeps the converted floats
// live between the two uses).
constexpr int kRegsThreads = 1024;
constexpr int kRegsMaxVecs = 4;
// Rows of more than one vector a thread (K > 8192) take the one-pass kernel only up to this many
// rows (about one CTA an SM): beyond, its 1024-thread CTAs leave too few loads in flight and the
// two-pass loop's 512-thread CTAs win. H200, K = 14336: one-pass / two-pass 3.8 / 4.5 us at M =
// 64, 7.1 / 6.4 at M = 256, 27.1 / 18.6 at M = 1024; at K <= 8192 one-pass is never slower
// (session 31, csrc/gemm/NOTES.md "PDL").
constexpr int kRegsMaxRowsMultiVec = 128;

// kVec: K % 8 == 0 and 16-byte aligned rows (8 elements per access); otherwise scalar.
template <typename T, typename S, bool kVec>
__global__ void quantize_act_int8_kernel(const T* __restrict__ x, int64_t x_row_stride,
                                         const S* __restrict__ smooth, int8_t* __restrict__ q,
                                         float* __restrict__ scale, int K, bool wgmma_order) {
  __shared__ float s_red[32];
  const QuantRow<T> r = begin_row(x, x_row_stride, q, K, blockIdx.x);
  const T* xr = r.x;
  int8_t* qr = r.q;

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
  const float sc = row_scale(amax, s_red, scale, r.row);

  if constexpr (kVec) {
    for (int i = threadIdx.x * 8; i < K; i += blockDim.x * 8) {
      float v[8];
      load_input8(xr, smooth, i, v);
      store_codes8(qr, i, pack_codes8(v, sc), wgmma_order);
    }
  } else {
    for (int i = threadIdx.x; i < K; i += blockDim.x)
      qr[wgmma_order ? wgmma_act_k(i) : i] = quantize_one(load_input1(xr, smooth, i), sc);
  }
}

// One pass: thread t holds vectors t, t + blockDim.x, ... of its row (coalesced). One vector a
// thread stays at 32 registers (K = 4096: 4 CTAs of 512 threads an SM), as it compiled before the
// lean arithmetic.
template <typename T, typename S, int kVecs, bool kLean>
__global__ void __launch_bounds__(kRegsThreads, kVecs == 1 ? 2 : 1) quantize_act_int8_regs_kernel(
    const T* __restrict__ x, int64_t x_row_stride, const S* __restrict__ smooth, int8_t* __restrict__ q,
    float* __restrict__ scale, int K, bool wgmma_order) {
  __shared__ float s_red[32];
  const QuantRow<T> r = begin_row(x, x_row_stride, q, K, blockIdx.x);
  const T* xr = r.x;
  int8_t* qr = r.q;
  const int vecs = K / 8;

  Raw8<T> raw[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = threadIdx.x + j * blockDim.x;
    if (vi < vecs) raw[j] = load_raw8(xr + vi * 8);
  }
  // f(vector index, its 8 inputs) over this thread's vectors, converted again for each use
  auto each_vec = [&](auto&& f) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int vi = threadIdx.x + j * blockDim.x;
      if (vi < vecs) {
        float v[8];
        unpack_input8(raw[j], smooth, vi * 8, v);
        f(vi, v);
      }
    }
  };
  float amax = 0.f;
  each_vec([&](int, const float (&v)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = kLean ? max_abs_nan(amax, v[e]) : fmaxf(amax, abs_or_inf(v[e]));
  });
  const float sc = row_scale(kLean ? nan_to_inf(amax) : amax, s_red, scale, r.row);
  if constexpr (kLean) {
    const float inv_sc = 1.0f / sc;
    each_vec([&](int vi, const float (&v)[8]) {
      store_codes8(qr, vi * 8, pack_codes8_lean(v, sc, inv_sc), wgmma_order);
    });
  } else {
    each_vec([&](int vi, const float (&v)[8]) { store_codes8(qr, vi * 8, pack_codes8(v, sc), wgmma_order); });
  }
}

// A row's largest magnitude, from the input's own bits with the sign cleared: IEEE magnitudes order
// as unsigned integers (NaN above Inf), so the max of 8 elements a vector is exact, one LOP3 and one
// VIMNMX a word. (fp16 / bf16: two 16-bit halves a word, compared as u16x2.)
__device__ __forceinline__ uint32_t max_magnitude8(const Raw8<float>& r, uint32_t m) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m = max(m, r.u[i].x & 0x7fffffffu);
    m = max(m, r.u[i].y & 0x7fffffffu);
    m = max(m, r.u[i].z & 0x7fffffffu);
    m = max(m, r.u[i].w & 0x7fffffffu);
  }
  return m;
}
template <typename T>
__device__ __forceinline__ uint32_t max_magnitude8(const Raw8<T>& r, uint32_t m) {
  m = __vmaxu2(m, r.u[0].x & 0x7fff7fffu);
  m = __vmaxu2(m, r.u[0].y & 0x7fff7fffu);
  m = __vmaxu2(m, r.u[0].z & 0x7fff7fffu);
  return __vmaxu2(m, r.u[0].w & 0x7fff7fffu);
}
// Those bits as the float amax; +inf where the row holds a NaN or an Inf (scale_of_amax: NaN scale).
__device__ __forceinline__ float amax_of_magnitude(uint32_t m, const float*) {
  return m >= 0x7f800000u ? __int_as_float(0x7f800000) : __uint_as_float(m);
}
__device__ __forceinline__ float amax_of_magnitude(uint32_t m, const __nv_bfloat16*) {
  const uint32_t b = max(m & 0xffffu, m >> 16);
  return b >= 0x7f80u ? __int_as_float(0x7f800000) : __uint_as_float(b << 16);
}
__device__ __forceinline__ float amax_of_magnitude(uint32_t m, const __half*) {
  const uint32_t b = max(m & 0xffffu, m >> 16);
  return b >= 0x7c00u ? __int_as_float(0x7f800000) : __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
}

// Split rows (act_quant_split): grid (chunks, M), a CTA of blockDim.x threads codes one vector a
// thread of its row's chunk of 8 * blockDim.x elements. Every CTA takes the whole row's amax
// itself (its other chunks come from L2 once one CTA has fetched them), as integer maxima, about
// one instruction an element against the codes' ~30: so the codes of a long row are spread over
// several SMs, at one launch and no workspace. At M = 16, K = 28672 the one-pass kernel codes the
// row on one SM, issue-bound (csrc/gemm/NOTES.md "quantize_act"). Same scale and codes as the
// one-pass lean kernel. No smoothing divisor: its per-element division would make the amax cost
// what the codes do.
constexpr int kSplitMaxThreads = 512;
template <typename T>
__global__ void __launch_bounds__(kSplitMaxThreads) quantize_act_int8_split_kernel(
    const T* __restrict__ x, int64_t x_row_stride, int8_t* __restrict__ q, float* __restrict__ scale, int K,
    bool wgmma_order) {
  __shared__ float s_red[32];
  const QuantRow<T> r = begin_row(x, x_row_stride, q, K, blockIdx.y);
  const int vecs = K / 8, chunk_vecs = blockDim.x;
  const int own = blockIdx.x * chunk_vecs + threadIdx.x;
  Raw8<T> mine;
  uint32_t mag = 0;
  if (own < vecs) {
    mine = load_raw8(r.x + own * 8);
    mag = max_magnitude8(mine, 0u);
  }
#pragma unroll 4
  for (int c = 0; c < static_cast<int>(gridDim.x); ++c) {
    const int vi = c * chunk_vecs + threadIdx.x;
    if (c != static_cast<int>(blockIdx.x) && vi < vecs) mag = max_magnitude8(load_raw8(r.x + vi * 8), mag);
  }
  const float sc = scale_of_amax(block_max(amax_of_magnitude(mag, r.x), s_red));
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[r.row] = sc;
  if (own < vecs) {
    float v[8];
    to_float8(mine, v);
    store_codes8(r.q, own * 8, pack_codes8_lean(v, sc, 1.0f / sc), wgmma_order);
  }
}

// The kernels a call may take: vec (K % 8 == 0 and aligned rows: 8 elements per access),
// one_pass (act_quant_one_pass), lean (act_quant_lean); and where the codes go (wgmma_order).
struct QuantPaths {
  bool vec, one_pass, lean, wgmma_order;
  int split_chunk;  // quantize_act_split_chunk(): 0, or the split kernel's chunk
  bool pdl;         // a programmatic dependent launch (quant_ops_pdl)
};

// A kernel of one CTA a row (grid M) with the row kernels' arguments, PDL as paths asks.
template <auto kKernel, typename T, typename S>
cudaError_t launch_rows(dim3 grid, int threads, const T* x, int64_t stride, const S* smooth, int8_t* q, float* scale,
                        int K, const QuantPaths& paths, cudaStream_t stream) {
  return launch_kernel<kKernel>(grid, dim3(threads), 0, paths.pdl, stream, x, stride, smooth, q, scale, K,
                                paths.wgmma_order);
}

template <typename T, typename S, bool kLean>
cudaError_t launch_regs_kernel(const T* x, int64_t stride, const S* smooth, int8_t* q, float* scale, int M, int K,
                               const QuantPaths& paths, cudaStream_t stream) {
  const int vecs = K / 8;
  int p = 1;  // vectors a thread: the fewest that hold the row
  while (p * kRegsThreads < vecs) p *= 2;
  const int threads = ((ceil_div(vecs, p) + 31) / 32) * 32;
  switch (p) {
    case 1:
      return launch_rows<quantize_act_int8_regs_kernel<T, S, 1, kLean>>(dim3(M), threads, x, stride, smooth, q, scale,
                                                                        K, paths, stream);
    case 2:
      return launch_rows<quantize_act_int8_regs_kernel<T, S, 2, kLean>>(dim3(M), threads, x, stride, smooth, q, scale,
                                                                        K, paths, stream);
    default:
      return launch_rows<quantize_act_int8_regs_kernel<T, S, kRegsMaxVecs, kLean>>(dim3(M), threads, x, stride, smooth,
                                                                                   q, scale, K, paths, stream);
  }
}

template <typename T, typename S>
cudaError_t launch_row_kernel(const T* x, int64_t stride, const S* smooth, int8_t* q, float* scale, int M, int K,
                              QuantPaths paths, cudaStream_t stream) {
  const int vecs = K / 8;
  const bool vec = paths.vec, one_pass = paths.one_pass;
  if (paths.split_chunk > 0 && vec && smooth == nullptr) {
    const int threads = paths.split_chunk / 8;
    return launch_kernel<quantize_act_int8_split_kernel<T>>(dim3(ceil_div(vecs, threads), M), dim3(threads), 0,
                                                            paths.pdl, stream, x, stride, q, scale, K,
                                                            paths.wgmma_order);
  }
  if (one_pass && vec && vecs <= kRegsThreads * kRegsMaxVecs && (vecs <= kRegsThreads || M <= kRegsMaxRowsMultiVec))
    return paths.lean ? launch_regs_kernel<T, S, true>(x, stride, smooth, q, scale, M, K, paths, stream)
                      : launch_regs_kernel<T, S, false>(x, stride, smooth, q, scale, M, K, paths, stream);
  const int work = vec ? (K + 7) / 8 : K;
  int threads = ((work + 31) / 32) * 32;
  threads = threads < 32 ? 32 : (threads > 512 ? 512 : threads);
  if (vec)
    return launch_rows<quantize_act_int8_kernel<T, S, true>>(dim3(M), threads, x, stride, smooth, q, scale, K, paths,
                                                             stream);
  return launch_rows<quantize_act_int8_kernel<T, S, false>>(dim3(M), threads, x, stride, smooth, q, scale, K, paths,
                                                            stream);
}

template <typename T>
cudaError_t launch_for_x(const void* x, int64_t stride, const void* smooth, OutKind smooth_kind, int8_t* q,
                         float* scale, int M, int K, QuantPaths paths, cudaStream_t stream) {
  const T* xt = static_cast<const T*>(x);
  if (smooth == nullptr || smooth_kind == OutKind::kFloat)
    return launch_row_kernel<T, float>(xt, stride, static_cast<const float*>(smooth), q, scale, M, K, paths, stream);
  if (smooth_kind == OutKind::kHalf)
    return launch_row_kernel<T, __half>(xt, stride, static_cast<const __half*>(smooth), q, scale, M, K, paths, stream);
  return launch_row_kernel<T, __nv_bfloat16>(xt, stride, static_cast<const __nv_bfloat16*>(smooth), q, scale, M, K,
                                             paths, stream);
}

}  // namespace

// The split kernel's chunk (elements; 0: no split) for M rows of K under option `split`
// (act_quant_split): 0 never; 1 the rule; 1024, 2048 or 4096 that chunk wherever M <= 64 and the
// row makes two. The rule, from session 80's H100 runs (csrc/gemm/NOTES.md "Session 80"): 4096 was
// the fastest chunk for the quantizer alone at every K >= 8192 and M <= 32 (K = 28672, M = 16: 6.66
// -> 3.69 us), 1024 the slowest; at M = 64, K = 28672 lost (5.27 -> 5.61 us). The linear gained
// 1.0-1.6 us at M = 16-32 on K >= 14336, but at M <= 8, where the decode GEMM reads its first
// weights while the quantizer runs (decode_preload_max_m), it did not, and under the write flush
// 28672 x 8192 at M = 1 lost 1.0 us (54.2 -> 55.2).
constexpr int kSplitRuleMinM = 9;
constexpr int kSplitRuleMaxM = 32;
constexpr int kSplitRuleMinK = 8192;
constexpr int kSplitRuleChunk = 4096;
int quantize_act_split_chunk(int split, int M, int K) {
  if (split == 0) return 0;
  if (split == 1)
    return M >= kSplitRuleMinM && M <= kSplitRuleMaxM && K >= kSplitRuleMinK ? kSplitRuleChunk : 0;
  return M <= 64 && K >= 2 * split ? split : 0;
}

cudaError_t quantize_act_int8_launch(const void* x, OutKind x_kind, int64_t x_row_stride, const void* smooth,
                                     OutKind smooth_kind, int8_t* q, float* scale, int M, int K,
                                     bool one_pass, bool lean, int split, bool wgmma_order, bool pdl,
                                     cudaStream_t stream) {
  if (M == 0) return cudaSuccess;
  if (wgmma_order && K % 64 != 0) return cudaErrorInvalidValue;  // the order permutes whole 64-k chunks
  // 8 elements per access: rows must start on 16-byte boundaries (x) and 8-byte ones (q).
  const bool vec = K % 8 == 0 && (x_row_stride % 8) == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                   (smooth == nullptr || reinterpret_cast<uintptr_t>(smooth) % 16 == 0) &&
                   reinterpret_cast<uintptr_t>(q) % 8 == 0;
  const QuantPaths paths{vec, one_pass, lean, wgmma_order, quantize_act_split_chunk(split, M, K), pdl};
  switch (x_kind) {
    case OutKind::kHalf:
      return launch_for_x<__half>(x, x_row_stride, smooth, smooth_kind, q, scale, M, K, paths, stream);
    case OutKind::kBFloat16:
      return launch_for_x<__nv_bfloat16>(x, x_row_stride, smooth, smooth_kind, q, scale, M, K, paths, stream);
    default: return launch_for_x<float>(x, x_row_stride, smooth, smooth_kind, q, scale, M, K, paths, stream);
  }
}

}  // namespace mixprec
