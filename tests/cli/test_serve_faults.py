"""`python -m fp8kv serve` under faults: a request that can never be served (its prompt, or its prompt
and max_tokens, past the model's context or the cache) is refused with HTTP 400 naming the limit, and
the server answers the next one; malformed fields are a 4xx naming the field, never a 500; a step that
raises (injected through a prelude run in the server's process) fails the requests it held and the
server goes on; a worker that stops anyway stops the server, exit status 1; /health says whether the
worker runs; SIGINT and SIGTERM end the requests still running after --shutdown-timeout with an error,
and the process ends within a bounded time."""

import asyncio
import re
import signal
import threading
import time

import pytest
from served import MAX_TOKENS, STOP_S, Server, openai, write_checkpoint


pytestmark = pytest.mark.usefixtures("one_cpu_thread")

CONTEXT = 256  # the tiny model's max_position_embeddings
PROMPT = "w5 w6 w7"
# Words whose token in a prompt makes the prelude's step fail (FAIL_WORD), or fail and leave the device
# broken (BREAK_WORD: the inputs' reset then raises too, as a synchronization of a broken GPU would).
FAIL_WORD, BREAK_WORD = "w60", "w59"
FAULTS = f"""
from transformers.generation.continuous_batching import continuous_api, input_outputs

step = continuous_api.ContinuousBatchProcessor._generation_step
FAIL, BREAK = {int(FAIL_WORD[1:]) + 3}, {int(BREAK_WORD[1:]) + 3}  # their token ids


def broken_reset(self):
    raise RuntimeError("injected: the device is broken")


def failing_step(self, model):
    prompts = {{token for future in self.inputs_and_outputs.requests_in_batch for token in future.state.initial_tokens}}
    if BREAK in prompts:
        input_outputs.ContinuousBatchingIOs.reset = broken_reset
    if FAIL in prompts or BREAK in prompts:
        raise RuntimeError('injected "fault"')
    return step(self, model)


continuous_api.ContinuousBatchProcessor._generation_step = failing_step
"""


def chat(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], **fields}


def words(count: int) -> str:
    return " ".join(f"w{3 + i % 50}" for i in range(count))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("served") / "tiny", context=CONTEXT)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """A server whose steps fail on FAIL_WORD and BREAK_WORD (see FAULTS)."""
    served = Server(checkpoint, tmp_path_factory.mktemp("logs") / "server.log", prelude=FAULTS)
    yield served
    served.close()


@pytest.fixture(scope="module")
def answer(server):
    """The server's answer to PROMPT before any fault (status 200, its text)."""
    status, body = server.post(chat(PROMPT, max_tokens=MAX_TOKENS))
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def assert_serves(server, answer) -> None:
    """The server answers PROMPT as it did first, and /health reports every page back in the free pool."""
    status, body = server.post(chat(PROMPT, max_tokens=MAX_TOKENS))
    assert (status, body["choices"][0]["message"]["content"]) == (200, answer), body
    status, health = server.health()
    assert status == 200 and health["requests"] == {"running": 0, "waiting": 0}, health
    pages = health["pages"]
    assert pages["held"] == 0 and pages["free"] + pages["cached"] == pages["total"], pages


def cache_tokens(server) -> int:
    return int(re.search(r" blocks of \d+ tokens \(([\d,]+) tokens\)", server.startup_line)[1].replace(",", ""))


# ----------------------------------------------------------------------------- what can never be served


def test_a_prompt_past_the_context_is_refused_and_the_server_goes_on(server, answer):
    status, body = server.post(chat(words(CONTEXT)))  # with the template's <bos>, CONTEXT + 1 tokens
    assert status == 400 and body["error"]["param"] == "messages", body
    assert body["error"]["message"] == (f"messages: the prompt is {CONTEXT + 1} tokens and the model's context "
                                        f"(max_position_embeddings) is {CONTEXT}, which leaves no room for an "
                                        "answer: shorten it")
    assert_serves(server, answer)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_refused_with_the_limit(server, answer, field):
    status, body = server.post(chat(PROMPT, **{field: CONTEXT}))  # the prompt: <bos> and 3 words
    assert status == 400 and body["error"] == {
        "message": f"{field} {CONTEXT}: the prompt's 4 tokens and {CONTEXT} new ones pass the model's context "
                   f"(max_position_embeddings), {CONTEXT} tokens: ask for at most {CONTEXT - 4}",
        "type": "invalid_request_error", "param": field}, body
    status, body = server.post(chat(PROMPT, **{field: CONTEXT - 4}))
    assert status == 200 and body["usage"]["total_tokens"] <= CONTEXT, body
    assert_serves(server, answer)


