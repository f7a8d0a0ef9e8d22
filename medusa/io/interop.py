"""Heads in other projects' layouts: export to vLLM's Medusa model, import from FasterDecoding/Medusa and vLLM.

vLLM layout (followed from vllm-project/vllm ``vllm/model_executor/models/medusa.py`` at commit 09cddad8 and
``vllm/transformers_utils/configs/medusa.py`` at commit 4bb77b32; the loader is the same at 01dbb081):

- ``config.json``: ``model_type: "medusa"``, ``num_heads``, ``num_hidden_layers`` (ResBlocks per head),
  ``hidden_size``, ``vocab_size``, ``truncated_vocab_size`` (the head vocabulary; equal to ``vocab_size`` when not
  truncated), ``medusa_fc_bias`` (the ResBlocks' Linear has a bias; vLLM's default is false), ``original_lm_head``
  (one projection shared by every head, read from ``lm_heads.0.weight``).
- ``model.safetensors``: ``blocks.{k}.layers.{j}.weight`` / ``.bias`` (block ``x + SiLU(W x + b)``, residual
  applied, as ours), ``lm_heads.{k}.weight`` ``(Vt, H)`` and, for a truncated vocabulary, ``token_map`` ``(Vt,)``
  (head index -> base token id; vLLM scatters the head logits into a full-vocabulary row of -inf).
- vLLM skips weight names it does not know without a word, so a layout mismatch serves random heads. The exporter
  therefore refuses heads whose computation the layout cannot hold (Hydra heads, extra layers) and checks the
  written files against a re-implementation of vLLM's forward (:func:`vllm_logits`) before it returns.

FasterDecoding/Medusa layout: ``config.json`` with ``medusa_num_heads``, ``medusa_num_layers`` and
``base_model_name_or_path``; ``medusa_lm_head.safetensors`` (older releases ``medusa_lm_head.pt``) with
``{k}.{j}.linear.weight`` / ``.bias`` for ResBlock j of head k and ``{k}.{L}.weight`` for head k's own vocab
projection. Head and layer counts are read from the weights and checked against the config (some published configs
carry a wrong head count).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from medusa.drafters.heads import (
    MedusaHeads,
    MedusaHeadsConfig,
    ResBlock,
    build_heads,
    fingerprint_mismatch,
    lm_head_fingerprint,
    read_json,
)
from medusa.io.checkpoint import save_heads
from medusa.io.files import atomic_folder

logger = logging.getLogger(__name__)

VLLM_CONFIG_NAME = "config.json"
VLLM_WEIGHTS_NAME = "model.safetensors"
VLLM_LAYOUT = ("vllm-project/vllm@09cddad8 vllm/model_executor/models/medusa.py, "
               "@4bb77b32 vllm/transformers_utils/configs/medusa.py")
# Provenance block in an exported config.json (vLLM keeps unknown config keys as attributes and ignores them; its
# config reader renames every top-level key holding both "num" and "heads"/"layers", so none is used here).
EXPORT_INFO_KEY = "medusa_heads_export"
MEDUSA_V1_CONFIG_NAME = "config.json"
MEDUSA_V1_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
# Config fields of ours the vLLM layout expresses (or that are provenance only). Any other field must be off.
EXPRESSIBLE_FIELDS = {"hidden_size", "vocab_size", "num_heads", "num_layers", "head_vocab_size", "share_lm_head",
                      "base_model_name_or_path", "lm_head_fingerprint", "head_type", "model_type", "format_version"}


class FormatError(ValueError):
    """Heads that the target layout cannot express, or a source checkpoint that is damaged or inconsistent."""


# ---------------------------------------------------------------------------------------------------------------------
# Export: ours -> vLLM.


def export_vllm(heads: MedusaHeads, out_dir: str | Path, lm_head_weight: torch.Tensor | None = None) -> Path:
    """Write ``heads`` in the layout vLLM's Medusa model loads; returns ``out_dir``.

    Args:
        heads: Medusa heads (not Hydra).
        out_dir: destination folder; must not exist or be empty. Written under a temporary name and renamed.
        lm_head_weight: the base's lm_head ``(V, H)``; needed when the heads share it (the shared projection is not
            saved with our heads), checked against the heads' fingerprint. Written once, as ``lm_heads.0.weight``
            with ``original_lm_head: true``.

    Raises:
        FormatError: the heads hold something vLLM's Medusa model cannot compute (see :func:`check_exportable`),
            shared heads without ``lm_head_weight`` or with another base's, or the written files do not reproduce
            the heads' logits.
    """
    check_exportable(heads)
    config = heads.config
    state, original_lm_head = _vllm_state(heads, lm_head_weight)
    vllm_config = {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size, "num_heads": config.num_heads, "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": heads.head_vocab_size, "medusa_fc_bias": True, "original_lm_head": original_lm_head,
        "base_model_name_or_path": config.base_model_name_or_path,
        EXPORT_INFO_KEY: {"layout": VLLM_LAYOUT, "lm_head_fingerprint": config.lm_head_fingerprint},
    }
    _check_same_logits(heads, vllm_config, state)
    return write_export_folder(out_dir, state, VLLM_WEIGHTS_NAME, vllm_config, VLLM_CONFIG_NAME)


def write_export_folder(out_dir: str | Path, state: dict, weights_name: str, config: dict, config_name: str) -> Path:
    """Write ``state`` (safetensors) and ``config`` (JSON) into the new folder ``out_dir``, atomically (nothing is
    left behind on failure); returns the folder.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty (:func:`_check_new_folder`).
    """
    out_dir = _check_new_folder(out_dir)
    with atomic_folder(out_dir) as tmp:
        save_file(state, str(tmp / weights_name), metadata={"format": "pt"})
        (tmp / config_name).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def check_exportable(heads: nn.Module) -> None:
    """Refuse heads whose computation vLLM's Medusa model (L ResBlocks then a vocab projection) cannot hold.

    Raises:
        FormatError: naming what cannot be expressed: Hydra heads, a config field switched on that the layout has
            no place for, or modules other than ResBlocks and bias-free projections.
    """
    config = heads.config
    if config.head_type == "hydra":
        raise FormatError("head_type 'hydra' cannot be exported to vLLM: its Medusa model feeds each head the hidden "
                          "state only, while Hydra heads also read the embeddings of the draft tokens before them")
    if config.head_type != "medusa" or type(heads) is not MedusaHeads:
        raise FormatError(f"head_type {config.head_type!r} ({type(heads).__name__}) cannot be exported to vLLM: its "
                          "Medusa model holds only L ResBlocks and a vocab projection per head")
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name not in EXPRESSIBLE_FIELDS and not _is_default(f, value):
            raise FormatError(f"heads config field {f.name}={value!r} has no counterpart in vLLM's Medusa layout (L "
                              "ResBlocks and a vocab projection per head): exporting would drop what it adds")
    for k, block in enumerate(heads.blocks):
        layers = list(block)
        if len(layers) != config.num_layers or any(type(layer) is not ResBlock for layer in layers):
            raise FormatError(f"head {k} holds {[type(layer).__name__ for layer in layers]}, not {config.num_layers} "
                              "ResBlocks: vLLM's Medusa layout cannot express it")
    expected = {f"blocks.{k}.{j}.linear.{p}" for k in range(config.num_heads) for j in range(config.num_layers)
                for p in ("weight", "bias")}
    if heads.lm_heads is not None:
        expected |= {f"lm_heads.{k}.weight" for k in range(config.num_heads)}
    if heads.token_map is not None:
        expected.add("token_map")
    unknown = sorted(set(heads.state_dict()) - expected)
    if unknown:
        raise FormatError(f"heads hold weights vLLM's Medusa layout has no place for: {unknown}")


def _is_default(f: dataclasses.Field, value) -> bool:
    """A config field left at its default (a field without one counts as off when its value is falsy)."""
    if f.default is not dataclasses.MISSING:
        return value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return value == f.default_factory()
    return not value


def _vllm_state(heads: MedusaHeads, lm_head_weight: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], bool]:
    """vLLM weight name -> tensor, and whether one projection serves every head (``original_lm_head``)."""
    config = heads.config
    state = {}
    for k, block in enumerate(heads.blocks):
        for j, layer in enumerate(block):
            state[f"blocks.{k}.layers.{j}.weight"] = layer.linear.weight  # (H, H)
            state[f"blocks.{k}.layers.{j}.bias"] = layer.linear.bias  # (H,)
    if heads.lm_heads is not None:
        for k, head in enumerate(heads.lm_heads):
            state[f"lm_heads.{k}.weight"] = head.weight  # (Vh, H)
        original_lm_head = False
    else:
        if lm_head_weight is None:
            raise FormatError("these heads share the base's lm_head, which is not saved with them: give the base "
                              "(--base) so its rows can be written as vLLM's original_lm_head")
        if tuple(lm_head_weight.shape) != (config.vocab_size, config.hidden_size):
            raise FormatError(f"the base's lm_head is {tuple(lm_head_weight.shape)}, the heads were trained on "
                              f"({config.vocab_size}, {config.hidden_size})")
        if problem := fingerprint_mismatch(config.lm_head_fingerprint, lm_head_weight):
            raise FormatError(f"the base given is not the one the heads were trained on: {problem}")
        rows = lm_head_weight.detach()
        if heads.token_map is not None:
            rows = rows[heads.token_map.to(rows.device)]  # (Vh, H)
        state["lm_heads.0.weight"] = rows
        original_lm_head = True
    if heads.token_map is not None:
        state["token_map"] = heads.token_map  # (Vh,)
    return {name: t.detach().cpu().contiguous() for name, t in state.items()}, original_lm_head


def vllm_logits(config: dict, state: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """What vLLM's ``Medusa.forward`` + ``compute_logits`` return for a vLLM-layout checkpoint (logit_scale 1), in
    ``hidden``'s dtype (vLLM casts every weight to the model dtype).

    Args:
        config: the checkpoint's ``config.json`` dict.
        state: its weights (names as in the file, ``medusa_heads.`` prefix removed).
        hidden: ``(N, H)`` base hidden states.

    Returns:
        ``(K, N, V)`` logits over the full vocabulary; -inf outside the token map when the vocabulary is truncated.
    """
    out = []
    truncated = config.get("truncated_vocab_size") or config["vocab_size"]
    token_map = state.get("token_map") if truncated < config["vocab_size"] else None
    for k in range(config["num_heads"]):
        x = hidden
        for j in range(config["num_hidden_layers"]):
            weight = state[f"blocks.{k}.layers.{j}.weight"].to(x.dtype)  # (H, H)
            bias = state.get(f"blocks.{k}.layers.{j}.bias") if config.get("medusa_fc_bias", False) else None
            x = x + nn.functional.silu(nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype)))
        if config.get("original_lm_head", False):
            weight = state["lm_head.weight"] if "lm_head.weight" in state else state["lm_heads.0.weight"]
        else:
            weight = state[f"lm_heads.{k}.weight"]
        if token_map is not None and weight.shape[0] > len(token_map):
            weight = weight[token_map]
        logits = nn.functional.linear(x, weight.to(x.dtype))  # (N, Vt)
        if token_map is not None:
            full = torch.full((*logits.shape[:-1], config["vocab_size"]), -torch.inf, dtype=logits.dtype)  # (N, V)
            full[..., token_map] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)  # (K, N, V)


def _check_same_logits(heads: MedusaHeads, vllm_config: dict, state: dict) -> None:
    """The exported weights, run the way vLLM runs them, give the heads' own logits (up to matmul rounding)."""
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    hidden = torch.randn(3, heads.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)  # (3, H)
    device = next(heads.buffers(), next(heads.parameters(), hidden)).device
    with torch.no_grad():
        ours = heads(hidden.to(device)).cpu()  # (K, 3, Vh)
        theirs = vllm_logits(vllm_config, state, hidden)  # (K, 3, V)
    if heads.token_map is not None:
        theirs = theirs[..., heads.token_map.cpu()]  # (K, 3, Vh)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    scale = ours.float().abs().max().clamp_min(1.0)
    if ours.shape != theirs.shape or (ours.float() - theirs.float()).abs().max() > tolerance * scale:
        raise FormatError("the vLLM-layout weights do not reproduce the heads' logits: the heads compute something "
                          "vLLM's Medusa model does not")


