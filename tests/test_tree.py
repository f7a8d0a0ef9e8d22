"""Candidate trees: validation, index buffers, greedy acceptance on constructed logits, growth, tree files."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from medusa.decode.greedy import greedy_accept
from medusa.decode.tree import Tree, expected_acceptance, grow_tree, load_tree, save_tree, tree_buffers
from medusa.drafters.heads_drafter import draft_tree

TREE_DIR = Path(__file__).resolve().parent.parent / "configs" / "trees"

# Node indices (root 0): (0)=1 (1)=2 (0,0)=3 (0,1)=4 (1,0)=5 (0,0,0)=6; leaves (0,1), (1,0), (0,0,0).
SMALL = Tree.from_paths([[0, 0, 0], [1], [0], [0, 1], [1, 0], [0, 0]], name="small")
LEAF_01, LEAF_10, LEAF_000 = [0, 1, 4], [0, 2, 5], [0, 1, 3, 6]


@pytest.mark.parametrize("paths, message", [
    ([(0,), (0, 1, 0)], r"path \[0, 1, 0\] has no parent \[0, 1\]"),
    ([(0,), (0,)], r"duplicate path \[0\]"),
    ([(0,), (-1,)], r"path \[-1\] has a rank that is not a non-negative int"),
    ([(0,), ()], "empty path"),
    ([(0.5,)], "not a non-negative int"),
])
def test_invalid_trees_are_rejected(paths, message):
    with pytest.raises(ValueError, match=message):
        Tree(tuple(paths), name="bad")


def test_from_paths_sorts_and_rejects_duplicates():
    assert SMALL.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert (SMALL.depth, SMALL.top_k, SMALL.num_nodes) == (3, 2, 7)
    with pytest.raises(ValueError, match="duplicate"):
        Tree.from_paths([[0], [1], [0]])


def test_check_fits():
    SMALL.check_fits(num_heads=3, top_k=2)
    with pytest.raises(ValueError, match="depth 3 but the model has only 2 heads"):
        SMALL.check_fits(num_heads=2, top_k=5)
    with pytest.raises(ValueError, match="uses rank 1 but only top-1 candidates"):
        SMALL.check_fits(num_heads=5, top_k=1)


def test_chain():
    assert Tree.chain(3).paths == ((0,), (0, 0), (0, 0, 0))


def test_buffers_of_a_hand_made_tree():
    buffers = tree_buffers(SMALL)
    assert buffers.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5], 6: [0, 1, 3, 6]}
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for node, visible in ancestors.items():
        expected[node, visible] = True
    assert torch.equal(buffers.ancestor_mask, expected)
    assert buffers.retrieve_index.tolist() == [LEAF_01 + [-1], LEAF_10 + [-1], LEAF_000]
    assert buffers.node_paths[6].tolist() == LEAF_000 and buffers.node_paths[2].tolist() == [0, 2, 0, 0]
    # Level d drafts the depth-(d+1) nodes from the depth-d nodes that have children.
    assert [p.tolist() for p in buffers.level_parents] == [[0], [1, 2], [3]]
    assert [c.tolist() for c in buffers.level_children] == [[1, 2], [3, 4, 5], [6]]
    assert [s.tolist() for s in buffers.child_slot] == [[0, 0], [0, 0, 1], [0]]
    assert [r.tolist() for r in buffers.child_rank] == [[0, 1], [0, 1, 0], [0]]
    assert buffers.level_top_k == (2, 2, 1)


class FixedHeads:
    """Medusa-like heads whose head k ranks ``ranking[k]`` (base ids, best first) whatever the node."""

    base_layers = ()

    def __init__(self, ranking: torch.Tensor, vocab: int = 200):
        self.ranking, self.vocab = ranking, vocab

    def draft_logits(self, k, hidden, path_tokens):
        logits = torch.zeros(self.vocab)
        logits[self.ranking[k]] = torch.linspace(10, 1, len(self.ranking[k]))
        return logits.expand(len(path_tokens), -1)

    def to_base_ids(self, ids):
        return ids


def test_drafted_tokens_follow_paths():
    head_topk = torch.arange(100, 109).reshape(3, 3)  # (K, top_k), all distinct
    tokens = draft_tree(FixedHeads(head_topk), torch.zeros(4), torch.tensor(7), tree_buffers(SMALL)).tokens
    assert tokens[0] == 7
    for i, path in enumerate(SMALL.paths, start=1):
        assert tokens[i] == head_topk[len(path) - 1, path[-1]]


def tree_case(predicted: dict[int, int], vocab: int = 50):
    """Tokens of SMALL's nodes and logits ``(N, V)`` whose argmax at node i is ``predicted[i]`` (else token 49)."""
    tokens = torch.tensor([10, 11, 12, 13, 14, 15, 16])  # root, then one distinct token per node
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(0))
    for node in range(7):
        logits[node, predicted.get(node, vocab - 1)] = 100.0
    return tokens, logits


