// Host interface of the W4A8 GEMM kernels (csrc/gemm/sm80/w4a8_gemm_mma.cu).
// Raw pointers only, so that the .cu files compile without the torch headers; csrc/ops.cpp
// checks the tensors and calls these.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace mixprec {

// Element types of the output and of the bias.
enum class OutKind : int { kHalf = 0, kBFloat16 = 1, kFloat = 2 };
enum class BiasKind : int { kNone = 0, kFloat = 1, kSameAsOut = 2 };

// Which kernel: decode kernels stream the weight once (M <= 64), tiled kernels stage
// weight and activation tiles in shared memory (any M).
enum class W4A8Kernel : int {
  kAuto = -1,
  kDecodeRows16 = 0,   // one 16-channel row tile per CTA
  kDecodeRows32 = 1,   // two row tiles per CTA (x fetched once for both)
  kTiledTok64 = 2,     // CTA tile 128 channels x 64 tokens
  kTiledTok128 = 3,    // CTA tile 128 channels x 128 tokens
};

struct W4A8GemmArgs {
  const int8_t* xq;             // [M, K] int8, row-major, 16-byte aligned
  const float* x_scale;         // [M]
  const uint8_t* qweight;       // [N/16, 8K] packed (see NOTES.md "Layout")
  const uint32_t* gparams;      // [N/16, K/G, 8] packed (scale, offset) words
  const float* channel_scale;   // [N]
  const void* bias;             // [N] or nullptr
  BiasKind bias_kind;
  void* out;                    // [M, N]
  OutKind out_kind;
  int32_t* workspace;           // plan.workspace_elems int32 (split-K or stream-K partials)
  int32_t* counters;            // plan.num_counters ints, zero at launch; the kernel leaves them zero
  int M, N, K, group_size;
  // Decode kernels (0, 1) and wgmma kernels (4..8), on sm_90: launched as a programmatic
  // dependent of the previous kernel on the stream, so their launch and set-up (for the wgmma
  // kernels also the first stages' weight copies) overlap its tail. Kernels 2, 3 ignore it.
  bool pdl = false;
  // Decode kernels (0, 1): u8 x s8 MMA on u = w8 + 128 (no XOR per weight byte), 128 * sum_k x
  // subtracted per warp; the same int32 sums (csrc/gemm/NOTES.md "Decode u8").
  bool decode_u8 = false;
  // Decode kernels (0, 1) at M = 1: IDP.4A on the 4-bit codes, no dequant, no MMA; the group
  // scale and offset applied once per pair of chunks of a group (per chunk at group 64). The same
  // int32 sums (csrc/gemm/NOTES.md "Session 55", "Session 56").
  bool decode_dp4a = false;
  // Decode kernels (0, 1): each warp reads its first batch of weight words before waiting on the
  // previous kernel (PDL), so that batch's DRAM latency overlaps the quantizer (csrc/gemm/NOTES.md
  // "Decode preload"). The same sums.
  bool decode_preload = false;
  // Decode kernels (0, 1), sm_90: each CTA issues griddepcontrol.launch_dependents once its
  // griddepcontrol.wait returns, so a quantizer op launched after it as a programmatic dependent
  // (quant_ops_pdl) is scheduled while its last CTAs run (csrc/gemm/NOTES.md "Session 88").
  bool trigger_dependents = false;
  // wgmma kernels (4..8) only: xq is in the wgmma k order (formats.py wgmma_act_k_order: 4-byte
  // units transposed 4 x 4 in every 64 k), so one TMA a stage copies it (csrc/gemm/NOTES.md
  // "Session 63"). The other kernels read xq in its natural order only.
  bool x_wgmma_order = false;
};

// What every W4A8 kernel reads: W4A8GemmArgs in device form (the kernels take it by value).
struct W4A8KernelParams {
  const int8_t* __restrict__ xq;
  const float* __restrict__ x_scale;
  const uint8_t* __restrict__ qweight;
  const uint32_t* __restrict__ gparams;
  const float* __restrict__ channel_scale;
  const void* __restrict__ bias;
  void* __restrict__ out;
  int32_t* __restrict__ workspace;
  int32_t* __restrict__ counters;
  int bias_kind;
  int M, N, K;
  int group_shift;  // log2(group_size / 64): 64-k chunk c uses group c >> group_shift
  bool trigger_dependents;
};

