"""Batched greedy Medusa decoding: several prompts of different lengths, one base forward per step for all of them.

Each step drafts a tree for every row, verifies all ``B x N`` tree tokens in one forward of the stock model (per-row
positions and a 4D additive mask), and lets each row accept its own path. The rows' caches then differ in length;
they share one cache with holes (:mod:`medusa.engines.kv_cache`, "batched decoding"): row b's slot s holds its
position s up to its own length, the slots beyond are hidden by the mask and overwritten as the row advances, and no
row's prefix is ever moved. A row that stops (stop token or budget) leaves the batch, so it costs nothing afterwards,
and a new prompt joins between two steps (:class:`RunningBatch`: continuous batching, as a server needs).
Heads that keep per-sequence state (an attention layer of their own) keep one state per row. Acceptance is
:mod:`medusa.decode.greedy`'s, row by row in one set of tensor operations.

Greedy only: each row's tokens are exactly the base's greedy tokens, as when the prompt is decoded alone
(:func:`medusa.decode.loop.medusa_steps`). A tree of one node (``Tree.chain(0)``) is plain batched greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from medusa.decode.greedy import greedy_paths, greedy_walk
from medusa.decode.loop import GenerationStats, Step, _emit, check_context, check_draft, legacy_scores_all_nodes
from medusa.decode.tree import Tree, TreeBuffers, tree_buffers
from medusa.drafters.base import DraftTree, RowsDrafter, TopK
from medusa.drafters.composite import CompositeDrafter, tree_drafter
from medusa.engines import EagerEngine

GREEDY = TopK()


@dataclass
class BatchStats:
    """What a batched generation did, over all rows; times in seconds."""

    rows: list[GenerationStats] = field(default_factory=list)
    """Per prompt, in the order given (``prefill_s``/``decode_s`` there are the batch's shared wall-clock times)."""
    forwards: int = 0
    """Batched verify forwards after the prefill."""
    row_forwards: int = 0
    """Rows summed over the verify forwards (finished rows no longer count)."""
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.rows)

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total else float("nan")


def check_prompts(prompts: list[torch.Tensor]) -> None:
    """Raise ``ValueError`` for an empty batch, or naming the prompts that are empty or not ``(T,)`` ids."""
    if not prompts:
        raise ValueError("the batch holds no prompt")
    for i, ids in enumerate(prompts):
        if ids.ndim != 1:
            raise ValueError(f"prompt {i} of the batch must be (T,) token ids, got shape {tuple(ids.shape)}")
    empty = [i for i, ids in enumerate(prompts) if len(ids) == 0]
    if empty:
        raise ValueError(f"prompt{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of the batch "
                         f"{'are' if len(empty) > 1 else 'is'} empty (of {len(prompts)} prompts)")


@torch.inference_mode()
def batch_decode_steps(model, drafter, prompts: list[torch.Tensor], max_new_tokens: int,
                       stop_token_ids: set[int] | None = None, stats: BatchStats | None = None,
                       scores_all_nodes: bool | None = None, engine=None) -> Iterator[list[tuple[int, Step]]]:
    """Batched greedy speculative decoding; yields, per base forward, ``(prompt index, Step)`` for each row still
    running (all prompts join a :class:`RunningBatch` at once, then it steps until every row has left).

    Args:
        model: the base ``*ForCausalLM`` (eval mode).
        drafter: proposes each row's tree (:class:`medusa.drafters.base.Drafter`); one state per row. All rows of a
            step must get trees of one layout (one forward holds them all).
        prompts: ``B`` prompts, each ``(T_b,)`` long ids, any lengths.
        max_new_tokens: generation budget of each row.
        stop_token_ids: a row stops after emitting one of these (included in its output).
        stats: filled in as decoding proceeds, when given.
        scores_all_nodes: score every node of every row with the lm_head in one product (``True``), or only the
            nodes along each row's accepted path, one product per tree level over the rows still matching
            (``False``). Both accept exactly the same tokens. ``None``: all nodes on an accelerator, the path on a CPU.
        engine: runs the batched forwards and cache operations (:class:`medusa.engines.Engine`, whose
            ``supports_batch`` is true); ``None``: the eager engine (a ``DynamicCache`` and the model's own modules).

    Raises:
        ValueError: an empty batch or prompt (named), a prompt that does not fit the context, an engine without
            batched decoding, or rows drafted with different tree layouts in one step.
    """
    stats = stats if stats is not None else BatchStats()
    check_prompts(prompts)
    for ids in prompts:
        check_context(model, len(ids), max_new_tokens, drafter.max_depth)
    batch = RunningBatch(model, drafter, engine, scores_all_nodes)
    stats.rows = [GenerationStats() for _ in prompts]
    start = time.perf_counter()
    first = [(i, batch.join(i, ids, max_new_tokens, stop_token_ids, stats.rows[i])) for i, ids in enumerate(prompts)]
    stats.prefill_s = time.perf_counter() - start
    for row in stats.rows:
        row.prefill_s = stats.prefill_s
    yield first
    while batch.keys:
        start = time.perf_counter()
        out = batch.step()
        stats.decode_s += time.perf_counter() - start
        stats.forwards += 1
        stats.row_forwards += len(out)
        yield out


