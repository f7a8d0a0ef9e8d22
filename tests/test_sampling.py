"""Speculative sampling on the tree is exactly the base's sampling distribution, whatever the heads.

The base is a tiny random model with a 32-token vocabulary and a peaked next-token distribution. Its logits after a
fixed prompt and root, for every continuation of up to two tokens, are tabulated once (one batched forward), so one
Medusa step (draft the tree, verify, emit 1-3 tokens) costs no model call. The first three tokens after the root are
the step's tokens, completed from the exact base distribution when the step emitted fewer; their joint frequencies
over 20,000 steps are compared with the enumerated base probabilities by a chi-square test over the bins expected
to hold at least 5 draws plus one "other" bin.
"""

from __future__ import annotations

import types

import pytest
import torch
from tiny import tiny_model

from medusa.decode.acceptance import RejectionSampling, TypicalAcceptance
from medusa.decode.logits_process import logits_processors, resolve_decoding
from medusa.decode.tree import Tree, tree_buffers
from medusa.drafters.base import sample_without_replacement
from medusa.drafters.heads_drafter import draft_tree

V = 32
PROMPT = [5, 6, 7, 8, 9, 10]
ROOT = 11
# Depth 2 with a rank gap under node [0] (rank 1 is drawn but not kept), so skipping is exercised too.
TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 2], [1, 0]])
# A truncated head vocabulary (token_map) without six of the base's unlikely tokens: q is zero there.
HEAD_VOCAB = torch.tensor([i for i in range(V) if i not in (0, 8, 14, 22, 23, 24)])
DRAWS = 20_000


@pytest.fixture(scope="module")
def base_logits():
    return tabulated_base_logits()


def tabulated_base_logits():
    """Raw base logits after prompt + root + y1 + y2: ``(V,)``, ``(V, V)``, ``(V, V, V)``, lm_head scaled x1.5."""
    model = tiny_model("llama", vocab_size=V)
    prefix = torch.tensor(PROMPT + [ROOT])
    y1, y2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    ids = torch.cat([prefix.expand(V * V, -1), y1.reshape(-1, 1), y2.reshape(-1, 1)], dim=1)  # (V*V, 9)
    with torch.no_grad():
        logits = 1.5 * model(ids).logits  # (V*V, 9, V)
    return logits[0, -3], logits[:: V, -2].reshape(V, V), logits[:, -1].reshape(V, V, V)


def processed(settings: dict, tables):
    """The base's processed logits tables (temperature / top-p applied by the library's own processor list)."""
    config = resolve_decoding(do_sample=True, top_k=0, **settings).generation_config
    processors = logits_processors(config, len(PROMPT), 16, set(), "cpu")
    dummy = torch.zeros(1, 1, dtype=torch.long)
    return [processors(dummy.expand(t.reshape(-1, V).shape[0], -1), t.reshape(-1, V)).reshape(t.shape)
            for t in tables]


class TableHeads:
    """Heads whose logits come from a function of (depth, path below the root), on the truncated head vocabulary."""

    config = types.SimpleNamespace(num_heads=2)
    head_vocab_size = len(HEAD_VOCAB)
    base_layers = ()

    def __init__(self, logits_fn):
        self.logits_fn = logits_fn

    def new_context(self):
        return None

    def extend_context(self, context, hidden, next_tokens):
        return hidden[-1]

    def draft_logits(self, k, hidden, path_tokens):
        return torch.stack([self.logits_fn(k, p[1:].tolist()) for p in path_tokens])[:, HEAD_VOCAB]  # (P, Vh)

    def to_base_ids(self, ids):
        return HEAD_VOCAB[ids]


def make_heads(kind: str, raw):
    tables = {0: lambda path: raw[0], 1: lambda path: raw[1][path[0]]}
    if kind == "random":
        noise = torch.randn(2, V, generator=torch.Generator().manual_seed(7)) * 2
        return TableHeads(lambda k, path: noise[k])
    if kind == "base":  # the base's own distribution (conditioned on the path, as Hydra heads are)
        return TableHeads(lambda k, path: tables[k](path))
    if kind == "adversarial":  # the least likely tokens first
        return TableHeads(lambda k, path: -tables[k](path))
    raise ValueError(kind)


class TopKClaimingSoftmax:
    """The known bug as a sampler: deterministic top-k candidates, reported as drawn from the softmax q."""

    def __init__(self, warp):
        self.warp = warp

    def draw(self, logits, k):
        return logits.topk(k, dim=-1).indices, torch.softmax(self.warp(logits.float()), dim=-1)


def draft(heads, sampler):
    return draft_tree(heads, torch.zeros(4), torch.tensor(ROOT), tree_buffers(TREE), sampler, vocab=HEAD_VOCAB)


