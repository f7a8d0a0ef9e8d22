"""What one fused Hydra level costs with its weights in cache and right after a base forward (which streams the
base's ~100 MB of codes through every cache, so the level's ~3.4 MB of Q8_0 codes come from memory), through the
native int4 decoder (``native-q8``, the Q4_1 GGUF, its Q8_0 lm_head) and the shipped Hydra heads.

For P = 1 and 3 nodes and heads 0 and 1: the median of ``--calls`` level calls back to back (warm), and of the same
calls each right after a one-token forward after 300 cached tokens (cold; the forward itself untimed).

    python studies/native_level_cache.py

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
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from peer_bench import native_model

    from medusa.engines import kv_cache

    model = native_model(args.base, args.heads, "native-q8", args.threads)
    heads, engine = model.heads, model.engine
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.heads.config.vocab_size, (300,), generator=gen)
    one, position, mask = torch.tensor([5]), torch.tensor([300]), torch.ones(1, 1, dtype=torch.bool)
    with torch.inference_mode():
        cache = engine.new_cache(400)
        engine.forward(prompt, torch.arange(300), kv_cache.causal_mask(300, prompt.device), cache)
        hidden = torch.randn(heads.config.hidden_size, generator=gen)
        print("| nodes P | head | warm us | after a forward us |\n|---|---|---|---|")
        for nodes in (1, 3):
            for k in (0, 1):
                path = torch.randint(0, heads.config.vocab_size, (nodes, k + 1), generator=gen)
                if heads.draft_ranked(k, hidden, path, 10) is None:
                    raise SystemExit("these heads have no fused level here")
                warm, cold = [], []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    heads.draft_ranked(k, hidden, path, 10)
                    warm.append(time.perf_counter() - start)
                for _ in range(args.calls // 2):
                    engine.forward(one, position, mask, cache)
                    engine.keep_positions(cache, 300, torch.arange(0))
                    start = time.perf_counter()
                    heads.draft_ranked(k, hidden, path, 10)
                    cold.append(time.perf_counter() - start)
                print(f"| {nodes} | {k} | {statistics.median(warm) * 1e6:.0f} | {statistics.median(cold) * 1e6:.0f} |",
                      flush=True)


if __name__ == "__main__":
    main()
