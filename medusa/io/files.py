"""Atomic writes shared by the writers of heads, adapters, exports, training checkpoints and hidden-state stores.

A reader (a loader, a resuming run) must find either the old content or the new one, complete, never a half-written
file or folder: everything is written under a temporary name next to its target and renamed into place at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_folder(out_dir: str | Path, tmp: Path | None = None, swap: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder next to ``out_dir``; on success it replaces ``out_dir`` (see replace_folder).

    On an error (a full disk, a failed serialisation) the temporary folder is removed and ``out_dir`` is left as it
    was. The folder is readable by all (``0o755``): a checkpoint is meant to be shared.

    Args:
        out_dir: the folder to (re)place; its parent is created.
        tmp: a fixed temporary folder (made afresh), for writers in several processes that must all find it;
            default: a new hidden ``.{name}.*`` folder.
        swap: whether this caller moves the folder into place (and removes it on error): under several processes,
            only the one that writes last; the others just write into ``tmp``.
    """
    out_dir = Path(out_dir)
    if swap:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        if tmp is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    elif tmp is None:
        raise ValueError("atomic_folder(swap=False) writes into another process's folder: pass tmp")
    try:
        yield tmp
    except BaseException:
        if swap:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if swap:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        replace_folder(tmp, out_dir)


def replace_folder(tmp: Path, out_dir: Path) -> Path:
    """Move the finished folder ``tmp`` to ``out_dir``, replacing any folder there.

    An existing ``out_dir`` is first renamed aside (to the hidden ``.{name}.old``) and removed only after the swap, so
    at every moment either the old or the new folder is in place under ``out_dir`` (a crash never leaves a
    half-written one there). ``tmp`` must be on the same file system (made next to ``out_dir``).
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


def remove_folder(path: Path) -> None:
    """Delete ``path``, renamed out of sight (to the hidden ``.{name}.deleting``) first, so a kill during the
    deletion never leaves a partial folder under its name."""
    hidden = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(path, hidden)
    shutil.rmtree(hidden)


@contextlib.contextmanager
def atomic_file(path: Path, tmp_prefix: str = ".tmp-", sync: bool = False) -> Iterator[Path]:
    """Yield the temporary path ``{tmp_prefix}{name}`` next to ``path``; on success it is renamed to ``path``
    (after an ``fsync`` with ``sync``), on an error deleted. For files that grow a folder in place, one by one
    (a hidden-state store's shards), where the folder itself cannot be swapped."""
    tmp = path.with_name(f"{tmp_prefix}{path.name}")
    try:
        yield tmp
        if sync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def read_json(path: str | Path, what: str):
    """Read a JSON file; ``what`` names the file in errors.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not valid JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e}") from e
    return data
