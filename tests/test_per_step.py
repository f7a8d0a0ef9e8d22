"""The per-step tree: grown from calibrated confidence and measured cost, exact whatever it grows to."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from test_batch import BatchOracle, prompts_of
from test_decoding import ARCHS, OracleHeads, hf_greedy, random_heads
from test_sampling import (
    DRAWS,
    HEAD_VOCAB,
    PROMPT,
    ROOT,
    SETTINGS,
    TableHeads,
    V,
    chi_square_p,
    make_heads,
    processed,
    rejection_rule,
    table_logits_at,
)
from tiny import tiny_model

from medusa.decode.batch import batch_decode_steps
from medusa.decode.loop import GenerationStats, decode_steps
from medusa.drafters.calibration import (
    CONFIDENCE_EDGES,
    Calibration,
    CalibrationMismatchError,
    check_calibration,
    heads_identity,
    load_calibration,
    measure_calibration,
    monotone_fit,
    save_calibration,
)
from medusa.drafters.per_step import PerStepDrafter, StepCost
from medusa.engines import make_engine
from medusa.tools.calibrate import sequence_states

BINS = len(CONFIDENCE_EDGES) - 1
# What this machine charges, in the shape a profile measures (a forward over n tokens; a head call per depth).
COST = {1: 0.050, 2: 0.052, 4: 0.054, 8: 0.058, 16: 0.066, 32: 0.090, 64: 0.140}
HEAD_CALL = 0.002


def flat_calibration(heads, accept: float, lookup: float = 0.0, length: int = 6, top_k: int = 8) -> Calibration:
    """A calibration that says every draft of every depth is accepted with probability ``accept``."""
    k = heads.config.num_heads
    return Calibration(heads_identity(heads), top_k, [[accept] * top_k] * k, [[accept] * BINS] * k, [[1] * BINS] * k,
                       3, [[lookup] * length] * 4, [[1] * length] * 4)


def decode(model, drafter, ids, n, engine=None):
    stats, out = GenerationStats(), []
    for step in decode_steps(model, drafter, ids, n, stats=stats, engine=engine or make_engine("eager", model)):
        out += step.tokens
    return out, stats


@pytest.mark.parametrize("arch", ARCHS)
def test_heads_that_are_right_grow_large_trees_and_stay_exact(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    reference = hf_greedy(model, ids, 40)
    heads = OracleHeads(model, ids.tolist() + reference, ranks=[0, 1, 0], vocab=model.config.vocab_size)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.9), StepCost(COST, [HEAD_CALL] * 3))
    out, stats = decode(model, drafter, ids, 40)
    assert out == reference
    assert sum(stats.tree_nodes) / len(stats.tree_nodes) > 10  # far more than a chain
    assert stats.tau > 2.5  # and they pay: 1 + ranks 0 and 1 of heads 0 and 1 accepted
    assert 1 not in stats.tree_nodes


class NeverRight(torch.nn.Module):
    """Random heads that never propose a token of ``avoid`` (the reference answer): heads that are always wrong."""

    base_layers = ()

    def __init__(self, heads, avoid: list[int]):
        super().__init__()
        self.heads, self.config, self.head_vocab_size = heads, heads.config, heads.head_vocab_size
        self.penalty = torch.zeros(heads.head_vocab_size)
        self.penalty[torch.tensor(sorted(set(avoid)))] = -1e4

    def forward(self, hidden, tokens):
        return self.heads(hidden, tokens) + self.penalty

    def draft_logits(self, k, hidden, path_tokens):
        return self.heads.draft_logits(k, hidden, path_tokens) + self.penalty

    def new_context(self):
        return self.heads.new_context()

    def extend_context(self, context, hidden, next_tokens):
        return self.heads.extend_context(context, hidden, next_tokens)

    def to_base_ids(self, ids):
        return self.heads.to_base_ids(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_random_heads_shrink_to_plain_steps_and_stay_exact(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, ids, 40)
    heads = NeverRight(random_heads(model, head_type="hydra"), reference)
    calibration = measure_calibration(heads, sequence_states(model, [(ids.tolist() + reference, len(ids))]), 4, 6)
    assert max(calibration.acceptance[0]) == 0.0  # measured: never accepted
    drafter = PerStepDrafter(heads, calibration, StepCost(COST, [HEAD_CALL] * 3), lookup_length=0)
    out, stats = decode(model, drafter, ids, 40)
    assert out == reference
    assert stats.tree_nodes == [1] * len(stats.tree_nodes)  # every step a plain step


def test_a_cheaper_machine_grows_larger_trees():
    """The same heads and calibration: where each extra node costs less, the trees are larger."""
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    reference = hf_greedy(model, ids, 32)
    heads = OracleHeads(model, ids.tolist() + reference, ranks=[0, 1, 0], vocab=model.config.vocab_size)
    sizes = {}
    for name, slope in (("cheap", 0.0002), ("dear", 0.004)):
        cost = StepCost({n: 0.05 + slope * (n - 1) for n in (1, 64)}, [HEAD_CALL] * 3)
        out, stats = decode(model, PerStepDrafter(heads, flat_calibration(heads, 0.5), cost), ids, 32)
        assert out == reference
        sizes[name] = sum(stats.tree_nodes) / len(stats.tree_nodes)
    assert sizes["cheap"] > sizes["dear"] + 4, sizes


def test_bucketed_engines_get_trees_that_fill_their_bucket():
    model = tiny_model("qwen2")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(3))
    reference = hf_greedy(model, ids, 32)
    heads = OracleHeads(model, ids.tolist() + reference, ranks=[0, 1, 0], vocab=model.config.vocab_size)
    cost = StepCost(COST, [HEAD_CALL] * 3, buckets=(1, 4, 8, 16, 32))
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.7), cost, max_nodes=32, top_k=8, max_parents=8)
    out, stats = decode(model, drafter, ids, 32)
    assert out == reference
    assert set(stats.tree_nodes) <= {1, 4, 8, 16, 32}, stats.tree_nodes


def test_lookup_chain_is_a_branch_valued_by_its_calibration():
    """A prompt that repeats: a trusted lookup chain makes deep steps; an untrusted one is left out."""
    model = tiny_model("llama")
    heads = random_heads(model)
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12] * 4)
    reference = hf_greedy(model, ids, 32)
    taus = {}
    for trust in (0.95, 0.0):
        drafter = PerStepDrafter(heads, flat_calibration(heads, 0.0, lookup=trust, length=8),
                                 StepCost(COST, [HEAD_CALL] * 3))
        out, stats = decode(model, drafter, ids, 32)
        assert out == reference
        taus[trust] = stats.tau
    assert taus[0.0] == 1.0  # nothing pays: every step is plain
    assert taus[0.95] > 1.0 or reference[:8] != reference[8:16]  # the base did not copy: nothing to accept


def test_batched_per_step_trees_equal_one_prompt_at_a_time():
    model = tiny_model("llama")
    prompts = prompts_of([12, 4, 20, 9], seed=2)
    references = [hf_greedy(model, p, 32) for p in prompts]
    ranks = [[0, 1, None], [None, None, None], [0, None, None], [0, 0, 0]]
    oracles = [OracleHeads(model, p.tolist() + r, rk, model.config.vocab_size)
               for p, r, rk in zip(prompts, references, ranks, strict=True)]
    heads = BatchOracle(oracles)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.6), StepCost(COST, [HEAD_CALL] * 3))
    from medusa.decode.batch import BatchStats

    stats = BatchStats()
    out = [[] for _ in prompts]
    for step in batch_decode_steps(model, drafter, prompts, 32, stats=stats, engine=make_engine("eager", model)):
        for i, s in step:
            out[i] += s.tokens
    assert out == references
    assert min(stats.rows[0].tree_nodes) > 1  # one per-step tree shape for all rows
    taus = [s.tau for s in stats.rows]
    assert taus[3] > taus[1] and taus[0] > taus[1]  # each row kept its own acceptance


@pytest.mark.parametrize("engine", ["eager", "onednn", "int4"])
def test_greedy_rows_get_trees_of_their_own_shapes_of_one_size_and_stay_exact(engine):
    """Batched greedy rows each get a tree of their own shape (a row whose heads are right drafts deep, one whose
    heads are always wrong is padded to the batch's size), all of one size, verified in one forward under per-row
    tree attention masks: every row's tokens are still the ones it gets alone through the same engine, and the
    row whose heads are right drafts deeper than the rows whose heads are wrong (on one shared shape, as deep)."""
    from medusa.decode.batch import BatchStats

    model = tiny_model("llama")
    options = {"kernel": "native-q8", "lm_head": "bf16"} if engine == "int4" else {}
    prompts = prompts_of([12, 4, 20, 9], seed=2)
    plain = PerStepDrafter(random_heads(model), flat_calibration(random_heads(model), 0.0),
                           StepCost(COST, [HEAD_CALL] * 3))
    references = [decode(model, plain, p, 32, make_engine(engine, model, **options))[0] for p in prompts]
    if engine != "int4":
        assert references == [hf_greedy(model, p, 32) for p in prompts]
    ranks = [[0, 0, 0], [None, None, None], [0, None, None], [None, None, None]]
    oracles = [OracleHeads(model, p.tolist() + r, rk, model.config.vocab_size)
               for p, r, rk in zip(prompts, references, ranks, strict=True)]
    heads = BatchOracle(oracles)
    depths = {}
    for row_trees in (True, False):
        drafter = PerStepDrafter(heads, flat_calibration(heads, 0.6), StepCost(COST, [HEAD_CALL] * 3),
                                 row_trees=row_trees)
        shapes, propose_rows = [], drafter.propose_rows

        def spied(*args, propose_rows=propose_rows, shapes=shapes):
            drafts = propose_rows(*args)
            shapes.append([tuple(d.layout.parents.tolist()) for d in drafts])
            return drafts

        drafter.propose_rows = spied
        stats, out = BatchStats(), [[] for _ in prompts]
        for step in batch_decode_steps(model, drafter, prompts, 32, stats=stats,
                                       engine=make_engine(engine, model, **options)):
            for i, s in step:
                out[i] += s.tokens
        assert out == references, row_trees
        assert shapes and all(len({len(p) for p in step}) == 1 for step in shapes)  # one size a step
        mixed = sum(len(set(step)) > 1 for step in shapes)
        assert (mixed > 0) == row_trees, (row_trees, shapes[:3])
        depths[row_trees] = [sum(_depth(step[b]) for step in shapes if len(step) == 4) for b in range(4)]
    assert depths[True][0] > depths[True][1] and depths[True][0] > depths[True][3]  # the right row drafts deeper
    assert len(set(depths[False])) == 1


def _depth(parents: tuple[int, ...]) -> int:
    """The depth of a tree given by its nodes' parents (the root's -1)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_trees_of_their_own_shapes_share_one_head_call_per_depth(head_type, monkeypatch):
    """Greedy rows growing trees of their own shapes still draft in one head call per depth (each row's parents
    side by side), with the candidates each row's own call gives; their tokens stay the base's greedy ones."""
    from medusa.decode.loop import RunningBatch
    from medusa.drafters.base import TopK

    model = tiny_model("llama")
    heads = random_heads(model, head_type=head_type)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.9), StepCost(COST, [HEAD_CALL] * 3))
    prompts = prompts_of([12, 4, 20], seed=2)
    batch = RunningBatch(model, drafter, make_engine("eager", model))
    for i, p in enumerate(prompts):
        batch.join(i, p, 24)
    rows = batch.rows
    args = ([r.state for r in rows], torch.stack([r.root for r in rows]), [r.sequence for r in rows])
    calls, draft_logits = [], type(heads).draft_logits

    def counted(self, k, hidden, paths):
        calls.append((k, len(hidden)))
        return draft_logits(self, k, hidden, paths)

    monkeypatch.setattr(type(heads), "draft_logits", counted)
    with torch.inference_mode():
        pooled = drafter.propose_rows(*args, TopK(greedy=True))
    assert calls and len({k for k, _ in calls}) == len(calls)  # one call per depth
    assert max(n for _, n in calls) > 1  # several rows' parents in one call
    calls.clear()
    drafter._rows_together = False  # heads that cannot draft rows together: one call per row and depth
    with torch.inference_mode():
        alone = drafter.propose_rows(*args, TopK(greedy=True))
    assert len(calls) > len({k for k, _ in calls})
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(pooled, alone, strict=True))


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_greedy_rows_share_one_head_call_per_level_and_draft_what_each_would_alone(head_type, monkeypatch):
    """Rows that all decode greedily are drafted in one head call per depth, with the candidates each row's own
    call gives (rows that sample keep one call each: test below); their tokens stay the base's greedy ones."""
    from medusa.decode.loop import RunningBatch
    from medusa.drafters.base import TopK

    model = tiny_model("llama")
    heads = random_heads(model, head_type=head_type)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.9), StepCost(COST, [HEAD_CALL] * 3), row_trees=False)
    prompts = prompts_of([12, 4, 20], seed=2)
    references = [hf_greedy(model, p, 24) for p in prompts]
    batch = RunningBatch(model, drafter, make_engine("eager", model))
    for i, p in enumerate(prompts):
        batch.join(i, p, 24)
    calls, draft_logits = [], type(heads).draft_logits

    def counted(self, k, hidden, paths):
        calls.append(hidden.dim())
        return draft_logits(self, k, hidden, paths)

    monkeypatch.setattr(type(heads), "draft_logits", counted)
    rows = batch.rows
    args = ([r.state for r in rows], torch.stack([r.root for r in rows]), [r.sequence for r in rows])
    with torch.inference_mode():
        together = drafter.propose_rows(*args, TopK(greedy=True))
    levels = len(calls)
    assert levels > 1 and calls == [2] * levels  # one call per depth, one hidden state per node
    calls.clear()
    with torch.inference_mode():
        alone = drafter.propose_rows(*args, TopK())  # typical acceptance's draws: one call per row, as alone
    assert len(calls) == len(rows) * levels
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(together, alone, strict=True))
    out = [[] for _ in prompts]
    for step in batch_decode_steps(model, drafter, prompts, 24, engine=make_engine("eager", model)):
        for i, s in step:
            out[i] += s.tokens
    assert out == references


