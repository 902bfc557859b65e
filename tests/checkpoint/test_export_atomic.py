"""Checkpoint export is all-or-nothing: an export killed (or failing) at any file-system operation
leaves the old checkpoint or the new one, and running it again finishes it; file modes are kept;
copies never leave a partial directory; user files are never overwritten or deleted.

An export is killed by running it in a forked child whose file-system calls are counted: the n-th
call (open for writing, fsync, rename, unlink, chmod, mkdir, rmdir) exits the
child instead of running, for every n until the export completes.
"""

import builtins
import contextlib
import errno
import io
import json
import os
import pathlib
import re
import shutil
import stat
import time
import traceback
import warnings

import pytest
from safetensors import safe_open

from checkpoints import random_amax, source_checkpoint
from fp8kv import commit
from fp8kv.calibration import export_checkpoint, export_legacy_json
from fp8kv.checkpoint import CheckpointError, checkpoint_tensor_names, load_kv_cache_config, read_checkpoint_scales
from fp8kv.formats import KVCacheDtype

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

JOURNAL = ".fp8kv-commit.json"  # the commit point's name, as the protocol documents it
TEMPORARY = re.compile(r"\.fp8kv-tmp-[0-9a-f]{16}")  # the suffix of a temporary's name, as documented
KILLED = 75


# ----------------------------------------------------------------------------- counting file operations


def _writes(*args, **kwargs) -> bool:
    mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
    return any(c in mode for c in "wax+")


# (module, function, which calls count): every call an export makes that changes the file system.
FILE_OPERATIONS = [
    (os, "open", lambda path, flags, *args, **kwargs: bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))),
    (builtins, "open", _writes),
    (io, "open", _writes),
    *((os, name, None) for name in ("replace", "rename", "fsync", "unlink", "chmod", "mkdir", "rmdir")),
]


@contextlib.contextmanager
def interrupted_at(n: int, interrupt):
    """Makes the n-th file-system operation (from 1) call `interrupt()` instead of running."""
    count = 0

    def counting(function, counts):
        def call(*args, **kwargs):
            nonlocal count
            if counts is None or counts(*args, **kwargs):
                count += 1
                if count == n:
                    interrupt()
            return function(*args, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as patch:
        for owner, name, counts in FILE_OPERATIONS:
            patch.setattr(owner, name, counting(getattr(owner, name), counts))
        yield


def killed_at(n: int, export) -> bool:
    """Runs `export()` in a forked child killed at its n-th file-system operation; True when the
    export completed before that."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with interrupted_at(n, lambda: os._exit(KILLED)):
                export()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the export killed at operation {n} hung")
        time.sleep(0.005)
    code = os.waitstatus_to_exitcode(status[1])
    assert code in (0, KILLED), f"the export killed at operation {n} failed instead (exit code {code})"
    return code == 0


# ----------------------------------------------------------------------------- what a checkpoint reads as


def reading(directory: pathlib.Path, fmt: KVCacheDtype) -> dict:
    """Everything fp8kv's loader makes of `directory` (paths relative to it; a committed export's
    temporaries by the names they stand for), and its config.json as a committed journal makes it."""
    strip = lambda text: TEMPORARY.sub("", str(text).replace(str(directory), "<dir>"))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unit-scale warning of a checkpoint without scales
        try:
            loaded = load_kv_cache_config(directory, fmt, rotation="none")
            loaded = (loaded.dtype, loaded.k_scales, loaded.v_scales)
        except CheckpointError as e:
            loaded = strip(e)
    found = read_checkpoint_scales(directory)
    tensors = {}
    for name, path in checkpoint_tensor_names(directory).items():
        with safe_open(str(path), framework="pt") as f:
            tensors[name] = (strip(path.name), f.get_tensor(name).tolist())
    return dict(loaded=loaded, declared=found.declared, forms=found.forms, calibrated_for=found.calibrated_for,
                scales=[(strip(pathlib.Path(s.file).name), s.tensor, s.values) for s in (*found.k, *found.v)],
                problems=[strip(p) for p in found.problems], tensors=tensors,
                config=json.loads(committed_file(directory, "config.json").read_text()))


def listing(directory: pathlib.Path) -> dict[str, tuple]:
    """{file name: (mode, content)}; a safetensors file's content is its metadata and tensors (its
    header's key order is not deterministic)."""
    return {p.name: (stat.S_IMODE(p.stat().st_mode), safetensors_content(p) if p.suffix == ".safetensors"
                     else p.read_bytes()) for p in sorted(directory.iterdir())}


def safetensors_content(path: pathlib.Path) -> tuple:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {name: f.get_tensor(name).tolist() for name in sorted(f.keys())}


def journal_files(directory: pathlib.Path) -> dict[str, str]:
    """{name: temporary} of `directory`'s commit journal ({} without one), read as the protocol documents it."""
    journal = directory / JOURNAL
    return json.loads(journal.read_text())["files"] if journal.exists() else {}


