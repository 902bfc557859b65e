"""Calibration: the K/V maxima of a model over data, turned into scales and written into its checkpoint.

    amax = calibrate(model, batches, granularity="head")        # transformers model, token batches
    kv_cache = amax.scales("float8_e4m3fn")                       # s = amax / 448, a KVCacheConfig
    export_checkpoint(model_dir, out_dir, kv_cache)               # k_scale/v_scale + kv_cache_scheme

Layers, bottom to top:
- `KVCalibrator` keeps one running maximum per layer (per tensor or per KV head) and folds each
  step's K/V into it with `fp8kv.ops.kv_amax` on the K/V's device, never synchronizing with the
  host; `result()` reduces across tensor-parallel ranks (fp8kv.distributed) into a `KVAmax`.
- `KVAmax.scales` turns maxima into dequantization scales s = amax * margin / max_finite(format),
  refusing NaN/inf maxima and all-zero heads (or giving those scale 1.0 when asked to) by name.
- `export_checkpoint` writes the scales as `P.k_scale` / `P.v_scale` float32 tensors in the shapes
  llm-compressor writes ([1] per tensor, [num_kv_heads, 1, 1] per head), in an added shard
  registered in the index (sharded checkpoints) or in model.safetensors (single-file ones), and
  declares them in config.json as a compressed-tensors `kv_cache_scheme`; `export_legacy_json`
  writes the legacy kv_cache_scales.json.
- `calibrate` / `observe_model` drive a transformers model: a DynamicCache subclass sees every
  layer's K (after rotary embedding, exactly as it is cached) and V; the data comes from
  `text_sequences` (a text file and the model's tokenizer) or `token_id_sequences` (a file of ids),
  cut by `make_batches`.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import pathlib
import re
import shutil
import warnings
from dataclasses import dataclass
from typing import Iterable

import torch

from . import distributed, ops
from .checkpoint import CONFIG_FILE, INDEX_FILE, CheckpointError, format_ranges, read_checkpoint_scales
from .formats import KVCacheConfig, KVCacheDtype

GRANULARITIES = ("tensor", "head")
SCALES_FILE = "kv_cache_scales.safetensors"
SINGLE_FILE = "model.safetensors"
ZERO_AMAX_POLICIES = ("error", "unit")
_STRATEGIES = {"tensor": "tensor", "head": "attn_head"}


class CalibrationError(ValueError):
    """Calibration maxima that cannot become scales (NaN/inf, all-zero), or layers never observed."""

    def __init__(self, problems):
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"calibration failed ({len(self.problems)} problem(s)):\n{lines}")


# ----------------------------------------------------------------------------- running maxima


class KVCalibrator:
    """Running max |K| and max |V| of every layer, per tensor or per KV head.

    num_layers, num_kv_heads: the model's (global) layer and KV head counts.
    granularity: 'tensor' (one maximum per layer) or 'head' (one per KV head).
    Each rank of a tensor-parallel model observes its own KV heads; `result` puts them together.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, granularity: str = "tensor"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        self.num_layers, self.num_kv_heads, self.granularity = num_layers, num_kv_heads, granularity
        self._k_amax: list[torch.Tensor | None] = [None] * num_layers
        self._v_amax: list[torch.Tensor | None] = [None] * num_layers
        self.num_tokens = [0] * num_layers

    @classmethod
    def for_model(cls, model, granularity: str = "tensor") -> KVCalibrator:
        """A calibrator sized from a transformers model's (text) config."""
        config = model.config.get_text_config(decoder=True)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, num_kv_heads, granularity)

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Folds one step's K/V of `layer` into its maxima (no host synchronization).

        key, value: [num_tokens, kv_heads, head_size] as written to the cache (K after rotary
        embedding), fp16/bf16/fp32, last dim contiguous; kv_heads: this rank's KV heads.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside the calibrator's {self.num_layers} layers")
        if key.dim() != 3 or value.shape != key.shape:
            raise ValueError(f"layer {layer}: key and value must both be [num_tokens, kv_heads, head_size], "
                             f"got {list(key.shape)} and {list(value.shape)}")
        width = 1 if self.granularity == "tensor" else key.shape[1]
        if self._k_amax[layer] is None:
            self._k_amax[layer] = torch.zeros(width, dtype=torch.float32, device=key.device)
            self._v_amax[layer] = torch.zeros(width, dtype=torch.float32, device=key.device)
        elif self._k_amax[layer].numel() != width:
            raise ValueError(f"layer {layer}: observed {key.shape[1]} KV heads, earlier {self._k_amax[layer].numel()}")
        ops.kv_amax(key, value, self._k_amax[layer], self._v_amax[layer])
        self.num_tokens[layer] += key.shape[0]

    def result(self, group=None) -> KVAmax:
        """The maxima of every layer over all ranks of `group` (default: all, when torch.distributed
        is initialized; a collective then, so every rank calls it). Raises CalibrationError when a
        layer was never observed."""
        missing = [layer for layer, amax in enumerate(self._k_amax) if amax is None]
        if missing:
            raise CalibrationError([f"layer(s) {format_ranges(missing)} of {self.num_layers} were never observed: their "
                                    "attention did not pass K/V to the calibrator (for transformers models: did "
                                    "not call past_key_values.update)"])
        widths = {amax.numel() for amax in self._k_amax}
        if len(widths) != 1:
            raise ValueError(f"layers observed different KV head counts: {sorted(widths)}")
        device = self._k_amax[0].device
        local = torch.stack([torch.stack([a.to(device) for a in amaxes]) for amaxes in (self._k_amax, self._v_amax)])
        if distributed.is_distributed():
            amax = distributed.reduce_amax(local, self.granularity, self.num_kv_heads, group)
        else:
            amax = local.cpu()
        if self.granularity == "head" and amax.shape[-1] != self.num_kv_heads:
            raise ValueError(f"observed {amax.shape[-1]} KV heads per layer, the model has {self.num_kv_heads} "
                             "(a tensor-parallel shard needs torch.distributed initialized to gather the others)")
        k, v = (tuple(tuple(row) for row in part.tolist()) for part in amax)
        return KVAmax(k, v, self.num_tokens[0])


