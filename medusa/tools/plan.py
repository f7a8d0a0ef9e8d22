"""The seed's analysis of speculative decoding as a calculator (``medusa plan``), and the functions the bench's
prediction uses.

A draft proposes K tokens; the base verifies all K + 1 positions in one forward (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", section 3; Chen et al. 2023). With each draft accepted with
probability alpha given the ones before it (i.i.d.), a round emits

    E[tokens] = (1 - alpha**(K+1)) / (1 - alpha)        (K + 1 when alpha = 1)

tokens and costs ``1 + K * c`` base forwards, c the cost of one draft step relative to one base forward (c_q / c_p);
the speedup over plain decoding is their ratio (Leviathan et al., theorem 3.8). With per-depth acceptance
``alpha_1 .. alpha_K`` (alpha_d given depths 1 .. d-1 accepted) the expected tokens are ``1 + sum_d prod_{i<=d}
alpha_i``. The worked example of the issue:

>>> round(expected_tokens(0.8, 5), 2), round(round_cost(5, 0.05), 2), round(speedup(0.8, 5, 0.05), 2)
(3.69, 1.25, 2.95)

The exercises (docs/plan.md):

>>> [round(expected_tokens(0.7, k), 3) for k in (4, 8, 16)]
[2.773, 3.199, 3.326]
>>> optimal_k(0.9, 1 / 20)
(13, 4.67)
>>> tree_paths(3, 4), tree_nodes(3, 4)
(81, 120)
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _check_alpha(alpha: float | Sequence[float]) -> list[float] | float:
    values = list(alpha) if isinstance(alpha, Sequence) else [alpha]
    for a in values:
        if not (isinstance(a, (int, float)) and math.isfinite(a) and 0.0 <= a <= 1.0):
            raise ValueError(f"acceptance rate alpha must be in [0, 1], got {a!r}")
    return values if isinstance(alpha, Sequence) else float(alpha)


def _check_cost(cost_ratio: float) -> float:
    if not (isinstance(cost_ratio, (int, float)) and math.isfinite(cost_ratio) and cost_ratio > 0):
        raise ValueError(f"cost ratio c_q/c_p must be > 0 (a draft step's cost over a base forward's), got "
                         f"{cost_ratio!r}")
    return float(cost_ratio)


def _check_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"draft length K must be an integer >= 0, got {k!r}")
    return k


def expected_tokens(alpha: float | Sequence[float], k: int | None = None) -> float:
    """Expected tokens one round emits (accepted drafts + the base's own token).

    Args:
        alpha: one acceptance rate in [0, 1] (i.i.d. per draft), or per-depth rates ``[alpha_1, ..., alpha_K]``
            (each given the depths above it accepted; then ``k`` defaults to their count and may not exceed it).
        k: drafts per round (K >= 0).

    Raises:
        ValueError: alpha outside [0, 1], K negative, or K longer than the per-depth rates given.
    """
    alpha = _check_alpha(alpha)
    if isinstance(alpha, list):
        k = len(alpha) if k is None else _check_k(k)
        if k > len(alpha):
            raise ValueError(f"K={k} drafts but only {len(alpha)} per-depth acceptance rates given")
        total, reach = 1.0, 1.0
        for a in alpha[:k]:
            reach *= a
            total += reach
        return total
    if k is None:
        raise ValueError("K is required with a single acceptance rate")
    k = _check_k(k)
    return float(k + 1) if alpha == 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def round_cost(k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Cost of one round in base forwards: one verify (``verify_cost``: a forward over K + 1 tokens relative to one
    token's; 1 in the paper's model, measured in a machine profile) plus K draft steps of ``cost_ratio`` (c_q / c_p).

    Raises:
        ValueError: K negative, cost ratio <= 0 or verify cost <= 0.
    """
    if not (math.isfinite(verify_cost) and verify_cost > 0):
        raise ValueError(f"verify cost must be > 0, got {verify_cost!r}")
    return verify_cost + _check_k(k) * _check_cost(cost_ratio)


def speedup(alpha: float | Sequence[float], k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Expected speedup over plain decoding: ``expected_tokens / round_cost``."""
    return expected_tokens(alpha, k) / round_cost(k, cost_ratio, verify_cost)


def optimal_k(alpha: float | Sequence[float], cost_ratio: float, k_max: int = 16,
              verify_cost=None) -> tuple[int, float]:
    """The K in 1 .. ``k_max`` with the highest :func:`speedup`, and that speedup (rounded to 2 places);
    ``verify_cost(k)``, when given, is the verify forward's cost at K drafts (e.g. from the machine profile)."""
    rows = plan_table(alpha, cost_ratio, k_max, verify_cost)
    best = max(rows, key=lambda r: r["speedup"])
    return best["k"], round(best["speedup"], 2)


def tree_paths(branching: int, depth: int) -> int:
    """Candidate paths (root to leaf) of a full tree with ``branching`` children per node and ``depth`` levels."""
    _check_tree(branching, depth)
    return branching ** depth


def tree_nodes(branching: int, depth: int) -> int:
    """Draft nodes of that tree (root excluded): ``b + b**2 + ... + b**d``."""
    _check_tree(branching, depth)
    return sum(branching ** i for i in range(1, depth + 1))


def tree_expected_tokens(alpha: float, branching: int, depth: int) -> float:
    """Expected tokens per round of a full tree when each of a node's ``branching`` children is accepted
    independently with probability alpha: a level is passed with ``p = 1 - (1 - alpha)**b``, so the tree emits
    ``(1 - p**(d+1)) / (1 - p)``. An upper-bound model: a greedy base accepts at most one sibling, so real siblings are
    exclusive (the sum of their top-b probabilities), not independent."""
    _check_tree(branching, depth)
    alpha = _check_alpha(alpha)
    return expected_tokens(1 - (1 - alpha) ** branching, depth)


def _check_tree(branching: int, depth: int) -> None:
    for name, v in (("branching", branching), ("depth", depth)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"tree {name} must be an integer >= 1, got {v!r}")


def check_plan(alpha: float | Sequence[float], cost_ratio: float, branching: int | None = None,
               depth: int | None = None) -> None:
    """``medusa plan``'s inputs checked before any model is read: alpha's range, the cost ratio, and a tree's
    ``branching`` and ``depth`` given together with a single alpha.

    Raises:
        ValueError: the input at fault named.
    """
    expected_tokens(alpha, 0)
    round_cost(0, cost_ratio)
    if (branching is None) != (depth is None):
        raise ValueError("--branching and --depth go together")
    if branching is not None and isinstance(alpha, Sequence):
        raise ValueError("--branching/--depth take a single --alpha")


def plan_table(alpha: float | Sequence[float], cost_ratio: float, k_max: int = 16, verify_cost=None) -> list[dict]:
    """Rows ``{"k", "tokens", "cost", "speedup"}`` for K = 1 .. ``k_max`` (per-depth rates: up to their count);
    ``verify_cost(k)``: the verify forward's cost with K drafts relative to one token (default: 1)."""
    if isinstance(alpha, Sequence):
        k_max = min(k_max, len(alpha))
    rows = []
    for k in range(1, _check_k(k_max) + 1):
        verify = 1.0 if verify_cost is None else verify_cost(k)
        tokens, cost = expected_tokens(alpha, k), round_cost(k, cost_ratio, verify)
        rows.append({"k": k, "tokens": tokens, "cost": cost, "speedup": tokens / cost})
    return rows


def add_plan_arguments(p) -> None:
    """The ``medusa plan`` flags."""
    p.add_argument("--alpha", type=float, nargs="+", required=True,
                   help="acceptance rate in [0, 1], or per-depth rates alpha_1 .. alpha_K (each given the ones above)")
    p.add_argument("--cost-ratio", type=float, required=True,
                   help="c_q/c_p: one draft step's cost over one base forward's (> 0)")
    p.add_argument("--k", type=int, default=None, help="also print this K's figures alone")
    p.add_argument("--k-max", type=int, default=16, help="the table's largest K (default: 16)")
    p.add_argument("--branching", type=int, help="a full tree's children per node (with --depth)")
    p.add_argument("--depth", type=int, help="a full tree's levels (with --branching)")
    p.add_argument("--profile", metavar="BASE",
                   help="a base model folder: read the verify forward's cost over K + 1 tokens from this machine's "
                        "profile of it (medusa profile; measured once) instead of counting it as one forward")
    p.add_argument("--engine", default=None, help="with --profile: the engine whose costs are read (default: auto's "
                                                  "pick for each step size)")
