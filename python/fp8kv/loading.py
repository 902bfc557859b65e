"""Loading a user's checkpoint as a transformers causal LM, strictly.

transformers fills the weights a checkpoint lacks with fresh random values and only logs a report;
weights of another shape than the config's stop it with a RuntimeError that refers to that report.
Calibrating or evaluating a model with random weights measures nothing, so here every weight of the
model comes from the checkpoint with the shape its config gives, or loading fails with a
`WeightsMismatchError` naming the directory and the tensors. Tensors the model does not use (such
as KV cache scales) are fine.
"""

from __future__ import annotations

import contextlib
import os

import torch

SHOWN = 3  # tensors named per kind of problem; the rest are counted


class WeightsMismatchError(ValueError):
    """A checkpoint's weights do not fit the model its config describes."""


def load_causal_lm(model_dir: str | os.PathLike, dtype: torch.dtype | str, *, progress: bool = True):
    """`AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)`, refusing missing weights and
    weights of the wrong shape. progress: transformers' loading bar."""
    from transformers import AutoModelForCausalLM

    with _transformers_quiet(progress):
        model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, output_loading_info=True,
                                                           ignore_mismatched_sizes=True)
    problems = _problems(info)
    if problems:
        raise WeightsMismatchError(f"{model_dir}: the weights do not fit its config.json: {'; '.join(problems)}")
    return model


def _problems(info: dict) -> list[str]:
    problems = []
    missing = sorted(info.get("missing_keys", ()))
    if missing:
        problems.append(f"{len(missing)} missing ({_first(missing)})")
    mismatched = sorted(info.get("mismatched_keys", ()))
    if mismatched:
        shapes = [f"{name} is {list(checkpoint)}, not {list(model)}" for name, checkpoint, model in mismatched]
        problems.append(f"{len(mismatched)} of another shape ({_first(shapes)})")
    problems += [str(message) for message in info.get("error_msgs", ())]
    return problems


def _first(items: list[str]) -> str:
    more = len(items) - SHOWN
    return ", ".join(items[:SHOWN]) + (f", and {more} more" if more > 0 else "")


@contextlib.contextmanager
def _transformers_quiet(progress: bool):
    """transformers' loading report is replaced by the error above; its bar shows only with progress."""
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    if not progress:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()
