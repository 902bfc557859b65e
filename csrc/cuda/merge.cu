// The split-KV merge shared by the decode and multi-token kernels: combines each (query row, head)'s
// per-split partial results (attention_io.cuh's write_row) with log-sum-exp weights in fp32, and,
// for a call that asks for it, writes the row's log-sum-exp.
#include "../hadamard.h"
#include "device.cuh"
#include "launch.h"

namespace fp8kv::cuda::merge {
namespace {

// Splits whose partial outputs a thread group loads before the weights are known, so that those
// loads' round trip overlaps the maxima's and sums' (the splits of a batch-1 call, 32 for Llama-3-8B at
// 32k, fit: 4 x kGroups is 32 for head size 128).
constexpr int kEarlySplits = 4;

constexpr float kLn2 = 0.6931471805599453f;

// The rotated recipe's logit offset of a row, softmax_scale * (rotated query . k_offset[kv_head]), in
// natural units: the kernels leave it out of the logits without a soft cap (softmax ignores it), the
// log-sum-exp must not. Computed by the whole CTA (kThreads threads), in fp32, from the query itself
// (rotated here by the butterflies of hadamard.h), returned to every thread.
template <int D>
__device__ __forceinline__ float query_offset_logit(const PagedAttentionParams& p, int64_t query_row, int head) {
  __shared__ float q[D];
  __shared__ float partial[kThreads / 32];
  const auto* row = static_cast<const uint8_t*>(p.query) +
                    (query_row * p.query_token_stride + static_cast<int64_t>(head) * p.query_head_stride) * 2;
  for (int i = threadIdx.x; i < D / 2; i += kThreads) {
    const float2 x = pair_as_float2(reinterpret_cast<const uint32_t*>(row)[i], p.query_dtype == DType::kBFloat16);
    q[2 * i] = x.x, q[2 * i + 1] = x.y;
  }
  __syncthreads();
  constexpr int kBlock = hadamard_block(D);
  if (p.transform.hadamard) {
    for (int h = 1; h < kBlock; h *= 2) {
      for (int i = threadIdx.x; i < D / 2; i += kThreads) {
        const int lo = i / h * 2 * h + i % h;
        butterfly(q[lo], q[lo + h]);
      }
      __syncthreads();
    }
  }
  const float* offset = p.transform.k_offset + static_cast<int64_t>(head / (p.num_heads / p.num_kv_heads)) * D;
  float sum = 0.f;
  for (int d = threadIdx.x; d < D; d += kThreads) sum += q[d] * offset[d];
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int x = 0; x < kThreads / 32; ++x) sum += partial[x];
  return p.softmax_scale * (p.transform.hadamard ? sum * hadamard_norm(kBlock) : sum);
}

// One CTA per row: thread s weighs split s (num_splits <= kMaxSplits); then each group of D/4 threads
// sums a share of the splits as float4 vectors (independent loads, all in flight at once: its first
// kEarlySplits issued with the maxima's and sums'), and the groups' sums are added through shared memory.
// kLse: also the row's log-sum-exp into lse (a separate kernel, so that the other's code does not change).
template <int D, bool kLse>
__device__ __forceinline__ void merge_splits(const PagedAttentionParams& p, const SplitWorkspace& ws,
                                             const LseOutput& lse) {
  constexpr int kVectors = D / 4;
  constexpr int kGroups = kThreads / kVectors;
  __shared__ float weights[kMaxSplits];
  __shared__ float partial[2][kThreads / 32];
  __shared__ float group_sums[kGroups][D];
  wait_for_previous_grid();
  const int64_t row = blockIdx.x;  // query_row * num_heads + head
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int s = threadIdx.x;
  const int group = threadIdx.x / kVectors, vector = threadIdx.x % kVectors;
  // Loaded unconditionally (a split past the last reads the last one, a thread past the groups reads
  // the last group's) so the loads are in flight together; an empty split's acc was never written
  // (weight 0): selected away below, never multiplied.
  auto acc_vector = [&](int split) {
    return reinterpret_cast<const float4*>(ws.acc + (split * ws.rows + row) * D)[vector];
  };
  float4 early[kEarlySplits];
#pragma unroll
  for (int i = 0; i < kEarlySplits; ++i) {
    early[i] = acc_vector(min(min(group, kGroups - 1) + i * kGroups, ws.num_splits - 1));
  }
  // Every split writes its row's max and sum (sum 0: no keys), so both load at once.
  const float split_sum = s < ws.num_splits ? ws.row_sum[s * ws.rows + row] : 0.f;
  const float split_max = s < ws.num_splits ? ws.row_max[s * ws.rows + row] : -INFINITY;
  const bool has_split = split_sum > 0.f;
  float max_all = has_split ? split_max : -INFINITY;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) max_all = fmaxf(max_all, __shfl_xor_sync(0xffffffffu, max_all, mask));
  if (lane == 0) partial[0][warp] = max_all;
  __syncthreads();
  max_all = partial[0][0];
#pragma unroll
  for (int x = 1; x < kThreads / 32; ++x) max_all = fmaxf(max_all, partial[0][x]);
  const float weight = has_split ? fast_exp2(split_max - max_all) : 0.f;
  float sum = weight * split_sum;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, mask);
  if (lane == 0) partial[1][warp] = sum;
  if (s < ws.num_splits) weights[s] = weight;
  __syncthreads();
  sum = 0.f;
