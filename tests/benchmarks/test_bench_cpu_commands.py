"""benchmarks/bench_cpu_commands.py: its quick run on the tiny model end to end, and its PASS/MISS
judgement. The times are whatever the machine gives: no speed is asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_cpu_commands as bench  # noqa: E402


def test_the_forwards_evaluate_needs_count_its_calibration_pass():
    assert [bench.needs_calibration(name) for name in ("e4m3-plain", "e4m3", "e4m3-checkpoint",
                                                       "e4m3-centred-checkpoint")] == [False] * 4
    assert [bench.needs_calibration(name) for name in ("e4m3-plain-head", "e4m3-tensor", "e5m2-centred")] == [True] * 3


def runs(*pairs) -> list[dict]:
    return [{"forwards_s": forwards, "command_s": command, "ratio": command / forwards} for forwards, command in pairs]


def test_rows_are_judged_on_the_median_runs_ratio_against_one_and_a_half():
    passing = bench.row("calibrate", "w", 8, runs((10.0, 15.0), (10.0, 30.0), (10.0, 12.0)), "")
    assert (passing["forwards_s"], passing["command_s"], passing["ratio"], passing["pass"]) == (10.0, 15.0, 1.5, True)
    missing = bench.row("evaluate", "w", 12, runs((4.0, 6.4)), "")
    assert (missing["ratio"], missing["pass"]) == (1.6, False)
    assert bench.verdict_line([passing]) == "targets: PASS (all 1)"
    assert bench.verdict_line([passing, missing]) == "targets: MISS (1 of 2: evaluate 1.60x)"
    lines = bench.table([passing, missing]).splitlines()
    assert lines[2].endswith("1.50x  1.50 3.00 1.20  PASS (<=1.5x)") and lines[3].endswith("1.60  MISS (<=1.5x)")


def test_quick_run_on_the_tiny_model(tmp_path):
    out = tmp_path / "commands.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_cpu_commands.py"), "--model", "tiny", "--quick",
                             "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    payload = json.loads(out.read_text())
    assert payload["model"] == "tiny random-weight Llama" and payload["quick"] is True
    assert len(payload["load_average_before"]) == len(payload["load_average_after"]) == 3
    calibrate, evaluate = payload["rows"]
    setting = bench.QUICK
    assert calibrate["command"] == "calibrate"
    assert calibrate["forwards"] == setting.calibrate_tokens // setting.calibrate_seq_len
    assert "calibrated 2 layers on 256 tokens" in calibrate["output"]
    # Per window: the reference, `auto`, the three caches and the calibration pass (e4m3-plain-head).
    assert evaluate["command"] == "evaluate" and evaluate["forwards"] == 6 * setting.evaluate_windows
    assert evaluate["work"] == "2 x 64 tokens: reference + 4 caches + calibration"
    assert "| KV cache | perplexity |" in evaluate["output"] and evaluate["output"].count("| float8_e4m3fn") == 3
    assert payload["repeats"] == 1
    for row in payload["rows"]:
        assert row["forwards_s"] > 0 and row["command_s"] > 0 and len(row["runs"]) == 1
        assert len(row["runs"][0]["load_average"]) == 3
        assert row["ratio"] == pytest.approx(row["command_s"] / row["forwards_s"])
        assert row["pass"] == (row["ratio"] <= bench.MAX_RATIO)
    assert "model: tiny random-weight Llama\n" in result.stdout
    assert result.stdout.count("\ntargets: ") == 1 and "load average (1, 5, 15 min) before" in result.stdout
