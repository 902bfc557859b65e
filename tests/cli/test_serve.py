"""`python -m fp8kv serve`: the server started as a subprocess on a free loopback port with a tiny
random Llama whose checkpoint holds KV cache scales; through the openai client it answers
/v1/chat/completions, plain, streaming and to several clients at once, with the text that
`generate` on fp8kv's PagedCache (the checkpoint's scales, the same chat template) gives greedily,
and refuses generation settings its one shared generation config would not apply; SIGINT and
SIGTERM stop it with the documented status, after the answer in flight, and release its port. Bad
arguments are one line on stderr, exit status 2, no traceback. The cache size expected from --kv-cache-memory is
computed here from the model's geometry."""

import argparse
import concurrent.futures
import json
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
from served import (BLOCK_BYTES, CUDA_STARTUP_S, KV_CACHE_GIB, LAYERS, MAX_TOKENS, PAGE, STARTUP_S,
                    STOP_S, V_SCALE, Server, openai, transformers, write_checkpoint)
from safetensors.torch import load_file, save_file

from checkpoints import scale_tensors
from fp8kv import load_kv_cache_config
from fp8kv.cli import main
from fp8kv.commands.arguments import FP8
from fp8kv.formats import KVCacheConfig, format_names
from fp8kv.integrations.transformers import PagedCache, cache_argument, enable
from fp8kv.loading import load_causal_lm


pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# `python -m fp8kv` in a process whose SIGINT is ignored before fp8kv starts.
IGNORING_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)"
PROMPTS = ["w5 w6 w7", "w40 w2 w33 w19 w8", "w11", "w58 w57 w56 w55 w54 w53 w52"]


# ----------------------------------------------------------------------------- the model and its references


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("served") / "tiny")


