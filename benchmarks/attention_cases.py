"""Model geometries, paged FP8 caches with random contents, the naive dequantize path, SDPA in each
of its forms, and float32 references: what the decode and prefill benchmarks share. Everything here
runs on CPU as well as CUDA.

Data: K and V are N(0, 1) and N(0, 4) after dequantization (codes = clamp(x / scale) in e4m3, with
power-of-two scales so that dequantizing in bf16 is exact), queries are N(0, 1) in bf16. Block
tables are a random permutation of the blocks. Cache slots past seq_len in a sequence's last page
hold NaN codes, as stale slots may in a serving engine: a kernel that lets them reach the output
produces NaN and fails the correctness check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import common

@dataclasses.dataclass(frozen=True)
class Model:
    """The attention geometry of one layer of a model (per GPU where it is tensor-parallel)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int


LLAMA3_8B = Model("Llama-3-8B", 32, 8, 128)  # GQA 4
LLAMA2_7B = Model("Llama-2-7B", 32, 32, 128)  # MHA
LLAMA3_70B_TP8 = Model("Llama-3-70B TP8", 8, 1, 128)  # 64/8 heads over 8 GPUs: MQA on each
LLAMA32_1B = Model("Llama-3.2-1B", 32, 8, 64)  # head 64
GEMMA3_12B = Model("Gemma-3-12B", 16, 8, 256)  # head 256 (a global-attention layer)
SMOLLM2_135M = Model("SmolLM2-135M", 9, 3, 64)  # 3 KV heads of 64: few, small rows

def tokens_text(tokens: int) -> str:
    """4096 -> "4k", for shape labels."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


CACHE_DTYPE = torch.float8_e4m3fn
QUERY_DTYPE = torch.bfloat16
K_SCALE, V_SCALE = 2.0**-6, 2.0**-5  # powers of two: code * scale is exact in bf16
NAN_CODE = 0x7F  # e4m3fn NaN
FLOAT32_CHUNK = 1 << 26  # elements of a float32 temporary (256 MiB): per randn call, per chunk of centred_recipe
REFERENCE_CHUNK_BYTES = 2 << 30  # float32 working set of one reference chunk


def random_codes(shape: tuple[int, ...], scale: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """e4m3 codes of N(0, 1) samples quantized with `scale` (saturating, round to nearest even)."""
    codes = torch.empty(shape, dtype=CACHE_DTYPE, device=device)
    flat = codes.view(-1)
    fmax = torch.finfo(CACHE_DTYPE).max
    for start in range(0, flat.numel(), FLOAT32_CHUNK):
        n = min(FLOAT32_CHUNK, flat.numel() - start)
        x = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        # Clamping before the cast keeps out-of-range values finite on every torch version.
        flat[start:start + n] = (x / scale).clamp_(-fmax, fmax).to(CACHE_DTYPE)
    return codes


@dataclasses.dataclass
class PagedCache:
    """One random FP8 paged cache in NHD and HND storage, as fp8kv's logical views
    [num_blocks, block_size, num_kv_heads, head_size]."""

    key_nhd: torch.Tensor
    value_nhd: torch.Tensor
    key_hnd: torch.Tensor
    value_hnd: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, max blocks per sequence]
    seq_lens: torch.Tensor  # int32 [batch]
    k_scale: torch.Tensor  # float32 [1]
    v_scale: torch.Tensor
    hadamard: bool = False  # the rotated recipe: K/V stored rotated by the block Hadamard matrix H
    k_offset: torch.Tensor | None = None  # float32 [num_kv_heads, head_size]: mu, taken from the rotated K

    @property
    def block_size(self) -> int:
        return self.key_nhd.shape[1]

    def layout(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return {"NHD": (self.key_nhd, self.value_nhd), "HND": (self.key_hnd, self.value_hnd)}[name]


def hnd_storage(cache: torch.Tensor) -> torch.Tensor:
    """The same logical cache stored head-major: [blocks, heads, block, dim] memory, permuted back."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def poison_tail(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> None:
    """Writes NaN codes into the slots past seq_len of each sequence's last page."""
    offset = seq_len % cache.shape[1]
    if offset:
        cache.view(torch.uint8)[block_tables[:, -1].long(), offset:] = NAN_CODE


