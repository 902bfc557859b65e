"""Hostile checkpoints: files that could block or never end, index entries pointing out of the
directory, content that must be a CheckpointError naming the file rather than another exception,
and content that must not be accepted silently.

Every case that could block (a FIFO, /dev/zero, a layer count of 10^12) runs in a forked child
with a time limit and a memory limit, so a regression fails the test instead of hanging the run.
"""

import json
import os
import pathlib
import re
import struct

import pytest
import torch
from safetensors.torch import save_file

from checkpoints import (ATTENTION, assert_child_error, assert_reported, compressed_tensors_config, edit_index,
                         edit_safetensors_header, legacy_json, llama_config, random_amax, raw_safetensors,
                         run_in_child, scale_tensors, truncate, write_checkpoint)
from fp8kv import checkpoint
from fp8kv.calibration import export_checkpoint
from fp8kv.checkpoint import CheckpointError, checkpoint_tensor_names, load_kv_cache_config, read_checkpoint_scales
from fp8kv.checkpoint.tensor_files import check_tensor_files

K = [0.0625, 0.375]
V = [0.125, 1.5]
K0 = f"{ATTENTION.format(0)}.k_scale"
INDEX = "model.safetensors.index.json"

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs POSIX FIFOs")


def _replace(path: pathlib.Path, kind: str) -> None:
    """Replaces `path` by a FIFO, or by a symlink to /dev/zero."""
    if path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


# ----------------------------------------------------------------------------- files that could block


@needs_fifo
@pytest.mark.parametrize("kind, expected", [("fifo", "is a FIFO"), ("/dev/zero", "is a character device")])
@pytest.mark.parametrize("file, layout", [
    (INDEX, "sharded"),
    ("config.json", "single"),
    ("kv_cache_scales.json", "json"),
    ("hf_quant_config.json", "single"),
    ("model.safetensors", "single"),  # found by listing the directory
    ("model-00001-of-00002.safetensors", "sharded"),  # named by the index
    ("extra.safetensors", "sharded"),  # in the directory, not in the index
])
def test_special_files_are_errors_not_hangs(tmp_path, kind, expected, file, layout):
    write_checkpoint(tmp_path, shards=2 if layout == "sharded" else 1,
                     tensors=None if layout == "json" else scale_tensors(K, V),
                     legacy_json=legacy_json({0: {0: 1.0, 1: 1.0}}) if layout == "json" else None,
                     hf_quant_config={"quantization": {"kv_cache_quant_algo": "FP8"}})
    _replace(tmp_path / file, kind)
    assert_child_error(run_in_child(load_kv_cache_config, tmp_path, "fp8_e4m3fn"), expected, file)
    # inspect reports it among the problems
    kind, problems = run_in_child(lambda: [str(p) for p in read_checkpoint_scales(tmp_path).problems])
    assert kind == "returned", problems
    assert_reported(problems, expected, file)


@needs_fifo
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_special_config_for_the_unquantized_format(tmp_path, kind):
    write_checkpoint(tmp_path)
    _replace(tmp_path / "config.json", kind)
    assert_child_error(run_in_child(load_kv_cache_config, tmp_path, "auto"), "expected a regular file", "config.json")


@needs_fifo
@pytest.mark.parametrize("kind, expected", [("fifo", "is a FIFO"), ("dir", "is a directory")])
def test_scales_json_argument_must_be_a_regular_file(tmp_path, kind, expected):
    write_checkpoint(tmp_path / "model")
    given = tmp_path / "scales.json"
    os.mkfifo(given) if kind == "fifo" else given.mkdir()
    outcome = run_in_child(load_kv_cache_config, tmp_path / "model", "fp8_e4m3fn", scales_json=given)
    assert_child_error(outcome, f"{given}: {expected}, expected a regular file")


@needs_fifo
def test_inspect_reports_a_fifo(tmp_path):
    from fp8kv.cli import main

    write_checkpoint(tmp_path, shards=2, tensors=scale_tensors(K, V))
    _replace(tmp_path / INDEX, "fifo")
    assert run_in_child(main, ["inspect", str(tmp_path)]) == ("returned", 1)


@pytest.mark.parametrize("layers", [10**9, 10**12])
@pytest.mark.parametrize("cache, tensors", [("auto", None), ("fp8_e4m3fn", None), ("fp8_e4m3fn", "scales"),
                                             ("fp8_e5m2", "scales")])
def test_absurd_layer_counts_are_errors_not_hangs(tmp_path, layers, cache, tensors):
    write_checkpoint(tmp_path, config=llama_config(num_layers=layers),
                     tensors=scale_tensors(K, V) if tensors else None)
    outcome = run_in_child(load_kv_cache_config, tmp_path, cache)
    assert_child_error(outcome, f"is {layers}, above the limit of {checkpoint.MAX_NUM_LAYERS}", "config.json",
                       "num_hidden_layers")


