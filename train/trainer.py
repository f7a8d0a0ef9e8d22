"""Medusa-1 head training with Accelerate: frozen base, K heads trained on its last hidden states.

Medusa (Cai et al., 2024, section 2.2.1): the base model (embeddings and lm_head included) is frozen and runs under
``torch.no_grad``; only the heads train, on the loss of :mod:`medusa.losses`. Reading order:

``train`` -> ``setup`` (accelerator, base, data, heads, optimizer, resume) -> ``fit`` (the loop: ``train_step``,
``evaluate``, ``save_checkpoint``) -> final evaluation and ``save_heads``.

Only the heads go through ``accelerator.prepare`` (DDP wraps them alone); the base sits on ``accelerator.device``
as a plain module. A checkpoint is one folder ``checkpoints/step_N`` (heads, optimizer state, step, config),
written atomically; a run whose ``output_dir`` holds checkpoints resumes from the latest one.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from medusa.checkpoint import load_heads, save_heads
from medusa.heads import MedusaHeads, MedusaHeadsConfig, head_target_offset, lm_head_fingerprint, most_frequent_tokens
from medusa.losses import head_lookup_table, medusa_loss
from train.config import TrainConfig, resume_mismatch
from train.data import (
    Conversation,
    collate,
    load_conversations,
    split_held_out,
    target_token_counts,
    tokenize_conversations,
)
from train.distill import distill, jsonl_ids
from train.history import append_evaluation, write_curves

logger = logging.getLogger(__name__)

HEADS_DIR = "heads"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step_"
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
EVAL_NAME = "eval.json"
DISTILLED_TRAIN_NAME = "distilled_train.jsonl"
DISTILLED_HELD_OUT_NAME = "distilled_held_out.jsonl"


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
    step: int = 0
    hidden_cache: dict[int, torch.Tensor] | None = None
    """Example index -> its ``(T_i, H)`` bf16 hidden states, when ``config.cache_hidden_states``."""


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
    metrics = evaluate(run) if run.held_examples else {}
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
    checkpoint = latest_checkpoint(config.output_dir)
    state = read_checkpoint_state(checkpoint, config) if checkpoint else None
    model, tokenizer = prepare_base(config, accelerator, model, tokenizer)
    train_convs, held_convs = prepare_conversations(config, accelerator, model, tokenizer)
    train_examples, _ = tokenize_conversations(train_convs, tokenizer, config.max_seq_len)
    held_examples = tokenize_held_out(held_convs, tokenizer, config.max_seq_len)
    lm_head = model.get_output_embeddings().weight  # (V, H)
    if checkpoint:
        heads = load_heads(checkpoint / HEADS_DIR, lm_head)
    else:
        heads = build_heads(config, lm_head, train_examples, eos_ids(model, tokenizer))
    optimizer = make_optimizer(heads, config)
    heads, optimizer = accelerator.prepare(heads, optimizer)
    step = state["step"] if state else 0
    if checkpoint:
        optimizer.load_state_dict(torch.load(checkpoint / OPTIMIZER_NAME, map_location="cpu", weights_only=True))
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
    return Run(config, accelerator, model, heads, optimizer, scheduler, train_examples, held_examples, lookup,
               pad_id, step=step, hidden_cache={} if config.cache_hidden_states else None)


def make_accelerator(config: TrainConfig) -> Accelerator:
    """The run's Accelerator: mixed precision, tracker, and DDP that does not re-broadcast the heads' buffers.

    Accelerate turns a multi-process launch into CPU DDP (gloo) only when asked for CPU, and ``accelerate launch
    --multi_gpu`` / ``torchrun`` do not say so: a multi-process launch on a machine without CUDA runs on CPU.
    """
    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(config.tracker)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ImportError(f'tracker="{config.tracker}" needs the {module} package: pip install -e ".[tracking]"')
    if config.tracker == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    cpu = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    # The shared lm_head rows and token map are constant buffers: broadcasting them every forward is wasted traffic.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    return Accelerator(cpu=cpu, mixed_precision=resolve_mixed_precision(config.mixed_precision),
                       log_with=None if config.tracker == "none" else config.tracker,
                       project_dir=str(Path(config.output_dir) / "runs"), kwargs_handlers=[ddp])


def describe_processes(accelerator: Accelerator) -> str:
    """``"1 process"`` or, e.g., ``"2 processes (DDP on CPU)"``, for the log."""
    n = accelerator.num_processes
    if n == 1:
        return "1 process"
    kind = {"MULTI_CPU": "DDP on CPU", "MULTI_GPU": "DDP on GPUs"}.get(accelerator.distributed_type.value,
                                                                       accelerator.distributed_type.value)
    return f"{n} processes ({kind})"


def resolve_mixed_precision(value: str) -> str:
    """``"auto"`` -> ``"bf16"`` on a CUDA device that supports it, else ``"no"``; other values unchanged."""
    if value != "auto":
        return value
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


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


def base_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``(B, T, H)`` (after the final norm) of the frozen base; no logits are computed.

    ``get_decoder()`` is the inner transformer (``LlamaModel``, ``GPT2Model``...) in transformers 5.x.
    """
    with torch.no_grad():
        out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state  # (B, T, H)


