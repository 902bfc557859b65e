// CPU calibration reduction: fold max(|x|) of K and V into running maxima, per tensor or per KV head.
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>

#include "../float_conversions.h"
#include "dtype_dispatch.h"
#include "kernels.h"

namespace fp8kv::cpu {
namespace {

template <DType Src>
float head_amax(const void* base, int64_t token_stride, int64_t head_stride, int64_t num_tokens, int head,
                int head_size) {
  const auto* data = static_cast<const typename Element<Src>::Storage*>(base);
  float amax = 0.0f;
  int64_t nan_count = 0;  // counted apart: a vectorized max reduction need not propagate NaN
  for (int64_t t = 0; t < num_tokens; ++t) {
    const auto* row = data + t * token_stride + head * head_stride;
    float row_max = 0.0f;
#pragma omp simd reduction(max : row_max) reduction(+ : nan_count)
    for (int d = 0; d < head_size; ++d) {
      const float x = std::fabs(Element<Src>::to_float(row[d]));
      nan_count += x != x;
      row_max = x > row_max ? x : row_max;
    }
    amax = row_max > amax ? row_max : amax;
  }
  return nan_count > 0 ? std::numeric_limits<float>::quiet_NaN() : amax;
}

void fold(const HeadScalars& running, const std::vector<float>& per_head) {
  if (running.per_head) {
    for (size_t h = 0; h < per_head.size(); ++h) running.data[h] = nan_max(running.data[h], per_head[h]);
  } else {
    float amax = 0.0f;
    for (float x : per_head) amax = nan_max(amax, x);
    running.data[0] = nan_max(running.data[0], amax);
  }
}

}  // namespace

void kv_amax(const AmaxParams& p) {
  if (p.num_tokens == 0) return;
  const int heads = p.num_kv_heads;
  std::vector<float> key_heads(heads), value_heads(heads);
  dispatch_source_dtype(p.src_dtype, [&](auto src) {
    constexpr DType Src = decltype(src)::value;
    // Items 0..heads-1 reduce K heads, heads..2*heads-1 reduce V heads.
    at::parallel_for(0, 2 * heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const bool is_key = i < heads;
        const int h = static_cast<int>(is_key ? i : i - heads);
        if (is_key) {
          key_heads[h] = head_amax<Src>(p.key, p.key_token_stride, p.key_head_stride, p.num_tokens, h, p.head_size);
        } else {
          value_heads[h] =
              head_amax<Src>(p.value, p.value_token_stride, p.value_head_stride, p.num_tokens, h, p.head_size);
        }
      }
    });
  });
  fold(p.k_amax, key_heads);
  fold(p.v_amax, value_heads);
}

}  // namespace fp8kv::cpu