def committed_file(directory: pathlib.Path, name: str) -> pathlib.Path:
    """The file holding what the directory's `name` is: a committed journal's temporary until it is renamed."""
    temporary = directory / journal_files(directory).get(name, name)
    return temporary if temporary.exists() else directory / name


CASES = [("single", KVCacheDtype.E4M3FNUZ, 4), ("single", KVCacheDtype.E4M3FN, 1),
         ("sharded", KVCacheDtype.E4M3FNUZ, 4), ("sharded", KVCacheDtype.E4M3FN, 1)]


def prepared(tmp_path, layout: str, fmt: KVCacheDtype, width: int):
    """(pristine source, scales, old reading, new reading, new listing)."""
    pristine = source_checkpoint(tmp_path / "pristine", layout=layout)
    scales = random_amax(2, width).scales(fmt)
    done = tmp_path / "done"
    shutil.copytree(pristine, done)
    export_checkpoint(done, done, scales)
    return pristine, scales, reading(pristine, fmt), reading(done, fmt), listing(done)


def fresh_copy(pristine: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work)
    return work


# ----------------------------------------------------------------------------- in place


@pytest.mark.parametrize("layout,fmt,width", CASES)
def test_in_place_export_killed_anywhere_reads_old_or_new_and_a_rerun_finishes(tmp_path, layout, fmt, width):
    pristine, scales, old, new, new_listing = prepared(tmp_path, layout, fmt, width)
    assert old != new and old["scales"] == [] and old["problems"] == new["problems"] == []
    work = tmp_path / "work"
    outcomes = []
    for n in range(1, 100):
        fresh_copy(pristine, work)
        if killed_at(n, lambda: export_checkpoint(work, work, scales)):
            break
        state = reading(work, fmt)  # through the loader, as any reader of the checkpoint sees it
        assert state in (old, new), n
        outcomes.append(("new" if state == new else "old", (work / JOURNAL).exists()))
        assert export_checkpoint(work, work, scales) == work  # the re-run finishes
        assert reading(work, fmt) == new and listing(work) == new_listing, n
    else:
        pytest.fail("the export never completed")
    assert reading(work, fmt) == new and listing(work) == new_listing
    # Old before the commit point, new with a journal after it (its removal is the last operation).
    before, after = outcomes.count(("old", False)), outcomes.count(("new", True))
    assert outcomes == [("old", False)] * before + [("new", True)] * after and before >= 6 and after >= 3


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_loader_reads_a_committed_export_as_new_where_its_files_alone_are_neither(tmp_path, layout):
    pristine, scales, old, new, _ = prepared(tmp_path, layout, KVCacheDtype.E4M3FNUZ, 4)
    work = tmp_path / "work"
    for n in range(1, 100):
        fresh_copy(pristine, work)
        assert not killed_at(n, lambda: export_checkpoint(work, work, scales))
        renamed = [name for name, temporary in journal_files(work).items() if not (work / temporary).exists()]
        if len(renamed) == 1:
            break  # killed after the first rename
    else:
        pytest.fail("no kill point after the first rename")
    assert reading(work, KVCacheDtype.E4M3FNUZ) == new
    # The directory's files alone mix the old and new checkpoints (the renamed file is new, the
    # others old): only the journal makes it read as new.
    alone = shutil.copytree(work, tmp_path / "alone")
    os.unlink(alone / JOURNAL)
    assert reading(alone, KVCacheDtype.E4M3FNUZ) not in (old, new)


@pytest.mark.parametrize("layout,fmt,width", CASES[:1] + CASES[2:3])
def test_in_place_export_failing_anywhere_leaves_no_trace_or_is_finished_by_a_rerun(tmp_path, layout, fmt, width):
    pristine, scales, old, new, new_listing = prepared(tmp_path, layout, fmt, width)
    work, old_listing = tmp_path / "work", listing(pristine)

    def fail():
        raise OSError(errno.EIO, "injected")

    for n in range(1, 100):
        fresh_copy(pristine, work)
        try:
            with interrupted_at(n, fail):
                export_checkpoint(work, work, scales)
            break
        except OSError as e:
            if (work / JOURNAL).exists():
                assert "is committed but could not be finished" in str(e) and "run it again" in str(e)
            else:  # every temporary removed: exactly the old files
                assert str(e).endswith("injected") and listing(work) == old_listing, n
        export_checkpoint(work, work, scales)
        assert reading(work, fmt) == new and listing(work) == new_listing, n
    else:
        pytest.fail("the export never completed")
    assert listing(work) == new_listing


