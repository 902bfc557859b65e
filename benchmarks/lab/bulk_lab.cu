// Does the copy mechanism limit the decode kernel's read bandwidth? The kernel's page walk (4 warps per
// (sequence, KV head), warp w takes 16-token tiles w, w+4, ...; K and V rows of head 128 in FP8) with
// no attention math, staged four ways:
//   0 cp.async, 16-byte lane-private vectors (as the kernel does now);
//   1 cp.async.bulk, one 128-byte row per lane (any page layout), completion on a per-warp mbarrier;
//   2 cp.async.bulk, one 2 KB copy per K and V page slice (HND pages only);
//   3 cp.async on a contiguous range per warp (the ceiling of this structure).
// Read-only L2 flush before every run, CUDA events, median of 20.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "../../csrc/cuda/device_utils.cuh"

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
using namespace fp8kv::cuda;

constexpr int kRowBytes = 128, kTile = 16, kWarps = 4;

struct Walk {
  const uint8_t* k; const uint8_t* v;
  const int32_t* table; int table_stride;
  int64_t block_stride, token_stride, head_stride;  // bytes
  int block_size, tokens_per_cta, ctas_per_seq;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void bar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

template <int kMode, int kStages>
__global__ void __launch_bounds__(128) walk_kernel(Walk w, uint32_t* sink) {
  constexpr int kKStride = kMode == 1 ? 192 : 128, kVStride = kMode == 1 ? 144 : 128;  // conflict-free rows
  constexpr int kVOffset = kTile * kKStride, kStageBytes = kVOffset + kTile * kVStride;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bars[kWarps][kStages];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int seq = blockIdx.x / w.ctas_per_seq, part = blockIdx.x % w.ctas_per_seq, head = blockIdx.y;
  const int lo = part * w.tokens_per_cta;
  const int my_tiles = w.tokens_per_cta / kTile / kWarps;
  uint8_t* ring = smem + warp * kStages * kStageBytes;
  if (lane == 0) for (int s = 0; s < kStages; ++s) bar_init(&bars[warp][s], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();
  auto row = [&](const uint8_t* cache, int token) {
    const int page = __ldg(w.table + seq * w.table_stride + token / w.block_size);
    return cache + page * w.block_stride + (token % w.block_size) * w.token_stride + head * w.head_stride;
  };
  auto issue = [&](int k) {
    const int first = lo + (warp + k * kWarps) * kTile;
    uint8_t* stage = ring + (k % kStages) * kStageBytes;
    if constexpr (kMode == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 2; ++i)
          copy_async<16>(stage + ((h * 2 + i) * 32 + lane) * 16, row(w.k, first + g + 8 * h) + (i * 4 + t) * 16, true);
#pragma unroll
      for (int r = 0; r < 4; ++r)
        copy_async<16>(stage + 2048 + (r * 32 + lane) * 16, row(w.v, first + 2 * t + r % 2 + 8 * (r / 2)) + g * 16, true);
      copy_async_commit();
    } else if constexpr (kMode == 1) {
      uint64_t* bar = &bars[warp][k % kStages];
      if (lane == 0) bar_expect(bar, 2 * kTile * kRowBytes);
      __syncwarp();
      const int r = lane % 16;
      if (lane < 16) bulk_copy(stage + r * kKStride, row(w.k, first + r), kRowBytes, bar);
      else bulk_copy(stage + kVOffset + r * kVStride, row(w.v, first + r), kRowBytes, bar);
    } else if constexpr (kMode == 2) {
      uint64_t* bar = &bars[warp][k % kStages];
      if (lane == 0) {
        bar_expect(bar, 2 * kTile * kRowBytes);
        bulk_copy(stage, row(w.k, first), kTile * kRowBytes, bar);
        bulk_copy(stage + kVOffset, row(w.v, first), kTile * kRowBytes, bar);
      }
    } else {
      const size_t cta = blockIdx.y * (size_t)gridDim.x + blockIdx.x;
      const uint8_t* base = w.k + (cta * kWarps + warp) * (size_t)my_tiles * 4096 + (size_t)k * 4096;
#pragma unroll
      for (int j = 0; j < 8; ++j) copy_async<16>(stage + (j * 32 + lane) * 16, base + (j * 32 + lane) * 16, true);
      copy_async_commit();
    }
  };
  auto await = [&](int k) {
    if constexpr (kMode == 1 || kMode == 2) bar_wait(&bars[warp][k % kStages], (k / kStages) & 1);
    else copy_async_wait<kStages - 1>();
  };
  for (int k = 0; k < kStages - 1; ++k) {
    if (k < my_tiles) issue(k);
    else if (kMode == 0 || kMode == 3) copy_async_commit();
  }
  uint32_t acc = 0;
  for (int k = 0; k < my_tiles; ++k) {
    if (k + kStages - 1 < my_tiles) issue(k + kStages - 1);
    else if (kMode == 0 || kMode == 3) copy_async_commit();
    await(k);
    const uint8_t* stage = ring + (k % kStages) * kStageBytes;
    uint4 x[8];
    if constexpr (kMode == 1) {  // the kernel's fragment reads from row-major rows
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < 2; ++i) x[h * 2 + i] = *reinterpret_cast<const uint4*>(stage + (g + 8 * h) * kKStride + (i * 4 + t) * 16);
#pragma unroll
      for (int r = 0; r < 4; ++r) x[4 + r] = *reinterpret_cast<const uint4*>(stage + kVOffset + (2 * t + r % 2 + 8 * (r / 2)) * kVStride + g * 16);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = reinterpret_cast<const uint4*>(stage)[j * 32 + lane];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= x[j].x ^ x[j].y ^ x[j].z ^ x[j].w;
    __syncwarp();  // every lane has read the slot before it is refilled
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void read_flush(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9999u) sink[0] = acc;
}

template <int kMode, int kStages>
void run(const char* what, const Walk& w, dim3 grid, int ctas_per_sm, double bytes, const uint4* flush, uint32_t* sink) {
  constexpr int kStageBytes = kMode == 1 ? kTile * (192 + 144) : 4096;
  // Pad shared memory so that exactly ctas_per_sm CTAs fit (the real kernel is register-limited).
  const int need = kWarps * kStages * kStageBytes;
  const int smem = std::max(need, (227 * 1024) / ctas_per_sm - 1024 - kWarps * kStages * 8);
  auto kernel = walk_kernel<kMode, kStages>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int fit = 0; CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, kernel, 128, smem));
  std::vector<float> t; cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int it = 0; it < 25; ++it) {
    read_flush<<<1056, 256>>>(flush, (256ull << 20) / 16, sink);
    cudaEventRecord(a); kernel<<<grid, 128, smem>>>(w, sink); cudaEventRecord(b);
    CHECK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms, a, b); if (it >= 5) t.push_back(ms * 1e3f);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end()); const float us = t[t.size() / 2];
  printf("  %-34s stages %d  ctas/SM %d  %8.1f us  %.2f TB/s\n", what, kStages, fit, us, bytes / us / 1e6);
}

