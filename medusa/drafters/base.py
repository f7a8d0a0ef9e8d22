"""The drafter seam: what proposes a decode step's candidate tree, and how candidates are drawn (pure tensor code).

A decode step is draft -> verify -> accept (:mod:`medusa.decode.loop`). The drafter proposes a tree of candidate tokens
hanging from the root (the base's own latest token) as a :class:`DraftTree`: node tokens, the tree's layout (parents,
depth, tree-attention mask, see :class:`medusa.decode.tree.TreeBuffers`), and for every node where its token came from:

- **drawn** nodes are siblings drawn at one parent from one distribution over a (possibly truncated) vocabulary
  (:class:`Draws`): the top-k of the drafter's logits for greedy and typical acceptance, or a sample without
  replacement from q for speculative sampling. The acceptance rule reads q from here; it never re-derives it.
- **copied** nodes are deterministic (q is one-hot): prompt lookup copies them from the context.

How candidates are drawn is a :class:`DraftSampler` the acceptance rule asks for (:class:`TopK` or
:class:`SampleWithoutReplacement`); the drafter draws, the rule only reads.

A drafter owns its per-sequence state (the Hydra heads' attention-layer cache today, a draft model's KV cache
tomorrow): :meth:`Drafter.new_state`, fed the prompt after the prefill (:meth:`Drafter.start`) and told which nodes
the base accepted after every step (:meth:`Drafter.update`). Trees may differ in shape from one step to the next.

Registry: :func:`register_drafter` names a drafter class; :func:`drafter_class` finds it by name. The commands choose
a drafter by that name (``--drafter NAME``, :func:`medusa.build.build_model`): a class registered from outside the
package builds itself there with a classmethod ``from_decode_config(config, base)`` (a
:class:`medusa.build.DecodeConfig` and the loaded base).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from medusa.decode.tree import TreeBuffers
from medusa.registry import claim


@dataclass
class Draws:
    """Sibling candidates drawn at a set of parent nodes, each parent's from one distribution (one tree level).

    P parents, each with ``k`` candidates in draw (rank) order over a vocabulary of Vh ids; the tree keeps C of the
    P x k candidates as nodes.
    """

    parents: torch.Tensor
    """``(P,)`` long node indices of the parents."""
    logits: torch.Tensor
    """``(P, Vh)`` the drafter's logits at each parent."""
    candidates: torch.Tensor
    """``(P, k)`` long vocabulary ids in draw order (rank 0 first)."""
    nodes: torch.Tensor
    """``(C,)`` long node indices of the kept candidates."""
    slot: torch.Tensor
    """``(C,)`` long: the kept node's parent, as an index into :attr:`parents`."""
    rank: torch.Tensor
    """``(C,)`` long: the kept node's rank among its parent's candidates."""
    q: torch.Tensor | None = None
    """``(P, Vh)`` the probabilities the candidates were drawn from (sampled drafts); ``None``: the top-k of
    :attr:`logits` (deterministic given the logits)."""
    vocab: torch.Tensor | None = None
    """``(Vh,)`` long base token id of each vocabulary id (a truncated head vocabulary); ``None``: the identity."""

    def to_base(self, ids: torch.Tensor) -> torch.Tensor:
        """Base token ids of vocabulary ids (any shape)."""
        return ids if self.vocab is None else self.vocab[ids]


@dataclass
class DraftTree:
    """One step's candidate tree. N nodes, node 0 the root (the base's latest token, not yet in the cache)."""

    tokens: torch.Tensor
    """``(N,)`` long base token ids of every node."""
    layout: TreeBuffers
    """Parents, depths, the tree-attention mask and walk order of the N nodes."""
    draws: list[Draws] = field(default_factory=list)
    """Where the drawn nodes came from, one entry per group of parents drafted together."""
    copied: torch.Tensor | None = None
    """``(L,)`` long node indices of deterministic (copied) nodes; ``None``: none."""
    parts: list[DraftTree] | None = None
    """For a merged tree (:class:`medusa.drafters.composite.CompositeDrafter`), each part's own draft."""
    choose_s: float = 0.0
    """Seconds the drafter spent choosing this tree's shape, its model calls excluded (the per-step tree's
    overhead, :mod:`medusa.drafters.per_step`; 0 for a fixed tree)."""

    def confidence(self) -> torch.Tensor:
        """``(N,)`` float: each node's draft probability, the probability its own distribution gave its token (q
        for sampled drafts, the softmax of the drafter's logits for top-k ones; 1 for the root and copied nodes,
        whose q is one-hot). Computed on demand: decoding itself does not need it."""
        conf = torch.ones(len(self.tokens), dtype=torch.float32, device=self.tokens.device)  # (N,)
        for draws in self.draws:
            probs = draws.q if draws.q is not None else torch.softmax(draws.logits.float(), dim=-1)  # (P, Vh)
            picked = draws.candidates[draws.slot, draws.rank]  # (C,)
            conf[draws.nodes] = probs[draws.slot, picked].float()
        return conf


