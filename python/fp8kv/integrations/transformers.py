"""Hugging Face transformers on fp8kv's paged FP8 KV cache.

    from fp8kv.integrations.transformers import PagedCache, cache_argument, enable
    from fp8kv.loading import load_causal_lm
    model = enable(load_causal_lm(path, torch.bfloat16))
    cache = PagedCache(load_kv_cache_config(path, "fp8_e4m3"), max_tokens=batch * 8192, compileable=True)
    out = model.generate(input_ids, attention_mask=mask, **cache_argument(model, cache), max_new_tokens=64)

`cache_argument` passes the cache under the name the installed transformers takes (`cache`, or
`past_key_values` before transformers renamed it), so the same code runs without a deprecation
warning on every supported version.

Two public extension points of transformers (5.x) carry it: an attention function registered
with `AttentionInterface` (and a mask function with `AttentionMaskInterface`) under the name
"fp8kv", and `PagedCache`, a `Cache` whose layers write nothing themselves. Each layer's
`update` tags the new key tensor with the cache's shared state; the attention function then writes
the new K/V into the paged cache (quantizing with the layer's scales) and attends over it with
fp8kv's ops. Works for models whose attention calls `past_key_values.update` and then the
attention function with the returned tensors (Llama, Qwen2, Mistral and most decoder-only models),
with greedy or sampled decoding and left-padded batches; beam search and cache cropping are not
supported.

Decode steps (one new token per sequence) are planned on the device, in place, in tensors of fixed
shapes (`fp8kv.cache.FixedBatch`), so the step can be compiled and captured in a CUDA graph: with
`compileable=True`, `generate` compiles the decode forward (transformers' static-cache path,
`torch.compile(mode="reduce-overhead")` by default on CUDA) and replays one graph per step, whatever
the number of layers. Steps with several new tokens (prefill) are planned on the host and run eagerly.
"""

from __future__ import annotations

import inspect
import math

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import LayerAttentions, check_fp8_math, mark_static
from ..cache import BatchMetadata, CacheFullError, FixedBatch, PagedKVCache
from ..formats import KVCacheConfig
from . import transformers_continuous_batching as continuous_batching

ATTN_IMPLEMENTATION = "fp8kv"
_TAG = "_fp8kv_paged_layer"
_NOT_ENABLED = ("PagedCache: the model's attention ignored the paged cache (layer {layer}'s keys never reached fp8kv's "
                "attention): call enable(model) from fp8kv.integrations.transformers before generate or forward")
_REUSED = ("PagedCache: this step does not continue the sequences the cache holds ({held} positions): a PagedCache "
           "serves one batch; call cache.reset() (or use a new PagedCache) before generating for a new one")


def cache_argument(model, cache: Cache) -> dict:
    """The keyword argument that hands `cache` to `model`'s forward and generate: `cache` where the
    installed transformers takes it (it deprecates `past_key_values`), `past_key_values` before."""
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {keyword: cache}


