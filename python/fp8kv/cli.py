"""Command line: `python -m fp8kv demo`, `python -m fp8kv inspect CHECKPOINT` and `python -m fp8kv calibrate`."""

from __future__ import annotations

import argparse
import pathlib
import sys


# ----------------------------------------------------------------------------- inspect


def _inspect(args: argparse.Namespace) -> int:
    """Prints what a checkpoint says about its KV cache scales; exit status 1 if anything is wrong."""
    from .checkpoint import read_checkpoint_scales

    found = read_checkpoint_scales(args.checkpoint, scales_json=args.scales_json)
    print(f"checkpoint:      {found.directory}")
    print(f"model:           {found.model_type or '?'}, {found.num_layers or '?'} layers, "
          f"{found.num_kv_heads or '?'} KV heads")
    print(f"declared:        {', '.join(found.declared) or 'nothing (no kv_cache_scheme / kv_cache_quant_algo)'}")
    print(f"scales:          {', '.join(found.forms) or 'none'}")
    print(f"calibrated for:  {found.calibrated_for.value}")
    if found.k:
        _print_scale_table(found)
    elif found.legacy_json_scales:
        print(f"legacy JSON:     {found.legacy_json} (per tensor, one scale for K and V)")
        for rank, layers in enumerate(found.legacy_json_scales):
            print(f"  rank {rank}: " + " ".join(f"{s:.6g}" for s in layers))
    elif not found.problems:
        print("note:            no KV cache scales: an e4m3 cache would use 1.0 in every layer (calibrate first); "
              "e5m2 and unquantized caches need none")
    if found.problems:
        print(f"\n{len(found.problems)} problem(s):")
        for problem in found.problems:
            print(f"  - {problem}")
        return 1
    print("\nno problems found")
    return 0


def _print_scale_table(found) -> None:
    per_head = any(len(s.values) > 1 for s in (*found.k, *found.v))
    print(f"granularity:     {'per KV head' if per_head else 'per tensor'}")
    print(f"\n{'layer':>5}  {'kind':4}  scales")
    for layer, (k, v) in enumerate(zip(found.k, found.v)):
        for kind, scale in (("K", k), ("V", v)):
            values = " ".join(f"{s:.6g}" for s in scale.values)
            print(f"{layer:>5}  {kind:4}  {values}    ({scale.tensor})")


