"""A first measurement of the int4/int8 engines against fp32 ``onednn`` on the prepared SmolLM2-135M.

Figures and their reading: docs/quantized.md.

One process, one thread, the engines interleaved round by round (the machine is shared: read the ratios, not the
milliseconds). Measures: one forward over 1, 8 and 16 new tokens after a 64-token prompt (median ms); the one-token
forward with every quantized linear replaced by a no-op (the cost outside the matrix products); plain greedy and
Medusa tokens/s; teacher-forced top-1 agreement and KL of each engine against fp32 along fp32's greedy tokens; the
quantized bytes. Writes JSON to ``--out``.

    OMP_NUM_THREADS=1 python studies/quantized_bench.py --out /tmp/quantized.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {  # label -> (engine, options)
    "fp32 onednn": ("onednn", {}),
    "int4 gguf, lm_head fp32": ("int4", {"gguf": None}),
    "int4 gguf, base attention (not row-invariant)": ("int4", {"gguf": None}),
    "int4 weights, lm_head int4": ("int4", {"lm_head": True}),
    "int8 weights, lm_head fp32": ("int8", {}),
}


class NoOpLinear(nn.Module):
    """Zeros of a linear layer's output shape: what a forward costs without its matrix products."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.out_features)


def without_linears(engine):
    from medusa.engines import quantized

    for module in list(engine.quantized.decoder.modules()):
        for name, child in module._modules.items():
            if isinstance(child, (quantized.Int4Linear, quantized.Int8Linear)):
                module._modules[name] = NoOpLinear(child.out_features)
    return engine


def base_attention(engine):
    """``engine`` with its decoding steps on the base's own attention (all rows at once): what row-invariance costs.
    Speculation through it is no longer exact (docs/quantized.md)."""
    from medusa.engines import quantized

    steps, forward = quantized.row_invariant_steps, engine._forward
    engine._forward = lambda *a, **k: _without_invariance(steps, forward, *a, **k)
    return engine


def _without_invariance(steps, forward, *args, **kwargs):
    from medusa.engines import quantized

    quantized.row_invariant_steps = lambda on=True: steps(False)
    try:
        return forward(*args, **kwargs)
    finally:
        quantized.row_invariant_steps = steps


@torch.inference_mode()
def time_forwards(engines: dict, prompt: torch.Tensor, sizes=(1, 8, 16), rounds: int = 15) -> dict:
    """Median ms of one forward over ``n`` new tokens after ``prompt``, per engine, interleaved by round."""
    setups = {}
    for label, engine in engines.items():
        cache = engine.new_cache(len(prompt) + max(sizes))
        engine.forward(prompt, torch.arange(len(prompt)), torch.ones(len(prompt), len(prompt)).tril().bool(), cache)
        setups[label] = cache
    times = {(label, n): [] for label in engines for n in sizes}
    ids = prompt[:max(sizes)]
    for r in range(rounds + 2):
        for n in sizes:
            mask = torch.ones(n, n).tril().bool()
            positions = torch.arange(len(prompt), len(prompt) + n)
            for label, engine in engines.items():
                start = time.perf_counter()
                engine.forward(ids[:n], positions, mask, setups[label], slice(-1, None))
                elapsed = time.perf_counter() - start
                engine.keep_positions(setups[label], len(prompt), torch.empty(0, dtype=torch.long))
                if r >= 2:  # two warm-up rounds
                    times[(label, n)].append(elapsed * 1000)
    return {label: {str(n): round(statistics.median(times[(label, n)]), 2) for n in sizes} for label in engines}


