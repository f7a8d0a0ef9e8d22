"""The per-step tree: each step's candidate tree grown from the drafts' calibrated confidence and this machine's
measured cost of every extra node (pure tensor code).

A fixed tree is right for one machine and one kind of text. EAGLE-2 (Li et al. 2024, section 4) grows the tree each
step from the draft model's confidence; here the confidence is first calibrated into an acceptance probability
(:mod:`medusa.drafters.calibration`), and every node is weighed against what the verify forward charges for it on
this machine (:mod:`medusa.profile`; measured by :mod:`medusa.tools.measure`).

A node's value is the probability that the base accepts its whole path: the product along the path of each node's
calibrated acceptance probability given its parent was accepted. Greedy acceptance emits one token plus the accepted
path, so a tree's expected tokens are ``1 + sum of its nodes' values`` (Medusa report, Cai et al. 2024, section
2.1.2; each node counted once, twins aside). Its cost is the measured forward over its nodes plus the head calls
made to draft it. A candidate is kept when it raises this step's expected tokens per second:
``value / extra seconds > expected tokens / seconds`` so far. When not even the first candidate pays, the step is a
plain decoding step (the root alone).

The tree is grown one depth at a time, as the heads draft it (one batched head call per depth, :mod:`medusa.drafters
.heads_drafter`). The heads are called at a depth only when its best conceivable candidate would pay for its node
and the call. The prompt-lookup chain is one more branch from the root (:mod:`medusa.drafters.prompt_lookup`), its
nodes valued by the calibration's table for the matched n-gram length and their place in the chain.

Lossless with sampling too: which candidates of a parent are kept is decided before they are drawn, from the sorted
probabilities of the distribution they are drawn from (``q``), never from the drawn tokens themselves; a parent's
kept candidates are always its first ranks. Whether a node gets children may depend on its own token (the Hydra
heads' next distribution does); that leaves recursive rejection sampling exact (:class:`medusa.decode.acceptance.
RejectionSampling`), which the chi-square test checks.

The tree's size then settles on a bucket: the sizes an engine pads to (``step_buckets``; ``fixed_shapes``: one
compilation per size), or else the sizes the machine profile measured, whose cost is known rather than interpolated
(a forward's cost jumps between sizes, by kernel choice). It is filled up to the bucket above with the best
candidates left over, as leaves, or, with deterministic drafts, pruned to the bucket below (its least likely nodes,
leaves first), whichever the measured costs say gives more tokens per second.

Batched decoding (:meth:`PerStepDrafter.propose_rows`) verifies every row's tree in one forward, so the rows' trees
have one size. Rows that all decode greedily each get a tree of their own shape (each under its own tree attention
mask): grown from the row's own values and its share of the batch's forward, then brought to the size that gives the
whole step the most expected tokens per second (pruned or filled). When a row samples, one shape is grown from the
rows' mean values and the cost of the batch's forward (pruning, which per-row sizes need, is never offered to sampled
drafts); each row fills it with its own drafts and keeps its own acceptance.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import operator
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from medusa.decode.tree import TreeBuffers, layout_from_parents
from medusa.drafters.base import DraftSampler, DraftTree, Draws, TopK, register_drafter
from medusa.drafters.calibration import (
    CALIBRATION_FILE_NAME,
    Calibration,
    CalibrationMismatchError,
    check_calibration,
    heads_identity,
    load_calibration,
)
from medusa.drafters.heads_drafter import HeadsState
from medusa.drafters.prompt_lookup import lookup_match
from medusa.profile import STEP_SIZES, heads_key, interpolate

logger = logging.getLogger(__name__)

DEFAULT_MAX_NODES = 48
"""The most nodes (root included) a per-step tree may have by default."""
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Step sizes a ``fixed_shapes`` engine without its own ``step_buckets`` is given trees of."""
STAND_IN_FORWARD_S = {1: 0.040, 4: 0.057, 8: 0.079, 16: 0.086, 32: 0.135, 64: 0.211}
"""Seconds of one forward over n new tokens used where no profile is stored: a 135M base in float32 through the
static engine on the developers' two cores (docs/engines.md), rounded. Only their ratios steer the tree; a measured
profile replaces them."""
STAND_IN_LEVEL_S = 0.0015
"""Seconds of one head call per depth used where the profile holds none for these heads (Hydra heads on the same
machine took 1.0 to 2.0 ms per depth)."""


