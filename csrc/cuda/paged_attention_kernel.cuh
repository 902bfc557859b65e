// CUDA paged-attention decode kernel over an FP8 (or 16-bit) cache (one query token per sequence;
// multi-token queries: prefill_attention_kernel.cuh), and the split-KV merge both use.
// Design notes: docs/cuda_decode_design.md. Instantiated per cache format by paged_attention_<format>.cu.
#pragma once
#include <algorithm>
#include <cfloat>
#include <climits>

#include "device_utils.cuh"
#include "paged_attention_config.h"

namespace fp8kv::cuda::attention {


// Multiplier of a raw q.k giving the base-2 logit: softmax scale, k_scale (FP8 caches only; an
// unquantized cache holds the values themselves) and the FP8 decode factor folded into one
// number; log2(e) too unless a soft cap applies it after tanh (see soft_capped).
template <CacheKind C>
__device__ __forceinline__ float logit_multiplier(const PagedAttentionParams& p, int kv_head) {
  float m = p.softmax_scale;
  if constexpr (CacheTraits<C>::kIsFp8) m *= p.k_scale.data[p.k_scale.per_head ? kv_head : 0] * fp8_decode_factor<C>();
  return p.logits_soft_cap > 0.f ? m : m * kLog2e;
}

// A logit scaled by logit_multiplier, soft-capped (cap > 0) and in base 2.
__device__ __forceinline__ float soft_capped(float x, float cap) {
  return cap > 0.f ? cap * tanhf(x * (1.f / cap)) * kLog2e : x;
}

// Factor of the normalized accumulator giving the output: v_scale and the FP8 decode factor.
template <CacheKind C>
__device__ __forceinline__ float output_scale(const PagedAttentionParams& p, int kv_head) {
  if constexpr (CacheTraits<C>::kIsFp8) return p.v_scale.data[p.v_scale.per_head ? kv_head : 0] * fp8_decode_factor<C>();
  return 1.f;
}

// Which bytes of a row each lane owns. With g = lane / 4 and t = lane % 4:
// - K (mma A, rows = tokens g and g + 8): lane t owns D/4 elements, vector i of it at element
//   (i * 4 + t) * kKVec;
// - V (mma A^T, rows = tokens 2t, 2t+1, 2t+8, 2t+9): lane group g owns D/8 elements, vector i at
//   element (i * 8 + g) * kVVec.
template <CacheKind C, int D>
struct Layout {
  static constexpr int kElemBytes = CacheTraits<C>::kElemBytes;
  static constexpr int kKBytes = D / 4 * kElemBytes;
  static constexpr int kKVecBytes = vector_bytes(kKBytes);
  static constexpr int kKVecs = kKBytes / kKVecBytes;
  static constexpr int kKVec = kKVecBytes / kElemBytes;
  static constexpr int kKWords = kKBytes / 4;
  static constexpr int kVBytes = D / 8 * kElemBytes;
  static constexpr int kVVecBytes = vector_bytes(kVBytes);
  static constexpr int kVVecs = kVBytes / kVVecBytes;
  static constexpr int kVVec = kVVecBytes / kElemBytes;
  static constexpr int kVWords = (kVBytes + 3) / 4;
  static constexpr int kSteps = D / 16;  // k-steps of S = K Q^T, and m-tiles of O^T = V^T P^T

