"""Shared benchmark machinery: GPU timing with an L2 flush, CUDA-graph replays, the device's bandwidth
ceilings, tables and output files.

Timing: warm up, then time each repetition with CUDA events around the work alone, evicting L2
before every repetition by reading a buffer several times its size, and report the median. A short
GPU sleep is queued first so that the host enqueues every repetition before the GPU reaches it;
host-side Python (argument checks, FlashInfer's run()) then never shows up as GPU idle time between
the two events. A column is timed twice: as a plain launch, and replayed from a CUDA graph that
captured the same call (the kernel without the launch path's cost).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
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
    """Evicts L2 by reading a buffer of max(4 x L2, 256 MiB).

    A read, not a write: a written buffer leaves up to a whole L2 of dirty lines, whose write-back
    then competes with the timed call for DRAM bandwidth (on an H100 a contiguous read measured 2.87
    TB/s after a memset flush and 3.06 TB/s after a read-only one)."""

    def __init__(self, device: torch.device):
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        self.nbytes = max(4 * l2_bytes, 256 << 20)
        self._buffer = torch.zeros(self.nbytes // 4, dtype=torch.float32, device=device)
        self._sum = torch.empty((), dtype=torch.float32, device=device)

    def __call__(self) -> None:
        torch.sum(self._buffer, dim=0, out=self._sum)


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


def capture_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """A callable that replays fn() from a CUDA graph and returns the output of the captured call
    (the same tensors at every replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    torch.cuda.synchronize()

    def replay():
        graph.replay()
        return output
    return replay


POISON_BYTE = 0x55


def poison_outputs(output: object) -> None:
    """Overwrites the tensors of an output (a tensor, or a tuple or list of them) so that a call which
    does not write them fails the next check: NaN in 16- and 32-bit floats, POISON_BYTE in every
    byte of 8-bit tensors (FP8 caches). An output of None is left to the check to read."""
    tensors = output if isinstance(output, (tuple, list)) else [output]
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        if tensor.element_size() == 1:
            tensor.view(torch.uint8).fill_(POISON_BYTE)
        elif tensor.is_floating_point():
            tensor.fill_(float("nan"))
        else:
            raise TypeError(f"cannot poison a {tensor.dtype} output")


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured memory bandwidth of the device, bytes per second."""

    copy_bytes_per_s: float  # device-to-device copy, bytes read + bytes written
    read_bytes_per_s: float  # a read-only fp32 sum reduction

    def as_dict(self) -> dict:
        return {"copy_tb_s": self.copy_bytes_per_s / TB, "read_tb_s": self.read_bytes_per_s / TB}


def measure_ceilings(device: torch.device, flush: L2Flush, nbytes: int | None = None) -> Ceilings:
    """Copy and read-only bandwidth over BANDWIDTH_PROBE_BYTES, each the faster of its plain launches
    and graph replays (as the columns compared with them)."""
    nbytes = nbytes or BANDWIDTH_PROBE_BYTES
    return Ceilings(2 * nbytes / (copy_us(nbytes, device, flush) * 1e-6),
                    nbytes / (read_us(nbytes, device, flush) * 1e-6))


def copy_us(nbytes: int, device: torch.device, flush: L2Flush) -> float:
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return fastest_us(lambda: target.copy_(source), flush)


def read_us(nbytes: int, device: torch.device, flush: L2Flush) -> float:
    values = torch.rand(nbytes // 4, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    return fastest_us(lambda: torch.sum(values, dim=0, out=total), flush)


def fastest_us(fn: Callable[[], object], flush: L2Flush) -> float:
    column = measure(lambda info: fn, lambda output: {}, flush)
    if best_us(column) is None:
        raise RuntimeError(f"timing failed: {column['error']}")
    return best_us(column)


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


def measure(build: Callable[[dict], Callable[[], object]], check: Callable[[object], dict], flush: L2Flush,
            *, graph: bool = True) -> dict:
    """Builds one column, checks its output, then times it as a plain launch and (graph=True)
    replayed from a CUDA graph.

    build(info) returns the callable to time and may record facts in info (a backend, a setup
    time); check(output of a call) returns correctness facts (an error, mismatch counts). The graph
    is checked too, after its outputs are poisoned (poison_outputs). A column that
    cannot run gets {"error": ...}, a graph that cannot be captured {"graph": {"error": ...}}; the
    caller's other columns still run. Times used for comparisons: best_us()."""
    info: dict = {}
    try:
        run = build(info)
        info.update(check(run()))
        info.update(benchmark(run, flush).as_dict())
    except Exception as exc:  # reported in the table and the JSON, never fatal
        info["error"] = error_text(exc)
        return info
    if graph:
        info["graph"] = measure_graph(run, check, flush)
    return info


def measure_graph(run: Callable[[], object], check: Callable[[object], dict], flush: L2Flush) -> dict:
    try:
        replay = capture_graph(run)
        poison_outputs(replay())  # the outputs the graph writes, poisoned before the checked replay
        return check(replay()) | benchmark(replay, flush).as_dict()
    except Exception as exc:  # e.g. a host synchronization inside the call: not capturable
        return {"error": error_text(exc)}


def graph_us(column: dict) -> float | None:
    """Median time of a column's CUDA-graph replays, None when it was not timed."""
    return column.get("graph", {}).get("median_us")


def best_us(column: dict) -> float | None:
    """The faster of a column's plain-launch and graph-replay medians (None when neither ran)."""
    times = [t for t in (column.get("median_us"), graph_us(column)) if t is not None]
    return min(times) if times else None


def add_rate(column: dict, amount: float, key: str, unit: float) -> None:
    """Adds key = amount / time / unit to each timing of a column (its launch and its graph), e.g.
    bytes -> TB/s with unit=TB."""
    for timing in (column, column.get("graph", {})):
        if "median_us" in timing:
            timing[key] = amount / (timing["median_us"] * 1e-6) / unit


def fastest(columns: dict, names: Iterable[str], time_of: Callable[[dict], float | None] = best_us) -> str | None:
    """The name of the fastest column among names (by time_of), None when none of them ran."""
    timed = [n for n in names if n in columns and time_of(columns[n]) is not None]
    return min(timed, key=lambda n: time_of(columns[n])) if timed else None


def bandwidth_summary(row: dict, name: str, ceiling_tb_s: float, fraction_key: str, baseline: str) -> dict:
    """Column `name`'s launch and graph times, its bandwidth at the graph time (row["bytes"] / time),
    that as a fraction of a measured ceiling, and its graph time relative to a baseline column's best."""
    column = row["columns"][name]
    us = graph_us(column)
    tb_s = row["bytes"] / (us * 1e-6) / TB
    summary = {"fp8kv_launch_us": column["median_us"], "fp8kv_graph_us": us, "fp8kv_tb_s": tb_s,
               fraction_key: tb_s / ceiling_tb_s}
    baseline_us = best_us(row["columns"].get(baseline, {}))
    if baseline_us:
        summary["vs_baseline"] = us / baseline_us
    return summary


def worst_rel_err(column: dict) -> float:
    """The larger relative error of a column's launch and graph outputs (inf when it did not run)."""
    return max(column.get("rel_err", float("inf")), column.get("graph", {}).get("rel_err", 0.0))


def max_rel_err(columns: dict, names: Iterable[str]) -> float:
    """The worst relative error among the named columns present (inf where one did not run)."""
    return max(worst_rel_err(columns[n]) for n in names if n in columns)


def rel_err_check(reference: torch.Tensor, to_reference: Callable[[torch.Tensor], torch.Tensor] = lambda out: out):
    """A check for measure(): relative error of the (reshaped) output against a reference."""
    return lambda out: {"rel_err": relative_error(to_reference(out), reference)}


def error_text(exc: BaseException) -> str:
    """One line naming the exception, for a column that could not run."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}"[:500]


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


def fmt_err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def judge(condition: Callable[[], bool], *values) -> bool | None:
    """condition() when every value it needs was measured, else None (reported as n/a)."""
    return None if any(v is None for v in values) else bool(condition())


def targets_text(targets: dict[str, bool | None]) -> str:
    return " ".join(f"{name}:{verdict(ok)}" for name, ok in targets.items())


ROTATED = "rot+c"  # the rotated + centred recipe, in target names and table headers


# Plot series (label, summary key) that the attention benchmarks share.
FP8KV_SERIES = ["fp8kv e4m3 (faster storage)", "@fp8kv_best"]
ROTATED_SERIES = ["fp8kv e4m3 rotated+centred (faster storage)", "@rotated_best"]
SDPA_SERIES = ["bf16 SDPA (fastest form)", "@sdpa_best"]
FLASHINFER_SERIES = ["FlashInfer FP8 (fastest)", "@flashinfer_best"]


def layout_headers(size: str) -> list[str]:
    """The first headers of a kernel's table (layout_cells): shape, its size, both layouts, the graph,
    the rotated + centred recipe and its ratio to the plain one."""
    return ["shape", size, "NHD us", "HND us", "graph us", f"{ROTATED} us", "xplain"]


def layout_cells(row: dict, size_bytes: int, nhd_column: str, hnd_column: str) -> list[str]:
    """The first cells of a kernel table's row, under layout_headers."""
    cols, s = row["columns"], row["summary"]
    us = lambda name: fmt(cols.get(name, {}).get("median_us"))
    return [row["label"], f"{size_bytes / 1e6:.0f}", us(nhd_column), us(hnd_column), fmt(s.get("fp8kv_graph_us")),
            fmt(s.get("rotated_graph_us")), fmt(s.get("rotated_vs_plain"), 2)]


def rotated_summary(columns: dict, names: Sequence[str], plain_graph_us: float | None) -> dict:
    """The rotated + centred recipe's columns next to the plain recipe's: its faster storage, picked by
    CUDA-graph time (by launch time where no graph ran) as the plain one is, its launch and graph
    times, and its graph time relative to the plain recipe's."""
    best = fastest(columns, names, graph_us) or fastest(columns, names)
    summary = {"rotated_best": best}
    if best is None:
        return summary
    us = graph_us(columns[best])
    summary.update(rotated_launch_us=columns[best]["median_us"], rotated_graph_us=us)
    if us is not None and plain_graph_us:
        summary["rotated_vs_plain"] = us / plain_graph_us
    return summary


def rotated_ratio_target(summary: dict, max_ratio: float) -> dict[str, bool | None]:
    """The rotated + centred recipe's graph time at most max_ratio x the plain recipe's."""
    ratio = summary.get("rotated_vs_plain")
    return {f"{ROTATED}<={max_ratio}xplain": judge(lambda: ratio <= max_ratio, ratio)}


def rotated_attention_summary(columns: dict, names: Sequence[str], plain_graph_us: float | None) -> dict:
    """rotated_summary, and the largest relative error of the recipe's attention columns."""
    summary = rotated_summary(columns, names, plain_graph_us)
    if summary["rotated_best"]:
        summary["max_rotated_rel_err"] = max_rel_err(columns, names)
    return summary


def attention_error_targets(summary: dict, max_rel_err: float, max_rotated_ratio: float) -> dict[str, bool | None]:
    """The attention benchmarks' error targets (named for their 1e-2): the plain columns' and the
    rotated + centred ones' largest relative error, and between them the recipe's time ratio."""
    err, rotated_err = summary.get("max_fp8kv_rel_err"), summary.get("max_rotated_rel_err")
    return {"err<=1e-2": judge(lambda: err <= max_rel_err, err),
            **rotated_ratio_target(summary, max_rotated_ratio),
            f"{ROTATED}_err<=1e-2": judge(lambda: rotated_err <= max_rel_err, rotated_err)}


def errors_text(rows: list[dict]) -> str:
    """Every shape, column or column's graph that did not run, with the reason; empty when all ran."""
    lines = []
    for row in rows:
        if "error" in row:
            lines.append(f"  {row['label']}: {row['error']}")
        for name, column in row["columns"].items():
            if "error" in column:
                lines.append(f"  {row['label']} / {name}: {column['error']}")
            elif "error" in column.get("graph", {}):
                lines.append(f"  {row['label']} / {name} (CUDA graph): {column['graph']['error']}")
    return "columns that did not run:\n" + "\n".join(lines) if lines else ""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def load_average() -> list[float]:
    """The system's load average over 1, 5 and 15 minutes: other processes skew CPU times."""
    return [round(x, 2) for x in os.getloadavg()]


def write_json(payload: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")


def write_outputs(payload: dict, args: argparse.Namespace) -> None:
    """Writes the JSON and the PNG asked for on the command line."""
    if args.json:
        write_json(payload, args.json)
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
    """(torch.ops.fp8kv, description) when usable, else (None, why not): fp8kv's columns then report it.
    The raw operators: the benchmarks time the kernels on caches, scales and recipes they make."""
    try:
        import fp8kv
    except Exception as exc:  # e.g. the library was not built: say so in the columns
        return None, f"import fp8kv failed: {error_text(exc)}"
    if require_cuda and not fp8kv.has_cuda_kernels():
        return None, "fp8kv was built without CUDA kernels (build with FP8KV_CUDA=1)"
    return torch.ops.fp8kv, f"fp8kv {fp8kv.__version__} from {pathlib.Path(fp8kv.__file__).parent}"


@dataclasses.dataclass
class Setup:
    """What every shape of a benchmark run measures with: the device, its flush and measured
    ceilings, fp8kv's ops and FlashInfer (None, with the reason, when not usable)."""

    device: torch.device
    flush: L2Flush
    ceilings: dict
    ops: object
    ops_reason: str
    flashinfer: object = None
    flashinfer_reason: str = "not used by this benchmark"
    kernel: str = "auto"  # the multi-token kernel fp8kv's plans force (--kernel)


def start_run(description: str, shapes: list, quick_shapes: list, *, flashinfer: bool = False,
              kernel_option: bool = False) -> tuple[argparse.Namespace, list, Setup]:
    """Parses the command line, picks the shapes, loads fp8kv (and FlashInfer) and measures the
    device's ceilings; exits when there is no GPU."""
    parser = argparse.ArgumentParser(description=description)
    add_common_arguments(parser)
    if flashinfer:
        parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer's columns out")
    if kernel_option:
        parser.add_argument("--kernel", default="auto", choices=["auto", "sm80", "sm90a", "decode"],
                            help="the multi-token kernel fp8kv's plans force (default: the planner's choice)")
    args = parser.parse_args()
    shapes = select_shapes(quick_shapes if args.quick else shapes, args.shapes)
    device = cuda_device_or_exit()
    ops, ops_reason = load_fp8kv()
    print(f"fp8kv: {ops_reason}")
    fi_module, fi_reason = None, Setup.flashinfer_reason
    if flashinfer:
        import flashinfer_baseline  # benchmarks/ is on sys.path when a script here runs

        fi_module, fi_reason = (None, "disabled by --no-flashinfer") if args.no_flashinfer else flashinfer_baseline.load()
        print(f"FlashInfer: {fi_reason}")
    flush = L2Flush(device)
    ceilings = measure_ceilings(device, flush).as_dict()
    print(f"device: {torch.cuda.get_device_name(device)}; copy {ceilings['copy_tb_s']:.2f} TB/s (read + write), "
          f"read-only sum {ceilings['read_tb_s']:.2f} TB/s")
    return args, shapes, Setup(device, flush, ceilings, ops, ops_reason, fi_module, fi_reason,
                               getattr(args, "kernel", "auto"))


def measure_rows(shapes: list, measure_row: Callable[[object, int], dict]) -> list[dict]:
    """measure_row(shape, index) for every shape, memory released after each, with progress. A shape
    that fails outside its columns (its data did not fit, say) becomes {"label", "error"}; the
    other shapes still run."""
    rows = []
    for index, shape in enumerate(shapes):
        try:
            rows.append(measure_row(shape, index))
            status = ""
        except Exception as exc:  # reported under the table and in the JSON, never fatal
            rows.append({"label": shape.label, "error": error_text(exc), "columns": {}})
            status = f": {rows[-1]['error']}"
        release_memory()
        print(f"[{index + 1}/{len(shapes)}] {shape.label}{status}", flush=True)
    return rows


def finish_run(benchmark_name: str, setup: Setup, rows: list[dict], table: Callable[[list[dict]], str], plot: dict,
               args: argparse.Namespace) -> None:
    """Prints the table of the measured shapes and what did not run, writes the JSON and PNG asked for."""
    print(table([row for row in rows if "error" not in row]))
    print(errors_text(rows))
    payload = run_header(benchmark_name, setup.device) | {
        "ceilings": setup.ceilings, "fp8kv": setup.ops_reason, "flashinfer": setup.flashinfer_reason,
        "rows": rows, "plot": plot}
    write_outputs(payload, args)


def release_memory() -> None:
    """Frees what a finished shape held (reference cycles included) and returns it to the device."""
    gc.collect()
    torch.cuda.empty_cache()


def cuda_device_or_exit() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("these benchmarks need a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())
