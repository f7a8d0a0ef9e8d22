"""Medusa-1 head training with Accelerate: frozen base, K heads trained on its last hidden states.

Medusa (Cai et al., 2024, section 2.2.1): the base model (embeddings and lm_head included) is frozen and runs under
``torch.no_grad``; only the heads train, on the loss of :mod:`medusa.losses`. Reading order:

``train`` -> ``setup`` (accelerator, base, data, heads, optimizer, resume) -> ``fit`` (the loop: ``train_step``,
``evaluate``, ``save_checkpoint``) -> final evaluation and ``save_heads``.

Only the heads go through ``accelerator.prepare`` (DDP wraps them alone); the base sits on ``accelerator.device``
as a plain module. A checkpoint is one folder ``checkpoints/step_N`` (heads, optimizer state, each process's random
state, step, config), written atomically; a run whose ``output_dir`` holds checkpoints resumes from the latest one and
continues exactly as an uninterrupted run would (the data order and the schedule are functions of the step).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from medusa import heads as heads_module
from medusa.checkpoint import load_heads, save_heads
from medusa.heads import (
    IGNORE_INDEX,
    HydraHeads,
    MedusaHeads,
    MedusaHeadsConfig,
    head_target_offset,
    lm_head_fingerprint,
    most_frequent_tokens,
    read_json,
)
from medusa.losses import head_ce_sums, head_lookup_table, head_soft_sums, head_target_counts, medusa_loss
from train.config import TrainConfig, resume_mismatch
from train.data import (
    Conversation,
    ReadReport,
    collate,
    default_tokenize_cache_dir,
    load_conversations,
    normalize_record,
    split_held_out,
    target_token_counts,
    tokenize_conversations,
)
from train.distill import DISTILLED_HELD_OUT_NAME, DISTILLED_TRAIN_NAME, distill, jsonl_ids
from train.history import append_evaluation, write_curves
from train.store import HiddenStateStore, base_hidden_states, ensure_store

logger = logging.getLogger(__name__)

HEADS_DIR = "heads"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step_"
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
RNG_STATE_NAME = "rng_state_{rank}.pt"
EVAL_NAME = "eval.json"


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


def train(config: TrainConfig, model=None, tokenizer=None) -> Path:
    """Train Medusa heads as ``config`` says and write them to ``output_dir/heads``.

    Args:
        config: the run configuration.
        model: an already loaded base causal LM to use instead of loading ``config.base`` (it is frozen in place).
        tokenizer: its tokenizer; loaded from ``config.base`` when ``None``.

    Returns:
        The heads folder (loadable with :func:`medusa.checkpoint.load_heads`).

    Raises:
        ValueError: the data holds nothing to train on, or ``output_dir`` holds a checkpoint written with a
            different config (the message names the differing fields).
    """
    run = setup(config, model, tokenizer)
    fit(run)
    metrics = evaluate(run) if any_held_out(run) else {}
    out = Path(config.output_dir)
    if run.accelerator.is_main_process:
        heads = run.accelerator.unwrap_model(run.heads)
        extra = {"config": config.to_dict(), "steps": run.step, "held_out": metrics}
        save_heads(heads, out / HEADS_DIR, extra_config=extra)
        (out / EVAL_NAME).write_text(json.dumps({"steps": run.step, **metrics}, indent=2) + "\n")
        write_curves(out)
        logger.info("heads written to %s; held-out %s", out / HEADS_DIR, _format_metrics(metrics))
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    return out / HEADS_DIR


def setup(config: TrainConfig, model=None, tokenizer=None) -> Run:
    """Accelerator, frozen base, tokenised data, heads (fresh or from the latest checkpoint), optimizer, schedule."""
    accelerator = make_accelerator(config)
    logger.info("training on %s, device %s, mixed precision %s", describe_processes(accelerator), accelerator.device,
                "off" if accelerator.mixed_precision == "no" else accelerator.mixed_precision)
    set_seed(config.seed)
    if accelerator.is_main_process:
        remove_unfinished_checkpoints(config.output_dir)
    checkpoint = latest_checkpoint(config.output_dir)
    state = read_checkpoint_state(checkpoint, config) if checkpoint else None
    model, tokenizer = prepare_base(config, accelerator, model, tokenizer)
    train_convs, held_convs = prepare_conversations(config, accelerator, model, tokenizer)
    train_examples, _ = tokenize_conversations(train_convs, tokenizer, config.max_seq_len, config.num_proc,
                                               default_tokenize_cache_dir())
    held_examples = tokenize_held_out(held_convs, tokenizer, config.max_seq_len, config.held_out_fraction)
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} exposes no lm_head (get_output_embeddings() is None): the heads "
                         "project with it and the teacher loss needs it")
    store = ensure_store(config.hidden_state_store, model, train_examples, config.max_seq_len, config.batch_size,
                         accelerator) if config.hidden_state_store else None
    lm_head = model.get_output_embeddings().weight  # (V, H)
    embed = model.get_input_embeddings().weight  # (V, H)
    if checkpoint:
        heads = load_heads(checkpoint / HEADS_DIR, lm_head, embed_weight=embed)
    else:
        heads = build_heads(config, lm_head, embed, train_examples, eos_ids(model, tokenizer))
    warn_heads_without_targets(head_target_totals(train_examples, heads.config.num_heads))
    teacher_weight = None
    if config.loss != "hard":
        teacher_weight = lm_head.detach() if heads.token_map is None else lm_head.detach()[heads.token_map]
    optimizer = make_optimizer(heads, config)
    heads, optimizer = accelerator.prepare(heads, optimizer)
    step = state["step"] if state else 0
    if checkpoint:
        optimizer.load_state_dict(_torch_load(checkpoint / OPTIMIZER_NAME, "optimizer state"))
        logger.info("resuming from step %d (%s)", step, checkpoint)
    # The schedule is a function of the step alone: rebuilt at the resumed step, it follows a changed max_steps.
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.max_steps, last_epoch=step - 1)
    unwrapped = accelerator.unwrap_model(heads)
    lookup = head_lookup_table(unwrapped.token_map, unwrapped.config.vocab_size)
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    if config.tracker != "none":
        tracker_config = {k: ("none" if v is None else v) for k, v in config.to_dict().items()}
        accelerator.init_trackers("medusa_heads", config=tracker_config,
                                  init_kwargs={"wandb": {"dir": config.output_dir}})
    if checkpoint:
        restore_rng_state(checkpoint, accelerator.process_index)
    return Run(config, accelerator, model, heads, optimizer, scheduler, train_examples, held_examples, lookup,
               pad_id, teacher_weight, step=step, hidden_cache={} if config.cache_hidden_states else None,
               store=store)


def make_accelerator(config: TrainConfig) -> Accelerator:
    """The run's Accelerator: mixed precision, tracker, and DDP that does not re-broadcast the heads' buffers.

    Accelerate turns a multi-process launch into CPU DDP (gloo) only when asked for CPU, and ``accelerate launch
    --multi_gpu`` / ``torchrun`` do not say so: a multi-process launch on a machine without CUDA runs on CPU.

    Raises:
        ImportError: the tracker's package is not installed.
        ValueError: the mixed-precision mode cannot run on this device (see :func:`resolve_mixed_precision`).
    """
    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(config.tracker)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ImportError(f'tracker="{config.tracker}" needs the {module} package: pip install -e ".[tracking]"')
    if config.tracker == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    # Checked before the Accelerator exists: its state is process-wide and a refused mode must not stick to it.
    mixed_precision = resolve_mixed_precision(config.mixed_precision, PartialState(cpu=cpu).device)
    # The shared lm_head rows and token map are constant buffers: broadcasting them every forward is wasted traffic.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision,
                              log_with=None if config.tracker == "none" else config.tracker,
                              project_dir=str(Path(config.output_dir) / "runs"), kwargs_handlers=[ddp])
    if accelerator.mixed_precision != "no" and not accelerator.native_amp:
        raise ValueError(f"mixed_precision={config.mixed_precision!r}: Accelerate runs no {mixed_precision} autocast "
                         f"on {accelerator.device}; use 'no' or 'auto'")
    return accelerator


def describe_processes(accelerator: Accelerator) -> str:
    """``"1 process"`` or, e.g., ``"2 processes (DDP on CPU)"``, for the log."""
    n = accelerator.num_processes
    if n == 1:
        return "1 process"
    kind = {"MULTI_CPU": "DDP on CPU", "MULTI_GPU": "DDP on GPUs"}.get(accelerator.distributed_type.value,
                                                                       accelerator.distributed_type.value)
    return f"{n} processes ({kind})"


def resolve_mixed_precision(value: str, device: torch.device) -> str:
    """The mixed-precision mode to run on ``device``: ``"auto"`` -> ``"bf16"`` on a CUDA device that supports it,
    else ``"no"``; other values unchanged.

    Raises:
        ValueError: ``value`` cannot run on ``device``: fp16 on a CPU (Accelerate has no fp16 autocast there, so the
            heads would get fp16 inputs with fp32 weights), bf16 on a CUDA device without bf16.
    """
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if value == "auto":
        return "bf16" if cuda_bf16 else "no"
    if value == "fp16" and device.type == "cpu":
        raise ValueError("mixed_precision='fp16' cannot run on cpu (Accelerate has no fp16 autocast there); "
                         "use 'bf16', 'no' or 'auto'")
    if value == "bf16" and device.type == "cuda" and not cuda_bf16:
        raise ValueError(f"mixed_precision='bf16': {torch.cuda.get_device_name(device)} does not support bf16; "
                         "use 'fp16', 'no' or 'auto'")
    return value


def prepare_base(config: TrainConfig, accelerator: Accelerator, model=None, tokenizer=None):
    """Load (unless given) the base and its tokenizer, freeze the base and put it on ``accelerator.device``."""
    if model is None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
        model = AutoModelForCausalLM.from_pretrained(config.base, dtype=dtype)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(config.base)
    freeze_base(model)
    return model.to(accelerator.device), tokenizer


def freeze_base(model: torch.nn.Module) -> None:
    """Medusa-1: freeze every base parameter (embeddings and lm_head included) and switch off dropout."""
    model.requires_grad_(False)
    model.eval()


def batch_hidden_states(run: Run, indices: list[int], batch: dict) -> torch.Tensor:
    """Base hidden states ``(B, T, H)`` for a micro-batch: from ``run.store`` when there is one, else from
    ``run.hidden_cache`` when every example is in it.

    Without either this is :func:`train.store.base_hidden_states`. With a cache, a batch holding any new example runs
    the base and stores each example's unpadded states (bf16, CPU); a fully cached batch is re-padded with zeros
    (padding positions carry no label).
    """
    if run.store is not None:
        return run.store.hidden_batch(indices).to(batch["input_ids"].device)  # (B, T, H)
    if run.hidden_cache is None or any(i not in run.hidden_cache for i in indices):
        hidden = base_hidden_states(run.model, batch["input_ids"], batch["attention_mask"])  # (B, T, H)
        if run.hidden_cache is not None:
            lengths = batch["attention_mask"].sum(dim=1).tolist()
            for row, (i, n) in enumerate(zip(indices, lengths, strict=True)):
                run.hidden_cache[i] = hidden[row, :n].to("cpu", torch.bfloat16)
        return hidden
    batch_size, width = batch["input_ids"].shape
    hidden = torch.zeros(batch_size, width, run.model.config.get_text_config(decoder=True).hidden_size,
                         device=batch["input_ids"].device)  # (B, T, H)
    for row, i in enumerate(indices):
        cached = run.hidden_cache[i]
        hidden[row, : len(cached)] = cached.to(hidden.device, torch.float32)
    return hidden


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids of the tokenizer and the generation config: always in a truncated head vocabulary."""
    ids = {tokenizer.eos_token_id}
    generation_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return sorted(i for i in ids if i is not None)


