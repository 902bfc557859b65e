"""vLLM's side of the vLLM backend's tests, without vLLM: a batch of requests as vLLM's model runner
lays it out, and what one layer's page of vLLM's cache must hold after each step.

vLLM's page of a layer is a logical [num_blocks, num_kv_heads, block_size, 2 * head_size] view
(uint8 storage for an FP8 cache, the model's dtype for an unquantized one), K in the first half of
the last dimension and V in the second; its memory order is vLLM's KVCacheLayout. Shared by
integrations/test_vllm.py (inside vLLM, CPU) and integrations/test_vllm_pages.py (the ops on
vLLM-shaped tensors, CPU and CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reference import (FORMAT_BY_DTYPE, FORMAT_BY_NAME, AttentionReference, add_output_rounding, bits, cache_values,
                       kernel_product_dtype, paged_attention_reference, stored)
from rotated_reference import rotated_attention_reference, stored_rotated

PAD_SLOT_ID, NULL_BLOCK_ID = -1, 0  # vLLM's padding slot and null block (block 0 is never allocated)


@dataclass
class Step:
    """One step's batch in vLLM's layout: requests in order (decodes first), `pad_reqs` padding
    requests after them (no query rows, seq_len 0, null-block table rows) and padding tokens after
    the real ones (slot -1). Tensors on the CPU."""
    query_start_loc: torch.Tensor  # int32 [num_reqs_padded + 1]
    seq_lens: torch.Tensor         # int32 [num_reqs_padded]
    block_table: torch.Tensor      # int32 [num_reqs_padded, max_blocks_per_req]
    slot_mapping: torch.Tensor     # int64 [num_tokens_padded]
    num_reqs: int                  # real requests
    num_tokens: int                # real tokens
    rows: list[tuple[str, int]]    # (request, position) of each real token
    query_lens: list[int]

    @property
    def num_reqs_padded(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens_padded(self) -> int:
        return self.slot_mapping.shape[0]


class Requests:
    """Requests' lengths and blocks (allocated in a shuffled order from 1 up; 0 is the null block)."""

    def __init__(self, num_blocks: int, block_size: int, max_blocks_per_req: int, generator: torch.Generator):
        self.block_size, self.max_blocks_per_req = block_size, max_blocks_per_req
        self.free_blocks = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
        self.lengths: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}

    def step(self, scheduled: list[tuple[str, int]], pad_tokens: int = 0, pad_reqs: int = 0) -> Step:
        """Schedules (request, new tokens) in order; pads the batch by `pad_reqs` requests (a token
        each, as vLLM pads a decode batch to a captured size) and `pad_tokens` more tokens."""
        slots, rows, query_lens = [], [], []
        for name, new in scheduled:
            start = self.lengths.get(name, 0)
            self.lengths[name] = start + new
            blocks = self.blocks.setdefault(name, [])
            while len(blocks) * self.block_size < start + new:
                blocks.append(self.free_blocks.pop())
            query_lens.append(new)
            for p in range(start, start + new):
                slots.append(blocks[p // self.block_size] * self.block_size + p % self.block_size)
                rows.append((name, p))
        num_reqs, num_tokens = len(scheduled), len(slots)
        cu = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
        block_table = torch.full((num_reqs + pad_reqs, self.max_blocks_per_req), NULL_BLOCK_ID, dtype=torch.int32)
        for i, (name, _) in enumerate(scheduled):
            block_table[i, :len(self.blocks[name])] = torch.tensor(self.blocks[name], dtype=torch.int32)
        slot_mapping = torch.full((num_tokens + pad_tokens + pad_reqs,), PAD_SLOT_ID, dtype=torch.int64)
        slot_mapping[:num_tokens] = torch.tensor(slots)
        return Step(query_start_loc=torch.cat([cu, cu[-1:].expand(pad_reqs)]),
                    seq_lens=torch.tensor([self.lengths[n] for n, _ in scheduled] + [0] * pad_reqs, dtype=torch.int32),
                    block_table=block_table, slot_mapping=slot_mapping, num_reqs=num_reqs, num_tokens=num_tokens,
                    rows=rows, query_lens=query_lens)


def poison(page: torch.Tensor, fp8: torch.dtype | None) -> None:
    """Fills a page (vLLM's view) with the format's NaN code, or NaN for an unquantized cache."""
    if fp8 is None:
        page.fill_(math.nan)
    else:
        page.view(torch.uint8).fill_(FORMAT_BY_DTYPE[fp8].nan_code)


class ExpectedPages:
    """The bits one layer's page must hold: poisoned (poison) at first, then each written token's K and
    V as reference.py's encoder stores them with the given scales (or their own bits, unquantized);
    with `rotated`, as rotated_reference.py's encoder stores them under the rotated recipe, K less
    `k_offset` [num_kv_heads, head_size] (rotated + centred) where given."""

    def __init__(self, page: torch.Tensor, fp8: torch.dtype | None, dtype: torch.dtype, rotated: bool = False,
                 k_offset: torch.Tensor | None = None):
        self.fp8, self.dtype, self.rotated, self.k_offset = fp8, dtype, rotated, k_offset
        self.head_size = page.shape[-1] // 2
        self.format = "none" if fp8 is None else FORMAT_BY_DTYPE[fp8].name
        reference_page = torch.empty(page.shape, dtype=page.dtype)
        poison(reference_page, fp8)
        self.bits = bits(reference_page)

    def write(self, slots: list[int] | torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor,
              v_scale: torch.Tensor) -> None:
        block_size = self.bits.shape[2]
        slots = torch.as_tensor(slots)
        blocks, offsets = slots // block_size, slots % block_size
        d = self.head_size
        if self.rotated:
            fmt = FORMAT_BY_NAME[self.format]
            self.bits[blocks, :, offsets, :d] = stored_rotated(key, k_scale.reshape(-1), fmt, self.k_offset)
            self.bits[blocks, :, offsets, d:] = stored_rotated(value, v_scale.reshape(-1), fmt, None)
            return
        self.bits[blocks, :, offsets, :d] = stored(key.cpu(), k_scale.reshape(-1), self.format, self.dtype)
        self.bits[blocks, :, offsets, d:] = stored(value.cpu(), v_scale.reshape(-1), self.format, self.dtype)

    def assert_held_by(self, page: torch.Tensor) -> None:
        assert torch.equal(bits(page).cpu(), self.bits), "the page does not hold exactly the tokens written to it"

    def reference(self, query: torch.Tensor, step: Step, k_scale: torch.Tensor, v_scale: torch.Tensor,
                  softmax_scale: float, sliding_window: int, logits_soft_cap: float,
                  device: str) -> AttentionReference:
        """Attention of the real requests' query rows over the values the page must hold, with the bound
        a correct kernel on `device` meets (reference.paged_attention_reference)."""
        held = self.bits.view(self.fp8 or self.dtype).transpose(1, 2)  # [num_blocks, block_size, H, 2D]
        d = self.head_size
        key_values = cache_values(held[..., :d], k_scale.cpu().reshape(-1))
        value_values = cache_values(held[..., d:], v_scale.cpu().reshape(-1))
        cache_like = torch.empty(0, dtype=self.fp8 or self.dtype, device=device)
        n = step.num_reqs
        attention = paged_attention_reference
        if self.rotated:
            attention = rotated_attention_reference
            if self.k_offset is not None:
                key_values = key_values + self.k_offset.double().cpu()
        reference = attention(
            query.cpu(), key_values, value_values, step.block_table[:n], step.seq_lens[:n],
            step.query_start_loc[:n + 1], softmax_scale, sliding_window, logits_soft_cap,
            kernel_product_dtype(cache_like))
        return add_output_rounding(reference, query.dtype)
