// W4A8 GEMM on int8 mma.sync (sm80 and sm90): y[m, n] = xs[m] * cs[n] * sum_k xq[m, k] * w8[n, k] (+ bias[n]).
//
// Orientation: Y^T = W X^T. The weight is the A operand (16 output channels x 32 k) of
// mma.m16n8k32.s8, dequantised in registers from LiquidQuant nibbles with
// w8 = (q * s + a) ^ 0x80 (exact in byte lanes); tokens are the B operand (n = 8).
// Integer accumulation runs over all of K: the group parameters give exact int8 weights,
// so no float math happens before the epilogue.
//
// Packed weight layout (repacked offline by vllm_mixprec/kernels/cuda.py:repack_w4a8):
//   qweight [N/16, K/64, 32 lanes, 16 bytes]: one 16-byte word per lane holds the A
//   fragments of two consecutive k32 steps (LDG.128 / LDS.128, no ldmatrix). Inside a
//   16-channel tile, MMA row r is channel 2*(r%8) + r/8, so that accumulator registers
//   c0/c2 are adjacent channels (one 32-bit store of a half2). Inside a 64-k chunk, lane
//   t's two k32 steps cover actual k in [16t, 16t+16), so its B fragments are one
//   contiguous 16-byte load of the activations (the k permutation is shared by A and B).
//   u32 word j of a lane (g = lane/4, t = lane%4): channel 2g + (j&1), step s = j>>1,
//   byte b = nibble(k = 16t + 8s + b) | nibble(k + 4) << 4.
//   gparams [N/16, K/G, 8 (g)] u32 = (s[2g], a[2g], s[2g+1], a[2g+1]) bytes.
// See csrc/gemm/NOTES.md for the derivation and the performance model.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device.h"
#include "common/launch.h"
#include "common/ptx.h"  // cp.async, griddepcontrol
#include "gemm/w4a8_gemm.h"
#include "gemm/w4a8_packed.cuh"  // dequant_chunk, store2 (shared with the wgmma kernels)

