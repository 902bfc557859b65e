"""GPU-only tests: CUDA against the CPU kernels, long contexts, split-KV, CUDA graphs.

Skipped (by the `gpu` marker, see conftest.py) without a CUDA device or without fp8kv's CUDA
kernels.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import fp8kv
import reference
from fp8kv._ops import supported_values
from reference import (CACHE_FORMATS, FORMAT_BY_NAME, AttentionReference, all_16bit_values, allocate_caches,
                       assert_within, bits, cache_dtype, make_paged_attention_inputs, quantize,
                       random_kv)

pytestmark = pytest.mark.gpu

NUM_KV_HEADS, HEAD_SIZE = 2, 128


# ----------------------------------------------------------------------------------------------
# Cache write: CUDA and CPU store the same bytes
# ----------------------------------------------------------------------------------------------


def extreme_values() -> torch.Tensor:
    """float32 specials and values at every binade edge of every format, both signs."""
    magnitudes = [0.0, math.inf, 1e30, float(torch.finfo(torch.float32).max), float(torch.finfo(torch.float32).tiny),
                  2.0**-149]
    for fmt in FORMAT_BY_NAME.values():
        magnitudes += fmt.midpoints().abs().tolist() + fmt.table[fmt.table.isfinite()].abs().tolist()
        magnitudes += [fmt.max_finite * 1.0625, fmt.max_finite * 2, fmt.min_subnormal / 2]
    x = torch.tensor(magnitudes, dtype=torch.float32)
    x = torch.cat([x, torch.nextafter(x, torch.full_like(x, math.inf)), torch.nextafter(x, torch.zeros_like(x))])
    return torch.cat([x, -x, torch.tensor([math.nan, -math.nan])])


def source_values(source: str) -> torch.Tensor:
    if source == "fp32":
        generator = torch.Generator().manual_seed(0)
        spread = torch.randn(200_000, generator=generator) * torch.pow(10.0, torch.randint(-8, 8, (200_000,),
                                                                                          generator=generator))
        return torch.cat([extreme_values(), spread])  # extremes first: the tail may be cut to whole tokens
    return all_16bit_values({"fp16": torch.float16, "bf16": torch.bfloat16}[source])


def write(x: torch.Tensor, cache_format: str, scale: torch.Tensor, layout: str, device: str):
    """x as keys (and reversed as values) through reshape_and_cache on `device`; the caches' bits."""
    row = NUM_KV_HEADS * HEAD_SIZE
    num_tokens = x.numel() // row
    key = x[: num_tokens * row].view(num_tokens, NUM_KV_HEADS, HEAD_SIZE)
    value = key.flip(0)
    num_blocks = -(-num_tokens // 16)
    key_cache, value_cache = allocate_caches(num_blocks, 16, NUM_KV_HEADS, HEAD_SIZE,
                                             cache_dtype(cache_format, x.dtype), layout, device)
    bits(key_cache).zero_()
    bits(value_cache).zero_()
    slots = torch.randperm(num_blocks * 16, generator=torch.Generator().manual_seed(1))[:num_tokens]
    torch.ops.fp8kv.reshape_and_cache(key.to(device), value.to(device), key_cache, value_cache, slots.to(device),
                                scale.to(device), (scale * 3).to(device))
    return bits(key_cache).cpu(), bits(value_cache).cpu()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("scale", ["one", "per_head"])
@pytest.mark.parametrize("source", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
def test_cache_bytes_identical_to_cpu(cache_format, source, scale, layout):
    x = source_values(source)
    scales = torch.ones(1) if scale == "one" else torch.tensor([0.0123, 3.7])
    cpu, cuda = write(x, cache_format, scales, layout, "cpu"), write(x, cache_format, scales, layout, "cuda")
    for name, a, b in zip(("key_cache", "value_cache"), cpu, cuda):
        differ = (a != b).sum().item()
        assert differ == 0, f"{name}: {differ} elements differ between CPU and CUDA"


@pytest.mark.parametrize("cache_format", ["e4m3fn", "e5m2", "e4m3fnuz"])
def test_cache_bytes_follow_the_reference_encoding(cache_format):
    """Independently of the CPU kernel: CUDA's codes are the reference encoding of x / s."""
    fmt = FORMAT_BY_NAME[cache_format]
    x = source_values("fp32")
    scale = torch.tensor([0.0123, 3.7])
    row = NUM_KV_HEADS * HEAD_SIZE
    key = x[: x.numel() // row * row].view(-1, NUM_KV_HEADS, HEAD_SIZE)
    key_cache = torch.empty(key.shape[0], 1, NUM_KV_HEADS, HEAD_SIZE, dtype=fmt.dtype, device="cuda")
    value_cache = torch.empty_like(key_cache)
    torch.ops.fp8kv.reshape_and_cache(key.cuda(), key.cuda(), key_cache, value_cache,
                                torch.arange(key.shape[0], device="cuda"), scale.cuda(), scale.cuda())
    expected = quantize(key, scale, fmt)
    assert torch.equal(key_cache.view(torch.uint8).cpu()[:, 0], expected)


# ----------------------------------------------------------------------------------------------
# Attention: CUDA against the reference and the CPU kernel
# ----------------------------------------------------------------------------------------------

ATTENTION_CASES = [
    # cache_format, query dtype, decode, per_head, layout, window, soft_cap, head_size, block_size, gqa
    ("e4m3fn", torch.bfloat16, True, True, "HND", -1, 0.0, 128, 16, 4),
    ("e5m2", torch.float16, True, False, "NHD", 40, 0.0, 64, 32, 8),
    ("e4m3fnuz", torch.bfloat16, False, True, "interleaved", -1, 5.0, 256, 16, 1),
    ("none", torch.float16, False, False, "NHD", 33, 0.0, 96, 8, 4),
    ("e4m3fn", torch.float16, False, True, "NHD", 100, 3.0, 80, 128, 8),
    ("none", torch.bfloat16, True, True, "HND", -1, 2.0, 192, 16, 1),
    ("e4m3fn", torch.bfloat16, True, False, "NHD", -1, 0.0, 192, 32, 4),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_attention_matches_cpu_and_reference(case):
    cache_format, dtype, decode, per_head, layout, window, soft_cap, head_size, block_size, gqa = case
    seq_lens = [1, 700, 0, 2 * block_size + 3, 3000] if decode else [1, 700, 2 * block_size + 3, 3000]
    q_lens = None if decode else [1, 30, 2 * block_size + 3, 64]
    outputs, references = {}, {}
    for device in ("cpu", "cuda"):  # the same inputs (same seed) on each device
        inputs = make_paged_attention_inputs(
            seq_lens=seq_lens, q_lens=q_lens, num_heads=NUM_KV_HEADS * gqa, num_kv_heads=NUM_KV_HEADS,
            head_size=head_size, block_size=block_size, cache_format=cache_format, query_dtype=dtype,
            per_head_scales=per_head, layout=layout, sliding_window=window, logits_soft_cap=soft_cap,
            strided=True, seed=5, device=device)
        outputs[device], references[device] = inputs.run(), inputs.reference()
        assert_within(outputs[device], references[device], f"{device} vs reference")
    # Each within its bound of the same exact value, so within the sum of the bounds of each other.
    cpu, cuda = references["cpu"], references["cuda"]
    allowed = AttentionReference(outputs["cpu"].double().cuda(), cpu.bound.cuda() + cuda.bound)
    assert_within(outputs["cuda"], allowed, "CUDA vs CPU")


@pytest.mark.parametrize("head_size", [32, 112, 512])
def test_unsupported_head_size_is_named(head_size):
    inputs = make_paged_attention_inputs(
        seq_lens=[5], q_lens=None, num_heads=2, num_kv_heads=1, head_size=head_size, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.float16, per_head_scales=False, device="cuda")
    with pytest.raises(RuntimeError, match="head_size"):
        inputs.run()


def attention_inputs(head_size: int, q_lens: list[int] | None):
    """One sequence of 40 cached tokens, GQA 4, e4m3fn: q_lens [30] (multi-token) or None (decode)."""
    return make_paged_attention_inputs(
        seq_lens=[40], q_lens=q_lens, num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=False, device="cuda")


SM90A = torch.cuda.is_available() and torch.cuda.get_device_capability() == supported_values("cuda_sm90a_capability")


def plan_for(inputs, kernel: str, lse: bool = False) -> list[int]:
    return torch.ops.fp8kv.plan_paged_attention(inputs.key_cache, inputs.block_tables, inputs.cu_seqlens_q,
                                                inputs.query.shape[0], inputs.query.shape[1], inputs.sliding_window,
                                                inputs.fp8_math, lse, kernel)


def test_a_plan_forces_a_multi_token_kernel(monkeypatch):
    inputs = attention_inputs(128, [30])
    with pytest.raises(RuntimeError, match='`kernel` must be "auto", "sm80", "sm90a" or "decode" on CUDA, got "sm75"'):
        plan_for(inputs, "sm75")
    for kernel, name in (("", "sm90a" if SM90A else "sm80"), ("auto", "sm90a" if SM90A else "sm80"),
                         ("sm80", "sm80"), ("decode", "decode")):
        plan = plan_for(inputs, kernel)
        assert fp8kv.ops.AttentionPlan(tuple(plan), torch.empty(plan[0], dtype=torch.uint8, device="cuda")).kernel == name
        monkeypatch.setattr(reference, "FORCED_KERNEL", kernel or "auto")
        assert_within(inputs.run(), inputs.reference(), f"kernel={kernel!r}")
    # Decode calls have one kernel: forcing a multi-token one for them is refused.
    decode = attention_inputs(128, None)
    with pytest.raises(RuntimeError, match='`kernel`="sm80" runs multi-token queries; a decode call'):
        plan_for(decode, "sm80")
    assert plan_for(decode, "decode") == plan_for(decode, "auto")[:1] + [3] + plan_for(decode, "auto")[2:]


def test_sm90a_kernel_request_that_cannot_run_is_refused():
    head_sizes, capability = supported_values("cuda_sm90a_head_sizes"), supported_values("cuda_sm90a_capability")
    with pytest.raises(RuntimeError, match=rf'`kernel`="sm90a" needs .* head_size one of '
                                           rf"{', '.join(map(str, head_sizes))} \(got 96\)"):
        plan_for(attention_inputs(96, [30]), "sm90a")
    if torch.cuda.get_device_capability() != capability:
        with pytest.raises(RuntimeError, match=rf"compute capability {capability[0]}\.{capability[1]} device"):
            plan_for(attention_inputs(head_sizes[-1], [30]), "sm90a")


def test_a_plan_is_checked_against_the_call():
    """A planned call recomputes its own plan and refuses another one (other sizes, lse, a changed
    value), or a workspace smaller than its plan's."""
    inputs = attention_inputs(128, [30])
    plan = plan_for(inputs, "auto")
    out = torch.empty_like(inputs.query)
    args = (out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.seq_lens,
            inputs.cu_seqlens_q, inputs.softmax_scale, inputs.k_scale, inputs.v_scale)
    workspace = torch.empty(max(plan[0], 1), dtype=torch.uint8, device="cuda")
    torch.ops.fp8kv.paged_attention(*args, plan=plan, workspace=workspace)
    assert_within(out, inputs.reference(), "planned")
    for changed in ([plan[0] + 16, *plan[1:]], [*plan[:3], plan[3] + 1, *plan[4:]], plan[:2], [0, 99]):
        with pytest.raises(RuntimeError, match="`plan`"):
            torch.ops.fp8kv.paged_attention(*args, plan=changed, workspace=workspace)
    lse = torch.empty(inputs.query.shape[:2], device="cuda")
    lse_plan = plan_for(inputs, "auto", lse=True)
    if lse_plan != plan:
        with pytest.raises(RuntimeError, match="is not this call's plan"):
            torch.ops.fp8kv.paged_attention(*args, lse=lse, plan=plan, workspace=workspace)
    if lse_plan[0] > 0:
        with pytest.raises(RuntimeError, match="`workspace` must be a contiguous tensor of at least"):
            torch.ops.fp8kv.paged_attention(*args, lse=lse, plan=lse_plan,
                                            workspace=torch.empty(lse_plan[0] - 1, dtype=torch.uint8, device="cuda"))


@pytest.mark.parametrize("multi_token", [False, True])
def test_block_table_without_columns_is_refused(multi_token):
    # The CPU kernels accept it (decode writes zeros); the CUDA planner sizes splits from the
    # table's capacity and refuses a table of none, before any launch.
    query = torch.randn(1, 2, HEAD_SIZE, dtype=torch.bfloat16, device="cuda")
    key_cache = torch.zeros(1, 16, 1, HEAD_SIZE, dtype=torch.float8_e4m3fn, device="cuda")
    tables = torch.zeros(1, 0, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(1, dtype=torch.int32, device="cuda")
    cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32, device="cuda") if multi_token else None
    one = torch.ones(1, device="cuda")
    with pytest.raises(RuntimeError, match="`block_tables` must have at least one column, got 0"):
        torch.ops.fp8kv.paged_attention(torch.empty_like(query), query, key_cache, key_cache.clone(), tables, seq_lens,
                                  cu_seqlens_q, HEAD_SIZE**-0.5, one, one)


@pytest.mark.parametrize("cache_format, head_size, layout, window, soft_cap", [
    ("e4m3fn", 128, "HND", -1, 0.0), ("none", 64, "NHD", 50, 0.0), ("e5m2", 256, "NHD", -1, 4.0)])
def test_decode_ctas_take_many_items(cache_format, head_size, layout, window, soft_cap):
    """2000 work items (1000 sequences x 2 KV heads), more than any GPU's resident decode CTAs: each
    CTA takes several from the queue, the next one's block table and first tiles requested across
    the boundary. Lengths 0-299 make the items of one CTA differ (some are empty)."""
    seq_lens = torch.randint(0, 300, (1000,), generator=torch.Generator().manual_seed(11)).tolist()
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=None, num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16,
        cache_format=cache_format, query_dtype=torch.bfloat16, per_head_scales=True, layout=layout,
        sliding_window=window, logits_soft_cap=soft_cap, seed=3, device="cuda")
    assert_within(inputs.run(), inputs.reference(), "many items per CTA")


@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_batch_padded_with_rows_of_length_0(block_size):
    """A CUDA-graph batch as a server pads it: three sequences (two long enough to split), then 125 rows of
    length 0, which are the queue's last items; every KV head and split of the real rows lands where it
    belongs, and the padding rows get zeros."""
    inputs = make_paged_attention_inputs(
        seq_lens=[5000, 300, 7000] + [0] * 125, q_lens=None, num_heads=8, num_kv_heads=2, head_size=128,
        block_size=block_size, cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True, seed=5,
        device="cuda")
    out = inputs.run()
    assert_within(out, inputs.reference(), f"padded batch, block_size {block_size}")
    assert not out[3:].count_nonzero()


def relative_error(inputs) -> float:
    out, reference = inputs.run(), inputs.reference()
    assert_within(out, reference, f"seq_len {inputs.seq_lens.tolist()}")
    return ((out.double() - reference.out).norm() / reference.out.norm()).item()


def test_long_context_error_does_not_grow():
    """e4m3fn decode at 131072 tokens: relative error against the float64 reference no worse than
    1.5x the error at 4096 tokens (fp32 accumulation; same K/V/q distribution)."""
    errors = {}
    for seq_len in (4096, 131072):
        inputs = make_paged_attention_inputs(
            seq_lens=[seq_len], q_lens=None, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
            cache_format="e4m3fn", query_dtype=torch.float16, per_head_scales=True, seed=2, device="cuda")
        errors[seq_len] = relative_error(inputs)
    assert errors[131072] <= 1.5 * errors[4096], errors


@pytest.mark.parametrize("seq_len", [1, 255, 256, 257, 511, 512, 513, 4095, 4097, 20000, 65537])
def test_split_kv_single_sequence(seq_len):
    """Batch 1: the kernel splits the context over many thread blocks; every split boundary must
    merge exactly (per-head scales, GQA 8)."""
    inputs = make_paged_attention_inputs(
        seq_lens=[seq_len], q_lens=None, num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True, seed=seq_len, device="cuda")
    assert_within(inputs.run(), inputs.reference(), f"seq_len {seq_len}")


def test_split_kv_chunked_prefill():
    """Multi-token queries at the end of a long context, next to short sequences."""
    inputs = make_paged_attention_inputs(
        seq_lens=[20000, 3, 9000], q_lens=[16, 3, 1], num_heads=16, num_kv_heads=2, head_size=128, block_size=16,
        cache_format="e5m2", query_dtype=torch.float16, per_head_scales=True, sliding_window=5000, seed=3,
        device="cuda")
    assert_within(inputs.run(), inputs.reference(), "chunked prefill")


def attention_kernels_run(inputs) -> set[str]:
    """The attention kernels one call of `inputs` launches (CUDA kernel names, by the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        inputs.run()
        torch.cuda.synchronize()
    names = {event.name for event in profile.events()}
    return {kernel for kernel in ("decode_kernel", "sm80_kernel", "sm90a_kernel") if any(kernel in n for n in names)}


def test_short_queries_run_on_the_decode_kernel():
    """The planner gives short multi-token queries (rows of the average sequence fit 16) to the decode
    kernel, longer ones to a multi-token kernel, and so a batch of more sequences than the decode
    kernel's table takes."""
    def call(q_lens, seq_len=300):
        return make_paged_attention_inputs(
            seq_lens=[seq_len] * len(q_lens), q_lens=q_lens, num_heads=8, num_kv_heads=2, head_size=128,
            block_size=16, cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=False, device="cuda")
    assert attention_kernels_run(call([4] * 8)) == {"decode_kernel"}
    assert attention_kernels_run(call([1, 2, 7, 0])) == {"decode_kernel"}
    long = attention_kernels_run(call([64] * 2))
    assert len(long) == 1 and "decode_kernel" not in long
    table_seqs = supported_values("cuda_decode_table_seqs")[0]
    many = attention_kernels_run(call([2] * (table_seqs + 1), seq_len=20))
    assert len(many) == 1 and "decode_kernel" not in many


def test_decode_kernel_request_refuses_more_sequences_than_its_table():
    table_seqs = supported_values("cuda_decode_table_seqs")[0]
    inputs = make_paged_attention_inputs(
        seq_lens=[3] * (table_seqs + 1), q_lens=[1] * (table_seqs + 1), num_heads=4, num_kv_heads=2, head_size=64,
        block_size=16, cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=False, device="cuda")
    with pytest.raises(RuntimeError, match=rf'`kernel`="decode" takes at most {table_seqs} '
                                           rf"sequences and num_query_tokens \* num_heads below 2\^31, got "
                                           rf"{table_seqs + 1} sequences and {4 * (table_seqs + 1)}"):
        plan_for(inputs, "decode")
    assert_within(inputs.run(), inputs.reference(), "more sequences than the decode kernel's table")


OVERLAPPING_QUERIES = """
import torch, fp8kv
torch.manual_seed(0)
seqs, tokens, heads, d, block = 9, 64, 1, 128, 16
cu = torch.tensor([0] + [tokens, 0] * 4 + [tokens], dtype=torch.int32, device="cuda")  # overlapping ranges
key_cache = torch.randn(seqs * 4, block, heads, d, device="cuda").to(torch.float8_e4m3fn)
tables = torch.arange(seqs * 4, dtype=torch.int32, device="cuda").view(seqs, 4)
seq_lens = torch.full((seqs,), tokens, dtype=torch.int32, device="cuda")
query = torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16)
buffer = torch.full((tokens + 2, heads, d), 7.0, device="cuda", dtype=torch.bfloat16)
one = torch.ones(1, device="cuda")
plan = torch.ops.fp8kv.plan_paged_attention(key_cache, tables, cu, tokens, heads, kernel=KERNEL)
torch.ops.fp8kv.paged_attention(buffer[1:-1], query, key_cache, key_cache.clone(), tables, seq_lens, cu, d ** -0.5, one,
                                one, plan=plan)
torch.cuda.synchronize()
assert bool((buffer[0] == 7).all() and (buffer[-1] == 7).all()), "wrote outside out"
print("ended")
"""


@pytest.mark.parametrize("kernel", ["auto", "decode"])
def test_overlapping_query_ranges_end_without_writing_outside(kernel):
    """An invalid cu_seqlens_q whose sequences overlap (not read on CUDA unless FP8KV_DEBUG_CHECKS is set):
    the decode kernel's items, counted from it, must still end, and nothing outside `out` is written.
    In a child process, so that a hang fails the test instead of stopping the run."""
    env = dict(os.environ)
    env.pop("FP8KV_DEBUG_CHECKS", None)
    child = subprocess.run([sys.executable, "-c", f"KERNEL = {kernel!r}\n" + OVERLAPPING_QUERIES], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0 and "ended" in child.stdout, child.stderr[-2000:]


VERIFY_QUEUE_CASES = [
    # cache_format, head_size, gqa, layout, window, soft_cap: items of two column tiles where the average
    # sequence's rows exceed one (head sizes <= 128), else one
    ("e4m3fn", 128, 4, "HND", -1, 0.0),       # Llama-3-8B: 4 draft tokens fill two column tiles
    ("e4m3fn", 64, 8, "NHD", 40, 0.0),        # two tiles, three CTAs per SM
    ("e5m2", 96, 1, "interleaved", -1, 5.0),  # one tile of up to 8 tokens
    ("none", 256, 2, "NHD", -1, 0.0),         # head size 256: one tile
    ("e4m3fnuz", 80, 6, "HND", 70, 3.0),      # tiles that start mid-token (a group of 6)
]


@pytest.mark.parametrize("case", VERIFY_QUEUE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_verification_on_the_decode_kernel_takes_many_items(case, monkeypatch):
    """700 sequences of 0-7 draft tokens over 0-399 cached positions past them, and one of 40 tokens,
    on the decode kernel: more items than resident CTAs (the queue), sequences without rows between
    others (the table's search), a sequence whose rows take many items, every causal end within a tile."""
    cache_format, head_size, gqa, layout, window, soft_cap = case
    monkeypatch.setattr(reference, "FORCED_KERNEL", "decode")
    generator = torch.Generator().manual_seed(head_size)
    q_lens = torch.randint(0, 8, (700,), generator=generator).tolist()
    q_lens[350] = 40
    seq_lens = [q + int(torch.randint(0, 400, (1,), generator=generator)) for q in q_lens]
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=q_lens, num_heads=2 * gqa, num_kv_heads=2, head_size=head_size, block_size=16,
        cache_format=cache_format, query_dtype=torch.bfloat16, per_head_scales=True, layout=layout,
        sliding_window=window, logits_soft_cap=soft_cap, seed=7, device="cuda")
    assert attention_kernels_run(inputs) == {"decode_kernel"}
    assert_within(inputs.run(), inputs.reference(), "verification items")


MIXED_BATCH_CASES = [
    # cache_format, query dtype, layout, window, soft_cap, head_size, block_size, gqa
    ("e4m3fn", torch.bfloat16, "NHD", -1, 0.0, 128, 16, 4),
    ("e4m3fn", torch.float16, "HND", 700, 0.0, 64, 32, 8),
    ("e5m2", torch.bfloat16, "NHD", -1, 30.0, 256, 64, 1),
    ("e4m3fnuz", torch.float16, "interleaved", -1, 0.0, 96, 16, 6),
    ("none", torch.bfloat16, "HND", 333, 0.0, 192, 128, 4),
    ("none", torch.float16, "NHD", -1, 0.0, 80, 8, 1),
    ("e4m3fn", torch.bfloat16, "HND", -1, 0.0, 128, 16, 80),  # more query heads per KV head than a tile's rows
]


@pytest.mark.parametrize("case", MIXED_BATCH_CASES, ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_mixed_prefill_and_decode_batch(case):
    """One batch with whole prompts of thousands of tokens, a chunked-prefill continuation, draft
    tokens and decode rows: every query tile, causal diagonal and sequence boundary of the
    multi-token kernel."""
    cache_format, dtype, layout, window, soft_cap, head_size, block_size, gqa = case
    long = 300 if gqa > 8 else 2500  # keeps the float64 reference small for 160 query heads
    seq_lens = [long, 1, 1200, 4500, 33, 4]
    q_lens = [long, 1, 1200, 257, 1, 4]
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=q_lens, num_heads=NUM_KV_HEADS * gqa, num_kv_heads=NUM_KV_HEADS,
        head_size=head_size, block_size=block_size, cache_format=cache_format, query_dtype=dtype,
        per_head_scales=True, layout=layout, sliding_window=window, logits_soft_cap=soft_cap, strided=True,
        seed=11, device="cuda")
    assert_within(inputs.run(), inputs.reference(), "mixed batch")


# ----------------------------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------------------------


def test_cuda_graph_replay_follows_new_scales_and_inputs():
    """Capture reshape_and_cache + paged_attention once; replays must read the scales, the new
    token's K/V and the query from device memory as they are at replay time."""
    seq_lens = [1, 40, 300]
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=None, num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True, layout="HND", device="cuda")
    fmt = FORMAT_BY_NAME["e4m3fn"]
    tables = inputs.block_tables.cpu().long()
    last = torch.tensor(seq_lens) - 1
    slots = (tables[torch.arange(3), last // 16] * 16 + last % 16).cuda()  # each sequence's newest token
    generator = torch.Generator().manual_seed(9)
    key = random_kv(3, 2, 128, generator).to(torch.bfloat16).cuda()
    value = random_kv(3, 2, 128, generator).to(torch.bfloat16).cuda()
    out = torch.empty_like(inputs.query)

    def step():
        torch.ops.fp8kv.reshape_and_cache(key, value, inputs.key_cache, inputs.value_cache, slots, inputs.k_scale,
                                    inputs.v_scale)
        torch.ops.fp8kv.paged_attention(out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                                  inputs.seq_lens, None, inputs.softmax_scale, inputs.k_scale, inputs.v_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay_and_check(what: str) -> torch.Tensor:
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        written = inputs.key_cache.view(torch.uint8)[slots // 16, slots % 16].cpu()
        assert torch.equal(written, quantize(key.cpu(), inputs.k_scale.cpu(), fmt)), f"{what}: cache write"
        assert_within(out, inputs.reference(), what)
        return out.clone()

    first = replay_and_check("first replay")
    inputs.k_scale.mul_(1.5)
    inputs.v_scale.copy_(inputs.v_scale * torch.tensor([0.5, 2.0], device="cuda"))
    second = replay_and_check("replay after changing k_scale and v_scale in place")
    assert not torch.equal(first, second), "the replay used the new scales"
    key.copy_(key.flip(0))
    inputs.query.mul_(-1)
    replay_and_check("replay after changing key and query in place")
