"""Load and fault run of ``medusa serve`` on loopback: N concurrent clients, mixed lengths, some streaming; Medusa
(``--speculation auto``) against plain decoding (``--speculation off``), each behind its own server process of the
same build; then the faults of issue 22 against a fresh server. Bounded in count and time; talks to 127.0.0.1 only.

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/serve_load.py --base models/smollm2-135m-instruct \\
        --heads checkpoints/smollm2-135m-instruct-hydra --threads 1 --concurrency 1 4 16 --out load.json

Reports per mode and concurrency: aggregate completion tokens/s, p50/p95 latency, p50/p95 time to first token
(streamed requests), answers identical to the same requests served one at a time; the server's resident memory after
warm-up and after the load; the library's own ``generate`` on the concurrency-1 requests; and each fault's status.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

KEY = "load-key"
NAME = "served"
PROMPT_FILES = ("benchmarks/prompts/sharegpt-held-out.jsonl", "benchmarks/prompts/mt-bench-style.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_messages(files=PROMPT_FILES) -> list[list[dict]]:
    """The frozen held-out prompts (first turn of each conversation), interleaved across the files."""
    sets = []
    for f in files:
        rows = [json.loads(line) for line in Path(f).read_text().splitlines() if line.strip()]
        sets.append([[m for m in r["messages"] if m["role"] != "assistant"][:1] if "messages" in r
                     else [{"role": "user", "content": r["prompt"]}] for r in rows])
    out = []
    for i in range(max(len(s) for s in sets)):
        out += [s[i] for s in sets if i < len(s)]
    return out


def requests_for(messages: list, count: int, lengths: list[int]) -> list[dict]:
    """Request i: prompt i, ``lengths[i % len]`` new tokens, streamed every third, greedy."""
    return [{"messages": messages[i % len(messages)], "max_tokens": lengths[i % len(lengths)], "temperature": 0,
             "stream": i % 3 == 0} for i in range(count)]


class ServerProcess:
    """``medusa serve`` in a subprocess on a free loopback port."""

    def __init__(self, args, speculation: str, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "import sys; from medusa.cli import main; sys.exit(main())", "serve",
               "--base", args.base, "--heads", args.heads, "--port", str(self.port), "--served-model-name", NAME,
               "--api-key", KEY, "--speculation", speculation, "--max-running", str(args.max_running),
               "--max-waiting", str(args.max_waiting), *extra]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.engine:
            cmd += ["--engine", args.engine]
        self.log = open(Path(args.log_dir) / f"serve-{speculation}-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + args.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not start within {args.start_timeout_s} s: see {self.log.name}")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, timeout: float = 60) -> float:
        """SIGTERM, then wait; returns the seconds to exit (SIGKILL past ``timeout``)."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return time.monotonic() - start


def call(client: httpx.Client, url: str, body: dict, timeout: float) -> dict:
    """One chat request; returns status, text, tokens, latency and time to first token (streamed: first text)."""
    start = time.monotonic()
    body = {"model": NAME} | body
    headers = {"Authorization": f"Bearer {KEY}"}
    if not body.get("stream"):
        r = client.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout)
        end = time.monotonic()
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.json().get("error"), "latency_s": end - start}
        data = r.json()
        return {"status": 200, "text": data["choices"][0]["message"]["content"], "latency_s": end - start,
                "ttft_s": None, "tokens": data["usage"]["completion_tokens"], "tau": data["usage"]["medusa_tau"],
                "finish": data["choices"][0]["finish_reason"]}
    body["stream_options"] = {"include_usage": True}
    text, first, usage, finish, error = [], None, None, None, None
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=timeout) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": json.loads(r.read()).get("error"),
                    "latency_s": time.monotonic() - start}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c["delta"].get("content")
                if piece and first is None:
                    first = time.monotonic() - start
                text.append(piece or "")
                finish = c["finish_reason"] or finish
    out = {"status": 200, "text": "".join(text), "latency_s": time.monotonic() - start, "ttft_s": first,
           "tokens": usage["completion_tokens"] if usage else None, "tau": usage["medusa_tau"] if usage else None,
           "finish": finish}
    if error:
        out["error"] = error
    return out


def run_level(url: str, requests: list[dict], concurrency: int, timeout: float) -> tuple[list[dict], float]:
    """``concurrency`` clients working through ``requests``; returns (results by request index, wall seconds)."""
    results: list[dict | None] = [None] * len(requests)
    lock = threading.Lock()
    queue = list(range(len(requests)))

    def client_loop():
        with httpx.Client() as client:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                try:
                    results[i] = call(client, url, requests[i], timeout)
                except httpx.HTTPError as e:
                    results[i] = {"status": None, "error": repr(e)}

    start = time.monotonic()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.monotonic() - start


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r and r.get("status") == 200 and "error" not in r]
    tokens = sum(r["tokens"] or 0 for r in ok)
    taus = [r["tau"] for r in ok if r.get("tau") is not None]
    return {"requests": len(results), "answered": len(ok), "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2), "p50_latency_s": percentile([r["latency_s"] for r in ok], 0.5),
            "p95_latency_s": percentile([r["latency_s"] for r in ok], 0.95),
            "p50_ttft_s": percentile([r["ttft_s"] for r in ok], 0.5),
            "p95_ttft_s": percentile([r["ttft_s"] for r in ok], 0.95),
            "mean_tau": round(statistics.mean(taus), 3) if taus else None}


