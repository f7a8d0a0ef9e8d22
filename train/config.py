"""Training run configuration: one typed dataclass; YAML files override its defaults and CLI flags override YAML."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

MIXED_PRECISION_CHOICES = ("auto", "no", "bf16", "fp16")
LOSS_CHOICES = ("hard", "teacher", "mixed")
TRACKER_CHOICES = ("none", "tensorboard", "wandb")
TRAINING_MODE_CHOICES = ("medusa1", "medusa2")

# Fields that may change between a run and its resumption: they do not change what the heads learn.
RESUMABLE_FIELDS = frozenset(
    {"output_dir", "max_steps", "save_every", "eval_every", "max_eval_batches", "log_every", "keep_checkpoints",
     "tracker", "distill_time_limit_s", "cache_hidden_states", "hidden_state_store", "num_proc"}
)


@dataclass
class TrainConfig:
    """Medusa head training (Cai et al., 2024, section 2.2): Medusa-1 trains K heads on a frozen base's hidden
    states; Medusa-2 trains them jointly with a LoRA on the base, kept close to the frozen base by a KL term."""

    base: str = ""
    """Folder of the base causal LM (Hugging Face format, with tokenizer and chat template)."""
    training_mode: str = "medusa1"
    """"medusa1" (the base frozen, only the heads train) or "medusa2" (heads and a LoRA on the base train jointly;
    the loss adds kl_weight x KL(frozen base || adapted base) on the base's next-token distribution)."""
    init_heads: str | None = None
    """Heads folder to start from instead of fresh heads (for Medusa-2: the stage-1 heads of a Medusa-1 run); its
    head type, count and layers must match this config. A checkpoint in output_dir takes precedence."""
    stage1_steps: int = 0
    """Medusa-2: the first this many optimizer steps train the heads only over the base as it is (stage 1); joint
    training (stage 2) follows. 0 starts joint training at once (use it with init_heads)."""
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Medusa-2: names of the base's linear modules that get a LoRA (peft target_modules: a module whose name is or
    ends with one of them); a list in YAML, comma-separated on the command line."""
    lora_rank: int = 8
    """Medusa-2: LoRA rank r."""
    lora_alpha: float = 16.0
    """Medusa-2: LoRA scaling alpha (the update is scaled by alpha / r)."""
    lora_dropout: float = 0.0
    """Medusa-2: dropout on the LoRA input during training."""
    lora_learning_rate: float = 1e-4
    """Medusa-2: peak learning rate of the LoRA parameters (their own AdamW group, same schedule as the heads)."""
    kl_weight: float = 1.0
    """Medusa-2: lambda, the weight of KL(frozen base || adapted base) averaged over the next-token positions of
    the supervised tokens."""
    heads_loss_warmup_steps: int = 50
    """Medusa-2: the heads' loss weight rises linearly from 0 to 1 over this many steps from the start of stage 2
    (the heads' gradient reaches the base only gradually); 0 gives it full weight at once."""
    data: str = "sharegpt"
    """Chat data: "sharegpt" (bundled ShareGPT V3) or a .json/.jsonl/.parquet file (ShareGPT, OpenAI-style or
    self-distilled records)."""
    output_dir: str = "outputs/medusa"
    """Run folder: checkpoints/, distilled data, heads/ and eval.json are written here."""
    head_type: str = "medusa"
    """The registered name of the drafter to train (:mod:`train.drafters`; ``drafter`` in YAML is the same key):
    "medusa" (each head reads the hidden state at t), "hydra" (head k also reads the input embeddings of the
    tokens t+1 .. t+k+1: sequentially dependent heads, Ankner et al. 2024) or "eagle" (an EAGLE-3-style drafter:
    one decoder layer over fused base layers, drafting each deeper token from its own output, Li et al. 2025;
    :mod:`medusa.drafters.eagle`) or "draft_model" (a separate draft model for classic speculative decoding,
    distilled toward the base's distribution, :mod:`train.draft_model`; written to output_dir/draft)."""
    draft_layers: int = 6
    """head_type draft_model: the draft starts as the base's first this many decoder layers (its embeddings, final
    norm and lm_head kept: LayerSkip-style self-drafting), unless draft_init names a folder."""
    draft_init: str | None = None
    """head_type draft_model: a draft model folder to start from instead (a smaller sibling sharing the base's
    tokenizer, or one made by `medusa make-draft`); its vocabulary is checked against the base's."""
    num_heads: int = 4
    """K: number of Medusa heads; head k predicts the token k + 2 positions ahead. For the eagle drafter: its
    drafting depth (the outputs evaluated, calibrated and drafted; output k predicts token k + 2 ahead)."""
    num_layers: int = 1
    """Layers per head: ResBlocks for Medusa heads; for Hydra heads the input layer plus num_layers - 1 ResBlocks.
    The eagle drafter is one decoder layer (1 only)."""
    prefix_layers: int = 0
    """1: Hydra heads get their own sliding-window attention layer over the base's hidden states (Hydra++'s extra
    decoder layer, :mod:`medusa.drafters.prefix_layer`), so they can look back at the context; 0: none."""
    prefix_window: int = 64
    """Positions that attention layer looks back over, in training and decoding alike."""
    eagle_layers: list[int] | None = None
    """head_type eagle: the base's decoder layers (0-based; each one's output) fused into the drafter's input, a
    list in YAML, comma-separated on the command line; null: EAGLE-3's low, middle and high layers of the base
    (:func:`medusa.drafters.eagle.default_eagle_layers`). Checked against the base's layer count when it loads."""
    ttt_steps: int = 3
    """head_type eagle: training-time-test steps (EAGLE-3, section 3.3): each training step unrolls the drafter this
    many times on its own outputs, output j scored as the depth-j head (loss_decay ** j); may differ from
    num_heads."""
    share_lm_head: bool = True
    """Project with the base's frozen lm_head (True) or train a per-head copy (False)."""
    head_vocab_size: int | None = 8192
    """Truncated head vocabulary: the most frequent training-target tokens (always with EOS); null for the full
    vocabulary (also used when it is not smaller than the base vocabulary)."""
    loss_decay: float = 0.8
    """Head k's loss weight is loss_decay ** k."""
    loss: str = "hard"
    """"hard" (cross-entropy on the data's tokens), "teacher" (soft cross-entropy on the base's own distribution
    for each target token, from its lm_head) or "mixed" (loss_mix * hard + (1 - loss_mix) * teacher)."""
    teacher_temperature: float = 1.0
    """Temperature of the teacher loss (both distributions are divided by it; the loss is scaled by its square)."""
    loss_mix: float = 0.5
    """Weight of the hard term when loss is "mixed"."""
    max_seq_len: int = 1024
    """Conversations are truncated to this many tokens."""
    train_window: int | None = None
    """Train each example on a random window of this many positions per step (its hidden states keep their full
    context): the heads' cost per step drops with the window while every epoch still sees every example; null trains
    on whole examples."""
    batch_size: int = 8
    """Sequences per micro-batch on each process."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step. The loss is normalised by the targets of the whole step, so
    batch_size x grad_accum_steps x processes, however split, trains the same heads. Above 1 it is refused under
    DeepSpeed, whose engine steps the optimizer inside backward."""
    learning_rate: float = 1e-3
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay on weight matrices (biases are not decayed)."""
    warmup_steps: int = 50
    """Linear warmup steps before the cosine decay."""
    max_steps: int = 2000
    """Optimizer steps in total (a resumed run continues up to this)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping."""
    mixed_precision: str = "auto"
    """"no", "bf16", "fp16" (needs a CUDA device; refused at start on CPU), or "auto": bf16 on a CUDA device that
    supports it, otherwise "no"."""
    save_every: int = 500
    """Checkpoint every this many optimizer steps (and at the end); 0 saves only at the end."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept in output_dir/checkpoints; 0 keeps all."""
    eval_every: int = 500
    """Evaluate on the held-out split every this many steps (and at the end); 0 evaluates only at the end."""
    max_eval_batches: int | None = None
    """Cap on held-out batches per process in periodic evaluations; null evaluates the whole split."""
    log_every: int = 10
    """Log the training loss every this many optimizer steps."""
    held_out_fraction: float = 0.02
    """Fraction of conversations (by a hash of their id) held out for evaluation."""
    validation_fraction: float = 0.02
    """Fraction of the other conversations (by a second hash of their id) set aside as the validation split, never
    trained on: what trees and calibrations are fitted on (``--self-distill`` writes their answers to
    ``distilled_validation.jsonl``, which ``medusa build-tree --data`` reads)."""
    seed: int = 0
    """Seed for the held-out split, data order and head initialisation."""
    tracker: str = "none"
    """Experiment tracker: "none", "tensorboard" (logs under output_dir/runs) or "wandb" (offline without
    WANDB_API_KEY)."""
    max_conversations: int | None = None
    """Use at most this many conversations of the data; null uses all."""
    data_sample: str = "spread"
    """Which ``max_conversations``: "spread" (evenly spaced over the whole dataset, each split its share, split
    first) or "first" (the file's first ones, split after)."""
    distill_turns: str = "all"
    """Self-distillation: answer a turn drawn from all of each conversation's turns ("all", with the dataset's own
    earlier turns as context) or only the first ("first")."""
    distill_prefix_lengths: list[int] | None = None
    """Self-distillation of plain-text documents: the base continues each document's first n tokens, n drawn (by a
    hash of its id) from these lengths shorter than the document; null: 16, 32, 64, 128."""
    text_prefix_tokens: int = 0
    """Plain-text documents: the first this many tokens of each are context only, not supervised."""
    self_distill: bool = False
    """Regenerate the answers with the base itself before training (ignored for data already self-distilled)."""
    distill_max_new_tokens: int = 256
    """Self-distillation: answer length budget in tokens."""
    distill_max_prompt_tokens: int = 512
    """Self-distillation: prompts longer than this many tokens are skipped."""
    distill_batch_size: int = 16
    """Self-distillation: prompts generated together per process."""
    distill_time_limit_s: float | None = None
    """Self-distillation: wall-clock budget per split and process in seconds, checked between batches (the batch that
    crosses it finishes, so that no answer is cut short: one batch of ``distill_batch_size`` prompts may run past
    it); null for no limit."""
    cache_hidden_states: bool = False
    """Keep each training example's base hidden states in memory (bf16, on CPU) after its first forward, so every
    later epoch runs the heads only. Costs sequence length x hidden size x 2 bytes per example."""
    hidden_state_store: str | None = None
    """Folder of a hidden-state store (train/store.py): the training examples' base hidden states on disk (bf16,
    memory-mapped), built by one base pass if missing and resumed if partial; training then reads them instead of
    running the base (the held-out split still runs it). Null runs the base every step."""
    num_proc: int = 1
    """Processes for tokenising the data (datasets map; the result is cached on disk)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f.name, _field_types()[f.name], getattr(self, f.name)))
        if not self.base:
            raise ValueError("base (the base model folder) is required")
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION_CHOICES)
        _check_choice("tracker", self.tracker, TRACKER_CHOICES)
        _check_choice("data_sample", self.data_sample, ("spread", "first"))
        _check_choice("distill_turns", self.distill_turns, ("all", "first"))
        # Here, not at the top: flag parsing (train.cli) stays free of torch.
        from train.drafters import check_fields, trainable_names

        _check_choice("head_type", self.head_type, trainable_names())
        _check_choice("loss", self.loss, LOSS_CHOICES)
        _check_choice("training_mode", self.training_mode, TRAINING_MODE_CHOICES)
        self._check_medusa2()
        for name in ("ttt_steps", "draft_layers"):
            _check_min(name, getattr(self, name), 1)
        if self.prefix_layers not in (0, 1):
            raise ValueError(f"prefix_layers must be 0 or 1, got {self.prefix_layers}")
        check_fields(self)  # head_type names a registered drafter; the fields it owns; its own rules
        if self.prefix_window < 1:
            raise ValueError(f"prefix_window must be >= 1, got {self.prefix_window}")
        if not self.teacher_temperature > 0:
            raise ValueError(f"teacher_temperature must be > 0, got {self.teacher_temperature}")
        if not 0 <= self.loss_mix <= 1:
            raise ValueError(f"loss_mix must be in [0, 1], got {self.loss_mix}")
        for name in ("num_heads", "max_seq_len", "batch_size", "grad_accum_steps", "max_steps", "log_every",
                     "distill_max_new_tokens", "distill_max_prompt_tokens", "distill_batch_size", "num_proc"):
            _check_min(name, getattr(self, name), 1)
        for name in ("num_layers", "warmup_steps", "stage1_steps", "heads_loss_warmup_steps", "kl_weight",
                     "save_every", "eval_every", "keep_checkpoints", "seed",
                     "weight_decay", "max_grad_norm"):
            _check_min(name, getattr(self, name), 0)
        for name in ("head_vocab_size", "max_conversations", "max_eval_batches", "train_window"):
            if getattr(self, name) is not None:
                _check_min(name, getattr(self, name), 1)
        if self.cache_hidden_states and self.hidden_state_store:
            raise ValueError("cache_hidden_states and hidden_state_store both keep hidden states: choose one")
        if self.num_layers == 0 and self.share_lm_head:
            raise ValueError("num_layers=0 with share_lm_head=true leaves the heads nothing to train")
        if self.distill_prefix_lengths is not None and (not self.distill_prefix_lengths
                                                        or min(self.distill_prefix_lengths) < 1):
            raise ValueError(f"distill_prefix_lengths must be token counts >= 1, got {self.distill_prefix_lengths}")
        if self.text_prefix_tokens < 0:
            raise ValueError(f"text_prefix_tokens must be >= 0, got {self.text_prefix_tokens}")
        if self.max_seq_len < 3:
            raise ValueError(f"max_seq_len must be >= 3 (head 0 predicts 2 tokens ahead), got {self.max_seq_len}")
        if not 0 < self.loss_decay <= 1:
            raise ValueError(f"loss_decay must be in (0, 1], got {self.loss_decay}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in [0, 1), got {self.held_out_fraction}")
        if not 0 <= self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in [0, 1), got {self.validation_fraction}")
        if self.distill_time_limit_s is not None and self.distill_time_limit_s <= 0:
            raise ValueError(f"distill_time_limit_s must be > 0 or null, got {self.distill_time_limit_s}")

    def _check_medusa2(self) -> None:
        _check_min("lora_rank", self.lora_rank, 1)
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_learning_rate > 0:
            raise ValueError(f"lora_learning_rate must be > 0, got {self.lora_learning_rate}")
        if not self.lora_target_modules or any(not m for m in self.lora_target_modules):
            raise ValueError(f"lora_target_modules must name modules, got {list(self.lora_target_modules)}")
        if self.training_mode != "medusa2":
            return
        for name in ("hidden_state_store", "cache_hidden_states"):
            if getattr(self, name):
                raise ValueError(f"training_mode medusa2 adapts the base, so its hidden states change every step: "
                                 f"{name} (states of the frozen base) cannot serve it; unset {name}")

    @property
    def trainable(self):
        """What the drafter ``head_type`` names declares for training (:func:`train.drafters.trainable_drafter`)."""
        from train.drafters import trainable_drafter

        return trainable_drafter(self.head_type)

    def to_dict(self) -> dict:
        # Tuples as lists: the dict is stored as JSON and compared with what JSON gives back.
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def resume_mismatch(self, stored: dict) -> list[str]:
        """:func:`resume_mismatch` of ``stored`` against this config."""
        return resume_mismatch(stored, self)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _check_min(name: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _field_types() -> dict[str, object]:
    return typing.get_type_hints(TrainConfig)


def coerce(name: str, annotation, value):
    """Convert ``value`` (from YAML or a CLI string) to the field type ``annotation`` (int, float, bool, str,
    ``tuple[str, ...]`` or ``list[int]`` (a list, or a comma-separated string) or ``X | None``).

    Raises:
        ValueError: the value does not fit the type (``True`` for an int, ``"abc"`` for a float...).
    """
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple:
        if isinstance(value, str) and value.strip().startswith("["):
            try:
                value = yaml.safe_load(value)  # a YAML/Python-style list given on the command line
            except yaml.YAMLError:
                pass
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ValueError(f"{name}: expected a list of strings, got {value!r}")
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        annotation = next(a for a in args if a is not type(None))
    if typing.get_origin(annotation) is list:
        return _coerce_list(name, typing.get_args(annotation)[0], value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # PyYAML reads 1e-3 (no dot) as a string
            except ValueError:
                pass
    elif annotation is str and isinstance(value, (str, Path)):
        return str(value)
    raise ValueError(f"{name}: expected {getattr(annotation, '__name__', annotation)}, got {value!r}")


def _coerce_list(name: str, item, value) -> list:
    """``value`` (a list, a YAML-style ``[1, 2]`` or a comma-separated string) as a list of ``item``."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name}: expected a list of {item.__name__}, got {value!r}")
    return [coerce(name, item, v) for v in value]


