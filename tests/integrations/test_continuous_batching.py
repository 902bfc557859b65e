"""transformers' continuous batching on fp8kv's pages (enable_continuous_batching): `generate_batch`
and the manager on tiny random Llama models in bf16 (and SmolLM2 where the real-model extra is
installed), token for token against fp8kv's own PagedCache + generate on the same KVCacheConfig.

Both run every row through the same kernels, over the same FP8 bits: the reference is one prompt at
a time, where continuous batching mixes requests, chunks prompts, shares prefixes, forks and pads.
So greedy tokens are compared exactly, and so are the log-probabilities transformers returns for
them (log of the softmax of the same logits; measured equal bit for bit on CPU, where the tiny
models' matmuls give a row the same bits wherever it sits in the batch): a difference of a rounding
anywhere in the cache would show.
"""

import multiprocessing
import pathlib
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from fp8kv.integrations import transformers_cb_check as cb_check  # noqa: E402
from fp8kv.integrations import transformers_cb_steps as cb_steps  # noqa: E402
from fp8kv.integrations import transformers_continuous_batching as continuous_batching  # noqa: E402

try:  # outside the releases it supports (test_continuous_batching_unsupported.py checks the error)
    continuous_batching.check_transformers()
except continuous_batching.UnsupportedTransformersError as e:
    pytest.skip(str(e), allow_module_level=True)

from safetensors.torch import save_file  # noqa: E402
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as transformers_cache  # noqa: E402
from transformers.generation.continuous_batching import continuous_api, initialization, input_outputs  # noqa: E402
from transformers.generation.continuous_batching import model_runner  # noqa: E402

from near_ties import assert_equal_up_to_near_ties, margins  # noqa: E402

from fp8kv import load_kv_cache_config  # noqa: E402
from fp8kv.evaluate.caches import kv_cache_configs  # noqa: E402
from fp8kv.formats import KVCacheConfig, KVCacheDtype  # noqa: E402
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable_continuous_batching  # noqa: E402
from fp8kv.rotation import Rotation  # noqa: E402

VOCAB, NEW_TOKENS, PAGE = 64, 12, 16
NEAR_TIE = 0.125  # two bf16 units of a logit between 4 and 8: a gap that a rounding or two can close
# On FP8 pages a rounding of a new K or V element in bf16 may also move its FP8 code by one (12.5% of the element
# in e4m3, 25% in e5m2), which moved a logit of these tiny models by up to 0.42 on the H100.
NEAR_TIE_FP8 = 0.5
# Every format and recipe, with scales (and K offsets) calibrated per KV head on the model
# (fp8kv.evaluate's names: FORMAT[-RECIPE]-head).
CACHES = ["auto", "e4m3-plain-head", "e4m3-head", "e4m3-centred-head", "e5m2-plain-head", "e5m2-centred-head",
          "e4m3fnuz-head"]

# Tiny models and tensors: one CPU thread (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def tiny_model(seed: int = 0, num_layers: int = 2):
    """A GQA Llama of `num_layers` layers (4 query and 2 KV heads of 64, a 64-token vocabulary) with
    random bf16 weights, spread 5x transformers' default so that greedy text changes token to token
    rather than repeating one; sdpa attention (what transformers' own continuous batching runs on
    CPU) until enabled."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def random_prompts(lengths, seed: int = 0, prefix=()) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def kv_cache(model, name: str) -> KVCacheConfig:
    """The model's KVCacheConfig `name`, calibrated on two random 48-token windows."""
    windows = torch.tensor(random_prompts([48, 48], seed=1))
    return kv_cache_configs(model, windows, [] if name == "auto" else [name], progress=False)[name]


def batching(**settings) -> ContinuousBatchingConfig:
    """Pages of 16 tokens; steps of at most 32 tokens, so that a longer prompt is prefilled in chunks."""
    return ContinuousBatchingConfig(**{"page_size": PAGE, "num_blocks": 64, "max_batch_tokens": 32,
                                       "return_logprobs": True, **settings})


def greedy(**settings) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": NEW_TOKENS, "do_sample": False, "eos_token_id": -1,
                               "pad_token_id": 0, **settings})


def generate_batch(model, prompts, generation_config=None, **settings) -> list:
    """generate_batch's outputs in prompt order (a forked request's copies together), each checked to
    have finished without error."""
    outputs = list(model.generate_batch(prompts, generation_config=generation_config or greedy(),
                                        continuous_batching_config=batching(**settings)).values())
    assert [output.error for output in outputs] == [None] * len(outputs)
    return outputs


