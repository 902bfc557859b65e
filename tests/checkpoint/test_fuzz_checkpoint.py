"""Seeded fuzzer of checkpoint reading: a small valid checkpoint (one file or shards with an index, with
or without KV cache scales) damaged one to three ways (cut short, grown, bytes overwritten in the
header or the data, a header entry's dtype, shape or offsets changed, an entry dropped, the header
length changed, a shard deleted), then read in a forked child with a time and memory limit
(checkpoints.run_in_child), which must:
- end, raising nothing but CheckpointError, in load_kv_cache_config, read_checkpoint_scales and
  check_tensor_files;
- report each problem once, naming a file of the checkpoint; read_checkpoint_scales (inspect) report
  exactly the problems load_kv_cache_config raises;
- accept a safetensors file exactly when safetensors' own loader opens it (the independent reference:
  safe_open validates the header against the file), and refuse the checkpoint (check_tensor_files)
  exactly when one of its weight files is refused or missing.

FP8KV_FUZZ_SECONDS sets the budget (default 20; at least MIN_CASES cases run); FP8KV_FUZZ_SEED=N runs that one
case in this process.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import struct
import time
import warnings

import pytest
import torch

from checkpoints import (compressed_tensors_config, edit_safetensors_header, llama_config, run_in_child,
                         scale_tensors, write_checkpoint)
from fp8kv.checkpoint import (CheckpointError, INDEX_FILE, load_kv_cache_config, read_checkpoint_scales,
                             read_safetensors_header)
from fp8kv.checkpoint.safetensors_layout import DTYPE_BITS
from fp8kv.checkpoint.tensor_files import check_tensor_files

LAYERS, HEADS = 2, 4
MIN_CASES = 100


def make_checkpoint(rng: random.Random, directory: pathlib.Path) -> None:
    shards = rng.choice((1, 1, 2, 3))
    tensors = config = None
    if rng.random() < 0.7:  # KV cache scales, per tensor or per KV head, declared or not
        width = rng.choice((1, HEADS))
        k, v = ([[rng.uniform(0.01, 2) for _ in range(width)] for _ in range(LAYERS)] for _ in "kv")
        tensors = scale_tensors(k, v)
        if rng.random() < 0.5:
            config = llama_config(LAYERS, HEADS, quantization_config=compressed_tensors_config(
                "tensor" if width == 1 else "attn_head"))
    write_checkpoint(directory, config=config, tensors=tensors, shards=shards, num_layers=LAYERS, num_kv_heads=HEADS)


# ----------------------------------------------------------------------------- damage


def header_bounds(path: pathlib.Path) -> tuple[int, int]:
    raw = path.read_bytes()
    return 8, 8 + struct.unpack("<Q", raw[:8])[0]


def cut(rng, path):
    os.truncate(path, rng.randrange(path.stat().st_size))


def grow(rng, path):
    with open(path, "ab") as f:
        f.write(rng.randbytes(rng.randint(1, 64)))


def overwrite(rng, path, start: int, end: int):
    raw = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 4)):
        if start < min(end, len(raw)):
            raw[rng.randrange(start, min(end, len(raw)))] = rng.randrange(256)
    path.write_bytes(bytes(raw))


def overwrite_header(rng, path):
    overwrite(rng, path, *header_bounds(path))


def overwrite_data(rng, path):
    overwrite(rng, path, header_bounds(path)[1], path.stat().st_size)


def set_header_length(rng, path):
    raw = bytearray(path.read_bytes())
    _, end = header_bounds(path)
    raw[:8] = struct.pack("<Q", rng.choice((end - 8 + rng.randint(-8, 8), rng.randrange(2**64), 0)) % 2**64)
    path.write_bytes(bytes(raw))


def _tensor_names(header: dict) -> list[str]:
    return sorted(name for name in header if name != "__metadata__")


def edit_entry(rng, path):
    def edit(header):
        names = _tensor_names(header)
        if not names:
            return
        entry = header[rng.choice(names)]
        field = rng.choice(("dtype", "shape", "data_offsets"))
        if field == "dtype":
            entry["dtype"] = rng.choice((*DTYPE_BITS, "F31", "f32", 4))
        elif field == "shape":
            entry["shape"] = rng.choice(([rng.randint(0, 20) for _ in range(rng.randint(0, 3))], [-1], [2**64], "x"))
        else:
            begin, end = entry["data_offsets"]
            shift = rng.choice((-4, -1, 1, 4, 10**6))
            entry["data_offsets"] = rng.choice(([begin + shift, end + shift], [begin, end + shift], [end, begin],
                                                [begin], [begin, end, end]))

    try:
        edit_safetensors_header(path, edit)
    except (ValueError, struct.error):  # an earlier change left no header to edit
        pass


def drop_entry(rng, path):
    def drop(header):
        names = _tensor_names(header)
        if names:
            del header[rng.choice(names)]

    try:
        edit_safetensors_header(path, drop)
    except (ValueError, struct.error):
        pass


def delete(rng, path):
    path.unlink()


DAMAGE = (cut, grow, overwrite_header, overwrite_data, set_header_length, edit_entry, drop_entry, delete)


def make_case(seed: int, directory: pathlib.Path) -> list[str]:
    """The checkpoint of case `seed` in `directory`; returns its damage, as text."""
    rng = random.Random(seed)
    make_checkpoint(rng, directory)
    changes = []
    for _ in range(rng.choice((0, 1, 1, 2, 3))):
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            break
        path, damage = rng.choice(files), rng.choice(DAMAGE)
        damage(rng, path)
        changes.append(f"{damage.__name__}({path.name})")
    return changes


# ----------------------------------------------------------------------------- judging


def safetensors_opens(path: pathlib.Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
        return True
    except Exception:  # noqa: BLE001 - its own error types: refused
        return False


def weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files a loader reads: the index's shards where there is one, else every *.safetensors file."""
    index = directory / INDEX_FILE
    if index.exists():
        return sorted({directory / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    return sorted(directory.glob("*.safetensors"))


def problems_of(call) -> tuple[list[str] | None, str | None]:
    """(the problems of the CheckpointError `call()` raised, or None), or a failure for any other outcome."""
    try:
        call()
    except CheckpointError as e:
        return [str(p) for p in e.problems], None
    except Exception as e:  # noqa: BLE001 - the failure judged here
        return None, f"{call.__name__}: {type(e).__name__}: {e}"
    return None, None


def judge(directory: pathlib.Path) -> list[str]:
    """What is wrong with how the checkpoint in `directory` is read (empty: nothing)."""
    failures = []

    def load():
        with warnings.catch_warnings():  # a checkpoint without scales: unit scales, and a warning saying so
            warnings.simplefilter("ignore")
            load_kv_cache_config(directory, "fp8_e4m3fn", rotation="none")

    def check():
        check_tensor_files(directory)

    raised, failure = problems_of(load)
    failures += [failure] if failure else []
    try:
        reported = [str(p) for p in read_checkpoint_scales(directory).problems]
    except Exception as e:  # noqa: BLE001
        return failures + [f"read_checkpoint_scales: {type(e).__name__}: {e}"]
    if raised is not None and reported != raised:
        failures.append(f"inspect reports {reported}, the loader raises {raised}")
    if len(set(reported)) != len(reported):
        failures.append(f"a problem reported twice: {reported}")
    failures += [f"names no file of the checkpoint: {p}" for p in reported if not p.startswith(str(directory))]

    for path in sorted(directory.glob("*.safetensors")):
        def header(path=path):
            read_safetensors_header(path)

        refused, failure = problems_of(header)
        failures += [failure] if failure else []
        if (refused is None) != safetensors_opens(path):
            failures.append(f"{path.name}: safetensors {'refuses' if refused is None else 'opens'} it, fp8kv "
                            f"{'accepts' if refused is None else 'refuses'} it: {refused}")
        elif refused and not set(refused) <= set(reported):
            failures.append(f"{path.name}: inspect does not report its problem {refused}: {reported}")
    refused, failure = problems_of(check)
    failures += [failure] if failure else []
    damaged = [path for path in weight_files(directory) if not (path.exists() and safetensors_opens(path))]
    if bool(damaged) != (refused is not None):
        failures.append(f"check_tensor_files {'refuses' if refused else 'accepts'} the checkpoint with damaged or "
                        f"missing weight files {[p.name for p in damaged]}: {refused}")
    return failures


# ----------------------------------------------------------------------------- the campaign


def run_case(seed: int, directory: pathlib.Path) -> dict:
    changes = make_case(seed, directory)
    kind, result = run_in_child(judge, directory)
    failures = result if kind == "returned" else [f"the judge raised {kind}: {result}"]
    return {"seed": seed, "changes": changes, "failures": failures}


def test_damaged_checkpoints_are_refused_as_safetensors_refuses_them_and_reported_once(tmp_path):
    torch.set_num_threads(1)
    if os.environ.get("FP8KV_FUZZ_SEED"):
        seed = int(os.environ["FP8KV_FUZZ_SEED"])
        make_case(seed, tmp_path)
        assert judge(tmp_path) == []
        return
    stop = time.monotonic() + float(os.environ.get("FP8KV_FUZZ_SECONDS", "20"))
    results, seed = [], 0
    while time.monotonic() < stop or seed < MIN_CASES:  # the first MIN_CASES seeds on any machine
        results.append(run_case(seed, tmp_path / str(seed)))
        seed += 1
    failed = [r for r in results if r["failures"]]
    reproduce = "reproduce one with: FP8KV_FUZZ_SEED=N python -m pytest -q tests/checkpoint/test_fuzz_checkpoint.py"
    assert not failed, f"{len(failed)} of {len(results)} cases failed; {reproduce}\n" + "\n".join(
        json.dumps(r) for r in failed[:10])
    damaged = sum(bool(r["changes"]) for r in results[:MIN_CASES])  # fixed by the seeds
    assert damaged >= MIN_CASES // 2 and MIN_CASES - damaged >= MIN_CASES // 10, damaged
