// Exact FP8 -> float unpacking of four codes at a time, for the attention inner loops.
//
// An e4m3 code's magnitude bits moved into an fp16's exponent and mantissa fields form an fp16 equal
// to the FP8 value times 2^(bias - 15), normals and subnormals alike; fp16 -> fp32 is exact and needs
// no fp32 denormal support. So `unpack4` returns value / kScale with kScale = 2^(15 - bias) a power
// of two, which the kernels fold into their logit and output scales instead of multiplying every
// element. e5m2 is the top byte of an fp16 (kScale = 1). NaN codes, which the bit move would turn into
// finite numbers, are patched behind a cheap any-NaN test on the whole word.
//
// Host-and-device code: scripts/check_hip_sources.sh runs it on the host against fp8_decode for every
// code of every format.
#pragma once

#include <cstdint>

#include "../fp8.h"

#if !defined(__HIP_DEVICE_COMPILE__)
#include "../half_float.h"
#endif

namespace fp8kv::hip {

FP8KV_HOST_DEVICE float fp16_bits_to_float(uint32_t bits) {
#if defined(__HIP_DEVICE_COMPILE__)
  return static_cast<float>(__builtin_bit_cast(_Float16, static_cast<uint16_t>(bits)));
#else
  return half_to_float(static_cast<uint16_t>(bits));
#endif
}

// Codes 2i and 2i+1 of `word` (bytes i*16 .. i*16+15) moved into the low bytes of two 16-bit lanes.
FP8KV_HOST_DEVICE uint32_t spread_code_pair(uint32_t word, int pair) {
  const uint32_t two = (word >> (16 * pair)) & 0xFFFFu;
  return (two & 0xFFu) | ((two & 0xFF00u) << 8);
}

template <Fp8Format F>
struct Fp8Unpack;

template <Fp8Format F>
struct E4M3Unpack {
  static constexpr float kScale = static_cast<float>(1u << (15 - Fp8Traits<F>::kExponentBias));

  // Nonzero if some byte of `word` is a NaN code of F (exact as an any-test; not per byte).
  FP8KV_HOST_DEVICE static uint32_t nan_bytes(uint32_t word) {
    if (F == Fp8Format::kE4M3FN) return ((word & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;  // low 7 bits all set
    const uint32_t x = word ^ 0x80808080u;  // e4m3fnuz: a byte equal to 0x80 becomes zero
    return (x - 0x01010101u) & ~x & 0x80808080u;
  }

  FP8KV_HOST_DEVICE static bool is_nan(uint32_t code) {
    return F == Fp8Format::kE4M3FN ? (code & 0x7Fu) == 0x7Fu : code == 0x80u;
  }

  FP8KV_HOST_DEVICE static void unpack4(uint32_t word, float out[4]) {
    for (int pair = 0; pair < 2; ++pair) {
      const uint32_t codes = spread_code_pair(word, pair);
      const uint32_t halves = ((codes & 0x00800080u) << 8) | ((codes & 0x007F007Fu) << 7);
      out[2 * pair] = fp16_bits_to_float(halves & 0xFFFFu);
      out[2 * pair + 1] = fp16_bits_to_float(halves >> 16);
    }
    if (nan_bytes(word) != 0) {
      for (int i = 0; i < 4; ++i) {
        if (is_nan((word >> (8 * i)) & 0xFFu)) out[i] = bits_float(0x7FC00000u);
      }
    }
  }
};

template <>
struct Fp8Unpack<Fp8Format::kE4M3FN> : E4M3Unpack<Fp8Format::kE4M3FN> {};

template <>
struct Fp8Unpack<Fp8Format::kE4M3FNUZ> : E4M3Unpack<Fp8Format::kE4M3FNUZ> {};

template <>
struct Fp8Unpack<Fp8Format::kE5M2> {
  static constexpr float kScale = 1.0f;

  FP8KV_HOST_DEVICE static void unpack4(uint32_t word, float out[4]) {
    for (int pair = 0; pair < 2; ++pair) {
      const uint32_t halves = spread_code_pair(word, pair) << 8;
      out[2 * pair] = fp16_bits_to_float(halves & 0xFFFFu);
      out[2 * pair + 1] = fp16_bits_to_float(halves >> 16);
    }
  }
};

}  // namespace fp8kv::hip