def register() -> str:
    """Registers fp8kv's attention and mask functions with transformers; returns their name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, new_tokens_mask)
    return ATTN_IMPLEMENTATION


def enable(model):
    """Switches `model` to fp8kv attention (it then needs a PagedCache to generate). Returns it.

    Refuses a model whose attention quantizes K and V itself (attention modules holding a k_scale:
    transformers 5.17, not 5.24, loads a checkpoint's kv_cache_scheme that way, with compressed-tensors):
    the PagedCache quantizes them, and twice would change the results."""
    quantizing = [name for name, module in model.named_modules()
                  if type(module).__name__.endswith("Attention") and hasattr(module, "k_scale")]
    if quantizing:
        raise ValueError(f"{quantizing[0]} quantizes its own K and V (a k_scale loaded from the checkpoint's KV cache "
                         "scheme), and the PagedCache quantizes them again: load the model with "
                         "fp8kv.loading.load_causal_lm(path, dtype), which leaves the scales to the cache")
    model.set_attn_implementation(register())
    return model


def enable_continuous_batching(model, kv_cache: KVCacheConfig, *, fp8_math: bool = False):
    """Switches `model` to fp8kv attention for transformers' continuous batching (`generate_batch`,
    `init_continuous_batching`, `continuous_batching_context_manager`): transformers' paged cache
    then holds pages in `kv_cache`'s format, recipe and scales, which fp8kv's ops write and read.
    `generate` with a PagedCache keeps working on the model. Returns it.

    Refuses, with the reason: a transformers whose continuous batching fp8kv does not support (see
    transformers_continuous_batching.SUPPORTED_VERSIONS), a model with sliding-window layers, a
    KVCacheConfig of another layer count, a model that is not float16 or bfloat16, a head size the
    recipe or (on CUDA) the kernels do not take. On CUDA, a page_size fp8kv's kernels do not read
    is refused when the cache is made. transformers' CUDA graphs of the steps run on fp8kv's pages;
    transformers leaves them off unless asked (ContinuousBatchingConfig(use_cuda_graph=True,
    use_async_batching=True) turns them and its asynchronous batching on).

    Tensor parallel (a model loaded with tp_plan="auto" under torchrun): each rank's attention sees
    its own KV heads. `kv_cache` may be the whole model's (the same on every rank): its per-head
    scales and K offsets are sliced to this rank's heads as load_kv_cache_config(tp_rank=,
    tp_size=) slices them; or this rank's own (from that call with this rank), used as it is.
    Per-tensor scales are used as they are. Per-head values for any other number of heads are
    refused, naming both counts (without tensor parallelism too).

    fp8_math: the steps' multi-token queries (prompts) in FP8 tensor-core math (PagedAttention's
    `fp8_math`): an e4m3fn or e5m2 cache on a compute capability 9.0 GPU."""
    if not isinstance(kv_cache, KVCacheConfig):
        raise TypeError(f"kv_cache must be a KVCacheConfig, got {type(kv_cache).__name__}")
    check_fp8_math(fp8_math, kv_cache.dtype)
    continuous_batching.install_hooks()
    continuous_batching.check_model(model, kv_cache)
    rank_kv_cache = continuous_batching.rank_kv_cache(model, kv_cache)
    enable(model)
    continuous_batching.enable_model(model, rank_kv_cache, ATTN_IMPLEMENTATION, fp8_math)
    return model


def new_tokens_mask(*, q_length: int, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask the attention function gets: [batch, q_length] bool, False where a new token is
    padding, or None without a padding mask. A contiguous copy, whose shape and strides do not
    change with the context (a compiled decode step keeps one graph); causality is the kernel's,
    and padding is never cached."""
    if attention_mask is None:
        return None
    return attention_mask[:, -q_length:].clone(memory_format=torch.contiguous_format)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: query [batch, heads, new, head_size], key/value the
    [batch, kv_heads, new, head_size] states just passed to PagedCache.update."""
    handle = getattr(key, _TAG, None)
    if handle is None:
        cache = kwargs.get("cache")
        if continuous_batching.serves(cache):
            return continuous_batching.attend(module, query, key, value, cache, scaling, sliding_window, softcap,
                                              kwargs), None
        raise RuntimeError(
            "fp8kv attention needs the key returned by a PagedCache update: pass a PagedCache to generate/forward "
            "(**cache_argument(model, PagedCache(...))), and use a model whose attention does not transform the "
            "cached key"
        )
    if dropout:
        raise ValueError("fp8kv attention is for inference: dropout must be 0")
    if getattr(module, "sinks", None) is not None or kwargs.get("is_causal") is False:
        raise NotImplementedError("fp8kv attention is causal softmax attention: no attention sinks, no bidirectional")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"fp8kv attention takes padding masks only, got a {attention_mask.dim()}-D mask")
    state, layer_idx = handle
    return state.attend(layer_idx, query, key, value, attention_mask, scaling, sliding_window, softcap,
                        kwargs.get("position_ids")), None


class _PagedState:
    """What the layers and the attention function share: the storage, the batch's index tensors and
    the layers' PagedAttention modules. It refers to neither the PagedCache nor its layers, so the
    storage goes as soon as the last reference to the cache does (no cycle left for gc to find)."""

    def __init__(self, kv_cache: KVCacheConfig, num_blocks: int, block_size: int, layout: str, fp8_math: bool):
        self.kv_cache, self.num_blocks, self.block_size, self.layout = kv_cache, num_blocks, block_size, layout
        self.fp8_math = fp8_math
        self.paged: PagedKVCache | None = None
        self.batch: FixedBatch | None = None
        self.seen: torch.Tensor | None = None  # positions given so far, padding included (transformers' count)
        self.attention: LayerAttentions | None = None
        self.host_step: tuple[BatchMetadata, torch.Tensor | None] | None = None
        self.batch_started = False
        self.unattended: int | None = None  # the layer whose keys were tagged and not yet attended

    def check_update(self, layer_idx: int) -> None:
        """Before layer `layer_idx`'s update: the model's attention took the previous update's keys
        (it is fp8kv's), and the layer has scales. Skipped inside a compiled step, which follows an
        eager first step that checked the same model."""
        if torch.compiler.is_compiling():
            return
        self.check_attended()
        if layer_idx >= self.kv_cache.num_layers:
            raise ValueError(f"PagedCache: the model has more layers than its KVCacheConfig "
                             f"({self.kv_cache.num_layers}): give it this model's KVCacheConfig (e.g. "
                             "load_kv_cache_config of its checkpoint)")
        self.unattended = layer_idx

    def check_attended(self) -> None:
        """Reported once: nothing was written, so the cache serves again once the model is enabled."""
        if self.unattended is not None:
            layer, self.unattended = self.unattended, None
            raise RuntimeError(_NOT_ENABLED.format(layer=layer))

    def accept(self, layer_idx: int, key: torch.Tensor) -> None:
        """Allocates the storage at the first update."""
        if self.paged is None:
            self.paged = PagedKVCache(self.kv_cache, num_kv_heads=key.shape[1], head_size=key.shape[-1],
                                      num_blocks=self.num_blocks, block_size=self.block_size,
                                      model_dtype=key.dtype, device=key.device, layout=self.layout)
            self.seen = torch.zeros((), dtype=torch.int64, device=key.device)
            self.attention = LayerAttentions(self.kv_cache, self.fp8_math)
            mark_static(*self.paged.tensors, self.seen)

    def attend(self, layer_idx, query, key, value, new_tokens, scaling, sliding_window, softcap,
               positions) -> torch.Tensor:
        """Writes the layer's new K/V into the paged cache and attends; returns [batch, new, heads, head_size].
        positions: the new tokens' position ids ([batch or 1, new]), or None where the model gives none."""
        self.unattended = None
        batch_size, num_heads, new, head_size = query.shape
        if layer_idx == 0:
            self._plan(batch_size, new, new_tokens, positions)
        batch, rows = (self.batch.decode_metadata, None) if new == 1 else self.host_step
        module = self.attention.get(layer_idx, num_heads, key.shape[1], head_size, scaling, sliding_window, softcap)
        if new == 1:  # the view the transpose and reshape below give, in one op instead of two (per layer and step)
            q, k, v = query.squeeze(2), key.squeeze(2), value.squeeze(2)
        else:
            q, k, v = (t.transpose(1, 2).reshape(batch_size * new, t.shape[1], head_size) for t in (query, key, value))
        if rows is not None:
            q, k, v = q[rows], k[rows], v[rows]
        # forward, not module(...): the module call's hooks cost host time at every layer of every step.
        out = module.forward(q, k, v, self.paged.layer(layer_idx), batch)
        if rows is not None:
            out = torch.zeros(batch_size * new, num_heads, head_size, dtype=out.dtype, device=out.device).index_copy_(
                0, rows, out)
        return out.view(batch_size, new, num_heads, head_size)

    def _plan(self, batch_size: int, new: int, new_tokens: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        """Reserves this step's slots: on the device for a decode step, on the host otherwise.
        Padded positions (mask False) are neither cached nor attended."""
        if not self.batch_started:
            self._start_batch(batch_size)
        elif self.batch.num_seqs != batch_size:
            raise ValueError(f"PagedCache holds {self.batch.num_seqs} sequences, the input has {batch_size} rows; "
                             "reset() it or use a new PagedCache for a new batch")
        elif new > 1 and positions is not None and positions.dim() == 2:  # not multimodal [3, batch, new] ids
            self._check_continues(positions)
        if new == 1:  # a padded row's new token gets no slot; its (ignored) output attends over its cache
            self.batch.append_one(None if new_tokens is None else new_tokens.reshape(batch_size))
        else:
            rows = None
            if new_tokens is None:
                counts = [new] * batch_size
            else:
                counts = new_tokens.sum(1).tolist()
                if sum(counts) != new_tokens.numel():
                    rows = new_tokens.reshape(-1).nonzero().squeeze(1)
            self.host_step = self.batch.extend(counts), rows
        self.seen.add_(new)

    def _check_continues(self, positions: torch.Tensor) -> None:
        """A step of several tokens on a started batch (a continuation, a prefill chunk) starts each
        sequence where it ends: its first position is the sequence's cached length. A new prompt
        starts again at 0. Planned on the host, so reading both costs no extra synchronization."""
        lengths = self.batch.seq_lens.long()
        if not torch.equal(positions[:, 0].to(lengths.device).expand_as(lengths), lengths):
            raise ValueError(_REUSED.format(held=int(self.seen)))

    def _start_batch(self, batch_size: int) -> None:
        """Gives each sequence of a new batch an equal share of the blocks; the batch's tensors are
        kept (cleared) when the batch size is unchanged, so a compiled step stays valid."""
        if torch.compiler.is_compiling():
            raise RuntimeError("PagedCache: the first step of a batch must run eagerly (generate's prefill does)")
        blocks_per_seq = self.num_blocks // batch_size
        if blocks_per_seq == 0:
            raise CacheFullError(f"PagedCache: {self.num_blocks} blocks of {self.block_size} tokens cannot give each "
                                 f"of {batch_size} sequences a block; allocate a larger cache")
        if self.batch is not None and self.batch.num_seqs == batch_size:
            self.batch.clear()
        else:
            self.batch = FixedBatch(batch_size, blocks_per_seq, self.block_size, self.paged.device)
            mark_static(*self.batch.tensors)
        self.seen.zero_()
        self.batch_started = True

    def reset(self) -> None:
        self.batch_started = False
        self.host_step = None
        if self.seen is not None:
            self.seen.zero_()


class _PagedLayer(CacheLayerMixin):
    """One layer's view of the PagedCache: tags new keys with the shared state."""

    is_sliding = False
    supports_early_init = False

    def __init__(self, state: _PagedState, layer_idx: int, compileable: bool):
        super().__init__()
        self.state, self.layer_idx, self.is_compileable = state, layer_idx, compileable

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.is_initialized = True
        self.state.accept(self.layer_idx, key_states)
        setattr(key_states, _TAG, (self.state, self.layer_idx))
        return key_states, value_states

    def get_seq_length(self) -> int | torch.Tensor:
        return 0 if self.state.seen is None else self.state.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The attention function gets only the new keys; the mask function keeps their columns.
        return query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass  # the shared state holds everything

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("PagedCache does not support beam search, batch reordering or cropping")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


class PagedCache(Cache):
    """A transformers Cache backed by fp8kv's PagedKVCache in the format of `kv_cache`.

    kv_cache: the format and per-layer scales (e.g. from fp8kv.load_kv_cache_config).
    max_tokens: the capacity in tokens for the whole batch. Each of the batch's sequences gets an
        equal share in whole blocks of `block_size` tokens: batch * (prompt + new tokens) fits every
        sequence. Size it to the need: the block tables are as wide as a share, and the decode
        kernel plans its split-KV work from their width (the lengths live on the device).
    compileable: lets `generate` compile the decode step (transformers' static-cache path: on CUDA
        by default, elsewhere with `compile_config._compile_all_devices`); `generate(...,
        disable_compile=True)` turns it off for one call.
    fp8_math: the prompts' attention in FP8 tensor-core math (PagedAttention's `fp8_math`): an
        e4m3fn or e5m2 cache on a compute capability 9.0 GPU.
    The storage is allocated at the first forward, on the model's device, with the model's KV head
    count and head size. Batch row i is sequence i; left padding is skipped, never cached. A step
    past a sequence's share raises CacheFullError: at once on the host for a prefill, and for a
    decode step, whose plan lives on the device, at a later step's mask creation, without waiting
    for the device (`generate` raises it one or two steps late; the late steps cached nothing).
    """

    def __init__(self, kv_cache: KVCacheConfig, *, max_tokens: int, block_size: int = 16, layout: str = "NHD",
                 compileable: bool = False, fp8_math: bool = False):
        if not isinstance(kv_cache, KVCacheConfig):
            raise TypeError(f"kv_cache must be a KVCacheConfig, got {type(kv_cache).__name__}")
        check_fp8_math(fp8_math, kv_cache.dtype)
        if max_tokens <= 0 or block_size <= 0:
            raise ValueError(f"max_tokens and block_size must be positive, got {max_tokens} and {block_size}")
        self._state = _PagedState(kv_cache, math.ceil(max_tokens / block_size), block_size, layout, fp8_math)
        super().__init__(layers=[_PagedLayer(self._state, i, compileable) for i in range(kv_cache.num_layers)])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self._state.check_update(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """transformers calls this before every step (outside a compiled step, in generate) to build
        the masks: the moment to report an overflow of an earlier decode step, an earlier step's
        keys that fp8kv's attention never took, and a step without tokens (what generate leaves of a new
        prompt shorter than the positions the cache holds)."""
        state = self._state
        if not torch.compiler.is_compiling():
            state.check_attended()
            if state.batch is not None:
                state.batch.raise_if_overflowed(wait=False)
            if query_length == 0 and state.batch_started:
                raise ValueError(_REUSED.format(held=int(state.seen)))
        return super().get_mask_sizes(query_length, layer_idx)

    def reset(self) -> None:
        """Forgets every sequence (the storage stays allocated, and a compiled step stays valid for
        a new batch of the same size)."""
        super().reset()
        self._state.reset()

    @property
    def paged(self) -> PagedKVCache | None:
        """The storage (None before the first forward)."""
        return self._state.paged

    @property
    def batch(self) -> FixedBatch | None:
        """The batch's index tensors: block tables, lengths, the decode step's slots (None before
        the first forward)."""
        return self._state.batch

    @property
    def memory_bytes(self) -> int:
        """Bytes of K/V storage (0 before the first forward)."""
        return 0 if self.paged is None else self.paged.memory_bytes
