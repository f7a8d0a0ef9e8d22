"""Coupled speculative sampling (``acceptance="coupled"``): every token is the base's Gumbel-max draw at its position,
so the output is distributed as the base's samples and is the same for any drafter, tree, batch or engine.

The law is checked by the chi-square test of ``tests/test_sampling.py`` on its tabulated 32-token base; the
invariance by comparing each Medusa step's tokens with the draws plain decoding makes, and, end to end, a tiny
model's seeded samples through every tree, head type, engine and batch with the same prompt decoded plainly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_decoding import WIDE_TREE, random_heads
from test_per_step import COST, HEAD_CALL, flat_calibration
from test_sampling import (
    DRAWS,
    HEAD_VOCAB,
    ROOT,
    SETTINGS,
    TREE,
    V,
    chi_square_p,
    make_heads,
    processed,
    table_logits_at,
)
from test_sampling import base_logits as base_logits  # noqa: F401 (the module fixture)
from tiny import tiny_model

from medusa.decode.acceptance import CoupledSampling, _open_unit, coupled_stream_seed, gumbel_noise
from medusa.decode.logits_process import resolve_decoding
from medusa.decode.loop import RunningBatch
from medusa.decode.tree import Tree, tree_buffers
from medusa.drafters.heads_drafter import draft_tree
from medusa.drafters.per_step import PerStepDrafter, StepCost
from medusa.engines import make_engine
from medusa.model import MedusaModel


def test_gumbel_noise_is_a_function_of_seed_index_and_id_alone():
    ids = torch.arange(200_000)
    noise = gumbel_noise(3, 17, ids)
    some = torch.tensor([199_999, 5, 70_000, 5])
    assert torch.equal(gumbel_noise(3, 17, some), noise[some])  # any subset, any order, repeats
    assert not torch.equal(gumbel_noise(3, 18, some), noise[some])
    assert not torch.equal(gumbel_noise(4, 17, some), noise[some])
    # Standard Gumbel: mean the Euler-Mascheroni constant, variance pi^2 / 6, P(g <= 0) = exp(-1).
    assert abs(float(noise.mean()) - 0.5772) < 0.01
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.03
    assert abs(float((noise <= 0).double().mean()) - math.exp(-1)) < 0.005
    for seed, index in ((-1, 0), (0, -1), (2**63, 0)):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
            gumbel_noise(seed, index, some)


def test_the_uniforms_stay_inside_the_open_unit_interval_at_the_extreme_hashes():
    u = _open_unit(np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64))
    assert (u > 0).all() and (u < 1).all()
    assert np.isfinite(-np.log(-np.log(u))).all()  # the Gumbel noise of the largest hash is finite, not +inf


def test_a_seeds_stream_is_a_hash_of_the_seed_itself():
    streams = {coupled_stream_seed(s) for s in range(1000)}
    assert len(streams) == 1000 and all(0 <= x < 2**63 for x in streams)
    assert coupled_stream_seed(-1) == coupled_stream_seed(2**64 - 1) != coupled_stream_seed(1)
    assert coupled_stream_seed(7) == coupled_stream_seed(7 + 2**64)


def test_a_draw_is_the_argmax_of_the_noisy_finite_logits():
    rule = CoupledSampling(seed=9)
    logits = torch.full((V,), -math.inf)
    logits[[3, 11, 20]] = torch.tensor([0.5, 1.0, -2.0])
    support = torch.tensor([3, 11, 20])
    expected = support[int((logits[support].double() + gumbel_noise(9, 4, support)).argmax())]
    assert int(rule.draw_at(logits, 4)) == int(expected)
    assert rule.index == 0  # draw_at does not move the stream
    with pytest.raises(ValueError, match="every logit is -inf"):
        rule.draw_at(torch.full((V,), -math.inf), 0)
    # overflowed logits (a tiny temperature): the mass is on the +inf ones, equally
    overflowed = torch.zeros(V)
    overflowed[[4, 9]] = math.inf
    draws = {int(CoupledSampling(seed).draw_at(overflowed, 0)) for seed in range(40)}
    assert draws == {4, 9}
    with pytest.raises(ValueError, match="NaN"):
        rule.draw_at(torch.tensor([0.0, math.nan] + [1.0] * (V - 2)), 0)


def plain_draws(tables, seed: int, first_index: int) -> list[int]:
    """The three tokens after the root that plain decoding with the coupled rule draws (no drafts)."""
    rule = CoupledSampling(seed)
    out: list[int] = []
    for depth in range(3):
        out.append(int(rule.draw_at(tables[depth][tuple(out)], first_index + depth)))
    return out


def coupled_step(rule, heads, tables):
    tree = draft_tree(heads, torch.zeros(4), torch.tensor(ROOT), tree_buffers(TREE), rule.sampler, vocab=HEAD_VOCAB)
    result = rule.accept(tree, table_logits_at(tables, tree_buffers(TREE), tree.tokens))
    return tree.tokens[result.path_nodes[1:]].tolist() + [int(result.next_token)], result.accepted


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_step_emits_the_plain_draws_whatever_the_heads(base_logits, setting):  # noqa: F811
    tables = processed(SETTINGS[setting], base_logits)
    accepted = {}
    for kind in ("random", "base", "adversarial"):
        heads, total = make_heads(kind, base_logits), 0
        for seed in range(150):
            rule = CoupledSampling(seed)
            rule.index = 1  # the prefill token was index 0
            emitted, n = coupled_step(rule, heads, tables)
            assert emitted == plain_draws(tables, seed, 1)[: len(emitted)], (kind, seed)
            assert rule.index == 1 + len(emitted)  # the stream moved past every emitted token
            total += n
        accepted[kind] = total / 150
    # the drafts change the speed only: heads proposing the base's own distribution accept the most
    assert accepted["base"] > 0.8 > accepted["adversarial"] + 0.4


@pytest.mark.slow
def test_coupled_sampling_is_exact(base_logits):  # noqa: F811
    """The first three tokens of 20,000 steps, each with a seed of its own, against the enumerated base joint (top-p
    0.9 at temperature 1: the draws cover a truncated support too)."""
    tables = processed(SETTINGS["top-p0.9"], base_logits)
    heads = make_heads("base", base_logits)
    samples = torch.empty(DRAWS, 3, dtype=torch.long)
    for seed in range(DRAWS):
        rule = CoupledSampling(seed)
        emitted, _ = coupled_step(rule, heads, tables)
        while len(emitted) < 3:  # the steps after this one: plain coupled draws
            emitted.append(int(rule.draw_at(tables[len(emitted)][tuple(emitted)], rule.index)))
            rule.index += 1
        samples[seed] = torch.tensor(emitted[:3])
    assert chi_square_p(samples, tables) > 0.01


class OneIndex(CoupledSampling):
    """The broken rule: every position drawn with the noise of one index (the tokens of a sample correlated)."""

    def draw_at(self, logits, index):
        return super().draw_at(logits, 1)


def test_control_a_rule_drawing_every_position_at_one_index_is_caught(base_logits):  # noqa: F811
    """Control: the same law test fails for a rule whose positions share their noise."""
    tables = processed(SETTINGS["top-p0.9"], base_logits)
    heads = make_heads("base", base_logits)
    samples = torch.empty(4000, 3, dtype=torch.long)
    for seed in range(len(samples)):
        rule = OneIndex(seed)
        emitted, _ = coupled_step(rule, heads, tables)
        while len(emitted) < 3:
            emitted.append(int(rule.draw_at(tables[len(emitted)][tuple(emitted)], rule.index)))
            rule.index += 1
        samples[seed] = torch.tensor(emitted[:3])
    assert chi_square_p(samples, tables) < 1e-6


def test_every_emitted_token_is_the_draw_at_its_own_index():
    """End to end through a wide tree with a lookup chain: token i of the output is the Gumbel-max draw at index
    i from the base's own logits after tokens 0 .. i-1 (so no index is reused or skipped, with drafts or without)."""
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(4))
    medusa = MedusaModel(model, random_heads(model), WIDE_TREE.with_lookup(4), engine="eager")
    out, stats = medusa.generate(ids, 30, stop_token_ids=set(), seed=21, **SAMPLING)
    assert stats.decode_steps < 30  # some steps accepted drafts
    rule = CoupledSampling(coupled_stream_seed(21))
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor(out)])[None]).logits[0, len(ids) - 1 : -1]  # (30, V)
    assert out == [int(rule.draw_at(row / SAMPLING["temperature"], i)) for i, row in enumerate(logits)]