def test_stale_temporaries_and_a_committed_journal_are_dealt_with_by_the_next_export(tmp_path):
    pristine, scales, old, new, new_listing = prepared(tmp_path, "sharded", KVCacheDtype.E4M3FN, 1)
    work = fresh_copy(pristine, tmp_path / "work")
    stale = work / "config.json.fp8kv-tmp-0123456789abcdef"
    stale.write_text("{half")
    export_checkpoint(work, work, scales)
    assert listing(work) == new_listing

    # A journal whose renames are all done (killed before removing it) is removed.
    for n in range(1, 100):
        fresh_copy(pristine, work)
        assert not killed_at(n, lambda: export_checkpoint(work, work, scales))
        if (work / JOURNAL).exists() and not any(".fp8kv-tmp-" in p.name for p in work.iterdir()):
            break  # every rename done, the journal not yet removed
    export_checkpoint(work, work, scales)
    assert listing(work) == new_listing


def test_a_journal_that_is_not_fp8kvs_is_refused_and_kept(tmp_path):
    work = source_checkpoint(tmp_path / "work", layout="single")
    expected = f"{work / JOURNAL}: not an fp8kv commit journal"
    for content in ('{"files": {"config.json": "/etc/passwd"}}', "[]",
                    '{"files": {"../x": "../x.fp8kv-tmp-0123456789abcdef"}}'):
        (work / JOURNAL).write_text(content)
        before = listing(work)
        with pytest.raises(ValueError, match=re.escape(expected)):
            export_checkpoint(work, work, random_amax(2, 1).scales())
        # The loader cannot tell which files to read: an error naming the journal.
        for read in (lambda: load_kv_cache_config(work, "fp8_e4m3fn", rotation="none"), lambda: load_kv_cache_config(work, "auto"),
                     lambda: checkpoint_tensor_names(work)):
            with pytest.raises(CheckpointError) as error:
                read()
            assert [str(p) for p in error.value.problems] == [str(p) for p in read_checkpoint_scales(work).problems]
            assert len(error.value.problems) == 1 and str(error.value.problems[0]).startswith(expected)
        assert listing(work) == before
    os.unlink(work / JOURNAL)
    (work / JOURNAL).mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{work / JOURNAL}: is not a regular file")):
        export_checkpoint(work, work, random_amax(2, 1).scales())
    assert (work / JOURNAL).is_dir()


def test_exporting_the_scales_a_checkpoint_holds_does_nothing_and_others_are_refused(tmp_path):
    work = source_checkpoint(tmp_path / "work", layout="sharded")
    scales = random_amax(2, 4).scales()
    export_checkpoint(work, work, scales)
    done = listing(work)
    export_checkpoint(work, work, scales)
    assert listing(work) == done
    for other in (random_amax(2, 4, seed=1).scales(), random_amax(2, 4).scales("float8_e4m3fnuz")):
        with pytest.raises(ValueError, match="already has KV cache scales"):
            export_checkpoint(work, work, other)
    with pytest.raises(ValueError, match="already has KV cache scales"):  # a copy needs a source without scales
        export_checkpoint(work, tmp_path / "copy", scales)
    assert listing(work) == done and not (tmp_path / "copy").exists()


# ----------------------------------------------------------------------------- copies


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_copy_killed_anywhere_leaves_no_partial_output_and_a_rerun_finishes(tmp_path, layout):
    pristine, scales, old, new, new_listing = prepared(tmp_path, layout, KVCacheDtype.E4M3FN, 4)
    source_listing = listing(pristine)
    parent = tmp_path / "outputs"
    out = parent / "out"
    for n in range(1, 400):
        shutil.rmtree(parent, ignore_errors=True)
        if killed_at(n, lambda: export_checkpoint(pristine, out, scales)):
            break
        assert listing(pristine) == source_listing
        if out.exists():  # killed after the rename that put it in place
            assert reading(out, KVCacheDtype.E4M3FN) == new
            continue
        export_checkpoint(pristine, out, scales)
        assert [p.name for p in parent.iterdir()] == ["out"], n  # the killed run's staging removed
        assert reading(out, KVCacheDtype.E4M3FN) == new and listing(out) == new_listing, n
    else:
        pytest.fail("the export never completed")
    assert n > 20 and listing(out) == new_listing


def test_copy_failure_names_source_and_destination_and_leaves_nothing(tmp_path):
    source = source_checkpoint(tmp_path / "source", layout="single")
    (source / "tokenizer.json").symlink_to(tmp_path / "missing")  # copying follows it: fails
    parent = tmp_path / "outputs"
    expected = f"cannot copy {source} to {parent / 'out'}: {source / 'tokenizer.json'}: "
    with pytest.raises(OSError, match=re.escape(expected)):
        export_checkpoint(source, parent / "out", random_amax(2, 1).scales())
    assert list(parent.iterdir()) == []
    (source / "tokenizer.json").unlink()
    export_checkpoint(source, parent / "out", random_amax(2, 1).scales())
    assert [p.name for p in parent.iterdir()] == ["out"]


