// The CPU kernels' dispatch over the float16 / bfloat16 / float32 element dtypes (Element,
// float_conversions.h). The attention decodes its cache tiles in cache_tile.h.
#pragma once

#include <cstdint>

#include <c10/util/Exception.h>

#include "../fp8.h"

namespace fp8kv::cpu {

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
