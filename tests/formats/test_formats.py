"""KVCacheDtype parsing and properties; KVCacheConfig validation and immutability."""

import dataclasses
import math
import re
import struct

import pytest
import torch

from fp8kv import formats
from fp8kv.formats import KVCacheConfig, KVCacheDtype

# Names used by vLLM (CacheDType), SGLang (--kv-cache-dtype) and TGI, torch's dtype names, and short ones.
FIXED_NAMES = [(name, fmt) for fmt, names in {
    KVCacheDtype.UNQUANTIZED: ["auto"],
    KVCacheDtype.E5M2: ["fp8_e5m2", "float8_e5m2", "e5m2", " FP8_E5M2 "],
    KVCacheDtype.E4M3FN: ["float8_e4m3fn", "fp8_e4m3fn", "e4m3fn", "torch.float8_e4m3fn"],
    KVCacheDtype.E4M3FNUZ: ["float8_e4m3fnuz", "fp8_e4m3fnuz", "e4m3fnuz"],
}.items() for name in names]


@pytest.mark.parametrize("name, expected", FIXED_NAMES)
@pytest.mark.parametrize("fnuz_platform", [False, True])
def test_fixed_names_do_not_depend_on_the_platform(monkeypatch, name, expected, fnuz_platform):
    monkeypatch.setattr(formats, "platform_uses_fnuz", lambda: fnuz_platform)
    assert KVCacheDtype.parse(name) is expected


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "e4m3", "FP8"])
@pytest.mark.parametrize("fnuz_platform, expected", [(False, KVCacheDtype.E4M3FN), (True, KVCacheDtype.E4M3FNUZ)])
def test_platform_names_follow_the_platform_rule(monkeypatch, name, fnuz_platform, expected):
    monkeypatch.setattr(formats, "platform_uses_fnuz", lambda: fnuz_platform)
    assert KVCacheDtype.parse(name) is expected


def test_platform_rule_on_this_machine():
    # Only a ROCm build on a gfx94x device uses fnuz; a CPU or CUDA build never does.
    if torch.version.hip is None:
        assert formats.platform_uses_fnuz() is False
        assert KVCacheDtype.parse("fp8") is KVCacheDtype.E4M3FN


@pytest.mark.parametrize("member", list(KVCacheDtype))
def test_parse_is_identity_on_members_and_accepts_values(member):
    assert KVCacheDtype.parse(member) is member
    assert KVCacheDtype.parse(member.value) is member


@pytest.mark.parametrize("dtype, expected", [
    (torch.float8_e4m3fn, KVCacheDtype.E4M3FN),
    (torch.float8_e5m2, KVCacheDtype.E5M2),
    (torch.float8_e4m3fnuz, KVCacheDtype.E4M3FNUZ),
])
def test_parse_torch_dtypes(dtype, expected):
    assert KVCacheDtype.parse(dtype) is expected


@pytest.mark.parametrize("bad", ["int8", "fp4_e2m1", "bfloat16", "e3m4", "fp8_ds_mla", "torch.", ""])
def test_unknown_names_list_the_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        KVCacheDtype.parse(bad)
    assert str(info.value) == f"unknown kv cache dtype {bad!r}; valid: {formats.format_names()}"


def test_format_names_list_every_name_once_canonical_first():
    listing = formats.format_names()
    assert listing.startswith("auto (the model's dtype, unquantized), float8_e4m3fn (fp8_e4m3fn, e4m3fn), "
                              "float8_e5m2 (fp8_e5m2, e5m2), float8_e4m3fnuz (fp8_e4m3fnuz, e4m3fnuz), ")
    assert listing.endswith("fp8/fp8_e4m3/e4m3 (float8_e4m3fnuz on MI300 GPUs, else float8_e4m3fn)")
    for name in (*formats._FIXED_NAMES, *formats._PLATFORM_E4M3_NAMES):  # every name parse accepts is listed
        assert re.search(rf"(^|[ (/]){name}([,)/ ]|$)", listing), name
    e4m3_only = formats.format_names(lambda fmt: fmt.is_e4m3)
    assert "e5m2" not in e4m3_only and "auto" not in e4m3_only and "fp8/fp8_e4m3/e4m3" in e4m3_only


