// The index-check ops, for any device: callers whose index tensors live on a GPU use them to check
// slots, block ids and lengths before a run (each copies its tensors to the host).
#include <torch/library.h>

#include "op_params.h"

namespace fp8kv {
namespace {

void check_cache_write_indices_op(const at::Tensor& slot_mapping, const at::Tensor& key_cache) {
  constexpr const char* op = "fp8kv.check_cache_write_indices";
  TORCH_CHECK(slot_mapping.scalar_type() == c10::ScalarType::Long && slot_mapping.dim() == 1, op,
              ": `slot_mapping` must be int64 of rank 1, got ", slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  TORCH_CHECK(key_cache.dim() == 4, op, ": `key_cache` must have rank 4 [num_blocks, block_size, num_kv_heads, ",
              "head_size], got shape ", key_cache.sizes());
  check_slot_mapping_indices(slot_mapping, key_cache.size(0) * key_cache.size(1));
}

void check_paged_attention_indices_op(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                      const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_query_tokens,
                                      const at::Tensor& key_cache, int64_t sliding_window) {
  constexpr const char* op = "fp8kv.check_paged_attention_indices";
  TORCH_CHECK(block_tables.scalar_type() == c10::ScalarType::Int && block_tables.dim() == 2, op,
              ": `block_tables` must be int32 of rank 2, got ", block_tables.scalar_type(), " ", block_tables.sizes());
  TORCH_CHECK(seq_lens.scalar_type() == c10::ScalarType::Int && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == block_tables.size(0),
              op, ": `seq_lens` must be int32 [num_seqs = ", block_tables.size(0), "], got ", seq_lens.scalar_type(),
              " ", seq_lens.sizes());
  if (cu_seqlens_q.has_value()) {
    TORCH_CHECK(cu_seqlens_q->scalar_type() == c10::ScalarType::Int && cu_seqlens_q->dim() == 1 &&
                    cu_seqlens_q->size(0) == block_tables.size(0) + 1,
                op, ": `cu_seqlens_q` must be int32 [num_seqs + 1 = ", block_tables.size(0) + 1, "], got ",
                cu_seqlens_q->scalar_type(), " ", cu_seqlens_q->sizes());
  }
  TORCH_CHECK(key_cache.dim() == 4, op, ": `key_cache` must have rank 4 [num_blocks, block_size, num_kv_heads, ",
              "head_size], got shape ", key_cache.sizes());
  TORCH_CHECK(num_query_tokens >= 0, op, ": `num_query_tokens` must be >= 0, got ", num_query_tokens);
  TORCH_CHECK(cu_seqlens_q.has_value() || num_query_tokens == block_tables.size(0), op,
              ": without `cu_seqlens_q` (decode) `num_query_tokens` must equal num_seqs = ", block_tables.size(0),
              ", got ", num_query_tokens);
  check_paged_attention_indices(block_tables, seq_lens, cu_seqlens_q, num_query_tokens, key_cache.size(1),
                                key_cache.size(0), sliding_window);
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8kv, CompositeExplicitAutograd, m) {
  m.impl("check_cache_write_indices", &check_cache_write_indices_op);
  m.impl("check_paged_attention_indices", &check_paged_attention_indices_op);
}

}  // namespace fp8kv
