"""CPU checks of the benchmark harness: everything that does not need a GPU.

    python -m pytest -q benchmarks/selfcheck.py

Covered: shape tables and byte/FLOP counts (against KERNELS.md's table and brute-force sums), the
random paged caches (poisoned tails, HND storage, gathers), the float32 reference (against a float64
loop), SDPA with its causal alignment, the column glue run through fp8kv's CPU kernels (attention
within tolerance, cache bytes identical to the PyTorch quantize path, maxima exact), FlashInfer's
page description, PASS/MISS judgement on synthetic rows, and JSON + PNG output from synthetic results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import time
import types

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import attention_cases as cases  # noqa: E402
import bench_kv_amax  # noqa: E402
import bench_paged_attention as decode  # noqa: E402
import bench_prefill as prefill  # noqa: E402
import bench_reshape_and_cache as write  # noqa: E402
import common  # noqa: E402
import flashinfer_baseline  # noqa: E402

CPU = torch.device("cpu")
MiB = 1 << 20
ops, ops_reason = common.load_fp8kv(require_cuda=False)
needs_fp8kv = pytest.mark.skipif(ops is None, reason=ops_reason)
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed (the PNG output needs it)")


# ---------------------------------------------------------------------------------------------
# Shapes and counts
# ---------------------------------------------------------------------------------------------

def test_decode_shapes_are_issue_3s():
    shapes = decode.issue_shapes()
    labels = [s.label for s in shapes]
    assert len(labels) == len(set(labels)) == 7 * 2 + 4
    gqa16 = {(s.batch, s.context) for s in shapes if s.is_gqa and s.block_size == 16}
    assert gqa16 == {(1, 32768), (1, 131072), (16, 4096), (64, 4096), (16, 16384), (128, 2048), (256, 1024)}
    variants = {(s.num_heads, s.num_kv_heads, s.head_size) for s in shapes if not s.is_gqa}
    assert variants == {(32, 32, 128), (8, 1, 128), (32, 8, 64), (32, 8, 256)}
    assert all((s.batch, s.context) == (64, 4096) for s in shapes if not s.is_gqa)


# FP8 K+V bytes from KERNELS.md's floor table (batch, Hq, Hkv, head, context) -> MiB.
@pytest.mark.parametrize("batch,hq,hkv,head,context,mib", [
    (1, 32, 8, 128, 32768, 64), (1, 32, 8, 128, 131072, 256), (16, 32, 8, 128, 4096, 128),
    (64, 32, 8, 128, 4096, 512), (16, 32, 8, 128, 16384, 512), (128, 32, 8, 128, 2048, 512),
    (256, 32, 8, 128, 1024, 512), (64, 32, 32, 128, 4096, 2048), (64, 8, 1, 128, 4096, 64),
    (64, 32, 8, 64, 4096, 256), (64, 32, 8, 256, 4096, 1024),
])
def test_decode_fp8_bytes_match_kernels_md(batch, hq, hkv, head, context, mib):
    shape = decode.DecodeShape(batch, context, hq, hkv, head)
    assert shape.kv_bytes(1) == mib * MiB
    assert shape.kv_bytes(2) == 2 * mib * MiB


@pytest.mark.parametrize("batch,q_len,seq_len", [(1, 1, 1), (2, 1, 37), (3, 5, 5), (2, 4, 19), (1, 16, 100)])
def test_attention_flops_counts_visible_keys(batch, q_len, seq_len):
    heads, head = 3, 8
    visible = sum(seq_len - q_len + j + 1 for j in range(q_len))
    assert cases.attention_flops(batch, q_len, seq_len, heads, head) == 4 * head * heads * batch * visible


def test_prefill_shapes_are_issue_7s():
    shapes = {s.kind: s for s in prefill.issue_shapes()}
    assert (shapes["prefill"].batch, shapes["prefill"].q_len, shapes["prefill"].seq_len) == (4, 4096, 4096)
    assert (shapes["chunked"].batch, shapes["chunked"].q_len, shapes["chunked"].seq_len) == (8, 512, 8704)
    assert (shapes["verify"].batch, shapes["verify"].q_len, shapes["verify"].seq_len) == (64, 4, 4100)


def test_write_and_amax_byte_counts():
    s = write.WriteShape(16384)
    elements = 2 * 16384 * 8 * 128
    assert s.bytes_moved == elements * 3 + 16384 * 8
    assert all(w.tokens >= 16384 for w in write.issue_shapes())
    assert bench_kv_amax.AmaxShape(1000, True).bytes_read == 2 * 1000 * 8 * 128 * 2


@pytest.mark.parametrize("pattern,count", [("bs64", 7), ("h8/1", 1), ("^B1 ", 4), (None, 18)])
def test_shape_filter(pattern, count):
    assert len(common.select_shapes(decode.issue_shapes(), pattern)) == count


def test_shape_filter_rejects_no_match():
    with pytest.raises(SystemExit, match="matches none"):
        common.select_shapes(decode.issue_shapes(), "no such shape")


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


def test_gather_dequantize_matches_a_loop():
    c = small_cache()
    got = cases.gather_dequantize(c.key_hnd, c.block_tables, c.seq_len, c.k_scale)
    for b in range(c.block_tables.shape[0]):
        for pos in range(c.seq_len):
            block, offset = int(c.block_tables[b, pos // c.block_size]), pos % c.block_size
            want = c.key_nhd[block, offset].float() * cases.K_SCALE
            assert torch.equal(got[b, :, pos].float(), want)


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


@pytest.mark.parametrize("q_len,kv_len", [(1, 40), (6, 6), (4, 19)])
def test_sdpa_causal_alignment(q_len, kv_len):
    gen = torch.Generator(CPU).manual_seed(3)
    query = torch.randn(2, 4, q_len, 16, generator=gen).to(torch.bfloat16)
    key, value = (torch.randn(2, 2, kv_len, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    backend = cases.first_working_sdpa_backend(query, key, value, 0.25, ("flash", "efficient", "math"))
    got = cases.sdpa(query, key, value, 0.25, backend)
    # bf16 output and bf16 intermediate products on CPU: ~1e-3 relative.
    assert common.relative_error(got, reference_float64(query, key, value, 0.25)) < 1e-2


def test_first_working_backend_names_every_refusal():
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 3, 8, 16)  # 4 query heads cannot share 3 KV heads
    with pytest.raises(RuntimeError, match="math"):
        cases.first_working_sdpa_backend(q, k, k, 1.0, ("math",))


def test_relative_error_flags_nan():
    ref = torch.ones(4)
    assert common.relative_error(torch.tensor([1.0, float("nan"), 1.0, 1.0]), ref) == math.inf
    assert common.relative_error(ref.clone(), ref) == 0.0


# ---------------------------------------------------------------------------------------------
# Column glue through fp8kv's CPU kernels
# ---------------------------------------------------------------------------------------------

@needs_fp8kv
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (4, 1)])
def test_decode_column_matches_reference(layout, hq, hkv):
    shape = decode.DecodeShape(3, 45, hq, hkv, 32, block_size=8)
    case = decode.make_case(shape, CPU, seed=4)
    ref = decode.reference_output(case)
    run = decode.fp8kv_column(ops, case, *case.cache.layout(layout), case.cache.k_scale, case.cache.v_scale)
    assert common.relative_error(run(), ref) < decode.MAX_REL_ERR


@needs_fp8kv
def test_bf16_cache_column_matches_reference():
    case = decode.make_case(decode.DecodeShape(2, 40, 4, 2, 32, block_size=16), CPU, seed=5)
    run = decode.fp8kv_bf16_cache_column(ops, case)
    assert common.relative_error(run(), decode.reference_output(case)) < decode.MAX_REL_ERR


@needs_fp8kv
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind,batch,q_len,cached", [("prefill", 2, 20, 0), ("chunked", 2, 8, 30), ("verify", 3, 4, 25)])
def test_prefill_columns_match_reference(layout, kind, batch, q_len, cached):
    shape = prefill.PrefillShape(kind, batch, q_len, cached, num_heads=4, num_kv_heads=2, head_size=32, block_size=8)
    case = prefill.make_case(shape, CPU, seed=6)
    key, value = prefill.dequantized(case)
    ref = cases.reference_attention(case.batched(case.query), key, value, case.softmax_scale)
    out = prefill.fp8kv_column(ops, case, layout)()
    assert common.relative_error(case.batched(out), ref) < prefill.MAX_REL_ERR
    decode_out = prefill.fp8kv_column(ops, case, layout, decode=True)()
    assert common.relative_error(decode_out, ref[:, :, -1]) < prefill.MAX_REL_ERR


@needs_fp8kv
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cache_write_bytes_equal_torch_path(fused, layout):
    shape = write.WriteShape(200, num_kv_heads=2, head_size=32, block_size=8, fused_qkv=fused)
    case = write.make_case(shape, CPU, seed=7)
    codes = case.expected_key.view(torch.uint8)
    assert int((codes & 0x7F == 0x7E).sum()) > 0  # some values saturated to +-448
    key_cache, value_cache = (write.empty_cache(shape, case.expected_key.shape[0], CPU, layout) for _ in range(2))
    ops.reshape_and_cache(case.key, case.value, key_cache, value_cache, case.slot_mapping, case.k_scale, case.v_scale)
    assert write.mismatch_check(case, key_cache, value_cache)(None) == {"mismatched_bytes": 0}


def test_cache_write_check_counts_mismatches():
    shape = write.WriteShape(64, num_kv_heads=2, head_size=16, block_size=8)
    case = write.make_case(shape, CPU, seed=8)
    key_cache, value_cache = case.expected_key.clone(), case.expected_value.clone()
    key_cache.view(torch.uint8)[0, 0, 0, :3] ^= 1
    assert write.mismatch_check(case, key_cache, value_cache)(None) == {"mismatched_bytes": 3}


@needs_fp8kv
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_kv_amax_matches_torch(per_head, fused):
    shape = bench_kv_amax.AmaxShape(300, per_head, num_kv_heads=4, head_size=32, fused_qkv=fused)
    key, value = bench_kv_amax.make_inputs(shape, CPU, seed=9)
    expected = (bench_kv_amax.torch_amax(key, per_head), bench_kv_amax.torch_amax(value, per_head))
    assert expected[0].shape == ((4,) if per_head else (1,))
    got = [torch.zeros_like(e) for e in expected]
    ops.kv_amax(key, value, *got)
    assert bench_kv_amax.exact_check(expected)(got) == {"exact": True}


def test_flashinfer_page_description():
    block_tables = torch.tensor([[5, 2, 9], [1, 7, 3], [4, 0, 8]], dtype=torch.int32)
    seq_lens = torch.tensor([17, 48, 1], dtype=torch.int32)
    indptr, indices, last = flashinfer_baseline.paged_kv_indices(block_tables, seq_lens, 16)
    assert indptr.tolist() == [0, 2, 5, 6]
    assert indices.tolist() == [5, 2, 1, 7, 3, 4]
    assert last.tolist() == [1, 16, 1]


# ---------------------------------------------------------------------------------------------
# Judgement, tables, JSON and PNG from synthetic results
# ---------------------------------------------------------------------------------------------

def synthetic_decode_row(shape, fp8_us, sdpa_us, fi_us=None, err=2e-3):
    cols = {"fp8kv e4m3 NHD": {"median_us": fp8_us, "rel_err": err},
            "fp8kv e4m3 HND": {"median_us": fp8_us * 1.1, "rel_err": err},
            "SDPA bf16": {"median_us": sdpa_us, "rel_err": 1e-3}}
    if fi_us is not None:
        cols["FlashInfer cuda-core NHD"] = {"median_us": fi_us, "rel_err": 1e-3}
    for name, col in cols.items():
        col["bytes"] = shape.kv_bytes(2 if name == "SDPA bf16" else 1)
        col["eff_tb_s"] = col["bytes"] / (col["median_us"] * 1e-6) / common.TB
    row = {"label": shape.label, "shape": decode.dataclasses.asdict(shape), "columns": cols}
    row["summary"] = decode.summarize_row(row, {"copy_tb_s": 3.0, "read_tb_s": 3.2})
    return row


def us_for(shape, tb_s):
    return shape.kv_bytes(1) / (tb_s * common.TB) * 1e6


def test_decode_targets():
    big = decode.DecodeShape(64, 4096)  # 512 MiB FP8
    b1 = decode.DecodeShape(1, 32768)
    mqa = decode.DecodeShape(64, 4096, 8, 1)
    small = decode.DecodeShape(16, 2048)  # 32k tokens: neither the large nor the batch-1 rule
    rows = [
        synthetic_decode_row(big, us_for(big, 2.7), sdpa_us=us_for(big, 2.7) / 0.5, fi_us=us_for(big, 2.0)),
        synthetic_decode_row(b1, us_for(b1, 1.9), sdpa_us=1000.0),
        synthetic_decode_row(mqa, us_for(mqa, 2.7 * 0.84), sdpa_us=1000.0, err=0.02),
        synthetic_decode_row(small, us_for(small, 1.0), sdpa_us=1000.0),
    ]
    decode.evaluate_targets(rows)
    assert rows[0]["targets"] == {"<=0.55xSDPA": True, ">=2.6TB/s": True, "<FlashInfer": True, "err<=1e-2": True}
    assert rows[1]["targets"] == {">=2.0TB/s": False, "<FlashInfer": None, "err<=1e-2": True}
    assert rows[2]["targets"] == {">=0.85xGQA": False, "<FlashInfer": None, "err<=1e-2": False}
    assert rows[3]["targets"] == {"<FlashInfer": None, "err<=1e-2": True}
    assert rows[0]["summary"]["fp8kv_best"] == "fp8kv e4m3 NHD"
    assert abs(rows[0]["summary"]["vs_sdpa"] - 0.5) < 1e-12
    text = decode.table(rows)
    assert "<=0.55xSDPA:PASS" in text and ">=2.0TB/s:MISS" in text and "<FlashInfer:n/a" in text


def test_decode_variant_without_its_gqa_reference_is_not_judged():
    mqa = decode.DecodeShape(64, 4096, 8, 1)
    rows = [synthetic_decode_row(mqa, us_for(mqa, 2.7), sdpa_us=1000.0)]
    decode.evaluate_targets(rows)
    assert rows[0]["targets"][">=0.85xGQA"] is None


def test_decode_row_whose_fp8kv_failed():
    shape = decode.DecodeShape(16, 4096)
    row = {"label": shape.label, "shape": decode.dataclasses.asdict(shape),
           "columns": {n: {"error": "RuntimeError: no kernel"} for n in decode.FP8KV_COLUMNS}}
    row["summary"] = decode.summarize_row(row, {"copy_tb_s": 3.0, "read_tb_s": 3.2})
    decode.evaluate_targets([row])
    assert row["targets"] == {"<=0.55xSDPA": None, ">=2.6TB/s": None, "<FlashInfer": None, "err<=1e-2": None}
    assert "no kernel" in decode.errors_text([row])


@pytest.mark.parametrize("kind,fp8_us,sdpa_us,decode_us,ok", [
    ("prefill", 190.0, 100.0, None, True), ("chunked", 210.0, 100.0, None, False),
    ("verify", 125.0, 50.0, 100.0, True), ("verify", 135.0, 50.0, 100.0, False),
])
def test_prefill_targets(kind, fp8_us, sdpa_us, decode_us, ok):
    cols = {"fp8kv e4m3 NHD": {"median_us": fp8_us, "tflops": 1.0, "rel_err": 1e-3},
            "SDPA bf16 causal": {"median_us": sdpa_us, "tflops": 1.0}}
    if decode_us is not None:
        cols["fp8kv decode NHD"] = {"median_us": decode_us, "rel_err": 1e-3}
    row = {"label": kind, "shape": {"kind": kind}, "columns": cols}
    row["summary"] = prefill.summarize_row(row)
    targets = prefill.evaluate_targets(row)
    assert targets[">=0.5xSDPA" if kind != "verify" else "<=1.3xdecode"] is ok
    assert targets["err<=1e-2"] is True
    row["targets"] = targets
    assert ("PASS" if ok else "MISS") in prefill.table([row])


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
        rows = [synthetic_decode_row(decode.DecodeShape(b, 4096), us_for(decode.DecodeShape(b, 4096), 2.5), 900.0, 700.0)
                for b in (16, 64)]
        series = [["fp8kv", "@fp8kv_best"], ["SDPA", "SDPA bf16"], ["FI", "@flashinfer_best"], ["absent", "nope"]]
        payload = synthetic_payload("decode", "eff_tb_s", rows, series, "SDPA bf16")
    else:
        rows = [{"label": "N1", "columns": {"fp8kv NHD": {"eff_tb_s": 2.1, "median_us": 5.0}}}]
        payload = synthetic_payload("write", "eff_tb_s", rows, [["fp8kv NHD", "fp8kv NHD"]])
    args = argparse.Namespace(json=tmp_path / "out" / "r.json", png=tmp_path / "out" / "r.png")
    common.write_outputs(payload, args)
    assert json.loads(args.json.read_text())["rows"][0]["label"] == rows[0]["label"]
    assert args.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"
    subprocess.run([sys.executable, str(HERE / "plot.py"), str(args.json), "--png", str(again)], check=True)
    assert again.stat().st_size > 10_000


def test_table_alignment():
    text = common.format_table(["a", "bb"], [["1", "22222"], ["333", "4"]])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1 and lines[1].startswith("---")


@pytest.mark.parametrize("script", ["bench_paged_attention.py", "bench_prefill.py", "bench_reshape_and_cache.py",
                                    "bench_kv_amax.py", "plot.py", "flashinfer_wheel.py", "flashinfer_baseline.py"])
def test_scripts_print_help(script):
    result = subprocess.run([sys.executable, str(HERE / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout


def test_benchmarks_refuse_to_run_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    result = subprocess.run([sys.executable, str(HERE / "bench_paged_attention.py"), "--quick"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "need a CUDA GPU" in result.stderr


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
    monkeypatch.setattr(common, "BANDWIDTH_PROBE_BYTES", 1 << 20)
    monkeypatch.setattr(common, "MIN_REPS", 2)
    monkeypatch.setattr(common, "MAX_REPS", 3)
    monkeypatch.setattr(common, "load_fp8kv", lambda require_cuda=True: (ops, ops_reason) if ops else (None, ops_reason))
    monkeypatch.setattr(flashinfer_baseline, "load", lambda: (None, "FlashInfer needs CUDA"))


def run_main(module, monkeypatch, tmp_path, *flags):
    out = tmp_path / module.__name__
    monkeypatch.setattr(sys, "argv", [module.__name__, "--json", str(out) + ".json", "--png", str(out) + ".png", *flags])
    module.main()
    payload = json.loads((tmp_path / f"{module.__name__}.json").read_text())
    assert (tmp_path / f"{module.__name__}.png").stat().st_size > 10_000
    return payload


@needs_fp8kv
@needs_matplotlib
def test_decode_main_on_cpu(cpu_as_cuda, monkeypatch, tmp_path, capsys):
    shapes = [decode.DecodeShape(2, 64, 8, 2, 32, block_size=16), decode.DecodeShape(2, 64, 4, 4, 32, block_size=16)]
    monkeypatch.setattr(decode, "issue_shapes", lambda: shapes)
    monkeypatch.setattr(decode, "GQA", (8, 2, 32))
    monkeypatch.setattr(decode, "GQA_REFERENCE_SHAPE", (2, 64))
    payload = run_main(decode, monkeypatch, tmp_path)
    printed = capsys.readouterr().out
    assert [r["label"] for r in payload["rows"]] == [s.label for s in shapes]
    for row in payload["rows"]:
        for name in ("fp8kv e4m3 NHD", "fp8kv e4m3 HND", "fp8kv bf16 cache", "dequant+SDPA"):
            assert row["columns"][name]["rel_err"] < decode.MAX_REL_ERR, (name, row["columns"][name])
            assert row["columns"][name]["reps"] >= 2
        assert row["targets"]["err<=1e-2"] is True
    assert ">=0.85xGQA" in payload["rows"][1]["targets"]
    assert "FlashInfer needs CUDA" in printed and "targets" in printed


@needs_fp8kv
@needs_matplotlib
def test_prefill_main_on_cpu(cpu_as_cuda, monkeypatch, tmp_path):
    shapes = [prefill.PrefillShape("chunked", 2, 8, 24, 4, 2, 32), prefill.PrefillShape("verify", 3, 4, 20, 4, 2, 32)]
    monkeypatch.setattr(prefill, "issue_shapes", lambda: shapes)
    payload = run_main(prefill, monkeypatch, tmp_path)
    for row in payload["rows"]:
        for name in prefill.FP8KV_COLUMNS:
            assert row["columns"][name]["rel_err"] < prefill.MAX_REL_ERR
    verify = payload["rows"][1]
    assert verify["summary"]["decode_best"] in prefill.DECODE_COLUMNS
    assert verify["targets"]["<=1.3xdecode"] in (True, False)


@needs_fp8kv
@needs_matplotlib
def test_write_and_amax_main_on_cpu(cpu_as_cuda, monkeypatch, tmp_path):
    monkeypatch.setattr(write, "issue_shapes", lambda: [write.WriteShape(96, 2, 32, 8), write.WriteShape(96, 2, 32, 8, fused_qkv=True)])
    payload = run_main(write, monkeypatch, tmp_path)
    for row in payload["rows"]:
        assert all(col.get("mismatched_bytes") == 0 for col in row["columns"].values()), row["columns"]
        assert row["targets"]["exact"] is True
    monkeypatch.setattr(bench_kv_amax, "issue_shapes",
                        lambda: [bench_kv_amax.AmaxShape(64, p, 2, 32) for p in (False, True)])
    payload = run_main(bench_kv_amax, monkeypatch, tmp_path)
    for row in payload["rows"]:
        assert row["columns"]["fp8kv"]["exact"] is True and row["columns"]["torch inf-norm"]["exact"] is True


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
