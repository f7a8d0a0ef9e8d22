"""Seconds per training step of each drafter on the real base, in one process (what the equal-wall-time column of
docs/eagle.md is computed from): the drafter's forward over a store batch, the teacher logits from the stored last
hidden state, the decayed teacher loss, backward and the optimizer step; the base is not run (the store has its
states). Batch 8 x 96 positions, draft vocabulary 8,192, as the configs in configs/eagle-comparison/.

    python studies/train_step_cost.py --base models/smollm2-135m-instruct --steps 10
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from medusa.base import load_base  # noqa: E402
from medusa.drafters.eagle import default_eagle_layers, eagle_base_settings  # noqa: E402
from medusa.drafters.heads import MedusaHeadsConfig, build_heads, head_lookup_table  # noqa: E402
from medusa.losses import medusa_loss  # noqa: E402


def drafter(kind: str, base, token_map: torch.Tensor, ttt: int):
    text = base.config.get_text_config(decoder=True)
    extra = {}
    if kind == "eagle":
        settings = eagle_base_settings(text)
        extra = {"eagle_layers": default_eagle_layers(settings["num_hidden_layers"]), "eagle_base": settings}
    config = MedusaHeadsConfig(hidden_size=text.hidden_size, vocab_size=text.vocab_size,
                               num_heads=5 if kind == "eagle" else 4, head_type=kind, head_vocab_size=len(token_map),
                               **extra)
    heads = build_heads(config, base.get_output_embeddings().weight, base.get_input_embeddings().weight, token_map)
    return heads, (ttt if kind == "eagle" else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ttt-steps", type=int, nargs="+", default=[3])
    args = p.parse_args()
    base, _ = load_base(args.base)
    vocab, hidden = base.get_output_embeddings().weight.shape
    token_map = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:8192].sort().values
    lookup = head_lookup_table(token_map, vocab)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (8, 96), generator=gen)
    out = {}
    for kind, ttt in [("medusa", None), ("hydra", None)] + [("eagle", t) for t in args.ttt_steps]:
        heads, steps = drafter(kind, base, token_map, ttt or 3)
        width = hidden * (1 + len(heads.base_layers))
        states = torch.randn(8, 96, width, generator=gen)
        opt = torch.optim.AdamW([q for q in heads.parameters() if q.requires_grad], lr=1e-3)
        times = []
        for i in range(args.steps + 2):
            start = time.perf_counter()
            logits = heads(states, ids) if steps is None else heads(states, ids, steps=steps)
            with torch.no_grad():
                teacher = base.get_output_embeddings()(states[..., :hidden])[..., token_map]  # (B, T, Vh)
            loss, _ = medusa_loss(logits, ids, lookup, 0.8, teacher_logits=teacher, loss_type="teacher")
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i >= 2:
                times.append(time.perf_counter() - start)
        name = kind if steps is None else f"eagle-ttt{steps}"
        out[name] = round(sorted(times)[len(times) // 2], 3)
        print(name, out[name], "s/step (median)", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
