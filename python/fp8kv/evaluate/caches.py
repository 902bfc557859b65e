"""The KV caches an evaluation can score, by name, and their configs for a model.

A cache is named FORMAT[-RECIPE][-SOURCE][-fp8math]: FORMAT any FP8 format name (fp8kv.formats.format_names:
e4m3, fp8_e4m3, float8_e4m3fn, e5m2, ...); RECIPE how K/V are stored (RECIPES, docs/rotated_cache.md):
left out (or `rotated`) for rotated, fp8kv's default as everywhere else, `plain`, `centred` for rotated +
centred; SOURCE where its
scales (and a centred cache's K offsets) come from (SOURCES): left out for scale 1 (a centred cache's
offsets then calibrated on the evaluation windows), `checkpoint` for a checkpoint's (the plain recipe's
k_scale / v_scale, the rotated recipe's fp8kv_kv_cache.json), `tensor` / `head` for calibrated on the
evaluation windows; `fp8math` attends to the cache in FP8 tensor-core math (`fp8_math`, docs/ops.md;
e4m3fn and e5m2 caches, compute capability 9.0 GPUs), next to the same cache in 16-bit math.
`cache_name` gives the one canonical spelling (`float8_e4m3fn-centred-tensor`; the default recipe left out).
"""

from __future__ import annotations

import dataclasses

import torch

from ..attention import FP8_MATH_FORMATS
from ..formats import KVCacheConfig, KVCacheDtype, format_names
from ..rotation import Rotation

UNQUANTIZED = "auto"
PLAIN = "plain"
RECIPES = {"": "rotated", PLAIN: "plain", "centred": "rotated + centred"}
ROTATED = "rotated"  # the default recipe spelled out (canonically it is left out)
SOURCES = {"": "scale 1", "checkpoint": "checkpoint scales", "tensor": "calibrated per tensor",
           "head": "calibrated per head"}
FP8_MATH = "fp8math"  # the last part of a cache attended to in FP8 math
# Evaluated by default (the checkpoint's recipes only where it has them).
CACHES = ("e4m3-plain", "e4m3-plain-checkpoint", "e4m3-plain-tensor", "e4m3-plain-head", "e4m3", "e4m3-centred",
          "e4m3-checkpoint", "e4m3-centred-checkpoint", "e5m2-plain", "e5m2", "e5m2-centred")


def parse_cache(name: str) -> tuple[KVCacheDtype, str, str]:
    """The format, recipe and scale source of the cache `name`; ValueError saying what a name is."""
    text, *rest = name.split("-")
    fp8_math = bool(rest) and rest[-1] == FP8_MATH
    if fp8_math:
        rest.pop()
    recipe = ""
    if rest and rest[0] == ROTATED:
        rest.pop(0)
    elif rest and rest[0] and rest[0] in RECIPES:
        recipe = rest.pop(0)
    source = rest.pop(0) if rest and rest[0] and rest[0] in SOURCES else ""
    try:
        fmt = KVCacheDtype.parse(text)
    except ValueError:
        fmt = None
    if fmt is None or not fmt.is_fp8 or rest:
        raise ValueError(f"unknown cache {name!r}: expected FORMAT[-RECIPE][-SOURCE][-{FP8_MATH}], FORMAT one of "
                         f"{format_names(lambda f: f.is_fp8)}; RECIPE one of {ROTATED} (or left out), "
                         f"{', '.join(filter(None, RECIPES))}; SOURCE one of "
                         f"{', '.join(filter(None, SOURCES))} (or left out: scale 1)")
    if fp8_math and fmt not in FP8_MATH_FORMATS:
        raise ValueError(f"cache {name!r}: FP8 math ({FP8_MATH}) reads {FP8_MATH_FORMATS[0].value} and "
                         f"{FP8_MATH_FORMATS[1].value} caches, not {fmt.value}")
    return fmt, recipe, source


def fp8_math(name: str) -> bool:
    """Whether the cache `name` is attended to in FP8 math."""
    return name.endswith(f"-{FP8_MATH}")


