"""One device, no downloads: decode-step costs of every engine, HF ``generate``, plain and Medusa decoding, and the
weight-read floor, written to one JSON (issue 7). ``studies/bench_gpu.sh`` runs it on a CUDA device.

Without ``--base`` a Llama-2-7B-shaped model with random weights is built on the device (``--shape tiny``: a
2-layer model, what the CPU test suite runs with ``--device cpu``). Random heads (4 Medusa heads) give a low tau:
the Medusa rows measure what a step of 16, 32 or 64 nodes costs against a plain step, not the heads.

Figures:
- ``step_ms[engine][n]``: one forward over n new tokens after ``--prefix`` cached ones (lm_head on one row), median;
- ``hf_generate_ms_per_token``: Hugging Face greedy ``generate``;
- ``plain[engine]`` and ``medusa[engine][nodes]``: our decoding through each engine (ms per token and per step);
- ``floor_ms``: bytes of the weights over the measured device-to-device copy bandwidth (the least one decode step
  at batch 1 can cost when it reads every weight once).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from medusa.decode.loop import medusa_generate
from medusa.decode.tree import Tree, grow_tree
from medusa.drafters.heads import MedusaHeadsConfig, build_heads
from medusa.engines import ENGINES, check_dtype, kv_cache, make_engine
from medusa.tools.bench import machine_load

SHAPES = {
    # Llama-2-7B: 32 layers, hidden 4096, MLP 11008, 32 heads, vocabulary 32000.
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
}


def build_model(args, dtype, device):
    """A local model folder, or a random model of ``args.shape`` built directly on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.base:
        model = AutoModelForCausalLM.from_pretrained(args.base, dtype=dtype).to(device)
        return model.eval()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES[args.shape]), dtype=dtype)
    return model.eval()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(times: list[float]) -> float:
    return 1e3 * sorted(times)[len(times) // 2]


@torch.inference_mode()
def step_costs(engines: dict, sizes: list[int], prefix: int, repeats: int) -> dict[str, dict]:
    """Median and least ms of one forward over n new tokens after ``prefix`` cached ones, for each engine and n;
    rounds interleave every (engine, n), so machine noise hits all alike."""
    first = next(iter(engines.values()))
    model, device = first.model, first.model.device
    vocab = model.config.vocab_size
    caches = {}
    for name, engine in engines.items():
        caches[name] = engine.new_cache(prefix + max(sizes))
        engine.forward(torch.randint(0, vocab, (prefix,), device=device), torch.arange(prefix, device=device),
                       kv_cache.causal_mask(prefix, device), caches[name], logits_for=slice(-1, None))
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in engines for n in sizes}
    for _ in range(repeats + 1):  # the first round warms up
        for name, n in times:
            ids = torch.randint(0, vocab, (n,), device=device)
            sync(device)
            start = time.perf_counter()
            engines[name].forward(ids, prefix + torch.arange(n, device=device), kv_cache.causal_mask(n, device),
                                  caches[name], logits_for=slice(-1, None))
            sync(device)
            times[name, n].append(time.perf_counter() - start)
            engines[name].keep_positions(caches[name], prefix, torch.zeros(0, dtype=torch.long, device=device))
    return {name: {str(n): median_ms(times[name, n][1:]) for n in sizes} for name in engines} | {
        f"{name}_min": {str(n): 1e3 * min(times[name, n][1:]) for n in sizes} for name in engines}


@torch.inference_mode()
def hf_generate_ms(model, prompt: torch.Tensor, new_tokens: int) -> float:
    ids = prompt[None]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    sync(model.device)
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    sync(model.device)
    return 1e3 * (time.perf_counter() - start) / new_tokens