  // Head dimension of the lane's l-th K element (lane % 4 = t) / V element (lane / 4 = g).
  static __device__ __forceinline__ int key_dim(int t, int l) { return ((l / kKVec) * 4 + t) * kKVec + l % kKVec; }
  static __device__ __forceinline__ int value_dim(int g, int l) { return ((l / kVVec) * 8 + g) * kVVec + l % kVVec; }
};

// Raw cache words of one 16-token tile, as one lane holds them.
template <CacheKind C, int D>
struct TileRegs {
  uint32_t k[2][Layout<C, D>::kKWords];  // tokens g, g + 8
  uint32_t v[4][Layout<C, D>::kVWords];  // tokens 2t, 2t + 1, 2t + 8, 2t + 9
};

struct RowInfo {
  int64_t query_row;  // row of query/out, or -1 for a padding column
  int head;           // query head
};

// Everything a CTA knows about its work.
struct CtaWork {
  int seq;
  int kv_head;
  int lo, hi;              // cache positions this CTA reads: [lo, hi)
  int block_shift;         // log2(block_size)
  int first_page;          // block-table index of position lo
};

// Per-lane byte offsets for addressing the CTA's tiles, computed once per CTA.
struct LaneCursor {
  const uint8_t* key_head;    // key cache at block 0, token 0, the CTA's KV head
  const uint8_t* value_head;
  // Byte strides fit in 31 bits (checked by the bindings), so addressing is 32-bit multiplies.
  int key_block_bytes, value_block_bytes;
  int key_token_bytes, value_token_bytes;
  int key_lane;       // token g of a half, the lane's first K vector
  int value_lane[2];  // tokens 2t and 2t + 1 of a half, the lane's first V vector
};

template <CacheKind C, int D>
__device__ __forceinline__ LaneCursor make_cursor(const PagedAttentionParams& p, int kv_head, int lane) {
  using L = Layout<C, D>;
  const int g = lane / 4, t = lane % 4;
  LaneCursor c;
  c.key_head = static_cast<const uint8_t*>(p.key_cache.data) +
               static_cast<int64_t>(kv_head) * p.key_cache.head_stride * L::kElemBytes;
  c.value_head = static_cast<const uint8_t*>(p.value_cache.data) +
                 static_cast<int64_t>(kv_head) * p.value_cache.head_stride * L::kElemBytes;
  c.key_block_bytes = static_cast<int>(p.key_cache.block_stride * L::kElemBytes);
  c.value_block_bytes = static_cast<int>(p.value_cache.block_stride * L::kElemBytes);
  c.key_token_bytes = static_cast<int>(p.key_cache.token_stride * L::kElemBytes);
  c.value_token_bytes = static_cast<int>(p.value_cache.token_stride * L::kElemBytes);
  c.key_lane = g * c.key_token_bytes + t * L::kKVecBytes;
  c.value_lane[0] = (2 * t) * c.value_token_bytes + g * L::kVVecBytes;
  c.value_lane[1] = c.value_lane[0] + c.value_token_bytes;
  // Keep the bases in registers: otherwise the compiler re-derives them (64-bit multiplies of
  // kernel parameters) for every tile.
  asm("" : "+l"(c.key_head), "+l"(c.value_head));
  return c;
}

// Where a lane's rows of one tile live; invalid rows (outside [lo, hi) or behind a bad table entry)
// are never read and stay zero.
struct TileRows {
  const uint8_t* key[2];    // tokens g, g + 8
  const uint8_t* value[4];  // tokens 2t, 2t + 1, 2t + 8, 2t + 9
  bool key_valid[2], value_valid[4];
};

// `pages` holds the CTA's slice of its block-table row, starting at w.first_page.
__device__ __forceinline__ TileRows locate_tile(const PagedAttentionParams& p, const CtaWork& w, const LaneCursor& c,
                                                const int32_t* pages, int tile_start, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int block_mask = (1 << w.block_shift) - 1;
  TileRows rows;
  // A tile's two 8-token halves each lie in one page (block_size >= 8, a power of two).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int first = tile_start + 8 * h;
    const bool half_in_range = first + 7 >= w.lo && first < w.hi;
    const int page = half_in_range ? pages[(first >> w.block_shift) - w.first_page] : -1;
    // Entries outside [0, num_blocks) are reported in debug-check mode; here they read as zeros.
    const bool page_valid = page >= 0 && page < p.num_blocks;
    const int in_page = first & block_mask;
    const int safe_page = page_valid ? page : 0;
    const uint8_t* key_half = c.key_head + static_cast<int64_t>(safe_page) * c.key_block_bytes +
                              (in_page * c.key_token_bytes + c.key_lane);
    const uint8_t* value_half = c.value_head + static_cast<int64_t>(safe_page) * c.value_block_bytes +
                                in_page * c.value_token_bytes;
    rows.key[h] = key_half;
    rows.key_valid[h] = page_valid && first + g >= w.lo && first + g < w.hi;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int pos = first + 2 * t + r;
      rows.value[2 * h + r] = value_half + c.value_lane[r];
      rows.value_valid[2 * h + r] = page_valid && pos >= w.lo && pos < w.hi;
    }
  }
  return rows;
}

