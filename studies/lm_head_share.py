"""The lm_head's share of one base forward: a forward over n new tokens after a cached prompt, timed with the
full lm_head, with no lm_head (hidden states only), and with the lm_head on one position only (path-only scoring's
floor), fp32, in one process. Then the drafting side: the heads' vocabulary projection per step (``--heads`` rows,
one per head, through the shared lm_head) over the full vocabulary and over a truncated head vocabulary of each
``--head-vocab`` size (the rows of the most frequent targets: the same product over fewer rows).

    OMP_NUM_THREADS=2 .venv/bin/python studies/lm_head_share.py --base models/gemma3-270m
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--sizes", default="1,8,16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--heads", type=int, default=4, help="rows projected per drafting step (one per head)")
    parser.add_argument("--head-vocab", default="4096,8192,16384", help="truncated head vocabulary sizes timed")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    vocab, hidden = model.get_output_embeddings().weight.shape
    prompt = torch.randint(10, 1000, (1, args.context))
    cache = DynamicCache(config=model.config)
    model(prompt, past_key_values=cache, use_cache=True)
    print(f"{args.base}: vocabulary {vocab}, hidden {hidden}, context {args.context}, threads "
          f"{torch.get_num_threads()}")
    for n in (int(s) for s in args.sizes.split(",")):
        ids = torch.randint(10, 1000, (1, n))
        times = {"full": [], "no lm_head": [], "lm_head on 1 position": []}
        for _ in range(args.repeats):
            for mode in times:
                step_cache = copy.deepcopy(cache)  # the cached prompt, untouched by earlier runs
                start = time.perf_counter()
                out = model.model(ids, past_key_values=step_cache, use_cache=True)
                h = out.last_hidden_state
                if mode == "full":
                    model.lm_head(h)
                elif mode == "lm_head on 1 position":
                    model.lm_head(h[:, -1:])
                times[mode].append(time.perf_counter() - start)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        print(f"n={n:3d}: full {med['full']:.1f} ms, no lm_head {med['no lm_head']:.1f} ms, lm_head on 1 position "
              f"{med['lm_head on 1 position']:.1f} ms; lm_head share {1 - med['no lm_head'] / med['full']:.0%}")
    # The heads keep their shared projection transposed, (H, Vh) contiguous (medusa/drafters/heads.py): time that.
    weight_t = model.get_output_embeddings().weight.T.contiguous()  # (H, V)
    rows = torch.randn(args.heads, hidden)
    full = median_ms(lambda: rows @ weight_t, args.repeats)
    weight = model.get_output_embeddings().weight  # (V, H): the base's own layout, for comparison
    base_layout = median_ms(lambda: torch.nn.functional.linear(rows, weight), args.repeats)
    print(f"heads' projection, {args.heads} rows: full vocabulary ({vocab}) {full:.2f} ms ((V, H) layout, as the "
          f"base's lm_head: {base_layout:.2f} ms)")
    for size in (int(s) for s in args.head_vocab.split(",")):
        sub = weight_t[:, :size].contiguous()  # any `size` columns cost the same: a truncated vocabulary's rows
        cut = median_ms(lambda sub=sub: rows @ sub, args.repeats)
        print(f"  truncated to {size}: {cut:.2f} ms ({cut / full:.1%} of full, saves {full - cut:.2f} ms per step)")


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after one warm-up, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


if __name__ == "__main__":
    main()
