"""Which safetensors file of a checkpoint holds which tensor: from model.safetensors.index.json
when there is one (shard paths inside the directory), else from the headers of its files."""

from __future__ import annotations

import os
import pathlib

from .files import Reader, checked, not_regular
from .values import show

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_tensor_names(directory: str | os.PathLike) -> dict[str, pathlib.Path]:
    """Every tensor name of checkpoint `directory` -> the safetensors file that holds it.

    From model.safetensors.index.json when there is one (its shard files must be regular files
    inside the directory), else from the headers of the directory's *.safetensors files. Every
    file's header is read and must describe the file (a truncated or corrupt file is a problem).
    Reads only regular files, each JSON part at most MAX_JSON_BYTES. A file that a committed export's
    journal lists is the one the journal names (see fp8kv.checkpoint). Raises CheckpointError
    naming the file (and tensor) of every problem.
    """
    return checked(Reader(pathlib.Path(directory)), locate_tensors)


def check_tensor_files(directory: str | os.PathLike) -> None:
    """Raises CheckpointError naming every damaged safetensors file of checkpoint `directory` (truncated,
    corrupt, a header that does not describe the file) and every missing or misplaced shard of its
    index, read as checkpoint_tensor_names reads them; a checkpoint of pickled weights only passes."""
    checked(Reader(pathlib.Path(directory)), lambda reader: locate_tensors(reader, pickled_ok=True))


def locate_tensors(reader: Reader, *, pickled_ok: bool = False) -> dict[str, pathlib.Path]:
    """Every tensor name -> its file; pickled_ok: a directory of pickled weights only is no problem."""
    index_path = reader.path(INDEX_FILE)
    if os.path.lexists(index_path):
        return _indexed_tensors(reader, index_path)
    entries = directory_files(reader)
    files = [path for name, path in entries.items() if name.endswith(".safetensors")]
    if not files and not pickled_ok:
        pickled = [name for name in entries if pathlib.PurePath(name).suffix in (".bin", ".pt", ".pth")]
        if pickled:
            reader.problem(reader.directory, None, f"holds only pickled weights ({', '.join(pickled)}); "
                           "fp8kv reads KV cache scales from safetensors files only")
    located = {}
    for path in files:
        for name in reader.tensor_names(path) or ():
            if name in located:
                reader.problem(path, name, f"also stored in {located[name].name}; conflicting copies")
                continue
            located[name] = path
    return located


def directory_files(reader: Reader) -> dict[str, pathlib.Path]:
    """{name: the file to read} for the directory's entries and the files a committed export adds, by name."""
    try:
        names = {path.name for path in reader.directory.iterdir()}
    except OSError as e:
        raise reader.fatal(reader.directory, None, f"cannot list the directory: {e.strerror or e}") from None
    return {name: reader.path(name) for name in sorted(names | reader.committed.keys())}


def _indexed_tensors(reader: Reader, index_path: pathlib.Path) -> dict[str, pathlib.Path]:
    """The index's weight_map with each shard checked once, its header included (entries naming a bad
    shard are left out)."""
    weight_map = reader.json_object(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise reader.fatal(index_path, "weight_map", "missing or not an object")
    shards: dict[str, pathlib.Path | None] = {}
    located = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            reader.problem(index_path, name, f"maps to {show(shard)}; expected a shard file name")
            continue
        if shard not in shards:
            shards[shard] = _shard_path(reader, index_path, name, shard)
        if shards[shard] is not None:
            located[name] = shards[shard]
    return located


def _shard_path(reader: Reader, index_path: pathlib.Path, name: str, shard: str) -> pathlib.Path | None:
    """The file an index entry names, if it is a regular file inside the checkpoint directory.

    The folder holding it must resolve inside the directory; the file itself may be a symlink to
    anywhere (the Hugging Face cache links every file of a snapshot to a blob outside it).
    """
    path = reader.directory / shard
    if path.parent == reader.directory:
        path = reader.path(path.name)
    try:
        inside = path.parent.resolve().is_relative_to(reader.directory.resolve())
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        inside = False
    why = not_regular(path) if inside else "lies outside the checkpoint directory"
    if why:
        reader.problem(index_path, name, f"maps to shard {show(shard)}, which {why}")
        reader.tensor_file_unread = True
        return None
    return path if reader.tensor_names(path) is not None else None  # a damaged shard: its problem is recorded

