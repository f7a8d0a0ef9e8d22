"""A lean single-row forward of a Llama-family decoder on weight-only quantized linears: the int4/int8 engines' own
loop over the layers, in place of the stock modules' Python.

Why: with int4 weights the matrix products of a one-token forward of SmolLM2-135M take about 9 ms on one thread, and
the stock decoder's module calls, casts and copies about as much again (docs/quantized.md). This forward runs, per
layer: RMSNorm, one fused q/k/v product, rotary, the cache write, attention, the output product, RMSNorm, one fused
gate/up product, SiLU-gate and the down product: four kernel calls instead of seven, one bfloat16 cast of each
normed input instead of one per linear layer, and no module dispatch, hooks or mask building per layer.

Bit for bit the stock forward: every operation is the stock one on the same values in the same order (the RMSNorm
and rotary formulas of transformers' Llama, the base's own attention function, the kernels on the same codes: the
int4 and int8 kernels compute each output column alone, so a fused product equals its parts side by side, checked
by ``tests/test_quantized.py``). A prompt (an empty cache) attends with the base's attention under the step's mask.
A decoding step attends row by row, each row on exactly the keys it may see, in slot order, as
:func:`medusa.engines.quantized.row_invariant_attention` does, always through a view of the cache: a tree branch's
visible new keys are first staged right after the cached ones (:func:`_attend_rows`).

Supported: ``model_type`` llama (and mistral with no sliding window) without biases and with every decoder linear
quantized; :func:`lean_unsupported` names what else stops it, and the engine then runs its stock shadow
(``settings()["forward"]``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

LEAN_MODEL_TYPES = ("llama", "mistral")
"""Decoders whose layer is pre-norm RMSNorm, rotary attention and a SiLU-gated MLP, as this forward runs them."""


def lean_unsupported(model, dense: dict[str, str]) -> str | None:
    """Why :class:`LeanDecoder` cannot run ``model`` (a ``*ForCausalLM``), or ``None`` when it can.

    Args:
        dense: the decoder's linear layers left dense, by qualified name (the engine's ``dense_layers``).
    """
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model_type {config.model_type!r} (the lean forward runs {', '.join(LEAN_MODEL_TYPES)})"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biases in the attention or MLP"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "a sliding attention window"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (the lean forward runs silu)"
    if getattr(config, "rope_scaling", None) is not None and (config.rope_scaling or {}).get("rope_type") not in (
            None, "default", "llama3", "linear", "dynamic"):
        return f"rope scaling {config.rope_scaling}"
    if dense:
        return f"dense linear layers ({', '.join(sorted(dense)[:3])}...)"
    return None


def base_attention(module):
    """The attention function ``module`` (a shadow's attention module, its config naming the base's implementation as
    ``medusa_base_attention``) would run in the base."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.config.medusa_base_attention
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


