"""Command line: `fp8kv demo | inspect | calibrate | evaluate`, also run as `python -m fp8kv`.

Argument parsing and dispatch. Every argument is checked when it is parsed (argparse `type=`
functions), and arguments that depend on each other before any model loads. A user error (a bad
value, a missing or malformed file, a broken checkpoint, a missing optional package) prints
`PROG COMMAND: error: argument ARG: what is wrong` on stderr and exits with status 2 (a bad argument)
or 1 (an operation failed on the user's files or data), never with a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pathlib
import sys

USAGE_ERROR, FAILURE = 2, 1
# Optional packages a command may need, and how to get them.
_OPTIONAL_PACKAGES = {"transformers": 'install fp8kv with its [hf] extra: pip install "fp8kv[hf]"'}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class CommandError(Exception):
    """A user error met while running a command; the message names the argument."""

    def __init__(self, message: str, status: int = FAILURE):
        super().__init__(message)
        self.status = status


class _Exit(SystemExit):
    """SystemExit(status) raised once the error line is printed; str() is the message, for callers of main()."""

    def __init__(self, status: int, message: str):
        super().__init__(status)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _fail(prog: str, message: str, status: int):
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise _Exit(status, message)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage dump), exit status 2."""

    def error(self, message: str):
        _fail(self.prog, message, USAGE_ERROR)


@contextlib.contextmanager
def _blame(argument: str, errors: tuple[type[Exception], ...] = (OSError, ValueError)):
    """Reports `errors` raised while using `argument`'s file or value as a CommandError naming it."""
    try:
        yield
    except errors as e:
        raise CommandError(f"argument {argument}: {_describe(e)}") from e