#pragma unroll
  for (int x = 0; x < kThreads / 32; ++x) sum += partial[1][x];
  const float norm = sum > 0.f ? 1.f / sum : 0.f;

  if (group < kGroups) {
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](int x, const float4& a) {
      const float w = weights[x];
      if (w != 0.f) o.x += w * a.x, o.y += w * a.y, o.z += w * a.z, o.w += w * a.w;
    };
#pragma unroll
    for (int i = 0; i < kEarlySplits; ++i) {
      if (group + i * kGroups < ws.num_splits) add(group + i * kGroups, early[i]);
    }
#pragma unroll 8
    for (int x = group + kEarlySplits * kGroups; x < ws.num_splits; x += kGroups) add(x, acc_vector(x));
    group_sums[group][4 * vector] = o.x, group_sums[group][4 * vector + 1] = o.y;
    group_sums[group][4 * vector + 2] = o.z, group_sums[group][4 * vector + 3] = o.w;
  }
  __syncthreads();

  const int64_t query_row = row / p.num_heads;
  const int head = static_cast<int>(row % p.num_heads);
  for (int d = 2 * threadIdx.x; d < D; d += 2 * kThreads) {
    float o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int x = 0; x < kGroups; ++x) o0 += group_sums[x][d], o1 += group_sums[x][d + 1];
    auto* out = static_cast<uint8_t*>(p.out) +
                (query_row * p.out_token_stride + static_cast<int64_t>(head) * p.out_head_stride + d) * 2;
    store_pair_from_float2(out, o0 * norm, o1 * norm, p.query_dtype == DType::kBFloat16);
  }
  if constexpr (kLse) {
    // The splits' maxima are base-2 logits and their sums are of 2^(logit - max + log2_shift).
    const bool add_offset = p.logits_soft_cap <= 0.f && p.transform.k_offset != nullptr;
    const float offset = add_offset ? query_offset_logit<D>(p, query_row, head) : 0.f;
    if (threadIdx.x == 0) {
      static_cast<float*>(lse.rows.data)[lse.rows.offset(query_row, head)] =
          sum > 0.f ? (max_all - lse.log2_shift + log2f(sum)) * kLn2 + offset : -INFINITY;
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(const PagedAttentionParams p, SplitWorkspace ws) {
  merge_splits<D, false>(p, ws, LseOutput{});
}

template <int D>
__global__ void __launch_bounds__(kThreads)
    merge_splits_lse_kernel(const PagedAttentionParams p, SplitWorkspace ws, LseOutput lse) {
  merge_splits<D, true>(p, ws, lse);
}

// Compute capability major of the current device (0 on error).
int compute_capability_major() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    return 0;
  }
  return major;
}

}  // namespace

cudaError_t launch(const PagedAttentionParams& p, const SplitWorkspace& ws, const LseOutput& lse,
                   cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ws.rows));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  if (compute_capability_major() >= 9) {
    config.attrs = &dependent;
    config.numAttrs = 1;
  }
  return dispatch<kCudaHeadSizes>(p.head_size, cudaErrorInvalidValue, [&](auto head) {
    constexpr int kHead = decltype(head)::value;
    return lse.rows.data == nullptr ? cudaLaunchKernelEx(&config, merge_splits_kernel<kHead>, p, ws)
                                    : cudaLaunchKernelEx(&config, merge_splits_lse_kernel<kHead>, p, ws, lse);
  });
}

}  // namespace fp8kv::cuda::merge
