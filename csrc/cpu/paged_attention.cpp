// CPU paged attention over an FP8 (or unquantized) cache, tiled as flash attention.
//
// Work item: one sequence, one KV head and up to kQueryChunk of its query tokens; its rows are those
// tokens times the KV head's group of query heads, so each cache tile is dequantized once for all of
// them. Keys come in tiles of kKeyTile positions, at multiples of kKeyTile whatever the item, with an
// online softmax: tiles are decoded to fp32 in vectors (cache_tile.h), S = Q K^T and O += P V are
// register-blocked products in fused multiply-adds (tile_math.h; this file compiles with contraction)
// in the widest vectors torch uses on this CPU (AVX-512, AVX2, else the baseline ISA), chosen at run
// time. A row's result does not depend on the item it is in (tile_math.h). Scratch memory is bounded
// by the tile and the chunk, not by the sequence length. Items are split between threads by their cost.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include "../float_conversions.h"
#include "../hadamard.h"
#include "cache_tile.h"
#include "dtype_dispatch.h"
#include "kernels.h"
#include "tile_math.h"

namespace fp8kv::cpu {
namespace {

constexpr int kKeyTile = 256;
constexpr int kQueryChunk = 64;
// Tile rows are padded to whole product blocks of the widest vectors (AVX-512's 16 floats).
constexpr int kColumnAlign = kProductVectors * 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int padded(int n) { return (n + kColumnAlign - 1) / kColumnAlign * kColumnAlign; }

// fp32 scratch aligned to a cache line, zeroed when it grows.
class Buffer {
 public:
  float* resize(size_t n) {
    lines_.resize((n + 15) / 16);
    return lines_.data()->values;
  }

