"""The three seams from outside the package: a drafter and an engine defined here, registered through the public
registries, decode exactly (greedy = the base's greedy tokens; seeded sampling reproducible), with trees that change
shape from step to step, and without a file of the package edited."""

from __future__ import annotations

import pytest
import torch
from test_decoding import hf_greedy, random_heads
from tiny import tiny_model

from medusa.decode.acceptance import acceptance_rule
from medusa.decode.loop import GenerationStats, decode_steps
from medusa.decode.tree import Tree, layout_from_parents
from medusa.drafters.base import DraftTree, Draws, drafter_class, register_drafter
from medusa.engines import ENGINES, Engine, kv_cache, make_engine, register_engine
from medusa.model import MedusaModel


class CountingEngine(Engine):
    """transformers' DynamicCache through medusa.engines.kv_cache, counting its forwards and the tokens they
    carried."""

    summary = "a DynamicCache engine that counts its forwards (tests)"

    def __init__(self, model, max_cache_len=None, scores_all_nodes=None):
        super().__init__(model, scores_all_nodes)
        self.forwards, self.tokens = 0, 0

    def new_cache(self, capacity):
        return kv_cache.new_cache()

    def cache_length(self, cache):
        return kv_cache.cache_length(cache)

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        self.forwards += 1
        self.tokens += len(input_ids)
        return kv_cache.forward(self.model, input_ids, positions, tree_mask, cache, logits_for)

    def keep_positions(self, cache, prefix_len, keep):
        kv_cache.keep_positions(cache, prefix_len, keep)


class BigramDrafter:
    """Drafts from the context's own bigram counts: a copied node (the token that followed the root last time) and,
    on odd steps, a drawn group of two under the root from the bigram distribution (so trees change shape). Its
    state records every token it was told was accepted."""

    max_nodes, max_depth = 4, 2
    base_layers = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def new_state(self):
        return {"seen": [], "steps": 0}

    def start(self, state, hidden, next_tokens):
        state["seen"] += next_tokens[-1:].tolist()

    def propose(self, state, root, sequence, sampler):
        state["steps"] += 1
        seq = sequence.tolist()
        after = [seq[i + 1] for i in range(len(seq) - 1) if seq[i] == int(root)]
        copied = after[-1] if after else int(root)
        if state["steps"] % 2 == 0:  # root -> copied -> copied again: a chain of two copied nodes
            tokens = torch.tensor([int(root), copied, copied])
            return DraftTree(tokens, layout_from_parents([-1, 0, 1]), copied=torch.tensor([1, 2]))
        counts = torch.bincount(torch.tensor(after or [int(root)]), minlength=self.vocab_size).float()
        logits = (counts + 0.1).log()[None]  # (1, V)
        candidates, q = sampler.draw(logits, 2)  # (1, 2)
        tokens = torch.cat([root[None], torch.tensor([copied]), candidates[0]])
        layout = layout_from_parents([-1, 0, 0, 0], [[1, 2, 3], [], [], []])
        draws = Draws(torch.tensor([0]), logits, candidates, torch.tensor([2, 3]), torch.tensor([0, 0]),
                      torch.tensor([0, 1]), q)
        return DraftTree(tokens, layout, [draws], copied=torch.tensor([1]))

    def update(self, state, draft, path, hidden, next_tokens):
        state["seen"] += next_tokens.tolist()


@pytest.fixture(autouse=True)
def registered():
    """Register the toy engine and drafter through the public decorators, and take them out again afterwards."""
    from medusa.drafters import base

    register_engine("test-counting")(CountingEngine)
    register_drafter("test-bigram")(BigramDrafter)
    yield
    ENGINES.pop("test-counting")
    base._DRAFTERS.pop("test-bigram")


def repetitive_prompt():
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(4))
    return torch.cat([ids, ids, ids[:5]])


