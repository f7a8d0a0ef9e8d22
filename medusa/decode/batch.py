"""Batched greedy Medusa decoding: several prompts of different lengths, one base forward per step for all of them.

Each step drafts a tree for every row, verifies all ``B x N`` tree tokens in one forward of the stock model (per-row
positions and a 4D additive mask), and lets each row accept its own path. The rows' caches then differ in length;
they share one cache with holes (:mod:`medusa.engines.kv_cache`, "batched decoding"): row b's slot s holds its
position s up to its own length, the slots beyond are hidden by the mask and overwritten as the row advances, and no
row's prefix is ever moved. A row that stops (stop token or budget) leaves the batch, so it costs nothing afterwards.
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
from medusa.decode.tree import Tree, TreeBuffers
from medusa.drafters.base import RowsDrafter, TopK
from medusa.drafters.composite import tree_drafter
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
    running.

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
    stop = stop_token_ids or set()
    if engine is None:
        engine = EagerEngine(model)
    if not engine.supports_batch:
        raise ValueError(f"engine {engine.name!r} does not run batched decoding")
    check_prompts(prompts)
    for ids in prompts:
        check_context(model, len(ids), max_new_tokens, drafter.max_depth)
    all_nodes = model.device.type != "cpu" if scores_all_nodes is None else scores_all_nodes
    stats.rows = [GenerationStats() for _ in prompts]
    start = time.perf_counter()
    states = [drafter.new_state() for _ in prompts]  # the drafter's per-sequence state, one per row
    cache, roots, valid_len = _prefill(engine, drafter, prompts, states)
    stats.prefill_s = time.perf_counter() - start
    for row in stats.rows:
        row.prefill_s = stats.prefill_s
    rows = list(range(len(prompts)))  # prompt index of each cache row
    emitted = [[int(r)] for r in roots]
    sequences = [torch.cat([ids, r[None]]) for ids, r in zip(prompts, roots, strict=True)]  # what lookup copies from
    while True:
        out = [(i, _emit(tokens, len(tokens) - 1, stats.rows[i], max_new_tokens, stop, is_prefill=not stats.forwards))
               for i, tokens in zip(rows, emitted, strict=True)]
        yield out
        running = [j for j, i in enumerate(rows) if not stats.rows[i].stopped_by]
        if not running:
            break
        if len(running) < len(rows):
            keep = torch.tensor(running, dtype=torch.long, device=roots.device)
            valid_len, roots = valid_len[keep], roots[keep]
            engine.select_rows(cache, keep, int(valid_len.max()))
            rows, states = [rows[j] for j in running], [states[j] for j in running]
            sequences = [sequences[j] for j in running]
        start = time.perf_counter()
        roots, valid_len, emitted, nodes = _step(engine, drafter, states, sequences, cache, roots, valid_len,
                                                 all_nodes)
        sequences = [torch.cat([seq, seq.new_tensor(e)]) for seq, e in zip(sequences, emitted, strict=True)]
        elapsed = time.perf_counter() - start
        stats.decode_s += elapsed
        stats.forwards += 1
        stats.row_forwards += len(rows)
        for i in rows:
            stats.rows[i].decode_s += elapsed
            stats.rows[i].tree_nodes.append(nodes)


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


def _prefill(engine, drafter, prompts: list[torch.Tensor], states: list):
    """Each prompt's own forward (as when decoded alone: no padding computed), then one batched cache.

    Returns:
        ``(cache, roots (B,), valid_len (B,))``.
    """
    caches, roots = [], []
    for ids, state in zip(prompts, states, strict=True):
        cache, logits, hidden, *features = engine.prefill_row(ids, drafter.base_layers)  # (1, V), (T, H)
        root = logits[-1].argmax()
        caches.append(cache)
        roots.append(root)
        states_in = torch.cat([hidden, *features], dim=-1)  # (T, H) or base states (medusa.decode.loop.base_forward)
        drafter.start(state, states_in, torch.cat([ids[1:], root[None]]))
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=prompts[0].device)  # (B,)
    return engine.stack_rows(caches), torch.stack(roots), lengths


def _step(engine, drafter, states: list, sequences: list[torch.Tensor], cache, roots: torch.Tensor,
          valid_len: torch.Tensor, all_nodes: bool):
    """Draft, verify and accept one tree per row (``sequences[b]``: row b's prompt and emitted tokens, root last).

    Returns:
        ``(roots (B,), valid_len (B,), emitted, nodes)``; ``emitted[b]``: row b's accepted draft tokens then its bonus
        token (the new root); ``nodes``: the step's tree size. A drafter with ``propose_rows`` (the per-step tree)
        grows one tree shape for all rows at once; any other proposes row by row.
    """
    batch = len(roots)
    if isinstance(drafter, RowsDrafter):  # one tree shape grown for all rows (medusa.drafters.per_step)
        drafts = drafter.propose_rows(states, roots, sequences, GREEDY)
    else:
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
    if all_nodes:
        predicted = engine.lm_logits(hidden).argmax(dim=-1)  # (B, N)
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
