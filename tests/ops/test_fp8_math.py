"""torch.ops.fp8kv.paged_attention(..., fp8_math=True): multi-token queries in FP8 tensor-core math on the
sm_90a kernel, against the float64 reference with the bound the FP8 math adds
(reference.fp8_math_error_bound: the query's and P's e4m3 rounding, the FP8 accumulators), and
the refusals everywhere else.

The long-context test plants "needle" keys (logits above every other key's by a margin) in 32k and
128k-key caches: the FP8 math must retrieve them with the bound's accuracy, which it could not if
its P V accumulated in the FP8 MMAs' accumulator over the whole row (that error grows with the row).
"""

from __future__ import annotations

import math

import pytest
import torch

import fp8kv
import reference
from fp8kv._ops import supported_values
from reference import (CACHE_LAYOUTS, FORMAT_BY_NAME, AttentionReference, add_output_rounding, assert_within, bits,
                       cache_values, covering_grid, fp8_math_error_bound, make_paged_attention_inputs,
                       paged_attention_reference)
from rotated_reference import make_rotated_inputs

FP8_MATH_HEAD_SIZES = list(supported_values("cuda_sm90a_fp8_math_head_sizes"))
SM90A_CAPABILITY = supported_values("cuda_sm90a_capability")
FP8_MATH_FORMATS = ["e4m3fn", "e5m2"]
QUERY_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
NUM_KV_HEADS = 2
SOFT_CAP = 2.0
E4M3 = FORMAT_BY_NAME["e4m3fn"]


def fp8_math_unavailable() -> str | None:
    if not torch.cuda.is_available() or not fp8kv.has_cuda_kernels():
        return "needs a CUDA device and fp8kv's CUDA kernels"
    if torch.cuda.get_device_capability() != SM90A_CAPABILITY:
        return f"the FP8-math kernel runs on compute capability {SM90A_CAPABILITY}"
    return None


needs_fp8_math = pytest.mark.skipif(fp8_math_unavailable() is not None, reason=str(fp8_math_unavailable()))


def case_id(case: dict) -> str:
    return "-".join(f"{k}{v}" if not isinstance(v, bool) else (k if v else f"no_{k}") for k, v in case.items())


CASES = covering_grid(
    {"cache_format": FP8_MATH_FORMATS, "head_size": FP8_MATH_HEAD_SIZES, "gqa": [1, 4, 8]},
    {"dtype": list(QUERY_DTYPES), "per_head": [False, True], "layout": CACHE_LAYOUTS, "block_size": [16, 64],
     "window": [False, True], "soft_cap": [False, True], "strided": [False, True]})


LENGTHS = {  # (seq_lens, q_lens)
    # Whole prompts: several 128-row query tiles, causal diagonal tiles, a one-token prompt, an empty one.
    "prefill": ([300, 1, 0, 129], [300, 1, 0, 129]),
    # Chunks over cached tokens; 64 rows over 1500 cached tokens get a split context.
    "chunked": ([640, 1564, 77, 200], [190, 64, 13, 200]),
    # Draft tokens, sent to the FP8-math kernel by a plan forcing "sm90a" (the planner gives them to
    # the decode kernel): tiles mostly of padding rows.
    "short": ([300, 1000, 1, 64], [4, 4, 1, 8]),
}


@pytest.mark.gpu
@needs_fp8_math
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_fp8_math_within_bound(case, lengths, monkeypatch):
    if lengths == "short":
        monkeypatch.setattr(reference, "FORCED_KERNEL", "sm90a")
    seq_lens, q_lens = LENGTHS[lengths]
    index = CASES.index(case)
    b = case["block_size"]
    inputs = make_paged_attention_inputs(
        seq_lens=seq_lens, q_lens=q_lens, num_heads=NUM_KV_HEADS * case["gqa"], num_kv_heads=NUM_KV_HEADS,
        head_size=case["head_size"], block_size=b, cache_format=case["cache_format"],
        query_dtype=QUERY_DTYPES[case["dtype"]], per_head_scales=case["per_head"], layout=case["layout"],
        sliding_window=b + 5 if case["window"] else -1, logits_soft_cap=SOFT_CAP if case["soft_cap"] else 0.0,
        strided=case["strided"], seed=7000 + index, device="cuda")
    inputs.fp8_math = True
    assert_within(inputs.run(), inputs.reference(), case_id(case))


