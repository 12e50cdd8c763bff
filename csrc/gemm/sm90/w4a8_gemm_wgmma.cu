// W4A8 GEMM on Hopper wgmma (sm_90a only): y[m, n] = xs[m] * cs[n] * sum_k xq[m, k] * w8[n, k] (+ bias[n]).
//
// LiquidGEMM-style: Y^T = W X^T with the dequantised weight as the register-sourced A operand of
// wgmma.m64nNk32.s32.s8.s8 (64 channels x 32 k) and the activation tile as B in shared memory.
// The per-warp A fragment of wgmma (warp w of the warpgroup owns rows 16w..16w+15) is the
// mma.m16n8k32 A fragment (PTX ISA register fragments; CuTe's ALayout_64x32), so the packed
// weights of kernels/cuda.py:repack_w4a8 and the 7-instruction LiquidQuant dequant carry over
// unchanged. The accumulator layout is the m16n8 one repeated every 8 tokens, so the epilogue
// again stores channel pairs (2g, 2g+1) from registers d[4j] / d[4j+2].
//
// What changes is B: wgmma reads B from shared memory in *logical* k order, and the packing's
// k permutation (lane t's two k32 steps hold actual k 16t..16t+15 of each 64-k chunk) makes
// logical 4-byte unit 4j + t hold actual unit 4t + j: a 4x4 transpose of 4-byte units per
// 64 bytes of a token row. The producer warpgroup applies it with 4-byte cp.async (no register
// staging, coalesced 128-byte warp reads, conflict-free swizzled writes), or, when the quantizer
// wrote x in that logical order already (W4A8GemmArgs::x_wgmma_order, formats.py
// wgmma_act_k_order), one 2-D TMA a stage copies it as it is (10-18 % faster at M >= 256, H200,
// csrc/gemm/NOTES.md "Session 63").
//
// CTA = 1 producer warpgroup (cp.async, plus one TMA a stage for the weights except in kernel
// 7, into a kStages ring, mbarrier full/empty per stage) + 2 consumer warpgroups (kBlocks x
// 64 channels x kTok tokens each; setmaxnreg moves the producer's registers to them). A stage
// is 128 k: x as kTok rows of 128 bytes in the 128-byte-swizzle K-major layout (one descriptor
// per k32 step), the packed weight words of the CTA's row tiles copied as is (conflict-free
// LDS.128, as in the mma.sync tiled kernel), and the group words. Consumers software-pipeline
// per 64-k chunk with two A register buffers: dequant chunk c+1 while the wgmmas of chunk c
// run. int32 accumulation over all K (or the CTA's K split), epilogue in fp32 as in the
// mma.sync kernels. K splits sum through global partials (split-K, stream-K) or, for a cluster
// pair (splits = -2), through the two CTAs' shared memory. Launched as a programmatic dependent
// (W4A8GemmArgs::pdl): the first stages' weight copies start before griddepcontrol.wait.
// See csrc/gemm/NOTES.md ("sm90 wgmma kernel", "PDL", "Stream-K", "Session 47", "Session 48").

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda.h>  // CUtensorMap (the weights' TMA descriptor)
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>  // integral_constant: the cluster pair's static register indices

#include "common/device.h"
#include "common/launch.h"
#include "common/ptx.h"  // cp.async, mbarriers, griddepcontrol, proxy fences
#include "gemm/w4a8_gemm.h"
#include "gemm/w4a8_packed.cuh"  // dequant_chunk, store2 (shared with the mma.sync kernels)

// The kernel bodies exist only in the sm_90a pass; every other pass (sm_80, plain sm_90)
// compiles empty stubs so the extension still builds and links for all targets.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MIXPREC_WGMMA_DEVICE 1
#endif

