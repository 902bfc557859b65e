"""transformers' continuous batching on fp8kv's pages (enable_continuous_batching): `generate_batch`
and the manager on tiny random Llama models in bf16 (and SmolLM2 where the real-model extra is
installed), token for token against fp8kv's own PagedCache + generate on the same KVCacheConfig.

Both run every row through the same kernels, over the same FP8 bits: the reference is one prompt at
a time, where continuous batching mixes requests, chunks prompts, shares prefixes, forks and pads.
So greedy tokens are compared exactly, and so are the log-probabilities transformers returns for
them (log of the softmax of the same logits; measured equal bit for bit on CPU): a difference of a
rounding anywhere in the cache would show.
"""

import multiprocessing

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as transformers_cache  # noqa: E402
from transformers.generation.continuous_batching import continuous_api, initialization  # noqa: E402

from fp8kv.evaluate.caches import kv_cache_configs  # noqa: E402
from fp8kv.formats import KVCacheConfig  # noqa: E402
from fp8kv.integrations import transformers_continuous_batching as continuous_batching  # noqa: E402
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable_continuous_batching  # noqa: E402

VOCAB, NEW_TOKENS, PAGE = 64, 12, 16
# Every format and recipe, with scales calibrated per KV head on the model (fp8kv.evaluate's names:
# FORMAT[-RECIPE]-head; e4m3fnuz gets the e4m3fn scales doubled, as the checkpoint loader does).
CACHES = ["auto", "e4m3-head", "e4m3-rotated-head", "e4m3-centred-head", "e5m2-head", "e5m2-centred-head",
          "e4m3fnuz-rotated-head"]

# Tiny models and tensors: one CPU thread (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def tiny_model(seed: int = 0, attn_implementation: str = "sdpa", **config):
    """A 2-layer GQA Llama (4 query and 2 KV heads of 64, a 64-token vocabulary) with random bf16
    weights, spread 5x transformers' default so that greedy text changes token to token rather than
    repeating one."""
    config = transformers.LlamaConfig(**{
        "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.1, **config})
    config._attn_implementation = attn_implementation
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


def reference(model, kv_cache_config: KVCacheConfig, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of PagedCache + generate for one prompt, and their log-probabilities."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                         **cache_argument(model, PagedCache(kv_cache_config, max_tokens=256, block_size=PAGE)))
    tokens = out.sequences[0, len(prompt):]
    probabilities = torch.stack(out.logits)[:, 0].float().softmax(-1)
    return tokens.tolist(), probabilities.gather(1, tokens[:, None]).squeeze(1).log()


def assert_same_as_reference(model, kv_cache_config, prompts, outputs, copies: int = 1, sampled: bool = False) -> None:
    """outputs: `copies` results per prompt, in prompt order. The log-probabilities of `sampled`
    ones are those of the sampling distribution, not compared."""
    assert len(outputs) == copies * len(prompts)
    for i, prompt in enumerate(prompts):
        tokens, logprobs = reference(model, kv_cache_config, prompt)
        for output in outputs[i * copies:(i + 1) * copies]:
            assert output.generated_tokens == tokens, (output.request_id, prompt)
            assert sampled or torch.equal(torch.tensor(output.logprobs), logprobs), output.request_id


class Steps:
    """What each continuous-batching step gave fp8kv's attention (once per step): whether it took the
    decode fast path, the query rows, and those no request owns (transformers' padding)."""

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
    step_metadata = continuous_batching._step_metadata

    def spy(allocator, seq_ends, kwargs, padded):
        found.record(seq_ends, kwargs)
        return step_metadata(allocator, seq_ends, kwargs, padded)

    monkeypatch.setattr(continuous_batching, "_step_metadata", spy)
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


def test_the_formats_give_different_text():
    # The comparison above can tell formats apart: the same prompts on bf16 and e5m2 pages diverge.
    model = tiny_model()
    prompts = random_prompts([5, 9, 40, 23])
    texts = {name: [o.generated_tokens for o in generate_batch(enable_continuous_batching(model, kv_cache(model, name)),
                                                               prompts)] for name in ("auto", "e5m2-head")}
    assert texts["auto"] != texts["e5m2-head"]


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
    prompts = random_prompts([20, 37])
    for prompt in prompts:
        ids = torch.tensor([prompt])
        logits = torch.stack(model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            **cache_argument(model, PagedCache(config, max_tokens=256))).logits)
        top2 = logits.float().topk(2, dim=-1).values
        assert (top2[..., 0] > top2[..., 1]).all()
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
    batch = continuous_batching._step_metadata(allocator, seq_ends, kwargs, padded=True)
    assert batch.slot_mapping.tolist() == [2 * 4 + 3, 3 * 4, 4 * 4, 4 * 4 + 1] + [-1] * 6
    assert batch.block_tables.tolist() == [[2, 3, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert batch.seq_lens.tolist() == [5, 2, 0, 6]
    assert batch.cu_seqlens_q.tolist() == [0, 2, 4, 4, 10]
    unpadded = continuous_batching._step_metadata(allocator, seq_ends, kwargs, padded=False)
    assert unpadded.block_tables.tolist() == [[2, 3], [4, 0], [0, 0]] and unpadded.seq_lens.tolist() == [5, 2, 0]
