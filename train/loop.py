"""The step loop: optimizer steps over micro-batches with gradient accumulation, periodic logging, evaluation and
checkpoints. Reads top to bottom: ``fit`` -> ``train_step`` -> the batch helpers."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from tqdm.auto import tqdm

from medusa.base import base_states
from medusa.drafters.heads import IGNORE_INDEX
from medusa.losses import head_target_counts
from train.checkpoints import latest_checkpoint, save_checkpoint
from train.data import collate, to_device
from train.evaluation import any_held_out, evaluate, format_metrics
from train.medusa2 import (
    adapted_hidden_states,
    frozen_hidden_states,
    heads_loss_weight,
    in_stage2,
    kl_positions,
    kl_sum,
    set_lora_dropout,
)
from train.run import Run

logger = logging.getLogger(__name__)


def micro_batches(num_examples: int, batch_size: int, seed: int, rank: int, world: int,
                  start: int = 0, accum: int = 1) -> Iterator[list[int]]:
    """Endless example indices of this process's micro-batches, from global micro-step ``start`` on.

    An optimizer step takes the next ``batch_size * world * accum`` examples of the epoch's permutation (seeded by
    ``(seed, epoch)``); its micro-batch m gives process r the slice starting at ``(m * world + r) * batch_size``.
    The examples of a step therefore depend on the step and the global batch only, not on how the step is split
    into micro-batches and processes, and a resumed run continues the order. An epoch is wrapped around to whole
    steps, so every process gets the same number of micro-batches.
    """
    step_examples = batch_size * world * accum
    steps_per_epoch = max(1, math.ceil(num_examples / step_examples))
    per_epoch = steps_per_epoch * accum  # micro-steps
    epoch, index = divmod(start, per_epoch)
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_examples, generator=generator).tolist()
        order = (order * math.ceil(steps_per_epoch * step_examples / num_examples))[: steps_per_epoch * step_examples]
        for m in range(index, per_epoch):
            first = (m * world + rank) * batch_size
            yield order[first : first + batch_size]
        epoch, index = epoch + 1, 0


def fit(run: Run) -> list[float]:
    """Optimizer steps from ``run.step`` to ``max_steps`` with periodic logging, evaluation and checkpoints.

    Returns:
        The loss of each step run (summed over processes: the loss of the whole step), in order.
    """
    def held_out(r):
        metrics = evaluate(r, max_batches=r.config.max_eval_batches) if any_held_out(r) else None
        return None if metrics is None else (metrics, format_metrics(metrics))

    return step_loop(run, train_step, held_out, save_checkpoint, "medusa heads")


def step_loop(run, step, held_out, save, desc: str) -> list[float]:
    """The loop shared by head and draft-model training: ``step(run, batches)`` (one optimizer step, this process's
    share of its loss) from ``run.step`` to ``max_steps`` over :func:`micro_batches`, the loss logged every
    ``log_every`` steps, ``held_out(run)`` (``(metrics, text)`` or ``None``) every ``eval_every`` steps before the
    last, ``save(run)`` every ``save_every`` steps and at the end (unless just saved or resumed there).

    Returns:
        The loss of each step run (summed over processes: the loss of the whole step), in order.
    """
    config, accelerator = run.config, run.accelerator
    batches = micro_batches(len(run.train_examples), config.batch_size, config.seed, accelerator.process_index,
                            accelerator.num_processes, start=run.step * config.grad_accum_steps,
                            accum=config.grad_accum_steps)
    progress = tqdm(total=config.max_steps, initial=run.step, desc=desc, disable=not accelerator.is_main_process)
    saved_at = run.step if latest_checkpoint(config.output_dir) else None
    losses = []
    while run.step < config.max_steps:
        losses.append(accelerator.reduce(step(run, batches), reduction="sum").item())
        run.step += 1
        progress.update(1)
        if run.step % config.log_every == 0 or run.step == config.max_steps:
            progress.set_postfix(loss=f"{losses[-1]:.4f}")
            logger.info("step %d loss %.6f lr %.6g", run.step, losses[-1], run.scheduler.get_last_lr()[0])
            accelerator.log({"train/loss": losses[-1], "train/lr": run.scheduler.get_last_lr()[0]}, step=run.step)
        if config.eval_every and run.step % config.eval_every == 0 and run.step < config.max_steps:
            result = held_out(run)
            if result is not None:
                logger.info("step %d held-out %s", run.step, result[1])
        if config.save_every and run.step % config.save_every == 0:
            save(run)
            saved_at = run.step
    progress.close()
    if saved_at != run.step:
        save(run)
    return losses


def train_step(run: Run, batches: Iterator[list[int]]) -> torch.Tensor:
    """One optimizer step over ``grad_accum_steps`` micro-batches; returns this process's share of the step loss.

    The loss is normalised by the targets of the whole step, counted over all micro-batches and processes before the
    first forward (:func:`step_loss`), so it equals the loss of one batch holding the whole step: splitting a step
    into micro-batches or processes changes neither the loss nor the gradient. The shares of all processes sum to the
    step loss (a detached scalar). In Medusa-2's stage 2 the heads' loss is weighted by
    :func:`train.medusa2.heads_loss_weight` and ``kl_weight x KL(frozen || adapted)``, averaged over the step's
    next-token positions, is added; the heads' gradient reaches the LoRA through the adapted hidden states.
    The forward and the loss are the drafter's declared objective (``config.trainable.objective``,
    :mod:`train.objective`): the eagle drafter's gives ``ttt_steps`` outputs (its training-time-test unroll), each
    scored as the head of its depth.
    """
    config, accelerator = run.config, run.accelerator
    run.heads.train()
    joint = in_stage2(config, run.step)
    if joint:
        set_lora_dropout(run.model, True)
    objective = config.trainable.objective
    num_heads = objective.outputs(config)  # outputs per position: heads, or the eagle drafter's unrolled steps
    micro = [next(batches) for _ in range(config.grad_accum_steps)]
    collated = [to_device(collate([run.train_examples[i] for i in indices], run.pad_id), accelerator.device)
                for indices in micro]
    starts = [window_starts(b, indices, config.train_window, config.seed, run.step) for b, indices in
              zip(collated, micro, strict=True)] if config.train_window else [None] * len(micro)
    windows = [crop_window(b, s, config.train_window) for b, s in zip(collated, starts, strict=True)]
    counts = sum(head_target_counts(b["labels"], num_heads, run.head_lookup) for b in windows)  # (K,)
    global_counts = accelerator.reduce(counts, reduction="sum")  # (K,) over all processes
    global_supervised = None  # the teacher term counts every supervised target, in the head vocabulary or not
    if run.teacher_weight is not None:
        supervised = sum(head_target_counts(b["labels"], num_heads) for b in windows)  # (K,)
        global_supervised = accelerator.reduce(supervised, reduction="sum")
    kl_count = sum(kl_positions(b["labels"]).sum() for b in windows) if joint else None  # next-token positions
    heads_weight = heads_loss_weight(config, run.step)
    total = torch.zeros((), device=accelerator.device)
    for m, (indices, full, batch) in enumerate(zip(micro, collated, windows, strict=True)):
        hidden, frozen = step_hidden_states(run, indices, full, joint)  # (B, T, S) each; frozen None unless joint
        if starts[m] is not None:
            hidden = crop_window({"hidden": hidden}, starts[m], config.train_window)["hidden"]  # (B, W, S)
            frozen = frozen if frozen is None else crop_window({"h": frozen}, starts[m], config.train_window)["h"]
        last = m == config.grad_accum_steps - 1
        # Gradients are all-reduced once per optimizer step, on the last micro-batch.
        with nullcontext() if last else accelerator.no_sync(run.heads):
            logits = objective.logits(run.heads, hidden, batch["input_ids"], config)  # (K, B, T, Vh); K: outputs
            loss = heads_weight * objective.loss(run, logits, hidden, batch, global_counts, global_supervised)
            if joint:
                kl = kl_sum(run.model, hidden, frozen, batch["labels"])
                loss = loss + config.kl_weight * kl / kl_count.clamp_min(1)
            # DDP averages gradients over processes; the loss is already a share of the sum over all of them.
            accelerator.backward(loss * accelerator.num_processes)
        total += loss.detach()
    if config.max_grad_norm > 0:
        accelerator.clip_grad_norm_(list(run.heads.parameters()) + (run.lora_params or []), config.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    if joint:
        set_lora_dropout(run.model, False)
    return total


def step_hidden_states(run: Run, indices: list[int], batch: dict, joint: bool):
    """``(hidden, frozen)``: the base states ``(B, T, S)`` the heads read (fp32; ``S = (1 + len(base_layers)) H``,
    :func:`medusa.base.base_states`) and, in Medusa-2's joint stage, the original base's hidden states (the KL
    teacher's; ``None`` otherwise). Jointly, ``hidden`` is the adapted base's, with gradient into the LoRA (Medusa
    and Hydra heads, which read the last hidden state alone); otherwise it comes from :func:`batch_hidden_states`
    without gradient."""
    if not joint:
        return batch_hidden_states(run, indices, batch).float(), None  # the heads' weights are fp32
    hidden = adapted_hidden_states(run.model, batch["input_ids"], batch["attention_mask"]).float()  # (B, T, H)
    frozen = frozen_hidden_states(run.model, batch["input_ids"], batch["attention_mask"]).float()  # (B, T, H)
    return hidden, frozen


def window_starts(batch: dict, indices: list[int], window: int, seed: int, step: int) -> list[int]:
    """Where each example's training window starts at this step: drawn from (seed, step, example index) alone, so
    the windows do not depend on how a step is split into micro-batches or processes, and a resumed run draws the
    same ones. The start is uniform over the windows that begin at most 2 positions before the first supervised
    token (earlier windows would hold no target), and a window never reaches past its example's end (so the padding
    of the other examples in a micro-batch cannot move it)."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    first_label = (batch["labels"] != IGNORE_INDEX).float().argmax(dim=1).tolist()
    starts = []
    for i, n, first in zip(indices, lengths, first_label, strict=True):
        low = max(first - 2, 0)
        high = max(n - window, low)
        start = random.Random(f"{seed}:{step}:{i}").randint(low, high)
        starts.append(min(start, max(n - window, 0)))
    return starts


