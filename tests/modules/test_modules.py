"""PagedKVCache, its block allocator, its KVCacheLayers, and PagedAttention (writes and attention)
against float64 references built in the test."""

import math
import random

import pytest
import torch

import fp8kv
from fp8kv.attention import PagedAttention
from fp8kv.cache import BlockAllocator, CacheFullError, PagedKVCache, bytes_per_token, capacity_report
from fp8kv.formats import KVCacheConfig, KVCacheDtype
from fp8kv.rotation import Rotation
from reference import (AttentionReference, add_output_rounding, assert_within, kernel_product_dtype,
                       paged_attention_reference)
from rotated_reference import hadamard_matrix, rotated_attention_reference

# Tiny models and tensors: one CPU thread (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
FORMATS = list(KVCacheDtype)


# ----------------------------------------------------------------------------- allocator


def test_allocator_hands_out_slots_block_by_block():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    allocator.add("a")
    allocator.add("b")
    assert allocator.extend(["a", "b"], [5, 2]) == [[0, 1, 2, 3, 4], [8, 9]]
    assert allocator.extend(["a", "b"], [1, 3]) == [[5], [10, 11, 12]]
    assert allocator.blocks("a") == [0, 1] and allocator.blocks("b") == [2, 3]
    assert allocator.length("a") == 6 and allocator.length("b") == 5
    assert allocator.num_free_blocks == 0


