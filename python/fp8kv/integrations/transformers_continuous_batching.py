"""transformers' continuous batching on fp8kv's cache: the pages of transformers' own paged cache in
the format of a KVCacheConfig, written and read by fp8kv's ops.

transformers' continuous batching (`model.generate_batch`, `model.init_continuous_batching`, the
`ContinuousBatchingManager`, and the server of `transformers serve --continuous-batching`) schedules
requests under a token budget, chunks long prefills, shares prompt prefixes between requests, forks
requests (`num_return_sequences`), runs a decode fast path and, under CUDA graphs or torch.compile,
pads steps to fixed sizes, all over a paged cache it allocates itself (`PagedAttentionCache`). fp8kv
keeps all of that and changes what the pages hold. Its
attention function (the "fp8kv" attention of fp8kv.integrations.transformers) writes each step's
new K/V into their pages with `fp8kv.ops.reshape_and_cache`, its slots being transformers' write
indices (which count rows of the page views), and attends over the pages with
`fp8kv.ops.paged_attention`, over transformers' own block table on the decode fast path and over
tables derived from its read indices otherwise. Six private parts of transformers are hooked, for
models enabled here only:

- `PagedAttentionCache.__init__` runs with the cache's storage dtype: transformers then sizes its
  sectors, blocks and memory in FP8 bytes (a budget holds twice the blocks of a bf16 cache, and the
  sizes it reports are those of the FP8 pages) and views its pages as FP8 tensors;
- `PagedAttentionMemoryHandler.__init__`, which estimates what a step needs beside the cache when
  the cache is sized from the memory left, counts the activations in the model's dtype (not the
  cache's), and neither the attention masks nor the dense copy of the cache read back that
  transformers' own attention makes and fp8kv's does not;
- `PagedAttentionCache.update` (which the model calls itself from transformers 5.24 on) writes
  nothing: it hands the cache to the attention function, as earlier versions do;
- `ContinuousBatchingManager.switch_to_cb_friendly_attn` accepts fp8kv's attention;
- `ensure_decode_fast_path_is_available` keeps the decode fast path, which transformers opens to
  flash attention on CUDA only and fp8kv's kernels run on every device;
- `get_model_kwargs` of the inputs (`ContinuousBatchingIOs`, `ContinuousBatchingAsyncIOs`) first
  makes the stream that reads the device inputs next wait for the current stream, which wrote them:
  see _ordering_reads_after_resets.

Under tensor parallelism (a model loaded with tp_plan="auto"), each rank's pages and attention hold its
own KV heads: `rank_kv_cache` gives the rank its scales and K offsets, by the mesh and plan of
transformers' own DistributedHelper (the one that sizes the cache).

`install_hooks` checks every private name and signature they rely on, and the transformers version,
before it installs anything: an unsupported transformers is one error, raised when a model is
enabled, never during generation.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import NamedTuple

import torch

from .._ops import has_cuda_kernels, supported_values
from ..checkpoint.config import model_head_size
from ..checkpoint.per_rank import shard_kv_cache_config
from ..formats import KVCacheConfig
from ..rotation import Rotation, check_head_size
from .transformers_cb_check import _Transformers
# The integration's interface, from the modules that hold them (fp8kv.integrations.transformers and serve use
# them from here).
from .transformers_cb_check import SUPPORTED_VERSIONS, UnsupportedTransformersError  # noqa: F401
from .transformers_cb_steps import CACHES, CacheState, serves
from .transformers_cb_steps import attend  # noqa: F401

logger = logging.getLogger(__name__)


_TRANSFORMERS: _Transformers | None = None


def check_transformers() -> None:
    """Raises UnsupportedTransformersError where install_hooks would refuse the installed
    transformers; installs nothing."""
    _Transformers()


def install_hooks() -> None:
    """Checks the installed transformers and installs the hooks, once (later calls do nothing).
    Raises UnsupportedTransformersError, installing nothing, where the version is outside
    SUPPORTED_VERSIONS or a private name or signature the hooks rely on is not what they expect."""
    global _TRANSFORMERS
    if _TRANSFORMERS is not None:
        return
    checked = _Transformers()
    cache_class = checked.cache.PagedAttentionCache
    cache_class.__init__ = _allocating_fp8_pages(cache_class.__init__)
    cache_class.update = _leaving_writes_to_attention(cache_class.update)
    checked.memory_handler.__init__ = _reserving_for_fp8kv(checked.memory_handler.__init__)
    checked.manager.switch_to_cb_friendly_attn = _accepting_fp8kv_attention(checked.manager.switch_to_cb_friendly_attn)
    checked.initialization.ensure_decode_fast_path_is_available = _keeping_decode_fast_path(
        checked.initialization.ensure_decode_fast_path_is_available)
    for inputs in (checked.inputs, checked.async_inputs):
        inputs.get_model_kwargs = _ordering_reads_after_resets(inputs.get_model_kwargs)
    _TRANSFORMERS = checked


# ----------------------------------------------------------------------------- enabled models


class _Enabled(NamedTuple):
    kv_cache: KVCacheConfig
    model_dtype: torch.dtype  # the activations' dtype
    fp8_math: bool


class _EnabledConfigs:
    """What each model config enabled for continuous batching runs with, while the config lives and
    its attention is fp8kv's (a config is mutable, so not hashable: held by identity)."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, str, _Enabled]] = {}

    def add(self, config, attn_implementation: str, enabled: _Enabled) -> None:
        key = id(config)
        self._entries[key] = (weakref.ref(config, lambda _: self._entries.pop(key, None)), attn_implementation,
                              enabled)

    def get(self, config) -> _Enabled | None:
        entry = self._entries.get(id(config))
        if entry is None or entry[0]() is not config or config._attn_implementation != entry[1]:
            return None
        return entry[2]


