// Device building blocks shared by the HIP kernels: wavefront-64 reductions, the rotated recipe's
// butterflies across lanes, the cache formats (FP8 codes or unquantized 16-bit values) loaded eight
// elements at a time, vector accesses.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../float_conversions.h"
#include "../fp8.h"
#include "../hadamard.h"
#include "../kernel_params.h"

#if defined(__AMDGCN_WAVEFRONT_SIZE)
static_assert(__AMDGCN_WAVEFRONT_SIZE == 64, "fp8kv's HIP kernels are written for 64-lane wavefronts (CDNA)");
#endif

namespace fp8kv::hip {

constexpr int kWaveSize = 64;

// Butterfly reductions over the wavefront; every lane gets the result.
inline __device__ float wave_sum(float x) {
  for (int offset = kWaveSize / 2; offset > 0; offset /= 2) x += __shfl_xor(x, offset);
  return x;
}

// NaN-ignoring max, like std::max in the CPU softmax.
inline __device__ float wave_max(float x) {
  for (int offset = kWaveSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor(x, offset));
  return x;
}

inline __device__ uint32_t wave_max_bits(uint32_t x) {
  for (int offset = kWaveSize / 2; offset > 0; offset /= 2) {
    x = max(x, static_cast<uint32_t>(__shfl_xor(static_cast<int>(x), offset)));
  }
  return x;
}

// Folds `value` into *target with nan_max, atomically (compare-and-swap on the bits).
inline __device__ void atomic_nan_max(float* target, float value) {
  auto* word = reinterpret_cast<unsigned int*>(target);
  unsigned int seen = *word;
  while (true) {
    const unsigned int wanted = float_bits(nan_max(bits_float(seen), value));
    if (wanted == seen) return;
    const unsigned int previous = atomicCAS(word, seen, wanted);
    if (previous == seen) return;
    seen = previous;
  }
}

// The unnormalized block Hadamard of csrc/hadamard.h (hadamard_blocks: butterflies h = 1, 2, ...,
// block / 2 in that order, so the bits equal the host's) on rows spread over consecutive lanes: a lane
// holds kValues consecutive elements, a row's first lane is a multiple of block / kValues. Pairs
// closer than kValues lie within a lane; farther ones are h / kValues lanes apart and meet through a
// shuffle. Every lane of the wavefront calls it with the same block, kValues <= block <= 64 * kValues.
template <int kValues>
__device__ void hadamard_across_lanes(float (&x)[kValues], int block) {
#pragma unroll
  for (int h = 1; h < kValues; h *= 2) {
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      if ((i & h) == 0) butterfly(x[i], x[i + h]);
    }
  }
  const int lane = threadIdx.x % kWaveSize;
  for (int lanes = 1; lanes < block / kValues; lanes *= 2) {
    const bool upper = (lane & lanes) != 0;  // this lane holds the pairs' second elements
#pragma unroll
    for (int i = 0; i < kValues; ++i) {
      const float other = __shfl_xor(x[i], lanes);
      x[i] = upper ? other - x[i] : x[i] + other;
    }
  }
}

// N elements accessed with one load or store (the caller guarantees the alignment).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Eight consecutive elements of one cache row of dtype C as floats, divided by kUnpackScale (a power
// of two the kernels fold into their scales; see fp8x4_to_half2x2). `aligned`: the row chunk may be
// read with one 8-byte (FP8) or 16-byte (16-bit) load; otherwise element loads are used.
template <DType C>
struct CacheRow {
  using Storage = std::conditional_t<is_fp8(C), uint8_t, uint16_t>;
  static constexpr float kUnpackScale = fp8_half_scale<C>();

  __device__ static void load8(const Storage* p, bool aligned, float out[8]) {
    Vec<Storage, 8> elements;
    if (aligned) {
      elements = *reinterpret_cast<const Vec<Storage, 8>*>(p);
    } else {
      for (int i = 0; i < 8; ++i) elements.v[i] = p[i];
    }
    // Four pairs of 16-bit values (FP8 codes converted to fp16 pairs).
    uint32_t pairs[4];
    if constexpr (is_fp8(C)) {
      uint32_t codes[2];
      memcpy(codes, elements.v, sizeof(codes));
      fp8x4_to_half2x2<C>(codes[0], pairs[0], pairs[1]);
      fp8x4_to_half2x2<C>(codes[1], pairs[2], pairs[3]);
    } else {
      memcpy(pairs, elements.v, sizeof(pairs));
    }
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = to_float(static_cast<uint16_t>(pairs[i] & 0xFFFFu));
      out[2 * i + 1] = to_float(static_cast<uint16_t>(pairs[i] >> 16));
    }
  }

 private:
  __device__ static float to_float(uint16_t bits) {
    if constexpr (C == DType::kBFloat16) return bf16_to_float(bits);
    return half_to_float(bits);  // FP8 codes are converted to fp16
  }
};

}  // namespace fp8kv::hip
