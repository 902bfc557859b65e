"""Calibration: K/V maxima of transformers models against the K/V their attention actually receives,
scales against the float64 formula, export into checkpoints and back through the loader, data
files, calibrate_checkpoint (all of it at once), and the CLI. Tensor-parallel reduction:
test_calibration_tp.py."""

import contextlib
import errno
import json
import math
import os
import struct
import sys
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, AttentionMaskInterface, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers import MistralConfig, MistralForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

from rotated_reference import hadamard_matrix  # noqa: E402
from checkpoints import (assert_reported, compressed_tensors_config, llama_config, random_amax,  # noqa: E402
                         raw_safetensors, run_in_child, scale_tensors, source_checkpoint, write_checkpoint)
from fp8kv import cli  # noqa: E402
from fp8kv.calibration import (CalibrationError, KVAmax, KVCalibrator, calibrate, calibrate_checkpoint,  # noqa: E402
                               export_checkpoint, export_legacy_json, make_batches, observe_model, text_sequences,
                               token_id_sequences)
from fp8kv.calibration import export as exporting  # noqa: E402
from fp8kv.checkpoint import CheckpointError, load_kv_cache_config  # noqa: E402
from fp8kv.formats import KVCacheConfig, KVCacheDtype  # noqa: E402
from fp8kv.integrations.transformers import enable  # noqa: E402
from fp8kv.loading import load_causal_lm  # noqa: E402

VOCAB, HEAD_SIZE = 64, 16
E4M3 = (KVCacheDtype.E4M3FN, KVCacheDtype.E4M3FNUZ)


# Tiny models and tensors: one CPU thread (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def f32(x: float) -> float:
    """float32 rounding by the IEEE encoder of the struct module (independent of torch)."""
    return struct.unpack("f", struct.pack("f", x))[0]


# ----------------------------------------------------------------------------- models and references


