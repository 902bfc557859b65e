"""Serving: a fixed-seed stream of requests served to completion by transformers' continuous
batching, offline and through its OpenAI-compatible server, on fp8kv's FP8 pages, fp8kv's bf16
pages and transformers' own paged attention, all at the same KV-cache memory budget.

Systems:

  fp8kv e4m3          enable_continuous_batching with an e4m3 KVCacheConfig: the rotated recipe
                      (fp8kv's default for FP8), unit scales (speed does not depend on them); on
                      CUDA with transformers' CUDA graphs and asynchronous batching (--fp8kv-eager:
                      without either)
  fp8kv bf16          the same with a bf16 (unquantized) KVCacheConfig
  transformers ...    transformers' own paged cache and attention in every form that runs here:
                      SDPA, SDPA with CUDA graphs (CUDA only), flash attention 2 and 3 and the
                      kernels hub's flash attention where importable (transformers' defaults: CUDA
                      graphs and its decode fast path). The fastest offline is "transformers' best",
                      the one served online and compared.

Budget: `--kv-cache-memory` GiB of cache pages, given to transformers as its number of cache blocks
(`ContinuousBatchingConfig.num_blocks` = budget / bytes of one block in the system's page dtype), so
FP8 pages get twice the blocks of bf16 ones. Two scenarios per model: memory-limited (that budget;
refused if it holds the whole stream in bf16 pages) and not memory-limited (a budget holding every
request of the stream at once in bf16 pages, one spare page each).

Stream: `--requests` requests whose prompt and output lengths are drawn uniformly (bounds included)
from `--prompt-tokens` and `--output-tokens`, prompt tokens uniformly from the vocabulary, with
`--seed`. EOS is ignored and decoding is greedy, so every request generates exactly its drawn length
(checked: a request that does not is an error of its row).

Offline: every request submitted at once to transformers' continuous-batching manager, in the
context manager `generate_batch` runs (whose loop takes one max_new_tokens for all requests, so each
request is added with its own). Online: `python -m fp8kv serve`'s server (transformers' own
OpenAI-compatible server with continuous batching, for one model), started in this process with the
model already loaded with the system's attention and pages (transformers' own systems too), and
`--clients` concurrent streaming clients (openai's AsyncOpenAI, /v1/completions), each sending its
next request when its last one finished.
Prompts go over HTTP as text that a word-level tokenizer (one word per token id) maps back to the
same ids, so both modes serve the same tokens. The server and transformers' generation thread share
this process, as in `python -m fp8kv serve`; the clients run in another (their interpreter lock is not
the server's).

Metrics, wall clock (time.perf_counter) on the host: output tokens/s = tokens generated / time from
the first submission to the last token; TTFT = first token - submission, per request; ITL = the gaps
between a request's consecutive tokens (offline: as transformers records them, across a preemption
too, see keep_timestamps_across_soft_resets; online: as the client receives them); p50 and p99 over
all requests (TTFT) and gaps (ITL); peak GPU memory (torch's max allocated, model included) over the
measured stream; the cache's blocks and bytes as transformers allocated them (offline rows; the
server is given the same configuration). Warm-up: before each measured stream, WARMUP_REQUESTS
requests of the same distribution (another seed, at most WARMUP_OUTPUT tokens each) through the same
manager or server.

Targets (PASS/MISS), per model and mode: memory-limited, fp8kv e4m3 output tokens/s >= 1.6x fp8kv
bf16's; not memory-limited, >= 1.0x; in both, fp8kv bf16 >= 1.0x transformers' best.

Models and streams (PRESETS): `--model llama3-8b` (Llama-3-8B geometry, random bf16 weights, CUDA
only; prompts 256-8192, outputs 64-512: prefill is much of the work), `--model llama3-8b-decode`
(the same model; prompts 1024-6144, outputs 1024-3072: decoding, which the cache limits, is most of
it; fp8kv's systems only, transformers' own would take hours) and `--model smollm2` (SmolLM2-135M's
real weights, from fp8kv.models; its rows say why when not installed).
`--smoke` serves a tiny random model a small stream (the CPU when there is no GPU), in under a minute.
`--systems REGEX` runs only the systems whose name matches.

Step profile (`--profile-window START-END`, CUDA): where a step's time goes. The device's kernels are
profiled (torch.profiler, CUDA activity only) from START to END seconds after each offline stream of
fp8kv's systems is submitted; steps are counted by fp8kv's attention launches (one per layer and step:
the decode kernel on transformers' decode fast path, a multi-token kernel in a step with prefill), and
per step the table gives the wall time, the output tokens, and the device's busy time in all kernels
and in attention, the cache write, matrix products (the weights' reads) and the rest. Busy time below
the wall time is time the device waited for the host.

    python benchmarks/bench_serve.py [--smoke] [--model NAME ...] [--kv-cache-memory GIB] [--systems REGEX]
                                     [--profile-window START-END] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import pathlib
import re
import socket
import sys
import threading
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_generate import (ATTENTION_KERNELS, SMOLLM2, attention_geometry, build_model, chosen,  # noqa: E402,I001
                            covered_us, peak_gib, reset_peak_memory)
from common import (error_text, fmt, judge, percentile, release_memory, run_header, verdict,  # noqa: E402
                    write_json, write_outputs)

import transformers  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402

from fp8kv.cache import bytes_per_token  # noqa: E402
from fp8kv.formats import KVCacheConfig, KVCacheDtype  # noqa: E402
from fp8kv.integrations.transformers import enable_continuous_batching  # noqa: E402

GIB = 1 << 30
PAGE_SIZE = 256  # tokens per page: transformers' default, read by fp8kv's kernels too
WARMUP_REQUESTS, WARMUP_OUTPUT = 2, 16
NO_EOS = -1  # transformers' "no end-of-sequence token": every request runs to its max_new_tokens
FP8_LIMITED_SPEEDUP, FP8_UNLIMITED_SPEEDUP = 1.6, 1.0
MEMORY_LIMITED, NOT_LIMITED = "memory-limited", "not memory-limited"
FP8, BF16 = "fp8kv e4m3", "fp8kv bf16"
OFFLINE, ONLINE = "offline", "online"
SERVED_NAME = "fp8kv-bench"  # the model's name on the server


def _without_info(record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO


@dataclasses.dataclass(frozen=True)
class Preset:
    """A model's default stream and budget."""

    geometry: str  # a bench_generate.GEOMETRIES key, or SMOLLM2
    requests: int
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    kv_cache_gib: float  # the memory-limited scenario's budget
    clients: int
    transformers: bool = True  # whether transformers' own systems serve it too (they take ~10x longer)


