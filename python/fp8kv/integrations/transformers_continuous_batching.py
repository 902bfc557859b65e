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
from packaging.version import Version

from .._ops import has_cuda_kernels, supported_values
from ..attention import LayerAttentions
from ..cache import BatchMetadata
from ..checkpoint.config import model_head_size
from ..checkpoint.per_rank import shard_kv_cache_config
from ..formats import KVCacheConfig
from ..models import pip_install
from ..rotation import Rotation, check_head_size

# The transformers releases whose continuous batching these hooks were written for and tested with
# (major, minor), both included; pyproject.toml's [serve] extra requires the same range.
SUPPORTED_VERSIONS = ((5, 23), (5, 24))

logger = logging.getLogger(__name__)


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers is not one whose continuous batching fp8kv can run on."""


def supported_range() -> str:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VERSIONS
    return f"{low_major}.{low_minor} to {high_major}.{high_minor}"


def _requirement() -> str:
    (low_major, low_minor), (high_major, high_minor) = SUPPORTED_VERSIONS
    return f"transformers>={low_major}.{low_minor},<{high_major}.{high_minor + 1}"


def _unsupported(version: str, why: str) -> UnsupportedTransformersError:
    return UnsupportedTransformersError(
        f"fp8kv's continuous batching supports transformers {supported_range()}; transformers {version} is installed "
        f"({why}): {pip_install(_requirement())}")


# ----------------------------------------------------------------------------- what is hooked, and its check

# Each hooked or called function of transformers and its parameters, first to last as fp8kv calls them.
_PARAMETERS = {
    "PagedAttentionCache.__init__": ("self", "config", "continuous_batching_config", "device", "distributed_helper",
                                     "dtype"),
    "PagedAttentionCache.update": ("self", "key_states", "value_states", "layer_idx", "kwargs"),
    "PagedAttentionMemoryHandler.__init__": ("self", "config", "cb_config", "dtype"),
    "ContinuousBatchingManager.switch_to_cb_friendly_attn": ("self", "model", "auto_switch_to_flash"),
    "ensure_decode_fast_path_is_available": ("config", "cb_config", "user_requested"),
    "FullAttentionCacheAllocator.get_cache_for_block_table": ("self", "layer_idx"),
    "group_layers_by_attn_type": ("config",),
    "find_num_key_value_heads": ("config",),
    "DistributedHelper.__init__": ("self", "device_mesh", "cpu_group_timeout", "tp_plan"),
    "DistributedHelper.extract_tp_mesh": ("device_mesh",),
    "DistributedHelper.are_kv_heads_tp_ed": ("self",),
    "ContinuousBatchingIOs.get_model_kwargs": ("self", "use_padding"),
    "ContinuousBatchingAsyncIOs.get_model_kwargs": ("self", "use_padding"),
}
# The keyword arguments of a continuous-batching forward that fp8kv's attention reads.
_STEP_ARGUMENTS = ("cache", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_k", "write_index", "read_index",
                   "block_table")
# The reserves of PagedAttentionMemoryHandler that fp8kv's caches set, in its __init__.
_MEMORY_RESERVES = ("activation_dtype", "num_attention_masks", "kv_heads_at_peak")
# The ContinuousBatchingConfig settings fp8kv reads (the last three: whether transformers pads the steps).
_BATCHING_SETTINGS = ("page_size", "cuda_graph_booleans", "varlen_compile_config", "decode_compile_config")
# The attributes that the inputs' __init__ sets and _ordering_reads_after_resets reads: the cache, and the
# stream reading the device inputs next (the synchronous inputs' compute stream, the asynchronous ones' transfer).
_INPUTS_ATTRIBUTES = ("cache", "compute_stream")
_ASYNC_INPUTS_ATTRIBUTES = ("io_pairs", "h2d_stream")


class _Transformers:
    """transformers' continuous-batching modules, imported and checked."""

    def __init__(self):
        import transformers

        version = transformers.__version__
        if not SUPPORTED_VERSIONS[0] <= Version(version).release[:2] <= SUPPORTED_VERSIONS[1]:
            raise _unsupported(version, "its continuous batching is not one these hooks were written for")
        try:
            from transformers import ContinuousBatchingConfig
            from transformers.generation.continuous_batching import cache, cache_allocators, continuous_api
            from transformers.generation.continuous_batching import distributed, initialization, input_outputs, utils
        except ImportError as e:
            raise _unsupported(version, f"{e}") from None
        self.cache, self.initialization, self.utils = cache, initialization, utils
        self.distributed_helper = distributed.DistributedHelper
        self.memory_handler = cache.PagedAttentionMemoryHandler
        self.manager = continuous_api.ContinuousBatchingManager
        self.inputs = input_outputs.ContinuousBatchingIOs
        self.async_inputs = input_outputs.ContinuousBatchingAsyncIOs
        self.full_attention = getattr(cache_allocators, "FULL_ATTENTION", None)
        functions = {
            "PagedAttentionCache.__init__": cache.PagedAttentionCache.__init__,
            "PagedAttentionCache.update": cache.PagedAttentionCache.update,
            "PagedAttentionMemoryHandler.__init__": self.memory_handler.__init__,
            "ContinuousBatchingManager.switch_to_cb_friendly_attn": getattr(self.manager, "switch_to_cb_friendly_attn",
                                                                            None),
            "ensure_decode_fast_path_is_available": getattr(initialization, "ensure_decode_fast_path_is_available",
                                                            None),
            "FullAttentionCacheAllocator.get_cache_for_block_table": getattr(
                cache_allocators.FullAttentionCacheAllocator, "get_cache_for_block_table", None),
            "group_layers_by_attn_type": getattr(cache, "group_layers_by_attn_type", None),
            "find_num_key_value_heads": getattr(utils, "find_num_key_value_heads", None),
            "DistributedHelper.__init__": self.distributed_helper.__init__,
            "DistributedHelper.extract_tp_mesh": getattr(self.distributed_helper, "extract_tp_mesh", None),
            "DistributedHelper.are_kv_heads_tp_ed": getattr(self.distributed_helper, "are_kv_heads_tp_ed", None),
            "ContinuousBatchingIOs.get_model_kwargs": getattr(self.inputs, "get_model_kwargs", None),
            "ContinuousBatchingAsyncIOs.get_model_kwargs": getattr(self.async_inputs, "get_model_kwargs", None),
        }
        problems = [_signature_problem(name, functions[name], expected) for name, expected in _PARAMETERS.items()]
        step_arguments = getattr(input_outputs, "PagedAttentionArgs", dict).__annotations__
        problems.append(_missing("PagedAttentionArgs", _STEP_ARGUMENTS, step_arguments))
        problems.append(_missing("ContinuousBatchingConfig", _BATCHING_SETTINGS, dir(ContinuousBatchingConfig)))
        problems.append(_missing("PagedAttentionMemoryHandler.__init__", _MEMORY_RESERVES,
                                 inspect.unwrap(self.memory_handler.__init__).__code__.co_names))
        for inputs, attributes in ((self.inputs, _INPUTS_ATTRIBUTES), (self.async_inputs, _ASYNC_INPUTS_ATTRIBUTES)):
            problems.append(_missing(f"{inputs.__name__}.__init__", attributes,
                                     inspect.unwrap(inputs.__init__).__code__.co_names))
        if self.full_attention != "full_attention":
            problems.append(f"cache_allocators.FULL_ATTENTION is {self.full_attention!r}, not 'full_attention'")
        problems = [p for p in problems if p]
        if problems:
            raise _unsupported(version, "; ".join(problems))


