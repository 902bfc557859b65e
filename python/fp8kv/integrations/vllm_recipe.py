"""fp8kv's rotated cache recipe in vLLM: the user's choice and the checkpoint's data, without vLLM.

A vLLM user chooses fp8kv's recipe as vLLM's own backend-specific choices are made, in vLLM's
`additional_config` (`--additional-config '{"fp8kv_rotation": "none"}'`, `LLM(...,
additional_config={...})`):

- absent or "hadamard" (an FP8 cache): the rotated recipe (docs/rotated_cache.md), fp8kv's default
  everywhere, rotated + centred where the checkpoint's fp8kv_kv_cache.json (written by `python -m
  fp8kv calibrate`) has K offsets, with that file's scales; a checkpoint without the file gets what
  `fp8kv.load_kv_cache_config` gives the transformers integration (the plain scales times
  sqrt(block), or 1.0 without scales);
- "none": the plain recipe, what vLLM's other backends store, with the scales vLLM loads from the
  checkpoint (`k_scale` / `v_scale`); an unquantized (auto) cache has no other.

The rotated recipe's data is read by fp8kv from the checkpoint directory, as the transformers
integration reads it: vLLM's loader has no place for it.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Mapping

import torch

from ..checkpoint import load_kv_cache_config
from ..formats import KVCacheConfig, KVCacheDtype, default_rotation
from ..rotation import Rotation

ROTATION_KEY = "fp8kv_rotation"


def chosen_rotation(additional_config, cache_format: torch.dtype | None) -> Rotation:
    """The rotation vLLM's `additional_config` asks for; where it does not, fp8kv's default for the
    cache (`cache_format`, an FP8 torch dtype, or None for an unquantized cache): Rotation.HADAMARD
    for FP8, Rotation.NONE unquantized. Any other key starting with "fp8kv" is refused: a misspelt
    choice must not fall back to the default."""
    default = Rotation.NONE if cache_format is None else default_rotation(KVCacheDtype.parse(cache_format))
    if not isinstance(additional_config, Mapping):
        return default
    unknown = [key for key in additional_config if str(key).startswith("fp8kv") and key != ROTATION_KEY]
    if unknown:
        raise ValueError(f"additional_config: unknown fp8kv key {unknown[0]!r}; fp8kv's attention backend reads "
                         f"{ROTATION_KEY!r} ('none' or 'hadamard')")
    value = additional_config.get(ROTATION_KEY, default)
    try:
        return Rotation.parse(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"additional_config[{ROTATION_KEY!r}]: {e}") from None


def rotated_recipe(model: str | os.PathLike, cache_format: torch.dtype | None, tp_rank: int,
                   tp_size: int) -> KVCacheConfig:
    """This tensor-parallel rank's rotated recipe (scales, K offsets) for an FP8 cache of
    `cache_format` (an FP8 torch dtype), from the checkpoint directory `model` (vLLM's --model).
    Refuses, naming why, a model that is not a local directory and an unquantized cache; the
    checkpoint's own problems raise fp8kv's CheckpointError, naming the file and entry."""
    if cache_format is None:
        raise ValueError(f"{ROTATION_KEY} 'hadamard' needs an FP8 cache (--kv-cache-dtype fp8, fp8_e4m3 or "
                         "fp8_e5m2): an unquantized (auto) cache stores K/V as they are")
    if not pathlib.Path(model).is_dir():
        raise ValueError(f"fp8kv's rotated recipe (its default for an FP8 cache) reads its scales and K offsets "
                         f"from the checkpoint's files, and the model {str(model)!r} is not a local directory: "
                         "download it and give vLLM the directory, or choose the plain recipe "
                         f"(--additional-config '{{\"{ROTATION_KEY}\": \"none\"}}')")
    return _load(str(pathlib.Path(model).resolve()), KVCacheDtype.parse(cache_format), tp_rank, tp_size)


@functools.lru_cache(maxsize=4)
def _load(model: str, dtype: KVCacheDtype, tp_rank: int, tp_size: int) -> KVCacheConfig:
    """Read once per process: every attention layer of the model asks."""
    return load_kv_cache_config(model, dtype, rotation=Rotation.HADAMARD, tp_rank=tp_rank, tp_size=tp_size)
