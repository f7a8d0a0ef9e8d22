"""Training check on one device: a random Llama-2-7B-shaped base in bf16, synthetic learnable sequences, a hidden-state
store built by the base on the device (train/store.py), then Medusa (optionally Hydra, or alone the eagle drafter,
whose store holds its fused layers too) heads trained from that store by the trainer's own loop
(:func:`train.loop.fit`), saved and loaded back. Checks the training path, not accuracy: the loss is finite at every
step and falls from the first steps to the last, and the saved heads load and give the same logits. Writes one JSON
(steps, first/last loss, steps/s, store build seconds and bytes, peak memory, device, versions) and exits 1 naming
each failed check. No ``datasets`` import and no download anywhere on this path.

    PYTHONPATH=. python scripts/gpu_train_check.py --steps 300 --out outputs/gpu/gpu-train-7b-shape.json
    PYTHONPATH=. python scripts/gpu_train_check.py --tiny --device cpu --out tmp/result.json   # seconds on a CPU

``medusa train`` builds its run with :func:`train.setup.setup`, which reads chat data and a tokenizer; here the base
and the examples are made in-process, so :func:`make_run` assembles the same :class:`train.run.Run` from setup's own
pieces (accelerator, frozen base, ``ensure_store``, fresh heads, optimizer, schedule) and ``fit`` trains it.

The data (:func:`synthetic_examples`): a prompt of random tokens (unsupervised) and an answer that walks a fixed
random cycle of ``--cycle`` token ids from a random start, so the token k + 2 positions ahead is a function of the
current token: heads can learn it (and, at the least, that only the cycle's tokens occur) over any random base.

The store and the run folders (about 1.1 GB and 0.8 GB for the 7B shape) go to a temporary folder, deleted at the
end, unless ``--work-dir`` names one to keep; only the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, get_cosine_schedule_with_warmup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import SHAPES  # noqa: E402

from medusa.base import stop_token_ids  # noqa: E402
from medusa.drafters.heads import HEAD_TYPES, head_lookup_table  # noqa: E402
from medusa.io.checkpoint import load_heads, save_heads  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.loop import fit  # noqa: E402
from train.run import Run  # noqa: E402
from train.setup import (  # noqa: E402
    freeze_base,
    full_base_weights,
    heads_base_layers,
    heads_for_training,
    make_accelerator,
    make_optimizer,
)
from train.store import HiddenStateStore, ensure_store  # noqa: E402

TINY_SHAPE = {**SHAPES["tiny"], "vocab_size": 512}
# Per shape: sequences, tokens per sequence, steps, peak learning rate. 256 x 512 tokens of the 7B shape are a 1.1 GB
# store, one base pass of a few seconds on an H200; 300 steps of batch 8 revisit each sequence about 9 times. The 7B
# shape trains at TrainConfig's learning rate; the tiny base's lm_head rows are short (hidden 64), so its heads need
# larger steps to move the logits within a few dozen steps.
DEFAULTS = {"llama2-7b": (256, 512, 300, TrainConfig.learning_rate), "tiny": (32, 64, 40, 3e-2)}
LOSS_WINDOW = 20
"""Steps averaged at each end of the run for the loss-went-down check (fewer when the run is short)."""
FIRST_TOKEN = 3  # ids 0, 1, 2 are Llama's pad, bos and eos


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a 2-layer base (hidden 64, vocab 512) instead of Llama-2-7B")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--steps", type=int, help="optimizer steps per head type (default 300, --tiny 40)")
    p.add_argument("--sequences", type=int, help="synthetic sequences (default 256, --tiny 32)")
    p.add_argument("--seq-len", type=int, help="longest sequence in tokens (default 512, --tiny 64)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step and per base forward of the store")
    p.add_argument("--head-types", nargs="+", default=["medusa"], choices=sorted(HEAD_TYPES))
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--learning-rate", type=float, help="peak AdamW learning rate (default 1e-3, --tiny 3e-2)")
    p.add_argument("--cycle", type=int, default=64, help="distinct answer tokens (the cycle the answers walk)")
    p.add_argument("--mixed-precision", default=TrainConfig.mixed_precision, choices=("auto", "no", "bf16"),
                   help="the trainer's autocast (auto: bf16 on CUDA, none on a CPU; bf16 runs CUDA's path on a CPU)")
    p.add_argument("--min-drop", type=float, default=0.1,
                   help="the last steps' mean loss must be below (1 - this) x the first steps' mean")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="keep the store and run folders here (default: a temporary folder, deleted)")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    args.shape = "tiny" if args.tiny else "llama2-7b"
    sequences, seq_len, steps, learning_rate = DEFAULTS[args.shape]
    args.sequences, args.seq_len = args.sequences or sequences, args.seq_len or seq_len
    args.steps, args.learning_rate = args.steps or steps, args.learning_rate or learning_rate
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_args(args, p)
    return args


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit through ``parser.error`` (status 2, the message on stderr) on a setting the check cannot run with."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu)")
    vocab = (TINY_SHAPE if args.tiny else SHAPES["llama2-7b"])["vocab_size"]
    for name, low in (("steps", 4), ("sequences", 1), ("seq_len", 8), ("batch_size", 1), ("num_heads", 1),
                      ("cycle", 2)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.cycle > vocab - FIRST_TOKEN:
        parser.error(f"--cycle {args.cycle} exceeds the {vocab - FIRST_TOKEN} ordinary token ids of the vocabulary")
    if not args.learning_rate > 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    if not 0 <= args.min_drop < 1:
        parser.error(f"--min-drop must be in [0, 1), got {args.min_drop}")
    if "eagle" in args.head_types and len(set(args.head_types)) > 1:
        parser.error("--head-types eagle trains from a store of the base's fused layers too, which the other head "
                     "types do not read: check it alone")


def build_base(shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A random Llama of ``shape`` (LlamaConfig fields), built directly on ``device`` in ``dtype`` (a 7B base never
    passes through host memory), frozen as Medusa-1 trains over it (:func:`train.setup.freeze_base`)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
    freeze_base(model)
    return model


def synthetic_examples(num: int, seq_len: int, vocab_size: int, cycle_len: int, seed: int) -> list[dict]:
    """``num`` examples ``{"input_ids", "labels"}`` (lists of ints) of ``3/4 seq_len .. seq_len`` tokens.

    Each is a prompt of ``seq_len/8 .. seq_len/4`` random ids (labels ``-100``) and an answer walking one fixed random
    cycle of ``cycle_len`` ids from a random start (labels = the ids), so the answer token ``k + 2`` ahead is
    determined by the current token. Ids 0-2 (pad, bos, eos) never occur. Deterministic in ``seed``.
    """
    generator = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int, size: int = 1) -> list[int]:  # uniform in [low, high]
        return torch.randint(low, high + 1, (size,), generator=generator).tolist()

    cycle = (torch.randperm(vocab_size - FIRST_TOKEN, generator=generator)[:cycle_len] + FIRST_TOKEN).tolist()
    examples = []
    for _ in range(num):
        length = randint(max(3 * seq_len // 4, 4), seq_len)[0]
        prompt = randint(FIRST_TOKEN, vocab_size - 1, randint(max(seq_len // 8, 1), max(seq_len // 4, 1))[0])
        start = randint(0, cycle_len - 1)[0]
        answer = [cycle[(start + i) % cycle_len] for i in range(length - len(prompt))]
        examples.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return examples


def train_config(args: argparse.Namespace, head_type: str, store_dir: Path, run_dir: Path) -> TrainConfig:
    """The run's config: TrainConfig's defaults (loss, head vocabulary, schedule shape, clipping) except the data
    sizes, the steps and a warmup of a tenth of them; checkpoints only at the end, no evaluation."""
    return TrainConfig(base=f"random-{args.shape}-shape (gpu_train_check)", output_dir=str(run_dir),
                       head_type=head_type, num_heads=args.num_heads, max_seq_len=args.seq_len,
                       batch_size=args.batch_size, learning_rate=args.learning_rate, max_steps=args.steps,
                       warmup_steps=args.steps // 10, save_every=0, eval_every=0, log_every=1,
                       hidden_state_store=str(store_dir), seed=args.seed, mixed_precision=args.mixed_precision)


def build_store(config: TrainConfig, accelerator, model, examples: list[dict]) -> tuple[HiddenStateStore, dict]:
    """The training examples' store, built and opened as :func:`train.setup.setup` does (``ensure_store``, checked
    against the base), and what it cost: ``{"store_build_s", "store_bytes", "store_tokens", "store_tokens_per_s"}``.

    Raises:
        train.store.StoreError: the folder holds another store, or the base gives other states on reopening.
    """
    sync(accelerator.device)
    start = time.perf_counter()
    layers = heads_base_layers(config, model.config.get_text_config(decoder=True))  # the eagle drafter's, else ()
    store = ensure_store(config.hidden_state_store, model, examples, config.max_seq_len, config.batch_size,
                         accelerator, layers)
    sync(accelerator.device)
    seconds = time.perf_counter() - start
    shards = store.meta["shards"]
    tokens = int(store.meta["num_tokens"])
    return store, {"store_build_s": round(seconds, 3), "store_tokens": tokens,
                   "store_bytes": sum(s["hidden_bytes"] + s["tokens_bytes"] for s in shards),
                   "store_tokens_per_s": round(tokens / max(seconds, 1e-9))}


def make_run(config: TrainConfig, accelerator, model, examples: list[dict], store: HiddenStateStore) -> Run:
    """The :class:`train.run.Run` :func:`train.setup.setup` would build for ``config`` from these examples (fresh
    heads of ``config.head_type``, AdamW over their trainable parameters, cosine schedule), without reading chat
    data or a tokenizer; nothing is held out."""
    lm_head, embed = full_base_weights(model, config.trainable.reads_embeddings)  # (V, H) each
    always = sorted(stop_token_ids(model.generation_config))
    heads = heads_for_training(config, lm_head, embed, examples, always, model.config.get_text_config(decoder=True),
                               config.trainable.position_weight(config, model))
    optimizer = make_optimizer(heads, config)
    heads, optimizer = accelerator.prepare(heads, optimizer)
    scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup_steps, config.max_steps)
    unwrapped = accelerator.unwrap_model(heads)
    lookup = head_lookup_table(unwrapped.token_map, unwrapped.config.vocab_size)
    return Run(config, accelerator, model, heads, optimizer, scheduler, examples, [], lookup, pad_id=0,
               teacher_weight=None, store=store)


class StepClock(logging.Handler):
    """Times the steps of :func:`train.loop.fit` from its per-step log lines (``"step %d loss %f lr %g"``, one per
    step with ``log_every=1``): ``(step, seconds)`` pairs, the clock read as each line is logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.times: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("step ") and " loss " in record.msg and isinstance(record.args, tuple):
            self.times.append((int(record.args[0]), time.perf_counter()))

    def steps_per_s(self) -> float:
        """Steps per second from the end of step 1 to the end of the last (the first step's warm-up left out).

        Raises:
            RuntimeError: fewer than two steps were logged (fit's log line changed, or the run was one step).
        """
        if len(self.times) < 2:
            raise RuntimeError(f"fit logged {len(self.times)} step lines: cannot time the steps (expected "
                               "'step N loss X lr Y' from train.loop with log_every=1)")
        (first, start), (last, stop) = self.times[0], self.times[-1]
        return (last - first) / max(stop - start, 1e-9)