// Lane-private staging of tiles in shared memory: each lane copies (cp.async) exactly the bytes it
// later reads, so it waits only for its own copies and the loop needs no barrier. Unit u of a lane
// sits at (u * 32 + lane) * unit_bytes: consecutive lanes, consecutive banks.
template <CacheKind C, int D>
struct Staging {
  using L = Layout<C, D>;
  static constexpr bool kAsyncValues = L::kVVecBytes >= 4;  // cp.async moves 4, 8 or 16 bytes
  static constexpr int kKeyBytes = 32 * 2 * L::kKBytes;     // per warp and tile
  static constexpr int kValueBytes = kAsyncValues ? 32 * 4 * L::kVBytes : 0;
  static constexpr int kStageBytes = kKeyBytes + kValueBytes;
  static constexpr int kRingBudget = 96 * 1024;  // per CTA
  static constexpr int kStages = std::max(2, std::min(kMaxStages, kRingBudget / (kWarps * kStageBytes)));
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  static constexpr int kMergeBytes = (kWarps * kRows * (D + 4) + 2 * kWarps * kRows) * 4;
  static constexpr int kPagesOffset = std::max(kRingBytes, kMergeBytes);
  // Typical block-table slice, used for the occupancy estimate; launches size it from the plan.
  static constexpr int kTypicalPagesBytes = 2048;
};



// Row pointers are valid addresses even for invalid rows (those point into block 0), so a
// zero-filling copy can use them as they are.
template <CacheKind C, int D>
__device__ __forceinline__ void stage_tile(uint8_t* stage, const TileRows& rows, int lane) {
  using L = Layout<C, D>;
  using S = Staging<C, D>;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int i = 0; i < L::kKVecs; ++i) {
      copy_async<L::kKVecBytes>(stage + ((r * L::kKVecs + i) * 32 + lane) * L::kKVecBytes,
                                rows.key[r] + i * 4 * L::kKVecBytes, rows.key_valid[r]);
    }
  }
  if constexpr (S::kAsyncValues) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
      for (int i = 0; i < L::kVVecs; ++i) {
        copy_async<L::kVVecBytes>(stage + S::kKeyBytes + ((r * L::kVVecs + i) * 32 + lane) * L::kVVecBytes,
                                  rows.value[r] + i * 8 * L::kVVecBytes, rows.value_valid[r]);
      }
    }
  }
}

template <CacheKind C, int D>
__device__ __forceinline__ void read_tile(TileRegs<C, D>& regs, const uint8_t* stage, const TileRows& rows, int lane) {
  using L = Layout<C, D>;
  using S = Staging<C, D>;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int i = 0; i < L::kKVecs; ++i) {
      load_words<L::kKVecBytes>(stage + ((r * L::kKVecs + i) * 32 + lane) * L::kKVecBytes,
                                regs.k[r] + i * (L::kKVecBytes / 4));
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    if constexpr (S::kAsyncValues) {
#pragma unroll
      for (int i = 0; i < L::kVVecs; ++i) {
        load_words<L::kVVecBytes>(stage + S::kKeyBytes + ((r * L::kVVecs + i) * 32 + lane) * L::kVVecBytes,
                                  regs.v[r] + i * (L::kVVecBytes / 4));
      }
    } else {
      // 2-byte vectors (FP8, head size 80) are below cp.async's granule: read them directly, two per word.
#pragma unroll
      for (int x = 0; x < L::kVWords; ++x) regs.v[r][x] = 0u;
#pragma unroll
      for (int i = 0; i < L::kVVecs; ++i) {
        uint32_t half = 0u;
        if (rows.value_valid[r]) half = __ldg(reinterpret_cast<const unsigned short*>(rows.value[r] + i * 8 * 2));
        regs.v[r][i / 2] |= half << (16 * (i % 2));
      }
    }
  }
}

