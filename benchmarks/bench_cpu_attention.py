"""CPU paged attention: fp8kv's CPU kernel against torch's scaled_dot_product_attention, same shapes.

fp8kv takes bf16 queries (its op takes fp16 / bf16 ones) over an e4m3 cache and over an unquantized
bf16 cache; SDPA runs in fp32 and in bf16 over the same K/V, dequantized, contiguous, in its faster
form (K/V as cached with enable_gqa, or expanded to the query heads), with torch's own choice of
backend. Shapes: SmolLM2-135M's and Llama-3-8B's attention layers, decode and prefill (causal).
Time: wall clock of each call on --threads threads (2 unless told), median of several runs after two
warm-up calls. Other processes may share the CPU: the load average before and after the run is
printed with the table. Correctness before timing: every column's output against float32 attention
on the exact dequantized values (relative error, limit 1e-2).

Target: each fp8kv column <= 2x SDPA's time, in fp32 and in bf16.

    python benchmarks/bench_cpu_attention.py [--quick] [--shapes REGEX] [--threads N] [--json PATH]

--quick: the same four layouts (each model's decode and prefill) with shorter contexts, timed over a
shorter budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import time
from typing import Callable

import torch

import attention_cases as cases
import common

CPU = torch.device("cpu")
BLOCK_SIZE = 16
MAX_RATIO = 2.0
MAX_REL_ERR = 1e-2
WARMUP, MIN_REPS, MAX_REPS = 2, 5, 30  # per column: repetitions until its budget is spent
BUDGET_S, QUICK_BUDGET_S = 1.0, 0.2
SDPA = {"SDPA fp32": torch.float32, "SDPA bf16": torch.bfloat16}
FP8KV = ("fp8kv bf16", "fp8kv e4m3")  # the cache each fp8kv column reads (bf16 queries)
TARGET_NAMES = {(f, s): f"{f.split()[1]}<={MAX_RATIO:g}x{s.split()[1]}" for f in FP8KV for s in SDPA}


@dataclasses.dataclass(frozen=True)
class CpuShape:
    model: cases.Model
    batch: int
    context: int  # cached tokens per sequence, the queried ones included
    q_len: int  # query tokens per sequence: 1 is decode, context is a whole prompt's prefill

    @property
    def label(self) -> str:
        if self.q_len == 1:
            return f"{self.model.name} decode B{self.batch} x {cases.tokens_text(self.context)}"
        batch = f" B{self.batch}" if self.batch > 1 else ""
        return f"{self.model.name} prefill {cases.tokens_text(self.q_len)}{batch}"


def default_shapes() -> list[CpuShape]:
    smol, llama = cases.SMOLLM2_135M, cases.LLAMA3_8B
    return [CpuShape(smol, 8, 2048, 1), CpuShape(smol, 1, 512, 512), CpuShape(smol, 1, 2048, 2048),
            CpuShape(llama, 4, 4096, 1), CpuShape(llama, 1, 512, 512)]


def quick_shapes() -> list[CpuShape]:
    smol, llama = cases.SMOLLM2_135M, cases.LLAMA3_8B
    return [CpuShape(smol, 4, 1024, 1), CpuShape(smol, 1, 256, 256), CpuShape(llama, 1, 1024, 1),
            CpuShape(llama, 1, 256, 256)]


def time_call(fn: Callable[[], object], budget_s: float = BUDGET_S) -> common.Timing:
    """Wall-clock times of fn() in microseconds: WARMUP calls, then MIN_REPS to MAX_REPS timed ones
    (as many as budget_s allows)."""
    for _ in range(WARMUP):
        fn()
    times_us: list[float] = []
    start = time.perf_counter()
    while len(times_us) < MAX_REPS and (len(times_us) < MIN_REPS or time.perf_counter() - start < budget_s):
        begin = time.perf_counter()
        fn()
        times_us.append((time.perf_counter() - begin) * 1e6)
    return common.summarize(times_us)


def measure_column(build: Callable[[], Callable[[], torch.Tensor]], check: Callable[[torch.Tensor], dict],
                   timer: Callable[[Callable[[], object]], common.Timing]) -> dict:
    """Builds a column, checks its output, times it; a column that cannot run records why."""
    try:
        run = build()
        return check(run()) | timer(run).as_dict()
    except Exception as exc:  # reported under the table and in the JSON, never fatal
        return {"error": common.error_text(exc)}


def sdpa_column(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, check, timer) -> dict:
    """SDPA in its faster form: K/V [B, Hkv, L, D] as they are (enable_gqa) or expanded to the query heads."""
    forms = {"enable_gqa": (key, value), "expanded": (cases.expand_heads(key, query.shape[1]),
                                                      cases.expand_heads(value, query.shape[1]))}
    timed = {form: measure_column(lambda k=k, v=v: lambda: cases.sdpa(query, k, v, scale, "default"), check, timer)
             for form, (k, v) in forms.items()}
    best = common.fastest(timed, timed, lambda column: column.get("median_us"))
    return timed[best] | {"form": best} if best else timed["enable_gqa"]


def measure_shape(shape: CpuShape, ops, ops_reason: str, seed: int,
                  timer: Callable[[Callable[[], object]], common.Timing] = time_call) -> dict:
    model, batch, q_len = shape.model, shape.batch, shape.q_len
    gen = torch.Generator().manual_seed(seed)
    cache = cases.make_paged_cache(batch, shape.context, model.num_kv_heads, model.head_size, BLOCK_SIZE, gen, CPU)
    query = cases.random_query(batch * q_len, model.num_heads, model.head_size, gen, CPU)
    cu_seqlens_q = None if q_len == 1 else torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    scale = model.head_size**-0.5
    key, value = (cases.gather_dequantize(c, cache.block_tables, shape.context, s, torch.float32).contiguous()
                  for c, s in ((cache.key_nhd, cache.k_scale), (cache.value_nhd, cache.v_scale)))
    by_sequence = query.view(batch, q_len, model.num_heads, model.head_size).transpose(1, 2)  # [B, Hq, Lq, D]
    reference = cases.reference_attention(by_sequence, key, value, scale)
    columns = {name: sdpa_column(by_sequence.to(dtype), key.to(dtype), value.to(dtype), scale,
                                 common.rel_err_check(reference), timer) for name, dtype in SDPA.items()}
    unquantized = (cases.bf16_paged_cache(cache.key_nhd, cases.K_SCALE),
                   cases.bf16_paged_cache(cache.value_nhd, cases.V_SCALE), torch.ones(1), torch.ones(1))
    caches = {"fp8kv bf16": unquantized, "fp8kv e4m3": (cache.key_nhd, cache.value_nhd, cache.k_scale, cache.v_scale)}
    as_reference = common.rel_err_check(reference, lambda out: out.view(batch, q_len, *out.shape[1:]).transpose(1, 2))
    for name, (key_cache, value_cache, k_scale, v_scale) in caches.items():
        def build(key_cache=key_cache, value_cache=value_cache, k_scale=k_scale, v_scale=v_scale):
            if ops is None:
                raise RuntimeError(ops_reason)
            out = torch.empty_like(query)

            def run():
                ops.paged_attention(out, query, key_cache, value_cache, cache.block_tables, cache.seq_lens,
                                    cu_seqlens_q, scale, k_scale, v_scale)
                return out
            return run
        columns[name] = measure_column(build, as_reference, timer)
    return {"label": shape.label, "columns": columns, "targets": targets(columns)}


def targets(columns: dict) -> dict[str, bool | None]:
    """Each fp8kv column <= MAX_RATIO x each SDPA column's time; every column's error <= MAX_REL_ERR."""
    time_of = {name: columns.get(name, {}).get("median_us") for name in (*FP8KV, *SDPA)}
    verdicts = {TARGET_NAMES[f, s]: common.judge(lambda f=f, s=s: time_of[f] <= MAX_RATIO * time_of[s],
                                                 time_of[f], time_of[s])
                for f in FP8KV for s in SDPA}
    errors = [columns.get(name, {}).get("rel_err") for name in (*FP8KV, *SDPA)]
    worst = None if None in errors else max(errors)
    return verdicts | {f"err<={MAX_REL_ERR:g}": common.judge(lambda: worst <= MAX_REL_ERR, worst)}


def table(rows: list[dict]) -> str:
    headers = ["shape", *(f"{name} ms" for name in (*SDPA, *FP8KV)),
               *(f"{f.split()[1]}/{s.split()[1]}" for f in FP8KV for s in SDPA), "max err", "targets"]
    lines = []
    for row in rows:
        columns = row["columns"]
        ms = {name: columns.get(name, {}).get("median_us") for name in (*SDPA, *FP8KV)}
        ratios = [None if None in (ms[f], ms[s]) else ms[f] / ms[s] for f in FP8KV for s in SDPA]
        errors = [c["rel_err"] for c in columns.values() if "rel_err" in c]
        lines.append([row["label"], *(common.fmt(None if t is None else t / 1e3, 2) for t in ms.values()),
                      *(common.fmt(r, 2) for r in ratios), common.fmt_err(max(errors) if errors else None),
                      common.targets_text(row["targets"])])
    return common.format_table(headers, lines)


def verdict_line(rows: list[dict]) -> str:
    """One line: PASS when every target of every shape passed, else MISS (or n/a) with the ones that did not."""
    verdicts = {f"{row['label']} {name}": ok for row in rows for name, ok in row["targets"].items()}
    failed = [f"{name}:{common.verdict(ok)}" for name, ok in verdicts.items() if ok is not True]
    if not failed:
        return f"targets: PASS (all {len(verdicts)})"
    return f"targets: {'MISS' if False in verdicts.values() else 'n/a'} ({len(failed)} of {len(verdicts)}: " \
        f"{', '.join(failed)})"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter contexts and timing budget")
    parser.add_argument("--shapes", metavar="REGEX", help="only shapes whose label matches REGEX")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads (default 2)")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write all results as JSON")
    args = parser.parse_args(argv)
    shapes = common.select_shapes(quick_shapes() if args.quick else default_shapes(), args.shapes)
    budget_s = QUICK_BUDGET_S if args.quick else BUDGET_S
    torch.set_num_threads(args.threads)
    ops, ops_reason = common.load_fp8kv(require_cuda=False)
    load_before = common.load_average()
    print(f"fp8kv: {ops_reason}")
    print(f"CPU: {common.cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__} on "
          f"{torch.get_num_threads()} threads ({torch.backends.cpu.get_cpu_capability()}); load average before: "
          f"{load_before}")
    rows = []
    for index, shape in enumerate(shapes):
        rows.append(measure_shape(shape, ops, ops_reason, seed=index, timer=lambda fn: time_call(fn, budget_s)))
        print(f"[{index + 1}/{len(shapes)}] {shape.label}", flush=True)
    load_after = common.load_average()
    print(table(rows))
    print(f"load average (1, 5, 15 min) before: {load_before}, after: {load_after}")
    print(verdict_line(rows))
    print(common.errors_text(rows))
    if args.json:
        common.write_json({"benchmark": "cpu_attention", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "cpu": common.cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "fp8kv": ops_reason, "load_average_before": load_before, "load_average_after": load_after,
                           "rows": rows}, args.json)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
