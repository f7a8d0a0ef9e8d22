"""Chat data: reading, role mapping, splitting, assistant-only labels, collation and head-vocab statistics."""

import json

import pytest
import torch

from tests.tiny import tiny_tokenizer
from train.data import (
    Conversation,
    ReadReport,
    collate,
    load_conversations,
    normalize_record,
    split_held_out,
    target_token_counts,
    tokenize_conversation,
    tokenize_conversations,
)


def sharegpt(i: int, turns: list[tuple[str, str]]) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": f, "value": v} for f, v in turns]}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_truncated_json_array_keeps_complete_records(tmp_path):
    records = [sharegpt(i, [("human", "hello"), ("gpt", "world")]) for i in range(3)]
    text = json.dumps(records)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('{"from"') + 5])  # cut inside the last record
    convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["c0", "c1"]
    assert report.dropped_truncated == 1 and report.read == 2


def test_role_mapping(tmp_path):
    records = [
        sharegpt(0, [("system", "be nice"), ("human", "a"), ("gpt", "b"), ("user", "c"), ("chatgpt", "d")]),
        sharegpt(1, [("human", "a"), ("bing", "b"), ("human", "c"), ("bard", "d")]),
    ]
    path = tmp_path / "roles.json"
    path.write_text(json.dumps(records))
    convs, _ = load_conversations(path)
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in convs[1].messages] == ["user", "assistant", "user", "assistant"]


def test_empty_and_assistant_less_conversations_dropped(tmp_path):
    records = [
        sharegpt(0, []),
        sharegpt(1, [("human", "   "), ("gpt", "")]),
        sharegpt(2, [("human", "only a question")]),
        sharegpt(3, [("human", "q"), ("gpt", "a")]),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    convs, report = load_conversations(path)
    assert [c.id for c in convs] == ["c3"]
    assert report.dropped_empty == 2 and report.dropped_no_assistant == 1


def test_openai_style_records(tmp_path):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "oa.jsonl"
    path.write_text(json.dumps(record) + "\n")
    convs, _ = load_conversations(path)
    assert convs[0].messages == record["messages"]


@pytest.mark.parametrize("records", [[], [sharegpt(0, [("human", "q")]), sharegpt(1, [("system", "s")])]])
def test_no_usable_conversation_raises(tmp_path, records):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(records))
    with pytest.raises(ValueError, match="no usable conversation"):
        load_conversations(path)


def test_tokenize_without_assistant_turn_raises(tok):
    with pytest.raises(ValueError, match="no conversation has an assistant turn"):
        tokenize_conversations([Conversation("x", [{"role": "user", "content": "hello"}])], tok, 64)
    with pytest.raises(ValueError, match="no conversations"):
        tokenize_conversations([], tok, 64)


def test_split_is_deterministic_and_order_independent():
    convs = [Conversation(f"id{i}", []) for i in range(200)]
    train, held = split_held_out(convs, 0.2, seed=3)
    _, held2 = split_held_out(list(reversed(convs)), 0.2, seed=3)
    assert {c.id for c in held} == {c.id for c in held2}
    assert 20 <= len(held) <= 60 and len(train) + len(held) == 200
    _, held_other_seed = split_held_out(convs, 0.2, seed=4)
    assert {c.id for c in held} != {c.id for c in held_other_seed}


def test_labels_cover_exactly_assistant_content_and_end_token(tok):
    messages = [
        {"role": "system", "content": "user assistant system"},
        {"role": "user", "content": "hello world, how are you today?"},
        {"role": "assistant", "content": "the quick brown fox"},
        {"role": "user", "content": "jumps over"},
        {"role": "assistant", "content": "the lazy dog"},
    ]
    (example,) = tokenize_conversation(Conversation("a", messages), tok, 512)
    ids, labels = example["input_ids"], example["labels"]
    assert len(ids) == len(labels)
    supervised = [i for i, label in enumerate(labels) if label != -100]
    assert all(labels[i] == ids[i] for i in supervised)
    # Split supervised positions into contiguous runs: one per assistant turn.
    runs, run = [], [supervised[0]]
    for i in supervised[1:]:
        if i == run[-1] + 1:
            run.append(i)
        else:
            runs.append(run)
            run = [i]
    runs.append(run)
    decoded = [tok.decode([ids[i] for i in r]) for r in runs]
    assert decoded == ["the quick brown fox<|im_end|>", "the lazy dog<|im_end|>"]


