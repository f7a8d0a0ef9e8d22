"""Small file helpers shared by the writers of heads, adapters and checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_folder(tmp: Path, out_dir: Path) -> Path:
    """Move the finished folder ``tmp`` to ``out_dir``, replacing any folder there.

    An existing ``out_dir`` is first renamed aside and removed only after the swap, so at every moment either the old
    or the new folder is in place under ``out_dir`` (a crash never leaves a half-written one there). ``tmp`` must be
    on the same file system (made next to ``out_dir``).
    """
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
    return out_dir
