// Host-side helpers of the HIP launchers: device facts, alignment tests.
#pragma once

#include <hip/hip_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <mutex>

namespace fp8kv::hip {

template <typename T>
constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Compute units of the current device, read once per device: the kernels size their grids to fill it.
inline hipError_t current_compute_units(int* count) {
  constexpr int kMaxDevices = 64;
  static std::once_flag read[kMaxDevices];
  static int units[kMaxDevices];
  static hipError_t read_status[kMaxDevices];
  int device = 0;
  const hipError_t status = hipGetDevice(&device);
  if (status != hipSuccess) return status;
  if (device < 0 || device >= kMaxDevices) return hipDeviceGetAttribute(count, hipDeviceAttributeMultiprocessorCount, device);
  std::call_once(read[device], [device] {
    read_status[device] = hipDeviceGetAttribute(&units[device], hipDeviceAttributeMultiprocessorCount, device);
  });
  *count = units[device];
  return read_status[device];
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
