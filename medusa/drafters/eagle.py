"""An EAGLE-3-style feature drafter: one decoder layer run autoregressively over the base's fused hidden states and
the next tokens' embeddings, drafting each deeper token from its own predicted feature (pure tensor code).

EAGLE (Li et al. 2024, "EAGLE: speculative sampling requires rethinking feature uncertainty", section 3) runs one
decoder layer over (feature, next token) pairs and feeds each output feature back in to draft one token deeper.
EAGLE-3 (Li et al. 2025, section 3) fuses the base's hidden states from a low, a middle and a high layer through one
linear layer, and trains with *training-time test*: the drafter is unrolled on its own outputs for several steps,
the base's distribution the target at every step (:meth:`EagleDrafterHeads.forward`).

The layer (:class:`EagleLayer`, as in EAGLE-3 and the ``speculators`` ``eagle3`` format): its attention reads
``[norm(embedding of x_{t+1}) ; norm(h_t)]`` (2 x hidden); the residual is ``h_t``; the MLP reads the attention's
output (hidden), as in the base's own layers. Its norms, grouped-query attention, activation and rotary embeddings
are the base's (from the base's config, :func:`eagle_base_settings`); bases with learned absolute positions (GPT-2)
have their position embedding added to the token embedding instead. The layer always attends over all of its own
context, even on sliding-window bases: its context is short next to a window, and full attention is what the format
other engines load holds.

Positions and what predicts what: position t pairs the feature of position t with the token t+1. For the base's
positions the feature is ``fc`` of the fused layers (:attr:`MedusaHeadsConfig.eagle_layers`); the layer's output
``g_t`` predicts token t+2 through the final norm and the lm_head (the base's frozen rows, or a truncated draft
vocabulary with a ``token_map``, as for the heads). A drafted node at depth d >= 1 sits at position t+d: its feature
is its parent's output, its token its own. So output k anchored at t predicts token t+k+2, as Medusa head k does
(:func:`medusa.drafters.heads.head_target_offset`): the same trainer, losses, calibration and tree machinery serve
it, and the drafter decodes through :class:`medusa.drafters.heads_drafter.HeadsDrafter` (fixed trees, the
prompt-lookup branch, batched rows) and :class:`medusa.drafters.per_step.PerStepDrafter` (the per-step tree).

Decoding state (:class:`EagleContext`): the layer's keys and values of every accepted position (positions whose
feature is the base's own) and, during a step, those of the drafted nodes, keyed by their token path. Each tree level
is one forward over all its parents, with a tree mask inside the layer's attention. After the verification the
drafted entries are dropped and the accepted positions are fed with the base's true features
(:meth:`EagleDrafterHeads.extend_context`): the cache is always the one rebuilt from the accepted tokens.

Base states: what this drafter reads from the base at each position is ``[last hidden ; layer a ; layer b ; ...]``
(:func:`medusa.base.base_states`), ``(1 + len(eagle_layers)) * hidden`` wide; the last hidden state is the
teacher's input (its logits), the layers are the drafter's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from medusa.drafters.heads import MedusaHeadsConfig, _HeadsBase, register_head_type
from medusa.drafters.prefix_layer import rotate

NORMS = ("rms", "rms_unit_offset", "layer")
"""Norm kinds: RMSNorm ``w * x / rms(x)``; Gemma's ``(1 + w) * x / rms(x)``; LayerNorm (GPT-2)."""


