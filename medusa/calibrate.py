"""Sizing the candidate tree for given heads on a given machine.

Two measurements decide the tree: how often each head's rank-r token is right (per-head, per-rank accuracy on
held-out base continuations) and what a verify forward over n tokens costs relative to one token on this machine.
The tree for each node budget is grown greedily (:func:`medusa.tree.grow_tree`) and the budget with the best
predicted speedup, expected acceptance length divided by verify cost, is chosen (Medusa report, section 2.1.2 and
appendix on optimised tree construction).
"""

from __future__ import annotations

import torch

from medusa import kv_cache
from medusa.heads import HydraHeads, MedusaHeads, head_target_offset
from medusa.tree import Tree, expected_acceptance, grow_tree


@torch.inference_mode()
def sequence_states(model, sequences: list[tuple[list[int], int]]) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """The base's last hidden states of each sequence: ``(token_ids (T,), response_start, hidden (T, H))``."""
    decoder = kv_cache.decoder_of(model)
    out = []
    for ids, start in sequences:
        tokens = torch.tensor(ids, device=model.device)
        out.append((tokens, start, decoder(input_ids=tokens[None]).last_hidden_state[0]))  # (T, H)
    return out


@torch.inference_mode()
def rank_accuracy(model, heads: MedusaHeads | HydraHeads, sequences: list[tuple[list[int], int]],
                  top_k: int = 10) -> torch.Tensor:
    """Per-head, per-rank accuracy of the heads on token sequences.

    Hydra heads read the true tokens between t and their target, so head k's accuracy is conditional on the tree
    path above it being right: exactly the probability a tree node is accepted given its parent was. (For Medusa
    heads it is unconditional; the product along a path then treats heads as independent.)

    Args:
        model: the base causal LM.
        heads: heads for that base.
        sequences: ``(token_ids, response_start)`` pairs; targets are counted only inside the response
            (positions >= response_start), as in decoding.
        top_k: ranks measured.

    Returns:
        ``(K, top_k)`` float: [k, r] = fraction of targets for head k that are exactly its rank-r token.

    Raises:
        ValueError: no sequence has a response long enough to give a target.
    """
    return rank_accuracy_from_states(heads, sequence_states(model, sequences), top_k)


@torch.inference_mode()
def rank_accuracy_from_states(heads: MedusaHeads | HydraHeads, states: list[tuple[torch.Tensor, int, torch.Tensor]],
                              top_k: int = 10) -> torch.Tensor:
    """:func:`rank_accuracy` from precomputed :func:`sequence_states` (the base runs once for many heads)."""
    num_heads = heads.config.num_heads
    hits = torch.zeros(num_heads, top_k)
    counts = torch.zeros(num_heads)
    for tokens, start, hidden in states:
        ranked = heads.to_base_ids(heads(hidden, tokens).topk(top_k, dim=-1).indices)  # (K, T, top_k)
        for k in range(num_heads):
            offset = head_target_offset(k)
            # Hidden state at t predicts t + offset; only targets inside the response count.
            t = torch.arange(max(start - offset, 0), len(tokens) - offset, device=tokens.device)
            if len(t) == 0:
                continue
            match = ranked[k, t] == tokens[t + offset, None]  # (n, top_k)
            hits[k] += match.float().sum(0).cpu()
            counts[k] += len(t)
    if counts.min() == 0:
        raise ValueError("no held-out sequence is long enough to measure every head")
    return hits / counts[:, None]


def interpolate_cost(cost_curve: dict[int, float], n: int) -> float:
    """Relative cost of a forward over ``n`` tokens, linearly interpolated in the measured curve."""
    sizes = sorted(k for k in cost_curve if isinstance(k, int))
    if n <= sizes[0]:
        return cost_curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if n <= hi:
            return cost_curve[lo] + (cost_curve[hi] - cost_curve[lo]) * (n - lo) / (hi - lo)
    lo, hi = sizes[-2], sizes[-1]
    return cost_curve[hi] + (cost_curve[hi] - cost_curve[lo]) * (n - hi) / (hi - lo)


def choose_tree(accuracy: torch.Tensor, cost_curve: dict[int, float], max_nodes: int = 64,
                level_cost: float = 0.0, name: str = "") -> tuple[Tree, list[dict]]:
    """Pick the node budget with the best predicted speedup.

    Args:
        accuracy: ``(K, top_k)`` per-head per-rank accuracy (:func:`rank_accuracy`).
        cost_curve: relative verify cost by number of new tokens (1 -> 1.0), e.g. from
            :func:`medusa.bench.verify_cost_curve`.
        max_nodes: largest budget tried (non-root nodes).
        level_cost: cost of drafting one tree level (one head call), relative to one single-token base forward;
            a tree of depth D pays it D times per step.

    Returns:
        ``(tree, table)`` where table lists, per budget, expected tau, relative step cost and predicted speedup.
    """
    table, best = [], None
    for budget in range(1, max_nodes + 1):
        tree = grow_tree(accuracy, budget, name=name)
        tau = expected_acceptance(tree, accuracy)
        cost = interpolate_cost(cost_curve, tree.num_nodes) + level_cost * tree.depth
        row = {"nodes": budget, "expected_tau": tau, "relative_cost": cost, "predicted_speedup": tau / cost}
        table.append(row)
        if best is None or row["predicted_speedup"] > best[1]["predicted_speedup"]:
            best = (tree, row)
    return best[0], table
