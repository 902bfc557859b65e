// Paged-attention kernels for e5m2 caches (one file per format keeps builds parallel).
#include "paged_attention_kernel.cuh"

namespace fp8kv::cuda::attention {
FP8KV_INSTANTIATE_ATTENTION(CacheKind::kE5M2)
}  // namespace fp8kv::cuda::attention