def run_steps(rule, heads, tables, n: int, sampler=None, accepted: list | None = None) -> torch.Tensor:
    """``(n, 3)`` first three tokens after the root from ``n`` independent Medusa steps (each step's accepted drafts
    appended to ``accepted`` when given)."""
    buffers = tree_buffers(TREE)
    probs = [torch.softmax(t, dim=-1) for t in tables]
    gen = torch.Generator().manual_seed(1)
    out = torch.empty(n, 3, dtype=torch.long)
    for i in range(n):
        tree = draft(heads, sampler or rule.sampler)
        result = rule.accept(tree, table_logits_at(tables, buffers, tree.tokens))
        if accepted is not None:
            accepted.append(result.accepted)
        emitted = tree.tokens[result.path_nodes[1:]].tolist() + [int(result.next_token)]
        while len(emitted) < 3:  # the steps after this one: exact base sampling
            context = probs[len(emitted)][tuple(emitted)]
            emitted.append(int(torch.multinomial(context, 1, generator=gen)))
        out[i] = torch.tensor(emitted[:3])
    return out


def table_logits_at(tables, buffers, tokens):
    """``logits_at(node)`` for a drafted tree: the tabulated base logits after the node's path below the root."""
    def logits_at(node: int) -> torch.Tensor:
        path = tokens[buffers.node_paths[node, 1 : int(buffers.depth[node]) + 1]].tolist()
        return tables[len(path)][tuple(path)]

    return logits_at


def chi_square_p(samples: torch.Tensor, tables) -> float:
    """p-value of a chi-square goodness-of-fit test of ``samples`` ``(n, 3)`` against the exact joint."""
    p1, p2, p3 = (torch.softmax(t.double(), dim=-1) for t in tables)
    exact = (p1[:, None, None] * p2[:, :, None] * p3).reshape(-1)  # (V^3,)
    n = len(samples)
    counts = torch.bincount(samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2], minlength=V**3).double()
    big = exact * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([exact[big], exact[~big].sum()[None]]) * n
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


def rejection_rule(settings: dict, seed: int = 1) -> RejectionSampling:
    decoding = resolve_decoding(do_sample=True, top_k=0, seed=seed, **settings)
    return RejectionSampling(V, decoding.draft_warp(), torch.Generator().manual_seed(seed))


SETTINGS = {"t1.0": {"temperature": 1.0}, "t0.7": {"temperature": 0.7}, "top-p0.9": {"top_p": 0.9}}


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["random", "base", "adversarial"])
def test_rejection_sampling_is_exact(base_logits, kind, setting):
    tables = processed(SETTINGS[setting], base_logits)
    samples = run_steps(rejection_rule(SETTINGS[setting]), make_heads(kind, base_logits), tables, DRAWS)
    assert chi_square_p(samples, tables) > 0.01


@pytest.mark.slow
def test_control_ratio_against_a_q_not_drawn_from_is_caught(base_logits):
    """The known bug: top-k candidates (deterministic) scored against the heads' softmax q. The same test fails."""
    tables = processed(SETTINGS["t1.0"], base_logits)
    rule = rejection_rule(SETTINGS["t1.0"])
    samples = run_steps(rule, make_heads("random", base_logits), tables, DRAWS,
                        sampler=TopKClaimingSoftmax(rule.sampler.warp))
    assert chi_square_p(samples, tables) < 1e-6


def test_heads_proposing_the_base_distribution_accept_more(base_logits):
    tables = processed(SETTINGS["t0.7"], base_logits)
    rule = rejection_rule(SETTINGS["t0.7"])
    accepted = {}
    for kind in ("adversarial", "base"):
        heads, buffers = make_heads(kind, base_logits), tree_buffers(TREE)
        total = 0
        for _ in range(300):
            tree = draft(heads, rule.sampler)
            total += rule.accept(tree, table_logits_at(tables, buffers, tree.tokens)).accepted
        accepted[kind] = total / 300
    assert accepted["base"] > 1.0 > accepted["adversarial"] + 0.5


def test_sampling_without_replacement_draws_distinct_ids_in_proportion():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).expand(20_000, -1)
    draws = sample_without_replacement(probs, 2, torch.Generator().manual_seed(0))
    assert (draws[:, 0] != draws[:, 1]).all() and (draws < 3).all()
    first = torch.bincount(draws[:, 0], minlength=4).double() / 20_000
    assert torch.allclose(first, torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.double), atol=0.015)
    # P(second = 1 | first = 0) = 0.3 / 0.5
    second = draws[draws[:, 0] == 0, 1]
    assert abs(float((second == 1).double().mean()) - 0.6) < 0.02


def test_typical_acceptance_accepts_by_threshold(base_logits):
    tables = processed(SETTINGS["t0.7"], base_logits)
    buffers = tree_buffers(TREE)
    heads = make_heads("base", base_logits)
    rule = TypicalAcceptance(epsilon=0.3, delta=0.09, generator=torch.Generator().manual_seed(0))
    tree = draft(heads, rule.sampler)
    p = torch.softmax(tables[0], -1)
    threshold = min(0.3, 0.09 * float(torch.exp(-torch.special.entr(p).sum())))
    first_ok = [c for c in buffers.children[0] if p[tree.tokens[c]] > threshold]
    result = rule.accept(tree, table_logits_at(tables, buffers, tree.tokens))
    if first_ok:
        assert int(result.path_nodes[1]) == first_ok[0]
    else:
        assert result.accepted == 0
