"""Fixtures shared by the training tests: a saved tiny Llama and a small chat file (one of each per test module)."""

from __future__ import annotations

import pytest
from tiny import save_tiny


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    from test_train import write_chats

    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")
