"""One tensor-parallel rank's KV cache config from a checkpoint: `load_kv_cache_config` takes the
recipe's scales (and K offsets), slices them to the rank's KV heads (`shard_kv_heads`) and converts
them to the cache format, raising CheckpointError on any problem of the checkpoint.
`shard_kv_cache_config` slices a whole model's KVCacheConfig the same way."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import warnings

from ..formats import KVCacheConfig, KVCacheDtype, default_rotation
from ..rotation import MIN_BLOCK, Rotation, hadamard_block
from .config import CONFIG_FILE, check_geometry_arguments, model_geometry
from .files import Reader, checked
from .problems import CheckpointError, Problem
from .reading import CheckpointScales, read_checkpoint_scales
from .rotated_recipe import RECIPE_FILE
from .scale_tensors import FoundScale
from .values import check_int_argument, float32


def shard_kv_heads(values: tuple[float, ...], tp_rank: int, tp_size: int) -> tuple[float, ...]:
    """The per-head values of tensor-parallel rank `tp_rank` (one value = per tensor: unchanged).

    KV heads are split evenly across ranks (num_kv_heads % tp_size == 0); with fewer KV heads than
    ranks each head is replicated on tp_size / num_kv_heads consecutive ranks, which then hold one
    head each (tp_size % num_kv_heads == 0).
    """
    heads = len(values)
    if heads == 1:
        return values
    if heads % tp_size == 0:
        per_rank = heads // tp_size
        return values[tp_rank * per_rank:(tp_rank + 1) * per_rank]
    if tp_size % heads == 0:
        return (values[tp_rank // (tp_size // heads)],)
    raise ValueError(
        f"num_kv_heads={heads} cannot be split across tp_size={tp_size} ranks: one must divide the other"
    )


def shard_kv_cache_config(kv_cache: KVCacheConfig, tp_rank: int, tp_size: int) -> KVCacheConfig:
    """The KVCacheConfig of tensor-parallel rank `tp_rank` from the whole model's: its per-head scales
    and K offsets sliced to the rank's KV heads as `shard_kv_heads` slices them (per-tensor scales
    unchanged)."""
    check_int_argument("tp_size", tp_size, 1)
    check_int_argument("tp_rank", tp_rank, 0, tp_size)
    k, v = ([shard_kv_heads(layer, tp_rank, tp_size) for layer in scales]
            for scales in (kv_cache.k_scales, kv_cache.v_scales))
    offsets = None
    if kv_cache.k_offsets is not None:
        offsets = [shard_kv_heads(rows, tp_rank, tp_size) for rows in kv_cache.k_offsets]
    return dataclasses.replace(kv_cache, k_scales=k, v_scales=v, k_offsets=offsets,
                               source=f"{kv_cache.source}; tensor-parallel rank {tp_rank} of {tp_size}")


def load_kv_cache_config(
    checkpoint_dir: str | os.PathLike,
    cache_dtype: KVCacheDtype | str,
    *,
    rotation: Rotation | str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    scales_json: str | os.PathLike | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
) -> KVCacheConfig:
    """The KV cache format, recipe and scales of one tensor-parallel rank, from a local checkpoint directory.

    cache_dtype: the cache format (a KVCacheDtype or a name such as 'fp8_e4m3', see
        KVCacheDtype.parse). 'auto' (unquantized) reads only the layer count: it has no scales.
    rotation: the recipe's rotation (docs/rotated_cache.md); None takes the default: Rotation.HADAMARD
        for FP8 formats where the checkpoint has the rotated recipe's file or config.json gives a head
        size divisible by 16, Rotation.NONE (the plain recipe, what other engines store) otherwise, as
        the config's source says.
    The plain recipe uses the checkpoint's scales (k_scale / v_scale and the other forms other engines
    read). The rotated recipe uses fp8kv_kv_cache.json (written by `python -m fp8kv calibrate`): its
    scales, and its K offsets when it has them. Without that file it uses the plain scales times
    sqrt(b), b the rotation's block size: a rotated element is at most sqrt(b) times a row's largest,
    so nothing the plain scales keep in range saturates (the source says so).
    Scales are sliced to this rank's KV heads and converted from the format they were calibrated for
    (e4m3fn unless the checkpoint says e4m3fnuz) to `cache_dtype`. With no scales in the checkpoint,
    an e4m3 cache uses 1.0 and warns once; e5m2 uses 1.0 silently (its range needs no scaling for
    typical activations).
    Raises CheckpointError (naming files and tensors) for every problem of the checkpoint, and
    TypeError / ValueError naming the argument for bad arguments.
    """
    dtype = KVCacheDtype.parse(cache_dtype)
    requested = None if rotation is None else Rotation.parse(rotation)
    rotation = default_rotation(dtype) if requested is None else requested
    check_int_argument("tp_size", tp_size, 1)
    check_int_argument("tp_rank", tp_rank, 0, tp_size)
    check_geometry_arguments(num_layers, num_kv_heads)
    if dtype is KVCacheDtype.UNQUANTIZED:
        if rotation is not Rotation.NONE:
            raise ValueError("rotation: an unquantized ('auto') cache stores K/V as they are; it must be 'none'")
        reader = Reader(pathlib.Path(checkpoint_dir))
        layers, _ = checked(reader, lambda r: model_geometry(r, r.json_object(r.path(CONFIG_FILE)),
                                                               num_layers, num_kv_heads))
        return KVCacheConfig.unit_scales(dtype, layers, "unquantized cache: no scales")
    found = read_checkpoint_scales(checkpoint_dir, scales_json=scales_json, num_layers=num_layers, num_kv_heads=num_kv_heads)
    if found.problems:
        raise CheckpointError(found.problems)
    if found.num_kv_heads % tp_size != 0 and tp_size % found.num_kv_heads != 0:
        raise ValueError(
            f"num_kv_heads={found.num_kv_heads} ({found.directory}/{CONFIG_FILE}) cannot be split across "
            f"tp_size={tp_size} ranks: one must divide the other"
        )
    if rotation is Rotation.HADAMARD and found.rotated is not None:
        return _rotated_recipe_config(found, dtype, tp_rank, tp_size)
    why_plain = None  # why the default recipe is the plain one here
    if found.head_size is None:
        why_plain = f"{CONFIG_FILE} gives no head size"
    elif hadamard_block(found.head_size) < MIN_BLOCK:
        why_plain = f"head size {found.head_size} has no rotation"
        if requested is Rotation.HADAMARD:
            raise ValueError(f"rotation: {found.directory}/{CONFIG_FILE} gives head size {found.head_size}, which has "
                             f"no rotation (it needs a head size divisible by {MIN_BLOCK}); use rotation='none'")
    if requested is None and why_plain is not None:
        rotation = Rotation.NONE
    plain = _plain_recipe_config(found, dtype, tp_rank, tp_size)
    if rotation is Rotation.NONE:
        if requested is None and why_plain is not None:
            return dataclasses.replace(plain, source=f"{plain.source}; plain recipe: {why_plain}")
        return plain
    return _rotated_from_plain(found, plain)


def _plain_recipe_config(found: CheckpointScales, dtype: KVCacheDtype, tp_rank: int, tp_size: int) -> KVCacheConfig:
    if not found.has_scales:
        if dtype.is_e4m3:
            warnings.warn(
                f"fp8kv: {found.directory} has no KV cache scales; the {dtype.value} cache uses scale 1.0 in every "
                f"layer, so |K|, |V| above {dtype.max_finite:g} saturate and small values lose precision. Calibrate "
                "scales for this model (python -m fp8kv calibrate) for accurate results.",
                stacklevel=3,
            )
        return KVCacheConfig.unit_scales(dtype, found.num_layers, f"no scales in {found.directory}: 1.0",
                                         rotation=Rotation.NONE)

    factor = dtype.scale_factor_from(found.calibrated_for)
    if found.legacy_json_scales:
        k_stored = v_stored = _json_rank_scales(found, tp_rank, tp_size)
        origin = found.legacy_json
    else:
        k_stored, v_stored = found.k, found.v
        origin = ", ".join(found.forms)
    problems = []
    k = [_for_rank(scale, tp_rank, tp_size, factor, dtype, problems) for scale in k_stored]
    v = [_for_rank(scale, tp_rank, tp_size, factor, dtype, problems) for scale in v_stored]
    if problems:
        raise CheckpointError(dict.fromkeys(problems))  # the legacy JSON's K and V scales are one source
    conversion = f", x{factor:g} for {dtype.value}" if factor != 1.0 else ""
    source = f"{found.directory}: {origin} (calibrated for {found.calibrated_for.value}{conversion})"
    return KVCacheConfig(dtype, k, v, source, Rotation.NONE)


def _rotated_recipe_config(found: CheckpointScales, dtype: KVCacheDtype, tp_rank: int, tp_size: int) -> KVCacheConfig:
    """The rotated recipe from the checkpoint's fp8kv_kv_cache.json."""
    recipe, file = found.rotated, str(pathlib.Path(found.directory) / RECIPE_FILE)
    factor = dtype.scale_factor_from(recipe.calibrated_for)
    problems = []
    k, v = ([_for_rank(FoundScale(file, f"layers[{layer}].{name}", values), tp_rank, tp_size, factor, dtype, problems)
             for layer, values in enumerate(scales)] for name, scales in (("k_scale", recipe.k_scales),
                                                                          ("v_scale", recipe.v_scales)))
    if problems:
        raise CheckpointError(problems)
    offsets = None
    if recipe.k_offsets is not None:
        offsets = [shard_kv_heads(rows, tp_rank, tp_size) for rows in recipe.k_offsets]
    conversion = f", x{factor:g} for {dtype.value}" if factor != 1.0 else ""
    source = f"{file} (calibrated for {recipe.calibrated_for.value}{conversion})"
    return KVCacheConfig(dtype, k, v, source, Rotation.HADAMARD, offsets)