def test_allocator_slots_follow_the_block_table():
    allocator = BlockAllocator(num_blocks=6, block_size=3)
    allocator.add(0)
    allocator.add(1)
    slots = {0: [], 1: []}
    for counts in ([2, 4], [3, 1], [1, 1], [0, 2]):
        for seq, new in zip((0, 1), allocator.extend([0, 1], counts)):
            slots[seq] += new
    for seq in (0, 1):
        table = allocator.blocks(seq)
        # Reference: position p lives in block table[p // 3] at offset p % 3.
        assert slots[seq] == [table[p // 3] * 3 + p % 3 for p in range(allocator.length(seq))]
    assert sorted(allocator.blocks(0) + allocator.blocks(1)) == list(range(len(allocator.blocks(0) + allocator.blocks(1))))


def test_allocator_is_all_or_nothing_when_full():
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    allocator.add("a")
    allocator.add("b")
    allocator.extend(["a"], [3])
    with pytest.raises(CacheFullError, match="needs 2 more blocks of 2 tokens but only 1 of 3 are free"):
        allocator.extend(["a", "b"], [1, 3])
    assert allocator.length("a") == 3 and allocator.length("b") == 0 and allocator.num_free_blocks == 1
    allocator.free("a")
    assert allocator.num_free_blocks == 3
    assert allocator.extend(["b"], [6]) == [[4, 5, 0, 1, 2, 3]]  # freed blocks are reused after the unused one


@pytest.mark.parametrize("call, error, message", [
    (lambda a: a.extend(["x"], [1]), KeyError, "unknown sequence 'x'"),
    (lambda a: a.add("a"), ValueError, "already exists"),
    (lambda a: a.extend(["a"], [-1]), ValueError, "must be >= 0"),
    (lambda a: a.extend(["a", "a"], [1, 1]), ValueError, "more than once"),
    (lambda a: a.extend(["a"], [1, 2]), ValueError, "1 sequences but 2 token counts"),
    (lambda a: a.free("x"), KeyError, "unknown sequence"),
])
def test_allocator_errors(call, error, message):
    allocator = BlockAllocator(num_blocks=2, block_size=2)
    allocator.add("a")
    with pytest.raises(error, match=message):
        call(allocator)


# ----------------------------------------------------------------------------- cache


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_cache_tensors(fmt, layout, model_dtype):
    cache = PagedKVCache(fmt, num_layers=3, num_kv_heads=2, head_size=8, num_blocks=5, block_size=4,
                         model_dtype=model_dtype, layout=layout, rotation="none")
    expected_dtype = model_dtype if fmt is KVCacheDtype.UNQUANTIZED else fmt.storage_dtype
    for layer in range(3):
        key, value = cache.layer(layer).key_cache, cache.layer(layer).value_cache
        assert key.shape == value.shape == (5, 4, 2, 8) and key.dtype == expected_dtype
        assert key.stride(-1) == 1
        # HND keeps each head's tokens together: the head stride is block_size * head_size.
        assert key.stride(2) == (4 * 8 if layout == "HND" else 8)
        # Views of the one storage (made once, handed out at every call): writes through them are the cache's.
        assert (key.data_ptr(), value.data_ptr()) == (cache.storage[layer, 0].data_ptr(),
                                                      cache.storage[layer, 1].data_ptr())
        assert cache.layer(layer) is cache.layer(layer)
    element = 2 if fmt is KVCacheDtype.UNQUANTIZED else 1
    assert cache.memory_bytes == 3 * 2 * 5 * 4 * 2 * 8 * element
    assert cache.memory_bytes == cache.capacity_tokens * bytes_per_token(3, 2, 8, expected_dtype)


def test_capacity_report():
    report = capacity_report(1.0, num_layers=32, num_kv_heads=8, head_size=128, model_dtype=torch.bfloat16)
    bf16_tokens = 2**30 // (2 * 32 * 8 * 128 * 2)  # 8192: a whole number of 16-token blocks
    assert report[KVCacheDtype.UNQUANTIZED] == bf16_tokens == 8192
    assert report[KVCacheDtype.E4M3FN] == report[KVCacheDtype.E5M2] == report[KVCacheDtype.E4M3FNUZ] == 2 * bf16_tokens
    assert capacity_report(0.001, 32, 8, 128, torch.bfloat16)[KVCacheDtype.E4M3FN] % 16 == 0


def test_prepare_builds_the_index_tensors():
    cache = PagedKVCache("auto", num_layers=1, num_kv_heads=1, head_size=8, num_blocks=8, block_size=2)
    cache.add_sequence("a")
    cache.add_sequence("b")
    batch = cache.prepare(["a", "b"], [3, 1])
    assert batch.slot_mapping.dtype == torch.int64 and batch.slot_mapping.tolist() == [0, 1, 2, 4]
    assert batch.block_tables.dtype == torch.int32 and batch.block_tables.tolist() == [[0, 1], [2, 0]]
    assert batch.seq_lens.dtype == torch.int32 and batch.seq_lens.tolist() == [3, 1]
    assert batch.cu_seqlens_q.dtype == torch.int32 and batch.cu_seqlens_q.tolist() == [0, 3, 4]
    decode = cache.prepare(["a", "b"], [1, 1])
    assert decode.cu_seqlens_q is None and decode.seq_lens.tolist() == [4, 2] and decode.slot_mapping.tolist() == [3, 5]
    assert cache.seq_len("a") == 4


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="NDH"), "layout must be one of"),
    (dict(model_dtype=torch.float32), "model_dtype must be float16 or bfloat16"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(num_blocks=0), "num_blocks and block_size must be positive"),
])
def test_cache_argument_errors(kwargs, message):
    arguments = {**dict(num_layers=1, num_kv_heads=1, head_size=8, num_blocks=2), **kwargs}
    with pytest.raises(ValueError, match=message):
        PagedKVCache("fp8_e4m3fn", **arguments)


def test_cache_from_config_takes_its_layer_count():
    cache = PagedKVCache(KVCacheConfig.unit_scales("fp8_e5m2", 5), num_kv_heads=1, head_size=16, num_blocks=2)
    assert cache.num_layers == 5 and cache.dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="num_layers=4 but the KVCacheConfig has 5 layers"):
        PagedKVCache(KVCacheConfig.unit_scales("fp8_e5m2", 5), num_layers=4, num_kv_heads=1, head_size=8, num_blocks=2)


# ----------------------------------------------------------------------------- attention


def reference_dequantize(x: torch.Tensor, scale: torch.Tensor, fmt: KVCacheDtype, offset=None) -> torch.Tensor:
    """What the cache holds for `x` (already rotated and centred for those recipes: `offset` is then
    added back), in float64: x / s in float32, rounded to nearest even in the FP8 format (these inputs
    stay inside its range, where torch's conversion is exact RNE), times s."""
    if fmt is KVCacheDtype.UNQUANTIZED:
        return x.double()
    s = scale.float()[:, None]
    values = (x.float() / s).to(fmt.storage_dtype).double() * s.double()
    return values if offset is None else values + offset.double()


