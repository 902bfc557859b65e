// HIP calibration reduction: fold max(|x|) of K and V into running maxima, per tensor or per KV head.
// A NaN anywhere makes the maximum NaN, as on the CPU.
//
// Workgroup (token chunk, KV head, K or V): each thread keeps the maximum of |x| as float bits
// compared as unsigned integers, which orders non-negative floats correctly and puts every NaN above
// +inf; the workgroup's maximum is folded into the running value with an atomic NaN-propagating max.
// The grid has a few workgroups per compute unit, so atomics per running value stay few.
#include <hip/hip_runtime.h>

#include <algorithm>

#include "device.h"
#include "../gpu/kernels.h"
#include "launch.h"

namespace fp8kv::hip {
namespace {

constexpr int kWaves = 4;
constexpr int kThreads = kWaves * kWaveSize;
constexpr int kVec = 4;
constexpr int kWorkgroupsPerUnit = 4;
constexpr int64_t kMinTokensPerWorkgroup = 16;

inline __device__ uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

template <int N, typename Src>
__device__ uint32_t rows_abs_max(const typename Src::Storage* base, int64_t token_stride, int64_t first,
                                 int64_t last, int head_size) {
  const int lane = threadIdx.x % kWaveSize;
  const int wave = threadIdx.x / kWaveSize;
  uint32_t amax = 0;
  for (int64_t t = first + wave; t < last; t += kWaves) {
    const auto* row = base + t * token_stride;
    for (int d = lane * N; d < head_size; d += kWaveSize * N) {
      const auto x = *reinterpret_cast<const Vec<typename Src::Storage, N>*>(row + d);
      for (int i = 0; i < N; ++i) amax = max(amax, abs_bits(Src::to_float(x.v[i])));
    }
  }
  return amax;
}

template <typename Src>  // an Element
__global__ __launch_bounds__(kThreads) void kv_amax_kernel(AmaxParams p, int64_t tokens_per_workgroup,
                                                           bool vectorized) {
  __shared__ uint32_t wave_maxima[kWaves];
  const int head = blockIdx.y;
  const bool is_value = blockIdx.z == 1;
  const int64_t first = blockIdx.x * tokens_per_workgroup;
  const int64_t last = std::min(first + tokens_per_workgroup, p.num_tokens);
  const auto* base = static_cast<const typename Src::Storage*>(is_value ? p.value : p.key) +
                     head * (is_value ? p.value_head_stride : p.key_head_stride);
  const int64_t token_stride = is_value ? p.value_token_stride : p.key_token_stride;

  uint32_t amax = vectorized ? rows_abs_max<kVec, Src>(base, token_stride, first, last, p.head_size)
                             : rows_abs_max<1, Src>(base, token_stride, first, last, p.head_size);
  amax = wave_max_bits(amax);
  if (threadIdx.x % kWaveSize == 0) wave_maxima[threadIdx.x / kWaveSize] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWaves; ++w) amax = max(amax, wave_maxima[w]);
    const HeadScalars& running = is_value ? p.v_amax : p.k_amax;
    atomic_nan_max(running.at(head), bits_float(amax));
  }
}

bool vectorizable(const AmaxParams& p) {
  const int bytes = dtype_bytes(p.src_dtype);
  return p.head_size % kVec == 0 && chunks_aligned(p.key, bytes, kVec, {p.key_token_stride, p.key_head_stride}) &&
         chunks_aligned(p.value, bytes, kVec, {p.value_token_stride, p.value_head_stride});
}

}  // namespace

}  // namespace fp8kv::hip

namespace fp8kv::gpu {

Status kv_amax(const AmaxParams& p, Stream stream) {
  using namespace hip;
  if (p.num_tokens == 0) return hipSuccess;
  int compute_units = 0;
  const hipError_t status = current_compute_units(&compute_units);
  if (status != hipSuccess) return status;
  // Enough workgroups to fill the device, each with at least kMinTokensPerWorkgroup tokens.
  const int64_t rows = 2 * static_cast<int64_t>(p.num_kv_heads);
  const int64_t wanted_chunks = ceil_div<int64_t>(static_cast<int64_t>(kWorkgroupsPerUnit) * compute_units, rows);
  const int64_t chunks = std::max<int64_t>(
      1, std::min(wanted_chunks, ceil_div<int64_t>(p.num_tokens, kMinTokensPerWorkgroup)));
  const int64_t tokens_per_workgroup = ceil_div<int64_t>(p.num_tokens, chunks);
  const dim3 grid(static_cast<unsigned int>(ceil_div<int64_t>(p.num_tokens, tokens_per_workgroup)), p.num_kv_heads, 2);
  return dispatch<kSourceDTypes>(p.src_dtype, hipErrorInvalidValue, [&](auto src) {
    using Src = Element<decltype(src)::value>;
    hipLaunchKernelGGL(kv_amax_kernel<Src>, grid, dim3(kThreads), 0, stream, p, tokens_per_workgroup, vectorizable(p));
    return hipGetLastError();
  });
}

}  // namespace fp8kv::gpu
