"""`PagedAttention`: the attention layer over a paged FP8 KV cache.

The module holds what the model gives its attention (heads, softmax scale, sliding window, soft cap,
FP8 math); the cache's format, recipe and scales come with the `KVCacheLayer` it writes and reads
(fp8kv.layer), so a layer's cache is read with the recipe it was written with.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .cache import BatchMetadata
from .formats import KVCacheConfig, KVCacheDtype
from .layer import KVCacheLayer


class PagedAttention(nn.Module):
    """Writes a step's new K/V into a KVCacheLayer and attends over it.

    num_heads, num_kv_heads: this tensor-parallel rank's query and KV heads.
    softmax_scale: multiplies q.k (None: head_size ** -0.5).
    fp8_math: multi-token queries (prefill, chunked prefill) in FP8 tensor-core math: an e4m3fn or
        e5m2 cache, and on CUDA a compute capability 9.0 GPU (fp8kv.ops.paged_attention's `fp8_math`
        says what it computes; other caches and devices refuse the call).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        *,
        softmax_scale: float | None = None,
        sliding_window: int = -1,
        logits_soft_cap: float = 0.0,
        fp8_math: bool = False,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if not isinstance(fp8_math, bool):
            raise TypeError(f"fp8_math must be True or False, got {fp8_math!r}")
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.softmax_scale = head_size**-0.5 if softmax_scale is None else softmax_scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.fp8_math = fp8_math

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: KVCacheLayer,
                batch: BatchMetadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_size], key/value [num_tokens, num_kv_heads, head_size]:
        the batch's new tokens, sequences in order, written into `layer` (e.g. PagedKVCache.layer(i))
        before attending. Returns [num_tokens, num_heads, head_size]."""
        ops.reshape_and_cache(key, value, layer, batch.slot_mapping)
        out = torch.empty_like(query)
        ops.paged_attention(out, query, layer, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q,
                            self.softmax_scale, self.sliding_window, self.logits_soft_cap, self.fp8_math,
                            plan=self._plan(query, layer, batch))
        return out

    def _plan(self, query: torch.Tensor, layer: KVCacheLayer, batch: BatchMetadata) -> ops.AttentionPlan | None:
        """The step's plan, shared by its layers; none in traced code (plans are made from real tensors)
        or while a CUDA graph is captured (the call's own workspace then lives in the graph's memory,
        where a replay may write it)."""
        if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        return batch.attention_plan(layer, query.shape[0], self.num_heads, self.sliding_window, self.fp8_math)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}"
                + (", fp8_math=True" if self.fp8_math else ""))


FP8_MATH_FORMATS = (KVCacheDtype.E4M3FN, KVCacheDtype.E5M2)


def check_fp8_math(fp8_math: bool, kv_cache_dtype: KVCacheDtype) -> None:
    """Refuses fp8_math where the format has no FP8 math (a bool, an e4m3fn or e5m2 cache)."""
    if not isinstance(fp8_math, bool):
        raise TypeError(f"fp8_math must be True or False, got {fp8_math!r}")
    if fp8_math and kv_cache_dtype not in FP8_MATH_FORMATS:
        raise ValueError(f"fp8_math needs a {FP8_MATH_FORMATS[0].value} or {FP8_MATH_FORMATS[1].value} cache, "
                         f"got {kv_cache_dtype.value}")


class LayerAttentions:
    """The PagedAttention of each layer of a model whose attention calls fp8kv's, built at the
    layer's first call with the parameters the model gives (heads, head size, scaling, window, soft
    cap) and `fp8_math`; a later call with other parameters is an error."""

    def __init__(self, kv_cache: KVCacheConfig, fp8_math: bool = False):
        check_fp8_math(fp8_math, kv_cache.dtype)
        self.fp8_math = fp8_math
        self._modules: list[PagedAttention | None] = [None] * kv_cache.num_layers

    def get(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int, scaling: float | None,
            sliding_window: int | None, softcap: float | None) -> PagedAttention:
        window = sliding_window if sliding_window is not None else -1
        cap = softcap if softcap is not None else 0.0
        module = self._modules[layer_idx]
        if module is None:
            module = PagedAttention(num_heads, num_kv_heads, head_size, softmax_scale=scaling, sliding_window=window,
                                    logits_soft_cap=cap, fp8_math=self.fp8_math)
            self._modules[layer_idx] = module
        elif (module.num_heads, module.softmax_scale, module.sliding_window, module.logits_soft_cap) != (
                num_heads, module.softmax_scale if scaling is None else scaling, window, cap):
            raise ValueError(f"layer {layer_idx} attention parameters changed between calls")
        return module


def mark_static(*tensors: torch.Tensor) -> None:
    """Tells torch.compile that these tensors keep their address (updated in place, never replaced),
    so CUDA graphs read them directly instead of copying them in at every replay."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)