def test_truncation_and_drop(tok):
    messages = [{"role": "user", "content": "hello world, how are you today?"},
                {"role": "assistant", "content": "the quick brown fox"}]
    (full,) = tokenize_conversation(Conversation("a", messages), tok, 512)
    prompt_len = full["labels"].index(next(label for label in full["labels"] if label != -100))
    (cut,) = tokenize_conversation(Conversation("a", messages), tok, prompt_len + 2)
    assert len(cut["input_ids"]) == prompt_len + 2
    assert sum(label != -100 for label in cut["labels"]) == 2
    assert tokenize_conversation(Conversation("a", messages), tok, prompt_len) == []
    convs = [Conversation("a", messages)] * 2 + [Conversation("b", [])]
    _, report = tokenize_conversations(convs, tok, prompt_len + 2)
    assert report.kept == 2 and report.dropped_no_target == 1 and report.truncated == 2


def test_self_distilled_records_use_ids_as_is(tmp_path, tok):
    record = {"id": "d0", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
              "prompt_ids": [3, 10, 11, 12], "response_ids": [40, 41, 2]}
    path = tmp_path / "distilled.jsonl"
    path.write_text(json.dumps(record) + "\n")
    convs, _ = load_conversations(path)
    assert tokenize_conversation(convs[0], tok, 512) == [
        {"input_ids": [3, 10, 11, 12, 40, 41, 2], "labels": [-100] * 4 + [40, 41, 2]}]


def test_collate_right_pads():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_target_token_counts():
    counts = target_token_counts([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [3], "labels": [3]}],
                                 vocab_size=5)
    assert counts.tolist() == [0, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="outside"):
        target_token_counts([{"input_ids": [9], "labels": [9]}], vocab_size=5)
    assert counts.dtype == torch.long


def chat_records(n: int) -> list[dict]:
    words = "the quick brown fox jumps over the lazy dog hello world".split()
    return [sharegpt(i, [("human", " ".join(words[i % 5 : i % 5 + 3])), ("gpt", " ".join(words[i % 7 :]))])
            for i in range(n)]


def test_json_jsonl_and_parquet_read_alike(tmp_path):
    import datasets

    records = chat_records(6)
    (tmp_path / "a.json").write_text(json.dumps(records))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "a.parquet"))
    read = [load_conversations(tmp_path / f"a.{ext}") for ext in ("json", "jsonl", "parquet")]
    assert read[0][0] == read[1][0] == read[2][0] and len(read[0][0]) == 6
    assert all(report.read == 6 and report.dropped_truncated == 0 for _, report in read)


def test_mixed_record_styles_in_one_file(tmp_path):
    # datasets gives every record every column (None where absent): neither style may read the other's None.
    records = [sharegpt(0, [("human", "a"), ("gpt", "b")]),
               {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    convs, _ = load_conversations(path)
    assert [c.id for c in convs] == ["c0", "1"]
    assert [m["content"] for m in convs[1].messages] == ["c", "d"]


def test_unsupported_suffix_raises(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported dataset format '\.csv'"):
        load_conversations(path)


def test_tokenisation_cache_is_keyed_by_tokenizer_and_max_seq_len(tmp_path, tok):
    from tokenizers import AddedToken

    convs = [Conversation(f"c{i}", normalize_messages(r)) for i, r in enumerate(chat_records(8))]
    cache = tmp_path / "cache"
    first, report = tokenize_conversations(convs, tok, 64, cache_dir=cache)
    files = set(cache.iterdir())
    assert len(files) == 1
    again, report_again = tokenize_conversations(convs, tok, 64, cache_dir=cache)
    assert again == first and report_again == report and set(cache.iterdir()) == files  # reused
    shorter, _ = tokenize_conversations(convs, tok, 30, cache_dir=cache)
    assert all(len(e["input_ids"]) <= 30 for e in shorter) and shorter != first and len(set(cache.iterdir())) == 2
    changed = tiny_tokenizer()
    changed.add_tokens([AddedToken("quick brown", special=False)])
    retokenised, _ = tokenize_conversations(convs, changed, 64, cache_dir=cache)
    assert retokenised != first and len(set(cache.iterdir())) == 3
    assert tokenize_conversations(convs, tok, 64)[0] == first  # no cache_dir: nothing cached, same result


def normalize_messages(record: dict) -> list[dict]:
    convs_report = ReadReport()
    return normalize_record(record, 0, convs_report).messages


@pytest.mark.slow
def test_tokenisation_with_two_processes_matches_one(tok):
    convs = [Conversation(f"c{i}", normalize_messages(r)) for i, r in enumerate(chat_records(10))]
    convs.append(Conversation("none", [{"role": "user", "content": "only a question"}]))
    one = tokenize_conversations(convs, tok, 64)
    two = tokenize_conversations(convs, tok, 64, num_proc=2)
    assert one == two and one[1].dropped_no_target == 1
