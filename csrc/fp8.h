// FP8 formats and their saturating round-to-nearest-even codecs.
//
// Framework-free: included by the CPU, CUDA and HIP kernels alike, so every backend produces the same
// bytes for the same input. The encoder matches CUDA's
// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)`: finite overflow and +-inf clamp to +-max finite,
// NaN becomes the format's canonical NaN code, ties go to the even code, the sign of zero is kept
// (except in e4m3fnuz, which has no negative zero).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FP8KV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FP8KV_HOST_DEVICE inline
#endif

namespace fp8kv {

enum class Fp8Format : int { kE4M3FN = 0, kE5M2 = 1, kE4M3FNUZ = 2 };

// Bit layout and limits of one format. Exponents are unbiased.
template <Fp8Format F>
struct Fp8Traits;

template <>
struct Fp8Traits<Fp8Format::kE4M3FN> {
  static constexpr int kMantissaBits = 3;
  static constexpr int kExponentBias = 7;
  static constexpr int kMinNormalExponent = -6;
  static constexpr uint8_t kMaxCode = 0x7E;  // 448
  static constexpr uint8_t kNanCode = 0x7F;  // 0x7F and 0xFF are the NaNs; no infinities
  static constexpr float kMaxFinite = 448.0f;
  static constexpr bool kHasNegativeZero = true;
};

template <>
struct Fp8Traits<Fp8Format::kE5M2> {
  static constexpr int kMantissaBits = 2;
  static constexpr int kExponentBias = 15;
  static constexpr int kMinNormalExponent = -14;
  static constexpr uint8_t kMaxCode = 0x7B;  // 57344; 0x7C is +inf, 0x7D..0x7F are NaNs
  static constexpr uint8_t kNanCode = 0x7F;
  static constexpr float kMaxFinite = 57344.0f;
  static constexpr bool kHasNegativeZero = true;
};

template <>
struct Fp8Traits<Fp8Format::kE4M3FNUZ> {
  static constexpr int kMantissaBits = 3;
  static constexpr int kExponentBias = 8;
  static constexpr int kMinNormalExponent = -7;
  static constexpr uint8_t kMaxCode = 0x7F;  // 240
  static constexpr uint8_t kNanCode = 0x80;  // the only NaN; no infinities, no negative zero
  static constexpr float kMaxFinite = 240.0f;
  static constexpr bool kHasNegativeZero = false;
};

FP8KV_HOST_DEVICE uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

FP8KV_HOST_DEVICE float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

// 2^e for e in the float normal range, built from bits (exact, no libm).
FP8KV_HOST_DEVICE float exp2_int(int e) { return bits_float(static_cast<uint32_t>(e + 127) << 23); }

// float -> FP8 code, saturating, round to nearest even.
template <Fp8Format F>
FP8KV_HOST_DEVICE uint8_t fp8_encode(float x) {
  using T = Fp8Traits<F>;
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t magnitude_bits = u & 0x7FFFFFFFu;
  if (magnitude_bits > 0x7F800000u) return T::kNanCode;
  const float a = bits_float(magnitude_bits);
  if (a >= T::kMaxFinite) return static_cast<uint8_t>(sign | T::kMaxCode);  // also +-inf
  // The quantum (spacing of FP8 values) in a's binade; subnormals share the lowest normal binade's.
  int exponent = static_cast<int>(magnitude_bits >> 23) - 127;
  if (exponent < T::kMinNormalExponent) exponent = T::kMinNormalExponent;
  const int quantum_exponent = exponent - T::kMantissaBits;
  // Scaling by a power of two is exact; rintf rounds half to even in the default rounding mode.
  const uint32_t steps = static_cast<uint32_t>(rintf(a * exp2_int(-quantum_exponent)));
  if (steps == 0) return T::kHasNegativeZero ? sign : uint8_t{0};
  // steps counts quanta from the binade's start; the same sum also encodes the carry into the next
  // binade (steps == 2^(m+1)) and the subnormal-to-normal boundary (steps == 2^m).
  const uint32_t code = (static_cast<uint32_t>(exponent - T::kMinNormalExponent) << T::kMantissaBits) + steps;
  return static_cast<uint8_t>(sign | code);
}

// FP8 code -> float (exact: every FP8 value is a float).
template <Fp8Format F>
FP8KV_HOST_DEVICE float fp8_decode(uint8_t code) {
  using T = Fp8Traits<F>;
  constexpr uint32_t kMantissaMask = (1u << T::kMantissaBits) - 1u;
  constexpr uint32_t kExponentMask = (0x7Fu >> T::kMantissaBits);
  const uint32_t magnitude = code & 0x7Fu;
  const bool negative = (code & 0x80u) != 0;
  if (F == Fp8Format::kE4M3FNUZ && code == 0x80u) return bits_float(0x7FC00000u);
  if (F == Fp8Format::kE4M3FN && magnitude == 0x7Fu) return bits_float(0x7FC00000u);
  const uint32_t exponent_field = magnitude >> T::kMantissaBits;
  const uint32_t mantissa = magnitude & kMantissaMask;
  if (F == Fp8Format::kE5M2 && exponent_field == kExponentMask) {
    return bits_float(mantissa ? 0x7FC00000u : (negative ? 0xFF800000u : 0x7F800000u));
  }
  // Subnormals: mantissa * 2^(min_normal - m); normals: (2^m + mantissa) * 2^(e - bias - m).
  const int exponent = exponent_field == 0 ? T::kMinNormalExponent : static_cast<int>(exponent_field) - T::kExponentBias;
  const uint32_t significand = exponent_field == 0 ? mantissa : (mantissa | (1u << T::kMantissaBits));
  const float value = static_cast<float>(significand) * exp2_int(exponent - T::kMantissaBits);
  return negative ? -value : value;
}

}  // namespace fp8kv
