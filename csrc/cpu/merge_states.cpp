// CPU merge of two attention states (merge_states.h), one (token, head) row at a time.
#include <ATen/Parallel.h>

#include "../float_conversions.h"
#include "../merge_states.h"
#include "dtype_dispatch.h"
#include "kernels.h"

namespace fp8kv::cpu {

void merge_attention_states(const MergeStatesParams& p) {
  dispatch_source_dtype(p.dtype, [&](auto type) {
    at::parallel_for(0, p.num_tokens * p.num_heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) merge_row<Element<decltype(type)::value>>(p, row, 0, 1);
    });
  });
}

}  // namespace fp8kv::cpu
