"""Accuracy of FP8 KV caches with and without calibrated scales (issue 5), on models built from configs.

No weights can be downloaded here, so the models are random-weight Llama / Qwen2 models given the
K/V structure that makes FP8 scales matter in real checkpoints (synthetic, stated in every report):
- per-KV-head magnitudes spread over a decade (x0.3 .. x3; "heads x1000": three decades) and
  log-normal per-channel gains;
- a few outlier key channels per head, on rotary pairs (channels i and i + head_size/2), x8 .. x20;
- queries small where keys are large (q_proj rows divided by the key gain), as in trained models,
  so no channel decides every logit;
- small values: V has a standard deviation of 0.01 ("llama-like"), 0.003 ("V/3") or 0.03 ("Vx3"),
  so under scale 1.0 much of it lands in e4m3's subnormals (below 2^-6) where relative precision
  is lost; "Kx8" multiplies K by 8, so its outlier channels exceed e4m3's 448 and saturate under
  scale 1.0;
- "qwen-like" adds k_proj biases of 150 .. 600 on the outlier channels (Qwen2 has q/k/v biases), so
  |K| exceeds 448 there too, but as a near-constant offset.

Scales are calibrated (fp8kv.calibration.calibrate) on one set of random token sequences and
evaluated on another; every number is the mean over --seeds models (weights and data) per profile.
Caches compared: bf16 (unquantized), e5m2 (scale 1), e4m3 with scale 1, e4m3 calibrated per
tensor, e4m3 calibrated per KV head. Metrics:
- attention output, each layer on the same bf16 q/k/v (captured from the bf16-cache run): relative
  RMS error ||out - ref|| / ||ref|| per query head against float64 causal attention over those
  q/k/v, averaged over heads; mean over layers and worst layer;
- end-to-end logits of one prefill (every query reads the cache, so every position sees the
  quantized K/V of the positions before it) against the float32 model with transformers' eager
  attention: relative RMS error, KL(ref || cache) per position (mean), top-1 agreement; and the
  relative RMS error against the bf16-cache logits (what the FP8 cache itself adds).

    python benchmarks/accuracy_report.py [--models llama-like qwen-like] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fp8kv import KVCacheConfig, PagedAttention, PagedKVCache
from fp8kv.calibration import calibrate
from fp8kv.integrations.transformers import PagedCache, enable

GEOMETRY = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
HEAD_SIZE = GEOMETRY["hidden_size"] // GEOMETRY["num_attention_heads"]


@dataclasses.dataclass(frozen=True)
class Profile:
    family: str = "llama"
    k_gain: float = 1.0  # multiplies every key channel's standard deviation
    v_std: float = 0.01  # value standard deviation before the head and channel gains
    head_decades: float = 1.0  # KV head gains spread over this many decades, centred on 1
    k_bias: tuple[float, float] | None = None  # |k_proj bias| range on the outlier channels


PROFILES = {
    "llama-like": Profile(),
    "llama-like, V/3": Profile(v_std=0.003),
    "llama-like, Vx3": Profile(v_std=0.03),
    "llama-like, Kx8": Profile(k_gain=8.0),
    "llama-like, heads x1000": Profile(head_decades=3.0),
    "qwen-like": Profile(family="qwen2", v_std=0.03, k_bias=(150.0, 600.0)),
}
FAMILIES = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}
CACHES = ("bf16 (unquantized)", "e5m2, scale 1", "e4m3, scale 1", "e4m3, calibrated per tensor",
          "e4m3, calibrated per head")


# ----------------------------------------------------------------------------- models


def build_model(profile: str, seed: int):
    """A float32 random-weight model with the profile's K/V structure (see the module docstring)."""
    shape = PROFILES[profile]
    model_class, config_class = FAMILIES[shape.family]
    torch.manual_seed(seed)
    model = model_class(config_class(**GEOMETRY)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    heads, d = GEOMETRY["num_key_value_heads"], HEAD_SIZE
    groups = GEOMETRY["num_attention_heads"] // heads
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            k_std, outlier = _channel_stds(heads, d, generator, shape.head_decades, outliers=2)
            v_gain, _ = _channel_stds(heads, d, generator, shape.head_decades, outliers=0)
            _set_row_stds(attn.k_proj.weight, shape.k_gain * k_std)
            _set_row_stds(attn.v_proj.weight, shape.v_std * v_gain)
            # Queries are small where keys are huge (as in trained models): each channel's share of
            # q.k stays ordinary instead of the outliers deciding every logit.
            q_div = shape.k_gain * torch.where(outlier, k_std, torch.ones_like(k_std))
            attn.q_proj.weight.div_(q_div.reshape(heads, 1, d).expand(heads, groups, d).reshape(-1, 1))
            if attn.k_proj.bias is not None:
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.zero_()
                if shape.k_bias is not None:
                    low, high = shape.k_bias
                    count = int(outlier.sum())
                    signs = torch.randint(0, 2, (count,), generator=generator) * 2 - 1
                    attn.k_proj.bias[outlier] = signs * (low + (high - low) * torch.rand(count, generator=generator))
    return model


def _channel_stds(heads: int, d: int, generator, head_decades: float, *,
                  outliers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel standard deviations [heads * d] (head gain x channel gain, `outliers` rotary
    pairs per head x8 .. x20) and the mask of the outlier channels."""
    head_gain = 10.0 ** (head_decades * (torch.linspace(0, 1, heads)[torch.randperm(heads, generator=generator)] - 0.5))
    head_gain = head_gain[:, None]
    channel_gain = torch.exp(0.5 * torch.randn(heads, d, generator=generator))
    mask = torch.zeros(heads, d, dtype=torch.bool)
    for h in range(heads):
        # Low-frequency rotary pairs (the upper half of the first d/2 channels), where trained models
        # keep their outlier key channels.
        for i in (d // 4 + torch.randperm(d // 4, generator=generator)[:outliers]).tolist():
            gain = 8.0 + 12.0 * torch.rand((), generator=generator).item()
            channel_gain[h, i] = channel_gain[h, i + d // 2] = gain
            mask[h, i] = mask[h, i + d // 2] = True
    return (head_gain * channel_gain).reshape(-1), mask.reshape(-1)


def _set_row_stds(weight: torch.Tensor, stds: torch.Tensor) -> None:
    # RMSNorm output has unit RMS, so row r yields about N(0, |w_r|^2): scale rows to |w_r| = std_r.
    weight.mul_((stds / weight.norm(dim=1))[:, None])


# ----------------------------------------------------------------------------- caches


def cache_configs(model, calibration_batches) -> dict[str, KVCacheConfig]:
    layers = GEOMETRY["num_hidden_layers"]
    per_tensor = calibrate(model, calibration_batches, granularity="tensor", progress=False)
    per_head = calibrate(model, calibration_batches, granularity="head", progress=False)
    return {
        CACHES[0]: KVCacheConfig.unit_scales("auto", layers),
        CACHES[1]: KVCacheConfig.unit_scales("float8_e5m2", layers),
        CACHES[2]: KVCacheConfig.unit_scales("float8_e4m3fn", layers),
        CACHES[3]: per_tensor.scales("float8_e4m3fn"),
        CACHES[4]: per_head.scales("float8_e4m3fn"),
    }


class RecordingCache(PagedCache):
    """A PagedCache that also keeps every layer's q, k, v (for the per-layer attention metric)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs = {}

    def attend(self, layer_idx, query, key, value, *args):
        self.inputs[layer_idx] = (query, key, value)
        return super().attend(layer_idx, query, key, value, *args)


def run_cache(model, ids: torch.Tensor, config: KVCacheConfig, cache_class=PagedCache):
    cache = cache_class(config, max_tokens=ids.numel() + 16 * ids.shape[0])
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache).logits.float()
    return logits, cache


# ----------------------------------------------------------------------------- metrics


def attention_errors(inputs: dict, config: KVCacheConfig) -> list[float]:
    """Per layer: relative RMS error of fp8kv attention over a `config` cache vs float64 attention,
    averaged over query heads."""
    errors = []
    for layer, (query, key, value) in sorted(inputs.items()):
        batch, heads, length, d = query.shape
        kv_heads = key.shape[1]
        cache = PagedKVCache(config, num_kv_heads=kv_heads, head_size=d, num_blocks=batch * math.ceil(length / 16),
                             model_dtype=query.dtype)
        for seq in range(batch):
            cache.add_sequence(seq)
        step = cache.prepare(range(batch), [length] * batch)
        module = PagedAttention(heads, kv_heads, d, config, layer)
        q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], d) for t in (query, key, value))
        out = module(q, k, v, cache, step).double().reshape(batch, length, heads, d).transpose(1, 2)
        ref = causal_attention_float64(query, key, value)
        # Per query head, then averaged: heads with small V count as much as heads with large V.
        per_head = (out - ref).square().sum((0, 2, 3)).sqrt() / ref.square().sum((0, 2, 3)).sqrt()
        errors.append(per_head.mean().item())
    return errors


