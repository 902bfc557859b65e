"""fp8kv's vLLM attention backend inside vLLM, on vLLM's CPU platform (fp8kv's CPU kernels).

Runs where the vLLM version pyproject.toml's [vllm] extra pins is installed (scripts/test_vllm.sh
makes that environment; elsewhere the module skips). What vLLM does is done by vLLM's own code:
the entry point is loaded by vLLM's plugin loader, scales by vLLM's KV-cache quantization methods,
the cache planned by vLLM's KV-cache planner and viewed by its create_kv_cache_views, and each step
runs through vLLM's `Attention` layer and its custom ops. Only the model runner is emulated: `Engine`
builds each step's CommonAttentionMetadata as vLLM's GPU model runner does (decode requests first,
padding requests with query length 0 and seq_len 0, null block 0 in their table rows, slot -1 for
padding tokens).

After every step the whole cache buffer (both layers planned in it) must hold exactly the bytes
reference.py's encoder gives for the tokens written so far, with the scales vLLM holds, and the
format's NaN code everywhere else; the output must be within reference.py's float64 bound of
attention over those values; a padding request's output row is zero.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import math
import pickle
import subprocess
import sys
import tomllib
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")
from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cpu():
    pytest.skip("needs vLLM's CPU platform: fp8kv's test platform (tests/vllm_test_platform, which "
                "scripts/test_vllm.sh installs), or VLLM_TARGET_DEVICE=cpu", allow_module_level=True)

from reference import (FORMAT_BY_DTYPE, AttentionReference, assert_within, calibrated_scales,  # noqa: E402
                       covering_grid, paged_attention_reference, quantization_error_bound, quantization_spacing,
                       random_kv)
from vllm.config import AttentionConfig, CacheConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsKVCacheMethod)
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.v1.attention.backend import (AttentionBackend, AttentionCGSupport, AttentionImpl,  # noqa: E402
                                       AttentionLayer, AttentionMetadataBuilder, CommonAttentionMetadata)
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: E402
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, PAD_SLOT_ID  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheLayout, create_kv_cache_views  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from rotated_reference import rotate_float32  # noqa: E402
from vllm_pages import ExpectedPages, Requests, poison  # noqa: E402

from fp8kv.evaluate.caches import converted  # noqa: E402
from fp8kv.formats import KVCacheConfig, KVCacheDtype  # noqa: E402
from fp8kv.integrations import vllm as plugin  # noqa: E402
from fp8kv.integrations import vllm_backend  # noqa: E402
from fp8kv.integrations import vllm_recipe as recipe  # noqa: E402
from fp8kv.integrations.vllm import AttentionMetadata  # noqa: E402
from fp8kv.integrations.vllm_backend import (Fp8kvAttentionBackend, Fp8kvAttentionImpl,  # noqa: E402
                                             Fp8kvMetadataBuilder)
from fp8kv.rotation import Rotation  # noqa: E402

LAYER, OTHER_LAYER = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
NUM_BLOCKS = 48
POOL, MAX_REQUESTS = 150, 3  # tokens per request at most, requests per engine
NUM_REQS_PADDED = 5  # the decode step's batch, padded as for a captured CUDA graph
SOFT_CAP = 30.0
# vLLM's cache dtype names, and the e4m3 format on a platform whose FP8 is e4m3fnuz (MI300),
# emulated by making the CPU platform answer as that one does.
CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_fnuz"]
# Scales as vLLM loads them: a 0-dim tensor (an FP8 checkpoint's per-tensor scale), [1]
# (compressed-tensors, strategy "tensor"), [num_kv_heads] (compressed-tensors, "attn_head").
SCALES = ["per_tensor", "per_tensor_1", "per_head"]


@pytest.fixture(scope="module", autouse=True)
def plugins():
    load_general_plugins()


@contextmanager
def default_dtype(dtype: torch.dtype):
    """vLLM builds a model's layers under its dtype as torch's default (the layer reads it)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def fake_fnuz_platform(monkeypatch) -> None:
    """The CPU platform answering as MI300's does: FP8 is e4m3fnuz (vLLM then doubles checkpoint scales)."""
    monkeypatch.setattr(current_platform, "fp8_dtype", lambda: torch.float8_e4m3fnuz)
    monkeypatch.setattr(current_platform, "is_fp8_fnuz", lambda: True)


def load_scales(layer: Attention, scales: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Loads checkpoint scales into the layer through vLLM's KV-cache quantization methods."""
    if scales == "per_tensor":
        method = BaseKVCacheMethod(quant_config=None)
    else:
        strategy = "attn_head" if scales == "per_head" else "tensor"
        scheme = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True, "dynamic": False}
        method = CompressedTensorsKVCacheMethod(SimpleNamespace(kv_cache_scheme=scheme))
    method.create_weights(layer)
    layer.k_scale.data.copy_(k_scale.reshape(layer.k_scale.shape))
    layer.v_scale.data.copy_(v_scale.reshape(layer.v_scale.shape))
    method.process_weights_after_loading(layer)


