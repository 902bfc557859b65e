"""Writing scales into a checkpoint (`export_checkpoint`) or a legacy JSON file (`export_legacy_json`).

This module decides what is written where; `fp8kv.commit` writes it, all or nothing.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import struct
from contextlib import nullcontext
from typing import Iterable, NamedTuple

import torch

from .. import commit, distributed
from ..checkpoint.config import CONFIG_FILE
from ..checkpoint.files import read_json_object, read_safetensors_header
from ..checkpoint.problems import CheckpointError
from ..checkpoint.reading import read_checkpoint_scales
from ..checkpoint.rotated_recipe import RECIPE_FILE, RotatedRecipe
from ..checkpoint.scale_tensors import module_and_layer
from ..checkpoint.tensor_files import INDEX_FILE, checkpoint_tensor_names
from ..checkpoint.values import format_ranges
from ..formats import KVCacheConfig, KVCacheDtype
from ..rotation import Rotation

SCALES_FILE = "kv_cache_scales.safetensors"
SINGLE_FILE = "model.safetensors"
_STRATEGIES = {"tensor": "tensor", "head": "attn_head"}
_sendfile = getattr(os, "sendfile", None)  # absent on Windows


def export_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, kv_cache: KVCacheConfig, *,
                      rotated: KVCacheConfig | None = None, module_template: str | None = None,
                      group=None) -> pathlib.Path:
    """Writes `kv_cache`'s scales (all KV heads) into a checkpoint; returns the output directory.

    model_dir: the source checkpoint (config.json + safetensors), without KV cache scales.
    out_dir: a new or empty directory outside model_dir, which becomes a copy of model_dir plus the
        scales; or model_dir itself, to add the scales in place.
    The scales are `P.k_scale` / `P.v_scale` float32 tensors ([1] per tensor, [num_kv_heads, 1, 1]
    per head). A sharded checkpoint gets them in an added shard, kv_cache_scales.safetensors,
    registered in model.safetensors.index.json; a single-file checkpoint gets them in its
    model.safetensors (rewritten: transformers reads that file alone whenever it exists).
    config.json's quantization_config gets `kv_cache_scheme` (a new compressed-tensors
    quantization_config when there is none) and, for e4m3fnuz scales, `kv_cache_torch_dtype`.
    kv_cache is the plain recipe's (what every engine reads); `rotated`, the rotated recipe's scales
    and K offsets (docs/rotated_cache.md), go into fp8kv_kv_cache.json in the same commit.
    module_template: the attention module of layer {} (e.g. 'model.layers.{}.self_attn'); found from
        the k_proj / qkv_proj weight names when omitted.
    The export is all-or-nothing. In place, the changed files are committed together (see `fp8kv.commit`):
    after a crash the checkpoint is the old or the new one, and running the export again finishes
    or redoes it (exporting the scales a checkpoint already holds does nothing). A copy is made in
    a temporary sibling of out_dir, renamed to out_dir once complete.
    Under torch.distributed only rank 0 of `group` writes, and every rank returns (or raises) once it is done.
    """
    source, out = pathlib.Path(model_dir), pathlib.Path(out_dir)
    if kv_cache.rotation is not Rotation.NONE:
        raise ValueError(f"kv_cache: the scales engines read are the plain recipe's; got a {kv_cache.recipe} config "
                         "(pass it as rotated=)")
    if rotated is not None and (rotated.rotation is not Rotation.HADAMARD or rotated.dtype is not kv_cache.dtype):
        raise ValueError(f"rotated: must be a rotated recipe for {kv_cache.dtype.value}, got a {rotated.recipe} "
                         f"{rotated.dtype.value} config")
    contents = _Contents(kv_cache, rotated, module_template)
    if out.exists() and out.resolve() == source.resolve():
        write = functools.partial(_export_in_place, source, contents)
    else:
        write = functools.partial(_export_copy, source, out, contents)
    distributed.on_writer(write, group)
    return out


def scales_file(model_dir: str | os.PathLike) -> str:
    """The file of `model_dir` that an export writes the scales into: kv_cache_scales.safetensors for
    a sharded checkpoint (one with an index), model.safetensors for a single-file one."""
    directory = pathlib.Path(model_dir)
    if (directory / INDEX_FILE).exists():
        return SCALES_FILE
    if [p.name for p in directory.glob("*.safetensors")] == [SINGLE_FILE]:
        return SINGLE_FILE
    raise ValueError(f"{directory} has neither {INDEX_FILE} nor a lone {SINGLE_FILE}: no file that every loader "
                     "reads could take the scales")


class _Contents(NamedTuple):
    """What an export writes: the plain recipe's scales, the rotated recipe's (or None), and the
    attention module template (None: found from the weight names)."""

    kv_cache: KVCacheConfig
    rotated: KVCacheConfig | None
    module_template: str | None


def _export_in_place(directory: pathlib.Path, contents: _Contents) -> None:
    with commit.locked(directory):
        commit.recover(directory)  # an interrupted export first: it decides what the checkpoint holds
        files = _checked_contents(directory, contents, in_place=True)
        if files is not None:
            commit.replace_files(directory, _writers(directory, *files, contents.kv_cache))


def _export_copy(source: pathlib.Path, out: pathlib.Path, contents: _Contents) -> None:
    # A missing source is reported by the checkpoint reader, by name.
    with commit.locked(source, shared=True) if source.is_dir() else nullcontext():
        if commit.committed_files(source) is not None:
            raise ValueError(f"{source} holds an interrupted export ({commit.JOURNAL}): export into it in place "
                             "again to finish it")
        files = _checked_contents(source, contents, in_place=False)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"output directory {out} exists and is not empty")
        if out.resolve().is_relative_to(source.resolve()):
            raise ValueError(f"output directory {out} is inside the model directory {source}, so the copy would "
                             f"contain itself; write it elsewhere, or into {source} itself to add the scales in place")
        with commit.new_directory(out) as stage:
            _copy(source, stage, out)
            commit.replace_files(stage, _writers(stage, *files, contents.kv_cache))


def _checked_contents(directory: pathlib.Path, contents: _Contents, *,
                      in_place: bool) -> tuple[dict[str, torch.Tensor], RotatedRecipe | None] | None:
    """The scale tensors and the rotated recipe's file to write into `directory` after every check;
    None when an in-place export finds them there already (declared as this export declares them)."""
    kv_cache = contents.kv_cache
    found = read_checkpoint_scales(directory)
    if found.problems:
        raise CheckpointError(found.problems)
    _check_geometry(kv_cache, found.num_layers, found.num_kv_heads, directory)
    tensors = _scale_tensors(kv_cache, _module_template(directory, found.num_layers, contents.module_template))
    recipe = None
    if contents.rotated is not None:
        _check_geometry(contents.rotated, found.num_layers, found.num_kv_heads, directory)
        if found.head_size is None:
            raise ValueError(f"{directory}/{CONFIG_FILE} gives no head size (head_dim, or hidden_size and "
                             f"num_attention_heads), which {RECIPE_FILE} records")
        recipe = RotatedRecipe(kv_cache.dtype, found.head_size, found.num_kv_heads, contents.rotated.k_scales,
                               contents.rotated.v_scales, contents.rotated.k_offsets)
    if found.has_scales or found.declared or found.rotated is not None:
        if in_place and _holds(directory, found, tensors, recipe, kv_cache):
            return None
        forms = found.forms + found.declared + ((RECIPE_FILE,) if found.rotated is not None else ())
        raise ValueError(f"{directory} already has KV cache scales ({', '.join(forms)}); calibrate from the "
                         "checkpoint without them")
    for name in (SCALES_FILE, RECIPE_FILE):
        if (name == RECIPE_FILE or scales_file(directory) == SCALES_FILE) and (directory / name).exists():
            raise FileExistsError(f"{directory / name} already exists")
    return tensors, recipe


def _holds(directory: pathlib.Path, found, tensors: dict[str, torch.Tensor], recipe: RotatedRecipe | None,
           kv_cache: KVCacheConfig) -> bool:
    stored = {scale.tensor: scale.values for scale in (*found.k, *found.v)}
    wanted = {name: tuple(t.flatten().tolist()) for name, t in tensors.items()}
    quant = read_json_object(directory / CONFIG_FILE).get("quantization_config")
    return (stored == wanted and found.rotated == recipe and found.calibrated_for is kv_cache.dtype
            and isinstance(quant, dict) and quant == _quantization_config(quant, kv_cache))


def _writers(directory: pathlib.Path, tensors: dict[str, torch.Tensor], recipe: RotatedRecipe | None,
             kv_cache: KVCacheConfig) -> dict:
    """{file name: writer} for the files the export changes, in commit order. The rotated recipe's
    file and config.json, which declares the scales (and e4m3fnuz), come before the file that makes
    them visible (the index or model.safetensors): a reader that ignores the commit journal then
    never reads undeclared scales (e4m3fnuz scales as e4m3fn), it finds the declared ones missing."""
    config = read_json_object(directory / CONFIG_FILE)
    config["quantization_config"] = _quantization_config(config.get("quantization_config"), kv_cache)
    first = {RECIPE_FILE: commit.json_writer(recipe.to_json())} if recipe is not None else {}
    if scales_file(directory) == SINGLE_FILE:
        rewrite = functools.partial(_write_safetensors, tensors=tensors, base=directory / SINGLE_FILE)
        return {**first, CONFIG_FILE: commit.json_writer(config), SINGLE_FILE: rewrite}
    index = read_json_object(directory / INDEX_FILE)
    index["weight_map"].update(dict.fromkeys(tensors, SCALES_FILE))
    metadata = index.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("total_size"), int):
        metadata["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    return {**first, SCALES_FILE: functools.partial(_write_safetensors, tensors=tensors),
            CONFIG_FILE: commit.json_writer(config), INDEX_FILE: commit.json_writer(index)}


def _write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], base: pathlib.Path | None = None) -> None:
    """Writes float32 `tensors` as a safetensors file, followed by the tensors and metadata of the
    safetensors file `base`, streamed byte for byte. The new tensors come first: their bytes (K/V
    pairs of float32, a multiple of 8) move the old tensors' offsets without changing their alignment."""
    blobs = [struct.pack(f"<{t.numel()}f", *t.flatten().tolist()) for t in tensors.values()]
    entries, end = {}, 0
    for (name, t), blob in zip(tensors.items(), blobs):
        entries[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [end, end + len(blob)]}
        end += len(blob)
    metadata = {"format": "pt"}
    if base is not None:
        old_entries, data_start = _copied_entries(base)
        metadata = old_entries.pop("__metadata__", None)
        for entry in old_entries.values():
            entry["data_offsets"] = [offset + end for offset in entry["data_offsets"]]
        entries.update(old_entries)
    header = {"__metadata__": metadata, **entries} if metadata else entries
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        out.writelines(blobs)
        if base is not None:
            _append_file(out, base, data_start)


