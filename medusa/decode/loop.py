"""The decode step and the loops around it: prefill, then draft -> verify -> accept steps, yielding tokens.

One step (:meth:`RunningBatch.step`) verifies the trees of ``B`` rows in one engine forward and applies each row's
acceptance rule (:mod:`medusa.decode.acceptance`: greedy, rejection sampling, typical, each row with its own
settings and random generator), over any drafter (:mod:`medusa.drafters`) and engine (:mod:`medusa.engines`). One
sequence is a batch of one row: :func:`decode_steps` (what ``generate`` and ``stream`` run) joins its prompt to a
:class:`RunningBatch` and steps it; several prompts (:mod:`medusa.decode.batch`) and the server's rows
(:mod:`medusa.serve.scheduler`) share the same step. With one row the forward is the engine's one-sequence forward (no
padding, no batched mask); with more, its batched forward over a cache with per-row holes
(:mod:`medusa.engines.kv_cache`, "batched decoding"), on the engine's own cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from medusa.decode.acceptance import AcceptanceRule, acceptance_rule
from medusa.decode.greedy import Acceptance, argmax_rows
from medusa.decode.logits_process import Decoding, resolve_decoding
from medusa.decode.tree import Tree, TreeBuffers, tree_buffers
from medusa.drafters import DraftTree
from medusa.drafters.base import RowsDrafter
from medusa.drafters.composite import CompositeDrafter, tree_drafter
from medusa.engines import EagerEngine, kv_cache, make_engine

STEP_PARTS = ("draft", "choose", "verify_forward", "accept", "cache")
"""A decode step's parts: the heads' draft, choosing the tree's shape (a per-step tree's overhead,
:mod:`medusa.drafters.per_step`; 0 for a fixed tree), the base's forward over the tree (mask included), the
acceptance walk (lm_head rows along the path included) and the cache compaction (with the heads' own context update,
if they keep one)."""


@dataclass
class Step:
    """Tokens emitted by one base forward."""

    tokens: list[int]
    """Emitted token ids (already cut at a stop token or at ``max_new_tokens``)."""
    accepted: int
    """Draft tokens accepted in this step (0 for the prefill step)."""
    is_prefill: bool = False


@dataclass
class GenerationStats:
    """What a generation did; times in seconds."""

    new_tokens: int = 0
    decode_steps: int = 0
    """Verify forwards after the prefill."""
    decode_tokens: int = 0
    """Tokens emitted by the verify forwards (prefill token excluded)."""
    accepted_per_step: list[int] = field(default_factory=list)
    copied_tokens: int = 0
    """Accepted drafts that were copied nodes (the prompt-lookup chain, :attr:`DraftTree.copied`), of
    ``decode_tokens``: the lookup chain's share of the output is ``copied_tokens / new_tokens``."""
    tree_nodes: list[int] = field(default_factory=list)
    """Nodes of each step's tree, root included (1: a plain step)."""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_PARTS, 0.0))
    """Decode time summed over steps, by part of the step (:data:`STEP_PARTS`)."""
    stopped_by: str = ""

    @property
    def tau(self) -> float:
        """Acceptance length: mean tokens emitted per verify forward, prefill excluded."""
        return self.decode_tokens / self.decode_steps if self.decode_steps else float("nan")

    @property
    def lookup_share(self) -> float:
        """Share of the new tokens that were accepted prompt-lookup drafts (copied from the context)."""
        return self.copied_tokens / max(self.new_tokens, 1)

    @property
    def tau_without_lookup(self) -> float:
        """Tokens per verify forward not counting the copied ones: the other drafters' and the base's own."""
        return (self.decode_tokens - self.copied_tokens) / self.decode_steps if self.decode_steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total else float("nan")


def check_context(model, prompt_len: int, max_new_tokens: int, tree_depth: int) -> None:
    """Raise ``ValueError`` when the prompt plus the generation budget and one tree cannot fit the context."""
    config = model.config.get_text_config(decoder=True)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if prompt_len == 0:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if limit is not None and prompt_len + max_new_tokens + tree_depth + 1 > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + tree depth {tree_depth} exceeds the "
            f"model's context of {limit} positions"
        )


