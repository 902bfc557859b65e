"""`KVCacheLayer`: one layer's key and value caches with the format, recipe and scales they hold.

A cache's bytes mean something only with the recipe (docs/rotated_cache.md) and the scales they were
written with. A layer carries them together, and fp8kv.ops' write and attention take the layer, not
loose scales and recipe arguments: a cache is read with the recipe it was written with. Layers come
from a `PagedKVCache` built from a `KVCacheConfig` (`cache.layer(index)`); fp8kv's integrations
make them over an engine's own pages (vLLM's, transformers' continuous batching).
"""

from __future__ import annotations

import torch

from .formats import KVCacheConfig, KVCacheDtype
from .rotation import Rotation, check_head_size, recipe_name


class KVCacheLayer:
    """One layer of a cache: its key and value caches with the format, recipe and scales they hold.

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size] in the format's dtype
        (the model's dtype for an unquantized cache), any strides but a contiguous last dim.
    k_scale, v_scale: float32 [1] or [num_kv_heads] dequantization scales, on the caches' device.
    rotation, k_offset: the recipe: Rotation.HADAMARD for a rotated cache; k_offset float32
        [num_kv_heads, head_size] for a centred one, else None.
    kv_cache_dtype: the format.
    Made by PagedKVCache.layer (from its KVCacheConfig) and fp8kv's integrations, not by hand: every
    write and read of a cache goes through the one layer made for it. The tensors are the ops'
    arguments as they are (no copy per call).
    """

    def __init__(self, kv_cache_dtype: KVCacheDtype, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, rotation: Rotation, k_offset: torch.Tensor | None):
        self.kv_cache_dtype, self.rotation = kv_cache_dtype, rotation
        self.key_cache, self.value_cache = key_cache, value_cache
        self.k_scale, self.v_scale, self.k_offset = k_scale, v_scale, k_offset
        # Read by the ops at every call: a bool, not an enum comparison.
        self.hadamard = rotation is Rotation.HADAMARD

    @classmethod
    def _of_config(cls, kv_cache: KVCacheConfig, index: int, key_cache: torch.Tensor,
                   value_cache: torch.Tensor) -> KVCacheLayer:
        """Layer `index` of `kv_cache` (its format, recipe and scales) over `key_cache` / `value_cache`:
        ValueError naming what does not fit. For fp8kv's own caches and integrations, which make one
        layer per page and never two over the same memory."""
        if not 0 <= index < kv_cache.num_layers:
            raise ValueError(f"layer {index}: the KVCacheConfig has {kv_cache.num_layers} layers")
        _check_caches(kv_cache.dtype, key_cache, value_cache)
        num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
        if kv_cache.rotation is Rotation.HADAMARD:
            check_head_size(head_size)
        device = key_cache.device
        scales = {}
        for name, values in (("k_scales", kv_cache.k_scales[index]), ("v_scales", kv_cache.v_scales[index])):
            if len(values) not in (1, num_kv_heads):
                raise ValueError(f"the KVCacheConfig's {name}[{index}] has {len(values)} values; expected 1 or "
                                 f"num_kv_heads={num_kv_heads}")
            scales[name] = torch.tensor(values, dtype=torch.float32, device=device)
        k_offset = kv_cache.k_offset(index, device)
        if k_offset is not None and tuple(k_offset.shape) != (num_kv_heads, head_size):
            raise ValueError(f"the KVCacheConfig's k_offsets[{index}] has shape {list(k_offset.shape)}; expected "
                             f"[num_kv_heads, head_size] = [{num_kv_heads}, {head_size}]")
        return cls(kv_cache.dtype, key_cache, value_cache, scales["k_scales"], scales["v_scales"], kv_cache.rotation,
                   k_offset)

    def with_caches(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> KVCacheLayer:
        """The same layer over other views of the same caches (a compiled step makes its own)."""
        return KVCacheLayer(self.kv_cache_dtype, key_cache, value_cache, self.k_scale, self.v_scale, self.rotation,
                            self.k_offset)

    @property
    def recipe(self) -> str:
        """"plain", "rotated" or "rotated + centred"."""
        return recipe_name(self.rotation, self.k_offset is not None)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The recipe's tensors (scales, K offset), which never change address: for
        torch._dynamo.mark_static_address."""
        return tuple(t for t in (self.k_scale, self.v_scale, self.k_offset) if t is not None)

    def __repr__(self) -> str:
        return (f"KVCacheLayer({self.kv_cache_dtype.value}, {self.recipe} recipe, "
                f"caches {list(self.key_cache.shape)} on {self.key_cache.device})")


def _check_caches(kv_cache_dtype: KVCacheDtype, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
            raise ValueError(f"{name} must be a tensor [num_blocks, block_size, num_kv_heads, head_size]")
        expected = kv_cache_dtype.storage_dtype
        if (cache.dtype != expected) if expected is not None else cache.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"{name} is {cache.dtype}, but the KVCacheConfig's format {kv_cache_dtype.value} is "
                             f"stored as {expected or 'float16 or bfloat16 (the model dtype)'}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {list(key_cache.shape)} and value_cache {list(value_cache.shape)} differ in shape")
