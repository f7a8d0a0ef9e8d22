"""Fixtures shared by the tests: a saved tiny Llama and a small chat file (one of each per test module); and for
every test a machine-profile cache of its own session and a fixed default engine.

The shipped default engine is ``auto``: chosen from this machine's stored profile (:mod:`medusa.profile`), or the
static default where none is stored; it never measures unless asked (:mod:`medusa.tools.measure`). A choice read
from timings may differ between machines, so the suite's default is pinned to ``onednn`` (what it was before
``auto``) and the tests of ``auto`` ask for it by name (tests/test_profile.py); the profiles those measure go to a
temporary folder, never the user's cache.

Under pytest-xdist (``scripts/test.sh`` runs ``-n auto``) each worker gets an equal share of the cores as torch
threads, set before torch is imported: two workers of two threads each on two cores would oversubscribe them.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))

import pytest  # noqa: E402
from tiny import save_tiny  # noqa: E402

import medusa.engines.base as engine_base  # noqa: E402

SHIPPED_DEFAULT_ENGINE = engine_base.DEFAULT_ENGINE
SUITE_DEFAULT_ENGINE = "onednn"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the files with the most ``slow`` tests go first (the rest keep their order, and so do the
    tests inside each file): ``--dist loadfile`` hands files to the workers in collection order, and a long file
    handed out last would end the run alone on one core."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.nodeid.split("::", 1)[0]])  # a stable sort


@pytest.fixture(autouse=True, scope="session")
def _suite_settings(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEDUSA_CACHE_DIR", str(tmp_path_factory.mktemp("medusa-cache")))
        patch.setattr(engine_base, "DEFAULT_ENGINE", SUITE_DEFAULT_ENGINE)
        yield


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    from test_train import write_chats

    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps one process-wide state that refuses a second mixed-precision mode; reset it around a test."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    yield
    AcceleratorState._reset_state()
