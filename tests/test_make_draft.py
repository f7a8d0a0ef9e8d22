"""medusa make-draft: the base's first N layers as an ordinary Hugging Face folder (layer-skip self-drafting)."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny
from transformers import AutoModelForCausalLM

from medusa.cli import main


@pytest.mark.parametrize("arch, layers", [("llama", 1), ("gemma3", 2), ("gpt2", 1)])
def test_the_draft_is_the_bases_early_exit(tmp_path, arch, layers):
    base_dir = save_tiny(tmp_path / "base", arch)
    assert main(["make-draft", "--base", str(base_dir), "--layers", str(layers), "--out", str(tmp_path / "d")]) == 0
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(tmp_path / "d", dtype=torch.float32).eval()
    assert (tmp_path / "d" / "tokenizer_config.json").is_file()
    ids = torch.randint(3, 300, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = base(ids, output_hidden_states=True)
        inner = base.model if hasattr(base, "model") else base.transformer
        norm = inner.norm if hasattr(inner, "norm") else inner.ln_f
        early = base.lm_head(norm(out.hidden_states[layers]))
        logits = draft(ids).logits
    if arch == "gemma3":  # Gemma scales and soft-caps its logits in the head; compare what the head sees
        early = early if base.config.final_logit_softcapping is None else torch.tanh(
            early / base.config.final_logit_softcapping) * base.config.final_logit_softcapping
    assert torch.allclose(logits, early, atol=1e-5)
    assert not torch.allclose(logits, out.logits, atol=1e-3)  # a real cut: not the base itself


def test_make_draft_bad_layers_and_nothing_lost(tmp_path, capsys):
    base_dir = save_tiny(tmp_path / "base", "llama")  # 2 layers
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("earlier")
    for layers in ("2", "0", "-1"):
        assert main(["make-draft", "--base", str(base_dir), "--layers", layers, "--out", str(tmp_path / "d")]) == 2
        assert "--layers must be in [1, 1] (below the base's 2 decoder layers)" in capsys.readouterr().err
    assert (tmp_path / "d" / "keep.txt").read_text() == "earlier"