namespace mixprec {
namespace {

constexpr int kStageK = 128;        // k per pipeline stage = one 128-byte swizzle row of x
constexpr int kThreads = 384;       // producer warpgroup + 2 consumer warpgroups

struct WParams : W4A8KernelParams {
  int tok_tiles, ch_tiles;
  int sk_ctas;      // stream-K: CTAs sharing the tiles x stages units (0: tiles x splits grid)
  int sk_dp_tiles;  // stream-K: the first tiles, run data-parallel (a multiple of sk_ctas)
  int pair;         // 1: two K halves per tile in a cluster of 2 CTAs, summed in shared memory
  int pair_dp_tiles;  // pair: the first tiles, run whole (one a CTA, two a cluster); even
};

// The weight words by TMA (one box a stage, thread 0) or by cp.async (16 B a thread, 64 a row
// tile): TMA was 2.5-5 % faster for kernels 4, 5 and 8 and 2.4-3 % slower for kernel 7, the
// 128 x 64 tile (H200, csrc/gemm/NOTES.md "Weights by TMA"). The host encodes a tensor map only
// for the kernels that take one.
__host__ __device__ constexpr bool weights_by_tma(int blocks, int tok) { return !(blocks == 1 && tok == 64); }

// 16-channel row tiles of a CTA: 2 consumer warpgroups x `blocks` m64 blocks x 4 warps.
__host__ __device__ constexpr int row_tiles_of(int blocks) { return 2 * blocks * 4; }

// kBlocks m64 blocks per consumer warpgroup, kTok tokens (= wgmma N), kStages ring slots.
template <int kBlocks, int kTok, int kStages>
struct WgShape {
  static constexpr int kRowTiles = row_tiles_of(kBlocks);    // 16-channel tiles per CTA
  static constexpr int kXBytes = kTok * kStageK;             // multiple of 1024: swizzle atoms stay aligned
  static constexpr int kWBytes = kRowTiles * 2 * kChunkBytes;
  static constexpr int kPBytes = kRowTiles * 2 * 32;
  static constexpr int kStageBytes = kXBytes + kWBytes + kPBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + slack to align the ring to 1024 B
  static constexpr int kAcc = kTok / 2;                      // s32 accumulators per thread per block
  static_assert(kTok == 64 || kTok == 128 || kTok == 256, "wgmma N");
  static_assert(kBlocks * kAcc <= 128, "accumulators must fit the consumer register budget");
  static_assert(kXBytes % 1024 == 0, "swizzle atom alignment");
};

#ifdef MIXPREC_WGMMA_DEVICE

constexpr int kConsumers = 256;
constexpr int kProducerRegs = 56;   // 56 + 2 * 224 = 3 * 168 (the cap of __launch_bounds__(384, 1))
constexpr int kConsumerRegs = 224;
// Copy address chains per producer thread: an LDGSTS reads its address register late (long
// scoreboard), so bumping one pointer in place after every copy stalled each next copy on the
// last (13-17 % slower GEMMs, csrc/gemm/NOTES.md "Stream-K"); round-robin over 4 pointers.
constexpr int kCopyChains = 4;
constexpr int kRasterGroup = 8;     // token tiles swept together across all channel tiles (L2 reuse)

// ---- PTX wrappers ----------------------------------------------------------------------------

// (The generic ones are in common/ptx.h. wgmma reads B through the async proxy, so cp.async
// writes are fenced with fence_proxy_async before it.)

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Pins register values in program order around wgmma issue/wait (no code motion across).
template <int kN>
__device__ __forceinline__ void fence_regs(int32_t (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The expected bytes of the current phase of a full barrier, before its TMA is issued.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// 2-D TMA load of one box at (x, y) of `map` (a __grid_constant__ parameter), completing on bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// Every thread of both CTAs of a cluster; release/acquire orders the shared::cluster stores.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ void named_barrier_consumers() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumers) : "memory");
}

// Shared-memory matrix descriptor for B: K-major, 128-byte swizzle, 8-row atoms 1024 B apart
// (SBO), LBO unused for swizzled K-major (set to 1 by convention), base offset 0 (atoms are
// 1024-B aligned). Bits: 0-13 addr >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 62-63 swizzle (1 = 128 B).
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t saddr) {
  const uint32_t lo = ((saddr >> 4) & 0x3FFFu) | (1u << 16);
  const uint32_t hi = (1024u >> 4) | (1u << 30);
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// wgmma.mma_async m64nNk32: D = A x B + (accumulate ? D : 0), s32 <- s8 (A: 4 registers) x s8
// (B: descriptor). accumulate = 0 starts a tile without zeroing D first: ptxas serialises the
// wgmmas of a loop whose accumulators other instructions write (C7515).
template <int N>
struct WgmmaRS;

template <>
struct WgmmaRS<64> {
  static __device__ __forceinline__ void run(int32_t (&d)[32], const uint32_t (&a)[4], uint64_t desc,
                                             int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),
          "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]),
          "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]),
          "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

template <>
struct WgmmaRS<128> {
  static __device__ __forceinline__ void run(int32_t (&d)[64], const uint32_t (&a)[4], uint64_t desc,
                                             int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),
          "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]),
          "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]),
          "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]),
          "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]),
          "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]),
          "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]),
          "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

template <>
struct WgmmaRS<256> {
  static __device__ __forceinline__ void run(int32_t (&d)[128], const uint32_t (&a)[4], uint64_t desc,
                                             int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
        "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, "
        "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, "
        "%114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, {%128, %129, %130, %131}, %132, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),
          "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]),
          "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]),
          "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]),
          "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]),
          "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]),
          "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]),
          "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]),
          "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]),
          "+r"(d[71]), "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]),
          "+r"(d[78]), "+r"(d[79]), "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]),
          "+r"(d[85]), "+r"(d[86]), "+r"(d[87]), "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]),
          "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]), "+r"(d[96]), "+r"(d[97]), "+r"(d[98]),
          "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]), "+r"(d[104]), "+r"(d[105]),
          "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]), "+r"(d[112]),
          "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]),
          "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]),
          "+r"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

// ---- epilogue --------------------------------------------------------------------------------

// Per-channel-pair epilogue constants (loaded once per tile).
struct ChanPair {
  float cs0, cs1, b0, b1;
};

template <typename OutT>
__device__ __forceinline__ ChanPair load_chan_pair(const WParams& p, int ch) {
  ChanPair c;
  const float2 cs = *reinterpret_cast<const float2*>(p.channel_scale + ch);
  c.cs0 = cs.x;
  c.cs1 = cs.y;
  c.b0 = 0.f;
  c.b1 = 0.f;
  if (p.bias_kind == static_cast<int>(BiasKind::kFloat)) {
    const float* b = static_cast<const float*>(p.bias);
    c.b0 = b[ch];
    c.b1 = b[ch + 1];
  } else if (p.bias_kind == static_cast<int>(BiasKind::kSameAsOut)) {
    const OutT* b = static_cast<const OutT*>(p.bias);
    c.b0 = to_float(b[ch]);
    c.b1 = to_float(b[ch + 1]);
  }
  return c;
}

// Same float operations, in the same order, as the mma.sync kernels' write_pair.
template <typename OutT>
__device__ __forceinline__ void write_pair(const WParams& p, const ChanPair& c, float xs, int tok, int ch,
                                           int32_t v0, int32_t v1) {
  float y0 = static_cast<float>(v0) * xs * c.cs0;
  float y1 = static_cast<float>(v1) * xs * c.cs1;
  if (p.bias_kind != static_cast<int>(BiasKind::kNone)) {
    y0 += c.b0;
    y1 += c.b1;
  }
  store2(static_cast<OutT*>(p.out) + static_cast<size_t>(tok) * p.N + ch, y0, y1);
}

__device__ __forceinline__ int2* workspace_at(const WParams& p, int split, int tok, int ch) {
  return reinterpret_cast<int2*>(p.workspace + (static_cast<size_t>(split) * p.M + tok) * p.N + ch);
}

#endif  // MIXPREC_WGMMA_DEVICE

// ---- the kernel ------------------------------------------------------------------------------

// A CTA's work is a run of (tile, K-stage) units, taken in segments of one tile each. Classic
// launches (gridDim = tiles x splits) run one segment: tile blockIdx.x, split blockIdx.y. Stream-K
// launches (p.sk_ctas > 0, gridDim.x = sk_ctas) are hybrid: CTA c first runs the whole tiles
// c, c + sk_ctas, ... below p.sk_dp_tiles (data-parallel waves, in the classic raster order, so
// their loads share the L2 as a classic wave's do), then the remaining tiles x stages units are
// split evenly over the CTAs, so the last partial wave of a classic launch disappears; a tile
// cut between CTAs is summed by the CTA holding its first stages, which reaches it last.
// Cluster pair launches (p.pair, 1-D, clusters of 2) run whole tiles first (p.pair_dp_tiles,
// one a CTA), then one K half of a tile a CTA.
// Python mirror: tests/kernels/test_cuda_gemm_wgmma.py, _stream_k_segments.
// Units are ints (the planner refuses problems of 2^31 units or more); products are 64-bit.
// (maybe_unused: the sm_80 pass compiles no kernel body that calls them.)
[[maybe_unused]] __host__ __device__ __forceinline__ int sk_range_begin(int cta, int units, int ctas) {
  return static_cast<int>(static_cast<long long>(cta) * units / ctas);
}
// The CTA whose range holds unit u (ranges are [begin(c), begin(c + 1))).
[[maybe_unused]] __host__ __device__ __forceinline__ int sk_owner(int u, int units, int ctas) {
  return static_cast<int>((static_cast<long long>(u + 1) * ctas + units - 1) / units) - 1;
}

// kXTma: x arrives in the wgmma k order (W4A8GemmArgs::x_wgmma_order) and goes by TMA.
template <int kBlocks, int kTok, int kStages, bool kXTma, typename OutT>
__global__ void __launch_bounds__(kThreads, 1) w4a8_wgmma_kernel(const WParams p,
                                                                 const __grid_constant__ CUtensorMap w_map,
                                                                 const __grid_constant__ CUtensorMap x_map) {
#ifdef MIXPREC_WGMMA_DEVICE
  using S = WgShape<kBlocks, kTok, kStages>;
  constexpr bool kTmaWeights = weights_by_tma(kBlocks, kTok);
  static_assert(kBlocks * (kTok / 16) * 4 * kConsumers * 4 <= kStages * S::kStageBytes,
                "a cluster pair exchanges half a tile's sums through the ring");
  // Only this (sm_90a) body has static shared memory and the 168-register launch-bound
  // allocation; w4a8_wgmma_supported tells it from the stubs by those attributes.
  __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[s] then empty[s]
  __shared__ int s_is_last;
  extern __shared__ __align__(16) uint8_t smem_raw[];

  const uint32_t raw_addr = smem_addr(smem_raw);
  uint8_t* smem = smem_raw + ((1024u - (raw_addr & 1023u)) & 1023u);
  const uint32_t smem_base = smem_addr(smem);  // 1024-aligned: x ring, then weight ring, then group words
  const uint32_t w_ring = smem_base + kStages * S::kXBytes;
  const uint32_t p_ring = w_ring + kStages * S::kWBytes;
  const uint32_t full0 = smem_addr(&bars[0]);
  const uint32_t empty0 = smem_addr(&bars[kStages]);

  // Tile t: token tiles in groups of kRasterGroup sweep all channel tiles (x stays in L2, each
  // weight tile is re-read by the group's CTAs while hot).
  const int span = kRasterGroup * p.ch_tiles;
  auto tile_origin = [&](int tile, int& tok0, int& rt0) {
    const int grp = tile / span;
    const int rem = tile - grp * span;
    const int in_grp = min(kRasterGroup, p.tok_tiles - grp * kRasterGroup);
    tok0 = (grp * kRasterGroup + rem % in_grp) * kTok;
    rt0 = (rem / in_grp) * S::kRowTiles;
  };

  const int M = p.M, K = p.K;
  const int chunks = K / kChunkK;
  const int num_rt = p.N >> 4;
  const int n_stage_all = ceil_div(chunks, 2);
  const bool stream_k = p.sk_ctas > 0;
  // Classic launch: tile blockIdx.x, split blockIdx.y. A cluster pair launch is 1-D, clusters of
  // CTAs (2c, 2c + 1), rank blockIdx.x & 1. Its first pair_dp_tiles / 2 clusters run two whole
  // tiles (one a CTA); the others one tile's two K halves, which they sum in shared memory
  // (`paired`).
  const int cluster = static_cast<int>(blockIdx.x) >> 1, pair_rank = static_cast<int>(blockIdx.x) & 1;
  const bool paired = p.pair && cluster >= (p.pair_dp_tiles >> 1);
  const bool pair_dp = p.pair && !paired;
  const int cl_tile = paired ? p.pair_dp_tiles + cluster - (p.pair_dp_tiles >> 1) : static_cast<int>(blockIdx.x);
  const int cl_split = paired ? pair_rank : p.pair ? 0 : static_cast<int>(blockIdx.y);
  const int splits = stream_k || pair_dp ? 1 : paired ? 2 : gridDim.y;  // classic split-K (2: a pair)
  const int dp_tiles = stream_k ? p.sk_dp_tiles : 0;
  const int dp_units = stream_k ? dp_tiles / p.sk_ctas * n_stage_all : 0;  // this CTA's data-parallel units
  const int units = (p.tok_tiles * p.ch_tiles - dp_tiles) * n_stage_all;  // the rest: tile dp_tiles + u / n_stage_all
  int u_begin, u_end;  // this CTA's units of the rest
  if (stream_k) {
    u_begin = sk_range_begin(blockIdx.x, units, p.sk_ctas);
    u_end = sk_range_begin(blockIdx.x + 1, units, p.sk_ctas);
  } else {
    const int per_split = ceil_div(n_stage_all, splits);
    const int st_lo = min(n_stage_all, cl_split * per_split);
    u_begin = cl_tile * n_stage_all + st_lo;
    u_end = u_begin + min(n_stage_all, st_lo + per_split) - st_lo;
  }
  // The CTA's segments, by position v in its work (0 <= v < v_end): tile, first stage, stages.
  const int v_end = dp_units + (u_end - u_begin);
  auto segment_at = [&](int v, int& tile, int& first_stage, int& n_it) {
    if (v < dp_units) {
      tile = static_cast<int>(blockIdx.x) + v / n_stage_all * p.sk_ctas;
      first_stage = 0;
      n_it = n_stage_all;
    } else {
      const int u = u_begin + v - dp_units;
      const int t = u / n_stage_all;
      tile = dp_tiles + t;
      first_stage = u - t * n_stage_all;
      n_it = min(n_stage_all - first_stage, u_end - u);
    }
  };

  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full0 + 8 * s, 128);             // one cp.async arrival per producer thread
      // One arrival per consumer thread: each releases its own ld.shared reads of the slot.
      // (One per warp after __syncwarp is also sound, but compute-sanitizer racecheck does not
      // follow that chain and reported 1.6M WAR hazards on lanes 1..31.)
      mbar_init(empty0 + 8 * s, kConsumers);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    // ================= producer warpgroup: global -> shared with cp.async =================
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    const int pt = threadIdx.x;
    const int pw = pt >> 5, lane = pt & 31;
    const int groups = chunks >> p.group_shift;
    // The descriptor is read from parameter memory on the first TMA: fetch it now, off that path.
    if (kTmaWeights && pt == 0)
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&w_map)) : "memory");
    if (kXTma && pt == 0)
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&x_map)) : "memory");
    // x: warp pw copies rows r = pw + 4i, one 128-byte row (both chunks of the stage) per
    // warp instruction. Lane l holds actual 4-byte unit u = l & 15 = 4a + b of chunk h = l >> 4;
    // it goes to logical unit 4b + a (the packing's k permutation), i.e. 16-byte block
    // 4h + b of the row, swizzled by r & 7 = pw + 4 (i & 1). Row r = pw + 4(2m + e) sits at
    // byte 128 pw + 512 e + 1024 m of the stage.
    const int xh = lane >> 4, xa = (lane & 15) >> 2, xb = lane & 3;
    const uint32_t x_off0 = pw * kStageK + 16 * ((4 * xh + xb) ^ pw) + 4 * xa;
    const uint32_t x_off1 = pw * kStageK + 512 + 16 * ((4 * xh + xb) ^ (pw + 4)) + 4 * xa;
    const size_t x_step4 = static_cast<size_t>(4) * K;
    // weights (without kTmaWeights): 16-byte unit u = pt + 128 i of the stage = row tile
    // (pt >> 6) + 2i, byte offset (pt & 63) * 16 of its two chunks (1 KB contiguous in global
    // memory).
    const int w_rt = pt >> 6, w_cl = (pt >> 5) & 1;
    const size_t w_step2 = static_cast<size_t>(2) * chunks * kChunkBytes;
    // group words: unit pt < 4 * kRowTiles = (row tile pt >> 2, chunk (pt >> 1) & 1, half pt & 1).
    const int p_rt = pt >> 2, p_cl = (pt >> 1) & 1;