def test_a_request_without_max_tokens_gets_what_fits_the_context(server):
    status, body = server.post(chat(words(CONTEXT - 11)))  # 246 tokens: 10 left
    assert status == 200, body
    usage, finish = body["usage"], body["choices"][0]["finish_reason"]
    assert usage["prompt_tokens"] == CONTEXT - 10 and usage["total_tokens"] <= CONTEXT, body
    assert (usage["completion_tokens"] == 10) == (finish == "length"), body


def test_the_limits_hold_on_the_completions_endpoint(server):
    status, body = server.post({"prompt": words(CONTEXT + 5)}, path="/v1/completions")
    assert status == 400 and body["error"]["param"] == "prompt", body
    status, body = server.post({"prompt": PROMPT, "max_tokens": CONTEXT}, path="/v1/completions")
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    assert "ask for at most 253" in body["error"]["message"], body  # the prompt: 3 tokens (no template)


@pytest.fixture(scope="module")
def small_cache_server(tmp_path_factory):
    """A model of 4096 positions served on 4 blocks of pages (1024 tokens): the cache is the limit."""
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("served") / "long", context=4096)
    served = Server(checkpoint, tmp_path_factory.mktemp("logs") / "server.log",
                    args=("--kv-cache-memory", str(4.5 * 256 * 512 / 2**30)))
    yield served
    served.close()


def test_a_prompt_past_the_cache_is_refused_and_the_server_goes_on(small_cache_server):
    served, tokens = small_cache_server, cache_tokens(small_cache_server)
    assert tokens == 1024, served.startup_line
    status, before = served.post(chat(PROMPT, max_tokens=MAX_TOKENS))
    assert status == 200, before
    status, body = served.post(chat(words(2000)))
    assert status == 400 and body["error"] == {
        "message": f"messages: the prompt is 2001 tokens and this server's KV cache (--kv-cache-memory) is {tokens}, "
                   "which leaves no room for an answer: shorten it",
        "type": "invalid_request_error", "param": "messages"}, body
    status, body = served.post(chat(words(999), max_tokens=100))
    assert status == 400 and body["error"]["message"] == (
        f"max_tokens 100: the prompt's 1000 tokens and 100 new ones pass this server's KV cache (--kv-cache-memory), "
        f"{tokens} tokens: ask for at most {tokens - 1000}"), body
    status, after = served.post(chat(PROMPT, max_tokens=MAX_TOKENS))
    assert (status, after["choices"]) == (200, before["choices"]), after
    status, body = served.post(chat(words(999), max_tokens=tokens - 1000))  # the largest request that fits
    assert status == 200 and body["usage"]["total_tokens"] <= tokens, body
    assert served.health()[1]["pages"]["held"] == 0
    assert "Traceback" not in served.stderr()


# ----------------------------------------------------------------------------- malformed requests


