// CUDA paged attention for multi-token queries with mma.sync (the shared pieces: multi_token.cuh):
// FlashAttention-2-style tiles over the paged FP8 (or 16-bit) cache; the kernel for every GPU before
// Hopper, for head sizes the sm90a kernel lacks, and for short queries. Design:
// docs/cuda_prefill_design.md.
#pragma once

#include "multi_token.cuh"

namespace fp8kv::cuda::multi_token::sm80 {

// Shared-memory geometry. K and V tiles are read by the tensor cores as 16-bit rows of D
// elements, 16-byte chunk c of row r stored at chunk c ^ (r % 8) (conflict-free ldmatrix); rows are
// padded to a multiple of 8 chunks so the swizzle stays inside the row. FP8 tiles land raw
// (row-major, D bytes per row) in a ring of stages and are converted into one operand buffer;
// 16-bit tiles land directly in operand layout, one operand buffer per stage.
template <DType C, int D, int kStageCount = kShallowStages>
struct Tile {
  static constexpr bool kFp8 = CacheTraits<C>::kIsFp8;
  static constexpr int kKeys = D <= 128 ? 64 : 32;  // keys per tile (bounds registers at D = 256)
  static_assert(kSplitAlign % kKeys == 0, "splits must start on a tile");
  static constexpr int kChunks = D / 8;               // 16-byte chunks of a 16-bit row
  static constexpr int kRowBytes = (kChunks + 7) / 8 * 8 * 16;
  static constexpr int kOperandBytes = kKeys * kRowBytes;  // one of K, V
  static constexpr int kStages = kStageCount;  // kStages - 1 tiles in flight while one is attended
  static constexpr int kStageBytes = kFp8 ? 2 * kKeys * D : 2 * kOperandBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + (kFp8 ? 2 * kOperandBytes : 0);
  static_assert(kSmemBytes >= (kWarps - 1) * 32 * (D / 8 + 1) * 16, "the warp merge reuses the shared memory");
};

// Byte offset of 16-byte chunk `chunk` of row `row` in an operand buffer.
template <int kRowBytes>
__device__ __forceinline__ unsigned operand_offset(unsigned row, unsigned chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}

// FP8 stage -> 16-bit operands, by the whole CTA. V's rows follow K's in both buffers, so the
// tile is 2 * kKeys rows: each thread converts 8-byte runs (8 values) of rows it strides over.
template <DType C, int D>
__device__ __forceinline__ void convert_tile(const uint8_t* stage, uint8_t* operands) {
  using T = Tile<C, D>;
  constexpr int kRuns = 2 * T::kKeys * T::kChunks;
  auto convert_run = [&](unsigned row, unsigned chunk) {
    const uint2 raw = *reinterpret_cast<const uint2*>(stage + row * D + chunk * 8);
    uint4 half;
    convert_fp8x4<C>(raw.x, half.x, half.y);
    convert_fp8x4<C>(raw.y, half.z, half.w);
    *reinterpret_cast<uint4*>(operands + operand_offset<T::kRowBytes>(row, chunk)) = half;
  };
  if constexpr (kThreads % T::kChunks == 0) {
    // A fixed chunk per thread: addresses are loop-invariant offsets, not registers per run.
    constexpr unsigned kRowsPerPass = kThreads / T::kChunks;
    const unsigned chunk = threadIdx.x % T::kChunks, first_row = threadIdx.x / T::kChunks;
#pragma unroll
    for (unsigned i = 0; i < kRuns / kThreads; ++i) convert_run(first_row + i * kRowsPerPass, chunk);
  } else {
#pragma unroll 2
    for (unsigned run = threadIdx.x; run < kRuns; run += kThreads) convert_run(run / T::kChunks, run % T::kChunks);
  }
}

// Runs load(i, fragment) kDepth - 1 items ahead of use(i, fragment), so that shared-memory
// latency hides behind the tensor-core work of earlier items (fully unrolled: fragments stay in
// registers).
template <int kItems, int kDepth = 3, typename Load, typename Use>
__device__ __forceinline__ void pipelined(Load&& load, Use&& use) {
  uint32_t fragments[kDepth][4];
#pragma unroll
  for (int i = 0; i < kDepth - 1 && i < kItems; ++i) load(i, fragments[i % kDepth]);
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    if (i + kDepth - 1 < kItems) load(i + kDepth - 1, fragments[(i + kDepth - 1) % kDepth]);
    use(i, fragments[i % kDepth]);
  }
}

