// CPU merge of two attention states (merge_states.h), one (token, head) row at a time.
#include <ATen/Parallel.h>

#include "../float_conversions.h"
#include "../merge_states.h"
#include "dtype_dispatch.h"
#include "kernels.h"

namespace fp8kv::cpu {

void merge_attention_states(const MergeStatesParams& p) {
  const int64_t rows = p.num_tokens * p.num_heads;
  dispatch_source_dtype(p.dtype, [&](auto type) {
    using T = Element<decltype(type)::value>;
    using Storage = typename T::Storage;
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t token = row / p.num_heads;
        const int head = static_cast<int>(row % p.num_heads);
        const MergeWeights w = merge_weights(static_cast<const float*>(p.lse_a.data)[p.lse_a.offset(token, head)],
                                             static_cast<const float*>(p.lse_b.data)[p.lse_b.offset(token, head)]);
        const auto* a = static_cast<const Storage*>(p.out_a.data) + p.out_a.offset(token, head);
        const auto* b = static_cast<const Storage*>(p.out_b.data) + p.out_b.offset(token, head);
        auto* out = static_cast<Storage*>(p.out.data) + p.out.offset(token, head);
        for (int d = 0; d < p.head_size; ++d) out[d] = T::from_float(merged(w, T::to_float(a[d]), T::to_float(b[d])));
        if (p.lse.data != nullptr) static_cast<float*>(p.lse.data)[p.lse.offset(token, head)] = w.lse;
      }
    });
  });
}

}  // namespace fp8kv::cpu
