// The checks that read index tensors (device tensors are copied to the host, which synchronizes): the
// CPU backend always runs them; device backends run them in debug-check mode only, and the
// check_*_indices ops (index_checks.cpp) run them on request.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

namespace fp8kv {

// slot_mapping: every slot is negative (skipped) or below num_blocks * block_size.
void check_slot_mapping_indices(const at::Tensor& slot_mapping, int64_t num_slots_in_cache);

// block_tables, seq_lens, cu_seqlens_q: query rows partition num_query_tokens, each sequence
// has at least as many cached tokens as query rows and fits its table row, and every table entry that
// will be read names a block in [0, num_blocks).
void check_paged_attention_indices(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_query_tokens,
                                   int64_t block_size, int64_t num_blocks, int64_t sliding_window);

// FP8KV_DEBUG_CHECKS=1 in the environment: device backends copy index tensors to the host and run the
// checks above (synchronizes; not for CUDA graph capture).
bool debug_checks_enabled();

}  // namespace fp8kv
