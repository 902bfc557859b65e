"""Hugging Face transformers on fp8kv's paged FP8 KV cache.

    from fp8kv.integrations.transformers import PagedCache, enable
    model = enable(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    cache = PagedCache(load_kv_cache_config(path, "fp8_e4m3"), max_tokens=8192)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

Two public extension points of transformers (5.x) carry it: an attention function registered
with `AttentionInterface` (and a mask function with `AttentionMaskInterface`) under the name
"fp8kv", and `PagedCache`, a `Cache` whose layers write nothing themselves. Each layer's
`update` tags the new key tensor with its layer; the attention function then writes the new K/V
into the paged cache (quantizing with the layer's scales) and attends over it with fp8kv's ops.
Works for models whose attention calls `past_key_values.update` and then the attention function
with the returned tensors (Llama, Qwen2, Mistral and most decoder-only models), with greedy or
sampled decoding and left-padded batches; beam search and cache cropping are not supported.
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import PagedAttention
from ..cache import BatchMetadata, PagedKVCache
from ..formats import KVCacheConfig

ATTN_IMPLEMENTATION = "fp8kv"
_TAG = "_fp8kv_paged_layer"


def register() -> str:
    """Registers fp8kv's attention and mask functions with transformers; returns their name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
    return ATTN_IMPLEMENTATION


def enable(model):
    """Switches `model` to fp8kv attention (it then needs a PagedCache to generate). Returns it."""
    model.set_attn_implementation(register())
    return model


