"""Distilling a separate draft model toward the base (``head_type: draft_model``).

Classic speculative decoding is as fast as its draft q agrees with the target p (Leviathan et al. 2023, section
3.5: the expected tokens per round grow with the acceptance rate alpha, which is ``1 - E[TV(p, q)]``). A draft cut
from the base itself (its first N layers, ``medusa make-draft``; LayerSkip's early exit, Elhoushi et al. 2024)
agrees with it almost never before training; DistillSpec (Zhou et al. 2024, section 3) distils the draft toward the
target's own distribution, which is what raises alpha. Here the draft's layers (and final norm) learn
``KL(p_base || q_draft)`` at every supervised next-token position of the data (``loss: teacher``; ``hard`` and
``mixed`` add the data's tokens), the base frozen under ``no_grad``; the draft's embeddings and lm_head stay the
base's (tied and frozen), so its vocabulary is the base's by construction.

A truncated draft vocabulary (``head_vocab_size``: the most frequent training targets, always with EOS) makes the
draft's lm_head that many rows: on a small base the lm_head is much of a one-token forward, so this is the lever on
c_q / c_p. The teacher is then renormalised over the same rows, and the folder carries ``draft_vocab.json``
(:data:`medusa.drafters.draft_model.DRAFT_VOCAB_FILE`), which the drafter reads.

Runs through Accelerate like head training (one process, DDP, mixed precision): only the draft is prepared, the base
sits on the device. A checkpoint ``checkpoints/step_N`` holds the draft folder, the optimizer state, each process's
random state and the step, written atomically; a run resumes from the latest one. The result,
``output_dir/draft``, is an ordinary Hugging Face model folder (with the base's tokenizer) that
``medusa generate/bench --draft-model`` loads; ``eval.json`` holds the held-out KL and top-1 agreement (greedy
alpha on the data) before and after training.

Reading order: :func:`train_draft_model` -> :func:`setup_draft_run` -> :func:`draft_step` (-> :func:`draft_loss`)
-> :func:`evaluate_draft` -> :func:`save_draft_folder`.
"""

from __future__ import annotations

import copy
import json
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from medusa.base import base_states, stop_token_ids
from medusa.drafters.draft_model import DRAFT_VOCAB_FILE, check_vocabularies
from medusa.drafters.heads import IGNORE_INDEX, head_lookup_table, most_frequent_tokens
from medusa.engines.kv_cache import decoder_of, soft_cap
from medusa.io.files import atomic_folder
from medusa.losses import soft_cross_entropy
from medusa.tools.make_draft import cut_layers
from train.checkpoints import (
    CHECKPOINTS_DIR,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    TRAINER_STATE_NAME,
    _prune_checkpoints,
    checkpoint_dir,
    latest_checkpoint,
    load_torch_file,
    read_checkpoint_state,
    remove_unfinished_checkpoints,
    restore_rng_state,
    rng_state,
)
from train.config import TrainConfig
from train.conversations import prepare_conversations, tokenize_held_out
from train.data import collate, default_tokenize_cache_dir, target_token_counts, to_device, tokenize_conversations
from train.loop import step_loop
from train.run import end_run

logger = logging.getLogger(__name__)

DRAFT_DIR = "draft"
"""The distilled draft model folder in ``output_dir`` (and in each checkpoint)."""
EVAL_NAME = "eval.json"