def test_missing_layers_are_found_from_the_tensors_present(tmp_path):
    # The largest allowed model with scales for two layers: the report spans the rest in one range.
    write_checkpoint(tmp_path, config=llama_config(num_layers=checkpoint.MAX_NUM_LAYERS),
                     tensors=scale_tensors(K, V))
    outcome = run_in_child(load_kv_cache_config, tmp_path, "fp8_e4m3fn")
    assert_child_error(outcome, f"no k_scale for layer\\(s\\) 2-{checkpoint.MAX_NUM_LAYERS - 1} of the model's "
                       f"{checkpoint.MAX_NUM_LAYERS}", "model.safetensors", ATTENTION.format(2) + ".k_scale")


def test_layer_limit_is_inclusive(tmp_path, monkeypatch):
    monkeypatch.setattr("fp8kv.checkpoint.config.MAX_NUM_LAYERS", 4)
    write_checkpoint(tmp_path / "at", config=llama_config(num_layers=4))
    assert load_kv_cache_config(tmp_path / "at", "auto").num_layers == 4
    write_checkpoint(tmp_path / "above", config=llama_config(num_layers=5))
    with pytest.raises(CheckpointError, match="num_hidden_layers: is 5, above the limit of 4"):
        load_kv_cache_config(tmp_path / "above", "auto")
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 5\), got 5"):
        load_kv_cache_config(tmp_path / "at", "auto", num_layers=5)


@pytest.mark.parametrize("name, message", [
    ("model.layers.1000000000000.self_attn.k_scale", "layer 1000000000000 is outside the model's 2 layers"),
    ("model.layers." + "9" * 400 + ".self_attn.k_scale", "has no layer index"),
])
def test_layer_index_in_a_name_beyond_the_model(tmp_path, name, message):
    write_checkpoint(tmp_path, tensors={**scale_tensors(K, V), name: torch.tensor(1.0)})
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")
    assert_reported(info.value.problems, message, "model.safetensors", name)


def test_json_files_are_read_up_to_a_limit(tmp_path, monkeypatch):
    monkeypatch.setattr("fp8kv.checkpoint.files.MAX_JSON_BYTES", 4096)
    write_checkpoint(tmp_path, config={**llama_config(), "padding": "x" * 4096})
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "auto")
    assert_reported(info.value.problems, "larger than 0.00390625 MiB \\(MAX_JSON_BYTES\\)", "config.json")
    # A safetensors header is JSON too.
    write_checkpoint(tmp_path / "header", tensors={f"{ATTENTION.format(0)}.{'x' * 4096}.k_scale": torch.tensor(1.0)})
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path / "header", "fp8_e4m3fn", rotation="none")
    assert_reported(info.value.problems, "header length \\d+ exceeds 0.00390625 MiB", "model.safetensors")


# ----------------------------------------------------------------------------- paths out of the directory


def _sharded_with_outside_scales(tmp_path, entry):
    """A sharded checkpoint in tmp_path/model whose index maps K0 to `entry`; the file outside holds valid scales."""
    directory = write_checkpoint(tmp_path / "model", shards=2, tensors=scale_tensors(K, V))
    save_file(scale_tensors(K, V), str(tmp_path / "outside.safetensors"))
    edit_index(directory, **{K0: entry})
    return directory


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", "escape/outside.safetensors",
                                   "./../model/../outside.safetensors"])
def test_index_entries_must_stay_inside_the_directory(tmp_path, entry):
    if entry == "ABSOLUTE":
        entry = str(tmp_path / "outside.safetensors")
    directory = _sharded_with_outside_scales(tmp_path, entry)
    (directory / "escape").symlink_to(tmp_path)  # a folder link out of the checkpoint
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(directory, "fp8_e4m3fn", rotation="none")
    assert_reported(info.value.problems, "maps to shard '.*outside.safetensors', which lies outside the checkpoint "
                    "directory", INDEX, K0)
    with pytest.raises(CheckpointError, match="lies outside"):
        checkpoint_tensor_names(directory)


def test_index_entries_in_a_subfolder_and_linked_files_are_fine(tmp_path):
    # A subfolder inside the checkpoint is inside; a file may link anywhere, as in the Hugging Face
    # cache, where every file of a snapshot links to a blob outside it.
    directory = write_checkpoint(tmp_path / "snapshot", shards=2, tensors=scale_tensors(K, V))
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for path in sorted(directory.iterdir()):
        path.rename(blobs / path.name)
        path.symlink_to(blobs / path.name)
    (directory / "sub").mkdir()
    save_file(scale_tensors(K, V), str(directory / "sub" / "scales.safetensors"))
    index = json.loads((directory / INDEX).read_text())
    weight_map = {n: ("sub/scales.safetensors" if n.endswith("_scale") else f) for n, f in index["weight_map"].items()}
    (directory / INDEX).unlink()
    (blobs / "index").write_text(json.dumps({"weight_map": weight_map}))
    (directory / INDEX).symlink_to(blobs / "index")
    config = load_kv_cache_config(directory, "fp8_e4m3fn", rotation="none")
    assert config.k_scales == tuple((k,) for k in K) and config.v_scales == tuple((v,) for v in V)
    assert checkpoint_tensor_names(directory)[K0] == directory / "sub" / "scales.safetensors"


