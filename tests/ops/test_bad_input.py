"""Bad input: every op raises a RuntimeError naming the offending argument.

Each case changes one argument of a valid call. Index checks (slot ids, block ids, sequence
lengths, query offsets) read tensor data: the CPU backend always runs them; a device backend
only with FP8KV_DEBUG_CHECKS=1 (reading device data would synchronize), so the CUDA cases set it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import fp8kv

NUM_KV_HEADS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 64, 16, 6


def reshape_and_cache_args(device) -> dict:
    key = torch.randn(5, NUM_KV_HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=device, dtype=torch.float8_e4m3fn)
    return dict(key=key, value=key.clone(), key_cache=cache, value_cache=cache.clone(),
                slot_mapping=torch.tensor([3, -1, 40, 17, 95], device=device),
                k_scale=torch.ones(1, device=device), v_scale=torch.full((NUM_KV_HEADS,), 0.5, device=device))


def paged_attention_args(device) -> dict:
    """Three sequences of 1, 5 and 20 cached tokens with 1, 2 and 3 query rows."""
    query = torch.randn(6, NUM_HEADS, HEAD_SIZE, device=device, dtype=torch.float16)
    cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=device, dtype=torch.float8_e5m2)
    return dict(out=torch.empty_like(query), query=query, key_cache=cache, value_cache=cache.clone(),
                block_tables=torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([1, 5, 20], dtype=torch.int32, device=device),
                cu_seqlens_q=torch.tensor([0, 1, 3, 6], dtype=torch.int32, device=device),
                softmax_scale=0.125, k_scale=torch.ones(1, device=device), v_scale=torch.ones(1, device=device),
                sliding_window=-1, logits_soft_cap=0.0)


def kv_amax_args(device) -> dict:
    key = torch.randn(5, NUM_KV_HEADS, HEAD_SIZE, device=device, dtype=torch.float16)
    return dict(key=key, value=key.clone(), k_amax=torch.zeros(1, device=device),
                v_amax=torch.zeros(NUM_KV_HEADS, device=device))


# The raw operators: the cases give caches, scales and recipe arguments that a KVCacheLayer would not hold.
OPS = {"reshape_and_cache": (torch.ops.fp8kv.reshape_and_cache, reshape_and_cache_args),
       "paged_attention": (torch.ops.fp8kv.paged_attention, paged_attention_args),
       "kv_amax": (fp8kv.ops.kv_amax, kv_amax_args)}


def edited(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def overlapping_caches(t: torch.Tensor, blocks: int) -> dict:
    """Key and value caches of t's shape in one buffer, the value cache `blocks` blocks further on."""
    base = torch.zeros(t.shape[0] + blocks, *t.shape[1:], dtype=t.dtype, device=t.device)
    return {"key_cache": base[:t.shape[0]], "value_cache": base[blocks:]}


