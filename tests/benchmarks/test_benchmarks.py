"""CPU tests of the benchmark scripts: everything that does not need a GPU.

    python -m pytest -q tests/benchmarks

Covered: shape tables and byte/FLOP counts (against independent arithmetic and brute-force sums),
the random paged caches (poisoned tails, HND storage, gathers, mixed batches), their rotated +
centred copies (the recipe's parameters against float64, the contract's bytes, the same poisoned
tails, the values mapped back), the float32 reference (against a float64 loop), SDPA in each form with
its causal alignment, the column glue run through fp8kv's CPU kernels (attention within tolerance of
each column's own reference, cache bytes identical to the PyTorch quantize path or, rotated, to the
contract's, maxima exact), the measuring harness (failures recorded per column, graph outputs poisoned and
checked), FlashInfer's page description, PASS/MISS judgement on synthetic rows, JSON + PNG output,
and whole runs of every benchmark's main() with CUDA's timing calls replaced by host clocks
(bench_generate: a tiny model on the CPU, with its host profile), also with an fp8kv that refuses the
rotated recipe (its columns record why, the plain ones still run).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import attention_cases as cases  # noqa: E402
import bench_kv_amax as amax  # noqa: E402
import bench_paged_attention as decode  # noqa: E402
import bench_prefill as prefill  # noqa: E402
import bench_reshape_and_cache as write  # noqa: E402
import common  # noqa: E402
import flashinfer_baseline  # noqa: E402

CPU = torch.device("cpu")
MiB = 1 << 20
TINY = cases.Model("tiny GQA", 4, 2, 32)
ops, ops_reason = common.load_fp8kv(require_cuda=False)
needs_fp8kv = pytest.mark.skipif(ops is None, reason=ops_reason)
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib is not installed (the PNG output needs it)")


# ---------------------------------------------------------------------------------------------
# Shapes and counts
# ---------------------------------------------------------------------------------------------

def test_models_have_their_published_geometry():
    geometry = {m.name: (m.num_heads, m.num_kv_heads, m.head_size) for m in (
        cases.LLAMA3_8B, cases.LLAMA2_7B, cases.LLAMA3_70B_TP8, cases.LLAMA32_1B, cases.GEMMA3_12B, cases.SMOLLM2_135M)}
    assert geometry == {"Llama-3-8B": (32, 8, 128), "Llama-2-7B": (32, 32, 128), "Llama-3-70B TP8": (64 // 8, 8 // 8, 128),
                        "Llama-3.2-1B": (32, 8, 64), "Gemma-3-12B": (16, 8, 256), "SmolLM2-135M": (9, 3, 64)}


def test_decode_shapes():
    shapes = decode.default_shapes()
    labels = [s.label for s in shapes]
    assert len(labels) == len(set(labels)) == 7 * 2 + 4 + 1 + 1
    assert "Llama-3-8B decode B64 x 4k" in labels and "Llama-3-8B decode B1 x 128k bs64" in labels
    assert labels[-1] == "Llama-3-8B decode B64 x 4k bs256 +64 empty"
    assert [s.empty_rows for s in shapes] == [0] * (len(shapes) - 1) + [64]
    llama3 = {(s.batch, s.context) for s in shapes if s.model == cases.LLAMA3_8B and s.block_size == 16}
    assert llama3 == {(1, 32768), (1, 131072), (16, 4096), (64, 4096), (16, 16384), (128, 2048), (256, 1024)}
    others = [s for s in shapes if s.model != cases.LLAMA3_8B]
    assert {s.model.name for s in others} == {"Llama-2-7B", "Llama-3-70B TP8", "Llama-3.2-1B", "Gemma-3-12B", "SmolLM2-135M"}
    assert all((s.batch, s.context) == ((64, 7680) if s.model == cases.SMOLLM2_135M else (64, 4096)) for s in others)


@needs_fp8kv
def test_decode_rows_of_length_0_after_the_batch_change_nothing_of_its_rows():
    ops = torch.ops.fp8kv  # the raw operators, as the benchmarks call them (common.load_fp8kv)

    device = torch.device("cpu")
    padded = decode.DecodeShape(cases.LLAMA3_8B, 2, 40, block_size=16, empty_rows=3)
    case = decode.make_case(padded, device, seed=0)
    plain = dataclasses.replace(case, shape=dataclasses.replace(padded, empty_rows=0))
    c = case.cache
    outputs = [decode.fp8kv_column(ops, which, c.key_nhd, c.value_nhd, c.k_scale, c.v_scale)() for which in (case, plain)]
    assert outputs[0].shape == case.query.shape
    assert torch.equal(outputs[0], outputs[1])
    assert "B2 x 40 +3 empty" in padded.label


# FP8 K+V bytes = 2 (K and V) x batch x KV heads x context x head size, in MiB.
@pytest.mark.parametrize("model,batch,context,mib,large", [
    (cases.LLAMA3_8B, 1, 32768, 64, False), (cases.LLAMA3_8B, 1, 131072, 256, True),
    (cases.LLAMA3_8B, 16, 4096, 128, False), (cases.LLAMA3_8B, 64, 4096, 512, True),
    (cases.LLAMA3_8B, 256, 1024, 512, True), (cases.LLAMA2_7B, 64, 4096, 2048, True),
    (cases.LLAMA3_70B_TP8, 64, 4096, 64, False), (cases.LLAMA32_1B, 64, 4096, 256, False),
    (cases.GEMMA3_12B, 64, 4096, 1024, True),
])
def test_decode_bytes_and_target_class(model, batch, context, mib, large):
    shape = decode.DecodeShape(model, batch, context)
    assert shape.kv_bytes(1) == mib * MiB
    assert shape.kv_bytes(2) == 2 * mib * MiB
    assert shape.is_large is large


@pytest.mark.parametrize("batch,q_len,seq_len", [(1, 1, 1), (2, 1, 37), (3, 5, 5), (2, 4, 19), (1, 16, 100)])
def test_attention_flops_counts_visible_keys(batch, q_len, seq_len):
    heads, head = 3, 8
    visible = sum(seq_len - q_len + j + 1 for j in range(q_len))
    assert cases.attention_flops(batch, q_len, seq_len, heads, head) == 4 * head * heads * batch * visible


def test_prefill_shapes():
    listed = prefill.default_shapes()
    shapes = {s.kind: s for s in listed}
    assert set(shapes) == {"prefill", "chunked prefill", "verify", "mixed"}
    groups = lambda shape: [(g.batch, g.q_len, g.seq_len) for g in shape.groups]
    one = lambda kind: groups(shapes[kind])
    assert one("prefill") == [(4, 4096, 4096)]
    assert one("chunked prefill") == [(8, 512, 8704)]
    verify = [s for s in listed if s.kind == "verify"]
    assert [groups(s) for s in verify] == [[(64, q, 4096 + q)] for q in (2, 4, 8)]
    assert [s.label for s in verify] == [f"Llama-3-8B verify B64 x {q} over 4k" for q in (2, 4, 8)]
    assert one("mixed") == [(64, 1, 4097), (2, 2048, 2048)]
    assert shapes["chunked prefill"].label == "Llama-3-8B chunked prefill B8 x 512 over 8k"
    prefills = [s for s in listed if s.kind == "prefill"]
    assert [(s.label, s.model.head_size) for s in prefills] == [
        ("Llama-3-8B prefill B4 x 4k", 128), ("Llama-3.2-1B prefill B4 x 4k", 64), ("Gemma-3-12B prefill B4 x 4k", 256)]
    assert all(groups(s) == [(4, 4096, 4096)] for s in prefills)
    mixed = shapes["mixed"]
    assert mixed.flops == (cases.attention_flops(64, 1, 4097, 32, 128) + cases.attention_flops(2, 2048, 2048, 32, 128))


def test_write_and_amax_byte_counts():
    s = write.WriteShape(16384)
    elements = 2 * 16384 * 8 * 128
    assert s.bytes_moved == elements * 3 + 16384 * 8
    assert all(w.tokens >= 16384 for w in write.default_shapes())
    assert amax.AmaxShape(1000, True).bytes_read == 2 * 1000 * 8 * 128 * 2
    assert write.default_shapes()[2].label == "Llama-3-8B write 128k tokens from fused QKV"


@pytest.mark.parametrize("pattern,count", [("bs64", 7), ("70B", 1), ("B1 x", 4), ("empty", 1), ("SmolLM2", 1), (None, 20)])
def test_shape_filter(pattern, count):
    assert len(common.select_shapes(decode.default_shapes(), pattern)) == count


def test_shape_filter_rejects_no_match():
    with pytest.raises(SystemExit, match="matches none"):
        common.select_shapes(decode.default_shapes(), "no such shape")


# ---------------------------------------------------------------------------------------------
# Caches, references, SDPA
# ---------------------------------------------------------------------------------------------

def small_cache(batch=3, seq_len=37, heads=2, head=16, block=8, seed=0):
    gen = torch.Generator(CPU).manual_seed(seed)
    return cases.make_paged_cache(batch, seq_len, heads, head, block, gen, CPU)


def test_random_codes_are_finite_normal_and_never_nan():
    gen = torch.Generator(CPU).manual_seed(1)
    codes = cases.random_codes((1 << 16,), cases.K_SCALE, gen, CPU).float() * cases.K_SCALE
    assert bool(torch.isfinite(codes).all())
    assert abs(float(codes.mean())) < 0.02 and abs(float(codes.std()) - 1.0) < 0.02


@pytest.mark.parametrize("seq_len,block", [(37, 8), (32, 8), (5, 16)])
def test_poisoned_tail_and_hnd_storage(seq_len, block):
    c = small_cache(seq_len=seq_len, block=block)
    tail = seq_len % block
    last = c.key_nhd.view(torch.uint8)[c.block_tables[:, -1].long()]
    if tail:
        assert bool((last[:, tail:] == cases.NAN_CODE).all())
    assert not bool((last[:, :tail or block] == cases.NAN_CODE).any())
    assert torch.equal(c.key_hnd.view(torch.uint8), c.key_nhd.view(torch.uint8))
    physical = c.key_hnd.permute(0, 2, 1, 3)
    assert physical.is_contiguous() and not c.key_hnd.is_contiguous()
    assert sorted(c.block_tables.flatten().tolist()) == list(range(c.key_nhd.shape[0]))


def gathered_by_loop(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    batch, block_size = block_tables.shape[0], cache.shape[1]
    out = torch.empty(batch, cache.shape[2], seq_len, cache.shape[3])
    for b in range(batch):
        for pos in range(seq_len):
            block = int(block_tables[b, pos // block_size])
            out[b, :, pos] = cache[block, pos % block_size].float() * scale
    return out


def test_gather_dequantize_matches_a_loop():
    c = small_cache()
    got = cases.gather_dequantize(c.key_hnd, c.block_tables, 37, c.k_scale)
    assert torch.equal(got.float(), gathered_by_loop(c.key_nhd, c.block_tables, 37, cases.K_SCALE))


def test_concatenated_caches_hold_each_sequence():
    parts = [small_cache(batch=2, seq_len=37, seed=1), small_cache(batch=3, seq_len=5, seed=2)]
    both = cases.concatenate_caches(parts)
    assert both.seq_lens.tolist() == [37, 37, 5, 5, 5]
    assert both.block_tables.shape == (5, 5) and both.key_nhd.shape[0] == 2 * 5 + 3 * 1
    assert torch.equal(both.key_hnd.view(torch.uint8), both.key_nhd.view(torch.uint8))
    rows = (slice(0, 2), slice(2, 5))
    for part, rows_of_part, seq_len in zip(parts, rows, (37, 5)):
        width = part.block_tables.shape[1]
        for name in ("key_nhd", "value_nhd"):
            want = gathered_by_loop(getattr(part, name), part.block_tables, seq_len, 1.0)
            got = gathered_by_loop(getattr(both, name), both.block_tables[rows_of_part, :width], seq_len, 1.0)
            assert torch.equal(got, want)
    assert both.block_tables[2:, 1:].eq(0).all()  # padding past a sequence's last page


def test_cached_slots_follow_the_block_tables():
    parts = [small_cache(batch=2, seq_len=37, seed=1), small_cache(batch=3, seq_len=5, seed=2)]
    for cache in (parts[0], cases.concatenate_caches(parts)):
        want = [int(cache.block_tables[b, pos // cache.block_size]) * cache.block_size + pos % cache.block_size
                for b in range(cache.block_tables.shape[0]) for pos in range(int(cache.seq_lens[b]))]
        assert cases.cached_slots(cache).tolist() == want


def centred_recipe_float64(key, value):
    """The rotated + centred recipe from its definition, in float64 with the Hadamard matrix written out."""
    from rotated_reference import hadamard_matrix  # imports fp8kv, which the tests without it do without

    h = hadamard_matrix(key.shape[-1])
    rotated_key, rotated_value = key.double() @ h, value.double() @ h
    mu = rotated_key.mean(0)
    return cases.CentredRecipe(((rotated_key - mu).abs().amax() / 448).view(1),
                               (rotated_value.abs().amax() / 448).view(1), mu)


def contract_codes(rows, scale, offset=None):
    """uint8 codes the rotated recipe specifies for rows [n, H, D] (tests/rotated_reference.py)."""
    from reference import FORMAT_BY_NAME
    from rotated_reference import stored_rotated

    return stored_rotated(rows, scale, FORMAT_BY_NAME["e4m3fn"], offset)


@needs_fp8kv
@pytest.mark.parametrize("chunk", [cases.FLOAT32_CHUNK, 16 * 3 * 48])  # one chunk; chunks of 16 tokens
def test_centred_recipe_against_float64(monkeypatch, chunk):
    monkeypatch.setattr(cases, "FLOAT32_CHUNK", chunk)
    gen = torch.Generator(CPU).manual_seed(11)
    shift = torch.randn(3, 48, generator=gen)  # a shared offset per head and channel, as real keys have
    key = (torch.randn(100, 3, 48, generator=gen) + shift).to(torch.bfloat16)
    value = torch.randn(100, 3, 48, generator=gen).to(torch.bfloat16)
    assert_recipe_of(cases.centred_recipe(key, value), key, value)


def assert_recipe_of(got, key, value):
    """got (a CentredRecipe, or a cache or case that holds one) is the recipe of key/value: float32 [1]
    scales and a contiguous float32 [H, D] offset, within float32 rounding of float64's."""
    want = centred_recipe_float64(key, value)
    assert got.k_offset.dtype == torch.float32 and got.k_offset.shape == key.shape[1:] and got.k_offset.is_contiguous()
    torch.testing.assert_close(got.k_offset.double(), want.k_offset, rtol=0, atol=1e-5)
    for scale, wanted in ((got.k_scale, want.k_scale), (got.v_scale, want.v_scale)):
        assert scale.dtype == torch.float32 and scale.shape == (1,)
        torch.testing.assert_close(scale.double(), wanted, rtol=1e-5, atol=0)