// S = Q K^T, softmax step and O += P V for one tile, by one warp. kKeys: the keys this warp attends to
// (the whole tile, or its slice with shared rows), starting at key_smem / value_smem and at cache
// position tile_start.
template <DType C, int D, int kKeys>
__device__ __forceinline__ void attend_tile(const uint32_t (&q_frag)[D / 16][4], uint32_t key_smem, uint32_t value_smem,
                                            WarpState<D>& st, const LaneQueryRows& rows, int tile_start, bool interior,
                                            float logit_multiplier, float soft_cap) {
  using T = Tile<C, D>;
  constexpr bool kBf16 = CacheTraits<C>::kBf16Math;
  constexpr int kKeyTiles = kKeys / 8;
  const int lane = threadIdx.x % 32;
  const int m = lane / 8, r = lane % 8;  // ldmatrix: lane supplies row r of matrix m

  float s[kKeyTiles][4];
#pragma unroll
  for (int j = 0; j < kKeyTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  // K fragments: matrices (keys 8j.., chunk 2step), (8j.., 2step+1), (8j+8.., 2step), (8j+8.., 2step+1);
  // item i = (step, j / 2).
  const uint32_t key_lane = key_smem + (8 * (m / 2) + r) * T::kRowBytes;
  const int key_swizzle = (m % 2) ^ r;
  constexpr int kKeyPairs = kKeyTiles / 2;
  pipelined<D / 16 * kKeyPairs>(
      [&](int i, uint32_t (&b)[4]) {
        const int step = i / kKeyPairs, j = 2 * (i % kKeyPairs);
        load_matrix_x4(b, key_lane + j * 8 * T::kRowBytes + (((2 * step) ^ key_swizzle) << 4));
      },
      [&](int i, const uint32_t (&b)[4]) {
        const int step = i / kKeyPairs, j = 2 * (i % kKeyPairs);
        mma_16x8x16<kBf16>(s[j], q_frag[step], b[0], b[1]);
        mma_16x8x16<kBf16>(s[j + 1], q_frag[step], b[2], b[3]);
      });

  uint32_t p_frag[kKeys / 16][4];
  float rescale[2];
  softmax_step<kBf16, D>(s, st, rows, tile_start, interior, logit_multiplier, soft_cap, p_frag, rescale);
  rescale_output(st, rescale);

  // O += P V, V fragments by transposing ldmatrix: matrices (keys 16kk.., chunk n), (16kk+8.., n), (16kk.., n+1), (16kk+8.., n+1).
  const uint32_t value_lane = value_smem + (8 * (m % 2) + r) * T::kRowBytes;
  const int value_swizzle = (m / 2) ^ r;
  constexpr int kDimPairs = D / 16;  // item i = (kk, n / 2)
  pipelined<kKeys / 16 * kDimPairs>(
      [&](int i, uint32_t (&b)[4]) {
        const int kk = i / kDimPairs, n = 2 * (i % kDimPairs);
        load_matrix_x4_trans(b, value_lane + kk * 16 * T::kRowBytes + ((n ^ value_swizzle) << 4));
      },
      [&](int i, const uint32_t (&b)[4]) {
        const int kk = i / kDimPairs, n = 2 * (i % kDimPairs);
        mma_16x8x16<kBf16>(st.acc[n], p_frag[kk], b[0], b[1]);
        mma_16x8x16<kBf16>(st.acc[n + 1], p_frag[kk], b[2], b[3]);
      });
}

// Shared rows: folds the other warps' states for rows 0..15 into warp 0's (log-sum-exp weights).
// Returns true in warp 0, which then writes the rows. Called by every thread of the CTA.
template <int D>
__device__ __forceinline__ bool merge_warps(WarpState<D>& st, uint8_t* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Warps 1.. store their fragments as held: acc[warp - 1][lane][n-tile] = (c0, c1, c2, c3).
  auto acc = reinterpret_cast<float4 (*)[32][D / 8]>(smem);
  auto max_sum = reinterpret_cast<float4 (*)[32]>(smem + (kWarps - 1) * 32 * (D / 8) * sizeof(float4));
  if (warp != 0) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[warp - 1][lane][n] = make_float4(st.acc[n][0], st.acc[n][1], st.acc[n][2], st.acc[n][3]);
    max_sum[warp - 1][lane] = make_float4(st.row_max[0], st.row_max[1], st.row_sum[0], st.row_sum[1]);
  }
  __syncthreads();
  if (warp != 0) return false;
  float4 others[kWarps - 1];
#pragma unroll
  for (int x = 0; x < kWarps - 1; ++x) others[x] = max_sum[x][lane];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    auto other_max = [&](int x) { return h == 0 ? others[x].x : others[x].y; };
    auto other_sum = [&](int x) { return h == 0 ? others[x].z : others[x].w; };
    float max_all = st.row_sum[h] > 0.f ? st.row_max[h] : -INFINITY;
#pragma unroll
    for (int x = 0; x < kWarps - 1; ++x) max_all = fmaxf(max_all, other_sum(x) > 0.f ? other_max(x) : -INFINITY);
    // A warp that saw no key has sum 0 and must not contribute.
    const float own = st.row_sum[h] > 0.f ? fast_exp2(st.row_max[h] - max_all) : 0.f;
    float weight[kWarps - 1];
    float sum = own * st.row_sum[h];
#pragma unroll
    for (int x = 0; x < kWarps - 1; ++x) {
      weight[x] = other_sum(x) > 0.f ? fast_exp2(other_max(x) - max_all) : 0.f;
      sum += weight[x] * other_sum(x);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      float o0 = own * st.acc[n][2 * h], o1 = own * st.acc[n][2 * h + 1];
#pragma unroll
      for (int x = 0; x < kWarps - 1; ++x) {
        const float4 a = acc[x][lane][n];
        o0 += weight[x] * (h == 0 ? a.x : a.z), o1 += weight[x] * (h == 0 ? a.y : a.w);
      }
      st.acc[n][2 * h] = o0, st.acc[n][2 * h + 1] = o1;
    }
    st.row_max[h] = max_all, st.row_sum[h] = sum;
  }
  return true;
}