namespace mixprec {
namespace {

constexpr int kDecodeWarps = 8;    // intra-CTA split-K for the decode kernels
constexpr int kDecodeThreads = kDecodeWarps * 32;

using Params = W4A8KernelParams;

// ---- memory ------------------------------------------------------------------------------

// (ldg_stream_v4, common/device.h: weights are read once, so they skip L1 and the activations stay there.)
__device__ __forceinline__ uint4 ldg_v4(const void* ptr) {
  return __ldg(reinterpret_cast<const uint4*>(ptr));
}

// ---- MMA -----------------------------------------------------------------------------------

// A is s8 (w8), or u8 (u = w8 + 128) when kUnsigned; B (activations) is s8.
template <bool kUnsigned = false>
__device__ __forceinline__ void mma_16x8x32(int32_t (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kUnsigned) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Both k32 steps of a chunk; x holds the lane's 16 activations k = 16t .. 16t+15.
template <bool kUnsigned = false>
__device__ __forceinline__ void mma_chunk(int32_t (&c)[4], const uint32_t (&a)[2][4], const uint4 x) {
  mma_16x8x32<kUnsigned>(c, a[0], x.x, x.y);
  mma_16x8x32<kUnsigned>(c, a[1], x.z, x.w);
}

// How a decode warp turns weight words and activations into int32 sums (all exact, all equal).
enum class DecodeMath {
  kS8Mma,         // dequant to s8, mma.sync s8 x s8
  kU8Mma,         // dequant to u8 (no XOR), mma.sync u8 x s8, minus 128 * sum_k x (decode_u8)
  kDp4aOneToken,  // M = 1 only: the 4-bit codes straight into IDP.4A, no dequant (decode_dp4a)
};

// The 16 signed bytes of x, plus c.
__device__ __forceinline__ int32_t sum_s8x16(const uint4 x, int32_t c) {
  c = __dp4a(static_cast<int>(x.x), 0x01010101, c);
  c = __dp4a(static_cast<int>(x.y), 0x01010101, c);
  c = __dp4a(static_cast<int>(x.z), 0x01010101, c);
  return __dp4a(static_cast<int>(x.w), 0x01010101, c);
}

// u8 x s8 dot product of 4 bytes, plus c.
__device__ __forceinline__ int32_t dp4a_u8s8(uint32_t a, uint32_t b, int32_t c) {
  int32_t d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// IDP.4A sums of one chunk of one row tile at M = 1, without dequant: a weight byte is
// (q*s + a) ^ 0x80, i.e. q*s + (a - 128), so a row's sum is s * sum(q x) + (a - 128) * sum(x)
// over the lane's 16 k. The codes go into IDP.4A as they lie (high nibbles times 16, divided out
// in apply_group_one_token), pairing words and activations as mma_chunk does; sums[0..3] gather
// rows g / g + 8 (channels 2g / 2g + 1): low nibbles, high nibbles, low, high.
__device__ __forceinline__ void dp4a_codes_one_token(int32_t (&sums)[4], const uint4 w, const uint4 x) {
  constexpr uint32_t kLo = 0x0F0F0F0Fu, kHi = 0xF0F0F0F0u;
  sums[0] = dp4a_u8s8(w.z & kLo, x.z, dp4a_u8s8(w.x & kLo, x.x, sums[0]));
  sums[1] = dp4a_u8s8(w.z & kHi, x.w, dp4a_u8s8(w.x & kHi, x.y, sums[1]));
  sums[2] = dp4a_u8s8(w.w & kLo, x.z, dp4a_u8s8(w.y & kLo, x.x, sums[2]));
  sums[3] = dp4a_u8s8(w.w & kHi, x.w, dp4a_u8s8(w.y & kHi, x.y, sums[3]));
}

// One group's share of the dp4a_codes_one_token sums (one chunk, or two of the same group) into
// C registers 0 / 2 of lane (g, t): its group scale, and (a - 128) times x_sum, the sum of the
// same chunks' x bytes.
__device__ __forceinline__ void apply_group_one_token(int32_t (&c)[4], const int32_t (&sums)[4],
                                                      const uint32_t params, int32_t x_sum) {
  const int32_t s_even = params & 0xFFu, s_odd = (params >> 16) & 0xFFu;  // gparams bytes 0, 2
  const int32_t a_even = static_cast<int8_t>((params >> 8) ^ 0x80u);     // bytes 1, 3, minus 128
  const int32_t a_odd = static_cast<int8_t>((params >> 24) ^ 0x80u);
  c[0] += s_even * (sums[0] + (sums[1] >> 4)) + a_even * x_sum;
  c[2] += s_odd * (sums[2] + (sums[3] >> 4)) + a_odd * x_sum;
}

// ---- epilogue ------------------------------------------------------------------------------

// Output channels ch, ch+1 (ch even) of token tok from their int32 sums.
template <typename OutT>
__device__ __forceinline__ void write_pair(const Params& p, int tok, int ch, int32_t v0, int32_t v1) {
  const float xs = p.x_scale[tok];
  const float2 cs = *reinterpret_cast<const float2*>(p.channel_scale + ch);
  float y0 = static_cast<float>(v0) * xs * cs.x;
  float y1 = static_cast<float>(v1) * xs * cs.y;
  if (p.bias_kind == static_cast<int>(BiasKind::kFloat)) {
    const float* b = static_cast<const float*>(p.bias);
    y0 += b[ch];
    y1 += b[ch + 1];
  } else if (p.bias_kind == static_cast<int>(BiasKind::kSameAsOut)) {
    const OutT* b = static_cast<const OutT*>(p.bias);
    y0 += to_float(b[ch]);
    y1 += to_float(b[ch + 1]);
  }
  store2(static_cast<OutT*>(p.out) + static_cast<size_t>(tok) * p.N + ch, y0, y1);
}

__device__ __forceinline__ int2* workspace_at(const Params& p, int split, int tok, int ch) {
  return reinterpret_cast<int2*>(p.workspace + (static_cast<size_t>(split) * p.M + tok) * p.N + ch);
}

// Cross-CTA split-K: every split stored its partial sums; the last CTA to arrive on this
// tile's counter sums them (integer sums: exact, so the order does not matter).
__device__ __forceinline__ bool arrive_last(int32_t* counter, int splits) {
  __shared__ int s_is_last;
  __threadfence();  // this CTA's partials are visible before the arrival is
  __syncthreads();
  if (threadIdx.x == 0) {
    const int prev = atomicAdd(counter, 1);
    s_is_last = (prev == splits - 1);
    if (s_is_last) *counter = 0;  // leave the counter reusable
  }
  __syncthreads();
  const bool last = s_is_last;
  if (last) __threadfence();
  return last;
}

__device__ __forceinline__ int2 sum_splits(const Params& p, int splits, int tok, int ch) {
  int2 acc = make_int2(0, 0);
#pragma unroll 1
  for (int s = 0; s < splits; ++s) {
    const int2 v = __ldcg(workspace_at(p, s, tok, ch));  // L2: other SMs wrote it
    acc.x += v.x;
    acc.y += v.y;
  }
  return acc;
}

// IDP.4A sums of kBatch loaded chunks at M = 1, kStep chunks of one group at a time (2: chunk
// pairs, group >= 128; 1: every chunk alone), each share scaled once by its first chunk's group.
template <int kStep, int kBatch, int kRowTiles>
__device__ __forceinline__ void dp4a_batch_one_token(const uint4 (&wv)[kBatch][kRowTiles],
                                                     const uint32_t (&pv)[kBatch][kRowTiles],
                                                     const uint4 (&xv)[kBatch][1], int32_t (&acc)[kRowTiles][1][4]) {
#pragma unroll
  for (int u = 0; u < kBatch; u += kStep) {
    int32_t x_sum = 0;
#pragma unroll
    for (int j = 0; j < kStep; ++j) x_sum = sum_s8x16(xv[u + j][0], x_sum);
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r) {
      int32_t sums[4] = {0, 0, 0, 0};
#pragma unroll
      for (int j = 0; j < kStep; ++j) dp4a_codes_one_token(sums, wv[u + j][r], xv[u + j][0]);
      apply_group_one_token(acc[r][0], sums, pv[u][r], x_sum);
    }
  }
}

// The sums of kBatch loaded chunks: dequant + MMA, or at M = 1 IDP.4A on the codes; kU8Mma
// also sums the lane's activations per token tile into xsum. kDp4aOneToken with pair_chunks
// (group >= 128, batch starting at an even chunk) scales chunks u, u + 1 once: one group.
template <int kBatch, DecodeMath kMath, int kRowTiles, int kTokTiles>
__device__ __forceinline__ void accumulate_batch(const uint4 (&wv)[kBatch][kRowTiles],
                                                 const uint32_t (&pv)[kBatch][kRowTiles],
                                                 const uint4 (&xv)[kBatch][kTokTiles], bool pair_chunks,
                                                 int32_t (&acc)[kRowTiles][kTokTiles][4], int32_t (&xsum)[kTokTiles]) {
  constexpr bool kUnsigned = kMath == DecodeMath::kU8Mma;
  if constexpr (kMath == DecodeMath::kDp4aOneToken) {
    if constexpr (kBatch % 2 == 0) {
      if (pair_chunks) {
        dp4a_batch_one_token<2>(wv, pv, xv, acc);
        return;
      }
    }
    dp4a_batch_one_token<1>(wv, pv, xv, acc);
  } else {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
#pragma unroll
      for (int r = 0; r < kRowTiles; ++r) {
        uint32_t a[2][4];
        dequant_chunk<kUnsigned>(wv[u][r], pv[u][r], a);
#pragma unroll
        for (int tt = 0; tt < kTokTiles; ++tt) mma_chunk<kUnsigned>(acc[r][tt], a, xv[u][tt]);
      }
      if constexpr (kUnsigned) {
#pragma unroll
        for (int tt = 0; tt < kTokTiles; ++tt) xsum[tt] = sum_s8x16(xv[u][tt], xsum[tt]);
      }
    }
  }
}

// A batch whose weight words are loaded: its activations, then its sums (accumulate_batch).
template <int kBatch, DecodeMath kMath, int kRowTiles, int kTokTiles>
__device__ __forceinline__ void decode_loaded_batch(const uint4 (&wv)[kBatch][kRowTiles],
                                                    const uint32_t (&pv)[kBatch][kRowTiles],
                                                    const int8_t* (&xptr)[kTokTiles], bool pair_chunks,
                                                    int32_t (&acc)[kRowTiles][kTokTiles][4],
                                                    int32_t (&xsum)[kTokTiles]) {
  uint4 xv[kBatch][kTokTiles];
#pragma unroll
  for (int u = 0; u < kBatch; ++u)
#pragma unroll
    for (int tt = 0; tt < kTokTiles; ++tt) xv[u][tt] = ldg_v4(xptr[tt] + u * kChunkK);
#pragma unroll
  for (int tt = 0; tt < kTokTiles; ++tt) xptr[tt] += kBatch * kChunkK;
  accumulate_batch<kBatch, kMath>(wv, pv, xv, pair_chunks, acc, xsum);
}

// The weight and group words of chunk c + u for each row tile (LDG.128 + LDG.32 each).
template <int kRowTiles>
__device__ __forceinline__ void load_chunk_weights(const uint8_t* const (&wptr)[kRowTiles],
                                                   const uint32_t* const (&pptr)[kRowTiles], int c, int u,
                                                   int group_shift, uint4 (&wv)[kRowTiles], uint32_t (&pv)[kRowTiles]) {
  const uint32_t group_word = (static_cast<uint32_t>(c + u) >> group_shift) * 8u;
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r) {
    wv[r] = ldg_stream_v4(wptr[r] + u * kChunkBytes);
    pv[r] = __ldg(pptr[r] + group_word);
  }
}

// The weight and group words of a warp's first kBatch chunks, read before the PDL wait
// (decode_preload: no other kernel writes them); wptr advances past them.
template <int kBatch, int kRowTiles>
__device__ __forceinline__ void load_weights(const uint8_t* (&wptr)[kRowTiles], const uint32_t* const (&pptr)[kRowTiles],
                                             int c, int group_shift, uint4 (&wv)[kBatch][kRowTiles],
                                             uint32_t (&pv)[kBatch][kRowTiles]) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) load_chunk_weights(wptr, pptr, c, u, group_shift, wv[u], pv[u]);
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r) wptr[r] += kBatch * kChunkBytes;
}

