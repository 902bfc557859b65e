// CUDA paged attention for multi-token queries (prefill, chunked prefill, speculative verification):
// FlashAttention-2-style tiles over the paged FP8 (or 16-bit) cache with mma.sync, the kernel for
// every GPU before Hopper and for short queries; and the pieces the Hopper kernel shares with it (row
// planning, page staging, the softmax step, the epilogue). Design: docs/cuda_prefill_design.md.
#pragma once
#include <algorithm>
#include <climits>

#include "attention_io.cuh"
#include "launch.h"

namespace fp8kv::cuda::prefill {

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

// Finds the CTA's query tile among all sequences' tiles (ceil(q_len / tokens_per_tile) each, in
// sequence order) with a block-wide scan of cu_seqlens_q. Returns false past the last tile.
// Called by every thread of the CTA (kCtaThreads of them).
template <int kCtaThreads>
__device__ __forceinline__ bool find_query_tile(const int32_t* cu_seqlens_q, int num_seqs, int tokens_per_tile,
                                                int tile, int& seq, int& tile_in_seq) {
  constexpr int kCtaWarps = kCtaThreads / 32;
  __shared__ int warp_totals[kCtaWarps];
  __shared__ int found[2];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) found[0] = -1;
  int base = 0;  // tiles of the sequences before this chunk of sequences
  for (int start = 0; start < num_seqs; start += kCtaThreads) {
    const int i = start + threadIdx.x;
    const int q_len = i < num_seqs ? __ldg(cu_seqlens_q + i + 1) - __ldg(cu_seqlens_q + i) : 0;
    const int tiles = max(0, (q_len + tokens_per_tile - 1) / tokens_per_tile);
    int inclusive = tiles;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += other;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    int first = base + inclusive - tiles, total = 0;
#pragma unroll
    for (int x = 0; x < kCtaWarps; ++x) {
      if (x < warp) first += warp_totals[x];
      total += warp_totals[x];
    }
    if (tiles > 0 && tile >= first && tile < first + tiles) found[0] = i, found[1] = tile - first;
    __syncthreads();
    if (found[0] >= 0) {
      seq = found[0];
      tile_in_seq = found[1];
      return true;
    }
    base += total;
  }
  return false;
}

// The two query rows a lane owns in the mma fragments: warp rows g and g + 8.
struct LaneRows {
  int64_t query_row[2];  // row of query/out; -1: padding
  int head[2];
  int lo[2], hi[2];      // visible cache positions [lo, hi), within the CTA's split
};

// Everything a CTA knows about its work.
struct PrefillWork {
  int seq, kv_head;
  // At most 16 rows (decode rows, draft tokens): every warp takes the same rows and a 16-key
  // slice of each tile, and the warps merge at the end, so short queries are not one warp's work.
  bool shared_rows;
  int lo, hi;                    // positions any row of the CTA sees in this split
  int warp_lo, warp_hi;          // positions any row of this warp sees
  int interior_lo, interior_hi;  // positions every row of this warp sees (no mask needed)
};

