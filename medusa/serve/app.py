"""The HTTP side of ``medusa serve``: an OpenAI-compatible API on Starlette, run by uvicorn.

``POST /v1/chat/completions`` and ``POST /v1/completions`` (JSON, or server-sent events with ``stream``), ``GET
/v1/models`` and ``GET /health``. Requests are validated (:mod:`medusa.serve.protocol`), turned into prompt ids and
decoding settings here, and decoded by the scheduler thread (:mod:`medusa.serve.scheduler`); its tokens come back
through an asyncio queue and are turned into text by :class:`medusa.serve.text.TextStream`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import secrets
import time
from dataclasses import dataclass, field

import torch

from medusa.decode.logits_process import resolve_decoding
from medusa.serve.metrics import Metrics
from medusa.serve.protocol import CHAT, COMPLETION, ApiError, Request, bad, parse_body
from medusa.serve.scheduler import SPECULATION, Job, QueueFull, Scheduler, profile_forward_s
from medusa.serve.text import TextStream, chat_ids, text_ids

logger = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """What ``medusa serve`` is configured with (its flags)."""

    served_model_name: str
    """The name ``/v1/models`` lists and requests must ask for."""
    api_key: str | None = None
    """When set, ``/v1`` requests need ``Authorization: Bearer <api_key>`` (``--api-key``, ``--api-key-file`` or the
    ``MEDUSA_API_KEY`` environment variable)."""
    allowed_hosts: list[str] = field(default_factory=list)
    """``Host`` names accepted beside localhost, 127.0.0.1, ::1 and the bound address (421 for others: a page
    elsewhere cannot reach the server through DNS rebinding); ``*`` accepts any."""
    cors_origins: list[str] = field(default_factory=list)
    """Origins a browser may call the API from (CORS); none by default."""
    max_running: int = 16
    """Requests decoding at once (rows of the batch, greedy and sampling alike)."""
    max_waiting: int = 64
    """Requests queued beyond those running; more get 429."""
    prefill_chunk: int = 256
    """Prompt tokens prefilled per round of the scheduler (chunked prefill): a longer prompt joins over several
    rounds, each followed by one step of the running rows, so it does not hold them up for its whole forward."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (413 beyond), counted as it arrives, chunked or not: no more is read."""
    max_header_bytes: int = 16 << 10
    """Largest request line and header block (431 beyond; 400 when h11 refuses a block arriving in pieces; the
    connection closed)."""
    read_timeout_s: float = 30.0
    """A client that sends no byte of its headers or body for this long is cut off (408 while sending a body)."""
    max_connections: int = 256
    """Open connections at once; one more is closed as soon as it is made."""
    keep_alive_s: float = 5.0
    """An idle keep-alive connection is closed after this long."""
    prefix_cache_mb: float = 64.0
    """Megabytes of prefilled prompts' keys and values kept, so that a prompt starting with the same tokens as a
    kept one (the chat template's system turn, a conversation's earlier turns) is prefilled from after them
    (:class:`medusa.decode.prefix.PrefixStore`): exact, and only through the engines whose forward gives each token
    the same bits however its prompt is cut (``native`` and the native int4 decoders); 0: off."""
    idle_release_s: float = 2.0
    """After this many seconds with no request, the C allocator's free memory goes back to the system, so that the
    resident size falls back after a busy spell (glibc ``malloc_trim``); 0: never."""
    request_timeout_s: float = 600.0
    """A request not finished by then is cancelled (504, or an error event when streaming)."""
    default_max_tokens: int = 512
    """New tokens when a request sets no ``max_tokens`` (less when the context has less room)."""
    speculation: str = "auto"
    """One of :data:`medusa.serve.scheduler.SPECULATION`."""
    acceptance: str = "rejection"
    """How sampling requests accept drafts: ``rejection`` (lossless), ``coupled`` (lossless, and a seeded request's
    tokens the same whatever the requests beside it, up to float rounding) or ``typical`` (Medusa's typical
    acceptance, lossy), or a rule registered with :func:`medusa.register_acceptance`."""

    @classmethod
    def from_flags(cls, args, served_model_name: str, environ: dict | None = None) -> ServeConfig:
        """The configuration ``medusa serve``'s parsed flags give (:func:`medusa.serve.run.add_serve_arguments`):
        each field from the flag of its name; the API key from ``--api-key``, else ``--api-key-file``, else the
        ``MEDUSA_API_KEY`` environment variable (a key on the command line shows in ``ps``).

        Raises:
            ValueError: both ``--api-key`` and ``--api-key-file``; an empty key file.
            OSError: an unreadable key file.
        """
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in ("served_model_name", "api_key")]
        key = api_key_from(args.api_key, args.api_key_file, os.environ if environ is None else environ)
        return cls(served_model_name, api_key=key, **{name: getattr(args, name) for name in fields})

    def __post_init__(self):
        if self.speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {SPECULATION}, got {self.speculation!r}")
        for name in ("max_running", "max_body_bytes", "max_header_bytes", "default_max_tokens", "max_connections",
                     "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not 0 <= self.prefix_cache_mb * (1 << 20) < float("inf"):  # also refuses NaN, and a size beyond floats
            raise ValueError(f"prefix_cache_mb must be >= 0 and finite (0: off), got {self.prefix_cache_mb}")
        if not self.idle_release_s >= 0:  # also refuses NaN
            raise ValueError(f"idle_release_s must be >= 0 (0: never), got {self.idle_release_s}")
        for name in ("request_timeout_s", "read_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


API_KEY_ENV = "MEDUSA_API_KEY"
"""The environment variable ``medusa serve`` reads its API key from when no flag gives one."""


def api_key_from(flag: str | None, path: str | None, environ) -> str | None:
    """The API key: ``flag``, else the first line of the file at ``path``, else ``environ[API_KEY_ENV]``.

    Raises:
        ValueError: both a flag and a file, or an empty key.
    """
    if flag is not None and path is not None:
        raise ValueError("--api-key and --api-key-file both give the API key: pass one")
    key = flag
    if path is not None:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {path}: the file's first line is empty")
    elif key is None:
        key = environ.get(API_KEY_ENV) or None
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return key


class Server:
    """The model, its scheduler and the request handling shared by the routes.

    Args:
        model: a :class:`medusa.model.MedusaModel` with a tokenizer.
        config: the :class:`ServeConfig`.
    """

    def __init__(self, model, config: ServeConfig):
        """Raises ``ValueError``: no tokenizer, or a setting of the base's generation_config (or ``acceptance``)
        that Medusa cannot honour, named: every request would be refused."""
        if model.tokenizer is None:
            raise ValueError("serving needs the base's tokenizer (MedusaModel.tokenizer is None)")
        resolve_decoding(model.base.generation_config, acceptance=config.acceptance)
        self.model, self.config = model, config
        self.scheduler = Scheduler(model, config.max_running, config.max_waiting, config.speculation,
                                   profile_forward_s(model) if config.speculation == "auto" else None,
                                   config.prefill_chunk, config.idle_release_s,
                                   int(config.prefix_cache_mb * (1 << 20)))
        self.drain_deadline: float | None = None
        """Set on SIGTERM (:meth:`drain`): requests still running then end with an error."""
        text_config = model.base.config.get_text_config(decoder=True)
        self.context = (getattr(text_config, "max_position_embeddings", None)
                        or getattr(text_config, "n_positions", None))
        self.vocab_size = text_config.vocab_size
        added = getattr(model.tokenizer, "added_tokens_decoder", {})  # special tokens outside the named roles too
        self.special_ids = set(model.tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        self.created = int(time.time())
        self.preparing = 0
        """Requests admitted and being parsed and tokenized (off the event loop), not yet queued."""
        self.metrics = Metrics()

    def drain(self, seconds: float) -> None:
        """Stop taking requests; those in flight get ``seconds`` to finish."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + seconds

    # -- one request --------------------------------------------------------------------------------------------------
    def check_key(self, headers) -> None:
        """Raises ``ApiError`` 401 when an API key is set and the request's ``headers`` (Starlette's) do not carry
        it in one ``Authorization: Bearer`` header (the scheme in any case, RFC 7235; two such headers are refused,
        whichever holds the key)."""
        key = self.config.api_key
        if key is None:
            return
        given = headers.getlist("authorization")
        if len(given) > 1:
            raise ApiError(401, f"{len(given)} Authorization headers: send one, 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        scheme, _, token = (given[0] if given else "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def prepare(self, request: Request) -> tuple[torch.Tensor, int, object]:
        """``(prompt ids (T,), max new tokens, Decoding)`` of a validated request.

        Raises:
            ApiError: 404 for another model's name; 400 for messages the chat template rejects, a prompt of only
                special tokens or out-of-vocabulary ids, a prompt or ``max_tokens`` beyond the context, or settings
                the base cannot honour (named).
        """
        if request.model != self.config.served_model_name:
            raise ApiError(404, f"The model '{request.model}' does not exist: this server serves "
                                f"'{self.config.served_model_name}'", "model", "model_not_found")
        ids = self.prompt_ids(request)
        return ids, self.budget(request, len(ids)), self.decoding(request)

    def prompt_ids(self, request: Request) -> torch.Tensor:
        """``(T,)`` prompt ids: the chat template's, or the prompt's. User text is text: special tokens written in
        it are tokenized as text (:mod:`medusa.serve.text`); control tokens come from the template, or from a
        prompt given as token ids."""
        tokenizer, param = self.model.tokenizer, "messages" if request.kind == CHAT else "prompt"
        if request.kind == CHAT:
            try:
                ids = chat_ids(tokenizer, request.messages)
            except Exception as e:  # jinja2's TemplateError, or what a template raises itself
                raise bad(f"the chat template rejected the messages: {e}", "messages") from None
        elif isinstance(request.prompt, str):
            ids = text_ids(tokenizer, request.prompt)
        else:
            ids = request.prompt
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise bad(f"token id {outside[0]} of the prompt is outside the vocabulary [0, {self.vocab_size})",
                          "prompt")
        if not ids or all(t in self.special_ids for t in ids):
            raise bad(f"the {param} holds only special tokens ({len(ids)}): there is no text to continue", param)
        return torch.tensor(ids, dtype=torch.long, device=self.model.device)

    def budget(self, request: Request, prompt_len: int) -> int:
        """New tokens for the request: its ``max_tokens``, else the server's default, within the context."""
        depth = self.scheduler.batch.drafter.max_depth
        room = math.inf if self.context is None else self.context - prompt_len - depth - 1
        param = "messages" if request.kind == CHAT else "prompt"
        if room < 1:
            raise bad(f"the prompt is {prompt_len} tokens: with the tree's depth {depth} it leaves no room in the "
                      f"model's context of {self.context} tokens", param, "context_length_exceeded")
        if request.max_tokens is None:
            return int(min(self.config.default_max_tokens, room))
        if request.max_tokens > room:
            raise bad(f"max_tokens {request.max_tokens} + the prompt's {prompt_len} tokens (+ the tree's depth "
                      f"{depth} + 1) exceed the model's context of {self.context} tokens: at most {int(room)} new "
                      f"tokens fit", "max_tokens", "context_length_exceeded")
        return request.max_tokens

    def decoding(self, request: Request):
        """The library's decoding settings: ``temperature`` 0 is greedy, > 0 samples at it, unset takes the base's
        generation_config (as ``MedusaModel.generate`` does); ``top_p`` applies when sampling."""
        do_sample = None if request.temperature is None else request.temperature > 0
        config, acceptance = self.model.base.generation_config, self.config.acceptance
        try:
            decoding = resolve_decoding(config, do_sample, request.temperature if do_sample else None,
                                        seed=request.seed, acceptance=acceptance)
            if decoding.do_sample and request.top_p is not None:
                decoding = resolve_decoding(config, True, request.temperature, top_p=request.top_p,
                                            seed=request.seed, acceptance=acceptance)
        except ValueError as e:
            raise bad(f"these decoding settings cannot be honoured: {e}", code="unsupported_setting") from None
        return decoding

    def admit(self) -> None:
        """Admission, before a request's body is read and again before it is parsed and tokenized: refused while the
        requests running, waiting and being prepared already fill ``max_running + max_waiting``, so that a flood
        costs no more than that many prompts' tokenizing at once.

        Raises:
            ApiError: 429 with ``Retry-After`` when full, 503 while draining.
        """
        if self.drain_deadline is not None:
            raise shutting_down()
        load = self.scheduler.load() + self.preparing
        if load >= self.config.max_running + self.config.max_waiting:
            raise ApiError(429, f"{load} requests are already running, waiting or being prepared (the server's "
                                f"limit): retry later", code="queue_full", kind="rate_limit_exceeded",
                           headers={"Retry-After": RETRY_AFTER_S})

    def submit(self, ids: torch.Tensor, max_new: int, decoding) -> tuple[Job, asyncio.Queue]:
        """Queue a job whose events arrive on the returned queue (from the scheduler thread).

        Raises:
            ApiError: 429 (with ``Retry-After``) when the waiting queue is full, 503 while draining.
        """
        if self.drain_deadline is not None:
            raise shutting_down()
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(event: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        job = Job(ids, max_new, decoding, deliver)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", kind="rate_limit_exceeded",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        except RuntimeError:
            raise shutting_down() from None
        return job, events

    async def events(self, job: Job, events: asyncio.Queue, started: float):
        """The job's events until it is done; ends with ``("error", ...)`` at its deadline or the drain's."""
        while True:
            deadline = started + self.config.request_timeout_s
            if self.drain_deadline is not None:
                deadline = min(deadline, self.drain_deadline)
            try:
                event = await asyncio.wait_for(events.get(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                job.cancelled = True
                if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
                    yield ("error", "the server is shutting down", 503)
                else:
                    yield ("error", f"the request timed out after {self.config.request_timeout_s:g} s", 504)
                return
            yield event
            if event[0] in ("done", "error"):
                return

    def usage(self, job: Job, prompt_len: int, completion: int) -> dict:
        tau = job.stats.tau
        return {"prompt_tokens": prompt_len, "completion_tokens": completion,
                "total_tokens": prompt_len + completion,
                "medusa_tau": None if math.isnan(tau) else round(tau, 4)}


RETRY_AFTER_S = "1"
"""``Retry-After`` of a 429 or 503: the queue moves by a request every few steps."""


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", code="server_shutting_down", kind="server_error",
                    headers={"Retry-After": RETRY_AFTER_S})


def chunk_body(kind: str, rid: str, created: int, model: str, text: str | None, finish: str | None,
               first: bool = False) -> dict:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``)."""
    if kind == CHAT:
        delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return {"id": rid, "object": COMPLETION, "created": created, "model": model, "choices": [choice]}


def response_body(kind: str, rid: str, created: int, model: str, text: str, finish: str, usage: dict,
                  token_ids: list[int] | None = None) -> dict:
    """The whole answer; ``token_ids`` (the completion's, asked with ``return_token_ids``) go in its choice."""
    if kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice], "usage": usage}


def error_response(body: dict, status: int, headers: dict[str, str] | None = None):
    """An error answer: OpenAI's body as ASCII JSON (whatever text it quotes, the answer encodes)."""
    from starlette.responses import Response

    return Response(json.dumps(body, ensure_ascii=True), status, headers, media_type="application/json")


def sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


async def complete(server: Server, request, kind: str):
    """``POST /v1/chat/completions`` (``kind`` :data:`CHAT`) or ``/v1/completions``."""
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse, StreamingResponse

    started = time.monotonic()
    server.check_key(request.headers)
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(415, f"the request body must be JSON, sent as 'Content-Type: application/json' (got "
                            f"{media or 'none'!r})", code="unsupported_media_type")
    server.admit()  # a full server refuses before reading the body
    raw = await read_body(server, request)  # not counted as preparing: a slow upload holds no place in the queue
    server.admit()
    server.preparing += 1
    try:  # parsing, the chat template and tokenizing grow with the input: off the event loop
        body = await run_in_threadpool(parse_body, raw, kind, server.config.max_body_bytes)
        ids, max_new, decoding = await run_in_threadpool(server.prepare, body)
        job, events = server.submit(ids, max_new, decoding)
    finally:
        server.preparing -= 1
    rid = ("chatcmpl-" if kind == CHAT else "cmpl-") + secrets.token_hex(12)
    created, model = int(time.time()), server.config.served_model_name
    text = TextStream(server.model.tokenizer, body.stop)
    if body.stream:
        return StreamingResponse(stream(server, job, events, started, body, rid, created, text, len(ids)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    pieces, finish = [], None
    watch = asyncio.create_task(cancel_on_disconnect(request, job))
    try:
        async for event in server.events(job, events, started):
            if event[0] == "tokens":
                pieces.append(await run_in_threadpool(text.add, event[1]))
            elif event[0] == "done":
                pieces.append(await run_in_threadpool(text.finish))
                finish = event[1]
            else:
                retry = {"Retry-After": RETRY_AFTER_S} if event[2] in (429, 503) else None
                raise ApiError(event[2], event[1], code="decoding_ended", kind="server_error", headers=retry)
            if text.stopped:
                finish = "stop"
                break
    finally:
        watch.cancel()
        job.cancelled = True  # a no-op once done; frees the slot when a stop string matched
        completion = completion_tokens(text)
        server.metrics.finished(ROUTES[kind != CHAT], job.stats, len(ids), completion, time.monotonic() - started)
    usage = server.usage(job, len(ids), completion)
    token_ids = text.ids[:completion] if body.return_token_ids else None
    return JSONResponse(response_body(kind, rid, created, model, "".join(pieces), finish, usage, token_ids))


def completion_tokens(text: TextStream) -> int:
    """Tokens of the answer: those decoded until a stop string appeared, else all."""
    return text.tokens_at_stop if text.tokens_at_stop is not None else len(text.ids)


class ClientGone(Exception):
    """The client went away before its request was read: nothing to answer."""


def too_large(limit: int, declared: str | None = None) -> ApiError:
    said = f"is {declared} bytes" if declared else "goes on past it"
    return ApiError(413, f"the request body {said}: over the server's limit of {limit} bytes",
                    code="request_too_large", headers={"Connection": "close"})


async def read_body(server: Server, request) -> bytes:
    """The request's body, read as it arrives and refused as soon as it passes ``max_body_bytes`` (a declared
    Content-Length is checked first): memory holds at most the limit plus one chunk, whatever the client sends.

    Raises:
        ApiError: 413 over the limit; 408 when the client sends nothing for ``read_timeout_s``; 503 once the drain
            has begun (a half-sent upload does not hold up the exit). Each closes the connection.
        ClientGone: the client disconnected mid-body.
    """
    limit = server.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit, declared)
    chunks, size = [], 0
    while True:
        message = await receive_within(server, request)
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def receive_within(server: Server, request) -> dict:
    """The next ASGI message of ``request`` within the read timeout, or the ``ApiError`` of :func:`read_body`."""
    deadline = time.monotonic() + server.config.read_timeout_s
    while True:
        if server.drain_deadline is not None:
            error = shutting_down()
            error.headers["Connection"] = "close"
            raise error
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(408, f"the client sent no byte of its body for {server.config.read_timeout_s:g} s",
                           code="request_timeout", headers={"Connection": "close"})
        try:  # in slices, so that the drain is seen; uvicorn keeps what arrives meanwhile
            return await asyncio.wait_for(request.receive(), min(left, 0.25))
        except TimeoutError:
            continue


async def cancel_on_disconnect(request, job: Job) -> None:
    """Cancel ``job`` when the client of a non-streamed request goes away (its body is read: the next message is
    the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled = True


async def stream(server: Server, job: Job, events: asyncio.Queue, started: float, body: Request, rid: str,
                 created: int, text: TextStream, prompt_len: int):
    """Server-sent events: one chunk per accepted group of tokens that adds text, the finish reason, the usage when
    asked (``stream_options.include_usage``), then ``[DONE]``; an error ends the stream with an error event."""
    from starlette.concurrency import run_in_threadpool

    model, kind = server.config.served_model_name, body.kind
    try:
        if kind == CHAT:
            yield sse(chunk_body(kind, rid, created, model, None, None, first=True))
        finish, first_text = None, True
        async for event in server.events(job, events, started):
            if event[0] == "error":
                yield sse({"error": {"message": event[1], "type": "server_error", "param": None,
                                     "code": "decoding_ended"}})
                yield sse("[DONE]")
                return
            # decoding the text so far grows with it: off the event loop
            piece = await run_in_threadpool(*((text.add, event[1]) if event[0] == "tokens" else (text.finish,)))
            finish = "stop" if text.stopped else (event[1] if event[0] == "done" else None)
            if piece:
                if first_text:
                    server.metrics.first_token.observe(time.monotonic() - started)
                    first_text = False
                yield sse(chunk_body(kind, rid, created, model, piece, None))
            if finish:
                break
        if kind == CHAT:
            yield sse(chunk_body(kind, rid, created, model, None, finish))
        else:
            yield sse(chunk_body(kind, rid, created, model, "", finish))
        if body.include_usage:
            completion = completion_tokens(text)
            usage = server.usage(job, prompt_len, completion)
            yield sse({"id": rid, "object": "chat.completion.chunk" if kind == CHAT else COMPLETION,
                       "created": created, "model": model, "choices": [], "usage": usage})
        yield sse("[DONE]")
    finally:
        job.cancelled = True  # the client went away, or a stop string ended the text: the slot is freed
        server.metrics.finished(ROUTES[kind != CHAT], job.stats, prompt_len, completion_tokens(text),
                                time.monotonic() - started)


class Guard:
    """ASGI middleware: what is checked of every HTTP request before a route sees it: the size of its request line
    and headers (431 beyond ``max_header_bytes``; h11 itself bounds only a header block that arrives in pieces)."""

    def __init__(self, app, server: Server, bound_host: str | None = None):
        self.app, self.server = app, server
        names = {*LOCAL_HOSTS, *(h.lower() for h in server.config.allowed_hosts)}
        if bound_host and bound_host not in WILDCARD_HOSTS:
            names.add(bound_host.lower().strip("[]"))
        self.hosts = None if "*" in names else names
        """The ``Host`` names accepted (without the port); ``None``: any."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = route_label(scope["path"])

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.server.metrics.answered(route, message["status"])
            await send(message)

        error = self.check(scope)
        if error is not None:
            return await error_response(error.body(), error.status, error.headers)(scope, receive, counted)
        return await self.app(scope, receive, counted)

    def check(self, scope) -> ApiError | None:
        limit = self.server.config.max_header_bytes
        size = (sum(len(k) + len(v) + 4 for k, v in scope["headers"]) + len(scope.get("raw_path", b""))
                + len(scope.get("query_string", b"")))
        if size > limit:
            return ApiError(431, f"the request line and headers are {size} bytes, over the server's limit of "
                                 f"{limit}", code="headers_too_large", headers={"Connection": "close"})
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        if self.hosts is not None:
            name = host_name(hosts[0]) if len(hosts) == 1 else None
            if name not in self.hosts:
                shown = hosts[0].decode("latin-1")[:100] if len(hosts) == 1 else f"{len(hosts)} Host headers"
                return ApiError(421, f"this server does not answer for the host {shown!r}: it answers for "
                                     f"{', '.join(sorted(self.hosts))} (medusa serve --allowed-host NAME adds one)",
                                code="host_not_allowed")
        return None


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
"""The routes' paths: the chat route first, then the completions route (``ROUTES[kind != CHAT]``)."""


def route_label(path: str) -> str:
    """The route a path counts under in ``/metrics`` (a bounded set of labels, whatever paths clients send)."""
    if path in ROUTES:
        return path
    return "/v1/models/{id}" if path.startswith("/v1/models/") else "other"


LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def host_name(value: bytes) -> str:
    """The name of a ``Host`` header's value, lowercase, without its port or an IPv6 address's brackets."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def build_app(server: Server, bound_host: str | None = None):
    """The Starlette application serving ``server`` bound to ``bound_host`` (a ``Host`` it also answers for); the
    scheduler thread runs while the app does."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    async def chat(request: HttpRequest):
        return await complete(server, request, CHAT)

    async def completions(request: HttpRequest):
        return await complete(server, request, COMPLETION)

    def model_entry() -> dict:
        return {"id": server.config.served_model_name, "object": "model", "created": server.created,
                "owned_by": "medusa"}

    async def models(request: HttpRequest):
        server.check_key(request.headers)
        return JSONResponse({"object": "list", "data": [model_entry()]})

    async def model(request: HttpRequest):
        server.check_key(request.headers)
        name = request.path_params["model_id"]
        if name != server.config.served_model_name:
            raise ApiError(404, f"The model '{name}' does not exist: this server serves "
                                f"'{server.config.served_model_name}'", "model", "model_not_found")
        return JSONResponse(model_entry())

    async def metrics(request: HttpRequest):
        return PlainTextResponse(server.metrics.text(server.scheduler, server.preparing),
                                 media_type="text/plain; version=0.0.4")

    async def health(request: HttpRequest):
        state = "draining" if server.drain_deadline is not None else "ok"
        return JSONResponse({"status": state, **server.scheduler.snapshot()}, status_code=200 if state == "ok"
                            else 503, headers=None if state == "ok" else {"Retry-After": RETRY_AFTER_S})

    async def api_error(request: HttpRequest, exc: ApiError):
        return error_response(exc.body(), exc.status, exc.headers)

    async def client_gone(request: HttpRequest, exc: ClientGone):
        logger.info("client %s went away before its request was read", request.client and request.client.host)
        return Response(status_code=400)  # sent to nobody

    async def http_error(request: HttpRequest, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": None}}
        return error_response(body, exc.status_code, exc.headers)

    async def internal_error(request: HttpRequest, exc: Exception):
        logger.exception("request failed")
        body = {"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                          "param": None, "code": None}}
        return error_response(body, 500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            yield
        finally:
            server.scheduler.stop(timeout=60)

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{model_id:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"])]
    handlers = {ApiError: api_error, ClientGone: client_gone, HTTPException: http_error, Exception: internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.router.redirect_slashes = False  # its Location would be built from the client's Host header
    if server.config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=server.config.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
    app.add_middleware(Guard, server=server, bound_host=bound_host)  # outermost: before CORS answers
    return app
