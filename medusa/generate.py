"""The Medusa generation loop: prefill, then draft -> verify -> accept steps, yielding tokens as they are accepted.

One generator (:func:`medusa_steps`) is the core; :func:`medusa_generate` collects it and streaming callers iterate
it directly. Batch size 1 (as in the Medusa and EAGLE reference implementations).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from medusa import kv_cache
from medusa.draft import Draft, draft_tree
from medusa.engine import DEFAULT_ENGINE, make_engine
from medusa.logits_process import Decoding, resolve_decoding
from medusa.sampling import GreedyAcceptance, RejectionSampling, TypicalAcceptance
from medusa.tree import Tree, TreeBuffers, tree_buffers
from medusa.verify import greedy_accept_along_path

STEP_PARTS = ("draft", "verify_forward", "accept", "cache")
"""A decode step's parts: the heads' draft, the base's forward over the tree (mask included), the acceptance walk
(lm_head rows along the path included) and the cache compaction (with the heads' own context update, if they keep
one)."""


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
def medusa_steps(model, heads, input_ids: torch.Tensor, tree: Tree, max_new_tokens: int,
                 stop_token_ids: set[int] | None = None, stats: GenerationStats | None = None,
                 verify_logits: str = "all", decoding: Decoding | None = None, engine=None) -> Iterator[Step]:
    """Medusa decoding, one :class:`Step` per base forward: greedy, or sampling (see :mod:`medusa.sampling`).

    Args:
        model: the base ``*ForCausalLM`` (eval mode).
        heads: :class:`medusa.heads.MedusaHeads` or :class:`medusa.heads.HydraHeads` on the same device and dtype.
        input_ids: ``(T,)`` long prompt ids.
        tree: candidate tree; must fit the heads (depth <= K).
        max_new_tokens: generation budget.
        stop_token_ids: stop after emitting any of these (included in the output).
        stats: filled in as decoding proceeds, when given.
        verify_logits: ``"all"`` scores every tree node with the lm_head in one product (best on a GPU, and with
            the ``onednn`` engine's prepacked lm_head on a CPU); ``"path"`` scores one node at a time along the
            accepted path (cheaper with MKL's matrix-vector kernel on a CPU, see
            :func:`medusa.verify.greedy_accept_along_path`). Both accept exactly the same tokens.
        decoding: generation settings and acceptance rule (:func:`medusa.logits_process.resolve_decoding`);
            ``None``: plain greedy, no logits processor.
        engine: where the KV cache lives and how a forward runs (:func:`medusa.engine.make_engine`);
            ``None``: the default engine for ``model``.

    Raises:
        ValueError: the tree does not fit the heads, or the prompt does not fit the context.
    """
    stats = stats if stats is not None else GenerationStats()
    stop = stop_token_ids or set()
    if verify_logits not in ("all", "path"):
        raise ValueError(f"verify_logits must be 'all' or 'path', got {verify_logits!r}")
    tree.check_fits(heads.config.num_heads, heads.head_vocab_size)
    check_context(model, len(input_ids), max_new_tokens, tree.depth)
    device = input_ids.device
    buffers = tree_buffers(tree, device)
    decoding = decoding if decoding is not None else resolve_decoding()
    processors = decoding.processors(len(input_ids), max_new_tokens, stop, device)
    rule = acceptance_rule(decoding, heads, buffers, model.config.get_text_config(decoder=True).vocab_size, device)
    # Plain greedy keeps the vectorised all-node acceptance; anything else walks the tree with processed logits.
    verify = _verify if isinstance(rule, GreedyAcceptance) and not processors else _verify_processed
    engine = engine if engine is not None else make_engine(DEFAULT_ENGINE, model)
    cache = engine.new_cache(len(input_ids) + max_new_tokens + len(buffers.depth))
    start = time.perf_counter()
    positions = torch.arange(len(input_ids), device=device)
    logits, hidden = engine.forward(input_ids, positions, kv_cache.causal_mask(len(input_ids), device), cache,
                                    logits_for=slice(-1, None))
    root = rule.next_token(_processed(processors, input_ids, logits[-1]))
    sequence = torch.cat([input_ids, root[None]])  # (T+1,) what the processors see: prompt + emitted tokens
    context = heads.new_context()  # the heads' own state (their attention layer's cache), if they keep one
    last_hidden = heads.extend_context(context, hidden, sequence[1:])  # (H,) drafting input
    stats.prefill_s = time.perf_counter() - start
    step = _emit([int(root)], 0, stats, max_new_tokens, stop, is_prefill=True)
    yield step
    while not stats.stopped_by:
        start = time.perf_counter()
        prefix_len = engine.cache_length(cache)
        draft = draft_tree(heads, last_hidden, root, buffers, rule.choose, sequence)
        drafted = time.perf_counter()
        result, hidden = verify(engine, draft, prefix_len + buffers.depth, buffers, cache, verify_logits,
                                rule, processors, sequence)
        verified = time.perf_counter()
        engine.keep_positions(cache, prefix_len, result.path_nodes)
        root = result.next_token
        emitted = torch.cat([draft.tokens[result.path_nodes[1:]], root[None]])  # (accepted + 1,)
        last_hidden = heads.extend_context(context, hidden[result.path_nodes], emitted)
        _add_step_times(stats, (start, drafted, verified, time.perf_counter()), engine.last_forward_s)
        sequence = torch.cat([sequence, emitted])
        stats.decode_s += time.perf_counter() - start
        yield _emit(emitted.tolist(), result.accepted, stats, max_new_tokens, stop)


def acceptance_rule(decoding: Decoding, heads, buffers: TreeBuffers, vocab_size: int, device):
    """The acceptance rule for ``decoding`` (picked once per decode call), with its own seeded generator."""
    if not decoding.do_sample:
        return GreedyAcceptance(buffers)
    generator = torch.Generator(device=device)
    if decoding.seed is None:
        generator.seed()
    else:
        generator.manual_seed(decoding.seed)
    if decoding.acceptance == "typical":
        return TypicalAcceptance(buffers, decoding.typical_epsilon, decoding.typical_delta, generator)
    head_to_base = heads.to_base_ids(torch.arange(heads.head_vocab_size, device=device))  # (Vh,)
    return RejectionSampling(buffers, head_to_base, vocab_size, decoding.draft_warp(), generator)


def _processed(processors, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply the logits processors to one row ``(V,)`` of next-token logits after the tokens ``ids`` ``(L,)``."""
    if not processors:
        return logits
    return processors(ids[None], logits[None].float().clone())[0]  # (V,)


def _verify(engine, draft: Draft, positions, buffers, cache, verify_logits: str, rule, processors, sequence):
    """One tree forward and plain greedy acceptance (no processor); returns ``(Acceptance, hidden (N, H))``."""
    tokens = draft.tokens
    if verify_logits == "all":
        logits, hidden = engine.forward(tokens, positions, buffers.ancestor_mask, cache)  # (N, V), (N, H)
        predicted = logits.argmax(dim=-1)  # (N,)
        # The walk, not greedy_accept: it also follows a prompt-lookup node's twin (same tokens, same prediction).
        return greedy_accept_along_path(tokens, predicted.__getitem__, buffers), hidden
    _, hidden = engine.forward(tokens, positions, buffers.ancestor_mask, cache, logits_for=slice(0, 0))

    def next_token_at(node: int) -> torch.Tensor:
        return engine.lm_logits_rows(hidden[node : node + 1])[0].argmax()

    return greedy_accept_along_path(tokens, next_token_at, buffers), hidden


def _verify_processed(engine, draft: Draft, positions, buffers: TreeBuffers, cache, verify_logits: str, rule,
                      processors, sequence: torch.Tensor):
    """One tree forward, then ``rule`` walks the tree asking for the base's processed logits node by node.

    At node n the processors see ``sequence`` (prompt and emitted tokens, the root last) followed by the path below
    the root down to n: the input ids ``generate`` would have at that point.
    """
    tokens = draft.tokens
    rows = None if verify_logits == "all" else slice(0, 0)
    logits, hidden = engine.forward(tokens, positions, buffers.ancestor_mask, cache, logits_for=rows)

    def logits_at(node: int) -> torch.Tensor:
        raw = logits[node] if rows is None else engine.lm_logits_rows(hidden[node : node + 1])[0]  # (V,)
        path = tokens[buffers.node_paths[node, 1 : int(buffers.depth[node]) + 1]]  # below the root, down to node
        return _processed(processors, torch.cat([sequence, path]), raw)

    return rule.accept(draft, logits_at), hidden


def _add_step_times(stats: GenerationStats, marks: tuple[float, ...], forward_s: float) -> None:
    """Add one step's parts to ``stats.step_s``: ``marks`` are the clock at its start, after the draft, after the
    verification and after the compaction and context update; ``forward_s`` is the engine's forward inside the
    verification."""
    start, drafted, verified, compacted = marks
    parts = (drafted - start, forward_s, verified - drafted - forward_s, compacted - verified)
    for name, seconds in zip(STEP_PARTS, parts, strict=True):
        stats.step_s[name] += seconds


def _emit(tokens: list[int], accepted: int, stats: GenerationStats, budget: int, stop: set[int],
          is_prefill: bool = False) -> Step:
    """Cut ``tokens`` at the first stop token and at the budget, and account for them in ``stats``."""
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
    return Step(tokens, accepted, is_prefill)


def medusa_generate(model, heads, input_ids: torch.Tensor, tree: Tree, max_new_tokens: int,
                    stop_token_ids: set[int] | None = None, verify_logits: str = "all",
                    decoding: Decoding | None = None, engine=None) -> tuple[list[int], GenerationStats]:
    """Run :func:`medusa_steps` to the end; returns ``(new_token_ids, stats)``."""
    stats = GenerationStats()
    out: list[int] = []
    for step in medusa_steps(model, heads, input_ids, tree, max_new_tokens, stop_token_ids, stats, verify_logits,
                             decoding, engine):
        out.extend(step.tokens)
    return out, stats