// kBatch chunks of one warp: all loads first (kBatch * (kRowTiles + kTokTiles) independent
// 16-byte requests plus the group words), then their sums; pointers advance by kBatch chunks.
template <int kBatch, DecodeMath kMath, int kRowTiles, int kTokTiles>
__device__ __forceinline__ void decode_batch(const uint8_t* (&wptr)[kRowTiles], const uint32_t* const (&pptr)[kRowTiles],
                                             const int8_t* (&xptr)[kTokTiles], int c, int group_shift,
                                             int32_t (&acc)[kRowTiles][kTokTiles][4], int32_t (&xsum)[kTokTiles]) {
  // (Weights and activations interleave per chunk: ptxas schedules 4 token tiles differently
  // when all weight loads come first, as load_weights + decode_loaded_batch would issue them.)
  uint4 wv[kBatch][kRowTiles];
  uint32_t pv[kBatch][kRowTiles];
  uint4 xv[kBatch][kTokTiles];
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    load_chunk_weights(wptr, pptr, c, u, group_shift, wv[u], pv[u]);
#pragma unroll
    for (int tt = 0; tt < kTokTiles; ++tt) xv[u][tt] = ldg_v4(xptr[tt] + u * kChunkK);
  }
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r) wptr[r] += kBatch * kChunkBytes;
#pragma unroll
  for (int tt = 0; tt < kTokTiles; ++tt) xptr[tt] += kBatch * kChunkK;
  accumulate_batch<kBatch, kMath>(wv, pv, xv, group_shift > 0, acc, xsum);
}

// The u8 x s8 MMA summed u * x = (w8 + 128) * x: subtract 128 * sum_k x of each accumulator's
// token over the warp's chunks. Lane (g, t) summed token g's x over its k-slice; the 4 t-lanes
// hold the chunk's k, and C register i belongs to token 2t + (i & 1). Integer, so exact: the
// sums equal the s8 x s8 path's bit for bit (int32 wraparound cancels within the final value).
template <int kRowTiles, int kTokTiles>
__device__ __forceinline__ void subtract_unsigned_offset(int32_t (&acc)[kRowTiles][kTokTiles][4],
                                                         const int32_t (&xsum)[kTokTiles], int t) {
#pragma unroll
  for (int tt = 0; tt < kTokTiles; ++tt) {
    int32_t s = xsum[tt];
    s += __shfl_xor_sync(0xFFFFFFFFu, s, 1);
    s += __shfl_xor_sync(0xFFFFFFFFu, s, 2);
    const int32_t even = __shfl_sync(0xFFFFFFFFu, s, 8 * t) * 128;      // token 2t: lanes g = 2t
    const int32_t odd = __shfl_sync(0xFFFFFFFFu, s, 8 * t + 4) * 128;   // token 2t + 1
#pragma unroll
    for (int r = 0; r < kRowTiles; ++r) {
      acc[r][tt][0] -= even;
      acc[r][tt][2] -= even;
      acc[r][tt][1] -= odd;
      acc[r][tt][3] -= odd;
    }
  }
}

// kDp4aOneToken: each lane summed its own k-slice of token 0 into C registers 0 and 2; add the 4
// t-lanes' slices (lane t = 0 stores them: token 2t = 0).
template <int kRowTiles>
__device__ __forceinline__ void sum_one_token_slices(int32_t (&acc)[kRowTiles][1][4]) {
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      acc[r][0][i] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][0][i], 1);
      acc[r][0][i] += __shfl_xor_sync(0xFFFFFFFFu, acc[r][0][i], 2);
    }
}

// ---- decode kernel (M <= 64): stream the weight once -----------------------------------------
//
// CTA = kRowTiles x 16 channels, 8 warps split its K range (contiguous chunk ranges; with
// kTokGroups = 2, 4 warps per half of the CTA's tokens, the halves reading the same weight), each
// warp reads its weight words straight from global memory with kUnroll x kRowTiles
// independent LDG.128 in flight, activations from L1/L2. Warp partials meet in a shared
// int32 tile (shared atomics), then the epilogue (or the split-K workspace). (Shared-memory
// rings that keep more bytes in flight were slower: csrc/gemm/NOTES.md "Decode ring".)
// kMinCtas: CTAs per SM the registers are capped for (2: <= 128 registers; 3: <= 80, the
// decode_ctas_per_sm launch option, M <= 16 only: 4 token tiles spill at 80). kPreload: each
// warp reads its first batch of weight words before the PDL wait (decode_preload). kMath:
// DecodeMath (kDp4aOneToken is right at M = 1 only: every lane's activations are token 0's).
// kTokGroups: token groups of kTokTiles tiles each (2 at M > 32 with 32 channels: eight tiles a
// warp spilled).
template <int kTokTiles, int kTokGroups, int kRowTiles, int kUnroll, DecodeMath kMath, int kMinCtas, bool kPreload,
          typename OutT>
