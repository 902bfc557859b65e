// CUDA registrations: validate (shared checks plus what these kernels require), allocate the
// split workspace through PyTorch's allocator, launch on the current stream. No host sync unless
// FP8KV_DEBUG_CHECKS is set.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../op_params.h"
#include "launchers.h"

namespace fp8kv {
namespace {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

int multiprocessor_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(status));
}

// The attention kernels stage 16-byte vectors and address within a block with 32-bit arithmetic.
void check_cache_strides(const char* op, const char* name, const void* ptr, std::initializer_list<int64_t> strides,
                         int64_t element_bytes) {
  bool aligned = reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  bool small = true;
  for (int64_t s : strides) aligned = aligned && (s * element_bytes) % 16 == 0, small = small && s * element_bytes < INT32_MAX;
  TORCH_CHECK(aligned, op, ": on CUDA, `", name, "` must start on a 16-byte boundary and have strides that are ",
              "multiples of 16 bytes (true for NHD, HND and interleaved K/V allocations)");
  TORCH_CHECK(small, op, ": on CUDA, `", name, "` strides must be below 2^31 bytes");
}

void reshape_and_cache_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                            at::Tensor& value_cache, const at::Tensor& slot_mapping, const at::Tensor& k_scale,
                            const at::Tensor& v_scale) {
  const CacheWriteParams p = cache_write_params(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  if (debug_checks_enabled()) check_slot_mapping_indices(slot_mapping, key_cache.size(0) * key_cache.size(1));
  const c10::cuda::CUDAGuard guard(key.device());
  check_launch(cuda::launch_reshape_and_cache(p, current_stream()), "fp8kv.reshape_and_cache");
}

void paged_attention_cuda(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const std::optional<at::Tensor>& cu_seqlens_q, double softmax_scale,
                          const at::Tensor& k_scale, const at::Tensor& v_scale, int64_t sliding_window,
                          double logits_soft_cap) {
  constexpr const char* op = "fp8kv.paged_attention";
  const PagedAttentionParams p = paged_attention_params(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                        cu_seqlens_q, softmax_scale, k_scale, v_scale, sliding_window,
                                                        logits_soft_cap);
  TORCH_CHECK(cuda::paged_attention_supports_head_size(p.head_size), op,
              ": on CUDA, head_size must be one of 64, 80, 96, 128, 192, 256, got ", p.head_size);
  TORCH_CHECK(p.block_size >= 8 && p.block_size <= 256 && (p.block_size & (p.block_size - 1)) == 0, op,
              ": on CUDA, block_size (`key_cache` dim 1) must be a power of two in [8, 256], got ", p.block_size);
  const int64_t capacity = block_tables.size(1) * key_cache.size(1);
  TORCH_CHECK(capacity <= cuda::paged_attention_max_context(p.block_size), op, ": on CUDA, `block_tables` capacity ",
              "(max_blocks_per_seq * block_size = ", capacity, ") must be at most ",
              cuda::paged_attention_max_context(p.block_size), " for block_size ", p.block_size);
  const int64_t cache_bytes = key_cache.element_size();
  check_cache_strides(op, "key_cache", p.key_cache.data, {p.key_cache.block_stride, p.key_cache.token_stride,
                p.key_cache.head_stride}, cache_bytes);
  check_cache_strides(op, "value_cache", p.value_cache.data, {p.value_cache.block_stride, p.value_cache.token_stride,
                p.value_cache.head_stride}, cache_bytes);
  // Queries are read and outputs written as pairs of 16-bit elements.
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p.query) % 4 == 0 && p.query_token_stride % 2 == 0 &&
                  p.query_head_stride % 2 == 0, op, ": on CUDA, `query` rows must start on 4-byte boundaries");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p.out) % 4 == 0 && p.out_token_stride % 2 == 0 &&
                  p.out_head_stride % 2 == 0, op, ": on CUDA, `out` rows must start on 4-byte boundaries");
  if (debug_checks_enabled()) {
    check_paged_attention_indices(block_tables, seq_lens, cu_seqlens_q, query.size(0), key_cache.size(1),
                                  key_cache.size(0), sliding_window);
  }
  if (p.num_query_tokens == 0 || p.num_seqs == 0) return;

  const c10::cuda::CUDAGuard guard(query.device());
  cuda::AttentionPlan plan{};
  check_launch(cuda::plan_paged_attention(p, multiprocessor_count(query.get_device()), plan), op);
  cuda::SplitWorkspace ws{};
  ws.rows = p.num_query_tokens * p.num_heads;
  ws.num_splits = plan.num_splits;
  at::Tensor workspace;
  if (plan.num_splits > 1) {
    const int64_t per_split = ws.rows * (p.head_size + 2);
    workspace = at::empty({plan.num_splits * per_split}, query.options().dtype(at::kFloat));
    ws.acc = workspace.data_ptr<float>();
    ws.row_max = ws.acc + plan.num_splits * ws.rows * p.head_size;
    ws.row_sum = ws.row_max + plan.num_splits * ws.rows;
  }
  check_launch(cuda::launch_paged_attention(p, plan, ws, current_stream()), op);
}

void kv_amax_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_amax, at::Tensor& v_amax) {
  const AmaxParams p = amax_params(key, value, k_amax, v_amax);
  const c10::cuda::CUDAGuard guard(key.device());
  check_launch(cuda::launch_kv_amax(p, current_stream()), "fp8kv.kv_amax");
}

}  // namespace

TORCH_LIBRARY_IMPL(fp8kv, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cuda);
  m.impl("paged_attention", &paged_attention_cuda);
  m.impl("kv_amax", &kv_amax_cuda);
}

}  // namespace fp8kv
