// The 16- and 32-bit float element types: conversions through float (round to nearest even) and the
// adapter every backend's kernels use to load and store them, plus the NaN-propagating max of the
// calibration reductions.
//
// Framework-free, host and device: device code uses the CUDA or HIP conversion instructions, host code
// the bit-exact equivalents below (csrc/checks/check_numerics.cpp checks every 16-bit code); only NaN
// payloads may differ between the two.
#pragma once

#include <cstdint>
#include <type_traits>

#include "dispatch.h"
#include "fp8.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace fp8kv {

FP8KV_HOST_DEVICE float bf16_to_float(uint16_t b) {
#if defined(__CUDA_ARCH__)
  return __bfloat162float(__ushort_as_bfloat16(b));
#else
  return bits_float(static_cast<uint32_t>(b) << 16);
#endif
}

// NaN stays a (quiet) NaN.
FP8KV_HOST_DEVICE uint16_t float_to_bf16(float x) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16(x));
#else
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
#endif
}

FP8KV_HOST_DEVICE float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#elif defined(__HIP_DEVICE_COMPILE__)
  return static_cast<float>(__builtin_bit_cast(_Float16, h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal or zero: mantissa * 2^-24, exact in float.
  const float value = static_cast<float>(mantissa) * exp2_int(-24);
  return sign ? -value : value;
#endif
}

// Overflow past 65504 rounds to inf.
FP8KV_HOST_DEVICE uint16_t float_to_half(float x) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half(x));
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_bit_cast(uint16_t, static_cast<_Float16>(x));
#else
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): count units of 2^-24, rounding half to even.
    const float units = rintf(bits_float(magnitude) * exp2_int(24));
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
  }
  // Normal: rebias the exponent and round the 13 dropped mantissa bits half to even.
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t rounded = rebased + 0xFFFu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
#endif
}

// A float16, bfloat16 or float32 element: its storage and its conversions through float.
template <DType T>
struct Element {
  static_assert(T == DType::kFloat16 || T == DType::kBFloat16 || T == DType::kFloat32, "16/32-bit floats only");
  using Storage = std::conditional_t<T == DType::kFloat32, float, uint16_t>;

  static FP8KV_HOST_DEVICE float to_float(Storage x) {
    if constexpr (T == DType::kFloat32) return x;
    else return T == DType::kFloat16 ? half_to_float(x) : bf16_to_float(x);
  }
  static FP8KV_HOST_DEVICE Storage from_float(float x) {
    if constexpr (T == DType::kFloat32) return x;
    else return T == DType::kFloat16 ? float_to_half(x) : float_to_bf16(x);
  }
};

// max that propagates NaN from either side (a calibration must see a NaN input).
FP8KV_HOST_DEVICE float nan_max(float a, float b) {
  return (a != a || b != b) ? bits_float(0x7FC00000u) : (a > b ? a : b);
}

}  // namespace fp8kv
