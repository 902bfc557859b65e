"""`fp8kv serve`'s continuous-batching worker: transformers' (CBGenerateManager, the worker of `transformers
serve --continuous-batching`) made to fail requests alone.

- A request that can never be served (its prompt, or its prompt and the tokens it asks for, past the
  model's context or past what the cache holds) is refused before it is queued (LimitExceeded), instead of
  stopping the worker when the scheduler finds it cannot place it; a request that does not say how many
  tokens it wants gets what fits, up to the served default.
- A step that raises ends the requests that had started (those holding pages, which the step may have
  left half-written) with an error and frees their pages; requests still waiting are served after it.
  Where the device itself is broken the step's recovery raises too: the worker stops, and the server exits.
- end_requests() ends every request with an error, in the worker's own thread (the server's bounded
  shutdown); stop() stops the worker without finishing what is left.
- pages() counts the cache's blocks by state, for /health.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from typing import NamedTuple

logger = logging.getLogger(__name__)

# transformers' private methods this worker wraps or calls, with their parameters, first to last.
PRIVATE = {
    "ContinuousBatchingManager._generation_loop_body": ("self", "batch_processor", "bootstrapping"),
    "ContinuousBatchingManager._fail_all_remaining_requests": ("self", "error", "batch_processor"),
    "ContinuousBatchProcessor._handle_request_error": ("self", "error", "state"),
}
STOP_S = 5  # how long stop() waits for the worker's current step


def private_functions() -> dict:
    """PRIVATE's functions as the installed transformers has them (None where it has none)."""
    from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                             ContinuousBatchProcessor)

    owners = {"ContinuousBatchingManager": ContinuousBatchingManager,
              "ContinuousBatchProcessor": ContinuousBatchProcessor}
    return {name: getattr(owners[name.split(".")[0]], name.split(".")[1], None) for name in PRIVATE}


class LimitExceeded(Exception):
    """A request that can never be served: its prompt and the tokens it asks for (`asked`, None where it
    asks for none) pass `limit` tokens, what `holder` holds."""

    def __init__(self, prompt_tokens: int, asked: int | None, limit: int, holder: str):
        super().__init__(prompt_tokens, asked, limit, holder)
        self.prompt_tokens, self.asked, self.limit, self.holder = prompt_tokens, asked, limit, holder

    def describe(self, prompt_field: str, tokens_field: str) -> tuple[str, str]:
        """(the request's field to blame, the message), its prompt being `prompt_field` and the field that asks
        for tokens `tokens_field`."""
        if self.asked is None or self.prompt_tokens >= self.limit:
            return prompt_field, (f"{prompt_field}: the prompt is {self.prompt_tokens} tokens and {self.holder} is "
                                  f"{self.limit}, which leaves no room for an answer: shorten it")
        return tokens_field, (f"{tokens_field} {self.asked}: the prompt's {self.prompt_tokens} tokens and {self.asked} "
                              f"new ones pass {self.holder}, {self.limit} tokens: ask for at most "
                              f"{self.limit - self.prompt_tokens}")