class DraftStudent(nn.Module):
    """The draft model being distilled, with the rows of its lm_head it drafts from.

    Args:
        model: the draft ``*ForCausalLM``; its input embeddings and lm_head are frozen here (the base's own).
        token_map: ``(Vd,)`` base ids of the draft vocabulary, or ``None`` for all of the lm_head's rows.
    """

    def __init__(self, model, token_map: torch.Tensor | None = None):
        super().__init__()
        self.model = model
        self.register_buffer("token_map", token_map, persistent=False)
        model.requires_grad_(True)
        model.get_input_embeddings().requires_grad_(False)
        model.get_output_embeddings().requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
        """Draft logits ``(N, Vd)`` (soft-capped as the model does) at the ``N`` positions where ``select`` ``(B, T)``
        is true, from ``input_ids`` / ``attention_mask`` ``(B, T)``."""
        out = decoder_of(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = out.last_hidden_state[select]  # (N, H)
        weight = self.model.get_output_embeddings().weight  # (V, H)
        weight = weight if self.token_map is None else weight[self.token_map]  # (Vd, H)
        return soft_cap(self.model, hidden @ weight.t().to(hidden.dtype))  # (N, Vd)


@dataclass
class DraftRun:
    """Everything the draft's distillation shares, built once by :func:`setup_draft_run`."""

    config: TrainConfig
    accelerator: object
    base: nn.Module
    student: nn.Module
    """The prepared :class:`DraftStudent` (wrapped by DDP in a multi-process run)."""
    optimizer: torch.optim.Optimizer
    scheduler: object
    tokenizer: object
    train_examples: list[dict]
    held_examples: list[dict]
    teacher_weight: torch.Tensor
    """``(Vd, H)`` the base's lm_head rows of the draft vocabulary."""
    draft_lookup: torch.Tensor | None
    """``(V,)`` base id -> draft vocabulary index (``IGNORE_INDEX`` outside it), or ``None``: the full vocabulary."""
    pad_id: int
    step: int = 0
    hidden_cache: dict[int, torch.Tensor] | None = None


def train_draft_model(config: TrainConfig, model=None, tokenizer=None) -> Path:
    """Distil a draft model toward the frozen base as ``config`` says; write it to ``output_dir/draft``.

    Args:
        config: a run configuration with ``head_type: draft_model``.
        model, tokenizer: an already loaded base (frozen in place) and its tokenizer, instead of ``config.base``.

    Returns:
        The draft folder (an ordinary Hugging Face causal-LM folder; ``draft_vocab.json`` beside it when the draft
        vocabulary is truncated).

    Raises:
        ValueError: no data to train on, a ``draft_init`` with another vocabulary (first differing id named),
            ``draft_layers`` not below the base's layer count, or a checkpoint written with another config.
    """
    run = setup_draft_run(config, model, tokenizer)
    before = evaluate_draft(run) if run.step == 0 and run.held_examples else None
    fit_draft(run)
    after = evaluate_draft(run) if run.held_examples else {}
    out = Path(config.output_dir)
    state = run.accelerator.get_state_dict(run.student)  # every process: a collective when sharded
    if run.accelerator.is_main_process:
        student = run.accelerator.unwrap_model(run.student)
        save_draft_folder(student.model, run.tokenizer, student.token_map, out / DRAFT_DIR, state)
        metrics = {"steps": run.step, "held_out": after, **({"held_out_before": before} if before else {})}
        (out / EVAL_NAME).write_text(json.dumps(metrics, indent=2) + "\n")
        logger.info("draft model written to %s; held-out %s%s", out / DRAFT_DIR, format_draft_metrics(after),
                    f" (before training: {format_draft_metrics(before)})" if before else "")
    del state  # so that nothing of the run outlives end_run
    end_run(run)
    return out / DRAFT_DIR


def setup_draft_run(config: TrainConfig, model=None, tokenizer=None) -> DraftRun:
    """Accelerator, frozen base, tokenised data, the draft (from the latest checkpoint, ``draft_init`` or the
    base's first ``draft_layers`` layers), its vocabulary, optimizer and schedule."""
    from transformers import get_cosine_schedule_with_warmup

    from train.setup import make_accelerator, make_optimizer, prepare_base

    accelerator = make_accelerator(config)
    torch.manual_seed(config.seed)
    if accelerator.is_main_process:
        remove_unfinished_checkpoints(config.output_dir)
    checkpoint = latest_checkpoint(config.output_dir)
    state = read_checkpoint_state(checkpoint, config) if checkpoint else None
    model, tokenizer = prepare_base(config, accelerator, model, tokenizer)
    draft = initial_draft(config, model, tokenizer, checkpoint)  # refused before any data work
    train_convs, _, held_convs = prepare_conversations(config, accelerator, model, tokenizer)
    train_examples, _ = tokenize_conversations(train_convs, tokenizer, config.max_seq_len, config.num_proc,
                                               default_tokenize_cache_dir(), config.text_prefix_tokens)
    if not train_examples:
        raise ValueError("the data holds no supervised tokens to distil the draft on")
    held_examples = tokenize_held_out(held_convs, tokenizer, config.max_seq_len, config.held_out_fraction,
                                      config.text_prefix_tokens)
    lm_head = model.get_output_embeddings().weight.detach()  # (V, H)
    token_map = draft_token_map(config, checkpoint, train_examples, lm_head.shape[0],
                                sorted(stop_token_ids(model.generation_config, tokenizer)))
    student = DraftStudent(draft.to(accelerator.device), token_map)
    optimizer = make_optimizer(student, config)
    student, optimizer = accelerator.prepare(student, optimizer)
    step = state["step"] if state else 0
    if checkpoint:
        optimizer.load_state_dict(load_torch_file(checkpoint / OPTIMIZER_NAME, "optimizer state"))
        restore_rng_state(checkpoint, accelerator.process_index)
        logger.info("resuming the draft's distillation from step %d (%s)", step, checkpoint)
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.max_steps, last_epoch=step - 1)
    teacher_weight = lm_head if token_map is None else lm_head[token_map.to(lm_head.device)]  # (Vd, H)
    lookup = head_lookup_table(token_map, lm_head.shape[0])
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    if config.tracker != "none":
        accelerator.init_trackers("medusa_draft", config={k: str(v) for k, v in config.to_dict().items()})
    return DraftRun(config, accelerator, model, student, optimizer, scheduler, tokenizer, train_examples,
                    held_examples, teacher_weight, None if lookup is None else lookup.to(accelerator.device), pad_id,
                    step, {} if config.cache_hidden_states else None)


