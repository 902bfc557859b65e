// Validation of the ops' tensor arguments, shared by every backend's bindings: `*_params` check
// everything that can be checked without reading tensor data (dtypes, ranks, shapes, devices,
// strides) and describe the operands for the kernels. The checks that read index tensors are in
// index_checks.h.
#pragma once

#include <optional>
#include <vector>

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

// The sizes fp8kv.plan_paged_attention plans from, checked as paged_attention checks them: the
// cache's geometry and dtype, the block table's shape, decode (no cu_seqlens_q) or multi-token, the
// query rows and heads, the window, fp8_math. The operands' data pointers are left unset.
PagedAttentionParams plan_params(const at::Tensor& key_cache, const at::Tensor& block_tables,
                                 const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_query_tokens,
                                 int64_t num_heads, int64_t sliding_window, bool fp8_math);

// A planned call's `plan` against the values this call's sizes plan to (the backend's plan_values):
// equal, or an error saying the plan was made for another call.
void check_plan(const char* op, c10::IntArrayRef plan, const std::vector<int64_t>& expected);

// A planned call's `workspace`: contiguous, on `reference`'s device, at least `bytes` bytes. Its data.
void* checked_workspace(const char* op, const at::Tensor& workspace, int64_t bytes, const at::Tensor& reference);

MergeStatesParams merge_states_params(const at::Tensor& out, const std::optional<at::Tensor>& lse,
                                      const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                                      const at::Tensor& lse_b);

AmaxParams amax_params(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_amax,
                       const at::Tensor& v_amax);

}  // namespace fp8kv
