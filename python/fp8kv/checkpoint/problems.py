"""What is wrong with a checkpoint: a `Problem` each, raised together as a `CheckpointError`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint: the file, the tensor or field (if any), and what."""

    file: str
    tensor: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.tensor}: {self.message}" if self.tensor else f"{self.file}: {self.message}"


class CheckpointError(ValueError):
    """A checkpoint's files are damaged, or its KV cache scales missing, malformed or inconsistent.

    One problem is one line (the file, what is wrong); several are a list, one line each."""

    def __init__(self, problems):
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            super().__init__(str(self.problems[0]))
            return
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid KV cache scales ({len(self.problems)} problem(s)):\n{lines}")


class Fatal(Exception):
    """Reading cannot continue past this problem."""
