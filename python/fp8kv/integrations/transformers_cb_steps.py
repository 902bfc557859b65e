"""One layer of a continuous-batching step on fp8kv's pages in transformers' paged cache: each
layer's KVCacheLayer over its pages, the step's index tensors derived from transformers' (once per
step, shared by the layers), and the attention (fp8kv.integrations.transformers_continuous_batching
installs the hooks that put fp8kv's pages there)."""

from __future__ import annotations

import weakref

import torch

from ..attention import LayerAttentions
from ..cache import BatchMetadata
from ..formats import KVCacheConfig
from ..layer import KVCacheLayer


class CacheState:
    """fp8kv's part of one transformers cache: its layers' PagedAttention modules and KVCacheLayers,
    and the index tensors of the step being run (derived once per step, for every layer; `padded`:
    whether transformers pads the steps, see _step_metadata)."""

    def __init__(self, kv_cache: KVCacheConfig, padded: bool, fp8_math: bool):
        self.kv_cache, self.padded = kv_cache, padded
        self.attentions = LayerAttentions(kv_cache, fp8_math)
        self._layers: dict[int, KVCacheLayer] = {}
        self._step: tuple[weakref.ref, bool, BatchMetadata] | None = None

    def layer(self, allocator, index: int) -> KVCacheLayer:
        """Layer `index` of the KVCacheConfig over its pages, its caches as the ops take them: [blocks,
        page_size, kv_heads, head_size], one page per block. transformers' page views hold every page
        from the layer's first on (its other layers' and its values' too), which its kernels index
        through the block table; one page in `pages_per_block` of each is the layer's."""
        if index not in self._layers:
            key_pages, value_pages = allocator.get_cache_for_block_table(index)
            pages_per_block = allocator.block_physical_stride // allocator.tokens_per_page
            self._layers[index] = KVCacheLayer._of_config(self.kv_cache, index, key_pages[::pages_per_block],
                                                          value_pages[::pages_per_block])
        return self._layers[index]

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


CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `tensor`'s device."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def serves(cache) -> bool:
    """True for a transformers continuous-batching cache holding pages for fp8kv."""
    return cache is not None and cache in CACHES


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
    state = CACHES[cache]
    layer = module.layer_idx
    allocator = cache.layer_to_allocator[layer]
    _, num_heads, tokens, head_size = query.shape
    attention = state.attentions.get(layer, num_heads, key.shape[1], head_size, scaling, sliding_window, softcap)
    q, k, v = (t.transpose(1, 2).reshape(tokens, t.shape[1], head_size) for t in (query, key, value))
    out = attention.forward(q, k, v, state.layer(allocator, layer), state.step(allocator, kwargs))
    return out.view(1, tokens, num_heads, head_size)
