"""Fixtures shared by the tests: a saved tiny Llama and a small chat file (one of each per test module); and for
every test a machine-profile cache of its own session and a fixed default engine.

The shipped default engine is ``auto``: chosen from this machine's stored profile (:mod:`medusa.profile`), or the
static default where none is stored; it never measures unless asked (:mod:`medusa.tools.measure`). A choice read
from timings may differ between machines, so the suite's default is pinned to ``onednn`` (what it was before
``auto``) and the tests of ``auto`` ask for it by name (tests/test_profile.py); the profiles those measure go to a
temporary folder, never the user's cache.
"""

from __future__ import annotations

import pytest
from tiny import save_tiny

import medusa.engines.base as engine_base

SHIPPED_DEFAULT_ENGINE = engine_base.DEFAULT_ENGINE
SUITE_DEFAULT_ENGINE = "onednn"


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
