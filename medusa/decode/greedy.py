"""Greedy acceptance of a drafted tree: the one implementation, vectorised or walked (pure tensor code).

Medusa report (Cai et al. 2024), sections 2.1.2 and 2.3.1: the drafts are laid out on a tree, the base scores every
tree node in one forward with tree attention, and the longest path whose every token equals the base's own
prediction at its parent is accepted, followed by the base's prediction at the path's last node (the bonus token).
The emitted tokens are exactly the base model's greedy tokens.

Twins: two nodes holding the same tokens from the root down (a prompt-lookup node repeating a heads' node, two
drafters proposing the same continuation) see the same context, so the base predicts the same token after both.
The accepted path is the longest one of the tree read as a trie of token sequences: below a node, the children of
all its twins count. Of twins, the first in the layout's walk order (``TreeBuffers.walk_rank``: breadth first,
children in ``TreeBuffers.children`` order) stands for all of them, gives the prediction, and is the node kept.

Two ways to the same answer, chosen by where the base's logits come from (:attr:`medusa.engines.Engine.
scores_all_nodes`):
- :func:`greedy_paths`: the base's prediction at every node is known (one lm_head product over all nodes); the path
  is found with tensor operations only, for a batch of rows at once (no host sync per node on a GPU).
- :func:`greedy_walk`: the prediction is asked for one node at a time, only along the accepted path (one lm_head row
  per accepted node per row: cheaper on a CPU, where the one-row product takes a matrix-vector kernel). The walk
  itself is a loop over plain ints on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from medusa.decode.tree import TreeBuffers


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: ``(..., V)`` -> ``(...)`` long, the first index of each row's largest value (a NaN
    counting as the largest, as torch does). On a CPU, for float32 logits without a gradient, through numpy's argmax,
    which is about ten times faster than torch's on one row of a large vocabulary (about 4 us against 40 us for 49,152
    logits here); the same indices (tested equal, ties and NaN included). Tensor subclasses and negated views go
    through torch."""
    if (type(logits) is torch.Tensor and logits.device.type == "cpu" and logits.dtype == torch.float32
            and not logits.requires_grad and logits.ndim >= 1 and logits.shape[-1] > 0 and not logits.is_neg()):
        return torch.from_numpy(np.ascontiguousarray(np.argmax(logits.detach().numpy(), axis=-1),
                                                     dtype=np.int64).reshape(logits.shape[:-1]))
    return logits.argmax(dim=-1)


@dataclass
class Acceptance:
    """Outcome of verifying one tree."""

    accepted: int
    """Draft tokens accepted (0..D); the step emits ``accepted + 1`` tokens."""
    path_nodes: torch.Tensor
    """(accepted + 1,) long: tree node indices of the root and the accepted nodes, in order. Of twins one stands
    for all, so a node's predecessor here may be a twin of its parent rather than its parent."""
    next_token: torch.Tensor
    """() long: the base's own prediction after the last accepted node (the bonus token)."""


def twin_representatives(tokens: torch.Tensor, layout: TreeBuffers) -> torch.Tensor:
    """Each node's stand-in among its twins (nodes with the same tokens from the root down, see module docstring).

    Args:
        tokens: ``(B, N)`` long node tokens per row.

    Returns:
        ``(B, N)`` long: the twin with the lowest ``walk_rank`` (a node without twins stands for itself).
    """
    depth, paths = layout.depth, layout.node_paths  # (N,), (N, D+1)
    below = torch.arange(paths.shape[1], device=tokens.device)[None, :] <= depth[:, None]  # (N, D+1)
    path_tokens = torch.where(below, tokens[:, paths], -1)  # (B, N, D+1) tokens root..node, -1 past the node
    twins = (path_tokens[:, :, None, :] == path_tokens[:, None, :, :]).all(dim=-1)  # (B, N, N)
    rank = torch.where(twins, layout.walk_rank[None, None, :], len(depth))  # (B, N, N)
    return rank.argmin(dim=-1)  # (B, N)


