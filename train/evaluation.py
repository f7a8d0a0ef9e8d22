"""Held-out evaluation: per-head (per-depth, for the eagle drafter) top-1/top-5 accuracy and loss, and the expected
acceptance length of the top-1 chain, summed over all processes."""

from __future__ import annotations

import logging

import torch

from medusa.base import base_states
from medusa.drafters.heads import head_target_offset
from train.data import collate, to_device
from train.history import append_evaluation
from train.objective import head_loss
from train.run import Run
from train.sharded import heads_are_sharded

logger = logging.getLogger(__name__)


def any_held_out(run: Run) -> bool:
    """Whether any process holds held-out examples: evaluation is a collective (its counts are reduced), so every
    process must enter it or none, even one whose own slice is empty."""
    flag = torch.tensor(len(run.held_examples), device=run.accelerator.device)
    return bool(run.accelerator.reduce(flag, reduction="sum").item() > 0)


@torch.no_grad()
def evaluate(run: Run, max_batches: int | None = None) -> dict:
    """Per-head top-1/top-5 accuracy and loss on the held-out examples, summed over all processes.

    Each process scores its own slice of the held-out split; counts are summed with ``accelerator.reduce``. The
    eagle drafter is scored at its drafting depth (``num_heads`` unrolled steps on its own outputs), so "head" k is
    its depth-k output.

    Returns:
        ``{"examples", "loss", "expected_tau", "heads": [{"head", "offset", "top1", "top5", "targets"}]}``;
        accuracies count targets outside a truncated head vocabulary as misses.
    """
    config, accelerator = run.config, run.accelerator
    heads = accelerator.unwrap_model(run.heads)
    heads.eval()
    mine = run.held_examples[accelerator.process_index :: accelerator.num_processes]
    starts = list(range(0, len(mine), config.batch_size))[:max_batches]
    spare = spare_forwards(accelerator, len(starts))  # before any forward: it is a collective itself
    totals: dict[str, torch.Tensor] = {}
    for start in starts:
        batch = to_device(collate(mine[start : start + config.batch_size], run.pad_id), accelerator.device)
        hidden = base_states(run.model, batch["input_ids"], batch["attention_mask"], heads.base_layers)  # (B, T, S)
        with accelerator.autocast():
            logits = heads(hidden.float(), batch["input_ids"])  # (K, B, T, Vh); the heads' weights are fp32
        _, stats = head_loss(run, logits, hidden.float(), batch)
        for name, value in stats.items():
            totals[name] = totals.get(name, 0) + value
    for _ in range(spare):
        # Sharded heads may gather their parameters in a forward (a collective): a process whose slice has fewer
        # batches runs them on a spare batch, discarded, so every process runs as many forwards.
        batch = to_device(collate(run.held_examples[:1], run.pad_id), accelerator.device)
        states = base_states(run.model, batch["input_ids"], batch["attention_mask"], heads.base_layers)  # (B, T, S)
        heads(states.float(), batch["input_ids"])
    if not totals:  # this process has no held-out slice; it still joins the reduction
        zeros = torch.zeros(heads.config.num_heads, device=accelerator.device)
        totals = {"top1": zeros.long(), "top5": zeros.long(), "count": zeros.long(), "ce_sum": zeros,
                  "ce_count": zeros.long()}
    totals["examples"] = torch.tensor(min(len(mine), len(starts) * config.batch_size), device=accelerator.device)
    totals = {name: accelerator.reduce(value, reduction="sum") for name, value in totals.items()}
    heads.train()
    metrics = _metrics(totals, config.loss_decay)
    if accelerator.is_main_process:
        append_evaluation(config.output_dir, run.step, metrics)
    accelerator.log({f"eval/{k}": v for k, v in _flat_metrics(metrics).items()}, step=run.step)
    return metrics


def spare_forwards(accelerator, batches: int) -> int:
    """How many more heads forwards this process must run so all processes run as many: ``0`` unless the heads are
    sharded (FSDP2, DeepSpeed), whose forwards are collectives; then the most batches of any process minus
    ``batches``."""
    if not heads_are_sharded(accelerator):
        return 0
    counts = accelerator.gather(torch.tensor([batches], device=accelerator.device))  # (processes,)
    return int(counts.max().item()) - batches


def _metrics(totals: dict[str, torch.Tensor], decay: float) -> dict:
    count, ce_count = totals["count"].clamp_min(1).double(), totals["ce_count"].clamp_min(1).double()
    ce = totals["ce_sum"].double() / ce_count  # (K,)
    heads = [
        {"head": k, "offset": head_target_offset(k), "top1": round((totals["top1"][k] / count[k]).item(), 6),
         "top5": round((totals["top5"][k] / count[k]).item(), 6), "targets": int(totals["count"][k].item()),
         "loss": round(ce[k].item(), 6)}
        for k in range(len(count))
    ]
    loss = sum(decay**k * ce[k].item() for k in range(len(ce)))
    return {"examples": int(totals["examples"].item()), "loss": round(loss, 6),
            "expected_tau": round(expected_chain_tau([h["top1"] for h in heads]), 6), "heads": heads}


def expected_chain_tau(top1: list[float]) -> float:
    """Expected tokens per verify step of the top-1 chain over the heads: ``1 + sum_k prod_{j <= k} top1_j`` (the
    base's own token plus each depth accepted while every shallower one was). Exact when each depth's top-1 is its
    acceptance given the shallower ones right (Hydra heads and the eagle drafter read the true path); for Medusa
    heads it treats the heads as independent."""
    tau, chain = 1.0, 1.0
    for accuracy in top1:
        chain *= accuracy
        tau += chain
    return tau


def _flat_metrics(metrics: dict) -> dict:
    flat = {"loss": metrics["loss"], "expected_tau": metrics["expected_tau"]}
    for h in metrics["heads"]:
        flat[f"head{h['head']}_top1"], flat[f"head{h['head']}_top5"] = h["top1"], h["top5"]
    return flat


def format_metrics(metrics: dict) -> str:
    if not metrics:
        return "(no held-out data)"
    heads = ", ".join(f"h{h['head']} {h['top1']:.3f}/{h['top5']:.3f}" for h in metrics["heads"])
    return f"loss {metrics['loss']:.4f}, expected tau {metrics['expected_tau']:.3f}, top-1/top-5 {heads}"
