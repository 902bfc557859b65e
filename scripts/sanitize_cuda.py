"""A compact workload for compute-sanitizer: every CUDA op and code path on small shapes.

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize_cuda.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/sanitize_cuda.py --small

Covers cache write (vectorized and scalar paths, skipped slots; the rotated recipe's), kv_amax, and
paged attention (the rotated recipe with K offsets too) for
every cache format and head size, decode, verification (on the decode kernel, and forced onto the
sm80 multi-token kernel's deep staging) and prefill, split-KV with its merge, persistent decode CTAs taking several work items, sliding window, soft cap, HND layout, partial last pages and block-table entries that are never read (-1).
On compute capability 9.0, the warpgroup-MMA multi-token kernel also runs short queries (forced by
a plan's `kernel`), whose CTAs are mostly padding rows, and 130-token chunks over 2000
cached tokens (many tiles per CTA, split-KV).
"""

import argparse
import itertools

import torch

from fp8kv._ops import supported_values

ops = torch.ops.fp8kv  # the raw operators: the caches, scales and recipes are the cases'

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, None]  # None: unquantized


def attention_case(head_size, block_size, group, cache_dtype, queries, hnd, window, cap, long, num_seqs=3,
                   rotated=False, fp8_math=False, kernel="auto"):
    """queries: 'decode' (one per sequence), 'verify' (1, 2 and 4 draft tokens) or 'prefill' (3
    sequences); more sequences repeat the three lengths and query lengths. kernel: the multi-token
    kernel the call's plan forces ("auto": the call plans itself)."""
    device = "cuda"
    num_kv_heads = 2
    query_dtype = torch.bfloat16
    cache_dtype = cache_dtype or query_dtype
    lens = torch.tensor([1, 3 * block_size + 5, 2000 if long else 70]).repeat(num_seqs)[:num_seqs]
    blocks_per_seq = int((lens.max() + block_size - 1) // block_size) + 1
    num_blocks = num_seqs * blocks_per_seq
    table = torch.randperm(num_blocks).view(num_seqs, blocks_per_seq).int()
    for s in range(num_seqs):  # entries past the sequence are never read
        table[s, (int(lens[s]) + block_size - 1) // block_size:] = -1
    shape = (num_blocks, num_kv_heads, block_size, head_size) if hnd else (num_blocks, block_size, num_kv_heads, head_size)
    raw = torch.randint(0, 100, (2, *shape), dtype=torch.uint8, device=device)
    if cache_dtype.itemsize == 1:
        key_cache, value_cache = raw[0].view(cache_dtype), raw[1].view(cache_dtype)
    else:
        key_cache = torch.randn(shape, device=device).to(cache_dtype)
        value_cache = torch.randn(shape, device=device).to(cache_dtype)
    if hnd:
        key_cache, value_cache = key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3)
    decode = queries == "decode"
    q_lens = torch.tensor({"decode": [1], "verify": [1, 2, 4], "prefill": [1, 3 * block_size + 5, 130]}[queries])
    q_lens = q_lens.repeat(num_seqs)[:num_seqs]
    q_lens = torch.minimum(q_lens, lens).int()
    cu = None if decode else torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()]).to(device)
    num_tokens = int(q_lens.sum())
    query = torch.randn(num_tokens, group * num_kv_heads, head_size, device=device, dtype=query_dtype)
    out = torch.empty_like(query)
    scale = torch.full((num_kv_heads,), 0.02, device=device)
    k_offset = torch.randn(num_kv_heads, head_size, device=device) if rotated else None
    table = table.to(device)
    planned = {}
    if kernel != "auto":
        values = ops.plan_paged_attention(key_cache, table, cu, num_tokens, query.shape[1], window, fp8_math, False,
                                          kernel)
        planned = {"plan": values, "workspace": torch.empty(values[0], dtype=torch.uint8, device=device)}
    ops.paged_attention(out, query, key_cache, value_cache, table, lens.int().to(device), cu,
                        head_size ** -0.5, scale, scale, window, cap, rotated, k_offset, fp8_math, **planned)


def cache_write_case(src_dtype, cache_dtype, head_size, strided, rotated=False):
    device = "cuda"
    tokens, heads, block_size, num_blocks = 37, 2, 16, 6
    fused = torch.randn(tokens, 3 * heads, head_size + (1 if strided else 0), device=device).to(src_dtype)
    key, value = fused[:, :heads, :head_size], fused[:, heads:2 * heads, :head_size]
    cache_dtype = cache_dtype or src_dtype
    key_cache = torch.zeros(num_blocks, block_size, heads, head_size, device=device, dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[::5] = -1
    scale = torch.tensor([0.5], device=device)
    k_offset = torch.randn(heads, head_size, device=device) if rotated else None
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, scale, scale, rotated, k_offset)
    k_amax, v_amax = torch.zeros(heads, device=device), torch.zeros(1, device=device)
    ops.kv_amax(key, value, k_amax, v_amax)


