"""Continuous batching with a transformers outside the releases fp8kv's hooks support (CI runs the
tests with the oldest transformers of the [hf] extra, older than the [serve] extra's): enabling a
model is one error that names the installed version and the install command, and installs nothing."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from fp8kv.formats import KVCacheConfig  # noqa: E402
from fp8kv.integrations import transformers_continuous_batching as continuous_batching  # noqa: E402
from fp8kv.integrations.transformers import enable_continuous_batching  # noqa: E402

try:
    continuous_batching.check_transformers()
except continuous_batching.UnsupportedTransformersError:
    pass
else:
    pytest.skip(f"transformers {transformers.__version__} is supported (test_continuous_batching.py)",
                allow_module_level=True)


def test_enabling_a_model_is_one_error_naming_the_version():
    low, high = continuous_batching.SUPPORTED_VERSIONS
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with pytest.raises(continuous_batching.UnsupportedTransformersError,
                       match=rf"^fp8kv's continuous batching supports transformers {low[0]}\.{low[1]} to "
                             rf"{high[0]}\.{high[1]}; transformers {transformers.__version__} is installed "
                             r"\(.*\): .* -m pip install 'transformers>=.*'$"):
        enable_continuous_batching(model, KVCacheConfig.unit_scales("e4m3", 2))
    assert continuous_batching._TRANSFORMERS is None
    assert model.config._attn_implementation != "fp8kv"