@pytest.mark.gpu
@needs_fp8_math
@pytest.mark.parametrize("head_size", FP8_MATH_HEAD_SIZES)
@pytest.mark.parametrize("centred", [False, True], ids=["rotated", "rotated+centred"])
@pytest.mark.parametrize("soft_cap", [False, True], ids=["no_cap", "cap"])
def test_fp8_math_rotated_recipe(head_size, centred, soft_cap):
    """The rotated (+ centred) recipe: the query is rotated in fp32, then quantized per row; the K
    offset's logit part comes back before a soft cap."""
    inputs, _, _, _ = make_rotated_inputs(
        seq_lens=[300, 700], q_lens=[300, 150], num_heads=8, num_kv_heads=2, head_size=head_size, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True, centred=centred,
        logits_soft_cap=SOFT_CAP if soft_cap else 0.0, key_shift=2.0, shared_outliers=4.0, seed=head_size + centred,
        device="cuda")
    inputs.fp8_math = True
    assert_within(inputs.run(), inputs.reference(), f"h{head_size}")


@pytest.mark.gpu
@needs_fp8_math
@pytest.mark.parametrize("context", [32768, 131072], ids=["32k", "128k"])
def test_needles_in_a_long_context(context):
    """16 query tokens (x 4 heads per KV head) over a context of 32k / 128k keys with 8 needle keys per
    KV head at random positions: a needle's K is the direction its KV head's queries share, scaled so
    that the needles take about half of an average row's weight (the other half spread over every
    other key), its V a one-hot vector of its own. Each math must stay within its bound at every
    output element (the needles' dims included: that is retrieving them); the relative errors
    against float64 are printed per length and math."""
    generator = torch.Generator().manual_seed(context)
    num_kv_heads, group, head_size, q_len, needles, block = 2, 4, 128, 16, 8, 64
    inputs = make_paged_attention_inputs(
        seq_lens=[context], q_lens=[q_len], num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
        head_size=head_size, block_size=block, cache_format="e4m3fn", query_dtype=torch.bfloat16,
        per_head_scales=True, seed=context, device="cuda")
    direction = torch.randn(num_kv_heads, head_size, generator=generator, dtype=torch.float64)
    direction /= direction.norm(dim=-1, keepdim=True)
    query = inputs.query.double().cpu().view(q_len, num_kv_heads, group, head_size) * 0.5
    query += 2.0 * direction.view(1, num_kv_heads, 1, head_size)
    inputs.query = query.view(q_len, -1, head_size).to(torch.bfloat16).cuda()
    mean_query = inputs.query.double().cpu().view(q_len, num_kv_heads, group, head_size).mean((0, 2))  # [Hkv, D]
    positions = torch.arange(context)
    table = inputs.block_tables[0].long().cpu()
    blocks, offsets = table[positions // block], positions % block
    keys = cache_values(inputs.key_cache, inputs.k_scale).cpu()[blocks, offsets]                    # [n, Hkv, D]
    # V with a mean per channel (real V has one): O then grows with the row instead of averaging out,
    # which is what an accumulator that drops small addends would get wrong.
    values = cache_values(inputs.value_cache, inputs.v_scale).cpu()[blocks, offsets]
    values += 2.0 * torch.randn(1, num_kv_heads, head_size, generator=generator, dtype=torch.float64)
    inputs.v_scale = (values.abs().amax(dim=(0, 2)) / E4M3.max_finite).float().cuda()
    bits(inputs.value_cache)[blocks.cuda(), offsets.cuda()] = E4M3.encode(values / inputs.v_scale.double().cpu().view(1, -1, 1)).cuda()
    needle_positions = torch.randperm(context - q_len, generator=generator)[:needles]
    for h in range(num_kv_heads):
        logits = inputs.softmax_scale * keys[:, h] @ mean_query[h]
        target = torch.logsumexp(logits, 0).item() - math.log(needles)  # the needles' weight ~ 1/2
        key = direction[h] * target / (inputs.softmax_scale * (mean_query[h] @ direction[h]).item())
        dims = torch.randperm(head_size, generator=generator)[:needles]
        for n, position in enumerate(needle_positions.tolist()):
            value = torch.zeros(head_size, dtype=torch.float64)
            value[dims[n]] = 8.0
            block_id, offset = table[position // block].item(), position % block
            for cache, x, scale in ((inputs.key_cache, key, inputs.k_scale), (inputs.value_cache, value, inputs.v_scale)):
                cache[block_id, offset, h] = (x / scale[h].item()).clamp(-448, 448).float().to(cache.dtype).cuda()
    keys, values = cache_values(inputs.key_cache, inputs.k_scale), cache_values(inputs.value_cache, inputs.v_scale)
    args = (inputs.query, keys, values, inputs.block_tables, inputs.seq_lens, inputs.cu_seqlens_q, inputs.softmax_scale)
    errors = {}
    for fp8_math in (False, True):
        inputs.fp8_math = fp8_math
        out = inputs.run()
        reference = paged_attention_reference(*args, product_dtype=None if fp8_math else torch.float16)
        bound = reference.bound + (fp8_math_error_bound(*args) if fp8_math else 0.0)
        assert_within(out, add_output_rounding(AttentionReference(reference.out, bound), out.dtype),
                      f"{context} keys, fp8_math={fp8_math}")
        errors["FP8" if fp8_math else "16-bit"] = ((out.double() - reference.out).norm() / reference.out.norm()).item()
    print(f"\n{context} keys: relative error against float64: 16-bit math {errors['16-bit']:.3e}, "
          f"FP8 math {errors['FP8']:.3e}")


@pytest.mark.gpu
@needs_fp8_math
def test_fp8_math_opcheck():
    """opcheck's schema test compares tensors with torch.allclose, which has no float8 kernel; the
    unquantized-cache cases of test_opcheck.py check the schema this call shares."""
    inputs = make_paged_attention_inputs(
        seq_lens=[200, 90], q_lens=[200, 30], num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
        cache_format="e4m3fn", query_dtype=torch.bfloat16, per_head_scales=True, device="cuda")
    out = torch.empty_like(inputs.query)
    torch.library.opcheck(torch.ops.fp8kv.paged_attention.default, (
        out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.seq_lens,
        inputs.cu_seqlens_q, inputs.softmax_scale, inputs.k_scale, inputs.v_scale, -1, 0.0, False, None, True),
        test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
@needs_fp8_math
def test_fp8_math_under_torch_compile_and_cuda_graphs():
    """fullgraph compile and a captured graph give the eager call's bytes."""
    inputs = make_paged_attention_inputs(
        seq_lens=[300, 90], q_lens=[300, 30], num_heads=8, num_kv_heads=2, head_size=64, block_size=32,
        cache_format="e5m2", query_dtype=torch.float16, per_head_scales=False, device="cuda")
    inputs.fp8_math = True
    eager = inputs.run().clone()

    def attend(out):
        torch.ops.fp8kv.paged_attention(out, inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables,
                                  inputs.seq_lens, inputs.cu_seqlens_q, inputs.softmax_scale, inputs.k_scale,
                                  inputs.v_scale, fp8_math=True)
        return out

    compiled = torch.compile(attend, fullgraph=True)(torch.full_like(eager, math.nan))
    assert torch.equal(compiled, eager)
    out = torch.full_like(eager, math.nan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attend(out)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# ---- refusals (every machine) ---------------------------------------------------------------------


def small_inputs(device: str, cache_format: str = "e4m3fn", head_size: int = 128):
    return make_paged_attention_inputs(
        seq_lens=[40], q_lens=[40], num_heads=4, num_kv_heads=1, head_size=head_size, block_size=16,
        cache_format=cache_format, query_dtype=torch.bfloat16, per_head_scales=False, device=device)


def test_fp8_math_is_refused_on_cpu():
    inputs = small_inputs("cpu")
    inputs.fp8_math = True
    with pytest.raises(RuntimeError, match=r"`fp8_math` needs the CUDA kernels on a compute capability 9\.0 GPU"):
        inputs.run()


@pytest.mark.parametrize("cache_format", ["e4m3fnuz", "none"])
def test_fp8_math_needs_an_e4m3fn_or_e5m2_cache(device, cache_format):
    inputs = small_inputs(device, cache_format)
    inputs.fp8_math = True
    with pytest.raises(RuntimeError, match=r"`fp8_math` needs a float8_e4m3fn or float8_e5m2 cache, got `key_cache`"):
        inputs.run()


@pytest.mark.gpu
def test_fp8_math_refusals_on_the_gpu(monkeypatch):
    """Head sizes without the FP8-math kernel, GPUs without sm_90a, and kernels named without FP8 math."""
    inputs = small_inputs("cuda", head_size=96)
    inputs.fp8_math = True
    with pytest.raises(RuntimeError, match=r"`fp8_math` needs fp8kv built with sm_90a code, a compute capability "
                                           r"9\.0 device and head_size one of 64, 128 \(got 96\)"):
        inputs.run()
    if fp8_math_unavailable() is not None:
        return
    inputs = small_inputs("cuda")
    inputs.fp8_math = True
    for kernel in ("sm80", "decode"):
        monkeypatch.setattr(reference, "FORCED_KERNEL", kernel)
        with pytest.raises(RuntimeError, match=f'`kernel`="{kernel}" names a kernel without FP8 math'):
            inputs.run()
