"""Candidate trees for Medusa tree attention: the tree is data, loaded from a file and validated.

A tree is a list of paths. A path ``(r_0, r_1, ..., r_{d-1})`` is a node at depth d whose token is the ``r_i``-th
most likely token of head i at each step down: depth-1 nodes take head 0's top-k (token t+2 when the base just
produced t+1), depth-2 nodes head 1's, and so on. The root (depth 0, index 0) is the token the base itself produced
last. Every prefix of a path must be in the tree. (Medusa report, Cai et al. 2024, section 2.1.2, "tree attention";
the same layout as the research code's ``medusa_choices``.)

A tree may also carry a prompt-lookup chain (``lookup_length`` > 0): that many more nodes, a chain hanging from the
root after the heads' nodes, whose tokens are copied from the context by :mod:`medusa.drafters.prompt_lookup` (the
tokens that followed the latest earlier occurrence of the context's last n-gram; prompt lookup decoding, Saxena 2023).
It is verified in the same forward as the heads' nodes, so it costs ``lookup_length`` more tree tokens and no model
call; it pays where the base copies its context, which the heads cannot see.

File format (JSON)::

    {"name": "...", "paths": [[0], [1], [0, 0], ...], "note": "optional free text",
     "prompt_lookup": {"length": 6, "max_ngram": 3}}   # optional

Node order: the root (0), the heads' nodes by depth then rank (1 .. len(paths)), then the lookup chain from depth 1
down (len(paths) + 1 .. len(paths) + lookup_length).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from medusa.io.files import read_json

Path_ = tuple[int, ...]


@dataclass(frozen=True)
class Tree:
    """A validated candidate tree: ``paths`` sorted by depth then rank, root excluded."""

    paths: tuple[Path_, ...]
    name: str = ""
    lookup_length: int = 0
    """Nodes of the prompt-lookup chain (0: none)."""
    lookup_max_ngram: int = 3
    """Longest context n-gram the lookup matches (it falls back to shorter ones, down to 1)."""

    def __post_init__(self):
        for field_name, least in (("lookup_length", 0), ("lookup_max_ngram", 1)):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"tree {self.name!r}: {field_name} must be an int >= {least}, got {value!r}")
        seen = set()
        for path in self.paths:
            if not path:
                raise ValueError(f"tree {self.name!r}: empty path (the root is implicit)")
            if any((not isinstance(r, int)) or r < 0 for r in path):
                raise ValueError(f"tree {self.name!r}: path {list(path)} has a rank that is not a non-negative int")
            if path in seen:
                raise ValueError(f"tree {self.name!r}: duplicate path {list(path)}")
            seen.add(path)
        for path in self.paths:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"tree {self.name!r}: path {list(path)} has no parent {list(path[:-1])} in the tree")

    @property
    def depth(self) -> int:
        """Deepest node, the lookup chain included (the most draft tokens one step can accept)."""
        return max(self.head_depth, self.lookup_length)

    @property
    def head_depth(self) -> int:
        """Deepest heads' node (number of heads the tree needs)."""
        return max((len(p) for p in self.paths), default=0)

    @property
    def top_k(self) -> int:
        """Widest rank used plus one (how many top tokens per head the tree needs)."""
        return max((r for p in self.paths for r in p), default=-1) + 1

    @property
    def num_nodes(self) -> int:
        """Nodes in one verification forward, the root and the lookup chain included."""
        return len(self.paths) + 1 + self.lookup_length

    def check_fits(self, num_heads: int, top_k: int) -> None:
        """Raise ``ValueError`` if the tree is deeper than ``num_heads`` or wider than ``top_k``."""
        if self.head_depth > num_heads:
            raise ValueError(f"tree {self.name!r} has depth {self.head_depth} but the model has only {num_heads} "
                             "heads")
        if self.top_k > top_k:
            raise ValueError(
                f"tree {self.name!r} uses rank {self.top_k - 1} but only top-{top_k} candidates are drawn"
            )

    @classmethod
    def from_paths(cls, paths, name: str = "", lookup_length: int = 0, lookup_max_ngram: int = 3) -> Tree:
        """Build from any iterable of rank sequences (sorted by depth, then lexicographically)."""
        paths = list(paths)
        tuples = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if len(tuples) != len(paths):
            raise ValueError(f"tree {name!r}: duplicate paths")
        return cls(tuple(tuples), name, lookup_length, lookup_max_ngram)

    def with_lookup(self, length: int, max_ngram: int | None = None) -> Tree:
        """The same heads' nodes with a prompt-lookup chain of ``length`` nodes (0 removes it)."""
        max_ngram = self.lookup_max_ngram if max_ngram is None else max_ngram
        return Tree(self.paths, f"{self.name.split('+lookup')[0]}+lookup{length}", length, max_ngram)

    @classmethod
    def chain(cls, depth: int) -> Tree:
        """The top-1 chain ``[0], [0,0], ...``: one candidate per head (what vLLM's Medusa proposer uses)."""
        return cls(tuple((0,) * d for d in range(1, depth + 1)), f"chain-{depth}")