def tiny_model(num_kv_heads: int = 2, *, kind: str = "llama", dtype=torch.float32, num_layers: int = 2, seed: int = 0):
    """A random-weight GQA model (4 query heads of 16) whose KV heads differ in magnitude (x0.5 to
    x4), so per-head and per-tensor maxima differ. Mistral gets an 8-token sliding window."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=HEAD_SIZE,
                  max_position_embeddings=256)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = MistralForCausalLM(MistralConfig(sliding_window=8, **common))
    head_gain = torch.linspace(0.5, 4.0, num_kv_heads).repeat_interleave(HEAD_SIZE)[:, None]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(head_gain)
            layer.self_attn.v_proj.weight.mul_(head_gain.flip(0))
    return model.to(dtype).eval()


def token_batches(shapes, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, shape, generator=generator) for shape in shapes]


BATCHES = [(2, 12), (1, 20), (3, 5)]


def attention_inputs(model, batches) -> dict[tuple[int, str], torch.Tensor]:
    """float64 key and value every attention call receives (K after rotary embedding), recorded by an
    attention function wrapped around transformers' SDPA attention: {(layer, 'k' or 'v'): [tokens,
    kv_heads, head_size]} over all batches."""
    inputs = {}

    def record(module, query, key, value, *args, **kwargs):
        for kind, t in (("k", key), ("v", value)):
            tokens = t.double().transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])
            inputs.setdefault((module.layer_idx, kind), []).append(tokens)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("record_kv", record)
    AttentionMaskInterface.register("record_kv", sdpa_mask)
    implementation = model.config._attn_implementation
    model.set_attn_implementation("record_kv")
    try:
        with torch.no_grad():
            for batch in batches:
                model(input_ids=batch)
    finally:
        model.set_attn_implementation(implementation)
    return {key: torch.cat(parts) for key, parts in inputs.items()}


def attention_inputs_amax(model, batches, granularity: str):
    """float64 max |K|, |V| of the attention inputs per layer, per head or over all heads."""
    inputs = attention_inputs(model, batches)

    def values(kind):
        per_head = [inputs[(layer, kind)].abs().amax(dim=(0, 2)) for layer in range(model.config.num_hidden_layers)]
        return [tuple((m.amax().reshape(1) if granularity == "tensor" else m).tolist()) for m in per_head]

    return values("k"), values("v")


def k_proj_amax(model, batches) -> list[float]:
    """max |k_proj output| per layer: K before rotary embedding."""
    maxima = [0.0] * model.config.num_hidden_layers
    handles = [layer.self_attn.k_proj.register_forward_hook(
        lambda module, args, out, i=i: maxima.__setitem__(i, max(maxima[i], out.double().abs().max().item())))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch)
    for handle in handles:
        handle.remove()
    return maxima


# ----------------------------------------------------------------------------- maxima


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,kind", [(1, "llama"), (2, "llama"), (4, "llama"), (2, "mistral")])
def test_amax_equals_max_of_attention_inputs(granularity, dtype, num_kv_heads, kind):
    model = tiny_model(num_kv_heads, kind=kind, dtype=dtype)
    batches = token_batches(BATCHES)  # Mistral: 12 and 20 tokens exceed its 8-token window
    amax = calibrate(model, batches, granularity=granularity, progress=False)
    k, v = attention_inputs_amax(model, batches, granularity)
    # A maximum is one of its (bf16 or fp32, so float32-exact) inputs: equality is exact.
    assert amax.k == tuple(k) and amax.v == tuple(v)
    assert amax.num_tokens == sum(b.numel() for b in batches)
    assert len(amax.k[0]) == (1 if granularity == "tensor" else num_kv_heads)
    # The key before rotary embedding has other maxima: the calibrator saw the rotated key.
    assert [max(layer) for layer in amax.k] != k_proj_amax(model, batches)


def test_per_head_maxima_differ_and_bound_per_tensor():
    model = tiny_model(4)
    batches = token_batches(BATCHES)
    per_tensor = calibrate(model, batches, granularity="tensor", progress=False)
    per_head = calibrate(model, batches, granularity="head", progress=False)
    for tensor_layer, head_layer in zip(per_tensor.k + per_tensor.v, per_head.k + per_head.v):
        assert tensor_layer == (max(head_layer),)
        assert min(head_layer) < max(head_layer) / 2  # head gains 0.5..4 make the heads differ


def test_calibrator_folds_steps_and_restores_training_mode():
    model = tiny_model(2).train()
    batches = token_batches(BATCHES)
    calibrator = KVCalibrator.for_model(model, "head")
    for batch in batches:  # one batch at a time: the running maxima persist across calls
        observe_model(model, [batch], calibrator, progress=False)
    assert model.training
    model.eval()
    assert calibrator.result() == calibrate(model, batches, granularity="head", progress=False)


@pytest.mark.parametrize("kind", ["K", "V"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_non_finite_maxima_are_refused_naming_layer_and_head(kind, bad, granularity):
    calibrator = KVCalibrator(num_layers=3, num_kv_heads=4, granularity=granularity)
    for layer in range(3):
        key, value = torch.randn(2, 7, 4, 8).unbind(0)
        if layer == 1:
            (key if kind == "K" else value)[5, 2, 3] = bad
        calibrator.observe(layer, key, value)
    amax = calibrator.result()
    with pytest.raises(CalibrationError) as error:
        amax.scales()
    where = f"layer 1 {kind}" + (" head 2" if granularity == "head" else "")
    assert len(error.value.problems) == 1
    assert where in str(error.value) and ("nan" if math.isnan(bad) else "inf") in str(error.value)


# ----------------------------------------------------------------------------- scales


@pytest.mark.parametrize("fmt", E4M3)
@pytest.mark.parametrize("margin", [1.0, 1.25, 3.0])
@pytest.mark.parametrize("width", [1, 4])
def test_scale_is_float32_rounded_amax_times_margin_over_max_finite(fmt, margin, width):
    amax = random_amax(3, width)
    config = amax.scales(fmt, margin=margin)
    max_finite = {KVCacheDtype.E4M3FN: 448.0, KVCacheDtype.E4M3FNUZ: 240.0}[fmt]  # the formats' definitions
    assert config.dtype is fmt
    # Python floats are IEEE doubles: one correctly rounded float64 quotient, then float32 rounding.
    assert config.k_scales == tuple(tuple(f32(a * margin / max_finite) for a in layer) for layer in amax.k)
    assert config.v_scales == tuple(tuple(f32(a * margin / max_finite) for a in layer) for layer in amax.v)


@pytest.mark.parametrize("fmt", E4M3)
def test_amax_quantizes_to_the_largest_finite_code(fmt):
    """With margin 1, the calibration maximum is stored as +-max_finite: full range, no overflow."""
    amax = random_amax(1, 4, seed=3)
    config = amax.scales(fmt)
    key = torch.tensor(amax.k[0], dtype=torch.float32).reshape(1, 4, 1).expand(1, 4, 16).contiguous()
    key[0, 1] *= -1
    key_cache = torch.zeros(1, 1, 4, 16, dtype=fmt.storage_dtype)
    value_cache = torch.zeros_like(key_cache)
    torch.ops.fp8kv.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([0]), config.k_scale(0), config.k_scale(0))
    stored = key_cache.float()[0, 0, :, 0]
    assert stored.tolist() == [fmt.max_finite, -fmt.max_finite, fmt.max_finite, fmt.max_finite]


def test_all_zero_heads_are_an_error_by_default():
    amax = KVAmax(((1.0, 0.0), (2.0, 3.0)), ((4.0, 5.0), (0.0, 0.0)))
    with pytest.raises(CalibrationError) as error:
        amax.scales()
    assert [p.split(":")[0] for p in error.value.problems] == ["layer 0 K head 1", "layer 1 V head 0",
                                                               "layer 1 V head 1"]
    assert "zero_amax='unit'" in str(error.value)


def test_all_zero_heads_get_unit_scale_with_a_warning_when_asked():
    amax = KVAmax(((1.0, 0.0), (2.0, 3.0)), ((4.0, 5.0), (0.0, 0.0)))
    with pytest.warns(UserWarning, match="layer 0 K head 1, layer 1 V head 0, layer 1 V head 1"):
        config = amax.scales(zero_amax="unit")
    assert config.k_scales == ((f32(1 / 448), 1.0), (f32(2 / 448), f32(3 / 448)))
    assert config.v_scales == ((f32(4 / 448), f32(5 / 448)), (1.0, 1.0))
    assert "scale 1.0 for all-zero layer 0 K head 1" in config.source


@pytest.mark.parametrize("kwargs,match", [
    (dict(fmt="float8_e5m2"), "e4m3"),
    (dict(fmt="auto"), "e4m3"),
    (dict(margin=0.5), "margin"),
    (dict(margin=math.inf), "margin"),
    (dict(zero_amax="floor"), "zero_amax"),
])
def test_bad_scale_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        random_amax(1, 1).scales(**kwargs)


def test_bad_calibrator_use():
    with pytest.raises(ValueError, match="granularity"):
        KVCalibrator(2, 2, "channel")
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVCalibrator(2, 0)
    calibrator = KVCalibrator(2, 2, "head")
    key = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="layer 2 is outside"):
        calibrator.observe(2, key, key)
    with pytest.raises(ValueError, match="key and value"):
        calibrator.observe(0, key, key[:, :1])
    calibrator.observe(0, key, key)
    with pytest.raises(ValueError, match="observed 1 KV heads, earlier 2"):
        calibrator.observe(0, key[:, :1], key[:, :1])
    with pytest.raises(CalibrationError, match=r"layer\(s\) 1 of 2 were never observed"):
        calibrator.result()
    calibrator.observe(1, key[:, :1], key[:, :1])
    with pytest.raises(ValueError, match="different KV head counts"):
        calibrator.result()
    one_head = KVCalibrator(1, 2, "head")
    one_head.observe(0, key[:, :1], key[:, :1])
    with pytest.raises(ValueError, match="observed 1 KV heads per layer, the model has 2"):
        one_head.result()


@pytest.mark.gpu
def test_observing_on_the_gpu_never_synchronizes():
    calibrator = KVCalibrator(2, 4, "head")
    key, value = torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16).unbind(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in (0, 1, 0, 1):
            calibrator.observe(layer, key, value)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calibrator.result().k[0] == tuple(key.float().abs().amax(dim=(0, 2)).tolist())


# ----------------------------------------------------------------------------- export


def all_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def file_metadata(directory) -> dict:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return f.metadata()


def load(directory, fmt, **kwargs) -> KVCacheConfig:
    """The plain recipe's config: the scales calibration writes for other engines."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_kv_cache_config(directory, fmt, **{"rotation": "none", **kwargs})