    // The segment being copied: tile `tile`, its stages from st_lo (set by begin_segment).
    int st_lo, rt_lo, rt_valid, rows_valid, x_tok0;
    const int8_t* x_src;
    const uint8_t* w_src;
    bool p_thread;
    const uint32_t* p_src;
    auto begin_segment = [&](int tile, int first_stage) {
      st_lo = first_stage;
      int tok0, rt0;
      tile_origin(tile, tok0, rt0);
      rt_lo = rt0;
      rt_valid = min(S::kRowTiles, num_rt - rt0);
      rows_valid = min(kTok, M - tok0);
      x_tok0 = tok0;
      x_src = p.xq + static_cast<size_t>(tok0 + pw) * K + static_cast<size_t>(st_lo) * kStageK + 4 * lane;
      w_src = p.qweight + (static_cast<size_t>(rt0 + w_rt) * chunks + 2 * st_lo) * kChunkBytes + (pt & 63) * 16;
      p_thread = pt < 4 * S::kRowTiles && p_rt < rt_valid;
      p_src = p.gparams + static_cast<size_t>(rt0 + (p_thread ? p_rt : 0)) * groups * 8 + (pt & 1) * 4;
    };
    // Rows past M and row tiles past N are not copied (their results are never stored).
    // The second chunk of the last stage when K / 64 is odd is zero-filled; its source
    // address is moved back onto the valid chunk so that no copy ever points past a row.
    // Opaque strides (asm below): keep the compiler from hoisting i * stride for every row out
    // of the stage loop (that needs 2 registers per row; the producer has 56).
    auto copy_weights = [&](int it, int slot) {  // the stage's weight words and group words
      const int c0 = 2 * (st_lo + it);
      if constexpr (kTmaWeights) {
        if (pt == 0) {
          // Thread 0's own cp.async arrival on this barrier comes later, so the phase cannot
          // complete before the bytes are expected. Row tiles past N and the chunk past an odd
          // K / 64 arrive as zeros.
          const uint32_t full = full0 + 8 * slot;
          mbar_expect_tx(full, S::kWBytes);
          tma_load_2d(w_ring + slot * S::kWBytes, &w_map, c0 * (kChunkBytes / 4), rt_lo, full);
        }
      } else {
        size_t w_step = w_step2;
        asm volatile("" : "+l"(w_step));
        const bool ok = c0 + w_cl < chunks;
        const uint32_t dst = w_ring + slot * S::kWBytes + pt * 16;
        const uint8_t* src[kCopyChains];
        src[0] = w_src + static_cast<size_t>(it) * (2 * kChunkBytes) - (ok ? 0 : kChunkBytes);
#pragma unroll
        for (int c = 1; c < kCopyChains; ++c) src[c] = src[c - 1] + w_step;
        if (rt_valid == S::kRowTiles) {
#pragma unroll
          for (int i = 0; i < S::kRowTiles / 2; ++i) {
            cp_async16(dst + i * 128 * 16, src[i % kCopyChains], ok);
            src[i % kCopyChains] += kCopyChains * w_step;
          }
        } else {
#pragma unroll
          for (int i = 0; i < S::kRowTiles / 2; ++i) {
            if (w_rt + 2 * i < rt_valid) cp_async16(dst + i * 128 * 16, src[i % kCopyChains], ok);
            src[i % kCopyChains] += kCopyChains * w_step;
          }
        }
      }
      if (p_thread) {
        const int c = c0 + p_cl;
        const bool pok = c < chunks;
        const uint32_t* psrc = p_src + static_cast<size_t>((pok ? c : c0) >> p.group_shift) * 8;
        cp_async16(p_ring + slot * S::kPBytes + pt * 16, psrc, pok);
      }
    };
    auto copy_x = [&](int it, int slot) {  // the stage's activation rows
      if constexpr (kXTma) {
        // One box of kTok rows x 128 B, swizzled as the descriptor reads it. As for the weights,
        // thread 0's cp.async arrival comes later; rows past M and the chunk past an odd K / 64
        // arrive as zeros.
        if (pt == 0) {
          const uint32_t full = full0 + 8 * slot;
          mbar_expect_tx(full, S::kXBytes);
          tma_load_2d(smem_base + slot * S::kXBytes, &x_map, (st_lo + it) * kStageK, x_tok0, full);
        }
        return;
      }
      const int c0 = 2 * (st_lo + it);
      size_t x_step = x_step4;
      asm volatile("" : "+l"(x_step));
      const bool ok = c0 + xh < chunks;
      const uint32_t d0 = smem_base + slot * S::kXBytes + x_off0;
      const uint32_t d1 = smem_base + slot * S::kXBytes + x_off1;
      const int8_t* src[kCopyChains];
      src[0] = x_src + static_cast<size_t>(it) * kStageK - (ok ? 0 : kChunkK);
#pragma unroll
      for (int c = 1; c < kCopyChains; ++c) src[c] = src[c - 1] + x_step;
      if (rows_valid == kTok) {
#pragma unroll
        for (int i = 0; i < kTok / 4; ++i) {
          cp_async4(((i & 1) ? d1 : d0) + (i >> 1) * 1024, src[i % kCopyChains], ok);
          src[i % kCopyChains] += kCopyChains * x_step;
        }
      } else {
#pragma unroll
        for (int i = 0; i < kTok / 4; ++i) {
          if (pw + 4 * i < rows_valid) cp_async4(((i & 1) ? d1 : d0) + (i >> 1) * 1024, src[i % kCopyChains], ok);
          src[i % kCopyChains] += kCopyChains * x_step;
        }
      }
    };
    int s = 0;
    uint32_t phase = 0;
    auto next_slot = [&]() {
      if (++s == kStages) {
        s = 0;
        phase ^= 1;
      }
    };
    // The weights of the first ring's worth of stages do not depend on the previous kernel: as a
    // programmatic dependent launch their copies start before the wait, while that kernel (the
    // activation quantizer, or the previous GEMM's last CTAs) still runs. A stage's full barrier
    // completes once all of this thread's earlier copies have landed, these included.
    if (!stream_k) {
      // Classic launch, one segment. Its own loop: as the stream-K loop below (more live state),
      // it ran up to 5 % slower (kernel 5, 14336 x 4096 at M = 256; csrc/gemm/NOTES.md).
      begin_segment(cl_tile, u_begin - cl_tile * n_stage_all);
      const int n_it = u_end - u_begin;
      const int n_pre = min(kStages, n_it);
      for (int it = 0; it < n_pre; ++it) copy_weights(it, it);
      wait_prior_grids();
      for (int it = 0; it < n_it; ++it) {
        if (it >= kStages) {
          mbar_wait(empty0 + 8 * s, phase ^ 1);
          copy_weights(it, s);
        }
        copy_x(it, s);
        cp_async_arrive_noinc(full0 + 8 * s);
        next_slot();
      }
    } else {
      int done = 0;  // stages issued by this CTA (ring slots are reused after kStages)
      for (int v = 0; v < v_end;) {
        int tile, first_stage, n_it;
        segment_at(v, tile, first_stage, n_it);
        begin_segment(tile, first_stage);
        int n_pre = 0;
        if (done == 0) {
          n_pre = min(kStages, n_it);
          for (int it = 0; it < n_pre; ++it) copy_weights(it, it);
          wait_prior_grids();
        }
        for (int it = 0; it < n_it; ++it, ++done) {
          if (done >= kStages) mbar_wait(empty0 + 8 * s, phase ^ 1);
          if (it >= n_pre) copy_weights(it, s);
          copy_x(it, s);
          cp_async_arrive_noinc(full0 + 8 * s);
          next_slot();
        }
        v += n_it;
      }
    }
    cp_async_wait_all();  // do not retire with copies in flight
    if (paired) {  // the consumers' CTA barrier and two cluster barriers (their partial-sum exchange)
      __syncthreads();
      cluster_sync();
      cluster_sync();
    }
  } else {
    // ================= consumer warpgroups: dequant + wgmma =================
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
    const int ct = threadIdx.x - 128;
    const int wgc = ct >> 7;
    const int warp = (ct >> 5) & 3, lane = ct & 31;
    const int g = lane >> 2, t = lane & 3;
    // Row tile of block b for this warp: (wgc * kBlocks + b) * 4 + warp (m64 rows 16 warp..).
    const uint8_t* w_thr = smem + (w_ring - smem_base) + ((wgc * kBlocks) * 4 + warp) * (2 * kChunkBytes) + lane * 16;
    const uint8_t* p_thr = smem + (p_ring - smem_base) + ((wgc * kBlocks) * 4 + warp) * 64 + g * 4;

    int32_t acc[kBlocks][S::kAcc];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
#pragma unroll
      for (int i = 0; i < S::kAcc; ++i) acc[b][i] = 0;  // defined once; each segment's first wgmma overwrites
    uint32_t a0[kBlocks][2][4], a1[kBlocks][2][4];  // A fragments of chunk 0 / 1 of a stage

    auto load_dequant = [&](int s, int cl, uint32_t(&a)[kBlocks][2][4]) {
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        const uint8_t* wp = w_thr + s * S::kWBytes + b * 4 * (2 * kChunkBytes) + cl * kChunkBytes;
        const uint4 w = *reinterpret_cast<const uint4*>(wp);
        const uint32_t pw = *reinterpret_cast<const uint32_t*>(p_thr + s * S::kPBytes + b * 4 * 64 + cl * 32);
        dequant_chunk(w, pw, a[b]);
      }
    };
    // fresh: the segment's first chunk, whose first k32 step overwrites the accumulators.
    auto issue = [&](int s, int cl, const uint32_t(&a)[kBlocks][2][4], bool fresh) {
      const uint64_t desc = make_desc_sw128(smem_base + s * S::kXBytes + cl * 64);
#pragma unroll
      for (int step = 0; step < 2; ++step)
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)  // +32 bytes per k32 step
          WgmmaRS<kTok>::run(acc[b], a[b][step], desc + 2 * step, (fresh && step == 0) ? 0 : 1);
    };
    // The (token, channel) of accumulator pair (b, j, d): c[4j + d] / c[4j + 2 + d] = channels
    // (2g, 2g+1) of token tok0 + 8j + 2t + d, row tile rt0 + (wgc * kBlocks + b) * 4 + warp.
    // Stream-K: a CTA leaves at most one partial tile (its first segment), in its own slot of the
    // workspace: the accumulators in register order, consumer thread fastest (coalesced; only the
    // tile's finisher reads it back, in the same order).
    constexpr int kTileRegs = kBlocks * S::kAcc;
    auto sk_partial = [&](int cta) { return p.workspace + static_cast<size_t>(cta) * (kTileRegs * kConsumers) + ct; };
    // One block at a time, so that only its channel pair's scales and bias are live (the
    // accumulators fill the consumers' registers; caching every block's spilled them).
    auto store_tile = [&](int tok0, int rt0, int j_lo, int j_hi) {  // token groups j_lo <= j < j_hi
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        const int rt = rt0 + (wgc * kBlocks + b) * 4 + warp;
        if (rt >= num_rt) continue;
        const int ch = rt * 16 + 2 * g;
        const ChanPair cp = load_chan_pair<OutT>(p, ch);
#pragma unroll
        for (int j = 0; j < kTok / 8; ++j) {
#pragma unroll
          for (int d = 0; d < 2; ++d) {
            const int tok = tok0 + 8 * j + 2 * t + d;
            if (j >= j_lo && j < j_hi && tok < M)
              write_pair<OutT>(p, cp, p.x_scale[tok], tok, ch, acc[b][4 * j + d], acc[b][4 * j + 2 + d]);
          }
        }
      }
    };

    int s = 0, s_prev = 0;
    uint32_t phase = 0;
    bool first = true;
    for (int v = 0; v < v_end;) {
      int tile, first_stage, n_it;
      segment_at(v, tile, first_stage, n_it);
      v += n_it;
      for (int it = 0; it < n_it; ++it) {
        mbar_wait(full0 + 8 * s, phase);
        if constexpr (!kXTma) fence_proxy_async();  // cp.async wrote x (generic proxy); TMA needs none
        if (it > 0) wgmma_wait<1>();  // chunk 0 of the previous stage retired: a0 is free
        load_dequant(s, 0, a0);
        wgmma_fence();
        issue(s, 0, a0, it == 0);
        wgmma_commit();
        if (it > 0) {
          wgmma_wait<1>();  // chunk 1 of the previous stage retired: a1 and its slot are free
          mbar_arrive(empty0 + 8 * s_prev);
        }
        load_dequant(s, 1, a1);
        wgmma_fence();
        issue(s, 1, a1, false);
        wgmma_commit();
        s_prev = s;
        if (++s == kStages) {
          s = 0;
          phase ^= 1;
        }
      }
      wgmma_wait<0>();
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) fence_regs(acc[b]);
      mbar_arrive(empty0 + 8 * s_prev);  // the segment's last slot: the producer may refill it
      if (first) {
        // The epilogue reads the scales and writes the output, the partials and the counters,
        // which earlier kernels write or read: the producer waited before its first activation
        // copy, but these threads order their own accesses after the previous grids too.
        wait_prior_grids();
        first = false;
      }
      int tok0, rt0;
      tile_origin(tile, tok0, rt0);

      if (stream_k && tile >= dp_tiles) {
        const int tile_u = (tile - dp_tiles) * n_stage_all;
        const int finisher = sk_owner(tile_u, units, p.sk_ctas);
        const int pieces = sk_owner(tile_u + n_stage_all - 1, units, p.sk_ctas) - finisher + 1;
        if (pieces > 1) {
          if (static_cast<int>(blockIdx.x) != finisher) {
            // A later piece of the tile: this CTA's first segment. Hand it to the finisher.
            int32_t* dst = sk_partial(blockIdx.x);
#pragma unroll
            for (int b = 0; b < kBlocks; ++b)
#pragma unroll
              for (int i = 0; i < S::kAcc; ++i) __stcg(dst + (b * S::kAcc + i) * kConsumers, acc[b][i]);
            __threadfence();
            named_barrier_consumers();
            if (ct == 0) atomicAdd(p.counters + tile, 1);
            continue;
          }
          // The tile's first stages, this CTA's last segment: the other pieces were the first
          // segments of the next CTAs, so they are done or nearly. Spinning is safe: those CTAs
          // wait on nothing before their piece, and a grid of at most one CTA per SM is resident
          // once earlier kernels drain (a dependent grid launches only after this one exits).
          if (ct == 0) {
            volatile int32_t* count = p.counters + tile;
            while (*count < pieces - 1) __nanosleep(64);
            *count = 0;  // reusable by the next launch
          }
          named_barrier_consumers();
          __threadfence();
          for (int c = 1; c < pieces; ++c) {
            const int32_t* src = sk_partial(blockIdx.x + c);
#pragma unroll
            for (int b = 0; b < kBlocks; ++b)
#pragma unroll
              for (int i = 0; i < S::kAcc; ++i) acc[b][i] += __ldcg(src + (b * S::kAcc + i) * kConsumers);
          }
        }
      }
      if (splits == 1) {
        store_tile(tok0, rt0, 0, kTok / 8);
        continue;
      }
      if (paired) {
        // The two K halves of the tile are this CTA and its cluster peer (rank = blockIdx.x & 1).
        // Each finishes half the tokens: it stores the other half of its sums into its own shared
        // memory (the ring, idle once this CTA's copies and wgmmas are done: the CTA barrier),
        // loads the peer's from the peer's (after the first cluster barrier) and writes its half.
        // No global partials, no counters. The sums are pulled, not pushed into the peer: a push
        // made compute-sanitizer racecheck report the peer's stores against this CTA's cp.async
        // writes of the ring (sessions 47-49, csrc/gemm/NOTES.md); each CTA writing only its own
        // shared memory, behind its own barrier, is clean and as fast.
        const uint32_t rank = pair_rank;
        constexpr int kHalf = kTok / 16;  // token groups of 8 a CTA finishes
        const int j_own = static_cast<int>(rank) * kHalf;
        // One instance per rank, so that the register indices of each half are constants.
        auto exchange = [&](auto own_c) {
          constexpr int kOwn = decltype(own_c)::value * kHalf, kPeer = kHalf - kOwn;
          // A thread's 4 sums of a token group are one 16-byte word (conflict-free: a quarter-warp
          // covers 128 contiguous bytes).
          int4* mine = reinterpret_cast<int4*>(smem);
          // The producer has waited for its copies (cp.async.wait_all); this barrier orders them
          // and the consumers' reads of the ring before the stores below.
          __syncthreads();
#pragma unroll
          for (int b = 0; b < kBlocks; ++b)
#pragma unroll
            for (int jh = 0; jh < kHalf; ++jh) {
              const int32_t* c = &acc[b][4 * (kPeer + jh)];
              mine[(b * kHalf + jh) * kConsumers + ct] = make_int4(c[0], c[1], c[2], c[3]);
            }
          cluster_sync();  // release: the peer's loads below see these stores
          // Plain loads through the generic address of the peer's copy, so that the compiler
          // schedules them against the registers.
          const int4* peer = static_cast<const int4*>(__cluster_map_shared_rank(mine, rank ^ 1u));
#pragma unroll
          for (int b = 0; b < kBlocks; ++b)
#pragma unroll
            for (int jh = 0; jh < kHalf; ++jh) {
              const int4 v = peer[(b * kHalf + jh) * kConsumers + ct];
              int32_t* c = &acc[b][4 * (kOwn + jh)];
              c[0] += v.x;
              c[1] += v.y;
              c[2] += v.z;
              c[3] += v.w;
            }
          cluster_sync();  // neither CTA exits while the peer still loads from it
        };
        if (rank == 0)
          exchange(std::integral_constant<int, 0>{});
        else
          exchange(std::integral_constant<int, 1>{});
        store_tile(tok0, rt0, j_own, j_own + kHalf);
        continue;
      }
      // Split-K: int32 partials; the last CTA of the tile to arrive sums them (exact in any order).
      int ch[kBlocks];
      bool ch_ok[kBlocks];
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        const int rt = rt0 + (wgc * kBlocks + b) * 4 + warp;
        ch_ok[b] = rt < num_rt;
        ch[b] = rt * 16 + 2 * g;
      }