@dataclass
class _Row:
    """One sequence of a :class:`RunningBatch`."""

    key: object
    state: object
    """The drafter's per-sequence state."""
    sequence: torch.Tensor
    """``(S,)`` the prompt and the emitted tokens, the root last (what prompt lookup copies from)."""
    budget: int
    stop: set[int]
    stats: GenerationStats


class RunningBatch:
    """Continuous batching: a batched greedy decode whose rows join and leave between steps.

    :meth:`join` prefills one prompt on its own (no padding computed) and appends its cache as one more row of the
    batched cache (:func:`medusa.engines.kv_cache.stack_rows`: no other row's prefix moves); :meth:`step` runs one
    batched verify forward for every row; a row leaves when it stops (stop token, budget) or is asked to
    (:meth:`leave`), so it costs nothing afterwards. Each row's tokens are exactly the base's greedy tokens, as when
    its prompt is decoded alone, whenever it joined and whoever shares its steps.

    Args:
        model: the base ``*ForCausalLM`` (eval mode).
        drafter: proposes each row's tree (as in :func:`batch_decode_steps`).
        engine: as in :func:`batch_decode_steps` (``None``: the eager engine).
        scores_all_nodes: as in :func:`batch_decode_steps`.

    Raises:
        ValueError: an engine without batched decoding.
    """

    def __init__(self, model, drafter, engine=None, scores_all_nodes: bool | None = None):
        engine = engine if engine is not None else EagerEngine(model)
        if not engine.supports_batch:
            raise ValueError(f"engine {engine.name!r} does not run batched decoding")
        self.model, self.drafter, self.engine = model, drafter, engine
        self.all_nodes = model.device.type != "cpu" if scores_all_nodes is None else scores_all_nodes
        self.rows: list[_Row] = []
        self.cache = None
        self.roots = torch.zeros(0, dtype=torch.long, device=model.device)  # (B,) each row's latest token
        self.valid_len = torch.zeros(0, dtype=torch.long, device=model.device)  # (B,) each row's cached positions
        self.forwards = 0
        """Batched verify forwards run."""
        self.row_forwards = 0
        """Rows summed over those forwards."""
        self.max_rows = 0
        """The most rows one forward held."""

    @property
    def keys(self) -> list:
        """The keys of the rows running, in cache order."""
        return [r.key for r in self.rows]

    @torch.inference_mode()
    def join(self, key, prompt: torch.Tensor, max_new_tokens: int, stop_token_ids: set[int] | None = None,
             stats: GenerationStats | None = None) -> Step:
        """Prefill ``prompt`` ``(T,)`` as a new row ``key`` and return its first token's :class:`Step`; a row that
        stops on it (a stop token, a budget of 1) does not join.

        Raises:
            ValueError: the prompt is empty or does not fit the context.
        """
        check_context(self.model, len(prompt), max_new_tokens, self.drafter.max_depth)
        stats = stats if stats is not None else GenerationStats()
        state = self.drafter.new_state()
        cache, root, length = _prefill_row(self.engine, self.drafter, prompt, state)
        stop = stop_token_ids or set()
        step = _emit([int(root)], 0, stats, max_new_tokens, stop, is_prefill=True)
        if stats.stopped_by:
            return step
        self.cache = cache if self.cache is None else self.engine.stack_rows([self.cache, cache])
        self.roots = torch.cat([self.roots, root[None]])
        self.valid_len = torch.cat([self.valid_len, length[None]])
        self.rows.append(_Row(key, state, torch.cat([prompt, root[None]]), max_new_tokens, stop, stats))
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
            self.cache, self.roots, self.valid_len = None, self.roots[:0], self.valid_len[:0]
            return
        keep = torch.tensor(stay, dtype=torch.long, device=self.roots.device)
        self.roots, self.valid_len = self.roots[keep], self.valid_len[keep]
        self.engine.select_rows(self.cache, keep, int(self.valid_len.max()))

    @torch.inference_mode()
    def step(self, plain: bool = False) -> list[tuple[object, Step]]:
        """One batched verify forward for every row; returns ``(key, Step)`` per row, in cache order. Rows that stop
        leave the batch. ``plain``: each tree is the root alone (a plain batched decoding step; the drafter's state
        still sees the accepted token), whatever the drafter would propose.

        Raises:
            ValueError: no row is running, or rows drafted with different tree layouts.
        """
        if not self.rows:
            raise ValueError("the batch holds no running row")
        start = time.perf_counter()
        states, sequences = [r.state for r in self.rows], [r.sequence for r in self.rows]
        drafts = _root_drafts(self.drafter, self.roots) if plain else None
        self.roots, self.valid_len, emitted, nodes = _step(self.engine, self.drafter, states, sequences, self.cache,
                                                           self.roots, self.valid_len, self.all_nodes, drafts)
        elapsed = time.perf_counter() - start
        self.forwards += 1
        self.row_forwards += len(self.rows)
        self.max_rows = max(self.max_rows, len(self.rows))
        out = []
        for row, tokens in zip(self.rows, emitted, strict=True):
            row.sequence = torch.cat([row.sequence, row.sequence.new_tensor(tokens)])
            row.stats.decode_s += elapsed
            row.stats.tree_nodes.append(nodes)
            out.append((row.key, _emit(tokens, len(tokens) - 1, row.stats, row.budget, row.stop)))
        self.leave([r.key for r in self.rows if r.stats.stopped_by])
        return out


