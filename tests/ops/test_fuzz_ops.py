"""The seeded op fuzzer (tests/ops/fuzz_ops.py), bounded in time: every case runs in a forked child and
must end without a crash or a hang, write nothing outside its tensors, and be either run or refused
with a RuntimeError naming one of the op's arguments. FP8KV_FUZZ_SECONDS sets the budget (default 90)."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

FUZZER = pathlib.Path(__file__).with_name("fuzz_ops.py")


def test_fuzzed_calls_are_run_or_refused_by_name():
    seconds = float(os.environ.get("FP8KV_FUZZ_SECONDS", "90"))
    driver = subprocess.run([sys.executable, str(FUZZER), "--seconds", str(seconds)], capture_output=True, text=True,
                            timeout=seconds + 300)
    assert driver.returncode == 0, driver.stderr[-3000:]
    results = [json.loads(line) for line in driver.stdout.splitlines()]
    outcomes = collections.Counter(r["outcome"] for r in results)
    failures = [r for r in results if r["outcome"] not in ("ran", "refused")]
    reproduce = "reproduce one with: python tests/ops/fuzz_ops.py --seed SEED --in-process"
    assert not failures, f"{outcomes}; {reproduce}\n" + "\n".join(json.dumps(f) for f in failures[:20])
    # The budget must cover a real campaign, with both valid and refused calls among the cases.
    assert len(results) >= 200 and outcomes["ran"] >= 20 and outcomes["refused"] >= 20, outcomes
