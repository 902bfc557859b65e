// The CPU attention's cache loads: a tile of one KV head's cached positions as fp32, W elements at a
// time in vectors (tile_math.h's Simd), exactly the codec's values (csrc/checks/check_numerics.cpp
// checks every code of every format against the scalar codec).
//
// FP8 and fp16 codes are decoded with integer arithmetic on their bits, not a table: a table lookup
// per element, not the products, was most of a decode step's time. A normal code's exponent and
// mantissa fields, shifted into a float's and rebiased, are the float; a subnormal code's mantissa
// converted to float and scaled by a power of two is its value; special codes are patched by a select.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "../float_conversions.h"
#include "../fp8.h"
#include "tile_math.h"

namespace fp8kv::cpu {

// W 32-bit lanes.
template <int W>
struct Lanes {
  // typedef in a class: GCC drops a vector_size that depends on a template parameter from a typedef in
  // a function.
  typedef uint32_t Bits __attribute__((vector_size(W * sizeof(uint32_t))));
};

// Elements per 32-bit lane: codes are read 4 bytes to a lane and taken apart with shifts and masks
// (GCC widens vectors of bytes to vectors of ints one element at a time).
template <DType F>
inline constexpr int kPerLane = 4 / dtype_bytes(F);

// Part `part` of W lanes of packed elements: element kPerLane * l + part, zero-extended, in lane l.
template <DType F, int W>
FP8KV_ALWAYS_INLINE typename Lanes<W>::Bits unpack(const typename Lanes<W>::Bits& packed, int part) {
  constexpr int kBits = 8 * dtype_bytes(F);
  if constexpr (kBits == 32) return packed;
  else return (packed >> (kBits * part)) & ((1u << kBits) - 1u);
}

// The bits of small integers times 2^exponent (converted as int32: unsigned conversions are not vector
// instructions before AVX-512).
template <int W>
FP8KV_ALWAYS_INLINE typename Lanes<W>::Bits scaled(const typename Lanes<W>::Bits& magnitude, int exponent) {
  using S = Simd<W>;
  return S::template bit_cast<typename Lanes<W>::Bits>(
      __builtin_convertvector(S::template bit_cast<typename S::Int>(magnitude), typename S::Vec) * exp2_int(exponent));
}

// W zero-extended codes of an FP8 format (or fp16 / bf16 / fp32 elements) -> W floats.
template <DType F, int W>
FP8KV_ALWAYS_INLINE typename Simd<W>::Vec decode_codes(const typename Lanes<W>::Bits& code) {
  using S = Simd<W>;
  using Vec = typename S::Vec;
  using Bits = typename Lanes<W>::Bits;
  if constexpr (F == DType::kFloat32) {
    return S::template bit_cast<Vec>(code);
  } else if constexpr (F == DType::kBFloat16) {
    return S::template bit_cast<Vec>(code << 16);
  } else if constexpr (F == DType::kFloat16) {
    const Bits magnitude = code & 0x7FFFu;
    Bits bits = magnitude < 0x400u ? scaled<W>(magnitude, -24) : (magnitude << 13) + (112u << 23);
    bits = magnitude >= 0x7C00u ? (magnitude << 13) | 0x7F800000u : bits;  // inf, NaN (payload kept)
    return S::template bit_cast<Vec>(bits | (code & 0x8000u) << 16);
  } else {
    using T = Fp8Traits<F>;
    constexpr int kMantissa = T::kMantissaBits;
    const Bits magnitude = code & 0x7Fu;
    Bits bits = magnitude < (1u << kMantissa)
                    ? scaled<W>(magnitude, T::kMinNormalExponent - kMantissa)
                    : (magnitude << (23 - kMantissa)) + (static_cast<uint32_t>(127 - T::kExponentBias) << 23);
    bits |= (code & 0x80u) << 24;
    const Bits nan = Bits{} + 0x7FC00000u;  // the scalar codec's NaN
    if constexpr (F == DType::kFloat8E4M3FN) {
      bits = magnitude == 0x7Fu ? nan : bits;
    } else if constexpr (F == DType::kFloat8E4M3FNUZ) {
      bits = code == 0x80u ? nan : bits;
    } else {  // e5m2: the top exponent holds inf (mantissa 0) and NaNs
      bits = magnitude == 0x7Cu ? (code & 0x80u) << 24 | 0x7F800000u : bits;
      bits = magnitude > 0x7Cu ? nan : bits;
    }
    return S::template bit_cast<Vec>(bits);
  }
}

template <DType F>
FP8KV_ALWAYS_INLINE float decode_element(const uint8_t* src) {
  if constexpr (is_fp8(F)) {
    return fp8_decode<F>(*src);
  } else {
    typename Element<F>::Storage x;
    std::memcpy(&x, src, sizeof x);
    return Element<F>::to_float(x);
  }
}

namespace detail {

// Lane l of the results: lane l of a, or of b when bit kBit of l is set, moved by kBit lanes, so that
// rows a and b of a square block swap their off-diagonal kBit x kBit blocks (see transpose).
template <int W, int kBit, typename Vec, int... kLane>
FP8KV_ALWAYS_INLINE void swap_blocks(Vec& a, Vec& b, std::integer_sequence<int, kLane...>) {
  const Vec low = __builtin_shufflevector(a, b, ((kLane & kBit) ? W + kLane - kBit : kLane)...);
  const Vec high = __builtin_shufflevector(a, b, ((kLane & kBit) ? W + kLane : kLane + kBit)...);
  a = low, b = high;
}

// Lanes [0, W / 2) of a and b interleaved (a0 b0 a1 b1 ...), then lanes [W / 2, W).
template <int W, typename Vec, int... kLane>
FP8KV_ALWAYS_INLINE void interleave(Vec& a, Vec& b, std::integer_sequence<int, kLane...>) {
  const Vec low = __builtin_shufflevector(a, b, ((kLane & 1) ? W + kLane / 2 : kLane / 2)...);
  const Vec high = __builtin_shufflevector(a, b, ((kLane & 1) ? W + (W + kLane) / 2 : (W + kLane) / 2)...);
  a = low, b = high;
}

}  // namespace detail

// rows[i][l] <-> rows[l][i]: for each bit of the index, the rows differing in it swap the off-diagonal
// blocks of that size (the swaps commute; all of them together exchange row and lane indices).
template <int W, int kBit = W / 2>
FP8KV_ALWAYS_INLINE void transpose(typename Simd<W>::Vec (&rows)[W]) {
  for (int i = 0; i < W; ++i) {
    if ((i & kBit) == 0) detail::swap_blocks<W, kBit>(rows[i], rows[i + kBit], std::make_integer_sequence<int, W>{});
  }
  if constexpr (kBit > 1) transpose<W, kBit / 2>(rows);
}

// parts[b] holds elements kPerLane * l + b in lane l -> the elements in order, W per vector.
template <int W, int kParts>
FP8KV_ALWAYS_INLINE void interleave_parts(typename Simd<W>::Vec (&parts)[kParts]) {
  constexpr auto lanes = std::make_integer_sequence<int, W>{};
  if constexpr (kParts == 2) {
    detail::interleave<W>(parts[0], parts[1], lanes);
  } else if constexpr (kParts == 4) {
    detail::interleave<W>(parts[0], parts[2], lanes);  // elements 4l, 4l + 2
    detail::interleave<W>(parts[1], parts[3], lanes);  // 4l + 1, 4l + 3
    detail::interleave<W>(parts[0], parts[1], lanes);
    detail::interleave<W>(parts[2], parts[3], lanes);
  }
}

template <int W>
FP8KV_ALWAYS_INLINE typename Lanes<W>::Bits load_lanes(const uint8_t* src) {
  typename Lanes<W>::Bits packed;
  std::memcpy(&packed, src, sizeof packed);
  return packed;
}

// Elements [0, dims) from byte `offset` of `count` cached rows (rows[i] + offset) as fp32 (scales not
// applied): row i's element d goes to dst[i * row_stride + d]. Dims past the last whole vector group
// go to narrower vectors, then one at a time.
template <DType F, int W>
FP8KV_ALWAYS_INLINE void load_rows(const uint8_t* const* rows, int64_t offset, int count, int dims, float* dst,
                                   int64_t row_stride) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "codes are unpacked from little-endian lanes");
  constexpr int kBytes = dtype_bytes(F), kParts = kPerLane<F>, kGroup = W * kParts;
  const int vector_dims = dims / kGroup * kGroup;
  for (int i = 0; i < count; ++i) {
    for (int d = 0; d < vector_dims; d += kGroup) {
      const auto packed = load_lanes<W>(rows[i] + offset + d * kBytes);
      typename Simd<W>::Vec parts[kParts];
      for (int b = 0; b < kParts; ++b) parts[b] = decode_codes<F, W>(unpack<F, W>(packed, b));
      interleave_parts<W, kParts>(parts);
      for (int b = 0; b < kParts; ++b) Simd<W>::store(dst + i * row_stride + d + b * W, parts[b]);
    }
  }
  if (vector_dims == dims) return;
  if constexpr (W > 4) {
    load_rows<F, W / 2>(rows, offset + vector_dims * kBytes, count, dims - vector_dims, dst + vector_dims,
                        row_stride);
  } else {
    for (int i = 0; i < count; ++i) {
      for (int d = vector_dims; d < dims; ++d) {
        dst[i * row_stride + d] = decode_element<F>(rows[i] + offset + d * kBytes);
      }
    }
  }
}