def batch_steps(model, heads, prompts: list[torch.Tensor], tree: Tree, max_new_tokens: int,
                stop_token_ids: set[int] | None = None, stats: BatchStats | None = None,
                verify_logits: str | None = None, engine=None) -> Iterator[list[tuple[int, Step]]]:
    """:func:`batch_decode_steps` with the drafter a tree describes (:func:`medusa.drafters.composite.tree_drafter`;
    ``heads`` may be ``None`` with a tree of one node: plain batched decoding). ``verify_logits`` (``"all"`` /
    ``"path"``, kept for callers of earlier releases) is ``scores_all_nodes`` True / False.

    Raises:
        ValueError: as :func:`batch_decode_steps`, a tree that does not fit the heads, or a bad ``verify_logits``.
    """
    all_nodes = legacy_scores_all_nodes(verify_logits)
    check_prompts(prompts)
    return batch_decode_steps(model, tree_drafter(heads, tree), prompts, max_new_tokens, stop_token_ids, stats,
                              all_nodes, engine)


def same_shape(a: TreeBuffers, b: TreeBuffers) -> bool:
    """Whether two layouts are the same tree (the same parents, children in the same walk order)."""
    return a.children == b.children and torch.equal(a.parents, b.parents)


def _prefill_row(engine, drafter, prompt: torch.Tensor, state):
    """One prompt's own forward (as when decoded alone: no padding computed), the drafter told its states.

    Returns:
        ``(single-row cache, root (), length ())``.
    """
    cache, logits, hidden, *features = engine.prefill_row(prompt, drafter.base_layers)  # (1, V), (T, H)
    root = logits[-1].argmax()
    states_in = torch.cat([hidden, *features], dim=-1)  # (T, H) or base states (medusa.decode.loop.base_forward)
    drafter.start(state, states_in, torch.cat([prompt[1:], root[None]]))
    return cache, root, torch.tensor(len(prompt), dtype=torch.long, device=prompt.device)


