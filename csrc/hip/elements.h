// Device element access for the HIP kernels: fp16/bf16/fp32 through float, and the cache formats
// (FP8 codes or unquantized 16-bit values) loaded eight elements at a time.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>

#include "../fp8.h"
#include "../kernel_params.h"
#include "fp8_unpack.h"

namespace fp8kv::hip {

struct Float16 {
  using Storage = uint16_t;
  __device__ static float to_float(uint16_t h) { return fp16_bits_to_float(h); }
  // Round to nearest even (the hardware conversion in the default rounding mode), overflow to inf.
  __device__ static uint16_t from_float(float x) { return __builtin_bit_cast(uint16_t, static_cast<_Float16>(x)); }
};

struct BFloat16 {
  using Storage = uint16_t;
  __device__ static float to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }
  // Round to nearest even; NaN stays a (quiet) NaN.
  __device__ static uint16_t from_float(float x) {
    const uint32_t u = float_bits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

struct Float32 {
  using Storage = float;
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
};

// Eight consecutive elements of one cache row as floats. `aligned`: the row chunk may be read with one
// 8-byte (FP8) or 16-byte (16-bit) load; otherwise element loads are used.
template <Fp8Format F>
struct Fp8Cache {
  using Storage = uint8_t;
  static constexpr float kUnpackScale = Fp8Unpack<F>::kScale;  // value = loaded * kUnpackScale

  __device__ static void load8(const uint8_t* p, bool aligned, float out[8]) {
    uint32_t words[2];
    if (aligned) {
      const uint2 v = *reinterpret_cast<const uint2*>(p);
      words[0] = v.x;
      words[1] = v.y;
    } else {
      for (int w = 0; w < 2; ++w) {
        words[w] = p[4 * w] | (p[4 * w + 1] << 8) | (p[4 * w + 2] << 16) | (static_cast<uint32_t>(p[4 * w + 3]) << 24);
      }
    }
    Fp8Unpack<F>::unpack4(words[0], out);
    Fp8Unpack<F>::unpack4(words[1], out + 4);
  }
};

template <typename T>
struct PlainCache {
  using Storage = uint16_t;
  static constexpr float kUnpackScale = 1.0f;

  __device__ static void load8(const uint16_t* p, bool aligned, float out[8]) {
    if (aligned) {
      const uint4 v = *reinterpret_cast<const uint4*>(p);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      for (int i = 0; i < 4; ++i) {
        out[2 * i] = T::to_float(static_cast<uint16_t>(words[i] & 0xFFFFu));
        out[2 * i + 1] = T::to_float(static_cast<uint16_t>(words[i] >> 16));
      }
    } else {
      for (int i = 0; i < 8; ++i) out[i] = T::to_float(p[i]);
    }
  }
};

// N elements accessed with one load or store (the caller guarantees the alignment).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

inline __device__ float head_scalar(const HeadScalars& s, int kv_head) { return s.data[s.per_head ? kv_head : 0]; }

}  // namespace fp8kv::hip
