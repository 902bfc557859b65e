// HIP paged attention over an FP8 (or unquantized) cache, for decode rows and multi-token rows.
//
// Workgroup = (query row, KV head, tile of up to kHeads query heads of that KV head's group, split).
// The query heads of a tile share every K/V row the workgroup loads, so a page is read once per KV
// head (per tile of kHeads query heads when the group is larger). Four 64-lane wavefronts walk the
// split's keys in steps; each key row is spread over kLanesPerToken lanes holding 8 dimensions each.
//
// Numerics: logits, softmax and both products in fp32. k_scale (and the format's power-of-two unpack
// scale, see fp8x4_to_half2x2 in csrc/fp8.h) is folded into the logit scale, v_scale into the output
// scale. The split's keys go through LDS in chunks with an online softmax. Keys a row may not see
// (past its causal end, before its window, a stale slot of its last page) are never loaded: a stale
// slot may hold NaN codes.
//
// Split-KV: the host fixes the number of splits from sizes only (plan_paged_attention); each row
// divides its own visible keys among them, so short rows use fewer, and a merge kernel combines
// the splits' partial results (max, sum, unnormalized output) from the workspace. A call that asks
// for the log-sum-exp has at least two splits: the merge writes it.
//
// Multi-token rows (cu_seqlens_q given) run the same kernel: every row finds its sequence and its
// causal range, and reads its keys itself (no reuse of K/V across the rows of a sequence).
//
// The rotated recipe (docs/rotated_cache.md): the query rows are rotated into the cache's basis (fp32
// butterflies across the lanes that hold a row, then the norm) before the products, and the output
// rows are rotated back before they are written, split results before the merge (it is linear), the
// norm in the output scale. With a soft cap and a K offset, q' . k_offset is added back to each logit
// before the cap (without a cap softmax ignores it).
#include <hip/hip_runtime.h>

#include <algorithm>
#include <cmath>

#include "device.h"
#include "../gpu/kernels.h"
#include "../hadamard.h"
#include "launch.h"

namespace fp8kv::hip {
namespace {

constexpr int kWaves = 4;
constexpr int kThreads = kWaves * kWaveSize;
constexpr int kDimsPerLane = 8;
constexpr int kMaxHeadSize = 256;
constexpr int kChunkTokens = 256;      // keys whose logits sit in LDS at once
constexpr int kMinSplitTokens = 128;   // a shorter split costs more in its merge than it gains
constexpr int kSplitGranule = 32;
constexpr int kWorkgroupsPerUnit = 4;  // splits are added until the grid has this many per compute unit
constexpr int kMaxGridY = 65535;
constexpr int kMaxGridZ = 65535;

template <int kPaddedHeadSize, int kHeads>
struct Tiling {
  static constexpr int kLanesPerToken = kPaddedHeadSize / kDimsPerLane;  // 8, 16 or 32
  static constexpr int kTokensPerWave = kWaveSize / kLanesPerToken;
  static constexpr int kTokensPerStep = kWaves * kTokensPerWave;
  static_assert(kHeads <= kLanesPerToken, "reduce_heads needs a lane per head");
  static constexpr int kSharedFloats = std::max(kHeads * kChunkTokens, (kWaves - 1) * kPaddedHeadSize);
};

struct AttentionLaunch {
  int num_splits;
  int head_tiles;  // per KV head
  bool aligned;    // cache rows allow 8-element vector loads
  float* partial_out;    // [rows][num_heads][num_splits][head_size], when num_splits > 1
  float2* partial_stats;  // [rows][num_heads][num_splits]: (max logit, sum of exponentials)
  RowsView lse;           // the merge's log-sum-exp output (data nullptr: none)
};

// The keys [begin, end) that query row `row` sees, and its sequence.
struct RowKeys {
  int seq;
  int begin;
  int end;
};

__device__ RowKeys row_keys(const PagedAttentionParams& p, int64_t row) {
  int seq = static_cast<int>(row);
  int q_len = 1;
  int token = 0;
  if (p.cu_seqlens_q != nullptr) {
    // The last sequence whose first row is <= row (empty sequences share their start).
    int lo = 0;
    int hi = p.num_seqs - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.cu_seqlens_q[mid] <= row) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    seq = lo;
    q_len = p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq];
    token = static_cast<int>(row - p.cu_seqlens_q[seq]);
  }
  const KeyRange<int64_t> visible = visible_keys<int64_t>(p.seq_lens[seq], q_len, token, p.sliding_window);
  // Never past the block table's row, whatever seq_lens says (checked only in debug mode).
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  return RowKeys{seq, static_cast<int>(visible.begin),
                 static_cast<int>(std::max(visible.begin, std::min(visible.end, capacity)))};
}

