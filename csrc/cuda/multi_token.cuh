// CUDA paged attention for multi-token queries (prefill, chunked prefill, speculative verification):
// what its two kernels share. A CTA takes one query tile of one sequence at one KV head (heads of the
// group fastest) and one split: it finds its tile (find_query_tile) and its rows' position ranges
// (cta_work), stages the K/V tiles of the pages (stage_tile), runs the online-softmax step per tile
// (softmax_step) and writes its rows (write_rows). The kernels: multi_token_sm80.cuh (mma.sync, every
// GPU) and multi_token_sm90a.cuh (warp-specialized with warpgroup MMAs, Hopper). Which one runs:
// heuristics.h. Design: docs/cuda_prefill_design.md.
#pragma once
#include <algorithm>
#include <climits>

#include "attention_io.cuh"
#include "launch.h"

namespace fp8kv::cuda::multi_token {

// Finds the CTA's query tile among all sequences' tiles (ceil(q_len / tokens_per_tile) each, in
// sequence order) with a block-wide scan of cu_seqlens_q. Returns false past the last tile.
// Called by every thread of the CTA (kCtaThreads of them).
template <int kCtaThreads>
__device__ __forceinline__ bool find_query_tile(const int32_t* cu_seqlens_q, int num_seqs, int tokens_per_tile,
                                                int tile, int& seq, int& tile_in_seq) {
  __shared__ int warp_totals[kCtaThreads / 32];
  __shared__ int found[2];
  if (threadIdx.x == 0) found[0] = -1;
  int base = 0;  // tiles of the sequences before this chunk of sequences
  for (int start = 0; start < num_seqs; start += kCtaThreads) {
    const int i = start + threadIdx.x;
    const int q_len = i < num_seqs ? __ldg(cu_seqlens_q + i + 1) - __ldg(cu_seqlens_q + i) : 0;
    const int tiles = max(0, (q_len + tokens_per_tile - 1) / tokens_per_tile);
    int total;
    const int first = base + block_exclusive_scan<kCtaThreads>(tiles, warp_totals, total);
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
struct LaneQueryRows {
  int64_t query_row[2];  // row of query/out; -1: padding
  int head[2];
  int lo[2], hi[2];      // visible cache positions [lo, hi), within the CTA's split
  float logit_offset[2];  // the rotated recipe's (see soft_capped), set by load_query
};

// Everything a CTA knows about its work.
struct CtaWork {
  int seq, kv_head;
  // At most 16 rows (decode rows, draft tokens) in the sm80 kernel: every warp takes the same rows and
  // a 16-key slice of each tile, and the warps merge at the end, so short queries are not one warp's work.
  bool shared_rows;
  int lo, hi;                    // positions any row of the CTA sees in this split
  int warp_lo, warp_hi;          // positions any row of this warp sees
  int interior_lo, interior_hi;  // positions every row of this warp sees (no mask needed)
};

// The CTA's work: the lane's rows (those of `warp`, the warp's index among the CTA's kCtaRows / 16
// row-owning warps) and the CTA's / warp's position ranges. Returns false when the CTA has nothing to
// do (past the last tile). Called by every thread of the CTA (kCtaThreads of them). kShareShortRows:
// a CTA with at most 16 rows gives them to every warp (CtaWork::shared_rows).
template <int kCtaRows, int kCtaThreads, bool kShareShortRows>
__device__ __forceinline__ bool cta_work(const PagedAttentionParams& p, int split, int split_tokens, int warp,
                                         CtaWork& w, LaneQueryRows& rows) {
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

// Issues the cp.async copies of the K and V rows of tile [tile_start, tile_start + kKeys) into shared
// memory, by threads 0 .. kThreads - 1: 16-byte copy `chunk` of key row `key` lands at
// stage + dst(key, chunk), its V row's at value_dst(that address, key, chunk). Positions outside
// [w.lo, w.hi) and pages outside [0, num_blocks) are zero-filled, never read.
template <DType C, int D, int kKeys, int kThreads, typename Dst, typename ValueDst>
__device__ __forceinline__ void copy_tile_rows(const PagedAttentionParams& p, const CtaWork& w,
                                               const int32_t* table_row, int tile_start, uint8_t* stage, Dst&& dst,
                                               ValueDst&& value_dst) {
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
    copy_async<16>(value_dst(stage + key_dst, key, chunk), value_src, valid);
  }
}

// Stages tile [tile_start, tile_start + kKeys) for a kernel whose MMAs read 16-bit operands with
// 16-byte chunk `chunk` of key row `key` at operand_offset(key, chunk) and V operand_bytes after K:
// 16-bit tiles land there directly; FP8 tiles land raw (row-major, D bytes per row, V rows after
// K's), and the kernel converts them into that layout.
template <DType C, int D, int kKeys, int kThreads, typename OperandOffset>
__device__ __forceinline__ void stage_tile(const PagedAttentionParams& p, const CtaWork& w, const int32_t* table_row,
                                           int tile_start, uint8_t* stage, OperandOffset&& operand_offset,
                                           int operand_bytes) {
  // A V row lands `value_offset` bytes after its K row.
  auto after = [](int value_offset) {
    return [value_offset](uint8_t* key_dst, int /*key*/, int /*chunk*/) { return key_dst + value_offset; };
  };
  if constexpr (CacheTraits<C>::kIsFp8) {
    copy_tile_rows<C, D, kKeys, kThreads>(
        p, w, table_row, tile_start, stage, [](int key, int chunk) { return key * D + chunk * 16; }, after(kKeys * D));
  } else {
    copy_tile_rows<C, D, kKeys, kThreads>(p, w, table_row, tile_start, stage, operand_offset, after(operand_bytes));
  }
}

// One warp's online-softmax state for its 16 rows (lane: rows g, g + 8), its accumulators the O
// fragments [dim n-tile][c0..c3].
template <int D>
using WarpState = OnlineSoftmax<D / 8>;

// A tile's logits for the lane's two rows, in place: S (the mma accumulators of Q K^T for keys
// tile_start .. tile_start + 8 kKeyTiles - 1) times row r's multiplier(r), soft-capped and masked to
// each row's visible keys (unless `interior`). s[j][i]: row g + 8 * (i / 2), key tile_start + 8j +
// 2t + i % 2. The branches are around whole loops: a branch per element keeps the compiler from
// interleaving the elements' arithmetic.
template <int kKeyTiles, typename RowMultiplier>
__device__ __forceinline__ void scale_and_mask(float (&s)[kKeyTiles][4], const LaneQueryRows& rows, int tile_start,
                                               bool interior, RowMultiplier&& multiplier, float soft_cap) {
  const int t = threadIdx.x % 4;
  if (soft_cap > 0.f) {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] = soft_capped(s[j][i] * multiplier(i / 2), soft_cap, rows.logit_offset[i / 2]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[j][i] *= multiplier(i / 2);
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
}

// The online-softmax step on a tile's logits (scale_and_mask): each row's running max moves once the
// tile's exceeds it by more than `slack` (lazy, see OnlineSoftmax; `rescale` gets the factors O must
// take), and the logits become probabilities 2^(logit - max + shift), added to the row's sum.
template <int kKeyTiles, int kTiles>
__device__ __forceinline__ void exponentiate(float (&s)[kKeyTiles][4], OnlineSoftmax<kTiles>& st, float slack,
                                             float shift, float (&rescale)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) tile_max = fmaxf(tile_max, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    rescale[h] = 1.f;
    if (tile_max > st.row_max[h] + slack) st.move_max(h, tile_max, rescale[h]);
    // A row with no visible key so far keeps row_max = -inf: its probabilities are exp2(-inf) = 0.
    const float reference = st.row_max[h] == -INFINITY ? 0.f : st.row_max[h] - shift;
#pragma unroll
    for (int j = 0; j < kKeyTiles; ++j) {
      s[j][2 * h] = fast_exp2(s[j][2 * h] - reference);
      s[j][2 * h + 1] = fast_exp2(s[j][2 * h + 1] - reference);
      st.row_sum[h] += s[j][2 * h] + s[j][2 * h + 1];
    }
  }
}

// One tile's online-softmax step for the lane's two rows in 16-bit math: the logits (scale_and_mask
// with one multiplier), the probabilities (exponentiate, lazy rescale by kRescaleSlack), and P as the
// A fragments of O += P V (keys 16kk .. 16kk + 15). O itself is left to the caller (rescale_output
// with `rescale`), which may still have an MMA writing it.
template <bool kBf16, int D, int kKeyTiles>
__device__ __forceinline__ void softmax_step(float (&s)[kKeyTiles][4], WarpState<D>& st, const LaneQueryRows& rows,
                                             int tile_start, bool interior, float logit_multiplier, float soft_cap,
                                             uint32_t (&p_frag)[kKeyTiles / 2][4], float (&rescale)[2]) {
  scale_and_mask(s, rows, tile_start, interior, [&](int) { return logit_multiplier; }, soft_cap);
  exponentiate(s, st, kRescaleSlack, 0.f, rescale);
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

// A lane's share of rows g and g + 8 as the fragments hold them: dims 16 step + 8 half + 2t + e
// (Q, A of S = Q K^T) and 8n + 2t + e (O) are, in order, value e + 2 i of the lane: the dim's lowest
// bit is in the lane's values, the next two are t (two lane bits), the rest in its values again.
template <int D>
__device__ __forceinline__ void rotate_row_share(float (&x)[D / 4]) {
  constexpr int kBlock = hadamard_block(D);
  hadamard_row<kBlock, 1, 2, 0>(x);
}

// Q fragments (A of S = Q K^T): rows g, g + 8; k-step `step` holds dims 16 step + 2t (+1) and + 8.
// The rotated recipe rotates each row first, in fp32, and sets its rows' logit offsets (see
// logit_offset; -0.f otherwise).
template <DType C, int D>
__device__ __forceinline__ void load_query(const PagedAttentionParams& p, LaneQueryRows& rows, int kv_head, int t,
                                           bool query_bf16, uint32_t (&q_frag)[D / 16][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const QueryRow<CacheTraits<C>::kBf16Math> q(p, rows.query_row[r], rows.head[r], query_bf16);
    rows.logit_offset[r] = -0.f;
    if constexpr (CacheTraits<C>::kIsFp8) {
      if (p.transform.hadamard) {
        float x[D / 4];
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          const float2 pair = pair_as_float2(q.bits(16 * (i / 2) + 8 * (i % 2) + 2 * t), q.bf16);
          x[2 * i] = pair.x, x[2 * i + 1] = pair.y;
        }
        rotate_row_share<D>(x);
#pragma unroll
        for (int i = 0; i < D / 4; ++i) x[i] = mul_rn(x[i], hadamard_norm(hadamard_block(D)));
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          q_frag[i / 2][2 * (i % 2) + r] = q.valid ? pack_pair<CacheTraits<C>::kBf16Math>(x[2 * i], x[2 * i + 1]) : 0u;
        }
        rows.logit_offset[r] = logit_offset(p, kv_head, x, [&](int v) { return 16 * (v / 4) + 8 * (v / 2 % 2) + 2 * t + v % 2; },
                                        {1, 2});
        continue;
      }
    }
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
#pragma unroll
      for (int half = 0; half < 2; ++half) q_frag[step][2 * half + r] = q.pair(16 * step + 8 * half + 2 * t);
    }
  }
}

// Each of a row's four lanes holds a share of its softmax denominator: adds them up.
template <int kTiles>
__device__ __forceinline__ void sum_row_shares(OnlineSoftmax<kTiles>& st) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st.row_sum[h] += __shfl_xor_sync(0xffffffffu, st.row_sum[h], 1);
    st.row_sum[h] += __shfl_xor_sync(0xffffffffu, st.row_sum[h], 2);
  }
}

