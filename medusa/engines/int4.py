"""Weight-only codes as torch's CPU kernels take them, in plain tensor code (no transformers, no engine).

The int4 kernel's formula for a weight is ``w = (q - 8) * scale + zero`` (``q`` in 0..15, ``scale`` and ``zero`` per
group of :data:`GROUP_SIZE` input features); int8 is ``w = q * scale`` per output channel. Used by the quantized
engines (:mod:`medusa.engines.quantized`) and by GGUF packing (:mod:`medusa.io.gguf_pack`), which sits above them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

GROUP_SIZE = 32
"""Input features sharing one int4 scale and zero point (the block size of GGUF's Q4_0/Q4_1/Q4_K)."""


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """Min-max int4 codes of ``weight`` ``(N, K)``, per group of ``group_size`` input features.

    Returns:
        ``(codes (N, K) uint8 in 0..15, scale (N, K // group_size) fp32, zero (N, K // group_size) fp32)`` with
        ``(codes - 8) * scale + zero`` the rounded weight (:func:`dequantize_int4`).

    Raises:
        ValueError: ``K`` is not a multiple of ``group_size``.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} need the input size to be a multiple of it, got {k}")
    groups = weight.detach().float().reshape(n, k // group_size, group_size)  # (N, G, S)
    low, high = groups.amin(-1), groups.amax(-1)  # (N, G)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return codes, scale, low + 8 * scale


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The fp32 weights ``(N, K)`` int4 codes ``(N, K)`` stand for: ``(codes - 8) * scale + zero`` per group."""
    group_size = codes.shape[1] // scale.shape[1]
    return ((codes.float() - 8) * scale.repeat_interleave(group_size, 1) + zero.repeat_interleave(group_size, 1))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 codes of ``weight`` ``(N, K)``: ``(codes (N, K) int8, scale (N,) fp32)``
    with ``codes * scale[:, None]`` the rounded weight."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # (N,)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


@dataclass(frozen=True)
class Int4Codes:
    """Int4 codes for one weight ``(N, K)`` as :class:`Int4Linear` takes them, from a source other than the weight
    itself (a GGUF's blocks, :mod:`medusa.io.gguf_pack`)."""

    codes: torch.Tensor
    """``(N, K)`` uint8 in 0..15."""
    scale: torch.Tensor
    """``(N, K // GROUP_SIZE)`` fp32."""
    zero: torch.Tensor
    """``(N, K // GROUP_SIZE)`` fp32."""


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """The ``(out, in)`` weight of a plain ``nn.Linear`` or a transformers ``Conv1D`` (which stores it transposed),
    or ``None`` for any other module (a subclass with a forward of its own is not a plain linear)."""
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return module.weight
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.t()
    return None
