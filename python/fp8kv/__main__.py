"""Command line: `python -m fp8kv demo`."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    """A small end-to-end run of the ops: write a cache in FP8, attend over it, compare with bf16."""
    import math
    import time

    import torch

    from . import ops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    num_seqs, context, num_heads, num_kv_heads, head_size, block_size = 4, 1024, 32, 8, 128, 16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    key = torch.randn(num_seqs * context, num_kv_heads, head_size, dtype=torch.bfloat16, device=device)
    value = torch.randn_like(key)
    query = torch.randn(num_seqs, num_heads, head_size, dtype=torch.bfloat16, device=device)
    block_tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(num_seqs, blocks_per_seq)
    positions = torch.arange(context, device=device)
    slots = (block_tables.long()[:, positions // block_size] * block_size + positions % block_size).flatten()
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    outputs = {}
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        scale = key.abs().amax().float().reshape(1) / 448.0 if cache_dtype != torch.bfloat16 else torch.ones(1, device=device)
        key_cache = torch.empty(num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dtype, device=device)
        value_cache = torch.empty_like(key_cache)
        ops.reshape_and_cache(key, value, key_cache, value_cache, slots, scale, scale)
        out = torch.empty_like(query)
        start = time.perf_counter()
        ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, None,
                            1 / math.sqrt(head_size), scale, scale)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        outputs[cache_dtype] = out
        cache_mib = 2 * key_cache.numel() * key_cache.element_size() / 2**20
        print(f"{str(cache_dtype):24s} cache {cache_mib:7.1f} MiB  decode attention {elapsed * 1e3:8.2f} ms")
    ref, fp8 = outputs[torch.bfloat16].float(), outputs[torch.float8_e4m3fn].float()
    print(f"relative difference fp8 vs bf16 cache: {((fp8 - ref).norm() / ref.norm()).item():.2e} on {device}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8kv", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run a small end-to-end example").set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