def test_greedy_accept_takes_the_longest_matching_path():
    # Base agrees with (0), (0,0), (0,0,0): the last leaf wins over the first leaf (0,1), which matches only (0).
    tokens, logits = tree_case({0: 11, 1: 13, 3: 16, 6: 42})
    result = greedy_accept(tokens, logits, tree_buffers(SMALL))
    assert result.accepted == 3
    assert result.path_nodes.tolist() == LEAF_000
    assert result.next_token == 42


def test_greedy_accept_partial_path_and_bonus_token():
    tokens, logits = tree_case({0: 12, 2: 30})  # (1) accepted, (1,0) rejected: the base says 30 instead of 15
    result = greedy_accept(tokens, logits, tree_buffers(SMALL))
    assert (result.accepted, result.path_nodes.tolist(), int(result.next_token)) == (1, [0, 2], 30)


def test_padding_never_matches():
    # Leaf (0,1) is fully accepted and the base's prediction after it equals the root token. Reading the -1 pad as
    # node 0 would accept a phantom third token there.
    tokens, logits = tree_case({0: 11, 1: 14, 4: 10})
    result = greedy_accept(tokens, logits, tree_buffers(SMALL))
    assert result.accepted == 2
    assert result.path_nodes.tolist() == LEAF_01
    assert result.next_token == 10


def test_zero_acceptance_emits_the_base_token():
    tokens, logits = tree_case({0: 33})
    result = greedy_accept(tokens, logits, tree_buffers(SMALL))
    assert (result.accepted, result.path_nodes.tolist(), int(result.next_token)) == (0, [0], 33)


ACCURACY = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.15, 0.05], [0.4, 0.1, 0.02]])


@pytest.mark.parametrize("budget", [1, 4, 9, 20])
def test_grow_tree_respects_budget_and_keeps_parents(budget):
    tree = grow_tree(ACCURACY, budget)
    assert len(tree.paths) == budget
    assert tree.depth <= ACCURACY.shape[0] and tree.top_k <= ACCURACY.shape[1]
    paths = set(tree.paths)
    assert all(p[:-1] in paths for p in tree.paths if len(p) > 1)


def test_grow_tree_prefers_accurate_nodes():
    accuracy = torch.tensor([[0.9, 0.05], [0.8, 0.1]])
    assert grow_tree(accuracy, 1).paths == ((0,),)
    assert grow_tree(accuracy, 2).paths == ((0,), (0, 0))  # 0.72 beats the second-ranked first token's 0.05
    assert set(grow_tree(accuracy, 3).paths) == {(0,), (0, 0), (0, 1)}  # 0.09 beats 0.05


def test_grow_tree_is_optimal_on_a_small_space():
    """Greedy growth equals the best of all valid trees of the same size (brute force over 2 heads x top-2)."""
    accuracy = torch.tensor([[0.5, 0.3], [0.6, 0.45]])
    space = [(a,) for a in range(2)] + [(a, b) for a in range(2) for b in range(2)]
    for budget in range(1, len(space) + 1):
        valid = [s for s in itertools.combinations(space, budget) if all(p[:-1] in s for p in s if len(p) > 1)]
        best = max(expected_acceptance(Tree.from_paths(s), accuracy) for s in valid)
        assert expected_acceptance(grow_tree(accuracy, budget), accuracy) == pytest.approx(best)


def test_grow_tree_stops_when_the_space_is_exhausted():
    assert len(grow_tree(torch.full((2, 2), 0.5), 100).paths) == 2 + 4


def test_expected_acceptance_grows_with_budget():
    values = [expected_acceptance(grow_tree(ACCURACY, n), ACCURACY) for n in range(1, 15)]
    assert all(b > a for a, b in zip(values[:-1], values[1:], strict=True))
    chain = Tree.chain(3)
    assert expected_acceptance(chain, ACCURACY) == pytest.approx(1 + 0.6 + 0.6 * 0.5 + 0.6 * 0.5 * 0.4)
    assert expected_acceptance(Tree(()), ACCURACY) == 1.0


