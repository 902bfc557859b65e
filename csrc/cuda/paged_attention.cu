// CUDA paged attention, host side: what the kernels support, split planning (from shapes and the
// device's occupancy), workspace carving and dispatch to the per-format decode (decode.cuh) and
// multi-token (prefill.cuh) kernels.
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "launch.h"

namespace fp8kv::cuda {
namespace {

// Decode: positions of one split, at most: the block-table slice a CTA stages, in whole tile groups.
int64_t decode_max_split_tokens(int block_size) {
  return (static_cast<int64_t>(decode::kMaxPages - 2) * block_size) / decode::kTileGroup * decode::kTileGroup;
}

int64_t max_context(int block_size) { return merge::kMaxSplits * decode_max_split_tokens(block_size); }

bool nothing_to_do(const PagedAttentionParams& p) { return p.num_query_tokens == 0 || p.num_seqs == 0; }

// The staging copies 16-byte vectors and addresses within a block with 32-bit arithmetic.
bool cache_staging_safe(const CacheView& cache, int64_t element_bytes) {
  bool ok = reinterpret_cast<uintptr_t>(cache.data) % 16 == 0;
  for (int64_t stride : {cache.block_stride, cache.token_stride, cache.head_stride}) {
    ok = ok && (stride * element_bytes) % 16 == 0 && stride * element_bytes < INT32_MAX;
  }
  return ok;
}

// Queries are read and outputs written as pairs of 16-bit elements.
bool pairs_aligned(const void* data, int64_t token_stride, int64_t head_stride) {
  return reinterpret_cast<uintptr_t>(data) % 4 == 0 && token_stride % 2 == 0 && head_stride % 2 == 0;
}

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

// CTA slots of the current device for a kernel with `resident_per_sm` CTAs per SM (0 on error).
int64_t cta_slots(int resident_per_sm) {
  int device = 0, sms = 0;
  if (resident_per_sm <= 0 || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return static_cast<int64_t>(sms) * resident_per_sm;
}

// Decode: persistent CTAs taking work items (sequence and query-head chunk, split, KV head); splits
// bring the items to about kItemsPerSm per SM.
cudaError_t plan_decode(const PagedAttentionParams& p, AttentionPlan& plan) {
  const int64_t target_items = cta_slots(decode::kItemsPerSm);
  if (target_items == 0) return cudaErrorInvalidConfiguration;
  const int group = p.num_heads / p.num_kv_heads;
  plan.row_chunks = p.num_query_tokens * ((group + decode::kRows - 1) / decode::kRows);
  const int64_t row_items = std::max<int64_t>(1, plan.row_chunks * p.num_kv_heads);  // items per split
  // Context known without a sync: the block table's capacity.
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t max_split_tokens = decode_max_split_tokens(p.block_size);
  const int64_t min_splits = (capacity + max_split_tokens - 1) / max_split_tokens;
  if (min_splits > merge::kMaxSplits) return cudaErrorInvalidValue;  // refused by paged_attention_unsupported
  const int64_t max_splits =
      std::max<int64_t>(min_splits, std::min<int64_t>(merge::kMaxSplits, capacity / kMinSplitTokens));
  const int64_t splits = (target_items + row_items / 2) / row_items;  // nearest
  set_splits(capacity, std::clamp(splits, min_splits, max_splits), decode::kTileGroup, plan);
  if (plan.row_chunks * plan.num_splits * p.num_kv_heads > INT32_MAX) return cudaErrorInvalidValue;
  const int resident = dispatch<kAttentionCacheDTypes>(p.cache_dtype, 0, [&](auto cache) {
    return decode::resident_ctas<decltype(cache)::value>(plan, p.head_size, p.block_size);
  });
  plan.ctas = cta_slots(std::min(resident, decode::kCtasPerSm));
  return plan.ctas == 0 ? cudaErrorInvalidConfiguration : cudaSuccess;
}

// The sm_90a multi-token kernel runs p: its head size, a compute capability 9.0 device, a build with
// sm_90a code.
bool sm90a_kernel_runs(const PagedAttentionParams& p) {
#ifdef FP8KV_SM90A
  int device = 0, major = 0, minor = 0;
  return contains(prefill::hopper::kHeadSizes, p.head_size) && cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess && major == 9 &&
         minor == 0;
#else
  return false;
#endif
}

// Multi-token: one CTA per (query tile of one sequence, split, KV head and head chunk). The tile
// count is bounded from host shapes (each sequence wastes at most one partial tile); CTAs past the
// real count exit at once.
cudaError_t plan_prefill(const PagedAttentionParams& p, AttentionPlan& plan) {
  const int group = p.num_heads / p.num_kv_heads;
  plan.deep_staging = prefill::use_deep_staging(p.num_query_tokens, group, p.num_seqs);
  // Short queries stay on the sm80 kernel: they are bound by memory, and it shares their few rows
  // among its warps. (paged_attention_unsupported has refused a request that cannot be met.)
  switch (gpu::requested_multi_token_kernel()) {
    case gpu::MultiTokenKernel::kSm80: plan.warp_specialized = false; break;
    case gpu::MultiTokenKernel::kSm90a: plan.warp_specialized = true; break;
    default: plan.warp_specialized = !plan.deep_staging && sm90a_kernel_runs(p);
  }
  const int64_t slots = cta_slots(dispatch<kAttentionCacheDTypes>(p.cache_dtype, 0, [&](auto cache) {
    return prefill::resident_ctas<decltype(cache)::value>(p.head_size, plan.deep_staging, plan.warp_specialized);
  }));
  if (slots == 0) return cudaErrorInvalidConfiguration;
  const prefill::RowMap map =
      prefill::RowMap::make(group, plan.warp_specialized ? prefill::hopper::kRows : prefill::kRows);
  const int64_t packed_tiles = (p.num_query_tokens + map.tokens_per_tile - 1) / map.tokens_per_tile;
  plan.row_chunks = packed_tiles + p.num_seqs;
  if (plan.row_chunks > INT32_MAX) return cudaErrorInvalidValue;
  const int64_t busy_ctas =
      std::max<int64_t>(packed_tiles, p.num_seqs) * map.head_chunks * p.num_kv_heads;  // at least this many
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  // Splitting pays when few query rows read a long cache (verification, decode-heavy batches); it
  // costs a partial-result round trip per row, so keep that below 1/16 of the cache bytes read.
  const int64_t partial_bytes = 2 * p.num_query_tokens * p.num_heads * (p.head_size + 2) * 4;
  const int64_t cache_bytes =
      2 * static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * capacity * p.head_size * dtype_bytes(p.cache_dtype);
  const int64_t max_splits = std::max<int64_t>(1, std::min({static_cast<int64_t>(merge::kMaxSplits),
                                                             capacity / kMinSplitTokens, cache_bytes / 16 / partial_bytes}));
  set_splits(capacity, choose_splits(busy_ctas, slots, 1, max_splits), prefill::kSplitAlign, plan);
  return cudaSuccess;
}

// Bytes of the splits' partial results in the workspace (0 with one split); the decode kernel's work
// queue counter follows them.
int64_t partials_bytes(const PagedAttentionParams& p, const AttentionPlan& plan) {
  if (plan.num_splits == 1) return 0;
  return plan.num_splits * p.num_query_tokens * p.num_heads * (p.head_size + 2) * static_cast<int64_t>(sizeof(float));
}

}  // namespace

int resident_ctas(const void* kernel, int threads, int max_smem_bytes, int smem_bytes) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  // Kernel attributes are per device: a process that uses several GPUs sets them on each.
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> resident;  // (kernel, device, smem) -> CTAs per SM
  const std::lock_guard<std::mutex> lock(mutex);
  const auto known = resident.find({kernel, device, smem_bytes});
  if (known != resident.end()) return known->second;
  int ctas = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem_bytes) != cudaSuccess) {
    return 0;
  }
  resident.emplace(std::make_tuple(kernel, device, smem_bytes), ctas);
  return ctas;
}

}  // namespace fp8kv::cuda