def stored_basis(x: torch.Tensor, recipe: str, offset=None) -> torch.Tensor:
    """x as the recipe stores it before the division by its scale (float32, the kernels' arithmetic)."""
    if recipe == "plain":
        return x.float()
    from rotated_reference import rotate_float32
    rotated = rotate_float32(x)
    return rotated if offset is None else rotated - offset


def reference_attention(q, keys, values, softmax_scale, num_cached):
    """float64 causal attention of q [n, Hq, D] (the last n of num_cached tokens) over keys/values
    [num_cached, Hkv, D]."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * softmax_scale
    n = q.shape[0]
    visible = torch.arange(num_cached)[None, :] <= (num_cached - n + torch.arange(n))[:, None]
    logits = logits.masked_fill(~visible, -math.inf)
    return torch.einsum("hqk,khd->qhd", logits.softmax(-1), v)


def kernel_error_bound(q, keys, values, softmax_scale, product_dtype, model_dtype) -> torch.Tensor:
    """float64 bound on |kernel - reference_attention(q, keys, values, ...)| for a kernel that
    rounds q and the probabilities P to product_dtype for its matrix products: the op suite's
    bound (derived in reference.paged_attention_reference) with this sequence's K/V [n, Hkv, D]
    as one cache block, plus the output's rounding to model_dtype."""
    num_cached, num_new = keys.shape[0], q.shape[0]
    bound = paged_attention_reference(q, keys[None], values[None], torch.zeros(1, 1, dtype=torch.int32),
                                      torch.tensor([num_cached]), torch.tensor([0, num_new]), softmax_scale,
                                      product_dtype=product_dtype)
    return add_output_rounding(bound, model_dtype).bound


def _scales(per_head, num_kv_heads, base, fmt):
    if fmt is KVCacheDtype.UNQUANTIZED:
        return (1.0,)
    return tuple(base * (1 + 0.5 * h) for h in range(num_kv_heads)) if per_head else (base,)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", ["plain", "rotated", "centred"])
