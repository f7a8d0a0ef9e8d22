"""The heads' teacher-forced accuracy on each native kernel's own greedy continuation: whether heads trained on the
fp32 base's hidden states draft worse from the int8-activation decoder's (``native-q8``) than from the fp32-activation
one (``native``), which would make heads trained on the engine's own hidden states worth their training run.

For each kernel: greedy decoding of the first ``--limit`` prompts (``--max-new-tokens``) through the int4 engine (the
Q4_1 GGUF's codes, its Q8_0 lm_head), then one forward over prompt + continuation through the same engine; the heads
read its hidden states and each head's top-1 is compared with the continuation's token ``k + 2`` ahead, at every
position of the continuation. Printed per kernel: top-1 by head, the top-1 chain (head k right and every head before
it), and the chain's expected tau (1 + the chain's sum).

    python studies/engine_head_accuracy.py --limit 16

Figures: docs/quantized.md ("Fourth pass").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--heads", default=str(REPO / "checkpoints/smollm2-135m-instruct-hydra"))
    parser.add_argument("--prompts", default=str(REPO / "benchmarks/prompts/mt-bench-style.jsonl"))
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from peer_bench import native_model
    from transformers import AutoTokenizer

    from medusa.engines import kv_cache
    from medusa.tools.bench import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    prompts = [encode_prompt(tokenizer, r) for r in read_prompts(args.prompts)][: args.limit]
    for kernel in ("native", "native-q8"):
        model = native_model(args.base, args.heads, kernel, args.threads)
        heads, engine, num = model.heads, model.engine, model.heads.config.num_heads
        right, chain, positions = torch.zeros(num), torch.zeros(num), 0
        with torch.inference_mode():
            for prompt in prompts:
                new, _ = model.generate(prompt, args.max_new_tokens)  # Medusa = plain greedy through the engine
                ids = torch.cat([prompt, torch.tensor(new, dtype=torch.long)])
                cache = engine.new_cache(len(ids) + 8)
                _, hidden = engine.forward(ids, torch.arange(len(ids)), kv_cache.causal_mask(len(ids), ids.device),
                                           cache, logits_for=slice(0, 0))
                logits = heads(hidden.float(), ids)  # (K, T, Vh)
                start, so_far = len(prompt) - 1, None
                for k in range(num):
                    at = torch.arange(start, len(ids) - (k + 2))
                    ok = logits[k, at].argmax(-1) == heads.to_head_ids(ids[at + k + 2])
                    right[k] += ok.sum()
                    so_far = ok if so_far is None else ok & so_far[: len(ok)]
                    chain[k] += so_far.sum()
                positions += len(ids) - 2 - start
        top1 = [round(float(r) / positions, 4) for r in right]
        chained = [round(float(c) / positions, 4) for c in chain]
        print(f"{kernel:10s} top-1 by head {top1}  chain {chained}  expected tau of the chain "
              f"{1 + float(chain.sum()) / positions:.4f}  ({len(prompts)} prompts, {positions} positions)", flush=True)
        del model


if __name__ == "__main__":
    main()
