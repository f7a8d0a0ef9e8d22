"""``medusa distill --server``: self-distillation through an OpenAI-compatible server. Against ``medusa serve`` on a
loopback port (the records equal the in-process distillation's), and against a scripted server for every fault:
down, 401, 404, 5xx, timeouts, malformed or cut-off answers, another model's tokens."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_decoding import WIDE_TREE, random_heads
from test_serve import Running
from test_train import write_chats
from tiny import save_tiny, tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa.cli import main
from medusa.model import MedusaModel
from train.data import Conversation
from train.distill_server import MalformedAnswer, ServerClient, ServerError, ServerSettings, distill_through_server

pytest.importorskip("httpx")

KEY = "distill-key"


def records(path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def served_base(tmp_path_factory):
    """A tiny base folder, and ``medusa serve`` (heads on top, greedy: exactly the base's tokens) serving it."""
    root = tmp_path_factory.mktemp("served")
    base = save_tiny(root / "base", "llama")
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    running = Running(MedusaModel(model, random_heads(model), WIDE_TREE, AutoTokenizer.from_pretrained(base),
                                  engine="eager"), api_key=KEY, max_running=4, max_waiting=32)
    (root / "key").write_text(KEY + "\n")
    yield base, running, root / "key"
    running.close()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_records_through_medusa_serve_equal_the_in_process_distillation(served_base, tmp_path, endpoint, capsys):
    base, running, key = served_base
    chats = write_chats(tmp_path / "chats.jsonl", n=10)
    common = ["distill", "--base", str(base), "--data", str(chats), "--held-out-fraction", "0.2",
              "--validation-fraction", "0.2", "--seed", "0", "--max-new-tokens", "6"]
    assert main([*common, "--out-dir", str(tmp_path / "here"), "--batch-size", "1"]) == 0
    assert main([*common, "--out-dir", str(tmp_path / "there"), "--server", running.url, "--endpoint", endpoint,
                 "--api-key-file", str(key), "--concurrency", "3", "--check-prompts", "3"]) == 0
    out = capsys.readouterr().out
    assert "answer tokens/s" in out and "0 malformed" in out
    for name in ("distilled_train.jsonl", "distilled_validation.jsonl", "distilled_held_out.jsonl"):
        here, there = records(tmp_path / "here" / name), records(tmp_path / "there" / name)
        assert here and here == there, name
    before = (tmp_path / "there" / "distilled_train.jsonl").read_text()
    assert main([*common, "--out-dir", str(tmp_path / "there"), "--server", running.url, "--api-key-file", str(key),
                 "--check-prompts", "0"]) == 0  # all done: nothing asked, nothing written again
    assert (tmp_path / "there" / "distilled_train.jsonl").read_text() == before


def test_a_wrong_key_is_named_and_nothing_is_written(served_base, tmp_path):
    base, running, _ = served_base
    (tmp_path / "bad").write_text("not-the-key\n")
    chats = write_chats(tmp_path / "chats.jsonl", n=4)
    with pytest.raises(ServerError, match="401.*API key"):
        main(["distill", "--base", str(base), "--data", str(chats), "--out-dir", str(tmp_path / "o"), "--server",
              running.url, "--api-key-file", str(tmp_path / "bad"), "--check-prompts", "0", "--retries", "0"])
    assert not any(p.read_text() for p in (tmp_path / "o").glob("*.jsonl"))


# -- a scripted server -----------------------------------------------------------------------------------------------
class Scripted:
    """An HTTP server on a loopback port whose answer to the n-th completion request is ``script(n, body)``:
    ``(status, body text)``, or ``("sleep", seconds)`` before answering 200."""

    def __init__(self, script):
        self.script, self.calls, self.lock = script, 0, threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.reply(200, json.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    n, owner.calls = owner.calls, owner.calls + 1
                status, text = owner.script(n, body)
                if status == "sleep":
                    import time

                    time.sleep(text)
                    status, text = 200, answer([5, 6, 7])
                self.reply(status, text)

            def reply(self, status, text):
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def answer(ids, finish="length", text="x"):
    return json.dumps({"choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]})


CONVS = [Conversation(f"c{i}", [{"role": "user", "content": f"question number {i} about the lazy dog"}])
         for i in range(6)]


def client_for(url, **settings):
    settings = {"retries": 2, "backoff_s": 0.01, "timeout_s": 5.0, "concurrency": 2, **settings}
    return ServerClient(ServerSettings(url, **settings), {1}, tiny_tokenizer())


def scripted_run(tmp_path, script, **settings):
    server = Scripted(script)
    try:
        return server, distill_through_server(client_for(server.url, **settings), tiny_tokenizer(), CONVS,
                                              tmp_path / "d.jsonl", max_new_tokens=3)
    finally:
        server.close()


def test_5xx_and_429_are_retried_with_backoff_and_every_answer_arrives(tmp_path):
    def script(n, body):
        assert body["temperature"] == 0.0 and body["max_tokens"] == 3 and isinstance(body["prompt"], list)
        return (500, "oops") if n == 0 else (429, "slow down") if n == 1 else (200, answer([5, 6, 7]))

    server, result = scripted_run(tmp_path, script)
    assert result["written"] == 6 and result["malformed"] == 0 and server.calls == 8
    assert {r["id"]: r["response_ids"] for r in records(tmp_path / "d.jsonl").values()} == \
        {c.id: [5, 6, 7] for c in CONVS}


def test_a_server_failing_mid_run_keeps_what_arrived_and_a_rerun_resumes(tmp_path):
    with pytest.raises(ServerError, match="failed 3 times.*500.*a rerun goes on"):
        scripted_run(tmp_path, lambda n, body: (200, answer([5, 6, 7])) if n < 4 else (500, "down"),
                     concurrency=1)  # chunks of 4: the first is written, the second fails
    assert len(records(tmp_path / "d.jsonl")) == 4
    server, result = scripted_run(tmp_path, lambda n, body: (200, answer([8, 9, 10])))
    assert result["written"] == 2 and server.calls == 2 and len(records(tmp_path / "d.jsonl")) == 6


@pytest.mark.parametrize("status,match", [(401, "401.*API key"), (404, "404.*--server-model"), (400, "400")])
def test_client_errors_stop_at_once(tmp_path, status, match):
    server = Scripted(lambda n, body: (status, '{"error": {"message": "no"}}'))
    try:
        with pytest.raises(ServerError, match=match):
            distill_through_server(client_for(server.url, token_ids=False), tiny_tokenizer(), CONVS,
                                   tmp_path / "d.jsonl", max_new_tokens=3)
        assert server.calls <= 2 * 4  # no retries: one call per prompt of the first chunk at most
    finally:
        server.close()


def test_a_server_that_is_down_or_too_slow_is_retried_then_named(tmp_path):
    with pytest.raises(ServerError, match="failed 2 times.*ConnectError"):
        distill_through_server(client_for("http://127.0.0.1:9", retries=1), tiny_tokenizer(), CONVS,
                               tmp_path / "d.jsonl", max_new_tokens=3)
    with pytest.raises(ServerError, match="no answer within 0.2 s"):
        scripted_run(tmp_path, lambda n, body: ("sleep", 1.0), timeout_s=0.2, retries=1)
    assert not (tmp_path / "d.jsonl").read_text()


@pytest.mark.parametrize("bad", ["{not json", answer([5, 6, 7], finish=None), answer([5], finish="length"),
                                 json.dumps({"choices": []})])
def test_malformed_or_cut_off_answers_are_not_written_and_asked_again(tmp_path, bad, caplog):
    server, result = scripted_run(tmp_path, lambda n, body: (200, bad) if n % 2 == 0 else (200, answer([5, 6, 7])),
                                  concurrency=1)
    assert result["written"] == 3 and result["malformed"] == 3
    assert "not written" in caplog.text
    server, result = scripted_run(tmp_path, lambda n, body: (200, answer([5, 6, 7])))
    assert result["written"] == 3 and len(records(tmp_path / "d.jsonl")) == 6


def test_a_server_without_token_ids_is_tokenized_again_and_its_stop_appended(tmp_path):
    tokenizer = tiny_tokenizer()
    text = "the lazy dog"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]

    def script(n, body):
        if body.get("return_token_ids"):
            return 400, '{"error": {"message": "unrecognized request argument supplied: return_token_ids"}}'
        return 200, json.dumps({"choices": [{"text": text, "finish_reason": "stop"}]})

    server = Scripted(script)
    try:
        result = distill_through_server(client_for(server.url), tokenizer, CONVS[:2], tmp_path / "d.jsonl",
                                        max_new_tokens=len(ids) + 1)
    finally:
        server.close()
    assert result["written"] == 2
    assert [r["response_ids"] for r in records(tmp_path / "d.jsonl").values()] == [ids + [1], ids + [1]]


def test_another_models_tokens_fail_the_token_check_and_nothing_is_written(tmp_path):
    from tiny import tiny_model

    server = Scripted(lambda n, body: (200, answer([9, 9, 9, 9])))
    try:
        with pytest.raises(ValueError, match="not --base's greedy tokens.*another model"):
            distill_through_server(client_for(server.url), tiny_tokenizer(), CONVS, tmp_path / "d.jsonl",
                                   max_new_tokens=4, check_model=tiny_model("llama", seed=3), check_prompts=4)
    finally:
        server.close()
    assert not (tmp_path / "d.jsonl").read_text()


def test_an_interrupted_line_is_cut_off_before_the_next_record(tmp_path):
    out = tmp_path / "d.jsonl"
    out.write_text(json.dumps({"id": "c0", "prompt_ids": [1], "response_ids": [2]}) + '\n{"id": "c1", "prom')
    scripted_run(tmp_path, lambda n, body: (200, answer([5, 6, 7])))
    lines = out.read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(line) for line in lines)


def test_settings_and_answers_refuse_bad_values():
    with pytest.raises(ValueError, match="endpoint"):
        ServerSettings("http://x", endpoint="embeddings")
    with pytest.raises(ValueError, match="concurrency"):
        ServerSettings("http://x", concurrency=0)
    with pytest.raises(ValueError, match="http://"):
        ServerSettings("127.0.0.1:8000")
    assert ServerSettings("http://h:1/").url == "http://h:1/v1" == ServerSettings("http://h:1/v1").url
    client = client_for("http://127.0.0.1:9")
    with pytest.raises(MalformedAnswer, match="empty"):
        client.answer_ids(answer([], finish="length"), 0)
    assert client.answer_ids(answer([4, 1], finish="stop"), 8) == [4, 1]  # the stop is not appended twice
    assert torch.tensor(client.answer_ids(answer([4], finish="stop"), 8)).tolist() == [4, 1]


def test_serve_returns_token_ids_only_without_stream():
    from medusa.serve.protocol import ApiError, parse_body

    body = {"model": "m", "prompt": [3, 4], "return_token_ids": True}
    assert parse_body(json.dumps(body).encode(), "text_completion", 10_000).return_token_ids
    with pytest.raises(ApiError, match="only without 'stream'") as e:
        parse_body(json.dumps({**body, "stream": True}).encode(), "text_completion", 10_000)
    assert e.value.status == 400
