"""Verifying drafted tree candidates against the base (pure tensor code).

Medusa report (Cai et al. 2024), sections 2.1.2 and 2.3.1: the heads' top-k tokens are laid out on a tree, the base
scores every tree node in one forward with tree attention, and the longest path whose every token equals the base's
own prediction at its parent is accepted, followed by the base's prediction at the path's last node. With greedy
acceptance the emitted tokens are exactly the base model's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from medusa.tree import TreeBuffers


@dataclass
class Acceptance:
    """Outcome of verifying one tree."""

    accepted: int
    """Draft tokens accepted (0..D); the step emits ``accepted + 1`` tokens."""
    path_nodes: torch.Tensor
    """(accepted + 1,) long: tree node indices of the root and the accepted nodes, in order."""
    next_token: torch.Tensor
    """() long: the base's own prediction after the last accepted node (the bonus token)."""


def greedy_accept(tree_tokens: torch.Tensor, tree_logits: torch.Tensor, buffers: TreeBuffers) -> Acceptance:
    """Accept the longest root-to-leaf prefix on which every token is the base's argmax at its parent.

    Args:
        tree_tokens: ``(N,)`` long node tokens (from :func:`medusa.draft.draft_tree`).
        tree_logits: ``(N, V)`` base logits at every node (node i's logits predict the token after node i).
        buffers: the tree's index tensors.

    Returns:
        The accepted path; ties between equally long paths go to the first leaf (the higher-ranked one).
    """
    predicted = tree_logits.argmax(dim=-1)  # (N,)
    retrieve = buffers.retrieve_index  # (P, D+1)
    valid = retrieve[:, 1:] >= 0  # (P, D)
    child_tokens = tree_tokens[retrieve[:, 1:].clamp_min(0)]  # (P, D)
    parent_preds = predicted[retrieve[:, :-1].clamp_min(0)]  # (P, D)
    match = valid & (child_tokens == parent_preds)  # (P, D)
    lengths = match.long().cumprod(dim=1).sum(dim=1)  # (P,)
    best = int(lengths.argmax())
    accepted = int(lengths[best])
    path_nodes = retrieve[best, : accepted + 1]
    return Acceptance(accepted, path_nodes, predicted[path_nodes[-1]])


def greedy_accept_along_path(tree_tokens: torch.Tensor, next_token_at: Callable[[int], torch.Tensor],
                             buffers: TreeBuffers) -> Acceptance:
    """:func:`greedy_accept` that asks for the base's prediction one node at a time, only along the accepted path.

    The same acceptance rule, but the base's logits are needed at ``accepted + 1`` nodes instead of all N: on a CPU,
    where a one-row lm_head product takes a matrix-vector path about twice as fast as a several-row one, this is
    cheaper than scoring every node at once. The heads' sibling candidates are distinct tokens (one head's top-k), so
    at most one of them matches. A prompt-lookup node may repeat a heads' node (same tokens from the root down):
    such twins hold the same hidden state, so the walk asks the base once for all of them and follows the children
    of every twin; it accepts the longest path of the tree read as a trie of token sequences, never shorter than
    :func:`greedy_accept`'s, at one lm_head row per accepted node.

    Args:
        tree_tokens: ``(N,)`` long node tokens.
        next_token_at: node index -> ``()`` long, the base's greedy next token after that node.
        buffers: the tree's index tensors.

    Returns:
        The accepted path; of twins, the first in ``buffers.children`` order (a lookup node) stands in the path
        (their cached keys and values are the same).
    """
    twins, path = [0], [0]
    while True:
        predicted = next_token_at(twins[0])
        twins = [c for node in twins for c in buffers.children[node] if tree_tokens[c] == predicted]
        if not twins:
            nodes = torch.tensor(path, dtype=torch.long, device=tree_tokens.device)
            return Acceptance(len(path) - 1, nodes, predicted)
        path.append(twins[0])
