"""The HTTP side of `fp8kv serve`, around transformers' server: each request's id, a shutdown bounded in
time, the generation handlers' checks of their requests, and fp8kv's error answers (OpenAI's shape)."""

from __future__ import annotations

import uuid

from . import serve_requests, serve_worker
from .errors import CommandError

INSTALL_SERVE = ('install fp8kv with its [serve] extra: python3 -m pip install --no-build-isolation ".[serve]" in the '
                 'source tree (README.md, Install)')


def replace_request_id_middleware(app) -> None:
    """transformers' middleware giving each request its id (the x-request-id header, or a new one) as one
    that passes a streamed answer's chunks straight through: transformers' is Starlette's
    BaseHTTPMiddleware, which relays each chunk through a stream of its own (measured on 2 CPU cores, 16
    streams of 300 tokens at once on a tiny model: the server's CPU time per chunk, 0.62 ms with this
    one, 0.72 ms with transformers')."""
    import transformers
    from starlette.middleware.base import BaseHTTPMiddleware
    from transformers.cli.serving.utils import X_REQUEST_ID

    header = X_REQUEST_ID.encode()

    class RequestIds:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            # Header values are bytes of any kind: latin-1, as Starlette reads them, decodes them all.
            request_id = dict(scope["headers"]).get(header, b"").decode("latin-1") or str(uuid.uuid4())
            scope.setdefault("state", {})["request_id"] = request_id

            async def send_with_id(message):
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), (header, request_id.encode("latin-1"))]
                await send(message)

            await self.app(scope, receive, send_with_id)

    kept = [middleware for middleware in app.user_middleware if not (
        middleware.cls is BaseHTTPMiddleware
        and getattr(middleware.kwargs.get("dispatch"), "__name__", None) == "request_id_middleware")]
    if len(kept) != len(app.user_middleware) - 1:  # both would run, each giving the request an id of its own
        raise CommandError(f"transformers {transformers.__version__}'s server has no one request_id_middleware "
                           f"for fp8kv to replace: {INSTALL_SERVE}")
    app.user_middleware[:] = kept
    app.add_middleware(RequestIds)


def bounded_server(server_class):
    """uvicorn's Server, whose shutdown ends the requests still running after `shutdown_s` seconds (through
    `end_requests`) and ends at once on a second SIGINT or SIGTERM."""

    class BoundedServer(server_class):
        def __init__(self, config, shutdown_s: float, end_requests):
            super().__init__(config)
            self.shutdown_s, self.end_requests = shutdown_s, end_requests

        async def shutdown(self, sockets=None):
            import asyncio

            deadline = asyncio.get_running_loop().call_later(self.shutdown_s, self.end_requests)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

        def handle_exit(self, sig, frame):
            if self.should_exit:  # uvicorn forces the exit on a second SIGINT only
                self.force_exit = True
            super().handle_exit(sig, frame)

    return BoundedServer


# GenerationConfig settings that do nothing in greedy decoding (do_sample None or False), and the values of
# temperature and top_p that ask for greedy decoding in OpenAI's API: any other asks for sampling.
_GREEDY_IGNORES = frozenset({"do_sample", "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"})
_GREEDY_VALUES = {"temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0)}


def served(handler_class, prompt_field: str, tokens_fields: tuple[str, ...]):
    """`handler_class` checking its requests' fields first (serve_requests), refusing a request that asks for
    generation settings the worker would not apply, and one the worker finds it can never serve, naming
    the field (`prompt_field`: the endpoint's field of the prompt; `tokens_fields`: its fields that ask for a
    number of tokens, by precedence).
    transformers' continuous batching decodes every request with the one generation config it started with,
    and takes from a request only its tokens and its number of new tokens."""
    from jinja2 import TemplateError

    class Served(handler_class):
        shared = None  # the worker's GenerationConfig, once it starts

        def _validate_request(self, body):
            super()._validate_request(body)  # unknown fields: HTTP 422
            serve_requests.check(body, self._unused_fields)

        async def handle_request(self, body, request_id):
            try:
                return await super().handle_request(body, request_id)
            except serve_worker.LimitExceeded as e:
                field = next((name for name in tokens_fields if body.get(name) is not None), tokens_fields[-1])
                raise serve_requests.InvalidRequest(*e.describe(prompt_field, field)) from None
            except TemplateError as e:
                raise serve_requests.InvalidRequest(prompt_field, f"{prompt_field}: the model's chat template "
                                                    f"refuses it: {e}") from None

        def _build_generation_config(self, body, model_generation_config, use_cb=False):
            config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
            if self.shared is None:
                return config
            requested, shared = config.to_dict(), self.shared.to_dict()
            sampling = bool(requested.get("do_sample")) or bool(shared.get("do_sample"))
            ignored = {"max_new_tokens"} | (set() if sampling else _GREEDY_IGNORES)
            unapplied = sorted(name for name in requested.keys() | shared.keys()
                               if name not in ignored and requested.get(name) != shared.get(name)
                               and (sampling or requested.get(name) not in _GREEDY_VALUES.get(name, ())))
            if unapplied:
                raise serve_requests.InvalidRequest(None, (
                    "this server decodes every request with one generation config, the model's; this request "
                    "asks for " + ", ".join(f"{name} {requested.get(name)!r} (served: {shared.get(name)!r})"
                                            for name in unapplied) + ": leave out what sets them"))
            if all(body.get(name) is None for name in (*tokens_fields, "generation_config")):
                config.max_new_tokens = None  # the worker gives what fits, up to the served default
            return config

    return Served


def _error(status: int, message: str, kind: str, field: str | None = None):
    """An OpenAI-style error answer (its clients show error.message)."""
    from fastapi.responses import JSONResponse

    error = {"message": message, "type": kind} | ({"param": field} if field is not None else {})
    return JSONResponse({"error": error}, status_code=status)


def invalid_request(request, error: serve_requests.InvalidRequest):
    return _error(400, str(error), "invalid_request_error", error.field)


def ended_request(request, error: serve_worker.RequestEnded):
    return _error(error.status, str(error), "server_error")


def worker_dead(request, error: Exception):
    """transformers' error for a request sent to a dead worker, as fp8kv's (HTTP 503)."""
    return _error(503, serve_worker.one_line(str(error)), "server_error")
