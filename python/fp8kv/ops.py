"""Typed wrappers over fp8kv's operators (`torch.ops.fp8kv.*`).

Every op writes into tensors the caller allocated, runs on the current stream, never synchronizes
with the host and can be captured in a CUDA graph. The tensor layouts are those of
docs/ops.md; bad input raises RuntimeError naming the argument, and a tensor argument given as
something else (a list, a float) TypeError saying what it must be.
"""

import torch

from . import _ops  # noqa: F401  (loads the library)

__all__ = sorted(["reshape_and_cache", "paged_attention", "kv_amax", "check_cache_write_indices",
                  "check_paged_attention_indices"])


def __dir__() -> list[str]:
    # The module's imports are not part of its interface.
    return __all__


# What each tensor argument must be, for the TypeError of a call that passes something else: the
# op's own schema error lists the whole signature instead of naming the argument.
_TENSORS = {
    "key": "a tensor [num_tokens, num_kv_heads, head_size]",
    "value": "a tensor [num_tokens, num_kv_heads, head_size]",
    "key_cache": "the key cache tensor [num_blocks, block_size, num_kv_heads, head_size]",
    "value_cache": "the value cache tensor [num_blocks, block_size, num_kv_heads, head_size]",
    "slot_mapping": "an int64 tensor [num_tokens] of slots",
    "k_scale": "a float32 tensor [1] or [num_kv_heads], e.g. torch.tensor([0.02])",
    "v_scale": "a float32 tensor [1] or [num_kv_heads], e.g. torch.tensor([0.02])",
    "out": "a tensor [num_query_tokens, num_heads, head_size] to write",
    "query": "a tensor [num_query_tokens, num_heads, head_size]",
    "block_tables": "an int32 tensor [num_seqs, max_blocks_per_seq]",
    "seq_lens": "an int32 tensor [num_seqs], e.g. torch.tensor(lengths, dtype=torch.int32)",
    "cu_seqlens_q": "None or an int32 tensor [num_seqs + 1]",
    "k_offset": "None or a float32 tensor [num_kv_heads, head_size]",
    "k_amax": "a float32 tensor [1] or [num_kv_heads]",
    "v_amax": "a float32 tensor [1] or [num_kv_heads]",
}


