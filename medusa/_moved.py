"""Import paths from before the subpackages, kept for one release: each old name is the new module itself.

``import medusa.kv_cache`` gives :mod:`medusa.engines.kv_cache` (the same module object, so attributes set through
either name are seen by both). Installed by ``import medusa``; nothing else is touched. The table (:data:`MOVED`) is
the list of what moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "medusa.engine": "medusa.engines",
    "medusa.kv_cache": "medusa.engines.kv_cache",
    "medusa.static_cache": "medusa.engines.static_cache",
    "medusa.onednn": "medusa.engines.onednn",
    "medusa.heads": "medusa.drafters.heads",
    "medusa.prefix_layer": "medusa.drafters.prefix_layer",
    "medusa.draft": "medusa.drafters.heads_drafter",
    "medusa.prompt_lookup": "medusa.drafters.prompt_lookup",
    "medusa.generate": "medusa.decode.loop",
    "medusa.batch": "medusa.decode.batch",
    "medusa.logits_process": "medusa.decode.logits_process",
    "medusa.tree": "medusa.decode.tree",
    "medusa.verify": "medusa.decode.greedy",
    "medusa.sampling": "medusa.decode.acceptance",
    "medusa.checkpoint": "medusa.io.checkpoint",
    "medusa.adapter": "medusa.io.adapter",
    "medusa.interop": "medusa.io.interop",
    "medusa.files": "medusa.io.files",
    "medusa.prepare": "medusa.io.prepare",
    "medusa.bench": "medusa.tools.bench",
    "medusa.calibrate": "medusa.tools.calibrate",
    "medusa.plots": "medusa.tools.plots",
    "medusa.drift": "medusa.tools.drift",
    "medusa.report": "medusa.tools.report",
}
"""Old module path -> where it lives now."""


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and loads each as the module it moved to."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module) -> None:
        pass

    def get_code(self, name: str):
        """``python -m <old path>`` runs the module it moved to."""
        return importlib.util.find_spec(MOVED[name]).loader.get_code(MOVED[name])


def install() -> None:
    """Let the old paths import (once per process)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(_OldPaths())
