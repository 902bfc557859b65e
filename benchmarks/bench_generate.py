"""End-to-end decode through `model.generate` and fp8kv's transformers integration.

Each row is a model, a batch and a context; each column a cache and how `generate` runs it:

  fp8 paged graph     PagedCache, e4m3, compileable: generate compiles the decode step
                      (torch.compile, fullgraph, mode "reduce-overhead": one CUDA graph per step)
  bf16 paged graph    the same with an unquantized (bf16) PagedCache
  fp8 paged eager     PagedCache, e4m3, every kernel launched from Python at every step
  bf16 paged eager    the same, bf16
  SDPA dynamic eager  transformers' default: DynamicCache and SDPA attention
  SDPA static graph   transformers' compiled path: StaticCache and SDPA, compiled by generate

The context is written into each cache directly as random K/V (through the cache's own write
path) instead of being prefilled by the model: a decode step's time does not depend on the cached
values, and an 8B prefill of 256k tokens would dominate the run. `generate` then gets the whole
sequence, runs its one uncached token as the prefill, and decodes greedily. A logits processor
synchronizes the device and reads the clock at every step, so each decode step is timed on its own
(forward, and generate's own work: logits processing, argmax, stopping criteria); the table shows
the median over the steps after the warm-up (compilation, CUDA graph recording).

Targets (PASS/MISS): on the full-size rows, with the graph path, FP8 decode >= 1.3x the tokens/s of
the bf16 paged cache, and without it (eager) FP8 at least as fast as bf16; >= 1.9x the sequences of
8k tokens that fit in GPU memory (computed from the free memory and the bytes per token, then
verified by allocating the cache and decoding); on every row, the bf16 paged cache at least as fast
as transformers' fastest own path.

Weights are random bf16 initialized on the device (no checkpoint, no CPU initialization), except
SmolLM2-135M, the real model of fp8kv.models (skipped with the reason when it is not installed).
`--quick` runs a small geometry; on a machine without CUDA (or `--device cpu`) a tiny one runs as
a smoke test, the compiled columns compiled by inductor without CUDA graphs.

    python benchmarks/bench_generate.py [--quick] [--shapes REGEX] [--columns REGEX] [--host-profile N] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import math
import pathlib
import pstats
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (error_text, fmt, format_table, percentile, release_memory, run_header,  # noqa: E402,I001
                    verdict, write_outputs)

import transformers  # noqa: E402
from transformers import CompileConfig, DynamicCache, LogitsProcessor, LogitsProcessorList, StaticCache  # noqa: E402

from fp8kv.cache import bytes_per_token  # noqa: E402
from fp8kv.formats import KVCacheConfig, KVCacheDtype  # noqa: E402
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable, paged_attention_forward  # noqa: E402

GIB = 1 << 30
BLOCK_SIZE = 16
WARMUP_STEPS = 4  # compilation, CUDA graph warm-up and recording, allocator growth
PROFILED_STEPS = 8  # forward passes (the first an eager one-token prefill) profiled for the busy time
CAPACITY_CONTEXT = 8192
ACTIVATION_RESERVE = 2 * GIB  # left free for a decode step's activations and workspaces when sizing a batch
FP8_SPEEDUP, FP8_CAPACITY = 1.3, 1.9
# Kernels counted as attention in the busy time: fp8kv's paged attention (decode, multi-token, split
# merge) and SDPA's (flash, memory-efficient, cuDNN).
ATTENTION_KERNELS = re.compile(r"decode_kernel|sm80_kernel|sm90a_kernel|merge_splits|flash|fmha|sdpa|attention", re.IGNORECASE)

GEOMETRIES = {  # LlamaConfig arguments
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, vocab_size=32000),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=512),
}
SMOLLM2 = "SmolLM2-135M"


@dataclasses.dataclass(frozen=True)
class Shape:
    model: str  # a GEOMETRIES key, or SMOLLM2
    batch: int
    context: int  # tokens cached when decoding starts

    @property
    def label(self) -> str:
        context = f"{self.context // 1024}k" if self.context % 1024 == 0 else str(self.context)
        return f"{self.model} B{self.batch} x {context}"


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    cache: str  # a KVCacheConfig format for a PagedCache, or "dynamic" / "static" (transformers' own)
    compiled: bool


COLUMNS = (
    Column("fp8 paged graph", "float8_e4m3fn", True),
    Column("bf16 paged graph", "auto", True),
    Column("fp8 paged eager", "float8_e4m3fn", False),
    Column("bf16 paged eager", "auto", False),
    Column("SDPA dynamic eager", "dynamic", False),
    Column("SDPA static graph", "static", True),
)
SHAPES = (Shape("Llama-3-8B", 32, 8192), Shape("Llama-3-8B", 4, 32768), Shape(SMOLLM2, 64, 7680))  # SmolLM2: 8192 positions
QUICK_SHAPES = (Shape("small", 8, 2048),)
CPU_SHAPES = (Shape("tiny", 2, 256),)


# ----------------------------------------------------------------------------- models


def build_model(name: str, device: torch.device):
    """The model of a geometry with random bf16 weights, created on `device` directly, or SmolLM2;
    switched to fp8kv attention. Raises with the reason when it cannot be had."""
    if name == SMOLLM2:
        from fp8kv.models import smollm2_checkpoint  # raises MissingDependencyError when not installed

        model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_checkpoint(), dtype=torch.bfloat16)
        return enable(model.to(device).eval())
    config = transformers.LlamaConfig(**GEOMETRIES[name], max_position_embeddings=131072)
    with torch.device(device):
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return enable(model.eval())


def attention_geometry(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head size)."""
    config = model.config
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_size