# ---------------------------------------------------------------------------------------------------------------------
# Import: FasterDecoding/Medusa or vLLM -> ours.


def import_medusa_v1(src: str | Path, out_dir: str | Path, lm_head_weight: torch.Tensor | None = None) -> Path:
    """Convert a FasterDecoding/Medusa heads folder into our heads folder (per-head vocab projections).

    Args:
        src: folder with ``config.json`` and ``medusa_lm_head.safetensors`` (or ``medusa_lm_head.pt``, read with
            ``torch.load(weights_only=True)``).
        out_dir: our heads folder to write; must not exist or be empty.
        lm_head_weight: the base's lm_head ``(V, H)``, optional: checked against the heads' shapes and stored as
            their fingerprint, so loading onto another base is refused later.

    Raises:
        FileNotFoundError: no config or weights file.
        FormatError: weights that are not a flat dict of tensors, unknown keys, inconsistent shapes, non-finite
            values, or a head / layer count in ``config.json`` other than the weights hold (both are named).
    """
    src = Path(src)
    config = _read_source_config(src / MEDUSA_V1_CONFIG_NAME, "FasterDecoding/Medusa config")
    path = next((src / name for name in MEDUSA_V1_WEIGHTS if (src / name).is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no {' or '.join(MEDUSA_V1_WEIGHTS)} in {src}")
    weights = _read_weights(path)
    blocks, projections = _parse_keys(weights, path, {
        r"(\d+)\.(\d+)\.linear\.(weight|bias)": "block", r"(\d+)\.(\d+)\.weight": "projection"})
    num_heads, num_layers = _counts(blocks, projections, path)
    if num_layers and not any(p == "bias" for (_, _, p) in blocks):
        raise FormatError(f"{path}: the ResBlocks have no bias: FasterDecoding/Medusa's ResBlock Linear has one")
    # Head k's projection sits right after its ResBlocks in its nn.Sequential: index num_layers.
    misplaced = sorted(f"{k}.{j}.weight" for (k, j) in projections if j != num_layers)
    if misplaced:
        raise FormatError(f"{path}: vocab projections {misplaced} are not at index {num_layers}, after the "
                          f"{num_layers} ResBlocks")
    _check_count(config, "medusa_num_heads", num_heads, "heads", path)
    _check_count(config, "medusa_num_layers", num_layers, "ResBlocks per head", path)
    state = {f"blocks.{k}.{j}.linear.{p}": weights[f"{k}.{j}.linear.{p}"]
             for k in range(num_heads) for j in range(num_layers) for p in ("weight", "bias")}
    state |= {f"lm_heads.{k}.weight": weights[f"{k}.{num_layers}.weight"] for k in range(num_heads)}
    base = config.get("base_model_name_or_path", "")
    return _save_imported(state, num_heads, num_layers, None, False, str(base or ""), out_dir, path, lm_head_weight)


def import_vllm(src: str | Path, out_dir: str | Path, lm_head_weight: torch.Tensor | None = None) -> Path:
    """Convert a vLLM Medusa folder (for example one :func:`export_vllm` wrote) into our heads folder.

    With ``original_lm_head`` (one projection for every head) and ``lm_head_weight`` given, the projection must equal
    the base's lm_head rows and the heads are imported as sharing the base's lm_head; without ``lm_head_weight`` each
    head gets its own copy of the projection (nothing is dropped, but the folder is K times larger).

    Raises:
        FileNotFoundError: no config or ``*.safetensors`` weights.
        FormatError: ``model_type`` is not "medusa"; unknown or missing weight names (vLLM would skip or leave them
            uninitialised); biases present with ``medusa_fc_bias`` false or absent with it true; a head or layer
            count in ``config.json`` other than the weights hold; a token map that disagrees with
            ``truncated_vocab_size``; an original_lm_head other than the base's rows.
    """
    src = Path(src)
    config = _vllm_config_keys(_read_source_config(src / VLLM_CONFIG_NAME, "vLLM Medusa config"))
    if config.get("model_type") != "medusa":
        raise FormatError(f"{src / VLLM_CONFIG_NAME} has model_type {config.get('model_type')!r}, not 'medusa': not "
                          "a vLLM Medusa checkpoint")
    weights, path = _read_vllm_weights(src)
    blocks, projections = _parse_keys(weights, path, {
        r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)": "block", r"lm_heads\.(\d+)\.weight": "projection",
        r"lm_head\.weight": "projection", r"token_map": "token_map"})
    num_heads = _head_count(blocks, projections, config, path)
    num_layers = _layer_count(blocks, num_heads, path)
    _check_count(config, "num_heads", num_heads, "heads", path)
    _check_count(config, "num_hidden_layers", num_layers, "ResBlocks per head", path)
    has_bias = any(p == "bias" for (_, _, p) in blocks)
    if blocks and bool(config.get("medusa_fc_bias", False)) != has_bias:
        raise FormatError(f"{path}: medusa_fc_bias is {config.get('medusa_fc_bias', False)} in {VLLM_CONFIG_NAME} "
                          f"but the ResBlocks {'have' if has_bias else 'have no'} biases: vLLM would "
                          f"{'skip' if has_bias else 'not initialise'} them")
    token_map = _vllm_token_map(config, weights, path)
    state = {}
    for k in range(num_heads):
        for j in range(num_layers):
            weight = weights[f"blocks.{k}.layers.{j}.weight"]  # (H, H)
            state[f"blocks.{k}.{j}.linear.weight"] = weight
            state[f"blocks.{k}.{j}.linear.bias"] = weights.get(f"blocks.{k}.layers.{j}.bias",
                                                               torch.zeros(len(weight), dtype=weight.dtype))
    rows = _vllm_projections(config, weights, num_heads, token_map, path)  # K x (Vh, H)
    share = False
    if config.get("original_lm_head", False) and lm_head_weight is not None:
        base_rows = lm_head_weight.detach().cpu() if token_map is None else lm_head_weight.detach().cpu()[token_map]
        if base_rows.shape != rows[0].shape or not torch.equal(base_rows.to(rows[0].dtype), rows[0]):
            raise FormatError(f"{path}: the original_lm_head rows differ from the base's lm_head: import without the "
                              "base to keep them as per-head projections")
        share = True
    else:
        state |= {f"lm_heads.{k}.weight": rows[k] for k in range(num_heads)}
    info = config.get(EXPORT_INFO_KEY) if isinstance(config.get(EXPORT_INFO_KEY), dict) else {}
    fingerprint = info.get("lm_head_fingerprint") or {}
    base = str(config.get("base_model_name_or_path") or "")
    return _save_imported(state, num_heads, num_layers, token_map, share, base, out_dir, path, lm_head_weight,
                          fingerprint, vocab_size=config.get("vocab_size"))


def _vllm_config_keys(config: dict) -> dict:
    """The config as vLLM's ``MedusaConfig.from_pretrained`` reads it: a key holding "num" and "heads" becomes
    ``num_heads``, one holding "num" and "layers" ``num_hidden_layers`` (so ``medusa_num_heads`` works there too)."""
    renamed = {}
    for key, value in config.items():
        if "num" in key and "heads" in key:
            key = "num_heads"
        elif "num" in key and "layers" in key:
            key = "num_hidden_layers"
        renamed[key] = value
    return renamed


def _read_source_config(path: Path, what: str) -> dict:
    config = read_json(path, what)
    if not isinstance(config, dict):
        raise FormatError(f"{what} {path} must be a JSON object, got {type(config).__name__}")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A flat ``name -> tensor`` dict from a ``.safetensors`` file or a ``.pt`` file read with weights_only=True."""
    if path.suffix == ".safetensors":
        return _read_safetensors(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise FormatError(f"{path} is not a plain torch file of tensors (read with weights_only=True, no arbitrary "
                          f"code): {str(e).splitlines()[0]}") from e
    if not isinstance(state, dict) or not state:
        raise FormatError(f"{path} must hold a dict of name -> tensor, got {type(state).__name__}")
    odd = sorted(str(name) for name, value in state.items() if not isinstance(value, torch.Tensor))
    if odd:
        raise FormatError(f"{path} holds entries that are not tensors: {odd[:5]}")
    return state


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises its own SafetensorError for a damaged file
        raise FormatError(f"{path} is damaged (truncated or not a safetensors file): {e}") from e


def _read_vllm_weights(src: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every ``*.safetensors`` file of the folder (as vLLM reads them), ``medusa_heads.`` prefixes removed."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {src}")
    weights = {}
    for path in files:
        for name, value in _read_safetensors(path).items():
            name = name.removeprefix("medusa_heads.")
            if name in weights:
                raise FormatError(f"{path}: weight {name} appears in more than one file of {src}")
            weights[name] = value
    return weights, files[0] if len(files) == 1 else src


def _parse_keys(weights: dict, path: Path, patterns: dict[str, str]) -> tuple[set, set]:
    """``(blocks, projections)``: ``(k, j, param)`` of each ResBlock tensor and ``(k, j)`` of each vocab
    projection (``(0, 0)`` for a pattern without groups); any name no pattern matches is an error (vLLM would skip
    it, the converter must not)."""
    blocks, projections, unknown = set(), set(), []
    for name in weights:
        for pattern, kind in patterns.items():
            match = re.fullmatch(pattern, name)
            if match:
                groups = match.groups()
                if kind == "block":
                    blocks.add((int(groups[0]), int(groups[1]), groups[2]))
                elif kind == "projection":
                    projections.add((int(groups[0]) if groups else 0, int(groups[1]) if len(groups) > 1 else 0))
                break
        else:
            unknown.append(name)
    if unknown:
        raise FormatError(f"{path}: unknown weight names {sorted(unknown)[:8]}: not the layout expected there")
    for name, value in weights.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise FormatError(f"{path}: {name} holds NaN or infinite values")
    return blocks, projections


def _counts(blocks: set, projections: set, path: Path) -> tuple[int, int]:
    """Head and layer counts of a FasterDecoding/Medusa state: heads 0..K-1, each with L ResBlocks (weight and
    bias) and one projection."""
    heads = sorted({k for k, _, _ in blocks} | {k for k, _ in projections})
    if not heads or heads != list(range(len(heads))):
        raise FormatError(f"{path}: head indices {heads} are not 0..K-1")
    num_layers = _layer_count(blocks, len(heads), path)
    for k in heads:
        if sum(1 for kk, _ in projections if kk == k) != 1:
            raise FormatError(f"{path}: head {k} needs exactly one vocab projection {k}.{num_layers}.weight")
    return len(heads), num_layers


def _head_count(blocks: set, projections: set, config: dict, path: Path) -> int:
    """Heads in a vLLM state: from the ResBlocks, and from the projections unless one serves every head."""
    heads = {k for k, _, _ in blocks}
    if not config.get("original_lm_head", False):
        heads |= {k for k, _ in projections}
    if not heads:  # no ResBlock and one shared projection: only the config says how many heads
        return int(config.get("num_heads", 0)) or 1
    if sorted(heads) != list(range(len(heads))):
        raise FormatError(f"{path}: head indices {sorted(heads)} are not 0..K-1")
    return len(heads)


def _layer_count(blocks: set, num_heads: int, path: Path) -> int:
    """ResBlocks per head: the same 0..L-1 in every head, each with the same parameters (weight, and bias or not)."""
    layers = {k: sorted({j for kk, j, _ in blocks if kk == k}) for k in range(num_heads)}
    params = {k: {(j, p) for kk, j, p in blocks if kk == k} for k in range(num_heads)}
    for k in range(num_heads):
        if layers[k] != list(range(len(layers[0]))) or len(layers[k]) != len(layers[0]):
            raise FormatError(f"{path}: head {k} has ResBlocks {layers[k]}, head 0 has {layers[0]}")
        if params[k] != params[0] or any((j, "weight") not in params[k] for j in layers[k]):
            missing = sorted({(j, p) for j in layers[0] for p in ("weight", "bias")} - params[k])
            raise FormatError(f"{path}: head {k} misses ResBlock tensors (layer, param) {missing}")
    return len(layers[0])


def _check_count(config: dict, field: str, found: int, what: str, path: Path) -> None:
    if field in config and config[field] != found:
        raise FormatError(f"{field}={config[field]!r} in {path.parent / 'config.json'} but the weights "
                          f"{path.name} hold {found} {what}")


def _vllm_token_map(config: dict, weights: dict, path: Path) -> torch.Tensor | None:
    vocab = config.get("vocab_size")
    truncated = config.get("truncated_vocab_size") or vocab
    token_map = weights.get("token_map")
    if not isinstance(vocab, int) or not isinstance(truncated, int):
        raise FormatError(f"{path.parent / VLLM_CONFIG_NAME} needs integer vocab_size (and truncated_vocab_size)")
    if truncated < vocab and token_map is None:
        raise FormatError(f"{path}: truncated_vocab_size={truncated} < vocab_size={vocab} but no token_map")
    if truncated == vocab and token_map is not None:
        raise FormatError(f"{path}: a token_map but truncated_vocab_size == vocab_size={vocab}: vLLM ignores it")
    if token_map is not None and (token_map.ndim != 1 or len(token_map) != truncated):
        raise FormatError(f"{path}: token_map has shape {tuple(token_map.shape)}, truncated_vocab_size={truncated}")
    return None if token_map is None else token_map.long()


def _vllm_projections(config: dict, weights: dict, num_heads: int, token_map, path: Path) -> list[torch.Tensor]:
    """Each head's ``(Vh, H)`` projection, as vLLM loads it (one shared when ``original_lm_head``)."""
    if config.get("original_lm_head", False):
        names = [n for n in ("lm_head.weight", "lm_heads.0.weight") if n in weights]
        extra = sorted(n for n in weights if n.startswith("lm_heads.") and n != "lm_heads.0.weight")
        if len(names) != 1 or extra:
            raise FormatError(f"{path}: original_lm_head needs exactly one of lm_head.weight / lm_heads.0.weight, "
                              f"found {names + extra} (vLLM would skip the others)")
        rows = [weights[names[0]]] + [weights[names[0]].clone() for _ in range(num_heads - 1)]  # saved K times
    else:
        missing = [f"lm_heads.{k}.weight" for k in range(num_heads) if f"lm_heads.{k}.weight" not in weights]
        extra = sorted(n for n in weights if n.startswith("lm_head") and not re.fullmatch(r"lm_heads\.\d+\.weight", n))
        if missing or extra:
            raise FormatError(f"{path}: needs lm_heads.0..{num_heads - 1}.weight; missing {missing}, unexpected "
                              f"{extra}")
        rows = [weights[f"lm_heads.{k}.weight"] for k in range(num_heads)]
    if token_map is not None and rows[0].shape[0] > len(token_map):
        rows = [r[token_map] for r in rows]  # vLLM keeps the token map's rows of a full-vocabulary projection
    expected = config.get("truncated_vocab_size") or config["vocab_size"]
    if any(r.ndim != 2 or r.shape[0] != expected for r in rows):
        raise FormatError(f"{path}: vocab projections of shapes {sorted({tuple(r.shape) for r in rows})}, expected "
                          f"{expected} rows (truncated_vocab_size / vocab_size)")
    return rows


def _save_imported(state: dict, num_heads: int, num_layers: int, token_map: torch.Tensor | None, share: bool,
                   base: str, out_dir: str | Path, path: Path, lm_head_weight: torch.Tensor | None,
                   fingerprint: dict | None = None, vocab_size: int | None = None) -> Path:
    """Build our heads from a converted state (every key consumed, shapes checked) and save them atomically."""
    if num_layers == 0 and not state and share:
        raise FormatError(f"{path}: no weights to import")
    hidden = next(v for k, v in state.items() if k.endswith(".weight")).shape[-1]
    vocab = vocab_size if token_map is not None or share else state["lm_heads.0.weight"].shape[0]
    if lm_head_weight is not None:
        if tuple(lm_head_weight.shape) != (vocab, hidden):
            raise FormatError(f"{path}: heads of hidden size {hidden} and vocabulary {vocab}, the base's lm_head is "
                              f"{tuple(lm_head_weight.shape)}")
        fingerprint = lm_head_fingerprint(lm_head_weight)
    config = MedusaHeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers,
                               head_vocab_size=None if token_map is None else len(token_map), share_lm_head=share,
                               base_model_name_or_path=base, lm_head_fingerprint=fingerprint or {})
    if token_map is not None:
        state["token_map"] = token_map
    state = _unshared(state)
    lm_head = lm_head_weight.detach().cpu() if share else torch.empty(vocab, hidden, device="meta")
    try:
        with torch.device("meta"):
            heads = build_heads(config, lm_head, None, token_map)
        heads.load_state_dict(state, strict=True, assign=True)
    except (RuntimeError, ValueError) as e:
        raise FormatError(f"{path}: the weights do not form {num_heads} heads of {num_layers} ResBlocks over hidden "
                          f"size {hidden}: {str(e).splitlines()[0]}") from e
    return save_heads(heads, _check_new_folder(out_dir))


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with a copy of every tensor whose storage an earlier one already uses. FasterDecoding/Medusa built
    each head's ResBlocks as ``[ResBlock(h)] * L`` (one module applied L times), so a ``.pt`` of it can hold one
    tensor under L names: L equal, separate blocks compute the same and can be saved."""
    seen, out = set(), {}
    for name, value in state.items():
        pointer = value.untyped_storage().data_ptr()
        out[name] = value.clone() if pointer in seen else value
        seen.add(pointer)
    return out


def _check_new_folder(out_dir: str | Path) -> Path:
    """``out_dir`` as a path, after checking it can be written without replacing anything.

    Raises:
        FileExistsError: ``out_dir`` exists and is not an empty folder (it is never replaced).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} exists and is not an empty folder: choose another --out")
    return out_dir
