"""`vllm serve MODEL --kv-cache-dtype fp8 --attention-backend FP8KV` on 127.0.0.1, in vLLM's default
process layout: the OpenAI-compatible API server in one process, the engine core in another it
spawns. OpenAI chat completions, plain and streamed, from several clients at once, on the tiny
random Llama of vllm_engines.py, against fp8kv's transformers integration on the same cache format and
recipe (fp8kv's default, rotated).
"""

from __future__ import annotations

import concurrent.futures

import pytest

vllm = pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from vllm_engines import Reference, require_test_platform, served, write_tiny_model  # noqa: E402

from fp8kv.formats import KVCacheConfig  # noqa: E402

require_test_platform()

NEW_TOKENS = 16
CLIENTS = 4
NEAR_TIE, LOGPROB_TOLERANCE = 0.5, 0.15  # as test_vllm_engine.py's for FP8 caches, which says why


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": f"Question {i}: what is {i} + {i * 7}?" + " Think." * i}]


def chat(client, model: str, messages: list[dict], stream: bool = False):
    """A greedy chat completion of NEW_TOKENS tokens (end of text ignored), with the token ids and
    log-probabilities vLLM returns on request; for a stream, the text of its deltas in order."""
    request = dict(model=model, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0, stream=stream,
                   extra_body={"ignore_eos": True})
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**request)
                       if chunk.choices)
    request["extra_body"]["return_token_ids"] = True
    return client.chat.completions.create(logprobs=True, **request)


def test_chat_completions_plain_streamed_and_concurrent(tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    reference = Reference(model, KVCacheConfig.unit_scales("e4m3", 2))
    with served(model, tmp_path / "serve.log", "--kv-cache-dtype", "fp8", "--max-model-len", "512") as (server, url):
        processes = [p.name() + " " + " ".join(p.cmdline()) for p in psutil.Process(server.pid).children(recursive=True)]
        assert any("EngineCore" in p for p in processes), processes
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        plain = chat(client, name, conversation(0))
        assert chat(client, name, conversation(0), stream=True) == plain.choices[0].message.content
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda i: chat(client, name, conversation(i)), range(1, CLIENTS + 1)))
            streams = list(pool.map(lambda i: chat(client, name, conversation(i), stream=True), range(1, CLIENTS + 1)))
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    for response in [plain, *answers]:
        choice = response.choices[0]
        assert choice.finish_reason == "length" and response.usage.completion_tokens == NEW_TOKENS
        tokens = choice.token_ids
        assert len(tokens) == NEW_TOKENS
        reference.assert_followed(response.prompt_token_ids, tokens, [t.logprob for t in choice.logprobs.content],
                                  NEAR_TIE, LOGPROB_TOLERANCE)
    # A streamed answer is the plain one's text, whether other clients' requests ran with it or not.
    assert streams == [a.choices[0].message.content for a in answers]
