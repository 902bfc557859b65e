// HIP kernel launchers. Framework-free: they take validated operand descriptions (kernel_params.h,
// built by op_params.h) and a stream, enqueue their kernels, never synchronize with the host and
// never allocate; they return the launch status.
#pragma once

#include <hip/hip_runtime_api.h>

#include <cstdint>

#include "../kernel_params.h"

namespace fp8kv::hip {

hipError_t reshape_and_cache(const CacheWriteParams& p, hipStream_t stream);

hipError_t kv_amax(const AmaxParams& p, hipStream_t stream);

// Why p has no HIP attention kernel (e.g. its head size), or nullptr when it has one.
const char* paged_attention_unsupported(const PagedAttentionParams& p);

// The split-KV partition of one paged_attention call, chosen on the host from sizes only (no device
// data), so a captured graph replays it unchanged.
struct AttentionPlan {
  int num_splits;           // grid extent over each row's visible keys; 1: no reduction pass
  int64_t workspace_bytes;  // partial results of the splits; 0 when num_splits == 1
};

// Plans p for the current device (its compute-unit count sets how many splits fill it).
hipError_t plan_paged_attention(const PagedAttentionParams& p, AttentionPlan* plan);

// `workspace`: plan.workspace_bytes of device memory on the current device (unused when 0).
hipError_t paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, void* workspace,
                           hipStream_t stream);

}  // namespace fp8kv::hip
