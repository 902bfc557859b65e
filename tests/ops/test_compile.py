"""torch.compile(fullgraph=True) of a step that writes a KVCacheLayer and attends over it (fp8kv.ops):
one graph (no break), no recompilation when only tensor values change, and the same bits as eager
(the compiled graph calls the same kernels)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import fp8kv
from fp8kv.formats import KVCacheDtype
from fp8kv.layer import KVCacheLayer
from fp8kv.rotation import Rotation
from reference import bits, make_paged_attention_inputs, random_kv


def step(key, value, slots, query, out, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
         k_scale, v_scale, sliding_window: int, logits_soft_cap: float):
    """Write this step's K/V, then attend over the cache (incl. them): the layer is made inside the
    compiled function, as PagedKVCache.layer makes it there."""
    layer = KVCacheLayer(KVCacheDtype.E4M3FN, key_cache, value_cache, k_scale, v_scale, Rotation.NONE, None)
    fp8kv.ops.reshape_and_cache(key, value, layer, slots)
    fp8kv.ops.paged_attention(out, query, layer, block_tables, seq_lens, cu_seqlens_q, query.shape[-1] ** -0.5,
                              sliding_window, logits_soft_cap)
    return out


def step_arguments(decode: bool, seed: int, device: str) -> tuple:
    """A batch of three sequences whose last 1 (decode) or 1/4/6 (multi-token) tokens are new:
    their K/V are written by the step, at the slots of their positions."""
    seq_lens, q_lens = [5, 19, 40], [1, 1, 1] if decode else [1, 4, 6]
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=None if decode else q_lens, num_heads=8, num_kv_heads=2, head_size=64,
        block_size=16, cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True,
        layout="HND", device=device, seed=seed)
    tables = inputs.block_tables.cpu().long()
    slots = torch.cat([tables[s, p // 16] * 16 + p % 16
                       for s, (n, q) in enumerate(zip(seq_lens, q_lens)) for p in [torch.arange(n - q, n)]])
    generator = torch.Generator().manual_seed(seed)
    key, value = (random_kv(len(slots), 2, 64, generator).to(torch.bfloat16).to(device) for _ in range(2))
    out = torch.empty_like(inputs.query)
    window, soft_cap = (-1, 0.0) if decode else (9, 4.0)
    return (key, value, slots.to(device), inputs.query, out, inputs.key_cache, inputs.value_cache,
            inputs.block_tables, inputs.seq_lens, inputs.cu_seqlens_q, inputs.k_scale, inputs.v_scale,
            window, soft_cap)


def clone_arguments(args: tuple) -> tuple:
    """Copies with the same strides (the permuted caches stay permuted)."""
    def clone(a):
        if not isinstance(a, torch.Tensor):
            return a
        copy = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        copy.copy_(a)
        return copy
    return tuple(clone(a) for a in args)


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "multi_token"])
def test_compiled_step_matches_eager(device, decode, fresh_dynamo):
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for seed in (0, 1):  # the second call has new values in tensors of the same shapes
        eager_args = step_arguments(decode, seed, device)
        compiled_args = clone_arguments(eager_args)
        step(*eager_args)
        compiled(*compiled_args)
        for name, index in (("out", 4), ("key_cache", 5), ("value_cache", 6)):
            assert torch.equal(bits(compiled_args[index]), bits(eager_args[index])), f"{name}, call {seed}"
    assert counter.frame_count == 1, "compiled once, as one graph"
    assert counter.op_count == 2, "the graph holds both ops"


def cache_step(cache, query, key, value, batch):
    """One layer's step through the PagedKVCache's layer, as the transformers integration compiles it."""
    out = torch.empty_like(query)
    layer = cache.layer(0)
    fp8kv.ops.reshape_and_cache(key, value, layer, batch.slot_mapping)
    fp8kv.ops.paged_attention(out, query, layer, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, 0.125)
    return out


def test_compiled_step_on_a_paged_cache_layer_keeps_its_recipe(device, fresh_dynamo):
    """A rotated + centred layer of a PagedKVCache, taken inside the compiled function: one graph, the
    same bits as eager, and a second step with new values replays it."""
    offsets = [(torch.randn(2, 64, generator=torch.Generator().manual_seed(3)) * 0.5).tolist()]
    config = fp8kv.KVCacheConfig("fp8_e4m3fn", [(0.02, 0.03)], [(0.01,)], k_offsets=offsets)
    caches = [fp8kv.PagedKVCache(config, num_kv_heads=2, head_size=64, num_blocks=8, device=device) for _ in range(2)]
    for cache in caches:
        torch._dynamo.mark_static_address(cache.storage)
        cache.add_sequence("a")
        cache.add_sequence("b")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(cache_step, backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    for new in ([5, 3], [1, 1]):
        batches = [cache.prepare(["a", "b"], new) for cache in caches]
        query = torch.randn(sum(new), 8, 64, generator=generator).to(torch.bfloat16).to(device)
        key, value = (random_kv(sum(new), 2, 64, generator).to(torch.bfloat16).to(device) for _ in range(2))
        eager = cache_step(caches[0], query, key, value, batches[0])
        traced = compiled(caches[1], query, key, value, batches[1])
        assert torch.equal(bits(traced), bits(eager))
        assert torch.equal(bits(caches[1].storage), bits(caches[0].storage))
    assert counter.frame_count == 2, "one graph per step shape (prefill, decode), no break"
