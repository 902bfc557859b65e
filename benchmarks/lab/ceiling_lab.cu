// Read-bandwidth ceilings on a contiguous 512 MiB buffer, timed like the attention lab.
#include <algorithm>
#include <cstdio>
#include <vector>
#include "../../csrc/cuda/device_utils.cuh"
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
using namespace fp8kv::cuda;

template <int kUnroll>
__global__ void ldg_stream(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += stride * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = (i + u * stride < n) ? __ldg(p + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9999u) sink[0] = acc;
}

// Each warp streams its own contiguous range through a kStages ring of 4 KB stages (like the kernel).
template <int kStages>
__global__ void ring_stream(const uint8_t* __restrict__ p, size_t bytes_per_warp, uint32_t* sink) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const size_t gw = (size_t)blockIdx.x * (blockDim.x / 32) + warp;
  const uint8_t* base = p + gw * bytes_per_warp;
  uint8_t* ring = smem + warp * kStages * 4096;
  const int tiles = (int)(bytes_per_warp / 4096);
  auto stage = [&](int k) {
#pragma unroll
    for (int j = 0; j < 8; ++j) copy_async<16>(ring + (k % kStages) * 4096 + (j * 32 + lane) * 16, base + (size_t)k * 4096 + (j * 32 + lane) * 16, true);
  };
  for (int k = 0; k < kStages - 1; ++k) { if (k < tiles) stage(k); copy_async_commit(); }
  uint32_t acc = 0;
  for (int k = 0; k < tiles; ++k) {
    if (k + kStages - 1 < tiles) stage(k + kStages - 1);
    copy_async_commit();
    copy_async_wait<kStages - 1>();
    const uint4* st = reinterpret_cast<const uint4*>(ring + (k % kStages) * 4096);
#pragma unroll
    for (int j = 0; j < 8; ++j) { uint4 v = st[j * 32 + lane]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  }
  if (acc == 0x9999u) sink[0] = acc;
}

// Variants of ring_stream: kPattern 1 = half of each stage from a second buffer at the same offset
// (K and V); kPattern 2 = stage rows of 128 B taken at a 1 KB stride (NHD head rows), 8 streams
// (heads) interleaved by warps of different CTAs.
template <int kPattern>
__global__ void ring_pattern(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v, size_t bytes_per_warp, uint32_t* sink) {
  constexpr int kStages = 2;
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const size_t gw = (size_t)blockIdx.x * (blockDim.x / 32) + warp;
  uint8_t* ring = smem + warp * kStages * 4096;
  const int tiles = (int)(bytes_per_warp / 4096);
  auto src = [&](int tile, int j) -> const uint8_t* {
    const int idx = j * 32 + lane;  // 16-byte unit within the 4 KB stage
    if (kPattern == 1) {
      const uint8_t* b = idx < 128 ? k : v;
      return b + gw * (bytes_per_warp / 2) + (size_t)tile * 2048 + (idx % 128) * 16;
    }
    // head = gw % 8 owns 128-byte columns of 1 KB rows; group of 8 warps shares rows
    const size_t group = gw / 8; const int head = gw % 8;
    const size_t row = group * (bytes_per_warp / 128) + (size_t)tile * 32 + idx / 8;
    return k + row * 1024 + head * 128 + (idx % 8) * 16;
  };
  auto stage = [&](int t) {
#pragma unroll
    for (int j = 0; j < 8; ++j) copy_async<16>(ring + (t % kStages) * 4096 + (j * 32 + lane) * 16, src(t, j), true);
  };
  stage(0); copy_async_commit();
  uint32_t acc = 0;
  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) stage(t + 1);
    copy_async_commit(); copy_async_wait<1>();
    const uint4* st = reinterpret_cast<const uint4*>(ring + (t % kStages) * 4096);
#pragma unroll
    for (int j = 0; j < 8; ++j) { uint4 x = st[j * 32 + lane]; acc ^= x.x ^ x.y ^ x.z ^ x.w; }
  }
  if (acc == 0x9999u) sink[0] = acc;
}

