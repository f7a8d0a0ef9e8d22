"""Medusa and Hydra heads as a drafter: the tree drafted from the heads, one level at a time (pure tensor code).

Level d holds the nodes at depth d + 1. Their tokens are candidates of head d at each depth-d node that has children
(its parent): for Medusa heads the same distribution at every parent (a head reads only the hidden state, Medusa
report, Cai et al. 2024, section 2.1.2); for Hydra heads the distribution of head d given the tokens on the path from
the root down to that parent (Ankner et al. 2024, section 3). Every parent of a level goes into one batched head
call, so a tree of depth D costs D head calls whatever its width.

How the candidates are drawn from a parent's distribution is the acceptance rule's
:class:`medusa.drafters.base.DraftSampler`: the top-k for greedy decoding, a sample without replacement for
speculative sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decode.tree import Tree, TreeBuffers, tree_buffers
from medusa.drafters.base import DraftSampler, DraftTree, Draws, TopK, register_drafter


def draft_tree(heads, hidden: torch.Tensor, root: torch.Tensor, layout: TreeBuffers,
               sampler: DraftSampler | None = None, vocab: torch.Tensor | None = None) -> DraftTree:
    """Fill every heads' node of ``layout`` with a drafted token, level by level.

    Args:
        heads: :class:`medusa.drafters.heads.MedusaHeads` or :class:`medusa.drafters.heads.HydraHeads` (anything with
            ``draft_logits(k, hidden, path_tokens)`` and ``to_base_ids``).
        hidden: ``(H,)`` the heads' drafting input at the last accepted position t (the base's last hidden state, or
            what the heads' own attention layer made of it).
        root: ``()`` long, the base's own next token t+1 (the tree root, not yet in the cache).
        layout: a heads' tree layout (:func:`medusa.decode.tree.tree_buffers` of a tree without a lookup chain).
        sampler: draws ``k`` candidates per parent (default :class:`medusa.drafters.base.TopK`).
        vocab: ``(Vh,)`` base ids of the head vocabulary (default: ``heads.to_base_ids`` of every head id).

    Returns:
        The :class:`medusa.drafters.base.DraftTree`: node tokens and, per level, where its candidates came from.
    """
    sampler = sampler or TopK()
    tokens = torch.empty(len(layout.depth), dtype=torch.long, device=root.device)  # (N,)
    tokens[0] = root
    draws = []
    for d, parents in enumerate(layout.level_parents):
        paths = tokens[layout.node_paths[parents, : d + 1]]  # (P_d, d+1): root .. parent
        logits = heads.draft_logits(d, hidden, paths)  # (P_d, Vh)
        if vocab is None:
            vocab = heads.to_base_ids(torch.arange(logits.shape[-1], device=root.device))  # (Vh,)
        candidates, q = sampler.draw(logits, layout.level_top_k[d])  # (P_d, k_d), (P_d, Vh) or None
        picked = candidates[layout.child_slot[d], layout.child_rank[d]]  # (C_d,)
        tokens[layout.level_children[d]] = heads.to_base_ids(picked)
        draws.append(Draws(parents, logits, candidates, layout.level_children[d], layout.child_slot[d],
                           layout.child_rank[d], q, vocab))
    return DraftTree(tokens, layout, draws)


@dataclass
class HeadsState:
    """One sequence's drafting state: the heads' own context (their attention layer's cache, if any) and the
    drafting input it gives."""

    context: object
    hidden: torch.Tensor | None = None
    """``(H,)`` what the next tree is drafted from."""


@register_drafter("heads")
class HeadsDrafter:
    """Medusa or Hydra heads proposing the nodes of a fixed tree of ranks (:class:`medusa.decode.tree.Tree`, its heads'
    paths; a lookup chain is another drafter, see :mod:`medusa.drafters.composite`).

    Training: the heads' decayed per-head loss over the frozen base's hidden states (:mod:`medusa.losses`, the
    trainer in ``train/``); saved and loaded as a heads folder (:mod:`medusa.io.checkpoint`).

    Args:
        heads: the heads, on the base's device and dtype.
        tree: which ranks of which heads make the tree (its lookup chain, if any, is ignored here).

    Raises:
        ValueError: the tree is deeper than the heads or wider than their vocabulary.
    """

    trainable = True
    training_objective = ("declared per head type in train.drafters (its objective, trainable parameters and folder): "
                          "sum_k decay^k L_k over the heads' targets t+k+2 (medusa, hydra); the eagle drafter's "
                          "training-time test")

    def __init__(self, heads, tree: Tree):
        heads_tree = Tree(tree.paths, tree.name)
        heads_tree.check_fits(heads.config.num_heads, heads.head_vocab_size)
        self.heads, self.tree = heads, heads_tree
        self._layouts: dict[torch.device, tuple[TreeBuffers, torch.Tensor]] = {}
        self.max_nodes = heads_tree.num_nodes
        self.max_depth = heads_tree.depth
        self.base_layers = tuple(heads.base_layers)

    def _layout(self, device: torch.device) -> tuple[TreeBuffers, torch.Tensor]:
        if device not in self._layouts:
            vocab = self.heads.to_base_ids(torch.arange(self.heads.head_vocab_size, device=device))  # (Vh,)
            self._layouts[device] = (tree_buffers(self.tree, device), vocab)
        return self._layouts[device]

    def new_state(self) -> HeadsState:
        return HeadsState(self.heads.new_context())

    def start(self, state: HeadsState, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        state.hidden = self.heads.extend_context(state.context, hidden, next_tokens)  # (H,)

    def propose(self, state: HeadsState, root: torch.Tensor, sequence: torch.Tensor,
                sampler: DraftSampler) -> DraftTree:
        layout, vocab = self._layout(root.device)
        return draft_tree(self.heads, state.hidden, root, layout, sampler, vocab)

    def update(self, state: HeadsState, draft: DraftTree, path: torch.Tensor, hidden: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        state.hidden = self.heads.extend_context(state.context, hidden, next_tokens)  # (H,)

    def save(self, out_dir) -> None:
        """Write the heads folder (:func:`medusa.io.checkpoint.save_heads`; the tree is a file of its own,
        :func:`medusa.decode.tree.save_tree`)."""
        from medusa.io.checkpoint import save_heads

        save_heads(self.heads, out_dir)

    @classmethod
    def load(cls, heads_dir, base, tree: Tree | None = None) -> HeadsDrafter:
        """The heads of ``heads_dir`` for ``base`` (a transformers causal LM) on ``tree`` (default: the folder's
        ``tree.json``, else the top-1 chain over all heads).

        Raises:
            FileNotFoundError, medusa.io.checkpoint.HeadsMismatchError: as :func:`medusa.io.checkpoint.load_heads`.
        """
        from pathlib import Path

        from medusa.decode.tree import load_tree
        from medusa.io.checkpoint import load_heads_for_base

        heads = load_heads_for_base(heads_dir, base)
        heads = heads.to(device=base.device, dtype=base.get_output_embeddings().weight.dtype)
        if tree is None:
            path = Path(heads_dir) / "tree.json"
            tree = load_tree(path) if path.is_file() else Tree.chain(heads.config.num_heads)
        return cls(heads, tree)
