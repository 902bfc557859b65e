"""`fp8kv demo`: the same model with a bf16 and an FP8 paged KV cache, side by side.

With the real model installed (SmolLM2-135M-Instruct, `fp8kv.models`), `run_real`:
1. answers a few questions (chat template, greedy decoding) with each cache and prints the texts;
2. scores both caches on real text against the model's own attention (`fp8kv.evaluate`:
   perplexity, KL, top-1), on a few windows of the license texts;
3. prints the cache bytes per token and the tokens that fit in a memory budget;
4. on CUDA, times decode steps of a large batch over a long prompt through the graph path
   (`PagedCache(..., compileable=True)`), where reading the cache dominates a step.
The FP8 cache uses scale 1.0: this model's K and V sit inside e4m3's normal range, where a scale
does not change the precision (docs/calibration.md measured no gain from calibration).

Without it (or with --random-weights), `run_random` runs a small random-weight Llama-style model
(no download, well under a minute on two CPU cores) with scales calibrated on the prompt: it shows
the memory, the capacity and the mechanics (tokens and logits against the bf16 cache and
transformers' eager attention), not accuracy on real text, and says so first.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import sys
import textwrap
import time

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from .cache import bytes_per_token, capacity_report
from .calibration import calibrate
from .evaluate.caches import ROTATED
from .formats import KVCacheConfig, KVCacheDtype
from .integrations.transformers import PagedCache, cache_argument, enable
from .models import SMOLLM2_MODEL

BLOCK_SIZE = 16
CAPACITY_GIB = 16  # the memory budget of the capacity lines
# The KV geometry of Llama-3-8B (32 layers, 8 KV heads of 128), for the capacity lines.
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_size=128)


# ----------------------------------------------------------------------------- generation on a cache


class _Progress:
    """A transformers streamer driving a tqdm bar and reading the clock at every token it gets.

    generate hands it the prompt first, then each step's new tokens after copying them to the host
    (which waits for the device), so consecutive times bound one decode step each.
    """

    def __init__(self, total: int, label: str | None):
        self.times: list[float] = []
        self.bar = tqdm(total=total, desc=label, unit="tok", leave=False, disable=label is None, file=sys.stderr)

    def put(self, value) -> None:
        self.times.append(time.perf_counter())
        if len(self.times) > 1:  # the first call carries the prompt
            self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


class _TeacherForcing(LogitsProcessor):
    """Makes generation pick `tokens[:, step]` at each step after a prompt of `prompt_len` tokens."""

    def __init__(self, tokens: torch.Tensor, prompt_len: int):
        self.tokens, self.prompt_len = tokens, prompt_len

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        return torch.full_like(scores, -torch.inf).scatter_(1, self.tokens[:, step:step + 1], 0.0)


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: torch.Tensor  # [batch, prompt + new] token ids
    logits: torch.Tensor  # [new, batch, vocab] float32
    cache_bytes: int | None  # the PagedCache's K/V storage; None for transformers' own cache
    start: float  # perf_counter before generate
    token_times: tuple[float, ...]  # perf_counter after the prefill's token and after each decode step's

    @property
    def prefill_s(self) -> float:
        return self.token_times[0] - self.start

    @property
    def step_seconds(self) -> list[float]:
        """Each decode step's time, in order."""
        return [later - earlier for earlier, later in zip(self.token_times, self.token_times[1:])]

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the whole decode (every step, warm-up included)."""
        return self.tokens.shape[0] * (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


def _generate(model, prompt, config: KVCacheConfig | None, new_tokens: int, label: str | None, *,
              attention_mask=None, pad_token_id: int = 0, until_eos: bool = False, force=None,
              compileable: bool = False) -> Generation:
    """Greedy generation on a PagedCache in `config`'s format, or with transformers' eager attention
    and its own cache when `config` is None.

    Every sequence gets `new_tokens` tokens, or with `until_eos` stops at the model's end of sequence.
    `force` teacher-forces the tokens; `compileable` lets generate compile the decode step (CUDA).
    """
    cache = None
    if config is None:
        model.set_attn_implementation("eager")
    else:
        per_sequence = -(-(prompt.shape[1] + new_tokens) // BLOCK_SIZE) * BLOCK_SIZE  # whole blocks
        cache = PagedCache(config, max_tokens=prompt.shape[0] * per_sequence, block_size=BLOCK_SIZE,
                           compileable=compileable)
    processors = [_TeacherForcing(force, prompt.shape[1])] if force is not None else []
    progress = _Progress(new_tokens, label and f"{label:>24}")
    lengths = {} if until_eos else dict(min_new_tokens=new_tokens)
    if attention_mask is None:
        attention_mask = torch.ones_like(prompt)
    _synchronize(prompt.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=attention_mask, **cache_argument(model, cache),
                             max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_token_id, streamer=progress,
                             output_logits=True, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList(processors), **lengths)
    enable(model)
    return Generation(out.sequences, torch.stack(out.logits).float(),
                      cache.memory_bytes if cache is not None else None, start, tuple(progress.times[1:]))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"CPU ({threads} thread{'s' * (threads != 1)}, {os.cpu_count()} cores)"


def _capacity_lines(fmt: KVCacheDtype, geometries: dict[str, dict]) -> list[str]:
    """Bytes per token and tokens that fit in CAPACITY_GIB, bf16 against `fmt`, for each named
    geometry (num_layers, num_kv_heads, head_size)."""
    width = max(map(len, geometries))

    def line(label: str, bf16: int, fp8: int) -> str:
        return f"  {label:<{width}}  bf16 {bf16:>12,}   {fmt.value} {fp8:>12,}  ({fp8 / bf16:.1f}x)"

    lines = ["bytes per token (K and V of every layer):"]
    for label, geometry in geometries.items():
        lines.append(line(label, *(bytes_per_token(**geometry, cache_dtype=f.torch_dtype(torch.bfloat16))
                                   for f in (KVCacheDtype.UNQUANTIZED, fmt))))
    lines.append(f"tokens that fit in {CAPACITY_GIB} GiB of KV cache (block size {BLOCK_SIZE}):")
    for label, geometry in geometries.items():
        report = capacity_report(CAPACITY_GIB, model_dtype=torch.bfloat16, block_size=BLOCK_SIZE, **geometry)
        lines.append(line(label, report[KVCacheDtype.UNQUANTIZED], report[fmt]))
    return lines


# ----------------------------------------------------------------------------- the real model

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
)
# Perplexity windows (count, tokens): a short sample on the CPU (a bf16 pass over 256 tokens takes
# seconds there), the accuracy table's size on a GPU.
EVALUATION_WINDOWS = {"cpu": (2, 256), "cuda": (16, 2048)}


@dataclasses.dataclass(frozen=True)
class DecodeSpeedShape:
    """Decode timing on CUDA: `batch` copies of a `context`-token prompt, `warmup` steps (compilation,
    CUDA graph recording) then `steps` timed steps."""

    batch: int = 64
    context: int = 7680  # SmolLM2 holds 8192 positions
    warmup: int = 4
    steps: int = 32


@dataclasses.dataclass(frozen=True)
class RealDemo:
    """What is checked and tokenized before the model's weights load."""

    checkpoint: pathlib.Path
    tokenizer: object
    questions: dict  # the chat-templated questions: input_ids and attention_mask [len(QUESTIONS), length]
    new_tokens: int


