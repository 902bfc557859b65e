// Host entry points of the CUDA kernels: plain C++ (no torch), called by csrc/cuda/bindings.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../kernel_params.h"

namespace fp8kv::cuda {

// How paged attention splits its work; computed on the host from shapes only (no sync).
struct AttentionPlan {
  int64_t row_chunks;  // grid.x: decode: sequences x query-head chunks; multi-token: query tiles (a bound)
  int num_splits;      // grid.y: context splits (flash-decoding); 1 writes `out` directly
  int split_tokens;    // context positions per split, a multiple of the tile group
  bool deep_staging;   // multi-token kernel: prefill::kDeepStages (see paged_attention_config.h)
};

// Per-split partial results, fp32, allocated by the caller when num_splits > 1.
struct SplitWorkspace {
  float* acc;      // [num_splits][rows][head_size], already multiplied by v_scale
  float* row_max;  // [num_splits][rows], log2 domain
  float* row_sum;  // [num_splits][rows]; 0 marks a split without keys for the row
  int64_t rows;    // num_query_tokens * num_heads
  int num_splits;
};

bool paged_attention_supports_head_size(int head_size);
// Longest block-table capacity (max_blocks_per_seq * block_size) the kernels accept.
int64_t paged_attention_max_context(int block_size);
// Chooses the split count from shapes and occupancy (also prepares the kernel's launch attributes).
cudaError_t plan_paged_attention(const PagedAttentionParams& p, int num_sms, AttentionPlan& plan);
cudaError_t launch_paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, SplitWorkspace ws,
                                   cudaStream_t stream);

cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream);
cudaError_t launch_kv_amax(const AmaxParams& p, cudaStream_t stream);

}  // namespace fp8kv::cuda
