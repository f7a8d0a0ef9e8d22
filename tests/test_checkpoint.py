"""Heads checkpoints: round trip, exact folder contents, atomic replace, and loud failures on any mismatch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from medusa.drafters.heads import MedusaHeads, MedusaHeadsConfig, lm_head_fingerprint
from medusa.io import checkpoint
from medusa.io.checkpoint import (
    HEADS_CONFIG_NAME,
    HEADS_WEIGHTS_NAME,
    HeadsMismatchError,
    load_heads,
    read_heads_config,
    save_heads,
)

H, V = 16, 64


def base_weight(seed=0, vocab=V, hidden=H):
    return torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))


def trained_heads(weight, share=True, token_map=None, num_heads=3, num_layers=2, scale=0.1, base_name=None):
    """Medusa heads for ``weight`` whose every trainable tensor is moved by ``scale`` noise (a stand-in for
    training); ``base_name`` goes into the config's ``base_model_name_or_path``."""
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=num_heads,
                               num_layers=num_layers, share_lm_head=share,
                               head_vocab_size=None if token_map is None else len(token_map),
                               lm_head_fingerprint=lm_head_fingerprint(weight),
                               **({"base_model_name_or_path": base_name} if base_name else {}))
    heads = MedusaHeads(config, weight, token_map)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * scale)
    return heads


@pytest.fixture
def saved(tmp_path):
    weight = base_weight()
    return save_heads(trained_heads(weight), tmp_path / "heads"), weight


@pytest.mark.parametrize("share, token_map", [(True, torch.tensor([0, 3, 9, 10, 33, 63])), (False, None),
                                              (False, torch.tensor([5, 6, 7]))])
def test_round_trip_gives_identical_outputs(tmp_path, share, token_map):
    weight = base_weight()
    heads = trained_heads(weight, share=share, token_map=token_map)
    out = save_heads(heads, tmp_path / "heads", extra_config={"lr": 1e-3})
    loaded = load_heads(out, weight)
    assert loaded.config == heads.config
    hidden = torch.randn(2, 5, H)
    with torch.no_grad():
        assert torch.equal(loaded(hidden), heads(hidden))
    if token_map is not None:
        assert torch.equal(loaded.token_map, token_map)
    assert json.loads((out / HEADS_CONFIG_NAME).read_text())["training"] == {"lr": 1e-3}


def test_saved_folder_holds_exactly_config_and_weights(saved):
    out, _ = saved
    assert sorted(p.name for p in out.iterdir()) == sorted([HEADS_CONFIG_NAME, HEADS_WEIGHTS_NAME])
    # The shared lm_head belongs to the base and is not written with the heads.
    assert all("shared_weight" not in key for key in load_file(out / HEADS_WEIGHTS_NAME))


@pytest.mark.parametrize("weight, message", [
    (base_weight(hidden=H + 8), "hidden size 16, base has 24"),
    (base_weight(vocab=V + 1), "vocabulary size 64, base has 65"),
    (base_weight(seed=7), "trained for another base: lm_head weights differ"),
])
def test_loading_onto_another_base_raises(saved, weight, message):
    out, _ = saved
    with pytest.raises(HeadsMismatchError, match=message):
        load_heads(out, weight)


def test_fingerprint_check_can_be_skipped(saved):
    out, _ = saved
    assert load_heads(out, base_weight(seed=7), check_fingerprint=False).config.num_heads == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_base_in_another_dtype_loads(saved, dtype):
    out, weight = saved
    heads = load_heads(out, weight.to(dtype))
    reference = load_heads(out, weight)
    assert heads.shared_weight.dtype == dtype
    assert heads.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(heads.state_dict()[k], v) for k, v in reference.state_dict().items())


def edit_weights(out, change):
    path = out / HEADS_WEIGHTS_NAME
    state = load_file(path)
    change(state)
    save_file(state, path)


