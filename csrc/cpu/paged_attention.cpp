// CPU paged attention over an FP8 (or unquantized) cache.
//
// Work item: one sequence, one KV head, and a chunk of up to kQueryChunk query tokens; its rows are
// those tokens times the KV head's group of query heads, so each cache tile is dequantized once for
// the whole group. Keys are consumed in tiles of kKeyTile with an online softmax, so scratch memory
// is bounded by the tile and the chunk, not by the sequence length.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>

#include "../float_conversions.h"
#include "../hadamard.h"
#include "dtype_dispatch.h"
#include "kernels.h"

namespace fp8kv::cpu {
namespace {

constexpr int kKeyTile = 64;
constexpr int kQueryChunk = 16;

// Dequantizes cache rows [start, start + count) of one KV head into dst[count][head_size] without
// the scale (which is folded into the logits or the output).
void load_tile(const PagedAttentionParams& p, const CacheView& cache, const int32_t* block_table, int kv_head,
               int start, int count, float* dst) {
  const int64_t elem_bytes = dtype_bytes(p.cache_dtype);
  const float* table = is_fp8(p.cache_dtype) ? fp8_table(p.cache_dtype) : nullptr;
  for (int i = 0; i < count; ++i) {
    const int position = start + i;
    const int64_t block = block_table[position / p.block_size];
    const int64_t offset = position % p.block_size;
    const auto* row = static_cast<const uint8_t*>(cache.data) +
                      (block * cache.block_stride + offset * cache.token_stride + kv_head * cache.head_stride) *
                          elem_bytes;
    float* out = dst + static_cast<int64_t>(i) * p.head_size;
    if (table != nullptr) {
      for (int d = 0; d < p.head_size; ++d) out[d] = table[row[d]];
    } else {
      dispatch_source_dtype(p.cache_dtype, [&](auto type) {
        using T = Element<decltype(type)::value>;
        const auto* values = reinterpret_cast<const typename T::Storage*>(row);
        for (int d = 0; d < p.head_size; ++d) out[d] = T::to_float(values[d]);
      });
    }
  }
}

float dot(const float* a, const float* b, int n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

struct WorkItem {
  int seq;
  int first_token;  // within the sequence's query rows
  int num_tokens;
};

struct Scratch {
  std::vector<float> query, keys, values, probs, acc, row_max, row_sum, logit_offset;
  std::vector<int> lo, hi;
};

template <DType kQuery>
void attend(const PagedAttentionParams& p, const RowsView& lse, const WorkItem& item, int kv_head, Scratch& s) {
  using Q = Element<kQuery>;
  const int group = p.num_heads / p.num_kv_heads;
  const int d_size = p.head_size;
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

  s.query.resize(static_cast<size_t>(rows) * d_size);
  s.acc.assign(static_cast<size_t>(rows) * d_size, 0.0f);
  s.row_max.assign(rows, -std::numeric_limits<float>::infinity());
  s.row_sum.assign(rows, 0.0f);
  s.lo.resize(rows);
  s.hi.resize(rows);
  s.logit_offset.assign(rows, 0.0f);
  s.keys.resize(static_cast<size_t>(kKeyTile) * d_size);
  s.values.resize(static_cast<size_t>(kKeyTile) * d_size);
  s.probs.resize(static_cast<size_t>(rows) * kKeyTile);

  // Row r is query token (first_token + r / group) and query head kv_head * group + r % group.
  for (int r = 0; r < rows; ++r) {
    const int token = item.first_token + r / group;
    const int head = kv_head * group + r % group;
    const auto* q = reinterpret_cast<const typename Q::Storage*>(p.query) + (q_begin + token) * p.query_token_stride +
                    head * p.query_head_stride;
    float* qf = s.query.data() + static_cast<int64_t>(r) * d_size;
    for (int d = 0; d < d_size; ++d) qf[d] = Q::to_float(q[d]);
    transform_row(qf, d_size, p.transform.hadamard, nullptr);
    if (soft_cap && k_offset != nullptr) s.logit_offset[r] = p.softmax_scale * dot(qf, k_offset, d_size);
    const KeyRange<int> keys = visible_keys(seq_len, q_len, token, p.sliding_window);
    s.lo[r] = keys.begin;
    s.hi[r] = keys.end;
  }
  const int range_lo = std::max(0, s.lo[0]);
  const int range_hi = std::max(0, s.hi[rows - 1]);

  for (int start = range_lo; start < range_hi; start += kKeyTile) {
    const int count = std::min(kKeyTile, range_hi - start);
    load_tile(p, p.key_cache, block_table, kv_head, start, count, s.keys.data());
    for (int r = 0; r < rows; ++r) {
      const int j_lo = std::max(s.lo[r], start) - start;
      const int j_hi = std::min(s.hi[r], start + count) - start;
      if (j_lo >= j_hi) continue;
      const float* qf = s.query.data() + static_cast<int64_t>(r) * d_size;
      float* probs = s.probs.data() + static_cast<int64_t>(r) * kKeyTile;
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int j = j_lo; j < j_hi; ++j) {
        float logit = logit_scale * dot(qf, s.keys.data() + static_cast<int64_t>(j) * d_size, d_size);
        if (soft_cap) logit = p.logits_soft_cap * std::tanh((logit + s.logit_offset[r]) / p.logits_soft_cap);
        probs[j] = logit;
        tile_max = std::max(tile_max, logit);
      }
      const float new_max = std::max(s.row_max[r], tile_max);
      const float rescale = std::exp(s.row_max[r] - new_max);  // 0 on the first tile (exp(-inf))
      float tile_sum = 0.0f;
      for (int j = j_lo; j < j_hi; ++j) {
        probs[j] = std::exp(probs[j] - new_max);
        tile_sum += probs[j];
      }
      s.row_sum[r] = s.row_sum[r] * rescale + tile_sum;
      s.row_max[r] = new_max;
      float* acc = s.acc.data() + static_cast<int64_t>(r) * d_size;
#pragma omp simd
      for (int d = 0; d < d_size; ++d) acc[d] *= rescale;
    }
    load_tile(p, p.value_cache, block_table, kv_head, start, count, s.values.data());
    for (int r = 0; r < rows; ++r) {
      // Only keys this row may see reach the product: a masked slot may hold NaN codes.
      const int j_lo = std::max(s.lo[r], start) - start;
      const int j_hi = std::min(s.hi[r], start + count) - start;
      const float* probs = s.probs.data() + static_cast<int64_t>(r) * kKeyTile;
      float* acc = s.acc.data() + static_cast<int64_t>(r) * d_size;
      for (int j = j_lo; j < j_hi; ++j) {
        const float w = probs[j];
        const float* v = s.values.data() + static_cast<int64_t>(j) * d_size;
#pragma omp simd
        for (int d = 0; d < d_size; ++d) acc[d] += w * v[d];
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
    float* acc = s.acc.data() + static_cast<int64_t>(r) * d_size;
    if (p.transform.hadamard) {
      hadamard_blocks(acc, d_size, block);
      out_scale *= hadamard_norm(block);
    }
    for (int d = 0; d < d_size; ++d) o[d] = Q::from_float(acc[d] * out_scale);
    if (lse.data != nullptr) {
      // The logits' log-sum-exp, -inf without keys. Without a soft cap the logits above lack the
      // rotated recipe's q . k_offset (softmax ignores it); the log-sum-exp does not.
      const float offset = !soft_cap && k_offset != nullptr
                               ? p.softmax_scale * dot(s.query.data() + static_cast<int64_t>(r) * d_size, k_offset, d_size)
                               : 0.0f;
      static_cast<float*>(lse.data)[lse.offset(q_begin + token, head)] =
          s.row_sum[r] > 0.0f ? s.row_max[r] + std::log(s.row_sum[r]) + offset : -std::numeric_limits<float>::infinity();
    }
  }
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
  dispatch_source_dtype(p.query_dtype, [&](auto query) {
    constexpr DType kQuery = decltype(query)::value;
    at::parallel_for(0, num_work, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t w = begin; w < end; ++w) {
        attend<kQuery>(p, lse, items[w / p.num_kv_heads], static_cast<int>(w % p.num_kv_heads), scratch);
      }
    });
  });
}

}  // namespace fp8kv::cpu
