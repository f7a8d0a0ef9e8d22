"""Hidden-state store: bit-exact round trip, resume, training from the store, and every bad input's error."""

import copy
import json
import random

import pytest
import torch

import train.store as store_module
from tests.test_train import make_config, write_chats
from tests.tiny import save_tiny, tiny_model, tiny_tokenizer
from train.data import collate
from train.store import (
    META_NAME,
    HiddenStateStore,
    StoreError,
    base_hidden_states,
    build_store,
    plan_shards,
)
from train.trainer import batch_hidden_states, head_loss, setup, train


def make_examples(n: int = 12, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(3, 40)
        ids = [rng.randrange(4, 300) for _ in range(length)]
        cut = rng.randint(1, length - 1)
        examples.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    return examples


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def examples():
    return make_examples()


@pytest.fixture(scope="module")
def built(tmp_path_factory, model, examples):
    """A store of ``examples`` in several shards, one base forward per example (unpadded)."""
    return build_store(tmp_path_factory.mktemp("store") / "s", model, examples, 64, batch_size=1, shard_tokens=80)


def online_bf16(model, example: dict) -> torch.Tensor:
    ids = torch.tensor([example["input_ids"]])
    return base_hidden_states(model, ids, torch.ones_like(ids))[0].to(torch.bfloat16)  # (T, H)


def test_round_trip_is_bit_exact(built, model, examples):
    store = HiddenStateStore.open(built, model=model, max_seq_len=64, examples=examples)
    assert len(store) == len(examples) and len(store.meta["shards"]) > 2
    for i, example in enumerate(examples):
        assert store.example(i) == example
        hidden = store.hidden(i)
        assert hidden.dtype == torch.bfloat16 and hidden.shape == (len(example["input_ids"]), 64)
        assert torch.equal(hidden.view(torch.int16), online_bf16(model, example).view(torch.int16))
    meta = json.loads((built / META_NAME).read_text())
    assert meta["bytes_per_token"] == 64 * 2 + 8 and meta["num_tokens"] == sum(len(e["input_ids"]) for e in examples)
    assert meta["base"]["hidden_size"] == 64 and meta["max_seq_len"] == 64 and meta["dtype"] == "bfloat16"
    sizes = {p.name: p.stat().st_size for p in built.iterdir() if p.name != META_NAME}
    assert sizes == {f"{s['name']}{suffix}": s[key] for s in meta["shards"]
                     for suffix, key in ((".hidden", "hidden_bytes"), (".tokens", "tokens_bytes"))}


def test_batched_build_matches_online_within_one_bf16_step(tmp_path, model, examples):
    store = HiddenStateStore.open(build_store(tmp_path / "s", model, examples, 64, batch_size=5), model=model)
    for i, example in enumerate(examples):
        online = online_bf16(model, example).float()
        torch.testing.assert_close(store.hidden(i).float(), online, rtol=2**-7, atol=1e-5)


def test_batch_pads_right_with_zero_states(built, examples):
    store = HiddenStateStore.open(built)
    indices = [3, 0, 7]
    batch = store.batch(indices, pad_id=0)
    expected = collate([examples[i] for i in indices], pad_id=0)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(batch[key], expected[key])
    assert batch["hidden"].dtype == torch.float32 and batch["hidden"].shape[:2] == expected["input_ids"].shape
    for row, i in enumerate(indices):
        n = len(examples[i]["input_ids"])
        assert torch.equal(batch["hidden"][row, :n], store.hidden(i).float())
        assert not batch["hidden"][row, n:].any()


def test_resume_after_interrupted_build_gives_the_same_store(tmp_path, monkeypatch, model, examples, built):
    real, calls = store_module.base_hidden_states, []

    def failing(*args):
        calls.append(1)
        if len(calls) > 6:  # inside the second or third shard
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(store_module, "base_hidden_states", failing)
    with pytest.raises(KeyboardInterrupt):
        build_store(tmp_path / "s", model, examples, 64, batch_size=1, shard_tokens=80)
    partial = json.loads((tmp_path / "s" / META_NAME).read_text())
    assert not partial["complete"] and 0 < len(partial["shards"]) < len(plan_shards([len(e["input_ids"]) for e in
                                                                                      examples], 80))
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "s").iterdir())  # the interrupted shard's
    (tmp_path / "s" / ".tmp-shard_00002.hidden").write_bytes(b"half")  # what a killed process leaves behind
    with pytest.raises(StoreError, match="build stopped after"):
        HiddenStateStore.open(tmp_path / "s")
    monkeypatch.setattr(store_module, "base_hidden_states", real)
    calls.clear()
    build_store(tmp_path / "s", model, examples, 64, batch_size=1, shard_tokens=80)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == sorted(p.name for p in built.iterdir())
    for p in built.iterdir():
        assert (tmp_path / "s" / p.name).read_bytes() == p.read_bytes(), p.name


