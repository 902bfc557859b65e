"""`python -m fp8kv serve` soaked: the real server process on loopback, CLIENTS concurrent clients for
FP8KV_SOAK_S seconds (default 60; the environment variable runs it longer) sending a seeded mix of
plain and streamed chats, streams closed by the client mid-answer, requests cancelled before their
first token, the same long prompt many times at once (prefix sharing), a request without max_tokens
that fills the cache, and malformed ones (JSON, types, unknown fields, empty and huge message lists,
prompts past the cache and the context, max_tokens 0 / negative / past the context, bytes that are not
UTF-8), on a cache of CACHE_BLOCKS blocks, small enough that requests are preempted. Afterwards: every
well-formed request got the whole answer it gets served alone, every malformed one a 4xx naming what
is wrong, no 5xx, every page back in the free pool, the server's RSS within RSS_GROWTH_MIB of what it
was before (and, in a soak of LONG_S or more, flat over its second half), the server still answering,
no traceback in its log. The figures are printed (-s)."""

import collections
import concurrent.futures
import contextlib
import http.client
import json
import os
import random
import re
import threading
import time

from served import BLOCK_BYTES, STOP_S, Server, psutil, write_checkpoint


SOAK_S = float(os.environ.get("FP8KV_SOAK_S", "60"))
CLIENTS, SEED = 64, 0
CONTEXT, CACHE_BLOCKS = 4096, 12  # the cache: 12 blocks of 256 tokens, 3072 tokens
CACHE_TOKENS = CACHE_BLOCKS * 256
# The server's resident memory rises over the first minutes to a plateau: what the allocator keeps of
# the steps' temporaries. oneDNN's cache of compiled CPU matmuls, one per shape seen (up to 1024 by
# default), adds to it as more shapes come: measured 519 MiB before, 1380 halfway through 480 s,
# 1429 after. The soak turns that cache off (ONEDNN=...), so that it measures the server's own memory:
# 535 MiB before, a plateau of 780 after 120 s, flat over 1900 more requests. RSS_GROWTH_MIB bounds
# the whole growth; a soak of LONG_S or more checks that its second half grows less than RSS_TAIL_MIB
# (a leak per request grows without bound).
ONEDNN = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
RSS_GROWTH_MIB, LONG_S, RSS_TAIL_MIB = 512, 240, 32
REQUEST_S = SOAK_S + 300  # a request waiting for pages may wait until the soak's load ends
# The cache's offloads are logged at level INFO.
LOGGING_OFFLOADS = "import logging; logging.getLogger('ContinuousBatchingLogger').setLevel(logging.INFO)"


def words(count: int, start: int = 0) -> str:
    return " ".join(f"w{3 + (start + 7 * i) % 55}" for i in range(count))


def chat(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], **fields}


# Well-formed requests, each served alone first for its answer: (prompt, max_tokens) pairs of 2 to 700
# words; SHARED, the one many clients send at once (three blocks of pages, two of them complete: shared);
# FILLING, a prompt that leaves 71 tokens of the cache and no max_tokens (it gets those 71).
PROMPTS = [(words(2 + 37 * i, start=i), 4 + 3 * (i % 11)) for i in range(20)]
SHARED = (words(700, start=99), 24)
FILLING = (words(3000, start=7), None)


def good(prompt_and_tokens, stream: bool = False) -> dict:
    prompt, max_tokens = prompt_and_tokens
    return chat(prompt, stream=stream, **({} if max_tokens is None else {"max_tokens": max_tokens}))


