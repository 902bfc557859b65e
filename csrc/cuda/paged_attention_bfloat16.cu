// Paged-attention kernels for bfloat16 caches.
#include "instantiate.cuh"
FP8KV_INSTANTIATE_ATTENTION(DType::kBFloat16)