@pytest.mark.parametrize("entry, message", [(["a.safetensors"], "maps to \\['a.safetensors'\\]; expected a shard"),
                                            ({"x": 1}, "expected a shard file name"),
                                            ("", "lies outside the checkpoint directory"),
                                            ("absent.safetensors", "which does not exist")])
def test_index_entries_of_the_wrong_kind(tmp_path, entry, message):
    write_checkpoint(tmp_path, shards=2, tensors=scale_tensors(K, V))
    edit_index(tmp_path, **{K0: entry})
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")
    assert_reported(info.value.problems, message, INDEX, K0)


# ----------------------------------------------------------------------------- content that raised other exceptions


def _write_file(name, content: bytes, **checkpoint_kwargs):
    def build(tmp_path):
        write_checkpoint(tmp_path, **checkpoint_kwargs)
        (tmp_path / name).write_bytes(content)
    return build


def _edit_config(**changes):
    def build(tmp_path):
        write_checkpoint(tmp_path, config={**llama_config(), **changes}, tensors=scale_tensors(K, V))
    return build


def _json_file(data, **checkpoint_kwargs):
    return _write_file("kv_cache_scales.json", json.dumps(data).encode(), **checkpoint_kwargs)


def _scale_of_400_digits(tmp_path):
    write_checkpoint(tmp_path)
    text = json.dumps(legacy_json({0: {0: 1.0, 1: 2.0}})).replace("2.0", "9" * 400)
    (tmp_path / "kv_cache_scales.json").write_text(text)


def _damaged(damage):
    """A checkpoint with scales whose model.safetensors `damage(path)` then changes."""
    def build(tmp_path):
        write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
        damage(tmp_path / "model.safetensors")
    return build


def _entry(name, **changes):
    """Changes the header entry of tensor `name`, leaving the data as it is."""
    return lambda path: edit_safetensors_header(path, lambda header: header[name].update(changes))


EMBED = "model.embed_tokens.weight"  # [16, 8] float32: 512 bytes
SHARDED = dict(shards=2, tensors=scale_tensors(K, V))
HF_QUANT = dict(hf_quant_config={"quantization": {}})
GOOD_HEADER = b'{"%s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}' % K0.encode()

