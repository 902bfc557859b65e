// HIP cache write: quantize each (token, KV head) row of K and V with its scale and scatter it to the
// token's slot. Bytes equal the CPU backend's: the same fp32 division and the shared fp8_encode.
//
// One workgroup per token (grid-stride beyond the grid's size); its threads cover the K and V rows of
// all KV heads in chunks of 4 elements when every pointer and stride allows vector accesses, else
// element by element. The rotated recipe (docs/rotated_cache.md) has its own kernel: the lanes of a
// row rotate it together first, in the contract's order, so its bytes too equal the CPU's.
#include <hip/hip_runtime.h>

#include <algorithm>

#include "device.h"
#include "../gpu/kernels.h"
#include "../hadamard.h"
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
  __device__ static uint8_t encode(float x, float scale) { return fp8_encode<F>(x / scale); }
  template <typename Src, int N>
  __device__ static Vec<uint8_t, N> convert(const Vec<typename Src::Storage, N>& x, float scale) {
    Vec<uint8_t, N> codes;
    for (int i = 0; i < N; ++i) codes.v[i] = encode(Src::to_float(x.v[i]), scale);
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

// A thread's N elements of a token's rows, `unit` = row * (head_size / N) + chunk, counting the K rows
// of every KV head first, then the V rows: where they come from and go to.
template <int N, typename Src, typename Dst>
struct RowChunk {
  bool is_value;
  int head;
  int d;  // the chunk's first element in its row
  const typename Src::Storage* src;
  typename Dst::Storage* dst;
  float scale;

  __device__ RowChunk(const CacheWriteParams& p, int64_t token, int64_t block, int64_t offset, int unit) {
    const int chunks = p.head_size / N;
    const int row = unit / chunks;
    d = (unit % chunks) * N;
    is_value = row >= p.num_kv_heads;
    head = is_value ? row - p.num_kv_heads : row;
    src = static_cast<const typename Src::Storage*>(is_value ? p.value : p.key) +
          token * (is_value ? p.value_token_stride : p.key_token_stride) +
          head * (is_value ? p.value_head_stride : p.key_head_stride) + d;
    const CacheView& cache = is_value ? p.value_cache : p.key_cache;
    dst = static_cast<typename Dst::Storage*>(cache.data) + block * cache.block_stride + offset * cache.token_stride +
          head * cache.head_stride + d;
    scale = *(is_value ? p.v_scale : p.k_scale).at(head);
  }
};

template <int N, typename Src, typename Dst>
__device__ void write_token(const CacheWriteParams& p, int64_t token, int64_t block, int64_t offset) {
  const int chunks = p.head_size / N;
  const int units = 2 * p.num_kv_heads * chunks;  // K rows, then V rows
  for (int unit = threadIdx.x; unit < units; unit += blockDim.x) {
    const RowChunk<N, Src, Dst> chunk(p, token, block, offset, unit);
    using In = Vec<typename Src::Storage, N>;
    using Out = Vec<typename Dst::Storage, N>;
    *reinterpret_cast<Out*>(chunk.dst) =
        Dst::template convert<Src, N>(*reinterpret_cast<const In*>(chunk.src), chunk.scale);
  }
}

// The rotated recipe's write of a token: transform_row of csrc/hadamard.h with each row spread over
// consecutive lanes, N elements each, then the plain recipe's quantization. A rotation block (at most
// 256 elements, so at most 64 lanes of 4) lies within one wavefront: a round's units start at the
// workgroup's first lane and rows are whole blocks. `aligned`: one vector access per chunk.
template <int N, typename Src, DType F>
__device__ void write_transformed_token(const CacheWriteParams& p, int64_t token, int64_t block, int64_t offset,
                                        bool aligned) {
  // mul_rn's __fmul_rn is a plain multiply in HIP's headers, which clang may fuse with the offset's
  // subtraction into one FMA (it does for __fmul_rn(a, b) - c on gfx90a); the contract rounds the
  // product first.
#pragma clang fp contract(off)
  using Dst = QuantizeTo<F>;
  const int chunks = p.head_size / N;
  const int units = 2 * p.num_kv_heads * chunks;
  const int rotation = p.transform.hadamard ? hadamard_block(p.head_size) : 0;
  // Every lane runs every round (the butterflies' shuffles need the whole wavefront); lanes past the
  // token's rows work on a copy of its first chunk and store nothing.
  for (int first = 0; first < units; first += blockDim.x) {
    const int unit = first + static_cast<int>(threadIdx.x);
    const bool in_rows = unit < units;
    const RowChunk<N, Src, Dst> chunk(p, token, block, offset, in_rows ? unit : 0);
    Vec<typename Src::Storage, N> in;
    if (aligned) {
      in = *reinterpret_cast<const Vec<typename Src::Storage, N>*>(chunk.src);
    } else {
      for (int i = 0; i < N; ++i) in.v[i] = chunk.src[i];
    }
    float x[N];
    for (int i = 0; i < N; ++i) x[i] = Src::to_float(in.v[i]);
    // A rotated row's head size is a multiple of 16: it always runs with kVec elements per lane.
    if constexpr (N == kVec) {
      if (rotation > 0) {
        hadamard_across_lanes(x, rotation);
        for (int i = 0; i < N; ++i) x[i] = mul_rn(x[i], hadamard_norm(rotation));
      }
    }
    if (!chunk.is_value && p.transform.k_offset != nullptr) {
      const float* k_offset = p.transform.k_offset + static_cast<int64_t>(chunk.head) * p.head_size + chunk.d;
      for (int i = 0; i < N; ++i) x[i] -= k_offset[i];
    }
    if (!in_rows) continue;
    Vec<uint8_t, N> codes;
    for (int i = 0; i < N; ++i) codes.v[i] = Dst::encode(x[i], chunk.scale);
    if (aligned) {
      *reinterpret_cast<Vec<uint8_t, N>*>(chunk.dst) = codes;
    } else {
      for (int i = 0; i < N; ++i) chunk.dst[i] = codes.v[i];
    }
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

template <typename Src, DType F, int N>
__global__ __launch_bounds__(kThreads) void transformed_write_kernel(CacheWriteParams p, bool aligned) {
  for (int64_t token = blockIdx.x; token < p.num_slots; token += gridDim.x) {
    const int64_t slot = p.slot_mapping[token];
    if (slot < 0) continue;  // padding token
    write_transformed_token<N, Src, F>(p, token, slot / p.block_size, slot % p.block_size, aligned);
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

dim3 token_grid(const CacheWriteParams& p) { return dim3(static_cast<unsigned int>(std::min(p.num_slots, kMaxGrid))); }

template <typename Src, typename Dst>
hipError_t launch(const CacheWriteParams& p, hipStream_t stream) {
  hipLaunchKernelGGL((reshape_and_cache_kernel<Src, Dst>), token_grid(p), dim3(kThreads), 0, stream, p,
                     vectorizable(p));
  return hipGetLastError();
}

// kVec elements per lane whenever the head size allows (always with a rotation), vector accesses when
// the rows allow them too; otherwise an offset alone goes element by element.
template <typename Src, DType F>
hipError_t launch_transformed(const CacheWriteParams& p, hipStream_t stream) {
  if (p.head_size % kVec == 0) {
    hipLaunchKernelGGL((transformed_write_kernel<Src, F, kVec>), token_grid(p), dim3(kThreads), 0, stream, p,
                       vectorizable(p));
  } else {
    hipLaunchKernelGGL((transformed_write_kernel<Src, F, 1>), token_grid(p), dim3(kThreads), 0, stream, p, false);
  }
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
    return dispatch<kFp8DTypes>(p.cache_dtype, hipErrorInvalidValue, [&](auto cache) {
      constexpr DType kCache = decltype(cache)::value;
      if (p.transform.any()) return launch_transformed<Src, kCache>(p, stream);
      return launch<Src, QuantizeTo<kCache>>(p, stream);
    });
  });
}

}  // namespace fp8kv::gpu