// Per-lane online-softmax state for the lane's two query columns 2t and 2t + 1.
template <int D>
struct SoftmaxState {
  float acc[D / 16][4];  // O^T fragments: [m-tile][c0..c3]
  float row_max[2];      // running max of log2-domain logits (uniform across lanes with equal t)
  float row_sum[2];      // this lane's share of the softmax denominator
};

template <CacheKind C, int D>
__device__ __forceinline__ void attend_tile(const TileRegs<C, D>& regs, const uint32_t (&q_frag)[D / 16][2],
                                            SoftmaxState<D>& st, int tile_start, bool interior,
                                            const int (&lo)[2], const int (&hi)[2], float logit_multiplier,
                                            float soft_cap, int lane) {
  using L = Layout<C, D>;
  constexpr bool kBf16 = CacheTraits<C>::kBf16Math;
  const int g = lane / 4;

  // S^T (16 tokens x 8 columns) = K (16 x D) . Q^T (D x 8), in two independent accumulation chains
  // (even and odd k-steps) so consecutive tensor-core ops do not wait on each other.
  float s[4] = {0.f, 0.f, 0.f, 0.f}, s_odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int step = 0; step < L::kSteps; ++step) {
    uint32_t a[4];
    if constexpr (CacheTraits<C>::kIsFp8) {
      fp8x4_to_half2x2<C>(regs.k[0][step], a[0], a[2]);
      fp8x4_to_half2x2<C>(regs.k[1][step], a[1], a[3]);
    } else {
      a[0] = regs.k[0][2 * step], a[2] = regs.k[0][2 * step + 1];
      a[1] = regs.k[1][2 * step], a[3] = regs.k[1][2 * step + 1];
    }
    mma_16x8x16<kBf16>(step % 2 == 0 ? s : s_odd, a, q_frag[step][0], q_frag[step][1]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += s_odd[i];

  // Logits in the log2 domain: s[i] is token g + 8 * (i / 2), column 2t + i % 2. Only tiles at the
  // edges of the rows' ranges need the mask (`interior` is uniform across the warp).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s[i] = soft_capped(s[i] * logit_multiplier, soft_cap);
  }
  if (!interior) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int pos = tile_start + g + 8 * (i / 2);
      const int c = i % 2;
      if (!(pos >= lo[c] && pos < hi[c])) s[i] = -INFINITY;
    }
  }
  float tile_max[2] = {fmaxf(s[0], s[2]), fmaxf(s[1], s[3])};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], mask));
    if (tile_max[c] > st.row_max[c] + kRescaleSlack) {
      const float new_max = fmaxf(tile_max[c], st.row_max[c]);
      const float rescale = fast_exp2(st.row_max[c] - new_max);  // 0 when the old max is -inf
      st.row_sum[c] *= rescale;
#pragma unroll
      for (int j = 0; j < D / 16; ++j) st.acc[j][c] *= rescale, st.acc[j][c + 2] *= rescale;
      st.row_max[c] = new_max;
    }
  }
  float prob[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = i % 2;
    // A column with no visible key so far keeps row_max = -inf: its probabilities are exp2(-inf) = 0.
    const float reference = st.row_max[c] == -INFINITY ? 0.f : st.row_max[c];
    prob[i] = fast_exp2(s[i] - reference);
    st.row_sum[c] += prob[i];
  }
  // P^T fragments (16 tokens x 8 columns) from S^T's accumulator layout.
  const uint32_t p0 = transpose_8x8(pack_pair<kBf16>(prob[0], prob[1]));
  const uint32_t p1 = transpose_8x8(pack_pair<kBf16>(prob[2], prob[3]));

  // O^T (D x 8) += V^T (D x 16 tokens) . P^T.
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    uint32_t a[4];
    if constexpr (CacheTraits<C>::kIsFp8) {
      // Word j/2 of each V row holds elements 2j, 2j+1 (m-tile j) and 2j+2, 2j+3 (m-tile j+1).
      const int word = j / 2;
      const uint32_t sel = (j % 2 == 0) ? 0x5140u : 0x7362u;
      const uint32_t top = byte_perm(regs.v[0][word], regs.v[1][word], sel);     // tokens 2t, 2t+1
      const uint32_t bottom = byte_perm(regs.v[2][word], regs.v[3][word], sel);  // tokens 2t+8, 2t+9
      fp8x4_to_half2x2<C>(top, a[0], a[1]);
      fp8x4_to_half2x2<C>(bottom, a[2], a[3]);
    } else {
      a[0] = byte_perm(regs.v[0][j], regs.v[1][j], 0x5410u);
      a[1] = byte_perm(regs.v[0][j], regs.v[1][j], 0x7632u);
      a[2] = byte_perm(regs.v[2][j], regs.v[3][j], 0x5410u);
      a[3] = byte_perm(regs.v[2][j], regs.v[3][j], 0x7632u);
    }
    mma_16x8x16<kBf16>(st.acc[j], a, p0, p1);
  }
}

