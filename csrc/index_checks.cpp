// The index checks (index_checks.h), and the ops that run them for any device: callers whose index
// tensors live on a GPU use those to check slots, block ids and lengths before a run (each copies its
// tensors to the host).
#include "index_checks.h"

#include <cstdlib>
#include <string>

#include <c10/util/Exception.h>
#include <torch/library.h>

#include "kernel_params.h"

namespace fp8kv {

void check_slot_mapping_indices(const at::Tensor& slot_mapping_any_device, int64_t num_slots_in_cache) {
  const at::Tensor slot_mapping = slot_mapping_any_device.cpu();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < slot_mapping.size(0); ++i) {
    TORCH_CHECK(slots[i] < num_slots_in_cache, "fp8kv.reshape_and_cache: `slot_mapping`[", i, "] = ", slots[i],
                " is outside the cache, which has num_blocks * block_size = ", num_slots_in_cache, " slots");
  }
}

void check_paged_attention_indices(const at::Tensor& block_tables_any_device, const at::Tensor& seq_lens_any_device,
                                   const std::optional<at::Tensor>& cu_seqlens_q_any_device, int64_t num_query_tokens,
                                   int64_t block_size, int64_t num_blocks, int64_t sliding_window) {
  constexpr const char* op = "fp8kv.paged_attention";
  const at::Tensor block_tables = block_tables_any_device.cpu();
  const at::Tensor seq_lens = seq_lens_any_device.cpu();
  at::Tensor cu_seqlens_q;
  if (cu_seqlens_q_any_device.has_value()) cu_seqlens_q = cu_seqlens_q_any_device->cpu();
  const int64_t num_seqs = block_tables.size(0);
  const int64_t capacity = block_tables.size(1) * block_size;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.defined() ? cu_seqlens_q.data_ptr<int32_t>() : nullptr;
  if (cu != nullptr) {
    TORCH_CHECK(cu[0] == 0, op, ": `cu_seqlens_q`[0] must be 0, got ", cu[0]);
    TORCH_CHECK(cu[num_seqs] == num_query_tokens, op, ": `cu_seqlens_q`[-1] must equal the number of query rows ",
                num_query_tokens, ", got ", cu[num_seqs]);
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t seq_len = lens[s];
    const int64_t q_len = cu != nullptr ? cu[s + 1] - cu[s] : 1;
    TORCH_CHECK(q_len >= 0, op, ": `cu_seqlens_q` must be non-decreasing, got cu_seqlens_q[", s, "] = ", cu[s],
                " > cu_seqlens_q[", s + 1, "] = ", cu[s + 1]);
    TORCH_CHECK(seq_len >= 0 && seq_len <= capacity, op, ": `seq_lens`[", s, "] = ", seq_len,
                " must be in [0, max_blocks_per_seq * block_size = ", capacity, "]");
    // A decode row with seq_len 0 is padding (output 0); a query row must otherwise see its own token.
    TORCH_CHECK(seq_len >= q_len || (cu == nullptr && seq_len == 0), op, ": sequence ", s, " has ", q_len,
                " query rows but `seq_lens`[", s, "] = ", seq_len, " cached tokens; the queried tokens must be cached");
    if (seq_len == 0) continue;
    // The first query row sees the earliest keys; the blocks from there to the last cached token are read.
    const int64_t first_position = visible_keys<int64_t>(seq_len, q_len, 0, sliding_window).begin;
    const int32_t* row = block_tables.data_ptr<int32_t>() + s * block_tables.stride(0);
    for (int64_t b = first_position / block_size; b <= (seq_len - 1) / block_size; ++b) {
      TORCH_CHECK(row[b] >= 0 && row[b] < num_blocks, op, ": `block_tables`[", s, ", ", b, "] = ", row[b],
                  " must be a block id in [0, num_blocks = ", num_blocks, ")");
    }
  }
}

bool debug_checks_enabled() {
  const char* value = std::getenv("FP8KV_DEBUG_CHECKS");
  return value != nullptr && std::string(value) != "0" && value[0] != '\0';
}

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
