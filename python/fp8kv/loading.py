"""Loading a user's checkpoint as a transformers causal LM, strictly.

transformers fills the weights a checkpoint lacks with fresh random values and only logs a report;
weights it cannot load (another shape than the config's, a failed conversion) stop it with a
RuntimeError that refers to that report. Calibrating or evaluating a model with random weights
measures nothing, so here every weight of the model comes from the checkpoint with the shape its
config gives, or loading fails with a `WeightsMismatchError` naming the directory and the tensors
(or, for transformers' own refusals, carrying its report); damaged weight files are a
`CheckpointError` naming the file. Tensors the model does not use (such as
KV cache scales) are fine.

A checkpoint that declares only KV cache scales (a compressed-tensors kv_cache_scheme without quantized
weights, as `fp8kv calibrate` and llm-compressor write it) loads as the plain model: fp8kv's cache
applies the scales (fp8kv.load_kv_cache_config), and transformers 5.17 (not 5.24) would otherwise have
compressed-tensors quantize K and V inside the model's own attention too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

import torch

SHOWN = 3  # tensors named per kind of problem; the rest are counted


class WeightsMismatchError(ValueError):
    """A checkpoint's weights do not fit the model its config describes."""


def load_causal_lm(model_dir: str | os.PathLike, dtype: torch.dtype | str, *, progress: bool = True):
    """`AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)`, refusing missing weights and
    weights of the wrong shape. progress: transformers' loading bar.

    A truncated or corrupt safetensors file, or a missing shard of the index, is a CheckpointError
    naming the file, raised before transformers reads any weight (its own errors name no file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .checkpoint.tensor_files import check_tensor_files

    check_tensor_files(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    if _declares_only_kv_cache_scales(config):
        del config.quantization_config
    with _transformers_quiet(progress) as report:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype,
                                                               output_loading_info=True, ignore_mismatched_sizes=True)
        except RuntimeError as e:
            raise WeightsMismatchError(f"{model_dir}: transformers cannot load its weights: {e}"
                                       + "".join(f"\n{line}" for line in report)) from None
    problems = _problems(info)
    if problems:
        raise WeightsMismatchError(f"{model_dir}: the weights do not fit its config.json: {'; '.join(problems)}")
    return model


def _declares_only_kv_cache_scales(config) -> bool:
    quantization = getattr(config, "quantization_config", None)
    quantization = quantization if isinstance(quantization, dict) else getattr(quantization, "to_dict", dict)()
    return (quantization.get("quant_method") == "compressed-tensors" and bool(quantization.get("kv_cache_scheme"))
            and not quantization.get("config_groups"))


def _problems(info: dict) -> list[str]:
    problems = []
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        problems.append(f"{len(missing)} missing ({_first(missing)})")
    mismatched = sorted(info.get("mismatched_keys", ()))
    if mismatched:
        shapes = [f"{name} is {list(checkpoint)}, not {list(model)}" for name, checkpoint, model in mismatched]
        problems.append(f"{len(mismatched)} of another shape ({_first(shapes)})")
    return problems


def _first(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f", and {more} more" if more > 0 else "")


ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


class _Lines(logging.Handler):
    """Keeps the text of the records it receives, one entry per line, without terminal colours."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += ANSI_ESCAPE.sub("", record.getMessage()).rstrip().splitlines()


@contextlib.contextmanager
def _transformers_quiet(progress: bool):
    """Collects transformers' log (its load report) instead of printing it, and yields its lines:
    the errors above replace it. transformers' progress bar shows only with progress."""
    from transformers.utils import logging as transformers_logging

    root = transformers_logging.get_logger()  # the library's root logger, which holds its handlers
    collected = _Lines()
    handlers, bar = root.handlers[:], transformers_logging.is_progress_bar_enabled()
    root.handlers = [collected]
    if not progress:
        transformers_logging.disable_progress_bar()
    try:
        yield collected.lines
    finally:
        root.handlers = handlers
        if bar:
            transformers_logging.enable_progress_bar()
