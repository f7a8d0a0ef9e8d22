"""The fp32 products a decode step runs, by rows, on the real model's weight shapes: torch's ``F.linear`` (MKL), the
``onednn`` engine's packed copy and the ``native`` engine's C product (:class:`medusa.engines.native.NativeDense`);
and one forward of a token (and of a tree of ``--tree`` nodes) through the ``onednn`` and ``native`` engines.

Each product is timed in rounds of calls, its weights read from memory each call (the lm_head's 113 MB do not fit in
a cache; the decoder's seven weights of a layer are timed over 30 distinct copies, as a forward reads them), the best
of 3 rounds; the engines' forwards after 200 cached tokens, median of 30.

    python studies/f32_products.py --threads 2 --out docs/results/f32-products-smollm2-135m-cpu.json

Figures: docs/engines.md ("The native engine").
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def best_ms(fn, calls: int, rounds: int = 3) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=str(REPO / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    parser.add_argument("--tree", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from medusa.engines import kv_cache, make_engine
    from medusa.engines.native import NativeDense
    from medusa.engines.onednn import packed_product
    from medusa.profile import cpu_info

    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    head = model.get_output_embeddings().weight.detach()
    layer = model.model.layers[0]
    shapes = [layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight,
              layer.self_attn.o_proj.weight, layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight,
              layer.mlp.down_proj.weight]
    layers = [[w.detach().clone() for w in shapes] for _ in range(30)]  # 30 distinct copies, as a forward reads
    result = {"machine": cpu_info(), "python": platform.python_version(), "torch": torch.__version__,
              "threads": args.threads, "products_ms": {}, "forward_ms": {}}
    ways = {
        "F.linear": lambda w: (lambda x: torch.nn.functional.linear(x, w)),
        "onednn packed": packed_product,
        "native C": lambda w: NativeDense(w).product,
    }
    with torch.no_grad():
        for name, make in ways.items():
            lm, stack = make(head), [[make(w) for w in ws] for ws in layers]
            row = {}
            for m in args.rows:
                x, xi = torch.randn(m, head.shape[1]), torch.randn(m, layer.mlp.down_proj.weight.shape[1])

                def decoder(x=x, xi=xi, stack=stack):
                    for products in stack:
                        for i, p in enumerate(products):
                            p(xi if i == 6 else x)

                row[m] = {"lm_head": best_ms(lambda x=x, lm=lm: lm(x), 20), "decoder linears": best_ms(decoder, 10)}
            result["products_ms"][name] = row
            print(name, {m: {k: round(v, 2) for k, v in r.items()} for m, r in row.items()}, flush=True)
        del stack
        ids = torch.randint(0, head.shape[0], (200,), generator=torch.Generator().manual_seed(0))
        n = args.tree
        tree_mask = torch.ones(n, n).tril().bool()
        for name in ("onednn", "native"):
            engine = make_engine(name, model)
            out = {}
            one = torch.ones(1, 1, dtype=torch.bool)
            for label, size, mask in (("1 token", 1, one), (f"{n} nodes", n, tree_mask)):
                times = []
                for _ in range(30):
                    cache = engine.new_cache(200 + n)  # a fresh prompt each time: the step sees 200 cached tokens
                    engine.forward(ids, torch.arange(200), kv_cache.causal_mask(200, ids.device), cache,
                                   logits_for=slice(-1, None))
                    start = time.perf_counter()
                    engine.forward(ids[:size], 200 + torch.arange(size), mask, cache)
                    times.append(time.perf_counter() - start)
                out[label] = sorted(times)[len(times) // 2] * 1e3
            result["forward_ms"][name] = out
            print(name, {k: round(v, 2) for k, v in out.items()}, flush=True)
            del engine
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
