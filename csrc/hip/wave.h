// Wavefront-64 building blocks shared by the HIP kernels.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>

#include "../fp8.h"

#if defined(__AMDGCN_WAVEFRONT_SIZE)
static_assert(__AMDGCN_WAVEFRONT_SIZE == 64, "fp8kv's HIP kernels are written for 64-lane wavefronts (CDNA)");
#endif

namespace fp8kv::hip {

constexpr int kWaveSize = 64;

inline __device__ float nan_float() { return bits_float(0x7FC00000u); }

// max that propagates NaN from either side (calibration must see a NaN input).
inline __device__ float nan_max(float a, float b) { return (a != a || b != b) ? nan_float() : fmaxf(a, b); }

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

}  // namespace fp8kv::hip
