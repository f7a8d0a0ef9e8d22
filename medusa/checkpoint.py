"""Heads-only checkpoints: a folder with ``config.json`` and ``model.safetensors``.

Weight keys: ``blocks.{k}.{j}.linear.{weight,bias}`` (ResBlock j of head k), ``inputs.{k}.{weight,bias}`` (Hydra
heads' input layer), ``lm_heads.{k}.weight`` when the heads own their projection, and ``token_map`` when the head
vocabulary is truncated. ``config.json`` names the ``head_type`` (medusa | hydra) and the ``format_version``;
version 1 folders (Medusa heads, before ``head_type`` existed) still load. Loading checks every key and every
shape (no ``strict=False``) and checks the heads against the base they are put on.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from medusa.heads import HydraHeads, MedusaHeads, MedusaHeadsConfig, build_heads, fingerprint_mismatch, read_json

logger = logging.getLogger(__name__)

HEADS_CONFIG_NAME = "config.json"
HEADS_WEIGHTS_NAME = "model.safetensors"


class HeadsMismatchError(ValueError):
    """The heads do not fit the base model (hidden size, vocabulary, lm_head) or their own weights file."""


def save_heads(heads: MedusaHeads | HydraHeads, out_dir: str | Path, extra_config: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``heads`` into ``out_dir``, atomically.

    The folder is written under a temporary name and swapped in at the end, so a crash never leaves a half-written
    checkpoint where a loader would find it.

    Args:
        heads: the heads to save (weights are saved in their current dtype, on CPU).
        out_dir: destination folder; replaced if it exists.
        extra_config: informational keys stored under ``"training"`` in ``config.json``.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
    try:
        state = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
        save_file(state, str(tmp / HEADS_WEIGHTS_NAME), metadata={"format": "pt"})
        config = heads.config.to_dict()
        if extra_config:
            config["training"] = extra_config
        (tmp / HEADS_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    except BaseException:
        # A failed write (full disk, unserialisable extra_config) must not leave a half-written temp folder behind.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(tmp / HEADS_WEIGHTS_NAME, 0o644)
    if out_dir.exists():
        old = out_dir.with_name(out_dir.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
    return out_dir


def read_heads_config(heads_dir: str | Path) -> MedusaHeadsConfig:
    """Read and validate ``config.json`` of a heads folder.

    Raises:
        FileNotFoundError: the folder or its config is missing.
        ValueError: the config is not valid JSON or has unknown or invalid fields.
    """
    path = Path(heads_dir) / HEADS_CONFIG_NAME
    data = read_json(path, "Medusa heads config")
    if not isinstance(data, dict):
        raise ValueError(f"Medusa heads config {path} must be a JSON object")
    data.pop("training", None)
    return MedusaHeadsConfig.from_dict(data)


def load_heads(heads_dir: str | Path, lm_head_weight: torch.Tensor, check_fingerprint: bool = True,
               embed_weight: torch.Tensor | None = None) -> MedusaHeads | HydraHeads:
    """Load heads from a folder onto a base whose lm_head weight is ``lm_head_weight`` ``(V, H)``.

    ``embed_weight`` is the base's input embedding weight ``(V, H)``, needed by Hydra heads.

    Raises:
        FileNotFoundError: the folder, config or weights file is missing.
        HeadsMismatchError: the base's hidden size, vocabulary size or lm_head differ from the ones the heads were
            trained on, or the weights file has missing, unexpected or mis-shaped keys.
    """
    heads_dir = Path(heads_dir)
    config = read_heads_config(heads_dir)
    vocab, hidden = lm_head_weight.shape
    if hidden != config.hidden_size:
        raise HeadsMismatchError(f"heads expect hidden size {config.hidden_size}, base has {hidden} ({heads_dir})")
    if vocab != config.vocab_size:
        raise HeadsMismatchError(f"heads expect vocabulary size {config.vocab_size}, base has {vocab} ({heads_dir})")
    if check_fingerprint and not config.lm_head_fingerprint:
        logger.warning("%s has no lm_head fingerprint: cannot check the heads were trained for this base", heads_dir)
    if check_fingerprint and (problem := fingerprint_mismatch(config.lm_head_fingerprint, lm_head_weight)):
        raise HeadsMismatchError(f"heads in {heads_dir} were trained for another base: {problem}")
    weights_path = heads_dir / HEADS_WEIGHTS_NAME
    if not weights_path.is_file():
        raise FileNotFoundError(f"no Medusa heads weights at {weights_path}")
    state = load_file(str(weights_path))
    token_map = state.get("token_map")
    try:
        heads = build_heads(config, lm_head_weight, embed_weight, token_map)
    except ValueError as e:
        raise HeadsMismatchError(f"{heads_dir}: {e}") from e
    expected = heads.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise HeadsMismatchError(f"{weights_path}: missing keys {missing}, unexpected keys {unexpected}")
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise HeadsMismatchError(
                f"{weights_path}: {key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}"
            )
    heads.load_state_dict(state, strict=True)
    return heads.to(device=lm_head_weight.device)