__global__ void __launch_bounds__(kDecodeThreads, kMinCtas) w4a8_decode_kernel(const Params p) {
  static_assert(kMath != DecodeMath::kDp4aOneToken || kTokTiles * kTokGroups == 1, "the IDP.4A form takes one token");
  static_assert(kDecodeWarps % kTokGroups == 0, "token groups split the warps evenly");
  constexpr int kKWarps = kDecodeWarps / kTokGroups;  // warps along K in a token group
  constexpr int kRows = kRowTiles * 16;
  constexpr int kToks = kTokGroups * kTokTiles * 8;
  constexpr int kStride = kRows + 8;  // +8 ints: the 4 t-lanes' rows land 16 banks apart
  __shared__ int32_t tile[kToks * kStride];

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int k_warp = warp % kKWarps;
  const int tok0 = warp / kKWarps * kTokTiles * 8;  // the warp's token group
  const int M = p.M, N = p.N, K = p.K;
  const int num_row_tiles = N >> 4;
  const int chunks = K / kChunkK;
  const int groups = chunks >> p.group_shift;
  const int row_tile0 = blockIdx.x * kRowTiles;
  const int splits = gridDim.y;

  // The IDP.4A form scales two chunks of a group at once: its ranges start at even chunks.
  constexpr int kAlign = kMath == DecodeMath::kDp4aOneToken ? 2 : 1;
  const int per_split = ceil_div(chunks, splits * kAlign) * kAlign;
  const int split_lo = min(chunks, static_cast<int>(blockIdx.y) * per_split);
  const int split_hi = min(chunks, split_lo + per_split);
  const int per_warp = ceil_div(split_hi - split_lo, kKWarps * kAlign) * kAlign;
  const int c_lo = min(split_hi, split_lo + k_warp * per_warp);
  const int c_hi = min(split_hi, c_lo + per_warp);

  // Row tiles past N (last CTA) and tokens past M read valid duplicates instead of being
  // predicated: their accumulators are never stored.
  const uint8_t* wptr[kRowTiles];
  const uint32_t* pptr[kRowTiles];
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r) {
    const size_t rt = min(row_tile0 + r, num_row_tiles - 1);
    wptr[r] = p.qweight + (rt * chunks + c_lo) * kChunkBytes + lane * 16;
    pptr[r] = p.gparams + rt * groups * 8 + g;
  }
  // As a programmatic dependent (sm_90), the CTA got here while the previous grid
  // (quantize_act) may still run; nothing it writes is read or written before this wait.
  // (An L2 prefetch of the weight range before it cost 1-8 us: session 24, NOTES.md "PDL".)
  // The 3-CTA build with two token tiles and 32 channels preloads half a batch: the whole one
  // spilled at its 80 registers (NOTES.md "Decode preload").
  constexpr int kPre = kMinCtas == 3 && kTokTiles >= 2 && kRowTiles >= 2 ? kUnroll / 2 : kUnroll;
  uint4 wv0[kPreload ? kPre : 1][kRowTiles];
  uint32_t pv0[kPreload ? kPre : 1][kRowTiles];
  const bool preloaded = kPreload && c_lo + kPre <= c_hi;
  if constexpr (kPreload) {
    if (preloaded) load_weights<kPre>(wptr, pptr, c_lo, p.group_shift, wv0, pv0);
  }
  wait_prior_grids();
  // (Not before the wait: dependents then start only once every grid before this one is done.)
  if (p.trigger_dependents) allow_dependent_launch();

  const int8_t* xptr[kTokTiles];
#pragma unroll
  for (int tt = 0; tt < kTokTiles; ++tt) {
    const size_t tok = min(tok0 + tt * 8 + g, M - 1);
    xptr[tt] = p.xq + tok * K + static_cast<size_t>(c_lo) * kChunkK + t * 16;
  }

  int32_t acc[kRowTiles][kTokTiles][4];
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r)
#pragma unroll
    for (int tt = 0; tt < kTokTiles; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][tt][i] = 0;

  int32_t xsum[kTokTiles] = {};  // kU8Mma only
  int c = c_lo;
  if constexpr (kPreload) {
    if (preloaded) {
      decode_loaded_batch<kPre, kMath>(wv0, pv0, xptr, p.group_shift > 0, acc, xsum);
      c += kPre;
    }
  }
  for (; c + kUnroll <= c_hi; c += kUnroll)
    decode_batch<kUnroll, kMath>(wptr, pptr, xptr, c, p.group_shift, acc, xsum);
  if constexpr (kAlign == 2) {  // whole groups' pairs, then (group 64) single chunks
    for (; c + 2 <= c_hi; c += 2) decode_batch<2, kMath>(wptr, pptr, xptr, c, p.group_shift, acc, xsum);
  }
  for (; c < c_hi; ++c) decode_batch<1, kMath>(wptr, pptr, xptr, c, p.group_shift, acc, xsum);
  if constexpr (kMath == DecodeMath::kU8Mma) subtract_unsigned_offset(acc, xsum, t);
  if constexpr (kMath == DecodeMath::kDp4aOneToken) sum_one_token_slices(acc);

  // Intra-CTA split-K: warps add into a shared int32 tile [token][channel].
  for (int i = tid; i < kToks * kStride; i += kDecodeThreads) tile[i] = 0;
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRowTiles; ++r) {
#pragma unroll
    for (int tt = 0; tt < kTokTiles; ++tt) {
      const int ch = r * 16 + 2 * g;  // MMA rows g, g+8 are channels 2g, 2g+1
      const int tok = tok0 + tt * 8 + 2 * t;
      if (tok < M) {
        atomicAdd(&tile[tok * kStride + ch], acc[r][tt][0]);
        atomicAdd(&tile[tok * kStride + ch + 1], acc[r][tt][2]);
      }
      if (tok + 1 < M) {
        atomicAdd(&tile[(tok + 1) * kStride + ch], acc[r][tt][1]);
        atomicAdd(&tile[(tok + 1) * kStride + ch + 1], acc[r][tt][3]);
      }
    }
  }
  __syncthreads();

  constexpr int kPairs = kRows / 2;
  const int ch0 = row_tile0 * 16;
  for (int i = tid; i < kToks * kPairs; i += kDecodeThreads) {
    const int tok = i / kPairs, ch_l = (i % kPairs) * 2, ch = ch0 + ch_l;
    if (tok >= M || ch >= N) continue;
    const int32_t v0 = tile[tok * kStride + ch_l], v1 = tile[tok * kStride + ch_l + 1];
    if (splits == 1)
      write_pair<OutT>(p, tok, ch, v0, v1);
    else
      *workspace_at(p, blockIdx.y, tok, ch) = make_int2(v0, v1);
  }
  if (splits == 1) return;
  if (!arrive_last(p.counters + blockIdx.x, splits)) return;
  for (int i = tid; i < kToks * kPairs; i += kDecodeThreads) {
    const int tok = i / kPairs, ch = ch0 + (i % kPairs) * 2;
    if (tok >= M || ch >= N) continue;
    const int2 v = sum_splits(p, splits, tok, ch);
    write_pair<OutT>(p, tok, ch, v.x, v.y);
  }
}

