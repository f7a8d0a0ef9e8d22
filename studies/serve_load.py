"""Load and fault run of ``medusa serve`` on loopback: N concurrent clients, mixed lengths, some streaming; Medusa
(``--speculation auto``) against plain decoding (``--speculation off``), each behind its own server process of the
same build; then the faults of issue 22 against a fresh server. Bounded in count and time; talks to 127.0.0.1 only.
With ``--rounds R`` both servers run at once and take turns level by level, R rounds each in rotating order, so that
the machine's drift over the minutes of a run falls on both (the runs before 2026-12-07 ran one server, then the
other: their Medusa / plain ratios at 16 and 64 clients, where both servers step plain, moved between 0.82 and 1.14).

    OMP_NUM_THREADS=1 taskset -c 1 python studies/serve_load.py --base models/smollm2-135m-instruct \\
        --heads checkpoints/smollm2-135m-instruct-hydra --threads 1 --concurrency 1 4 16 --out load.json

Reports per mode and concurrency: aggregate completion tokens/s, p50/p95 latency, p50/p95 time to first token
(streamed requests), answers identical to the same requests served one at a time; the server's resident memory after
warm-up, after each level and after the load; served Medusa at concurrency 1 against the library's own ``generate``
on the same requests, interleaved; and each fault's status.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


TEMPERATURE = 0.0
"""The load's sampling temperature (``--temperature``); 0: greedy."""


def requests_for(messages: list, count: int, lengths: list[int]) -> list[dict]:
    """Request i: prompt i, ``lengths[i % len]`` new tokens, streamed every third, greedy (or sampled at
    :data:`TEMPERATURE` with seed i, so that request i draws the same text whenever it is served)."""
    return [{"messages": messages[i % len(messages)], "max_tokens": lengths[i % len(lengths)], "stream": i % 3 == 0,
             "temperature": TEMPERATURE} | ({"seed": i} if TEMPERATURE else {}) for i in range(count)]


class ServerProcess:
    """``medusa serve`` in a subprocess on a free loopback port."""

    def __init__(self, args, speculation: str, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-c", "import sys; from medusa.cli import main; sys.exit(main())", "serve",
               "--base", args.base, "--heads", args.heads, "--port", str(self.port), "--served-model-name", NAME,
               "--api-key", KEY, "--speculation", speculation, "--max-running", str(args.max_running),
               "--max-waiting", str(args.max_waiting), *extra, *(args.server_arg or ())]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.engine:
            cmd += ["--engine", args.engine]
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
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

    def steps_by_batch_size(self) -> dict:
        """``{batch size: {"speculative": n, "plain": n}}`` of the batched steps so far (``/metrics``)."""
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
        out: dict = {}
        for m in re.finditer(r'medusa_batched_steps_total\{batch_size="(\d+)",mode="(\w+)"\} (\d+)', text):
            out.setdefault(int(m[1]), {})[m[2]] = int(m[3])
        return dict(sorted(out.items()))

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


def warm(server: ServerProcess, args, messages) -> dict:
    """Warm-up at the largest concurrency and the longest answers, so that the memory after it holds the allocator's
    working set for the biggest batch: what grows after that is a leak, not the first large batch."""
    top = max(args.concurrency)
    run_level(server.url, requests_for(messages, top, [max(args.lengths)]), top, args.request_timeout_s)
    entry = {"rss_after_warmup_mb": round(server.rss_mb(), 1), "levels": {}}
    time.sleep(args.idle_s)  # the server hands its free memory back when idle (--idle-release-s)
    entry["rss_after_warmup_idle_mb"] = round(server.rss_mb(), 1)
    return entry


def level_requests(args, messages, c: int) -> list[dict]:
    count = max(args.min_requests, args.requests_per_client * c)
    if c == 1:  # the first mode's answers, one at a time, are the reference
        count = max(count, args.reference_requests)
    return requests_for(messages, count, args.lengths)


def finish(server: ServerProcess, entry: dict, mode: str, args) -> None:
    entry["steps_by_batch_size"] = server.steps_by_batch_size()
    print(f"{mode} steps by batch size: {entry['steps_by_batch_size']}", flush=True)
    entry["rss_after_load_mb"] = round(server.rss_mb(), 1)
    time.sleep(args.idle_s)
    entry["rss_after_load_idle_mb"] = round(server.rss_mb(), 1)
    entry["health"] = server.health()


