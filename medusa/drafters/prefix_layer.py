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


def rotary_freqs(dim: int, theta: float = ROPE_THETA, device=None) -> torch.Tensor:
    """``(dim / 2,)`` fp32 rotary frequencies ``theta ** (-i / (dim / 2))`` (Su et al. 2021)."""
    half = dim // 2
    return theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = ROPE_THETA,
           freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021; the half-split layout transformers uses) of ``x`` ``(..., T, D)``
    at integer ``positions`` ``(T,)`` (or any leading shape broadcastable to ``x``'s, ``(..., T)``), base
    ``theta`` (``freqs``: :func:`rotary_freqs` of ``D`` and ``theta``, made once by a caller that rotates often)."""
    half = x.shape[-1] // 2
    if freqs is None:
        freqs = rotary_freqs(x.shape[-1], theta, x.device)  # (D/2,)
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
    length: int = 0
    """Positions seen so far (the next position's index); the cached keys are the last ``L`` of them."""


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

    def extend(self, context: PrefixContext, hidden: torch.Tensor, next_embeds: torch.Tensor,
               linear=None) -> torch.Tensor:
        """Append ``n`` accepted positions to ``context`` and return ``h'`` at the last of them (decoding).

        The cache keeps the last ``prefix_window`` positions, consecutive, and only the last position is queried, so
        every cached key is inside its window: the attention needs no mask. Equal to :meth:`forward` at that
        position up to float summation order.

        Args:
            context: the sequence's state, updated in place.
            hidden: ``(n, H)`` the base's hidden states at the accepted positions, in order.
            next_embeds: ``(n, H)`` the normalised input embeddings of the token that followed each of them.
            linear: ``(role, layer, x) -> layer(x)``, the product to run the layer's three linears through (roles
                ``prefix.fuse``, ``prefix.qkv``, ``prefix.out``): the heads pass the engine's drafter products
                (:meth:`medusa.drafters.heads.MedusaHeads._linear`); ``None``: the layers themselves.

        Returns:
            ``(H,)`` the drafting input at the last position.
        """
        run = linear or (lambda role, layer, x: layer(x))
        n = len(hidden)
        freqs = self.__dict__.get("_freqs")
        if freqs is None or freqs.device != hidden.device:
            freqs = self.__dict__["_freqs"] = rotary_freqs(HEAD_DIM, device=hidden.device)
        positions = torch.arange(context.length, context.length + n, device=hidden.device)
        z = run("prefix.fuse", self.fuse, torch.cat([hidden, next_embeds.to(hidden.dtype)], dim=-1))  # (n, H)
        z = nn.functional.rms_norm(z, (z.shape[-1],))
        qkv = run("prefix.qkv", self.qkv, z).view(n, 3, self.num_attention_heads, HEAD_DIM)  # (n, 3, A, D)
        q = rotate(qkv[-1:, 0].transpose(0, 1), positions[-1:], freqs=freqs)  # (A, 1, D): the last position only
        k = rotate(qkv[:, 1].transpose(0, 1), positions, freqs=freqs)  # (A, n, D)
        v = qkv[:, 2].transpose(0, 1)  # (A, n, D)
        if context.keys is not None:
            k = torch.cat([context.keys, k], dim=-2)  # (A, L + n, D)
            v = torch.cat([context.values, v], dim=-2)
        k, v = k[:, -self.window:], v[:, -self.window:]  # the query's window: every key it may see
        scores = (q @ k.transpose(-1, -2)) * HEAD_DIM ** -0.5  # (A, 1, W)
        attended = torch.softmax(scores, dim=-1) @ v  # (A, 1, D)
        context.keys, context.values = k, v
        context.length += n
        out = run("prefix.out", self.out, attended.transpose(0, 1).reshape(1, -1))  # (1, H)
        return hidden[-1] + out[0]  # (H,)
