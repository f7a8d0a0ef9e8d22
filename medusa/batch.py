"""Batched greedy Medusa decoding: several prompts of different lengths, one base forward per step for all of them.

Each step drafts a tree for every row, verifies all ``B x N`` tree tokens in one forward of the stock model (per-row
positions and a 4D additive mask), and lets each row accept its own path. The rows' caches then differ in length;
they share one cache with holes (:mod:`medusa.kv_cache`, "batched decoding"): row b's slot s holds its position s up
to its own length, the slots beyond are hidden by the mask and overwritten as the row advances, and no row's prefix
is ever moved. A row that stops (stop token or budget) leaves the batch, so it costs nothing afterwards. Heads that
keep per-sequence state (an attention layer of their own) keep one state per row.

Greedy only: each row's tokens are exactly the base's greedy tokens, as when the prompt is decoded alone
(:func:`medusa.generate.medusa_steps`). A tree of one node (``Tree.chain(0)``) is plain batched greedy decoding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from medusa.draft import draft_tree
from medusa.engine import EagerEngine
from medusa.generate import GenerationStats, Step, _emit, check_context
from medusa.tree import Tree, TreeBuffers, tree_buffers


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
def batch_steps(model, heads, prompts: list[torch.Tensor], tree: Tree, max_new_tokens: int,
                stop_token_ids: set[int] | None = None, stats: BatchStats | None = None, verify_logits: str = "all",
                engine=None) -> Iterator[list[tuple[int, Step]]]:
    """Batched greedy Medusa decoding; yields, per base forward, ``(prompt index, Step)`` for each row still running.

    Args:
        model: the base ``*ForCausalLM`` (eval mode).
        heads: the heads (any with ``draft_logits``), or ``None`` with a tree of one node (plain decoding).
        prompts: ``B`` prompts, each ``(T_b,)`` long ids, any lengths.
        tree: candidate tree (depth <= K).
        max_new_tokens: generation budget of each row.
        stop_token_ids: a row stops after emitting one of these (included in its output).
        stats: filled in as decoding proceeds, when given.
        verify_logits: ``"all"`` scores every node of every row with the lm_head in one product (best on a GPU);
            ``"path"`` only the nodes along each row's accepted path, one product per tree level over the rows still
            matching (cheaper on a CPU). Both accept exactly the same tokens.
        engine: runs the batched forwards and cache operations (:class:`medusa.engine.Engine`, whose
            ``supports_batch`` is true); ``None``: the eager engine (a ``DynamicCache`` and the model's own modules).

    Raises:
        ValueError: an empty batch or prompt (named), a prompt that does not fit the context, a tree that does not
            fit the heads, or an engine without batched decoding.
    """
    stats = stats if stats is not None else BatchStats()
    stop = stop_token_ids or set()
    if verify_logits not in ("all", "path"):
        raise ValueError(f"verify_logits must be 'all' or 'path', got {verify_logits!r}")
    if engine is None:
        engine = EagerEngine(model)
    if not engine.supports_batch:
        raise ValueError(f"engine {engine.name!r} does not run batched decoding")
    check_prompts(prompts)
    if heads is None and tree.head_depth > 0:
        raise ValueError(f"tree {tree.name!r} has heads' nodes down to depth {tree.head_depth}: drafting needs heads")
    if heads is not None:
        tree.check_fits(heads.config.num_heads, heads.head_vocab_size)
    for ids in prompts:
        check_context(model, len(ids), max_new_tokens, tree.depth)
    device = prompts[0].device
    buffers = tree_buffers(tree, device)
    stats.rows = [GenerationStats() for _ in prompts]
    start = time.perf_counter()
    # The heads' own per-sequence state (their attention layer's cache), one per row, if they keep one.
    contexts = [heads.new_context() for _ in prompts] if heads is not None else [None] * len(prompts)
    cache, roots, last_hidden, valid_len = _prefill(engine, heads, prompts, contexts)
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
            keep = torch.tensor(running, dtype=torch.long, device=device)
            valid_len, roots, last_hidden = valid_len[keep], roots[keep], last_hidden[keep]
            engine.select_rows(cache, keep, int(valid_len.max()))
            rows, contexts = [rows[j] for j in running], [contexts[j] for j in running]
            sequences = [sequences[j] for j in running]
        start = time.perf_counter()
        roots, last_hidden, valid_len, emitted = _step(engine, heads, contexts, sequences, buffers, cache, roots,
                                                       last_hidden, valid_len, verify_logits)
        sequences = [torch.cat([seq, seq.new_tensor(e)]) for seq, e in zip(sequences, emitted, strict=True)]
        elapsed = time.perf_counter() - start
        stats.decode_s += elapsed
        stats.forwards += 1
        stats.row_forwards += len(rows)
        for i in rows:
            stats.rows[i].decode_s += elapsed


def _prefill(engine, heads, prompts: list[torch.Tensor], contexts: list):
    """Each prompt's own forward (as when decoded alone: no padding computed), then one batched cache.

    Returns:
        ``(cache, roots (B,), drafting inputs (B, H), valid_len (B,))``.
    """
    caches, roots, last = [], [], []
    for ids, context in zip(prompts, contexts, strict=True):
        cache, logits, hidden = engine.prefill_row(ids)  # (1, V), (T, H)
        root = logits[-1].argmax()
        caches.append(cache)
        roots.append(root)
        last.append(_drafting_input(heads, context, hidden, torch.cat([ids[1:], root[None]])))
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=prompts[0].device)  # (B,)
    return engine.stack_rows(caches), torch.stack(roots), torch.stack(last), lengths


def _drafting_input(heads, context, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """What the heads draft from ``(H,)``, after the base accepted positions with hidden states ``(n, H)`` followed
    by ``next_tokens`` ``(n,)`` (``heads.extend_context``; the last hidden state when there are no heads)."""
    return hidden[-1] if heads is None else heads.extend_context(context, hidden, next_tokens)


def _step(engine, heads, contexts: list, sequences: list[torch.Tensor], buffers: TreeBuffers, cache,
          roots: torch.Tensor, last_hidden: torch.Tensor, valid_len: torch.Tensor, verify_logits: str):
    """Draft, verify and accept one tree per row (``sequences[b]``: row b's prompt and emitted tokens, root last).

    Returns:
        ``(roots (B,), drafting inputs (B, H), valid_len (B,), emitted)``; ``emitted[b]``: row b's accepted draft
        tokens then its bonus token (the new root).
    """
    batch = len(roots)
    tokens = torch.stack([draft_tree(heads, last_hidden[b], roots[b], buffers, sequence=sequences[b]).tokens
                          for b in range(batch)])  # (B, N)
    positions = valid_len[:, None] + buffers.depth[None, :]  # (B, N)
    prefix_len = engine.rows_cache_length(cache)
    hidden = engine.forward_rows(tokens, positions, valid_len, buffers.ancestor_mask, cache)  # (B, N, H)
    if verify_logits == "all":
        predicted = engine.lm_logits(hidden).argmax(dim=-1)  # (B, N)
        paths, accepted = greedy_accept_rows(tokens, predicted, buffers)
        roots = predicted.gather(1, paths.gather(1, accepted[:, None]))[:, 0]  # (B,)
    else:
        def next_token_at(rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            picked = hidden[rows, nodes]  # (R, H)
            return engine.batch_lm_logits(picked).argmax(dim=-1)  # (R,)

        paths, accepted, roots = greedy_accept_rows_along_path(tokens, next_token_at, buffers)
    keep = [paths[b, : int(accepted[b]) + 1] for b in range(batch)]
    valid_len = engine.keep_row_paths(cache, prefix_len, valid_len, keep)
    emitted = [torch.cat([tokens[b, k[1:]], roots[b, None]]) for b, k in enumerate(keep)]  # (A_b,) each
    last_hidden = torch.stack([_drafting_input(heads, contexts[b], hidden[b, k], emitted[b])
                               for b, k in enumerate(keep)])  # (B, H)
    return roots, last_hidden, valid_len, [e.tolist() for e in emitted]


def greedy_accept_rows(tokens: torch.Tensor, predicted: torch.Tensor, buffers: TreeBuffers):
    """:func:`medusa.verify.greedy_accept` for every row at once.

    Args:
        tokens: ``(B, N)`` long node tokens per row.
        predicted: ``(B, N)`` long, the base's greedy next token after each node.

    Returns:
        ``(paths (B, D+1), accepted (B,))``: per row the root-to-leaf node indices of the chosen path (the first
        longest, as in ``greedy_accept``; -1 past the leaf) and how many of its drafts are accepted.
    """
    retrieve = buffers.retrieve_index  # (P, D+1)
    valid = retrieve[:, 1:] >= 0  # (P, D)
    child_tokens = tokens[:, retrieve[:, 1:].clamp_min(0)]  # (B, P, D)
    parent_preds = predicted[:, retrieve[:, :-1].clamp_min(0)]  # (B, P, D)
    match = valid[None] & (child_tokens == parent_preds)  # (B, P, D)
    lengths = match.long().cumprod(dim=2).sum(dim=2)  # (B, P)
    accepted, best = lengths.max(dim=1)  # (B,), (B,)
    return retrieve[best], accepted


def greedy_accept_rows_along_path(tokens: torch.Tensor, next_token_at, buffers: TreeBuffers):
    """:func:`greedy_accept_rows` asking for the base's prediction only along each row's accepted path.

    One call per tree level, for the rows whose path still matches (:func:`medusa.verify.greedy_accept_along_path`
    row by row: the heads' siblings are distinct tokens, and a prompt-lookup child, first among its siblings, is
    taken when it repeats one of them).

    Args:
        tokens: ``(B, N)`` long node tokens per row.
        next_token_at: ``(rows (R,), nodes (R,)) -> (R,)`` long, the base's greedy next token after those nodes.

    Returns:
        ``(paths (B, D+1), accepted (B,), next_tokens (B,))``: paths as in :func:`greedy_accept_rows`, and each row's
        bonus token (the base's prediction after its last accepted node).
    """
    batch, device = tokens.shape[0], tokens.device
    children = _children_table(buffers, device)  # (N, C)
    paths = torch.full((batch, buffers.retrieve_index.shape[1]), -1, dtype=torch.long, device=device)  # (B, D+1)
    paths[:, 0] = 0
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_tokens = torch.empty(batch, dtype=torch.long, device=device)
    rows, nodes = torch.arange(batch, device=device), torch.zeros(batch, dtype=torch.long, device=device)
    while len(rows):
        predicted = next_token_at(rows, nodes)  # (R,)
        kids = children[nodes]  # (R, C)
        match = (kids >= 0) & (tokens[rows[:, None], kids.clamp_min(0)] == predicted[:, None])  # (R, C)
        found = match.any(dim=1)  # (R,)
        next_tokens[rows[~found]] = predicted[~found]
        child = kids.gather(1, match.long().argmax(dim=1, keepdim=True))[:, 0]  # (R,)
        rows, nodes = rows[found], child[found]
        accepted[rows] += 1
        paths[rows, accepted[rows]] = nodes
    return paths, accepted, next_tokens


def _children_table(buffers: TreeBuffers, device) -> torch.Tensor:
    """``(N, C)`` long: each node's children (``buffers.children``), padded with -1."""
    width = max(1, max((len(c) for c in buffers.children), default=0))  # one -1 column at least: argmax needs one
    table = torch.full((len(buffers.children), width), -1, dtype=torch.long)
    for node, kids in enumerate(buffers.children):
        table[node, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    return table.to(device)


def batch_generate(model, heads, prompts: list[torch.Tensor], tree: Tree, max_new_tokens: int,
                   stop_token_ids: set[int] | None = None, verify_logits: str = "all", engine=None
                   ) -> tuple[list[list[int]], BatchStats]:
    """Run :func:`batch_steps` to the end; returns ``(new token ids per prompt, stats)``."""
    stats = BatchStats()
    out: list[list[int]] = [[] for _ in prompts]
    for step in batch_steps(model, heads, prompts, tree, max_new_tokens, stop_token_ids, stats, verify_logits,
                            engine):
        for i, s in step:
            out[i].extend(s.tokens)
    return out, stats