#pragma unroll
      for (int j = 0; j < kTok / 8; ++j)
#pragma unroll
        for (int d = 0; d < 2; ++d) {
          const int tok = tok0 + 8 * j + 2 * t + d;
          if (tok >= M) continue;
#pragma unroll
          for (int b = 0; b < kBlocks; ++b)
            if (ch_ok[b]) *workspace_at(p, blockIdx.y, tok, ch[b]) = make_int2(acc[b][4 * j + d], acc[b][4 * j + 2 + d]);
        }
      __threadfence();
      named_barrier_consumers();
      if (ct == 0) {
        const int prev = atomicAdd(p.counters + tile, 1);
        s_is_last = prev == splits - 1;
        if (s_is_last) p.counters[tile] = 0;  // reusable by the next launch
      }
      named_barrier_consumers();
      if (!s_is_last) continue;
      __threadfence();
      ChanPair cp[kBlocks];
#pragma unroll
      for (int b = 0; b < kBlocks; ++b)
        if (ch_ok[b]) cp[b] = load_chan_pair<OutT>(p, ch[b]);
      // kJ x 2 token rows of one block at a time, the split loop inside: 2 kJ independent loads
      // in flight per step. (A load-add chain per element costs splits x L2 latency for every
      // element: 7 splits at 4096 x 4096, M = 64 took 71 us that way against 15 us for Marlin.)
      constexpr int kJ = kTok / 8 < 8 ? kTok / 8 : 8;
