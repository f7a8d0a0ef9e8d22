"""What a verified row costs inside decoding through the native int4 decoder, and whether the per-step tree's sizes
follow from the profile it reads.

Plain decoding and Medusa decoding (the shipped Hydra heads, the per-step tree) through ``--quantize int4
--int4-kernel native-q8`` (or ``--kernel``), interleaved prompt by prompt, greedy, 128 new tokens. Reported:

- each decoder's tokens/s (prefill included), ratio to plain, tau and mean tree nodes;
- the C forward's own seconds by its number of new tokens (``medusa_q4_forward``, timed around the call inside real
  steps: caches as decoding leaves them, not a loop of one shape), and the fused Hydra level call's;
- with ``--profiles A B``: Medusa built twice, its per-step tree reading the profile folder A (then B)
  (``MEDUSA_CACHE_DIR``), both against one plain decoder: how much the tree's sizes, and the speed, follow a
  profile's measured forward costs.

    python studies/int4_rows_in_decode.py --limit 24
    python studies/int4_rows_in_decode.py --stride 2 --rounds 2 --profiles /tmp/profA ~/.cache/medusa

Figures: docs/quantized.md ("What a verified row costs").
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "studies"))
sys.path.insert(0, str(REPO / "scripts"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/prompts/mt-bench-style.jsonl"))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kernel", default="native-q8", choices=["native", "native-q8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profiles", nargs=2, metavar=("A", "B"), help="two profile folders, one Medusa each")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import heads_ab
    from transformers import AutoTokenizer

    from medusa.engines import native
    from medusa.tools.bench import encode_prompt, read_prompts

    build_args = types.SimpleNamespace(base=args.base, quantize="int4", int4_kernel=args.kernel, gguf=None,
                                       threads=args.threads, engine="auto")
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    prompts = [encode_prompt(tokenizer, r) for r in read_prompts(args.prompts)[:: args.stride][: args.limit]]
    models = {}
    if args.profiles:
        os.environ["MEDUSA_CACHE_DIR"] = args.profiles[0]
    models["plain"] = heads_ab.build(build_args, None, {})
    models["medusa"] = heads_ab.build(build_args, args.heads, {})
    if args.profiles:
        os.environ["MEDUSA_CACHE_DIR"] = args.profiles[1]
        models["medusa B"] = heads_ab.build(build_args, args.heads, {})

    lib, current = native._library(), [None]
    calls = collections.defaultdict(list)  # (decoder, call, rows) -> seconds

    def timed(name: str, rows_arg: int):
        call = getattr(lib, name)

        def wrapper(*a):
            start = time.perf_counter()
            out = call(*a)
            calls[(current[0], name, a[rows_arg])].append(time.perf_counter() - start)
            return out
        setattr(lib, name, wrapper)

    timed("medusa_q4_forward", 2)  # (model, x, M, ...): M new tokens
    timed("medusa_hydra_level", 1)  # (hidden, P, ...): P nodes
    totals = {name: [0, 0.0, 0, 0] for name in models}  # tokens, seconds, steps, nodes
    names = list(models)
    with torch.inference_mode():
        for model in models.values():
            model.generate(prompts[0], 16)  # warm-up, untimed
        calls.clear()
        for r in range(args.rounds):
            for i, ids in enumerate(prompts):
                shift = (i + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    current[0] = name
                    start = time.perf_counter()
                    out, stats = models[name].generate(ids, 128)
                    t = totals[name]
                    t[0] += len(out)
                    t[1] += time.perf_counter() - start
                    t[2] += stats.decode_steps
                    t[3] += sum(stats.tree_nodes) if stats.tree_nodes else stats.decode_steps
    plain_rate = totals["plain"][0] / totals["plain"][1]
    print(f"# {len(prompts)} prompts x {args.rounds} rounds, int4 {args.kernel}, {args.threads} threads\n")
    print("| decoder | tok/s | vs plain | tau | mean tree nodes |\n|---|---|---|---|---|")
    for name, (tokens, seconds, steps, nodes) in totals.items():
        rate = tokens / seconds
        print(f"| {name} | {rate:.1f} | {rate / plain_rate:.3f} | {tokens / steps:.3f} | {nodes / steps:.2f} |")
    print("\n| decoder | C call | rows | calls | median ms | mean ms |\n|---|---|---|---|---|---|")
    for (name, call, rows), seconds in sorted(calls.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if len(seconds) >= 20:
            seconds = sorted(seconds)
            print(f"| {name} | {call} | {rows} | {len(seconds)} | {1e3 * seconds[len(seconds) // 2]:.3f} | "
                  f"{1e3 * sum(seconds) / len(seconds):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