def _root_drafts(drafter, roots: torch.Tensor) -> list[DraftTree]:
    """Trees of the root alone for rows ``roots`` ``(B,)``: a plain step through ``drafter``'s states. A composite
    drafter's update reads each part's own draft, so each part gets the root alone too."""
    layout = tree_buffers(Tree.chain(0), roots.device)
    parts = len(drafter.parts) if isinstance(drafter, CompositeDrafter) else 0
    return [DraftTree(r[None], layout, parts=[DraftTree(r[None], layout) for _ in range(parts)] or None)
            for r in roots]


def _step(engine, drafter, states: list, sequences: list[torch.Tensor], cache, roots: torch.Tensor,
          valid_len: torch.Tensor, all_nodes: bool, drafts: list[DraftTree] | None = None):
    """Draft, verify and accept one tree per row (``sequences[b]``: row b's prompt and emitted tokens, root last).

    Returns:
        ``(roots (B,), valid_len (B,), emitted, nodes)``; ``emitted[b]``: row b's accepted draft tokens then its bonus
        token (the new root); ``nodes``: the step's tree size. A drafter with ``propose_rows`` (the per-step tree)
        grows one tree shape for all rows at once; any other proposes row by row. ``drafts`` given: these trees
        instead of the drafter's.
    """
    batch = len(roots)
    if drafts is None and isinstance(drafter, RowsDrafter):  # one tree shape for all rows (medusa.drafters.per_step)
        drafts = drafter.propose_rows(states, roots, sequences, GREEDY)
    elif drafts is None:
        drafts = [drafter.propose(states[b], roots[b], sequences[b], GREEDY) for b in range(batch)]
    layout = drafts[0].layout
    for b, draft in enumerate(drafts):
        check_draft(drafter, draft)
        if draft.layout is not layout and not same_shape(draft.layout, layout):
            raise ValueError(f"batched decoding verifies all rows' trees in one forward, so they need one shape per "
                             f"step: row {b}'s tree differs from row 0's (parents {draft.layout.parents.tolist()} vs "
                             f"{layout.parents.tolist()})")
    tokens = torch.stack([d.tokens for d in drafts])  # (B, N)
    positions = valid_len[:, None] + layout.depth[None, :]  # (B, N)
    prefix_len = engine.rows_cache_length(cache)
    layers = drafter.base_layers
    out = engine.forward_rows(tokens, positions, valid_len, layout.ancestor_mask, cache, layers)
    hidden, drafter_in = (out, out) if not layers else (out[0], torch.cat(out, dim=-1))  # (B, N, H), (B, N, ...)
    if all_nodes:  # the engine's cheapest product over many rows (the onednn engine's packed lm_head)
        predicted = engine.lm_logits_rows(hidden.flatten(0, 1)).argmax(dim=-1).view(batch, -1)  # (B, N)
        paths, accepted = greedy_paths(tokens, predicted, layout)
        roots = predicted.gather(1, paths.gather(1, accepted[:, None]))[:, 0]  # (B,)
    else:
        def next_tokens_at(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            picked = hidden[rows, nodes]  # (R, H)
            return engine.batch_lm_logits(picked).argmax(dim=-1)  # (R,)

        paths, accepted, roots = greedy_walk(tokens, next_tokens_at, layout)
    keep = [paths[b, : int(accepted[b]) + 1] for b in range(batch)]
    valid_len = engine.keep_row_paths(cache, prefix_len, valid_len, keep)
    emitted = [torch.cat([tokens[b, k[1:]], roots[b, None]]) for b, k in enumerate(keep)]  # (A_b,) each
    for b, k in enumerate(keep):
        drafter.update(states[b], drafts[b], k, drafter_in[b, k], emitted[b])
    return roots, valid_len, [e.tolist() for e in emitted], len(layout.depth)


def batch_generate(model, heads, prompts: list[torch.Tensor], tree: Tree, max_new_tokens: int,
                   stop_token_ids: set[int] | None = None, verify_logits: str | None = None, engine=None
                   ) -> tuple[list[list[int]], BatchStats]:
    """Run :func:`batch_steps` to the end; returns ``(new token ids per prompt, stats)``."""
    stats = BatchStats()
    out: list[list[int]] = [[] for _ in prompts]
    for step in batch_steps(model, heads, prompts, tree, max_new_tokens, stop_token_ids, stats, verify_logits,
                            engine):
        for i, s in step:
            out[i].extend(s.tokens)
    return out, stats