@pytest.mark.parametrize("body, status, field", [
    ({"messages": []}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [5]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": PROMPT}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": "{"}}]}]},
     400, "messages"),
    (chat(PROMPT, max_tokens="ten"), 400, "max_tokens"),
    (chat(PROMPT, max_tokens=-1), 400, "max_tokens"),
    (chat(PROMPT, max_tokens=0), 400, "max_tokens"),
    (chat(PROMPT, max_tokens=2.5), 400, "max_tokens"),
    (chat(PROMPT, max_tokens=True), 400, "max_tokens"),
    (chat(PROMPT, max_completion_tokens="x"), 400, "max_completion_tokens"),
    (chat(PROMPT, temperature="hot"), 400, "temperature"),
    (chat(PROMPT, top_p=2), 400, "top_p"),
    (chat(PROMPT, stream="yes"), 400, "stream"),
    (chat(PROMPT, stop=5), 400, "stop"),
    (chat(PROMPT, seed=-1), 400, "seed"),
    (chat(PROMPT, logit_bias="x"), 400, "logit_bias"),
    (chat(PROMPT, generation_config="{not json"), 400, "generation_config"),
    (chat(PROMPT, model=5), 400, "model"),
    (chat(PROMPT, n=2), 400, "n"),
    (chat(PROMPT, logprobs=True), 400, "logprobs"),
    (chat(PROMPT, presence_penalty=0.5), 400, "presence_penalty"),
    (chat(PROMPT, response_format={"type": "json_object"}), 400, "response_format"),
    (chat(PROMPT, unknown_field=1), 422, "unknown_field"),
    ({"prompt": 5}, 400, "prompt"),
], ids=lambda value: None if isinstance(value, (dict, int)) else value)
def test_a_malformed_field_is_a_4xx_naming_it(server, answer, body, status, field):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    got, answered = server.post(body, path=path)
    assert got == status and field in str(answered), answered
    assert_serves(server, answer)


@pytest.mark.parametrize("data, status", [(b'{"messages": [', 422), (b'{"messages": "\xff\xfe"}', 400)],
                         ids=["malformed JSON", "not UTF-8"])
def test_a_body_that_is_not_json_is_a_4xx(server, data, status):
    assert server.post(data)[0] == status


def test_fields_that_ask_for_what_the_server_does_anyway_are_taken(server, answer):
    body = chat(PROMPT, max_tokens=MAX_TOKENS, n=1, presence_penalty=0, logprobs=False, user="someone",
                response_format={"type": "text"}, stream_options=None)
    status, answered = server.post(body)
    assert (status, answered["choices"][0]["message"]["content"]) == (200, answer), answered


def test_no_malformed_request_left_a_traceback(server):
    assert "Traceback" not in server.stderr()


# ----------------------------------------------------------------------------- a step that raises


def test_a_step_that_raises_fails_its_requests_and_the_server_goes_on(server, answer):
    status, body = server.post(chat(f"{FAIL_WORD} w7", max_tokens=MAX_TOKENS))
    assert status == 500 and body["error"] == {
        "message": "the generation step holding this request failed (RuntimeError: injected 'fault'); the server "
                   "goes on", "type": "server_error"}, body
    stream = server.client.chat.completions.create(model=server.name, stream=True, max_tokens=MAX_TOKENS,
                                                   messages=[{"role": "user", "content": f"{FAIL_WORD} w8"}])
    with pytest.raises(openai.APIError) as ended:
        list(stream)
    assert ended.value.body == ("the generation step holding this request failed (RuntimeError: injected 'fault'); "
                                "the server goes on")
    assert_serves(server, answer)


# ----------------------------------------------------------------------------- a worker that stops anyway


def test_a_worker_that_stops_stops_the_server_with_status_1(checkpoint, tmp_path):
    served = Server(checkpoint, tmp_path / "server.log", prelude=FAULTS)
    try:
        status, body = served.post(chat(f"{BREAK_WORD} w7", max_tokens=MAX_TOKENS))
        assert status in (500, 503) and "injected" in body["error"]["message"], body
        assert served.process.wait(timeout=STOP_S) == 1, served.stderr()
        last = served.stderr().strip().splitlines()[-1]
        assert last == ("python -m fp8kv serve: error: the continuous-batching worker stopped (RuntimeError: injected: "
                        "the device is broken); the server stopped with it"), served.stderr()
    finally:
        served.close()


