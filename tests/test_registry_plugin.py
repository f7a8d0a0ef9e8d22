"""A drafter and an engine defined in this file, registered by name, chosen by name through the CLI's own model
builder (:func:`medusa.build.build_model`, ``medusa generate --drafter NAME --engine NAME``), decode exactly the
base's greedy tokens, with no file of the package edited. The built-in drafters without heads (``lookup``, ``none``)
are chosen by name the same way."""

from __future__ import annotations

import pytest
import torch
from test_decoding import hf_greedy
from tiny import save_tiny, tiny_tokenizer

from medusa.build import DecodeConfig, build_model
from medusa.cli import main
from medusa.decode.tree import layout_from_parents
from medusa.drafters import base as drafters_base
from medusa.drafters import register_drafter
from medusa.drafters.base import DraftTree
from medusa.engines import ENGINES, Engine, kv_cache, register_engine

DRAFTER, ENGINE = "test-plugin-repeat", "test-plugin-engine"


class RepeatDrafter:
    """Drafts a chain of two copied nodes: the two tokens that followed the root's last earlier occurrence in the
    context (the root again when it has none). Built from a decode configuration by its own classmethod."""

    max_nodes, max_depth = 3, 2
    base_layers = ()

    @classmethod
    def from_decode_config(cls, config: DecodeConfig, base) -> RepeatDrafter:
        return cls()

    def new_state(self):
        return None

    def start(self, state, hidden, next_tokens):
        pass

    def propose(self, state, root, sequence, sampler):
        seq = sequence.tolist()
        starts = [i for i in range(len(seq) - 1) if seq[i] == int(root)]
        follow = seq[starts[-1] + 1 : starts[-1] + 3] if starts else []
        follow = (follow + [int(root)] * 2)[:2]
        tokens = torch.tensor([int(root), *follow], device=root.device)
        return DraftTree(tokens, layout_from_parents([-1, 0, 1], device=root.device),
                         copied=torch.tensor([1, 2], device=root.device))

    def update(self, state, draft, path, hidden, next_tokens):
        pass


class NotBuildable(RepeatDrafter):
    """A registered drafter that cannot build itself from a configuration."""

    from_decode_config = None


class BuildsNothing(RepeatDrafter):
    """A registered drafter whose builder returns no drafter (a plugin bug that must not decode plainly)."""

    @classmethod
    def from_decode_config(cls, config, base):
        return None


class CountingEngine(Engine):
    """transformers' DynamicCache through medusa.engines.kv_cache, counting its forwards."""

    summary = "a DynamicCache engine that counts its forwards (tests)"

    def __init__(self, model, max_cache_len=None, scores_all_nodes=None):
        super().__init__(model, scores_all_nodes)
        self.forwards = 0

    def new_cache(self, capacity):
        return kv_cache.new_cache()

    def cache_length(self, cache):
        return kv_cache.cache_length(cache)

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        self.forwards += 1
        return kv_cache.forward(self.model, input_ids, positions, tree_mask, cache, logits_for)

    def keep_positions(self, cache, prefix_len, keep):
        kv_cache.keep_positions(cache, prefix_len, keep)


@pytest.fixture(autouse=True)
def registered():
    register_engine(ENGINE)(CountingEngine)
    register_drafter(DRAFTER)(RepeatDrafter)
    register_drafter("test-plugin-unbuildable")(NotBuildable)
    register_drafter("test-plugin-builds-nothing")(BuildsNothing)
    yield
    ENGINES.pop(ENGINE)
    drafters_base._DRAFTERS.pop(DRAFTER)
    drafters_base._DRAFTERS.pop("test-plugin-unbuildable")
    drafters_base._DRAFTERS.pop("test-plugin-builds-nothing")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("plugin") / "base", "llama")


def repetitive_ids() -> torch.Tensor:
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(7))
    return torch.cat([ids, ids, ids[:4]])


