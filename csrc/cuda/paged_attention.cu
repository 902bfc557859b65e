// CUDA paged attention, host side: split planning and dispatch to the per-format decode and
// multi-token kernels.
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

namespace {

constexpr int64_t kMinSplitTokens = 512;  // several tiles per warp, so the pipeline fills

// Splits = waves of equal CTAs: of the counts in [min_splits, max_splits] up to 4 waves' worth,
// the one whose last wave is fullest, preferring fewer splits on ties.
int64_t choose_splits(int64_t busy_ctas, int64_t slots, int64_t min_splits, int64_t max_splits) {
  int64_t best = min_splits;
  double best_efficiency = 0.0;
  const int64_t first = std::min<int64_t>(max_splits, std::max<int64_t>(min_splits, slots / busy_ctas));
  for (int64_t splits = first; splits <= std::min<int64_t>(max_splits, 4 * first); ++splits) {
    const int64_t ctas = busy_ctas * splits;
    const int64_t waves = (ctas + slots - 1) / slots;
    const double efficiency = static_cast<double>(ctas) / static_cast<double>(waves * slots);
    if (efficiency > best_efficiency + 0.02) best = splits, best_efficiency = efficiency;
  }
  return best;
}

void set_splits(int64_t capacity, int64_t splits, int64_t align, AttentionPlan& plan) {
  int64_t split_tokens = (capacity + splits - 1) / splits;
  split_tokens = (split_tokens + align - 1) / align * align;
  plan.split_tokens = static_cast<int>(std::min<int64_t>(split_tokens, INT32_MAX));
  plan.num_splits = static_cast<int>(std::max<int64_t>(1, (capacity + split_tokens - 1) / split_tokens));
}

// Decode: one CTA per (sequence, query-head chunk, split, KV head).
cudaError_t plan_decode(const PagedAttentionParams& p, int num_sms, AttentionPlan& plan) {
  int resident_per_sm = 0;
  const cudaError_t status = with_cache_kind(p.cache_dtype, [&](auto kind) {
    resident_per_sm = prepare<decltype(kind)::value>(p.head_size);
    return resident_per_sm > 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
  });
  if (status != cudaSuccess) return status;
  const int group = p.num_heads / p.num_kv_heads;
  plan.row_chunks = p.num_query_tokens * ((group + kRows - 1) / kRows);
  const int64_t busy_ctas = std::max<int64_t>(1, plan.row_chunks * p.num_kv_heads);
  const int64_t slots = static_cast<int64_t>(num_sms) * resident_per_sm;
  // Context known without a sync: the block table's capacity.
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t tile_group = kTileTokens * kWarps;
  const int64_t max_split_tokens = (static_cast<int64_t>(kMaxPages - 2) * p.block_size) / tile_group * tile_group;
  const int64_t min_splits = (capacity + max_split_tokens - 1) / max_split_tokens;
  if (min_splits > kMaxSplits) return cudaErrorInvalidValue;  // context beyond kMaxSplits * max_split_tokens
  const int64_t max_splits =
      std::max<int64_t>(min_splits, std::min<int64_t>(kMaxSplits, capacity / kMinSplitTokens));
  set_splits(capacity, choose_splits(busy_ctas, slots, min_splits, max_splits), tile_group, plan);
  return cudaSuccess;
}

// Multi-token: one CTA per (query tile of one sequence, split, KV head and head chunk). The tile
// count is bounded from host shapes (each sequence wastes at most one partial tile); CTAs past the
// real count exit at once.
cudaError_t plan_prefill(const PagedAttentionParams& p, int num_sms, AttentionPlan& plan) {
  const int group = p.num_heads / p.num_kv_heads;
  plan.deep_staging = prefill::use_deep_staging(p.num_query_tokens, group, p.num_seqs);
  int resident_per_sm = 0;
  const cudaError_t status = with_cache_kind(p.cache_dtype, [&](auto kind) {
    resident_per_sm = prefill::prepare<decltype(kind)::value>(p.head_size, plan.deep_staging);
    return resident_per_sm > 0 ? cudaSuccess : cudaErrorInvalidConfiguration;
  });
  if (status != cudaSuccess) return status;
  const prefill::RowMap map = prefill::RowMap::make(group);
  const int64_t packed_tiles = (p.num_query_tokens + map.tokens_per_tile - 1) / map.tokens_per_tile;
  plan.row_chunks = packed_tiles + p.num_seqs;
  if (plan.row_chunks > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t busy_ctas =
      std::max<int64_t>(packed_tiles, p.num_seqs) * map.head_chunks * p.num_kv_heads;  // at least this many
  const int64_t slots = static_cast<int64_t>(num_sms) * resident_per_sm;
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  // Splitting pays when few query rows read a long cache (verification, decode-heavy batches); it
  // costs a partial-result round trip per row, so keep that below 1/16 of the cache bytes read.
  const int64_t partial_bytes = 2 * p.num_query_tokens * p.num_heads * (p.head_size + 2) * 4;
  const int64_t cache_bytes =
      2 * static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * capacity * p.head_size * dtype_bytes(p.cache_dtype);
  const int64_t max_splits = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(kMaxSplits), capacity / kMinSplitTokens, cache_bytes / 16 / partial_bytes}));
  set_splits(capacity, choose_splits(busy_ctas, slots, 1, max_splits), prefill::kSplitAlign, plan);
  return cudaSuccess;
}

}  // namespace

cudaError_t plan_paged_attention(const PagedAttentionParams& p, int num_sms, AttentionPlan& plan) {
  return p.cu_seqlens_q == nullptr ? plan_decode(p, num_sms, plan) : plan_prefill(p, num_sms, plan);
}

cudaError_t launch_paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, SplitWorkspace ws,
                                   cudaStream_t stream) {
  return with_cache_kind(p.cache_dtype, [&](auto kind) {
    constexpr CacheKind kKind = decltype(kind)::value;
    return p.cu_seqlens_q == nullptr ? launch<kKind>(p, plan, ws, stream) : prefill::launch<kKind>(p, plan, ws, stream);
  });
}

}  // namespace fp8kv::cuda
