"""The rotated recipe in a checkpoint: fp8kv_kv_cache.json read and checked (every bad field named),
and load_kv_cache_config's recipes: the file's scales and offsets per rank and format, the plain
scales spread by sqrt(block) without it, the plain recipe where the head size has no rotation."""

import json
import os
import re

import pytest

from checkpoints import assert_reported, llama_config, scale_tensors, write_checkpoint
from fp8kv import load_kv_cache_config
from fp8kv.checkpoint import CheckpointError, read_checkpoint_scales, shard_kv_cache_config
from fp8kv.rotation import Rotation

RECIPE = "fp8kv_kv_cache.json"
HEAD_SIZE = 16  # a 16-element rotation block: config hidden_size 128 over 8 attention heads
CONFIG = llama_config(hidden_size=128)  # 2 layers, 4 KV heads
K_SCALES = [[0.5, 0.25, 0.125, 1.0], [2.0, 0.75, 0.375, 0.0625]]
V_SCALES = [[0.25], [0.5]]


def reported(problems, message: str, **where) -> None:
    assert_reported(problems, re.escape(message), **where)


def offsets(layer: int) -> list[list[float]]:
    return [[(layer + 1) * (h - 2.0) + d / 16 for d in range(HEAD_SIZE)] for h in range(4)]


def recipe(**changes) -> dict:
    data = {"fp8kv_kv_cache": 1, "rotation": "hadamard", "calibrated_for": "float8_e4m3fn", "head_size": HEAD_SIZE,
            "num_kv_heads": 4, "layers": [{"k_scale": K_SCALES[layer], "v_scale": V_SCALES[layer],
                                           "k_offset": offsets(layer)} for layer in range(2)]}
    data.update(changes)
    return data


def write(directory, data, *, plain_scales: bool = True, config=CONFIG) -> None:
    write_checkpoint(directory, config=config,
                     tensors=scale_tensors([0.5, 0.5], [0.25, 0.25]) if plain_scales else None)
    if data is not None:
        (directory / RECIPE).write_text(json.dumps(data))


def test_the_file_gives_the_rotated_recipe(tmp_path):
    write(tmp_path, recipe())
    config = load_kv_cache_config(tmp_path, "fp8_e4m3fn")
    assert config.rotation is Rotation.HADAMARD and config.recipe == "rotated + centred"
    assert config.k_scales == tuple(map(tuple, K_SCALES)) and config.v_scales == tuple(map(tuple, V_SCALES))
    assert config.k_offsets == tuple(tuple(map(tuple, offsets(layer))) for layer in range(2))
    assert config.source == f"{tmp_path / RECIPE} (calibrated for float8_e4m3fn)"
    plain = load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")  # the engines' scales stay apart
    assert (plain.rotation, plain.k_scales, plain.k_offsets) == (Rotation.NONE, ((0.5,), (0.5,)), None)


@pytest.mark.parametrize("tp_rank, tp_size, heads", [(1, 2, [2, 3]), (3, 4, [3]), (5, 8, [2])])
def test_scales_and_offsets_are_sliced_for_the_rank(tmp_path, tp_rank, tp_size, heads):
    write(tmp_path, recipe())
    config = load_kv_cache_config(tmp_path, "fp8_e4m3fn", tp_rank=tp_rank, tp_size=tp_size)
    assert config.k_scales[1] == tuple(K_SCALES[1][h] for h in heads)
    assert config.v_scales[1] == (0.5,)  # per tensor: every rank
    assert config.k_offsets[1] == tuple(tuple(offsets(1)[h]) for h in heads)


@pytest.mark.parametrize("tp_rank, tp_size, heads", [(1, 2, [2, 3]), (3, 4, [3]), (5, 8, [2])])
def test_a_whole_config_is_sliced_for_the_rank_as_the_loader_slices_it(tmp_path, tp_rank, tp_size, heads):
    write(tmp_path, recipe())
    config = shard_kv_cache_config(load_kv_cache_config(tmp_path, "fp8_e4m3fn"), tp_rank, tp_size)
    assert config.k_scales[1] == tuple(K_SCALES[1][h] for h in heads)
    assert config.v_scales == ((0.25,), (0.5,))  # per tensor: every rank
    assert config.k_offsets[1] == tuple(tuple(offsets(1)[h]) for h in heads)
    loaded = load_kv_cache_config(tmp_path, "fp8_e4m3fn", tp_rank=tp_rank, tp_size=tp_size)
    assert (config.k_scales, config.v_scales, config.k_offsets) == (loaded.k_scales, loaded.v_scales, loaded.k_offsets)
    assert config.source.endswith(f"; tensor-parallel rank {tp_rank} of {tp_size}")
    with pytest.raises(ValueError, match="tp_rank"):
        shard_kv_cache_config(config, tp_size, tp_size)