// Keys per split for a row with `count` visible keys; the row uses ceil(count / result) splits.
__device__ int split_tokens(int count, int num_splits) {
  const int even = (count + num_splits - 1) / num_splits;
  return std::max(kMinSplitTokens, (even + kSplitGranule - 1) / kSplitGranule * kSplitGranule);
}

// Walks one lane's key positions (first, first + step, ...) as (block table index, offset in block).
struct PagePosition {
  int index;
  int offset;

  __device__ PagePosition(int position, int block_size) : index(position / block_size), offset(position % block_size) {}

  __device__ void advance(int step, int block_size) {
    offset += step;
    while (offset >= block_size) {
      offset -= block_size;
      ++index;
    }
  }
};

// One lane's 8 dimensions of one KV head's cache rows.
template <typename Cache>
struct LaneCacheRows {
  const typename Cache::Storage* base;
  int64_t block_stride;
  int64_t token_stride;

  __device__ LaneCacheRows(const CacheView& cache, int kv_head, int dim0)
      : base(static_cast<const typename Cache::Storage*>(cache.data) + kv_head * cache.head_stride + dim0),
        block_stride(cache.block_stride),
        token_stride(cache.token_stride) {}

  __device__ void load(int32_t block, int offset, bool aligned, float out[kDimsPerLane]) const {
    Cache::load8(base + block * block_stride + offset * token_stride, aligned, out);
  }
};

// Sums partial[h] over kWidth consecutive lanes for all kHeads heads. Each halving step trades half of
// the heads with the partner lane, so the whole reduction costs kHeads - 1 + log2(kWidth / kHeads)
// shuffles instead of kHeads * log2(kWidth). Afterwards partial[0] holds the total of the returned head;
// kWidth / kHeads lanes hold each head, the one with the low bits clear is its `leader`.
template <int kCount, int kOffset, int kHeads>
__device__ void trade_halves(float (&partial)[kHeads], int lane, int& head) {
  if constexpr (kCount > 1) {
    const bool upper = (lane & kOffset) != 0;
#pragma unroll
    for (int j = 0; j < kCount / 2; ++j) {
      const float keep = upper ? partial[j + kCount / 2] : partial[j];
      const float give = upper ? partial[j] : partial[j + kCount / 2];
      partial[j] = keep + __shfl_xor(give, kOffset);
    }
    if (upper) head += kCount / 2;
    trade_halves<kCount / 2, kOffset / 2>(partial, lane, head);
  }
}

template <int kHeads, int kWidth>
__device__ int reduce_heads(float (&partial)[kHeads], int lane, bool* leader) {
  int head = 0;
  trade_halves<kHeads, kWidth / 2>(partial, lane, head);
#pragma unroll
  for (int offset = kWidth / kHeads / 2; offset > 0; offset /= 2) partial[0] += __shfl_xor(partial[0], offset);
  *leader = (lane & (kWidth / kHeads - 1)) == 0;
  return head;
}

// What an output row is multiplied by besides v_scale / sum: the format's unpack scale and, rotated, the
// norm the un-rotation's butterflies leave out.
template <typename Cache>
__host__ __device__ float output_factor(const PagedAttentionParams& p) {
  return Cache::kUnpackScale * (p.transform.hadamard ? hadamard_norm(hadamard_block(p.head_size)) : 1.0f);
}