def test_missing_weight_key_raises(saved):
    out, weight = saved
    edit_weights(out, lambda s: s.pop("blocks.1.0.linear.bias"))
    with pytest.raises(HeadsMismatchError, match=r"missing keys \['blocks.1.0.linear.bias'\]"):
        load_heads(out, weight)


def test_extra_weight_key_raises(saved):
    out, weight = saved
    edit_weights(out, lambda s: s.update({"lm_heads.0.weight": torch.zeros(V, H)}))
    with pytest.raises(HeadsMismatchError, match=r"unexpected keys \['lm_heads.0.weight'\]"):
        load_heads(out, weight)


def test_misshaped_weight_raises(saved):
    out, weight = saved
    edit_weights(out, lambda s: s.update({"blocks.0.0.linear.bias": torch.zeros(H + 1)}))
    with pytest.raises(HeadsMismatchError, match="blocks.0.0.linear.bias has shape"):
        load_heads(out, weight)


def test_stray_token_map_raises(saved):
    out, weight = saved
    edit_weights(out, lambda s: s.update({"token_map": torch.arange(4)}))
    with pytest.raises(HeadsMismatchError, match=r"unexpected keys \['token_map'\]"):
        load_heads(out, weight)


@pytest.mark.parametrize("num_heads, message", [(2, "unexpected keys"), (4, "missing keys")])
def test_config_with_wrong_head_count_raises(saved, num_heads, message):
    out, weight = saved
    path = out / HEADS_CONFIG_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_heads": num_heads}))
    with pytest.raises(HeadsMismatchError, match=message):
        load_heads(out, weight)


def test_config_with_unknown_key_raises(saved):
    out, weight = saved
    path = out / HEADS_CONFIG_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_head": 3}))
    with pytest.raises(ValueError, match=r"config.json: unknown keys in Medusa heads config: \['num_head'\]"):
        read_heads_config(out)


def test_missing_folder_or_weights_raise_file_not_found(saved, tmp_path):
    out, weight = saved
    with pytest.raises(FileNotFoundError):
        load_heads(tmp_path / "nowhere", weight)
    (out / HEADS_WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=HEADS_WEIGHTS_NAME):
        load_heads(out, weight)


def test_save_replaces_existing_folder_without_leftovers(tmp_path):
    weight = base_weight()
    out = tmp_path / "heads"
    save_heads(trained_heads(weight, num_heads=2), out)
    (out / "stale.txt").write_text("from an older run")
    save_heads(trained_heads(weight, num_heads=4), out)
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]
    assert sorted(p.name for p in out.iterdir()) == sorted([HEADS_CONFIG_NAME, HEADS_WEIGHTS_NAME])
    assert load_heads(out, weight).config.num_heads == 4


def test_failed_save_keeps_old_checkpoint_and_leaves_no_temp_folder(tmp_path, monkeypatch):
    weight = base_weight()
    out = save_heads(trained_heads(weight, num_heads=2), tmp_path / "heads")

    def broken_save_file(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_heads(trained_heads(weight, num_heads=4), out)
    assert [p.name for p in tmp_path.iterdir()] == ["heads"]
    assert load_heads(out, weight).config.num_heads == 2


# --- the eagle drafter (head_type eagle, format version 4) ---------------------------------------------------------

def eagle_heads(model, layers=(1, 0), head_vocab: int | None = 24, scale=0.05):
    """An eagle drafter for the tiny base ``model`` (its own settings, ``layers``, a draft vocabulary of the
    ``head_vocab`` first tokens), every trainable tensor moved by ``scale`` noise."""
    from medusa.base import learned_position_weight
    from medusa.drafters.eagle import eagle_base_settings
    from medusa.drafters.heads import build_heads

    lm_head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    settings = eagle_base_settings(model.config.get_text_config(decoder=True))
    config = MedusaHeadsConfig(hidden_size=lm_head.shape[1], vocab_size=lm_head.shape[0], num_heads=3,
                               head_vocab_size=head_vocab, lm_head_fingerprint=lm_head_fingerprint(lm_head),
                               head_type="eagle", eagle_layers=list(layers), eagle_base=settings)
    position = learned_position_weight(model) if settings["positions"] == "learned" else None
    token_map = None if head_vocab is None else torch.arange(head_vocab)
    torch.manual_seed(2)
    heads = build_heads(config, lm_head, embed, token_map, position_weight=position)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * scale)
    return heads