def padding_mask(*, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask the attention function gets: the 2D padding mask over the kv positions, or None
    when nothing is padded (causality is the kernel's)."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    return None if attention_mask.all() else attention_mask


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: query [batch, heads, new, head_size], key/value the
    [batch, kv_heads, new, head_size] states just passed to PagedCache.update."""
    handle = getattr(key, _TAG, None)
    if handle is None:
        raise RuntimeError(
            "fp8kv attention needs the key returned by a PagedCache update: pass past_key_values=PagedCache(...) "
            "to generate/forward (and use a model whose attention does not transform the cached key)"
        )
    if dropout:
        raise ValueError("fp8kv attention is for inference: dropout must be 0")
    if getattr(module, "sinks", None) is not None or kwargs.get("is_causal") is False:
        raise NotImplementedError("fp8kv attention is causal softmax attention: no attention sinks, no bidirectional")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"fp8kv attention takes padding masks only, got a {attention_mask.dim()}-D mask")
    cache, layer_idx = handle
    return cache.attend(layer_idx, query, key, value, attention_mask, scaling, sliding_window, softcap), None


class _PagedLayer(CacheLayerMixin):
    """One layer's view of the PagedCache: counts the tokens it has seen and tags new keys."""

    is_sliding = False
    is_compileable = False
    supports_early_init = False

    def __init__(self, owner: PagedCache, layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx, self.seen = owner, layer_idx, 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.owner.accept(self.layer_idx, key_states)
        self.seen += key_states.shape[-2]
        setattr(key_states, _TAG, (self.owner, self.layer_idx))
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("PagedCache does not support beam search, batch reordering or cropping")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


class PagedCache(Cache):
    """A transformers Cache backed by fp8kv's PagedKVCache in the format of `kv_cache`.

    kv_cache: the format and per-layer scales (e.g. from fp8kv.load_kv_cache_config).
    max_tokens: cache capacity in tokens, all sequences of the batch together; each sequence
        occupies whole blocks of `block_size` tokens.
    The storage is allocated at the first forward, on the model's device, with the model's KV head
    count and head size. Batch row i is sequence i; left padding is skipped, never cached.
    """

    def __init__(self, kv_cache: KVCacheConfig, *, max_tokens: int, block_size: int = 16, layout: str = "NHD"):
        if not isinstance(kv_cache, KVCacheConfig):
            raise TypeError(f"kv_cache must be a KVCacheConfig, got {type(kv_cache).__name__}")
        self.kv_cache, self.block_size, self.layout = kv_cache, block_size, layout
        self.num_blocks = math.ceil(max_tokens / block_size)
        self.paged: PagedKVCache | None = None
        self.attention: list[PagedAttention | None] = [None] * kv_cache.num_layers
        self._step: tuple[BatchMetadata, torch.Tensor | None] | None = None
        super().__init__(layers=[_PagedLayer(self, i) for i in range(kv_cache.num_layers)])

    def accept(self, layer_idx: int, key: torch.Tensor) -> None:
        """Allocates the storage at the first update."""
        if layer_idx >= self.kv_cache.num_layers:
            raise ValueError(f"the model has more layers than the KVCacheConfig's {self.kv_cache.num_layers}")
        if self.paged is None:
            self.paged = PagedKVCache(self.kv_cache, num_kv_heads=key.shape[1], head_size=key.shape[-1],
                                      num_blocks=self.num_blocks, block_size=self.block_size,
                                      model_dtype=key.dtype, device=key.device, layout=self.layout)

    def attend(self, layer_idx, query, key, value, attention_mask, scaling, sliding_window, softcap) -> torch.Tensor:
        """Writes the layer's new K/V into the paged cache and attends; returns [batch, new, heads, head_size]."""
        batch_size, num_heads, new, head_size = query.shape
        if layer_idx == 0:
            self._step = self._plan(batch_size, new, attention_mask)
        batch, rows = self._step
        module = self._attention(layer_idx, num_heads, key.shape[1], head_size, scaling, sliding_window, softcap)
        q, k, v = (t.transpose(1, 2).reshape(batch_size * new, t.shape[1], head_size) for t in (query, key, value))
        if rows is not None:
            q, k, v = q[rows], k[rows], v[rows]
        out = module(q, k, v, self.paged, batch)
        if rows is not None:
            out = torch.zeros(batch_size * new, num_heads, head_size, dtype=out.dtype, device=out.device).index_copy_(
                0, rows, out)
        return out.view(batch_size, new, num_heads, head_size)

    def _plan(self, batch_size: int, new: int, attention_mask: torch.Tensor | None):
        """Reserves this step's slots. Padded positions (mask 0) are neither cached nor attended."""
        if not self.paged.allocator.sequences:
            for seq in range(batch_size):
                self.paged.add_sequence(seq)
        elif len(self.paged.allocator.sequences) != batch_size:
            raise ValueError(f"PagedCache holds {len(self.paged.allocator.sequences)} sequences, the input has "
                             f"{batch_size} rows; use a new PagedCache for a new batch")
        if attention_mask is None:
            return self.paged.prepare(range(batch_size), [new] * batch_size), None
        real = attention_mask[:, -new:].to(torch.bool)
        counts = real.sum(1).tolist()
        rows = None if sum(counts) == real.numel() else real.reshape(-1).nonzero().squeeze(1)
        return self.paged.prepare(range(batch_size), counts), rows

    def _attention(self, layer_idx, num_heads, num_kv_heads, head_size, scaling, sliding_window, softcap):
        """The layer's PagedAttention, built at its first call with the model's own parameters."""
        window = sliding_window if sliding_window is not None else -1
        cap = softcap if softcap is not None else 0.0
        module = self.attention[layer_idx]
        if module is None:
            module = PagedAttention(num_heads, num_kv_heads, head_size, self.kv_cache, layer_idx,
                                    softmax_scale=scaling, sliding_window=window, logits_soft_cap=cap)
            self.attention[layer_idx] = module.to(self.paged.device)
        elif (module.num_heads, module.softmax_scale, module.sliding_window, module.logits_soft_cap) != (
                num_heads, module.softmax_scale if scaling is None else scaling, window, cap):
            raise ValueError(f"layer {layer_idx} attention parameters changed between calls")
        return module

    def reset(self) -> None:
        """Forgets every sequence (the storage stays allocated)."""
        super().reset()
        if self.paged is not None:
            for seq in self.paged.allocator.sequences:
                self.paged.free_sequence(seq)
        self._step = None

    @property
    def memory_bytes(self) -> int:
        """Bytes of K/V storage (0 before the first forward)."""
        return 0 if self.paged is None else self.paged.memory_bytes
