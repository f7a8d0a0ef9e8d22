"""The splits the ``distill`` and ``held-out-prompts`` commands read: a dataset's train / validation / held-out
conversations (:func:`distill_splits_of`), and the held-out split's first prompts as JSON-lines records
(:func:`held_out_prompt_records`). Settings left ``None`` take :class:`train.config.TrainConfig`'s defaults, so the
splits are the ones a training run with the same settings makes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from train.config import TrainConfig
from train.data import (
    document_prefix_text,
    first_prompt,
    load_conversations,
    load_splits,
    split_conversations,
    split_held_out,
)

DISTILL_SPLITS = ("validation", "held-out", "train")
"""The splits ``distill`` writes, in the order it writes them."""


def split_file(out_dir: str | Path, split: str) -> Path:
    """The file ``distill`` writes a split's answers to, in ``out_dir``."""
    from train.distill import DISTILLED_HELD_OUT_NAME, DISTILLED_TRAIN_NAME, DISTILLED_VALIDATION_NAME

    names = {"validation": DISTILLED_VALIDATION_NAME, "held-out": DISTILLED_HELD_OUT_NAME,
             "train": DISTILLED_TRAIN_NAME}
    return Path(out_dir) / names[split]


def train_default(field: str, given=None):
    """``given``, or :class:`train.config.TrainConfig`'s default for ``field`` when ``given`` is ``None``."""
    if given is not None:
        return given
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}[field]


def distill_splits_of(data: str, max_conversations: int | None = None, sample: str | None = None,
                      held_out_fraction: float | None = None, validation_fraction: float | None = None,
                      seed: int | None = None, skip_conversations: int = 0) -> dict[str, list]:
    """``{"validation": [...], "held-out": [...], "train": [...]}``: the conversations of ``data`` split as training
    splits them. With ``skip_conversations`` the file is read in its own order (``sample`` first), its first N left
    out (e.g. those an earlier run read), then split.

    Raises:
        ValueError: ``skip_conversations`` below 0, or as :func:`train.data.load_conversations`.
    """
    if skip_conversations < 0:
        raise ValueError(f"--skip-conversations must be >= 0, got {skip_conversations}")
    held = train_default("held_out_fraction", held_out_fraction)
    validation, seed = train_default("validation_fraction", validation_fraction), train_default("seed", seed)
    if skip_conversations:  # the file's order matters here: read it as it is, then split
        conversations, _ = load_conversations(data, limit=max_conversations, sample="first")
        train, val, held_out = split_conversations(conversations[skip_conversations:], held, validation, seed)
    else:
        train, val, held_out = load_splits(data, max_conversations, train_default("data_sample", sample), held,
                                           validation, seed)
    return {"validation": val, "held-out": held_out, "train": train}


def held_out_prompt_records(data: str, n: int, held_out_fraction: float | None = None, seed: int | None = None,
                            max_conversations: int | None = None, max_prompt_chars: int = 1000,
                            prefix_chars: int = 400) -> list[dict]:
    """The first ``n`` usable held-out records: ``{"id", "messages"}`` (a conversation's first prompt, at most
    ``max_prompt_chars`` long) or ``{"id", "text"}`` (a document's prefix of about ``prefix_chars``, cut at a space).

    Raises:
        ValueError: fewer than ``n`` usable held-out conversations or documents.
    """
    conversations, _ = load_conversations(data, limit=max_conversations)
    _, held_out = split_held_out(conversations, train_default("held_out_fraction", held_out_fraction),
                                 train_default("seed", seed))
    records = []
    for conv in held_out:
        if conv.is_document:
            prefix = document_prefix_text(conv.text, prefix_chars)
            if prefix:
                records.append({"id": conv.id, "text": prefix})
        elif sum(len(m["content"]) for m in first_prompt(conv)) <= max_prompt_chars:
            records.append({"id": conv.id, "messages": first_prompt(conv)})
    if len(records) < n:
        raise ValueError(f"only {len(records)} usable held-out conversations or documents, asked for {n}")
    return records[:n]


def write_jsonl(records: list[dict], path: str | Path) -> Path:
    """Write ``records`` as JSON lines (the folder made if needed); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
