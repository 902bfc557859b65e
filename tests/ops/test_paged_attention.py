"""The paged_attention op (torch.ops.fp8kv) against the float64 reference in reference.py.

The reference reads the same cache bytes (dequantized with the test's own tables), so only the
kernel's fp32 arithmetic and the output rounding separate the two; the bound is derived in
reference.paged_attention_reference. Every cache slot no query may see holds NaN codes, and `out`
starts as NaN, so reading a masked slot or skipping an output element fails.

The grids take every combination of the axes that change the arithmetic most and add the other
axes so that every pair of values of any two axes occurs (see reference.covering_grid).
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import pytest
import torch

import fp8kv  # noqa: F401  (loads torch.ops.fp8kv)
import reference
from fp8kv._ops import supported_values
from reference import (CACHE_FORMATS, CACHE_LAYOUTS, FORMAT_BY_NAME, AttentionReference, allocate_caches,
                       assert_within, calibrated_scales, covering_grid, fill_nan, kernel_product_dtype,
                       make_paged_attention_inputs, paged_attention_reference, add_output_rounding, paged_block_tables,
                       quantization_error_bound, quantization_spacing, random_kv)

HEAD_SIZES = list(supported_values("cuda_head_sizes"))  # the CPU kernels take any
BLOCK_SIZES = list(supported_values("cuda_block_sizes"))
SM90A_HEAD_SIZES = supported_values("cuda_sm90a_head_sizes")  # the warpgroup-MMA multi-token kernel's
SM90A_CAPABILITY = supported_values("cuda_sm90a_capability")
GQA_RATIOS = [1, 4, 8]
QUERY_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NUM_KV_HEADS = 2
SOFT_CAP = 2.0


def case_id(case: dict) -> str:
    parts = []
    for name, value in case.items():
        if isinstance(value, bool):
            parts.append(name if value else f"no_{name}")
        elif name in ("head_size", "block_size", "gqa"):
            parts.append(f"{name.split('_')[0][0]}{value}" if name != "gqa" else f"gqa{value}")
        else:
            parts.append(str(value))
    return "-".join(parts)


DECODE_CASES = covering_grid(
    {"cache_format": CACHE_FORMATS, "head_size": HEAD_SIZES, "block_size": BLOCK_SIZES},
    {"gqa": GQA_RATIOS, "dtype": list(QUERY_DTYPES), "per_head": [False, True], "layout": CACHE_LAYOUTS,
     "window": [False, True], "soft_cap": [False, True], "strided": [False, True], "padding_row": [False, True]})

VARLEN_CASES = covering_grid(
    {"cache_format": CACHE_FORMATS, "gqa": GQA_RATIOS, "dtype": list(QUERY_DTYPES), "layout": CACHE_LAYOUTS},
    {"head_size": HEAD_SIZES, "block_size": BLOCK_SIZES, "per_head": [False, True], "window": [False, True],
     "soft_cap": [False, True], "strided": [False, True]})


@pytest.fixture(params=["cpu", pytest.param("cuda:sm80", marks=pytest.mark.gpu),
                        pytest.param("cuda:sm90a", marks=pytest.mark.gpu),
                        pytest.param("cuda:decode", marks=pytest.mark.gpu)])
def multi_token_device(request, monkeypatch) -> str:
    """The device for a multi-token case; on CUDA each of the three kernels in turn (forced through
    the calls' plans): the sm80 one on every GPU, the warpgroup-MMA one on compute capability 9.0, and
    the decode kernel (which the planner gives short queries) taking every sequence's rows in items of
    8 or 16."""
    device, _, kernel = request.param.partition(":")
    if kernel:
        if kernel == "sm90a" and torch.cuda.get_device_capability() != SM90A_CAPABILITY:
            pytest.skip(f"the sm90a multi-token kernel runs on compute capability {SM90A_CAPABILITY} only")
        monkeypatch.setattr(reference, "FORCED_KERNEL", kernel)
    return device


def sliding_window(case: dict) -> int:
    """A window that starts mid-block and leaves whole blocks of the longer sequences behind it."""
    return case["block_size"] + 5 if case["window"] else -1


def run_case(case: dict, seq_lens: list[int], q_lens: list[int] | None, device: str, seed: int) -> None:
    if reference.FORCED_KERNEL == "sm90a" and case["head_size"] not in SM90A_HEAD_SIZES:
        pytest.skip(f"the sm90a multi-token kernel has head sizes {SM90A_HEAD_SIZES}")
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=q_lens, num_heads=NUM_KV_HEADS * case["gqa"], num_kv_heads=NUM_KV_HEADS,
        head_size=case["head_size"], block_size=case["block_size"], cache_format=case["cache_format"],
        query_dtype=QUERY_DTYPES[case["dtype"]], per_head_scales=case["per_head"], layout=case["layout"],
        sliding_window=sliding_window(case), logits_soft_cap=SOFT_CAP if case["soft_cap"] else 0.0,
        strided=case["strided"], seed=seed, device=device)
    assert_within(inputs.run(), inputs.reference(), case_id(case))


@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode(device, case):
    """One query token per sequence: a single token, exactly one block, a partial block past
    several blocks, a long sequence; optionally a padding row (seq_len 0, output zeros)."""
    index = DECODE_CASES.index(case)
    b = case["block_size"]
    seq_lens = [1, b, 2 * b + 3, 3 * b + 37 + 13 * (index % 11)]
    if case["padding_row"]:
        seq_lens.insert(2, 0)
    run_case(case, seq_lens, None, device, seed=index)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=case_id)
def test_varlen_causal(multi_token_device, case):
    """Multi-token queries (cu_seqlens_q): a one-token prompt, a whole 20-token prompt (more rows
    than one CPU work chunk), a chunked-prefill continuation, a sequence with no query rows,
    and a long sequence with 17 new tokens."""
    index = VARLEN_CASES.index(case)
    b = case["block_size"]
    seq_lens = [1, 20, 2 * b + 7, b, 3 * b + 11]
    q_lens = [1, 20, 5, 0, 17]
    run_case(case, seq_lens, q_lens, multi_token_device, seed=1000 + index)


LONG_PROMPT_CASES = covering_grid(
    {"cache_format": CACHE_FORMATS, "head_size": [64, 128, 96, 256], "gqa": [1, 4]},
    {"block_size": [16, 32, 128], "dtype": list(QUERY_DTYPES), "per_head": [False, True], "layout": CACHE_LAYOUTS,
     "window": [False, True], "soft_cap": [False, True], "strided": [False, True]})


@pytest.mark.parametrize("case", LONG_PROMPT_CASES, ids=case_id)
def test_long_prompts(multi_token_device, case):
    """Prompts long enough for many key tiles per CTA and several query tiles per sequence (on an
    H100 at head sizes 64, 128 and 256, the warp-specialized kernel with both consumer warpgroups): a
    whole 300-token prompt, a 190-token chunk continuing 450 cached tokens, a decode row, and a lone
    64-token chunk over 1500 cached tokens, whose few CTAs split the context."""
    index = LONG_PROMPT_CASES.index(case)
    seq_lens = [300, 640 + index % 7, 1, 1564]
    q_lens = [300, 190, 1, 64]
    run_case(case, seq_lens, q_lens, multi_token_device, seed=5000 + index)


VERIFY_CASES = covering_grid(
    {"cache_format": CACHE_FORMATS, "q_len": [2, 4, 8], "gqa": GQA_RATIOS},
    # The four smallest block sizes: these 36 cases cannot pair more of them with every head size.
    {"head_size": HEAD_SIZES, "block_size": BLOCK_SIZES[:4], "dtype": list(QUERY_DTYPES),
     "per_head": [False, True], "layout": CACHE_LAYOUTS, "window": [False, True], "soft_cap": [False, True],
     "strided": [False, True]})


@pytest.mark.parametrize("case", VERIFY_CASES, ids=case_id)
def test_speculative_verification(multi_token_device, case):
    """q_len draft tokens per sequence (2, 4, 8) over caches of different lengths, next to a plain
    decode row: each draft token sees the cache up to itself."""
    index = VERIFY_CASES.index(case)
    b, q = case["block_size"], case["q_len"]
    seq_lens = [q, 3 * b + 5 + 7 * (index % 5), 1, 5 * b + 1]
    q_lens = [q, q, 1, q]
    run_case(case, seq_lens, q_lens, multi_token_device, seed=3000 + index)


@pytest.mark.parametrize("cache_format", CACHE_FORMATS)
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
def test_multi_query_attention(device, cache_format, decode):
    """One KV head shared by 8 query heads."""
    inputs = make_paged_attention_inputs(
        seq_lens=[5, 40], q_lens=None if decode else [3, 9], num_heads=8, num_kv_heads=1, head_size=128,
        block_size=16, cache_format=cache_format, query_dtype=torch.bfloat16, per_head_scales=True,
        device=device, seed=3)
    assert_within(inputs.run(), inputs.reference(), "MQA")


@pytest.mark.parametrize("cache_format", ["e4m3fn", "none"])
def test_table_entries_outside_the_window_are_not_read(device, cache_format):
    """Entries that no query reads (before the sliding window, past seq_len) may hold anything,
    here -1 (validation must not reject them and the kernel must not follow them)."""
    inputs = make_paged_attention_inputs(
        seq_lens=[100, 7], q_lens=None, num_heads=4, num_kv_heads=NUM_KV_HEADS, head_size=64, block_size=16,
        cache_format=cache_format, query_dtype=torch.float16, per_head_scales=False, sliding_window=20,
        device=device, seed=4)
    expected = inputs.reference()  # read through the valid (poisoned) entries
    tables = inputs.block_tables.clone()
    tables[0, :(100 - 20) // 16] = -1  # blocks wholly before the window of the last token
    tables[0, -(-100 // 16):] = -1     # past seq_len
    tables[1, 1:] = -1
    inputs.block_tables = tables
    assert_within(inputs.run(), expected, "-1 table entries")


@pytest.mark.parametrize("query_dtype", list(QUERY_DTYPES))
def test_seq_len_zero_rows_are_zero(device, query_dtype):
    """A batch of decode rows that are all padding: every output element is exactly 0."""
    inputs = make_paged_attention_inputs(
        seq_lens=[0, 0, 0], q_lens=None, num_heads=4, num_kv_heads=NUM_KV_HEADS, head_size=128, block_size=16,
        cache_format="e4m3fn", query_dtype=QUERY_DTYPES[query_dtype], per_head_scales=False, device=device)
    out = inputs.run()
    assert bool((out == 0).all())


@pytest.mark.parametrize("window", [-1, 100])
def test_cpu_rows_do_not_depend_on_the_rows_computed_with_them(window):
    """On the CPU a query row's output is the same bits whatever else the call computes: a 300-token
    prompt (two key tiles) prefilled whole next to another sequence, alone (on 1, 2 and 3 threads), in
    chunks, or token by token as decode rows. Continuous batching gives a request the bits it gets alone
    because of it."""
    inputs = make_paged_attention_inputs(
        seq_lens=[300, 77], q_lens=[300, 77], num_heads=6, num_kv_heads=NUM_KV_HEADS, head_size=64, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True, sliding_window=window, seed=7)
    whole = inputs.run()[:300]

    def prompt_rows(first: int, seq_len: int, decode: bool = False) -> torch.Tensor:
        """The prompt's rows [first, seq_len) with seq_len of its tokens cached."""
        query = inputs.query[first:seq_len]
        out = torch.full_like(query, math.nan)
        torch.ops.fp8kv.paged_attention(out, query, inputs.key_cache, inputs.value_cache, inputs.block_tables[:1],
                                        torch.tensor([seq_len], dtype=torch.int32),
                                        None if decode else torch.tensor([0, seq_len - first], dtype=torch.int32),
                                        inputs.softmax_scale, inputs.k_scale, inputs.v_scale, window)
        return out

    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(prompt_rows(0, 300), whole), n
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat([prompt_rows(0, 100), prompt_rows(100, 290), prompt_rows(290, 300)]), whole)
    for token in (0, 150, 255, 256, 299):
        assert torch.equal(prompt_rows(token, token + 1, decode=True), whole[token:token + 1]), token


