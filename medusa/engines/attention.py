"""Grouped-query attention over a tree's or a batch's mask without copying the cache (CPU).

Why: transformers' SDPA attention hands grouped query heads to torch's kernel (``enable_gqa``) only when no mask is
given; with a mask and more than one query row (every tree verify and every batched step here) it first copies each
layer's keys and values ``num_key_value_groups`` times (``repeat_kv``), a copy of the whole visible cache per layer
and step. On the reference model (3 query heads per key head) a speculative step of 16 rows took 229 ms with the
copy and 174 ms without it (docs/serve.md, run 6, ``studies/batched_step_cost.py``). torch's CPU kernel reads the
shared key head itself when told ``enable_gqa``, with the mask, and gives the same bits as the copied keys
(``tests/test_onednn.py``).

How: :func:`grouped_query_attention` is registered once in transformers' ``AttentionInterface`` (its documented
extension point) as :data:`GROUPED_QUERY_ATTENTION`; :func:`use_grouped_query_attention` gives the attention modules
of an engine's shadow decoder (:mod:`medusa.engines.onednn`) their own config copy naming it. The base's modules and
config are not touched; everything else (no mask, one query row, another device, soft-capping) goes to transformers'
own SDPA function unchanged.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED_QUERY_ATTENTION = "medusa_grouped_sdpa"
"""The name :func:`grouped_query_attention` is registered under."""


def grouped_query_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, the grouped key heads read in place under a mask (see the module docstring).

    Takes and returns what transformers' attention functions do: ``query (B, Hq, N, D)``, ``key/value (B, Hkv, S,
    D)``, ``attention_mask`` additive or boolean ``(B or 1, 1 or Hq, N, S)`` or ``None``; returns ``((B, N, Hq, D),
    None)``.
    """
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (not grouped or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
            or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, is_causal=False, enable_gqa=True)  # (B, Hq, N, D)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_query_attention(shadow: nn.Module) -> int:
    """Point the attention modules of ``shadow`` (an engine's own shadow decoder: new module objects) that run
    transformers' SDPA with grouped query heads at :func:`grouped_query_attention`, each through its own copy of its
    config. Returns how many modules now use it."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if GROUPED_QUERY_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GROUPED_QUERY_ATTENTION, grouped_query_attention)
    count = 0
    for module in shadow.modules():
        config = getattr(module, "config", None)
        if (type(module).__name__.endswith("Attention") and getattr(module, "num_key_value_groups", 1) > 1
                and getattr(config, "_attn_implementation", None) == "sdpa"):
            own = copy.copy(config)
            own._attn_implementation = GROUPED_QUERY_ATTENTION
            module.config = own
            count += 1
    return count