# build(tmp_path) -> None; then loading as e4m3fn is a CheckpointError with a problem that names
# `file` (and `tensor`) and matches `message`.
CONTENT_ERRORS = {
    # invalid UTF-8
    "config.json not UTF-8": (_write_file("config.json", b'{"model_type": "ll\xffama"}'), "config.json", None,
                              "not valid UTF-8"),
    "index not UTF-8": (_write_file(INDEX, b'{"weight_map": {"\xc3\x28": "x"}}', **SHARDED), INDEX, None,
                        "not valid UTF-8"),
    "legacy JSON not UTF-8": (_write_file("kv_cache_scales.json", b"\xfe\xff{}"), "kv_cache_scales.json", None,
                              "not valid UTF-8"),
    "hf_quant_config not UTF-8": (_write_file("hf_quant_config.json", b'{"\x80": 1}'), "hf_quant_config.json", None,
                                  "not valid UTF-8"),
    # nesting beyond the recursion limit
    "config.json nested lists": (_write_file("config.json", b"[" * 200_000 + b"]" * 200_000), "config.json", None,
                                 "nested too deeply"),
    "index nested objects": (_write_file(INDEX, b'{"a":' * 200_000 + b"1" + b"}" * 200_000, **SHARDED), INDEX, None,
                             "nested too deeply"),
    # an integer too long for int(): json.loads raises ValueError
    "config.json huge integer": (_write_file("config.json", b'{"num_hidden_layers": ' + b"1" * 5000 + b"}"),
                                 "config.json", None, "invalid JSON: Exceeds the limit"),
    # a list or object where a string is expected
    "kv_cache_torch_dtype list": (_edit_config(kv_cache_torch_dtype=["float8_e4m3fn"]), "config.json",
                                  "kv_cache_torch_dtype", "must be one of .* got \\['float8_e4m3fn'\\]"),
    "quantization_config dtype object": (_edit_config(quantization_config={"kv_cache_torch_dtype": {}}),
                                         "config.json", "quantization_config.kv_cache_torch_dtype", "got \\{\\}"),
    "strategy list": (_edit_config(quantization_config={"kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": ["tensor"]}}), "config.json",
        "quantization_config.kv_cache_scheme", "strategy must be 'tensor' or 'attn_head', got \\['tensor'\\]"),
    "legacy dtype list": (_json_file(legacy_json({0: {0: 1.0, 1: 1.0}}, dtype=["float8_e4m3fn"])),
                          "kv_cache_scales.json", "kv_cache.dtype", "must be one of"),
    "model_type object": (_edit_config(model_type={"name": "llama"}), "config.json", "model_type", "must be a string"),
    # numbers beyond float
    "400-digit legacy scale": (_scale_of_400_digits, "kv_cache_scales.json", "kv_cache.scaling_factor[0][1]",
                               "must be a finite number > 0, got 9999"),
    # corrupted safetensors files
    "empty safetensors": (_write_file("model.safetensors", b""), "model.safetensors", None,
                          "0 bytes, shorter than the header length"),
    "truncated header": (_write_file("model.safetensors", GOOD_HEADER[:8]), "model.safetensors", None,
                         "header length .* exceeds the file"),
    "header length beyond the file": (lambda p: (write_checkpoint(p), raw_safetensors(
        p / "model.safetensors", GOOD_HEADER, b"\0" * 4, header_length=10**6)), "model.safetensors", None,
        "header length 1000000 exceeds the file \\(\\d+ bytes\\)"),
    "header length 2^64-1": (lambda p: (write_checkpoint(p), raw_safetensors(
        p / "model.safetensors", GOOD_HEADER, header_length=2**64 - 1)), "model.safetensors", None, "exceeds the file"),
    "garbage": (_write_file("model.safetensors", b"\x10\0\0\0\0\0\0\0garbage garbage!"), "model.safetensors", None,
                "invalid JSON"),
    "header not an object": (lambda p: (write_checkpoint(p), raw_safetensors(p / "model.safetensors", b"[1, 2]")),
                             "model.safetensors", None, "must hold a JSON object"),
    "data offsets beyond the file": (lambda p: (write_checkpoint(p), raw_safetensors(
        p / "model.safetensors", GOOD_HEADER.replace(b"[0,4]", b"[0,400]"), b"\0" * 4)), "model.safetensors", K0,
        "data_offsets hold 400 bytes, where F32 of shape \\[\\] takes 4 bytes"),
    "a scale tensor claiming 10^9 elements": (lambda p: (write_checkpoint(p), raw_safetensors(
        p / "model.safetensors", GOOD_HEADER.replace(b"[]", b"[1000000000]"), b"\0" * 4)), "model.safetensors", K0,
        "data_offsets hold 4 bytes, where F32 of shape \\[1000000000\\] takes 4000000000 bytes"),
    "a shape of 10^4000 elements": (lambda p: (write_checkpoint(p), raw_safetensors(
        p / "model.safetensors", GOOD_HEADER.replace(b"[]", b"[" + b",".join([b"9" * 4000] * 1000) + b"]"),
        b"\0" * 4)), "model.safetensors", K0, "takes more than 2\\^64 elements"),
    # damaged files: cut short, grown, or a header that does not describe the data
    "truncated model.safetensors": (_damaged(lambda path: truncate(path)), "model.safetensors", None,
                                    "^[^:]+: truncated: the file has \\d+ bytes, its header describes \\d+$"),
    "bytes after the data": (_damaged(lambda path: path.write_bytes(path.read_bytes() + b"\0" * 8)),
                             "model.safetensors", None, "its header describes \\d+: 8 bytes follow$"),
    "a weight's shape that lies": (_damaged(_entry(EMBED, shape=[32, 8])), "model.safetensors", EMBED,
                                   "data_offsets hold 512 bytes, where F32 of shape \\[32, 8\\] takes 1024 bytes"),
    "a weight's dtype that lies": (_damaged(_entry(EMBED, dtype="F16")), "model.safetensors", EMBED,
                                   "where F16 of shape \\[16, 8\\] takes 256 bytes"),
    "an unknown dtype": (_damaged(_entry(EMBED, dtype="F31")), "model.safetensors", EMBED,
                         "dtype 'F31' is none of the safetensors dtypes \\(BOOL, F4, "),
    "a shape that is no list": (_damaged(_entry(EMBED, shape="16x8")), "model.safetensors", EMBED,
                                "shape must be a list of non-negative integers, got '16x8'"),
    "a negative size": (_damaged(_entry(EMBED, shape=[-16, -8])), "model.safetensors", EMBED,
                        "shape must be a list of non-negative integers"),
    "offsets of one entry": (_damaged(_entry(EMBED, data_offsets=[0])), "model.safetensors", EMBED,
                             "data_offsets must be \\[begin, end\\], integers with 0 <= begin <= end, got \\[0\\]"),
    "an entry that is no object": (_damaged(lambda path: edit_safetensors_header(
        path, lambda header: header.update({EMBED: [0, 512]}))), "model.safetensors", EMBED,
        "must be an object of dtype, shape and data_offsets"),
    "two tensors on the same bytes": (_damaged(lambda path: edit_safetensors_header(path, lambda header: header[
        f"{ATTENTION.format(1)}.k_proj.weight"].update(data_offsets=header[f"{ATTENTION.format(0)}.k_proj.weight"][
            "data_offsets"]))), "model.safetensors", None, "must fill the data without gaps or overlaps"),
    "metadata of numbers": (_damaged(lambda path: edit_safetensors_header(
        path, lambda header: header.update(__metadata__={"format": 1}))), "model.safetensors", "__metadata__",
        "must be an object of strings"),
    "truncated shard named by the index": (lambda p: (write_checkpoint(p, **SHARDED), truncate(
        p / "model-00001-of-00002.safetensors")), "model-00001-of-00002.safetensors", None, "truncated: the file has"),
    "deleted shard named by the index": (lambda p: (write_checkpoint(p, **SHARDED), (
        p / "model-00002-of-00002.safetensors").unlink()), INDEX, None,
        "maps to shard 'model-00002-of-00002.safetensors', which does not exist"),
    "a scale tensor of 1000 elements": (lambda p: (write_checkpoint(p), raw_safetensors(
        p / "model.safetensors", GOOD_HEADER.replace(b"[]", b"[1000]").replace(b"[0,4]", b"[0,4000]"),
        b"\0" * 4000)), "model.safetensors", K0, "shape \\[1000\\] is none of"),
    "corrupted shard named by the index": (lambda p: (write_checkpoint(p, **SHARDED), raw_safetensors(
        p / "model-00002-of-00002.safetensors", b"{", header_length=7)), "model-00002-of-00002.safetensors", None,
        "header length 7 exceeds the file"),
    # a directory where a file is expected
    "directory as a shard": (lambda p: (write_checkpoint(p, shards=2), edit_index(p, **{K0: "sub"}),
                                        (p / "sub").mkdir()), INDEX, K0, "which is a directory, expected a regular"),
    "directory as kv_cache_scales.json": (lambda p: (write_checkpoint(p), (p / "kv_cache_scales.json").mkdir()),
                                          "kv_cache_scales.json", None, "is a directory"),
    "directory named .safetensors": (lambda p: (write_checkpoint(p), (p / "x.safetensors").mkdir()),
                                     "x.safetensors", None, "is a directory"),
    "dangling hf_quant_config.json": (lambda p: (write_checkpoint(p), (p / "hf_quant_config.json").symlink_to(
        p / "absent")), "hf_quant_config.json", None, "does not exist"),
    "symlink loop as config.json": (lambda p: (write_checkpoint(p), (p / "config.json").unlink(),
                                               (p / "config.json").symlink_to(p / "config.json")),
                                    "config.json", None, "cannot be read: Too many levels of symbolic links"),
    # silently accepted before: repeated keys
    "config.json repeated key": (_write_file("config.json", b'{"num_hidden_layers": 2, "num_key_value_heads": 4, '
                                 b'"num_hidden_layers": 3}'), "config.json", None,
                                 "duplicate key 'num_hidden_layers'"),
    "index repeated entry": (lambda p: (write_checkpoint(p, **SHARDED), (p / INDEX).write_text(
        '{"weight_map": {"%s": "model-00001-of-00002.safetensors", "%s": "model-00002-of-00002.safetensors"}}'
        % (K0, K0))), INDEX, None, f"duplicate key '{K0}'"),
    "legacy JSON repeated layer": (_write_file("kv_cache_scales.json", b'{"kv_cache": {"dtype": "float8_e4m3fn", '
                                   b'"scaling_factor": {"0": {"0": 1.0, "1": 2.0, "1": 4.0}}}}'),
                                   "kv_cache_scales.json", None, "duplicate key '1'"),
    "hf_quant_config repeated key": (_write_file("hf_quant_config.json", b'{"quantization": {}, "quantization": {}}'),
                                     "hf_quant_config.json", None, "duplicate key 'quantization'"),
    "safetensors header repeated name": (lambda p: (write_checkpoint(p), raw_safetensors(
        p / "model.safetensors", GOOD_HEADER[:-1] + b"," + GOOD_HEADER[1:], b"\0" * 4)), "model.safetensors", None,
        f"duplicate key '{K0}'"),
    "layer 0 and 00": (_json_file({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {"0": 1.0, "00": 2.0, "1": 1.0}}}}), "kv_cache_scales.json", "kv_cache.scaling_factor[0]['00']",
        "repeats key '0': both are 0"),
    "rank 1 and 01": (_json_file(legacy_json({0: {0: 1.0, 1: 1.0}, 1: {0: 1.0, 1: 1.0}, "01": {0: 1.0, 1: 1.0}})),
                      "kv_cache_scales.json", "kv_cache.scaling_factor['01']", "repeats key '1'"),
    "layer key with a sign": (_json_file({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {"0": 1.0, "+1": 1.0}}}}), "kv_cache_scales.json", "kv_cache.scaling_factor[0]['+1']",
        "key must be a non-negative integer"),
    "layer key with an underscore": (_json_file({"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
        "0": {"0": 1.0, "1_0": 1.0}}}}), "kv_cache_scales.json", "kv_cache.scaling_factor[0]['1_0']",
        "key must be a non-negative integer"),
    # silently ignored before: scales the loader would not use
    "unlisted scales shard": (lambda p: (write_checkpoint(p, shards=2), save_file(
        scale_tensors(K, V), str(p / "kv_cache_scales.safetensors"))), "kv_cache_scales.safetensors", None,
        f"holds KV cache scale tensors but {INDEX} does not list this file"),
}