# Small streams (every system serves each one twice, offline and online, per scenario); every request at once.
PRESETS = {
    # Mean context ~4.4k tokens: 16 GiB of bf16 pages hold 131k tokens, ~29 such requests (FP8 pages: all 40).
    "llama3-8b": Preset("Llama-3-8B", 40, (256, 8192), (64, 512), 16.0, 40),
    # Long answers (mean context ~4.6k): decoding, which the cache limits, is most of the work; fp8kv's systems only.
    # 16 GiB of bf16 pages hold ~28 such requests at once, FP8 pages ~57.
    "llama3-8b-decode": Preset("Llama-3-8B", 96, (1024, 6144), (1024, 3072), 16.0, 96, transformers=False),
    # SmolLM2 holds 8192 positions; 1 GiB of its bf16 pages holds 46k tokens, ~10 such requests (FP8 pages: ~20).
    "smollm2": Preset(SMOLLM2, 24, (256, 7680), (64, 512), 1.0, 24),
}
SMOKE = Preset("tiny", 6, (32, 512), (4, 16), 1 / 1024, 3)  # 1 MiB: 1024 bf16 tokens of the tiny model


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_tokens: int


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    kv_format: str | None  # fp8kv's page format (a KVCacheDtype name), None for transformers' own cache
    attention: str  # the attention implementation transformers' path runs (fp8kv's systems: fp8kv's)
    # None: transformers decides (both off where its attention needs a mask, which fp8kv's does not)
    cuda_graphs: bool | None = None
    async_batching: bool | None = None


def fp8kv_systems(device: torch.device, eager: bool) -> list[System]:
    """fp8kv's FP8 and bf16 pages; on CUDA with CUDA graphs and asynchronous batching unless `eager`."""
    fast = None if device.type != "cuda" or eager else True
    return [System(FP8, "float8_e4m3fn", "fp8kv", fast, fast), System(BF16, "auto", "fp8kv", fast, fast)]


def transformers_systems(device: torch.device) -> list[System]:
    """transformers' own continuous-batching paths that can run here."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_kernels_available

    systems = [System("transformers sdpa", None, "sdpa")]
    if device.type == "cuda":
        systems.append(System("transformers sdpa + CUDA graphs", None, "sdpa", True))
        flash = [("flash_attention_3", is_flash_attn_3_available()), ("flash_attention_2", is_flash_attn_2_available()),
                 ("kernels-community/flash-attn2", is_kernels_available())]
        systems += [System(f"transformers {name}", None, name) for name, available in flash if available]
    return systems


# ----------------------------------------------------------------------------- the stream


def draw_stream(count: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], vocab_size: int,
                seed: int) -> list[Request]:
    """`count` requests, lengths uniform over the bounds (included), prompt tokens uniform over the vocabulary."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=generator))

    requests = []
    for _ in range(count):
        prompt_len, output_len = uniform(*prompt_tokens), uniform(*output_tokens)
        requests.append(Request(torch.randint(0, vocab_size, (prompt_len,), generator=generator).tolist(), output_len))
    return requests


def pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def stream_bytes(requests: list[Request], token_bytes: int, page_size: int) -> int:
    """Cache bytes that hold every request at once (prompt and output, whole pages, one spare page each)."""
    return sum(pages(len(r.prompt) + r.output_tokens, page_size) + 1 for r in requests) * page_size * token_bytes


# ----------------------------------------------------------------------------- systems and their caches


def page_bytes_per_token(model, kv_format: str | None) -> int:
    """Cache bytes of one token in a system's pages (transformers' own: the model's dtype)."""
    layers, _, kv_heads, head_size = attention_geometry(model)
    dtype = KVCacheDtype.parse(kv_format or "auto").torch_dtype(model.dtype)
    return bytes_per_token(layers, kv_heads, head_size, dtype)


def use_system(model, system: System) -> None:
    if system.kv_format is None:
        model.set_attn_implementation(system.attention)
    else:
        enable_continuous_batching(model, KVCacheConfig.unit_scales(system.kv_format, model.config.num_hidden_layers))


def batching_config(model, system: System, budget_bytes: int, page_size: int) -> ContinuousBatchingConfig:
    """The budget as whole blocks (page_size tokens of every layer) of the system's pages."""
    num_blocks = budget_bytes // (page_bytes_per_token(model, system.kv_format) * page_size)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, auto_switch_to_flash=False,
                                    use_cuda_graph=system.cuda_graphs, use_async_batching=system.async_batching)


def generation_config() -> GenerationConfig:
    return GenerationConfig(do_sample=False, eos_token_id=NO_EOS, pad_token_id=0)


def cache_facts(cache, page_size: int, token_bytes: int) -> dict:
    """What transformers allocated: blocks, the tokens they hold, their bytes, and the whole tensor's (its two
    scratch sectors included)."""
    allocated = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    return {"cache_blocks": cache.num_blocks, "cache_tokens": cache.num_blocks * page_size,
            "cache_gib": cache.num_blocks * page_size * token_bytes / GIB, "allocated_gib": allocated / GIB}


# ----------------------------------------------------------------------------- metrics


Served = tuple[list[float], list[list[float]], float]  # submission times, token times per request, last token


def summarize(requests: list[Request], starts: list[float], token_times: list[list[float]], end: float) -> dict:
    """Throughput and latency percentiles of a served stream; raises if a request did not generate its drawn
    length."""
    for index, (request, times) in enumerate(zip(requests, token_times)):
        if len(times) != request.output_tokens:
            raise RuntimeError(f"request {index} generated {len(times)} tokens, expected {request.output_tokens}")
    duration = end - min(starts)
    ttft = sorted(1e3 * (times[0] - start) for start, times in zip(starts, token_times))
    itl = sorted(1e3 * (later - earlier) for times in token_times for earlier, later in zip(times, times[1:]))
    output_tokens = sum(len(times) for times in token_times)
    return {"requests": len(requests), "output_tokens": output_tokens,
            "output_counts": [len(times) for times in token_times],
            "prompt_tokens": sum(len(r.prompt) for r in requests), "duration_s": duration,
            "output_tokens_per_s": output_tokens / duration,
            "ttft_ms": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
            "itl_ms": {"p50": percentile(itl, 0.5), "p99": percentile(itl, 0.99)} if itl else None}


# ----------------------------------------------------------------------------- offline


def keep_timestamps_across_soft_resets() -> None:
    """Where the cache runs out, transformers preempts a request: it frees its pages and requeues it as a
    new request whose prompt holds the tokens generated so far, with a new submission time and no
    timestamps, which would lose the first tokens' times. The requeued request keeps the original's."""
    from transformers.generation.continuous_batching.requests import RequestState

    requeue = RequestState.create_equivalent_initial_request
    if getattr(requeue, "keeps_timestamps", False):
        return

    def create_equivalent_initial_request(self):
        requeued = requeue(self)
        requeued.created_time, requeued._timestamps = self.created_time, self._timestamps[:]
        return requeued

    create_equivalent_initial_request.keeps_timestamps = True
    RequestState.create_equivalent_initial_request = create_equivalent_initial_request


def serve_offline(manager, requests: list[Request], window: ProfileWindow | None = None) -> Served:
    """Submits every request at once, waits for all; (submission times, token times per request, end).
    `window`: profiled while the stream is served."""
    ids = [manager.add_request(r.prompt, max_new_tokens=r.output_tokens, record_timestamps=True, eos_token_id=NO_EOS)
           for r in requests]
    submitted = time.perf_counter()
    results = {}
    try:
        while len(results) < len(ids):
            wait = 1.0 if window is None else min(1.0, window.advance(time.perf_counter() - submitted))
            result = manager.get_result(timeout=wait)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread stopped before the stream was served")
                continue
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            if result.is_finished():
                results[result.request_id] = result
    finally:  # a failed stream leaves no profiler running for the next system's
        if window is not None:
            window.stop()
    ordered = [results[request_id] for request_id in ids]
    token_times = [result.timestamps for result in ordered]
    return [result.created_time for result in ordered], token_times, max(times[-1] for times in token_times)


