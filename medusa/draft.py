"""Drafting a candidate tree from the heads, one level at a time (pure tensor code).

Level d holds the nodes at depth d + 1. Their tokens are the top candidates of head d at each depth-d node that has
children (its parent): for Medusa heads the same distribution at every parent (a head reads only the hidden state,
Medusa report, Cai et al. 2024, section 2.1.2); for Hydra heads the distribution of head d given the tokens on the
path from the root down to that parent (Ankner et al. 2024, section 3). Every parent of a level goes into one
batched head call, so a tree of depth D costs D head calls whatever its width.

How the candidates are chosen from a parent's distribution is a function passed in: the top-k for greedy decoding,
or a sample without replacement for speculative sampling.

A tree with a prompt-lookup chain gets that chain's tokens from the context
(:func:`medusa.prompt_lookup.lookup_draft`), not from the heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from medusa.prompt_lookup import lookup_draft
from medusa.tree import TreeBuffers

# (logits (P, Vh), k) -> (P, k) head-vocabulary ids, one row of candidates per parent.
Chooser = Callable[[torch.Tensor, int], torch.Tensor]


def top_k_candidates(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The greedy chooser: each parent's ``k`` most likely head-vocabulary ids, best first. ``(P, Vh) -> (P, k)``."""
    return logits.topk(k, dim=-1).indices


@dataclass
class Draft:
    """A drafted tree."""

    tokens: torch.Tensor
    """(N,) long base token ids of every node; node 0 is the root (the base's own last token)."""
    level_logits: list[torch.Tensor]
    """Per level d: ``(P_d, Vh)`` head d's logits at the level's parents (``buffers.level_parents[d]``)."""
    level_candidates: list[torch.Tensor]
    """Per level d: ``(P_d, k_d)`` the head-vocabulary ids chosen at each parent, in rank order."""


def draft_tree(heads, hidden: torch.Tensor, root: torch.Tensor, buffers: TreeBuffers,
               choose: Chooser = top_k_candidates, sequence: torch.Tensor | None = None) -> Draft:
    """Fill every tree node with a drafted token, level by level.

    Args:
        heads: :class:`medusa.heads.MedusaHeads` or :class:`medusa.heads.HydraHeads` (anything with
            ``draft_logits(k, hidden, path_tokens)`` and ``to_base_ids``).
        hidden: ``(H,)`` the base's last hidden state at the last accepted position t.
        root: ``()`` long, the base's own next token t+1 (the tree root, not yet in the cache).
        buffers: the tree's index tensors (:func:`medusa.tree.tree_buffers`).
        choose: picks ``k`` candidates per parent from head logits (:func:`top_k_candidates` for greedy).
        sequence: ``(S,)`` long, the prompt and every emitted token, ``root`` last: what the lookup chain copies
            from. Needed only when the tree has one.

    Returns:
        The :class:`Draft`: node tokens and, per heads' level, the logits and candidates they came from.

    Raises:
        ValueError: the tree has a lookup chain and no ``sequence`` is given.
    """
    tokens = torch.empty(len(buffers.depth), dtype=torch.long, device=root.device)  # (N,)
    tokens[0] = root
    level_logits, level_candidates = [], []
    for d, parents in enumerate(buffers.level_parents):
        paths = tokens[buffers.node_paths[parents, : d + 1]]  # (P_d, d+1): root .. parent
        logits = heads.draft_logits(d, hidden, paths)  # (P_d, Vh)
        candidates = choose(logits, buffers.level_top_k[d])  # (P_d, k_d)
        picked = candidates[buffers.child_slot[d], buffers.child_rank[d]]  # (C_d,)
        tokens[buffers.level_children[d]] = heads.to_base_ids(picked)
        level_logits.append(logits)
        level_candidates.append(candidates)
    lookup = buffers.lookup_nodes
    if lookup is not None and len(lookup):
        if sequence is None:
            raise ValueError("the tree has a prompt-lookup chain: drafting it needs the context (sequence=)")
        tokens[lookup] = lookup_draft(sequence, len(lookup), buffers.lookup_max_ngram)
    return Draft(tokens, level_logits, level_candidates)