def crop_window(batch: dict, starts: list[int] | None, window: int | None) -> dict:
    """Each row of every ``(B, T, ...)`` tensor in ``batch`` cut to ``[start, start + window)`` (padded positions
    beyond a short row stay as they are). The base's hidden states keep their full left context, so a window only
    chooses which targets a step sees (Medusa-1's base is frozen: nothing else depends on the rest of the row).

    The eagle drafter's training-time test runs inside the window: every tensor is cut at the same start, so step j
    at window position p still reads its own step-(j-1) output at p - 1 and the token p + 1, and output j anchored
    at p still scores the label p + j + 2. Its own attention sees the window only (its context starts there);
    window-relative positions are what rotary attention needs, and a base with learned positions is refused with a
    window (:func:`train.setup.heads_base_layers`)."""
    if starts is None:
        return batch
    width = min(window, next(iter(batch.values())).shape[1])
    starts = [min(s, next(iter(batch.values())).shape[1] - width) for s in starts]

    def cut(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[row, s : s + width] for row, s in enumerate(starts)])

    return {name: cut(value) for name, value in batch.items()}


def batch_hidden_states(run: Run, indices: list[int], batch: dict) -> torch.Tensor:
    """Base states ``(B, T, S)`` the heads read for a micro-batch (``S = (1 + len(heads.base_layers)) H``): from
    ``run.store`` when there is one, else from ``run.hidden_cache`` when every example is in it.

    Without either this is :func:`medusa.base.base_states` of the heads' ``base_layers``. With a cache, a batch
    holding any new example runs the base and stores each example's unpadded states (bf16, CPU); a fully cached
    batch is re-padded with zeros (padding positions carry no label).
    """
    if run.store is not None:
        return run.store.hidden_batch(indices).to(batch["input_ids"].device)  # (B, T, S)
    if run.hidden_cache is None or any(i not in run.hidden_cache for i in indices):
        layers = run.accelerator.unwrap_model(run.heads).base_layers
        hidden = base_states(run.model, batch["input_ids"], batch["attention_mask"], layers)  # (B, T, S)
        if run.hidden_cache is not None:
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
                run.hidden_cache[i] = hidden[row, :n].to("cpu", torch.bfloat16)
        return hidden
    batch_size, length = batch["input_ids"].shape
    width = run.hidden_cache[indices[0]].shape[-1]
    hidden = torch.zeros(batch_size, length, width, device=batch["input_ids"].device)  # (B, T, S)
    for row, i in enumerate(indices):
        cached = run.hidden_cache[i]
        hidden[row, : len(cached)] = cached.to(hidden.device, torch.float32)
    return hidden
