"""Reading KV cache scales from a local checkpoint directory.

Two layers: `read_checkpoint_scales` gathers everything the checkpoint says about KV cache scales
(tensors, config hints, the legacy JSON file) and every problem with it, without raising for bad
content; `load_kv_cache_config` turns that into the `KVCacheConfig` of one tensor-parallel rank
and cache format, raising `CheckpointError` on any problem. `python -m fp8kv inspect` prints the
former.

Checkpoint forms (attention module P, e.g. `model.layers.7.self_attn`):
- `P.k_scale`, `P.v_scale` (vLLM, llm-compressor, TGI): shape [], [1], [num_kv_heads] or
  [num_kv_heads, 1, 1], any float dtype;
- `P.kv_scale` (legacy, one scale for K and V); `P.k_proj.k_scale`, `P.v_proj.v_scale` (ModelOpt);
- config.json `quantization_config.kv_cache_scheme` (compressed-tensors: strategy tensor|attn_head),
  `kv_cache_quant_algo` (ModelOpt, also in hf_quant_config.json), `kv_cache_torch_dtype` (the
  format the scales were calibrated for: float8_e4m3fn, the default, or float8_e4m3fnuz);
- `kv_cache_scales.json`: {"model_type", "kv_cache": {"dtype", "scaling_factor": {rank: {layer: s}}}}.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import warnings
from dataclasses import dataclass, field

import torch

from .formats import KVCacheConfig, KVCacheDtype

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MODELOPT_FILE = "hf_quant_config.json"
LEGACY_JSON_FILE = "kv_cache_scales.json"

# Scale tensor name suffixes, most specific first: (suffix, which cache tensors it scales, form).
_SCALE_SUFFIXES = (
    (".k_proj.k_scale", "k", "ModelOpt k_proj.k_scale"),
    (".v_proj.v_scale", "v", "ModelOpt v_proj.v_scale"),
    (".kv_scale", "kv", "legacy kv_scale"),
    (".k_scale", "k", "k_scale"),
    (".v_scale", "v", "v_scale"),
)
_CALIBRATION_FORMATS = {"float8_e4m3fn": KVCacheDtype.E4M3FN, "float8_e4m3fnuz": KVCacheDtype.E4M3FNUZ}


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


@dataclass
class _Reader:
    """Accumulates problems while reading; each check records and moves on where it can."""

    directory: pathlib.Path
    problems: list[Problem] = field(default_factory=list)

    def problem(self, file, tensor, message) -> None:
        self.problems.append(Problem(str(file), tensor, message))

    def fatal(self, file, tensor, message) -> _Fatal:
        self.problem(file, tensor, message)
        return _Fatal()

    def json_object(self, path: pathlib.Path) -> dict:
        try:
            text = path.read_text()
        except OSError as e:
            raise self.fatal(path, None, f"cannot read: {e.strerror or e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise self.fatal(path, None, f"invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise self.fatal(path, None, f"must hold a JSON object, got {type(data).__name__}")
        return data


# ----------------------------------------------------------------------------- config.json


def _model_geometry(reader: _Reader, config: dict, num_layers: int | None, num_kv_heads: int | None):
    """num_layers and num_kv_heads from config.json (or its text_config), checked against the caller's."""
    path = reader.directory / CONFIG_FILE
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def field_value(*names):
        for source in (config, text_config):
            for name in names:
                if source.get(name) is not None:
                    return name, source[name]
        return None, None

    result = []
    for label, given, names in (
        ("num_layers", num_layers, ("num_hidden_layers",)),
        ("num_kv_heads", num_kv_heads, ("num_key_value_heads", "num_attention_heads")),
    ):
        name, value = field_value(*names)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            reader.problem(path, name, f"must be a positive integer, got {value!r}")
            value = None
        if value is not None and given is not None and value != given:
            reader.problem(path, name, f"is {value} but {label}={given} was given")
        if value is None and given is None:
            raise reader.fatal(path, names[0], f"missing; pass {label}= to the loader")
        result.append(value if value is not None else given)
    return result


