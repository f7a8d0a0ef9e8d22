"""Prompt lookup: drafts copied from the context, verified as one more branch of the tree.

What must hold: the copied draft is the continuation of the latest earlier occurrence of the longest matching
n-gram; the chain's nodes are laid out as a chain from the root; greedy decoding with a lookup chain is still
exactly the base's greedy decoding (five architectures, both verify modes, one row or a batch, with and without
heads); speculative sampling with a copied token stays exact; and the replayed tau that build-tree optimises is the
tau decoding then measures.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_decoding import ARCHS, WIDE_TREE, hf_greedy, random_heads
from test_sampling import (
    DRAWS,
    TREE,
    chi_square_p,
    make_heads,
    processed,
    rejection_rule,
    table_logits_at,
    tabulated_base_logits,
)
from tiny import tiny_model

from medusa.decode.acceptance import TypicalAcceptance
from medusa.decode.batch import batch_generate
from medusa.decode.greedy import greedy_accept, greedy_accept_along_path
from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree, load_tree, save_tree, tree_buffers
from medusa.drafters.base import TopK
from medusa.drafters.composite import CompositeDrafter, tree_drafter
from medusa.drafters.prompt_lookup import PromptLookupDrafter, lookup_draft, lookup_match
from medusa.tools.calibrate import (
    Replay,
    choose_tree,
    rank_accuracy_from_replays,
    rank_accuracy_from_states,
    replay_data,
    replayed_tau,
    sequence_states,
)

T = torch.tensor


def test_lookup_copies_after_the_latest_occurrence_of_the_longest_ngram():
    # "1 2 3" occurs at 0 (followed by 4 5) and "3" alone at 7 (followed by 8): the 3-gram wins over the later 1-gram.
    assert lookup_draft(T([1, 2, 3, 4, 5, 9, 9, 3, 8, 1, 2, 3]), 2).tolist() == [4, 5]
    # Two occurrences of "1 2": the latest one's continuation (7), not the first's (6).
    assert lookup_draft(T([1, 2, 6, 0, 1, 2, 7, 0, 1, 2]), 1).tolist() == [7]
    # max_ngram 1 looks at the last token only: its latest earlier occurrence is at 7, followed by 8.
    assert lookup_draft(T([1, 2, 3, 4, 5, 9, 9, 3, 8, 1, 2, 3]), 2, max_ngram=1).tolist() == [8, 1]


def test_lookup_repeats_a_span_that_reaches_the_end_and_pads_without_a_match():
    # "7 8" matched at 0; the copy 7 8 reaches the end and continues with itself.
    assert lookup_draft(T([7, 8, 7, 8]), 5).tolist() == [7, 8, 7, 8, 7]
    assert lookup_draft(T([1, 2, 3]), 3).tolist() == [3, 3, 3]  # the last token is new: no match
    assert lookup_draft(T([5]), 2).tolist() == [5, 5]
    assert lookup_draft(T([1, 2, 1]), 0).tolist() == []


def _lookup_by_list(ids: list[int], length: int, max_ngram: int) -> tuple[list[int], int]:
    """The rule spelled out on a list: the last earlier match of the longest final n-gram, copied periodically."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        starts = [j for j in range(len(ids) - n) if ids[j:j + n] == ids[len(ids) - n:]]
        if starts:
            copied = ids[starts[-1] + n:]
            return (copied * length)[:length], n
    return [ids[-1]] * length, 0


