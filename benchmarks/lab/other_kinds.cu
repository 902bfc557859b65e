// Lab stubs: only e4m3fn is built.
#include "../../csrc/cuda/paged_attention_config.h"
namespace fp8kv::cuda::attention {
#define STUB(K) template <> cudaError_t launch<K>(const PagedAttentionParams&, const AttentionPlan&, SplitWorkspace, cudaStream_t) { return cudaErrorNotSupported; } \
  template <> int prepare<K>(int) { return 0; }
STUB(CacheKind::kE5M2) STUB(CacheKind::kE4M3FNUZ) STUB(CacheKind::kFloat16) STUB(CacheKind::kBFloat16)
}