def greedy_generation(checkpoint, device: str = "cpu"):
    """generate(prompt, kv_cache=the checkpoint's, **generate_kwargs): (prompt length, output) of `generate`'s
    greedy answer to the chat `prompt` on a PagedCache, with the checkpoint's model loaded once on `device`."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = enable(load_causal_lm(checkpoint, torch.bfloat16, progress=False).to(device).eval())
    served_cache = load_kv_cache_config(checkpoint, "fp8")

    def generate(prompt: str, kv_cache: KVCacheConfig | None = None, **generate_kwargs):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")["input_ids"].to(device)
        cache = PagedCache(kv_cache or served_cache, max_tokens=ids.shape[1] + MAX_TOKENS)
        return ids.shape[1], model.generate(ids, **cache_argument(model, cache), max_new_tokens=MAX_TOKENS,
                                            do_sample=False, **generate_kwargs)

    generate.tokenizer = tokenizer
    return generate


@pytest.fixture(scope="module")
def reference(checkpoint):
    """answer(prompt, kv_cache=the checkpoint's): (text, finish reason) of `generate`'s greedy answer on a
    PagedCache: "stop" where it ends with the EOS token, else "length"."""
    generate = greedy_generation(checkpoint)
    tokenizer = generate.tokenizer

    def answer(prompt: str, kv_cache: KVCacheConfig | None = None) -> tuple[str, str]:
        prompt_len, out = generate(prompt, kv_cache)
        new = out[0, prompt_len:]
        finish = "stop" if new[-1] == tokenizer.eos_token_id else "length"
        return tokenizer.decode(new, skip_special_tokens=True), finish

    return answer


# ----------------------------------------------------------------------------- the server as a subprocess


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    served = Server(checkpoint, tmp_path_factory.mktemp("logs") / "server.log")
    yield served
    served.close()


@pytest.fixture
def fresh_server(checkpoint, tmp_path, request):
    """A server of its own; `request.param` (indirect parametrization): whether it starts with SIGINT ignored."""
    prelude = IGNORING_SIGINT if getattr(request, "param", False) else None
    served = Server(checkpoint, tmp_path / "server.log", prelude=prelude)
    yield served
    served.close()


# ----------------------------------------------------------------------------- serving


def test_startup_line_says_what_is_served(server, checkpoint):
    blocks = int(KV_CACHE_GIB * 2**30) // BLOCK_BYTES
    line = server.startup_line
    assert line.startswith(f"fp8kv serve: {checkpoint} ({checkpoint}, bfloat16 on cpu) at http://127.0.0.1:"), line
    assert f"float8_e4m3fn pages (rotated recipe, scales: " in line and f"{checkpoint}" in line, line
    assert f": {blocks:,} blocks of {PAGE} tokens ({blocks * PAGE:,} tokens), " in line, line
    assert line.endswith(" on cpu\n") and line.count("\n") == 1, line


def test_models_lists_the_served_model(server):
    assert [model.id for model in server.client.models.list()] == [server.name]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
@pytest.mark.parametrize("given", [None, "client-id-7", "client-\xe9"], ids=["new", "given", "given-latin-1"])
def test_each_answer_carries_its_request_id(server, stream, given):
    """The x-request-id header the client sends (any bytes: a header is latin-1), else a new one, comes back
    as the one such header and as the id of the completion (of every chunk of a stream)."""
    body = {"model": server.name, "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 3,
            "stream": stream}
    headers = {"Content-Type": "application/json"} | ({"x-request-id": given} if given else {})
    asked = urllib.request.Request(f"{server.url}/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(asked, timeout=STARTUP_S) as response:
        request_ids, text = response.headers.get_all("x-request-id"), response.read().decode()
    ids = ({json.loads(line[6:])["id"] for line in text.splitlines() if line.startswith("data: ")} if stream
           else {json.loads(text)["id"]})
    assert len(request_ids) == 1 and ids == set(request_ids), (ids, request_ids)
    assert request_ids[0] == given if given else len(request_ids[0]) == 36, request_ids


def test_a_model_without_an_eos_token_answers_up_to_max_tokens(tmp_path):
    """transformers' worker takes such a model's eos_token_id (None) as -1: requests, whose own configs say None,
    were refused for asking for another generation config."""
    served = Server(write_checkpoint(tmp_path / "endless", ends=False), tmp_path / "server.log")
    try:
        for stream in (False, True):
            assert served.chat(PROMPTS[0], stream=stream, max_tokens=40)[1] == "length"
        status, body = served.post({"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 40})
        assert status == 200 and body["usage"]["completion_tokens"] == 40, body
    finally:
        served.close()


def test_the_request_id_middleware_is_replaced_where_there_is_exactly_one():
    """Where transformers' id middleware were not found, both would run, each giving its own id."""
    from fastapi import FastAPI
    from starlette.middleware.base import BaseHTTPMiddleware

    from fp8kv.commands.errors import CommandError
    from fp8kv.commands.serve_http import replace_request_id_middleware

    app = FastAPI()

    @app.middleware("http")
    async def request_id_middleware(request, call_next):
        return await call_next(request)

    replace_request_id_middleware(app)
    assert [middleware.cls.__name__ for middleware in app.user_middleware] == ["RequestIds"]
    assert not any(middleware.cls is BaseHTTPMiddleware for middleware in app.user_middleware)
    with pytest.raises(CommandError, match="has no one request_id_middleware for fp8kv to replace"):
        replace_request_id_middleware(app)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_answers_are_generate_s_on_the_checkpoint_scales(server, reference, stream):
    prompt = PROMPTS[0]
    expected = reference(prompt)
    served = load_kv_cache_config(server.name, "fp8")
    unit_scales = KVCacheConfig.unit_scales(served.dtype, LAYERS, rotation=served.rotation)
    assert reference(prompt, unit_scales) != expected, "the scales do not change the answer: the test cannot tell"
    assert server.chat(prompt, stream) == expected


def test_concurrent_clients_get_their_own_answers(server, reference):
    requests = [(prompt, stream) for prompt in PROMPTS for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda request: server.chat(*request), requests))
    assert answers == [reference(prompt) for prompt, _ in requests]