// Q: the query's Element; Cache: the cache's CacheRow.
template <typename Q, typename Cache, int kPaddedHeadSize, int kHeads>
__global__ __launch_bounds__(kThreads) void paged_attention_kernel(PagedAttentionParams p, AttentionLaunch launch) {
  using T = Tiling<kPaddedHeadSize, kHeads>;
  __shared__ float shared[T::kSharedFloats];  // logits of a chunk, later the cross-wave partial sums
  __shared__ float head_max[kHeads];          // running maximum logit per head
  __shared__ float head_sum[kHeads];          // running sum of exponentials per head
  __shared__ float head_rescale[kHeads];      // factor on the accumulators when the maximum moved

  const int64_t row = blockIdx.x;
  const int kv_head = blockIdx.y / launch.head_tiles;
  const int group = p.num_heads / p.num_kv_heads;
  const int tile_first = (blockIdx.y % launch.head_tiles) * kHeads;
  const int heads = std::min(kHeads, group - tile_first);
  const int first_head = kv_head * group + tile_first;
  const int split = blockIdx.z;

  const RowKeys keys = row_keys(p, row);
  const int split_size = split_tokens(keys.end - keys.begin, launch.num_splits);
  const int split_begin = keys.begin + split * split_size;
  const int split_end = std::min(keys.end, split_begin + split_size);
  if (launch.num_splits > 1 && split_begin >= split_end) return;  // the merge never reads this split

  const int lane = threadIdx.x % kWaveSize;
  const int wave = threadIdx.x / kWaveSize;
  const int dim0 = (lane % T::kLanesPerToken) * kDimsPerLane;
  const bool has_dims = dim0 < p.head_size;  // head sizes below kPaddedHeadSize idle some lanes
  const int slot = wave * T::kTokensPerWave + lane / T::kLanesPerToken;  // this lane's key within a step
  const int32_t* block_table = p.block_tables + keys.seq * p.block_table_stride;

  // Register arrays are indexed only by unrolled loops over kHeads (a runtime index would spill them).
  float q[kHeads][kDimsPerLane] = {};
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    if (h >= heads || !has_dims) continue;
    const auto* src = static_cast<const typename Q::Storage*>(p.query) + row * p.query_token_stride +
                      (first_head + h) * p.query_head_stride + dim0;
    for (int i = 0; i < kDimsPerLane; ++i) q[h][i] = Q::to_float(src[i]);
  }
  // A row's lanes hold consecutive dims, its first lane a multiple of kLanesPerToken >= rotation / 8.
  const int rotation = p.transform.hadamard ? hadamard_block(p.head_size) : 0;
  if (rotation > 0) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      hadamard_across_lanes(q[h], rotation);
      for (int i = 0; i < kDimsPerLane; ++i) q[h][i] *= hadamard_norm(rotation);
    }
  }
  // The logits' offset under a soft cap: softmax_scale * (q' . k_offset) of the head whose logits this
  // lane writes (reduce_heads gives a lane the same head for every key).
  float logit_offset = 0.0f;
  if (p.logits_soft_cap > 0.0f && p.transform.k_offset != nullptr) {
    const float* k_offset = p.transform.k_offset + static_cast<int64_t>(kv_head) * p.head_size + dim0;
    float partial[kHeads];
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      partial[h] = 0.0f;
      if (!has_dims) continue;
      for (int i = 0; i < kDimsPerLane; ++i) partial[h] += q[h][i] * k_offset[i];
    }
    bool leader = false;
    reduce_heads<kHeads, T::kLanesPerToken>(partial, lane, &leader);
    logit_offset = p.softmax_scale * partial[0];
  }
  if (threadIdx.x < kHeads) {
    head_max[threadIdx.x] = -INFINITY;
    head_sum[threadIdx.x] = 0.0f;
  }

  const LaneCacheRows<Cache> key_rows(p.key_cache, kv_head, dim0);
  const LaneCacheRows<Cache> value_rows(p.value_cache, kv_head, dim0);
  const float logit_scale = p.softmax_scale * *p.k_scale.at(kv_head) * Cache::kUnpackScale;
  float* logits = shared;  // [kHeads][kChunkTokens]
  float acc[kHeads][kDimsPerLane] = {};

  for (int chunk_begin = split_begin; chunk_begin < split_end; chunk_begin += kChunkTokens) {
    const int chunk_end = std::min(split_end, chunk_begin + kChunkTokens);

    // Logits of the chunk's keys for every head of the tile.
    PagePosition at(chunk_begin + slot, p.block_size);
    for (int step = chunk_begin; step < chunk_end; step += T::kTokensPerStep, at.advance(T::kTokensPerStep, p.block_size)) {
      const int position = step + slot;
      const bool valid = position < chunk_end;
      float k[kDimsPerLane] = {};
      if (valid && has_dims) key_rows.load(block_table[at.index], at.offset, launch.aligned, k);
      float partial[kHeads];
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        partial[h] = 0.0f;
        for (int i = 0; i < kDimsPerLane; ++i) partial[h] += q[h][i] * k[i];
      }
      bool leader = false;
      const int h = reduce_heads<kHeads, T::kLanesPerToken>(partial, lane, &leader);
      if (valid && leader && h < heads) {
        float logit = partial[0] * logit_scale;
        if (p.logits_soft_cap > 0.0f) logit = p.logits_soft_cap * tanhf((logit + logit_offset) / p.logits_soft_cap);
        logits[h * kChunkTokens + position - chunk_begin] = logit;
      }
    }
    __syncthreads();

    // Online softmax, one wavefront per head: exponentials in place, running max and sum updated.
    const int count = chunk_end - chunk_begin;
    for (int h = wave; h < heads; h += kWaves) {
      float* row_logits = logits + h * kChunkTokens;
      float chunk_max = -INFINITY;
      for (int t = lane; t < count; t += kWaveSize) chunk_max = fmaxf(chunk_max, row_logits[t]);
      const float new_max = fmaxf(head_max[h], wave_max(chunk_max));
      float chunk_sum = 0.0f;
      for (int t = lane; t < count; t += kWaveSize) {
        const float e = expf(row_logits[t] - new_max);
        row_logits[t] = e;
        chunk_sum += e;
      }
      chunk_sum = wave_sum(chunk_sum);
      if (lane == 0) {
        const float rescale = expf(head_max[h] - new_max);  // 0 on the first chunk (exp(-inf))
        head_rescale[h] = rescale;
        head_sum[h] = head_sum[h] * rescale + chunk_sum;
        head_max[h] = new_max;
      }
    }
    __syncthreads();

    // P.V over the chunk's keys: only keys with a probability reach the accumulators.
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      for (int i = 0; i < kDimsPerLane; ++i) acc[h][i] *= h < heads ? head_rescale[h] : 0.0f;
    }
    at = PagePosition(chunk_begin + slot, p.block_size);
    for (int step = chunk_begin; step < chunk_end; step += T::kTokensPerStep, at.advance(T::kTokensPerStep, p.block_size)) {
      const int position = step + slot;
      if (position >= chunk_end || !has_dims) continue;
      float v[kDimsPerLane];
      value_rows.load(block_table[at.index], at.offset, launch.aligned, v);
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        if (h >= heads) continue;
        const float weight = logits[h * kChunkTokens + position - chunk_begin];
        for (int i = 0; i < kDimsPerLane; ++i) acc[h][i] += weight * v[i];
      }
    }
    __syncthreads();  // the next chunk overwrites the probabilities
  }

  // Sum the accumulators of the keys a step spreads over: across a wavefront's token slots, then
  // across wavefronts through LDS, one head at a time. Wavefront 0's first token slot ends with the totals.
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    for (int i = 0; i < kDimsPerLane; ++i) {
      for (int offset = T::kLanesPerToken; offset < kWaveSize; offset *= 2) acc[h][i] += __shfl_xor(acc[h][i], offset);
    }
  }
  const bool holds_total = wave == 0 && lane < T::kLanesPerToken && has_dims;
  float* wave_partials = shared;  // [kWaves - 1][kPaddedHeadSize]
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    if (h >= heads) continue;  // uniform across the workgroup, like the barriers below
    if (wave > 0 && lane < T::kLanesPerToken && has_dims) {
      for (int i = 0; i < kDimsPerLane; ++i) wave_partials[(wave - 1) * kPaddedHeadSize + dim0 + i] = acc[h][i];
    }
    __syncthreads();
    if (holds_total) {
      for (int w = 1; w < kWaves; ++w) {
        for (int i = 0; i < kDimsPerLane; ++i) acc[h][i] += wave_partials[(w - 1) * kPaddedHeadSize + dim0 + i];
      }
    }
    __syncthreads();
  }
  // Back to the original basis (the norm is in output_factor); wave 0's other lanes rotate copies.
  if (rotation > 0 && wave == 0) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (h < heads) hadamard_across_lanes(acc[h], rotation);
    }
  }
  if (!holds_total) return;

  if (launch.num_splits == 1) {
    const float out_scale = *p.v_scale.at(kv_head) * output_factor<Cache>(p);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
      if (h >= heads) continue;
      // A row that sees no keys (a decode row with seq_len 0: batch padding) outputs zeros.
      const float scale = head_sum[h] > 0.0f ? out_scale / head_sum[h] : 0.0f;
      auto* dst = static_cast<typename Q::Storage*>(p.out) + row * p.out_token_stride +
                  (first_head + h) * p.out_head_stride + dim0;
      for (int i = 0; i < kDimsPerLane; ++i) dst[i] = Q::from_float(acc[h][i] * scale);
    }
    return;
  }
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    if (h >= heads) continue;
    const int64_t index = (row * p.num_heads + first_head + h) * launch.num_splits + split;
    float* dst = launch.partial_out + index * p.head_size + dim0;
    for (int i = 0; i < kDimsPerLane; ++i) dst[i] = acc[h][i];
    if (lane == 0) launch.partial_stats[index] = make_float2(head_max[h], head_sum[h]);
  }
}

