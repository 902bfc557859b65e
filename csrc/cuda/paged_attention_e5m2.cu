// Paged-attention kernels (decode and multi-token) for e5m2 caches (one file per format keeps builds parallel).
#include "paged_attention_kernel.cuh"
#include "prefill_attention_kernel.cuh"

namespace fp8kv::cuda::attention {
FP8KV_INSTANTIATE_ATTENTION(CacheKind::kE5M2)
}  // namespace fp8kv::cuda::attention

namespace fp8kv::cuda::prefill {
FP8KV_INSTANTIATE_PREFILL(CacheKind::kE5M2)
}  // namespace fp8kv::cuda::prefill