inline W4A8KernelParams w4a8_kernel_params(const W4A8GemmArgs& a) {
  W4A8KernelParams p;
  p.xq = a.xq;
  p.x_scale = a.x_scale;
  p.qweight = a.qweight;
  p.gparams = a.gparams;
  p.channel_scale = a.channel_scale;
  p.bias = a.bias;
  p.out = a.out;
  p.workspace = a.workspace;
  p.counters = a.counters;
  p.bias_kind = static_cast<int>(a.bias_kind);
  p.M = a.M;
  p.N = a.N;
  p.K = a.K;
  p.group_shift = 0;
  while ((64 << p.group_shift) < a.group_size) ++p.group_shift;
  p.trigger_dependents = a.trigger_dependents;
  return p;
}

struct W4A8Plan {
  W4A8Kernel kernel;
  int splits;          // K split across CTAs (1: no workspace); -1: stream-K, -2: a cluster pair (wgmma)
  // Decode kernels (0, 1): the build's registers are capped for 2 CTAs per SM (<= 128) or 3
  // (<= 80, M <= 16; csrc/gemm/NOTES.md "Decode occupancy"); 0 for the other kernels.
  int decode_ctas = 0;
  int num_counters;    // output tiles (one arrival counter each)
  int sk_ctas = 0;     // stream-K: CTAs of the persistent grid (0: a CTA per tile and split)
  int sk_slots = 0;    // stream-K: pieces of the most-cut tile - 1 (0: no tile is cut)
  int pair_dp_tiles = 0;  // cluster pair: the first tiles, run whole (one a CTA) before the pairs
  long long workspace_elems = 0;  // int32 partials to allocate (0: none, nor counters)
};

// Picks kernel, K split and (decode kernels) build for a problem (kernel/splits < 0 or == 0 and
// decode_ctas_per_sm == 0 mean "choose"; a forced 3 applies at M <= 16 only).
// Returns an error string (static) when the request cannot be served, nullptr otherwise.
const char* w4a8_make_plan(int M, int N, int K, int group_size, int num_sms, int kernel,
                           int splits, int decode_ctas_per_sm, W4A8Plan* plan);

// Auto (kernel -1) on a GPU with the wgmma kernels: whether M tokens on an N x K weight take the
// decode kernels (M <= 32; M = 33-64 where a decode grid is one wave: 16 channels, or 32 to
// K = 10240 at M <= 48 and 8192 past it) instead of wgmma.
bool w4a8_auto_prefers_decode(int M, int N, int K, int num_sms);

cudaError_t w4a8_gemm_launch(const W4A8GemmArgs& args, const W4A8Plan& plan, cudaStream_t stream);

// Per-token symmetric int8 quantisation (csrc/quant/quantize_act_int8.cu).
// x [M, K] (row stride x_row_stride elements) of x_kind; smooth [K] of smooth_kind or nullptr.
// one_pass: rows of up to 32768 elements are read once, into registers (rows over 8192 only
// when M <= 128); false: always the two-pass loop, for A/B timing. lean: the one-pass kernel takes
// the codes from v * (1 / scale), dividing only near half-integers, and the amax in one FMNMX.NAN
// an element (session 46); false: its per-element division, for A/B timing. Every path gives the
// same codes and scales.
// split: a few long rows are each split over CTAs of one chunk, every CTA taking the row's amax
// itself (quantize_act_int8_split_kernel; no smoothing divisor, aligned rows, the lean codes): 0
// never; 1 the rule (quantize_act_split_chunk); 1024, 2048 or 4096 that chunk wherever M <= 64 and
// K >= 2 chunks (A/B timing).
// wgmma_order: the codes go to their places in the wgmma k order (wgmma_act_k; K % 64 == 0).
// pdl (sm_90; the caller checks): launched as a programmatic dependent of the kernel before it,
// waiting for it before reading x (quant_ops_pdl; the same codes).
cudaError_t quantize_act_int8_launch(const void* x, OutKind x_kind, int64_t x_row_stride,
                                     const void* smooth, OutKind smooth_kind, int8_t* q,
                                     float* scale, int M, int K, bool one_pass, bool lean, int split,
                                     bool wgmma_order, bool pdl, cudaStream_t stream);
