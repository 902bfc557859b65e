// CUDA paged-attention decode kernel over an FP8 (or 16-bit) cache: one query token per sequence
// (multi-token queries: multi_token.cuh). Design notes: docs/cuda_decode_design.md. Instantiated per cache
// format by paged_attention_<format>.cu.
#pragma once
#include <algorithm>
#include <cfloat>
#include <climits>
#include <type_traits>

#include "attention_io.cuh"
#include "launch.h"

namespace fp8kv::cuda::decode {

// Which bytes of a row each lane owns. With g = lane / 4 and t = lane % 4:
// - K (mma A, rows = tokens g and g + 8): lane t owns D/4 elements, vector i of it at element
//   (i * 4 + t) * kKVec;
// - V (mma A^T, rows = tokens 2t, 2t+1, 2t+8, 2t+9): lane group g owns D/8 elements, vector i at
//   element (i * 8 + g) * kVVec.
template <DType C, int D>
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
template <DType C, int D>
struct TileRegs {
  uint32_t k[2][Layout<C, D>::kKWords];  // tokens g, g + 8
  uint32_t v[4][Layout<C, D>::kVWords];  // tokens 2t, 2t + 1, 2t + 8, 2t + 9
};

struct RowInfo {
  int64_t query_row;  // row of query/out, or -1 for a padding column
  int head;           // query head
};

// A work item's query rows, its columns: rows first .. first + count - 1 of its sequence's q_len x group
// rows at its KV head (query token j, head h of the group at row j * group + h); columns n >= count
// are padding. kQueries: multi-token queries; else decode (q_len = 1, every row is token 0).
template <bool kQueriesValue>
struct RowSet {
  static constexpr bool kQueries = kQueriesValue;
  int first_token;  // the sequence's first query row
  int head0;  // the KV head's first query head (decode: the item's first)
  int count;
  int group;
  int first;

