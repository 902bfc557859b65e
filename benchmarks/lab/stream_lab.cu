// How fast can the CTA/warp/tile structure move the bytes with no attention math?
// Variant A: same staging (cp.async ring) + LDS, XOR-consume. Variant B: direct 16B ld.global, 4 tiles unrolled.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>
#include "../../csrc/cuda/paged_attention_kernel.cuh"

using namespace fp8kv;
using namespace fp8kv::cuda;
using namespace fp8kv::cuda::attention;
#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

constexpr CacheKind C = CacheKind::kE4M3FN;
constexpr int D = 128;

template <int kMode>
__global__ void __launch_bounds__(kThreads) stream_kernel(const PagedAttentionParams p, int split_tokens, uint32_t* sink) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  CtaWork w; w.kv_head = blockIdx.z; RowInfo rows[kRows]; int row_lo[kRows], row_hi[kRows];
  if (!plan_cta<D>(p, blockIdx.x, blockIdx.y, split_tokens, w, rows, row_lo, row_hi)) return;
  using Stg = Staging<C, D>;
  extern __shared__ __align__(16) uint8_t smem[];
  int32_t* pages = reinterpret_cast<int32_t*>(smem + Stg::kPagesOffset);
  if (w.hi > w.lo) {
    const int32_t* table_row = p.block_tables + w.seq * p.block_table_stride;
    const int num_pages = ((w.hi - 1) >> w.block_shift) - w.first_page + 1;
    for (int i = threadIdx.x; i < num_pages; i += kThreads) pages[i] = __ldg(table_row + w.first_page + i);
  }
  __syncthreads();
  const LaneCursor cursor = make_cursor<C, D>(p, w.kv_head, lane);
  const int first_tile = (w.lo / kTileTokens) * kTileTokens;
  const int num_tiles = w.hi > w.lo ? (w.hi - first_tile + kTileTokens - 1) / kTileTokens : 0;
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
  auto tile_start = [&](int k) { return first_tile + (warp + k * kWarps) * kTileTokens; };
  uint32_t acc = 0;
  if constexpr (kMode == 2) {
    // K copied with full 128-byte lines per row (8 lanes a row, 4 rows an instruction); V as in the kernel.
    uint8_t* ring = smem + warp * Stg::kStages * Stg::kStageBytes;
    auto stage_full = [&](uint8_t* stage, const TileRows& t) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int idx = j * 32 + lane, row = idx / 8, chunk = idx % 8;
        const uint8_t* base = t.key[row / 8] - cursor.key_lane;
        copy_async<16>(stage + idx * 16, base + (row % 8) * cursor.key_token_bytes + chunk * 16, true);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) copy_async<16>(stage + 2048 + (r * 32 + lane) * 16, t.value[r], t.value_valid[r]);
    };
    for (int k = 0; k < Stg::kStages - 1; ++k) {
      if (k < my_tiles) stage_full(ring + k * Stg::kStageBytes, locate_tile(p, w, cursor, pages, tile_start(k), lane));
      copy_async_commit();
    }
    for (int k = 0; k < my_tiles; ++k) {
      const int ahead = k + Stg::kStages - 1;
      if (ahead < my_tiles) stage_full(ring + (ahead % Stg::kStages) * Stg::kStageBytes, locate_tile(p, w, cursor, pages, tile_start(ahead), lane));
      copy_async_commit();
      copy_async_wait<Stg::kStages - 1>();
      __syncwarp();
      const uint4* st = reinterpret_cast<const uint4*>(ring + (k % Stg::kStages) * Stg::kStageBytes);
#pragma unroll
      for (int x = 0; x < 8; ++x) { uint4 v = st[x * 32 + lane]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
      __syncwarp();
    }
  } else if constexpr (kMode == 3) {
    // The kernel's staging with every copy in the plain form (no zero-fill operand).
    uint8_t* ring = smem + warp * Stg::kStages * Stg::kStageBytes;
    using L = Layout<C, D>;
    auto stage_plain = [&](uint8_t* stage, const TileRows& t) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int i = 0; i < L::kKVecs; ++i)
          copy_async<16>(stage + ((r * L::kKVecs + i) * 32 + lane) * 16, t.key[r] + i * 64, true);
