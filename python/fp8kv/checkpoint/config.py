"""What config.json (and ModelOpt's hf_quant_config.json) says: the model's layer and KV head
counts, the KV cache quantization it declares, and the format its scales were calibrated for.

- `quantization_config.kv_cache_scheme` (compressed-tensors: strategy tensor|attn_head);
- `kv_cache_quant_algo` (ModelOpt, in config.json or hf_quant_config.json);
- `kv_cache_torch_dtype` (the format the scales were calibrated for: float8_e4m3fn, the default,
  or float8_e4m3fnuz).
"""

from __future__ import annotations

import os
import pathlib

from ..formats import KVCacheDtype
from .files import Reader
from .problems import Fatal
from .values import check_int_argument, is_int, lookup, show

CONFIG_FILE = "config.json"
MODELOPT_FILE = "hf_quant_config.json"

# Far above any real model (a few hundred layers): a KVCacheConfig holds one entry per layer, so a
# hostile count must not exhaust memory or time.
MAX_NUM_LAYERS = 1 << 14

CALIBRATION_FORMATS = {"float8_e4m3fn": KVCacheDtype.E4M3FN, "float8_e4m3fnuz": KVCacheDtype.E4M3FNUZ}
_STRATEGY_GRANULARITY = {"tensor": "tensor", "attn_head": "head"}


def model_geometry(reader: Reader, config: dict, num_layers: int | None, num_kv_heads: int | None):
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
        if value is not None and not (is_int(value) and value > 0):
            reader.problem(path, name, f"must be a positive integer, got {show(value)}")
            value = None
        if value is not None and limit is not None and value > limit:
            raise reader.fatal(path, name, f"is {show(value)}, above the limit of {limit} (MAX_NUM_LAYERS)")
        if value is not None and given is not None and value != given:
            reader.problem(path, name, f"is {value} but {label}={given} was given")
        if value is None and given is None:
            raise reader.fatal(path, names[0], f"missing; pass {label}= to the loader")
        result.append(value if value is not None else given)
    return result


def model_head_size(config: dict) -> int | None:
    """The attention head size config.json gives (head_dim, or hidden_size / num_attention_heads, in
    it or its text_config); None when it gives neither as positive integers."""
    for source in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        head_dim, hidden, heads = (source.get(n) for n in ("head_dim", "hidden_size", "num_attention_heads"))
        if is_int(head_dim) and head_dim > 0:
            return head_dim
        if is_int(hidden) and is_int(heads) and hidden > 0 and heads > 0 and hidden % heads == 0:
            return hidden // heads
    return None


def quantization_hints(reader: Reader, config: dict) -> tuple[list[str], bool, str | None, list]:
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
            granularity = lookup(_STRATEGY_GRANULARITY, strategy)
            checks = (
                (scheme.get("type") == "float", f"type must be 'float' (FP8), got {show(scheme.get('type'))}"),
                (scheme.get("num_bits") == 8, f"num_bits must be 8, got {show(scheme.get('num_bits'))}"),
                (granularity is not None, f"strategy must be 'tensor' or 'attn_head', got {show(strategy)}"),
                (not scheme.get("dynamic", False), "dynamic=true (scales computed at run time) is not supported"),
                (scheme.get("symmetric", True) is True, "symmetric must be true: FP8 scales have no zero point"),
            )
            for ok, message in checks:
                if not ok:
                    reader.problem(path, where, message)
            shown = strategy if granularity else show(strategy)
            declared.append(f"compressed-tensors kv_cache_scheme (strategy {shown})")
            required = True

    for file, algo_owner, algo in _modelopt_algos(reader, quant):
        if algo is None:
            continue
        if algo != "FP8":
            reader.problem(file, f"{algo_owner}.kv_cache_quant_algo", f"only 'FP8' is supported, got {show(algo)}")
            continue
        declared.append(f"ModelOpt kv_cache_quant_algo FP8 ({pathlib.Path(file).name})")
        required = True

    for owner, holder in (("quantization_config", quant), (None, config)):
        hint = holder.get("kv_cache_torch_dtype")
        if hint is None:
            continue
        name = f"{owner}.kv_cache_torch_dtype" if owner else "kv_cache_torch_dtype"
        calibrated_for = lookup(CALIBRATION_FORMATS, hint)
        if calibrated_for is None:
            reader.problem(path, name, f"must be one of {sorted(CALIBRATION_FORMATS)}, got {show(hint)}")
        else:
            dtype_hints.append((str(path), name, calibrated_for))
    return declared, required, granularity, dtype_hints


def _modelopt_algos(reader: Reader, quant: dict):
    """(file, owner, kv_cache_quant_algo) from config.json and hf_quant_config.json."""
    yield str(reader.path(CONFIG_FILE)), "quantization_config", quant.get("kv_cache_quant_algo")
    modelopt = reader.path(MODELOPT_FILE)
    if os.path.lexists(modelopt):
        try:
            section = reader.json_object(modelopt).get("quantization") or {}
        except Fatal:
            return
        if not isinstance(section, dict):
            reader.problem(modelopt, "quantization", "must be an object")
            return
        yield str(modelopt), "quantization", section.get("kv_cache_quant_algo")


def check_geometry_arguments(num_layers, num_kv_heads) -> None:
    if num_layers is not None:
        check_int_argument("num_layers", num_layers, 1, MAX_NUM_LAYERS + 1)
    if num_kv_heads is not None:
        check_int_argument("num_kv_heads", num_kv_heads, 1)


