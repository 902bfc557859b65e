// Paged-attention kernels for e4m3fnuz caches (one file per format keeps builds parallel).
#include "paged_attention_kernel.cuh"

namespace fp8kv::cuda::attention {
FP8KV_INSTANTIATE_ATTENTION(CacheKind::kE4M3FNUZ)
}  // namespace fp8kv::cuda::attention
