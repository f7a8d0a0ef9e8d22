"""One forward of the native int4 decoder repeated: N new tokens (a chain) after 300 cached ones, through the
prepared SmolLM2-135M (``native-q8``, the Q4_1 GGUF, its Q8_0 lm_head), the cache cut back after each. Prints the
median ms; meant to run under a profiler, e.g.

    perf record -F 1000 -o /tmp/perf.data python studies/native_forward_loop.py --new-tokens 8 --repeats 3000
    perf report -i /tmp/perf.data --sort dso,symbol --stdio

Figures: docs/quantized.md ("Fourth pass").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--kernel", default="native-q8", choices=["native", "native-q8"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from peer_bench import native_model

    from medusa.engines import kv_cache

    model = native_model(args.base, None, args.kernel, args.threads)
    engine, n = model.engine, args.new_tokens
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.base.config.vocab_size, (300,), generator=gen)
    tokens = torch.randint(0, model.base.config.vocab_size, (n,), generator=gen)
    times = []
    with torch.inference_mode():
        cache = engine.new_cache(300 + n + 8)
        engine.forward(prompt, torch.arange(300), kv_cache.causal_mask(300, prompt.device), cache)
        positions, mask = 300 + torch.arange(n), kv_cache.causal_mask(n, prompt.device)
        for _ in range(args.repeats):
            start = time.perf_counter()
            engine.forward(tokens, positions, mask, cache)
            times.append(time.perf_counter() - start)
            engine.keep_positions(cache, 300, torch.arange(0))
    print(f"{n} new tokens after 300: median {statistics.median(times) * 1e3:.2f} ms over {args.repeats} forwards")


if __name__ == "__main__":
    main()
