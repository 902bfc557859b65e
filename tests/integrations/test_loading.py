"""fp8kv.loading: a checkpoint loads only when every weight of the model comes from it, with the
shape its config gives (transformers alone fills missing weights with random values)."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from checkpoints import edit_safetensors_header, truncate  # noqa: E402
from fp8kv.checkpoint import CheckpointError  # noqa: E402
from fp8kv.loading import WeightsMismatchError, load_causal_lm  # noqa: E402

WEIGHTS = "model.safetensors"


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    return tmp_path, model.state_dict()


def edit_weights(directory, change) -> None:
    tensors = load_file(directory / WEIGHTS)
    change(tensors)
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})


def test_a_complete_checkpoint_loads_exactly(checkpoint):
    directory, state = checkpoint
    # Tensors the model does not use (here a KV cache scale) are fine.
    edit_weights(directory, lambda t: t.update({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}))
    loaded = load_causal_lm(directory, torch.float32, progress=False).state_dict()
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)


def test_missing_weights_are_refused_by_name(checkpoint):
    directory, _ = checkpoint
    edit_weights(directory, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(WeightsMismatchError, match=re.escape(f"{directory}: the weights do not fit its config.json: "
                                                             "1 missing (model.norm.weight)")):
        load_causal_lm(directory, torch.float32, progress=False)


def test_weights_of_another_shape_are_refused_with_both_shapes(checkpoint):
    directory, _ = checkpoint
    name = "model.layers.1.self_attn.k_proj.weight"
    edit_weights(directory, lambda t: t.update({name: torch.zeros(8, 32)}))
    with pytest.raises(WeightsMismatchError, match=re.escape(
            f"1 of another shape ({name} is [8, 32], not [16, 32])")):
        load_causal_lm(directory, torch.float32, progress=False)


def test_many_problems_are_counted_not_listed(checkpoint):
    directory, state = checkpoint
    layer_weights = sorted(name for name in state if name.startswith("model.layers."))

    def drop_layers(tensors):
        for name in layer_weights:
            tensors.pop(name)

    edit_weights(directory, drop_layers)
    with pytest.raises(WeightsMismatchError) as error:
        load_causal_lm(directory, torch.float32, progress=False)
    assert f"{len(layer_weights)} missing ({', '.join(layer_weights[:3])}, and {len(layer_weights) - 3} more)" in str(
        error.value)


def test_loading_is_quiet_and_restores_transformers_logging(checkpoint, capfd):
    directory, _ = checkpoint
    edit_weights(directory, lambda t: t.pop("model.norm.weight"))
    hf_logging.set_verbosity_warning()
    hf_logging.enable_progress_bar()
    handlers = hf_logging.get_logger().handlers[:]
    with pytest.raises(WeightsMismatchError):
        load_causal_lm(directory, torch.float32, progress=False)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # no load report, no bar: the error says it all
    assert hf_logging.get_logger().handlers == handlers and hf_logging.is_progress_bar_enabled()


def test_a_transformers_refusal_carries_its_report(checkpoint, monkeypatch, capfd):
    # transformers stops on weights it cannot convert with a RuntimeError pointing at the report it
    # logged just before: the error carries that report (without terminal colours).
    directory, _ = checkpoint

    def refuse(*args, **kwargs):
        hf_logging.get_logger("transformers.modeling_utils").warning("\x1b[1mLOAD REPORT\x1b[0m\nexperts.0.w1 | CONVERSION")
        raise RuntimeError("We encountered some issues during automatic conversion. See the above report!")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    handlers = hf_logging.get_logger().handlers[:]
    with pytest.raises(WeightsMismatchError) as error:
        load_causal_lm(directory, torch.float32, progress=False)
    assert str(error.value) == (f"{directory}: transformers cannot load its weights: We encountered some issues "
                                "during automatic conversion. See the above report!\nLOAD REPORT\n"
                                "experts.0.w1 | CONVERSION")
    assert capfd.readouterr().err == "" and hf_logging.get_logger().handlers == handlers


@pytest.mark.parametrize("damage, message", [
    (lambda d: truncate(d / WEIGHTS), f"{WEIGHTS}: truncated: the file has \\d+ bytes, its header describes \\d+"),
    (lambda d: edit_safetensors_header(d / WEIGHTS, lambda h: h["model.norm.weight"].update(shape=[64])),
     f"{WEIGHTS}: model.norm.weight: data_offsets hold 128 bytes, where F32 of shape \\[64\\] takes 256 bytes"),
])
def test_a_damaged_weights_file_is_one_line_naming_it(checkpoint, damage, message):
    # transformers' own error names no file ("incomplete metadata, file not fully covered").
    directory, _ = checkpoint
    damage(directory)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(directory))}/{message}$"):
        load_causal_lm(directory, torch.float32, progress=False)


def test_a_missing_shard_is_one_line_naming_it(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=64)).save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(tmp_path))}/model.safetensors.index.json: .*: maps to "
                       f"shard '{shard.name}', which does not exist$"):
        load_causal_lm(tmp_path, torch.float32, progress=False)