def mixed_cache():
    return cases.concatenate_caches([small_cache(batch=2, seq_len=37, seed=1), small_cache(batch=3, seq_len=5, seed=2)])


@needs_fp8kv
@pytest.mark.parametrize("plain_of", [small_cache, mixed_cache], ids=["one group", "mixed"])
def test_rotated_copy_stores_the_plain_kv_with_the_recipe(plain_of):
    plain = plain_of()
    rotated = cases.rotated_copy(ops, plain)
    assert rotated.hadamard and not plain.hadamard and plain.k_offset is None
    assert torch.equal(rotated.block_tables, plain.block_tables) and torch.equal(rotated.seq_lens, plain.seq_lens)
    for got, was in ((rotated.key_nhd, plain.key_nhd), (rotated.value_nhd, plain.value_nhd)):
        assert torch.equal(got.view(torch.uint8) == cases.NAN_CODE, was.view(torch.uint8) == cases.NAN_CODE)
    for nhd, hnd in ((rotated.key_nhd, rotated.key_hnd), (rotated.value_nhd, rotated.value_hnd)):
        assert torch.equal(hnd.view(torch.uint8), nhd.view(torch.uint8)) and hnd.permute(0, 2, 1, 3).is_contiguous()
    slots = cases.cached_slots(plain)
    key, value = (cases.dequantized_rows(codes, slots, scale)
                  for codes, scale in ((plain.key_nhd, plain.k_scale), (plain.value_nhd, plain.v_scale)))
    assert_recipe_of(rotated, key, value)
    for codes, rows, scale, offset in ((rotated.key_nhd, key, rotated.k_scale, rotated.k_offset),
                                       (rotated.value_nhd, value, rotated.v_scale, None)):
        stored = codes.view(torch.uint8).view(-1, *codes.shape[2:])[slots]
        assert torch.equal(stored, contract_codes(rows, scale, offset))


@needs_fp8kv
def test_original_basis_maps_the_rotated_codes_back():
    from rotated_reference import hadamard_matrix

    plain = small_cache()
    rotated = cases.rotated_copy(ops, plain)
    key, value = cases.original_basis(rotated, rotated.block_tables, 37)
    h = hadamard_matrix(16)
    stored_key = gathered_by_loop(rotated.key_nhd, rotated.block_tables, 37, float(rotated.k_scale))
    stored_value = gathered_by_loop(rotated.value_nhd, rotated.block_tables, 37, float(rotated.v_scale))
    torch.testing.assert_close(key.double(), (stored_key.double() + rotated.k_offset.double()[:, None]) @ h,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value.double(), stored_value.double() @ h, rtol=1e-5, atol=1e-6)
    # The same K/V as the plain cache, up to e4m3's rounding of the rotated values (<= 2^-4 relative).
    for mapped, codes, scale in ((key, plain.key_nhd, cases.K_SCALE), (value, plain.value_nhd, cases.V_SCALE)):
        assert common.relative_error(mapped, gathered_by_loop(codes, plain.block_tables, 37, scale)) < 2**-4


