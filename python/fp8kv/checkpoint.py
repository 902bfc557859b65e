"""Reading KV cache scales from a local checkpoint directory.

Two layers: `read_checkpoint_scales` gathers everything the checkpoint says about KV cache scales
(tensors, config hints, the legacy JSON file) and every problem with it, without raising for bad
content; `load_kv_cache_config` turns that into the `KVCacheConfig` of one tensor-parallel rank
and cache format, raising `CheckpointError` on any problem. `CheckpointScales.report` describes
the former (`python -m fp8kv inspect` prints it). `checkpoint_tensor_names` lists every tensor of
a checkpoint and the file holding it.

Checkpoint forms (attention module P, e.g. `model.layers.7.self_attn`):
- `P.k_scale`, `P.v_scale` (vLLM, llm-compressor, TGI): shape [], [1], [num_kv_heads] or
  [num_kv_heads, 1, 1], any float dtype;
- `P.kv_scale` (legacy, one scale for K and V); `P.k_proj.k_scale`, `P.v_proj.v_scale` (ModelOpt);
- config.json `quantization_config.kv_cache_scheme` (compressed-tensors: strategy tensor|attn_head),
  `kv_cache_quant_algo` (ModelOpt, also in hf_quant_config.json), `kv_cache_torch_dtype` (the
  format the scales were calibrated for: float8_e4m3fn, the default, or float8_e4m3fnuz);
- `kv_cache_scales.json`: {"model_type", "kv_cache": {"dtype", "scaling_factor": {rank: {layer: s}}}}.

Checkpoints come from untrusted sources, so reading is bounded: regular files only (a FIFO or
device is an error, not a hang), JSON files and safetensors headers up to MAX_JSON_BYTES, shard
paths of the index inside the directory, and work proportional to the entries the files hold,
never to a count a file declares.

An export into the directory that committed but did not finish its renames (a commit journal,
see `fp8kv.commit`) is read as finished: each file its journal lists is read from where the
journal says, so the checkpoint reads as the old one or the new one, never a mix.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import reprlib
import stat
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from . import commit
from .formats import KVCacheConfig, KVCacheDtype

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MODELOPT_FILE = "hf_quant_config.json"
LEGACY_JSON_FILE = "kv_cache_scales.json"

# Limits far above any real checkpoint (JSON files of a few MiB, a few hundred layers) that keep
# a hostile one from exhausting memory or time.
MAX_JSON_BYTES = 64 << 20  # a JSON file, or the JSON header of a safetensors file
MAX_NUM_LAYERS = 1 << 14  # a KVCacheConfig holds one entry per layer

# Scale tensor name suffixes, most specific first: (suffix, which cache tensors it scales, form).
_SCALE_SUFFIXES = (
    (".k_proj.k_scale", "k", "ModelOpt k_proj.k_scale"),
    (".v_proj.v_scale", "v", "ModelOpt v_proj.v_scale"),
    (".kv_scale", "kv", "legacy kv_scale"),
    (".k_scale", "k", "k_scale"),
    (".v_scale", "v", "v_scale"),
)
_CALIBRATION_FORMATS = {"float8_e4m3fn": KVCacheDtype.E4M3FN, "float8_e4m3fnuz": KVCacheDtype.E4M3FNUZ}
_STRATEGY_GRANULARITY = {"tensor": "tensor", "attn_head": "head"}


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the file, the tensor or field (if any), and what."""

    file: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.tensor}: {self.message}" if self.tensor else f"{self.file}: {self.message}"


class CheckpointError(ValueError):
    """A checkpoint's KV cache scales are missing, malformed or inconsistent."""

    def __init__(self, problems):
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid KV cache scales ({len(self.problems)} problem(s)):\n{lines}")


class _Fatal(Exception):
    """Reading cannot continue past this problem."""


@dataclass(frozen=True)
class FoundScale:
    """One layer's K or V scale as stored: global heads, float32 values, and where it came from."""

    file: str
    tensor: str
    values: tuple[float, ...]


