// Framework-free descriptions of each op's operands: raw pointers, element types and strides
// (in elements). The op bindings build these from validated tensors; every backend's kernels
// consume them, so a kernel never sees a torch type.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dispatch.h"

namespace fp8kv {

// One K or V cache: logical [num_blocks, block_size, num_kv_heads, head_size], last dim contiguous.
struct CacheView {
  void* data;
  int64_t block_stride;
  int64_t token_stride;
  int64_t head_stride;
};

// Per-tensor ([1]) or per-KV-head ([num_kv_heads]) float32 scales or maxima, on the op's device.
struct HeadScalars {
  float* data;
  bool per_head;

  FP8KV_HOST_DEVICE float* at(int kv_head) const { return data + (per_head ? kv_head : 0); }
};

// key and value: [num_tokens, num_kv_heads, head_size], last dim contiguous, same dtype.
struct KeyValueInput {
  const void* key;
  const void* value;
  DType src_dtype;
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
};

// The rotated recipe's transform of an FP8 cache (docs/rotated_cache.md); the plain recipe has
// neither part. K is stored as (rotated K) - k_offset, V as rotated V.
struct CacheTransform {
  bool hadamard;          // rotate by the block Hadamard matrix of hadamard.h
  const float* k_offset;  // nullptr, or [num_kv_heads][head_size] contiguous, in the stored basis

  FP8KV_HOST_DEVICE bool any() const { return hadamard || k_offset != nullptr; }
};

struct CacheWriteParams : KeyValueInput {
  CacheView key_cache, value_cache;
  DType cache_dtype;
  const int64_t* slot_mapping;
  int64_t num_slots;  // tokens to write: slot_mapping's length
  HeadScalars k_scale, v_scale;
  CacheTransform transform;
  int num_kv_heads, head_size, block_size, num_blocks;
};

struct PagedAttentionParams {
  void* out;
  int64_t out_token_stride, out_head_stride;
  const void* query;
  int64_t query_token_stride, query_head_stride;
  DType query_dtype;  // also the output's
  CacheView key_cache, value_cache;
  DType cache_dtype;
  const int32_t* block_tables;
  int64_t block_table_stride;
  int max_blocks_per_seq;
  const int32_t* seq_lens;
  const int32_t* cu_seqlens_q;  // nullptr: decode, one query row per sequence
  int num_seqs;
  int64_t num_query_tokens;
  int num_heads, num_kv_heads, head_size, block_size, num_blocks;
  float softmax_scale;
  HeadScalars k_scale, v_scale;
  int sliding_window;     // <= 0: none
  float logits_soft_cap;  // <= 0: none
  CacheTransform transform;
  bool fp8_math;  // multi-token queries in FP8 tensor-core math (e4m3fn / e5m2 caches), where a backend has it
};

// The cache positions [begin, end) that query token `token` of a sequence's q_len query tokens sees,
// when the sequence has seq_len cached tokens (its query tokens last): causal, so up to its own
// position seq_len - q_len + token, and within the sliding window (<= 0: none). Int is the caller's
// index type (int32 in the kernels, int64 where seq_len is unchecked).
template <typename Int>
struct KeyRange {
  Int begin, end;
};

template <typename Int>
FP8KV_HOST_DEVICE KeyRange<Int> visible_keys(Int seq_len, Int q_len, Int token, Int sliding_window) {
  // `end` is recomputed inside the window's branch: computed once up front, it lets the compiler turn
  // the branch into selects, which shifts the multi-token kernel's register allocation.
  const auto end = [&] { return seq_len - q_len + token + 1; };
  return {sliding_window > 0 ? std::max(Int{0}, end() - sliding_window) : Int{0}, end()};
}

// Per-(token, head) rows of a [num_tokens, num_heads, ...] tensor: an attention output (its rows
// [head_size], last dim contiguous) or a log-sum-exp (float32 [num_tokens, num_heads]). Strides in
// elements.
struct RowsView {
  void* data;  // nullptr: an optional output not requested
  int64_t token_stride, head_stride;

  FP8KV_HOST_DEVICE int64_t offset(int64_t token, int head) const {
    return token * token_stride + static_cast<int64_t>(head) * head_stride;
  }
};

// paged_attention's log-sum-exp output beside its kernels' operands: kept out of
// PagedAttentionParams, which every attention kernel takes by value, so that their code does not
// change with it. Natural log of each row's softmax denominator over its logits (docs/ops.md).
struct PagedAttentionOperands {
  PagedAttentionParams params;
  RowsView lse;  // float32 [num_query_tokens, num_heads]; data nullptr: not requested
};

// merge_attention_states: two attention states (out_a, lse_a), (out_b, lse_b) of the same query rows
// over disjoint key sets combined into (out, lse); every out* of `dtype`, every lse* float32.
struct MergeStatesParams {
  RowsView out, lse;  // lse.data nullptr: not requested
  RowsView out_a, lse_a, out_b, lse_b;
  DType dtype;
  int64_t num_tokens;
  int num_heads, head_size;
};

struct AmaxParams : KeyValueInput {
  int64_t num_tokens;
  int num_kv_heads, head_size;
  HeadScalars k_amax, v_amax;
};

}  // namespace fp8kv
