"""The frozen held-out prompt sets (benchmarks/prompts/): well-formed, and disjoint from what trees and heads are
fitted on (the training and validation splits, :func:`train.data.split_conversations`)."""

import dataclasses
import json
import random
from collections import Counter
from pathlib import Path

from medusa.tools.bench import read_prompts
from train.config import TrainConfig
from train.data import Conversation, conversation_group, is_held_out, is_validation, split_conversations

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts"
SHAREGPT = PROMPTS / "sharegpt-held-out.jsonl"
MT_BENCH_STYLE = PROMPTS / "mt-bench-style.jsonl"
CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


def _text(record: dict) -> str:
    return record.get("prompt") or "\n".join(m["content"] for m in record["messages"])


def test_sharegpt_set_is_in_the_held_out_split_never_train_or_validation():
    records = read_prompts(SHAREGPT)
    ids = [r["id"] for r in records]
    assert len(records) == 20 and len(set(ids)) == len(ids)
    fraction, validation, seed = (DEFAULTS[k] for k in ("held_out_fraction", "validation_fraction", "seed"))
    assert all(is_held_out(i, fraction, seed) for i in ids)
    # Through the split itself, mixed with other ids: every frozen id lands in held-out, none in train/validation.
    rng = random.Random(0)
    others = [f"conv{rng.randrange(10**9)}_{n}" for n in range(3000)]
    convs = [Conversation(i, []) for i in others + ids]
    train, val, held = split_conversations(convs, fraction, validation, seed)
    assert set(ids) <= {c.id for c in held}
    assert not set(ids) & ({c.id for c in train} | {c.id for c in val})
    assert val and all(is_validation(c.id, validation, seed) for c in val)  # the validation split exists
    assert not {c.id for c in val} & {c.id for c in held} and not {c.id for c in val} & {c.id for c in train}


def test_no_chunk_of_a_frozen_prompts_conversation_is_trained_on_or_fitted_on():
    """ShareGPT cuts a conversation into chunks ``<id>_<n>``: every other chunk of a frozen prompt's conversation is
    kept out of the training and validation splits, and a conversation is never on two sides."""
    ids = [r["id"] for r in read_prompts(SHAREGPT)]
    groups = {conversation_group(i) for i in ids}
    assert len(groups) < len(ids) or all("_" in i for i in ids)  # chunk ids, several from one conversation
    siblings = [f"{g}_{n}" for g in groups for n in range(40)]
    rng = random.Random(1)
    others = [f"c{rng.randrange(10**9)}_{n}" for _ in range(800) for n in range(3)]
    convs = [Conversation(i, []) for i in dict.fromkeys(siblings + others + ids)]
    fraction, validation, seed = (DEFAULTS[k] for k in ("held_out_fraction", "validation_fraction", "seed"))
    train, val, held = split_conversations(convs, fraction, validation, seed)
    assert not groups & {conversation_group(c.id) for c in train + val}
    by_side = [{conversation_group(c.id) for c in side} for side in (train, val, held)]
    assert not (by_side[0] & by_side[1] or by_side[0] & by_side[2] or by_side[1] & by_side[2])
    assert conversation_group("Ot1oxuK_7") == "Ot1oxuK" and conversation_group("c12") == "c12"
    assert conversation_group("a_b") == "a_b" and conversation_group("_3") == "_3"


def test_mt_bench_style_set_has_ten_prompts_per_category_interleaved():
    records = read_prompts(MT_BENCH_STYLE)
    assert Counter(r["category"] for r in records) == dict.fromkeys(CATEGORIES, 10)
    assert [r["category"] for r in records[:16]] == CATEGORIES * 2  # --limit 8N takes N of every category
    assert len({r["id"] for r in records}) == 80 and len({_text(r) for r in records}) == 80
    assert all(r["id"].startswith(f"mtb-{r['category']}-") for r in records)


def test_the_two_sets_share_no_id_or_prompt():
    a, b = read_prompts(SHAREGPT), read_prompts(MT_BENCH_STYLE)
    assert not {r["id"] for r in a} & {r["id"] for r in b}
    assert not {_text(r) for r in a} & {_text(r) for r in b}
    for path in (SHAREGPT, MT_BENCH_STYLE):  # one JSON object per line, nothing else
        assert all(isinstance(json.loads(line), dict) for line in path.read_text(encoding="utf-8").splitlines())


def test_document_continuation_set_is_held_out_prefixes_of_plain_text():
    """benchmarks/prompts/documents-held-out.jsonl: ``text`` records (document prefixes, continued as plain text
    whatever the tokenizer), every id in the held-out split, none shared with the chat sets' prompts."""
    records = read_prompts(PROMPTS / "documents-held-out.jsonl")
    ids = [r["id"] for r in records]
    assert len(records) == 24 and len(set(ids)) == len(ids)
    assert all(set(r) == {"id", "text"} and 200 < len(r["text"]) <= 400 for r in records)
    fraction, seed = DEFAULTS["held_out_fraction"], DEFAULTS["seed"]
    assert all(is_held_out(i, fraction, seed) for i in ids)
    chat_texts = {_text(r) for path in (SHAREGPT, MT_BENCH_STYLE) for r in read_prompts(path)}
    assert not chat_texts & {r["text"] for r in records}