def test_a_sampling_row_shares_the_per_step_tree_with_greedy_rows():
    """Each row's candidates are drawn with its own rule's sampler (the sampling row's without replacement, from its
    own generator) on one tree shape; the greedy rows keep the base's greedy tokens."""
    from medusa.decode.logits_process import resolve_decoding
    from medusa.decode.loop import RunningBatch

    model = tiny_model("llama")
    prompts = prompts_of([12, 4, 20], seed=2)
    references = [hf_greedy(model, p, 24) for p in prompts]
    oracles = [OracleHeads(model, p.tolist() + r, [0, 1, None], model.config.vocab_size)
               for p, r in zip(prompts, references, strict=True)]
    heads = BatchOracle(oracles)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.6), StepCost(COST, [HEAD_CALL] * 3))
    batch = RunningBatch(model, drafter, make_engine("eager", model))
    sampling = resolve_decoding(do_sample=True, temperature=0.8, seed=1)
    out = [batch.join(i, p, 24, set(), None, sampling if i == 1 else None).tokens for i, p in enumerate(prompts)]
    shapes = []
    while batch.rows:
        shapes.append(len(batch.rows))
        for i, s in batch.step():
            out[i] += s.tokens
    assert shapes[0] == 3 and out[0] == references[0] and out[2] == references[2] and len(out[1]) == 24


