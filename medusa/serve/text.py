"""Token ids to streamed text: incremental detokenisation that never splits a multi-byte character, and stop
strings matched across token boundaries, a partial match held back until it is resolved."""

from __future__ import annotations

REPLACEMENT = "\ufffd"
"""What a tokenizer decodes the bytes of an incomplete UTF-8 character to."""


def decode(tokenizer, ids: list[int]) -> str:
    """The text of ``ids`` as the server sends it: special tokens skipped, no clean-up of spaces (so that the text
    of a longer sequence always extends the text of its prefix)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class TextStream:
    """Token ids in, text pieces out, for one request.

    Each :meth:`add` returns the text that is safe to send: trailing replacement characters (an incomplete UTF-8
    character whose remaining bytes come with the next tokens) and any tail that could be the start of a stop string
    are held back. When a stop string appears, the text ends just before it and :attr:`stopped` is set.

    Args:
        tokenizer: a transformers tokenizer.
        stop: stop strings (non-empty).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer, self.stop = tokenizer, list(stop or [])
        self.ids: list[int] = []
        self.sent = 0
        """Characters of the text sent so far."""
        self.stopped = False
        """A stop string was found: the text is final."""
        self.tokens_at_stop: int | None = None
        """Tokens decoded when the stop string appeared."""

    def add(self, ids: list[int]) -> str:
        """Take new token ids; return the new text that may be sent (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = decode(self.tokenizer, self.ids)
        stable = text.rstrip(REPLACEMENT)
        cut = self._stop_at(stable)
        if cut is not None:
            self.stopped, self.tokens_at_stop = True, len(self.ids)
            return self._send(stable, cut)
        return self._send(stable, len(stable) - self._partial_stop(stable))

    def finish(self) -> str:
        """The rest of the text at the end of generation: what was held back (an unresolved partial stop string,
        replacement characters that no further byte will complete)."""
        if self.stopped:
            return ""
        text = decode(self.tokenizer, self.ids)
        cut = self._stop_at(text)
        self.stopped = cut is not None
        return self._send(text, len(text) if cut is None else cut)

    def _send(self, text: str, end: int) -> str:
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string starts in the unsent text, or ``None``."""
        found = [i for s in self.stop if (i := text.find(s, self.sent)) >= 0]
        return min(found) if found else None

    def _partial_stop(self, text: str) -> int:
        """Length of the longest unsent tail of ``text`` that a stop string starts with."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text) - self.sent), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest


# -- user text in ---------------------------------------------------------------------------------------------------
def special_strings(tokenizer) -> list[str]:
    """The text of every special token of ``tokenizer`` (named roles and added special tokens)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return sorted({*tokenizer.all_special_tokens, *(t.content for t in added.values() if t.special)} - {""})


def text_ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` as text: a special token's string inside it (``<|im_start|>``) is split into ordinary
    tokens, never read as the control token. ``add_special_tokens``: the tokenizer's own BOS/EOS, as it adds them."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"])


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat's generation prompt (:func:`medusa.base.chat_prompt_ids`), where only the chat template
    places control tokens: special tokens' strings in the messages' content are tokenized as text, so that a user
    cannot forge a system or assistant turn. Without such strings the ids are exactly ``chat_prompt_ids``'.

    Raises:
        ValueError: the content holds special tokens' strings and the template does not insert the content
            verbatim (it edits or repeats it), so it cannot be kept apart from the template's text.
    """
    from medusa.base import chat_prompt_ids, render_plain_chat

    specials = special_strings(tokenizer)
    if not any(s in m["content"] for m in messages for s in specials):
        return chat_prompt_ids(tokenizer, messages)
    templated = bool(getattr(tokenizer, "chat_template", None))

    def render(contents: list[str]) -> str:
        chat = [m | {"content": c} for m, c in zip(messages, contents, strict=True)]
        if templated:
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return render_plain_chat(chat, add_generation_prompt=True)[0]

    import secrets

    marks = [f"MEDUSA{secrets.token_hex(8)}MARK{i}" for i in range(len(messages))]
    marked, parts = render(marks), []
    for mark in marks:
        before, found, marked = marked.partition(mark)
        if not found or mark in marked:
            raise ValueError("the messages hold special tokens' text and the chat template does not insert each "
                             "message's content once, verbatim: it cannot be kept as text")
        parts.append(before)
    parts.append(marked)
    real = render([m["content"] for m in messages])
    for contents in ([m["content"] for m in messages], [m["content"].strip() for m in messages]):
        if "".join(p + c for p, c in zip(parts, [*contents, ""], strict=True)) == real:
            break
    else:
        raise ValueError("the messages hold special tokens' text and the chat template edits the content: it "
                         "cannot be kept as text")
    prefix = [] if templated else text_ids(tokenizer, "")  # the tokenizer's own BOS, as chat_prompt_ids gets it
    ids = list(prefix)
    for part, content in zip(parts, [*contents, ""], strict=True):
        ids += tokenizer(part, add_special_tokens=False)["input_ids"]  # the template's text: its control tokens
        ids += text_ids(tokenizer, content, add_special_tokens=False)
    return ids
