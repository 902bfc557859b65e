"""Loading KV cache scales from synthetic checkpoints: every supported form, tensor-parallel slicing,
format conversion, and the malformed inputs that must be hard errors naming file and tensor."""

import json
import math
import struct
import warnings

import pytest
import torch

from checkpoints import (ATTENTION, assert_reported, compressed_tensors_config, edit_index, legacy_json, llama_config,
                         scale_tensors, write_checkpoint)
import fp8kv  # noqa: F401  (loads torch.ops.fp8kv)
from fp8kv.checkpoint import CheckpointError, load_kv_cache_config, read_checkpoint_scales, shard_kv_heads
from fp8kv.formats import KVCacheConfig, KVCacheDtype

# Scales that bf16 and fp16 hold exactly, so every stored dtype must load the same float32 value.
K = [0.0625, 0.375]
V = [0.125, 1.5]
K_HEADS = [[0.5, 0.25, 0.125, 0.0625], [1.0, 2.0, 4.0, 8.0]]
V_HEADS = [[0.75, 0.375, 0.1875, 3.0], [0.5, 0.5, 0.25, 6.0]]


def f32(x: float) -> float:
    """float32 rounding by the IEEE encoder of the struct module (independent of torch)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def load(directory, cache_dtype="float8_e4m3fn", **kwargs) -> KVCacheConfig:
    """The plain recipe's config (the scales other engines read; the rotated recipe: test_rotated_recipe.py)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a supported checkpoint with scales loads without warnings
        return load_kv_cache_config(directory, cache_dtype, **{"rotation": "none", **kwargs})


# ----------------------------------------------------------------------------- supported forms


@pytest.mark.parametrize("shape", ["scalar", "one"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("form", ["k_scale", "modelopt"])
def test_per_tensor_scales_in_any_shape_and_dtype(tmp_path, shape, dtype, form):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V, form=form, shape=shape, dtype=dtype))
    config = load(tmp_path)
    assert config.dtype is KVCacheDtype.E4M3FN
    assert config.k_scales == tuple((k,) for k in K)
    assert config.v_scales == tuple((v,) for v in V)


def test_float64_scales_are_rounded_to_float32(tmp_path):
    write_checkpoint(tmp_path, tensors=scale_tensors([0.1, 0.2], [0.3, 0.7], dtype=torch.float64))
    config = load(tmp_path)
    assert config.k_scales == ((f32(0.1),), (f32(0.2),))
    assert config.v_scales == ((f32(0.3),), (f32(0.7),))


def test_legacy_kv_scale_scales_both(tmp_path):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, None, form="kv_scale", shape="one"))
    config = load(tmp_path)
    assert config.k_scales == config.v_scales == tuple((k,) for k in K)


@pytest.mark.parametrize("shape", ["heads", "heads11"])
@pytest.mark.parametrize("declare", [None, "compressed-tensors"])
def test_per_head_scales(tmp_path, shape, declare):
    config_json = llama_config()
    if declare:
        config_json["quantization_config"] = compressed_tensors_config("attn_head")
    write_checkpoint(tmp_path, config=config_json, tensors=scale_tensors(K_HEADS, V_HEADS, shape=shape))
    config = load(tmp_path)
    assert config.k_scales == tuple(tuple(h) for h in K_HEADS)
    assert config.v_scales == tuple(tuple(h) for h in V_HEADS)
    assert config.k_scale(1).tolist() == K_HEADS[1]


def test_compressed_tensors_per_tensor(tmp_path):
    config_json = llama_config(quantization_config=compressed_tensors_config("tensor"))
    write_checkpoint(tmp_path, config=config_json, tensors=scale_tensors(K, V))
    found = read_checkpoint_scales(tmp_path)
    assert found.declared == ("compressed-tensors kv_cache_scheme (strategy tensor)",)
    assert load(tmp_path).k_scales == tuple((k,) for k in K)


