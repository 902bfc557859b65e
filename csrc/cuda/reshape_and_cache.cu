// CUDA cache write: each thread quantizes kVec consecutive elements of one (token, head) row of K
// and of V (16-byte loads) and scatters them to the token's slot. The rotated recipe
// (docs/rotated_cache.md) has its own kernel: the threads of a row rotate it together first.
#include <algorithm>

#include "../float_conversions.h"
#include "device.cuh"
#include "hadamard.cuh"
#include "../gpu/kernels.h"

namespace fp8kv::cuda {
namespace {

constexpr int kThreads = 256;

// x / scale encoded; the division is IEEE (fp32, round to nearest) like the CPU codec's input.
template <DType F>
__device__ __forceinline__ uint8_t quantize(float x, float scale) {
  const float y = __fdiv_rn(x, scale);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (F == DType::kFloat8E4M3FN || F == DType::kFloat8E5M2) {
    // The hardware conversion is the contract's reference; NaN is pinned to the canonical code.
    if (isnan(y)) return Fp8Traits<F>::kNanCode;
    uint16_t pair;
    if constexpr (F == DType::kFloat8E4M3FN) {
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(pair) : "f"(0.0f), "f"(y));
    } else {
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;\n" : "=h"(pair) : "f"(0.0f), "f"(y));
    }
    return static_cast<uint8_t>(pair);
  }
#endif
  return fp8_encode<F>(y);
}

// Writes kVec elements starting at `src` to `dst` (cache element type kCache).
template <DType kSrc, DType kCache, int kVec>
__device__ __forceinline__ void write_chunk(const typename Element<kSrc>::Storage* src, uint8_t* dst, float scale) {
  using Src = typename Element<kSrc>::Storage;
  if constexpr (!is_fp8(kCache)) {
    // Unquantized: a bit copy (the cache dtype equals the source dtype).
    if constexpr (sizeof(Src) * kVec == 16) {
      *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) reinterpret_cast<Src*>(dst)[i] = src[i];
    }
  } else {
    Src values[kVec];
    if constexpr (sizeof(Src) * kVec == 16) {
      *reinterpret_cast<uint4*>(values) = __ldg(reinterpret_cast<const uint4*>(src));
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) values[i] = src[i];
    }
    uint8_t codes[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) codes[i] = quantize<kCache>(Element<kSrc>::to_float(values[i]), scale);
    if constexpr (kVec == 8) {
      *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(codes);
    } else if constexpr (kVec == 4) {
      *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(codes);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) dst[i] = codes[i];
    }
  }
}

template <DType kSrc, DType kCache, int kVec>
__global__ void __launch_bounds__(kThreads) reshape_and_cache_kernel(const CacheWriteParams p) {
  using Src = typename Element<kSrc>::Storage;
  const int chunks_per_row = p.head_size / kVec;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t total = p.num_slots * p.num_kv_heads * chunks_per_row;
  if (index >= total) return;
  const int chunk = static_cast<int>(index % chunks_per_row);
  const int head = static_cast<int>((index / chunks_per_row) % p.num_kv_heads);
  const int64_t token = index / (static_cast<int64_t>(chunks_per_row) * p.num_kv_heads);
  const int64_t slot = __ldg(p.slot_mapping + token);
  if (slot < 0) return;  // padding token
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  if (block >= p.num_blocks) return;  // invalid slot (reported in debug-check mode): never write outside
  constexpr int kCacheBytes = dtype_bytes(kCache);
  const int element = chunk * kVec;

  const auto* key = static_cast<const Src*>(p.key) + token * p.key_token_stride + head * p.key_head_stride + element;
  auto* key_dst = static_cast<uint8_t*>(p.key_cache.data) +
                  (block * p.key_cache.block_stride + offset * p.key_cache.token_stride +
                   head * p.key_cache.head_stride + element) * kCacheBytes;
  write_chunk<kSrc, kCache, kVec>(key, key_dst, *p.k_scale.at(head));

  const auto* value = static_cast<const Src*>(p.value) + token * p.value_token_stride + head * p.value_head_stride + element;
  auto* value_dst = static_cast<uint8_t*>(p.value_cache.data) +
                    (block * p.value_cache.block_stride + offset * p.value_cache.token_stride +
                     head * p.value_cache.head_stride + element) * kCacheBytes;
  write_chunk<kSrc, kCache, kVec>(value, value_dst, *p.v_scale.at(head));
}