  __device__ __forceinline__ int token(int n) const { return kQueries ? (first + n) / group : 0; }  // within the sequence
  __device__ __forceinline__ RowInfo operator[](int n) const {
    if constexpr (kQueries) {
      return n < count ? RowInfo{first_token + token(n), head0 + (first + n) % group} : RowInfo{-1, 0};
    } else {
      return n < count ? RowInfo{first_token, head0 + n} : RowInfo{-1, 0};
    }
  }
};

// A work item's place: its sequence, its row chunk of that sequence, split and KV head.
struct ItemIndex {
  int seq;
  int chunk;
  int split;
  int kv_head;
};

// Everything a CTA knows about its current item.
struct CtaWork {
  int seq;
  int kv_head;
  int seq_len;             // clamped to the table's capacity
  int q_len;               // the sequence's query tokens (1 for decode)
  int lo, hi;              // cache positions this CTA reads: [lo, hi), what any of its rows sees
  int interior_lo, interior_hi;  // positions every row sees (tiles inside need no mask)
  int block_shift;         // log2(block_size)
  int first_page;          // block-table index of the split's first position (start of the staged slice)
};

// Shared-memory wavefronts of one warp-wide load where lane l reads `width` bytes at byte
// address(l): 4-byte banks; 16-byte loads go in four phases of 8 lanes, 8-byte loads in two of 16.
template <typename Address>
constexpr int load_wavefronts(Address address, int width) {
  const int lanes_per_phase = width == 16 ? 8 : width == 8 ? 16 : 32;
  int total = 0;
  for (int first = 0; first < 32; first += lanes_per_phase) {
    int worst = 1;
    for (int bank = 0; bank < 32; ++bank) {
      int words[32] = {}, distinct = 0;  // words of this bank the phase touches
      for (int lane = first; lane < first + lanes_per_phase; ++lane) {
        for (int byte = 0; byte < width; byte += 4) {
          const int word = (address(lane) + byte) / 4;
          bool seen = word % 32 != bank;
          for (int i = 0; i < distinct; ++i) seen = seen || words[i] == word;
          if (!seen) words[distinct++] = word;
        }
      }
      worst = distinct > worst ? distinct : worst;
    }
    total += worst;
  }
  return total;
}

// Wavefronts of read_tile's fragment loads of `vec` bytes at a row pitch: lane (g, t) =
// (lane / 4, lane % 4) reads K row g at byte t * vec, or V row 2t at byte g * vec (other rows and
// vectors are constant shifts of these). One warp-wide load of `vec` bytes needs max(1, vec / 4).
constexpr int fragment_wavefronts(int pitch, int vec, bool is_key) {
  return load_wavefronts(
      [=](int lane) { return is_key ? (lane / 4) * pitch + (lane % 4) * vec : 2 * (lane % 4) * pitch + (lane / 4) * vec; },
      vec);
}

// Smallest row pitch (row_bytes padded by 0-112 bytes) with the fewest wavefronts.
constexpr int conflict_free_pitch(int row_bytes, int vec, bool is_key) {
  int best = row_bytes, best_wavefronts = 1 << 30;
  for (int pad = 0; pad < 128; pad += 16) {
    const int wavefronts = fragment_wavefronts(row_bytes + pad, vec, is_key);
    if (wavefronts < best_wavefronts) best = row_bytes + pad, best_wavefronts = wavefronts;
  }
  return best;
}

// What a CTA's threads share about its items besides the ring: the next item (from the queue), each
// buffer's sequence length, and the warps' softmax max and sum for the merge.
struct ItemShared {
  int next_item;
  int seq_len[2];
  int pad;  // the arrays start 16 bytes in, on a 16-byte boundary
  float row_max[kWarps][kRows];
  float row_sum[kWarps][kRows];
};

// Per-warp staging of 16-token tiles in shared memory: K rows then V rows, each row as in the cache,
// at pitches padded so that the fragment loads of read_tile are free of bank conflicts.
template <DType C, int D>
struct Staging {
  using L = Layout<C, D>;
  static constexpr int kRowBytes = D * L::kElemBytes;  // a multiple of 16 for every head size
  static constexpr int kKeyPitch = conflict_free_pitch(kRowBytes, L::kKVecBytes, true);
  static constexpr int kValuePitch = conflict_free_pitch(kRowBytes, L::kVVecBytes, false);
  static_assert(fragment_wavefronts(kKeyPitch, L::kKVecBytes, true) == std::max(1, L::kKVecBytes / 4) &&
                    fragment_wavefronts(kValuePitch, L::kVVecBytes, false) == std::max(1, L::kVVecBytes / 4),
                "fragment loads with bank conflicts");
  static constexpr int kValueOffset = kTileTokens * kKeyPitch;
  static constexpr int kStageBytes = kValueOffset + kTileTokens * kValuePitch;
  static constexpr int kRingBudget = 96 * 1024;  // per CTA
  static constexpr int kStages = std::max(2, std::min(kMaxStages, kRingBudget / (kWarps * kStageBytes)));
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes;
  // The warp merge of an item's result uses each warp's last ring stage, free at that point (the
  // next item's first tiles are in flight in the others): kRows x D floats, padded where they fit.
  static constexpr int kMergePitch = kStageBytes >= kRows * (D + 4) * 4 ? D + 4 : D;
  static_assert(kStageBytes >= kRows * D * 4, "a warp's merge scratch must fit one stage");
  static constexpr int kSharedOffset = kRingBytes;  // ItemShared
  static constexpr int kPagesOffset = kSharedOffset + (sizeof(ItemShared) + 15) / 16 * 16;  // two table slices
};

// The cache rows a lane stages (K for lanes 0-15, V for 16-31) at the CTA's KV head. Byte strides
// fit in 31 bits (checked by the bindings), so in-block addressing is 32-bit.
struct RowSource {
  const uint8_t* head;  // block 0, token 0 of the KV head
  int block_bytes;
  int token_bytes;
};

template <DType C>
__device__ __forceinline__ RowSource make_row_source(const PagedAttentionParams& p, int kv_head, int lane) {
  constexpr int kElemBytes = CacheTraits<C>::kElemBytes;
  const CacheView& cache = lane < 16 ? p.key_cache : p.value_cache;
  RowSource s;
  s.head = static_cast<const uint8_t*>(cache.data) + static_cast<int64_t>(kv_head) * cache.head_stride * kElemBytes;
  s.block_bytes = static_cast<int>(cache.block_stride * kElemBytes);
  s.token_bytes = static_cast<int>(cache.token_stride * kElemBytes);
  // Keep the base in a register: otherwise the compiler re-derives it from kernel parameters per tile.
  asm("" : "+l"(s.head));
  return s;
}

// Stages a 16-token tile: lane l locates row l % 16 of K (l < 16) or V (l >= 16); then consecutive
// lanes copy consecutive 16-byte pieces of the rows (cp.async, the row's source shuffled from the
// lane that located it), so every copy instruction reads whole rows of the cache. Rows outside
// [w.lo, w.hi) or behind a block-table entry outside [0, num_blocks) are not read but zero-filled,
// so masked keys and values stay finite (a stale FP8 NaN code would survive a zero probability).
// `pages` holds the CTA's slice of its block-table row, starting at w.first_page.
template <DType C, int D>
__device__ __forceinline__ void stage_tile(uint8_t* stage, const RowSource& src, const int32_t* pages,
                                           const CtaWork& w, int num_blocks, int tile_start, int lane) {
  using S = Staging<C, D>;
  const int pos = tile_start + lane % 16;
  const bool in_range = pos >= w.lo && pos < w.hi;
  const int page = in_range ? pages[(pos >> w.block_shift) - w.first_page] : -1;
  const bool valid = page >= 0 && page < num_blocks;  // other entries: reported in debug-check mode
  const uint8_t* from = src.head + static_cast<int64_t>(valid ? page : 0) * src.block_bytes +
                        (pos & ((1 << w.block_shift) - 1)) * src.token_bytes;
  constexpr int kPieces = S::kRowBytes / 16;
#pragma unroll
  for (int j = 0; j < kPieces; ++j) {
    const int piece = j * 32 + lane;
    const int row = piece / kPieces, offset = (piece % kPieces) * 16;
    const auto* row_from =
        reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(from), row));
    const bool row_valid = __shfl_sync(0xffffffffu, valid, row);
    uint8_t* row_to = stage + (row < 16 ? row * S::kKeyPitch : S::kValueOffset + (row - 16) * S::kValuePitch);
    copy_async<16>(row_to + offset, row_from + offset, row_valid);
  }
}

