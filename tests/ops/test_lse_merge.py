"""The log-sum-exp output of paged_attention and merge_attention_states, against float64.

The log-sum-exp reference reads the same cache bytes (reference.cache_values), rotates the query
exactly for the rotated recipe and keeps its K offset in the logits (softmax ignores it, the
log-sum-exp must not). Its bound, per row: the fp32 logits (each a sum of head_size products,
within head_size * u of sum |q_i k_i| times the logit scale), the fp32 exponentials and sums (within
(keys + 8) * u relative), and where the kernel rounds the probabilities to its 16-bit product type
before summing them, that type's unit roundoff eta (a relative error of the sum is an absolute one
of its log). The LSE buffer starts as NaN, so every row must be written.

Merging two states of disjoint key sets must equal attention over their union: checked end to end
(a prefix and the rest of every sequence, as cascade attention splits them) and per element against
the float64 merge.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

import fp8kv
import reference
from fp8kv._ops import supported_values
from reference import (FLOAT32_UNIT_ROUNDOFF, AttentionReference, PagedAttentionInputs, add_output_rounding,
                       assert_within, bits, cache_values, kernel_product_dtype, make_paged_attention_inputs)
from rotated_reference import hadamard_matrix, make_rotated_inputs

SM90A_CAPABILITY = supported_values("cuda_sm90a_capability")


@pytest.fixture(params=["cpu", pytest.param("cuda:auto", marks=pytest.mark.gpu),
                        pytest.param("cuda:sm80", marks=pytest.mark.gpu),
                        pytest.param("cuda:sm90a", marks=pytest.mark.gpu),
                        pytest.param("cuda:decode", marks=pytest.mark.gpu)])
def any_kernel(request, monkeypatch) -> str:
    """The device, and on CUDA each multi-token kernel in turn (the planner's choice, then each one
    forced through the calls' plans)."""
    device, _, kernel = request.param.partition(":")
    if kernel == "sm90a" and torch.cuda.get_device_capability() != SM90A_CAPABILITY:
        pytest.skip(f"the sm90a multi-token kernel runs on compute capability {SM90A_CAPABILITY} only")
    if kernel and kernel != "auto":
        monkeypatch.setattr(reference, "FORCED_KERNEL", kernel)
    return device


def lse_reference(inputs, k_offset=None, rotated=False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 log-sum-exp [num_query_tokens, num_heads] of the logits as the op defines them (-inf for
    a row without keys), a correct fp32 kernel's bound on its error (see the module docstring) before
    any product-type rounding, and the largest softmax_scale * sum |q_i k_i| of each row's keys."""
    keys = cache_values(inputs.key_cache, inputs.k_scale).cpu()
    if k_offset is not None:
        keys = keys + k_offset.double().cpu().view(1, 1, *k_offset.shape)
    query = inputs.query.cpu().double()
    if rotated:
        query = query @ hadamard_matrix(query.shape[-1])
    num_tokens, num_heads, head_size = query.shape
    group = num_heads // keys.shape[2]
    block_size = keys.shape[1]
    lens = inputs.seq_lens.tolist()
    cu = inputs.cu_seqlens_q.tolist() if inputs.cu_seqlens_q is not None else list(range(len(lens) + 1))
    tables = inputs.block_tables.cpu().long()
    lse = torch.full((num_tokens, num_heads), -math.inf, dtype=torch.float64)
    bound = torch.zeros(num_tokens, num_heads, dtype=torch.float64)
    magnitudes = torch.zeros(num_tokens, num_heads, dtype=torch.float64)
    u = FLOAT32_UNIT_ROUNDOFF
    for seq, seq_len in enumerate(lens):
        q_len = cu[seq + 1] - cu[seq]
        for j in range(q_len):
            end = seq_len - q_len + j + 1
            begin = max(0, end - inputs.sliding_window) if inputs.sliding_window > 0 else 0
            if end <= begin:
                continue
            positions = torch.arange(begin, end)
            k = keys[tables[seq, positions // block_size], positions % block_size]  # [n, kv_heads, D]
            k = k.repeat_interleave(group, dim=1)
            q = query[cu[seq] + j]  # [H, D]
            logits = inputs.softmax_scale * torch.einsum("hd,nhd->hn", q, k)
            magnitude = inputs.softmax_scale * torch.einsum("hd,nhd->hn", q.abs(), k.abs()).amax(dim=1)
            if inputs.logits_soft_cap > 0:
                logits = inputs.logits_soft_cap * torch.tanh(logits / inputs.logits_soft_cap)
            row_lse = torch.logsumexp(logits, dim=1)
            lse[cu[seq] + j] = row_lse
            bound[cu[seq] + j] = (head_size + 8) * u * magnitude + (len(positions) + 8) * u * (1 + row_lse.abs())
            magnitudes[cu[seq] + j] = magnitude
    return lse, bound, magnitudes


def assert_lse_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str = "") -> None:
    got = got.double().cpu()
    empty = want == -math.inf
    assert torch.equal(got[empty], want[empty]), f"{what}: rows without keys must have -inf"
    err = (got[~empty] - want[~empty]).abs()
    excess = err - bound[~empty]
    assert not torch.isnan(err).any() and (excess <= 0).all(), (
        f"{what}: log-sum-exp off by {err.max().item():.3g} where the bound is {bound[~empty].min().item():.3g}"
        f" .. {bound[~empty].max().item():.3g}")


def product_roundoff(inputs, device: str) -> float:
    """The CUDA kernels round the probabilities to their 16-bit product type (docs/ops.md)."""
    dtype = kernel_product_dtype(inputs.key_cache)
    return 0.0 if device == "cpu" or dtype is None else torch.finfo(dtype).eps / 2


def run_with_lse(inputs, transposed: bool, **recipe) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(inputs.query, math.nan) if inputs.out is None else inputs.out.fill_(math.nan)
    shape = inputs.query.shape[:2]
    lse = torch.full(shape[::-1] if transposed else shape, math.nan, device=inputs.query.device)
    lse = lse.t() if transposed else lse
    torch.ops.fp8kv.paged_attention(out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                              inputs.seq_lens, inputs.cu_seqlens_q, inputs.softmax_scale, inputs.k_scale,
                              inputs.v_scale, inputs.sliding_window, inputs.logits_soft_cap, lse=lse,
                              fp8_math=inputs.fp8_math, **recipe, **inputs.forced_plan(lse=True))
    return out, lse


# (decode, cache format, query dtype, window, soft cap, per-head scales, strided, gqa)
PLAIN_CASES = [
    (True, "e4m3fn", torch.float16, False, False, False, False, 4),
    (True, "e5m2", torch.bfloat16, True, True, True, True, 1),
    (True, "none", torch.bfloat16, False, True, True, False, 8),
    (False, "e4m3fn", torch.bfloat16, False, False, True, True, 4),
    (False, "e4m3fnuz", torch.float16, True, False, False, False, 8),
    (False, "none", torch.float16, True, True, False, True, 1),
]


@pytest.mark.parametrize("decode, cache_format, dtype, window, soft_cap, per_head, strided, gqa", PLAIN_CASES)
def test_lse_matches_float64(any_kernel, decode, cache_format, dtype, window, soft_cap, per_head, strided, gqa):
    """Decode (a padding row of seq_len 0: -inf) and multi-token rows (a sequence without query rows,
    a long one), windows, soft caps, every cache kind; the output beside it still within its bound,
    and on the CPU bit for bit the output without the log-sum-exp."""
    block_size = 16
    seq_lens = [37, 0, 300, 1] if decode else [20, 45, 16, 290]
    q_lens = None if decode else [20, 5, 0, 17]
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=q_lens, num_heads=2 * gqa, num_kv_heads=2, head_size=128, block_size=block_size,
        cache_format=cache_format, query_dtype=dtype, per_head_scales=per_head, layout="HND",
        sliding_window=block_size + 5 if window else -1, logits_soft_cap=2.0 if soft_cap else 0.0, strided=strided,
        seed=len(seq_lens) * gqa, device=any_kernel)
    out, lse = run_with_lse(inputs, transposed=strided)
    want, bound, _ = lse_reference(inputs)
    assert_lse_within(lse, want, bound + product_roundoff(inputs, any_kernel), "lse")
    assert_within(out, inputs.reference(), "out beside lse")
    if any_kernel == "cpu":
        assert torch.equal(bits(out), bits(inputs.run())), "the output does not depend on asking for the lse"


@pytest.mark.parametrize("centred", [False, True], ids=["rotated", "rotated_centred"])
@pytest.mark.parametrize("soft_cap", [0.0, 5.0], ids=["no_cap", "cap"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "multi_token"])
def test_lse_of_the_rotated_recipe_keeps_the_k_offset(any_kernel, centred, soft_cap, decode):
    """Without a soft cap the kernels leave q . k_offset out of the logits (softmax ignores it); the
    log-sum-exp must hold it, or a merge with a state from another kernel would weigh it wrongly.
    key_shift makes the offset large (several units of the logits)."""
    inputs, _, _, _ = make_rotated_inputs(
        seq_lens=[70, 0, 33] if decode else [70, 9, 33], q_lens=None if decode else [6, 0, 17], num_heads=8,
        num_kv_heads=2, head_size=128, block_size=16, cache_format="e4m3fn", query_dtype=torch.bfloat16,
        per_head_scales=True, centred=centred, logits_soft_cap=soft_cap, key_shift=3.0, seed=7, device=any_kernel)
    out, lse = run_with_lse(inputs, transposed=False, hadamard=True, k_offset=inputs.k_offset)
    want, bound, _ = lse_reference(inputs, inputs.k_offset, rotated=True)
    # The CUDA kernels also round the rotated query to their 16-bit product type (docs/ops.md): a logit
    # moves by up to that type's unit roundoff times softmax_scale * sum |q'_i k_i| over the stored keys.
    _, _, stored_magnitudes = lse_reference(inputs, rotated=True)
    bound = 2 * bound + product_roundoff(inputs, any_kernel) * (1 + stored_magnitudes)
    assert_lse_within(lse, want, bound, "rotated lse")
    assert_within(out, inputs.reference(), "out beside lse")


@pytest.mark.gpu
@pytest.mark.parametrize("rotated", [False, True], ids=["plain", "rotated"])
def test_lse_of_fp8_math(rotated):
    """The FP8-math kernel scales its probabilities by 2^8 (docs/ops.md); the log-sum-exp undoes it.
    Bound: the query's e4m3 rounding moves each logit by at most 2^-4 of sum |q_i k_i| times the
    scale, and the probabilities' e4m3 rounding the sum by at most 2^-4 relative."""
    if torch.cuda.get_device_capability() != SM90A_CAPABILITY:
        pytest.skip(f"FP8 math runs on compute capability {SM90A_CAPABILITY} only")
    common = dict(seq_lens=[700, 40, 300], q_lens=[64, 40, 30], num_heads=8, num_kv_heads=2, head_size=128,
                  block_size=16, cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True,
                  seed=3, device="cuda")
    if rotated:
        inputs, _, _, _ = make_rotated_inputs(**common, centred=False)
        inputs.fp8_math = True
        _, lse = run_with_lse(inputs, transposed=False, hadamard=True)
        want, _, magnitude = lse_reference(inputs, rotated=True)
    else:
        inputs = make_paged_attention_inputs(**common)
        inputs.fp8_math = True
        _, lse = run_with_lse(inputs, transposed=False)
        want, _, magnitude = lse_reference(inputs)
    assert_lse_within(lse, want, 2**-4 * magnitude + 2**-3, "fp8 math lse")


def block_aligned_split(inputs, prefix_blocks: int):
    """Decode rows over a prefix of every sequence (its first prefix_blocks blocks) and over the rest:
    two paged_attention calls whose key sets partition the full one's (cascade attention's split)."""
    block_size = inputs.key_cache.shape[1]
    lens = inputs.seq_lens
    prefix = (lens.clamp(max=prefix_blocks * block_size)).to(torch.int32)
    rest = (lens - prefix).to(torch.int32)
    rest_tables = inputs.block_tables[:, prefix_blocks:].contiguous()
    return (inputs.block_tables, prefix), (rest_tables, rest)


def test_merged_split_equals_attention_over_the_union(device):
    """Cascade attention: attention over each sequence's first blocks and over the rest, merged, is
    attention over the whole. A sequence shorter than the prefix has an empty rest (-inf), one of
    length 0 both empty (zeros, -inf). Bound: each part's own bound weighted by its share, the weights'
    error from the parts' log-sum-exp errors, the merge's fp32 arithmetic and its output rounding."""
    inputs = make_paged_attention_inputs(
        seq_lens=[100, 20, 0, 300], q_lens=None, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.float16, per_head_scales=True, seed=11, device=device)
    states, lse_parts, parts_bound, weights_error = [], [], [], 0.0
    for tables, lens in block_aligned_split(inputs, prefix_blocks=2):
        part = PagedAttentionInputs(
            query=inputs.query, key_cache=inputs.key_cache, value_cache=inputs.value_cache, block_tables=tables,
            seq_lens=lens, cu_seqlens_q=None, softmax_scale=inputs.softmax_scale, k_scale=inputs.k_scale,
            v_scale=inputs.v_scale)
        out, lse = run_with_lse(part, transposed=False)
        want_lse, lse_bound, _ = lse_reference(part)
        states.append((out, lse))
        lse_parts.append(want_lse)
        parts_bound.append(part.reference().bound.cpu())
        weights_error = weights_error + lse_bound + product_roundoff(part, device)
    out = torch.full_like(inputs.query, math.nan)
    lse = torch.full(inputs.query.shape[:2], math.nan, device=device)
    fp8kv.ops.merge_attention_states(out, lse, states[0][0], states[0][1], states[1][0], states[1][1])

    want_lse, lse_bound, _ = lse_reference(inputs)
    assert_lse_within(lse, want_lse, lse_bound + weights_error, "merged lse")
    total = want_lse.masked_fill(want_lse == -math.inf, 0.0)
    shares = torch.stack([torch.exp(part_lse - total) for part_lse in lse_parts]).unsqueeze(-1)  # [2, T, H, 1]
    magnitudes = states[0][0].double().abs().cpu() + states[1][0].double().abs().cpu()
    bound = (shares * torch.stack(parts_bound)).sum(0) + (weights_error.unsqueeze(-1) + 8 * FLOAT32_UNIT_ROUNDOFF) * magnitudes
    reference = inputs.reference()
    assert_within(out, add_output_rounding(AttentionReference(reference.out.cpu(), bound), torch.float16),
                  "merged out")


def merge_reference(out_a, lse_a, out_b, lse_b):
    """float64 merge; a side with lse -inf contributes nothing, whatever its output holds."""
    la, lb = lse_a.double().cpu(), lse_b.double().cpu()
    m = torch.maximum(la, lb)
    empty = m == -math.inf
    m = m.masked_fill(empty, 0.0)
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    xa = out_a.double().cpu().masked_fill((wa == 0).unsqueeze(-1), 0.0)
    xb = out_b.double().cpu().masked_fill((wb == 0).unsqueeze(-1), 0.0)
    total = (wa + wb).masked_fill(empty, 1.0)
    out = (wa.unsqueeze(-1) * xa + wb.unsqueeze(-1) * xb) / total.unsqueeze(-1)
    lse = torch.where(empty, -math.inf, m + torch.log(total))
    # fp32 weights: exponentials, a division and the exponent's argument (relative to |lse_a - lse_b|).
    spread = torch.where((wa == 0) | (wb == 0), 0.0, (la - lb).abs())
    bound = ((spread + 8) * FLOAT32_UNIT_ROUNDOFF).unsqueeze(-1) * (xa.abs() + xb.abs())
    return out, lse, bound, (8 * FLOAT32_UNIT_ROUNDOFF) * (2 + lse.abs())


def random_states(num_tokens, num_heads, head_size, dtype, device, seed):
    """Two states with log-sum-exps spread over +-20, rows whose one side has no keys (-inf, NaN
    output) and rows where neither has; outputs padded (strided), log-sum-exps transposed."""
    generator = torch.Generator().manual_seed(seed)
    lse_a = torch.randn(num_tokens, num_heads, generator=generator) * 10
    lse_b = torch.randn(num_tokens, num_heads, generator=generator) * 10
    lse_a[0::5, 0] = -math.inf
    lse_b[1::5, 0] = -math.inf
    lse_a[2::5, -1] = lse_b[2::5, -1] = -math.inf
    states = []
    for lse in (lse_a, lse_b):
        out = torch.randn(num_tokens, num_heads, head_size + 8, generator=generator)[..., :head_size]
        out[lse == -math.inf] = math.nan
        states += [out.to(dtype).to(device), lse.t().contiguous().to(device).t()]
    return states


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_merge_matches_float64(device, dtype):
    out_a, lse_a, out_b, lse_b = random_states(23, 5, 72, dtype, device, seed=5)
    out = torch.full((23, 5, 80), math.nan, dtype=dtype, device=device)[..., :72]
    lse = torch.full((23, 5), math.nan, device=device)
    fp8kv.ops.merge_attention_states(out, lse, out_a, lse_a, out_b, lse_b)
    want_out, want_lse, out_bound, lse_bound = merge_reference(out_a, lse_a, out_b, lse_b)
    rounding = torch.finfo(dtype).eps / 2 * want_out.abs()
    err = (out.double().cpu() - want_out).abs()
    assert not torch.isnan(err).any(), "a side without keys entered the merge"
    assert (err <= out_bound + rounding).all(), f"out off by {err.max().item():.3g}"
    assert_lse_within(lse, want_lse, lse_bound, "merged lse")
    both_empty = want_lse == -math.inf
    assert both_empty.any() and (out.cpu()[both_empty] == 0).all(), "rows without keys merge to zeros"


def test_merge_without_lse_output_and_nan_lse(device):
    """lse None writes only `out`; a NaN log-sum-exp makes its row NaN (not a silent number)."""
    out_a, lse_a, out_b, lse_b = random_states(4, 2, 16, torch.float32, device, seed=1)
    lse_a[3, 1] = math.nan
    out = torch.empty_like(out_a)
    fp8kv.ops.merge_attention_states(out, None, out_a, lse_a, out_b, lse_b)
    assert torch.isnan(out[3, 1]).all()
    assert not torch.isnan(out[:3]).any()


@pytest.mark.parametrize("call, match", [
    (lambda t: t.pa(lse=torch.zeros(t.rows, t.heads, dtype=torch.float64, device=t.device)), r"`lse` must be float32"),
    (lambda t: t.pa(lse=torch.zeros(t.rows + 1, t.heads, device=t.device)),
     r"`lse` must have shape \[num_tokens, num_heads\] = \[3, 4\] like `query`"),
    (lambda t: t.pa(lse=torch.zeros(t.rows, t.heads, device="meta" if t.device == "cpu" else "cpu")),
     r"`lse` must be on"),
    (lambda t: t.pa(lse=t.out.view(torch.float32)[..., 0]), r"`out` and `lse` must be distinct tensors"),
    (lambda t: t.pa(lse=torch.zeros(1, t.heads, device=t.device).expand(t.rows, t.heads)), r"`lse` must not have overlapping elements"),
    (lambda t: t.merge(out_b=t.out_a[:, :1]), r"`out_b` must have the shape of `out_a`"),
    (lambda t: t.merge(out=t.out_a.clone().float()), r"`out` must have the dtype of `out_a`"),
    (lambda t: t.merge(lse_a=t.lse_a[:, :1]), r"`lse_a` must have shape \[num_tokens, num_heads\] = \[3, 4\] like `out_a`"),
    (lambda t: t.merge(lse_b=t.lse_b.double()), r"`lse_b` must be float32"),
    (lambda t: t.merge(out=t.out_a), r"output `out` must not overlap input `out_a`"),
    (lambda t: t.merge(lse=t.lse_a), r"output `lse` must not overlap input `lse_a`"),
    (lambda t: t.merge(out_a=t.out_a.to(torch.float8_e4m3fn)), r"`out_a` must be float16, bfloat16 or float32"),
])
def test_bad_lse_and_merge_arguments_are_named(device, call, match):
    class Case:
        pass
    t = Case()
    t.device, t.rows, t.heads = device, 3, 4
    inputs = make_paged_attention_inputs(
        seq_lens=[5, 9, 2], q_lens=None, num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
        cache_format="e4m3fn", query_dtype=torch.float16, per_head_scales=False, device=device)
    t.out = torch.empty_like(inputs.query)

    def pa(lse):
        torch.ops.fp8kv.paged_attention(t.out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                                  inputs.seq_lens, None, 0.125, inputs.k_scale, inputs.v_scale, lse=lse)

    t.out_a, t.lse_a, t.out_b, t.lse_b = random_states(3, 4, 16, torch.float16, device, seed=2)

    def merge(**changed):
        args = dict(out=torch.empty_like(t.out_a), lse=torch.empty_like(t.lse_a), out_a=t.out_a, lse_a=t.lse_a,
                    out_b=t.out_b, lse_b=t.lse_b)
        args.update(changed)
        fp8kv.ops.merge_attention_states(**args)

    t.pa, t.merge = pa, merge
    with pytest.raises(RuntimeError, match=match):
        call(t)


def test_opcheck(device):
    """Schema (the optional mutated lse), fakes and AOT dispatch of both ops with an lse output. An
    unquantized cache: opcheck's schema test compares tensors with allclose, which has no float8 kernel."""
    inputs = make_paged_attention_inputs(
        seq_lens=[3, 17, 9], q_lens=[3, 4, 1], num_heads=8, num_kv_heads=2, head_size=64, block_size=8,
        cache_format="none", query_dtype=torch.float16, per_head_scales=True, device=device)
    out = torch.zeros_like(inputs.query)
    lse = torch.zeros(inputs.query.shape[:2], device=device)
    torch.library.opcheck(torch.ops.fp8kv.paged_attention.default, (
        out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.seq_lens,
        inputs.cu_seqlens_q, inputs.softmax_scale, inputs.k_scale, inputs.v_scale, -1, 0.0, False, None, False, lse))
    out_a, lse_a, out_b, lse_b = random_states(6, 3, 32, torch.bfloat16, device, seed=3)
    for merged_lse in (torch.zeros(6, 3, device=device), None):
        torch.library.opcheck(torch.ops.fp8kv.merge_attention_states.default,
                              (torch.zeros_like(out_a), merged_lse, out_a, lse_a, out_b, lse_b))


def cascade_step(query, key_cache, value_cache, prefix_tables, prefix_lens, rest_tables, rest_lens, k_scale, v_scale,
                 out, parts, lse_parts):
    """Attention over a shared prefix and over each sequence's rest, merged: one graph."""
    for i, (tables, lens) in enumerate(((prefix_tables, prefix_lens), (rest_tables, rest_lens))):
        torch.ops.fp8kv.paged_attention(parts[i], query, key_cache, value_cache, tables, lens, None,
                                  query.shape[-1] ** -0.5, k_scale, v_scale, lse=lse_parts[i])
    fp8kv.ops.merge_attention_states(out, None, parts[0], lse_parts[0], parts[1], lse_parts[1])
    return out


def test_compiled_cascade_matches_eager(device):
    """torch.compile(fullgraph=True) through both ops with their optional lse: one graph of three ops,
    no recompilation for new values, the same bits as eager."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(cascade_step, backend=counter, fullgraph=True)
    try:
        for seed in (0, 1):
            inputs = make_paged_attention_inputs(
                seq_lens=[40, 70, 3], q_lens=None, num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True, seed=seed, device=device)
            (prefix_tables, prefix_lens), (rest_tables, rest_lens) = block_aligned_split(inputs, prefix_blocks=2)
            results = []
            for fn in (cascade_step, compiled):
                parts = [torch.empty_like(inputs.query) for _ in range(2)]
                lse_parts = [torch.empty(inputs.query.shape[:2], device=device) for _ in range(2)]
                out = torch.empty_like(inputs.query)
                fn(inputs.query, inputs.key_cache, inputs.value_cache, prefix_tables, prefix_lens, rest_tables,
                   rest_lens, inputs.k_scale, inputs.v_scale, out, parts, lse_parts)
                results.append((out, lse_parts))
            assert torch.equal(bits(results[0][0]), bits(results[1][0])), f"out, call {seed}"
            for eager_lse, compiled_lse in zip(results[0][1], results[1][1]):
                assert torch.equal(eager_lse, compiled_lse), f"lse, call {seed}"
        assert counter.frame_count == 1, "compiled once, as one graph"
        assert counter.op_count == 3, "the graph holds the three ops"
    finally:
        torch._dynamo.reset()
