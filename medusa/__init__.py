"""medusa-heads: train Medusa / Hydra draft heads on a frozen causal LM and decode self-speculatively with tree
attention, exactly (greedy: the base's own tokens; speculative sampling: the base's distribution).

The public API (imported on first use, so ``import medusa`` stays cheap)::

    from medusa import MedusaModel, Tree
    model = MedusaModel.from_pretrained("models/base", "checkpoints/heads")
    tokens, stats = model.generate(input_ids, max_new_tokens=128)

Subpackages (docs/architecture.md): :mod:`medusa.drafters` (what proposes a tree), :mod:`medusa.engines` (cache and
forward), :mod:`medusa.decode` (tree, acceptance, generation loop, batch), :mod:`medusa.io` (heads folders, adapters,
other formats), :mod:`medusa.tools` (bench, calibration, plots).
"""

from __future__ import annotations

import importlib

from medusa import _moved

_moved.install()

_PUBLIC = {
    "MedusaModel": "medusa.model",
    "DecodeConfig": "medusa.build",
    "build_model": "medusa.build",
    "load_base": "medusa.base",
    "Tree": "medusa.decode.tree",
    "load_tree": "medusa.decode.tree",
    "save_tree": "medusa.decode.tree",
    "load_heads": "medusa.io.checkpoint",
    "save_heads": "medusa.io.checkpoint",
    "MedusaHeads": "medusa.drafters.heads",
    "HydraHeads": "medusa.drafters.heads",
    "MedusaHeadsConfig": "medusa.drafters.heads",
    "GenerationStats": "medusa.decode.loop",
    "decode_steps": "medusa.decode.loop",
    "make_engine": "medusa.engines",
    "register_engine": "medusa.engines",
    "Engine": "medusa.engines",
    "register_drafter": "medusa.drafters",
    "Drafter": "medusa.drafters",
    "tree_drafter": "medusa.drafters",
    "register_acceptance": "medusa.decode.acceptance",
    "HeadsMismatchError": "medusa.io.checkpoint",
}
__all__ = sorted(_PUBLIC)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'medusa' has no attribute {name!r}")