class Engine:
    """One attention layer of a model on vLLM's cache (planned for two layers, the second one's pages
    next to it), and vLLM's model runner for it: each step's CommonAttentionMetadata built as the
    runner builds it, the layer called inside vLLM's forward context."""

    def __init__(self, case: dict, monkeypatch, seed: int):
        self.case = case
        self.generator = torch.Generator().manual_seed(seed)
        if case["cache_dtype"] == "fp8_fnuz":
            fake_fnuz_platform(monkeypatch)
        kv_cache_dtype = "fp8" if case["cache_dtype"] == "fp8_fnuz" else case["cache_dtype"]
        self.dtype = model_dtype(case)
        self.head_size, self.num_kv_heads = case["head_size"], case["num_kv_heads"]
        self.num_heads = 4 * self.num_kv_heads
        self.window = case["block_size"] + 5 if case["window"] else -1
        self.soft_cap = SOFT_CAP if case["soft_cap"] else 0.0
        cache_config = CacheConfig(cache_dtype=kv_cache_dtype, block_size=case["block_size"])
        cache_config.kv_cache_layout = case["layout"]
        cache_config.num_gpu_blocks_override = NUM_BLOCKS
        recipe_name = case.get("recipe", "plain")
        additional_config = {recipe.ROTATION_KEY: "none" if recipe_name == "plain" else "hadamard"}
        self.config = VllmConfig(cache_config=cache_config, additional_config=additional_config)
        backend = AttentionBackendEnum[plugin.BACKEND_NAME].get_class()
        # K/V of every token the requests will have, and checkpoint scales calibrated on them.
        self.pool = {name: random_kv(POOL * MAX_REQUESTS, self.num_kv_heads, self.head_size, self.generator)
                     .to(self.dtype) for name in "kv"}
        self.rotated = None
        if recipe_name != "plain":  # what fp8kv reads from the checkpoint, for both layers
            self.rotated = checkpoint_rotated_recipe(self.pool, recipe_name == "centred", case, self.generator)
            monkeypatch.setattr(vllm_backend, "checkpoint_recipe", lambda *args: self.rotated)
        with set_current_vllm_config(self.config), default_dtype(self.dtype):
            self.layer = Attention(self.num_heads, self.head_size, self.head_size**-0.5, self.num_kv_heads,
                                   cache_config=cache_config, prefix=LAYER, attn_backend=backend,
                                   logits_soft_cap=self.soft_cap or None,
                                   per_layer_sliding_window=self.window if case["window"] else None)
        assert not self.layer.use_direct_call  # the layer calls vLLM's custom ops, as on CUDA
        self.fp8 = None
        if kv_cache_dtype != "auto":
            self.fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else current_platform.fp8_dtype()
            calibrated_as = "e5m2" if self.fp8 == torch.float8_e5m2 else "e4m3fn"  # checkpoints: e4m3fn scales
            per_head = case["scales"] == "per_head"
            self.checkpoint_scales = [calibrated_scales(self.pool[n].float(), calibrated_as, per_head, self.generator)
                                      for n in "kv"]
            load_scales(self.layer, case["scales"], *self.checkpoint_scales)

        if self.rotated is not None:  # as vLLM's loader does once the weights are in
            with set_current_vllm_config(self.config):
                self.layer.impl.process_weights_after_loading(self.dtype)
        spec = self.layer.get_kv_cache_spec(self.config)
        plan = get_kv_cache_config_from_groups(self.config, [KVCacheGroupSpec([LAYER, OTHER_LAYER], spec)], 1 << 40)
        assert plan.num_blocks == NUM_BLOCKS
        caches = allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout[case["layout"]])
        for page in caches.values():  # every byte a step does not write must keep its NaN code
            poison(page, self.fp8)
        self.layer.kv_cache, self.other_page = caches[LAYER], caches[OTHER_LAYER]
        k_offset = None if self.rotated is None else self.rotated.k_offset(0)
        self.expected = ExpectedPages(caches[LAYER], self.fp8, self.dtype, self.rotated is not None, k_offset)
        self.expected_other = ExpectedPages(caches[OTHER_LAYER], self.fp8, self.dtype)
        self.builder = backend.get_builder_cls()(spec, [LAYER], self.config, torch.device("cpu"))
        self.requests = Requests(NUM_BLOCKS, case["block_size"], math.ceil(POOL / case["block_size"]), self.generator)
        self.pool_offset: dict[str, int] = {}

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's scales, [1] or [num_kv_heads]: as vLLM holds them (the plain recipe), or the
        rotated recipe's for layer 0."""
        if self.rotated is not None:
            return self.rotated.k_scale(0), self.rotated.v_scale(0)
        return self.layer._k_scale.reshape(-1), self.layer._v_scale.reshape(-1)

    def step(self, scheduled: list[tuple[str, int]], pad_tokens: int = 0, pad_reqs: int = 0) -> AttentionMetadata:
        """Runs one step of `scheduled` (request, new tokens) in vLLM's order, decodes first, padded
        by `pad_reqs` requests and `pad_tokens` tokens; checks the cache and the output."""
        step = self.requests.step(scheduled, pad_tokens, pad_reqs)
        common = CommonAttentionMetadata(
            query_start_loc=step.query_start_loc, query_start_loc_cpu=step.query_start_loc.clone(),
            seq_lens=step.seq_lens, num_reqs=step.num_reqs_padded, num_actual_tokens=step.num_tokens_padded,
            max_query_len=max(step.query_lens), max_seq_len=int(step.seq_lens.max()),
            block_table_tensor=step.block_table, slot_mapping=step.slot_mapping, causal=True,
            seq_lens_cpu_upper_bound=step.seq_lens.clone(),
            is_prefilling=torch.zeros(step.num_reqs_padded, dtype=torch.bool))
        metadata = self.builder.build(0, common)

        for name, _ in scheduled:
            self.pool_offset.setdefault(name, POOL * len(self.pool_offset))
        index = torch.tensor([self.pool_offset[name] + p for name, p in step.rows], dtype=torch.long)
        padding = torch.randn(step.num_tokens_padded - step.num_tokens, self.num_kv_heads, self.head_size,
                              generator=self.generator).to(self.dtype)
        key, value = (torch.cat([self.pool[n][index], padding]) for n in "kv")
        query = torch.randn(step.num_tokens_padded, self.num_heads * self.head_size, generator=self.generator)
        query = query.to(self.dtype)
        with set_forward_context({LAYER: metadata}, self.config, slot_mapping={LAYER: step.slot_mapping}):
            out = self.layer(query, key.flatten(1), value.flatten(1))

        self.expected.write(step.slot_mapping[:step.num_tokens], key[:step.num_tokens], value[:step.num_tokens],
                            *self.scales())
        self.expected.assert_held_by(self.layer.kv_cache)
        self.expected_other.assert_held_by(self.other_page)
        out = out.view(step.num_tokens_padded, self.num_heads, self.head_size)
        q = query.view(step.num_tokens_padded, self.num_heads, self.head_size)[:step.num_tokens]
        reference = self.expected.reference(q, step, *self.scales(), self.head_size**-0.5, self.window,
                                            self.soft_cap, "cpu")
        assert_within(out[:step.num_tokens], reference, f"step {scheduled}")
        if metadata.query_start_loc is None:  # a decode batch: padding requests' rows are zeros
            assert bool((out[step.num_reqs:step.num_reqs_padded] == 0).all())
        self.last = step, q, out[:step.num_tokens]
        return metadata

    def unquantized_caches(self) -> tuple[torch.Tensor, ...]:
        """float64 [num_blocks, block_size, H, D] caches of the K/V the requests wrote, as the model
        computed them, and of half the FP8 grid spacing around each (its quantization error bound);
        NaN in every other slot."""
        block_size = self.case["block_size"]
        caches = [torch.full((NUM_BLOCKS, block_size, self.num_kv_heads, self.head_size), math.nan,
                             dtype=torch.float64) for _ in range(4)]
        for name, length in self.requests.lengths.items():
            p = torch.arange(length)
            slots = torch.tensor(self.requests.blocks[name])[p // block_size], p % block_size
            for n, scale, values, error in zip("kv", self.scales(), caches[:2], caches[2:]):
                x = self.pool[n][self.pool_offset[name]:][:length]
                values[slots] = x.double()
                error[slots] = quantization_spacing(x.double(), scale, FORMAT_BY_DTYPE[self.fp8]) / 2
        return tuple(caches)


def checkpoint_rotated_recipe(pool: dict[str, torch.Tensor], centred: bool, case: dict,
                              generator: torch.Generator) -> KVCacheConfig:
    """The rotated recipe of a two-layer checkpoint, as fp8kv reads it for the cache format: scales
    calibrated on the rotated pool (per the case's granularity), and for `centred` the K offset the
    mean rotated key of each head, layer 1's different from layer 0's (the layer a page belongs to must
    pick its own)."""
    fmt = "e5m2" if case["cache_dtype"] == "fp8_e5m2" else "e4m3fn"
    rotated = {name: rotate_float32(values) for name, values in pool.items()}
    offset = rotated["k"].mean(dim=0) if centred else None
    if offset is not None:
        rotated["k"] = rotated["k"] - offset
    per_head = case["scales"] == "per_head"
    k, v = (calibrated_scales(rotated[name], fmt, per_head, generator).tolist() for name in "kv")
    offsets = None if offset is None else [offset.tolist(), (offset + 1).tolist()]
    config = KVCacheConfig(fmt, [k, [2 * s for s in k]], [v, [2 * s for s in v]], "the test's", Rotation.HADAMARD,
                           offsets)
    if case["cache_dtype"] == "fp8_fnuz":  # as the loader converts e4m3fn scales for e4m3fnuz
        config = converted(config, KVCacheDtype.E4M3FNUZ)
    return config


def model_dtype(case: dict) -> torch.dtype:
    # An auto cache has the model's dtype, which vLLM takes from the model config: without one (no
    # model here) vLLM makes it float16.
    return torch.float16 if case["cache_dtype"] == "auto" else case["dtype"]


def case_id(case: dict) -> str:
    parts = [case["cache_dtype"], case["layout"], case["scales"], str(model_dtype(case)).removeprefix("torch."),
             f"b{case['block_size']}", f"h{case['head_size']}", f"kv{case['num_kv_heads']}"]
    parts += [name if case[name] else f"no_{name}" for name in ("window", "soft_cap")]
    return "-".join(parts)


# Every cache dtype in every layout vLLM's KVCacheLayout has (LBNHC is NHD, LBHNC HND; the others
# nest layers and blocks differently), every pair of values of the other axes in some case.
STEP_CASES = covering_grid(
    {"cache_dtype": CACHE_DTYPES, "layout": [layout.name for layout in KVCacheLayout]},
    {"scales": SCALES, "dtype": [torch.bfloat16, torch.float16], "block_size": [16, 64], "head_size": [128, 64],
     "num_kv_heads": [2, 1], "window": [False, True], "soft_cap": [False, True]})


@pytest.mark.parametrize("case", STEP_CASES, ids=case_id)
def test_prefill_chunked_prefill_and_decode_through_the_attention_layer(case, monkeypatch):
    """Three requests through four steps: two whole prompts and a first chunk; two decodes then the
    chunk's continuation, with padding tokens; a decode batch padded with requests as for a CUDA
    graph; a decode then two chunks continuing after decodes."""
    engine = Engine(case, monkeypatch, seed=STEP_CASES.index(case))
    if case["cache_dtype"] == "fp8_fnuz":
        # The backend uses the scales as vLLM holds them. vLLM 0.33 doubles an FP8 checkpoint's for
        # e4m3fnuz; its compressed-tensors loader leaves them as they are.
        doubled = case["scales"] == "per_tensor"
        for held, checkpoint in zip(engine.scales(), engine.checkpoint_scales):
            assert torch.equal(held, (2 if doubled else 1) * checkpoint)
    b = case["block_size"]
    engine.step([("a", 2 * b + 3), ("b", 5), ("c", 20)])
    engine.step([("a", 1), ("b", 1), ("c", b + 7)], pad_tokens=3)
    engine.step([("a", 1), ("b", 1), ("c", 1)], pad_reqs=NUM_REQS_PADDED - 3)
    engine.step([("b", 1), ("c", 9), ("a", 2)])


ROTATED_CASES = [
    {"cache_dtype": "fp8", "layout": "LBNHC", "scales": "per_tensor", "dtype": torch.bfloat16, "block_size": 16,
     "head_size": 128, "num_kv_heads": 2, "window": False, "soft_cap": False, "recipe": "rotated"},
    {"cache_dtype": "fp8", "layout": "LBHNC", "scales": "per_head", "dtype": torch.float16, "block_size": 16,
     "head_size": 80, "num_kv_heads": 1, "window": True, "soft_cap": True, "recipe": "centred"},
    {"cache_dtype": "fp8_e5m2", "layout": "BLNHC", "scales": "per_head", "dtype": torch.bfloat16, "block_size": 64,
     "head_size": 64, "num_kv_heads": 2, "window": False, "soft_cap": True, "recipe": "centred"},
    {"cache_dtype": "fp8_fnuz", "layout": "LBNHC", "scales": "per_tensor", "dtype": torch.bfloat16, "block_size": 16,
     "head_size": 96, "num_kv_heads": 2, "window": True, "soft_cap": False, "recipe": "centred"},
]


@pytest.mark.parametrize("case", ROTATED_CASES, ids=lambda case: f"{case['recipe']}-{case_id(case)}")
def test_the_rotated_recipe_through_the_attention_layer(case, monkeypatch):
    """fp8kv_rotation 'hadamard' in vLLM's additional_config: the layer binds layer 0's scales and K
    offset (not vLLM's checkpoint scales, nor layer 1's) once its weights are loaded, and the steps
    of the plain recipe's test write exactly the rotated recipe's bytes and attend within the
    rotated reference's bound."""
    engine = Engine(case, monkeypatch, seed=100 + ROTATED_CASES.index(case))
    bound = engine.layer.impl.rotated_layer
    for held, expected in zip((bound.k_scale, bound.v_scale, bound.k_offset),
                              (engine.rotated.k_scale(0), engine.rotated.v_scale(0), engine.rotated.k_offset(0))):
        assert (held is None and expected is None) or torch.equal(held, expected)
    assert not torch.equal(engine.layer._k_scale.reshape(-1), bound.k_scale)
    b = case["block_size"]
    engine.step([("a", 2 * b + 3), ("b", 5), ("c", 20)])
    engine.step([("a", 1), ("b", 1), ("c", b + 7)], pad_tokens=3)
    engine.step([("a", 1), ("b", 1), ("c", 1)], pad_reqs=NUM_REQS_PADDED - 3)


@pytest.mark.parametrize("cache_dtype, scales", [
    ("fp8", "per_tensor"), ("fp8", "per_head"), ("fp8_e5m2", "per_tensor"), ("fp8_e5m2", "per_head"),
    ("fp8_fnuz", "per_tensor")])
def test_the_output_follows_the_models_kv_within_the_formats_precision(cache_dtype, scales, monkeypatch):
    """A prompt and a decode step, compared with float64 attention over the K/V the model computed
    (not the cache's values): the allowed error is the quantization bound (reference.
    quantization_error_bound) plus the kernel's over the quantized values, and it rejects the same
    output with a doubled V scale. So the cache holds K/V in the scales' meaning in vLLM: x is about
    code * scale. (e4m3fnuz with compressed-tensors scales is left out: vLLM 0.33 does not double
    them for it, so values past 240 scales saturate and this bound fails.)"""
    case = {"cache_dtype": cache_dtype, "layout": "LBHNC", "scales": scales, "dtype": torch.bfloat16,
            "block_size": 16, "head_size": 128, "num_kv_heads": 2, "window": False, "soft_cap": False}
    engine = Engine(case, monkeypatch, seed=21)
    engine.step([("a", 70), ("b", 33)])
    engine.step([("a", 1), ("b", 1)])
    step, query, out = engine.last
    key_values, value_values, key_error, value_error = engine.unquantized_caches()
    n = step.num_reqs
    common = (step.block_table[:n], step.seq_lens[:n], step.query_start_loc[:n + 1], engine.head_size**-0.5)
    exact = paged_attention_reference(query, key_values, value_values, *common)
    quantization = quantization_error_bound(query, key_values, value_values, key_error, value_error, *common)
    kernel = engine.expected.reference(query, step, *engine.scales(), engine.head_size**-0.5, -1, 0.0, "cpu")
    allowed = AttentionReference(exact.out, quantization + kernel.bound)
    assert_within(out, allowed, "against the model's K/V")
    with pytest.raises(AssertionError, match="outside the bound"):  # a doubled V scale doubles the output
        assert_within(2 * out.double(), allowed, "with a doubled V scale")


# ----------------------------------------------------------------------------------------------
# Registration, selection, refusals
# ----------------------------------------------------------------------------------------------


def test_the_entry_point_registers_the_backend_with_vllm():
    entry_points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [e.value for e in entry_points if e.name == "fp8kv"] == ["fp8kv.integrations.vllm:register"]
    # The plugins fixture ran vLLM's loader; vLLM may run a plugin again in a process.
    plugin.register()
    assert AttentionBackendEnum[plugin.BACKEND_NAME].get_class() is Fp8kvAttentionBackend
    assert Fp8kvAttentionBackend.get_name() == plugin.BACKEND_NAME


def test_a_process_that_has_not_loaded_the_plugins_unpickles_the_selected_backend():
    """vLLM pickles its config, the selected backend's registry member with it, into the processes
    it spawns (engine core, workers), which unpickle it before they load plugins: a fresh
    interpreter must find FP8KV and fp8kv's class behind it."""
    config = AttentionConfig(backend=AttentionConfig.validate_backend_before("FP8KV"))
    code = ("import pickle, sys; config = pickle.load(sys.stdin.buffer); "
            "print(config.backend.name, config.backend.get_class().__qualname__)")
    child = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(config), capture_output=True, timeout=300)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.decode().split() == ["FP8KV", "Fp8kvAttentionBackend"]


