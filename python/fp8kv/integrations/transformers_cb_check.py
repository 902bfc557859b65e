"""Whether the installed transformers is one whose continuous batching fp8kv's hooks
(fp8kv.integrations.transformers_continuous_batching) can run on: its version, and every private
name and signature the hooks rely on, checked before anything is installed."""

from __future__ import annotations

import inspect

from packaging.version import Version

from ..models import pip_install

# The transformers releases whose continuous batching these hooks were written for and tested with
# (major, minor), both included; pyproject.toml's [serve] extra requires the same range.
SUPPORTED_VERSIONS = ((5, 23), (5, 24))


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