def test_store_of_another_base_or_max_seq_len_is_refused(built, model, examples):
    tuned = copy.deepcopy(model)  # same sizes and lm_head, another decoder layer: caught by re-running example 0
    with torch.no_grad():
        tuned.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    with pytest.raises(StoreError, match="other hidden states"):
        HiddenStateStore.open(built, model=tuned)
    other = tiny_model("llama", seed=1)
    with pytest.raises(StoreError, match="built by another base"):
        HiddenStateStore.open(built, model=other)
    with pytest.raises(StoreError, match="another base|a different store"):
        build_store(built, other, examples, 64, batch_size=1, shard_tokens=80)
    bigger = tiny_model("llama", hidden_size=96)
    with pytest.raises(StoreError, match="hidden_size"):
        HiddenStateStore.open(built, model=bigger)
    with pytest.raises(StoreError, match="max_seq_len 64, asked for 32"):
        HiddenStateStore.open(built, max_seq_len=32)
    with pytest.raises(StoreError, match="max_seq_len"):
        build_store(built, tiny_model("llama"), examples, 128, batch_size=1, shard_tokens=80)
    with pytest.raises(StoreError, match="other examples"):
        HiddenStateStore.open(built, examples=examples[:-1])


def copy_store(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_truncated_shard_is_refused(built, tmp_path):
    store = copy_store(built, tmp_path / "s")
    shard = store / "shard_00001.hidden"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(StoreError, match=r"shard_00001\.hidden: shard .* bytes on disk"):
        HiddenStateStore.open(store)
    (store / "shard_00000.tokens").unlink()
    with pytest.raises(StoreError, match=r"shard_00000\.tokens: shard missing"):
        HiddenStateStore.open(store)


@pytest.mark.parametrize("meta_text, match", [
    (None, "meta.json not found"),
    ('{"format": "medusa-hidden-st', "corrupt"),
    ('{"format": "something else"}', "not the meta of a hidden-state store"),
    ('{"format": "medusa-hidden-state-store", "format_version": 99}', "unknown store format version 99"),
    ('{"format": "medusa-hidden-state-store", "format_version": 1}', "corrupt: missing"),
])
def test_bad_meta_is_refused(built, tmp_path, meta_text, match):
    store = copy_store(built, tmp_path / "s")
    if meta_text is None:
        (store / META_NAME).unlink()
    else:
        (store / META_NAME).write_text(meta_text)
    with pytest.raises(StoreError, match=match):
        HiddenStateStore.open(store)


def test_examples_longer_than_max_seq_len_are_refused(tmp_path, model, examples):
    with pytest.raises(ValueError, match="max_seq_len=8"):
        build_store(tmp_path / "s", model, examples, 8)


@pytest.mark.parametrize("loss", ["hard", "teacher"])
def test_training_from_the_store_matches_online_training(tmp_path, loss):
    base_dir = save_tiny(tmp_path / "base", "llama")
    chats = write_chats(tmp_path / "chats.jsonl")
    config = make_config(base_dir, chats, tmp_path / "run", hidden_state_store=str(tmp_path / "store"), loss=loss,
                         head_type="hydra")
    run = setup(config, tokenizer=tiny_tokenizer())
    assert run.store is not None and len(run.store) == len(run.train_examples)
    indices = [0, 5, 2, 7]
    batch = collate([run.train_examples[i] for i in indices], run.pad_id)
    from_store = batch_hidden_states(run, indices, batch)  # (B, T, H)
    online = base_hidden_states(run.model, batch["input_ids"], batch["attention_mask"])  # (B, T, H)
    online = online.to(torch.bfloat16).float() * batch["attention_mask"][..., None]
    # The store ran the base in other batches (other padding): its bf16 states may differ by one bf16 step.
    torch.testing.assert_close(from_store, online, rtol=2**-7, atol=1e-5)
    with torch.no_grad():  # teacher logits, when the loss needs them, come from the same (stored) states
        store_loss, _ = head_loss(run, run.heads(from_store, batch["input_ids"]), from_store, batch)
        online_loss, _ = head_loss(run, run.heads(online, batch["input_ids"]), online, batch)
    torch.testing.assert_close(store_loss, online_loss, rtol=1e-4, atol=0)


def test_train_with_a_store_end_to_end(tmp_path):
    base_dir = save_tiny(tmp_path / "base", "llama")
    chats = write_chats(tmp_path / "chats.jsonl")
    config = make_config(base_dir, chats, tmp_path / "run", hidden_state_store=str(tmp_path / "store"))
    heads_dir = train(config, tokenizer=tiny_tokenizer())
    assert (heads_dir / "model.safetensors").is_file()
    assert json.loads((tmp_path / "store" / META_NAME).read_text())["complete"]


def test_a_finished_store_is_reused_whatever_shard_size_built_it(built, model, examples, monkeypatch):
    """The trainer (default shard size) reuses a store built with another one, without running the base again."""
    import train.store as store_module

    monkeypatch.setattr(store_module, "_write_shard", lambda *a, **k: pytest.fail("the base ran again"))
    assert build_store(built, model, examples, 64, shard_tokens=1 << 20) == built
    with pytest.raises(StoreError, match="other examples|examples_sha256"):
        build_store(built, model, make_examples(seed=1), 64, shard_tokens=1 << 20)