class CalibratedTableHeads(TableHeads):
    """The sampling tests' table heads, with the config a calibration identifies heads by."""

    config = types.SimpleNamespace(head_type="medusa", num_heads=2, num_layers=1, hidden_size=4, vocab_size=V,
                                   lm_head_fingerprint=None)


class TopKClaimingSoftmaxRanked:
    """The known bug as a per-step sampler: deterministic top-k candidates reported as drawn from the softmax q."""

    def __init__(self, warp):
        self.warp = warp

    def draw_ranked(self, logits, k):
        q = torch.softmax(self.warp(logits.float()), dim=-1)
        return logits.topk(k, dim=-1).indices, q, q.topk(k, dim=-1).values


def per_step_samples(rule, heads, tables, n: int, sampler=None) -> tuple[torch.Tensor, set[int], int]:
    """``(n, 3)`` first three tokens after the root from ``n`` per-step trees, the tree sizes seen, and the drafts
    accepted in all."""
    mids = [(a + b) / 2 for a, b in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:], strict=False)]
    calibration = Calibration(heads_identity(heads), 8, [[0.5] * 8] * 2, [mids] * 2,
                              [[1] * BINS] * 2, 3, [[0.5] * 4] * 4, [[1] * 4] * 4)
    # Sizes settle on buckets: candidates are added to fill one (never pruned: the draws are sampled).
    drafter = PerStepDrafter(heads, calibration, StepCost({1: 1.0, 8: 1.02, 16: 1.1}, [0.004, 0.004], (1, 2, 4, 8)),
                             lookup_length=2, top_k=4)
    probs = [torch.softmax(t, dim=-1) for t in tables]
    context = torch.tensor(PROMPT + [ROOT])
    gen = torch.Generator().manual_seed(1)
    out, sizes, accepted = torch.empty(n, 3, dtype=torch.long), set(), 0
    for i in range(n):
        state = drafter.new_state()
        state.hidden = torch.zeros(4)
        tree = drafter.propose(state, torch.tensor(ROOT), context, sampler or rule.sampler)
        sizes.add(len(tree.tokens))
        result = rule.accept(tree, table_logits_at(tables, tree.layout, tree.tokens))
        accepted += result.accepted
        emitted = tree.tokens[result.path_nodes[1:]].tolist() + [int(result.next_token)]
        while len(emitted) < 3:
            emitted.append(int(torch.multinomial(probs[len(emitted)][tuple(emitted)], 1, generator=gen)))
        out[i] = torch.tensor(emitted[:3])
    return out, sizes, accepted


