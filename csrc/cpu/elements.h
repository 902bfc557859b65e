// Typed element access for the CPU kernels: fp16/bf16/fp32 loads and stores through float, and
// FP8 decoding through a 256-entry table built from the shared codec.
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include <c10/util/Exception.h>

#include "../fp8.h"
#include "../half_float.h"
#include "../kernel_params.h"

namespace fp8kv::cpu {

struct Float16 {
  using Storage = uint16_t;
  static float load(const Storage* p, int64_t i) { return half_to_float(p[i]); }
  static void store(Storage* p, int64_t i, float x) { p[i] = float_to_half(x); }
};

struct BFloat16 {
  using Storage = uint16_t;
  static float load(const Storage* p, int64_t i) { return bf16_to_float(p[i]); }
  static void store(Storage* p, int64_t i, float x) { p[i] = float_to_bf16(x); }
};

struct Float32 {
  using Storage = float;
  static float load(const Storage* p, int64_t i) { return p[i]; }
  static void store(Storage* p, int64_t i, float x) { p[i] = x; }
};

// Calls fn(Float16{}), fn(BFloat16{}) or fn(Float32{}) for a 16/32-bit float dtype.
template <typename Fn>
decltype(auto) dispatch_float_type(DType t, Fn&& fn) {
  switch (t) {
    case DType::kFloat16: return std::forward<Fn>(fn)(Float16{});
    case DType::kBFloat16: return std::forward<Fn>(fn)(BFloat16{});
    case DType::kFloat32: return std::forward<Fn>(fn)(Float32{});
    default: TORCH_CHECK(false, "fp8kv: expected a float16, bfloat16 or float32 dtype");
  }
}

template <Fp8Format F>
std::array<float, 256> make_fp8_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) table[code] = fp8_decode<F>(static_cast<uint8_t>(code));
  return table;
}

// Decoded values of all 256 codes of an FP8 cache dtype.
inline const float* fp8_table(DType t) {
  static const auto e4m3fn = make_fp8_table<Fp8Format::kE4M3FN>();
  static const auto e5m2 = make_fp8_table<Fp8Format::kE5M2>();
  static const auto e4m3fnuz = make_fp8_table<Fp8Format::kE4M3FNUZ>();
  switch (t) {
    case DType::kFloat8E4M3FN: return e4m3fn.data();
    case DType::kFloat8E5M2: return e5m2.data();
    case DType::kFloat8E4M3FNUZ: return e4m3fnuz.data();
    default: TORCH_CHECK(false, "fp8kv: expected an FP8 dtype");
  }
}

}  // namespace fp8kv::cpu
