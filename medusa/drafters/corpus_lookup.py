"""Corpus lookup: draft tokens copied from a datastore of the base's own earlier answers (retrieval drafting).

REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding", section 3) drafts from a datastore of text: find
the context's longest suffix that occurs in the datastore and propose what most often followed it. Prompt lookup
(:mod:`medusa.drafters.prompt_lookup`) copies from the context alone; a small chat model also repeats itself *across*
answers (greetings, list openers, closing offers of help, the phrasing of its refusals), which neither the context nor
the heads, which read one hidden state, can see. Here the datastore is the base's own greedy answers to training
prompts (``medusa distill``'s ``response_ids``), so its continuations are the base's phrasing, and its proposal is one
more candidate for the per-step tree's copied chain (:mod:`medusa.drafters.per_step`): each step the chain copies from
whichever source's first token the calibration trusts more.

The index is a suffix array of the datastore whose suffixes are sorted by their first ``max_ngram`` tokens, packed
into a few int64 keys, so the suffixes that start with a pattern lie in one range found by ``np.searchsorted`` on the
keys (in C, no Python loop over the datastore); the longest matching suffix of the context is found by a binary search
over its length (a suffix that occurs has every shorter suffix occurring). Within the range the suffixes are sorted by
what follows the pattern, so the continuation is read greedily: at each position, the token that most of the matches
still agreeing so far continue with (ties: the smallest id), the range narrowing to it. The proposal is deterministic
and the same on every machine.

No model call, nothing trained: the cost of a proposal is a few small numpy searches (tens of microseconds).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

CORPUS_FILE_NAME = "lookup_corpus.npz"
"""The datastore's file in a heads folder: its token ids (answers separated by :data:`SEPARATOR`), its measured
acceptance and what it was built and measured from (:meth:`LookupCorpus.save`)."""
CORPUS_FORMAT = 1
SEPARATOR = -1
"""Between two answers of the datastore: no match crosses it and no continuation runs past it."""
DEFAULT_MAX_NGRAM = 8
"""The longest context suffix matched."""
DEFAULT_MAX_LENGTH = 16
"""The longest proposal (the index sorts suffixes by ``max_ngram + max_length`` tokens)."""


class LookupCorpus:
    """A datastore of token sequences and its index for longest-suffix matching (see module docstring).

    Args:
        tokens: ``(N,)`` int ids of the answers, each followed by :data:`SEPARATOR` (the last included).
        max_ngram: the longest suffix matched.
        min_ngram: the shortest suffix that counts as a match.
        max_length: the longest proposal.

    Raises:
        ValueError: empty ``tokens``, an id below :data:`SEPARATOR`, a datastore that does not end with
            :data:`SEPARATOR`, ``min_ngram`` outside ``1..max_ngram``, or ``max_length`` < 1.
    """

    def __init__(self, tokens: np.ndarray, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 2,
                 max_length: int = DEFAULT_MAX_LENGTH):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or len(tokens) < 2:
            raise ValueError(f"a lookup corpus needs a 1-D array of at least one token and its separator, got shape "
                             f"{tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"a lookup corpus holds integer token ids, got dtype {tokens.dtype}")
        if int(tokens.min()) < SEPARATOR or int(tokens[-1]) != SEPARATOR:
            raise ValueError(f"a lookup corpus holds ids >= 0, each answer followed by {SEPARATOR} (the last one "
                             "too)")
        if not 1 <= min_ngram <= max_ngram or max_length < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram and max_length >= 1, got {min_ngram}, {max_ngram} "
                             f"and {max_length}")
        self.tokens = tokens.astype(np.int32)
        self.max_ngram, self.min_ngram, self.max_length = max_ngram, min_ngram, max_length
        size, depth = len(self.tokens), max_ngram + max_length
        self._vocab = int(self.tokens.max()) + 1
        # ids shifted by one (the separator and the padding past the end become 0, below every id), packed
        self._bits = max(self._vocab + 1, 2).bit_length()
        self._per_key = 63 // self._bits
        shifted = np.concatenate([self.tokens.astype(np.int64) + 1, np.zeros(depth, dtype=np.int64)])
        keys = []
        for first in range(0, depth, self._per_key):
            key = np.zeros(size, dtype=np.int64)
            for k in range(first, first + self._per_key):
                key = (key << self._bits) | (shifted[k: k + size] if k < depth else 0)
            keys.append(key)
        self._order = np.lexsort(keys[::-1])  # (N,) suffixes sorted by their first max_ngram + max_length tokens
        self._keys = [key[self._order] for key in keys]  # each (N,), sorted together
        self._shifted = shifted
        self.digest = hashlib.sha256(self.tokens.tobytes()).hexdigest()[:16]
        self.acceptance: list[list[float]] | None = None
        """``(max_ngram + 1, max_length)``: how often the proposal's token j is right given the ones before it
        were, by the matched length m (:meth:`measure`); ``None`` until measured."""
        self.counts: list[list[int]] | None = None
        self.source: dict = {}

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """The range of :attr:`_order` whose suffixes start with ``pattern`` (ids, at most ``max_ngram``)."""
        lo, hi = 0, len(self.tokens)
        top = (1 << self._bits) - 1
        for first in range(0, len(pattern), self._per_key):
            part = [t + 1 for t in pattern[first: first + self._per_key]]
            low = high = 0
            for k in range(self._per_key):
                low = (low << self._bits) | (part[k] if k < len(part) else 0)
                high = (high << self._bits) | (part[k] if k < len(part) else top)
            keys = self._keys[first // self._per_key]
            lo, hi = (lo + int(np.searchsorted(keys[lo:hi], low, "left")),
                      lo + int(np.searchsorted(keys[lo:hi], high, "right")))
            if lo == hi:
                break
        return lo, hi

    @classmethod
    def from_sequences(cls, sequences, **options) -> LookupCorpus:
        """A corpus of ``sequences`` (lists or 1-D tensors of ids >= 0), in order.

        Raises:
            ValueError: no non-empty sequence, or an id < 0.
        """
        parts = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("a lookup corpus needs at least one non-empty sequence")
        if min(int(p.min()) for p in parts) < 0:
            raise ValueError("token ids in a lookup corpus must be >= 0")
        tokens = np.concatenate([np.append(p, SEPARATOR) for p in parts])
        return cls(tokens, **options)

    @classmethod
    def load(cls, path: str | Path) -> LookupCorpus:
        """Read a corpus :meth:`save` wrote (``np.load`` without pickles), its measured acceptance included.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file is not a corpus of this format, or its tables do not fit it (named).
        """
        with np.load(Path(path), allow_pickle=False) as data:
            missing = {"tokens", "meta"} - set(data)
            if missing:
                raise ValueError(f"{path}: a lookup corpus file holds 'tokens' and 'meta', missing {sorted(missing)}")
            meta = json.loads(str(data["meta"]))
            found = meta.get("format") if isinstance(meta, dict) else meta
            if found != CORPUS_FORMAT:
                raise ValueError(f"{path}: lookup corpus format {found!r}, this release reads {CORPUS_FORMAT}")
            corpus = cls(data["tokens"].astype(np.int32), max_ngram=int(meta["max_ngram"]),
                         min_ngram=int(meta["min_ngram"]), max_length=int(meta["max_length"]))
            if "acceptance" in data:
                acceptance, counts = data["acceptance"].astype(np.float64), data["counts"].astype(np.int64)
                if acceptance.shape != (corpus.max_ngram + 1, corpus.max_length) or counts.shape != acceptance.shape:
                    raise ValueError(f"{path}: acceptance table of shape {acceptance.shape} (counts "
                                     f"{counts.shape}), expected {(corpus.max_ngram + 1, corpus.max_length)}")
                if not np.all(np.isfinite(acceptance)) or acceptance.min() < 0 or acceptance.max() > 1:
                    raise ValueError(f"{path}: the acceptance table holds a value outside [0, 1]")
                corpus.acceptance, corpus.counts = acceptance.tolist(), counts.tolist()
        if meta.get("digest") != corpus.digest:
            raise ValueError(f"{path}: the tokens' digest {corpus.digest} differs from the recorded "
                             f"{meta.get('digest')!r}: the file was changed after it was written")
        corpus.source = meta.get("source", {})
        return corpus

    def save(self, path: str | Path) -> Path:
        """Write the token ids, the settings, the digest and (once measured) the acceptance table, compressed and
        atomically (a temporary file renamed over ``path``)."""
        path = Path(path)
        meta = {"format": CORPUS_FORMAT, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram,
                "max_length": self.max_length, "digest": self.digest,
                "sequences": int((self.tokens == SEPARATOR).sum()), "source": self.source}
        arrays = {"tokens": self.tokens, "meta": np.array(json.dumps(meta))}
        if self.acceptance is not None:
            arrays["acceptance"] = np.asarray(self.acceptance, dtype=np.float32)
            arrays["counts"] = np.asarray(self.counts, dtype=np.int64)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
        return path

    def measure(self, sequences: list[tuple[list[int], int]]) -> None:
        """Measure how often the proposal's token j is right given tokens before it were, by the matched length m,
        replaying greedy decoding over the base's own continuations (a validation split, never the frozen sets):
        ``acceptance[m][j]``, shrunk towards the rate of position j over every m where it holds few samples (as the
        prompt-lookup chain's table, :mod:`medusa.drafters.calibration`).

        Args:
            sequences: ``(token ids, response start)`` per sequence: the prompt and the base's greedy answer.

        Raises:
            ValueError: no sequence has a response of at least two tokens.
        """
        rows, cols = self.max_ngram + 1, self.max_length
        hits, counts = np.zeros((rows, cols)), np.zeros((rows, cols))
        positions = 0
        for ids, start in sequences:
            ids = [int(t) for t in ids]
            for i in range(max(start - 1, 0), len(ids) - 2):  # the root is token i + 1, the draft guesses i + 2 on
                draft, m = self.match(ids[: i + 2], cols)
                truth = ids[i + 2: i + 2 + cols]
                for j, token in enumerate(truth):
                    counts[m, j] += 1
                    if draft[j] != token:
                        break
                    hits[m, j] += 1
                positions += 1
        if positions == 0:
            raise ValueError("no sequence has a response of at least two tokens to measure the corpus lookup on")
        pooled = (hits.sum(0) + 1) / (counts.sum(0) + 2)  # (L,) every matched length together
        self.acceptance = ((hits + 2 * pooled) / (counts + 2)).tolist()
        self.counts = counts.astype(np.int64).tolist()
        self.source = {**self.source, "measured_sequences": len(sequences), "measured_positions": positions}

    def __len__(self) -> int:
        return len(self.tokens)

    def match(self, context: list[int], length: int) -> tuple[list[int], int]:
        """Propose ``length`` tokens after ``context`` from the datastore.

        Args:
            context: the ids so far (the prompt and every emitted token, the tree root last); only the last
                ``max_ngram`` are read.
            length: tokens to propose.

        Returns:
            ``(tokens, m)``: the proposal (``length`` ids; where the datastore's continuation ends, its last token
            repeated) and the length m of the matched suffix (0 when no suffix of at least ``min_ngram`` tokens
            occurs: then the last token repeated, which the calibration values near zero).
        """
        tail = [int(t) for t in context[-self.max_ngram:]]
        fallback = [tail[-1] if tail else 0] * length
        if len(tail) < self.min_ngram or not all(0 <= t < self._vocab for t in tail):
            return fallback, 0
        # the longest suffix of the context that occurs and has a token after it: a binary search over its length
        shortest, longest, found = self.min_ngram, len(tail), None
        while shortest <= longest:
            m = (shortest + longest) // 2
            lo, hi = self._range(tail[-m:])
            if lo < hi and self._shifted[self._order[hi - 1] + m] > 0:  # sorted: the last has the largest next id
                found, shortest = (m, lo, hi), m + 1
            else:
                longest = m - 1
        if found is None:
            return fallback, 0
        matched, lo, hi = found
        out: list[int] = []
        stop = matched + min(length, self.max_length)
        for j in range(matched, stop):
            if hi - lo == 1:  # one match left: the rest of its answer, up to its end
                start = int(self._order[lo])
                rest = self._shifted[start + j: start + stop]
                ends = np.flatnonzero(rest == 0)
                out.extend((rest[: ends[0]] if len(ends) else rest) - 1)
                break
            first, last = self._shifted[self._order[lo] + j], self._shifted[self._order[hi - 1] + j]
            if first == last:  # sorted: every match continues alike
                if first == 0:
                    break
                out.append(int(first) - 1)
                continue
            column = self._shifted[self._order[lo:hi] + j]  # sorted: the suffixes agree up to j
            ends = np.flatnonzero(column[1:] != column[:-1]) + 1
            bounds = np.concatenate([[0], ends, [len(column)]])
            runs = np.diff(bounds)
            runs[column[bounds[:-1]] == 0] = 0  # a separator continues nothing
            best = int(np.argmax(runs))
            if runs[best] == 0:
                break
            out.append(int(column[bounds[best]]) - 1)
            lo, hi = lo + int(bounds[best]), lo + int(bounds[best + 1])
        out = [int(t) for t in out]
        return out + [out[-1]] * (length - len(out)), matched

    def match_tensor(self, sequence: torch.Tensor, length: int) -> tuple[torch.Tensor, int]:
        """:meth:`match` on a 1-D tensor of ids; the proposal as a long tensor on its device."""
        tokens, m = self.match(sequence[-self.max_ngram:].tolist(), length)
        return torch.tensor(tokens, dtype=torch.long, device=sequence.device), m


def load_corpus_for(path: str | Path, vocab_size: int) -> LookupCorpus:
    """:meth:`LookupCorpus.load`, refused unless its acceptance was measured and its ids fit a base of
    ``vocab_size`` tokens.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a damaged or unmeasured corpus, or one holding an id >= ``vocab_size`` (another base's).
    """
    corpus = LookupCorpus.load(path)
    if corpus.acceptance is None:
        raise ValueError(f"{path}: the lookup corpus has no measured acceptance: measure it with `medusa calibrate "
                         "--lookup-corpus` before decoding with it")
    if int(corpus.tokens.max()) >= vocab_size:
        raise ValueError(f"{path}: token id {int(corpus.tokens.max())} is beyond the base's vocabulary of "
                         f"{vocab_size}: a corpus of another base")
    return corpus
