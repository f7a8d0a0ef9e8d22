"""Prompt prefixes kept for the next prompts that start alike (medusa/decode/prefix.py, RunningBatch.begin, the
engines' prefix_snapshot / restore_prefix, the server's --prefix-cache-mb): a prompt prefilled from a kept prefix
gets the cache and the tokens of one prefilled whole, bit for bit; nothing is reused through an engine that cannot
promise that, nor after the weights changed; the store keeps to its budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_decode_step import TREE
from test_decoding import WIDE_TREE, random_heads
from tiny import tiny_model, tiny_tokenizer

from medusa.decode.logits_process import resolve_decoding
from medusa.decode.loop import RunningBatch
from medusa.decode.prefix import PrefixStore
from medusa.drafters.composite import tree_drafter
from medusa.engines import make_engine, native, quantized
from medusa.model import MedusaModel
from medusa.serve.app import ServeConfig
from medusa.serve.scheduler import Job, Scheduler

FIRST = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(4))
OTHER = torch.randint(3, 300, (9,), generator=torch.Generator().manual_seed(5))
PROMPTS = [FIRST, torch.cat([FIRST[:14], OTHER[:6]]), torch.cat([FIRST[:14], OTHER]), FIRST.clone(), OTHER]
SHARED = [0, 14, 20, 19, 0]  # with the store: positions copied for each prompt, in this order


def native_or_skip(int4: bool = False):
    reason = native.native_unavailable() or (quantized.quantize_unavailable("int4", "cpu") if int4 else None)
    if reason is not None:
        pytest.skip(reason)


def decode_each(batch: RunningBatch, prompts, max_new: int = 10):
    """Each prompt alone through ``batch`` in turn: its tokens and its cache's prompt positions right after its
    prefill (every layer's keys and values)."""
    out = []
    for i, prompt in enumerate(prompts):
        joining = batch.begin(i, prompt, max_new, set())
        step = batch.prefill(joining, joining.left)
        kv = torch.stack([torch.cat([layer.keys[:, :, : len(prompt)], layer.values[:, :, : len(prompt)]])
                          for layer in joining.cache.layers])
        tokens = list(step.tokens)
        while batch.rows:
            tokens += batch.step()[0][1].tokens
        out.append((tokens, kv))
    return out


@pytest.mark.parametrize("engine_name", ["native", "int4-native"])
def test_a_prompt_starting_like_a_kept_one_gets_the_cache_and_tokens_of_a_whole_prefill(engine_name):
    native_or_skip(int4=engine_name != "native")
    model = tiny_model("llama")
    drafter = tree_drafter(random_heads(model), TREE)
    engine = (make_engine("native", model) if engine_name == "native"
              else make_engine("int4", model, kernel="native"))
    whole = decode_each(RunningBatch(model, drafter, engine), PROMPTS)
    batch = RunningBatch(model, drafter, engine)
    batch.prefix_store = store = PrefixStore(1 << 24, min_tokens=4)
    kept = decode_each(batch, PROMPTS)
    for i, ((tokens, kv), (want_tokens, want_kv)) in enumerate(zip(kept, whole, strict=True)):
        assert tokens == want_tokens, i
        assert torch.equal(kv, want_kv), i  # bit for bit, not to rounding
    assert store.hits == sum(n > 0 for n in SHARED) and store.reused_tokens == sum(SHARED)
    # the prompt covering FIRST[:14] + OTHER[:6] replaced it; FIRST itself came back as an entry of its own
    assert sorted(len(e.tokens) for e in store.entries.values()) == [9, 20, 23]


def test_nothing_is_reused_through_an_engine_that_cannot_promise_the_bits():
    model = tiny_model("llama")
    drafter = tree_drafter(random_heads(model), TREE)
    for name in ("eager", "static"):
        engine = make_engine(name, model)
        batch = RunningBatch(model, drafter, engine)
        batch.prefix_store = store = PrefixStore(1 << 24, min_tokens=4)
        kept = decode_each(batch, PROMPTS[:2])
        assert store.hits == 0 and not store.entries, name
        assert [t for t, _ in kept] == [t for t, _ in decode_each(RunningBatch(model, drafter, engine), PROMPTS[:2])]


def test_a_prefix_kept_before_the_weights_changed_is_not_restored():
    native_or_skip()
    model = tiny_model("llama")
    drafter = tree_drafter(random_heads(model), TREE)
    engine = make_engine("native", model)
    batch = RunningBatch(model, drafter, engine)
    batch.prefix_store = store = PrefixStore(1 << 24, min_tokens=4)
    decode_each(batch, PROMPTS[:1])
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # in place: the engine rebuilds its C weights
    changed = decode_each(batch, PROMPTS[1:2])
    assert store.hits == 0 and len(store.entries) == 1  # the stale one dropped, this prompt kept
    assert torch.equal(next(iter(store.entries.values())).tokens, PROMPTS[1])
    fresh = decode_each(RunningBatch(model, drafter, engine), PROMPTS[1:2])
    assert changed[0][0] == fresh[0][0] and torch.equal(changed[0][1], fresh[0][1])


def run_chunked(batch: RunningBatch, prompt: torch.Tensor, chunk: int, between=lambda n: None):
    """``prompt`` through ``batch`` in chunks of ``chunk``, ``between(n)`` called before the n-th: (tokens, the
    prompt positions' keys and values after its prefill)."""
    joining, step, n = batch.begin(0, prompt, 10, set()), None, 0
    while step is None:
        between(n)
        step = batch.prefill(joining, chunk)
        n += 1
    kv = torch.stack([torch.cat([layer.keys[:, :, : len(prompt)], layer.values[:, :, : len(prompt)]])
                      for layer in joining.cache.layers])
    tokens = list(step.tokens)
    while batch.rows:
        tokens += batch.step()[0][1].tokens
    return tokens, kv


@pytest.mark.parametrize("when", ["between a kept prompt's chunks", "after begin copied a prefix in",
                                  "a hook on a middle chunk"])
def test_a_cache_written_by_two_builds_or_a_static_forward_is_never_kept_or_used(when):
    """The weights change, or a forward hook makes one chunk run as static, while a prompt is being prefilled: no
    snapshot comes from that mixed cache, and a prompt whose copied prefix predates a change is prefilled whole, so
    every prompt gets the tokens and cache of a whole prefill under the weights of its own forwards."""
    native_or_skip()
    model = tiny_model("llama")
    drafter = tree_drafter(random_heads(model), TREE)
    engine = make_engine("native", model)
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(3, 300, (24,), generator=gen)
    second = torch.cat([first, torch.randint(3, 300, (6,), generator=gen)])
    batch = RunningBatch(model, drafter, engine)
    batch.prefix_store = store = PrefixStore(1 << 24, min_tokens=4)
    weight = model.model.layers[0].mlp.down_proj.weight

    def change(n):
        if n == 1:
            with torch.no_grad():
                weight.mul_(3.0)

    if when == "between a kept prompt's chunks":
        run_chunked(batch, first, 8, change)
        assert not store.entries  # its cache holds positions of two builds
        got = run_chunked(batch, second, 1000)
    elif when == "after begin copied a prefix in":
        run_chunked(batch, first, 1000)
        got = run_chunked(batch, second, 1000, lambda n: change(n + 1))  # begin copies 24, then the weights change
        assert store.hits == 0 and store.reused_tokens == 0
    else:
        hook = []

        def hooked(n):
            if n == 1:
                hook.append(model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: o * 5.0))
            elif n == 2:
                hook.pop().remove()

        with pytest.warns(RuntimeWarning, match="runs as 'static'"):
            run_chunked(batch, first, 8, hooked)
        assert not store.entries
        got = run_chunked(batch, second, 1000)
    whole = run_chunked(RunningBatch(model, drafter, engine), second, 1000)
    assert got[0] == whole[0] and torch.equal(got[1], whole[1])


