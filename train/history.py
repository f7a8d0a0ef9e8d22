"""A run's held-out evaluations, one JSON line each (``eval_history.jsonl``), and the curves drawn from them.

The trainer appends every evaluation (periodic and final) whatever the tracker, so a run without tensorboard or
wandb still ends with its per-head loss and top-1 curves (``eval.png`` next to ``eval.json``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

HISTORY_NAME = "eval_history.jsonl"
CURVES_NAME = "eval.png"


def append_evaluation(output_dir: str | Path, step: int, metrics: dict) -> None:
    """Append one evaluation (``metrics`` as :func:`train.trainer.evaluate` returns them) at optimizer ``step``."""
    path = Path(output_dir) / HISTORY_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")


def read_history(output_dir: str | Path) -> list[dict]:
    """The evaluations of the run in ``output_dir``, in step order.

    A resumed or restarted run appends steps it has logged before; the later line wins and drops every line after
    that step, so the history is the one of the run that finished.
    """
    path = Path(output_dir) / HISTORY_NAME
    history: list[dict] = []
    if not path.is_file():
        return history
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by an interrupted write
            continue
        if record.get("heads"):
            history = [h for h in history if h["step"] < record["step"]] + [record]
    return history


def write_curves(output_dir: str | Path) -> Path | None:
    """Draw the held-out curves of the run in ``output_dir`` to ``eval.png``; returns the file, or ``None``.

    A missing matplotlib or an empty history is logged, not raised: the heads are already saved.
    """
    from medusa.tools.plots import plot_training

    history = read_history(output_dir)
    if not history:
        logger.info("no held-out evaluation recorded: no curves drawn")
        return None
    try:
        path = plot_training(history, Path(output_dir) / CURVES_NAME)
    except ImportError as e:
        logger.warning("training curves not drawn: %s", e)
        return None
    logger.info("held-out curves drawn to %s", path)
    return path
