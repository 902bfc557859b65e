"""The FP8 codecs, exhaustively and bit-exactly, against tables built from the format definitions.

Encoding goes through the reshape_and_cache op (key and value paths), decoding through
the paged_attention op with one cached token (softmax over one key is 1, so the output is the
decoded value code times v_scale, exactly).
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8kv  # noqa: F401  (loads torch.ops.fp8kv)
from reference import FORMATS, Fp8Format, all_16bit_values, quantize

FORMAT_PARAMS = [pytest.param(f, id=f.name) for f in FORMATS]
HEAD_SIZE, NUM_KV_HEADS, BLOCK_SIZE = 64, 2, 16


def op_codes(x: torch.Tensor, fmt: Fp8Format, device: str, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes the op stores for x (1-D, any float dtype) as keys, and for x reversed as values.
    x is laid out as [tokens, NUM_KV_HEADS, HEAD_SIZE] (zero-padded), so a per-head scale applies
    to alternating runs of HEAD_SIZE elements."""
    n = x.numel()
    row = NUM_KV_HEADS * HEAD_SIZE
    num_tokens = -(-n // row)
    padded = torch.zeros(num_tokens * row, dtype=x.dtype)
    padded[:n] = x
    key = padded.view(num_tokens, NUM_KV_HEADS, HEAD_SIZE).to(device)
    value = padded.flip(0).view(num_tokens, NUM_KV_HEADS, HEAD_SIZE).to(device)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    key_cache = torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=fmt.dtype, device=device)
    value_cache = torch.empty_like(key_cache)
    ones = torch.ones(1, device=device)
    k_scale = ones if k_scale is None else k_scale.to(device)
    v_scale = ones if v_scale is None else v_scale.to(device)
    slots = torch.arange(num_tokens, device=device)
    torch.ops.fp8kv.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    key_codes = key_cache.view(torch.uint8).flatten()[:num_tokens * row].cpu()
    value_codes = value_cache.view(torch.uint8).flatten()[:num_tokens * row].cpu()
    return key_codes[:n], value_codes.flip(0)[:n]


def assert_codes_equal(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor, what: str) -> None:
    wrong = (actual != expected).nonzero().flatten()
    if len(wrong):
        examples = ", ".join(f"{inputs[i].item()!r}: got 0x{actual[i].item():02X} want 0x{expected[i].item():02X}"
                             for i in wrong[:8].tolist())
        raise AssertionError(f"{what}: {len(wrong)} of {len(inputs)} codes wrong, e.g. {examples}")