@pytest.mark.parametrize("scores_all_nodes", [True, False])
def test_a_drafter_and_an_engine_from_outside_decode_exactly(scores_all_nodes):
    model = tiny_model("llama")
    ids = repetitive_prompt()
    reference = hf_greedy(model, ids, 40)
    assert "test-counting" in ENGINES and drafter_class("test-bigram") is BigramDrafter
    engine = make_engine("test-counting", model, scores_all_nodes=scores_all_nodes)
    drafter = BigramDrafter(model.config.vocab_size)
    stats = GenerationStats()
    out = [t for step in decode_steps(model, drafter, ids, 40, set(), stats, engine=engine) for t in step.tokens]
    assert out == reference
    assert stats.tau > 1.0  # the copied nodes are accepted on this repetitive text
    assert engine.forwards == 1 + stats.decode_steps  # one prefill, then one forward per step
    assert engine.tokens == len(ids) + sum(3 if s % 2 == 0 else 4 for s in range(1, stats.decode_steps + 1))


def test_the_model_decodes_through_a_registered_drafter_and_engine_by_name():
    model = tiny_model("llama")
    ids = repetitive_prompt()
    reference = hf_greedy(model, ids, 32)
    medusa = MedusaModel(model, random_heads(model), Tree.chain(3), engine="test-counting",
                         drafter=BigramDrafter(model.config.vocab_size))
    assert isinstance(medusa.engine, CountingEngine)
    out, stats = medusa.generate(ids, 32, stop_token_ids=set())
    assert out == reference
    first, _ = medusa.generate(ids, 24, stop_token_ids=set(), do_sample=True, temperature=0.8, seed=3)
    again, _ = medusa.generate(ids, 24, stop_token_ids=set(), do_sample=True, temperature=0.8, seed=3)
    assert first == again and len(first) == 24


def test_the_drafter_is_told_every_accepted_token():
    model = tiny_model("llama")
    ids = repetitive_prompt()
    drafter = BigramDrafter(model.config.vocab_size)
    state = drafter.new_state()
    original = drafter.new_state
    drafter.new_state = lambda: state
    out = [t for step in decode_steps(model, drafter, ids, 30, set(), engine=make_engine("test-counting", model))
           for t in step.tokens]
    drafter.new_state = original
    # The prefill's token, then each step's accepted drafts and bonus token: the whole output, in order.
    assert state["seen"][: len(out)] == out


def test_rejection_sampling_reads_the_drafters_q_and_refuses_top_k_drafts():
    from medusa.decode.logits_process import resolve_decoding

    rule = acceptance_rule(resolve_decoding(do_sample=True, seed=0), 320, "cpu")
    assert rule.lossless and rule.sampler.__class__.__name__ == "SampleWithoutReplacement"
    drafter = BigramDrafter(320)
    state = drafter.new_state()
    draft = drafter.propose(state, torch.tensor(5), torch.tensor([5, 7, 5]), rule.sampler)
    assert draft.draws[0].q is not None
    torch.testing.assert_close(draft.draws[0].q.sum(), torch.tensor(1.0))
    conf = draft.confidence()
    assert conf[1] == 1.0 and 0 < float(conf[2]) <= 1.0  # copied: q one-hot; drawn: its q probability
    draft.draws[0].q = None  # drawn as if by top-k: the rule cannot be exact and says so
    with pytest.raises(ValueError, match="drawn from a distribution q"):
        rule.accept(draft, lambda node: torch.zeros(320))


def test_old_import_paths_are_the_moved_modules_and_the_package_names_its_api():
    import importlib

    import medusa
    from medusa._moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from medusa.generate import medusa_generate  # the names callers of earlier releases imported still work
    from medusa.heads import MedusaHeads

    assert medusa_generate.__module__ == "medusa.decode.loop" and MedusaHeads is medusa.MedusaHeads
    assert medusa.MedusaModel is MedusaModel and medusa.Tree is Tree and callable(medusa.load_heads)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        medusa.nothing  # noqa: B018