def reference(model, kv_cache_config: KVCacheConfig, prompt: list[int],
              page: int = PAGE) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Greedy tokens of PagedCache + generate for one prompt, their log-probabilities, and the gap
    between the best and the second-best logit at each."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                         **cache_argument(model, PagedCache(kv_cache_config, max_tokens=256, block_size=page)))
    tokens = out.sequences[0, len(prompt):]
    logits = torch.stack(out.logits)[:, 0].float()
    return tokens.tolist(), logits.softmax(-1).gather(1, tokens[:, None]).squeeze(1).log().cpu(), margins(logits)


def assert_same_as_reference(model, kv_cache_config, prompts, outputs, copies: int = 1, sampled: bool = False) -> None:
    """outputs: `copies` results per prompt, in prompt order. The log-probabilities of `sampled`
    ones are those of the sampling distribution, not compared."""
    assert len(outputs) == copies * len(prompts)
    for i, prompt in enumerate(prompts):
        tokens, logprobs, _ = reference(model, kv_cache_config, prompt)
        for output in outputs[i * copies:(i + 1) * copies]:
            assert output.generated_tokens == tokens, (output.request_id, prompt)
            assert sampled or torch.equal(torch.tensor(output.logprobs), logprobs), output.request_id


def assert_as_reference_up_to_near_ties(expected, outputs, near_tie: float) -> int:
    """Each output has NEW_TOKENS tokens, equal to its reference's (`reference`'s results, in order) up to
    the first one whose best two logits are within `near_tie`. Returns how many equal it throughout."""
    assert [len(output.generated_tokens) for output in outputs] == [NEW_TOKENS] * len(outputs)
    return assert_equal_up_to_near_ties([(tokens, gaps) for tokens, _, gaps in expected],
                                        [output.generated_tokens for output in outputs], near_tie)


class Steps:
    """What each continuous-batching step gave fp8kv's attention (once per step run in Python, not per
    replay of a CUDA graph): whether it took the decode fast path, the query rows, and those no request
    owns (transformers' padding)."""

    def __init__(self):
        self.decode, self.rows, self.padding_rows, self.query_lens, self.key_lens = [], [], [], [], []

    def record(self, seq_ends, kwargs) -> None:
        query_ends = kwargs["cu_seq_lens_q"]
        rows = kwargs["write_index"][0].numel() if kwargs["block_table"] is None else query_ends.numel() - 1
        self.decode.append(kwargs["block_table"] is not None)
        self.rows.append(rows)
        self.padding_rows.append(rows - int(query_ends[-1]))
        self.query_lens.append(query_ends.diff().tolist())
        self.key_lens.append(seq_ends.diff().tolist())

    def chunked_prefills(self) -> int:
        """Steps that prefill part of a prompt whose start is already cached."""
        return sum(any(1 < q < k for q, k in zip(qs, ks)) for qs, ks in zip(self.query_lens, self.key_lens))


@pytest.fixture
def steps(monkeypatch) -> Steps:
    found = Steps()
    step_metadata = cb_steps._step_metadata

    def spy(allocator, seq_ends, kwargs, padded):
        if not cb_steps._capturing(seq_ends):  # reading the values would end a capture
            found.record(seq_ends, kwargs)
        return step_metadata(allocator, seq_ends, kwargs, padded)

    monkeypatch.setattr(cb_steps, "_step_metadata", spy)
    return found


@pytest.fixture
def reports(monkeypatch) -> list:
    """(cache, report) of each transformers cache made for fp8kv, as it is made."""
    made = []
    describe = continuous_batching.describe

    def spy(cache):
        made.append((cache, describe(cache)))
        return made[-1][1]

    monkeypatch.setattr(continuous_batching, "describe", spy)
    return made


# ----------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("cache_name", CACHES)
def test_generate_batch_gives_the_tokens_of_paged_cache_generate(cache_name, steps):
    # Four requests at once: short ones decoding while the 40-token one is prefilled in chunks of the
    # 32-token budget, then decode steps of several requests on the fast path.
    model = tiny_model()
    config = kv_cache(model, cache_name)
    prompts = random_prompts([5, 9, 40, 23])
    outputs = generate_batch(enable_continuous_batching(model, config), prompts)
    assert_same_as_reference(model, config, prompts, outputs)
    assert steps.chunked_prefills() > 0
    assert sum(steps.decode) > 0 and max(rows for rows, decode in zip(steps.rows, steps.decode) if decode) > 1