// ---- tiled kernel (any M): cp.async multistage, weight and activations in shared memory ------
//
// CTA tile = (kWarpsCh * kRtW * 16) channels x (kWarpsTok * kTtW * 8) tokens; a stage is one
// 64-k chunk: the packed weight words are copied as is (1-D, lane-ordered, so LDS.128 with
// no bank conflicts and no swizzle), activations as [token][64 B] rows (a warp's B loads
// touch 8 tokens x 64 B = 4 conflict-free wavefronts), and the chunk's group words.
template <int kWarpsCh, int kWarpsTok, int kRtW, int kTtW, int kStages>
struct TiledShape {
  static constexpr int kThreads = kWarpsCh * kWarpsTok * 32;
  static constexpr int kCtaRowTiles = kWarpsCh * kRtW;
  static constexpr int kCtaToks = kWarpsTok * kTtW * 8;
  static constexpr int kStageW = kCtaRowTiles * kChunkBytes;
  static constexpr int kStageX = kCtaToks * kChunkK;
  static constexpr int kStageP = kCtaRowTiles * 32;
  static constexpr int kStageBytes = kStageW + kStageX + kStageP;
  static constexpr int kSmemBytes = kStages * kStageBytes;
};

template <int kWarpsCh, int kWarpsTok, int kRtW, int kTtW, int kStages, typename OutT>
__global__ void __launch_bounds__(kWarpsCh* kWarpsTok * 32, 2) w4a8_tiled_kernel(const Params p) {
  using S = TiledShape<kWarpsCh, kWarpsTok, kRtW, kTtW, kStages>;
  extern __shared__ __align__(16) uint8_t smem[];

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int warp_ch = warp % kWarpsCh, warp_tok = warp / kWarpsCh;
  const int M = p.M, N = p.N, K = p.K;
  const int num_row_tiles = N >> 4;
  const int chunks = K / kChunkK;
  const int groups = chunks >> p.group_shift;
  const int tok0 = blockIdx.x * S::kCtaToks;
  const int row_tile0 = blockIdx.y * S::kCtaRowTiles;
  const int splits = gridDim.z;

  const int per_split = ceil_div(chunks, splits);
  const int c_lo = min(chunks, static_cast<int>(blockIdx.z) * per_split);
  const int c_hi = min(chunks, c_lo + per_split);

  auto load_stage = [&](int buf, int c) {
    uint8_t* s_w = smem + buf * S::kStageBytes;
    uint8_t* s_x = s_w + S::kStageW;
    uint8_t* s_p = s_x + S::kStageX;
    for (int i = tid; i < S::kCtaRowTiles * 32; i += S::kThreads) {
      const int rt = row_tile0 + i / 32;
      const bool ok = rt < num_row_tiles;
      const uint8_t* src = p.qweight + (static_cast<size_t>(rt) * chunks + c) * kChunkBytes + (i % 32) * 16;
      cp_async16(smem_addr(s_w + i * 16), ok ? src : p.qweight, ok);
    }
    for (int i = tid; i < S::kCtaToks * 4; i += S::kThreads) {
      const int tok = tok0 + i / 4;
      const bool ok = tok < M;
      const int8_t* src = p.xq + static_cast<size_t>(tok) * K + c * kChunkK + (i % 4) * 16;
      cp_async16(smem_addr(s_x + i * 16), ok ? src : p.xq, ok);
    }
    for (int i = tid; i < S::kCtaRowTiles * 2; i += S::kThreads) {
      const int rt = row_tile0 + i / 2;
      const bool ok = rt < num_row_tiles;
      const uint32_t* src = p.gparams + (static_cast<size_t>(rt) * groups + (c >> p.group_shift)) * 8 + (i % 2) * 4;
      cp_async16(smem_addr(s_p + i * 16), ok ? src : p.gparams, ok);
    }
  };

  int32_t acc[kRtW][kTtW][4];
#pragma unroll
  for (int r = 0; r < kRtW; ++r)
#pragma unroll
    for (int tt = 0; tt < kTtW; ++tt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][tt][i] = 0;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (c_lo + s < c_hi) load_stage(s, c_lo + s);
    cp_async_commit();
  }

  int buf = 0;
  for (int c = c_lo; c < c_hi; ++c) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `buf` landed for all threads; stage buf-1 is free again
    {
      const int c_next = c + kStages - 1;
      int buf_next = buf + kStages - 1;
      if (buf_next >= kStages) buf_next -= kStages;
      if (c_next < c_hi) load_stage(buf_next, c_next);
      cp_async_commit();
    }
    const uint8_t* s_w = smem + buf * S::kStageBytes;
    const uint8_t* s_x = s_w + S::kStageW;
    const uint8_t* s_p = s_x + S::kStageX;
    uint32_t a[kRtW][2][4];
