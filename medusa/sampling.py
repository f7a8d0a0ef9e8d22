"""Acceptance rules for a drafted tree: greedy, lossless speculative sampling, and Medusa's typical acceptance.

Pure tensor code. Each rule is an object the generation loop builds once, before decoding starts, with the same
interface:

- ``choose(logits (P, Vh), k) -> (P, k)``: how candidates are drafted at each tree parent (:func:`medusa.draft.
  draft_tree`);
- ``next_token(logits (V,)) -> ()``: the base's own token from processed logits (the prefill token);
- ``accept(draft, logits_at) -> Acceptance``: walk the tree from the root. ``logits_at(node)`` returns the base's
  processed logits ``(V,)`` after that node (every generation setting already applied for the node's own prefix);
  only the nodes on the walk are asked for.

Tree layout (:class:`medusa.tree.TreeBuffers`): a parent's children are its candidates of ranks ``0..k-1`` that the
tree keeps, in rank order. Heads may have a truncated vocabulary: ``head_to_base`` ``(Vh,)`` maps head-vocabulary
ids to base ids, and the draft distribution q is zero outside it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from medusa.draft import Draft, top_k_candidates
from medusa.tree import TreeBuffers
from medusa.verify import Acceptance, greedy_accept_along_path

LogitsAt = Callable[[int], torch.Tensor]


def sample_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """``k`` distinct ids per row, in draw order, drawn one after another without replacement from ``probs``.

    The exponential race (Efraimidis and Spirakis 2006; the Gumbel-top-k trick, Kool et al. 2019): with
    ``E_i ~ Exp(1)`` independent, the ids sorted by ``probs_i / E_i`` descending are distributed as sequential draws
    where the j-th id is drawn from ``probs`` renormalised without the first j-1. Ids with probability 0 sort last;
    when a row has fewer than ``k`` positive entries its trailing ids are not draws (callers check ``probs > 0``).

    Args:
        probs: ``(P, V)`` non-negative rows (need not be normalised).
        k: ids per row (at most V).

    Returns:
        ``(P, k)`` long ids.
    """
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).topk(k, dim=-1).indices  # (P, k)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One id ``()`` drawn from ``probs`` ``(V,)`` (non-negative, not necessarily normalised)."""
    return torch.multinomial(probs, 1, generator=generator)[0]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))``: what is left of target ``p`` after rejecting a draw from ``q``, both ``(V,)``.

    Exactly zero mass only when ``p == q``, where rejection has probability 0; ``p`` is returned then.
    """
    left = (p - q).clamp_min_(0)  # (V,)
    total = left.sum()
    return left / total if total > 0 else p


class _TreeWalk:
    """Per-node lookups for walking a tree one node at a time: depth, slot among its level's parents, the heads'
    children ``(rank, node)`` in rank order, and the prompt-lookup child (on the root and along the chain)."""

    def __init__(self, buffers: TreeBuffers):
        self.buffers = buffers
        self.depth = buffers.depth.tolist()
        chain = buffers.lookup_nodes.tolist() if buffers.lookup_nodes is not None else []
        self.lookup_child: dict[int, int] = dict(zip(([0] + chain)[:-1], chain, strict=True))
        self.slot: dict[int, int] = {}
        self.kids: dict[int, list[tuple[int, int]]] = {}
        for d, parents in enumerate(buffers.level_parents):
            for s, node in enumerate(parents.tolist()):
                self.slot[node] = s
            children = buffers.level_children[d].tolist()
            for child, slot, rank in zip(children, buffers.child_slot[d].tolist(), buffers.child_rank[d].tolist(),
                                         strict=True):
                self.kids.setdefault(parents[slot].item(), []).append((rank, child))
        for kids in self.kids.values():
            kids.sort()


class GreedyAcceptance:
    """Greedy decoding: top-k candidates, accept the child equal to the base's argmax (Medusa report, section 2.3).

    The emitted tokens are exactly the base's greedy tokens under the same logits processors.
    """

    def __init__(self, buffers: TreeBuffers):
        self.buffers = buffers

    choose = staticmethod(top_k_candidates)

    @staticmethod
    def next_token(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax()

    def accept(self, draft: Draft, logits_at: LogitsAt) -> Acceptance:
        return greedy_accept_along_path(draft.tokens, lambda node: logits_at(node).argmax(), self.buffers)


class RejectionSampling:
    """Lossless speculative sampling on a tree: recursive rejection sampling over candidates drawn without
    replacement (SpecInfer, Miao et al. 2024, section 4.2, multi-step speculative sampling; EAGLE's multi-draft
    verification, Li et al. 2024; Sequoia, Chen et al. 2024, section 3.2, sampling without replacement).

    Drafting (``choose``): at every tree parent, the candidates ``x_1 .. x_k`` are drawn one after another without
    replacement from the heads' processed distribution q (``draft_warp`` then softmax): ``x_i ~ q_i``, q with
    ``x_1 .. x_{i-1}`` removed and renormalised.

    Verification (``accept``), starting at the root with r = p, the base's processed distribution at the node: for
    the children in rank order, accept ``x_i`` with probability ``min(1, r(x_i) / q_i(x_i))``; on rejection
    ``r <- norm(max(0, r - q_i))``. On acceptance move to that child (its own p, its own candidates); when every
    child is rejected, or the node has none, emit one token drawn from r (the final residual, or p at a node
    without children: the bonus token).

    Why exact: one rejection step is the speculative-sampling lemma (Leviathan et al. 2023, Chen et al. 2023): if
    ``x ~ q``, accepting with probability ``min(1, r(x)/q(x))`` and otherwise emitting a draw from
    ``norm(max(0, r - q))`` emits a token distributed as r. Given the history ``x_1 .. x_{i-1}``, the next candidate
    is distributed as ``q_i``, and ``q_i`` (so the next residual) does not depend on ``x_i``; by induction from the
    last candidate backwards, what the node emits is distributed as p. A candidate the tree does not keep (a rank
    gap) is skipped, but still removed from q for the later ranks: the later ranks are then still drawn from the q
    they are tested against. Each emitted token is thus distributed as the base's p given everything before it, so
    the output is distributed exactly as sampling from the base with the same settings, whatever the heads.
    The ratio must use the q the candidates were drawn from: deterministic top-k candidates scored against a
    softmax q are not exact (kept as a control in the tests).

    A prompt-lookup child (:mod:`medusa.prompt_lookup`) is tried first at its parent, as a draft from a one-hot q:
    accepted with probability ``r(x)``, else ``r <- r`` without x, renormalised (the same lemma). The copied token
    depends only on the context, not on the heads' draws, so the heads' candidates after it are tested as before,
    against that residual.

    Args:
        buffers: the tree's index tensors.
        head_to_base: ``(Vh,)`` long base ids of the head vocabulary.
        vocab_size: V, the base vocabulary.
        draft_warp: head logits ``(P, Vh)`` -> processed logits (temperature, top-k, top-p); any q keeps the output
            exact, a q close to p accepts more.
        generator: the decode call's random generator.
    """

    def __init__(self, buffers: TreeBuffers, head_to_base: torch.Tensor, vocab_size: int,
                 draft_warp: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator | None):
        self.walk = _TreeWalk(buffers)
        self.head_to_base, self.vocab_size = head_to_base, vocab_size
        self.draft_warp, self.generator = draft_warp, generator

    def draft_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """q: ``(P, Vh)`` head logits -> ``(P, Vh)`` probabilities the candidates are drawn from."""
        return torch.softmax(self.draft_warp(logits.float()), dim=-1)

    def choose(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        return sample_without_replacement(self.draft_probs(logits), k, self.generator)

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(torch.softmax(logits.float(), dim=-1), self.generator)

    def accept(self, draft: Draft, logits_at: LogitsAt) -> Acceptance:
        node, path, level_q = 0, [0], {}
        while True:
            p = torch.softmax(logits_at(node).float(), dim=-1)  # (V,)
            if (lookup := self.walk.lookup_child.get(node)) is not None:
                # A copied token is a draft from q = one-hot: accept it with probability r(x), else r <- r without x.
                x = int(draft.tokens[lookup])
                if float(torch.rand((), generator=self.generator, device=p.device)) < float(p[x]):
                    node = lookup
                    path.append(node)
                    continue
                p = residual(p, torch.nn.functional.one_hot(draft.tokens[lookup], p.shape[-1]).to(p.dtype))
            kids = self.walk.kids.get(node)
            if kids:
                d = self.walk.depth[node]
                if d not in level_q:  # the same computation as at drafting time, so the same q
                    level_q[d] = self.draft_probs(draft.level_logits[d])  # (P_d, Vh)
                q = level_q[d][self.walk.slot[node]]  # (Vh,)
                child, p = self._try_children(p, q, draft.level_candidates[d][self.walk.slot[node]], kids)
                if child is not None:
                    node = child
                    path.append(node)
                    continue
            nodes = torch.tensor(path, dtype=torch.long, device=draft.tokens.device)
            return Acceptance(len(path) - 1, nodes, sample(p, self.generator))

    def _try_children(self, p: torch.Tensor, q_head: torch.Tensor, candidates: torch.Tensor,
                      kids: list[tuple[int, int]]) -> tuple[int | None, torch.Tensor]:
        """Recursive rejection over one node's candidates; returns ``(accepted child or None, residual r)``.

        ``q_head``: ``(Vh,)`` draft probabilities; ``candidates``: ``(k,)`` head ids in draw order.
        """
        q = torch.zeros(self.vocab_size, dtype=p.dtype, device=p.device)  # (V,), zero outside the head vocab
        q[self.head_to_base] = q_head.to(p.dtype)
        last = kids[-1][0]
        base_ids = self.head_to_base[candidates[: last + 1]]  # (last+1,)
        q_drawn = q[base_ids].tolist()
        total = float(q.sum())
        node_at = dict(kids)
        for rank, x in enumerate(base_ids.tolist()):
            if total <= 0 or q_drawn[rank] <= 0:  # q's support is used up: this and later candidates are not draws
                break
            if rank in node_at:
                q_i = q / total  # q without the earlier candidates, renormalised: what x was drawn from
                u = float(torch.rand((), generator=self.generator, device=p.device))
                if u * q_drawn[rank] < float(p[x]) * total:  # u < r(x) / q_i(x)
                    return node_at[rank], p
                p = residual(p, q_i)
            q[x] = 0  # later candidates were drawn without this one
            total -= q_drawn[rank]
        return None, p


class TypicalAcceptance:
    """Medusa's typical acceptance (Medusa report, Cai et al. 2024, section 2.3.1). LOSSY: the output is not
    distributed as the base's samples.

    Candidates are the heads' top-k (as for greedy). Walking from the root, a child x is accepted when the base's
    processed distribution p at its parent gives ``p(x) > min(epsilon, delta * exp(-H(p)))``; the highest-ranked
    child that passes is taken (the walk does not search for the longest path, which would need the base's logits at
    every node). The token after the last accepted node is sampled from p, so a step with nothing accepted is an
    ordinary sampling step.
    """

    def __init__(self, buffers: TreeBuffers, epsilon: float, delta: float, generator: torch.Generator | None):
        self.walk = _TreeWalk(buffers)
        self.epsilon, self.delta, self.generator = epsilon, delta, generator

    choose = staticmethod(top_k_candidates)

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(torch.softmax(logits.float(), dim=-1), self.generator)

    def accept(self, draft: Draft, logits_at: LogitsAt) -> Acceptance:
        node, path = 0, [0]
        while True:
            p = torch.softmax(logits_at(node).float(), dim=-1)  # (V,)
            entropy = torch.special.entr(p).sum()
            threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)
            kids = [c for _, c in self.walk.kids.get(node, ())]
            if (lookup := self.walk.lookup_child.get(node)) is not None:
                kids.insert(0, lookup)  # the copied token first, as in greedy acceptance
            child = next((c for c in kids if p[draft.tokens[c]] > threshold), None)
            if child is None:
                nodes = torch.tensor(path, dtype=torch.long, device=draft.tokens.device)
                return Acceptance(len(path) - 1, nodes, sample(p, self.generator))
            node = child
            path.append(node)