#pragma unroll
      for (int r = 0; r < 4; ++r) copy_async<16>(stage + Stg::kKeyBytes + (r * 32 + lane) * 16, t.value[r], true);
    };
    for (int k = 0; k < Stg::kStages - 1; ++k) {
      if (k < my_tiles) stage_plain(ring + k * Stg::kStageBytes, locate_tile(p, w, cursor, pages, tile_start(k), lane));
      copy_async_commit();
    }
    TileRegs<C, D> regs;
    for (int k = 0; k < my_tiles; ++k) {
      const int ahead = k + Stg::kStages - 1;
      if (ahead < my_tiles) stage_plain(ring + (ahead % Stg::kStages) * Stg::kStageBytes, locate_tile(p, w, cursor, pages, tile_start(ahead), lane));
      copy_async_commit();
      copy_async_wait<Stg::kStages - 1>();
      TileRows rows{};
      read_tile<C, D>(regs, ring + (k % Stg::kStages) * Stg::kStageBytes, rows, lane);
#pragma unroll
      for (int r = 0; r < 2; ++r) for (int x = 0; x < 8; ++x) acc ^= regs.k[r][x];
#pragma unroll
      for (int r = 0; r < 4; ++r) for (int x = 0; x < 4; ++x) acc ^= regs.v[r][x];
    }
  } else if constexpr (kMode == 0) {
    uint8_t* ring = smem + warp * Stg::kStages * Stg::kStageBytes;
    for (int k = 0; k < Stg::kStages - 1; ++k) {
      if (k < my_tiles) stage_tile<C, D>(ring + k * Stg::kStageBytes, locate_tile(p, w, cursor, pages, tile_start(k), lane), lane);
      copy_async_commit();
    }
    TileRegs<C, D> regs;
    for (int k = 0; k < my_tiles; ++k) {
      const int ahead = k + Stg::kStages - 1;
      if (ahead < my_tiles) stage_tile<C, D>(ring + (ahead % Stg::kStages) * Stg::kStageBytes, locate_tile(p, w, cursor, pages, tile_start(ahead), lane), lane);
      copy_async_commit();
      copy_async_wait<Stg::kStages - 1>();
      TileRows rows{};
      read_tile<C, D>(regs, ring + (k % Stg::kStages) * Stg::kStageBytes, rows, lane);
#pragma unroll
      for (int r = 0; r < 2; ++r) for (int x = 0; x < 8; ++x) acc ^= regs.k[r][x];
#pragma unroll
      for (int r = 0; r < 4; ++r) for (int x = 0; x < 4; ++x) acc ^= regs.v[r][x];
    }
  } else {
    // direct loads, 4 tiles in flight per warp
    for (int k = 0; k < my_tiles; k += 4) {
      uint4 buf[4][4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (k + u < my_tiles) {
          TileRows t = locate_tile(p, w, cursor, pages, tile_start(k + u), lane);
          buf[u][0] = __ldg(reinterpret_cast<const uint4*>(t.key[0]));
          buf[u][1] = __ldg(reinterpret_cast<const uint4*>(t.key[1]));
          buf[u][2] = __ldg(reinterpret_cast<const uint4*>(t.value[0]));
          buf[u][3] = __ldg(reinterpret_cast<const uint4*>(t.value[2]));
        } else { for (int x = 0; x < 4; ++x) buf[u][x] = make_uint4(0,0,0,0); }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) for (int x = 0; x < 4; ++x) acc ^= buf[u][x].x ^ buf[u][x].y ^ buf[u][x].z ^ buf[u][x].w;
    }
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
  int sms; CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint8_t* flush; CHECK(cudaMalloc(&flush, 256 << 20));
  uint32_t* sink; CHECK(cudaMalloc(&sink, 4));
  float scale = 0.01f; float* d_scale; CHECK(cudaMalloc(&d_scale, 4)); CHECK(cudaMemcpy(d_scale, &scale, 4, cudaMemcpyHostToDevice));
  struct Shape { int B, L, H, Hk; };
  for (Shape s : {Shape{64, 4096, 32, 8}, Shape{1, 131072, 32, 8}}) {
    const int bs = 16; const int64_t nblk = (int64_t)s.B * s.L / bs; const size_t bytes = (size_t)nblk * bs * s.Hk * D;
    uint8_t *kc, *vc; CHECK(cudaMalloc(&kc, bytes)); CHECK(cudaMalloc(&vc, bytes)); cudaMemset(kc, 1, bytes); cudaMemset(vc, 1, bytes);
    std::vector<int32_t> table(nblk); std::iota(table.begin(), table.end(), 0); std::shuffle(table.begin(), table.end(), std::mt19937(0));
    int32_t *bt, *sl; CHECK(cudaMalloc(&bt, nblk * 4)); CHECK(cudaMalloc(&sl, s.B * 4));
    CHECK(cudaMemcpy(bt, table.data(), nblk * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(s.B, s.L); CHECK(cudaMemcpy(sl, lens.data(), s.B * 4, cudaMemcpyHostToDevice));
    PagedAttentionParams p{};
    p.key_cache = {kc, (int64_t)bs * s.Hk * D, (int64_t)s.Hk * D, D}; p.value_cache = {vc, (int64_t)bs * s.Hk * D, (int64_t)s.Hk * D, D};
    p.cache_dtype = DType::kFloat8E4M3FN; p.query_dtype = DType::kBFloat16;
    p.block_tables = bt; p.block_table_stride = s.L / bs; p.max_blocks_per_seq = s.L / bs; p.seq_lens = sl;
    p.num_seqs = s.B; p.num_query_tokens = s.B; p.num_heads = s.H; p.num_kv_heads = s.Hk; p.head_size = D; p.block_size = bs;
    p.num_blocks = (int)nblk; p.k_scale = {d_scale, false}; p.v_scale = {d_scale, false}; p.sliding_window = -1;
    AttentionPlan plan{}; CHECK(plan_paged_attention(p, sms, plan));
    const int smem = Staging<C, D>::kPagesOffset + pages_bytes(plan, bs);
    CHECK(cudaFuncSetAttribute(stream_kernel<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaFuncSetAttribute(stream_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaFuncSetAttribute(stream_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaFuncSetAttribute(stream_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid(plan.row_chunks, plan.num_splits, s.Hk);
    for (int mode : {0, 2, 3}) {
      std::vector<float> t; cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
      for (int it = 0; it < 25; ++it) {
        cudaMemsetAsync(flush, it, 256 << 20); cudaEventRecord(a);
        if (mode == 0) stream_kernel<0><<<grid, kThreads, smem>>>(p, plan.split_tokens, sink);
        else if (mode == 2) stream_kernel<2><<<grid, kThreads, smem>>>(p, plan.split_tokens, sink);
        else stream_kernel<3><<<grid, kThreads, smem>>>(p, plan.split_tokens, sink);
        cudaEventRecord(b); CHECK(cudaEventSynchronize(b)); float ms; cudaEventElapsedTime(&ms, a, b); if (it >= 5) t.push_back(ms * 1e3f);
      }
      std::sort(t.begin(), t.end()); float us = t[t.size() / 2];
      printf("stream B=%d L=%d splits=%d %s: %.1f us %.2f TB/s\n", s.B, s.L, plan.num_splits, mode == 3 ? "plain cp.async (no zfill)" : mode ? "cp.async full-line K" : "cp.async-ring (kernel)", us, 2.0 * bytes / us / 1e6);
    }
    cudaFree(kc); cudaFree(vc); cudaFree(bt); cudaFree(sl);
  }
}
