"""The run's conversations: loaded, split, self-distilled when asked (resumable, one shard per process), and
tokenised; warnings for heads the data leaves without targets."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from accelerate import Accelerator

from medusa.drafters.heads import IGNORE_INDEX, head_target_offset
from train.config import TrainConfig
from train.data import (
    Conversation,
    ReadReport,
    load_splits,
    normalize_record,
    tokenize_conversations,
)
from train.distill import (
    DEFAULT_PREFIX_LENGTHS,
    DISTILLED_HELD_OUT_NAME,
    DISTILLED_TRAIN_NAME,
    DISTILLED_VALIDATION_NAME,
    distill,
    jsonl_ids,
)

logger = logging.getLogger(__name__)


def prepare_conversations(config: TrainConfig, accelerator: Accelerator, model, tokenizer):
    """``(train, validation, held_out)`` conversations; self-distilled first when ``config.self_distill`` asks for
    it. The validation conversations that carry base ids are what the end of training calibrates the per-step tree
    on (:func:`validation_sequences`).

    The split is made on the source conversations (:func:`train.data.split_conversations`), so distilled held-out
    answers come from held-out prompts only. The validation split is never trained on; with ``self_distill`` its
    answers are written to ``distilled_validation.jsonl`` for ``medusa build-tree``. Records that already carry
    base token ids are used as they are.
    """
    train_convs, val_convs, held_convs = load_splits(config.data, config.max_conversations, config.data_sample,
                                                     config.held_out_fraction, config.validation_fraction,
                                                     config.seed)
    convs = train_convs + val_convs + held_convs
    if config.self_distill and any(c.response_ids is None for c in convs):
        out = Path(config.output_dir)
        splits = ((train_convs, DISTILLED_TRAIN_NAME), (val_convs, DISTILLED_VALIDATION_NAME),
                  (held_convs, DISTILLED_HELD_OUT_NAME))
        train_convs, val_convs, held_convs = (
            self_distill_split(config, accelerator, model, tokenizer, split, out / name) for split, name in splits
        )
    logger.info("%d train, %d validation (not trained on) and %d held-out conversations", len(train_convs),
                len(val_convs), len(held_convs))
    return train_convs, val_convs, held_convs


def validation_sequences(convs: list[Conversation]) -> list[tuple[list[int], int]]:
    """``(token_ids, response_start)`` of the validation conversations that carry the base's own token ids
    (self-distilled): what a calibration is measured on."""
    return [(c.prompt_ids + c.response_ids, len(c.prompt_ids)) for c in convs
            if c.prompt_ids is not None and c.response_ids]


def read_distilled(path: Path) -> list[Conversation]:
    """The complete records of a distilled JSON-lines file, read line by line (not through the ``datasets`` cache:
    the file grows between reads, and every process must read the same records)."""
    report, conversations = ReadReport(), []
    for i, line in enumerate(path.read_text(encoding="utf-8").split("\n")):  # not splitlines: U+2028 in a text
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
    """Distill the conversations of one split into ``path`` (resumable; the processes share the batches and the
    file is the one-process file, :func:`train.distill.distill`).

    Returns the conversations that already had base ids plus the distilled ones (those within the time budget).
    """
    have_ids = [c for c in convs if c.response_ids is not None]
    todo = [c for c in convs if c.response_ids is None]
    if todo:  # the same on every process: all or none of them take part
        distill(model, tokenizer, todo, path, max_new_tokens=config.distill_max_new_tokens,
                max_prompt_tokens=config.distill_max_prompt_tokens, batch_size=config.distill_batch_size,
                time_limit_s=config.distill_time_limit_s, turns=config.distill_turns, seed=config.seed,
                prefix_lengths=tuple(config.distill_prefix_lengths or DEFAULT_PREFIX_LENGTHS),
                accelerator=accelerator)
    wanted = {c.id for c in convs}
    distilled = read_distilled(path) if jsonl_ids(path) & wanted else []
    return have_ids + [c for c in distilled if c.id in wanted]


def tokenize_held_out(convs: list[Conversation], tokenizer, max_seq_len: int, fraction: float,
                      prefix_tokens: int = 0, min_tokens: int = 2) -> list[dict]:
    """Held-out examples; an empty or unusable held-out split only disables evaluation (with a warning when
    ``fraction`` asked for one)."""
    if not convs:
        if fraction > 0:
            logger.warning("held_out_fraction=%g left no held-out conversation: evaluation is skipped", fraction)
        return []
    try:
        return tokenize_conversations(convs, tokenizer, max_seq_len, prefix_tokens=prefix_tokens,
                                      min_tokens=min_tokens)[0]
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