_ENABLED = _EnabledConfigs()


def check_model(model, kv_cache: KVCacheConfig) -> None:
    """Raises ValueError naming what keeps `model` from continuous batching on `kv_cache`'s pages:
    sliding-window (or other non-full-attention) layers, a layer count other than the
    KVCacheConfig's, a dtype other than float16/bfloat16, a head size the rotation refuses."""
    config = model.config.get_text_config()
    try:
        groups = _TRANSFORMERS.cache.group_layers_by_attn_type(config)
    except ValueError as e:  # a layer type transformers' continuous batching does not know
        raise ValueError(f"transformers' continuous batching does not run this {config.model_type} model: {e}") from e
    if set(groups) != {_TRANSFORMERS.full_attention}:
        others = {kind: layers for kind, layers in groups.items() if kind != _TRANSFORMERS.full_attention}
        described = "; ".join(f"{kind} (layers {', '.join(map(str, layers))})" if layers else kind
                              for kind, layers in others.items())
        raise ValueError(
            f"fp8kv's continuous batching needs every layer to use full attention, but this {config.model_type} model "
            f"has {described}: transformers keeps sliding-window layers in a ring buffer that fp8kv's kernels do not "
            "read. That refuses the models with sliding-window layers (Gemma 2 and 3, Mistral and Qwen2 configs that "
            "set a sliding window, GPT-OSS, Cohere2, ...) and those transformers' continuous batching refuses; "
            "model.generate with fp8kv's PagedCache runs their windows")
    if kv_cache.num_layers != config.num_hidden_layers:
        raise ValueError(f"the KVCacheConfig has {kv_cache.num_layers} layers but the model has "
                         f"{config.num_hidden_layers}: give it this model's KVCacheConfig (e.g. load_kv_cache_config of "
                         "its checkpoint)")
    if model.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the model computes in {model.dtype}; fp8kv's attention takes float16 or bfloat16 queries: "
                         "convert it with model.to(torch.bfloat16)")
    head_size = model_head_size(config.to_dict())
    if head_size is None:
        raise ValueError(f"this {config.model_type} model's config gives no head size (head_dim, or hidden_size and "
                         "num_attention_heads)")
    if kv_cache.rotation is Rotation.HADAMARD:
        check_head_size(head_size)
    if model.device.type == "cuda" and has_cuda_kernels() and head_size not in supported_values("cuda_head_sizes"):
        raise ValueError(f"head size {head_size}: fp8kv's CUDA kernels attend over heads of "
                         f"{', '.join(map(str, supported_values('cuda_head_sizes')))}")