def initial_draft(config: TrainConfig, base, tokenizer, checkpoint: Path | None):
    """The draft training starts from, in fp32: the checkpoint's, else ``config.draft_init`` (its vocabulary
    checked against the base's), else a copy of the base cut to its first ``config.draft_layers`` layers.

    Raises:
        FileNotFoundError: a ``draft_init`` folder without ``config.json``.
        ValueError: another vocabulary (first differing id named), or ``draft_layers`` not below the base's count.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = checkpoint / DRAFT_DIR if checkpoint else config.draft_init
    if source is None:
        draft = cut_layers(copy.deepcopy(base), config.draft_layers, "draft_layers")
        logger.info("draft: the base's first %d decoder layers (embeddings, final norm and lm_head kept)",
                    config.draft_layers)
        return draft.float().requires_grad_(True)
    if not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"draft_init folder {source} does not exist or has no config.json")
    draft = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    try:
        draft_tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError):
        draft_tokenizer = None
    check_vocabularies(tokenizer, draft_tokenizer, base.get_output_embeddings().weight.shape[0],
                       draft.get_output_embeddings().weight.shape[0])
    logger.info("draft initialised from %s", source)
    return draft


def draft_token_map(config: TrainConfig, checkpoint: Path | None, examples: list[dict], vocab: int,
                    always: list[int]) -> torch.Tensor | None:
    """``(Vd,)`` base ids of a truncated draft vocabulary (the checkpoint's, else the ``head_vocab_size`` most
    frequent training targets, with ``always``), or ``None`` for the full vocabulary."""
    stored = checkpoint / DRAFT_DIR / DRAFT_VOCAB_FILE if checkpoint else None
    if stored is not None and stored.is_file():
        return torch.tensor(json.loads(stored.read_text())["token_map"], dtype=torch.long)
    if not config.head_vocab_size or config.head_vocab_size >= vocab:
        return None
    return most_frequent_tokens(target_token_counts(examples, vocab), config.head_vocab_size,
                                always=[i for i in always if i < vocab])


def next_token_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: the positions whose next token is supervised (the draft at t predicts token t + 1)."""
    select = torch.zeros_like(labels, dtype=torch.bool)
    select[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return select


def draft_loss(run: DraftRun, batch: dict, teacher_hidden: torch.Tensor, select: torch.Tensor) -> tuple:
    """Summed loss terms of one micro-batch: ``(soft, hard, hard_count)``.

    ``soft`` is the summed soft cross-entropy to the base's distribution at temperature ``teacher_temperature``
    (KL(p || q) plus p's entropy, a constant: the same gradient) over the ``N`` selected positions; ``hard`` the
    summed cross-entropy of the data's next token where it lies in the draft vocabulary (``hard_count`` of them).

    Args:
        batch: collated ``input_ids`` / ``attention_mask`` / ``labels`` ``(B, T)``.
        teacher_hidden: ``(B, T, H)`` the base's last hidden states.
        select: ``(B, T)`` bool, :func:`next_token_positions`.
    """
    config = run.config
    logits = run.student(batch["input_ids"], batch["attention_mask"], select)  # (N, Vd)
    zero = logits.new_zeros((), dtype=torch.float32)
    soft = hard = zero
    count = torch.zeros((), dtype=torch.long, device=logits.device)
    if config.loss != "hard":
        teacher = teacher_logits(run, teacher_hidden[select])  # (N, Vd)
        soft = soft_cross_entropy(logits, teacher, config.teacher_temperature).sum()
    if config.loss != "teacher":
        targets = batch["labels"][:, 1:][select[:, :-1]]  # (N,) base ids of the next tokens
        targets = targets if run.draft_lookup is None else run.draft_lookup[targets]
        inside = targets != IGNORE_INDEX
        count = inside.sum()
        if count:
            hard = nn.functional.cross_entropy(logits[inside].float(), targets[inside], reduction="sum")
    return soft, hard, count


def teacher_logits(run: DraftRun, hidden: torch.Tensor) -> torch.Tensor:
    """The base's logits ``(N, Vd)`` over the draft vocabulary from its last hidden states ``(N, H)``."""
    with torch.no_grad():
        return soft_cap(run.base, hidden.float() @ run.teacher_weight.float().t())


def teacher_hidden_states(run: DraftRun, indices: list[int], batch: dict) -> torch.Tensor:
    """The base's last hidden states ``(B, T, H)`` of a micro-batch (without gradient): computed, or read from
    ``run.hidden_cache`` (``cache_hidden_states``) when every example is there."""
    cache = run.hidden_cache
    if cache is None or any(i not in cache for i in indices):
        hidden = base_states(run.base, batch["input_ids"], batch["attention_mask"])  # (B, T, H)
        if cache is not None:
            for row, (i, n) in enumerate(zip(indices, batch["attention_mask"].sum(dim=1).tolist(), strict=True)):
                cache[i] = hidden[row, :n].to("cpu", torch.bfloat16)
        return hidden
    hidden = torch.zeros(*batch["input_ids"].shape, cache[indices[0]].shape[-1],
                         device=batch["input_ids"].device)  # (B, T, H)
    for row, i in enumerate(indices):
        hidden[row, : len(cache[i])] = cache[i].to(hidden.device, torch.float32)
    return hidden


def fit_draft(run: DraftRun) -> list[float]:
    """Optimizer steps from ``run.step`` to ``max_steps`` (:func:`train.loop.step_loop`, as head training) with
    logging, held-out evaluation and checkpoints; returns the step losses (summed over processes)."""
    def held_out(r):
        if not r.held_examples:
            return None
        metrics = evaluate_draft(r, r.config.max_eval_batches)
        r.accelerator.log({f"eval/{k}": v for k, v in metrics.items()}, step=r.step)
        return metrics, format_draft_metrics(metrics)

    return step_loop(run, draft_step, held_out, save_draft_checkpoint, "draft model")


def draft_step(run: DraftRun, batches) -> torch.Tensor:
    """One optimizer step over ``grad_accum_steps`` micro-batches; returns this process's share of the step loss.

    Each term is normalised by its target count over the whole step (all micro-batches and processes, counted before
    the first forward), so the step's loss and gradient do not depend on how it is split.
    """
    config, accelerator = run.config, run.accelerator
    run.student.train()
    micro = [next(batches) for _ in range(config.grad_accum_steps)]
    collated = [to_device(collate([run.train_examples[i] for i in m], run.pad_id), accelerator.device) for m in micro]
    selects = [next_token_positions(b["labels"]) for b in collated]
    soft_count = accelerator.reduce(sum(s.sum() for s in selects), reduction="sum").clamp_min(1)
    hard_count = soft_count
    if config.loss != "teacher":
        hard_count = accelerator.reduce(sum(hard_targets_inside(run, b, s) for b, s in zip(collated, selects,
                                                                                            strict=True)),
                                        reduction="sum").clamp_min(1)
    hard_weight = {"hard": 1.0, "teacher": 0.0, "mixed": config.loss_mix}[config.loss]
    total = torch.zeros((), device=accelerator.device)
    for m, (indices, batch, select) in enumerate(zip(micro, collated, selects, strict=True)):
        teacher = teacher_hidden_states(run, indices, batch)  # (B, T, H)
        last = m == config.grad_accum_steps - 1
        with nullcontext() if last else accelerator.no_sync(run.student):
            with accelerator.autocast():
                soft, hard, _ = draft_loss(run, batch, teacher, select)
            loss = (1 - hard_weight) * soft / soft_count + hard_weight * hard / hard_count
            accelerator.backward(loss * accelerator.num_processes)  # DDP averages; the loss is already a share
        total += loss.detach()
    if config.max_grad_norm > 0:
        accelerator.clip_grad_norm_(run.student.parameters(), config.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return total


def hard_targets_inside(run: DraftRun, batch: dict, select: torch.Tensor) -> torch.Tensor:
    """How many selected positions' next tokens lie in the draft vocabulary (the hard term's targets)."""
    targets = batch["labels"][:, 1:][select[:, :-1]]  # (N,)
    return select.sum() if run.draft_lookup is None else (run.draft_lookup[targets] != IGNORE_INDEX).sum()


@torch.no_grad()
def evaluate_draft(run: DraftRun, max_batches: int | None = None) -> dict:
    """Held-out ``{"kl", "top1_agreement", "positions"}``: the mean KL(p_base || q_draft) in nats over the draft
    vocabulary (teacher temperature 1), and how often the draft's argmax is the base's argmax over the base's whole
    vocabulary (greedy decoding's acceptance rate alpha on the data), over every supervised next-token position of
    the held-out split (summed over processes)."""
    config, accelerator = run.config, run.accelerator
    student = accelerator.unwrap_model(run.student)
    was_training = student.training
    student.eval()
    rank, world = accelerator.process_index, accelerator.num_processes
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # kl, agree, positions
    full_head = run.base.get_output_embeddings().weight  # (V, H)
    for b, first in enumerate(range(rank * config.batch_size, len(run.held_examples), world * config.batch_size)):
        if max_batches is not None and b >= max_batches:
            break
        batch = to_device(collate(run.held_examples[first : first + config.batch_size], run.pad_id),
                          accelerator.device)
        select = next_token_positions(batch["labels"])
        hidden = base_states(run.base, batch["input_ids"], batch["attention_mask"])[select].float()  # (N, H)
        q = student(batch["input_ids"], batch["attention_mask"], select).float()  # (N, Vd)
        p = teacher_logits(run, hidden)  # (N, Vd)
        log_p, log_q = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
        drafted = q.argmax(-1) if student.token_map is None else student.token_map[q.argmax(-1)]  # (N,) base ids
        base_top = soft_cap(run.base, hidden @ full_head.float().t()).argmax(-1)  # (N,)
        totals += torch.stack([(log_p.exp() * (log_p - log_q)).sum().double(),
                               (drafted == base_top).sum().double(), torch.tensor(len(q), dtype=torch.float64,
                                                                                 device=q.device)])
    student.train(was_training)
    totals = accelerator.reduce(totals, reduction="sum")
    n = max(float(totals[2]), 1.0)
    return {"kl": float(totals[0]) / n, "top1_agreement": float(totals[1]) / n, "positions": int(totals[2])}


def format_draft_metrics(metrics: dict) -> str:
    if not metrics:
        return "(no held-out split)"
    return (f"KL(p||q) {metrics['kl']:.4f} nats, top-1 agreement {metrics['top1_agreement']:.4f} over "
            f"{metrics['positions']} positions")


def save_draft_folder(model, tokenizer, token_map: torch.Tensor | None, out_dir: Path,
                      state_dict: dict | None = None) -> Path:
    """Write the draft as an ordinary Hugging Face folder (weights, config, the base's tokenizer) with its
    ``draft_vocab.json`` when the vocabulary is truncated, atomically (an earlier folder stays until the new one is
    complete). ``state_dict``: the :class:`DraftStudent`'s (gathered under sharding), else the model's own."""
    if state_dict is not None:
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items() if k.startswith("model.")}
    with atomic_folder(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if token_map is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_map": token_map.tolist()}) + "\n")
    return out_dir


def save_draft_checkpoint(run: DraftRun) -> Path:
    """``checkpoints/step_N``: the draft folder, the optimizer state, each process's random state and the trainer
    state (written last), made visible by one rename; older checkpoints pruned to ``keep_checkpoints``."""
    accelerator, path = run.accelerator, checkpoint_dir(run.config.output_dir, run.step)
    accelerator.wait_for_everyone()
    main = accelerator.is_main_process
    with atomic_folder(path, tmp=path.with_name(f".{path.name}.tmp"), swap=main) as tmp:
        accelerator.wait_for_everyone()
        torch.save(rng_state(), tmp / RNG_STATE_NAME.format(rank=accelerator.process_index))
        state = accelerator.get_state_dict(run.student)
        if main:
            student = accelerator.unwrap_model(run.student)
            save_draft_folder(student.model, run.tokenizer, student.token_map, tmp / DRAFT_DIR, state)
            torch.save(run.optimizer.state_dict(), tmp / OPTIMIZER_NAME)
            trainer_state = {"step": run.step, "micro_step": run.step * run.config.grad_accum_steps,
                             "num_processes": accelerator.num_processes, "config": run.config.to_dict()}
            (tmp / TRAINER_STATE_NAME).write_text(json.dumps(trainer_state, indent=2) + "\n")
        accelerator.wait_for_everyone()
    if main:
        _prune_checkpoints(Path(run.config.output_dir) / CHECKPOINTS_DIR, run.config.keep_checkpoints)
        logger.info("checkpoint saved: %s", path)
    accelerator.wait_for_everyone()
    return path
