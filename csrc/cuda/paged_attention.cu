// CUDA paged attention, host side: what the kernels support, the plan (heuristics.h's answers for the
// current device and the kernels' occupancy), workspace carving and dispatch to the per-format kernels.
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "heuristics.h"
#include "launch.h"

namespace fp8kv::cuda {
namespace {

int64_t max_context(int block_size) { return merge::kMaxSplits * decode::max_split_tokens(block_size); }

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

// The current device's facts, read once per device (nullptr on error).
const DeviceFacts* current_device() {
  constexpr int kMaxDevices = 64;
  static std::once_flag read[kMaxDevices];
  static DeviceFacts facts[kMaxDevices];
  static bool valid[kMaxDevices];
  int id = 0;
  if (cudaGetDevice(&id) != cudaSuccess || id < 0 || id >= kMaxDevices) return nullptr;
  std::call_once(read[id], [id] {
    DeviceFacts& device = facts[id];
    valid[id] = cudaDeviceGetAttribute(&device.multiprocessors, cudaDevAttrMultiProcessorCount, id) == cudaSuccess &&
                cudaDeviceGetAttribute(&device.major, cudaDevAttrComputeCapabilityMajor, id) == cudaSuccess &&
                cudaDeviceGetAttribute(&device.minor, cudaDevAttrComputeCapabilityMinor, id) == cudaSuccess;
  });
  return valid[id] ? &facts[id] : nullptr;
}

cudaError_t plan_decode(const PagedAttentionParams& p, bool lse, const DeviceFacts& device, AttentionPlan& plan) {
  plan.kernel = AttentionKernel::kDecode;
  plan.column_tiles = decode_column_tiles(p);
  plan.row_chunks = decode_row_chunk_bound(p);
  plan.sequence_table_bytes = p.cu_seqlens_q == nullptr ? 0 : decode::sequence_table_bytes(p.num_seqs);
  std::optional<Splits> splits = decode_splits(p, device);
  if (!splits) return cudaErrorInvalidValue;  // refused by plan_unsupported
  if (lse) splits = at_least_two(*splits, decode::kTileGroup);
  plan.num_splits = splits->count, plan.split_tokens = splits->tokens;
  if (plan.row_chunks * plan.num_splits * p.num_kv_heads > INT32_MAX) return cudaErrorInvalidValue;
  const int resident = dispatch<kAttentionCacheDTypes>(p.cache_dtype, 0, [&](auto cache) {
    return decode::occupancy<decltype(cache)::value>(plan, p.head_size, p.block_size);
  });
  plan.ctas = decode_ctas(resident, device);
  return plan.ctas == 0 ? cudaErrorInvalidConfiguration : cudaSuccess;
}

cudaError_t plan_multi_token(const PagedAttentionParams& p, bool lse, const DeviceFacts& device, AttentionPlan& plan) {
  plan.deep_staging = deep_staging(p);
  const int resident = dispatch<kAttentionCacheDTypes>(p.cache_dtype, 0, [&](auto cache) {
    constexpr DType kCache = decltype(cache)::value;
    switch (plan.kernel) {
      case AttentionKernel::kMultiTokenSm90a: return multi_token::sm90a::occupancy<kCache>(p.head_size, false);
      case AttentionKernel::kMultiTokenSm90aFp8Math: return multi_token::sm90a::occupancy<kCache>(p.head_size, true);
      default: return multi_token::sm80::occupancy<kCache>(p.head_size, plan.deep_staging);
    }
  });
  if (resident <= 0) return cudaErrorInvalidConfiguration;
  const MultiTokenGrid grid = multi_token_grid(p, plan.kernel);
  plan.query_tiles = grid.query_tiles;
  if (plan.query_tiles > INT32_MAX) return cudaErrorInvalidValue;
  Splits splits = multi_token_splits(p, grid, static_cast<int64_t>(device.multiprocessors) * resident);
  if (lse) splits = at_least_two(splits, multi_token::kSplitAlign);
  plan.num_splits = splits.count, plan.split_tokens = splits.tokens;
  return cudaSuccess;
}

// Bytes of the splits' partial results in the workspace (0 with one split); the decode kernel's work
// queue counter follows them.
int64_t partials_bytes(const PagedAttentionParams& p, const AttentionPlan& plan) {
  if (plan.num_splits == 1) return 0;
  return plan.num_splits * p.num_query_tokens * p.num_heads * (p.head_size + 2) * static_cast<int64_t>(sizeof(float));
}

}  // namespace

int kernel_occupancy(const void* kernel, int threads, int max_smem_bytes, int smem_bytes) {
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

std::string kernel_request(const std::string& name, int* request) {
  const std::string chosen = name.empty() ? "auto" : name;
  for (int code = 0; code < static_cast<int>(std::size(kMultiTokenRequestNames)); ++code) {
    if (chosen == kMultiTokenRequestNames[code]) {
      *request = code;
      return "";
    }
  }
  return "`kernel` must be \"auto\", \"sm80\", \"sm90a\" or \"decode\" on CUDA, got \"" + name + "\"";
}

std::string plan_unsupported(const PagedAttentionParams& p, int request) {
  if (request < 0 || request >= static_cast<int>(std::size(kMultiTokenRequestNames))) {
    return "`plan` names no kernel of this backend: make it with fp8kv.plan_paged_attention";
  }
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
  const std::string forced = std::string("`kernel`=\"") + kMultiTokenRequestNames[request] + "\"";
  switch (static_cast<MultiTokenRequest>(request)) {
    case MultiTokenRequest::kAuto: break;
    case MultiTokenRequest::kDecode:
      if (p.cu_seqlens_q != nullptr && !decode_takes_queries(p)) {
        return forced + " takes at most " + std::to_string(decode::kMaxTableSeqs) +
               " sequences and num_query_tokens * num_heads below 2^31, got " + std::to_string(p.num_seqs) +
               " sequences and " + std::to_string(p.num_query_tokens * p.num_heads);
      }
      if (p.fp8_math) return forced + " names a kernel without FP8 math: plan with \"auto\" or \"sm90a\" to run `fp8_math`";
      break;
    case MultiTokenRequest::kSm80:
    case MultiTokenRequest::kSm90a: {
      if (p.cu_seqlens_q == nullptr) {
        return forced + " runs multi-token queries; a decode call (no `cu_seqlens_q`) runs the decode kernel";
      }
      if (p.fp8_math && request == static_cast<int>(MultiTokenRequest::kSm80)) {
        return forced + " names a kernel without FP8 math: plan with \"auto\" or \"sm90a\" to run `fp8_math`";
      }
      const DeviceFacts* device = current_device();
      if (request == static_cast<int>(MultiTokenRequest::kSm90a) && !(device && sm90a_kernel_runs(p.head_size, *device))) {
        return forced + " needs fp8kv built with sm_90a code, a compute capability " +
               std::to_string(kCudaSm90aCapability[0]) + "." + std::to_string(kCudaSm90aCapability[1]) +
               " device and head_size one of " + format_list(kCudaSm90aHeadSizes) + " (got " +
               std::to_string(p.head_size) + ")";
      }
      break;
    }
  }
  if (p.fp8_math) {
    const DeviceFacts* device = current_device();
    if (!(device && sm90a_fp8_math_runs(p, *device))) {
      return "`fp8_math` needs fp8kv built with sm_90a code, a compute capability " +
             std::to_string(kCudaSm90aCapability[0]) + "." + std::to_string(kCudaSm90aCapability[1]) +
             " device and head_size one of " + format_list(kCudaSm90aFp8MathHeadSizes) + " (got " +
             std::to_string(p.head_size) + ")";
    }
  }
  return "";
}

std::string paged_attention_unsupported(const PagedAttentionParams& p, int request) {
  const std::string unplanned = plan_unsupported(p, request);
  if (!unplanned.empty()) return unplanned;
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
  return "";
}

cudaError_t plan_paged_attention(const PagedAttentionParams& p, bool lse, int request, AttentionPlan* plan) {
  *plan = AttentionPlan{};
  plan->num_splits = 1;
  plan->request = request;
  if (nothing_to_do(p)) return cudaSuccess;
  const DeviceFacts* device = current_device();
  if (device == nullptr) return cudaErrorInvalidConfiguration;
  const auto forced = static_cast<MultiTokenRequest>(request);
  // The decode kernel's plan where it may take p: whether its staging fits is part of the choice.
  AttentionPlan decode = *plan;
  const bool decode_may_run = p.cu_seqlens_q == nullptr || forced == MultiTokenRequest::kDecode ||
                              (forced == MultiTokenRequest::kAuto && short_queries(p) && decode_takes_queries(p));
  const cudaError_t decode_status = decode_may_run ? plan_decode(p, lse, *device, decode) : cudaErrorInvalidConfiguration;
  const AttentionKernel kernel = attention_kernel(p, forced, *device, decode_status == cudaSuccess);
  cudaError_t status = decode_status;
  if (kernel == AttentionKernel::kDecode) {
    *plan = decode;
  } else {
    plan->kernel = kernel;
    status = plan_multi_token(p, lse, *device, *plan);
  }
  plan->workspace_bytes = partials_bytes(p, *plan) + (plan->kernel == AttentionKernel::kDecode ? sizeof(int) : 0);
  return status;
}

std::vector<int64_t> plan_values(const AttentionPlan& plan) {
  return {plan.workspace_bytes, plan.request, static_cast<int64_t>(plan.kernel), plan.num_splits, plan.split_tokens,
          plan.deep_staging, plan.row_chunks, plan.column_tiles, plan.sequence_table_bytes, plan.ctas,
          plan.query_tiles};
}

cudaError_t paged_attention(const PagedAttentionParams& p, const RowsView& lse, const AttentionPlan& plan,
                            void* workspace, cudaStream_t stream) {
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
  const cudaError_t status = dispatch<kAttentionCacheDTypes>(p.cache_dtype, cudaErrorInvalidValue, [&](auto cache) {
    constexpr DType kCache = decltype(cache)::value;
    switch (plan.kernel) {
      case AttentionKernel::kDecode: return decode::launch<kCache>(p, plan, ws, taken, stream);
      case AttentionKernel::kMultiTokenSm80: return multi_token::sm80::launch<kCache>(p, plan, ws, stream);
      case AttentionKernel::kMultiTokenSm90a:
      case AttentionKernel::kMultiTokenSm90aFp8Math: return multi_token::sm90a::launch<kCache>(p, plan, ws, stream);
    }
    return cudaErrorInvalidValue;
  });
  if (status != cudaSuccess || plan.num_splits == 1) return status;
  const float shift = plan.kernel == AttentionKernel::kMultiTokenSm90aFp8Math
                          ? multi_token::sm90a::fp8_math::kProbabilityShift : 0.f;
  return merge::launch(p, ws, merge::LseOutput{lse, shift}, stream);
}

}  // namespace fp8kv::gpu
