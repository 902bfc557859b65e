// Host-side fp16 / bf16 <-> fp32 conversions (round to nearest even), framework-free.
// Device code uses the CUDA/HIP intrinsics instead.
#pragma once

#include <cstdint>

#include "fp8.h"

namespace fp8kv {

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal or zero: mantissa * 2^-24, exact in float.
  const float value = static_cast<float>(mantissa) * exp2_int(-24);
  return sign ? -value : value;
}

inline uint16_t float_to_half(float x) {
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
}

}  // namespace fp8kv