class _Layer:
    """One decoder layer's pieces: its norms' weights, fused products and the stock attention module (for its
    attention function, scaling and GQA grouping)."""

    def __init__(self, layer: nn.Module, qkv: nn.Module, gate_up: nn.Module, o: nn.Module, down: nn.Module):
        attn = layer.self_attn
        self.attention = attn
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.qkv, self.gate_up, self.o, self.down = qkv, gate_up, o, down
        self.head_dim = attn.head_dim
        self.q_heads = attn.q_proj.out_features // attn.head_dim
        self.qk_heads = self.q_heads + attn.k_proj.out_features // attn.head_dim
        self.intermediate = layer.mlp.gate_proj.out_features
        self.attend = base_attention(attn)
        self.attend_row = _row_attention(attn, self.attend)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm on an fp32 ``x`` ``(N, H)``, the same operations in the same order (six small ops:
    11 us for one row against 14 us for ``torch.rms_norm``, which gives the same bits)."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def _row_attention(module, attend):
    """One query row's attention ``(1, Hq, 1, D)`` over its visible ``(1, Hkv, S, D)`` keys and values ->
    ``(1, 1, Hq, D)``: the call transformers' SDPA attention makes for it (no mask, grouped query heads through
    ``enable_gqa``, the module's scaling), made directly; any other attention function through itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scaling = module.scaling
    if attend is not sdpa_attention_forward:
        return lambda q, k, v: attend(module, q, k, v, None, is_causal=False, dropout=0.0, scaling=scaling)[0]
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    sdpa = nn.functional.scaled_dot_product_attention
    return lambda q, k, v: sdpa(q, k, v, dropout_p=0.0, scale=scaling, is_causal=False,
                                enable_gqa=gqa).transpose(1, 2)


class LeanDecoder:
    """The decoder of a Llama-family ``model`` run by :meth:`forward` on fused quantized products.

    Args:
        decoder: the engine's shadow of the model's decoder stack (the base's embeddings, norms and rotary
            embedding; attention modules whose config names the base's attention function, see
            ``_uses_row_invariant_attention`` in :mod:`medusa.engines.quantized`).
        fuse: builds one product module from a list of the decoder's linear modules by qualified name (their
            outputs side by side); the module's ``product(x)`` maps bfloat16 ``(M, K)`` to bfloat16
            ``(M, sum N)``.

    Raises:
        ValueError: :func:`lean_unsupported` names a reason.
    """

    def __init__(self, decoder: nn.Module, fuse):
        self.stack = decoder
        self.layers = []
        for i, layer in enumerate(self.stack.layers):
            prefix = f"layers.{i}"
            qkv = fuse([f"{prefix}.self_attn.{p}_proj" for p in "qkv"])
            gate_up = fuse([f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"])
            o, down = fuse([f"{prefix}.self_attn.o_proj"]), fuse([f"{prefix}.mlp.down_proj"])
            self.layers.append(_Layer(layer, qkv, gate_up, o, down))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache, mask,
                layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward of ``N`` new tokens of one row after ``cache.length`` cached ones, written into ``cache``.

        Args:
            input_ids: ``(N,)`` long.
            positions: ``(N,)`` long.
            tree_mask: ``(N, N)`` bool among the new tokens.
            cache: a :class:`medusa.engines.static_cache.SlotCache` (its ``length`` grows by N).
            mask: the engine's :class:`medusa.engines.static_cache.StaticMask` (a prompt's attention mask).
            layers: decoder layers (0-based) whose outputs are returned too (the last one after the final norm,
                as transformers' ``hidden_states``).

        Returns:
            ``(hidden (N, H) after the final norm, features (N, len(layers) * H) or None)``.

        Raises:
            medusa.engines.static_cache.CacheFullError: the step does not fit the cache.
        """
        n, length = len(input_ids), cache.length
        cache.begin_step(n)
        prompt = length == 0
        attention_mask = mask.write(cache, positions, tree_mask) if prompt else None
        if isinstance(attention_mask, dict):  # masks by layer type: every layer here attends fully
            attention_mask = attention_mask["full_attention"]
        plan = None if prompt else _visible_plan(tree_mask)
        x = self.stack.embed_tokens(input_ids[None])[0]  # (N, H) fp32
        cos, sin = self.stack.rotary_emb(x[None], position_ids=positions[None])  # (1, N, D) each
        cos, sin = cos[0][:, None], sin[0][:, None]  # (N, 1, D): over every head of a row
        kept = {}
        for index, layer in enumerate(self.layers):
            h = _rms_norm(layer.input_norm, x)
            qkv = layer.qkv.product(h.to(torch.bfloat16)).float().view(n, -1, layer.head_dim)  # (N, Hq+2Hkv, D)
            qk = qkv[:, :layer.qk_heads]  # (N, Hq+Hkv, D): rotary on queries and keys at once
            half = layer.head_dim // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin  # transformers' rotate_half
            q = qk[:, :layer.q_heads].transpose(0, 1)[None]  # (1, Hq, N, D)
            k = qk[:, layer.q_heads:].transpose(0, 1)[None]  # (1, Hkv, N, D)
            v = qkv[:, layer.qk_heads:].transpose(0, 1)[None]
            keys, values = cache.update(k, v, index)  # (1, Hkv, visible, D) views
            if prompt:
                out = layer.attend(layer.attention, q, keys, values, attention_mask, dropout=0.0,
                                   scaling=layer.attention.scaling)[0]  # (1, N, Hq, D)
            else:
                out = _attend_rows(layer.attend_row, q, k, v, keys, values, length, plan)  # (1, N, Hq, D)
            x = x + layer.o.product(out.reshape(n, -1).to(torch.bfloat16)).float()
            h = _rms_norm(layer.post_norm, x)
            gate, up = layer.gate_up.product(h.to(torch.bfloat16)).float().split(layer.intermediate, -1)
            x = x + layer.down.product((nn.functional.silu(gate) * up).to(torch.bfloat16)).float()
            if index in layers:
                kept[index] = x
        cache.length += n
        hidden = _rms_norm(self.stack.norm, x)
        last = len(self.layers) - 1
        features = None if not layers else torch.cat([hidden if i == last else kept[i] for i in layers], -1)
        return hidden, features