def measure_offline(model, system: System, budget_bytes: int, page_size: int, requests: list[Request],
                    warmup: list[Request], device: torch.device, profile_window: tuple[float, float] | None) -> dict:
    from transformers.generation.continuous_batching.utils import WorkloadHints

    keep_timestamps_across_soft_resets()
    use_system(model, system)
    config = batching_config(model, system, budget_bytes, page_size)
    served = requests + warmup
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in served),
                          max_generated_length=max(r.output_tokens for r in served), num_requests=len(requests))
    window = ProfileWindow(*profile_window) if profile_window and system.kv_format is not None else None
    with model.continuous_batching_context_manager(generation_config=generation_config(), block=True, timeout=30,
                                                   continuous_batching_config=config, workload_hints=hints) as manager:
        serve_offline(manager, warmup)
        reset_peak_memory(device)
        starts, token_times, end = serve_offline(manager, requests, window)
        info = summarize(requests, starts, token_times, end)
        info["peak_gib"] = peak_gib(device)
        token_bytes = page_bytes_per_token(model, system.kv_format)
        info.update(cache_facts(manager.batch_processor.cache, page_size, token_bytes))
        resolved = manager.continuous_batching_config
        info["cuda_graphs"], info["async_batching"] = list(resolved.cuda_graph_booleans), resolved.use_async_batching
    if window is not None:
        info["step_profile"] = window.summary(token_times, model.config.num_hidden_layers)
    return info


# ----------------------------------------------------------------------------- where a step's time goes


# Kernel kinds of a step profile, by name (the first that matches; the rest is "other"): fp8kv's attention
# (decode, multi-token, split merge), its cache write, and the matrix products (cuBLAS's nvjet and
# CUTLASS kernels), which read the weights.
KERNEL_KINDS = {"attention": ATTENTION_KERNELS,
                "cache write": re.compile(r"reshape_and_cache|transformed_write"),
                "matmul": re.compile(r"gemm|nvjet|cutlass|xmma", re.IGNORECASE)}
# fp8kv's attention runs once per layer and step: the decode kernel on transformers' decode fast path,
# a multi-token kernel otherwise.
DECODE_STEP_KERNEL, MIXED_STEP_KERNEL = re.compile(r"decode_kernel"), re.compile(r"sm80_kernel|sm90a_kernel")


class ProfileWindow:
    """The device's kernels (torch.profiler, CUDA activity only) from `start` to `end` seconds after a
    stream's submission; started and stopped by the thread that waits for the results while transformers'
    generation thread runs the steps."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, end
        self.profiler, self.host_times, self.kernels = None, None, None

    def advance(self, elapsed: float) -> float:
        """Starts or stops the profiler as `elapsed` passes the window's edges; the seconds to the next one."""
        if self.profiler is None and self.kernels is None and elapsed >= self.start:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
            self.host_times = [time.perf_counter()]
        if self.profiler is not None and elapsed >= self.end:
            self.stop()
        edge = self.start if self.host_times is None else self.end if self.kernels is None else math.inf
        return max(edge - elapsed, 0.01)

    def stop(self) -> None:
        """Ends the window (early where the stream ended first)."""
        if self.profiler is None:
            return
        self.host_times.append(time.perf_counter())
        self.profiler.__exit__(None, None, None)
        self.kernels = [(e.name, e.time_range.start, e.time_range.end) for e in self.profiler.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA]
        self.profiler = None

    def summary(self, token_times: list[list[float]], layers: int) -> dict:
        if self.kernels is None:
            return {"error": f"the stream ended before the profile window started ({self.start:g} s)"}
        return step_profile(self.kernels, self.host_times, token_times, layers)


def step_profile(kernels: list[tuple[str, float, float]], host_times: list[float], token_times: list[list[float]],
                 layers: int) -> dict:
    """Where a window's steps spend their time. kernels: (name, start us, end us) on the device; host_times:
    the window's start and end on the host's clock (s); token_times: every request's token times on it.
    Steps: fp8kv attention launches / layers (decode-only steps and steps with prefill apart); per step:
    the window's wall time, output tokens, and the device's busy time (overlaps counted once) in all kernels
    and in each kind (KERNEL_KINDS and "other")."""
    start, end = host_times
    decode_steps = sum(1 for name, *_ in kernels if DECODE_STEP_KERNEL.search(name)) / layers
    mixed_steps = sum(1 for name, *_ in kernels if MIXED_STEP_KERNEL.search(name)) / layers
    steps = decode_steps + mixed_steps
    if steps == 0:
        return {"error": "no step of fp8kv's attention ran in the profile window"}
    kinds = {kind: [] for kind in [*KERNEL_KINDS, "other"]}
    for kernel in kernels:
        kind = next((kind for kind, pattern in KERNEL_KINDS.items() if pattern.search(kernel[0])), "other")
        kinds[kind].append(kernel)
    tokens = sum(1 for times in token_times for t in times if start <= t < end)
    return {"window_s": end - start, "steps": steps, "decode_steps": decode_steps, "mixed_steps": mixed_steps,
            "ms_per_step": 1e3 * (end - start) / steps, "tokens_per_step": tokens / steps,
            "busy_ms_per_step": busy_ms(kernels) / steps,
            "kinds_ms_per_step": {kind: busy_ms(spans) / steps for kind, spans in kinds.items()}}


