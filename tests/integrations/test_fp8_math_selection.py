"""`fp8_math` (FP8 tensor-core math for multi-token queries) through the modules and both transformers
integrations: refused where it cannot run, naming it; on a compute capability 9.0 GPU it reaches the
kernel (the module's output is the op's FP8-math output bit for bit, and not its 16-bit one).
The kernel itself is tested in tests/ops/test_fp8_math.py."""

from __future__ import annotations

import pytest
import torch

from fp8kv import ops
from fp8kv._ops import supported_values
from fp8kv.attention import PagedAttention
from fp8kv.cache import PagedKVCache
from fp8kv.formats import KVCacheConfig

transformers = pytest.importorskip("transformers")
from fp8kv.integrations import transformers_cb_steps as cb_steps  # noqa: E402
from fp8kv.integrations import transformers_continuous_batching as continuous_batching  # noqa: E402
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable, enable_continuous_batching  # noqa: E402

SM90A = torch.cuda.is_available() and torch.cuda.get_device_capability() == supported_values("cuda_sm90a_capability")
needs_sm90a = pytest.mark.skipif(not SM90A, reason="FP8 math runs on compute capability 9.0 GPUs")
on_sm90a = [pytest.mark.gpu, needs_sm90a]
HEADS, KV_HEADS, HEAD_SIZE, LAYERS = 8, 2, 64, 2


def config(fmt: str) -> KVCacheConfig:
    return KVCacheConfig.unit_scales(fmt, LAYERS)


@pytest.mark.parametrize("fmt", ["float8_e4m3fnuz", "auto"])
def test_formats_without_fp8_math_are_refused_everywhere(fmt):
    message = f"fp8_math needs a float8_e4m3fn or float8_e5m2 cache, got {fmt}"  # "auto": unquantized
    with pytest.raises(ValueError, match=message):
        PagedCache(config(fmt), max_tokens=64, fp8_math=True)
    with pytest.raises(ValueError, match=message):
        enable_continuous_batching(tiny_model(), config(fmt), fp8_math=True)


def test_fp8_math_must_be_a_bool():
    with pytest.raises(TypeError, match="fp8_math must be True or False, got 'yes'"):
        PagedAttention(HEADS, KV_HEADS, HEAD_SIZE, fp8_math="yes")


def layer_inputs(device: str, fmt: str = "float8_e4m3fn"):
    """A module, its cache and a prefill step of two prompts (40 and 300 tokens)."""
    module = PagedAttention(HEADS, KV_HEADS, HEAD_SIZE, fp8_math=True)
    cache = PagedKVCache(config(fmt), num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, num_blocks=64, device=device)
    for seq in (0, 1):
        cache.add_sequence(seq)
    batch = cache.prepare([0, 1], [40, 300])
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(340, h, HEAD_SIZE, generator=generator).to(torch.bfloat16).to(device)
                         for h in (HEADS, KV_HEADS, KV_HEADS))
    return module, cache, batch, query, key, value


def test_the_module_passes_fp8_math_to_the_op_which_the_cpu_refuses():
    module, cache, batch, query, key, value = layer_inputs("cpu")
    assert "fp8_math=True" in repr(module)
    with pytest.raises(RuntimeError, match=r"`fp8_math` needs the CUDA kernels on a compute capability 9\.0 GPU"):
        module(query, key, value, cache.layer(0), batch)


@pytest.mark.gpu
@needs_sm90a
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_the_module_runs_the_fp8_math_kernel(fmt):
    module, cache, batch, query, key, value = layer_inputs("cuda", fmt)
    out = module(query, key, value, cache.layer(0), batch)
    expected = {}
    for fp8_math in (True, False):
        expected[fp8_math] = torch.empty_like(query)
        ops.paged_attention(expected[fp8_math], query, cache.layer(0), batch.block_tables, batch.seq_lens,
                            batch.cu_seqlens_q, module.softmax_scale, fp8_math=fp8_math)
    assert torch.equal(out, expected[True]) and not torch.equal(out, expected[False])



def tiny_model(device: str = "cpu"):
    """A two-layer GQA Llama (8 query and 2 KV heads of 64) with random bf16 weights."""
    model_config = transformers.LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=512,
                                            num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                            num_key_value_heads=KV_HEADS, max_position_embeddings=512)
    model_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(model_config).to(torch.bfloat16).to(device).eval()


def attention_modules(layer_attentions) -> list[PagedAttention]:
    return [m for m in layer_attentions._modules if m is not None]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=on_sm90a)])
def test_generate_with_a_paged_cache_in_fp8_math(device):
    """PagedCache(fp8_math=True): the prompt's attention runs in FP8 math on the GPU, is refused on the CPU."""
    model = enable(tiny_model(device))
    cache = PagedCache(config("float8_e4m3fn"), max_tokens=512, fp8_math=True)
    ids = torch.randint(0, 64, (2, 200), generator=torch.Generator().manual_seed(1)).to(device)
    generate = lambda: model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                      **cache_argument(model, cache))
    if device == "cpu":
        with pytest.raises(RuntimeError, match="`fp8_math` needs the CUDA kernels"):
            generate()
        return
    assert generate().shape == (2, 204)
    modules = attention_modules(cache._state.attention)
    assert len(modules) == LAYERS and all(m.fp8_math for m in modules)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=on_sm90a)])
def test_continuous_batching_in_fp8_math(device):
    """enable_continuous_batching(fp8_math=True): transformers' cache holds fp8kv's pages and its layers
    attend in FP8 math on the GPU; the CPU refuses the step, and the request says so."""
    try:  # outside the transformers releases the hooks support (test_continuous_batching_unsupported.py)
        continuous_batching.check_transformers()
    except continuous_batching.UnsupportedTransformersError as e:
        pytest.skip(str(e))
    model = enable_continuous_batching(tiny_model(device), config("float8_e4m3fn"), fp8_math=True)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (150, 90)]
    generation = transformers.GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256)
    outputs = list(model.generate_batch(prompts, generation_config=generation,
                                        continuous_batching_config=batching).values())
    if device == "cpu":
        assert all("`fp8_math` needs the CUDA kernels" in str(output.error) for output in outputs)
        return
    assert [output.error for output in outputs] == [None, None]
    states = list(cb_steps.CACHES.values())
    assert states and all(m.fp8_math for state in states for m in attention_modules(state.attentions))
