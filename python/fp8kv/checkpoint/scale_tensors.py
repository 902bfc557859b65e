"""KV cache scale tensors: found by name in the safetensors files, checked, one K and one V per layer.

Forms (attention module P, e.g. `model.layers.7.self_attn`):
- `P.k_scale`, `P.v_scale` (vLLM, llm-compressor, TGI): shape [], [1], [num_kv_heads] or
  [num_kv_heads, 1, 1], any float dtype;
- `P.kv_scale` (legacy, one scale for K and V); `P.k_proj.k_scale`, `P.v_proj.v_scale` (ModelOpt).
"""

from __future__ import annotations

import math
import os
import pathlib
import re
from dataclasses import dataclass

import torch

from .config import CONFIG_FILE
from .files import Reader
from .tensor_files import INDEX_FILE, directory_files, locate_tensors

# Scale tensor name suffixes, most specific first: (suffix, which cache tensors it scales, form).
_SCALE_SUFFIXES = (
    (".k_proj.k_scale", "k", "ModelOpt k_proj.k_scale"),
    (".v_proj.v_scale", "v", "ModelOpt v_proj.v_scale"),
    (".kv_scale", "kv", "legacy kv_scale"),
    (".k_scale", "k", "k_scale"),
    (".v_scale", "v", "v_scale"),
)


@dataclass(frozen=True)
class FoundScale:
    """One layer's K or V scale as stored: global heads, float32 values, and where it came from."""

    file: str
    tensor: str
    values: tuple[float, ...]


def _scale_tensor_files(reader: Reader) -> dict[str, pathlib.Path]:
    """Scale tensor name -> the file that holds it."""
    located = locate_tensors(reader)
    if os.path.lexists(reader.path(INDEX_FILE)):
        # A scales shard the index does not list is one that no loader reads: refuse rather than
        # fall back to unit scales.
        listed = {os.path.normpath(p) for p in located.values()}
        for name, path in directory_files(reader).items():
            if (name.endswith(".safetensors") and os.path.normpath(path) not in listed
                    and any(map(_scale_suffix, reader.tensor_names(path) or ()))):
                reader.problem(path, None, f"holds KV cache scale tensors but {INDEX_FILE} does not list this file")
    return {name: path for name, path in located.items() if _scale_suffix(name) is not None}


def _read_scale_tensor(reader: Reader, path: pathlib.Path, name: str, num_kv_heads: int) -> torch.Tensor | None:
    """Tensor `name` of `path`, read only if its shape is one a scale can have; None (and a problem) otherwise."""
    from safetensors import safe_open

    if name not in reader.tensor_names(path):  # a readable file: locate_tensors leaves the others out
        reader.problem(path, name, "listed in the index but not stored in this shard")
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            error = _shape_error(f.get_slice(name).get_shape(), num_kv_heads)
            if error is None:
                return f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error type for inconsistent headers and data
        error = f"cannot read tensor: {e}"
    reader.problem(path, name, error)
    return None


def _scale_suffix(name: str):
    for suffix, kind, form in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            return suffix, kind, form
    return None


def scale_values(tensor: torch.Tensor, num_kv_heads: int) -> tuple[tuple[float, ...] | None, str | None]:
    """A checkpoint scale tensor as float32 values ([1] or [num_kv_heads]), or (None, what is wrong)."""
    if not torch.is_floating_point(tensor):
        return None, f"dtype must be floating point, got {tensor.dtype}"
    error = _shape_error(list(tensor.shape), num_kv_heads)
    if error:
        return None, error
    values = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).tolist()
    for head, s in enumerate(values):
        if not (math.isfinite(s) and s > 0):
            where = f"[{head}] " if len(values) > 1 else ""
            return None, f"value {where}{s} must be finite and > 0 (as float32)"
    return tuple(values), None


def _shape_error(shape: list[int], num_kv_heads: int) -> str | None:
    if list(shape) in ([], [1], [num_kv_heads], [num_kv_heads, 1, 1]):
        return None
    return f"shape {list(shape)} is none of [], [1], [num_kv_heads] = [{num_kv_heads}], [{num_kv_heads}, 1, 1]"


# A layer index: a dotted name component of decimal digits (at most 18, so it converts to an int).
_LAYER_COMPONENT = re.compile(r"(?:^|\.)([0-9]{1,18})(?=\.|$)")


def module_and_layer(name: str, suffix: str) -> tuple[str, int] | None:
    """('model.layers.{}.self_attn', 7) for 'model.layers.7.self_attn.k_scale' and suffix '.k_scale':
    the module above `suffix` with its layer index (the first component of ASCII digits) as {}."""
    module = name[: -len(suffix)]
    match = _LAYER_COMPONENT.search(module)
    if match is None:
        return None
    return module[: match.start(1)] + "{}" + module[match.end(1):], int(match.group(1))


