"""`PagedAttention`: the attention layer over a paged FP8 KV cache.

The module owns its layer's recipe (docs/rotated_cache.md) and dequantization scales: float32
buffers `k_scale` / `v_scale` of shape [num_kv_heads] (a per-tensor scale is broadcast to every
head) and, for the rotated + centred recipe, `k_offset` [num_kv_heads, head_size]. They are set
once, at construction from a `KVCacheConfig` or when a checkpoint's state dict is loaded, and never
change in forward.

State dict names: registered under a checkpoint's attention module P (e.g. as
`model.layers.0.self_attn.attn`), the module's own keys are `P.attn.k_scale` / `P.attn.v_scale`
(and legacy `P.attn.kv_scale`). `map_checkpoint_scale_names(model)` makes the names checkpoints
actually use land there: `P.k_scale` / `P.v_scale` (vLLM, llm-compressor), `P.kv_scale` (legacy),
`P.k_proj.k_scale` / `P.v_proj.v_scale` (ModelOpt). Those are scales of the plain recipe: a layer
with a rotation refuses them (its scales come with its KVCacheConfig, from `load_kv_cache_config`).
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .cache import BatchMetadata, PagedKVCache
from .checkpoint.per_rank import shard_kv_heads
from .checkpoint.problems import CheckpointError, Problem
from .checkpoint.scale_tensors import scale_values
from .formats import KVCacheConfig, KVCacheDtype, default_rotation
from .rotation import Rotation, check_head_size, recipe_name


class PagedAttention(nn.Module):
    """Writes a step's new K/V into the paged cache and attends over it.

    num_heads, num_kv_heads: this tensor-parallel rank's query and KV heads.
    kv_cache: a KVCacheConfig (recipe and scales from its layer `layer_idx`) or a format alone
        (scales 1.0 until a checkpoint's state dict is loaded).
    layer_idx: which layer of the PagedKVCache this module reads and writes.
    rotation: with a format alone, the recipe's rotation (None: the default, Rotation.HADAMARD for
        FP8 formats); a KVCacheConfig carries its own.
    scales_calibrated_for: the format the checkpoint's scales were calibrated for (state dict
        loading converts them, e.g. x2 for an e4m3fnuz cache); tp_rank, tp_size: how the
        checkpoint's per-head scales are sliced (KV heads split evenly, or replicated when fewer
        than ranks).
    fp8_math: multi-token queries (prefill, chunked prefill) in FP8 tensor-core math: an e4m3fn or
        e5m2 cache, and on CUDA a compute capability 9.0 GPU (fp8kv.ops.paged_attention's `fp8_math`
        says what it computes; other devices refuse the call).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        kv_cache: KVCacheConfig | KVCacheDtype | str,
        layer_idx: int,
        *,
        softmax_scale: float | None = None,
        sliding_window: int = -1,
        logits_soft_cap: float = 0.0,
        scales_calibrated_for: KVCacheDtype | str = KVCacheDtype.E4M3FN,
        tp_rank: int = 0,
        tp_size: int = 1,
        rotation: Rotation | str | None = None,
        fp8_math: bool = False,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.layer_idx = layer_idx
        self.softmax_scale = head_size**-0.5 if softmax_scale is None else softmax_scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.scales_calibrated_for = KVCacheDtype.parse(scales_calibrated_for)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        k_offset = None
        if isinstance(kv_cache, KVCacheConfig):
            if rotation is not None:
                raise ValueError("rotation: a KVCacheConfig carries its own recipe; give one or the other")
            self.kv_cache_dtype, self.rotation = kv_cache.dtype, kv_cache.rotation
            k_scale, v_scale = kv_cache.k_scales[layer_idx], kv_cache.v_scales[layer_idx]
            k_offset = kv_cache.k_offset(layer_idx)
        else:
            self.kv_cache_dtype = KVCacheDtype.parse(kv_cache)
            self.rotation = default_rotation(self.kv_cache_dtype) if rotation is None else Rotation.parse(rotation)
            KVCacheConfig.unit_scales(self.kv_cache_dtype, 1, rotation=self.rotation)  # refuses a rotated unquantized cache
            k_scale = v_scale = (1.0,)
        if self.rotation is Rotation.HADAMARD:
            check_head_size(head_size)
        check_fp8_math(fp8_math, self.kv_cache_dtype)
        self.fp8_math = fp8_math
        if k_offset is not None and tuple(k_offset.shape) != (num_kv_heads, head_size):
            raise ValueError(f"the KVCacheConfig's k_offsets[{layer_idx}] has shape {list(k_offset.shape)}; expected "
                             f"[num_kv_heads, head_size] = [{num_kv_heads}, {head_size}]")
        self.register_buffer("k_scale", self._per_head("k_scale", k_scale))
        self.register_buffer("v_scale", self._per_head("v_scale", v_scale))
        # Part of the recipe, like the rotation: it comes with the KVCacheConfig, not with state dicts.
        self.register_buffer("k_offset", k_offset, persistent=False)
        self.register_load_state_dict_pre_hook(self._load_checkpoint_scales)

    def _per_head(self, name: str, values: tuple[float, ...]) -> torch.Tensor:
        if len(values) not in (1, self.num_kv_heads):
            raise ValueError(f"{name} has {len(values)} values; expected 1 or num_kv_heads={self.num_kv_heads}")
        scales = torch.tensor(values, dtype=torch.float32)
        # The ops read scales on the device unchecked: this is where every scale of the module is made.
        if not bool(torch.isfinite(scales).all() and (scales > 0).all()):
            raise ValueError(f"{name} = {list(values)} must be finite and > 0 in float32")
        return scales.expand(self.num_kv_heads).clone()

    def _checkpoint_heads(self, tensor: torch.Tensor) -> int:
        """Width of a per-head checkpoint scale: num_kv_heads * tp_size, except that with one local
        KV head on several ranks (heads replicated) any head count dividing tp_size fits."""
        if self.num_kv_heads == 1 and self.tp_size > 1 and tensor.numel() > 1 and self.tp_size % tensor.numel() == 0:
            return tensor.numel()
        return self.num_kv_heads * self.tp_size

    @staticmethod
    def _load_checkpoint_scales(module, state_dict, prefix, *args) -> None:
        """Turns the checkpoint's scale tensors at this prefix into this rank's [num_kv_heads] buffers."""
        legacy = state_dict.pop(prefix + "kv_scale", None)
        if legacy is not None:
            for name in ("k_scale", "v_scale"):
                if prefix + name in state_dict:
                    raise CheckpointError([Problem("state_dict", prefix + "kv_scale",
                                                   f"conflicts with {prefix + name}: give one or the other")])
                state_dict[prefix + name] = legacy
        for name in ("k_scale", "v_scale"):
            if prefix + name in state_dict:
                state_dict[prefix + name] = module._convert(prefix + name, state_dict[prefix + name])

    def _convert(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        values, error = scale_values(tensor, self._checkpoint_heads(tensor))
        if error:
            raise CheckpointError([Problem("state_dict", key, error)])
        values = shard_kv_heads(values, self.tp_rank, self.tp_size)
        if self.kv_cache_dtype.is_fp8:
            factor = self.kv_cache_dtype.scale_factor_from(self.scales_calibrated_for)
            values = tuple(v * factor for v in values)
        return self._per_head(key, values).to(self.k_scale.device)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache,
                batch: BatchMetadata) -> torch.Tensor:
        """query [num_tokens, num_heads, head_size], key/value [num_tokens, num_kv_heads, head_size]:
        the batch's new tokens, sequences in order. Returns [num_tokens, num_heads, head_size]."""
        if (cache.kv_cache_dtype, cache.rotation) != (self.kv_cache_dtype, self.rotation):
            raise ValueError(f"PagedAttention layer {self.layer_idx} is {self.kv_cache_dtype.value} with rotation "
                             f"{self.rotation.value!r} but the cache is {cache.kv_cache_dtype.value} with rotation "
                             f"{cache.rotation.value!r}")
        return self.write_and_attend(query, key, value, *cache.layer(self.layer_idx), batch)

    def write_and_attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """forward on this layer's caches given as the ops take them ([num_blocks, block_size,
        num_kv_heads, head_size] in this module's format, written with its recipe): pages that a
        PagedKVCache does not own, such as transformers' continuous-batching cache."""
        hadamard = self.rotation is Rotation.HADAMARD
        # Read once: a buffer is found through nn.Module.__getattr__, about a microsecond of host time per read.
        k_scale, v_scale, k_offset = self.k_scale, self.v_scale, self.k_offset
        ops.reshape_and_cache(key, value, key_cache, value_cache, batch.slot_mapping, k_scale, v_scale, hadamard,
                              k_offset)
        out = torch.empty_like(query)
        ops.paged_attention(out, query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                            batch.cu_seqlens_q, self.softmax_scale, k_scale, v_scale,
                            self.sliding_window, self.logits_soft_cap, hadamard, k_offset, self.fp8_math)
        return out

    @property
    def recipe(self) -> str:
        """"plain", "rotated" or "rotated + centred" (or "centred": offsets without a rotation)."""
        return recipe_name(self.rotation, self.k_offset is not None)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_size={self.head_size}, kv_cache={self.kv_cache_dtype.value}, recipe={self.recipe}"
                + (", fp8_math=True" if self.fp8_math else ""))


