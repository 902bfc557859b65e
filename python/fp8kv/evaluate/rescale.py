"""Rescaling a model's K and V exactly, to show an FP8 cache other magnitudes of the same model."""

from __future__ import annotations

import math

import torch

from .metrics import attention_modules


def rescale_kv(model, k_factor: float, v_factor: float):
    """Makes every layer's K `k_factor` and V `v_factor` times larger without changing what the model
    computes: k_proj x k_factor with q_proj / k_factor (q.k unchanged; rotary embedding is a rotation),
    v_proj x v_factor with o_proj / v_factor. Powers of two keep every rounding of the model's own
    computation, so the rescaled model's logits are bit for bit the original's: only the magnitudes
    an FP8 cache sees change. For attention modules with q/k/v/o projections and no q/k norm
    (Llama, Mistral, Qwen2). Returns the model, changed in place.
    """
    for name, factor in (("k_factor", k_factor), ("v_factor", v_factor)):
        mantissa, _ = math.frexp(factor) if isinstance(factor, (int, float)) and math.isfinite(factor) else (0, 0)
        if mantissa != 0.5:
            raise ValueError(f"{name} must be a positive power of two (so the model's arithmetic stays exact), "
                             f"got {factor!r}")
    for module in attention_modules(model):
        projections = [getattr(module, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if any(p is None for p in projections) or hasattr(module, "k_norm"):
            raise ValueError(f"{type(module).__name__} has no separate q/k/v/o projections, or normalizes K: "
                             "rescaling its projections would not rescale the cached K/V exactly")
        q_proj, k_proj, v_proj, o_proj = projections
        with torch.no_grad():
            for proj, factor in ((q_proj, 1 / k_factor), (k_proj, k_factor), (v_proj, v_factor)):
                proj.weight.mul_(factor)
                if proj.bias is not None:
                    proj.bias.mul_(factor)
            o_proj.weight.div_(v_factor)
    return model