@pytest.mark.parametrize("name", ["FP8KV", "fp8kv"])
def test_the_command_line_selects_the_backend(name):
    """`vllm serve MODEL --kv-cache-dtype fp8 --attention-backend FP8KV` (the name in any case)."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--attention-backend", name, "--kv-cache-dtype", "fp8"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.kv_cache_dtype == "fp8"
    # What create_engine_config makes of the name (it needs a model, so the step is called alone).
    assert AttentionConfig.validate_backend_before(engine_args.attention_backend) is AttentionBackendEnum.FP8KV


def valid_configuration(**changes) -> dict:
    """validate_configuration's arguments as vLLM's CUDA platform passes them, for an H100 and a
    GQA model with an FP8 cache, per-head scales and a sliding window, changed by `changes`."""
    selector = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=16,
                                       use_per_head_quant_scales=True, has_sliding_window=True)
    return {"device_capability": DeviceCapability(9, 0), **selector._asdict(), **changes}


@pytest.mark.parametrize("changes", [{}, {"kv_cache_dtype": "auto"}, {"kv_cache_dtype": "fp8_e4m3"},
                                     {"kv_cache_dtype": "fp8_e5m2"}, {"dtype": torch.float16}, {"head_size": 64},
                                     {"block_size": 256}, {"block_size": 512}, {"block_size": None},
                                     {"device_capability": DeviceCapability(8, 0)},
                                     {"device_capability": DeviceCapability(8, 6)},
                                     {"device_capability": DeviceCapability(8, 9)}], ids=str)
def test_validate_configuration_accepts(changes):
    assert Fp8kvAttentionBackend.validate_configuration(**valid_configuration(**changes)) == []


@pytest.mark.parametrize("changes, reason", [
    ({"use_mla": True}, "MLA not supported"),
    ({"has_sink": True}, "attention sinks not supported"),
    ({"use_sparse": True}, "sparse not supported"),
    ({"use_mm_prefix": True}, "partial multimodal token full attention not supported"),
    ({"use_non_causal": True}, "non-causal attention not supported"),
    ({"attn_type": "encoder_only"}, "attention type encoder_only not supported"),
    ({"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype not supported"),
    ({"kv_cache_dtype": "float16"}, "kv_cache_dtype not supported"),  # only the model's own dtype (auto)
    ({"dtype": torch.float32}, "dtype not supported"),
    ({"head_size": 72}, "head_size not supported"),
    ({"block_size": 4}, "block_size not supported"),
    ({"device_capability": DeviceCapability(7, 5)}, "compute capability not supported"),
    ({"device_capability": DeviceCapability(9, 4)}, "compute capability not supported"),  # MI300
    ({"device_capability": DeviceCapability(10, 0)}, "compute capability not supported"),
    ({"use_dcp": True}, "DCP not supported"),
    ({"use_batch_invariant": True}, "batch invariance not supported"),
], ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_validate_configuration_refuses(changes, reason):
    assert reason in Fp8kvAttentionBackend.validate_configuration(**valid_configuration(**changes))


def test_a_platform_without_a_compute_capability_is_accepted_where_it_is_vllms_cpu_platform(monkeypatch):
    """vLLM's CPU platform reports no compute capability (None): fp8kv's CPU kernels run there, and
    on no other platform without one."""
    assert current_platform.is_cpu() and current_platform.get_device_capability() is None
    assert Fp8kvAttentionBackend.validate_configuration(**valid_configuration(device_capability=None)) == []
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert "compute capability not supported" in \
        Fp8kvAttentionBackend.validate_configuration(**valid_configuration(device_capability=None))


def test_validate_configuration_refuses_another_vllm_and_a_build_without_cuda_kernels(monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    assert "fp8kv's backend is written for vLLM 0.33, not 0.34.0" in \
        Fp8kvAttentionBackend.validate_configuration(**valid_configuration())
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert not __import__("fp8kv").has_cuda_kernels()  # this environment's build is the CPU one
    assert "fp8kv was built without its CUDA kernels" in \
        Fp8kvAttentionBackend.validate_configuration(**valid_configuration())


def make_impl(**changes) -> Fp8kvAttentionImpl:
    arguments = dict(num_heads=8, head_size=128, scale=128**-0.5, num_kv_heads=2, alibi_slopes=None,
                     sliding_window=None, kv_cache_dtype="fp8")
    return Fp8kvAttentionImpl(**{**arguments, **changes})


@pytest.mark.parametrize("changes, message", [
    ({"alibi_slopes": [0.5] * 8}, "does not support ALiBi (alibi_slopes)"),
    ({"sinks": torch.zeros(8)}, "does not support attention sinks (sinks)"),
    ({"attn_type": "encoder_decoder"}, "does not support attn_type 'encoder_decoder'"),
], ids=["alibi", "sinks", "cross_attention"])
def test_the_impl_refuses_what_fp8kv_does_not_do(changes, message):
    with pytest.raises(NotImplementedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_impl(**changes)


def test_the_impl_refuses_a_cache_dtype_it_does_not_read():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*, got 'fp8_inc'"):
        make_impl(kv_cache_dtype="fp8_inc")


@pytest.mark.parametrize("additional_config, cache_format, rotation", [
    ({}, torch.float8_e4m3fn, Rotation.HADAMARD), ({"other_plugin": 1}, torch.float8_e5m2, Rotation.HADAMARD),
    ({}, None, Rotation.NONE), ({"fp8kv_rotation": "none"}, torch.float8_e4m3fn, Rotation.NONE),
    ({"fp8kv_rotation": "hadamard"}, torch.float8_e4m3fn, Rotation.HADAMARD),
    ({"fp8kv_rotation": " Hadamard "}, torch.float8_e4m3fnuz, Rotation.HADAMARD)])
def test_the_recipe_is_chosen_in_vllms_additional_config(additional_config, cache_format, rotation):
    """fp8kv's default for an FP8 cache is the rotated recipe, as everywhere; "none" chooses the plain one."""
    config = VllmConfig(additional_config=additional_config).additional_config
    assert recipe.chosen_rotation(config, cache_format) is rotation