def _rotated_from_plain(found: CheckpointScales, plain: KVCacheConfig) -> KVCacheConfig:
    """The rotated recipe without its own file: the plain scales spread by sqrt(block), or 1.0 without scales."""
    missing = f"{found.directory} has no {RECIPE_FILE}"
    if not found.has_scales:
        return KVCacheConfig(plain.dtype, plain.k_scales, plain.v_scales, f"{plain.source} ({missing})",
                             Rotation.HADAMARD)
    if found.head_size is None:
        raise CheckpointError([Problem(f"{found.directory}/{CONFIG_FILE}", "head_dim", (
            "missing (nor hidden_size / num_attention_heads): the rotated recipe spreads the plain scales by the "
            f"square root of its block size, which the head size decides; pass rotation='none' for the plain recipe, "
            f"or add {RECIPE_FILE} by calibrating"))])
    block = hadamard_block(found.head_size)
    factor = math.sqrt(block)
    k, v = ([tuple(float32(s * factor) for s in layer) for layer in scales] for scales in (plain.k_scales, plain.v_scales))
    source = f"{plain.source}, x{factor:g} (sqrt of the rotation's block, {block}) for the rotated values ({missing})"
    return KVCacheConfig(plain.dtype, k, v, source, Rotation.HADAMARD)