// Fills the lane's rows (those of `warp`, the warp's index among the CTA's kCtaRows / 16 row-owning
// warps) and the CTA's / warp's position ranges. Returns false when the CTA has nothing to do (past
// the last tile). Called by every thread of the CTA (kCtaThreads of them). kShareShortRows: a CTA
// with at most 16 rows gives them to every warp (PrefillWork::shared_rows).
template <int kCtaRows, int kCtaThreads, bool kShareShortRows>
__device__ __forceinline__ bool plan_prefill_cta(const PagedAttentionParams& p, int split, int split_tokens, int warp,
                                                 PrefillWork& w, LaneRows& rows) {
  const int group = p.num_heads / p.num_kv_heads;
  const RowMap map = RowMap::make(group, kCtaRows);
  const int head_chunk = blockIdx.z % map.head_chunks;
  w.kv_head = blockIdx.z / map.head_chunks;
  int tile_in_seq = 0;
  // Tiles in reverse order: in a causal sequence the later tiles have the most keys, so they start first.
  if (!find_query_tile<kCtaThreads>(p.cu_seqlens_q, p.num_seqs, map.tokens_per_tile, gridDim.x - 1 - blockIdx.x,
                                    w.seq, tile_in_seq)) {
    return false;
  }
  const int first_token = __ldg(p.cu_seqlens_q + w.seq);
  const int q_len = __ldg(p.cu_seqlens_q + w.seq + 1) - first_token;
  const int j0 = tile_in_seq * map.tokens_per_tile;
  const int tokens = min(map.tokens_per_tile, q_len - j0);
  // Clamped to the table's capacity so that unchecked (non-debug) input never reads past it.
  const int seq_len = min(__ldg(p.seq_lens + w.seq), p.max_blocks_per_seq * p.block_size);
  const int split_lo = split * split_tokens, split_hi = split_lo + split_tokens;
  auto keys = [&](int j) { return visible_keys(seq_len, q_len, j, p.sliding_window); };
  w.lo = max(keys(j0).begin, split_lo);
  w.hi = min(keys(j0 + tokens - 1).end, split_hi);

  const int lane = threadIdx.x % 32;
  w.shared_rows = kShareShortRows && tokens * map.heads_per_tile <= kWarpRows;
  int lo_min = INT_MAX, hi_max = INT_MIN, lo_max = INT_MIN, hi_min = INT_MAX;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = (w.shared_rows ? 0 : kWarpRows * warp) + lane / 4 + 8 * r;
    const int j = j0 + row / map.heads_per_tile;
    const int head_in_group = head_chunk * map.heads_per_tile + row % map.heads_per_tile;
    const bool valid = row < map.tokens_per_tile * map.heads_per_tile && j < j0 + tokens &&
                       head_in_group < group && first_token + j < p.num_query_tokens;
    rows.query_row[r] = valid ? first_token + j : -1;
    rows.head[r] = w.kv_head * group + head_in_group;
    rows.lo[r] = valid ? max(keys(j).begin, w.lo) : 0;
    rows.hi[r] = valid ? min(keys(j).end, w.hi) : 0;
    if (valid) {
      lo_min = min(lo_min, rows.lo[r]), hi_max = max(hi_max, rows.hi[r]);
      lo_max = max(lo_max, rows.lo[r]), hi_min = min(hi_min, rows.hi[r]);
    }
  }
  w.warp_lo = __reduce_min_sync(0xffffffffu, lo_min);
  w.warp_hi = __reduce_max_sync(0xffffffffu, hi_max);
  w.interior_lo = __reduce_max_sync(0xffffffffu, lo_max);
  w.interior_hi = __reduce_min_sync(0xffffffffu, hi_min);
  return true;
}