@pytest.mark.parametrize("case", sorted(CONTENT_ERRORS))
def test_hostile_content_is_a_checkpoint_error_naming_the_file(tmp_path, case):
    build, file, tensor, message = CONTENT_ERRORS[case]
    build(tmp_path)
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")
    assert_reported(info.value.problems, message, file, tensor)
    assert read_checkpoint_scales(tmp_path).problems == info.value.problems


@pytest.mark.parametrize("shards", [1, 2])
def test_a_damaged_file_is_one_problem_not_one_per_tensor_it_holds(tmp_path, shards):
    # A calibrated checkpoint cut short: one line naming the file, not one per scale tensor in it, nor the
    # scales it held (or, sharded, the layers whose scales it held) reported missing as well.
    write_checkpoint(tmp_path, config=llama_config(quantization_config=compressed_tensors_config()),
                     tensors=scale_tensors(K, V), shards=shards)
    damaged = tmp_path / ("model.safetensors" if shards == 1 else "model-00001-of-00002.safetensors")
    size = damaged.stat().st_size
    truncate(damaged)
    expected = f"{damaged}: truncated: the file has {size // 2} bytes, its header describes {size}"
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")
    assert str(info.value) == expected  # one problem, one line
    assert [str(p) for p in read_checkpoint_scales(tmp_path).problems] == [expected]
    with pytest.raises(CheckpointError, match=f"^{re.escape(expected)}$"):
        checkpoint_tensor_names(tmp_path)