def cache_bytes_per_token(model, column: Column) -> int:
    """Cache bytes one token takes: K and V of every layer, in the column's storage dtype."""
    layers, _, kv_heads, head_size = attention_geometry(model)
    kv_format = "auto" if column.cache in ("dynamic", "static") else column.cache  # transformers': the model's
    return bytes_per_token(layers, kv_heads, head_size, KVCacheDtype.parse(kv_format).torch_dtype(torch.bfloat16))


# ----------------------------------------------------------------------------- caches


def new_cache(model, column: Column, batch: int, max_len: int):
    """An empty cache for `batch` sequences of up to `max_len` tokens."""
    if column.cache == "dynamic":
        return DynamicCache(config=model.config)
    if column.cache == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    per_sequence = math.ceil(max_len / BLOCK_SIZE) * BLOCK_SIZE
    config = KVCacheConfig.unit_scales(column.cache, model.config.num_hidden_layers)
    return PagedCache(config, max_tokens=batch * per_sequence, block_size=BLOCK_SIZE, compileable=column.compiled)


def use_attention(model, column: Column) -> None:
    if column.cache in ("dynamic", "static"):
        model.set_attn_implementation("sdpa")
    else:
        enable(model)


def write_context(model, cache, batch: int, tokens: int, generator: torch.Generator) -> None:
    """Writes `tokens` random K/V per sequence into every layer of `cache`, through its own write
    path: `update` for transformers' caches; for a PagedCache, `update` and fp8kv's attention
    function over random queries (it writes the K/V, quantized, and attends causally over them)."""
    layers, heads, kv_heads, head_size = attention_geometry(model)
    device = next(model.parameters()).device

    def normal(num_heads):
        return torch.randn(batch, num_heads, tokens, head_size, generator=generator, device=device,
                           dtype=torch.bfloat16)

    for index, layer in enumerate(model.model.layers):
        key, value = cache.update(normal(kv_heads), normal(kv_heads), index)
        if isinstance(cache, PagedCache):
            attention = layer.self_attn
            paged_attention_forward(attention, normal(heads), key, value, None, scaling=attention.scaling)
        del key, value


# ----------------------------------------------------------------------------- timing