@pytest.mark.parametrize("where", ["config", "hf_quant_config"])
def test_modelopt_declared_fp8(tmp_path, where):
    config_json, hf_quant = llama_config(), None
    if where == "config":
        config_json["quantization_config"] = {"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}
    else:
        hf_quant = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
    write_checkpoint(tmp_path, config=config_json, hf_quant_config=hf_quant,
                     tensors=scale_tensors(K, V, form="modelopt", shape="one"))
    assert load(tmp_path).v_scales == tuple((v,) for v in V)
    assert read_checkpoint_scales(tmp_path).forms == ("ModelOpt k_proj.k_scale", "ModelOpt v_proj.v_scale")


@pytest.mark.parametrize("shards, index", [(2, True), (3, True), (2, False)])
def test_sharded_checkpoints(tmp_path, shards, index):
    write_checkpoint(tmp_path, shards=shards, index=index, tensors=scale_tensors(K_HEADS, V_HEADS))
    config = load(tmp_path)
    assert config.k_scales == tuple(tuple(h) for h in K_HEADS)
    assert config.v_scales == tuple(tuple(h) for h in V_HEADS)


def test_text_config_geometry(tmp_path):
    config_json = {"model_type": "llava", "text_config": llama_config(num_layers=2, num_kv_heads=4)}
    write_checkpoint(tmp_path, config=config_json, tensors=scale_tensors(K_HEADS, V_HEADS))
    assert load(tmp_path).k_scales[0] == tuple(K_HEADS[0])


def test_geometry_may_come_from_the_caller(tmp_path):
    config_json = {"model_type": "custom"}
    write_checkpoint(tmp_path, config=config_json, tensors=scale_tensors(K_HEADS, V_HEADS))
    assert load(tmp_path, num_layers=2, num_kv_heads=4).k_scales[1] == tuple(K_HEADS[1])


# ----------------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("num_kv_heads, tp_size", [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (2, 8), (8, 2)])
def test_per_head_scales_are_sliced_per_rank(tmp_path, num_kv_heads, tp_size):
    k = [[0.25 * (h + 1) + layer for h in range(num_kv_heads)] for layer in range(2)]
    v = [[0.125 * (h + 2) + layer for h in range(num_kv_heads)] for layer in range(2)]
    write_checkpoint(tmp_path, num_kv_heads=num_kv_heads, tensors=scale_tensors(k, v, shape="heads11"))
    for rank in range(tp_size):
        config = load(tmp_path, tp_rank=rank, tp_size=tp_size)
        # Reference: the global head ids this rank holds. Split evenly, or replicated when there
        # are fewer KV heads than ranks (consecutive ranks share a head).
        if num_kv_heads >= tp_size:
            per_rank = num_kv_heads // tp_size
            heads = list(range(rank * per_rank, (rank + 1) * per_rank))
        else:
            heads = [rank * num_kv_heads // tp_size]
        for layer in range(2):
            assert config.k_scales[layer] == tuple(k[layer][h] for h in heads)
            assert config.v_scales[layer] == tuple(v[layer][h] for h in heads)


def test_per_tensor_scales_are_the_same_on_every_rank(tmp_path):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
    assert all(load(tmp_path, tp_rank=r, tp_size=4).k_scales == tuple((k,) for k in K) for r in range(4))


def test_shard_kv_heads_rejects_indivisible_counts():
    with pytest.raises(ValueError, match="num_kv_heads=3 cannot be split across tp_size=2"):
        shard_kv_heads((1.0, 2.0, 3.0), 0, 2)


@pytest.mark.parametrize("tp_rank, tp_size, message", [(0, 0, "tp_size must be"), (2, 2, "tp_rank must be"),
                                                       (-1, 2, "tp_rank must be")])
def test_bad_tp_arguments(tmp_path, tp_rank, tp_size, message):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
    with pytest.raises(ValueError, match=message):
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none", tp_rank=tp_rank, tp_size=tp_size)


def test_indivisible_heads_for_tp_size(tmp_path):
    write_checkpoint(tmp_path, num_kv_heads=6, tensors=scale_tensors(K, V))
    with pytest.raises(ValueError, match="num_kv_heads=6 .* cannot be split across tp_size=4"):
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none", tp_size=4)


# ----------------------------------------------------------------------------- legacy JSON


def test_legacy_json_single_rank_applies_to_every_rank(tmp_path):
    write_checkpoint(tmp_path, legacy_json=legacy_json({0: {0: 0.25, 1: 0.5}}))
    for rank in range(2):
        config = load(tmp_path, tp_rank=rank, tp_size=2)
        assert config.k_scales == config.v_scales == ((0.25,), (0.5,))


def test_legacy_json_per_rank(tmp_path):
    write_checkpoint(tmp_path, legacy_json=legacy_json({0: {0: 0.25, 1: 0.5}, 1: {0: 0.75, 1: 0.1}}))
    assert load(tmp_path, tp_rank=1, tp_size=2).k_scales == ((0.75,), (f32(0.1),))
    assert load(tmp_path, tp_rank=0, tp_size=2).v_scales == ((0.25,), (0.5,))


def test_legacy_json_given_explicitly(tmp_path):
    write_checkpoint(tmp_path / "model")
    path = tmp_path / "elsewhere.json"
    path.write_text(json.dumps(legacy_json({0: {0: 2.0, 1: 4.0}})))
    assert load(tmp_path / "model", scales_json=path).k_scales == ((2.0,), (4.0,))


# ----------------------------------------------------------------------------- format conversion


@pytest.mark.parametrize("calibrated_for, hint_place", [
    ("float8_e4m3fn", None),
    ("float8_e4m3fn", "quantization_config"),
    ("float8_e4m3fnuz", "quantization_config"),
    ("float8_e4m3fnuz", "top"),
    ("float8_e4m3fnuz", "json"),
])
@pytest.mark.parametrize("cache", ["float8_e4m3fn", "float8_e4m3fnuz", "fp8_e5m2"])
def test_scales_are_converted_to_the_cache_format(tmp_path, calibrated_for, hint_place, cache):
    config_json, tensors, json_file = llama_config(), scale_tensors(K, V), None
    if hint_place == "quantization_config":
        config_json["quantization_config"] = {**compressed_tensors_config(), "kv_cache_torch_dtype": calibrated_for}
    elif hint_place == "top":
        config_json["kv_cache_torch_dtype"] = calibrated_for
    elif hint_place == "json":
        tensors, json_file = None, legacy_json({0: {0: K[0], 1: K[1]}}, dtype=calibrated_for)
    write_checkpoint(tmp_path, config=config_json, tensors=tensors, legacy_json=json_file)
    expected_factor = {("float8_e4m3fn", "float8_e4m3fnuz"): 2.0, ("float8_e4m3fnuz", "float8_e4m3fn"): 0.5}.get(
        (calibrated_for, cache), 1.0)
    config = load(tmp_path, cache)
    assert config.k_scales == tuple((k * expected_factor,) for k in K)
    assert (f"x{expected_factor:g} for {cache}" in config.source) == (expected_factor != 1.0)


def test_fnuz_cache_from_fn_scales_dequantizes_to_the_same_values(tmp_path):
    # End to end: an e4m3fnuz cache built from e4m3fn-calibrated scales holds the bits an e4m3fn
    # cache holds (the x2 compensates fnuz decoding every code to half), so both dequantize alike.
    num_kv_heads, head_size = 4, 16
    write_checkpoint(tmp_path, tensors=scale_tensors(K_HEADS, V_HEADS, shape="heads"))
    fn = load(tmp_path, "float8_e4m3fn")
    fnuz = load(tmp_path, "float8_e4m3fnuz")
    generator = torch.Generator().manual_seed(0)
    for layer in range(2):
        # |x / s| up to ~80 * 4: the whole e4m3 range below saturation, subnormals included.
        k_heads, v_heads = torch.tensor(K_HEADS[layer])[:, None], torch.tensor(V_HEADS[layer])[:, None]
        key = (torch.randn(64, num_kv_heads, head_size, generator=generator) * 80 * k_heads).to(torch.bfloat16)
        value = (torch.randn(64, num_kv_heads, head_size, generator=generator) * 80 * v_heads).to(torch.bfloat16)
        assert (key.float().abs() / k_heads).max() < 448 and (value.float().abs() / v_heads).max() < 448
        dequantized = {}
        for config in (fn, fnuz):
            k_cache = torch.empty(4, 16, num_kv_heads, head_size, dtype=config.torch_dtype(torch.bfloat16))
            v_cache = torch.empty_like(k_cache)
            k_scale, v_scale = config.k_scale(layer), config.v_scale(layer)
            torch.ops.fp8kv.reshape_and_cache(key, value, k_cache, v_cache, torch.arange(64), k_scale, v_scale)
            dequantized[config.dtype] = (k_cache.float().reshape(64, num_kv_heads, head_size) * k_scale[:, None],
                                         v_cache.float().reshape(64, num_kv_heads, head_size) * v_scale[:, None])
        assert torch.equal(dequantized[KVCacheDtype.E4M3FN][0], dequantized[KVCacheDtype.E4M3FNUZ][0])
        assert torch.equal(dequantized[KVCacheDtype.E4M3FN][1], dequantized[KVCacheDtype.E4M3FNUZ][1])


# ----------------------------------------------------------------------------- no scales


@pytest.mark.parametrize("cache", ["float8_e4m3fn", "float8_e4m3fnuz"])
def test_e4m3_without_scales_uses_one_and_warns_once(tmp_path, cache):
    write_checkpoint(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_kv_cache_config(tmp_path, cache, rotation="none")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert str(tmp_path) in message and "scale 1.0" in message and "calibrate" in message
    assert config.k_scales == config.v_scales == ((1.0,), (1.0,))


def test_e5m2_without_scales_uses_one_silently(tmp_path):
    write_checkpoint(tmp_path)
    config = load(tmp_path, "fp8_e5m2")
    assert config.k_scales == ((1.0,), (1.0,)) and config.dtype is KVCacheDtype.E5M2


def test_unquantized_cache_reads_no_scales(tmp_path):
    # A broken scale does not matter to an unquantized cache: it never reads scales.
    write_checkpoint(tmp_path, tensors={f"{ATTENTION.format(0)}.k_scale": torch.tensor(math.nan)})
    config = load(tmp_path, "auto")
    assert config.dtype is KVCacheDtype.UNQUANTIZED and config.num_layers == 2


def test_exported_float32_scales_load_back_identically(tmp_path):
    # What calibration does: scale = amax / 448 in float32, written as [num_kv_heads] tensors.
    amax = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) * 30 + 0.5
    scales = (amax / 448.0).tolist()
    write_checkpoint(tmp_path, tensors=scale_tensors(scales, scales, shape="heads"))
    config = load(tmp_path)
    assert config.k_scales == tuple(tuple((amax[layer] / 448.0).tolist()) for layer in range(2))


# ----------------------------------------------------------------------------- malformed inputs


def _tensors_with(layer0_k):
    tensors = scale_tensors(K_HEADS, V_HEADS)
    tensors[f"{ATTENTION.format(0)}.k_scale"] = layer0_k
    return tensors


K0 = f"{ATTENTION.format(0)}.k_scale"


def _bad_index(tmp_path):
    write_checkpoint(tmp_path, shards=2, tensors=scale_tensors(K, V))
    edit_index(tmp_path, **{K0: "model-00009-of-00009.safetensors"})
    return "model.safetensors.index.json", K0


def _index_lists_absent_tensor(tmp_path):
    write_checkpoint(tmp_path, shards=2, tensors=scale_tensors(K, V))
    edit_index(tmp_path, **{"model.layers.1.self_attn.kv_scale": "model-00001-of-00002.safetensors"})
    return "model-00001-of-00002.safetensors", "model.layers.1.self_attn.kv_scale"


def _garbage_shard(tmp_path):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
    (tmp_path / "model.safetensors").write_bytes(b"\x00\x01garbage")
    return "model.safetensors", None


def _duplicate_across_shards(tmp_path):
    write_checkpoint(tmp_path, shards=2, index=False, tensors=scale_tensors(K, V))
    from safetensors.torch import save_file
    save_file({K0: torch.tensor(0.5)}, str(tmp_path / "extra.safetensors"))
    return "extra.safetensors", K0


def _only_pickled(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({K0: torch.tensor(1.0)}, tmp_path / "pytorch_model.bin")
    return str(tmp_path), "pytorch_model.bin"


def _json_case(data, tensor, raw=None):
    def build(tmp_path):
        write_checkpoint(tmp_path)
        (tmp_path / "kv_cache_scales.json").write_text(raw if raw is not None else json.dumps(data))
        return "kv_cache_scales.json", tensor
    return build


def _config_case(quantization_config=None, tensors=None, top=None, hf_quant=None, file="config.json", tensor=None):
    def build(tmp_path):
        config = llama_config(**(top or {}))
        if quantization_config is not None:
            config["quantization_config"] = quantization_config
        write_checkpoint(tmp_path, config=config, tensors=tensors, hf_quant_config=hf_quant)
        return file, tensor
    return build


def _tensor_case(tensors, tensor, file="model.safetensors", **kwargs):
    def build(tmp_path):
        write_checkpoint(tmp_path, tensors=tensors, **kwargs)
        return file, tensor
    return build


def _missing_dir(tmp_path):
    return str(tmp_path / "nowhere"), None, {"checkpoint_dir": tmp_path / "nowhere"}


def _missing_config(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    return "config.json", None


def _bad_config_json(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2,')
    return "config.json", None


def _no_layer_count(tmp_path):
    write_checkpoint(tmp_path, config={"model_type": "llama", "num_key_value_heads": 4})
    return "config.json", "num_hidden_layers"


def _missing_json_given(tmp_path):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
    return str(tmp_path / "absent.json"), None, {"scales_json": tmp_path / "absent.json"}


MALFORMED = {
    "missing directory": (_missing_dir, "does not exist"),
    "missing config.json": (_missing_config, "missing"),
    "config.json is not JSON": (_bad_config_json, "invalid JSON"),
    "no layer count": (_no_layer_count, "missing; pass num_layers="),
    "NaN scale": (_tensor_case(_tensors_with(torch.tensor([0.5, math.nan, 0.5, 0.5])), K0), r"value \[1\] nan"),
    "inf scale": (_tensor_case(_tensors_with(torch.tensor(math.inf)), K0), "value inf must be finite"),
    "zero scale": (_tensor_case(_tensors_with(torch.tensor([0.0])), K0), "value 0.0 must be finite and > 0"),
    "negative scale": (_tensor_case(_tensors_with(torch.tensor([0.5, 0.5, 0.5, -1.0])), K0), r"value \[3\] -1.0"),
    "float overflow to inf": (_tensor_case(_tensors_with(torch.tensor(1e300, dtype=torch.float64)), K0), "inf"),
    "wrong head count": (_tensor_case(_tensors_with(torch.ones(3)), K0), r"shape \[3\] is none of"),
    "wrong 3d shape": (_tensor_case(_tensors_with(torch.ones(5, 1, 1)), K0), r"shape \[5, 1, 1\]"),
    "integer scale": (_tensor_case(_tensors_with(torch.tensor([1], dtype=torch.int32)), K0), "floating point"),
    "layer out of range": (_tensor_case(scale_tensors(K + [0.5], V + [0.5]), "model.layers.2.self_attn.k_scale"),
                           "layer 2 is outside the model's 2 layers"),
    "some layers only": (_tensor_case(scale_tensors(K, V, layers=[0]), "model.layers.1.self_attn.k_scale"),
                         "no k_scale for layer\\(s\\) 1 of the model's 2"),
    "k without v": (_tensor_case({k: t for k, t in scale_tensors(K, V).items() if "v_scale" not in k},
                                 "model.layers.0.self_attn.v_scale"), "no v_scale for layer\\(s\\) 0-1"),
    "k_scale and kv_scale": (_tensor_case({**scale_tensors(K, V), "model.layers.1.self_attn.kv_scale": torch.tensor(1.0)},
                                          "model.layers.1.self_attn.k_scale"), "conflicting k_scale sources for layer 1"),
    "vLLM and ModelOpt names": (_tensor_case({**scale_tensors(K, V), **scale_tensors(K, V, form="modelopt")}, K0),
                                "conflicting k_scale sources for layer 0"),
    "no layer index": (_tensor_case({"lm_head.k_scale": torch.tensor(1.0)}, "lm_head.k_scale"), "no layer index"),
    "mixed module patterns": (_tensor_case({**scale_tensors(K, V, layers=[0]), **{
        "model.decoder.layers.1.attn.k_scale": torch.tensor(1.0), "model.decoder.layers.1.attn.v_scale": torch.tensor(1.0)}},
        "model.decoder.layers.1.attn.k_scale", file=None), "different module patterns"),
    "index names a missing shard": (_bad_index, "does not exist"),
    "index lists an absent tensor": (_index_lists_absent_tensor, "not stored in this shard"),
    "unreadable safetensors": (_garbage_shard, "cannot read safetensors file"),
    "same tensor in two files": (_duplicate_across_shards, "conflicting copies"),
    "pickled weights only": (_only_pickled, "safetensors files only"),
    "JSON and tensors": (lambda p: (write_checkpoint(p, tensors=scale_tensors(K, V),
                                                     legacy_json=legacy_json({0: {0: 1.0, 1: 1.0}})),
                                    ("kv_cache_scales.json", "k_scale"))[1], "conflicting sources"),
    "legacy JSON not JSON": (_json_case(None, None, raw="{'kv_cache': 1}"), "invalid JSON"),
    "legacy JSON missing layer": (_json_case(legacy_json({0: {0: 1.0}}), "kv_cache.scaling_factor[0]"),
                                  "must have layers 0..1"),
    "legacy JSON NaN": (_json_case(legacy_json({0: {0: 1.0, 1: math.nan}}), "kv_cache.scaling_factor[0][1]"),
                        "finite number > 0"),
    "legacy JSON string scale": (_json_case(legacy_json({0: {0: "1.0", 1: 1.0}}), "kv_cache.scaling_factor[0][0]"),
                                 "finite number > 0"),
    "legacy JSON e5m2 dtype": (_json_case(legacy_json({0: {0: 1.0, 1: 1.0}}, dtype="float8_e5m2"), "kv_cache.dtype"),
                               "must be one of"),
    "legacy JSON model_type": (_json_case(legacy_json({0: {0: 1.0, 1: 1.0}}, model_type="qwen2"), "model_type"),
                               "'qwen2' but config.json says 'llama'"),
    "legacy JSON ranks": (_json_case(legacy_json({0: {0: 1.0, 1: 1.0}, 2: {0: 1.0, 1: 1.0}}), "kv_cache.scaling_factor"),
                          "ranks must be 0..1"),
    "legacy JSON without kv_cache": (_json_case({"model_type": "llama"}, "kv_cache"), "missing or not an object"),
    "scales_json does not exist": (_missing_json_given, "does not exist"),
    "kv_cache_scheme without tensors": (_config_case(compressed_tensors_config("tensor"), tensor="quantization_config"),
                                        "no scale tensors were found"),
    "dynamic kv_cache_scheme": (_config_case(compressed_tensors_config("tensor", dynamic=True), scale_tensors(K, V),
                                             tensor="quantization_config.kv_cache_scheme"), "dynamic=true"),
    "int8 kv_cache_scheme": (_config_case(compressed_tensors_config("tensor", type="int"), scale_tensors(K, V),
                                          tensor="quantization_config.kv_cache_scheme"), "type must be 'float'"),
    "strategy tensor with per-head scales": (_config_case(compressed_tensors_config("tensor"),
                                                          scale_tensors(K_HEADS, V_HEADS), file="model.safetensors",
                                                          tensor=K0), "strategy 'tensor' needs one scale"),
    "strategy attn_head with one scale": (_config_case(compressed_tensors_config("attn_head"), scale_tensors(K, V),
                                                       file="model.safetensors", tensor=K0), "needs 4 scales, got 1"),
    "unknown strategy": (_config_case(compressed_tensors_config("channel"), scale_tensors(K, V),
                                      tensor="quantization_config.kv_cache_scheme"), "strategy must be"),
    "ModelOpt INT8": (_config_case({"quant_method": "modelopt", "kv_cache_quant_algo": "INT8"}, scale_tensors(K, V),
                                   tensor="quantization_config.kv_cache_quant_algo"), "only 'FP8'"),
    "ModelOpt declared, no tensors": (_config_case(hf_quant={"quantization": {"kv_cache_quant_algo": "FP8"}},
                                                   tensor="quantization_config"), "no scale tensors were found"),
    "bad kv_cache_torch_dtype": (_config_case(top={"kv_cache_torch_dtype": "float8_e5m2"}, tensors=scale_tensors(K, V),
                                              tensor="kv_cache_torch_dtype"), "must be one of"),
    "conflicting calibration formats": (_config_case(
        {**compressed_tensors_config(), "kv_cache_torch_dtype": "float8_e4m3fn"}, scale_tensors(K, V),
        top={"kv_cache_torch_dtype": "float8_e4m3fnuz"}, tensor="kv_cache_torch_dtype"),
        "conflicting calibration formats"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoints_are_errors_naming_file_and_tensor(tmp_path, case):
    build, message = MALFORMED[case]
    file, tensor, *load_kwargs = build(tmp_path)
    load_kwargs = {"checkpoint_dir": tmp_path, **(load_kwargs[0] if load_kwargs else {})}
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(cache_dtype="float8_e4m3fn", **load_kwargs)
    assert_reported(info.value.problems, message, file, tensor)
    # inspect reports the same problems instead of raising
    checkpoint_dir = load_kwargs.pop("checkpoint_dir")
    assert read_checkpoint_scales(checkpoint_dir, **load_kwargs).problems == info.value.problems


def test_malformed_case_count():
    assert len(MALFORMED) >= 15


def test_given_geometry_must_agree_with_config(tmp_path):
    write_checkpoint(tmp_path, tensors=scale_tensors(K, V))
    with pytest.raises(CheckpointError, match="config.json: num_hidden_layers: is 2 but num_layers=3 was given"):
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none", num_layers=3)


def test_legacy_json_rank_count_must_match_tp_size(tmp_path):
    write_checkpoint(tmp_path, legacy_json=legacy_json({0: {0: 1.0, 1: 1.0}, 1: {0: 1.0, 1: 1.0}}))
    with pytest.raises(CheckpointError, match=r"kv_cache_scales.json: kv_cache.scaling_factor: has scales for 2 "
                                              r"tensor-parallel ranks; expected 1 or tp_size=4"):
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none", tp_size=4, tp_rank=0)


def test_every_problem_is_reported_at_once(tmp_path):
    tensors = scale_tensors(K, V)
    tensors[K0] = torch.tensor(-1.0)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(math.nan)
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(CheckpointError) as info:
        load_kv_cache_config(tmp_path, "fp8_e4m3fn", rotation="none")
    assert len(info.value.problems) >= 2
    assert K0 in str(info.value) and "model.layers.1.self_attn.v_scale" in str(info.value)


# ----------------------------------------------------------------------------- inspect command


def test_inspect_prints_per_head_scales(tmp_path, capsys):
    from fp8kv.cli import main

    config_json = llama_config(quantization_config=compressed_tensors_config("attn_head"))
    write_checkpoint(tmp_path, config=config_json, tensors=scale_tensors(K_HEADS, V_HEADS, shape="heads11"))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "compressed-tensors kv_cache_scheme (strategy attn_head)" in out
    assert "per KV head" in out and "no problems found" in out
    assert "0.5 0.25 0.125 0.0625" in out and "model.layers.0.self_attn.k_scale" in out
    assert "0.5 0.5 0.25 6" in out and "model.layers.1.self_attn.v_scale" in out


def test_inspect_lists_every_problem_and_fails(tmp_path, capsys):
    from fp8kv.cli import main

    tensors = scale_tensors(K, V)
    tensors[K0] = torch.tensor(-1.0)
    tensors["model.layers.1.self_attn.v_scale"] = torch.ones(3)
    write_checkpoint(tmp_path, tensors=tensors)
    assert main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 problem(s)" in out
    assert f"{tmp_path / 'model.safetensors'}: {K0}: value -1.0 must be finite and > 0" in out
    assert "model.layers.1.self_attn.v_scale: shape [3]" in out


def test_inspect_without_scales_and_with_legacy_json(tmp_path, capsys):
    from fp8kv.cli import main

    write_checkpoint(tmp_path / "plain")
    assert main(["inspect", str(tmp_path / "plain")]) == 0
    assert "no KV cache scales: an e4m3 cache would use 1.0" in capsys.readouterr().out
    write_checkpoint(tmp_path / "json", legacy_json=legacy_json({0: {0: 0.25, 1: 0.5}}, dtype="float8_e4m3fnuz"))
    assert main(["inspect", str(tmp_path / "json")]) == 0
    out = capsys.readouterr().out
    assert "calibrated for:  float8_e4m3fnuz" in out and "rank 0: 0.25 0.5" in out


def test_inspect_reports_only_what_it_could_read(tmp_path, capsys):
    from fp8kv.cli import main

    # Nothing could be read: the checkpoint and its problem, no model, declared or scales line.
    assert main(["inspect", str(tmp_path / "nowhere")]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"checkpoint:      {tmp_path / 'nowhere'}", "", "1 problem(s):", f"  - {tmp_path / 'nowhere'}: does not exist"]
    (tmp_path / "file").write_text("")
    assert main(["inspect", str(tmp_path / "file")]) == 1
    assert f"{tmp_path / 'file'}: is not a checkpoint directory" in capsys.readouterr().out
    (tmp_path / "no_config").mkdir()
    assert main(["inspect", str(tmp_path / "no_config")]) == 1
    out = capsys.readouterr().out
    assert "config.json: missing" in out and "model:" not in out and "scales:" not in out


@pytest.mark.parametrize("scales_json", ["absent.json", "broken.json"])
def test_inspect_with_an_unreadable_scales_json_still_reports_the_checkpoints_scales(tmp_path, scales_json, capsys):
    from fp8kv.cli import main

    write_checkpoint(tmp_path / "ckpt", tensors=scale_tensors(K, V))
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["inspect", str(tmp_path / "ckpt"), "--scales-json", str(tmp_path / scales_json)]) == 1
    out = capsys.readouterr().out
    assert "scales:          k_scale, v_scale\n" in out and "0  K     " in out and "1 problem(s):" in out
    assert f"{tmp_path / scales_json}: " in out