class StepCost:
    """What a step costs on this machine, in seconds: the verify forward over n tree nodes per row (at batch size
    B: the forward over ``B * n`` tokens, an approximation) and each depth's head call per row.

    The forward curve is made non-decreasing in n (a larger forward is never counted cheaper than a smaller one,
    whatever the measuring noise), and with ``buckets`` every size costs what its bucket costs.

    Args:
        forward_s: ``{n: seconds}`` of one forward over n new tokens (measured sizes; linear in between).
        level_s: ``(K,)`` seconds of one head call, by depth.
        buckets: step sizes an engine pads to, or ``None``.

    Raises:
        ValueError: an empty curve, or a cost that is not positive and finite.
    """

    def __init__(self, forward_s: dict[int, float], level_s: list[float], buckets: tuple[int, ...] | None = None):
        if not forward_s or any(not (0 < float(v) < float("inf")) for v in [*forward_s.values(), *level_s]):
            raise ValueError(f"step costs must be positive and finite: forward {forward_s}, heads {level_s}")
        self._interpolate = lambda n: interpolate({int(k): float(v) for k, v in forward_s.items()}, n)
        self.level_s = [float(v) for v in level_s]
        self.buckets = tuple(sorted(buckets)) if buckets else None
        self._table: list[float] = [0.0]
        self.node_s = 0.0
        """Seconds charged per node of each row on top of the forward (:meth:`charging_nodes`)."""

    @classmethod
    def from_profile(cls, profile, engine: str, heads, buckets: tuple[int, ...] | str | None = "measured",
                     level_s: list[float] | None = None, why: str = "given") -> StepCost:
        """The costs ``profile`` (:class:`medusa.profile.MachineProfile`, or ``None``) stored for ``engine`` and
        ``heads``; ``buckets`` ``"measured"``: the step sizes the profile timed (a tree then runs only sizes whose
        cost was measured, not interpolated). ``level_s`` (the heads' seconds per depth, e.g. just measured)
        overrides the stored figures. What the profile lacks is taken from the stand-ins :data:`STAND_IN_FORWARD_S`
        and :data:`STAND_IN_LEVEL_S`, said in one warning (``why``: why there is no profile); nothing is measured
        here (:mod:`medusa.tools.measure` does, when asked).
        """
        entry = profile.engines.get(engine, {}) if profile is not None else {}
        if level_s is None and profile is not None:
            level_s = profile.drafter_cost(heads_key(heads))
        lacking = []
        if "forward_s" in entry:
            curve = {int(k): v for k, v in entry["forward_s"].items()}
        else:
            curve = {n: interpolate(STAND_IN_FORWARD_S, n) for n in STEP_SIZES}
            lacking.append(f"the {engine} engine's forward" if profile is not None else "every figure")
        if level_s is None:
            level_s = [STAND_IN_LEVEL_S] * heads.config.num_heads
            if profile is not None:
                lacking.append("these heads' drafting cost")
        if lacking:
            where = f"the machine profile {profile.path} lacks" if profile is not None else (
                f"no machine profile of this model here ({why}):")
            logger.warning("per-step tree: %s %s, so stand-in costs are used, not measured (`medusa profile --base "
                           "BASE --heads HEADS --engines %s` measures them)", where, " and ".join(lacking), engine)
        return cls(curve, level_s, tuple(sorted(curve)) if buckets == "measured" else buckets)

    def forward(self, tokens: int) -> float:
        """Seconds of a forward over ``tokens`` new tokens (non-decreasing in ``tokens``)."""
        while len(self._table) <= tokens:
            self._table.append(max(self._table[-1], self._interpolate(len(self._table))))
        return self._table[tokens]

    def bucket(self, n: int) -> int:
        """The step size a forward over ``n`` nodes runs at: the smallest bucket >= n (``n`` past the last)."""
        if self.buckets is None:
            return n
        return next((b for b in self.buckets if b >= n), n)

    def verify(self, n: int, batch: int = 1, smooth: bool = False) -> float:
        """Seconds of verifying trees of ``n`` nodes (root included) for ``batch`` rows: at ``n``'s bucket, or
        (``smooth``) along the interpolated curve, which the tree is grown on before its size settles on a
        bucket."""
        return self.forward((n if smooth else self.bucket(n)) * batch) + self.node_s * n * batch

    def extra(self, n: int, batch: int = 1) -> float:
        """Seconds one more node adds to a tree of ``n`` nodes along the smooth curve: ``verify(n + 1, batch, True) -
        verify(n, batch, True)``, remembered (the tree's growth asks for it once per candidate)."""
        memo = self.__dict__.get("_extra")
        if memo is None:
            memo = self.__dict__["_extra"] = {}
        key = (n, batch, self.node_s)  # node_s: a changed charge is not read from the remembered ones
        seconds = memo.get(key)
        if seconds is None:
            seconds = memo[key] = self.verify(n + 1, batch, True) - self.verify(n, batch, True)
        return seconds

    def charging_nodes(self, node_s: float, level_s: list[float] | None = None) -> StepCost:
        """These costs with ``node_s`` seconds more per node of each row in every verify (the step's work outside
        the forward and the head calls that grows with the tree: :attr:`PerStepDrafter.node_overhead_s`), and the
        head calls at ``level_s`` by depth where given (:attr:`PerStepDrafter.level_learned_s`)."""
        charged = object.__new__(type(self))  # a copy sharing the measured curve and its table (made about every
        charged.__dict__.update(self.__dict__)  # greedy step, as the learned overhead moves: copy.copy costs more)
        charged.__dict__.pop("_extra", None)  # its own node_s: not this one's remembered extras
        charged.node_s = node_s
        if level_s is not None:
            charged.level_s = list(level_s)
        return charged

    def level(self, depth: int, batch: int = 1) -> float:
        """Seconds of drafting depth ``depth + 1`` (head ``depth``) for ``batch`` rows."""
        return self.level_s[min(depth, len(self.level_s) - 1)] * batch


@dataclass
class _Candidate:
    """A possible node: candidate ``rank`` of the parent in ``slot`` of the depth's drafted parents, or the next
    node of the prompt-lookup chain (``rank`` -1)."""

    value: float
    """Mean over rows of the probability that its path is accepted."""
    parent: int
    rank: int
    slot: int = -1


@dataclass
class _Level:
    """One depth's head call: the nodes drafted from, and per row what was drawn there."""

    parents: list[int]
    logits: list[torch.Tensor]
    """Per row ``(P, Vh)``."""
    candidates: list[torch.Tensor]
    """Per row ``(P, k)`` head-vocabulary ids in draw order."""
    q: list[torch.Tensor | None]
    """Per row ``(P, Vh)`` the distribution drawn from, or ``None`` (top-k)."""
    child_values: list[list[list[float]]]
    """``(B, P, k)`` each candidate's path value."""
    base_ids: list[list[list[int]]]
    """``(B, P, k)`` each candidate's base token id."""
    kept: list[tuple[int, int, int]] = field(default_factory=list)
    """``(node, slot, rank)`` of the candidates made nodes."""
    child_accept: list[list[list[float]]] = field(default_factory=list)
    """``(B, P, k)`` each candidate's calibrated acceptance probability given its parent (before a row's seen
    scale)."""


@dataclass
class PerStepState(HeadsState):
    """A sequence's drafting state, and the running rate its trees are weighed against: moving averages of the
    tokens each step emitted and of the seconds the cost model gave the step (:data:`RATE_DECAY`)."""

    tokens: float = 1.0
    seconds: float = 0.0
    """0 until the first step: the plain step's cost is taken then."""
    last_seconds: float = 0.0
    predicted: dict[int, float] = field(default_factory=dict)
    """Per kind of drafted node (a head's: ``2 (depth - 1)`` for its parent's first candidate, ``2 (depth - 1) + 1``
    for the later ones; :data:`CHAIN` for the prompt-lookup chain), the decayed sum of the calibrated acceptance
    probabilities of such nodes whose parent was accepted (:data:`SEEN_DECAY`)."""
    accepted: dict[int, float] = field(default_factory=dict)
    """Per kind, the decayed count of those nodes the base accepted."""
    last_nodes: list[tuple[int, int, int, float]] = field(default_factory=list)
    """The last tree's drafted nodes: ``(node, parent, kind, calibrated acceptance given the parent)``."""
    step_started: float = 0.0
    """``time.perf_counter()`` when the last timed step's tree was proposed (0: none yet)."""
    step_model_s: float = 0.0
    """What the cost model gave that step, without the per-node overhead (:attr:`PerStepDrafter.node_overhead_s`)."""
    step_nodes: int = 0
    """That step's nodes over all its rows."""

    def seen_scale(self, kind: int) -> float:
        """How far the base accepted this sequence's drafts of ``kind`` (see :attr:`predicted`) more
        (> 1) or less (< 1) often than the calibration said, shrunk towards 1 by :data:`SEEN_PRIOR` (1 before any
        step)."""
        return (self.accepted.get(kind, 0.0) + SEEN_PRIOR) / (self.predicted.get(kind, 0.0) + SEEN_PRIOR)


CHAIN = -1
"""The prompt-lookup chain's first node's kind in :class:`PerStepState`'s seen acceptance (its later nodes:
``CHAIN - 1``; the first is accepted far more often than the calibration's n-gram table says on text that copies
little, the later ones less)."""
OVERHEAD_DECAY = 0.95
"""Weight of the past in the learned per-node overhead (:attr:`PerStepDrafter.node_overhead_s`)."""


