"""Medusa head training with Accelerate: K heads trained on the base's last hidden states (the eagle drafter,
``head_type: eagle``, on them and the outputs of the base layers it fuses: :func:`medusa.base.base_states`).

Medusa-1 (Cai et al., 2024, section 2.2.1): the base model (embeddings and lm_head included) is frozen and runs under
``torch.no_grad``; only the heads train, on the loss of :mod:`medusa.losses`. Medusa-2 (section 2.2.2,
``training_mode: medusa2``, :mod:`train.medusa2`) adds a LoRA on the base, trained jointly with a KL to the frozen
base; it is written to ``output_dir/adapter`` next to the heads. Reading order:

``train`` (here) -> :func:`train.setup.setup` (accelerator, base, data, heads, optimizer, resume) ->
:func:`train.loop.fit` (the loop: ``train_step``, :func:`train.evaluation.evaluate`,
:func:`train.checkpoints.save_checkpoint`) -> final evaluation and ``save_heads``.

The pieces live by concern: :mod:`train.setup` (run setup), :mod:`train.conversations` (data and self-distillation
orchestration), :mod:`train.loop` (the step loop), :mod:`train.objective` (the loss), :mod:`train.evaluation`
(held-out metrics), :mod:`train.checkpoints` (atomic checkpoints and resumption) and :mod:`train.medusa2`
(the LoRA, its stages and its KL). Their public names are
importable from here too.

Only the heads go through ``accelerator.prepare`` (DDP, FSDP2 or DeepSpeed wraps them alone); the base sits on
``accelerator.device`` as a plain module. A checkpoint is one folder ``checkpoints/step_N`` (heads, optimizer state,
each process's random state, step, config), written atomically, with sharded heads gathered whole first; a run whose
``output_dir`` holds checkpoints resumes from the latest one and continues exactly as an uninterrupted run would (the
data order and the schedule are functions of the step).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from train.checkpoints import (  # noqa: F401 (public names, importable from here)
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    HEADS_DIR,
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    TRAINER_STATE_NAME,
    checkpoint_dir,
    latest_checkpoint,
    read_checkpoint_state,
    remove_unfinished_checkpoints,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from train.config import TrainConfig
from train.conversations import (  # noqa: F401
    head_target_totals,
    prepare_conversations,
    read_distilled,
    self_distill_split,
    tokenize_held_out,
    warn_heads_without_targets,
)
from train.evaluation import any_held_out, evaluate, format_metrics
from train.history import write_curves
from train.loop import batch_hidden_states, crop_window, fit, micro_batches, train_step, window_starts  # noqa: F401
from train.medusa2 import ADAPTER_DIR, save_adapter
from train.objective import head_loss, mixed_step_loss, step_loss, teacher_logits  # noqa: F401
from train.run import end_run
from train.setup import (  # noqa: F401
    Run,
    describe_processes,
    freeze_base,
    heads_for_training,
    make_accelerator,
    make_optimizer,
    prepare_base,
    resolve_mixed_precision,
    setup,
)

logger = logging.getLogger(__name__)

EVAL_NAME = "eval.json"


def write_calibration(run: Run, heads, heads_dir: Path) -> Path | None:
    """Measure the heads' calibration on the validation split's self-distilled answers and write it into the heads
    folder (:func:`medusa.tools.calibrate.calibrate_heads`): decoding then grows a per-step tree. Without such
    answers (a run that did not self-distill) nothing is written and the log says how to calibrate later."""
    from medusa.model import CALIBRATION_NOTE
    from medusa.tools.calibrate import calibrate_heads

    if not run.validation:
        logger.info("no self-distilled validation answers to calibrate on: %s", CALIBRATION_NOTE)
        return None
    base = run.accelerator.unwrap_model(run.model)
    was_training = heads.training
    heads.eval()
    try:
        calibration, path = calibrate_heads(base, heads, heads_dir, run.validation,
                                            source={"data": "validation split", "sequences": len(run.validation)})
    except ValueError as e:  # answers too short to measure: the heads are saved; say so and how to calibrate
        logger.warning("no calibration written (%s): %s", e, CALIBRATION_NOTE)
        return None
    finally:
        heads.train(was_training)
    logger.info("calibration of the per-step tree written to %s (top-1 acceptance per depth %s)", path,
                [round(a[0], 3) for a in calibration.accuracy])
    return path


def train(config: TrainConfig, model=None, tokenizer=None) -> Path:
    """Train the drafter ``config.head_type`` names as it declares (:mod:`train.drafters`): heads through
    :func:`train_heads`, the draft model through :func:`train.draft_model.train_draft_model`.

    Args:
        config: the run configuration.
        model: an already loaded base causal LM to use instead of loading ``config.base`` (it is frozen in place).
        tokenizer: its tokenizer; loaded from ``config.base`` when ``None``.

    Returns:
        The folder written: the heads folder, or the distilled draft model's folder.

    Raises:
        ValueError: as the drafter's training raises (see :func:`train_heads`).
    """
    return PIPELINES[config.trainable.pipeline](config, model, tokenizer)


def train_heads(config: TrainConfig, model=None, tokenizer=None) -> Path:
    """Train heads as ``config`` says (their objective, parameters and folder as their drafter declares,
    ``config.trainable``) and write them to ``output_dir/heads``.

    Args:
        config: the run configuration.
        model: an already loaded base causal LM to use instead of loading ``config.base`` (it is frozen in place).
        tokenizer: its tokenizer; loaded from ``config.base`` when ``None``.

    Returns:
        The heads folder (loadable with :func:`medusa.io.checkpoint.load_heads`).

    Raises:
        ValueError: the data holds nothing to train on, or ``output_dir`` holds a checkpoint written with a
            different config (the message names the differing fields).
    """
    run = setup(config, model, tokenizer)
    fit(run)
    metrics = evaluate(run) if any_held_out(run) else {}
    out = Path(config.output_dir)
    state = run.accelerator.get_state_dict(run.heads)  # every process: a collective when the heads are sharded
    if run.accelerator.is_main_process:
        heads = run.accelerator.unwrap_model(run.heads)
        extra = {"config": config.to_dict(), "steps": run.step, "held_out": metrics}
        config.trainable.save(heads, out / HEADS_DIR, extra_config=extra, state_dict=state)
        write_calibration(run, heads, out / HEADS_DIR)
        if run.lora_params is not None:  # Medusa-2: the heads were trained over the adapted base
            save_adapter(run.model, out / ADAPTER_DIR)
            logger.info("LoRA adapter written to %s (decode with --adapter, or `medusa merge` it)", out / ADAPTER_DIR)
        (out / EVAL_NAME).write_text(json.dumps({"steps": run.step, **metrics}, indent=2) + "\n")
        write_curves(out)
        logger.info("heads written to %s; held-out %s", out / HEADS_DIR, format_metrics(metrics))
    del state  # so that nothing of the run outlives end_run
    end_run(run)
    return out / HEADS_DIR


def _train_draft_model(config: TrainConfig, model=None, tokenizer=None) -> Path:
    from train.draft_model import train_draft_model  # the draft model's own run, above the heads' pieces it shares

    return train_draft_model(config, model, tokenizer)


PIPELINES = {"heads": train_heads, "draft_model": _train_draft_model}
"""The training runs a drafter's declared ``pipeline`` names (:class:`train.drafters.TrainableDrafter`)."""
