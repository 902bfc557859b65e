"""What the serving tests share: a tiny random Llama checkpoint with KV cache scales and a word-level
tokenizer, and `python -m fp8kv serve` as a subprocess on a free loopback port, with raw HTTP to it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

# transformers' server and the client come with fp8kv's [serve] extra, which README's test command leaves out:
# the serving tests (which import these from here, before anything else of theirs) skip without it.
SKIP_REASON = "needs fp8kv's [serve] extra (python3 -m pip install --no-build-isolation '.[serve]')"
transformers = pytest.importorskip("transformers", reason=SKIP_REASON)
fastapi, uvicorn, openai, psutil = (pytest.importorskip(package, reason=SKIP_REASON)
                                    for package in ("fastapi", "uvicorn", "openai", "psutil"))
from safetensors.torch import load_file, save_file  # noqa: E402

from checkpoints import scale_tensors  # noqa: E402
from fp8kv.integrations.transformers_continuous_batching import (UnsupportedTransformersError,  # noqa: E402
                                                                  install_hooks)

try:  # what the server does first with the model: refused outside the transformers releases it supports
    install_hooks()
except UnsupportedTransformersError as e:
    pytest.skip(str(e), allow_module_level=True)

LAYERS, KV_HEADS, HEAD_SIZE, VOCAB = 2, 2, 64, 64
PAGE = 256  # transformers' page size, in tokens
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * HEAD_SIZE * PAGE  # one block of FP8 pages: one byte per element
KV_CACHE_GIB = 0.01
# Large scales put K and V among e4m3's subnormals: answers differ from a cache with scale 1.0.
K_SCALE, V_SCALE = 16.0, 8.0
STARTUP_S, STOP_S = 120, 30
# On a GPU shared with a parallel test run (pytest -n 16 -m gpu) a server took more than 120 s to start.
CUDA_STARTUP_S = 600
MAX_TOKENS = 12


def write_checkpoint(directory: pathlib.Path, initializer_range: float = 0.02, context: int = 256,
                     ends: bool = True) -> pathlib.Path:
    """A tiny random Llama (2 layers, 4 query and 2 KV heads of 64, `context` positions) with per-layer KV
    cache scales, and a word-level tokenizer with a chat template (no download), in `directory`. Word
    "w{i}" is token i + 3. Where not `ends`, the model has no EOS token: its answers run to max_tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<bos>", "<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", unk_token="<unk>",
                                                eos_token="<eos>")
    fast.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                                      max_position_embeddings=context, bos_token_id=0,
                                      eos_token_id=2 if ends else None, initializer_range=initializer_range)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    weights = directory / "model.safetensors"
    save_file({**load_file(weights), **scale_tensors([K_SCALE] * LAYERS, [V_SCALE] * LAYERS)}, str(weights),
              metadata={"format": "pt"})
    return directory


class Server:
    """`python -m fp8kv serve` on a free loopback port (--port 0, the start-up line gives it), ready
    once /health answers; `name` is the model's name for the clients (--model as given). `prelude`:
    Python run in the process before fp8kv (it then runs through runpy); `args`: more options; `env`:
    more environment variables."""

    def __init__(self, checkpoint, log_path, device: str = "cpu", startup_s: float = STARTUP_S,
                 prelude: str | None = None, args: tuple[str, ...] = (), env: dict[str, str] | None = None):
        self.name, self.startup_s = str(checkpoint), startup_s
        # Its output goes to files: a pipe nobody reads would fill up with the access log and block the server.
        self.log = open(log_path, "w+")
        self.out = open(pathlib.Path(log_path).with_suffix(".out"), "w+")
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}  # a tiny model: one thread, no synchronization
        start = ["-m", "fp8kv"] if prelude is None else [
            "-c", f"{prelude}\nimport runpy\nrunpy.run_module('fp8kv', run_name='__main__', alter_sys=True)"]
        self.process = subprocess.Popen(
            [sys.executable, *start, "serve", "--model", self.name, "--port", "0", "--device", device,
             "--kv-cache-memory", str(KV_CACHE_GIB), *args],
            stdout=self.out, stderr=self.log, env=env)
        self.startup_line = self._first_line()
        match = re.search(r" at http://127\.0\.0\.1:(\d+)/v1; ", self.startup_line)
        assert match, self.startup_line
        self.port = int(match[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                                    timeout=self.startup_s)
        self._wait_until_healthy()

    def _first_line(self) -> str:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            line, newline, _ = self.stdout().partition("\n")
            if newline:
                return line + newline
            assert self.process.poll() is None, f"the server exited with status {self.process.wait()}: {self.stderr()}"
            time.sleep(0.05)
        pytest.fail(f"no start-up line in {self.startup_s} s: {self.stderr()}")

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            try:
                assert self.health()[1]["status"] == "ok"
                return
            except ConnectionError:  # bound, not listening yet
                time.sleep(0.1)
            except urllib.error.URLError as e:
                if not isinstance(e.reason, ConnectionError):
                    raise
                time.sleep(0.1)
        pytest.fail(f"/health did not answer in {self.startup_s} s: {self.stderr()}")

    def health(self) -> tuple[int, dict]:
        """(HTTP status, JSON) of GET /health."""
        return request(f"{self.url}/health", timeout=self.startup_s)

    def chat(self, prompt: str, stream: bool = False, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
        """(answer, finish reason) of a chat completion, streamed or not."""
        asked = dict(model=self.name, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
        if not stream:
            choice = self.client.chat.completions.create(**asked).choices[0]
            return choice.message.content, choice.finish_reason
        chunks = list(self.client.chat.completions.create(**asked, stream=True))
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    def post(self, body, path: str = "/v1/chat/completions", timeout: float | None = None) -> tuple[int, dict | str]:
        """(HTTP status, the answer: its JSON, else its text) of POST `body` (bytes as they are, anything else as
        JSON)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return request(f"{self.url}{path}", data, timeout=timeout or self.startup_s)

    def stdout(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.out.close()
        self.log.close()


def request(url: str, data: bytes | None = None, timeout: float = STARTUP_S) -> tuple[int, dict | str]:
    """(HTTP status, the answer: its JSON, else its text) of GET `url`, or POST `data` as JSON."""
    headers = {"Content-Type": "application/json"} if data is not None else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=timeout) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text
