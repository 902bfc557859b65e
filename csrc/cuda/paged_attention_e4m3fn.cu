// Paged-attention kernels for e4m3fn caches.
#include "instantiate.cuh"
FP8KV_INSTANTIATE_ATTENTION(DType::kFloat8E4M3FN)