def test_the_cpu_byte_search_matches_the_rule_on_random_sequences():
    """CPU sequences are searched as bytes (8 per id); a match must start at an id's first byte: ids times 257 make
    byte patterns that straddle two ids, the case an unaligned hit would get wrong."""
    gen = torch.Generator().manual_seed(5)
    for trial in range(400):
        size = int(torch.randint(1, 30, (1,), generator=gen))
        vocab = 4 if trial % 2 else 70000
        ids = torch.randint(0, vocab, (size,), generator=gen) * (257 if trial % 3 == 0 else 1)
        length, ngram = int(torch.randint(1, 9, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        tokens, n = lookup_match(ids, length, ngram)
        assert (tokens.tolist(), n) == _lookup_by_list(ids.tolist(), length, ngram)
        assert tokens.dtype == ids.dtype


@pytest.mark.parametrize("sequence, length, ngram", [(T([], dtype=torch.long), 2, 3), (T([[1, 2]]), 2, 3),
                                                      (T([1, 2]), -1, 3), (T([1, 2]), 2, 0)])
def test_lookup_bad_input_is_named(sequence, length, ngram):
    with pytest.raises(ValueError, match="sequence|length|max_ngram"):
        lookup_draft(sequence, length, ngram)


def test_lookup_chain_layout():
    tree = Tree.from_paths([[0], [1], [0, 0]], "t", lookup_length=3)
    assert (tree.num_nodes, tree.depth, tree.head_depth) == (7, 3, 2)
    b = tree_buffers(tree)
    chain = b.lookup_nodes.tolist()
    assert chain == [4, 5, 6] and b.depth[chain].tolist() == [1, 2, 3]
    # Each chain node sees the root and the chain above it, nothing of the heads' nodes.
    assert b.ancestor_mask[6].nonzero().flatten().tolist() == [0, 4, 5, 6]
    assert not b.ancestor_mask[chain][:, 1:4].any() and not b.ancestor_mask[1:4][:, chain].any()
    assert b.children[0][0] == 4 and b.children[4] == (5,) and b.children[6] == ()
    assert b.retrieve_index[0].tolist() == [0, 4, 5, 6]
    # The heads draft only their own levels.
    assert len(b.level_parents) == 2 and all(int(c.max()) <= 3 for c in b.level_children)


def test_tree_file_round_trip_and_bad_lookup_fields(tmp_path):
    tree = Tree.from_paths([[0], [1]], "t", lookup_length=6, lookup_max_ngram=2)
    save_tree(tree, tmp_path / "t.json")
    assert load_tree(tmp_path / "t.json") == tree
    assert load_tree(tmp_path / "t.json").check_fits(1, 2) is None  # the chain needs no head
    for bad in ({"length": -1}, {"max_ngram": 2}, {"length": 2, "max_ngram": 0}, {"length": 2, "extra": 1},
                {"length": "6"}, [6]):
        (tmp_path / "b.json").write_text(json.dumps({"paths": [[0]], "prompt_lookup": bad}))
        with pytest.raises(ValueError, match="prompt_lookup|lookup_length|lookup_max_ngram"):
            load_tree(tmp_path / "b.json")


def test_drafting_a_lookup_chain_needs_the_context():
    drafter = PromptLookupDrafter(2)
    for missing in (T([], dtype=torch.long), T([[3, 4]])):
        with pytest.raises(ValueError, match="non-empty 1-D tensor of token ids"):
            drafter.propose(drafter.new_state(), T(3), missing, TopK())


def test_the_lookup_drafter_copies_from_the_context_as_deterministic_nodes():
    drafter = PromptLookupDrafter(2)
    draft = drafter.propose(drafter.new_state(), T(3), T([3, 4, 5, 3]), TopK())
    assert draft.tokens.tolist() == [3, 4, 5]
    assert draft.copied.tolist() == [1, 2] and draft.draws == []
    assert draft.layout.parents.tolist() == [-1, 0, 1]
    assert draft.confidence().tolist() == [1.0, 1.0, 1.0]  # a copied token's q is one-hot
    with pytest.raises(ValueError, match="length >= 1"):
        PromptLookupDrafter(0)


def test_a_composite_of_heads_and_lookup_has_the_tree_file_layout():
    """Heads' nodes then the lookup chain, the chain first in ties: the node order and walk order of the tree
    file, so decoding is as before the drafter seam."""
    for tree in (Tree.chain(3).with_lookup(4), WIDE_TREE.with_lookup(6), Tree.from_paths([[0], [0, 0]], "t", 2)):
        heads = random_heads(tiny_model("llama"))
        drafter = tree_drafter(heads, tree)
        assert isinstance(drafter, CompositeDrafter) and drafter.max_nodes == tree.num_nodes
        state = drafter.new_state()
        drafter.start(state, torch.zeros(1, 64), T([11]))
        draft = drafter.propose(state, T(11), T([5, 6, 11]), TopK())
        expected = tree_buffers(tree)
        for name in ("depth", "ancestor_mask", "node_paths", "parents", "walk_rank"):
            assert torch.equal(getattr(draft.layout, name), getattr(expected, name)), (tree.name, name)
        assert draft.layout.children == expected.children
        assert draft.copied.tolist() == expected.lookup_nodes.tolist()
        assert [d.nodes.tolist() for d in draft.draws] == [c.tolist() for c in expected.level_children]


def test_walk_follows_the_children_of_twin_nodes():
    """A lookup node repeating a heads' node: the heads' child below the twin is still reachable, and the walk
    accepts as much as the all-nodes rule."""
    tree = Tree.from_paths([[0], [0, 0]], "t", lookup_length=2)  # heads: 1 -> 2; lookup: 3 -> 4
    buffers = tree_buffers(tree)
    tokens = T([9, 5, 6, 5, 7])  # lookup copies 5 then 7; the heads drafted 5 then 6
    base_next = {0: 5, 1: 6, 3: 6, 2: 8, 4: 1}  # the base: 9 -> 5 -> 6 -> 8 (7 is wrong)
    result = greedy_accept_along_path(tokens, lambda node: T(base_next[node]), buffers)
    assert result.accepted == 2 and tokens[result.path_nodes].tolist() == [9, 5, 6] and int(result.next_token) == 8
    logits = torch.full((5, 10), -1.0)
    logits[torch.arange(5), T([base_next[n] for n in range(5)])] = 1.0
    assert greedy_accept(tokens, logits, buffers).accepted == 2


LOOKUP_TREES = [Tree.chain(3).with_lookup(4), WIDE_TREE.with_lookup(6), Tree.chain(0).with_lookup(5)]


@pytest.mark.parametrize("verify_logits", ["all", "path"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_a_lookup_chain_is_the_base_greedy(arch, verify_logits):
    model = tiny_model(arch)
    # A prompt that repeats itself, so the copied chain is accepted on some steps.
    ids = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(0)).repeat(2)
    reference = hf_greedy(model, ids, 40)
    heads = random_heads(model, head_type="hydra")
    for tree in LOOKUP_TREES:
        out, stats = medusa_generate(model, heads, ids, tree, 40, verify_logits=verify_logits)
        assert out == reference, (arch, tree.name)
        assert stats.new_tokens == 40


def test_lookup_accepts_a_repeating_answer():
    """This tiny Gemma 3 answers the prompt by repeating one token: the copied chain (which continues a span that
    reaches the end of the context) is right every step, so each verify forward emits the chain and the bonus."""
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(3))
    reference = hf_greedy(model, ids, 40)
    assert len(set(reference[2:])) == 1  # the premise: greedy text that repeats
    out, stats = medusa_generate(model, random_heads(model), ids, Tree.chain(0).with_lookup(6), 40)
    assert out == reference
    assert stats.accepted_per_step[1:-1] == [6] * (len(stats.accepted_per_step) - 2)
    # With only a lookup chain, every accepted draft kept was copied (the last step's are cut at the budget).
    assert 0 < sum(stats.accepted_per_step[:-1]) <= stats.copied_tokens <= sum(stats.accepted_per_step)


def test_the_lookup_chains_share_counts_only_copied_drafts():
    """A tree of heads and a lookup chain on a repeating answer: some copied drafts are counted, never more than
    were accepted; a tree without a chain counts none."""
    model = tiny_model("gemma3")
    ids = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(3))
    heads = random_heads(model)
    _, with_chain = medusa_generate(model, heads, ids, Tree.chain(2).with_lookup(6), 40)
    assert 0 < with_chain.copied_tokens <= sum(with_chain.accepted_per_step)
    _, heads_only = medusa_generate(model, heads, ids, Tree.chain(2), 40)
    assert heads_only.copied_tokens == 0


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_batched_lookup_equals_one_at_a_time(arch):
    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=gen).repeat(2) for n in (5, 9, 7)]
    heads = random_heads(model, head_type="hydra")
    tree = WIDE_TREE.with_lookup(4)
    for verify_logits in ("all", "path"):
        batched, _ = batch_generate(model, heads, prompts, tree, 24, verify_logits=verify_logits)
        assert batched == [hf_greedy(model, p, 24) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replayed_tau_is_the_tau_decoding_measures(arch):
    """build-tree scores trees by replaying greedy decoding on held-out base continuations: on the base's own
    greedy text that replay must predict the decode's tau exactly."""
    model = tiny_model(arch)
    heads = random_heads(model, head_type="hydra")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (8,), generator=gen).repeat(2) for _ in range(3)]
    answers = [hf_greedy(model, p, 30) for p in prompts]
    states = sequence_states(model, [(p.tolist() + a, len(p)) for p, a in zip(prompts, answers, strict=True)])
    replays = replay_data(heads, states, top_k=4, max_lookup=8)
    assert torch.equal(rank_accuracy_from_replays(replays, 4), rank_accuracy_from_states(heads, states, 4))
    for tree in (Tree.from_paths([[0], [1], [0, 0]]), Tree.from_paths([[0], [1], [0, 0]]).with_lookup(5),
                 Tree.chain(0).with_lookup(8)):
        steps = emitted = 0
        for prompt in prompts:
            _, stats = medusa_generate(model, heads, prompt, tree, 30, verify_logits="path")
            steps, emitted = steps + stats.decode_steps, emitted + stats.decode_tokens
        assert replayed_tau(tree, replays) == pytest.approx(emitted / steps), tree.name


