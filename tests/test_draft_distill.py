"""Distilling a draft model toward the base (``head_type: draft_model``, train.draft_model): the draft's layers move
toward the base's distribution (held-out KL down, top-1 agreement up) while its embeddings and lm_head stay the
base's; the folder it writes loads as a drafter (a truncated vocabulary through draft_vocab.json) and decodes the
base's greedy tokens; a resumed run ends where an uninterrupted one does; bad settings are named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_train import make_config
from tiny import save_tiny, tiny_tokenizer
from transformers import AutoModelForCausalLM

from medusa.decode.loop import GenerationStats, decode_steps
from medusa.drafters.composite import tree_drafter
from medusa.drafters.draft_model import DRAFT_VOCAB_FILE, draft_tree_shape, load_draft_model
from medusa.engines import make_engine
from train.config import TrainConfig
from train.trainer import train


def draft_config(base_dir, chats, out, **overrides) -> TrainConfig:
    values = dict(head_type="draft_model", draft_layers=1, loss="teacher", head_vocab_size=None, max_steps=40,
                  learning_rate=1e-2, save_every=20, eval_every=0, held_out_fraction=0.25, batch_size=6)
    values.update(overrides)
    return make_config(base_dir, chats, out, **values)


@pytest.fixture(scope="module")
def distilled(base_dir, chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft-run")
    return train(draft_config(base_dir, chats, out)), out


def test_distillation_moves_the_draft_toward_the_base_and_keeps_its_vocabulary_weights(base_dir, distilled):
    draft_dir, out = distilled
    metrics = json.loads((out / "eval.json").read_text())
    before, after = metrics["held_out_before"], metrics["held_out"]
    assert after["positions"] == before["positions"] > 0
    assert after["kl"] < 0.8 * before["kl"]
    assert after["top1_agreement"] > before["top1_agreement"]
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(draft.get_input_embeddings().weight, base.get_input_embeddings().weight)
    assert torch.equal(draft.get_output_embeddings().weight, base.get_output_embeddings().weight)
    trained = draft.model.layers[0].mlp.down_proj.weight
    assert not torch.equal(trained, base.model.layers[0].mlp.down_proj.weight)
    assert not (draft_dir / DRAFT_VOCAB_FILE).exists()


def test_the_distilled_draft_loads_as_a_drafter_and_decodes_the_base_greedy(base_dir, distilled):
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    heads = load_draft_model(distilled[0], base, tiny_tokenizer(), depth=3)
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(4))
    stats = GenerationStats()
    steps = decode_steps(base, tree_drafter(heads, draft_tree_shape(3)), ids, 24, set(), stats,
                         engine=make_engine("eager", base))
    expected = base.generate(ids[None], max_new_tokens=24, min_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    assert [t for s in steps for t in s.tokens] == expected


def test_truncated_draft_vocabulary_is_written_and_read(base_dir, chats, tmp_path):
    draft_dir = train(draft_config(base_dir, chats, tmp_path, head_vocab_size=40, max_steps=2, loss="mixed"))
    token_map = json.loads((draft_dir / DRAFT_VOCAB_FILE).read_text())["token_map"]
    assert len(token_map) == len(set(token_map)) == 40 and 2 in token_map  # EOS always kept
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    heads = load_draft_model(draft_dir, base, tiny_tokenizer(), depth=2)
    assert heads.config.head_vocab_size == 40 and heads.token_map.tolist() == token_map
    metrics = json.loads((tmp_path / "eval.json").read_text())["held_out"]
    assert 0 <= metrics["top1_agreement"] <= 1 and metrics["kl"] >= 0


def test_a_resumed_distillation_ends_where_an_uninterrupted_one_does(base_dir, chats, tmp_path, distilled):
    """The uninterrupted run's folder cut back to its step-20 checkpoint (as a run killed after it leaves it)."""
    resumed_out = tmp_path / "resumed"
    shutil.copytree(distilled[1], resumed_out)
    shutil.rmtree(resumed_out / "checkpoints" / "step_40")
    shutil.rmtree(resumed_out / "draft")
    resumed = train(draft_config(base_dir, chats, resumed_out))
    whole, again = load_file(distilled[0] / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert whole.keys() == again.keys()
    for name in whole:
        torch.testing.assert_close(again[name], whole[name], rtol=1e-5, atol=1e-6)
    assert "held_out_before" not in json.loads((resumed_out / "eval.json").read_text())  # resumed: no "before"


@pytest.mark.parametrize("overrides, message", [
    (dict(draft_layers=2), "draft_layers must be in [1, 1]"),
    (dict(training_mode="medusa2"), "training_mode medusa2"),
    (dict(train_window=8), "train_window"),
    (dict(head_type="medusa"), "draft_layers belong to head_type draft_model"),
    (dict(draft_layers=0), "draft_layers must be >= 1"),
])
def test_bad_draft_settings_are_named(base_dir, chats, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        train(draft_config(base_dir, chats, tmp_path, **overrides))


def test_a_draft_init_with_another_vocabulary_names_the_first_differing_id(base_dir, chats, tmp_path):
    other = save_tiny(tmp_path / "other", "llama", seed=3)
    tokenizer = tiny_tokenizer()
    first_new = len(tokenizer.get_vocab())
    tokenizer.add_tokens(["<zz-new>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match=rf"token id {first_new}: base None, draft '<zz-new>'"):
        train(draft_config(base_dir, chats, tmp_path / "out", draft_init=str(other)))
    assert not (tmp_path / "out" / "draft").exists()


def test_a_draft_init_folder_is_trained_from(base_dir, chats, tmp_path):
    start = save_tiny(tmp_path / "start", "llama", seed=5)
    draft_dir = train(draft_config(base_dir, chats, tmp_path / "out", draft_init=str(start), max_steps=2))
    draft, initial = load_file(draft_dir / "model.safetensors"), load_file(start / "model.safetensors")
    assert draft.keys() == initial.keys()
    assert torch.equal(draft["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    assert not torch.equal(draft["model.layers.1.mlp.up_proj.weight"], initial["model.layers.1.mlp.up_proj.weight"])