def fp8_math_cases() -> int:
    """The sm_90a kernel's FP8 math: both FP8 formats and head sizes, prefill with long contexts
    (splits), and short queries forced onto it (tiles of padding rows), with the recipes' features."""
    count = 0
    for i, (head, cache, queries) in enumerate(itertools.product(supported_values("cuda_sm90a_fp8_math_head_sizes"),
                                                                 [torch.float8_e4m3fn, torch.float8_e5m2],
                                                                 ["prefill", "verify"])):
        attention_case(head, [16, 32][i % 2], [1, 4, 8][i % 3], cache, queries, hnd=i % 2 == 1,
                       window=50 if i % 4 == 1 else -1, cap=20.0 if i % 3 == 0 else 0.0, long=True,
                       rotated=i % 2 == 0, fp8_math=True, kernel="sm90a" if queries == "verify" else "auto")
        count += 1
    return count


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="a few cases (racecheck is slow)")
    parser.add_argument("--fp8-math", action="store_true", help="only the FP8-math kernel's cases")
    args = parser.parse_args()
    torch.manual_seed(0)
    count = 0
    if torch.cuda.get_device_capability() == supported_values("cuda_sm90a_capability"):
        count += fp8_math_cases()
    if args.fp8_math:
        torch.cuda.synchronize()
        print(f"sanitize workload: {count} op calls completed")
        return
    for src, cache, head, strided in itertools.product([torch.float16, torch.bfloat16, torch.float32],
                                                      FORMATS, [64, 80], [False, True]):
        cache_write_case(src, cache, head, strided)
        count += 1
        if args.small and count >= 4:
            break
    fp8 = [f for f in FORMATS if f is not None]
    for src, cache, head, strided in itertools.product([torch.float32, torch.bfloat16], fp8[:1] if args.small else fp8,
                                                      [64, 80, 256], [False, True]):
        cache_write_case(src, cache, head, strided, rotated=True)  # the rotated recipe: lanes exchange values
        count += 1
    heads = [128] if args.small else list(supported_values("cuda_head_sizes"))
    block_sizes = supported_values("cuda_block_sizes")[:3]  # the smallest: sequences span many blocks
    for i, (head, cache) in enumerate(itertools.product(heads, FORMATS)):
        for j, (queries, long) in enumerate([("decode", True), ("prefill", False), ("decode", False),
                                              ("verify", True)]):
            attention_case(head, block_sizes[(i + j) % 3], [1, 4, 8, 16][(i + j) % 4], cache, queries,
                           hnd=(i + j) % 2 == 1, window=50 if j == 2 else -1, cap=20.0 if (i + j) % 3 == 0 else 0.0,
                           long=long)
            count += 1
    for i, head in enumerate(heads):  # the rotated recipe, its logit offsets under a soft cap
        for j, queries in enumerate(["decode", "prefill", "verify"]):
            attention_case(head, block_sizes[(i + j) % 3], [1, 4, 8][j], fp8[(i + j) % len(fp8)], queries,
                           hnd=j == 1, window=-1, cap=20.0 if j != 2 else 0.0, long=j == 0, rotated=True)
            count += 1
    if torch.cuda.get_device_capability() == supported_values("cuda_sm90a_capability"):
        sm90a_heads = supported_values("cuda_sm90a_head_sizes")
        for head, cache, queries in itertools.product(sm90a_heads[-1:] if args.small else sm90a_heads,
                                                      [torch.float8_e4m3fn, None], ["verify", "prefill"]):
            attention_case(head, 16, 4, cache, queries, hnd=cache is None, window=50 if cache is None else -1,
                           cap=0.0 if cache is None else 20.0, long=True, rotated=cache is not None, kernel="sm90a")
            count += 1
    # Short queries run on the decode kernel: the sm80 kernel's deep staging (forced), and the decode
    # kernel's multi-token items with groups of two column tiles and more, and with many sequences.
    for kernel, group, num_seqs in (("sm80", 4, 3), ("decode", 8, 3), ("decode", 16, 3), ("decode", 4, 700)):
        for head in heads[-2:]:
            attention_case(head, 16, group, torch.float8_e4m3fn, "verify", hnd=group == 8, window=50 if group == 16 else -1,
                           cap=20.0 if group == 8 else 0.0, long=num_seqs == 3, num_seqs=num_seqs, rotated=group == 16,
                           kernel=kernel)
            count += 1
    for head in heads:  # decode with far more work items than resident CTAs: each CTA takes several
        attention_case(head, 16, 4, torch.float8_e4m3fn, "decode", hnd=False, window=-1, cap=0.0, long=False,
                       num_seqs=700)
        count += 1
    torch.cuda.synchronize()
    print(f"sanitize workload: {count} op calls completed")


if __name__ == "__main__":
    main()
