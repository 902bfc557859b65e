// What every CUDA attention kernel does around its main loop, the same way: fold the scales, keep
// the online softmax, load query fragments, and write each (query row, head)'s result (the
// epilogue), either normalized into `out` or as its split's partial result for the merge (merge.cu).
#pragma once

#include "device.cuh"
#include "hadamard.cuh"
#include "tiles.h"

namespace fp8kv::cuda {

// Multiplier of a raw q.k giving the base-2 logit: softmax scale, k_scale (FP8 caches only; an
// unquantized cache holds the values themselves) and the FP8 decode factor folded into one
// number; log2(e) too unless a soft cap applies it after tanh (see soft_capped).
template <DType C>
__device__ __forceinline__ float logit_multiplier(const PagedAttentionParams& p, int kv_head) {
  float m = p.softmax_scale;
  if constexpr (CacheTraits<C>::kIsFp8) m *= *p.k_scale.at(kv_head) * fp8_decode_factor<C>();
  return p.logits_soft_cap > 0.f ? m : m * kLog2e;
}

// A logit scaled by logit_multiplier, soft-capped (cap > 0) and in base 2. `offset`: what the rotated
// recipe's K offset took from the row's logits (softmax alone would not notice), added back before
// the cap; -0.f (an exact no-op) for the other recipes.
__device__ __forceinline__ float soft_capped(float x, float cap, float offset = -0.f) {
  return cap > 0.f ? cap * tanhf((x + offset) * (1.f / cap)) * kLog2e : x;
}

// Factor of the normalized accumulator giving the output: v_scale and the FP8 decode factor, and the
// rotation's norm for the rotated recipe (the kernels rotate the output back unnormalized).
template <DType C, int D>
__device__ __forceinline__ float output_scale(const PagedAttentionParams& p, int kv_head) {
  if constexpr (CacheTraits<C>::kIsFp8) {
    const float scale = *p.v_scale.at(kv_head) * fp8_decode_factor<C>();
    return p.transform.hadamard ? scale * hadamard_norm(hadamard_block(D)) : scale;
  }
  return 1.f;
}

// The rotated recipe's logit offset of a query row: softmax_scale * (q' . k_offset[kv_head]) from the
// lane's rotated elements q_rot[i] (dims dim(i)), summed over the row's lanes (`row_lanes`: the lane
// masks that reach them); -0.f unless a soft cap needs it (see soft_capped).
template <int kValues, int kRowLanes, typename Dim>
__device__ __forceinline__ float logit_offset(const PagedAttentionParams& p, int kv_head, const float (&q_rot)[kValues],
                                              Dim&& dim, const int (&row_lanes)[kRowLanes]) {
  if (!(p.logits_soft_cap > 0.f && p.transform.k_offset != nullptr)) return -0.f;
  const float* offset = p.transform.k_offset + static_cast<int64_t>(kv_head) * p.head_size;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kValues; ++i) sum += q_rot[i] * __ldg(offset + dim(i));
#pragma unroll
  for (int l = 0; l < kRowLanes; ++l) sum += __shfl_xor_sync(0xffffffffu, sum, row_lanes[l]);
  return p.softmax_scale * sum;
}

// A lane's share of the online softmax of its two rows (columns of S^T in the decode kernel): kTiles
// mma accumulator fragments of the unnormalized output, and per row the running max of the log2-domain
// logits (uniform across the row's lanes) and the lane's share of the denominator. Starts with no key
// seen: zero accumulators, max -inf, sum 0.
template <int kTiles>
struct OnlineSoftmax {
  float acc[kTiles][4];
  float row_max[2];
  float row_sum[2];

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int j = 0; j < kTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Lazy rescale (kRescaleSlack): row r's running max moves only when a tile's max exceeds this.
  __device__ __forceinline__ float rescale_threshold(int r) const { return row_max[r] + kRescaleSlack; }

  // Moves row r's running max to new_max; `factor`: what its sum took, and its accumulators must
  // take (0 when the old max is -inf).
  __device__ __forceinline__ void move_max(int r, float new_max, float& factor) {
    factor = fast_exp2(row_max[r] - new_max);
    row_sum[r] *= factor;
    row_max[r] = new_max;
  }
};