@pytest.mark.parametrize("setting", [{"temperature": 0}, {"top_p": 1}, {"temperature": 0.0, "top_p": 1.0}])
def test_settings_that_ask_for_greedy_decoding_are_taken(server, reference, setting):
    """The model's generation config decodes greedily: temperature 0 and top_p 1 ask for just that."""
    messages = [{"role": "user", "content": PROMPTS[2]}]
    choice = server.client.chat.completions.create(model=server.name, messages=messages, max_tokens=MAX_TOKENS,
                                                   **setting).choices[0]
    assert (choice.message.content, choice.finish_reason) == reference(PROMPTS[2])


@pytest.mark.parametrize("setting, asked", [
    ({"frequency_penalty": 0.5}, "repetition_penalty 1.5 (served: None)"),
    ({"stop": ["w3"]}, "stop_strings ['w3'] (served: None)"),
    ({"logit_bias": {"5": 3}}, "sequence_bias {(5,): 3} (served: None)"),
    ({"temperature": 0.7}, "temperature 0.7 (served: None)"),
    ({"top_p": 0.5}, "top_p 0.5 (served: None)"),
])
def test_settings_the_worker_would_not_apply_are_refused(server, setting, asked):
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": PROMPTS[2]}],
                                              max_tokens=MAX_TOKENS, **setting)
    assert refused.value.body == {"type": "invalid_request_error", "message": (  # the client's: the answer's "error"
        "this server decodes every request with one generation config, the model's; this request asks for "
        f"{asked}: leave out what sets them")}


# ----------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("sent, status, fresh_server", [
    (signal.SIGINT, 130, False), (signal.SIGTERM, -signal.SIGTERM, False),
    (signal.SIGINT, 130, True),  # started with SIGINT ignored: uvicorn stops on it all the same
], indirect=["fresh_server"], ids=["SIGINT", "SIGTERM", "SIGINT-started-ignored"])
def test_a_signal_stops_the_server_after_the_answers_in_flight(fresh_server, reference, sent, status):
    """The signal arrives once a streamed answer has started (its first chunk, the role, is sent before
    any token): the answer still comes whole, then the process ends and its port is free again."""
    stream = fresh_server.client.chat.completions.create(
        model=fresh_server.name, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=MAX_TOKENS,
        stream=True)
    chunks = [next(stream)]
    fresh_server.process.send_signal(sent)
    chunks += list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert (text, chunks[-1].choices[0].finish_reason) == reference(PROMPTS[1])
    assert fresh_server.process.wait(timeout=STOP_S) == status, fresh_server.stderr()
    assert "Traceback" not in fresh_server.stderr()
    # The last line, once the worker has stopped (uvicorn's access log comes before it on stdout).
    assert fresh_server.stdout().splitlines()[-1] == "fp8kv serve: stopped"
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", fresh_server.port))


# ----------------------------------------------------------------------------- bad arguments


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if the model's weights are loaded: the error must come before."""
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model was loaded before the error"))


def run(args: list[str], capsys) -> tuple[int, str]:
    """main(["serve", *args]) in this process: (exit status, stderr)."""
    try:
        status = main(["serve", *args])
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("args, argument, fragment", [
    (["--kv-cache-dtype", "fp9"], "--kv-cache-dtype", "expected an FP8 format, one of "),
    (["--kv-cache-dtype", "auto"], "--kv-cache-dtype", "; got 'auto'"),
    (["--port", "65536"], "--port", "expected a TCP port, 0 to 65535, got '65536'"),
    (["--port", "-1"], "--port", "expected a TCP port, 0 to 65535, got '-1'"),
    (["--port", "http"], "--port", "expected a TCP port, 0 to 65535, got 'http'"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory", "expected a positive number, got '-1'"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory", "expected a positive number, got '0'"),
    (["--kv-cache-memory", "inf"], "--kv-cache-memory", "expected a positive number, got 'inf'"),
    (["--max-num-seqs", "0"], "--max-num-seqs", "expected a positive integer, got '0'"),
    (["--max-num-batched-tokens", "many"], "--max-num-batched-tokens", "expected a positive integer"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-seqs",
     "64 requests per step need at least as many tokens per step, but --max-num-batched-tokens is 32"),
    (["--dtype", "float32"], "--dtype", "invalid choice: 'float32'"),
])
def test_bad_arguments_are_one_line_errors(checkpoint, args, argument, fragment, capsys):
    status, err = run(["--model", str(checkpoint), *args], capsys)
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fp8kv serve: error: argument {argument}: ") and fragment in err, err