// The transformed recipe (rotation blocks of kBlock elements; 1: an offset alone): kVec consecutive
// elements of a row per thread, so a block spans at most a warp's lanes, which exchange values in the
// butterflies before each quantizes its own. kAligned: 16-byte source loads and 8-byte stores (rows
// aligned for them), else one element at a time.
template <DType kSrc, int kVec, bool kAligned>
__device__ __forceinline__ void load_chunk(const typename Element<kSrc>::Storage* src,
                                           typename Element<kSrc>::Storage (&values)[kVec]) {
  using Src = typename Element<kSrc>::Storage;
  if constexpr (kAligned) {
    static_assert(kVec * sizeof(Src) % 16 == 0, "whole 16-byte loads");
#pragma unroll
    for (int i = 0; i < kVec; i += 16 / static_cast<int>(sizeof(Src))) {
      *reinterpret_cast<uint4*>(values + i) = __ldg(reinterpret_cast<const uint4*>(src + i));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) values[i] = src[i];
  }
}

template <DType kSrc, DType kCache, int kBlock, int kVec, bool kAligned>
__device__ __forceinline__ void transform_and_store(const typename Element<kSrc>::Storage (&values)[kVec], uint8_t* dst,
                                                    float scale, const float* offset, bool store) {
  constexpr int kLow = log2_exact(kVec < kBlock ? kVec : kBlock);
  constexpr int kLaneBits = kBlock > kVec ? log2_exact(kBlock / kVec) : 0;
  static_assert(kLaneBits <= 5, "a rotation block spans at most one warp");
  float x[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) x[i] = Element<kSrc>::to_float(values[i]);
  hadamard_row<kBlock, kLow, kLaneBits, 0>(x);
  uint8_t codes[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    float y = mul_rn(x[i], hadamard_norm(kBlock));
    if (offset != nullptr) y -= offset[i];
    codes[i] = quantize<kCache>(y, scale);
  }
  if (!store) return;
  if constexpr (kAligned) {
    static_assert(kVec % 8 == 0, "whole 8-byte stores");
#pragma unroll
    for (int i = 0; i < kVec; i += 8) *reinterpret_cast<uint2*>(dst + i) = *reinterpret_cast<const uint2*>(codes + i);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) dst[i] = codes[i];
  }
}

template <DType kSrc, DType kCache, int kBlock, int kVec, bool kAligned>
__global__ void __launch_bounds__(kThreads) transformed_write_kernel(const CacheWriteParams p) {
  using Src = typename Element<kSrc>::Storage;
  const int chunks_per_row = p.head_size / kVec;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  // Every lane takes part in the butterflies: one past the last row works on row 0 and stores nothing
  // (a rotation block's lanes are all past it or none: rows are whole blocks).
  const bool in_grid = index < p.num_slots * p.num_kv_heads * chunks_per_row;
  const int64_t at = in_grid ? index : 0;
  const int chunk = static_cast<int>(at % chunks_per_row);
  const int head = static_cast<int>((at / chunks_per_row) % p.num_kv_heads);
  const int64_t token = at / (static_cast<int64_t>(chunks_per_row) * p.num_kv_heads);
  const int element = chunk * kVec;

  // K and V are both loaded before either is rotated, so their loads are in flight together.
  Src key[kVec], value[kVec];
  load_chunk<kSrc, kVec, kAligned>(
      static_cast<const Src*>(p.key) + token * p.key_token_stride + head * p.key_head_stride + element, key);
  load_chunk<kSrc, kVec, kAligned>(
      static_cast<const Src*>(p.value) + token * p.value_token_stride + head * p.value_head_stride + element, value);
  const int64_t slot = __ldg(p.slot_mapping + token);
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  // Padding tokens and invalid slots (reported in debug-check mode) are not stored.
  const bool store = in_grid && slot >= 0 && block < p.num_blocks;

  auto* key_dst = static_cast<uint8_t*>(p.key_cache.data) + block * p.key_cache.block_stride +
                  offset * p.key_cache.token_stride + head * p.key_cache.head_stride + element;
  const float* key_offset = p.transform.k_offset != nullptr
                                ? p.transform.k_offset + static_cast<int64_t>(head) * p.head_size + element
                                : nullptr;
  transform_and_store<kSrc, kCache, kBlock, kVec, kAligned>(key, key_dst, *p.k_scale.at(head), key_offset, store);

  auto* value_dst = static_cast<uint8_t*>(p.value_cache.data) + block * p.value_cache.block_stride +
                    offset * p.value_cache.token_stride + head * p.value_cache.head_stride + element;
  transform_and_store<kSrc, kCache, kBlock, kVec, kAligned>(value, value_dst, *p.v_scale.at(head), nullptr, store);
}