def test_non_fp8_torch_dtype_and_wrong_type_are_errors():
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        KVCacheDtype.parse(torch.bfloat16)
    with pytest.raises(TypeError, match="got int"):
        KVCacheDtype.parse(8)


def _max_finite_from_definition(exponent_bits, mantissa_bits, bias, reserved_top_mantissas):
    # Largest code: top exponent field, largest mantissa not reserved for inf/NaN.
    top_exponent = (1 << exponent_bits) - 1 - (1 if reserved_top_mantissas is None else 0)
    mantissa = (1 << mantissa_bits) - 1 - (reserved_top_mantissas or 0)
    return (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (top_exponent - bias)


@pytest.mark.parametrize("member, definition", [
    (KVCacheDtype.E4M3FN, (4, 3, 7, 1)),       # S.1111.111 is NaN
    (KVCacheDtype.E5M2, (5, 2, 15, None)),     # exponent 11111 is inf/NaN
    (KVCacheDtype.E4M3FNUZ, (4, 3, 8, 0)),     # no inf; only 0x80 is NaN
])
def test_max_finite_matches_the_format_definition(member, definition):
    assert member.max_finite == _max_finite_from_definition(*definition)


def test_max_finite_values():
    assert [KVCacheDtype.E4M3FN.max_finite, KVCacheDtype.E5M2.max_finite, KVCacheDtype.E4M3FNUZ.max_finite] == [
        448.0, 57344.0, 240.0]
    with pytest.raises(ValueError, match="no FP8 range"):
        KVCacheDtype.UNQUANTIZED.max_finite


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_torch_dtype(model_dtype):
    assert KVCacheDtype.UNQUANTIZED.torch_dtype(model_dtype) == model_dtype
    assert KVCacheDtype.E4M3FN.torch_dtype(model_dtype) == torch.float8_e4m3fn
    assert KVCacheDtype.E5M2.torch_dtype(model_dtype) == torch.float8_e5m2
    assert KVCacheDtype.E4M3FNUZ.torch_dtype(model_dtype) == torch.float8_e4m3fnuz


def test_format_flags():
    assert [m.is_fp8 for m in KVCacheDtype] == [False, True, True, True]
    assert [m.is_e4m3 for m in KVCacheDtype] == [False, True, False, True]


@pytest.mark.parametrize("calibrated_for, target, factor", [
    (KVCacheDtype.E4M3FN, KVCacheDtype.E4M3FN, 1.0),
    (KVCacheDtype.E4M3FN, KVCacheDtype.E4M3FNUZ, 2.0),
    (KVCacheDtype.E4M3FNUZ, KVCacheDtype.E4M3FN, 0.5),
    (KVCacheDtype.E4M3FNUZ, KVCacheDtype.E4M3FNUZ, 1.0),
    (KVCacheDtype.E4M3FN, KVCacheDtype.E5M2, 1.0),
    (KVCacheDtype.E4M3FNUZ, KVCacheDtype.E5M2, 1.0),
])
def test_scale_conversion_factors(calibrated_for, target, factor):
    assert target.scale_factor_from(calibrated_for) == factor


def test_fnuz_bits_decode_to_half_the_fn_value():
    # The reason for the x2: every e4m3 code but the two special ones means half as much in fnuz.
    codes = torch.arange(256, dtype=torch.uint8)
    fn = codes.view(torch.float8_e4m3fn).float()
    fnuz = codes.view(torch.float8_e4m3fnuz).float()
    ordinary = (codes != 0x7F) & (codes != 0xFF) & (codes != 0x80)
    assert torch.equal(fnuz[ordinary] * 2, fn[ordinary])


@pytest.mark.parametrize("bad_pair", [(KVCacheDtype.E5M2, KVCacheDtype.E4M3FN),
                                      (KVCacheDtype.E4M3FN, KVCacheDtype.UNQUANTIZED)])
def test_scale_conversion_rejects_meaningless_pairs(bad_pair):
    calibrated_for, target = bad_pair
    with pytest.raises(ValueError, match="cannot be converted"):
        target.scale_factor_from(calibrated_for)


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_config_rounds_to_float32_and_builds_tensors():
    config = KVCacheConfig("fp8_e4m3fn", [[0.1], [0.2, 0.3]], [(0.5,), (1.0, 2.0)])
    assert config.dtype is KVCacheDtype.E4M3FN
    assert config.num_layers == 2
    assert config.k_scales == ((_float32(0.1),), (_float32(0.2), _float32(0.3)))
    k = config.k_scale(1)
    assert k.dtype == torch.float32 and k.shape == (2,) and k.tolist() == [_float32(0.2), _float32(0.3)]
    assert config.v_scale(0).shape == (1,)
    assert config.torch_dtype(torch.bfloat16) == torch.float8_e4m3fn


def test_config_is_immutable():
    config = KVCacheConfig.unit_scales("fp8_e5m2", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = KVCacheDtype.E4M3FN
    handed_out = config.k_scale(0)
    handed_out.fill_(7.0)
    assert config.k_scale(0).tolist() == [1.0]
    assert hash(config) == hash(KVCacheConfig.unit_scales("fp8_e5m2", 3))


@pytest.mark.parametrize("k, v, message", [
    ([[1.0]], [[1.0], [1.0]], "k_scales has 1 layers but v_scales has 2"),
    ([], [], "at least one layer"),
    ([[]], [[1.0]], r"k_scales\[0\] is empty"),
    ([[1.0, math.nan]], [[1.0]], r"k_scales\[0\]\[1\] = nan"),
    ([[1.0]], [[0.0]], r"v_scales\[0\]\[0\] = 0.0"),
    ([[1.0]], [[-2.0]], r"v_scales\[0\]\[0\] = -2.0"),
    ([[math.inf]], [[1.0]], r"k_scales\[0\]\[0\] = inf"),
    ([[1e39]], [[1.0]], r"k_scales\[0\]\[0\] = inf"),  # overflows float32
])
def test_config_rejects_bad_scales(k, v, message):
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(KVCacheDtype.E4M3FN, k, v)


@pytest.mark.parametrize("arguments, error, message", [
    (dict(k_scales=0.02), TypeError, r"^KVCacheConfig: k_scales must be a sequence with one float or num_kv_heads "
     r"floats per layer, e\.g\. \[\(0\.02,\)\] \* num_layers, got float 0\.02$"),
    (dict(v_scales="0.02"), TypeError, "v_scales must be a sequence .* got str '0.02'"),
    (dict(k_scales={0: 0.02}), TypeError, "k_scales must be a sequence .* got dict"),
    (dict(k_scales=[None]), TypeError, r"k_scales\[0\] must be a float or a sequence of floats, got NoneType None"),
    (dict(k_scales=[["0.02"]]), TypeError, r"k_scales\[0\] must be a float or a sequence of floats"),
    (dict(k_scales=[[[0.1, 0.2]]]), ValueError, r"k_scales\[0\] has shape \[1, 2\]; expected 1 or num_kv_heads"),
    (dict(k_offsets=0.5), TypeError, r"k_offsets must be a sequence with \[num_kv_heads\]\[head_size\] floats per "
     "layer, got float 0.5"),
    (dict(k_offsets=[object()]), TypeError, r"k_offsets\[0\] must be \[num_kv_heads\]\[head_size\] floats, got object"),
])
def test_config_arguments_of_the_wrong_type_are_named_with_the_expected_type(arguments, error, message):
    # k_scales=0.02 raised "'float' object is not iterable"; a nested list was flattened into per-head scales.
    with pytest.raises(error, match=message):
        KVCacheConfig(**{"dtype": "fp8_e4m3fn", "k_scales": [(1.0,)], "v_scales": [(1.0,)], **arguments})


def test_config_takes_tensors_and_sequences_of_any_kind():
    config = KVCacheConfig("fp8_e4m3fn", torch.full((2, 4), 0.5), (0.25, torch.tensor(0.125)))
    assert config.k_scales == ((0.5,) * 4,) * 2 and config.v_scales == ((0.25,), (0.125,))


def test_config_rejects_unknown_dtype_name():
    with pytest.raises(ValueError, match="unknown kv cache dtype"):
        KVCacheConfig("int4", [[1.0]], [[1.0]])
