"""What feeding the heads' own attention layer costs a decoding step (``HydraHeads.extend_context``: the accepted
positions appended to the layer's cache, and the drafting input computed): microseconds per call over ``n``
accepted positions, with the layer's linears through ``nn.Linear`` (fp32) and through the native int4 decoder's
drafter products (Q8_0 in C), warm (the same call repeated) and after flushing the caches (as in decoding, where
the base's forward has just streamed its weights through them).

    python studies/prefix_extend_cost.py --heads outputs/smollm2-135m-hydra-4k-prefix/heads --threads 2

Figures: docs/training.md ("Two more runs on the same 4,000 answers").
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", required=True, help="Hydra heads with prefix_layers: 1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from peer_bench import native_model

    from medusa.tools.measure import _cache_evictor

    model = native_model(args.base, args.heads, "native-q8", args.threads)
    heads = model.heads
    if getattr(heads, "prefix", None) is None:
        raise SystemExit(f"{args.heads}: no prefix layer (prefix_layers: 0)")
    hidden_size = heads.config.hidden_size
    evict = _cache_evictor("cpu")
    generator = torch.Generator().manual_seed(0)

    def per_call(n: int, products: bool, flush: bool) -> float:
        heads.drafter_products = model.engine.drafter_product if products else None
        heads.__dict__.pop("_products", None)
        context = heads.new_context()
        with torch.inference_mode():
            heads.extend_context(context, torch.randn(40, hidden_size, generator=generator),
                                 torch.randint(0, 1000, (40,), generator=generator))  # a prompt's prefill
            times = []
            for _ in range(args.calls):
                hidden = torch.randn(n, hidden_size, generator=generator)
                tokens = torch.randint(0, 1000, (n,), generator=generator)
                if flush:
                    evict()
                start = time.perf_counter()
                heads.extend_context(context, hidden, tokens)
                times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times)

    print(f"| accepted positions | fp32 warm | fp32 flushed | Q8_0 products warm | Q8_0 products flushed |  "
          f"({args.threads} threads, median us per call)")
    print("|---|---|---|---|---|")
    for n in (1, 2, 3, 5):
        cells = [per_call(n, products, flush) for products in (False, True) for flush in (False, True)]
        print(f"| {n} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)
    heads.drafter_products = model.engine.drafter_product
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
