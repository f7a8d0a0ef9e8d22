"""``Run``: everything the training loop, evaluation and checkpoints share, built once by :func:`train.setup.setup`.

Its own module so that the modules reading it (``train.loop``, ``train.evaluation``, ``train.checkpoints``) and the
one building it (``train.setup``) import it without importing each other.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from train.config import TrainConfig
from train.store import HiddenStateStore


@dataclass
class Run:
    """Everything the loop needs, built once by :func:`setup`."""

    config: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module
    heads: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_examples: list[dict]
    held_examples: list[dict]
    head_lookup: torch.Tensor | None
    pad_id: int
    teacher_weight: torch.Tensor | None
    """``(Vh, H)`` the base's lm_head rows of the head vocabulary (teacher logits), when the loss needs them."""
    step: int = 0
    hidden_cache: dict[int, torch.Tensor] | None = None
    """Example index -> its ``(T_i, H)`` bf16 hidden states, when ``config.cache_hidden_states``."""
    store: HiddenStateStore | None = None
    """The training examples' hidden states on disk, when ``config.hidden_state_store`` is set."""
    lora_params: list[torch.nn.Parameter] | None = None
    """Medusa-2: the base's LoRA parameters (``run.model`` is then a peft model)."""
    validation: list[tuple[list[int], int]] = dataclasses.field(default_factory=list)
    """``(token_ids, response_start)`` of the validation split's self-distilled answers (never trained on): what the
    per-step tree's calibration is measured on at the end (:func:`medusa.tools.calibrate.calibrate_heads`)."""


def end_run(run) -> None:
    """End a training run on every process: free what it prepared, then end the trackers and the process group.

    The DDP-wrapped modules, the optimizer and the dataloaders are released (``Accelerator.free_memory`` and every
    field of ``run``) and collected while every process is still inside the group, and only then, after a barrier,
    does ``Accelerator.end_training`` destroy it. Freeing them after the group was gone, at the return of the training
    function, left one process of a two-process gloo run hanging in the teardown in about one run in seven
    (its stack: the caller's frame, nothing below it; tests/processes.py dumps such stacks on a timeout).

    Args:
        run: a :class:`Run` or ``train.draft_model.DraftRun``; its fields are ``None`` afterwards.
    """
    accelerator = run.accelerator
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    for field in dataclasses.fields(run):
        setattr(run, field.name, None)
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()
