"""Self-distillation through an OpenAI-compatible server: vLLM, SGLang, TGI, llama.cpp's server or ``medusa serve``.

The same prompts as the in-process path (:func:`train.distill.prompts_to_distill`) are sent, greedy, to the server's
``/v1/completions`` (the prompt as token ids, exactly the ids the record holds) or ``/v1/chat/completions`` (the
messages; the server applies its own chat template), ``concurrency`` at a time. The answer's token ids are the
server's own when it returns them (``return_token_ids``, vLLM's extension, which ``medusa serve`` answers too);
otherwise its text is tokenized again with ``--base``'s tokenizer and the stop token appended where the server
stopped. The records are those :func:`train.distill.distill` writes, so training reads either.

FasterDecoding/Medusa makes its self-distillation data the same way, by asking a served copy of the base (Medusa
report, Cai et al. 2024, section 2.3.2).

Robustness: 429, 5xx, timeouts and refused connections are retried with exponential backoff (a ``Retry-After`` is
honoured) up to ``retries`` times, after which the run stops with :class:`ServerError`; 400, 401, 403 and 404 stop
it at once. Answers are written in prompt order, a chunk at a time, each line whole and flushed, so whatever was
answered before a failure is kept and a rerun resumes after it (ids already in the file are skipped). An answer
that is not JSON, lacks its text or finish reason, or ends before its budget without a stop, is not written; it is
logged and counted, and the next run asks again.

The token check (:func:`token_check`) answers the first prompts with ``--base`` itself and compares token by token:
a server serving another model, or the same weights with another tokenizer, is named before anything is written.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from train.data import Conversation
from train.distill import distilled_record, open_for_append, pending_prompts

logger = logging.getLogger(__name__)

ENDPOINTS = ("completions", "chat")
RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""Statuses that a later try may not meet: asked again after a backoff."""
API_KEY_ENV = ("MEDUSA_API_KEY", "OPENAI_API_KEY")
"""Environment variables the API key is read from, in this order, when no ``--api-key-file`` is given."""
MAX_BACKOFF_S = 30.0


class ServerError(RuntimeError):
    """The server failed for good: it is down, refused the key, does not know the model, or kept failing after
    every retry. The message names the URL, the status and what the server said."""


class MalformedAnswer(ValueError):
    """One answer the server sent cannot be a distilled record (not JSON, no text, cut short): it is skipped."""


