// Host check of the framework-free layer, run by scripts/check_cuda_sources.sh and
// scripts/check_hip_sources.sh; not part of the library. Exhaustive where it is numerics:
//   - fp8x4_to_half2x2 (the kernels' FP8 unpacking): every code of every format at every byte
//     position of a word, next to other codes, equals fp8_decode bit for bit once scaled back;
//   - fp8_decode / fp8_encode: every code round-trips (NaN to the canonical NaN, inf to the max);
//   - fp16 and bf16: every code converts to the exactly computed float and back, and every midpoint
//     between neighbouring codes rounds to the even one;
//   - the CPU kernel's vector decode (cpu/cache_tile.h): every code of every cache format at every
//     lane, in vectors of 4, 8 and 16, equals the scalar codec bit for bit; its tile loads, plain and
//     transposed, equal element-by-element decoding for every count and head size up to 40;
//   - nan_max over special values; visible_keys against a position-by-position definition;
//   - dispatch and format_list.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "../float_conversions.h"
#include "../fp8.h"
#include "../kernel_params.h"
#include "../cpu/cache_tile.h"
#include "expect.h"

namespace fp8kv {
namespace {

using checks::expect;

bool same_float(float a, float b) { return std::isnan(a) ? std::isnan(b) : float_bits(a) == float_bits(b); }

std::string hex(uint32_t x) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%x", x);
  return text;
}

template <DType F>
void check_fp8(const char* name) {
  for (uint32_t a = 0; a < 256; ++a) {
    // Codec: every code round-trips.
    const float value = fp8_decode<F>(static_cast<uint8_t>(a));
    const uint8_t expected = std::isnan(value)   ? Fp8Traits<F>::kNanCode
                             : std::isinf(value) ? static_cast<uint8_t>((a & 0x80u) | Fp8Traits<F>::kMaxCode)
                                                 : static_cast<uint8_t>(a);
    expect(fp8_encode<F>(value) == expected, std::string(name) + " encode(decode(" + hex(a) + "))");
    for (uint32_t b = 0; b < 256; ++b) {
      // (a, b) in the low half and, swapped with a scrambled pair, in the high half.
      const uint32_t other = ((a * 7u + 13u) & 0xFFu) | (((b * 11u + 5u) & 0xFFu) << 8);
      for (uint32_t word : {a | (b << 8) | (other << 16), other | (a << 16) | (b << 24)}) {
        uint32_t halves[2];
        fp8x4_to_half2x2<F>(word, halves[0], halves[1]);
        for (int i = 0; i < 4; ++i) {
          const uint16_t half = static_cast<uint16_t>(halves[i / 2] >> (16 * (i % 2)));
          const uint8_t code = static_cast<uint8_t>(word >> (8 * i));
          const float got = half_to_float(half) * fp8_half_scale<F>();  // a power of two: exact
          expect(same_float(got, fp8_decode<F>(code)),
                 std::string(name) + " fp8x4_to_half2x2 word " + hex(word) + " byte " + std::to_string(i));
        }
      }
    }
  }
}

// The value of fp16 code h, computed independently of half_to_float.
float half_reference(uint16_t h) {
  const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  const float sign = (h & 0x8000u) ? -1.0f : 1.0f;
  if (exponent == 0x1F) return mantissa ? std::nanf("") : sign * INFINITY;
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -24);
  return sign * std::ldexp(static_cast<float>(1024 + mantissa), exponent - 25);
}

