// Paged-attention kernels for bfloat16 caches (one file per format keeps builds parallel).
#include "paged_attention_kernel.cuh"

namespace fp8kv::cuda::attention {
FP8KV_INSTANTIATE_ATTENTION(CacheKind::kBFloat16)
}  // namespace fp8kv::cuda::attention
