"""``medusa serve``: the OpenAI-compatible server, talked to with the official ``openai`` client on a loopback port,
and its parts (continuous batching, the scheduler, streamed text, request validation) on tiny random models."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from test_decoding import WIDE_TREE, random_heads
from tiny import tiny_model, tiny_tokenizer

from medusa.decode.batch import RunningBatch
from medusa.decode.loop import decode_steps
from medusa.drafters.composite import tree_drafter
from medusa.model import MedusaModel
from medusa.serve.app import ServeConfig, Server
from medusa.serve.protocol import ApiError, parse_body
from medusa.serve.run import make_uvicorn_server
from medusa.serve.scheduler import Job, QueueFull, Scheduler, StepChoice
from medusa.serve.text import TextStream, decode

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[1]
KEY = "test-key"
NAME = "tiny-heads"


def tiny_medusa(seed: int = 0) -> MedusaModel:
    base = tiny_model("llama", seed)
    return MedusaModel(base, random_heads(base), WIDE_TREE, tiny_tokenizer(), engine="eager")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server on a free loopback port, in a thread of this process."""

    def __init__(self, model, **config):
        self.model, self.port = model, free_port()
        self.server = Server(model, ServeConfig(NAME, **config))
        self.uvicorn = make_uvicorn_server(self.server, port=self.port, drain_timeout_s=1)
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        while not self.uvicorn.started:
            assert self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=config.get("api_key") or "none",
                                    max_retries=0)

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served():
    running = Running(tiny_medusa(), api_key=KEY, max_running=8, max_waiting=16)
    yield running
    running.close()


def chat_ids(model, messages) -> torch.Tensor:
    from medusa.base import chat_prompt_ids

    return torch.tensor(chat_prompt_ids(model.tokenizer, messages))


def generated_text(model, ids: torch.Tensor, max_new: int, **settings) -> str:
    tokens, _ = model.generate(ids, max_new, **settings)
    return decode(model.tokenizer, tokens)


MESSAGES = [{"role": "user", "content": "hello world, how are you today?"}]


