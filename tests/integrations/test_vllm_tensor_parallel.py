"""Tensor parallelism through vLLM: two ranks on vLLM's CPU platform (vLLM's multiprocessing
executor: the engine core and a worker process per rank, spawned, talking through gloo), on the
tiny random Llama of vllm_engines.py calibrated per KV head by fp8kv's calibrate, on the rotated +
centred recipe. Its 2 KV heads split one per rank: each rank must bind its own head's scales and K
offsets (load_kv_cache_config's slicing), and greedy tokens and log-probabilities follow fp8kv's
transformers integration on the whole model.
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm")

from near_ties import assert_equal_up_to_near_ties  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm_engines import Reference, engine, generated, require_test_platform, write_tiny_model  # noqa: E402

from fp8kv import load_kv_cache_config  # noqa: E402
from fp8kv.calibration import calibrate_checkpoint, make_batches  # noqa: E402
from fp8kv.checkpoint import shard_kv_cache_config  # noqa: E402

require_test_platform()

NEW_TOKENS = 16
NEAR_TIE, LOGPROB_TOLERANCE = 0.5, 0.15  # as test_vllm_engine.py's for FP8 caches, which says why


def bound_recipes(model) -> dict[str, list]:
    """On a worker: the rotated recipe each attention layer bound (scales and K offset, as lists)."""
    return {m.layer_name: [m.impl.rotated_layer.k_scale.tolist(), m.impl.rotated_layer.v_scale.tolist(),
                           m.impl.rotated_layer.k_offset.tolist()] for m in model.modules() if isinstance(m, Attention)}


def test_two_ranks_on_the_rotated_centred_recipe(tmp_path, monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("two ranks need two CPUs to bind their threads to")
    tiny = write_tiny_model(tmp_path / "tiny")
    generator = torch.Generator().manual_seed(5)
    calibration = make_batches([torch.randint(0, 256, (512,), generator=generator)], seq_len=256)
    calibrated = tmp_path / "calibrated"
    calibrate_checkpoint(tiny, calibration, calibrated, granularity="head", dtype=torch.bfloat16, progress=False)
    kv_cache = load_kv_cache_config(calibrated, "fp8_e4m3", rotation="hadamard")
    assert kv_cache.recipe == "rotated + centred" and len(kv_cache.k_scales[0]) == 2
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (40, 150, 7)]
    # vLLM binds each rank's threads to CPUs of its own NUMA node unless told which (one node here).
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}|{cpus[1]}")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends bound_recipes to the workers
    with engine(calibrated, kv_cache_dtype="fp8", tensor_parallel_size=2, distributed_executor_backend="mp",
                additional_config={"fp8kv_rotation": "hadamard"}) as llm:
        outputs = generated(llm, prompts, NEW_TOKENS, logprobs=0)
        bound = llm.apply_model(bound_recipes)
    for rank, recipes in enumerate(bound):
        expected = shard_kv_cache_config(kv_cache, rank, 2)
        assert sorted(recipes) == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        for layer in range(2):
            k_scale, v_scale, k_offset = recipes[f"model.layers.{layer}.self_attn.attn"]
            assert (k_scale, v_scale) == (list(expected.k_scales[layer]), list(expected.v_scales[layer]))
            assert torch.equal(torch.tensor(k_offset), expected.k_offset(layer))
    assert bound[0] != bound[1]
    reference = Reference(calibrated, kv_cache)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert_equal_up_to_near_ties([reference.greedy(p, NEW_TOKENS) for p in prompts], tokens, NEAR_TIE)
    for prompt, output, generated_tokens in zip(prompts, outputs, tokens):
        logprobs = [step[t].logprob for step, t in zip(output.outputs[0].logprobs, generated_tokens)]
        reference.assert_followed(prompt, generated_tokens, logprobs, NEAR_TIE, LOGPROB_TOLERANCE)
