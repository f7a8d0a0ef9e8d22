"""The machine profile and ``--engine auto`` on a lent GPU (phase ``profile`` of scripts/gpu_check.sh), or on the CPU
with ``--tiny``.

Builds a random base of the Llama-2-7B shape (bf16, built on the device; no downloads), measures this device's
machine profile (:mod:`medusa.profile`: forward cost by engine and step size, plain decoding and HF ``generate`` per
token) into ``--cache-dir``, prints it, and then does what the bench does with it: ``MedusaModel(..., engine="auto")``
with random Medusa heads picks the engine for its tree's step, and one prompt is decoded greedily through it, with
plain decoding and HF ``generate`` timed next to it. Checks: the choice is one of auto's candidates and its reason is
recorded; Medusa's and plain decoding's tokens equal HF greedy's, or first differ at a numerical tie of the dtype
(the bench's rule, :func:`medusa.tools.bench.divergence`; random heads only make tau small, never the tokens wrong);
a second load reads the stored profile instead of measuring again. Exits 1 naming each failed check.

    python scripts/gpu_profile_check.py --out outputs/gpu/gpu-profile.json            # CUDA, 7B shape
    python scripts/gpu_profile_check.py --tiny --device cpu --out /tmp/profile.json    # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SHAPES  # noqa: E402

import medusa.profile as prof  # noqa: E402
from medusa.base import hf_greedy_batch  # noqa: E402
from medusa.drafters.heads import MedusaHeads, MedusaHeadsConfig  # noqa: E402
from medusa.engines import auto_candidates  # noqa: E402
from medusa.model import MedusaModel  # noqa: E402
from medusa.tools.bench import divergence  # noqa: E402
from medusa.tools.measure import load_profile  # noqa: E402
from medusa.tools.report import profile_table  # noqa: E402


def build_base(shape: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random Llama of ``shape``, built directly on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
    return model.eval()


def timed(fn) -> tuple[object, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 7B shape (CPU, seconds)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--cache-dir", default=None, help="profile cache folder (default: next to --out)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens decoded in the engine-choice check")
    p.add_argument("--out", required=True, help="JSON result")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.bfloat16
    out = Path(args.out)
    folder = Path(args.cache_dir) if args.cache_dir else out.with_suffix("") / "cache"
    shape = SHAPES["tiny"] if args.tiny else SHAPES["llama2-7b"]
    base = build_base(shape, device, dtype)

    def progress(text):
        print(text, flush=True)

    profile, measure_s = timed(lambda: load_profile(base, folder=folder, progress=progress))
    step_sizes = [1, 16, 64]
    print(profile_table(profile.to_dict(), str(profile.path), {n: profile.choose_engine(n).reason
                                                               for n in step_sizes}))
    failures = []
    stored, read_s = timed(lambda: load_profile(base, folder=folder))
    if stored.measured != profile.measured or stored.to_dict()["engines"].keys() != profile.engines.keys():
        failures.append("the stored profile was measured again instead of read back")
    if "onednn" in stored.usable() and device.type != "cpu":
        failures.append("onednn is in a GPU profile: it runs as static there")

    vocab, hidden = base.config.vocab_size, base.config.hidden_size
    heads = MedusaHeads(MedusaHeadsConfig(num_heads=3, hidden_size=hidden, vocab_size=vocab),
                        base.get_output_embeddings().weight)
    # The bench's own path: MedusaModel(engine="auto") reads the profile from the cache folder (--cache-dir here).
    os.environ["MEDUSA_CACHE_DIR"] = str(folder)
    model = MedusaModel(base, heads, engine="auto")
    choice = model.engine.choice
    candidates = auto_candidates(device, dtype)
    if choice is None or choice.engine not in candidates or choice.profile != str(profile.path):
        failures.append(f"auto's choice {choice} is not one of {candidates} read from {profile.path}")
    ids = torch.randint(3, vocab, (64,), generator=torch.Generator().manual_seed(1)).to(device)
    model.generate(ids, max_new_tokens=4)  # warm-up
    hf_greedy_batch(base, [ids], 4, set(), 0)
    (tokens, stats), medusa_s = timed(lambda: model.generate(ids, max_new_tokens=args.new_tokens))
    (plain, _), plain_s = timed(lambda: model.generate(ids, max_new_tokens=args.new_tokens, tree=_plain_tree()))
    reference, hf_s = timed(lambda: hf_greedy_batch(base, [ids], args.new_tokens, set(), 0)[0])
    found = {}
    for name, got in (("Medusa", tokens), ("plain decoding", plain)):
        if got != reference:
            found[name] = divergence(base, ids, got, reference, 0)
            if not found[name]["tie"]:
                failures.append(f"{name}'s greedy tokens leave HF generate's at token {found[name]['position']}, "
                                f"not a tie (top-2 gap {found[name]['base_top2_gap']:.3g})")
    result = {
        "shape": "tiny" if args.tiny else "llama2-7b", "dtype": str(dtype), "device": prof.device_name(device),
        "profile": profile.to_dict(), "profile_path": str(profile.path), "measure_s": measure_s, "read_back_s": read_s,
        "choices": {n: profile.choose_engine(n).to_dict() for n in step_sizes},
        "bench_choice": choice.to_dict(),
        "decode": {"new_tokens": len(tokens), "tau": stats.tau, "medusa_tokens_per_s": len(tokens) / medusa_s,
                   "plain_tokens_per_s": len(plain) / plain_s, "hf_tokens_per_s": len(reference) / hf_s,
                   "identical": tokens == reference, "plain_identical": plain == reference,
                   "divergences": found},
        "failures": failures,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    d = result["decode"]
    print(f"auto chose {choice.engine} for a {choice.step_size}-token step: {choice.reason}")
    print(f"decode {d['new_tokens']} tokens: Medusa {d['medusa_tokens_per_s']:.1f} tok/s (tau {d['tau']:.2f}, random "
          f"heads), plain {d['plain_tokens_per_s']:.1f}, HF generate {d['hf_tokens_per_s']:.1f}; identical "
          f"{d['identical']}; profile measured in {measure_s:.1f} s, read back in {read_s:.2f} s -> {out}")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _plain_tree():
    from medusa.decode.tree import Tree

    return Tree.chain(0)


if __name__ == "__main__":
    sys.exit(main())
