"""Evaluating a model directory on a text: every argument checked and the text tokenized before
the weights load (`prepare`), then the model loaded, its caches built and scored (`evaluate`)."""

from __future__ import annotations

import dataclasses
import pathlib

import torch

from ..checkpoint.per_rank import load_kv_cache_config
from ..checkpoint.problems import CheckpointError
from ..checkpoint.reading import read_checkpoint_scales
from ..checkpoint.rotated_recipe import RECIPE_FILE
from .._ops import supported_values
from ..attention import FP8_MATH_FORMATS
from ..formats import KVCacheConfig
from ..loading import WeightsMismatchError, load_causal_lm
from ..rotation import Rotation
from .caches import (CACHES, FP8_MATH, UNQUANTIZED, cache_name, checkpoint_recipe, fp8_math, kv_cache_configs,
                     parse_cache)
from .metrics import evaluate_model
from .results import EvaluationResult

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # the paged attention op's query dtypes


def token_windows(ids: list[int], seq_len: int, count: int, bos: int | None) -> torch.Tensor:
    """`count` consecutive windows [count, seq_len] of the token stream `ids`, each after `bos` when given."""
    body = seq_len - (bos is not None)
    needed = count * body
    if len(ids) < needed:
        raise ValueError(f"--data: the text has {len(ids)} tokens; {count} windows (--windows) of {seq_len} tokens "
                         f"(--seq-len) need {needed}: give more text, fewer or shorter windows")
    prefix = [bos] if bos is not None else []
    return torch.tensor([prefix + ids[i * body:(i + 1) * body] for i in range(count)], dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything checked and prepared before the model's weights are loaded."""

    model_dir: pathlib.Path
    caches: tuple[str, ...]
    windows: torch.Tensor
    checkpoint: dict[Rotation, KVCacheConfig]
    device: torch.device
    dtype: torch.dtype


def _positive(name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
    return value


def _device(device) -> torch.device:
    from .._ops import has_cuda_kernels

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() and has_cuda_kernels() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device: not a device: {device!r} (cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: fp8kv runs on cpu or cuda, got {device}")
    if device.type == "cuda" and not (torch.cuda.is_available() and has_cuda_kernels()):
        raise ValueError(f"--device: {device} needs a CUDA device and fp8kv built with its CUDA kernels")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device: {device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
    return device


def _checkpoint_configs(model_dir: pathlib.Path, scales, num_layers: int,
                        num_kv_heads: int) -> dict[Rotation, KVCacheConfig]:
    """The e4m3 configs of --scales, else of the model's own checkpoint, by rotation: the plain
    recipe's where it has KV cache scales, the rotated recipe's where it has fp8kv_kv_cache.json."""
    source = pathlib.Path(scales) if scales is not None else model_dir
    found = read_checkpoint_scales(source)
    if found.problems:
        raise ValueError(f"{'--scales' if scales is not None else '--model'}: {CheckpointError(found.problems)}")
    if not (found.has_scales or found.rotated):
        if scales is not None:
            raise ValueError(f"--scales: {source} has no KV cache scales")
        return {}
    configs = {rotation: load_kv_cache_config(source, "fp8_e4m3", rotation=rotation)
               for rotation, present in ((Rotation.NONE, found.has_scales), (Rotation.HADAMARD, found.rotated))
               if present}
    for config in configs.values():
        widths = {len(s) for s in (*config.k_scales, *config.v_scales)}
        if config.num_layers != num_layers or not widths <= {1, num_kv_heads}:
            raise ValueError(f"--scales: {source} has scales for {config.num_layers} layers x {sorted(widths)} heads; "
                             f"the model has {num_layers} layers and {num_kv_heads} KV heads")
    return configs


def _available(name: str, checkpoint: dict[Rotation, KVCacheConfig]) -> bool:
    """Whether the cache `name` can be built: a checkpoint cache needs the checkpoint's recipe."""
    _, recipe, source = parse_cache(name)
    return source != "checkpoint" or checkpoint_recipe(checkpoint, recipe) is not None


def with_fp8_math(caches) -> tuple[str, ...]:
    """`caches` with, after each e4m3fn or e5m2 cache in 16-bit math, the same cache in FP8 math."""
    twins = []
    for name in caches:
        twins.append(name)
        if not fp8_math(name) and parse_cache(name)[0] in FP8_MATH_FORMATS:
            twins.append(f"{name}-{FP8_MATH}")
    return tuple(dict.fromkeys(twins))


def _check_fp8_math_device(caches, device: torch.device) -> None:
    """FP8 math runs on compute capability 9.0 GPUs: refused before the model loads elsewhere."""
    names = [name for name in caches if fp8_math(name)]
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if names and capability != tuple(supported_values("cuda_sm90a_capability")):
        where = device.type if capability is None else f"{device} of compute capability {capability[0]}.{capability[1]}"
        raise ValueError(f"--kv-cache-dtype {names[0]}: FP8 math runs on compute capability 9.0 GPUs, not on {where}")


def check_options(caches=None, *, seq_len: int = 2048, windows: int = 16, scales=None, device=None,
                  dtype: torch.dtype | str = torch.bfloat16):
    """The checks that need no model: (cache names or None, torch.device, torch.dtype)."""
    _positive("--seq-len", seq_len, 2)
    _positive("--windows", windows)
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in DTYPES.values():
        raise ValueError(f"--dtype: the paged cache runs models in {' or '.join(DTYPES)}, got {dtype}")
    if scales is not None and not (pathlib.Path(scales) / "config.json").is_file():
        raise ValueError(f"--scales: {scales} is not a checkpoint directory (no config.json)")
    device = _device(device)
    if caches is not None:
        try:
            caches = tuple(dict.fromkeys(cache_name(name) for name in caches if name != UNQUANTIZED))
        except ValueError as e:
            raise ValueError(f"--kv-cache-dtype: {e}") from None
        _check_fp8_math_device(caches, device)
    return caches, device, dtype


def prepare(model_dir, text: str, caches=None, *, seq_len: int = 2048, windows: int = 16, scales=None, device=None,
            dtype: torch.dtype | str = torch.bfloat16, fp8_math_rows: bool = False) -> _Plan:
    """Checks every argument and tokenizes the text, without loading the model's weights."""
    from transformers import AutoConfig, AutoTokenizer

    caches, device, dtype = check_options(caches, seq_len=seq_len, windows=windows, scales=scales, device=device,
                                          dtype=dtype)
    model_dir = pathlib.Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"--model: {model_dir} is not a checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(model_dir).get_text_config(decoder=True)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    checkpoint = _checkpoint_configs(model_dir, scales, config.num_hidden_layers, num_kv_heads)
    if caches is None:
        caches = tuple(cache_name(name) for name in CACHES if _available(name, checkpoint))
    if fp8_math_rows:
        caches = with_fp8_math(caches)
        _check_fp8_math_device(caches, device)
    for name in caches:
        if not _available(name, checkpoint):
            raise ValueError(f"--kv-cache-dtype: {name} needs that recipe's KV cache scales (the plain recipe's "
                             f"k_scale / v_scale, the rotated recipe's {RECIPE_FILE}, with K offsets for a centred "
                             f"cache), and {scales or model_dir} has none; pass --scales CKPT")
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"--seq-len: {seq_len} is beyond the model's max_position_embeddings ({max_positions})")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ValueError(f"--model: {model_dir} has no tokenizer (tokenizer.json, tokenizer_config.json, "
                         "tokenizer.model)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return _Plan(model_dir, caches, token_windows(ids, seq_len, windows, tokenizer.bos_token_id), checkpoint,
                 device, dtype)


def evaluate(model_dir, text: str, caches=None, *, seq_len: int = 2048, windows: int = 16, scales=None,
             device=None, dtype: torch.dtype | str = torch.bfloat16, progress: bool = True,
             setup: dict | None = None, on_row=None, fp8_math_rows: bool = False) -> EvaluationResult:
    """Scores the unquantized paged cache and each of `caches` (FORMAT[-RECIPE][-SOURCE] names, see
    caches; default: those of CACHES that apply) on `windows` windows of `seq_len` tokens of `text`,
    with the model of `model_dir` in `dtype` on `device` (default: CUDA when available). `scales`: a
    checkpoint directory whose scales `-checkpoint` caches use (default: the model's own, if any).
    on_row: as evaluate_model's (each cache's result as it is final); interrupted, evaluate_model's
    EvaluationInterrupted carries the scores over the windows completed. fp8_math_rows: each e4m3fn /
    e5m2 cache also in FP8 math (with_fp8_math).

    Raises ValueError naming the command-line option for bad arguments and files, before the
    model's weights are loaded.
    """
    plan = prepare(model_dir, text, caches, seq_len=seq_len, windows=windows, scales=scales, device=device,
                   dtype=dtype, fp8_math_rows=fp8_math_rows)
    model = load_model(plan, progress=progress)
    kv_caches = kv_cache_configs(model, plan.windows, plan.caches, checkpoint=plan.checkpoint, progress=progress)
    return evaluate_model(model, plan.windows, kv_caches, progress=progress, on_row=on_row,
                          setup={"model": str(plan.model_dir), **(setup or {}), **environment(plan)})


def load_model(plan: _Plan, progress: bool = True):
    """The plan's model in its dtype on its device, in eval mode with transformers' SDPA attention."""
    try:
        model = load_causal_lm(plan.model_dir, plan.dtype, progress=progress)
    except (WeightsMismatchError, CheckpointError) as e:
        raise ValueError(f"--model: {e}") from None
    except (OSError, ImportError) as e:
        raise ValueError(f"--model: transformers cannot load {plan.model_dir}: {e}") from None
    model = model.to(plan.device).eval()
    model.set_attn_implementation("sdpa")
    return model


def environment(plan: _Plan) -> dict:
    """What the numbers were measured with: device, dtype and versions."""
    import platform

    import transformers

    from .. import __version__

    if plan.device.type == "cuda":
        device = torch.cuda.get_device_name(plan.device)
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return dict(device=device, dtype=str(plan.dtype).removeprefix("torch."), torch=torch.__version__,
                transformers=transformers.__version__, fp8kv=__version__)


def model_directory(model: str) -> pathlib.Path:
    """--model: a checkpoint directory, or SMOLLM2_NAME for the packaged model (converted on first use)."""
    from ..models import SMOLLM2_NAME, MissingDependencyError, checkpoint_directory

    try:
        path = checkpoint_directory(model)
    except MissingDependencyError as e:
        raise ValueError(f"--model {SMOLLM2_NAME}: {e}") from None
    if not (path / "config.json").is_file():
        raise ValueError(f"--model: {path} is not a checkpoint directory (no config.json); pass one, or "
                         f"'{SMOLLM2_NAME}'")
    return path