// Finds the CTA's sequence, rows (query heads of one chunk of the group) and cache range.
// Every row of the CTA sees the same positions, [w.lo, w.hi).
__device__ __forceinline__ void plan_cta(const PagedAttentionParams& p, int chunk_index, int split, int split_tokens,
                                         CtaWork& w, RowInfo (&rows)[kRows]) {
  const int group = p.num_heads / p.num_kv_heads;
  const int head_chunks = (group + kRows - 1) / kRows;
  const int seq = chunk_index / head_chunks;
  const int head_chunk = chunk_index % head_chunks;
  const int heads_in_chunk = min(kRows, group - head_chunk * kRows);
  // Clamped to the table's capacity so that unchecked (non-debug) input never reads past it.
  const int seq_len = min(__ldg(p.seq_lens + seq), p.max_blocks_per_seq * p.block_size);
  const int lo_all = p.sliding_window > 0 ? max(0, seq_len - p.sliding_window) : 0;
#pragma unroll
  for (int n = 0; n < kRows; ++n) {
    const bool valid = n < heads_in_chunk;
    rows[n].query_row = valid ? seq : -1;
    rows[n].head = valid ? w.kv_head * group + head_chunk * kRows + n : 0;
  }
  w.seq = seq;
  w.block_shift = __ffs(p.block_size) - 1;
  w.lo = max(lo_all, split * split_tokens);
  w.hi = min(seq_len, (split + 1) * split_tokens);
  w.first_page = w.lo >> w.block_shift;
}