def test_paged_attention_over_steps_matches_float64_reference(device, fmt, layout, num_heads, num_kv_heads,
                                                             per_head, model_dtype, recipe):
    if recipe != "plain" and not fmt.is_fp8:
        pytest.skip("an unquantized cache has the plain recipe only")
    # Head size 64 and 8-token blocks: supported by the CUDA kernels too; sequences span several blocks.
    head_size, block_size, num_layers = 64, 8, 2
    generator = torch.Generator().manual_seed(0)
    # Scales put |x / s| up to ~4 / 0.02 = 200: inside every format's range, e4m3fnuz's 240 included
    # (rotated values keep the norm of a row, and rarely exceed the plain maximum by much).
    offsets = None
    if recipe == "centred":
        offsets = [0.5 * torch.randn(num_kv_heads, head_size, generator=generator) for _ in range(num_layers)]
    config = KVCacheConfig(fmt, [_scales(per_head, num_kv_heads, 0.02 * (layer + 1), fmt) for layer in range(num_layers)],
                           [_scales(per_head, num_kv_heads, 0.03, fmt) for _ in range(num_layers)],
                           rotation="none" if recipe == "plain" else "hadamard", k_offsets=offsets)
    cache = PagedKVCache(config, num_kv_heads=num_kv_heads, head_size=head_size, num_blocks=12,
                         block_size=block_size, model_dtype=model_dtype, device=device, layout=layout)
    layers = [PagedAttention(num_heads, num_kv_heads, head_size) for _ in range(num_layers)]
    seqs = ["a", "b", "c"]
    for s in seqs:
        cache.add_sequence(s)
    history = {(s, layer): ([], []) for s in seqs for layer in range(num_layers)}
    # Prefill, a chunked continuation (one sequence with no new tokens), then decode steps.
    steps = [[5, 9, 1], [3, 0, 4], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    # Tolerance. CPU: the kernel accumulates in fp32 from the same dequantized inputs as the
    # float64 reference, then rounds once to the model dtype: half an ulp, 2^-9 (bf16) or 2^-12
    # (fp16) relative; rtol is twice that, atol covers outputs near zero.
    # CUDA: the tensor-core kernel also rounds P to fp16 (bf16 for a bf16 cache) before P.V and
    # converts q to it (docs/cuda_decode_design.md). P's rounding moves each weight by up to
    # 2^-11 (2^-9) relative, so an element may be off by ~2^-10 (2^-8) of sum_j w_j |v_j|, which
    # exceeds rtol * |out| wherever the weighted values cancel; kernel_error_bound is the op
    # suite's per-element bound for exactly these roundings.
    rtol = 2**-8 if model_dtype == torch.bfloat16 else 2**-11
    product_dtype = kernel_product_dtype(cache.layer(0).key_cache)  # None on CPU: fp32 throughout
    for counts in steps:
        batch = cache.prepare(seqs, counts)
        total = sum(counts)
        for layer, module in enumerate(layers):
            q = torch.randn(total, num_heads, head_size, generator=generator).to(model_dtype)
            k = torch.randn(total, num_kv_heads, head_size, generator=generator).to(model_dtype)
            v = torch.randn(total, num_kv_heads, head_size, generator=generator).to(model_dtype)
            out = module(q.to(device), k.to(device), v.to(device), cache.layer(layer), batch).cpu()
            start = 0
            offset = config.k_offset(layer)
            for s, n in zip(seqs, counts):
                keys, values = history[(s, layer)]
                keys.append(reference_dequantize(stored_basis(k[start:start + n], recipe, offset), config.k_scale(layer),
                                                  fmt, offset))
                values.append(reference_dequantize(stored_basis(v[start:start + n], recipe), config.v_scale(layer), fmt))
                if n and recipe != "plain":
                    # The cache holds the rotated values: attention in the rotated basis, rotated back.
                    reference = rotated_attention_reference(
                        q[start:start + n], torch.cat(keys)[None], torch.cat(values)[None],
                        torch.zeros(1, 1, dtype=torch.int32), torch.tensor([cache.seq_len(s)]), torch.tensor([0, n]),
                        head_size**-0.5, product_dtype=product_dtype)
                    assert_within(out[start:start + n], add_output_rounding(reference, model_dtype),
                                  f"sequence {s}, layer {layer}, {counts} new tokens")
                elif n:
                    ref = reference_attention(q[start:start + n], torch.cat(keys), torch.cat(values),
                                              head_size**-0.5, cache.seq_len(s))
                    if product_dtype is None:
                        torch.testing.assert_close(out[start:start + n].double(), ref, rtol=rtol, atol=1e-5)
                    else:
                        bound = kernel_error_bound(q[start:start + n], torch.cat(keys), torch.cat(values),
                                                   head_size**-0.5, product_dtype, model_dtype)
                        assert_within(out[start:start + n], AttentionReference(ref, bound),
                                      f"sequence {s}, layer {layer}, {counts} new tokens")
                start += n
    # The cache holds exactly the reference's dequantized values, at the slots of the block table.
    key_cache = cache.layer(1).key_cache
    table = cache.allocator.blocks("b")
    stored = torch.stack([key_cache[table[p // block_size], p % block_size] for p in range(cache.seq_len("b"))]).cpu()
    scale = config.k_scale(1)[:, None] if fmt.is_fp8 else torch.ones(1, 1)
    offset = config.k_offset(1)
    expected = torch.cat(history[("b", 1)][0]) - (0 if offset is None else offset.double())
    assert torch.equal(stored.double() * scale.double(), expected)


def test_a_layer_carries_its_configs_recipe_and_scales():
    """Each layer holds its KVCacheConfig's scales and K offsets as the ops take them, on the cache's
    device, and the attention reads them unchanged."""
    offsets = [torch.full((2, 16), 0.5).tolist(), torch.full((2, 16), -0.25).tolist()]
    config = KVCacheConfig("fp8_e4m3fn", [(0.5, 0.25), (2.0,)], [(0.125,), (1.0, 4.0)], k_offsets=offsets)
    cache = PagedKVCache(config, num_kv_heads=2, head_size=16, num_blocks=4)
    first, second = cache.layer(0), cache.layer(1)
    assert first.k_scale.tolist() == [0.5, 0.25] and first.v_scale.tolist() == [0.125]
    assert second.k_scale.tolist() == [2.0] and second.v_scale.tolist() == [1.0, 4.0]
    assert torch.equal(second.k_offset, torch.full((2, 16), -0.25)) and second.hadamard
    assert first.recipe == "rotated + centred" and first.kv_cache_dtype is KVCacheDtype.E4M3FN
    cache.add_sequence(0)
    x = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    PagedAttention(4, 2, 16)(torch.randn(3, 4, 16, dtype=torch.bfloat16), x, x, first, cache.prepare([0], [3]))
    assert first.k_scale.tolist() == [0.5, 0.25] and torch.equal(first.k_offset, torch.full((2, 16), 0.5))


@pytest.mark.parametrize("kv_cache, rotation, expected", [
    ("fp8_e4m3fn", None, Rotation.HADAMARD), ("fp8_e5m2", "none", Rotation.NONE), ("auto", None, Rotation.NONE),
    (KVCacheConfig.unit_scales("fp8_e4m3fn", 1), None, Rotation.HADAMARD),
    (KVCacheConfig.unit_scales("fp8_e4m3fn", 1, rotation="none"), None, Rotation.NONE),
])
def test_fp8_caches_are_rotated_by_default(kv_cache, rotation, expected):
    cache = PagedKVCache(kv_cache, num_layers=None if isinstance(kv_cache, KVCacheConfig) else 1, num_kv_heads=2,
                         head_size=64, num_blocks=1, rotation=rotation)
    assert cache.rotation is expected and cache.layer(0).rotation is expected


def cache_of(kv_cache, head_size=64, num_kv_heads=2, **kwargs):
    return PagedKVCache(kv_cache, num_kv_heads=num_kv_heads, head_size=head_size, num_blocks=1, **kwargs)


def test_layer_and_module_argument_errors():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedAttention(3, 2, 8)
    with pytest.raises(TypeError, match="fp8_math must be True or False"):
        PagedAttention(2, 2, 8, fp8_math="yes")
    with pytest.raises(ValueError, match=r"k_scales\[0\] has 3 values; expected 1 or num_kv_heads=2"):
        cache_of(KVCacheConfig("fp8_e4m3fn", [(1.0, 1.0, 1.0)], [(1.0,)], rotation="none"))
    with pytest.raises(ValueError, match="needs a head size divisible by 16.*got 40; use rotation='none'"):
        cache_of("fp8_e4m3fn", head_size=40, num_layers=1)
    with pytest.raises(ValueError, match="an unquantized cache stores K/V as they are; rotation must be 'none'"):
        cache_of("auto", num_layers=1, rotation="hadamard")
    with pytest.raises(ValueError, match="a KVCacheConfig carries its own recipe"):
        cache_of(KVCacheConfig.unit_scales("fp8_e4m3fn", 1), rotation="none")
    offsets = [torch.zeros(3, 64)]
    with pytest.raises(ValueError, match=r"k_offsets\[0\] has shape \[3, 64\]; expected \[num_kv_heads, head_size\] = \[2, 64\]"):
        cache_of(KVCacheConfig("fp8_e4m3fn", [(1.0,)], [(1.0,)], k_offsets=offsets))


@pytest.mark.parametrize("seed", range(4))
def test_cache_steps_produce_indices_the_ops_accept(seed):
    """Every slot and table PagedKVCache.prepare hands out is in range by construction: random add,
    prefill, decode and free steps, each checked by the ops' own index checks; live slots are distinct."""
    rng = random.Random(seed)
    cache = PagedKVCache("fp8_e4m3", num_kv_heads=1, head_size=64, num_blocks=12, num_layers=1,
                               block_size=rng.choice((1, 4, 16)))
    layer = cache.layer(0)
    live, next_id, owner = [], 0, {}
    for _ in range(60):
        if live and rng.random() < 0.2:
            cache.free_sequence(live.pop(rng.randrange(len(live))))
            continue
        if not live or rng.random() < 0.3:
            cache.add_sequence(next_id)
            live.append(next_id)
            next_id += 1
        batch = rng.sample(live, rng.randint(1, len(live)))
        counts = [rng.choice((1, 1, 3, 7)) for _ in batch]
        try:
            meta = cache.prepare(batch, counts)
        except CacheFullError:
            continue
        fp8kv.ops.check_cache_write_indices(meta.slot_mapping, layer)
        fp8kv.ops.check_paged_attention_indices(meta.block_tables, meta.seq_lens, meta.cu_seqlens_q,
                                                meta.num_tokens, layer)
        for slot, seq in zip(meta.slot_mapping.tolist(), [s for s, n in zip(batch, counts) for _ in range(n)]):
            assert owner.get(slot, seq) == seq or owner[slot] not in live, f"slot {slot} handed to two live sequences"
            owner[slot] = seq