def test_a_missing_model_directory_is_a_usage_error(tmp_path, capsys):
    status, err = run(["--model", str(tmp_path / "nowhere")], capsys)
    assert status == 2 and err == (f"fp8kv serve: error: argument --model: {tmp_path / 'nowhere'} is not a checkpoint "
                                   "directory (no config.json); pass one, or 'smollm2'\n")


def test_a_port_in_use_is_refused_before_the_model_loads(checkpoint, capsys, no_model_loading):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = run(["--model", str(checkpoint), "--port", str(port)], capsys)
    assert status == 1 and err.count("\n") == 1, err
    assert err.startswith(f"fp8kv serve: error: argument --port: cannot listen on 127.0.0.1 port {port}: "), err


def test_a_tokenizer_without_chat_template_is_refused(checkpoint, tmp_path, capsys):
    copy = tmp_path / "no-template"
    shutil.copytree(checkpoint, copy)
    (copy / "chat_template.jinja").unlink()
    status, err = run(["--model", str(copy)], capsys)
    assert status == 1 and err == (f"fp8kv serve: error: argument --model: {copy}'s tokenizer has no chat template, "
                                   "which /v1/chat/completions applies to the messages\n")


def test_memory_below_one_block_is_refused_before_the_model_loads(checkpoint, capsys, no_model_loading):
    status, err = run(["--model", str(checkpoint), "--kv-cache-memory", "1e-4"], capsys)
    assert status == 2 and err == (f"fp8kv serve: error: argument --kv-cache-memory: 0.0001 GiB holds no block of "
                                   f"{PAGE} tokens ({BLOCK_BYTES:,} bytes)\n")