// The rotated recipe's logit offset of query row `row` at `head`, softmax_scale * (q' . k_offset), which
// the logits leave out without a soft cap (softmax ignores it) and the log-sum-exp must not: the query
// rotated in LDS by hadamard.h's butterflies, in fp32. Every thread of the workgroup (kMaxHeadSize)
// calls it and gets the value.
template <typename Q>
__device__ float query_offset_logit(const PagedAttentionParams& p, int64_t row, int head) {
  __shared__ float q[kMaxHeadSize];
  __shared__ float total;
  const int d = threadIdx.x;
  if (d < p.head_size) {
    q[d] = Q::to_float(static_cast<const typename Q::Storage*>(p.query)[row * p.query_token_stride +
                                                                        head * p.query_head_stride + d]);
  }
  __syncthreads();
  const int block = p.transform.hadamard ? hadamard_block(p.head_size) : 1;
  for (int h = 1; h < block; h *= 2) {
    if (d < p.head_size / 2) butterfly(q[d / h * 2 * h + d % h], q[d / h * 2 * h + d % h + h]);
    __syncthreads();
  }
  if (d == 0) {
    const float* offset = p.transform.k_offset + static_cast<int64_t>(head / (p.num_heads / p.num_kv_heads)) * p.head_size;
    float sum = 0.0f;
    for (int i = 0; i < p.head_size; ++i) sum += q[i] * offset[i];
    total = p.softmax_scale * (block > 1 ? sum * hadamard_norm(block) : sum);
  }
  __syncthreads();
  return total;
}