def load(args, messages) -> dict:
    """Each mode's server through every level. Without ``--rounds``: one server after the other, each through all
    levels. With ``--rounds R``: both servers up at once (each idle while the other works), every level run R times
    per server, the servers alternating within a level and the order rotating from round to round, so the machine's
    drift falls on both alike; a level's tokens/s is its tokens over its seconds summed over the rounds, each round's
    kept in ``round_tokens_per_s``; every round's answers are compared (``more_rounds_results``)."""
    if not args.rounds:
        return {mode: sequential(args, messages, mode) for mode in args.modes}
    servers: dict = {}
    out: dict = {}
    try:
        for mode in args.modes:  # inside the try: a server that fails to start stops the ones already up
            servers[mode] = ServerProcess(args, {"medusa": "auto", "plain": "off"}[mode])
        for mode, server in servers.items():
            out[mode] = warm(server, args, messages)
        for c in args.concurrency:
            reqs = level_requests(args, messages, c)
            runs: dict = {mode: [] for mode in servers}
            rss: dict = {}
            for r in range(args.rounds):
                order = args.modes[r % len(args.modes):] + args.modes[:r % len(args.modes)]
                for mode in order:
                    runs[mode].append(run_level(servers[mode].url, reqs, c, args.request_timeout_s))
                    rss[mode] = round(servers[mode].rss_mb(), 1)  # right after its own turn, before it idles
            for mode, mode_runs in runs.items():
                every = summary([x for results, _ in mode_runs for x in results], sum(w for _, w in mode_runs))
                out[mode]["levels"][c] = every | {
                    "rss_after_mb": rss[mode], "results": mode_runs[0][0],
                    "more_rounds_results": [results for results, _ in mode_runs[1:]],
                    "round_tokens_per_s": [summary(results, wall)["tokens_per_s"] for results, wall in mode_runs]}
                print(f"{mode} c={c}: {json.dumps(every)} rounds {out[mode]['levels'][c]['round_tokens_per_s']}",
                      flush=True)
        for mode, server in servers.items():  # both read busy, then both after one idle spell
            out[mode]["steps_by_batch_size"] = server.steps_by_batch_size()
            out[mode]["rss_after_load_mb"] = round(server.rss_mb(), 1)
        time.sleep(args.idle_s)
        for mode, server in servers.items():
            out[mode]["rss_after_load_idle_mb"] = round(server.rss_mb(), 1)
            out[mode]["health"] = server.health()
            print(f"{mode} steps by batch size: {out[mode]['steps_by_batch_size']}", flush=True)
    finally:
        for mode, server in servers.items():
            try:
                out.setdefault(mode, {})["exit_s"] = round(server.stop(), 2)
            except Exception as e:  # noqa: BLE001 - the next server must be stopped too
                out.setdefault(mode, {})["exit_error"] = repr(e)
    return out


def sequential(args, messages, mode: str) -> dict:
    """One server through every level (the runs before ``--rounds``)."""
    server = ServerProcess(args, {"medusa": "auto", "plain": "off"}[mode])
    entry: dict = {}
    try:
        entry = warm(server, args, messages)
        for c in args.concurrency:
            results, wall = run_level(server.url, level_requests(args, messages, c), c, args.request_timeout_s)
            entry["levels"][c] = summary(results, wall) | {"rss_after_mb": round(server.rss_mb(), 1),
                                                           "results": results}
            print(f"{mode} c={c}: {json.dumps(summary(results, wall))}", flush=True)
        finish(server, entry, mode, args)
    finally:
        entry["exit_s"] = round(server.stop(), 2)
    return entry


def same_answers(report: dict) -> dict:
    """Each request's greedy text against the same request served one at a time (the first mode, concurrency 1),
    for the requests both ran; sampled (``--temperature``), against the same mode's own one-at-a-time answer (a
    seed draws alike in one mode, not across the two: speculative sampling spends its random numbers otherwise)."""
    reference = {i: r["text"] for i, r in enumerate(report["reference"]) if r.get("status") == 200}
    out = {}
    for mode, entry in report["load"].items():
        if report["args"].get("temperature"):
            reference = {i: r["text"] for i, r in enumerate(entry["levels"][1]["results"]) if r.get("status") == 200}
        for c, level in entry["levels"].items():
            rounds = [level["results"], *level.get("more_rounds_results", [])]
            pairs = [(reference[i], r.get("text")) for results in rounds for i, r in enumerate(results)
                     if i in reference]
            out[f"{mode} c={c}"] = {"compared": len(pairs), "identical": sum(a == b for a, b in pairs)}
    return out