@pytest.mark.slow
def test_rejection_sampling_on_per_step_trees_is_exact(base_logits):
    tables = processed(SETTINGS["t1.0"], base_logits)
    heads = CalibratedTableHeads(make_heads("base", base_logits).logits_fn)
    samples, sizes, accepted = per_step_samples(rejection_rule(SETTINGS["t1.0"]), heads, tables, DRAWS)
    assert len(sizes) >= 3, sizes
    assert accepted > DRAWS // 4
    assert chi_square_p(samples, tables) > 0.01


@pytest.mark.slow
def test_control_broken_q_on_per_step_trees_is_caught(base_logits):
    tables = processed(SETTINGS["t1.0"], base_logits)
    rule = rejection_rule(SETTINGS["t1.0"])
    heads = CalibratedTableHeads(make_heads("random", base_logits).logits_fn)
    samples, _, _ = per_step_samples(rule, heads, tables, DRAWS // 2, TopKClaimingSoftmaxRanked(rule.sampler.warp))
    assert chi_square_p(samples, tables) < 1e-6


@pytest.fixture(scope="module")
def base_logits():
    from test_sampling import tabulated_base_logits

    return tabulated_base_logits()


# -- calibration ------------------------------------------------------------------------------------------------------
def test_monotone_fit_pools_violators_and_leans_on_the_prior_where_sparse():
    fit = monotone_fit(torch.tensor([0.0, 50.0, 10.0, 0.0]), torch.tensor([100.0, 100.0, 100.0, 0.0]),
                       torch.tensor([0.1, 0.3, 0.5, 0.9]))
    assert (fit[1:] >= fit[:-1]).all()
    assert fit[1] == pytest.approx(fit[2])  # 0.5 then 0.1: pooled
    assert fit[3] == pytest.approx(0.9)  # no samples: the prior


def test_measured_calibration_round_trips_and_matches_accuracy(tmp_path):
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=2)
    ids = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(0))
    sequence = ids.tolist() + hf_greedy(model, ids, 48)
    calibration = measure_calibration(heads, sequence_states(model, [(sequence, len(ids))]), 4, 6)
    # every position whose head-0 target lies in the response (the prefill emits the first), every rank
    assert sum(calibration.counts[0]) == 4 * (len(sequence) - len(ids) - 1)
    path = save_calibration(calibration, tmp_path / "calibration.json")
    assert load_calibration(path) == calibration
    check_calibration(load_calibration(path), heads_identity(heads))