def cache_name(name: str) -> str:
    """The canonical name of the cache `name` (`e4m3-tensor` -> `float8_e4m3fn-tensor` off MI300)."""
    fmt, recipe, source = parse_cache(name)
    return "-".join(part for part in (fmt.value, recipe, source, FP8_MATH if fp8_math(name) else "") if part)


def label(name: str) -> str:
    """What a cache is, for tables: its format, recipe and where its scales come from; other names as they are."""
    if name == UNQUANTIZED:
        return "unquantized (model dtype)"
    try:
        fmt, recipe, source = parse_cache(name)
    except ValueError:
        return name
    return f"{fmt.value}, {RECIPES[recipe]}, {SOURCES[source]}" + (", FP8 math" if fp8_math(name) else "")


def converted(kv_cache: KVCacheConfig, fmt: KVCacheDtype) -> KVCacheConfig:
    """`kv_cache`'s scales for a `fmt` cache, converted as the checkpoint loader converts them
    (KVCacheDtype.scale_factor_from: x2 for e4m3fnuz from e4m3fn scales, as they are for e5m2);
    its recipe (rotation, K offsets in real units) unchanged."""
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
                  amax.num_tokens, amax.rotated)


def checkpoint_recipe(checkpoint: dict[Rotation, KVCacheConfig], recipe: str) -> KVCacheConfig | None:
    """The checkpoint's config for `recipe` (by rotation, as the pipeline loaded them), or None: a
    centred cache needs the rotated recipe's K offsets, a rotated one a rotated recipe without them."""
    config = checkpoint.get(Rotation.NONE if recipe == PLAIN else Rotation.HADAMARD)
    if config is not None and recipe != PLAIN and (config.k_offsets is not None) != (recipe == "centred"):
        return None
    return config


def kv_cache_configs(model, windows: torch.Tensor, names, *, checkpoint: dict[Rotation, KVCacheConfig] | None = None,
                     progress: bool = True) -> dict[str, KVCacheConfig]:
    """`auto` and each cache of `names`, for `model`: the checkpoint's configs by rotation, calibrated
    ones on `windows` (one pass, per head)."""
    from ..calibration import calibrate

    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    configs = {UNQUANTIZED: KVCacheConfig.unit_scales(UNQUANTIZED, num_layers)}
    amax = None
    for name in names:
        fmt, recipe, source = parse_cache(name)
        rotation = Rotation.NONE if recipe == PLAIN else Rotation.HADAMARD
        if source == "checkpoint":
            config = checkpoint_recipe(checkpoint or {}, recipe)
            if config is None:
                raise ValueError(f"--kv-cache-dtype {name} needs a checkpoint with that recipe's scales: --scales "
                                 "CKPT, or a model with them")
            configs[name] = converted(config, fmt)
            continue
        if (source or recipe == "centred") and amax is None:
            implementation = model.config._attn_implementation
            model.set_attn_implementation("sdpa")
            try:
                amax = calibrate(model, [w[None] for w in windows], granularity="head", progress=progress)
            finally:
                model.set_attn_implementation(implementation)
            if recipe != PLAIN and amax.rotated is None:
                raise ValueError(f"--kv-cache-dtype {name}: the model's head size has no rotation")
        if source == "":
            unit = KVCacheConfig.unit_scales(fmt, num_layers, rotation=rotation)
            if recipe == "centred":
                unit = dataclasses.replace(unit, source="unit scales, K offsets calibrated on the windows",
                                           k_offsets=amax.rotated.k_offsets)
            configs[name] = unit
            continue
        # e5m2 uses scales calibrated for e4m3fn as they are, as it does a checkpoint's.
        calibrated_for = fmt if fmt.is_e4m3 else KVCacheDtype.E4M3FN
        if recipe != PLAIN:
            config = amax.rotated.kv_cache(calibrated_for, source, centred=recipe == "centred")
        else:
            config = (amax if source == "head" else per_tensor(amax)).scales(calibrated_for)
        configs[name] = converted(config, fmt)
    return configs
