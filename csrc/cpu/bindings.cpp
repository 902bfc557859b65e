// CPU registrations: validate, check index tensors (already on the host), run the kernel.
#include <torch/library.h>

#include <string>
#include <vector>

#include "../index_checks.h"
#include "../op_params.h"
#include "../paged_attention_kernel.h"
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

void run_paged_attention(const PagedAttentionOperands& operands, const PagedAttentionCall& call) {
  constexpr const char* op = "fp8kv.paged_attention";
  refuse_fp8_math(op, operands.params.fp8_math);
  if (call.plan.has_value()) check_plan(op, *call.plan, kCpuPlan);
  if (call.workspace.has_value()) checked_workspace(op, *call.workspace, 0, call.query);
  check_paged_attention_indices(call.block_tables, call.seq_lens, call.cu_seqlens_q, call.query.size(0),
                                call.key_cache.size(1), call.key_cache.size(0), operands.params.sliding_window);
  cpu::paged_attention(operands.params, operands.lse);
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
  m.impl("paged_attention", &paged_attention_kernel<run_paged_attention>);
  m.impl("plan_paged_attention", &plan_paged_attention_cpu);
  m.impl("kv_amax", &kv_amax_cpu);
  m.impl("merge_attention_states", &merge_attention_states_cpu);
}

}  // namespace fp8kv
