"""Head ablations and data scaling from one hidden-state store: the tables in docs/results/heads-*.json.

Every variant trains from the same stored base hidden states (``train/store.py``: the base runs once for all of
them), with the same optimizer, schedule, steps and batches, and is scored on the same held-out self-distilled
answers (the base's own greedy text, the text the heads meet when decoding). Reported per variant: held-out
per-head, per-rank accuracy (for Hydra heads conditional on the true tokens before the target, i.e. the chance a
tree node is accepted when its parent was), the expected tau of the greedy-grown tree at several node budgets, and
the training time.

    python studies/head_ablation.py --base models/smollm2-135m-instruct --store outputs/stores/sharegpt \\
        --held-out data/distill/distilled_held_out.jsonl --variants medusa:hard hydra:teacher --sizes 400 1600 \\
        --steps 300 --out docs/results/heads-ablation.json

A variant is ``head_type:loss[:num_layers[:prefix_window]]`` (a prefix window gives Hydra heads their own attention
layer over the base's hidden states, ``medusa/prefix_layer.py``); ``--sizes`` trains on the first N stored examples.
With ``--data`` the store is built first when missing (resumable): the training split of the first ``--conversations``
conversations of a dataset (``sharegpt``, or self-distilled JSON lines from ``medusa distill``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

from medusa.decode.tree import expected_acceptance, grow_tree
from medusa.drafters.heads import (
    MedusaHeadsConfig,
    build_heads,
    head_lookup_table,
    lm_head_fingerprint,
    most_frequent_tokens,
)
from medusa.io.checkpoint import load_heads, save_heads
from medusa.losses import head_ce_sums, head_soft_sums, head_target_counts
from medusa.tools.calibrate import rank_accuracy_from_states, sequence_states
from train.data import load_conversations, split_held_out, target_token_counts, tokenize_conversations
from train.store import HiddenStateStore, build_store
from train.trainer import crop_window, step_loss, window_starts

logger = logging.getLogger("head_ablation")
BUDGETS = (4, 8, 16, 32)


def parse_variant(text: str) -> dict:
    head_type, loss, *rest = text.split(":")
    return {"name": text, "head_type": head_type, "loss": loss, "num_layers": int(rest[0]) if rest else 1,
            "prefix_window": int(rest[1]) if len(rest) > 1 else 0}


def held_out_sequences(path: Path, limit: int | None) -> list[tuple[list[int], int]]:
    records = [json.loads(line) for line in path.read_text().splitlines()[:limit]]
    return [(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])) for r in records]


def make_heads(model, store: HiddenStateStore, indices: list[int], variant: dict, args):
    lm_head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    counts = target_token_counts([store.example(i) for i in indices], lm_head.shape[0])
    eos = model.generation_config.eos_token_id
    token_map = most_frequent_tokens(counts, args.head_vocab_size, always=eos if isinstance(eos, list) else [eos])
    config = MedusaHeadsConfig(hidden_size=lm_head.shape[1], vocab_size=lm_head.shape[0], num_heads=args.num_heads,
                               num_layers=variant["num_layers"], head_vocab_size=args.head_vocab_size,
                               head_type=variant["head_type"], lm_head_fingerprint=lm_head_fingerprint(lm_head),
                               prefix_layers=int(variant["prefix_window"] > 0),
                               prefix_window=variant["prefix_window"] or 64)
    return build_heads(config, lm_head, embed, token_map)


def train_variant(model, store: HiddenStateStore, indices: list[int], variant: dict, args):
    """The trainer's step (``train.trainer.mixed_step_loss``, one process, no accumulation) on stored states."""
    torch.manual_seed(args.seed)
    heads = make_heads(model, store, indices, variant, args)
    lookup = head_lookup_table(heads.token_map, heads.config.vocab_size)
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=args.lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    hard_weight = {"hard": 1.0, "teacher": 0.0, "mixed": 0.5}[variant["loss"]]
    order = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(args.steps):
        picked = [indices[i] for i in torch.randint(len(indices), (args.batch_size,), generator=order).tolist()]
        batch = store.batch(picked)
        if args.window:  # the trainer's train_window
            batch = crop_window(batch, window_starts(batch, picked, args.window, args.seed, step), args.window)
        hidden, labels = batch["hidden"], batch["labels"]  # (B, W, H), (B, W)
        logits = heads(hidden, batch["input_ids"])  # (K, B, W, Vh)
        loss = logits.new_zeros(())
        if hard_weight > 0:
            counts = head_target_counts(labels, args.num_heads, lookup)
            loss = loss + hard_weight * step_loss(head_ce_sums(logits, labels, lookup), counts, args.decay)
        if hard_weight < 1:
            with torch.no_grad():
                teacher = hidden @ heads.shared_weight.T  # (B, T, Vh): the base's lm_head rows of the head vocab
            sums = head_soft_sums(logits, teacher, labels, args.temperature)
            loss = loss + (1 - hard_weight) * step_loss(sums, head_target_counts(labels, args.num_heads), args.decay)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0:
            logger.info("%s n=%d step %d loss %.4f (%.1f s)", variant["name"], len(indices), step + 1, loss.item(),
                        time.perf_counter() - start)
    return heads.eval(), time.perf_counter() - start


