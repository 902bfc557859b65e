// A host emulation of the slice of HIP that fp8kv's kernels use, so that their unmodified sources run
// on a CPU (csrc/hip/emulation/run_kernels.cpp; scripts/check_hip_sources.sh). Not a HIP runtime.
//
// Execution model: workgroups run one after another; each workgroup's threads are OS threads.
// __syncthreads is a barrier over the workgroup, and a shuffle is a barrier-separated exchange
// among the 64 threads of a wavefront (so all lanes of a wavefront must reach it, as the kernels
// guarantee). A thread that returns drops out of later barriers, as on the GPU. Threads are not
// lockstep: code that relied on implicit wavefront synchronization would race here and be caught.
// Device numerics are the host's (fp32 IEEE, expf/tanhf from libm), not the GPU's.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static  // one workgroup at a time, so a static is the workgroup's LDS

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }

enum hipError_t { hipSuccess = 0, hipErrorInvalidValue = 1 };
enum hipDeviceAttribute_t { hipDeviceAttributeMultiprocessorCount };
using hipStream_t = struct EmulatedStream*;

namespace hip_emulation {

constexpr int kWaveSize = 64;

struct Workgroup {
  explicit Workgroup(int threads)
      : barrier(threads), waves((threads + kWaveSize - 1) / kWaveSize) {
    for (int w = 0; w < static_cast<int>(waves.size()); ++w) {
      const int lanes = std::min(kWaveSize, threads - w * kWaveSize);
      waves[w] = std::make_unique<Wave>(lanes);
    }
  }
  struct Wave {
    explicit Wave(int lanes) : barrier(lanes) {}
    std::barrier<> barrier;
    uint32_t slots[kWaveSize] = {};
  };
  std::barrier<> barrier;
  std::vector<std::unique_ptr<Wave>> waves;
};

inline thread_local Workgroup* current = nullptr;
inline thread_local dim3 thread_index;
inline thread_local dim3 block_index;
inline dim3 block_dim;
inline dim3 grid_dim;
inline int compute_units = 4;  // what hipDeviceGetAttribute reports

inline Workgroup::Wave& wave() { return *current->waves[thread_index.x / kWaveSize]; }

template <typename T>
T shfl_xor(T value, int mask) {
  static_assert(sizeof(T) == 4, "32-bit shuffles only");
  Workgroup::Wave& w = wave();
  const int lane = thread_index.x % kWaveSize;
  std::memcpy(&w.slots[lane], &value, 4);
  w.barrier.arrive_and_wait();
  T result;
  std::memcpy(&result, &w.slots[lane ^ mask], 4);
  w.barrier.arrive_and_wait();
  return result;
}

// Runs kernel(args...) over the grid (x and y and z), workgroup by workgroup.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, dim3 grid, dim3 block, Args... args) {
  grid_dim = grid;
  block_dim = block;
  for (unsigned int z = 0; z < grid.z; ++z) {
    for (unsigned int y = 0; y < grid.y; ++y) {
      for (unsigned int x = 0; x < grid.x; ++x) {
        Workgroup group(static_cast<int>(block.x));
        std::vector<std::thread> threads;
        for (unsigned int t = 0; t < block.x; ++t) {
          threads.emplace_back([&, t] {
            current = &group;
            thread_index = dim3(t);
            block_index = dim3(x, y, z);
            kernel(args...);
            wave().barrier.arrive_and_drop();
            group.barrier.arrive_and_drop();
          });
        }
        for (auto& thread : threads) thread.join();
      }
    }
  }
}

}  // namespace hip_emulation

#define threadIdx (::hip_emulation::thread_index)
#define blockIdx (::hip_emulation::block_index)
#define blockDim (::hip_emulation::block_dim)
#define gridDim (::hip_emulation::grid_dim)

inline void __syncthreads() { hip_emulation::current->barrier.arrive_and_wait(); }

inline float __shfl_xor(float value, int mask) { return hip_emulation::shfl_xor(value, mask); }
inline int __shfl_xor(int value, int mask) { return hip_emulation::shfl_xor(value, mask); }

inline unsigned int atomicCAS(unsigned int* address, unsigned int expected, unsigned int desired) {
  __atomic_compare_exchange_n(address, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;  // the value found, as atomicCAS returns
}

#define hipLaunchKernelGGL(kernel, grid, block, shared_bytes, stream, ...) \
  ::hip_emulation::launch(kernel, dim3(grid), dim3(block), __VA_ARGS__)

inline hipError_t hipGetLastError() { return hipSuccess; }
inline hipError_t hipGetDevice(int* device) {
  *device = 0;
  return hipSuccess;
}
inline hipError_t hipDeviceGetAttribute(int* value, hipDeviceAttribute_t, int) {
  *value = hip_emulation::compute_units;
  return hipSuccess;
}
inline const char* hipGetErrorString(hipError_t status) { return status == hipSuccess ? "success" : "error"; }