@pytest.mark.parametrize("additional_config, message", [
    ({"fp8kv_rotaton": "hadamard"}, "unknown fp8kv key 'fp8kv_rotaton'; fp8kv's attention backend reads "
                                    "'fp8kv_rotation'"),
    ({"fp8kv_rotation": "centred"}, "additional_config\\['fp8kv_rotation'\\]: unknown rotation 'centred'"),
    ({"fp8kv_rotation": 1}, "additional_config\\['fp8kv_rotation'\\]: rotation must be a Rotation or str")])
def test_a_misspelt_or_unknown_recipe_choice_is_refused(additional_config, message):
    with pytest.raises(ValueError, match=message):
        recipe.chosen_rotation(additional_config, torch.float8_e4m3fn)


def test_the_rotated_recipe_refuses_what_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="'hadamard' needs an FP8 cache .* an unquantized \\(auto\\) cache stores"):
        recipe.rotated_recipe(tmp_path, None, 0, 1)
    with pytest.raises(ValueError, match="the model 'org/model' is not a local directory: download it .* or choose "
                                         "the plain recipe"):
        recipe.rotated_recipe("org/model", torch.float8_e4m3fn, 0, 1)
    rotated = VllmConfig(additional_config={"fp8kv_rotation": "hadamard"})
    with set_current_vllm_config(rotated), pytest.raises(
            NotImplementedError, match="rotated recipe .* does not support a layer reading another layer's cache"):
        make_impl(kv_sharing_target_layer_name=LAYER)