NARROWER_CAPABILITIES = {"AVX512": ["avx2", "default"], "AVX2": ["default"]}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="torch's CPU capabilities are x86's")
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_cpu_narrower_vectors(capability):
    """The CPU kernel uses the vector width of torch's CPU capability, which ATEN_CPU_CAPABILITY
    lowers: the long-prompt (decode rows among them) and row-independence cases pass again in a child
    process on each width narrower than this machine's."""
    if capability not in NARROWER_CAPABILITIES.get(torch.backends.cpu.get_cpu_capability(), []):
        pytest.skip(f"{capability} is not narrower than this machine's {torch.backends.cpu.get_cpu_capability()}")
    cases = "cpu and (test_long_prompts or test_cpu_rows_do_not_depend)"
    child = (f"import sys, torch, pytest; assert torch.backends.cpu.get_cpu_capability() == {capability.upper()!r}; "
             f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', {cases!r}]))")
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                            env={**os.environ, "ATEN_CPU_CAPABILITY": capability})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


# ----------------------------------------------------------------------------------------------
# End to end: reshape_and_cache from float32 K/V, then attention, against the original K/V
# ----------------------------------------------------------------------------------------------


def placed(x: torch.Tensor, slots: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """float64 logical cache holding x [n, H, D] at `slots` and NaN elsewhere."""
    cache = torch.full((num_blocks, block_size, *x.shape[1:]), math.nan, dtype=torch.float64)
    cache[slots // block_size, slots % block_size] = x.double()
    return cache


@pytest.mark.parametrize("cache_format", ["e4m3fn", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
def test_end_to_end_error_follows_the_format_precision(device, cache_format, per_head, decode):
    """Write float32 K/V with calibrated scales, attend, and compare with float64 attention over
    the ORIGINAL K/V. The allowed error is the quantization bound (reference.
    quantization_error_bound: each element is off by at most half the FP8 grid spacing, i.e. a
    relative 2^-4 for e4m3, 2^-3 for e5m2 (relative steps 2^-3, 2^-2), statistically combined)
    plus the kernel bound over the quantized values."""
    fmt = FORMAT_BY_NAME[cache_format]
    generator = torch.Generator().manual_seed(11)
    num_kv_heads, num_heads, head_size, block_size = 2, 8, 128, 16
    seq_lens, q_lens = [1, 37, 300], [1, 1, 1] if decode else [1, 12, 30]
    tables, num_blocks, _, slot_lists = paged_block_tables(seq_lens, q_lens, block_size, -1, generator)
    slots = torch.cat(slot_lists)
    key, value = (random_kv(len(slots), num_kv_heads, head_size, generator) for _ in range(2))
    k_scale = calibrated_scales(key, cache_format, per_head, generator)
    v_scale = calibrated_scales(value, cache_format, per_head, generator)
    key_cache, value_cache = allocate_caches(num_blocks, block_size, num_kv_heads, head_size, fmt.dtype, "NHD",
                                             device)
    fill_nan(key_cache)
    fill_nan(value_cache)
    torch.ops.fp8kv.reshape_and_cache(key.to(device), value.to(device), key_cache, value_cache, slots.to(device),
                                k_scale.to(device), v_scale.to(device))
    query = torch.randn(sum(q_lens), num_heads, head_size, generator=generator).to(torch.float16)
    cu_seqlens_q = None if decode else torch.tensor([0, 1, 13, 43], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)

    def attend(v_scale_used):
        out = torch.full_like(query, math.nan).to(device)
        torch.ops.fp8kv.paged_attention(out, query.to(device), key_cache, value_cache, tables.to(device),
                                  seq_lens_t.to(device), None if decode else cu_seqlens_q.to(device),
                                  head_size**-0.5, k_scale.to(device), v_scale_used.to(device))
        return out

    def cache_of(x):
        return placed(x, slots, num_blocks, block_size)

    common = (tables, seq_lens_t, cu_seqlens_q, head_size**-0.5)
    exact = paged_attention_reference(query, cache_of(key), cache_of(value), *common)
    quantization = quantization_error_bound(
        query, cache_of(key), cache_of(value), cache_of(quantization_spacing(key, k_scale, fmt) / 2),
        cache_of(quantization_spacing(value, v_scale, fmt) / 2), *common)
    dequantized = [cache_of(fmt.table[fmt.encode(x.float() / s.view(-1, 1)).long()] * s.double().view(-1, 1))
                   for x, s in ((key, k_scale), (value, v_scale))]
    kernel = add_output_rounding(paged_attention_reference(
        query, *dequantized, *common, product_dtype=kernel_product_dtype(key_cache)), torch.float16)
    bound = quantization + kernel.bound
    # The bound must be informative: well below the output itself.
    allowed = AttentionReference(exact.out, bound)
    assert_within(attend(v_scale), allowed, "end to end")
    # Control: the bound is tight enough to reject a pipeline with a wrong (doubled) V scale.
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within(attend(2 * v_scale), allowed, "doubled v_scale")