def tensor_scales(reader: Reader, num_layers: int, num_kv_heads: int, granularity: str | None):
    """Per-layer K and V FoundScale from the safetensors files, plus the forms seen."""
    candidates: dict[tuple[int, str], list[FoundScale]] = {}
    templates: dict[str, str] = {}
    forms: set[str] = set()
    for name, path in sorted(_scale_tensor_files(reader).items()):
        suffix, kind, form = _scale_suffix(name)
        parsed = module_and_layer(name, suffix)
        if parsed is None:
            reader.problem(path, name, "has no layer index in its name (expected e.g. model.layers.0.self_attn.k_scale)")
            continue
        template, layer = parsed
        templates.setdefault(template, name)
        if layer >= num_layers:
            reader.problem(path, name, f"layer {layer} is outside the model's {num_layers} layers ({CONFIG_FILE})")
            continue
        tensor = _read_scale_tensor(reader, path, name, num_kv_heads)
        values, error = scale_values(tensor, num_kv_heads) if tensor is not None else ((), None)
        if error:
            reader.problem(path, name, error)
            values = ()  # present but unusable: reported here, not again as missing
        if values and granularity == "tensor" and len(values) != 1:
            reader.problem(path, name, "kv_cache_scheme strategy 'tensor' needs one scale, got per-head scales")
        if values and granularity == "head" and len(values) != num_kv_heads:
            reader.problem(path, name, f"kv_cache_scheme strategy 'attn_head' needs {num_kv_heads} scales, got 1")
        forms.add(form)
        found = FoundScale(str(path), name, values)
        for target in ("k", "v") if kind == "kv" else (kind,):
            candidates.setdefault((layer, target), []).append(found)

    if len(templates) > 1:
        examples = ", ".join(sorted(templates.values()))
        reader.problem(reader.directory, None, f"scale tensors name different module patterns: {examples}")
    return _one_scale_per_layer(reader, candidates, num_layers), tuple(sorted(forms))


def _one_scale_per_layer(reader: Reader, candidates, num_layers: int):
    """Exactly one K and one V scale per layer, for all layers or none (candidates hold layers < num_layers).

    Walks the layers present, not range(num_layers): the work follows what the files hold.
    """
    if not candidates:
        return (), ()
    complete = True
    per_kind = {}
    for target in ("k", "v"):
        layers = sorted(layer for layer, kind in candidates if kind == target)
        for layer in layers:
            found = candidates[(layer, target)]
            if len(found) > 1:
                names = " and ".join(f"{f.tensor} ({pathlib.Path(f.file).name})" for f in found)
                reader.problem(found[0].file, found[0].tensor, f"conflicting {target}_scale sources for layer {layer}: {names}")
                complete = False
            elif not found[0].values:
                complete = False
        gaps = _gaps(layers, num_layers)
        if gaps and reader.tensor_file_unread:
            complete = False  # the missing scales may be in that file, whose problem is recorded
        elif gaps:
            example = candidates[(layers[0], target)][0] if layers else next(iter(candidates.values()))[0]
            expected = _with_layer(_as_kind(example.tensor, target), gaps[0][0])
            missing = ", ".join(f"{first}" if first == last else f"{first}-{last}" for first, last in gaps)
            reader.problem(
                example.file, expected,
                f"missing: no {target}_scale for layer(s) {missing} of the model's {num_layers}, "
                f"while {example.tensor} exists",
            )
            complete = False
        per_kind[target] = tuple(candidates[(layer, target)][0] for layer in layers)
    return (per_kind["k"], per_kind["v"]) if complete else ((), ())


def _gaps(present: list[int], end: int) -> list[tuple[int, int]]:
    """The (first, last) runs of [0, end) missing from `present` (sorted, distinct, all < end)."""
    gaps, start = [], 0
    for layer in (*present, end):
        if layer > start:
            gaps.append((start, layer - 1))
        start = layer + 1
    return gaps


def _as_kind(name: str, target: str) -> str:
    """The name of the `target` ('k' or 'v') scale next to scale tensor `name`, in its form."""
    for suffix, kind, _ in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if suffix.endswith("proj.k_scale") or suffix.endswith("proj.v_scale"):
                return f"{base}.{target}_proj.{target}_scale"
            return f"{base}.{target}_scale"
    return name


def _with_layer(name: str, layer: int) -> str:
    """`name` with its layer index replaced by `layer`."""
    match = _LAYER_COMPONENT.search(name)
    return name[: match.start(1)] + str(layer) + name[match.end(1):]