def decode_engine(monkeypatch) -> Engine:
    case = {"cache_dtype": "fp8", "layout": "LBNHC", "scales": "per_tensor", "dtype": torch.bfloat16,
            "block_size": 16, "head_size": 64, "num_kv_heads": 2, "window": False, "soft_cap": False}
    engine = Engine(case, monkeypatch, seed=0)
    engine.step([("a", 20)])
    return engine


def test_fp8_queries_and_output_quantization_are_refused(monkeypatch):
    """vLLM quantizes the query only for an impl that says it takes FP8 queries (this one does not);
    one given anyway is refused by fp8kv's op, naming it. Fused output quantization is refused."""
    engine = decode_engine(monkeypatch)
    impl, layer = engine.layer.impl, engine.layer
    assert not impl.supports_quant_query_input and layer.query_quant is None
    metadata = engine.step([("a", 1)])
    output = torch.empty(1, 8, 64, dtype=torch.bfloat16)
    query = torch.zeros(1, 8, 64).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="`query`"):
        impl.forward(layer, query, None, None, layer.kv_cache, metadata, output)
    with pytest.raises(NotImplementedError, match="output_scale"):
        impl.forward(layer, query.bfloat16(), None, None, layer.kv_cache, metadata, output,
                     output_scale=torch.ones(1))