class RequestEnded(Exception):
    """A request the server ended with an error: HTTP `status` 500 where its step failed, 503 where the server is
    shutting down or its worker stopped."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Limits(NamedTuple):
    """What one request may hold: the model's context (None where its config gives none) and the cache's
    tokens; and the tokens a request that does not say gets at most."""
    context: int | None
    cache_tokens: int
    default_new_tokens: int

    def bound(self) -> tuple[int, str]:
        """(the tighter limit, what it is)."""
        cache = (self.cache_tokens, "this server's KV cache (--kv-cache-memory)")
        if self.context is None or self.context > self.cache_tokens:
            return cache
        return self.context, "the model's context (max_position_embeddings)"


def one_line(text: str) -> str:
    """`text` as one line without double quotes or backslashes: transformers writes a stream's error
    between double quotes as it is (a quote would break its JSON, a line break its event)."""
    return " ".join(text.replace("\\", "/").replace('"', "'").split())


def worker_class():
    """Worker, a subclass of transformers' CBGenerateManager (imported only where the server runs)."""
    from transformers.cli.serving.utils import CBGenerateManager

    class Worker(CBGenerateManager):
        """transformers' continuous-batching worker failing requests alone (see the module's docstring)."""

        def __init__(self, cb_config):
            super().__init__(cb_config=cb_config)
            self.limits: Limits | None = None
            self._thread: threading.Thread | None = None
            self._ending: RequestEnded | None = None  # the loop ends every request with it, once set
            self._stopping = False

        # ------------------------------------------------------------------------- life

        def init_cb(self, model, gen_config) -> None:
            """Starts the worker, with the loop body and cancellation wrapped (before it starts: transformers'
            own init_cb starts it at once)."""
            if self._cb is not None:
                return
            self._cb = model.init_continuous_batching(generation_config=gen_config,
                                                      continuous_batching_config=self._cb_config)
            self._cb._generation_loop_body = self._guarded(self._cb._generation_loop_body)
            self._cb.cancel_request = self._forgetting_handler(self._cb.cancel_request)
            self._context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
            self._default_new_tokens = gen_config.max_new_tokens
            self._cb.start()
            self._thread = self._cb._generation_thread

        def cache(self):
            """The cache, once the worker has allocated it (None before; RuntimeError where it stopped first)."""
            if not self._thread.is_alive():
                raise RuntimeError(f"the worker stopped: {self.death()}")
            try:
                cache = self.scheduler.cache
            except RuntimeError:  # not allocated yet
                return None
            if self.limits is None:
                allocator = _allocator(cache)
                self.limits = Limits(self._context, allocator.num_blocks * allocator.tokens_per_page,
                                     self._default_new_tokens)
            return cache

        def is_alive(self) -> bool:
            """Whether the worker runs (transformers' own check misses a thread that ended without an error)."""
            return self._cb is None or (self._thread.is_alive() and self.fatal_error is None)

        @property
        def fatal_error(self) -> Exception | None:
            """The error that stopped the worker, if one did."""
            return self._cb.background_thread_status.fatal_error

        def death(self) -> str:
            """Why the worker stopped, in one line."""
            error = self.fatal_error
            return one_line(f"{type(error).__name__}: {error}" if error is not None else "its thread ended")

        def wait(self) -> None:
            """Returns once the worker's thread has ended."""
            self._thread.join()

        @property
        def stopping(self) -> bool:
            return self._stopping

        def end_requests(self, message: str) -> None:
            """Ends every request, those to come too, with `message` (HTTP 503), at the loop's next iteration."""
            self._ending = RequestEnded(503, one_line(message))
            self._cb._wake_up_loop.set()

        def stop(self) -> None:
            """Stops the worker without finishing its requests, waiting STOP_S for the step in progress."""
            self._stopping = True
            if self._cb is not None and self._thread.is_alive():
                self._cb.stop(block=True, timeout=STOP_S, hard_stop=True)

        def fail_remaining(self) -> None:
            """Once the worker stopped on its own: ends what it left undelivered (a thread that ended without
            transformers' error handling delivers nothing)."""
            status = self._cb.background_thread_status
            if status.fatal_error is None:
                status.record_fatal_error(RuntimeError("the continuous-batching worker's thread ended"))
            self._cb._fail_all_remaining_requests(RequestEnded(503, self._dead_message()), self._cb.batch_processor)

        # ------------------------------------------------------------------------- requests

        def admit(self, inputs: dict, gen_config) -> None:
            """Refuses what can never be served (LimitExceeded), and where the request asks for no number of
            tokens (gen_config.max_new_tokens None) gives it what fits, up to the served default."""
            prompt = len(inputs["input_ids"])
            limit, holder = self.limits.bound()
            asked = gen_config.max_new_tokens
            if prompt >= limit or (asked is not None and prompt + asked > limit):
                raise LimitExceeded(prompt, asked, limit, holder)
            if asked is None:
                gen_config.max_new_tokens = min(self.limits.default_new_tokens, limit - prompt)
            if (self._ending is not None or not self.is_alive()
                    or self._cb.background_thread_status.can_accept_new_requests() is not None):
                raise RequestEnded(503, self._dead_message())

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            self.admit(inputs, gen_config)
            return super().generate_streaming(model, processor, inputs, gen_config, request_id,
                                              response_parser=response_parser)

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            """transformers' own, with its errors as RequestEnded, a request the worker no longer takes refused
            (transformers' would wait for it forever) and the request cancelled where its handler is."""
            self.admit(inputs, gen_config)
            cb, input_ids = self._cb, inputs["input_ids"]
            future = asyncio.get_running_loop().create_future()
            cb.register_result_handler(request_id, lambda result: future.done() or future.set_result(result))
            if cb.add_request(input_ids, request_id=request_id, max_new_tokens=gen_config.max_new_tokens,
                              streaming=False, eos_token_id=gen_config.eos_token_id) is None:
                self._forget(request_id)
                raise RequestEnded(503, self._dead_message())
            try:
                result = await future
            except asyncio.CancelledError:
                cb.cancel_request(request_id)
                raise
            if result.error is not None:
                raise RequestEnded(503 if self._ending is not None or not self.is_alive() else 500, result.error)
            generated = result.generated_tokens
            return processor.decode(generated, skip_special_tokens=True), len(input_ids), generated

        def _dead_message(self) -> str:
            """Why the worker takes no more requests."""
            if self._ending is not None:
                return str(self._ending)
            if self.is_alive() or self._stopping:
                return "the server is shutting down"
            return f"the continuous-batching worker stopped ({self.death()}): the server exits"

        def _forget(self, request_id: str) -> None:
            router = self._cb.output_router
            with router._lock:
                router.result_handlers.pop(request_id, None)

        def _forgetting_handler(self, cancel_request):
            """cancel_request that also drops the request's result handler: transformers delivers nothing for a
            cancelled request, so its handler (and what it holds) would stay registered forever."""
            def cancel(request_id: str) -> None:
                cancel_request(request_id)
                self._forget(request_id)

            return cancel

        # ------------------------------------------------------------------------- the loop

        def _guarded(self, loop_body):
            def guarded(batch_processor, bootstrapping: bool) -> bool:
                # Results of requests whose handler is gone (the last tokens of a cancelled stream) land in
                # transformers' shared queue, which nothing here reads.
                _drain(self._cb.output_router.output_queue)
                if self._ending is not None and (batch_processor.has_pending_requests()
                                                 or not self._cb.input_queue.empty()):
                    self._end(batch_processor, self._ending, waiting_too=True)
                try:
                    return loop_body(batch_processor, bootstrapping)
                except Exception as error:
                    logger.error("fp8kv serve: a generation step failed; the requests it held end with an error, "
                                 "the others are served", exc_info=error)
                    self._end(batch_processor, RequestEnded(500, one_line(
                        f"the generation step holding this request failed ({type(error).__name__}: {error}); the "
                        "server goes on")), waiting_too=False)
                    return True

            return guarded

        def _end(self, batch_processor, error: RequestEnded, waiting_too: bool) -> None:
            """Ends the requests that had started with `error` and frees their pages, and the waiting ones too
            where `waiting_too`; drops what a step left half-done."""
            scheduler = batch_processor.scheduler
            if waiting_too:
                self._cb._fail_all_remaining_requests(error, batch_processor)
            for state in list(scheduler.active_requests.values()):
                batch_processor._handle_request_error(error, state)
                scheduler.finish_request(state.request_id)
            # A step that raised may have stopped mid-way through scheduling.
            scheduler.waiting_requests_order = collections.deque(
                request_id for request_id in scheduler.waiting_requests_order
                if request_id in scheduler.waiting_requests)
            scheduler._requests_to_fork.clear()
            scheduler.starved_requests = []
            # The next step starts from clean inputs (with asynchronous batching, both pairs of them, one of which
            # may hold a batch of the requests just ended). This synchronizes the device's streams: a device left
            # broken raises here, and the worker stops.
            batch_processor.inputs_and_outputs.reset()

        # ------------------------------------------------------------------------- accounts

        def pages(self) -> dict[str, int]:
            """The cache's blocks: held by requests, cached (held by none, kept for prompts that start alike and
            given back when pages run short) and free; their total."""
            allocator = _allocator(self.scheduler.cache)
            pool = allocator.pool
            held = {block for table in list(allocator.block_table.values()) for block in table}
            free = pool.num_free_sectors * allocator.blocks_per_sector + pool.count_free_blocks(allocator.index)
            return {"total": allocator.num_blocks, "held": len(held), "cached": len(allocator.ledger.cached_blocks),
                    "free": free}

        def requests(self) -> dict[str, int]:
            scheduler = self.scheduler
            return {"running": len(scheduler.active_requests),
                    "waiting": len(scheduler.waiting_requests) + self._cb.input_queue.qsize()}

    return Worker


def _drain(results: queue.Queue) -> None:
    while True:
        try:
            results.get_nowait()
        except queue.Empty:
            return


def _allocator(cache):
    """The cache's one allocator: fp8kv serves models whose every layer is full attention."""
    (allocator,) = cache.cache_allocators.values()
    return allocator
