"""All-or-nothing writes into a directory: several new or replaced files appear together or not at all.

`replace_files(directory, writers)` commits in three steps:
1. Each file is written under a temporary name in the same directory, `<name>.fp8kv-tmp-<16 hex>`
   (created exclusively, so no existing file is ever overwritten, and named so that no reader of
   checkpoints reads it), given the mode of the file it replaces (a new file keeps the mode open()
   gives under the umask), and fsynced.
2. Commit point: a journal listing the temporaries is written the same way and renamed to
   `.fp8kv-commit.json`; the directory is fsynced. A failure before this rename removes the
   temporaries and leaves the directory as it was.
3. The temporaries are renamed to their names in the writers' order, the directory is fsynced and
   the journal removed.
A single file needs no journal: its rename is the commit point.

A writer killed in steps 1-2 leaves temporaries, one killed in step 3 a journal: `recover`, which
the next export runs first, rolls a journal forward (the renames not yet done) and then removes
every other temporary (the journal proves which ones were committed). `committed_files` tells a
reader which files a journal makes new, so it can read the new checkpoint before the renames
(fp8kv.checkpoint does).
Writers hold `locked(directory)`, so two exports never interleave.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pathlib
import re
import secrets
import shutil
import stat
from typing import Callable

TEMPORARY_MARKER = ".fp8kv-tmp-"
JOURNAL = ".fp8kv-commit.json"
_TEMPORARY = re.compile(r"(.+)\.fp8kv-tmp-[0-9a-f]{16}")
_JOURNAL_LIMIT = 1 << 20  # bytes; a journal names a handful of files

Writer = Callable[[pathlib.Path], None]  # fills the (empty, existing) file at the path it is given


class JournalError(ValueError):
    """A file at the journal's path that is not fp8kv's journal, or cannot be read: `path`, `reason`."""

    def __init__(self, path: pathlib.Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def temporary_name(name: str) -> str:
    return f"{name}{TEMPORARY_MARKER}{secrets.token_hex(8)}"


@contextlib.contextmanager
def locked(directory: pathlib.Path, *, shared: bool = False):
    """Holds an flock on `directory` (shared: for an export that only reads it); an export already
    holding it makes this raise at once instead of interleaving."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OSError(errno.EBUSY, f"another fp8kv export is using {directory}; wait for it to finish") from None
        except OSError as e:
            # A file system without flock (some network file systems) gets no guard against a
            # concurrent export; each export on its own is still all-or-nothing.
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF):
                raise
        yield
    finally:
        os.close(fd)


def replace_files(directory: pathlib.Path, writers: dict[str, Writer]) -> None:
    """Writes every file of `writers` ({name: writer}) into `directory`, all or none (see the module)."""
    temporaries: dict[str, pathlib.Path] = {}
    journal = None
    try:
        for name, write in writers.items():
            temporaries[name] = _write_temporary(directory, name, write)
        if len(temporaries) == 1:
            (name, temporary), = temporaries.items()
            os.replace(temporary, directory / name)  # the commit point
            _fsync(directory)
            return
        listing = {"files": {name: temporary.name for name, temporary in temporaries.items()}}
        journal = _write_temporary(directory, JOURNAL, json_writer(listing))
        os.rename(journal, directory / JOURNAL)  # the commit point
    except BaseException:
        for temporary in (*temporaries.values(), journal):
            if temporary is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary)
        raise
    try:
        _roll_forward(directory, temporaries)
    except OSError as e:
        raise OSError(e.errno, f"the export into {directory} is committed but could not be finished ({e}); "
                               "run it again to finish it") from e


def recover(directory: pathlib.Path) -> None:
    """Finishes an export into `directory` that a journal shows committed, then removes the
    temporaries of exports killed before their commit point."""
    committed = committed_files(directory)
    if committed is not None:
        _roll_forward(directory, {name: path for name, path in committed.items() if path.name != name})
    remove_temporaries(directory)


def remove_temporaries(directory: pathlib.Path, name: str | None = None) -> None:
    """Removes the temporary files in `directory` (those standing for `name` only, if given)."""
    for entry in _temporaries(directory, name):
        if entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)


def committed_files(directory: pathlib.Path) -> dict[str, pathlib.Path] | None:
    """{name: the file to read for it} for the files a committed export's journal makes new (the
    temporary until it is renamed, then the file itself); None when `directory` has no journal.
    Raises JournalError for a journal that is not fp8kv's (never touched) or cannot be read."""
    path = directory / JOURNAL
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise JournalError(path, f"cannot read the commit journal: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory
        os.close(fd)
        raise JournalError(path, "is not a regular file, so not an fp8kv commit journal; move it away")
    with os.fdopen(fd, "rb") as f:
        try:
            content = f.read(_JOURNAL_LIMIT + 1)
        except OSError as e:
            raise JournalError(path, f"cannot read the commit journal: {e.strerror}") from None
    try:
        files = json.loads(content)["files"]
        valid = len(content) <= _JOURNAL_LIMIT and all(
            isinstance(name, str) and _is_file_name(name) and _TEMPORARY.fullmatch(temporary)
            and _TEMPORARY.fullmatch(temporary).group(1) == name for name, temporary in files.items())
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        valid = False
    if not valid:
        raise JournalError(path, f"not an fp8kv commit journal (an object 'files' of name: '<name>"
                                 f"{TEMPORARY_MARKER}<16 hex>'); fp8kv leaves it alone: move it away")
    return {name: directory / (temporary if os.path.lexists(directory / temporary) else name)
            for name, temporary in files.items()}


@contextlib.contextmanager
def new_directory(out: pathlib.Path):
    """Yields an empty temporary sibling of `out` to fill; it is fsynced and renamed to `out` (absent
    or an empty directory) when the block succeeds, and removed when it fails. Temporary siblings of
    `out` left by a killed run are removed first."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    for entry in _temporaries(parent, out.name):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
    stage = parent / temporary_name(out.name)
    os.mkdir(stage)
    try:
        yield stage
        for root, dirs, files in os.walk(stage):
            for name in files:
                _fsync(pathlib.Path(root, name))
            _fsync(pathlib.Path(root))
        os.rename(stage, out)  # the commit point
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _fsync(parent)


def is_temporary(name: str) -> bool:
    return _TEMPORARY.fullmatch(name) is not None


def _temporaries(directory: pathlib.Path, name: str | None):
    """The entries of `directory` named as temporaries (of `name` only, if given)."""
    for entry in os.scandir(directory):
        match = _TEMPORARY.fullmatch(entry.name)
        if match and name in (None, match.group(1)):
            yield entry


def _write_temporary(directory: pathlib.Path, name: str, write: Writer) -> pathlib.Path:
    path = directory / temporary_name(name)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # 0o666: the umask applies, as for open()
    try:
        replaced = directory / name
        mode = stat.S_IMODE(os.stat(replaced if os.path.exists(replaced) else path).st_mode)
        write(path)
        os.chmod(path, mode)
        _fsync(path)
    except BaseException:
        os.unlink(path)
        raise
    return path


def _roll_forward(directory: pathlib.Path, temporaries: dict[str, pathlib.Path]) -> None:
    for name, temporary in temporaries.items():
        os.replace(temporary, directory / name)
    _fsync(directory)
    os.unlink(directory / JOURNAL)


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_writer(data: dict) -> Writer:
    """A writer of `data` as indented JSON."""
    return lambda path: path.write_text(json.dumps(data, indent=2) + "\n")


def _is_file_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name