def test_the_profiling_run_without_metadata_outputs_zeros(monkeypatch):
    engine = decode_engine(monkeypatch)
    query = torch.randn(3, 8 * 64).bfloat16()
    with set_forward_context(None, engine.config):
        out = engine.layer(query, query[:, :128], query[:, :128])
    assert bool((out == 0).all())


# ----------------------------------------------------------------------------------------------
# The metadata builder
# ----------------------------------------------------------------------------------------------


def common_metadata(query_lens: list[int], seq_lens: list[int], num_tokens: int) -> CommonAttentionMetadata:
    cu = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu.clone(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens), num_actual_tokens=num_tokens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=torch.zeros(len(query_lens), 4, dtype=torch.int32),
        slot_mapping=torch.full((num_tokens,), PAD_SLOT_ID))


@pytest.mark.parametrize("query_lens, seq_lens, num_tokens, num_decodes, query_start_loc, num_query_rows", [
    ([1, 1, 0, 0], [9, 30, 0, 0], 4, 4, None, 2),              # decodes padded with requests (CUDA graph)
    ([1, 1, 1], [9, 30, 4], 8, 3, None, 3),                    # decodes padded with tokens
    ([1, 1, 5, 3], [9, 30, 5, 40], 12, 2, [0, 5, 8], 10),      # decodes first, then prefill chunks
    ([7, 1, 3], [7, 30, 3], 11, 0, [0, 7, 8, 11], 11),         # no decode first: all multi-token
    ([6, 2, 0], [6, 12, 0], 9, 0, [0, 6, 8, 8], 8),            # a padding request after prefills
])
def test_the_builder_puts_decodes_first(monkeypatch, query_lens, seq_lens, num_tokens, num_decodes,
                                        query_start_loc, num_query_rows):
    builder = decode_engine(monkeypatch).builder
    assert builder.reorder_batch_threshold == 1
    common = common_metadata(query_lens, seq_lens, num_tokens)
    metadata = builder.build(0, common)
    assert metadata.num_decodes == num_decodes and metadata.num_query_rows == num_query_rows
    assert metadata.num_actual_tokens == num_tokens
    if query_start_loc is None:
        assert metadata.query_start_loc is None
    else:
        assert metadata.query_start_loc.tolist() == query_start_loc
    assert metadata.seq_lens is common.seq_lens and metadata.block_table is common.block_table_tensor
    assert metadata.slot_mapping is common.slot_mapping
    table, slots = torch.ones(4, 4, dtype=torch.int32), torch.zeros(num_tokens, dtype=torch.int64)
    updated = builder.update_block_table(metadata, table, slots)
    assert updated.block_table is table and updated.slot_mapping is slots and metadata.block_table is not table


