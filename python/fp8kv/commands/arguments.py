"""Argument types shared by the commands: each checks a value when argparse parses it and raises
ArgumentTypeError, which argparse reports as `argument ARG: message`."""

from __future__ import annotations

import argparse
import math
import operator
import os
import pathlib

DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda when available and fp8kv has its CUDA kernels, else cpu)"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def margin(text: str) -> float:
    """The rule of KVAmax.scales: a finite number >= 1."""
    return _finite(text, lambda value: value >= 1.0, "a finite number >= 1")


def positive_number(text: str) -> float:
    return _finite(text, lambda value: value > 0, "a positive number")


def _finite(text: str, accepted, expectation: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and accepted(value)):
        raise argparse.ArgumentTypeError(f"expected {expectation}, got {text!r}")
    return value


# The formats a command takes, as predicates for fp8kv.formats.format_names (help texts list them).
FP8, E4M3 = operator.attrgetter("is_fp8"), operator.attrgetter("is_e4m3")


def fp8_format(text: str):
    """Any name of an FP8 cache format, as its KVCacheDtype."""
    return _cache_format(text, FP8, "an FP8 format")


def e4m3_format(text: str):
    """Any name of an e4m3 format (the formats scales are calibrated for), as its KVCacheDtype."""
    return _cache_format(text, E4M3, "an e4m3 format")


def _cache_format(text: str, accepted, kind: str):
    from ..formats import KVCacheDtype, format_names

    try:
        fmt = KVCacheDtype.parse(text)
    except ValueError:
        fmt = None
    if fmt is None or not accepted(fmt):
        raise argparse.ArgumentTypeError(f"expected {kind}, one of {format_names(accepted)}; got {text!r}")
    return fmt


def device(text: str):
    import torch

    from .._ops import has_cuda_kernels

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device is available (torch {torch.__version__})")
        if not has_cuda_kernels():
            raise argparse.ArgumentTypeError(f"{text}: fp8kv was built without its CUDA kernels (build it with a "
                                             "CUDA torch and nvcc installed)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def default_device():
    import torch

    from .._ops import has_cuda_kernels

    return torch.device("cuda" if torch.cuda.is_available() and has_cuda_kernels() else "cpu")


def input_file(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return path


def unwritable(directory: pathlib.Path) -> str | None:
    """What keeps us from creating files in `directory`, or None."""
    if not directory.exists():
        return f"directory {directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    return None


def output_directory(text: str) -> pathlib.Path:
    """A directory path; where it must be writable depends on --model (see the calibrate command)."""
    path = pathlib.Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    return path


def output_file(text: str) -> pathlib.Path:
    """A file path in an existing writable directory."""
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory")
    problem = unwritable(path.absolute().parent)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return path
