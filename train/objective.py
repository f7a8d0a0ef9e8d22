"""What a training step minimises: Medusa's decayed per-head loss (hard, teacher or mixed) normalised by the targets
of the whole optimizer step (Cai et al., 2024, section 2.2). The eagle drafter's ``ttt_steps`` unrolled outputs
(EAGLE-3's training-time test, Li et al. 2025, section 3.3) are scored as heads of their depth; the teacher is the
base's lm_head over its last hidden state, the first columns of the base states the heads read.

An objective (:class:`DecayedHeadLoss`, :class:`TrainingTimeTest`) is what a trainable drafter declares
(:mod:`train.drafters`): how many outputs a step scores, the forward that gives them and their loss."""

from __future__ import annotations

import torch

from medusa.losses import head_ce_sums, head_soft_sums, medusa_loss


def teacher_logits(run, hidden: torch.Tensor) -> torch.Tensor | None:
    """The base's own logits over the head vocabulary ``(B, T, Vh)`` from base states ``(B, T, (1 + k) H)`` (its
    lm_head rows of the token map over the last hidden state, the first H columns, with its final soft-capping), or
    ``None`` when the loss needs no teacher."""
    if run.teacher_weight is None:
        return None
    with torch.no_grad():
        last = last_hidden(hidden, run.teacher_weight.shape[1])  # (B, T, H)
        teacher = last.float() @ run.teacher_weight.float().T  # (B, T, Vh)
        cap = getattr(run.model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        return teacher if cap is None else torch.tanh(teacher / cap) * cap


def last_hidden(states: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The base's last hidden state ``(..., H)`` (what its lm_head reads) of base states ``(..., (1 + k) H)``
    (:func:`medusa.base.base_states`: it comes first)."""
    return states[..., :hidden_size]


class DecayedHeadLoss:
    """The objective of Medusa and Hydra heads (Cai et al., 2024, section 2.2; Ankner et al., 2024, section 3): one
    output per head, head k's loss weighted ``loss_decay ** k`` (:func:`mixed_step_loss`)."""

    def outputs(self, config) -> int:
        """How many outputs per position a training step scores: one per head."""
        return config.num_heads

    def logits(self, heads: torch.nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor,
               config) -> torch.Tensor:
        """The heads' logits ``(outputs, B, T, Vh)`` from base states ``(B, T, (1 + k) H)`` and tokens ``(B, T)``."""
        return heads(hidden, input_ids)

    def loss(self, run, logits: torch.Tensor, hidden: torch.Tensor, batch: dict, counts: torch.Tensor,
             supervised: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch's share of the step loss (:func:`mixed_step_loss`; ``counts`` and ``supervised``
        ``(outputs,)``: the step's targets per output inside the head vocabulary and in all)."""
        return mixed_step_loss(run, logits, hidden, batch, counts, supervised)


class TrainingTimeTest(DecayedHeadLoss):
    """The eagle drafter's objective: EAGLE-3's training-time test (Li et al. 2025, section 3.3). Each step unrolls
    the drafter ``ttt_steps`` times on its own outputs; output j is scored as the depth-j head (``loss_decay ** j``),
    whatever the drafting depth ``num_heads`` is."""

    def outputs(self, config) -> int:
        return config.ttt_steps

    def logits(self, heads: torch.nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor,
               config) -> torch.Tensor:
        return heads(hidden, input_ids, steps=config.ttt_steps)


def head_loss(run, logits: torch.Tensor, hidden: torch.Tensor, batch: dict):
    """:func:`medusa.losses.medusa_loss` with the run's loss settings (evaluation: per-batch means and stats)."""
    config = run.config
    return medusa_loss(logits, batch["labels"], run.head_lookup, config.loss_decay,
                       teacher_logits=teacher_logits(run, hidden), loss_type=config.loss,
                       temperature=config.teacher_temperature, mix=config.loss_mix)


def mixed_step_loss(run, logits: torch.Tensor, hidden: torch.Tensor, batch: dict, hard_counts: torch.Tensor,
                    soft_counts: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch's share of the step loss for ``config.loss`` (hard, teacher or mixed), each term normalised
    by its own target count over the whole step (see :func:`step_loss`)."""
    config = run.config
    hard_weight = {"hard": 1.0, "teacher": 0.0, "mixed": config.loss_mix}[config.loss]
    loss = logits.new_zeros((), dtype=torch.float32)
    if hard_weight > 0:
        sums = head_ce_sums(logits, batch["labels"], run.head_lookup)  # (K,)
        loss = loss + hard_weight * step_loss(sums, hard_counts, config.loss_decay)
    if hard_weight < 1:
        sums = head_soft_sums(logits, teacher_logits(run, hidden), batch["labels"], config.teacher_temperature)
        loss = loss + (1 - hard_weight) * step_loss(sums, soft_counts, config.loss_decay)
    return loss


def step_loss(ce_sums: torch.Tensor, step_counts: torch.Tensor, decay: float) -> torch.Tensor:
    """Medusa's decayed loss ``sum_k decay**k * CE_k`` for one micro-batch's share of an optimizer step.

    ``CE_k`` is head k's cross-entropy averaged over the targets of the whole step (all micro-batches, all
    processes), so the shares of a step add up to the loss of one batch holding the step, however it is split.

    Args:
        ce_sums: ``(K,)`` this micro-batch's summed cross-entropy per head (:func:`medusa.losses.head_ce_sums`,
            or the soft one, :func:`medusa.losses.head_soft_sums`).
        step_counts: ``(K,)`` targets per head in the whole step (:func:`medusa.losses.head_target_counts`,
            summed over micro-batches and processes); a head with none contributes exactly 0.
        decay: Medusa's lambda_k = decay ** k.

    Returns:
        The scalar share of the step loss (nats), with gradient.
    """
    weights = torch.tensor([decay**k for k in range(len(ce_sums))], device=ce_sums.device)  # (K,)
    return (weights * ce_sums / step_counts.clamp_min(1).to(ce_sums.dtype)).sum()
