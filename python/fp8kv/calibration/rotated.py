"""The rotated recipe's calibration (docs/rotated_cache.md).

Per layer and KV head, over the calibration tokens: the mean of the rotated K (the K offset mu), the
per-channel extremes of the rotated K, from which the maxima of K - mu follow in one pass
(max over channels c of max(max_c - mu_c, mu_c - min_c)), and the maxima of the rotated V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import distributed
from ..checkpoint.rotated_recipe import RotatedRecipe
from ..formats import KVCacheConfig, KVCacheDtype
from ..rotation import Rotation, hadamard
from .scales import KVAmax


class RotatedObserver:
    """One layer's running statistics of the rotated K and V of this rank's KV heads."""

    def __init__(self, num_kv_heads: int, head_size: int, device: torch.device):
        shape = (num_kv_heads, head_size)
        self.k_sum = torch.zeros(shape, dtype=torch.float64, device=device)
        self.k_min = torch.full(shape, torch.inf, device=device)
        self.k_max = torch.full(shape, -torch.inf, device=device)
        self.v_amax = torch.zeros(num_kv_heads, device=device)
        self.num_tokens = 0

    def observe(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value: [num_tokens, kv_heads, head_size]. NaN propagates into every statistic."""
        k = hadamard(key.float())
        self.k_sum += k.sum(0, dtype=torch.float64)
        self.k_min = torch.minimum(self.k_min, k.amin(0))
        self.k_max = torch.maximum(self.k_max, k.amax(0))
        self.v_amax = torch.maximum(self.v_amax, hadamard(value.float()).abs().amax(dim=(0, 2)))
        self.num_tokens += key.shape[0]


@dataclass(frozen=True)
class RotatedAmax:
    """The rotated recipe's statistics of every layer, all KV heads in global order.

    k_offsets: mu per layer [num_kv_heads][head_size]; k: max |kH - mu| and k_uncentred: max |kH|
    per layer and head; v: max |vH| per layer and head. num_tokens: how many tokens this rank
    observed (per layer), as KVAmax says.
    """

    k_offsets: tuple[tuple[tuple[float, ...], ...], ...]
    k: tuple[tuple[float, ...], ...]
    k_uncentred: tuple[tuple[float, ...], ...]
    v: tuple[tuple[float, ...], ...]
    num_tokens: int

    @classmethod
    def gather(cls, observers: list[RotatedObserver], num_kv_heads: int, group=None) -> RotatedAmax:
        """The statistics of every rank's heads (a collective under torch.distributed)."""
        k_sum = torch.stack([o.k_sum for o in observers])                        # [layers, heads, D]
        extremes = torch.stack([torch.stack([o.k_max, -o.k_min]) for o in observers])  # [layers, 2, heads, D]
        v_amax = torch.stack([o.v_amax for o in observers])                      # [layers, heads]
        num_tokens = summed_tokens = observers[0].num_tokens
        if distributed.is_distributed():
            # Heads last, as the reductions take them. (One KV head on every rank may be tensor
            # parallel, the same tokens everywhere, or data parallel: the sums and counts add up
            # either way, and their quotient is the same.)
            k_sum, summed_tokens = distributed.reduce_head_sums(k_sum.transpose(-1, -2), num_tokens, num_kv_heads,
                                                                group)
            k_sum = k_sum.transpose(-1, -2)
            extremes = distributed.reduce_amax(extremes.transpose(-1, -2), "head", num_kv_heads, group).transpose(-1, -2)
            v_amax = distributed.reduce_amax(v_amax, "head", num_kv_heads, group)
        k_sum, extremes, v_amax = k_sum.cpu(), extremes.cpu(), v_amax.cpu()
        mu = (k_sum / summed_tokens).float()                                        # [layers, heads, D]
        k_centred = torch.maximum(extremes[:, 0] - mu, mu + extremes[:, 1]).amax(-1)
        k_uncentred = extremes.amax(dim=(1, 3))

        def rows(t):
            return tuple(tuple(row) for row in t.tolist())

        return cls(tuple(rows(layer) for layer in mu), rows(k_centred), rows(k_uncentred), rows(v_amax), num_tokens)

    def kv_cache(self, fmt: KVCacheDtype | str, granularity: str, *, centred: bool = True, margin: float = 1.0,
                 zero_amax: str = "error") -> KVCacheConfig:
        """The rotated (+ centred) recipe's config: scales s = amax * margin / max_finite(fmt) per
        tensor or per head (as `KVAmax.scales`), and mu as the K offsets when centred."""
        k = self.k if centred else self.k_uncentred
        if granularity == "tensor":
            k, v = (tuple((max(heads),) for heads in maxima) for maxima in (k, self.v))
        else:
            v = self.v
        plain = KVAmax(k, v, self.num_tokens).scales(fmt, margin=margin, zero_amax=zero_amax)
        recipe = "rotated + centred" if centred else "rotated"
        return KVCacheConfig(plain.dtype, plain.k_scales, plain.v_scales, f"{plain.source}, {recipe} recipe",
                             Rotation.HADAMARD, self.k_offsets if centred else None)


def recipe_file(kv_cache: KVCacheConfig, head_size: int, num_kv_heads: int) -> RotatedRecipe:
    """What fp8kv_kv_cache.json holds for a rotated recipe calibrated for kv_cache.dtype."""
    if kv_cache.rotation is not Rotation.HADAMARD:
        raise ValueError(f"fp8kv_kv_cache.json holds a rotated recipe; got rotation {kv_cache.rotation.value!r}")
    return RotatedRecipe(kv_cache.dtype, head_size, num_kv_heads, kv_cache.k_scales, kv_cache.v_scales,
                         kv_cache.k_offsets)
