"""Soak run of ``medusa serve`` on loopback: N clients for a fixed time, a fault injected every minute, every answer
checked against the same request served alone. Bounded in time; talks to 127.0.0.1 only.

    OMP_NUM_THREADS=1 taskset -c 1 python studies/serve_soak.py --base models/smollm2-135m-instruct \\
        --heads checkpoints/smollm2-135m-instruct-hydra --threads 1 --clients 16 --minutes 20 --out soak.json

One server (``--speculation auto``). First every distinct request (prompt x length) is served alone: the reference
answers. Then ``--clients`` threads send those requests in turn (greedy, every third streamed) for ``--minutes``,
while every ``--fault-every-s`` seconds one fault, in turn:

- ``disconnect``: three streamed requests closed after their first two lines;
- ``oversize``: a body over ``--max-body-bytes``, declared and chunked (413 each);
- ``half_open``: five connections that send the headers and part of a body, then nothing (the server must close
  them after ``--read-timeout-s``);
- ``malformed``: broken JSON, and JSON nested 5,000 deep (400 each);
- ``sigstop``: a client process stopped (SIGSTOP) for ``--stop-s`` seconds in the middle of its stream, then
  continued (SIGCONT): its answer must still arrive whole and equal the reference.

Reports: the clients' requests answered, wrong (text differs from the reference) and lost (anything but a complete
200 answer); p50/p95/p99 latency; each fault's outcome; the server's resident memory sampled every
``--rss-every-s`` seconds, and its growth over the soak after the first minute (the allocator's working set for a
full batch is reached then).
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from serve_load import KEY, NAME, ServerProcess, call, percentile, read_messages, requests_for, server_arguments

FAULTS = ("disconnect", "oversize", "half_open", "malformed", "sigstop")

STOPPED_CLIENT = """
import json, sys
from serve_load import call
import httpx
url, body = sys.argv[1], json.loads(sys.argv[2])
with httpx.Client() as client:
    print(json.dumps(call(client, url, body, 900)), flush=True)
