"""Self-distillation: windowed length batching, per-batch rates, and ``medusa distill`` (validation and held-out
first, resumable)."""

import json
import logging
import re

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


def _records(folder):
    return {name: {r["id"]: r for r in map(json.loads, (folder / name).read_text().splitlines())}
            for name in ("distilled_train.jsonl", "distilled_validation.jsonl", "distilled_held_out.jsonl")}


def test_distill_through_this_projects_decoder_writes_the_in_process_records(tmp_path, capsys, caplog):
    """``--decoder medusa``: plain decoding and Medusa decoding (random heads: exact all the same) write the records
    Hugging Face ``generate`` writes, greedy and stopping where it stops even when the base's generation_config asks
    for sampling and names no EOS (the tokenizer's is then no stop); a rerun resumes; decoder flags without
    ``--decoder medusa``, or beside ``--server``, and quantizer flags without ``--quantize``, are refused by name."""
    from transformers import AutoModelForCausalLM

    from medusa.io.checkpoint import save_heads
    from tests.test_decoding import random_heads

    base = save_tiny(tmp_path / "base", "llama")
    generation = json.loads((base / "generation_config.json").read_text())
    generation.update(do_sample=True, temperature=1.0, top_k=0, eos_token_id=None)  # as some instruct bases ship
    (base / "generation_config.json").write_text(json.dumps(generation))
    save_heads(random_heads(AutoModelForCausalLM.from_pretrained(base)), tmp_path / "heads")
    chats = write_chats(tmp_path / "chats.jsonl", n=10)
    common = ["distill", "--base", str(base), "--data", str(chats), "--held-out-fraction", "0.2",
              "--validation-fraction", "0.2", "--seed", "0", "--max-new-tokens", "6"]
    assert main([*common, "--out-dir", str(tmp_path / "hf"), "--batch-size", "1"]) == 0
    assert main([*common, "--out-dir", str(tmp_path / "plain"), "--decoder", "medusa", "--engine", "eager"]) == 0
    caplog.set_level(logging.INFO, logger="train.splits")
    caplog.set_level(logging.INFO, logger="train.distill")
    assert main([*common, "--out-dir", str(tmp_path / "medusa"), "--decoder", "medusa", "--heads",
                 str(tmp_path / "heads"), "--engine", "static"]) == 0
    assert "the heads folder has no calibration.json" in caplog.text  # the heads were loaded
    reference = _records(tmp_path / "hf")
    assert all(reference.values()) and _records(tmp_path / "plain") == reference == _records(tmp_path / "medusa")
    # the static engine batches: the decoder takes HF's default batches (16), each prompt decoded as alone
    planned = re.findall(r"distilling (\d+) prompts in (\d+) batches", caplog.text)
    assert planned and any(int(prompts) > int(batches) for prompts, batches in planned)
    before = (tmp_path / "medusa" / "distilled_train.jsonl").read_text()
    assert main([*common, "--out-dir", str(tmp_path / "medusa"), "--decoder", "medusa"]) == 0  # all done already
    assert (tmp_path / "medusa" / "distilled_train.jsonl").read_text() == before
    capsys.readouterr()
    assert main([*common, "--out-dir", str(tmp_path / "x"), "--heads", str(tmp_path / "heads")]) == 2
    assert "--heads choose this project's decoder: add --decoder medusa" in capsys.readouterr().err
    assert main([*common, "--out-dir", str(tmp_path / "x"), "--decoder", "medusa", "--server",
                 "http://127.0.0.1:9/v1"]) == 2
    assert "--decoder medusa answers in process and --server through a server" in capsys.readouterr().err
    assert main([*common, "--out-dir", str(tmp_path / "x"), "--decoder", "medusa", "--int4-kernel", "native"]) == 2
    assert "--int4-kernel set how --quantize quantizes: pass --quantize int4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_a_quantized_decoder_is_token_checked_against_the_base_before_anything_is_written(tmp_path, capsys,
                                                                                         monkeypatch, caplog):
    """On a quantized engine the decoder's first answers are compared with the base's own greedy tokens first: the
    agreement is printed; a decoder that answers something else is named, and no record is written."""
    import pytest

    import train.distill
    from medusa.engines import quantized

    if quantized.quantize_unavailable("int8", "cpu") is not None:
        pytest.skip(quantized.quantize_unavailable("int8", "cpu"))
    base = save_tiny(tmp_path / "base", "llama")
    chats = write_chats(tmp_path / "chats.jsonl", n=8)
    common = ["distill", "--base", str(base), "--data", str(chats), "--held-out-fraction", "0.2",
              "--validation-fraction", "0.2", "--seed", "0", "--max-new-tokens", "5", "--decoder", "medusa",
              "--quantize", "int8", "--check-prompts", "3"]
    caplog.set_level(logging.INFO, logger="train.splits")
    assert main([*common, "--out-dir", str(tmp_path / "q"), "--min-agreement", "0"]) == 0
    assert "token check against --base's own greedy tokens: " in capsys.readouterr().out
    assert "--release-dense: freed" in caplog.text  # built quantized
    assert _records(tmp_path / "q")["distilled_train.jsonl"]
    monkeypatch.setattr(train.distill, "decoder_answer", lambda model: lambda prompts, n: [[3] * n for _ in prompts])
    assert main([*common, "--out-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "the decoder's answers are not --base's greedy tokens" in err and "--quantize int8 rounds" in err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").glob("*.jsonl"))

    class TwoProcesses:  # what accelerate launch --num_processes 2 gives each process
        num_processes, device, is_main_process = 2, "cpu", True

        def __init__(self, **kwargs):
            pass

    import accelerate

    monkeypatch.setattr(accelerate, "PartialState", TwoProcesses)
    assert main([*common, "--out-dir", str(tmp_path / "two")]) == 2
    assert "the token check (--check-prompts 3) runs in one process" in capsys.readouterr().err
