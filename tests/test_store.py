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
    base_states,
    build_store,
    ensure_store,
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
    return base_states(model, ids, torch.ones_like(ids))[0].to(torch.bfloat16)  # (T, H)


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


LAYERS = (0, 1, 2)  # the low, middle and high layers of a 4-layer base, fused by the eagle drafter


@pytest.fixture(scope="module")
def deep_model():
    return tiny_model("llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def layered(tmp_path_factory, deep_model, examples):
    """A store of ``examples`` with the outputs of ``LAYERS`` after the last hidden state, one forward per example."""
    return build_store(tmp_path_factory.mktemp("layered") / "s", deep_model, examples, 64, batch_size=1,
                       shard_tokens=80, layers=LAYERS)


def test_round_trip_of_the_three_layers_is_bit_exact(layered, deep_model, examples, caplog):
    store = HiddenStateStore.open(layered, model=deep_model, max_seq_len=64, examples=examples, layers=LAYERS)
    assert store.layers == LAYERS and store.width == 4 * 64 and len(store.meta["shards"]) > 2
    for i, example in enumerate(examples):
        ids = torch.tensor([example["input_ids"]])
        online = base_states(deep_model, ids, torch.ones_like(ids), LAYERS)[0].to(torch.bfloat16)  # (T, 4H)
        assert torch.equal(online[:, :64], base_states(deep_model, ids, torch.ones_like(ids))[0].to(torch.bfloat16))
        hidden = store.hidden(i)
        assert hidden.shape == (len(example["input_ids"]), 4 * 64)
        assert torch.equal(hidden.view(torch.int16), online.view(torch.int16))
    meta = json.loads((layered / META_NAME).read_text())
    assert meta["format_version"] == 2 and meta["layers"] == list(LAYERS)
    assert meta["bytes_per_token"] == 2 * 4 * 64 + 8
    assert all(s["hidden_bytes"] == s["tokens"] * 4 * 64 * 2 for s in meta["shards"])
    with caplog.at_level("INFO", logger="train.store"):
        build_store(layered.parent / "again", deep_model, examples[:2], 64, layers=LAYERS)
    assert "layers [0, 1, 2]: 520 bytes per token" in caplog.text


def test_layered_store_built_in_batches_of_8_equals_one_built_one_by_one(tmp_path, layered, deep_model, examples):
    """Padding never reaches the stored states: each example's rows, built in length-sorted batches of 8 (padded),
    equal the ones built alone, within one bf16 step (the padded forward rounds differently), and the files have
    the same sizes."""
    alone = HiddenStateStore.open(layered)
    batched = HiddenStateStore.open(build_store(tmp_path / "s", deep_model, examples, 64, batch_size=8,
                                                shard_tokens=80, layers=LAYERS), layers=LAYERS)
    assert [s["hidden_bytes"] for s in batched.meta["shards"]] == [s["hidden_bytes"] for s in alone.meta["shards"]]
    for i in range(len(examples)):
        torch.testing.assert_close(batched.hidden(i).float(), alone.hidden(i).float(), rtol=2**-7, atol=1e-5)
    indices = [3, 0, 7]
    batch = batched.hidden_batch(indices)  # (B, T, 4H): zero padding, each row its example's states
    for row, i in enumerate(indices):
        n = len(examples[i]["input_ids"])
        assert torch.equal(batch[row, :n], batched.hidden(i).float()) and not batch[row, n:].any()


def test_a_store_built_with_other_layers_is_refused(built, layered, deep_model, model, examples):
    with pytest.raises(StoreError, match=r"a store built with other layers: it holds the base states of layers "
                                         r"\[\], the heads read layers \[1, 0\]"):
        HiddenStateStore.open(built, layers=(1, 0))
    with pytest.raises(StoreError, match=r"a store built with other layers: .*layers \[\], the heads read "
                                         r"layers \[2\]"):
        HiddenStateStore.open(built, layers=(2,))
    with pytest.raises(StoreError, match=r"a store built with other layers"):
        build_store(built, model, examples, 64, batch_size=1, shard_tokens=80, layers=(0,))


def test_a_store_of_more_layers_serves_heads_of_fewer(layered, deep_model, examples):
    """A finished store holding layers [0, 1, 2] gives Medusa/Hydra heads their last hidden states and an eagle
    drafter of layers [2, 0] exactly those columns, in its order: one base pass serves every drafter."""
    full = HiddenStateStore.open(layered)
    h = full.hidden_size
    heads = ensure_store(layered, deep_model, examples, 64)  # layers (): the heads' own
    assert heads.width == h and torch.equal(heads.hidden(1), full.hidden(1)[:, :h])
    picked = HiddenStateStore.open(layered, layers=(2, 0))
    expected = torch.cat([full.hidden(1)[:, :h], full.hidden(1)[:, 3 * h :], full.hidden(1)[:, h : 2 * h]], dim=1)
    assert picked.width == 3 * h and torch.equal(picked.hidden(1), expected)
    # The last layer's output is the last hidden state, which every store holds first.
    with_last = HiddenStateStore.open(layered, layers=(3, 1), model=deep_model)
    assert torch.equal(with_last.hidden(1), torch.cat([full.hidden(1)[:, :h], full.hidden(1)[:, :h],
                                                       full.hidden(1)[:, 2 * h : 3 * h]], dim=1))


def test_a_version_1_store_holds_the_last_hidden_states(built, tmp_path, model, examples):
    store = copy_store(built, tmp_path / "s")
    meta = json.loads((store / META_NAME).read_text())
    meta.pop("layers")
    (store / META_NAME).write_text(json.dumps(meta | {"format_version": 1}))
    opened = HiddenStateStore.open(store, model=model, examples=examples, layers=())
    assert opened.layers == () and opened.width == 64
    assert torch.equal(opened.hidden(0), HiddenStateStore.open(built).hidden(0))


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
    real, calls = store_module.base_states, []

    def failing(*args):
        calls.append(1)
        if len(calls) > 6:  # inside the second or third shard
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(store_module, "base_states", failing)
    with pytest.raises(KeyboardInterrupt):
        build_store(tmp_path / "s", model, examples, 64, batch_size=1, shard_tokens=80)
    partial = json.loads((tmp_path / "s" / META_NAME).read_text())
    assert not partial["complete"] and 0 < len(partial["shards"]) < len(plan_shards([len(e["input_ids"]) for e in
                                                                                      examples], 80))
    assert not any(p.name.startswith(".tmp-") for p in (tmp_path / "s").iterdir())  # the interrupted shard's
    (tmp_path / "s" / ".tmp-shard_00002.hidden").write_bytes(b"half")  # what a killed process leaves behind
    with pytest.raises(StoreError, match="build stopped after"):
        HiddenStateStore.open(tmp_path / "s")
    monkeypatch.setattr(store_module, "base_states", real)
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
    ('{"format": "medusa-hidden-state-store", "format_version": 2}',
     r"corrupt: missing \['base', 'complete', 'layers'"),
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


@pytest.mark.parametrize("loss, head_type", [("hard", "hydra"), ("teacher", "hydra"), ("teacher", "eagle")])
def test_training_from_the_store_matches_online_training(tmp_path, loss, head_type):
    base_dir = save_tiny(tmp_path / "base", "llama")
    chats = write_chats(tmp_path / "chats.jsonl")
    config = make_config(base_dir, chats, tmp_path / "run", hidden_state_store=str(tmp_path / "store"), loss=loss,
                         head_type=head_type)
    run = setup(config, tokenizer=tiny_tokenizer())
    assert run.store is not None and len(run.store) == len(run.train_examples)
    layers = run.heads.base_layers  # the eagle drafter's: the base's default layers, also the store's
    assert run.store.layers == layers and len(layers) == (3 if head_type == "eagle" else 0)
    indices = [0, 5, 2, 7]
    batch = collate([run.train_examples[i] for i in indices], run.pad_id)
    from_store = batch_hidden_states(run, indices, batch)  # (B, T, S)
    online = base_states(run.model, batch["input_ids"], batch["attention_mask"], layers)  # (B, T, S)
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