def reference_float64(query, key, value, scale):
    """Per-sequence, per-head float64 attention with the end-aligned causal mask."""
    batch, hq, q_len, _ = query.shape
    hkv, kv_len = key.shape[1], key.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(hq):
            k, v = key[b, h // (hq // hkv)].double(), value[b, h // (hq // hkv)].double()
            for j in range(q_len):
                visible = kv_len - q_len + j + 1
                weights = torch.softmax((k[:visible] @ query[b, h, j].double()) * scale, 0)
                out[b, h, j] = weights @ v[:visible]
    return out


@pytest.mark.parametrize("hq,hkv,q_len", [(4, 2, 1), (4, 4, 3), (4, 1, 5)])
def test_reference_attention_against_float64(hq, hkv, q_len):
    gen = torch.Generator(CPU).manual_seed(2)
    query = torch.randn(2, hq, q_len, 16, generator=gen).to(torch.bfloat16)
    key, value = (torch.randn(2, hkv, 23, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    got = cases.reference_attention(query, key, value, 0.25)
    want = reference_float64(query, key, value, 0.25)
    # float32 softmax and matmuls over 23 keys: errors near 1e-7 relative.
    assert common.relative_error(got, want) < 1e-5


def test_sdpa_forms():
    gqa = [f.name for f in cases.sdpa_forms(32, 8)]
    assert gqa == [f"SDPA {b}{k}" for b in ("flash", "efficient", "cudnn", "default") for k in ("", " expanded")]
    assert [f.name for f in cases.sdpa_forms(32, 32)] == [f"SDPA {b}" for b in ("flash", "efficient", "cudnn", "default")]


def test_expand_heads_maps_query_heads_to_their_kv_head():
    kv = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    expanded = cases.expand_heads(kv, 6)
    assert expanded.shape == (1, 6, 3, 4)
    for h in range(6):
        assert torch.equal(expanded[0, h], kv[0, h // 3])


@pytest.mark.parametrize("backend,expanded", [("flash", False), ("default", False), ("default", True)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 40), (6, 6), (4, 19)])
def test_sdpa_causal_alignment(q_len, kv_len, backend, expanded):
    gen = torch.Generator(CPU).manual_seed(3)
    query = torch.randn(2, 4, q_len, 16, generator=gen).to(torch.bfloat16)
    key, value = (torch.randn(2, 2, kv_len, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    want = reference_float64(query, key, value, 0.25)
    if expanded:
        key, value = cases.expand_heads(key, 4), cases.expand_heads(value, 4)
    got = cases.sdpa(query, key, value, 0.25, backend)
    # bf16 output and bf16 intermediate products on CPU: ~1e-3 relative.
    assert common.relative_error(got, want) < 1e-2


def test_sdpa_backend_refusal_is_an_error():
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(RuntimeError):
        cases.sdpa(q, q, q, 1.0, "cudnn")  # no cuDNN attention on CPU, and no silent fallback


def test_sdpa_refusal_names_torchs_reasons(monkeypatch):
    def refuse(*args, **kwargs):
        warnings.warn("Flash attention kernel not used because: (Triggered internally at sdp_utils.cpp:1.)")
        warnings.warn("Flash attention requires q, k, v to have the same number of heads (Triggered internally at x.h:2.)")
        raise RuntimeError("No available kernel. Aborting execution.")
    monkeypatch.setattr(cases.F, "scaled_dot_product_attention", refuse)
    q = torch.randn(1, 4, 1, 16)
    with pytest.raises(RuntimeError) as raised:
        cases.sdpa(q, q, q, 1.0, "flash")
    assert common.error_text(raised.value) == (
        "RuntimeError: No available kernel. Aborting execution. (Flash attention kernel not used because:) "
        "(Flash attention requires q, k, v to have the same number of heads)")


def test_relative_error_flags_nan():
    ref = torch.ones(4)
    assert common.relative_error(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == math.inf
    assert common.relative_error(ref.clone(), ref) == 0.0


# ---------------------------------------------------------------------------------------------
# The measuring harness
# ---------------------------------------------------------------------------------------------

def test_poison_outputs():
    floats, codes = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float8_e4m3fn)
    common.poison_outputs((floats, codes, None))
    assert bool(floats.isnan().all())
    assert codes.view(torch.uint8).eq(common.POISON_BYTE).all()
    common.poison_outputs(None)
    with pytest.raises(TypeError, match="int32"):
        common.poison_outputs(torch.zeros(2, dtype=torch.int32))


def test_best_and_graph_times():
    assert common.best_us({"median_us": 10.0, "graph": {"median_us": 8.0}}) == 8.0
    assert common.best_us({"median_us": 10.0, "graph": {"error": "no"}}) == 10.0
    assert common.best_us({"error": "no"}) is None and common.graph_us({"median_us": 1.0}) is None
    columns = {"a": {"median_us": 5.0, "graph": {"median_us": 4.0}}, "b": {"median_us": 4.5}, "c": {"error": "x"}}
    assert common.fastest(columns, ["a", "b", "c", "absent"]) == "a"
    assert common.fastest(columns, ["b", "c"], common.graph_us) is None
    assert common.worst_rel_err({"rel_err": 1e-3, "graph": {"rel_err": 2e-3}}) == 2e-3
    assert common.worst_rel_err({"error": "no"}) == math.inf


def test_judge_and_errors_text():
    assert common.judge(lambda: 1 < 2, 1.0) is True and common.judge(lambda: 1 / 0, None) is None
    assert common.targets_text({"a": True, "b": False, "c": None}) == "a:PASS b:MISS c:n/a"
    rows = [{"label": "s", "columns": {"x": {"error": "E1"}, "y": {"median_us": 1.0, "graph": {"error": "E2"}}}}]
    assert common.errors_text(rows) == "columns that did not run:\n  s / x: E1\n  s / y (CUDA graph): E2"
    assert common.errors_text([{"label": "s", "columns": {"y": {"median_us": 1.0}}}]) == ""


# ---------------------------------------------------------------------------------------------
# Whole runs on the CPU: torch.cuda's timing calls replaced by host clocks, tiny shapes
# ---------------------------------------------------------------------------------------------

class HostEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class HostFlush:
    def __init__(self, device):
        self._buffer = torch.empty(1 << 16, dtype=torch.uint8)

    def __call__(self):
        self._buffer.fill_(0x5A)


def host_capture(fn):
    """CUDA-graph capture stood in for by the call itself: the harness around it is what is tested."""
    return fn


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    props = types.SimpleNamespace(name="host CPU", major=0, minor=0, multi_processor_count=1,
                                  L2_cache_size=1 << 20, total_memory=1 << 30)
    monkeypatch.setattr(torch.cuda, "Event", HostEvent)
    for name in ("synchronize", "_sleep", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
    monkeypatch.setattr(common, "cuda_device_or_exit", lambda: CPU)
    monkeypatch.setattr(common, "L2Flush", HostFlush)
    monkeypatch.setattr(common, "capture_graph", host_capture)
    monkeypatch.setattr(common, "BANDWIDTH_PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(common, "MIN_REPS", 2)
    monkeypatch.setattr(common, "MAX_REPS", 3)
    monkeypatch.setattr(common, "load_fp8kv", lambda require_cuda=True: (ops, ops_reason))
    monkeypatch.setattr(flashinfer_baseline, "load", lambda: (None, "FlashInfer needs CUDA"))


def test_measure_records_a_failing_build_and_goes_on(cpu_as_cuda):
    def build(info):
        raise RuntimeError("no kernel for this shape\nsecond line")
    assert common.measure(build, lambda out: {}, HostFlush(CPU)) == {"error": "RuntimeError: no kernel for this shape"}


def test_measure_keeps_the_launch_timing_when_capture_fails(cpu_as_cuda, monkeypatch):
    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(common, "capture_graph", refuse)
    out = torch.ones(4)
    column = common.measure(lambda info: lambda: out, common.rel_err_check(torch.ones(4)), HostFlush(CPU))
    assert column["rel_err"] == 0.0 and column["reps"] >= 2
    assert column["graph"] == {"error": "RuntimeError: operation not permitted when stream is capturing"}
    assert common.best_us(column) == column["median_us"]


def test_graph_that_does_not_write_its_output_fails_the_check(cpu_as_cuda, monkeypatch):
    out = torch.ones(4)
    monkeypatch.setattr(common, "capture_graph", lambda fn: (fn(), lambda: out)[1])  # replays do nothing
    column = common.measure(lambda info: lambda: out.fill_(1.0), common.rel_err_check(torch.ones(4)), HostFlush(CPU))
    assert column["rel_err"] == 0.0 and column["graph"]["rel_err"] == math.inf
    assert common.worst_rel_err(column) == math.inf


def test_a_failing_shape_is_recorded_and_the_others_run(cpu_as_cuda, monkeypatch, tmp_path, capsys):
    shapes = [amax.AmaxShape(64, False, TINY), amax.AmaxShape(-1, False, TINY), amax.AmaxShape(32, True, TINY)]
    monkeypatch.setattr(amax, "default_shapes", lambda: shapes)
    payload = run_main(amax, monkeypatch, tmp_path)
    assert [row["label"] for row in payload["rows"]] == [s.label for s in shapes]
    failed = payload["rows"][1]
    assert failed["columns"] == {} and failed["error"].startswith("RuntimeError")  # randn of a negative size
    assert "exact" in payload["rows"][0]["columns"][amax.FP8KV_COLUMN] or ops is None
    printed = capsys.readouterr().out
    assert f"  {shapes[1].label}: RuntimeError" in printed and shapes[2].label in printed.split("columns that")[0]


def test_ceilings_use_the_probe_size(cpu_as_cuda):
    ceilings = common.measure_ceilings(CPU, HostFlush(CPU))
    assert ceilings.copy_bytes_per_s > 0 and ceilings.read_bytes_per_s > 0


def run_main(module, monkeypatch, tmp_path):
    """Runs a benchmark's main() with --json (and --png where matplotlib is installed)."""
    json_path, png_path = tmp_path / f"{module.__name__}.json", tmp_path / f"{module.__name__}.png"
    flags = ["--json", str(json_path)] + (["--png", str(png_path)] if HAVE_MATPLOTLIB else [])
    monkeypatch.setattr(sys, "argv", [module.__name__, *flags])
    module.main()
    if HAVE_MATPLOTLIB:
        assert png_path.stat().st_size > 10_000
    return json.loads(json_path.read_text())


@needs_fp8kv
def test_decode_main_on_cpu(cpu_as_cuda, monkeypatch, tmp_path, capsys):
    shapes = [decode.DecodeShape(TINY, 2, 64), decode.DecodeShape(cases.Model("tiny MHA", 4, 4, 32), 2, 40, block_size=8)]
    monkeypatch.setattr(decode, "default_shapes", lambda: shapes)
    payload = run_main(decode, monkeypatch, tmp_path)
    printed = capsys.readouterr().out
    assert [r["label"] for r in payload["rows"]] == [s.label for s in shapes]
    for row in payload["rows"]:
        cols = row["columns"]
        for name in ("fp8kv e4m3 NHD", "fp8kv e4m3 HND", *decode.ROTATED_COLUMNS, "fp8kv bf16 cache", "dequant+SDPA",
                     "SDPA flash"):
            assert cols[name]["rel_err"] < decode.MAX_REL_ERR, (name, cols[name])
            assert cols[name]["graph"]["rel_err"] < decode.MAX_REL_ERR and cols[name]["graph"]["reps"] >= 2
        assert "error" in cols["SDPA cudnn"]  # no cuDNN on CPU: recorded, the others ran
        assert row["summary"]["sdpa_best"].startswith("SDPA ") and row["summary"]["fp8kv_graph_us"] > 0
        assert row["targets"]["err<=1e-2"] is True and row["targets"]["<=FI/1.1"] is None
        assert_rotated_judged(row, decode.ROTATED_COLUMNS, "rot+c<=1.03xplain", "rot+c_err<=1e-2")
    assert ("SDPA flash expanded" in payload["rows"][0]["columns"]) and ("SDPA flash expanded" not in payload["rows"][1]["columns"])
    assert "FlashInfer needs CUDA" in printed and "SDPA cudnn" in printed and "targets" in printed
    assert "rot+c us" in printed and "rot+c<=1.03xplain:" in printed
    assert ["fp8kv e4m3 rotated+centred (faster storage)", "@rotated_best"] in payload["plot"]["series"]


def assert_rotated_judged(row, names, ratio_target, correct_target):
    """The rotated + centred columns ran and were judged: the faster storage by graph time, its ratio to
    the plain recipe's graph time, its correctness target passed."""
    s = row["summary"]
    assert s["rotated_best"] in names
    assert s["rotated_graph_us"] == min(row["columns"][n]["graph"]["median_us"] for n in names)
    assert s["rotated_vs_plain"] == pytest.approx(s["rotated_graph_us"] / s["fp8kv_graph_us"])
    assert row["targets"][ratio_target] in (True, False) and row["targets"][correct_target] is True


class RefusedRotation:
    """fp8kv's ops where they refuse the rotated recipe (its CUDA kernels, until they exist)."""

    def __getattr__(self, name):
        return getattr(ops, name)

    @staticmethod
    def reshape_and_cache(*args, hadamard=False, **kwargs):
        if hadamard:
            raise RuntimeError("reshape_and_cache: the rotated recipe is not supported on this device")
        ops.reshape_and_cache(*args, **kwargs)


@needs_fp8kv
@pytest.mark.parametrize("module,rotated_columns,shapes", [
    (decode, decode.ROTATED_COLUMNS, [decode.DecodeShape(TINY, 2, 64)]),
    (prefill, prefill.ROTATED_COLUMNS, [prefill.PrefillShape("verify", (prefill.Sequences(3, 4, 20),), TINY)]),
    (write, write.ROTATED_COLUMNS, [write.WriteShape(96, TINY, 8)]),
], ids=["decode", "prefill", "write"])
def test_main_with_the_rotated_recipe_refused(cpu_as_cuda, monkeypatch, tmp_path, capsys, module, rotated_columns,
                                              shapes):
    monkeypatch.setattr(common, "load_fp8kv", lambda require_cuda=True: (RefusedRotation(), ops_reason))
    monkeypatch.setattr(module, "default_shapes", lambda: shapes)
    (row,) = run_main(module, monkeypatch, tmp_path)["rows"]
    printed = capsys.readouterr().out
    for name in rotated_columns:
        assert "not supported on this device" in row["columns"][name]["error"]
        assert f"{row['label']} / {name}: RuntimeError" in printed
    plain = [n for n in row["columns"] if n.startswith("fp8kv") and n not in rotated_columns and "fp8-math" not in n]
    assert plain and all("median_us" in row["columns"][n] for n in plain)
    assert row["summary"]["rotated_best"] is None and row["summary"]["fp8kv_graph_us"] > 0
    assert {v for k, v in row["targets"].items() if k.startswith("rot+c")} == {None}
    assert row["targets"].get("err<=1e-2", row["targets"].get("exact")) is True  # the plain recipe still judged


@needs_fp8kv
def test_prefill_main_on_cpu(cpu_as_cuda, monkeypatch, tmp_path):
    Seq = prefill.Sequences
    shapes = [prefill.PrefillShape("chunked prefill", (Seq(2, 8, 24),), TINY),
              prefill.PrefillShape("verify", (Seq(3, 4, 20),), TINY),
              prefill.PrefillShape("mixed", (Seq(3, 1, 30), Seq(2, 9, 0)), TINY, block_size=8)]
    monkeypatch.setattr(prefill, "default_shapes", lambda: shapes)
    payload = run_main(prefill, monkeypatch, tmp_path)
    for row in payload["rows"]:
        for name in (*prefill.FP8KV_COLUMNS, *prefill.ROTATED_COLUMNS, "SDPA flash", "SDPA default expanded"):
            assert row["columns"][name]["rel_err"] < prefill.MAX_REL_ERR, (name, row["columns"][name])
            assert row["columns"][name]["graph"]["rel_err"] < prefill.MAX_REL_ERR
        assert row["targets"]["err<=1e-2"] is True
        assert_rotated_judged(row, prefill.ROTATED_COLUMNS, "rot+c<=1.05xplain", "rot+c_err<=1e-2")
    assert ["fp8kv e4m3 rotated+centred (faster storage)", "@rotated_best"] in payload["plot"]["series"]
    for row in payload["rows"]:  # FP8 math: refused on the CPU, so its columns say why and are not judged
        for name in (*prefill.FP8_MATH_COLUMNS, *prefill.ROTATED_FP8_MATH_COLUMNS):
            assert "`fp8_math` needs the CUDA kernels" in row["columns"][name]["error"], row["columns"][name]
        assert row["summary"]["fp8_math_best"] is None and row["targets"]["fp8_err<=0.05"] is None
    verify = payload["rows"][1]
    assert verify["summary"]["decode_best"] in prefill.DECODE_COLUMNS
    assert verify["targets"]["<=1.1xdecode"] in (True, False)
    assert "<=1.1xdecode" not in payload["rows"][2]["targets"]


@needs_fp8kv
def test_write_and_amax_main_on_cpu(cpu_as_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(write, "default_shapes", lambda: [write.WriteShape(96, TINY, 8), write.WriteShape(96, TINY, 8, True)])
    payload = run_main(write, monkeypatch, tmp_path)
    for row in payload["rows"]:
        assert set(write.ROTATED_COLUMNS) < set(row["columns"])
        for col in row["columns"].values():
            assert col["mismatched_bytes"] == 0 and col["graph"]["mismatched_bytes"] == 0, col
        assert row["targets"]["exact"] is True and row["summary"]["rotated_mismatched_bytes"] == 0
        assert_rotated_judged(row, write.ROTATED_COLUMNS, "rot+c<=1.15xplain", "rot+c_exact")
    assert [write.ROTATED_COLUMNS[0]] * 2 in payload["plot"]["series"]
    monkeypatch.setattr(amax, "default_shapes", lambda: [amax.AmaxShape(64, p, TINY) for p in (False, True)])
    payload = run_main(amax, monkeypatch, tmp_path)
    for row in payload["rows"]:
        for col in row["columns"].values():
            assert col["exact"] is True and col["graph"]["exact"] is True
        assert row["targets"]["exact"] is True


def test_generate_targets_judge_every_full_size_row_graph_and_eager():
    import bench_generate as generate

    def row(label, fp8_graph, bf16_graph, fp8_eager, bf16_eager):
        speeds = {"fp8 paged graph": fp8_graph, "bf16 paged graph": bf16_graph, "fp8 paged eager": fp8_eager,
                  "bf16 paged eager": bf16_eager}
        return {"label": label, "columns": {name: {"tokens_per_s": tok_s} for name, tok_s in speeds.items() if tok_s}}

    rows = [row("Llama-3-8B B32 x 8k", 1300, 1000, 1000, 1000), row("Llama-3-8B B4 x 32k", 1299, 1000, 999, 1000),
            row("SmolLM2-135M B64 x 7680", 1400, 1000, None, 1000), row("tiny B2 x 256", 1, 1000, 1, 1000)]
    targets = generate.evaluate_targets(rows, {})
    speed = {name: value for name, value in targets.items() if "fp8/bf16" in name}
    assert speed == {
        "Llama-3-8B B32 x 8k: fp8/bf16 graph >= 1.3x": True, "Llama-3-8B B32 x 8k: fp8/bf16 eager >= 1.0x": True,
        "Llama-3-8B B4 x 32k: fp8/bf16 graph >= 1.3x": False, "Llama-3-8B B4 x 32k: fp8/bf16 eager >= 1.0x": False,
        "SmolLM2-135M B64 x 7680: fp8/bf16 graph >= 1.3x": True,
        "SmolLM2-135M B64 x 7680: fp8/bf16 eager >= 1.0x": None,  # a column that did not run: n/a
    }  # the small smoke-test row gets no fp8/bf16 target


def test_generate_busy_time_counts_overlaps_once_and_picks_attention_kernels():
    import bench_generate as generate

    def kernel(name, start, end):
        return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start, end=end))

    kernels = [kernel("void fp8kv::cuda::decode::decode_kernel<(fp8kv::DType)3, 128>(...)", 0, 10),
               kernel("void fp8kv::cuda::merge::merge_splits_kernel<128>(...)", 8, 12),  # a dependent grid: overlaps
               kernel("void fp8kv::cuda::reshape_and_cache_kernel(fp8kv::CacheWriteParams)", 12, 13),
               kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 20, 30),
               kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 40, 41),
               kernel("void pytorch_flash::flash_fwd_splitkv_kernel<...>", 50, 52),
               kernel("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", 60, 61),
               kernel("void fp8kv::cuda::multi_token::sm80::sm80_kernel<(fp8kv::DType)3, 128, 4>(...)", 70, 75),
               kernel("void fp8kv::cuda::multi_token::sm90a::sm90a_kernel<(fp8kv::DType)3, 128>(...)", 80, 83)]
    attention = [k for k in kernels if generate.ATTENTION_KERNELS.search(k.name)]
    assert [k.time_range.start for k in attention] == [0, 8, 40, 50, 60, 70, 80]  # not the cache write, not the GEMM

    def spans(events):
        return [(event.time_range.start, event.time_range.end) for event in events]

    assert generate.covered_us(spans(kernels)) == 12 + 1 + 10 + 1 + 2 + 1 + 5 + 3
    assert generate.covered_us(spans(attention)) == 12 + 1 + 2 + 1 + 5 + 3
    assert generate.covered_us([(0, 10), (2, 5)]) == 10  # nested: counted once
    assert generate.covered_us([]) == 0


@needs_fp8kv
def test_generate_main_on_cpu_with_a_host_profile(tmp_path, capsys):
    pytest.importorskip("transformers")
    import bench_generate as generate

    out = tmp_path / "generate.json"
    payload = generate.main(["--device", "cpu", "--steps", "2", "--columns", "fp8 paged (graph|eager)",
                             "--host-profile", "5", "--json", str(out)])
    printed = capsys.readouterr().out
    (row,) = payload["rows"]
    assert list(row["columns"]) == ["fp8 paged graph", "fp8 paged eager"]
    for name, column in row["columns"].items():
        assert "error" not in column, (name, column)
        assert column["steps"] == 2 and column["step_ms"] > 0
        profile = column["host_profile"]
        # The costliest first; a decode step always goes through the model's forward.
        assert len(profile) == 5 and all(a["ms_per_step"] >= b["ms_per_step"] for a, b in zip(profile, profile[1:]))
        assert any("forward" in entry["function"] or "_call_impl" in entry["function"] for entry in profile)
        assert all(0 <= entry["own_ms_per_step"] <= entry["ms_per_step"] for entry in profile)
        assert f"host profile, {row['label']} / {name} (cProfile, ms per decode step: cumulative, own):" in printed
    assert json.loads(out.read_text())["rows"][0]["columns"]["fp8 paged graph"]["host_profile"] == \
        row["columns"]["fp8 paged graph"]["host_profile"]
    with pytest.raises(SystemExit):
        generate.main(["--device", "cpu", "--host-profile", "-1"])


# ---------------------------------------------------------------------------------------------
# Column glue through fp8kv's CPU kernels
# ---------------------------------------------------------------------------------------------

@needs_fp8kv
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (4, 1)])
def test_decode_column_matches_reference(layout, hq, hkv):
    shape = decode.DecodeShape(cases.Model("test", hq, hkv, 32), 3, 45, block_size=8)
    case = decode.make_case(shape, CPU, seed=4)
    ref = decode.reference_output(case)
    run = decode.fp8kv_e4m3_column(ops, case, case.cache, layout)
    assert common.relative_error(run(), ref) < decode.MAX_REL_ERR


# The rotated copy re-quantizes the plain cache's values in another basis: the same attention up to
# that rounding (e4m3: up to 2^-4 relative per value, about 3% in norm, reaching the output through V
# and the logits: 3-4% measured). A wrong basis, scale or offset gives errors of order 1.
SAME_KV_REL_ERR = 0.1


@needs_fp8kv
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("hq,hkv,head", [(8, 2, 32), (4, 4, 64), (4, 1, 48)])
def test_decode_rotated_column_matches_its_reference(layout, hq, hkv, head):
    shape = decode.DecodeShape(cases.Model("test", hq, hkv, head), 3, 45, block_size=8)
    case = decode.make_case(shape, CPU, seed=4)
    rotated = cases.RotatedCopy(ops, case.cache, lambda cache: decode.reference_output(case, cache))
    out = decode.fp8kv_e4m3_column(ops, case, rotated.cache, layout)()
    assert rotated.check(out)["rel_err"] < decode.MAX_REL_ERR
    assert common.relative_error(out, decode.reference_output(case)) < SAME_KV_REL_ERR


@needs_fp8kv
def test_bf16_cache_column_matches_reference():
    case = decode.make_case(decode.DecodeShape(TINY, 2, 40), CPU, seed=5)
    run = decode.fp8kv_bf16_cache_column(ops, case)
    assert common.relative_error(run(), decode.reference_output(case)) < decode.MAX_REL_ERR


@needs_fp8kv
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind,groups", [("prefill", ((2, 20, 0),)), ("chunked prefill", ((2, 8, 30),)),
                                         ("verify", ((3, 4, 25),)), ("mixed", ((3, 1, 30), (2, 9, 0), (1, 5, 7)))])
def test_prefill_columns_match_reference(layout, kind, groups):
    shape = prefill.PrefillShape(kind, tuple(prefill.Sequences(*g) for g in groups), TINY, block_size=8)
    case = prefill.make_case(shape, CPU, seed=6)
    ref = case.reference_rows()
    assert ref.shape[0] == sum(b * q for b, q, _ in groups) == case.query.shape[0]
    out = prefill.fp8kv_column(ops, case, case.cache, layout)()
    assert common.relative_error(out, ref) < prefill.MAX_REL_ERR
    if kind == "verify":
        decode_out = prefill.fp8kv_column(ops, case, case.cache, layout, decode=True)()
        assert common.relative_error(decode_out, case.groups[0].batched(ref)[:, :, -1]) < prefill.MAX_REL_ERR
    rotated = cases.RotatedCopy(ops, case.cache, case.reference_rows)
    rotated_out = prefill.fp8kv_column(ops, case, rotated.cache, layout)()
    assert rotated.check(rotated_out)["rel_err"] < prefill.MAX_REL_ERR
    assert common.relative_error(rotated_out, ref) < SAME_KV_REL_ERR


@pytest.fixture(params=[False, True], ids=["contiguous", "fused QKV"])
def write_case(request):
    return write.make_case(write.WriteShape(200, TINY, block_size=8, fused_qkv=request.param), CPU, seed=7)


def empty_caches(case, layout):
    return tuple(write.empty_cache(case.shape, case.expected_key.shape[0], CPU, layout) for _ in range(2))


@needs_fp8kv
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_write_bytes_equal_torch_path(write_case, layout):
    case = write_case
    codes = case.expected_key.view(torch.uint8)
    assert int((codes & 0x7F == 0x7E).sum()) > 0  # some values saturated to +-448
    key_cache, value_cache = empty_caches(case, layout)
    ops.reshape_and_cache(case.key, case.value, key_cache, value_cache, case.slot_mapping, case.k_scale, case.v_scale)
    assert write.mismatch_check(case, key_cache, value_cache) == {"mismatched_bytes": 0}


@needs_fp8kv
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_rotated_cache_write_bytes_are_the_contracts(write_case, layout):
    case = write_case
    rotated = write.rotated_case(ops, case)
    assert_recipe_of(rotated, case.key, case.value)
    slots = case.slot_mapping
    for expected, rows, scale, offset in ((rotated.expected_key, case.key, rotated.k_scale, rotated.k_offset),
                                          (rotated.expected_value, case.value, rotated.v_scale, None)):
        written = expected.view(torch.uint8).view(-1, *expected.shape[2:])
        assert torch.equal(written[slots], contract_codes(rows, scale, offset))
        untouched = torch.ones(written.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert bool((written[untouched] == write.EMPTY_CACHE_BYTE).all())
    key_cache, value_cache = empty_caches(case, layout)
    ops.reshape_and_cache(case.key, case.value, key_cache, value_cache, slots, rotated.k_scale, rotated.v_scale,
                          hadamard=True, k_offset=rotated.k_offset)
    assert write.mismatch_check(rotated, key_cache, value_cache) == {"mismatched_bytes": 0}
    assert write.mismatch_check(case, key_cache, value_cache)["mismatched_bytes"] > 0  # not the plain bytes


def test_cache_write_check_counts_mismatches():
    shape = write.WriteShape(64, cases.Model("test", 2, 2, 16), block_size=8)
    case = write.make_case(shape, CPU, seed=8)
    key_cache, value_cache = case.expected_key.clone(), case.expected_value.clone()
    key_cache.view(torch.uint8)[0, 0, 0, :3] ^= 1
    assert write.mismatch_check(case, key_cache, value_cache) == {"mismatched_bytes": 3}


@needs_fp8kv
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_kv_amax_matches_torch(per_head, fused):
    shape = amax.AmaxShape(300, per_head, cases.Model("test", 4, 4, 32), fused_qkv=fused)
    key, value = amax.make_inputs(shape, CPU, seed=9)
    expected = (amax.torch_amax(key, per_head), amax.torch_amax(value, per_head))
    assert expected[0].shape == ((4,) if per_head else (1,))
    got = tuple(torch.zeros_like(e) for e in expected)
    ops.kv_amax(key, value, *got)
    assert amax.exact_check(expected, got)(None) == {"exact": True}
    got[1][0] += 1.0
    assert amax.exact_check(expected)(got) == {"exact": False}


def test_flashinfer_page_description():
    block_tables = torch.tensor([[5, 2, 9], [1, 7, 3], [4, 0, 8]], dtype=torch.int32)
    seq_lens = torch.tensor([17, 48, 1], dtype=torch.int32)
    indptr, indices, last = flashinfer_baseline.paged_kv_indices(block_tables, seq_lens, 16)
    assert indptr.tolist() == [0, 2, 5, 6]
    assert indices.tolist() == [5, 2, 1, 7, 3, 4]
    assert last.tolist() == [1, 16, 1]


def test_flashinfer_query_quantization_per_head():
    gen = torch.Generator().manual_seed(8)
    magnitudes = torch.tensor([1e-3, 1.0, 0.0, 300.0])  # head 2 is all zeros
    query = (torch.randn(40, 4, 64, generator=gen) * magnitudes[None, :, None]).to(torch.bfloat16)
    codes, scale = flashinfer_baseline.quantize_per_head(query)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == query.shape
    assert scale.dtype == torch.float32 and scale.shape == (4,)
    amax = query.float().abs().amax(dim=(0, 2))
    used = amax > 0
    assert torch.equal(scale[used], amax[used] / 448) and 0 < scale[2] < 1e-30
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[e4m3.isfinite()]
    target = query.float() / scale[None, :, None]
    nearest = (target[..., None] - e4m3).abs().amin(-1)
    assert torch.equal((codes.float() - target).abs(), nearest)  # every code is a nearest e4m3 value
    assert codes.float().abs().amax(dim=(0, 2)).tolist() == [448.0, 448.0, 0.0, 448.0]


class FakeFlashInfer:
    """FlashInfer 0.7.2's paged prefill as its source reads, computed in float32 on the CPU: plan()
    takes CSR pages; run() reads the caches in the wrapper's layout and checks the planned dtypes.
    Keyword q_scale / k_scale fold into sm_scale and v_scale multiplies the output afterwards; backend
    "fa3" (e4m3 query and cache, head 64/128/256) takes positional (q, k, v) scales that its kernel
    applies: a float32 tensor per head, or a float; "fa2" takes none."""

    class BatchPrefillWithPagedKVCacheWrapper:
        def __init__(self, workspace, kv_layout, backend):
            assert kv_layout in ("NHD", "HND") and backend in ("fa2", "fa3")
            self.kv_layout, self.backend = kv_layout, backend

        def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                 page_size, *, causal, sm_scale, q_data_type, kv_data_type, o_data_type):
            assert causal
            assert self.backend == "fa2" or (q_data_type == kv_data_type == torch.float8_e4m3fn
                                             and head_dim in (64, 128, 256))
            self.plan_args = dict(locals())

        def run(self, q, paged_kv_cache, *kernel_scales, q_scale=None, k_scale=None, v_scale=None, out):
            p = self.plan_args
            key_cache, value_cache = paged_kv_cache
            assert (q.dtype, key_cache.dtype, value_cache.dtype) == (p["q_data_type"], p["kv_data_type"], p["kv_data_type"])
            assert out.dtype == p["o_data_type"] and out.shape == q.shape and q.shape[0] == int(p["qo_indptr"][-1])
            if self.kv_layout == "HND":
                key_cache, value_cache = key_cache.transpose(1, 2), value_cache.transpose(1, 2)
            assert len(kernel_scales) == (3 if self.backend == "fa3" else 0)
            sq, sk, sv = (self.per_head(s, n) for s, n in zip(kernel_scales or (1.0,) * 3,
                                                               (p["num_qo_heads"], p["num_kv_heads"], p["num_kv_heads"])))
            query, keys, values = q.float() * sq, key_cache.float() * sk, value_cache.float() * sv
            sm_scale = p["sm_scale"] * (q_scale or 1.0) * (k_scale or 1.0)
            qo, kv, pages, last = (p[name].tolist() for name in ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len"))
            for i in range(len(last)):
                kv_len = (kv[i + 1] - kv[i] - 1) * p["page_size"] + last[i]
                seq = lambda cache: cache[pages[kv[i]:kv[i + 1]]].flatten(0, 1)[:kv_len].transpose(0, 1)[None]
                rows = query[qo[i]:qo[i + 1]].transpose(0, 1)[None]
                out[qo[i]:qo[i + 1]] = cases.reference_attention(rows, seq(keys), seq(values), sm_scale)[0].transpose(0, 1)
            return out.mul_(v_scale or 1.0)

        @staticmethod
        def per_head(scale, heads):
            if isinstance(scale, torch.Tensor):
                assert scale.dtype == torch.float32 and scale.shape == (heads,)
                return scale[:, None]
            return float(scale)


HEAD_64 = cases.Model("tiny GQA head 64", 4, 2, 64)  # FA3's smallest head size


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fp8_query", [False, True], ids=["FA2", "FA3 FP8"])
@pytest.mark.parametrize("kind,groups", [("prefill", ((2, 20, 0),)), ("verify", ((3, 4, 25),)),
                                         ("mixed", ((3, 1, 30), (2, 9, 0), (1, 5, 7)))])
def test_flashinfer_prefill_column_matches_reference(cpu_as_cuda, layout, fp8_query, kind, groups):
    shape = prefill.PrefillShape(kind, tuple(prefill.Sequences(*g) for g in groups), HEAD_64, block_size=8)
    case = prefill.make_case(shape, CPU, seed=9)
    run = prefill.flashinfer_column(FakeFlashInfer, case, layout, {}, fp8_query=fp8_query)
    err = common.relative_error(run(), case.reference_rows())
    # the fake's kernel is exact: FA3's error is its query's e4m3 rounding (~2.5e-2), FA2's the bf16
    # output's rounding (at most 2^-9 of each element)
    assert (prefill.MAX_REL_ERR < err < prefill.MAX_FP8_MATH_REL_ERR) if fp8_query else err < 2**-9


def test_prefill_main_has_flashinfer_columns(cpu_as_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(flashinfer_baseline, "load", lambda: (FakeFlashInfer, "FlashInfer on the CPU"))
    Seq = prefill.Sequences
    shapes = [prefill.PrefillShape("chunked prefill", (Seq(2, 8, 24),), HEAD_64),
              prefill.PrefillShape("mixed", (Seq(3, 1, 30), Seq(2, 9, 0)), HEAD_64, block_size=8)]
    monkeypatch.setattr(prefill, "default_shapes", lambda: shapes)
    limits = {"FlashInfer NHD": prefill.MAX_REL_ERR, "FlashInfer HND": prefill.MAX_REL_ERR,
              "FlashInfer FA3 FP8 NHD": prefill.MAX_FP8_MATH_REL_ERR, "FlashInfer FA3 FP8 HND": prefill.MAX_FP8_MATH_REL_ERR}
    for row in run_main(prefill, monkeypatch, tmp_path)["rows"]:
        flashinfer = {name: col for name, col in row["columns"].items() if name.startswith(prefill.FLASHINFER_PREFIX)}
        assert set(flashinfer) == set(limits)
        for name, col in flashinfer.items():
            assert common.worst_rel_err(col) < limits[name], (name, col)
        assert row["summary"]["flashinfer_best"] in limits


# ---------------------------------------------------------------------------------------------
# Judgement, tables, JSON and PNG from synthetic results
# ---------------------------------------------------------------------------------------------

CEILINGS = {"copy_tb_s": 3.0, "read_tb_s": 3.0}


NOT_RUN = {"rot+c<=1.03xplain": None, "rot+c_err<=1e-2": None}  # decode's rotated targets, no rotated column


def synthetic_decode_row(shape, fp8_graph_us, sdpa_us, fi_us=None, err=2e-3, fp8_launch_extra_us=5.0,
                         rotated_graph_us=None, rotated_err=2e-3):
    """A row as measure_shape() leaves it: fp8kv NHD faster than HND, SDPA's expanded form fastest;
    with rotated_graph_us, the rotated + centred columns, HND the faster (by graph time; NHD launches
    faster)."""
    timing = lambda us, rel_err: {"median_us": us + fp8_launch_extra_us, "rel_err": rel_err,
                                  "graph": {"median_us": us, "rel_err": rel_err}}
    cols = {"fp8kv e4m3 NHD": timing(fp8_graph_us, err), "fp8kv e4m3 HND": timing(fp8_graph_us * 1.1, err),
            "SDPA flash": {"median_us": sdpa_us * 1.2, "rel_err": 1e-3, "graph": {"error": "x"}},
            "SDPA flash expanded": {"median_us": sdpa_us + 3, "rel_err": 1e-3, "graph": {"median_us": sdpa_us}}}
    if rotated_graph_us is not None:
        nhd, hnd = decode.ROTATED_COLUMNS
        cols[nhd] = timing(rotated_graph_us * 1.1, rotated_err) | {"median_us": rotated_graph_us * 0.9}
        cols[hnd] = timing(rotated_graph_us, rotated_err)
    if fi_us is not None:
        cols["FlashInfer cuda-core NHD"] = {"median_us": fi_us, "rel_err": 1e-3}
    for name, col in cols.items():
        common.add_rate(col, shape.kv_bytes(1 if "fp8kv" in name or "FlashInfer" in name else 2), "eff_tb_s", common.TB)
    row = {"label": shape.label, "fp8_kv_bytes": shape.kv_bytes(1), "large": shape.is_large, "columns": cols}
    row["summary"] = decode.summarize_row(row, CEILINGS)
    row["targets"] = decode.evaluate_targets(row)
    return row


def us_for(shape, tb_s):
    return shape.kv_bytes(1) / (tb_s * common.TB) * 1e6


def test_decode_summary_uses_graph_time_and_the_best_baselines():
    big = decode.DecodeShape(cases.LLAMA3_8B, 64, 4096)
    row = synthetic_decode_row(big, 200.0, sdpa_us=400.0, fi_us=250.0)
    s = row["summary"]
    assert (s["fp8kv_best"], s["sdpa_best"], s["flashinfer_best"]) == ("fp8kv e4m3 NHD", "SDPA flash expanded",
                                                                       "FlashInfer cuda-core NHD")
    assert (s["fp8kv_graph_us"], s["fp8kv_launch_us"], s["sdpa_us"], s["flashinfer_us"]) == (200.0, 205.0, 400.0, 250.0)
    assert s["vs_sdpa"] == 0.5 and s["vs_flashinfer"] == 0.8
    assert s["fp8kv_tb_s"] == pytest.approx(512 * MiB / 200e-6 / 1e12)
    assert s["fraction_of_read"] == pytest.approx(s["fp8kv_tb_s"] / 3.0)


@pytest.mark.parametrize("tb_s,sdpa_ratio,fi_ratio,expected", [
    (2.8, 0.52, 0.90, (True, True, True)),  # 2.8 / 3.0 = 93% of read
    (2.7, 0.52, 0.90, (True, False, True)),  # 90% of read
    (2.8, 0.54, 0.92, (False, True, False)),  # 0.92 > 1 / 1.1
])
def test_decode_targets_large(tb_s, sdpa_ratio, fi_ratio, expected):
    big = decode.DecodeShape(cases.LLAMA3_8B, 16, 16384)
    us = us_for(big, tb_s)
    row = synthetic_decode_row(big, us, sdpa_us=us / sdpa_ratio, fi_us=us / fi_ratio)
    assert row["targets"] == dict(zip(["<=0.53xSDPA", ">=92%read", "<=FI/1.1"], expected)) | {"err<=1e-2": True} | NOT_RUN
    text = decode.table([row])
    assert "<=0.53xSDPA:" + ("PASS" if expected[0] else "MISS") in text and "flash expanded" in text


@pytest.mark.parametrize("shape", [decode.DecodeShape(cases.LLAMA3_8B, 1, 32768), decode.DecodeShape(cases.LLAMA32_1B, 64, 4096),
                                   decode.DecodeShape(cases.LLAMA3_70B_TP8, 64, 4096)])
@pytest.mark.parametrize("sdpa_ratio,ok", [(0.59, True), (0.61, False)])
def test_decode_targets_small(shape, sdpa_ratio, ok):
    row = synthetic_decode_row(shape, 50.0, sdpa_us=50.0 / sdpa_ratio, err=0.02)
    assert row["targets"] == {"<=0.60xSDPA": ok, "<=FI/1.1": None, "err<=1e-2": False} | NOT_RUN


@pytest.mark.parametrize("ratio,rotated_err,expected", [
    (1.02, 2e-3, (True, True)), (1.04, 2e-3, (False, True)), (1.0, 0.02, (True, False))])
def test_decode_rotated_targets(ratio, rotated_err, expected):
    shape = decode.DecodeShape(cases.LLAMA3_8B, 64, 4096)
    row = synthetic_decode_row(shape, 200.0, sdpa_us=400.0, rotated_graph_us=200.0 * ratio, rotated_err=rotated_err)
    s = row["summary"]
    assert (s["fp8kv_best"], s["rotated_best"]) == ("fp8kv e4m3 NHD", "fp8kv e4m3 rotated+centred HND")
    assert s["rotated_graph_us"] == 200.0 * ratio and s["rotated_vs_plain"] == pytest.approx(ratio)
    assert s["max_rotated_rel_err"] == rotated_err
    assert {k: row["targets"][k] for k in NOT_RUN} == dict(zip(NOT_RUN, expected))
    text = decode.table([row])
    assert all(h in text.splitlines()[0] for h in ("rot+c us", "xplain", "rot+c err"))
    assert f" {200.0 * ratio:.1f} " in text and f" {ratio:.2f} " in text and f" {rotated_err:.1e} " in text
    assert "rot+c<=1.03xplain:" + ("PASS" if expected[0] else "MISS") in text


def test_decode_row_whose_fp8kv_graph_failed_is_not_judged():
    shape = decode.DecodeShape(cases.LLAMA3_8B, 16, 4096)
    cols = {n: {"median_us": 80.0, "rel_err": 1e-3, "graph": {"error": "RuntimeError: capture"}} for n in decode.FP8KV_COLUMNS}
    cols["SDPA flash"] = {"median_us": 100.0}
    row = {"label": shape.label, "fp8_kv_bytes": shape.kv_bytes(1), "large": shape.is_large, "columns": cols}
    row["summary"] = decode.summarize_row(row, CEILINGS)
    assert row["summary"]["fp8kv_launch_us"] == 80.0 and row["summary"]["fp8kv_graph_us"] is None
    assert decode.evaluate_targets(row) == {"<=0.60xSDPA": None, "<=FI/1.1": None, "err<=1e-2": True} | NOT_RUN
    assert "(CUDA graph): RuntimeError: capture" in common.errors_text([row])


def test_decode_row_whose_fp8kv_failed():
    shape = decode.DecodeShape(cases.LLAMA3_8B, 64, 4096)
    row = {"label": shape.label, "fp8_kv_bytes": shape.kv_bytes(1), "large": True,
           "columns": {n: {"error": "RuntimeError: no kernel"} for n in decode.FP8KV_COLUMNS}}
    row["summary"] = decode.summarize_row(row, CEILINGS)
    row["targets"] = decode.evaluate_targets(row)
    assert set(row["targets"].values()) == {None}
    assert "no kernel" in common.errors_text([row]) and "n/a" in decode.table([row])


def synthetic_prefill_row(kind, fp8_us, flash_us, fi_us=None, decode_us=None, best_sdpa_us=None, rotated_us=None):
    graph = lambda us: {"median_us": us + 5, "graph": {"median_us": us, "rel_err": 1e-3}, "rel_err": 1e-3}
    cols = {"fp8kv e4m3 NHD": graph(fp8_us), "SDPA flash": {"median_us": flash_us}}
    if rotated_us is not None:
        cols |= {prefill.ROTATED_COLUMNS[0]: graph(rotated_us * 1.2), prefill.ROTATED_COLUMNS[1]: graph(rotated_us)}
    if best_sdpa_us is not None:
        cols["SDPA cudnn expanded"] = {"median_us": best_sdpa_us}
    if fi_us is not None:
        cols["FlashInfer NHD"] = {"median_us": fi_us}
    if decode_us is not None:
        cols["fp8kv decode NHD"] = graph(decode_us)
    row = {"label": kind, "kind": kind, "flops": 10**12, "columns": cols}
    row["summary"] = prefill.summarize_row(row)
    row["targets"] = prefill.evaluate_targets(row)
    return row


@pytest.mark.parametrize("kind,fp8_us,flash_us,best_sdpa_us,fi_us,decode_us,expected", [
    ("prefill", 100.0, 101.0, 50.0, 131.0, None, (True, False, True)),
    ("prefill", 100.0, 101.0, 100.0, 131.0, None, (True, True, True)),
    ("chunked prefill", 100.0, 99.0, 98.0, 129.0, None, (False, False, False)),
    ("mixed", 100.0, 100.0, 50.0, None, None, (True, False, None)),
    ("verify", 110.0, 500.0, 50.0, 150.0, 100.0, (True, False, True, True)),
    ("verify", 111.0, 500.0, 50.0, 150.0, 100.0, (True, False, True, False)),
])
def test_prefill_targets(kind, fp8_us, flash_us, best_sdpa_us, fi_us, decode_us, expected):
    row = synthetic_prefill_row(kind, fp8_us, flash_us, fi_us, decode_us, best_sdpa_us=best_sdpa_us)
    names = [">=1.0xSDPAflash", ">=1.0xSDPA", "FI>=1.3x"] + (["<=1.1xdecode"] if kind == "verify" else [])
    sixteen_bit = {name: ok for name, ok in row["targets"].items() if not name.startswith("fp8")}
    assert sixteen_bit == dict(zip(names, expected)) | {"err<=1e-2": True, "rot+c<=1.05xplain": None,
                                                        "rot+c_err<=1e-2": None}
    assert {ok for name, ok in row["targets"].items() if name.startswith("fp8")} == {None}  # no FP8-math column
    s = row["summary"]
    assert s["sdpa_flash_best"] == "SDPA flash" and s["sdpa_best"] == "SDPA cudnn expanded"
    assert s["fp8kv_tflops"] == pytest.approx(1e12 / (fp8_us * 1e-6) / 1e12)
    assert "cudnn expanded" in prefill.table([row])


@pytest.mark.parametrize("model,kind,fp8_us,target,ok", [
    ("Llama-3-8B", "prefill", 66.0, 1.5, True), ("Llama-3-8B", "chunked prefill", 67.0, 1.5, False),
    ("Gemma-3-12B", "prefill", 76.0, 1.3, True), ("Gemma-3-12B", "prefill", 77.0, 1.3, False),
    ("Llama-3-8B", "verify", 100.0, None, None)])
def test_prefill_fp8_math_targets(model, kind, fp8_us, target, ok):
    """FP8 math against the fastest SDPA form (100 us here): 1.5x for Llama-3-8B's prefill and chunked
    prefill, 1.3x for the other models' prefill, none for the other kinds; FlashInfer's FA3 FP8
    prefill (fp8_us exactly); its error limit; the rotated recipe in FP8 math against the plain one."""
    row = synthetic_prefill_row(kind, 200.0, 100.0, best_sdpa_us=100.0)
    graph = lambda us, err: {"median_us": us + 5, "graph": {"median_us": us, "rel_err": err}, "rel_err": err}
    row["model"] = model
    row["columns"] |= {prefill.FP8_MATH_COLUMNS[1]: graph(fp8_us, 0.02), prefill.ROTATED_FP8_MATH_COLUMNS[0]: graph(fp8_us * 1.06, 0.02),
                       "FlashInfer FA3 NHD": {"median_us": fp8_us}}
    row["summary"] = prefill.summarize_row(row)
    row["targets"] = prefill.evaluate_targets(row)
    s, targets = row["summary"], row["targets"]
    assert s["fp8_math_best"] == prefill.FP8_MATH_COLUMNS[1] and s["flashinfer_fa3_best"] == "FlashInfer FA3 NHD"
    assert s["sdpa_vs_fp8_math"] == pytest.approx(100.0 / fp8_us) and s["sixteen_bit_vs_fp8_math"] == pytest.approx(200.0 / fp8_us)
    assert s["flashinfer_best"] is None  # FA3 is the FP8 math's peer only
    assert targets.get(f"fp8>={target}xSDPA") is ok and (target is not None or not any("xSDPA" in k and k.startswith("fp8") for k in targets))
    assert targets["fp8>=1.0xFI3"] is True and targets["fp8_err<=0.05"] is True and targets["fp8_rot+c<=1.05x"] is False
    assert "SDPA/fp8" in prefill.table([row])


@pytest.mark.parametrize("ratio,ok", [(1.04, True), (1.06, False)])
def test_prefill_rotated_targets(ratio, ok):
    row = synthetic_prefill_row("chunked prefill", 100.0, 100.0, rotated_us=100.0 * ratio)
    s = row["summary"]
    assert s["rotated_best"] == prefill.ROTATED_COLUMNS[1] and s["rotated_vs_plain"] == pytest.approx(ratio)
    assert row["targets"]["rot+c<=1.05xplain"] is ok and row["targets"]["rot+c_err<=1e-2"] is True
    text = prefill.table([row])
    assert "rot+c us" in text and f" {100.0 * ratio:.1f} " in text
    assert f"rot+c<=1.05xplain:{'PASS' if ok else 'MISS'}" in text


@pytest.mark.parametrize("fraction,ok", [(0.7, True), (0.6, False)])
def test_write_and_amax_targets(fraction, ok):
    us = 1e6 / (fraction * 3.0e12) * 1e6  # 1 MB moved at fraction x 3.0 TB/s
    graph = {"median_us": us, "mismatched_bytes": 0, "exact": True}
    write_cols = {"fp8kv NHD": {"median_us": us + 5, "mismatched_bytes": 0, "graph": graph},
                  write.TORCH_COLUMN: {"median_us": 10 * us}}
    row = {"label": "w", "bytes": 10**6, "columns": write_cols}
    row["summary"] = write.summarize_row(row, CEILINGS)
    assert write.evaluate_targets(row) == {">=67%copy": ok, "exact": True, "rot+c<=1.15xplain": None,
                                           "rot+c_exact": None}
    assert row["summary"]["vs_baseline"] == pytest.approx(0.1)
    amax_cols = {amax.FP8KV_COLUMN: {"median_us": us + 5, "exact": True, "graph": graph},
                 amax.TORCH_COLUMN: {"median_us": 2 * us}}
    row = {"label": "a", "bytes": 10**6, "columns": amax_cols}
    row["summary"] = amax.summarize_row(row, CEILINGS)
    assert amax.evaluate_targets(row) == {">=67%read": ok, "exact": True}


@pytest.mark.parametrize("ratio,bad_bytes,expected", [(1.14, 0, (True, True)), (1.16, 0, (False, True)),
                                                     (1.0, 2, (True, False))])
def test_write_rotated_targets(ratio, bad_bytes, expected):
    timing = lambda us, bad: {"median_us": us + 5, "mismatched_bytes": 0,
                              "graph": {"median_us": us, "mismatched_bytes": bad}}
    nhd, hnd = write.ROTATED_COLUMNS
    cols = {"fp8kv NHD": timing(10.0, 0), "fp8kv HND": timing(12.0, 0),
            nhd: timing(10.0 * ratio + 1, 0), hnd: timing(10.0 * ratio, bad_bytes)}
    row = {"label": "w", "bytes": 10**6, "columns": cols}
    row["summary"] = write.summarize_row(row, CEILINGS)
    row["targets"] = write.evaluate_targets(row)
    s = row["summary"]
    assert s["rotated_best"] == hnd and s["rotated_vs_plain"] == pytest.approx(ratio)
    assert (s["mismatched_bytes"], s["rotated_mismatched_bytes"]) == (0, bad_bytes)
    assert (row["targets"]["rot+c<=1.15xplain"], row["targets"]["rot+c_exact"]) == expected
    text = write.table([row])
    assert all(h in text.splitlines()[0] for h in ("rot+c us", "xplain", "rot+c bad"))
    assert f" {10.0 * ratio:.1f} " in text and "rot+c_exact:" + ("PASS" if expected[1] else "MISS") in text


def synthetic_payload(name, metric, rows, series, relative_to=None):
    payload = {"benchmark": name, "device": {"name": "synthetic"}, "rows": rows,
               "plot": {"metric": metric, "ylabel": metric, "lines": {"target": 2.0}, "series": series}}
    if relative_to:
        payload["plot"]["relative_to"] = relative_to
    return payload


@pytest.mark.parametrize("which", ["decode", "write"])
@needs_matplotlib
def test_json_and_png_outputs(tmp_path, which):
    if which == "decode":
        shapes = [decode.DecodeShape(cases.LLAMA3_8B, b, 4096) for b in (16, 64)]
        rows = [synthetic_decode_row(s, us_for(s, 2.5), 900.0, 700.0, rotated_graph_us=us_for(s, 2.4)) for s in shapes]
        series = [["fp8kv", "@fp8kv_best"], ["rotated", "@rotated_best"], ["SDPA", "@sdpa_best"],
                  ["FI", "@flashinfer_best"], ["absent", "nope"]]
        payload = synthetic_payload("decode", "eff_tb_s", rows, series, ["SDPA", "@sdpa_best"])
    else:
        rows = [{"label": "N1", "columns": {"fp8kv NHD": {"eff_tb_s": 2.1, "median_us": 5.0}}}]
        payload = synthetic_payload("write", "eff_tb_s", rows, [["fp8kv NHD", "fp8kv NHD"]])
    args = argparse.Namespace(json=tmp_path / "out" / "r.json", png=tmp_path / "out" / "r.png")
    common.write_outputs(payload, args)
    assert json.loads(args.json.read_text())["rows"][0] == json.loads(json.dumps(rows[0]))  # columns, summary, targets
    assert args.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"
    subprocess.run([sys.executable, str(BENCHMARKS / "plot.py"), str(args.json), "--png", str(again)], check=True)
    assert again.stat().st_size > 10_000


def test_plot_takes_each_column_at_its_faster_timing():
    import plot

    column = {"median_us": 10.0, "eff_tb_s": 1.0, "graph": {"median_us": 8.0, "eff_tb_s": 1.25}}
    assert plot.best_value(column, "eff_tb_s") == 1.25 and plot.best_value(column, "median_us", min) == 8.0
    assert math.isnan(plot.best_value({"error": "x"}, "eff_tb_s"))


def test_table_alignment():
    text = common.format_table(["a", "bb"], [["1", "22222"], ["333", "4"]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[1].startswith("---")


@pytest.mark.parametrize("script", ["bench_paged_attention.py", "bench_prefill.py", "bench_reshape_and_cache.py",
                                    "bench_kv_amax.py", "plot.py", "flashinfer_wheel.py", "flashinfer_baseline.py"])
def test_scripts_print_help(script):
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_run_all_builds_with_the_readme_install_commands():
    # Steps 1 (the virtual environment, where python3 runs in none) and 3 (fp8kv); step 2 installs a
    # torch, which a benchmark machine has.
    install = (BENCHMARKS.parent / "README.md").read_text().split("## Install", 1)[1].split("\n## ", 1)[0]
    blocks = [block.split("```", 1)[0] for block in install.split("```bash")[1:]]
    (venv_block,) = [block for block in blocks if " -m venv " in block]
    (fp8kv_block,) = [block for block in blocks if "--no-build-isolation" in block]
    readme_commands = [line.split("#")[0].strip() for line in (venv_block + fp8kv_block).splitlines() if line.strip()]
    script = (BENCHMARKS / "run_all.sh").read_text()
    build = script[script.index("build_fp8kv() {"):].split("\n}\n", 1)[0]
    script_commands = [line.strip().removeprefix("&& ").rstrip("\\").strip() for line in build.splitlines()
                       if " -m venv " in line or "/activate" in line or "pip install" in line]
    assert len(readme_commands) == 4 and script_commands == readme_commands
    assert "sys.prefix != sys.base_prefix" in install and "sys.prefix != sys.base_prefix" in build
    result = subprocess.run(["bash", "-n", str(BENCHMARKS / "run_all.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_run_all_refuses_unknown_arguments_and_empty_wheel_folders(tmp_path):
    result = subprocess.run(["bash", str(BENCHMARKS / "run_all.sh"), "--fast"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown argument: --fast" in result.stderr
    result = subprocess.run(["bash", str(BENCHMARKS / "run_all.sh"), "--wheels", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "no .whl files there" in result.stderr


def test_flashinfer_wheel_refuses_a_toolkit_without_curand_headers(tmp_path):
    (tmp_path / "include").mkdir()
    result = subprocess.run([sys.executable, str(BENCHMARKS / "flashinfer_wheel.py"), "--wheel",
                             str(tmp_path / "flashinfer_python-0.7.2.post1-py3-none-any.whl"), "--out", str(tmp_path / "out"),
                             "--cuda-home", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "curand_kernel.h is in none of" in result.stderr, result.stderr
    assert "--include-dir" in result.stderr and not (tmp_path / "out").exists()


def test_benchmarks_refuse_to_run_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_paged_attention.py"), "--quick"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "need a CUDA GPU" in result.stderr


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