def causal_attention_float64(query, key, value) -> torch.Tensor:
    q, k, v = (t.double() for t in (query, key, value))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    length = q.shape[2]
    scores.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), -math.inf)
    return scores.softmax(-1) @ v


def logit_metrics(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    log_p, log_q = ref.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return dict(logit_rel_rms=((logits - ref).norm() / ref.norm()).item(), kl_mean=kl.mean().item(),
                top1_agreement=(logits.argmax(-1) == ref.argmax(-1)).double().mean().item())


def kv_ranges(amax_per_head) -> dict:
    return dict(k_amax_max=max(max(layer) for layer in amax_per_head.k),
                v_amax_min=min(min(layer) for layer in amax_per_head.v),
                v_amax_max=max(max(layer) for layer in amax_per_head.v))


# ----------------------------------------------------------------------------- report


def report(profile: str, args) -> dict:
    """The profile's metrics averaged over `args.seeds` models (each with its own data)."""
    runs = [report_one(profile, seed, args) for seed in range(args.seed, args.seed + args.seeds)]
    averaged = {name: {metric: sum(run["rows"][name][metric] for run in runs) / len(runs) for metric in row}
                for name, row in runs[0]["rows"].items()}
    return dict(runs[0], rows=averaged, seeds=len(runs), k_amax_max=max(r["k_amax_max"] for r in runs),
                v_amax_min=min(r["v_amax_min"] for r in runs), v_amax_max=max(r["v_amax_max"] for r in runs),
                per_seed=[run["rows"] for run in runs])


def report_one(profile: str, seed: int, args) -> dict:
    model = build_model(profile, seed)
    generator = torch.Generator().manual_seed(seed + 2)
    vocab = GEOMETRY["vocab_size"]
    calibration = [torch.randint(0, vocab, (args.batch, args.seq_len), generator=generator)
                   for _ in range(args.calibration_batches)]
    evaluation = torch.randint(0, vocab, (args.batch, args.seq_len), generator=generator)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        reference = model(input_ids=evaluation).logits.float()  # float32, transformers' eager attention
    bf16 = model.to(torch.bfloat16)
    amax = calibrate(bf16, calibration, granularity="head", progress=False)
    configs = cache_configs(bf16, calibration)
    enable(bf16)
    _, recording = run_cache(bf16, evaluation, configs[CACHES[0]], RecordingCache)
    rows, unquantized = {}, None
    for name, config in configs.items():
        logits, _ = run_cache(bf16, evaluation, config)
        unquantized = logits if unquantized is None else unquantized  # the first config is the bf16 cache
        layer_errors = attention_errors(recording.inputs, config)
        rows[name] = dict(attention_rel_rms_mean=sum(layer_errors) / len(layer_errors),
                          attention_rel_rms_worst=max(layer_errors), **logit_metrics(logits, reference),
                          logit_rel_rms_vs_bf16_cache=((logits - unquantized).norm() / unquantized.norm()).item())
    return dict(profile=profile, calibration_tokens=amax.num_tokens, evaluation_tokens=evaluation.numel(),
                **kv_ranges(amax), rows=rows)


def print_report(result: dict) -> None:
    print(f"\n{result['profile']} (mean of {result['seeds']} models): calibrated on {result['calibration_tokens']} "
          f"tokens, evaluated on {result['evaluation_tokens']}; max |K| {result['k_amax_max']:.4g}, per-head max |V| "
          f"{result['v_amax_min']:.3g} .. {result['v_amax_max']:.3g}")
    print(f"| {'KV cache':<28} | attention rel RMS: mean / worst layer | logits rel RMS | vs bf16 cache "
          "| KL mean | top-1 agree |")
    print(f"|{'-' * 30}|{'-' * 38}|{'-' * 16}|{'-' * 15}|{'-' * 9}|{'-' * 13}|")
    for name, row in result["rows"].items():
        print(f"| {name:<28} | {row['attention_rel_rms_mean']:>17.2e} / {row['attention_rel_rms_worst']:.2e} | "
              f"{row['logit_rel_rms']:>14.2e} | {row['logit_rel_rms_vs_bf16_cache']:>13.2e} | "
              f"{row['kl_mean']:.1e} | {row['top1_agreement']:>11.1%} |")
    unit, tensor, head = (result["rows"][c] for c in CACHES[2:])
    for metric, label in (("attention_rel_rms_mean", "attention error"),
                          ("logit_rel_rms_vs_bf16_cache", "logit error vs bf16 cache"), ("kl_mean", "KL")):
        print(f"  {label}: e4m3 scale 1 / calibrated per tensor = {unit[metric] / tensor[metric]:.1f}x, "
              f"/ calibrated per head = {unit[metric] / head[metric]:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--calibration-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--seeds", type=int, default=3, help="models (and data sets) per profile, averaged")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results = [report(profile, args) for profile in args.models]
    device = f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"fp8kv accuracy report on {device}; models from configs with synthetic K/V structure (see --help)")
    for result in results:
        print_report(result)
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, geometry=GEOMETRY, args=vars(args), results=results), f, indent=2)


if __name__ == "__main__":
    main()