// The main loop: the CTA stages the tiles of [w.lo, w.hi) through a ring of kStages (kStages - 1 in
// flight), FP8 tiles converted to 16-bit operands once per CTA; each warp attends to the tile's keys
// its rows see, into st.
template <DType C, int D, int kStages>
__device__ __forceinline__ void attend_cta(const PagedAttentionParams& p, const CtaWork& w, const LaneQueryRows& rows,
                                           const uint32_t (&q_frag)[D / 16][4], float multiplier, int warp,
                                           uint8_t* smem, WarpState<D>& st) {
  using T = Tile<C, D, kStages>;
  const float soft_cap = p.logits_soft_cap;
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint8_t* operands = smem + T::kStages * T::kStageBytes;  // FP8 only
  const int32_t* table_row = p.block_tables + w.seq * p.block_table_stride;

  const int first_tile = w.lo / T::kKeys * T::kKeys;
  const int num_tiles = w.hi > w.lo ? (w.hi - first_tile + T::kKeys - 1) / T::kKeys : 0;
  auto stage = [&](int tile, uint8_t* dst) {
    stage_tile<C, D, T::kKeys, kThreads>(
        p, w, table_row, first_tile + tile * T::kKeys, dst,
        [](int key, int chunk) { return static_cast<int>(operand_offset<T::kRowBytes>(key, chunk)); },
        T::kOperandBytes);
  };
  // Keep kStages - 1 tiles in flight; every iteration commits one (possibly empty) copy group.
#pragma unroll
  for (int k = 0; k < T::kStages - 1; ++k) {
    if (k < num_tiles) stage(k, smem + k * T::kStageBytes);
    copy_async_commit();
  }
  for (int k = 0; k < num_tiles; ++k) {
    const int tile_start = first_tile + k * T::kKeys;
    copy_async_wait<T::kStages - 2>();
    // Tile k is visible to every thread, and every warp is done with tile k - 1 (its stage and operands).
    __syncthreads();
    const int ahead = k + T::kStages - 1;
    if (ahead < num_tiles) {
      stage(ahead, smem + (ahead % T::kStages) * T::kStageBytes);
    }
    copy_async_commit();
    uint32_t key_smem;
    if constexpr (T::kFp8) {
      convert_tile<C, D>(smem + (k % T::kStages) * T::kStageBytes, operands);
      __syncthreads();
      key_smem = smem_base + T::kStages * T::kStageBytes;
    } else {
      key_smem = smem_base + (k % T::kStages) * T::kStageBytes;
    }
    // Warps whose rows see none of their keys skip them (causal rows before, window rows after).
    auto attend = [&](auto keys, int offset) {
      constexpr int kKeys = decltype(keys)::value;
      const int start = tile_start + offset;
      if (start < w.warp_hi && start + kKeys > w.warp_lo) {
        const bool interior = start >= w.interior_lo && start + kKeys <= w.interior_hi;
        const uint32_t key_rows = key_smem + offset * T::kRowBytes;
        attend_tile<C, D, kKeys>(q_frag, key_rows, key_rows + T::kOperandBytes, st, rows, start, interior,
                                 multiplier, soft_cap);
      }
    };
    if (!w.shared_rows) {
      attend(std::integral_constant<int, T::kKeys>{}, 0);
    } else if (16 * warp < T::kKeys) {
      attend(std::integral_constant<int, 16>{}, 16 * warp);
    }
  }
  copy_async_wait<0>();
}

