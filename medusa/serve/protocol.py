"""The OpenAI request bodies ``medusa serve`` accepts, validated into one :class:`Request`, and the error body it
answers bad input with (``{"error": {"message", "type", "param", "code"}}``, as OpenAI's API does).

No HTTP and no model here: the body is parsed from bytes, checked field by field, and every refusal names the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

CHAT = "chat.completion"
COMPLETION = "text_completion"

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n",
                 "logprobs", "user", "frequency_penalty", "presence_penalty", "return_token_ids"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
MESSAGE_FIELDS = {"role", "content", "name"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_STOP = 4
"""Stop sequences per request, as OpenAI allows."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects a body may hold (a valid request nests 5 levels)."""


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error body (:meth:`body`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})
        """HTTP headers the answer carries (``Retry-After``, ``Connection: close``)."""

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, message, param, code)


@dataclass
class Request:
    """One validated completion request (chat or raw text)."""

    kind: str
    """:data:`CHAT` or :data:`COMPLETION`."""
    model: str
    messages: list[dict] | None = None
    """Chat: ``[{"role", "content"}]`` with text content."""
    prompt: str | list[int] | None = None
    """Completions: raw text, or token ids."""
    max_tokens: int | None = None
    """``None``: as many as the context and the server's default allow."""
    temperature: float | None = None
    """``None``: the base's generation_config; 0: greedy; > 0: sampling at this temperature."""
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    """vLLM's extension: the answer's choice also carries ``token_ids``, the completion's token ids (what
    ``medusa distill --server`` records). Not with ``stream``."""


def parse_body(raw: bytes, kind: str, max_bytes: int) -> Request:
    """Parse and validate one request body.

    Raises:
        ApiError: 413 for a body over ``max_bytes``; 400 naming the problem for invalid UTF-8, malformed JSON, JSON
            nested deeper than :data:`MAX_JSON_DEPTH`, a lone surrogate in any string or field name, a body that is
            not an object, an unknown field, or a bad value (see :func:`check_fields`).
    """
    if len(raw) > max_bytes:
        raise ApiError(413, f"the request body is {len(raw)} bytes, over the server's limit of {max_bytes}",
                       code="request_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # the parser's own stack ran out, far beyond MAX_JSON_DEPTH
        raise bad(f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    check_text(body)
    return check_fields(body, kind)


def check_text(body: dict) -> None:
    """Check every string and field name of a parsed body, without recursion: nesting within
    :data:`MAX_JSON_DEPTH` and no lone surrogates (JSON's ``\\ud800``-style escapes can spell them; they are not
    Unicode text, and neither a tokenizer nor a UTF-8 answer can hold them).

    Raises:
        ApiError: 400 naming where (``messages[0].content``), the offending name or string escaped.
    """
    stack = [(body, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad(f"the request body nests arrays or objects deeper than {MAX_JSON_DEPTH} levels (at "
                      f"{where or 'the top'})", where or None)
        if isinstance(value, dict):
            for name, item in value.items():
                path = f"{where}.{name}" if where else name
                if not _is_unicode(name):
                    raise bad(f"the field name {name!r} in {where or 'the body'} holds a lone surrogate: not Unicode "
                              f"text", where or None)
                if isinstance(item, str | dict | list):
                    stack.append((item, depth + 1, path))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value)
                         if isinstance(item, str | dict | list))
        else:
            _unicode(value, where)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_fields(body: dict, kind: str) -> Request:
    """The :class:`Request` of a parsed body of ``kind``.

    Raises:
        ApiError: 400 naming the field: unknown fields, a missing ``model`` / ``messages`` / ``prompt``, ``n`` other
            than 1, ``logprobs``, ``echo``, ``suffix``, ``best_of`` or penalties (unsupported), ``max_tokens`` < 1,
            ``temperature`` outside [0, 2], ``top_p`` outside (0, 1], a bad ``seed``, ``stop`` or ``stream_options``.
    """
    allowed = CHAT_FIELDS if kind == CHAT else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: {', '.join(unknown)}",
                  unknown[0], "unknown_field")
    _check_unsupported(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: a string naming the served model (GET /v1/models lists it)", "model")
    request = Request(kind, model, max_tokens=_max_tokens(body), temperature=_number(body, "temperature", 0.0, 2.0),
                      top_p=_top_p(body), seed=_seed(body), stop=_stop(body), stream=_bool(body, "stream"),
                      include_usage=_include_usage(body), return_token_ids=_bool(body, "return_token_ids"))
    if request.return_token_ids and request.stream:
        raise bad("'return_token_ids' is answered only without 'stream'", "return_token_ids")
    if kind == CHAT:
        request.messages = _messages(body.get("messages"))
    else:
        request.prompt = _prompt(body.get("prompt"))
    return request


def _check_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):  # true == 1 and 1.0 == 1 in Python: neither is JSON's 1
        raise bad(f"n={json.dumps(n)} is not supported: n must be the integer 1 (this server returns one choice per "
                  f"request)", "n")
    for name in ("logprobs", "top_logprobs", "echo"):
        if body.get(name) is not None and body.get(name) is not False:
            raise bad(f"'{name}' is not supported by this server", name)
    if body.get("best_of") is not None and (type(body["best_of"]) is not int or body["best_of"] != 1):
        raise bad("'best_of' is not supported by this server (only the integer 1)", "best_of")
    if body.get("suffix") not in (None, ""):
        raise bad("'suffix' is not supported by this server", "suffix")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad(f"'user' must be a string, got {type(body['user']).__name__}", "user")
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or value not in (0, 0.0)):
            raise bad(f"'{name}' is not supported by this server (only 0)", name)


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, got {value!r}", name)
    if not low <= value <= high:
        raise bad(f"'{name}' must be in [{low:g}, {high:g}], got {value!r}", name)
    return float(value)


