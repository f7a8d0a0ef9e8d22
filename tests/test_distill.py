"""Self-distillation: windowed length batching, per-batch rates, and ``medusa distill`` (validation and held-out
first, resumable)."""

import json
import logging

from medusa.cli import main
from tests.test_train import write_chats
from tests.tiny import save_tiny, tiny_model, tiny_tokenizer
from train.data import Conversation, is_held_out, is_validation
from train.distill import distill, window_sorted


def test_window_sorted_keeps_file_order_between_windows():
    items = [5, 1, 4, 9, 2, 8, 0]
    assert window_sorted(items, lambda x: x, 3) == [1, 4, 5, 2, 8, 9, 0]
    assert window_sorted(items, lambda x: x, 100) == sorted(items)


def test_time_limited_run_answers_the_first_window_not_the_shortest_prompts(tmp_path, caplog):
    words = "the quick brown fox jumps over the lazy dog".split()
    # Long prompts first, the shortest ones at the end of the file.
    convs = [Conversation(f"c{i}", [{"role": "user", "content": " ".join(words[: 9 - i // 4])}]) for i in range(32)]
    out = tmp_path / "d.jsonl"
    with caplog.at_level(logging.INFO, logger="train.distill"):
        written = distill(tiny_model("llama"), tiny_tokenizer(), convs, out, max_new_tokens=3, batch_size=2,
                          time_limit_s=1e-9)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert written == 2 and set(ids) <= {f"c{i}" for i in range(16)}  # from the first window of 8 batches
    assert "answers/s" in caplog.text and "tokens/s" in caplog.text


def test_distill_command_writes_validation_and_held_out_first_and_resumes(tmp_path, capsys):
    base = save_tiny(tmp_path / "base", "llama")
    chats = write_chats(tmp_path / "chats.jsonl", n=12)
    args = ["distill", "--base", str(base), "--data", str(chats), "--out-dir", str(tmp_path / "out"),
            "--held-out-fraction", "0.25", "--validation-fraction", "0.3", "--seed", "0", "--max-new-tokens", "4",
            "--batch-size", "4"]
    assert main(args) == 0

    def records(name):
        return [json.loads(line) for line in (tmp_path / "out" / name).read_text().splitlines()]

    held, train, val = (records(f"distilled_{n}.jsonl") for n in ("held_out", "train", "validation"))
    assert held and train and val and len(held) + len(train) + len(val) == 12
    assert all(is_held_out(r["id"], 0.25, 0) for r in held) and not any(is_held_out(r["id"], 0.25, 0) for r in train)
    assert all(is_validation(r["id"], 0.3, 0) and not is_held_out(r["id"], 0.25, 0) for r in val)
    assert not any(is_validation(r["id"], 0.3, 0) for r in train)
    record = train[0]
    assert set(record) == {"id", "messages", "prompt_ids", "response_ids"} and record["messages"][-1]["role"] == \
        "assistant" and 0 < len(record["response_ids"]) <= 4
    before = (tmp_path / "out" / "distilled_train.jsonl").read_text()
    assert main(args) == 0  # everything is done: nothing is generated again
    assert (tmp_path / "out" / "distilled_train.jsonl").read_text() == before
    assert "distilled_held_out.jsonl: " in capsys.readouterr().out
