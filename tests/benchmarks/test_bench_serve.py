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
import types

import pytest
import torch

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

    # The online rows are where it stops: reached whether or not transformers' [serving] extra is installed.
    monkeypatch.setattr(serve, "online_unavailable", lambda: None)
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


def test_systems_are_chosen_by_name():
    payload = serve.main(["--smoke", "--device", "cpu", "--scenario", serve.NOT_LIMITED, "--no-online",
                          "--systems", "bf16$"])
    assert [(row["mode"], row["system"]) for row in payload["rows"]] == [(serve.OFFLINE, serve.BF16),
                                                                         (serve.ONLINE, serve.BF16)]
    assert payload["rows"][1]["skipped"] == "disabled by --no-online"
    with pytest.raises(SystemExit, match="'nothing' matches none of: fp8kv e4m3, fp8kv bf16"):
        serve.main(["--smoke", "--device", "cpu", "--no-transformers", "--systems", "nothing"])


# A window of 2 layers: 3 decode steps (one decode kernel + its split merge per layer), then 1 step with
# prefill (a multi-token kernel per layer). Spans in microseconds on the device's clock.
KERNELS = [("nvjet_gemm", 0, 100), ("rms_norm", 100, 110), ("reshape_and_cache_kernel", 110, 115),
           ("decode_kernel<...>", 115, 150), ("merge_splits_kernel", 145, 155), ("nvjet_gemm", 155, 255),
           ("decode_kernel<...>", 300, 330), ("decode_kernel<...>", 400, 430), ("decode_kernel<...>", 500, 530),
           ("decode_kernel<...>", 600, 630), ("decode_kernel<...>", 700, 730),
           ("transformed_write_kernel", 800, 820), ("sm90a_kernel<...>", 820, 900), ("sm80_kernel<...>", 950, 990)]


def test_a_step_profile_counts_steps_by_attention_launches_and_busy_time_once_per_overlap():
    token_times = [[0.5, 1.5, 2.0, 3.5], [0.9, 1.0, 2.9]]  # host seconds; the window is [1, 3)
    profile = serve.step_profile(KERNELS, [1.0, 3.0], token_times, layers=2)
    assert (profile["decode_steps"], profile["mixed_steps"], profile["steps"]) == (3, 1, 4)
    assert profile["window_s"] == 2.0 and profile["ms_per_step"] == 500.0
    assert profile["tokens_per_step"] == 4 / 4  # 1.5, 2.0, 1.0, 2.9
    # Kinds: attention 35 + 10 - 5 (the merge overlaps the decode kernel) + 5 * 30 + 80 + 40 = 310 us.
    assert profile["kinds_ms_per_step"] == pytest.approx(
        {"attention": 0.310 / 4, "cache write": 0.025 / 4, "matmul": 0.200 / 4, "other": 0.010 / 4})
    assert profile["busy_ms_per_step"] == pytest.approx(0.545 / 4)  # the kinds' sum: no two kinds overlap here


def test_a_step_profile_without_attention_steps_says_so():
    profile = serve.step_profile(KERNELS[:3], [0.0, 1.0], [[0.5]], layers=2)
    assert profile == {"error": "no step of fp8kv's attention ran in the profile window"}


class FakeProfiler:
    """torch.profiler.profile's part that ProfileWindow uses, with two kernels (and a host event)."""

    def __init__(self, activities):
        assert activities == [torch.profiler.ProfilerActivity.CUDA]
        self.entered = self.exited = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc_info):
        self.exited += 1

    def events(self):
        def event(name, device_type, start, end):
            return types.SimpleNamespace(name=name, device_type=device_type,
                                         time_range=types.SimpleNamespace(start=start, end=end))

        return [event("decode_kernel", torch.autograd.DeviceType.CUDA, 0, 10),
                event("cudaLaunchKernel", torch.autograd.DeviceType.CPU, 0, 1),
                event("decode_kernel", torch.autograd.DeviceType.CUDA, 20, 30)]


def test_a_profile_window_runs_the_profiler_between_its_edges(monkeypatch):
    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    window = serve.ProfileWindow(2.0, 5.0)
    assert window.advance(0.5) == 1.5  # waits for the start
    assert window.profiler is None
    assert window.advance(2.25) == 2.75  # started; waits for the end
    profiler = window.profiler
    assert profiler.entered == 1 and profiler.exited == 0
    assert window.advance(4.0) == 1.0 and window.profiler is profiler
    assert window.advance(5.0) == math.inf  # stopped: nothing more to wait for
    assert profiler.exited == 1 and window.profiler is None
    assert window.kernels == [("decode_kernel", 0, 10), ("decode_kernel", 20, 30)]  # device events only
    assert window.advance(6.0) == math.inf and profiler.entered == 1  # never restarted
    window.stop()  # a stream's end after the window: nothing to stop
    assert profiler.exited == 1
    host_start, host_end = window.host_times
    summary = window.summary([[host_start, host_end]], layers=1)
    assert summary["steps"] == 2 and summary["tokens_per_step"] == 0.5


def test_a_profile_window_stopped_by_the_end_of_its_stream(monkeypatch):
    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    window = serve.ProfileWindow(1.0, 9.0)
    window.advance(1.0)
    window.stop()
    assert window.profiler is None and len(window.kernels) == 2 and window.host_times[0] <= window.host_times[1]
    never = serve.ProfileWindow(9.0, 10.0)
    never.advance(1.0)
    never.stop()
    assert never.summary([], layers=1) == {"error": "the stream ended before the profile window started (9 s)"}


@pytest.mark.parametrize("argv,named", [
    (["--profile-window", "5-2"], "START < END"),
    (["--profile-window", "x"], "START-END"),
    (["--profile-window", "1-2", "--device", "cpu"], "it needs --device cuda"),
])
def test_bad_profile_windows_are_refused(argv, named, capsys):
    with pytest.raises(SystemExit):
        serve.parse_arguments(["--smoke", *argv])
    assert named in capsys.readouterr().err


@pytest.mark.gpu
def test_a_profiled_stream_on_the_gpu_reports_its_steps():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fp8kv.integrations import transformers_continuous_batching as continuous_batching

    try:  # the served rows run on transformers' continuous batching
        continuous_batching.check_transformers()
    except continuous_batching.UnsupportedTransformersError as e:
        pytest.skip(str(e))
    payload = serve.main(["--smoke", "--device", "cuda", "--scenario", serve.NOT_LIMITED, "--no-online",
                          "--no-transformers", "--profile-window", "0-60"])
    for row in rows_of(payload, serve.OFFLINE):
        profile = row["step_profile"]
        assert "error" not in profile, profile
        assert profile["steps"] > 0 and profile["busy_ms_per_step"] <= profile["ms_per_step"]
        assert profile["kinds_ms_per_step"]["attention"] > 0 and profile["kinds_ms_per_step"]["matmul"] > 0
