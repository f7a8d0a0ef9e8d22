"""A separate draft model as the drafter: classic speculative decoding (pure tensor code around two causal LMs).

A cheap causal LM q that shares the base's vocabulary drafts K tokens autoregressively, and the base p verifies
all K + 1 positions in one forward (Leviathan et al. 2023, "Fast inference from transformers via speculative
decoding", section 2; Chen et al. 2023, "Accelerating large language model decoding with speculative sampling",
algorithm 2). Greedy decoding accepts the longest prefix the base agrees with; speculative sampling accepts draft x
with probability ``min(1, p(x) / q(x))`` and at the first rejection draws the correction from
``norm(max(0, p - q))``, a bonus token from p when every draft is accepted, so the output is distributed exactly as
p. With top-k candidates per node (a tree of width W), the same rule runs over the siblings in draw order, each
drawn without replacement from q (:class:`medusa.decode.acceptance.RejectionSampling`, SpecInfer's multi-step
rule): the chain is the tree of width 1.

The draft is any local causal-LM folder with the base's tokenizer (:func:`check_vocabularies`), a smaller sibling
or one cut from the base itself (``medusa make-draft``, :mod:`medusa.tools.make_draft`). It drafts through the heads'
interface (:class:`DraftModelHeads`: ``draft_logits(k, context, path_tokens)`` one level of the tree at a time), so
:func:`medusa.drafters.heads_drafter.draft_tree` fills the tree, the acceptance rules read its q, and the
prompt-lookup chain can sit beside it as another branch (:func:`medusa.drafters.composite.tree_drafter`).

State (:class:`DraftContext`, one per sequence): the draft's own KV cache through an engine of its own
(:mod:`medusa.engines`), holding exactly the accepted tokens. Each step first feeds the tokens emitted since the
last step (the accepted drafts and the base's bonus token, the new root: one forward), whose last logits draft depth
1; each deeper level is one forward over that level's parents with a tree mask. The drafted entries are then cut
off (:meth:`DraftModelHeads.discard_tree`), so after a rejection nothing of the rejected branch stays: the cache is
always the one the accepted tokens alone would build.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from medusa.decode.tree import Tree
from medusa.drafters.base import DraftSampler, DraftTree, register_drafter
from medusa.drafters.heads_drafter import HeadsDrafter, HeadsState, draft_tree
from medusa.engines import kv_cache

logger = logging.getLogger(__name__)

DRAFT_VOCAB_FILE = "draft_vocab.json"
"""Optional file in a draft folder: ``{"token_map": [base ids...]}``, the rows of the draft's lm_head it drafts
from (a truncated draft vocabulary, :func:`medusa.drafters.heads.most_frequent_tokens`); absent: all of them."""


def draft_tree_shape(tokens: int, width: int = 1) -> Tree:
    """The tree a draft model fills: the chain of ``tokens`` drafts (``width`` 1, the classic algorithm) or the full
    top-``width`` tree of depth ``tokens`` (every rank path with ranks below ``width``; ``width**1 + ... +
    width**tokens`` nodes below the root, :func:`medusa.tools.plan.tree_paths`).

    Raises:
        ValueError: ``tokens`` < 1 or ``width`` < 1 (named), or a tree of more than 256 nodes.
    """
    for name, value in (("draft tokens", tokens), ("draft width", width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if width == 1:
        return Tree(tuple((0,) * d for d in range(1, tokens + 1)), f"draft-chain-{tokens}")
    nodes = sum(width**d for d in range(1, tokens + 1))
    if nodes > 256:
        raise ValueError(f"a full tree of width {width} and depth {tokens} has {nodes} nodes: at most 256 are "
                         "verified in one forward (lower --draft-width or --draft-tokens)")
    paths, level = [], [()]
    for _ in range(tokens):
        level = [p + (r,) for p in level for r in range(width)]
        paths += level
    return Tree.from_paths(paths, f"draft-tree-{width}x{tokens}")


def check_vocabularies(base_tokenizer, draft_tokenizer, base_vocab: int, draft_vocab: int) -> None:
    """Raise ``ValueError`` unless the draft reads and writes the base's token ids: equal tokenizer vocabularies
    (id -> token string) and a draft lm_head covering every id of the base's tokenizer.

    Args:
        base_tokenizer, draft_tokenizer: Hugging Face tokenizers, or ``None`` (then only the sizes are checked).
        base_vocab, draft_vocab: the models' ``vocab_size`` (lm_head rows; either may be padded past the
            tokenizer).

    Raises:
        ValueError: naming the first id whose token differs (and both tokens), or the sizes.
    """
    if base_tokenizer is not None and draft_tokenizer is not None:
        base_ids = {i: t for t, i in base_tokenizer.get_vocab().items()}
        draft_ids = {i: t for t, i in draft_tokenizer.get_vocab().items()}
        for i in range(max(len(base_ids), len(draft_ids))):
            if base_ids.get(i) != draft_ids.get(i):
                raise ValueError(f"the draft's tokenizer differs from the base's at token id {i}: base "
                                 f"{base_ids.get(i)!r}, draft {draft_ids.get(i)!r} (a draft must share the base's "
                                 "vocabulary)")
        used = len(base_ids)
    else:
        used = base_vocab
    if draft_vocab < used:
        raise ValueError(f"the draft's lm_head has {draft_vocab} rows but the base's tokenizer has {used} ids: it "
                         f"cannot draft ids {draft_vocab} and above")


def context_limit(config) -> int | None:
    """The most positions a causal LM's config allows (``max_position_embeddings`` / ``n_positions``), or None."""
    config = config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