# ----------------------------------------------------------------------------- calibrate


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _calibrate(args: argparse.Namespace) -> int:
    """Calibrates a checkpoint's K/V scales on the user's data and writes them into a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .calibration import (CalibrationError, calibrate, export_checkpoint, export_legacy_json, make_batches,
                              text_sequences, token_id_sequences)
    from .checkpoint import LEGACY_JSON_FILE, CheckpointError
    from .formats import KVCacheDtype

    try:
        fmt = KVCacheDtype.parse(args.format)
    except ValueError as e:
        raise SystemExit(f"--format: {e}") from None
    in_checkpoint = (pathlib.Path(args.out) / LEGACY_JSON_FILE).resolve()
    if args.legacy_json and pathlib.Path(args.legacy_json).resolve() == in_checkpoint:
        raise SystemExit(f"--legacy-json: not {LEGACY_JSON_FILE} inside --out, which holds the scale tensors "
                         "(the loader refuses two sources); write it elsewhere")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    try:
        if args.token_ids:
            sequences = token_id_sequences(args.data, model.config.get_text_config(decoder=True).vocab_size)
        else:
            if not any((pathlib.Path(args.model) / name).exists() for name in TOKENIZER_FILES):
                raise SystemExit(f"--data: {args.model} has no tokenizer ({', '.join(TOKENIZER_FILES)}): pass a "
                                 "file of token ids with --token-ids")
            tokenizer = AutoTokenizer.from_pretrained(args.model)
            sequences = text_sequences(args.data, tokenizer, args.seq_len)
        batches = make_batches(sequences, args.seq_len, args.batch_size, args.max_tokens)
        amax = calibrate(model, batches, granularity=args.granularity, progress=not args.no_progress)
        kv_cache = amax.scales(fmt, margin=args.margin, zero_amax=args.zero_amax)
        out = export_checkpoint(args.model, args.out, kv_cache)
        if args.legacy_json:
            export_legacy_json(args.legacy_json, kv_cache, model_type=getattr(model.config, "model_type", None))
    except (CalibrationError, CheckpointError, ValueError, FileExistsError) as e:
        raise SystemExit(f"calibrate: {e}") from None
    print(f"calibrated {kv_cache.num_layers} layers on {amax.num_tokens} tokens ({device}, {model.dtype}), "
          f"per {amax.granularity}, for {fmt.value}, margin {args.margin:g}")
    print(f"\n{'layer':>5}  {'K amax':>10} {'K scale':>11}  {'V amax':>10} {'V scale':>11}   (largest over heads)")
    for layer in range(kv_cache.num_layers):
        print(f"{layer:>5}  {max(amax.k[layer]):>10.4g} {max(kv_cache.k_scales[layer]):>11.4g}  "
              f"{max(amax.v[layer]):>10.4g} {max(kv_cache.v_scales[layer]):>11.4g}")
    print(f"\nwrote {out} (scales in kv_cache_scales.safetensors, declared in config.json)"
          + (f" and {args.legacy_json}" if args.legacy_json else ""))
    return 0


# ----------------------------------------------------------------------------- demo

# A small Llama-style model (GQA, 4 layers, head size 64) built from a config with random weights:
# the demo needs no download and finishes in well under a minute on two CPU cores.
DEMO_MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
# The KV geometry of Llama-3-8B (32 layers, 8 KV heads of 128), for the capacity table.
LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_size=128)


def _demo(args: argparse.Namespace) -> int:
    """Generates with a small built-in model on a bf16 and an FP8 paged cache and compares them."""
    import torch

    from .formats import KVCacheDtype

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        fmt = KVCacheDtype.parse(args.kv_cache_dtype)
    except ValueError as e:
        raise SystemExit(f"--kv-cache-dtype: {e}") from None
    if not fmt.is_fp8:
        raise SystemExit(f"--kv-cache-dtype must name an FP8 format, got {args.kv_cache_dtype!r}")
    model = _demo_model(device)
    prompt = torch.randint(0, DEMO_MODEL["vocab_size"], (args.batch_size, args.prompt_len),
                           generator=torch.Generator().manual_seed(0)).to(device)
    configs = {"bf16": _unquantized(), fmt.value: _calibrated(model, prompt, fmt)}
    print(f"fp8kv demo on {_device_name(device)}: random-weight Llama ({DEMO_MODEL['num_hidden_layers']} layers, "
          f"{DEMO_MODEL['num_key_value_heads']} KV heads x 64), batch {args.batch_size}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; {fmt.value} scales calibrated on the prompt")
    _generate(model, prompt[:, :8], configs["bf16"], 2, None)  # warm-up: first-call overheads out of the timings
    runs = {name: _generate(model, prompt, config, args.new_tokens, name) for name, config in configs.items()}
    # Teacher forcing: the FP8 cache and transformers' own eager attention follow the bf16 run's
    # tokens, so their logits compare with it step by step.
    bf16_tokens = runs["bf16"]["tokens"][:, args.prompt_len:]
    forced = {name: _generate(model, prompt, config, args.new_tokens, f"{name} (forced)", force=bf16_tokens)
              for name, config in ((fmt.value, configs[fmt.value]), ("eager", None))}
    print(_report(runs, forced, fmt, args))
    return 0


def _demo_model(device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .integrations.transformers import enable

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**DEMO_MODEL)).to(device=device, dtype=torch.bfloat16).eval()
    return enable(model)


def _unquantized():
    from .formats import KVCacheConfig

    return KVCacheConfig.unit_scales("auto", DEMO_MODEL["num_hidden_layers"])


def _calibrated(model, prompt, fmt):
    """Per-KV-head scales amax / max_finite from the prompt's K/V (e5m2 needs none: 1.0)."""
    import torch

    from .formats import KVCacheConfig
    from .integrations.transformers import PagedCache

    if not fmt.is_e4m3:
        return KVCacheConfig.unit_scales(fmt, DEMO_MODEL["num_hidden_layers"])
    cache = PagedCache(_unquantized(), max_tokens=prompt.shape[0] * (prompt.shape[1] + 15) // 16 * 16)
    with torch.no_grad():
        model(prompt, past_key_values=cache)
    # The storage starts zeroed, so the amax over all of it is the amax of the prompt's K/V.
    layers = [cache.paged.layer(i) for i in range(DEMO_MODEL["num_hidden_layers"])]
    k = [key.float().abs().amax(dim=(0, 1, 3)).cpu() / fmt.max_finite for key, _ in layers]
    v = [value.float().abs().amax(dim=(0, 1, 3)).cpu() / fmt.max_finite for _, value in layers]
    return KVCacheConfig(fmt, k, v, "calibrated on the demo prompt")


class _Progress:
    """A transformers streamer driving a tqdm bar, and timing the first generated token."""

    def __init__(self, total: int, label: str | None):
        import time

        from tqdm import tqdm

        self.clock, self.calls, self.first_token_at = time.perf_counter, 0, None
        self.bar = tqdm(total=total, desc=label, unit="tok", leave=False, disable=label is None, file=sys.stderr)

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_token_at = self.clock()
        if self.calls > 1:
            self.bar.update(1)

    def end(self) -> None:
        self.bar.close()


def _generate(model, prompt, config, new_tokens: int, label: str | None, force=None) -> dict:
    """Greedy generation on a PagedCache in `config`'s format, or with transformers' eager attention
    and its own cache when `config` is None; `force` teacher-forces the tokens."""
    import time

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from .integrations.transformers import PagedCache, enable

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - prompt.shape[1]
            return torch.full_like(scores, -torch.inf).scatter_(1, force[:, step:step + 1], 0.0)

    cache = None
    if config is None:
        model.set_attn_implementation("eager")
    else:
        block_size = 16
        per_sequence = -(-(prompt.shape[1] + new_tokens) // block_size) * block_size  # whole blocks
        cache = PagedCache(config, max_tokens=prompt.shape[0] * per_sequence, block_size=block_size)
    progress = _Progress(new_tokens, label and f"{label:>24}")
    _synchronize(prompt.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             streamer=progress, output_logits=True, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([Force()] if force is not None else []))
    _synchronize(prompt.device)
    end = time.perf_counter()
    enable(model)
    return dict(tokens=out.sequences, logits=torch.stack(out.logits).float(),
                cache_bytes=cache.memory_bytes if cache is not None else None,
                prefill_s=progress.first_token_at - start,
                decode_tokens_per_s=prompt.shape[0] * (new_tokens - 1) / (end - progress.first_token_at))


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device) -> str:
    import os

    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}"
    return f"CPU ({torch.get_num_threads()} threads, {os.cpu_count()} cores)"