# -- end to end, with the openai client ------------------------------------------------------------------------------
def test_chat_plain_and_streamed_give_the_text_generate_gives(served):
    expected = generated_text(served.model, chat_ids(served.model, MESSAGES), 24, do_sample=False)
    r = served.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(chat_ids(served.model, MESSAGES))
    assert r.usage.model_extra["medusa_tau"] >= 1.0
    chunks = list(served.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens and not chunks[-1].choices


def test_completions_continue_raw_text_as_generate_does(served):
    prompt = "the quick brown fox"
    ids = torch.tensor(served.model.tokenizer(prompt)["input_ids"])
    r = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == generated_text(served.model, ids, 16, do_sample=False)
    streamed = "".join(c.choices[0].text for c in served.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert streamed == r.choices[0].text


def test_stop_sequence_ends_the_text_before_it(served):
    full = served.client.completions.create(model=NAME, prompt="hello world", max_tokens=30, temperature=0)
    text = full.choices[0].text
    printable = [i for i in range(2, len(text) - 2) if text[i:i + 2].isprintable() and text[i:i + 2].strip()]
    assert printable, f"no printable pair in {text!r}"
    stop = text[printable[len(printable) // 2]: printable[len(printable) // 2] + 2]
    expected = text[: text.find(stop)]
    r = served.client.completions.create(model=NAME, prompt="hello world", max_tokens=30, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    streamed = list(served.client.completions.create(model=NAME, prompt="hello world", max_tokens=30, temperature=0,
                                                     stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_same_seed_same_text_as_generate_samples(served):
    def ask():
        return served.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=20, temperature=0.9,
                                                     top_p=0.95, seed=7).choices[0].message.content

    first, second = ask(), ask()
    assert first == second
    expected = generated_text(served.model, chat_ids(served.model, MESSAGES), 20, do_sample=True, temperature=0.9,
                              top_p=0.95, seed=7)
    assert first == expected


def test_two_requests_sent_together_share_verify_forwards(served):
    before = served.health()["max_rows_per_forward"]
    assert before <= 1, "an earlier test already batched"
    prompts = ["the lazy dog", "Medusa heads predict"]
    barrier, out = threading.Barrier(2), {}

    def ask(p):
        barrier.wait()
        out[p] = served.client.completions.create(model=NAME, prompt=p, max_tokens=120, temperature=0)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert served.health()["max_rows_per_forward"] >= 2
    for p in prompts:  # each row still gets exactly its own greedy text
        ids = torch.tensor(served.model.tokenizer(p)["input_ids"])
        assert out[p].choices[0].text == generated_text(served.model, ids, 120, do_sample=False)


def wait_until_idle(running: Running) -> None:
    for _ in range(1000):  # the scheduler drops a cancelled row at its next step
        if running.health()["running"] == 0:
            break
        time.sleep(0.01)
    assert running.health()["running"] == 0


def test_disconnected_clients_free_their_slots_and_the_server_goes_on(served):
    body = {"model": NAME, "prompt": "hello", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until_idle(served)
    with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a non-streamed request
        httpx.post(served.url + "/v1/completions", json=body | {"stream": False}, timeout=0.05,
                   headers={"Authorization": f"Bearer {KEY}"})
    wait_until_idle(served)
    assert served.client.completions.create(model=NAME, prompt="hello", max_tokens=4, temperature=0).choices


BAD = [
    ({"prompt": "hi", "max_tokens": 4, "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": [2, 3]}, 400, "prompt"),  # token ids: special tokens (in a string they are text)
    ({"prompt": "hi " * 600}, 400, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_get_the_status_and_the_field_named(served, body, status, param):
    r = httpx.post(served.url + "/v1/completions", json={"model": NAME} | body,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_malformed_bodies_keys_and_content_are_refused_and_the_server_goes_on(served):
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    cases = [(b'{"model": "tiny-heads", "prompt": "hi"', auth, 400, "not valid JSON"),
             (b'{"model": "tiny-heads", "prompt": "\xff\xfe"}', auth, 400, "UTF-8"),
             (b"[1, 2]", auth, 400, "JSON object"),
             (b'{"model": "tiny-heads", "prompt": "ab\\udc80"}', auth, 400, "lone surrogate"),
             (json.dumps({"model": NAME, "prompt": "x" * (2 << 20)}).encode(), auth, 413, "limit"),
             (json.dumps({"model": NAME, "prompt": "hi"}).encode(), {"Authorization": "Bearer wrong"}, 401, "API key"),
             (json.dumps({"model": NAME, "prompt": "hi"}).encode(), {}, 401, "API key")]
    for raw, headers, status, words in cases:
        r = httpx.post(served.url + "/v1/completions", content=raw, headers=headers)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = httpx.post(served.url + "/v1/chat/completions", headers=auth, json={
        "model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in served.client.models.list().data] == [NAME]
    assert served.client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0).choices


def test_messages_the_chat_template_rejects_are_a_400():
    model = tiny_medusa()
    model.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                     "{{ raise_exception('system messages are not supported') }}{% endif %}"
                                     "{{ m['content'] }}{% endfor %}")
    server = Server(model, ServeConfig(NAME))
    body = json.dumps({"model": NAME, "messages": [{"role": "system", "content": "x"}]}).encode()
    with pytest.raises(ApiError, match="system messages are not supported") as e:
        server.prepare(parse_body(body, "chat.completion", 1 << 20))
    assert (e.value.status, e.value.param) == (400, "messages")


def test_a_flood_beyond_the_queue_gets_429_and_the_rest_is_answered():
    running = Running(tiny_medusa(seed=1), max_running=1, max_waiting=1)
    try:
        statuses = []

        def ask():
            r = httpx.post(running.url + "/v1/completions", timeout=60,
                           json={"model": NAME, "prompt": "hello", "max_tokens": 60, "temperature": 0})
            statuses.append((r.status_code, r.json()))

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(s for s, _ in statuses)
        assert len(codes) == 8 and set(codes) <= {200, 429} and 429 in codes and 200 in codes
        assert all(b["error"]["code"] == "queue_full" for s, b in statuses if s == 429)
        assert running.client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0).choices
    finally:
        running.close()


# -- the parts --------------------------------------------------------------------------------------------------------
def alone(model, heads, ids, max_new):
    from medusa.decode.loop import medusa_generate

    return medusa_generate(model, heads, ids, WIDE_TREE, max_new)[0]


def test_rows_join_a_running_batch_and_each_stays_exact():
    model = tiny_model("llama")
    heads = random_heads(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (7, 19, 12)]
    batch = RunningBatch(model, tree_drafter(heads, WIDE_TREE))
    out = {k: [] for k in range(3)}
    budgets = {0: 30, 1: 12, 2: 25}
    out[0] += batch.join(0, prompts[0], budgets[0], set()).tokens
    for step in range(60):
        if step == 3:
            out[1] += batch.join(1, prompts[1], budgets[1], set()).tokens
        if step == 5:
            out[2] += batch.join(2, prompts[2], budgets[2], set()).tokens
        if not batch.keys:
            break
        for key, s in batch.step(plain=step % 3 == 1):  # plain steps between speculative ones
            out[key] += s.tokens
    assert batch.max_rows == 3 and not batch.keys
    for k, ids in enumerate(prompts):
        assert out[k] == alone(model, heads, ids, budgets[k])


def test_a_row_that_leaves_does_not_disturb_the_others():
    model = tiny_model("qwen2")
    heads = random_heads(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (9, 15)]
    batch = RunningBatch(model, tree_drafter(heads, WIDE_TREE))
    tokens = [batch.join(k, p, 20, set()).tokens for k, p in enumerate(prompts)]
    for _ in range(2):
        for key, s in batch.step():
            tokens[key] += s.tokens
    batch.leave([0])
    while batch.keys:
        for key, s in batch.step():
            tokens[key] += s.tokens
    assert tokens[1] == alone(model, heads, prompts[1], 20)


def test_sampling_and_greedy_requests_share_every_verify_forward_and_all_advance_every_round():
    from medusa.decode.logits_process import resolve_decoding

    model = tiny_medusa()
    scheduler = Scheduler(model, max_running=8, max_waiting=8, speculation="on")
    calls = []
    forward_rows = model.engine.forward_rows
    model.engine.forward_rows = lambda *a, **k: calls.append(a[0].shape[0]) or forward_rows(*a, **k)
    rounds, jobs, events = [], [], {}
    g = torch.Generator().manual_seed(2)
    for i, (sample, acceptance) in enumerate([(False, None), (True, "rejection"), (False, None),
                                              (True, "typical"), (False, None)]):
        decoding = resolve_decoding(None, do_sample=sample, temperature=0.8 if sample else None, seed=i,
                                    **({"acceptance": acceptance} if acceptance else {}))
        events[i] = []
        job = Job(torch.randint(3, 300, (8 + i,), generator=g), 20, decoding, events[i].append)
        jobs.append(job)
        scheduler.submit(job)
    scheduler._admit()
    scheduler._prefill()
    sizes, sampling = [], []
    try:
        while scheduler.jobs:
            before = [len(events[i]) for i in range(len(jobs))]
            running = [i for i, j in enumerate(jobs) if not j.stats.stopped_by]
            scheduler._drop_cancelled()
            sizes.append(len(scheduler.jobs))
            sampling.append(sum(j.decoding.do_sample for j in scheduler.jobs.values()))
            scheduler._batched_step()
            rounds.append(all(len(events[i]) > before[i] for i in running))
    finally:
        del model.engine.forward_rows
    assert all(rounds) and sizes[0] == 5
    # one verify forward per round holds every row, sampling rows included (one row alone: the one-row forward)
    assert scheduler.batch.forwards == len(sizes) and calls == [n for n in sizes if n > 1]
    assert scheduler.sampling_row_steps == sum(sampling) and sampling[0] == 2
    assert all(e[-1] == ("done", "length") for e in events.values())
    for i, job in enumerate(jobs):  # each row decodes as its request alone would
        alone = [t for s in decode_steps(model.base, model.drafter, job.ids, 20, scheduler.stop_ids, None,
                                         job.decoding, model.engine) for t in s.tokens]
        assert [t for e in events[i] if e[0] == "tokens" for t in e[1]] == alone, i


def serve_events(scheduler: Scheduler, jobs: list) -> list[list[int]]:
    """Run ``jobs`` through ``scheduler``'s rounds to the end; each job's streamed tokens."""
    events = []
    for job in jobs:
        events.append([])
        job.deliver = events[-1].append
        scheduler.submit(job)
    while scheduler.waiting or scheduler.joining or scheduler.jobs:
        scheduler._admit()
        scheduler._prefill()
        if scheduler.jobs:
            scheduler._batched_step()
    return [[t for e in ev if e[0] == "tokens" for t in e[1]] for ev in events]


def test_a_seeded_coupled_request_gets_the_same_tokens_whatever_the_load_or_speculation():
    """With ``acceptance="coupled"`` a seeded request's tokens are its plain samples: served alone or beside other
    requests, speculative or plain (rejection sampling's would follow the rows beside it)."""
    from medusa.decode.logits_process import resolve_decoding

    model = tiny_medusa()
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 300, (6 + 3 * i,), generator=g) for i in range(4)]
    coupled = resolve_decoding(None, do_sample=True, temperature=0.9, top_k=0, seed=11, acceptance="coupled")
    others = [resolve_decoding(None, do_sample=True, temperature=0.8, seed=i) for i in range(2)]
    others.append(resolve_decoding(None))  # a greedy row

    def job(i: int):
        return Job(prompts[i], 20, coupled if i == 0 else others[i - 1], print)

    alone_plain = serve_events(Scheduler(model, speculation="off"), [job(0)])[0]
    alone = serve_events(Scheduler(model, speculation="on"), [job(0)])[0]
    loaded = serve_events(Scheduler(model, speculation="on"), [job(i) for i in range(4)])[0]
    assert len(alone_plain) == 20 and alone == alone_plain and loaded == alone_plain


def test_where_a_prompt_is_cut_into_chunks_does_not_depend_on_the_requests_beside_it():
    """A 20-token prompt is prefilled in chunks of 8, 8 and 4 whether it joins alone or after a 3-token prompt
    that takes part of a round's budget (a chunk boundary changes the logits' rounding)."""
    from medusa.decode.logits_process import resolve_decoding

    model = tiny_medusa()
    g = torch.Generator().manual_seed(8)
    short, long = torch.randint(3, 300, (3,), generator=g), torch.randint(3, 300, (20,), generator=g)
    chunks = {}
    for name, prompts in (("alone", [long]), ("beside", [short, long])):
        scheduler = Scheduler(model, speculation="on", prefill_chunk=8)
        prefill = scheduler.batch.prefill
        cuts = []

        def spy(joining, tokens, prefill=prefill, cuts=cuts):
            if len(joining.prompt) == 20:
                cuts.append(tokens)
            return prefill(joining, tokens)

        scheduler.batch.prefill = spy
        serve_events(scheduler, [Job(p, 4, resolve_decoding(None), print) for p in prompts])
        chunks[name] = cuts
    assert chunks["alone"] == chunks["beside"] == [8, 8, 4]


def test_a_long_prompt_joins_in_chunks_while_the_running_rows_step():
    """Chunked prefill: a 40-token prompt joins over 5 rounds of 8 tokens, the running request advancing every one
    of them, and both decode as their requests alone would; a cancelled joining request frees its slot."""
    from medusa.decode.logits_process import resolve_decoding

    model = tiny_medusa()
    scheduler = Scheduler(model, max_running=4, max_waiting=4, speculation="on", prefill_chunk=8)
    g = torch.Generator().manual_seed(5)
    events = {"short": [], "long": [], "gone": []}
    jobs = {name: Job(torch.randint(3, 300, (n,), generator=g), budget, resolve_decoding(None), events[name].append)
            for name, n, budget in (("short", 6, 40), ("long", 40, 12), ("gone", 30, 12))}
    scheduler.submit(jobs["short"])
    scheduler._round()  # 6 tokens: prefilled in one chunk and stepped at once
    assert len(scheduler.jobs) == 1
    scheduler.submit(jobs["long"])
    scheduler.submit(jobs["gone"])
    joined_after = None
    for r in range(1, 100):
        before, joining = len(events["short"]), bool(scheduler.joining)
        scheduler._round()
        if joining:
            assert len(events["short"]) > before  # the running request steps while the long prompt is prefilled
        if joined_after is None and id(jobs["long"]) in scheduler.jobs:
            joined_after = r
            jobs["gone"].cancelled = True
        if not scheduler.jobs and not scheduler.joining:
            break
    assert joined_after == 5 and not scheduler.joining
    assert events["gone"] == [("error", "the request was cancelled", 499)]
    for name in ("short", "long"):
        job = jobs[name]
        alone = [t for s in decode_steps(model.base, model.drafter, job.ids, job.max_new_tokens, scheduler.stop_ids,
                                         None, job.decoding, model.engine) for t in s.tokens]
        assert [t for e in events[name] if e[0] == "tokens" for t in e[1]] == alone, name


def test_a_failing_step_ends_its_requests_with_an_error_and_the_scheduler_goes_on():
    from medusa.decode.logits_process import resolve_decoding

    scheduler = Scheduler(tiny_medusa(), max_running=4)
    events = {0: [], 1: []}
    step = scheduler.batch.step

    def broken(plain=False):
        raise RuntimeError("out of memory")

    scheduler.batch.step = broken
    scheduler.submit(Job(torch.tensor([5, 6, 7, 8]), 6, resolve_decoding(), events[0].append))
    scheduler._round()
    assert events[0][-1] == ("error", "decoding failed: out of memory", 500) and not scheduler.batch.keys
    scheduler.batch.step = step
    scheduler.submit(Job(torch.tensor([5, 6, 7, 8]), 6, resolve_decoding(), events[1].append))
    while not events[1] or events[1][-1][0] == "tokens":
        scheduler._round()
    assert events[1][-1] == ("done", "length")


def test_the_waiting_queue_is_bounded():
    model = tiny_medusa()
    scheduler = Scheduler(model, max_running=1, max_waiting=2)
    from medusa.decode.logits_process import resolve_decoding

    job = Job(torch.tensor([5, 6, 7]), 4, resolve_decoding(), lambda e: None)
    scheduler.submit(job)
    scheduler.submit(job)
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        scheduler.submit(job)


def test_step_choice_steps_aside_where_plain_is_faster():
    choice = StepChoice("auto", warm=2, explore_every=8)
    for _ in range(40):
        for batch, spec_rate, plain_rate in ((1, 30.0, 20.0), (8, 40.0, 80.0)):
            plain = choice.plain(batch)
            choice.record(batch, plain, 100, 100 / (plain_rate if plain else spec_rate))
    assert choice.count[(8, True)] > 3 * choice.count[(8, False)]
    assert choice.count[(1, False)] > 3 * choice.count[(1, True)]
    cold = StepChoice("auto", warm=3)  # a first speculative step slowed by new kernels does not decide
    for rate_spec, rate_plain in ((5.0, 40.0), (60.0, 40.0), (60.0, 40.0)):
        cold.record(4, False, 60, 60 / rate_spec)
        cold.record(4, True, 40, 40 / rate_plain)
    assert not cold.plain(4)
    learnt = StepChoice("auto", warm=2, explore_every=8)  # plain won at 4 rows: 8 rows start plain
    for _ in range(2):
        learnt.record(4, False, 40, 1.0)
        learnt.record(4, True, 80, 1.0)
    picks = []
    for _ in range(8):
        learnt.record(8, True, 80, 1.0)
        picks.append(learnt.plain(8))
    assert learnt.guess(8) is True and learnt.guess(2) is None and picks.count(True) == 7
    assert StepChoice("off").plain(1) and not StepChoice("on").plain(64)
    with pytest.raises(ValueError, match="speculation must be one of"):
        StepChoice("sometimes")


def test_step_choice_starts_an_unmeasured_batch_size_from_the_profiles_costs():
    """With a cost model, a batch size never measured starts in the mode the costs predict from the speculative
    steps seen so far (tau, tree size), and measurements that contradict the prediction take over."""
    cost = lambda m: 0.01 + 0.001 * m  # noqa: E731 - a forward's seconds over m new tokens
    choice = StepChoice("auto", warm=2, explore_every=8, forward_s=cost)
    assert choice.prior(16) is None  # no speculative step seen yet: nothing to predict from
    for _ in range(3):
        choice.record(1, False, 2, cost(4), nodes=4)  # tau 2 with 4-node trees at one row
    assert choice.prior(2) is False  # 2 rows: 4 tokens / cost(8) beats 2 tokens / cost(2)
    assert choice.prior(64) is True  # 64 rows: 128 tokens / cost(256) loses to 64 tokens / cost(64)
    picks = [choice.plain(64)]
    for _ in range(7):
        choice.record(64, picks[-1], 64, cost(64)) if picks[-1] else choice.record(64, False, 128, cost(256), 256)
        picks.append(choice.plain(64))
    assert picks[0] and picks.count(True) >= 6  # plain from the first step at 64 rows, speculation now and then
    blind = StepChoice("auto", warm=2)  # the same steps without a cost model: speculative first, to measure
    for _ in range(3):
        blind.record(1, False, 2, cost(4), nodes=4)
    assert blind.prior(64) is None and not blind.plain(64)
    wrong = StepChoice("auto", warm=2, explore_every=4, forward_s=cost)
    for _ in range(3):
        wrong.record(1, False, 2, cost(4), nodes=4)
    for _ in range(40):  # the costs said plain at 64 rows; measured, speculation is twice as fast there
        plain = wrong.plain(64)
        wrong.record(64, plain, 64 if plain else 128, cost(64), None if plain else 256)
    assert wrong.count[(64, False)] > wrong.count[(64, True)]


def test_streamed_text_never_splits_a_character_and_holds_back_a_partial_stop():
    tokenizer = tiny_tokenizer()
    text = "héllo wörld, 日本語 😀 done"
    ids = tokenizer(text)["input_ids"]
    stream = TextStream(tokenizer)
    pieces = [stream.add([t]) for t in ids] + [stream.finish()]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    stream = TextStream(tokenizer, stop=["wörld", "zzz"])
    pieces, sent = [], ""
    for t in ids:
        pieces.append(stream.add([t]))
        sent += pieces[-1]
        assert not sent.endswith(("w", "wö")) or stream.stopped
    assert sent + stream.finish() == "héllo " and stream.stopped
    stream = TextStream(tokenizer, stop=["wörx"])  # a partial match that never resolves is sent in the end
    assert "".join([stream.add([t]) for t in ids] + [stream.finish()]) == text


def test_the_base_generation_config_is_honoured_as_generate_honours_it():
    model = tiny_medusa(seed=3)
    model.base.generation_config.repetition_penalty = 1.5  # a logits processor, applied to the request's own row
    running = Running(model)
    try:
        ids = torch.tensor(model.tokenizer("hello world")["input_ids"])
        r = running.client.completions.create(model=NAME, prompt="hello world", max_tokens=30, temperature=0)
        assert r.choices[0].text == generated_text(model, ids, 30, do_sample=False)
        assert r.choices[0].text != decode(model.tokenizer, alone(model.base, model.heads, ids, 30))
        assert running.health()["batched_forwards"] > 0
    finally:
        running.close()
    model.base.generation_config.num_beams = 2
    with pytest.raises(ValueError, match="num_beams=2"):
        Server(model, ServeConfig(NAME))


def test_server_refuses_a_model_without_tokenizer_and_bad_config():
    model = tiny_medusa()
    model.tokenizer = None
    with pytest.raises(ValueError, match="tokenizer"):
        Server(model, ServeConfig(NAME))
    with pytest.raises(ValueError, match="speculation"):
        ServeConfig(NAME, speculation="maybe")



def test_a_request_past_its_timeout_or_the_drain_ends_with_an_error():
    running = Running(tiny_medusa(seed=2), request_timeout_s=0.05)
    try:
        body = {"model": NAME, "prompt": "hello", "max_tokens": 400, "temperature": 0}
        r = httpx.post(running.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        running.server.config.request_timeout_s = 600.0
        with httpx.stream("POST", running.url + "/v1/completions", json=body | {"stream": True}, timeout=60) as r:
            it = r.iter_lines()
            lines = [next(it)]
            running.server.drain(0.0)  # as SIGTERM does: what is still running ends now, with an error event
            lines += [line for line in it if line]
        assert lines[-1] == "data: [DONE]"
        assert "shutting down" in lines[-2] or json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        r = httpx.post(running.url + "/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    finally:
        running.close()


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_and_exits(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tiny import save_cli_files

    base, _ = save_cli_files(tmp_path, [{"prompt": "hi"}])
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from medusa.cli import main; sys.exit(main())", "serve", "--base",
           str(base), "--heads", str(tmp_path / "heads"), "--engine", "eager", "--threads", "1", "--port", str(port),
           "--drain-timeout-s", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "heads", "prompt": "hello", "max_tokens": 480, "temperature": 0, "stream": True}
        upload = socket.create_connection(("127.0.0.1", port), timeout=60)  # half-sent: it must not hold the exit
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000\r\n\r\n{\"model\": ")
        headers = socket.create_connection(("127.0.0.1", port), timeout=60)  # still sending its headers
        headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # finished within the drain, or ended with an error event
        assert proc.wait(120) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
        assert upload.recv(65536).startswith(b"HTTP/1.1 503") and headers.recv(65536) == b""
        upload.close()
        headers.close()
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_idle_scheduler_hands_free_memory_back_once_per_idle_spell():
    from medusa.decode.logits_process import resolve_decoding

    def served(scheduler, jobs: int) -> None:
        for _ in range(jobs):
            done = threading.Event()
            scheduler.submit(Job(torch.tensor([5, 6, 7, 8]), 4, resolve_decoding(),
                                 lambda e, done=done: done.set() if e[0] != "tokens" else None))
            assert done.wait(30)

    def releases_after(scheduler, seconds: float) -> int:
        time.sleep(seconds)
        return scheduler.memory_releases

    model = tiny_medusa()
    scheduler = Scheduler(model, max_running=2, idle_release_s=0.05)
    scheduler.start()
    try:
        served(scheduler, 1)
        first = releases_after(scheduler, 0.5)
        assert first >= 1 and releases_after(scheduler, 0.3) == first  # once per spell, not every wait
        served(scheduler, 1)
        assert releases_after(scheduler, 0.5) == first + 1
    finally:
        scheduler.stop(10)
    never = Scheduler(model, max_running=2, idle_release_s=0)
    never.start()
    try:
        served(never, 1)
        assert releases_after(never, 0.3) == 0
    finally:
        never.stop(10)
    with pytest.raises(ValueError, match="idle_release_s"):
        ServeConfig(NAME, idle_release_s=float("nan"))
    with pytest.raises(ValueError, match="idle_release_s"):
        Scheduler(model, idle_release_s=-1)


RELEASE_SCRIPT = """
import os, sys, time
import torch
from medusa.engines.threads import loaded_openmp_runtimes, release_openmp_threads

def count():
    return len(os.listdir("/proc/self/task"))

if not any("gomp" in path for path in loaded_openmp_runtimes()):
    print("no-gomp"); sys.exit(0)
torch.set_num_threads(2)
a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
before = a @ a  # a parallel region: this thread's pool has its one worker
pooled = count()
released = release_openmp_threads()
deadline = time.monotonic() + 5
while count() != pooled - 1 and time.monotonic() < deadline:
    time.sleep(0.01)  # the worker leaves after the pause's barrier
freed = count()
same = torch.equal(a @ a, before)
print(released, pooled, freed, count(), same)
"""


def test_the_loading_threads_openmp_workers_are_freed_and_a_later_parallel_region_starts_them_again(tmp_path):
    """release_openmp_threads frees the calling thread's libgomp workers (a thread fewer in a fresh process; left in
    place, a decode thread's own pool makes libgomp's waiting workers sleep at every barrier), the next parallel
    region in that thread starts them again with the same result; maps without a runtime give none."""
    import subprocess
    import sys

    from medusa.engines.threads import loaded_openmp_runtimes

    out = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2", "OMP_DYNAMIC": "false",
                              "PYTHONPATH": str(REPO)})  # this checkout's code, whatever the working directory
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-gomp":
        pytest.skip("no GNU OpenMP runtime loaded (its worker pools are what this frees)")
    released, pooled, freed, again, same = out.stdout.split()
    assert int(released) >= 1 and int(freed) == int(pooled) - 1  # the one worker is gone
    assert int(again) == int(pooled) and same == "True"  # started again, the same product
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libgompx.txt\n7f01-7f02 rw-p 00000000 00:00 0\n"
                    "7f02-7f03 r-xp 00000000 08:01 2 /opt/lib/libomp.so.5 (deleted)\n"
                    "7f03-7f04 r-xp 00000000 08:01 3 /torch/lib/libgomp-a34b3233.so.1\n"
                    "7f04-7f05 r--p 00000000 08:01 3 /torch/lib/libgomp-a34b3233.so.1\n")
    assert loaded_openmp_runtimes(maps) == ["/opt/lib/libomp.so.5", "/torch/lib/libgomp-a34b3233.so.1"]
    maps.write_bytes(b"7f00-7f01 r--p 00000000 08:01 1 /weights/w-\xe9.bin\n"  # a name that is not UTF-8
                     b"7f01-7f02 r-xp 00000000 08:01 2 /torch/lib/libgomp.so.1\n")
    assert loaded_openmp_runtimes(maps) == ["/torch/lib/libgomp.so.1"]
    assert loaded_openmp_runtimes(tmp_path / "missing") == []


def test_the_scheduler_frees_the_starting_threads_openmp_workers_before_its_thread_starts(monkeypatch):
    import medusa.serve.scheduler as scheduler_module

    calls = []
    scheduler = Scheduler(tiny_medusa(), max_running=2)
    monkeypatch.setattr(scheduler_module, "release_openmp_threads",
                        lambda: calls.append((threading.current_thread(), scheduler._thread)))
    scheduler.start()
    try:
        assert calls == [(threading.current_thread(), None)]  # in the starting thread, before its own exists
    finally:
        scheduler.stop(10)

    def broken():
        raise UnicodeDecodeError("utf-8", b"\xe9", 0, 1, "a mapped file's name")

    monkeypatch.setattr(scheduler_module, "release_openmp_threads", broken)
    scheduler = Scheduler(tiny_medusa(), max_running=2)
    scheduler.start()  # a speed-up only: the scheduler serves without it
    try:
        assert scheduler._thread.is_alive()
    finally:
        scheduler.stop(10)