SAMPLING = {"do_sample": True, "temperature": 0.9, "top_k": 0, "acceptance": "coupled"}


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_seeded_tokens_are_the_same_through_any_tree_engine_or_batch(head_type):
    model = tiny_model("llama")
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 5, 17)]
    plain = MedusaModel(model, random_heads(model, head_type=head_type), Tree.chain(0), engine="eager")
    reference = [plain.generate(p, 24, stop_token_ids=set(), seed=s, **SAMPLING)[0] for s, p in enumerate(prompts)]
    assert reference[0] != plain.generate(prompts[0], 24, stop_token_ids=set(), seed=7, **SAMPLING)[0]
    medusa = MedusaModel(model, random_heads(model, head_type=head_type), WIDE_TREE, engine="eager")
    for engine in ("eager", "onednn") if head_type == "medusa" else ("static",):
        medusa.use_engine(engine)
        for tree in (WIDE_TREE, Tree.from_paths([[0], [1], [0, 0]], lookup_length=4)):
            medusa.tree = tree
            alone = [medusa.generate(p, 24, stop_token_ids=set(), seed=s, **SAMPLING)[0]
                     for s, p in enumerate(prompts)]
            assert alone == reference, (engine, tree.name)
    # rows beside greedy and other sampled rows in shared verify forwards: each its own seed's tokens
    medusa.use_engine("eager")
    medusa.tree = WIDE_TREE
    batch = RunningBatch(model, medusa.drafter, make_engine("eager", model))
    settings = [resolve_decoding(seed=s, **SAMPLING) for s in range(3)]
    out = {i: batch.join(i, p, 24, set(), None, settings[i]).tokens for i, p in enumerate(prompts)}
    out[3] = batch.join(3, prompts[1], 24, set(), None, resolve_decoding(do_sample=True, seed=1)).tokens
    out[4] = batch.join(4, prompts[2], 24, set()).tokens
    while batch.rows:
        for key, step in batch.step():
            out[key] += step.tokens
    assert [out[i] for i in range(3)] == reference


def test_seeded_tokens_are_the_same_on_per_step_trees_of_any_batch_size():
    """The per-step tree grows another shape for each batch size (and for each row's seen acceptance): the seeded
    tokens stay the plain draws."""
    model = tiny_model("llama")
    heads = random_heads(model)
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 14, 6, 12)]
    plain = MedusaModel(model, heads, Tree.chain(0), engine="eager")
    reference = [plain.generate(p, 20, stop_token_ids=set(), seed=10 + i, **SAMPLING)[0]
                 for i, p in enumerate(prompts)]
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.7), StepCost(COST, [HEAD_CALL] * 3))
    for size in (1, 2, 4):
        out: dict[int, list[int]] = {}
        for first in range(0, len(prompts), size):
            batch = RunningBatch(model, drafter, make_engine("eager", model))
            for i in range(first, first + size):
                out[i] = batch.join(i, prompts[i], 20, set(), None, resolve_decoding(seed=10 + i, **SAMPLING)).tokens
            while batch.rows:
                for key, step in batch.step():
                    out[key] += step.tokens
        assert [out[i] for i in range(len(prompts))] == reference, size