// Loads the lane's fragment bytes of a staged tile (see Layout for which bytes a lane owns).
template <DType C, int D>
__device__ __forceinline__ void read_tile(TileRegs<C, D>& regs, const uint8_t* stage, int lane) {
  using L = Layout<C, D>;
  using S = Staging<C, D>;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < L::kKVecs; ++i) {
      load_words<L::kKVecBytes>(stage + (g + 8 * h) * S::kKeyPitch + (i * 4 + t) * L::kKVecBytes,
                                regs.k[h] + i * (L::kKVecBytes / 4));
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint8_t* row = stage + S::kValueOffset + (2 * t + r % 2 + 8 * (r / 2)) * S::kValuePitch;
    if constexpr (L::kVVecBytes >= 4) {
#pragma unroll
      for (int i = 0; i < L::kVVecs; ++i) {
        load_words<L::kVVecBytes>(row + (i * 8 + g) * L::kVVecBytes, regs.v[r] + i * (L::kVVecBytes / 4));
      }
    } else {
      // 2-byte vectors (FP8, head size 80): two per word.
#pragma unroll
      for (int x = 0; x < L::kVWords; ++x) regs.v[r][x] = 0u;
#pragma unroll
      for (int i = 0; i < L::kVVecs; ++i) {
        uint32_t half;
        load_words<2>(row + (i * 8 + g) * 2, &half);
        regs.v[r][i / 2] |= half << (16 * (i % 2));
      }
    }
  }
}

// The lane's online-softmax state is for its two query columns 2t and 2t + 1 of a column tile, its
// accumulators the O^T fragments [m-tile][c0..c3].
template <int D>
using SoftmaxState = OnlineSoftmax<D / 16>;

// How the lane's logits are formed and masked: the logit multiplier, soft cap and, per column tile,
// the logit offsets (see soft_capped) and visible positions of its two columns 2t, 2t + 1 (padding
// columns see nothing).
template <int NT>
struct LogitRule {
  float multiplier;
  float soft_cap;
  float offset[NT][2];
  int lo[NT][2], hi[NT][2];
};

// One 16-token tile for the item's NT column tiles: the K and V fragments are converted once and
// serve every column tile.
template <DType C, int D, int NT>
__device__ __forceinline__ void attend_tile(const TileRegs<C, D>& regs, const uint32_t (&q_frag)[NT][D / 16][2],
                                            SoftmaxState<D> (&st)[NT], int tile_start, bool interior,
                                            const LogitRule<NT>& rule, int lane) {
  using L = Layout<C, D>;
  constexpr bool kBf16 = CacheTraits<C>::kBf16Math;
  const int g = lane / 4;

  // S^T (16 tokens x 8 columns) = K (16 x D) . Q^T (D x 8) per column tile, in two independent
  // accumulation chains (even and odd k-steps) so consecutive tensor-core ops do not wait on each other.
  float s[NT][4], s_odd[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = 0.f, s_odd[nt][i] = 0.f;
  }
#pragma unroll
  for (int step = 0; step < L::kSteps; ++step) {
    uint32_t a[4];
    if constexpr (CacheTraits<C>::kIsFp8) {
      convert_fp8x4<C>(regs.k[0][step], a[0], a[2]);
      convert_fp8x4<C>(regs.k[1][step], a[1], a[3]);
    } else {
      a[0] = regs.k[0][2 * step], a[2] = regs.k[0][2 * step + 1];
      a[1] = regs.k[1][2 * step], a[3] = regs.k[1][2 * step + 1];
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      mma_16x8x16<kBf16>(step % 2 == 0 ? s[nt] : s_odd[nt], a, q_frag[nt][step][0], q_frag[nt][step][1]);
    }
  }

  uint32_t p_frag[NT][2];  // P^T fragments (16 tokens x 8 columns) per column tile
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] += s_odd[nt][i];
    // Logits in the log2 domain: s[i] is token g + 8 * (i / 2), column 2t + i % 2. Only tiles at the
    // edges of the rows' ranges need the mask (`interior` is uniform across the warp).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      s[nt][i] = soft_capped(s[nt][i] * rule.multiplier, rule.soft_cap, rule.offset[nt][i % 2]);
    }
    if (!interior) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pos = tile_start + g + 8 * (i / 2);
        const int c = i % 2;
        if (!(pos >= rule.lo[nt][c] && pos < rule.hi[nt][c])) s[nt][i] = -INFINITY;
      }
    }
    float tile_max[2] = {fmaxf(s[nt][0], s[nt][2]), fmaxf(s[nt][1], s[nt][3])};
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int mask = 4; mask < 32; mask <<= 1) {
        tile_max[c] = fmaxf(tile_max[c], __shfl_xor_sync(0xffffffffu, tile_max[c], mask));
      }
      if (tile_max[c] > st[nt].rescale_threshold(c)) {
        float rescale;
        st[nt].move_max(c, fmaxf(tile_max[c], st[nt].row_max[c]), rescale);
#pragma unroll
        for (int j = 0; j < D / 16; ++j) st[nt].acc[j][c] *= rescale, st[nt].acc[j][c + 2] *= rescale;
      }
    }
    float prob[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = i % 2;
      // A column with no visible key so far keeps row_max = -inf: its probabilities are exp2(-inf) = 0.
      const float reference = st[nt].row_max[c] == -INFINITY ? 0.f : st[nt].row_max[c];
      prob[i] = fast_exp2(s[nt][i] - reference);
      st[nt].row_sum[c] += prob[i];
    }
    // P^T fragments from S^T's accumulator layout.
    p_frag[nt][0] = transpose_8x8(pack_pair<kBf16>(prob[0], prob[1]));
    p_frag[nt][1] = transpose_8x8(pack_pair<kBf16>(prob[2], prob[3]));
  }

  // O^T (D x 8) += V^T (D x 16 tokens) . P^T per column tile.
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    uint32_t a[4];
    if constexpr (CacheTraits<C>::kIsFp8) {
      // Word j/2 of each V row holds elements 2j, 2j+1 (m-tile j) and 2j+2, 2j+3 (m-tile j+1).
      const int word = j / 2;
      const uint32_t sel = (j % 2 == 0) ? 0x5140u : 0x7362u;
      const uint32_t top = byte_perm(regs.v[0][word], regs.v[1][word], sel);     // tokens 2t, 2t+1
      const uint32_t bottom = byte_perm(regs.v[2][word], regs.v[3][word], sel);  // tokens 2t+8, 2t+9
      convert_fp8x4<C>(top, a[0], a[1]);
      convert_fp8x4<C>(bottom, a[2], a[3]);
    } else {
      a[0] = byte_perm(regs.v[0][j], regs.v[1][j], 0x5410u);
      a[1] = byte_perm(regs.v[0][j], regs.v[1][j], 0x7632u);
      a[2] = byte_perm(regs.v[2][j], regs.v[3][j], 0x5410u);
      a[3] = byte_perm(regs.v[2][j], regs.v[3][j], 0x7632u);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma_16x8x16<kBf16>(st[nt].acc[j], a, p_frag[nt][0], p_frag[nt][1]);
  }
}

