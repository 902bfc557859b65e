// Paged-attention kernels for float16 caches (one file per format keeps builds parallel).
#include "paged_attention_kernel.cuh"

namespace fp8kv::cuda::attention {
FP8KV_INSTANTIATE_ATTENTION(CacheKind::kFloat16)
}  // namespace fp8kv::cuda::attention