@pytest.mark.parametrize("accuracy, budget, message", [
    (torch.ones(3), 2, "must be \\(K, top_k\\)"),
    (torch.ones(2, 2), 0, "num_nodes must be >= 1"),
])
def test_grow_tree_argument_errors(accuracy, budget, message):
    with pytest.raises(ValueError, match=message):
        grow_tree(accuracy, budget)


def test_save_load_round_trip(tmp_path):
    path = tmp_path / "small.json"
    save_tree(SMALL, path, note="hand-made")
    loaded = load_tree(path)
    assert loaded == SMALL
    assert json.loads(path.read_text())["note"] == "hand-made"


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('[[0], [1]]', "must be a JSON object with a 'paths' list"),
    ('{"paths": [[0]], "tree": 1}', r"unknown keys \['tree'\]"),
    ('{"paths": [[0, 0]]}', "has no parent"),
])
def test_load_tree_errors(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tree(path)


def test_load_missing_tree_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tree(tmp_path / "absent.json")


def test_shipped_tree_files_are_valid():
    files = sorted(p for p in TREE_DIR.glob("*.json") if not p.name.endswith(".report.json"))
    if not files:
        pytest.skip(f"no tree files in {TREE_DIR}")
    for path in files:
        tree = load_tree(path)
        assert tree.paths or tree.lookup_length, path  # a tree drafts something
        buffers = tree_buffers(tree)
        assert buffers.ancestor_mask.shape == (tree.num_nodes, tree.num_nodes), path
        assert (buffers.retrieve_index[:, 0] == 0).all(), path


def test_accept_along_path_matches_accepting_on_all_nodes():
    """The one-node-at-a-time walk accepts what scoring every node at once accepts, on many random cases."""
    from medusa.decode.greedy import greedy_accept_along_path

    tree = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]])
    buffers = tree_buffers(tree)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        topk = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(3)])  # (K, top_k) distinct per head
        tokens = draft_tree(FixedHeads(topk, vocab=6), torch.zeros(4), torch.tensor(5), buffers).tokens
        logits = torch.randn(tree.num_nodes, 6, generator=gen) * 3
        full = greedy_accept(tokens, logits, buffers)
        asked = []

        def next_token_at(node, logits=logits, asked=asked):
            asked.append(node)
            return logits[node].argmax()

        walk = greedy_accept_along_path(tokens, next_token_at, buffers)
        assert walk.accepted == full.accepted
        assert walk.path_nodes.tolist() == full.path_nodes.tolist()
        assert int(walk.next_token) == int(full.next_token)
        assert asked == full.path_nodes.tolist()  # only the accepted path was scored


def test_argmax_rows_is_torch_argmax_on_ties_nan_inf_and_strided_rows():
    """The greedy paths' argmax (numpy's on CPU float32 logits) names the same index as ``torch.argmax`` wherever
    the two could part: ties (the first wins), NaN (counted largest, the first), infinities, signed zeros, strided
    and batched rows; other dtypes and autograd tensors go through torch. A control: the last of tied maxima would
    be another index."""
    from medusa.decode.greedy import argmax_rows

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, nan, 3.0, nan], [-inf, -inf, -inf, -inf], [1.0, inf, inf, 0.0],
                         [-0.0, 0.0, -1.0, -2.0], [0.0, -0.0, 5.0, 5.0]])
    assert argmax_rows(rows).tolist() == rows.argmax(-1).tolist() == [1, 1, 0, 1, 0, 2]
    assert rows.shape[-1] - 1 - rows.flip(-1).argmax(-1)[0] != argmax_rows(rows)[0]  # last-of-ties differs
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 5, 4099, generator=gen).round()  # many ties
    for x in (wide, wide[1], wide[:, :, ::3], wide.transpose(0, 1), wide[0, 0]):
        got = argmax_rows(x)
        assert got.dtype == torch.long and got.shape == x.shape[:-1] and torch.equal(got, x.argmax(-1))
    for x in (wide.double(), wide.bfloat16(), wide.clone().requires_grad_()):
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    with torch.inference_mode():
        assert torch.equal(argmax_rows(wide * 1), wide.argmax(-1))
    negated = torch._neg_view(wide)  # a lazily negated view: numpy cannot read it, torch answers
    assert torch.equal(argmax_rows(negated), negated.argmax(-1))