def test_check_tensor_files_passes_pickled_weights_and_refuses_damaged_safetensors(tmp_path):
    torch.save({"model.embed_tokens.weight": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    check_tensor_files(tmp_path)  # no safetensors file: nothing to check (transformers reads the pickle)
    with pytest.raises(CheckpointError, match="holds only pickled weights"):
        checkpoint_tensor_names(tmp_path)  # where KV cache scales are read, safetensors only
    write_checkpoint(tmp_path / "sharded", **SHARDED)
    check_tensor_files(tmp_path / "sharded")
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="which does not exist"):
        check_tensor_files(tmp_path / "sharded")


def test_unlisted_shard_without_scales_is_fine(tmp_path):
    write_checkpoint(tmp_path, **SHARDED)
    save_file({"consolidated.weight": torch.ones(2)}, str(tmp_path / "consolidated.safetensors"))
    assert load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none").k_scales == tuple((k,) for k in K)


@pytest.mark.parametrize("source", ["tensors", "json"])
@pytest.mark.parametrize("scale, calibrated_for, cache, result", [
    (3e38, "float8_e4m3fn", "float8_e4m3fnuz", "inf"),  # doubled past float32's maximum
    (2 ** -149, "float8_e4m3fnuz", "float8_e4m3fn", "0"),  # the smallest float32 halved rounds to 0
])
def test_scale_conversion_out_of_float32_names_file_and_tensor(tmp_path, source, scale, calibrated_for, cache, result):
    if source == "tensors":
        tensors = scale_tensors(K, V)
        tensors[K0] = torch.tensor(scale, dtype=torch.float32)
        write_checkpoint(tmp_path, config=llama_config(kv_cache_torch_dtype=calibrated_for), tensors=tensors)
        file, tensor = "model.safetensors", K0
    else:
        write_checkpoint(tmp_path, legacy_json=legacy_json({0: {0: scale, 1: 1.0}}, dtype=calibrated_for))
        file, tensor = "kv_cache_scales.json", "kv_cache.scaling_factor[0][0]"
    assert read_checkpoint_scales(tmp_path).problems == ()  # valid as stored
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, cache, rotation="none")
    assert len(info.value.problems) == 1
    assert_reported(info.value.problems, f"x{2.0 if result == 'inf' else 0.5:g} for the {cache} cache is {result} "
                    "in float32", file, tensor)


# ----------------------------------------------------------------------------- two sources of scales