def check_encoding(x: torch.Tensor, fmt: Fp8Format, device: str) -> None:
    """Scale 1: the op's codes for x must be the reference encoding of x, on both paths."""
    key_codes, value_codes = op_codes(x, fmt, device)
    expected = fmt.encode(x)
    assert_codes_equal(key_codes, expected, x, "key path")
    assert_codes_equal(value_codes, expected, x, "value path")


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_reference_formats_match_their_specification(fmt):
    """Guards the reference itself: anchors from the contract, and torch's decoding of the bits
    (decoding only; encoding never uses torch's float8 casts)."""
    assert fmt.max_finite == {"e4m3fn": 448.0, "e5m2": 57344.0, "e4m3fnuz": 240.0}[fmt.name]
    assert fmt.min_subnormal == {"e4m3fn": 2.0**-9, "e5m2": 2.0**-16, "e4m3fnuz": 2.0**-10}[fmt.name]
    torch_values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).double()
    torch.testing.assert_close(fmt.table, torch_values, rtol=0, atol=0, equal_nan=True)
    # Contract literals for the special inputs.
    special = torch.tensor([math.nan, math.inf, -math.inf, -0.0, -1e-30, 1e30])
    expected = {"e4m3fn": [0x7F, 0x7E, 0xFE, 0x80, 0x80, 0x7E],
                "e5m2": [0x7F, 0x7B, 0xFB, 0x80, 0x80, 0x7B],
                "e4m3fnuz": [0x80, 0x7F, 0xFF, 0x00, 0x00, 0x7F]}[fmt.name]
    assert fmt.encode(special).tolist() == expected


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
@pytest.mark.parametrize("source_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_encode_every_16bit_input(device, fmt, source_dtype):
    check_encoding(all_16bit_values(source_dtype), fmt, device)


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_encode_midpoints_and_their_neighbours(device, fmt):
    """Every midpoint between adjacent FP8 values (a tie: goes to the even code) and the nearest
    float32 on either side (must round to the nearer code), as float32 inputs."""
    midpoints = fmt.midpoints().float()
    assert torch.equal(midpoints.double(), fmt.midpoints()), "midpoints are exact in float32"
    below = torch.nextafter(midpoints, torch.zeros_like(midpoints))
    above = torch.nextafter(midpoints, midpoints * 2)
    check_encoding(torch.cat([midpoints, below, above]), fmt, device)


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
def test_encode_special_values(device, fmt):
    """Zeros, subnormals and their ties, the largest values, saturation, infinities and NaNs."""
    tiny, top = fmt.min_subnormal, fmt.max_finite
    largest_step = top - float(fmt.table[fmt.encode(torch.tensor([top])).long() - 1])
    f32 = torch.finfo(torch.float32)
    magnitudes = [0.0, tiny, tiny / 2, tiny * 0.75, tiny * 1.5, tiny * 2.5, 2.0 ** (1 - fmt.exponent_bias),
                  float(f32.tiny), 2.0**-149, top, top - largest_step / 2, top + largest_step / 2,
                  top + largest_step, top * 2, 1e30, float(f32.max), math.inf]
    x = torch.tensor(magnitudes, dtype=torch.float32)
    x = torch.cat([x, -x, torch.tensor([math.nan, -math.nan])])
    check_encoding(x, fmt, device)


def wide_range_inputs(fmt: Fp8Format, scale: float, generator: torch.Generator) -> torch.Tensor:
    """float32 x such that x / scale spans the whole format, beyond max and below the subnormals,
    plus values whose quotient lands on or next to a midpoint (ties after the division)."""
    exponent = torch.empty(20000).uniform_(math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max_finite) + 2,
                                           generator=generator)
    sign = torch.randint(0, 2, (20000,), generator=generator) * 2 - 1
    spread = sign * torch.pow(2.0, exponent)
    ties = fmt.midpoints().float()
    return (torch.cat([spread, ties, torch.nextafter(ties, ties * 2)]) * scale).float()


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_encode_divides_by_the_scale_in_float32(device, fmt, source_dtype, per_head):
    """Stored code = encode(x / s) with the division in float32 (not a multiplication by 1 / s)."""
    generator = torch.Generator().manual_seed(7)
    k_scale = torch.tensor([0.0123, 3.7] if per_head else [0.0123])
    v_scale = torch.tensor([1 / 3, 0.07] if per_head else [1 / 3])
    x = wide_range_inputs(fmt, 0.05, generator).to(source_dtype)
    x = x[: x.numel() // (NUM_KV_HEADS * HEAD_SIZE) * NUM_KV_HEADS * HEAD_SIZE]  # whole tokens
    key_codes, value_codes = op_codes(x, fmt, device, k_scale, v_scale)
    tokens = x.view(-1, NUM_KV_HEADS, HEAD_SIZE)
    assert_codes_equal(key_codes, quantize(tokens, k_scale, fmt).flatten(), x, "key path")
    value_expected = quantize(x.flip(0).view(-1, NUM_KV_HEADS, HEAD_SIZE), v_scale, fmt).flatten().flip(0)
    assert_codes_equal(value_codes, value_expected, x, "value path")


@pytest.mark.parametrize("fmt", FORMAT_PARAMS)
@pytest.mark.parametrize("query_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("v_scale", [1.0, 0.25])
def test_decode_every_code(device, fmt, query_dtype, v_scale):
    """All 256 codes as one cached value row: out = decode(code) * v_scale, exactly (every value
    of the three formats, times a power of two, is a float16 and a bfloat16); NaN codes give NaN."""
    head_size = 256
    key_cache = torch.zeros(1, 16, 1, head_size, dtype=torch.uint8)  # code 0 is +0 in every format
    value_cache = torch.full((1, 16, 1, head_size), fmt.nan_code, dtype=torch.uint8)
    value_cache[0, 0, 0] = torch.arange(256, dtype=torch.uint8)
    query = torch.randn(1, 2, head_size, generator=torch.Generator().manual_seed(0)).to(query_dtype)
    expected = (fmt.table * v_scale).expand(2, head_size)
    # Two poisons of `out`, so no element passes by being left as it was.
    for poison in (math.nan, 0.0):
        out = torch.full((1, 2, head_size), poison, dtype=query_dtype, device=device)
        torch.ops.fp8kv.paged_attention(out, query.to(device), key_cache.view(fmt.dtype).to(device),
                                  value_cache.view(fmt.dtype).to(device),
                                  torch.zeros(1, 1, dtype=torch.int32, device=device),
                                  torch.ones(1, dtype=torch.int32, device=device), None, 0.0625,
                                  torch.ones(1, device=device), torch.full((1,), v_scale, device=device))
        torch.testing.assert_close(out[0].double().cpu(), expected, rtol=0, atol=0, equal_nan=True)