# Malformed requests: (body, expected status, what the error must name).
BAD = {
    "malformed JSON": (b'{"messages": [{"role": "user", "content": "w5"}', 422, "JSON decode error"),
    "not UTF-8": (b'{"messages": [{"role": "user", "content": "\xff\xfe w5"}]}', 400, "parsing the body"),
    "wrong type": (chat("w5 w6", max_tokens="ten"), 400, "max_tokens"),
    "wrong type of messages": ({"messages": "hello"}, 400, "messages"),
    "unknown field": (chat("w5 w6", colour="blue"), 422, "colour"),
    "empty messages": ({"messages": []}, 400, "messages"),
    "huge message list": ({"messages": [{"role": "user", "content": "w5"}] * 5000}, 400, "messages"),
    "prompt past the cache": (chat(words(3500)), 400, "this server's KV cache"),
    "prompt past the context": (chat(words(CONTEXT + 100)), 400, "messages"),
    "max_tokens 0": (chat("w5 w6", max_tokens=0), 400, "max_tokens"),
    "max_tokens negative": (chat("w5 w6", max_tokens=-5), 400, "max_tokens"),
    "max_tokens past the context": (chat("w5 w6", max_tokens=CONTEXT), 400, "max_tokens"),
}
# Each kind and its weight in the mix.
KINDS = {"plain": 24, "streamed": 24, "shared at once": 4, "filling the cache": 1, "closed mid-answer": 8,
         "cancelled before its first token": 8} | dict.fromkeys(BAD, 2)


class Client:
    """One client's connection per request to 127.0.0.1:port."""

    def __init__(self, port: int):
        self.port = port

    def send(self, body) -> http.client.HTTPConnection:
        """A connection that has sent `body` (bytes as they are, anything else as JSON)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_S)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
        return connection

    @contextlib.contextmanager
    def response(self, body):
        connection = self.send(body)
        try:
            yield connection.getresponse()
        finally:
            connection.close()

    def answer(self, body) -> tuple[int, object]:
        """(status, the answer): (text, finish reason) where it is 200, else the body's JSON or text."""
        with self.response(body) as response:
            if response.status != 200:
                return response.status, _json(response.read())
            if not body.get("stream"):
                choice = json.loads(response.read())["choices"][0]
                return 200, (choice["message"]["content"], choice["finish_reason"])
            text, finish = "", None
            for event in _events(response):
                if "error" in event:
                    return 200, {"stream error": event["error"]}
                text += event["choices"][0]["delta"].get("content") or ""
                finish = event["choices"][0].get("finish_reason") or finish
            return 200, (text, finish)

    def close_mid_answer(self, body) -> tuple[int, object]:
        """Reads the stream's first two content chunks, then closes: (status, the text read)."""
        with self.response(body) as response:
            if response.status != 200:
                return response.status, _json(response.read())
            text, chunks = "", 0
            for event in _events(response):
                if "error" in event:
                    return 200, {"stream error": event["error"]}
                content = event["choices"][0]["delta"].get("content")
                text += content or ""
                chunks += bool(content)
                if chunks == 2 or event["choices"][0].get("finish_reason"):
                    break
            return 200, text

    def cancel_at_once(self, body) -> None:
        """Sends the request and closes the connection before any answer."""
        self.send(body).close()


def _events(response):
    for line in response:
        if line.startswith(b"data: "):
            yield json.loads(line[6:])


