// KV4 paged decode attention on fp16 mma.sync (sm80 and sm90): the page part of a decode row,
// split across the sequence (flash-decoding), as the Triton page kernel computes it
// (vllm_mixprec/kernels/triton/attention.py, its reference and fallback).
//
// Why a CUDA kernel: the Triton loop spends 42 instructions per token and kv head (SASS,
// docs/ATTENTION.md) and reaches half of HBM bandwidth at batch 64. This one spends at most 25:
//  * Transposed tiles (BitDecoding's idea of putting the tokens on the wide side): scores are
//    S^T = K Q^T with 16 page tokens as the m16 side and the G <= 8 query heads as n8, so a
//    page is 8 mma for the scores and 8 for P V (O^T = V^T P^T), not 16 + 16 with G padded to 16.
//  * The nibbles go from registers straight into mma operands. Any consistent order of the
//    k index works, so each thread's 16 bytes of a K row (dims 32*tig..+31) become its A
//    fragments with a fixed permutation of the dims that the query fragments share; the V
//    operand pairs two tokens per register, which one byte permute (prmt) of two rows gives.
//    Codes become fp16 by OR-ing them into 1024.0's mantissa (lop3) and one packed subtract.
//  * The softmax's P moves from the score accumulators to the P V operand with two
//    movmatrix.trans per page (no shared memory), and each thread sums its own l and the V
//    zero-point term, reduced across the warp once at the end.
//  * Each warp walks its own pages (page w, w + W, ...) with the next page's loads in flight
//    in registers while it computes this one: no barrier in the loop. The W warps' states
//    merge through shared memory at the end.
// Scale and zero point are applied per token in fp32 on the accumulators, as the Triton kernel
// does: q . (c s + z) = s (q . c) + z sum(q), and sum_t p_t (c s_t + z_t) = (p s) . c + sum_t p_t z_t.
// Queries are fed as fp16 q / shift (shift a power of two keeping bf16 queries finite), and
// P s as fp16, like the Triton kernel.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/decode_kv4.h"
#include "common/device.h"

namespace mixprec {
namespace {

constexpr int kD = kDecodeKV4HeadDim;      // 128
constexpr int kB = kDecodeKV4BlockSize;    // 16 tokens per page
constexpr int kCodeBytes = kD / 2;         // 64 bytes of nibbles per token and plane
constexpr int kVPlane = kB * kCodeBytes;   // V codes follow the B rows of K codes
constexpr int kMetaPlane = 2 * kB * kCodeBytes;  // then k_scale, k_zero, v_scale, v_zero (fp16 x B)
constexpr int kSlabBytes = kMetaPlane + 4 * 2 * kB;  // 2176: one (block, kv head) page
constexpr int kWarps = 4;
constexpr float kNegInf = -__builtin_huge_valf();

// --- loads -----------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) {
  uint32_t r;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}

// One page's share of a thread (lane = 4 g + tig). Row r of the score tile S^T is token
// 2 r (r < 8) or 2 (r - 8) + 1, so that a thread's two rows g, g + 8 are the adjacent tokens
// 2 g, 2 g + 1, whose metadata come in one 32-bit load per plane. The P V step's k index then
// follows (movmatrix turns S^T row r into k = r): k = 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9
// are tokens 4 tig, 4 tig + 2, 4 tig + 1, 4 tig + 3.
//   k:    K rows of tokens 2 g, 2 g + 1: the thread's 16 bytes (dims 32 tig .. 32 tig + 31)
//   v:    V rows of tokens 4 tig, 4 tig + 2 (pair 0) and 4 tig + 1, 4 tig + 3 (pair 1): 8 bytes
//         each, dims 16 g .. 16 g + 15
//   meta: k_scale, k_zero, v_scale, v_zero of tokens 2 g, 2 g + 1 (fp16 pairs)
struct PageRegs {
  uint4 k[2];
  uint2 v[4];
  uint32_t meta[4];
};

__device__ __forceinline__ void load_page(PageRegs& r, const uint8_t* slab, int g, int tig) {
  r.k[0] = ldg_stream_v4(slab + (2 * g) * kCodeBytes + 16 * tig);
  r.k[1] = ldg_stream_v4(slab + (2 * g + 1) * kCodeBytes + 16 * tig);
  const uint8_t* v = slab + kVPlane + 8 * g + (4 * tig) * kCodeBytes;
  r.v[0] = ldg_stream_v2(v);
  r.v[1] = ldg_stream_v2(v + 2 * kCodeBytes);
  r.v[2] = ldg_stream_v2(v + kCodeBytes);
  r.v[3] = ldg_stream_v2(v + 3 * kCodeBytes);
  const uint8_t* m = slab + kMetaPlane + 4 * g;
#pragma unroll
  for (int plane = 0; plane < 4; ++plane) r.meta[plane] = ld_u32(m + 2 * kB * plane);
}

// --- math helpers ------------------------------------------------------------------------------

__device__ __forceinline__ float2 f16x2_to_float2(uint32_t h) {
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t x, uint32_t mask, uint32_t bits) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));  // (x & mask) | bits
  return r;
}

