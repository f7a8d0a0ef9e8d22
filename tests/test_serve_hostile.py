"""``medusa serve`` against hostile clients: bodies and headers bounded as they arrive, every bad input a 4xx in
OpenAI's error shape, nothing that grows with the input on the event loop, safe defaults (Host, content type, keys,
CORS), user content kept as text, connection hygiene and OpenAI's conventions. Raw sockets where a client library
would not send what a hostile client does."""

from __future__ import annotations

import json
import socket

import pytest
from test_serve import KEY, NAME, Running, tiny_medusa

from medusa.serve.protocol import COMPLETION, ApiError, parse_body

httpx = pytest.importorskip("httpx")

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def hostile():
    running = Running(tiny_medusa(), api_key=KEY, max_running=4, max_waiting=8, max_body_bytes=4096,
                      max_header_bytes=8192, read_timeout_s=1.0)
    yield running
    running.close()


def raw_exchange(running: Running, head: bytes, parts: list[bytes] = (), timeout: float = 10.0) -> tuple[int, dict,
                                                                                                        dict]:
    """Send ``head`` then each of ``parts`` on one connection (stopping when the server closes it) and read the
    answer: ``(status, headers, JSON body)``. The client never finishes on its own: what it did not send, the server
    did not wait for."""
    with socket.create_connection(("127.0.0.1", running.port), timeout=timeout) as s:
        s.sendall(head)
        for part in parts:
            try:
                s.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + content_length(data):
            try:
                more = s.recv(65536)
            except ConnectionResetError:
                break
            if not more:
                break
            data += more
    head_text, _, body = data.partition(b"\r\n\r\n")
    lines = head_text.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def request_head(running: Running, path: str = "/v1/completions", extra: str = "", method: str = "POST") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{running.port}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def assert_error_shape(body: dict) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    return error


# -- bounded before read ---------------------------------------------------------------------------------------------
def test_a_chunked_body_over_the_limit_is_refused_before_the_client_finishes(hostile):
    # 64 chunks of 1 KiB (16x the 4 KiB limit) and never the closing chunk: the answer comes all the same
    parts = [chunk(b'{"model": "tiny-heads", "prompt": "' + b"x" * 1024)] + [chunk(b"x" * 1024)] * 63
    status, headers, body = raw_exchange(hostile, request_head(hostile, extra="Transfer-Encoding: chunked\r\n"),
                                         parts)
    assert status == 413 and assert_error_shape(body)["code"] == "request_too_large"
    assert headers["connection"] == "close"
    assert "4096" in body["error"]["message"]


def test_a_body_longer_than_it_declared_is_refused_and_a_declared_one_is_refused_unread(hostile):
    status, _, body = raw_exchange(hostile, request_head(hostile, extra="Content-Length: 100000000\r\n"))
    assert status == 413 and "100000000 bytes" in body["error"]["message"]
    ok = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 1}).encode()
    r = httpx.post(hostile.url + "/v1/completions", content=ok, headers=AUTH | {"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_headers_over_the_limit_get_the_error_shape_whether_they_come_whole_or_in_pieces(hostile):
    big = f"X-Big: {'a' * 20000}\r\n"
    status, headers, body = raw_exchange(hostile, request_head(hostile, extra=big))  # one write: h11 parses it
    assert status == 431 and assert_error_shape(body)["code"] == "headers_too_large"
    assert "8192" in body["error"]["message"] and headers["connection"] == "close"
    head = request_head(hostile, extra=big)
    pieces = [head[i:i + 1000] for i in range(0, len(head) - 4, 1000)]  # never ends: h11's buffer limit
    status, headers, body = raw_exchange(hostile, pieces[0], pieces[1:])
    assert status == 400 and assert_error_shape(body)["code"] == "invalid_http_request"
    assert "8192" in body["error"]["message"] and headers["connection"] == "close"


def nested(depth: int) -> bytes:
    return b'{"model": "tiny-heads", "prompt": "hi", "user": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [40, 2000])  # within the parser's stack, and beyond it (within the 4 KiB limit)
def test_deeply_nested_json_is_a_400(hostile, depth):
    r = httpx.post(hostile.url + "/v1/completions", content=nested(depth),
                   headers=AUTH | {"Content-Type": "application/json"})
    assert r.status_code == 400 and "deeper than 32 levels" in assert_error_shape(r.json())["message"]


def test_json_nested_5000_levels_is_a_400_not_a_recursion_error():
    with pytest.raises(ApiError, match="deeper than 32 levels") as e:
        parse_body(nested(5000), COMPLETION, 1 << 20)
    assert e.value.status == 400
