// Paged-attention kernels for float16 caches.
#include "instantiate.cuh"
FP8KV_INSTANTIATE_ATTENTION(DType::kFloat16)
