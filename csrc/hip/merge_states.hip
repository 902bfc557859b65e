// HIP merge of two attention states (merge_attention_states; the arithmetic is merge_states.h's).
// Bound by memory: one wavefront per (token, head) row, its lanes taking consecutive elements.
#include <hip/hip_runtime.h>

#include "device.h"
#include "../gpu/kernels.h"
#include "../merge_states.h"
#include "launch.h"

namespace fp8kv::hip {
namespace {

constexpr int kWaves = 4;

template <typename E>  // an Element
__global__ __launch_bounds__(kWaves * kWaveSize) void merge_states_kernel(MergeStatesParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWaves + threadIdx.x / kWaveSize;
  if (row < p.num_tokens * p.num_heads) merge_row<E>(p, row, threadIdx.x % kWaveSize, kWaveSize);
}

}  // namespace
}  // namespace fp8kv::hip

namespace fp8kv::gpu {

Status merge_attention_states(const MergeStatesParams& p, Stream stream) {
  using namespace hip;
  const int64_t rows = p.num_tokens * p.num_heads;  // below 2^31 (merge_states_params)
  if (rows == 0) return hipSuccess;
  const dim3 grid(static_cast<unsigned int>(ceil_div<int64_t>(rows, kWaves)));
  return dispatch<kSourceDTypes>(p.dtype, hipErrorInvalidValue, [&](auto type) {
    hipLaunchKernelGGL(merge_states_kernel<Element<decltype(type)::value>>, grid, dim3(kWaves * kWaveSize), 0, stream, p);
    return hipGetLastError();
  });
}

}  // namespace fp8kv::gpu