def train_heads(run: Run) -> dict:
    """``fit(run)`` timed: its per-step losses, steps/s (:class:`StepClock`), the whole call's seconds (with its final
    checkpoint) and the device's peak memory during it (bytes; ``None`` on a CPU)."""
    device = run.accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = StepClock()
    loop_logger = logging.getLogger("train.loop")
    loop_logger.addHandler(clock)
    level = loop_logger.level
    loop_logger.setLevel(logging.INFO)
    start = time.perf_counter()
    try:
        losses = fit(run)
    finally:
        loop_logger.removeHandler(clock)
        loop_logger.setLevel(level)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"losses": losses, "steps_per_s": round(clock.steps_per_s(), 3), "fit_s": round(seconds, 3),
            "peak_train_memory_bytes": peak}


def heads_roundtrip(run: Run, folder: Path) -> dict:
    """Save the trained heads with :func:`medusa.io.checkpoint.save_heads`, load them back with ``load_heads`` onto
    the base's lm_head (and embeddings) and compare: every weight equal and the same logits ``(K, B, T, Vh)`` on the
    first batch of the store, both in the run's autocast. Returns ``{"heads_bytes", "heads_weights_equal",
    "heads_logits_equal"}``."""
    heads = run.accelerator.unwrap_model(run.heads).eval()
    save_heads(heads, folder, extra_config={"steps": run.step, "check": "gpu_train_check"})
    lm_head, embed = full_base_weights(run.model, run.config.trainable.reads_embeddings)  # (V, H) each
    layers = run.model.config.get_text_config(decoder=True).num_hidden_layers
    loaded = load_heads(folder, lm_head, embed_weight=embed, num_base_layers=layers).eval()
    saved, back = heads.state_dict(), loaded.state_dict()
    weights_equal = saved.keys() == back.keys() and all(torch.equal(saved[k], back[k].to(saved[k].device))
                                                        for k in saved)
    indices = list(range(min(run.config.batch_size, len(run.store))))
    batch = run.store.batch(indices)
    hidden = batch["hidden"].to(run.accelerator.device)  # (B, T, S): the base states the heads read
    input_ids = batch["input_ids"].to(run.accelerator.device)  # (B, T)
    # Accelerate's prepare wrapped the trained heads' forward in the run's autocast: the loaded heads run in it too.
    with torch.no_grad(), run.accelerator.autocast():
        trained = heads(hidden, input_ids).float()  # (K, B, T, Vh)
        again = loaded(hidden, input_ids).float()  # (K, B, T, Vh)
    logits_equal = torch.equal(trained, again)
    return {"heads_bytes": sum(f.stat().st_size for f in folder.iterdir()), "heads_weights_equal": weights_equal,
            "heads_logits_equal": logits_equal}