def test_checkpoint_scales_give_the_same_text_on_fn_and_fnuz_pages(tmp_path):
    # Scales read from a checkpoint (per KV head, calibrated for e4m3fn) by load_kv_cache_config, which
    # doubles them for an e4m3fnuz cache: both caches then hold the same bits (the default, rotated
    # recipe, whose scales the loader derives from the plain ones), so the text and its
    # log-probabilities are the same, and those of PagedCache + generate.
    model = tiny_model()
    plain = kv_cache(model, "e4m3-plain-head")
    model.save_pretrained(tmp_path)
    save_file({f"model.layers.{i}.self_attn.{name}_scale": torch.tensor(getattr(plain, f"{name}_scales")[i])
               for i in range(2) for name in ("k", "v")}, str(tmp_path / "kv_scales.safetensors"))
    prompts = random_prompts([5, 40, 23])
    configs = {fmt: load_kv_cache_config(tmp_path, fmt) for fmt in ("float8_e4m3fn", "float8_e4m3fnuz")}
    assert configs["float8_e4m3fn"].rotation is Rotation.HADAMARD
    assert configs["float8_e4m3fnuz"].k_scales == tuple(tuple(2 * s for s in layer)
                                                       for layer in configs["float8_e4m3fn"].k_scales)
    outputs = {}
    for fmt, config in configs.items():
        outputs[fmt] = generate_batch(enable_continuous_batching(model, config), prompts)
        assert_same_as_reference(model, config, prompts, outputs[fmt])
    assert [(o.generated_tokens, o.logprobs) for o in outputs["float8_e4m3fn"]] == [
        (o.generated_tokens, o.logprobs) for o in outputs["float8_e4m3fnuz"]]


def test_the_formats_give_different_text():
    # The comparison above can tell formats apart: the same prompts on bf16 and e5m2 pages diverge.
    model = tiny_model()
    prompts = random_prompts([5, 9, 40, 23])
    texts = {name: [o.generated_tokens for o in generate_batch(enable_continuous_batching(model, kv_cache(model, name)),
                                                               prompts)] for name in ("auto", "e5m2-plain-head")}
    assert texts["auto"] != texts["e5m2-plain-head"]


def test_shared_prompt_prefixes_give_the_same_tokens(monkeypatch):
    # Three prompts starting with the same 37 tokens: once the first is prefilled, the next ones find its
    # two complete pages in the cache and prefill only the rest.
    matched = []
    search = transformers_cache.PagedAttentionCache.search_prefix_match
    monkeypatch.setattr(transformers_cache.PagedAttentionCache, "search_prefix_match",
                        lambda self, *args: matched.append(search(self, *args)) or matched[-1])
    model = tiny_model()
    config = kv_cache(model, "e4m3-rotated-head")
    prompts = random_prompts([3, 7, 11], prefix=random_prompts([37], seed=2)[0])
    outputs = generate_batch(enable_continuous_batching(model, config), prompts)
    assert sorted(matched) == [0, 2 * PAGE, 2 * PAGE]
    assert_same_as_reference(model, config, prompts, outputs)


def test_forked_requests_copy_the_fp8_pages(monkeypatch):
    # num_return_sequences=3 forks each request after its prefill: the children share its complete
    # pages and get a byte copy of its last one. Sampling from the top token only (transformers'
    # continuous batching forks sampled requests, not greedy ones) makes each copy the greedy text,
    # token for token, as long as the two best logits never tie (checked below on the reference).
    copies = []
    copy = transformers_cache.PagedAttentionCache.perform_cache_copy
    monkeypatch.setattr(transformers_cache.PagedAttentionCache, "perform_cache_copy",
                        lambda self, blocks: copies.append(blocks) or copy(self, blocks))
    model = tiny_model()
    config = kv_cache(model, "e4m3-rotated-head")
    enable_continuous_batching(model, config)
    prompts = random_prompts([20, 37], seed=2)  # prompts whose reference has no tie
    assert all((reference(model, config, prompt)[2] > 0).all() for prompt in prompts)
    outputs = generate_batch(model, prompts, greedy(do_sample=True, top_k=1, num_return_sequences=3))
    assert any(src for blocks in copies for src, _ in blocks.values())
    assert_same_as_reference(model, config, prompts, outputs, copies=3, sampled=True)


