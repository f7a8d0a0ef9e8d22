"""Acceptance rules for a drafted tree: greedy, lossless speculative sampling, and Medusa's typical acceptance.

Pure tensor code. An acceptance rule is picked once per decode call (:func:`acceptance_rule`, from the registry
:func:`register_acceptance`) and has the same interface (:class:`AcceptanceRule`):

- ``sampler``: how the drafter must draw candidates for this rule (:mod:`medusa.drafters.base`: the top-k, or a
  sample without replacement from q); the rule never draws drafts itself;
- ``next_token(logits (V,)) -> ()``: the base's own token from processed logits (the prefill token);
- ``rows_at_once``: whether ``accept_rows(tokens (R, N), layout, predicted, next_tokens_at)`` accepts several rows
  of a batched step together from the base's greedy tokens (greedy acceptance without logits processors: one set
  of tensor operations for all of them); the other rules accept row by row;
- ``accept(draft, logits_at, predicted=None) -> Acceptance``: walk the tree from the root. ``logits_at(node)``
  returns the base's processed logits ``(V,)`` after that node (every generation setting already applied for the
  node's own prefix); only the nodes on the walk are asked for. ``predicted`` ``(N,)``, when the base's greedy token
  at every node is already known (all nodes scored, no logits processor), lets greedy acceptance run vectorised.

Where the drafts came from is in the :class:`medusa.drafters.base.DraftTree`: per group of siblings, the parent, the
candidates in draw order and the distribution q they were drawn from (over a possibly truncated vocabulary, mapped to
base ids by ``Draws.vocab``; q is zero outside it); copied nodes are deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from medusa.decode.greedy import (
    Acceptance,
    NextTokens,
    argmax_rows,
    greedy_accept,
    greedy_accept_along_path,
    greedy_paths,
    greedy_walk,
)
from medusa.decode.tree import TreeBuffers
from medusa.drafters.base import DraftSampler, DraftTree, SampleWithoutReplacement, TopK, sample_without_replacement
from medusa.registry import claim

__all__ = ["AcceptanceRule", "CoupledSampling", "GreedyAcceptance", "RejectionSampling",
           "TypicalAcceptance", "acceptance_rule", "coupled_stream_seed", "gumbel_noise", "register_acceptance",
           "residual", "sample", "sample_without_replacement", "sampling_rules"]

LogitsAt = Callable[[int], torch.Tensor]


class AcceptanceRule(Protocol):
    """How a drafted tree is accepted (see module docstring).

    Attributes:
        lossless: the output is distributed exactly as the base's (greedy: the base's greedy tokens).
        sampler: how the drafter draws candidates for this rule.
        rows_at_once: rows without logits processors may be accepted together (``accept_rows``).
    """

    name: str
    lossless: bool
    sampler: DraftSampler
    rows_at_once: bool

    def next_token(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, draft: DraftTree, logits_at: LogitsAt, predicted: torch.Tensor | None = None
               ) -> Acceptance: ...


_RULES: dict[str, Callable] = {}


def register_acceptance(name: str):
    """Decorator: make an acceptance rule findable by ``name`` (``acceptance=name`` when sampling); the decorated
    callable is ``(decoding, vocab_size, generator) -> rule``. ``"greedy"`` is the rule when not sampling.

    Raises:
        ValueError: ``name`` is already registered to another factory.
    """

    def register(factory):
        claim(_RULES, name, factory, "acceptance rule")
        return factory

    return register


def sampling_rules() -> tuple[str, ...]:
    """The registered rules a sampling decode can name (``acceptance=``), in registration order."""
    return tuple(name for name in _RULES if name != "greedy")


def acceptance_rule(decoding, vocab_size: int, device) -> AcceptanceRule:
    """The rule ``decoding`` asks for (greedy when not sampling, else ``decoding.acceptance``), with its own seeded
    generator.

    Raises:
        ValueError: no rule of that name is registered.
    """
    if not decoding.do_sample:
        return _RULES["greedy"](decoding, vocab_size, None)
    if decoding.acceptance not in _RULES:
        raise ValueError(f"unknown acceptance rule {decoding.acceptance!r}: choose one of {sorted(_RULES)}")
    generator = torch.Generator(device=device)
    if decoding.seed is None:
        generator.seed()
    else:
        generator.manual_seed(decoding.seed)
    return _RULES[decoding.acceptance](decoding, vocab_size, generator)


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


class _Walk:
    """Per-node lookups for walking a drafted tree one node at a time: the copied children of each node (walk
    order), and each node's groups of drawn children ``(draws index, parent slot, [(rank, child)] in rank order)``.

    Built from each step's draft (its structure may change from step to step)."""

    def __init__(self, draft: DraftTree):
        layout = draft.layout
        self.copied: dict[int, list[int]] = {}
        if draft.copied is not None and len(draft.copied):
            walk_rank = layout.walk_rank.tolist()
            parents = layout.parents.tolist()
            for node in sorted(draft.copied.tolist(), key=walk_rank.__getitem__):
                self.copied.setdefault(parents[node], []).append(node)
        self.groups: dict[int, list[tuple[int, int, list[tuple[int, int]]]]] = {}
        for g, draws in enumerate(draft.draws):
            kids: dict[int, list[tuple[int, int]]] = {}
            for child, slot, rank in zip(draws.nodes.tolist(), draws.slot.tolist(), draws.rank.tolist(), strict=True):
                kids.setdefault(slot, []).append((rank, child))
            for slot, node in enumerate(draws.parents.tolist()):
                if slot in kids:
                    self.groups.setdefault(node, []).append((g, slot, sorted(kids[slot])))

    def children(self, node: int) -> list[int]:
        """``node``'s children in the order the walk tries them: the copied ones, then each group's by rank."""
        return [*self.copied.get(node, ()), *(c for _, _, group in self.groups.get(node, ()) for _, c in group)]


