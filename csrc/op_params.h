// Validation of the ops' tensor arguments, shared by every backend's bindings: `*_params` check
// everything that can be checked without reading tensor data (dtypes, ranks, shapes, devices,
// strides) and describe the operands for the kernels. The checks that read index tensors are in
// index_checks.h.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "kernel_params.h"

namespace fp8kv {

CacheWriteParams cache_write_params(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                                    const at::Tensor& k_scale, const at::Tensor& v_scale, bool hadamard,
                                    const std::optional<at::Tensor>& k_offset);

PagedAttentionOperands paged_attention_params(const at::Tensor& out, const at::Tensor& query,
                                              const at::Tensor& key_cache, const at::Tensor& value_cache,
                                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                              const std::optional<at::Tensor>& cu_seqlens_q, double softmax_scale,
                                              const at::Tensor& k_scale, const at::Tensor& v_scale,
                                              int64_t sliding_window, double logits_soft_cap, bool hadamard,
                                              const std::optional<at::Tensor>& k_offset, bool fp8_math,
                                              const std::optional<at::Tensor>& lse);

MergeStatesParams merge_states_params(const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                      const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                      const at::Tensor& lse_b);

AmaxParams amax_params(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_amax,
                       const at::Tensor& v_amax);

}  // namespace fp8kv