// Issues the cp.async copies of the K and V rows of tile [tile_start, tile_start + kKeys) into a
// stage, by kThreads threads: 16-byte copy `chunk` of key row `key` lands at stage + dst(key, chunk),
// its V row's at value_offset past it. Positions outside [w.lo, w.hi) and pages outside
// [0, num_blocks) are zero-filled, never read.
template <DType C, int D, int kKeys, typename Dst>
__device__ __forceinline__ void stage_tile(const PagedAttentionParams& p, const PrefillWork& w,
                                           const int32_t* table_row, int tile_start, uint8_t* stage, Dst&& dst,
                                           int value_offset) {
  constexpr int kElemBytes = CacheTraits<C>::kElemBytes;
  constexpr int kCopyChunks = D * kElemBytes / 16;  // 16-byte copies per cache row
  const int block_shift = __ffs(p.block_size) - 1;
  const auto* key_base = static_cast<const uint8_t*>(p.key_cache.data) +
                         static_cast<int64_t>(w.kv_head) * p.key_cache.head_stride * kElemBytes;
  const auto* value_base = static_cast<const uint8_t*>(p.value_cache.data) +
                           static_cast<int64_t>(w.kv_head) * p.value_cache.head_stride * kElemBytes;
  constexpr int kItems = kKeys * kCopyChunks;
#pragma unroll
  for (int i = 0; i < (kItems + kThreads - 1) / kThreads; ++i) {
    const int item = threadIdx.x + i * kThreads;
    if (kItems % kThreads != 0 && item >= kItems) break;
    const int key = item / kCopyChunks, chunk = item % kCopyChunks;
    const int pos = tile_start + key;
    const int page = pos >= w.lo && pos < w.hi ? __ldg(table_row + (pos >> block_shift)) : -1;
    // Entries outside [0, num_blocks) are reported in debug-check mode; here they read as zeros.
    const bool valid = page >= 0 && page < p.num_blocks;
    const int64_t safe_page = valid ? page : 0;
    const int in_page = pos & (p.block_size - 1);
    const uint8_t* key_src = key_base + (safe_page * p.key_cache.block_stride + in_page * p.key_cache.token_stride) *
                                            kElemBytes + chunk * 16;
    const uint8_t* value_src = value_base + (safe_page * p.value_cache.block_stride +
                                             in_page * p.value_cache.token_stride) * kElemBytes + chunk * 16;
    const int key_dst = dst(key, chunk);
    copy_async<16>(stage + key_dst, key_src, valid);
    copy_async<16>(stage + key_dst + value_offset, value_src, valid);
  }
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

// One warp's online-softmax state for its 16 rows (lane: rows g, g + 8), its accumulators the O
// fragments [dim n-tile][c0..c3].
template <int D>
using WarpState = OnlineSoftmax<D / 8>;

// S = Q K^T, softmax update and O += P V for one tile, by one warp.
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

// One tile's online-softmax step for the lane's two rows, shared by both multi-token kernels: S (the
// mma accumulators of Q K^T for keys tile_start .. tile_start + 8 kKeyTiles - 1) is scaled, soft-capped
// and masked to each row's visible keys (unless `interior`), the running max and sum move, and P
// leaves as the A fragments of O += P V (keys 16kk .. 16kk + 15). O itself is left to the caller
// (rescale_output with `rescale`), which may still have an MMA writing it.
template <bool kBf16, int D, int kKeyTiles>
__device__ __forceinline__ void softmax_step(float (&s)[kKeyTiles][4], WarpState<D>& st, const LaneRows& rows,
                                             int tile_start, bool interior, float logit_multiplier, float soft_cap,
                                             uint32_t (&p_frag)[kKeyTiles / 2][4], float (&rescale)[2]) {
  const int t = threadIdx.x % 4;
  // s[j][i]: row g + 8 * (i / 2), key tile_start + 8j + 2t + i % 2. The branches are around whole
  // loops: a branch per element keeps the compiler from interleaving the elements' arithmetic.
  if (soft_cap > 0.f) {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = soft_capped(s[j][i] * logit_multiplier, soft_cap);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] *= logit_multiplier;
    }
  }
  if (!interior) {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pos = tile_start + 8 * j + 2 * t + i % 2;
        if (!(pos >= rows.lo[i / 2] && pos < rows.hi[i / 2])) s[j][i] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    // Lazy rescale, as in the decode kernel: P may grow to 2^kRescaleSlack before the max moves.
    rescale[h] = 1.f;
    if (tile_max > st.row_max[h] + kRescaleSlack) {
      rescale[h] = fast_exp2(st.row_max[h] - tile_max);  // 0 when the old max is -inf
      st.row_sum[h] *= rescale[h];
      st.row_max[h] = tile_max;
    }
    // A row with no visible key so far keeps row_max = -inf: its probabilities are exp2(-inf) = 0.
    const float reference = st.row_max[h] == -INFINITY ? 0.f : st.row_max[h];
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      s[j][2 * h] = fast_exp2(s[j][2 * h] - reference);
      s[j][2 * h + 1] = fast_exp2(s[j][2 * h + 1] - reference);
      st.row_sum[h] += s[j][2 * h] + s[j][2 * h + 1];
    }
  }

