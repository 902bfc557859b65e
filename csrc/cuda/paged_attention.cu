// CUDA paged attention, host side: split planning and dispatch to the per-format kernels.
#include <algorithm>
#include <cstdint>

#include "paged_attention_config.h"

namespace fp8kv::cuda {
namespace {

using namespace attention;

// Calls fn(CacheKind constant) for the params' cache dtype.
template <typename Fn>
cudaError_t with_cache_kind(DType cache_dtype, Fn&& fn) {
  switch (cache_dtype) {
    case DType::kFloat8E4M3FN: return fn(std::integral_constant<CacheKind, CacheKind::kE4M3FN>{});
    case DType::kFloat8E5M2: return fn(std::integral_constant<CacheKind, CacheKind::kE5M2>{});
    case DType::kFloat8E4M3FNUZ: return fn(std::integral_constant<CacheKind, CacheKind::kE4M3FNUZ>{});
    case DType::kFloat16: return fn(std::integral_constant<CacheKind, CacheKind::kFloat16>{});
    case DType::kBFloat16: return fn(std::integral_constant<CacheKind, CacheKind::kBFloat16>{});
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool paged_attention_supports_head_size(int head_size) {
  return head_size == 64 || head_size == 80 || head_size == 96 || head_size == 128 || head_size == 192 ||
         head_size == 256;
}

int64_t paged_attention_max_context(int block_size) {
  const int64_t tile_group = kTileTokens * kWarps;
  return kMaxSplits * ((static_cast<int64_t>(kMaxPages - 2) * block_size) / tile_group * tile_group);
}

cudaError_t plan_paged_attention(const PagedAttentionParams& p, int num_sms, AttentionPlan& plan) {
  int resident_per_sm = 0;
  const cudaError_t status = with_cache_kind(p.cache_dtype, [&](auto kind) {
    resident_per_sm = prepare<decltype(kind)::value>(p.head_size);
    return resident_per_sm > 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
  });
  if (status != cudaSuccess) return status;
  const int group = p.num_heads / p.num_kv_heads;
  const int head_chunks = (group + kRows - 1) / kRows;
  const int tokens_per_cta = group >= kRows ? 1 : kRows / group;
  plan.row_chunks = p.num_query_tokens * head_chunks;
  // CTAs with work: decode has one per sequence and head chunk, multi-token about one per
  // tokens_per_cta query tokens (the others exit at once).
  const int64_t busy_chunks = p.cu_seqlens_q == nullptr
                                  ? plan.row_chunks
                                  : (p.num_query_tokens + tokens_per_cta - 1) / tokens_per_cta * head_chunks + p.num_seqs;
  const int64_t busy_ctas = std::max<int64_t>(1, busy_chunks * p.num_kv_heads);
  const int64_t slots = static_cast<int64_t>(num_sms) * resident_per_sm;
  // Context known without a sync: the block table's capacity.
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  constexpr int64_t kMinSplitTokens = 512;  // several tiles per warp, so the pipeline fills
  const int64_t tile_group = kTileTokens * kWarps;
  const int64_t max_split_tokens = (static_cast<int64_t>(kMaxPages - 2) * p.block_size) / tile_group * tile_group;
  const int64_t min_splits = (capacity + max_split_tokens - 1) / max_split_tokens;
  if (min_splits > kMaxSplits) return cudaErrorInvalidValue;  // context beyond kMaxSplits * max_split_tokens
  const int64_t max_splits =
      std::max<int64_t>(min_splits, std::min<int64_t>(kMaxSplits, capacity / kMinSplitTokens));
  // Splits = waves of equal CTAs: pick the count (up to 4 waves' worth) whose last wave is fullest,
  // preferring fewer splits on ties.
  int64_t best = min_splits;
  double best_efficiency = 0.0;
  const int64_t first = std::min<int64_t>(max_splits, std::max<int64_t>(min_splits, slots / busy_ctas));
  for (int64_t splits = first; splits <= std::min<int64_t>(max_splits, 4 * first); ++splits) {
    const int64_t ctas = busy_ctas * splits;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double efficiency = static_cast<double>(ctas) / static_cast<double>(waves * slots);
    if (efficiency > best_efficiency + 0.02) best = splits, best_efficiency = efficiency;
  }
  int64_t split_tokens = (capacity + best - 1) / best;
  split_tokens = (split_tokens + tile_group - 1) / tile_group * tile_group;
  plan.split_tokens = static_cast<int>(std::min<int64_t>(split_tokens, INT32_MAX));
  plan.num_splits = static_cast<int>(std::max<int64_t>(1, (capacity + split_tokens - 1) / split_tokens));
  return cudaSuccess;
}

cudaError_t launch_paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, SplitWorkspace ws,
                                   cudaStream_t stream) {
  return with_cache_kind(p.cache_dtype, [&](auto kind) { return launch<decltype(kind)::value>(p, plan, ws, stream); });
}

}  // namespace fp8kv::cuda