static bool g_read_flush = false;
template <typename F>
float time_us(F launch, uint8_t* flush) {
  std::vector<float> t; cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  static uint32_t* flush_sink = nullptr; if (!flush_sink) cudaMalloc(&flush_sink, 4);
  for (int it = 0; it < 25; ++it) {
    // A read-only flush leaves clean lines in L2 (no write-back during the timed kernel).
    if (g_read_flush) ldg_stream<4><<<528, 256>>>((const uint4*)flush, (256 << 20) / 16, flush_sink);
    else cudaMemsetAsync(flush, it, 256 << 20);
    cudaEventRecord(a); launch(); cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms, a, b); if (it >= 5) t.push_back(ms * 1e3f);
  }
  std::sort(t.begin(), t.end()); return t[t.size() / 2];
}

int main(int argc, char**) {
  g_read_flush = argc > 1;
  const size_t bytes = 512ull << 20;
  uint8_t *buf, *flush; uint32_t* sink;
  CHECK(cudaMalloc(&buf, bytes)); CHECK(cudaMalloc(&flush, 256 << 20)); CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(buf, 3, bytes));
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t n = bytes / 16;
  for (int blocks_per_sm : {2, 4, 8}) {
    float us = time_us([&] { ldg_stream<4><<<sms * blocks_per_sm, 256>>>((const uint4*)buf, n, sink); }, flush);
    printf("ldg unroll4, %d x 256 threads/SM: %.1f us %.2f TB/s\n", blocks_per_sm, us, bytes / us / 1e6);
    us = time_us([&] { ldg_stream<8><<<sms * blocks_per_sm, 256>>>((const uint4*)buf, n, sink); }, flush);
    printf("ldg unroll8, %d x 256 threads/SM: %.1f us %.2f TB/s\n", blocks_per_sm, us, bytes / us / 1e6);
  }
  // no flush: includes nothing else
  float us = time_us([&] { cudaMemsetAsync(flush, 1, 0); ldg_stream<8><<<sms * 4, 256>>>((const uint4*)buf, n, sink); }, flush);
  for (int warps_total : {sms * 12, sms * 16, sms * 32}) {
    const size_t per_warp = bytes / warps_total / 4096 * 4096;
    auto run2 = [&] { ring_stream<2><<<warps_total / 4, 128, 2 * 4 * 4096>>>(buf, per_warp, sink); };
    auto run4 = [&] { ring_stream<4><<<warps_total / 4, 128, 4 * 4 * 4096>>>(buf, per_warp, sink); };
    cudaFuncSetAttribute(ring_stream<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    const double moved = (double)per_warp * warps_total;
    us = time_us(run2, flush); printf("ring S=2 %d warps: %.1f us %.2f TB/s\n", warps_total, us, moved / us / 1e6);
    us = time_us(run4, flush); printf("ring S=4 %d warps: %.1f us %.2f TB/s\n", warps_total, us, moved / us / 1e6);
  }
  {
    uint8_t* buf2; CHECK(cudaMalloc(&buf2, bytes)); CHECK(cudaMemset(buf2, 5, bytes));
    const int warps_total = sms * 16;
    const size_t per_warp = bytes / warps_total / 4096 * 4096;  // pattern 1 reads per_warp/2 from each buffer
    us = time_us([&] { ring_pattern<1><<<warps_total / 4, 128, 2 * 4 * 4096>>>(buf, buf2, per_warp, sink); }, flush);
    printf("ring K+V two buffers: %.1f us %.2f TB/s\n", us, (double)per_warp * warps_total / us / 1e6);
    const size_t per_warp2 = bytes / warps_total / 4096 * 4096;
    us = time_us([&] { ring_pattern<2><<<warps_total / 4, 128, 2 * 4 * 4096>>>(buf, buf2, per_warp2, sink); }, flush);
    printf("ring 128B rows at 1KB stride: %.1f us %.2f TB/s\n", us, (double)per_warp2 * warps_total / us / 1e6);
  }
  // flush cost alone (write-back after memset): an empty kernel after the memset
  us = time_us([&] { ldg_stream<1><<<1, 32>>>((const uint4*)buf, 0, sink); }, flush);
  printf("empty kernel after flush: %.1f us\n", us);
}
