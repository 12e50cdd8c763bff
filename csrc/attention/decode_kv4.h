// Host interface of the KV4 paged decode attention kernel (csrc/attention/sm80/decode_kv4_mma.cu).
// Raw pointers only, so that the .cu file compiles without the torch headers; csrc/ops.cpp
// checks the tensors and calls it. The Triton page kernel (vllm_mixprec/kernels/triton/
// attention.py) is its reference and its fallback; the two partition a row's pages into
// splits the same way, so that the Triton finish kernel merges either's partials.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace mixprec {

// The one page shape the kernel handles: head_dim 128, 16-token pages, at most 8 query
// heads per kv head (the n = 8 side of the score tile). formats.KVPageLayout("kv4", 128, 16).
constexpr int kDecodeKV4HeadDim = 128;
constexpr int kDecodeKV4BlockSize = 16;
constexpr int kDecodeKV4MaxGroup = 8;

struct DecodeKV4Args {
  const void* q;                // [T, Hq, 128] fp16/bf16, 16-byte aligned rows
  int64_t q_stride_t, q_stride_h;
  void* out;                    // [T, Hq, 128], same dtype (written when part_o is null)
  int64_t out_stride_t, out_stride_h;
  float* part_o;                // [rows * slots, Hq, 128] normalised split outputs, or null
  float* part_lse;              // [rows * slots, Hq] base-2 log-sum-exp of the scaled scores
  const uint8_t* cache;         // (blocks, Hkv, 16, 136) bytes: slabs of [K codes][V codes][meta]
  int64_t stride_block, stride_head;  // bytes
  const int32_t* block_table;   // [rows, >= pages]
  int64_t block_table_stride;
  const int32_t* seq_lens;      // [rows]
  const int32_t* query_start_loc;  // [rows + 1]; rows of query length != 1 are skipped
  const float* k_smooth;        // [Hkv, 128] (the pages hold K / smooth) or null
  float qk_scale;               // softmax scale * log2(e)
  int num_rows, num_q_heads, num_kv_heads;
  int num_splits, slots;        // grid z; partial rows per batch row (splits, + 1 with a tail program)
  int res_tokens;               // newest positions left to the residual tail (0: none)
  int tile_tokens;              // split granularity, a multiple of 16 (the finish kernel's BLOCK_N)
  int min_tiles;                // tiles a split attends at least (decode_min_tiles)
  int prefetch_pages;           // a warp asks its page i + prefetch_pages into L2 at page i (0: off)
  bool bf16;                    // q/out dtype: bf16, else fp16
};

// Launches the page kernel on `stream`; returns the launch error (cudaSuccess when none).
cudaError_t decode_kv4_pages_launch(const DecodeKV4Args& args, cudaStream_t stream);

}  // namespace mixprec