def build_heads(config: TrainConfig, lm_head: torch.Tensor, embed: torch.Tensor, examples: list[dict],
                always: list[int]) -> MedusaHeads | HydraHeads:
    """Fresh heads of ``config.head_type`` over the base's lm_head and input embeddings ``(V, H)``, with a token map
    of the most frequent training targets. Sharded or partitioned weights are gathered once (:func:`full_weight`)."""
    from train.sharded import full_weight

    lm_head = full_weight(lm_head, "lm_head")  # (V, H)
    embed = full_weight(embed, "input embeddings") if config.head_type == "hydra" else embed  # (V, H)
    vocab, hidden = lm_head.shape
    head_vocab = config.head_vocab_size if config.head_vocab_size and config.head_vocab_size < vocab else None
    token_map = None
    if head_vocab is not None:
        counts = target_token_counts(examples, vocab)  # (V,)
        kept = [i for i in always if i < vocab]
        seen = int((counts > 0).sum()) + sum(1 for i in kept if counts[i] == 0)
        if head_vocab > seen:
            logger.warning("head_vocab_size=%d but the training targets hold only %d distinct tokens: %d head "
                           "vocabulary entries are tokens never seen in training; head_vocab_size=%d would do",
                           head_vocab, seen, head_vocab - seen, seen)
        token_map = most_frequent_tokens(counts, head_vocab, always=kept)
    heads_config = MedusaHeadsConfig(
        hidden_size=hidden, vocab_size=vocab, num_heads=config.num_heads, num_layers=config.num_layers,
        head_vocab_size=head_vocab, share_lm_head=config.share_lm_head, base_model_name_or_path=config.base,
        lm_head_fingerprint=lm_head_fingerprint(lm_head), head_type=config.head_type,
        prefix_layers=config.prefix_layers, prefix_window=config.prefix_window,
    )
    return heads_module.build_heads(heads_config, lm_head, embed, token_map)


