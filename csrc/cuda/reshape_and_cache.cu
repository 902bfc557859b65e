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

// The transformed recipe (rotation blocks of kBlock elements; 1: an offset alone). A thread holds
// kChunks chunks of kChunk consecutive elements of one rotation block, chunks kLanes apart, so a
// block spans kLanes lanes and each load or store instruction of a warp covers whole 32-byte sectors:
// the butterflies over a chunk's and over the chunks' bits stay in registers, and only those over
// the lanes' bits (log2 kLanes of them) go through shuffles. kAligned: 16-byte source loads and
// 8-byte stores (rows aligned for them), else one element at a time.
template <int kBlock, int kChunk>
struct WriteTiling {
  static constexpr int kChunks = kBlock >= 64 ? 4 : kBlock >= 16 ? 2 : 1;  // 32 values per tensor at most
  static constexpr int kUnit = kBlock > kChunk ? kBlock : kChunk;          // elements a group of lanes holds
  static constexpr int kLanes = kUnit / (kChunk * kChunks);
  static constexpr int kValues = kChunk * kChunks;
  static_assert(kLanes >= 1 && kLanes <= 32 && kUnit == kLanes * kValues, "a unit spans whole lanes of a warp");
  // The unit's element that value `v` of lane `lane` holds.
  __device__ static constexpr int element(int lane, int v) {
    return v % kChunk + kChunk * (lane + kLanes * (v / kChunk));
  }
};

template <DType kSrc, int kChunk, bool kAligned>
__device__ __forceinline__ void load_chunk(const typename Element<kSrc>::Storage* src,
                                           typename Element<kSrc>::Storage* values) {
  using Src = typename Element<kSrc>::Storage;
  if constexpr (kAligned) {
    static_assert(kChunk * sizeof(Src) % 16 == 0, "whole 16-byte loads");
#pragma unroll
    for (int i = 0; i < kChunk; i += 16 / static_cast<int>(sizeof(Src))) {
      *reinterpret_cast<uint4*>(values + i) = __ldg(reinterpret_cast<const uint4*>(src + i));
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) values[i] = src[i];
  }
}

template <DType kSrc, DType kCache, int kBlock, int kChunk, bool kAligned,
          typename Tiling = WriteTiling<kBlock, kChunk>>
__device__ __forceinline__ void transform_and_store(const typename Element<kSrc>::Storage (&values)[Tiling::kValues],
                                                    int lane, uint8_t* dst, float scale, const float* offset,
                                                    bool store) {
  constexpr int kValues = Tiling::kValues;
  float x[kValues];
#pragma unroll
  for (int i = 0; i < kValues; ++i) x[i] = Element<kSrc>::to_float(values[i]);
  hadamard_row<kBlock, log2_exact(kChunk), log2_exact(Tiling::kLanes), 0>(x);
  uint8_t codes[kValues];
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    float y = mul_rn(x[i], hadamard_norm(kBlock));
    if (offset != nullptr) y -= offset[Tiling::element(lane, i)];
    codes[i] = quantize<kCache>(y, scale);
  }
  if (!store) return;
#pragma unroll
  for (int c = 0; c < Tiling::kChunks; ++c) {
    uint8_t* chunk_dst = dst + Tiling::element(lane, c * kChunk);
    if constexpr (kAligned) {
      static_assert(kChunk == 8, "8-byte stores");
      *reinterpret_cast<uint2*>(chunk_dst) = *reinterpret_cast<const uint2*>(codes + c * kChunk);
    } else {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) chunk_dst[i] = codes[c * kChunk + i];
    }
  }
}

