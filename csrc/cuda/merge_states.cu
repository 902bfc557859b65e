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
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row < p.num_tokens * p.num_heads) merge_row<Element<T>>(p, row, threadIdx.x % 32, 32);
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