def _json(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")


def soak(port: int, references: dict) -> list[tuple[str, bool, object]]:
    """CLIENTS clients sending the mix until SOAK_S is over: (kind, as expected, what came back) per request."""
    deadline = time.monotonic() + SOAK_S
    outcomes, lock = [], threading.Lock()
    kinds, weights = list(KINDS), list(KINDS.values())

    def record(kind, expected, got):
        with lock:
            outcomes.append((kind, expected, got))

    def client(index: int) -> None:
        rng, client = random.Random(SEED * 1000 + index), Client(port)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            request = PROMPTS[rng.randrange(len(PROMPTS))]
            try:
                if kind in ("plain", "streamed"):
                    got = client.answer(good(request, stream=kind == "streamed"))
                    record(kind, got == (200, references[request]), got)
                elif kind == "filling the cache":
                    got = client.answer(good(FILLING, stream=rng.random() < 0.5))
                    record(kind, got == (200, references[FILLING]), got)
                elif kind == "shared at once":  # six copies at once, half of them streamed
                    with concurrent.futures.ThreadPoolExecutor(6) as pool:
                        copies = list(pool.map(lambda i: client.answer(good(SHARED, stream=i % 2 == 1)), range(6)))
                    for got in copies:
                        record(kind, got == (200, references[SHARED]), got)
                elif kind == "closed mid-answer":
                    status, text = client.close_mid_answer(good(request, stream=True))
                    record(kind, status == 200 and isinstance(text, str) and references[request][0].startswith(text),
                           (status, text))
                elif kind == "cancelled before its first token":
                    client.cancel_at_once(good(request, stream=rng.random() < 0.5))
                    record(kind, True, None)
                else:
                    body, status, named = BAD[kind]
                    got = client.answer(body)
                    record(kind, got[0] == status and named in json.dumps(got[1]), got)
            except (OSError, http.client.HTTPException, ValueError) as e:
                record(kind, False, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SOAK_S + REQUEST_S)
    assert not any(thread.is_alive() for thread in threads), "a client still waits for its answer"
    return outcomes


def idle_health(served) -> dict:
    """/health once no request runs or waits (a cancelled request is dropped at the worker's next step)."""
    deadline = time.monotonic() + STOP_S
    while True:
        status, health = served.health()
        assert status == 200, health
        if health["requests"] == {"running": 0, "waiting": 0} or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def test_soak(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "tiny", context=CONTEXT)
    memory_gib = (CACHE_BLOCKS + 0.5) * BLOCK_BYTES / 2**30
    served = Server(checkpoint, tmp_path / "server.log", prelude=LOGGING_OFFLOADS,
                    args=("--kv-cache-memory", str(memory_gib)), env=ONEDNN)
    try:
        assert f"({CACHE_TOKENS:,} tokens)" in served.startup_line, served.startup_line
        client = Client(served.port)
        references = {request: client.answer(good(request)) for request in [*PROMPTS, SHARED, FILLING]}
        assert all(status == 200 for status, _ in references.values()), references
        references = {request: answer for request, (_, answer) in references.items()}
        process = psutil.Process(served.process.pid)
        rss, done = [process.memory_info().rss], threading.Event()

        def sample():  # the RSS every second of the soak
            while not done.wait(1):
                rss.append(process.memory_info().rss)

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        try:
            outcomes = soak(served.port, references)
        finally:
            done.set()
            sampler.join()
        soaked_s = time.monotonic() - started
        health = idle_health(served)
        rss_before, rss_half, rss_after = rss[0], rss[len(rss) // 2], process.memory_info().rss
        again = client.answer(good(PROMPTS[3], stream=True))
        log = served.stderr()
    finally:
        served.close()

    counts = collections.Counter(kind for kind, _, _ in outcomes)
    unexpected = [(kind, got) for kind, expected, got in outcomes if not expected]
    statuses = collections.Counter(got[0] for _, _, got in outcomes if isinstance(got, tuple))
    offloads = [int(n) for n in re.findall(r"Offloaded (\d+) requests", log)]
    print(f"\nsoak: {CLIENTS} clients, {soaked_s:.0f} s (the last answers included), {len(outcomes)} requests, "
          f"{len(outcomes) / soaked_s:.1f}/s")
    for kind, count in sorted(counts.items(), key=lambda item: -item[1]):
        print(f"  {kind}: {count}")
    print(f"  statuses: {dict(sorted(statuses.items()))}; not as expected: {len(unexpected)}")
    print(f"  preemptions: {len(offloads)} times, {sum(offloads)} requests offloaded")
    print(f"  pages after: {health['pages']}")
    print(f"  RSS: {rss_before / 2**20:.0f} MiB before, {rss_half / 2**20:.0f} MiB halfway, "
          f"{rss_after / 2**20:.0f} MiB after")

    assert not unexpected, unexpected[:10]
    assert not any(status >= 500 for status in statuses), statuses
    assert set(counts) == set(KINDS), counts  # every kind was sent
    assert offloads, "no request was preempted: the cache is not small enough to test preemption"
    assert health["requests"] == {"running": 0, "waiting": 0}, health
    pages = health["pages"]
    assert pages["total"] == CACHE_BLOCKS and pages["held"] == 0, pages
    assert pages["free"] + pages["cached"] == pages["total"], pages
    assert rss_after - rss_before < RSS_GROWTH_MIB * 2**20, (rss_before, rss_after)
    if SOAK_S >= LONG_S:
        assert rss_after - rss_half < RSS_TAIL_MIB * 2**20, (rss_half, rss_after)
    assert again == (200, references[PROMPTS[3]])
    assert "Traceback" not in log, log[-5000:]