// Combines a row's splits per (row, query head): out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s,
// times v_scale and `factor` (output_factor of the cache's format); kLse: and M + log(sum_s e^(m_s - M)
// l_s) into launch.lse.
template <typename Q, bool kLse>
__global__ __launch_bounds__(kMaxHeadSize) void merge_splits_kernel(PagedAttentionParams p, AttentionLaunch launch,
                                                                    float factor) {
  const int64_t row = blockIdx.x;
  const int head = blockIdx.y;
  const int d = threadIdx.x;
  float offset = 0.0f;
  if constexpr (kLse) {
    if (p.logits_soft_cap <= 0.0f && p.transform.k_offset != nullptr) offset = query_offset_logit<Q>(p, row, head);
  }
  if (d >= p.head_size) return;
  const RowKeys keys = row_keys(p, row);
  const int count = keys.end - keys.begin;
  const int used = count == 0 ? 0 : (count + split_tokens(count, launch.num_splits) - 1) / split_tokens(count, launch.num_splits);
  const int64_t first = (row * p.num_heads + head) * launch.num_splits;

  float max_logit = -INFINITY;
  for (int s = 0; s < used; ++s) max_logit = fmaxf(max_logit, launch.partial_stats[first + s].x);
  float sum = 0.0f;
  float out = 0.0f;
  for (int s = 0; s < used; ++s) {
    const float2 stats = launch.partial_stats[first + s];
    const float weight = expf(stats.x - max_logit);
    sum += weight * stats.y;
    out += weight * launch.partial_out[(first + s) * p.head_size + d];
  }
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const float scale = sum > 0.0f ? *p.v_scale.at(kv_head) * factor / sum : 0.0f;
  auto* dst = static_cast<typename Q::Storage*>(p.out) + row * p.out_token_stride + head * p.out_head_stride;
  dst[d] = Q::from_float(out * scale);
  if constexpr (kLse) {
    if (d == 0) {
      static_cast<float*>(launch.lse.data)[launch.lse.offset(row, head)] =
          sum > 0.0f ? max_logit + logf(sum) + offset : -INFINITY;
    }
  }
}