class DraftSampler(Protocol):
    """How a drafter draws ``k`` candidates per parent from its logits; chosen by the acceptance rule."""

    def draw(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(P, Vh)`` logits -> ``(candidates (P, k) long, q (P, Vh) or None)``: the ids in draw order and the
        probabilities they were drawn from (``None`` when the draw is the deterministic top-k)."""
        ...

    def draw_ranked(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """:meth:`draw` and ``(P, k)`` the ``k`` largest probabilities of the distribution drawn from, sorted: what a
        per-step tree values rank r by before the draw (:mod:`medusa.drafters.per_step`)."""
        ...


class TopK:
    """Each parent's ``k`` most likely ids, best first (greedy decoding, typical acceptance).

    Args:
        greedy: the draws serve greedy decoding, whose output no tree changes (a per-step tree may then weigh
            nodes by measured wall time, :attr:`medusa.drafters.per_step.PerStepDrafter.node_overhead_s`).
    """

    def __init__(self, greedy: bool = False):
        self.greedy = greedy

    def draw(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, None]:
        return logits.topk(k, dim=-1).indices, None  # (P, k)

    def draw_ranked(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, None, torch.Tensor]:
        probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)  # (P, k) each
        return ids, None, probs


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


class SampleWithoutReplacement:
    """Candidates drawn one after another without replacement from ``q = softmax(warp(logits))`` (speculative
    sampling on a tree: SpecInfer, Miao et al. 2024, section 4.2; Sequoia, Chen et al. 2024, section 3.2).

    Args:
        warp: logits ``(P, Vh)`` -> processed logits (temperature, top-k, top-p); any q keeps rejection sampling
            exact, a q close to the base's p accepts more.
        generator: the decode call's random generator.
    """

    def __init__(self, warp: Callable[[torch.Tensor], torch.Tensor], generator: torch.Generator | None):
        self.warp, self.generator = warp, generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """q: ``(P, Vh)`` logits -> ``(P, Vh)`` probabilities the candidates are drawn from."""
        return torch.softmax(self.warp(logits.float()), dim=-1)

    def draw(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.probs(logits)  # (P, Vh)
        return sample_without_replacement(q, k, self.generator), q

    def draw_ranked(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.probs(logits)  # (P, Vh)
        return sample_without_replacement(q, k, self.generator), q, q.topk(k, dim=-1).values


@runtime_checkable
class Drafter(Protocol):
    """Proposes each decode step's candidate tree (see module docstring).

    Attributes:
        name: the registry name.
        max_nodes: the most nodes (root included) a proposed tree has: what the KV cache must hold beyond the text.
        max_depth: the deepest node a proposed tree has: the most drafts one step can accept.
        base_layers: the base's decoder layers (0-based) whose outputs the drafter reads besides the last hidden
            state: empty for most; a feature drafter's fused layers (:mod:`medusa.drafters.eagle`). With layers,
            the ``hidden`` of :meth:`start` and :meth:`update` is ``(n, (1 + len(base_layers)) H)``: the last hidden
            state, then those layers' outputs.
    """

    name: str
    max_nodes: int
    max_depth: int
    base_layers: tuple[int, ...]

    def new_state(self):
        """A fresh per-sequence state (``None`` when the drafter keeps none)."""
        ...

    def start(self, state, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """After the prefill: the prompt's last hidden states ``(T, H)`` and the token after each ``(T,)`` (the last
        is the base's own next token, the first tree's root)."""
        ...

    def propose(self, state, root: torch.Tensor, sequence: torch.Tensor, sampler: DraftSampler) -> DraftTree:
        """The step's tree below ``root`` ``()``; ``sequence`` ``(S,)`` is the prompt and every emitted token, the
        root last; candidates are drawn by ``sampler``."""
        ...

    def update(self, state, draft: DraftTree, path: torch.Tensor, hidden: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        """After the verification: the kept nodes of ``draft`` ``path`` ``(A'+1,)`` (root first), the hidden
        states of every accepted position ``(A+1, H)`` and the token after each ``(A+1,)`` (the last is the base's
        bonus token, the next root). Of twins (the same tokens from the root down) one is kept, so ``path`` need
        not be a chain of parents; inside a composite it is the drafter's own nodes along the accepted tokens, as
        far as its tree holds them (``A' <= A``)."""
        ...


@runtime_checkable
class RowsDrafter(Protocol):
    """A drafter that proposes trees for a batch of rows at once (batched decoding verifies every row's tree in one
    forward, so a step's trees have one size; each row's may have its own shape): the per-step tree
    (:mod:`medusa.drafters.per_step`) chooses the size, and the shapes, from all rows' drafts. Other drafters propose
    row by row."""

    def propose_rows(self, states: list, roots: torch.Tensor, sequences: list[torch.Tensor],
                     sampler: DraftSampler | list[DraftSampler]) -> list[DraftTree]:
        """``B`` trees of one size, below ``roots`` ``(B,)``; ``sequences[b]`` ``(S_b,)`` as in
        :meth:`Drafter.propose`; ``sampler``: one for every row, or one per row (each row's acceptance rule's)."""
        ...


_DRAFTERS: dict[str, type] = {}


def register_drafter(name: str) -> Callable[[type], type]:
    """Class decorator: make a drafter class findable by ``name`` (:func:`drafter_class`).

    Raises:
        ValueError: ``name`` is already registered to another class.
    """

    def register(cls: type) -> type:
        claim(_DRAFTERS, name, cls, "drafter")
        cls.name = name
        return cls

    return register


def drafter_class(name: str) -> type:
    """The drafter class registered as ``name``.

    Raises:
        ValueError: no drafter of that name (the known ones are named).
    """
    if name not in _DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(sorted(_DRAFTERS))}")
    return _DRAFTERS[name]


def drafter_names() -> tuple[str, ...]:
    """The registered drafter names, sorted."""
    return tuple(sorted(_DRAFTERS))
