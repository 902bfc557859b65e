"""The paged KV cache: per-layer K/V storage in the cache format, and the block allocator.

Storage is one allocation per cache, viewed per layer as the ops' logical
[num_blocks, block_size, num_kv_heads, head_size] tensors. Sequences own whole blocks; a batch
step reserves slots for its new tokens and gets the index tensors the ops read (`BatchMetadata`):
from the host `BlockAllocator` (sequences come and go, blocks are shared on demand), or from a
`FixedBatch` (a fixed set of sequences with a fixed share each, planned on the device so that a
captured decode step stays valid).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from . import ops
from .formats import KVCacheConfig, KVCacheDtype
from .layer import KVCacheLayer
from .rotation import Rotation

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
    _plans: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()

    def attention_plan(self, layer: KVCacheLayer, num_query_tokens: int, num_heads: int, sliding_window: int,
                       fp8_math: bool) -> ops.AttentionPlan:
        """The step's plan of attention calls of these sizes over caches shaped like `layer`'s
        (fp8kv.ops.plan_paged_attention): made at the first layer's call, shared by the others."""
        cache = layer.key_cache
        key = (cache.shape, cache.dtype, cache.device, num_query_tokens, num_heads, sliding_window, fp8_math)
        plan = self._plans.get(key)
        if plan is None:
            plan = ops.plan_paged_attention(layer, self.block_tables, self.cu_seqlens_q, num_query_tokens, num_heads,
                                            sliding_window=sliding_window, fp8_math=fp8_math)
            self._plans[key] = plan
        return plan


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