def test_a_heads_drafter_saves_and_loads_its_heads(tmp_path):
    from medusa.drafters.heads_drafter import HeadsDrafter

    model = tiny_model("llama")
    heads = random_heads(model)
    drafter = HeadsDrafter(heads, Tree.from_paths([[0], [1], [0, 0]]))
    drafter.save(tmp_path / "heads")
    loaded = HeadsDrafter.load(tmp_path / "heads", model)
    assert loaded.tree == Tree.chain(3)  # no tree.json in the folder: the top-1 chain
    for a, b in zip(heads.state_dict().values(), loaded.heads.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    ids = repetitive_prompt()
    reference = hf_greedy(model, ids, 24)
    out = [t for s in decode_steps(model, loaded, ids, 24, set()) for t in s.tokens]
    assert out == reference


def test_acceptance_reads_each_steps_structure_even_with_one_layout_object():
    """A drafter may reuse its layout object and still reorder ranks from one step to the next: the rule must read
    each step's draws (a stale structure would emit a token the base gives probability 0)."""
    from medusa.decode.acceptance import RejectionSampling

    vocab, first, second = 8, 3, 5
    layout = layout_from_parents([-1, 0, 0])
    rule = RejectionSampling(vocab, lambda x: x, torch.Generator().manual_seed(0))

    def draft(ranks):
        candidates, q = torch.tensor([[first, second]]), torch.zeros(1, vocab)
        q[0, [first, second]] = 0.5
        tokens = torch.tensor([0, int(candidates[0, ranks[0]]), int(candidates[0, ranks[1]])])
        return DraftTree(tokens, layout, [Draws(torch.tensor([0]), q.log(), candidates, torch.tensor([1, 2]),
                                                torch.tensor([0, 0]), torch.tensor(ranks), q)])

    at_root = torch.full((vocab,), -1e9)
    at_root[first] = 0.0  # the base emits `first` with probability 1
    for ranks in ([0, 1], [1, 0]):
        tree = draft(ranks)
        result = rule.accept(tree, lambda node: at_root if node == 0 else torch.zeros(vocab))
        assert int(tree.tokens[result.path_nodes[-1]]) == first, ranks


class FixedChain:
    """Copies a fixed chain; records what it is told after each step."""

    def __init__(self, tokens):
        self.tokens = torch.tensor(tokens)
        self.max_nodes, self.max_depth = len(tokens) + 1, len(tokens)
        self.base_layers = ()
        self.layout = layout_from_parents(list(range(-1, len(tokens))))
        self.copied = torch.arange(1, len(tokens) + 1)

    def new_state(self):
        return {}

    def start(self, state, hidden, next_tokens):
        pass

    def propose(self, state, root, sequence, sampler):
        state["mine"] = DraftTree(torch.cat([root[None], self.tokens]), self.layout, copied=self.copied)
        return state["mine"]

    def update(self, state, draft, path, hidden, next_tokens):
        state["told"] = (draft is state["mine"], path.tolist())


def test_each_part_of_a_composite_is_told_its_own_accepted_nodes():
    from medusa.drafters.composite import CompositeDrafter

    a, b = FixedChain([4, 5]), FixedChain([7, 8, 9])
    composite = CompositeDrafter([a, b])
    state = composite.new_state()
    draft = composite.propose(state, torch.tensor(1), torch.tensor([1]), None)
    assert draft.tokens.tolist() == [1, 4, 5, 7, 8, 9]
    composite.update(state, draft, torch.tensor([0, 3, 4]), torch.zeros(3, 4), torch.tensor([7, 8, 0]))
    assert state[0]["told"] == (True, [0])  # a's chain (4, 5) was not accepted
    assert state[1]["told"] == (True, [0, 1, 2])  # b's own nodes for 7, 8
    # The same layouts and index tensors every step: one merge, reused.
    assert composite.propose(state, torch.tensor(2), torch.tensor([2]), None).layout is draft.layout


def test_batched_rows_may_bring_trees_of_one_shape_built_per_step():
    from medusa.decode.batch import batch_decode_steps

    model = tiny_model("llama")
    prompts = [repetitive_prompt(), repetitive_prompt()[:15]]
    drafter = BigramDrafter(model.config.vocab_size)  # a fresh layout object every step
    out = [[], []]
    for step in batch_decode_steps(model, drafter, prompts, 16, set()):
        for i, s in step:
            out[i] += s.tokens
    assert out == [hf_greedy(model, p, 16) for p in prompts]


def test_a_tree_larger_than_the_drafter_declared_is_refused_naming_it():
    model = tiny_model("llama")
    drafter = BigramDrafter(model.config.vocab_size)
    drafter.max_nodes = 2
    with pytest.raises(ValueError, match="drafter BigramDrafter proposed a tree of 4 nodes .* max_nodes 2"):
        list(decode_steps(model, drafter, repetitive_prompt(), 8, set()))


def test_a_registered_acceptance_rule_is_chosen_by_name_and_names_are_not_taken_twice():
    from medusa.decode import acceptance
    from medusa.decode.logits_process import resolve_decoding

    @acceptance.register_acceptance("test-always-reject")
    def always_reject(decoding, vocab_size, generator):
        class Reject(acceptance.TypicalAcceptance):
            def accept(self, draft, logits_at, predicted=None):
                return acceptance.Acceptance(0, torch.zeros(1, dtype=torch.long), logits_at(0).argmax())

        return Reject(0.3, 0.09, generator)

    try:
        model = tiny_model("llama")
        medusa = MedusaModel(model, random_heads(model), Tree.chain(3), engine="eager")
        out, stats = medusa.generate(repetitive_prompt(), 12, stop_token_ids=set(), do_sample=True,
                                     temperature=1e-4, seed=0, acceptance="test-always-reject")
        assert stats.accepted_per_step == [0] * stats.decode_steps and len(out) == 12
        with pytest.raises(ValueError, match="already registered"):
            acceptance.register_acceptance("rejection")(always_reject)
        with pytest.raises(ValueError, match="expected one of .*test-always-reject"):
            resolve_decoding(do_sample=True, acceptance="nope")
    finally:
        acceptance._RULES.pop("test-always-reject")


def test_setting_the_model_tree_makes_the_drafter_draft_on_it():
    """``model.tree = ...`` (what the CLI's --lookup does) decodes on the new tree, not the one the model was made
    with."""
    base = tiny_model("llama")
    tree = Tree.from_paths([[0], [0, 0]], lookup_length=4)
    model = MedusaModel(base, random_heads(base, 2), tree, engine="static")
    assert model.drafter.max_nodes == 1 + 2 + 4
    model.tree = tree.with_lookup(0)
    assert model.drafter.max_nodes == 1 + 2 and model.tree.lookup_length == 0
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5])
    tokens, stats = model.generate(ids, max_new_tokens=10)
    assert tokens == hf_greedy(base, ids, 10) and max(stats.accepted_per_step) <= 2
    with pytest.raises(ValueError):
        model.tree = Tree.from_paths([[0], [0, 0], [0, 0, 0]])  # three levels for two heads