@torch.inference_mode()
def decode_steps(model, drafter, input_ids: torch.Tensor, max_new_tokens: int,
                 stop_token_ids: set[int] | None = None, stats: GenerationStats | None = None,
                 decoding: Decoding | None = None, engine=None, scores_all_nodes: bool | None = None
                 ) -> Iterator[Step]:
    """Speculative decoding, one :class:`Step` per base forward: draft -> verify -> accept -> compact -> update.

    A :class:`RunningBatch` of this one row, stepped until it stops: each step the drafter proposes a tree below the
    base's latest token (:mod:`medusa.drafters.base`), the engine runs the base once over every node with tree
    attention, the acceptance rule keeps the longest path the base agrees with (:mod:`medusa.decode.greedy`,
    :mod:`medusa.decode.acceptance`), the cache keeps only that path, and the drafter is told what was accepted.
    Greedy: exactly the base's greedy tokens; rejection sampling: exactly the base's distribution.

    Args:
        model: the base ``*ForCausalLM`` (eval mode).
        drafter: proposes each step's tree (:class:`medusa.drafters.base.Drafter`).
        input_ids: ``(T,)`` long prompt ids.
        max_new_tokens: generation budget.
        stop_token_ids: stop after emitting any of these (included in the output).
        stats: filled in as decoding proceeds, when given.
        decoding: generation settings and acceptance rule (:func:`medusa.decode.logits_process.resolve_decoding`);
            ``None``: plain greedy, no logits processor.
        engine: where the KV cache lives and how a forward runs (:func:`medusa.engines.make_engine`);
            ``None``: the default engine for ``model``.
        scores_all_nodes: score every node with the lm_head in one product (``True``) or one node at a time along
            the accepted path (``False``); both accept the same tokens. ``None``: what the engine declares cheaper
            (:attr:`medusa.engines.Engine.scores_all_nodes`).

    Raises:
        ValueError: the prompt and budget do not fit the context.
    """
    check_context(model, len(input_ids), max_new_tokens, drafter.max_depth)  # before an engine is made
    engine = engine if engine is not None else make_engine(None, model, step_size=drafter.max_nodes)
    batch = RunningBatch(model, drafter, engine, scores_all_nodes)
    yield batch.join(0, input_ids, max_new_tokens, stop_token_ids, stats, decoding)
    while batch.rows:
        ((_, step),) = batch._step()  # decode_steps runs in inference mode already
        yield step


def copied_on_path(draft: DraftTree, path_nodes: torch.Tensor) -> int:
    """Accepted drafts of ``path_nodes`` (``(1 + accepted,)`` node indices, the root first) that are copied nodes
    of ``draft`` (prompt lookup); 0 when the draft copied none."""
    if draft.copied is None or not len(draft.copied) or len(path_nodes) < 2:
        return 0
    return int(torch.isin(path_nodes[1:], draft.copied).sum())


def check_draft(drafter, draft: DraftTree) -> None:
    """Raise ``ValueError`` naming the drafter when its tree is larger or deeper than it declared (``max_nodes``,
    ``max_depth``: what the cache and the context check were sized for). No host sync: shapes only."""
    nodes, depth, laid_out = len(draft.tokens), draft.layout.node_paths.shape[1] - 1, len(draft.layout.depth)
    if nodes > drafter.max_nodes or depth > drafter.max_depth or laid_out != nodes:
        raise ValueError(f"drafter {type(drafter).__name__} proposed a tree of {nodes} nodes ({laid_out} in its "
                         f"layout) and depth {depth}, but declares max_nodes {drafter.max_nodes} and max_depth "
                         f"{drafter.max_depth}")


def legacy_scores_all_nodes(verify_logits: str | None) -> bool | None:
    """``scores_all_nodes`` from an earlier release's ``verify_logits`` (``"all"``, ``"path"`` or ``None``).

    Raises:
        ValueError: any other value.
    """
    if verify_logits not in (None, "all", "path"):
        raise ValueError(f"verify_logits must be 'all' or 'path', got {verify_logits!r}")
    return None if verify_logits is None else verify_logits == "all"