RATE_DECAY = 0.85
"""Weight of the past in the running rate (about the last seven steps count)."""
SEEN_DECAY = 0.97
"""Weight of the past in a sequence's seen acceptance (:meth:`PerStepState.seen_scale`; about the last 30 steps)."""
SEEN_PRIOR = 1.0
"""Pseudo-count, in expected accepted nodes, shrinking the seen acceptance's scale towards the calibration's."""
OBJECTIVES = ("throughput", "step")
"""``throughput``: a node pays when its value beats the sequence's running tokens per second times its extra seconds
(Dinkelbach's rule for the long-run rate of tokens per second); ``step``: when it raises this step's own expected
tokens per second."""


@register_drafter("per-step")
class PerStepDrafter:
    """Heads (and prompt lookup) proposing each step a tree grown from calibrated confidence and measured cost (see
    module docstring).

    Args:
        heads: :class:`medusa.drafters.heads.MedusaHeads` or :class:`medusa.drafters.heads.HydraHeads`.
        calibration: their :class:`medusa.drafters.calibration.Calibration` (checked against them).
        cost: this machine's :class:`StepCost`.
        lookup_length: longest prompt-lookup chain (default: the calibration's; 0: none).
        max_nodes: most nodes of a tree, root included.
        top_k: most candidates per parent (at most the calibration's ``top_k``).
        max_parents: most nodes drafted from at one depth.
        learn_level_cost: greedy trees charge a head call what this drafter's own calls took
            (:attr:`level_learned_s`); off by default.
        row_trees: in batched decoding, rows that all decode greedily get trees of their own shapes, of one size
            (:meth:`_propose_each_row`); ``False``: one shape for all rows, from their mean values.

    Raises:
        medusa.drafters.calibration.CalibrationMismatchError: the calibration is for other heads.
        ValueError: ``max_nodes``, ``top_k`` or ``max_parents`` < 1, or a lookup chain longer than calibrated.
    """

    trainable = False
    training_objective = None

    def __init__(self, heads, calibration: Calibration, cost: StepCost, lookup_length: int | None = None,
                 max_nodes: int = DEFAULT_MAX_NODES, top_k: int = 4, max_parents: int = 2,
                 objective: str = "step", learn_acceptance: bool = True, learn_level_cost: bool = False,
                 row_trees: bool = True):
        check_calibration(calibration, heads_identity(heads))
        if calibration.num_heads != heads.config.num_heads:
            raise CalibrationMismatchError(f"the calibration's tables hold {calibration.num_heads} depths, the heads "
                                           f"{heads.config.num_heads}")
        lookup_length = calibration.lookup_length if lookup_length is None else lookup_length
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
        self.objective = objective
        if max_nodes < 1 or top_k < 1 or max_parents < 1:
            raise ValueError(f"max_nodes, top_k and max_parents must be >= 1, got {max_nodes}, {top_k}, {max_parents}")
        if not 0 <= lookup_length <= calibration.lookup_length:
            raise ValueError(f"a prompt-lookup chain of {lookup_length} tokens, but the calibration measured "
                             f"{calibration.lookup_length} positions")
        self.heads, self.calibration, self.cost = heads, calibration, cost
        self.lookup_length, self.top_k, self.max_parents = lookup_length, min(top_k, calibration.top_k), max_parents
        self.max_nodes = max_nodes
        self.learn_acceptance = learn_acceptance
        self.node_overhead_s = 0.0
        """Seconds a step costs beyond the cost model's verify and head calls, per node of a row: learned from the
        wall time of one sequence's greedy steps (decoding whose output no tree changes; a batch's rounds also run
        other requests' prefill), and used for greedy trees, batched ones too; sampled decoding leaves it out, so
        that its trees, and the random numbers they draw, do not depend on timing."""
        self._overhead_sums = [0.0, 0.0]  # decayed (unmodeled seconds, nodes) of the timed steps
        self.learn_level_cost = learn_level_cost
        self.level_learned_s: list[float] | None = None
        """With ``learn_level_cost``: seconds of a head call by depth as one sequence's greedy steps measured them,
        never above the cost model's figure (the profile times a call with its weights flushed from the caches,
        which can overstate what a call right after a forward pays); used, as :attr:`node_overhead_s`, for greedy
        trees only. Off by default: a load run with it on was slower at 1 and 64 clients (docs/serve.md, run 9),
        not yet separated from the machine's own drift."""
        self._level_sums: list[list[float]] = []  # per depth: decayed (seconds, calls), the model's figure a prior
        self.max_depth = max(heads.config.num_heads, min(lookup_length, max_nodes - 1))
        self.base_layers = tuple(heads.base_layers)
        self._rows_together = getattr(heads, "drafts_rows_together", False)  # test doubles may not declare it
        self._drafts_from_drafted = getattr(heads, "drafts_from_drafted_parents", False)
        self.row_trees = row_trees
        """Rows that all decode greedily get trees of their own shapes (:meth:`_propose_each_row`), else one shape
        for all rows."""
        self.typical_nodes = min(16, max_nodes)
        """The step size an engine is chosen for (``--engine auto``)."""
        self._tables: dict = {}  # per device: the calibration's tables, as tensors and as lists
        self._layouts: OrderedDict[tuple, TreeBuffers] = OrderedDict()

    @classmethod
    def load(cls, heads_dir, heads, cost: StepCost, **options) -> PerStepDrafter:
        """The heads of ``heads_dir`` (already loaded: ``heads``) with the folder's ``calibration.json``.

        Raises:
            FileNotFoundError: the folder has no calibration.
            ValueError, medusa.drafters.calibration.CalibrationMismatchError: a damaged calibration, or one for other
                heads (e.g. heads trained again after it was measured: their weights file differs).
        """
        from medusa.io.checkpoint import HEADS_WEIGHTS_NAME

        path = Path(heads_dir) / CALIBRATION_FILE_NAME
        calibration = load_calibration(path)
        check_calibration(calibration, heads_identity(heads, Path(heads_dir) / HEADS_WEIGHTS_NAME),
                          f"calibration file {path}")
        return cls(heads, calibration, cost, **options)

    def settings(self) -> dict:
        """What the bench records about the drafter."""
        return {"drafter": self.name, "max_nodes": self.max_nodes, "lookup_length": self.lookup_length,
                "top_k": self.top_k, "max_parents": self.max_parents, "buckets": self.cost.buckets,
                "calibration": self.calibration.source}

    # -- per-sequence state (as the heads' drafter) -------------------------------------------------------------------
    def new_state(self) -> PerStepState:
        return PerStepState(self.heads.new_context())

    def start(self, state: HeadsState, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        state.hidden = self.heads.extend_context(state.context, hidden, next_tokens)  # (H,)

    def update(self, state: PerStepState, draft: DraftTree, path: torch.Tensor, hidden: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        state.hidden = self.heads.extend_context(state.context, hidden, next_tokens)  # (H,)
        if self.learn_acceptance and state.last_nodes:
            self._see(state, set(path.tolist()))
        state.tokens = RATE_DECAY * state.tokens + (1 - RATE_DECAY) * len(next_tokens)
        state.seconds = RATE_DECAY * state.seconds + (1 - RATE_DECAY) * state.last_seconds

    @staticmethod
    def _see(state: PerStepState, accepted: set[int]) -> None:
        """Fold the last tree's outcome into the sequence's seen acceptance: each heads-drafted node whose parent
        was accepted adds its calibrated probability to its kind's prediction, and 1 to its count if accepted."""
        for kind in state.predicted:
            state.predicted[kind] *= SEEN_DECAY
            state.accepted[kind] *= SEEN_DECAY
        for node, parent, kind, p in state.last_nodes:
            if parent in accepted:
                state.predicted[kind] = state.predicted.get(kind, 0.0) + p
                state.accepted[kind] = state.accepted.get(kind, 0.0) + (node in accepted)
        state.last_nodes = []

    # -- proposing ----------------------------------------------------------------------------------------------------
    def propose(self, state: HeadsState, root: torch.Tensor, sequence: torch.Tensor,
                sampler: DraftSampler) -> DraftTree:
        return self.propose_rows([state], root[None], [sequence], sampler)[0]

    def _device_tables(self, device: torch.device):
        if device not in self._tables:
            edges, acceptance, lookup = self.calibration.tables(device)
            vocab = self.heads.to_base_ids(torch.arange(self.heads.head_vocab_size, device=device))  # (Vh,)
            self._tables[device] = (edges[1:-1].contiguous(), acceptance, lookup, vocab, acceptance[:, -1].tolist())
        return self._tables[device]

    def propose_rows(self, states: list[PerStepState], roots: torch.Tensor, sequences: list[torch.Tensor],
                     sampler: DraftSampler | list[DraftSampler]) -> list[DraftTree]:
        """Trees of one size for ``B`` rows (see module docstring): rows that all decode greedily each get a tree of
        their own shape (:attr:`row_trees`, :meth:`_propose_each_row`), otherwise one shape grown from the rows'
        mean values, each row filling it with its own drafts.

        Args:
            states: each row's drafting state.
            roots: ``(B,)`` long, each row's tree root.
            sequences: each row's prompt and emitted tokens ``(S_b,)``, the root last.
            sampler: how candidates are drawn (:meth:`medusa.drafters.base.TopK.draw_ranked`), one for all rows or
                one per row (rows that sample, each with its own generator, beside greedy rows).

        Returns:
            ``B`` :class:`medusa.drafters.base.DraftTree` s with the same number of nodes (one layout, or with
            :attr:`row_trees` one per row); the first carries the time spent choosing the trees (``choose_s``, head
            calls excluded).
        """
        start = time.perf_counter()
        device, batch = roots.device, len(roots)
        samplers = sampler if isinstance(sampler, list) else [sampler] * batch
        greedy = all(getattr(s, "greedy", False) for s in samplers)
        timed = greedy and batch == 1  # a batch's rounds also run other requests' prefill: not a step's time alone
        if timed:
            self._time_last_step(states[0], start)
        cost = self._charged_cost() if greedy else self.cost
        if greedy and batch > 1 and self.row_trees:
            drafts, in_heads = self._propose_each_row(states, roots, sequences, samplers, cost)
        else:
            grown = self._grow(states, roots, sequences, samplers, cost, greedy, timed)
            seconds = grown.seconds
            for state in states:
                state.last_seconds = seconds
                if timed:
                    state.step_started, state.step_nodes = start, len(grown.tree.parents) * batch
                    state.step_model_s = grown.draft_s + self.cost.verify(len(grown.tree.parents), batch)
            self._record_nodes(states, grown)
            drafts = self._assemble(grown.tree, grown.levels, self._device_tables(device)[3], device)
            in_heads = grown.in_heads
        drafts[0].choose_s = time.perf_counter() - start - in_heads
        return drafts

    def _propose_each_row(self, states: list[PerStepState], roots: torch.Tensor, sequences: list[torch.Tensor],
                          samplers: list[DraftSampler], cost: StepCost) -> tuple[list[DraftTree], float]:
        """Greedy rows, each with a tree of its own shape, all of one size (one forward verifies them, each row
        under its own tree attention mask): each row's tree is grown alone from its own values, charged its share
        of the batch's forward (:class:`_RowShare`: a node of every row costs ``extra(n, B)``, so one row's node
        ``extra(n, B) / B``) and its own head calls; then the batch's size is the one of the rows' sizes that gives
        the most expected tokens per second of the whole step, each row pruned to it (its least likely nodes, leaves
        first) or filled up to it (its best candidates left over, then, when none is left, copies of its root as
        leaves: valid drafts the base may even accept). A confident row drafts deep where an unsure one would have
        spent the same nodes on a shape chosen from the mean of both. Returns ``(drafts, seconds in head calls)``."""
        batch, device = len(states), roots.device
        grown = self._grow_rows(states, roots, sequences, samplers, cost)
        draft_s = sum(g.draft_s for g in grown)
        sizes = sorted({len(g.tree.parents) for g in grown})
        running = sum(s.tokens for s in states) / (sum(s.seconds for s in states) / batch)
        plans = {size: [self._resize_plan(g, size) for g in grown] for size in sizes}

        def score(size: int) -> float:
            gain = sum(plan[0] for plan in plans[size])
            seconds = draft_s + cost.verify(size, batch)
            return gain / seconds if self.objective == "step" else gain - running * seconds

        size = max(sizes, key=score)
        seconds = draft_s + cost.verify(size, batch)
        vocab = self._device_tables(device)[3]
        drafts = []
        for g, (_, action) in zip(grown, plans[size], strict=True):
            if action[0] == "prune":
                g.tree, g.levels = g.tree.without(action[1], g.levels)
            else:
                for c, depth, level in action[1]:
                    g.tree.add(c, depth, level, g.chain)
                g.tree.pad(size)
            drafts.extend(self._assemble(g.tree, g.levels, vocab, device))
        for state, g in zip(states, grown, strict=True):
            state.last_seconds = seconds
            self._record_nodes([state], g)
        return drafts, sum(g.in_heads for g in grown)

    @staticmethod
    def _resize_plan(grown: _Grown, size: int):
        """How a row's grown tree comes to ``size`` nodes: ``(expected tokens, ("prune", removed nodes))`` or
        ``(expected tokens, ("fill", candidates to add))`` (any nodes still missing are copies of the root, worth
        nothing)."""
        tree, n = grown.tree, len(grown.tree.parents)
        if n > size:
            removed, lost = _prunable(tree, n - size)
            return grown.expected - lost, ("prune", removed)
        fills = PerStepDrafter._plan_fill(tree, grown.leftovers, size - n)
        return grown.expected + sum(c.value for c, _, _ in fills), ("fill", fills)

    def _record_nodes(self, states: list[PerStepState], grown: _Grown) -> None:
        """Remember each row's drafted nodes and their calibrated acceptance, for its seen acceptance
        (:meth:`_see`)."""
        if not self.learn_acceptance:
            return
        tree, levels = grown.tree, grown.levels
        for b, state in enumerate(states):
            state.last_nodes = [(node, tree.parents[node], 2 * (tree.depths[node] - 1) + (rank > 0),
                                 level.child_accept[b][slot][rank])
                                for level in levels for node, slot, rank in level.kept]
            state.last_nodes += [(node, tree.parents[node], CHAIN - min(j, 1), grown.chain_conditional[b][j])
                                 for j, node in enumerate(tree.lookup)]

    def _grow(self, states: list[PerStepState], roots: torch.Tensor, sequences: list[torch.Tensor],
              samplers: list[DraftSampler], cost: StepCost, greedy: bool, timed: bool) -> _Grown:
        """Grow one tree shape for ``states``' rows from their mean values against ``cost``, one depth at a time,
        then settle its size on a bucket (see module docstring)."""
        growing = self._growth(states, roots, sequences, samplers, cost, timed)
        request = _advance(growing, None)
        while not isinstance(request, _Grown):
            depth, states, tree, chosen, samplers, device = request
            start = time.perf_counter()
            level = self._draft_level(depth, states, tree, chosen, samplers, device,
                                      together=greedy and self._rows_together)
            request = _advance(growing, (level, time.perf_counter() - start))
        return request

    def _grow_rows(self, states: list[PerStepState], roots: torch.Tensor, sequences: list[torch.Tensor],
                   samplers: list[DraftSampler], cost: StepCost) -> list[_Grown]:
        """Grow one tree for each greedy row alone, charged its share of the batch's costs (:class:`_RowShare`):
        the rows' growths run side by side, and the rows wanting the same depth's head call share one call (each
        row's candidates are its own top ranks, whatever rows sit beside it)."""
        share = _RowShare(cost, len(states))
        growths = [self._growth([state], roots[b : b + 1], [sequences[b]], [samplers[b]], share, False, len(states))
                   for b, state in enumerate(states)]
        results = [_advance(g, None) for g in growths]  # each a head call's request, or the grown tree
        while not all(isinstance(r, _Grown) for r in results):
            depth = min(r[0] for r in results if not isinstance(r, _Grown))
            rows = [b for b, r in enumerate(results) if not isinstance(r, _Grown) and r[0] == depth]
            start = time.perf_counter()
            levels = self._draft_levels_pooled(depth, [results[b] for b in rows])
            spent = (time.perf_counter() - start) / len(rows)
            for b, level in zip(rows, levels, strict=True):
                results[b] = _advance(growths[b], (level, spent))
        return results

    def _draft_levels_pooled(self, depth: int, requests: list) -> list[_Level]:
        """Head ``depth`` for several one-row growths (their ``(depth, [state], tree, chosen, [sampler], device)``
        requests) in one head call: each row's parents' paths side by side, each row's candidates its own top
        ranks (greedy: the sampler is top-k)."""
        if len(requests) == 1 or not self._rows_together:
            return [self._draft_level(*request) for request in requests]
        paths = [self._path_tokens(tree, chosen)[0] for _, _, tree, chosen, _, _ in requests]  # (P_b, depth + 1)
        widths = [len(p) for p in paths]
        hidden = torch.cat([states[0].hidden.expand(w, -1) for (_, states, _, _, _, _), w in
                            zip(requests, widths, strict=True)])  # (sum P_b, H)
        logits, cands, _, ranked = self._draw(depth, hidden, torch.cat(paths).to(requests[0][5]), requests[0][4][0])
        out, first = [], 0
        for request, w in zip(requests, widths, strict=True):
            drawn = [(logits[first : first + w], cands[first : first + w], None, ranked[first : first + w])]
            out.append(self._draft_level(*request, drawn=drawn))
            first += w
        return out

    @staticmethod
    def _path_tokens(tree: _Growing, chosen: list[int]) -> torch.Tensor:
        """``(B, P, depth + 1)`` long: each row's tokens from the root down to each chosen node."""
        paths = [_path(tree.parents, node) for node in chosen]
        return torch.tensor([[[row[i] for i in path] for path in paths] for row in tree.tokens], dtype=torch.long)

    def _growth(self, states: list[PerStepState], roots: torch.Tensor, sequences: list[torch.Tensor],
                samplers: list[DraftSampler], cost, timed: bool, share: int = 1):
        """The growth of one tree shape (:meth:`_grow`) as a generator: it yields each head call it wants,
        ``(depth, states, tree, chosen nodes, samplers, device)``, is sent ``(the _Level, seconds it took)``, and
        returns the :class:`_Grown`. ``cost``: a :class:`StepCost`, or a row's :class:`_RowShare` of a batch of
        ``share`` rows (the running rate is then the batch's)."""
        in_heads = 0.0
        device, batch = roots.device, len(roots)
        inner_edges, acceptance, lookup_table, vocab, best_accept = self._device_tables(device)
        tree = _Growing([-1], [0], [-1], [[int(r)] for r in roots.tolist()], [[1.0] for _ in range(batch)])
        seconds = cost.verify(1, batch)
        draft_s = 0.0  # the head calls' share of ``seconds``
        expected = float(batch)  # a plain step: one token per row
        for state in states:
            state.seconds = state.seconds or seconds * share
        running = sum(s.tokens for s in states) / (sum(s.seconds for s in states) / batch / share)
        step_rate = self.objective == "step"
        chain = chain_conditional = None
        if self.lookup_length:
            drafts = [lookup_match(seq, self.lookup_length, self.calibration.lookup_max_ngram) for seq in sequences]
            if ("lookup", device) not in self._tables:
                self._tables["lookup", device] = lookup_table[:, : self.lookup_length].tolist()
            by_ngram = self._tables["lookup", device]
            # (B, L) each position's acceptance given the one before, by the n-gram each row matched
            chain_conditional = conditional = [by_ngram[n] for _, n in drafts]
            if self.learn_acceptance:  # the first node by its seen scale, the later ones by theirs
                conditional = [[min(1.0, v * s.seen_scale(CHAIN if j == 0 else CHAIN - 1)) for j, v in enumerate(row)]
                               for row, s in zip(conditional, states, strict=True)]
            chain = ([t.tolist() for t, _ in drafts],  # (B, L) tokens
                     [list(itertools.accumulate(row, operator.mul)) for row in conditional])  # (B, L) path values
        if self.learn_acceptance:  # the best a depth may give, after the rows' seen scales
            best_accept = [min(1.0, a * max(s.seen_scale(k) for s in states for k in (2 * d, 2 * d + 1)))
                           for d, a in enumerate(best_accept)]
        levels: list[_Level] = []
        leftovers: list[tuple[_Candidate, int, _Level | None]] = []  # (candidate, its depth, its head call)
        depth = 0
        while len(tree.parents) < self.max_nodes:
            n = len(tree.parents)
            rate = expected / seconds if step_rate else running
            extra = cost.extra(n, batch)
            candidates: list[_Candidate] = []
            level = None
            at_depth = [i for i, d in enumerate(tree.depths) if d == depth]
            if self._drafts_from_drafted and depth >= 2:  # a node below one never drafted from has no draft state
                drafted = {node for lv in levels for node in lv.parents}
                at_depth = [i for i in at_depth if tree.parents[i] in drafted]
            if depth < self.heads.config.num_heads and at_depth:
                mean = [sum(row[i] for row in tree.values) / batch for i in at_depth]
                # Parents whose best conceivable child could pay for its node, best first.
                order = sorted(range(len(at_depth)), key=lambda i: -mean[i])[: self.max_parents]
                chosen = [at_depth[i] for i in order if mean[i] * best_accept[depth] * batch > rate * extra] or [
                    at_depth[order[0]]]
                call = cost.level(depth, batch)
                best = max(mean) * best_accept[depth] * batch
                if best > rate * (extra + call):  # its best candidate could pay for the head call and itself
                    seconds += call
                    draft_s += call
                    level, spent = yield depth, states, tree, chosen, samplers, device  # the head call (_grow drives)
                    in_heads += spent
                    if timed and self.learn_level_cost:
                        self._learn_level(depth, spent)
                    levels.append(level)
                    for slot, node in enumerate(chosen):
                        for rank in range(len(level.child_values[0][slot])):
                            v = sum(row[slot][rank] for row in level.child_values) / batch
                            if v > 0:
                                candidates.append(_Candidate(v, node, rank, slot))
            chain_parent = (tree.lookup[-1] if tree.lookup else 0) if len(tree.lookup) == depth else None
            if chain is not None and chain_parent is not None and depth < self.lookup_length:
                candidates.append(_Candidate(sum(row[depth] for row in chain[1]) / batch, chain_parent, -1))
            if not candidates:
                break
            candidates.sort(key=lambda c: (-c.value, c.rank))  # ties: the lookup, then the lower rank
            kept_here: set[tuple[int, int]] = set()
            for c in candidates:
                n = len(tree.parents)
                extra = cost.extra(n, batch)
                rate = expected / seconds if step_rate else running
                prefix = c.rank <= 0 or (c.slot, c.rank - 1) in kept_here
                if n < self.max_nodes and prefix and c.value * batch > rate * extra:
                    expected += c.value * batch
                    seconds += extra
                    tree.add(c, depth, level, chain)
                    kept_here.add((c.slot, c.rank))
                else:
                    leftovers.append((c, depth, None if c.rank < 0 else level))
            if not kept_here:
                break
            depth += 1
        if cost.buckets is not None:
            tree, levels, expected, leftovers = self._settle(tree, levels, leftovers, chain, expected, draft_s,
                                                             batch, all(isinstance(s, TopK) for s in samplers),
                                                             None if step_rate else running, cost)
            seconds = draft_s + cost.verify(len(tree.parents), batch)
        return _Grown(tree, levels, leftovers, chain, chain_conditional, expected, seconds, draft_s, in_heads)

    def _charged_cost(self) -> StepCost:
        """:attr:`cost` charging the learned per-node overhead and head-call costs (:meth:`StepCost.charging_nodes`),
        made again only when what it charges changed (not every step)."""
        cost = self.cost  # its fields too: one rebound on the drafter's cost is read again, as every step did before
        key = (cost, self.node_overhead_s, None if self.level_learned_s is None else tuple(self.level_learned_s),
               cost.node_s, tuple(cost.level_s), cost.buckets)
        cached = self.__dict__.get("_charged")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_charged"] = (key, self.cost.charging_nodes(self.node_overhead_s,
                                                                                 self.level_learned_s))
        return cached[1]

    def _draft_level(self, depth: int, states: list[PerStepState], tree: _Growing, chosen: list[int],
                     samplers: list[DraftSampler], device: torch.device, together: bool = False,
                     drawn: list | None = None) -> _Level:
        """Head ``depth`` at the ``chosen`` nodes of every row, and the value of every candidate: the parent's
        value times the calibrated acceptance of the candidate's rank-ordered probability (known before the
        draw). ``together`` (every row decodes greedily, and the heads draft rows together): one head call and one
        draw for all rows (each row's top candidates are its own, whatever rows sit beside it, and greedy output
        never depends on the drafts); otherwise each row gets the call a single sequence would make, so a seeded
        sampling row draws as ``generate`` does. ``drawn``: what each row's call gave, made by the caller
        (:meth:`_draft_levels_pooled`)."""
        inner_edges, acceptance, _, vocab, _ = self._device_tables(device)
        if drawn is None:
            drawn = self._draw_rows(depth, states, tree, chosen, samplers, device, together)
        # A few values a row (P x k): Python lists cost less than a dozen small tensor calls here.
        edges, table, vocab_ids = self._list_tables(inner_edges, acceptance, vocab)
        logits, cands, qs, values, base_ids, calibrated = [], [], [], [], [], []
        for b, (state, (row_logits, c, q, ranked)) in enumerate(zip(states, drawn, strict=True)):
            # each candidate's calibrated acceptance by the bin of its ranked probability (0 where it is 0)
            accept = [[table[depth][bisect.bisect_right(edges, r)] if r > 0 else 0.0 for r in row]
                      for row in ranked.float().tolist()]  # (P, k)
            parent = [tree.values[b][i] for i in chosen]  # (P,)
            logits.append(row_logits), cands.append(c), qs.append(q)
            seen = accept
            if self.learn_acceptance:  # rank 0 and the later ranks, each by its own seen scale; a later rank
                # never above an earlier one (a parent's kept candidates are its first ranks): a running minimum
                first, later = state.seen_scale(2 * depth), state.seen_scale(2 * depth + 1)
                seen = [list(itertools.accumulate((min(1.0, a * (later if r else first)) for r, a in enumerate(row)),
                                                  min)) for row in accept]
            values.append([[p * v for v in row] for p, row in zip(parent, seen, strict=True)])
            base_ids.append([[vocab_ids[i] for i in row] for row in c.tolist()])
            calibrated.append(accept)
        return _Level(chosen, logits, cands, qs, values, base_ids, child_accept=calibrated)

    def _draw_rows(self, depth: int, states: list[PerStepState], tree: _Growing, chosen: list[int],
                   samplers: list[DraftSampler], device: torch.device, together: bool) -> list[tuple]:
        """Each row's head call at ``chosen`` and its draw (``together``: one call for all rows, as
        :meth:`_draft_level` says): per row ``(logits (P, Vh), candidates (P, k), q or None, ranked probabilities
        (P, k))``."""
        path_tokens = self._path_tokens(tree, chosen).to(device)  # (B, P, depth + 1)
        batch, width = path_tokens.shape[:2]
        if batch > 1 and together:
            hidden = torch.stack([s.hidden for s in states]).repeat_interleave(width, 0)  # (B*P, H)
            logits_all, c_all, _, ranked_all = self._draw(depth, hidden, path_tokens.flatten(0, 1), samplers[0])
            return [(logits_all.view(batch, width, -1)[b], c_all.view(batch, width, -1)[b], None,
                     ranked_all.view(batch, width, -1)[b]) for b in range(batch)]
        return [self._draw(depth, state.hidden, path_tokens[b], samplers[b])  # (P, Vh), (P, k) ...
                for b, state in enumerate(states)]

    def _list_tables(self, inner_edges: torch.Tensor, acceptance: torch.Tensor, vocab: torch.Tensor):
        """The calibration's inner bin edges, acceptance table ``(depths, bins)`` and head-to-base ids as Python lists
        (made once per device)."""
        key = ("lists", inner_edges.device)
        if key not in self._tables:
            self._tables[key] = (inner_edges.tolist(), acceptance.tolist(), vocab.tolist())
        return self._tables[key]

    def _draw(self, depth: int, hidden: torch.Tensor, path_tokens: torch.Tensor, sampler: DraftSampler):
        """Head ``depth``'s logits ``(P, Vh)`` at ``P`` nodes and ``sampler``'s ranked draw from them: ``(logits,
        candidates (P, k), q or None, ranked probabilities (P, k))``. Top-k draws go through the heads' fused level
        where they offer one (:meth:`medusa.drafters.heads.HydraHeads.draft_ranked`: one C call beside the native
        decoder), the same candidates up to float summation order."""
        if type(sampler) is TopK:
            fused = getattr(self.heads, "draft_ranked", None)
            out = None if fused is None else fused(depth, hidden, path_tokens, self.top_k)
            if out is not None:
                logits, ids, probs = out
                return logits, ids, None, probs
        logits = self.heads.draft_logits(depth, hidden, path_tokens)  # (P, Vh)
        return (logits, *sampler.draw_ranked(logits, self.top_k))

    def _learn_level(self, depth: int, seconds: float) -> None:
        """Fold one greedy single-sequence head call's wall time at ``depth`` into :attr:`level_learned_s`: a
        decayed mean with the cost model's figure as a prior of one call, kept at or below that figure; a call
        over three times the figure (a first call making its products, a pause) is skipped."""
        model = self.cost.level_s
        if not self._level_sums:
            self._level_sums = [[s, 1.0] for s in model]
        prior = model[min(depth, len(model) - 1)]
        if depth >= len(self._level_sums) or seconds > 3 * prior:
            return
        sums = self._level_sums[depth]
        sums[0] = OVERHEAD_DECAY * sums[0] + seconds
        sums[1] = OVERHEAD_DECAY * sums[1] + 1.0
        self.level_learned_s = [min(a / b, s) for (a, b), s in zip(self._level_sums, model, strict=True)]

    def _time_last_step(self, state: PerStepState, now: float) -> None:
        """Fold the last timed step of ``state``'s rows (from its tree's proposal to ``now``, the next one's) into
        :attr:`node_overhead_s`: its wall time beyond what the cost model gave it, per node. A gap of more than
        three times the model's figure is a pause (the caller away), not a step, and is skipped."""
        if not state.step_started or not state.step_nodes:
            return
        elapsed = now - state.step_started
        if elapsed > 3 * state.step_model_s:
            return
        sums = self._overhead_sums
        sums[0] = OVERHEAD_DECAY * sums[0] + (elapsed - state.step_model_s)
        sums[1] = OVERHEAD_DECAY * sums[1] + state.step_nodes
        self.node_overhead_s = max(0.0, sums[0] / sums[1])

    def _settle(self, tree: _Growing, levels: list[_Level], leftovers, chain, expected: float, draft_s: float,
                batch: int, may_prune: bool, rate: float | None, cost=None):
        """Settle the grown tree's size on a bucket: filled up to the bucket above with the best candidates left
        over (as leaves), or, with deterministic drafts (top-k: greedy, typical), pruned to the bucket below (its
        least likely nodes, leaves first), whichever gives more expected tokens per second at the buckets' measured
        cost (``rate``: against the running rate instead). Returns ``(tree, levels, expected tokens, leftovers)``:
        the candidates still left over (none after pruning).

        Pruning is not offered for sampled drafts: whether a drawn candidate is kept must not depend on what was
        drawn below it, which pruning by value would do (see module docstring); filling only adds leaves, whose keep
        decision depends on the candidates' probabilities, never on their draws. When too few candidates are left to
        fill the bucket (``top_k`` x ``max_parents`` per depth bounds them) and pruning is not taken, the size stays
        between buckets: a ``fixed_shapes`` engine then compiles that size too."""
        cost, n = cost or self.cost, len(tree.parents)
        up = min(cost.bucket(n), self.max_nodes)
        fills = self._plan_fill(tree, leftovers, up - n)
        options = [(expected + sum(c.value for c, _, _ in fills) * batch, n + len(fills), "fill")]
        below = max((b for b in cost.buckets if b < n), default=None) if may_prune and cost.bucket(n) != n else None
        if below is not None:
            removed, lost = _prunable(tree, n - below)
            options.append((expected - lost, below, "prune"))

        def score(option) -> float:
            gain, size, _ = option
            seconds = draft_s + cost.verify(size, batch)
            return gain / seconds if rate is None else gain - rate * seconds

        best = max(options, key=score)
        if best[2] == "fill":
            for c, depth, level in fills:
                tree.add(c, depth, level, chain)
            used = {id(item) for item in fills}
            return tree, levels, best[0], [item for item in leftovers if id(item) not in used]
        return (*tree.without(removed, levels), best[0], [])  # the leftovers' parents are renumbered: none kept

    @staticmethod
    def _plan_fill(tree: _Growing, leftovers, room: int) -> list:
        """Up to ``room`` left-over candidates to add as leaves, best first (a parent's kept candidates stay its
        first ranks; the lookup chain stays a chain)."""
        pending = sorted(leftovers, key=lambda item: (-item[0].value, item[0].rank))
        kept = {(id(level), s, r) for level in {id(lv): lv for _, _, lv in leftovers if lv is not None}.values()
                for _, s, r in level.kept}
        chain_len, chain_end = len(tree.lookup), (tree.lookup[-1] if tree.lookup else 0)
        plan, progress = [], True
        while len(plan) < room and progress:
            progress = False
            for item in list(pending):
                if len(plan) >= room:
                    break
                c, depth, level = item
                if c.rank < 0:
                    ok = chain_len == depth and c.parent == chain_end
                else:
                    ok = c.rank == 0 or (id(level), c.slot, c.rank - 1) in kept
                if ok:
                    plan.append(item)
                    pending.remove(item)
                    progress = True
                    if c.rank < 0:
                        chain_len, chain_end = chain_len + 1, -1  # the planned node's index is not known yet
                    else:
                        kept.add((id(level), c.slot, c.rank))
        return plan

    def _assemble(self, tree: _Growing, levels: list[_Level], vocab: torch.Tensor,
                  device: torch.device) -> list[DraftTree]:
        """Each row's :class:`medusa.drafters.base.DraftTree` on the shared layout."""
        parents, ranks = tree.parents, tree.ranks
        key = (tuple(parents), tuple(ranks))
        layout = self._layouts.get(key)
        if layout is None:
            children = [[] for _ in parents]
            for node in sorted(range(1, len(parents)), key=lambda n: (ranks[n], n)):  # copied (-1) first, by rank
                children[parents[node]].append(node)
            layout = layout_from_parents(parents, children, device)
            self._layouts[key] = layout
            if len(self._layouts) > 512:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        groups = []
        indices = self._tables.setdefault(("draw indices", device), {})
        for level in levels:
            if level.kept:
                # (parents, nodes, slots, ranks) as tensors, remembered per level shape: a few shapes recur
                key = (tuple(level.parents), tuple(level.kept))
                made = indices.get(key)
                if made is None:
                    if len(indices) > 1024:
                        indices.clear()
                    made = indices[key] = tuple(torch.tensor(col, dtype=torch.long, device=device)
                                                for col in (level.parents, *zip(*level.kept, strict=True)))
                groups.append((*made, level))
        copied = torch.tensor(tree.lookup, dtype=torch.long, device=device) if tree.lookup else None
        tokens = torch.tensor(tree.tokens, dtype=torch.long, device=device)  # (B, N)
        return [DraftTree(tokens[b], layout,
                          [Draws(parent_ids, level.logits[b], level.candidates[b], nodes, slots, kept_ranks,
                                 level.q[b], vocab) for parent_ids, nodes, slots, kept_ranks, level in groups],
                          copied) for b in range(len(tokens))]


