"""fp8kv.ops.kv_amax: running max(|x|) per tensor or per KV head, folded into existing maxima."""

from __future__ import annotations

import math

import pytest
import torch

import fp8kv

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
NUM_KV_HEADS, HEAD_SIZE = 4, 96


def key_value(num_tokens: int, dtype: torch.dtype, strided: bool, seed: int, device: str):
    """key, value [num_tokens, NUM_KV_HEADS, HEAD_SIZE] with a different magnitude per head;
    strided: slices of one fused QKV tensor."""
    generator = torch.Generator().manual_seed(seed)
    heads = 8 + 2 * NUM_KV_HEADS if strided else 2 * NUM_KV_HEADS
    fused = torch.randn(num_tokens, heads, HEAD_SIZE, generator=generator)
    fused *= torch.rand(1, heads, 1, generator=generator) * 10
    fused = fused.to(dtype).to(device)
    start = heads - 2 * NUM_KV_HEADS
    return fused[:, start:start + NUM_KV_HEADS], fused[:, start + NUM_KV_HEADS:]


def expected_amax(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """float32 max(|x|) per head (over tokens and channels) or over everything; exact (max of
    values representable in float32), NaN if any element is NaN."""
    x = x.float().cpu().abs()
    per_head_max = x.amax(dim=(0, 2))  # torch's amax propagates NaN
    return per_head_max if per_head else per_head_max.amax().view(1)


def initial_maxima(per_head: bool, device: str) -> torch.Tensor:
    """Running maxima from earlier calls: one head above anything in the data, the others below."""
    values = [1e6, 0.5, 0.0, 2.0] if per_head else [0.5]
    return torch.tensor(values, dtype=torch.float32, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "fused_qkv"])
def test_running_maxima_fold_across_calls(device, dtype, per_head, strided):
    k_amax, v_amax = initial_maxima(per_head, device), initial_maxima(per_head, device)
    expected_k, expected_v = k_amax.cpu(), v_amax.cpu()
    for call, num_tokens in enumerate([37, 5, 130]):
        key, value = key_value(num_tokens, DTYPES[dtype], strided, seed=call, device=device)
        if call == 1:
            key[2, 1, 7] = -math.inf  # |x| of an infinity is a maximum like any other
        fp8kv.ops.kv_amax(key, value, k_amax, v_amax)
        expected_k = torch.maximum(expected_k, expected_amax(key, per_head))
        expected_v = torch.maximum(expected_v, expected_amax(value, per_head))
        assert torch.equal(k_amax.cpu(), expected_k), f"call {call}"
        assert torch.equal(v_amax.cpu(), expected_v), f"call {call}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_nan_propagates_and_stays(device, dtype, per_head):
    """A NaN in head 2 of the keys makes that maximum NaN (the tensor's, or head 2's only); a later
    call with finite data leaves it NaN."""
    k_amax, v_amax = initial_maxima(per_head, device), initial_maxima(per_head, device)
    key, value = key_value(20, DTYPES[dtype], False, seed=0, device=device)
    key[13, 2, 50] = math.nan
    fp8kv.ops.kv_amax(key, value, k_amax, v_amax)
    expected_k = torch.maximum(initial_maxima(per_head, "cpu"), expected_amax(key, per_head))  # NaN-propagating
    expected_v = torch.maximum(initial_maxima(per_head, "cpu"), expected_amax(value, per_head))
    for _ in range(2):
        torch.testing.assert_close(k_amax.cpu(), expected_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v_amax.cpu(), expected_v, rtol=0, atol=0, equal_nan=True)
        assert bool(k_amax.isnan().any())
        key, value = key_value(20, DTYPES[dtype], False, seed=1, device=device)
        fp8kv.ops.kv_amax(key, value, k_amax, v_amax)
        expected_k = torch.maximum(expected_k, expected_amax(key, per_head))
        expected_v = torch.maximum(expected_v, expected_amax(value, per_head))


@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_empty_input_leaves_maxima(device, per_head):
    k_amax, v_amax = initial_maxima(per_head, device), initial_maxima(per_head, device)
    key = torch.empty(0, NUM_KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=device)
    fp8kv.ops.kv_amax(key, key.clone(), k_amax, v_amax)
    assert torch.equal(k_amax.cpu(), initial_maxima(per_head, "cpu"))
    assert torch.equal(v_amax.cpu(), initial_maxima(per_head, "cpu"))


def test_zero_maxima_take_the_data_maximum(device):
    """Fresh (zero) maxima become the data's maxima; per head they differ."""
    key, value = key_value(64, torch.float16, False, seed=3, device=device)
    k_amax = torch.zeros(NUM_KV_HEADS, device=device)
    v_amax = torch.zeros(NUM_KV_HEADS, device=device)
    fp8kv.ops.kv_amax(key, value, k_amax, v_amax)
    assert torch.equal(k_amax.cpu(), expected_amax(key, True))
    assert torch.equal(v_amax.cpu(), expected_amax(value, True))
    assert len(set(k_amax.tolist())) == NUM_KV_HEADS