class StepClock(LogitsProcessor):
    """Called by generate once per step, after the forward: synchronizes the device and reads the
    clock. The differences between consecutive calls are the decode steps' times."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores

    def step_seconds(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.times, self.times[1:])]


class HostProfile(LogitsProcessor):
    """Profiles the host with cProfile from generate's first logits processing (after the first,
    prefill forward) to the end of generate: every decode step after the first, whole. cProfile
    slows Python-heavy code, so the milliseconds are relative, not the step's real host time."""

    def __init__(self):
        self.profiler, self.calls = cProfile.Profile(), 0

    def __call__(self, input_ids, scores):
        if self.calls == 0:
            self.profiler.enable()
        self.calls += 1
        return scores

    def top(self, count: int, steps: int) -> list[dict]:
        """The `count` functions with the most cumulative time over the `steps` profiled steps, in ms
        per step, with their own time (outside the functions they call)."""
        if self.calls != steps + 1:
            raise RuntimeError(f"host profile: generate processed logits {self.calls} times, expected {steps + 1}")
        ranked = sorted(((cumulative, own, f"{pathlib.Path(file).name}:{line}({name})")
                         for (file, line, name), (_, _, own, cumulative, _) in pstats.Stats(self.profiler).stats.items()),
                        reverse=True)
        return [{"function": where, "ms_per_step": 1e3 * cumulative / steps, "own_ms_per_step": 1e3 * own / steps}
                for cumulative, own, where in ranked[:count]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_arguments(column: Column, device: torch.device) -> dict:
    """generate's arguments: eager, or compiled with generate's defaults (inductor, mode
    "reduce-overhead"); fullgraph for fp8kv, whose decode step has no graph break. On the CPU:
    inductor without a mode (no CUDA graphs), which generate compiles only when asked."""
    if not column.compiled:
        return dict(disable_compile=True)
    config = CompileConfig(fullgraph=column.cache not in ("dynamic", "static"))
    if device.type != "cuda":
        config.mode = None
        config._compile_all_devices = True
    return dict(compile_config=config)


def decode(model, cache, column: Column, batch: int, context: int, steps: int, device: torch.device,
           processor: LogitsProcessor | None = None) -> None:
    """Greedy generate of `steps` tokens after a context of `context` tokens, `context - 1` of
    them already in `cache`; `processor` (a StepClock or HostProfile) sees every step."""
    generator = torch.Generator(device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=generator, device=device)
    processors = LogitsProcessorList([processor] if processor is not None else [])
    with torch.no_grad():
        model.generate(ids, **cache_argument(model, cache), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       pad_token_id=0, logits_processor=processors, **compile_arguments(column, device))


def measure_column(model, shape: Shape, column: Column, steps: int, device: torch.device, host_top: int = 0) -> dict:
    """Per-step decode time (median over `steps` steps after the warm-up), tokens/s, the peak
    memory of the decode and the cache's size; on CUDA the busy time; with host_top, the host
    functions with the most time per step; {"error": ...} when it does not run."""
    info: dict = {}
    cache = None
    try:
        use_attention(model, column)
        total = WARMUP_STEPS + steps
        profiled = PROFILED_STEPS * ((device.type == "cuda") + (host_top > 0))  # steps after the timed ones
        cache = new_cache(model, column, shape.batch, shape.context + total + profiled + 1)
        with torch.no_grad():
            write_context(model, cache, shape.batch, shape.context - 1, torch.Generator(device).manual_seed(0))
        reset_peak_memory(device)
        clock = StepClock(device)
        counters_before = compile_counters()
        decode(model, cache, column, shape.batch, shape.context, total, device, clock)
        seconds = sorted(clock.step_seconds()[WARMUP_STEPS - 1:])
        median = statistics.median(seconds)
        info.update(step_ms=1e3 * median, p10_ms=1e3 * percentile(seconds, 0.1), p90_ms=1e3 * percentile(seconds, 0.9),
                    steps=len(seconds), tokens_per_s=shape.batch / median, peak_gib=peak_gib(device),
                    cache_gib=cache_bytes(cache) / GIB)
        if column.compiled:
            info.update({name: after - counters_before[name] for name, after in compile_counters().items()})
        context = shape.context + total
        if device.type == "cuda":
            info["gpu_ms"], info["attention_ms"] = busy_ms_per_step(model, cache, column, shape.batch, context, device)
            context += PROFILED_STEPS
        if host_top:
            profile = HostProfile()
            try:
                decode(model, cache, column, shape.batch, context, PROFILED_STEPS, device, profile)
            finally:
                profile.profiler.disable()
            info["host_profile"] = profile.top(host_top, PROFILED_STEPS - 1)  # the first step is the prefill
    except Exception as exc:  # recorded in the table and the JSON; the other columns still run
        info["error"] = error_text(exc)
    finally:
        del cache
        reset_compiled()
    return info


def busy_ms_per_step(model, cache, column: Column, batch: int, context: int,
                     device: torch.device) -> tuple[float, float]:
    """The device's busy time per forward pass, in all and in attention kernels: the time covered
    by kernels (overlapping ones counted once: a dependent grid may start before its predecessor
    ends) over PROFILED_STEPS more steps, profiled and so not timed by the clock, divided by the
    steps. Against the step time it shows how much of a step the device waits for the host."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        decode(model, cache, column, batch, context, PROFILED_STEPS, device)
    kernels = [event for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    attention = [event for event in kernels if ATTENTION_KERNELS.search(event.name)]
    return tuple(covered_us((e.time_range.start, e.time_range.end) for e in events) / 1e3 / PROFILED_STEPS
                 for events in (kernels, attention))


def covered_us(spans) -> float:
    """Microseconds covered by (start, end) spans in microseconds (overlaps counted once)."""
    busy_us, covered_until = 0.0, -math.inf
    for start, end in sorted(spans):
        busy_us += max(0.0, end - max(start, covered_until))
        covered_until = max(covered_until, end)
    return busy_us


def compile_counters() -> dict:
    """Graphs compiled and CUDA graphs skipped so far (a compiled column should add 1 and 0)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def cache_bytes(cache) -> int:
    if isinstance(cache, PagedCache):
        return cache.memory_bytes
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if isinstance(t, torch.Tensor))


