// Framework-free descriptions of each op's operands: raw pointers, element types and strides
// (in elements). The op bindings build these from validated tensors; every backend's kernels
// consume them, so a kernel never sees a torch type.
#pragma once

#include <cstdint>

namespace fp8kv {

enum class DType : int {
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat8E4M3FN,
  kFloat8E5M2,
  kFloat8E4M3FNUZ,
};

inline bool is_fp8(DType t) {
  return t == DType::kFloat8E4M3FN || t == DType::kFloat8E5M2 || t == DType::kFloat8E4M3FNUZ;
}

inline int dtype_bytes(DType t) { return t == DType::kFloat32 ? 4 : is_fp8(t) ? 1 : 2; }

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
};

struct CacheWriteParams {
  const void* key;
  const void* value;
  DType src_dtype;
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
  CacheView key_cache, value_cache;
  DType cache_dtype;
  const int64_t* slot_mapping;
  int64_t num_slots;  // tokens to write: slot_mapping's length
  HeadScalars k_scale, v_scale;
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
};

struct AmaxParams {
  const void* key;
  const void* value;
  DType src_dtype;
  int64_t key_token_stride, key_head_stride;
  int64_t value_token_stride, value_head_stride;
  int64_t num_tokens;
  int num_kv_heads, head_size;
  HeadScalars k_amax, v_amax;
};

}  // namespace fp8kv