def load_tree(path: str | Path) -> Tree:
    """Read a tree file (see module docstring).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not JSON, no ``paths`` list, unknown keys, or an invalid tree.
    """
    path = Path(path)
    data = read_json(path, "tree file")
    if not isinstance(data, dict) or not isinstance(data.get("paths"), list):
        raise ValueError(f"tree file {path} must be a JSON object with a 'paths' list")
    unknown = set(data) - {"name", "paths", "note", "prompt_lookup"}
    if unknown:
        raise ValueError(f"tree file {path}: unknown keys {sorted(unknown)}")
    lookup = data.get("prompt_lookup", {"length": 0})
    if not isinstance(lookup, dict) or set(lookup) - {"length", "max_ngram"} or "length" not in lookup:
        raise ValueError(f"tree file {path}: 'prompt_lookup' must be an object with 'length' and optionally "
                         f"'max_ngram', got {lookup!r}")
    for key, least in (("length", 0), ("max_ngram", 1)):
        value = lookup.get(key, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"tree file {path}: 'prompt_lookup.{key}' must be an int >= {least}, got {value!r}")
    for node in data["paths"]:
        if not isinstance(node, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in node):
            raise ValueError(f"tree file {path}: every path must be a list of integer ranks, got {node!r}")
    if not isinstance(data.get("name", ""), str):
        raise ValueError(f"tree file {path}: 'name' must be a string, got {data['name']!r}")
    try:
        return Tree.from_paths(data["paths"], name=data.get("name", path.stem), lookup_length=lookup["length"],
                               lookup_max_ngram=lookup.get("max_ngram", 3))
    except ValueError as e:
        raise ValueError(f"tree file {path}: {e}") from e


def save_tree(tree: Tree, path: str | Path, note: str = "") -> None:
    """Write a tree file (see module docstring)."""
    data = {"name": tree.name, "paths": [list(p) for p in tree.paths]}
    if tree.lookup_length:
        data["prompt_lookup"] = {"length": tree.lookup_length, "max_ngram": tree.lookup_max_ngram}
    if note:
        data["note"] = note
    Path(path).write_text(json.dumps(data) + "\n")


@dataclass
class TreeBuffers:
    """Index tensors of a tree, built once per (tree, device).

    N = tree.num_nodes (root at index 0), D = tree.depth, P = number of leaves. The heads' nodes are ordered by depth,
    so the heads' nodes of one level are contiguous; the lookup chain's nodes follow them.
    """

    depth: torch.Tensor
    """(N,) long: depth of each node; the root is 0."""
    ancestor_mask: torch.Tensor
    """(N, N) bool: [i, j] is True when node j is node i or one of its ancestors (what node i may attend to)."""
    retrieve_index: torch.Tensor
    """(P, D+1) long: node indices of each root-to-leaf path; padded with -1 past the leaf."""
    node_paths: torch.Tensor
    """(N, D+1) long: node indices from the root down to each node; padded with 0 past the node."""
    level_parents: tuple[torch.Tensor, ...]
    """Per level d < D: ``(P_d,)`` indices of the depth-d nodes that have children (drafted together)."""
    level_children: tuple[torch.Tensor, ...]
    """Per level d < D: ``(C_d,)`` indices of the depth-(d+1) nodes, in order."""
    child_slot: tuple[torch.Tensor, ...]
    """Per level d < D: ``(C_d,)`` position of each child's parent in ``level_parents[d]``."""
    child_rank: tuple[torch.Tensor, ...]
    """Per level d < D: ``(C_d,)`` the child's rank among its parent's candidates (0 = most likely)."""
    level_top_k: tuple[int, ...]
    """Per level d < D: candidates needed per parent (largest child rank + 1)."""
    children: tuple[tuple[int, ...], ...] = ()
    """Per node, the indices of its children (for walking the tree one node at a time); a lookup child first."""
    lookup_nodes: torch.Tensor | None = None
    """(L,) long: the prompt-lookup chain's nodes from depth 1 down (empty: no chain)."""
    lookup_max_ngram: int = 3
    """Longest context n-gram the lookup matches."""
    parents: torch.Tensor | None = None
    """(N,) long: each node's parent; -1 for the root."""
    walk_rank: torch.Tensor | None = None
    """(N,) long: each node's place in a breadth-first walk that visits children in :attr:`children` order (the root
    0). Of twin nodes (the same tokens from the root down), the one with the lowest rank stands for all of them in
    greedy acceptance (:mod:`medusa.decode.greedy`)."""