def test_out_inside_the_model_directory_is_refused(tmp_path):
    source = source_checkpoint(tmp_path / "source", layout="single")
    before = listing(source)
    for out in (source / "calibrated", source / "a" / "b", source / ".." / "source" / "c"):
        expected = f"output directory {out} is inside the model directory {source}"
        with pytest.raises(ValueError, match=re.escape(expected)):
            export_checkpoint(source, out, random_amax(2, 1).scales())
    assert listing(source) == before


# ----------------------------------------------------------------------------- modes and names


@contextlib.contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("in_place", [True, False])
def test_replaced_files_keep_their_mode_and_new_files_get_the_umask_mode(tmp_path, layout, in_place):
    source = source_checkpoint(tmp_path / "source", layout=layout)
    modes = {"config.json": 0o640, "model.safetensors.index.json": 0o604, "model.safetensors": 0o660}
    for name, m in modes.items():
        if (source / name).exists():
            os.chmod(source / name, m)
    out = source if in_place else tmp_path / "out"
    with umask(0o027):
        export_checkpoint(source, out, random_amax(2, 1).scales())
        (tmp_path / "plain").write_text("")  # the mode open() gives under this umask: 0o640
    for name, m in modes.items():
        if (source / name).exists():
            assert mode(out / name) == m, name
    if layout == "sharded":
        assert mode(out / "kv_cache_scales.safetensors") == mode(tmp_path / "plain") == 0o640


def test_legacy_json_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "scales.json"
    with umask(0o022):
        export_legacy_json(path, random_amax(2, 1).scales())
        assert mode(path) == 0o644
        os.chmod(path, 0o600)
        export_legacy_json(path, random_amax(2, 1, seed=1).scales())
    assert mode(path) == 0o600 and [p.name for p in tmp_path.iterdir()] == ["scales.json"]


def test_user_files_named_like_temporaries_are_never_overwritten_or_deleted(tmp_path, monkeypatch):
    work = source_checkpoint(tmp_path / "work", layout="sharded")
    user_files = {"config.json.tmp": "mine", "model.safetensors.index.json.tmp": "mine too",
                  "kv_cache_scales.safetensors.tmp": "and this", "config.json.fp8kv-tmp-notours": "also mine"}
    for name, text in user_files.items():
        (work / name).write_text(text)
    export_checkpoint(work, work, random_amax(2, 1).scales())
    assert {name: (work / name).read_text() for name in user_files} == user_files

    # A temporary name that exists already (written between the clean-up and the write) is not
    # overwritten: the export fails without touching it.
    other = source_checkpoint(tmp_path / "other", layout="single")
    taken = other / "model.safetensors.fp8kv-tmp-0123456789abcdef"
    monkeypatch.setattr(commit, "remove_temporaries", lambda *args: taken.write_text("someone else's"))
    monkeypatch.setattr(commit.secrets, "token_hex", lambda n: "0123456789abcdef")
    before = listing(other)
    with pytest.raises(FileExistsError):
        export_checkpoint(other, other, random_amax(2, 1).scales())
    assert taken.read_text() == "someone else's"
    taken.unlink()
    assert listing(other) == before


def test_module_template_naming_no_module_is_refused(tmp_path):
    source = source_checkpoint(tmp_path / "source", layout="sharded")
    for template, missing in (("model.layer.{}.self_attn", "0-1"), ("model.layers.{}.attn", "0-1"),
                              ("model.layers.{}", None)):
        if missing is None:  # the layer itself is a module: accepted (the scales' names are the caller's choice)
            export_checkpoint(source, tmp_path / "ok", random_amax(2, 1).scales(), module_template=template)
            continue
        with pytest.raises(ValueError, match=rf"module_template '{re.escape(template)}' names no module of "
                                             rf".* for layer\(s\) {missing} .*attention modules of the checkpoint: "
                                             r"model\.layers\.0\.self_attn"):
            export_checkpoint(source, tmp_path / "out", random_amax(2, 1).scales(), module_template=template)
    for template in ("model.layers.{}.{}", "model.layers.{0}.self_attn", "model.layers.{}.attn}"):
        with pytest.raises(ValueError, match="module_template must contain"):
            export_checkpoint(source, tmp_path / "out", random_amax(2, 1).scales(), module_template=template)
    assert not (tmp_path / "out").exists()


def test_a_busy_directory_is_refused(tmp_path):
    work = source_checkpoint(tmp_path / "work", layout="single")
    with commit.locked(work):
        pid = os.fork()
        if pid == 0:
            try:
                export_checkpoint(work, work, random_amax(2, 1).scales())
                os._exit(1)
            except OSError as e:
                os._exit(0 if "another fp8kv export is using" in str(e) else 2)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert read_checkpoint_scales(work).k == ()