// Multi-token queries: the sequences' query starts (cu_seqlens_q, clamped into [0, num_query_tokens])
// and first row chunks, staged in shared memory by every CTA (stage_sequence_table); entry num_seqs
// holds the totals.
struct SequenceTable {
  int* q_start;      // [num_seqs + 1]
  int* chunk_start;  // [num_seqs + 1]
};

// Fills the table with a block-wide scan of the sequences' row-chunk counts (ceil(q_len * group /
// columns) each) and returns the number of row chunks. Called by every thread of the CTA.
__device__ __forceinline__ int stage_sequence_table(const PagedAttentionParams& p, int columns, SequenceTable table) {
  __shared__ int warp_totals[kWarps];
  const int group = p.num_heads / p.num_kv_heads;
  const int num_tokens = static_cast<int>(p.num_query_tokens);  // the planner takes int-sized calls only
  int base = 0;  // chunks of the sequences before this block of them
  for (int start = 0; start < p.num_seqs; start += kThreads) {
    const int i = start + threadIdx.x;
    int q_start = 0, chunks = 0;
    if (i < p.num_seqs) {
      q_start = min(max(__ldg(p.cu_seqlens_q + i), 0), num_tokens);
      const int q_end = min(max(__ldg(p.cu_seqlens_q + i + 1), q_start), num_tokens);
      chunks = ((q_end - q_start) * group + columns - 1) / columns;
      table.q_start[i] = q_start;
      if (i == p.num_seqs - 1) table.q_start[p.num_seqs] = q_end;
    }
    int total;
    const int first = base + block_exclusive_scan<kThreads>(chunks, warp_totals, total);
    if (i < p.num_seqs) table.chunk_start[i] = first;
    base += total;
    __syncthreads();  // warp_totals is rewritten by the next block of sequences
  }
  if (threadIdx.x == 0) table.chunk_start[p.num_seqs] = base;
  __syncthreads();
  return base;
}

// Work item `item` of the queue (tiles.h: the KV head fastest, the sequence slowest). Decode: every
// sequence has the same row chunks of kColumns query heads; multi-token queries: the table's.
template <bool kQueries, int kColumns>
__device__ __forceinline__ ItemIndex item_index(const PagedAttentionParams& p, int num_splits,
                                               const SequenceTable& table, int item) {
  ItemIndex at;
  at.kv_head = item % p.num_kv_heads;
  at.split = (item / p.num_kv_heads) % num_splits;
  const int chunk = item / (p.num_kv_heads * num_splits);
  if constexpr (!kQueries) {
    at.seq = chunk / ((p.num_heads / p.num_kv_heads + kColumns - 1) / kColumns);
    at.chunk = chunk;  // of the batch: item_work takes the sequence's chunks off (fewer live registers)
  } else {
    // The last sequence whose first chunk is at most `chunk` (those without rows share it with the next).
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table.chunk_start[mid] <= chunk) lo = mid; else hi = mid - 1;
    }
    at.seq = lo;
    at.chunk = chunk - table.chunk_start[lo];
  }
  return at;
}

// The split's first block-table index (the start of its staged slice): known without seq_len.
__device__ __forceinline__ int split_first_page(const PagedAttentionParams& p, const WorkQueue& queue, int split) {
  return (split * queue.split_tokens) >> (__ffs(p.block_size) - 1);
}

// Starts copying an item's block-table slice and sequence length into shared memory (cp.async, in the
// caller's copy group; every thread takes part). The slice's bounds do not depend on seq_len, so both
// copies are issued at once; entries past seq_len are copied but never used.
__device__ __forceinline__ void prefetch_item(const PagedAttentionParams& p, const WorkQueue& queue,
                                              const ItemIndex& at, int32_t* pages, int* seq_len) {
  const int first_page = split_first_page(p, queue, at.split);
  const int64_t split_end = static_cast<int64_t>(at.split + 1) * queue.split_tokens;
  const int end_page = static_cast<int>(
      std::min<int64_t>(p.max_blocks_per_seq, (split_end + p.block_size - 1) >> (__ffs(p.block_size) - 1)));
  const int32_t* table_row = p.block_tables + at.seq * p.block_table_stride;
  for (int i = threadIdx.x; i < end_page - first_page; i += kThreads) {
    copy_async<4>(pages + i, table_row + first_page + i, true);
  }
  if (threadIdx.x == 0) copy_async<4>(seq_len, p.seq_lens + at.seq, true);
}