def batch_hidden_states(run: Run, indices: list[int], batch: dict) -> torch.Tensor:
    """Base hidden states ``(B, T, H)`` for a micro-batch, from ``run.hidden_cache`` when every example is in it.

    Without a cache this is :func:`base_hidden_states`. With one, a batch holding any new example runs the base and
    stores each example's unpadded states (bf16, CPU); a fully cached batch is re-padded with zeros (padding
    positions carry no label).
    """
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


def build_heads(config: TrainConfig, lm_head: torch.Tensor, examples: list[dict], always: list[int]) -> MedusaHeads:
    """Fresh heads over the base's lm_head ``(V, H)``, with a token map of the most frequent training targets."""
    vocab, hidden = lm_head.shape
    head_vocab = config.head_vocab_size if config.head_vocab_size and config.head_vocab_size < vocab else None
    token_map = None
    if head_vocab is not None:
        counts = target_token_counts(examples, vocab)  # (V,)
        token_map = most_frequent_tokens(counts, head_vocab, always=[i for i in always if i < vocab])
    heads_config = MedusaHeadsConfig(
        hidden_size=hidden, vocab_size=vocab, num_heads=config.num_heads, num_layers=config.num_layers,
        head_vocab_size=head_vocab, share_lm_head=config.share_lm_head, base_model_name_or_path=config.base,
        lm_head_fingerprint=lm_head_fingerprint(lm_head),
    )
    return MedusaHeads(heads_config, lm_head, token_map)


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
    distilled = load_conversations(path)[0] if jsonl_ids(path) & wanted else []
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


def tokenize_held_out(convs: list[Conversation], tokenizer, max_seq_len: int) -> list[dict]:
    """Held-out examples; an empty or unusable held-out split only disables evaluation (with a warning)."""
    if not convs:
        logger.warning("no held-out conversations: evaluation is skipped")
        return []
    try:
        return tokenize_conversations(convs, tokenizer, max_seq_len)[0]
    except ValueError as e:
        logger.warning("held-out split unusable (%s): evaluation is skipped", e)
        return []


def micro_batches(num_examples: int, batch_size: int, seed: int, rank: int, world: int,
                  start: int = 0) -> Iterator[list[int]]:
    """Endless example indices of this process's micro-batches, from global micro-step ``start`` on.

    Each epoch is a permutation seeded by ``(seed, epoch)``, wrapped around to whole global batches so every process
    gets the same number of micro-batches; the order depends only on the step, so a resumed run continues it.
    """
    global_batch = batch_size * world
    per_epoch = max(1, math.ceil(num_examples / global_batch))
    epoch, index = divmod(start, per_epoch)
    while True:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(num_examples, generator=generator).tolist()
        order = (order * math.ceil(per_epoch * global_batch / num_examples))[: per_epoch * global_batch]
        for b in range(index, per_epoch):
            first = b * global_batch + rank * batch_size
            yield order[first : first + batch_size]
        epoch, index = epoch + 1, 0


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The loop.