def fake(length: int, nbytes: int):
    return SimpleNamespace(length=length, nbytes=nbytes)


def test_the_store_keeps_to_its_budget_and_finds_the_longest_shared_prefix():
    store = PrefixStore(budget_bytes=1000, min_tokens=3, max_tokens=8)
    states = torch.zeros(10, 2)  # 8 bytes a position
    a, b = torch.arange(10), torch.tensor([0, 1, 2, 3, 9, 9, 9, 9])
    assert not store.add(a, None, states)  # an engine without snapshots: nothing kept
    assert store.add(a, fake(8, 300), states)  # its first max_tokens: 300 + 64 bytes
    assert len(store.entries[0].tokens) == 8
    assert store.find(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8]))[0] == 8
    assert store.find(torch.arange(6))[0] == 5  # never the prompt's last position
    assert store.find(torch.tensor([0, 1, 5, 5]))[0] == 0  # below min_tokens
    assert store.add(b, fake(8, 300), states)
    assert store.find(torch.tensor([0, 1, 2, 3, 9, 9, 1]))[1].tokens[4] == 9
    store.find(torch.arange(9))  # a becomes the most recently used
    assert store.add(torch.tensor([7, 7, 7, 7]), fake(4, 500), states)  # over budget: b goes first, not a
    assert [e.tokens[0].item() for e in store.entries.values()] == [0, 7] and store.nbytes <= 1000
    assert store.add(torch.arange(9), fake(8, 100), states)  # covers a (0..7): a is dropped
    assert sorted(len(e.tokens) for e in store.entries.values()) == [4, 8] and store.nbytes == 532 + 164
    assert store.nbytes == sum(e.nbytes for e in store.entries.values())
    store.discard(store.entries[next(iter(store.entries))])
    assert store.nbytes == 164 and len(store.entries) == 1
    store.clear()
    assert store.nbytes == 0 and not store.entries and store.find(torch.arange(9)) == (0, None)
    assert not store.add(torch.arange(5), fake(5, 2000), states)  # alone over the budget
    for bad in ((-1, 8, 16), (float("nan"), 8, 16), (float("inf"), 8, 16), (10, 0, 16), (10, 8, 4)):
        with pytest.raises(ValueError, match="budget_bytes >= 0 and 1 <= min_tokens <= max_tokens"):
            PrefixStore(*bad)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), 1e308])