#pragma unroll
    for (int r = 0; r < kRtW; ++r) {
      const int rt_l = warp_ch * kRtW + r;
      const uint4 wv = *reinterpret_cast<const uint4*>(s_w + rt_l * kChunkBytes + lane * 16);
      const uint32_t pw = *reinterpret_cast<const uint32_t*>(s_p + rt_l * 32 + g * 4);
      dequant_chunk(wv, pw, a[r]);
    }
#pragma unroll
    for (int tt = 0; tt < kTtW; ++tt) {
      const int tok_l = (warp_tok * kTtW + tt) * 8 + g;
      const uint4 xv = *reinterpret_cast<const uint4*>(s_x + tok_l * kChunkK + t * 16);
#pragma unroll
      for (int r = 0; r < kRtW; ++r) mma_chunk(acc[r][tt], a[r], xv);
    }
    if (++buf == kStages) buf = 0;
  }
  cp_async_wait<0>();

  // Epilogue straight from the accumulators: c0/c2 (and c1/c3) are channels 2g, 2g+1.
#pragma unroll
  for (int r = 0; r < kRtW; ++r) {
    const int ch = (row_tile0 + warp_ch * kRtW + r) * 16 + 2 * g;
#pragma unroll
    for (int tt = 0; tt < kTtW; ++tt) {
      const int tok = tok0 + (warp_tok * kTtW + tt) * 8 + 2 * t;
      if (ch >= N) continue;
      if (splits == 1) {
        if (tok < M) write_pair<OutT>(p, tok, ch, acc[r][tt][0], acc[r][tt][2]);
        if (tok + 1 < M) write_pair<OutT>(p, tok + 1, ch, acc[r][tt][1], acc[r][tt][3]);
      } else {
        if (tok < M) *workspace_at(p, blockIdx.z, tok, ch) = make_int2(acc[r][tt][0], acc[r][tt][2]);
        if (tok + 1 < M) *workspace_at(p, blockIdx.z, tok + 1, ch) = make_int2(acc[r][tt][1], acc[r][tt][3]);
      }
    }
  }
  if (splits == 1) return;
  if (!arrive_last(p.counters + blockIdx.y * gridDim.x + blockIdx.x, splits)) return;
#pragma unroll
  for (int r = 0; r < kRtW; ++r) {
    const int ch = (row_tile0 + warp_ch * kRtW + r) * 16 + 2 * g;
#pragma unroll
    for (int tt = 0; tt < kTtW; ++tt) {
      const int tok = tok0 + (warp_tok * kTtW + tt) * 8 + 2 * t;
      if (ch >= N) continue;
      for (int d = 0; d < 2; ++d) {
        if (tok + d >= M) continue;
        const int2 v = sum_splits(p, splits, tok + d, ch);
        write_pair<OutT>(p, tok + d, ch, v.x, v.y);
      }
    }
  }
}

// ---- host side -----------------------------------------------------------------------------

// Tiled configurations: <warps along channels, warps along tokens, row tiles / warp, token tiles / warp, stages>.
using Tiled64 = TiledShape<4, 2, 2, 4, 4>;   // 128 ch x 64 tok, 33.8 KB smem
using Tiled128 = TiledShape<4, 2, 2, 8, 3>;  // 128 ch x 128 tok, 37.6 KB smem
static_assert(Tiled64::kSmemBytes <= 48 * 1024, "tiled-64 needs no opt-in shared memory");
static_assert(Tiled128::kSmemBytes <= 48 * 1024, "tiled-128 needs no opt-in shared memory");

constexpr int kDecodeMaxM = 64;  // M = 33-64: eight token tiles (16 channels), two groups of 3-4 (32)
// M = 33-64, 32 channels: the token tiles a group sums (3 to M = 48, 4 past it: the M <= 32 build's
// registers), and the K x tiles under which that kernel beat the wgmma plans (session 61's K sweep).
int decode_group_token_tiles(int M) { return M <= 48 ? 3 : 4; }
constexpr int kDecodeRows32MaxKTiles = 32768;

bool is_decode(W4A8Kernel k) { return k == W4A8Kernel::kDecodeRows16 || k == W4A8Kernel::kDecodeRows32; }

int ctas_per_split(W4A8Kernel k, int M, int N) {
  const int row_tiles = N / 16;
  switch (k) {
    case W4A8Kernel::kDecodeRows16: return row_tiles;
    case W4A8Kernel::kDecodeRows32: return ceil_div(row_tiles, 2);
    case W4A8Kernel::kTiledTok64:
      return ceil_div(M, Tiled64::kCtaToks) * ceil_div(row_tiles, Tiled64::kCtaRowTiles);
    default:
      return ceil_div(M, Tiled128::kCtaToks) * ceil_div(row_tiles, Tiled128::kCtaRowTiles);
  }
}

// Decode CTAs resident per SM, which registers decide: the 2-CTA build uses 70 registers for
// 16 channels and one token tile (3 fit), 91-128 otherwise; the 3-CTA build <= 80 (M <= 16).
int decode_ctas_resident(int M, W4A8Kernel k, int build_ctas) {
  const int tok_tiles = M <= 8 ? 1 : (M <= 16 ? 2 : (M <= 32 ? 4 : 8));
  if (build_ctas == 3 && tok_tiles <= 2) return 3;
  return tok_tiles == 1 && k == W4A8Kernel::kDecodeRows16 ? 3 : 2;
}

// Which decode kernel build to launch: its DecodeMath (decode_u8; decode_dp4a at M = 1),
// decode_preload, the plan's 3-CTA build.
struct DecodeBuild {
  DecodeMath math;
  bool preload, three_ctas;
};

template <int kTokTiles, int kTokGroups, int kRowTiles, int kUnroll, DecodeMath kMath, int kMinCtas, typename OutT>
cudaError_t launch_decode_math(const Params& p, dim3 grid, bool pdl, bool preload, cudaStream_t stream) {
  const dim3 block(kDecodeThreads);
  if constexpr (kTokTiles * kTokGroups > 4)  // decode_preload_max_m <= 32: no preload build past 32 tokens
    return launch_kernel<w4a8_decode_kernel<kTokTiles, kTokGroups, kRowTiles, kUnroll, kMath, kMinCtas, false, OutT>>(
        grid, block, 0, pdl, stream, p);
  else
    return preload
               ? launch_kernel<w4a8_decode_kernel<kTokTiles, kTokGroups, kRowTiles, kUnroll, kMath, kMinCtas, true, OutT>>(
                     grid, block, 0, pdl, stream, p)
               : launch_kernel<w4a8_decode_kernel<kTokTiles, kTokGroups, kRowTiles, kUnroll, kMath, kMinCtas, false, OutT>>(
                     grid, block, 0, pdl, stream, p);
}