def busy_ms(kernels: list[tuple[str, float, float]]) -> float:
    return covered_us((start, end) for _, start, end in kernels) / 1e3


# ----------------------------------------------------------------------------- online


def online_unavailable() -> str | None:
    """Why transformers' server or openai's client cannot run here, or None."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        return ("transformers' server needs its [serving] extra (fastapi, uvicorn, openai): "
                "pip install 'transformers[serving]'")
    return None


def word(token_id: int) -> str:
    return f"t{token_id}"


def word_tokenizer(vocab_size: int):
    """A tokenizer with one word per token id: a prompt's text maps back to exactly its ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token=word(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)


class Server:
    """`python -m fp8kv serve`'s server in this process on a free loopback port, serving `model` as it is
    (its attention and pages those of the system measured) with `tokenizer` and the continuous-batching
    `config`; its HTTP server in a thread of its own."""

    def __init__(self, model, tokenizer, config: ContinuousBatchingConfig):
        from fp8kv.commands import serve

        serve.check_server()  # transformers' server is the one whose private parts fp8kv's relies on
        # uvicorn logs at level info: 8 lines per server otherwise (a filter outlives its setup).
        for name in ("uvicorn.error", "uvicorn.access"):
            if _without_info not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_without_info)
        # transformers' server logs a warning per request received.
        self.serving_log = logging.getLogger("transformers.cli.serving")
        self.serving_level = self.serving_log.level
        self.serving_log.setLevel(logging.ERROR)
        self.server = serve.Server(SERVED_NAME, model, tokenizer, config)
        self.server.start_worker()
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        self.thread = threading.Thread(target=self.server.run, args=(listener,), daemon=True)
        self.thread.start()
        deadline = time.perf_counter() + 30
        while self.server.http is None or not self.server.http.started:
            if time.perf_counter() > deadline or not self.thread.is_alive():
                self.close()
                raise RuntimeError(f"fp8kv serve's server did not start at {self.url}")
            time.sleep(0.01)

    def close(self) -> None:
        if self.server.http is not None:
            self.server.stop()
        self.thread.join(timeout=30)
        self.server.stop_worker()
        self.serving_log.setLevel(self.serving_level)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


