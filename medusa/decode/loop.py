"""The generation loop: prefill, then draft -> verify -> accept steps, yielding tokens as they are accepted.

One generator (:func:`decode_steps`) is the core, over any drafter (:mod:`medusa.drafters`), engine
(:mod:`medusa.engines`) and acceptance rule (:mod:`medusa.decode.acceptance`); :func:`medusa_steps` is the same for
heads and a tree file, :func:`medusa_generate` collects it and streaming callers iterate it directly. Batch size 1 (as
in the Medusa and EAGLE reference implementations); several prompts: :mod:`medusa.decode.batch`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from medusa.decode.acceptance import acceptance_rule
from medusa.decode.greedy import Acceptance
from medusa.decode.logits_process import Decoding, resolve_decoding
from medusa.decode.tree import Tree
from medusa.drafters import DraftTree
from medusa.drafters.composite import tree_drafter
from medusa.engines import kv_cache, make_engine

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

    Each step the drafter proposes a tree below the base's latest token (:mod:`medusa.drafters.base`), the engine
    runs the base once over every node with tree attention, the acceptance rule keeps the longest path the base
    agrees with (:mod:`medusa.decode.greedy`, :mod:`medusa.decode.acceptance`), the cache keeps only that path, and
    the drafter is told what was accepted. Greedy: exactly the base's greedy tokens; rejection sampling: exactly the
    base's distribution.

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
    stats = stats if stats is not None else GenerationStats()
    stop = stop_token_ids or set()
    check_context(model, len(input_ids), max_new_tokens, drafter.max_depth)
    device = input_ids.device
    decoding = decoding if decoding is not None else resolve_decoding()
    processors = decoding.processors(len(input_ids), max_new_tokens, stop, device)
    rule = acceptance_rule(decoding, model.config.get_text_config(decoder=True).vocab_size, device)
    engine = engine if engine is not None else make_engine(None, model, step_size=drafter.max_nodes)
    all_nodes = engine.scores_all_nodes if scores_all_nodes is None else scores_all_nodes
    cache = engine.new_cache(len(input_ids) + max_new_tokens + drafter.max_nodes)
    start = time.perf_counter()
    positions = torch.arange(len(input_ids), device=device)
    logits, _, states = base_forward(engine, drafter.base_layers, input_ids, positions,
                                     kv_cache.causal_mask(len(input_ids), device), cache, logits_for=slice(-1, None))
    root = rule.next_token(_processed(processors, input_ids, logits[-1]))
    sequence = torch.cat([input_ids, root[None]])  # (T+1,) what the processors see: prompt + emitted tokens
    state = drafter.new_state()
    drafter.start(state, states, sequence[1:])
    stats.prefill_s = time.perf_counter() - start
    yield _emit([int(root)], 0, stats, max_new_tokens, stop, is_prefill=True)
    while not stats.stopped_by:
        start = time.perf_counter()
        prefix_len = engine.cache_length(cache)
        draft = drafter.propose(state, root, sequence, rule.sampler)
        check_draft(drafter, draft)
        drafted = time.perf_counter()
        result, states = verify(engine, draft, prefix_len, cache, rule, processors, sequence, all_nodes,
                                drafter.base_layers)
        verified = time.perf_counter()
        engine.keep_positions(cache, prefix_len, result.path_nodes)
        root = result.next_token
        emitted = torch.cat([draft.tokens[result.path_nodes[1:]], root[None]])  # (accepted + 1,)
        drafter.update(state, draft, result.path_nodes, states[result.path_nodes], emitted)
        _add_step_times(stats, (start, drafted, verified, time.perf_counter()), engine.last_forward_s, draft.choose_s)
        stats.tree_nodes.append(len(draft.tokens))
        sequence = torch.cat([sequence, emitted])
        stats.decode_s += time.perf_counter() - start
        yield _emit(emitted.tolist(), result.accepted, stats, max_new_tokens, stop,
                    copied=copied_on_path(draft, result.path_nodes))


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
    """One forward of the base over the drafted tree, then ``rule`` accepts a path; returns ``(Acceptance, states
    (N, ...))``: the hidden states ``(N, H)``, or with ``layers`` the base states :func:`base_forward` returns.

    With ``all_nodes`` every node's logits come from one lm_head product, else one row at a time as the rule walks.
    At node n the processors see ``sequence`` (prompt and emitted tokens, the root last) followed by the path below
    the root down to n: the input ids ``generate`` would have at that point.
    """
    tokens, layout = draft.tokens, draft.layout
    rows = None if all_nodes else slice(0, 0)
    logits, hidden, states = base_forward(engine, layers, tokens, prefix_len + layout.depth, layout.ancestor_mask,
                                          cache, logits_for=rows)  # (N or 0, V), (N, H), (N, ...)

    def logits_at(node: int) -> torch.Tensor:
        raw = logits[node] if rows is None else engine.lm_logits_rows(hidden[node : node + 1])[0]  # (V,)
        if not processors:
            return raw
        path = tokens[layout.node_paths[node, 1 : int(layout.depth[node]) + 1]]  # below the root, down to node
        return _processed(processors, torch.cat([sequence, path]), raw)

    predicted = logits.argmax(dim=-1) if rows is None and not processors else None  # (N,)
    return rule.accept(draft, logits_at, predicted), states


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