def load_model(args):
    """The model as ``medusa serve`` loads it (the same flags through the same code), in this process."""
    import torch

    from medusa.cli import _load, build_parser

    if args.threads:
        torch.set_num_threads(args.threads)
    argv = ["serve", "--base", args.base, "--heads", args.heads] + (["--engine", args.engine] if args.engine else [])
    return _load(build_parser().parse_args(argv))


def generate_text(model, request: dict) -> tuple[str, int]:
    import torch

    from medusa.base import chat_prompt_ids

    ids = torch.tensor(chat_prompt_ids(model.tokenizer, request["messages"]))
    out, _ = model.generate(ids, request["max_tokens"], do_sample=False)
    return model.tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False), len(out)


def overhead(args, messages) -> dict:
    """Served Medusa at concurrency 1 against the library's own ``generate`` on the same requests, interleaved
    request by request (served then generate, then the other order for the next request), so that a change in the
    rest of the machine's load hits both alike. The server is idle while ``generate`` runs and the other way round."""
    reqs = requests_for(messages, args.reference_requests, args.lengths)
    server = ServerProcess(args, "auto")
    try:
        model = load_model(args)
        generate_text(model, reqs[0] | {"max_tokens": 8})  # warm-up, both
        run_level(server.url, requests_for(messages, 2, [8]), 1, args.request_timeout_s)
        served_s = generate_s = 0.0
        served_tokens = generate_tokens = identical = 0
        with httpx.Client() as client:
            for i, r in enumerate(reqs):
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    start = time.monotonic()
                    if side == 0:
                        answer = call(client, server.url, r, args.request_timeout_s)
                        served_s += time.monotonic() - start
                        served_tokens += answer["tokens"] or 0
                    else:
                        text, n = generate_text(model, r)
                        generate_s += time.monotonic() - start
                        generate_tokens += n
                identical += answer.get("text") == text
    finally:
        server.stop()
    return {"requests": len(reqs), "served_tokens": served_tokens, "served_s": round(served_s, 2),
            "served_tokens_per_s": round(served_tokens / served_s, 2), "generate_tokens": generate_tokens,
            "generate_s": round(generate_s, 2), "generate_tokens_per_s": round(generate_tokens / generate_s, 2),
            "served_vs_generate": round((served_tokens / served_s) / (generate_tokens / generate_s), 3),
            "identical_texts": identical}


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


