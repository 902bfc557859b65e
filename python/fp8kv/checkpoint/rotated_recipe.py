"""The rotated recipe's data in a checkpoint: fp8kv_kv_cache.json (docs/rotated_cache.md).

Calibration writes it next to the plain recipe's scales: the scales of the rotated (and centred) K
and V, and optionally the K offsets. JSON, not safetensors, so engines that load every
*.safetensors file of a directory never see it, and namespaced by its name and its first field, so
no engine mistakes its scales for plain ones. Read here with every field checked: version,
rotation, the format the scales were calibrated for, geometry, scales finite and > 0 in float32,
offsets finite; a problem names the file and the entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..formats import KVCacheDtype
from ..rotation import MIN_BLOCK, Rotation, hadamard_block
from .config import CALIBRATION_FORMATS
from .files import Reader
from .values import float32, is_int, is_number, lookup, show

RECIPE_FILE = "fp8kv_kv_cache.json"
VERSION = 1
_FIELDS = ("fp8kv_kv_cache", "rotation", "calibrated_for", "head_size", "num_kv_heads", "layers")
_LAYER_FIELDS = ("k_scale", "v_scale", "k_offset")


@dataclass(frozen=True)
class RotatedRecipe:
    """The rotated recipe's scales (per layer: 1 value or one per KV head, all heads) and K offsets
    (per layer [num_kv_heads][head_size], or None), calibrated for `calibrated_for`."""

    calibrated_for: KVCacheDtype
    head_size: int
    num_kv_heads: int
    k_scales: tuple[tuple[float, ...], ...]
    v_scales: tuple[tuple[float, ...], ...]
    k_offsets: tuple[tuple[tuple[float, ...], ...], ...] | None

    def to_json(self) -> dict:
        """The file's content (floats written in full: they read back as the same float32 values)."""
        layers = []
        for layer in range(len(self.k_scales)):
            entry = {"k_scale": list(self.k_scales[layer]), "v_scale": list(self.v_scales[layer])}
            if self.k_offsets is not None:
                entry["k_offset"] = [list(row) for row in self.k_offsets[layer]]
            layers.append(entry)
        return {"fp8kv_kv_cache": VERSION, "rotation": Rotation.HADAMARD.value,
                "calibrated_for": self.calibrated_for.value, "head_size": self.head_size,
                "num_kv_heads": self.num_kv_heads, "layers": layers}


def read_rotated_recipe(reader: Reader, num_layers: int, num_kv_heads: int,
                        head_size: int | None) -> RotatedRecipe | None:
    """The checkpoint's rotated recipe, None when it has no RECIPE_FILE (or the file has problems,
    which are recorded). head_size: the model's, when config.json says (checked against the file's)."""
    path = reader.path(RECIPE_FILE)
    if not path.exists() and not path.is_symlink():
        return None
    data = reader.json_object(path)
    problems_before = len(reader.problems)

    def problem(field, message):
        reader.problem(path, field, message)

    for name in data:
        if name not in _FIELDS:
            problem(name, f"unknown field (known: {', '.join(_FIELDS)})")
    if data.get("fp8kv_kv_cache") != VERSION:
        problem("fp8kv_kv_cache", f"must be {VERSION} (the file's version), got {show(data.get('fp8kv_kv_cache'))}")
    if data.get("rotation") != Rotation.HADAMARD.value:
        problem("rotation", f"must be {Rotation.HADAMARD.value!r}, got {show(data.get('rotation'))}")
    calibrated_for = lookup(CALIBRATION_FORMATS, data.get("calibrated_for"))
    if calibrated_for is None:
        problem("calibrated_for", f"must be one of {sorted(CALIBRATION_FORMATS)}, got {show(data.get('calibrated_for'))}")
    size = data.get("head_size")
    if not (is_int(size) and size > 0 and hadamard_block(size) >= MIN_BLOCK):
        problem("head_size", f"must be a positive integer divisible by {MIN_BLOCK}, got {show(size)}")
        size = None
    elif head_size is not None and size != head_size:
        problem("head_size", f"is {size} but config.json gives head size {head_size}")
    if data.get("num_kv_heads") != num_kv_heads:
        problem("num_kv_heads", f"must be the model's {num_kv_heads}, got {show(data.get('num_kv_heads'))}")
    layers = data.get("layers")
    if not (isinstance(layers, list) and len(layers) == num_layers):
        count = len(layers) if isinstance(layers, list) else show(layers)
        problem("layers", f"must be a list of the model's {num_layers} layers, got {count}")
        return None

    k_scales, v_scales, offsets = [], [], []
    for layer, entry in enumerate(layers):
        where = f"layers[{layer}]"
        if not isinstance(entry, dict):
            problem(where, f"must be an object, got {type(entry).__name__}")
            continue
        for name in entry:
            if name not in _LAYER_FIELDS:
                problem(f"{where}.{name}", f"unknown field (known: {', '.join(_LAYER_FIELDS)})")
        k_scales.append(_scales(problem, f"{where}.k_scale", entry.get("k_scale"), num_kv_heads))
        v_scales.append(_scales(problem, f"{where}.v_scale", entry.get("v_scale"), num_kv_heads))
        if "k_offset" in entry:
            offsets.append(_offsets(problem, f"{where}.k_offset", entry["k_offset"], num_kv_heads, size))
    if offsets and len(offsets) != num_layers:
        problem("layers", f"k_offset must be in every layer or in none; {len(offsets)} of {num_layers} have one")
    if len(reader.problems) > problems_before:
        return None
    return RotatedRecipe(calibrated_for, size, num_kv_heads, tuple(k_scales), tuple(v_scales),
                         tuple(offsets) if offsets else None)


def _scales(problem, where: str, values, num_kv_heads: int) -> tuple[float, ...]:
    if not (isinstance(values, list) and len(values) in (1, num_kv_heads)):
        problem(where, f"must be a list of 1 or num_kv_heads={num_kv_heads} numbers, got {show(values)}")
        return ()
    result = []
    for head, value in enumerate(values):
        s = float32(value) if is_number(value) else math.nan
        if not (math.isfinite(s) and s > 0):
            problem(f"{where}[{head}]", f"must be a number that is finite and > 0 in float32, got {show(value)}")
        result.append(s)
    return tuple(result)


def _offsets(problem, where: str, rows, num_kv_heads: int, head_size: int | None):
    if not (isinstance(rows, list) and len(rows) == num_kv_heads):
        problem(where, f"must be a list of num_kv_heads={num_kv_heads} rows, got {show(rows)}")
        return ()
    result = []
    for head, row in enumerate(rows):
        if not (isinstance(row, list) and (head_size is None or len(row) == head_size)):
            problem(f"{where}[{head}]", f"must be a list of head_size={head_size} numbers, got {show(row)}")
            continue
        values = [float32(v) if is_number(v) else math.nan for v in row]
        bad = [d for d, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            problem(f"{where}[{head}][{bad[0]}]", f"must be a number finite in float32, got {show(row[bad[0]])}")
        result.append(tuple(values))
    return tuple(result)

