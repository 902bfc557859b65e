// HIP cache write: quantize each (token, KV head) row of K and V with its scale and scatter it to the
// token's slot. Bytes equal the CPU backend's: the same fp32 division and the shared fp8_encode.
//
// One workgroup per token (grid-stride beyond the grid's size); its threads cover the K and V rows of
// all KV heads in chunks of 4 elements when every pointer and stride allows vector accesses, else
// element by element.
#include <hip/hip_runtime.h>

#include <algorithm>

#include "device.h"
#include "../gpu/kernels.h"
#include "launch.h"

namespace fp8kv::hip {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int64_t kMaxGrid = 1 << 20;

// Stores x / scale as FP8 codes of dtype F.
template <DType F>
struct QuantizeTo {
  using Storage = uint8_t;
  template <typename Src, int N>
  __device__ static Vec<uint8_t, N> convert(const Vec<typename Src::Storage, N>& x, float scale) {
    Vec<uint8_t, N> codes;
    for (int i = 0; i < N; ++i) codes.v[i] = fp8_encode<F>(Src::to_float(x.v[i]) / scale);
    return codes;
  }
};

// An unquantized cache has the source dtype: rows are copied bit for bit and scales do not apply.
template <typename Src>
struct CopyAs {
  using Storage = typename Src::Storage;
  template <typename, int N>
  __device__ static Vec<Storage, N> convert(const Vec<Storage, N>& x, float) {
    return x;
  }
};

template <int N, typename Src, typename Dst>
__device__ void write_token(const CacheWriteParams& p, int64_t token, int64_t block, int64_t offset) {
  const int chunks = p.head_size / N;
  const int units = 2 * p.num_kv_heads * chunks;  // K rows, then V rows
  for (int unit = threadIdx.x; unit < units; unit += blockDim.x) {
    const int row = unit / chunks;
    const int d = (unit % chunks) * N;
    const bool is_value = row >= p.num_kv_heads;
    const int head = is_value ? row - p.num_kv_heads : row;
    const auto* src = static_cast<const typename Src::Storage*>(is_value ? p.value : p.key) +
                      token * (is_value ? p.value_token_stride : p.key_token_stride) +
                      head * (is_value ? p.value_head_stride : p.key_head_stride) + d;
    const CacheView& cache = is_value ? p.value_cache : p.key_cache;
    auto* dst = static_cast<typename Dst::Storage*>(cache.data) + block * cache.block_stride +
                offset * cache.token_stride + head * cache.head_stride + d;
    const float scale = *(is_value ? p.v_scale : p.k_scale).at(head);
    using In = Vec<typename Src::Storage, N>;
    using Out = Vec<typename Dst::Storage, N>;
    *reinterpret_cast<Out*>(dst) = Dst::template convert<Src, N>(*reinterpret_cast<const In*>(src), scale);
  }
}

template <typename Src, typename Dst>
__global__ __launch_bounds__(kThreads) void reshape_and_cache_kernel(CacheWriteParams p, bool vectorized) {
  for (int64_t token = blockIdx.x; token < p.num_slots; token += gridDim.x) {
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0) continue;  // padding token
    const int64_t block = slot / p.block_size;
    const int64_t offset = slot % p.block_size;
    if (vectorized) {
      write_token<kVec, Src, Dst>(p, token, block, offset);
    } else {
      write_token<1, Src, Dst>(p, token, block, offset);
    }
  }
}

bool vectorizable(const CacheWriteParams& p) {
  const int src_bytes = dtype_bytes(p.src_dtype);
  const int cache_bytes = dtype_bytes(p.cache_dtype);
  return p.head_size % kVec == 0 &&
         chunks_aligned(p.key, src_bytes, kVec, {p.key_token_stride, p.key_head_stride}) &&
         chunks_aligned(p.value, src_bytes, kVec, {p.value_token_stride, p.value_head_stride}) &&
         chunks_aligned(p.key_cache.data, cache_bytes, kVec,
                        {p.key_cache.block_stride, p.key_cache.token_stride, p.key_cache.head_stride}) &&
         chunks_aligned(p.value_cache.data, cache_bytes, kVec,
                        {p.value_cache.block_stride, p.value_cache.token_stride, p.value_cache.head_stride});
}

template <typename Src, typename Dst>
hipError_t launch(const CacheWriteParams& p, hipStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(std::min(p.num_slots, kMaxGrid)));
  hipLaunchKernelGGL((reshape_and_cache_kernel<Src, Dst>), grid, dim3(kThreads), 0, stream, p, vectorizable(p));
  return hipGetLastError();
}

}  // namespace

}  // namespace fp8kv::hip

namespace fp8kv::gpu {

Status reshape_and_cache(const CacheWriteParams& p, Stream stream) {
  using namespace hip;
  if (p.num_slots == 0) return hipSuccess;
  return dispatch<kSourceDTypes>(p.src_dtype, hipErrorInvalidValue, [&](auto src) {
    using Src = Element<decltype(src)::value>;
    if (!is_fp8(p.cache_dtype)) return launch<Src, CopyAs<Src>>(p, stream);
    return dispatch<kFp8DTypes>(p.cache_dtype, hipErrorInvalidValue,
                                [&](auto cache) { return launch<Src, QuantizeTo<decltype(cache)::value>>(p, stream); });
  });
}

}  // namespace fp8kv::gpu