def _quantization_hints(reader: _Reader, config: dict) -> tuple[list[str], bool, str | None, list]:
    """Checks the config hints. Returns (declared schemes, scales required, granularity, dtype hints)."""
    path = reader.directory / CONFIG_FILE
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
            checks = (
                (scheme.get("type") == "float", f"type must be 'float' (FP8), got {scheme.get('type')!r}"),
                (scheme.get("num_bits") == 8, f"num_bits must be 8, got {scheme.get('num_bits')!r}"),
                (strategy in ("tensor", "attn_head"), f"strategy must be 'tensor' or 'attn_head', got {strategy!r}"),
                (not scheme.get("dynamic", False), "dynamic=true (scales computed at run time) is not supported"),
                (scheme.get("symmetric", True) is True, "symmetric must be true: FP8 scales have no zero point"),
            )
            for ok, message in checks:
                if not ok:
                    reader.problem(path, where, message)
            declared.append(f"compressed-tensors kv_cache_scheme (strategy {strategy})")
            required = True
            granularity = {"tensor": "tensor", "attn_head": "head"}.get(strategy)

    for file, algo_owner, algo in _modelopt_algos(reader, quant):
        if algo is None:
            continue
        if algo != "FP8":
            reader.problem(file, f"{algo_owner}.kv_cache_quant_algo", f"only 'FP8' is supported, got {algo!r}")
            continue
        declared.append(f"ModelOpt kv_cache_quant_algo FP8 ({pathlib.Path(file).name})")
        required = True

    for owner, holder in (("quantization_config", quant), (None, config)):
        hint = holder.get("kv_cache_torch_dtype")
        if hint is None:
            continue
        name = f"{owner}.kv_cache_torch_dtype" if owner else "kv_cache_torch_dtype"
        if hint not in _CALIBRATION_FORMATS:
            reader.problem(path, name, f"must be one of {sorted(_CALIBRATION_FORMATS)}, got {hint!r}")
        else:
            dtype_hints.append((str(path), name, _CALIBRATION_FORMATS[hint]))
    return declared, required, granularity, dtype_hints


def _modelopt_algos(reader: _Reader, quant: dict):
    """(file, owner, kv_cache_quant_algo) from config.json and hf_quant_config.json."""
    yield str(reader.directory / CONFIG_FILE), "quantization_config", quant.get("kv_cache_quant_algo")
    modelopt = reader.directory / MODELOPT_FILE
    if modelopt.exists():
        try:
            section = reader.json_object(modelopt).get("quantization") or {}
        except _Fatal:
            return
        if not isinstance(section, dict):
            reader.problem(modelopt, "quantization", "must be an object")
            return
        yield str(modelopt), "quantization", section.get("kv_cache_quant_algo")


# ----------------------------------------------------------------------------- safetensors


