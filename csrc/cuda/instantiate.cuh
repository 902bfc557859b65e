// Explicit instantiation of the attention kernels' entry points (launch.h) for one cache dtype: each
// paged_attention_<format>.cu is one line of it, so the formats build in parallel.
#pragma once

#include "decode.cuh"
#include "multi_token_sm80.cuh"
#include "multi_token_sm90a.cuh"

#define FP8KV_INSTANTIATE_ATTENTION(CACHE)                                                                        \
  namespace fp8kv::cuda {                                                                                         \
  template cudaError_t decode::launch<CACHE>(const PagedAttentionParams&, const AttentionPlan&,                   \
                                             const SplitWorkspace&, int*, cudaStream_t);                          \
  template int decode::occupancy<CACHE>(const AttentionPlan&, int, int);                                          \
  template cudaError_t multi_token::sm80::launch<CACHE>(const PagedAttentionParams&, const AttentionPlan&,        \
                                                        const SplitWorkspace&, cudaStream_t);                     \
  template int multi_token::sm80::occupancy<CACHE>(int, bool);                                                    \
  template cudaError_t multi_token::sm90a::launch<CACHE>(const PagedAttentionParams&, const AttentionPlan&,       \
                                                         const SplitWorkspace&, cudaStream_t);                    \
  template int multi_token::sm90a::occupancy<CACHE>(int, bool);                                                         \
  }