def test_scales_are_converted_for_the_cache_format_and_offsets_are_not(tmp_path):
    write(tmp_path, recipe())
    config = load_kv_cache_config(tmp_path, "fp8_e4m3fnuz")
    assert config.k_scales[0] == tuple(2 * s for s in K_SCALES[0])
    assert config.k_offsets[0] == tuple(map(tuple, offsets(0)))
    assert "x2 for float8_e4m3fnuz" in config.source


def test_without_offsets_the_recipe_is_rotated_only(tmp_path):
    data = recipe()
    for layer in data["layers"]:
        del layer["k_offset"]
    write(tmp_path, data)
    config = load_kv_cache_config(tmp_path, "fp8_e5m2")
    assert config.recipe == "rotated" and config.k_offsets is None and config.k_scales[0] == tuple(K_SCALES[0])


def test_without_the_file_the_plain_scales_are_spread_by_sqrt_block(tmp_path):
    """A rotated element is at most sqrt(block) times a row's largest: nothing the plain scales keep in
    range saturates."""
    write(tmp_path, None)
    config = load_kv_cache_config(tmp_path, "fp8_e4m3fn")
    assert config.recipe == "rotated"
    assert config.k_scales == ((0.5 * 4,), (0.5 * 4,)) and config.v_scales == ((1.0,), (1.0,))  # sqrt(16) = 4
    assert f"x4 (sqrt of the rotation's block, 16) for the rotated values ({tmp_path} has no {RECIPE})" in config.source


def test_without_any_scales_the_rotated_recipe_uses_one(tmp_path):
    write(tmp_path, None, plain_scales=False)
    config = load_kv_cache_config(tmp_path, "fp8_e5m2")
    assert (config.recipe, config.k_scales) == ("rotated", ((1.0,), (1.0,)))


def test_a_head_size_without_rotation_gets_the_plain_recipe(tmp_path):
    write(tmp_path, None, config=llama_config())  # head size 64 / 8 = 8: blocks of 8
    config = load_kv_cache_config(tmp_path, "fp8_e4m3fn")
    assert config.recipe == "plain" and "plain recipe: head size 8 has no rotation" in config.source
    with pytest.raises(ValueError, match="head size 8, which has no rotation .* use rotation='none'"):
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="hadamard")


def test_without_a_head_size_the_default_is_plain_and_the_rotation_an_error(tmp_path):
    """The rotated recipe spreads plain scales by sqrt(block), which the head size decides."""
    config = {k: v for k, v in CONFIG.items() if k != "hidden_size"}
    write(tmp_path, None, config=config)
    default = load_kv_cache_config(tmp_path, "fp8_e4m3fn")
    assert default.recipe == "plain" and "plain recipe: config.json gives no head size" in default.source
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="hadamard")
    reported(info.value.problems, "missing (nor hidden_size / num_attention_heads)", tensor="head_dim")


def test_an_unquantized_cache_has_no_rotation(tmp_path):
    write(tmp_path, recipe())
    assert load_kv_cache_config(tmp_path, "auto").rotation is Rotation.NONE
    with pytest.raises(ValueError, match="an unquantized .* must be 'none'"):
        load_kv_cache_config(tmp_path, "auto", rotation="hadamard")


def _layer(layer=0, **changes):
    entry = {"k_scale": K_SCALES[layer], "v_scale": V_SCALES[layer], "k_offset": offsets(layer)}
    entry.update(changes)
    return entry