def medusa_steps(model, heads, input_ids: torch.Tensor, tree: Tree, max_new_tokens: int,
                 stop_token_ids: set[int] | None = None, stats: GenerationStats | None = None,
                 verify_logits: str | None = None, decoding: Decoding | None = None, engine=None) -> Iterator[Step]:
    """:func:`decode_steps` with the drafter a tree describes (:func:`medusa.drafters.tree_drafter`: ``heads`` on
    the tree's heads' nodes, plus its prompt-lookup chain).

    ``verify_logits`` (``"all"`` / ``"path"``, kept for callers of earlier releases) is ``scores_all_nodes``
    True / False; ``None``: the engine's choice.

    Raises:
        ValueError: the tree does not fit the heads, the prompt does not fit the context, or a bad
            ``verify_logits``.
    """
    return decode_steps(model, tree_drafter(heads, tree), input_ids, max_new_tokens, stop_token_ids, stats,
                        decoding, engine, legacy_scores_all_nodes(verify_logits))


def _processed(processors, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply the logits processors to one row ``(V,)`` of next-token logits after the tokens ``ids`` ``(L,)``."""
    if not processors:
        return logits
    return processors(ids[None], logits[None].float().clone())[0]  # (V,)


def base_forward(engine, layers: tuple[int, ...], input_ids: torch.Tensor, positions: torch.Tensor,
                 tree_mask: torch.Tensor, cache, logits_for=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One engine forward (:meth:`medusa.engines.Engine.forward`) returning what the drafter reads too.

    Returns:
        ``(logits (M, V), hidden (N, H), states)``: ``states`` is ``hidden`` for a drafter that reads the last hidden
        state only (no ``layers``), else the base states ``(N, (1 + len(layers)) H)``: the last hidden state, then
        the outputs of decoder layers ``layers`` (:mod:`medusa.drafters.eagle`).
    """
    if not layers:
        logits, hidden = engine.forward(input_ids, positions, tree_mask, cache, logits_for=logits_for)
        return logits, hidden, hidden
    logits, hidden, features = engine.forward_features(input_ids, positions, tree_mask, cache, layers, logits_for)
    return logits, hidden, torch.cat([hidden, features], dim=-1)


def verify(engine, draft: DraftTree, prefix_len: int, cache, rule, processors, sequence: torch.Tensor,
           all_nodes: bool, layers: tuple[int, ...] = ()) -> tuple[Acceptance, torch.Tensor]:
    """One row's verification: one forward of the base over the drafted tree (the engine's one-sequence forward),
    then ``rule`` accepts a path; returns ``(Acceptance, states (N, ...))``: the hidden states ``(N, H)``, or with
    ``layers`` the base states :func:`base_forward` returns.

    With ``all_nodes`` every node's logits come from one lm_head product, else one row at a time as the rule walks.
    At node n the processors see ``sequence`` (prompt and emitted tokens, the root last) followed by the path below
    the root down to n: the input ids ``generate`` would have at that point.
    """
    layout = draft.layout
    rows = None if all_nodes else slice(0, 0)
    logits, hidden, states = base_forward(engine, layers, draft.tokens, prefix_len + layout.depth,
                                          layout.ancestor_mask, cache, logits_for=rows)  # (N or 0, V), (N, H), (N, ..)
    return _accept(engine, draft, logits if all_nodes else None, hidden, rule, processors, sequence), states


def _accept(engine, draft: DraftTree, logits: torch.Tensor | None, hidden: torch.Tensor, rule, processors,
            sequence: torch.Tensor) -> Acceptance:
    """``rule`` accepts a path of one row's tree from its forward's ``logits`` ``(N, V)`` (every node scored), or
    ``None`` and the hidden states ``hidden`` ``(N, H)``: the lm_head then scores the nodes the rule asks for, one
    at a time (:meth:`medusa.engines.Engine.lm_logits_rows`)."""
    tokens, layout = draft.tokens, draft.layout

    def logits_at(node: int) -> torch.Tensor:
        raw = logits[node] if logits is not None else engine.lm_logits_rows(hidden[node : node + 1])[0]  # (V,)
        if not processors:
            return raw
        path = tokens[layout.node_paths[node, 1 : int(layout.depth[node]) + 1]]  # below the root, down to node
        return _processed(processors, torch.cat([sequence, path]), raw)

    predicted = argmax_rows(logits) if logits is not None and not processors else None  # (N,)
    return rule.accept(draft, logits_at, predicted)


def _add_step_times(stats: GenerationStats, marks: tuple[float, ...], forward_s: float, choose_s: float = 0.0) -> None:
    """Add one step's parts to ``stats.step_s``: ``marks`` are the clock at its start, after the draft, after the
    verification and after the compaction and context update; ``forward_s`` is the engine's forward inside the
    verification, ``choose_s`` the drafter's choosing of the tree inside the draft."""
    start, drafted, verified, compacted = marks
    parts = (drafted - start - choose_s, choose_s, forward_s, verified - drafted - forward_s, compacted - verified)
    for name, seconds in zip(STEP_PARTS, parts, strict=True):
        stats.step_s[name] += seconds


def _emit(tokens: list[int], accepted: int, stats: GenerationStats, budget: int, stop: set[int],
          is_prefill: bool = False, copied: int = 0) -> Step:
    """Cut ``tokens`` at the first stop token and at the budget, and account for them in ``stats`` (``copied``: how
    many of the accepted drafts were copied nodes; counted among the tokens kept)."""
    for i, t in enumerate(tokens):
        if t in stop:
            tokens, stats.stopped_by = tokens[: i + 1], "stop_token"
            break
    room = budget - stats.new_tokens
    if len(tokens) >= room:
        tokens = tokens[:room]
        stats.stopped_by = stats.stopped_by or "max_new_tokens"
    stats.new_tokens += len(tokens)
    if not is_prefill:
        stats.decode_steps += 1
        stats.decode_tokens += len(tokens)
        stats.accepted_per_step.append(accepted)
        stats.copied_tokens += min(copied, accepted, len(tokens))  # the drafts kept come first
    return Step(tokens, accepted, is_prefill)


def medusa_generate(model, heads, input_ids: torch.Tensor, tree: Tree, max_new_tokens: int,
                    stop_token_ids: set[int] | None = None, verify_logits: str | None = None,
                    decoding: Decoding | None = None, engine=None) -> tuple[list[int], GenerationStats]:
    """Run :func:`medusa_steps` to the end; returns ``(new_token_ids, stats)``."""
    stats = GenerationStats()
    out: list[int] = []
    for step in medusa_steps(model, heads, input_ids, tree, max_new_tokens, stop_token_ids, stats, verify_logits,
                             decoding, engine):
        out.extend(step.tokens)
    return out, stats


@dataclass
class _Row:
    """One sequence of a :class:`RunningBatch`."""

    key: object
    state: object
    """The drafter's per-sequence state."""
    sequence: torch.Tensor
    """``(S,)`` the prompt and the emitted tokens, the root last (what the processors and prompt lookup read)."""
    root: torch.Tensor
    """``()`` long: the row's latest token, the root of its next tree."""
    length: int
    """Cached positions of this row (slot == position, see :mod:`medusa.engines.kv_cache`)."""
    budget: int
    stop: set[int]
    stats: GenerationStats
    rule: AcceptanceRule
    """The row's acceptance rule, with its own random generator when it samples."""
    processors: object
    """The row's logits processors (a ``LogitsProcessorList``, empty for none)."""


@dataclass
class Joining:
    """A row being prefilled (:meth:`RunningBatch.begin`), not yet in the batch: its prompt goes into its own cache
    chunk by chunk (:meth:`RunningBatch.prefill`)."""

    key: object
    prompt: torch.Tensor
    """``(T,)`` long."""
    max_new_tokens: int
    stop: set[int]
    stats: GenerationStats
    rule: AcceptanceRule
    processors: object
    cache: object
    """The row's own cache (the engine's), holding the first :attr:`done` prompt positions."""
    done: int = 0
    """Prompt tokens prefilled so far."""
    states: list = field(default_factory=list)
    """What the drafter reads of each chunk (:func:`base_forward`'s states), until it starts."""
    restored: object = None
    """The prefix snapshot copied in at :meth:`RunningBatch.begin`, until the first :meth:`RunningBatch.prefill`
    checks that the engine still computes with its weights."""

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.prompt) - self.done