#pragma unroll
  for (int kk = 0; kk < kKeyTiles / 2; ++kk) {
    p_frag[kk][0] = pack_pair<kBf16>(s[2 * kk][0], s[2 * kk][1]);
    p_frag[kk][1] = pack_pair<kBf16>(s[2 * kk][2], s[2 * kk][3]);
    p_frag[kk][2] = pack_pair<kBf16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    p_frag[kk][3] = pack_pair<kBf16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// O's rows times the factors softmax_step returned (rows whose max did not move are left alone).
template <int kTiles>
__device__ __forceinline__ void rescale_output(OnlineSoftmax<kTiles>& st, const float (&rescale)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rescale[h] != 1.f) {
#pragma unroll
      for (int n = 0; n < kTiles; ++n) st.acc[n][2 * h] *= rescale[h], st.acc[n][2 * h + 1] *= rescale[h];
    }
  }
}

// kKeys: the keys this warp attends to (the whole tile, or its slice with shared rows), starting at
// key_smem / value_smem and at cache position tile_start.
template <DType C, int D, int kKeys>
__device__ __forceinline__ void attend_tile(const uint32_t (&q_frag)[D / 16][4], uint32_t key_smem, uint32_t value_smem,
                                            WarpState<D>& st, const LaneRows& rows, int tile_start, bool interior,
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

// Q fragments (A of S = Q K^T): rows g, g + 8; k-step `step` holds dims 16 step + 2t (+1) and + 8.
template <DType C, int D>
__device__ __forceinline__ void load_query(const PagedAttentionParams& p, const LaneRows& rows, int t, bool query_bf16,
                                           uint32_t (&q_frag)[D / 16][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const QueryRow<CacheTraits<C>::kBf16Math> q(p, rows.query_row[r], rows.head[r], query_bf16);
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
#pragma unroll
      for (int half = 0; half < 2; ++half) q_frag[step][2 * half + r] = q.pair(16 * step + 8 * half + 2 * t);
    }
  }
}

// The main loop: the CTA stages the tiles of [w.lo, w.hi) through a ring of kStages (kStages - 1 in
// flight), FP8 tiles converted to 16-bit operands once per CTA; each warp attends to the tile's keys
// its rows see, into st.
template <DType C, int D, int kStages>
__device__ __forceinline__ void attend_cta(const PagedAttentionParams& p, const PrefillWork& w, const LaneRows& rows,
                                           const uint32_t (&q_frag)[D / 16][4], float multiplier, int warp,
                                           uint8_t* smem, WarpState<D>& st) {
  using T = Tile<C, D, kStages>;
  const float soft_cap = p.logits_soft_cap;
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint8_t* operands = smem + T::kStages * T::kStageBytes;  // FP8 only
  const int32_t* table_row = p.block_tables + w.seq * p.block_table_stride;

  const int first_tile = w.lo / T::kKeys * T::kKeys;
  const int num_tiles = w.hi > w.lo ? (w.hi - first_tile + T::kKeys - 1) / T::kKeys : 0;
  // FP8 tiles land raw (row-major), 16-bit ones in operand layout.
  auto stage = [&](int tile, uint8_t* dst) {
    if constexpr (T::kFp8) {
      stage_tile<C, D, T::kKeys>(
          p, w, table_row, first_tile + tile * T::kKeys, dst, [](int key, int chunk) { return key * D + chunk * 16; },
          T::kKeys * D);
    } else {
      stage_tile<C, D, T::kKeys>(
          p, w, table_row, first_tile + tile * T::kKeys, dst,
          [](int key, int chunk) { return static_cast<int>(operand_offset<T::kRowBytes>(key, chunk)); },
          T::kOperandBytes);
    }
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

// Writes the lane's rows g and g + 8 (see write_row): dims 8n + 2t, 8n + 2t + 1 of each n-tile.
template <DType C, int D>
__device__ __forceinline__ void write_rows(const PagedAttentionParams& p, const SplitWorkspace& ws, int split,
                                           const PrefillWork& w, const LaneRows& rows, int t, bool out_bf16,
                                           const WarpState<D>& st) {
  const float v_scale = output_scale<C>(p, w.kv_head);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rows.query_row[h] < 0) continue;
    write_row<D>(p, ws, split, rows.query_row[h], rows.head[h], out_bf16, v_scale, st.row_max[h], st.row_sum[h], t == 0,
                 [&](auto store) {
#pragma unroll
                   for (int n = 0; n < D / 8; ++n) store(8 * n + 2 * t, st.acc[n][2 * h], st.acc[n][2 * h + 1]);
                 });
  }
}