// A decode kernel, as a programmatic dependent launch when pdl (sm_90 only: the caller checks).
template <int kTokTiles, int kTokGroups, int kRowTiles, int kUnroll, int kMinCtas, typename OutT>
cudaError_t launch_decode(const Params& p, dim3 grid, bool pdl, DecodeBuild b, cudaStream_t stream) {
  if constexpr (kTokTiles * kTokGroups == 1) {
    if (b.math == DecodeMath::kDp4aOneToken)
      return launch_decode_math<1, 1, kRowTiles, kUnroll, DecodeMath::kDp4aOneToken, kMinCtas, OutT>(
          p, grid, pdl, b.preload, stream);
  }
  if (b.math == DecodeMath::kU8Mma)
    return launch_decode_math<kTokTiles, kTokGroups, kRowTiles, kUnroll, DecodeMath::kU8Mma, kMinCtas, OutT>(
        p, grid, pdl, b.preload, stream);
  return launch_decode_math<kTokTiles, kTokGroups, kRowTiles, kUnroll, DecodeMath::kS8Mma, kMinCtas, OutT>(
      p, grid, pdl, b.preload, stream);
}

// Token tiles (a warp's, and its groups) x row tiles x unroll by M; three_ctas picks the
// 80-register build (M <= 16).
template <int kTokTiles, int kTokGroups, int kRowTiles, int kUnroll, typename OutT>
cudaError_t launch_decode_ctas(const Params& p, dim3 grid, bool pdl, DecodeBuild b, cudaStream_t stream) {
  if constexpr (kTokTiles * kTokGroups <= 2) {
    if (b.three_ctas) return launch_decode<kTokTiles, kTokGroups, kRowTiles, kUnroll, 3, OutT>(p, grid, pdl, b, stream);
  }
  return launch_decode<kTokTiles, kTokGroups, kRowTiles, kUnroll, 2, OutT>(p, grid, pdl, b, stream);
}

template <typename OutT>
cudaError_t launch_typed(const Params& p, const W4A8Plan& plan, bool pdl, DecodeBuild b, cudaStream_t stream) {
  const int row_tiles = p.N / 16;
  switch (plan.kernel) {
    case W4A8Kernel::kDecodeRows16:
    case W4A8Kernel::kDecodeRows32: {
      const bool two = plan.kernel == W4A8Kernel::kDecodeRows32;
      const dim3 grid(ceil_div(row_tiles, two ? 2 : 1), plan.splits);
      // Loads in flight per lane: unroll x (row tiles + token tiles); unroll shrinks as x grows.
      if (p.M <= 8)
        return two ? launch_decode_ctas<1, 1, 2, 4, OutT>(p, grid, pdl, b, stream)
                   : launch_decode_ctas<1, 1, 1, 4, OutT>(p, grid, pdl, b, stream);
      if (p.M <= 16)
        return two ? launch_decode_ctas<2, 1, 2, 4, OutT>(p, grid, pdl, b, stream)
                   : launch_decode_ctas<2, 1, 1, 4, OutT>(p, grid, pdl, b, stream);
      if (p.M <= 32)
        return two ? launch_decode_ctas<4, 1, 2, 2, OutT>(p, grid, pdl, b, stream)
                   : launch_decode_ctas<4, 1, 1, 2, OutT>(p, grid, pdl, b, stream);
      // M = 33-64. 32 channels: two token groups of 3 (M <= 48) or 4 token tiles, the M <= 32
      // build's registers (eight token tiles a warp spilled 80-120 bytes: session 58).
      if (two)
        return decode_group_token_tiles(p.M) == 3 ? launch_decode_ctas<3, 2, 2, 2, OutT>(p, grid, pdl, b, stream)
                                                   : launch_decode_ctas<4, 2, 2, 2, OutT>(p, grid, pdl, b, stream);
      return launch_decode_ctas<8, 1, 1, 1, OutT>(p, grid, pdl, b, stream);
    }
    case W4A8Kernel::kTiledTok64: {
      const dim3 grid(ceil_div(p.M, Tiled64::kCtaToks), ceil_div(row_tiles, Tiled64::kCtaRowTiles), plan.splits);
      w4a8_tiled_kernel<4, 2, 2, 4, 4, OutT><<<grid, Tiled64::kThreads, Tiled64::kSmemBytes, stream>>>(p);
      break;
    }
    default: {
      const dim3 grid(ceil_div(p.M, Tiled128::kCtaToks), ceil_div(row_tiles, Tiled128::kCtaRowTiles), plan.splits);
      w4a8_tiled_kernel<4, 2, 2, 8, 3, OutT><<<grid, Tiled128::kThreads, Tiled128::kSmemBytes, stream>>>(p);
      break;
    }
  }
  return cudaGetLastError();
}

}  // namespace