def loss_failures(losses: list[float], min_drop: float, window: int = LOSS_WINDOW) -> list[str]:
    """What is wrong with a run's per-step losses (empty when nothing): a step whose loss is not finite, or a mean
    over the last ``window`` steps (at most half the run) not below ``(1 - min_drop)`` x the first ``window``'s."""
    bad = [step for step, loss in enumerate(losses, 1) if not math.isfinite(loss)]
    if bad:
        return [f"loss not finite at {len(bad)} of {len(losses)} steps (first: step {bad[0]})"]
    window = max(1, min(window, len(losses) // 2))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    if not last < (1 - min_drop) * first:
        return [f"loss did not go down: mean of the last {window} steps {last:.4f} vs the first {window} "
                f"{first:.4f} (needs < {(1 - min_drop) * first:.4f}, a drop of {min_drop:.0%})"]
    return []


def check_one_head_type(args, head_type: str, accelerator, model, examples, store, work: Path) -> dict:
    """Train ``head_type`` heads from ``store``, round-trip them and judge the run: its result dict, with
    ``"failures"`` (empty when every check passed)."""
    config = train_config(args, head_type, Path(store.path), work / f"run-{head_type}")
    run = make_run(config, accelerator, model, examples, store)
    trained = train_heads(run)
    losses = trained.pop("losses")
    roundtrip = heads_roundtrip(run, work / f"heads-{head_type}")
    failures = [f"{head_type}: {f}" for f in loss_failures(losses, args.min_drop)]
    failures += [f"{head_type}: the saved heads load back with other {what}"
                 for what, key in (("weights", "heads_weights_equal"), ("logits", "heads_logits_equal"))
                 if not roundtrip[key]]
    window = max(1, min(LOSS_WINDOW, len(losses) // 2))
    return {"steps": run.step, "first_loss": losses[0], "last_loss": losses[-1],
            "first_mean_loss": sum(losses[:window]) / window, "last_mean_loss": sum(losses[-window:]) / window,
            "loss_window": window, "all_finite": all(math.isfinite(x) for x in losses), **trained, **roundtrip,
            "losses": [round(x, 5) for x in losses], "failures": failures}


def versions() -> dict:
    import accelerate
    import numpy
    import transformers

    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
             "accelerate": accelerate.__version__, "numpy": numpy.__version__}
    try:
        import peft

        found["peft"] = peft.__version__
    except ImportError:
        found["peft"] = None
    return found


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_checks(args: argparse.Namespace, work: Path) -> dict:
    """Everything but writing the result: base, data, store, and each head type's training and round trip.

    Raises:
        RuntimeError: the trainer's accelerator chose another device than ``--device``.
        train.store.StoreError: ``--work-dir`` holds a store of another base or other data.
    """
    config = train_config(args, args.head_types[0], work / "store", work / "run")
    accelerator = make_accelerator(config)
    device = accelerator.device
    if device.type != args.device:
        raise RuntimeError(f"--device {args.device}, but train.setup.make_accelerator chose {device} (it takes "
                           "CUDA when it sees it): hide the GPU with CUDA_VISIBLE_DEVICES= to check on cpu")
    shape = TINY_SHAPE if args.tiny else SHAPES["llama2-7b"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start = time.perf_counter()
    model = build_base(shape, device, dtype, args.seed)
    sync(device)
    base_s = time.perf_counter() - start
    examples = synthetic_examples(args.sequences, args.seq_len, shape["vocab_size"], args.cycle, args.seed)
    store, store_stats = build_store(config, accelerator, model, examples)
    cuda = device.type == "cuda"
    base_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    result = {"shape": args.shape, "device": str(device), "dtype": base_dtype,
              "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
              "mixed_precision": accelerator.mixed_precision, "sequences": len(examples), "seq_len": args.seq_len,
              "batch_size": args.batch_size, "base_build_s": round(base_s, 3), **store_stats,
              "peak_store_memory_bytes": torch.cuda.max_memory_allocated(device) if cuda else None, "heads": {}}
    for head_type in args.head_types:
        result["heads"][head_type] = check_one_head_type(args, head_type, accelerator, model, examples, store, work)
    peaks = [result["peak_store_memory_bytes"]] + [h["peak_train_memory_bytes"] for h in result["heads"].values()]
    result["peak_memory_bytes"] = max(peaks) if cuda else None
    return result


def main(argv=None) -> dict:
    """Run the check and write ``--out``; returns the result. Exits 1 (after writing it) when a check failed."""
    args = parse_args(argv)
    start = time.perf_counter()
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
        result = run_checks(args, Path(args.work_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="gpu-train-check-") as work:
            result = run_checks(args, Path(work))
    failures = [f for heads in result["heads"].values() for f in heads["failures"]]
    if sys.modules.get("datasets") is not None:
        failures.append("the datasets package was imported on this path (it must not be: the GPU machine has none)")
    result.update(total_s=round(time.perf_counter() - start, 3), peak_rss_bytes=peak_rss_bytes(),
                  versions=versions(), failures=failures, ok=not failures)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result, out))
    if failures:
        sys.exit("gpu_train_check FAILED:\n  " + "\n  ".join(failures))
    return result


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports kibibytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summary(result: dict, out: Path) -> str:
    """A few lines for the log: the store, each head type's loss, speed and memory, and where the JSON went."""
    gib = 2**30
    lines = [f"{result['shape']} on {result['device']} ({result['device_name']}), {result['dtype']}, mixed precision "
             f"{result['mixed_precision']}: base built in {result['base_build_s']:.1f} s",
             f"store: {result['sequences']} sequences, {result['store_tokens']} tokens, "
             f"{result['store_bytes'] / gib:.2f} GiB in {result['store_build_s']:.1f} s "
             f"({result['store_tokens_per_s']} tokens/s)"]
    for head_type, h in result["heads"].items():
        memory = "" if h["peak_train_memory_bytes"] is None else f", peak {h['peak_train_memory_bytes'] / gib:.1f} GiB"
        lines.append(f"{head_type}: {h['steps']} steps, loss {h['first_mean_loss']:.3f} -> {h['last_mean_loss']:.3f} "
                     f"(means of {h['loss_window']}), {h['steps_per_s']:.2f} steps/s{memory}, heads round trip "
                     f"{'ok' if h['heads_weights_equal'] and h['heads_logits_equal'] else 'FAILED'}")
    peak = result["peak_memory_bytes"]
    peak = "" if peak is None else f"; peak device memory {peak / gib:.1f} GiB"
    lines.append(f"{'ok' if result['ok'] else 'FAILED'} in {result['total_s']:.1f} s{peak}; wrote {out}")
    return "\n".join(lines)


def configure_logging() -> None:
    """Warnings and errors on stderr: fit's per-step lines are read by :class:`StepClock`, the summary says the
    rest. Only when run as a script (an importer keeps its own logging)."""
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[handler])


if __name__ == "__main__":
    configure_logging()
    main()
