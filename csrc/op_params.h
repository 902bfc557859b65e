// Validation of the ops' tensor arguments, shared by every backend's bindings.
//
// `*_params` check everything that can be checked without reading tensor data (dtypes, ranks, shapes,
// devices, strides) and describe the operands for the kernels. `check_*_indices` read index tensors
// (device tensors are copied to the host): the CPU backend always calls them; device backends call them
// only in debug-check mode, since reading device data would synchronize with the host.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "kernel_params.h"

namespace fp8kv {

CacheWriteParams cache_write_params(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                    const at::Tensor& k_scale, const at::Tensor& v_scale, bool hadamard,
                                    const std::optional<at::Tensor>& k_offset);

PagedAttentionParams paged_attention_params(const at::Tensor& out, const at::Tensor& query,
                                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                            const std::optional<at::Tensor>& cu_seqlens_q, double softmax_scale,
                                            const at::Tensor& k_scale, const at::Tensor& v_scale,
                                            int64_t sliding_window, double logits_soft_cap, bool hadamard,
                                            const std::optional<at::Tensor>& k_offset);

AmaxParams amax_params(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_amax,
                       const at::Tensor& v_amax);

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