def make_optimizer(heads: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the heads' trainable parameters only; weight decay on matrices, not on biases."""
    params = [p for p in heads.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.learning_rate)


# ---------------------------------------------------------------------------------------------------------------------
# Data: conversations (optionally self-distilled), batches.


def prepare_conversations(config: TrainConfig, accelerator: Accelerator, model, tokenizer):
    """``(train, held_out)`` conversations; self-distilled first when ``config.self_distill`` asks for it.

    The split is made on the source conversations, so distilled held-out answers come from held-out prompts only.
    Records that already carry base token ids are used as they are.
    """
    convs, _ = load_conversations(config.data, config.max_conversations)
    train_convs, held_convs = split_held_out(convs, config.held_out_fraction, config.seed)
    if config.self_distill and any(c.response_ids is None for c in convs):
        out = Path(config.output_dir)
        splits = ((train_convs, DISTILLED_TRAIN_NAME), (held_convs, DISTILLED_HELD_OUT_NAME))
        train_convs, held_convs = (
            self_distill_split(config, accelerator, model, tokenizer, split, out / name) for split, name in splits
        )
    logger.info("%d train and %d held-out conversations", len(train_convs), len(held_convs))
    return train_convs, held_convs


def any_held_out(run: Run) -> bool:
    """Whether any process holds held-out examples: evaluation is a collective (its counts are reduced), so every
    process must enter it or none, even one whose own slice is empty."""
    flag = torch.tensor(len(run.held_examples), device=run.accelerator.device)
    return bool(run.accelerator.reduce(flag, reduction="sum").item() > 0)


def read_distilled(path: Path) -> list[Conversation]:
    """The complete records of a distilled JSON-lines file, read line by line (not through the ``datasets`` cache:
    the file grows between reads, and every process must read the same records)."""
    report, conversations = ReadReport(), []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off by an interrupted write: distilled again on the next run
        conv = normalize_record(record, i, report)
        if conv is not None:
            conversations.append(conv)
    return conversations


def self_distill_split(config: TrainConfig, accelerator: Accelerator, model, tokenizer,
                       convs: list[Conversation], path: Path) -> list[Conversation]:
    """Distill the conversations of one split into ``path`` (resumable; each process answers a shard).

    Returns the conversations that already had base ids plus the distilled ones (those within the time budget).
    """
    have_ids = [c for c in convs if c.response_ids is not None]
    done = jsonl_ids(path)
    todo = [c for c in convs if c.response_ids is None and c.id not in done]
    rank, world = accelerator.process_index, accelerator.num_processes
    shard_path = path if world == 1 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    if todo:
        distill(model, tokenizer, todo[rank::world], shard_path, max_new_tokens=config.distill_max_new_tokens,
                max_prompt_tokens=config.distill_max_prompt_tokens, batch_size=config.distill_batch_size,
                time_limit_s=config.distill_time_limit_s)
    accelerator.wait_for_everyone()
    if world > 1 and accelerator.is_main_process:
        _merge_jsonl(path, sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}")))
    accelerator.wait_for_everyone()
    wanted = {c.id for c in convs}
    distilled = read_distilled(path) if jsonl_ids(path) & wanted else []
    return have_ids + [c for c in distilled if c.id in wanted]


def _merge_jsonl(path: Path, shards: list[Path]) -> None:
    """Append the complete, new records of each per-process shard to ``path``, then delete the shards."""
    done = jsonl_ids(path)
    with open(path, "a", encoding="utf-8") as out:
        for shard in shards:
            for line in shard.read_text(encoding="utf-8").splitlines():
                try:
                    record_id = json.loads(line)["id"]
                except (json.JSONDecodeError, KeyError):
                    continue
                if record_id not in done:
                    out.write(line + "\n")
                    done.add(record_id)
    for shard in shards:
        shard.unlink()


def tokenize_held_out(convs: list[Conversation], tokenizer, max_seq_len: int, fraction: float) -> list[dict]:
    """Held-out examples; an empty or unusable held-out split only disables evaluation (with a warning when
    ``fraction`` asked for one)."""
    if not convs:
        if fraction > 0:
            logger.warning("held_out_fraction=%g left no held-out conversation: evaluation is skipped", fraction)
        return []
    try:
        return tokenize_conversations(convs, tokenizer, max_seq_len)[0]
    except ValueError as e:
        logger.warning("held-out split unusable (%s): evaluation is skipped", e)
        return []


def head_target_totals(examples: list[dict], num_heads: int) -> list[int]:
    """Targets of each head in ``examples``: supervised labels at least ``head_target_offset(k)`` positions in.

    Targets outside a truncated head vocabulary are counted too (the vocabulary holds the most frequent ones).
    """
    totals = [0] * num_heads
    for example in examples:
        labels = example["labels"]
        supervised = len(labels) - labels.count(IGNORE_INDEX)
        for k in range(num_heads):
            totals[k] += supervised - sum(label != IGNORE_INDEX for label in labels[: head_target_offset(k)])
    return totals


def warn_heads_without_targets(totals: list[int]) -> None:
    """A warning when a head has no target in the training data: training is legal but leaves it untrained."""
    if not any(totals):
        logger.warning("no supervised token in the training data reaches any head (head k needs answer tokens at "
                       "least k + 2 positions into the sequence): the heads will keep their initial values")
        return
    empty = [k for k, total in enumerate(totals) if total == 0]
    if empty:
        logger.warning("heads %s have no target in the training data (answers too short): they will keep their "
                       "initial values", empty)


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


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The loop.


def fit(run: Run) -> list[float]:
    """Optimizer steps from ``run.step`` to ``max_steps`` with periodic logging, evaluation and checkpoints.

    Returns:
        The loss of each step run (summed over processes: the loss of the whole step), in order.
    """
    config, accelerator = run.config, run.accelerator
    batches = micro_batches(len(run.train_examples), config.batch_size, config.seed, accelerator.process_index,
                            accelerator.num_processes, start=run.step * config.grad_accum_steps,
                            accum=config.grad_accum_steps)
    progress = tqdm(total=config.max_steps, initial=run.step, desc="medusa heads",
                    disable=not accelerator.is_main_process)
    saved_at = run.step if latest_checkpoint(config.output_dir) else None
    losses = []
    while run.step < config.max_steps:
        losses.append(accelerator.reduce(train_step(run, batches), reduction="sum").item())
        run.step += 1
        progress.update(1)
        if run.step % config.log_every == 0 or run.step == config.max_steps:
            progress.set_postfix(loss=f"{losses[-1]:.4f}")
            logger.info("step %d loss %.6f lr %.6g", run.step, losses[-1], run.scheduler.get_last_lr()[0])
            accelerator.log({"train/loss": losses[-1], "train/lr": run.scheduler.get_last_lr()[0]}, step=run.step)
        periodic_eval = config.eval_every and run.step % config.eval_every == 0 and run.step < config.max_steps
        if periodic_eval and any_held_out(run):
            metrics = evaluate(run, max_batches=config.max_eval_batches)
            logger.info("step %d held-out %s", run.step, _format_metrics(metrics))
        if config.save_every and run.step % config.save_every == 0:
            save_checkpoint(run)
            saved_at = run.step
    progress.close()
    if saved_at != run.step:
        save_checkpoint(run)
    return losses


def train_step(run: Run, batches: Iterator[list[int]]) -> torch.Tensor:
    """One optimizer step over ``grad_accum_steps`` micro-batches; returns this process's share of the step loss.

    The loss is normalised by the targets of the whole step, counted over all micro-batches and processes before the
    first forward (:func:`step_loss`), so it equals the loss of one batch holding the whole step: splitting a step
    into micro-batches or processes changes neither the loss nor the gradient. The shares of all processes sum to the
    step loss (a detached scalar).
    """
    config, accelerator = run.config, run.accelerator
    run.heads.train()
    num_heads = accelerator.unwrap_model(run.heads).config.num_heads
    micro = [next(batches) for _ in range(config.grad_accum_steps)]
    collated = [_to_device(collate([run.train_examples[i] for i in indices], run.pad_id), accelerator.device)
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
    total = torch.zeros((), device=accelerator.device)
    for m, (indices, full, batch) in enumerate(zip(micro, collated, windows, strict=True)):
        hidden = batch_hidden_states(run, indices, full).float()  # (B, T, H); the heads' weights are fp32
        if starts[m] is not None:
            hidden = crop_window({"hidden": hidden}, starts[m], config.train_window)["hidden"]  # (B, W, H)
        last = m == config.grad_accum_steps - 1
        # Gradients are all-reduced once per optimizer step, on the last micro-batch.
        with nullcontext() if last else accelerator.no_sync(run.heads):
            logits = run.heads(hidden, batch["input_ids"])  # (K, B, T, Vh)
            loss = mixed_step_loss(run, logits, hidden, batch, global_counts, global_supervised)
            # DDP averages gradients over processes; the loss is already a share of the sum over all of them.
            accelerator.backward(loss * accelerator.num_processes)
        total += loss.detach()
    if config.max_grad_norm > 0:
        accelerator.clip_grad_norm_(run.heads.parameters(), config.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total


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
    chooses which targets a step sees (Medusa-1's base is frozen: nothing else depends on the rest of the row)."""
    if starts is None:
        return batch
    width = min(window, next(iter(batch.values())).shape[1])
    starts = [min(s, next(iter(batch.values())).shape[1] - width) for s in starts]

    def cut(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[row, s : s + width] for row, s in enumerate(starts)])

    return {name: cut(value) for name, value in batch.items()}


def teacher_logits(run: Run, hidden: torch.Tensor) -> torch.Tensor | None:
    """The base's own logits over the head vocabulary ``(B, T, Vh)`` from hidden states ``(B, T, H)`` (its lm_head
    rows of the token map, with its final soft-capping), or ``None`` when the loss needs no teacher."""
    if run.teacher_weight is None:
        return None
    with torch.no_grad():
        teacher = hidden.float() @ run.teacher_weight.float().T  # (B, T, Vh)
        cap = getattr(run.model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        return teacher if cap is None else torch.tanh(teacher / cap) * cap


def head_loss(run: Run, logits: torch.Tensor, hidden: torch.Tensor, batch: dict):
    """:func:`medusa.losses.medusa_loss` with the run's loss settings (evaluation: per-batch means and stats)."""
    config = run.config
    return medusa_loss(logits, batch["labels"], run.head_lookup, config.loss_decay,
                       teacher_logits=teacher_logits(run, hidden), loss_type=config.loss,
                       temperature=config.teacher_temperature, mix=config.loss_mix)


def mixed_step_loss(run: Run, logits: torch.Tensor, hidden: torch.Tensor, batch: dict, hard_counts: torch.Tensor,
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


@torch.no_grad()
def evaluate(run: Run, max_batches: int | None = None) -> dict:
    """Per-head top-1/top-5 accuracy and loss on the held-out examples, summed over all processes.

    Each process scores its own slice of the held-out split; counts are summed with ``accelerator.reduce``.

    Returns:
        ``{"examples", "loss", "heads": [{"head", "offset", "top1", "top5", "targets"}]}``; accuracies count
        targets outside a truncated head vocabulary as misses.
    """
    config, accelerator = run.config, run.accelerator
    heads = accelerator.unwrap_model(run.heads)
    heads.eval()
    mine = run.held_examples[accelerator.process_index :: accelerator.num_processes]
    starts = list(range(0, len(mine), config.batch_size))[:max_batches]
    totals: dict[str, torch.Tensor] = {}
    for start in starts:
        batch = _to_device(collate(mine[start : start + config.batch_size], run.pad_id), accelerator.device)
        hidden = base_hidden_states(run.model, batch["input_ids"], batch["attention_mask"])  # (B, T, H)
        with accelerator.autocast():
            logits = heads(hidden.float(), batch["input_ids"])  # (K, B, T, Vh); the heads' weights are fp32
        _, stats = head_loss(run, logits, hidden.float(), batch)
        for name, value in stats.items():
            totals[name] = totals.get(name, 0) + value
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
    return {"examples": int(totals["examples"].item()), "loss": round(loss, 6), "heads": heads}


def _flat_metrics(metrics: dict) -> dict:
    flat = {"loss": metrics["loss"]}
    for h in metrics["heads"]:
        flat[f"head{h['head']}_top1"], flat[f"head{h['head']}_top5"] = h["top1"], h["top5"]
    return flat


def _format_metrics(metrics: dict) -> str:
    if not metrics:
        return "(no held-out data)"
    heads = ", ".join(f"h{h['head']} {h['top1']:.3f}/{h['top5']:.3f}" for h in metrics["heads"])
    return f"loss {metrics['loss']:.4f}, top-1/top-5 {heads}"


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints.


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR / f"{CHECKPOINT_PREFIX}{step}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint (one with a trainer state file) with the highest step, or ``None``.

    Only folders named exactly ``step_N`` count: a checkpoint being written or deleted has a name starting with
    a dot (see :func:`save_checkpoint`) and is never picked up.
    """
    root = Path(output_dir) / CHECKPOINTS_DIR
    found = []
    for path in root.glob(f"{CHECKPOINT_PREFIX}*") if root.is_dir() else []:
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
        if match and (path / TRAINER_STATE_NAME).is_file():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def remove_unfinished_checkpoints(output_dir: str | Path) -> None:
    """Delete the hidden ``.step_N.*`` folders a killed run left behind (checkpoints half written or deleted)."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    for path in sorted(root.glob(f".{CHECKPOINT_PREFIX}*")) if root.is_dir() else []:
        logger.info("removing unfinished checkpoint folder %s", path)
        shutil.rmtree(path)


def read_checkpoint_state(checkpoint: Path, config: TrainConfig) -> dict:
    """The checkpoint's ``{"step", "micro_step", "num_processes", "config"}``.

    Raises:
        FileNotFoundError: the state file is missing.
        ValueError: the state file is not valid JSON or lacks a field, or the checkpoint was written with a config
            that differs from ``config`` in fields that change what is trained (all but
            :data:`train.config.RESUMABLE_FIELDS`); the message names the file or lists the fields.
    """
    path = checkpoint / TRAINER_STATE_NAME
    state = read_json(path, "trainer state")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("config"),
                                                                                                  dict):
        raise ValueError(f"trainer state {path} must be a JSON object with an integer 'step' and a 'config' object")
    problems = resume_mismatch(state["config"], config)
    if problems:
        raise ValueError(
            f"cannot resume from {checkpoint}: the config differs in fields that matter:\n  " + "\n  ".join(problems)
            + "\nrestore those values or choose another output_dir"
        )
    return state


def save_checkpoint(run: Run) -> Path:
    """Write ``checkpoints/step_N`` atomically and prune old ones.

    Everything is written into the hidden folder ``.step_N.tmp`` (each process adds its RNG state) and the trainer
    state last; one rename then makes the checkpoint visible. A process killed at any point leaves either the
    previous checkpoints or the new one complete, never a half-written ``step_N``. Checkpoints are taken between
    optimizer steps, so the gradient-accumulation position is always ``step * grad_accum_steps``.
    """
    accelerator, path = run.accelerator, checkpoint_dir(run.config.output_dir, run.step)
    tmp = path.with_name(f".{path.name}.tmp")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / RNG_STATE_NAME.format(rank=accelerator.process_index))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        save_heads(accelerator.unwrap_model(run.heads), tmp / HEADS_DIR, extra_config={"steps": run.step})
        torch.save(run.optimizer.state_dict(), tmp / OPTIMIZER_NAME)
        state = {"step": run.step, "micro_step": run.step * run.config.grad_accum_steps,
                 "num_processes": accelerator.num_processes, "config": run.config.to_dict()}
        (tmp / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")
        if path.exists():
            _remove_checkpoint(path)
        os.replace(tmp, path)
        _prune_checkpoints(path.parent, run.config.keep_checkpoints)
        logger.info("checkpoint saved: %s", path)
    accelerator.wait_for_everyone()
    return path


def rng_state() -> dict:
    """This process's Python, NumPy, torch (and CUDA) random states, in a form ``torch.load(weights_only)`` reads."""
    python_version, python_state, python_gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [python_version, list(python_state), python_gauss],
             "numpy": [name, keys.tolist(), pos, has_gauss, cached], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(checkpoint: Path, rank: int) -> None:
    """Set this process's random states to the ones saved in ``checkpoint`` (a warning when it has none for it).

    Raises:
        ValueError: the RNG state file is damaged (the message names it).
    """
    path = checkpoint / RNG_STATE_NAME.format(rank=rank)
    if not path.is_file():
        logger.warning("%s has no random state for process %d: random draws will differ from an uninterrupted run",
                       checkpoint, rank)
        return
    state = _torch_load(path, "random state")
    try:
        version, python_state, gauss = state["python"]
        random.setstate((version, tuple(python_state), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"random state {path} is damaged: {e}") from e


def _torch_load(path: Path, what: str):
    """``torch.load`` (tensors and plain containers only) with errors that name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError... for a damaged file
        raise ValueError(f"{what} {path} is damaged or not a torch file: {type(e).__name__}: {e}") from e


def _remove_checkpoint(path: Path) -> None:
    """Rename out of sight first, so a kill during the deletion never leaves a partial ``step_N``."""
    hidden = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(path, hidden)
    shutil.rmtree(hidden)


def _prune_checkpoints(root: Path, keep: int) -> None:
    if keep == 0:
        return
    steps = sorted(int(p.name[len(CHECKPOINT_PREFIX) :]) for p in root.glob(f"{CHECKPOINT_PREFIX}*")
                   if p.name[len(CHECKPOINT_PREFIX) :].isdigit())
    for step in steps[:-keep]:
        _remove_checkpoint(root / f"{CHECKPOINT_PREFIX}{step}")
