"""Prompt prefixes kept for the next prompts that start alike (automatic prefix caching, as serving engines call it).

Chat requests share their first tokens: the chat template's system turn and role markers (SmolLM2's default system
turn and the user marker are 24 tokens, a third of a short prompt), and a conversation's next turn repeats the whole
of the last prompt. :class:`PrefixStore` keeps, per prefilled prompt, a copy of its keys and values
(:meth:`medusa.engines.Engine.prefix_snapshot`) and the drafter's states of its positions; a later prompt that starts
with the same tokens gets them copied into its fresh cache (:meth:`medusa.engines.Engine.restore_prefix`) and is
prefilled from there (:meth:`medusa.decode.loop.RunningBatch.begin`).

Exact, not approximate: an engine gives a snapshot only where a token's keys, values and logits come out bit for bit
the same however its prompt is cut into forwards (the C forwards, whose products and attention are each token's
own); the others give none, and nothing is reused through them. A snapshot names the engine's build of the weights
it was made with, so one made before the weights changed is never restored (checked again at the prompt's first
forward), and a cache that another build or a ``static`` forward wrote any position of gives none. A weight edited
through ``.data`` is not seen (as by the engine itself) until ``engine.refresh(force=True)`` makes a new build.

The idea is the serving engines' (vLLM's automatic prefix caching over PagedAttention's blocks, Kwon et al. 2023;
SGLang's RadixAttention, Zheng et al. 2024), kept small here: whole prompts, a linear scan for the longest shared
prefix, and exactness instead of reuse through every engine.

Bounded: the copies' bytes stay within ``budget_bytes``; the least recently used entries go first, and an entry
whose tokens begin a newer one's is dropped (the newer one covers it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    """One prefilled prompt's reusable part."""

    tokens: torch.Tensor
    """``(T,)`` long: the prompt's first ``T`` tokens (CPU)."""
    snapshot: object
    """The engine's copy of those positions' keys and values (:meth:`medusa.engines.Engine.prefix_snapshot`)."""
    states: torch.Tensor
    """``(T, ...)``: what the drafter read of those positions (:func:`medusa.decode.loop.base_forward`'s states)."""
    nbytes: int


class PrefixStore:
    """Snapshots of prefilled prompts, looked up by their longest common prefix with a new prompt.

    Args:
        budget_bytes: the most bytes of keys, values and states kept (the snapshots' own ``nbytes``).
        min_tokens: the fewest shared tokens worth a copy.
        max_tokens: the most leading tokens of a prompt kept (a longer prompt keeps its first ``max_tokens``).

    Raises:
        ValueError: a budget below 0 or not finite, ``min_tokens`` below 1 or ``max_tokens`` below ``min_tokens``.
    """

    def __init__(self, budget_bytes: int, min_tokens: int = 8, max_tokens: int = 1024):
        if not 0 <= budget_bytes < float("inf") or min_tokens < 1 or max_tokens < min_tokens:  # NaN refused too
            raise ValueError(f"a prefix store takes a finite budget_bytes >= 0 and 1 <= min_tokens <= max_tokens, got "
                             f"{budget_bytes}, {min_tokens}, {max_tokens}")
        self.budget_bytes, self.min_tokens, self.max_tokens = budget_bytes, min_tokens, max_tokens
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # least recently used first
        self._next = 0
        self.nbytes = 0
        """Bytes held now (a plain int, kept as entries come and go: other threads may read it)."""
        self.hits = 0
        """Prompts that started from a kept prefix."""
        self.reused_tokens = 0
        """Prompt tokens not prefilled again, summed over the hits."""

    def find(self, prompt: torch.Tensor) -> tuple[int, PrefixEntry | None]:
        """The entry sharing the most leading tokens with ``prompt`` ``(T,)`` and how many it shares, at most
        ``T - 1`` (the prompt's last position is always prefilled: its logits choose the first token); ``(0, None)``
        below ``min_tokens``. The entry found becomes the most recently used."""
        prompt = prompt.cpu()
        best, best_key, limit = 0, None, len(prompt) - 1
        for key, entry in self.entries.items():
            n = min(len(entry.tokens), limit)
            if n < self.min_tokens or n <= best:
                continue
            differ = (entry.tokens[:n] != prompt[:n]).nonzero()
            shared = n if len(differ) == 0 else int(differ[0])
            if shared > best:
                best, best_key = shared, key
        if best < self.min_tokens:
            return 0, None
        self.entries.move_to_end(best_key)
        return best, self.entries[best_key]

    def discard(self, entry: PrefixEntry) -> None:
        """Drop ``entry`` (one its engine no longer restores: the weights changed since)."""
        for key, e in list(self.entries.items()):
            if e is entry:
                self._drop(key)

    def add(self, prompt: torch.Tensor, snapshot, states: torch.Tensor) -> bool:
        """Keep ``prompt``'s first ``min(T, max_tokens)`` positions: ``snapshot`` of those keys and values (``None``:
        the engine cannot promise exact reuse, nothing kept) and the drafter's ``states`` ``(T', ...)`` of at least
        those positions. Entries that ``prompt`` begins with are dropped, then the least recently used until the
        budget holds. Returns whether it was kept (not when ``None``, shorter than ``min_tokens`` or alone over the
        budget)."""
        if snapshot is None:
            return False
        length = min(len(prompt), self.max_tokens, snapshot.length)
        if length < self.min_tokens:
            return False
        tokens = prompt[:length].cpu().clone()
        states = states[:length].clone()
        nbytes = int(snapshot.nbytes) + states.numel() * states.element_size()
        if nbytes > self.budget_bytes:
            return False
        covered = [key for key, e in self.entries.items()
                   if len(e.tokens) <= length and torch.equal(e.tokens, tokens[: len(e.tokens)])]
        for key in covered:
            self._drop(key)
        while self.entries and self.nbytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self.entries)))
        self.entries[self._next] = PrefixEntry(tokens, snapshot, states, nbytes)
        self.nbytes += nbytes
        self._next += 1
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    def clear(self) -> None:
        """Drop every entry."""
        self.entries.clear()
        self.nbytes = 0