def test_the_server_refuses_a_prefix_budget_that_is_not_a_size(value):
    with pytest.raises(ValueError, match="prefix_cache_mb must be >= 0 and finite"):
        ServeConfig("m", prefix_cache_mb=value)


def test_the_scheduler_reuses_a_chat_prefix_and_answers_as_without():
    native_or_skip()
    base = tiny_model("llama")
    model = MedusaModel(base, random_heads(base), WIDE_TREE, tiny_tokenizer(), engine="native")
    system = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(6))
    prompts = [torch.cat([system, torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n))])
               for n in (3, 5, 8)]

    def answers(prefix_cache_bytes: int):
        scheduler = Scheduler(model, max_running=2, prefix_cache_bytes=prefix_cache_bytes)
        events = [[] for _ in prompts]
        for ids, sink in zip(prompts, events, strict=True):
            scheduler.submit(Job(ids, 8, resolve_decoding(), sink.append))
            while not sink or sink[-1][0] == "tokens":
                scheduler._round()
        return [[t for e in sink if e[0] == "tokens" for t in e[1]] for sink in events], scheduler.snapshot()

    with_prefix, counters = answers(1 << 22)
    without, off = answers(0)
    assert with_prefix == without
    assert counters["prefix_hits"] == 2 and counters["prefix_reused_tokens"] == 24
    assert 0 < counters["prefix_cache_bytes"] <= 1 << 22 and off["prefix_hits"] == 0
