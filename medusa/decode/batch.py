"""Batched Medusa decoding: several prompts of different lengths, one base forward per step for all of them.

Each step drafts a tree for every row, verifies all ``B x N`` tree tokens in one forward of the stock model (per-row
positions and a 4D additive mask), and lets each row accept its own path with its own acceptance rule: the one
decode step of :class:`medusa.decode.loop.RunningBatch`, which this module runs over a list of prompts. The rows'
caches then differ in length; they share one cache with holes (:mod:`medusa.engines.kv_cache`, "batched decoding";
the engine's own cache): row b's slot s holds its position s up to its own length, the slots beyond are hidden by the
mask and overwritten as the row advances, and no row's prefix is ever moved. A row that stops (stop token or budget)
leaves the batch, so it costs nothing afterwards. Heads that keep per-sequence state keep one state per row.

Each row decodes as its prompt alone would (:func:`medusa.decode.loop.decode_steps`): greedy, exactly the base's
greedy tokens; rejection sampling, exactly the base's distribution. A tree of one node (``Tree.chain(0)``) is plain
batched decoding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from medusa.decode.logits_process import Decoding
from medusa.decode.loop import (  # noqa: F401 - RunningBatch and same_shape are imported from here too
    GenerationStats,
    RunningBatch,
    Step,
    check_context,
    legacy_scores_all_nodes,
    same_shape,
)
from medusa.decode.tree import Tree
from medusa.drafters.composite import tree_drafter


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
                       scores_all_nodes: bool | None = None, engine=None, decoding: Decoding | None = None
                       ) -> Iterator[list[tuple[int, Step]]]:
    """Batched speculative decoding; yields, per base forward, ``(prompt index, Step)`` for each row still running
    (all prompts join a :class:`medusa.decode.loop.RunningBatch` at once, then it steps until every row has left).

    Args:
        model: the base ``*ForCausalLM`` (eval mode).
        drafter: proposes each row's tree (:class:`medusa.drafters.base.Drafter`); one state per row. All rows of a
            step must get trees of one size (one forward holds them all).
        prompts: ``B`` prompts, each ``(T_b,)`` long ids, any lengths.
        max_new_tokens: generation budget of each row.
        stop_token_ids: a row stops after emitting one of these (included in its output).
        stats: filled in as decoding proceeds, when given.
        scores_all_nodes: score every node of every row with the lm_head in one product (``True``), or only the
            nodes along each row's accepted path (``False``). Both accept exactly the same tokens. ``None``: what the
            engine declares cheaper (:attr:`medusa.engines.Engine.scores_all_nodes`).
        engine: runs the forwards and cache operations (:class:`medusa.engines.Engine`, whose ``supports_batch`` is
            true); ``None``: the eager engine.
        decoding: every row's generation settings and acceptance rule
            (:func:`medusa.decode.logits_process.resolve_decoding`); each row gets its own rule and random generator
            (seeded with ``decoding.seed``: a row samples as its prompt alone would with that seed). ``None``: plain
            greedy.

    Raises:
        ValueError: an empty batch or prompt (named), a prompt that does not fit the context, an engine without
            batched decoding, or rows drafted with trees of different sizes in one step.
    """
    stats = stats if stats is not None else BatchStats()
    check_prompts(prompts)
    for ids in prompts:
        check_context(model, len(ids), max_new_tokens, drafter.max_depth)
    batch = RunningBatch(model, drafter, engine, scores_all_nodes)
    if len(prompts) > 1 and not batch.engine.supports_batch:
        raise ValueError(f"engine {batch.engine.name!r} does not run batched decoding")
    stats.rows = [GenerationStats() for _ in prompts]
    start = time.perf_counter()
    first = [(i, batch.join(i, ids, max_new_tokens, stop_token_ids, stats.rows[i], decoding))
             for i, ids in enumerate(prompts)]
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