def _visible_plan(tree_mask: torch.Tensor) -> list:
    """Per new row, the step's rows it may see (itself included; every row sees all ``length`` cached slots): an
    ``int`` k when they are rows ``0 .. k-1`` (one run of slots from the first new one: plain decoding, a chain, a
    tree's root), else their ``(k,)`` long indices in order."""
    plan = []
    for row in tree_mask:
        new = row.nonzero()[:, 0]  # (k,) new rows this row sees
        plan.append(len(new) if len(new) == 0 or int(new[-1]) == len(new) - 1 else new)
    return plan


def _attend_rows(attend_row, q, k, v, keys, values, length: int, plan: list) -> torch.Tensor:
    """Each query row of a decoding step attends alone to exactly the keys it may see, in slot order.

    A row whose visible keys are one run of slots (``plan`` gives an int) reads a view of the cache. For any other
    row (a tree's branch) its visible new keys are staged, in order, into the slots right after the cached ones,
    ``length .. length+k-1``, so that it too reads a view: the same keys in the same order as a copy would hold,
    without copying the ``length`` cached ones (a gather of them cost 2.5 ms a row at 300 cached tokens on
    SmolLM2-135M, 2 threads). The step's own keys and values are written back to those slots afterwards.

    Args:
        attend_row: ``(q (1, Hq, 1, D), keys (1, Hkv, S, D), values) -> (1, 1, Hq, D)``.
        q: ``(1, Hq, N, D)`` the step's queries; ``k``, ``v``: ``(1, Hkv, N, D)`` its keys and values, already
            written at slots ``length .. length+N-1`` of the cache buffers ``keys``/``values`` (views of at least
            ``length + N`` slots).

    Returns:
        ``(1, N, Hq, D)``.
    """
    outs, staged = [], False
    for i, seen in enumerate(plan):
        if isinstance(seen, int):
            if staged:  # put the step's own keys back before a row that reads them in place
                keys[:, :, length:length + k.shape[2]] = k
                values[:, :, length:length + v.shape[2]] = v
                staged = False
            outs.append(attend_row(q[:, :, i:i + 1], keys[:, :, :length + seen], values[:, :, :length + seen]))
            continue
        end = length + len(seen)
        keys[:, :, length:end] = k.index_select(2, seen)
        values[:, :, length:end] = v.index_select(2, seen)
        staged = True
        outs.append(attend_row(q[:, :, i:i + 1], keys[:, :, :end], values[:, :, :end]))
    if staged:
        keys[:, :, length:length + k.shape[2]] = k
        values[:, :, length:length + v.shape[2]] = v
    return torch.cat(outs, 1)