void check_16_bit() {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const uint16_t h = static_cast<uint16_t>(code);
    const float half = half_to_float(h);
    expect(same_float(half, half_reference(h)), "half_to_float(" + hex(code) + ")");
    expect(std::isnan(half) ? std::isnan(half_to_float(float_to_half(half))) : float_to_half(half) == h,
           "float_to_half(half_to_float(" + hex(code) + "))");
    const float bf16 = bf16_to_float(h);
    expect(float_bits(bf16) == code << 16, "bf16_to_float(" + hex(code) + ")");
    expect(std::isnan(bf16) ? std::isnan(bf16_to_float(float_to_bf16(bf16))) : float_to_bf16(bf16) == h,
           "float_to_bf16(bf16_to_float(" + hex(code) + "))");
    // Midpoints to the next code of the same sign (exact in float) round to the even code; just
    // above and below them, to the nearer one.
    if ((code & 0x7FFFu) < 0x7BFFu) {
      const uint16_t next = static_cast<uint16_t>(code + 1);
      const uint16_t even = (code & 1u) ? next : h;
      const float mid = (half + half_to_float(next)) / 2;
      expect(float_to_half(mid) == even, "float_to_half(midpoint after " + hex(code) + ")");
      expect(float_to_half(std::nextafter(mid, half)) == h, "float_to_half(below midpoint after " + hex(code) + ")");
      expect(float_to_half(std::nextafter(mid, 2 * mid - half)) == next,
             "float_to_half(above midpoint after " + hex(code) + ")");
    }
    if ((code & 0x7FFFu) < 0x7F80u) {
      const uint32_t mid = (code << 16) | 0x8000u;
      expect(float_to_bf16(bits_float(mid)) == ((code & 1u) ? code + 1 : code),
             "float_to_bf16(midpoint " + hex(mid) + ")");
      expect(float_to_bf16(bits_float(mid - 1)) == code, "float_to_bf16(" + hex(mid - 1) + ")");
      expect(float_to_bf16(bits_float(mid + 1)) == code + 1, "float_to_bf16(" + hex(mid + 1) + ")");
    }
  }
}

// Past the largest half, 65504: below 65520 rounds down to it, from 65520 on to inf.
void check_half_overflow() {
  for (const float sign : {1.0f, -1.0f}) {
    const uint16_t sign_bit = sign < 0 ? 0x8000u : 0u;
    expect(float_to_half(sign * std::nextafter(65520.0f, 0.0f)) == (sign_bit | 0x7BFFu), "float_to_half(65519.996)");
    expect(float_to_half(sign * 65520.0f) == (sign_bit | 0x7C00u), "float_to_half(65520)");
    expect(float_to_half(sign * INFINITY) == (sign_bit | 0x7C00u), "float_to_half(inf)");
  }
}

template <DType F>
uint32_t scalar_bits(const uint8_t* element) {
  return float_bits(cpu::decode_element<F>(element));
}

template <DType F, int W>
void check_vector_decode(const char* name) {
  constexpr int kBytes = dtype_bytes(F);
  constexpr uint32_t kCodes = 1u << (8 * std::min(kBytes, 2));  // fp32: a sample of 65536 bit patterns
  for (uint32_t start = 0; start < kCodes; ++start) {  // each code lands in every lane
    typename cpu::Lanes<W>::Bits codes;
    uint8_t elements[W][4];
    for (int lane = 0; lane < W; ++lane) {
      const uint32_t code = kBytes == 4 ? ((start + lane) % kCodes) * 0x9E3779B1u : (start + lane) % kCodes;
      codes[lane] = code;
      std::memcpy(elements[lane], &code, 4);  // little-endian: the code's bytes first
    }
    float got[W];
    cpu::Simd<W>::store(got, cpu::decode_codes<F, W>(codes));
    for (int lane = 0; lane < W; ++lane) {
      if (float_bits(got[lane]) != scalar_bits<F>(elements[lane])) {
        expect(false, std::string(name) + " decode_codes<" + std::to_string(W) + "> code " + hex(codes[lane]) +
                          " lane " + std::to_string(lane));
      }
    }
  }
}

// Tile loads of the rows of a scrambled table of codes, taken in a scrambled order from a byte offset,
// over counts and head sizes around every vector width's block.
template <DType F, int W>
void check_tile_loads(const char* name) {
  constexpr int kBytes = dtype_bytes(F), kRows = 40, kDims = 160, kOffset = 3, kStride = 192;
  static uint8_t table[kRows][(kOffset + kDims) * kBytes];
  for (int r = 0; r < kRows; ++r) {
    for (int b = 0; b < (kOffset + kDims) * kBytes; ++b) {
      table[r][b] = static_cast<uint8_t>((r * 131 + b * 29 + 7) % 251);
    }
  }
  const uint8_t* rows[kRows];
  for (int i = 0; i < kRows; ++i) rows[i] = table[(i * 17 + 5) % kRows];
  static float plain[kRows * kStride], transposed[kDims * kStride];
  const int counts[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 20, 24, 31, 32, 33, 36, 40};
  const int head_sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 24, 28, 31, 32, 33, 40, 48, 60, 63, 64, 65,
                            72, 80, 96, 100, 112, 127, 128, 129, 144, 160};
  for (int count : counts) {
    for (int head_size : head_sizes) {
      const int64_t offset = kOffset * kBytes;
      cpu::load_rows<F, W>(rows, offset, count, head_size, plain, kStride);
      cpu::load_rows_transposed<F, W>(rows, offset, count, head_size, transposed, kStride);
      bool same = true;
      for (int i = 0; i < count; ++i) {
        for (int d = 0; d < head_size; ++d) {
          const uint32_t expected = scalar_bits<F>(rows[i] + offset + d * kBytes);
          same = same && float_bits(plain[i * kStride + d]) == expected &&
                 float_bits(transposed[d * kStride + i]) == expected;
        }
      }
      expect(same, std::string(name) + " tile loads<" + std::to_string(W) + "> of " + std::to_string(count) +
                       " rows x " + std::to_string(head_size));
    }
  }
}