def _safetensors_files(reader: _Reader) -> dict[str, pathlib.Path]:
    """Scale tensor name -> the file that holds it (index-driven when there is an index)."""
    index_path = reader.directory / INDEX_FILE
    if index_path.exists():
        index = reader.json_object(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise reader.fatal(index_path, "weight_map", "missing or not an object")
        located = {}
        for name, shard in weight_map.items():
            if _scale_suffix(name) is None:
                continue
            shard_path = reader.directory / str(shard)
            if not shard_path.is_file():
                reader.problem(index_path, name, f"maps to shard {shard!r}, which does not exist")
                continue
            located[name] = shard_path
        return located
    files = sorted(reader.directory.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in reader.directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickled:
            reader.problem(reader.directory, None, f"holds only pickled weights ({', '.join(pickled)}); "
                           "fp8kv reads KV cache scales from safetensors files only")
    located = {}
    for path in files:
        for name in _tensor_names(reader, path):
            if _scale_suffix(name) is None:
                continue
            if name in located:
                reader.problem(path, name, f"also stored in {located[name].name}; conflicting copies")
                continue
            located[name] = path
    return located


def _tensor_names(reader: _Reader, path: pathlib.Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises several exception types for unreadable files
        reader.problem(path, None, f"cannot read safetensors file: {e}")
        return []


def _read_tensor(reader: _Reader, path: pathlib.Path, name: str) -> torch.Tensor | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if name not in f.keys():
                reader.problem(path, name, "listed in the index but not stored in this shard")
                return None
            return f.get_tensor(name)
    except Exception as e:
        reader.problem(path, name, f"cannot read tensor: {e}")
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
    shape = list(tensor.shape)
    if shape not in ([], [1], [num_kv_heads], [num_kv_heads, 1, 1]):
        return None, (
            f"shape {shape} is none of [], [1], [num_kv_heads] = [{num_kv_heads}], [{num_kv_heads}, 1, 1]"
        )
    values = tensor.detach().to(device="cpu", dtype=torch.float32).reshape(-1).tolist()
    for head, s in enumerate(values):
        if not (math.isfinite(s) and s > 0):
            where = f"[{head}] " if len(values) > 1 else ""
            return None, f"value {where}{s} must be finite and > 0 (as float32)"
    return tuple(values), None


_LAYER_COMPONENT = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _module_and_layer(name: str, suffix: str) -> tuple[str, int] | None:
    """('model.layers.{}.self_attn', 7) for 'model.layers.7.self_attn.k_scale'."""
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
    for name, path in sorted(_safetensors_files(reader).items()):
        suffix, kind, form = _scale_suffix(name)
        parsed = _module_and_layer(name, suffix)
        if parsed is None:
            reader.problem(path, name, "has no layer index in its name (expected e.g. model.layers.0.self_attn.k_scale)")
            continue
        template, layer = parsed
        templates.setdefault(template, name)
        tensor = _read_tensor(reader, path, name)
        values, error = scale_values(tensor, num_kv_heads) if tensor is not None else ((), None)
        if error:
            reader.problem(path, name, error)
            values = ()  # present but unusable: reported here, not again as missing
        if values and granularity == "tensor" and len(values) != 1:
            reader.problem(path, name, "kv_cache_scheme strategy 'tensor' needs one scale, got per-head scales")
        if values and granularity == "head" and len(values) != num_kv_heads:
            reader.problem(path, name, f"kv_cache_scheme strategy 'attn_head' needs {num_kv_heads} scales, got 1")
        if layer >= num_layers:
            reader.problem(path, name, f"layer {layer} is outside the model's {num_layers} layers ({CONFIG_FILE})")
            continue
        forms.add(form)
        found = FoundScale(str(path), name, values)
        for target in ("k", "v") if kind == "kv" else (kind,):
            candidates.setdefault((layer, target), []).append(found)

    if len(templates) > 1:
        examples = ", ".join(sorted(templates.values()))
        reader.problem(reader.directory, None, f"scale tensors name different module patterns: {examples}")
    return _one_scale_per_layer(reader, candidates, num_layers), tuple(sorted(forms))


def _one_scale_per_layer(reader: _Reader, candidates, num_layers: int):
    """Exactly one K and one V scale per layer, for all layers or none."""
    if not candidates:
        return (), ()
    complete = True
    per_kind = {}
    for target in ("k", "v"):
        scales, missing = [], []
        for layer in range(num_layers):
            found = candidates.get((layer, target), [])
            if len(found) > 1:
                names = " and ".join(f"{f.tensor} ({pathlib.Path(f.file).name})" for f in found)
                reader.problem(found[0].file, found[0].tensor, f"conflicting {target}_scale sources for layer {layer}: {names}")
                complete = False
            if not found:
                missing.append(layer)
            elif not found[0].values:
                complete = False
            else:
                scales.append(found[0])
        if missing:
            same_kind = [found[0] for (_, kind), found in candidates.items() if kind == target]
            example = same_kind[0] if same_kind else next(iter(candidates.values()))[0]
            expected = _with_layer(_as_kind(example.tensor, target), missing[0])
            reader.problem(
                example.file, expected,
                f"missing: no {target}_scale for layer(s) {format_ranges(missing)} of the model's {num_layers}, "
                f"while {example.tensor} exists",
            )
            complete = False
        per_kind[target] = tuple(scales)
    return (per_kind["k"], per_kind["v"]) if complete else ((), ())


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
        reader.problem(path, "model_type", f"is {file_model_type!r} but {CONFIG_FILE} says {model_type!r}")
    kv_cache = data.get("kv_cache")
    if not isinstance(kv_cache, dict):
        raise reader.fatal(path, "kv_cache", "missing or not an object")
    dtype = kv_cache.get("dtype")
    calibrated_for = _CALIBRATION_FORMATS.get(dtype)
    if calibrated_for is None:
        reader.problem(path, "kv_cache.dtype", f"must be one of {sorted(_CALIBRATION_FORMATS)}, got {dtype!r}")
    factors = kv_cache.get("scaling_factor")
    if not isinstance(factors, dict) or not factors:
        raise reader.fatal(path, "kv_cache.scaling_factor", "missing, empty or not an object of ranks")
    ranks = _int_keyed(reader, path, "kv_cache.scaling_factor", factors)
    if sorted(ranks) != list(range(len(ranks))):
        reader.problem(path, "kv_cache.scaling_factor", f"ranks must be 0..{len(ranks) - 1}, got {sorted(ranks)}")
        return (), calibrated_for
    scales = []
    for rank in range(len(ranks)):
        where = f"kv_cache.scaling_factor[{rank}]"
        if not isinstance(ranks[rank], dict):
            reader.problem(path, where, "must be an object of layer: scale")
            continue
        layers = _int_keyed(reader, path, where, ranks[rank])
        if sorted(layers) != list(range(num_layers)):
            reader.problem(path, where, f"must have layers 0..{num_layers - 1} ({CONFIG_FILE}), got {format_ranges(sorted(layers)) if layers else 'none'}")
            continue
        values = []
        for layer in range(num_layers):
            s = layers[layer]
            s32 = float(torch.tensor(s, dtype=torch.float32)) if _is_number(s) else None
            if s32 is None or not (math.isfinite(s32) and s32 > 0):
                reader.problem(path, f"{where}[{layer}]", f"must be a finite number > 0, got {s!r}")
            values.append(s32)
        scales.append(tuple(values))
    return tuple(scales), calibrated_for


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_keyed(reader: _Reader, path, where: str, mapping: dict) -> dict[int, object]:
    result = {}
    for key, value in mapping.items():
        try:
            result[int(key)] = value
        except (TypeError, ValueError):
            reader.problem(path, f"{where}[{key!r}]", "key must be an integer")
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
    scales_json: a legacy kv_cache_scales.json to read (default: that file in the directory, if any).
    num_layers, num_kv_heads: needed when config.json lacks num_hidden_layers / num_key_value_heads
        (a value given and a different one in config.json is a problem).
    """
    reader = _Reader(pathlib.Path(checkpoint_dir))
    state = dict(model_type=None, num_layers=num_layers, num_kv_heads=num_kv_heads, calibrated_for=KVCacheDtype.E4M3FN,
                 declared=(), forms=(), k=(), v=(), legacy_json=None, legacy_json_scales=())
    try:
        _read_into(reader, state, scales_json)
    except _Fatal:
        pass
    return CheckpointScales(directory=str(reader.directory), problems=tuple(reader.problems), **state)


def _read_into(reader: _Reader, state: dict, scales_json) -> None:
    if not reader.directory.is_dir():
        raise reader.fatal(reader.directory, None, "is not a checkpoint directory")
    config_path = reader.directory / CONFIG_FILE
    if not config_path.is_file():
        raise reader.fatal(config_path, None, "missing (needed for the layer and head counts)")
    config = reader.json_object(config_path)
    state["model_type"] = config.get("model_type")
    num_layers, num_kv_heads = _model_geometry(reader, config, state["num_layers"], state["num_kv_heads"])
    state["num_layers"], state["num_kv_heads"] = num_layers, num_kv_heads
    declared, required, granularity, dtype_hints = _quantization_hints(reader, config)

    (k, v), forms = _tensor_scales(reader, num_layers, num_kv_heads, granularity)
    json_path = pathlib.Path(scales_json) if scales_json is not None else reader.directory / LEGACY_JSON_FILE
    if scales_json is not None or json_path.exists():
        if not json_path.is_file():
            raise reader.fatal(json_path, None, "scales JSON file does not exist")
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
    Raises CheckpointError (naming files and tensors) for every problem of the checkpoint.
    """
    dtype = KVCacheDtype.parse(cache_dtype)
    if not (isinstance(tp_size, int) and tp_size >= 1):
        raise ValueError(f"tp_size must be a positive integer, got {tp_size!r}")
    if not (isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
        raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank!r}")
    if dtype is KVCacheDtype.UNQUANTIZED:
        layers, _ = _read_geometry(checkpoint_dir, num_layers, num_kv_heads)
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
        k_global = v_global = _json_rank_scales(found, tp_rank, tp_size)
        origin = found.legacy_json
    else:
        k_global = [s.values for s in found.k]
        v_global = [s.values for s in found.v]
        origin = ", ".join(found.forms)
    k = [_for_rank(values, tp_rank, tp_size, factor) for values in k_global]
    v = [_for_rank(values, tp_rank, tp_size, factor) for values in v_global]
    conversion = f", x{factor:g} for {dtype.value}" if factor != 1.0 else ""
    source = f"{found.directory}: {origin} (calibrated for {found.calibrated_for.value}{conversion})"
    return KVCacheConfig(dtype, k, v, source)


def _read_geometry(checkpoint_dir, num_layers: int | None, num_kv_heads: int | None) -> tuple[int, int]:
    """num_layers and num_kv_heads from config.json alone; raises CheckpointError on problems."""
    reader = _Reader(pathlib.Path(checkpoint_dir))
    try:
        geometry = _model_geometry(reader, reader.json_object(reader.directory / CONFIG_FILE), num_layers, num_kv_heads)
    except _Fatal:
        pass
    if reader.problems:
        raise CheckpointError(reader.problems)
    return geometry


def _json_rank_scales(found: CheckpointScales, tp_rank: int, tp_size: int) -> list[tuple[float, ...]]:
    ranks = found.legacy_json_scales
    if len(ranks) == 1:
        # Calibrated without tensor parallelism: a per-tensor scale covers any subset of the heads.
        return [(s,) for s in ranks[0]]
    if len(ranks) != tp_size:
        raise CheckpointError([Problem(
            found.legacy_json, "kv_cache.scaling_factor",
            f"has scales for {len(ranks)} tensor-parallel ranks; expected 1 or tp_size={tp_size}",
        )])
    return [(s,) for s in ranks[tp_rank]]


def _for_rank(values: tuple[float, ...], tp_rank: int, tp_size: int, factor: float) -> tuple[float, ...]:
    # Multiplying a float32 by a power of two is exact unless it overflows, which KVCacheConfig rejects.
    return tuple(s * factor for s in shard_kv_heads(values, tp_rank, tp_size))