def base_states_of(model, heads, ids):
    from medusa.base import base_states

    return base_states(model, ids, torch.ones_like(ids), heads.base_layers)  # (B, T, (1 + k) H)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eagle_folder_round_trip_is_exact_and_strict(tmp_path, arch):
    """An eagle folder saves and loads back to identical outputs (GPT-2: with its position embedding passed);
    its weights file holds exactly the drafter's trainable weights and token map, checked without a base."""
    from medusa.io.checkpoint import check_heads_folder, expected_shapes, load_heads_for_base
    from tests.tiny import tiny_model

    model = tiny_model(arch)
    heads = eagle_heads(model)
    out = save_heads(heads, tmp_path / "heads")
    config = check_heads_folder(out)
    assert config == heads.config and config.format_version == 4 and config.eagle_layers == [1, 0]
    stored = load_file(out / HEADS_WEIGHTS_NAME)
    assert {k: tuple(v.shape) for k, v in stored.items()} == expected_shapes(config)
    assert "fc.weight" in stored and "embed_weight" not in stored and "position_weight" not in stored
    loaded = load_heads_for_base(out, model)
    assert loaded.base_layers == (1, 0)
    ids = torch.randint(4, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    states = base_states_of(model, heads, ids)
    with torch.no_grad():
        assert torch.equal(loaded(states, ids), heads(states, ids))
    del stored["layer.q_proj.weight"]
    save_file(stored, str(out / HEADS_WEIGHTS_NAME))
    with pytest.raises(HeadsMismatchError, match=r"missing keys \['layer.q_proj.weight'\]"):
        load_heads_for_base(out, model)


def test_eagle_folder_of_a_learned_position_base_needs_its_position_embedding(tmp_path):
    from tests.tiny import tiny_model

    model = tiny_model("gpt2")
    out = save_heads(eagle_heads(model), tmp_path / "heads")
    with pytest.raises(HeadsMismatchError, match=r"learned positions needs its position embedding \(P, 64\)"):
        load_heads(out, model.get_output_embeddings().weight, embed_weight=model.get_input_embeddings().weight,
                   num_base_layers=2)


@pytest.mark.parametrize("other, message", [
    (dict(hidden_size=96), r"heads expect hidden size 64, base has 96"),
    (dict(vocab_size=321), r"heads expect vocabulary size 320, base has 321"),
    (dict(num_hidden_layers=4), r"reads layers \[1, 0\] of a base with 2 decoder layers, base has 4"),
], ids=["hidden size", "vocabulary", "layer count"])
def test_eagle_folder_loaded_onto_another_base_is_refused(tmp_path, other, message):
    from medusa.io.checkpoint import load_heads_for_base
    from tests.tiny import tiny_model

    out = save_heads(eagle_heads(tiny_model("llama")), tmp_path / "heads")
    with pytest.raises(HeadsMismatchError, match=message):
        load_heads_for_base(out, tiny_model("llama", **other))


def test_eagle_config_in_an_older_format_version_is_refused(tmp_path):
    from tests.tiny import tiny_model

    out = save_heads(eagle_heads(tiny_model("llama")), tmp_path / "heads")
    data = json.loads((out / HEADS_CONFIG_NAME).read_text())
    (out / HEADS_CONFIG_NAME).write_text(json.dumps(data | {"format_version": 3}))
    with pytest.raises(ValueError, match=r"config.json: head_type 'eagle' in format_version 3; the eagle drafter "
                                         r"exists from version 4 on"):
        read_heads_config(out)
