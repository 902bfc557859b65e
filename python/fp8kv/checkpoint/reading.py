"""Everything a checkpoint says about its KV cache scales, and every problem with it:
`read_checkpoint_scales`, which raises nothing for bad content, and the report of what it found."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

from ..formats import KVCacheDtype
from .config import CONFIG_FILE, check_geometry_arguments, model_geometry, model_head_size, quantization_hints
from .files import Reader, open_directory
from .legacy_json import legacy_json_path, read_legacy_json
from .problems import Fatal, Problem
from .rotated_recipe import RECIPE_FILE, RotatedRecipe, read_rotated_recipe
from .scale_tensors import FoundScale, tensor_scales
from .values import show


@dataclass(frozen=True)
class CheckpointScales:
    """Everything a checkpoint says about its KV cache scales, before any per-rank conversion.

    k, v: per layer (empty when the checkpoint has no scale tensors). legacy_json: the JSON file's
    per-rank per-layer scales (empty when there is none). head_size: config.json's (None when it
    does not say). rotated: the rotated recipe's scales and offsets (None without fp8kv_kv_cache.json).
    problems: everything found wrong.
    read: what could be read, in order: "config" (config.json: the model and what it declares),
    "scales" (the scale tensors); a reading stopped by a problem leaves the rest out.
    """

    directory: str
    model_type: str | None
    num_layers: int | None
    num_kv_heads: int | None
    calibrated_for: KVCacheDtype
    declared: tuple[str, ...]
    forms: tuple[str, ...]
    k: tuple[FoundScale, ...]
    v: tuple[FoundScale, ...]
    legacy_json: str | None
    legacy_json_scales: tuple[tuple[float, ...], ...]
    head_size: int | None
    rotated: RotatedRecipe | None
    problems: tuple[Problem, ...]
    read: tuple[str, ...]

    @property
    def has_scales(self) -> bool:
        return bool(self.k) or bool(self.legacy_json_scales)

    def report(self) -> list[str]:
        """The lines of a readable report: the model, what is declared, the scales (per layer, K and
        V, with the tensor holding each), and every problem, or that there is none. What could not
        be read (`read`) has no line."""
        lines = [f"checkpoint:      {self.directory}"]
        if "config" in self.read:
            lines += [
                f"model:           {self.model_type or '?'}, {self.num_layers} layers, {self.num_kv_heads} KV heads",
                f"declared:        {', '.join(self.declared) or 'nothing (no kv_cache_scheme / kv_cache_quant_algo)'}",
            ]
        if "scales" in self.read:
            lines += [f"scales:          {', '.join(self.forms) or 'none'}",
                      f"calibrated for:  {self.calibrated_for.value}"]
        if self.k:
            lines += self._scale_table()
        elif self.legacy_json_scales:
            lines.append(f"legacy JSON:     {self.legacy_json} (per tensor, one scale for K and V)")
            lines += [f"  rank {rank}: {_values(layers)}" for rank, layers in enumerate(self.legacy_json_scales)]
        elif "scales" in self.read and not self.problems:
            lines.append("note:            no KV cache scales: an e4m3 cache would use 1.0 in every layer (calibrate "
                         "first); e5m2 and unquantized caches need none")
        if self.problems:
            return lines + ["", f"{len(self.problems)} problem(s):"] + [f"  - {p}" for p in self.problems]
        return lines + self._rotated_lines() + ["", "no problems found"]

    def _scale_table(self) -> list[str]:
        per_head = any(len(s.values) > 1 for s in (*self.k, *self.v))
        lines = [f"granularity:     {'per KV head' if per_head else 'per tensor'}", "",
                 f"{'layer':>5}  {'kind':4}  scales"]
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            for kind, scale in (("K", k), ("V", v)):
                lines.append(f"{layer:>5}  {kind:4}  {_values(scale.values)}    ({scale.tensor})")
        return lines


    def _rotated_lines(self) -> list[str]:
        recipe = self.rotated
        if recipe is None:
            fallback = "the plain scales times sqrt(block size)" if self.has_scales else "scale 1.0"
            return ["", f"rotated recipe:  no {RECIPE_FILE}: the rotated recipe (an FP8 cache's default) takes "
                        f"{fallback}"]
        offsets = "with K offsets (rotated + centred)" if recipe.k_offsets is not None else "no K offsets"
        lines = ["", f"rotated recipe:  {RECIPE_FILE}: Hadamard rotation, head size {recipe.head_size}, {offsets}, "
                     f"calibrated for {recipe.calibrated_for.value}", f"{'layer':>5}  {'kind':4}  scales"]
        for layer, (k, v) in enumerate(zip(recipe.k_scales, recipe.v_scales)):
            offset = ""
            if recipe.k_offsets is not None:
                offset = f"    (K offset: largest |mu| {max(abs(x) for row in recipe.k_offsets[layer] for x in row):.4g})"
            lines += [f"{layer:>5}  {'K':4}  {_values(k)}{offset}", f"{layer:>5}  {'V':4}  {_values(v)}"]
        return lines


def _values(scales) -> str:
    return " ".join(f"{s:.6g}" for s in scales)


def read_checkpoint_scales(
    checkpoint_dir: str | os.PathLike,
    *,
    scales_json: str | os.PathLike | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
) -> CheckpointScales:
    """Everything `checkpoint_dir` says about KV cache scales, and every problem found.

    Raises nothing for bad checkpoint content (it lands in `problems`), only for bad arguments.
    scales_json: a legacy kv_cache_scales.json to read (default: that file in the directory, if any;
        both at once is a problem: two sources of scales).
    num_layers, num_kv_heads: needed when config.json lacks num_hidden_layers / num_key_value_heads
        (a value given and a different one in config.json is a problem).
    """
    check_geometry_arguments(num_layers, num_kv_heads)
    reader = Reader(pathlib.Path(checkpoint_dir))
    state = dict(model_type=None, num_layers=num_layers, num_kv_heads=num_kv_heads, calibrated_for=KVCacheDtype.E4M3FN,
                 declared=(), forms=(), k=(), v=(), legacy_json=None, legacy_json_scales=(), head_size=None,
                 rotated=None, read=())
    try:
        _read_into(reader, state, scales_json)
    except Fatal:
        pass
    return CheckpointScales(directory=str(reader.directory), problems=tuple(reader.problems), **state)


def _read_into(reader: Reader, state: dict, scales_json) -> None:
    open_directory(reader)
    config_path = reader.path(CONFIG_FILE)
    if not os.path.lexists(config_path):
        raise reader.fatal(config_path, None, "missing (needed for the layer and head counts)")
    config = reader.json_object(config_path)
    state["model_type"] = config.get("model_type")
    if state["model_type"] is not None and not isinstance(state["model_type"], str):
        reader.problem(config_path, "model_type", f"must be a string, got {show(state['model_type'])}")
        state["model_type"] = None
    num_layers, num_kv_heads = model_geometry(reader, config, state["num_layers"], state["num_kv_heads"])
    state["num_layers"], state["num_kv_heads"] = num_layers, num_kv_heads
    declared, required, granularity, dtype_hints = quantization_hints(reader, config)
    state.update(declared=tuple(declared), head_size=model_head_size(config), read=("config",))

    (k, v), forms = tensor_scales(reader, num_layers, num_kv_heads, granularity)
    state.update(forms=forms, k=k, v=v, read=("config", "scales"))
    json_path, json_read = legacy_json_path(reader, scales_json), None
    if json_path is not None:
        try:
            json_read = read_legacy_json(reader, json_path, num_layers, state["model_type"])
        except Fatal:
            pass  # the file's problem is recorded; the checkpoint's own scales are still reported
    if json_read is not None:
        json_scales, json_dtype = json_read
        if json_dtype is not None:
            dtype_hints.append((str(json_path), "kv_cache.dtype", json_dtype))
        if forms:
            reader.problem(json_path, None, f"conflicting sources: the safetensors files also hold scales ({', '.join(forms)})")
        state.update(legacy_json=str(json_path), legacy_json_scales=json_scales)
        forms = (*forms, "legacy kv_cache_scales.json")
    if required and not forms and not reader.tensor_file_unread:  # else that file's problem says why
        reader.problem(config_path, "quantization_config", f"declares {' and '.join(declared)} but no scale tensors were found")

    formats = {fmt for _, _, fmt in dtype_hints}
    if len(formats) > 1:
        sources = ", ".join(f"{pathlib.Path(f).name} {name} = {fmt.value}" for f, name, fmt in dtype_hints)
        reader.problem(dtype_hints[0][0], dtype_hints[0][1], f"conflicting calibration formats: {sources}")
    elif formats:
        state["calibrated_for"] = formats.pop()
    state.update(forms=forms)
    state["rotated"] = read_rotated_recipe(reader, num_layers, num_kv_heads, state["head_size"])
