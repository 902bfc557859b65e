"""Command line: `fp8kv demo | inspect | calibrate | evaluate | serve`, also run as `python -m fp8kv`.

Assembles the commands of fp8kv.commands (each declares its arguments and runs) and reports
their errors. Every argument is checked when it is parsed (argparse `type=` functions), and
arguments that depend on each other before any model loads. A user error (a bad value, a missing
or malformed file, a broken checkpoint, a missing optional package) prints
`PROG COMMAND: error: argument ARG: what is wrong` on stderr and exits with status 2 (a bad argument)
or 1 (an operation failed on the user's files or data), never with a traceback.
"""

from __future__ import annotations

import argparse
import sys

from .commands.errors import FAILURE, INSTALL_HF, USAGE_ERROR, CommandError

# Optional packages a command may need, and how to get them.
_OPTIONAL_PACKAGES = {"transformers": f"install fp8kv with its [hf] extra: {INSTALL_HF}"}


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


def _parser(prog: str) -> argparse.ArgumentParser:
    from .commands import calibrate, demo, evaluate, inspect, serve

    parser = _Parser(prog=prog, description="FP8 KV cache for transformer inference.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in (demo, inspect, calibrate, evaluate, serve):
        name = command.__name__.rpartition(".")[2]  # a command's module is named after it
        subparser = subparsers.add_parser(name, help=command.HELP)
        command.add_arguments(subparser)
        subparser.set_defaults(run=command.run, parser=subparser)
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