def tensor_parallel_rank(model) -> tuple[int, int]:
    """(tp_rank, tp_size) of `model`'s KV heads as transformers' continuous batching splits them: by
    the tensor-parallel mesh of a model loaded with a tp_plan, where that plan shards k_proj and
    v_proj; (0, 1) otherwise. Asks transformers' own DistributedHelper, which makes the cache."""
    helper = _TRANSFORMERS.distributed_helper
    mesh = helper.extract_tp_mesh(getattr(model, "_device_mesh", None))
    # Without a device mesh the helper is a plain object (no process group is made): only its plan is read.
    if mesh is None or not helper(None, None, getattr(model, "tp_plan", {})).are_kv_heads_tp_ed():
        return 0, 1
    return mesh.get_local_rank(), mesh.size()


def rank_kv_cache(model, kv_cache: KVCacheConfig) -> KVCacheConfig:
    """The KVCacheConfig of this process's tensor-parallel rank of `model` (`kv_cache` itself without
    tensor parallelism). `kv_cache` is either the whole model's, whose per-head scales and K offsets
    (one per KV head of the model) are sliced to the rank's heads, or already the rank's (one per KV
    head of the rank, e.g. load_kv_cache_config(..., tp_rank=, tp_size=)), used as it is; per-tensor
    scales are either. Raises ValueError for any other head count, naming both."""
    tp_rank, tp_size = tensor_parallel_rank(model)
    heads = _TRANSFORMERS.utils.find_num_key_value_heads(model.config.get_text_config())
    if heads % tp_size:
        raise ValueError(f"the model's {heads} KV heads cannot be split across its {tp_size} tensor-parallel ranks")
    local = heads // tp_size
    per_layer = [*kv_cache.k_scales, *kv_cache.v_scales, *(kv_cache.k_offsets or ())]
    counts = {len(values) for values in per_layer} - {1}  # 1: per tensor (or one head, the same on every reading)
    if counts <= {local}:  # the rank's (the model's without tensor parallelism), or per tensor
        return kv_cache
    if counts <= {heads}:
        return shard_kv_cache_config(kv_cache, tp_rank, tp_size)
    given = f"kv_cache has per-head scales or K offsets for {' and '.join(map(str, sorted(counts)))} KV heads"
    if tp_size == 1:
        raise ValueError(f"{given} but the model has {heads}: give this model's KVCacheConfig (load_kv_cache_config "
                         "of its checkpoint)")
    raise ValueError(f"{given} but the model has {heads}, {local} on each of its {tp_size} tensor-parallel ranks: give "
                     "the whole model's KVCacheConfig (load_kv_cache_config of its checkpoint) or this rank's "
                     f"(load_kv_cache_config(..., tp_rank={tp_rank}, tp_size={tp_size}))")


def enable_model(model, kv_cache: KVCacheConfig, attn_implementation: str, fp8_math: bool) -> None:
    """Gives `model`'s continuous batching `kv_cache`'s pages (its attention must be, and stay,
    `attn_implementation`, fp8kv's), attended in FP8 math where `fp8_math`."""
    _ENABLED.add(model.config.get_text_config(), attn_implementation, _Enabled(kv_cache, model.dtype, fp8_math))


# ----------------------------------------------------------------------------- the hooks