class TooManyTokens(ValueError):
    """The questions and the new tokens do not fit the model's positions."""


def prepare_real(checkpoint, new_tokens: int) -> RealDemo:
    """Tokenizes the questions. Raises TooManyTokens when the longest question and `new_tokens` exceed
    the model's positions."""
    from transformers import AutoConfig, AutoTokenizer

    positions = AutoConfig.from_pretrained(checkpoint).max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    if tokenizer.pad_token is None:  # some transformers releases convert the GGUF without one; left
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out, so any id fills it
    questions = tokenizer.apply_chat_template([[{"role": "user", "content": q}] for q in QUESTIONS],
                                              add_generation_prompt=True, padding=True, return_tensors="pt",
                                              return_dict=True)
    length = questions["input_ids"].shape[1]
    if length + new_tokens > positions:
        raise TooManyTokens(f"the longest question takes {length} tokens with the chat template; {length} + {new_tokens} "
                         f"is more than {SMOLLM2_MODEL}'s {positions} positions")
    return RealDemo(pathlib.Path(checkpoint), tokenizer, dict(questions), new_tokens)


def run_real(demo: RealDemo, device: torch.device, fmt: KVCacheDtype, *,
             evaluation_windows: tuple[int, int] | None = None,
             decode_speed: DecodeSpeedShape | None = DecodeSpeedShape(), progress: bool = True) -> None:
    """Prints the four sections of the real-model demo (see the module docstring).

    evaluation_windows: (count, tokens) of the perplexity sample (default: EVALUATION_WINDOWS by device);
    decode_speed: the shape timed on CUDA, or None to skip the timing.
    """
    from transformers import AutoModelForCausalLM

    from .models import evaluation_text

    print(f"fp8kv demo: {SMOLLM2_MODEL} (real weights, bf16) on {_device_name(device)}, with a bf16 KV cache and a "
          f"{fmt.value} KV cache:\n  1. answers to {len(QUESTIONS)} questions  2. perplexity on real text  "
          "3. cache memory and capacity  4. decode speed (CUDA only)")
    print(f"{fmt.value} scales: 1.0, uncalibrated. This model's K and V (|K| up to about 20) sit inside the "
          "format's normal range, where a scale does not change the precision: calibration gains nothing here "
          f"(docs/calibration.md). The {fmt.value} cache stores K and V rotated (fp8kv's default recipe, "
          "docs/rotated_cache.md): the same attention, less FP8 rounding error.")
    model = enable(AutoModelForCausalLM.from_pretrained(demo.checkpoint, dtype=torch.bfloat16).to(device).eval())
    num_layers = model.config.num_hidden_layers
    configs = {"bf16": KVCacheConfig.unit_scales("auto", num_layers),
               # The recipe spelled out (a name fp8kv.evaluate takes): the demo says which cache it compares.
               f"{fmt.value}-{ROTATED}": KVCacheConfig.unit_scales(fmt, num_layers, rotation="hadamard")}
    text_ids = demo.tokenizer(evaluation_text(), add_special_tokens=False, verbose=False)["input_ids"]

    answers = _answers_section(model, demo, configs, progress)
    print(_perplexity_section(model, demo, text_ids, configs, evaluation_windows or EVALUATION_WINDOWS[device.type],
                              progress))
    print(_memory_section(model, fmt, answers))
    if device.type != "cuda":
        print("\n4. Decode speed: measured on CUDA only (the speed an FP8 cache buys is the GPU's memory "
              "bandwidth).")
    elif decode_speed is not None:
        print(_decode_speed_section(model, demo, text_ids, configs, decode_speed, progress))


