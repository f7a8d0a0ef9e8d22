"""Sizing the candidate tree for given heads on a given machine.

Two measurements decide the tree: how often each head's rank-r token is right (per-head, per-rank accuracy on
held-out base continuations) and what a verify forward over n tokens costs relative to one token on this machine.
The tree for each node budget is grown greedily (:func:`medusa.decode.tree.grow_tree`) and the budget with the best
predicted speedup, expected acceptance length divided by verify cost, is chosen (Medusa report, section 2.1.2 and
appendix on optimised tree construction).

With prompt lookup (:mod:`medusa.drafters.prompt_lookup`) the acceptance length is not a product of per-head
accuracies: the copied chain and the heads' branches win on different positions. There the tau of each (heads' nodes,
lookup length) pair is replayed: greedy decoding is deterministic, so the held-out base continuations say exactly which
tokens each step would accept (:func:`replayed_tau`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from medusa.base import base_states
from medusa.decode.tree import Tree, expected_acceptance, grow_tree
from medusa.drafters.calibration import Calibration
from medusa.drafters.heads import HydraHeads, MedusaHeads, head_target_offset
from medusa.drafters.prompt_lookup import lookup_draft
from medusa.profile import interpolate


@torch.inference_mode()
def sequence_states(model, sequences: list[tuple[list[int], int]],
                    layers: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    """The base states the heads read of each sequence (:func:`medusa.base.base_states`: the last hidden state, then
    the outputs of decoder layers ``layers``, the heads' ``base_layers``): ``(token_ids (T,), response_start,
    hidden (T, (1 + len(layers)) H))``."""
    out = []
    for ids, start in sequences:
        tokens = torch.tensor(ids, device=model.device)
        out.append((tokens, start, base_states(model, tokens[None], None, layers)[0]))  # (T, S)
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
    return rank_accuracy_from_states(heads, sequence_states(model, sequences, heads.base_layers), top_k)


@torch.inference_mode()
def rank_accuracy_from_states(heads: MedusaHeads | HydraHeads, states: list[tuple[torch.Tensor, int, torch.Tensor]],
                              top_k: int = 10) -> torch.Tensor:
    """:func:`rank_accuracy` from precomputed :func:`sequence_states` (the base runs once for many heads)."""
    return _accuracy_of_ranks([(true_ranks(heads, tokens, hidden, top_k), start) for tokens, start, hidden in states],
                              top_k)


def rank_accuracy_from_replays(replays: list[Replay], top_k: int = 10) -> torch.Tensor:
    """:func:`rank_accuracy` from :func:`replay_data` built with the same ``top_k`` (no second pass of the heads)."""
    return _accuracy_of_ranks([(torch.tensor(r.ranks, dtype=torch.long), r.start) for r in replays], top_k)


@torch.inference_mode()
def true_ranks(heads: MedusaHeads | HydraHeads, tokens: torch.Tensor, hidden: torch.Tensor,
               top_k: int) -> torch.Tensor:
    """``(T, K)`` long: [t, k] = rank of the true token t + k + 2 among head k's ``top_k`` candidates at position t
    (on the true path, for Hydra heads and the eagle drafter); ``top_k`` when it is not among them or lies past the
    end.

    Args:
        tokens: ``(T,)`` long token ids; hidden: ``(T, S)`` the base states over them (:func:`sequence_states`).
    """
    ranked = heads.to_base_ids(heads(hidden, tokens).topk(top_k, dim=-1).indices)  # (K, T, top_k)
    num_heads, length = ranked.shape[:2]
    ranks = torch.full((length, num_heads), top_k, dtype=torch.long)
    for k in range(num_heads):
        offset = head_target_offset(k)
        match = (ranked[k, : length - offset] == tokens[offset:, None]).cpu()  # (T - offset, top_k)
        rank = match.float().argmax(dim=1)  # (T - offset,): first hit, 0 when none
        ranks[: length - offset, k] = torch.where(match.any(dim=1), rank, top_k)
    return ranks


def _accuracy_of_ranks(sequences: list[tuple[torch.Tensor, int]], top_k: int) -> torch.Tensor:
    """``(K, top_k)`` per-rank hit rates from each sequence's :func:`true_ranks` ``(T, K)`` and response start; only
    targets inside the response count (position t of head k targets t + k + 2)."""
    num_heads = sequences[0][0].shape[1] if sequences else 0
    hits = torch.zeros(num_heads, top_k)
    counts = torch.zeros(num_heads)
    for ranks, start in sequences:
        for k in range(num_heads):
            offset = head_target_offset(k)
            rows = ranks[max(start - offset, 0) : max(len(ranks) - offset, 0), k]  # (n,)
            hits[k] += torch.bincount(rows, minlength=top_k + 1)[:top_k].float()
            counts[k] += len(rows)
    if not sequences or counts.min() == 0:
        raise ValueError("no held-out sequence is long enough to measure every head")
    return hits / counts[:, None]


@dataclass
class Replay:
    """What a greedy decode of one held-out sequence would meet at each position (:func:`replay_data`).

    Position i is a step whose last accepted hidden state is at i: the root is token i + 1, the drafts guess tokens
    i + 2 onwards.
    """

    start: int
    """First response position (the prefill's token)."""
    ranks: list[list[int]]
    """``ranks[i][k]``: rank of the true token i + k + 2 among head k's candidates at i, on the true path
    (``top_k`` when not among them or past the end)."""
    lookup_match: list[int]
    """``lookup_match[i]``: how many tokens of the prompt-lookup draft at i are right, up to ``max_lookup``."""


@torch.inference_mode()
def replay_data(heads: MedusaHeads | HydraHeads, states: list[tuple[torch.Tensor, int, torch.Tensor]],
                top_k: int = 10, max_lookup: int = 16, lookup_max_ngram: int = 3) -> list[Replay]:
    """Per-position head ranks and lookup matches of held-out sequences (from :func:`sequence_states`)."""
    out = []
    for tokens, start, hidden in states:
        ranks = true_ranks(heads, tokens, hidden, top_k)  # (T, K)
        length = len(tokens)
        matches = [0] * length
        ids = tokens.cpu()
        for i in range(max(start - 1, 0), length - 2):
            draft = lookup_draft(ids[: i + 2], max_lookup, lookup_max_ngram)
            truth = ids[i + 2 : i + 2 + max_lookup]
            agree = (draft[: len(truth)] == truth).long().cumprod(0)
            matches[i] = int(agree.sum())
        out.append(Replay(start, ranks.tolist(), matches))
    return out


def replayed_tau(tree: Tree, replays: list[Replay]) -> float:
    """Mean tokens per verify step of greedy decoding with ``tree`` over held-out base continuations.

    Each step accepts the longest tree path the base agrees with: the heads' nodes whose ranks along the true path
    are in the tree, or the lookup chain's correct prefix (:func:`medusa.decode.greedy.greedy_accept_along_path`),
    whichever is longer, then the base's own token. Exact for greedy decoding up to the lookup depth ``max_lookup``
    the replay data were built with, and up to a path :func:`medusa.decode.greedy.greedy_accept_along_path` would
    take: the prediction of one step holds for the decode.

    Raises:
        ValueError: no replay has a response to decode.
    """
    paths = set(tree.paths)
    steps = emitted = 0
    for replay in replays:
        i, end = replay.start - 1, len(replay.lookup_match) - 1  # end: the last token, the last one to emit
        while i + 2 <= end:  # a step emits tokens i + 2 .. i + accepted + 2, cut at the end
            depth = 0
            while depth < tree.head_depth and tuple(replay.ranks[i][: depth + 1]) in paths:
                depth += 1
            accepted = max(depth, min(replay.lookup_match[i], tree.lookup_length))
            steps += 1
            emitted += min(accepted + 1, end - i - 1)
            i += accepted + 1
    if not steps:
        raise ValueError("no held-out sequence has a response to replay")
    return emitted / steps


def interpolate_cost(cost_curve: dict, n: int) -> float:
    """Relative cost of a forward over ``n`` tokens, linearly interpolated in a relative cost curve (its integer
    keys; :func:`medusa.profile.interpolate`)."""
    return interpolate({k: v for k, v in cost_curve.items() if isinstance(k, int)}, n)


def choose_tree(accuracy: torch.Tensor, cost_curve: dict[int, float], max_nodes: int = 64,
                level_cost: float = 0.0, name: str = "", replays: list[Replay] | None = None,
                lookup_lengths: tuple[int, ...] = (0,), lookup_max_ngram: int = 3) -> tuple[Tree, list[dict]]:
    """Pick the node budget (and prompt-lookup length) with the best predicted speedup.

    Args:
        accuracy: ``(K, top_k)`` per-head per-rank accuracy (:func:`rank_accuracy`).
        cost_curve: relative verify cost by number of new tokens (1 -> 1.0), e.g.
            :meth:`medusa.profile.MachineProfile.cost_curve`.
        max_nodes: largest heads' node budget tried (root and lookup chain excluded).
        level_cost: cost of drafting one tree level (one head call), relative to one single-token base forward;
            a tree of depth D pays it D times per step.
        replays: held-out replay data (:func:`replay_data`); when given, each candidate is scored by its
            :func:`replayed_tau` instead of the independent-heads estimate. Needed for lookup lengths above 0.
        lookup_lengths: prompt-lookup chain lengths tried with every budget.

    Returns:
        ``(tree, table)`` where table lists, per budget and lookup length, expected tau (independent heads),
        replayed tau (when replayed), relative step cost and predicted speedup.

    Raises:
        ValueError: a lookup length above 0 without replay data.
    """
    if replays is None and any(lookup_lengths):
        raise ValueError("scoring a prompt-lookup chain needs replay data (replays=)")
    table, best = [], None
    for budget in range(1, max_nodes + 1):
        heads_tree = grow_tree(accuracy, budget, name=name)
        expected = expected_acceptance(heads_tree, accuracy)
        for length in lookup_lengths:
            tree = Tree(heads_tree.paths, name, length, lookup_max_ngram)
            row = {"nodes": budget, "lookup": length, "expected_tau": expected}
            tau = expected
            if replays is not None:
                row["replayed_tau"] = tau = replayed_tau(tree, replays)
            cost = interpolate_cost(cost_curve, tree.num_nodes) + level_cost * tree.head_depth
            row.update(relative_cost=cost, predicted_speedup=tau / cost)
            table.append(row)
            if best is None or row["predicted_speedup"] > best[1]["predicted_speedup"]:
                best = (tree, row)
    return best[0], table


def build_tree(model, sequences: list[tuple[list[int], int]], top_k: int, max_nodes: int, lookup_lengths,
               lookup_max_ngram: int, name: str, profile=None) -> tuple[Tree, dict, str]:
    """``medusa build-tree``: replay greedy decoding on ``sequences`` (token ids, response start; a validation
    split, never the benchmark's held-out prompts) to measure the heads' per-rank accuracy and the lookup chain's
    correct prefixes, read the verify cost on ``model``'s engine and the heads' drafting cost from this machine's
    profile (:mod:`medusa.profile`; ``None``: loaded, measured if none is stored), and choose the tree with the best
    predicted speedup (:func:`choose_tree`).

    Returns:
        ``(tree, report, note)``: the report (accuracy, cost curve, level cost, the table of candidates, the chosen
        row under ``"chosen"``, dtype, engine and profile) and the note the tree file carries.
    """
    from medusa.tools.measure import ensure_engine, ensure_profile, heads_level_s, stderr_progress

    lookup_lengths = tuple(sorted(set(lookup_lengths)))
    states = sequence_states(model.base, sequences, model.heads.base_layers)
    replays = replay_data(model.heads, states, top_k, max(lookup_lengths), lookup_max_ngram)
    accuracy = rank_accuracy_from_replays(replays, top_k)
    engine = model.engine.profile_name
    profile = profile if profile is not None else ensure_profile(model.base, announce=stderr_progress)
    profile = ensure_engine(profile, model.base, model.engine, stderr_progress)
    curve = profile.cost_curve(engine)
    per_depth = heads_level_s(profile, model.heads)
    cost = sum(per_depth) / len(per_depth) / curve["one_token_s"]
    tree, table = choose_tree(accuracy, curve, max_nodes, cost, name=name, replays=replays,
                              lookup_lengths=lookup_lengths, lookup_max_ngram=lookup_max_ngram)
    best = next(r for r in table if r["nodes"] == len(tree.paths) and r["lookup"] == tree.lookup_length)
    lookup = f" and a {tree.lookup_length}-token prompt-lookup chain" if tree.lookup_length else ""
    note = (f"{len(tree.paths)} heads' nodes{lookup}, from measured per-rank head accuracy and greedy decoding "
            f"replayed on {len(sequences)} validation sequences, and the verify cost of the {engine} engine from the "
            f"machine profile of {profile.key['cpu']} ({profile.key['torch_threads']} threads, "
            f"{profile.key['dtype']}); "
            f"replayed tau {best['replayed_tau']:.2f}, predicted speedup {best['predicted_speedup']:.2f}x over plain "
            "decoding")
    report = {"accuracy": accuracy.tolist(), "cost_curve": {str(k): v for k, v in curve.items()},
              "level_cost": cost, "table": table, "chosen_nodes": len(tree.paths),
              "chosen_lookup": tree.lookup_length, "lookup_max_ngram": lookup_max_ngram,
              "dtype": str(model.base.dtype), "engine": model.engine.settings(), "chosen": best,
              "profile": {"path": str(profile.path), "key": profile.key}}
    return tree, report, note


def calibrate_heads(base, heads, heads_dir, sequences: list[tuple[list[int], int]], top_k: int = 8,
                    lookup_length: int = 16, lookup_max_ngram: int = 3, source: dict | None = None,
                    out: str | Path | None = None) -> tuple[Calibration, Path]:
    """``medusa calibrate`` (and the end of ``train``): measure the heads of ``heads_dir`` on ``sequences`` (the
    base's own continuations of a validation split, never the frozen held-out prompt sets) and write their
    ``calibration.json`` (:func:`medusa.drafters.calibration.measure_calibration`), which turns on the per-step tree
    (:mod:`medusa.drafters.per_step`).

    Args:
        base: the base causal LM the heads were trained on.
        heads: the heads loaded from ``heads_dir``.
        sequences: ``(token_ids, response_start)`` pairs.
        out: where to write (default: ``heads_dir/calibration.json``).

    Returns:
        ``(calibration, path written)``.

    Raises:
        ValueError: no sequence is long enough to measure the heads.
    """
    from medusa.drafters.calibration import (
        CALIBRATION_FILE_NAME,
        heads_identity,
        measure_calibration,
        save_calibration,
    )
    from medusa.io.checkpoint import HEADS_WEIGHTS_NAME

    heads_dir = Path(heads_dir)
    identity = heads_identity(heads, heads_dir / HEADS_WEIGHTS_NAME)
    states = sequence_states(base, sequences, heads.base_layers)
    calibration = measure_calibration(heads, states, top_k, lookup_length, lookup_max_ngram, identity, source)
    return calibration, save_calibration(calibration, out or heads_dir / CALIBRATION_FILE_NAME)


def calibrate_folder(base_dir: str | Path, heads_dir: str | Path, data: str | Path, limit: int | None = None,
                     top_k: int = 8, lookup_length: int = 16, lookup_ngram: int = 3, out: str | Path | None = None,
                     device: str | None = None) -> tuple[Calibration, Path, int]:
    """``medusa calibrate``: :func:`calibrate_heads` of the heads folder ``heads_dir`` on the first ``limit``
    self-distilled records of ``data``, the base and heads loaded in float32 on ``device`` (default: cuda when
    available). The flags are checked before anything loads.

    Returns:
        ``(calibration, path written, sequences measured)``.

    Raises:
        ValueError: ``top_k`` below 1 or beyond the heads' vocabulary, ``lookup_length`` below 0, ``lookup_ngram``
            below 1 (each named), or as :func:`calibrate_heads`.
    """
    from medusa.base import load_base
    from medusa.io.checkpoint import check_heads_folder, load_heads_for_base
    from medusa.tools.bench import read_distilled_sequences

    if top_k < 1 or lookup_length < 0 or lookup_ngram < 1:
        raise ValueError(f"--top-k must be >= 1, --lookup-length >= 0 and --lookup-ngram >= 1, got {top_k}, "
                         f"{lookup_length} and {lookup_ngram}")
    config = check_heads_folder(heads_dir)
    if top_k > (config.head_vocab_size or config.vocab_size):
        raise ValueError(f"--top-k {top_k} is more than the heads' vocabulary of "
                         f"{config.head_vocab_size or config.vocab_size} tokens")
    sequences = read_distilled_sequences(data, limit)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    base, _ = load_base(base_dir, torch.float32, device)
    heads = load_heads_for_base(heads_dir, base).to(device)
    calibration, path = calibrate_heads(base, heads, heads_dir, sequences, top_k, lookup_length, lookup_ngram,
                                        {"data": str(data), "limit": limit}, out)
    return calibration, path, len(sequences)


def eval_heads(model, data: str | Path, limit: int | None = None) -> dict:
    """``medusa eval-heads``: each head's top-1 and top-5 accuracy (:func:`rank_accuracy`) on the first ``limit``
    self-distilled records of ``data``, for the heads of ``model`` (a :class:`medusa.model.MedusaModel`).

    Returns:
        ``{"data", "sequences", "top1": [K floats], "top5": [K floats]}``.
    """
    from medusa.tools.bench import read_distilled_sequences

    sequences = read_distilled_sequences(data, limit)
    accuracy = rank_accuracy(model.base, model.heads, sequences, top_k=5)  # (K, 5)
    return {"data": data, "sequences": len(sequences), "top1": accuracy[:, 0].tolist(),
            "top5": accuracy.sum(dim=1).tolist()}


def build_tree_files(model, data: str | Path, limit: int | None, top_k: int, max_nodes: int, lookup_lengths,
                     lookup_max_ngram: int, out: str | Path, name: str | None = None) -> tuple[Tree, dict, Path]:
    """``medusa build-tree``: :func:`build_tree` on the first ``limit`` self-distilled records of ``data``, the tree
    written to ``out`` (named ``name``, default the file's stem) and its report beside it, ``<out>.report.json``.

    Returns:
        ``(tree, report, report path)``.
    """
    import json

    from medusa.decode.tree import save_tree
    from medusa.tools.bench import read_distilled_sequences

    sequences = read_distilled_sequences(data, limit)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tree, report, note = build_tree(model, sequences, top_k, max_nodes, lookup_lengths, lookup_max_ngram,
                                    name or Path(out).stem)
    save_tree(tree, out, note=note)
    report_path = Path(out).with_suffix(".report.json")
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return tree, report, report_path
