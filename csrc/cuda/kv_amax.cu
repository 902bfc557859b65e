// CUDA calibration reduction: max(|x|) of K and V per KV head, folded into running maxima.
//
// CTA = (K or V, head, chunk of tokens). |x| is non-negative, so its float bits order like signed
// integers, with every NaN (sign cleared) above +inf: an integer max reduces and propagates NaN
// in one operation, and atomicMax folds into the running maximum.
#include "../float_conversions.h"
#include "device.cuh"
#include "../gpu/kernels.h"

namespace fp8kv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensPerCta = 64;
constexpr int kLoadsInFlight = 4;

template <DType kSrc, int kVec>
__global__ void __launch_bounds__(kThreads) kv_amax_kernel(const AmaxParams p) {
  using Src = typename Element<kSrc>::Storage;
  const bool is_value = blockIdx.y >= static_cast<unsigned>(p.num_kv_heads);
  const int head = is_value ? blockIdx.y - p.num_kv_heads : blockIdx.y;
  const auto* base = static_cast<const Src*>(is_value ? p.value : p.key);
  const int64_t token_stride = is_value ? p.value_token_stride : p.key_token_stride;
  const int64_t head_stride = is_value ? p.value_head_stride : p.key_head_stride;
  const int chunks_per_row = p.head_size / kVec;
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * kTokensPerCta;
  const int64_t tokens = min(static_cast<int64_t>(kTokensPerCta), p.num_tokens - first_token);

  // Each thread issues kLoadsInFlight vector loads before reducing any, so a CTA's whole chunk is
  // in flight at once (one memory round trip per CTA for 16-bit head size 128).
  int amax_bits = 0;  // bits of +0.0
  const int64_t vectors = tokens * chunks_per_row;
  for (int64_t first = threadIdx.x; first < vectors; first += kThreads * kLoadsInFlight) {
    Src values[kLoadsInFlight][kVec];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int64_t i = first + u * kThreads;
      const int64_t token = first_token + i / chunks_per_row;
      const Src* src = base + token * token_stride + head * head_stride + (i % chunks_per_row) * kVec;
      if (i >= vectors) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) values[u][e] = Element<kSrc>::from_float(0.f);
      } else if constexpr (sizeof(Src) * kVec == 16) {
        *reinterpret_cast<uint4*>(values[u]) = __ldg(reinterpret_cast<const uint4*>(src));
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) values[u][e] = src[e];
      }
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) amax_bits = max(amax_bits, __float_as_int(fabsf(Element<kSrc>::to_float(values[u][e]))));
    }
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) amax_bits = max(amax_bits, __shfl_xor_sync(0xffffffffu, amax_bits, mask));
  __shared__ int warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax_bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) amax_bits = max(amax_bits, warp_max[w]);
    const HeadScalars& out = is_value ? p.v_amax : p.k_amax;
    atomicMax(reinterpret_cast<int*>(out.at(head)), amax_bits);
  }
}

template <DType kSrc>
cudaError_t launch_typed(const AmaxParams& p, cudaStream_t stream) {
  using Src = typename Element<kSrc>::Storage;
  constexpr int kVec = 16 / sizeof(Src);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int64_t strides[] = {p.key_token_stride, p.key_head_stride, p.value_token_stride, p.value_head_stride};
  bool vectorized = p.head_size % kVec == 0 && aligned(p.key) && aligned(p.value);
  for (int64_t s : strides) vectorized = vectorized && (s * static_cast<int64_t>(sizeof(Src))) % 16 == 0;
  const dim3 grid(static_cast<unsigned>((p.num_tokens + kTokensPerCta - 1) / kTokensPerCta),
                  static_cast<unsigned>(2 * p.num_kv_heads));
  if (vectorized) {
    kv_amax_kernel<kSrc, kVec><<<grid, kThreads, 0, stream>>>(p);
  } else {
    kv_amax_kernel<kSrc, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace fp8kv::cuda

namespace fp8kv::gpu {

Status kv_amax(const AmaxParams& p, Stream stream) {
  if (p.num_tokens == 0) return cudaSuccess;
  return dispatch<kSourceDTypes>(p.src_dtype, cudaErrorInvalidValue,
                                 [&](auto src) { return cuda::launch_typed<decltype(src)::value>(p, stream); });
}

}  // namespace fp8kv::gpu
