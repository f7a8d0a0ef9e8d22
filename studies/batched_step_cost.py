"""One batched decode step of B rows, as `medusa serve` runs it, by mode and by the two levers of the serve's third
pass: the grouped key heads read in place under a mask, and greedy rows sharing one head call per depth.

    OMP_NUM_THREADS=1 taskset -c 1 python studies/batched_step_cost.py --base models/smollm2-135m-instruct \\
        --heads checkpoints/smollm2-135m-instruct-hydra --threads 1 --rows 1 4 8 16 --out steps.json

For each B: B held-out ShareGPT prompts (their first user turn, at most ``--prompt-tokens`` tokens) join one
:class:`medusa.decode.loop.RunningBatch`, then ``--steps`` steps run (the first three not timed), and the median step
is reported with the tokens a step emitted: plain steps without a drafter (the plain server's), plain steps beside
the Medusa drafter, and speculative steps (the per-step tree), each speculative case with both levers off, one on,
and both on. Each case gets a fresh per-step tree (what one learns, such as its per-node overhead, would otherwise
carry into the next). The cases of one B run in turn in one process, ``--rounds`` times, the fastest round kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

PROMPTS = "benchmarks/prompts/sharegpt-held-out.jsonl"


def prompts_ids(tokenizer, count: int, limit: int) -> list[torch.Tensor]:
    rows = [json.loads(line) for line in Path(PROMPTS).read_text().splitlines() if line.strip()]
    out = []
    for r in rows[:count]:
        messages = [m for m in r["messages"] if m["role"] != "assistant"][:1]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:limit]))
    return out


def one_case(model, drafter, engine, prompts, plain: bool, steps: int) -> dict:
    from medusa.decode.loop import RunningBatch

    batch = RunningBatch(model.base, drafter, engine)
    for i, p in enumerate(prompts):
        batch.join(i, p, steps * (drafter.max_depth + 1) + 8)
    times, tokens = [], 0
    for s in range(steps):
        start = time.perf_counter()
        out = batch.step(plain)
        if s >= 3:
            times.append(time.perf_counter() - start)
            tokens += sum(len(step.tokens) for _, step in out)
    median = statistics.median(times)
    per_step = tokens / len(times)
    return {"median_step_ms": round(median * 1e3, 2), "tokens_per_step": round(per_step, 3),
            "tokens_per_s": round(per_step / median, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--heads", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--engine", default="onednn")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from medusa.drafters.composite import NoDrafter
    from medusa.engines import make_engine, onednn
    from medusa.model import MedusaModel

    model = MedusaModel.from_pretrained(args.base, args.heads, engine=args.engine)
    engines = {"grouped": model.engine}
    grouped = onednn.use_grouped_query_attention
    onednn.use_grouped_query_attention = lambda shadow: 0  # an engine whose shadow keeps transformers' SDPA
    try:
        engines["copied"] = make_engine(args.engine, model.base)
    finally:
        onednn.use_grouped_query_attention = grouped
    heads = model.drafter.heads
    cases = [("plain, no drafter", NoDrafter(), "grouped", True, True),
             ("plain beside the drafter", model.drafter, "grouped", True, True),
             ("speculative, both levers off", model.drafter, "copied", False, False),
             ("speculative, grouped attention", model.drafter, "grouped", False, False),
             ("speculative, shared head call", model.drafter, "copied", False, True),
             ("speculative, both levers on", model.drafter, "grouped", False, True)]
    report = {"args": vars(args), "torch": torch.__version__, "rows": {}}
    with torch.inference_mode():
        for b in args.rows:
            prompts = prompts_ids(model.tokenizer, b, args.prompt_tokens)
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for name, drafter, engine, plain, shared in cases:
                    type(heads).drafts_rows_together = shared
                    if drafter is not cases[0][1]:  # a fresh per-step tree: nothing learned in the case before
                        model.use_per_step_tree(args.heads)
                        drafter = model.drafter
                    r = one_case(model, drafter, engines[engine], prompts, plain, args.steps)
                    if name not in best or r["median_step_ms"] < best[name]["median_step_ms"]:
                        best[name] = r
            type(heads).drafts_rows_together = True
            plain_rate = best["plain, no drafter"]["tokens_per_s"]
            for name, r in best.items():
                r["vs_plain"] = round(r["tokens_per_s"] / plain_rate, 3)
                print(f"B={b:3d} {name:32s} {r['median_step_ms']:8.2f} ms  {r['tokens_per_step']:6.2f} tokens  "
                      f"{r['tokens_per_s']:7.1f} tok/s  {r['vs_plain']:.3f}x plain", flush=True)
            report["rows"][b] = best
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
