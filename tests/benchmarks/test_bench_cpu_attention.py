"""benchmarks/bench_cpu_attention.py: its --quick run end to end, and its PASS/MISS judgement."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_cpu_attention as bench  # noqa: E402
import common  # noqa: E402

ops, ops_reason = common.load_fp8kv(require_cuda=False)


def columns(sdpa_fp32_us, sdpa_bf16_us, fp8kv_bf16_us, fp8kv_e4m3_us, rel_err=1e-3) -> dict:
    times = dict(zip((*bench.SDPA, *bench.FP8KV), (sdpa_fp32_us, sdpa_bf16_us, fp8kv_bf16_us, fp8kv_e4m3_us)))
    return {name: {"error": "did not run"} if us is None else {"median_us": us, "rel_err": rel_err}
            for name, us in times.items()}


def test_targets_are_twice_sdpa_and_the_error_bound():
    assert bench.targets(columns(100, 50, 100, 200)) == {
        "bf16<=2xfp32": True, "bf16<=2xbf16": True, "e4m3<=2xfp32": True, "e4m3<=2xbf16": False, "err<=0.01": True}
    assert bench.targets(columns(100, 100, 201, 199, rel_err=0.011)) == {
        "bf16<=2xfp32": False, "bf16<=2xbf16": False, "e4m3<=2xfp32": True, "e4m3<=2xbf16": True, "err<=0.01": False}
    missing = bench.targets(columns(100, None, 100, 100))
    assert missing["bf16<=2xbf16"] is None and missing["bf16<=2xfp32"] is True and missing["err<=0.01"] is None


def test_verdict_line_names_what_did_not_pass():
    passing = {"label": "a", "targets": bench.targets(columns(100, 100, 150, 150))}
    assert bench.verdict_line([passing]) == "targets: PASS (all 5)"
    missing = {"label": "b", "targets": bench.targets(columns(100, 100, 250, 150))}
    assert bench.verdict_line([passing, missing]) == \
        "targets: MISS (2 of 10: b bf16<=2xfp32:MISS, b bf16<=2xbf16:MISS)"
    unmeasured = {"label": "c", "targets": bench.targets(columns(100, 100, None, 150))}
    assert bench.verdict_line([passing, unmeasured]).startswith("targets: n/a (3 of 10: c bf16<=2xfp32:n/a")


def test_quick_shapes_cover_each_layout_decode_and_prefill():
    shapes = bench.quick_shapes()
    layouts = {(s.model.num_heads, s.model.num_kv_heads, s.model.head_size, s.q_len == 1) for s in shapes}
    assert layouts == {(9, 3, 64, True), (9, 3, 64, False), (32, 8, 128, True), (32, 8, 128, False)}
    assert {(s.model.name, s.q_len == 1) for s in bench.default_shapes()} == {(s.model.name, s.q_len == 1) for s in shapes}


@pytest.mark.skipif(ops is None, reason=ops_reason)
def test_quick_run(tmp_path):
    out = tmp_path / "cpu.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cpu_attention.py"), "--quick", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert [row["label"] for row in payload["rows"]] == [s.label for s in bench.quick_shapes()]
    for row in payload["rows"]:
        assert set(row["columns"]) == {*bench.SDPA, *bench.FP8KV}
        for name, column in row["columns"].items():
            # Every column ran and is within the error bound; the times are whatever the machine gave.
            assert "error" not in column, (row["label"], name, column)
            assert column["rel_err"] <= bench.MAX_REL_ERR and column["median_us"] > 0, (row["label"], name)
        assert row["targets"][f"err<={bench.MAX_REL_ERR:g}"] is True
        assert all(ok is not None for ok in row["targets"].values())
        assert row["label"] in result.stdout
    assert result.stdout.count("\ntargets: ") == 1 and "load average (1, 5, 15 min) before" in result.stdout
