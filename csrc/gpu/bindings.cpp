// GPU registrations, for whichever GPU backend the library is built with (kernels.h): CUDA, or HIP
// (ROCm builds of PyTorch call their GPUs "cuda" devices, so both register under the CUDA dispatch key).
//
// Validate (op_params.h), refuse what the backend's kernels do not support, check index tensors in
// debug-check mode only (that copies them to the host and synchronizes), then launch on the current
// stream of the operands' device, with the workspace from PyTorch's caching allocator (stream-ordered,
// capturable in graphs). Only c10's device-generic API is used, so this file compiles against the
// headers of any torch build.
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <vector>

#include "../index_checks.h"
#include "../op_params.h"
#include "../paged_attention_kernel.h"
#include "kernels.h"

namespace fp8kv {
namespace {

gpu::Stream current_stream(const at::Device& device) {
  return static_cast<gpu::Stream>(
      c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle());
}

void check_launch(const char* op, gpu::Status status) {
  TORCH_CHECK(status == gpu::kSuccess, op, ": ", gpu::kBackend, " kernel launch failed: ", gpu::status_string(status));
}

void reshape_and_cache_gpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                           const at::Tensor& v_scale, bool hadamard, const std::optional<at::Tensor>& k_offset) {
  const CacheWriteParams p =
      cache_write_params(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, hadamard, k_offset);
  if (debug_checks_enabled()) check_slot_mapping_indices(slot_mapping, key_cache.size(0) * key_cache.size(1));
  const c10::DeviceGuard guard(key.device());
  check_launch("fp8kv.reshape_and_cache", gpu::reshape_and_cache(p, current_stream(key.device())));
}

// The request a planned call's `plan` carries (its second value), -1 where it carries none.
int planned_request(at::OptionalIntArrayRef plan) {
  if (!plan.has_value()) return 0;
  if (plan->size() < 2 || (*plan)[1] < 0 || (*plan)[1] > std::numeric_limits<int>::max()) return -1;
  return static_cast<int>((*plan)[1]);
}

std::vector<int64_t> plan_paged_attention_gpu(const at::Tensor& key_cache, const at::Tensor& block_tables,
                                              const std::optional<at::Tensor>& cu_seqlens_q, int64_t num_query_tokens,
                                              int64_t num_heads, int64_t sliding_window, bool fp8_math, bool lse,
                                              c10::string_view kernel) {
  constexpr const char* op = "fp8kv.plan_paged_attention";
  const PagedAttentionParams p =
      plan_params(key_cache, block_tables, cu_seqlens_q, num_query_tokens, num_heads, sliding_window, fp8_math);
  int request = 0;
  const std::string unknown = gpu::kernel_request(std::string(kernel), &request);
  TORCH_CHECK(unknown.empty(), op, ": ", unknown);
  const std::string unsupported = gpu::plan_unsupported(p, request);
  TORCH_CHECK(unsupported.empty(), op, ": on ", gpu::kBackend, ", ", unsupported);
  const c10::DeviceGuard guard(key_cache.device());
  gpu::AttentionPlan plan{};
  check_launch(op, gpu::plan_paged_attention(p, lse, request, &plan));
  return gpu::plan_values(plan);
}

void run_paged_attention(const PagedAttentionOperands& operands, const PagedAttentionCall& call) {
  constexpr const char* op = "fp8kv.paged_attention";
  const PagedAttentionParams& p = operands.params;
  const int request = planned_request(call.plan);
  TORCH_CHECK(request >= 0, op, ": `plan` must be fp8kv.plan_paged_attention's answer, got ", *call.plan);
  const std::string unsupported = gpu::paged_attention_unsupported(p, request);
  TORCH_CHECK(unsupported.empty(), op, ": on ", gpu::kBackend, ", ", unsupported);
  if (debug_checks_enabled()) {
    check_paged_attention_indices(call.block_tables, call.seq_lens, call.cu_seqlens_q, call.query.size(0),
                                  call.key_cache.size(1), call.key_cache.size(0), p.sliding_window);
  }
  const c10::DeviceGuard guard(call.query.device());
  // A given plan is checked against this call's own (host arithmetic on cached device facts): a plan
  // made for other sizes would size the grid and the workspace wrongly.
  gpu::AttentionPlan planned{};
  check_launch(op, gpu::plan_paged_attention(p, operands.lse.data != nullptr, request, &planned));
  if (call.plan.has_value()) check_plan(op, *call.plan, gpu::plan_values(planned));
  at::Tensor allocated;
  void* workspace = nullptr;
  if (call.workspace.has_value()) {
    workspace = checked_workspace(op, *call.workspace, planned.workspace_bytes, call.query);
  } else {
    allocated = at::empty({planned.workspace_bytes}, call.query.options().dtype(at::kByte));
    workspace = allocated.data_ptr();
  }
  check_launch(op, gpu::paged_attention(p, operands.lse, planned, workspace, current_stream(call.query.device())));
}

void merge_attention_states_gpu(at::Tensor& out, const std::optional<at::Tensor>& lse, const at::Tensor& out_a,
                                const at::Tensor& lse_a, const at::Tensor& out_b, const at::Tensor& lse_b) {
  const MergeStatesParams p = merge_states_params(out, lse, out_a, lse_a, out_b, lse_b);
  const c10::DeviceGuard guard(out_a.device());
  check_launch("fp8kv.merge_attention_states", gpu::merge_attention_states(p, current_stream(out_a.device())));
}

void kv_amax_gpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_amax, at::Tensor& v_amax) {
  const AmaxParams p = amax_params(key, value, k_amax, v_amax);
  const c10::DeviceGuard guard(key.device());
  check_launch("fp8kv.kv_amax", gpu::kv_amax(p, current_stream(key.device())));
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8kv, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_gpu);
  m.impl("paged_attention", &paged_attention_kernel<run_paged_attention>);
  m.impl("plan_paged_attention", &plan_paged_attention_gpu);
  m.impl("kv_amax", &kv_amax_gpu);
  m.impl("merge_attention_states", &merge_attention_states_gpu);
}

}  // namespace fp8kv