// An item's work: its rows (a chunk of its sequence's rows at its KV head) and the cache positions they
// see (causal per query token, within the split); the range of any row and of every row.
template <bool kQueries>
__device__ __forceinline__ void item_work(const PagedAttentionParams& p, const WorkQueue& queue, const ItemIndex& at,
                                          int seq_len, int columns, const SequenceTable& table, CtaWork& w,
                                          RowSet<kQueries>& rows) {
  const int group = p.num_heads / p.num_kv_heads;
  // Decode: `at.chunk` counts the batch's chunks (see item_index).
  const int chunk = kQueries ? at.chunk : at.chunk - at.seq * ((group + columns - 1) / columns);
  // Clamped to the table's capacity so that unchecked (non-debug) input never reads past it.
  w.seq_len = min(seq_len, p.max_blocks_per_seq * p.block_size);
  w.q_len = kQueries ? table.q_start[at.seq + 1] - table.q_start[at.seq] : 1;
  rows.first_token = kQueries ? table.q_start[at.seq] : at.seq;
  rows.head0 = at.kv_head * group + (kQueries ? 0 : chunk * columns);
  rows.count = min(columns, w.q_len * group - chunk * columns);
  rows.group = group;
  rows.first = chunk * columns;
  // Causal: the item's first token sees the fewest positions, its last the most.
  const KeyRange<int> first = visible_keys(w.seq_len, w.q_len, rows.token(0), p.sliding_window);
  const KeyRange<int> last = visible_keys(w.seq_len, w.q_len, rows.token(rows.count - 1), p.sliding_window);
  w.seq = at.seq;
  w.kv_head = at.kv_head;
  w.block_shift = __ffs(p.block_size) - 1;
  w.lo = max(first.begin, at.split * queue.split_tokens);
  w.hi = min(last.end, (at.split + 1) * queue.split_tokens);
  w.interior_lo = max(last.begin, at.split * queue.split_tokens);
  w.interior_hi = min(first.end, (at.split + 1) * queue.split_tokens);
  w.first_page = split_first_page(p, queue, at.split);
}

// Q^T fragments for S = K Q^T of one column tile: column g of B is the tile's query row g; its k-step `step` holds the lane's
// K elements 4*step .. 4*step+3 (see Layout::key_dim). In two steps, so that the query's round trip
// overlaps the block table's: load_query issues the loads (raw pairs in q_frag), query_operands
// converts them in place once the table slice has been read.
template <DType C>
using KernelQueryRow = QueryRow<CacheTraits<C>::kBf16Math>;

template <DType C, int D>
__device__ __forceinline__ KernelQueryRow<C> load_query(const PagedAttentionParams& p, const RowInfo& row, int t,
                                                        bool query_bf16, uint32_t (&q_frag)[D / 16][2]) {
  const KernelQueryRow<C> q(p, row.query_row, row.head, query_bf16);
#pragma unroll
  for (int step = 0; step < D / 16; ++step) {
#pragma unroll
    for (int half = 0; half < 2; ++half) q_frag[step][half] = q.bits(Layout<C, D>::key_dim(t, 4 * step + 2 * half));
  }
  return q;
}

// Returns the row's logit offset (see logit_offset): the rotated recipe rotates the query first, in
// fp32. A lane holds the row's dims key_dim(t, l) for l < D / 4: l's low bits, then t (two lane bits),
// then l's high bits (Layout).
template <DType C, int D>
__device__ __forceinline__ float query_operands(const PagedAttentionParams& p, int kv_head, const KernelQueryRow<C>& q,
                                                int t, uint32_t (&q_frag)[D / 16][2]) {
  if constexpr (CacheTraits<C>::kIsFp8) {
    if (p.transform.hadamard) {
      using L = Layout<C, D>;
      constexpr int kBlock = hadamard_block(D), kLow = log2_exact(L::kKVec < kBlock ? L::kKVec : kBlock);
      constexpr int kLaneBits = log2_exact(kBlock) - kLow < 2 ? log2_exact(kBlock) - kLow : 2;
      float x[D / 4];
#pragma unroll
      for (int step = 0; step < D / 16; ++step) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 pair = pair_as_float2(q_frag[step][half], q.bf16);
          x[4 * step + 2 * half] = pair.x, x[4 * step + 2 * half + 1] = pair.y;
        }
      }
      hadamard_row<kBlock, kLow, kLaneBits, 0>(x);
#pragma unroll
      for (int l = 0; l < D / 4; ++l) x[l] = mul_rn(x[l], hadamard_norm(kBlock));
#pragma unroll
      for (int step = 0; step < D / 16; ++step) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int l = 4 * step + 2 * half;
          q_frag[step][half] = q.valid ? pack_pair<CacheTraits<C>::kBf16Math>(x[l], x[l + 1]) : 0u;
        }
      }
      return logit_offset(p, kv_head, x, [&](int l) { return L::key_dim(t, l); }, {1, 2});
    }
  }
#pragma unroll
  for (int step = 0; step < D / 16; ++step) {
#pragma unroll
    for (int half = 0; half < 2; ++half) q_frag[step][half] = q.operand(q_frag[step][half]);
  }
  return -0.f;
}

