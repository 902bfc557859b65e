// FP8 formats: their saturating round-to-nearest-even codecs, and the unpacking of four codes to
// fp16 bits that the attention kernels use.
//
// Framework-free: included by the CPU, CUDA and HIP kernels alike, so every backend produces the same
// bytes for the same input. The encoder matches CUDA's
// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)`: finite overflow and +-inf clamp to +-max finite,
// NaN becomes the format's canonical NaN code, ties go to the even code, the sign of zero is kept
// (except in e4m3fnuz, which has no negative zero). csrc/checks/check_numerics.cpp checks every code
// of every format.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dispatch.h"

namespace fp8kv {

// Bit layout and limits of an FP8 format. Exponents are unbiased.
template <int kMantissa, int kBias, uint8_t kMax, uint8_t kNan, int kMaxValue, bool kNegativeZero>
struct Fp8Layout {
  static constexpr int kMantissaBits = kMantissa;
  static constexpr int kExponentBias = kBias;
  static constexpr int kMinNormalExponent = 1 - kBias;
  static constexpr uint8_t kMaxCode = kMax;  // largest finite magnitude
  static constexpr uint8_t kNanCode = kNan;  // the canonical NaN the encoder writes
  static constexpr float kMaxFinite = static_cast<float>(kMaxValue);
  static constexpr bool kHasNegativeZero = kNegativeZero;
};

template <DType F>
struct Fp8Traits;
// 0x7F and 0xFF are the NaNs; no infinities.
template <>
struct Fp8Traits<DType::kFloat8E4M3FN> : Fp8Layout<3, 7, 0x7E, 0x7F, 448, true> {};
// 0x7C is +inf, 0x7D..0x7F are NaNs.
template <>
struct Fp8Traits<DType::kFloat8E5M2> : Fp8Layout<2, 15, 0x7B, 0x7F, 57344, true> {};
// 0x80 is the only NaN; no infinities, no negative zero.
template <>
struct Fp8Traits<DType::kFloat8E4M3FNUZ> : Fp8Layout<3, 8, 0x7F, 0x80, 240, false> {};

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
template <DType F>
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
template <DType F>
FP8KV_HOST_DEVICE float fp8_decode(uint8_t code) {
  using T = Fp8Traits<F>;
  constexpr uint32_t kMantissaMask = (1u << T::kMantissaBits) - 1u;
  constexpr uint32_t kExponentMask = (0x7Fu >> T::kMantissaBits);
  const uint32_t magnitude = code & 0x7Fu;
  const bool negative = (code & 0x80u) != 0;
  if (F == DType::kFloat8E4M3FNUZ && code == 0x80u) return bits_float(0x7FC00000u);
  if (F == DType::kFloat8E4M3FN && magnitude == 0x7Fu) return bits_float(0x7FC00000u);
  const uint32_t exponent_field = magnitude >> T::kMantissaBits;
  const uint32_t mantissa = magnitude & kMantissaMask;
  if (F == DType::kFloat8E5M2 && exponent_field == kExponentMask) {
    return bits_float(mantissa ? 0x7FC00000u : (negative ? 0xFF800000u : 0x7F800000u));
  }
  // Subnormals: mantissa * 2^(min_normal - m); normals: (2^m + mantissa) * 2^(e - bias - m).
  const int exponent = exponent_field == 0 ? T::kMinNormalExponent : static_cast<int>(exponent_field) - T::kExponentBias;
  const uint32_t significand = exponent_field == 0 ? mantissa : (mantissa | (1u << T::kMantissaBits));
  const float value = static_cast<float>(significand) * exp2_int(exponent - T::kMantissaBits);
  return negative ? -value : value;
}

// ---- four codes at once, for the attention kernels -------------------------------------------------
//
// An e4m3 code's magnitude bits moved into an fp16's exponent and mantissa fields form an fp16 equal
// to the FP8 value times 2^(bias - 15), normals and subnormals alike, and e5m2 is the top byte of an
// fp16. So fp8x4_to_half2x2 yields fp16 bits of value / fp8_half_scale<F>(), a power of two the kernels
// fold into their scales instead of multiplying every element. NaN codes, which the bit move would turn
// into finite numbers, are patched behind a cheap any-NaN test of the whole word.

// 1 for a 16-bit dtype, whose values need no conversion.
template <DType F>
constexpr float fp8_half_scale() {
  if constexpr (is_fp8(F)) {
    return static_cast<float>(1u << (15 - Fp8Traits<F>::kExponentBias));
  } else {
    return 1.0f;
  }
}

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FP8KV_HOST_DEVICE_NOINLINE __host__ __device__ __noinline__
#define FP8KV_UNROLL _Pragma("unroll")
#else
#define FP8KV_HOST_DEVICE_NOINLINE __attribute__((noinline))
#define FP8KV_UNROLL
#endif

// Bytes of (b:a) picked by the selector's four nibbles, low result byte first (CUDA's __byte_perm).
FP8KV_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, selector);
#else
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t result = 0;
  for (int i = 0; i < 4; ++i) {
    result |= static_cast<uint32_t>((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  }
  return result;
#endif
}

namespace detail {

// Nonzero iff some byte of v is zero.
FP8KV_HOST_DEVICE uint32_t has_zero_byte(uint32_t v) { return (v - 0x01010101u) & ~v & 0x80808080u; }

// fp16 bits of sign | (magnitude << 7): the e4m3 value times 2^(bias - 15).
FP8KV_HOST_DEVICE void e4m3_bits_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t x0 = byte_perm(w, 0u, 0x1404u);  // [0, b0, 0, b1]
  const uint32_t x1 = byte_perm(w, 0u, 0x3424u);  // [0, b2, 0, b3]
  lo = (x0 & 0x80008000u) | ((x0 >> 1) & 0x3F803F80u);
  hi = (x1 & 0x80008000u) | ((x1 >> 1) & 0x3F803F80u);
}

// Out of line: NaN codes are rare, and the inlined loop would cost registers in every caller.
template <DType F>
FP8KV_HOST_DEVICE_NOINLINE void patch_nan_codes(uint32_t w, uint32_t& lo, uint32_t& hi) {
  uint32_t halves[2] = {lo, hi};
  FP8KV_UNROLL
  for (int i = 0; i < 4; ++i) {
    const uint32_t code = (w >> (8 * i)) & 0xFFu;
    const bool nan = F == DType::kFloat8E4M3FNUZ ? code == 0x80u : (code & 0x7Fu) == 0x7Fu;
    if (nan) halves[i / 2] |= 0x7E00u << (16 * (i % 2));
  }
  lo = halves[0], hi = halves[1];
}

}  // namespace detail

// The FP8 codes (b0, b1) and (b2, b3) of `w` as two fp16 pairs (low half first) holding the values
// divided by fp8_half_scale<F>().
template <DType F>
FP8KV_HOST_DEVICE void fp8x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  static_assert(is_fp8(F), "FP8 dtypes only");
  if constexpr (F == DType::kFloat8E5M2) {
    lo = byte_perm(w, 0u, 0x1404u);
    hi = byte_perm(w, 0u, 0x3424u);
  } else {
    detail::e4m3_bits_to_half2x2(w, lo, hi);
    // NaN codes: 0x80 in fnuz; 0x7F and 0xFF in e4m3fn.
    const uint32_t nan_probe =
        F == DType::kFloat8E4M3FNUZ ? (w ^ 0x80808080u) : ((w & 0x7F7F7F7Fu) ^ 0x7F7F7F7Fu);
    if (detail::has_zero_byte(nan_probe)) detail::patch_nan_codes<F>(w, lo, hi);
  }
}

}  // namespace fp8kv