class RunningBatch:
    """The decode step over ``B`` rows, and continuous batching: rows join and leave between steps.

    :meth:`join` prefills one prompt on its own (the engine's one-sequence forward into a fresh cache of the engine:
    no padding computed) and, when rows are running, appends its cache as one more row of the batched cache
    (:meth:`medusa.engines.Engine.stack_rows`: no other row's prefix moves); :meth:`step` verifies every row's tree
    in one forward and applies each row's own acceptance rule; a row leaves when it stops (stop token, budget) or is
    asked to (:meth:`leave`), so it costs nothing afterwards. Each row decodes as its prompt decoded alone would,
    whenever it joined and whoever shares its steps: greedy rows get exactly the base's greedy tokens, sampling rows
    are distributed exactly as the base's samples (rejection sampling) and, with a fixed tree, consume their random
    draws in the same order as alone.

    Args:
        model: the base ``*ForCausalLM`` (eval mode).
        drafter: proposes each row's tree (:class:`medusa.drafters.base.Drafter`); one state per row. All rows of a
            step must get trees of one size (one forward holds them all, each row under its own tree attention
            mask): a fixed tree, or a drafter that proposes for all rows at once
            (:class:`medusa.drafters.base.RowsDrafter`).
        engine: where the cache lives and how a forward runs (:class:`medusa.engines.Engine`); ``None``: the eager
            engine. Several rows need its ``supports_batch``.
        scores_all_nodes: score every node with the lm_head in one product (``True``) or only the nodes along each
            row's path (``False``); both accept the same tokens. ``None``: what the engine declares cheaper
            (:attr:`medusa.engines.Engine.scores_all_nodes`).
    """

    def __init__(self, model, drafter, engine=None, scores_all_nodes: bool | None = None):
        engine = engine if engine is not None else EagerEngine(model)
        self.model, self.drafter, self.engine = model, drafter, engine
        self.all_nodes = engine.scores_all_nodes if scores_all_nodes is None else scores_all_nodes
        self.vocab_size = model.config.get_text_config(decoder=True).vocab_size
        self.rows: list[_Row] = []
        self.cache = None
        self._greedy: Decoding | None = None
        self.forwards = 0
        """Verify forwards run."""
        self.row_forwards = 0
        """Rows summed over those forwards."""
        self.max_rows = 0
        """The most rows one forward held."""
        self.prefix_store = None
        """A :class:`medusa.decode.prefix.PrefixStore`: prompts keep their prefilled positions there, and a prompt
        that starts like a kept one is prefilled from after the shared tokens (exact through the engines that give
        snapshots); ``None``: every prompt is prefilled whole."""

    @property
    def keys(self) -> list:
        """The keys of the rows running, in cache order."""
        return [r.key for r in self.rows]

    @torch.inference_mode()
    def join(self, key, prompt: torch.Tensor, max_new_tokens: int, stop_token_ids: set[int] | None = None,
             stats: GenerationStats | None = None, decoding: Decoding | None = None) -> Step:
        """Prefill ``prompt`` ``(T,)`` as a new row ``key`` decoded with ``decoding`` (``None``: plain greedy, no
        logits processor) in one forward and return its first token's :class:`Step`; a row that stops on it (a stop
        token, a budget of 1) does not join. :meth:`begin` and :meth:`prefill` do the same in chunks.

        Raises:
            ValueError: the prompt is empty or does not fit the context, an unknown acceptance rule, or a second
                row on an engine without batched decoding.
        """
        joining = self.begin(key, prompt, max_new_tokens, stop_token_ids, stats, decoding)
        return self.prefill(joining, len(prompt))

    def begin(self, key, prompt: torch.Tensor, max_new_tokens: int, stop_token_ids: set[int] | None = None,
              stats: GenerationStats | None = None, decoding: Decoding | None = None) -> Joining:
        """Start row ``key`` (as :meth:`join`) without computing anything: its checks, rule and fresh cache. The
        prompt then goes through :meth:`prefill`, in as many chunks as the caller likes, between the batch's steps
        (chunked prefill: a long prompt does not hold the running rows up for its whole forward). With a
        :attr:`prefix_store`, the positions the prompt shares with a kept one are copied in first
        (:attr:`Joining.done` counts them) and :meth:`prefill` goes on from there.

        Raises:
            ValueError: as :meth:`join`.
        """
        check_context(self.model, len(prompt), max_new_tokens, self.drafter.max_depth)
        if self.rows and not self.engine.supports_batch:
            raise ValueError(f"engine {self.engine.name!r} does not run batched decoding")
        stats = stats if stats is not None else GenerationStats()
        stop = stop_token_ids or set()
        if decoding is None:  # resolved once per batch: resolving reads a whole generation config
            self._greedy = decoding = self._greedy or resolve_decoding()
        processors = decoding.processors(len(prompt), max_new_tokens, stop, prompt.device)
        rule = acceptance_rule(decoding, self.vocab_size, prompt.device)
        cache = self.engine.new_cache(len(prompt) + max_new_tokens + self.drafter.max_nodes)
        joining = Joining(key, prompt, max_new_tokens, stop, stats, rule, processors, cache)
        if self.prefix_store is not None:
            start = time.perf_counter()
            shared, entry = self.prefix_store.find(prompt)
            if entry is not None and self.engine.restore_prefix(entry.snapshot, cache, shared):
                joining.done, joining.restored = shared, entry.snapshot
                joining.states = [entry.states[:shared].to(prompt.device)]
            elif entry is not None:  # made before the weights changed: it never will be restored
                self.prefix_store.discard(entry)
            stats.prefill_s += time.perf_counter() - start
        return joining

    @torch.inference_mode()
    def prefill(self, joining: Joining, tokens: int) -> Step | None:
        """Run the next ``tokens`` (at least 1) prompt tokens of ``joining`` through the base into its own cache
        (one forward over them, attending to the chunks before: the engine's verify forward over a chain). After the
        last chunk the first token is chosen and the row joins the batch (as :meth:`join`): its :class:`Step` is
        returned; ``None`` while prompt tokens are left. A prompt prefilled in one chunk is :meth:`join`'s forward,
        bit for bit; in several, the same attention over the same cache, whose rounding may differ in the last bits.

        Raises:
            ValueError: ``tokens`` < 1, or ``joining`` already joined.
        """
        if tokens < 1 or joining.done == len(joining.prompt):
            raise ValueError(f"prefill takes at least one token of a prompt not yet joined, got {tokens} with "
                             f"{len(joining.prompt) - joining.done} left")
        start, device, prompt = time.perf_counter(), joining.prompt.device, joining.prompt
        if joining.restored is not None:
            snapshot, joining.restored = joining.restored, None
            if not self.engine.prefix_current(snapshot):  # the weights changed since begin(): prefill it whole
                joining.cache.length, joining.done, joining.states = 0, 0, []
            elif self.prefix_store is not None:
                self.prefix_store.hits += 1
                self.prefix_store.reused_tokens += joining.done
        first, stop = joining.done, min(len(prompt), joining.done + tokens)
        last = stop == len(prompt)
        logits, _, states = base_forward(self.engine, self.drafter.base_layers, prompt[first:stop],
                                         torch.arange(first, stop, device=device),
                                         kv_cache.causal_mask(stop - first, device), joining.cache,
                                         logits_for=slice(-1, None) if last else slice(0, 0))
        joining.states.append(states)
        joining.done = stop
        joining.stats.prefill_s += time.perf_counter() - start
        if not last:
            return None
        start = time.perf_counter()
        root = joining.rule.next_token(_processed(joining.processors, prompt, logits[-1]))
        sequence = torch.cat([prompt, root[None]])  # (T+1,) what the processors see: prompt + emitted tokens
        state = self.drafter.new_state()
        states = joining.states[0] if len(joining.states) == 1 else torch.cat(joining.states)  # (T, ...)
        if self.prefix_store is not None:  # before the cache joins the batch's
            kept = min(len(prompt), self.prefix_store.max_tokens)
            self.prefix_store.add(prompt, self.engine.prefix_snapshot(joining.cache, kept), states)
        self.drafter.start(state, states, sequence[1:])
        joining.states = []
        stats = joining.stats
        stats.prefill_s += time.perf_counter() - start
        step = _emit([int(root)], 0, stats, joining.max_new_tokens, joining.stop, is_prefill=True)
        if stats.stopped_by:
            return step
        cache = joining.cache
        self.cache = cache if self.cache is None else self.engine.stack_rows([self.cache, cache])
        self.rows.append(_Row(joining.key, state, sequence, root, len(prompt), joining.max_new_tokens, joining.stop,
                              stats, joining.rule, joining.processors))
        return step

    @torch.inference_mode()
    def leave(self, keys) -> None:
        """Drop the rows ``keys`` (unknown keys are ignored): one copy of the rows that stay."""
        gone = set(keys)
        stay = [j for j, r in enumerate(self.rows) if r.key not in gone]
        if len(stay) == len(self.rows):
            return
        self.rows = [self.rows[j] for j in stay]
        if not stay:
            self.cache = None
            return
        keep = torch.tensor(stay, dtype=torch.long, device=self.model.device)
        self.engine.select_rows(self.cache, keep, max(r.length for r in self.rows))

    @torch.inference_mode()
    def step(self, plain: bool = False) -> list[tuple[object, Step]]:
        """One verify forward for every row: draft, verify, accept, compact, update. Returns ``(key, Step)`` per
        row, in cache order; rows that stop leave the batch. ``plain``: each tree is the root alone (a plain
        decoding step; the drafter's state still sees the accepted token), whatever the drafter would propose.

        Raises:
            ValueError: no row is running, a tree larger than the drafter declared, or rows drafted with trees of
                different sizes.
        """
        return self._step(plain)

    def _step(self, plain: bool = False) -> list[tuple[object, Step]]:
        """:meth:`step`, for a caller already in inference mode (no context switch per step)."""
        rows = self.rows
        if not rows:
            raise ValueError("the batch holds no running row")
        start = time.perf_counter()
        drafts = self._propose(plain)
        drafted = time.perf_counter()
        accepted, states = self._verify(drafts)
        verified = time.perf_counter()
        if len(rows) == 1:
            self.engine.keep_positions(self.cache, rows[0].length, accepted[0].path_nodes)
        else:
            # The cache held the longest row before the forward (stack_rows, keep_row_paths, select_rows keep so).
            valid_len = torch.tensor([r.length for r in rows], dtype=torch.long, device=self.model.device)
            self.engine.keep_row_paths(self.cache, max(r.length for r in rows), valid_len,
                                       [a.path_nodes for a in accepted])
        emitted = []
        for row, draft, result, st in zip(rows, drafts, accepted, states, strict=True):
            row.length += len(result.path_nodes)
            row.root = result.next_token
            tokens = torch.cat([draft.tokens[result.path_nodes[1:]], row.root[None]])  # (accepted + 1,)
            self.drafter.update(row.state, draft, result.path_nodes, st[result.path_nodes], tokens)
            emitted.append(tokens)
        marks = (start, drafted, verified, time.perf_counter())
        out = []
        for row, draft, result, tokens in zip(rows, drafts, accepted, emitted, strict=True):
            _add_step_times(row.stats, marks, self.engine.last_forward_s, draft.choose_s)
            row.stats.tree_nodes.append(len(draft.tokens))
            row.sequence = torch.cat([row.sequence, tokens])
            row.stats.decode_s += time.perf_counter() - start
            out.append((row.key, _emit(tokens.tolist(), result.accepted, row.stats, row.budget, row.stop,
                                       copied=copied_on_path(draft, result.path_nodes))))
        self.forwards += 1
        self.row_forwards += len(rows)
        self.max_rows = max(self.max_rows, len(rows))
        if any(r.stats.stopped_by for r in rows):
            self.leave([r.key for r in rows if r.stats.stopped_by])
        return out

    def _propose(self, plain: bool) -> list[DraftTree]:
        """Each row's tree: the root alone (``plain``), the drafter's for one row, or for all rows at once (a
        :class:`medusa.drafters.base.RowsDrafter`: trees of one size), else row by row; each drawn with its row's
        rule's sampler."""
        rows, drafter = self.rows, self.drafter
        if plain:
            drafts = _root_drafts(drafter, [r.root for r in rows])
        elif len(rows) == 1:
            row = rows[0]
            drafts = [drafter.propose(row.state, row.root, row.sequence, row.rule.sampler)]
        elif isinstance(drafter, RowsDrafter):
            samplers = [r.rule.sampler for r in rows]
            sampler = samplers[0] if all(s is samplers[0] for s in samplers) else samplers
            drafts = drafter.propose_rows([r.state for r in rows], torch.stack([r.root for r in rows]),
                                          [r.sequence for r in rows], sampler)
        else:
            drafts = [drafter.propose(r.state, r.root, r.sequence, r.rule.sampler) for r in rows]
        nodes = len(drafts[0].tokens)
        for b, draft in enumerate(drafts):
            check_draft(drafter, draft)
            if len(draft.tokens) != nodes:
                raise ValueError(f"batched decoding verifies all rows' trees in one forward, so they need one size "
                                 f"per step: row {b}'s tree has {len(draft.tokens)} nodes, row 0's {nodes}")
        return drafts

    def _verify(self, drafts: list[DraftTree]) -> tuple[list[Acceptance], list[torch.Tensor]]:
        """One forward over every row's tree, then each row's rule; returns per row its :class:`Acceptance` and
        its states ``(N, ...)`` (what the drafter reads, :func:`base_forward`)."""
        rows, engine, layers = self.rows, self.engine, self.drafter.base_layers
        if len(rows) == 1:  # the engine's one-sequence forward: no padding, no batched mask
            row = rows[0]
            result, states = verify(engine, drafts[0], row.length, self.cache, row.rule, row.processors,
                                    row.sequence, self.all_nodes, layers)
            return [result], [states]
        layouts = _row_layouts(drafts)  # one per row, the same object where rows share a shape
        tokens = torch.stack([d.tokens for d in drafts])  # (B, N)
        valid_len = torch.tensor([r.length for r in rows], dtype=torch.long, device=tokens.device)  # (B,)
        if all(layout is layouts[0] for layout in layouts):
            depth, visible = layouts[0].depth[None, :], layouts[0].ancestor_mask  # (1, N), (N, N)
        else:  # each row under its own tree attention mask
            depth = torch.stack([layout.depth for layout in layouts])  # (B, N)
            visible = torch.stack([layout.ancestor_mask for layout in layouts])  # (B, N, N)
        positions = valid_len[:, None] + depth  # (B, N)
        out = engine.forward_rows(tokens, positions, valid_len, visible, self.cache, layers)
        hidden, states = (out, out) if not layers else (out[0], torch.cat(out, dim=-1))  # (B, N, H), (B, N, ...)
        batch, n = tokens.shape
        # The engine's cheapest product over many rows (the onednn engine's packed lm_head).
        logits = engine.lm_logits_rows(hidden.flatten(0, 1)).view(batch, n, -1) if self.all_nodes else None
        groups: dict[int, list[int]] = {}  # rows accepted together, by tree shape
        for b, r in enumerate(rows):
            if r.rule.rows_at_once and not r.processors:
                groups.setdefault(id(layouts[b]), []).append(b)
        results: list[Acceptance | None] = [None] * batch
        # One set of tensor operations for the rows of a shape (medusa.decode.greedy).
        for together in (g for g in groups.values() if len(g) > 1):
            picked = torch.tensor(together, device=tokens.device)
            predicted = None if logits is None else argmax_rows(logits[picked])  # (R, N)

            def next_tokens_at(r: torch.Tensor, nodes: torch.Tensor, picked=picked) -> torch.Tensor:
                return argmax_rows(engine.batch_lm_logits(hidden[picked[r], nodes]))  # (R',)

            accepted = rows[together[0]].rule.accept_rows(tokens[picked], layouts[together[0]], predicted,
                                                          next_tokens_at)
            for b, result in zip(together, accepted, strict=True):
                results[b] = result
        for b, row in enumerate(rows):
            if results[b] is None:
                results[b] = _accept(engine, drafts[b], None if logits is None else logits[b], hidden[b], row.rule,
                                     row.processors, row.sequence)
        return results, list(states)