template <CacheKind C, int D>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm) paged_attention_kernel(const PagedAttentionParams p, SplitWorkspace ws,
                                                                   int split_tokens) {
  using L = Layout<C, D>;
  constexpr bool kBf16 = CacheTraits<C>::kBf16Math;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int split = blockIdx.y;

  CtaWork w;
  w.kv_head = blockIdx.z;
  RowInfo rows[kRows];
  plan_cta(p, blockIdx.x, split, split_tokens, w, rows);
  const bool query_bf16 = p.query_dtype == DType::kBFloat16;

  // Q^T fragments for S = K Q^T: column g of B is query row g; its k-step `step` holds the lane's
  // K elements 4*step .. 4*step+3 (see Layout::key_dim).
  uint32_t q_frag[D / 16][2];
  {
    const RowInfo row = rows[g];
    const auto* q = static_cast<const uint8_t*>(p.query) +
                    (row.query_row * p.query_token_stride + static_cast<int64_t>(row.head) * p.query_head_stride) * 2;
#pragma unroll
    for (int step = 0; step < D / 16; ++step) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        uint32_t packed = 0u;
        if (row.query_row >= 0) {
          const int dim = L::key_dim(t, 4 * step + 2 * half);  // dims dim, dim+1 are adjacent
          const float2 x = load_pair_as_float2(q + dim * 2, query_bf16);
          packed = pack_pair<kBf16>(x.x, x.y);
        }
        q_frag[step][half] = packed;
      }
    }
  }

  const int seq = w.seq;
  const float multiplier = logit_multiplier<C>(p, w.kv_head);
  const float soft_cap = p.logits_soft_cap;

  int lo[2], hi[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const bool valid = rows[2 * t + c].query_row >= 0;  // padding columns see nothing
    lo[c] = valid ? w.lo : 0;
    hi[c] = valid ? w.hi : 0;
  }

  SoftmaxState<D> st;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) st.acc[j][0] = st.acc[j][1] = st.acc[j][2] = st.acc[j][3] = 0.f;
  st.row_max[0] = st.row_max[1] = -INFINITY;
  st.row_sum[0] = st.row_sum[1] = 0.f;

  using Stg = Staging<C, D>;
  extern __shared__ __align__(16) uint8_t smem[];
  // The CTA's slice of its block-table row, read once: the loop then finds pages in shared memory.
  int32_t* pages = reinterpret_cast<int32_t*>(smem + Stg::kPagesOffset);
  if (w.hi > w.lo) {
    const int32_t* table_row = p.block_tables + seq * p.block_table_stride;
    const int num_pages = ((w.hi - 1) >> w.block_shift) - w.first_page + 1;
    for (int i = threadIdx.x; i < num_pages; i += kThreads) pages[i] = __ldg(table_row + w.first_page + i);
  }
  __syncthreads();
  const LaneCursor cursor = make_cursor<C, D>(p, w.kv_head, lane);

  const int first_tile = (w.lo / kTileTokens) * kTileTokens;
  const int num_tiles = w.hi > w.lo ? (w.hi - first_tile + kTileTokens - 1) / kTileTokens : 0;
  // Warp `warp` takes tiles warp, warp + kWarps, ...; its k-th tile starts at tile_start(k).
  const int my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
  auto tile_start = [&](int k) { return first_tile + (warp + k * kWarps) * kTileTokens; };

  uint8_t* ring = smem + warp * Stg::kStages * Stg::kStageBytes;
  // Keep kStages - 1 tiles in flight; every iteration commits one (possibly empty) copy group, so
  // waiting for all but the newest kStages - 1 groups means tile k has landed.