@dataclass
class _Growing:
    """A tree being grown: per node its parent, depth and rank (-1: the root or a copied node); per row and node
    its token and path value; the lookup chain's nodes."""

    parents: list[int]
    depths: list[int]
    ranks: list[int]
    tokens: list[list[int]]
    values: list[list[float]]
    lookup: list[int] = field(default_factory=list)

    def add(self, c: _Candidate, depth: int, level: _Level | None, chain) -> None:
        """Make candidate ``c`` (drafted at ``depth``) the next node."""
        node = len(self.parents)
        self.parents.append(c.parent)
        self.depths.append(depth + 1)
        self.ranks.append(c.rank)
        if c.rank < 0:  # the lookup chain's next token
            for b, (row_tokens, row_values) in enumerate(zip(*chain, strict=True)):
                self.tokens[b].append(row_tokens[depth])
                self.values[b].append(row_values[depth])
            self.lookup.append(node)
        else:
            for b in range(len(self.tokens)):
                self.tokens[b].append(level.base_ids[b][c.slot][c.rank])
                self.values[b].append(level.child_values[b][c.slot][c.rank])
            level.kept.append((node, c.slot, c.rank))

    def pad(self, size: int) -> None:
        """Add copies of the root as its last children until the tree has ``size`` nodes (one row's tree brought to
        its batch's size when no candidate is left: a valid draft, worth nothing to the tree's choice)."""
        while len(self.parents) < size:
            self.parents.append(0)
            self.depths.append(1)
            self.ranks.append(PAD_RANK)
            for row_tokens, row_values in zip(self.tokens, self.values, strict=True):
                row_tokens.append(row_tokens[0])
                row_values.append(0.0)

    def without(self, removed: set[int], levels: list[_Level]) -> tuple[_Growing, list[_Level]]:
        """The tree without the nodes ``removed`` (leaves of what stays), and its head calls renumbered (a parent
        that is gone takes its rows of the call with it)."""
        index = {}
        for old in range(len(self.parents)):
            if old not in removed:
                index[old] = len(index)
        keep = list(index)
        tree = _Growing([self.parents[i] if i == 0 else index[self.parents[i]] for i in keep],
                        [self.depths[i] for i in keep], [self.ranks[i] for i in keep],
                        [[row[i] for i in keep] for row in self.tokens],
                        [[row[i] for i in keep] for row in self.values],
                        [index[i] for i in self.lookup if i in index])
        out = []
        for level in levels:
            rows = [slot for slot, node in enumerate(level.parents) if node in index]
            if not rows:
                continue
            slot_of = {old: new for new, old in enumerate(rows)}
            picked = torch.tensor(rows, dtype=torch.long, device=level.candidates[0].device)
            out.append(_Level([index[level.parents[r]] for r in rows], [x[picked] for x in level.logits],
                              [x[picked] for x in level.candidates],
                              [None if x is None else x[picked] for x in level.q],
                              [[row[r] for r in rows] for row in level.child_values],
                              [[row[r] for r in rows] for row in level.base_ids],
                              [(index[node], slot_of[slot], rank) for node, slot, rank in level.kept
                               if node in index],
                              [[row[r] for r in rows] for row in level.child_accept]))
        return tree, out


