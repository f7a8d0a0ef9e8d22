"""Medusa heads: K small residual MLPs over the base model's last hidden state, each followed by a vocab projection.

Medusa (Cai et al., 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
section 2.1.1): head k reads the hidden state the base computed at position t and predicts the token at position
t + k + 2, while the base's own lm_head predicts t + 1. Each head is L ResBlocks ``x + SiLU(W x + b)`` and a vocab
projection. W and b start at zero, so an untrained head's hidden state equals the base's and, with the base's
lm_head, it starts as the base's next-token predictor.

Hydra heads (Ankner et al., 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", section 3):
head k also reads the base's frozen input embeddings of the k + 1 tokens between t and its target (t+1 .. t+k+1):
the true tokens in training, the tokens on the tree path from the root down to the node in decoding. A tree of
depth D is then drafted level by level, one batched head call per level (:mod:`medusa.drafters.heads_drafter`).

The vocab projection is either the base's frozen lm_head (shared, not saved with the heads) or a trainable per-head
copy. Either may be truncated to the ``head_vocab_size`` most frequent target tokens (a ``token_map`` from head
vocabulary index to base token id, the layout vLLM's Medusa loader reads), which keeps the head cost small next to
the base forward on small models with large vocabularies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from medusa.drafters.prefix_layer import PrefixAttention, PrefixContext
from medusa.engines import kv_cache
from medusa.io.files import read_json  # noqa: F401 - read by medusa.io.checkpoint from here too
from medusa.registry import claim

# Head k (0-based) reading the hidden state at position t predicts the token at t + k + HEAD_TOKEN_OFFSET.
HEAD_TOKEN_OFFSET = 2
# Label / head index meaning "no target" (the cross-entropy ignore index).
IGNORE_INDEX = -100
HEAD_TYPES: dict[str, type] = {}
"""The registry of head types: ``head_type`` name -> heads class (filled by :func:`register_head_type`). A class is
built as ``cls(config, lm_head_weight, embed_weight=..., token_map=...)`` and decodes through
:class:`medusa.drafters.heads_drafter.HeadsDrafter` when it has ``draft_logits``, ``new_context``, ``extend_context``
and ``to_base_ids``."""
# Version 1: Medusa heads only (no head_type field). Version 2: head_type (medusa | hydra). Version 3: the heads'
# own attention layer (prefix_layers, prefix_window). Version 4: the eagle drafter (eagle_layers, eagle_base).
FLOAT32_EPS = torch.finfo(torch.float32).eps
"""The weightless RMS norm's epsilon of the fused Hydra level (:meth:`HydraHeads.draft_ranked`), as the unfused
path's ``F.rms_norm`` takes it for fp32."""
FORMAT_VERSION = 4
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4)


def register_head_type(name: str):
    """Class decorator: register a heads class as ``head_type`` ``name`` (:data:`HEAD_TYPES`).

    Raises:
        ValueError: ``name`` is registered to another class (both named).
    """

    def register(cls: type) -> type:
        claim(HEAD_TYPES, name, cls, "head type")
        return cls

    return register


def head_target_offset(k: int) -> int:
    """How many positions ahead of the hidden state's own position head ``k`` (0-based) predicts: ``k + 2``."""
    if k < 0:
        raise ValueError(f"head index must be >= 0, got {k}")
    return k + HEAD_TOKEN_OFFSET


