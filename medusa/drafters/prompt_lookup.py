"""Prompt lookup: draft tokens copied from the context (pure tensor code).

Prompt lookup decoding (Saxena 2023; Hugging Face's ``prompt_lookup_num_tokens``, vLLM's n-gram proposer): find the
latest earlier occurrence of the context's last n tokens and propose the tokens that followed it. A small chat model
repeats its prompt and its own answer often (names, code, lists, phrasing), and its Medusa heads, which read one
hidden state and the tokens after it, cannot see that context. Here the copied tokens are one more branch of the
candidate tree (:class:`medusa.decode.tree.Tree` ``lookup_length``), a chain from the root verified in the same
forward as the heads' nodes, so a step accepts whichever branch the base agrees with for longer. It costs no model
call; its price is the chain's tokens in the verify forward.
"""

from __future__ import annotations

import torch

from medusa.decode.tree import Tree, tree_buffers
from medusa.drafters.base import DraftTree, register_drafter


def lookup_draft(sequence: torch.Tensor, length: int, max_ngram: int = 3) -> torch.Tensor:
    """Propose the ``length`` tokens that follow the context, copied from the context itself.

    The pattern is the context's last n tokens, n from ``max_ngram`` down to 1; the first n with an earlier
    occurrence (the latest one) wins, and the tokens after that occurrence are proposed. Where the copy runs into the
    end of the context it continues with its own proposal (a repeated span keeps repeating). Without any match (the
    last token is new) the last token is proposed ``length`` times: a fixed-shape tree needs tokens there, and the
    base will simply reject them.

    Args:
        sequence: ``(S,)`` long, the prompt and every emitted token, the tree root (the base's latest token) last.
        length: tokens to propose.
        max_ngram: longest pattern tried.

    Returns:
        ``(length,)`` long token ids, on ``sequence``'s device.

    Raises:
        ValueError: ``sequence`` is empty or not 1-D, or ``length`` < 0 or ``max_ngram`` < 1.
    """
    return lookup_match(sequence, length, max_ngram)[0]


def lookup_match(sequence: torch.Tensor, length: int, max_ngram: int = 3) -> tuple[torch.Tensor, int]:
    """:func:`lookup_draft` and the length n of the n-gram that matched (0: none; what the per-step tree's
    calibration of the chain is indexed by, :mod:`medusa.drafters.calibration`).

    Returns:
        ``(tokens (length,), n)``.

    Raises:
        ValueError: as :func:`lookup_draft`.
    """
    if sequence.ndim != 1 or len(sequence) == 0:
        raise ValueError(f"sequence must be a non-empty 1-D tensor of token ids, got shape {tuple(sequence.shape)}")
    if length < 0 or max_ngram < 1:
        raise ValueError(f"length must be >= 0 and max_ngram >= 1, got {length} and {max_ngram}")
    size = len(sequence)
    if sequence.device.type == "cpu" and length > 0:
        return _lookup_match_cpu(sequence, length, max_ngram)
    out = sequence.new_full((length,), int(sequence[-1]))
    if length == 0:
        return out, 0
    for n in range(min(max_ngram, size - 1), 0, -1):
        windows = sequence[: size - 1].unfold(0, n, 1)  # (size - n, n): windows with at least one token after them
        hits = (windows == sequence[size - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[-1]) + n  # first copied position
            period = size - start  # the copy repeats with this period once it reaches the end of the context
            copied = sequence[start:]
            reps = -(-length // period)
            return copied.repeat(reps)[:length], n
    return out, 0


def _lookup_match_cpu(sequence: torch.Tensor, length: int, max_ngram: int) -> tuple[torch.Tensor, int]:
    """:func:`lookup_match` on a CPU tensor, by a byte search over the ids' 8-byte words (a few microseconds where the
    tensor calls take about 0.1 ms): the last match of the final n-gram that ends before the last token, longest n
    first. The same tokens and n."""
    ids = sequence.to(torch.int64)
    data, size = ids.numpy().tobytes(), len(ids)
    word = 8
    for n in range(min(max_ngram, size - 1), 0, -1):
        pattern, end = data[(size - n) * word:], (size - 1) * word  # windows with at least one token after them
        found = data.rfind(pattern, 0, end)
        while found >= 0 and found % word:  # a match must start at a token's first byte
            found = data.rfind(pattern, 0, found + len(pattern) - 1)
        if found >= 0:
            start = found // word + n  # first copied position
            copied = sequence[start:].tolist()
            reps = -(-length // len(copied))
            return torch.tensor((copied * reps)[:length], dtype=sequence.dtype), n
    return sequence.new_full((length,), int(sequence[-1])), 0


@register_drafter("lookup")
class PromptLookupDrafter:
    """Prompt lookup as a drafter: a chain of ``length`` tokens copied from the context (:func:`lookup_draft`),
    deterministic (q is one-hot), no model call, no state, nothing trained or saved: its settings live in the tree
    file (``prompt_lookup``, :mod:`medusa.decode.tree`).

    Raises:
        ValueError: ``length`` < 1 or ``max_ngram`` < 1.
    """

    trainable = False
    training_objective = None

    def __init__(self, length: int, max_ngram: int = 3):
        if length < 1 or max_ngram < 1:
            raise ValueError(f"prompt lookup needs length >= 1 and max_ngram >= 1, got {length} and {max_ngram}")
        self.length, self.max_ngram = length, max_ngram
        self.max_nodes, self.max_depth = length + 1, length
        self.base_layers = ()
        self._layouts: dict[torch.device, tuple] = {}

    def _layout(self, device: torch.device):
        if device not in self._layouts:
            layout = tree_buffers(Tree((), "lookup", self.length, self.max_ngram), device)
            self._layouts[device] = (layout, torch.arange(1, self.length + 1, device=device))
        return self._layouts[device]

    def new_state(self) -> None:
        return None

    def start(self, state, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        pass

    def propose(self, state, root: torch.Tensor, sequence: torch.Tensor, sampler) -> DraftTree:
        layout, chain = self._layout(root.device)
        tokens = torch.cat([root[None], lookup_draft(sequence, self.length, self.max_ngram)])  # (L+1,)
        return DraftTree(tokens, layout, copied=chain)

    def update(self, state, draft: DraftTree, path: torch.Tensor, hidden: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        pass