"""


class Soak:
    """The clients, the faults and the memory samples of one soak run (see module docstring)."""

    def __init__(self, server: ServerProcess, requests: list[dict], reference: list[str], args):
        self.server, self.requests, self.reference, self.args = server, requests, reference, args
        self.results: list[dict] = []
        self.faults: list[dict] = []
        self.rss: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.start = time.monotonic()
        self.end = self.start + args.minutes * 60

    def client(self, offset: int) -> None:
        with httpx.Client() as client:
            for i in itertools.count(offset * 3):
                if time.monotonic() >= self.end:
                    return
                k = i % len(self.requests)
                try:
                    r = call(client, self.server.url, self.requests[k], self.args.request_timeout_s)
                except httpx.HTTPError as e:
                    r = {"status": None, "error": repr(e)}
                r |= {"request": k, "at_s": round(time.monotonic() - self.start, 1)}
                r["verdict"] = ("lost" if r.get("status") != 200 or "error" in r or r.get("finish") is None
                                else "ok" if r["text"] == self.reference[k] else "wrong")
                with self.lock:
                    self.results.append(r)

    def sample_memory(self) -> None:
        while time.monotonic() < self.end:
            self.rss.append((round(time.monotonic() - self.start, 1), round(self.server.rss_mb(), 1)))
            time.sleep(self.args.rss_every_s)

    def inject(self) -> None:
        for n in itertools.count():
            due = self.start + (n + 1) * self.args.fault_every_s
            if due >= self.end - 30:  # the last fault has time to finish before the clients stop
                return
            time.sleep(max(0.0, due - time.monotonic()))
            kind = FAULTS[n % len(FAULTS)]
            started = time.monotonic()
            try:
                outcome = getattr(self, f"fault_{kind}")()
            except Exception as e:  # a fault that breaks the study is reported, not hidden
                outcome = {"passed": False, "error": repr(e)}
            outcome |= {"fault": kind, "at_s": round(started - self.start, 1),
                        "took_s": round(time.monotonic() - started, 1)}
            print(f"fault {json.dumps(outcome)}", flush=True)
            self.faults.append(outcome)

    # -- the faults ---------------------------------------------------------------------------------------------
    def _post(self, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"} | kwargs.pop("headers", {})
        return httpx.post(self.server.url + "/v1/chat/completions", headers=headers, timeout=120, **kwargs)

    def fault_disconnect(self) -> dict:
        body = {"model": NAME, "messages": self.requests[1]["messages"], "max_tokens": 200, "temperature": 0,
                "stream": True}
        for _ in range(3):
            with httpx.stream("POST", self.server.url + "/v1/chat/completions", json=body, timeout=300,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                lines = r.iter_lines()
                next(lines)
                next(lines)
        return {"passed": True}

    def fault_oversize(self) -> dict:
        limit = self.args.max_body_bytes
        declared = self._post(content=b"{" + b" " * (limit + 1024) + b"}").status_code

        def chunks():
            for _ in range(limit // 65536 + 2):
                yield b" " * 65536

        chunked = self._post(content=chunks()).status_code
        return {"passed": declared == 413 and chunked == 413, "declared": declared, "chunked": chunked}

    def fault_half_open(self) -> dict:
        socks = []
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", self.server.port), timeout=self.args.read_timeout_s + 30)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
            socks.append(s)
        started, closed = time.monotonic(), []
        for s in socks:
            try:
                data = s.recv(65536)
                while data and b"\r\n\r\n" not in data:  # the answer's head, if any
                    data += s.recv(65536)
                status = int(data.split(b" ", 2)[1]) if data else None
            except TimeoutError:
                status = "still open"
            closed.append((status, round(time.monotonic() - started, 1)))
            s.close()
        limit = self.args.read_timeout_s + 5
        return {"passed": all(isinstance(st, int) or st is None for st, _ in closed)
                and max(t for _, t in closed) <= limit, "closed": closed}

    def fault_malformed(self) -> dict:
        broken = self._post(content=b'{"model": "served", "messages": [').status_code
        deep = self._post(content=b"[" * 5000 + b"]" * 5000).status_code
        return {"passed": broken == 400 and deep == 400, "broken_json": broken, "nested_5000": deep}

    def fault_sigstop(self) -> dict:
        k = next(i for i, r in enumerate(self.requests) if r["max_tokens"] == max(self.args.lengths))
        body = self.requests[k] | {"stream": True}  # streamed or not, greedy gives the reference's text
        argv = [sys.executable, "-c", STOPPED_CLIENT, self.server.url, json.dumps(body)]
        client = subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=Path(__file__).parent, text=True)
        time.sleep(1.0)
        client.send_signal(signal.SIGSTOP)
        time.sleep(self.args.stop_s)
        client.send_signal(signal.SIGCONT)
        out, _ = client.communicate(timeout=600)
        answer = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        same = answer.get("status") == 200 and answer.get("text") == self.reference[k]
        return {"passed": same, "status": answer.get("status"), "same_as_alone": same, "stopped_s": self.args.stop_s}


def soak(args) -> dict:
    messages = read_messages()
    requests = requests_for(messages, args.distinct, args.lengths)
    server = ServerProcess(args, "auto", ("--max-body-bytes", str(args.max_body_bytes),
                                          "--read-timeout-s", str(args.read_timeout_s)))
    report = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        reference = []
        with httpx.Client() as client:
            for r in requests:
                answer = call(client, server.url, r, args.request_timeout_s)
                if answer.get("status") != 200 or "error" in answer:
                    raise RuntimeError(f"the reference request failed: {answer}")
                reference.append(answer["text"])
        report["rss_before_soak_mb"] = round(server.rss_mb(), 1)
        print(f"reference: {len(reference)} answers; RSS {report['rss_before_soak_mb']} MB", flush=True)
        run = Soak(server, requests, reference, args)
        threads = [threading.Thread(target=run.client, args=(j,)) for j in range(args.clients)]
        threads += [threading.Thread(target=run.sample_memory), threading.Thread(target=run.inject)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report["health"] = server.health()
    finally:
        report["exit_s"] = round(server.stop(), 2)
    report |= summarise(run, args)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return report


def summarise(run: Soak, args) -> dict:
    results = run.results
    ok = [r for r in results if r["verdict"] == "ok"]
    latencies = [r["latency_s"] for r in ok]
    settled = [mb for t, mb in run.rss if t >= 60] or [mb for _, mb in run.rss]
    baseline = settled[0]
    return {
        "requests": len(results), "answered_right": len(ok),
        "wrong": [r for r in results if r["verdict"] == "wrong"],
        "lost": [r for r in results if r["verdict"] == "lost"],
        "tokens_per_s": round(sum(r["tokens"] or 0 for r in ok) / (args.minutes * 60), 2),
        "p50_latency_s": percentile(latencies, 0.5), "p95_latency_s": percentile(latencies, 0.95),
        "p99_latency_s": percentile(latencies, 0.99), "max_latency_s": max(latencies, default=None),
        "faults": run.faults, "faults_passed": sum(f["passed"] for f in run.faults),
        "rss_mb": run.rss, "rss_after_first_minute_mb": baseline, "rss_max_after_mb": max(settled),
        "rss_last_mb": settled[-1], "rss_growth": round(max(settled) / baseline - 1, 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_arguments(p)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--minutes", type=float, default=20)
    p.add_argument("--fault-every-s", type=float, default=60)
    p.add_argument("--distinct", type=int, default=48, help="distinct requests (prompt x length), cycled")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 48, 96], help="max_tokens, cycled")
    p.add_argument("--stop-s", type=float, default=15, help="how long the sigstop fault keeps its client stopped")
    p.add_argument("--rss-every-s", type=float, default=10)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--read-timeout-s", type=float, default=30)
    p.add_argument("--out", required=True, help="the JSON report")
    args = p.parse_args()
    report = soak(args)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("args", "rss_mb", "faults")} | {
        "wrong": len(report["wrong"]), "lost": len(report["lost"])}, indent=1))
    return 0 if not report["wrong"] and not report["lost"] and report["faults_passed"] == len(report["faults"]) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
