"""Plans: fp8kv.ops.plan_paged_attention, made once per step from sizes, given to every layer's call.

A planned call gives the unplanned call's bytes (the plan is what the call would make itself), refuses a
plan made for other sizes and a workspace smaller than its plan's, and the plan op checks its sizes as
paged_attention checks them. The CUDA-only behaviour (forcing a kernel, plans that differ with `lse`) is
in tests/kernels/test_cuda_kernels.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp8kv
from fp8kv.rotation import Rotation
from reference import make_paged_attention_inputs

# (decode, sliding_window, lse)
CASES = [(True, -1, False), (True, 20, True), (False, -1, False), (False, -1, True), (False, 20, False)]


def layer_of(inputs) -> fp8kv.KVCacheLayer:
    """The inputs' caches as a plain-recipe layer (the ops read the layer's tensors as they are)."""
    return fp8kv.KVCacheLayer(fp8kv.KVCacheDtype.E4M3FN, inputs.key_cache, inputs.value_cache, inputs.k_scale,
                              inputs.v_scale, Rotation.NONE, None)


def attend(inputs, layer, plan=None, lse: bool = False):
    out = torch.full_like(inputs.query, math.nan)
    row_lse = torch.full(inputs.query.shape[:2], math.nan, device=inputs.query.device) if lse else None
    fp8kv.ops.paged_attention(out, inputs.query, layer, inputs.block_tables, inputs.seq_lens, inputs.cu_seqlens_q,
                              inputs.softmax_scale, inputs.sliding_window, lse=row_lse, plan=plan)
    return out, row_lse


def inputs_for(decode: bool, window: int, device: str, cache_format: str = "e4m3fn"):
    return make_paged_attention_inputs(
        seq_lens=[37, 300, 1, 90], q_lens=None if decode else [5, 40, 1, 90], num_heads=8, num_kv_heads=2,
        head_size=64, block_size=16, cache_format=cache_format, query_dtype=torch.bfloat16, per_head_scales=True,
        sliding_window=window, device=device)


@pytest.mark.parametrize("decode, window, lse", CASES)
def test_a_planned_call_gives_the_unplanned_calls_bytes(device, decode, window, lse):
    inputs = inputs_for(decode, window, device)
    layer = layer_of(inputs)
    plan = fp8kv.ops.plan_paged_attention(layer, inputs.block_tables, inputs.cu_seqlens_q, *inputs.query.shape[:2],
                                          sliding_window=window, lse=lse)
    assert plan.workspace.device == inputs.query.device and plan.workspace.numel() == plan.values[0]
    assert plan.num_splits >= (2 if lse and device == "cuda" else 1)
    assert plan.kernel in {"cpu": ("cpu",), "cuda": ("decode", "sm80", "sm90a", "hip")}[device]
    want_out, want_lse = attend(inputs, layer, lse=lse)
    for _ in range(2):  # the workspace is reused, as by the layers of a step
        out, row_lse = attend(inputs, layer, plan, lse)
        assert torch.equal(out, want_out)
        assert not lse or torch.equal(row_lse, want_lse)


def test_a_plan_made_for_another_call_is_refused(device):
    inputs = inputs_for(False, -1, device)
    layer = layer_of(inputs)
    plan = fp8kv.ops.plan_paged_attention(layer, inputs.block_tables, inputs.cu_seqlens_q, *inputs.query.shape[:2])
    for values in ((), (7,), (*plan.values, 0), tuple(v + 1 for v in plan.values)):
        other = fp8kv.ops.AttentionPlan(values, plan.workspace)
        with pytest.raises(RuntimeError, match="`plan`"):
            attend(inputs, layer, other)
    # A plan for decode calls of the same table is not a multi-token call's (on CUDA); on the CPU every
    # plan is the one kernel's, and any is accepted where its values are the CPU's.
    decode = inputs_for(True, -1, device)
    decode_plan = fp8kv.ops.plan_paged_attention(layer_of(decode), decode.block_tables, None, *decode.query.shape[:2])
    if decode_plan.values != plan.values:
        with pytest.raises(RuntimeError, match="is not this call's plan"):
            attend(inputs, layer, decode_plan)


def test_a_workspace_smaller_than_the_plan_or_elsewhere_is_refused(device):
    inputs = inputs_for(False, -1, device)
    layer = layer_of(inputs)
    values = torch.ops.fp8kv.plan_paged_attention(layer.key_cache, inputs.block_tables, inputs.cu_seqlens_q,
                                                  *inputs.query.shape[:2], lse=True)
    args = (torch.empty_like(inputs.query), inputs.query, layer.key_cache, layer.value_cache, inputs.block_tables,
            inputs.seq_lens, inputs.cu_seqlens_q, inputs.softmax_scale, layer.k_scale, layer.v_scale)
    lse = torch.empty(inputs.query.shape[:2], device=device)
    if values[0] > 0:
        small = torch.empty(values[0] - 1, dtype=torch.uint8, device=device)
        with pytest.raises(RuntimeError, match=rf"`workspace` must be a contiguous tensor of at least the plan's "
                                               rf"{values[0]} bytes, got {values[0] - 1} bytes"):
            torch.ops.fp8kv.paged_attention(*args, lse=lse, plan=values, workspace=small)
        strided = torch.empty(2 * values[0], dtype=torch.uint8, device=device)[::2]
        with pytest.raises(RuntimeError, match=r"\(not contiguous\)"):
            torch.ops.fp8kv.paged_attention(*args, lse=lse, plan=values, workspace=strided)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="`workspace` must be on"):
            torch.ops.fp8kv.paged_attention(*args, lse=lse, plan=values,
                                            workspace=torch.empty(values[0], dtype=torch.uint8))


def test_the_plan_op_checks_its_sizes_as_the_call_does():
    inputs = inputs_for(True, -1, "cpu")
    cache, tables = inputs.key_cache, inputs.block_tables
    plan = torch.ops.fp8kv.plan_paged_attention
    op = "fp8kv.plan_paged_attention: "
    with pytest.raises(RuntimeError, match=op + "`num_heads` must be >= 1, got 0"):
        plan(cache, tables, None, 4, 0)
    with pytest.raises(RuntimeError, match=op + r"`num_heads` \(7\) must be a multiple of the cache's num_kv_heads \(2\)"):
        plan(cache, tables, None, 4, 7)
    with pytest.raises(RuntimeError, match=op + r"without `cu_seqlens_q` \(decode\) `num_query_tokens` must have one "
                                                 "row per sequence: 4 rows, got 5"):
        plan(cache, tables, None, 5, 8)
    with pytest.raises(RuntimeError, match=op + "`num_query_tokens` must be >= 0"):
        plan(cache, tables, torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32), -1, 8)
    with pytest.raises(RuntimeError, match=op + "`block_tables` must be int32, got Long"):
        plan(cache, tables.long(), None, 4, 8)
    with pytest.raises(RuntimeError, match=op + r"`cu_seqlens_q` must have num_seqs \+ 1 = 5 entries, got 4"):
        plan(cache, tables, torch.zeros(4, dtype=torch.int32), 4, 8)
    with pytest.raises(RuntimeError, match=op + "`key_cache` must be"):
        plan(cache.float(), tables, None, 4, 8)
    with pytest.raises(RuntimeError, match=op + "`sliding_window` must be -1"):
        plan(cache, tables, None, 4, 8, sliding_window=0)
    with pytest.raises(RuntimeError, match=op + '`kernel` must be "auto" on the CPU'):
        plan(cache, tables, None, 4, 8, kernel="sm80")
    with pytest.raises(RuntimeError, match=op + "`fp8_math` needs the CUDA kernels"):
        plan(cache, tables, None, 4, 8, fp8_math=True)


def test_the_wrapper_names_a_plan_that_is_not_one():
    inputs = inputs_for(True, -1, "cpu")
    with pytest.raises(TypeError, match=r"fp8kv.ops.paged_attention: plan must be None or an AttentionPlan "
                                        r"\(fp8kv.ops.plan_paged_attention\), got list"):
        attend(inputs, layer_of(inputs), [0, 0, 0, 1])


def test_plans_are_made_outside_traced_code():
    inputs = inputs_for(True, -1, "cpu")
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="plans are made from real tensors outside traced"):
        torch.ops.fp8kv.plan_paged_attention(mode.from_tensor(inputs.key_cache), mode.from_tensor(inputs.block_tables),
                                             None, 4, 8)


def test_opcheck_of_a_planned_call(device):
    # An unquantized cache: opcheck's schema check compares tensors with arithmetic FP8 tensors lack.
    inputs = inputs_for(False, -1, device, cache_format="none")
    values = torch.ops.fp8kv.plan_paged_attention(inputs.key_cache, inputs.block_tables, inputs.cu_seqlens_q,
                                                  *inputs.query.shape[:2], lse=True)
    torch.library.opcheck(torch.ops.fp8kv.paged_attention.default, (
        torch.empty_like(inputs.query), inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
        inputs.seq_lens, inputs.cu_seqlens_q, inputs.softmax_scale, inputs.k_scale, inputs.v_scale), {
        "lse": torch.empty(inputs.query.shape[:2], device=device), "plan": values,
        "workspace": torch.empty(values[0], dtype=torch.uint8, device=device)})
    # The plan op returns host values: its schema and autograd registration (it has no fake to compare).
    torch.library.opcheck(torch.ops.fp8kv.plan_paged_attention.default,
                          (inputs.key_cache, inputs.block_tables, inputs.cu_seqlens_q, *inputs.query.shape[:2]),
                          test_utils=("test_schema", "test_autograd_registration"))


def test_paged_attention_plans_once_per_step(monkeypatch):
    """The layers of a step share its plan: PagedAttention plans at the first layer's call only."""
    made = []
    plan_paged_attention = fp8kv.ops.plan_paged_attention
    monkeypatch.setattr(fp8kv.ops, "plan_paged_attention", lambda *a, **k: made.append(a) or plan_paged_attention(*a, **k))
    cache = fp8kv.PagedKVCache("fp8", num_kv_heads=2, head_size=64, num_layers=3, num_blocks=8)
    attention = fp8kv.PagedAttention(8, 2, 64)
    for step, tokens in enumerate(([5, 7], [1, 1])):
        if step == 0:
            cache.add_sequence("a"), cache.add_sequence("b")
        batch = cache.prepare(["a", "b"], tokens)
        query = torch.randn(sum(tokens), 8, 64, dtype=torch.bfloat16)
        key, value = torch.randn(2, sum(tokens), 2, 64, dtype=torch.bfloat16)
        for index in range(3):
            out = attention(query, key, value, cache.layer(index), batch)
            unplanned = torch.empty_like(query)
            fp8kv.ops.paged_attention(unplanned, query, cache.layer(index), batch.block_tables, batch.seq_lens,
                                      batch.cu_seqlens_q, 64 ** -0.5)
            assert torch.equal(out, unplanned)
        assert len(made) == step + 1
