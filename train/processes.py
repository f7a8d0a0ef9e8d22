"""The processes of one launch (``accelerate launch``, ``torchrun``) as the data steps see them: an ``accelerate``
``Accelerator`` or ``PartialState``, or ``None`` for one process. The distillation and the hidden-state store split
their work by :func:`rank_and_world` and meet at :func:`wait_for_everyone`."""

from __future__ import annotations


def rank_and_world(accelerator) -> tuple[int, int]:
    """``(this process's index, number of processes)``; ``(0, 1)`` for ``None``."""
    return (0, 1) if accelerator is None else (accelerator.process_index, accelerator.num_processes)


def wait_for_everyone(accelerator) -> None:
    """Return once every process has called this (``accelerator.wait_for_everyone()``); at once for ``None``."""
    if accelerator is not None:
        accelerator.wait_for_everyone()
