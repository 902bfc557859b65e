// Standalone timing of the paged-attention kernel (e4m3fn) for tuning variants; no torch.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/cuda/launchers.h"
#ifdef FP8KV_LAB_TRACE  // built by trace_lab.py
namespace fp8kv::cuda::attention { void fp8kv_set_trace(void*); }
#endif

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t x = (uint32_t)i * 2654435761u ^ seed; x ^= x >> 13; x *= 0x5bd1e995u; x ^= x >> 15;
    p[i] = (uint8_t)(x % 120);
  }
}

__global__ void read_flush(const uint4* __restrict__ p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9999u) sink[0] = acc;
}

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "variant";
  struct Shape { int B, L, H, Hk, D; };
  std::vector<Shape> shapes = {{1, 32768, 32, 8, 128}, {1, 131072, 32, 8, 128}, {16, 4096, 32, 8, 128},
                               {64, 4096, 32, 8, 128}, {16, 16384, 32, 8, 128}, {128, 2048, 32, 8, 128},
                               {256, 1024, 32, 8, 128}, {64, 4096, 32, 32, 128}, {64, 4096, 8, 1, 128}};
  int dev = 0, sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  uint8_t* flush; const size_t flush_bytes = 256ull << 20;
  CHECK(cudaMalloc(&flush, flush_bytes));
  float scale = 0.01f; float* d_scale; CHECK(cudaMalloc(&d_scale, 8)); CHECK(cudaMemcpy(d_scale, &scale, 4, cudaMemcpyHostToDevice));
  printf("%-10s", name);
  const int bs = getenv("LAB_BS") ? atoi(getenv("LAB_BS")) : 16;
  const bool hnd = getenv("LAB_HND") && atoi(getenv("LAB_HND"));
  const bool identity = getenv("LAB_IDENTITY") && atoi(getenv("LAB_IDENTITY"));
  if (getenv("LAB_FEW")) shapes = {shapes[1], shapes[3], shapes[7]};
  for (const Shape& s : shapes) {
    const int64_t nblk = (int64_t)s.B * s.L / bs;
    const size_t cache_bytes = (size_t)nblk * bs * s.Hk * s.D;
    uint8_t *kc, *vc; CHECK(cudaMalloc(&kc, cache_bytes)); CHECK(cudaMalloc(&vc, cache_bytes));
    fill_bytes<<<1024, 256>>>(kc, cache_bytes, 1); fill_bytes<<<1024, 256>>>(vc, cache_bytes, 2);
    std::vector<int32_t> table(nblk); std::iota(table.begin(), table.end(), 0);
    if (!identity) std::shuffle(table.begin(), table.end(), std::mt19937(0));
    int32_t *bt, *sl; CHECK(cudaMalloc(&bt, nblk * 4)); CHECK(cudaMalloc(&sl, s.B * 4));
    CHECK(cudaMemcpy(bt, table.data(), nblk * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(s.B, s.L); CHECK(cudaMemcpy(sl, lens.data(), s.B * 4, cudaMemcpyHostToDevice));
    uint16_t *q, *out; CHECK(cudaMalloc(&q, (size_t)s.B * s.H * s.D * 2)); CHECK(cudaMalloc(&out, (size_t)s.B * s.H * s.D * 2));
    CHECK(cudaMemset(q, 0x3c, (size_t)s.B * s.H * s.D * 2));
    fp8kv::PagedAttentionParams p{};
    p.out = out; p.out_token_stride = s.H * s.D; p.out_head_stride = s.D;
    p.query = q; p.query_token_stride = s.H * s.D; p.query_head_stride = s.D; p.query_dtype = fp8kv::DType::kBFloat16;
    // NHD: [block][token][head][dim]; HND: [block][head][token][dim].
    const int64_t token_stride = hnd ? s.D : (int64_t)s.Hk * s.D, head_stride = hnd ? (int64_t)bs * s.D : s.D;
    p.key_cache = {kc, (int64_t)bs * s.Hk * s.D, token_stride, head_stride};
    p.value_cache = {vc, (int64_t)bs * s.Hk * s.D, token_stride, head_stride};
    p.cache_dtype = fp8kv::DType::kFloat8E4M3FN;
    p.block_tables = bt; p.block_table_stride = s.L / bs; p.max_blocks_per_seq = s.L / bs; p.seq_lens = sl;
    p.cu_seqlens_q = nullptr; p.num_seqs = s.B; p.num_query_tokens = s.B; p.num_heads = s.H; p.num_kv_heads = s.Hk;
    p.head_size = s.D; p.block_size = bs; p.num_blocks = (int)nblk; p.softmax_scale = 0.088f;
    p.k_scale = {d_scale, false}; p.v_scale = {d_scale, false}; p.sliding_window = -1; p.logits_soft_cap = 0.f;
    fp8kv::cuda::AttentionPlan plan{};
    CHECK(fp8kv::cuda::plan_paged_attention(p, sms, plan));
    fp8kv::cuda::SplitWorkspace ws{};
    ws.rows = (int64_t)s.B * s.H; ws.num_splits = plan.num_splits;
    float* wsbuf = nullptr;
    if (plan.num_splits > 1) {
      CHECK(cudaMalloc(&wsbuf, (size_t)plan.num_splits * ws.rows * (s.D + 2) * 4));
      ws.acc = wsbuf; ws.row_max = wsbuf + (size_t)plan.num_splits * ws.rows * s.D; ws.row_sum = ws.row_max + plan.num_splits * ws.rows;
    }
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> times;
    for (int it = 0; it < 25; ++it) {
      read_flush<<<528, 256>>>((const uint4*)flush, flush_bytes / 16, (uint32_t*)d_scale + 1);  // clean L2, no write-back
      cudaEventRecord(a);
      CHECK(fp8kv::cuda::launch_paged_attention(p, plan, ws, 0));
      cudaEventRecord(b); CHECK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b); if (it >= 5) times.push_back(ms * 1000.f);
    }
    std::sort(times.begin(), times.end());
    const float us = times[times.size() / 2];
    printf(" | %6.1fus %4.2f", us, 2.0 * cache_bytes / us / 1e6);
#ifdef FP8KV_LAB_TRACE
    {  // one more run with the trace buffer set: phase durations per CTA from %globaltimer stamps
      unsigned long long* tr; const size_t n = 6 * 65536 + 2 * 65536;
      CHECK(cudaMalloc(&tr, n * 8)); CHECK(cudaMemset(tr, 0, n * 8));
      fp8kv::cuda::attention::fp8kv_set_trace(tr);
      read_flush<<<528, 256>>>((const uint4*)flush, flush_bytes / 16, (uint32_t*)d_scale + 1);
      cudaEventRecord(a); CHECK(fp8kv::cuda::launch_paged_attention(p, plan, ws, 0)); cudaEventRecord(b); CHECK(cudaEventSynchronize(b));
      float ms; cudaEventElapsedTime(&ms, a, b);
      fp8kv::cuda::attention::fp8kv_set_trace(nullptr);
      std::vector<unsigned long long> h(n); CHECK(cudaMemcpy(h.data(), tr, n * 8, cudaMemcpyDeviceToHost)); cudaFree(tr);
      const int ctas = plan.row_chunks * plan.num_splits * s.Hk;
      unsigned long long origin = ~0ull; for (int c = 0; c < ctas; ++c) origin = std::min(origin, h[c * 6]);
      auto pct = [&](int from, int to) { std::vector<double> v; for (int c = 0; c < ctas; ++c) v.push_back((double)(h[c * 6 + to] - (from < 0 ? origin : h[c * 6 + from])) / 1e3);
        std::sort(v.begin(), v.end()); char buf[96]; snprintf(buf, sizeof buf, "%5.1f/%5.1f/%5.1f", v[0], v[v.size() / 2], v.back()); return std::string(buf); };
      fprintf(stderr, "\nB%d L%d H%d/%d splits %d ctas %d event %.1f us | min/med/max us: start %s prologue %s first-tile %s loop %s epilogue %s end %s",
              s.B, s.L, s.H, s.Hk, plan.num_splits, ctas, ms * 1e3, pct(-1, 0).c_str(), pct(0, 1).c_str(), pct(1, 2).c_str(), pct(2, 3).c_str(), pct(3, 4).c_str(), pct(-1, 4).c_str());
      if (plan.num_splits > 1) {
        double m0 = 1e30, m0max = 0, m1 = 0;
        for (int r = 0; r < ws.rows; ++r) { m0 = std::min(m0, (double)(h[6 * 65536 + 2 * r] - origin)); m0max = std::max(m0max, (double)(h[6 * 65536 + 2 * r] - origin)); m1 = std::max(m1, (double)(h[6 * 65536 + 2 * r + 1] - origin)); }
        fprintf(stderr, " | merge start %.1f..%.1f end %.1f us", m0 / 1e3, m0max / 1e3, m1 / 1e3);
      }
    }
#endif
    if (getenv("LAB_HASH")) {  // FNV-1a of the output bytes: staging variants must agree bit for bit
      std::vector<uint8_t> host((size_t)s.B * s.H * s.D * 2);
      CHECK(cudaMemcpy(host.data(), out, host.size(), cudaMemcpyDeviceToHost));
      uint64_t h = 1469598103934665603ull;
      for (uint8_t byte : host) h = (h ^ byte) * 1099511628211ull;
      fprintf(stderr, "B%d L%d H%d/%d: %016llx\n", s.B, s.L, s.H, s.Hk, (unsigned long long)h);
    }
    cudaFree(kc); cudaFree(vc); cudaFree(bt); cudaFree(sl); cudaFree(q); cudaFree(out); if (wsbuf) cudaFree(wsbuf);
  }
  printf("\n");
  return 0;
}