def _allocating_fp8_pages(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        enabled = _ENABLED.get(arguments["config"])
        if enabled is None:
            return original(*args, **kwargs)
        kv_cache = enabled.kv_cache
        device = torch.device(arguments["device"])
        batching = arguments["continuous_batching_config"]
        _check_batching(batching, device)
        # transformers sizes its cache (sectors, blocks, bytes) and views its pages with this one dtype (its
        # estimate of the activations then counts the model's, see _reserving_for_fp8kv).
        arguments["dtype"] = kv_cache.torch_dtype(arguments["dtype"])
        original(*bound.args, **bound.kwargs)
        cache = arguments["self"]
        CACHES[cache] = CacheState(kv_cache, _pads_steps(batching), enabled.fp8_math)
        logger.info("%s", describe(cache))

    return __init__


def _check_batching(batching, device: torch.device) -> None:
    """Refuses the settings fp8kv's pages cannot serve, before anything is allocated."""
    if device.type == "cuda" and has_cuda_kernels() and batching.page_size not in supported_values("cuda_block_sizes"):
        raise ValueError(f"page_size {batching.page_size}: fp8kv's CUDA kernels read pages of "
                         f"{', '.join(map(str, supported_values('cuda_block_sizes')))} tokens")


def _pads_steps(batching) -> bool:
    """Whether transformers pads the steps to fixed sizes: it does under CUDA graphs and torch.compile."""
    compiled = (batching.varlen_compile_config, batching.decode_compile_config) != (None, None)
    return any(batching.cuda_graph_booleans) or compiled


def _reserving_for_fp8kv(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        enabled = _ENABLED.get(config)
        if enabled is not None:
            # fp8kv's attention reads the pages in place: no dense copy of the cache (reserved per cache token and
            # per step token) and no mask. Its own temporaries per step token (q, k, v made contiguous, the output)
            # are the size of the projections counted already, and well inside max_memory_percent's margin.
            self.activation_dtype = enabled.model_dtype
            self.num_attention_masks = self.kv_heads_at_peak = 0

    return __init__


def _leaving_writes_to_attention(original):
    @functools.wraps(original)
    def update(self, key_states, value_states, layer_idx, kwargs):
        if self not in CACHES:
            return original(self, key_states, value_states, layer_idx, kwargs)
        kwargs["cache"] = self  # the attention function writes the new K/V and reads the pages
        return key_states, value_states

    return update


def _accepting_fp8kv_attention(original):
    @functools.wraps(original)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        config = model.config.get_text_config()
        if _ENABLED.get(config) is None:
            return original(self, model, *args, **kwargs)
        # fp8kv's attention runs on transformers' paged cache as it is: nothing to switch.
        return None

    return switch_to_cb_friendly_attn


def _keeping_decode_fast_path(original):
    @functools.wraps(original)
    def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
        if _ENABLED.get(config) is None:
            return original(config, cb_config, user_requested)
        # fp8kv's kernels read transformers' block table on every device: max_blocks_per_request stays as resolved.
        return None

    return ensure_decode_fast_path_is_available


def _ordering_reads_after_resets(original):
    """transformers writes the device inputs with kernels on the current stream and reads them on
    another, with nothing ordering the two. The asynchronous inputs are reset there (tokens and lengths
    zeroed, indices pointed at the trash pages) when they are made and when a generation starts, and
    each step is copied into them on the transfer stream: a reset that runs late on the device zeroes a
    step's inputs after they were copied (measured: the first step of a generation ran on tokens all 0
    and gave wrong text, or indexed out of bounds). The synchronous inputs are filled there at every
    step and read on the compute stream (its blocking copies order all but the last write). Before each
    step's inputs are handed over, the stream that reads them waits for the current stream."""
    @functools.wraps(original)
    def get_model_kwargs(self, *args, **kwargs):
        if isinstance(self, _TRANSFORMERS.async_inputs):
            cache, stream = self.io_pairs[0].device_io.cache, self.h2d_stream
        else:
            cache, stream = self.cache, self.compute_stream
        if stream is not None and serves(cache):
            stream.wait_stream(torch.get_device_module(stream.device).current_stream(stream.device))
        return original(self, *args, **kwargs)

    return get_model_kwargs


def describe(cache) -> str:
    """What a cache holds for fp8kv: its format and recipe, and its size as allocated."""
    state = CACHES[cache]
    kv_cache = state.kv_cache
    page = cache.cache_allocators[_TRANSFORMERS.full_attention].tokens_per_page
    allocated = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    return (f"fp8kv: continuous batching on {kv_cache.dtype.value} pages ({kv_cache.recipe} recipe, scales: "
            f"{kv_cache.source}): {cache.num_blocks:,} blocks of {page} tokens ({cache.num_blocks * page:,} tokens), "
            f"{allocated:,} bytes ({allocated / 2**30:.2f} GiB, two scratch sectors of transformers' included) on "
            f"{cache.cache_tensor.device}")