class GreedyAcceptance:
    """Greedy decoding: top-k candidates, accept the child equal to the base's argmax (Medusa report, section 2.3;
    :mod:`medusa.decode.greedy`). The emitted tokens are exactly the base's greedy tokens under the same logits
    processors.
    """

    name = "greedy"
    lossless = True
    sampler = TopK(greedy=True)
    rows_at_once = True

    @staticmethod
    def next_token(logits: torch.Tensor) -> torch.Tensor:
        return argmax_rows(logits)

    def accept(self, draft: DraftTree, logits_at: LogitsAt, predicted: torch.Tensor | None = None) -> Acceptance:
        if predicted is not None:
            return greedy_accept(draft.tokens, predicted, draft.layout)
        return greedy_accept_along_path(draft.tokens, lambda node: argmax_rows(logits_at(node)), draft.layout)

    @staticmethod
    def accept_rows(tokens: torch.Tensor, layout: TreeBuffers, predicted: torch.Tensor | None,
                    next_tokens_at: NextTokens | None = None) -> list[Acceptance]:
        """Greedy acceptance of ``R`` rows' trees of one layout at once (no logits processor): from the base's
        greedy token at every node ``predicted`` ``(R, N)`` (:func:`medusa.decode.greedy.greedy_paths`), or, when
        ``None``, asking ``next_tokens_at`` along the rows' paths (:func:`medusa.decode.greedy.greedy_walk`).

        Args:
            tokens: ``(R, N)`` long node tokens per row.
        """
        if predicted is not None:
            paths, accepted = greedy_paths(tokens, predicted, layout)  # (R, D+1), (R,)
            bonus = predicted.gather(1, paths.gather(1, accepted[:, None]))[:, 0]  # (R,)
        else:
            paths, accepted, bonus = greedy_walk(tokens, next_tokens_at, layout)
        return [Acceptance(a, paths[r, : a + 1], bonus[r]) for r, a in enumerate(accepted.tolist())]


class _SampledToken:
    """The base's own token in a sampling decode (the prefill token): drawn from its processed distribution."""

    generator: torch.Generator | None

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(torch.softmax(logits.float(), dim=-1), self.generator)


