"""Independent references for the rotated cache recipe (docs/rotated_cache.md).

- The block Hadamard matrix from its definition (entry (i, j) of a Sylvester block is
  (-1)^popcount(i & j)), in float64.
- The contract's fp32 rotation (butterflies in their specified order, then the fp32 norm), which the
  kernels must reproduce bit for bit in the cache write.
- Rotated paged-attention problems and their float64 reference with its error bound, built on
  reference.py's plain one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import fp8kv  # noqa: F401  (loads torch.ops.fp8kv)
from reference import (FLOAT32_UNIT_ROUNDOFF, FORMAT_BY_NAME, AttentionReference, Fp8Format, add_output_rounding,
                       allocate_caches, bits, cache_values, fill_nan, fp8_math_error_bound, kernel_product_dtype,
                       PagedAttentionInputs, paged_attention_reference, paged_block_tables, random_kv)

# Head sizes with rotation blocks of at least 16 (the CUDA ones first) and their blocks.
HEAD_SIZES = [64, 80, 96, 128, 192, 256, 48, 112, 512]


def hadamard_block(head_size: int) -> int:
    """The largest power of two dividing head_size, at most 256."""
    block = 1
    while head_size % (2 * block) == 0 and block < 256:
        block *= 2
    return block


def hadamard_matrix(head_size: int) -> torch.Tensor:
    """float64 [D, D]: block diagonal, Sylvester blocks scaled by 1/sqrt(block)."""
    block = hadamard_block(head_size)
    i = torch.arange(block).view(-1, 1)
    j = torch.arange(block).view(1, -1)
    and_bits = i & j
    popcount = torch.zeros_like(and_bits)
    for bit in range(block.bit_length()):
        popcount += (and_bits >> bit) & 1
    sylvester = (1 - 2 * (popcount % 2)).double() / math.sqrt(block)
    return torch.block_diag(*[sylvester] * (head_size // block))


def norm_float32(block: int) -> torch.Tensor:
    """1/sqrt(block) rounded to float32."""
    return torch.tensor(1 / math.sqrt(block), dtype=torch.float64).float()


def rotate_float32(x: torch.Tensor) -> torch.Tensor:
    """The contract's rotation of x [..., D] in float32: for h = 1, 2, ..., block / 2 each pair
    (x_i, x_{i+h}), i & h = 0, becomes (x_i + x_{i+h}, x_i - x_{i+h}); then times the fp32 norm."""
    x = x.float().clone()
    head_size = x.shape[-1]
    block = hadamard_block(head_size)
    h = 1
    while h < block:
        pairs = x.view(*x.shape[:-1], head_size // (2 * h), 2, h)
        a, b = pairs[..., 0, :].clone(), pairs[..., 1, :].clone()
        pairs[..., 0, :] = a + b
        pairs[..., 1, :] = a - b
        h *= 2
    return x * norm_float32(block)


def stored_rotated(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, offset: torch.Tensor | None) -> torch.Tensor:
    """uint8 codes of x [..., num_kv_heads, D] under the rotated recipe: encode((rotated x - offset) / scale),
    every step one float32 operation."""
    y = rotate_float32(x.cpu())
    if offset is not None:
        y = y - offset.float().cpu()
    return fmt.encode(y / scale.float().cpu().view(-1, 1))


def rotation_error_bound(x_abs: torch.Tensor) -> torch.Tensor:
    """Bound on |fp32 rotation - exact rotation| of a vector with magnitudes x_abs [..., D], per element:
    log2(block) rounded sums of block terms and one product, each within u of its result."""
    head_size = x_abs.shape[-1]
    block = hadamard_block(head_size)
    block_sums = x_abs.double().reshape(*x_abs.shape[:-1], head_size // block, block).sum(-1, keepdim=True)
    per_element = block_sums.expand(*x_abs.shape[:-1], head_size // block, block).reshape(x_abs.shape)
    return (math.log2(block) + 2) * FLOAT32_UNIT_ROUNDOFF * per_element / math.sqrt(block)


@dataclass
class RotatedInputs(PagedAttentionInputs):
    """A paged-attention problem over a cache written with the rotated recipe (K offsets optional)."""
    k_offset: torch.Tensor | None = None

    def run(self) -> torch.Tensor:
        out = torch.full_like(self.query, math.nan)
        torch.ops.fp8kv.paged_attention(out, self.query, self.key_cache, self.value_cache, self.block_tables,
                                  self.seq_lens, self.cu_seqlens_q, self.softmax_scale, self.k_scale, self.v_scale,
                                  self.sliding_window, self.logits_soft_cap, True, self.k_offset, self.fp8_math,
                                  **self.forced_plan())
        return out

    def reference(self) -> AttentionReference:
        device = self.key_cache.device
        keys = cache_values(self.key_cache, self.k_scale)
        if self.k_offset is not None:
            keys = keys + self.k_offset.double().to(device).view(1, 1, *self.k_offset.shape)
        reference = rotated_attention_reference(
            self.query, keys, cache_values(self.value_cache, self.v_scale), self.block_tables, self.seq_lens,
            self.cu_seqlens_q, self.softmax_scale, self.sliding_window, self.logits_soft_cap,
            None if self.fp8_math else kernel_product_dtype(self.key_cache), self.fp8_math)
        return add_output_rounding(reference, self.query.dtype)


def rotated_attention_reference(query, key_values, value_values, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
                                sliding_window=-1, logits_soft_cap=0.0, product_dtype=None,
                                fp8_math=False) -> AttentionReference:
    """Attention over a rotated cache and the bound on a correct kernel's error before the output's
    rounding. key_values / value_values: float64 caches of the stored values in the rotated basis (K
    with its offset added back). The query is rotated as the kernel rotates it (its fp32 rotation is
    specified exactly); attention runs in the rotated basis (reference.paged_attention_reference, whose
    bound covers everything from there to the unnormalized output) and is rotated back in float64.
    The bound: the rotated-basis bound spread by H (an output element mixes its block: sum over the
    block of |error| / sqrt(block)), plus the kernel's fp32 rotation of its output. fp8_math: the FP8
    math quantizes the rotated query; its bound (reference.fp8_math_error_bound) is added in the rotated
    basis."""
    rotated_query = rotate_float32(query.cpu()).to(key_values.device)
    args = (rotated_query, key_values, value_values, block_tables, seq_lens, cu_seqlens_q, softmax_scale,
            sliding_window, logits_soft_cap)
    rotated = paged_attention_reference(*args, product_dtype)
    rotated_bound = rotated.bound + fp8_math_error_bound(*args) if fp8_math else rotated.bound
    h = hadamard_matrix(query.shape[-1]).to(key_values.device)
    bound = rotated_bound @ h.abs() + rotation_error_bound(rotated.out.abs() + rotated_bound)
    return AttentionReference(rotated.out @ h, bound)


def make_rotated_inputs(*, seq_lens: list[int], q_lens: list[int] | None, num_heads: int, num_kv_heads: int,
                        head_size: int, block_size: int, cache_format: str, query_dtype: torch.dtype,
                        per_head_scales: bool, centred: bool, sliding_window: int = -1,
                        logits_soft_cap: float = 0.0, key_shift: float = 0.0, shared_outliers: float = 1.0,
                        seed: int = 0, device="cpu") -> tuple[RotatedInputs, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rotated-recipe problem: K/V (random, with outlier channels; K shifted by key_shift times a
    fixed per-head vector; four channels of both K and the query times shared_outliers, as the
    channels that carry real models' large logits) written with the reference's codes at every slot a
    query may see, NaN codes elsewhere. Scales are the transformed values' amax / max_finite; the
    offset (centred) is their mean. Returns the inputs, the unquantized K and V [n, H, D] at those
    slots, and the slots."""
    fmt = FORMAT_BY_NAME[cache_format]
    generator = torch.Generator().manual_seed(seed)
    decode = q_lens is None
    q_lens_or_one = [1] * len(seq_lens) if decode else q_lens
    tables, num_blocks, _, slots = paged_block_tables(seq_lens, q_lens_or_one, block_size, sliding_window, generator)
    key_cache, value_cache = allocate_caches(num_blocks, block_size, num_kv_heads, head_size, fmt.dtype, "NHD", device)
    fill_nan(key_cache)
    fill_nan(value_cache)
    slots = torch.cat(slots)
    key = random_kv(len(slots), num_kv_heads, head_size, generator)
    outlier_channels = torch.randperm(head_size, generator=generator)[:4]
    key[..., outlier_channels] *= shared_outliers
    key = key + key_shift * torch.randn(1, num_kv_heads, head_size, generator=generator)
    value = random_kv(len(slots), num_kv_heads, head_size, generator)
    rotated_key, rotated_value = rotate_float32(key), rotate_float32(value)
    k_offset = rotated_key.mean(0).float() if centred else None
    centred_key = rotated_key - k_offset if centred else rotated_key

    def scales(x):
        amax = x.abs().amax(dim=(0, 2)) if per_head_scales else x.abs().amax().view(1)
        return (amax / fmt.max_finite).float().clamp(min=1e-6)

    k_scale, v_scale = scales(centred_key), scales(rotated_value)
    blocks, offsets = slots // block_size, slots % block_size
    bits(key_cache)[blocks.to(device), offsets.to(device)] = stored_rotated(key, k_scale, fmt, k_offset).to(device)
    bits(value_cache)[blocks.to(device), offsets.to(device)] = stored_rotated(value, v_scale, fmt, None).to(device)
    num_query_tokens = sum(q_lens_or_one)
    query = torch.randn(num_query_tokens, num_heads, head_size, generator=generator)
    query[..., outlier_channels] *= shared_outliers
    query = query.to(query_dtype).to(device)
    cu_seqlens_q = None
    if not decode:
        cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    inputs = RotatedInputs(
        query=query, key_cache=key_cache, value_cache=value_cache, block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), cu_seqlens_q=cu_seqlens_q,
        softmax_scale=head_size**-0.5, k_scale=k_scale.to(device), v_scale=v_scale.to(device),
        k_offset=None if k_offset is None else k_offset.to(device), sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap)
    return inputs, key, value, slots