def _answers_section(model, demo: RealDemo, configs: dict, progress: bool) -> dict[str, Generation]:
    """Prints each question and each cache's answer; returns the generations."""
    device = next(model.parameters()).device
    prompt = demo.questions["input_ids"].to(device)
    mask = demo.questions["attention_mask"].to(device)
    runs = {name: _generate(model, prompt, config, demo.new_tokens, name if progress else None, attention_mask=mask,
                            pad_token_id=demo.tokenizer.pad_token_id, until_eos=True)
            for name, config in configs.items()}
    eos = demo.tokenizer.eos_token_id
    answers = {name: [_until(row.tolist(), eos) for row in run.tokens[:, prompt.shape[1]:]]
               for name, run in runs.items()}
    lines = ["", f"1. Answers (chat template, greedy decoding, at most {demo.new_tokens} new tokens each; the same "
             "model with each cache):"]
    width = max(map(len, configs))
    identical = 0
    for index, question in enumerate(QUESTIONS):
        lines.append(f"Q: {question}")
        for name in configs:
            text = demo.tokenizer.decode(answers[name][index], skip_special_tokens=True).strip() or "(nothing)"
            lines.append(_indented(text, f"  {name:<{width}}  "))
        first, other = (answers[name][index] for name in configs)
        same = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
        identical += first == other
        lines.append(f"  -> {'identical' if first == other else f'the same first {same} tokens, then different'}")
    lines.append(f"{identical} of {len(QUESTIONS)} answers identical. Greedy decoding takes the single most likely "
                 "token: a rounding that flips a near tie sends the rest of the answer down another path. The "
                 "perplexity below measures the change token by token, without that amplification.")
    print("\n".join(lines))
    return runs