def interleaved_decode(medusa, gguf: str, prompts: list, max_new_tokens: int, rounds: int = 2) -> dict:
    """Tok/s of fp32 ``onednn`` and ``int4`` (GGUF codes) run back to back per prompt and tree (best round), and
    how many prompts each tree's tokens equal plain decoding's through the same engine."""
    from medusa.decode.tree import Tree
    from medusa.model import MedusaModel

    models = {"fp32 onednn": medusa, "int4 gguf": MedusaModel(medusa.base, medusa.heads, tree=medusa.tree,
                                                              tokenizer=medusa.tokenizer, engine="int4", gguf=gguf)}
    medusa.use_engine("onednn")
    trees = {"plain": Tree.chain(0), "chain2": Tree.chain(2), "shipped, no lookup": medusa.tree.with_lookup(0),
             "shipped": medusa.tree}
    seconds, outs = {}, {}
    for r in range(rounds):
        for i, ids in enumerate(prompts):
            for tree_name, tree in trees.items():
                for label, model in models.items():
                    start = time.perf_counter()
                    outs[(label, tree_name, i)] = model.generate(ids, max_new_tokens, tree=tree, stop_token_ids=set(),
                                                                 do_sample=False)[0]
                    seconds.setdefault((label, tree_name), [0.0] * rounds)[r] += time.perf_counter() - start
    total, n = max_new_tokens * len(prompts), len(prompts)
    return {f"{label} / {tree_name}": {
        "tok_s": round(total / min(s), 2), "tok_s_rounds": [round(total / x, 2) for x in s],
        "identical_to_plain": sum(outs[(label, tree_name, i)] == outs[(label, "plain", i)] for i in range(n))}
        for (label, tree_name), s in seconds.items()}


@torch.inference_mode()
def profile_one_token(engine, prompt: torch.Tensor, steps: int = 20, top: int = 12) -> list[dict]:
    """The ops taking the most self CPU time over ``steps`` one-token forwards (torch.profiler), ms per forward."""
    from torch.profiler import ProfilerActivity, profile

    cache = engine.new_cache(len(prompt) + 1)
    engine.forward(prompt, torch.arange(len(prompt)), torch.ones(len(prompt), len(prompt)).tril().bool(), cache)
    one = torch.ones(1, 1, dtype=torch.bool)
    position = torch.tensor([len(prompt)])

    def step():
        engine.forward(prompt[:1], position, one, cache, slice(-1, None))
        engine.keep_positions(cache, len(prompt), torch.empty(0, dtype=torch.long))

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls_per_forward": e.count / steps,
             "self_ms_per_forward": round(e.self_cpu_time_total / 1000 / steps, 3)} for e in events]