const char* w4a8_make_plan(int M, int N, int K, int group_size, int num_sms, int kernel, int splits,
                           int decode_ctas_per_sm, W4A8Plan* plan) {
  if (M <= 0 || N <= 0 || K <= 0) return "w4a8_gemm: M, N and K must be positive";
  if (N % 16) return "w4a8_gemm: N must be a multiple of 16";
  if (group_size < kChunkK || group_size % kChunkK || ((group_size / kChunkK) & (group_size / kChunkK - 1)))
    return "w4a8_gemm: group size must be 64 times a power of two (64, 128, ...)";
  if (K % group_size) return "w4a8_gemm: K must be a multiple of the group size";
  if (kernel < -1 || kernel > 3) return "w4a8_gemm: kernel must be -1 (auto) or 0..3";
  if (splits < 0)
    return "w4a8_gemm: splits = -1 (stream-K) and -2 (a cluster pair) run on the wgmma kernels (4..8) only";
  if (decode_ctas_per_sm != 0 && decode_ctas_per_sm != 2 && decode_ctas_per_sm != 3)
    return "w4a8_gemm: decode_ctas_per_sm must be 0 (choose), 2 or 3";
  const int chunks = K / kChunkK;
  W4A8Kernel k = static_cast<W4A8Kernel>(kernel);
  // (The tiled-64 kernel, auto at M = 33-64 before session 58, ran 1.03-4x slower than the decode
  // kernel there on every Llama row of the H200: forced only now.)
  if (k == W4A8Kernel::kAuto && M > kDecodeMaxM) k = W4A8Kernel::kTiledTok128;
  int build_ctas = 0;
  if (M <= kDecodeMaxM && (k == W4A8Kernel::kAuto || is_decode(k))) {
    // Fewest waves of resident CTAs, then the fullest last wave, then the 2-CTA build and 16
    // channels. The 3-CTA build covers M <= 16; above M = 8 (two token tiles, 120 registers cut
    // to 80: up to 28 % slower per CTA) it is chosen only when its grid fits one wave (a forced
    // build is taken as it is). Session 36's H200 rows: within 0.5 % of the measured best on
    // all 36 (csrc/gemm/NOTES.md "Decode occupancy"). decode_dp4a's IDP.4A form at M = 1 keeps
    // the rule: its 3-CTA build was the fastest on both multi-wave Llama rows (NOTES.md "Session 56").
    // At M = 33-64 it picked the faster of 16 and 32 channels on all 28 H200 rows of session 59.
    const int forced = decode_ctas_per_sm == 3 && M > 16 ? 2 : decode_ctas_per_sm;
    long long best_waves = 0, best_slots = 1;
    int best_ctas = 0;
    W4A8Kernel best_kernel = k;
    for (const int build : {2, 3}) {
      if ((forced != 0 && build != forced) || (build == 3 && M > 16)) continue;
      for (const W4A8Kernel cand : {W4A8Kernel::kDecodeRows16, W4A8Kernel::kDecodeRows32}) {
        if (k != W4A8Kernel::kAuto && cand != k) continue;
        const int ctas = ctas_per_split(cand, M, N);
        const long long slots = static_cast<long long>(decode_ctas_resident(M, cand, build)) * num_sms;
        const long long waves = (ctas + slots - 1) / slots;
        if (build == 3 && M > 8 && waves > 1 && forced == 0) continue;
        // fuller: ctas / (waves * slots) larger, compared without division
        const bool better = best_ctas == 0 || waves < best_waves ||
                            (waves == best_waves && static_cast<long long>(ctas) * best_waves * best_slots >
                                                        static_cast<long long>(best_ctas) * waves * slots);
        if (better) {
          best_waves = waves;
          best_slots = slots;
          best_ctas = ctas;
          best_kernel = cand;
          build_ctas = build;
        }
      }
    }
    k = best_kernel;
  }
  if (is_decode(k) && M > kDecodeMaxM) return "w4a8_gemm: the decode kernels (0, 1) need M <= 64";
  const int ctas = ctas_per_split(k, M, N);
  if (splits <= 0) {
    // Decode splits K only when its CTAs would leave over half the SMs idle: each split
    // cost 1.5-10 us on the H100 in every measured shape (decode sweep, NOTES.md). Tiled
    // fills >= 1 CTA per SM with >= 8 chunks per CTA.
    const int want = is_decode(k) ? ceil_div(num_sms, 2 * ctas) : ceil_div(num_sms, ctas);
    const int most = is_decode(k) ? chunks / (kDecodeWarps * 2) : chunks / 8;
    splits = want < most ? want : most;
    if (splits > 16) splits = 16;
    if (splits < 1) splits = 1;
  }
  if (splits > chunks) splits = chunks;
  if (static_cast<long long>(ctas) * splits > 0x7FFFFFFFLL || splits > 65535)
    return "w4a8_gemm: problem too large for the grid";
  plan->kernel = k;
  plan->splits = splits;
  plan->decode_ctas = build_ctas;
  plan->num_counters = ctas;
  plan->workspace_elems = splits > 1 ? static_cast<long long>(splits) * M * N : 0;
  return nullptr;
}

bool w4a8_auto_prefers_decode(int M, int N, int K, int num_sms) {
  if (M <= 32) return true;
  if (M > kDecodeMaxM) return false;
  // M = 33-64 (sessions 58-61, H200). Where the 16-channel grid is one wave the decode kernel beat
  // the wgmma plans timed (4096x4096: 8.8-9.8 us against 14.5-15.8) or tied them (14336x4096 at
  // M = 64). Where only the 32-channel grid is, a CTA's time grows with K x its token tiles while
  // the wgmma plans split K: it won to K = 10240 at 3 tiles (M <= 48) and to 8192 at 4 (0.77-1.02x
  // the wgmma plan's time; 8192x8192 at M = 40: 20.4 us against 24.4) and tied or lost past them
  // (0.99-1.21x; 28672x8192: 65-80 against 51-54). Where neither grid is one wave it lost (1.2-1.7x).
  const long long slots = static_cast<long long>(decode_ctas_resident(M, W4A8Kernel::kDecodeRows16, 2)) * num_sms;
  if (ctas_per_split(W4A8Kernel::kDecodeRows16, M, N) <= slots) return true;
  return static_cast<long long>(K) * decode_group_token_tiles(M) <= kDecodeRows32MaxKTiles &&
         ctas_per_split(W4A8Kernel::kDecodeRows32, M, N) <= slots;
}

cudaError_t w4a8_gemm_launch(const W4A8GemmArgs& a, const W4A8Plan& plan, cudaStream_t stream) {
  const Params p = w4a8_kernel_params(a);
  // The IDP.4A form sums one token only; at M > 1 decode_dp4a leaves the MMA forms.
  const DecodeMath math = a.decode_dp4a && a.M == 1 ? DecodeMath::kDp4aOneToken
                          : a.decode_u8              ? DecodeMath::kU8Mma
                                                     : DecodeMath::kS8Mma;
  const DecodeBuild b{math, a.decode_preload, plan.decode_ctas == 3};
  switch (a.out_kind) {
    case OutKind::kHalf: return launch_typed<__half>(p, plan, a.pdl, b, stream);
    case OutKind::kBFloat16: return launch_typed<__nv_bfloat16>(p, plan, a.pdl, b, stream);
    default: return launch_typed<float>(p, plan, a.pdl, b, stream);
  }
}

}  // namespace mixprec
