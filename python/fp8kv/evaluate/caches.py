"""The KV caches an evaluation can score, by name, and their configs for a model."""

from __future__ import annotations

import torch

from ..formats import KVCacheConfig, KVCacheDtype

UNQUANTIZED = "auto"
CACHES = {
    "e4m3": "e4m3, scale 1",
    "e4m3-checkpoint": "e4m3, checkpoint scales",
    "e4m3-tensor": "e4m3, calibrated per tensor",
    "e4m3-head": "e4m3, calibrated per head",
    "e5m2": "e5m2, scale 1",
}
CALIBRATED = {"e4m3-tensor": "tensor", "e4m3-head": "head"}
LABELS = {UNQUANTIZED: "unquantized (model dtype)", **CACHES}


def per_tensor(amax):
    """Per-tensor maxima from per-head ones (the maximum over each layer's heads: exactly what per-tensor
    calibration measures), so one calibration pass serves both granularities."""
    from ..calibration import KVAmax

    return KVAmax(tuple((max(heads),) for heads in amax.k), tuple((max(heads),) for heads in amax.v),
                  amax.num_tokens, amax.rotated)


def kv_cache_configs(model, windows: torch.Tensor, names, *, checkpoint_scales: KVCacheConfig | None = None,
                     progress: bool = True) -> dict[str, KVCacheConfig]:
    """`auto` and each cache of `names`, for `model`; calibrated ones on `windows` (one pass, per head)."""
    from ..calibration import calibrate

    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    e4m3 = KVCacheDtype.parse("fp8_e4m3")
    configs = {UNQUANTIZED: KVCacheConfig.unit_scales(UNQUANTIZED, num_layers)}
    amax = None
    for name in names:
        if name == "e4m3":
            configs[name] = KVCacheConfig.unit_scales(e4m3, num_layers)
        elif name == "e5m2":
            configs[name] = KVCacheConfig.unit_scales(KVCacheDtype.E5M2, num_layers)
        elif name == "e4m3-checkpoint":
            if checkpoint_scales is None:
                raise ValueError("--kv-cache-dtype e4m3-checkpoint needs scales: --scales CKPT, or a model with them")
            configs[name] = checkpoint_scales
        elif name in CALIBRATED:
            if amax is None:
                implementation = model.config._attn_implementation
                model.set_attn_implementation("sdpa")
                try:
                    amax = calibrate(model, [w[None] for w in windows], granularity="head", progress=progress)
                finally:
                    model.set_attn_implementation(implementation)
            configs[name] = (amax if CALIBRATED[name] == "head" else per_tensor(amax)).scales(e4m3)
        else:
            raise ValueError(f"--kv-cache-dtype: unknown cache {name!r}; valid: {', '.join(CACHES)}")
    return configs