def field_docs() -> dict[str, str]:
    """The docstring under each :class:`TrainConfig` field (for CLI help), read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(TrainConfig)))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def load_config(yaml_path: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from defaults, then a YAML file, then ``overrides`` (``None`` values skipped).
    In either, ``drafter`` is a synonym of ``head_type``.

    Raises:
        FileNotFoundError: the YAML file does not exist.
        ValueError: the YAML is not valid or not a mapping, a key (in YAML or overrides) is not a field, ``drafter``
            and ``head_type`` both given and different, or a value is invalid (a YAML value of the wrong type is
            reported with the file's name).
    """
    values: dict = {}
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of TrainConfig fields, got {type(loaded).__name__}")
        loaded = _head_type_synonym(loaded, f"config file {path}")
        _check_known(loaded, f"config file {path}")
        for name, value in loaded.items():
            try:
                coerce(name, _field_types()[name], value)
            except ValueError as e:
                raise ValueError(f"config file {path}: {e}") from e
        values.update(loaded)
    overrides = _head_type_synonym({k: v for k, v in (overrides or {}).items() if v is not None}, "overrides")
    _check_known(overrides, "overrides")
    values.update(overrides)
    return TrainConfig(**values)


DRAFTER_SYNONYM = "drafter"
"""A key read as ``head_type`` (the drafter's registered name) in YAML files and overrides."""


