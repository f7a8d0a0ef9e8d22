"""Plain-text data and base models without a chat template: reading documents (json lines, a folder of .txt),
windows that never cross a document, the loss after a prefix, chats rendered as role-labelled text, distillation of
document prefixes, and a tiny template-less model trained end to end whose heads decode like HF and get drafts
accepted."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from medusa.base import render_plain_chat
from tests.tiny import tiny_model, tiny_tokenizer
from train.config import TrainConfig
from train.data import (
    Conversation,
    document_examples,
    document_prefix_text,
    load_conversations,
    plain_chat_labels,
    tokenize_conversations,
)
from train.distill import distill, document_prefix

SENTENCES = ["the quick brown fox jumps over the lazy dog.", "a cat sat on the mat and looked at the door.",
             "we went to the market to buy some bread and milk.", "the sun rose over the hills at dawn."]


def plain_tokenizer():
    """The tiny byte-level tokenizer with no chat template, as a pretrained base ships."""
    tok = tiny_tokenizer()
    tok.chat_template = None
    return tok


def write_documents(path, n=24, repeats=6):
    """JSON lines of repetitive documents: each repeats two sentences."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(SENTENCES[(i + r) % 2 + 2 * (i % 2)] for r in range(repeats))
            f.write(json.dumps({"id": f"doc{i}", "text": text}) + "\n")
    return path


def test_documents_load_from_json_lines_and_a_txt_folder(tmp_path):
    docs, report = load_conversations(write_documents(tmp_path / "docs.jsonl", n=5))
    assert [d.id for d in docs] == [f"doc{i}" for i in range(5)] and all(d.is_document for d in docs)
    assert report.kept == 5 and docs[0].messages == []
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second document", encoding="utf-8")
    (folder / "sub" / "a.txt").write_text("first document", encoding="utf-8")
    (folder / "notes.md").write_text("not read", encoding="utf-8")
    docs, _ = load_conversations(folder)
    assert [(d.id, d.text) for d in docs] == [("b.txt", "second document"), ("sub/a.txt", "first document")]


