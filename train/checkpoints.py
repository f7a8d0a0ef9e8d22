"""Training checkpoints: one folder ``checkpoints/step_N`` per save (heads, optimizer state, each process's random
state, step and config), written atomically; the latest complete one is where a run resumes.

Under sharded training the heads and their optimizer state are gathered whole by every process together (collectives)
and written by the main process, so a checkpoint holds the same files as a single-process one: the heads by
``accelerator.get_state_dict``; the optimizer state under FSDP2 by torch.distributed.checkpoint with
``full_state_dict`` (keyed by parameter name, so it loads back on any number of processes). Under DeepSpeed the
engine writes its optimizer partitions itself, into ``deepspeed/`` (one per process; resume on as many processes).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DistributedType

from medusa.io.files import atomic_folder, read_json, remove_folder
from train.config import TrainConfig
from train.medusa2 import ADAPTER_DIR, save_adapter
from train.run import Run

logger = logging.getLogger(__name__)

HEADS_DIR = "heads"
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_PREFIX = "step_"
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
RNG_STATE_NAME = "rng_state_{rank}.pt"
DEEPSPEED_DIR = "deepspeed"
"""DeepSpeed's engine checkpoint inside a checkpoint (its optimizer partitions), under the tag ``heads``."""


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
    problems = config.resume_mismatch(state["config"])
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
    accelerator.wait_for_everyone()
    main = accelerator.is_main_process
    with atomic_folder(path, tmp=path.with_name(f".{path.name}.tmp"), swap=main) as tmp:
        accelerator.wait_for_everyone()  # the main process made tmp
        torch.save(rng_state(), tmp / RNG_STATE_NAME.format(rank=accelerator.process_index))
        heads_state = accelerator.get_state_dict(run.heads)  # every process: a collective when the heads are sharded
        optimizer_state = save_optimizer_state(run, tmp)
        accelerator.wait_for_everyone()
        if main:
            run.config.trainable.save(accelerator.unwrap_model(run.heads), tmp / HEADS_DIR,
                                      extra_config={"steps": run.step}, state_dict=heads_state)
            if run.lora_params is not None:
                save_adapter(run.model, tmp / ADAPTER_DIR)
            if optimizer_state is not None:
                torch.save(optimizer_state, tmp / OPTIMIZER_NAME)
            state = {"step": run.step, "micro_step": run.step * run.config.grad_accum_steps,
                     "num_processes": accelerator.num_processes, "config": run.config.to_dict()}
            (tmp / TRAINER_STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")
    if main:
        _prune_checkpoints(path.parent, run.config.keep_checkpoints)
        logger.info("checkpoint saved: %s", path)
    accelerator.wait_for_everyone()
    return path


def save_optimizer_state(run: Run, checkpoint: Path) -> dict | None:
    """The optimizer state to write as ``OPTIMIZER_NAME`` (by the main process), or ``None`` when DeepSpeed wrote
    it into ``checkpoint`` itself. Called on every process: under FSDP2 and DeepSpeed it is a collective.

    FSDP2: the full state keyed by parameter name (only the main process holds it). Otherwise
    ``optimizer.state_dict()``, as in a single-process run.
    """
    accelerator, heads, optimizer = run.accelerator, run.heads, run.optimizer
    if accelerator.is_fsdp2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(heads, getattr(optimizer, "optimizer", optimizer), options=options)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        heads.save_checkpoint(str(checkpoint / DEEPSPEED_DIR), "heads")  # heads is the DeepSpeedEngine
        return None
    return optimizer.state_dict()


def load_optimizer_state(accelerator, heads: torch.nn.Module, optimizer, checkpoint: Path) -> None:
    """Restore what :func:`save_optimizer_state` saved into the prepared ``heads``' ``optimizer``, on every process.

    A state keyed by parameter name (saved under FSDP2) loads into sharded or whole heads alike; the
    ``state_dict()`` of a run that was not sharded loads with ``optimizer.load_state_dict``; under DeepSpeed the
    engine reloads its own partitions.

    Raises:
        FileNotFoundError, ValueError: the optimizer file is missing or damaged (see :func:`load_torch_file`).
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        heads.load_checkpoint(str(checkpoint / DEEPSPEED_DIR), "heads", load_module_strict=True,
                              load_optimizer_states=True, load_lr_scheduler_states=False)
        return
    path = checkpoint / OPTIMIZER_NAME
    state = load_torch_file(path, "optimizer state")
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
        raise ValueError(f"optimizer state {path} is damaged: not an optimizer state dict")
    groups = state["param_groups"] or [{}]
    if not any(isinstance(name, str) for name in groups[0].get("params", [])):  # not keyed by parameter name
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside Accelerate's wrapper
    # torch.distributed.checkpoint loads only the group fields the optimizer already has; the schedule's
    # initial_lr is added to the groups when the scheduler is built, after this.
    for group, saved in zip(inner.param_groups, state["param_groups"], strict=False):
        group.update({key: value for key, value in saved.items() if key not in group})
    set_optimizer_state_dict(heads, inner, state, options=StateDictOptions(full_state_dict=True))


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
    state = load_torch_file(path, "random state")
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


def load_torch_file(path: Path, what: str):
    """``torch.load`` (tensors and plain containers only) with errors that name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError... for a damaged file
        raise ValueError(f"{what} {path} is damaged or not a torch file: {type(e).__name__}: {e}") from e


def _prune_checkpoints(root: Path, keep: int) -> None:
    if keep == 0:
        return
    steps = sorted(int(p.name[len(CHECKPOINT_PREFIX) :]) for p in root.glob(f"{CHECKPOINT_PREFIX}*")
                   if p.name[len(CHECKPOINT_PREFIX) :].isdigit())
    for step in steps[:-keep]:
        remove_folder(root / f"{CHECKPOINT_PREFIX}{step}")
