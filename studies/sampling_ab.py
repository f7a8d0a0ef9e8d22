"""Sampling decoders side by side, interleaved prompt by prompt: plain sampling and Medusa sampling under each
acceptance rule (``rejection``: recursive rejection sampling over candidates drawn from q; ``coupled``: the base's
Gumbel-max draws, top-k candidates; ``typical``: lossy), one seed per prompt, the same for every decoder.

Plain decoding is the same model on the top-1 chain of no heads (``Tree.chain(0)``), so plain and Medusa share the
engine, the base and the logits processors. Reported per decoder: tokens/s and the ratio to plain sampling under
the same rule, tau, tau less the lookup chain's copied tokens, the mean tree size, and on how many prompts its tokens
equal plain sampling's under the same rule and seed (``coupled`` promises all; ``rejection`` draws differently once
a tree is drafted, so its outputs differ while being distributed alike).

    MEDUSA_CACHE_DIR=/tmp/prof python studies/sampling_ab.py --threads 2 --limit 16 \\
        --heads checkpoints/smollm2-135m-instruct-hydra --rules rejection coupled \\
        --temperature 0.7 --top-p 0.9 --out docs/results/sampling-ab.json

Figures: docs/sampling.md.
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
sys.path.insert(0, str(REPO / "studies"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/prompts/mt-bench-style.jsonl"))
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts")
    parser.add_argument("--stride", type=int, default=1, help="keep every n-th prompt")
    parser.add_argument("--rules", nargs="+", default=["rejection", "coupled"])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="JSON of the totals per decoder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from heads_ab import new_totals, tally
    from transformers import AutoTokenizer

    from medusa.build import DecodeConfig, build_model
    from medusa.decode.tree import Tree
    from medusa.tools.bench import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    prompts = [encode_prompt(tokenizer, r) for r in read_prompts(args.prompts)[:: args.stride][: args.limit]]
    medusa = build_model(DecodeConfig(base=args.base, heads=args.heads, engine=args.engine, threads=args.threads))
    settings = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    decoders = [(f"{kind}-{rule}", kind, rule) for rule in args.rules for kind in ("plain", "medusa")]

    def run(kind: str, rule: str, ids: torch.Tensor, seed: int):
        start = time.perf_counter()
        with torch.inference_mode():
            out, stats = medusa.generate(ids, args.max_new_tokens, tree=Tree.chain(0) if kind == "plain" else None,
                                         seed=seed, acceptance=rule, **settings)
        return out, time.perf_counter() - start, stats

    for _, kind, rule in decoders:
        run(kind, rule, prompts[0], 0)  # warm-up, untimed
    totals = {name: new_totals() for name, _, _ in decoders}
    for i, ids in enumerate(prompts):
        outs = {}
        shift = i % len(decoders)
        for name, kind, rule in decoders[shift:] + decoders[:shift]:
            out, seconds, stats = run(kind, rule, ids, seed=i)
            outs[name] = out
            tally(totals[name], stats, seconds)
        for name, _, rule in decoders:
            totals[name]["identical"] += outs[name] == outs[f"plain-{rule}"]
    print(f"\n# {medusa.engine.name}, {len(prompts)} prompts of {Path(args.prompts).stem}, {args.threads} threads, "
          f"temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}\n")
    print("| decoder | tok/s | vs plain, same rule | tau | tau less copied | mean tree nodes | = plain, same rule |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for name, _, rule in decoders:
        t = totals[name]
        rate = t["tokens"] / t["seconds"]
        plain = totals[f"plain-{rule}"]
        steps = max(t["steps"], 1)
        rows[name] = {"tokens_per_s": round(rate, 2),
                      "vs_plain": round(rate / (plain["tokens"] / plain["seconds"]), 3),
                      "tau": round(t["decoded"] / steps, 3),
                      "tau_less_copied": round((t["decoded"] - t["copied"]) / steps, 3),
                      "mean_tree_nodes": round(sum(t["nodes"]) / max(len(t["nodes"]), 1), 2),
                      "identical_to_plain": f"{t['identical']}/{len(prompts)}", "new_tokens": t["tokens"]}
        r = rows[name]
        print(f"| {name} | {r['tokens_per_s']:.2f} | {r['vs_plain']:.3f} | {r['tau']:.3f} | "
              f"{r['tau_less_copied']:.3f} | {r['mean_tree_nodes']:.2f} | {r['identical_to_plain']} |", flush=True)
    if args.out:
        result = {"engine": medusa.engine.name, "threads": args.threads, "heads": args.heads, "prompts": args.prompts,
                  "n_prompts": len(prompts), "settings": settings, "max_new_tokens": args.max_new_tokens,
                  "decoders": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
