"""Medusa-1 training loss: decayed sum of per-head cross-entropies over supervised future tokens.

Medusa (Cai et al., 2024, section 2.2.1, "Medusa-1: frozen backbone"): head k reads the hidden state at position t
and is trained on the token at position t + k + 2 with a cross-entropy whose weight decays geometrically with k
(``lambda_k = decay ** k``), because far heads are less accurate and should not dominate the gradient.

Pure tensor code: no transformers, Accelerate or tokenizer here.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from medusa.heads import IGNORE_INDEX, head_lookup_table, head_target_offset

__all__ = ["IGNORE_INDEX", "head_ce_sums", "head_lookup_table", "head_target_counts", "head_targets", "medusa_loss"]

TOP_K = 5


def head_targets(labels: torch.Tensor, k: int, head_lookup: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of head ``k`` for every position whose target lies inside the sequence.

    Args:
        labels: ``(B, T)`` base token ids, ``IGNORE_INDEX`` where unsupervised.
        k: head index (0-based).
        head_lookup: see :func:`head_lookup_table`; ``None`` for the full vocabulary.

    Returns:
        ``(targets, supervised)``, both ``(B, T - k - 2)`` (empty when T is too short): head-vocabulary targets
        (``IGNORE_INDEX`` where unsupervised or outside the head vocab) and the mask of supervised base targets.
    """
    shifted = labels[:, head_target_offset(k) :]  # (B, T - k - 2)
    supervised = shifted != IGNORE_INDEX  # (B, T - k - 2)
    if head_lookup is None:
        return shifted, supervised
    mapped = head_lookup[shifted.clamp_min(0)]  # (B, T - k - 2)
    return torch.where(supervised, mapped, torch.full_like(mapped, IGNORE_INDEX)), supervised


def medusa_loss(
    head_logits: torch.Tensor,
    labels: torch.Tensor,
    head_lookup: torch.Tensor | None = None,
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decayed sum over heads of the mean cross-entropy on each head's supervised targets.

    ``loss = sum_k decay**k * CE_k`` where ``CE_k`` averages over the positions t whose target ``labels[:, t+k+2]``
    is supervised and inside the head vocabulary. A head with no such target contributes exactly 0 (never NaN) and
    still keeps its logits in the graph, so every head parameter gets a (zero) gradient under DDP.

    Args:
        head_logits: ``(K, B, T, Vh)`` logits of the K heads at every position.
        labels: ``(B, T)`` the input token ids where supervised (assistant tokens), ``IGNORE_INDEX`` elsewhere.
        head_lookup: ``(V,)`` base id -> head index or ``IGNORE_INDEX`` (see :func:`head_lookup_table`);
            ``None`` when the heads predict over the full vocabulary.
        decay: per-head loss weight base (Medusa's lambda_k = decay ** k).

    Returns:
        ``(loss, stats)``: the scalar loss and ``(K,)`` tensors that sum over batches and processes:
        ``top1``/``top5`` correct predictions, ``count`` supervised targets (targets outside the head vocabulary
        count as misses), ``ce_sum`` summed cross-entropy over in-vocab targets and ``ce_count`` their number.

    Raises:
        ValueError: the logits and labels shapes disagree.
    """
    num_heads, batch, seq, head_vocab = head_logits.shape
    if labels.shape != (batch, seq):
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits (B, T) = {(batch, seq)}")
    loss = head_logits.new_zeros(())
    counters = ("top1", "top5", "count")
    stats = {name: torch.zeros(num_heads, dtype=torch.long, device=labels.device) for name in counters}
    stats["ce_sum"] = torch.zeros(num_heads, dtype=torch.float32, device=labels.device)
    stats["ce_count"] = torch.zeros(num_heads, dtype=torch.long, device=labels.device)
    for k in range(num_heads):
        targets, supervised = head_targets(labels, k, head_lookup)  # (B, T') each
        logits = head_logits[k, :, : targets.shape[1]].float()  # (B, T', Vh)
        in_vocab = targets != IGNORE_INDEX  # (B, T')
        ce_sum = F.cross_entropy(logits.reshape(-1, head_vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                 reduction="sum")
        ce_count = in_vocab.sum()
        # sum / max(count, 1): exactly 0 with a zero gradient when nothing is supervised.
        loss = loss + decay**k * ce_sum / ce_count.clamp_min(1)
        with torch.no_grad():
            top = logits.topk(min(TOP_K, head_vocab), dim=-1).indices  # (B, T', 5)
            hits = (top == targets.unsqueeze(-1)) & in_vocab.unsqueeze(-1)  # (B, T', 5)
            stats["top1"][k] = hits[..., 0].sum()
            stats["top5"][k] = hits.any(dim=-1).sum()
            stats["count"][k] = supervised.sum()
            stats["ce_sum"][k] = ce_sum.detach()
            stats["ce_count"][k] = ce_count
    return loss, stats


def head_target_counts(labels: torch.Tensor, num_heads: int, head_lookup: torch.Tensor | None = None) -> torch.Tensor:
    """Number of targets each head is trained on in ``labels``: supervised and inside the head vocabulary.

    Needs no logits, so a trainer can count the targets of a whole optimizer step before its first forward.

    Args:
        labels: ``(B, T)`` as for :func:`medusa_loss`.
        num_heads: K.
        head_lookup: as for :func:`medusa_loss`.

    Returns:
        ``(K,)`` long tensor on ``labels``' device; entry k is the denominator of ``CE_k`` in :func:`medusa_loss`.
    """
    counts = [(head_targets(labels, k, head_lookup)[0] != IGNORE_INDEX).sum() for k in range(num_heads)]
    return torch.stack(counts)  # (K,)


def head_ce_sums(
    head_logits: torch.Tensor, labels: torch.Tensor, head_lookup: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-head cross-entropy summed (not averaged) over each head's targets, with gradient.

    Sums add up across micro-batches and processes, so a trainer can divide them by the target count of a whole
    optimizer step (see ``train.trainer.step_loss``) and the loss does not depend on how the step is split.
    A head with no target gives exactly 0 and keeps its logits in the graph.

    Args:
        head_logits: ``(K, B, T, Vh)``.
        labels: ``(B, T)``; head_lookup: as for :func:`medusa_loss`.

    Returns:
        ``(K,)`` float32 summed cross-entropies (nats); the matching counts are :func:`head_target_counts`.

    Raises:
        ValueError: the logits and labels shapes disagree.
    """
    num_heads, batch, seq, head_vocab = head_logits.shape
    if labels.shape != (batch, seq):
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits (B, T) = {(batch, seq)}")
    sums = []
    for k in range(num_heads):
        targets, _ = head_targets(labels, k, head_lookup)  # (B, T')
        logits = head_logits[k, :, : targets.shape[1]].float()  # (B, T', Vh)
        sums.append(F.cross_entropy(logits.reshape(-1, head_vocab), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                                    reduction="sum"))
    return torch.stack(sums)  # (K,)