@pytest.mark.parametrize("kind", ["engine", "drafter", "acceptance rule", "head type"])
def test_registering_a_taken_name_is_an_error_that_names_both(kind):
    from medusa.decode import acceptance
    from medusa.drafters import heads

    def first():
        pass

    def second():
        pass

    register, table = {"engine": (register_engine, ENGINES), "drafter": (register_drafter, None),
                       "acceptance rule": (acceptance.register_acceptance, acceptance._RULES),
                       "head type": (heads.register_head_type, heads.HEAD_TYPES)}[kind]
    if kind == "drafter":
        from medusa.drafters import base

        table = base._DRAFTERS
    if kind in ("engine", "drafter", "head type"):
        first, second = type("First", (CountingEngine,), {}), type("Second", (CountingEngine,), {})
    try:
        register("test-twice")(first)
        register("test-twice")(first)  # the same object again (a module imported twice) is fine
        with pytest.raises(ValueError) as error:
            register("test-twice")(second)
        message = str(error.value)
        assert f"{kind} name 'test-twice' is already registered to" in message
        assert f"{first.__module__}.{first.__qualname__}" in message
        assert f"cannot register {second.__module__}.{second.__qualname__}" in message
        assert table["test-twice"] is first
    finally:
        table.pop("test-twice", None)
