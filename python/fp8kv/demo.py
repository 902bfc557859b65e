"""`fp8kv demo`: greedy generation with a small built-in model on a bf16 and an FP8 paged cache.

The model is a Llama-style config with random weights, so the demo needs no download and finishes
in well under a minute on two CPU cores. The FP8 scales are calibrated on the prompt with
fp8kv.calibration; the report compares tokens, logits, speed and cache capacity.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from .cache import capacity_report
from .calibration import calibrate
from .formats import KVCacheConfig, KVCacheDtype
from .integrations.transformers import PagedCache, enable

# A small Llama-style model: GQA, 4 layers, head size 64.
DEMO_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
# Tokens a run may hold: the model's context.
MAX_TOKENS = DEMO_MODEL["max_position_embeddings"]
# The KV geometry of Llama-3-8B (32 layers, 8 KV heads of 128), for the capacity table.
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_size=128)
BLOCK_SIZE = 16


def run(device: torch.device, fmt: KVCacheDtype, *, batch_size: int, prompt_len: int, new_tokens: int) -> None:
    """Generates on a bf16 and a `fmt` cache and prints how they compare.

    fmt: an FP8 format; batch_size, prompt_len, new_tokens > 0 with prompt_len + new_tokens <= MAX_TOKENS
    (the command line checks them).
    """
    model = _demo_model(device)
    prompt = torch.randint(0, DEMO_MODEL["vocab_size"], (batch_size, prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(device)
    configs = {"bf16": _unquantized(), fmt.value: _calibrated(model, prompt, fmt)}
    print(f"fp8kv demo on {_device_name(device)}: random-weight Llama ({DEMO_MODEL['num_hidden_layers']} layers, "
          f"{DEMO_MODEL['num_key_value_heads']} KV heads x 64), batch {batch_size}, prompt {prompt_len}, "
          f"{new_tokens} new tokens; {fmt.value} scales calibrated on the prompt")
    _generate(model, prompt[:, :8], configs["bf16"], 2, None)  # warm-up: first-call overheads out of the timings
    runs = {name: _generate(model, prompt, config, new_tokens, name) for name, config in configs.items()}
    # Teacher forcing: the FP8 cache and transformers' own eager attention follow the bf16 run's
    # tokens, so their logits compare with it step by step.
    bf16_tokens = runs["bf16"]["tokens"][:, prompt_len:]
    forced = {name: _generate(model, prompt, config, new_tokens, f"{name} (forced)", force=bf16_tokens)
              for name, config in ((fmt.value, configs[fmt.value]), ("eager", None))}
    print(_report(runs, forced, fmt, prompt_len))


def _demo_model(device: torch.device):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DEMO_MODEL)).to(device=device, dtype=torch.bfloat16).eval()
    return enable(model)


def _unquantized() -> KVCacheConfig:
    return KVCacheConfig.unit_scales("auto", DEMO_MODEL["num_hidden_layers"])


def _calibrated(model, prompt: torch.Tensor, fmt: KVCacheDtype) -> KVCacheConfig:
    """Per-KV-head scales calibrated on the prompt, for `fmt` as the checkpoint loader would give them."""
    # Calibration runs the model on transformers' own cache and attention.
    model.set_attn_implementation("sdpa")
    amax = calibrate(model, [prompt], granularity="head", progress=False)
    enable(model)
    if fmt.is_e4m3:
        return amax.scales(fmt)
    # Scales are calibrated for e4m3; an e5m2 cache uses e4m3fn scales unchanged (scale_factor_from is 1).
    return dataclasses.replace(amax.scales(KVCacheDtype.E4M3FN), dtype=fmt)


class _Progress:
    """A transformers streamer driving a tqdm bar, and timing the first generated token."""

    def __init__(self, total: int, label: str | None):
        self.calls, self.first_token_at = 0, None
        self.bar = tqdm(total=total, desc=label, unit="tok", leave=False, disable=label is None, file=sys.stderr)

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_token_at = time.perf_counter()
        if self.calls > 1:
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


def _generate(model, prompt, config: KVCacheConfig | None, new_tokens: int, label: str | None, force=None) -> dict:
    """Greedy generation on a PagedCache in `config`'s format, or with transformers' eager attention
    and its own cache when `config` is None; `force` teacher-forces the tokens."""
    cache = None
    if config is None:
        model.set_attn_implementation("eager")
    else:
        per_sequence = -(-(prompt.shape[1] + new_tokens) // BLOCK_SIZE) * BLOCK_SIZE  # whole blocks
        cache = PagedCache(config, max_tokens=prompt.shape[0] * per_sequence, block_size=BLOCK_SIZE)
    processors = [_TeacherForcing(force, prompt.shape[1])] if force is not None else []
    progress = _Progress(new_tokens, label and f"{label:>24}")
    _synchronize(prompt.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             streamer=progress, output_logits=True, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList(processors))
    _synchronize(prompt.device)
    end = time.perf_counter()
    enable(model)
    return dict(tokens=out.sequences, logits=torch.stack(out.logits).float(),
                cache_bytes=cache.memory_bytes if cache is not None else None,
                prefill_s=progress.first_token_at - start,
                decode_tokens_per_s=prompt.shape[0] * (new_tokens - 1) / (end - progress.first_token_at))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads, {os.cpu_count()} cores)"


def _report(runs: dict, forced: dict, fmt: KVCacheDtype, prompt_len: int) -> str:
    bf16, fp8 = runs["bf16"], runs[fmt.value]
    generated = slice(prompt_len, None)

    def logit_error(name):
        return ((forced[name]["logits"] - bf16["logits"]).abs().amax() / bf16["logits"].abs().amax()).item()

    same = (bf16["tokens"][:, generated] == fp8["tokens"][:, generated]).float().mean().item()
    top1 = (forced[fmt.value]["logits"].argmax(-1) == bf16["tokens"][:, generated].T).float().mean().item()
    lines = ["", f"{'KV cache':>16} {'KV bytes':>12} {'prefill s':>10} {'decode tok/s':>13}"]
    for name, run in runs.items():
        lines.append(f"{name:>16} {run['cache_bytes']:>12,} {run['prefill_s']:>10.3f} "
                     f"{run['decode_tokens_per_s']:>13.1f}")
    lines += [
        "",
        f"{fmt.value} cache compared with the bf16 cache:",
        f"  greedy tokens identical (free running):    {same:.1%}",
        f"  top-1 identical (teacher forced):          {top1:.1%}",
        f"  max |logit error| / max |logit|:           {logit_error(fmt.value):.2%}",
        "bf16 cache compared with transformers' eager attention:",
        f"  max |logit error| / max |logit|:           {logit_error('eager'):.2%}",
        "",
        f"tokens that fit in 16 GiB of KV cache (block size {BLOCK_SIZE}):",
    ]
    model_geometry = dict(num_layers=DEMO_MODEL["num_hidden_layers"], num_kv_heads=DEMO_MODEL["num_key_value_heads"],
                          head_size=DEMO_MODEL["hidden_size"] // DEMO_MODEL["num_attention_heads"])
    for label, geometry in (("this demo model", model_geometry), ("Llama-3-8B geometry", LLAMA3_8B)):
        report = capacity_report(16, model_dtype=torch.bfloat16, block_size=BLOCK_SIZE, **geometry)
        base = report[KVCacheDtype.UNQUANTIZED]
        lines.append(f"  {label:<20} bf16 {base:>12,}   {fmt.value} {report[fmt]:>12,}  ({report[fmt] / base:.1f}x)")
    return "\n".join(lines)
