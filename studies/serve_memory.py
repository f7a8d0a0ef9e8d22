"""Where a served model's resident memory goes under load: rounds of the same concurrent level against one
``medusa serve`` process per variant, the resident size read right after each round and again after the server has
been idle a while. A leak grows round after round; memory the C allocator keeps after freeing it grows once, to the
high-water mark of the rounds, and falls back when the server hands it back (``--idle-release-s``).

    OMP_NUM_THREADS=1 taskset -c 1 python studies/serve_memory.py --base models/smollm2-135m-instruct \\
        --heads checkpoints/smollm2-135m-instruct-hydra --threads 1 --rounds 3 \\
        --variant keep:--idle-release-s=0 --variant release: --variant arenas2:MALLOC_ARENA_MAX=2,--idle-release-s=0 \\
        --out docs/results/serve-memory-smollm2-135m-hydra-cpu.json

A variant is ``NAME:ITEM,ITEM``: an item that starts with ``--`` is a server flag (``--flag=value``), any other is an
environment variable of the server process (``KEY=VALUE``). Loopback only; every answer is checked against the
first round's (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from serve_load import ServerProcess, read_messages, requests_for, run_level, server_arguments, summary


def parse_variant(text: str) -> tuple[str, list[str], dict[str, str]]:
    """``NAME:ITEM,ITEM`` -> (name, server flags, environment)."""
    name, _, items = text.partition(":")
    if not name:
        raise SystemExit(f"--variant {text!r}: give it a name, NAME:ITEM,ITEM")
    flags, env = [], {}
    for item in filter(None, items.split(",")):
        if item.startswith("--"):
            flags += item.split("=", 1)
        elif "=" in item:
            key, value = item.split("=", 1)
            env[key] = value
        else:
            raise SystemExit(f"--variant {text!r}: {item!r} is neither --flag=value nor KEY=VALUE")
    return name, flags, env


def run_variant(args, messages, name: str, flags: list[str], env: dict[str, str]) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server process inherits them
    try:
        server = ServerProcess(args, args.speculation, tuple(flags))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = {"flags": flags, "env": env, "rss_after_start_mb": round(server.rss_mb(), 1), "rounds": []}
    try:
        top = args.concurrency
        run_level(server.url, requests_for(messages, top, [max(args.lengths)]), top, args.request_timeout_s)
        out["rss_after_warmup_mb"] = round(server.rss_mb(), 1)
        time.sleep(args.idle_s)
        out["rss_after_warmup_idle_mb"] = round(server.rss_mb(), 1)
        reference = None
        for r in range(args.rounds):
            reqs = requests_for(messages, args.requests, args.lengths)
            results, wall = run_level(server.url, reqs, top, args.request_timeout_s)
            texts = [x.get("text") if x else None for x in results]
            reference = reference or texts
            busy = round(server.rss_mb(), 1)
            time.sleep(args.idle_s)
            idle = round(server.rss_mb(), 1)
            same = sum(a == b for a, b in zip(texts, reference, strict=True))
            entry = summary(results, wall) | {"rss_after_mb": busy, "rss_after_idle_mb": idle, "same_as_round_1": same}
            out["rounds"].append(entry)
            print(f"{name} round {r + 1}: {json.dumps(entry)}", flush=True)
        out["health"] = server.health()
    finally:
        out["exit_s"] = round(server.stop(), 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    server_arguments(p)
    p.add_argument("--speculation", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=128, help="requests per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 48, 96], help="max_tokens, cycled")
    p.add_argument("--idle-s", type=float, default=5.0, help="idle seconds before the second reading")
    p.add_argument("--variant", action="append", required=True, help="NAME:ITEM,ITEM (see the module docstring)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    messages = read_messages()
    report = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "variants": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name, flags, env in variants:
        report["variants"][name] = run_variant(args, messages, name, flags, env)
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")  # after each variant: a stopped run keeps it
    print("| variant | after warm-up | idle | " + " | ".join(f"round {i + 1} busy / idle" for i in range(args.rounds))
          + " |")
    for name, v in report["variants"].items():
        print(f"| {name} | {v['rss_after_warmup_mb']:.0f} | {v['rss_after_warmup_idle_mb']:.0f} | "
              + " | ".join(f"{r['rss_after_mb']:.0f} / {r['rss_after_idle_mb']:.0f}" for r in v["rounds"]) + " |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