// Unlike the decode kernel, it does not let the merge start early (allow_dependent_grid): that moves
// its parameter loads and costs main-loop instructions; the merge then starts when the grid ends.
template <DType C, int D, int kStages>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm(D, kStages))
    prefill_kernel(const PagedAttentionParams p, SplitWorkspace ws, int split_tokens) {
  const int t = threadIdx.x % 4, warp = threadIdx.x / 32;
  const int split = blockIdx.y;

  PrefillWork w;
  LaneRows rows;
  if (!plan_prefill_cta<kRows, kThreads, true>(p, split, split_tokens, warp, w, rows)) return;
  const bool query_bf16 = p.query_dtype == DType::kBFloat16;  // also the output's
  uint32_t q_frag[D / 16][4];
  load_query<C, D>(p, rows, t, query_bf16, q_frag);
  const float multiplier = logit_multiplier<C>(p, w.kv_head);

  WarpState<D> st;

  extern __shared__ __align__(128) uint8_t prefill_smem[];
  attend_cta<C, D, kStages>(p, w, rows, q_frag, multiplier, warp, prefill_smem, st);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st.row_sum[h] += __shfl_xor_sync(0xffffffffu, st.row_sum[h], 1);
    st.row_sum[h] += __shfl_xor_sync(0xffffffffu, st.row_sum[h], 2);
  }
  if (w.shared_rows) {
    __syncthreads();  // every warp is done with the tiles: reuse their shared memory for the merge
    if (!merge_warps<D>(st, prefill_smem)) return;
  }
  write_rows<C, D>(p, ws, split, w, rows, t, query_bf16, st);
}

// After a multi-token kernel's launch: its status, or the merge's when there are splits to merge.
inline cudaError_t merge_splits(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                                cudaStream_t stream) {
  const cudaError_t status = cudaGetLastError();
  return status != cudaSuccess || plan.num_splits == 1 ? status : merge::launch(p, ws, stream);
}

template <DType C, int D, int kStages>
cudaError_t launch_variant(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                           cudaStream_t stream) {
  const RowMap map = RowMap::make(p.num_heads / p.num_kv_heads, kRows);
  const dim3 grid(static_cast<unsigned>(plan.query_tiles), static_cast<unsigned>(plan.num_splits),
                  static_cast<unsigned>(p.num_kv_heads * map.head_chunks));
  prefill_kernel<C, D, kStages><<<grid, kThreads, Tile<C, D, kStages>::kSmemBytes, stream>>>(p, ws, plan.split_tokens);
  return merge_splits(p, plan, ws, stream);
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
cudaError_t launch_sm80(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                        cudaStream_t stream) {
  return dispatch_variant(p.head_size, plan.deep_staging, cudaErrorInvalidValue, [&](auto head, auto stages) {
    return launch_variant<C, decltype(head)::value, decltype(stages)::value>(p, plan, ws, stream);
  });
}

template <DType C>
int resident_ctas_sm80(int head_size, bool deep_staging) {
  return dispatch_variant(head_size, deep_staging, 0, [](auto head, auto stages) {
    constexpr int kSmemBytes = Tile<C, decltype(head)::value, decltype(stages)::value>::kSmemBytes;
    return cuda::resident_ctas(
        reinterpret_cast<const void*>(prefill_kernel<C, decltype(head)::value, decltype(stages)::value>), kThreads,
        kSmemBytes, kSmemBytes);
  });
}

}  // namespace fp8kv::cuda::prefill