def tree_buffers(tree: Tree, device: torch.device | str = "cpu") -> TreeBuffers:
    """Build the index tensors of ``tree`` (see :class:`TreeBuffers`)."""
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    index[()] = 0
    n, depth_max = tree.num_nodes, tree.depth
    lookup = list(range(len(tree.paths) + 1, n))  # the lookup chain, depth 1 .. lookup_length
    depth = torch.zeros(n, dtype=torch.long)
    ancestor = torch.eye(n, dtype=torch.bool)
    ancestor[:, 0] = True
    node_paths = torch.zeros(n, depth_max + 1, dtype=torch.long)
    for path in tree.paths:
        i = index[path]
        depth[i] = len(path)
        for d in range(1, len(path) + 1):
            ancestor[i, index[path[:d]]] = True
            node_paths[i, d] = index[path[:d]]
    for d, i in enumerate(lookup, start=1):
        depth[i] = d
        ancestor[i, lookup[:d]] = True
        node_paths[i, 1 : d + 1] = torch.tensor(lookup[:d])
    parents = {p[:-1] for p in tree.paths}
    leaves = [index[p] for p in tree.paths if p not in parents]
    # The lookup leaf first: of two equally long accepted paths, the one that can go deeper is taken.
    leaves = ([lookup[-1]] if lookup else []) + leaves or [0]
    retrieve = torch.full((len(leaves), depth_max + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        retrieve[row, : int(depth[leaf]) + 1] = node_paths[leaf, : int(depth[leaf]) + 1]
    children = [[] for _ in range(n)]
    # The lookup children first (see medusa.decode.greedy.greedy_accept_along_path).
    for parent, child in zip(([0] + lookup)[:-1], lookup, strict=True):
        children[parent].append(child)
    for path in tree.paths:
        children[index[path[:-1]]].append(index[path])
    level_parents, level_children, child_slot, child_rank, level_top_k = [], [], [], [], []
    for d in range(tree.head_depth):
        expanding = sorted(index[p] for p in parents if len(p) == d)
        slot = {node: s for s, node in enumerate(expanding)}
        kids = [p for p in tree.paths if len(p) == d + 1]
        level_parents.append(torch.tensor(expanding, dtype=torch.long, device=device))
        level_children.append(torch.tensor([index[p] for p in kids], dtype=torch.long, device=device))
        child_slot.append(torch.tensor([slot[index[p[:-1]]] for p in kids], dtype=torch.long, device=device))
        child_rank.append(torch.tensor([p[-1] for p in kids], dtype=torch.long, device=device))
        level_top_k.append(max(p[-1] for p in kids) + 1)
    parent = node_paths.gather(1, (depth - 1).clamp_min(0)[:, None])[:, 0]  # (N,)
    parent[0] = -1
    return TreeBuffers(depth.to(device), ancestor.to(device), retrieve.to(device), node_paths.to(device),
                       tuple(level_parents), tuple(level_children), tuple(child_slot), tuple(child_rank),
                       tuple(level_top_k), tuple(tuple(c) for c in children),
                       torch.tensor(lookup, dtype=torch.long, device=device), tree.lookup_max_ngram,
                       parent.to(device), _walk_rank(children).to(device))


def _walk_rank(children) -> torch.Tensor:
    """``(N,)`` each node's place in the breadth-first walk of :func:`_walk_order` (see ``walk_rank``)."""
    order = _walk_order(children)
    rank = torch.zeros(len(children), dtype=torch.long)
    rank[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return rank


def layout_from_parents(parents: list[int], children_order: list[list[int]] | None = None,
                        device: torch.device | str = "cpu") -> TreeBuffers:
    """The layout of any tree given each node's parent: node 0 the root (parent -1), every other node's parent
    listed before it. ``children_order`` gives each node's children in walk order (default: node order): of equally
    long accepted paths through twin nodes, the first in that order is kept.

    The heads-specific fields of :class:`TreeBuffers` (levels, lookup chain) are left empty: a drafter that needs
    them builds its own from a :class:`Tree`.

    Raises:
        ValueError: node 0 is not the root, or a parent comes after its child.
    """
    n = len(parents)
    if n == 0 or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError(f"parents must start with -1 (the root) and name an earlier node for every other node, got "
                         f"{parents}")
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    deepest = max(depth)
    node_paths = torch.zeros(n, deepest + 1, dtype=torch.long)
    ancestor = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        node_paths[i, : depth[i]] = node_paths[parents[i], : depth[i]]
        node_paths[i, depth[i]] = i
        ancestor[i] = ancestor[parents[i]]
        ancestor[i, i] = True
    children = children_order or [[c for c in range(1, n) if parents[c] == p] for p in range(n)]
    has_kids = {parents[i] for i in range(1, n)}
    leaves = [i for i in _walk_order(children) if i not in has_kids and i] or [0]
    retrieve = torch.full((len(leaves), deepest + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        retrieve[row, : depth[leaf] + 1] = node_paths[leaf, : depth[leaf] + 1]
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return TreeBuffers(torch.tensor(depth, device=device), ancestor.to(device), retrieve.to(device),
                       node_paths.to(device), (), (), (), (), (), tuple(tuple(c) for c in children), empty, 3,
                       torch.tensor(parents, dtype=torch.long, device=device), _walk_rank(children).to(device))


def _walk_order(children) -> list[int]:
    """The nodes breadth first from the root, each node's children in the order given."""
    order, i = [0], 0
    while i < len(order):
        order.extend(children[order[i]])
        i += 1
    return order


def grow_tree(accuracy: torch.Tensor, num_nodes: int, name: str = "") -> Tree:
    """Greedily grow the tree that maximises expected acceptance length under a node budget.

    A node's value is the probability that its whole path is accepted, estimated as the product of the per-head,
    per-rank accuracies along it (heads treated as independent, as in the Medusa report, section 2.1.2). Starting
    from the root, the frontier node with the highest value is added until ``num_nodes`` non-root nodes are in
    the tree; the expected acceptance length is the sum of the values of all nodes.

    Args:
        accuracy: ``(K, top_k)``: accuracy[k, r] = fraction of positions where head k's rank-r token was right.
        num_nodes: non-root nodes to add.

    Raises:
        ValueError: ``num_nodes`` < 1 or accuracy has the wrong shape.
    """
    if accuracy.ndim != 2:
        raise ValueError(f"accuracy must be (K, top_k), got shape {tuple(accuracy.shape)}")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    acc = accuracy.double().tolist()
    num_heads, top_k = len(acc), len(acc[0])
    frontier = [(-acc[0][r], (r,)) for r in range(top_k)]
    heapq.heapify(frontier)
    chosen: list[Path_] = []
    while frontier and len(chosen) < num_nodes:
        neg_value, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < num_heads:
            for r in range(top_k):
                heapq.heappush(frontier, (neg_value * acc[len(path)][r], path + (r,)))
    return Tree.from_paths(chosen, name=name)


def expected_acceptance(tree: Tree, accuracy: torch.Tensor) -> float:
    """Expected tokens per verify step under independent per-head accuracies: 1 (the base's own token) plus the
    sum over nodes of the product of accuracies along the node's path."""
    acc = accuracy.double()
    total = 1.0
    for path in tree.paths:
        value = 1.0
        for k, r in enumerate(path):
            value *= float(acc[k, r]) if r < acc.shape[1] else 0.0
        total += value
    return total