def _check_tensors(op: str, **arguments) -> None:
    """Raises TypeError naming the first of `arguments` that is not a tensor (None only for cu_seqlens_q
    and k_offset).
    A type check per argument, no data read: cheap enough for every decode step."""
    for name, value in arguments.items():
        if not isinstance(value, torch.Tensor) and not (value is None and name in ("cu_seqlens_q", "k_offset")):
            raise TypeError(f"fp8kv.ops.{op}: {name} must be {_TENSORS[name]}, got {type(value).__name__}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    hadamard: bool = False,
    k_offset: torch.Tensor | None = None,
) -> None:
    """Quantizes `key`/`value` rows and writes them to their cache slots.

    key, value: [num_tokens, num_kv_heads, head_size], fp16/bf16/fp32, last dim contiguous.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], any strides but a
        contiguous last dim; their dtype is the cache format (an FP8 dtype, or key's dtype for an
        unquantized cache, which stores the values bit for bit and ignores the scales).
    slot_mapping: int64 [n], n <= num_tokens; token i goes to slot block * block_size + offset;
        a negative slot skips the token.
    k_scale, v_scale: float32 [1] or [num_kv_heads] dequantization scales: stores
        saturate_rne(x / scale).
    hadamard, k_offset: the rotated recipe (docs/rotated_cache.md), FP8 caches only: rows are
        rotated by the block Hadamard matrix, and K minus k_offset (float32 [num_kv_heads,
        head_size], in the rotated basis) is stored. The cache must be read with the same values.
    """
    _check_tensors("reshape_and_cache", key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                   slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale, k_offset=k_offset)
    torch.ops.fp8kv.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, hadamard,
                                      k_offset)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    softmax_scale: float,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
    hadamard: bool = False,
    k_offset: torch.Tensor | None = None,
    fp8_math: bool = False,
) -> None:
    """Attention of `query` over the paged cache, written into `out`.

    query, out: [num_query_tokens, num_heads, head_size], fp16/bf16; num_heads a multiple of the
        cache's num_kv_heads (MHA, GQA, MQA).
    block_tables: int32 [num_seqs, max_blocks_per_seq]; seq_lens: int32 [num_seqs], cached tokens of
        each sequence including the queried ones.
    cu_seqlens_q: None for decode (one query row per sequence), else int32 [num_seqs + 1]: sequence
        i owns rows cu_seqlens_q[i]:cu_seqlens_q[i + 1], its last tokens, attending causally.
    softmax_scale: multiplies q.k (usually head_size ** -0.5).
    k_scale, v_scale: float32 [1] or [num_kv_heads], read on the device.
    sliding_window: -1, or w > 0: a query at position p sees positions > p - w.
    logits_soft_cap: 0, or c > 0: logits become c * tanh(logits / c).
    hadamard, k_offset: the recipe the cache was written with (see reshape_and_cache).
    fp8_math: multi-token queries in FP8 tensor-core math: each query row quantized to e4m3 (its
        largest magnitude to 448), S = Q K^T and O += P V as FP8 MMAs with P quantized to e4m3, O
        accumulated in fp32 every 128 keys. Needs an e4m3fn or e5m2 cache and the CUDA kernels on a
        compute capability 9.0 GPU (head sizes supported_values("cuda_sm90a_fp8_math_head_sizes"));
        refused elsewhere. Calls the decode kernel takes (decode, and short queries: at most 16 query
        rows per sequence and KV head on average) keep 16-bit math: they are bound by memory.
        docs/ops.md gives its accuracy and speed.
    A decode row whose sequence has seq_len 0 (batch padding) gets zeros.
    """
    _check_tensors("paged_attention", out=out, query=query, key_cache=key_cache, value_cache=value_cache,
                   block_tables=block_tables, seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q, k_scale=k_scale,
                   v_scale=v_scale, k_offset=k_offset)
    torch.ops.fp8kv.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
        k_scale, v_scale, sliding_window, logits_soft_cap, hadamard, k_offset, fp8_math,
    )


def kv_amax(key: torch.Tensor, value: torch.Tensor, k_amax: torch.Tensor, v_amax: torch.Tensor) -> None:
    """Folds max(|key|) and max(|value|) into the running maxima `k_amax`, `v_amax` in place.

    The granularity follows the maxima's shape: float32 [1] per tensor or [num_kv_heads] per head.
    A NaN in the input makes the maximum NaN.
    """
    _check_tensors("kv_amax", key=key, value=value, k_amax=k_amax, v_amax=v_amax)
    torch.ops.fp8kv.kv_amax(key, value, k_amax, v_amax)


def check_cache_write_indices(slot_mapping: torch.Tensor, key_cache: torch.Tensor) -> None:
    """Raises RuntimeError unless every slot is negative (skipped) or inside `key_cache`.

    `reshape_and_cache` checks this itself on CPU. On a GPU it does not read the slots (that would
    synchronize): an out-of-range slot there is not written, so its token is lost. Call this where a
    slot mapping is built outside fp8kv's cache modules; it copies the slots to the host (a
    synchronization, so not during CUDA graph capture). FP8KV_DEBUG_CHECKS=1 runs it inside every call.
    """
    torch.ops.fp8kv.check_cache_write_indices(slot_mapping, key_cache)


def check_paged_attention_indices(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    num_query_tokens: int,
    key_cache: torch.Tensor,
    sliding_window: int = -1,
) -> None:
    """Raises RuntimeError unless the query rows, lengths and every block id that attention will read
    are consistent with the table and `key_cache` (the checks `paged_attention` runs itself on CPU).

    On a GPU, `paged_attention` reads out-of-range block ids as zeros and clamps lengths to the table.
    Copies the tensors to the host (not during CUDA graph capture). FP8KV_DEBUG_CHECKS=1 runs it inside
    every call.
    """
    torch.ops.fp8kv.check_paged_attention_indices(block_tables, seq_lens, cu_seqlens_q, num_query_tokens, key_cache,
                                                  sliding_window)