def test_a_calibration_for_other_heads_is_refused_with_the_difference_named():
    model = tiny_model("llama")
    calibration = flat_calibration(random_heads(model, num_heads=2), 0.5)
    with pytest.raises(CalibrationMismatchError, match="num_heads: calibrated 2, heads 3"):
        PerStepDrafter(random_heads(model, num_heads=3), calibration, StepCost(COST, [HEAD_CALL]))
    calibration.heads["weights_sha256"] = "0" * 64
    with pytest.raises(CalibrationMismatchError, match="weights_sha256"):
        check_calibration(calibration, {**heads_identity(random_heads(model, num_heads=2)),
                                        "weights_sha256": "f" * 64})


@pytest.mark.parametrize("damage", ["truncated", "nan", "probability", "ragged", "unknown field", "rows",
                                    "ragged lookup"])
def test_a_damaged_calibration_file_is_refused(tmp_path, damage):
    model = tiny_model("llama")
    data = flat_calibration(random_heads(model, num_heads=2), 0.5).to_dict()
    path = tmp_path / "calibration.json"
    text = json.dumps(data)
    if damage == "truncated":
        text = text[: len(text) // 2]
    elif damage == "nan":
        text = text.replace("0.5", "NaN", 1)
    elif damage == "probability":
        data["acceptance"][0][3] = 1.5
        text = json.dumps(data)
    elif damage == "ragged":
        data["acceptance"][1] = data["acceptance"][1][:-1]
        text = json.dumps(data)
    elif damage == "rows":  # fewer depths than the heads it names
        for key in ("acceptance", "counts", "accuracy"):
            data[key] = data[key][:1]
        text = json.dumps(data)
    elif damage == "ragged lookup":
        data["lookup"][1] = data["lookup"][1][:2]
        text = json.dumps(data)
    else:
        data["extra"] = 1
        text = json.dumps(data)
    path.write_text(text)
    with pytest.raises(ValueError, match="calibration"):
        load_calibration(path)


def test_step_cost_never_falls_with_size_and_pays_whole_buckets():
    cost = StepCost({1: 0.05, 2: 0.07, 4: 0.06, 8: 0.08}, [0.001], buckets=(1, 4, 8))
    values = [cost.verify(n) for n in range(1, 9)]
    assert all(b >= a for a, b in zip(values, values[1:], strict=False))
    assert cost.verify(2) == cost.verify(4) and cost.verify(5) == cost.verify(8)
    with pytest.raises(ValueError, match="positive and finite"):
        StepCost({1: math.nan}, [0.001])


def test_head_vocab_mapping_is_used_for_the_tree_tokens():
    """Heads on a truncated vocabulary: node tokens are base ids."""
    heads = CalibratedTableHeads(lambda k, path: torch.linspace(3, 0, V))
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.9, length=2), StepCost(COST, [HEAD_CALL] * 2),
                             lookup_length=0)
    state = drafter.new_state()
    state.hidden = torch.zeros(4)
    from medusa.drafters.base import TopK

    tree = drafter.propose(state, torch.tensor(ROOT), torch.tensor(PROMPT + [ROOT]), TopK())
    assert len(tree.tokens) > 3
    assert set(tree.tokens[1:].tolist()) <= set(HEAD_VOCAB.tolist())


