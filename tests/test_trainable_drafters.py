"""A drafter type defined here, registered by name with its own objective and trainable parameters, trains through
the real trainer entry point: no package file names it."""

import pytest
import torch
from safetensors.torch import load_file
from test_train import make_config
from torch import nn
from transformers import AutoModelForCausalLM

from medusa.drafters.heads import HEAD_TYPES, _HeadsBase, register_head_type
from medusa.io.checkpoint import load_heads
from medusa.losses import head_ce_sums
from tests.tiny import tiny_tokenizer
from train import drafters
from train.drafters import HeadsTraining, register_trainable, trainable_drafter
from train.objective import DecayedHeadLoss
from train.trainer import train


class OffsetHeads(_HeadsBase):
    """Head k: the base's hidden state times a scale plus a learned offset, through the shared lm_head."""

    def __init__(self, config, lm_head_weight, embed_weight=None, token_map=None):
        super().__init__(config, lm_head_weight, token_map)
        self.offsets = nn.Parameter(torch.zeros(config.num_heads, config.hidden_size))
        self.scale = nn.Parameter(torch.ones(()))

    def features(self, k, hidden, tokens):
        return hidden * self.scale + self.offsets[k]  # (..., H)


class LastHeadOnly(DecayedHeadLoss):
    """Scores only the deepest head's cross-entropy (per step target), and counts its calls."""

    calls = 0

    def loss(self, run, logits, hidden, batch, counts, supervised):
        LastHeadOnly.calls += 1
        sums = head_ce_sums(logits, batch["labels"], run.head_lookup)  # (K,)
        return sums[-1] / counts[-1].clamp_min(1)


class OffsetTraining(HeadsTraining):
    """Declares only the offsets trainable: the scale stays as built."""

    def trainable_parameters(self, heads):
        return [heads.offsets]


@pytest.fixture
def offset_type(monkeypatch):
    monkeypatch.setattr(drafters, "_TRAINABLE", dict(drafters._TRAINABLE))
    register_head_type("offset")(OffsetHeads)
    register_trainable(OffsetTraining("offset", objective=LastHeadOnly(), label="Offset heads"))
    yield
    HEAD_TYPES.pop("offset")


def test_a_drafter_registered_in_a_test_trains_its_declared_parameters_by_its_own_objective(base_dir, chats,
                                                                                          tmp_path, offset_type):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    LastHeadOnly.calls = 0
    config = make_config(base_dir, chats, tmp_path / "run", head_type="offset", grad_accum_steps=2)
    assert config.trainable is trainable_drafter("offset")
    heads_dir = train(config, model, tiny_tokenizer())
    assert LastHeadOnly.calls == config.max_steps * config.grad_accum_steps
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the frozen base moved"
    state = load_file(str(heads_dir / "model.safetensors"))
    assert state["scale"].item() == 1.0  # not declared trainable
    # Only the deepest head is scored: its offset moved, the others got no gradient.
    assert state["offsets"][-1].abs().sum() > 0 and not state["offsets"][:-1].any()
    heads = load_heads(heads_dir, model.get_output_embeddings().weight)
    assert isinstance(heads, OffsetHeads) and torch.equal(heads.offsets.detach(), state["offsets"])


def test_registering_a_trainable_name_twice_names_both(offset_type):
    with pytest.raises(ValueError, match="'offset' is already registered .*OffsetTraining"):
        register_trainable(HeadsTraining("offset"))


def test_a_config_field_of_another_drafter_is_refused_by_name(base_dir, chats, tmp_path, offset_type):
    with pytest.raises(ValueError, match="ttt_steps belong to head_type eagle, not 'offset'"):
        make_config(base_dir, chats, tmp_path, head_type="offset", ttt_steps=5)


def test_heads_training_needs_a_registered_heads_class():
    with pytest.raises(ValueError, match="no heads class is registered as 'unbuilt'"):
        HeadsTraining("unbuilt")