__device__ __forceinline__ uint32_t sub_f16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint32_t fma_f16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// 8 nibbles n0..n7 of x (n0 lowest) -> fp16 pairs (n_r, n_{r+4}), r = 0..3 (low half first).
// 1024 + n is exact in fp16 (0x6400 | n); the high nibble of a byte comes out as 1024 + 16 n
// and is scaled back with one fma.
__device__ __forceinline__ void nibbles_to_f16x2(uint32_t x, uint32_t (&h)[4]) {
  constexpr uint32_t kMagic = 0x64006400u;    // 1024.0 twice
  constexpr uint32_t kOneSixteenth = 0x2c002c00u;
  constexpr uint32_t kMinus64 = 0xd400d400u;
  const uint32_t y = x >> 8;
  h[0] = sub_f16x2(lop3_and_or(x, 0x000f000fu, kMagic), kMagic);
  h[1] = fma_f16x2(lop3_and_or(x, 0x00f000f0u, kMagic), kOneSixteenth, kMinus64);
  h[2] = sub_f16x2(lop3_and_or(y, 0x000f000fu, kMagic), kMagic);
  h[3] = fma_f16x2(lop3_and_or(y, 0x00f000f0u, kMagic), kOneSixteenth, kMinus64);
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                          uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = 0
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// Reduces over the 8 lanes of equal tig (the score tile's 8 row groups): lane bits 2..4.
template <typename Op>
__device__ __forceinline__ float reduce_over_groups(float v, Op op) {
#pragma unroll
  for (int mask = 4; mask <= 16; mask <<= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}
__device__ __forceinline__ float warp_max_over_groups(float v) {
  return reduce_over_groups(v, [](float a, float b) { return fmaxf(a, b); });
}
__device__ __forceinline__ float warp_sum_over_groups(float v) {
  return reduce_over_groups(v, [](float a, float b) { return a + b; });
}

// --- the kernel ---------------------------------------------------------------------------------

// The online-softmax state of one warp: thread (g, tig) holds heads h0 = 2 tig and h1 = 2 tig + 1.
struct WarpState {
  float m[2];       // running max (base-2 scaled scores), equal across the warp's groups
  float l[2];       // this thread's share of sum p
  float z[2];       // this thread's share of sum p * v_zero
  float o[8][4];    // O^T accumulators: m-tile j, (dim 16 g + 2 j, h0), (.., h1), (16 g + 2 j + 1, h0), (.., h1)
};

// Attends one page (16 tokens, `valid` of them real) into the warp's state.
__device__ __forceinline__ void attend_page(WarpState& st, const PageRegs& r, const uint32_t (&qf)[16],
                                            const float (&head_scale)[2], const float (&head_zero)[2],
                                            int valid, int g) {
  // scores S^T[token][head]: A = K codes (rows g, g + 8: tokens 2 g, 2 g + 1), B = q fragments
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t kw0[4] = {r.k[0].x, r.k[0].y, r.k[0].z, r.k[0].w};
  const uint32_t kw1[4] = {r.k[1].x, r.k[1].y, r.k[1].z, r.k[1].w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t a[4], b[4];
    nibbles_to_f16x2(kw0[w], a);
    nibbles_to_f16x2(kw1[w], b);
    mma_16816(s, a[0], b[0], a[1], b[1], qf[4 * w], qf[4 * w + 1]);
    mma_16816(s, a[2], b[2], a[3], b[3], qf[4 * w + 2], qf[4 * w + 3]);
  }
  const float2 ks2 = f16x2_to_float2(r.meta[0]), kz2 = f16x2_to_float2(r.meta[1]);
  const float2 vs2 = f16x2_to_float2(r.meta[2]), vz2 = f16x2_to_float2(r.meta[3]);
  const float ks[2] = {ks2.x, ks2.y}, kz[2] = {kz2.x, kz2.y};
  float vs[2] = {vs2.x, vs2.y}, vz[2] = {vz2.x, vz2.y};
  // s[2 i + c]: token 2 g + i, head h_c
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int c = 0; c < 2; ++c)
      s[2 * i + c] = fmaf(s[2 * i + c] * ks[i], head_scale[c], kz[i] * head_zero[c]);
  }
  if (valid < kB) {  // the row's last page: positions past its end are not attended
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (2 * g + i >= valid) {
        s[2 * i] = s[2 * i + 1] = kNegInf;
        vs[i] = vz[i] = 0.f;  // (their metadata may be garbage; p = 0 must stay 0)
      }
    }
  }
  float p[4];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const float m_new = fmaxf(st.m[c], warp_max_over_groups(fmaxf(s[c], s[2 + c])));
    const float m_safe = m_new == kNegInf ? 0.f : m_new;
    const float alpha = fast_exp2(st.m[c] - m_safe);
    p[c] = fast_exp2(s[c] - m_safe);
    p[2 + c] = fast_exp2(s[2 + c] - m_safe);
    st.l[c] = fmaf(st.l[c], alpha, p[c] + p[2 + c]);
    st.z[c] = fmaf(st.z[c], alpha, fmaf(p[c], vz[0], p[2 + c] * vz[1]));
    st.m[c] = m_new;
    if (__any_sync(0xffffffffu, alpha != 1.f)) {  // the max moved (rarely after the first pages)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        st.o[j][c] *= alpha;
        st.o[j][2 + c] *= alpha;
      }
    }
  }
  // P s as the B operand of O^T = V^T P^T: rows of tokens -> rows of heads
  const uint32_t pb0 = transpose_8x8(pack_f16x2(p[0] * vs[0], p[1] * vs[0]));
  const uint32_t pb1 = transpose_8x8(pack_f16x2(p[2] * vs[1], p[3] * vs[1]));
  // V codes: k = (2 tig, 2 tig + 1) and (2 tig + 8, 2 tig + 9) paired per register (PageRegs)
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const uint32_t w0 = u ? r.v[0].y : r.v[0].x, w1 = u ? r.v[1].y : r.v[1].x;
    const uint32_t w2 = u ? r.v[2].y : r.v[2].x, w3 = u ? r.v[3].y : r.v[3].x;
    uint32_t lo0[4], hi0[4], lo1[4], hi1[4];  // [r]: local dim 8 u + r (lo) / 8 u + 4 + r (hi)
    nibbles_to_f16x2(__byte_perm(w0, w1, 0x5410), lo0);
    nibbles_to_f16x2(__byte_perm(w0, w1, 0x7632), hi0);
    nibbles_to_f16x2(__byte_perm(w2, w3, 0x5410), lo1);
    nibbles_to_f16x2(__byte_perm(w2, w3, 0x7632), hi1);
    // m-tile j takes local dims 2 j (row g) and 2 j + 1 (row g + 8): j = 4 u + {0, 1, 2, 3}
    mma_16816(st.o[4 * u + 0], lo0[0], lo0[1], lo1[0], lo1[1], pb0, pb1);
    mma_16816(st.o[4 * u + 1], lo0[2], lo0[3], lo1[2], lo1[3], pb0, pb1);
    mma_16816(st.o[4 * u + 2], hi0[0], hi0[1], hi1[0], hi1[1], pb0, pb1);
    mma_16816(st.o[4 * u + 3], hi0[2], hi0[3], hi1[2], hi1[3], pb0, pb1);
  }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 4) decode_kv4_pages_kernel(const DecodeKV4Args a) {
  const int row = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int q_start = a.query_start_loc[row];
  if (a.query_start_loc[row + 1] - q_start != 1) return;  // not a decode row
  const int seq_len = a.seq_lens[row];
  // The split's pages, partitioned exactly as _decode_tiles (Triton) does.
  const int win = a.res_tokens > 0 ? max(seq_len - a.res_tokens, 0) : seq_len;
  const int n_tiles = ceil_div(win, a.tile_tokens);
  const int per_split = max(ceil_div(n_tiles, a.num_splits), a.min_tiles);
  const int writers = ceil_div(n_tiles, per_split);
  if (a.num_splits > 1 && split >= writers) return;  // past the row's tiles: no partial
  const int t0 = split * per_split;
  const int tok_end = min(min(t0 + per_split, n_tiles) * a.tile_tokens, win);
  const int page_begin = t0 * a.tile_tokens / kB;
  const int page_end = ceil_div(tok_end, kB);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, tig = lane & 3;
  const int group = a.num_q_heads / a.num_kv_heads;

  // Query fragments: thread (g, tig) loads head g's dims 32 tig .. 32 tig + 31.
  float qv[32];
  {
    const T* qp = static_cast<const T*>(a.q) + static_cast<int64_t>(q_start) * a.q_stride_t +
                  static_cast<int64_t>(kvh * group + g) * a.q_stride_h + 32 * tig;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (g < group) raw = *reinterpret_cast<const uint4*>(qp + 8 * v);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) qv[8 * v + i] = to_float(e[i]);
    }
    if (a.k_smooth != nullptr) {  // the pages hold K / smooth; round q * smooth to the model dtype
      const float* sp = a.k_smooth + kvh * kD + 32 * tig;
#pragma unroll
      for (int i = 0; i < 32; ++i) qv[i] = to_float(from_float<T>(qv[i] * sp[i]));
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(qv[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float shift = exp2f(fmaxf(ceilf(log2f(amax)) - 14.f, 0.f));  // fp16 range for bf16 q
  uint32_t qf[16];  // qf[4 w + r] = dims (8 w + r, 8 w + r + 4) of the thread's 32, as nibbles_to_f16x2 orders K
  float qsum = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const __half lo = __float2half_rn(qv[8 * w + r] / shift);
      const __half hi = __float2half_rn(qv[8 * w + r + 4] / shift);
      qsum += __half2float(lo) + __half2float(hi);
      __half2 h = __halves2half2(lo, hi);
      qf[4 * w + r] = *reinterpret_cast<uint32_t*>(&h);
    }
  }
  qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
  qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);
  qsum *= shift;
  // Per-head score constants for the accumulator's heads h0 = 2 tig, h1 = 2 tig + 1 (lane 4 h holds head h).
  float head_scale[2], head_zero[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    head_scale[c] = __shfl_sync(0xffffffffu, shift, 4 * (2 * tig + c)) * a.qk_scale;
    head_zero[c] = __shfl_sync(0xffffffffu, qsum, 4 * (2 * tig + c)) * a.qk_scale;
  }

  WarpState st;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    st.m[c] = kNegInf;
    st.l[c] = st.z[c] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[j][e] = 0.f;

  // This warp's pages: page_begin + warp + i * kWarps, i < n_local. Two register buffers: page
  // i + 1's loads are in flight while page i is computed. Block ids come 32 pages at a time,
  // one per lane, the next 32 requested as the current ones come into use.
  const int32_t* bt = a.block_table + static_cast<int64_t>(row) * a.block_table_stride + page_begin + warp;
  const uint8_t* head_base = a.cache + static_cast<int64_t>(kvh) * a.stride_head;
  const int n_local = page_end - page_begin > warp ? ceil_div(page_end - page_begin - warp, kWarps) : 0;
  auto block_ids = [&](int chunk) {
    const int i = 32 * chunk + lane;
    return i < n_local ? bt[static_cast<int64_t>(i) * kWarps] : 0;
  };
  int chunk = 0, ids = block_ids(0), ids_next = block_ids(1);
  auto slab_at = [&](int i) {  // i in chunk or chunk + 1
    const int a0 = __shfl_sync(0xffffffffu, ids, i & 31), a1 = __shfl_sync(0xffffffffu, ids_next, i & 31);
    return head_base + static_cast<int64_t>((i >> 5) == chunk ? a0 : a1) * a.stride_block;
  };
  auto slab_of = [&](int i) {  // called for i = 0, 1, 2, ... in order
    if ((i >> 5) != chunk) {
      chunk = i >> 5;
      ids = ids_next;
      ids_next = block_ids(chunk + 1);
    }
    return slab_at(i);
  };
  // Page i + prefetch's slab is asked into L2 while page i is computed, so that its register
  // loads (issued one page ahead) wait on L2 rather than on HBM: 17 lanes, one 128-byte line each.
  const int prefetch = a.prefetch_pages;
  auto prefetch_l2 = [&](int i) {
    if (prefetch > 0 && i + prefetch < n_local) {  // (warp-uniform: slab_at shuffles)
      const uint8_t* p = slab_at(i + prefetch) + lane * 128;
      if (lane * 128 < kSlabBytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
    }
  };
  auto valid_tokens = [&](int i) { return min(tok_end - (page_begin + warp + i * kWarps) * kB, kB); };
  PageRegs buf[2];
  if (n_local > 0) load_page(buf[0], slab_of(0), g, tig);
#pragma unroll 1
  for (int i = 0; i < n_local; i += 2) {
    if (i + 1 < n_local) load_page(buf[1], slab_of(i + 1), g, tig);
    prefetch_l2(i);
    attend_page(st, buf[0], qf, head_scale, head_zero, valid_tokens(i), g);
    if (i + 1 >= n_local) break;
    if (i + 2 < n_local) load_page(buf[0], slab_of(i + 2), g, tig);
    prefetch_l2(i + 1);
    attend_page(st, buf[1], qf, head_scale, head_zero, valid_tokens(i + 1), g);
  }

  // Merge the warps (log-sum-exp) through shared memory, then normalise and store.
  __shared__ float sm_m[kWarps][kDecodeKV4MaxGroup], sm_l[kWarps][kDecodeKV4MaxGroup],
      sm_z[kWarps][kDecodeKV4MaxGroup];
  __shared__ __align__(16) float sm_o[kWarps][kDecodeKV4MaxGroup][kD];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    st.l[c] = warp_sum_over_groups(st.l[c]);
    st.z[c] = warp_sum_over_groups(st.z[c]);
  }
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      sm_m[warp][2 * tig + c] = st.m[c];
      sm_l[warp][2 * tig + c] = st.l[c];
      sm_z[warp][2 * tig + c] = st.z[c];
    }
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int h = 2 * tig + c;
    if (h >= group) continue;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][h]);
    const float f = exp2f(st.m[c] - (mx == kNegInf ? 0.f : mx));