// The split kernel's chunk (elements; 0: no split) for M unsmoothed, aligned rows of K under option
// `split`, as quantize_act_int8_launch takes it.
int quantize_act_split_chunk(int split, int M, int K);

// add + RMSNorm + per-token int8 (csrc/quant/add_rms_norm_quantize_act.cu,
// reference.add_rms_norm_quantize_act). x, residual, res_out [M, K] of `kind` (half or bf16;
// res_out contiguous), weight [K] of `kind` or null, smooth [K] float32 or null; q [M, K],
// scale [M]. Rows of K % 8 == 0, at most kNormMaxK, 16-byte aligned (else cudaErrorInvalidValue).
constexpr int kNormMaxK = 16384;
struct NormQuantArgs {
  const void* x;
  int64_t x_row_stride;
  const void* residual;
  int64_t residual_row_stride;
  const void* weight;
  const float* smooth;
  int8_t* q;
  float* scale;
  void* res_out;
  int M, K;
  float epsilon;
  OutKind kind;
  bool pdl = false;  // sm_90: a programmatic dependent launch, waiting before any load
};
bool add_rms_norm_quantize_act_supports(int K);
cudaError_t add_rms_norm_quantize_act_launch(const NormQuantArgs& args, cudaStream_t stream);

// SiLU-and-mul + per-token int8 (csrc/quant/silu_mul_quantize_act.cu, reference.silu_mul_quantize_act).
// gate_up [M, 2K] of `kind` (half or bf16; rows of 2K, row stride row_stride elements), smooth [K]
// float32 or null; q [M, K], scale [M]. A row's K outputs go to a cluster of plan.ctas CTAs of
// plan.threads threads, plan.vecs 8-element vectors a thread (clusters of more than one CTA need
// sm_90; more than 8, Hopper's non-portable sizes, which the launch opts in to).
// silu_mul_quantize_act_plan: about cta_vecs vectors a CTA (1 to kSiluQuantMaxThreads *
// kSiluQuantMaxVecs), at most max_cluster CTAs (1 to kSiluQuantMaxCluster); false where K % 8 != 0,
// an argument is out of range or the row does not fit. The launch needs K % 8 == 0, 16-byte
// aligned rows and at most kSiluQuantMaxRows rows (else cudaErrorInvalidValue).
constexpr int kSiluQuantMaxCluster = 16;  // Hopper's non-portable cluster size
constexpr int kSiluQuantCluster = 8;  // the op's default max_cluster
constexpr int kSiluQuantCtaVecs = 512;  // the op's default cta_vecs
constexpr int kSiluQuantMaxThreads = 1024;
constexpr int kSiluQuantMaxVecs = 2;
constexpr int kSiluQuantMaxRows = 65535;  // gridDim.y
struct SiluQuantPlan {
  int ctas, threads, vecs;
};
struct SiluQuantArgs {
  const void* gate_up;
  int64_t row_stride;
  const float* smooth;
  int8_t* q;
  float* scale;
  int M, K;
  OutKind kind;
  bool pdl = false;  // sm_90: a programmatic dependent launch, waiting before any load
};
bool silu_mul_quantize_act_plan(int K, int max_cluster, int cta_vecs, SiluQuantPlan* plan);
cudaError_t silu_mul_quantize_act_launch(const SiluQuantArgs& args, const SiluQuantPlan& plan, cudaStream_t stream);

// The wgmma k order of int8 activations (formats.py wgmma_act_k_order): in every 64 k, 4-byte
// unit 4a + b goes to unit 4b + a, the packing's k permutation, so that the wgmma kernels'
// shared-memory B tile is a plain copy of the row (W4A8GemmArgs::x_wgmma_order). An involution.
__host__ __device__ __forceinline__ int wgmma_act_k(int k) {
  const int u = (k >> 2) & 15;
  return (k & ~63) | (((u & 3) << 2 | u >> 2) << 2) | (k & 3);
}

}  // namespace mixprec