def test_padded_steps_under_torch_compile(steps):
    # torch.compile of the step (here with the eager backend: dynamo traces it, nothing is generated)
    # makes transformers pad every step to fixed sizes: prefill steps to 64 query rows whatever their
    # requests hold, decode steps to 4 requests for 3. The rows past the last request get no slot and
    # their output is ignored.
    model = tiny_model()
    config = kv_cache(model, "e4m3-rotated-head")
    prompts = random_prompts([5, 9, 40])
    compiled = CompileConfig(backend="eager", fullgraph=False)
    outputs = generate_batch(enable_continuous_batching(model, config), prompts, max_requests_per_batch=4,
                             varlen_compile_config=compiled, decode_compile_config=compiled)
    assert_same_as_reference(model, config, prompts, outputs)
    padded = [(decode, pad) for decode, pad in zip(steps.decode, steps.padding_rows) if pad > 0]
    assert any(not decode for decode, _ in padded), steps.padding_rows
    assert any(0 in lens for lens, decode in zip(steps.key_lens, steps.decode) if decode), steps.key_lens


def test_padding_rows_are_neither_written_nor_read():
    # A padded step as transformers makes it, on pages of 4 tokens in blocks of 16 rows: request 0 has 3
    # tokens cached in block 2 and 2 new ones (rows 35 and 48, block 3), request 1 2 new ones in block
    # 4, request 2 is padding (no tokens), and 6 query rows of 10 belong to no request (their write
    # rows point at the trash, row 0). Those rows get no slot and a sequence of their own over block 0,
    # its table widened to hold 6 tokens, so the kernel's sequences own every row.
    allocator = type("Allocator", (), {"tokens_per_page": 4, "block_physical_stride": 16, "index": 0,
                                       "layer_type": "full_attention"})()
    kwargs = {"block_table": None, "cu_seq_lens_q": torch.tensor([0, 2, 4, 4], dtype=torch.int32),
              "write_index": [torch.tensor([35, 48, 64, 65] + [0] * 6)],
              "read_index": [torch.tensor([32, 33, 34, 35, 48, 64, 65] + [0] * 6)],
              "max_length_k": {"full_attention": 5}}
    seq_ends = torch.tensor([0, 5, 7, 7], dtype=torch.int32)
    batch = cb_steps._step_metadata(allocator, seq_ends, kwargs, padded=True)
    assert batch.slot_mapping.tolist() == [2 * 4 + 3, 3 * 4, 4 * 4, 4 * 4 + 1] + [-1] * 6
    assert batch.block_tables.tolist() == [[2, 3, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert batch.seq_lens.tolist() == [5, 2, 0, 6]
    assert batch.cu_seqlens_q.tolist() == [0, 2, 4, 4, 10]
    unpadded = cb_steps._step_metadata(allocator, seq_ends, kwargs, padded=False)
    assert unpadded.block_tables.tolist() == [[2, 3], [4, 0], [0, 0]] and unpadded.seq_lens.tolist() == [5, 2, 0]


def test_the_manager_serves_requests_added_one_by_one():
    model = tiny_model()
    config = kv_cache(model, "e5m2-plain-head")
    prompts = random_prompts([5, 40, 23])
    manager = enable_continuous_batching(model, config).init_continuous_batching(greedy(), batching())
    manager.start()
    try:
        ids = [manager.add_request(prompt, request_id=f"request {i}", max_new_tokens=NEW_TOKENS)
               for i, prompt in enumerate(prompts)]
        results = {}
        while len(results) < len(prompts):
            result = manager.get_result(timeout=10)
            assert result is not None, "no result within 10 s"
            if result.is_finished():
                results[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=10)
    assert not manager.is_running()
    assert [results[i].error for i in ids] == [None] * len(ids)
    assert_same_as_reference(model, config, prompts, [results[i] for i in ids])


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e4m3fnuz"])
def test_a_memory_budget_holds_twice_the_blocks_in_fp8(fmt, monkeypatch, reports):
    # transformers sizes its cache from the memory it finds (here a fixed 16 MiB, its share already
    # taken): the cache gets what is left once the activations of a 32-token step are reserved, in
    # blocks of 16 tokens x 2 layers x K,V x 2 heads x 64 dims x 1 byte (FP8) or 2 (bf16).
    monkeypatch.setattr(transformers_cache.PagedAttentionMemoryHandler, "get_available_memory",
                        lambda self: 16 << 20)
    model = tiny_model()
    prompts = random_prompts([5, 9])
    for config in (kv_cache(model, "auto"), KVCacheConfig.unit_scales(fmt, 2)):
        generate_batch(enable_continuous_batching(model, config), prompts, num_blocks=None)
    (bf16, bf16_report), (fp8, fp8_report) = reports
    for cache, report, itemsize, dtype in ((bf16, bf16_report, 2, torch.bfloat16),
                                          (fp8, fp8_report, 1, KVCacheDtype.parse(fmt).storage_dtype)):
        key_pages, value_pages = cache.cache_allocators["full_attention"].get_cache_for_block_table(1)
        assert key_pages.dtype == value_pages.dtype == dtype
        block_bytes = 2 * 2 * PAGE * 2 * 64 * itemsize
        allocated = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
        trash = 2 * cache.bytes_per_sector
        assert cache.num_blocks == (allocated - trash) // block_bytes
        assert f"{cache.num_blocks:,} blocks of {PAGE} tokens" in report and f"{allocated:,} bytes" in report
    # Each cache token also costs the 8 bytes of its read index, in either format, so the ratio stays
    # just below 2: (2c + 8) / (c + 8) for c bytes of FP8 K/V, here 512 per token; less 0.01 for the
    # whole sectors (measured: 2008 / 1010 = 1.988, the bf16 cache's two scratch sectors being larger).
    assert (2 * 512 + 8) / (512 + 8) - 0.01 <= fp8.num_blocks / bf16.num_blocks <= 2


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("model_class, config, layers", [
    (transformers.MistralForCausalLM, {"sliding_window": 16}, "mistral model has sliding_attention (layers 0, 1)"),
    (transformers.Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     "qwen2 model has sliding_attention (layers 1)"),
], ids=["mistral, every layer", "qwen2, layer 1"])
def test_a_model_with_sliding_window_layers_is_refused(model_class, config, layers):
    model = model_class(model_class.config_class(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **config)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=rf"^fp8kv's continuous batching needs every layer to use full attention, but "
                                         rf"this {re.escape(layers)}: transformers keeps sliding-window layers in a "
                                         r"ring buffer .* \(Gemma 2 and 3, Mistral and Qwen2 configs that set a "
                                         r"sliding window, GPT-OSS, Cohere2, ...\) .*PagedCache runs their windows$"):
        enable_continuous_batching(model, KVCacheConfig.unit_scales("e4m3", 2))
    assert model.config._attn_implementation != "fp8kv"


def test_other_bad_arguments_are_refused():
    model = tiny_model()
    with pytest.raises(TypeError, match="kv_cache must be a KVCacheConfig, got str"):
        enable_continuous_batching(model, "e4m3")
    with pytest.raises(ValueError, match="the KVCacheConfig has 3 layers but the model has 2"):
        enable_continuous_batching(model, KVCacheConfig.unit_scales("e4m3", 3))
    with pytest.raises(ValueError, match="the model computes in torch.float32; .* model.to\\(torch.bfloat16\\)"):
        enable_continuous_batching(model.float(), KVCacheConfig.unit_scales("e4m3", 2))


HOOKED = [(transformers_cache.PagedAttentionCache, "__init__"), (transformers_cache.PagedAttentionCache, "update"),
          (transformers_cache.PagedAttentionMemoryHandler, "__init__"),
          (continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn"),
          (input_outputs.ContinuousBatchingIOs, "get_model_kwargs"),
          (input_outputs.ContinuousBatchingAsyncIOs, "get_model_kwargs"),
          (initialization, "ensure_decode_fast_path_is_available")]  # last: the signature test deletes it


def hooked_functions(hooked=HOOKED) -> list:
    return [getattr(owner, name) for owner, name in hooked]


@pytest.fixture
def uninstalled(monkeypatch):
    """As before the first model is enabled (the hooks installed so far stay, restored after the test)."""
    for owner, name in HOOKED:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(continuous_batching, "_TRANSFORMERS", None)


@pytest.mark.parametrize("version", ["5.22.0", "5.25.0.dev0", "6.0.0"])
def test_an_unsupported_transformers_is_one_error_and_installs_nothing(version, uninstalled, monkeypatch):
    monkeypatch.setattr("transformers.__version__", version)
    before = hooked_functions()
    with pytest.raises(continuous_batching.UnsupportedTransformersError,
                       match=rf"^fp8kv's continuous batching supports transformers 5\.23 to 5\.24; transformers "
                             rf"{version} is installed \(its continuous batching is not one these hooks were written "
                             r"for\): .* -m pip install 'transformers>=5\.23,<5\.25'$"):
        enable_continuous_batching(tiny_model(), KVCacheConfig.unit_scales("e4m3", 2))
    assert hooked_functions() == before and continuous_batching._TRANSFORMERS is None


def test_a_changed_private_signature_is_one_error_and_installs_nothing(uninstalled, monkeypatch):
    # A renamed parameter, a function gone, and a memory handler that no longer sets the reserves fp8kv
    # changes: all three in the one error.
    def memory_handler_init(self, config, cb_config, dtype, *args, **kwargs):
        self.cache_dtype = dtype

    monkeypatch.setattr(transformers_cache.PagedAttentionMemoryHandler, "__init__", memory_handler_init)
    monkeypatch.setattr(continuous_api.ContinuousBatchingManager, "switch_to_cb_friendly_attn",
                        lambda self, model: None)
    monkeypatch.delattr(initialization, "ensure_decode_fast_path_is_available")
    before = hooked_functions(HOOKED[:-1])
    with pytest.raises(continuous_batching.UnsupportedTransformersError,
                       match=r"\(ContinuousBatchingManager.switch_to_cb_friendly_attn takes \(self, model\), not "
                             r"\(self, model, auto_switch_to_flash, ...\); it has no "
                             r"ensure_decode_fast_path_is_available; PagedAttentionMemoryHandler.__init__ has no "
                             r"activation_dtype, num_attention_masks, kv_heads_at_peak\): .* -m pip install"):
        enable_continuous_batching(tiny_model(), KVCacheConfig.unit_scales("e4m3", 2))
    assert hooked_functions(HOOKED[:-1]) == before and continuous_batching._TRANSFORMERS is None


def test_inputs_that_no_longer_keep_their_streams_are_one_error(uninstalled, monkeypatch):
    # _ordering_reads_after_resets reads the stream each kind of inputs reads with.
    def async_inputs_init(self, cache, *args, **kwargs):
        self.io_pairs = []

    monkeypatch.setattr(input_outputs.ContinuousBatchingAsyncIOs, "__init__", async_inputs_init)
    before = hooked_functions()
    with pytest.raises(continuous_batching.UnsupportedTransformersError,
                       match=r"\(ContinuousBatchingAsyncIOs.__init__ has no h2d_stream\): .* -m pip install"):
        enable_continuous_batching(tiny_model(), KVCacheConfig.unit_scales("e4m3", 2))
    assert hooked_functions() == before and continuous_batching._TRANSFORMERS is None


# ----------------------------------------------------------------------------- hooks


def test_the_hooks_are_installed_once_and_serve_each_enabled_model_its_own_pages(reports):
    first, second = tiny_model(), tiny_model(seed=1)
    configs = kv_cache(first, "auto"), kv_cache(second, "e5m2-head")
    enable_continuous_batching(first, configs[0])
    installed = hooked_functions()
    enable_continuous_batching(first, configs[0])
    enable_continuous_batching(second, configs[1])
    assert hooked_functions() == installed
    # Each hook wraps transformers' own function, once.
    ours = continuous_batching.__file__
    assert all(f.__code__.co_filename == ours != f.__wrapped__.__code__.co_filename for f in installed)
    prompts = random_prompts([5, 40])
    for model, config in zip((first, second), configs):
        assert_same_as_reference(model, config, prompts, generate_batch(model, prompts))
    assert [cache.cache_allocators["full_attention"].cache_dtype for cache, _ in reports] == [
        torch.bfloat16, torch.float8_e5m2]


class RecordingStream:
    """A stream that records what it is made to wait for."""

    def __init__(self, log: list):
        self.device, self.log = torch.device("cuda", 0), log

    def wait_stream(self, other) -> None:
        self.log.append(("waits for", other))


@pytest.mark.parametrize("inputs_kind", ["async", "sync", "no compute stream"])
@pytest.mark.parametrize("served", [True, False], ids=["fp8kv's cache", "another cache"])
def test_the_stream_that_reads_the_inputs_waits_for_the_current_stream_first(inputs_kind, served, monkeypatch):
    # transformers resets the device inputs on the current stream and then fills them on another: the
    # asynchronous inputs' transfer stream copies a step into them, the synchronous inputs' compute stream
    # reads them. Before each step's inputs are handed over, that stream waits for the current one (for
    # the caches fp8kv serves; transformers' own are left as they are). Inputs without a compute stream
    # (the device inputs of an asynchronous pair, ordered by the pair; the inputs on the host) have
    # nothing to order. On any machine: the streams are stand-ins
    # (test_a_late_reset_of_the_inputs_does_not_reach_a_step runs the real ones on CUDA).
    continuous_batching.install_hooks()
    log = []
    cache = type("Cache", (), {})()
    if served:
        monkeypatch.setitem(cb_steps.CACHES, cache, None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current stream of", device))
    stream = RecordingStream(log)
    if inputs_kind == "async":
        inputs = object.__new__(input_outputs.ContinuousBatchingAsyncIOs)
        device_inputs = type("DeviceInputs", (), {"cache": cache})()
        inputs.io_pairs, inputs.h2d_stream = [type("Pair", (), {"device_io": device_inputs})()] * 2, stream
    else:
        inputs = object.__new__(input_outputs.ContinuousBatchingIOs)
        inputs.cache, inputs.compute_stream = cache, stream if inputs_kind == "sync" else None
    hooked = continuous_batching._ordering_reads_after_resets(lambda self, use_padding: log.append(
        ("inputs handed over", use_padding)) or "kwargs")
    assert hooked(inputs, use_padding=True) == "kwargs"
    ordered = served and inputs_kind != "no compute stream"
    waited = [("waits for", ("current stream of", stream.device))] if ordered else []
    assert log == waited + [("inputs handed over", True)]


def transformers_own_tokens(enable_another_model_first: bool) -> list:
    """generate_batch's tokens and log-probabilities for a model fp8kv does not enable (sdpa, bf16
    pages), in a new interpreter: with or without fp8kv's hooks installed by another model."""
    torch.set_num_threads(1)
    assert continuous_batching._TRANSFORMERS is None
    if enable_another_model_first:
        enable_continuous_batching(tiny_model(seed=1), KVCacheConfig.unit_scales("e4m3", 2))
        assert continuous_batching._TRANSFORMERS is not None
    outputs = generate_batch(tiny_model(), random_prompts([5, 40, 23]))
    return [(output.generated_tokens, output.logprobs) for output in outputs]


def test_a_model_not_enabled_keeps_transformers_own_continuous_batching():
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:  # a new interpreter each
        assert pool.apply(transformers_own_tokens, (False,)) == pool.apply(transformers_own_tokens, (True,))


# ----------------------------------------------------------------------------- the real model


def test_smollm2_generate_batch_gives_the_tokens_of_paged_cache_generate():
    # SmolLM2-135M (30 layers, 3 KV heads) on license text: three requests on e4m3 pages of the default
    # (rotated) recipe, with scales calibrated on another window. One request per step: on CPU a bf16
    # matmul's row can round differently with its place among the rows (measured on this model's
    # down_proj, 3 rows against 1), which the reference, one prompt at a time, cannot match.
    pytest.importorskip("gguf", reason="the real-model extra (gguf) is not installed")
    from checkpoints import smollm2_or_skip
    from fp8kv import models

    checkpoint = smollm2_or_skip()
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer(models.evaluation_text()[:4000], add_special_tokens=False)["input_ids"]
    config = kv_cache_configs(model, torch.tensor([text[:64]]), ["e4m3-rotated-head"],
                              progress=False)["e4m3-rotated-head"]
    prompts = [text[100:120], text[300:345], text[500:570]]
    outputs = generate_batch(enable_continuous_batching(model, config), prompts, max_batch_tokens=128,
                             max_requests_per_batch=1)
    assert_same_as_reference(model, config, prompts, outputs)


def test_the_serve_extra_requires_the_supported_transformers():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    from packaging.requirements import Requirement

    with open(pathlib.Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        serve = [Requirement(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["serve"]]
    (required,) = [r for r in serve if r.name == "transformers"]
    assert required.specifier == Requirement(cb_check._requirement()).specifier
    assert required.extras == {"serving"}


# ----------------------------------------------------------------------------- CUDA


@pytest.fixture
def replays(monkeypatch) -> list:
    """One entry per replay of a captured CUDA graph."""
    replayed = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replayed.append(graph) or replay(graph))
    return replayed


@pytest.mark.parametrize("cache_name", ["auto", "e4m3-rotated-head", "e4m3-centred-head", "e5m2-head"])
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "CUDA graphs"])
def test_generate_batch_on_each_device(device, cache_name, page, cuda_graphs, steps, replays):
    # On the GPU a bf16 matmul's rounding may depend on how many rows it multiplies, and continuous
    # batching stacks requests (and pads them under CUDA graphs) where the reference runs one at a
    # time: a logit may move by a rounding or two, which flips a greedy token only where the best two
    # logits of the reference are that close (bf16 logits tie often: their unit is 1/16 at 4 to 8; on
    # FP8 pages the roundings of the cache add, see NEAR_TIE_FP8). So each request's tokens must equal
    # the reference's up to its first such near tie, and all after it on most requests; the
    # log-probabilities are not compared. Under CUDA graphs transformers pads
    # the steps (query rows past the last request, empty decode requests) and runs them
    # asynchronously, replaying the graphs it captured after one eager run each.
    if cuda_graphs and device == "cpu":
        pytest.skip("CUDA graphs need CUDA")
    model = tiny_model()
    config = kv_cache(model, cache_name)  # calibrated on the CPU
    enable_continuous_batching(model.to(device), config)
    prompts = random_prompts([5, 9, 40, 23, 17, 31, 12, 50])
    expected = [reference(model, config, prompt, page) for prompt in prompts]
    outputs = generate_batch(model, prompts, page_size=page, num_blocks=64 * 16 // page, use_cuda_graph=cuda_graphs,
                             use_async_batching=cuda_graphs, return_logprobs=False)
    whole = assert_as_reference_up_to_near_ties(expected, outputs, NEAR_TIE_FP8 if config.dtype.is_fp8 else NEAR_TIE)
    assert whole >= len(prompts) - 2, f"{whole} of {len(prompts)} requests as the reference"
    assert steps.chunked_prefills() > 0 and any(steps.decode)
    if cuda_graphs:
        # Python runs a step only before its graph is captured; later steps of its sizes replay the graph.
        assert replays
    else:
        assert not replays


def test_a_late_reset_of_the_inputs_does_not_reach_a_step(device, monkeypatch):
    # transformers resets its device inputs with kernels on the current stream (when it makes them and
    # when a generation starts), copies each step into them on its transfer stream, and its compute
    # stream waits for that copy only. Here every reset starts about 50 ms late on the device and the
    # step after it about 300 ms late (sleeps queued before them), so that a reset not ordered before
    # the copy lands between the copy and the step that reads it, as it did now and then on a busy GPU
    # (the first step then ran on zeroed tokens); the tokens stay the reference's.
    if device == "cpu":
        pytest.skip("the inputs' streams are CUDA streams")
    reset, compute = input_outputs.ContinuousBatchingIOs._reset_static_tensors, model_runner.ModelRunner.compute_batch
    reset_pending = []

    def late_reset(self, *args, **kwargs):
        if self.device.type == "cuda":
            torch.cuda._sleep(100_000_000)  # clock cycles: about 50 ms on an H100
            reset_pending.append(True)
        return reset(self, *args, **kwargs)

    def late_step(self, model, batch_data):
        if reset_pending:
            reset_pending.clear()
            with torch.cuda.stream(self.inputs_and_outputs.compute_stream):
                torch.cuda._sleep(600_000_000)  # about 300 ms
        return compute(self, model, batch_data)

    monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "_reset_static_tensors", late_reset)
    monkeypatch.setattr(model_runner.ModelRunner, "compute_batch", late_step)
    model = tiny_model()
    config = kv_cache(model, "auto")
    enable_continuous_batching(model.to(device), config)
    prompts = random_prompts([5, 9, 40, 23])
    expected = [reference(model, config, prompt) for prompt in prompts]
    outputs = generate_batch(model, prompts, use_cuda_graph=True, use_async_batching=True, return_logprobs=False)
    assert_as_reference_up_to_near_ties(expected, outputs, NEAR_TIE)


def test_cuda_graph_capture_derives_the_step_indices_inside_the_graph(monkeypatch):
    # transformers runs a step once, then captures it on the same index tensors: the metadata derived
    # on the first run must not be reused by the capture, or the graph would replay that step's indices
    # on every later step. On any machine: capture is simulated.
    state = cb_steps.CacheState(KVCacheConfig.unit_scales("e4m3", 2), padded=True, fp8_math=False)
    derived = []
    monkeypatch.setattr(cb_steps, "_step_metadata", lambda *args: derived.append(args) or len(derived))
    allocator = type("Allocator", (), {"layer_type": "full_attention"})()
    seq_ends = torch.tensor([0, 5])
    kwargs = {"cu_seq_lens_k": {"full_attention": seq_ends}}
    capturing = [False]
    monkeypatch.setattr(cb_steps, "_capturing", lambda tensor: capturing[0])
    assert state.step(allocator, kwargs) == state.step(allocator, kwargs) == 1  # the eager run: once per step
    capturing[0] = True
    assert state.step(allocator, kwargs) == state.step(allocator, kwargs) == 2  # the capture: once more
