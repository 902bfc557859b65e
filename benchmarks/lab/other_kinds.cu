// Lab stubs: only e4m3fn is built.
#include "../../csrc/cuda/paged_attention_config.h"
#define STUB(K)                                                                                                     \
  template <> cudaError_t launch<K>(const PagedAttentionParams&, const AttentionPlan&, SplitWorkspace, cudaStream_t) { \
    return cudaErrorNotSupported;                                                                                   \
  }
namespace fp8kv::cuda::attention {
STUB(CacheKind::kE5M2) STUB(CacheKind::kE4M3FNUZ) STUB(CacheKind::kFloat16) STUB(CacheKind::kBFloat16)
template <> int prepare<CacheKind::kE5M2>(int) { return 0; }
template <> int prepare<CacheKind::kE4M3FNUZ>(int) { return 0; }
template <> int prepare<CacheKind::kFloat16>(int) { return 0; }
template <> int prepare<CacheKind::kBFloat16>(int) { return 0; }
}
namespace fp8kv::cuda::prefill {
STUB(CacheKind::kE5M2) STUB(CacheKind::kE4M3FNUZ) STUB(CacheKind::kFloat16) STUB(CacheKind::kBFloat16)
template <> int prepare<CacheKind::kE5M2>(int, bool) { return 0; }
template <> int prepare<CacheKind::kE4M3FNUZ>(int, bool) { return 0; }
template <> int prepare<CacheKind::kFloat16>(int, bool) { return 0; }
template <> int prepare<CacheKind::kBFloat16>(int, bool) { return 0; }
}
