// Device side of the packed W4A8 weight layout, shared by the mma.sync (sm80/) and wgmma (sm90/)
// kernels: the chunk geometry, the LiquidQuant dequantization of one lane's 16-byte word, and the
// paired output stores. The layout itself: csrc/gemm/NOTES.md "Layout" (kernels/cuda.py:repack_w4a8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mixprec {

constexpr int kChunkK = 64;       // k per packed chunk (two k32 MMA steps)
constexpr int kChunkBytes = 512;  // one 16-channel x 64-k chunk = 32 lanes x 16 B, lane-ordered

// One packed 16-byte word -> the A fragments of two k32 steps: a[step][reg].
// Per u32: 8 nibbles -> two registers of 4 byte lanes (AND, SHF+AND), then IMAD + XOR each.
// No lane carries: q * s + a <= 255 by construction of LiquidQuant (formats.py).
// kUnsigned keeps u = q * s + a (= w8 + 128, no XOR) for a u8 x s8 MMA (decode_u8 option).
template <bool kUnsigned = false>
__device__ __forceinline__ void dequant_chunk(const uint4 w, const uint32_t params, uint32_t (&a)[2][4]) {
  constexpr uint32_t kFlip = kUnsigned ? 0u : 0x80808080u;
  const uint32_t s_even = __byte_perm(params, 0, 0x4440);  // scale of channel 2g in lane 0
  const uint32_t a_even = __byte_perm(params, 0, 0x1111);  // offset of 2g in all 4 lanes
  const uint32_t s_odd = __byte_perm(params, 0, 0x4442);
  const uint32_t a_odd = __byte_perm(params, 0, 0x3333);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t s = (j & 1) ? s_odd : s_even;
    const uint32_t off = (j & 1) ? a_odd : a_even;
    const uint32_t lo = words[j] & 0x0F0F0F0Fu;         // k = 16t + 8s + 0..3
    const uint32_t hi = (words[j] >> 4) & 0x0F0F0F0Fu;  // k = 16t + 8s + 4..7
    // step j>>1; reg 0/1 = rows g / g+8 (k 0..15 of the step), reg 2/3 = k 16..31
    a[j >> 1][(j & 1)] = (lo * s + off) ^ kFlip;
    a[j >> 1][2 + (j & 1)] = (hi * s + off) ^ kFlip;
  }
}

// Two adjacent output channels, rounded once to the output type.
__device__ __forceinline__ void store2(float* p, float y0, float y1) {
  *reinterpret_cast<float2*>(p) = make_float2(y0, y1);
}
__device__ __forceinline__ void store2(__half* p, float y0, float y1) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(y0, y1);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float y0, float y1) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(y0, y1);
}

}  // namespace mixprec