def _describe(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    return str(error)


# ----------------------------------------------------------------------------- argument types
# Each raises ArgumentTypeError, which argparse reports as `argument ARG: message`.


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _margin(text: str) -> float:
    """The rule of KVAmax.scales: a finite number >= 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1.0):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 1, got {text!r}")
    return value


def _device(text: str):
    import torch

    from ._ops import has_cuda_kernels

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device is available (torch {torch.__version__})")
        if not has_cuda_kernels():
            raise argparse.ArgumentTypeError(f"{text}: fp8kv was built without its CUDA kernels (build it with a "
                                             "CUDA torch and nvcc installed)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def _default_device():
    import torch

    from ._ops import has_cuda_kernels

    return torch.device("cuda" if torch.cuda.is_available() and has_cuda_kernels() else "cpu")


def _input_file(text: str) -> pathlib.Path:
    path = pathlib.Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: not readable")
    return path


def _unwritable(directory: pathlib.Path) -> str | None:
    """What keeps us from creating files in `directory`, or None."""
    if not directory.exists():
        return f"directory {directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    return None


def _output_directory(text: str) -> pathlib.Path:
    """A directory path; where it must be writable depends on --model (see _check_calibration_arguments)."""
    path = pathlib.Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    return path


def _output_file(text: str) -> pathlib.Path:
    """A file path in an existing writable directory."""
    path = pathlib.Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory")
    problem = _unwritable(path.absolute().parent)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return path


def _uncalibrated_checkpoint(text: str) -> pathlib.Path:
    """A checkpoint directory the loader reads without problems, holding no KV cache scales yet, in a
    form the export can write scales into."""
    from .calibration import scales_file
    from .checkpoint.reading import read_checkpoint_scales

    found = read_checkpoint_scales(text)  # reports bad content as problems, raises nothing
    if found.problems:
        raise argparse.ArgumentTypeError("; ".join(str(p) for p in found.problems))
    if found.has_scales or found.declared:
        held = ", ".join(found.forms + found.declared)
        raise argparse.ArgumentTypeError(f"{text} already has KV cache scales ({held}); calibrate from the checkpoint "
                                         "without them")
    try:
        scales_file(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return pathlib.Path(text)


# ----------------------------------------------------------------------------- commands


def _demo(args: argparse.Namespace) -> int:
    """The real model's demo where it is installed, else (or with --random-weights) the random-weight one."""
    import torch

    for option in ("batch_size", "prompt_len"):
        if getattr(args, option) is not None and not args.random_weights:
            raise CommandError(f"argument --{option.replace('_', '-')}: an option of the random-weight demo (the real "
                               "model answers fixed questions): add --random-weights", USAGE_ERROR)
    from . import demo
    from .formats import KVCacheDtype

    fmt = KVCacheDtype.parse(args.kv_cache_dtype or "fp8_e4m3")
    device = args.device or _default_device()
    checkpoint, why = (None, "--random-weights") if args.random_weights else demo.find_real_model()
    if checkpoint is not None:
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
    demo.run_random(device, fmt, batch_size=batch_size, prompt_len=prompt_len, new_tokens=args.new_tokens, why=why)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    """Prints what a checkpoint says about its KV cache scales; exit status 1 if anything is wrong."""
    from .checkpoint.reading import read_checkpoint_scales

    with _blame("checkpoint"):
        found = read_checkpoint_scales(args.checkpoint, scales_json=args.scales_json)
    print("\n".join(found.report()))
    return 1 if found.problems else 0


def _check_calibration_arguments(args: argparse.Namespace) -> None:
    """The checks that involve several arguments, made before anything loads or is written."""
    from .checkpoint.legacy_json import LEGACY_JSON_FILE

    out, model = args.out, args.model.resolve()
    if out.exists() and out.resolve() == model:
        problem = _unwritable(out)  # the scales are added in place
    elif out.exists() and any(out.iterdir()):
        problem = (f"{out} is not empty (give a new or empty directory, or the --model directory to add the scales "
                   "in place)")
    elif out.resolve().is_relative_to(model):
        problem = f"{out} is inside --model {args.model}: the copy would contain itself"
    else:  # the copy is made next to it, then renamed
        problem = _unwritable(next(p for p in out.absolute().parents if p.exists()))
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


def _calibration_batches(args: argparse.Namespace):
    """--data as [rows, length] token batches, read before the model loads."""
    from transformers import AutoConfig, AutoTokenizer

    from .calibration import make_batches, text_sequences, token_id_sequences

    if args.token_ids:
        with _blame("--model"):
            vocab_size = AutoConfig.from_pretrained(args.model).get_text_config(decoder=True).vocab_size
        with _blame("--data"):
            sequences = token_id_sequences(args.data, vocab_size)
    else:
        with _blame("--model"):
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.bos_token_id is not None and args.seq_len < 2:
            raise CommandError("argument --seq-len: must be at least 2: every sequence starts with the tokenizer's "
                               "BOS token", USAGE_ERROR)
        with _blame("--data"):
            sequences = text_sequences(args.data, tokenizer, args.seq_len)
    return make_batches(sequences, args.seq_len, args.batch_size, args.max_tokens)


def _calibrate(args: argparse.Namespace) -> int:
    """Calibrates a checkpoint's K/V scales on the user's data and writes them into a checkpoint."""
    _check_calibration_arguments(args)
    batches = _calibration_batches(args)

    import torch

    from .calibration import CalibrationError, calibrate_checkpoint

    blamed = {  # step of calibrate_checkpoint: the argument its errors are reported against, which errors
        "load": ("--model", (OSError, ValueError)),
        "observe": ("--model", (CalibrationError,)),  # layers whose attention never showed their K/V
        "scales": ("--data", (CalibrationError,)),  # NaN, inf or all-zero K/V
        "export": ("--out", (OSError, ValueError)),
        "legacy_json": ("--legacy-json", (OSError, ValueError)),
    }
    result = calibrate_checkpoint(
        args.model, batches, args.out, fmt=args.format, granularity=args.granularity, margin=args.margin,
        zero_amax=args.zero_amax, device=args.device or _default_device(),
        dtype="auto" if args.dtype == "auto" else getattr(torch, args.dtype), legacy_json=args.legacy_json,
        progress=not args.no_progress, around_step=lambda step: _blame(*blamed[step]))
    print(result.summary())
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from . import evaluate

    try:
        return evaluate.run(args)
    except (OSError, ValueError) as e:  # its bad arguments and files, each message naming the argument
        raise CommandError(_describe(e)) from e


# ----------------------------------------------------------------------------- parser and dispatch


def _parser(prog: str) -> argparse.ArgumentParser:
    from . import evaluate
    from .calibration import GRANULARITIES, ZERO_AMAX_POLICIES
    from .formats import KVCacheDtype

    parser = _Parser(prog=prog, description="FP8 KV cache for transformer inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    device_help = "cpu, cuda or cuda:N (default: cuda when available and fp8kv has its CUDA kernels, else cpu)"

    demo = commands.add_parser("demo", help="the same model with a bf16 and an FP8 KV cache: answers, perplexity, "
                               "memory, decode speed (the real SmolLM2 model where installed, else random weights)")
    demo.add_argument("--device", type=_device, help=device_help)
    demo.add_argument("--kv-cache-dtype", choices=[fmt.value for fmt in KVCacheDtype if fmt.is_fp8],
                      help="the FP8 format to compare with bf16 (default: float8_e4m3fn, or float8_e4m3fnuz on GPUs "
                      "whose FP8 is e4m3fnuz)")
    demo.add_argument("--random-weights", action="store_true",
                      help="run the small random-weight model even where the real model is installed")
    demo.add_argument("--threads", type=_positive_int, help="CPU threads (default: torch's for the real model; 1 "
                      "for the random-weight model, whose matmuls are too small to gain from more)")
    demo.add_argument("--new-tokens", type=_positive_int, default=48,
                      help="tokens generated per answer or sequence (default 48)")
    demo.add_argument("--batch-size", type=_positive_int,
                      help="random-weight demo: sequences (default 4)")
    demo.add_argument("--prompt-len", type=_positive_int,
                      help="random-weight demo: prompt tokens (default 64)")
    demo.set_defaults(run=_demo, parser=demo)

    inspect = commands.add_parser("inspect", help="show a checkpoint's KV cache scales and every problem with them")
    inspect.add_argument("checkpoint", help="local checkpoint directory (config.json + safetensors)")
    inspect.add_argument("--scales-json", help="a legacy kv_cache_scales.json outside the checkpoint")
    inspect.set_defaults(run=_inspect, parser=inspect)

    calib = commands.add_parser("calibrate", help="calibrate K/V cache scales on your data and write them into a "
                                "checkpoint")
    calib.add_argument("--model", required=True, type=_uncalibrated_checkpoint,
                       help="local checkpoint directory (transformers causal LM) without KV cache scales")
    calib.add_argument("--data", required=True, type=_input_file, help="text file (tokenized with the model's "
                       "tokenizer), or with --token-ids a file of whitespace-separated token ids, one sequence per "
                       "line")
    calib.add_argument("--out", required=True, type=_output_directory, help="new or empty directory for the "
                       "checkpoint with scales, or the --model directory itself to add the scales in place")
    calib.add_argument("--granularity", choices=GRANULARITIES, default="tensor",
                       help="one scale per layer (default), or one per KV head")
    calib.add_argument("--token-ids", action="store_true", help="--data holds token ids, not text")
    calib.add_argument("--seq-len", type=_positive_int, default=2048, help="tokens per sequence (default 2048)")
    calib.add_argument("--batch-size", type=_positive_int, default=1, help="sequences per forward pass (default 1)")
    calib.add_argument("--max-tokens", type=_positive_int, help="stop after this many tokens of --data")
    calib.add_argument("--format", choices=[fmt.value for fmt in KVCacheDtype if fmt.is_e4m3],
                       default=KVCacheDtype.E4M3FN.value, help="format the scales are for (default float8_e4m3fn; "
                       "e4m3fnuz caches double them on load, e5m2 caches use them as they are)")
    calib.add_argument("--margin", type=_margin, default=1.0,
                       help="scale = amax * margin / max_finite; a finite number >= 1 (default 1.0)")
    calib.add_argument("--zero-amax", choices=ZERO_AMAX_POLICIES, default="error",
                       help="an all-zero K/V head or layer: error (default), or scale 1.0 with a warning")
    calib.add_argument("--legacy-json", type=_output_file,
                       help="also write the legacy kv_cache_scales.json here (per tensor)")
    calib.add_argument("--device", type=_device, help=device_help)
    calib.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                       help="model dtype (default: the checkpoint's)")
    calib.add_argument("--no-progress", action="store_true", help="no progress bar")
    calib.set_defaults(run=_calibrate, parser=calib)

    evaluation = commands.add_parser("evaluate", help="score FP8 KV caches against the model's own attention on "
                                     "real text (perplexity, KL, top-1, per-layer error)")
    evaluate.add_arguments(evaluation)
    evaluation.set_defaults(run=_evaluate, parser=evaluation)
    return parser


def main(argv: list[str] | None = None, prog: str = "fp8kv") -> int:
    """Runs the command in `argv` (default: the process's arguments) and returns its exit status.

    prog: the program name the user typed, for messages. A user error prints one line on stderr
    and raises SystemExit: status 2 for a bad argument, 1 for a failed operation.
    """
    args = _parser(prog).parse_args(argv)
    try:
        return args.run(args)
    except CommandError as e:
        _fail(args.parser.prog, str(e), e.status)
    except ModuleNotFoundError as e:
        if e.name not in _OPTIONAL_PACKAGES:
            raise
        _fail(args.parser.prog, f"needs the {e.name} package: {_OPTIONAL_PACKAGES[e.name]}", FAILURE)