# ----------------------------------------------------------------------------- maxima to scales


@dataclass(frozen=True)
class KVAmax:
    """max |K| and max |V| per layer: 1 value (per tensor) or num_kv_heads values in global head order.

    num_tokens: how many tokens this rank observed (per layer).
    """

    k: tuple[tuple[float, ...], ...]
    v: tuple[tuple[float, ...], ...]
    num_tokens: int = 0

    @property
    def granularity(self) -> str:
        return "tensor" if len(self.k[0]) == 1 else "head"

    def scales(self, fmt: KVCacheDtype | str = KVCacheDtype.E4M3FN, *, margin: float = 1.0,
               zero_amax: str = "error") -> KVCacheConfig:
        """Dequantization scales s = amax * margin / max_finite(fmt), rounded to float32, for all heads.

        fmt: the format the scales are calibrated for: float8_e4m3fn (loads as e4m3fn, e4m3fnuz x2,
            e5m2 as is) or float8_e4m3fnuz.
        margin: >= 1; headroom above the calibration maximum (1.0 maps it to max_finite exactly).
        zero_amax: what an all-zero head (or layer) gets: 'error' (default) raises CalibrationError
            naming it; 'unit' gives it scale 1.0, the uncalibrated default, and warns naming it.
        NaN or inf maxima always raise CalibrationError naming layer, K/V and head.
        """
        fmt = KVCacheDtype.parse(fmt)
        if not fmt.is_e4m3:
            raise ValueError(f"scales are calibrated for an e4m3 format (float8_e4m3fn or float8_e4m3fnuz), got "
                             f"{fmt.value}; an e5m2 cache loads e4m3fn scales unchanged")
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 1.0):
            raise ValueError(f"margin must be a finite number >= 1, got {margin!r}")
        if zero_amax not in ZERO_AMAX_POLICIES:
            raise ValueError(f"zero_amax must be one of {ZERO_AMAX_POLICIES}, got {zero_amax!r}")
        problems, zeros = [], []
        k = self._scales("K", self.k, fmt, margin, problems, zeros)
        v = self._scales("V", self.v, fmt, margin, problems, zeros)
        if zeros and zero_amax == "error":
            problems += [f"{where}: amax is 0 (all-zero over the calibration data); pass zero_amax='unit' "
                         "(CLI: --zero-amax unit) to give it scale 1.0" for where in zeros]
        if problems:
            raise CalibrationError(problems)
        source = f"calibrated on {self.num_tokens} tokens for {fmt.value}, per {self.granularity}, margin {margin:g}"
        if zeros:
            warnings.warn(f"fp8kv: all-zero calibration maxima get scale 1.0: {', '.join(zeros)}", stacklevel=2)
            source += f"; scale 1.0 for all-zero {', '.join(zeros)}"
        return KVCacheConfig(fmt, k, v, source)

    def _scales(self, kind: str, layers, fmt: KVCacheDtype, margin: float, problems: list, zeros: list):
        result = []
        for layer, amax in enumerate(layers):
            amax64 = torch.tensor(amax, dtype=torch.float64)
            # amax is float32, so float64 arithmetic then one rounding gives the correctly rounded scale.
            scale = (amax64 * margin / fmt.max_finite).to(torch.float32)
            for head, a in enumerate(amax):
                where = f"layer {layer} {kind}" + (f" head {head}" if len(amax) > 1 else "")
                if not math.isfinite(a):
                    problems.append(f"{where}: amax is {a} (the model produced NaN or inf on the calibration data)")
                elif a == 0.0:
                    zeros.append(where)
                    scale[head] = 1.0
            result.append(scale.tolist())
        return result


