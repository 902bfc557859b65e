"""vLLM on fp8kv's kernels: an attention backend that writes and reads vLLM's own paged KV cache.

    python3 -m pip install --no-build-isolation ".[vllm]"   # the source tree, in vLLM's environment
    vllm serve MODEL --kv-cache-dtype fp8 --attention-backend FP8KV

vLLM loads the `vllm.general_plugins` entry point `fp8kv` (pyproject.toml) in each of its processes;
it calls `register`, which adds the backend to vLLM's registry under the name "FP8KV". The backend
(fp8kv.integrations.vllm_backend, which needs vLLM) takes KV-cache dtypes auto, fp8, fp8_e4m3 and
fp8_e5m2, per-tensor and per-head scales, sliding windows and soft caps; docs/vllm.md says what it
refuses and what has been run where.

The cache is vLLM's, read in place: each layer's page is a logical [num_blocks, num_kv_heads,
block_size, 2 * head_size] view of vLLM's buffer (the uint8 storage of an FP8 cache), K in the first
half of the last dimension and V in the second, in whichever memory order vLLM's KVCacheLayout gave
it. `kv_cache_halves` views its two halves as fp8kv's [num_blocks, block_size, num_kv_heads,
head_size] caches, which take any strides, and `page_layer` makes them a KVCacheLayer of the plain
recipe with the attention layer's `_k_scale` and `_v_scale` as vLLM loaded them (0-dim, [1] or
[num_kv_heads], float32, on the device), used as they are: vLLM's own adjustments (doubling an FP8
checkpoint's for e4m3fnuz) are made already. Under the rotated recipe the layer comes from fp8kv's
KVCacheConfig instead (fp8kv.integrations.vllm_recipe).

This module does not import vLLM: the functions below are the backend's work on plain tensors
(`page_layer`, `attend`), so they are tested on GPUs without vLLM installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..formats import KVCacheDtype
from ..layer import KVCacheLayer
from ..rotation import Rotation

BACKEND_NAME = "FP8KV"
BACKEND_CLASS = "fp8kv.integrations.vllm_backend.Fp8kvAttentionBackend"
# The vLLM release (major, minor) the backend is written against and tested with; pyproject.toml's
# [vllm] extra pins the same.
SUPPORTED_VLLM = (0, 33)
# vLLM's --kv-cache-dtype names the backend reads: auto is an unquantized cache in the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def register() -> None:
    """The `vllm.general_plugins` entry point: registers the backend as FP8KV in vLLM's registry.
    vLLM may load its plugins more than once in a process; a second call does nothing."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, _BackendClass(BACKEND_CLASS))


class _BackendClass(str):
    """The value of the registry's FP8KV member: the backend's class path, registering the backend
    wherever it is unpickled. vLLM sends its config, the selected member with it, to the processes
    it spawns (the engine core, the workers), and an enum member is unpickled by its value before
    those processes load their plugins: without this, FP8KV would not exist there yet."""

    def __reduce__(self):
        return _registered_class, ()


def _registered_class() -> str:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register()
    return AttentionBackendEnum[BACKEND_NAME].value


def cache_format(kv_cache_dtype: str, platform_fp8: torch.dtype) -> torch.dtype | None:
    """The FP8 dtype of vLLM's `--kv-cache-dtype` name (`platform_fp8`, vLLM's `fp8_dtype()` of the
    platform, for fp8 and fp8_e4m3: e4m3fn, or e4m3fnuz on MI300), or None for auto, whose cache has
    the model's dtype and stores K/V unquantized."""
    formats = dict(zip(KV_CACHE_DTYPES, (None, platform_fp8, platform_fp8, torch.float8_e5m2)))
    if kv_cache_dtype not in formats:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} for fp8kv's attention "
                         f"backend, got {kv_cache_dtype!r}")
    return formats[kv_cache_dtype]


def kv_cache_halves(kv_cache: torch.Tensor, head_size: int,
                    fp8: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8kv's key and value caches, [num_blocks, block_size, num_kv_heads, head_size] views of one
    layer's vLLM page [num_blocks, num_kv_heads, block_size, 2 * head_size] (its uint8 storage viewed
    as `fp8`, or as it is for None): no copy, so writes land in vLLM's cache."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache must be vLLM's page [num_blocks, num_kv_heads, block_size, 2 * head_size = "
                         f"{2 * head_size}], got shape {tuple(kv_cache.shape)}")
    pages = kv_cache.transpose(1, 2)
    if fp8 is not None:
        pages = pages.view(fp8)
    return pages[..., :head_size], pages[..., head_size:]


def page_layer(kv_cache: torch.Tensor, head_size: int, fp8: torch.dtype | None, k_scale: torch.Tensor,
               v_scale: torch.Tensor) -> KVCacheLayer:
    """The plain recipe's KVCacheLayer over one layer's vLLM page, with the scales vLLM holds for it:
    views of vLLM's tensors (a 0-dim per-tensor scale viewed as [1]), so a captured graph reads the
    values vLLM holds at replay."""
    key_cache, value_cache = kv_cache_halves(kv_cache, head_size, fp8)
    fmt = KVCacheDtype.UNQUANTIZED if fp8 is None else KVCacheDtype.parse(fp8)
    return KVCacheLayer(fmt, key_cache, value_cache, k_scale.view(-1), v_scale.view(-1), Rotation.NONE, None)


@dataclass
class AttentionMetadata:
    """One step's batch, decode requests first (vLLM reorders the batch so): requests
    [0, num_decodes) have one query row each, rows 0..num_decodes - 1, and fp8kv's decode kernel
    attends them; requests [num_decodes, num_reqs) own rows [num_decodes, num_query_rows) as
    `query_start_loc` (relative to row num_decodes) says, attended by the multi-token kernel.
    Rows from num_query_rows on (vLLM's padding) are not written."""
    num_actual_tokens: int           # the step's tokens, padding included (vLLM reads it from a backend's metadata)
    num_decodes: int
    num_query_rows: int
    seq_lens: torch.Tensor           # int32 [num_reqs]; 0 for a padding request (its output is zeros)
    block_table: torch.Tensor        # int32 [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor       # int64 [num_tokens]; -1 where vLLM pads
    query_start_loc: torch.Tensor | None  # int32 [num_reqs - num_decodes + 1], None without such requests


def attend(output: torch.Tensor, query: torch.Tensor, layer: KVCacheLayer, metadata: AttentionMetadata,
           softmax_scale: float, sliding_window: int = -1, logits_soft_cap: float = 0.0) -> None:
    """Attention of `query` [num_tokens, num_heads, head_size] over one layer's vLLM page (`layer`),
    written into `output` (same shape): the decode rows in one call, the other requests' rows in a
    second."""
    options = (softmax_scale, sliding_window, logits_soft_cap)
    m, d = metadata, metadata.num_decodes
    if d:
        ops.paged_attention(output[:d], query[:d], layer, m.block_table[:d], m.seq_lens[:d], None, *options)
    if m.query_start_loc is not None:
        rows = slice(d, m.num_query_rows)
        ops.paged_attention(output[rows], query[rows], layer, m.block_table[d:], m.seq_lens[d:], m.query_start_loc,
                            *options)
