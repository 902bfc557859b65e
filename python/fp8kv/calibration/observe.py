"""Observing a model's K/V: `KVCalibrator` keeps the running maxima, `observe_model` / `calibrate`
drive a transformers model over token batches."""

from __future__ import annotations

import functools
import inspect
from typing import Iterable

import torch

from .. import distributed, ops
from ..checkpoint.values import format_ranges
from ..rotation import MIN_BLOCK, hadamard_block
from .rotated import RotatedAmax, RotatedObserver
from .scales import CalibrationError, KVAmax

GRANULARITIES = ("tensor", "head")


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


class KVCalibrator:
    """Running max |K| and max |V| of every layer, per tensor or per KV head, and the rotated
    recipe's statistics (calibration.rotated) where the head size has a rotation.

    num_layers, num_kv_heads: the model's (global) layer and KV head counts.
    granularity: 'tensor' (one maximum per layer) or 'head' (one per KV head).
    Each rank of a tensor-parallel model observes its own KV heads; `result` puts them together.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, granularity: str = "tensor"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_granularity(granularity)
        self.num_layers, self.num_kv_heads, self.granularity = num_layers, num_kv_heads, granularity
        self._k_amax: list[torch.Tensor | None] = [None] * num_layers
        self._v_amax: list[torch.Tensor | None] = [None] * num_layers
        self._rotated: list[RotatedObserver | None] = [None] * num_layers
        self.num_tokens = [0] * num_layers

    @classmethod
    def for_model(cls, model, granularity: str = "tensor") -> KVCalibrator:
        """A calibrator sized from a transformers model's (text) config."""
        config = model.config.get_text_config(decoder=True)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, num_kv_heads, granularity)

    def observe(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Folds one step's K/V of `layer` into its maxima (no host synchronization).

        key, value: [num_tokens, kv_heads, head_size] as written to the cache (K after rotary
        embedding), fp16/bf16/fp32, last dim contiguous; kv_heads: this rank's KV heads.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside the calibrator's {self.num_layers} layers")
        if key.dim() != 3 or value.shape != key.shape:
            raise ValueError(f"layer {layer}: key and value must both be [num_tokens, kv_heads, head_size], "
                             f"got {list(key.shape)} and {list(value.shape)}")
        width = 1 if self.granularity == "tensor" else key.shape[1]
        if self._k_amax[layer] is None:
            self._k_amax[layer] = torch.zeros(width, dtype=torch.float32, device=key.device)
            self._v_amax[layer] = torch.zeros(width, dtype=torch.float32, device=key.device)
            if hadamard_block(key.shape[2]) >= MIN_BLOCK:
                self._rotated[layer] = RotatedObserver(key.shape[1], key.shape[2], key.device)
        elif self._k_amax[layer].numel() != width:
            raise ValueError(f"layer {layer}: observed {key.shape[1]} KV heads, earlier {self._k_amax[layer].numel()}")
        ops.kv_amax(key, value, self._k_amax[layer], self._v_amax[layer])
        if self._rotated[layer] is not None:
            self._rotated[layer].observe(key, value)
        self.num_tokens[layer] += key.shape[0]

    def result(self, group=None) -> KVAmax:
        """The maxima of every layer over all ranks of `group` (default: all, when torch.distributed
        is initialized; a collective then, so every rank calls it). Raises CalibrationError when a
        layer was never observed."""
        missing = [layer for layer, amax in enumerate(self._k_amax) if amax is None]
        if missing:
            raise CalibrationError([f"layer(s) {format_ranges(missing)} of {self.num_layers} were never observed: their "
                                    "attention did not pass K/V to the calibrator (for transformers models: did "
                                    "not call past_key_values.update)"])
        widths = {amax.numel() for amax in self._k_amax}
        if len(widths) != 1:
            raise ValueError(f"layers observed different KV head counts: {sorted(widths)}")
        device = self._k_amax[0].device
        local = torch.stack([torch.stack([a.to(device) for a in amaxes]) for amaxes in (self._k_amax, self._v_amax)])
        if distributed.is_distributed():
            amax = distributed.reduce_amax(local, self.granularity, self.num_kv_heads, group)
        else:
            amax = local.cpu()
        if self.granularity == "head" and amax.shape[-1] != self.num_kv_heads:
            raise ValueError(f"observed {amax.shape[-1]} KV heads per layer, the model has {self.num_kv_heads} "
                             "(a tensor-parallel shard needs torch.distributed initialized to gather the others)")
        k, v = (tuple(tuple(row) for row in part.tolist()) for part in amax)
        rotated = None
        if self._rotated[0] is not None:
            rotated = RotatedAmax.gather(self._rotated, self.num_kv_heads, group)
        return KVAmax(k, v, self.num_tokens[0], rotated)


def calibrate(model, batches: Iterable[torch.Tensor], *, granularity: str = "tensor", progress: bool = True,
              group=None) -> KVAmax:
    """The K/V maxima of a transformers model over `batches` ([rows, length] token ids, no padding).

    Every rank of a tensor-parallel model calls it with the same batches (a collective at the end).
    """
    calibrator = KVCalibrator.for_model(model, granularity)
    observe_model(model, batches, calibrator, progress=progress)
    return calibrator.result(group)


def observe_model(model, batches: Iterable[torch.Tensor], calibrator: KVCalibrator, *, progress: bool = True) -> None:
    """Runs `model` over `batches`, each a fresh sequence batch, feeding every layer's K/V to `calibrator`.

    The model sees an ordinary transformers DynamicCache (sliding-window layers included), so it
    computes exactly what it computes at inference; the cache passes each layer's K/V to the
    calibrator as they are written. Batches go to the model's device; the model runs in eval mode
    without gradients.
    """
    from tqdm import tqdm

    from ..integrations.transformers import cache_argument

    batches = list(batches)
    device = next(model.parameters()).device
    cache_class = _calibration_cache_class()
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    was_training = model.training
    model.eval()
    bar = tqdm(total=sum(b.numel() for b in batches), unit="tok", desc="calibrating",
               disable=not progress or not distributed.is_writer())
    try:
        with torch.no_grad():
            for batch in batches:
                if batch.dim() != 2:
                    raise ValueError(f"a batch must be [rows, length] token ids, got shape {list(batch.shape)}")
                cache = cache_class(calibrator, model.config)
                model(input_ids=batch.to(device), **cache_argument(model, cache), use_cache=True, **extra)
                bar.update(batch.numel())
    finally:
        bar.close()
        model.train(was_training)


@functools.cache
def _calibration_cache_class():
    """The DynamicCache subclass (built on first use: transformers is an optional dependency)."""
    from transformers import DynamicCache

    class CalibrationCache(DynamicCache):
        """A DynamicCache that shows each layer's new K/V ([batch, kv_heads, new, head_size]) to a calibrator."""

        def __init__(self, calibrator: KVCalibrator, config):
            super().__init__(config=config)
            self.calibrator = calibrator

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            head_size = key_states.shape[-1]
            tokens = [t.transpose(1, 2).reshape(-1, t.shape[1], head_size) for t in (key_states, value_states)]
            self.calibrator.observe(layer_idx, *tokens)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return CalibrationCache