def _head_type_synonym(values: dict, where: str) -> dict:
    """``values`` with :data:`DRAFTER_SYNONYM` read as ``head_type``.

    Raises:
        ValueError: both keys given with different values.
    """
    if DRAFTER_SYNONYM not in values:
        return values
    values = dict(values)
    drafter = values.pop(DRAFTER_SYNONYM)
    if "head_type" in values and values["head_type"] != drafter:
        raise ValueError(f"{where}: drafter {drafter!r} and head_type {values['head_type']!r} name the same "
                         "setting: give one")
    values["head_type"] = drafter
    return values


def _check_known(values: dict, where: str) -> None:
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown keys in {where}: {unknown}")


def resume_mismatch(stored: dict, current: TrainConfig) -> list[str]:
    """Fields (outside :data:`RESUMABLE_FIELDS`) whose stored value differs from ``current``, as readable lines.

    A field the stored config lacks (one added after the checkpoint was written) counts as its default, so a
    checkpoint of an older version resumes when the new field is left at its default.
    """
    now = current.to_dict()
    defaults = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
                for f in dataclasses.fields(TrainConfig)}
    stored = {**{k: v for k, v in defaults.items() if k not in stored}, **stored}
    return [
        f"{name}: checkpoint {stored.get(name)!r} != now {now.get(name)!r}"
        for name in sorted(set(stored) | set(now))
        if name not in RESUMABLE_FIELDS and stored.get(name) != now.get(name)
    ]