def reset_compiled() -> None:
    """Drops compiled graphs (and their CUDA graph memory) and frees what the column held."""
    torch._dynamo.reset()
    release_memory()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


# ----------------------------------------------------------------------------- capacity


def max_batch(model, column: Column, steps: int, device: torch.device) -> dict:
    """The most sequences of CAPACITY_CONTEXT tokens whose cache fits: estimated from the free
    memory (less ACTIVATION_RESERVE) and the bytes per token, then verified by allocating the cache
    and decoding two steps eagerly, 3% fewer sequences after each out-of-memory error."""
    release_memory()
    free, _ = torch.cuda.mem_get_info(device)
    per_sequence = math.ceil((CAPACITY_CONTEXT + steps) / BLOCK_SIZE) * BLOCK_SIZE
    per_token = cache_bytes_per_token(model, column)
    estimate = max(0, (free - ACTIVATION_RESERVE) // (per_token * per_sequence))
    info = dict(bytes_per_token=per_token, free_gib=free / GIB, estimate=estimate, verified=None)
    batch = estimate
    eager = dataclasses.replace(column, compiled=False)
    use_attention(model, eager)
    for _ in range(8):
        if batch <= 0:
            break
        cache = None
        try:
            cache = new_cache(model, eager, batch, per_sequence)
            decode(model, cache, eager, batch, 1, 2, device)
            info["verified"] = batch
            break
        except torch.OutOfMemoryError:
            batch = int(batch * 0.97)
        finally:
            del cache
            release_memory()
    return info


# ----------------------------------------------------------------------------- run


def measure_row(model, shape: Shape, columns: list[Column], steps: int, device: torch.device,
                host_top: int = 0) -> dict:
    row = {"label": shape.label, "shape": dataclasses.asdict(shape), "columns": {}}
    for column in columns:
        row["columns"][column.name] = measure_column(model, shape, column, steps, device, host_top)
        print(f"  {shape.label} / {column.name}: {describe(row['columns'][column.name])}", flush=True)
    return row


def describe(column: dict) -> str:
    if "error" in column:
        return column["error"]
    return f"{column['step_ms']:.2f} ms/step, {column['tokens_per_s']:.0f} tok/s"


def ratio(row: dict, numerator: str, denominator: str) -> float | None:
    """tokens/s of one column over another's (None unless both ran)."""
    a, b = (row["columns"].get(name, {}).get("tokens_per_s") for name in (numerator, denominator))
    return a / b if a and b else None


def transformers_best(row: dict) -> str | None:
    timed = [name for name in ("SDPA dynamic eager", "SDPA static graph")
             if "tokens_per_s" in row["columns"].get(name, {})]
    return max(timed, key=lambda name: row["columns"][name]["tokens_per_s"]) if timed else None


def at_least(value: float | None, threshold: float) -> bool | None:
    """None (reported n/a) when the value was not measured."""
    return None if value is None else value >= threshold


def evaluate_targets(rows: list[dict], capacity: dict) -> dict:
    targets = {}
    for shape in SHAPES:
        row = next((r for r in rows if r["label"] == shape.label), None)
        if row is not None:
            speedup = ratio(row, "fp8 paged graph", "bf16 paged graph")
            targets[f"{shape.label}: fp8/bf16 graph >= {FP8_SPEEDUP}x"] = at_least(speedup, FP8_SPEEDUP)
            eager = ratio(row, "fp8 paged eager", "bf16 paged eager")
            targets[f"{shape.label}: fp8/bf16 eager >= 1.0x"] = at_least(eager, 1.0)
    for row in rows:
        best = transformers_best(row)
        versus = ratio(row, "bf16 paged graph", best) if best else None
        targets[f"{row['label']}: bf16 paged graph >= transformers' best"] = at_least(versus, 1.0)
    if capacity:
        fp8, bf16 = (capacity[name].get("verified") for name in ("fp8 paged graph", "bf16 paged graph"))
        targets[f"sequences of {CAPACITY_CONTEXT // 1024}k that fit: fp8/bf16 >= {FP8_CAPACITY}x"] = at_least(
            fp8 / bf16 if fp8 and bf16 else None, FP8_CAPACITY)
    return targets


def results_table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        for name, column in row["columns"].items():
            if "error" in column:
                lines.append([row["label"], name] + ["-"] * 8)
                continue
            lines.append([row["label"], name, fmt(column["step_ms"], 2),
                          f"{fmt(column['p10_ms'], 2)}-{fmt(column['p90_ms'], 2)}", fmt(column.get("gpu_ms"), 2),
                          fmt(column.get("attention_ms"), 2),
                          fmt(column["tokens_per_s"], 0), fmt(ratio(row, name, "bf16 paged graph"), 2),
                          fmt(column["peak_gib"], 1), fmt(column["cache_gib"], 2)])
    return format_table(["shape", "cache", "ms/step", "p10-p90", "GPU busy ms", "attention ms", "tok/s",
                         "vs bf16 graph", "peak GiB", "cache GiB"], lines)


def capacity_table(capacity: dict) -> str:
    lines = [[name, f"{c['bytes_per_token']:,}", fmt(c["free_gib"], 1), c["estimate"], c["verified"] or "-"]
             for name, c in capacity.items() if "error" not in c]
    return format_table(["cache", "bytes/token", "free GiB", "estimated", "verified"], lines)


def host_profile_text(rows: list[dict]) -> str:
    blocks = []
    for row in rows:
        for name, column in row["columns"].items():
            if "host_profile" in column:
                lines = [f"{entry['ms_per_step']:9.3f}  {entry['own_ms_per_step']:9.3f}  {entry['function']}"
                         for entry in column["host_profile"]]
                blocks.append(f"host profile, {row['label']} / {name} (cProfile, ms per decode step: cumulative, "
                              "own):\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def errors_text(rows: list[dict], capacity: dict) -> str:
    lines = [f"  {row['label']} / {name}: {column['error']}" for row in rows
             for name, column in row["columns"].items() if "error" in column]
    lines += [f"  capacity / {name}: {c['error']}" for name, c in capacity.items() if "error" in c]
    return "did not run:\n" + "\n".join(lines) if lines else ""


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"the small geometry only ({QUICK_SHAPES[0].label})")
    parser.add_argument("--shapes", metavar="REGEX", help="only rows whose label matches REGEX")
    parser.add_argument("--columns", metavar="REGEX", help="only columns whose name matches REGEX")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per column, after the warm-up")
    parser.add_argument("--no-capacity", action="store_true", help="skip the largest-batch measurement")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="after each column, profile the host over more decode steps and list its N costliest "
                        "functions (cProfile, cumulative time per step)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write all results as JSON")
    args = parser.parse_args(argv)
    if args.host_profile < 0:
        parser.error(f"argument --host-profile: expected a count >= 0, got {args.host_profile}")
    args.png = None  # common.write_outputs: no plot for this benchmark
    return args