// The same elements transposed: row i's element d goes to dst[d * dim_stride + i]. A block of W rows
// by W dims (one part of each lane) is decoded row by row and transposed in registers, so that loads
// and stores stay vectors. Rows and dims past the whole blocks go to narrower vectors, then one at a
// time.
template <DType F, int W>
FP8KV_ALWAYS_INLINE void load_rows_transposed(const uint8_t* const* rows, int64_t offset, int count, int dims,
                                              float* dst, int64_t dim_stride) {
  constexpr int kBytes = dtype_bytes(F), kParts = kPerLane<F>, kGroup = W * kParts;
  const int vector_rows = count / W * W;
  const int vector_dims = dims / kGroup * kGroup;
  for (int i = 0; i < vector_rows; i += W) {
    for (int d = 0; d < vector_dims; d += kGroup) {
      for (int b = 0; b < kParts; ++b) {
        typename Simd<W>::Vec block[W];
        for (int k = 0; k < W; ++k) {
          block[k] = decode_codes<F, W>(unpack<F, W>(load_lanes<W>(rows[i + k] + offset + d * kBytes), b));
        }
        transpose<W>(block);  // block[l]: element kParts * l + b of rows i .. i + W
        for (int l = 0; l < W; ++l) Simd<W>::store(dst + (d + kParts * l + b) * dim_stride + i, block[l]);
      }
    }
  }
  const int64_t rest = offset + vector_dims * kBytes;
  if constexpr (W > 4) {
    if (vector_dims < dims) {
      load_rows_transposed<F, W / 2>(rows, rest, vector_rows, dims - vector_dims, dst + vector_dims * dim_stride,
                                     dim_stride);
    }
    if (vector_rows < count) {
      load_rows_transposed<F, W / 2>(rows + vector_rows, offset, count - vector_rows, dims, dst + vector_rows,
                                     dim_stride);
    }
  } else {
    for (int d = vector_dims; d < dims; ++d) {
      for (int i = 0; i < vector_rows; ++i) dst[d * dim_stride + i] = decode_element<F>(rows[i] + offset + d * kBytes);
    }
    for (int d = 0; d < dims; ++d) {
      for (int i = vector_rows; i < count; ++i) {
        dst[d * dim_stride + i] = decode_element<F>(rows[i] + offset + d * kBytes);
      }
    }
  }
}

}  // namespace fp8kv::cpu