@dataclass
class MedusaHeadsConfig:
    """Shape and provenance of a set of Medusa heads; saved as the heads folder's ``config.json``."""

    hidden_size: int
    """Hidden size of the base model (width of its last hidden state)."""
    vocab_size: int
    """Vocabulary size of the base model's lm_head."""
    num_heads: int = 4
    """K: number of heads; head k predicts the token k + 2 positions ahead."""
    num_layers: int = 1
    """L: ResBlocks per head."""
    head_vocab_size: int | None = None
    """Truncated head vocabulary (most frequent target tokens, listed by ``token_map``); None means full vocab."""
    share_lm_head: bool = True
    """True: project with the base's frozen lm_head rows; False: each head trains its own copy."""
    base_model_name_or_path: str = ""
    """Name or folder of the base model the heads were trained on (informational)."""
    lm_head_fingerprint: dict = field(default_factory=dict)
    """Summary of the base lm_head (see :func:`lm_head_fingerprint`) checked when loading onto a base."""
    head_type: str = "medusa"
    """"medusa": each head reads the hidden state at t only; "hydra": head k also reads the input embeddings of
    tokens t+1 .. t+k+1 (sequentially dependent heads)."""
    prefix_layers: int = 0
    """1: Hydra heads read ``h_t`` plus the output of their own sliding-window attention layer over the base's hidden
    states (:mod:`medusa.drafters.prefix_layer`); 0: no such layer."""
    prefix_window: int = 64
    """Positions that layer attends over (training and decoding alike)."""
    eagle_layers: list[int] | None = None
    """head_type "eagle": the base's decoder layers (0-based; each one's output) fused into the drafter's input
    (:mod:`medusa.drafters.eagle`)."""
    eagle_base: dict | None = None
    """head_type "eagle": what its decoder layer takes from the base's config
    (:func:`medusa.drafters.eagle.eagle_base_settings`)."""
    model_type: str = "medusa_heads"
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.format_version not in SUPPORTED_FORMAT_VERSIONS:
            raise ValueError(f"unknown heads format_version {self.format_version!r}: this release reads "
                             f"{list(SUPPORTED_FORMAT_VERSIONS)} (written by a newer release?)")
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head_type {self.head_type!r}: expected one of {list(HEAD_TYPES)}")
        if self.format_version == 1 and self.head_type != "medusa":
            raise ValueError(f"format_version 1 holds only Medusa heads, got head_type {self.head_type!r}")
        if self.prefix_layers not in (0, 1):
            raise ValueError(f"prefix_layers must be 0 or 1, got {self.prefix_layers!r}")
        if self.prefix_layers and self.head_type != "hydra":
            raise ValueError(f"prefix_layers needs head_type 'hydra' (it reads the next tokens' embeddings), "
                             f"got {self.head_type!r}")
        self._check_eagle()
        for name in ("hidden_size", "vocab_size", "num_heads", "prefix_window"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ValueError(f"num_layers must be a non-negative integer, got {self.num_layers!r}")
        if self.head_vocab_size is not None and not 1 <= self.head_vocab_size <= self.vocab_size:
            raise ValueError(
                f"head_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.head_vocab_size}"
            )

    def _check_eagle(self) -> None:
        if self.head_type != "eagle":
            if self.eagle_layers is not None or self.eagle_base is not None:
                raise ValueError(f"eagle_layers and eagle_base belong to head_type 'eagle', not {self.head_type!r}")
            return
        if not isinstance(self.eagle_base, dict) or "num_hidden_layers" not in self.eagle_base:
            raise ValueError("head_type 'eagle' needs eagle_base (the base's layer settings)")
        layers, count = self.eagle_layers, self.eagle_base["num_hidden_layers"]
        if not layers or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise ValueError(f"eagle_layers must be a non-empty list of layer indices, got {layers!r}")
        bad = [i for i in layers if not 0 <= i < count]
        if bad:
            raise ValueError(f"eagle_layers {bad} are outside the base's {count} decoder layers (0 .. {count - 1})")
        self.eagle_layers = list(layers)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MedusaHeadsConfig:
        """Build from a ``config.json`` dict; unknown keys are an error (a misspelt field is never ignored)."""
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown keys in Medusa heads config: {sorted(unknown)}")
        data = dict(data)
        data.setdefault("format_version", 1)  # version 1 files were written before the field mattered
        config = cls(**data)
        config.format_version = FORMAT_VERSION  # read as version 1 or 2, held (and re-saved) as the current one
        return config


def lm_head_fingerprint(weight: torch.Tensor, rows: int = 16) -> dict:
    """A dtype-robust summary of an lm_head weight ``(V, H)``: shape and the L2 norms of ``rows`` evenly spaced rows.

    Norms survive fp32/bf16/fp16 casts to about 1e-2 relative, so the same base loaded in another dtype matches while
    a different base (or a fine-tuned lm_head) does not.
    """
    vocab, hidden = weight.shape
    index = torch.linspace(0, vocab - 1, rows).round().long()
    norms = weight.detach()[index.to(weight.device)].float().norm(dim=-1)
    return {"shape": [vocab, hidden], "rows": index.tolist(), "norms": [round(v, 6) for v in norms.tolist()]}


def fingerprint_mismatch(expected: dict, weight: torch.Tensor, rtol: float = 2e-2) -> str | None:
    """Describe how ``weight`` differs from a stored fingerprint, or ``None`` when it matches."""
    if not expected:
        return None
    if list(weight.shape) != list(expected["shape"]):
        return f"lm_head shape {list(weight.shape)} != {expected['shape']} the heads were trained on"
    index = torch.tensor(expected["rows"], device=weight.device)
    norms = weight.detach()[index].float().norm(dim=-1).cpu()
    stored = torch.tensor(expected["norms"])
    if not torch.allclose(norms, stored, rtol=rtol, atol=1e-4):
        worst = ((norms - stored).abs() / stored.abs().clamp_min(1e-6)).max().item()
        return f"lm_head weights differ from the ones the heads were trained on (row-norm relative error {worst:.3g})"
    return None


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with W and b zero-initialised, so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class _HeadsBase(nn.Module):
    """What both head types share: the config, the token map, the vocab projection and the draft interface.

    Subclasses implement ``features(k, hidden, tokens)``: head k's ``(..., H)`` features from base hidden states
    ``(..., H)`` and, for Hydra heads, the embeddings of the ``k + 1`` tokens that follow (``(..., k+1)`` ids).
    """

    def __init__(self, config: MedusaHeadsConfig, lm_head_weight: torch.Tensor, token_map: torch.Tensor | None):
        super().__init__()
        self.config = config
        if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"lm_head weight shape {tuple(lm_head_weight.shape)} does not match heads config "
                f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size})"
            )
        _check_token_map(config, token_map)
        if token_map is not None:
            self.register_buffer("token_map", token_map.to(torch.long).clone())
        else:
            self.token_map = None
        rows = lm_head_weight.detach()
        if token_map is not None:
            rows = rows[token_map.to(rows.device)]
        if config.share_lm_head:
            # Frozen and not saved: it is the base's own lm_head (or its token_map rows), re-derived on load. Kept
            # transposed, (H, Vh) contiguous: a product with one or a few rows (drafting) reads it several times
            # faster on a CPU than the (Vh, H) layout.
            self.register_buffer("shared_weight_t", rows.T.contiguous(), persistent=False)
            self.lm_heads = None
        else:
            self.shared_weight_t = None
            self.lm_heads = nn.ModuleList(
                nn.Linear(config.hidden_size, rows.shape[0], bias=False) for _ in range(config.num_heads)
            )
            for head in self.lm_heads:
                head.weight.data.copy_(rows)

    base_layers: tuple[int, ...] = ()
    """The base's intermediate decoder layers the heads read besides its last hidden state (none: heads read the
    last hidden state only; the eagle drafter reads its fused layers)."""
    drafts_rows_together: bool = True
    """:meth:`draft_logits` takes one hidden state per node ``(P, H)``, so the nodes of several sequences' trees
    share one call (the eagle drafter, whose state is a context of its own, does not)."""

    def project(self, k: int, feats: torch.Tensor) -> torch.Tensor:
        """Head ``k``'s logits ``(..., Vh)`` from its features ``(..., H)``: shared lm_head rows or its own copy.

        Drafting (no gradient) beside an engine that offers its own products for the drafter (:attr:`drafter_products`)
        projects through that product of the shared rows: a oneDNN-packed copy beside the onednn and int4/int8
        engines (0.11 ms for 4 rows of SmolLM2's 4096-row head vocabulary against 0.67 ms through ``matmul``, 2
        threads, AMD EPYC; docs/quantized.md), the rows as Q8_0 blocks in C beside the native int4 decoder. The logits
        equal ``matmul``'s up to float summation order (or the Q8_0 rounding); the verify decides what is emitted
        either way."""
        if self.lm_heads is None:
            product = self._drafter_product("projection", self.shared_weight_t.T, feats)
            if product is not None:
                out = product(feats.reshape(-1, feats.shape[-1]))  # (M, Vh)
                return out.view(*feats.shape[:-1], out.shape[-1])
            return feats @ self.shared_weight_t.to(feats.dtype)  # (..., Vh)
        return self.lm_heads[k](feats)  # (..., Vh)

    @property
    def drafts_through_products(self) -> bool:
        """Whether drafting runs any product through the engine's :attr:`drafter_products` (here: the shared
        projection; a head with its own lm_head copy runs none), so that their dtype is worth choosing
        (:meth:`medusa.model.MedusaModel.use_per_step_tree`)."""
        return self.lm_heads is None

    drafter_products = None
    """``(weight (N, K), role) -> product or None``: the products the engine offers the drafter
    (:meth:`medusa.engines.Engine.drafter_product`), set by :class:`medusa.model.MedusaModel` from its engine;
    ``None``: ``matmul`` and ``nn.Linear``. Used only while drafting: no gradient, on a CPU, in the weight's dtype."""

    drafter_products_key: str | None = None
    """What the engine's drafter products are when they change the drafting cost beyond a packed copy
    (:attr:`medusa.engines.Engine.drafter_products_key`): part of the profile's drafter key
    (:func:`medusa.profile.heads_key`)."""

    def _drafter_product(self, role: str, weight: torch.Tensor, rows: torch.Tensor):
        """The engine's product of ``weight`` ``(N, K)`` for ``role`` (made once, and again after the weight
        changed), or ``None`` where it must stay ``matmul``: gradients on, not a CPU, another dtype, nothing
        offered."""
        if (self.drafter_products is None or torch.is_grad_enabled() or rows.device.type != "cpu"
                or rows.dtype != weight.dtype or weight.device.type != "cpu"):
            return None
        key = (weight.data_ptr(), kv_cache.weight_version(weight), weight.dtype)
        made = self.__dict__.setdefault("_products", {})
        hit = made.get(role)
        if hit is None or hit[0] is not self.drafter_products or hit[1] != key:  # another engine's: made again
            hit = made[role] = (self.drafter_products, key, self.drafter_products(weight, role))
        return hit[2]

    def _linear(self, role: str, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``, through the engine's drafter product of its weight where one is offered (see
        :meth:`_drafter_product`)."""
        product = self._drafter_product(role, layer.weight, x)
        if product is None:
            return layer(x)
        out = product(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)  # (..., N)
        return out if layer.bias is None else out + layer.bias

    @property
    def shared_weight(self) -> torch.Tensor | None:
        """The shared projection ``(Vh, H)``: the base's lm_head rows of the head vocabulary (``None`` when each head
        has its own)."""
        return None if self.shared_weight_t is None else self.shared_weight_t.T

    @property
    def head_vocab_size(self) -> int:
        return self.config.head_vocab_size or self.config.vocab_size

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Head logits over the head vocabulary at every position (training and evaluation).

        Args:
            hidden_states: ``(B, T, H)`` (or ``(T, H)``) the base's last hidden states (after its final norm).
            input_ids: ``(B, T)`` (or ``(T,)``) the tokens of the same sequences; Hydra heads read the embeddings of
                tokens t+1 .. t+k+1 from it (zeros past the end, where no target exists). Ignored by Medusa heads.

        Returns:
            ``(K, B, T, Vh)`` (or ``(K, T, Vh)``) logits; index ``k`` predicts ``head_target_offset(k)`` positions
            ahead.

        Raises:
            ValueError: Hydra heads called without ``input_ids``.
        """
        follow = self._following_tokens(hidden_states, input_ids)  # (..., T, K) or None
        hidden_states = self.context_states(hidden_states, follow)  # (..., T, H)
        return torch.stack([
            self.project(k, self.features(k, hidden_states, None if follow is None else follow[..., : k + 1]))
            for k in range(self.config.num_heads)
        ])  # (K, ..., T, Vh)

    def draft_logits(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        """Head ``k``'s logits at ``P`` tree nodes of depth ``k`` (one batched call per tree level).

        Args:
            k: head index (the depth of the nodes whose children are drafted).
            hidden: ``(H,)`` the base's hidden state at the last accepted position t, or ``(P, H)`` one per node
                (nodes of several sequences' trees in one call).
            path_tokens: ``(P, k + 1)`` long: for each node, the tokens from the root (token t+1) down to the node.

        Returns:
            ``(P, Vh)`` logits over the head vocabulary.
        """
        return self.project(k, self.features(k, hidden.expand(len(path_tokens), -1), path_tokens))

    def _following_tokens(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None):
        return None

    def context_states(self, hidden_states: torch.Tensor, follow: torch.Tensor | None) -> torch.Tensor:
        """The hidden states the heads read ``(..., T, H)``, from the base's ``(..., T, H)`` and the following tokens
        ``(..., T, K)``: the base's own, unless the heads have their own attention layer."""
        return hidden_states

    def new_context(self):
        """A fresh per-sequence decoding state for :meth:`extend_context` (``None`` when the heads keep none)."""
        return None

    def extend_context(self, context, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """Feed the positions the base just accepted to the heads; returns the drafting input ``(H,)``.

        Args:
            context: from :meth:`new_context`, updated in place.
            hidden: ``(n, H)`` the base's hidden states at the accepted positions (the prompt, after the prefill).
            next_tokens: ``(n,)`` long, the token that followed each position: the last is the base's own next token.

        Returns:
            ``(H,)``: what :meth:`draft_logits` reads for the next tree (the base's last hidden state by default).
        """
        return hidden[-1]

    def to_base_ids(self, head_ids: torch.Tensor) -> torch.Tensor:
        """Map head-vocabulary indices (any shape) to base token ids."""
        return head_ids if self.token_map is None else self.token_map[head_ids]

    def to_head_ids(self, base_ids: torch.Tensor, missing: int = IGNORE_INDEX) -> torch.Tensor:
        """Map base token ids (any shape) to head-vocabulary indices; ids outside the head vocab become ``missing``."""
        if self.token_map is None:
            return base_ids
        lookup = head_lookup_table(self.token_map, self.config.vocab_size, missing).to(base_ids.device)  # (V,)
        return torch.where(base_ids >= 0, lookup[base_ids.clamp_min(0)], torch.full_like(base_ids, missing))


@register_head_type("medusa")
class MedusaHeads(_HeadsBase):
    """K Medusa heads over the base's last hidden state (Cai et al., 2024, section 2.1.1).

    Args:
        config: head shapes (``head_type`` "medusa").
        lm_head_weight: the base's lm_head weight ``(V, H)``; shared heads keep a frozen view (or, when truncated,
            a copy of the ``token_map`` rows); per-head projections are initialised from it.
        token_map: ``(head_vocab_size,)`` base token ids of the truncated head vocabulary; required exactly when
            ``config.head_vocab_size`` is set.
        embed_weight: ignored (Medusa heads do not read the token embeddings; accepted so every head type is built
            the same way).

    Raises:
        ValueError: the lm_head or token map does not match the config.
    """

    def __init__(self, config: MedusaHeadsConfig, lm_head_weight: torch.Tensor, token_map: torch.Tensor | None = None,
                 embed_weight: torch.Tensor | None = None):
        super().__init__(config, lm_head_weight, token_map)
        # One distinct module per layer and head (list multiplication would share a single ResBlock).
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )

    def features(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        return self.blocks[k](hidden)  # (..., H)

    def draft_logits(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor) -> torch.Tensor:
        if hidden.dim() > 1:  # one state per node: several sequences' trees in one call
            return self.project(k, self.blocks[k](hidden))  # (P, Vh)
        # A Medusa head does not read the path: one row serves every node of the level.
        return self.project(k, self.blocks[k](hidden[None])).expand(len(path_tokens), -1)  # (P, Vh)


@register_head_type("hydra")
class HydraHeads(_HeadsBase):
    """K sequentially dependent (Hydra) heads (Ankner et al., 2024, section 3).

    Head k reads ``[h_t ; e(x_{t+1}) ; ... ; e(x_{t+k+1})]``: the base's hidden state at t and the base's frozen
    input embeddings (RMS-normalised, so their scale matches whatever the base's embedding scale is) of the k + 1
    tokens after t, and predicts x_{t+k+2}. Its MLP is ``h_t + SiLU(W_in [...] + b)`` (W_in, b zero-initialised, so
    an untrained head is the base's next-token predictor, as a Medusa head) followed by ``num_layers - 1`` ResBlocks.

    Args:
        config: head shapes (``head_type`` "hydra", ``num_layers`` >= 1).
        lm_head_weight: the base's lm_head weight ``(V, H)`` (see :class:`MedusaHeads`).
        embed_weight: the base's input embedding weight ``(V, H)``; kept as a frozen view, never saved.
        token_map: as for :class:`MedusaHeads`.

    Raises:
        ValueError: the lm_head, embeddings or token map do not match the config, or ``num_layers`` is 0.
    """

    drafts_through_products = True
    """Each head's input layer and ResBlocks run through the engine's drafter products (and the shared
    projection, where there is one)."""

    def __init__(self, config: MedusaHeadsConfig, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor,
                 token_map: torch.Tensor | None = None):
        super().__init__(config, lm_head_weight, token_map)
        hidden = config.hidden_size
        if config.num_layers < 1:
            raise ValueError("Hydra heads need num_layers >= 1 (the input layer reads the token embeddings)")
        if embed_weight is None or tuple(embed_weight.shape) != (config.vocab_size, hidden):
            shape = None if embed_weight is None else tuple(embed_weight.shape)
            raise ValueError(f"Hydra heads need the base's input embeddings of shape ({config.vocab_size}, {hidden}), "
                             f"got {shape}")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.inputs = nn.ModuleList(nn.Linear((k + 2) * hidden, hidden) for k in range(config.num_heads))
        for layer in self.inputs:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden) for _ in range(config.num_layers - 1))) for _ in range(config.num_heads)
        )
        self.prefix = PrefixAttention(hidden, config.prefix_window) if config.prefix_layers else None

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The base's frozen input embeddings of ``tokens`` (any shape), RMS-normalised: ``(..., H)``."""
        embeds = nn.functional.embedding(tokens, self.embed_weight).to(dtype)  # (..., H)
        return nn.functional.rms_norm(embeds, (embeds.shape[-1],))

    def context_states(self, hidden_states: torch.Tensor, follow: torch.Tensor | None) -> torch.Tensor:
        if self.prefix is None:
            return hidden_states
        return self.prefix(hidden_states, self.embed(follow[..., 0], hidden_states.dtype))  # (..., T, H)

    def new_context(self) -> PrefixContext | None:
        return None if self.prefix is None else PrefixContext()

    def extend_context(self, context, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        if self.prefix is None:
            return hidden[-1]
        # the layer's linears through the engine's drafter products, as the heads' own (_linear)
        return self.prefix.extend(context, hidden, self.embed(next_tokens, hidden.dtype), self._linear)  # (H,)

    def features(self, k: int, hidden: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        if tokens is None or tokens.shape[-1] != k + 1:
            raise ValueError(f"Hydra head {k} needs the {k + 1} tokens after position t, got "
                             f"{None if tokens is None else tokens.shape[-1]}")
        embeds = self.embed(tokens, hidden.dtype)  # (..., k+1, H)
        x = torch.cat([hidden, embeds.flatten(-2)], dim=-1)  # (..., (k+2) H)
        feats = hidden + nn.functional.silu(self._linear(f"input{k}", self.inputs[k], x))  # (..., H)
        for j, block in enumerate(self.blocks[k]):
            product = self._drafter_product(f"block{k}.{j}", block.linear.weight, feats)
            if product is None:
                feats = block(feats)  # the module itself (training, hooks, subclasses)
            else:  # drafting beside an engine's products: ResBlock.forward through them, as the fused level does
                out = product(feats.reshape(-1, feats.shape[-1])).view_as(feats)
                out = out if block.linear.bias is None else out + block.linear.bias
                feats = feats + nn.functional.silu(out)
        return feats  # (..., H)

    def draft_ranked(self, k: int, hidden: torch.Tensor, path_tokens: torch.Tensor,
                     top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Head ``k``'s level in one call where the engine's drafter products can fuse it (the native decoder's Q8_0
        products: :meth:`medusa.engines.native.NativeHead.hydra_level`): ``(logits (P, Vh), ids (P, top_k),
        probs (P, top_k))``, the ``top_k`` head-vocabulary ids by logit with their softmax probabilities, best first,
        as :meth:`draft_logits` then :meth:`medusa.drafters.base.TopK.draw_ranked` give them up to float summation
        order. ``None`` where it cannot (no such products, another dtype, gradients on): the caller then takes those
        two steps. ``hidden`` ``(H,)`` or ``(P, H)``; ``path_tokens``
        ``(P, k + 1)``."""
        rows = hidden.expand(len(path_tokens), -1)  # (P, H)
        fused = self._fused_level(k, rows)
        if fused is None:
            return None
        level, bias, projection, blocks = fused
        return level(bias, projection, self.embed_weight, FLOAT32_EPS, rows, path_tokens, top_k, blocks)

    def _fused_level(self, k: int, rows: torch.Tensor):
        """``(level call, bias, projection, ResBlocks' (product, bias) pairs)`` for :meth:`draft_ranked` at head
        ``k``, or ``None`` where the level
        cannot be fused. Resolved once per head, and again when a weight changed (its storage or version), the
        engine's products or the hidden states' dtype did; gradients on or another device: ``None``
        (:meth:`_drafter_product`)."""
        if self.drafter_products is None or torch.is_grad_enabled() or rows.device.type != "cpu":
            return None
        layer = self.inputs[k]
        linears = [block.linear for block in self.blocks[k]]
        weights = (layer.weight, self.shared_weight_t, layer.bias,
                   *(w for lin in linears for w in (lin.weight, lin.bias)))
        key = (rows.dtype, *((w.data_ptr(), kv_cache.weight_version(w)) if w is not None else None for w in weights))
        cache = self.__dict__.setdefault("_fused_levels", {})
        hit = cache.get(k)
        if hit is not None and hit[0] is self.drafter_products and hit[1] == key:  # the products object itself
            return hit[2]
        fused = None
        biased = layer.bias is not None and all(lin.bias is not None for lin in linears)
        if self.lm_heads is None and biased and rows.dtype == torch.float32:  # the shared projection only
            # the engine's products of the weights, made once and again after a weight changed (_drafter_product)
            first = self._drafter_product(f"input{k}", layer.weight, rows)
            projection = getattr(self._drafter_product("projection", self.shared_weight_t.T, rows), "__self__", None)
            level = getattr(getattr(first, "__self__", None), "hydra_level", None)
            blocks = tuple((getattr(self._drafter_product(f"block{k}.{j}", lin.weight, rows), "__self__", None),
                            lin.bias.detach()) for j, lin in enumerate(linears))
            if level is not None and projection is not None and all(w is not None for w, _ in blocks):
                fused = (level, layer.bias.detach(), projection, blocks)
        cache[k] = (self.drafter_products, key, fused)
        return fused

    def _following_tokens(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None) -> torch.Tensor:
        """``(..., T, K)``: ``[t, j]`` is the token at t + 1 + j, 0 past the end (no target exists there)."""
        if input_ids is None:
            raise ValueError("Hydra heads need input_ids: head k reads the embeddings of tokens t+1 .. t+k+1")
        if input_ids.shape != hidden_states.shape[:-1]:
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)} does not match hidden states "
                             f"{tuple(hidden_states.shape[:-1])}")
        num = self.config.num_heads
        padded = nn.functional.pad(input_ids, (0, num), value=0)  # (..., T + K)
        return padded.unfold(-1, num, 1)[..., 1:, :]  # (..., T, K)


def build_heads(config: MedusaHeadsConfig, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor | None = None,
                token_map: torch.Tensor | None = None, position_weight: torch.Tensor | None = None) -> nn.Module:
    """The heads ``config.head_type`` names (:data:`HEAD_TYPES`), over the base's lm_head (and, for Hydra and the
    eagle drafter, input embeddings) ``(V, H)``; ``position_weight`` ``(P, H)`` is a learned-position base's
    position embedding (the eagle drafter on GPT-2).

    Raises:
        ValueError: Hydra heads or the eagle drafter without ``embed_weight``, or shapes that do not match.
    """
    extra = {} if position_weight is None else {"position_weight": position_weight}
    return HEAD_TYPES[config.head_type](config, lm_head_weight, embed_weight=embed_weight, token_map=token_map,
                                        **extra)


def head_lookup_table(token_map: torch.Tensor | None, vocab_size: int,
                      missing: int = IGNORE_INDEX) -> torch.Tensor | None:
    """Lookup ``(V,)`` from base token id to head-vocabulary index, ``missing`` for ids outside the head vocab.

    Args:
        token_map: ``(Vh,)`` base token ids of a truncated head vocabulary, or ``None`` for the full vocabulary.
        vocab_size: V, the base vocabulary size.

    Returns:
        ``(V,)`` long tensor on ``token_map``'s device, or ``None`` when ``token_map`` is ``None``.
    """
    if token_map is None:
        return None
    lookup = torch.full((vocab_size,), missing, dtype=torch.long, device=token_map.device)  # (V,)
    lookup[token_map] = torch.arange(len(token_map), device=token_map.device)
    return lookup


def _check_token_map(config: MedusaHeadsConfig, token_map: torch.Tensor | None) -> None:
    if config.head_vocab_size is None:
        if token_map is not None:
            raise ValueError("token_map given but head_vocab_size is None (full vocabulary)")
        return
    if token_map is None:
        raise ValueError(f"head_vocab_size={config.head_vocab_size} needs a token_map")
    if token_map.ndim != 1 or len(token_map) != config.head_vocab_size:
        raise ValueError(f"token_map must have shape ({config.head_vocab_size},), got {tuple(token_map.shape)}")
    if token_map.min() < 0 or token_map.max() >= config.vocab_size:
        raise ValueError(f"token_map ids must be in [0, {config.vocab_size})")
    if len(torch.unique(token_map)) != len(token_map):
        raise ValueError("token_map holds duplicate token ids")


def most_frequent_tokens(token_counts: torch.Tensor, size: int, always: list[int] | None = None) -> torch.Tensor:
    """Token map of the ``size`` most frequent tokens (ids sorted ascending), always including ``always`` (EOS...).

    Args:
        token_counts: ``(V,)`` counts of each base token among training targets.
        size: head vocabulary size.
        always: token ids that must be in the map whatever their count.

    Raises:
        ValueError: more distinct ``always`` ids than ``size`` (some would be silently dropped).
    """
    kept = set(always or [])
    if len(kept) > size:
        raise ValueError(f"{len(kept)} token ids must always be kept but the head vocabulary holds only {size}")
    counts = token_counts.double().clone()
    for t in always or []:
        counts[t] = float("inf")
    return torch.topk(counts, size).indices.sort().values

