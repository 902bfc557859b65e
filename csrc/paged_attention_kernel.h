// The paged_attention kernel every backend registers (csrc/cpu/bindings.cpp, csrc/gpu/bindings.cpp):
// the schema's arguments validated (op_params.h), then the backend's `Run`, which checks the call's
// plan, its index tensors where it reads them, and launches. One signature for every backend,
// checked against the schema by tests/ops/test_op_declarations.py.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>

#include "op_params.h"

namespace fp8kv {

// What a backend's run reads besides the validated operands (whose params hold the window and
// fp8_math, and whose lse view is set when the call writes the log-sum-exp).
struct PagedAttentionCall {
  const at::Tensor& query;
  const at::Tensor& key_cache;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  const std::optional<at::Tensor>& cu_seqlens_q;
  at::OptionalIntArrayRef plan;
  const std::optional<at::Tensor>& workspace;
};

template <void (*Run)(const PagedAttentionOperands&, const PagedAttentionCall&)>
void paged_attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const std::optional<at::Tensor>& cu_seqlens_q, double softmax_scale,
                            const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t sliding_window,
                            double logits_soft_cap, bool hadamard, const std::optional<at::Tensor>& k_offset,
                            bool fp8_math, const std::optional<at::Tensor>& lse, at::OptionalIntArrayRef plan,
                            const std::optional<at::Tensor>& workspace) {
  const PagedAttentionOperands operands = paged_attention_params(
      out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale, k_scale, v_scale,
      sliding_window, logits_soft_cap, hadamard, k_offset, fp8_math, lse);
  Run(operands, PagedAttentionCall{query, key_cache, block_tables, seq_lens, cu_seqlens_q, plan, workspace});
}

}  // namespace fp8kv
