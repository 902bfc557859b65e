// The merge of two attention states (merge_attention_states), framework-free: every backend merges
// its rows with merge_row, in fp32.
#pragma once

#include <cmath>

#include "dispatch.h"
#include "kernel_params.h"

namespace fp8kv {

// States (out_a, lse_a) and (out_b, lse_b) of one query row over disjoint key sets: out = a * out_a +
// b * out_b, their log-sum-exp `lse`. A state with lse -inf (no keys) gets weight 0 and its output is
// never read (see merged); with both -inf the row merges to zeros and -inf, as paged_attention leaves
// a row without keys. A NaN log-sum-exp makes the row NaN.
struct MergeWeights {
  float a, b, lse;
};

FP8KV_HOST_DEVICE MergeWeights merge_weights(float lse_a, float lse_b) {
  const float m = fmaxf(lse_a, lse_b);
  if (m == -INFINITY) return {0.f, 0.f, -INFINITY};
  const float ea = expf(lse_a - m), eb = expf(lse_b - m);  // the larger one is 1
  const float sum = ea + eb;
  return {ea / sum, eb / sum, m + logf(sum)};
}

// One merged element: a state of weight 0 does not enter (its output may be anything, even NaN).
FP8KV_HOST_DEVICE float merged(const MergeWeights& w, float x_a, float x_b) {
  return (w.a != 0.f ? w.a * x_a : 0.f) + (w.b != 0.f ? w.b * x_b : 0.f);
}

// Merges row `row` (token * num_heads + head) of p: elements first, first + step, ... (a backend's
// lanes share a row), the log-sum-exp by the lane of element 0. E: the Element of p.dtype.
template <typename E>
FP8KV_HOST_DEVICE void merge_row(const MergeStatesParams& p, int64_t row, int first, int step) {
  using Storage = typename E::Storage;
  const int64_t token = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  const MergeWeights w = merge_weights(static_cast<const float*>(p.lse_a.data)[p.lse_a.offset(token, head)],
                                       static_cast<const float*>(p.lse_b.data)[p.lse_b.offset(token, head)]);
  const auto* a = static_cast<const Storage*>(p.out_a.data) + p.out_a.offset(token, head);
  const auto* b = static_cast<const Storage*>(p.out_b.data) + p.out_b.offset(token, head);
  auto* out = static_cast<Storage*>(p.out.data) + p.out.offset(token, head);
  for (int d = first; d < p.head_size; d += step) out[d] = E::from_float(merged(w, E::to_float(a[d]), E::to_float(b[d])));
  if (first == 0 && p.lse.data != nullptr) static_cast<float*>(p.lse.data)[p.lse.offset(token, head)] = w.lse;
}

}  // namespace fp8kv
