"""Host cost of one eager layer call, and a whole model's eager decode step against bf16.

- host: the host's microseconds to issue one call. On a GPU the calls queue behind a GPU sleep, so
  the kernels' time does not enter (it is the time a host-bound eager step spends per call); on the
  CPU the call does its work, so a tiny shape (one sequence, 16 cached tokens) is timed. fp8kv's
  write and attention through a KVCacheLayer (fp8kv.ops), the raw operator, the attention with a
  plan made once per step, the plan itself, and bf16 SDPA on the same tiny decode.
- step (GPU): one decode token of a 32-layer Llama-3-8B geometry (32 query heads, 8 KV heads, head
  size 128): per layer the new token's K/V written, then attention over the cache. Eager (every op
  issued from Python) and replayed from a CUDA graph (the GPU's own time); kernels and memsets per
  layer counted by the profiler. fp8kv's FP8 cache (the rotated recipe, the default), fp8kv's bf16
  cache, and bf16 SDPA over a static cache in its fastest backend (the others are listed too).

    python benchmarks/bench_layer_call.py [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fp8kv  # noqa: E402
from attention_cases import SDPA_BACKENDS  # noqa: E402
from common import device_info  # noqa: E402
from torch.nn.attention import sdpa_kernel  # noqa: E402

HOST_CALLS = 200  # calls per host timing (the GPU's launch queue holds them all behind the sleep)
HOST_REPEATS = 9  # host timings per path; the median is reported
STEP_REPEATS = 20
LAYERS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 32, 8, 128, 16
STEP_SHAPES = {"B4 x 32k": (4, 32768), "B32 x 8k": (32, 8192), "B64 x 1k": (64, 1024)}
QUICK_SHAPES = ("B64 x 1k",)
SDPA_CANDIDATES = ("flash", "efficient", "cudnn", "default")


class DecodeLayers:
    """fp8kv paged caches of `layers` layers holding `seq_len` tokens per sequence, and one decode
    token's inputs: the new K/V, their slots, the query and the output."""

    def __init__(self, kv_cache: str, batch: int, seq_len: int, layers: int, heads: int, kv_heads: int,
                 head_size: int, device: torch.device):
        blocks = (seq_len + BLOCK_SIZE) // BLOCK_SIZE  # room for the new token
        self.cache = fp8kv.PagedKVCache(kv_cache, num_kv_heads=kv_heads, head_size=head_size, num_layers=layers,
                                        num_blocks=batch * blocks, block_size=BLOCK_SIZE, device=device)
        self.layers = [self.cache.layer(i) for i in range(layers)]
        for layer in self.layers:  # values of a plausible size (the kernels' speed does not depend on them)
            for cache in (layer.key_cache, layer.value_cache):
                cache.copy_((torch.rand(cache.shape, device=device) - 0.5).to(cache.dtype))
        self.block_tables = torch.arange(batch * blocks, dtype=torch.int32, device=device).view(batch, blocks)
        self.seq_lens = torch.full((batch,), seq_len + 1, dtype=torch.int32, device=device)
        self.slots = (self.block_tables[:, seq_len // BLOCK_SIZE].long() * BLOCK_SIZE + seq_len % BLOCK_SIZE)
        self.key, self.value = torch.randn(2, batch, kv_heads, head_size, dtype=torch.bfloat16, device=device)
        self.query = torch.randn(batch, heads, head_size, dtype=torch.bfloat16, device=device)
        self.out = torch.empty_like(self.query)
        self.scale = head_size ** -0.5
        self.plan = None

    def make_plan(self) -> None:
        """Planned mode: each step makes its plan once, for all its layers."""
        self.plan = fp8kv.ops.plan_paged_attention(self.layers[0], self.block_tables, None, *self.query.shape[:2])

    def layer_call(self, layer) -> None:
        fp8kv.ops.reshape_and_cache(self.key, self.value, layer, self.slots)
        if self.plan is None:
            fp8kv.ops.paged_attention(self.out, self.query, layer, self.block_tables, self.seq_lens, None, self.scale)
        else:
            fp8kv.ops.paged_attention(self.out, self.query, layer, self.block_tables, self.seq_lens, None, self.scale,
                                      plan=self.plan)

    def raw_attention(self, layer) -> None:
        torch.ops.fp8kv.paged_attention(self.out, self.query, layer.key_cache, layer.value_cache, self.block_tables,
                                        self.seq_lens, None, self.scale, layer.k_scale, layer.v_scale, -1, 0.0,
                                        layer.hadamard, layer.k_offset, False, None)

    def step(self) -> None:
        if self.plan is not None:
            self.make_plan()  # once per step, as an engine does
        for layer in self.layers:
            self.layer_call(layer)


class SdpaLayers:
    """A bf16 static cache per layer, [B, Hkv, max_len, D], as transformers' eager path keeps it: the
    new token's K/V copied in, then SDPA over the filled length."""

    def __init__(self, backend: str, batch: int, seq_len: int, layers: int, heads: int, kv_heads: int,
                 head_size: int, device: torch.device):
        self.backend = backend
        self.caches = [torch.rand(2, batch, kv_heads, seq_len + 1, head_size, device=device).to(torch.bfloat16) - 0.5
                       for _ in range(layers)]
        self.position = torch.tensor([seq_len], device=device)
        self.new = torch.randn(2, batch, kv_heads, 1, head_size, dtype=torch.bfloat16, device=device)
        self.query = torch.randn(batch, heads, 1, head_size, dtype=torch.bfloat16, device=device)
        self.scale = head_size ** -0.5

    def layer_call(self, cache: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(3, self.position, self.new)
        return F.scaled_dot_product_attention(self.query, cache[0], cache[1], scale=self.scale, enable_gqa=True)

    def step(self) -> None:
        chosen = sdpa_kernel([SDPA_BACKENDS[self.backend]]) if SDPA_BACKENDS[self.backend] else None
        if chosen is None:
            for cache in self.caches:
                self.layer_call(cache)
        else:
            with chosen:
                for cache in self.caches:
                    self.layer_call(cache)


def host_us(call, device: torch.device) -> float:
    """Median host microseconds per call (module docstring)."""
    for _ in range(5):
        call()
    samples = []
    for _ in range(HOST_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(int(HOST_CALLS * 300 * 2000))  # ~300 us per call: longer than the host's issue
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            call()
        samples.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return statistics.median(samples)


def host_rows(device: torch.device) -> list[dict]:
    # A tiny decode (one sequence, 16 cached tokens) in SmolLM2's layout: the kernels' work is negligible.
    layers = DecodeLayers("fp8", 1, 16, 1, 9, 3, 64, device)
    layer = layers.layers[0]
    plan = fp8kv.ops.plan_paged_attention(layer, layers.block_tables, None, *layers.query.shape[:2])
    sdpa = SdpaLayers("default", 1, 16, 1, 9, 3, 64, device)
    rows = [
        ("fp8kv.ops.reshape_and_cache (layer)",
         lambda: fp8kv.ops.reshape_and_cache(layers.key, layers.value, layer, layers.slots)),
        ("fp8kv.ops.paged_attention (layer)",
         lambda: fp8kv.ops.paged_attention(layers.out, layers.query, layer, layers.block_tables, layers.seq_lens,
                                           None, layers.scale)),
        ("torch.ops.fp8kv.paged_attention (raw)", lambda: layers.raw_attention(layer)),
        ("fp8kv.ops.paged_attention (layer, plan)",
         lambda: fp8kv.ops.paged_attention(layers.out, layers.query, layer, layers.block_tables, layers.seq_lens,
                                           None, layers.scale, plan=plan)),
        ("fp8kv.ops.plan_paged_attention (once per step)",
         lambda: fp8kv.ops.plan_paged_attention(layer, layers.block_tables, None, *layers.query.shape[:2])),
        ("bf16 SDPA decode (F.scaled_dot_product_attention)",
         lambda: F.scaled_dot_product_attention(sdpa.query, sdpa.caches[0][0], sdpa.caches[0][1], scale=sdpa.scale,
                                                enable_gqa=True)),
    ]
    return [{"call": name, "host_us": host_us(call, device)} for name, call in rows]


def step_ms(step) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(STEP_REPEATS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(STEP_REPEATS)]
    for start, end in zip(starts, ends):
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def graph_ms(step) -> float | None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as exc:
        print(f"  (no graph: {str(exc).splitlines()[0][:120]})", flush=True)
        return None
    return step_ms(graph.replay)


def launches_per_layer(step, layers: int) -> float:
    """Kernels and memsets one step runs on the GPU, per layer (the profiler's device events)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(device_events) / layers


def step_rows(shapes, device: torch.device) -> list[dict]:
    rows = []
    for label in shapes:
        batch, seq_len = STEP_SHAPES[label]
        subjects = [(f"fp8kv {kv} cache", lambda kv=kv: DecodeLayers(kv, batch, seq_len, LAYERS, HEADS, KV_HEADS,
                                                                      HEAD_SIZE, device))
                    for kv in ("fp8", "auto")]
        subjects += [(f"bf16 SDPA {backend} (static cache)",
                      lambda backend=backend: SdpaLayers(backend, batch, seq_len, LAYERS, HEADS, KV_HEADS, HEAD_SIZE,
                                                         device))
                     for backend in SDPA_CANDIDATES]
        for name, make in subjects:
            subject = make()
            variants = [("", None)]
            if isinstance(subject, DecodeLayers):
                variants.append((" planned once per step", subject.make_plan))
            for suffix, prepare in variants:
                if prepare is not None:
                    prepare()
                try:
                    row = {"shape": label, "subject": name + suffix, "eager_ms": step_ms(subject.step),
                           "graph_ms": graph_ms(subject.step),
                           "launches_per_layer": launches_per_layer(subject.step, LAYERS)}
                except RuntimeError as exc:
                    print(f"  {label} {name}: {str(exc).splitlines()[0][:160]}", flush=True)
                    continue
                rows.append(row)
                print(f"  {label:9} {row['subject']:44} eager {row['eager_ms']:7.3f} ms  graph "
                      f"{row['graph_ms'] if row['graph_ms'] is None else round(row['graph_ms'], 3)} ms  "
                      f"{row['launches_per_layer']:.1f} launches/layer", flush=True)
            del subject
            torch.cuda.empty_cache()
    return rows


def summarize_steps(rows: list[dict]) -> list[str]:
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        of_shape = [r for r in rows if r["shape"] == shape]
        sdpa = [r for r in of_shape if r["subject"].startswith("bf16 SDPA")]
        if not sdpa:
            continue
        best = min(sdpa, key=lambda r: r["eager_ms"])
        for r in of_shape:
            if r["subject"].startswith("fp8kv fp8"):
                lines.append(f"{shape}: eager {r['subject']} {r['eager_ms']:.3f} ms = "
                             f"{best['eager_ms'] / r['eager_ms']:.2f}x the speed of the fastest eager bf16 "
                             f"({best['subject']}, {best['eager_ms']:.3f} ms)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help=f"step shapes {', '.join(QUICK_SHAPES)} only")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    result = {"device": device_info(device) if device.type == "cuda" else {"name": "cpu",
              "threads": torch.get_num_threads()}}
    print(f"device: {result['device']}", flush=True)
    result["host"] = host_rows(device)
    for row in result["host"]:
        print(f"  host {row['call']:52} {row['host_us']:7.2f} us", flush=True)
    if device.type == "cuda":
        result["step"] = step_rows(QUICK_SHAPES if args.quick else STEP_SHAPES, device)
        for line in summarize_steps(result["step"]):
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