def _report(runs: dict, forced: dict, fmt, args) -> str:
    import torch

    from .cache import capacity_report

    bf16, fp8 = runs["bf16"], runs[fmt.value]
    generated = slice(args.prompt_len, None)

    def logit_error(name):
        return ((forced[name]["logits"] - bf16["logits"]).abs().amax() / bf16["logits"].abs().amax()).item()

    same = (bf16["tokens"][:, generated] == fp8["tokens"][:, generated]).float().mean().item()
    top1 = (forced[fmt.value]["logits"].argmax(-1) == bf16["tokens"][:, generated].T).float().mean().item()
    lines = ["", f"{'KV cache':>16} {'KV bytes':>12} {'prefill s':>10} {'decode tok/s':>13}"]
    for name, run in runs.items():
        lines.append(f"{name:>16} {run['cache_bytes']:>12,} {run['prefill_s']:>10.3f} {run['decode_tokens_per_s']:>13.1f}")
    lines += [
        "",
        f"{fmt.value} cache compared with the bf16 cache:",
        f"  greedy tokens identical (free running):    {same:.1%}",
        f"  top-1 identical (teacher forced):          {top1:.1%}",
        f"  max |logit error| / max |logit|:           {logit_error(fmt.value):.2%}",
        f"bf16 cache compared with transformers' eager attention:",
        f"  max |logit error| / max |logit|:           {logit_error('eager'):.2%}",
        "",
        "tokens that fit in 16 GiB of KV cache (block size 16):",
    ]
    model_geometry = dict(num_layers=DEMO_MODEL["num_hidden_layers"], num_kv_heads=DEMO_MODEL["num_key_value_heads"],
                          head_size=DEMO_MODEL["hidden_size"] // DEMO_MODEL["num_attention_heads"])
    for label, geometry in (("this demo model", model_geometry), ("Llama-3-8B geometry", LLAMA3_8B)):
        report = capacity_report(16, model_dtype=torch.bfloat16, **geometry)
        base = report[type(fmt).UNQUANTIZED]
        lines.append(f"  {label:<20} bf16 {base:>12,}   {fmt.value} {report[fmt]:>12,}  ({report[fmt] / base:.1f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp8kv", description="FP8 KV cache for transformer inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="generate with a small built-in model on a bf16 and an FP8 cache")
    demo.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--kv-cache-dtype", default="fp8_e4m3",
                      help="the FP8 format to compare with bf16 (default fp8_e4m3; see KVCacheDtype.parse)")
    demo.add_argument("--threads", type=int, default=1,
                      help="CPU threads (default 1: the demo model's matmuls are too small to gain from more)")
    demo.add_argument("--batch-size", type=int, default=4)
    demo.add_argument("--prompt-len", type=int, default=64)
    demo.add_argument("--new-tokens", type=int, default=48)
    demo.set_defaults(run=_demo)

    inspect = commands.add_parser("inspect", help="show a checkpoint's KV cache scales and every problem with them")
    inspect.add_argument("checkpoint", help="local checkpoint directory (config.json + safetensors)")
    inspect.add_argument("--scales-json", help="a legacy kv_cache_scales.json outside the checkpoint")
    inspect.set_defaults(run=_inspect)

    calib = commands.add_parser("calibrate", help="calibrate K/V cache scales on your data and write them into a "
                                "checkpoint")
    calib.add_argument("--model", required=True, help="local checkpoint directory (transformers causal LM)")
    calib.add_argument("--data", required=True, help="text file (tokenized with the model's tokenizer), or with "
                       "--token-ids a file of whitespace-separated token ids, one sequence per line")
    calib.add_argument("--out", required=True, help="new or empty directory for the checkpoint with scales, or the "
                       "--model directory itself to add the scales in place")
    calib.add_argument("--granularity", choices=("tensor", "head"), default="tensor",
                       help="one scale per layer (default), or one per KV head")
    calib.add_argument("--token-ids", action="store_true", help="--data holds token ids, not text")
    calib.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    calib.add_argument("--batch-size", type=int, default=1, help="sequences per forward pass (default 1)")
    calib.add_argument("--max-tokens", type=int, help="stop after this many tokens of --data")
    calib.add_argument("--format", default="float8_e4m3fn",
                       help="format the scales are for: float8_e4m3fn (default; e4m3fnuz caches double them on "
                       "load) or float8_e4m3fnuz")
    calib.add_argument("--margin", type=float, default=1.0,
                       help="scale = amax * margin / max_finite; >= 1 leaves headroom (default 1.0)")
    calib.add_argument("--zero-amax", choices=("error", "unit"), default="error",
                       help="an all-zero K/V head or layer: error (default), or scale 1.0 with a warning")
    calib.add_argument("--legacy-json", help="also write the legacy kv_cache_scales.json here (per tensor)")
    calib.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    calib.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                       help="model dtype (default: the checkpoint's)")
    calib.add_argument("--no-progress", action="store_true", help="no progress bar")
    calib.set_defaults(run=_calibrate)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