@dataclass
class _Grown:
    """A grown tree and what its growth left: its head calls, the candidates not made nodes (``(candidate, depth,
    head call)``), the lookup chain's tokens and values, the expected tokens and seconds of its step."""

    tree: _Growing
    levels: list[_Level]
    leftovers: list
    chain: tuple | None
    chain_conditional: list | None
    expected: float
    seconds: float
    draft_s: float
    in_heads: float


class _RowShare:
    """One row's share of a step's costs when ``batch`` rows of ``n`` nodes each are verified in one forward and each
    row is drafted on its own: a tree of ``n`` nodes costs ``verify(n, batch) / batch``, a node
    ``extra(n, batch) / batch``, a head call one row's (:class:`StepCost`'s interface, for one row)."""

    def __init__(self, cost: StepCost, batch: int):
        self.cost, self.batch = cost, batch
        self.buckets, self.level_s = cost.buckets, cost.level_s

    def bucket(self, n: int) -> int:
        return self.cost.bucket(n)

    def verify(self, n: int, batch: int = 1, smooth: bool = False) -> float:
        return self.cost.verify(n, self.batch, smooth) * batch / self.batch

    def extra(self, n: int, batch: int = 1) -> float:
        return self.cost.extra(n, self.batch) * batch / self.batch

    def level(self, depth: int, batch: int = 1) -> float:
        return self.cost.level(depth, batch)


PAD_RANK = 1 << 20
"""The rank of a root copy padding a row's tree to its batch's size (:meth:`_Growing.pad`): after every drafted
child of the root."""


def _prunable(tree: _Growing, count: int) -> tuple[set[int], float]:
    """The ``count`` least likely nodes of ``tree`` (by their value summed over rows; on ties the deeper, the later
    rank, the later node first), and their summed value. A node's value is at most its parent's, so what stays is a
    tree (leaves go first)."""
    order = sorted(range(1, len(tree.parents)), key=lambda i: (sum(row[i] for row in tree.values), -tree.depths[i],
                                                               -tree.ranks[i], -i))
    removed = order[:count]
    return set(removed), sum(row[i] for row in tree.values for i in removed)


def _advance(growth, sent):
    """Run a tree's growth (:meth:`PerStepDrafter._growth`) to its next head call's request, sending it ``sent``
    (``None`` to start it): the request, or the :class:`_Grown` once it is done."""
    try:
        return growth.send(sent)
    except StopIteration as done:
        return done.value


def _path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root down to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]