// The lane's LogitRule: column n = 8 * nt + 2t + c sees its query token's positions within the item's
// range. `row_offset[nt]`: query_operands' offset of the lane's own row g of column tile nt.
template <DType C, int NT, typename Rows>
__device__ __forceinline__ LogitRule<NT> logit_rule(const PagedAttentionParams& p, const CtaWork& w,
                                                    const Rows& rows, int t, const float (&row_offset)[NT]) {
  LogitRule<NT> r;
  r.multiplier = logit_multiplier<C>(p, w.kv_head);
  r.soft_cap = p.logits_soft_cap;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int n = kRows * nt + 2 * t + c;
      const bool valid = rows[n].query_row >= 0;
      if constexpr (Rows::kQueries) {
        const KeyRange<int> keys = visible_keys(w.seq_len, w.q_len, rows.token(n), p.sliding_window);
        r.lo[nt][c] = valid ? max(keys.begin, w.lo) : 0;
        r.hi[nt][c] = valid ? min(keys.end, w.hi) : 0;
      } else {  // decode: every row sees [w.lo, w.hi)
        r.lo[nt][c] = valid ? w.lo : 0;
        r.hi[nt][c] = valid ? w.hi : 0;
      }
      // Column 2t + c is the row of the lanes with g = 2t + c.
      r.offset[nt][c] = CacheTraits<C>::kIsFp8 ? __shfl_sync(0xffffffffu, row_offset[nt], 4 * (2 * t + c)) : -0.f;
    }
  }
  return r;
}

// The rotated recipe: the warp's unnormalized output columns rotated back (the warps' merge is linear,
// so each warp's share can be). Lane (g, t) holds columns 2t, 2t + 1 at dims value_dim(g, l): acc[j][c]
// is l = 2j and acc[j][c + 2] is l = 2j + 1; l's low bits, then g (three lane bits), then l's high bits.
template <DType C, int D>
__device__ __forceinline__ void rotate_output(SoftmaxState<D>& st) {
  using L = Layout<C, D>;
  constexpr int kBlock = hadamard_block(D), kLow = log2_exact(L::kVVec < kBlock ? L::kVVec : kBlock);
  constexpr int kLaneBits = log2_exact(kBlock) - kLow < 3 ? log2_exact(kBlock) - kLow : 3;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    float v[D / 8];
#pragma unroll
    for (int j = 0; j < D / 16; ++j) v[2 * j] = st.acc[j][c], v[2 * j + 1] = st.acc[j][c + 2];
    hadamard_row<kBlock, kLow, kLaneBits, 2>(v);
#pragma unroll
    for (int j = 0; j < D / 16; ++j) st.acc[j][c] = v[2 * j], st.acc[j][c + 2] = v[2 * j + 1];
  }
}

// Merges the warps' states of column tile nt through shared memory and writes each row: thread items
// cover kRows columns x D dims, two adjacent dims per item. The caller syncs before the scratch is reused.
template <DType C, int D, typename Rows>
__device__ __forceinline__ void merge_warps_and_write(const PagedAttentionParams& p, const SplitWorkspace& ws,
                                                      int split, const CtaWork& w, const Rows& rows, int nt,
                                                      bool out_bf16, int g, int t, int warp, SoftmaxState<D>& st,
                                                      uint8_t* smem, ItemShared& shared) {
  using L = Layout<C, D>;
  // Each lane holds a share of the denominators: sum over lanes with equal t.
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) st.row_sum[c] += __shfl_xor_sync(0xffffffffu, st.row_sum[c], mask);
  }

  if constexpr (CacheTraits<C>::kIsFp8) {
    if (p.transform.hadamard) rotate_output<C, D>(st);
  }

  // acc[column][dim] of warp x in its last ring stage (free: see Staging::kMergePitch); max and sum
  // per (warp, column) in ItemShared.
  using Stg = Staging<C, D>;
  auto smem_acc = [&](int x) {
    return reinterpret_cast<float (*)[Stg::kMergePitch]>(smem + (x * Stg::kStages + Stg::kStages - 1) * Stg::kStageBytes);
  };
  auto smem_max = shared.row_max;
  auto smem_sum = shared.row_sum;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int d0 = L::value_dim(g, 2 * j), d1 = L::value_dim(g, 2 * j + 1);
    smem_acc(warp)[2 * t][d0] = st.acc[j][0];
    smem_acc(warp)[2 * t + 1][d0] = st.acc[j][1];
    smem_acc(warp)[2 * t][d1] = st.acc[j][2];
    smem_acc(warp)[2 * t + 1][d1] = st.acc[j][3];
  }
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) smem_max[warp][2 * t + c] = st.row_max[c], smem_sum[warp][2 * t + c] = st.row_sum[c];
  }
  __syncthreads();

  const float v_scale = output_scale<C, D>(p, w.kv_head);
  for (int item = threadIdx.x; item < kRows * D / 2; item += kThreads) {
    const int n = item / (D / 2);
    const int d = 2 * (item % (D / 2));
    const RowInfo row = rows[kRows * nt + n];
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
      o0 += weight * smem_acc(x)[n][d];
      o1 += weight * smem_acc(x)[n][d + 1];
    }
    write_pair<D>(p, ws, split, row.query_row, row.head, out_bf16, v_scale, max_all, sum, d, o0, o1);
  }
}

// The item a CTA takes after its current one: from the queue when there may be more items than CTAs
// (a CTA's first item is its own index), else none (queue.items), and the counter is not touched.
__device__ __forceinline__ int claim_item(const WorkQueue& queue) {
  return queue.items > static_cast<int>(gridDim.x) ? gridDim.x + atomicAdd(queue.taken, 1) : queue.items;
}

