"""Medusa-1 vs Medusa-2 at equal steps: held-out per-head accuracy, expected tau and the base's drift.

Each run folder is a ``medusa train`` output (``heads/``, and ``adapter/`` for Medusa-2); ``--init-heads`` adds the
heads both runs started from as a reference row. Every row is scored on the same held-out self-distilled answers
(the original base's greedy text), with the base each set of heads decodes with: the original for Medusa-1, the
merged adapted base for Medusa-2. Reported: per-head top-1/top-5 (for Hydra heads conditional on the true tokens
before the target), the expected tau of the greedy-grown tree at several node budgets (as ``studies/head_ablation.py``
and ``medusa build-tree``), and the drift of the decoding base from the original (:mod:`medusa.tools.drift`; none for
the original itself).

    python studies/medusa2_compare.py --base models/smollm2-135m-instruct \\
        --held-out data/distill/distilled_held_out.jsonl --limit 48 \\
        --init-heads checkpoints/smollm2-135m-instruct-hydra \\
        --runs outputs/medusa2-compare/medusa1 outputs/medusa2-compare/medusa2 \\
        --out docs/results/medusa2-vs-medusa1.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from medusa.decode.tree import expected_acceptance, grow_tree
from medusa.io.adapter import merge_adapter
from medusa.io.checkpoint import load_heads
from medusa.model import load_base
from medusa.tools.calibrate import rank_accuracy
from medusa.tools.drift import drift

logger = logging.getLogger("medusa2_compare")
BUDGETS = (4, 8, 16, 32)


def held_out_sequences(path: Path, limit: int | None) -> list[tuple[list[int], int]]:
    records = [json.loads(line) for line in path.read_text().splitlines()[:limit]]
    return [(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in records]


def score(name: str, model, heads_dir: Path, original, sequences, top_k: int) -> dict:
    heads = load_heads(heads_dir, model.get_output_embeddings().weight,
                       embed_weight=model.get_input_embeddings().weight)
    accuracy = rank_accuracy(model, heads, sequences, top_k)  # (K, top_k)
    taus = {n: expected_acceptance(grow_tree(accuracy, n), accuracy) for n in BUDGETS}
    row = {"name": name, "heads": str(heads_dir), "top1": [round(a, 4) for a in accuracy[:, 0].tolist()],
           "top5": [round(a, 4) for a in accuracy[:, :5].sum(1).tolist()],
           "expected_tau": {str(n): round(t, 4) for n, t in taus.items()},
           "drift": None if model is original else drift(original, model, sequences)}
    training = json.loads((heads_dir / "config.json").read_text()).get("training", {})
    row["steps"] = training.get("steps")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--held-out", required=True, type=Path)
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--init-heads", type=Path, help="the heads the runs started from (a reference row)")
    parser.add_argument("--runs", nargs="+", type=Path, required=True,
                        help="run output folders or checkpoints (heads/, and adapter/ for Medusa-2); named by folder")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_grad_enabled(False)
    sequences = held_out_sequences(args.held_out, args.limit)
    original, _ = load_base(args.base)
    rows = []
    if args.init_heads:
        rows.append(score("start (init heads)", original, args.init_heads, original, sequences, args.top_k))
    for run in args.runs:
        started = time.perf_counter()
        model = original
        if (run / "adapter").is_dir():
            model = merge_adapter(load_base(args.base)[0], run / "adapter").eval()
        rows.append(score(run.name, model, run / "heads", original, sequences, args.top_k))
        logger.info("%s scored in %.0f s: %s", run, time.perf_counter() - started, rows[-1])
    result = {"base": args.base, "held_out": str(args.held_out), "sequences": len(sequences), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