def _json_rank_scales(found: CheckpointScales, tp_rank: int, tp_size: int) -> list[FoundScale]:
    """This rank's per-layer scales of the legacy JSON file, each named by its place in the file."""
    ranks = found.legacy_json_scales
    if len(ranks) not in (1, tp_size):
        raise CheckpointError([Problem(
            found.legacy_json, "kv_cache.scaling_factor",
            f"has scales for {len(ranks)} tensor-parallel ranks; expected 1 or tp_size={tp_size}",
        )])
    # One rank: calibrated without tensor parallelism; a per-tensor scale covers any subset of the heads.
    rank = tp_rank if len(ranks) > 1 else 0
    return [FoundScale(found.legacy_json, f"kv_cache.scaling_factor[{rank}][{layer}]", (s,))
            for layer, s in enumerate(ranks[rank])]


def _for_rank(scale: FoundScale, tp_rank: int, tp_size: int, factor: float, dtype: KVCacheDtype,
              problems: list[Problem]) -> tuple[float, ...]:
    """This rank's heads of `scale`, converted by `factor` for a `dtype` cache.

    Multiplying a float32 by a power of two is exact unless it leaves float32's range (a scale near
    3.4e38 doubled for e4m3fnuz overflows, one near 1.4e-45 halved underflows): a problem naming
    the scale's file and tensor.
    """
    converted = []
    for s in shard_kv_heads(scale.values, tp_rank, tp_size):
        s32 = float32(s * factor)
        if not (math.isfinite(s32) and s32 > 0):
            problems.append(Problem(scale.file, scale.tensor, f"scale {s:g} x{factor:g} for the {dtype.value} cache is "
                                    f"{s32:g} in float32; it must be finite and > 0"))
        converted.append(s32)
    return tuple(converted)