class RejectionSampling(_SampledToken):
    """Lossless speculative sampling on a tree: recursive rejection sampling over candidates drawn without
    replacement (SpecInfer, Miao et al. 2024, section 4.2, multi-step speculative sampling; EAGLE's multi-draft
    verification, Li et al. 2024; Sequoia, Chen et al. 2024, section 3.2, sampling without replacement).

    Drafting (:attr:`sampler`, done by the drafter): at every tree parent, the candidates ``x_1 .. x_k`` are drawn one
    after another without replacement from the heads' processed distribution q (``draft_warp`` then softmax): ``x_i ~
    q_i``, q with ``x_1 .. x_{i-1}`` removed and renormalised.

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

    A copied child (prompt lookup, :mod:`medusa.drafters.prompt_lookup`) is tried first at its parent, as a draft from
    a one-hot q: accepted with probability ``r(x)``, else ``r <- r`` without x, renormalised (the same lemma). The
    copied token depends only on the context, not on the drawn candidates, so those are tested after it as before,
    against that residual; several groups of candidates drawn independently at one parent are tested one group after
    another the same way.

    The q of each drawn candidate is the one its drafter drew it from (:attr:`medusa.drafters.base.Draws.q`): the
    drafter draws with :attr:`sampler`, this rule only reads.

    Args:
        vocab_size: V, the base vocabulary.
        draft_warp: head logits ``(P, Vh)`` -> processed logits (temperature, top-k, top-p); any q keeps the output
            exact, a q close to p accepts more.
        generator: the decode call's random generator.
    """

    name = "rejection"
    lossless = True
    rows_at_once = False

    def __init__(self, vocab_size: int, draft_warp: Callable[[torch.Tensor], torch.Tensor],
                 generator: torch.Generator | None):
        self.vocab_size, self.generator = vocab_size, generator
        self.sampler = SampleWithoutReplacement(draft_warp, generator)

    def accept(self, draft: DraftTree, logits_at: LogitsAt, predicted: torch.Tensor | None = None) -> Acceptance:
        walk = _Walk(draft)
        node, path = 0, [0]
        while True:
            p = torch.softmax(logits_at(node).float(), dim=-1)  # (V,)
            child = None
            for copied in walk.copied.get(node, ()):
                # A copied token is a draft from q = one-hot: accept it with probability r(x), else r <- r without x.
                x = int(draft.tokens[copied])
                if float(torch.rand((), generator=self.generator, device=p.device)) < float(p[x]):
                    child = copied
                    break
                p = residual(p, torch.nn.functional.one_hot(draft.tokens[copied], p.shape[-1]).to(p.dtype))
            for g, slot, kids in walk.groups.get(node, ()) if child is None else ():
                draws = draft.draws[g]
                if draws.q is None:
                    raise ValueError("rejection sampling needs candidates drawn from a distribution q: this drafter "
                                     "drew its candidates deterministically (top-k)")
                vocab = draws.vocab if draws.vocab is not None else torch.arange(draws.q.shape[-1], device=p.device)
                child, p = self._try_children(p, draws.q[slot], vocab, draws.candidates[slot], kids)
                if child is not None:
                    break
            if child is not None:
                node = child
                path.append(node)
                continue
            nodes = torch.tensor(path, dtype=torch.long, device=draft.tokens.device)
            return Acceptance(len(path) - 1, nodes, sample(p, self.generator))

    def _try_children(self, p: torch.Tensor, q_head: torch.Tensor, head_to_base: torch.Tensor,
                      candidates: torch.Tensor, kids: list[tuple[int, int]]) -> tuple[int | None, torch.Tensor]:
        """Recursive rejection over one node's candidates; returns ``(accepted child or None, residual r)``.

        ``q_head``: ``(Vh,)`` draft probabilities; ``head_to_base``: ``(Vh,)`` their base ids; ``candidates``:
        ``(k,)`` head ids in draw order.
        """
        q = torch.zeros(self.vocab_size, dtype=p.dtype, device=p.device)  # (V,), zero outside the head vocab
        q[head_to_base] = q_head.to(p.dtype)
        last = kids[-1][0]
        base_ids = head_to_base[candidates[: last + 1]]  # (last+1,)
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


