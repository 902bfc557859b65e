"""Tensor-parallel continuous batching on fp8kv's pages against one process: the same greedy tokens.

    torchrun --nproc-per-node 2 scripts/check_tp_continuous_batching.py CHECKPOINT
    torchrun --nproc-per-node 2 scripts/check_tp_continuous_batching.py CHECKPOINT --kv-cache-dtype fp8_e4m3 \\
        --rotation none

On GPUs each rank takes the GPU of its LOCAL_RANK (NCCL); without CUDA the ranks run on the CPU (gloo).
Every rank loads CHECKPOINT (a transformers model with its KV cache scales) whole on its device and
generates with fp8kv's PagedCache + generate, one prompt at a time, then with `generate_batch` on
fp8kv's pages (one process: no tensor parallelism); then loads it with tp_plan="auto" and runs the
same `generate_batch`, enabled with the same whole-model KVCacheConfig, which fp8kv slices to the
rank's KV heads. Each rank prints one JSON line (its rank, the three token lists per prompt, the
largest difference of the log-probabilities between the two generate_batch runs) and exits with 1
where the tokens differ. Tensor parallelism sums the attention's output projection across ranks,
which rounds otherwise than one process: the log-probabilities may differ by a rounding, which a
near tie between two tokens could turn into another token (in a model of one layer the pages are
still those of one process bit for bit: only the layers after the first see the rounding), so a
difference is worth a look before it is called a bug. --rank-config enables the tensor-parallel
model with each rank's own KVCacheConfig instead (load_kv_cache_config with tp_rank, tp_size).
Exits with 3, printing {"refused": ...}, where transformers refuses to load the model tensor parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import transformers
from transformers import ContinuousBatchingConfig, DistributedConfig, GenerationConfig

from fp8kv import load_kv_cache_config
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable_continuous_batching


def prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def paged_cache_tokens(model, kv_cache, prompt: list[int], new_tokens: int, page: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0,
                         **cache_argument(model, PagedCache(kv_cache, max_tokens=len(prompt) + new_tokens,
                                                            block_size=page)))
    return out[0, len(prompt):].tolist()


def generate_batch(model, batch: list[list[int]], new_tokens: int, page: int) -> tuple[list, list]:
    """Tokens and log-probabilities per prompt, in prompt order."""
    outputs = model.generate_batch(
        batch, generation_config=GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                                  pad_token_id=0),
        # Steps of at most 32 tokens: longer prompts are prefilled in chunks, as a loaded server does. No CUDA
        # graphs, as the server runs (they have not been run on fp8kv's pages on a GPU yet).
        continuous_batching_config=ContinuousBatchingConfig(page_size=page, num_blocks=64, max_batch_tokens=32,
                                                            use_cuda_graph=False, return_logprobs=True))
    outputs = list(outputs.values())
    errors = [output.error for output in outputs if output.error is not None]
    if errors:
        raise RuntimeError(f"generate_batch failed: {errors[0]}")
    return [output.generated_tokens for output in outputs], [output.logprobs for output in outputs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    parser.add_argument("--rotation", default=None, help="none or hadamard (default: load_kv_cache_config's)")
    parser.add_argument("--prompt-lengths", default="5,20,40,23")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--rank-config", action="store_true",
                        help="enable the tensor-parallel model with the rank's KVCacheConfig (load_kv_cache_config "
                             "with tp_rank and tp_size) rather than the whole model's")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the machine's cores
    kv_cache = load_kv_cache_config(args.checkpoint, args.kv_cache_dtype, rotation=args.rotation)
    load = {"dtype": getattr(torch, args.dtype), "attn_implementation": "sdpa"}

    # One process: the whole model on this rank's device, before any process group exists.
    whole = transformers.AutoModelForCausalLM.from_pretrained(args.checkpoint, **load).to(device).eval()
    enable_continuous_batching(whole, kv_cache)  # fp8kv's attention, for PagedCache + generate too
    batch = prompts(whole.config.vocab_size, [int(n) for n in args.prompt_lengths.split(",")], args.seed)
    paged = [paged_cache_tokens(whole, kv_cache, prompt, args.new_tokens, args.page_size) for prompt in batch]
    one_tokens, one_logprobs = generate_batch(whole, batch, args.new_tokens, args.page_size)
    del whole

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.checkpoint, distributed_config=DistributedConfig(tp_plan="auto"), **load).eval()
    except Exception as e:  # transformers may refuse tensor parallelism here (e.g. on this device): say so
        print(json.dumps({"refused": f"{type(e).__name__}: {e}"}), flush=True)
        return 3
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if args.rank_config:
        kv_cache = load_kv_cache_config(args.checkpoint, args.kv_cache_dtype, rotation=args.rotation, tp_rank=rank,
                                        tp_size=torch.distributed.get_world_size())
    tp_tokens, tp_logprobs = generate_batch(enable_continuous_batching(model, kv_cache), batch, args.new_tokens,
                                            args.page_size)
    # Over the tokens both runs gave (after a differing token the texts differ).
    difference = 0.0
    for tp, one, tp_values, one_values in zip(tp_tokens, one_tokens, tp_logprobs, one_logprobs):
        same = next((i for i, (a, b) in enumerate(zip(tp, one)) if a != b), len(tp))
        difference = max([difference, *(abs(a - b) for a, b in zip(tp_values[:same + 1], one_values[:same + 1]))])
    report = json.dumps({"rank": rank, "device": str(device), "kv_cache": kv_cache.source, "recipe": kv_cache.recipe,
                         "tensor_parallel": tp_tokens, "one_process": one_tokens, "paged_cache": paged,
                         "max_logprob_difference": difference})
    # The ranks share one stdout, where print's two writes (line, newline) could interleave: one rank at a time.
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for turn in range(ranks):
        if turn == rank:
            print(report, flush=True)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if tp_tokens == one_tokens == paged else 1


if __name__ == "__main__":
    sys.exit(main())