#pragma unroll
  for (int k = 0; k < Stg::kStages - 1; ++k) {
    if (k < my_tiles) {
      stage_tile<C, D>(ring + k * Stg::kStageBytes, locate_tile(p, w, cursor, pages, tile_start(k), lane), lane);
    }
    copy_async_commit();
  }
  TileRegs<C, D> regs;
  for (int k = 0; k < my_tiles; ++k) {
    const int ahead = k + Stg::kStages - 1;
    if (ahead < my_tiles) {
      stage_tile<C, D>(ring + (ahead % Stg::kStages) * Stg::kStageBytes,
                       locate_tile(p, w, cursor, pages, tile_start(ahead), lane), lane);
    }
    copy_async_commit();
    copy_async_wait<Stg::kStages - 1>();
    TileRows rows{};
    if constexpr (!Stg::kAsyncValues) rows = locate_tile(p, w, cursor, pages, tile_start(k), lane);
    read_tile<C, D>(regs, ring + (k % Stg::kStages) * Stg::kStageBytes, rows, lane);
    const bool interior = tile_start(k) >= w.lo && tile_start(k) + kTileTokens <= w.hi;
    attend_tile<C, D>(regs, q_frag, st, tile_start(k), interior, lo, hi, multiplier, soft_cap, lane);
  }
  copy_async_wait<0>();
  __syncthreads();  // the ring is reused below for the warp merge

  // Each lane holds a share of the denominators: sum over lanes with equal t.
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) st.row_sum[c] += __shfl_xor_sync(0xffffffffu, st.row_sum[c], mask);
  }

  // Merge the warps through shared memory: acc[warp][column][dim], max and sum per (warp, column).
  auto smem_acc = reinterpret_cast<float (*)[kRows][D + 4]>(smem);
  auto smem_max = reinterpret_cast<float (*)[kRows]>(smem + kWarps * kRows * (D + 4) * sizeof(float));
  auto smem_sum = smem_max + kWarps;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int d0 = L::value_dim(g, 2 * j), d1 = L::value_dim(g, 2 * j + 1);
    smem_acc[warp][2 * t][d0] = st.acc[j][0];
    smem_acc[warp][2 * t + 1][d0] = st.acc[j][1];
    smem_acc[warp][2 * t][d1] = st.acc[j][2];
    smem_acc[warp][2 * t + 1][d1] = st.acc[j][3];
  }
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) smem_max[warp][2 * t + c] = st.row_max[c], smem_sum[warp][2 * t + c] = st.row_sum[c];
  }
  __syncthreads();

  const float v_scale = output_scale<C>(p, w.kv_head);
  const bool out_bf16 = query_bf16;
  // 128 threads cover kRows columns x D dims, two adjacent dims per thread per pass.
  for (int item = threadIdx.x; item < kRows * D / 2; item += kThreads) {
    const int n = item / (D / 2);
    const int d = 2 * (item % (D / 2));
    const RowInfo row = rows[n];
    if (row.query_row < 0) continue;
    float max_all = -INFINITY;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) max_all = fmaxf(max_all, smem_max[x][n]);
    float sum = 0.f, o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int x = 0; x < kWarps; ++x) {
      // A warp that saw no key has sum 0 and must not contribute (its acc is 0, but stay exact).
      if (smem_sum[x][n] == 0.f) continue;
      const float weight = fast_exp2(smem_max[x][n] - max_all);
      sum += weight * smem_sum[x][n];
      o0 += weight * smem_acc[x][n][d];
      o1 += weight * smem_acc[x][n][d + 1];
    }
    const int64_t out_index = row.query_row * static_cast<int64_t>(p.num_heads) + row.head;
    if (ws.num_splits == 1) {
      const float norm = sum > 0.f ? v_scale / sum : 0.f;  // no visible key: zeros
      auto* out = static_cast<uint8_t*>(p.out) + (row.query_row * p.out_token_stride + static_cast<int64_t>(row.head) * p.out_head_stride + d) * 2;
      store_pair_from_float2(out, o0 * norm, o1 * norm, out_bf16);
    } else {
      // Partials carry the value scale: the merge is then a plain log-sum-exp over splits.
      const int64_t slot = static_cast<int64_t>(split) * ws.rows + out_index;
      ws.acc[slot * D + d] = o0 * v_scale;
      ws.acc[slot * D + d + 1] = o1 * v_scale;
      if (d == 0) ws.row_max[slot] = max_all, ws.row_sum[slot] = sum;
    }
  }
}

// Merges the splits of each (query row, head) with log-sum-exp weights in fp32. One CTA per row:
// thread s weighs split s (num_splits <= kMaxSplits), then each thread sums two dims over splits.

template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_splits_kernel(const PagedAttentionParams p, SplitWorkspace ws) {
  __shared__ float weights[kMaxSplits];
  __shared__ float partial[2][kMergeThreads / 32];
  const int64_t row = blockIdx.x;  // query_row * num_heads + head
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int s = threadIdx.x;
  const bool has_split = s < ws.num_splits && ws.row_sum[s * ws.rows + row] > 0.f;  // 0: no keys
  const float split_max = has_split ? ws.row_max[s * ws.rows + row] : -INFINITY;
  float max_all = split_max;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) max_all = fmaxf(max_all, __shfl_xor_sync(0xffffffffu, max_all, mask));
  if (lane == 0) partial[0][warp] = max_all;
  __syncthreads();
  max_all = partial[0][0];
