"""Whole vLLM engines on fp8kv's attention backend: vLLM's `LLM` with `attention_backend="FP8KV"`,
its engine core in its own process (spawned, vLLM's default layout), scheduler, KV-cache manager,
CPU model runner and sampler, on a tiny random Llama (vllm_engines.py), on vLLM's CPU platform.

A batch of prompts of different lengths, one prefilled in chunks, in a KV cache small enough that
vLLM preempts requests, then prompts sharing a cached prefix, on every cache dtype; greedy tokens
against transformers' on the same model up to near ties of transformers' logits: the auto cache
against transformers' own attention, the FP8 caches against fp8kv's transformers integration on the
same cache format, recipe and scales (fp8kv's default rotated recipe with unit scales, what fp8kv
reads from a checkpoint without scales).
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from near_ties import assert_equal_up_to_near_ties  # noqa: E402
from vllm_engines import Reference, engine, generated, metric, require_test_platform, write_tiny_model  # noqa: E402

from fp8kv.formats import KVCacheConfig  # noqa: E402

require_test_platform()

NEW_TOKENS = 24
BLOCK, NUM_BLOCKS = 16, 17  # 16 blocks of KV cache: vLLM keeps block 0 as its null block
MAX_STEP_TOKENS = 64
# transformers' bf16 logits and vLLM's differ by roundings (a bf16 unit of a logit between 4 and 8 is
# 1/32); on FP8 pages a rounding of K or V in bf16 may also move its FP8 code by one step.
NEAR_TIE = {"auto": 0.125, "fp8": 0.5, "fp8_e5m2": 0.5}
# Measured at most 0.09 on every cache dtype, and an FP8 engine's log-probabilities differ from the
# auto cache's by 0.28 or more (e4m3) and 0.34 or more (e5m2) on each request: the bound tells the
# cache formats apart.
LOGPROB_TOLERANCE = 0.15
FORMAT = {"fp8": "e4m3", "fp8_e5m2": "e5m2"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def references(tiny) -> dict:
    """The reference of each cache dtype: transformers' own attention for auto, fp8kv's transformers
    integration on the default rotated recipe with unit scales (fp8kv's for a checkpoint without scales) for FP8."""
    return {"auto": Reference(tiny), **{name: Reference(tiny, KVCacheConfig.unit_scales(fmt, 2))
                                        for name, fmt in FORMAT.items()}}


def prompts(lengths, seed: int, prefix=()) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_generate_with_chunked_prefill_prefix_caching_and_preemption(tiny, references, kv_cache_dtype):
    """Two batches on 16 blocks of 16 tokens, at most 64 tokens a step. The first: a 40-token prompt
    and a 150-token one, prefilled in three chunks. The second: two prompts that start with the
    first prompt's two whole blocks (cached by then), and two of 60 tokens; vLLM admits all four (13
    blocks), and their decodes outgrow the cache (19 blocks), so vLLM preempts one and computes it again."""
    first = prompts([40, 150], seed=1)
    second = prompts([20, 5], seed=2, prefix=first[0][:2 * BLOCK]) + prompts([60, 60], seed=3)
    with engine(tiny, kv_cache_dtype=kv_cache_dtype, block_size=BLOCK, num_gpu_blocks_override=NUM_BLOCKS,
                max_model_len=(NUM_BLOCKS - 1) * BLOCK, max_num_batched_tokens=MAX_STEP_TOKENS,
                enable_prefix_caching=True, disable_log_stats=False) as llm:
        outputs = generated(llm, first, NEW_TOKENS, logprobs=0)
        assert metric(llm, "vllm:num_preemptions") == 0
        outputs += generated(llm, second, NEW_TOKENS, logprobs=0)
        assert metric(llm, "vllm:num_preemptions") > 0
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 2 * BLOCK, 2 * BLOCK, 0, 0]
    reference = references[kv_cache_dtype]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    expected = [reference.greedy(p, NEW_TOKENS) for p in first + second]
    assert_equal_up_to_near_ties(expected, tokens, NEAR_TIE[kv_cache_dtype])
    for prompt, output, generated_tokens in zip(first + second, outputs, tokens):
        logprobs = [step[t].logprob for step, t in zip(output.outputs[0].logprobs, generated_tokens)]
        reference.assert_followed(prompt, generated_tokens, logprobs, NEAR_TIE[kv_cache_dtype], LOGPROB_TOLERANCE)