@dataclass(frozen=True)
class CheckpointScales:
    """Everything a checkpoint says about its KV cache scales, before any per-rank conversion.

    k, v: per layer (empty when the checkpoint has no scale tensors). legacy_json: the JSON file's
    per-rank per-layer scales (empty when there is none). problems: everything found wrong.
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
    problems: tuple[Problem, ...]

    @property
    def has_scales(self) -> bool:
        return bool(self.k) or bool(self.legacy_json_scales)

    def report(self) -> list[str]:
        """The lines of a readable report: the model, what is declared, the scales (per layer, K and
        V, with the tensor holding each), and every problem, or that there is none."""
        lines = [
            f"checkpoint:      {self.directory}",
            f"model:           {self.model_type or '?'}, {self.num_layers or '?'} layers, "
            f"{self.num_kv_heads or '?'} KV heads",
            f"declared:        {', '.join(self.declared) or 'nothing (no kv_cache_scheme / kv_cache_quant_algo)'}",
            f"scales:          {', '.join(self.forms) or 'none'}",
            f"calibrated for:  {self.calibrated_for.value}",
        ]
        if self.k:
            lines += self._scale_table()
        elif self.legacy_json_scales:
            lines.append(f"legacy JSON:     {self.legacy_json} (per tensor, one scale for K and V)")
            lines += [f"  rank {rank}: {_values(layers)}" for rank, layers in enumerate(self.legacy_json_scales)]
        elif not self.problems:
            lines.append("note:            no KV cache scales: an e4m3 cache would use 1.0 in every layer (calibrate "
                         "first); e5m2 and unquantized caches need none")
        if self.problems:
            return lines + ["", f"{len(self.problems)} problem(s):"] + [f"  - {p}" for p in self.problems]
        return lines + ["", "no problems found"]

    def _scale_table(self) -> list[str]:
        per_head = any(len(s.values) > 1 for s in (*self.k, *self.v))
        lines = [f"granularity:     {'per KV head' if per_head else 'per tensor'}", "",
                 f"{'layer':>5}  {'kind':4}  scales"]
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            for kind, scale in (("K", k), ("V", v)):
                lines.append(f"{layer:>5}  {kind:4}  {_values(scale.values)}    ({scale.tensor})")
        return lines


def _values(scales) -> str:
    return " ".join(f"{s:.6g}" for s in scales)


class SafetensorsHeader(NamedTuple):
    """The JSON header of a safetensors file and where its tensor data lies."""

    entries: dict  # tensor name -> {"dtype", "shape", "data_offsets"}, and "__metadata__" if present
    data_start: int  # the file offset of the tensor data
    data_size: int  # bytes from data_start to the end of the file


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of safetensors file `path`, read as the loader reads it: a regular file (symlinks
    followed), a header length within the file and MAX_JSON_BYTES, a JSON object without repeated
    keys. Raises CheckpointError naming the file."""
    path = pathlib.Path(path)
    reader = _Reader(path.parent)
    try:
        return reader.safetensors_header(path)
    except _Fatal:
        raise CheckpointError(reader.problems) from None


