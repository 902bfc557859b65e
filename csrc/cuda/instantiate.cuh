// Explicit instantiation of the decode and multi-token kernels' launchers for one cache dtype: each
// paged_attention_<format>.cu is one line of it, so the formats build in parallel.
#pragma once

#include "decode.cuh"
#include "prefill_hopper.cuh"

#define FP8KV_INSTANTIATE_ATTENTION(CACHE)                                                                        \
  namespace fp8kv::cuda {                                                                                         \
  template cudaError_t decode::launch<CACHE>(const PagedAttentionParams&, const AttentionPlan&,                   \
                                             const SplitWorkspace&, int*, cudaStream_t);                          \
  template int decode::resident_ctas<CACHE>(const AttentionPlan&, int, int);                                      \
  template cudaError_t prefill::launch<CACHE>(const PagedAttentionParams&, const AttentionPlan&,                  \
                                              const SplitWorkspace&, cudaStream_t);                               \
  template int prefill::resident_ctas<CACHE>(const AttentionPlan&, int);                                          \
  }