def make_paged_cache(batch: int, seq_len: int, num_kv_heads: int, head_size: int, block_size: int,
                     gen: torch.Generator, device: torch.device) -> PagedCache:
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    block_tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32).view(batch, -1)
    key, value = random_codes(shape, K_SCALE, gen, device), random_codes(shape, V_SCALE, gen, device)
    for cache in (key, value):
        poison_tail(cache, block_tables, seq_len)
    return PagedCache(
        key_nhd=key, value_nhd=value, key_hnd=hnd_storage(key), value_hnd=hnd_storage(value),
        block_tables=block_tables,
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        k_scale=torch.tensor([K_SCALE], dtype=torch.float32, device=device),
        v_scale=torch.tensor([V_SCALE], dtype=torch.float32, device=device),
    )


def concatenate_caches(caches: list[PagedCache]) -> PagedCache:
    """One cache holding the sequences of several (a mixed batch): blocks appended in order, block
    tables offset to them and padded with block 0 past each sequence's last page (never read)."""
    offsets = [0]
    for cache in caches[:-1]:
        offsets.append(offsets[-1] + cache.key_nhd.shape[0])
    width = max(cache.block_tables.shape[1] for cache in caches)
    tables = [F.pad(cache.block_tables + offset, (0, width - cache.block_tables.shape[1]))
              for cache, offset in zip(caches, offsets)]
    key, value = (torch.cat([getattr(c, name) for c in caches]) for name in ("key_nhd", "value_nhd"))
    return PagedCache(key_nhd=key, value_nhd=value, key_hnd=hnd_storage(key), value_hnd=hnd_storage(value),
                      block_tables=torch.cat(tables), seq_lens=torch.cat([c.seq_lens for c in caches]),
                      k_scale=caches[0].k_scale, v_scale=caches[0].v_scale)