def _until(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def _indented(text: str, prefix: str) -> str:
    """`text` after `prefix`, its lines (wrapped at 100 columns) aligned under the first."""
    pieces = [piece for line in text.splitlines() for piece in (textwrap.wrap(line, 100 - len(prefix)) or [""])]
    return "\n".join(((prefix if i == 0 else " " * len(prefix)) + piece).rstrip() for i, piece in enumerate(pieces))


def _perplexity_section(model, demo: RealDemo, text_ids: list[int], configs: dict, windows: tuple[int, int],
                        progress: bool) -> str:
    from .evaluate import evaluate_model, token_windows

    count, seq_len = windows
    device = next(model.parameters()).device
    result = evaluate_model(model, token_windows(text_ids, seq_len, count, demo.tokenizer.bos_token_id), configs,
                            progress=progress, setup={"model": SMOLLM2_MODEL, "device": _device_name(device)})
    bf16, fp8 = (result.cache(name) for name in configs)
    return "\n".join([
        "", "2. Perplexity of real text (the license texts of /usr/share/common-licenses) with each cache, against the "
        "model's own attention (fp8kv.evaluate; KL and top-1 against the model's next-token distribution):",
        result.table(),
        f"{fp8.name} against the bf16 cache: perplexity {fp8.perplexity / bf16.perplexity - 1:+.2%}, KL {fp8.kl:.1e} "
        f"against {bf16.kl:.1e} (the bf16 cache's own rounding); docs/accuracy.md has longer runs."])


def _memory_section(model, fmt: KVCacheDtype, answers: dict[str, Generation]) -> str:
    config = model.config
    geometry = dict(num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                    head_size=config.hidden_size // config.num_attention_heads)
    lines = ["", "3. KV cache memory and capacity:"]
    lines += _capacity_lines(fmt, {SMOLLM2_MODEL: geometry, "Llama-3-8B geometry": LLAMA3_8B})
    sizes = ", ".join(f"{name} {run.cache_bytes:,} bytes" for name, run in answers.items())
    lines.append(f"the answers' caches ({len(QUESTIONS)} sequences): {sizes}")
    return "\n".join(lines)


def time_decode(model, prompt: torch.Tensor, configs: dict[str, KVCacheConfig], warmup: int, steps: int,
                progress: bool = True) -> dict[str, dict]:
    """Greedy decode of `prompt` [batch, context] on a compileable PagedCache for each config: the
    median step time over `steps` steps after `warmup`, tokens per second and the cache's bytes."""
    results = {}
    for name, config in configs.items():
        run = _generate(model, prompt, config, warmup + steps + 1, f"{name} decode" if progress else None,
                        compileable=True)
        step_s = statistics.median(run.step_seconds[warmup:])
        results[name] = dict(step_s=step_s, tokens_per_s=prompt.shape[0] / step_s, cache_bytes=run.cache_bytes)
        del run
        torch._dynamo.reset()  # the compiled step and its CUDA graphs, with the memory they hold
        if prompt.device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _decode_speed_section(model, demo: RealDemo, text_ids: list[int], configs: dict, shape: DecodeSpeedShape,
                          progress: bool) -> str:
    from .evaluate import token_windows

    device = next(model.parameters()).device
    prompt = token_windows(text_ids, shape.context, 1, demo.tokenizer.bos_token_id).repeat(shape.batch, 1)
    results = time_decode(model, prompt.to(device), configs, shape.warmup, shape.steps, progress)
    lines = ["", f"4. Decode speed on {_device_name(device)}: {shape.batch} sequences of a {shape.context:,}-token "
             "prompt (license text), greedy, graph path (PagedCache(..., compileable=True): generate compiles the "
             f"decode step, one CUDA graph per step); median of {shape.steps} steps after {shape.warmup} warm-up "
             "steps, each step synchronized:"]
    base = results["bf16"]["tokens_per_s"]
    width = max(map(len, results))
    for name, r in results.items():
        lines.append(f"  {name:<{width}}  {r['step_s'] * 1e3:7.2f} ms/step  {r['tokens_per_s']:>9,.0f} tokens/s  "
                     f"cache {r['cache_bytes'] / 2**30:5.2f} GiB  ({r['tokens_per_s'] / base:.2f}x bf16)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- random weights

# A small Llama-style model: GQA, 4 layers, head size 64.
DEMO_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
# Tokens a run may hold: the model's context.
MAX_TOKENS = DEMO_MODEL["max_position_embeddings"]
RANDOM_BATCH_SIZE, RANDOM_PROMPT_LEN = 4, 64  # the command line's defaults


def run_random(device: torch.device, fmt: KVCacheDtype, *, batch_size: int, prompt_len: int, new_tokens: int,
               why: str, real_model_missing: str | None) -> None:
    """Generates on a bf16 and a `fmt` cache with the random-weight model and prints how they compare,
    after two lines: what random weights show and `why` they are used, then how to get the real model
    (`real_model_missing`: what it lacks, models.smollm2_missing) or, where it is installed, to run it.

    fmt: an FP8 format; batch_size, prompt_len, new_tokens > 0 with prompt_len + new_tokens <= MAX_TOKENS
    (the command line checks them).
    """
    print(f"fp8kv demo with RANDOM WEIGHTS ({why}). They show the FP8 cache's memory, capacity and mechanics, not "
          "its accuracy on real text.")
    real_model = f"real model ({SMOLLM2_MODEL}: answers and perplexity)"
    print(f"For the {real_model}: {real_model_missing}" if real_model_missing else
          f"The {real_model} is installed: run the demo without --random-weights.")
    model = _demo_model(device)
    prompt = torch.randint(0, DEMO_MODEL["vocab_size"], (batch_size, prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(device)
    configs = {"bf16": _unquantized(), fmt.value: _calibrated(model, prompt, fmt)}
    print(f"Random-weight Llama ({DEMO_MODEL['num_hidden_layers']} layers, {DEMO_MODEL['num_key_value_heads']} KV "
          f"heads x 64) on {_device_name(device)}: batch {batch_size}, prompt {prompt_len}, {new_tokens} new tokens; "
          f"{fmt.value} scales calibrated on the prompt")
    _generate(model, prompt[:, :8], configs["bf16"], 2, None)  # warm-up: first-call overheads out of the timings
    runs = {name: _generate(model, prompt, config, new_tokens, name) for name, config in configs.items()}
    # Teacher forcing: the FP8 cache and transformers' own eager attention follow the bf16 run's
    # tokens, so their logits compare with it step by step.
    bf16_tokens = runs["bf16"].tokens[:, prompt_len:]
    forced = {name: _generate(model, prompt, config, new_tokens, f"{name} (forced)", force=bf16_tokens)
              for name, config in ((fmt.value, configs[fmt.value]), ("eager", None))}
    print(_random_report(runs, forced, fmt, prompt_len))


def _demo_model(device: torch.device):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DEMO_MODEL)).to(device=device, dtype=torch.bfloat16).eval()
    return enable(model)


def _unquantized() -> KVCacheConfig:
    return KVCacheConfig.unit_scales("auto", DEMO_MODEL["num_hidden_layers"])


def _calibrated(model, prompt: torch.Tensor, fmt: KVCacheDtype) -> KVCacheConfig:
    """The rotated recipe's per-KV-head scales calibrated on the prompt, for `fmt` as the checkpoint
    loader would give them."""
    # Calibration runs the model on transformers' own cache and attention.
    model.set_attn_implementation("sdpa")
    amax = calibrate(model, [prompt], granularity="head", progress=False)
    enable(model)
    if fmt.is_e4m3:
        return amax.rotated.kv_cache(fmt, "head", centred=False)
    # Scales are calibrated for e4m3; an e5m2 cache uses e4m3fn scales unchanged (scale_factor_from is 1).
    return dataclasses.replace(amax.rotated.kv_cache(KVCacheDtype.E4M3FN, "head", centred=False), dtype=fmt)


def _random_report(runs: dict[str, Generation], forced: dict[str, Generation], fmt: KVCacheDtype,
                   prompt_len: int) -> str:
    bf16, fp8 = runs["bf16"], runs[fmt.value]
    generated = slice(prompt_len, None)

    def logit_error(name):
        return ((forced[name].logits - bf16.logits).abs().amax() / bf16.logits.abs().amax()).item()

    same = (bf16.tokens[:, generated] == fp8.tokens[:, generated]).float().mean().item()
    top1 = (forced[fmt.value].logits.argmax(-1) == bf16.tokens[:, generated].T).float().mean().item()
    lines = ["", f"{'KV cache':>16} {'KV bytes':>12} {'prefill s':>10} {'decode tok/s':>13}"]
    for name, run in runs.items():
        lines.append(f"{name:>16} {run.cache_bytes:>12,} {run.prefill_s:>10.3f} {run.decode_tokens_per_s:>13.1f}")
    lines += [
        "",
        f"{fmt.value} cache compared with the bf16 cache:",
        f"  greedy tokens identical (free running):    {same:.1%}",
        f"  top-1 identical (teacher forced):          {top1:.1%}",
        f"  max |logit error| / max |logit|:           {logit_error(fmt.value):.2%}",
        "bf16 cache compared with transformers' eager attention:",
        f"  max |logit error| / max |logit|:           {logit_error('eager'):.2%}",
        "",
    ]
    model_geometry = dict(num_layers=DEMO_MODEL["num_hidden_layers"], num_kv_heads=DEMO_MODEL["num_key_value_heads"],
                          head_size=DEMO_MODEL["hidden_size"] // DEMO_MODEL["num_attention_heads"])
    lines += _capacity_lines(fmt, {"this demo model": model_geometry, "Llama-3-8B geometry": LLAMA3_8B})
    return "\n".join(lines)
