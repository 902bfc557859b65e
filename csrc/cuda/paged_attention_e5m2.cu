// Paged-attention kernels for e5m2 caches.
#include "instantiate.cuh"
FP8KV_INSTANTIATE_ATTENTION(DType::kFloat8E5M2)