async def stream_requests(url: str, requests: list[Request], clients: int) -> Served:
    """`clients` concurrent streaming clients, each sending the next request of the stream when its last one
    finished; (send times, token arrival times per request, last arrival)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    starts, token_times = [0.0] * len(requests), [[] for _ in requests]
    order = iter(range(len(requests)))

    async def send(index: int) -> None:
        request = requests[index]
        starts[index] = time.perf_counter()
        stream = await client.completions.create(model=SERVED_NAME, prompt=" ".join(map(word, request.prompt)),
                                                 max_tokens=request.output_tokens, temperature=0.0, stream=True)
        counted = None
        async for chunk in stream:
            arrival = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                token_times[index].append(arrival)
            if chunk.usage is not None:
                counted = chunk.usage.completion_tokens
        if counted != len(token_times[index]):
            raise RuntimeError(f"request {index}: {len(token_times[index])} tokens streamed, "
                               f"the server counted {counted}")

    async def client_loop() -> None:
        for index in order:
            await send(index)

    try:
        await asyncio.gather(*(client_loop() for _ in range(min(clients, len(requests)))))
    finally:
        await client.close()
    return starts, token_times, max(times[-1] for times in token_times if times)


def client_process(url: str, requests: list[Request], clients: int) -> Served:
    return asyncio.run(stream_requests(url, requests, clients))


def stream_from_another_process(url: str, requests: list[Request], clients: int) -> Served:
    """stream_requests in a new process (time.perf_counter is the system's monotonic clock, the same in both)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(client_process, url, requests, clients).result()


def measure_online(model, system: System, budget_bytes: int, page_size: int, requests: list[Request],
                   warmup: list[Request], clients: int, device: torch.device) -> dict:
    use_system(model, system)
    config = batching_config(model, system, budget_bytes, page_size)
    saved, model.generation_config = model.generation_config, generation_config()  # the server's defaults
    try:
        with Server(model, word_tokenizer(model.config.vocab_size), config) as server:
            stream_from_another_process(server.url, warmup, clients)
            reset_peak_memory(device)
            info = summarize(requests, *stream_from_another_process(server.url, requests, clients))
            info["peak_gib"] = peak_gib(device)
    finally:
        model.generation_config = saved
    return info | {"clients": min(clients, len(requests))}


# ----------------------------------------------------------------------------- run


def measured(label: str, measure) -> dict:
    """measure(), or {"error": ...}; the memory it held released, its time printed."""
    start = time.perf_counter()
    try:
        info = measure()
    except Exception as exc:  # recorded in the table and the JSON; the other systems still run
        info = {"error": error_text(exc)}
    release_memory()
    summary = info["error"] if "error" in info else f"{info['output_tokens_per_s']:.0f} output tok/s"
    print(f"  {label}: {summary} ({time.perf_counter() - start:.0f} s)", flush=True)
    return info


def transformers_best(rows: list[dict]) -> str | None:
    """The fastest of transformers' own systems among rows (one model, scenario and mode)."""
    timed = [r for r in rows if r["system"].startswith("transformers") and "output_tokens_per_s" in r]
    return max(timed, key=lambda r: r["output_tokens_per_s"])["system"] if timed else None


def run_model(name: str, preset: Preset, args: argparse.Namespace, device: torch.device, streams: dict,
              rows: list[dict], saved) -> None:
    """Every scenario, system and mode of one model: its stream's description into `streams`, each row
    appended to `rows` as it is measured, and saved() called after each (a run stopped midway keeps
    what it measured)."""
    model = build_model(preset.geometry, device)
    positions = model.config.max_position_embeddings
    longest = preset.prompt_tokens[1] + preset.output_tokens[1]
    if longest > positions:
        raise SystemExit(f"--prompt-tokens / --output-tokens: {name} holds {positions} positions, fewer than the "
                         f"longest prompt plus the longest output ({longest})")
    vocab = model.config.vocab_size
    requests = draw_stream(preset.requests, preset.prompt_tokens, preset.output_tokens, vocab, args.seed)
    warmup_output = tuple(min(bound, WARMUP_OUTPUT) for bound in preset.output_tokens)
    warmup = draw_stream(WARMUP_REQUESTS, preset.prompt_tokens, warmup_output, vocab, args.seed + 1)
    whole_stream = stream_bytes(requests, page_bytes_per_token(model, "auto"), args.page_size)
    limited = int(preset.kv_cache_gib * GIB)
    if limited >= whole_stream:
        raise SystemExit(f"--kv-cache-memory {preset.kv_cache_gib:g} GiB holds {name}'s whole stream in bf16 pages "
                         f"({whole_stream / GIB:.3g} GiB): nothing limits the batch; give less, or more requests")
    streams[name] = {"requests": preset.requests, "prompt_tokens": list(preset.prompt_tokens),
                     "output_tokens": list(preset.output_tokens), "output_lengths": [r.output_tokens for r in requests],
                     "prompt_lengths": [len(r.prompt) for r in requests], "bf16_stream_gib": whole_stream / GIB,
                     "clients": min(preset.clients, preset.requests)}
    with_transformers = preset.transformers and not args.no_transformers
    offline_systems = fp8kv_systems(device, args.fp8kv_eager) + (transformers_systems(device) if with_transformers
                                                                  else [])
    offline_systems = chosen(offline_systems, args.systems, lambda system: system.name)
    online_reason = "disabled by --no-online" if args.no_online else online_unavailable()

    def add(row: dict) -> dict:
        rows.append(row)
        saved()
        return row

    for scenario, budget in ((MEMORY_LIMITED, limited), (NOT_LIMITED, whole_stream)):
        if scenario not in args.scenario:
            continue
        print(f"{name}, {scenario}: {budget / GIB:.3g} GiB of cache pages", flush=True)
        base = {"model": name, "scenario": scenario, "kv_cache_gib": budget / GIB}
        offline = [add(base | {"mode": OFFLINE, "system": system.name} | measured(
            f"{OFFLINE} / {system.name}",
            lambda system=system: measure_offline(model, system, budget, args.page_size, requests, warmup, device,
                                                  args.profile_window)))
            for system in offline_systems]
        best = transformers_best(offline)
        for system in (s for s in offline_systems if s.name in (FP8, BF16, best)):
            if online_reason is None:
                info = measured(f"{ONLINE} / {system.name}", lambda system=system: measure_online(
                    model, system, budget, args.page_size, requests, warmup, preset.clients, device))
            else:
                info = {"skipped": online_reason}
            add(base | {"mode": ONLINE, "system": system.name} | info)


def comparisons(rows: list[dict]) -> list[dict]:
    """Per model, scenario and mode: FP8 over bf16 pages and fp8kv's bf16 pages over transformers' best (output
    tokens/s; None where either did not run), and the targets they are judged by."""
    groups = {}
    for row in rows:
        groups.setdefault((row["model"], row["scenario"], row["mode"]), []).append(row)
    results = []
    for (model, scenario, mode), group in groups.items():
        rate = {row["system"]: row.get("output_tokens_per_s") for row in group}
        best = transformers_best(group)

        def over(a, b):
            return rate[a] / rate[b] if rate.get(a) and rate.get(b) else None

        fp8, bf16 = over(FP8, BF16), over(BF16, best)
        need = FP8_LIMITED_SPEEDUP if scenario == MEMORY_LIMITED else FP8_UNLIMITED_SPEEDUP
        where = f"{model} {scenario} {mode}"
        targets = {f"{where}: fp8 >= {need}x bf16": judge(lambda: fp8 >= need, fp8),
                   f"{where}: bf16 >= 1.0x transformers' best": judge(lambda: bf16 >= 1.0, bf16)}
        results.append({"model": model, "scenario": scenario, "mode": mode, "transformers_best": best,
                        "fp8_vs_bf16": fp8, "bf16_vs_transformers": bf16,
                        "targets": {name: verdict(ok) for name, ok in targets.items()}})
    return results


def markdown_table(headers: list[str], lines: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [headers, ["---"] * len(headers), *lines])


def percentiles_text(latency: dict | None) -> str:
    return "-" if latency is None else f"{fmt(latency['p50'])} / {fmt(latency['p99'])}"


def results_table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        budget = "-" if row["kv_cache_gib"] is None else f"{row['kv_cache_gib']:.3g}"
        cells = [row["model"], row["scenario"], budget, row["mode"], row["system"]]
        if "output_tokens_per_s" not in row:
            lines.append(cells + ["-"] * 6 + [row.get("error") or row.get("skipped")])
            continue
        lines.append(cells + [fmt(row["output_tokens_per_s"], 0), percentiles_text(row["ttft_ms"]),
                              percentiles_text(row["itl_ms"]), fmt(row["peak_gib"]),
                              str(row.get("cache_blocks", "-")), fmt(row["duration_s"]), ""])
    return markdown_table(["model", "scenario", "KV GiB", "mode", "system", "output tok/s", "TTFT p50 / p99 ms",
                           "ITL p50 / p99 ms", "peak GiB", "cache blocks", "s", "not run"], lines)


def comparisons_table(compared: list[dict]) -> str:
    lines = []
    for c in compared:
        fp8_target, bf16_target = c["targets"].values()
        lines.append([c["model"], c["scenario"], c["mode"], fmt(c["fp8_vs_bf16"], 2), fp8_target,
                      c["transformers_best"] or "-", fmt(c["bf16_vs_transformers"], 2), bf16_target])
    return markdown_table(["model", "scenario", "mode", "fp8 / bf16", "target", "transformers' best",
                           "bf16 / transformers' best", "target"], lines)


def profile_table(rows: list[dict]) -> str:
    """The step profiles of the rows that have one."""
    lines = []
    for row in rows:
        profile = row.get("step_profile")
        if profile is None:
            continue
        cells = [row["model"], row["scenario"], row["system"]]
        if "error" in profile:
            lines.append(cells + ["-"] * 9 + [profile["error"]])
            continue
        kinds = profile["kinds_ms_per_step"]
        lines.append(cells + [fmt(profile["window_s"], 2), f"{fmt(profile['decode_steps'], 0)} + "
                              f"{fmt(profile['mixed_steps'], 0)}", fmt(profile["tokens_per_step"]),
                              fmt(profile["ms_per_step"], 2), fmt(profile["busy_ms_per_step"], 2)]
                     + [fmt(kinds[kind], 2) for kind in [*KERNEL_KINDS, "other"]] + [""])
    return markdown_table(["model", "scenario", "system", "window s", "steps (decode + with prefill)",
                           "output tokens / step", "ms / step", "device busy ms / step",
                           *(f"{kind} ms / step" for kind in [*KERNEL_KINDS, "other"]), "not run"], lines)


def parse_window(text: str) -> tuple[float, float]:
    match = re.fullmatch(r"(\d+(?:\.\d*)?)-(\d+(?:\.\d*)?)", text)
    if not match or not float(match[1]) < float(match[2]):
        raise argparse.ArgumentTypeError(f"expected START-END in seconds with START < END, got {text!r}")
    return float(match[1]), float(match[2])


def parse_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)-(\d+)", text)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise argparse.ArgumentTypeError(f"expected MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(match[1]), int(match[2])


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value
    return parse


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(PRESETS),
                        help="a model to serve (repeatable; default: all; llama3-8b on CUDA only)")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and a short stream, on any device")
    parser.add_argument("--requests", type=positive(int), help="requests in the stream (default: the model's preset)")
    parser.add_argument("--prompt-tokens", type=parse_range, metavar="MIN-MAX", help="prompt lengths, uniform")
    parser.add_argument("--output-tokens", type=parse_range, metavar="MIN-MAX", help="output lengths, uniform")
    parser.add_argument("--kv-cache-memory", type=positive(float), metavar="GIB",
                        help="the memory-limited scenario's budget of cache pages, GiB (default: the model's preset)")
    parser.add_argument("--clients", type=positive(int), help="concurrent clients online (default: the model's preset)")
    parser.add_argument("--page-size", type=positive(int), default=PAGE_SIZE, help="tokens per cache page")
    parser.add_argument("--seed", type=int, default=0, help="the stream's seed")
    parser.add_argument("--no-online", action="store_true", help="offline only")
    parser.add_argument("--scenario", action="append", choices=(MEMORY_LIMITED, NOT_LIMITED),
                        help="a scenario to run (repeatable; default: both)")
    parser.add_argument("--no-transformers", action="store_true", help="fp8kv's systems only")
    parser.add_argument("--systems", metavar="REGEX", help="only the systems whose name matches REGEX")
    parser.add_argument("--profile-window", type=parse_window, metavar="START-END",
                        help="profile the device from START to END seconds after each offline stream's submission "
                        "(fp8kv's systems, CUDA): where a step's time goes")
    parser.add_argument("--fp8kv-eager", action="store_true",
                        help="fp8kv's systems without CUDA graphs and asynchronous batching")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write all results as JSON")
    args = parser.parse_args(argv)
    if args.smoke and args.model:
        parser.error("argument --model: not with --smoke, which serves its own tiny model")
    llama = [name for name in args.model or PRESETS if PRESETS[name].geometry != SMOLLM2]
    if not args.smoke and args.device != "cuda" and llama:
        parser.error(f"argument --device: {llama[0]} needs a CUDA GPU; on the CPU: --smoke, or --model smollm2")
    if args.profile_window and args.device != "cuda":
        parser.error("argument --profile-window: profiles CUDA kernels; it needs --device cuda")
    args.scenario = args.scenario or [MEMORY_LIMITED, NOT_LIMITED]
    args.png = None  # common.write_outputs: no plot for this benchmark
    return args