def _top_p(body: dict) -> float | None:
    value = _number(body, "top_p", 0.0, 1.0)
    if value == 0.0:
        raise bad("'top_p' must be in (0, 1], got 0", "top_p")
    return value


def _max_tokens(body: dict) -> int | None:
    names = [n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None]
    if not names:
        return None
    name = names[0]
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {value!r}", name)
    if value < 1:
        raise bad(f"'{name}' must be at least 1, got {value}", name)
    return value


def _seed(body: dict) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise bad(f"'seed' must be an integer in [0, 2**63), got {value!r}", "seed")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"'stop' must be a non-empty string or a list of them, got {value!r}", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' holds {len(stops)} sequences, at most {MAX_STOP} are allowed", "stop")
    return [_unicode(s, "stop") for s in stops]


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad(f"'stream_options' may only hold include_usage, got {options!r}", "stream_options")
    if not _bool(body, "stream"):
        raise bad("'stream_options' is only allowed with stream: true", "stream_options")
    return _bool(options, "include_usage")


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("'messages' is required: a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content, got {type(m).__name__}", where)
        unknown = sorted(set(m) - MESSAGE_FIELDS)
        if unknown:
            raise bad(f"{where} has unsupported field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}",
                      f"{where}.{unknown[0]}")
        if m.get("role") not in ROLES:
            raise bad(f"{where}.role must be one of {sorted(ROLES)}, got {m.get('role')!r}", f"{where}.role")
        out.append({"role": m["role"], "content": _content(m.get("content"), f"{where}.content")})
    return out


def _unicode(text: str, where: str) -> str:
    """``text``, checked to be Unicode text: JSON's ``\\ud800``-style escapes can spell lone surrogates, which no
    tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{where} holds a lone surrogate ({text[e.start]!r} at character {e.start}): not Unicode text",
                  where) from None
    return text


def _content(value, where: str) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(value, str):
        return _unicode(value, where)
    if isinstance(value, list) and not value:
        raise bad(f"{where} is an empty list of parts: a message needs text (a string, or text parts)", where)
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return _unicode("".join(p["text"] for p in value), where)
    raise bad(f"{where} must be a string or a list of text parts ({{'type': 'text', 'text': ...}}); other content "
              f"(images, audio) is not supported", where)


def _prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad("'prompt' is empty", "prompt")
        return _unicode(value, "prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)
    raise bad("'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt")
