// The CPU kernels' dispatch over element dtypes: FP8 codes decode through a 256-entry table per format
// (built from the shared codec), float16 / bfloat16 / float32 go through Element (float_conversions.h).
#pragma once

#include <array>
#include <cstdint>

#include <c10/util/Exception.h>

#include "../fp8.h"

namespace fp8kv::cpu {

template <DType F>
const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int code = 0; code < 256; ++code) values[code] = fp8_decode<F>(static_cast<uint8_t>(code));
    return values;
  }();
  return table.data();
}

// Decoded values of all 256 codes of an FP8 cache dtype.
inline const float* fp8_table(DType t) {
  const float* table = dispatch<kFp8DTypes>(t, static_cast<const float*>(nullptr),
                                            [](auto fp8) { return fp8_table<decltype(fp8)::value>(); });
  TORCH_CHECK(table != nullptr, "fp8kv: expected an FP8 dtype");
  return table;
}

// Calls fn(DTypeTag) for a float16, bfloat16 or float32 dtype.
template <typename Fn>
void dispatch_source_dtype(DType t, Fn&& fn) {
  const bool supported = dispatch<kSourceDTypes>(t, false, [&](auto type) {
    fn(type);
    return true;
  });
  TORCH_CHECK(supported, "fp8kv: expected a float16, bfloat16 or float32 dtype");
}

}  // namespace fp8kv::cpu
