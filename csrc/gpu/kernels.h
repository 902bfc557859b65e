// The GPU kernels' launchers: one contract, defined by whichever GPU backend the library is built
// with (csrc/cuda, or csrc/hip for ROCm), called by csrc/gpu/bindings.cpp. Framework-free: the
// launchers take validated operand descriptions (kernel_params.h, built by op_params.h) and a stream,
// enqueue their kernels, never synchronize with the host and never allocate; they return the
// launch status.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// A kernel a caller forces through a plan (plan_paged_attention's `kernel`), by the backend's own name
// for it: "" or "auto" is the backend's choice (request 0). Sets *request to its code and returns "",
// or returns why the name is not one of the backend's.
std::string kernel_request(const std::string& name, int* request);

// Why p, planned with `request`, has no attention kernel on this backend (its head size, block size,
// grid limits, a forced kernel that cannot run it), from sizes only: "" when it has one.
std::string plan_unsupported(const PagedAttentionParams& p, int request);

// plan_unsupported, and what the operands' addresses and strides must satisfy.
std::string paged_attention_unsupported(const PagedAttentionParams& p, int request);

// How paged attention will run p on the current device (its multiprocessor count and the kernels'
// occupancy set how many splits fill it), chosen on the host from sizes only (no device data), so a
// captured graph replays it unchanged and one plan serves every layer of a step. AttentionPlan is each
// backend's own (above): the bindings read only its `int64_t workspace_bytes` and pass the plan back to
// paged_attention. `lse`: whether the call writes the log-sum-exp (the split merge writes it, so such
// a plan has at least two splits); `request`: kernel_request's code (checked by plan_unsupported).
Status plan_paged_attention(const PagedAttentionParams& p, bool lse, int request, AttentionPlan* plan);

// The plan as fp8kv.plan_paged_attention returns it, and a planned call checks it: [workspace_bytes,
// request, kernel, num_splits, the backend's other fields]. Equal values are the same plan.
std::vector<int64_t> plan_values(const AttentionPlan& plan);

// `workspace`: plan.workspace_bytes of device memory on the current device (unused when 0); `lse`:
// the log-sum-exp output, as planned (data nullptr: none).
Status paged_attention(const PagedAttentionParams& p, const RowsView& lse, const AttentionPlan& plan, void* workspace,
                       Stream stream);

Status merge_attention_states(const MergeStatesParams& p, Stream stream);

}  // namespace fp8kv::gpu
