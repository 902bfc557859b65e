// CPU kernels. Each takes a validated operand description (kernel_params.h).
#pragma once

#include "../kernel_params.h"

namespace fp8kv::cpu {

void reshape_and_cache(const CacheWriteParams& p);
// lse.data: nullptr, or where each query row's log-sum-exp goes.
void paged_attention(const PagedAttentionParams& p, const RowsView& lse);
void merge_attention_states(const MergeStatesParams& p);
void kv_amax(const AmaxParams& p);

}  // namespace fp8kv::cpu
