"""fp8kv: FP8 KV cache for transformer inference."""

from . import ops
from ._ops import has_cuda_kernels

__all__ = ["ops", "has_cuda_kernels"]
__version__ = "0.1.0"