 private:
  struct alignas(64) Line {
    float values[16];
  };
  std::vector<Line> lines_;
};

template <DType F, int W>
FP8KV_ALWAYS_INLINE void load_tile_rows(const uint8_t* const* rows, int count, int head_size, float* dst,
                                        int64_t row_stride, bool transposed) {
  if (transposed) {
    load_rows_transposed<F, W>(rows, 0, count, head_size, dst, row_stride);
  } else {
    load_rows<F, W>(rows, 0, count, head_size, dst, row_stride);
  }
}

// Where the rows of cache positions [begin, end) of one KV head start, a block-table entry per block.
void tile_rows(const PagedAttentionParams& p, const CacheView& cache, const int32_t* block_table, int kv_head,
               int begin, int end, const uint8_t** rows) {
  const int64_t elem_bytes = dtype_bytes(p.cache_dtype);
  const auto* data = static_cast<const uint8_t*>(cache.data) + kv_head * cache.head_stride * elem_bytes;
  for (int position = begin; position < end;) {
    const int offset = position % p.block_size;
    const int n = std::min(p.block_size - offset, end - position);
    const uint8_t* row = data + (block_table[position / p.block_size] * cache.block_stride +
                                 static_cast<int64_t>(offset) * cache.token_stride) * elem_bytes;
    for (int j = 0; j < n; ++j) *rows++ = row + j * cache.token_stride * elem_bytes;
    position += n;
  }
}

// `count` cached rows as fp32, without the scale (folded into the logits or the output): row i's
// element d goes to dst[i * row_stride + d], or to dst[d * row_stride + i] when transposed (the keys'
// K^T).
template <int W>
FP8KV_ALWAYS_INLINE void load_tile(const PagedAttentionParams& p, const uint8_t* const* rows, int count, float* dst,
                                   int64_t row_stride, bool transposed) {
  // A switch, not a dispatching lambda: a lambda is a function of its own, compiled for the baseline ISA.
  switch (p.cache_dtype) {
    case DType::kFloat8E4M3FN:
      return load_tile_rows<DType::kFloat8E4M3FN, W>(rows, count, p.head_size, dst, row_stride, transposed);
    case DType::kFloat8E5M2:
      return load_tile_rows<DType::kFloat8E5M2, W>(rows, count, p.head_size, dst, row_stride, transposed);
    case DType::kFloat8E4M3FNUZ:
      return load_tile_rows<DType::kFloat8E4M3FNUZ, W>(rows, count, p.head_size, dst, row_stride, transposed);
    case DType::kFloat16:
      return load_tile_rows<DType::kFloat16, W>(rows, count, p.head_size, dst, row_stride, transposed);
    case DType::kBFloat16:
      return load_tile_rows<DType::kBFloat16, W>(rows, count, p.head_size, dst, row_stride, transposed);
    default: TORCH_CHECK(false, "fp8kv: unexpected cache dtype");
  }
}

struct WorkItem {
  int seq;
  int first_token;  // within the sequence's query rows
  int num_tokens;
};

struct Scratch {
  Buffer query, keys, values, logits, acc;
  std::vector<float> row_max, row_sum, logit_offset;
  std::vector<int> lo, hi, tile_lo, tile_hi;
};

// One tile's logits of row x[0, cols) -> its probabilities, updating the row's running max and sum;
// x[j_lo, j_hi) are the keys it sees. Returns the factor that rescales the row's accumulator.
template <int W>
FP8KV_ALWAYS_INLINE float softmax_tile(float* x, int cols, int j_lo, int j_hi, float& row_max, float& row_sum) {
  using S = Simd<W>;
  std::fill(x, x + j_lo, kNegInf);
  std::fill(x + j_hi, x + cols, kNegInf);
  auto high = S::splat(kNegInf);
  for (int j = 0; j < cols; j += W) {
    const auto v = S::load(x + j);
    high = v > high ? v : high;
  }
  const float tile_max = S::reduce(high, kNegInf, [](float a, float b) { return std::max(a, b); });
  const float new_max = std::max(row_max, tile_max);
  const float shift = new_max == kNegInf ? 0.0f : new_max;  // no key seen yet: every x is -inf
  auto sum = S::splat(0.0f);
  for (int j = 0; j < cols; j += W) {
    S::store(x + j, S::load(x + j) - shift);
    exp_nonpositive<W>(x + j);
    sum += S::load(x + j);
  }
  const float tile_sum = S::reduce(sum, 0.0f, [](float a, float b) { return a + b; });
  const float rescale = new_max == row_max ? 1.0f : std::exp(row_max - new_max);  // 0 on the first keys
  row_sum = row_sum * rescale + tile_sum;
  row_max = new_max;
  return rescale;
}

template <DType kQuery, int W>
FP8KV_ALWAYS_INLINE void attend(const PagedAttentionParams& p, const RowsView& lse, const WorkItem& item, int kv_head,
                                Scratch& s) {
  using Q = Element<kQuery>;
  using S = Simd<W>;
  const int group = p.num_heads / p.num_kv_heads;
  const int d_size = p.head_size;
  const int dims = padded(d_size);  // row stride of V tiles and of the accumulator
  const int rows = item.num_tokens * group;
  const int seq_len = p.seq_lens[item.seq];
  const int64_t q_begin = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[item.seq] : item.seq;
  const int q_len = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[item.seq + 1] - p.cu_seqlens_q[item.seq] : 1;
  const int32_t* block_table = p.block_tables + item.seq * p.block_table_stride;
  // An unquantized cache holds the values themselves: scales do not apply (as in the cache write).
  const bool quantized = is_fp8(p.cache_dtype);
  const float k_scale = quantized ? *p.k_scale.at(kv_head) : 1.0f;
  const float v_scale = quantized ? *p.v_scale.at(kv_head) : 1.0f;
  const float logit_scale = p.softmax_scale * k_scale;
  const bool soft_cap = p.logits_soft_cap > 0.0f;
  // The rotated recipe (docs/rotated_cache.md): queries rotated like the keys, outputs rotated back,
  // and under a soft cap each row's q . k_offset, which softmax alone would ignore, added back.
  const int block = hadamard_block(d_size);
  const float* k_offset =
      p.transform.k_offset != nullptr ? p.transform.k_offset + static_cast<int64_t>(kv_head) * d_size : nullptr;

  float* query = s.query.resize(static_cast<size_t>(rows) * d_size);
  float* keys = s.keys.resize(static_cast<size_t>(d_size) * kKeyTile);  // K^T: [head_size][kKeyTile]
  float* values = s.values.resize(static_cast<size_t>(kKeyTile) * dims);
  float* logits = s.logits.resize(static_cast<size_t>(rows) * kKeyTile);
  float* acc = s.acc.resize(static_cast<size_t>(rows) * dims);
  std::fill(acc, acc + static_cast<size_t>(rows) * dims, 0.0f);
  s.row_max.assign(rows, kNegInf);
  s.row_sum.assign(rows, 0.0f);
  s.logit_offset.assign(rows, 0.0f);
  for (auto* v : {&s.lo, &s.hi, &s.tile_lo, &s.tile_hi}) v->resize(rows);

  // Row r is query token (first_token + r / group) and query head kv_head * group + r % group.
  for (int r = 0; r < rows; ++r) {
    const int token = item.first_token + r / group;
    const int head = kv_head * group + r % group;
    const auto* q = reinterpret_cast<const typename Q::Storage*>(p.query) + (q_begin + token) * p.query_token_stride +
                    head * p.query_head_stride;
    float* qf = query + static_cast<int64_t>(r) * d_size;
    for (int d = 0; d < d_size; ++d) qf[d] = Q::to_float(q[d]);
    transform_row(qf, d_size, p.transform.hadamard, nullptr);
    if (k_offset != nullptr && (soft_cap || lse.data != nullptr)) {
      float dot = 0.0f;
      for (int d = 0; d < d_size; ++d) dot += qf[d] * k_offset[d];
      s.logit_offset[r] = p.softmax_scale * dot;
    }
    const KeyRange<int> keys_seen = visible_keys(seq_len, q_len, token, p.sliding_window);
    s.lo[r] = keys_seen.begin;
    s.hi[r] = keys_seen.end;
  }
  const int range_lo = std::max(0, s.lo[0]);
  const int range_hi = std::max(0, s.hi[rows - 1]);
  const uint8_t* rows_of_tile[kKeyTile];

  for (int start = range_lo / kKeyTile * kKeyTile; start < range_hi; start += kKeyTile) {
    const int count = std::min(kKeyTile, range_hi - start);
    const int first = std::max(range_lo, start) - start;  // no row sees the tile's positions before it
    const int cols = padded(count);
    const int tile_begin = start + first, tile_count = count - first;
    tile_rows(p, p.key_cache, block_table, kv_head, tile_begin, start + count, rows_of_tile);
    load_tile<W>(p, rows_of_tile, tile_count, keys + first, kKeyTile, true);
    for (int r = 0; r < rows; r += kProductRows) {
      product_rows<W, false>(std::min(kProductRows, rows - r), cols, 0, d_size, query + r * d_size, d_size, keys,
                             kKeyTile, logits + r * kKeyTile, kKeyTile);
    }
    for (int r = 0; r < rows; ++r) {
      float* x = logits + static_cast<int64_t>(r) * kKeyTile;
      const int j_lo = std::clamp(s.lo[r] - start, 0, count);
      const int j_hi = std::clamp(s.hi[r] - start, 0, count);
      if (j_lo >= j_hi) {  // sees no key of this tile
        std::fill(x, x + cols, 0.0f);
        s.tile_lo[r] = count;
        s.tile_hi[r] = 0;
        continue;
      }
      s.tile_lo[r] = j_lo;
      s.tile_hi[r] = j_hi;
      if (soft_cap) {
        for (int j = j_lo; j < j_hi; ++j) {
          x[j] = p.logits_soft_cap * std::tanh((logit_scale * x[j] + s.logit_offset[r]) / p.logits_soft_cap);
        }
      } else {
        for (int j = 0; j < cols; j += W) S::store(x + j, S::load(x + j) * logit_scale);
      }
      const float rescale = softmax_tile<W>(x, cols, j_lo, j_hi, s.row_max[r], s.row_sum[r]);
      if (rescale != 1.0f) {
        float* o = acc + static_cast<int64_t>(r) * dims;
        for (int d = 0; d < dims; d += W) S::store(o + d, S::load(o + d) * rescale);
      }
    }
    // Only keys some row of a product block sees reach its product (other rows' weights there are 0):
    // a slot no row sees may hold NaN codes.
    tile_rows(p, p.value_cache, block_table, kv_head, tile_begin, start + count, rows_of_tile);
    load_tile<W>(p, rows_of_tile, tile_count, values + first * dims, dims, false);
    for (int r = 0; r < rows; r += kProductRows) {
      const int n = std::min(kProductRows, rows - r);
      const int k_begin = *std::min_element(s.tile_lo.begin() + r, s.tile_lo.begin() + r + n);
      const int k_end = *std::max_element(s.tile_hi.begin() + r, s.tile_hi.begin() + r + n);
      if (k_begin < k_end) {
        product_rows<W, true>(n, dims, k_begin, k_end, logits + r * kKeyTile, kKeyTile, values, dims, acc + r * dims,
                              dims);
      }
    }
  }

  for (int r = 0; r < rows; ++r) {
    const int token = item.first_token + r / group;
    const int head = kv_head * group + r % group;
    auto* o = reinterpret_cast<typename Q::Storage*>(p.out) + (q_begin + token) * p.out_token_stride +
              head * p.out_head_stride;
    // A row that sees no keys (a decode row with seq_len 0, i.e. batch padding) outputs zeros.
    float out_scale = s.row_sum[r] > 0.0f ? v_scale / s.row_sum[r] : 0.0f;
    float* row = acc + static_cast<int64_t>(r) * dims;
    if (p.transform.hadamard) {
      hadamard_blocks(row, d_size, block);
      out_scale *= hadamard_norm(block);
    }
    for (int d = 0; d < d_size; ++d) o[d] = Q::from_float(row[d] * out_scale);
    if (lse.data != nullptr) {
      // The logits' log-sum-exp, -inf without keys. Without a soft cap the logits above lack the
      // rotated recipe's q . k_offset (softmax ignores it); the log-sum-exp does not.
      static_cast<float*>(lse.data)[lse.offset(q_begin + token, head)] =
          s.row_sum[r] > 0.0f ? s.row_max[r] + std::log(s.row_sum[r]) + (soft_cap ? 0.0f : s.logit_offset[r]) : kNegInf;
    }
  }
}

// Work w is item w / num_kv_heads for KV head w % num_kv_heads.
template <DType kQuery, int W>
FP8KV_ALWAYS_INLINE void attend_range(const PagedAttentionParams& p, const RowsView& lse,
                                      const std::vector<WorkItem>& items, int64_t begin, int64_t end) {
  // Kept by each thread across calls: a decode step's call is short, and fresh scratch of a few hundred
  // KiB per thread per call is page faults.
  static thread_local Scratch scratch;
  for (int64_t w = begin; w < end; ++w) {
    attend<kQuery, W>(p, lse, items[w / p.num_kv_heads], static_cast<int>(w % p.num_kv_heads), scratch);
  }
}

using AttendRange = void (*)(const PagedAttentionParams&, const RowsView&, const std::vector<WorkItem>&, int64_t,
                             int64_t);

template <DType kQuery>
void attend_range_baseline(const PagedAttentionParams& p, const RowsView& lse, const std::vector<WorkItem>& items,
                           int64_t begin, int64_t end) {
  attend_range<kQuery, 4>(p, lse, items, begin, end);
}

#if defined(__x86_64__)
template <DType kQuery>
__attribute__((target("avx2,fma"))) void attend_range_avx2(const PagedAttentionParams& p, const RowsView& lse,
                                                       const std::vector<WorkItem>& items, int64_t begin, int64_t end) {
  attend_range<kQuery, 8>(p, lse, items, begin, end);
}

template <DType kQuery>
__attribute__((target("avx512f"))) void attend_range_avx512(const PagedAttentionParams& p, const RowsView& lse,
                                                            const std::vector<WorkItem>& items, int64_t begin,
                                                            int64_t end) {
  attend_range<kQuery, 16>(p, lse, items, begin, end);
}
#endif

// The widest vectors torch's own kernels use on this CPU (ATEN_CPU_CAPABILITY can lower it).
template <DType kQuery>
AttendRange attend_range_for_cpu() {
#if defined(__x86_64__)
  static const std::string capability = at::get_cpu_capability();
  if (capability == "AVX512") return attend_range_avx512<kQuery>;
  if (capability == "AVX2") return attend_range_avx2<kQuery>;
#endif
  return attend_range_baseline<kQuery>;
}

// Relative cost of an item: its rows' products plus the dequantization (about kDequantRows rows' worth),
// per key it reads.
constexpr int64_t kDequantRows = 4;

int64_t item_cost(const PagedAttentionParams& p, const WorkItem& item) {
  const int seq_len = p.seq_lens[item.seq];
  const int q_len = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[item.seq + 1] - p.cu_seqlens_q[item.seq] : 1;
  const int lo = visible_keys(seq_len, q_len, item.first_token, p.sliding_window).begin;
  const int hi = visible_keys(seq_len, q_len, item.first_token + item.num_tokens - 1, p.sliding_window).end;
  const int64_t keys = std::max(0, hi - std::max(0, lo) / kKeyTile * kKeyTile);
  return (static_cast<int64_t>(item.num_tokens) * (p.num_heads / p.num_kv_heads) + kDequantRows) * keys;
}

}  // namespace

void paged_attention(const PagedAttentionParams& p, const RowsView& lse) {
  std::vector<WorkItem> items;
  for (int seq = 0; seq < p.num_seqs; ++seq) {
    const int q_len = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq] : 1;
    for (int first = 0; first < q_len; first += kQueryChunk) {
      items.push_back({seq, first, std::min(kQueryChunk, q_len - first)});
    }
  }
  const int64_t num_work = static_cast<int64_t>(items.size()) * p.num_kv_heads;
  // One contiguous range of work per thread, of about equal cost: causal prefill items differ in cost
  // by up to the sequence length.
  std::vector<int64_t> cost_before(num_work + 1, 0);
  for (int64_t w = 0; w < num_work; ++w) cost_before[w + 1] = cost_before[w] + item_cost(p, items[w / p.num_kv_heads]);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_work));
  auto part_begin = [&](int64_t part) {
    if (part == parts) return num_work;
    const int64_t target = cost_before[num_work] / parts * part;
    return static_cast<int64_t>(std::lower_bound(cost_before.begin(), cost_before.end(), target) - cost_before.begin());
  };
  dispatch_source_dtype(p.query_dtype, [&](auto query) {
    const AttendRange attend_part = attend_range_for_cpu<decltype(query)::value>();
    at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) attend_part(p, lse, items, part_begin(part), part_begin(part + 1));
    });
  });
}

}  // namespace fp8kv::cpu