int main() {
  uint4* flush; CHECK(cudaMalloc(&flush, 256ull << 20)); CHECK(cudaMemset(flush, 1, 256ull << 20));
  uint32_t* sink; CHECK(cudaMalloc(&sink, 4));
  const int hk = 8;
  struct Shape { int B, L, bs, ctas_per_seq; };
  for (Shape s : {Shape{64, 4096, 16, 1}, Shape{1, 131072, 16, 64}, Shape{64, 4096, 64, 1}}) {
    const int64_t nblk = (int64_t)s.B * s.L / s.bs;
    const size_t bytes = (size_t)nblk * s.bs * hk * kRowBytes;
    uint8_t *kc, *vc; CHECK(cudaMalloc(&kc, bytes)); CHECK(cudaMalloc(&vc, bytes));
    CHECK(cudaMemset(kc, 1, bytes)); CHECK(cudaMemset(vc, 2, bytes));
    std::vector<int32_t> table(nblk); std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(0));
    int32_t* bt; CHECK(cudaMalloc(&bt, nblk * 4)); CHECK(cudaMemcpy(bt, table.data(), nblk * 4, cudaMemcpyHostToDevice));
    const dim3 grid(s.B * s.ctas_per_seq, hk);
    const double moved = 2.0 * bytes;
    for (int hnd = 0; hnd < 2; ++hnd) {
      Walk w{kc, vc, bt, s.L / s.bs, (int64_t)s.bs * hk * kRowBytes, hnd ? kRowBytes : hk * kRowBytes,
             hnd ? (int64_t)s.bs * kRowBytes : kRowBytes, s.bs, s.L / s.ctas_per_seq, s.ctas_per_seq};
      printf("B%d L%d bs%d %s (%d CTAs)\n", s.B, s.L, s.bs, hnd ? "HND" : "NHD", grid.x * grid.y);
      run<0, 2>("cp.async lane vectors (kernel)", w, grid, 4, moved, flush, sink);
      run<0, 4>("cp.async lane vectors (kernel)", w, grid, 3, moved, flush, sink);
      run<1, 2>("bulk rows", w, grid, 4, moved, flush, sink);
      run<1, 3>("bulk rows", w, grid, 4, moved, flush, sink);
      run<1, 4>("bulk rows", w, grid, 3, moved, flush, sink);
      run<1, 6>("bulk rows", w, grid, 2, moved, flush, sink);
      if (hnd) {
        run<2, 2>("bulk pages", w, grid, 4, moved, flush, sink);
        run<2, 4>("bulk pages", w, grid, 4, moved, flush, sink);
      }
    }
    CHECK(cudaFree(kc)); CHECK(cudaFree(vc)); CHECK(cudaFree(bt));
  }
  {  // contiguous ceiling through the same ring: 1 GiB
    const size_t bytes = 1ull << 30;
    uint8_t* buf; CHECK(cudaMalloc(&buf, bytes)); CHECK(cudaMemset(buf, 3, bytes));
    const int ctas = 512; const int tokens = (int)(bytes / ctas / 256);  // 256 bytes (K+V row) per token
    Walk w{buf, buf, nullptr, 0, 0, 0, 0, 16, tokens, 1};
    printf("contiguous 1 GiB (%d CTAs)\n", ctas);
    run<3, 2>("cp.async contiguous", w, dim3(ctas, 1), 4, (double)bytes, flush, sink);
    run<3, 4>("cp.async contiguous", w, dim3(ctas, 1), 3, (double)bytes, flush, sink);
    CHECK(cudaFree(buf));
  }
}
