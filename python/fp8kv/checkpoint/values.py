"""Checking, converting and showing the values a checkpoint's files or a caller's arguments hold."""

from __future__ import annotations

import math
import reprlib

import torch

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 200, 200, 40


def show(value) -> str:
    """repr of a value read from a user's file, shortened (one field can hold megabytes)."""
    return _SHORT.repr(value)


def format_ranges(layers: list[int]) -> str:
    spans, start = [], layers[0]
    for previous, current in zip(layers, layers[1:] + [None]):
        if current != previous + 1:
            spans.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(spans)


def lookup(table: dict, value):
    """table[value] for a string naming an entry; None otherwise (a JSON list or object included)."""
    return table.get(value) if isinstance(value, str) else None


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, float) or is_int(value)


def float32(value: float) -> float:
    """`value` rounded to float32 (inf beyond its range: JSON integers can have hundreds of digits)."""
    try:
        return float(torch.tensor(float(value), dtype=torch.float32))
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_int_argument(name: str, value, low: int, high: int | None = None) -> None:
    """TypeError unless `value` is an int (a bool is not), ValueError unless low <= value (< high)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} must be {bounds}, got {value}")