def decode(engine, heads, prompt: torch.Tensor, tree: Tree, new_tokens: int) -> dict:
    """One untimed short run, then one timed run of our decoding through ``engine``."""
    medusa_generate(engine.model, heads, prompt, tree, 4, engine=engine)
    sync(engine.model.device)
    start = time.perf_counter()
    out, stats = medusa_generate(engine.model, heads, prompt, tree, new_tokens, engine=engine)
    sync(engine.model.device)
    seconds = time.perf_counter() - start
    return {"tokens": len(out), "ms_per_token": 1e3 * seconds / len(out), "tau": stats.tau,
            "ms_per_step": 1e3 * stats.decode_s / max(stats.decode_steps, 1),
            "step_parts_ms": {k: 1e3 * v / max(stats.decode_steps, 1) for k, v in stats.step_s.items()}}


@torch.inference_mode()
def floor_ms(model, repeats: int = 5) -> dict:
    """The weight-read floor: the weights' bytes over a measured device-to-device copy bandwidth."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    device = model.device
    n = min(weight_bytes, 2 << 30) // 4
    src, dst = torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    seconds = sorted(times[1:])[len(times[1:]) // 2]
    bandwidth = 2 * n * 4 / seconds  # a copy reads and writes every byte
    return {"weight_bytes": weight_bytes, "copy_bytes_per_s": bandwidth, "floor_ms": 1e3 * weight_bytes / bandwidth}


def random_heads(model, num_heads: int = 4):
    weight = model.get_output_embeddings().weight
    config = MedusaHeadsConfig(hidden_size=weight.shape[1], vocab_size=weight.shape[0], num_heads=num_heads)
    heads = build_heads(config, weight.detach(), model.get_input_embeddings().weight.detach())
    for p in heads.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.02)
    return heads.to(device=model.device, dtype=weight.dtype).eval()


def tree_of(nodes: int, num_heads: int = 4, top_k: int = 10) -> Tree:
    """A tree of ``nodes`` non-root nodes grown from a typical accuracy profile (head k, rank r: 0.6^(k+1)/(r+1))."""
    accuracy = torch.tensor([[0.6 ** (k + 1) / (r + 1) for r in range(top_k)] for k in range(num_heads)])
    return grow_tree(accuracy, nodes, name=f"grown-{nodes}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--base", help="a local model folder instead of a random model")
    p.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 4, 16, 32, 64], help="tokens per step timed")
    p.add_argument("--trees", nargs="+", type=int, default=[16, 32, 64], help="Medusa tree sizes (non-root nodes)")
    p.add_argument("--prefix", type=int, default=256, help="cached tokens before each timed step")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per decoding run")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    check_dtype(dtype, args.device)
    model = build_model(args, dtype, args.device)
    heads = random_heads(model)
    prompt = torch.randint(0, model.config.vocab_size, (args.prefix,), device=model.device)
    trees = {n: tree_of(n) for n in args.trees}
    result = {"device": str(model.device), "dtype": args.dtype, "model": args.base or args.shape,
              "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
              "prefix": args.prefix, "new_tokens": args.new_tokens, **floor_ms(model),
              "hf_generate_ms_per_token": hf_generate_ms(model, prompt, args.new_tokens),
              "step_ms": {}, "plain": {}, "medusa": {}, "engines": {}}
    needed = args.prefix + args.new_tokens + max([*args.sizes, *[n + 1 for n in args.trees]])
    engines = {}
    for name in args.engines:
        engines[name] = make_engine(name, model, **({} if name == "eager" else {"max_cache_len": needed}))
        engines[name].sync_timing = True
        engines[name].warm_up(sorted({*args.sizes, *[n + 1 for n in args.trees]}), needed)
    result["step_ms"] = step_costs(engines, args.sizes, args.prefix, args.repeats)
    for name, engine in engines.items():
        result["plain"][name] = decode(engine, heads, prompt, Tree.chain(0), args.new_tokens)
        result["medusa"][name] = {str(n): decode(engine, heads, prompt, tree, args.new_tokens)
                                  for n, tree in trees.items()}
        result["engines"][name] = engine.settings()
    result["load"] = machine_load(torch.get_num_threads())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