def test_scales_json_next_to_the_directory_file_is_an_error_naming_both(tmp_path):
    write_checkpoint(tmp_path / "model", legacy_json=legacy_json({0: {0: 1.0, 1: 1.0}}))
    given = tmp_path / "other.json"
    given.write_text(json.dumps(legacy_json({0: {0: 2.0, 1: 2.0}})))
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path / "model", "fp8_e4m3fn", rotation="none", scales_json=given)
    assert_reported(info.value.problems, f"conflicting sources: scales_json='{given}' was also given",
                    tmp_path / "model" / "kv_cache_scales.json")
    # Naming the directory's own file is one source.
    own = tmp_path / "model" / "kv_cache_scales.json"
    assert load_kv_cache_config(tmp_path / "model", "fp8_e4m3fn", rotation="none", scales_json=own).k_scales == ((1.0,), (1.0,))


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("argument, value, error", [
    ("tp_rank", True, TypeError), ("tp_rank", 1.0, TypeError), ("tp_size", True, TypeError),
    ("tp_size", 2.0, TypeError), ("tp_size", "2", TypeError), ("num_layers", True, TypeError),
    ("num_layers", 2.0, TypeError), ("num_kv_heads", False, TypeError), ("num_kv_heads", "4", TypeError),
    ("num_layers", 0, ValueError), ("num_kv_heads", -4, ValueError), ("num_layers", 10**12, ValueError),
])
def test_integer_arguments_refuse_bools_and_other_types(tmp_path, argument, value, error):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
    kwargs = {"tp_size": 2} if argument == "tp_rank" else {}
    with pytest.raises(error, match=f"^{argument} must be"):
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none", **kwargs, **{argument: value})
    if argument in ("num_layers", "num_kv_heads"):
        with pytest.raises(error, match=f"^{argument} must be"):
            read_checkpoint_scales(tmp_path, **{argument: value})


# ----------------------------------------------------------------------------- checkpoint_tensor_names


def _names_by_safetensors(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """Reference: every tensor of every *.safetensors file, read by the safetensors library."""
    from safetensors import safe_open

    names = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), path))
    return names


@pytest.mark.parametrize("shards", [1, 3])
def test_checkpoint_tensor_names(tmp_path, shards):
    write_checkpoint(tmp_path, shards=shards, tensors=scale_tensors(K, V))
    names = checkpoint_tensor_names(tmp_path)
    assert names == _names_by_safetensors(tmp_path)
    assert K0 in names and "model.embed_tokens.weight" in names


@needs_fifo
def test_checkpoint_tensor_names_refuses_hostile_files(tmp_path):
    write_checkpoint(tmp_path / "fifo", shards=2)
    _replace(tmp_path / "fifo" / INDEX, "fifo")
    assert_child_error(run_in_child(checkpoint_tensor_names, tmp_path / "fifo"), "is a FIFO", INDEX)
    with pytest.raises(CheckpointError, match="absent: does not exist"):
        checkpoint_tensor_names(tmp_path / "absent")
    write_checkpoint(tmp_path / "garbage")
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read safetensors file"):
        checkpoint_tensor_names(tmp_path / "garbage")


# ----------------------------------------------------------------------------- commit journals

JOURNAL = ".fp8kv-commit.json"  # the commit point of an export (fp8kv.commit)


@needs_fifo
@pytest.mark.parametrize("kind, expected", [("fifo", "is not a regular file"), ("dir", "is not a regular file"),
                                            ("/dev/zero", "cannot read the commit journal")])
def test_a_journal_that_is_no_file_is_an_error_naming_it_not_a_hang(tmp_path, kind, expected):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
    if kind == "dir":
        (tmp_path / JOURNAL).mkdir()
    else:
        _replace(tmp_path / JOURNAL, kind)  # a symlink: refused, as the journal is never followed
    for cache in ("fp8_e4m3fn", "auto"):
        assert_child_error(run_in_child(load_kv_cache_config, tmp_path, cache), expected, JOURNAL)
    assert_child_error(run_in_child(checkpoint_tensor_names, tmp_path), expected, JOURNAL)


@needs_fifo
@pytest.mark.parametrize("kind, expected", [("fifo", "is a FIFO"), ("/dev/zero", "is a character device")])
@pytest.mark.parametrize("file, layout", [("config.json", "single"), ("model.safetensors", "single"),
                                          (INDEX, "sharded"), ("kv_cache_scales.safetensors", "sharded")])
def test_a_journals_files_are_read_with_the_same_care(tmp_path, kind, expected, file, layout):
    write_checkpoint(tmp_path, shards=2 if layout == "sharded" else 1, tensors=scale_tensors(K, V))
    temporary = f"{file}.fp8kv-tmp-0123456789abcdef"
    _replace(tmp_path / temporary, kind)
    (tmp_path / JOURNAL).write_text(json.dumps({"files": {file: temporary}}))
    # Read instead of the file it stands for, and named in the error.
    assert_child_error(run_in_child(load_kv_cache_config, tmp_path, "fp8_e4m3fn"), expected, temporary)