@dataclass
class DraftModelConfig:
    """What the heads' machinery reads of a drafter's config."""

    num_heads: int
    """The deepest node the draft may fill (``--draft-tokens``)."""
    head_vocab_size: int
    """Ids the draft drafts from (its lm_head rows used)."""
    vocab_size: int
    """The base's vocabulary size."""
    head_type: str = "draft_model"


@dataclass
class DraftContext:
    """One sequence's draft state: the draft model's KV cache of the accepted tokens and this step's tree."""

    cache: object = None
    capacity: int = 0
    """Positions the cache was made for."""
    fed: int = 0
    """Tokens of the sequence in the cache (positions 0 .. fed-1; the last is the current root)."""
    root_logits: torch.Tensor | None = None
    """``(Vd,)`` the draft's logits after the root: what depth 1 is drawn from."""
    tree: list = field(default_factory=list)
    """Token paths (root first) of this step's drafted nodes in the cache after position ``fed``, in slot order."""


class DraftModelHeads(nn.Module):
    """A causal LM drafting through the heads' interface (see module docstring).

    Args:
        model: the draft ``*ForCausalLM`` (moved with this module: ``.to`` moves and casts it).
        depth: the deepest node it may draft (``config.num_heads``).
        base_vocab: the base's ``vocab_size``; draft logits beyond it are dropped.
        engine: the draft's own engine name (:func:`medusa.engines.make_engine`; default ``"eager"``).
        token_map: ``(Vd,)`` base ids of the lm_head rows it drafts from (a truncated draft vocabulary); ``None``:
            every id below ``min(base_vocab, draft vocab)``.
        capacity: cache positions preallocated per sequence by static engines (default: the draft's context,
            at most 8192).

    Raises:
        ValueError: ``depth`` < 1, or a token map with ids outside the vocabularies.
    """

    base_layers: tuple[int, ...] = ()

    drafts_rows_together = False  # its draft state is a context of its own per sequence

    def __init__(self, model, depth: int, base_vocab: int, engine: str | None = "eager",
                 token_map: torch.Tensor | None = None, capacity: int | None = None, **engine_options):
        super().__init__()
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"draft tokens must be an int >= 1, got {depth!r}")
        self.model = model.eval()
        rows = min(base_vocab, model.get_output_embeddings().weight.shape[0])
        if token_map is not None:
            token_map = torch.as_tensor(token_map, dtype=torch.long)
            if token_map.ndim != 1 or not len(token_map) or int(token_map.min()) < 0 or int(token_map.max()) >= rows:
                raise ValueError(f"the draft's token map must list distinct ids in [0, {rows}), got "
                                 f"{len(token_map)} ids")
            if len(set(token_map.tolist())) != len(token_map):
                raise ValueError("the draft's token map lists an id twice")
        self.register_buffer("token_map", token_map, persistent=False)
        self.rows = rows
        self.config = DraftModelConfig(depth, rows if token_map is None else len(token_map), base_vocab)
        self.limit = context_limit(model.config)
        self.engine_name, self.engine_options = engine, engine_options
        self.capacity = capacity or min(self.limit or 8192, 8192)
        self._engine = None
        self._head: torch.Tensor | None = None  # (Vd, H) the truncated lm_head rows, gathered once
        self.quantized: str | None = None
        """``"int8"`` when the draft's decoder layers were quantized at load (:func:`quantize_draft`)."""
        self.source: str | None = None
        """The folder the draft was loaded from (:func:`load_draft_model`)."""

    def _apply(self, fn, recurse=True):
        self._engine = None  # a moved or cast model: its engine (and any packed weight copies) is made again
        self._head = None
        return super()._apply(fn, recurse)

    def use_engine(self, name: str | None, **options) -> None:
        """Draft through the engine ``name`` from now on (:func:`medusa.engines.make_engine`, made at first use)."""
        self.engine_name, self.engine_options, self._engine = name, options, None

    def settings(self) -> dict:
        """What the bench records about the draft."""
        return {"draft_model": self.source, "draft_engine": self.engine.name, "draft_tokens": self.config.num_heads,
                "draft_vocab": self.config.head_vocab_size, "draft_quantized": self.quantized,
                "draft_layers": getattr(self.model.config.get_text_config(decoder=True), "num_hidden_layers", None)
                or getattr(self.model.config, "n_layer", None)}

    @property
    def engine(self):
        """The draft's own engine, made at first use (after any move or cast)."""
        if self._engine is None:
            from medusa.engines import make_engine

            self._engine = make_engine(self.engine_name, self.model, step_size=1, **self.engine_options)
        return self._engine

    @property
    def head_vocab_size(self) -> int:
        return self.config.head_vocab_size

    def to_base_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Base ids of draft vocabulary ids (any shape)."""
        return ids if self.token_map is None else self.token_map[ids]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits ``(M, Vd)`` of the draft's last hidden states ``(M, H)`` (its soft-capping included)."""
        if self.token_map is None:
            return self.engine.lm_logits(hidden)[..., : self.rows]
        if self._head is None:  # gathered once, not per draft forward (a copy of Vd x H)
            self._head = self.model.get_output_embeddings().weight[self.token_map].detach()  # (Vd, H)
        return kv_cache.soft_cap(self.model, hidden @ self._head.t().to(hidden.dtype))

    # -- the heads' decoding interface ---------------------------------------------------------------------------
    def new_context(self) -> DraftContext:
        return DraftContext()

    def catch_up(self, context: DraftContext, sequence: torch.Tensor) -> None:
        """Feed the tokens of ``sequence`` ``(S,)`` (prompt and emitted tokens, the root last) not yet in the
        draft's cache, in one causal forward; its last logits draft depth 1.

        Raises:
            ValueError: the sequence plus a full draft does not fit the draft's context.
        """
        need = len(sequence) + self.config.num_heads
        if self.limit is not None and need > self.limit:
            raise ValueError(f"the draft model's context is {self.limit} positions: {len(sequence)} tokens plus "
                             f"{self.config.num_heads} drafts do not fit (a smaller --draft-tokens, or a shorter "
                             "prompt or budget)")
        engine = self.engine
        if context.cache is None:
            context.capacity = max(self.capacity, need)
            context.cache = engine.new_cache(context.capacity)
        elif need > context.capacity:
            raise ValueError(f"the draft's cache holds {context.capacity} positions: {len(sequence)} tokens plus "
                             f"{self.config.num_heads} drafts do not fit (pass a larger capacity)")
        new = sequence[context.fed :]
        if not len(new):
            raise ValueError("the draft model was asked to draft twice after the same root")
        positions = torch.arange(context.fed, len(sequence), device=sequence.device)
        _, hidden = engine.forward(new, positions, kv_cache.causal_mask(len(new), sequence.device), context.cache,
                                   logits_for=slice(0, 0))  # (n, H)
        context.root_logits = self._logits(hidden[-1:])[0]  # (Vd,)
        context.fed = len(sequence)
        context.tree = []

    def draft_logits(self, k: int, hidden: DraftContext, path_tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits at ``P`` tree nodes of depth ``k`` (0: the root).

        Depth 0 is the root's logits from :meth:`catch_up`. A deeper level is one draft forward over its parents,
        each seeing the accepted tokens and its own ancestors: when every drafted node already in the cache is an
        ancestor of every parent (a chain), only the parents are fed; otherwise the level's parents and their
        ancestors are fed again after the accepted tokens, with the tree's mask among them.

        Args:
            k: the nodes' depth.
            hidden: the sequence's :class:`DraftContext`.
            path_tokens: ``(P, k + 1)`` long base ids from the root down to each node.

        Returns:
            ``(P, Vd)`` logits of the nodes' children.
        """
        context = hidden
        if k == 0:
            return context.root_logits[None].expand(len(path_tokens), -1)
        engine, device = self.engine, path_tokens.device
        paths = [tuple(p) for p in path_tokens.tolist()]
        incremental = all(len(c) <= len(p) and p[: len(c)] == c for c in context.tree for p in paths)
        if incremental:
            feed = paths
        else:
            engine.keep_positions(context.cache, context.fed, torch.empty(0, dtype=torch.long, device=device))
            context.tree = []
            feed = sorted({p[:d] for p in paths for d in range(2, k + 2)}, key=len)  # ancestors, then the parents
        visible = torch.tensor([[len(b) <= len(a) and a[: len(b)] == b for b in feed] for a in feed],
                               dtype=torch.bool, device=device)  # (F, F): b is on a's path (a included)
        tokens = torch.tensor([p[-1] for p in feed], dtype=torch.long, device=device)  # (F,)
        positions = torch.tensor([context.fed - 2 + len(p) for p in feed], dtype=torch.long, device=device)
        index = {p: i for i, p in enumerate(feed)}
        rows = torch.tensor([index[p] for p in paths], dtype=torch.long, device=device)  # (P,)
        _, out = engine.forward(tokens, positions, visible, context.cache, logits_for=slice(0, 0))  # (F, H)
        context.tree += feed
        return self._logits(out[rows])  # (P, Vd)

    def discard_tree(self, context: DraftContext) -> None:
        """Cut this step's drafted entries from the cache: it holds the accepted tokens only."""
        if context.tree:
            self.engine.keep_positions(context.cache, context.fed,
                                       torch.empty(0, dtype=torch.long, device=context.root_logits.device))
            context.tree = []

    def make_drafter(self, tree: Tree) -> DraftModelDrafter:
        """The drafter of this draft model on ``tree`` (:func:`medusa.drafters.composite.tree_drafter`)."""
        return DraftModelDrafter(self, tree)


@register_drafter("draft_model")
class DraftModelDrafter(HeadsDrafter):
    """A draft model filling a fixed tree of ranks (a chain for the classic algorithm, :func:`draft_tree_shape`),
    one draft forward per level (see module docstring).

    Training: ``head_type: draft_model`` distils the draft's layers toward the base (the teacher's KL,
    :mod:`train.draft_model`); saved as an ordinary model folder.

    Args:
        heads: the :class:`DraftModelHeads`.
        tree: the ranks drafted (its lookup chain, if any, is another drafter).
    """

    trainable = True
    training_objective = ("KL(p_base || q_draft) at every position: the teacher's distribution distilled "
                          "(head_type draft_model in train.drafters)")

    def start(self, state: HeadsState, hidden: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Nothing yet: the prompt is fed at the first :meth:`propose`, which sees the whole sequence."""

    def propose(self, state: HeadsState, root: torch.Tensor, sequence: torch.Tensor,
                sampler: DraftSampler) -> DraftTree:
        layout, vocab = self._layout(root.device)
        self.heads.catch_up(state.context, sequence)
        try:
            return draft_tree(self.heads, state.context, root, layout, sampler, vocab)
        finally:
            self.heads.discard_tree(state.context)

    def update(self, state: HeadsState, draft: DraftTree, path: torch.Tensor, hidden: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        """Nothing: the emitted tokens are fed at the next :meth:`propose` (one forward with the new root)."""


def load_draft_model(folder: str | Path, base, base_tokenizer=None, depth: int = 4, engine: str | None = "eager",
                     quantize: str | None = None, **options) -> DraftModelHeads:
    """A draft model folder made ready to draft for ``base``: loaded, its vocabulary checked against the base's,
    moved to the base's device and dtype (with a note when it was stored otherwise), its ``draft_vocab.json``
    read when present, its decoder layers quantized when ``quantize`` says so (:func:`quantize_draft`; the base's
    own folder then makes "a quantized copy of the target").

    Raises:
        FileNotFoundError: no folder with a ``config.json``.
        ValueError: another vocabulary (the first differing id named), ``depth`` < 1, a bad token map, or a
            quantization that cannot run here (named).
    """
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"draft model folder {folder} does not exist or has no config.json")
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"--draft-tokens must be an int >= 1, got {depth!r}")
    model = AutoModelForCausalLM.from_pretrained(folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    base_vocab = base.get_output_embeddings().weight.shape[0]
    check_vocabularies(base_tokenizer, tokenizer, base_vocab, model.get_output_embeddings().weight.shape[0])
    dtype = base.get_output_embeddings().weight.dtype
    stored = model.get_output_embeddings().weight
    if stored.dtype != dtype or stored.device != base.device:
        logger.warning("note: the draft model %s (%s on %s) is moved to the base's %s on %s", folder, stored.dtype,
                       stored.device, dtype, base.device)
    token_map = None
    if (folder / DRAFT_VOCAB_FILE).is_file():
        token_map = torch.tensor(json.loads((folder / DRAFT_VOCAB_FILE).read_text())["token_map"], dtype=torch.long)
    check_quantize(quantize, base.device, dtype)
    heads = DraftModelHeads(model, depth, base_vocab, engine, token_map, **options)
    heads.source = str(folder)
    heads = heads.to(device=base.device, dtype=dtype)
    if quantize is not None:
        quantize_draft(heads)
    return heads


QUANTIZE_CHOICES = ("int8",)


def check_quantize(quantize: str | None, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` for a ``quantize`` that is not one of :data:`QUANTIZE_CHOICES`, or int8 on a device or
    dtype it cannot run on (PyTorch's dynamic int8 linear layers run on the CPU, from fp32 inputs)."""
    if quantize is None:
        return
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"draft quantization must be one of {list(QUANTIZE_CHOICES)}, got {quantize!r}")
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"--draft-quantize int8 runs on the CPU in float32 (dynamic int8 linear layers); the base "
                         f"is {dtype} on {device}")