def test_help_lists_the_fp8_formats(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert format_names(FP8) in " ".join(capsys.readouterr().out.split())


def test_errors_are_one_line_without_traceback_as_a_program(tmp_path):
    result = subprocess.run([sys.executable, "-m", "fp8kv", "serve", "--model", str(tmp_path), "--port", "99999"],
                            capture_output=True, text=True, timeout=STARTUP_S)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == ("python -m fp8kv serve: error: argument --port: expected a TCP port, 0 to 65535, got "
                             "'99999'\n")


def test_missing_server_packages_say_what_to_install(checkpoint, capsys, monkeypatch):
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    status, err = run(["--model", str(checkpoint)], capsys)
    assert status == 1 and err == ("fp8kv serve: error: serve needs transformers' server packages (fastapi, uvicorn, "
                                   "openai, pydantic): install fp8kv with its [serve] extra: python3 -m pip install "
                                   '--no-build-isolation ".[serve]" in the source tree (README.md, Install)\n')


def test_bad_checkpoint_scales_are_refused_before_the_model_loads(checkpoint, tmp_path, capsys, no_model_loading):
    copy = tmp_path / "bad-scales"
    shutil.copytree(checkpoint, copy)
    weights = copy / "model.safetensors"
    save_file({**load_file(weights), **scale_tensors([-1.0] * LAYERS, [V_SCALE] * LAYERS)}, str(weights),
              metadata={"format": "pt"})
    status, err = run(["--model", str(copy)], capsys)
    assert status == 1 and err.startswith("fp8kv serve: error: argument --model: invalid KV cache scales"), err
    for layer in range(LAYERS):  # the loader's list of problems, one line each
        assert f"  - {weights}: model.layers.{layer}.self_attn.k_scale: value -1.0 must be finite and > 0" in err, err


def test_the_docs_client_example_runs(server, reference, capsys):
    """docs/serving.md's Python example, against this server and its model: it prints the two answers."""
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "serving.md"
    example = docs.read_text().split("```python\n")[1].split("```", 1)[0]
    assert example.count('model="smollm2"') == 2 and example.count("http://127.0.0.1:8000/v1") == 1, example
    exec(example.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{server.port}/v1")
         .replace('model="smollm2"', f"model={server.name!r}").replace("max_tokens=64", f"max_tokens={MAX_TOKENS}"), {})
    expected = [reference(prompt)[0] for prompt in ("What is the capital of France?", "Hi")]
    assert capsys.readouterr().out == f"{expected[0]}\n{expected[1]}"


@pytest.mark.parametrize("device, enforce_eager, fast", [("cuda", False, True), ("cuda", True, False),
                                                         ("cpu", False, False)])
def test_cuda_steps_run_in_graphs_and_asynchronously_unless_eager_is_enforced(checkpoint, device, enforce_eager, fast):
    # transformers would leave both off for fp8kv's attention (it takes every attention but flash
    # attention to need a mask); on the CPU there are no CUDA graphs.
    from fp8kv.commands import serve

    args = argparse.Namespace(max_num_seqs=None, max_num_batched_tokens=None, kv_cache_memory=KV_CACHE_GIB,
                              dtype="bfloat16", enforce_eager=enforce_eager)
    config = serve._batching(args, checkpoint, load_kv_cache_config(checkpoint, "fp8"), torch.device(device))
    assert (config.use_cuda_graph, config.use_async_batching) == (fast, fast)


# ----------------------------------------------------------------------------- on a GPU

# On CUDA the server batches requests and runs its steps in CUDA graphs (padded to fixed sizes), where the
# reference runs one request eagerly: a logit may move by a rounding or two of bf16, and on FP8 pages a
# rounding of a new K or V element may move its code by one. That moved logits of tiny models by up to 0.42
# on an H100 (tests/integrations/test_continuous_batching.py), so a greedy token may flip where the
# reference's best two logits are that close.
NEAR_TIE_FP8 = 0.5


def generated_words(generate, prompt: str) -> tuple[list[str], list[float]]:
    """The greedy answer of greedy_generation's `generate` (its words, then "<eos>" where it stopped there) and
    the gap between the best two logits at each step."""
    prompt_len, out = generate(prompt, output_scores=True, return_dict_in_generate=True)
    words = generate.tokenizer.convert_ids_to_tokens(out.sequences[0, prompt_len:].tolist())
    best_two = [scores[0].float().topk(2).values for scores in out.scores]
    return words, [float(best - second) for best, second in best_two]


@pytest.mark.gpu
def test_on_cuda_the_server_answers_from_cuda_graphs_as_generate_does(tmp_path):
    # Weights spread 5x (initializer_range 0.1) so that the best two logits are mostly apart by more than
    # NEAR_TIE_FP8 (with transformers' default 0.02 nearly every step of this tiny model is a near tie).
    checkpoint = write_checkpoint(tmp_path / "spread", initializer_range=0.1)
    served = Server(checkpoint, tmp_path / "server.log", device="cuda", startup_s=CUDA_STARTUP_S)
    try:
        assert "bfloat16 on cuda" in served.startup_line and served.startup_line.rstrip().endswith("on cuda:0"), \
            served.startup_line
        requests = [(prompt, stream) for prompt in PROMPTS for stream in (False, True)]
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda request: served.chat(*request), requests))
    finally:
        served.close()
    generate = greedy_generation(checkpoint, "cuda")
    expected = {prompt: generated_words(generate, prompt) for prompt in PROMPTS}
    # The answers come back as text, which leaves out <bos> and <unk>: the reference must not generate them.
    assert not any({"<bos>", "<unk>"} & set(words) for words, _ in expected.values()), expected
    clear = sum(margin > NEAR_TIE_FP8 for _, margins in expected.values() for margin in margins)
    assert clear >= len(PROMPTS) * MAX_TOKENS // 3, f"{clear} steps without a near tie: the test could not tell"
    whole = 0
    for (prompt, _), (text, finish) in zip(requests, answers):
        want, margins = expected[prompt]
        got = text.split() + (["<eos>"] if finish == "stop" else [])
        differ = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
        if differ is None:
            assert got == want, (prompt, got, want)
            whole += 1
        else:
            assert margins[differ] <= NEAR_TIE_FP8, (prompt, differ, got, want, margins)
    assert whole >= len(requests) - 2, f"{whole} of {len(requests)} answers as generate's"
