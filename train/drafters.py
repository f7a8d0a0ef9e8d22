"""The trainable drafters, by registered name: what each one declares for training (``head_type`` in the config).

The trainer compares no names. It looks ``config.head_type`` up here (:func:`trainable_drafter`, also
``config.trainable``) and reads what the drafter declares:

- **config**: the :class:`train.config.TrainConfig` fields that belong to it (any other drafter changing them from
  their defaults is refused) and its own rules (:meth:`TrainableDrafter.check_config`);
- **training**: :meth:`TrainableDrafter.train`, the whole run. Heads (:class:`HeadsTraining`) share the heads
  trainer (:func:`train.trainer.train_heads`), which reads the rest of their declaration: how they are built
  (over the base's input embeddings too or not, which base layers they fuse, their extra heads-config fields),
  their trainable parameters, their objective (the forward and loss of a step, :mod:`train.objective`) and how they
  are saved and loaded (a heads folder, :mod:`medusa.io.checkpoint`). The draft model (:class:`DraftModelTraining`)
  declares its own run: a separate model distilled toward the base (:mod:`train.draft_model`).

A new trainable drafter is one module (its heads class, registered with
:func:`medusa.drafters.heads.register_head_type`, and, when it trains differently, its objective) and one line here
or in its own module: ``register_trainable(HeadsTraining("name", objective=...))``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from medusa.base import check_layer_indices, learned_position_weight
from medusa.drafters.eagle import default_eagle_layers, eagle_base_settings
from medusa.drafters.heads import HEAD_TYPES
from medusa.io.checkpoint import load_heads, save_heads
from train.objective import DecayedHeadLoss, TrainingTimeTest
from train.sharded import full_weight


class TrainableDrafter(Protocol):
    """What a trainable drafter declares for the trainer.

    Attributes:
        name: the registered name (``head_type``).
        label: what the run writes, for the command's last line ("Medusa heads").
        fields: the config fields that belong to this drafter alone.
        pipeline: which training run trains it (:data:`train.trainer.PIPELINES`): ``"heads"`` (heads over the
            frozen base's states, :func:`train.trainer.train_heads`) or ``"draft_model"`` (a separate model
            distilled toward the base, :func:`train.draft_model.train_draft_model`).
    """

    name: str
    label: str
    fields: tuple[str, ...]
    pipeline: str

    def check_config(self, config) -> None:
        """Refuse a config this drafter cannot train (``ValueError`` naming the problem)."""
        ...

    def trainable_parameters(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters of the module being trained that the optimizer steps (:func:`train.setup.make_optimizer`)."""
        ...