// The rotated recipe: the lane's rows of O rotated back (unnormalized: output_scale has the norm).
template <int D>
__device__ __forceinline__ void rotate_output(WarpState<D>& st) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float x[D / 4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) x[2 * n] = st.acc[n][2 * h], x[2 * n + 1] = st.acc[n][2 * h + 1];
    rotate_row_share<D>(x);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) st.acc[n][2 * h] = x[2 * n], st.acc[n][2 * h + 1] = x[2 * n + 1];
  }
}

// Writes the lane's rows g and g + 8 (see write_row): dims 8n + 2t, 8n + 2t + 1 of each n-tile.
template <DType C, int D>
__device__ __forceinline__ void write_rows(const PagedAttentionParams& p, const SplitWorkspace& ws, int split,
                                           const CtaWork& w, const LaneQueryRows& rows, int t, bool out_bf16,
                                           WarpState<D>& st) {
  const float v_scale = output_scale<C, D>(p, w.kv_head);
  if constexpr (CacheTraits<C>::kIsFp8) {
    if (p.transform.hadamard) rotate_output<D>(st);
  }
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

// Launches a multi-token kernel on the plan's grid (query tiles, splits, KV heads x head chunks of
// kRows-row CTAs).
template <int kRows>
cudaError_t launch_grid(void (*kernel)(PagedAttentionParams, SplitWorkspace, int), int threads, int smem_bytes,
                        const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                        cudaStream_t stream) {
  const RowMap map = RowMap::make(p.num_heads / p.num_kv_heads, kRows);
  const dim3 grid(static_cast<unsigned>(plan.query_tiles), static_cast<unsigned>(plan.num_splits),
                  static_cast<unsigned>(p.num_kv_heads * map.head_chunks));
  kernel<<<grid, threads, smem_bytes, stream>>>(p, ws, plan.split_tokens);
  return cudaGetLastError();
}

}  // namespace fp8kv::cuda::multi_token