def quantize_draft(heads: DraftModelHeads) -> None:
    """Quantize the draft's decoder layers' linear layers to int8 weights with dynamic activation scales
    (``torch.ao.quantization.quantize_dynamic``, per-tensor), in place; its embeddings and lm_head stay as they are
    (the lm_head is tied to the embeddings, and the drafts' q is read from it). A quantized copy of the target is
    the draft option of Leviathan et al. (2023, section 4) that needs no training: its q is close to p (high
    alpha), and on a CPU its forward reads a quarter of the weight bytes. Its engine must run the model's own
    modules (eager or static); the draft is never trained after this."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    from medusa.tools.make_draft import decoder_layers

    layers, _ = decoder_layers(heads.model)
    with warnings.catch_warnings():  # torch marks torch.ao quantization deprecated; it still runs
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        quantize_dynamic(layers, {nn.Linear}, dtype=torch.qint8, inplace=True)
    heads.quantized = "int8"
    heads.use_engine(heads.engine_name if heads.engine_name in ("eager", "static") else "eager",
                     **heads.engine_options)


@torch.inference_mode()
def draft_forward_s(heads: DraftModelHeads, sizes=(1, 2, 4, 8), repeats: int = 5, prefix_len: int = 256
                    ) -> dict[int, float]:
    """Seconds of one draft forward over n new tokens after ``prefix_len`` cached ones, its logits of one row
    included (what each level of a chain costs, :meth:`DraftModelHeads.draft_logits`), for each n in ``sizes``: the
    fastest of ``repeats`` rounds after one untimed round, as :func:`medusa.profile.time_forwards` times the base.
    This is c_q of the seed's analysis, measured on its own (never from a decode run's step times)."""
    import time

    device = heads.model.device
    generator = torch.Generator().manual_seed(0)
    context = heads.new_context()
    prompt = torch.randint(0, heads.rows, (prefix_len,), generator=generator).to(device)
    heads.catch_up(context, prompt)
    times: dict[int, float] = {}
    for round_ in range(repeats + 1):
        for n in sizes:
            ids = torch.randint(0, heads.rows, (n,), generator=generator).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            _, hidden = heads.engine.forward(ids, prefix_len + torch.arange(n, device=device),
                                             kv_cache.causal_mask(n, device), context.cache, logits_for=slice(0, 0))
            heads._logits(hidden[-1:])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_:
                times[n] = min(times.get(n, float("inf")), time.perf_counter() - start)
            heads.engine.keep_positions(context.cache, prefix_len, torch.empty(0, dtype=torch.long, device=device))
    return times