BAD_FILES = {
    "version": (recipe(fp8kv_kv_cache=2), "fp8kv_kv_cache", "must be 1 (the file's version), got 2"),
    "unknown field": (recipe(extra=1), "extra", "unknown field"),
    "rotation": (recipe(rotation="random"), "rotation", "must be 'hadamard', got 'random'"),
    "calibrated for": (recipe(calibrated_for="float8_e5m2"), "calibrated_for", "must be one of"),
    "head size": (recipe(head_size=32), "head_size", "is 32 but config.json gives head size 16"),
    "head size without rotation": (recipe(head_size=8), "head_size", "divisible by 16, got 8"),
    "kv heads": (recipe(num_kv_heads=2), "num_kv_heads", "must be the model's 4, got 2"),
    "layer count": (recipe(layers=[_layer()]), "layers", "must be a list of the model's 2 layers, got 1"),
    "layer not an object": (recipe(layers=[_layer(), 3]), "layers[1]", "must be an object, got int"),
    "unknown layer field": (recipe(layers=[_layer(), _layer(1, mu=0)]), "layers[1].mu", "unknown field"),
    "scale count": (recipe(layers=[_layer(k_scale=[1.0, 1.0]), _layer(1)]), "layers[0].k_scale",
                    "a list of 1 or num_kv_heads=4 numbers"),
    "negative scale": (recipe(layers=[_layer(), _layer(1, v_scale=[-1.0])]), "layers[1].v_scale[0]",
                       "finite and > 0 in float32, got -1.0"),
    "scale overflowing float32": (recipe(layers=[_layer(), _layer(1, v_scale=[1e39])]), "layers[1].v_scale[0]",
                                  "finite and > 0 in float32"),
    "string scale": (recipe(layers=[_layer(), _layer(1, v_scale=["1"])]), "layers[1].v_scale[0]", "got '1'"),
    "offset rows": (recipe(layers=[_layer(k_offset=offsets(0)[:3]), _layer(1)]), "layers[0].k_offset",
                    "a list of num_kv_heads=4 rows"),
    "offset row length": (recipe(layers=[_layer(k_offset=[[0.0] * 15] * 4), _layer(1)]), "layers[0].k_offset[0]",
                          "a list of head_size=16 numbers"),
    "infinite offset": (recipe(layers=[_layer(k_offset=[[0.0] * 15 + [1e39]] * 4), _layer(1)]),
                        "layers[0].k_offset[0][15]", "finite in float32"),
    "offset in one layer": (recipe(layers=[_layer(), {"k_scale": [1.0], "v_scale": [1.0]}]), "layers",
                            "k_offset must be in every layer or in none; 1 of 2 have one"),
}


@pytest.mark.parametrize("bad", BAD_FILES)
def test_bad_files_are_errors_naming_the_field(tmp_path, bad):
    data, field, message = BAD_FILES[bad]
    write(tmp_path, data)
    found = read_checkpoint_scales(tmp_path)
    reported(found.problems, message, file=str(tmp_path / RECIPE), tensor=field)
    assert found.rotated is None
    with pytest.raises(CheckpointError):
        load_kv_cache_config(tmp_path, "fp8_e4m3fn")
    with pytest.raises(CheckpointError):  # the plain recipe reads the same checkpoint: it is refused too
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", "must hold a JSON object, got list"),
    (b"{\"fp8kv_kv_cache\": 1, \"fp8kv_kv_cache\": 1}", "duplicate key 'fp8kv_kv_cache'"),
    (b"\xff", "not valid UTF-8"),
    (b"{", "invalid JSON"),
])
def test_unreadable_files_are_errors_naming_the_file(tmp_path, content, message):
    write(tmp_path, None)
    (tmp_path / RECIPE).write_bytes(content)
    reported(read_checkpoint_scales(tmp_path).problems, message, file=str(tmp_path / RECIPE))


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    write(tmp_path, None)
    os.mkfifo(tmp_path / RECIPE)
    reported(read_checkpoint_scales(tmp_path).problems, "is a FIFO, expected a regular file",
                    file=str(tmp_path / RECIPE))


def test_inspect_reports_the_recipe(tmp_path):
    write(tmp_path, recipe())
    report = read_checkpoint_scales(tmp_path).report()
    start = report.index(next(line for line in report if line.startswith("rotated recipe:")))
    largest = max(abs(x) for row in offsets(0) for x in row)
    assert report[start:start + 4] == [
        f"rotated recipe:  {RECIPE}: Hadamard rotation, head size 16, with K offsets (rotated + centred), calibrated "
        "for float8_e4m3fn",
        "layer  kind  scales",
        f"    0  K     0.5 0.25 0.125 1    (K offset: largest |mu| {largest:.4g})",
        "    0  V     0.25",
    ]
    assert report[-1] == "no problems found"