def default_eagle_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers of a base with ``num_layers`` decoder layers (0-based; the output of
    each): layer 1, layer ``L // 2 - 1`` and layer ``L - 4``, clamped into the base (SmolLM2-135M: 1, 14, 26)."""
    last = num_layers - 1
    return [min(1, last), min(max(num_layers // 2 - 1, 0), last), min(max(num_layers - 4, 0), last)]


def eagle_base_settings(text_config) -> dict:
    """What the drafter's layer takes from the base's (text) config: attention shape, MLP, norm, positions.

    Raises:
        ValueError: a rotary embedding kind other than the default one (a drafter for such a base would need that
            scaling reimplemented; it is refused rather than approximated).
    """
    c = text_config
    hidden = c.hidden_size
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    learned = getattr(c, "n_positions", None) is not None and not hasattr(c, "rope_parameters")
    settings = {
        "model_type": c.model_type,
        "num_hidden_layers": getattr(c, "num_hidden_layers", None) or c.n_layer,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or hidden // heads,
        "intermediate_size": getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden,
        "gated_mlp": hasattr(c, "intermediate_size"),
        "hidden_act": (getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
                       or getattr(c, "activation_function", None) or "silu"),
        "norm": "layer" if learned else ("rms_unit_offset" if c.model_type.startswith("gemma") else "rms"),
        "norm_eps": float(getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_epsilon", None) or 1e-6),
        "positions": "learned" if learned else "rotary",
        "rope_theta": None,
        "max_position_embeddings": getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None),
    }
    if not learned:
        rope = getattr(c, "rope_parameters", None) or {}
        if "full_attention" in rope:  # per-layer-type parameters (Gemma 3): the drafter attends fully
            rope = rope["full_attention"]
        kind = rope.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"the eagle drafter supports the default rotary embedding only; this base uses "
                             f"rope_type {kind!r}")
        settings["rope_theta"] = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    return settings


class Norm(nn.Module):
    """The base's kind of norm over the last dimension (:data:`NORMS`)."""

    def __init__(self, size: int, kind: str, eps: float):
        super().__init__()
        if kind not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.zeros(size) if kind == "rms_unit_offset" else torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if kind == "layer" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        scale = self.weight.float() + 1 if self.kind == "rms_unit_offset" else self.weight.float()
        return (normed * scale).to(x.dtype)


def attend(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], visible: list[torch.Tensor],
           diagonal: tuple[list[torch.Tensor], list[torch.Tensor]] = ((), ())) -> torch.Tensor:
    """Softmax attention of queries over several groups of keys at once (one softmax over all of them), in float32.

    Args:
        q: ``(B, nh, T, D)`` queries.
        keys, values: per group ``(B, nkv, S_g, D)``, seen by every query as its ``visible`` mask says.
        visible: per group a bool mask broadcastable to ``(B, nh, T, S_g)``.
        diagonal: ``(keys, values)`` groups of ``(B, nkv, T, D)`` with one key per query (query t sees key t only):
            the training-time-test chain (:meth:`EagleDrafterHeads.forward`).

    Returns:
        ``(B, nh, T, D)``; a query that sees no key gets zeros.
    """
    groups = q.shape[1] // keys[0].shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf = q.float()
    shared = [(k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float())
              for k, v in zip(keys, values, strict=True)]
    diag = [(k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float())
            for k, v in zip(*diagonal, strict=True)]
    scores = [(qf @ k.transpose(-1, -2) * scale).masked_fill(~m, float("-inf")) for (k, _), m in
              zip(shared, visible, strict=True)]  # (B, nh, T, S_g) each
    scores += [(qf * k).sum(-1, keepdim=True) * scale for k, _ in diag]  # (B, nh, T, 1) each
    weights = torch.nan_to_num(torch.softmax(torch.cat(scores, dim=-1), dim=-1))  # (B, nh, T, S)
    parts = torch.split(weights, [s.shape[-1] for s in scores], dim=-1)
    out = sum(w @ v for w, (_, v) in zip(parts, shared, strict=False))
    out = out + sum((w * v for w, (_, v) in zip(parts[len(shared):], diag, strict=True)), torch.zeros_like(qf))
    return out.to(q.dtype)


class EagleLayer(nn.Module):
    """One decoder layer over ``[norm(e) ; norm(h)]`` (2 x hidden): attention with the base's head layout, then the
    base's kind of MLP (EAGLE-3, section 3.2)."""

    def __init__(self, hidden: int, s: dict):
        super().__init__()
        nh, nkv, hd = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, s["rope_theta"]
        self.input_layernorm = Norm(hidden, s["norm"], s["norm_eps"])
        self.hidden_norm = Norm(hidden, s["norm"], s["norm_eps"])
        self.q_proj = nn.Linear(2 * hidden, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * hidden, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * hidden, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, hidden, bias=False)
        self.post_attention_layernorm = Norm(hidden, s["norm"], s["norm_eps"])
        from transformers.activations import ACT2FN

        self.act = ACT2FN[s["hidden_act"]]
        inner = s["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=False) if s["gated_mlp"] else None
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def qkv(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor):
        """Queries ``(B, nh, T, hd)`` and keys/values ``(B, nkv, T, hd)`` of ``(B, T, H)`` features and embeddings
        at ``positions`` ``(B, T)`` or ``(T,)``."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        b, t = x.shape[:2]
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        if self.theta is not None:
            pos = positions[:, None, :] if positions.ndim == 2 else positions
            q, k = rotate(q, pos, self.theta), rotate(k, pos, self.theta)
        return q, k, v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output ``(B, T, H)`` from its input feature ``(B, T, H)`` (the residual) and attention output
        ``(B, nh, T, hd)``."""
        b, _, t, _ = attended.shape
        h = hidden + self.o_proj(attended.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        x = self.post_attention_layernorm(h)
        inner = self.act(self.gate_proj(x)) * self.up_proj(x) if self.gate_proj is not None else self.act(
            self.up_proj(x))
        return h + self.down_proj(inner)


@dataclass
class EagleContext:
    """One sequence's drafting state: the layer's keys/values of every accepted position and of this step's
    drafted nodes."""

    keys: torch.Tensor | None = None
    """``(1, nkv, L, hd)`` keys of the L accepted positions."""
    values: torch.Tensor | None = None
    last: torch.Tensor | None = None
    """``(H,)`` the layer's output at the last accepted position: what depth 1 is drafted from."""
    tree: dict = field(default_factory=dict)
    """This step's drafted nodes: token path from the root ``tuple`` -> ``(output (H,), key, value (nkv, hd))``."""

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]


@register_head_type("eagle")
class EagleDrafterHeads(_HeadsBase):
    """The EAGLE-3-style drafter, through the heads' interface (see module docstring): ``forward`` for training,
    evaluation and calibration, ``new_context`` / ``extend_context`` / ``draft_logits`` for decoding.

    ``config.num_heads`` is the drafting depth (outputs 0 .. K-1; output k predicts token t+k+2).

    Args:
        config: ``head_type`` "eagle", with ``eagle_layers`` and ``eagle_base`` (:func:`eagle_base_settings`).
        lm_head_weight: the base's lm_head ``(V, H)`` (shared, frozen rows as for the heads).
        embed_weight: the base's input embedding ``(V, H)`` (frozen, not saved).
        token_map: the draft vocabulary, as for the heads.
        position_weight: the base's learned position embedding ``(P, H)`` (bases with ``positions: learned``).

    Raises:
        ValueError: missing or mis-shaped embeddings, a missing position embedding, or bad layer settings.
    """

    drafts_rows_together = False  # its draft state is a context of its own per sequence
    drafts_from_drafted_parents = True
    """A node of depth >= 2 can be drafted from only when its parent was (its features are the parent's draft
    output, kept in :attr:`EagleContext.tree`): the per-step tree picks such nodes only."""

    def __init__(self, config: MedusaHeadsConfig, lm_head_weight: torch.Tensor, embed_weight: torch.Tensor,
                 token_map: torch.Tensor | None = None, position_weight: torch.Tensor | None = None):
        super().__init__(config, lm_head_weight, token_map)
        hidden, s = config.hidden_size, config.eagle_base
        if embed_weight is None or tuple(embed_weight.shape) != (config.vocab_size, hidden):
            shape = None if embed_weight is None else tuple(embed_weight.shape)
            raise ValueError(f"the eagle drafter needs the base's input embeddings of shape ({config.vocab_size}, "
                             f"{hidden}), got {shape}")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        if s["positions"] == "learned":
            if position_weight is None or position_weight.shape[-1] != hidden:
                shape = None if position_weight is None else tuple(position_weight.shape)
                raise ValueError(f"the eagle drafter of a base with learned positions needs its position embedding "
                                 f"(P, {hidden}), got {shape}")
            self.register_buffer("position_weight", position_weight.detach(), persistent=False)
        else:
            self.position_weight = None
        self.embed_scale = math.sqrt(hidden) if s["model_type"].startswith("gemma") else 1.0
        self.fc = nn.Linear(len(config.eagle_layers) * hidden, hidden, bias=False)
        self.layer = EagleLayer(hidden, s)
        self.norm = Norm(hidden, s["norm"], s["norm_eps"])
        self._init_as_next_token_guess()

    def _init_as_next_token_guess(self) -> None:
        """Start as the base's own next-token guess, as an untrained Medusa or Hydra head does: ``fc`` passes the
        highest fused layer through and the layer adds nothing (its attention and MLP outputs start at zero), so
        output 0 at t is the lm_head of that late layer's state, the base's guess for token t+1 made one position
        early. Training then moves every weight (the zero outputs get gradients from the first step)."""
        hidden, late = self.config.hidden_size, self.config.eagle_layers.index(max(self.config.eagle_layers))
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, late * hidden : (late + 1) * hidden] = torch.eye(hidden)
            self.layer.o_proj.weight.zero_()
            self.layer.down_proj.weight.zero_()

    # -- shared pieces --------------------------------------------------------------------------------------------
    @property
    def base_layers(self) -> tuple[int, ...]:
        """The base's decoder layers this drafter reads (0-based), after the last hidden state."""
        return tuple(self.config.eagle_layers)

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The base's frozen embeddings of ``tokens`` at ``positions`` (same shape) -> ``(..., H)``."""
        e = nn.functional.embedding(tokens, self.embed_weight).to(dtype) * self.embed_scale
        if self.position_weight is not None:
            e = e + nn.functional.embedding(positions.clamp_max(len(self.position_weight) - 1),
                                            self.position_weight).to(dtype)
        return e

    def fuse(self, states: torch.Tensor) -> torch.Tensor:
        """The drafter's input feature ``(..., H)`` from base states ``(..., (1 + k) H)`` (last hidden first)."""
        return self.fc(states[..., self.config.hidden_size :])

    def logits_of(self, outputs: torch.Tensor) -> torch.Tensor:
        """Draft logits ``(..., Vh)`` of layer outputs ``(..., H)``."""
        return self.project(0, self.norm(outputs))

    drafts_through_products = False
    """Its projection and layer run as they are (never through the engine's drafter products)."""

    def project(self, k: int, feats: torch.Tensor) -> torch.Tensor:
        if self.lm_heads is None:
            return feats @ self.shared_weight_t.to(feats.dtype)
        return self.lm_heads[0](feats)  # one projection: every depth is the same layer's output

    # -- training: training-time test ---------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None,
                steps: int | None = None) -> torch.Tensor:
        """Draft logits of ``steps`` unrolled steps at every position, anchored as the heads' (training-time test,
        EAGLE-3 section 3.3).

        Step 0 reads the base's fused feature at t and token t+1. Step j reads, at position p, the drafter's own
        step-(j-1) output at p-1 and the true token p+1, and attends to the step-0 keys up to position p-j and to
        the keys of steps 1..j along its own chain: what a depth-(j+1) node sees at decoding time.

        Args:
            hidden_states: ``(B, T, (1 + k) H)`` (or ``(T, ...)``) base states (module docstring).
            input_ids: ``(B, T)`` (or ``(T,)``) the tokens.
            steps: unrolled steps (default ``config.num_heads``).

        Returns:
            ``(steps, B, T, Vh)`` (or ``(steps, T, Vh)``) logits; index j at position t predicts token t+j+2
            (rows whose chain would start before position 0 or run past the end are garbage and carry no target).

        Raises:
            ValueError: no ``input_ids``, shapes that do not match, or ``steps`` < 1.
        """
        if input_ids is None:
            raise ValueError("the eagle drafter needs input_ids: it reads the embedding of token t+1")
        unbatched = hidden_states.ndim == 2
        if unbatched:
            hidden_states, input_ids = hidden_states[None], input_ids[None]
        if input_ids.shape != hidden_states.shape[:-1]:
            raise ValueError(f"input_ids shape {tuple(input_ids.shape)} does not match hidden states "
                             f"{tuple(hidden_states.shape[:-1])}")
        steps = self.config.num_heads if steps is None else steps
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device)  # (T,)
        nxt = nn.functional.pad(input_ids[:, 1:], (0, 1), value=0)  # (B, T): token t+1
        embeds = self.embed(nxt, positions[None].expand(b, t), hidden_states.dtype)  # (B, T, H)
        feature = self.fuse(hidden_states)  # (B, T, H)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()  # (T, T)
        keys, values, outs = [], [], []
        for j in range(steps):
            q, k, v = self.layer.qkv(feature, embeds, positions)
            if j == 0:
                keys, values = [k], [v]
                out = self.layer.finish(feature, attend(q, [k], [v], [causal]))
            else:
                # Step i's key at p - j + i for i = 1..j: this query's own chain.
                chain_k = [_shift(kk, j - i) for i, kk in enumerate(keys[1:], start=1)] + [k]
                chain_v = [_shift(vv, j - i) for i, vv in enumerate(values[1:], start=1)] + [v]
                keys.append(k), values.append(v)
                out = self.layer.finish(feature, attend(q, [keys[0]], [values[0]], [causal.tril(-j)],
                                                        (chain_k, chain_v)))
            outs.append(_shift(out, -j))  # anchored at t = p - j
            feature = _shift(out, 1)  # position p reads the output at p - 1
        logits = torch.stack([self.logits_of(o) for o in outs])  # (steps, B, T, Vh)
        return logits[:, 0] if unbatched else logits

    # -- decoding -------------------------------------------------------------------------------------------------
    def new_context(self) -> EagleContext:
        return EagleContext()

    def extend_context(self, context: EagleContext, hidden: torch.Tensor, next_tokens: torch.Tensor
                       ) -> EagleContext:
        """Feed the accepted positions (base states ``(n, (1 + k) H)`` and the token after each ``(n,)``): their
        keys and values join the cache, this step's drafted entries are dropped. Returns the context, what
        :meth:`draft_logits` reads."""
        n = len(next_tokens)
        positions = torch.arange(context.length, context.length + n, device=next_tokens.device)  # (n,)
        feature = self.fuse(hidden)[None]  # (1, n, H)
        embeds = self.embed(next_tokens[None], positions[None], feature.dtype)  # (1, n, H)
        q, k, v = self.layer.qkv(feature, embeds, positions)
        past_k = k if context.keys is None else torch.cat([context.keys, k], dim=2)
        past_v = v if context.values is None else torch.cat([context.values, v], dim=2)
        visible = torch.ones(n, past_k.shape[2], dtype=torch.bool, device=k.device).tril(past_k.shape[2] - n)
        out = self.layer.finish(feature, attend(q, [past_k], [past_v], [visible]))  # (1, n, H)
        context.keys, context.values, context.last = past_k, past_v, out[0, -1]
        context.tree = {}
        return context

    def draft_logits(self, k: int, hidden: EagleContext, path_tokens: torch.Tensor) -> torch.Tensor:
        """Draft logits at ``P`` tree nodes of depth ``k`` (one layer forward over them, tree-masked).

        Args:
            k: the depth of the nodes (0: the root).
            hidden: the sequence's :class:`EagleContext` (from :meth:`extend_context`).
            path_tokens: ``(P, k + 1)`` long, each node's tokens from the root down.

        Returns:
            ``(P, Vh)`` logits of the nodes' children.

        Raises:
            KeyError: a node whose parent was not drafted from this step (levels must come in order).
        """
        context = hidden
        if k == 0:
            return self.logits_of(context.last)[None].expand(len(path_tokens), -1)  # (P, Vh)
        paths = [tuple(p) for p in path_tokens.tolist()]
        parents = [context.last if len(p) == 2 else context.tree[p[:-1]][0] for p in paths]
        feature = torch.stack(parents)[None]  # (1, P, H)
        position = context.length + k - 1
        positions = torch.full((len(paths),), position, dtype=torch.long, device=path_tokens.device)
        embeds = self.embed(path_tokens[None, :, -1], positions[None], feature.dtype)  # (1, P, H)
        q, kk, vv = self.layer.qkv(feature, embeds, positions)
        drafted = list(context.tree)
        keys, values, visible = [context.keys], [context.values], [
            torch.ones(len(paths), context.length, dtype=torch.bool, device=kk.device)]
        if drafted:
            keys.append(torch.stack([context.tree[d][1] for d in drafted], dim=1)[None])  # (1, nkv, M, hd)
            values.append(torch.stack([context.tree[d][2] for d in drafted], dim=1)[None])
            visible.append(torch.tensor([[len(d) <= len(p) and p[: len(d)] == d for d in drafted] for p in paths],
                                        dtype=torch.bool, device=kk.device))  # (P, M): the node's ancestors
        keys.append(kk), values.append(vv)
        visible.append(torch.eye(len(paths), dtype=torch.bool, device=kk.device))
        out = self.layer.finish(feature, attend(q, keys, values, visible))[0]  # (P, H)
        for i, p in enumerate(paths):
            context.tree[p] = (out[i], kk[0, :, i], vv[0, :, i])
        return self.logits_of(out)  # (P, Vh)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` ``(B, ..., T, D)``-like shifted along its time axis (dim -2) by ``n``: ``out[t] = x[t - n]``, zeros
    where ``t - n`` is outside."""
    if n == 0:
        return x
    t = x.shape[-2]
    out = torch.zeros_like(x)
    if abs(n) >= t:
        return out
    if n > 0:
        out[..., n:, :] = x[..., : t - n, :]
    else:
        out[..., : t + n, :] = x[..., -n:, :]
    return out
