"""The int4 products one at a time: torch's kernel (bf16 activations) against the native decoder's fp32 and int8-block
products, on SmolLM2-135M's layer shapes, and the lm_head three ways; each figure the median of 200 calls after 10
untimed ones, on random codes (the shapes decide the cost, not the values).

    python studies/native_products.py --threads 2

Results: docs/quantized.md ("The native decoder").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"q/k/v fused": (960, 576), "o": (576, 576), "gate/up fused": (3072, 576), "down": (576, 1536)}


def timed(fn, *args, repeats: int = 200) -> float:
    """Median microseconds of ``fn(*args)``."""
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from medusa.engines import native
    from medusa.engines.checked_head import bf16_product
    from medusa.engines.int4 import quantize_int4
    from medusa.engines.quantized import Int4Linear

    print(f"# native library: {native.isa()}, "
          f"{args.threads} threads")
    gen = torch.Generator().manual_seed(0)
    rows = (1, 2, 4, 8, 16)
    totals = {kind: dict.fromkeys(rows, 0.0) for kind in ("torch", "native", "native-q8")}
    with torch.inference_mode():
        for n, k in SHAPES.values():
            codes = quantize_int4(torch.randn(n, k, generator=gen))
            layers = {"torch": Int4Linear(*codes), "native": native.NativeCodes(*codes),
                      "native-q8": native.NativeCodesQ8(*codes)}
            for m in rows:
                x = torch.randn(m, k, generator=gen)
                xb = x.to(torch.bfloat16)
                totals["torch"][m] += timed(layers["torch"].product, xb)
                totals["native"][m] += timed(layers["native"].product, x)
                totals["native-q8"][m] += timed(layers["native-q8"].product, x)
        print("\none layer's four products (us), times 30 layers in ms in brackets")
        print("| kernel | " + " | ".join(f"M={m}" for m in rows) + " |\n|---|" + "---|" * len(rows))
        for kind, by_rows in totals.items():
            print(f"| {kind} | " + " | ".join(f"{t:.0f} ({30 * t / 1000:.2f})" for t in by_rows.values()) + " |")
        v, k = 49152, 576
        q8 = torch.randint(-127, 128, (v, k), generator=gen, dtype=torch.int8)
        d = torch.rand(v, k // 32, generator=gen) * 0.01
        bf16 = (q8.float() * d.repeat_interleave(32, 1)).to(torch.bfloat16)
        heads = {"bf16 oneDNN packed (the checked head's product)": bf16_product(bf16),
                 "Q8_0 in C, fp32 activations": native.NativeHead(q8, d).logits,
                 "Q8_0 in C, int8 activations (VNNI)": native.NativeHead(q8, d, int8_activations=True).logits}
        print(f"\nthe lm_head ({v} x {k}), ms")
        print("| product | M=1 | M=4 | M=8 |\n|---|---|---|---|")
        for name, product in heads.items():
            cells = []
            for m in (1, 4, 8):
                x = torch.randn(m, k, generator=gen)
                x = x.to(torch.bfloat16) if name.startswith("bf16") else x
                cells.append(f"{timed(product, x, repeats=50) / 1000:.2f}")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