#pragma unroll
    for (int j = 0; j < 8; ++j)
      *reinterpret_cast<float2*>(&sm_o[warp][h][16 * g + 2 * j]) = make_float2(st.o[j][c] * f, st.o[j][2 + c] * f);
  }
  __syncthreads();
  const bool partial = a.part_o != nullptr;
  const int64_t part_row = (static_cast<int64_t>(row) * a.slots + split) * a.num_q_heads + kvh * group;
  for (int idx = 4 * threadIdx.x; idx < group * kD; idx += 4 * 32 * kWarps) {
    const int h = idx / kD, d = idx % kD;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][h]);
    const float m_safe = mx == kNegInf ? 0.f : mx;
    float l = 0.f, z = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = exp2f(sm_m[w][h] - m_safe);
      l = fmaf(sm_l[w][h], f, l);
      z = fmaf(sm_z[w][h], f, z);
      const float4 ow = *reinterpret_cast<const float4*>(&sm_o[w][h][d]);
      o.x += ow.x;
      o.y += ow.y;
      o.z += ow.z;
      o.w += ow.w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float4 res = make_float4((o.x + z) * inv, (o.y + z) * inv, (o.z + z) * inv, (o.w + z) * inv);
    if (partial) {
      *reinterpret_cast<float4*>(a.part_o + (part_row + h) * kD + d) = res;
      if (d == 0) a.part_lse[part_row + h] = l > 0.f ? mx + log2f(l) : kNegInf;
    } else {
      T* dst = static_cast<T*>(a.out) + static_cast<int64_t>(q_start) * a.out_stride_t +
               static_cast<int64_t>(kvh * group + h) * a.out_stride_h + d;
      T v[4] = {from_float<T>(res.x), from_float<T>(res.y), from_float<T>(res.z), from_float<T>(res.w)};
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(v);
    }
  }
}

}  // namespace

cudaError_t decode_kv4_pages_launch(const DecodeKV4Args& a, cudaStream_t stream) {
  if (a.num_rows == 0) return cudaSuccess;
  const dim3 grid(a.num_rows, a.num_kv_heads, a.num_splits);
  if (a.bf16)
    decode_kv4_pages_kernel<__nv_bfloat16><<<grid, kWarps * 32, 0, stream>>>(a);
  else
    decode_kv4_pages_kernel<__half><<<grid, kWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace mixprec