#pragma unroll
      for (int b = 0; b < kBlocks; ++b) {
        if (!ch_ok[b]) continue;
#pragma unroll 1
        for (int j0 = 0; j0 < kTok / 8; j0 += kJ) {
          int2 sum[kJ][2];
#pragma unroll
          for (int j = 0; j < kJ; ++j) sum[j][0] = sum[j][1] = make_int2(0, 0);
#pragma unroll 1
          for (int sp = 0; sp < splits; ++sp) {
#pragma unroll
            for (int j = 0; j < kJ; ++j)
#pragma unroll
              for (int d = 0; d < 2; ++d) {
                const int tok = tok0 + 8 * (j0 + j) + 2 * t + d;
                if (tok < M) {
                  const int2 v = __ldcg(workspace_at(p, sp, tok, ch[b]));  // L2: other SMs wrote it
                  sum[j][d].x += v.x;
                  sum[j][d].y += v.y;
                }
              }
          }
#pragma unroll
          for (int j = 0; j < kJ; ++j)
#pragma unroll
            for (int d = 0; d < 2; ++d) {
              const int tok = tok0 + 8 * (j0 + j) + 2 * t + d;
              if (tok < M) write_pair<OutT>(p, cp[b], p.x_scale[tok], tok, ch[b], sum[j][d].x, sum[j][d].y);
            }
        }
      }
    }
  }