def test_replayed_tau_counts_the_longer_branch_and_stops_at_the_end():
    # Tokens 0..7, response from 1: decoding emits tokens 2..7 after the prefill. At i = 0 the heads are right for
    # one token and the copy for three; at i = 5 the copy would run past the last token.
    ranks = [[0, 5]] + [[5, 5]] * 7
    replay = Replay(start=1, ranks=ranks, lookup_match=[3, 0, 0, 0, 0, 2, 0, 0])
    heads = Tree.from_paths([[0], [0, 0]])
    assert replayed_tau(heads, [replay]) == pytest.approx(6 / 5)  # 2 + 1 + 1 + 1 + 1
    assert replayed_tau(heads.with_lookup(2), [replay]) == pytest.approx(6 / 4)  # 3 + 1 + 1 + 1
    assert replayed_tau(heads.with_lookup(3), [replay]) == pytest.approx(6 / 3)  # 4 + 1 + 1 (cut at the end)
    with pytest.raises(ValueError, match="no held-out sequence"):
        replayed_tau(heads, [Replay(start=7, ranks=ranks, lookup_match=[0] * 8)])
    with pytest.raises(ValueError, match="needs replay data"):
        choose_tree(torch.full((2, 2), 0.5), {1: 1.0, 8: 1.2}, max_nodes=2, lookup_lengths=(0, 4))
    tree, table = choose_tree(torch.full((2, 2), 0.5), {1: 1.0, 8: 1.0}, max_nodes=2, replays=[replay],
                              lookup_lengths=(0, 3))
    # At equal cost the 3-token chain (tau 2.0 with one node, above) beats every heads-only tree here.
    assert tree.lookup_length == 3 and len(table) == 4


