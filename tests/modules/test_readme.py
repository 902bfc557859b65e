"""README.md's first Python example runs as written (read from README.md at run time) on a
calibrated checkpoint, and its output is the float64 attention over what its cache holds."""

import json
import pathlib
import re

import torch

from checkpoints import llama_config, write_checkpoint
from fp8kv.checkpoint.rotated_recipe import RECIPE_FILE, RotatedRecipe
from fp8kv.formats import KVCacheDtype
from reference import add_output_rounding, assert_within
from rotated_reference import rotate_float32, rotated_attention_reference

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 2, 4, 64


def first_python_example() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


def calibrated_checkpoint(directory: pathlib.Path) -> RotatedRecipe:
    """A checkpoint whose fp8kv_kv_cache.json has the rotated + centred recipe (per-head K scales)."""
    generator = torch.Generator().manual_seed(1)
    offsets = [(0.3 * torch.randn(NUM_KV_HEADS, HEAD_SIZE, generator=generator)).tolist() for _ in range(NUM_LAYERS)]
    recipe = RotatedRecipe(KVCacheDtype.E4M3FN, HEAD_SIZE, NUM_KV_HEADS, ((0.02, 0.025, 0.015, 0.03),) * NUM_LAYERS,
                           ((0.03,),) * NUM_LAYERS, tuple(tuple(map(tuple, layer)) for layer in offsets))
    write_checkpoint(directory, config=llama_config(NUM_LAYERS, NUM_KV_HEADS, hidden_size=8 * HEAD_SIZE),
                     num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS)
    (directory / RECIPE_FILE).write_text(json.dumps(recipe.to_json()))
    return recipe


def stored(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """float64 values an e4m3fn rotated cache holds for x [tokens, kv_heads, D], offset added back:
    rotated in float32, minus the offset, divided by the scale, rounded to e4m3fn (inside its range,
    where torch's conversion is exact round-to-nearest-even), times the scale."""
    y = rotate_float32(x) - (0 if offset is None else offset)
    s = scale.view(-1, 1)
    return (y / s).to(torch.float8_e4m3fn).double() * s.double() + (0 if offset is None else offset.double())


def test_the_readmes_first_example_runs_and_attends_over_the_recipe_it_wrote(tmp_path, monkeypatch):
    recipe = calibrated_checkpoint(tmp_path / "path" / "to" / "checkpoint")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {}
    exec(compile(first_python_example(), str(README), "exec"), namespace)
    config, layer = namespace["config"], namespace["layer"]
    assert config.recipe == layer.recipe == "rotated + centred" and config.dtype is KVCacheDtype.E4M3FN
    key, value, query, out = (namespace[name] for name in ("key", "value", "query", "out"))
    k_scale, v_scale = torch.tensor(recipe.k_scales[0]), torch.tensor(recipe.v_scales[0]).expand(NUM_KV_HEADS)
    offset = torch.tensor(recipe.k_offsets[0])
    keys, values = stored(key, k_scale, offset), stored(value, v_scale, None)
    assert (rotate_float32(key) - offset).div(k_scale.view(-1, 1)).abs().max() < 448, "no saturation"
    reference = rotated_attention_reference(query, keys[None], values[None], torch.zeros(1, 1, dtype=torch.int32),
                                            torch.tensor([12]), torch.tensor([0, 12]), HEAD_SIZE**-0.5)
    assert_within(out, add_output_rounding(reference, query.dtype), "README.md's example")
