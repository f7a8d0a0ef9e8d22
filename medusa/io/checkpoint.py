"""Heads-only checkpoints: a folder with ``config.json`` and ``model.safetensors``.

Weight keys: ``blocks.{k}.{j}.linear.{weight,bias}`` (ResBlock j of head k), ``inputs.{k}.{weight,bias}`` (Hydra
heads' input layer), ``fc.weight``, ``layer.*`` and ``norm.weight`` (the eagle drafter's fusion, decoder layer and
final norm), ``lm_heads.{k}.weight`` when the heads own their projection, and ``token_map`` when the head
vocabulary is truncated. ``config.json`` names the ``head_type`` (medusa | hydra | eagle) and the
``format_version``; version 1 folders (Medusa heads, before ``head_type`` existed) still load, an eagle folder is
version 4 or later. Loading checks every key and every shape (no ``strict=False``) and checks the heads against the
base they are put on (hidden size, vocabulary, lm_head, and for the eagle drafter the base's decoder layer count).
:func:`check_heads_folder` does every check that needs no base (config fields and types, another project's layout, a
damaged weights file, weight shapes against the config) from the files alone, so a caller can run it before spending
time on the base.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import types
import typing
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from medusa.drafters.heads import (
    HydraHeads,
    MedusaHeads,
    MedusaHeadsConfig,
    build_heads,
    fingerprint_mismatch,
    read_json,
)
from medusa.io.files import atomic_folder

logger = logging.getLogger(__name__)

EAGLE_FORMAT_VERSION = 4
"""The first heads format version that holds the eagle drafter."""

HEADS_CONFIG_NAME = "config.json"
HEADS_WEIGHTS_NAME = "model.safetensors"
# Files that mark a folder written by another Medusa implementation, and what it is.
FOREIGN_WEIGHTS = {
    "medusa_lm_head.safetensors": "a FasterDecoding/Medusa checkpoint",
    "medusa_lm_head.pt": "a FasterDecoding/Medusa checkpoint",
    "pytorch_model.bin": "a PyTorch model folder",
}


class HeadsMismatchError(ValueError):
    """The heads do not fit the base model (hidden size, vocabulary, lm_head) or their own weights file."""


def save_heads(heads: MedusaHeads | HydraHeads, out_dir: str | Path, extra_config: dict | None = None,
               state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``heads`` into ``out_dir``, atomically.

    The folder is written under a temporary name and swapped in at the end, so a crash never leaves a half-written
    checkpoint where a loader would find it.

    Args:
        heads: the heads to save (their config; their weights too unless ``state_dict`` is given).
        out_dir: destination folder; replaced if it exists.
        extra_config: informational keys stored under ``"training"`` in ``config.json``.
        state_dict: the heads' full weights, for heads whose own parameters are shards (FSDP2 DTensors, ZeRO-3
            partitions): gathered by ``accelerator.get_state_dict``. Saved in their dtype, on CPU.

    Raises:
        HeadsMismatchError: a weight is a shard, or the keys or shapes are not the ones ``heads.config`` describes;
            nothing is written.
    """
    out_dir = Path(out_dir)
    state = check_full_state(heads.state_dict() if state_dict is None else state_dict, heads.config, out_dir)
    config = heads.config.to_dict()
    if extra_config:
        config["training"] = extra_config
    with atomic_folder(out_dir) as tmp:
        save_file(state, str(tmp / HEADS_WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / HEADS_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        os.chmod(tmp / HEADS_WEIGHTS_NAME, 0o644)
    return out_dir


def check_full_state(state: dict[str, torch.Tensor], config: MedusaHeadsConfig, out_dir: Path) -> dict:
    """``state`` as plain CPU tensors, after checking it holds every weight of heads with ``config``, whole.

    Raises:
        HeadsMismatchError: a weight is a DTensor shard, or a key or shape differs from ``config``'s heads.
    """
    shards = sorted(k for k, v in state.items() if hasattr(v, "full_tensor"))
    if shards:
        raise HeadsMismatchError(f"cannot save heads to {out_dir}: {shards} are shards (DTensor) of sharded "
                                 "training; pass the full weights of accelerator.get_state_dict (every process)")
    _check_shapes({k: tuple(v.shape) for k, v in state.items()}, expected_shapes(config), out_dir / HEADS_WEIGHTS_NAME)
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def read_heads_config(heads_dir: str | Path) -> MedusaHeadsConfig:
    """Read and validate ``config.json`` of a heads folder.

    Raises:
        FileNotFoundError: the folder or its config is missing.
        ValueError: the folder is in another project's format, or the config is not valid JSON, misses a required
            field, has an unknown field or a field of the wrong type or value; the message names the file.
    """
    heads_dir = Path(heads_dir)
    if not heads_dir.is_dir():
        raise FileNotFoundError(f"Medusa heads folder not found: {heads_dir}")
    path = heads_dir / HEADS_CONFIG_NAME
    _check_not_foreign(heads_dir, path)
    data = read_json(path, "Medusa heads config")
    if not isinstance(data, dict):
        raise ValueError(f"Medusa heads config {path} must be a JSON object, got {type(data).__name__}")
    data.pop("training", None)
    _check_config_fields(data, path)
    if data.get("head_type") == "eagle" and data.get("format_version", 1) < EAGLE_FORMAT_VERSION:
        raise ValueError(f"Medusa heads config {path}: head_type 'eagle' in format_version "
                         f"{data.get('format_version', 1)}; the eagle drafter exists from version "
                         f"{EAGLE_FORMAT_VERSION} on (a damaged or hand-edited config?)")
    try:
        return MedusaHeadsConfig.from_dict(data)
    except ValueError as e:
        raise ValueError(f"Medusa heads config {path}: {e}") from e


def _check_not_foreign(heads_dir: Path, config_path: Path) -> None:
    """Name the format of a folder written by another project (FasterDecoding/Medusa, vLLM, a whole model)."""
    ours = f"this project's heads format ({HEADS_CONFIG_NAME} with hidden_size/vocab_size/num_heads, and " \
           f"{HEADS_WEIGHTS_NAME})"
    config = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            config = {}  # reported by the reader with the decoding error
    if "medusa_num_heads" in config or "medusa_num_layers" in config:
        raise ValueError(f"{config_path} has medusa_num_heads/medusa_num_layers: {heads_dir} is a "
                         f"FasterDecoding/Medusa checkpoint, not {ours}")
    model_type = config.get("model_type")
    if model_type == "medusa":
        raise ValueError(f"{config_path} has model_type 'medusa': {heads_dir} is a vLLM Medusa checkpoint, not {ours}")
    if isinstance(model_type, str) and model_type != "medusa_heads":
        raise ValueError(f"{config_path} has model_type {model_type!r}: {heads_dir} looks like a model folder (the "
                         f"base?), not {ours}")
    if not (heads_dir / HEADS_WEIGHTS_NAME).exists():
        for name, what in FOREIGN_WEIGHTS.items():
            if (heads_dir / name).exists():
                raise ValueError(f"{heads_dir / name}: {heads_dir} is {what}, not {ours}")


def _check_config_fields(data: dict, path: Path) -> None:
    """Every required :class:`MedusaHeadsConfig` field present and every field of its annotated type."""
    hints = typing.get_type_hints(MedusaHeadsConfig)
    for f in dataclasses.fields(MedusaHeadsConfig):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in data:
            if required:
                raise ValueError(f"Medusa heads config {path} misses the required field {f.name!r}")
            continue
        if not _has_type(data[f.name], hints[f.name]):
            raise ValueError(f"Medusa heads config {path}: field {f.name!r} must be {_type_name(hints[f.name])}, "
                             f"got {data[f.name]!r}")


def _has_type(value, annotation) -> bool:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return any(_has_type(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    origin = typing.get_origin(annotation) or annotation
    return isinstance(value, origin)


def _type_name(annotation) -> str:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def check_heads_folder(heads_dir: str | Path) -> MedusaHeadsConfig:
    """Check a heads folder from its files alone, without a base model; returns its config.

    Reads the config (:func:`read_heads_config`) and only the header of the weights file, and compares every key and
    shape with what the config describes.

    Raises:
        FileNotFoundError: the folder, config or weights file is missing.
        ValueError: see :func:`read_heads_config`; or the weights file is truncated or not a safetensors file.
        HeadsMismatchError: the weights have missing, unexpected or mis-shaped keys for the config.
    """
    heads_dir = Path(heads_dir)
    config = read_heads_config(heads_dir)
    path = heads_dir / HEADS_WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no Medusa heads weights at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
        raise ValueError(f"Medusa heads weights {path} are damaged (truncated or not a safetensors file): {e}") from e
    _check_shapes(shapes, expected_shapes(config), path)
    return config


def expected_shapes(config: MedusaHeadsConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the weights file of heads with ``config`` (built on the meta device: nothing allocated)."""
    lm_head = torch.empty(config.vocab_size, config.hidden_size, device="meta")
    token_map = None if config.head_vocab_size is None else torch.arange(config.head_vocab_size)
    position = None  # the eagle drafter on a learned-position base needs one; it is never saved
    if config.eagle_base is not None and config.eagle_base.get("positions") == "learned":
        position = torch.empty(config.eagle_base.get("max_position_embeddings") or 1, config.hidden_size,
                               device="meta")
    with torch.device("meta"):
        heads = build_heads(config, lm_head, lm_head, token_map, position_weight=position)
    return {key: tuple(value.shape) for key, value in heads.state_dict().items()}


def _check_shapes(shapes: dict[str, tuple], expected: dict[str, tuple], path: Path) -> None:
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise HeadsMismatchError(f"{path}: missing keys {missing}, unexpected keys {unexpected} for the heads its "
                                 f"{HEADS_CONFIG_NAME} describes")
    for key, shape in shapes.items():
        if shape != expected[key]:
            raise HeadsMismatchError(f"{path}: {key} has shape {shape}, expected {expected[key]} from its "
                                     f"{HEADS_CONFIG_NAME}")


def load_heads(heads_dir: str | Path, lm_head_weight: torch.Tensor, check_fingerprint: bool = True,
               embed_weight: torch.Tensor | None = None, position_weight: torch.Tensor | None = None,
               num_base_layers: int | None = None) -> torch.nn.Module:
    """Load heads from a folder onto a base whose lm_head weight is ``lm_head_weight`` ``(V, H)``.

    ``embed_weight`` is the base's input embedding weight ``(V, H)``, needed by Hydra heads and the eagle drafter;
    ``position_weight`` ``(P, H)`` its learned position embedding, needed by the eagle drafter on such a base
    (GPT-2); ``num_base_layers`` its decoder layer count, checked against an eagle drafter's (which reads the
    outputs of some of those layers). :func:`load_heads_for_base` passes all of them from a loaded base.

    Raises:
        FileNotFoundError: the folder, config or weights file is missing.
        ValueError: the folder is damaged or in another format (see :func:`check_heads_folder`), or a weight holds
            NaN or infinity.
        HeadsMismatchError: the base's hidden size, vocabulary size, lm_head or (eagle) decoder layer count differ
            from the ones the heads were trained on, or the weights file has missing, unexpected or mis-shaped keys.
    """
    heads_dir = Path(heads_dir)
    config = check_heads_folder(heads_dir)
    if problems := base_problems(config, lm_head_weight, num_base_layers):
        raise HeadsMismatchError(f"heads in {heads_dir} do not fit this base: " + "; ".join(problems))
    if config.head_type == "eagle" and num_base_layers is None:
        logger.warning("%s: the base's layer count was not given: cannot check the eagle drafter's layers fit it",
                       heads_dir)
    if check_fingerprint and not config.lm_head_fingerprint:
        logger.warning("%s has no lm_head fingerprint: cannot check the heads were trained for this base", heads_dir)
    if check_fingerprint and (problem := fingerprint_mismatch(config.lm_head_fingerprint, lm_head_weight)):
        raise HeadsMismatchError(f"heads in {heads_dir} were trained for another base: {problem}")
    weights_path = heads_dir / HEADS_WEIGHTS_NAME
    try:
        state = load_file(str(weights_path))
    except Exception as e:  # the header was readable; the data may still be damaged
        raise ValueError(f"Medusa heads weights {weights_path} are damaged: {e}") from e
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ValueError(f"Medusa heads weights {weights_path}: {key} holds NaN or infinite values")
    token_map = state.get("token_map")
    try:
        heads = build_heads(config, lm_head_weight, embed_weight, token_map, position_weight=position_weight)
    except ValueError as e:
        raise HeadsMismatchError(f"{heads_dir}: {e}") from e
    heads.load_state_dict(state, strict=True)
    return heads.to(device=lm_head_weight.device)


def base_problems(config: MedusaHeadsConfig, lm_head_weight: torch.Tensor, num_base_layers: int | None) -> list[str]:
    """How a base (its lm_head ``(V, H)`` and decoder layer count) differs from the one heads of ``config`` were
    trained on, in words: hidden size, vocabulary size and, for the eagle drafter, decoder layer count (empty when
    they fit; ``num_base_layers`` ``None`` skips the layer count)."""
    vocab, hidden = lm_head_weight.shape
    problems = []
    if hidden != config.hidden_size:
        problems.append(f"heads expect hidden size {config.hidden_size}, base has {hidden}")
    if vocab != config.vocab_size:
        problems.append(f"heads expect vocabulary size {config.vocab_size}, base has {vocab}")
    trained = (config.eagle_base or {}).get("num_hidden_layers")
    if trained is not None and num_base_layers is not None and trained != num_base_layers:
        problems.append(f"the eagle drafter reads layers {config.eagle_layers} of a base with {trained} decoder "
                        f"layers, base has {num_base_layers}")
    return problems


def load_heads_for_base(heads_dir: str | Path, base, check_fingerprint: bool = True) -> torch.nn.Module:
    """:func:`load_heads` onto a loaded base causal LM ``base``: its lm_head, input embeddings, decoder layer count
    and (for the eagle drafter on a base with learned positions) its position embedding. Raises what
    :func:`load_heads` raises."""
    from medusa.base import learned_position_weight

    config = check_heads_folder(heads_dir)
    learned = config.eagle_base is not None and config.eagle_base.get("positions") == "learned"
    return load_heads(heads_dir, base.get_output_embeddings().weight, check_fingerprint,
                      embed_weight=base.get_input_embeddings().weight,
                      position_weight=learned_position_weight(base) if learned else None,
                      num_base_layers=base.config.get_text_config(decoder=True).num_hidden_layers)
