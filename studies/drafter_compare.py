"""Compare drafters (Medusa heads, Hydra heads, the eagle drafter) on the same base, in one process.

For each drafter folder: held-out top-1 by depth (the drafted token at depth d is right given the true tokens before
it, defined identically for every drafter: ``medusa.tools.calibrate.rank_accuracy_from_states``) and the expected
chain tau it implies; then greedy decoding of both frozen held-out prompt sets with the per-step tree, with and
without the prompt-lookup chain: tau, tokens/s, the drafter's cost per step (draft + choose, ms) and whether its
tokens are Hugging Face ``generate``'s. HF ``generate`` and our plain decoding are timed on the same prompts in the
same process (``--no-timing`` skips HF: tau needs no idle machine, speed does). ``--stride`` keeps every n-th prompt
of a set (the MT-bench-style set is 8 categories of 10 in order: a stride of 4 keeps 20 prompts of every category).

    python studies/drafter_compare.py --base models/smollm2-135m-instruct \
        --drafter eagle=outputs/smollm2-135m-eagle/heads --drafter hydra=outputs/hydra-768/heads \
        --held-out data/distill-all/distilled_held_out.jsonl --out docs/results/drafter-compare.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa.base import load_base  # noqa: E402
from medusa.decode.tree import Tree  # noqa: E402
from medusa.io.checkpoint import load_heads_for_base  # noqa: E402
from medusa.model import MedusaModel  # noqa: E402
from medusa.tools.bench import encode_prompt, hf_greedy, read_distilled_sequences, read_prompts  # noqa: E402
from medusa.tools.calibrate import rank_accuracy_from_states, sequence_states  # noqa: E402

SETS = ("benchmarks/prompts/sharegpt-held-out.jsonl", "benchmarks/prompts/mt-bench-style.jsonl")


def top1_by_depth(base, heads, sequences) -> list[float]:
    """Held-out top-1 accuracy of each depth, given the true tokens before it."""
    states = sequence_states(base, sequences, heads.base_layers)
    return [round(float(a), 4) for a in rank_accuracy_from_states(heads, states, top_k=1)[:, 0]]


def chain_tau(top1: list[float]) -> float:
    """1 + the sum of the running products of top-1 by depth: the tau of a top-1 chain if depths were independent
    given the path."""
    total, run = 1.0, 1.0
    for a in top1:
        run *= a
        total += run
    return round(total, 3)


def decode_set(model: MedusaModel, prompts: list[torch.Tensor], max_new_tokens: int, tree=None) -> tuple[dict, list]:
    """Greedy-decode ``prompts`` (``tree``: that tree instead of the model's drafter); tau over the set, tokens/s,
    the drafter's ms per step and the tokens."""
    steps = tokens_out = new = copied = 0
    draft_s = seconds = 0.0
    outputs = []
    for ids in prompts:
        start = time.perf_counter()
        tokens, stats = model.generate(ids, max_new_tokens, tree=tree)
        seconds += time.perf_counter() - start
        outputs.append(tokens)
        new += len(tokens)
        steps += stats.decode_steps
        tokens_out += stats.decode_tokens
        copied += stats.copied_tokens
        draft_s += stats.step_s["draft"] + stats.step_s["choose"]
    return {"tau": round(tokens_out / max(steps, 1), 3),
            "tau_without_lookup_tokens": round((tokens_out - copied) / max(steps, 1), 3),
            "steps": steps, "new_tokens": new,
            "tokens_per_s": round(new / seconds, 2), "drafter_ms_per_step": round(1000 * draft_s / max(steps, 1), 2),
            "seconds": round(seconds, 1)}, outputs


def hf_set(base, prompts: list[torch.Tensor], max_new_tokens: int, stop: set[int]) -> tuple[dict, list]:
    """HF ``generate`` greedy over ``prompts``: tokens/s and the tokens."""
    outputs, seconds = [], 0.0
    for ids in prompts:
        start = time.perf_counter()
        outputs.append(hf_greedy(base, ids, max_new_tokens, stop))
        seconds += time.perf_counter() - start
    new = sum(len(o) for o in outputs)
    return {"new_tokens": new, "tokens_per_s": round(new / seconds, 2), "seconds": round(seconds, 1)}, outputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--drafter", action="append", required=True, metavar="NAME=HEADS_DIR")
    p.add_argument("--sets", nargs="+", default=list(SETS))
    p.add_argument("--held-out", help="self-distilled held-out answers for top-1 by depth")
    p.add_argument("--held-out-limit", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each set (after --stride)")
    p.add_argument("--stride", type=int, nargs="+", default=[1], help="keep every n-th prompt (one per set)")
    p.add_argument("--no-timing", action="store_true", help="skip HF generate and plain decoding")
    p.add_argument("--top1-only", action="store_true", help="only the held-out top-1 by depth (no decoding)")
    p.add_argument("--no-lookup-only", action="store_true", help="skip the runs with the lookup chain")
    p.add_argument("--engine", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tokenizer = load_base(args.base)
    strides = args.stride * len(args.sets) if len(args.stride) == 1 else args.stride
    sets = {Path(s).stem: [encode_prompt(tokenizer, r) for r in read_prompts(s)[::n][: args.limit]]
            for s, n in zip(args.sets, strides, strict=True)}
    held = read_distilled_sequences(args.held_out, args.held_out_limit) if args.held_out else None
    result, tokens = {}, {}
    if not args.no_timing and not args.top1_only:
        first = load_heads_for_base(args.drafter[0].split("=", 1)[1], base).eval()
        plain = MedusaModel(base, first, tokenizer=tokenizer, engine=args.engine)
        stop = plain.stop_token_ids()
        for set_name, prompts in sets.items():
            plain.generate(prompts[0], 8), hf_greedy(base, prompts[0], 8, stop)  # warm-up, untimed
            run, outs = hf_set(base, prompts, args.max_new_tokens, stop)
            result.setdefault("hf_generate", {})[set_name] = run
            tokens.setdefault(set_name, {})["hf_generate"] = outs
            run, outs = decode_set(plain, prompts, args.max_new_tokens, tree=Tree.chain(0))
            result.setdefault("plain", {})[set_name] = run
            tokens[set_name]["plain"] = outs
            print("hf / plain", set_name, result["hf_generate"][set_name], run, flush=True)
    for spec in args.drafter:
        name, folder = spec.split("=", 1)
        heads = load_heads_for_base(folder, base).eval()
        entry = {"folder": folder, "head_type": heads.config.head_type, "depth": heads.config.num_heads}
        if held:
            entry["top1_by_depth"] = top1_by_depth(base, heads, held)
            entry["chain_tau"] = chain_tau(entry["top1_by_depth"])
        if args.top1_only:
            result[name] = entry
            print(name, entry, flush=True)
            continue
        model = MedusaModel(base, heads, tokenizer=tokenizer, engine=args.engine)
        for lookup in ([0] if args.no_lookup_only else [None, 0]):
            model.use_per_step_tree(folder, **({} if lookup is None else {"lookup_length": lookup}))
            key = "with_lookup" if lookup is None else "no_lookup"
            for set_name, prompts in sets.items():
                model.generate(prompts[0], 8)  # warm-up, untimed
                run, outs = decode_set(model, prompts, args.max_new_tokens)
                if "hf_generate" in result:
                    run["vs_hf"] = round(run["tokens_per_s"] / result["hf_generate"][set_name]["tokens_per_s"], 3)
                    run["vs_plain"] = round(run["tokens_per_s"] / result["plain"][set_name]["tokens_per_s"], 3)
                entry[f"{set_name}/{key}"] = run
                tokens.setdefault(set_name, {})[f"{name}/{key}"] = outs
                print(name, key, set_name, run, flush=True)
        result[name] = entry
    for set_name, runs in tokens.items():
        first = next(iter(runs.values()))
        result.setdefault("_identical", {})[set_name] = {
            "reference": next(iter(runs)), "prompts": len(first),
            **{k: sum(a == b for a, b in zip(v, first, strict=True)) for k, v in runs.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if "top1" in kk or "chain" in kk} for k, v in result.items()
                      if not k.startswith("_")}, indent=1))
    print("identical outputs per set (vs the first run):", json.dumps(result.get("_identical")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
