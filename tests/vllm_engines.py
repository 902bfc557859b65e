"""Whole vLLM engines with fp8kv's attention backend, for the tests that run them (test_vllm_*.py):
a tiny random Llama with a byte-level tokenizer, vLLM's `LLM` and `vllm serve` on a model, and
transformers on the same checkpoint as the reference to compare them with.

vLLM runs them on fp8kv's test platform for vLLM (tests/vllm_test_platform: vLLM's CPU platform,
fp8kv's CPU kernels), as scripts/test_vllm.sh installs it. Every engine is eager (no torch.compile,
whose CPU compilation would take minutes) with vLLM's custom ops off (their kernels are in vLLM's
CPU build, which the PyPI wheel does not have), and its engine core runs in its own process, spawned,
as `vllm serve` runs it: vLLM's default process layout.
"""

from __future__ import annotations

import json
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import pytest
import torch

from near_ties import margins

# The tiny model: 2 layers, 4 query and 2 KV heads of 64 (GQA, a head size fp8kv's kernels take),
# random bf16 weights spread 5x transformers' default, so that greedy text changes token to token
# rather than repeating one.
TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024, "initializer_range": 0.1}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
# kv_cache_memory_bytes: vLLM's CPU worker otherwise sizes the KV cache from the machine's memory.
ENGINE_ARGS = {"attention_backend": "FP8KV", "enforce_eager": True, "compilation_config": {"custom_ops": ["none"]},
               "kv_cache_memory_bytes": 64 << 20, "seed": 0}


def require_test_platform() -> None:
    """Skips unless vLLM's platform here is fp8kv's test platform (where the engines run)."""
    from vllm.platforms import current_platform

    if type(current_platform).__module__ != "fp8kv_test_vllm_platform.platform":
        pytest.skip(f"needs fp8kv's test platform for vLLM (tests/vllm_test_platform, installed by "
                    f"scripts/test_vllm.sh, with VLLM_TARGET_DEVICE unset); vLLM's platform here is "
                    f"{type(current_platform).__name__}", allow_module_level=True)


def write_tiny_model(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A tiny random Llama checkpoint with a byte-level tokenizer (256 bytes, <s>, </s>) and a chat
    template, in transformers' format, as vLLM loads it."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_level = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_level, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, **TINY)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["vocab_size"] == 258
    return directory


@contextmanager
def engine(model: pathlib.Path, **args):
    """vLLM's LLM on `model` with fp8kv's backend (ENGINE_ARGS, then `args`), its engine core
    stopped on leaving."""
    from vllm import LLM

    llm = LLM(model=str(model), **{**ENGINE_ARGS, **args})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def generated(llm, prompts: list[list[int]], new_tokens: int, **sampling) -> list:
    """vLLM's greedy outputs (RequestOutput) for token prompts, `new_tokens` each (end of text ignored)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, **sampling)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [new_tokens] * len(prompts)
    return outputs


class Reference:
    """transformers on a checkpoint, the reference for a vLLM engine on it: for an auto cache the
    model's own attention (sdpa), for an FP8 one fp8kv's transformers integration on fp8kv's cache in
    `kv_cache`'s format, recipe and scales."""

    def __init__(self, checkpoint: pathlib.Path, kv_cache=None, block_size: int = 16, max_tokens: int = 1024):
        from fp8kv.integrations.transformers import enable
        from fp8kv.loading import load_causal_lm

        model = load_causal_lm(checkpoint, torch.bfloat16, progress=False).eval()  # a checkpoint with scales too
        model.set_attn_implementation("sdpa")
        self.model = model if kv_cache is None else enable(model)
        self.kv_cache, self.block_size, self.max_tokens = kv_cache, block_size, max_tokens

    def _cache(self) -> dict:
        """The cache argument of one new sequence."""
        from fp8kv.integrations.transformers import PagedCache, cache_argument

        if self.kv_cache is None:
            return {}
        return cache_argument(self.model, PagedCache(self.kv_cache, max_tokens=self.max_tokens,
                                                     block_size=self.block_size))

    def greedy(self, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens for `prompt` and the gaps between the best two logits at each."""
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True, **self._cache())
        return out.sequences[0, len(prompt):].tolist(), margins(torch.stack(out.logits)[:, 0])

    def log_softmax(self, tokens: list[int]) -> torch.Tensor:
        """float32 log-probabilities [len(tokens), vocab] after each of `tokens`, in one forward."""
        ids = torch.tensor([tokens])
        with torch.no_grad():
            logits = self.model(ids, attention_mask=torch.ones_like(ids), **self._cache()).logits[0]
        return logits.float().log_softmax(-1)

    def assert_followed(self, prompt: list[int], tokens: list[int], logprobs: list[float], near_tie: float,
                        tolerance: float) -> None:
        """Every one of `tokens` (generated greedily by vLLM after `prompt`, with `logprobs`), also after
        a near tie parted vLLM's text from the reference's, is the reference's best for vLLM's text so
        far up to `near_tie` (a gap of log-probabilities, that of the logits), and its log-probability
        is the reference's within `tolerance`."""
        expected = self.log_softmax(prompt + tokens[:-1])[len(prompt) - 1:]
        chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gaps = expected.max(-1).values - chosen
        assert float(gaps.max()) <= near_tie, gaps
        error = (torch.tensor(logprobs) - chosen).abs()
        assert float(error.max()) <= tolerance, error


def metric(llm, name: str) -> float:
    """The engine's counter `name` (vLLM's Prometheus name), summed over its labels."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(model: pathlib.Path, log: pathlib.Path, *args: str, timeout: float = 600):
    """`vllm serve MODEL` on 127.0.0.1 with fp8kv's backend (ENGINE_ARGS as options, then `args`),
    its output in `log`: yields the server process and its OpenAI base URL once /health answers;
    stops it (SIGINT, as Ctrl-C does) on leaving and checks it exits."""
    port = free_port()
    options = ["--attention-backend", "FP8KV", "--enforce-eager", "--compilation-config",
               json.dumps(ENGINE_ARGS["compilation_config"]), "--kv-cache-memory-bytes",
               str(ENGINE_ARGS["kv_cache_memory_bytes"]), "--seed", str(ENGINE_ARGS["seed"])]
    command = [str(pathlib.Path(sys.executable).parent / "vllm"), "serve", str(model), "--host", "127.0.0.1",
               "--port", str(port), *options, *args]
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            assert server.poll() is None, f"vllm serve exited with {server.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"vllm serve did not answer in {timeout} s: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield server, f"{url}/v1"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