class TypicalAcceptance(_SampledToken):
    """Medusa's typical acceptance (Medusa report, Cai et al. 2024, section 2.3.1). LOSSY: the output is not
    distributed as the base's samples.

    Candidates are the heads' top-k (as for greedy). Walking from the root, a child x is accepted when the base's
    processed distribution p at its parent gives ``p(x) > min(epsilon, delta * exp(-H(p)))``; the first child that
    passes is taken, copied children first, then each group of drawn children by rank (the walk does not search for
    the longest path, which would need the base's logits at every node). The token after the last accepted node is
    sampled from p, so a step with nothing accepted is an ordinary sampling step.
    """

    name = "typical"
    lossless = False
    sampler = TopK()
    rows_at_once = False

    def __init__(self, epsilon: float, delta: float, generator: torch.Generator | None):
        self.epsilon, self.delta, self.generator = epsilon, delta, generator

    def accept(self, draft: DraftTree, logits_at: LogitsAt, predicted: torch.Tensor | None = None) -> Acceptance:
        walk = _Walk(draft)
        node, path = 0, [0]
        while True:
            p = torch.softmax(logits_at(node).float(), dim=-1)  # (V,)
            entropy = torch.special.entr(p).sum()
            threshold = torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)
            # the copied tokens first, as in greedy acceptance
            child = next((c for c in walk.children(node) if p[draft.tokens[c]] > threshold), None)
            if child is None:
                nodes = torch.tensor(path, dtype=torch.long, device=draft.tokens.device)
                return Acceptance(len(path) - 1, nodes, sample(p, self.generator))
            node = child
            path.append(node)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014) on ``uint64`` arrays: a counter-based hash (the same
    value for the same input on every machine, wrapping modulo 2**64)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def gumbel_noise(seed: int, index: int, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``(n,)`` float64 for token ids ``ids`` ``(n,)`` at new-token ``index`` of the draw
    stream ``seed``: a pure function of ``(seed, index, id)`` (a counter-based hash, not a generator's state), so
    the noise at a position does not depend on how many draws came before it, on which ids are asked for, or on the
    device.

    Raises:
        ValueError: ``seed`` or ``index`` outside ``[0, 2**63)``.
    """
    if not (0 <= seed < 2**63 and 0 <= index < 2**63):
        raise ValueError(f"seed and index must lie in [0, 2**63), got seed={seed} index={index}")
    key = _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(index))  # (1,)
    hashed = _splitmix64(key ^ ids.detach().cpu().numpy().astype(np.uint64))  # (n,)
    return torch.from_numpy(-np.log(-np.log(_open_unit(hashed)))).to(ids.device)


def _open_unit(hashed: np.ndarray) -> np.ndarray:
    """``uint64`` hashes -> float64 uniforms in the open interval (0, 1): the top 52 bits plus one half, times
    2**-52 (exact in float64: the largest is 1 - 2**-53, the smallest 2**-53; with 53 bits the half would round
    away at the top and give exactly 1, whose Gumbel noise is +inf)."""
    return ((hashed >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52


def coupled_stream_seed(seed: int) -> int:
    """The coupled draw stream of a request's ``seed`` (any integer, taken modulo 2**64): a hash of the seed
    itself, in ``[0, 2**63)``, so the same seed gives the same stream on every device (a random generator's first
    draw would differ between the CPU's and CUDA's generators)."""
    return int(_splitmix64(np.array([seed % 2**64], dtype=np.uint64))[0] >> np.uint64(1))


class CoupledSampling:
    """Lossless speculative sampling whose output is a function of the seed alone: every token is the base's own
    Gumbel-max draw at its position, and a drafted node is accepted when it names that draw (the drafter-invariant
    speculative decoding of Daliri, Musco and Suresh, "Coupling without communication and drafter-invariant
    speculative decoding", 2024; the Gumbel-max trick: Gumbel 1954, Maddison et al. 2014).

    The token at new-token index ``i`` is ``x_i = argmax_v (l_i(v) + g(seed, i, v))``, where ``l_i`` are the base's
    processed logits there (temperature, top-k, top-p and every other setting, applied on the node's own prefix;
    ``-inf`` outside the support) and ``g`` standard Gumbel noise from a counter-based hash of (seed, i, v)
    (:func:`gumbel_noise`). By the Gumbel-max trick ``x_i`` is distributed as ``softmax(l_i)`` given the prefix, with
    noise independent across positions, so the output is distributed exactly as the base's samples.

    Verification (``accept``): from the root, at a node of depth d the rule computes ``x`` at index ``i + d`` from
    the node's logits; the first child (copied children first, then drawn ones by rank) whose token is ``x`` is
    accepted and the walk goes on there; when none is, ``x`` is the step's last (bonus) token. Every emitted token is
    thus ``x`` at its index, computed from the same prefix as without drafts: **the tokens are the same for any
    drafter, tree, batch or server load**, and equal to plain decoding's with this rule and seed (up to the float
    rounding of the logits, as greedy decoding's equality is). Candidates are the drafter's top-k (:class:`TopK`);
    at a parent the acceptance probability is the base's probability of the drafted children, what recursive
    rejection sampling gives for deterministic drafts. (Drafting the candidates with the same noise, the top-k of
    the heads' warped logits plus ``g`` at the children's index, accepted less with the shipped heads:
    docs/sampling.md.)

    Args:
        seed: the draw stream, in ``[0, 2**63)`` (a request's seed goes through :func:`coupled_stream_seed`).
    """

    name = "coupled"
    lossless = True
    sampler = TopK()
    rows_at_once = False

    def __init__(self, seed: int):
        if not 0 <= seed < 2**63:
            raise ValueError(f"the coupled draw stream's seed must lie in [0, 2**63), got {seed}")
        self.seed = seed
        self.index = 0
        """New-token index of the next token this rule chooses (0: the prefill token)."""

    def draw_at(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        """The base's token ``()`` at new-token ``index`` from its processed logits ``(V,)``: the Gumbel-max draw
        over the logits above ``-inf`` (the first such id on a tie). Where some logits are ``+inf`` (a temperature
        so small that the logits overflowed), the distribution is uniform over those, and the draw is among them.

        Raises:
            ValueError: a logit is NaN, or every logit is ``-inf`` (nothing can be drawn).
        """
        top = float(logits.max())  # NaN when any logit is
        if math.isnan(top):
            raise ValueError("coupled sampling: the base's processed logits hold NaN")
        if top == -math.inf:
            raise ValueError("coupled sampling: every logit is -inf after the logits processors")
        if top == math.inf:  # softmax puts all the mass on the +inf logits, equally
            support = (logits == top).nonzero()[:, 0]  # (n,)
            return support[int(gumbel_noise(self.seed, index, support).argmax())]
        support = (logits > -math.inf).nonzero()[:, 0]  # (n,)
        scores = logits[support].double() + gumbel_noise(self.seed, index, support)  # (n,)
        return support[int(scores.argmax())]

    def next_token(self, logits: torch.Tensor) -> torch.Tensor:
        token = self.draw_at(logits, self.index)
        self.index += 1
        return token

    def accept(self, draft: DraftTree, logits_at: LogitsAt, predicted: torch.Tensor | None = None) -> Acceptance:
        walk = _Walk(draft)
        node, path = 0, [0]
        while True:
            x = self.draw_at(logits_at(node), self.index + len(path) - 1)
            child = next((c for c in walk.children(node) if int(draft.tokens[c]) == int(x)), None)
            if child is None:
                self.index += len(path)
                nodes = torch.tensor(path, dtype=torch.long, device=draft.tokens.device)
                return Acceptance(len(path) - 1, nodes, x)
            node = child
            path.append(node)


@register_acceptance("greedy")
def _greedy(decoding, vocab_size: int, generator) -> GreedyAcceptance:
    return GreedyAcceptance()


@register_acceptance("rejection")
def _rejection(decoding, vocab_size: int, generator) -> RejectionSampling:
    return RejectionSampling(vocab_size, decoding.draft_warp(), generator)


@register_acceptance("typical")
def _typical(decoding, vocab_size: int, generator) -> TypicalAcceptance:
    return TypicalAcceptance(decoding.typical_epsilon, decoding.typical_delta, generator)


@register_acceptance("coupled")
def _coupled(decoding, vocab_size: int, generator) -> CoupledSampling:
    if decoding.seed is not None:
        seed = coupled_stream_seed(decoding.seed)
    else:  # a fresh stream
        seed = int(torch.randint(0, 2**62, (), generator=generator, device=generator.device))
    return CoupledSampling(seed)
