// The GPU kernels' launchers: one contract, defined by whichever GPU backend the library is built
// with (csrc/cuda, or csrc/hip for ROCm), called by csrc/gpu/bindings.cpp. Framework-free: the
// launchers take validated operand descriptions (kernel_params.h, built by op_params.h) and a stream,
// enqueue their kernels, never synchronize with the host and never allocate; they return the
// launch status.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../kernel_params.h"

// The runtime API of the backend: hipFoo or cudaFoo.
#if defined(FP8KV_WITH_HIP) || defined(__HIPCC__)
#include <hip/hip_runtime_api.h>
#define FP8KV_GPU_API(name) hip##name
#define FP8KV_GPU_BACKEND "HIP"
#else
#include <cuda_runtime_api.h>
#define FP8KV_GPU_API(name) cuda##name
#define FP8KV_GPU_BACKEND "CUDA"
#endif

namespace fp8kv::gpu {

using Status = FP8KV_GPU_API(Error_t);
using Stream = FP8KV_GPU_API(Stream_t);
inline constexpr Status kSuccess = FP8KV_GPU_API(Success);
inline constexpr const char* kBackend = FP8KV_GPU_BACKEND;
inline const char* status_string(Status status) { return FP8KV_GPU_API(GetErrorString)(status); }

Status reshape_and_cache(const CacheWriteParams& p, Stream stream);

Status kv_amax(const AmaxParams& p, Stream stream);

// The multi-token attention kernel a user asks for with FP8KV_MULTI_TOKEN_KERNEL (read at every call):
// unset, empty or "auto" lets the backend choose; "sm80" / "sm90a" name the CUDA kernels (the HIP
// backend has one and refuses both). Each backend's paged_attention_unsupported refuses a request it
// cannot meet.
enum class MultiTokenKernel { kAuto, kSm80, kSm90a, kUnknown };
inline constexpr const char* kMultiTokenKernelVariable = "FP8KV_MULTI_TOKEN_KERNEL";

inline MultiTokenKernel requested_multi_token_kernel() {
  const char* value = std::getenv(kMultiTokenKernelVariable);
  if (value == nullptr || std::strcmp(value, "") == 0 || std::strcmp(value, "auto") == 0) return MultiTokenKernel::kAuto;
  if (std::strcmp(value, "sm80") == 0) return MultiTokenKernel::kSm80;
  if (std::strcmp(value, "sm90a") == 0) return MultiTokenKernel::kSm90a;
  return MultiTokenKernel::kUnknown;
}

// Why p has no attention kernel on this backend (its head size, block size, alignment, grid limits),
// or "" when it has one.
std::string paged_attention_unsupported(const PagedAttentionParams& p);

// How paged attention splits its work; chosen on the host from sizes only (no device data), so a
// captured graph replays it unchanged.
struct AttentionPlan {
  int num_splits;           // context splits (flash-decoding); 1 writes `out` directly
  int64_t workspace_bytes;  // the splits' partial results (0 when num_splits == 1), and CUDA decode's work queue
  // The CUDA kernels' grid (the HIP kernels find their rows and split ranges on the device):
  int64_t row_chunks;  // decode: sequences x query-head chunks; multi-token: grid.x, query tiles (a bound)
  int split_tokens;    // context positions per split, a multiple of the kernel's tile group
  bool deep_staging;   // multi-token kernel: prefill::kDeepStages (see csrc/cuda/tiles.h)
  int64_t ctas;        // decode: persistent CTAs taking the work items (row chunks x splits x KV heads)
  bool warp_specialized;  // multi-token kernel: the sm_90a one (csrc/cuda/prefill_hopper.cuh)
};

// Plans p for the current device (its multiprocessor count and the kernels' occupancy set how many
// splits fill it).
Status plan_paged_attention(const PagedAttentionParams& p, AttentionPlan* plan);

// `workspace`: plan.workspace_bytes of device memory on the current device (unused when 0).
Status paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, void* workspace, Stream stream);

}  // namespace fp8kv::gpu
