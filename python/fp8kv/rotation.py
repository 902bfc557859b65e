"""The rotation of the rotated cache recipe (docs/rotated_cache.md), in PyTorch.

`Rotation` names what an FP8 cache's K/V are rotated by before they are stored; `hadamard` applies the
same orthonormal block Hadamard matrix as the kernels, for calibration (offsets and maxima of the
stored values) and reports.
"""

from __future__ import annotations

import enum
import math

import torch

MIN_BLOCK = 16   # smaller blocks are refused (the ops' kMinHadamardBlock)
MAX_BLOCK = 256  # the ops' kMaxHadamardBlock


class Rotation(enum.Enum):
    """What an FP8 cache's K/V are rotated by before they are stored.

    NONE: the plain recipe, what every engine stores. HADAMARD: the block Hadamard matrix over the
    head dimension (the rotated recipe, fp8kv's default for FP8 caches).
    """

    NONE = "none"
    HADAMARD = "hadamard"

    @classmethod
    def parse(cls, value: Rotation | str) -> Rotation:
        if isinstance(value, Rotation):
            return value
        if not isinstance(value, str):
            raise TypeError(f"rotation must be a Rotation or str, got {type(value).__name__}")
        name = value.strip().lower()
        for member in cls:
            if member.value == name:
                return member
        raise ValueError(f"unknown rotation {value!r}; valid: {', '.join(repr(m.value) for m in cls)}")


def recipe_name(rotation: Rotation, has_k_offsets: bool) -> str:
    """"plain", "rotated" or "rotated + centred" (or "centred": offsets without a rotation)."""
    rotated = rotation is Rotation.HADAMARD
    if not has_k_offsets:
        return "rotated" if rotated else "plain"
    return "rotated + centred" if rotated else "centred"


def hadamard_block(head_size: int) -> int:
    """The size of the rotation's blocks: the largest power of two dividing head_size, at most 256."""
    return min(head_size & -head_size, MAX_BLOCK)


def check_head_size(head_size: int) -> None:
    """Raises ValueError unless the rotation applies to head_size (blocks of at least 16)."""
    if hadamard_block(head_size) < MIN_BLOCK:
        raise ValueError(
            f"the rotated recipe needs a head size divisible by {MIN_BLOCK} (its blocks are the largest power of "
            f"two dividing it), got {head_size}; use rotation='none' (the plain recipe) for this model")


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_size] times the orthonormal block Hadamard matrix (symmetric: its own inverse), in
    x's dtype (float32 or float64 for calibration)."""
    head_size = x.shape[-1]
    check_head_size(head_size)
    block = hadamard_block(head_size)
    y = x.reshape(*x.shape[:-1], head_size // block, block)
    h = 1
    while h < block:
        pairs = y.reshape(*y.shape[:-1], block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(y.shape)
        h *= 2
    return (y / math.sqrt(block)).reshape(x.shape)
