"""``medusa make-draft``: a smaller draft model cut from the base itself (layer-skip self-drafting).

The draft keeps the base's embeddings, its first N decoder layers, its final norm and its lm_head, and is saved as
an ordinary Hugging Face folder (with the base's tokenizer and generation config), so any causal-LM code loads it.
Its next-token distribution is the base's early exit after layer N (Elhoushi et al. 2024, "LayerSkip", section
4; Zhang et al. 2023, "Draft & Verify": the base drafting for itself with layers skipped); distilling it toward the
base (issue 21) is a separate step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from medusa.io.files import atomic_folder

# Per-layer lists in a config that must shrink with the layers (e.g. Gemma 3 / Qwen2's sliding-window pattern).
_PER_LAYER_KEYS = ("layer_types",)


def decoder_layers(model) -> tuple[torch.nn.ModuleList, str]:
    """The base's decoder layer list and the config key counting them.

    Raises:
        ValueError: an architecture whose layer list is not ``model.layers`` (Llama, Qwen2, Mistral, Gemma ...) or
            ``transformer.h`` (GPT-2), naming its class.
    """
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return inner.layers, "num_hidden_layers"
    inner = getattr(model, "transformer", None)
    if inner is not None and isinstance(getattr(inner, "h", None), torch.nn.ModuleList):
        return inner.h, "n_layer"
    raise ValueError(f"make-draft does not know where {type(model).__name__} keeps its decoder layers "
                     "(expected model.layers or transformer.h)")


def cut_layers(model, layers: int, name: str = "--layers"):
    """Keep the first ``layers`` decoder layers of ``model`` (in place; its config follows) and return it: the
    base's early exit after layer ``layers``, through its final norm and lm_head.

    Raises:
        ValueError: ``layers`` not in [1, the model's layer count) (``name`` names the setting), or layers that
            cannot be found.
    """
    blocks, key = decoder_layers(model)
    total = len(blocks)
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers < total:
        raise ValueError(f"{name} must be in [1, {total - 1}] (below the base's {total} decoder layers), got "
                         f"{layers!r}")
    del blocks[layers:]
    config = model.config.get_text_config(decoder=True)
    setattr(config, key, layers)
    for name in _PER_LAYER_KEYS:
        values = getattr(config, name, None)
        if isinstance(values, list) and len(values) == total:
            setattr(config, name, values[:layers])
    return model


def make_draft(base_dir: str | Path, layers: int, out_dir: str | Path) -> Path:
    """Write a draft of the base's first ``layers`` decoder layers (plus embeddings, final norm, lm_head) to
    ``out_dir``, atomically (a failed write leaves any earlier folder there as it was).

    Args:
        base_dir: a local Hugging Face causal-LM folder.
        layers: decoder layers kept, 1 <= layers < the base's count.
        out_dir: the folder written (replaced when it exists).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: ``layers`` not in [1, base layers), or an architecture whose layers cannot be found.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = cut_layers(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), layers)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    with atomic_folder(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)