#endif  // MIXPREC_WGMMA_DEVICE
}

// ---- host side -------------------------------------------------------------------------------

// Kernel ids of the w4a8_gemm op (4..8) -> <kBlocks, kTok, kStages>.
//   4: 256 channels x 128 tokens, 5 stages (165 KB): large M
//   5: 256 channels x  64 tokens, 6 stages (150 KB): M <= 64 and the tail of larger M
//   6: 128 channels x 256 tokens, 5 stages (203 KB): A/B alternative for large M
//   7: 128 channels x  64 tokens, 8 stages (133 KB): twice kernel 5's CTAs, for layers whose
//      N / 256 x M / 64 leaves most SMs idle (4096 x 4096 at M = 256: 64 CTAs on 132 SMs;
//      M = 64: 21.6 -> 14.2 us, H100, 2026-11-28)
//   8: 128 channels x 128 tokens, 8 stages (197 KB): the same for kernel 4
using Wg4 = WgShape<2, 128, 5>;
using Wg5 = WgShape<2, 64, 6>;
using Wg6 = WgShape<1, 256, 5>;
using Wg7 = WgShape<1, 64, 8>;
using Wg8 = WgShape<1, 128, 8>;
constexpr int kMaxSmem = 227 * 1024;
static_assert(Wg4::kSmemBytes <= kMaxSmem && Wg5::kSmemBytes <= kMaxSmem && Wg6::kSmemBytes <= kMaxSmem &&
                  Wg7::kSmemBytes <= kMaxSmem && Wg8::kSmemBytes <= kMaxSmem,
              "shared memory per CTA");

// m64 blocks per consumer warpgroup, tokens per CTA, the measured microseconds of one 128-deep
// K stage (wgmma_estimate_us), and a stream-K stage's cost against it (wgmma_sk_estimate_us)
struct Cfg {
  int blocks, tok;
  double stage_us, sk_stage_scale;
  int row_tiles() const { return row_tiles_of(blocks); }
  long long tile_elems() const { return 16LL * row_tiles() * tok; }  // outputs a CTA tile holds
};
Cfg cfg_of(int kernel) {
  switch (kernel) {
    case 4: return {2, 128, 0.912, 1.11};
    case 5: return {2, 64, 0.615, 1.066};
    case 7: return {1, 64, 0.48, 1.036};
    case 8: return {1, 128, 0.65, 1.032};
    default: return {1, 256, 1.025, 1.1};  // kernel 6: not auto-picked, its stream-K not fitted
  }
}

template <int kBlocks, int kTok, int kStages, typename OutT>
cudaError_t launch_one(const WParams& p, const CUtensorMap& w_map, const CUtensorMap* x_map, int splits, bool pdl,
                       cudaStream_t stream) {
  using S = WgShape<kBlocks, kTok, kStages>;
  const int tiles = p.tok_tiles * p.ch_tiles;
  const dim3 grid = p.sk_ctas > 0 ? dim3(p.sk_ctas)
                    : p.pair      ? dim3(p.pair_dp_tiles + 2 * (tiles - p.pair_dp_tiles))
                                  : dim3(tiles, splits);
  const dim3 cluster = p.pair ? dim3(2, 1, 1) : dim3(1, 1, 1);
  if (x_map != nullptr)
    return launch_kernel_clustered<w4a8_wgmma_kernel<kBlocks, kTok, kStages, true, OutT>>(
        grid, dim3(kThreads), S::kSmemBytes, pdl, cluster, stream, p, w_map, *x_map);
  return launch_kernel_clustered<w4a8_wgmma_kernel<kBlocks, kTok, kStages, false, OutT>>(
      grid, dim3(kThreads), S::kSmemBytes, pdl, cluster, stream, p, w_map, w_map);  // x_map unread
}

// x_map: null when x goes by cp.async (natural order), else its TMA descriptor (wgmma order).
template <typename OutT>
cudaError_t launch_typed(const WParams& p, const CUtensorMap& w_map, const CUtensorMap* x_map, const W4A8Plan& plan,
                         bool pdl, cudaStream_t stream) {
  switch (static_cast<int>(plan.kernel)) {
    case 4: return launch_one<2, 128, 5, OutT>(p, w_map, x_map, plan.splits, pdl, stream);
    case 5: return launch_one<2, 64, 6, OutT>(p, w_map, x_map, plan.splits, pdl, stream);
    case 7: return launch_one<1, 64, 8, OutT>(p, w_map, x_map, plan.splits, pdl, stream);
    case 8: return launch_one<1, 128, 8, OutT>(p, w_map, x_map, plan.splits, pdl, stream);
    default: return launch_one<1, 256, 5, OutT>(p, w_map, x_map, plan.splits, pdl, stream);
  }
}

constexpr int kStagesMinPerSplit = 4;  // 512 k per split at least: pipeline fill stays amortised
// Whole tiles before the pairs paid off at K = 14336 and 28672 (-2 to -8 %, H200, session 48)
// and not at K = 4096 (+1.4 % against stream-K at 4096 x 6144, M = 1024).
constexpr int kPairTailMinStages = 64;

long long ctas_of(int kernel, int M, int N) {
  const Cfg c = cfg_of(kernel);
  return static_cast<long long>(ceil_div(M, c.tok)) * ceil_div(N / 16, c.row_tiles());
}

// A cluster pair launch runs at most half an SM count of tiles as pairs (one wave of CTAs), the
// rest whole, first, two a cluster: with 1.45 SM counts of tiles (192 on 132 SMs) that is one
// wave of whole tiles and half a wave's time of pairs, where the classic grid takes two waves.
// An even count, so that no cluster mixes the two.
long long pair_dp_tiles_of(long long tiles, int num_sms) {
  const long long paired = std::min<long long>(tiles, std::max(num_sms, 2) / 2);
  return (tiles - paired) & ~1LL;
}

// Half-waves of a cluster pair launch: its whole tiles take two, its K halves one each.
long long pair_half_waves(long long tiles, int num_sms) {
  const long long sms = std::max(num_sms, 1);
  return (2 * tiles + sms - 1) / sms;
}

// The plan of `kernel` as a cluster pair: two K halves a tile in a cluster of 2 CTAs, summed in
// shared memory (no workspace, no counters), past one wave of CTAs after pair_dp_tiles_of whole ones.
const char* pair_plan(int M, int N, int kernel, int n_stages, int num_sms, W4A8Plan* plan) {
  if (n_stages < 2) return "w4a8_gemm: splits=-2 (a cluster pair) needs K >= 256";
  const long long tiles = ctas_of(kernel, M, N);
  if (tiles > 65535) return "w4a8_gemm: problem too large for the grid";
  plan->kernel = static_cast<W4A8Kernel>(kernel);
  plan->splits = -2;
  plan->pair_dp_tiles = static_cast<int>(pair_dp_tiles_of(tiles, num_sms));
  plan->num_counters = 0;
  plan->sk_ctas = 0;
  plan->sk_slots = 0;
  plan->workspace_elems = 0;
  return nullptr;
}

