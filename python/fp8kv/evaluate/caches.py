"""The KV caches an evaluation can score, by name, and their configs for a model.

A cache is named FORMAT or FORMAT-SOURCE: FORMAT any FP8 format name (fp8kv.formats.format_names:
e4m3, fp8_e4m3, float8_e4m3fn, e5m2, ...), SOURCE where its scales come from (SOURCES): none for
scale 1, `checkpoint` for a checkpoint's, `tensor` / `head` for calibrated on the evaluation
windows. `cache_name` gives the one canonical spelling (`float8_e4m3fn-tensor`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..formats import KVCacheConfig, KVCacheDtype, format_names

UNQUANTIZED = "auto"
SOURCES = {"": "scale 1", "checkpoint": "checkpoint scales", "tensor": "calibrated per tensor",
           "head": "calibrated per head"}
# Evaluated by default (the checkpoint's scales only where there are some).
CACHES = ("e4m3", "e4m3-checkpoint", "e4m3-tensor", "e4m3-head", "e5m2")


def parse_cache(name: str) -> tuple[KVCacheDtype, str]:
    """The format and the scale source of the cache `name`; ValueError saying what a name is."""
    text, dash, source = name.partition("-")
    try:
        fmt = KVCacheDtype.parse(text)
    except ValueError:
        fmt = None
    if fmt is None or not fmt.is_fp8 or source not in SOURCES or bool(dash) != bool(source):
        raise ValueError(f"unknown cache {name!r}: expected FORMAT or FORMAT-SOURCE, FORMAT one of "
                         f"{format_names(lambda f: f.is_fp8)}; SOURCE one of {', '.join(filter(None, SOURCES))}")
    return fmt, source


def cache_name(name: str) -> str:
    """The canonical name of the cache `name` (`e4m3-tensor` -> `float8_e4m3fn-tensor` off MI300)."""
    fmt, source = parse_cache(name)
    return f"{fmt.value}-{source}" if source else fmt.value


def label(name: str) -> str:
    """What a cache is, for tables: its format and where its scales come from; other names as they are."""
    if name == UNQUANTIZED:
        return "unquantized (model dtype)"
    try:
        fmt, source = parse_cache(name)
    except ValueError:
        return name
    return f"{fmt.value}, {SOURCES[source]}"


def converted(kv_cache: KVCacheConfig, fmt: KVCacheDtype) -> KVCacheConfig:
    """`kv_cache`'s scales for a `fmt` cache, converted as the checkpoint loader converts them
    (KVCacheDtype.scale_factor_from: x2 for e4m3fnuz from e4m3fn scales, as they are for e5m2)."""
    factor = fmt.scale_factor_from(kv_cache.dtype)

    def scaled(layers):
        return [[s * factor for s in heads] for heads in layers]

    return dataclasses.replace(kv_cache, dtype=fmt, k_scales=scaled(kv_cache.k_scales),
                               v_scales=scaled(kv_cache.v_scales))


def per_tensor(amax):
    """Per-tensor maxima from per-head ones (the maximum over each layer's heads: exactly what per-tensor
    calibration measures), so one calibration pass serves both granularities."""
    from ..calibration import KVAmax

    return KVAmax(tuple((max(heads),) for heads in amax.k), tuple((max(heads),) for heads in amax.v),
                  amax.num_tokens)


def kv_cache_configs(model, windows: torch.Tensor, names, *, checkpoint_scales: KVCacheConfig | None = None,
                     progress: bool = True) -> dict[str, KVCacheConfig]:
    """`auto` and each cache of `names`, for `model`; calibrated ones on `windows` (one pass, per head)."""
    from ..calibration import calibrate

    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    configs = {UNQUANTIZED: KVCacheConfig.unit_scales(UNQUANTIZED, num_layers)}
    amax = None
    for name in names:
        fmt, source = parse_cache(name)
        if source == "":
            configs[name] = KVCacheConfig.unit_scales(fmt, num_layers)
        elif source == "checkpoint":
            if checkpoint_scales is None:
                raise ValueError(f"--kv-cache-dtype {name} needs scales: --scales CKPT, or a model with them")
            configs[name] = converted(checkpoint_scales, fmt)
        else:
            if amax is None:
                implementation = model.config._attn_implementation
                model.set_attn_implementation("sdpa")
                try:
                    amax = calibrate(model, [w[None] for w in windows], granularity="head", progress=progress)
                finally:
                    model.set_attn_implementation(implementation)
            # e5m2 uses scales calibrated for e4m3fn as they are, as it does a checkpoint's.
            calibrated_for = fmt if fmt.is_e4m3 else KVCacheDtype.E4M3FN
            configs[name] = converted((amax if source == "head" else per_tensor(amax)).scales(calibrated_for), fmt)
    return configs
