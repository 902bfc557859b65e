"""The legacy kv_cache_scales.json: {"model_type", "kv_cache": {"dtype", "scaling_factor": {rank: {layer: s}}}},
one scale per layer for K and V together, per tensor-parallel rank."""

from __future__ import annotations

import math
import os
import pathlib

from .config import CALIBRATION_FORMATS, CONFIG_FILE
from .files import Reader
from .values import float32, format_ranges, is_number, lookup, show

LEGACY_JSON_FILE = "kv_cache_scales.json"


def legacy_json_path(reader: Reader, scales_json) -> pathlib.Path | None:
    """The legacy JSON file to read: `scales_json`, else the directory's own, else None."""
    own = reader.path(LEGACY_JSON_FILE)
    if scales_json is None:
        return own if os.path.lexists(own) else None
    given = pathlib.Path(scales_json)
    if os.path.lexists(own) and not _same_file(given, own):
        reader.problem(own, None, f"conflicting sources: scales_json={str(given)!r} was also given; remove one")
    return given


def _same_file(a: pathlib.Path, b: pathlib.Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def read_legacy_json(reader: Reader, path: pathlib.Path, num_layers: int, model_type: str | None):
    """Per-rank per-layer scales and the calibration format of a kv_cache_scales.json file."""
    data = reader.json_object(path)
    file_model_type = data.get("model_type")
    if file_model_type is not None and model_type is not None and file_model_type != model_type:
        reader.problem(path, "model_type", f"is {show(file_model_type)} but {CONFIG_FILE} says {model_type!r}")
    kv_cache = data.get("kv_cache")
    if not isinstance(kv_cache, dict):
        raise reader.fatal(path, "kv_cache", "missing or not an object")
    dtype = kv_cache.get("dtype")
    calibrated_for = lookup(CALIBRATION_FORMATS, dtype)
    if calibrated_for is None:
        reader.problem(path, "kv_cache.dtype", f"must be one of {sorted(CALIBRATION_FORMATS)}, got {show(dtype)}")
    factors = kv_cache.get("scaling_factor")
    if not isinstance(factors, dict) or not factors:
        raise reader.fatal(path, "kv_cache.scaling_factor", "missing, empty or not an object of ranks")
    ranks = _int_keyed(reader, path, "kv_cache.scaling_factor", factors)
    if sorted(ranks) != list(range(len(ranks))):
        reader.problem(path, "kv_cache.scaling_factor",
                       f"ranks must be 0..{len(ranks) - 1}, got {format_ranges(sorted(ranks))}")
        return (), calibrated_for
    scales = []
    for rank in range(len(ranks)):
        where = f"kv_cache.scaling_factor[{rank}]"
        if not isinstance(ranks[rank], dict):
            reader.problem(path, where, "must be an object of layer: scale")
            continue
        layers = _int_keyed(reader, path, where, ranks[rank])
        if len(layers) != num_layers or max(layers) >= num_layers:  # keys are distinct and >= 0
            got = format_ranges(sorted(layers)) if layers else "none"
            reader.problem(path, where, f"must have layers 0..{num_layers - 1} ({CONFIG_FILE}), got {got}")
            continue
        values = []
        for layer, s in sorted(layers.items()):
            s32 = float32(s) if is_number(s) else None
            if s32 is None or not (math.isfinite(s32) and s32 > 0):
                reader.problem(path, f"{where}[{layer}]", f"must be a finite number > 0, got {show(s)}")
            values.append(s32)
        scales.append(tuple(values))
    return tuple(scales), calibrated_for


def _int_keyed(reader: Reader, path, where: str, mapping: dict) -> dict[int, object]:
    """`mapping` keyed by the numbers its keys spell; other keys, and two spelling one number, are problems."""
    result, spelled = {}, {}
    for key, value in mapping.items():
        # Decimal digits only (int() would also take ' 1', '+1', '1_0'), few enough to convert.
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            reader.problem(path, f"{where}[{show(key)}]", "key must be a non-negative integer (at most 18 digits)")
            continue
        number = int(key)
        if number in result:
            reader.problem(path, f"{where}[{key!r}]", f"repeats key {spelled[number]!r}: both are {number}")
            continue
        result[number], spelled[number] = value, key
    return result