def zero_stride(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t's first slice along `dim`, repeated `size` times without memory (stride 0)."""
    shape = list(t.shape)
    shape[dim] = size
    return t.narrow(dim, 0, 1).expand(shape)


def not_last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, stride 2 in the last dimension."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


@dataclass
class Case:
    op: str
    name: str
    change: Callable[[dict], dict]  # valid arguments -> the replaced ones
    match: str                       # regex the error message must contain
    reads_indices: bool = False      # an index check: on CUDA only with FP8KV_DEBUG_CHECKS=1
    host_values: bool = False        # a check of scale values, made where they are on the host (CPU)


R, P, A = "reshape_and_cache", "paged_attention", "kv_amax"
SOFTMAX_SCALE = r"`softmax_scale` must be a finite positive number representable in float32"
CASES = [
    # reshape_and_cache
    Case(R, "key_dtype_int", lambda a: {"key": a["key"].int(), "value": a["value"].int()},
         r"`key` must be float16, bfloat16 or float32"),
    Case(R, "key_rank_2", lambda a: {"key": a["key"][:, 0], "value": a["value"][:, 0]}, r"`key` must have rank 3"),
    Case(R, "key_last_dim_strided", lambda a: {"key": not_last_dim_contiguous(a["key"])},
         r"`key` must be contiguous in its last dimension"),
    Case(R, "value_shape", lambda a: {"value": a["value"][:4]}, r"`value` must have the shape of `key`"),
    Case(R, "value_dtype", lambda a: {"value": a["value"].half()}, r"`value` must have the dtype of `key`"),
    Case(R, "key_cache_rank_3", lambda a: {"key_cache": a["key_cache"][0], "value_cache": a["value_cache"][0]},
         r"`key_cache` must have rank 4"),
    Case(R, "key_cache_last_dim_strided", lambda a: {"key_cache": not_last_dim_contiguous(a["key_cache"].view(
        torch.uint8)).view(torch.float8_e4m3fn)}, r"`key_cache` must be contiguous in its last dimension"),
    Case(R, "key_cache_empty", lambda a: {"key_cache": a["key_cache"][:0], "value_cache": a["value_cache"][:0]},
         r"`key_cache` must have non-empty dimensions"),
    Case(R, "value_cache_dtype", lambda a: {"value_cache": a["value_cache"].view(torch.float8_e5m2)},
         r"`value_cache` must have the dtype of `key_cache`"),
    Case(R, "value_cache_shape", lambda a: {"value_cache": a["value_cache"][:3]},
         r"`value_cache` must have the shape of `key_cache`"),
    Case(R, "cache_dtype_int8", lambda a: {k: a[k].view(torch.int8) for k in ("key_cache", "value_cache")},
         r"`key_cache` must be float8_e4m3fn, float8_e5m2, float8_e4m3fnuz or the dtype of `key`"),
    Case(R, "unquantized_cache_other_dtype", lambda a: {k: torch.zeros(a[k].shape, dtype=torch.float16,
                                                                       device=a[k].device)
                                                        for k in ("key_cache", "value_cache")},
         r"`key_cache` must be float8_e4m3fn, float8_e5m2, float8_e4m3fnuz or the dtype of `key`"),
    Case(R, "cache_num_kv_heads", lambda a: {k: a[k][:, :, :1] for k in ("key_cache", "value_cache")},
         r"`key_cache` .* must match `key`"),
    Case(R, "slot_mapping_int32", lambda a: {"slot_mapping": a["slot_mapping"].int()}, r"`slot_mapping` must be"),
    Case(R, "slot_mapping_rank_2", lambda a: {"slot_mapping": a["slot_mapping"].view(5, 1)},
         r"`slot_mapping` must have rank 1"),
    Case(R, "slot_mapping_longer_than_key", lambda a: {"slot_mapping": torch.cat([a["slot_mapping"]] * 2)},
         r"`slot_mapping` has 10 entries but `key` has only 5"),
    Case(R, "slot_mapping_non_contiguous", lambda a: {"slot_mapping": torch.cat([a["slot_mapping"]] * 2)[::2]},
         r"`slot_mapping` must be contiguous"),
    Case(R, "slot_past_the_cache", lambda a: {"slot_mapping": edited(a["slot_mapping"], 2, NUM_BLOCKS * BLOCK_SIZE)},
         r"`slot_mapping`\[2\] = 96 is outside the cache", reads_indices=True),
    Case(R, "k_scale_shape", lambda a: {"k_scale": torch.ones(3, device=a["key"].device)},
         r"`k_scale` must have shape \[1\] \(per tensor\) or \[num_kv_heads\] = \[2\]"),
    Case(R, "k_scale_rank_2", lambda a: {"k_scale": a["k_scale"].view(1, 1)}, r"`k_scale` must have shape"),
    Case(R, "v_scale_float64", lambda a: {"v_scale": a["v_scale"].double()}, r"`v_scale` must be float32"),
    Case(R, "key_no_heads", lambda a: {"key": a["key"][:, :0], "value": a["value"][:, :0]},
         r"`key` must have num_kv_heads >= 1 and head_size >= 1"),
    Case(R, "key_heads_beyond_int32", lambda a: {k: zero_stride(a[k], 1, 2**31) for k in ("key", "value")},
         r"`key` num_kv_heads = 2147483648 exceeds the int32 limit"),
    Case(R, "value_cache_is_key_cache", lambda a: {"value_cache": a["key_cache"]},
         r"`key_cache` and `value_cache` must be distinct tensors that do not overlap"),
    Case(R, "value_cache_overlaps_key_cache", lambda a: overlapping_caches(a["key_cache"], 2),
         r"`key_cache` and `value_cache` must be distinct tensors that do not overlap"),
    Case(R, "key_cache_overlaps_itself", lambda a: {"key_cache": zero_stride(a["key_cache"], 0, NUM_BLOCKS)},
         r"`key_cache` must not have overlapping elements"),
    Case(R, "k_scale_zero", lambda a: {"k_scale": torch.zeros(1)}, r"`k_scale`\[0\] = 0 must be a finite scale > 0",
         host_values=True),
    Case(R, "k_scale_negative", lambda a: {"k_scale": -torch.ones(1)}, r"`k_scale`\[0\] = -1 must be a finite",
         host_values=True),
    Case(R, "v_scale_inf", lambda a: {"v_scale": torch.tensor([1.0, math.inf])},
         r"`v_scale`\[1\] = inf must be a finite scale > 0", host_values=True),
    Case(R, "v_scale_nan", lambda a: {"v_scale": torch.full((1,), math.nan)}, r"`v_scale`\[0\] = nan must be",
         host_values=True),
    Case(R, "key_on_meta", lambda a: {"key": a["key"].to("meta")}, r"`key` must be on (cpu|cuda)"),
    # paged_attention
    Case(P, "query_float32", lambda a: {"query": a["query"].float(), "out": a["out"].float()},
         r"`query` must be float16 or bfloat16"),
    Case(P, "query_rank_4", lambda a: {"query": a["query"][None], "out": a["out"][None]}, r"`query` must have rank 3"),
    Case(P, "out_dtype", lambda a: {"out": a["out"].bfloat16()}, r"`out` must have the dtype of `query`"),
    Case(P, "out_shape", lambda a: {"out": a["out"][:, :2]}, r"`out` must have the shape of `query`"),
    Case(P, "out_last_dim_strided", lambda a: {"out": not_last_dim_contiguous(a["out"])},
         r"`out` must be contiguous in its last dimension"),
    Case(P, "query_last_dim_strided", lambda a: {"query": not_last_dim_contiguous(a["query"])},
         r"`query` must be contiguous in its last dimension"),
    Case(P, "head_ratio", lambda a: {"query": a["query"][:, :3], "out": a["out"][:, :3]},
         r"`query` num_heads \(3\) must be a multiple of the cache's num_kv_heads \(2\)"),
    Case(P, "cache_head_size", lambda a: {k: a[k][..., :32] for k in ("key_cache", "value_cache")},
         r"`key_cache` head_size \(dim 3\) must equal `query` head_size 64"),
    Case(P, "unquantized_cache_other_dtype", lambda a: {k: torch.zeros(a[k].shape, dtype=torch.bfloat16,
                                                                       device=a[k].device)
                                                        for k in ("key_cache", "value_cache")},
         r"`key_cache` must be float8_e4m3fn, float8_e5m2, float8_e4m3fnuz or the dtype of `query`"),
    Case(P, "value_cache_dtype", lambda a: {"value_cache": a["value_cache"].view(torch.float8_e4m3fn)},
         r"`value_cache` must have the dtype of `key_cache`"),
    Case(P, "value_cache_shape", lambda a: {"value_cache": a["value_cache"][:, :8]},
         r"`value_cache` must have the shape of `key_cache`"),
    Case(P, "block_tables_int64", lambda a: {"block_tables": a["block_tables"].long()},
         r"`block_tables` must be int32"),
    Case(P, "block_tables_rank_1", lambda a: {"block_tables": a["block_tables"].flatten()},
         r"`block_tables` must have rank 2"),
    Case(P, "seq_lens_length", lambda a: {"seq_lens": a["seq_lens"][:2]},
         r"`seq_lens` must have num_seqs = 3 entries"),
    Case(P, "seq_lens_int64", lambda a: {"seq_lens": a["seq_lens"].long()}, r"`seq_lens` must be Int"),
    Case(P, "cu_seqlens_q_length", lambda a: {"cu_seqlens_q": a["cu_seqlens_q"][:3]},
         r"`cu_seqlens_q` must have num_seqs \+ 1 = 4 entries"),
    Case(P, "decode_rows_not_num_seqs", lambda a: {"cu_seqlens_q": None},
         r"without `cu_seqlens_q` \(decode\) `query` must have one row per sequence"),
    Case(P, "softmax_scale_zero", lambda a: {"softmax_scale": 0.0}, SOFTMAX_SCALE),
    Case(P, "softmax_scale_negative", lambda a: {"softmax_scale": -0.125}, SOFTMAX_SCALE),
    Case(P, "softmax_scale_nan", lambda a: {"softmax_scale": math.nan}, SOFTMAX_SCALE),
    Case(P, "softmax_scale_beyond_float32", lambda a: {"softmax_scale": 1e39}, SOFTMAX_SCALE),
    Case(P, "softmax_scale_zero_in_float32", lambda a: {"softmax_scale": 1e-46}, SOFTMAX_SCALE),
    Case(P, "sliding_window_zero", lambda a: {"sliding_window": 0}, r"`sliding_window` must be -1 \(none\)"),
    Case(P, "sliding_window_below_minus_one", lambda a: {"sliding_window": -2}, r"`sliding_window` must be -1"),
    Case(P, "soft_cap_negative", lambda a: {"logits_soft_cap": -1.0}, r"`logits_soft_cap` must be 0 \(none\)"),
    Case(P, "soft_cap_inf", lambda a: {"logits_soft_cap": math.inf}, r"`logits_soft_cap` must be 0 \(none\)"),
    Case(P, "soft_cap_beyond_float32", lambda a: {"logits_soft_cap": 1e39}, r"`logits_soft_cap` must be 0 \(none\)"),
    Case(P, "soft_cap_zero_in_float32", lambda a: {"logits_soft_cap": 1e-46}, r"`logits_soft_cap` must be 0 \(none\)"),
    Case(P, "sliding_window_beyond_int32", lambda a: {"sliding_window": 2**32 + 1},
         r"`sliding_window` must be -1 \(none\) or a positive number of tokens up to 2147483647"),
    Case(P, "query_no_heads", lambda a: {"query": a["query"][:, :0], "out": a["out"][:, :0]},
         r"`query` must have num_heads >= 1 and head_size >= 1"),
    Case(P, "query_rows_beyond_int32", lambda a: {"query": zero_stride(a["query"], 1, 2**30),
                                                  "out": zero_stride(a["out"], 1, 2**30)},
         r"`query` has num_query_tokens \* num_heads = 6 \* 1073741824 rows, beyond the int32 limit"),
    Case(P, "table_rows_beyond_2^30_tokens", lambda a: {k: zero_stride(a[k], 1, 2**29 + 1)
                                                         for k in ("key_cache", "value_cache")},
         r"`block_tables` rows cover max_blocks_per_seq \* block_size = 2 \* 536870913 tokens"),
    Case(P, "out_is_query", lambda a: {"out": a["query"]}, r"output `out` must not overlap input `query`"),
    Case(P, "out_overlaps_itself", lambda a: {"out": zero_stride(a["out"], 0, 6)},
         r"`out` must not have overlapping elements"),
    Case(P, "value_cache_is_key_cache", lambda a: {"value_cache": a["key_cache"]},
         r"`key_cache` and `value_cache` must be distinct tensors that do not overlap"),
    Case(P, "value_cache_overlaps_key_cache", lambda a: overlapping_caches(a["key_cache"], 1),
         r"`key_cache` and `value_cache` must be distinct tensors that do not overlap"),
    Case(P, "k_scale_zero", lambda a: {"k_scale": torch.zeros(1)}, r"`k_scale`\[0\] = 0 must be a finite scale > 0",
         host_values=True),
    Case(P, "v_scale_nan", lambda a: {"v_scale": torch.full((2,), math.nan)},
         r"`v_scale`\[0\] = nan must be a finite scale > 0", host_values=True),
    Case(P, "value_cache_on_meta", lambda a: {"value_cache": a["value_cache"].to("meta")},
         r"`value_cache` must be on (cpu|cuda)"),
    Case(P, "k_scale_shape", lambda a: {"k_scale": torch.ones(4, device=a["query"].device)},
         r"`k_scale` must have shape \[1\] \(per tensor\) or \[num_kv_heads\] = \[2\]"),
    Case(P, "v_scale_float16", lambda a: {"v_scale": a["v_scale"].half()}, r"`v_scale` must be float32"),
    Case(P, "block_id_past_num_blocks", lambda a: {"block_tables": edited(a["block_tables"], (2, 1), NUM_BLOCKS)},
         r"`block_tables`\[2, 1\] = 6 must be a block id in \[0, num_blocks = 6\)", reads_indices=True),
    Case(P, "block_id_negative", lambda a: {"block_tables": edited(a["block_tables"], (1, 0), -1)},
         r"`block_tables`\[1, 0\] = -1 must be a block id", reads_indices=True),
    Case(P, "seq_len_beyond_table", lambda a: {"seq_lens": edited(a["seq_lens"], 1, 33)},
         r"`seq_lens`\[1\] = 33 must be in \[0, max_blocks_per_seq \* block_size = 32\]", reads_indices=True),
    Case(P, "seq_len_negative", lambda a: {"seq_lens": edited(a["seq_lens"], 0, -1)},
         r"`seq_lens`\[0\] = -1 must be in", reads_indices=True),
    Case(P, "more_query_rows_than_cached_tokens", lambda a: {"seq_lens": edited(a["seq_lens"], 1, 1)},
         r"sequence 1 has 2 query rows but `seq_lens`\[1\] = 1", reads_indices=True),
    Case(P, "cu_seqlens_q_not_from_zero", lambda a: {"cu_seqlens_q": edited(a["cu_seqlens_q"], 0, 1)},
         r"`cu_seqlens_q`\[0\] must be 0, got 1", reads_indices=True),
    Case(P, "cu_seqlens_q_not_to_num_rows", lambda a: {"cu_seqlens_q": edited(a["cu_seqlens_q"], 3, 5)},
         r"`cu_seqlens_q`\[-1\] must equal the number of query rows 6, got 5", reads_indices=True),
    Case(P, "cu_seqlens_q_decreasing", lambda a: {"cu_seqlens_q": edited(a["cu_seqlens_q"], 2, 0)},
         r"`cu_seqlens_q` must be non-decreasing", reads_indices=True),
    # kv_amax
    Case(A, "key_fp8", lambda a: {k: a[k].to(torch.float8_e4m3fn) for k in ("key", "value")},
         r"`key` must be float16, bfloat16 or float32"),
    Case(A, "value_shape", lambda a: {"value": a["value"][:, :1]}, r"`value` must have the shape of `key`"),
    Case(A, "value_last_dim_strided", lambda a: {"value": not_last_dim_contiguous(a["value"])},
         r"`value` must be contiguous in its last dimension"),
    Case(A, "k_amax_float16", lambda a: {"k_amax": a["k_amax"].half()}, r"`k_amax` must be float32"),
    Case(A, "v_amax_shape", lambda a: {"v_amax": torch.zeros(3, device=a["key"].device)},
         r"`v_amax` must have shape \[1\] \(per tensor\) or \[num_kv_heads\] = \[2\]"),
    Case(A, "v_amax_non_contiguous", lambda a: {"v_amax": torch.zeros(4, device=a["key"].device)[::2]},
         r"`v_amax` must be contiguous"),
    Case(A, "no_heads_and_empty_maxima", lambda a: {"key": a["key"][:, :0], "value": a["value"][:, :0],
                                                    "k_amax": a["k_amax"][1:1], "v_amax": a["v_amax"][1:1]},
         r"`key` must have num_kv_heads >= 1 and head_size >= 1"),
    Case(A, "v_amax_is_k_amax", lambda a: {"v_amax": a["k_amax"]},
         r"`k_amax` and `v_amax` must be distinct tensors that do not overlap"),
    Case(A, "k_amax_on_meta", lambda a: {"k_amax": a["k_amax"].to("meta")}, r"`k_amax` must be on (cpu|cuda)"),
]


def call(op: str, args: dict) -> None:
    OPS[op][0](**args)


@pytest.mark.parametrize("op", OPS)
def test_valid_arguments_are_accepted(device, op):
    """The starting point of every case is a valid call (so each error comes from the change)."""
    call(op, OPS[op][1](device))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{c.name}")
def test_bad_argument_is_named(device, case, monkeypatch):
    if device == "cuda" and case.reads_indices:
        monkeypatch.setenv("FP8KV_DEBUG_CHECKS", "1")
    if device == "cuda" and case.host_values:
        pytest.skip("scale values on the device are not read by the op (docs/ops.md)")
    args = OPS[case.op][1](device)
    args.update(case.change(args))
    with pytest.raises(RuntimeError, match=case.match):
        call(case.op, args)


def test_there_are_at_least_20_distinct_cases():
    assert len({(c.op, c.name) for c in CASES}) == len(CASES) >= 20


# Arguments on another device than the data: needs a CUDA device (the other device is the CPU).
DEVICE_CASES = [
    (R, "k_scale", r"`k_scale` must be on cuda"),
    (R, "slot_mapping", r"`slot_mapping` must be on cuda"),
    (R, "value_cache", r"`value_cache` must be on cuda"),
    (P, "block_tables", r"`block_tables` must be on cuda"),
    (P, "seq_lens", r"`seq_lens` must be on cuda"),
    (P, "v_scale", r"`v_scale` must be on cuda"),
    (P, "out", r"`out` must be on cuda"),
    (A, "v_amax", r"`v_amax` must be on cuda"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("op, argument, match", DEVICE_CASES, ids=[f"{c[0]}-{c[1]}" for c in DEVICE_CASES])
def test_argument_on_the_wrong_device_is_named(op, argument, match):
    args = OPS[op][1]("cuda")
    args[argument] = args[argument].cpu()
    with pytest.raises(RuntimeError, match=match):
        call(op, args)


def test_interleaved_key_value_halves_are_accepted(device):
    """K and V halves of one buffer share storage and byte span but no element: not an overlap.
    Writes and attention through them equal those through separate caches, bit for bit."""
    write, attend = reshape_and_cache_args(device), paged_attention_args(device)
    both = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=device, dtype=torch.float8_e4m3fn)
    halves = {"key_cache": both[:, 0], "value_cache": both[:, 1]}
    torch.ops.fp8kv.reshape_and_cache(**{**write, **halves})
    torch.ops.fp8kv.reshape_and_cache(**write)
    for name in halves:
        assert torch.equal(halves[name].view(torch.uint8), write[name].view(torch.uint8))
    separate = {**attend, "key_cache": write["key_cache"], "value_cache": write["value_cache"]}
    interleaved = {**separate, **halves, "out": torch.empty_like(attend["out"])}
    torch.ops.fp8kv.paged_attention(**separate)
    torch.ops.fp8kv.paged_attention(**interleaved)
    assert torch.equal(interleaved["out"], separate["out"])


# The index-check ops run the checks that need index values on request, on any device.
INDEX_CHECKS = {
    R: lambda a: torch.ops.fp8kv.check_cache_write_indices(a["slot_mapping"], a["key_cache"]),
    P: lambda a: torch.ops.fp8kv.check_paged_attention_indices(a["block_tables"], a["seq_lens"], a["cu_seqlens_q"],
                                                         a["query"].shape[0], a["key_cache"], a["sliding_window"]),
}


@pytest.mark.parametrize("op", INDEX_CHECKS)
def test_index_check_ops_accept_valid_indices(device, op):
    INDEX_CHECKS[op](OPS[op][1](device))


@pytest.mark.parametrize("case", [c for c in CASES if c.reads_indices], ids=lambda c: f"{c.op}-{c.name}")
def test_index_check_ops_name_the_bad_index(device, case, monkeypatch):
    monkeypatch.delenv("FP8KV_DEBUG_CHECKS", raising=False)
    args = OPS[case.op][1](device)
    args.update(case.change(args))
    with pytest.raises(RuntimeError, match=case.match):
        INDEX_CHECKS[case.op](args)


def test_index_check_ops_refuse_malformed_index_tensors():
    cache = torch.zeros(2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"check_cache_write_indices: `slot_mapping` must be int64 of rank 1"):
        torch.ops.fp8kv.check_cache_write_indices(torch.zeros(3, dtype=torch.int32), cache)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"`seq_lens` must be int32 \[num_seqs = 2\]"):
        torch.ops.fp8kv.check_paged_attention_indices(tables, lens[:1], None, 2, cache)
    with pytest.raises(RuntimeError, match=r"without `cu_seqlens_q` \(decode\) `num_query_tokens` must equal num_seqs"):
        torch.ops.fp8kv.check_paged_attention_indices(tables, lens, None, 3, cache)


# What a caller writing Python values naturally passes where the ops take tensors (or a layer's caches where
# they take the layer): the wrapper names the argument and says what it must be (the op's schema error would
# list the whole signature instead).
WRONG_TYPES = [
    ("paged_attention", "seq_lens", [1, 5, 20], "seq_lens must be an int32 tensor [num_seqs]"),
    ("paged_attention", "block_tables", [[0, 1], [2, 3], [4, 5]], "block_tables must be an int32 tensor"),
    ("paged_attention", "cu_seqlens_q", [0, 1, 3, 6], "cu_seqlens_q must be None or an int32 tensor"),
    ("paged_attention", "layer", torch.zeros(2, 16, 2, 64), "layer must be a KVCacheLayer (PagedKVCache.layer(index)), "
     "got Tensor"),
    ("reshape_and_cache", "slot_mapping", [3, -1, 40, 17, 95], "slot_mapping must be an int64 tensor"),
    ("reshape_and_cache", "layer", (torch.zeros(2, 16, 2, 64),) * 2, "layer must be a KVCacheLayer"),
    ("kv_amax", "k_amax", 0.0, "k_amax must be a float32 tensor"),
]


def wrapper_args(op: str) -> dict:
    """A valid call of fp8kv.ops' `op` on layer 0 of a PagedKVCache."""
    if op == "kv_amax":
        return kv_amax_args("cpu")
    cache = fp8kv.PagedKVCache("fp8_e4m3fn", num_layers=1, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                               num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    raw = OPS[op][1]("cpu")
    if op == "reshape_and_cache":
        return dict(key=raw["key"], value=raw["value"], layer=cache.layer(0), slot_mapping=raw["slot_mapping"])
    return dict(out=raw["out"], query=raw["query"], layer=cache.layer(0), block_tables=raw["block_tables"],
                seq_lens=raw["seq_lens"], cu_seqlens_q=raw["cu_seqlens_q"], softmax_scale=0.125)


@pytest.mark.parametrize("op", ["reshape_and_cache", "paged_attention", "kv_amax"])
def test_the_wrappers_accept_a_valid_call(op):
    getattr(fp8kv.ops, op)(**wrapper_args(op))


@pytest.mark.parametrize("op, argument, value, match", WRONG_TYPES, ids=[f"{c[0]}-{c[1]}" for c in WRONG_TYPES])
def test_a_python_value_for_a_tensor_argument_is_named(op, argument, value, match):
    args = wrapper_args(op)
    args[argument] = value
    with pytest.raises(TypeError, match="^" + re.escape(f"fp8kv.ops.{op}: {match}")):
        getattr(fp8kv.ops, op)(**args)


@pytest.mark.parametrize("op, recipe", [("reshape_and_cache", {"hadamard": True}),
                                        ("paged_attention", {"k_offset": torch.zeros(NUM_KV_HEADS, HEAD_SIZE)}),
                                        ("paged_attention", {"k_scale": torch.ones(1)})])
def test_the_wrappers_take_no_recipe_beside_the_layer(op, recipe):
    """A cache's recipe and scales come with its layer only: the wrappers have no argument through
    which a call could read a cache with another."""
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(recipe))}'"):
        getattr(fp8kv.ops, op)(**wrapper_args(op), **recipe)
