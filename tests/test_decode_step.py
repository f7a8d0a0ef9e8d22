"""The one decode step over B rows (:class:`medusa.decode.loop.RunningBatch`): sampling rows in a shared forward are
distributed exactly as the base's samples, and each engine batches on its own cache.

The exactness test decodes many rows of one prompt, each with its own seed, in shared verify forwards of a tiny
32-token model; the first three tokens of each row are compared with the enumerated base joint by the chi-square
test of ``tests/test_sampling.py``. The control accepts every draft: the same test catches it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_decoding import random_heads
from test_sampling import chi_square_p
from tiny import tiny_model

from medusa.decode import acceptance
from medusa.decode.logits_process import resolve_decoding
from medusa.decode.loop import RunningBatch
from medusa.decode.tree import Tree
from medusa.drafters.composite import tree_drafter
from medusa.engines import EagerEngine, make_engine
from medusa.engines.static_cache import SlotCache

V = 32
PROMPT = torch.tensor([5, 6, 7, 8, 9, 10])
TREE = Tree.from_paths([[0], [1], [0, 0], [1, 0]])


@pytest.fixture(scope="module")
def small():
    model = tiny_model("llama", vocab_size=V)
    y1, y2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([PROMPT.expand(V * V, -1), y1.reshape(-1, 1), y2.reshape(-1, 1)], dim=1)  # (V*V, 8)
    with torch.no_grad():
        logits = model(ids).logits  # (V*V, 8, V)
    tables = (logits[0, -3], logits[::V, -2].reshape(V, V), logits[:, -1].reshape(V, V, V))
    return model, tree_drafter(random_heads(model), TREE), tables


def sampled_rows(model, drafter, rows: int, per_batch: int, acceptance_name: str = "rejection") -> torch.Tensor:
    """``(rows, 3)``: the first three tokens of ``rows`` rows of :data:`PROMPT`, ``per_batch`` rows sharing each
    verify forward, row i seeded with i."""
    out = []
    decoding = resolve_decoding(do_sample=True, top_k=0, temperature=1.0, acceptance=acceptance_name)
    for first in range(0, rows, per_batch):
        batch = RunningBatch(model, drafter, EagerEngine(model, scores_all_nodes=True))
        tokens = {}
        for i in range(first, min(first + per_batch, rows)):
            tokens[i] = batch.join(i, PROMPT, 3, set(), None, dataclasses.replace(decoding, seed=i)).tokens
        while batch.rows:
            for key, step in batch.step():
                tokens[key] += step.tokens
        assert batch.max_rows == min(per_batch, rows)
        out += [tokens[i][:3] for i in sorted(tokens)]
    return torch.tensor(out)


@pytest.mark.slow
def test_rejection_sampling_rows_sharing_forwards_are_exact(small):
    model, drafter, tables = small
    assert chi_square_p(sampled_rows(model, drafter, 3000, 500), tables) > 0.01


@pytest.mark.slow
def test_control_accepting_every_draft_in_a_shared_forward_is_caught(small):
    model, drafter, tables = small

    @acceptance.register_acceptance("test-accept-every-draft")
    def accept_all(decoding, vocab_size, generator):
        class AcceptAll(acceptance.RejectionSampling):
            def accept(self, draft, logits_at, predicted=None):
                first = draft.layout.children[0][0]  # a drawn child of the root, then its first child
                path = [0, first, *draft.layout.children[first][:1]]
                p = torch.softmax(logits_at(path[-1]).float(), dim=-1)
                return acceptance.Acceptance(len(path) - 1, torch.tensor(path), acceptance.sample(p, self.generator))

        return AcceptAll(vocab_size, decoding.draft_warp(), generator)

    try:
        assert chi_square_p(sampled_rows(model, drafter, 1000, 500, "test-accept-every-draft"), tables) < 1e-6
    finally:
        del acceptance._RULES["test-accept-every-draft"]


def test_typical_and_greedy_rows_share_a_forward_each_as_alone(small):
    """Typical acceptance, rejection sampling and greedy rows in one batch: each row's tokens are those of its
    prompt decoded alone with its settings (its own rule and seeded generator)."""
    model, drafter, _ = small
    settings = [{}, {"do_sample": True, "acceptance": "typical", "seed": 4, "top_k": 0},
                {"do_sample": True, "seed": 5, "top_k": 0}, {"do_sample": True, "acceptance": "typical", "seed": 6}]
    prompts = [PROMPT, PROMPT[:4], torch.tensor([3, 1, 4, 1, 5, 9, 2]), PROMPT[1:]]
    engine = EagerEngine(model)
    batch = RunningBatch(model, drafter, engine)
    tokens = {i: batch.join(i, p, 12, set(), None, resolve_decoding(**s)).tokens
              for i, (p, s) in enumerate(zip(prompts, settings, strict=True))}
    while batch.rows:
        for key, step in batch.step():
            tokens[key] += step.tokens
    assert batch.max_rows == 4
    for i, (p, s) in enumerate(zip(prompts, settings, strict=True)):
        alone = RunningBatch(model, drafter, engine)
        expected = alone.join(i, p, 12, set(), None, resolve_decoding(**s)).tokens
        while alone.rows:
            expected += alone.step()[0][1].tokens
        assert tokens[i] == expected, s


@pytest.mark.parametrize("name", ["static", "onednn"])
def test_static_engines_batch_on_their_own_preallocated_cache(name):
    model = tiny_model("qwen2")
    drafter = tree_drafter(random_heads(model), TREE)
    engine = make_engine(name, model)
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 13)]
    batch = RunningBatch(model, drafter, engine)
    tokens = {i: batch.join(i, p, 10, set()).tokens for i, p in enumerate(prompts)}
    assert isinstance(batch.cache, SlotCache) and batch.cache.layers[0].keys.shape[0] == 3
    assert batch.cache.capacity >= 13 + 10 + drafter.max_nodes
    while batch.rows:
        for key, step in batch.step():
            tokens[key] += step.tokens
        assert batch.rows == [] or isinstance(batch.cache, SlotCache)
    for i, p in enumerate(prompts):
        alone = RunningBatch(model, drafter, EagerEngine(model))
        expected = alone.join(i, p, 10, set()).tokens
        while alone.rows:
            expected += alone.step()[0][1].tokens
        assert tokens[i] == expected, i


@pytest.mark.parametrize("name", ["eager", "onednn"])
def test_a_prompt_prefilled_in_chunks_decodes_as_one_prefilled_at_once(name):
    """Chunked prefill (RunningBatch.begin / prefill): a row prefilled a few tokens at a time, with another row
    stepping between its chunks, gets the same cache (to rounding) and the same greedy tokens as the row joined in
    one forward; nothing is returned before the last chunk, and a finished join refuses more."""
    model = tiny_model("llama")
    drafter = tree_drafter(random_heads(model), TREE)
    engine = make_engine(name, model)
    prompt = torch.randint(3, 300, (13,), generator=torch.Generator().manual_seed(2))
    other = torch.randint(3, 300, (7,), generator=torch.Generator().manual_seed(3))

    def decode(chunk: int | None) -> dict:
        batch = RunningBatch(model, drafter, engine)
        tokens = {"other": batch.join("other", other, 16, set()).tokens}
        if chunk is None:
            tokens["row"] = batch.join("row", prompt, 12, set()).tokens
        else:
            joining = batch.begin("row", prompt, 12, set())
            while (step := batch.prefill(joining, chunk)) is None:
                assert batch.keys == ["other"] and joining.left > 0
                for key, s in batch.step():
                    tokens[key] += s.tokens
            tokens["row"] = step.tokens
            assert joining.left == 0 and batch.keys == ["other", "row"]
            with pytest.raises(ValueError, match="prefill takes at least one token of a prompt not yet joined"):
                batch.prefill(joining, 4)
        while batch.rows:
            for key, s in batch.step():
                tokens[key] += s.tokens
        return tokens

    whole = decode(None)
    alone = RunningBatch(model, drafter, engine)
    joining = alone.begin("row", prompt, 1, set())
    assert alone.prefill(joining, len(prompt)).tokens == whole["row"][:1]  # one chunk: join's own forward
    for chunk in (1, 4, 5):
        chunked = decode(chunk)
        assert chunked["row"] == whole["row"], chunk
        assert chunked["other"] == whole["other"]
