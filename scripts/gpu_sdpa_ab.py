"""A/B on one CUDA device, in one process: the static engine with torch's own attention-kernel choice (cuDNN on an
H200 in bf16) against the engine's default (no cuDNN attention), and the eager engine; plain decoding and random-head
trees of 16 and 64 nodes, two passes (the first meets every key length for the first time, the second again).
Llama-2-7B shape, random bf16 weights; ``--device cpu --shape tiny`` is a dry run. Writes one JSON.

    PYTHONPATH=. python scripts/gpu_sdpa_ab.py --out outputs/gpu/gpu-sdpa-ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SHAPES, build_model, hf_generate_ms, random_heads, sync, tree_of  # noqa: E402

from medusa.decode.loop import medusa_generate  # noqa: E402
from medusa.decode.tree import Tree  # noqa: E402
from medusa.engines import make_engine  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(argparse.Namespace(base=None, shape=args.shape), dtype, args.device)
    heads = random_heads(model)
    prompt = torch.randint(0, model.config.vocab_size, (256,), device=model.device)
    engines = {"static-default-sdpa": make_engine("static", model), "static-no-cudnn": make_engine("static", model),
               "eager": make_engine("eager", model)}
    engines["static-default-sdpa"].sdpa_backends = None  # torch's own choice of attention kernel
    trees = {"plain": Tree.chain(0), "tree16": tree_of(16), "tree64": tree_of(64)}
    result = {"hf_generate_ms_per_token": hf_generate_ms(model, prompt, args.new_tokens), "torch": torch.__version__}
    for engine in engines.values():
        engine.sync_timing = True
    for rnd in range(2):
        for tree_name, tree in trees.items():
            for name, engine in engines.items():
                medusa_generate(model, heads, prompt, tree, 4, engine=engine)
                sync(model.device)
                start = time.perf_counter()
                out, stats = medusa_generate(model, heads, prompt, tree, args.new_tokens, engine=engine)
                sync(model.device)
                ms = 1e3 * (time.perf_counter() - start) / len(out)
                parts = {k: 1e3 * v / stats.decode_steps for k, v in stats.step_s.items()}
                result[f"{name}/{tree_name}/round{rnd}"] = {"ms_per_token": ms, "tau": stats.tau,
                                                            "step_parts_ms": parts}
                print(name, tree_name, rnd, f"{ms:.2f} ms/token", flush=True)
    result["settings"] = {k: e.settings() for k, e in engines.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