def _append_file(out, path: pathlib.Path, start: int) -> None:
    """Appends the bytes of the file `path` from `start` on to the open file `out`: in the kernel
    (os.sendfile; a checkpoint's weights are gigabytes, copied through Python several times slower)
    where it copies between files, else through Python."""
    out.flush()
    offset = start
    with open(path, "rb") as f:
        if _sendfile is not None:
            try:
                while sent := _sendfile(out.fileno(), f.fileno(), offset, 1 << 30):
                    offset += sent
                return
            except OSError:  # not between files (macOS)
                if offset != start:  # it did copy: a real error
                    raise
        f.seek(start)
        shutil.copyfileobj(f, out, 1 << 24)


def _copied_entries(path: pathlib.Path) -> tuple[dict, int]:
    """The header entries of safetensors file `path` and where its data starts. Its data is copied
    whole behind the new tensors, every offset moved: read_safetensors_header has checked that the
    entries' offsets fill the data and that the metadata is what safetensors reads."""
    header = read_safetensors_header(path)
    return header.entries, header.data_start


def _copy(source: pathlib.Path, stage: pathlib.Path, out: pathlib.Path) -> None:
    """Copies the checkpoint `source` into `stage` (a temporary stand-in for `out`), without the
    temporaries of an interrupted export."""
    def temporaries(_, names):
        return [name for name in names if commit.is_temporary(name)]

    try:
        shutil.copytree(source, stage, dirs_exist_ok=True, ignore=temporaries)
    except shutil.Error as e:
        failures = e.args[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise OSError(f"cannot copy {source} to {out}: {failures[0][0]}: {failures[0][2]}{more}") from None
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        raise OSError(e.errno, f"cannot copy {source} to {out}: {where}{e.strerror or e}") from None


def _check_geometry(kv_cache: KVCacheConfig, num_layers: int, num_kv_heads: int, source: pathlib.Path) -> None:
    if not kv_cache.dtype.is_e4m3:
        raise ValueError(f"checkpoints hold scales calibrated for float8_e4m3fn or float8_e4m3fnuz, not "
                         f"{kv_cache.dtype.value}")
    if kv_cache.num_layers != num_layers:
        raise ValueError(f"the scales cover {kv_cache.num_layers} layers, {source}/{CONFIG_FILE} has {num_layers}")
    widths = sorted({len(s) for s in (*kv_cache.k_scales, *kv_cache.v_scales)})
    if len(widths) != 1 or widths[0] not in (1, num_kv_heads):
        raise ValueError(f"every layer needs 1 scale or num_kv_heads={num_kv_heads} scales (all KV heads of the "
                         f"model, not one tensor-parallel rank's), got {widths}")


# ----------------------------------------------------------------------------- module names

_PROJECTIONS = (".k_proj.weight", ".qkv_proj.weight")


def _module_template(directory: pathlib.Path, num_layers: int, given: str | None) -> str:
    """The attention module of layer {}: `given`, checked to name a module of every layer, or the
    module above the K projection when it is None."""
    names = checkpoint_tensor_names(directory)
    attention = _projection_modules(names)
    if given is None:
        complete = [t for t, layers in attention.items() if layers == set(range(num_layers))]
        if len(complete) != 1:
            seen = ", ".join(sorted(attention)) or "none"
            raise ValueError(f"cannot tell the attention modules of {directory} from its weight names (K projections "
                             f"of all {num_layers} layers found under: {seen}); pass module_template, e.g. "
                             "'model.layers.{}.self_attn'")
        return complete[0]
    rest = given.replace("{}", "", 1)
    if "{}" not in given or "{" in rest or "}" in rest:
        raise ValueError(f"module_template must contain '{{}}' once, for the layer index, and no other braces; "
                         f"got {given!r}")
    found = _layers_with_module(names, given, num_layers)
    missing = [layer for layer in range(num_layers) if layer not in found]
    if missing:
        examples = ", ".join(sorted(t.format(min(layers)) for t, layers in attention.items())) or "none found"
        raise ValueError(f"module_template {given!r} names no module of {directory} for layer(s) "
                         f"{format_ranges(missing)} (no tensor named '{given.format(missing[0])}.*'); attention "
                         f"modules of the checkpoint: {examples}")
    return given


def _layers_with_module(names: Iterable[str], template: str, num_layers: int) -> set[int]:
    """The layers l < num_layers with a tensor named `template.format(l)` + '.' + more. The work
    grows with the number of names and the template's length, not the names' (a name can be
    megabytes): only the characters where the template and a layer index can stand are compared."""
    head, tail = template.split("{}")
    tail += "."
    layers = {str(layer): layer for layer in range(num_layers)}
    widths = {len(index) for index in layers}
    found = set()
    for name in names:
        if name.startswith(head):
            for width in widths:
                index = name[len(head):len(head) + width]
                if index in layers and name.startswith(tail, len(head) + width):
                    found.add(layers[index])
    return found


def _projection_modules(names: Iterable[str]) -> dict[str, set[int]]:
    """{'model.layers.{}.self_attn': {0, 1, ...}}: the modules holding a K projection, by layer."""
    layers_by_template: dict[str, set[int]] = {}
    for name in names:
        suffix = next((s for s in _PROJECTIONS if name.endswith(s)), None)
        parsed = module_and_layer(name, suffix) if suffix else None
        if parsed:
            template, layer = parsed
            layers_by_template.setdefault(template, set()).add(layer)
    return layers_by_template


# ----------------------------------------------------------------------------- contents


def _scale_tensors(kv_cache: KVCacheConfig, template: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in range(kv_cache.num_layers):
        module = template.format(layer)
        for kind, values in (("k", kv_cache.k_scales[layer]), ("v", kv_cache.v_scales[layer])):
            t = torch.tensor(values, dtype=torch.float32)
            tensors[f"{module}.{kind}_scale"] = t if len(values) == 1 else t.reshape(-1, 1, 1)
    return tensors


def _quantization_config(existing, kv_cache: KVCacheConfig) -> dict:
    """config.json's quantization_config with the kv_cache_scheme merged in."""
    granularity = "tensor" if len(kv_cache.k_scales[0]) == 1 else "head"
    scheme = {"num_bits": 8, "type": "float", "strategy": _STRATEGIES[granularity], "dynamic": False,
              "symmetric": True}
    # A model without quantization gets the compressed-tensors config llm-compressor writes for a
    # KV-cache-only recipe: dense weights, no config groups.
    quant = dict(existing) if existing else {"quant_method": "compressed-tensors", "format": "dense",
                                             "quantization_status": "frozen", "config_groups": {}, "ignore": []}
    quant["kv_cache_scheme"] = scheme
    if kv_cache.dtype is KVCacheDtype.E4M3FNUZ:
        quant["kv_cache_torch_dtype"] = KVCacheDtype.E4M3FNUZ.value
    return quant


def export_legacy_json(path: str | os.PathLike, kv_cache: KVCacheConfig, *, model_type: str | None = None,
                       group=None) -> pathlib.Path:
    """Writes the legacy `{"model_type", "kv_cache": {"dtype", "scaling_factor": {"0": {layer: s}}}}`.

    The format holds one scale per layer for K and V together: max(k_scale, v_scale), so neither
    saturates. Per-tensor scales only. Keep the file out of a checkpoint that already holds scale
    tensors (the loader refuses two sources); pass it to the loader as scales_json. The file is
    replaced atomically.
    """
    if any(len(s) != 1 for s in (*kv_cache.k_scales, *kv_cache.v_scales)):
        raise ValueError("the legacy JSON holds per-tensor scales; calibrate with granularity 'tensor'")
    if not kv_cache.dtype.is_e4m3:
        raise ValueError(f"the legacy JSON holds e4m3 scales, not {kv_cache.dtype.value}")
    path = pathlib.Path(path)
    layers = {str(i): max(k[0], v[0]) for i, (k, v) in enumerate(zip(kv_cache.k_scales, kv_cache.v_scales))}
    data = {"kv_cache": {"dtype": kv_cache.dtype.value, "scaling_factor": {"0": layers}}}
    if model_type is not None:
        data = {"model_type": model_type, **data}

    def write():
        commit.remove_temporaries(path.parent, path.name)
        commit.replace_files(path.parent, {path.name: commit.json_writer(data)})

    distributed.on_writer(write, group)
    return path
