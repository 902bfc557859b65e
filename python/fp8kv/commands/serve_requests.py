"""The fields of `fp8kv serve`'s requests, checked before transformers' handlers read them: a value of the
wrong type or out of range is refused (InvalidRequest, HTTP 400) naming the field and what it takes, where
transformers' handlers would fail on it (HTTP 500); and a field transformers' server accepts but does not
apply is refused unless it asks for what the server does anyway."""

from __future__ import annotations

import json
import math
from collections.abc import Callable


class InvalidRequest(Exception):
    """A request refused for `field` (None: for no one field)."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return (_integer(value) or isinstance(value, float)) and math.isfinite(value)


def _strings(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _shown(value) -> str:
    """`value` in JSON, cut short: an error names what it got without echoing a whole prompt."""
    text = json.dumps(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _tool_calls(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(call, dict) and isinstance(call.get("function"), dict)
        and isinstance(call["function"].get("name"), str)
        and (isinstance(call["function"].get("arguments"), dict) or _json_object(call["function"].get("arguments")))
        for call in value)


def _json_object(value) -> bool:
    try:
        return isinstance(json.loads(value), dict)
    except (TypeError, ValueError):
        return False


# Each field's check, and what it takes (for the message). A null value is taken as the field left out, as
# transformers' handlers take it.
_TYPES: dict[str, tuple[Callable[[object], bool], str]] = {
    "model": (lambda v: isinstance(v, str), "a string"),
    "stream": (lambda v: isinstance(v, bool), "true or false"),
    "max_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "max_completion_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "max_output_tokens": (lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "frequency_penalty": (_number, "a number"),
    "seed": (lambda v: _integer(v) and 0 <= v < 2**64, "an integer from 0 to 2^64 - 1"),
    "stop": (_strings, "a string or a list of strings"),
    "logit_bias": (lambda v: isinstance(v, dict) and all(k.isdigit() and _number(b) for k, b in v.items()),
                   "an object of token ids to numbers"),
    "generation_config": (_json_object, "a string holding a JSON object"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
    "tools": (lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "a list of objects"),
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "suffix": (lambda v: isinstance(v, str), "a string"),
    "instructions": (lambda v: isinstance(v, str), "a string"),
    "input": (lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(i, dict) for i in v)),
              "a string or a list of objects"),
}

# Fields transformers' server takes and does not apply (it logs a warning and answers without them), with the
# values that ask for what it does anyway; any other value is refused. ANY: a value that changes no answer.
ANY = object()
_NOT_APPLIED = {
    "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,),
    "presence_penalty": (0,), "response_format": ({"type": "text"},), "text": ({"format": {"type": "text"}},),
    "modalities": (["text"],), "tool_choice": ("auto",), "parallel_tool_calls": (True,), "store": (False,),
    "background": (False,), "include": ([],), "truncation": ("disabled",), "service_tier": ("auto", "default"),
    "stream_options": ANY,  # the last chunk carries the usage anyway
    "user": ANY, "metadata": ANY,  # labels of the request
}
_ROLES = ("system", "developer", "user", "assistant", "tool")


def check(body: dict, not_applied: set[str]) -> None:
    """Raises InvalidRequest for the first field of `body` whose value its endpoint cannot take; `not_applied`:
    the fields the endpoint takes and does not apply (transformers' _unused_fields)."""
    for field, value in body.items():
        if value is None:
            continue
        if field in not_applied:
            accepted = _NOT_APPLIED.get(field, ())
            if accepted is not ANY and value not in accepted:
                takes = " or ".join(json.dumps(v) for v in accepted) or "null"
                raise InvalidRequest(field, f"{field}: this server does not apply it; it takes only {takes} "
                                     f"(or leave it out), got {_shown(value)}")
        elif field in _TYPES:
            test, takes = _TYPES[field]
            if not test(value):
                raise InvalidRequest(field, f"{field}: expected {takes}, got {_shown(value)}")
    if "messages" in body:
        check_messages(body["messages"])


def check_messages(messages) -> None:
    """Raises InvalidRequest unless `messages` is a non-empty list of chat messages of text."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", f"messages: expected a non-empty list of messages, got "
                             f"{_shown(messages)}")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest("messages", f"{where}: expected an object with a role and a content, got "
                                 f"{_shown(message)}")
        if message.get("role") not in _ROLES:
            raise InvalidRequest("messages", f"{where}.role: expected one of {', '.join(_ROLES)}, got "
                                 f"{_shown(message.get('role'))}")
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not _tool_calls(tool_calls):
            raise InvalidRequest("messages", f"{where}.tool_calls: expected a list of calls, each with a function of "
                                 f"a name and JSON arguments, got {_shown(tool_calls)}")
        content = message.get("content")
        if content is None and tool_calls:
            continue
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise InvalidRequest("messages", f"{where}.content[{j}]: expected a text part, "
                                         f'{{"type": "text", "text": "..."}} (this model takes text only), got '
                                         f"{_shown(part)}")
        elif not isinstance(content, str):
            raise InvalidRequest("messages", f"{where}.content: expected a string or a list of text parts, got "
                                 f"{_shown(content)}")