def test_a_tree_between_buckets_is_pruned_to_the_one_below_when_the_next_costs_too_much():
    """Greedy drafts grown to 15 nodes on the smooth curve, but a 16-node forward costs six plain ones: every step
    settles on 4 nodes (its least likely nodes pruned, leaves first), and the output is still the base's."""
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    reference = hf_greedy(model, ids, 32)
    heads = OracleHeads(model, ids.tolist() + reference, ranks=[0, 1, 0], vocab=model.config.vocab_size)
    cost = StepCost({1: 0.05, 4: 0.051, 8: 0.052, 15: 0.053, 16: 0.3, 32: 0.5}, [HEAD_CALL] * 3, (1, 4, 16, 32))
    out, stats = decode(model, PerStepDrafter(heads, flat_calibration(heads, 0.5), cost, max_nodes=32), ids, 32)
    assert out == reference
    assert set(stats.tree_nodes) == {4}, stats.tree_nodes


def test_from_pretrained_takes_the_per_step_tree_from_a_calibrated_folder(tmp_path):
    """A heads folder with calibration.json (and a tree.json that no longer fits, which the per-step tree never
    reads) loads as a per-step model whose greedy output is the base's; per_step=False falls back to the chain."""
    from tiny import save_tiny

    from medusa.decode.tree import Tree, save_tree
    from medusa.drafters.calibration import folder_identity
    from medusa.io.checkpoint import save_heads
    from medusa.model import MedusaModel

    base_dir = save_tiny(tmp_path / "base", "llama")
    model = tiny_model("llama")
    heads_dir = save_heads(random_heads(model, num_heads=2), tmp_path / "heads")
    calibration = flat_calibration(random_heads(model, num_heads=2), 0.6)
    calibration.heads = folder_identity(heads_dir)
    save_calibration(calibration, heads_dir / "calibration.json")
    save_tree(Tree.chain(5), heads_dir / "tree.json")  # stale: deeper than the 2 heads
    loaded = MedusaModel.from_pretrained(base_dir, heads_dir, engine="eager")
    assert loaded.per_step
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(1))
    tokens, stats = loaded.generate(ids, max_new_tokens=16, stop_token_ids=set())
    assert tokens == hf_greedy(loaded.base, ids, 16) and stats.tree_nodes
    with pytest.raises(ValueError, match="depth 5 but the model has only 2 heads"):
        MedusaModel.from_pretrained(base_dir, heads_dir, engine="eager", per_step=False)


