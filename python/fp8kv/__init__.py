"""fp8kv: FP8 KV cache for transformer inference."""

from . import ops
from ._ops import has_cuda_kernels
from .checkpoint import CheckpointError, load_kv_cache_config, read_checkpoint_scales
from .formats import KVCacheConfig, KVCacheDtype

__all__ = [
    "ops",
    "has_cuda_kernels",
    "KVCacheDtype",
    "KVCacheConfig",
    "load_kv_cache_config",
    "read_checkpoint_scales",
    "CheckpointError",
]
__version__ = "0.1.0"