def _row_layouts(drafts: list[DraftTree]) -> list[TreeBuffers]:
    """Each draft's layout, rows of the same shape given the same object (the first row's of that shape; the same
    children lists are the same parents)."""
    seen: list[TreeBuffers] = []
    out = []
    for draft in drafts:
        layout = draft.layout
        match = next((s for s in seen if s is layout or s.children == layout.children), None)  # no device sync
        if match is None:
            seen.append(layout)
            match = layout
        out.append(match)
    return out


def same_shape(a: TreeBuffers, b: TreeBuffers) -> bool:
    """Whether two layouts are the same tree (the same parents, children in the same walk order)."""
    return a.children == b.children and torch.equal(a.parents, b.parents)


def _root_drafts(drafter, roots: list[torch.Tensor]) -> list[DraftTree]:
    """Trees of the root alone for rows ``roots`` (``()`` each): a plain step through ``drafter``'s states. A
    composite drafter's update reads each part's own draft, so each part gets the root alone too."""
    layout = tree_buffers(Tree.chain(0), roots[0].device)
    parts = len(drafter.parts) if isinstance(drafter, CompositeDrafter) else 0
    return [DraftTree(r[None], layout, parts=[DraftTree(r[None], layout) for _ in range(parts)] or None)
            for r in roots]
