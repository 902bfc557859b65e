"""A user error met while running a command, reported against the argument it concerns."""

from __future__ import annotations

import contextlib

USAGE_ERROR, FAILURE = 2, 1
INSTALL_HF = 'python3 -m pip install --no-build-isolation ".[hf]" in the source tree (README.md, Install)'


class CommandError(Exception):
    """A user error met while running a command; the message names the argument."""

    def __init__(self, message: str, status: int = FAILURE):
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def blame(argument: str, errors: tuple[type[Exception], ...] = (OSError, ValueError)):
    """Reports `errors` raised while using `argument`'s file or value as a CommandError naming it."""
    try:
        yield
    except errors as e:
        raise CommandError(f"argument {argument}: {describe(e)}") from e


def describe(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror and error.filename:
        return f"{error.filename}: {error.strerror}"
    return str(error)