// NT: column tiles per item (1 for decode); kQueries: multi-token queries (cu_seqlens_q), else decode.
template <DType C, int D, int NT, bool kQueries>
__global__ void __launch_bounds__(kThreads, min_ctas_per_sm(D, NT, kQueries))
    decode_kernel(const PagedAttentionParams p, SplitWorkspace ws, WorkQueue queue) {
  using Stg = Staging<C, D>;
  constexpr int kColumns = kRows * NT;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates
  if (ws.num_splits > 1) allow_dependent_grid();  // the merge may start its CTAs (they wait for this grid)
  extern __shared__ __align__(16) uint8_t smem[];
  ItemShared& shared = *reinterpret_cast<ItemShared*>(smem + Stg::kSharedOffset);
  int32_t* const slices = reinterpret_cast<int32_t*>(smem + Stg::kPagesOffset);  // two block-table slices
  uint8_t* const ring = smem + warp * Stg::kStages * Stg::kStageBytes;
  const bool query_bf16 = p.query_dtype == DType::kBFloat16;  // also the output's

  // Decode: every sequence has the same row chunks and queue.items is exact. Multi-token queries: the
  // sequences' chunks are counted here, from cu_seqlens_q (after the two block-table slices).
  const SequenceTable table{slices + 2 * queue.slice_entries, slices + 2 * queue.slice_entries + p.num_seqs + 1};
  int items = queue.items;
  if constexpr (kQueries) {
    // At most the host's bound: sequences whose query ranges overlap (an unchecked, invalid
    // cu_seqlens_q) could count more, and a count past the bound would never run out.
    items = min(stage_sequence_table(p, kColumns, table) * ws.num_splits * p.num_kv_heads, queue.items);
    if (static_cast<int>(blockIdx.x) >= items) return;  // the grid is sized for a bound
  }

  // Persistent CTAs: the first item is the CTA's own index, later ones come from the queue. While an
  // item streams, the next one's block-table slice and sequence length are copied into the other
  // buffer; when it ends, the next item's first tiles and query are requested before its merge, so
  // that an item's ramp overlaps the previous item's end.
  ItemIndex at = item_index<kQueries, kColumns>(p, ws.num_splits, table, blockIdx.x);
  int buffer = 0;
  int ticket = 0;  // thread 0: the item after the next one
  if (threadIdx.x == 0) ticket = claim_item(queue);
  prefetch_item(p, queue, at, slices, &shared.seq_len[0]);
  copy_async_commit();
  copy_async_wait<0>();
  if (threadIdx.x == 0) shared.next_item = ticket;
  __syncthreads();

  CtaWork w;
  RowSet<kQueries> rows;
  uint32_t q_frag[NT][D / 16][2];
  KernelQueryRow<C> query[NT] = {};
  int first_tile = 0, my_tiles = 0;
  // Starts the item `at` from its shared buffer: its range, its first kStages - 1 tiles (one copy
  // group each) and its query loads (raw bits in q_frag; query_operands converts them).
  auto begin_item = [&]() {
    item_work(p, queue, at, shared.seq_len[buffer], kColumns, table, w, rows);
    first_tile = (w.lo / kTileTokens) * kTileTokens;
    const int num_tiles = w.hi > w.lo ? (w.hi - first_tile + kTileTokens - 1) / kTileTokens : 0;
    // Warp `warp` takes tiles warp, warp + kWarps, ... of the item.
    my_tiles = num_tiles > warp ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
    const RowSource source = make_row_source<C>(p, w.kv_head, lane);
#pragma unroll
    for (int k = 0; k < Stg::kStages - 1; ++k) {
      if (k < my_tiles) {
        stage_tile<C, D>(ring + k * Stg::kStageBytes, source, slices + buffer * queue.slice_entries, w, p.num_blocks,
                         first_tile + (warp + k * kWarps) * kTileTokens, lane);
      }
      copy_async_commit();
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) query[nt] = load_query<C, D>(p, rows[kRows * nt + g], t, query_bf16, q_frag[nt]);
  };
  float row_offset[NT];
  auto query_ready = [&]() {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) row_offset[nt] = query_operands<C, D>(p, w.kv_head, query[nt], t, q_frag[nt]);
  };
  begin_item();
  query_ready();

  for (;;) {
    const int next = shared.next_item;
    const bool has_next = next < items;
    const ItemIndex next_at = item_index<kQueries, kColumns>(p, ws.num_splits, table, has_next ? next : 0);
    auto prefetch_next = [&]() {
      if (has_next) prefetch_item(p, queue, next_at, slices + (buffer ^ 1) * queue.slice_entries, &shared.seq_len[buffer ^ 1]);
    };
    const LogitRule<NT> rule = logit_rule<C, NT>(p, w, rows, t, row_offset);
    SoftmaxState<D> st[NT];
    // The main loop: warp `warp` attends to its tiles of [w.lo, w.hi) through its own ring of kStages
    // shared-memory stages (kStages - 1 tiles in flight). It stays in the kernel body: as a function
    // it shifts the register allocation of some instantiations' loop.
    {
      const RowSource source = make_row_source<C>(p, w.kv_head, lane);
      const int32_t* pages = slices + buffer * queue.slice_entries;
      auto tile_start = [&](int k) { return first_tile + (warp + k * kWarps) * kTileTokens; };
      // Every iteration commits one (possibly empty) copy group, so waiting for all but the newest
      // kStages - 1 groups means tile k has landed. The next item's slice joins the first group.
      TileRegs<C, D> regs;
      for (int k = 0; k < my_tiles; ++k) {
        if (k + Stg::kStages - 1 < my_tiles) {
          stage_tile<C, D>(ring + ((k + Stg::kStages - 1) % Stg::kStages) * Stg::kStageBytes, source, pages, w,
                           p.num_blocks, tile_start(k + Stg::kStages - 1), lane);
        }
        if (k == 0) prefetch_next();
        copy_async_commit();
        copy_async_wait<Stg::kStages - 1>();
        __syncwarp();  // rows copied by other lanes are visible
        read_tile<C, D>(regs, ring + (k % Stg::kStages) * Stg::kStageBytes, lane);
        // Decode: every row sees [w.lo, w.hi).
        const bool interior = kQueries ? tile_start(k) >= w.interior_lo && tile_start(k) + kTileTokens <= w.interior_hi
                                       : tile_start(k) >= w.lo && tile_start(k) + kTileTokens <= w.hi;
        attend_tile<C, D, NT>(regs, q_frag, st, tile_start(k), interior, rule, lane);
        __syncwarp();  // every lane has read the slot before it is refilled
      }
      if (my_tiles == 0) prefetch_next();
      copy_async_commit();
      copy_async_wait<0>();
    }
    __syncthreads();  // the next slice is visible; every warp is done with the ring
    const CtaWork done = w;
    const RowSet<kQueries> done_rows = rows;
    const int done_split = at.split;
    if (has_next) {
      at = next_at;
      buffer ^= 1;
      if (threadIdx.x == 0) ticket = claim_item(queue);
      begin_item();  // its tiles and query are in flight during the merge
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (nt > 0) __syncthreads();  // the previous column tile's merge has read the scratch
      merge_warps_and_write<C, D>(p, ws, done_split, done, done_rows, nt, query_bf16, g, t, warp, st[nt], smem,
                                  shared);
    }
    if (!has_next) break;
    if (threadIdx.x == 0) shared.next_item = ticket;
    query_ready();
    __syncthreads();  // the merge has read the ring's last stages before they are refilled
  }
}

