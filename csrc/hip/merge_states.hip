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
  using Storage = typename E::Storage;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWaves + threadIdx.x / kWaveSize;
  if (row >= p.num_tokens * p.num_heads) return;
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  const MergeWeights w = merge_weights(static_cast<const float*>(p.lse_a.data)[p.lse_a.offset(token, head)],
                                       static_cast<const float*>(p.lse_b.data)[p.lse_b.offset(token, head)]);
  const auto* a = static_cast<const Storage*>(p.out_a.data) + p.out_a.offset(token, head);
  const auto* b = static_cast<const Storage*>(p.out_b.data) + p.out_b.offset(token, head);
  auto* out = static_cast<Storage*>(p.out.data) + p.out.offset(token, head);
  const int lane = threadIdx.x % kWaveSize;
  for (int d = lane; d < p.head_size; d += kWaveSize) out[d] = E::from_float(merged(w, E::to_float(a[d]), E::to_float(b[d])));
  if (lane == 0 && p.lse.data != nullptr) static_cast<float*>(p.lse.data)[p.lse.offset(token, head)] = w.lse;
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
