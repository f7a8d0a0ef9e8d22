"""Run setup: the accelerator, the frozen base, the tokenised data, the heads (fresh or resumed), the optimizer and
the schedule, gathered in one :class:`Run`."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

from medusa.base import stop_token_ids
from medusa.drafters.heads import (
    MedusaHeadsConfig,
    build_heads,
    head_target_offset,
    lm_head_fingerprint,
    most_frequent_tokens,
)
from medusa.losses import head_lookup_table
from train.checkpoints import (
    HEADS_DIR,
    latest_checkpoint,
    load_optimizer_state,
    read_checkpoint_state,
    remove_unfinished_checkpoints,
    restore_rng_state,
)
from train.config import TrainConfig
from train.conversations import (
    head_target_totals,
    prepare_conversations,
    tokenize_held_out,
    validation_sequences,
    warn_heads_without_targets,
)
from train.data import default_tokenize_cache_dir, target_token_counts, tokenize_conversations
from train.medusa2 import ADAPTER_DIR, apply_lora, load_adapter_state, lora_parameters
from train.run import Run
from train.sharded import check_sharded_settings, full_weight
from train.store import ensure_store

logger = logging.getLogger(__name__)

def setup(config: TrainConfig, model=None, tokenizer=None) -> Run:
    """Accelerator, frozen base, tokenised data, heads (fresh or from the latest checkpoint), optimizer, schedule."""
    accelerator = make_accelerator(config)
    check_sharded_settings(accelerator, config.grad_accum_steps)
    logger.info("training on %s, device %s, mixed precision %s", describe_processes(accelerator), accelerator.device,
                "off" if accelerator.mixed_precision == "no" else accelerator.mixed_precision)
    if config.training_mode == "medusa2" and accelerator.num_processes > 1:
        raise ValueError("training_mode medusa2 runs in one process for now (DDP does not wrap the LoRA yet); "
                         "launch one process")
    set_seed(config.seed)
    if accelerator.is_main_process:
        remove_unfinished_checkpoints(config.output_dir)
    checkpoint = latest_checkpoint(config.output_dir)
    state = read_checkpoint_state(checkpoint, config) if checkpoint else None
    model, tokenizer = prepare_base(config, accelerator, model, tokenizer)
    base_config = model.config.get_text_config(decoder=True)
    layers = heads_base_layers(config, base_config)  # a bad eagle layer is refused before any data work
    train_convs, val_convs, held_convs = prepare_conversations(config, accelerator, model, tokenizer)
    # A document shorter than the last head's offset + 1 gives that head no target: counted and dropped.
    min_tokens = head_target_offset(config.num_heads - 1) + 1
    train_examples, _ = tokenize_conversations(train_convs, tokenizer, config.max_seq_len, config.num_proc,
                                               default_tokenize_cache_dir(), config.text_prefix_tokens, min_tokens)
    held_examples = tokenize_held_out(held_convs, tokenizer, config.max_seq_len, config.held_out_fraction,
                                      config.text_prefix_tokens, min_tokens)
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} exposes no lm_head (get_output_embeddings() is None): the heads "
                         "project with it and the teacher loss needs it")
    store = ensure_store(config.hidden_state_store, model, train_examples, config.max_seq_len, config.batch_size,
                         accelerator, layers) if config.hidden_state_store else None
    model = adapt_base(config, accelerator, model, checkpoint)
    lora_params = lora_parameters(model) if config.training_mode == "medusa2" else None
    drafter = config.trainable
    lm_head, embed = full_base_weights(model, drafter.reads_embeddings)  # (V, H) each; gathered once when sharded
    position = drafter.position_weight(config, model)  # (P, H) for the eagle drafter on GPT-2, else None
    eos = sorted(stop_token_ids(model.generation_config, tokenizer))  # always in a truncated head vocabulary
    heads = initial_heads(config, checkpoint, lm_head, embed, train_examples, eos, base_config, position)
    warn_heads_without_targets(head_target_totals(train_examples, heads.config.num_heads))
    teacher_weight = None
    if config.loss != "hard":
        teacher_weight = lm_head.detach() if heads.token_map is None else lm_head.detach()[heads.token_map]
    optimizer = make_optimizer(heads, config, lora_params)
    heads, optimizer = accelerator.prepare(heads, optimizer)
    step = state["step"] if state else 0
    if checkpoint:
        load_optimizer_state(accelerator, heads, optimizer, checkpoint)
        logger.info("resuming from step %d (%s)", step, checkpoint)
    # The schedule is a function of the step alone: rebuilt at the resumed step, it follows a changed max_steps.
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.max_steps, last_epoch=step - 1)
    unwrapped = accelerator.unwrap_model(heads)
    lookup = head_lookup_table(unwrapped.token_map, unwrapped.config.vocab_size)
    pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
    if config.tracker != "none":
        # Trackers take scalars and strings only: None as "none", lists comma-joined.
        tracker_config = {k: "none" if v is None else ",".join(map(str, v)) if isinstance(v, list) else v
                          for k, v in config.to_dict().items()}
        accelerator.init_trackers("medusa_heads", config=tracker_config,
                                  init_kwargs={"wandb": {"dir": config.output_dir}})
    if checkpoint:
        restore_rng_state(checkpoint, accelerator.process_index)
    return Run(config, accelerator, model, heads, optimizer, scheduler, train_examples, held_examples, lookup,
               pad_id, teacher_weight, step=step, hidden_cache={} if config.cache_hidden_states else None,
               store=store, lora_params=lora_params, validation=validation_sequences(val_convs))


def adapt_base(config: TrainConfig, accelerator: Accelerator, model, checkpoint: Path | None):
    """Medusa-2: the frozen base wrapped in its LoRA (the checkpoint's weights when resuming); Medusa-1: ``model``.

    Raises:
        ValueError: bad LoRA target modules, or a checkpoint whose LoRA has another rank or other targets.
    """
    if config.training_mode != "medusa2":
        return model
    model = apply_lora(model, config)
    if checkpoint:
        load_adapter_state(model, checkpoint / ADAPTER_DIR, config)
    return model


def full_base_weights(model, reads_embeddings: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The base's whole lm_head ``(V, H)`` and, for heads that read them (Hydra heads, the eagle drafter), its whole
    input embeddings ``(V, H)`` (else ``None``): gathered once (:func:`full_weight`) when sharded training holds
    them partitioned."""
    lm_head = full_weight(model.get_output_embeddings().weight, "lm_head")
    if not reads_embeddings:
        return lm_head, None
    return lm_head, full_weight(model.get_input_embeddings().weight, "input embeddings")


def heads_base_layers(config: TrainConfig, base_config) -> tuple[int, ...]:
    """The base's decoder layers (0-based) whose outputs the heads read after its last hidden state, as the drafter
    declares (:meth:`train.drafters.HeadsTraining.base_layers`: none for Medusa and Hydra heads, the fused layers of
    the eagle drafter). Checked as soon as the base loads (before data, store or heads).

    Raises:
        ValueError: what the drafter refuses of this base (a layer index outside it, naming both).
    """
    return config.trainable.base_layers(config, base_config)


def initial_heads(config: TrainConfig, checkpoint: Path | None, lm_head: torch.Tensor, embed: torch.Tensor | None,
                  examples: list[dict], always: list[int], base_config=None,
                  position_weight: torch.Tensor | None = None):
    """The heads training starts from: the checkpoint's, else ``config.init_heads``, else fresh ones, over the
    base's whole lm_head and (Hydra, eagle) input embeddings ``(V, H)``; ``always`` are the token ids a truncated
    head vocabulary keeps. ``base_config`` is the base's text config (needed by the eagle drafter; its layer count
    is checked against loaded heads), ``position_weight`` its learned position embedding (GPT-2, eagle)."""
    layers = heads_base_layers(config, base_config) if base_config is not None else ()
    num_layers = None if base_config is None else base_config.num_hidden_layers
    loaded = {"embed_weight": embed, "position_weight": position_weight, "num_base_layers": num_layers}
    drafter = config.trainable
    if checkpoint:
        return drafter.load(checkpoint / HEADS_DIR, lm_head, **loaded)
    if config.init_heads:
        heads = drafter.load(config.init_heads, lm_head, **loaded)
        check_init_heads(config, heads.config, layers)
        logger.info("heads initialised from %s", config.init_heads)
        return heads
    return heads_for_training(config, lm_head, embed, examples, always, base_config, position_weight)


def check_init_heads(config: TrainConfig, heads_config: MedusaHeadsConfig, layers: tuple[int, ...] = ()) -> None:
    """Refuse ``init_heads`` whose head type, count, layers, lm_head sharing or (eagle) base layers differ from the
    run's config (``layers``: the run's :func:`heads_base_layers`).

    Raises:
        ValueError: naming every differing field with both values.
    """
    fields = ("head_type", "num_heads", "num_layers", "share_lm_head")
    problems = [f"{f}: heads {getattr(heads_config, f)!r} != config {getattr(config, f)!r}" for f in fields
                if getattr(heads_config, f) != getattr(config, f)]
    if list(heads_config.eagle_layers or []) != list(layers):
        problems.append(f"eagle_layers: heads {heads_config.eagle_layers!r} != config {list(layers) or None!r}")
    if problems:
        raise ValueError(f"init_heads {config.init_heads} do not fit the config: " + "; ".join(problems))


def make_accelerator(config: TrainConfig) -> Accelerator:
    """The run's Accelerator: mixed precision, tracker, and DDP that does not re-broadcast the heads' buffers.

    A multi-process launch on a machine without CUDA runs on CPU (:func:`launched_on_cpu`).

    Raises:
        ImportError: the tracker's package is not installed.
        ValueError: the mixed-precision mode cannot run on this device (see :func:`resolve_mixed_precision`).
    """
    module = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(config.tracker)
    if module is not None and importlib.util.find_spec(module) is None:
        raise ImportError(f'tracker="{config.tracker}" needs the {module} package: pip install -e ".[tracking]"')
    if config.tracker == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    cpu = launched_on_cpu()
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


def launched_on_cpu() -> bool:
    """Whether this is one of several launched processes (``WORLD_SIZE`` > 1) on a machine without CUDA: Accelerate
    runs them as CPU processes over gloo only when asked (``cpu=True``), and ``accelerate launch --multi_gpu`` /
    ``torchrun`` do not ask."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


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


def heads_for_training(config: TrainConfig, lm_head: torch.Tensor, embed: torch.Tensor, examples: list[dict],
                       always: list[int], base_config=None,
                       position_weight: torch.Tensor | None = None) -> torch.nn.Module:
    """Fresh heads of ``config.head_type`` over the base's lm_head and input embeddings ``(V, H)``, with a token map
    of the most frequent training targets, initialised from ``config.seed`` alone (the global random state is left
    as it was). Sharded or partitioned weights are gathered once (:func:`full_weight`).

    The eagle drafter also takes its layer's shape from the base's text config ``base_config``
    (:func:`medusa.drafters.eagle.eagle_base_settings`), its fused layers from :func:`heads_base_layers` and, on a
    base with learned positions, the position embedding ``position_weight`` ``(P, H)``.

    Raises:
        ValueError: an eagle drafter without ``base_config``; what :func:`heads_base_layers` raises; shapes that do
            not fit.
    """
    lm_head = full_weight(lm_head, "lm_head")  # (V, H); a no-op on a whole weight
    drafter = config.trainable
    embed = full_weight(embed, "input embeddings") if drafter.reads_embeddings else embed  # (V, H)
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
        **drafter.heads_fields(config, base_config),
    )
    # The initial weights are a function of the seed alone: every process of a sharded run (FSDP2 keeps each
    # process's own shard of them) and a run after any other random draws start from the same heads.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return build_heads(heads_config, lm_head, embed, token_map, position_weight=position_weight)


def make_optimizer(heads: torch.nn.Module, config: TrainConfig,
                   lora_params: list[torch.nn.Parameter] | None = None) -> torch.optim.Optimizer:
    """AdamW over the parameters the drafter declares trainable (``config.trainable.trainable_parameters``) only;
    weight decay on matrices, not on biases. Medusa-2 adds the base's LoRA parameters as a group of their own at
    ``lora_learning_rate`` (no weight decay)."""
    params = config.trainable.trainable_parameters(heads)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        {"params": list(lora_params or []), "weight_decay": 0.0, "lr": config.lora_learning_rate},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.learning_rate)