def fit(run: Run) -> None:
    """Optimizer steps from ``run.step`` to ``max_steps`` with periodic logging, evaluation and checkpoints."""
    config, accelerator = run.config, run.accelerator
    batches = micro_batches(len(run.train_examples), config.batch_size, config.seed, accelerator.process_index,
                            accelerator.num_processes, start=run.step * config.grad_accum_steps)
    progress = tqdm(total=config.max_steps, initial=run.step, desc="medusa heads",
                    disable=not accelerator.is_main_process)
    saved_at = run.step if latest_checkpoint(config.output_dir) else None
    while run.step < config.max_steps:
        loss = train_step(run, batches)
        run.step += 1
        progress.update(1)
        if run.step % config.log_every == 0 or run.step == config.max_steps:
            mean_loss = accelerator.reduce(loss, reduction="mean").item()
            progress.set_postfix(loss=f"{mean_loss:.4f}")
            accelerator.log({"train/loss": mean_loss, "train/lr": run.scheduler.get_last_lr()[0]}, step=run.step)
        periodic_eval = config.eval_every and run.step % config.eval_every == 0 and run.step < config.max_steps
        if periodic_eval and run.held_examples:
            metrics = evaluate(run, max_batches=config.max_eval_batches)
            logger.info("step %d held-out %s", run.step, _format_metrics(metrics))
        if config.save_every and run.step % config.save_every == 0:
            save_checkpoint(run)
            saved_at = run.step
    progress.close()
    if saved_at != run.step:
        save_checkpoint(run)


def train_step(run: Run, batches: Iterator[list[int]]) -> torch.Tensor:
    """One optimizer step over ``grad_accum_steps`` micro-batches; returns the mean loss (a detached scalar)."""
    config, accelerator = run.config, run.accelerator
    run.heads.train()
    total = torch.zeros((), device=accelerator.device)
    for micro in range(config.grad_accum_steps):
        indices = next(batches)
        batch = _to_device(collate([run.train_examples[i] for i in indices], run.pad_id), accelerator.device)
        hidden = batch_hidden_states(run, indices, batch)  # (B, T, H)
        last = micro == config.grad_accum_steps - 1
        # Gradients are all-reduced once per optimizer step, on the last micro-batch.
        with nullcontext() if last else accelerator.no_sync(run.heads):
            logits = run.heads(hidden)  # (K, B, T, Vh)
            loss, _ = medusa_loss(logits, batch["labels"], run.head_lookup, config.loss_decay)
            accelerator.backward(loss / config.grad_accum_steps)
        total += loss.detach() / config.grad_accum_steps
    if config.max_grad_norm > 0:
        accelerator.clip_grad_norm_(run.heads.parameters(), config.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total


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
            logits = heads(hidden)  # (K, B, T, Vh)
        _, stats = medusa_loss(logits, batch["labels"], run.head_lookup, config.loss_decay)
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
    """The complete checkpoint (one with a trainer state file) with the highest step, or ``None``."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    found = []
    for path in root.glob(f"{CHECKPOINT_PREFIX}*") if root.is_dir() else []:
        match = re.fullmatch(rf"{CHECKPOINT_PREFIX}(\d+)", path.name)
        if match and (path / TRAINER_STATE_NAME).is_file():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None


def read_checkpoint_state(checkpoint: Path, config: TrainConfig) -> dict:
    """The checkpoint's ``{"step", "config"}``.

    Raises:
        ValueError: the checkpoint was written with a config that differs from ``config`` in fields that change
            what is trained (all but :data:`train.config.RESUMABLE_FIELDS`); the message lists them.
    """
    state = json.loads((checkpoint / TRAINER_STATE_NAME).read_text())
    problems = resume_mismatch(state["config"], config)
    if problems:
        raise ValueError(
            f"cannot resume from {checkpoint}: the config differs in fields that matter:\n  " + "\n  ".join(problems)
            + "\nrestore those values or choose another output_dir"
        )
    return state


def save_checkpoint(run: Run) -> Path:
    """Write ``checkpoints/step_N`` atomically (temporary folder renamed into place) and prune old ones."""
    accelerator, path = run.accelerator, checkpoint_dir(run.config.output_dir, run.step)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        save_heads(accelerator.unwrap_model(run.heads), tmp / HEADS_DIR, extra_config={"steps": run.step})
        torch.save(run.optimizer.state_dict(), tmp / OPTIMIZER_NAME)
        state = {"step": run.step, "config": run.config.to_dict()}
        (tmp / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        _prune_checkpoints(path.parent, run.config.keep_checkpoints)
        logger.info("checkpoint saved: %s", path)
    accelerator.wait_for_everyone()
    return path


def _prune_checkpoints(root: Path, keep: int) -> None:
    if keep == 0:
        return
    steps = sorted(int(p.name[len(CHECKPOINT_PREFIX) :]) for p in root.glob(f"{CHECKPOINT_PREFIX}*")
                   if p.name[len(CHECKPOINT_PREFIX) :].isdigit())
    for step in steps[:-keep]:
        shutil.rmtree(root / f"{CHECKPOINT_PREFIX}{step}")