@dataclass
class ServerSettings:
    """Where and how to ask.

    Attributes:
        url: the server's base URL, with or without its ``/v1`` (``http://127.0.0.1:8000`` and
            ``http://127.0.0.1:8000/v1`` are the same server).
        model: the served model's name; ``None``: the first one ``GET /v1/models`` lists.
        endpoint: ``"completions"`` (token-id prompts, exact) or ``"chat"`` (messages, the server's template).
        api_key: sent as ``Authorization: Bearer``; ``None``: no header.
        concurrency: requests in flight at once (a server with continuous batching answers them together).
        timeout_s: limit per request, seconds.
        retries: tries after the first one, for the statuses in :data:`RETRIED_STATUS` and network errors.
        backoff_s: the first wait between tries; doubled each time, at most :data:`MAX_BACKOFF_S`.
    """

    url: str
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    concurrency: int = 8
    timeout_s: float = 300.0
    retries: int = 4
    backoff_s: float = 1.0
    token_ids: bool = field(default=True, repr=False)
    """Ask for ``return_token_ids``; switched off when the server refuses the field."""

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        for name, low in (("concurrency", 1), ("retries", 0)):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {getattr(self, name)!r}")
        for name in ("timeout_s", "backoff_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"the server URL must start with http:// or https://, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"


def read_api_key(path: str | None) -> str | None:
    """The API key: the first line of ``path`` when given, else the first of :data:`API_KEY_ENV` set; ``None``.
    Never a command-line value (other users of the machine see those in ``ps``).

    Raises:
        ValueError: ``path`` does not exist or is empty.
    """
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--api-key-file {path}: no such file")
        key = file.read_text(encoding="utf-8").strip().splitlines()
        if not key or not key[0].strip():
            raise ValueError(f"--api-key-file {path} is empty")
        return key[0].strip()
    return next((os.environ[name] for name in API_KEY_ENV if os.environ.get(name)), None)


class ServerClient:
    """Greedy answers from one OpenAI-compatible server (thread-safe: one ``httpx.Client`` pool).

    Args:
        settings: where and how to ask.
        stop_ids: the base's end-of-sequence ids (what a ``"stop"`` finish appends when the server returns text).
        tokenizer: ``--base``'s tokenizer (tokenizes a text-only answer again).

    Raises:
        ImportError: ``httpx`` is not installed (``pip install 'medusa-heads[serve]'``).
    """

    def __init__(self, settings: ServerSettings, stop_ids: set[int], tokenizer):
        try:
            import httpx
        except ImportError as e:  # pragma: no cover (a dev install has it)
            raise ImportError("distill --server needs httpx: pip install httpx (or the 'serve' extra)") from e
        self.settings, self.stop_ids, self.tokenizer, self.httpx = settings, set(stop_ids), tokenizer, httpx
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.http = httpx.Client(base_url=settings.url, headers=headers, timeout=settings.timeout_s,
                                 limits=httpx.Limits(max_connections=settings.concurrency + 2))
        self.retried = 0
        """Tries that were retried (for the log)."""

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, body: dict | None = None):
        """One request, retried as :class:`ServerSettings` says; returns the ``httpx.Response`` of a 2xx answer.

        Raises:
            ServerError: a status that retrying does not help (400-404 and other 4xx), or the last try failed.
        """
        s, url = self.settings, self.settings.url + path
        for attempt in range(s.retries + 1):
            wait = min(s.backoff_s * 2 ** attempt, MAX_BACKOFF_S)
            try:
                response = self.http.request(method, path, json=body)
            except self.httpx.TimeoutException:
                problem = f"no answer within {s.timeout_s:g} s"
            except self.httpx.TransportError as e:  # refused, reset, DNS, a body cut off mid-way
                problem = f"{type(e).__name__}: {e}"
            else:
                if response.is_success:
                    return response
                said = response.text[:300].strip()
                if response.status_code not in RETRIED_STATUS:
                    hint = {401: " (the API key: --api-key-file, or MEDUSA_API_KEY / OPENAI_API_KEY)",
                            403: " (the API key: --api-key-file, or MEDUSA_API_KEY / OPENAI_API_KEY)",
                            404: " (the URL or --server-model: GET /v1/models lists the served names)"}
                    raise ServerError(f"{method} {url} answered {response.status_code}"
                                      f"{hint.get(response.status_code, '')}: {said}")
                problem = f"status {response.status_code}: {said}"
                retry_after = response.headers.get("retry-after", "")
                if retry_after.replace(".", "", 1).isdigit():
                    wait = min(max(wait, float(retry_after)), MAX_BACKOFF_S)
            if attempt == s.retries:
                raise ServerError(f"{method} {url} failed {s.retries + 1} times; the last: {problem}")
            self.retried += 1
            logger.warning("%s %s: %s; trying again in %.1f s (%d/%d)", method, url, problem, wait, attempt + 1,
                           s.retries)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def served_model(self) -> str:
        """The name to ask for: ``settings.model``, else the first of ``GET /v1/models``.

        Raises:
            ServerError: the server is unreachable or lists no model.
        """
        if self.settings.model:
            return self.settings.model
        try:
            names = [m["id"] for m in self._request("GET", "/models").json()["data"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ServerError(f"GET {self.settings.url}/models did not list models ({e}): name one with "
                              f"--server-model") from None
        if not names:
            raise ServerError(f"{self.settings.url}/models lists no model")
        self.settings.model = names[0]
        return names[0]

    def answer(self, prompt: list[dict] | None, ids: list[int], max_new_tokens: int) -> list[int]:
        """The server's greedy answer to one prompt, as ``--base`` token ids.

        Args:
            prompt: the chat messages (``None`` for a document prefix, which only ``completions`` can continue).
            ids: the prompt's token ids (what ``completions`` sends).
            max_new_tokens: the answer's budget.

        Returns:
            The answer's ids, ending in a stop id when the server stopped (not when the budget ran out).

        Raises:
            MalformedAnswer: the answer is not a JSON completion, or ends early without a stop.
            ServerError: as :meth:`_request`.
        """
        s = self.settings
        body = {"model": self.served_model(), "max_tokens": max_new_tokens, "temperature": 0.0}
        if s.endpoint == "chat":
            if prompt is None:
                raise ValueError("a document prefix can only be continued through --endpoint completions")
            path, body["messages"] = "/chat/completions", prompt
        else:
            path, body["prompt"] = "/completions", ids
        asked = s.token_ids
        if asked:
            body["return_token_ids"] = True
        try:
            response = self._request("POST", path, body)
        except ServerError as e:
            if not (asked and " 400" in str(e) and "return_token_ids" in str(e)):
                raise
            s.token_ids = False  # a strict server (OpenAI's own) refuses the extension: text it is
            logger.info("the server does not return token ids: answers are tokenized again with --base's tokenizer")
            return self.answer(prompt, ids, max_new_tokens)
        return self.answer_ids(response.text, max_new_tokens)

    def answer_ids(self, raw: str, max_new_tokens: int) -> list[int]:
        """The ``--base`` token ids of one answer body (see :meth:`answer`).

        Raises:
            MalformedAnswer: as :meth:`answer` says.
        """
        try:
            choice = json.loads(raw)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise MalformedAnswer(f"not a completion: {raw[:200]!r}") from None
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        if finish not in ("stop", "length"):
            raise MalformedAnswer(f"finish_reason {finish!r}: the answer may be cut off")
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            ids = list(token_ids)
        else:
            text = choice.get("text") if self.settings.endpoint == "completions" else \
                (choice.get("message") or {}).get("content")
            if not isinstance(text, str):
                raise MalformedAnswer(f"the answer holds no text: {raw[:200]!r}")
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        ids = ids[:max_new_tokens]
        if finish == "stop" and self.stop_ids and (not ids or ids[-1] not in self.stop_ids) and \
                len(ids) < max_new_tokens:
            ids.append(min(self.stop_ids))  # a server leaves the stop token out of its answer
        if finish == "length" and len(ids) < max_new_tokens and self.settings.token_ids:
            raise MalformedAnswer(f"finish_reason 'length' after {len(ids)} of {max_new_tokens} tokens")
        if not ids:
            raise MalformedAnswer("an empty answer")
        return ids


def token_check(model, todo: list[tuple], answers: list[list[int] | None], stop_ids: set[int], pad_id: int,
                tokenizer, min_agreement: float, source: str = "the server", why: str | None = None) -> dict:
    """Compare the server's answers (``source``: whose they are, in the messages) with ``--base``'s own greedy
    tokens, one prompt at a time (no padding).

    Args:
        model: the in-process base (HF causal LM).
        todo: ``(id, prompt, ids)`` of the checked prompts.
        answers: the server's ids for them (``None`` where the answer was malformed; not counted).
        min_agreement: the least mean share of each base answer that the server's answer matches before their first
            difference.
        source, why: whose answers they are and the likely cause a failed check names (default: a server's).

    Returns:
        ``{"checked", "identical", "agreement", "first_token_agreement"}``.

    Raises:
        ValueError: the agreement is below ``min_agreement``: the server's model or tokenizer is not ``--base``'s
            (the message shows the first difference).
    """
    from medusa.base import hf_greedy_batch

    identical, shares, first, example = 0, [], 0, None
    for (conv_id, _, ids), served in zip(todo, answers, strict=True):
        if served is None:
            continue
        own = hf_greedy_batch(model, [ids], len(served), stop_ids, pad_id)[0]  # as long: a longer one differs
        same = next((i for i, (a, b) in enumerate(zip(served, own, strict=False)) if a != b),
                    min(len(served), len(own)))
        identical += served == own
        first += bool(served) and bool(own) and served[0] == own[0]
        shares.append(same / max(len(own), 1))
        if served != own and example is None:
            example = (conv_id, same, tokenizer.decode(served[same:same + 8]), tokenizer.decode(own[same:same + 8]))
    report = {"checked": len(shares), "identical": identical,
              "agreement": sum(shares) / len(shares) if shares else float("nan"),
              "first_token_agreement": first / len(shares) if shares else float("nan")}
    logger.info("token check against --base on %d answers: %d identical, %.1f%% of tokens agree before the first "
                "difference, first tokens agree on %.0f%%", report["checked"], identical, 100 * report["agreement"],
                100 * report["first_token_agreement"])
    if shares and report["agreement"] < min_agreement:
        conv_id, at, theirs, ours = example
        why = why or ("the server serves another model, or the same weights with another tokenizer or chat template "
                      "(--endpoint completions sends token ids, which sidesteps a template that differs)")
        raise ValueError(f"{source}'s answers are not --base's greedy tokens: {100 * report['agreement']:.1f}% of "
                         f"tokens agree before the first difference (at least {100 * min_agreement:.0f}% wanted; "
                         f"{identical}/{len(shares)} answers identical). The first difference, {conv_id!r} at token "
                         f"{at}: {source} {theirs!r}, --base {ours!r}. Likely: {why}; --min-agreement 0 writes the "
                         f"answers anyway")
    return report


def distill_through_server(client: ServerClient, tokenizer, conversations: list[Conversation], out_path: str | Path,
                           max_new_tokens: int = 192, max_prompt_tokens: int = 384, time_limit_s: float | None = None,
                           turns: str = "all", seed: int = 0, prefix_lengths: tuple[int, ...] = (16, 32, 64, 128),
                           check_model=None, check_prompts: int = 8, min_agreement: float = 0.5,
                           pad_id: int | None = None) -> dict:
    """:func:`train.distill.distill` with the answers from ``client``'s server: the same prompts, the same records.

    Args:
        client: the server.
        tokenizer: ``--base``'s tokenizer.
        conversations, out_path, max_new_tokens, max_prompt_tokens, time_limit_s, turns, seed, prefix_lengths: as
            :func:`train.distill.distill` (the file is appended to; ids in it are skipped).
        check_model: the in-process base for :func:`token_check` on the first ``check_prompts`` answers, before any
            is written; ``None`` skips the check.
        min_agreement: :func:`token_check`'s threshold.

    Returns:
        ``{"written", "malformed", "seconds", "answer_tokens", "check"}``.

    Raises:
        ServerError: the server failed for good (every answer received before is written).
        ValueError: the token check failed (nothing is written).
    """
    out_path, done, (todo, too_long, too_short) = pending_prompts(out_path, tokenizer, conversations,
                                                                  max_prompt_tokens, turns, seed, prefix_lengths)
    logger.info("distilling %d prompts through %s (%s, %d at once; %d already done, %d longer than %d tokens "
                "skipped, %d documents no longer than the shortest prefix skipped)", len(todo), client.settings.url,
                client.settings.endpoint, client.settings.concurrency, len(done), too_long, max_prompt_tokens,
                too_short)
    chunk = max(4 * client.settings.concurrency, check_prompts if check_model is not None else 0)
    start, written, malformed, tokens, check = time.monotonic(), 0, 0, 0, None

    def ask(item):
        try:
            return client.answer(item[1], item[2], max_new_tokens)
        except MalformedAnswer as e:
            logger.error("%s: not written (%s); a rerun asks again", item[0], e)
            return None

    with ThreadPoolExecutor(client.settings.concurrency) as pool, open_for_append(out_path) as out:
        for c in range(0, len(todo), chunk):
            batch = todo[c : c + chunk]
            futures = [pool.submit(ask, item) for item in batch]
            answers, failure = [], None
            for future in futures:  # in prompt order; a failure keeps every answer received
                try:
                    answers.append(future.result())
                except ServerError as e:
                    failure = failure or e
                    answers.append(None)
            if check is None and check_model is not None and failure is None:
                n = min(check_prompts, len(batch))
                check = token_check(check_model, batch[:n], answers[:n], client.stop_ids,
                                    tokenizer.eos_token_id if pad_id is None else pad_id, tokenizer, min_agreement)
            for (conv_id, prompt, ids), response in zip(batch, answers, strict=True):
                if response is None:
                    continue
                out.write(json.dumps(distilled_record(tokenizer, conv_id, prompt, ids, response),
                                     ensure_ascii=False) + "\n")
                written += 1
                tokens += len(response)
            out.flush()
            malformed += sum(a is None for a in answers) if failure is None else 0
            if failure is not None:
                raise ServerError(f"{failure}; {written} answers of this run are written to {out_path}, and a rerun "
                                  f"goes on from there")
            elapsed = max(time.monotonic() - start, 1e-9)
            logger.info("distilled %d/%d prompts in %.0f s: %.2f answers/s %.1f answer tokens/s (%d malformed, %d "
                        "retried)", written, len(todo), elapsed, written / elapsed, tokens / elapsed, malformed,
                        client.retried)
            if time_limit_s is not None and elapsed > time_limit_s:
                break
    return {"written": written, "malformed": malformed, "seconds": time.monotonic() - start,
            "answer_tokens": tokens, "check": check}