def markdown(report: dict) -> str:
    """The report's tables: per mode and concurrency level, then Medusa against plain, memory and the faults."""
    def f(v, digits=2):
        return "-" if v is None else f"{v:.{digits}f}"

    lines = ["| mode | clients | requests | tokens | tok/s | p50 / p95 latency s | p50 / p95 TTFT s (streamed) | "
             "tau | same as one at a time | RSS after MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    same = report.get("same_answers", {})
    for mode, entry in report.get("load", {}).items():
        for c, lv in entry["levels"].items():
            s = same.get(f"{mode} c={c}", {})
            lines.append(f"| {mode} | {c} | {lv['answered']}/{lv['requests']} | {lv['tokens']} | "
                         f"{f(lv['tokens_per_s'])} | {f(lv['p50_latency_s'])} / {f(lv['p95_latency_s'])} | "
                         f"{f(lv['p50_ttft_s'])} / "
                         f"{f(lv['p95_ttft_s'])} | {f(lv['mean_tau'])} | {s.get('identical')}/{s.get('compared')} | "
                         f"{f(lv.get('rss_after_mb'), 0)} |")
    load = report.get("load", {})
    if {"medusa", "plain"} <= set(load):
        lines += ["", "| clients | Medusa / plain tok/s | concurrency vs 1 (Medusa, plain) |", "|---|---|---|"]
        m, p = load["medusa"]["levels"], load["plain"]["levels"]
        first = next(iter(m))
        for c in m:
            rounds = ""
            if "round_tokens_per_s" in m[c]:  # --rounds: each round's ratio and their median
                ratios = [a / b for a, b in zip(m[c]["round_tokens_per_s"], p[c]["round_tokens_per_s"], strict=True)]
                rounds = (f" (rounds {', '.join(f'{x:.3f}' for x in ratios)}; median "
                          f"{statistics.median(ratios):.3f})")
            lines.append(f"| {c} | {m[c]['tokens_per_s'] / p[c]['tokens_per_s']:.3f}{rounds} | "
                         f"{m[c]['tokens_per_s'] / m[first]['tokens_per_s']:.2f}x, "
                         f"{p[c]['tokens_per_s'] / p[first]['tokens_per_s']:.2f}x |")
    for mode, entry in load.items():
        grow = entry["rss_after_load_mb"] / entry["rss_after_warmup_mb"] - 1
        lines.append(f"\n{mode}: RSS {entry['rss_after_warmup_mb']:.0f} MB after warm-up, "
                     f"{entry['rss_after_load_mb']:.0f} MB after the load ({grow:+.1%}); {entry['health']}")
        if "rss_after_load_idle_mb" in entry:  # from 2026-12-06 run 7: also read after an idle spell
            idle = entry["rss_after_load_idle_mb"] / entry["rss_after_warmup_idle_mb"] - 1
            lines.append(f"{mode}, each read after {report['args'].get('idle_s')} s idle: "
                         f"{entry['rss_after_warmup_idle_mb']:.0f} MB after warm-up, "
                         f"{entry['rss_after_load_idle_mb']:.0f} MB after the load ({idle:+.1%})")
    if "generate" in report:  # earlier reports: generate after the servers stopped
        g = report["generate"]
        lines.append(f"\nlibrary generate: {g['tokens']} tokens in {g['wall_s']} s = {g['tokens_per_s']} tok/s; "
                     f"texts identical to the served ones: {g.get('same_as_served')}")
    if "overhead" in report:
        lines.append(f"\nserved Medusa vs the library's generate, interleaved: {json.dumps(report['overhead'])}")
    for name, fault in report.get("faults", {}).items():
        lines.append(f"\nfault {name}: {json.dumps(fault)}")
    return "\n".join(lines)


def server_arguments(p: argparse.ArgumentParser) -> None:
    """The flags :class:`ServerProcess` reads (shared with ``serve_soak.py``)."""
    p.add_argument("--base", required=True)
    p.add_argument("--heads", required=True)
    p.add_argument("--threads", type=int)
    p.add_argument("--engine")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument("--request-timeout-s", type=float, default=900)
    p.add_argument("--start-timeout-s", type=float, default=600)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--server-arg", action="append", metavar="FLAG",
                   help="one more flag for every server started, e.g. --server-arg=--idle-release-s=0 (repeatable)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_arguments(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--reference-requests", type=int, default=32,
                   help="requests served one at a time (Medusa, concurrency 1): the answers every level is compared "
                        "with, by request")
    p.add_argument("--modes", nargs="+", default=["medusa", "plain"], choices=["medusa", "plain"],
                   help="servers run, in this order: medusa (--speculation auto) and plain (--speculation off)")
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 48, 96], help="max_tokens, cycled")
    p.add_argument("--rounds", type=lambda v: int(v) if int(v) >= 0 else p.error(f"--rounds must be >= 0, got {v}"),
                   default=0,
                   help="run both servers at once and each level this many times per server, alternating between "
                        "them in rotating order (0: one server after the other, as the runs before 2026-12-07)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the load's requests at this temperature, request i with seed i (0: greedy)")
    p.add_argument("--idle-s", type=float, default=5.0,
                   help="idle seconds before the second reading of the resident size after warm-up and after the load")
    p.add_argument("--drain-timeout-s", type=float, default=10)
    p.add_argument("--sigterm-after-s", type=float, default=3)
    p.add_argument("--flood", type=int, default=100, help="requests sent at once in the flood fault")
    p.add_argument("--skip", nargs="*", default=[], choices=["load", "overhead", "faults"])
    p.add_argument("--out", required=True, help="the JSON report (with --tables: an earlier one, printed)")
    p.add_argument("--tables", action="store_true", help="print the tables of the report --out and exit")
    args = p.parse_args()
    if args.tables:
        print(markdown(json.loads(Path(args.out).read_text())))
        return 0
    global TEMPERATURE
    TEMPERATURE = args.temperature
    messages = read_messages()
    report: dict = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if "load" not in args.skip:
        if args.concurrency[0] != 1:
            raise SystemExit("--concurrency must start with 1: its Medusa answers are the one-at-a-time reference")
        report["load"] = load(args, messages)
        report["reference"] = report["load"][args.modes[0]]["levels"][1]["results"]
        report["same_answers"] = same_answers(report)
        print(f"same answers: {json.dumps(report['same_answers'])}", flush=True)
    if "overhead" not in args.skip:
        report["overhead"] = overhead(args, messages)
        print(f"overhead: {json.dumps(report['overhead'])}", flush=True)
    if "faults" not in args.skip:
        report["faults"] = faults(args, messages)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