namespace fp8kv::gpu {

using namespace cuda;  // the backend's pieces

std::string paged_attention_unsupported(const PagedAttentionParams& p) {
  // The split planner sizes splits from the table's capacity, which must not be 0.
  if (p.max_blocks_per_seq < 1) return "`block_tables` must have at least one column, got 0";
  if (!contains(kCudaHeadSizes, p.head_size)) {
    return "head_size must be one of " + format_list(kCudaHeadSizes) + ", got " + std::to_string(p.head_size);
  }
  if (!contains(kCudaBlockSizes, p.block_size)) {
    return "block_size (`key_cache` dim 1) must be one of " + format_list(kCudaBlockSizes) + ", got " +
           std::to_string(p.block_size);
  }
  const int64_t capacity = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  if (capacity > max_context(p.block_size)) {
    return "`block_tables` capacity (max_blocks_per_seq * block_size = " + std::to_string(capacity) +
           ") must be at most " + std::to_string(max_context(p.block_size)) + " for block_size " +
           std::to_string(p.block_size);
  }
  const int64_t cache_bytes = dtype_bytes(p.cache_dtype);
  for (const auto& [name, cache] : {std::pair{"key_cache", p.key_cache}, std::pair{"value_cache", p.value_cache}}) {
    if (!cache_staging_safe(cache, cache_bytes)) {
      return std::string("`") + name + "` must start on a 16-byte boundary and have strides that are multiples of "
             "16 bytes and below 2^31 bytes (true for NHD, HND and interleaved K/V allocations)";
    }
  }
  if (!pairs_aligned(p.query, p.query_token_stride, p.query_head_stride)) {
    return "`query` rows must start on 4-byte boundaries";
  }
  if (!pairs_aligned(p.out, p.out_token_stride, p.out_head_stride)) return "`out` rows must start on 4-byte boundaries";
  if (p.cu_seqlens_q != nullptr) {
    const MultiTokenKernel kernel = requested_multi_token_kernel();
    if (kernel == MultiTokenKernel::kUnknown) {
      return std::string("environment variable ") + kMultiTokenKernelVariable +
             " must be unset, empty, \"auto\", \"sm80\" or \"sm90a\", got \"" + std::getenv(kMultiTokenKernelVariable) +
             "\"";
    }
    if (kernel == MultiTokenKernel::kSm90a && !sm90a_kernel_runs(p)) {
      return std::string(kMultiTokenKernelVariable) + "=sm90a needs fp8kv built with sm_90a code, a compute "
             "capability 9.0 device and head_size one of " + format_list(prefill::hopper::kHeadSizes) + " (got " +
             std::to_string(p.head_size) + ")";
    }
  }
  return "";
}

cudaError_t plan_paged_attention(const PagedAttentionParams& p, AttentionPlan* plan) {
  *plan = AttentionPlan{1, 0, 0, 0, false, 0, false};
  if (nothing_to_do(p)) return cudaSuccess;
  const cudaError_t status = p.cu_seqlens_q == nullptr ? plan_decode(p, *plan) : plan_prefill(p, *plan);
  plan->workspace_bytes = partials_bytes(p, *plan) + (p.cu_seqlens_q == nullptr ? sizeof(int) : 0);
  return status;
}

cudaError_t paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan, void* workspace,
                            cudaStream_t stream) {
  if (nothing_to_do(p)) return cudaSuccess;
  SplitWorkspace ws{};
  ws.rows = p.num_query_tokens * p.num_heads;
  ws.num_splits = plan.num_splits;
  if (plan.num_splits > 1) {
    ws.acc = static_cast<float*>(workspace);
    ws.row_max = ws.acc + plan.num_splits * ws.rows * p.head_size;
    ws.row_sum = ws.row_max + plan.num_splits * ws.rows;
  }
  int* taken = reinterpret_cast<int*>(static_cast<uint8_t*>(workspace) + partials_bytes(p, plan));
  return dispatch<kAttentionCacheDTypes>(p.cache_dtype, cudaErrorInvalidValue, [&](auto cache) {
    constexpr DType kCache = decltype(cache)::value;
    return p.cu_seqlens_q == nullptr ? decode::launch<kCache>(p, plan, ws, taken, stream)
                                     : prefill::launch<kCache>(p, plan, ws, stream);
  });
}

}  // namespace fp8kv::gpu