class FixedBatch:
    """`num_seqs` sequences with `blocks_per_seq` blocks each, whose index tensors live on the device
    and change only in place: a graph captured around a step (torch.compile, CUDA graphs) reads the
    same tensors at every replay, and a decode step is planned without the host.

    Sequence i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq), i.e. the `capacity`
    slots from i * capacity on, so `block_tables` is written once. It takes the blocks from the
    start of the cache it indexes and does not use that cache's BlockAllocator.
    """

    def __init__(self, num_seqs: int, blocks_per_seq: int, block_size: int, device: torch.device | str):
        for name, value in (("num_seqs", num_seqs), ("blocks_per_seq", blocks_per_seq), ("block_size", block_size)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.capacity = blocks_per_seq * block_size
        self.block_tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=device).view(
            num_seqs, blocks_per_seq)
        self.seq_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((num_seqs,), -1, dtype=torch.int64, device=device)
        self.overflowed = torch.zeros((), dtype=torch.bool, device=device)
        self._first_slots = torch.arange(num_seqs, dtype=torch.int64, device=device) * self.capacity
        self.decode_metadata = BatchMetadata(self.slot_mapping, self.block_tables, self.seq_lens, None)
        self._overflow_poll = _FlagPoll(self.overflowed)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a step reads or updates (for torch._dynamo.mark_static_address)."""
        return self.block_tables, self.seq_lens, self.slot_mapping, self.overflowed, self._first_slots

    def clear(self) -> None:
        """Empties every sequence, in place."""
        self._overflow_poll.discard()
        self.seq_lens.zero_()
        self.slot_mapping.fill_(-1)
        self.overflowed.zero_()

    def append_one(self, real: torch.Tensor | None = None) -> BatchMetadata:
        """Decode: reserves one slot per sequence, on the device (no host sync), and returns
        `decode_metadata`. real: bool [num_seqs], False where the new token is padding (no slot, not
        counted), or None (all real). A sequence already holding `capacity` tokens gets no slot
        either (its token is not cached; nothing is written out of bounds) and sets `overflowed`,
        which `raise_if_overflowed` turns into CacheFullError."""
        # Each op here is one more launch from the host at every decode step: the bools are added as they are,
        # and a real token left without a slot is one whose `wanted` differs from `real`.
        positions = self.seq_lens.long()
        fits = positions < self.capacity
        wanted = fits if real is None else real & fits
        self.slot_mapping.copy_(torch.where(wanted, self._first_slots + positions, -1))
        self.seq_lens.add_(wanted)
        self.overflowed.logical_or_((~fits if real is None else wanted != real).any())
        return self.decode_metadata

    def extend(self, num_new_tokens: Sequence[int]) -> BatchMetadata:
        """Reserves `num_new_tokens[i]` slots for sequence i (prefill, chunked prefill), planned on the
        host: reads seq_lens, which waits for the device. All or nothing: on CacheFullError nothing
        is reserved."""
        if len(num_new_tokens) != self.num_seqs:
            raise ValueError(f"{len(num_new_tokens)} token counts for a batch of {self.num_seqs} sequences")
        self.raise_if_overflowed()
        lengths = self.seq_lens.tolist()
        for seq, (length, n) in enumerate(zip(lengths, num_new_tokens)):
            if n < 0:
                raise ValueError(f"sequence {seq}: token count must be >= 0, got {n}")
            if length + n > self.capacity:
                raise CacheFullError(
                    f"sequence {seq} holds {length} tokens and gets {n} more, past its capacity of {self.capacity} "
                    f"({self.block_tables.shape[1]} blocks); allocate a larger cache")
        counts = torch.tensor(num_new_tokens, dtype=torch.int64)
        starts = torch.tensor(lengths, dtype=torch.int64) + torch.arange(self.num_seqs) * self.capacity
        firsts = counts.cumsum(0) - counts  # index of each sequence's first new token in the step
        seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs), counts)
        slots = starts[seq_of_token] + torch.arange(int(counts.sum())) - firsts[seq_of_token]
        self.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32) + counts.int())
        cu_seqlens_q = None
        if any(n != 1 for n in num_new_tokens):
            cu_seqlens_q = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(self.seq_lens.device, torch.int32)
        return BatchMetadata(slots.to(self.seq_lens.device), self.block_tables, self.seq_lens, cu_seqlens_q)

    def raise_if_overflowed(self, wait: bool = True) -> None:
        """Raises CacheFullError if a decode step found a sequence full. wait=False never waits for
        the device: it reads the flag as copied to the host by an earlier call, so it reports an
        overflow one call late (at once on the CPU)."""
        if self._overflow_poll.read(wait):
            raise CacheFullError(
                f"a decode step found a sequence at its capacity of {self.capacity} tokens "
                f"({self.block_tables.shape[1]} blocks) and did not cache its new token; allocate a larger cache")


class _FlagPoll:
    """Reads a device bool on the host; without waiting, through a pinned copy started by the
    previous read (the pattern of a deferred stop check: the host never stalls on the device)."""

    def __init__(self, flag: torch.Tensor):
        self.flag = flag
        self._asynchronous = flag.device.type == "cuda"
        if self._asynchronous:
            self._host = torch.zeros((), dtype=torch.bool, pin_memory=True)
            self._copied = torch.cuda.Event()
            self._pending = False

    def read(self, wait: bool) -> bool:
        if wait or not self._asynchronous:
            return bool(self.flag)
        value = False
        if self._pending and self._copied.query():
            self._pending, value = False, bool(self._host)
        if not self._pending:
            with torch.cuda.device(self.flag.device):
                self._host.copy_(self.flag, non_blocking=True)
                self._copied.record()
            self._pending = True
        return value

    def discard(self) -> None:
        """Forgets a copy in flight (taken before the flag was cleared)."""
        if self._asynchronous and self._pending:
            self._copied.synchronize()
            self._pending = False


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
    """Per-layer K/V caches in one format, recipe and layout, with the block allocator of the sequences.

    kv_cache: a KVCacheConfig (format, recipe and each layer's scales), or a format alone (a
        KVCacheDtype or its name: scales 1.0, the recipe `rotation` gives).
    rotation: with a format alone, the recipe's rotation (None: the default, Rotation.HADAMARD for
        FP8 formats); a KVCacheConfig carries its own.
    layout: "NHD" stores [num_blocks, block_size, num_kv_heads, head_size]; "HND" stores
        [num_blocks, num_kv_heads, block_size, head_size], handed out as permuted views. The ops
        take both (they read arbitrary strides).
    `layer(index)` is the KVCacheLayer that fp8kv.ops and PagedAttention write and read.
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
        rotation: Rotation | str | None = None,
    ):
        if isinstance(kv_cache, KVCacheConfig):
            if num_layers is not None and num_layers != kv_cache.num_layers:
                raise ValueError(f"num_layers={num_layers} but the KVCacheConfig has {kv_cache.num_layers} layers")
            if rotation is not None:
                raise ValueError("rotation: a KVCacheConfig carries its own recipe; give one or the other")
        else:
            if num_layers is None or num_layers <= 0:
                raise ValueError(f"num_layers must be a positive integer, got {num_layers}")
            kv_cache = KVCacheConfig.unit_scales(kv_cache, num_layers, rotation=rotation)
        self.kv_cache = kv_cache
        self.kv_cache_dtype, self.rotation, num_layers = kv_cache.dtype, kv_cache.rotation, kv_cache.num_layers
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
        # Made once: an eager decode step asks for every layer, and making its views costs host time (two
        # or four view ops) at every layer of every step.
        self._layers = [KVCacheLayer._of_config(kv_cache, index, *self._views(index)) for index in range(num_layers)]

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def storage(self) -> torch.Tensor:
        """The one allocation behind every layer's caches: [num_layers, 2 (K, V), num_blocks, ...]."""
        return self._storage

    @property
    def memory_bytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, index: int) -> KVCacheLayer:
        """Layer `index`: its key and value caches [num_blocks, block_size, num_kv_heads, head_size]
        with the format, recipe and scales they are written and read with."""
        if torch.compiler.is_compiling():
            # A compiled step makes the views from the storage, its one static input: views held here would each
            # be an input of the graph, with guards of their own.
            return self._layers[index].with_caches(*self._views(index))
        return self._layers[index]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The storage and every layer's scales and K offsets: what never changes address (for
        torch._dynamo.mark_static_address)."""
        return self._storage, *(t for layer in self._layers for t in layer.tensors)

    def _views(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
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
