"""KV cache formats and the object that carries a format together with its recipe and scales.

`KVCacheDtype` names the storage format of the cache; `KVCacheConfig` pairs it with the recipe (the
rotation and K offsets of docs/rotated_cache.md) and the per-layer K/V dequantization scales of the
stored values (stored `q = satfinite_rne(x / s)`, read `x ~ q * s`). Everything that builds or reads
a cache takes one `KVCacheConfig`, never a format, a recipe and scales separately.
"""

from __future__ import annotations

import enum
import math
import reprlib
from dataclasses import dataclass

import torch

from .rotation import Rotation, recipe_name


def platform_uses_fnuz() -> bool:
    """True on AMD MI300-class GPUs (gfx94x), whose FP8 hardware format is e4m3fnuz.

    This decides what the platform-dependent names `fp8` and `fp8_e4m3` mean (as in vLLM): e4m3fnuz
    on a ROCm build of torch running on a gfx94x device, e4m3fn everywhere else (CUDA, CPU, and AMD
    parts with OCP FP8 such as gfx950).
    """
    if torch.version.hip is None or not torch.cuda.is_available():
        return False
    arch = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName
    return arch.startswith("gfx94")


class KVCacheDtype(enum.Enum):
    """Storage format of the KV cache.

    UNQUANTIZED ("auto") stores K/V in the model's dtype, bit for bit, and ignores scales. The FP8
    formats store one byte per element; see `max_finite` for their ranges.
    """

    UNQUANTIZED = "auto"
    E4M3FN = "float8_e4m3fn"
    E5M2 = "float8_e5m2"
    E4M3FNUZ = "float8_e4m3fnuz"

    @classmethod
    def parse(cls, value: KVCacheDtype | str | torch.dtype) -> KVCacheDtype:
        """The format named by `value`: a KVCacheDtype, an FP8 torch dtype, or any name of
        `format_names()`: vLLM's, SGLang's and TGI's (`auto`, `fp8`, `fp8_e4m3`, `fp8_e5m2`, ...),
        torch's dtype names (`float8_e4m3fn`, `torch.float8_e4m3fn`, ...) and short ones (`e4m3`,
        `e5m2`, `e4m3fn`, `e4m3fnuz`). Case and surrounding blanks do not matter.

        `fp8`, `fp8_e4m3` and `e4m3` are platform-dependent (see `platform_uses_fnuz`): e4m3fnuz on
        MI300, e4m3fn elsewhere. The other names are not.
        """
        if isinstance(value, KVCacheDtype):
            return value
        if isinstance(value, torch.dtype):
            for member in (cls.E4M3FN, cls.E5M2, cls.E4M3FNUZ):
                if member.storage_dtype == value:
                    return member
            raise ValueError(
                f"kv cache dtype {value} is not an FP8 dtype; use 'auto' for a cache in the model's dtype, "
                f"or one of {format_names()}"
            )
        if not isinstance(value, str):
            raise TypeError(f"kv cache dtype must be a KVCacheDtype, str or torch.dtype, got {type(value).__name__}")
        name = value.strip().lower().removeprefix("torch.")
        if name in _PLATFORM_E4M3_NAMES:
            return cls.E4M3FNUZ if platform_uses_fnuz() else cls.E4M3FN
        if name not in _FIXED_NAMES:
            raise ValueError(f"unknown kv cache dtype {value!r}; valid: {format_names()}")
        return _FIXED_NAMES[name]

    @property
    def is_fp8(self) -> bool:
        return self is not KVCacheDtype.UNQUANTIZED

    @property
    def is_e4m3(self) -> bool:
        """E4M3 formats have a narrow range (448 or 240) and need calibrated scales."""
        return self in (KVCacheDtype.E4M3FN, KVCacheDtype.E4M3FNUZ)

    @property
    def storage_dtype(self) -> torch.dtype | None:
        """The torch dtype of an FP8 cache; None for UNQUANTIZED, which follows the model."""
        return _STORAGE_DTYPES.get(self)

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the cache tensors are allocated with for a model computing in `model_dtype`."""
        return model_dtype if self is KVCacheDtype.UNQUANTIZED else _STORAGE_DTYPES[self]

    @property
    def max_finite(self) -> float:
        """Largest finite value of the FP8 format (448, 57344, 240); stored values saturate there."""
        if self is KVCacheDtype.UNQUANTIZED:
            raise ValueError("an unquantized ('auto') cache has no FP8 range")
        return float(torch.finfo(_STORAGE_DTYPES[self]).max)

    def scale_factor_from(self, calibrated_for: KVCacheDtype) -> float:
        """Factor turning scales calibrated for `calibrated_for` into scales for this format.

        The same e4m3 bits decode in e4m3fnuz to half their e4m3fn value, so doubling an e4m3fn
        scale for an e4m3fnuz cache stores exactly the bits an e4m3fn cache would hold (and halving
        goes back; the top e4m3fnuz code, 240, has no e4m3fn counterpart and saturates to 224 * s).
        E5M2 uses scales as given: any positive scale keeps its relative precision, and a scale
        calibrated for e4m3 keeps values within +-448, far inside e5m2's range.
        """
        if not (calibrated_for.is_e4m3 and self.is_fp8):
            raise ValueError(f"scales calibrated for {calibrated_for.value} cannot be converted to {self.value}")
        if calibrated_for is KVCacheDtype.E4M3FN and self is KVCacheDtype.E4M3FNUZ:
            return 2.0
        if calibrated_for is KVCacheDtype.E4M3FNUZ and self is KVCacheDtype.E4M3FN:
            return 0.5
        return 1.0


_STORAGE_DTYPES = {
    KVCacheDtype.E4M3FN: torch.float8_e4m3fn,
    KVCacheDtype.E5M2: torch.float8_e5m2,
    KVCacheDtype.E4M3FNUZ: torch.float8_e4m3fnuz,
}
_PLATFORM_E4M3_NAMES = ("fp8", "fp8_e4m3", "e4m3")
# Each format's canonical name (its value, torch's dtype name) first, then its aliases.
_FIXED_NAMES = {
    "auto": KVCacheDtype.UNQUANTIZED,
    "float8_e4m3fn": KVCacheDtype.E4M3FN,
    "fp8_e4m3fn": KVCacheDtype.E4M3FN,
    "e4m3fn": KVCacheDtype.E4M3FN,
    "float8_e5m2": KVCacheDtype.E5M2,
    "fp8_e5m2": KVCacheDtype.E5M2,
    "e5m2": KVCacheDtype.E5M2,
    "float8_e4m3fnuz": KVCacheDtype.E4M3FNUZ,
    "fp8_e4m3fnuz": KVCacheDtype.E4M3FNUZ,
    "e4m3fnuz": KVCacheDtype.E4M3FNUZ,
}


def format_names(accepted=lambda fmt: True) -> str:
    """The names `KVCacheDtype.parse` accepts for the formats `accepted(fmt)` selects, one group per
    format, canonical name first: what every command's help and every error lists."""
    groups = [f"{fmt.value} ({', '.join(n for n, f in _FIXED_NAMES.items() if f is fmt and n != fmt.value)})"
              for fmt in KVCacheDtype if fmt.is_fp8 and accepted(fmt)]
    if accepted(KVCacheDtype.E4M3FN) and accepted(KVCacheDtype.E4M3FNUZ):
        groups.append(f"{'/'.join(_PLATFORM_E4M3_NAMES)} (float8_e4m3fnuz on MI300 GPUs, else float8_e4m3fn)")
    if accepted(KVCacheDtype.UNQUANTIZED):
        groups.insert(0, "auto (the model's dtype, unquantized)")
    return ", ".join(groups)


