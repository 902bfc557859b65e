// CUDA merge of two attention states (merge_attention_states; the arithmetic is merge_states.h's).
// Bound by memory: one warp per (token, head) row, its lanes taking consecutive elements, so that a
// warp's loads and stores are contiguous.
#include "../float_conversions.h"
#include "../gpu/kernels.h"
#include "../merge_states.h"

namespace fp8kv::cuda {
namespace {

constexpr int kWarps = 4;

template <DType T>
__global__ void __launch_bounds__(kWarps * 32) merge_states_kernel(const MergeStatesParams p) {
  using E = Element<T>;
  using Storage = typename E::Storage;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= p.num_tokens * p.num_heads) return;
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  const MergeWeights w = merge_weights(static_cast<const float*>(p.lse_a.data)[p.lse_a.offset(token, head)],
                                       static_cast<const float*>(p.lse_b.data)[p.lse_b.offset(token, head)]);
  const auto* a = static_cast<const Storage*>(p.out_a.data) + p.out_a.offset(token, head);
  const auto* b = static_cast<const Storage*>(p.out_b.data) + p.out_b.offset(token, head);
  auto* out = static_cast<Storage*>(p.out.data) + p.out.offset(token, head);
  const int lane = threadIdx.x % 32;
  for (int d = lane; d < p.head_size; d += 32) out[d] = E::from_float(merged(w, E::to_float(a[d]), E::to_float(b[d])));
  if (lane == 0 && p.lse.data != nullptr) static_cast<float*>(p.lse.data)[p.lse.offset(token, head)] = w.lse;
}

}  // namespace
}  // namespace fp8kv::cuda

namespace fp8kv::gpu {

cudaError_t merge_attention_states(const MergeStatesParams& p, cudaStream_t stream) {
  const int64_t rows = p.num_tokens * p.num_heads;  // below 2^31 (merge_states_params)
  if (rows == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((rows + cuda::kWarps - 1) / cuda::kWarps);
  return dispatch<kSourceDTypes>(p.dtype, cudaErrorInvalidValue, [&](auto type) {
    cuda::merge_states_kernel<decltype(type)::value><<<blocks, cuda::kWarps * 32, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace fp8kv::gpu
