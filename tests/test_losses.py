"""Medusa loss: target offsets, masking, decay weighting and truncated head vocabularies."""

import math

import pytest
import torch

from medusa.losses import IGNORE_INDEX, head_lookup_table, medusa_loss

V = 11


def peaked_logits(labels: torch.Tensor, num_heads: int, shift_extra: int = 0, vocab: int = V) -> torch.Tensor:
    """Logits ``(K, B, T, V)`` where head k at t puts a huge logit on ``labels[t + k + 2 + shift_extra]``."""
    batch, seq = labels.shape
    logits = torch.zeros(num_heads, batch, seq, vocab)
    for k in range(num_heads):
        off = k + 2 + shift_extra
        for t in range(seq - off):
            target = labels[:, t + off].clamp_min(0)
            logits[k, torch.arange(batch), t, target] = 50.0
    return logits


def test_correct_offset_gives_zero_loss_and_full_accuracy():
    torch.manual_seed(0)
    labels = torch.randint(0, V, (2, 12))
    logits = peaked_logits(labels, num_heads=3)
    loss, stats = medusa_loss(logits, labels)
    assert loss.item() < 1e-6
    assert torch.equal(stats["top1"], stats["count"])
    assert stats["count"].tolist() == [2 * 10, 2 * 9, 2 * 8]


@pytest.mark.parametrize("shift_extra", [-1, 1])
def test_wrong_offset_is_penalised(shift_extra):
    labels = torch.arange(12).remainder(V).unsqueeze(0).repeat(2, 1)  # distinct neighbours: shifts never coincide
    logits = peaked_logits(labels, num_heads=3, shift_extra=shift_extra)
    loss, stats = medusa_loss(logits, labels)
    assert loss.item() > 10
    assert stats["top1"].sum() == 0


def test_masked_positions_are_not_targets():
    labels = torch.randint(0, V, (1, 10))
    labels[0, :6] = IGNORE_INDEX
    _, stats = medusa_loss(torch.randn(2, 1, 10, V), labels)
    # Head 0 targets positions 2..9, of which 6..9 are supervised; head 1 targets 3..9.
    assert stats["count"].tolist() == [4, 4]


def test_all_masked_batch_is_zero_and_finite():
    logits = torch.randn(3, 2, 8, V, requires_grad=True)
    labels = torch.full((2, 8), IGNORE_INDEX)
    loss, stats = medusa_loss(logits, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() == 0
    assert stats["count"].sum() == 0


def test_sequence_shorter_than_offset_is_zero():
    logits = torch.randn(4, 1, 3, V, requires_grad=True)
    loss, stats = medusa_loss(logits, torch.randint(0, V, (1, 3)))
    loss.backward()
    # Only head 0 (offset 2) has a target inside a 3-token sequence.
    assert stats["count"].tolist() == [1, 0, 0, 0]
    assert math.isfinite(loss.item())


def test_decay_weighting():
    torch.manual_seed(1)
    labels = torch.randint(0, V, (2, 10))
    logits = torch.randn(3, 2, 10, V)
    loss, stats = medusa_loss(logits, labels, decay=0.5)
    per_head = stats["ce_sum"] / stats["ce_count"]
    assert loss.item() == pytest.approx((per_head * torch.tensor([1.0, 0.5, 0.25])).sum().item(), rel=1e-5)
    loss_flat, _ = medusa_loss(logits, labels, decay=1.0)
    assert loss_flat.item() == pytest.approx(per_head.sum().item(), rel=1e-5)


def test_truncated_vocab_excludes_missing_targets_and_counts_them_as_misses():
    token_map = torch.tensor([0, 2, 4, 6, 8, 10])
    lookup = head_lookup_table(token_map, V)
    labels = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])  # odd ids are outside the head vocab
    head_vocab_labels = torch.where(labels % 2 == 0, labels // 2, torch.zeros_like(labels))
    logits = peaked_logits(head_vocab_labels, num_heads=1, vocab=len(token_map))
    loss, stats = medusa_loss(logits, labels, head_lookup=lookup)
    assert loss.item() < 1e-6  # only the in-vocab targets 2, 4, 6 enter the cross-entropy
    assert stats["count"].item() == 6  # targets at positions 2..7
    assert stats["ce_count"].item() == 3
    assert stats["top1"].item() == 3 and stats["top5"].item() == 3


def test_top5_counts():
    labels = torch.tensor([[1, 1, 3]])
    logits = torch.zeros(1, 1, 3, V)
    logits[0, 0, 0] = torch.arange(V, 0, -1).float()  # ranking 0, 1, 2, 3, ...: target 3 is 4th
    _, stats = medusa_loss(logits, labels)
    assert stats["top1"].item() == 0 and stats["top5"].item() == 1


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="labels shape"):
        medusa_loss(torch.randn(2, 1, 5, V), torch.zeros(1, 6, dtype=torch.long))