def load(args, messages) -> dict:
    out = {}
    for mode in args.modes:
        speculation = {"medusa": "auto", "plain": "off"}[mode]
        server = ServerProcess(args, speculation)
        try:
            # Warm-up at the largest concurrency, so that the memory after it holds the allocator's working set
            # for the biggest batch: what grows after that is a leak, not the first large batch.
            top = max(args.concurrency)
            run_level(server.url, requests_for(messages, top, [16]), top, args.request_timeout_s)
            entry = {"rss_after_warmup_mb": round(server.rss_mb(), 1), "levels": {}}
            for c in args.concurrency:
                count = max(args.min_requests, args.requests_per_client * c)
                if c == 1:  # the Medusa answers, one at a time, are the reference
                    count = max(count, args.reference_requests)
                reqs = requests_for(messages, count, args.lengths)
                results, wall = run_level(server.url, reqs, c, args.request_timeout_s)
                entry["levels"][c] = summary(results, wall) | {"rss_after_mb": round(server.rss_mb(), 1),
                                                               "results": results}
                print(f"{mode} c={c}: {json.dumps(summary(results, wall))}", flush=True)
            entry["rss_after_load_mb"] = round(server.rss_mb(), 1)
            entry["health"] = server.health()
        finally:
            entry["exit_s"] = round(server.stop(), 2)
        out[mode] = entry
    return out


def same_answers(report: dict) -> dict:
    """Each request's greedy text against the same request served one at a time (the first mode, concurrency 1),
    for the requests both ran."""
    reference = {i: r["text"] for i, r in enumerate(report["reference"]) if r.get("status") == 200}
    out = {}
    for mode, entry in report["load"].items():
        for c, level in entry["levels"].items():
            pairs = [(reference[i], r.get("text")) for i, r in enumerate(level["results"]) if i in reference]
            out[f"{mode} c={c}"] = {"compared": len(pairs), "identical": sum(a == b for a, b in pairs)}
    return out


def library_generate(args, requests: list[dict]) -> dict:
    """The library's own ``generate`` on the same requests, in this process (the servers are stopped)."""
    import torch

    from medusa.base import chat_prompt_ids
    from medusa.cli import _load, build_parser

    if args.threads:
        torch.set_num_threads(args.threads)
    argv = ["serve", "--base", args.base, "--heads", args.heads] + (["--engine", args.engine] if args.engine else [])
    model = _load(build_parser().parse_args(argv))
    ids = [torch.tensor(chat_prompt_ids(model.tokenizer, r["messages"])) for r in requests]
    model.generate(ids[0], 8, do_sample=False)  # warm-up
    start, tokens, texts = time.monotonic(), 0, []
    for x, r in zip(ids, requests, strict=True):
        out, _ = model.generate(x, r["max_tokens"], do_sample=False)
        tokens += len(out)
        texts.append(model.tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False))
    wall = time.monotonic() - start
    return {"tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 2), "texts": texts}


def faults(args, messages) -> dict:
    """Each fault of issue 22 against one server; after each, a normal request must still be answered."""
    server = ServerProcess(args, "auto", ("--drain-timeout-s", str(args.drain_timeout_s)))
    out, url, auth = {}, server.url, {"Authorization": f"Bearer {KEY}"}
    ok_body = {"model": NAME, "messages": messages[0], "max_tokens": 4, "temperature": 0}

    def still_serving() -> bool:
        return httpx.post(url + "/v1/chat/completions", json=ok_body, headers=auth, timeout=300).status_code == 200

    def record(name, response: httpx.Response):
        out[name] = {"status": response.status_code, "error": response.json().get("error"),
                     "serving_after": still_serving()}
        print(f"fault {name}: {out[name]['status']} serving after: {out[name]['serving_after']}", flush=True)

    try:
        # clients that disconnect mid-stream
        body = {"model": NAME, "messages": messages[1], "max_tokens": 200, "temperature": 0, "stream": True}
        for _ in range(3):
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth, timeout=300) as r:
                lines = r.iter_lines()
                next(lines)
                next(lines)
        deadline = time.monotonic() + 60
        while server.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.2)
        out["disconnect"] = {"running_after": server.health()["running"], "serving_after": still_serving()}
        print(f"fault disconnect: {out['disconnect']}", flush=True)
        long_text = "word " * 20000
        record("over_context", httpx.post(url + "/v1/chat/completions", headers=auth, timeout=60, json={
            "model": NAME, "messages": [{"role": "user", "content": long_text}]}))
        record("malformed_json", httpx.post(url + "/v1/chat/completions", headers=auth | {
            "Content-Type": "application/json"}, content=b'{"model": "served", "messages": [', timeout=60))
        record("unknown_model", httpx.post(url + "/v1/chat/completions", headers=auth, timeout=60,
                                           json=ok_body | {"model": "gpt-4o"}))
        record("wrong_api_key", httpx.post(url + "/v1/chat/completions", timeout=60, json=ok_body,
                                           headers={"Authorization": "Bearer nope"}))
        out["flood"] = flood(url, auth, ok_body, args) | {"serving_after": still_serving()}
        print(f"fault flood: {out['flood']}", flush=True)
        out["sigterm"] = sigterm_during_load(server, messages, args)
        print(f"fault sigterm: {out['sigterm']}", flush=True)
    finally:
        server.stop()
    return out


