"""Record decoding outputs that a refactor must leave bit-identical, or compare them with an earlier record.

Tiny random models of five architectures (built in-process, no downloads), random Medusa and Hydra heads, a wide tree
with a prompt-lookup chain: greedy tokens on every engine, seeded rejection-sampling and typical-acceptance tokens,
batched greedy tokens, and each run's accepted drafts per step. With ``--real``, the same on the prepared
SmolLM2-135M-Instruct with the shipped heads and their tree (held-out prompts, greedy; seeded sampling on a few).

Only the public API is used (``MedusaModel``, ``Tree``, the heads classes), through import paths that must keep
working, so the same script runs on the code before and after a change:

    PYTHONPATH=/path/to/old/checkout:tests python scripts/golden_outputs.py --out old.json [--real]
    PYTHONPATH=.:tests python scripts/golden_outputs.py --out new.json [--real] --compare old.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "gpt2", "mistral", "gemma3")
ENGINES = ("eager", "static", "onednn")
WIDE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]]


def random_heads(model, head_type: str, seed: int = 1):
    from medusa.drafters.heads import MedusaHeadsConfig, build_heads

    weight = model.get_output_embeddings().weight
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=3,
                               head_type=head_type)
    heads = build_heads(config, weight.detach(), model.get_input_embeddings().weight.detach())
    torch.manual_seed(seed)
    for p in heads.parameters():
        p.data.normal_(0, 0.05)
    return heads


def run(medusa, ids, **kw) -> dict:
    out, stats = medusa.generate(ids, **kw)
    return {"tokens": out, "accepted": stats.accepted_per_step}


def tiny_cases(with_batch: bool = True) -> dict:
    from tiny import tiny_model

    from medusa.decode.tree import Tree
    from medusa.model import MedusaModel

    results = {}
    tree = Tree.from_paths(WIDE, name="wide").with_lookup(3)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=gen) for n in (20, 9, 31)]
    prompts[1] = torch.cat([prompts[1], prompts[1], prompts[1][:4]])  # repeats: the lookup chain gets accepted
    for arch in ARCHS:
        model = tiny_model(arch)
        model.generation_config.eos_token_id = None
        for head_type in ("medusa", "hydra"):
            heads = random_heads(model, head_type)
            for engine in ENGINES:
                medusa = MedusaModel(model, heads, tree, engine=engine)
                key = f"{arch}/{head_type}/{engine}"
                for i, ids in enumerate(prompts):
                    results[f"{key}/greedy/{i}"] = run(medusa, ids, max_new_tokens=40, stop_token_ids=set())
                if engine != "static":
                    continue
                for acceptance in ("rejection", "typical"):
                    for i, ids in enumerate(prompts[:2]):
                        results[f"{key}/{acceptance}/{i}"] = run(
                            medusa, ids, max_new_tokens=30, stop_token_ids=set(), do_sample=True, temperature=0.9,
                            top_p=0.95, seed=7 + i, acceptance=acceptance)
                if with_batch:
                    batch, _ = medusa.generate_batch(prompts, max_new_tokens=24, stop_token_ids=set())
                    results[f"{key}/batch"] = {"tokens": batch}
    return results


def real_cases(base: str, heads: str, prompts_file: str, limit: int, max_new_tokens: int) -> dict:
    from medusa.model import MedusaModel
    from medusa.tools.bench import encode_prompt

    medusa = MedusaModel.from_pretrained(base, heads)
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line.strip()][:limit]
    results, steps, tokens = {}, 0, 0
    for i, row in enumerate(rows):
        ids = encode_prompt(medusa.tokenizer, row)
        out, stats = medusa.generate(ids, max_new_tokens=max_new_tokens)
        results[f"real/greedy/{i}"] = {"tokens": out, "accepted": stats.accepted_per_step}
        steps, tokens = steps + stats.decode_steps, tokens + stats.decode_tokens
        if i < 3:
            results[f"real/rejection/{i}"] = run(medusa, ids, max_new_tokens=48, do_sample=True, temperature=0.8,
                                                 seed=i, acceptance="rejection")
            results[f"real/typical/{i}"] = run(medusa, ids, max_new_tokens=48, do_sample=True, temperature=0.8,
                                               seed=i, acceptance="typical")
    results["real/tau"] = tokens / steps
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="an earlier record: exit 1 naming every case that differs")
    parser.add_argument("--real", action="store_true", help="also the prepared SmolLM2-135M-Instruct")
    parser.add_argument("--base", default="models/smollm2-135m-instruct")
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-hydra")
    parser.add_argument("--prompts", default="benchmarks/prompts/sharegpt-held-out.jsonl")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-batch", action="store_true", help="leave out batched decoding")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    results = tiny_cases(not args.no_batch)
    if args.real:
        results |= real_cases(args.base, args.heads, args.prompts, args.limit, args.max_new_tokens)
    Path(args.out).write_text(json.dumps(results, sort_keys=True) + "\n")
    print(f"{len(results)} cases in {time.perf_counter() - start:.0f} s -> {args.out}")
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())
    if args.no_batch or not args.real:
        before = {k: v for k, v in before.items() if (not args.no_batch or not k.endswith("/batch"))
                  and (args.real or not k.startswith("real/"))}
    differ = sorted(k for k in before.keys() | results.keys() if before.get(k) != results.get(k))
    for key in differ:
        print(f"DIFFERS {key}: before {str(before.get(key))[:120]} / now {str(results.get(key))[:120]}")
    print(f"{len(before) - len(differ)} of {len(before)} cases identical" if not differ else f"{len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
