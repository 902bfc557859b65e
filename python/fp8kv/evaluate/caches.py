"""The KV caches an evaluation can score, by name, and their configs for a model.

A cache is a format, a recipe (docs/rotated_cache.md: plain, rotated, rotated + centred) and where
its scales and K offsets come from: scale 1, a checkpoint, or calibration on the evaluation windows
(the most favourable case for calibration: no value at evaluation exceeds what it measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import KVCacheConfig, KVCacheDtype
from ..rotation import Rotation


@dataclass(frozen=True)
class CacheSpec:
    label: str
    format: str          # the KVCacheDtype name
    rotation: Rotation
    source: str          # 'unit', 'checkpoint', 'tensor' / 'head' (scales calibrated on the windows), or
                         # 'offsets' (scale 1, K offsets calibrated on the windows)


UNQUANTIZED = "auto"
_E4M3, _E5M2, _PLAIN, _ROTATED = "fp8_e4m3", "fp8_e5m2", Rotation.NONE, Rotation.HADAMARD
CACHES = {
    "e4m3": CacheSpec("e4m3, plain, scale 1", _E4M3, _PLAIN, "unit"),
    "e4m3-checkpoint": CacheSpec("e4m3, plain, checkpoint scales", _E4M3, _PLAIN, "checkpoint"),
    "e4m3-tensor": CacheSpec("e4m3, plain, calibrated per tensor", _E4M3, _PLAIN, "tensor"),
    "e4m3-head": CacheSpec("e4m3, plain, calibrated per head", _E4M3, _PLAIN, "head"),
    "e4m3-rotated": CacheSpec("e4m3, rotated, scale 1", _E4M3, _ROTATED, "unit"),
    "e4m3-centred": CacheSpec("e4m3, rotated + centred (offsets calibrated), scale 1", _E4M3, _ROTATED, "offsets"),
    "e4m3-rotated-checkpoint": CacheSpec("e4m3, the checkpoint's rotated recipe", _E4M3, _ROTATED, "checkpoint"),
    "e5m2": CacheSpec("e5m2, plain, scale 1", _E5M2, _PLAIN, "unit"),
    "e5m2-rotated": CacheSpec("e5m2, rotated, scale 1", _E5M2, _ROTATED, "unit"),
    "e5m2-centred": CacheSpec("e5m2, rotated + centred (offsets calibrated), scale 1", _E5M2, _ROTATED, "offsets"),
}
CALIBRATED = {name: spec.source for name, spec in CACHES.items() if spec.source in ("tensor", "head")}
LABELS = {UNQUANTIZED: "unquantized (model dtype)", **{name: spec.label for name, spec in CACHES.items()}}


def per_tensor(amax):
    """Per-tensor maxima from per-head ones (the maximum over each layer's heads: exactly what per-tensor
    calibration measures), so one calibration pass serves both granularities."""
    from ..calibration import KVAmax

    return KVAmax(tuple((max(heads),) for heads in amax.k), tuple((max(heads),) for heads in amax.v),
                  amax.num_tokens, amax.rotated)


def kv_cache_configs(model, windows: torch.Tensor, names, *,
                     checkpoint: dict[Rotation, KVCacheConfig] | None = None,
                     progress: bool = True) -> dict[str, KVCacheConfig]:
    """`auto` and each cache of `names`, for `model`: the checkpoint's configs by rotation, calibrated
    ones on `windows` (one pass, per head)."""
    from ..calibration import calibrate

    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    configs = {UNQUANTIZED: KVCacheConfig.unit_scales(UNQUANTIZED, num_layers)}
    amax = None
    for name in names:
        spec = CACHES.get(name)
        if spec is None:
            raise ValueError(f"--kv-cache-dtype: unknown cache {name!r}; valid: {', '.join(CACHES)}")
        if spec.source == "checkpoint":
            if checkpoint is None or spec.rotation not in checkpoint:
                raise ValueError(f"--kv-cache-dtype {name} needs a checkpoint with those scales: --scales CKPT, or a "
                                 "model with them")
            configs[name] = checkpoint[spec.rotation]
            continue
        if spec.source in ("tensor", "head", "offsets") and amax is None:
            implementation = model.config._attn_implementation
            model.set_attn_implementation("sdpa")
            try:
                amax = calibrate(model, [w[None] for w in windows], granularity="head", progress=progress)
            finally:
                model.set_attn_implementation(implementation)
        fmt = KVCacheDtype.parse(spec.format)
        if spec.source == "unit":
            configs[name] = KVCacheConfig.unit_scales(fmt, num_layers, rotation=spec.rotation)
        elif spec.source == "offsets":
            if amax.rotated is None:
                raise ValueError(f"--kv-cache-dtype {name}: the model's head size has no rotation")
            configs[name] = KVCacheConfig(fmt, ((1.0,),) * num_layers, ((1.0,),) * num_layers,
                                          "scale 1, K offsets calibrated on the windows", spec.rotation,
                                          amax.rotated.k_offsets)
        else:
            configs[name] = (amax if spec.source == "head" else per_tensor(amax)).scales(fmt)
    return configs
