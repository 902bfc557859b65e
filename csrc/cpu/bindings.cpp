// CPU registrations: validate, check index tensors (already on the host), run the kernel.
#include <torch/library.h>

#include <string>
#include <vector>

#include "../index_checks.h"
#include "../op_params.h"
#include "kernels.h"

namespace fp8kv {
namespace {

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                           const at::Tensor& v_scale, bool hadamard, const std::optional<at::Tensor>& k_offset) {
  const CacheWriteParams p =
      cache_write_params(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, hadamard, k_offset);
  check_slot_mapping_indices(slot_mapping, key_cache.size(0) * key_cache.size(1));
  cpu::reshape_and_cache(p);
}

// The CPU kernel plans its own work per call: every plan is [workspace_bytes 0, request 0 ("auto"),
// kernel 0 (the CPU kernel), num_splits 1 (no context splits)].
const std::vector<int64_t> kCpuPlan = {0, 0, 0, 1};

void refuse_fp8_math(const char* op, bool fp8_math) {
  TORCH_CHECK(!fp8_math, op, ": `fp8_math` needs the CUDA kernels on a compute capability ", kCudaSm90aCapability[0],
              ".", kCudaSm90aCapability[1], " GPU; the CPU kernels compute in fp32");
}

std::vector<int64_t> plan_paged_attention_cpu(const at::Tensor& key_cache, const at::Tensor& block_tables,
                                              const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_query_tokens,
                                              int64_t num_heads, int64_t sliding_window, bool fp8_math, bool lse,
                                              c10::string_view kernel) {
  // `lse` changes nothing here: the CPU kernel writes the log-sum-exp without splitting the keys.
  constexpr const char* op = "fp8kv.plan_paged_attention";
  plan_params(key_cache, block_tables, cu_seqlens_q, num_query_tokens, num_heads, sliding_window, fp8_math);
  refuse_fp8_math(op, fp8_math);
  TORCH_CHECK(kernel.empty() || kernel == "auto", op, ": `kernel` must be \"auto\" on the CPU (one kernel runs every ",
              "call), got \"", std::string(kernel), "\"");
  return kCpuPlan;
}

void paged_attention_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const std::optional<at::Tensor>& cu_seqlens_q, double softmax_scale,
                         const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t sliding_window,
                         double logits_soft_cap, bool hadamard, const std::optional<at::Tensor>& k_offset,
                         bool fp8_math, const std::optional<at::Tensor>& lse, at::OptionalIntArrayRef plan,
                         const std::optional<at::Tensor>& workspace) {
  constexpr const char* op = "fp8kv.paged_attention";
  const PagedAttentionOperands p = paged_attention_params(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                          cu_seqlens_q, softmax_scale, k_scale, v_scale, sliding_window,
                                                          logits_soft_cap, hadamard, k_offset, fp8_math, lse);
  refuse_fp8_math(op, fp8_math);
  if (plan.has_value()) check_plan(op, *plan, kCpuPlan);
  if (workspace.has_value()) checked_workspace(op, *workspace, 0, query);
  check_paged_attention_indices(block_tables, seq_lens, cu_seqlens_q, query.size(0), key_cache.size(1),
                                key_cache.size(0), sliding_window);
  cpu::paged_attention(p.params, p.lse);
}

void merge_attention_states_cpu(at::Tensor& out, const std::optional<at::Tensor>& lse, const at::Tensor& out_a,
                                const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b) {
  cpu::merge_attention_states(merge_states_params(out, lse, out_a, lse_a, out_b, lse_b));
}

void kv_amax_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_amax, at::Tensor& v_amax) {
  cpu::kv_amax(amax_params(key, value, k_amax, v_amax));
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8kv, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("plan_paged_attention", &plan_paged_attention_cpu);
  m.impl("kv_amax", &kv_amax_cpu);
  m.impl("merge_attention_states", &merge_attention_states_cpu);
}

}  // namespace fp8kv