#pragma unroll
  for (int x = 1; x < kMergeThreads / 32; ++x) max_all = fmaxf(max_all, partial[0][x]);
  const float weight = has_split ? fast_exp2(split_max - max_all) : 0.f;
  float sum = has_split ? weight * ws.row_sum[s * ws.rows + row] : 0.f;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  if (lane == 0) partial[1][warp] = sum;
  if (s < ws.num_splits) weights[s] = weight;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int x = 0; x < kMergeThreads / 32; ++x) sum += partial[1][x];
  const float norm = sum > 0.f ? 1.f / sum : 0.f;

  const int64_t query_row = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  for (int d = 2 * threadIdx.x; d < D; d += 2 * kMergeThreads) {
    float o0 = 0.f, o1 = 0.f;
#pragma unroll 4
    for (int x = 0; x < ws.num_splits; ++x) {
      if (weights[x] == 0.f) continue;  // an empty split's acc is not read
      const float2 a = *reinterpret_cast<const float2*>(ws.acc + (x * ws.rows + row) * D + d);
      o0 += weights[x] * a.x;
      o1 += weights[x] * a.y;
    }
    auto* out = static_cast<uint8_t*>(p.out) +
                (query_row * p.out_token_stride + static_cast<int64_t>(head) * p.out_head_stride + d) * 2;
    store_pair_from_float2(out, o0 * norm, o1 * norm, p.query_dtype == DType::kBFloat16);
  }
}

template <CacheKind C, int D>
cudaError_t launch_head(const PagedAttentionParams& p, const AttentionPlan& plan, SplitWorkspace ws,
                        cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(plan.row_chunks), static_cast<unsigned>(plan.num_splits),
                  static_cast<unsigned>(p.num_kv_heads));
  const int smem_bytes = Staging<C, D>::kPagesOffset + pages_bytes(plan, p.block_size);
  paged_attention_kernel<C, D><<<grid, kThreads, smem_bytes, stream>>>(p, ws, plan.split_tokens);
  if (plan.num_splits > 1) {
    merge_splits_kernel<D><<<static_cast<unsigned>(ws.rows), kMergeThreads, 0, stream>>>(p, ws);
  }
  return cudaGetLastError();
}

template <CacheKind C, int D>
int prepare_head() {
  static const int resident = [] {
    auto* kernel = paged_attention_kernel<C, D>;
    using Stg = Staging<C, D>;
    int ctas = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             Stg::kPagesOffset + kMaxPages * 4) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kThreads,
                                                      Stg::kPagesOffset + Stg::kTypicalPagesBytes) != cudaSuccess) {
      return 0;
    }
    return ctas;
  }();
  return resident;
}

// Calls fn(head-size constant) for a supported head size.
template <typename Fn>
auto with_head_size(int head_size, Fn&& fn) {
  switch (head_size) {
    case 64: return fn(std::integral_constant<int, 64>{});
    case 80: return fn(std::integral_constant<int, 80>{});
    case 96: return fn(std::integral_constant<int, 96>{});
    case 128: return fn(std::integral_constant<int, 128>{});
    case 192: return fn(std::integral_constant<int, 192>{});
    default: return fn(std::integral_constant<int, 256>{});  // the bindings admit no other size
  }
}

template <CacheKind C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, SplitWorkspace ws, cudaStream_t stream) {
  return with_head_size(p.head_size, [&](auto head) { return launch_head<C, decltype(head)::value>(p, plan, ws, stream); });
}

template <CacheKind C>
int prepare(int head_size) {
  return with_head_size(head_size, [](auto head) { return prepare_head<C, decltype(head)::value>(); });
}

#define FP8KV_INSTANTIATE_ATTENTION(KIND)                                                                      \
  template cudaError_t launch<KIND>(const PagedAttentionParams&, const AttentionPlan&, SplitWorkspace, cudaStream_t); \
  template int prepare<KIND>(int);

}  // namespace fp8kv::cuda::attention