@dataclass(frozen=True)
class HeadsTraining:
    """A heads drafter trained on the frozen base's states (Medusa-1, Cai et al. 2024, section 2.2.1) by the heads
    trainer; its heads class is the one registered as :attr:`name` in :data:`medusa.drafters.heads.HEAD_TYPES`."""

    name: str
    objective: DecayedHeadLoss = DecayedHeadLoss()
    """The forward and loss of a training step (:mod:`train.objective`)."""
    reads_embeddings: bool = False
    """Built over the base's input embeddings ``(V, H)`` as well as its lm_head."""
    fields: tuple[str, ...] = ()
    label: str = "Medusa heads"
    pipeline: str = "heads"
    check: Callable[..., None] | None = None
    """Its own config rules (raise ``ValueError``), besides the shared ones."""

    def __post_init__(self):
        if self.name not in HEAD_TYPES:
            raise ValueError(f"no heads class is registered as {self.name!r} (medusa.drafters.heads."
                             f"register_head_type): the heads trainer builds, saves and loads heads of a registered "
                             f"type; registered: {list(HEAD_TYPES)}")

    def check_config(self, config) -> None:
        if self.check is not None:
            self.check(config)

    def base_layers(self, config, base_config) -> tuple[int, ...]:
        """The base's decoder layers (0-based) whose outputs the heads read after its last hidden state (checked
        against the base's text config ``base_config`` as soon as the base loads): none."""
        return ()

    def heads_fields(self, config, base_config) -> dict:
        """Extra :class:`medusa.drafters.heads.MedusaHeadsConfig` fields of fresh heads: none."""
        return {}

    def position_weight(self, config, model) -> torch.Tensor | None:
        """The base's learned position embedding ``(P, H)`` when the heads need it, else ``None``: not needed."""
        return None

    def trainable_parameters(self, heads: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The parameters the optimizer steps: those of ``heads`` that require a gradient (the shared lm_head
        rows and embeddings are buffers)."""
        return [p for p in heads.parameters() if p.requires_grad]

    def save(self, heads: torch.nn.Module, out_dir: Path, extra_config: dict | None = None,
             state_dict: dict | None = None) -> Path:
        """Write a heads folder (:func:`medusa.io.checkpoint.save_heads`)."""
        return save_heads(heads, out_dir, extra_config=extra_config, state_dict=state_dict)

    def load(self, heads_dir: Path, lm_head: torch.Tensor, **base) -> torch.nn.Module:
        """Heads saved by :meth:`save`, over the base's lm_head (``base``: its embeddings, position embedding and
        layer count, :func:`medusa.io.checkpoint.load_heads`)."""
        return load_heads(heads_dir, lm_head, **base)


def _check_hydra(config) -> None:
    if config.num_layers < 1:
        raise ValueError("head_type hydra needs num_layers >= 1 (its input layer reads the token embeddings)")


def _check_eagle(config) -> None:
    if config.eagle_layers is not None and (not config.eagle_layers or min(config.eagle_layers) < 0):
        raise ValueError(f"eagle_layers must be a non-empty list of decoder layer indices >= 0 (or null), got "
                         f"{config.eagle_layers}")
    if config.num_layers != 1:
        raise ValueError(f"head_type eagle is one decoder layer: num_layers must be 1, got {config.num_layers}")
    if not config.share_lm_head:
        raise ValueError("head_type eagle projects every depth with one lm_head: share_lm_head must be true (the "
                         "drafter would hold num_heads trainable copies and use one)")
    if config.training_mode == "medusa2":
        raise ValueError("head_type eagle reads intermediate base layers, which training_mode medusa2's joint "
                         "stage does not pass through; use training_mode medusa1")


@dataclass(frozen=True)
class EagleTraining(HeadsTraining):
    """The EAGLE-3-style drafter (:mod:`medusa.drafters.eagle`): one decoder layer over fused base layers, trained
    by the training-time test, built from the base's layer settings."""

    def base_layers(self, config, base_config) -> tuple[int, ...]:
        """``config.eagle_layers`` (null: EAGLE-3's low, middle and high layers of this base,
        :func:`medusa.drafters.eagle.default_eagle_layers`).

        The layers must lie inside the base, the base's kind of layer must be one the drafter can be
        (:func:`medusa.drafters.eagle.eagle_base_settings`), and a training window needs rotary positions (the
        drafter's positions start at the window; a base with learned positions would see window-relative positions
        in training and absolute ones when drafting).

        Raises:
            ValueError: a layer index outside the base (naming it and the base's layer count), a rotary embedding
                the drafter does not support, or ``train_window`` on a base with learned positions.
        """
        settings = eagle_base_settings(base_config)
        count = settings["num_hidden_layers"]
        layers = default_eagle_layers(count) if config.eagle_layers is None else config.eagle_layers
        check_layer_indices(layers, count, "eagle_layers")
        if config.train_window and settings["positions"] == "learned":
            raise ValueError(f"train_window={config.train_window} with head_type eagle needs a base with rotary "
                             f"positions: this {settings['model_type']} base has learned positions, which the "
                             "drafter would see window-relative in training; set train_window: null")
        return tuple(layers)

    def heads_fields(self, config, base_config) -> dict:
        """``eagle_layers`` and ``eagle_base`` from the base's text config.

        Raises:
            ValueError: no ``base_config``.
        """
        if base_config is None:
            raise ValueError("head_type eagle needs the base's config (its layer count, attention and MLP shape)")
        return {"eagle_layers": list(self.base_layers(config, base_config)),
                "eagle_base": eagle_base_settings(base_config)}

    def position_weight(self, config, model) -> torch.Tensor | None:
        """The base's whole learned position embedding on a base with learned absolute positions (GPT-2)."""
        if eagle_base_settings(model.config.get_text_config(decoder=True))["positions"] != "learned":
            return None
        return full_weight(learned_position_weight(model), "position embedding")


