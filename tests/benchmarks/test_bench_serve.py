"""CPU tests of benchmarks/bench_serve.py: its smoke run (a tiny random model, offline and through
transformers' server when its [serving] extra is installed) gives a complete, consistent JSON, and its
arguments are checked.

    python -m pytest -q tests/benchmarks/test_bench_serve.py
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_serve as serve  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def smoke(one_cpu_thread, tmp_path_factory):
    """One smoke run's returned payload and the JSON it wrote."""
    path = tmp_path_factory.mktemp("serve") / "serve.json"
    payload = serve.main(["--smoke", "--device", "cpu", "--json", str(path)])
    return payload, json.loads(path.read_text())


def rows_of(payload: dict, mode: str) -> list[dict]:
    return [row for row in payload["rows"] if row["mode"] == mode]


def check_served(row: dict, stream: dict) -> None:
    """A row served the whole stream: every request its drawn length, times that add up."""
    assert "error" not in row, row.get("error")
    assert row["output_counts"] == stream["output_lengths"]
    assert row["output_tokens"] == sum(stream["output_lengths"])
    assert row["prompt_tokens"] == sum(stream["prompt_lengths"])
    assert row["requests"] == stream["requests"] == len(stream["output_lengths"])
    assert math.isclose(row["output_tokens_per_s"], row["output_tokens"] / row["duration_s"])
    for latency in (row["ttft_ms"], row["itl_ms"]):
        assert 0 <= latency["p50"] <= latency["p99"]
    assert row["peak_gib"] is None  # no GPU


def check_systems(rows: list[dict], expected_transformers: int) -> None:
    for scenario in (serve.MEMORY_LIMITED, serve.NOT_LIMITED):
        systems = [row["system"] for row in rows if row["scenario"] == scenario]
        transformers = [name for name in systems if name.startswith("transformers")]
        assert systems[:2] == [serve.FP8, serve.BF16] and len(transformers) == expected_transformers


def test_the_json_written_is_the_payload_returned(smoke):
    payload, written = smoke
    assert written == payload
    assert written["benchmark"] == "serve" and written["device"]["name"] == "cpu"
    assert set(written["streams"]) == {"tiny"}


def test_the_stream_is_drawn_within_its_bounds(smoke):
    stream = smoke[1]["streams"]["tiny"]
    assert stream["requests"] == serve.SMOKE.requests
    low, high = stream["prompt_tokens"]
    assert all(low <= n <= high for n in stream["prompt_lengths"])
    low, high = stream["output_tokens"]
    assert all(low <= n <= high for n in stream["output_lengths"])


def test_offline_serves_every_request_its_drawn_length_on_the_three_systems(smoke):
    payload = smoke[1]
    rows = rows_of(payload, serve.OFFLINE)
    check_systems(rows, expected_transformers=1)  # the CPU runs transformers' SDPA only
    stream = payload["streams"]["tiny"]
    for row in rows:
        check_served(row, stream)
        assert row["cuda_graphs"] == [False, False]


def test_every_system_holds_the_same_budget_of_pages(smoke):
    payload = smoke[1]
    stream = payload["streams"]["tiny"]
    budgets = {serve.MEMORY_LIMITED: serve.SMOKE.kv_cache_gib, serve.NOT_LIMITED: stream["bf16_stream_gib"]}
    assert budgets[serve.MEMORY_LIMITED] < budgets[serve.NOT_LIMITED]
    bf16_token = 2 * 2 * 2 * 64 * 2  # K and V, 2 layers, 2 KV heads, head size 64, 2 bytes
    for row in rows_of(payload, serve.OFFLINE):
        assert row["kv_cache_gib"] == budgets[row["scenario"]]
        block = payload["page_size"] * bf16_token / (2 if row["system"] == serve.FP8 else 1) / serve.GIB
        assert row["kv_cache_gib"] - block < row["cache_gib"] <= row["kv_cache_gib"]
        assert row["cache_tokens"] == row["cache_blocks"] * payload["page_size"]
        assert row["allocated_gib"] >= row["cache_gib"]
    for scenario in budgets:
        blocks = {row["system"]: row["cache_blocks"] for row in rows_of(payload, serve.OFFLINE)
                  if row["scenario"] == scenario}
        assert blocks[serve.BF16] == blocks["transformers sdpa"]
        assert blocks[serve.FP8] >= 2 * blocks[serve.BF16]


def test_online_serves_every_request_its_drawn_length_on_the_three_systems(smoke):
    payload = smoke[1]
    rows = rows_of(payload, serve.ONLINE)
    if "skipped" in rows[0]:
        pytest.skip(rows[0]["skipped"])
    check_systems(rows, expected_transformers=1)
    stream = payload["streams"]["tiny"]
    for row in rows:
        check_served(row, stream)
        assert row["clients"] == stream["clients"] == serve.SMOKE.clients