@pytest.mark.parametrize("granularity", ["tensor", "head"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("fmt", E4M3)
def test_exported_scales_load_back_identically(tmp_path, granularity, layout, in_place, fmt):
    source = source_checkpoint(tmp_path / "source", layout=layout)
    weights_before = all_tensors(source)
    metadata_before = file_metadata(source) if layout == "single" else None
    config = random_amax(2, 1 if granularity == "tensor" else 4).scales(fmt)
    out = source if in_place else tmp_path / "out"
    assert export_checkpoint(source, out, config) == out

    loaded = load(out, fmt)
    assert (loaded.dtype, loaded.k_scales, loaded.v_scales) == (fmt, config.k_scales, config.v_scales)
    # The other e4m3 format gets the same bits' scales: x2 for fnuz, /2 for fn (exact powers of two).
    other = KVCacheDtype.E4M3FN if fmt is KVCacheDtype.E4M3FNUZ else KVCacheDtype.E4M3FNUZ
    factor = other.scale_factor_from(fmt)
    assert load(out, other).k_scales == tuple(tuple(s * factor for s in layer) for layer in config.k_scales)
    for rank in range(2):  # tensor parallel 2: each rank's slice of the per-head scales
        sliced = load(out, fmt, tp_rank=rank, tp_size=2).v_scales
        assert sliced == tuple(layer if len(layer) == 1 else layer[2 * rank:2 * rank + 2] for layer in config.v_scales)

    tensors = all_tensors(out)
    assert {n: t for n, t in tensors.items() if "scale" not in n}.keys() == weights_before.keys()
    assert all(torch.equal(tensors[n], t) for n, t in weights_before.items())
    shape = [1] if granularity == "tensor" else [4, 1, 1]  # as llm-compressor writes them
    for layer in range(2):
        for kind in ("k", "v"):
            t = tensors[f"model.layers.{layer}.self_attn.{kind}_scale"]
            assert (t.dtype, list(t.shape)) == (torch.float32, shape)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if layout == "sharded":
        assert "kv_cache_scales.safetensors" in files
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"]["model.layers.1.self_attn.v_scale"] == "kv_cache_scales.safetensors"
    else:
        assert files == ["model.safetensors"]
        assert file_metadata(out) == metadata_before
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    assert quant["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "dynamic": False, "symmetric": True,
                                        "strategy": "tensor" if granularity == "tensor" else "attn_head"}
    assert ("kv_cache_torch_dtype" in quant) == (fmt is KVCacheDtype.E4M3FNUZ)
    if not in_place:
        assert "quantization_config" not in json.loads((source / "config.json").read_text())


@pytest.mark.parametrize("existing", [
    compressed_tensors_config() | {"kv_cache_scheme": None, "config_groups": {"group_0": {"targets": ["Linear"]}}},
    {"quant_method": "fp8", "activation_scheme": "dynamic"},
])
def test_export_merges_into_an_existing_quantization_config(tmp_path, existing):
    source = source_checkpoint(tmp_path / "source", layout="single", config=llama_config(quantization_config=existing))
    export_checkpoint(source, tmp_path / "out", random_amax(2, 1).scales())
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in quant.items() if k != "kv_cache_scheme"} == {
        k: v for k, v in existing.items() if k != "kv_cache_scheme"}
    assert quant["kv_cache_scheme"]["strategy"] == "tensor"


def test_export_refusals(tmp_path):
    scales = random_amax(2, 4).scales()
    with_scales = write_checkpoint(tmp_path / "with_scales", tensors=scale_tensors([0.5, 0.5], [0.5, 0.5]))
    with pytest.raises(ValueError, match="already has KV cache scales"):
        export_checkpoint(with_scales, tmp_path / "a", scales)
    source = source_checkpoint(tmp_path / "source", layout="sharded")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export_checkpoint(source, tmp_path / "busy", scales)
    with pytest.raises(ValueError, match="cover 3 layers"):
        export_checkpoint(source, tmp_path / "b", random_amax(3, 1).scales())
    with pytest.raises(ValueError, match="num_kv_heads=4"):
        export_checkpoint(source, tmp_path / "c", random_amax(2, 2).scales())
    with pytest.raises(ValueError, match="module_template"):
        export_checkpoint(source, tmp_path / "d", scales, module_template="model.layers.self_attn")
    unindexed = write_checkpoint(tmp_path / "unindexed", shards=2, index=False)
    with pytest.raises(ValueError, match="neither"):
        export_checkpoint(unindexed, tmp_path / "e", scales)
    bad = write_checkpoint(tmp_path / "bad", config=llama_config(num_hidden_layers="two"))
    with pytest.raises(CheckpointError):
        export_checkpoint(bad, tmp_path / "f", scales)
    for name in "abcdef":  # nothing was written for a refused export
        assert not (tmp_path / name).exists()


@pytest.mark.parametrize("copy", ["sendfile", "python"])
def test_single_file_rewrite_keeps_every_tensor_byte_for_byte_and_aligned(tmp_path, monkeypatch, copy):
    """Odd-sized tensors of narrow dtypes end the data (42 bytes past the float32 weights: scales
    appended there would be misaligned); no tensor may lose its alignment, and no old byte may change.
    The old data is copied by os.sendfile, or through Python where sendfile refuses files (macOS)."""
    calls = []

    def counted(*args):
        calls.append(args)
        if copy == "python":
            raise OSError(errno.ENOTSOCK, "Socket operation on non-socket")
        return os.sendfile(*args)

    monkeypatch.setattr(exporting, "_sendfile", counted)
    odd = {"extra.f64": torch.randn(3, dtype=torch.float64), "extra.bf16": torch.randn(5).bfloat16(),
           "extra.flags": torch.tensor([True, False, True]), "extra.i8": torch.arange(5, dtype=torch.int8)}
    source = write_checkpoint(tmp_path / "source", tensors=odd)
    before = load_file(str(source / "model.safetensors"))
    export_checkpoint(source, tmp_path / "out", random_amax(2, 4).scales())
    raw = (tmp_path / "out" / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    assert (8 + size) % 8 == 0
    item_sizes = {"F64": 8, "F32": 4, "BF16": 2, "BOOL": 1, "I8": 1}
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % item_sizes[entry["dtype"]] == 0, name
    after = load_file(str(tmp_path / "out" / "model.safetensors"))  # safetensors checks the layout has no holes
    assert after.keys() == before.keys() | {f"model.layers.{i}.self_attn.{k}_scale" for i in range(2) for k in "kv"}
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype
        assert torch.equal(after[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert len(calls) == (1 if copy == "python" else 2)  # the data in one call, then 0 bytes: the end


def test_module_names_come_from_the_weights_or_the_caller(tmp_path):
    renamed = {f"transformer.h.{i}.attn.{p}.weight": torch.zeros(2, 2) for i in range(2) for p in ("q_proj", "k_proj")}
    source = write_checkpoint(tmp_path / "source", tensors=renamed)
    with pytest.raises(ValueError, match="cannot tell the attention modules"):
        # Two templates cover all layers: the test checkpoint's model.layers.{}.self_attn and this one.
        export_checkpoint(source, tmp_path / "out", random_amax(2, 1).scales())
    export_checkpoint(source, tmp_path / "out", random_amax(2, 1).scales(), module_template="transformer.h.{}.attn")
    assert "transformer.h.1.attn.v_scale" in all_tensors(tmp_path / "out")


@pytest.mark.parametrize("other_names", [
    ["model.layers." + "1" * 5000 + ".self_attn.k_proj.weight"],  # int() refuses more than 4300 digits
    [f"transformer.h.{digit}.attn.k_proj.weight" for digit in "\u0660\u0661"],  # Arabic-Indic 0 and 1
], ids=["5000 digits", "non-ASCII digits"])
def test_a_layer_index_is_a_short_ascii_number(tmp_path, other_names):
    """Other K projections whose layer component is no layer index (too long, or digits int() reads
    but the loader does not) leave model.layers.{}.self_attn the only attention modules."""
    source = write_checkpoint(tmp_path / "source", tensors={name: torch.zeros(2) for name in other_names})
    export_checkpoint(source, tmp_path / "out", random_amax(2, 1).scales())
    assert "model.layers.1.self_attn.v_scale" in all_tensors(tmp_path / "out")


def test_module_template_check_is_bounded_by_the_template_not_the_names(tmp_path):
    """A megabyte name with a million dots (every dotted prefix of it held at once: about 10^12 bytes)
    is checked in a child with a memory limit: a regression fails instead of filling the machine."""
    long_name = "model." + "x." * 1_000_000 + "k_proj.weight"
    source = write_checkpoint(tmp_path / "source", tensors={long_name: torch.zeros(2)})
    outcome = run_in_child(export_checkpoint, source, tmp_path / "out", random_amax(2, 1).scales(),
                           module_template="model.layers.{}.self_attn")
    assert outcome == ("returned", tmp_path / "out")
    assert long_name in all_tensors(tmp_path / "out")


def _weights_header(**changes) -> dict:
    """The safetensors header of two float32 K projection weights of one element each, with `changes`
    (tensor name: entry) applied."""
    names = [f"model.layers.{layer}.self_attn.k_proj.weight" for layer in range(2)]
    header = {name: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, name in enumerate(names)}
    return header | changes


K1 = "model.layers.1.self_attn.k_proj.weight"


@pytest.mark.parametrize("header, data, tensor, message", [
    (_weights_header(**{K1: {"dtype": "F32", "shape": [1]}}), 8, K1, "data_offsets must be \\[begin, end\\]"),
    (_weights_header(**{K1: [4, 8]}), 8, K1, "must be an object of dtype, shape and data_offsets"),
    (_weights_header(**{K1: {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}), 8, K1, "0 <= begin <= end"),
    (_weights_header(**{K1: {"dtype": "F32", "shape": [1], "data_offsets": [4, "8"]}}), 8, K1, "integers"),
    (_weights_header(), 4, None, "truncated: the file has \\d+ bytes, its header describes \\d+"),
    (_weights_header(), 12, None, "the file has \\d+ bytes, its header describes \\d+: 4 bytes follow"),
    (_weights_header(__metadata__={"format": 1}), 8, "__metadata__", "must be an object of strings"),
], ids=["no offsets", "entry not an object", "reversed", "string offset", "data short", "data long", "metadata"])
def test_single_file_rewrite_refuses_a_file_it_cannot_copy_naming_it(tmp_path, header, data, tensor, message):
    source = write_checkpoint(tmp_path / "source")
    raw_safetensors(source / "model.safetensors", json.dumps(header).encode(), b"\0" * data)
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    with pytest.raises(CheckpointError) as info:
        export_checkpoint(source, source, random_amax(2, 1).scales())
    assert_reported(info.value.problems, message, source / "model.safetensors", tensor)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before  # nothing written, no temporaries


def test_legacy_json_round_trip(tmp_path):
    source = source_checkpoint(tmp_path / "source", layout="single")
    config = random_amax(2, 1).scales()
    path = export_legacy_json(tmp_path / "scales.json", config, model_type="llama")
    loaded = load(source, "float8_e4m3fn", scales_json=path)
    expected = tuple((max(k[0], v[0]),) for k, v in zip(config.k_scales, config.v_scales))
    assert loaded.k_scales == loaded.v_scales == expected
    with pytest.raises(ValueError, match="per-tensor"):
        export_legacy_json(tmp_path / "heads.json", random_amax(2, 4).scales())


def calibrated_checkpoint(tmp_path, granularity: str):
    """(the model, the directory `python -m fp8kv calibrate` wrote its checkpoint with scales into)."""
    model = tiny_model(2)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "ids.txt").write_text("1 5 9 13 17 21\n1 2 3\n")
    assert cli.main(["calibrate", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "ids.txt"), "--token-ids",
                     "--out", str(tmp_path / "out"), "--granularity", granularity, "--no-progress", "--device",
                     "cpu"]) == 0
    return model, tmp_path / "out"


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_calibrated_checkpoint_loads_with_fp8kvs_loader(tmp_path, granularity, monkeypatch):
    """The guide's recipe: fp8kv's loader gives the model as it was, without compressed-tensors (which
    transformers needs for the config's kv_cache_scheme), ready for enable()."""
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # as where it is not installed
    model, out = calibrated_checkpoint(tmp_path, granularity)
    loaded = enable(load_causal_lm(out, torch.float32, progress=False))
    loaded.set_attn_implementation("sdpa")
    ids = token_batches([(2, 12)])[0]
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_calibrated_checkpoint_loads_with_from_pretrained(tmp_path, granularity):
    """transformers' own from_pretrained, with compressed-tensors installed (the form vLLM reads the
    scales in is a compressed-tensors kv_cache_scheme): the weights as they were. transformers 5.17 (not
    5.24) also puts the scales into the attention modules, where compressed-tensors quantizes K and V
    with them: enable() refuses such a model (its cache would quantize them twice)."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (scripts/run.sh installs it)")
    import transformers

    model, out = calibrated_checkpoint(tmp_path, granularity)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on the scale tensors it does not use itself
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    state = loaded.state_dict()
    assert all(torch.equal(state[name], weight) for name, weight in model.state_dict().items())
    attention = [layer.self_attn for layer in loaded.model.layers]
    if hasattr(attention[0], "k_scale"):
        scales = load(out, "e4m3")
        assert [(a.k_scale.flatten().tolist(), a.v_scale.flatten().tolist()) for a in attention] == [
            (list(k), list(v)) for k, v in zip(scales.k_scales, scales.v_scales)]
        with pytest.raises(ValueError, match="model.layers.0.self_attn quantizes its own K and V"):
            enable(loaded)
    else:
        enable(loaded)


# ----------------------------------------------------------------------------- data


def test_token_id_files(tmp_path):
    path = tmp_path / "ids.txt"
    path.write_text("1 2 3\n\n  4 5\t6 7 \n")
    assert [s.tolist() for s in token_id_sequences(path, vocab_size=8)] == [[1, 2, 3], [4, 5, 6, 7]]
    path.write_text("1 2\n3 x\n")
    with pytest.raises(ValueError, match=r"ids.txt:2: token ids must be integers"):
        token_id_sequences(path, vocab_size=8)
    path.write_text("1 2\n3 8\n")
    with pytest.raises(ValueError, match=r"ids.txt:2: token id 8 is outside the vocabulary \[0, 8\)"):
        token_id_sequences(path, vocab_size=8)
    path.write_text("\n \n")
    with pytest.raises(ValueError, match="no token ids"):
        token_id_sequences(path, vocab_size=8)


def test_batches_cut_group_and_stop():
    sequences = [torch.arange(10), torch.arange(100, 104), torch.arange(200, 206)]
    batches = make_batches(sequences, seq_len=4, batch_size=2)
    assert [b.tolist() for b in batches] == [
        [[0, 1, 2, 3], [4, 5, 6, 7]], [[100, 101, 102, 103], [200, 201, 202, 203]], [[8, 9], [204, 205]]]
    limited = make_batches(sequences, seq_len=4, batch_size=3, max_tokens=9)
    assert [b.tolist() for b in limited] == [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8]]]
    with pytest.raises(ValueError, match="seq_len"):
        make_batches(sequences, seq_len=0)


def word_tokenizer(with_bos: bool = True):
    """A whitespace word-level tokenizer over a fixed vocabulary, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>" if with_bos else None)


def test_text_is_tokenized_and_cut_with_bos_first(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text(" ".join(f"w{i}" for i in range(7)) + "\n")
    # w_i has id i + 2; every sequence starts with <s> (id 1), as prompts do.
    assert [s.tolist() for s in text_sequences(path, word_tokenizer(), seq_len=4)] == [
        [1, 2, 3, 4], [1, 5, 6, 7], [1, 8]]
    assert [s.tolist() for s in text_sequences(path, word_tokenizer(with_bos=False), seq_len=4)] == [
        [2, 3, 4, 5], [6, 7, 8]]


# ----------------------------------------------------------------------------- calibrate_checkpoint


def recording(steps: list):
    """An around_step for calibrate_checkpoint that appends (step, None) or (step, its error's type) to `steps`."""
    @contextlib.contextmanager
    def around_step(name):
        try:
            yield
        except Exception as e:
            steps.append((name, type(e)))
            raise
        steps.append((name, None))

    return around_step


def summary_table(summary: str) -> list[list[float]]:
    """The per-layer rows [K amax, K scale, V amax, V scale] of CheckpointCalibration.summary()."""
    lines = summary.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("layer  ")))
    rows = [line.split() for line in lines[header + 1:lines.index("", header)]]
    assert [int(row[0]) for row in rows] == list(range(len(rows)))
    return [[float(x) for x in row[1:]] for row in rows]


@pytest.mark.parametrize("layout, granularity, fmt, in_place, with_json", [
    ("single", "tensor", KVCacheDtype.E4M3FN, False, True),
    ("sharded", "head", KVCacheDtype.E4M3FNUZ, True, False),
])
def test_calibrate_checkpoint_measures_exports_and_summarizes(tmp_path, layout, granularity, fmt, in_place, with_json):
    model = tiny_model(2)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir, max_shard_size="100KB" if layout == "sharded" else "1GB")
    out = model_dir if in_place else tmp_path / "out"
    legacy = tmp_path / "legacy.json" if with_json else None
    batches = token_batches(BATCHES)
    steps = []
    result = calibrate_checkpoint(model_dir, batches, out, fmt=fmt.value, granularity=granularity, margin=1.25,
                                  legacy_json=legacy, progress=False, around_step=recording(steps))
    assert steps == [(step, None) for step in ("load", "observe", "scales", "export", "legacy_json")[:4 + with_json]]

    # The maxima of the K/V the model's attention receives, and the float64 formula rounded to float32.
    k, v = attention_inputs_amax(model, batches, granularity)
    assert (result.amax.k, result.amax.v) == (tuple(k), tuple(v))
    assert result.amax.num_tokens == sum(b.numel() for b in batches)
    max_finite = {KVCacheDtype.E4M3FN: 448.0, KVCacheDtype.E4M3FNUZ: 240.0}[fmt]
    kv_cache = result.kv_cache
    assert kv_cache.dtype is fmt and result.margin == 1.25
    assert kv_cache.k_scales == tuple(tuple(f32(a * 1.25 / max_finite) for a in layer) for layer in k)
    assert kv_cache.v_scales == tuple(tuple(f32(a * 1.25 / max_finite) for a in layer) for layer in v)

    # The files: the scales load back as calibrated, from the file the result names.
    scales_name = "kv_cache_scales.safetensors" if layout == "sharded" else "model.safetensors"
    assert (result.out_dir, result.scales_file, result.legacy_json) == (out, out / scales_name, legacy)
    with safe_open(str(result.scales_file), framework="pt") as f:
        assert f.get_tensor("model.layers.1.self_attn.v_scale").flatten().tolist() == list(kv_cache.v_scales[1])
    loaded = load(out, fmt)
    assert (loaded.k_scales, loaded.v_scales) == (kv_cache.k_scales, kv_cache.v_scales)
    if with_json:
        from_json = load(model_dir, fmt, scales_json=legacy)  # model_dir itself holds no scales
        assert from_json.k_scales == tuple((max(a[0], b[0]),) for a, b in zip(kv_cache.k_scales, kv_cache.v_scales))

    # The rotated + centred recipe: mu = the mean of the rotated K, scales from max |kH - mu| and max
    # |vH| (float64 here; the calibrator rotates in float32: 1e-6 relative), loaded back by default.
    inputs = attention_inputs(model, batches)
    rotated = result.rotated
    assert rotated.recipe == "rotated + centred" and rotated.dtype is fmt
    h = hadamard_matrix(HEAD_SIZE)
    for layer in range(2):
        key, value = inputs[(layer, "k")] @ h, inputs[(layer, "v")] @ h
        mu = key.mean(0)
        torch.testing.assert_close(rotated.k_offset(layer).double(), mu, rtol=1e-6, atol=1e-6)
        for scales, x in ((rotated.k_scales[layer], key - mu), (rotated.v_scales[layer], value)):
            amax = x.abs().amax(dim=(0, 2))
            amax = amax.amax().reshape(1) if granularity == "tensor" else amax
            assert scales == pytest.approx((amax * 1.25 / max_finite).tolist(), rel=1e-6)
    default = load(out, fmt, rotation="hadamard")
    assert (default.k_scales, default.v_scales, default.k_offsets) == (rotated.k_scales, rotated.v_scales,
                                                                       rotated.k_offsets)

    # The summary: the run, each layer's largest maxima and scales to 4 significant digits, the files.
    assert (result.device, result.model_dtype) == (torch.device("cpu"), torch.float32)
    lines = result.summary().splitlines()
    assert lines[0] == (f"calibrated 2 layers on {result.amax.num_tokens} tokens (cpu, torch.float32), "
                        f"per {granularity}, for {fmt.value}, margin 1.25")
    assert lines[-1] == (f"wrote {out} (scales in {scales_name}, declared in config.json, the rotated recipe's "
                         "in fp8kv_kv_cache.json)" + (f" and {legacy}" if with_json else ""))
    expected = [[max(k[layer]), max(kv_cache.k_scales[layer]), max(v[layer]), max(kv_cache.v_scales[layer])]
                for layer in range(2)]
    # 4 significant digits: within half a unit of the 4th digit, 5e-4 relative.
    assert summary_table(result.summary()) == [pytest.approx(row, rel=5e-4) for row in expected]


def zero_k_model_dir(directory):
    """A tiny model saved in `directory` whose layer 0 K projection is zero: all-zero K in layer 0."""
    model = tiny_model(2)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.zero_()
    model.save_pretrained(directory)
    return directory


def test_calibrate_checkpoint_step_errors_pass_through_around_step_and_write_nothing(tmp_path):
    model_dir = zero_k_model_dir(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    steps = []
    with pytest.raises(CalibrationError, match="layer 0 K: amax is 0"):
        calibrate_checkpoint(model_dir, token_batches(BATCHES), tmp_path / "out", progress=False,
                             around_step=recording(steps))
    assert steps == [("load", None), ("observe", None), ("scales", CalibrationError)]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "something").write_text("x")
    steps.clear()
    with pytest.raises(FileExistsError, match="is not empty"), pytest.warns(UserWarning, match="layer 0 K"):
        calibrate_checkpoint(model_dir, token_batches(BATCHES), tmp_path / "full", zero_amax="unit",
                             legacy_json=tmp_path / "legacy.json", progress=False, around_step=recording(steps))
    assert steps == [("load", None), ("observe", None), ("scales", None), ("export", FileExistsError)]
    assert not (tmp_path / "out").exists() and not (tmp_path / "legacy.json").exists()
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["something"]
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before


def test_calibrate_checkpoint_unit_scale_for_all_zero_k(tmp_path):
    model_dir = zero_k_model_dir(tmp_path / "model")
    with pytest.warns(UserWarning, match="all-zero calibration maxima get scale 1.0: layer 0 K"):
        result = calibrate_checkpoint(model_dir, token_batches(BATCHES), tmp_path / "out", zero_amax="unit",
                                      progress=False)
    assert result.amax.k[0] == (0.0,) and result.amax.k[1][0] > 0
    assert result.kv_cache.k_scales[0] == (1.0,)
    assert result.kv_cache.k_scales[1] == (f32(result.amax.k[1][0] / 448),)
    assert load(tmp_path / "out", "float8_e4m3fn").k_scales == result.kv_cache.k_scales


@pytest.mark.parametrize("kwargs, match", [
    (dict(fmt="float8_e5m2"), "e4m3 format"),
    (dict(fmt="fp9"), "fp9"),
    (dict(margin=0.5), "margin must be a finite number >= 1"),
    (dict(zero_amax="floor"), "zero_amax must be one of"),
    (dict(granularity="channel"), "granularity must be one of"),
    (dict(dtype=torch.int8), "dtype must be 'auto' or a floating-point torch.dtype"),
    (dict(dtype="half"), "dtype must be"),
    (dict(device="tpu"), "device must be a torch.device or its name"),
    (dict(legacy_json="legacy.json", granularity="head"), "legacy_json: the legacy JSON holds per-tensor scales"),
    (dict(legacy_json="out/kv_cache_scales.json"), "legacy_json: not kv_cache_scales.json inside out_dir"),
], ids=lambda value: None if isinstance(value, str) else " ".join(f"{k}={v}" for k, v in value.items()))
def test_calibrate_checkpoint_checks_arguments_before_loading(tmp_path, kwargs, match):
    """A bad argument is refused before anything runs: no step starts, on a checkpoint without
    weights (with good arguments the load step is what fails there)."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(llama_config()))
    if "legacy_json" in kwargs:
        kwargs["legacy_json"] = tmp_path / kwargs["legacy_json"]
    steps = []
    with pytest.raises(ValueError, match=match):
        calibrate_checkpoint(model_dir, [], tmp_path / "out", around_step=recording(steps), **kwargs)
    assert steps == []
    with pytest.raises(OSError, match="no file named model.safetensors"):
        calibrate_checkpoint(model_dir, [], tmp_path / "out", around_step=recording(steps))
    assert steps == [("load", OSError)]


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_cli_calibrates_text_and_writes_a_loadable_checkpoint(tmp_path, granularity, capsys):
    model = tiny_model(2)
    model.save_pretrained(tmp_path / "model")
    word_tokenizer().save_pretrained(tmp_path / "model")
    text = " ".join(f"w{i % (VOCAB - 2)}" for i in range(150))
    (tmp_path / "data.txt").write_text(text)
    assert cli.main(["calibrate", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data.txt"),
                     "--out", str(tmp_path / "out"), "--granularity", granularity, "--seq-len", "64",
                     "--batch-size", "2", "--margin", "1.5", "--no-progress", "--device", "cpu"]) == 0
    assert "calibrated 2 layers on 153 tokens" in capsys.readouterr().out  # 150 words + 3 BOS

    # The same data through the Python API and the attention-input reference (both on the CPU: the
    # comparison is exact, and another device's matmuls round differently).
    ids = [1] + [2 + i % (VOCAB - 2) for i in range(150)]
    rows = [torch.tensor([1] + ids[1 + 63 * i:1 + 63 * (i + 1)]) for i in range(3)]
    k, v = attention_inputs_amax(model, [torch.stack(rows[:2]), rows[2][None]], granularity)
    loaded = load(tmp_path / "out", "float8_e4m3fn")
    assert loaded.k_scales == tuple(tuple(f32(a * 1.5 / 448) for a in layer) for layer in k)
    assert loaded.v_scales == tuple(tuple(f32(a * 1.5 / 448) for a in layer) for layer in v)


def test_cli_token_ids_fnuz_and_legacy_json(tmp_path, capsys):
    model = tiny_model(2)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "ids.txt").write_text("1 5 9 13 17 21\n1 2 3\n")
    out, legacy = tmp_path / "out", tmp_path / "legacy.json"
    assert cli.main(["calibrate", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "ids.txt"),
                     "--token-ids", "--out", str(out), "--format", "float8_e4m3fnuz", "--legacy-json", str(legacy),
                     "--no-progress", "--device", "cpu"]) == 0
    fnuz = load(out, "float8_e4m3fnuz")
    k, v = attention_inputs_amax(model, [torch.tensor([[1, 5, 9, 13, 17, 21]]), torch.tensor([[1, 2, 3]])], "tensor")
    assert fnuz.k_scales == tuple((f32(layer[0] / 240),) for layer in k)
    from_json = load(tmp_path / "model", "float8_e4m3fnuz", scales_json=legacy)
    assert from_json.k_scales == tuple((max(a[0], b[0]),) for a, b in zip(fnuz.k_scales, fnuz.v_scales))


def test_cli_blames_all_zero_maxima_on_the_data(tmp_path, capsys):
    model_dir = zero_k_model_dir(tmp_path / "model")
    (tmp_path / "ids.txt").write_text("1 5 9 13\n")
    args = ["calibrate", "--model", str(model_dir), "--data", str(tmp_path / "ids.txt"), "--token-ids",
            "--out", str(tmp_path / "out"), "--no-progress", "--device", "cpu"]
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    err = capsys.readouterr().err  # after transformers' progress bars
    assert info.value.code == 1 and not (tmp_path / "out").exists()
    error = err[err.index("fp8kv calibrate: error: "):]
    assert error.startswith("fp8kv calibrate: error: argument --data: calibration failed (1 problem(s)):\n"), err
    assert "layer 0 K: amax is 0" in error
    with pytest.warns(UserWarning, match="layer 0 K"):
        assert cli.main(args + ["--zero-amax", "unit"]) == 0
    assert load(tmp_path / "out", "float8_e4m3fn").k_scales[0] == (1.0,)


def test_cli_errors(tmp_path):
    model = tiny_model(2)
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "data.txt").write_text("some text")
    common = ["calibrate", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--no-progress"]
    with pytest.raises(SystemExit, match="has no tokenizer.*--token-ids"):
        cli.main(common + ["--data", str(tmp_path / "data.txt")])
    with pytest.raises(SystemExit, match="token ids must be integers"):
        cli.main(common + ["--data", str(tmp_path / "data.txt"), "--token-ids"])
    with pytest.raises(SystemExit, match="--format"):
        cli.main(common + ["--data", str(tmp_path / "data.txt"), "--format", "fp9"])
    with pytest.raises(SystemExit, match="--legacy-json"):
        cli.main(common + ["--data", str(tmp_path / "data.txt"), "--legacy-json",
                           str(tmp_path / "out" / "kv_cache_scales.json")])
    assert not (tmp_path / "out").exists()