template <DType F>
void check_cpu_cache_loads(const char* name) {
  check_vector_decode<F, 4>(name);
  check_vector_decode<F, 8>(name);
  check_vector_decode<F, 16>(name);
  check_tile_loads<F, 4>(name);
  check_tile_loads<F, 8>(name);
  check_tile_loads<F, 16>(name);
}

void check_nan_max() {
  const float values[] = {std::nanf(""), -INFINITY, -1.0f, -0.0f, 0.0f, 1.0f, INFINITY};
  for (float a : values) {
    for (float b : values) {
      const float expected = (std::isnan(a) || std::isnan(b)) ? std::nanf("") : (a > b ? a : b);
      expect(same_float(nan_max(a, b), expected), "nan_max(" + std::to_string(a) + ", " + std::to_string(b) + ")");
    }
  }
}

// Position by position: token j of q_len sits at seq_len - q_len + j and sees itself and earlier
// positions, the last `window` of them when window > 0.
void check_visible_keys() {
  for (int seq_len = 1; seq_len <= 12; ++seq_len) {
    for (int q_len = 1; q_len <= seq_len; ++q_len) {
      for (int token = 0; token < q_len; ++token) {
        for (int window : {-1, 0, 1, 2, 5, 20}) {
          const int position = seq_len - q_len + token;
          int begin = -1, end = -1;
          for (int key = 0; key < seq_len; ++key) {
            if (key > position || (window > 0 && key <= position - window)) continue;
            begin = begin < 0 ? key : begin, end = key + 1;
          }
          const KeyRange<int> keys = visible_keys(seq_len, q_len, token, window);
          const KeyRange<int64_t> wide = visible_keys<int64_t>(seq_len, q_len, token, window);
          expect(keys.begin == begin && keys.end == end && wide.begin == begin && wide.end == end,
                 "visible_keys(" + std::to_string(seq_len) + ", " + std::to_string(q_len) + ", " +
                     std::to_string(token) + ", " + std::to_string(window) + ")");
        }
      }
    }
  }
}

void check_dispatch() {
  for (int value = 0; value <= 300; ++value) {
    const int got = dispatch<kCudaHeadSizes>(value, -1, [](auto head) { return int{decltype(head)::value}; });
    expect(got == (contains(kCudaHeadSizes, value) ? value : -1),
           "dispatch<kCudaHeadSizes>(" + std::to_string(value) + ")");
  }
  const bool fp8 = dispatch<kFp8DTypes>(DType::kFloat8E5M2, false,
                                        [](auto t) { return decltype(t)::value == DType::kFloat8E5M2; });
  expect(fp8 && !dispatch<kFp8DTypes>(DType::kFloat16, false, [](auto) { return true; }), "dispatch<kFp8DTypes>");
  expect(format_list(kCudaHeadSizes) == "64, 80, 96, 128, 192, 256", "format_list(kCudaHeadSizes)");
}

}  // namespace
}  // namespace fp8kv

int main() {
  using namespace fp8kv;
  check_fp8<DType::kFloat8E4M3FN>("e4m3fn");
  check_fp8<DType::kFloat8E5M2>("e5m2");
  check_fp8<DType::kFloat8E4M3FNUZ>("e4m3fnuz");
  check_16_bit();
  check_half_overflow();
  check_cpu_cache_loads<DType::kFloat8E4M3FN>("e4m3fn");
  check_cpu_cache_loads<DType::kFloat8E5M2>("e5m2");
  check_cpu_cache_loads<DType::kFloat8E4M3FNUZ>("e4m3fnuz");
  check_cpu_cache_loads<DType::kFloat16>("fp16");
  check_cpu_cache_loads<DType::kBFloat16>("bf16");
  check_cpu_cache_loads<DType::kFloat32>("fp32");
  check_nan_max();
  check_visible_keys();
  check_dispatch();
  return checks::finish("check_numerics");
}