int heads_per_tile(const PagedAttentionParams& p) {
  const int group = p.num_heads / p.num_kv_heads;
  return group == 1 ? 1 : group == 2 ? 2 : group <= 4 ? 4 : 8;
}

int head_tiles(const PagedAttentionParams& p) {
  return ceil_div(p.num_heads / p.num_kv_heads, heads_per_tile(p));
}

template <typename Q, typename Cache, int kPaddedHeadSize, int kHeads>
hipError_t launch_tiles(const PagedAttentionParams& p, const AttentionLaunch& launch, hipStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(p.num_query_tokens), p.num_kv_heads * launch.head_tiles, launch.num_splits);
  hipLaunchKernelGGL((paged_attention_kernel<Q, Cache, kPaddedHeadSize, kHeads>), grid, dim3(kThreads), 0, stream, p,
                     launch);
  hipError_t status = hipGetLastError();
  if (status != hipSuccess || launch.num_splits == 1) return status;
  const dim3 rows(static_cast<unsigned int>(p.num_query_tokens), p.num_heads);
  if (launch.lse.data == nullptr) {
    hipLaunchKernelGGL((merge_splits_kernel<Q, false>), rows, dim3(kMaxHeadSize), 0, stream, p, launch,
                       output_factor<Cache>(p));
  } else {
    hipLaunchKernelGGL((merge_splits_kernel<Q, true>), rows, dim3(kMaxHeadSize), 0, stream, p, launch,
                       output_factor<Cache>(p));
  }
  return hipGetLastError();
}

template <typename Q, typename Cache, int kPaddedHeadSize>
hipError_t launch_head_size(const PagedAttentionParams& p, const AttentionLaunch& launch, hipStream_t stream) {
  switch (heads_per_tile(p)) {
    case 1: return launch_tiles<Q, Cache, kPaddedHeadSize, 1>(p, launch, stream);
    case 2: return launch_tiles<Q, Cache, kPaddedHeadSize, 2>(p, launch, stream);
    case 4: return launch_tiles<Q, Cache, kPaddedHeadSize, 4>(p, launch, stream);
    default: return launch_tiles<Q, Cache, kPaddedHeadSize, 8>(p, launch, stream);
  }
}

template <typename Q, typename Cache>
hipError_t launch_cache(const PagedAttentionParams& p, const AttentionLaunch& launch, hipStream_t stream) {
  if (p.head_size <= 64) return launch_head_size<Q, Cache, 64>(p, launch, stream);
  if (p.head_size <= 128) return launch_head_size<Q, Cache, 128>(p, launch, stream);
  return launch_head_size<Q, Cache, 256>(p, launch, stream);
}

}  // namespace

}  // namespace fp8kv::hip