def test_ratios_and_targets_come_from_the_reported_numbers(smoke):
    payload = smoke[1]
    assert len(payload["comparisons"]) == 4  # two scenarios, two modes
    for c in payload["comparisons"]:
        rows = {row["system"]: row for row in payload["rows"]
                if (row["model"], row["scenario"], row["mode"]) == (c["model"], c["scenario"], c["mode"])}
        if any("skipped" in row for row in rows.values()):
            assert c["fp8_vs_bf16"] is None and set(c["targets"].values()) == {"n/a"}
            continue
        rate = {name: row["output_tokens_per_s"] for name, row in rows.items()}
        transformers = {name: value for name, value in rate.items() if name.startswith("transformers")}
        assert c["transformers_best"] == max(transformers, key=transformers.get)
        assert c["fp8_vs_bf16"] == pytest.approx(rate[serve.FP8] / rate[serve.BF16])
        assert c["bf16_vs_transformers"] == pytest.approx(rate[serve.BF16] / rate[c["transformers_best"]])
        need = 1.6 if c["scenario"] == serve.MEMORY_LIMITED else 1.0
        fp8_target, bf16_target = c["targets"].values()
        assert fp8_target == ("PASS" if c["fp8_vs_bf16"] >= need else "MISS")
        assert bf16_target == ("PASS" if c["bf16_vs_transformers"] >= 1.0 else "MISS")
    assert payload["targets"] == {name: ok for c in payload["comparisons"] for name, ok in c["targets"].items()}


def test_the_stream_is_fixed_by_its_seed():
    def draw(seed):
        return serve.draw_stream(5, (3, 9), (2, 4), 50, seed)

    assert draw(7) == draw(7) and draw(7) != draw(8)
    for request in draw(7):
        assert 3 <= len(request.prompt) <= 9 and 2 <= request.output_tokens <= 4
        assert all(0 <= token < 50 for token in request.prompt)


@pytest.mark.parametrize("argv,named", [
    (["--smoke", "--prompt-tokens", "10-5"], "--prompt-tokens"),
    (["--smoke", "--output-tokens", "many"], "--output-tokens"),
    (["--smoke", "--requests", "0"], "--requests"),
    (["--smoke", "--kv-cache-memory", "-1"], "--kv-cache-memory"),
    (["--smoke", "--model", "smollm2"], "--model"),
    (["--model", "llama3-8b", "--device", "cpu"], "--device"),
    (["--device", "cpu"], "--device"),
])
def test_bad_arguments_are_refused_naming_them(argv, named, capsys):
    with pytest.raises(SystemExit):
        serve.parse_arguments(argv)
    assert f"argument {named}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,named", [
    (["--kv-cache-memory", "1"], "--kv-cache-memory 1 GiB holds tiny's whole stream"),
    (["--prompt-tokens", "1-131072"], "--prompt-tokens / --output-tokens: tiny holds 131072 positions"),
])
def test_a_stream_the_model_or_budget_cannot_measure_is_refused(argv, named):
    with pytest.raises(SystemExit, match=named):
        serve.main(["--smoke", "--device", "cpu", *argv])


def test_a_preempted_request_keeps_its_submission_time_and_token_times(monkeypatch):
    # transformers requeues a preempted request as a new one (its tokens so far in the prompt); the stream's
    # latencies need the original's submission time and the times of the tokens it had generated.
    from transformers.generation.continuous_batching.requests import RequestState

    requeue = RequestState.create_equivalent_initial_request
    monkeypatch.setattr(RequestState, "create_equivalent_initial_request", requeue)  # restored after the test
    serve.keep_timestamps_across_soft_resets()
    wrapped = RequestState.create_equivalent_initial_request
    serve.keep_timestamps_across_soft_resets()  # once: a second call wraps nothing more
    assert RequestState.create_equivalent_initial_request is wrapped
    state = RequestState(request_id="r", initial_tokens=[1, 2, 3], max_new_tokens=5, record_timestamps=True)
    state.created_time, state._timestamps, state.generated_tokens = 10.0, [11.0, 12.5], [4, 5]
    requeued = state.create_equivalent_initial_request()
    assert requeued.initial_tokens == [1, 2, 3, 4, 5] and requeued.max_new_tokens == 3
    assert (requeued.created_time, requeued.timestamps) == (10.0, [11.0, 12.5])


def test_a_run_stopped_midway_has_saved_the_rows_it_measured(tmp_path, monkeypatch):
    class Stopped(BaseException):  # as a time limit's signal would: not an error of one row
        pass

    def stop(*args, **kwargs):
        raise Stopped

    monkeypatch.setattr(serve, "measure_online", stop)
    path = tmp_path / "serve.json"
    with pytest.raises(Stopped):
        serve.main(["--smoke", "--device", "cpu", "--scenario", serve.MEMORY_LIMITED, "--no-transformers",
                    "--json", str(path)])
    saved = json.loads(path.read_text())
    assert [(row["mode"], row["system"]) for row in saved["rows"]] == [(serve.OFFLINE, serve.FP8),
                                                                      (serve.OFFLINE, serve.BF16)]
    for row in saved["rows"]:
        check_served(row, saved["streams"]["tiny"])
