// Tiling constants of the CUDA paged-attention kernels (decode: attention::, multi-token: prefill::),
// shared by the kernels and the host planner.
#pragma once

#include <algorithm>

#include "launchers.h"
#include "device_utils.cuh"

namespace fp8kv::cuda::attention {

// FP8KV_ATTENTION_* exist for tuning experiments (benchmarks/lab builds variants with -D).
#ifndef FP8KV_ATTENTION_WARPS
#define FP8KV_ATTENTION_WARPS 4
#endif
#ifndef FP8KV_ATTENTION_STAGES
#define FP8KV_ATTENTION_STAGES 2
#endif
#ifndef FP8KV_ATTENTION_MIN_CTAS
#define FP8KV_ATTENTION_MIN_CTAS 1
#endif
#ifndef FP8KV_ATTENTION_DEPENDENT_MERGE
#define FP8KV_ATTENTION_DEPENDENT_MERGE 1
#endif
constexpr int kWarps = FP8KV_ATTENTION_WARPS;
constexpr bool kDependentMerge = FP8KV_ATTENTION_DEPENDENT_MERGE;  // merge launched as a dependent grid (sm_90+)
constexpr int kMaxStages = FP8KV_ATTENTION_STAGES;  // tiles staged per warp (kMaxStages - 1 in flight)
constexpr int kMinCtasPerSm = FP8KV_ATTENTION_MIN_CTAS;  // register cap via __launch_bounds__
constexpr int kThreads = kWarps * 32;
constexpr int kTileTokens = 16;
constexpr int kRows = 8;              // query rows per CTA: the mma's N
inline constexpr float kRescaleSlack = 8.0f;  // lazy rescale: P may grow to 2^8 before the max is moved
inline constexpr float kLog2e = 1.4426950408889634f;

// Block-table entries a CTA stages (caps split_tokens at (kMaxPages - 2) * block_size).
constexpr int kMaxPages = 2048;
// Splits one merge CTA handles (one thread per split).
constexpr int kMaxSplits = 256;
constexpr int kMergeThreads = kMaxSplits;

inline int pages_bytes(const AttentionPlan& plan, int block_size) {
  const int pages = std::min(kMaxPages, plan.split_tokens / block_size + 2);
  return (pages * 4 + 15) / 16 * 16;
}

// Defined per cache format in paged_attention_<format>.cu.
template <CacheKind C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, SplitWorkspace ws, cudaStream_t stream);
// Raises the kernel's dynamic shared-memory limit (once) and returns its resident CTAs per SM (0 on error).
template <CacheKind C>
int prepare(int head_size);

}  // namespace fp8kv::cuda::attention

namespace fp8kv::cuda::prefill {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kWarpRows = 16;               // query rows per warp: the mma's M
constexpr int kRows = kWarpRows * kWarps;  // query rows per CTA
constexpr int kSplitAlign = 64;     // split_tokens is a multiple of every head size's key tile
// Two stagings of the same kernel. Shallow (2 stages, 3 CTAs per SM where registers allow) keeps
// the tensor cores busy when CTAs have many rows (prefill); deep (4 stages, 3 tiles in flight,
// 2 CTAs per SM) keeps enough bytes in flight when they have few (verification, decode rows), as
// the kernel is then bound by memory.
constexpr int kShallowStages = 2;
constexpr int kDeepStages = 4;
constexpr int min_ctas_per_sm(int head_size, int stages) { return head_size <= 128 && stages == kShallowStages ? 3 : 2; }
// Deep staging when the average sequence's query rows fit one warp (decided from host shapes).
inline bool use_deep_staging(int64_t num_query_tokens, int group, int num_seqs) {
  return num_query_tokens * group <= kWarpRows * static_cast<int64_t>(num_seqs);
}

// How a CTA's rows map to (query token, query head): the heads of one KV head's group vary
// fastest, so every K/V tile read from the cache serves all of them.
struct RowMap {
  int heads_per_tile;   // min(group, kRows)
  int head_chunks;      // ceil(group / heads_per_tile)
  int tokens_per_tile;  // kRows / heads_per_tile

  __host__ __device__ static RowMap make(int group) {
    RowMap m;
    m.heads_per_tile = group < kRows ? group : kRows;
    m.head_chunks = (group + m.heads_per_tile - 1) / m.heads_per_tile;
    m.tokens_per_tile = kRows / m.heads_per_tile;
    return m;
  }
};

// Defined per cache format in paged_attention_<format>.cu (prefill_attention_kernel.cuh).
template <CacheKind C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, SplitWorkspace ws, cudaStream_t stream);
template <CacheKind C>
int prepare(int head_size, bool deep_staging);

}  // namespace fp8kv::cuda::prefill
