"""Reading a checkpoint's files, bounded: checkpoints come from untrusted sources.

Regular files only (a FIFO or device is an error, not a hang), JSON files and safetensors headers
up to MAX_JSON_BYTES, JSON objects without repeated keys; every problem names the file.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .. import commit
from .problems import CheckpointError, Fatal, Problem
from .safetensors_layout import layout_problem
from .values import show

# Far above any real checkpoint's JSON files (a few MiB); keeps a hostile one from exhausting memory.
MAX_JSON_BYTES = 64 << 20  # a JSON file, or the JSON header of a safetensors file


class SafetensorsHeader(NamedTuple):
    """The JSON header of a safetensors file and where its tensor data lies."""

    entries: dict  # tensor name -> {"dtype", "shape", "data_offsets"}, and "__metadata__" if present
    data_start: int  # the file offset of the tensor data
    data_size: int  # bytes from data_start to the end of the file


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of safetensors file `path`, read as the loader reads it: a regular file (symlinks
    followed), a header length within the file and MAX_JSON_BYTES, a JSON object without repeated
    keys whose tensors fill the rest of the file (safetensors_layout). Raises CheckpointError naming
    the file."""
    return _read_file(path, Reader.safetensors_header)


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object of file `path`, read as the loader reads a checkpoint's JSON files: a regular
    file (symlinks followed) of at most MAX_JSON_BYTES, without repeated keys. Raises
    CheckpointError naming the file."""
    return _read_file(path, Reader.json_object)


def _read_file(path: str | os.PathLike, read: Callable):
    path = pathlib.Path(path)
    reader = Reader(path.parent)
    try:
        return read(reader, path)
    except Fatal:
        raise CheckpointError(reader.problems) from None


@dataclass
class Reader:
    """Accumulates problems while reading; each check records and moves on where it can.

    Every file is read through here: regular files only (symlinks followed), never more than
    MAX_JSON_BYTES of JSON, so no checkpoint can make the loader block or read without end.
    """

    directory: pathlib.Path
    problems: list[Problem] = field(default_factory=list)
    # File name -> the file to read for it, for the files a committed export's journal lists.
    committed: dict[str, pathlib.Path] = field(default_factory=dict)
    # safetensors file -> its tensor names (a dict for ordered, constant-time lookup); None: unreadable.
    _names: dict[pathlib.Path, dict[str, None] | None] = field(default_factory=dict)
    # Whether a safetensors file could not be read (damaged, or a shard missing; its problem recorded):
    # a tensor not found may be in it, which is then no problem of its own.
    tensor_file_unread: bool = False

    def path(self, name: str) -> pathlib.Path:
        """The file to read for the directory's file `name`."""
        return self.committed.get(name, self.directory / name)

    def problem(self, file, tensor, message) -> None:
        self.problems.append(Problem(str(file), tensor, message))

    def fatal(self, file, tensor, message) -> Fatal:
        self.problem(file, tensor, message)
        return Fatal()

    def read(self, path: pathlib.Path, offset: int, count: int) -> tuple[bytes, int]:
        """Up to `count` bytes of regular file `path` from `offset`, and the file's size."""
        why = not_regular(path)
        if why:
            raise self.fatal(path, None, why)
        try:
            # O_NONBLOCK: a file replaced by a FIFO after the check above must not block the open.
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                f.seek(offset)
                return f.read(count) or b"", os.fstat(f.fileno()).st_size
        except OSError as e:
            raise self.fatal(path, None, f"cannot read: {e.strerror or e}") from None

    def json_object(self, path: pathlib.Path) -> dict:
        raw, _ = self.read(path, 0, MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise self.fatal(path, None, f"larger than {_mib(MAX_JSON_BYTES)} (MAX_JSON_BYTES): not a checkpoint file")
        return self.parse_json_object(path, raw)

    def parse_json_object(self, path: pathlib.Path, raw: bytes) -> dict:
        try:
            data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
        except UnicodeDecodeError as e:
            raise self.fatal(path, None, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
        except _DuplicateKey as e:
            raise self.fatal(path, None, f"duplicate key {show(e.key)} in a JSON object") from None
        except RecursionError:
            raise self.fatal(path, None, "invalid JSON: nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, or an integer with too many digits to convert
            raise self.fatal(path, None, f"invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise self.fatal(path, None, f"must hold a JSON object, got {type(data).__name__}")
        return data

    def tensor_names(self, path: pathlib.Path) -> dict[str, None] | None:
        """The tensor names in the header of safetensors file `path` (read once); None if unreadable."""
        if path not in self._names:
            try:
                entries = self.safetensors_header(path).entries
                self._names[path] = dict.fromkeys(n for n in entries if n != "__metadata__")
            except Fatal:
                self._names[path] = None
                self.tensor_file_unread = True
        return self._names[path]

    def safetensors_header(self, path: pathlib.Path) -> SafetensorsHeader:
        # Layout: an 8-byte little-endian header length, the JSON header, then the tensor data.
        length_bytes, size = self.read(path, 0, 8)
        if len(length_bytes) < 8:
            raise self.fatal(path, None, f"cannot read safetensors file: {size} bytes, shorter than the header length")
        length = int.from_bytes(length_bytes, "little")
        if length > size - 8:
            raise self.fatal(path, None, f"cannot read safetensors file: header length {length} exceeds the file "
                             f"({size} bytes)")
        if length > MAX_JSON_BYTES:
            raise self.fatal(path, None, f"cannot read safetensors file: header length {length} exceeds "
                             f"{_mib(MAX_JSON_BYTES)} (MAX_JSON_BYTES)")
        header = SafetensorsHeader(self.parse_json_object(path, self.read(path, 8, length)[0]), 8 + length,
                                   size - 8 - length)
        problem = layout_problem(*header)
        if problem:
            raise self.fatal(path, *problem)
        return header


def open_directory(reader: Reader) -> None:
    """Checks that the reader's directory is a directory and reads its commit journal, if any."""
    if not reader.directory.is_dir():
        exists = os.path.lexists(reader.directory)
        raise reader.fatal(reader.directory, None, "is not a checkpoint directory" if exists else "does not exist")
    try:
        reader.committed = commit.committed_files(reader.directory) or {}
    except commit.JournalError as e:
        raise reader.fatal(e.path, None, e.reason) from None


def checked(reader: Reader, read):
    """read(reader) on a checkpoint directory, raising CheckpointError for the problems it records."""
    result = None
    try:
        open_directory(reader)
        result = read(reader)
    except Fatal:
        pass
    if reader.problems:
        raise CheckpointError(reader.problems)
    return result


def not_regular(path: pathlib.Path) -> str | None:
    """Why `path` cannot be read as a regular file (after symlinks), or None when it can."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        return f"cannot be read: {getattr(e, 'strerror', None) or e}"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "a special file")
    return f"is {kind}, expected a regular file"


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json object_pairs_hook: a dict, refusing repeated keys (json.loads would keep the last)."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"