@pytest.mark.parametrize("learn", [True, False])
def test_a_sequences_seen_acceptance_shrinks_trees_whose_drafts_the_base_rejects(learn):
    """Heads that are never right, under a calibration that trusts them: with the seen acceptance the trees shrink
    within the sequence (the control, learning off, keeps growing them); the tokens stay the base's either way."""
    model = tiny_model("llama")
    ids = torch.randint(3, 300, (16,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, ids, 40)
    heads = NeverRight(random_heads(model, head_type="hydra"), reference)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.9), StepCost(COST, [HEAD_CALL] * 3), lookup_length=0,
                             learn_acceptance=learn)
    out, stats = decode(model, drafter, ids, 40)
    assert out == reference and stats.tau == 1.0
    late = stats.tree_nodes[len(stats.tree_nodes) // 2:]
    if learn:
        assert sum(late) / len(late) < 0.5 * sum(stats.tree_nodes[:3]) / 3, stats.tree_nodes
    else:
        assert min(stats.tree_nodes) > 4, stats.tree_nodes


def test_greedy_trees_learn_a_head_calls_cost_from_its_wall_time_never_above_the_model():
    """With ``learn_level_cost`` (off by default), head calls measured cheaper than the profile's figure lower the
    cost greedy trees charge (a decayed mean, the figure a prior of one call); a call over three times the figure is
    skipped, and the learned cost never rises above the figure. Sampled trees keep the model's figures."""
    model = tiny_model("llama")
    heads = random_heads(model, head_type="hydra")
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.6), StepCost(COST, [HEAD_CALL] * 3), lookup_length=0)
    assert drafter.level_learned_s is None
    drafter._learn_level(1, 10 * HEAD_CALL)  # a first call making its products: skipped
    assert drafter.level_learned_s is None
    for _ in range(60):
        drafter._learn_level(1, HEAD_CALL / 4)
    learned = drafter.level_learned_s
    assert learned[0] == learned[2] == HEAD_CALL and HEAD_CALL / 4 < learned[1] < HEAD_CALL / 3
    drafter._learn_level(0, 2 * HEAD_CALL)  # slower than the model: the figure is kept
    assert drafter.level_learned_s[0] == HEAD_CALL
    charged = drafter.cost.charging_nodes(0.0, drafter.level_learned_s)
    assert charged.level(1) == learned[1] and drafter.cost.level(1) == HEAD_CALL  # the model itself unchanged
    # A greedy decode learns from its own calls; the tokens stay the base's.
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    off = PerStepDrafter(heads, flat_calibration(heads, 0.6), StepCost(COST, [HEAD_CALL] * 3), lookup_length=0)
    decode(model, off, ids, 12)
    assert off.level_learned_s is None  # off by default
    fresh = PerStepDrafter(heads, flat_calibration(heads, 0.6), StepCost(COST, [HEAD_CALL] * 3), lookup_length=0,
                           learn_level_cost=True)
    out, _ = decode(model, fresh, ids, 12)
    assert out == hf_greedy(model, ids, 12) and fresh.level_learned_s is not None  # a tiny head: well under 2 ms
    assert all(v <= HEAD_CALL for v in fresh.level_learned_s) and min(fresh.level_learned_s) < HEAD_CALL