// 16-byte source vectors when every row start is 16-byte aligned, else one element per thread.
bool rows_are_16_byte_aligned(const CacheWriteParams& p, int src_bytes, int vec) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const int64_t cache_bytes = dtype_bytes(p.cache_dtype);
  const int64_t strides[] = {p.key_token_stride * src_bytes, p.key_head_stride * src_bytes,
                             p.value_token_stride * src_bytes, p.value_head_stride * src_bytes,
                             p.key_cache.block_stride * cache_bytes, p.key_cache.token_stride * cache_bytes,
                             p.key_cache.head_stride * cache_bytes, p.value_cache.block_stride * cache_bytes,
                             p.value_cache.token_stride * cache_bytes, p.value_cache.head_stride * cache_bytes};
  bool ok = p.head_size % vec == 0 && aligned(p.key) && aligned(p.value) && aligned(p.key_cache.data) &&
            aligned(p.value_cache.data);
  // A cache chunk is vec * cache_bytes wide; its alignment follows from the strides.
  for (int64_t s : strides) ok = ok && s % (vec * cache_bytes) == 0 && s % 16 == 0;
  return ok;
}

// Rotation blocks (1: no rotation, an offset alone) of the transformed write.
inline constexpr int kRotationBlocks[] = {1, 16, 32, 64, 128, 256};

// Eight elements per thread: a 256-element block spans a warp, and the codes go out 8 bytes at a
// time. An offset alone with a head size that is not a multiple of 8 goes one element per thread.
// (32 elements per thread, 2 to 4 times fewer shuffles, measured 1.6 times slower on H100.)
template <DType kSrc, DType kCache>
cudaError_t launch_transformed(const CacheWriteParams& p, cudaStream_t stream) {
  const int block = p.transform.hadamard ? hadamard_block(p.head_size) : 1;
  return dispatch<kRotationBlocks>(block, cudaErrorInvalidValue, [&](auto rotation) {
    constexpr int kBlock = decltype(rotation)::value;
    auto launch = [&](auto vec, auto aligned) {
      constexpr int kVec = decltype(vec)::value;
      const int64_t threads = p.num_slots * p.num_kv_heads * (p.head_size / kVec);
      if (threads == 0) return cudaSuccess;
      const unsigned blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
      transformed_write_kernel<kSrc, kCache, kBlock, kVec, decltype(aligned)::value><<<blocks, kThreads, 0, stream>>>(p);
      return cudaGetLastError();
    };
    if (p.head_size % 8 != 0) {
      if constexpr (kBlock == 1) return launch(std::integral_constant<int, 1>{}, std::false_type{});
      return cudaErrorInvalidValue;  // a rotation needs a head size divisible by 16 (checked by the bindings)
    }
    using Eight = std::integral_constant<int, 8>;
    if (rows_are_16_byte_aligned(p, dtype_bytes(kSrc), 16 / dtype_bytes(kSrc))) return launch(Eight{}, std::true_type{});
    return launch(Eight{}, std::false_type{});
  });
}

template <DType kSrc, DType kCache>
cudaError_t launch_typed(const CacheWriteParams& p, cudaStream_t stream) {
  constexpr int kVec = 16 / dtype_bytes(kSrc);
  const bool vectorized = rows_are_16_byte_aligned(p, dtype_bytes(kSrc), kVec);
  const int vec = vectorized ? kVec : 1;
  const int64_t threads = p.num_slots * p.num_kv_heads * (p.head_size / vec);
  if (threads == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  if (vectorized) {
    reshape_and_cache_kernel<kSrc, kCache, kVec><<<blocks, kThreads, 0, stream>>>(p);
  } else {
    reshape_and_cache_kernel<kSrc, kCache, 1><<<blocks, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace fp8kv::cuda

namespace fp8kv::gpu {

Status reshape_and_cache(const CacheWriteParams& p, Stream stream) {
  return dispatch<kSourceDTypes>(p.src_dtype, cudaErrorInvalidValue, [&](auto src) {
    constexpr DType kSrc = decltype(src)::value;
    // Unquantized: the cache has the source's dtype.
    if (!is_fp8(p.cache_dtype)) return cuda::launch_typed<kSrc, kSrc>(p, stream);
    return dispatch<kFp8DTypes>(p.cache_dtype, cudaErrorInvalidValue, [&](auto cache) {
      if (p.transform.any()) return cuda::launch_transformed<kSrc, decltype(cache)::value>(p, stream);
      return cuda::launch_typed<kSrc, decltype(cache)::value>(p, stream);
    });
  });
}

}  // namespace fp8kv::gpu
