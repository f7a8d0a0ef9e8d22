"""Several drafters merged into one tree, verified in one forward (pure tensor code).

Each part proposes its own tree below the shared root; the merged tree holds the root, then every part's nodes in
the order the parts are given. A step accepts whichever branch the base agrees with for longer. Where two parts
propose the same tokens (twins, see :mod:`medusa.decode.greedy`), ``priority`` says which part's node is kept: the
shipped trees put the prompt-lookup chain first, since a copied span can run deeper than the heads.

:func:`tree_drafter` builds what a :class:`medusa.decode.tree.Tree` file describes: the heads' nodes and, when the
tree has one, the prompt-lookup chain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decode.tree import Tree, TreeBuffers, layout_from_parents, tree_buffers
from medusa.drafters.base import DraftSampler, DraftTree, Draws, register_drafter
from medusa.drafters.heads_drafter import HeadsDrafter
from medusa.drafters.prompt_lookup import PromptLookupDrafter


def merge_layouts(layouts: list[TreeBuffers], priority: list[int]) -> tuple[TreeBuffers, list[torch.Tensor]]:
    """One layout of the root and every part's nodes, in part order; the root's children by ``priority`` (part
    indices, first wins ties), every other node's children as in its part.

    Returns:
        ``(layout, maps)``: ``maps[i]`` ``(N_i,)`` long, the merged index of part i's nodes (its root -> 0).
    """
    device = layouts[0].depth.device
    maps, parents, offset = [], [-1], 1
    for layout in layouts:
        n = len(layout.depth)
        index = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(offset, offset + n - 1)])  # (N_i,)
        maps.append(index)
        parents += [int(index[p]) for p in layout.parents[1:].tolist()]
        offset += n - 1
    children = [[] for _ in parents]
    for i in priority:
        children[0] += [int(maps[i][c]) for c in layouts[i].children[0]]
    for layout, index in zip(layouts, maps, strict=True):
        for node in range(1, len(layout.depth)):
            children[int(index[node])] = [int(index[c]) for c in layout.children[node]]
    return layout_from_parents(parents, children, device), [m.to(device) for m in maps]


@dataclass
class _Merged:
    key: list  # the objects it was made from (compared by identity)
    layout: TreeBuffers
    draws: list[list[tuple[torch.Tensor, torch.Tensor]]]  # per part, per draws group: merged (parents, nodes)
    copied: torch.Tensor | None


@register_drafter("composite")
class CompositeDrafter:
    """Drafters ``parts`` proposing one merged tree (see module docstring).

    Args:
        parts: the drafters, in node order.
        priority: part indices in tie order (default: the given order).

    Raises:
        ValueError: no part, ``priority`` is not an order of the parts, or two parts read different base layers.
    """

    trainable = False
    training_objective = None

    def __init__(self, parts: list, priority: list[int] | None = None):
        layered = {tuple(p.base_layers) for p in parts if p.base_layers}
        if len(layered) > 1:
            raise ValueError(f"the parts of a composite drafter read different base layers {sorted(layered)}: at "
                             "most one set can be returned by a forward")
        self.base_layers = layered.pop() if layered else ()
        if not parts:
            raise ValueError("a composite drafter needs at least one part")
        priority = list(range(len(parts))) if priority is None else list(priority)
        if sorted(priority) != list(range(len(parts))):
            raise ValueError(f"priority must order the parts 0..{len(parts) - 1}, got {priority}")
        self.parts, self.priority = list(parts), priority
        self.max_nodes = 1 + sum(p.max_nodes - 1 for p in parts)
        self.max_depth = max(p.max_depth for p in parts)
        self._last: _Merged | None = None

    def _merged_for(self, drafts: list[DraftTree]) -> _Merged:
        """The merged layout and the parts' index tensors mapped into it. The last merge is kept and reused while
        the parts hand back the same layout and index tensor objects (a fixed tree's every step); a part that builds
        new ones each step gets a new merge each step, and nothing piles up."""
        key = [d.layout for d in drafts] + [t for d in drafts for w in d.draws for t in (w.parents, w.nodes)]
        key += [d.copied for d in drafts]
        hit = self._last
        if hit is None or len(hit.key) != len(key) or any(a is not b for a, b in zip(hit.key, key, strict=True)):
            layout, maps = merge_layouts([d.layout for d in drafts], self.priority)
            draws = [[(index[w.parents], index[w.nodes]) for w in d.draws]
                     for d, index in zip(drafts, maps, strict=True)]
            copied = [index[d.copied] for d, index in zip(drafts, maps, strict=True) if d.copied is not None]
            hit = self._last = _Merged(key, layout, draws, torch.cat(copied) if copied else None)
        return hit

    def new_state(self) -> list:
        return [part.new_state() for part in self.parts]

    def _states_for(self, part, hidden: torch.Tensor) -> torch.Tensor:
        """What ``part`` reads of the base states: all of them, or the last hidden state (their first ``H``
        columns) for a part that reads no layers."""
        if part.base_layers or not self.base_layers:
            return hidden
        return hidden[..., : hidden.shape[-1] // (1 + len(self.base_layers))]

    def start(self, state: list, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        for part, own in zip(self.parts, state, strict=True):
            part.start(own, self._states_for(part, hidden), next_tokens)

    def propose(self, state: list, root: torch.Tensor, sequence: torch.Tensor, sampler: DraftSampler) -> DraftTree:
        drafts = [part.propose(own, root, sequence, sampler) for part, own in zip(self.parts, state, strict=True)]
        merged = self._merged_for(drafts)
        tokens = torch.cat([root[None]] + [d.tokens[1:] for d in drafts])  # (N,)
        draws = [Draws(parents, w.logits, w.candidates, nodes, w.slot, w.rank, w.q, w.vocab)
                 for d, mapped in zip(drafts, merged.draws, strict=True)
                 for w, (parents, nodes) in zip(d.draws, mapped, strict=True)]
        return DraftTree(tokens, merged.layout, draws, merged.copied, parts=drafts)

    def update(self, state: list, draft: DraftTree, path: torch.Tensor, hidden: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        """Each part is told about its own draft: its nodes along the accepted tokens, in its own indices, as far
        as its tree holds them (a twin in another part counts), with every accepted position's hidden state."""
        accepted = next_tokens[:-1].tolist()  # the accepted drafts' tokens (the last is the bonus token)
        for part, own, mine in zip(self.parts, state, draft.parts, strict=True):
            part.update(own, mine, own_path(mine, accepted), self._states_for(part, hidden), next_tokens)


def own_path(draft: DraftTree, tokens: list[int]) -> torch.Tensor:
    """``(A'+1,)`` long: ``draft``'s nodes from its root down along ``tokens``, as far as its tree holds them."""
    node_tokens, children = draft.tokens.tolist(), draft.layout.children
    path = [0]
    for token in tokens:
        below = next((c for c in children[path[-1]] if node_tokens[c] == token), None)
        if below is None:
            break
        path.append(below)
    return torch.tensor(path, dtype=torch.long, device=draft.tokens.device)


@register_drafter("none")
class NoDrafter:
    """No drafts: every tree is the root alone, so every step is one plain decoding step."""

    trainable = False
    training_objective = None
    max_nodes, max_depth = 1, 0
    base_layers = ()

    def __init__(self):
        self._layouts: dict[torch.device, TreeBuffers] = {}

    def new_state(self) -> None:
        return None

    def start(self, state, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        pass

    def propose(self, state, root: torch.Tensor, sequence: torch.Tensor, sampler: DraftSampler) -> DraftTree:
        if root.device not in self._layouts:
            self._layouts[root.device] = tree_buffers(Tree.chain(0), root.device)
        return DraftTree(root[None], self._layouts[root.device])

    def update(self, state, draft: DraftTree, path: torch.Tensor, hidden: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        pass


def tree_drafter(heads, tree: Tree):
    """The drafter a tree file describes: :class:`medusa.drafters.heads_drafter.HeadsDrafter` over its heads' nodes
    and, when it has one, a :class:`medusa.drafters.prompt_lookup.PromptLookupDrafter` chain beside them (its nodes
    after the heads', first in ties). ``heads`` may be ``None`` for a tree without heads' nodes.

    Raises:
        ValueError: the tree has heads' nodes and no heads are given, or it does not fit the heads.
    """
    if tree.num_nodes == 1:
        return NoDrafter()
    parts = []
    if tree.paths:
        if heads is None:
            raise ValueError(f"tree {tree.name!r} has heads' nodes down to depth {tree.head_depth}: drafting needs "
                             "heads")
        # A draft model (medusa.drafters.draft_model) drafts through the heads' interface with a drafter of its own.
        make = getattr(heads, "make_drafter", None)
        parts.append(make(tree) if make is not None else HeadsDrafter(heads, tree))
    if tree.lookup_length:
        parts.append(PromptLookupDrafter(tree.lookup_length, tree.lookup_max_ngram))
    if len(parts) == 1:
        return parts[0]
    return CompositeDrafter(parts, priority=[1, 0])