# ----------------------------------------------------------------------------- export


def export_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, kv_cache: KVCacheConfig, *,
                      module_template: str | None = None, group=None) -> pathlib.Path:
    """Writes `kv_cache`'s scales (all KV heads) into a checkpoint; returns the output directory.

    model_dir: the source checkpoint (config.json + safetensors), without KV cache scales.
    out_dir: a new or empty directory, which becomes a copy of model_dir plus the scales; or
        model_dir itself, to add the scales in place.
    The scales are `P.k_scale` / `P.v_scale` float32 tensors ([1] per tensor, [num_kv_heads, 1, 1]
    per head). A sharded checkpoint gets them in an added shard, kv_cache_scales.safetensors,
    registered in model.safetensors.index.json; a single-file checkpoint gets them in its
    model.safetensors (rewritten: transformers reads that file alone whenever it exists).
    config.json's quantization_config gets `kv_cache_scheme` (a new compressed-tensors
    quantization_config when there is none) and, for e4m3fnuz scales, `kv_cache_torch_dtype`.
    module_template: the attention module of layer {} (e.g. 'model.layers.{}.self_attn'); found from
        the k_proj / qkv_proj weight names when omitted.
    Under torch.distributed only rank 0 of `group` writes, and every rank returns (or raises) once it is done.
    """
    source, out = pathlib.Path(model_dir), pathlib.Path(out_dir)
    distributed.on_writer(lambda: _write_checkpoint(source, out, kv_cache, module_template), group)
    return out


def _write_checkpoint(source: pathlib.Path, out: pathlib.Path, kv_cache: KVCacheConfig, module_template) -> None:
    found = read_checkpoint_scales(source)
    if found.problems:
        raise CheckpointError(found.problems)
    if found.has_scales or found.declared:
        raise ValueError(f"{source} already has KV cache scales ({', '.join(found.forms + found.declared)}); "
                         "calibrate from the checkpoint without them")
    _check_geometry(kv_cache, found.num_layers, found.num_kv_heads, source)
    if module_template is not None and "{}" not in module_template:
        raise ValueError(f"module_template must contain '{{}}' for the layer index, got {module_template!r}")
    template = module_template or _attention_template(source, found.num_layers)
    sharded = _is_sharded(source)
    in_place = out.exists() and out.resolve() == source.resolve()
    if not in_place:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"output directory {out} exists and is not empty")
        shutil.copytree(source, out, dirs_exist_ok=True)
    tensors = _scale_tensors(kv_cache, template)
    if sharded:
        _add_shard(out, tensors)
    else:
        _add_to_single_file(out / SINGLE_FILE, tensors)
    config_path = out / CONFIG_FILE
    config = json.loads(config_path.read_text())
    config["quantization_config"] = _quantization_config(config.get("quantization_config"), kv_cache)
    _write_json(config_path, config)


