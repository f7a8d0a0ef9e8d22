"""A/B of trees in one process: plain decoding, fixed trees and per-step tree settings, prompt by prompt.

Each prompt is decoded by every method back to back, in an order that rotates from prompt to prompt, through one
engine; every method's tokens must equal plain greedy decoding's. Prints tokens/s, tau, mean tree size, the share of
plain steps and the step's parts (ms) per method and prompt file, and writes them as JSON with ``--out``.

Use it to choose settings on the validation split (``--prompts data/validation/distilled_validation.jsonl``: its
records' ``prompt_ids`` are decoded), never on the frozen held-out sets, whose figures come from ``medusa bench``::

    python studies/per_step_ab.py --base models/smollm2-135m-instruct \\
        --heads checkpoints/smollm2-135m-instruct-hydra --prompts data/validation/distilled_validation.jsonl \\
        --limit 12 --fixed-tree configs/trees/smollm2-135m-hydra-validation-refit-cpu.json \\
        --variant '{}' --variant '{"max_parents": 8, "top_k": 8}' --out docs/results/per-step-ab-validation.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa.decode.loop import GenerationStats, decode_steps  # noqa: E402
from medusa.decode.tree import load_tree  # noqa: E402
from medusa.drafters.calibration import CALIBRATION_FILE_NAME, load_calibration  # noqa: E402
from medusa.drafters.composite import NoDrafter, tree_drafter  # noqa: E402
from medusa.drafters.per_step import PerStepDrafter, StepCost  # noqa: E402
from medusa.model import MedusaModel  # noqa: E402
from medusa.tools.bench import encode_prompt, read_prompts  # noqa: E402
from medusa.tools.measure import ensure_engine, load_profile, stderr_progress  # noqa: E402


def prompt_ids(path: str, tokenizer, limit: int) -> list[torch.Tensor]:
    """Prompts of a bench prompt file, or the ``prompt_ids`` of a self-distilled file."""
    first = json.loads(Path(path).read_text().splitlines()[0])
    if "prompt_ids" in first:
        records = [json.loads(line) for line in Path(path).read_text().splitlines()[:limit]]
        return [torch.tensor(r["prompt_ids"]) for r in records]
    return [encode_prompt(tokenizer, p) for p in read_prompts(path)[:limit]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--heads", required=True)
    p.add_argument("--prompts", nargs="+", required=True, help="bench prompt files or self-distilled JSON lines")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--engine", default="onednn")
    p.add_argument("--fixed-tree", nargs="*", default=[], help="fixed tree files timed beside the per-step tree")
    p.add_argument("--variant", action="append", default=[],
                   help="PerStepDrafter options as JSON ({} the defaults); 'buckets': null grows without settling")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = MedusaModel.from_pretrained(args.base, args.heads, engine=args.engine, per_step=False)
    calibration = load_calibration(Path(args.heads) / CALIBRATION_FILE_NAME)
    profile = ensure_engine(load_profile(model.base, progress=stderr_progress), model.base, args.engine,
                            stderr_progress)
    methods = [("plain", NoDrafter())] + [(Path(f).stem, tree_drafter(model.heads, load_tree(f)))
                                          for f in args.fixed_tree]
    for text in args.variant or ["{}"]:
        options = json.loads(text)
        cost = StepCost.from_profile(profile, args.engine, model.heads, options.pop("buckets", "measured"))
        methods.append((f"per-step {text}", PerStepDrafter(model.heads, calibration, cost, **options)))
    stop, results = model.stop_token_ids(), {}
    for path in args.prompts:
        totals = {name: {"tokens": 0, "seconds": 0.0, "steps": 0, "decoded": 0, "nodes": [], "parts": {}}
                  for name, _ in methods}
        for i, ids in enumerate(prompt_ids(path, model.tokenizer, args.limit)):
            outputs = {}
            for name, drafter in methods[i % len(methods):] + methods[: i % len(methods)]:
                stats, tokens, start = GenerationStats(), [], time.perf_counter()
                for step in decode_steps(model.base, drafter, ids, args.max_new_tokens, stop, stats,
                                         engine=model.engine):
                    tokens += step.tokens
                total = totals[name]
                total["seconds"] += time.perf_counter() - start
                total["tokens"] += len(tokens)
                total["steps"] += stats.decode_steps
                total["decoded"] += stats.decode_tokens
                total["nodes"] += stats.tree_nodes
                for part, seconds in stats.step_s.items():
                    total["parts"][part] = total["parts"].get(part, 0.0) + seconds
                outputs[name] = tokens
            if any(out != outputs["plain"] for out in outputs.values()):
                raise AssertionError(f"{path} prompt {i}: a method's tokens differ from plain greedy decoding's")
            print(f"{Path(path).name} prompt {i} done", file=sys.stderr)
        results[path] = {}
        for name, total in totals.items():
            steps, nodes = max(total["steps"], 1), total["nodes"] or [1]
            row = {"tokens_per_s": total["tokens"] / total["seconds"], "tau": total["decoded"] / steps,
                   "mean_nodes": sum(nodes) / len(nodes), "plain_steps": nodes.count(1) / len(nodes),
                   "step_ms": {k: 1e3 * v / steps for k, v in total["parts"].items()}}
            results[path][name] = row
            parts = " ".join(f"{k} {v:.1f}" for k, v in row["step_ms"].items())
            print(f"{Path(path).name}  {name:45s} {row['tokens_per_s']:6.2f} tok/s  tau {row['tau']:.2f}  "
                  f"nodes {row['mean_nodes']:4.1f}  plain {100 * row['plain_steps']:3.0f}%  ms: {parts}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
