"""SmolLM2-135M-Instruct's real weights (fp8kv.models' converted checkpoint) through vLLM on fp8kv's
backend with an e4m3 cache, on each of fp8kv's recipes, against fp8kv's transformers integration on
the same recipe and scales: vLLM's per-token log-probabilities of real text (prompt_logprobs) and
its greedy answer to a chat prompt. The checkpoint is calibrated by fp8kv's calibrate (per KV head,
on the end of the license texts), as a user would before serving it; the evaluated windows are from
the start of the texts. Skipped without the real-model extra.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the real-model extra (gguf) is not installed")

from vllm import SamplingParams, TokensPrompt  # noqa: E402
from checkpoints import smollm2_or_skip  # noqa: E402
from vllm_engines import Reference, engine, generated, require_test_platform  # noqa: E402

from fp8kv import evaluate as ev  # noqa: E402
from fp8kv import load_kv_cache_config, models  # noqa: E402
from fp8kv.calibration import calibrate_checkpoint, make_batches  # noqa: E402

require_test_platform()

SEQ_LEN, WINDOWS = 256, 2
CALIBRATION_TOKENS = 2048
NEW_TOKENS = 16
ROTATIONS = {"plain": "none", "rotated + centred": "hadamard"}
# vLLM's bf16 model and transformers' round differently over 30 layers, and a rounding of a K or V
# element may move its FP8 code, so single tokens' log-probabilities differ by up to 1.6 (measured
# over 4 windows of 1024 tokens: 3.2 once); per window of 255 tokens the mean |difference| measured
# 0.08 to 0.14, the mean difference (a perplexity change of the window) at most 0.032.
MEAN_LOGPROB_ERROR, MEAN_NLL_ERROR = 0.2, 0.06
# The answer: vLLM's token the reference's best at every step (gap 0), log-probabilities within 0.056.
NEAR_TIE, LOGPROB_TOLERANCE = 0.5, 0.15


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_or_skip()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    return tokenizer(models.evaluation_text(), add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def calibrated(checkpoint, text_ids, tmp_path_factory):
    """The checkpoint calibrated per KV head by fp8kv's calibrate (plain scales for every engine, the
    rotated recipe's scales and K offsets in fp8kv_kv_cache.json), on the text's last tokens."""
    out = tmp_path_factory.mktemp("smollm2") / "calibrated"
    batches = make_batches([torch.tensor(text_ids[-CALIBRATION_TOKENS:])], seq_len=512)
    calibrate_checkpoint(checkpoint, batches, out, granularity="head", dtype=torch.bfloat16, progress=False)
    return out


@pytest.mark.parametrize("recipe", ROTATIONS)
def test_log_probabilities_and_answers_follow_the_transformers_integration(recipe, calibrated, tokenizer, text_ids):
    rotation = ROTATIONS[recipe]
    windows = ev.token_windows(text_ids, SEQ_LEN, WINDOWS, tokenizer.bos_token_id).tolist()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the GNU General Public License?"}],
                                         add_generation_prompt=True, tokenize=False)
    chat = tokenizer(text, add_special_tokens=False)["input_ids"]
    with engine(calibrated, kv_cache_dtype="fp8", dtype="bfloat16", max_model_len=1024,
                additional_config={"fp8kv_rotation": rotation}) as llm:
        scored = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows],
                              SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
        answer = generated(llm, [chat], NEW_TOKENS, logprobs=0)[0].outputs[0]
    kv_cache = load_kv_cache_config(calibrated, "fp8_e4m3", rotation=rotation)
    assert kv_cache.recipe == recipe
    reference = Reference(calibrated, kv_cache)
    for window, output in zip(windows, scored):
        got = torch.tensor([step[token].logprob for step, token in zip(output.prompt_logprobs[1:], window[1:])])
        expected = reference.log_softmax(window)[:-1].gather(1, torch.tensor(window[1:])[:, None])[:, 0]
        error = got - expected
        assert float(error.abs().mean()) <= MEAN_LOGPROB_ERROR and abs(float(error.mean())) <= MEAN_NLL_ERROR, error
    tokens = list(answer.token_ids)
    reference.assert_followed(chat, tokens, [step[t].logprob for step, t in zip(answer.logprobs, tokens)],
                              NEAR_TIE, LOGPROB_TOLERANCE)