def test_a_drafter_and_an_engine_registered_here_decode_exactly_through_the_model_builder(folder):
    model = build_model(DecodeConfig(base=str(folder), drafter=DRAFTER, engine=ENGINE))
    assert isinstance(model.drafter, RepeatDrafter) and isinstance(model.engine, CountingEngine)
    assert model.heads is None and model.draft_model is None
    ids = repetitive_ids()
    out, stats = model.generate(ids, 40, stop_token_ids=set())
    assert out == hf_greedy(model.base, ids, 40)
    assert stats.tau > 1.0  # the repeated text's copies are accepted
    assert model.engine.forwards == 1 + stats.decode_steps


def test_the_cli_decodes_through_them_by_name(folder, capsys):
    from transformers import AutoModelForCausalLM

    text = "the cat sat on the mat and the cat sat on the"
    argv = ["generate", "--base", str(folder), "--drafter", DRAFTER, "--engine", ENGINE, "--prompt", text,
            "--no-chat-template", "--max-new-tokens", "16"]
    assert main(argv) == 0
    tokenizer = tiny_tokenizer()
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids
    reference = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert capsys.readouterr().out.strip() == tokenizer.decode(reference[0, ids.shape[1]:],
                                                               skip_special_tokens=True).strip()


@pytest.mark.parametrize("name, copies", [("lookup", True), ("none", False)])
def test_the_built_in_drafters_without_heads_are_chosen_by_name(folder, name, copies):
    model = build_model(DecodeConfig(base=str(folder), drafter=name, lookup=4 if copies else None))
    assert model.drafter.name == name and model.heads is None
    ids = repetitive_ids()
    out, stats = model.generate(ids, 32, stop_token_ids=set())
    assert out == hf_greedy(model.base, ids, 32)
    assert (stats.tau > 1.0) == copies


@pytest.mark.parametrize("argv, message", [
    (["--drafter", "no-such-drafter"], "unknown drafter 'no-such-drafter': choose one of"),
    (["--drafter", "test-plugin-unbuildable"], "cannot be built from a decode configuration"),
    (["--drafter", "test-plugin-builds-nothing"], "from_decode_config returned None, not a drafter"),
    (["--drafter", DRAFTER, "--tree", "t.json"], f"--drafter {DRAFTER} drafts without heads: drop --tree"),
    (["--drafter", "heads"], "pass --heads (Medusa, Hydra or eagle heads)"),
    (["--drafter", "draft_model"], "--drafter draft_model needs --draft-model DIR"),
    (["--drafter", "lookup", "--draft-model", "d"], "--draft-model drafts with the draft_model drafter"),
])
def test_a_drafter_name_that_cannot_decode_is_refused_by_name(folder, argv, message, capsys):
    assert main(["generate", "--base", str(folder), "--prompt", "hi", *argv]) == 2
    assert message in capsys.readouterr().err


def test_decode_config_refuses_bad_values_on_construction():
    with pytest.raises(ValueError, match="--verify-logits 'rows': choose one of auto, all, path"):
        DecodeConfig(base="b", heads="h", verify_logits="rows")
    with pytest.raises(ValueError, match="--lookup must be >= 0, got -1"):
        DecodeConfig(base="b", drafter="lookup", lookup=-1)
    with pytest.raises(ValueError, match="--drafter per-step grows a tree each step: drop --per-step-tree off"):
        DecodeConfig(base="b", heads="h", drafter="per-step", per_step_tree="off")


@pytest.mark.parametrize("drafter", [None, "draft_model"])
def test_the_draft_model_is_a_drafter_of_its_own_not_heads(folder, drafter):
    """``--draft-model DIR`` is the shorthand of ``--drafter draft_model``: the draft model sits in its own slot
    (``model.draft_model``, what the bench reads), the drafter is the registered class, and greedy stays exact."""
    from medusa.build import registered_drafter
    from medusa.drafters.draft_model import DraftModelHeads

    model = build_model(DecodeConfig(base=str(folder), drafter=drafter, draft_model=str(folder), draft_tokens=2,
                                     engine="eager"))
    assert model.heads is None and isinstance(model.draft_model, DraftModelHeads)
    assert isinstance(model.drafter, registered_drafter("draft_model")) and model.drafts_from is model.draft_model
    ids = repetitive_ids()
    out, _ = model.generate(ids, 24, stop_token_ids=set())
    assert out == hf_greedy(model.base, ids, 24)