// Estimated microseconds of one wgmma launch on an H100 SXM. Filling the SMs (the old rule) is
// not enough: a partial last wave costs a whole wave, and every split writes and reads back an
// int32 M x N partial sum, which at M >= 256 costs more than the wave it saves; the tile's last
// CTA then sums splits x its tile from L2 alone. Stage times of kernels 4-6 were fitted to the
// 144-point kernel x split sweep of 2026-11-23, those of 7 and 8 and the split cost to the
// 105-point sweep of 2026-11-28 with the 2023 one (csrc/gemm/NOTES.md, "Choosing the tile and
// the split"): on both, every pick they timed is within 1.3% of the best measured.
constexpr double kWaveUs = 2.89;  // a wave's prologue and epilogue (both estimates below)

double wgmma_estimate_us(int kernel, int splits, long long ctas, int n_stages, int M, int N, int num_sms) {
  const Cfg c = cfg_of(kernel);
  constexpr double kSplitUs = 1.0;                 // the split-K reduction's fixed cost
  constexpr double kSumUsPerKElem = 0.1;           // the last CTA's sum, per split and 1024 tile elements
  constexpr double kPartialBytesPerUs = 2.56e6;    // int32 partials written, then read back
  const long long sms = num_sms > 0 ? num_sms : 1;
  const long long waves = (ctas * splits + sms - 1) / sms;
  double us = static_cast<double>(waves) * (ceil_div(n_stages, splits) * c.stage_us + kWaveUs);
  if (splits > 1) {
    const double tile_kelems = c.tile_elems() / 1024.0;
    us += kSplitUs + kSumUsPerKElem * splits * tile_kelems +
          2.0 * splits * static_cast<double>(M) * N * 4 / kPartialBytesPerUs;
  }
  return us;
}

// Stream-K over `ctas` CTAs runs its first tiles data-parallel: every whole wave but the last,
// so the stream-K units cover one to two waves' worth of tiles (and cut none when tiles is a
// multiple of ctas). Without the waves, 4 of 7 Llama shapes ran 5-14 % slower at M = 1024 than
// the classic grid: each CTA swept its own run of tiles, and the L2 shared little.
long long sk_dp_tiles_of(long long tiles, int ctas) {
  return tiles >= 2LL * ctas ? (tiles / ctas - 1) * ctas : 0;
}

// Stream-K over `ctas` CTAs: the most partials any tile leaves for its finisher (the pieces of
// the most-cut tile - 1), from the CTA boundaries that fall inside a tile. The planner runs this
// for every candidate of every w4a8_gemm call, so the boundaries sk_range_begin(c) =
// c * q + floor(c * r / ctas) are stepped (by q or q + 1, ctas <= units) without dividing.
int sk_slots_of(long long tiles, int n_stages, int ctas) {
  const long long units = (tiles - sk_dp_tiles_of(tiles, ctas)) * n_stages;
  const long long q = units / ctas, r = units % ctas;
  long long carry = 0, at = 0;  // c * r mod ctas; the boundary's stage within its tile
  long long tile = 0;
  int most = 0, run = 0;
  long long run_tile = -1;
  for (int c = 1; c < ctas; ++c) {
    carry += r;
    at += q;
    if (carry >= ctas) {
      carry -= ctas;
      ++at;
    }
    while (at >= n_stages) {  // at most tiles + ctas passes in all: the stream-K tiles are < 2 ctas
      at -= n_stages;
      ++tile;
    }
    if (at == 0) continue;  // a boundary between tiles cuts none
    run = tile == run_tile ? run + 1 : 1;
    run_tile = tile;
    if (run > most) most = run;
  }
  return most;
}

// Estimated microseconds of a stream-K launch: its data-parallel waves as classic ones (times
// kDpWaveScale), then ceil(units / ctas) stream-K stages per CTA at the kernel's sk_stage_scale,
// one launch with its pipeline fill and fix-up waits, an epilogue per further tile, and the
// finisher's sum of the other pieces. Fitted (rms 4.8 %) to 132 stream-K times on one H200
// (sessions 33, 34 and 42: M = 64 to 1024, the Llama shapes), each divided by its kernel's mean
// measured / wgmma_estimate_us ratio there, so that the two estimates compare as the launches do.
// `python scripts/fit_stream_k.py` reproduces the fit (csrc/gemm/NOTES.md, "Stream-K").
double wgmma_sk_estimate_us(int kernel, long long tiles, int n_stages, int ctas, int slots) {
  const Cfg c = cfg_of(kernel);
  constexpr double kDpWaveScale = 0.98;        // a data-parallel wave against a classic one
  constexpr double kLaunchUs = 5.91;           // the stream-K part: fill, drain and fix-up waits
  constexpr double kSegmentUs = 1.82;          // each further tile's epilogue (or partial store)
  constexpr double kSumUsPerKElem = 0.055;     // the finisher's sum, per piece and 1024 tile elements
  const long long dp_waves = sk_dp_tiles_of(tiles, ctas) / ctas;
  const long long units = (tiles - dp_waves * ctas) * n_stages;
  const long long per_cta = (units + ctas - 1) / ctas;
  const long long segments = (per_cta + n_stages - 1) / n_stages + (slots > 0 ? 1 : 0);
  double us = kDpWaveScale * static_cast<double>(dp_waves) * (n_stages * c.stage_us + kWaveUs);
  us += c.sk_stage_scale * static_cast<double>(per_cta) * c.stage_us + kLaunchUs +
        static_cast<double>(segments - 1) * kSegmentUs;
  if (slots > 0) us += kSumUsPerKElem * slots * (c.tile_elems() / 1024.0);
  return us;
}

using EncodeFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's cuTensorMapEncodeTiled, looked up once (null if the driver lacks it).
EncodeFn tensor_map_encoder() {
  static EncodeFn encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<EncodeFn>(fn);
  }();
  return encode;
}

