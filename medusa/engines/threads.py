"""Decoding from a thread other than the one that loaded the model: hand that thread's OpenMP workers back first.

GNU OpenMP (libgomp: torch's Linux wheels bundle it, and the native decoder's C library binds to that copy) keeps one
pool of worker threads per thread that opened a parallel region, and counts every pool's workers together. While
that count exceeds the CPUs the process may run on, each waiting worker spins only about a hundred times before it
sleeps on a futex (``gomp_throttled_spin_count_var``, against some 300,000 spins otherwise), so every barrier of a
forward then pays a sleep and a wake-up. A thread that loaded and warmed a model keeps its pool; a second thread
that decodes opens another, and on 2 cores at 2 threads the two pools' 2 workers make the count 3: the decode
thread ran at 0.68-0.74x the loading thread's speed on this EPYC (``medusa serve``'s scheduler thread, the same
model and requests one at a time). :func:`release_openmp_threads` from the loading thread, before the other
starts, frees the loading thread's pool (OpenMP 5.0's ``omp_pause_resource_all``); the decode thread then ran at
0.94-0.97x (docs/serve.md, "Runs 20 and 21").
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` (OpenMP 5.0): free the threads, keep what a later region needs to start them again."""

RUNTIMES = ("libgomp", "libiomp", "libomp")
"""File-name stems of the OpenMP runtimes looked for among the libraries this process has loaded."""


def loaded_openmp_runtimes(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Paths of the OpenMP runtime libraries mapped into this process (Linux's ``/proc/self/maps``, symbolic links
    resolved; a file deleted since it was mapped under its old name), sorted; empty where the file cannot be read
    (macOS, Windows) or none is loaded."""
    try:
        lines = os.fsdecode(maps.read_bytes()).splitlines()  # any mapped file's name, UTF-8 or not
    except OSError:
        return []
    paths = {fields[5].removesuffix(" (deleted)") for fields in (line.split(maxsplit=5) for line in lines)
             if len(fields) == 6}
    return sorted(p for p in paths if Path(p).name.startswith(RUNTIMES) and ".so" in Path(p).name)


def release_openmp_threads() -> int:
    """Free the calling thread's OpenMP worker threads in every OpenMP runtime loaded in this process.

    Call it from the thread that loaded (and warmed) a model, before another thread decodes with it (see the
    module's docstring for why). Nothing is lost: a later parallel region in this thread starts its workers again.
    Must not be called from inside a parallel region (torch never returns to Python inside one).

    Returns:
        How many runtimes answered the pause with success (one with no pool to free answers so too); 0 where none
        is loaded, ``/proc/self/maps`` is missing, a runtime is not loaded under the name the maps show, or one
        predates OpenMP 5.0's ``omp_pause_resource_all`` (each such runtime is logged at debug level). LLVM's
        libomp pauses the whole process's threads, not the caller's, and answers a second pause with an error.
    """
    released = 0
    for path in loaded_openmp_runtimes():
        try:
            # RTLD_NOLOAD: the copy already loaded under that name, never a second one (a name the runtime was
            # not loaded under, or a file replaced since, is refused rather than loaded beside it)
            pause = ctypes.CDLL(path, mode=os.RTLD_NOLOAD).omp_pause_resource_all
        except (OSError, AttributeError) as e:
            logger.debug("no omp_pause_resource_all in %s: %s", path, e)
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(OMP_PAUSE_SOFT) == 0:
            released += 1
        else:
            logger.debug("omp_pause_resource_all failed in %s", path)
    return released
