// The GPU kernels' launchers: one contract, defined by whichever GPU backend the library is built
// with (csrc/cuda, or csrc/hip for ROCm), called by csrc/gpu/bindings.cpp. Framework-free: the
// launchers take validated operand descriptions (kernel_params.h, built by op_params.h) and a stream,
// enqueue their kernels, never synchronize with the host and never allocate; they return the
// launch status.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

#include "../kernel_params.h"

// The runtime API of the backend (hipFoo or cudaFoo), and its AttentionPlan.
#if defined(FP8KV_WITH_HIP) || defined(__HIPCC__)
#include <hip/hip_runtime_api.h>

#include "../hip/attention_plan.h"
#define FP8KV_GPU_API(name) hip##name
#define FP8KV_GPU_BACKEND "HIP"
namespace fp8kv::gpu {
using AttentionPlan = hip::AttentionPlan;
}
#else
#include <cuda_runtime_api.h>

#include "../cuda/attention_plan.h"
#define FP8KV_GPU_API(name) cuda##name
#define FP8KV_GPU_BACKEND "CUDA"
namespace fp8kv::gpu {
using AttentionPlan = cuda::AttentionPlan;
}
#endif

namespace fp8kv::gpu {

using Status = FP8KV_GPU_API(Error_t);
using Stream = FP8KV_GPU_API(Stream_t);
inline constexpr Status kSuccess = FP8KV_GPU_API(Success);
inline constexpr const char* kBackend = FP8KV_GPU_BACKEND;
inline const char* status_string(Status status) { return FP8KV_GPU_API(GetErrorString)(status); }

Status reshape_and_cache(const CacheWriteParams& p, Stream stream);

Status kv_amax(const AmaxParams& p, Stream stream);

// The multi-token attention kernel a user names with FP8KV_MULTI_TOKEN_KERNEL (read at every call):
// nullptr when the variable is unset, empty or "auto" (the backend chooses). The names are each
// backend's own; its paged_attention_unsupported refuses a name it does not have.
inline constexpr const char* kMultiTokenKernelVariable = "FP8KV_MULTI_TOKEN_KERNEL";

inline const char* requested_multi_token_kernel() {
  const char* name = std::getenv(kMultiTokenKernelVariable);
  return name == nullptr || std::strcmp(name, "") == 0 || std::strcmp(name, "auto") == 0 ? nullptr : name;
}

// Why p has no attention kernel on this backend (its head size, block size, alignment, grid limits),
// or "" when it has one.
std::string paged_attention_unsupported(const PagedAttentionParams& p);

// How paged attention will run p on the current device (its multiprocessor count and the kernels'
// occupancy set how many splits fill it), chosen on the host from sizes only (no device data), so a
// captured graph replays it unchanged. AttentionPlan is each backend's own (above): the bindings
// read only its `int64_t workspace_bytes` and pass the plan back to paged_attention. `lse`: whether
// the call writes the log-sum-exp (the split merge writes it, so such a plan has at least two splits).
Status plan_paged_attention(const PagedAttentionParams& p, bool lse, AttentionPlan* plan);

// `workspace`: plan.workspace_bytes of device memory on the current device (unused when 0); `lse`:
// the log-sum-exp output, as planned (data nullptr: none).
Status paged_attention(const PagedAttentionParams& p, const RowsView& lse, const AttentionPlan& plan, void* workspace,
                       Stream stream);

Status merge_attention_states(const MergeStatesParams& p, Stream stream);

}  // namespace fp8kv::gpu
