// The merge of two attention states (merge_attention_states), framework-free: every backend weighs
// the two outputs the same way, in fp32.
#pragma once

#include <cmath>

#include "dispatch.h"

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

}  // namespace fp8kv
