"""Shared benchmark machinery: GPU timing with an L2 flush, the device's bandwidth ceilings, output.

Timing follows the device README's method: warm up, then time each repetition with CUDA events
around the work alone, flushing L2 before every repetition by writing a buffer several times its
size, and report the median. A short GPU sleep is queued first so that the host enqueues every
repetition before the GPU reaches it; host-side Python overhead (FlashInfer's run(), argument checks)
then never shows up as GPU idle time between the two events.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import platform
import re
import statistics
import time
from typing import Callable, Iterable, Sequence

import torch

TB = 1e12
MIN_REPS, MAX_REPS = 10, 100
BUDGET_MS = 40.0  # GPU time spent per measured column (reps = budget / one run, within the bounds)
HOST_US_PER_REP = 150.0  # generous host enqueue time of one repetition, sizes the initial GPU sleep
SLEEP_CYCLES_PER_US = 2000  # ~2 GHz SM clock: cycles of torch.cuda._sleep per microsecond
BANDWIDTH_PROBE_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    reps: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class L2Flush:
    """Evicts L2 by writing a buffer of max(4 x L2, 256 MiB)."""

    def __init__(self, device: torch.device):
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        self.nbytes = max(4 * l2_bytes, 256 << 20)
        self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def __call__(self) -> None:
        self._buffer.fill_(0x5A)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of an ascending sequence, q in [0, 1]."""
    position = q * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(times_us: Sequence[float]) -> Timing:
    ordered = sorted(times_us)
    return Timing(statistics.median(ordered), percentile(ordered, 0.1), percentile(ordered, 0.9), len(ordered))


def reps_for(one_run_us: float, budget_ms: float = BUDGET_MS) -> int:
    return int(min(MAX_REPS, max(MIN_REPS, budget_ms * 1e3 / max(one_run_us, 1e-3))))


def _timed_runs(fn: Callable[[], object], flush: L2Flush, reps: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(int(reps * HOST_US_PER_REP * SLEEP_CYCLES_PER_US))
    for start, end in zip(starts, ends):
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in zip(starts, ends)]


def benchmark(fn: Callable[[], object], flush: L2Flush, *, warmup: int = 3, reps: int | None = None) -> Timing:
    """Median GPU time of fn() in microseconds, L2 flushed before each run."""
    for _ in range(warmup):
        flush()
        fn()
    torch.cuda.synchronize()
    if reps is None:
        reps = reps_for(statistics.median(_timed_runs(fn, flush, 3)))
    return summarize(_timed_runs(fn, flush, reps))


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured memory bandwidth of the device, bytes per second."""

    copy_bytes_per_s: float  # device-to-device copy, bytes read + bytes written
    read_bytes_per_s: float  # a read-only fp32 sum reduction

    def as_dict(self) -> dict:
        return {"copy_tb_s": self.copy_bytes_per_s / TB, "read_tb_s": self.read_bytes_per_s / TB}


def measure_ceilings(device: torch.device, flush: L2Flush, nbytes: int = BANDWIDTH_PROBE_BYTES) -> Ceilings:
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy = benchmark(lambda: target.copy_(source), flush)
    del source, target
    values = torch.rand(nbytes // 4, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    read = benchmark(lambda: torch.sum(values, dim=0, out=total), flush)
    return Ceilings(2 * nbytes / (copy.median_us * 1e-6), nbytes / (read.median_us * 1e-6))


def device_info(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
    }


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere in out gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not bool(torch.isfinite(out64).all()):
        return math.inf
    return float(torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64))


def measure(build: Callable[[dict], Callable[[], object]], check: Callable[[object], dict], flush: L2Flush) -> dict:
    """Builds one column, checks its output once, then times it.

    build(info) returns the callable to time and may record facts in info (a backend, a setup
    time); check(output of the first call) returns correctness facts (an error, mismatch counts).
    A column that cannot run gets {"error": ...}; the caller's other columns still run."""
    info: dict = {}
    try:
        run = build(info)
        info.update(check(run()))
        info.update(benchmark(run, flush).as_dict())
    except Exception as exc:  # reported in the table and the JSON, never fatal
        info["error"] = error_text(exc)
    return info


def rel_err_check(reference: torch.Tensor, to_reference: Callable[[torch.Tensor], torch.Tensor] = lambda out: out):
    """A check for measure(): relative error of the (reshaped) output against a reference."""
    return lambda out: {"rel_err": relative_error(to_reference(out), reference)}


def error_text(exc: BaseException) -> str:
    """One line naming the exception, for a column that could not run."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"[:300]


def select_shapes(shapes: Iterable, pattern: str | None) -> list:
    """Shapes whose label matches the regular expression (all when pattern is None)."""
    shapes = list(shapes)
    if pattern is None:
        return shapes
    regex = re.compile(pattern)
    chosen = [s for s in shapes if regex.search(s.label)]
    if not chosen:
        labels = ", ".join(s.label for s in shapes)
        raise SystemExit(f"--shapes {pattern!r} matches none of: {labels}")
    return chosen


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--shapes", metavar="REGEX", help="only shapes whose label matches REGEX")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write all results as JSON")
    parser.add_argument("--png", type=pathlib.Path, metavar="PATH", help="write a plot of the results")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width table; numbers are expected already formatted as strings."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def write_outputs(payload: dict, args: argparse.Namespace) -> None:
    """Writes the JSON and the PNG asked for on the command line."""
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")
        print(f"wrote {args.json}")
    if args.png:
        from plot import plot_results  # benchmarks/ is on sys.path when a script here runs

        args.png.parent.mkdir(parents=True, exist_ok=True)
        plot_results(payload, args.png)
        print(f"wrote {args.png}")


def run_header(benchmark_name: str, device: torch.device) -> dict:
    """The part of every JSON that says what ran where and when."""
    return {
        "benchmark": benchmark_name,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": device_info(device),
    }


def load_fp8kv(require_cuda: bool = True):
    """(fp8kv.ops, description) when usable, else (None, why not): fp8kv's columns then report it."""
    try:
        import fp8kv
    except Exception as exc:  # e.g. the library was not built: say so in the columns
        return None, f"import fp8kv failed: {error_text(exc)}"
    if require_cuda and not fp8kv.has_cuda_kernels():
        return None, "fp8kv was built without CUDA kernels (build with FP8KV_CUDA=1)"
    return fp8kv.ops, f"fp8kv {fp8kv.__version__} from {pathlib.Path(fp8kv.__file__).parent}"


def cuda_device_or_exit() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("these benchmarks need a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())
