"""Calibration maxima to dequantization scales: `KVAmax.scales`, s = amax * margin / max_finite(format)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..formats import KVCacheConfig, KVCacheDtype
from ..rotation import Rotation

if TYPE_CHECKING:
    from .rotated import RotatedAmax

ZERO_AMAX_POLICIES = ("error", "unit")


class CalibrationError(ValueError):
    """Calibration maxima that cannot become scales (NaN/inf, all-zero), or layers never observed."""

    def __init__(self, problems):
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"calibration failed ({len(self.problems)} problem(s)):\n{lines}")


def check_scale_arguments(fmt: KVCacheDtype | str, margin: float, zero_amax: str) -> KVCacheDtype:
    """Raises ValueError naming the first bad argument of `KVAmax.scales`; returns `fmt` parsed."""
    fmt = KVCacheDtype.parse(fmt)
    if not fmt.is_e4m3:
        raise ValueError(f"scales are calibrated for an e4m3 format (float8_e4m3fn or float8_e4m3fnuz), got "
                         f"{fmt.value}; an e5m2 cache loads e4m3fn scales unchanged")
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 1.0):
        raise ValueError(f"margin must be a finite number >= 1, got {margin!r}")
    if zero_amax not in ZERO_AMAX_POLICIES:
        raise ValueError(f"zero_amax must be one of {ZERO_AMAX_POLICIES}, got {zero_amax!r}")
    return fmt


@dataclass(frozen=True)
class KVAmax:
    """max |K| and max |V| per layer: 1 value (per tensor) or num_kv_heads values in global head order.

    num_tokens: how many tokens this rank observed (per layer). rotated: the rotated recipe's
    statistics (calibration.rotated), or None where the head size has no rotation.
    """

    k: tuple[tuple[float, ...], ...]
    v: tuple[tuple[float, ...], ...]
    num_tokens: int = 0
    rotated: RotatedAmax | None = None

    @property
    def granularity(self) -> str:
        return "tensor" if len(self.k[0]) == 1 else "head"

    def scales(self, fmt: KVCacheDtype | str = KVCacheDtype.E4M3FN, *, margin: float = 1.0,
               zero_amax: str = "error") -> KVCacheConfig:
        """The plain recipe's dequantization scales s = amax * margin / max_finite(fmt), rounded to
        float32, for all heads (the rotated recipe's: `rotated.kv_cache`).

        fmt: the format the scales are calibrated for: float8_e4m3fn (loads as e4m3fn, e4m3fnuz x2,
            e5m2 as is) or float8_e4m3fnuz.
        margin: >= 1; headroom above the calibration maximum (1.0 maps it to max_finite exactly).
        zero_amax: what an all-zero head (or layer) gets: 'error' (default) raises CalibrationError
            naming it; 'unit' gives it scale 1.0, the uncalibrated default, and warns naming it.
        NaN or inf maxima always raise CalibrationError naming layer, K/V and head.
        """
        fmt = check_scale_arguments(fmt, margin, zero_amax)
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
        return KVCacheConfig(fmt, k, v, source, Rotation.NONE)

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