template <DType kSrc, DType kCache, int kBlock, int kChunk, bool kAligned>
__global__ void __launch_bounds__(kThreads) transformed_write_kernel(const CacheWriteParams p) {
  using Src = typename Element<kSrc>::Storage;
  using Tiling = WriteTiling<kBlock, kChunk>;
  const int units_per_row = p.head_size / Tiling::kUnit;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int lane = static_cast<int>(index % Tiling::kLanes);
  // Every lane takes part in the butterflies: one past the last unit works on unit 0 and stores
  // nothing (a unit's lanes are all past it or none).
  const int64_t units = p.num_slots * p.num_kv_heads * units_per_row;
  const bool in_grid = index / Tiling::kLanes < units;
  const int64_t unit = in_grid ? index / Tiling::kLanes : 0;
  const int head = static_cast<int>((unit / units_per_row) % p.num_kv_heads);
  const int64_t token = unit / (static_cast<int64_t>(units_per_row) * p.num_kv_heads);
  const int first = static_cast<int>(unit % units_per_row) * Tiling::kUnit;  // the unit's first element

  // K and V are both loaded before either is rotated, so their loads are in flight together.
  Src key[Tiling::kValues], value[Tiling::kValues];
  const Src* key_src = static_cast<const Src*>(p.key) + token * p.key_token_stride + head * p.key_head_stride + first;
  const Src* value_src =
      static_cast<const Src*>(p.value) + token * p.value_token_stride + head * p.value_head_stride + first;
#pragma unroll
  for (int c = 0; c < Tiling::kChunks; ++c) {
    const int at = Tiling::element(lane, c * kChunk);
    load_chunk<kSrc, kChunk, kAligned>(key_src + at, key + c * kChunk);
    load_chunk<kSrc, kChunk, kAligned>(value_src + at, value + c * kChunk);
  }
  const int64_t slot = __ldg(p.slot_mapping + token);
  const int64_t block = slot / p.block_size, offset = slot % p.block_size;
  // Padding tokens and invalid slots (reported in debug-check mode) are not stored.
  const bool store = in_grid && slot >= 0 && block < p.num_blocks;

  auto* key_dst = static_cast<uint8_t*>(p.key_cache.data) + block * p.key_cache.block_stride +
                  offset * p.key_cache.token_stride + head * p.key_cache.head_stride + first;
  const float* key_offset = p.transform.k_offset != nullptr
                                ? p.transform.k_offset + static_cast<int64_t>(head) * p.head_size + first
                                : nullptr;
  transform_and_store<kSrc, kCache, kBlock, kChunk, kAligned>(key, lane, key_dst, *p.k_scale.at(head), key_offset,
                                                              store);

  auto* value_dst = static_cast<uint8_t*>(p.value_cache.data) + block * p.value_cache.block_stride +
                    offset * p.value_cache.token_stride + head * p.value_cache.head_stride + first;
  transform_and_store<kSrc, kCache, kBlock, kChunk, kAligned>(value, lane, value_dst, *p.v_scale.at(head), nullptr,
                                                              store);
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

// Chunks of eight elements: 16-byte loads (bf16/fp16) and 8-byte stores. An offset alone with a head
// size that is not a multiple of 8 goes one element per thread. (Other tilings measured on H100, 128k
// tokens of Llama-3-8B, against the plain write: one chunk per thread, four shuffle rounds for a
// 128-element block, 1.47x; 32 consecutive elements per thread, a warp's load spanning 2 KB, 2.3x;
// this one 1.17x.)
template <DType kSrc, DType kCache>
cudaError_t launch_transformed(const CacheWriteParams& p, cudaStream_t stream) {
  const int block = p.transform.hadamard ? hadamard_block(p.head_size) : 1;
  return dispatch<kRotationBlocks>(block, cudaErrorInvalidValue, [&](auto rotation) {
    constexpr int kBlock = decltype(rotation)::value;
    auto launch = [&](auto chunk, auto aligned) {
      constexpr int kChunk = decltype(chunk)::value;
      using Tiling = WriteTiling<kBlock, kChunk>;
      const int64_t threads = p.num_slots * p.num_kv_heads * (p.head_size / Tiling::kUnit) * Tiling::kLanes;
      if (threads == 0) return cudaSuccess;
      const unsigned blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
      transformed_write_kernel<kSrc, kCache, kBlock, kChunk, decltype(aligned)::value>
          <<<blocks, kThreads, 0, stream>>>(p);
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
