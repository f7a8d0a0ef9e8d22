"""The heads' own attention layer over the base's hidden states (Hydra++'s extra decoder layer, Ankner et al. 2024,
section 4; the input fusion follows EAGLE, Li et al. 2024, section 3.1).

An MLP head sees one hidden state: it cannot look back at the context, so it cannot copy a phrase the text already
holds. This layer gives the heads that look. At every position j it fuses the base's last hidden state h_j with the
(RMS-normalised, frozen) input embedding of the token that follows, x_{j+1}, into ``z_j = W_f [h_j ; e(x_{j+1})]``,
and position t attends causally over ``z`` within a sliding window of ``prefix_window`` positions (rotary position
embeddings, so only relative positions matter: a training window and a long decoding context look alike). Its output
is added to the hidden state the heads read::

    h'_t = h_t + W_o Attention(RMSNorm(z))_t

``W_o`` starts at zero, so an untrained layer leaves the heads exactly as they were.

In decoding the layer keeps its own small key/value cache (:class:`PrefixContext`): after the prefill and after every
verify step, the positions the base accepted (their hidden states and the tokens that followed them, the last of which
is the base's own next token) are appended, and h'_t at the last accepted position becomes the drafting input. The
cache holds at most ``prefix_window`` positions, so its cost per step does not grow with the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ROPE_THETA = 10000.0
HEAD_DIM = 64


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021; the half-split layout transformers uses) of ``x`` ``(..., T, D)``
    at integer ``positions`` ``(T,)`` (or any leading shape broadcastable to ``x``'s, ``(..., T)``), base
    ``theta``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # (D/2,)
    angles = positions.to(torch.float32)[..., None] * freqs  # (..., T, D/2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``(Tq, Tk)`` bool, True where a query at ``query_pos`` may see a key at ``key_pos``: causal, and fewer than
    ``window`` positions back."""
    delta = query_pos[:, None] - key_pos[None, :]
    return (delta >= 0) & (delta < window)


@dataclass
class PrefixContext:
    """One sequence's decoding state of a :class:`PrefixAttention`: rotated keys and values of the last
    ``prefix_window`` positions."""

    keys: torch.Tensor | None = None
    """``(A, L, D)`` rotated keys, ``A`` attention heads, ``L <= prefix_window`` positions."""
    values: torch.Tensor | None = None
    """``(A, L, D)`` values."""
    positions: torch.Tensor | None = None
    """``(L,)`` long positions of the cached keys."""
    length: int = 0
    """Positions seen so far (the next position's index)."""


class PrefixAttention(nn.Module):
    """One causal, sliding-window self-attention layer over fused (hidden state, next-token embedding) pairs.

    Args:
        hidden_size: H, the base's hidden size.
        window: attention window in positions (training and decoding alike).

    Raises:
        ValueError: ``window`` < 1.
    """

    def __init__(self, hidden_size: int, window: int):
        super().__init__()
        if window < 1:
            raise ValueError(f"prefix_window must be >= 1, got {window}")
        self.window = window
        self.num_attention_heads = max(1, hidden_size // HEAD_DIM)
        inner = self.num_attention_heads * HEAD_DIM
        self.fuse = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.qkv = nn.Linear(hidden_size, 3 * inner, bias=False)
        self.out = nn.Linear(inner, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)

    def _qkv(self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor):
        """Rotated queries, keys and values ``(..., A, T, D)`` of positions ``(T,)`` from ``hidden`` ``(..., T, H)``
        and the (normalised) embeddings of the tokens that follow them ``(..., T, H)``."""
        z = self.fuse(torch.cat([hidden, next_embeds.to(hidden.dtype)], dim=-1))  # (..., T, H)
        z = nn.functional.rms_norm(z, (z.shape[-1],))
        q, k, v = self.qkv(z).unflatten(-1, (3, self.num_attention_heads, HEAD_DIM)).unbind(-3)  # (..., T, A, D)
        q, k, v = (x.transpose(-3, -2) for x in (q, k, v))  # (..., A, T, D)
        return rotate(q, positions), rotate(k, positions), v

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """The heads' input ``h'`` at every position of whole sequences (training and evaluation).

        Args:
            hidden: ``(..., T, H)`` the base's last hidden states.
            next_embeds: ``(..., T, H)``: at position j the normalised input embedding of token j + 1 (anything where
                none exists: a position sees only its own and earlier pairs, so a placeholder at the end changes
                nothing before it).

        Returns:
            ``(..., T, H)``: ``hidden`` plus this layer's output.
        """
        positions = torch.arange(hidden.shape[-2], device=hidden.device)
        q, k, v = self._qkv(hidden, next_embeds, positions)
        mask = window_mask(positions, positions, self.window)  # (T, T)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (..., A, T, D)
        return hidden + self.out(attended.transpose(-3, -2).flatten(-2))  # (..., T, H)

    def extend(self, context: PrefixContext, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """Append ``n`` accepted positions to ``context`` and return ``h'`` at the last of them (decoding).

        Args:
            context: the sequence's state, updated in place.
            hidden: ``(n, H)`` the base's hidden states at the accepted positions, in order.
            next_embeds: ``(n, H)`` the normalised input embeddings of the token that followed each of them.

        Returns:
            ``(H,)`` the drafting input at the last position.
        """
        n = len(hidden)
        positions = torch.arange(context.length, context.length + n, device=hidden.device)
        q, k_all, v_all = self._qkv(hidden, next_embeds, positions)  # (A, n, D) each
        q = q[:, -1:]  # only the last position is queried
        if context.keys is not None:
            k_all = torch.cat([context.keys, k_all], dim=-2)  # (A, L + n, D)
            v_all = torch.cat([context.values, v_all], dim=-2)
            positions = torch.cat([context.positions, positions])
        mask = window_mask(positions[-1:], positions, self.window)  # (1, L + n)
        attended = nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)  # (A, 1, D)
        keep = slice(-self.window, None)
        context.keys, context.values, context.positions = k_all[:, keep], v_all[:, keep], positions[keep]
        context.length += n
        return hidden[-1] + self.out(attended.transpose(0, 1).flatten(-2))[0]  # (H,)
