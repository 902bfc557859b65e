// Host-side helpers of the HIP launchers: dtype dispatch, device facts, alignment tests.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "../fp8.h"
#include "../kernel_params.h"
#include "elements.h"

namespace fp8kv::hip {

template <typename T>
constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

template <Fp8Format F>
using Fp8Tag = std::integral_constant<Fp8Format, F>;

// fn(Float16{}), fn(BFloat16{}) or fn(Float32{}); other dtypes are excluded by validation.
template <typename Fn>
hipError_t with_float_type(DType t, Fn&& fn) {
  switch (t) {
    case DType::kFloat16: return std::forward<Fn>(fn)(Float16{});
    case DType::kBFloat16: return std::forward<Fn>(fn)(BFloat16{});
    case DType::kFloat32: return std::forward<Fn>(fn)(Float32{});
    default: return hipErrorInvalidValue;
  }
}

// fn(Fp8Tag<F>{}) for an FP8 dtype; `unquantized()` for any other.
template <typename Fn, typename Other>
hipError_t with_fp8_format(DType t, Fn&& fn, Other&& unquantized) {
  switch (t) {
    case DType::kFloat8E4M3FN: return std::forward<Fn>(fn)(Fp8Tag<Fp8Format::kE4M3FN>{});
    case DType::kFloat8E5M2: return std::forward<Fn>(fn)(Fp8Tag<Fp8Format::kE5M2>{});
    case DType::kFloat8E4M3FNUZ: return std::forward<Fn>(fn)(Fp8Tag<Fp8Format::kE4M3FNUZ>{});
    default: return std::forward<Other>(unquantized)();
  }
}

// Compute units of the current device: the kernels size their grids to fill it.
inline hipError_t current_compute_units(int* count) {
  int device = 0;
  hipError_t status = hipGetDevice(&device);
  if (status != hipSuccess) return status;
  return hipDeviceGetAttribute(count, hipDeviceAttributeMultiprocessorCount, device);
}

// True if `chunk` consecutive elements of `element_bytes` starting at `base` plus any combination of
// the strides (in elements) lie on a `chunk * element_bytes`-byte boundary.
inline bool chunks_aligned(const void* base, int element_bytes, int chunk, std::initializer_list<int64_t> strides) {
  const int64_t bytes = static_cast<int64_t>(element_bytes) * chunk;
  if (reinterpret_cast<uintptr_t>(base) % bytes != 0) return false;
  for (int64_t stride : strides) {
    if (stride % chunk != 0) return false;
  }
  return true;
}

}  // namespace fp8kv::hip
