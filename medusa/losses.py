"""Head training losses: decayed sum over heads of a per-head term on supervised future tokens.

Medusa (Cai et al., 2024, section 2.2.1, "Medusa-1: frozen backbone"): head k reads the hidden state at position t
and is trained on the token at position t + k + 2 with a cross-entropy whose weight decays geometrically with k
(``lambda_k = decay ** k``), because far heads are less accurate and should not dominate the gradient.

The per-head term is one of (``loss``):
- ``"hard"``: cross-entropy against the token in the data;
- ``"teacher"``: soft cross-entropy against the base's own distribution for that token, the base's lm_head applied
  to its hidden state at t + k + 1, which the same forward already computes (Hydra++ teacher distillation, Ankner
  et al. 2024, section 4; Medusa report section 2.3.2). On greedy self-distilled text the teacher's argmax is the
  label; the soft target also ranks the runners-up, which the tree's other branches use. Restricted to a truncated
  head vocabulary, the teacher is renormalised over it;
- ``"mixed"``: ``mix * hard + (1 - mix) * teacher``.

Pure tensor code: no transformers, Accelerate or tokenizer here.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from medusa.drafters.heads import IGNORE_INDEX, head_lookup_table, head_target_offset

__all__ = ["IGNORE_INDEX", "LOSS_TYPES", "head_ce_sums", "head_lookup_table", "head_soft_sums",
           "head_target_counts", "head_targets", "medusa_loss", "next_token_kl_sum", "soft_cross_entropy"]

TOP_K = 5
LOSS_TYPES = ("hard", "teacher", "mixed")


def soft_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Per-row soft cross-entropy ``-sum_v p_T(v) log q_T(v) * T**2`` with ``p_T = softmax(teacher / T)`` and
    ``q_T = softmax(logits / T)`` (Hinton et al. 2015; the T**2 keeps gradient sizes comparable across T).

    Args:
        logits: ``(..., V)`` student logits.
        teacher_logits: ``(..., V)`` teacher logits (no gradient flows into them).
        temperature: T > 0.

    Returns:
        ``(...)`` float32 losses; with a one-hot teacher and T = 1 this is the hard cross-entropy.
    """
    teacher = torch.softmax(teacher_logits.detach().float() / temperature, dim=-1)  # (..., V)
    log_q = torch.log_softmax(logits.float() / temperature, dim=-1)  # (..., V)
    return -(teacher * log_q).sum(dim=-1) * temperature**2


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
    teacher_logits: torch.Tensor | None = None,
    loss_type: str = "hard",
    temperature: float = 1.0,
    mix: float = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decayed sum over heads of the mean per-head term on each head's supervised targets.

    ``loss = sum_k decay**k * L_k``. For ``"hard"``, ``L_k`` is the cross-entropy averaged over the positions t
    whose target ``labels[:, t+k+2]`` is supervised and inside the head vocabulary; for ``"teacher"``, the soft
    cross-entropy against ``teacher_logits[:, t+k+1]`` averaged over the positions whose target is supervised; for
    ``"mixed"``, ``mix * hard + (1 - mix) * teacher``. A head with no target contributes exactly 0 (never NaN) and
    still keeps its logits in the graph, so every head parameter gets a (zero) gradient under DDP.

    Args:
        head_logits: ``(K, B, T, Vh)`` logits of the K heads at every position.
        labels: ``(B, T)`` the input token ids where supervised (assistant tokens), ``IGNORE_INDEX`` elsewhere.
        head_lookup: ``(V,)`` base id -> head index or ``IGNORE_INDEX`` (see :func:`head_lookup_table`);
            ``None`` when the heads predict over the full vocabulary.
        decay: per-head loss weight base (Medusa's lambda_k = decay ** k).
        teacher_logits: ``(B, T, Vh)`` the base's logits over the head vocabulary at every position (row j predicts
            token j + 1); required unless ``loss_type`` is ``"hard"``.
        loss_type: one of :data:`LOSS_TYPES`.
        temperature: teacher temperature (see :func:`soft_cross_entropy`).
        mix: weight of the hard term in ``"mixed"``.

    Returns:
        ``(loss, stats)``: the scalar loss and ``(K,)`` tensors that sum over batches and processes:
        ``top1``/``top5`` correct predictions, ``count`` supervised targets (targets outside the head vocabulary
        count as misses), ``ce_sum`` summed cross-entropy over in-vocab targets and ``ce_count`` their number.

    Raises:
        ValueError: the logits and labels shapes disagree, an unknown ``loss_type``, or a teacher loss without
            ``teacher_logits``.
    """
    num_heads, batch, seq, head_vocab = head_logits.shape
    if labels.shape != (batch, seq):
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits (B, T) = {(batch, seq)}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss {loss_type!r}: expected one of {list(LOSS_TYPES)}")
    if loss_type != "hard" and (teacher_logits is None or teacher_logits.shape != (batch, seq, head_vocab)):
        got = None if teacher_logits is None else tuple(teacher_logits.shape)
        raise ValueError(f"loss {loss_type!r} needs the base's teacher logits of shape {(batch, seq, head_vocab)} "
                         f"(the base's lm_head over the head vocabulary), got {got}")
    # The same per-head sums and counts the trainer normalises over a whole step, here over this batch alone.
    ce_sums = head_ce_sums(head_logits, labels, head_lookup)  # (K,)
    ce_counts = head_target_counts(labels, num_heads, head_lookup)  # (K,)
    weights = torch.tensor([decay**k for k in range(num_heads)], device=ce_sums.device)  # (K,)
    # sum / max(count, 1): exactly 0 with a zero gradient when nothing is supervised.
    terms = ce_sums / ce_counts.clamp_min(1)  # (K,)
    if loss_type != "hard":
        soft = head_soft_sums(head_logits, teacher_logits, labels, temperature)  # (K,)
        soft_terms = soft / head_target_counts(labels, num_heads).clamp_min(1)
        terms = soft_terms if loss_type == "teacher" else mix * terms + (1 - mix) * soft_terms
    loss = (weights * terms).sum()
    stats = {name: torch.zeros(num_heads, dtype=torch.long, device=labels.device) for name in ("top1", "top5")}
    stats["count"] = head_target_counts(labels, num_heads)
    stats["ce_sum"] = ce_sums.detach().float()
    stats["ce_count"] = ce_counts
    with torch.no_grad():
        for k in range(num_heads):
            targets, _ = head_targets(labels, k, head_lookup)  # (B, T')
            in_vocab = targets != IGNORE_INDEX  # (B, T')
            top = head_logits[k, :, : targets.shape[1]].topk(min(TOP_K, head_vocab), dim=-1).indices  # (B, T', 5)
            hits = (top == targets.unsqueeze(-1)) & in_vocab.unsqueeze(-1)  # (B, T', 5)
            stats["top1"][k] = hits[..., 0].sum()
            stats["top5"][k] = hits.any(dim=-1).sum()
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


def head_soft_sums(head_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Per-head soft cross-entropy against the base's own distribution, summed over each head's supervised targets.

    The teacher-loss counterpart of :func:`head_ce_sums`: head k at position t is scored against
    ``teacher_logits[:, t + k + 1]`` (the base's prediction of the same token) wherever ``labels[:, t + k + 2]`` is
    supervised; the matching counts are :func:`head_target_counts` without a head lookup.

    Args:
        head_logits: ``(K, B, T, Vh)``.
        teacher_logits: ``(B, T, Vh)`` the base's logits over the head vocabulary.
        labels: ``(B, T)`` as for :func:`medusa_loss`.
        temperature: see :func:`soft_cross_entropy`.

    Returns:
        ``(K,)`` float32 sums (nats), with gradient.
    """
    sums = []
    for k in range(head_logits.shape[0]):
        _, supervised = head_targets(labels, k, None)  # (B, T')
        offset = head_target_offset(k) - 1
        teacher = teacher_logits[:, offset : offset + supervised.shape[1]]  # (B, T', Vh)
        soft = soft_cross_entropy(head_logits[k, :, : supervised.shape[1]], teacher, temperature)  # (B, T')
        sums.append((soft * supervised).sum())
    return torch.stack(sums)  # (K,)


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


def next_token_kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Summed ``KL(p_teacher || p_student)`` over rows: Medusa-2's self-distillation term that keeps the adapted base's
    next-token distribution on the frozen base's (Cai et al., 2024, section 2.2.2).

    Args:
        teacher_logits: ``(N, V)`` the frozen base's logits (no gradient flows into them).
        student_logits: ``(N, V)`` the adapted base's logits at the same positions.

    Returns:
        A float32 scalar, the sum over the N rows (nats); 0 for N = 0.
    """
    log_p = torch.log_softmax(teacher_logits.detach().float(), dim=-1)  # (N, V)
    log_q = torch.log_softmax(student_logits.float(), dim=-1)  # (N, V)
    return (log_p.exp() * (log_p - log_q)).sum()
