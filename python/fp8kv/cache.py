"""The paged KV cache: per-layer K/V storage in the cache format, and the block allocator.

Storage is one allocation per cache, viewed per layer as the ops' logical
[num_blocks, block_size, num_kv_heads, head_size] tensors. Sequences own whole blocks; a batch
step reserves slots for its new tokens and gets the index tensors the ops read (`BatchMetadata`).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from .formats import KVCacheConfig, KVCacheDtype

LAYOUTS = ("NHD", "HND")


class CacheFullError(RuntimeError):
    """The cache has no free blocks for the tokens asked for."""


@dataclass(frozen=True)
class BatchMetadata:
    """Index tensors of one batch step, on the cache's device.

    slot_mapping: int64 [num_new_tokens], the cache slot of each new token, sequences in order.
    block_tables: int32 [num_seqs, max_blocks]; seq_lens: int32 [num_seqs], cached tokens per
    sequence including the new ones. cu_seqlens_q: int32 [num_seqs + 1], or None when every
    sequence has exactly one new token (decode).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()


class BlockAllocator:
    """Hands out fixed-size blocks of cache slots to sequences, in order, on the host."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = collections.deque(range(num_blocks))
        self._blocks: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> tuple[Hashable, ...]:
        return tuple(self._blocks)

    def add(self, seq_id: Hashable) -> None:
        if seq_id in self._blocks:
            raise ValueError(f"sequence {seq_id!r} already exists")
        self._blocks[seq_id], self._lengths[seq_id] = [], 0

    def free(self, seq_id: Hashable) -> None:
        self._free.extend(self._blocks.pop(self._known(seq_id)))
        del self._lengths[seq_id]

    def length(self, seq_id: Hashable) -> int:
        return self._lengths[self._known(seq_id)]

    def blocks(self, seq_id: Hashable) -> list[int]:
        return list(self._blocks[self._known(seq_id)])

    def extend(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> list[list[int]]:
        """Reserves slots for `num_tokens[i]` more tokens of sequence `seq_ids[i]`; returns the
        slots per sequence. All or nothing: on CacheFullError nothing is reserved."""
        if len(seq_ids) != len(num_tokens):
            raise ValueError(f"{len(seq_ids)} sequences but {len(num_tokens)} token counts")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequences appear more than once in {list(seq_ids)}")
        needed = 0
        for seq_id, n in zip(seq_ids, num_tokens):
            if n < 0:
                raise ValueError(f"sequence {seq_id!r}: token count must be >= 0, got {n}")
            needed += self._blocks_needed(self._known(seq_id), n)
        if needed > len(self._free):
            raise CacheFullError(
                f"PagedKVCache: the batch needs {needed} more blocks of {self.block_size} tokens but only "
                f"{len(self._free)} of {self.num_blocks} are free; free finished sequences or allocate a larger cache"
            )
        return [self._reserve(seq_id, n) for seq_id, n in zip(seq_ids, num_tokens)]

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._blocks:
            raise KeyError(f"unknown sequence {seq_id!r}; add it first")
        return seq_id

    def _blocks_needed(self, seq_id: Hashable, n: int) -> int:
        return math.ceil((self._lengths[seq_id] + n) / self.block_size) - len(self._blocks[seq_id])

    def _reserve(self, seq_id: Hashable, n: int) -> list[int]:
        blocks = self._blocks[seq_id]
        for _ in range(self._blocks_needed(seq_id, n)):
            blocks.append(self._free.popleft())
        start = self._lengths[seq_id]
        self._lengths[seq_id] = start + n
        return [blocks[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, start + n)]


def bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, cache_dtype: torch.dtype) -> int:
    """Cache bytes one token occupies: K and V of every layer."""
    return 2 * num_layers * num_kv_heads * head_size * torch.empty((), dtype=cache_dtype).element_size()


def capacity_report(
    gib: float, num_layers: int, num_kv_heads: int, head_size: int, model_dtype: torch.dtype, block_size: int = 16
) -> dict[KVCacheDtype, int]:
    """Tokens that fit in `gib` GiB of cache for each format (whole blocks only)."""
    report = {}
    for fmt in KVCacheDtype:
        per_block = block_size * bytes_per_token(num_layers, num_kv_heads, head_size, fmt.torch_dtype(model_dtype))
        report[fmt] = int(gib * 2**30) // per_block * block_size
    return report


class PagedKVCache:
    """Per-layer K/V caches in one format and layout, with the block allocator of the sequences.

    kv_cache: the format (a KVCacheDtype, its name, or a KVCacheConfig, whose dtype and layer count
        are used; the scales belong to the attention modules).
    layout: "NHD" stores [num_blocks, block_size, num_kv_heads, head_size]; "HND" stores
        [num_blocks, num_kv_heads, block_size, head_size], handed out as permuted views. The ops
        take both (they read arbitrary strides).
    """

    def __init__(
        self,
        kv_cache: KVCacheConfig | KVCacheDtype | str,
        *,
        num_kv_heads: int,
        head_size: int,
        num_blocks: int,
        num_layers: int | None = None,
        block_size: int = 16,
        model_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        layout: str = "NHD",
    ):
        if isinstance(kv_cache, KVCacheConfig):
            if num_layers is not None and num_layers != kv_cache.num_layers:
                raise ValueError(f"num_layers={num_layers} but the KVCacheConfig has {kv_cache.num_layers} layers")
            self.kv_cache_dtype, num_layers = kv_cache.dtype, kv_cache.num_layers
        else:
            self.kv_cache_dtype = KVCacheDtype.parse(kv_cache)
        if num_layers is None or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if model_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"model_dtype must be float16 or bfloat16 (the attention op's query dtypes), got {model_dtype}")
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.model_dtype, self.layout, self.device = model_dtype, layout, torch.device(device)
        self.dtype = self.kv_cache_dtype.torch_dtype(model_dtype)
        self.allocator = BlockAllocator(num_blocks, block_size)
        inner = (block_size, num_kv_heads, head_size) if layout == "NHD" else (num_kv_heads, block_size, head_size)
        self._storage = torch.zeros((num_layers, 2, num_blocks, *inner), dtype=self.dtype, device=self.device)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def memory_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of layer `index`: [num_blocks, block_size, num_kv_heads, head_size]."""
        key, value = self._storage[index]
        if self.layout == "HND":
            return key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)
        return key, value

    def add_sequence(self, seq_id: Hashable) -> None:
        self.allocator.add(seq_id)

    def free_sequence(self, seq_id: Hashable) -> None:
        self.allocator.free(seq_id)

    def seq_len(self, seq_id: Hashable) -> int:
        return self.allocator.length(seq_id)

    def prepare(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> BatchMetadata:
        """Reserves slots for a batch step and returns its index tensors on the cache's device."""
        slots = self.allocator.extend(seq_ids, num_new_tokens)
        tables = [self.allocator.blocks(s) for s in seq_ids]
        width = max(1, max(len(t) for t in tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        seq_lens = torch.tensor([self.allocator.length(s) for s in seq_ids], dtype=torch.int32)
        slot_mapping = torch.tensor([s for per_seq in slots for s in per_seq], dtype=torch.int64)
        cu_seqlens_q = None
        if any(n != 1 for n in num_new_tokens):
            cu_seqlens_q = torch.tensor([0, *num_new_tokens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            cu_seqlens_q = cu_seqlens_q.to(self.device)
        return BatchMetadata(slot_mapping.to(self.device), block_tables.to(self.device), seq_lens.to(self.device),
                             cu_seqlens_q)