def gather_dequantize(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int,
                      scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The naive path's first half: gather each sequence's pages and convert them to bf16 (or dtype).

    Returns a [batch, num_kv_heads, seq_len, head_size] view (token-major memory)."""
    batch, blocks_per_seq = block_tables.shape
    _, block_size, num_kv_heads, head_size = cache.shape
    pages = cache.view(torch.uint8)[block_tables.reshape(-1).long()].view(cache.dtype)
    values = pages.to(dtype) * scale.to(dtype)
    values = values.reshape(batch, blocks_per_seq * block_size, num_kv_heads, head_size)[:, :seq_len]
    return values.transpose(1, 2)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_size] times the recipe's block Hadamard matrix H, fp8kv's torch version (imported
    here, not at the top: the baselines still run where fp8kv cannot be imported)."""
    from fp8kv.rotation import hadamard as fp8kv_hadamard

    return fp8kv_hadamard(x)


@dataclasses.dataclass(frozen=True)
class CentredRecipe:
    """The rotated + centred recipe's parameters for some K/V."""

    k_scale: torch.Tensor  # float32 [1]: amax(kH - mu) / max_finite
    v_scale: torch.Tensor  # float32 [1]: amax(vH) / max_finite
    k_offset: torch.Tensor  # float32 [num_kv_heads, head_size]: mu = mean(kH) per KV head and channel


def centred_recipe(key: torch.Tensor, value: torch.Tensor) -> CentredRecipe:
    """The recipe of K/V rows [tokens, num_kv_heads, head_size], in token chunks (bounded float32
    temporaries) and one pass, as calibration measures it: K's maximum from the per-channel extremes
    of kH, max_c max(max_c - mu_c, mu_c - min_c)."""
    tokens = max(1, FLOAT32_CHUNK // (key.shape[1] * key.shape[2]))
    sums, lows, highs, v_maxima = [], [], [], []
    for key_rows, value_rows in zip(key.split(tokens), value.split(tokens)):
        rotated_key = hadamard(key_rows.float())
        sums.append(rotated_key.sum(0, dtype=torch.float64))
        lows.append(rotated_key.amin(0))
        highs.append(rotated_key.amax(0))
        v_maxima.append(hadamard(value_rows.float()).abs().amax())
    mu = (torch.stack(sums).sum(0) / key.shape[0]).float()
    k_max = torch.maximum(torch.stack(highs).amax(0) - mu, mu - torch.stack(lows).amin(0)).amax()
    max_finite = torch.finfo(CACHE_DTYPE).max
    return CentredRecipe((k_max / max_finite).view(1), (torch.stack(v_maxima).amax() / max_finite).view(1), mu)


def cached_slots(cache: PagedCache) -> torch.Tensor:
    """int64 [tokens]: the slot (block * block_size + offset) of every cached token, sequence by sequence."""
    block_size = cache.block_size
    positions = torch.arange(cache.block_tables.shape[1] * block_size, device=cache.block_tables.device)
    slots = cache.block_tables.long().repeat_interleave(block_size, dim=1) * block_size + positions % block_size
    return slots[positions < cache.seq_lens[:, None]]


def dequantized_rows(codes: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 [len(slots), num_kv_heads, head_size]: the values at slots of an NHD cache (exact: the
    plain caches' scales are powers of two)."""
    rows = codes.view(torch.uint8).view(-1, *codes.shape[2:])[slots].view(codes.dtype)
    return rows.to(torch.bfloat16) * scale.to(torch.bfloat16)


def rotated_copy(ops, plain: PagedCache) -> PagedCache:
    """The plain cache's K/V stored again with the rotated + centred recipe: its values, in bf16 rows
    as a model's projections give them, written by fp8kv's reshape_and_cache with the recipe measured
    from them. The slots the write does not reach, those past seq_len, hold NaN codes as the plain
    cache's do. Same block tables and sequence lengths."""
    slots = cached_slots(plain)
    key = dequantized_rows(plain.key_nhd, slots, plain.k_scale)
    value = dequantized_rows(plain.value_nhd, slots, plain.v_scale)
    recipe = centred_recipe(key, value)
    key_cache, value_cache = (torch.full_like(c.view(torch.uint8), NAN_CODE).view(CACHE_DTYPE)
                              for c in (plain.key_nhd, plain.value_nhd))
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, recipe.k_scale, recipe.v_scale,
                          hadamard=True, k_offset=recipe.k_offset)
    return dataclasses.replace(plain, key_nhd=key_cache, value_nhd=value_cache, key_hnd=hnd_storage(key_cache),
                               value_hnd=hnd_storage(value_cache), k_scale=recipe.k_scale, v_scale=recipe.v_scale,
                               hadamard=True, k_offset=recipe.k_offset)


def original_basis(cache: PagedCache, block_tables: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V [batch, num_kv_heads, seq_len, head_size] that a rotated + centred cache's codes
    stand for, in the original basis: dequantized, K's offset added back, times H (its own inverse)."""
    key = gather_dequantize(cache.key_nhd, block_tables, seq_len, cache.k_scale, torch.float32)
    value = gather_dequantize(cache.value_nhd, block_tables, seq_len, cache.v_scale, torch.float32)
    return hadamard(key + cache.k_offset[:, None]), hadamard(value)


class RotatedCopy:
    """A case's rotated + centred copy of its plain cache and the float32 reference over it, made when
    a rotated column first needs them: fp8kv writes the copy, and where it refuses the recipe each
    rotated column records why while the plain columns still run."""

    def __init__(self, ops, plain: PagedCache, reference: Callable[[PagedCache], torch.Tensor]):
        self._ops, self._plain, self._reference = ops, plain, reference

    @functools.cached_property
    def cache(self) -> PagedCache:
        return rotated_copy(self._ops, self._plain)

    @functools.cached_property
    def reference(self) -> torch.Tensor:
        """reference(cache): the case's attention over the copy's values in the original basis."""
        return self._reference(self.cache)

    def check(self, out: torch.Tensor) -> dict:
        """measure()'s check of a rotated column: its own reference, not the plain cache's."""
        return {"rel_err": common.relative_error(out, self.reference)}


def bf16_paged_cache(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """The dequantized values in an unquantized (bf16) paged cache of the same geometry."""
    values = cache.to(torch.bfloat16)
    values.mul_(scale)
    return values


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH,
                 "default": None}  # None: torch's own choice among the backends


@dataclasses.dataclass(frozen=True)
class SdpaForm:
    """One way to call scaled_dot_product_attention on GQA K/V: a backend, and either enable_gqa over
    [B, Hkv, L, D] K/V or K/V expanded to the query heads (repeat_interleave) beforehand."""

    backend: str
    expanded: bool

    @property
    def name(self) -> str:
        """e.g. "SDPA flash" (K/V as cached, enable_gqa where grouped), "SDPA flash expanded"."""
        return f"SDPA {self.backend}" + (" expanded" if self.expanded else "")


def sdpa_forms(num_heads: int, num_kv_heads: int, backends=("flash", "efficient", "cudnn", "default")) -> list[SdpaForm]:
    """The candidate forms; expanded K/V only where they differ from the K/V (GQA, MQA)."""
    expansions = (False, True) if num_heads != num_kv_heads else (False,)
    return [SdpaForm(backend, expanded) for backend in backends for expanded in expansions]


def expand_heads(kv: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, Hkv, L, D] K or V repeated to [B, Hq, L, D] (query head h reads KV head h // group)."""
    return kv.repeat_interleave(num_heads // kv.shape[1], dim=1)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, softmax_scale: float,
         backend: str) -> torch.Tensor:
    """Causal (aligned to the end of the keys) attention with one SDPA backend, no fallback
    ("default": torch's dispatch).

    query [B, Hq, Lq, D], key/value [B, Hkv, L, D]; Lq = 1 is decode."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if q_len == 1:
        mask, is_causal = None, False
    elif q_len == kv_len:
        mask, is_causal = None, True
    else:
        mask, is_causal = causal_lower_right(q_len, kv_len), False
    chosen = sdpa_kernel([SDPA_BACKENDS[backend]]) if SDPA_BACKENDS[backend] else contextlib.nullcontext()
    with chosen, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # torch says why a backend refuses in warnings: keep them for the error
        try:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal,
                                                  scale=softmax_scale, enable_gqa=query.shape[1] != key.shape[1])
        except RuntimeError as exc:
            reasons = [str(w.message).split(" (Triggered internally")[0] for w in caught]
            message = " ".join([str(exc).strip()] + [f"({r})" for r in reasons if r.strip()])
            raise RuntimeError(message.replace("\n", " ")) from exc


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        softmax_scale: float) -> torch.Tensor:
    """float32 attention, causal aligned to the end of the keys, in batch chunks.

    query [B, Hq, Lq, D]; key/value [B, Hkv, L, D] (the exact dequantized cache values).
    Returns [B, Hq, Lq, D] float32."""
    batch, num_heads, q_len, head_size = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    visible = (torch.arange(kv_len, device=query.device)[None, :]
               <= (kv_len - q_len + torch.arange(q_len, device=query.device))[:, None])
    per_sequence = 4 * (num_heads * q_len * kv_len * 2 + 2 * num_kv_heads * kv_len * head_size)
    chunk = max(1, REFERENCE_CHUNK_BYTES // per_sequence)
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    for b in range(0, batch, chunk):
        q = query[b:b + chunk].float().reshape(-1, num_kv_heads, group * q_len, head_size)
        k, v = key[b:b + chunk].float(), value[b:b + chunk].float()
        logits = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale  # [b, Hkv, group * Lq, L]
        logits = logits.view(-1, num_kv_heads, group, q_len, kv_len).masked_fill(~visible, -math.inf)
        probs = torch.softmax(logits, dim=-1).view(-1, num_kv_heads, group * q_len, kv_len)
        out[b:b + chunk] = torch.matmul(probs, v).view(-1, num_heads, q_len, head_size)
    return out


def random_query(num_tokens: int, num_heads: int, head_size: int, gen: torch.Generator,
                 device: torch.device) -> torch.Tensor:
    return torch.randn(num_tokens, num_heads, head_size, generator=gen, device=device).to(QUERY_DTYPE)


def attention_flops(batch: int, q_len: int, seq_len: int, num_heads: int, head_size: int) -> int:
    """Multiply-adds x 2 of QK^T and PV over the causally visible keys (no masked work counted)."""
    visible_keys = q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
    return 4 * head_size * num_heads * batch * visible_keys