def greedy_paths(tokens: torch.Tensor, predicted: torch.Tensor, layout: TreeBuffers
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance for every row at once, from the base's prediction at every node.

    Args:
        tokens: ``(B, N)`` long node tokens per row.
        predicted: ``(B, N)`` long, the base's greedy next token after each node.
        layout: the tree's layout.

    Returns:
        ``(paths (B, D+1), accepted (B,))``: per row the node indices kept, root first (-1 past the last accepted
        node), and how many drafts are accepted. The bonus token is ``predicted`` at the last kept node.
    """
    rep = twin_representatives(tokens, layout)  # (B, N)
    parent = layout.parents.clamp_min(0)  # (N,)
    at_parent = predicted.gather(1, rep[:, parent])  # (B, N) the prediction the node's token is checked against
    match = tokens == at_parent  # (B, N)
    match[:, 0] = True
    below = torch.arange(layout.node_paths.shape[1], device=tokens.device)[None, :] <= layout.depth[:, None]
    reached = (match[:, layout.node_paths] | ~below).all(dim=-1)  # (B, N): every node from the root down matches
    accepted = torch.where(reached, layout.depth, -1).amax(dim=1)  # (B,)
    # At each depth the reached nodes are one class of twins: keep the one first in walk order.
    levels = torch.arange(layout.node_paths.shape[1], device=tokens.device)  # (D+1,)
    at_level = reached[:, None, :] & (layout.depth[None, None, :] == levels[None, :, None])  # (B, D+1, N)
    rank = torch.where(at_level, layout.walk_rank, len(layout.depth))  # (B, D+1, N)
    paths = rank.argmin(dim=-1)  # (B, D+1)
    paths = paths.masked_fill(levels[None, :] > accepted[:, None], -1)
    return paths, accepted


def greedy_accept(tree_tokens: torch.Tensor, predicted: torch.Tensor, layout: TreeBuffers) -> Acceptance:
    """Greedy acceptance of one tree from the base's prediction at every node: ``tree_tokens`` ``(N,)``,
    ``predicted`` ``(N,)`` long (or ``(N, V)`` logits, whose argmax is taken).

    On an accelerator :func:`greedy_paths` (tensor operations, one host sync for the accepted count); on a CPU,
    where each small tensor operation costs more than a loop over a few ints, the same rule as :func:`greedy_walk`
    over plain lists (tested equal).
    """
    if predicted.ndim == 2:
        predicted = argmax_rows(predicted)  # (N,)
    if predicted.device.type == "cpu":
        want = predicted.tolist()
        (path,), (bonus,) = _walk([tree_tokens.tolist()], lambda rows, nodes: [want[n] for n in nodes], layout)
        return Acceptance(len(path) - 1, torch.tensor(path, dtype=torch.long), predicted[path[-1]])
    paths, accepted = greedy_paths(tree_tokens[None], predicted[None], layout)
    count = int(accepted[0])
    path = paths[0, : count + 1]
    return Acceptance(count, path, predicted[path[-1]])


# (rows (R,), nodes (R,)) -> (R,) long: the base's greedy next token after each of those nodes.
NextTokens = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _walk(tokens: list[list[int]], predict: Callable[[list[int], list[int]], list[int]], layout: TreeBuffers
          ) -> tuple[list[list[int]], list[int]]:
    """The walk on plain lists: per row, the reached twins (a list in walk order, see the module docstring) go one
    level down at a time; ``predict(rows, nodes)`` gives the base's token after each row's first twin. Returns the
    kept nodes per row (root first) and each row's bonus token."""
    children = layout.children
    twins = [[0] for _ in tokens]
    paths = [[0] for _ in tokens]
    bonus = [0] * len(tokens)
    active = list(range(len(tokens)))
    while active:
        predicted = predict(active, [twins[b][0] for b in active])
        still = []
        for b, want in zip(active, predicted, strict=True):
            row = tokens[b]
            below = [c for node in twins[b] for c in children[node] if row[c] == want]
            if below:
                twins[b] = below
                paths[b].append(below[0])
                still.append(b)
            else:
                bonus[b] = want
        active = still
    return paths, bonus


def greedy_walk(tokens: torch.Tensor, next_tokens_at: NextTokens, layout: TreeBuffers
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`greedy_paths`, asking for the base's prediction only along each row's accepted path.

    One call of ``next_tokens_at`` per tree level, for the rows whose path still matches, at the node standing for
    the reached twins (see module docstring); the walk itself runs on the host.

    Args:
        tokens: ``(B, N)`` long node tokens per row.
        next_tokens_at: the base's prediction at given ``(row, node)`` pairs (see :data:`NextTokens`).
        layout: the tree's layout.

    Returns:
        ``(paths (B, D+1), accepted (B,), next_tokens (B,))``: as :func:`greedy_paths`, and each row's bonus token.
    """
    device = tokens.device

    def predict(rows: list[int], nodes: list[int]) -> list[int]:
        return next_tokens_at(torch.tensor(rows, device=device), torch.tensor(nodes, device=device)).tolist()

    kept, bonus = _walk(tokens.tolist(), predict, layout)
    paths = torch.full((len(kept), layout.node_paths.shape[1]), -1, dtype=torch.long)  # (B, D+1)
    for b, path in enumerate(kept):
        paths[b, : len(path)] = torch.tensor(path)
    accepted = torch.tensor([len(p) - 1 for p in kept], dtype=torch.long)
    return paths.to(device), accepted.to(device), torch.tensor(bonus, dtype=torch.long, device=device)


def greedy_accept_along_path(tree_tokens: torch.Tensor, next_token_at: Callable[[int], torch.Tensor],
                             layout: TreeBuffers) -> Acceptance:
    """The walk for one tree: ``next_token_at(node) -> ()`` long asks for one node's prediction."""
    asked: list[torch.Tensor] = []

    def predict(rows: list[int], nodes: list[int]) -> list[int]:
        asked.append(next_token_at(nodes[0]))
        return [int(asked[-1])]

    (path,), _ = _walk([tree_tokens.tolist()], predict, layout)
    return Acceptance(len(path) - 1, torch.tensor(path, dtype=torch.long, device=tree_tokens.device), asked[-1])
