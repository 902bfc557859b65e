// Host-side pieces shared by the CUDA paged-attention launchers (paged_attention.cu and the
// per-format kernel files): the kernels' launch entry points and occupancy, the merge launch, and
// the per-device occupancy query.
#pragma once

#include "../gpu/kernels.h"
#include "tiles.h"

namespace fp8kv::cuda {

// Raises `kernel`'s dynamic shared-memory limit to max_smem_bytes on the current device and returns
// its resident CTAs per SM with smem_bytes of dynamic shared memory (0 on error); computed once per
// (kernel, device, smem_bytes).
int kernel_occupancy(const void* kernel, int threads, int max_smem_bytes, int smem_bytes);

namespace merge {
// Where the merge writes each row's log-sum-exp (rows.data nullptr: nowhere), and the base-2 shift
// the attention kernel gave its probabilities and sums (FP8 math's kProbabilityShift, else 0).
struct LseOutput {
  RowsView rows;
  float log2_shift;
};

// Merges the splits of ws into p.out (merge.cu), launched right after the attention kernel: a
// programmatic dependent launch on sm_90+, so it starts while the attention grid before it finishes
// once that grid allows it (the decode kernel does); a plain launch elsewhere.
cudaError_t launch(const PagedAttentionParams& p, const SplitWorkspace& ws, const LseOutput& lse, cudaStream_t stream);
}  // namespace merge

// The kernels' entry points, defined per cache format in paged_attention_<format>.cu; each launches
// its attention kernel only (paged_attention.cu launches the merge). `occupancy`:
// the kernel's resident CTAs per SM on the current device (0 on error or for an unsupported head
// size); the decode kernel's depends on the plan's split size (its block-table slices).
namespace decode {
// `taken`: the work queue's counter (zeroed by the launch where it is used).
template <DType C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws, int* taken,
                   cudaStream_t stream);
template <DType C>
int occupancy(const AttentionPlan& plan, int head_size, int block_size);
}  // namespace decode

namespace multi_token::sm80 {
template <DType C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                   cudaStream_t stream);
template <DType C>
int occupancy(int head_size, bool deep_staging);
}  // namespace multi_token::sm80

namespace multi_token::sm90a {
template <DType C>
cudaError_t launch(const PagedAttentionParams& p, const AttentionPlan& plan, const SplitWorkspace& ws,
                   cudaStream_t stream);
template <DType C>
int occupancy(int head_size, bool fp8_math);
}  // namespace multi_token::sm90a

}  // namespace fp8kv::cuda