def test_a_journals_file_is_read_instead_of_the_one_it_replaces(tmp_path):
    """A journal made by hand (the kill tests of test_export_atomic.py use fp8kv's): the loader reads
    the journal's temporaries, a new file included, and reports problems in them by their names."""
    write_checkpoint(tmp_path, shards=2)  # no scales: unit scales
    new_shard = "kv_cache_scales.safetensors.fp8kv-tmp-0123456789abcdef"
    new_index = f"{INDEX}.fp8kv-tmp-0123456789abcdef"
    save_file(scale_tensors(K, V), str(tmp_path / new_shard))
    index = json.loads((tmp_path / INDEX).read_text())
    index["weight_map"].update(dict.fromkeys(scale_tensors(K, V), "kv_cache_scales.safetensors"))
    (tmp_path / new_index).write_text(json.dumps(index))
    (tmp_path / JOURNAL).write_text(json.dumps({"files": {"kv_cache_scales.safetensors": new_shard,
                                                          INDEX: new_index}}))
    config = load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")
    assert config.k_scales == tuple((k,) for k in K) and config.v_scales == tuple((v,) for v in V)
    assert checkpoint_tensor_names(tmp_path)[K0] == tmp_path / new_shard
    (tmp_path / new_index).write_text("{")
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")
    assert_reported(info.value.problems, "invalid JSON", new_index)


# ----------------------------------------------------------------------------- safetensors headers


def test_read_safetensors_header_matches_the_file_layout(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.float16)}, str(path), metadata={"k": "v"})
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])  # the layout: header length, JSON header, data
    header = checkpoint.read_safetensors_header(path)
    assert header == (json.loads(raw[8:8 + length]), 8 + length, len(raw) - 8 - length)
    assert header.data_size == 3 * 4 + 2 * 2 and header.entries["__metadata__"] == {"k": "v"}


def _with_length(header: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if length is None else length) + header


@pytest.mark.parametrize("content, message", [
    (b"\x01\x00", "cannot read safetensors file: 2 bytes, shorter than the header length"),
    (_with_length(b"{}", 100), "header length 100 exceeds the file \\(10 bytes\\)"),
    (_with_length(b""), "invalid JSON"),
    (_with_length(b"[1]"), "must hold a JSON object, got list"),
    (_with_length(b'{"a": 1, "a": 2}'), "duplicate key 'a'"),
    (_with_length(b"{\xff}"), "not valid UTF-8"),
])
def test_read_safetensors_header_refuses_malformed_files_naming_them(tmp_path, content, message):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        checkpoint.read_safetensors_header(path)
    assert_reported(info.value.problems, message, path)


@needs_fifo
@pytest.mark.parametrize("kind, expected", [("fifo", "is a FIFO"), ("/dev/zero", "is a character device")])
def test_read_safetensors_header_refuses_special_files(tmp_path, kind, expected):
    _replace(tmp_path / "x.safetensors", kind)
    assert_child_error(run_in_child(checkpoint.read_safetensors_header, tmp_path / "x.safetensors"), expected,
                       "x.safetensors")


# ----------------------------------------------------------------------------- the export's own reads


def _oversized(path: pathlib.Path) -> None:
    """JSON file `path` grown past the MAX_JSON_BYTES of 4096 that the test sets."""
    path.write_text(json.dumps({**json.loads(path.read_text()), "padding": "x" * 4096}))


@needs_fifo
@pytest.mark.parametrize("kind, expected", [("fifo", "is a FIFO"), ("/dev/zero", "is a character device"),
                                            ("oversized", "larger than 0.00390625 MiB \\(MAX_JSON_BYTES\\)")])
@pytest.mark.parametrize("file, layout", [("config.json", "single"), ("config.json", "sharded"), (INDEX, "sharded")])
def test_export_reads_json_files_with_the_same_care(tmp_path, monkeypatch, kind, expected, file, layout):
    """The export reads config.json and the index again to rewrite them. A file that turns hostile
    after the export checked the checkpoint is refused as the loader refuses it, naming the file."""
    write_checkpoint(tmp_path, shards=2 if layout == "sharded" else 1)
    monkeypatch.setattr("fp8kv.checkpoint.files.MAX_JSON_BYTES", 4096)

    def check_then_replace(directory):
        found = read_checkpoint_scales(directory)
        _oversized(tmp_path / file) if kind == "oversized" else _replace(tmp_path / file, kind)
        return found

    monkeypatch.setattr("fp8kv.calibration.export.read_checkpoint_scales", check_then_replace)
    outcome = run_in_child(export_checkpoint, tmp_path, tmp_path, random_amax(2, 1).scales())
    assert_child_error(outcome, expected, tmp_path / file)