namespace fp8kv::gpu {

using namespace hip;  // the backend's pieces

std::string kernel_request(const std::string& name, int* request) {
  *request = 0;
  if (name.empty() || name == "auto") return "";
  return "`kernel` must be \"auto\" on HIP (one kernel runs every call), got \"" + name + "\"";
}

std::string plan_unsupported(const PagedAttentionParams& p, int request) {
  if (request != 0) return "`plan` names no kernel of this backend: make it with fp8kv.plan_paged_attention";
  if (p.head_size % kDimsPerLane != 0 || p.head_size > kMaxHeadSize) {
    return "head_size must be a multiple of 8 and at most 256, got " + std::to_string(p.head_size);
  }
  // HIP grid limits: blocks * threads below 2^32 along x, 65535 along y.
  if (p.num_query_tokens * kMaxHeadSize >= (int64_t{1} << 32)) return "num_query_tokens must be below 2^24";
  if (p.num_heads > kMaxGridY || static_cast<int64_t>(p.num_kv_heads) * head_tiles(p) > kMaxGridY) {
    return "too many heads for one grid (at most 65535 query heads)";
  }
  if (p.fp8_math) return "`fp8_math` needs the CUDA kernels on a compute capability 9.0 GPU";
  return "";
}

// The kernel reads any alignment (aligned chunks are a fast path it picks per call).
std::string paged_attention_unsupported(const PagedAttentionParams& p, int request) {
  return plan_unsupported(p, request);
}

Status plan_paged_attention(const PagedAttentionParams& p, bool lse, int request, AttentionPlan* plan) {
  *plan = AttentionPlan{};
  plan->request = request;
  int compute_units = 0;
  const hipError_t status = current_compute_units(&compute_units);
  if (status != hipSuccess) return status;
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t longest = p.sliding_window > 0 ? std::min<int64_t>(capacity, p.sliding_window) : capacity;
  const int64_t workgroups = std::max<int64_t>(1, p.num_query_tokens * p.num_kv_heads * head_tiles(p));
  const int64_t to_fill = ceil_div<int64_t>(static_cast<int64_t>(kWorkgroupsPerUnit) * compute_units, workgroups);
  const int64_t useful = ceil_div<int64_t>(longest, kMinSplitTokens);
  const int64_t splits = std::max<int64_t>(lse ? 2 : 1, std::min({to_fill, useful, static_cast<int64_t>(kMaxGridZ)}));
  plan->num_splits = static_cast<int>(splits);
  plan->workspace_bytes =
      splits == 1 ? 0 : p.num_query_tokens * p.num_heads * splits * (p.head_size + 2) * static_cast<int64_t>(sizeof(float));
  return hipSuccess;
}

// [workspace_bytes, request, kernel (0: the one kernel), num_splits].
std::vector<int64_t> plan_values(const AttentionPlan& plan) {
  return {plan.workspace_bytes, plan.request, 0, plan.num_splits};
}

Status paged_attention(const PagedAttentionParams& p, const RowsView& lse, const AttentionPlan& plan, void* workspace,
                       Stream stream) {
  if (p.num_query_tokens == 0) return hipSuccess;
  const int cache_bytes = dtype_bytes(p.cache_dtype);
  const int64_t partial_floats = p.num_query_tokens * p.num_heads * plan.num_splits * p.head_size;
  AttentionLaunch launch{};
  launch.num_splits = plan.num_splits;
  launch.head_tiles = head_tiles(p);
  launch.aligned =
      chunks_aligned(p.key_cache.data, cache_bytes, kDimsPerLane,
                     {p.key_cache.block_stride, p.key_cache.token_stride, p.key_cache.head_stride}) &&
      chunks_aligned(p.value_cache.data, cache_bytes, kDimsPerLane,
                     {p.value_cache.block_stride, p.value_cache.token_stride, p.value_cache.head_stride});
  launch.partial_out = static_cast<float*>(workspace);
  launch.partial_stats = reinterpret_cast<float2*>(launch.partial_out + partial_floats);
  launch.lse = lse;
  return dispatch<kQueryDTypes>(p.query_dtype, hipErrorInvalidValue, [&](auto query) {
    constexpr DType kQuery = decltype(query)::value;
    // An unquantized cache has the query's dtype.
    if (!is_fp8(p.cache_dtype)) return launch_cache<Element<kQuery>, CacheRow<kQuery>>(p, launch, stream);
    return dispatch<kFp8DTypes>(p.cache_dtype, hipErrorInvalidValue, [&](auto cache) {
      return launch_cache<Element<kQuery>, CacheRow<decltype(cache)::value>>(p, launch, stream);
    });
  });
}

}  // namespace fp8kv::gpu