def _signature_problem(name: str, function, expected: tuple[str, ...]) -> str | None:
    if function is None:
        return f"it has no {name}"
    parameters = tuple(inspect.signature(function).parameters)
    if parameters[:len(expected)] != expected:
        return f"{name} takes ({', '.join(parameters)}), not ({', '.join(expected)}, ...)"
    return None


def _missing(owner: str, names: tuple[str, ...], present) -> str | None:
    absent = [name for name in names if name not in present]
    return f"{owner} has no {', '.join(absent)}" if absent else None


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
        _CACHES[cache] = _CacheState(kv_cache, device, _pads_steps(batching), enabled.fp8_math)
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
        if self not in _CACHES:
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


# ----------------------------------------------------------------------------- the caches and their attention


class _CacheState:
    """fp8kv's part of one transformers cache: its layers' PagedAttention modules and caches, and the
    index tensors of the step being run (derived once per step, for every layer; `padded`: whether
    transformers pads the steps, see _step_metadata)."""

    def __init__(self, kv_cache: KVCacheConfig, device: torch.device, padded: bool, fp8_math: bool):
        self.kv_cache, self.padded = kv_cache, padded
        self.layers = LayerAttentions(kv_cache, device, fp8_math)
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step: tuple[weakref.ref, bool, BatchMetadata] | None = None

    def caches(self, allocator, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value caches as the ops take them: [blocks, page_size, kv_heads,
        head_size], one page per block. transformers' page views hold every page from the layer's
        first on (its other layers' and its values' too), which its kernels index through the block
        table; one page in `pages_per_block` of each is the layer's."""
        if layer not in self._caches:
            key_pages, value_pages = allocator.get_cache_for_block_table(layer)
            pages_per_block = allocator.block_physical_stride // allocator.tokens_per_page
            self._caches[layer] = key_pages[::pages_per_block], value_pages[::pages_per_block]
        return self._caches[layer]

    def step(self, allocator, kwargs: dict) -> BatchMetadata:
        # A step's index tensors are views made for that step, shared by its layers: the same object is the
        # same step (a weak reference, so a later step's view at a recycled address is not mistaken for it).
        # transformers runs a step once before capturing it in a CUDA graph, on the same views: the capture
        # derives the indices again, so that the graph holds that work and replays it on each step's values.
        seq_ends = kwargs["cu_seq_lens_k"][allocator.layer_type]
        capturing = _capturing(seq_ends)
        if self._step is None or self._step[0]() is not seq_ends or self._step[1] != capturing:
            self._step = weakref.ref(seq_ends), capturing, _step_metadata(allocator, seq_ends, kwargs, self.padded)
        return self._step[2]


_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `tensor`'s device."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def serves(cache) -> bool:
    """True for a transformers continuous-batching cache holding pages for fp8kv."""
    return cache is not None and cache in _CACHES


def _step_metadata(allocator, seq_ends: torch.Tensor, kwargs: dict, padded: bool) -> BatchMetadata:
    """The step's slots, block tables, lengths and query offsets, on the device, without waiting for it.

    transformers numbers a layer's cache by rows: row r is in block r // block_stride, at position r %
    block_stride of its page (the block's rows beyond the page belong to other layers). On the decode
    fast path its block table gives each request's pages (block * pages per block) and its sequence
    ends the lengths; the new token goes at the last position. Otherwise the write indices are the new
    tokens' rows, and the read indices list every request's rows in order (where no request reads the
    cache, every one is a new prompt and its rows are the ones it writes): the first row of each page
    gives the block.

    Where the step is `padded` (under CUDA graphs or torch.compile), transformers pads it to a fixed
    size: on the decode fast path with requests of length 0, which get no slot and which the kernel
    answers with zeros; otherwise with query rows past the last request's (cu_seq_lens_q[-1] < rows),
    which no request owns: see _owning_padding_rows. Their output is never read."""
    page, block_stride = allocator.tokens_per_page, allocator.block_physical_stride
    seq_lens = (seq_ends[1:] - seq_ends[:-1]).to(torch.int32)
    block_table = kwargs["block_table"]
    if block_table is not None:
        tables = torch.div(block_table[allocator.index], block_stride // page, rounding_mode="floor")
        last = seq_lens.long() - 1  # -1 for the padding rows of an empty sequence: no slot
        blocks = tables.gather(1, (last.clamp(min=0) // page).unsqueeze(1)).squeeze(1).long()
        slots = torch.where(seq_lens > 0, blocks * page + last % page, -1)
        return BatchMetadata(slots, tables, seq_lens, None)
    write_rows = kwargs["write_index"][allocator.index]
    read_rows = kwargs["read_index"][allocator.index]
    rows = read_rows if read_rows.numel() else write_rows
    width = -(-kwargs["max_length_k"][allocator.layer_type] // page)
    offsets = torch.arange(width, device=rows.device) * page
    firsts = (seq_ends[:-1].long().unsqueeze(1) + offsets).clamp(max=rows.numel() - 1)
    tables = torch.where(offsets < seq_lens.unsqueeze(1), rows[firsts] // block_stride, 0).to(torch.int32)
    slots = write_rows // block_stride * page + write_rows % block_stride
    batch = BatchMetadata(slots, tables, seq_lens, kwargs["cu_seq_lens_q"])
    return _owning_padding_rows(batch, page) if padded else batch


def _owning_padding_rows(batch: BatchMetadata, page: int) -> BatchMetadata:
    """`batch` with its padding rows (those past cu_seqlens_q[-1]) unwritten and owned by one more
    sequence, of those rows only, over block 0 (in transformers' never-allocated trash sectors)."""
    num_rows = batch.num_tokens
    query_ends = batch.cu_seqlens_q
    is_padding = torch.arange(num_rows, device=query_ends.device) >= query_ends[-1]
    tables = batch.block_tables
    tables = torch.nn.functional.pad(tables, (0, max(0, -(-num_rows // page) - tables.shape[1])))
    return BatchMetadata(batch.slot_mapping.masked_fill(is_padding, -1),
                         torch.cat([tables, tables.new_zeros(1, tables.shape[1])]),
                         torch.cat([batch.seq_lens, num_rows - query_ends[-1:]]),
                         torch.cat([query_ends, query_ends.new_full((1,), num_rows)]))


@torch.compiler.disable  # eager, as transformers' own cache update: the step's indices are derived in Python
def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache, scaling, sliding_window,
           softcap, kwargs: dict) -> torch.Tensor:
    """One layer of a continuous-batching step: query [1, heads, tokens, head_size], key/value the
    step's new [1, kv_heads, tokens, head_size]. Returns [1, tokens, heads, head_size]."""
    state = _CACHES[cache]
    layer = module.layer_idx
    allocator = cache.layer_to_allocator[layer]
    _, num_heads, tokens, head_size = query.shape
    attention = state.layers.get(layer, num_heads, key.shape[1], head_size, scaling, sliding_window, softcap)
    q, k, v = (t.transpose(1, 2).reshape(tokens, t.shape[1], head_size) for t in (query, key, value))
    out = attention.write_and_attend(q, k, v, *state.caches(allocator, layer), state.step(allocator, kwargs))
    return out.view(1, tokens, num_heads, head_size)


def describe(cache) -> str:
    """What a cache holds for fp8kv: its format and recipe, and its size as allocated."""
    state = _CACHES[cache]
    kv_cache = state.kv_cache
    page = cache.cache_allocators[_TRANSFORMERS.full_attention].tokens_per_page
    allocated = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    return (f"fp8kv: continuous batching on {kv_cache.dtype.value} pages ({kv_cache.recipe} recipe, scales: "
            f"{kv_cache.source}): {cache.num_blocks:,} blocks of {page} tokens ({cache.num_blocks * page:,} tokens), "
            f"{allocated:,} bytes ({allocated / 2**30:.2f} GiB, two scratch sectors of transformers' included) on "
            f"{cache.cache_tensor.device}")