def test_the_seen_scale_follows_what_the_base_accepted_shrunk_towards_the_calibration():
    from medusa.drafters.per_step import CHAIN, SEEN_PRIOR, PerStepState

    state = PerStepState(None)
    assert state.seen_scale(0) == state.seen_scale(CHAIN) == 1.0  # nothing seen yet
    # node 1 (depth 1, rank 0) and node 2 (its child) drafted at 0.8 each; node 3 a chain node at 0.5
    state.last_nodes = [(1, 0, 0, 0.8), (2, 1, 2, 0.8), (3, 0, CHAIN, 0.5)]
    PerStepDrafter._see(state, {0, 3})  # node 1 rejected (its child then unseen), the chain node accepted
    assert state.predicted == {0: 0.8, CHAIN: 0.5} and state.accepted == {0: 0.0, CHAIN: 1.0}
    assert state.seen_scale(0) == SEEN_PRIOR / (0.8 + SEEN_PRIOR) < 1 < state.seen_scale(CHAIN)
    assert state.seen_scale(2) == 1.0 and state.last_nodes == []


def test_the_node_overhead_is_learned_from_greedy_steps_and_left_out_of_sampled_ones():
    """Wall time beyond the cost model, per node: learned from a greedy step's timing and then charged per node (a
    large one makes greedy steps plain); sampled trees never see it, so that their draws do not depend on time."""
    from medusa.drafters.base import SampleWithoutReplacement, TopK
    from medusa.drafters.per_step import PerStepState

    model = tiny_model("llama")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2))
    reference = hf_greedy(model, ids, 8)
    heads = OracleHeads(model, ids.tolist() + reference, ranks=[0, 1, 0], vocab=model.config.vocab_size)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.9), StepCost(COST, [HEAD_CALL] * 3))
    state = PerStepState(None, step_started=10.0, step_model_s=0.05, step_nodes=4)
    drafter._time_last_step(state, 10.07)  # 20 ms beyond the model over 4 nodes
    assert drafter.node_overhead_s == pytest.approx(0.005)
    drafter._time_last_step(state, 10.5)  # ten times the model: a pause, skipped
    assert drafter.node_overhead_s == pytest.approx(0.005)

    def propose(sampler, overhead):
        drafter.node_overhead_s = overhead
        row = drafter.new_state()
        with torch.no_grad():
            hidden = heads.ref_hidden[len(ids) - 1]
            drafter.start(row, hidden[None], torch.tensor([reference[0]]))
            tree = drafter.propose(row, torch.tensor(reference[0]), torch.tensor(ids.tolist() + reference[:1]),
                                   sampler)
        return len(tree.tokens), row

    greedy = TopK(greedy=True)
    assert propose(greedy, 0.0)[0] > 4 and propose(greedy, 1.0)[0] == 1  # a second a node: plain steps
    sampler = SampleWithoutReplacement(lambda logits: logits, torch.Generator().manual_seed(0))
    size, row = propose(sampler, 1.0)
    assert size > 4 and row.step_started == 0.0  # not charged, not timed


def test_the_charged_costs_follow_the_learned_overhead_and_the_extras_are_the_curves():
    """The costs a greedy tree is grown on are made once, not every step, and made again when the learned per-node
    overhead or head-call costs move; a remembered extra node's cost is the smooth curve's difference, each copy
    its own (a copy charging more per node must not read the extras remembered without it)."""
    model = tiny_model("llama")
    heads = random_heads(model, num_heads=3)
    drafter = PerStepDrafter(heads, flat_calibration(heads, 0.6), StepCost(COST, [HEAD_CALL] * 3))
    first = drafter._charged_cost()
    assert drafter._charged_cost() is first and first.node_s == 0.0
    for n in (1, 3, 7):
        assert first.extra(n, 2) == pytest.approx(first.verify(n + 1, 2, True) - first.verify(n, 2, True))
    drafter.node_overhead_s = 0.003
    second = drafter._charged_cost()
    assert second is not first and second.node_s == 0.003
    assert second.extra(3, 2) == pytest.approx(first.extra(3, 2) + 0.003 * 2)
    drafter.level_learned_s = [0.001] * 3
    assert drafter._charged_cost().level_s == [0.001] * 3 and second.level_s == [HEAD_CALL] * 3
    drafter.level_learned_s = None
    drafter.cost.level_s = [0.5] * 3  # a field rebound on the drafter's cost is read again
    assert drafter._charged_cost().level_s == [0.5] * 3
    second.node_s = 0.01  # a remembered extra follows its copy's charge
    assert second.extra(3, 2) == pytest.approx(first.extra(3, 2) + 0.01 * 2)

    class Flat(StepCost):
        def forward(self, tokens: int) -> float:
            return 0.05

    assert type(Flat(COST, [HEAD_CALL]).charging_nodes(0.001)) is Flat  # a subclass's own curve is kept