_SCALES = "one float or num_kv_heads floats per layer, e.g. [(0.02,)] * num_layers"


def _layers(name: str, layers, expected: str) -> list:
    """`layers` as a list of per-layer entries; TypeError naming the argument for anything but a sequence
    (a float, a string or a mapping is no list of layers)."""
    if isinstance(layers, (str, bytes, dict)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"KVCacheConfig: {name} must be a sequence with {expected}, got {type(layers).__name__} "
                        f"{reprlib.repr(layers)}")
    return list(layers)


def _float32_tensor(name: str, value, expected: str) -> torch.Tensor:
    try:
        return torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"KVCacheConfig: {name} must be {expected}, got {type(value).__name__} "
                        f"{reprlib.repr(value)}") from None


def _float32_scales(name: str, layers) -> tuple[tuple[float, ...], ...]:
    """Per-layer scales as tuples of float32-exact Python floats, checked finite and positive."""
    result = []
    for layer, scales in enumerate(_layers(name, layers, _SCALES)):
        values = _float32_tensor(f"{name}[{layer}]", scales, "a float or a sequence of floats")
        if values.dim() > 1:
            raise ValueError(f"KVCacheConfig: {name}[{layer}] has shape {list(values.shape)}; expected 1 or "
                             "num_kv_heads scales")
        values = values.reshape(-1).tolist()
        if not values:
            raise ValueError(f"KVCacheConfig: {name}[{layer}] is empty; expected 1 or num_kv_heads scales")
        for head, s in enumerate(values):
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"KVCacheConfig: {name}[{layer}][{head}] = {s} must be finite and > 0")
        result.append(tuple(values))
    return tuple(result)


