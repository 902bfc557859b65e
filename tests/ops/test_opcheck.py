"""torch.library.opcheck for every op (the three kernels and the two index checks): schema (mutation annotations), fake kernels, autograd
registration, and AOT dispatch with dynamic shapes, over a representative set of inputs.

opcheck's schema test (SchemaCheckMode) compares tensors before and after the call with
torch.allclose, which has no float8 kernel; so it runs on the unquantized-cache cases (same
schema, same mutated arguments) and FP8-cache cases run the other three tests.
"""

from __future__ import annotations

import pytest
import torch

from reference import allocate_caches, make_paged_attention_inputs, random_kv

ALL_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def checks_for(cache_format: str) -> tuple[str, ...]:
    return ALL_TESTS if cache_format == "none" else ALL_TESTS[1:]


def reshape_and_cache_args(cache_format: str, per_head: bool, layout: str, device: str) -> tuple:
    generator = torch.Generator().manual_seed(0)
    key, value = (random_kv(10, 2, 64, generator).to(torch.bfloat16).to(device) for _ in range(2))
    dtype = torch.bfloat16 if cache_format == "none" else getattr(torch, f"float8_{cache_format}")
    key_cache, value_cache = allocate_caches(4, 8, 2, 64, dtype, layout, device)
    key_cache.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).zero_()
    value_cache.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).zero_()
    slots = torch.tensor([5, -1, 0, 31, 12, 13, -1, 7, 8, 20], device=device)
    scale = torch.tensor([0.01, 0.02] if per_head else [0.015], device=device)
    return key, value, key_cache, value_cache, slots, scale, scale * 2


@pytest.mark.parametrize("cache_format, per_head, layout", [
    ("e4m3fn", False, "NHD"), ("e5m2", True, "HND"), ("e4m3fnuz", True, "interleaved"), ("none", False, "NHD"),
    ("none", True, "HND")])
def test_reshape_and_cache(device, cache_format, per_head, layout):
    torch.library.opcheck(torch.ops.fp8kv.reshape_and_cache.default,
                          reshape_and_cache_args(cache_format, per_head, layout, device),
                          test_utils=checks_for(cache_format))


@pytest.mark.parametrize("cache_format, per_head, layout, decode, window, soft_cap", [
    ("e4m3fn", False, "NHD", True, -1, 0.0),
    ("e4m3fn", True, "HND", False, -1, 0.0),
    ("e5m2", True, "HND", True, 9, 5.0),
    ("e4m3fnuz", False, "interleaved", False, 7, 0.0),
    ("none", True, "NHD", False, -1, 3.0),
    ("none", False, "HND", True, 5, 0.0),
])
def test_paged_attention(device, cache_format, per_head, layout, decode, window, soft_cap):
    inputs = make_paged_attention_inputs(
        seq_lens=[3, 17, 0] if decode else [3, 17, 9], q_lens=None if decode else [3, 4, 1], num_heads=8,
        num_kv_heads=2, head_size=64, block_size=8, cache_format=cache_format, query_dtype=torch.float16,
        per_head_scales=per_head, layout=layout, sliding_window=window, logits_soft_cap=soft_cap, device=device)
    out = torch.zeros_like(inputs.query)
    torch.library.opcheck(torch.ops.fp8kv.paged_attention.default, (
        out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.seq_lens,
        inputs.cu_seqlens_q, inputs.softmax_scale, inputs.k_scale, inputs.v_scale, inputs.sliding_window,
        inputs.logits_soft_cap), test_utils=checks_for(cache_format))


@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_amax(device, per_head, dtype):
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(12, 8, 32, generator=generator).to(dtype).to(device)
    key, value = qkv[:, 4:6], qkv[:, 6:]
    amax = torch.zeros(2 if per_head else 1, device=device)
    torch.library.opcheck(torch.ops.fp8kv.kv_amax.default, (key, value, amax, amax.clone()))


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "multi_token"])
def test_index_checks(device, decode):
    inputs = make_paged_attention_inputs(
        seq_lens=[3, 17, 0] if decode else [3, 17, 9], q_lens=None if decode else [3, 4, 1], num_heads=4,
        num_kv_heads=2, head_size=64, block_size=8, cache_format="none", query_dtype=torch.float16,
        per_head_scales=False, layout="NHD", sliding_window=-1, logits_soft_cap=0.0, device=device)
    # An unquantized cache: opcheck's schema test compares tensors with allclose, which has no float8 kernel.
    torch.library.opcheck(torch.ops.fp8kv.check_paged_attention_indices.default, (
        inputs.block_tables, inputs.seq_lens, inputs.cu_seqlens_q, inputs.query.shape[0], inputs.key_cache, -1))
    slots = torch.tensor([5, -1, 0, 31], device=device)
    torch.library.opcheck(torch.ops.fp8kv.check_cache_write_indices.default, (slots, inputs.key_cache))
