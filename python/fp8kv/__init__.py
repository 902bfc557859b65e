"""fp8kv: FP8 KV cache for transformer inference."""

from . import ops
from ._ops import has_cuda_kernels
from .attention import PagedAttention, map_checkpoint_scale_names
from .cache import BatchMetadata, BlockAllocator, CacheFullError, PagedKVCache, capacity_report
from .checkpoint.per_rank import load_kv_cache_config
from .checkpoint.problems import CheckpointError
from .checkpoint.reading import read_checkpoint_scales
from .formats import KVCacheConfig, KVCacheDtype

__all__ = [
    "ops",
    "has_cuda_kernels",
    "KVCacheDtype",
    "KVCacheConfig",
    "load_kv_cache_config",
    "read_checkpoint_scales",
    "CheckpointError",
    "PagedKVCache",
    "BlockAllocator",
    "BatchMetadata",
    "CacheFullError",
    "capacity_report",
    "PagedAttention",
    "map_checkpoint_scale_names",
]
__version__ = "0.1.0"