def chosen(items, pattern: str | None, name) -> list:
    picked = [item for item in items if pattern is None or re.search(pattern, name(item))]
    if not picked:
        raise SystemExit(f"{pattern!r} matches none of: {', '.join(name(item) for item in items)}")
    return picked


def main(argv: list[str] | None = None) -> dict:
    args = parse_arguments(argv)
    device = torch.device(args.device)
    shapes = CPU_SHAPES if device.type == "cpu" else QUICK_SHAPES if args.quick else SHAPES
    shapes = chosen(shapes, args.shapes, lambda s: s.label)
    columns = chosen(COLUMNS, args.columns, lambda c: c.name)
    print("context: written into each cache as random K/V (not prefilled by the model); greedy decode; "
          f"{args.steps} steps timed per column after {WARMUP_STEPS} warm-up steps, device synchronized every step")
    rows, capacity, model, model_name, model_error = [], {}, None, None, None
    measure_capacity = device.type == "cuda" and not args.no_capacity
    for index, shape in enumerate(shapes):
        if model_name != shape.model:
            model, model_name, model_error = None, shape.model, None  # one model on the device at a time
            release_memory()
            try:
                model = build_model(shape.model, device)
            except Exception as exc:  # e.g. SmolLM2 not installed: its rows say why
                model_error = f"model unavailable: {error_text(exc)}"
        if model is None:
            rows.append({"label": shape.label, "shape": dataclasses.asdict(shape),
                         "columns": {column.name: {"error": model_error} for column in columns}})
            print(f"{shape.label}: {model_error}", flush=True)
            continue
        rows.append(measure_row(model, shape, columns, args.steps, device, args.host_profile))
        last_of_model = index + 1 == len(shapes) or shapes[index + 1].model != shape.model
        if measure_capacity and last_of_model:  # the first model's largest batches, while it is loaded
            measure_capacity = False
            for column in (COLUMNS[0], COLUMNS[1], COLUMNS[5]):
                try:
                    capacity[column.name] = max_batch(model, column, args.steps + WARMUP_STEPS, device)
                except Exception as exc:
                    capacity[column.name] = {"error": error_text(exc)}
                capacity[column.name]["model"] = shape.model
    model = None
    release_memory()
    targets = evaluate_targets(rows, capacity)
    print(results_table(rows))
    if capacity:
        model_name = next(iter(capacity.values()))["model"]
        print(f"\nsequences of {CAPACITY_CONTEXT} tokens whose cache fits ({model_name}):")
        print(capacity_table(capacity))
    print("\ntargets:")
    for name, ok in targets.items():
        print(f"  {verdict(ok):4}  {name}")
    if args.host_profile:
        print("\n" + host_profile_text(rows))
    print(errors_text(rows, capacity))
    header = run_header("generate", device) if device.type == "cuda" else {
        "benchmark": "generate", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": {"name": "cpu", "torch": torch.__version__}}
    payload = header | {"transformers": transformers.__version__, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                        "context": "random K/V written into the cache", "rows": rows, "capacity": capacity,
                        "targets": {name: verdict(ok) for name, ok in targets.items()}}
    write_outputs(payload, args)
    return payload


if __name__ == "__main__":
    main()