// The weights' TMA descriptor: the packed weights as a 2-D tensor of 4-byte words, [N / 16 row
// tiles][K / 64 chunks x 128], box [row tiles a CTA][256], so that one TMA copies a stage's
// weight words (1 KB a row tile); row tiles past N and the chunk past an odd K / 64 arrive as
// zeros. Encoded on the host for each launch that takes it (host work only, so also under graph
// capture). A separate __grid_constant__ parameter: inside WParams it made all of p
// addressable, and ptxas then compiled the consumers differently.
cudaError_t encode_weight_map(CUtensorMap* map, const uint8_t* qweight, int N, int K, int row_tiles) {
  const EncodeFn encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t row_words = static_cast<cuuint64_t>(K / kChunkK) * (kChunkBytes / 4);
  const cuuint64_t dims[2] = {row_words, static_cast<cuuint64_t>(N / 16)};
  const cuuint64_t strides[1] = {row_words * 4};  // bytes between row tiles
  const cuuint32_t box[2] = {2 * kChunkBytes / 4, static_cast<cuuint32_t>(row_tiles)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 2, const_cast<uint8_t*>(qweight), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The activations' TMA descriptor (x in the wgmma k order): [M][K] bytes, box [tok rows][128 B]
// with the 128-byte swizzle that make_desc_sw128 reads; rows past M and k past K arrive as zeros.
cudaError_t encode_x_map(CUtensorMap* map, const int8_t* xq, int M, int K, int tok) {
  const EncodeFn encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(M)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(K)};  // bytes between rows
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kStageK), static_cast<cuuint32_t>(tok)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<int8_t*>(xq), dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

// wgmma kernels run iff the current device is sm_90 and the image chosen for it is the sm_90a
// body (an sm_80 or plain sm_90 image only holds the stub). Cached per device.
bool w4a8_wgmma_supported() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const int slot = dev & 63;
  int v = cache[slot].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0;
    bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
              cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
              major == 9 && minor == 0;
    if (ok) {
      cudaFuncAttributes attr{};
      ok = cudaFuncGetAttributes(&attr, w4a8_wgmma_kernel<2, 128, 5, false, __half>) == cudaSuccess &&
           attr.binaryVersion >= 90 && attr.numRegs >= 64 && attr.sharedSizeBytes > 0;
    }
    (void)cudaGetLastError();  // a missing image leaves a (non-sticky) error behind: clear it
    v = ok ? 1 : 2;
    cache[slot].store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

const char* w4a8_wgmma_make_plan(int M, int N, int K, int group_size, int num_sms, int kernel, int splits,
                                 bool stream_k_auto, bool pair_auto, W4A8Plan* plan) {
  if (M <= 0 || N <= 0 || K <= 0) return "w4a8_gemm: M, N and K must be positive";
  if (N % 16) return "w4a8_gemm: N must be a multiple of 16";
  if (K % kChunkK) return "w4a8_gemm: K must be a multiple of 64";
  if (group_size < kChunkK || group_size % kChunkK || ((group_size / kChunkK) & (group_size / kChunkK - 1)))
    return "w4a8_gemm: group size must be 64 times a power of two (64, 128, ...)";
  if (K % group_size) return "w4a8_gemm: K must be a multiple of the group size";
  if (kernel != -1 && (kernel < 4 || kernel > 8)) return "w4a8_gemm: the wgmma kernels are 4 to 8";
  if (splits < -2)
    return "w4a8_gemm: splits must be -2 (a cluster pair), -1 (stream-K), 0 (choose) or a split count";
  const int n_stages = ceil_div(K / kChunkK, 2);
  const int sms = num_sms > 0 ? num_sms : 1;
  int most = n_stages / kStagesMinPerSplit;  // splits to try when choosing
  if (most > 16) most = 16;
  if (most < 1) most = 1;
  // Candidates: the requested kernel, or kAutoKernels (6 never won a sweep); the requested
  // split count, or 1..most, and stream-K when asked for (-1) or allowed (stream_k_auto).
  // The least estimated time wins. splits_of -1 stands for stream-K below.
  static constexpr int kAutoKernels[] = {4, 5, 7, 8};
  const int* k_list = kernel == -1 ? kAutoKernels : &kernel;
  const int k_count = kernel == -1 ? static_cast<int>(sizeof(kAutoKernels) / sizeof(int)) : 1;
  if (splits == -2) {
    if (kernel == -1) return "w4a8_gemm: splits=-2 (a cluster pair) needs a kernel id (4..8)";
    return pair_plan(M, N, kernel, n_stages, sms, plan);
  }
  const bool try_classic = splits >= 0;
  const bool try_sk = splits == -1 || (splits == 0 && stream_k_auto);
  const int s_lo = splits > 0 ? splits : 1, s_hi = splits > 0 ? splits : most;
  bool have = false;
  double best_us = 0.0;
  int best_kernel = k_list[0], best_splits = s_lo, best_slots = 0;
  for (int i = 0; i < k_count; ++i) {
    const int k = k_list[i];
    const long long tiles = ctas_of(k, M, N);
    for (int s = try_classic ? s_lo : s_hi + 1; s <= s_hi; ++s) {
      const double us = wgmma_estimate_us(k, s, tiles, n_stages, M, N, num_sms);
      if (!have || us < best_us) {
        have = true;
        best_us = us;
        best_kernel = k;
        best_splits = s;
      }
    }
    // A cluster pair (two K halves a tile, summed in shared memory): one wave of pairs, or,
    // where K has kPairTailMinStages, three half-waves (pair_dp_tiles_of: a wave of whole tiles,
    // then the pairs). Its estimate is a half-wave's one-split time on half the stages per
    // half-wave plus kPairUs (fitted to session 47's one-wave pairs); kernel 7 never won as a
    // pair (H200, sessions 47-48: csrc/gemm/NOTES.md).
    const bool pair_fits = 2 * tiles <= sms || (2 * tiles <= 3LL * sms && n_stages >= kPairTailMinStages);
    if (pair_auto && splits == 0 && k != 7 && n_stages >= 2 * kStagesMinPerSplit && pair_fits) {
      constexpr double kPairUs = 5.0;
      const double us = static_cast<double>(pair_half_waves(tiles, sms)) *
                            wgmma_estimate_us(k, 1, 1, ceil_div(n_stages, 2), M, N, num_sms) +
                        kPairUs;
      if (!have || us < best_us) {
        have = true;
        best_us = us;
        best_kernel = k;
        best_splits = -2;
      }
    }
    if (try_sk && tiles * n_stages <= 0x7FFFFFFFLL) {
      const int ctas = static_cast<int>(std::min<long long>(sms, tiles * n_stages));
      // Stream-K must be estimated 7 % faster to be chosen (its estimate is 4.8 % rms off, 12.5 %
      // at worst): with edges of 0.92-0.94 no pick of the 56 timed rows loses 2 % to the classic
      // planner's; session 33's fit and 5 % edge lost 11.5 % on 4096 x 6144 at M = 128 (NOTES.md
      // "Stream-K"). scripts/fit_stream_k.py scans the edge.
      constexpr double kStreamKEdge = 0.93;
      const int slots = sk_slots_of(tiles, n_stages, ctas);
      const double us = wgmma_sk_estimate_us(k, tiles, n_stages, ctas, slots) / kStreamKEdge;
      if (!have || us < best_us) {
        have = true;
        best_us = us;
        best_kernel = k;
        best_splits = -1;
        best_slots = slots;
      }
    }
  }
  kernel = best_kernel;
  splits = best_splits;
  if (splits == -2) return pair_plan(M, N, kernel, n_stages, sms, plan);
  const long long ctas = ctas_of(kernel, M, N);
  const Cfg c = cfg_of(kernel);
  plan->kernel = static_cast<W4A8Kernel>(kernel);
  plan->num_counters = static_cast<int>(std::min<long long>(ctas, 0x7FFFFFFFLL));
  // The kernel counts (tile, stage) units in ints.
  if (ctas * n_stages > 0x7FFFFFFFLL) return "w4a8_gemm: problem too large for the grid";
  if (splits == -1) {
    plan->splits = -1;
    plan->sk_ctas = static_cast<int>(std::min<long long>(sms, ctas * n_stages));
    plan->sk_slots = best_slots;  // the candidate's: same tiles and CTAs
    // A partial tile per CTA, when any tile is cut (sk_slots > 0).
    plan->workspace_elems = plan->sk_slots > 0 ? plan->sk_ctas * c.tile_elems() : 0;
    return nullptr;
  }
  if (splits > n_stages) splits = n_stages;
  splits = ceil_div(n_stages, ceil_div(n_stages, splits));  // no empty split
  if (ctas * splits > 0x7FFFFFFFLL || splits > 65535) return "w4a8_gemm: problem too large for the grid";
  plan->splits = splits;
  plan->sk_ctas = 0;
  plan->sk_slots = 0;
  plan->workspace_elems = splits > 1 ? static_cast<long long>(splits) * M * N : 0;
  return nullptr;
}

cudaError_t w4a8_wgmma_launch(const W4A8GemmArgs& a, const W4A8Plan& plan, cudaStream_t stream) {
  WParams p;
  static_cast<W4A8KernelParams&>(p) = w4a8_kernel_params(a);
  const Cfg c = cfg_of(static_cast<int>(plan.kernel));
  const int row_tiles = c.row_tiles();
  CUtensorMap w_map{};  // zeros, unread, for the kernels that copy their weights with cp.async
  if (weights_by_tma(c.blocks, c.tok)) {
    const cudaError_t e = encode_weight_map(&w_map, a.qweight, a.N, a.K, row_tiles);
    if (e != cudaSuccess) return e;
  }
  CUtensorMap x_map{};
  if (a.x_wgmma_order) {
    const cudaError_t e = encode_x_map(&x_map, a.xq, a.M, a.K, c.tok);
    if (e != cudaSuccess) return e;
  }
  const CUtensorMap* x_tma = a.x_wgmma_order ? &x_map : nullptr;
  p.tok_tiles = ceil_div(a.M, c.tok);
  p.ch_tiles = ceil_div(a.N / 16, row_tiles);
  p.sk_ctas = plan.splits == -1 ? plan.sk_ctas : 0;
  p.pair = plan.splits == -2 ? 1 : 0;
  p.pair_dp_tiles = p.pair ? plan.pair_dp_tiles : 0;
  p.sk_dp_tiles = p.sk_ctas > 0 ? static_cast<int>(sk_dp_tiles_of(static_cast<long long>(p.tok_tiles) * p.ch_tiles, p.sk_ctas)) : 0;
  switch (a.out_kind) {
    case OutKind::kHalf: return launch_typed<__half>(p, w_map, x_tma, plan, a.pdl, stream);
    case OutKind::kBFloat16: return launch_typed<__nv_bfloat16>(p, w_map, x_tma, plan, a.pdl, stream);
    default: return launch_typed<float>(p, w_map, x_tma, plan, a.pdl, stream);
  }
}

}  // namespace mixprec