def _check_draft_model(config) -> None:
    refused = {"training_mode medusa2": config.training_mode == "medusa2",
               "hidden_state_store": bool(config.hidden_state_store), "train_window": bool(config.train_window),
               "init_heads (use draft_init)": bool(config.init_heads),
               "share_lm_head false (the draft projects with its own lm_head, the base's, frozen)":
                   not config.share_lm_head}
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ValueError(f"head_type draft_model trains a separate model on the base's distribution: "
                         f"{', '.join(bad)} cannot be used with it")


@dataclass(frozen=True)
class DraftModelTraining:
    """A separate draft model distilled toward the base (:mod:`train.draft_model`): its objective is the
    teacher's KL at every next-token position (:func:`train.draft_model.draft_loss`), its trainable parameters the
    draft's layers and final norm (embeddings and lm_head frozen, :class:`train.draft_model.DraftStudent`), and it
    is saved as a Hugging Face model folder (:func:`train.draft_model.save_draft_folder`)."""

    name: str = "draft_model"
    label: str = "Draft model"
    fields: tuple[str, ...] = ("draft_layers", "draft_init")
    pipeline: str = "draft_model"

    def check_config(self, config) -> None:
        _check_draft_model(config)

    def trainable_parameters(self, student: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The draft's parameters that require a gradient (the student froze its embeddings and lm_head)."""
        return [p for p in student.parameters() if p.requires_grad]


_TRAINABLE: dict[str, TrainableDrafter] = {}


def register_trainable(drafter: TrainableDrafter) -> TrainableDrafter:
    """Make ``drafter`` trainable as ``head_type: drafter.name``; returns it.

    Raises:
        ValueError: the name is already registered (both declarations named).
    """
    if drafter.name in _TRAINABLE:
        raise ValueError(f"trainable drafter {drafter.name!r} is already registered ({_TRAINABLE[drafter.name]!r}); "
                         f"cannot register {drafter!r} under the same name")
    _TRAINABLE[drafter.name] = drafter
    return drafter


def trainable_drafter(name: str) -> TrainableDrafter:
    """The trainable drafter registered as ``name``.

    Raises:
        ValueError: no such name (the registered ones are listed).
    """
    if name not in _TRAINABLE:
        raise ValueError(f"head_type must be one of {list(_TRAINABLE)}, got {name!r}")
    return _TRAINABLE[name]


def trainable_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_TRAINABLE)


def check_fields(config) -> None:
    """Refuse config fields that belong to another drafter than ``config.head_type``'s, changed from their
    defaults, then apply the drafter's own rules.

    Raises:
        ValueError: naming the fields and the drafter they belong to, or what the drafter's rules refuse.
    """
    own = trainable_drafter(config.head_type)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for other in _TRAINABLE.values():
        changed = [name for name in other.fields
                   if name not in own.fields and getattr(config, name) != defaults[name]]
        if other is not own and changed:
            raise ValueError(f"{', '.join(changed)} belong to head_type {other.name}, not {config.head_type!r}")
    own.check_config(config)


register_trainable(HeadsTraining("medusa"))
register_trainable(HeadsTraining("hydra", reads_embeddings=True, fields=("prefix_layers",), check=_check_hydra))
register_trainable(EagleTraining("eagle", objective=TrainingTimeTest(), reads_embeddings=True,
                                 fields=("eagle_layers", "ttt_steps"), check=_check_eagle))
register_trainable(DraftModelTraining())
