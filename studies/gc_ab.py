"""Python's cyclic garbage collector during decoding through the native int4 decoder: left as it is, frozen after
the models load (``gc.freeze()``: the objects of the loaded models are never traversed again), or switched off
around each ``generate`` call; plain and Medusa decoding under each, every prompt through the six decoders back to
back (order reversed on every other prompt), one process.

Each decoder is its own model (the per-step tree learns from its own steps). Greedy, ``--max-new-tokens`` new
tokens, tokens/s over the ``generate`` calls (the collector's setting switched outside the timing).

    python studies/gc_ab.py --limit 16

Figures: docs/quantized.md ("Fourth pass").
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

MODES = ("as-is", "frozen", "off")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/prompts/mt-bench-style.jsonl"))
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from peer_bench import native_model
    from transformers import AutoTokenizer

    from medusa.tools.bench import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    prompts = [encode_prompt(tokenizer, r) for r in read_prompts(args.prompts)][: args.limit + 1]
    models = {}
    for mode in MODES:
        models["plain", mode] = native_model(args.base, None, "native-q8", args.threads)
        models["medusa", mode] = native_model(args.base, args.heads, "native-q8", args.threads)
    gc.collect()
    frozen_objects = len(gc.get_objects())
    totals = {key: [0, 0.0] for key in models}
    with torch.inference_mode():
        for model in models.values():
            model.generate(prompts[0], args.max_new_tokens)  # warm-up
        for i, ids in enumerate(prompts[1:]):
            for key in list(models) if i % 2 == 0 else list(reversed(models)):
                mode = key[1]
                gc.enable()
                gc.unfreeze()
                if mode == "frozen":
                    gc.freeze()
                elif mode == "off":
                    gc.disable()
                start = time.perf_counter()
                out, _ = models[key].generate(ids, args.max_new_tokens)
                totals[key][1] += time.perf_counter() - start
                totals[key][0] += len(out)
    gc.enable()
    gc.unfreeze()
    speed = {key: tokens / seconds for key, (tokens, seconds) in totals.items()}
    print(f"{frozen_objects} objects tracked after the loads; {args.limit} prompts")
    print("| collector | plain tok/s | Medusa tok/s | Medusa / plain | plain vs as-is | Medusa vs as-is |")
    print("|---|---|---|---|---|---|")
    for mode in MODES:
        plain, medusa = speed["plain", mode], speed["medusa", mode]
        print(f"| {mode} | {plain:.1f} | {medusa:.1f} | {medusa / plain:.3f} | "
              f"{plain / speed['plain', 'as-is']:.3f} | {medusa / speed['medusa', 'as-is']:.3f} |")


if __name__ == "__main__":
    main()