FP8_MATH_FORMATS = (KVCacheDtype.E4M3FN, KVCacheDtype.E5M2)


def check_fp8_math(fp8_math: bool, kv_cache_dtype: KVCacheDtype) -> None:
    """Refuses fp8_math where the format has no FP8 math (a bool, an e4m3fn or e5m2 cache)."""
    if not isinstance(fp8_math, bool):
        raise TypeError(f"fp8_math must be True or False, got {fp8_math!r}")
    if fp8_math and kv_cache_dtype not in FP8_MATH_FORMATS:
        raise ValueError(f"fp8_math needs a {FP8_MATH_FORMATS[0].value} or {FP8_MATH_FORMATS[1].value} cache, "
                         f"got {kv_cache_dtype.value}")


# Checkpoint names one level up (at the attention module P), relative to P: target buffer name.
_PARENT_NAMES = (
    ("k_scale", "k_scale"),
    ("v_scale", "v_scale"),
    ("kv_scale", "kv_scale"),
    ("k_proj.k_scale", "k_scale"),
    ("v_proj.v_scale", "v_scale"),
)


def map_checkpoint_scale_names(model: nn.Module) -> nn.Module:
    """Lets `model.load_state_dict(checkpoint)` fill every PagedAttention from the names
    checkpoints use at its parent module P: P.k_scale, P.v_scale, P.kv_scale, P.k_proj.k_scale,
    P.v_proj.v_scale. Two names for the same buffer are an error. Returns `model`."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, PagedAttention):
                parent.register_load_state_dict_pre_hook(_parent_renamer(child_name))
    return model


def _parent_renamer(child_name: str):
    def rename(module, state_dict, prefix, *args) -> None:
        child = getattr(module, child_name)
        for source, target in _PARENT_NAMES:
            tensor = state_dict.pop(prefix + source, None)
            if tensor is None:
                continue
            if child.rotation is not Rotation.NONE:
                raise CheckpointError([Problem("state_dict", prefix + source, (
                    f"is a plain-recipe scale, but {prefix}{child_name} stores K/V rotated ({child.recipe} recipe): "
                    "its scales come with its KVCacheConfig (fp8kv.load_kv_cache_config reads the checkpoint's "
                    "rotated-recipe scales); build it with rotation='none' to use this one"))])
            destination = f"{prefix}{child_name}.{target}"
            if destination in state_dict:
                raise CheckpointError([Problem("state_dict", prefix + source,
                                               f"conflicts with another scale for {destination}")])
            state_dict[destination] = tensor
    return rename


class LayerAttentions:
    """The PagedAttention of each layer of a model whose attention calls fp8kv's, built at the
    layer's first call with the parameters the model gives (heads, head size, scaling, window, soft
    cap), the recipe and scales of `kv_cache` and `fp8_math`, on `device`; a later call with other
    parameters is an error. Their buffers never change address, so torch.compile may treat them as
    static."""

    def __init__(self, kv_cache: KVCacheConfig, device: torch.device, fp8_math: bool = False):
        check_fp8_math(fp8_math, kv_cache.dtype)
        self.kv_cache, self.device, self.fp8_math = kv_cache, device, fp8_math
        self._modules: list[PagedAttention | None] = [None] * kv_cache.num_layers

    def get(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int, scaling: float | None,
            sliding_window: int | None, softcap: float | None) -> PagedAttention:
        window = sliding_window if sliding_window is not None else -1
        cap = softcap if softcap is not None else 0.0
        module = self._modules[layer_idx]
        if module is None:
            module = PagedAttention(num_heads, num_kv_heads, head_size, self.kv_cache, layer_idx,
                                    softmax_scale=scaling, sliding_window=window, logits_soft_cap=cap,
                                    fp8_math=self.fp8_math).to(self.device)
            mark_static(*(buffer for buffer in (module.k_scale, module.v_scale, module.k_offset) if buffer is not None))
            self._modules[layer_idx] = module
        elif (module.num_heads, module.softmax_scale, module.sliding_window, module.logits_soft_cap) != (
                num_heads, module.softmax_scale if scaling is None else scaling, window, cap):
            raise ValueError(f"layer {layer_idx} attention parameters changed between calls")
        return module


def mark_static(*tensors: torch.Tensor) -> None:
    """Tells torch.compile that these tensors keep their address (updated in place, never replaced),
    so CUDA graphs read them directly instead of copying them in at every replay."""
    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)
