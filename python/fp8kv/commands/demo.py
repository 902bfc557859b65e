"""`fp8kv demo`: the same model with a bf16 and an FP8 KV cache (see fp8kv.demo)."""

from __future__ import annotations

import argparse

from ..checkpoint.problems import CheckpointError
from ..checkpoint.tensor_files import check_tensor_files
from ..formats import KVCacheDtype, format_names
from .. import models
from . import arguments
from .errors import USAGE_ERROR, CommandError

HELP = ("the same model with a bf16 and an FP8 KV cache: answers, perplexity, memory, decode speed (the real SmolLM2 "
        "model where installed, else random weights)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=arguments.device, help=arguments.DEVICE_HELP)
    parser.add_argument("--kv-cache-dtype", type=arguments.fp8_format, metavar="FORMAT",
                        help=f"the FP8 format to compare with bf16, in fp8kv's rotated recipe: {format_names(arguments.FP8)} "
                        "(default: e4m3)")
    parser.add_argument("--random-weights", action="store_true",
                        help="run the small random-weight model even where the real model is installed")
    parser.add_argument("--threads", type=arguments.positive_int, help="CPU threads (default: torch's for the real "
                        "model; 1 for the random-weight model, whose matmuls are too small to gain from more)")
    parser.add_argument("--new-tokens", type=arguments.positive_int, default=48,
                        help="tokens generated per answer or sequence (default 48)")
    parser.add_argument("--batch-size", type=arguments.positive_int,
                        help="random-weight demo: sequences (default 4)")
    parser.add_argument("--prompt-len", type=arguments.positive_int,
                        help="random-weight demo: prompt tokens (default 64)")


def run(args: argparse.Namespace) -> int:
    """The real model's demo where it is installed, else (or with --random-weights) the random-weight one."""
    import torch

    for option in ("batch_size", "prompt_len"):
        if getattr(args, option) is not None and not args.random_weights:
            raise CommandError(f"argument --{option.replace('_', '-')}: an option of the random-weight demo (the real "
                               "model answers fixed questions): add --random-weights", USAGE_ERROR)
    from .. import demo  # needs transformers: imported once the arguments are checked

    fmt = args.kv_cache_dtype or KVCacheDtype.parse("e4m3")
    device = args.device or arguments.default_device()
    missing = models.smollm2_missing()
    if not (args.random_weights or missing):
        checkpoint = models.smollm2_checkpoint()
        try:
            check_tensor_files(checkpoint)
        except CheckpointError as e:
            raise CommandError(f"the converted {models.SMOLLM2_MODEL} checkpoint is damaged: {e}; delete {checkpoint} "
                               "to convert it again") from e
        try:
            prepared = demo.prepare_real(checkpoint, args.new_tokens)
        except demo.TooManyTokens as e:
            raise CommandError(f"argument --new-tokens: {e}", USAGE_ERROR) from e
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        demo.run_real(prepared, device, fmt)
        return 0
    batch_size, prompt_len = args.batch_size or demo.RANDOM_BATCH_SIZE, args.prompt_len or demo.RANDOM_PROMPT_LEN
    if prompt_len + args.new_tokens > demo.MAX_TOKENS:
        raise CommandError(f"argument --new-tokens: --prompt-len + --new-tokens is {prompt_len + args.new_tokens}, "
                           f"more than the demo model's {demo.MAX_TOKENS} positions", USAGE_ERROR)
    torch.set_num_threads(args.threads or 1)
    why = "--random-weights" if args.random_weights else "the real model is not installed"
    demo.run_random(device, fmt, batch_size=batch_size, prompt_len=prompt_len, new_tokens=args.new_tokens, why=why,
                    real_model_missing=missing)
    return 0