def _is_sharded(directory: pathlib.Path) -> bool:
    """True for a checkpoint with an index, False for a lone model.safetensors; anything else is an error."""
    if (directory / INDEX_FILE).exists():
        if (directory / SCALES_FILE).exists():
            raise FileExistsError(f"{directory / SCALES_FILE} already exists")
        return True
    if [p.name for p in directory.glob("*.safetensors")] == [SINGLE_FILE]:
        return False
    raise ValueError(f"{directory} has neither {INDEX_FILE} nor a lone {SINGLE_FILE}: no file that every loader "
                     "reads could take the scales")


def _add_shard(directory: pathlib.Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(directory / SCALES_FILE), metadata={"format": "pt"})
    index_path = directory / INDEX_FILE
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: SCALES_FILE for name in tensors})
    metadata = index.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("total_size"), int):
        metadata["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(index_path, index)


def _add_to_single_file(path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> None:
    """Rewrites `path` with `tensors` added, keeping its metadata; replaced atomically."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    weights = load_file(str(path))
    tmp = path.with_name(path.name + ".tmp")
    save_file({**weights, **tensors}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


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


_PROJECTIONS = (".k_proj.weight", ".qkv_proj.weight")
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.)")


def _attention_template(directory: pathlib.Path, num_layers: int) -> str:
    """'model.layers.{}.self_attn': the module above the K projection, present for every layer."""
    layers_by_template: dict[str, set[int]] = {}
    for name in _tensor_names(directory):
        suffix = next((s for s in _PROJECTIONS if name.endswith(s)), None)
        match = _LAYER_INDEX.search(name[: -len(suffix)]) if suffix else None
        if match:
            module = name[: -len(suffix)]
            template = module[: match.start(1)] + "{}" + module[match.end(1):]
            layers_by_template.setdefault(template, set()).add(int(match.group(1)))
    complete = [t for t, layers in layers_by_template.items() if layers == set(range(num_layers))]
    if len(complete) != 1:
        seen = ", ".join(sorted(layers_by_template)) or "none"
        raise ValueError(f"cannot tell the attention modules of {directory} from its weight names (K projections "
                         f"of all {num_layers} layers found under: {seen}); pass module_template, e.g. "
                         "'model.layers.{}.self_attn'")
    return complete[0]


def _tensor_names(directory: pathlib.Path) -> list[str]:
    index_path = directory / INDEX_FILE
    if index_path.exists():
        return list(json.loads(index_path.read_text())["weight_map"])
    from safetensors import safe_open

    names = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


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


def _write_json(path: pathlib.Path, data: dict) -> None:
    """Replaces `path` atomically, so an interrupted export never leaves a half-written file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def export_legacy_json(path: str | os.PathLike, kv_cache: KVCacheConfig, *, model_type: str | None = None,
                       group=None) -> pathlib.Path:
    """Writes the legacy `{"model_type", "kv_cache": {"dtype", "scaling_factor": {"0": {layer: s}}}}`.

    The format holds one scale per layer for K and V together: max(k_scale, v_scale), so neither
    saturates. Per-tensor scales only. Keep the file out of a checkpoint that already holds scale
    tensors (the loader refuses two sources); pass it to the loader as scales_json.
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
    distributed.on_writer(lambda: _write_json(path, data), group)
    return path


# ----------------------------------------------------------------------------- data


def token_id_sequences(path: str | os.PathLike, vocab_size: int) -> list[torch.Tensor]:
    """One int64 sequence per non-empty line of whitespace-separated token ids in [0, vocab_size)."""
    sequences = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        try:
            ids = [int(f) for f in fields]
        except ValueError:
            raise ValueError(f"{path}:{number}: token ids must be integers separated by whitespace") from None
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{path}:{number}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        sequences.append(torch.tensor(ids, dtype=torch.int64))
    if not sequences:
        raise ValueError(f"{path} holds no token ids")
    return sequences


def text_sequences(path: str | os.PathLike, tokenizer, seq_len: int) -> list[torch.Tensor]:
    """The text of `path`, tokenized as one stream and cut into sequences of up to `seq_len` tokens,
    each starting with the tokenizer's BOS token when it has one (as prompts do at inference)."""
    text = pathlib.Path(path).read_text()
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise ValueError(f"{path} holds no text")
    bos = tokenizer.bos_token_id
    body = seq_len - (bos is not None)
    if body < 1:
        raise ValueError(f"seq_len must leave room for one token after BOS, got {seq_len}")
    prefix = [bos] if bos is not None else []
    return [torch.tensor(prefix + ids[i:i + body], dtype=torch.int64) for i in range(0, len(ids), body)]


def make_batches(sequences: Iterable[torch.Tensor], seq_len: int, batch_size: int = 1,
                 max_tokens: int | None = None) -> list[torch.Tensor]:
    """Rows of at most `seq_len` tokens (longer sequences are cut), grouped `batch_size` at a time
    into [rows, length] batches of equal-length rows, so no row needs padding. `max_tokens` stops
    after that many tokens in total."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens > 0):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    rows, budget = [], max_tokens if max_tokens is not None else math.inf
    for sequence in sequences:
        for start in range(0, sequence.numel(), seq_len):
            if budget <= 0:
                break
            row = sequence[start:start + min(seq_len, budget)]
            rows.append(row)
            budget -= row.numel()
    by_length: dict[int, list[torch.Tensor]] = {}
    for row in rows:
        by_length.setdefault(row.numel(), []).append(row)
    return [torch.stack(group[i:i + batch_size]) for group in by_length.values()
            for i in range(0, len(group), batch_size)]


# ----------------------------------------------------------------------------- transformers models


def calibrate(model, batches: Iterable[torch.Tensor], *, granularity: str = "tensor", progress: bool = True,
              group=None) -> KVAmax:
    """The K/V maxima of a transformers model over `batches` ([rows, length] token ids, no padding).

    Every rank of a tensor-parallel model calls it with the same batches (a collective at the end).
    """
    calibrator = KVCalibrator.for_model(model, granularity)
    observe_model(model, batches, calibrator, progress=progress)
    return calibrator.result(group)


def observe_model(model, batches: Iterable[torch.Tensor], calibrator: KVCalibrator, *, progress: bool = True) -> None:
    """Runs `model` over `batches`, each a fresh sequence batch, feeding every layer's K/V to `calibrator`.

    The model sees an ordinary transformers DynamicCache (sliding-window layers included), so it
    computes exactly what it computes at inference; the cache passes each layer's K/V to the
    calibrator as they are written. Batches go to the model's device; the model runs in eval mode
    without gradients.
    """
    from tqdm import tqdm

    batches = list(batches)
    device = next(model.parameters()).device
    cache_class = _calibration_cache_class()
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    was_training = model.training
    model.eval()
    bar = tqdm(total=sum(b.numel() for b in batches), unit="tok", desc="calibrating",
               disable=not progress or not distributed.is_writer())
    try:
        with torch.no_grad():
            for batch in batches:
                if batch.dim() != 2:
                    raise ValueError(f"a batch must be [rows, length] token ids, got shape {list(batch.shape)}")
                cache = cache_class(calibrator, model.config)
                model(input_ids=batch.to(device), past_key_values=cache, use_cache=True, **extra)
                bar.update(batch.numel())
    finally:
        bar.close()
        model.train(was_training)


@functools.cache
def _calibration_cache_class():
    """The DynamicCache subclass (built on first use: transformers is an optional dependency)."""
    from transformers import DynamicCache

    class CalibrationCache(DynamicCache):
        """A DynamicCache that shows each layer's new K/V ([batch, kv_heads, new, head_size]) to a calibrator."""

        def __init__(self, calibrator: KVCalibrator, config):
            super().__init__(config=config)
            self.calibrator = calibrator

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            head_size = key_states.shape[-1]
            tokens = [t.transpose(1, 2).reshape(-1, t.shape[1], head_size) for t in (key_states, value_states)]
            self.calibrator.observe(layer_idx, *tokens)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return CalibrationCache