def test_windows_never_cross_a_document_and_the_prefix_is_not_supervised():
    ids = list(range(100, 125))  # one document of 25 tokens
    windows = document_examples(ids, max_seq_len=10, prefix_tokens=3)
    assert [w for w, _ in windows] == [ids[0:10], ids[10:20], ids[20:25]]
    assert windows[0][1] == [-100] * 3 + ids[3:10] and windows[1][1] == ids[10:20]
    tok = plain_tokenizer()
    docs = [Conversation("a", [], text=SENTENCES[0] * 3), Conversation("b", [], text=SENTENCES[1])]
    examples, report = tokenize_conversations(docs, tok, max_seq_len=16, prefix_tokens=2, min_tokens=5)
    a_ids, b_ids = (tok(d.text)["input_ids"] for d in docs)
    # Each example is a slice of one document: concatenating a document's windows gives it back exactly.
    n_a = -(-len(a_ids) // 16)
    assert [t for e in examples[:n_a] for t in e["input_ids"]] == a_ids
    assert examples[n_a]["input_ids"] == b_ids[:16] and report.kept == 2 and report.examples == len(examples)
    assert examples[0]["labels"][:2] == [-100, -100] and examples[0]["labels"][2:] == a_ids[2:16]


def test_short_documents_are_counted_and_dropped_and_an_empty_corpus_is_refused(caplog):
    tok = plain_tokenizer()
    docs = [Conversation("long", [], text=SENTENCES[0]), Conversation("short", [], text="a")]
    with caplog.at_level(logging.WARNING, logger="train.data"):
        examples, report = tokenize_conversations(docs, tok, 64, min_tokens=5)
    assert report.dropped_short == 1 and report.kept == 1 and len(examples) == 1
    assert "1 documents shorter than 5 tokens" in caplog.text
    with pytest.raises(ValueError, match="empty corpus after filtering"):
        tokenize_conversations([Conversation("short", [], text="a")], tok, 64, min_tokens=5)


def test_chats_without_a_template_are_supervised_on_the_assistant_spans_only(caplog):
    tok = plain_tokenizer()
    messages = [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps over"},
                {"role": "user", "content": "the lazy dog"}, {"role": "assistant", "content": "a cat sat"}]
    text, spans = render_plain_chat(messages)
    assert text == ("User: the quick brown fox\n\nAssistant: jumps over\n\nUser: the lazy dog\n\n"
                    "Assistant: a cat sat\n\n")
    assert [text[s:e] for s, e in spans] == [" jumps over", " a cat sat"]
    ids, labels = plain_chat_labels(tok, messages)
    supervised = tok.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])
    assert supervised == " jumps over a cat sat"
    # The generation prompt is the rendering of the earlier turns plus "Assistant:", a prefix of the full text.
    prompt, _ = render_plain_chat(messages[:1], add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("Assistant:")
    with caplog.at_level(logging.WARNING, logger="train.data"):
        examples, _ = tokenize_conversations([Conversation("c", messages)], tok, 128)
    assert "no chat template" in caplog.text and examples[0]["labels"] == labels


def test_document_distillation_continues_drawn_prefixes_with_exact_ids_and_resumes(tmp_path):
    tok = plain_tokenizer()
    model = tiny_model("llama").eval()
    docs = [Conversation(f"d{i}", [], text=" ".join(SENTENCES)) for i in range(6)]
    docs.append(Conversation("tiny", [], text="a"))
    out = tmp_path / "distilled.jsonl"
    assert distill(model, tok, docs[:3], out, max_new_tokens=5, batch_size=2, prefix_lengths=(4, 8)) == 3
    assert distill(model, tok, docs, out, max_new_tokens=5, batch_size=2, prefix_lengths=(4, 8)) == 3
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # Resumed (the first three once each, in batches sorted by prefix length); "tiny" has no usable prefix.
    assert sorted(r["id"] for r in records) == [f"d{i}" for i in range(6)]
    full = tok(docs[0].text)["input_ids"]
    for r in records:
        assert len(r["prompt_ids"]) in (4, 8) and r["prompt_ids"] == full[: len(r["prompt_ids"])]
        expected = model.generate(torch.tensor([r["prompt_ids"]]), max_new_tokens=5, do_sample=False,
                                  pad_token_id=0)[0, len(r["prompt_ids"]):].tolist()
        assert r["response_ids"] == expected
    assert {len(r["prompt_ids"]) for r in records} == {4, 8}  # the drawn length varies by document
    assert document_prefix(tok, docs[0], (4, 8), seed=0) == document_prefix(tok, docs[0], (4, 8), seed=0)
    assert document_prefix_text("word " * 100, 40) == ("word " * 8).rstrip()


def test_a_template_less_tiny_model_trains_on_plain_text_and_its_heads_decode_like_hf(tmp_path):
    """Self-distilled document prefixes, then training: the held-out loss falls, the exported heads decode a
    held-out document prefix exactly as HF greedy does, and some drafts are accepted (tau above 1)."""
    from medusa.decode.loop import medusa_generate
    from medusa.decode.tree import Tree
    from medusa.io.checkpoint import load_heads_for_base
    from medusa.tools.bench import encode_prompt
    from train.history import read_history
    from train.trainer import train

    base = tmp_path / "base"
    tiny_model("llama").save_pretrained(base)
    plain_tokenizer().save_pretrained(base)
    docs = write_documents(tmp_path / "docs.jsonl", n=32)
    config = TrainConfig(base=str(base), data=str(docs), output_dir=str(tmp_path / "run"), num_heads=3,
                         head_vocab_size=None, max_seq_len=64, batch_size=8, learning_rate=3e-2, warmup_steps=0,
                         max_steps=24, save_every=0, eval_every=4, log_every=4, held_out_fraction=0.2,
                         validation_fraction=0.0, mixed_precision="no", self_distill=True, distill_max_new_tokens=24,
                         distill_prefix_lengths=[4, 8])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    heads_dir = train(config, model, plain_tokenizer())
    history = read_history(tmp_path / "run")
    first, last = history[0]["loss"], history[-1]["loss"]
    assert last < 0.8 * first, (first, last)
    heads = load_heads_for_base(heads_dir, model).eval()
    ids = encode_prompt(plain_tokenizer(), {"text": " ".join(SENTENCES[:2])})
    expected = model.generate(ids[None], max_new_tokens=24, min_new_tokens=24, do_sample=False,
                              pad_token_id=0)[0, len(ids):].tolist()
    tokens, stats = medusa_generate(model, heads, ids, Tree.chain(3), 24, stop_token_ids=set())
    assert tokens == expected
    assert sum(stats.accepted_per_step) > 0 and stats.tau > 1.0, (stats.accepted_per_step, first, last)


def test_a_text_file_that_is_not_utf8_is_named_with_its_byte_offset(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "good.txt").write_text("fine text", encoding="utf-8")
    (folder / "latin.txt").write_bytes(b"caf" + "é au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt is not UTF-8 text: byte 3 \(0xe9\)"):
        load_conversations(folder)
    lines = tmp_path / "docs.jsonl"
    lines.write_bytes(b'{"id": "a", "text": "ok"}\n{"id": "b", "text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"docs\.jsonl is not UTF-8 text: byte 50 \(0xe9\)"):
        load_conversations(lines)


def test_a_record_with_text_and_conversations_is_refused_naming_both(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"id": "x", "text": "a document", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}) + "\n")
    with pytest.raises(ValueError, match="record 0 has both 'text' .* and 'conversations'"):
        load_conversations(path)
    # Documents and chats in separate records of one file are both read.
    path.write_text(json.dumps({"id": "d", "text": "a document"}) + "\n" + json.dumps(
        {"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}) + "\n")
    convs, _ = load_conversations(path)
    assert [(c.id, c.is_document) for c in convs] == [("d", True), ("c", False)]


def test_an_empty_folder_and_a_gguf_of_an_unreadable_architecture_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .txt file"):
        load_conversations(tmp_path / "empty")
    gguf = pytest.importorskip("gguf")
    from medusa.io.prepare import check_gguf_architecture, prepare_model

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv9")
    writer.add_tensor("w", torch.zeros(4, dtype=torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="cannot read GGUF architecture 'rwkv9'"):
        check_gguf_architecture(path)
    with pytest.raises(ValueError, match="'rwkv9'"):
        prepare_model(tmp_path / "out", path)
    assert not (tmp_path / "out").exists()