@torch.no_grad()
def teacher_forced(engine, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probabilities ``(T - prompt_len, V)`` of ``engine`` at the generated positions of ``ids``."""
    cache = engine.new_cache(len(ids))
    logits, _ = engine.forward(ids, torch.arange(len(ids)), torch.ones(len(ids), len(ids)).tril().bool(), cache,
                               slice(prompt_len - 1, len(ids) - 1))
    return logits.float().log_softmax(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--base", default="models/smollm2-135m-instruct")
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-hydra")
    parser.add_argument("--gguf", help="the GGUF the base was prepared from (default: the reference)")
    parser.add_argument("--prompts", default="benchmarks/prompts/sharegpt-held-out.jsonl")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--interleaved-decode-only", action="store_true",
                        help="only fp32 onednn against int4 decoding, back to back per prompt and tree")
    parser.add_argument("--profile-only", action="store_true",
                        help="only profile the int4 engine's one-token forward (torch.profiler, top ops)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from medusa import engines as registry
    from medusa.decode.tree import Tree
    from medusa.io.prepare import reference_gguf_path
    from medusa.model import MedusaModel
    from medusa.tools.bench import encode_prompt

    gguf = args.gguf or str(reference_gguf_path())
    VARIANTS["int4 gguf, lm_head fp32"][1]["gguf"] = gguf
    medusa = MedusaModel.from_pretrained(args.base, args.heads, per_step=False, engine="onednn")
    base = medusa.base
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][:args.limit]
    prompts = [encode_prompt(medusa.tokenizer, row) for row in rows]
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1,
              "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens, "gguf": gguf}

    if args.interleaved_decode_only:
        result["interleaved_decode"] = interleaved_decode(medusa, gguf, prompts, args.max_new_tokens)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["interleaved_decode"], indent=1))
        return 0
    if args.profile_only:
        prompt = torch.cat(prompts)[:64]
        result["profile_int4_one_token"] = profile_one_token(registry.make_engine("int4", base, gguf=gguf), prompt)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["profile_int4_one_token"], indent=1))
        return 0
    start = time.perf_counter()
    made = {label: registry.make_engine(name, base, **options) for label, (name, options) in VARIANTS.items()}
    base_attention(made["int4 gguf, base attention (not row-invariant)"])
    result["build_s"] = round(time.perf_counter() - start, 1)
    result["settings"] = {label: {k: v for k, v in e.settings().items() if k not in ("auto",)}
                          for label, e in made.items()}
    result["fp32_weight_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
    noop = without_linears(registry.make_engine("int4", base, lm_head=True))
    long_prompt = torch.cat(prompts)[:64]
    if len(long_prompt) < 64:
        long_prompt = torch.cat([long_prompt, long_prompt])[:64]
    result["forward_ms"] = time_forwards({**made, "int4, every linear a no-op": noop}, long_prompt)

    # Greedy decoding: plain (the top-1 chain of no drafts) and Medusa (the heads' tree) through each engine.
    decode = {}
    fp32_tokens = []
    for label, (name, options) in VARIANTS.items():
        medusa.use_engine(name, **options)
        if "base attention" in label:
            base_attention(medusa.engine)
        plain_tokens, medusa_tokens, plain_s, medusa_s, steps = [], [], 0.0, 0.0, 0
        for ids in prompts:
            t = time.perf_counter()
            plain = medusa.generate(ids, args.max_new_tokens, tree=Tree.chain(0), stop_token_ids=set(),
                                    do_sample=False)[0]
            plain_s += time.perf_counter() - t
            t = time.perf_counter()
            drafted, stats = medusa.generate(ids, args.max_new_tokens, stop_token_ids=set(), do_sample=False)
            medusa_s += time.perf_counter() - t
            plain_tokens.append(plain)
            medusa_tokens.append(drafted)
            steps += stats.decode_steps
        if label == "fp32 onednn":
            fp32_tokens = plain_tokens
        total, drafted_total = sum(map(len, plain_tokens)), sum(map(len, medusa_tokens))
        decode[label] = {
            "plain_tok_s": round(total / plain_s, 2), "medusa_tok_s": round(drafted_total / medusa_s, 2),
            "tokens_per_step": round(drafted_total / steps, 2),
            "identical_to_plain": sum(a == b for a, b in zip(plain_tokens, medusa_tokens, strict=True)) / len(prompts),
            "prompts_identical_to_fp32": sum(a == b for a, b in zip(plain_tokens, fp32_tokens, strict=True)),
            "first_divergence": [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                                 for a, b in zip(plain_tokens, fp32_tokens, strict=True)]}
    result["decode"] = decode

    # Teacher-forced agreement along fp32's own greedy tokens (each position judged on the same context).
    agreement = {}
    for label, engine in made.items():
        agree, total, kl = 0, 0, 0.0
        for ids, tokens in zip(prompts, fp32_tokens, strict=True):
            seq = torch.cat([ids, torch.tensor(tokens)])
            ref = teacher_forced(made["fp32 onednn"], seq, len(ids))
            got = teacher_forced(engine, seq, len(ids))
            agree += (got.argmax(-1) == ref.argmax(-1)).sum().item()
            total += len(tokens)
            kl += (ref.exp() * (ref - got)).sum().item()
        agreement[label] = {"top1": round(agree / total, 4), "kl_per_token": round(kl / total, 5)}
    result["teacher_forced"] = agreement
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("forward_ms", "decode", "teacher_forced")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