def flood(url: str, auth: dict, body: dict, args) -> dict:
    """More requests at once than running + waiting slots: the rest must get 429 (not a crash, not a queue)."""
    statuses: list[int | None] = []
    lock = threading.Lock()

    def one():
        try:
            s = httpx.post(url + "/v1/chat/completions", json=body, headers=auth, timeout=600).status_code
        except httpx.HTTPError:
            s = None
        with lock:
            statuses.append(s)

    threads = [threading.Thread(target=one) for _ in range(args.flood)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"sent": args.flood, "200": statuses.count(200), "429": statuses.count(429),
            "other": [s for s in statuses if s not in (200, 429)]}


def sigterm_during_load(server: ServerProcess, messages, args) -> dict:
    """Streams in flight, then SIGTERM: each must end (finished or with an error event, then [DONE]) and the process
    must exit within the drain timeout plus a margin."""
    reqs = [{"messages": messages[i], "max_tokens": 400, "temperature": 0, "stream": True} for i in range(4)]
    results: list[dict] = []

    def one(r):
        with httpx.Client() as client:
            try:
                results.append(call(client, server.url, r, 600))
            except httpx.HTTPError as e:
                results.append({"status": None, "error": repr(e)})

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    time.sleep(args.sigterm_after_s)
    exit_s = server.stop(timeout=args.drain_timeout_s + 60)
    for t in threads:
        t.join()
    return {"in_flight": len(reqs), "finished": sum(r.get("finish") is not None and "error" not in r
                                                    for r in results),
            "ended_with_error_event": sum("error" in r and r.get("status") == 200 for r in results),
            "failed_otherwise": sum(r.get("status") != 200 for r in results), "exit_s": round(exit_s, 2),
            "returncode": server.proc.returncode, "drain_timeout_s": args.drain_timeout_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--heads", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--engine")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--reference-requests", type=int, default=32,
                   help="requests served one at a time (Medusa, concurrency 1): the answers every level is compared "
                        "with, by request")
    p.add_argument("--modes", nargs="+", default=["medusa", "plain"], choices=["medusa", "plain"],
                   help="servers run, in this order: medusa (--speculation auto) and plain (--speculation off)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 48, 96], help="max_tokens, cycled")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument("--request-timeout-s", type=float, default=900)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--drain-timeout-s", type=float, default=10)
    p.add_argument("--sigterm-after-s", type=float, default=3)
    p.add_argument("--flood", type=int, default=100, help="requests sent at once in the flood fault")
    p.add_argument("--skip", nargs="*", default=[], choices=["load", "faults", "generate"])
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    messages = read_messages()
    report: dict = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if "load" not in args.skip:
        if args.concurrency[0] != 1:
            raise SystemExit("--concurrency must start with 1: its Medusa answers are the one-at-a-time reference")
        report["load"] = load(args, messages)
        report["reference"] = report["load"][args.modes[0]]["levels"][1]["results"]
        report["same_answers"] = same_answers(report)
        print(f"same answers: {json.dumps(report['same_answers'])}", flush=True)
    if "generate" not in args.skip:
        first = args.concurrency[0]
        reqs = requests_for(messages, max(args.min_requests, args.requests_per_client * first,
                                          args.reference_requests), args.lengths)
        report["generate"] = library_generate(args, reqs)
        if "reference" in report:
            pairs = list(zip(report["generate"]["texts"], [r.get("text") for r in report["reference"]], strict=False))
            report["generate"]["same_as_served"] = {"compared": len(pairs), "identical": sum(a == b for a, b in pairs)}
        print(f"library generate: {report['generate']['tokens_per_s']} tok/s, "
              f"{report['generate'].get('same_as_served')}", flush=True)
    if "faults" not in args.skip:
        report["faults"] = faults(args, messages)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