// One (query row, head)'s query: pair(dim) packs elements dim and dim + 1 as an mma operand register
// of the kernel's math type (kBf16: bf16, else fp16); 0 for a padding row (query_row < 0). The query's
// own dtype (`bf16`, also the output's) is chosen at run time: it is touched once per CTA.
// pair(dim) = operand(bits(dim)); a kernel may issue all its bits() loads before anything else that
// waits on memory and convert them later. Every load is unconditional (a padding row reads row 0,
// head 0, which every call has): a load under a branch was issued only after the previous one
// returned.
template <bool kBf16>
struct QueryRow {
  const uint8_t* data;
  bool valid;
  bool bf16;

  QueryRow() = default;  // set before use
  __device__ __forceinline__ QueryRow(const PagedAttentionParams& p, int64_t query_row, int head, bool query_bf16)
      : data(static_cast<const uint8_t*>(p.query) +
             (query_row >= 0 ? (query_row * p.query_token_stride + static_cast<int64_t>(head) * p.query_head_stride) * 2
                             : 0)),
        valid(query_row >= 0),
        bf16(query_bf16) {}

  __device__ __forceinline__ uint32_t bits(int dim) const { return *reinterpret_cast<const uint32_t*>(data + dim * 2); }

  __device__ __forceinline__ uint32_t operand(uint32_t pair_bits) const {
    const float2 x = pair_as_float2(pair_bits, bf16);
    return valid ? pack_pair<kBf16>(x.x, x.y) : 0u;
  }

  __device__ __forceinline__ uint32_t pair(int dim) const { return operand(bits(dim)); }
};

// The epilogue: where one (query row, head)'s result goes. With one split, into `out` (bf16 or fp16),
// normalized by the softmax denominator `sum` and scaled by v_scale (zeros when no key was visible);
// with several, scaled by v_scale into the split's partial results with the row's max and sum (the
// merge is then a plain log-sum-exp over splits). write_row stores a row's pairs from one row base
// (pairs(store) calls store(d, o0, o1) for each pair of dims d, d + 1); write_pair stores one pair
// (two forms, as the kernels' address arithmetic differs: folding one into the other changes the
// generated code of the kernel that loses its own).
__device__ __forceinline__ float output_norm(float v_scale, float sum) { return sum > 0.f ? v_scale / sum : 0.f; }

__device__ __forceinline__ int64_t partial_slot(const PagedAttentionParams& p, const SplitWorkspace& ws, int split,
                                                int64_t query_row, int head) {
  return static_cast<int64_t>(split) * ws.rows + query_row * static_cast<int64_t>(p.num_heads) + head;
}

template <int D, typename Pairs>
__device__ __forceinline__ void write_row(const PagedAttentionParams& p, const SplitWorkspace& ws, int split,
                                          int64_t query_row, int head, bool bf16, float v_scale, float row_max,
                                          float sum, bool writes_stats, Pairs&& pairs) {
  if (ws.num_splits == 1) {
    const float norm = output_norm(v_scale, sum);
    auto* out = static_cast<uint8_t*>(p.out) +
                (query_row * p.out_token_stride + static_cast<int64_t>(head) * p.out_head_stride) * 2;
    pairs([&](int d, float o0, float o1) { store_pair_from_float2(out + d * 2, o0 * norm, o1 * norm, bf16); });
  } else {
    const int64_t slot = partial_slot(p, ws, split, query_row, head);
    pairs([&](int d, float o0, float o1) {
      *reinterpret_cast<float2*>(ws.acc + slot * D + d) = make_float2(o0 * v_scale, o1 * v_scale);
    });
    if (writes_stats) ws.row_max[slot] = row_max, ws.row_sum[slot] = sum;
  }
}

template <int D>
__device__ __forceinline__ void write_pair(const PagedAttentionParams& p, const SplitWorkspace& ws, int split,
                                           int64_t query_row, int head, bool bf16, float v_scale, float row_max,
                                           float sum, int d, float o0, float o1) {
  if (ws.num_splits == 1) {
    const float norm = output_norm(v_scale, sum);
    auto* out = static_cast<uint8_t*>(p.out) +
                (query_row * p.out_token_stride + static_cast<int64_t>(head) * p.out_head_stride + d) * 2;
    store_pair_from_float2(out, o0 * norm, o1 * norm, bf16);
  } else {
    const int64_t slot = partial_slot(p, ws, split, query_row, head);
    *reinterpret_cast<float2*>(ws.acc + slot * D + d) = make_float2(o0 * v_scale, o1 * v_scale);
    if (d == 0) ws.row_max[slot] = row_max, ws.row_sum[slot] = sum;
  }
}

}  // namespace fp8kv::cuda