@pytest.fixture(scope="module")
def base_logits():
    return tabulated_base_logits()


def table_drafter(heads, tree):
    """The tree file's drafter over table heads, its state started (``drafter.state``)."""
    drafter = tree_drafter(heads, tree)
    drafter.state = drafter.new_state()
    drafter.start(drafter.state, torch.zeros(1, 4), T([11]))
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize("copied", ["likely", "unlikely"])
@pytest.mark.parametrize("kind", ["random", "base"])
def test_rejection_sampling_with_a_copied_chain_is_exact(base_logits, kind, copied):
    """A copied token is a draft from a one-hot q; tried first, then the heads' candidates on the residual."""
    tables = processed({"temperature": 1.0}, base_logits)
    p1, p2 = (torch.softmax(t, dim=-1) for t in tables[:2])
    x = int(p1.argmax()) if copied == "likely" else int(p1.argmin())
    y = int(p2[x].argmax()) if copied == "likely" else int(p2[x].argmin())
    tree = Tree(TREE.paths, "t", lookup_length=2)
    buffers = tree_buffers(tree)
    context = T([1, 2, 11, x, y, 3, 11])  # the root 11 last: the lookup copies x, y
    rule = rejection_rule({"temperature": 1.0})
    drafter = table_drafter(make_heads(kind, base_logits), tree)
    probs = [torch.softmax(t, dim=-1) for t in tables]
    gen = torch.Generator().manual_seed(2)
    samples = torch.empty(DRAWS, 3, dtype=torch.long)
    accepted_copy = 0
    for i in range(DRAWS):
        draft = drafter.propose(drafter.state, T(11), context, rule.sampler)
        assert draft.tokens[buffers.lookup_nodes].tolist() == [x, y]
        result = rule.accept(draft, table_logits_at(tables, buffers, draft.tokens))
        accepted_copy += int(result.path_nodes[-1]) in buffers.lookup_nodes.tolist()
        emitted = draft.tokens[result.path_nodes[1:]].tolist() + [int(result.next_token)]
        while len(emitted) < 3:
            emitted.append(int(torch.multinomial(probs[len(emitted)][tuple(emitted)], 1, generator=gen)))
        samples[i] = T(emitted[:3])
    assert chi_square_p(samples, tables) > 0.01
    if copied == "likely":
        assert accepted_copy > DRAWS * float(p1[x]) * 0.9  # the copied chain is really taken


def test_typical_acceptance_tries_the_copied_token_first(base_logits):
    """The copied chain is walked like the heads' nodes: its token is taken when it passes the threshold, before
    the heads' candidates; a copied token below it falls back to the heads' children."""
    tables = processed({"temperature": 0.7}, base_logits)
    p1 = torch.softmax(tables[0], dim=-1)
    order = p1.argsort(descending=True).tolist()
    tree = Tree(TREE.paths, "t", lookup_length=2)
    buffers = tree_buffers(tree)
    drafter = table_drafter(make_heads("base", base_logits), tree)
    for copied, expect_chain in ((order[0], True), (order[-1], False)):
        rule = TypicalAcceptance(epsilon=0.3, delta=0.09, generator=torch.Generator().manual_seed(0))
        draft = drafter.propose(drafter.state, T(11), T([11, copied, 3, 11]), rule.sampler)
        result = rule.accept(draft, table_logits_at(tables, buffers, draft.tokens))
        on_chain = result.accepted > 0 and int(result.path_nodes[1]) == int(buffers.lookup_nodes[0])
        assert on_chain == expect_chain
        if not expect_chain:  # the heads' rank-0 child (the base's own top token here) passes instead
            assert result.accepted > 0 and int(result.path_nodes[1]) in buffers.children[0][1:]
