"""A checkpoint in, the checkpoint with K/V cache scales out: `calibrate_checkpoint` loads a
transformers causal LM, observes its K/V over token batches, turns the maxima into scales and
exports them (what `python -m fp8kv calibrate` runs)."""

from __future__ import annotations

import contextlib
import os
import pathlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable

import torch

from ..checkpoint.config import CONFIG_FILE
from ..checkpoint.legacy_json import LEGACY_JSON_FILE
from ..checkpoint.rotated_recipe import RECIPE_FILE
from ..formats import KVCacheConfig, KVCacheDtype
from ..loading import load_causal_lm
from .export import export_checkpoint, export_legacy_json, scales_file
from .observe import calibrate, check_granularity
from .scales import KVAmax, check_scale_arguments

# The steps of calibrate_checkpoint, in the order they run.
STEPS = ("load", "observe", "scales", "export", "legacy_json")


@dataclass(frozen=True)
class CheckpointCalibration:
    """What `calibrate_checkpoint` measured and wrote.

    amax: the K/V maxima over the batches; kv_cache: the plain recipe's scales made of them (format,
    per-layer K and V scales); rotated: the rotated + centred recipe's (docs/rotated_cache.md), or
    None where the head size has no rotation; margin: the margin they were made with. out_dir: the
    checkpoint holding the scales, in its file scales_file (the rotated recipe's in
    fp8kv_kv_cache.json); legacy_json: the legacy JSON file written too, or None.
    device, model_dtype: where and in which dtype the model ran.
    """

    amax: KVAmax
    kv_cache: KVCacheConfig
    rotated: KVCacheConfig | None
    margin: float
    out_dir: pathlib.Path
    scales_file: pathlib.Path
    legacy_json: pathlib.Path | None
    device: torch.device
    model_dtype: torch.dtype

    def summary(self) -> str:
        """What was calibrated, each layer's largest K and V maximum and scale, and the files written."""
        amax, kv_cache = self.amax, self.kv_cache
        lines = [f"calibrated {kv_cache.num_layers} layers on {amax.num_tokens} tokens ({self.device}, "
                 f"{self.model_dtype}), per {amax.granularity}, for {kv_cache.dtype.value}, margin {self.margin:g}",
                 "", f"{'layer':>5}  {'K amax':>10} {'K scale':>11}  {'V amax':>10} {'V scale':>11}   "
                 "(largest over heads)"]
        for layer in range(kv_cache.num_layers):
            lines.append(f"{layer:>5}  {max(amax.k[layer]):>10.4g} {max(kv_cache.k_scales[layer]):>11.4g}  "
                         f"{max(amax.v[layer]):>10.4g} {max(kv_cache.v_scales[layer]):>11.4g}")
        if self.rotated is not None:
            lines += ["", "rotated + centred recipe (the default for FP8 caches):",
                      f"{'layer':>5}  {'K scale':>11} {'V scale':>11}  {'max |K offset|':>14}   (largest over heads)"]
            for layer in range(self.rotated.num_layers):
                offset = max(abs(x) for row in self.rotated.k_offsets[layer] for x in row)
                lines.append(f"{layer:>5}  {max(self.rotated.k_scales[layer]):>11.4g} "
                             f"{max(self.rotated.v_scales[layer]):>11.4g}  {offset:>14.4g}")
        legacy_json = f" and {self.legacy_json}" if self.legacy_json is not None else ""
        rotated = f", the rotated recipe's in {RECIPE_FILE}" if self.rotated is not None else ""
        lines += ["", f"wrote {self.out_dir} (scales in {self.scales_file.name}, declared in {CONFIG_FILE}{rotated})"
                  + legacy_json]
        return "\n".join(lines)


def calibrate_checkpoint(model_dir: str | os.PathLike, batches: Iterable[torch.Tensor], out_dir: str | os.PathLike,
                         *, fmt: KVCacheDtype | str = KVCacheDtype.E4M3FN, granularity: str = "tensor",
                         margin: float = 1.0, zero_amax: str = "error", device: torch.device | str = "cpu",
                         dtype: torch.dtype | str = "auto", legacy_json: str | os.PathLike | None = None,
                         progress: bool = True,
                         around_step: Callable[[str], ContextManager] | None = None) -> CheckpointCalibration:
    """Calibrates the K/V cache scales of the transformers causal LM in `model_dir` on `batches` and
    writes them into a checkpoint.

    model_dir: a local checkpoint directory (config.json + safetensors) without KV cache scales.
    batches: [rows, length] token ids without padding (see `make_batches`).
    out_dir: a new or empty directory outside model_dir, or model_dir itself to add the scales in
        place (see `export_checkpoint`).
    fmt, margin, zero_amax: as for `KVAmax.scales`; granularity: 'tensor' or 'head'.
    device: where the model runs; dtype: the model's dtype ('auto': the checkpoint's).
    legacy_json: also write the legacy kv_cache_scales.json here (per-tensor scales only; not into
        out_dir, where the loader would find two sources of scales).
    around_step: called with each step's name (STEPS: 'load' the model, 'observe' its K/V, make the
        'scales', 'export' them, write the 'legacy_json'); the step runs inside the context manager
        it returns, e.g. to report the step's errors as the fault of one input, as the CLI does.
    The arguments are checked before the model loads; each output is written all or nothing, the
    legacy JSON after the checkpoint.
    """
    fmt = check_scale_arguments(fmt, margin, zero_amax)
    check_granularity(granularity)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point or dtype == "auto"):
        raise ValueError(f"dtype must be 'auto' or a floating-point torch.dtype, got {dtype!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or its name (cpu, cuda, cuda:N), got {device!r}") from None
    if legacy_json is not None:
        legacy_json = pathlib.Path(legacy_json)
        if granularity != "tensor":
            raise ValueError("legacy_json: the legacy JSON holds per-tensor scales; calibrate with granularity "
                             "'tensor'")
        if legacy_json.resolve() == (pathlib.Path(out_dir) / LEGACY_JSON_FILE).resolve():
            raise ValueError(f"legacy_json: not {LEGACY_JSON_FILE} inside out_dir, which holds the scale tensors "
                             "(the loader refuses two sources); write it elsewhere")
    step = around_step or (lambda name: contextlib.nullcontext())

    with step("load"):
        model = load_causal_lm(model_dir, dtype, progress=progress).to(device)
    with step("observe"):
        amax = calibrate(model, batches, granularity=granularity, progress=progress)
    with step("scales"):
        kv_cache = amax.scales(fmt, margin=margin, zero_amax=zero_amax)
        rotated = None
        if amax.rotated is not None:
            rotated = amax.rotated.kv_cache(fmt, granularity, margin=margin, zero_amax=zero_amax)
    with step("export"):
        out = export_checkpoint(model_dir, out_dir, kv_cache, rotated=rotated)
    if legacy_json is not None:
        with step("legacy_json"):
            export_legacy_json(legacy_json, kv_cache, model_type=getattr(model.config, "model_type", None))
    return CheckpointCalibration(amax, kv_cache, rotated, margin, out, out / scales_file(out), legacy_json, device,
                                 model.dtype)