def presets(args: argparse.Namespace) -> dict[str, Preset]:
    """The chosen models' presets with the command line's overrides."""
    chosen = {"tiny": SMOKE} if args.smoke else {name: PRESETS[name] for name in args.model or PRESETS}
    overrides = {field: getattr(args, field) for field in ("requests", "prompt_tokens", "output_tokens",
                                                           "kv_cache_memory", "clients")}
    overrides["kv_cache_gib"] = overrides.pop("kv_cache_memory")
    overrides = {field: value for field, value in overrides.items() if value is not None}
    return {name: dataclasses.replace(preset, **overrides) for name, preset in chosen.items()}


def payload_of(header: dict, args: argparse.Namespace, streams: dict, rows: list[dict]) -> dict:
    compared = comparisons([row for row in rows if row["mode"] != "-"])
    return header | {"transformers": transformers.__version__, "page_size": args.page_size, "seed": args.seed,
                     "warmup_requests": WARMUP_REQUESTS, "warmup_output_tokens": WARMUP_OUTPUT,
                     "streams": streams, "rows": rows, "comparisons": compared,
                     "targets": {name: ok for c in compared for name, ok in c["targets"].items()}}


def main(argv: list[str] | None = None) -> dict:
    args = parse_arguments(argv)
    device = torch.device(args.device)
    print(f"streams: seed {args.seed}, lengths uniform, EOS ignored, greedy; pages of {args.page_size} tokens; "
          f"{WARMUP_REQUESTS} warm-up requests (<= {WARMUP_OUTPUT} output tokens) before each measured stream; "
          "times: host wall clock", flush=True)
    header = run_header("serve", device) if device.type == "cuda" else {
        "benchmark": "serve", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": {"name": "cpu", "torch": torch.__version__}}
    rows, streams = [], {}

    def saved() -> None:
        if args.json:
            write_json(payload_of(header, args, streams, rows), args.json)

    for name, preset in presets(args).items():
        try:
            run_model(name, preset, args, device, streams, rows, saved)
        except SystemExit:
            raise
        except Exception as exc:  # e.g. SmolLM2 not installed: its row says why
            rows.append({"model": name, "scenario": "-", "kv_cache_gib": None, "mode": "-", "system": "-",
                         "error": f"model unavailable: {error_text(exc)}"})
            print(f"{name}: {rows[-1]['error']}", flush=True)
        release_memory()
    payload = payload_of(header, args, streams, rows)
    print(results_table(rows))
    print()
    print(comparisons_table(payload["comparisons"]))
    if args.profile_window:
        print()
        print(profile_table(rows))
    write_outputs(payload, args)
    return payload


if __name__ == "__main__":
    main()
