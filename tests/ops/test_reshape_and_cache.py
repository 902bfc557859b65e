"""The reshape_and_cache op (torch.ops.fp8kv): exact bytes in the right slots, nothing else touched.

Every cache starts filled with a sentinel byte pattern; after the write, the whole cache must equal
the sentinel except at the slots of non-negative slot_mapping entries, which must hold the test's
own encoding (or, for an unquantized cache, the source bits).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import fp8kv  # noqa: F401  (loads torch.ops.fp8kv)
from reference import (CACHE_FORMATS, CACHE_LAYOUTS, allocate_caches, bits, cache_dtype, random_kv, stored)

SOURCE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SENTINEL = {1: 0x5A, 2: 0x5A5A, 4: 0x5A5A5A5A}  # by element size


def scales(cache_format: str, num_kv_heads: int, per_head: bool, seed: int) -> torch.Tensor:
    """Non-trivial dequantization scales (not powers of two); the op must ignore them for an
    unquantized cache."""
    generator = torch.Generator().manual_seed(seed)
    return (0.003 + 0.05 * torch.rand(num_kv_heads if per_head else 1, generator=generator)).float()


def with_special_values(x: torch.Tensor) -> torch.Tensor:
    """x with NaN (with a payload), infinities, signed zeros and a tiny value in its first row."""
    x = x.clone()
    x[0, 0, :6] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40])
    signaling_nan = {torch.float32: 0x7F800001, torch.float16: 0x7C01, torch.bfloat16: 0x7F81}[x.dtype]
    bits(x)[0, -1, 0] = signaling_nan  # payload bits must survive an unquantized (bit) copy
    return x


def slot_mapping(num_tokens: int, num_slots: int, num_written: int, generator: torch.Generator) -> torch.Tensor:
    """num_written entries (<= num_tokens): distinct slots in random order, some negative (skipped)."""
    slots = torch.randperm(num_slots, generator=generator)[:num_written]
    skipped = torch.rand(num_written, generator=generator) < 0.25
    slots[skipped] = -1 - torch.randint(0, 1000, (int(skipped.sum()),), generator=generator)
    return slots


def expected_cache(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor,
                   cache_format: str) -> torch.Tensor:
    """Bits the cache must hold: the sentinel, and the stored x at each non-negative slot."""
    expected = torch.full(cache.shape, SENTINEL[cache.element_size()], dtype=bits(cache).dtype)
    block_size = cache.shape[1]
    written = slots >= 0
    rows = stored(x[: len(slots)][written].cpu(), scale.cpu(), cache_format, x.dtype)
    expected[slots[written] // block_size, slots[written] % block_size] = rows
    return expected


def write_and_check(key, value, key_cache, value_cache, slots, k_scale, v_scale, cache_format, device):
    for cache in (key_cache, value_cache):
        bits(cache).fill_(SENTINEL[cache.element_size()])
    expected_key = expected_cache(key_cache, key, slots, k_scale, cache_format)
    expected_value = expected_cache(value_cache, value, slots, v_scale, cache_format)
    torch.ops.fp8kv.reshape_and_cache(key.to(device), value.to(device), key_cache, value_cache, slots.to(device),
                                k_scale.to(device), v_scale.to(device))
    for name, cache, expected in (("key_cache", key_cache, expected_key), ("value_cache", value_cache, expected_value)):
        actual = bits(cache).cpu()
        wrong = (actual != expected).nonzero()
        assert len(wrong) == 0, (f"{name}: {len(wrong)} wrong elements, first at [block, offset, head, dim] = "
                                 f"{wrong[0].tolist()}: got {actual[tuple(wrong[0])]}, want {expected[tuple(wrong[0])]}")


@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("layout", CACHE_LAYOUTS)
@pytest.mark.parametrize("source", SOURCE_DTYPES)
@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
def test_writes_exact_bytes_to_their_slots(device, cache_format, source, layout, per_head):
    generator = torch.Generator().manual_seed(zlib.crc32(f"{cache_format}{source}{layout}{per_head}".encode()))
    num_blocks, block_size, num_kv_heads, head_size, num_tokens = 7, 16, 3, 64, 70
    source_dtype = SOURCE_DTYPES[source]
    key = with_special_values(random_kv(num_tokens, num_kv_heads, head_size, generator).to(source_dtype))
    value = with_special_values(random_kv(num_tokens, num_kv_heads, head_size, generator).to(source_dtype)).neg()
    # Fewer slot entries than tokens: the trailing tokens are not written.
    slots = slot_mapping(num_tokens, num_blocks * block_size, num_tokens - 5, generator)
    key_cache, value_cache = allocate_caches(num_blocks, block_size, num_kv_heads, head_size,
                                             cache_dtype(cache_format, source_dtype), layout, device)
    k_scale, v_scale = (scales(cache_format, num_kv_heads, per_head, seed) for seed in (1, 2))
    write_and_check(key, value, key_cache, value_cache, slots, k_scale, v_scale, cache_format, device)


@pytest.mark.parametrize("source", SOURCE_DTYPES)
@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
def test_key_and_value_sliced_from_a_fused_qkv_tensor(device, cache_format, source):
    """key and value are strided views (token stride > heads * head_size) of one QKV tensor."""
    generator = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_size, num_tokens, block_size = 8, 2, 128, 40, 16
    source_dtype = SOURCE_DTYPES[source]
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_size, generator=generator)
    qkv = qkv.to(source_dtype).to(device)
    key = qkv[:, num_heads:num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads:]
    assert not key.is_contiguous() and not value.is_contiguous()
    slots = slot_mapping(num_tokens, 4 * block_size, num_tokens, generator)
    key_cache, value_cache = allocate_caches(4, block_size, num_kv_heads, head_size,
                                             cache_dtype(cache_format, source_dtype), "NHD", device)
    k_scale, v_scale = (scales(cache_format, num_kv_heads, True, seed) for seed in (4, 5))
    write_and_check(key, value, key_cache, value_cache, slots, k_scale, v_scale, cache_format, device)


@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
@pytest.mark.parametrize("num_written", [0, 9], ids=["empty_slot_mapping", "all_negative"])
def test_padding_only_writes_nothing(device, cache_format, num_written):
    generator = torch.Generator().manual_seed(6)
    key = torch.randn(9, 2, 64, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    slots = torch.full((num_written,), -1, dtype=torch.int64)
    key_cache, value_cache = allocate_caches(2, 8, 2, 64, cache_dtype(cache_format, torch.bfloat16), "HND", device)
    ones = torch.ones(1)
    write_and_check(key, -key, key_cache, value_cache, slots, ones, ones, cache_format, device)


@pytest.mark.parametrize("cache_format", ["e4m3fn", "e4m3fnuz"])
def test_every_slot_of_a_large_cache(device, cache_format):
    """All slots of a cache with many blocks written in one call (work split across threads or
    thread blocks), in a shuffled order; block size 128 and 8 KV heads."""
    generator = torch.Generator().manual_seed(8)
    num_blocks, block_size, num_kv_heads, head_size = 6, 128, 8, 96
    num_tokens = num_blocks * block_size
    key, value = (random_kv(num_tokens, num_kv_heads, head_size, generator).to(torch.float16) for _ in range(2))
    slots = torch.randperm(num_tokens, generator=generator)
    key_cache, value_cache = allocate_caches(num_blocks, block_size, num_kv_heads, head_size,
                                             cache_dtype(cache_format, torch.float16), "NHD", device)
    k_scale, v_scale = (scales(cache_format, num_kv_heads, True, seed) for seed in (9, 10))
    write_and_check(key, value, key_cache, value_cache, slots, k_scale, v_scale, cache_format, device)