def _float32_offsets(layers, num_layers: int) -> tuple[tuple[tuple[float, ...], ...], ...]:
    """Per-layer K offsets [num_kv_heads][head_size] as float32-exact Python floats, checked finite."""
    result = []
    for layer, offsets in enumerate(_layers("k_offsets", layers, "[num_kv_heads][head_size] floats per layer")):
        values = _float32_tensor(f"k_offsets[{layer}]", offsets, "[num_kv_heads][head_size] floats")
        if values.dim() != 2 or values.numel() == 0:
            raise ValueError(f"KVCacheConfig: k_offsets[{layer}] must be [num_kv_heads, head_size], got shape "
                             f"{list(values.shape)}")
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"KVCacheConfig: k_offsets[{layer}] has values that are not finite")
        result.append(tuple(tuple(row) for row in values.tolist()))
    if len(result) != num_layers:
        raise ValueError(f"KVCacheConfig: k_offsets has {len(result)} layers but the scales have {num_layers}")
    return tuple(result)


@dataclass(frozen=True)
class KVCacheConfig:
    """A cache format with its recipe and per-layer K/V dequantization scales. Immutable.

    k_scales[layer] / v_scales[layer]: one float (per tensor) or num_kv_heads floats (per KV head of
    this tensor-parallel rank), exactly representable in float32: the scales of the values the cache
    stores (rotated ones under a rotation). An unquantized cache carries scales of 1.0 that the ops
    ignore.
    rotation: Rotation.HADAMARD (the default for FP8 formats) or Rotation.NONE (the plain recipe, the
        only one for an unquantized cache). None takes the default.
    k_offsets: None, or per layer [num_kv_heads][head_size] floats subtracted from K (in the rotated
        basis under a rotation) before it is stored: the rotated + centred recipe. FP8 formats only.
    source: where the scales came from, for reports.
    """

    dtype: KVCacheDtype
    k_scales: tuple[tuple[float, ...], ...]
    v_scales: tuple[tuple[float, ...], ...]
    source: str = "given"
    rotation: Rotation | None = None
    k_offsets: tuple[tuple[tuple[float, ...], ...], ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", KVCacheDtype.parse(self.dtype))
        object.__setattr__(self, "k_scales", _float32_scales("k_scales", self.k_scales))
        object.__setattr__(self, "v_scales", _float32_scales("v_scales", self.v_scales))
        if len(self.k_scales) != len(self.v_scales):
            raise ValueError(
                f"KVCacheConfig: k_scales has {len(self.k_scales)} layers but v_scales has {len(self.v_scales)}"
            )
        if not self.k_scales:
            raise ValueError("KVCacheConfig: needs scales for at least one layer")
        rotation = default_rotation(self.dtype) if self.rotation is None else Rotation.parse(self.rotation)
        if rotation is not Rotation.NONE and not self.dtype.is_fp8:
            raise ValueError(f"KVCacheConfig: an unquantized cache stores K/V as they are; rotation must be 'none', "
                             f"got {rotation.value!r}")
        object.__setattr__(self, "rotation", rotation)
        if self.k_offsets is not None:
            if not self.dtype.is_fp8:
                raise ValueError("KVCacheConfig: k_offsets apply to FP8 caches only")
            object.__setattr__(self, "k_offsets", _float32_offsets(self.k_offsets, len(self.k_scales)))

    @classmethod
    def unit_scales(cls, dtype: KVCacheDtype | str, num_layers: int, source: str = "unit scales",
                    rotation: Rotation | str | None = None) -> KVCacheConfig:
        """Scale 1.0 for every layer: right for unquantized and e5m2 caches, a fallback for e4m3."""
        ones = ((1.0,),) * num_layers
        return cls(KVCacheDtype.parse(dtype), ones, ones, source, rotation)

    @property
    def num_layers(self) -> int:
        return len(self.k_scales)

    @property
    def recipe(self) -> str:
        """"plain", "rotated" or "rotated + centred" (or "centred" for offsets without a rotation)."""
        return recipe_name(self.rotation, self.k_offsets is not None)

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype.torch_dtype(model_dtype)

    def k_scale(self, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A new float32 tensor [1] or [num_kv_heads] holding layer `layer`'s key scales."""
        return torch.tensor(self.k_scales[layer], dtype=torch.float32, device=device)

    def v_scale(self, layer: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A new float32 tensor [1] or [num_kv_heads] holding layer `layer`'s value scales."""
        return torch.tensor(self.v_scales[layer], dtype=torch.float32, device=device)

    def k_offset(self, layer: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """A new float32 tensor [num_kv_heads, head_size] of layer `layer`'s K offset, or None."""
        if self.k_offsets is None:
            return None
        return torch.tensor(self.k_offsets[layer], dtype=torch.float32, device=device)


def default_rotation(dtype: KVCacheDtype) -> Rotation:
    """The recipe's rotation when none is asked for: the Hadamard rotation for FP8 formats."""
    return Rotation.HADAMARD if dtype.is_fp8 else Rotation.NONE
