// How the CUDA paged-attention kernels run a call: which kernel, which staging, how many context
// splits. Every such choice is made here, on the host, from the call's sizes and the device's facts
// (never device data, so a captured graph replays it unchanged); paged_attention.cu gathers the facts
// (the device, the kernels' occupancy) and fills the plan from these answers. The kernels' geometry
// is tiles.h's; the measurements behind the choices: docs/cuda_decode_design.md,
// docs/cuda_prefill_design.md.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>

#include "../gpu/kernels.h"
#include "tiles.h"

namespace fp8kv::cuda {

// What the planner knows of the current device.
struct DeviceFacts {
  int multiprocessors;
  int major, minor;  // compute capability
};

// ---- which kernel, which staging ------------------------------------------------------------

// The kernel a plan forces (kernel_request's codes, the names "auto", "sm80", "sm90a", "decode"): none
// (the planner's choice) or one of the three that run multi-token queries.
enum class MultiTokenRequest { kAuto, kSm80, kSm90a, kDecode };
inline constexpr const char* kMultiTokenRequestNames[] = {"auto", "sm80", "sm90a", "decode"};

// The sm_90a multi-token kernel runs head_size on the device: one of its head sizes, the compute
// capability its code is for, and a build with that code.
inline bool sm90a_kernel_runs(int head_size, const DeviceFacts& device) {
#ifdef FP8KV_SM90A
  return contains(kCudaSm90aHeadSizes, head_size) && device.major == kCudaSm90aCapability[0] &&
         device.minor == kCudaSm90aCapability[1];
#else
  return false;
#endif
}

// The sm_90a kernel's FP8-math variant runs p on the device.
inline bool sm90a_fp8_math_runs(const PagedAttentionParams& p, const DeviceFacts& device) {
  return sm90a_kernel_runs(p.head_size, device) && contains(kCudaSm90aFp8MathHeadSizes, p.head_size) &&
         contains(kCudaFp8MathDTypes, p.cache_dtype);
}

// Short queries (verification, decode rows in a batch): the average sequence's query rows fit one warp.
inline bool short_queries(const PagedAttentionParams& p) {
  const int group = p.num_heads / p.num_kv_heads;
  return p.num_query_tokens * group <= multi_token::kWarpRows * static_cast<int64_t>(p.num_seqs);
}

// The sm80 kernel's staging (tiles.h): deep for short queries, which leave it bound by memory (deep
// staging keeps more bytes in flight), shallow otherwise (it keeps the tensor cores fed).
inline bool deep_staging(const PagedAttentionParams& p) { return short_queries(p); }

// Multi-token calls the decode kernel can take: its CTAs stage a table of the sequences (at most
// kMaxTableSeqs) and count rows in int.
inline bool decode_takes_queries(const PagedAttentionParams& p) {
  return p.num_seqs <= decode::kMaxTableSeqs && p.num_query_tokens * p.num_heads <= INT32_MAX;
}

// The multi-token kernel that runs p where the decode kernel does not: the sm_90a kernel in p's math
// where it runs (with fp8_math it does: plan_unsupported checked), else the sm80 kernel.
inline AttentionKernel multi_token_kernel(const PagedAttentionParams& p, const DeviceFacts& device) {
  if (p.fp8_math) return AttentionKernel::kMultiTokenSm90aFp8Math;
  return sm90a_kernel_runs(p.head_size, device) ? AttentionKernel::kMultiTokenSm90a : AttentionKernel::kMultiTokenSm80;
}

// The kernel for p: the one `request` names (checked by plan_unsupported: it runs p), else the
// planner's choice. Short queries (verification, decode-heavy batches) are bound by memory: they go to
// the decode kernel, whose items then take all of a sequence's draft rows (up to 16 at head size
// <= 128), so each page is streamed once at the decode kernel's bandwidth (cuda_prefill_design.md,
// "Short queries on the decode kernel"); it keeps 16-bit math, fp8_math or not (FP8 math would cost
// accuracy and save no time there). `decode_fits`: the decode kernel's staging for p fits the
// device's shared memory (not so at head size 192 with 16-bit caches on GPUs of 99 KiB per CTA);
// where it does not, short queries take a multi-token kernel.
inline AttentionKernel attention_kernel(const PagedAttentionParams& p, MultiTokenRequest request,
                                        const DeviceFacts& device, bool decode_fits) {
  if (p.cu_seqlens_q == nullptr) return AttentionKernel::kDecode;
  switch (request) {
    case MultiTokenRequest::kSm80: return AttentionKernel::kMultiTokenSm80;
    case MultiTokenRequest::kSm90a:
      return p.fp8_math ? AttentionKernel::kMultiTokenSm90aFp8Math : AttentionKernel::kMultiTokenSm90a;
    case MultiTokenRequest::kDecode: return AttentionKernel::kDecode;
    case MultiTokenRequest::kAuto: break;
  }
  // Short queries of more sequences than the decode kernel takes: a multi-token kernel (the sm80 one
  // shares their few rows among its warps).
  if (short_queries(p) && decode_takes_queries(p) && decode_fits) return AttentionKernel::kDecode;
  if (short_queries(p) && !p.fp8_math) return AttentionKernel::kMultiTokenSm80;
  return multi_token_kernel(p, device);
}

// ---- how many splits ------------------------------------------------------------------------

// Splitting a short context costs more in the merge than it gains: several tiles per warp per split.
inline constexpr int64_t kMinSplitTokens = 512;

struct Splits {
  int count;   // num_splits
  int tokens;  // split_tokens
};

// `count` splits of `capacity` positions, each a multiple of `align` (fewer where rounding up leaves
// the last ones empty).
inline Splits even_splits(int64_t capacity, int64_t count, int64_t align) {
  int64_t tokens = (capacity + count - 1) / count;
  tokens = (tokens + align - 1) / align * align;
  return {static_cast<int>(std::max<int64_t>(1, (capacity + tokens - 1) / tokens)),
          static_cast<int>(std::min<int64_t>(tokens, INT32_MAX))};
}

// A call that writes the log-sum-exp gets it from the split merge (merge.cu, from the splits' maxima
// and sums), so it has at least two splits: one split becomes two halves of it (the second may be
// empty, which the kernels and the merge handle as any split without keys).
inline Splits at_least_two(const Splits& splits, int64_t align) {
  if (splits.count > 1) return splits;
  return {2, static_cast<int>((splits.tokens / 2 + align - 1) / align * align)};
}

// Splits = waves of equal CTAs: of the counts in [min_splits, max_splits] up to 4 waves' worth, the
// one whose last wave is fullest, preferring fewer splits on ties. `slots`: resident CTAs on the device.
inline int64_t fullest_last_wave(int64_t busy_ctas, int64_t slots, int64_t min_splits, int64_t max_splits) {
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

inline int64_t table_capacity(const PagedAttentionParams& p) {
  return static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
}

// Decode: persistent CTAs take work items (a sequence's query-head chunk at one KV head over one
// split) until none is left, requesting the next item's block table and first tiles before they merge
// the current one, so the per-item ramp is paid once per CTA. Four per SM (at most what fits) were
// faster than two, and than one CTA per item (cuda_decode_design.md, "The persistent grid").
inline constexpr int kDecodeCtasPerSm = 4;
// Splits are sized for about this many work items per SM: each split adds a partial result to merge,
// and finer items did not shorten the uneven finish (cuda_decode_design.md, "Split sizing").
inline constexpr int kDecodeItemsPerSm = 2;

// The decode kernel's column tiles per item: two where the average sequence has more rows (query
// tokens x the KV head's query heads) than one tile holds and the head size allows, else one.
inline int decode_column_tiles(const PagedAttentionParams& p) {
  const int group = p.num_heads / p.num_kv_heads;
  const bool wide = p.cu_seqlens_q != nullptr && p.num_query_tokens * group > decode::kRows * int64_t{p.num_seqs};
  return wide ? decode::max_column_tiles(p.head_size) : 1;
}

// The decode kernel's row chunks (work items per split and KV head): per sequence, its rows at one KV
// head in chunks of the item's columns. Decode: exact. Multi-token queries: the lengths are on the
// device, so as many as the rows fill, at least one per sequence (what the splits are planned for);
// decode_row_chunk_bound is what the grid is sized for.
inline int64_t decode_row_chunks(const PagedAttentionParams& p) {
  const int64_t columns = int64_t{decode::kRows} * decode_column_tiles(p);
  const int group = p.num_heads / p.num_kv_heads;
  if (p.cu_seqlens_q == nullptr) return p.num_query_tokens * ((group + columns - 1) / columns);
  return std::max<int64_t>(p.num_seqs, (p.num_query_tokens * group + columns - 1) / columns);
}

// At most ceil(q_len * group / columns) per sequence: below rows / columns + 1 each.
inline int64_t decode_row_chunk_bound(const PagedAttentionParams& p) {
  if (p.cu_seqlens_q == nullptr) return decode_row_chunks(p);
  const int64_t columns = int64_t{decode::kRows} * decode_column_tiles(p);
  return p.num_query_tokens * (p.num_heads / p.num_kv_heads) / columns + p.num_seqs;
}

// A decode CTA keeps one tile per warp in flight (K and V rows); the grid streams near the read
// bandwidth only with about kDecodeBytesInFlight in flight in all (the bandwidth times a loaded
// round trip of about a microsecond). SmolLM2-135M at B64 (3 KV heads of head size 64) kept 1.5 MiB
// in flight with FP8 rows and read at 67% of the bandwidth, 3 MiB with bf16 rows and read at 86%
// (cuda_decode_design.md, "Split sizing"). On an H200 (1.4x the bandwidth, the same SMs) 3 MiB was
// again the fastest of 1.5 to 12 MiB on every decode shape, or within 0.5% of it
// (docs/benchmarks_h200.md).
inline constexpr int64_t kDecodeBytesInFlight = int64_t{3} << 20;

inline int64_t decode_cta_bytes_in_flight(const PagedAttentionParams& p) {
  return int64_t{decode::kWarps} * (decode::kMaxStages - 1) * decode::kTileTokens * 2 * p.head_size *
         dtype_bytes(p.cache_dtype);
}

// The split counts a decode plan may take over the block table's capacity (the context known without a
// sync): at least what the block-table slices need, at most what the merge takes and kMinSplitTokens
// allows (never below the least). `least` above merge::kMaxSplits: the table cannot be planned.
struct SplitBounds {
  int64_t least, most;
};

inline SplitBounds decode_split_bounds(const PagedAttentionParams& p) {
  const int64_t capacity = table_capacity(p);
  const int64_t max_split_tokens = decode::max_split_tokens(p.block_size);
  const int64_t least = (capacity + max_split_tokens - 1) / max_split_tokens;
  return {least, std::max<int64_t>(least, std::min<int64_t>(merge::kMaxSplits, capacity / kMinSplitTokens))};
}

// Decode's splits: the count nearest kDecodeItemsPerSm items per SM, raised where that keeps less
// than kDecodeBytesInFlight in flight (as far as the items stay one wave of kDecodeCtasPerSm CTAs
// per SM), within decode_split_bounds. None when the table needs more splits than the merge takes
// (refused by plan_unsupported).
inline std::optional<Splits> decode_splits(const PagedAttentionParams& p, const DeviceFacts& device) {
  const int64_t target_items = static_cast<int64_t>(device.multiprocessors) * kDecodeItemsPerSm;
  const int64_t row_items = std::max<int64_t>(1, decode_row_chunks(p) * p.num_kv_heads);  // items per split
  const SplitBounds bounds = decode_split_bounds(p);
  if (bounds.least > merge::kMaxSplits) return std::nullopt;
  const int64_t nearest = (target_items + row_items / 2) / row_items;
  const int64_t split_bytes = row_items * decode_cta_bytes_in_flight(p);  // in flight per split
  const int64_t splits_in_one_wave = static_cast<int64_t>(device.multiprocessors) * kDecodeCtasPerSm / row_items;
  const int64_t in_flight = std::min((kDecodeBytesInFlight + split_bytes - 1) / split_bytes, splits_in_one_wave);
  return even_splits(table_capacity(p), std::clamp(std::max(nearest, in_flight), bounds.least, bounds.most),
                     decode::kTileGroup);
}

// Decode's persistent CTAs: kDecodeCtasPerSm per SM, at most the `resident` that fit.
inline int64_t decode_ctas(int resident, const DeviceFacts& device) {
  return resident <= 0 ? 0 : static_cast<int64_t>(device.multiprocessors) * std::min(resident, kDecodeCtasPerSm);
}

// Multi-token: one CTA per (query tile of one sequence, split, KV head and head chunk). The tile count
// is bounded from host shapes (each sequence wastes at most one partial tile); CTAs past the real
// count exit at once.
struct MultiTokenGrid {
  int64_t query_tiles;  // grid.x
  int64_t busy_ctas;    // CTAs per split with work, at least
};

inline MultiTokenGrid multi_token_grid(const PagedAttentionParams& p, AttentionKernel kernel) {
  const bool sm90a = kernel == AttentionKernel::kMultiTokenSm90a || kernel == AttentionKernel::kMultiTokenSm90aFp8Math;
  const multi_token::RowMap map =
      multi_token::RowMap::make(p.num_heads / p.num_kv_heads, sm90a ? multi_token::sm90a::kRows : multi_token::sm80::kRows);
  const int64_t packed_tiles = (p.num_query_tokens + map.tokens_per_tile - 1) / map.tokens_per_tile;
  return {packed_tiles + p.num_seqs, std::max<int64_t>(packed_tiles, p.num_seqs) * map.head_chunks * p.num_kv_heads};
}

// Multi-token splits: splitting pays when few query rows read a long cache (verification,
// decode-heavy batches); it costs a partial-result round trip per row, so that stays below 1/16 of
// the cache bytes read. `slots`: the kernel's resident CTAs on the device.
inline Splits multi_token_splits(const PagedAttentionParams& p, const MultiTokenGrid& grid, int64_t slots) {
  const int64_t capacity = table_capacity(p);
  const int64_t partial_bytes = 2 * p.num_query_tokens * p.num_heads * (p.head_size + 2) * 4;
  const int64_t cache_bytes =
      2 * static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * capacity * p.head_size * dtype_bytes(p.cache_dtype);
  const int64_t max_splits = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(merge::kMaxSplits), capacity / kMinSplitTokens, cache_bytes / 16 / partial_bytes}));
  return even_splits(capacity, fullest_last_wave(grid.busy_ctas, slots, 1, max_splits), multi_token::kSplitAlign);
}

}  // namespace fp8kv::cuda
