"""benchmarks/bench_layer_call.py on the CPU: its host-time rows end to end (the GPU step rows need a GPU)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402

ops, ops_reason = common.load_fp8kv(require_cuda=False)


@pytest.mark.skipif(ops is None, reason=ops_reason)
def test_the_cpu_run_times_every_call(tmp_path):
    out = tmp_path / "layer_call.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bench_layer_call.py"), "--device", "cpu", "--json",
                             str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["device"]["name"] == "cpu" and "step" not in payload
    calls = [row["call"] for row in payload["host"]]
    assert calls == ["fp8kv.ops.reshape_and_cache (layer)", "fp8kv.ops.paged_attention (layer)",
                     "torch.ops.fp8kv.paged_attention (raw)", "fp8kv.ops.paged_attention (layer, plan)",
                     "fp8kv.ops.plan_paged_attention (once per step)",
                     "bf16 SDPA decode (F.scaled_dot_product_attention)"]
    assert all(row["host_us"] > 0 for row in payload["host"])
    for call in calls:
        assert call in result.stdout