def test_cuda_graphs_are_declared_for_uniform_single_token_decode_batches(monkeypatch):
    engine = decode_engine(monkeypatch)
    spec = engine.layer.get_kv_cache_spec(engine.config)
    assert Fp8kvMetadataBuilder.get_cudagraph_support(engine.config, spec) == \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


# ----------------------------------------------------------------------------------------------
# vLLM's interface, as the backend relies on it
# ----------------------------------------------------------------------------------------------


def parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name not in ("self", "cls")]


def test_the_installed_vllm_is_the_pinned_one():
    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["vllm"]
    assert extra == [f"vllm=={'.'.join(map(str, plugin.SUPPORTED_VLLM))}.*"]
    assert vllm.__version__.startswith(f"{'.'.join(map(str, plugin.SUPPORTED_VLLM))}.")


@pytest.mark.parametrize("ours, theirs", [
    (Fp8kvAttentionBackend, AttentionBackend), (Fp8kvMetadataBuilder, AttentionMetadataBuilder),
    (Fp8kvAttentionImpl, AttentionImpl), (Fp8kvAttentionImpl, FlashAttentionImpl)], ids=lambda c: c.__name__)
def test_every_overridden_method_keeps_vllms_signature(ours, theirs):
    """vLLM calls these methods (some by keyword): a renamed or added parameter fails here."""
    for name, member in vars(ours).items():
        base = getattr(theirs, name, None)
        if callable(base) and name not in ("validate_configuration", "__init__"):
            assert parameters(getattr(ours, name)) == parameters(base), f"{ours.__name__}.{name}"
    # __init__ and validate_configuration as vLLM calls them: the impl positionally plus sinks
    # (FlashAttention's extra argument), validation with every selector field by keyword.
    assert parameters(Fp8kvAttentionImpl.__init__) == parameters(AttentionImpl.__init__) + ["sinks"]
    assert parameters(FlashAttentionImpl.__init__) == parameters(Fp8kvAttentionImpl.__init__)
    assert parameters(AttentionBackend.validate_configuration) == \
        ["head_size", "dtype", "kv_cache_dtype", "block_size", "use_mla", "has_sink", "use_sparse", "use_mm_prefix",
         "use_per_head_quant_scales", "device_capability", "attn_type", "has_sliding_window", "use_non_causal",
         "use_batch_invariant", "use_kv_connector", "use_pcp", "use_adaptive_verification", "use_dcp", "use_rswa"]
    assert set(parameters(AttentionBackend.validate_configuration)) == \
        set(AttentionSelectorConfig._fields) | {"device_capability"}


def test_the_names_the_backend_reads_from_vllm():
    """The layer's scales and cache, the metadata's fields, the cache layouts and views, padding ids."""
    assert {"_k_scale", "_v_scale"} <= set(AttentionLayer.__annotations__)
    assert {"query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens",
            "max_query_len", "block_table_tensor", "slot_mapping"} <= set(CommonAttentionMetadata.__dataclass_fields__)
    # Every layout keeps the content (K then V) innermost: the halves are fp8kv caches with a
    # contiguous last dimension whatever the layout.
    assert {layout.name: layout.value[-1] for layout in KVCacheLayout} == \
        {"LBHNC": 4, "LBNHC": 4, "LHBNC": 4, "BLHNC": 4, "BLNHC": 4, "BHLNC": 4}
    assert parameters(create_kv_cache_views) == ["raw", "spec", "num_blocks", "layout", "kv_cache_tensor",
                                                  "kernel_block_size"]
    assert parameters(register_backend) == ["backend", "class_path", "is_mamba"]
    assert (PAD_SLOT_ID, NULL_BLOCK_ID) == (-1, 0)
    assert AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE.value == 1