// Unlike the decode kernel, it does not let the merge start early (allow_dependent_grid): that moves
// its parameter loads and costs main-loop instructions; the merge then starts when the grid ends.
template <DType C, int D, int kStages>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm(D, kStages))
    sm80_kernel(const PagedAttentionParams p, SplitWorkspace ws, int split_tokens) {
  const int t = threadIdx.x % 4, warp = threadIdx.x / 32;
  const int split = blockIdx.y;

  CtaWork w;
  LaneQueryRows rows;
  if (!cta_work<kRows, kThreads, true>(p, split, split_tokens, warp, w, rows)) return;
  const bool query_bf16 = p.query_dtype == DType::kBFloat16;  // also the output's
  uint32_t q_frag[D / 16][4];
  load_query<C, D>(p, rows, w.kv_head, t, query_bf16, q_frag);
  const float multiplier = logit_multiplier<C>(p, w.kv_head);

  WarpState<D> st;

  extern __shared__ __align__(128) uint8_t sm80_smem[];
  attend_cta<C, D, kStages>(p, w, rows, q_frag, multiplier, warp, sm80_smem, st);

  sum_row_shares(st);
  if (w.shared_rows) {
    __syncthreads();  // every warp is done with the tiles: reuse their shared memory for the merge
    if (!merge_warps<D>(st, sm80_smem)) return;
  }
  write_rows<C, D>(p, ws, split, w, rows, t, query_bf16, st);
}

inline constexpr int kStagings[] = {kShallowStages, kDeepStages};

// fn(head-size constant, stage-count constant); `unsupported` for a head size without a kernel.
template <typename Result, typename Fn>
Result dispatch_variant(int head_size, bool deep_staging, Result unsupported, Fn&& fn) {
  return dispatch<kCudaHeadSizes>(head_size, unsupported, [&](auto head) {
    return dispatch<kStagings>(deep_staging ? kDeepStages : kShallowStages, unsupported,
                               [&](auto stages) { return fn(head, stages); });
  });
}

template <DType C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                   cudaStream_t stream) {
  return dispatch_variant(p.head_size, plan.deep_staging, cudaErrorInvalidValue, [&](auto head, auto stages) {
    constexpr int kHead = decltype(head)::value, kStages = decltype(stages)::value;
    return launch_grid<kRows>(sm80_kernel<C, kHead, kStages>, kThreads, Tile<C, kHead, kStages>::kSmemBytes, p, plan,
                              ws, stream);
  });
}

template <DType C>
int occupancy(int head_size, bool deep_staging) {
  return dispatch_variant(head_size, deep_staging, 0, [](auto head, auto stages) {
    constexpr int kHead = decltype(head)::value, kStages = decltype(stages)::value;
    constexpr int kSmemBytes = Tile<C, kHead, kStages>::kSmemBytes;
    return kernel_occupancy(reinterpret_cast<const void*>(sm80_kernel<C, kHead, kStages>), kThreads, kSmemBytes,
                            kSmemBytes);
  });
}

}  // namespace fp8kv::cuda::multi_token::sm80
