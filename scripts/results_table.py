"""Markdown rows of the README's results table from `medusa bench` JSONs (no model, no timing).

    python scripts/results_table.py docs/results/bench-smollm2-135m-hydra-auto-fp32-cpu-*.json
    python scripts/results_table.py --by-category docs/results/bench-...-mt-bench-style.json

One row per JSON: machine, prompt set, engine (and whether auto chose it), dtype, tau, identical prompts (ties),
HF generate / plain / Medusa tokens/s, plain vs HF, Medusa vs HF and vs plain, the per-prompt minimum and median
speedups and the prompts slower than plain decoding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HEADER = ("| machine | prompts | engine, dtype | tau | identical to HF greedy | HF `generate` | our plain decoding "
          "| Medusa | plain vs HF | **Medusa vs HF** | Medusa vs plain | per prompt vs HF: min / median "
          "| per prompt vs plain: min / median | slower than plain |")


def row(path: Path) -> str:
    r = json.loads(path.read_text())
    cpu = r.get("cpu") or {}
    machine = f"{cpu.get('model', r.get('device'))} ({', '.join(cpu.get('flags', [])) or 'no AVX-512'})"
    prompts = Path(r.get("prompts_file", "?")).stem
    engine = r["engine"]["engine"] + (" (auto)" if r["engine"].get("auto") else "")
    dtype = r["dtype"].removeprefix("torch.")
    ties = r.get("ties", 0)
    identical = f"{round(r['identical'] * r['prompts'])}/{r['prompts']}" + (f" ({ties} ties)" if ties else "")
    truth = r["per_prompt_speedup"]
    return (f"| {machine} | {r['prompts']} {prompts} | {engine}, {dtype} | {r['tau']:.2f} | {identical} | "
            f"{r['baseline_tokens_per_s']:.2f} tok/s | {r['plain_tokens_per_s']:.2f} tok/s | "
            f"{r['medusa_tokens_per_s']:.2f} tok/s | {r['plain_tokens_per_s'] / r['baseline_tokens_per_s']:.2f}x | "
            f"**{r['speedup']:.2f}x** | {r['speedup_vs_plain']:.2f}x | {truth['vs_hf']['min']:.2f}x / "
            f"{truth['vs_hf']['median']:.2f}x | {truth['vs_plain']['min']:.2f}x / "
            f"{truth['vs_plain']['median']:.2f}x | "
            f"{truth['slower_than_plain']} of {truth['prompts']} |")


def by_category(path: Path) -> list[str]:
    """Per prompt category (records with a ``category``): tau over the category's steps, Medusa over HF and over
    plain decoding (tokens/s over tokens/s), the smallest per-prompt speedups."""
    r = json.loads(path.read_text())
    groups: dict[str, list[dict]] = {}
    for p in r["per_prompt"]:
        groups.setdefault(p.get("category", "?"), []).append(p)
    lines = ["| category | prompts | tau | Medusa vs HF | Medusa vs plain | per prompt vs HF: min "
             "| per prompt vs plain: min | slower than plain |", "|---|---|---|---|---|---|---|---|"]
    for name, ps in groups.items():
        tokens = sum(p["tokens"] for p in ps)
        steps = sum((p["tokens"] - 1) / p["tau"] for p in ps if p["tokens"] > 1)
        medusa = tokens / sum(p["medusa_s"] for p in ps)
        hf = sum(p["hf_tokens_per_s"] * p["hf_s"] for p in ps) / sum(p["hf_s"] for p in ps)
        plain = sum(p["plain_tokens_per_s"] * p["plain_s"] for p in ps) / sum(p["plain_s"] for p in ps)
        lines.append(f"| {name} | {len(ps)} | {sum(p['tokens'] - 1 for p in ps) / steps:.2f} | {medusa / hf:.2f}x | "
                     f"{medusa / plain:.2f}x | {min(p['speedup_vs_hf'] for p in ps):.2f}x | "
                     f"{min(p['speedup_vs_plain'] for p in ps):.2f}x | {sum(p['speedup_vs_plain'] < 1 for p in ps)} |")
    return lines


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "--by-category":
        for name in argv[1:]:
            print("\n".join(by_category(Path(name))))
        return 0
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    for name in argv:
        print(row(Path(name)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
