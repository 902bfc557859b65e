"""fp8kv: FP8 KV cache for transformer inference.

K and V are stored in FP8 (e4m3fn, e5m2, e4m3fnuz) with per-layer dequantization scales, and
attention reads them directly: twice the tokens in the same memory, half the bytes read per decode.

    import fp8kv
    config = fp8kv.load_kv_cache_config("path/to/checkpoint", "fp8")   # format, recipe, scales
    cache = fp8kv.PagedKVCache(config, num_kv_heads=2, head_size=64, num_blocks=64)
    layer = cache.layer(0)   # layer 0's caches with the recipe and scales they are written and read with

What is where:
- KVCacheDtype, KVCacheConfig (fp8kv.formats): the cache format, by any of its names
  (KVCacheDtype.parse: fp8, fp8_e4m3, e4m3, float8_e4m3fn, e5m2, ...), with its scales.
- load_kv_cache_config, read_checkpoint_scales (fp8kv.checkpoint): the scales a checkpoint holds
  (vLLM, llm-compressor, ModelOpt, TGI and legacy JSON forms), per tensor-parallel rank.
- PagedKVCache, KVCacheLayer, PagedAttention (fp8kv.cache, fp8kv.layer, fp8kv.attention): a paged
  cache, one layer of it (its caches with their format, recipe and scales) and a layer's attention
  over it, for your own inference loop.
- fp8kv.ops: the operators (reshape_and_cache, paged_attention on a KVCacheLayer; kv_amax).
- fp8kv.integrations.transformers: `enable(model)` and `PagedCache` run `model.generate` of a
  Hugging Face transformers model on the FP8 cache (needs the [hf] extra).
- fp8kv.integrations.vllm: vLLM's attention backend FP8KV, registered by the package's
  `vllm.general_plugins` entry point (`vllm serve MODEL --kv-cache-dtype fp8 --attention-backend
  FP8KV`; the [vllm] extra, docs/vllm.md).
- fp8kv.calibration, fp8kv.evaluate: scales calibrated on your data and written into a
  checkpoint; what a cache costs a model in perplexity and KL.
- The command line, `python -m fp8kv {demo,inspect,calibrate,evaluate,serve} --help`.

Documentation (in the source tree's docs/): guide.md (start here), ops.md, calibration.md,
accuracy.md, generate.md.
"""

from . import ops
from ._ops import has_cuda_kernels
from .attention import PagedAttention
from .cache import BatchMetadata, BlockAllocator, CacheFullError, PagedKVCache, capacity_report
from .checkpoint.per_rank import load_kv_cache_config
from .checkpoint.problems import CheckpointError
from .checkpoint.reading import read_checkpoint_scales
from .formats import KVCacheConfig, KVCacheDtype
from .layer import KVCacheLayer

__all__ = [
    "ops",
    "has_cuda_kernels",
    "KVCacheDtype",
    "KVCacheConfig",
    "load_kv_cache_config",
    "read_checkpoint_scales",
    "CheckpointError",
    "PagedKVCache",
    "KVCacheLayer",
    "BlockAllocator",
    "BatchMetadata",
    "CacheFullError",
    "capacity_report",
    "PagedAttention",
]
__version__ = "0.1.0"
