"""Decode through transformers at the speed of the kernels: the device-side batch plan
(`FixedBatch`), `generate` compiling the decode step of a `PagedCache` (one graph, never
recompiled per step; CUDA graphs on CUDA) with the same tokens as eager decode, and the storage
freed as soon as the cache goes, without the garbage collector."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from fp8kv.cache import CacheFullError, FixedBatch  # noqa: E402
from fp8kv.formats import KVCacheConfig  # noqa: E402
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable, new_tokens_mask  # noqa: E402
from test_transformers import PROMPT_LEN, prompt, tiny_model, ulp  # noqa: E402

STEPS = 24

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# ----------------------------------------------------------------------------- FixedBatch


def slot_of(batch: FixedBatch, seq: int, position: int) -> int:
    """The slot of a sequence's position, read through its block table (the ops' definition)."""
    block_size = batch.capacity // batch.block_tables.shape[1]
    return int(batch.block_tables[seq, position // block_size]) * block_size + position % block_size


def test_fixed_batch_plans_prefill_on_the_host_and_decode_on_the_device(device):
    batch = FixedBatch(3, blocks_per_seq=2, block_size=4, device=device)
    prefill = batch.extend([3, 0, 5])
    expected = [slot_of(batch, 0, p) for p in range(3)] + [slot_of(batch, 2, p) for p in range(5)]
    assert prefill.slot_mapping.tolist() == expected
    assert prefill.cu_seqlens_q.tolist() == [0, 3, 3, 8]
    assert batch.seq_lens.tolist() == [3, 0, 5]
    decode = batch.append_one(torch.tensor([True, False, True], device=device))
    assert decode is batch.decode_metadata and decode.cu_seqlens_q is None
    assert decode.slot_mapping.tolist() == [slot_of(batch, 0, 3), -1, slot_of(batch, 2, 5)]
    assert batch.seq_lens.tolist() == [4, 0, 6]
    batch.append_one()
    assert batch.slot_mapping.tolist() == [slot_of(batch, 0, 4), slot_of(batch, 1, 0), slot_of(batch, 2, 6)]
    assert batch.block_tables.unique().numel() == 6, "every sequence owns its own blocks"


def test_fixed_batch_decode_past_capacity_writes_nothing_and_is_reported(device):
    batch = FixedBatch(2, blocks_per_seq=1, block_size=4, device=device)
    batch.extend([4, 2])
    batch.append_one()
    assert batch.slot_mapping.tolist() == [-1, slot_of(batch, 1, 2)]
    assert batch.seq_lens.tolist() == [4, 3]
    with pytest.raises(CacheFullError, match="capacity of 4 tokens"):
        batch.raise_if_overflowed()
    with pytest.raises(CacheFullError, match="capacity of 4 tokens"):
        batch.extend([0, 1])
    batch.clear()
    batch.raise_if_overflowed()
    assert batch.seq_lens.tolist() == [0, 0]


def test_fixed_batch_decode_past_capacity_is_reported_for_real_tokens_only(device):
    batch = FixedBatch(3, blocks_per_seq=1, block_size=4, device=device)
    batch.extend([4, 4, 1])
    batch.append_one(torch.tensor([False, True, True], device=device))  # padding for the full sequence 0
    assert batch.slot_mapping.tolist() == [-1, -1, slot_of(batch, 2, 1)]
    assert batch.seq_lens.tolist() == [4, 4, 2]
    with pytest.raises(CacheFullError, match="capacity of 4 tokens"):  # sequence 1's real token
        batch.raise_if_overflowed()
    batch.clear()
    batch.extend([4, 0, 0])
    batch.append_one(torch.tensor([False, True, True], device=device))
    batch.raise_if_overflowed()  # the full sequence got padding only
    assert batch.seq_lens.tolist() == [4, 1, 1]


def test_fixed_batch_prefill_past_capacity_reserves_nothing():
    batch = FixedBatch(2, blocks_per_seq=2, block_size=4, device="cpu")
    batch.extend([5, 1])
    with pytest.raises(CacheFullError, match="sequence 1 holds 1 tokens and gets 8 more, past its capacity of 8"):
        batch.extend([1, 8])
    assert batch.seq_lens.tolist() == [5, 1]
    with pytest.raises(ValueError, match="3 token counts for a batch of 2"):
        batch.extend([1, 1, 1])


@pytest.mark.gpu
def test_fixed_batch_reports_a_decode_overflow_without_waiting_for_the_device():
    batch = FixedBatch(1, blocks_per_seq=1, block_size=4, device="cuda")
    batch.extend([4])
    batch.append_one()
    batch.raise_if_overflowed(wait=False)  # starts the copy of the flag; never waits for it
    torch.cuda.synchronize()
    with pytest.raises(CacheFullError):
        batch.raise_if_overflowed(wait=False)


# ----------------------------------------------------------------------------- compiled generate


@pytest.mark.parametrize("batch", [1, 3])
def test_new_tokens_mask_keeps_its_strides_as_the_context_grows(batch):
    # A view into the growing 2-D mask would change strides (or offset) at every step, and
    # torch.compile would then recompile the decode step with dynamic strides.
    masks = [new_tokens_mask(q_length=1, attention_mask=torch.ones(batch, context, dtype=torch.bool))
             for context in (5, 6)]
    assert [(m.shape, m.stride(), m.storage_offset()) for m in masks] == [((batch, 1), (1, 1), 0)] * 2
    padded = torch.tensor([[False, True, True], [False, False, True]])
    assert new_tokens_mask(q_length=2, attention_mask=padded).tolist() == [[True, True], [False, True]]
    assert new_tokens_mask(q_length=1, attention_mask=None) is None



def compile_config(backend: str | None = None) -> CompileConfig:
    """fullgraph: a graph break fails the test. `backend` None is generate's default (inductor,
    mode "reduce-overhead": CUDA graphs); otherwise no mode, and compiled on the CPU as well."""
    if backend is None:
        return CompileConfig(fullgraph=True)
    config = CompileConfig(fullgraph=True, backend=backend, mode=None)
    config._compile_all_devices = True
    return config


def run(model, ids, mask, cache, *, compiled: CompileConfig | None, sample_seed: int | None = None,
        steps: int = STEPS):
    """Tokens and logits of `generate` on `cache` (reset first): eager when `compiled` is None."""
    cache.reset()
    if sample_seed is not None:
        torch.manual_seed(sample_seed)
    compile_args = dict(disable_compile=True) if compiled is None else dict(compile_config=compiled)
    out = model.generate(ids, attention_mask=mask, **cache_argument(model, cache), max_new_tokens=steps,
                         do_sample=sample_seed is not None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, **compile_args)
    return out.sequences, torch.stack(out.logits).float()


def unambiguous_model(kind: str, device: str, allowed_ulps: float):
    """The first seed whose eager greedy decode on an unquantized PagedCache has a top-2 margin
    above twice `allowed_ulps` at every step: a compiled run within that tolerance then picks the
    same tokens."""
    for seed in range(64):  # about one seed in ten qualifies (a 32-token vocabulary keeps gaps wide)
        model = enable(tiny_model(kind, torch.float16, device, seed))
        ids, mask = prompt(device, seed)
        cache = PagedCache(KVCacheConfig.unit_scales("auto", 2), max_tokens=128, compileable=True)
        _, logits = run(model, ids, mask, cache, compiled=None)
        top2 = logits.topk(2, dim=-1).values
        if (top2[..., 0] - top2[..., 1]).min() > 2 * allowed_ulps * ulp(logits, torch.float16):
            return model, ids, mask, cache
    pytest.fail("no seed gives an unambiguous greedy baseline")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


# Inductor fuses each elementwise chain (RMSNorm, RoPE, SiLU * up, residual adds) and rounds its
# fp16 intermediates once, where eager rounds after every op; the reductions also sum in another
# order. Logits then move by a few ulps of the largest logit (measured on CPU, 32 steps, 3 models,
# greedy: <= 2 in fp16; bf16, whose ulp is 8x coarser, flips near-tied tokens). Allowed: 4.
# aot_eager traces and functionalizes the same graph but runs the eager ops: bit for bit equal.
INDUCTOR_ULPS = 4


@pytest.mark.parametrize("kind,backend", [("llama", "inductor"), ("qwen2", "aot_eager"), ("mistral", "aot_eager")])
def test_compiled_decode_gives_eager_tokens_and_compiles_once(kind, backend, fresh_dynamo):
    # Qwen2: one sliding-window layer (a dict of masks per layer type); Mistral: a 16-token window.
    model, ids, mask, cache = unambiguous_model(kind, "cpu", INDUCTOR_ULPS)
    config = compile_config(backend)
    eager_tokens, eager_logits = run(model, ids, mask, cache, compiled=None)
    tokens, logits = run(model, ids, mask, cache, compiled=config)
    assert graphs_compiled() == 1, "the decode step compiles once, then every step replays it"
    assert torch.equal(tokens, eager_tokens)
    if backend == "aot_eager":
        assert torch.equal(logits, eager_logits)
    else:
        assert (logits - eager_logits).abs().max() <= INDUCTOR_ULPS * ulp(eager_logits, torch.float16)
    for seed in (0, 1):
        eager_sampled, _ = run(model, ids, mask, cache, compiled=None, sample_seed=seed)
        sampled, _ = run(model, ids, mask, cache, compiled=config, sample_seed=seed)
        assert torch.equal(sampled, eager_sampled), f"sampled, seed {seed}"
    longer, _ = run(model, ids, mask, cache, compiled=config, steps=2 * STEPS)
    assert torch.equal(longer[:, :PROMPT_LEN + STEPS], eager_tokens)
    another = PagedCache(KVCacheConfig.unit_scales("auto", 2), max_tokens=128, compileable=True)
    assert torch.equal(run(model, ids, mask, another, compiled=config)[0], eager_tokens)
    assert graphs_compiled() == 1, "a reset cache, or another one, of the same batch size reuses the graph"
    if backend == "aot_eager":  # without padding generate may pass no mask: at most one more graph
        unpadded = ids[:1, :] if kind == "qwen2" else ids[:, 3:]
        eager_tokens, _ = run(model, unpadded, None, cache, compiled=None)
        tokens, _ = run(model, unpadded, None, cache, compiled=config)
        assert torch.equal(tokens, eager_tokens)
        # transformers 5.17 reuses the masked graph for some models where newer releases trace a second one.
        assert graphs_compiled() <= 2, "the unpadded decode compiles at most once more, not once per step"


def test_compiled_decode_past_capacity_raises(fresh_dynamo):
    # 2 sequences x 16 slots; the 9-token prompt fits, the 8th new token of row 0 does not. The
    # compiled step cannot raise: it caches nothing for the full row and sets a flag, which the
    # next step's mask creation reads without waiting.
    model = enable(tiny_model("llama", torch.float16, "cpu"))
    ids, mask = prompt("cpu")
    cache = PagedCache(KVCacheConfig.unit_scales("auto", 2), max_tokens=32, compileable=True)
    with pytest.raises(CacheFullError, match="at its capacity of 16 tokens"):
        run(model, ids, mask, cache, compiled=compile_config("aot_eager"))
    # Row 0 (9 tokens) stayed at its capacity; row 1 (6 after its padding) took the 8 decode steps
    # run before the next step's check (on the CPU the flag is read at once).
    assert cache.batch.seq_lens.tolist() == [16, 14]


def test_prefill_past_capacity_and_tiny_caches_are_refused():
    model = enable(tiny_model("llama", torch.float16, "cpu"))
    ids, mask = prompt("cpu")
    with pytest.raises(CacheFullError, match="sequence 0 holds 0 tokens and gets 9 more, past its capacity of 8"):
        model(ids, attention_mask=mask, **cache_argument(model, PagedCache(KVCacheConfig.unit_scales("auto", 2),
                                                                         max_tokens=16, block_size=8)))
    with pytest.raises(CacheFullError, match="cannot give each of 2 sequences a block"):
        model(ids, attention_mask=mask, **cache_argument(model, PagedCache(KVCacheConfig.unit_scales("auto", 2),
                                                                         max_tokens=16, block_size=16)))
    with pytest.raises(ValueError, match="max_tokens and block_size must be positive, got 0 and 16"):
        PagedCache(KVCacheConfig.unit_scales("auto", 2), max_tokens=0)


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.gpu
def test_cuda_graph_decode_gives_eager_tokens(fresh_dynamo):
    model, ids, mask, cache = unambiguous_model("llama", "cuda", INDUCTOR_ULPS)
    eager_tokens, eager_logits = run(model, ids, mask, cache, compiled=None)
    another = PagedCache(KVCacheConfig.unit_scales("auto", 2), max_tokens=128, compileable=True)
    # The first run records the graph, the second replays it; another cache has new tensors.
    for each_cache in (cache, cache, another):
        tokens, logits = run(model, ids, mask, each_cache, compiled=compile_config())
        assert torch.equal(tokens, eager_tokens)
        assert (logits - eager_logits).abs().max() <= INDUCTOR_ULPS * ulp(eager_logits, torch.float16)
    assert graphs_compiled() == 1
    assert not counters["inductor"]["cudagraph_skips"], "the decode step runs as a CUDA graph"


def decode_launches(num_layers: int) -> tuple[int, int]:
    """(kernels, CUDA graphs) launched from the host by 16 decode steps of a compiled generate:
    the launches of a 24-step run minus those of an 8-step run (the prefill, eager, launches
    kernels for every layer)."""
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = enable(transformers.LlamaForCausalLM(config).to(torch.float16).cuda().eval())
    ids, mask = prompt("cuda")
    cache = PagedCache(KVCacheConfig.unit_scales("auto", num_layers), max_tokens=128, compileable=True)
    run(model, ids, mask, cache, compiled=compile_config())  # compiles, records the graph
    counts = []
    for steps in (8, 24):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            run(model, ids, mask, cache, compiled=compile_config(), steps=steps)
        names = [event.name for event in profile.events()]
        counts.append((sum("LaunchKernel" in n for n in names), sum("GraphLaunch" in n for n in names)))
    return counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]


@pytest.mark.gpu
def test_decode_host_work_does_not_grow_with_the_layers(fresh_dynamo):
    # Eager decode launches a dozen kernels per layer and step; a replayed graph launches none, so
    # only generate's own per-step work is left (argmax, concatenations, stopping criteria, the
    # new-token mask: about 30 small kernels on transformers 5.17).
    (kernels_2, graphs_2), (kernels_6, graphs_6) = decode_launches(2), decode_launches(6)
    assert graphs_2 == graphs_6 == 16, "one graph replay per decode step"
    assert kernels_2 == kernels_6


# ----------------------------------------------------------------------------- freeing


@pytest.mark.parametrize("device,compiled", [("cpu", False), pytest.param("cuda", False, marks=pytest.mark.gpu),
                                             pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_storage_is_freed_with_the_cache_without_gc(device, compiled, fresh_dynamo):
    model = enable(tiny_model("llama", torch.float16, device))
    ids, mask = prompt(device)
    model(ids, attention_mask=mask, **cache_argument(model, PagedCache(KVCacheConfig.unit_scales("auto", 2),
                                                                     max_tokens=32)))
    gc.collect()  # the first forward's lasting allocations (e.g. cuBLAS workspaces) are behind us
    gc.disable()  # anything freed from here on is freed by reference counting alone
    try:
        baseline = torch.cuda.memory_allocated() if device == "cuda" else 0
        cache = PagedCache(KVCacheConfig.unit_scales("fp8_e4m3fn", 2), max_tokens=4096, compileable=compiled)
        tokens = model.generate(ids, attention_mask=mask, **cache_argument(model, cache), max_new_tokens=4,
                                do_sample=False,
                                pad_token_id=0, **(dict(compile_config=compile_config()) if compiled else {}))
        storage = weakref.ref(cache.paged.storage)
        del cache, tokens
        assert storage() is None, "the storage outlived the last reference to its cache"
        if device == "cuda" and not compiled:  # CUDA graphs keep a memory pool of their own
            assert torch.cuda.memory_allocated() == baseline
    finally:
        gc.enable()