@dataclass
class _Reader:
    """Accumulates problems while reading; each check records and moves on where it can.

    Every file is read through here: regular files only (symlinks followed), never more than
    MAX_JSON_BYTES of JSON, so no checkpoint can make the loader block or read without end.
    """

    directory: pathlib.Path
    problems: list[Problem] = field(default_factory=list)
    # File name -> the file to read for it, for the files a committed export's journal lists.
    committed: dict[str, pathlib.Path] = field(default_factory=dict)
    # safetensors file -> its tensor names (a dict for ordered, constant-time lookup); None: unreadable.
    _names: dict[pathlib.Path, dict[str, None] | None] = field(default_factory=dict)

    def path(self, name: str) -> pathlib.Path:
        """The file to read for the directory's file `name`."""
        return self.committed.get(name, self.directory / name)

    def problem(self, file, tensor, message) -> None:
        self.problems.append(Problem(str(file), tensor, message))

    def fatal(self, file, tensor, message) -> _Fatal:
        self.problem(file, tensor, message)
        return _Fatal()

    def read(self, path: pathlib.Path, offset: int, count: int) -> tuple[bytes, int]:
        """Up to `count` bytes of regular file `path` from `offset`, and the file's size."""
        why = _not_regular(path)
        if why:
            raise self.fatal(path, None, why)
        try:
            # O_NONBLOCK: a file replaced by a FIFO after the check above must not block the open.
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                f.seek(offset)
                return f.read(count) or b"", os.fstat(f.fileno()).st_size
        except OSError as e:
            raise self.fatal(path, None, f"cannot read: {e.strerror or e}") from None

    def json_object(self, path: pathlib.Path) -> dict:
        raw, _ = self.read(path, 0, MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise self.fatal(path, None, f"larger than {_mib(MAX_JSON_BYTES)} (MAX_JSON_BYTES): not a checkpoint file")
        return self.parse_json_object(path, raw)

    def parse_json_object(self, path: pathlib.Path, raw: bytes) -> dict:
        try:
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except UnicodeDecodeError as e:
            raise self.fatal(path, None, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
        except _DuplicateKey as e:
            raise self.fatal(path, None, f"duplicate key {_show(e.key)} in a JSON object") from None
        except RecursionError:
            raise self.fatal(path, None, "invalid JSON: nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, or an integer with too many digits to convert
            raise self.fatal(path, None, f"invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise self.fatal(path, None, f"must hold a JSON object, got {type(data).__name__}")
        return data

    def tensor_names(self, path: pathlib.Path) -> dict[str, None] | None:
        """The tensor names in the header of safetensors file `path` (read once); None if unreadable."""
        if path not in self._names:
            try:
                entries = self.safetensors_header(path).entries
                self._names[path] = dict.fromkeys(n for n in entries if n != "__metadata__")
            except _Fatal:
                self._names[path] = None
        return self._names[path]

    def safetensors_header(self, path: pathlib.Path) -> SafetensorsHeader:
        # Layout: an 8-byte little-endian header length, the JSON header, then the tensor data.
        length_bytes, size = self.read(path, 0, 8)
        if len(length_bytes) < 8:
            raise self.fatal(path, None, f"cannot read safetensors file: {size} bytes, shorter than the header length")
        length = int.from_bytes(length_bytes, "little")
        if length > size - 8:
            raise self.fatal(path, None, f"cannot read safetensors file: header length {length} exceeds the file "
                             f"({size} bytes)")
        if length > MAX_JSON_BYTES:
            raise self.fatal(path, None, f"cannot read safetensors file: header length {length} exceeds "
                             f"{_mib(MAX_JSON_BYTES)} (MAX_JSON_BYTES)")
        entries = self.parse_json_object(path, self.read(path, 8, length)[0])
        return SafetensorsHeader(entries, 8 + length, size - 8 - length)


def _not_regular(path: pathlib.Path) -> str | None:
    """Why `path` cannot be read as a regular file (after symlinks), or None when it can."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        return f"cannot be read: {getattr(e, 'strerror', None) or e}"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "a special file")
    return f"is {kind}, expected a regular file"


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object_pairs_hook: a dict, refusing repeated keys (json.loads would keep the last)."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 200, 200, 40


def _show(value) -> str:
    """repr of a value read from a user's file, shortened (one field can hold megabytes)."""
    return _SHORT.repr(value)


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


def _lookup(table: dict, value):
    """table[value] for a string naming an entry; None otherwise (a JSON list or object included)."""
    return table.get(value) if isinstance(value, str) else None


# ----------------------------------------------------------------------------- config.json


def _model_geometry(reader: _Reader, config: dict, num_layers: int | None, num_kv_heads: int | None):
    """num_layers and num_kv_heads from config.json (or its text_config), checked against the caller's."""
    path = reader.path(CONFIG_FILE)
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def field_value(*names):
        for source in (config, text_config):
            for name in names:
                if source.get(name) is not None:
                    return name, source[name]
        return None, None

    result = []
    for label, given, names, limit in (
        ("num_layers", num_layers, ("num_hidden_layers",), MAX_NUM_LAYERS),
        ("num_kv_heads", num_kv_heads, ("num_key_value_heads", "num_attention_heads"), None),
    ):
        name, value = field_value(*names)
        if value is not None and not (_is_int(value) and value > 0):
            reader.problem(path, name, f"must be a positive integer, got {_show(value)}")
            value = None
        if value is not None and limit is not None and value > limit:
            raise reader.fatal(path, name, f"is {_show(value)}, above the limit of {limit} (MAX_NUM_LAYERS)")
        if value is not None and given is not None and value != given:
            reader.problem(path, name, f"is {value} but {label}={given} was given")
        if value is None and given is None:
            raise reader.fatal(path, names[0], f"missing; pass {label}= to the loader")
        result.append(value if value is not None else given)
    return result


def _quantization_hints(reader: _Reader, config: dict) -> tuple[list[str], bool, str | None, list]:
    """Checks the config hints. Returns (declared schemes, scales required, granularity, dtype hints)."""
    path = reader.path(CONFIG_FILE)
    declared, required, granularity, dtype_hints = [], False, None, []
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        reader.problem(path, "quantization_config", f"must be an object, got {type(quant).__name__}")
        quant = None
    quant = quant or {}

    scheme = quant.get("kv_cache_scheme")
    if scheme is not None:
        where = "quantization_config.kv_cache_scheme"
        if not isinstance(scheme, dict):
            reader.problem(path, where, f"must be an object or null, got {type(scheme).__name__}")
        else:
            strategy = scheme.get("strategy", "tensor")
            granularity = _lookup(_STRATEGY_GRANULARITY, strategy)
            checks = (
                (scheme.get("type") == "float", f"type must be 'float' (FP8), got {_show(scheme.get('type'))}"),
                (scheme.get("num_bits") == 8, f"num_bits must be 8, got {_show(scheme.get('num_bits'))}"),
                (granularity is not None, f"strategy must be 'tensor' or 'attn_head', got {_show(strategy)}"),
                (not scheme.get("dynamic", False), "dynamic=true (scales computed at run time) is not supported"),
                (scheme.get("symmetric", True) is True, "symmetric must be true: FP8 scales have no zero point"),
            )
            for ok, message in checks:
                if not ok:
                    reader.problem(path, where, message)
            shown = strategy if granularity else _show(strategy)
            declared.append(f"compressed-tensors kv_cache_scheme (strategy {shown})")
            required = True

    for file, algo_owner, algo in _modelopt_algos(reader, quant):
        if algo is None:
            continue
        if algo != "FP8":
            reader.problem(file, f"{algo_owner}.kv_cache_quant_algo", f"only 'FP8' is supported, got {_show(algo)}")
            continue
        declared.append(f"ModelOpt kv_cache_quant_algo FP8 ({pathlib.Path(file).name})")
        required = True

    for owner, holder in (("quantization_config", quant), (None, config)):
        hint = holder.get("kv_cache_torch_dtype")
        if hint is None:
            continue
        name = f"{owner}.kv_cache_torch_dtype" if owner else "kv_cache_torch_dtype"
        calibrated_for = _lookup(_CALIBRATION_FORMATS, hint)
        if calibrated_for is None:
            reader.problem(path, name, f"must be one of {sorted(_CALIBRATION_FORMATS)}, got {_show(hint)}")
        else:
            dtype_hints.append((str(path), name, calibrated_for))
    return declared, required, granularity, dtype_hints


def _modelopt_algos(reader: _Reader, quant: dict):
    """(file, owner, kv_cache_quant_algo) from config.json and hf_quant_config.json."""
    yield str(reader.path(CONFIG_FILE)), "quantization_config", quant.get("kv_cache_quant_algo")
    modelopt = reader.path(MODELOPT_FILE)
    if os.path.lexists(modelopt):
        try:
            section = reader.json_object(modelopt).get("quantization") or {}
        except _Fatal:
            return
        if not isinstance(section, dict):
            reader.problem(modelopt, "quantization", "must be an object")
            return
        yield str(modelopt), "quantization", section.get("kv_cache_quant_algo")


# ----------------------------------------------------------------------------- safetensors


def checkpoint_tensor_names(directory: str | os.PathLike) -> dict[str, pathlib.Path]:
    """Every tensor name of checkpoint `directory` -> the safetensors file that holds it.

    From model.safetensors.index.json when there is one (its shard files must be regular files
    inside the directory), else from the headers of the directory's *.safetensors files. Reads
    only regular files, each JSON part at most MAX_JSON_BYTES. A file that a committed export's
    journal lists is the one the journal names (see the module). Raises CheckpointError naming the
    file (and tensor) of every problem.
    """
    return _checked(_Reader(pathlib.Path(directory)), _locate_tensors)


def _locate_tensors(reader: _Reader) -> dict[str, pathlib.Path]:
    index_path = reader.path(INDEX_FILE)
    if os.path.lexists(index_path):
        return _indexed_tensors(reader, index_path)
    entries = _directory_files(reader)
    files = [path for name, path in entries.items() if name.endswith(".safetensors")]
    if not files:
        pickled = [name for name in entries if pathlib.PurePath(name).suffix in (".bin", ".pt", ".pth")]
        if pickled:
            reader.problem(reader.directory, None, f"holds only pickled weights ({', '.join(pickled)}); "
                           "fp8kv reads KV cache scales from safetensors files only")
    located = {}
    for path in files:
        for name in reader.tensor_names(path) or ():
            if name in located:
                reader.problem(path, name, f"also stored in {located[name].name}; conflicting copies")
                continue
            located[name] = path
    return located


def _directory_files(reader: _Reader) -> dict[str, pathlib.Path]:
    """{name: the file to read} for the directory's entries and the files a committed export adds, by name."""
    try:
        names = {path.name for path in reader.directory.iterdir()}
    except OSError as e:
        raise reader.fatal(reader.directory, None, f"cannot list the directory: {e.strerror or e}") from None
    return {name: reader.path(name) for name in sorted(names | reader.committed.keys())}


def _indexed_tensors(reader: _Reader, index_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """The index's weight_map with each shard checked once (entries naming a bad shard are left out)."""
    weight_map = reader.json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise reader.fatal(index_path, "weight_map", "missing or not an object")
    shards: dict[str, pathlib.Path | None] = {}
    located = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            reader.problem(index_path, name, f"maps to {_show(shard)}; expected a shard file name")
            continue
        if shard not in shards:
            shards[shard] = _shard_path(reader, index_path, name, shard)
        if shards[shard] is not None:
            located[name] = shards[shard]
    return located


def _shard_path(reader: _Reader, index_path: pathlib.Path, name: str, shard: str) -> pathlib.Path | None:
    """The file an index entry names, if it is a regular file inside the checkpoint directory.

    The folder holding it must resolve inside the directory; the file itself may be a symlink to
    anywhere (the Hugging Face cache links every file of a snapshot to a blob outside it).
    """
    path = reader.directory / shard
    if path.parent == reader.directory:
        path = reader.path(path.name)
    try:
        inside = path.parent.resolve().is_relative_to(reader.directory.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        inside = False
    why = _not_regular(path) if inside else "lies outside the checkpoint directory"
    if why:
        reader.problem(index_path, name, f"maps to shard {_show(shard)}, which {why}")
        return None
    return path


def _scale_tensor_files(reader: _Reader) -> dict[str, pathlib.Path]:
    """Scale tensor name -> the file that holds it."""
    located = _locate_tensors(reader)
    if os.path.lexists(reader.path(INDEX_FILE)):
        # A scales shard the index does not list is one that no loader reads: refuse rather than
        # fall back to unit scales.
        listed = {os.path.normpath(p) for p in located.values()}
        for name, path in _directory_files(reader).items():
            if (name.endswith(".safetensors") and os.path.normpath(path) not in listed
                    and any(map(_scale_suffix, reader.tensor_names(path) or ()))):
                reader.problem(path, None, f"holds KV cache scale tensors but {INDEX_FILE} does not list this file")
    return {name: path for name, path in located.items() if _scale_suffix(name) is not None}


def _read_scale_tensor(reader: _Reader, path: pathlib.Path, name: str, num_kv_heads: int) -> torch.Tensor | None:
    """Tensor `name` of `path`, read only if its shape is one a scale can have; None (and a problem) otherwise."""
    from safetensors import safe_open

    names = reader.tensor_names(path)
    if names is None:
        return None  # the file's problem is already recorded
    if name not in names:
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


def _tensor_scales(reader: _Reader, num_layers: int, num_kv_heads: int, granularity: str | None):
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


def _one_scale_per_layer(reader: _Reader, candidates, num_layers: int):
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
        if gaps:
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


def format_ranges(layers: list[int]) -> str:
    spans, start = [], layers[0]
    for previous, current in zip(layers, layers[1:] + [None]):
        if current != previous + 1:
            spans.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(spans)


# ----------------------------------------------------------------------------- legacy JSON


def _legacy_json(reader: _Reader, path: pathlib.Path, num_layers: int, model_type: str | None):
    """Per-rank per-layer scales and the calibration format of a kv_cache_scales.json file."""
    data = reader.json_object(path)
    file_model_type = data.get("model_type")
    if file_model_type is not None and model_type is not None and file_model_type != model_type:
        reader.problem(path, "model_type", f"is {_show(file_model_type)} but {CONFIG_FILE} says {model_type!r}")
    kv_cache = data.get("kv_cache")
    if not isinstance(kv_cache, dict):
        raise reader.fatal(path, "kv_cache", "missing or not an object")
    dtype = kv_cache.get("dtype")
    calibrated_for = _lookup(_CALIBRATION_FORMATS, dtype)
    if calibrated_for is None:
        reader.problem(path, "kv_cache.dtype", f"must be one of {sorted(_CALIBRATION_FORMATS)}, got {_show(dtype)}")
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
            s32 = _float32(s) if _is_number(s) else None
            if s32 is None or not (math.isfinite(s32) and s32 > 0):
                reader.problem(path, f"{where}[{layer}]", f"must be a finite number > 0, got {_show(s)}")
            values.append(s32)
        scales.append(tuple(values))
    return tuple(scales), calibrated_for


def _float32(value: float) -> float:
    """`value` rounded to float32 (inf beyond its range: JSON integers can have hundreds of digits)."""
    try:
        return float(torch.tensor(float(value), dtype=torch.float32))
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, float) or _is_int(value)


def _int_keyed(reader: _Reader, path, where: str, mapping: dict) -> dict[int, object]:
    """`mapping` keyed by the numbers its keys spell; other keys, and two spelling one number, are problems."""
    result, spelled = {}, {}
    for key, value in mapping.items():
        # Decimal digits only (int() would also take ' 1', '+1', '1_0'), few enough to convert.
        if not (key.isascii() and key.isdigit() and len(key) <= 18):
            reader.problem(path, f"{where}[{_show(key)}]", "key must be a non-negative integer (at most 18 digits)")
            continue
        number = int(key)
        if number in result:
            reader.problem(path, f"{where}[{key!r}]", f"repeats key {spelled[number]!r}: both are {number}")
            continue
        result[number], spelled[number] = value, key
    return result


# ----------------------------------------------------------------------------- reading


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
    _check_geometry_arguments(num_layers, num_kv_heads)
    reader = _Reader(pathlib.Path(checkpoint_dir))
    state = dict(model_type=None, num_layers=num_layers, num_kv_heads=num_kv_heads, calibrated_for=KVCacheDtype.E4M3FN,
                 declared=(), forms=(), k=(), v=(), legacy_json=None, legacy_json_scales=())
    try:
        _read_into(reader, state, scales_json)
    except _Fatal:
        pass
    return CheckpointScales(directory=str(reader.directory), problems=tuple(reader.problems), **state)


def _read_into(reader: _Reader, state: dict, scales_json) -> None:
    _open_directory(reader)
    config_path = reader.path(CONFIG_FILE)
    if not os.path.lexists(config_path):
        raise reader.fatal(config_path, None, "missing (needed for the layer and head counts)")
    config = reader.json_object(config_path)
    state["model_type"] = config.get("model_type")
    if state["model_type"] is not None and not isinstance(state["model_type"], str):
        reader.problem(config_path, "model_type", f"must be a string, got {_show(state['model_type'])}")
        state["model_type"] = None
    num_layers, num_kv_heads = _model_geometry(reader, config, state["num_layers"], state["num_kv_heads"])
    state["num_layers"], state["num_kv_heads"] = num_layers, num_kv_heads
    declared, required, granularity, dtype_hints = _quantization_hints(reader, config)

    (k, v), forms = _tensor_scales(reader, num_layers, num_kv_heads, granularity)
    json_path = _legacy_json_path(reader, scales_json)
    if json_path is not None:
        json_scales, json_dtype = _legacy_json(reader, json_path, num_layers, state["model_type"])
        if json_dtype is not None:
            dtype_hints.append((str(json_path), "kv_cache.dtype", json_dtype))
        if forms:
            reader.problem(json_path, None, f"conflicting sources: the safetensors files also hold scales ({', '.join(forms)})")
        state.update(legacy_json=str(json_path), legacy_json_scales=json_scales)
        forms = (*forms, "legacy kv_cache_scales.json")
    if required and not forms:
        reader.problem(config_path, "quantization_config", f"declares {' and '.join(declared)} but no scale tensors were found")

    formats = {fmt for _, _, fmt in dtype_hints}
    if len(formats) > 1:
        sources = ", ".join(f"{pathlib.Path(f).name} {name} = {fmt.value}" for f, name, fmt in dtype_hints)
        reader.problem(dtype_hints[0][0], dtype_hints[0][1], f"conflicting calibration formats: {sources}")
    elif formats:
        state["calibrated_for"] = formats.pop()
    state.update(declared=tuple(declared), forms=forms, k=k, v=v)


def _legacy_json_path(reader: _Reader, scales_json) -> pathlib.Path | None:
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


def _open_directory(reader: _Reader) -> None:
    """Checks that the reader's directory is a directory and reads its commit journal, if any."""
    if not reader.directory.is_dir():
        raise reader.fatal(reader.directory, None, "is not a checkpoint directory")
    try:
        reader.committed = commit.committed_files(reader.directory) or {}
    except commit.JournalError as e:
        raise reader.fatal(e.path, None, e.reason) from None


def _checked(reader: _Reader, read):
    """read(reader) on a checkpoint directory, raising CheckpointError for the problems it records."""
    result = None
    try:
        _open_directory(reader)
        result = read(reader)
    except _Fatal:
        pass
    if reader.problems:
        raise CheckpointError(reader.problems)
    return result


def _check_geometry_arguments(num_layers, num_kv_heads) -> None:
    if num_layers is not None:
        _check_int_argument("num_layers", num_layers, 1, MAX_NUM_LAYERS + 1)
    if num_kv_heads is not None:
        _check_int_argument("num_kv_heads", num_kv_heads, 1)


def _check_int_argument(name: str, value, low: int, high: int | None = None) -> None:
    """TypeError unless `value` is an int (a bool is not), ValueError unless low <= value (< high)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} must be {bounds}, got {value}")


# ----------------------------------------------------------------------------- per rank


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


def load_kv_cache_config(
    checkpoint_dir: str | os.PathLike,
    cache_dtype: KVCacheDtype | str,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    scales_json: str | os.PathLike | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
) -> KVCacheConfig:
    """The KV cache format and scales of one tensor-parallel rank, from a local checkpoint directory.

    cache_dtype: the cache format (a KVCacheDtype or a name such as 'fp8_e4m3', see
        KVCacheDtype.parse). 'auto' (unquantized) reads only the layer count: it has no scales.
    FP8 caches use the checkpoint's scales, sliced to this rank's KV heads and converted from the
    format they were calibrated for (e4m3fn unless the checkpoint says e4m3fnuz) to `cache_dtype`.
    With no scales in the checkpoint, an e4m3 cache uses 1.0 and warns once; e5m2 uses 1.0 silently
    (its range needs no scaling for typical activations).
    Raises CheckpointError (naming files and tensors) for every problem of the checkpoint, and
    TypeError / ValueError naming the argument for bad arguments.
    """
    dtype = KVCacheDtype.parse(cache_dtype)
    _check_int_argument("tp_size", tp_size, 1)
    _check_int_argument("tp_rank", tp_rank, 0, tp_size)
    _check_geometry_arguments(num_layers, num_kv_heads)
    if dtype is KVCacheDtype.UNQUANTIZED:
        reader = _Reader(pathlib.Path(checkpoint_dir))
        layers, _ = _checked(reader, lambda r: _model_geometry(r, r.json_object(r.path(CONFIG_FILE)),
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
    if not found.has_scales:
        if dtype.is_e4m3:
            warnings.warn(
                f"fp8kv: {found.directory} has no KV cache scales; the {dtype.value} cache uses scale 1.0 in every "
                f"layer, so |K|, |V| above {dtype.max_finite:g} saturate and small values lose precision. Calibrate "
                "scales for this model (python -m fp8kv calibrate) for accurate results.",
                stacklevel=2,
            )
        return KVCacheConfig.unit_scales(dtype, found.num_layers, f"no scales in {found.directory}: 1.0")

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
    return KVCacheConfig(dtype, k, v, source)


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
        s32 = _float32(s * factor)
        if not (math.isfinite(s32) and s32 > 0):
            problems.append(Problem(scale.file, scale.tensor, f"scale {s:g} x{factor:g} for the {dtype.value} cache is "
                                    f"{s32:g} in float32; it must be finite and > 0"))
        converted.append(s32)
    return tuple(converted)
