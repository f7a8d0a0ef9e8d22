"""A cheap lm_head whose argmax is the fp32 lm_head's: one low-precision product (bf16 weights, or int4 codes), then
exact fp32 logits for every token the product's error bound cannot rule out.

Why: on a CPU the fp32 lm_head of SmolLM2-135M (49152 x 576, 113 MB read per token) costs as much as all of its int4
linear layers together (docs/quantized.md); in bfloat16 it reads half, on the CPU's bf16 dot-product units. But a
bf16 product rounds its output to bf16 (a step of 0.125 at a logit of 20), and rounding alone would change the
greedy token on about 3% of positions of the reference model.

The bound (per row ``h``, Cauchy-Schwarz on each term): with ``ĥ`` the bf16 rounding of ``h`` and ``Ŵ`` the
weights the product really uses (bf16 roundings, or the int4 codes' values),

    |h·w_v - round(ĥ·ŵ_v)| <= |h - ĥ| max|w| + |ĥ| max|w - ŵ| + 2^-8 max|ŝ| + K 2^-23 |ĥ| max|w|  =: δ

(norms over the hidden axis, maxima over the vocabulary, fp32 accumulation inside the product). A token whose
bf16 logit ``ŝ_v`` is below ``max ŝ - 2δ`` can then be neither the fp32 argmax nor tied with it; every other token
(the candidates: a median of 6 per position on the reference model) gets its exact fp32 logit, computed alone per
row (an elementwise product summed along the hidden axis: the same bits whatever the other rows). So the argmax of
the returned logits is the fp32 argmax, ties broken alike, in plain decoding and in a tree of any shape: greedy
decoding and greedy verification through it equal those through an fp32 lm_head (up to fp32 summation order).
Logits outside the candidates keep their low-precision values: a sampling rule reads a distribution within ``δ``
of the fp32 one there (docs/quantized.md says so beside the figures). With int4 codes ``δ`` is larger and more
tokens are rescored (a gather of their fp32 rows), against a product that reads a quarter of bf16's bytes.
"""

from __future__ import annotations

import torch
from torch.nn import functional

BF16_STEP = 2.0 ** -8
"""A bound on bf16 rounding's relative error (half a unit in the last place is 2^-9)."""
SAFETY = 1.25
"""The bound is taken this much wider (it is 6x to 20x above the largest error seen on the reference model)."""


def bf16_product(weight: torch.Tensor):
    """``rows (M, H) bf16 -> (M, V) bf16`` with the ``(V, H)`` bf16 ``weight``: oneDNN's product on a copy reordered
    once into its blocked layout where this CPU has it (1.5 ms against 3.6 ms for ``F.linear`` on SmolLM2's
    49152 x 576 lm_head, one row, 2 threads of an AVX-512 EPYC: docs/quantized.md), else ``F.linear``. Both accumulate
    in fp32 and round the output to bf16, which is what the bound assumes."""
    from medusa.engines.onednn import packed_product

    return packed_product(weight) or (lambda rows: functional.linear(rows, weight))


class CheckedHead:
    """The ``(V, H)`` fp32 lm_head ``weight`` behind a cheaper ``product`` and the bound's constants (see the module
    docstring). A snapshot: make a new one after changing the weight.

    Args:
        weight: the base's ``(V, H)`` fp32 lm_head weight (its rows are gathered for the candidates).
        product: bfloat16 ``(M, H)`` -> ``(M, V)`` logits (bf16), the cheap product; ``None``: a bf16 copy of
            ``weight``.
        effective: the ``(V, H)`` weights ``product`` computes with, for the bound (``None`` with the bf16 copy).
    """

    def __init__(self, weight: torch.Tensor, product=None, effective: torch.Tensor | None = None):
        weight = weight.detach()
        self.weight = weight  # (V, H) fp32
        if product is None:
            self.bf16 = weight.to(torch.bfloat16)  # (V, H)
            product, effective = bf16_product(self.bf16), self.bf16.float()
        self.product = product
        self.max_norm = float(weight.norm(dim=1).max())
        self.max_error_norm = float((weight - effective).norm(dim=1).max())
        self.candidates: list[int] = []
        """How many tokens got exact logits, per row of the last call (for the bench)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(M, H)`` fp32 hidden states -> ``(M, V)`` fp32 logits whose argmax per row is the fp32 lm_head's.

        Raises:
            ValueError: ``hidden`` is not 2-D fp32 of the head's width.
        """
        if hidden.dim() != 2 or hidden.dtype != torch.float32 or hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(f"the checked lm_head takes (M, {self.weight.shape[1]}) float32 hidden states, got "
                             f"{tuple(hidden.shape)} {hidden.dtype}")
        rounded = hidden.to(torch.bfloat16)
        logits = self.product(rounded).float()  # (M, V)
        rounded_norm = rounded.float().norm(dim=-1)  # (M,)
        top = logits.amax(-1)  # (M,)
        delta = SAFETY * ((hidden - rounded.float()).norm(dim=-1) * self.max_norm + rounded_norm * self.max_error_norm
                          + top.abs().clamp_min(logits.amin(-1).abs()) * BF16_STEP
                          + hidden.shape[1] * 2.0 ** -23 * rounded_norm * self.max_norm)  # (M,)
        self.candidates = []
        for m in range(hidden.shape[0]):
            candidates = (logits[m] >= top[m] - 2 * delta[m]).nonzero()[:, 0]  # (C,)
            logits[m, candidates] = (hidden[m] * self.weight.index_select(0, candidates)).sum(-1)
            self.candidates.append(len(candidates))
        return logits