def build(args, model) -> None:
    from transformers import AutoTokenizer

    convs, _ = load_conversations(args.data, args.conversations)
    train_convs, _ = split_held_out(convs, args.held_out_fraction, args.seed)
    examples, _ = tokenize_conversations(train_convs, AutoTokenizer.from_pretrained(args.base), args.max_seq_len)
    start = time.perf_counter()
    build_store(args.store, model, examples, args.max_seq_len, batch_size=8, shard_tokens=1 << 16)
    logger.info("store %s ready (%.0f s this call)", args.store, time.perf_counter() - start)


def score(heads, states, top_k: int) -> dict:
    accuracy = rank_accuracy_from_states(heads, states, top_k)  # (K, top_k)
    taus = {n: expected_acceptance(grow_tree(accuracy, n), accuracy) for n in BUDGETS}
    return {"top1": accuracy[:, 0].tolist(), "top5": accuracy[:, :5].sum(1).tolist(), "accuracy": accuracy.tolist(),
            "expected_tau": {str(n): round(t, 4) for n, t in taus.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--store", required=True, help="hidden-state store of the training data (train/store.py)")
    parser.add_argument("--data", help="build the store from this dataset when it does not exist")
    parser.add_argument("--conversations", type=int, default=None, help="read at most this many (with --data)")
    parser.add_argument("--max-seq-len", type=int, default=384, help="with --data")
    parser.add_argument("--held-out-fraction", type=float, default=0.02, help="with --data, as in training")
    parser.add_argument("--build-only", action="store_true", help="build the store and stop")
    parser.add_argument("--held-out", required=True, help="self-distilled held-out JSON lines")
    parser.add_argument("--held-out-limit", type=int, default=None)
    parser.add_argument("--variants", nargs="+", default=["medusa:hard", "medusa:teacher", "hydra:hard",
                                                          "hydra:teacher"])
    parser.add_argument("--sizes", nargs="+", type=int, default=None, help="first N stored examples (default all)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--window", type=int, default=None, help="train on a random window of this many positions")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--head-vocab-size", type=int, default=4096)
    parser.add_argument("--decay", type=float, default=0.8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reference", nargs="*", help="heads folders scored on the same held-out data, untrained")
    parser.add_argument("--save-dir", help="also save each variant's heads under this folder")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval().requires_grad_(False)
    if args.data:
        build(args, model)
        if args.build_only:
            return
    store = HiddenStateStore.open(args.store, model)
    start = time.perf_counter()
    cache = Path(args.held_out).with_suffix(f".states-{args.held_out_limit or 'all'}.pt")
    if cache.is_file() and cache.stat().st_mtime > Path(args.held_out).stat().st_mtime:
        states = torch.load(cache)
    else:
        states = sequence_states(model, held_out_sequences(Path(args.held_out), args.held_out_limit))
        torch.save(states, cache)
    logger.info("held-out states of %d sequences in %.0f s", len(states), time.perf_counter() - start)
    rows = []
    for folder in args.reference or []:
        heads = load_heads(folder, model.get_output_embeddings().weight,
                           embed_weight=model.get_input_embeddings().weight)
        rows.append({"variant": f"reference {folder}", **score(heads.eval(), states, args.top_k)})
        logger.info("%s top-1 %s expected tau %s", folder, [round(a, 3) for a in rows[-1]["top1"]],
                    rows[-1]["expected_tau"])
    for size in args.sizes or [len(store)]:
        indices = list(range(min(size, len(store))))
        tokens = sum(sum(label != -100 for label in store.example(i)["labels"]) for i in indices)
        for variant in map(parse_variant, args.variants):
            heads, seconds = train_variant(model, store, indices, variant, args)
            row = {"variant": variant["name"], "examples": len(indices), "supervised_tokens": tokens,
                   "train_s": round(seconds, 1), **score(heads, states, args.top_k)}
            logger.info("%s n=%d top-1 %s expected tau %s", variant["name"], len(indices),
                        [round(a, 3) for a in row["top1"]], row["expected_tau"])
            rows.append(row)
            if args.save_dir:
                save_heads(heads, Path(args.save_dir) / f"{variant['name'].replace(':', '-')}-n{len(indices)}",
                           extra_config={"ablation": {k: v for k, v in row.items() if k != "accuracy"}})
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"settings": vars(args), "store": store.meta.get("base", {}),
                                                  "held_out_sequences": len(states), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