def asgi_get(app, path: str) -> tuple[int, bytes]:
    """(status, body) of GET `path` from the ASGI `app`, in this process (routes, middleware and all)."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(message.get("body", b"") for message in sent[1:])


def test_health_says_whether_the_worker_runs(checkpoint, monkeypatch):
    import json

    import torch
    from transformers import AutoTokenizer, ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api, input_outputs

    from fp8kv import load_kv_cache_config
    from fp8kv.commands.serve import Server as ServeServer
    from fp8kv.integrations.transformers import enable_continuous_batching
    from fp8kv.loading import load_causal_lm

    model = load_causal_lm(checkpoint, torch.bfloat16, progress=False).eval()
    enable_continuous_batching(model, load_kv_cache_config(checkpoint, "fp8"))
    server = ServeServer("tiny", model, AutoTokenizer.from_pretrained(checkpoint), ContinuousBatchingConfig(
        num_blocks=4))
    server.start_worker()
    try:
        status, body = asgi_get(server.app, "/health")
        assert (status, json.loads(body)) == (200, {"status": "ok", "pages": {"total": 4, "held": 0, "cached": 0,
                                                                              "free": 4},
                                                    "requests": {"running": 0, "waiting": 0}})

        def broken(*args, **kwargs):
            raise RuntimeError("injected: the device is broken")

        monkeypatch.setattr(continuous_api.ContinuousBatchProcessor, "_generation_step", broken)
        monkeypatch.setattr(input_outputs.ContinuousBatchingIOs, "reset", broken)
        server.worker._cb.add_request([0, 5, 6], request_id="breaks", max_new_tokens=3)
        server.worker.wait()
        status, body = asgi_get(server.app, "/health")
        assert (status, json.loads(body)) == (503, {
            "status": "unhealthy",
            "reason": "the continuous-batching worker stopped (RuntimeError: injected: the device is broken)"})
        deadline = time.monotonic() + STOP_S
        while server.death is None and time.monotonic() < deadline:  # the watch's thread
            time.sleep(0.01)
        assert server.death == "RuntimeError: injected: the device is broken"
    finally:
        server.stop_worker()


# ----------------------------------------------------------------------------- stopping with requests in flight


@pytest.mark.parametrize("sent, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_requests_still_running_after_the_shutdown_timeout(tmp_path, sent, status):
    """Two generations of 3000 tokens (seconds on this CPU at the least; the model has no EOS, which a near
    tie could make it reach early) are in flight, one streamed: the signal stops the server, which ends
    both with an error once --shutdown-timeout (1 s) is over; the process ends."""
    checkpoint = write_checkpoint(tmp_path / "long", context=4096, ends=False)
    served = Server(checkpoint, tmp_path / "server.log", args=("--shutdown-timeout", "1"))
    try:
        plain = {}
        thread = threading.Thread(target=lambda: plain.update(
            answer=served.post(chat(PROMPT, max_tokens=3000), timeout=STOP_S)))
        thread.start()
        stream = served.client.chat.completions.create(model=served.name, stream=True, max_tokens=3000,
                                                       messages=[{"role": "user", "content": PROMPT}])
        first = [next(stream), next(stream)]  # the role, and a token: both generations run
        assert first[1].choices[0].delta.content, first
        signalled = time.monotonic()
        served.process.send_signal(sent)
        with pytest.raises(openai.APIError) as ended:
            list(stream)
        assert ended.value.body == ("the server is shutting down: this request was still running after the 1 s it "
                                    "gives requests in flight (--shutdown-timeout)")
        thread.join(timeout=STOP_S)
        assert plain["answer"] == (503, {"error": {
            "message": "the server is shutting down: this request was still running after the 1 s it gives requests "
                       "in flight (--shutdown-timeout)", "type": "server_error"}}), plain
        assert served.process.wait(timeout=STOP_S) == status, served.stderr()
        assert time.monotonic() - signalled < 10, "the shutdown took longer than its bound"
        assert served.stdout().splitlines()[-1] == "fp8kv serve: stopped"
        assert "Traceback" not in served.stderr(), served.stderr()
    finally:
        served.close()


def test_a_second_signal_ends_the_requests_at_once(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "long", context=4096, ends=False)
    served = Server(checkpoint, tmp_path / "server.log", args=("--shutdown-timeout", "600"))
    try:
        stream = served.client.chat.completions.create(model=served.name, stream=True, max_tokens=3000,
                                                       messages=[{"role": "user", "content": PROMPT}])
        next(stream), next(stream)
        signalled = time.monotonic()
        served.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        served.process.send_signal(signal.SIGTERM)
        with pytest.raises(Exception):  # an error event, or the connection cut
            list(stream)
        assert served.process.wait(timeout=STOP_S) == -signal.SIGTERM, served.stderr()
        assert time.monotonic() - signalled < 10, "the second signal did not end the server at once"
    finally:
        served.close()

