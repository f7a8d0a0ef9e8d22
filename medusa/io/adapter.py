"""Medusa-2 adapters: a peft LoRA folder next to the heads, merged into the base for decoding or into a full model
folder (``medusa merge``).

Decoding verifies against the adapted model, so the heads' drafts are checked by the distribution they were trained
for. Merging once (``merge_and_unload``) gives a stock transformers model: the decoder needs no peft code, and its
greedy output is that of Hugging Face ``generate`` on the merged folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

from medusa.io.files import atomic_folder

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"


def check_adapter_folder(adapter_dir: str | Path) -> Path:
    """The adapter folder, checked to hold peft's two files.

    Raises:
        FileNotFoundError: the folder or one of its files is missing (the message names it).
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"LoRA adapter folder not found: {adapter_dir}")
    for name in (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME):
        if not (adapter_dir / name).is_file():
            raise FileNotFoundError(f"{adapter_dir} is not a peft adapter folder: {name} is missing")
    return adapter_dir


def merge_adapter(model, adapter_dir: str | Path):
    """``model`` with the LoRA of ``adapter_dir`` folded into its weights: a plain transformers model again.

    Raises:
        FileNotFoundError: see :func:`check_adapter_folder`.
    """
    from peft import PeftModel

    adapter_dir = check_adapter_folder(adapter_dir)
    adapted = PeftModel.from_pretrained(model, str(adapter_dir))
    return adapted.merge_and_unload()


def write_merged(base: str | Path, adapter_dir: str | Path, out_dir: str | Path, dtype=None) -> Path:
    """Load ``base``, merge the adapter and save a full model folder (weights, config, generation config and
    tokenizer) that ``AutoModelForCausalLM`` / ``MedusaModel.from_pretrained`` load.

    Raises:
        FileNotFoundError: the base or the adapter folder is missing.
        FileExistsError: ``out_dir`` exists and is not empty.
    """
    import torch

    from medusa.base import load_base

    check_adapter_folder(adapter_dir)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty: choose a new folder for the merged model")
    model, tokenizer = load_base(base, dtype or torch.float32)
    merged = merge_adapter(model, adapter_dir)
    with atomic_folder(out_dir) as tmp:
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    logger.info("merged %s + %s into %s", base, adapter_dir, out_dir)
    return out_dir