// Dynamic shared memory of a launch: the ring, ItemShared, two block-table slices of the plan's size and,
// for multi-token queries, the sequence table.
template <DType C, int D>
int launch_smem_bytes(const AttentionPlan& plan, int block_size) {
  return Staging<C, D>::kPagesOffset + 2 * pages_bytes(plan, block_size) + plan.sequence_table_bytes;
}

template <DType C, int D, int NT, bool kQueries>
cudaError_t launch_tiles(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                         int* taken, cudaStream_t stream) {
  const int64_t items = plan.row_chunks * plan.num_splits * p.num_kv_heads;
  const WorkQueue queue{taken, static_cast<int>(items), plan.split_tokens,
                        pages_bytes(plan, p.block_size) / 4};
  const int64_t ctas = std::min(items, plan.ctas);
  // The counter is used only when the items may outnumber the CTAs: a call of one wave has no memset
  // (a node before the kernel in a CUDA graph, 0.6-1.0 us of a replay: cuda_decode_design.md, "The
  // persistent grid").
  if (items > ctas) {
    const cudaError_t status = cudaMemsetAsync(taken, 0, sizeof(int), stream);
    if (status != cudaSuccess) return status;
  }
  decode_kernel<C, D, NT, kQueries><<<static_cast<unsigned>(ctas), kThreads, launch_smem_bytes<C, D>(plan, p.block_size),
                            stream>>>(p, ws, queue);
  return cudaGetLastError();
}

// The kernel instantiation of a plan: visit(column tiles, multi-token queries) for decode (one tile),
// or multi-token queries with one or kMaxColumnTiles tiles (see max_column_tiles).
template <int D, typename Visit>
auto with_kernel_variant(const AttentionPlan& plan, Visit&& visit) {
  using One = std::integral_constant<int, 1>;
  if (plan.sequence_table_bytes == 0) return visit(One{}, std::false_type{});
  if constexpr (max_column_tiles(D) > 1) {
    if (plan.column_tiles == kMaxColumnTiles) {
      return visit(std::integral_constant<int, kMaxColumnTiles>{}, std::true_type{});
    }
  }
  return visit(One{}, std::true_type{});
}

template <DType C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws, int* taken,
                   cudaStream_t stream) {
  return dispatch<kCudaHeadSizes>(p.head_size, cudaErrorInvalidValue, [&](auto head) {
    constexpr int kHead = decltype(head)::value;
    return with_kernel_variant<kHead>(plan, [&](auto tiles, auto queries) {
      return launch_tiles<C, kHead, decltype(tiles)::value, decltype(queries)::value>(p, plan, ws, taken, stream);
    });
  });
}

// CTAs per SM that fit with the plan's shared memory: every CTA of the persistent grid must be
// resident at once (a CTA that starts late would start its first item late).
template <DType C>
int occupancy(const AttentionPlan& plan, int head_size, int block_size) {
  return dispatch<kCudaHeadSizes>(head_size, 0, [&](auto head) {
    constexpr int kHead = decltype(head)::value;
    return with_kernel_variant<kHead>(plan, [&](auto tiles, auto queries) {
      const auto kernel = decode_kernel<C, kHead, decltype(tiles)::value, decltype(queries)::value>;
      return kernel_occupancy(reinterpret_cast<const void*>(kernel),
                              kThreads, Staging<C, kHead>::kPagesOffset + 2 * kMaxPages * 4 +
                                            sequence_table_bytes(kMaxTableSeqs),
                              launch_smem_bytes<C, kHead>(plan, block_size));
    });
  });
}

}  // namespace fp8kv::cuda::decode
