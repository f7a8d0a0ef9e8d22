"""The machine profile: what a forward costs here, measured once and cached, and the choices made from it.

Speed choices that were right on one CPU were wrong on the next (docs/benchmark.md: the oneDNN engine that made a
step cheaper on the developers' AMD EPYC made plain decoding 25% slower than Hugging Face ``generate`` on an Intel
Xeon). So the choices are made from measurements of the machine they run on:

- per candidate engine (:data:`CANDIDATES`) in the base's dtype, the seconds of one base forward over n new tokens
  after :data:`PREFIX_LEN` cached ones, for n in :data:`STEP_SIZES` (1 to the largest tree), at batch size 1 and at
  the batched sizes :data:`BATCH_SIZES`; and our plain decoding's seconds per token through that engine;
- Hugging Face ``generate``'s own seconds per new token (the baseline every speedup is against);
- the drafters' own cost per tree depth (measured when a drafter first asks, :meth:`MachineProfile.drafter_cost`).

The profile is keyed by what the figures depend on (:func:`profile_key`: CPU model and flags, cores, torch threads,
torch and transformers versions, the base model's architecture and shape, dtype, device) and stored as JSON in a user
cache folder (:func:`cache_dir`). A stored profile whose key differs from this machine's, or that cannot be read, is
measured again, with a warning that names why; it is never trusted.

``--engine auto`` (:func:`auto_engine`) picks the engine from it, among :data:`CANDIDATES`: the cheapest forward at the
step size decoding will use, among the engines whose plain decoding is not slower than ``generate`` per token. This
one profile is what ``medusa build-tree`` and ``medusa bench`` read for the verify cost (one name for it: no separate
"cost curve"), and what a per-step tree reads next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import re
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

PROFILE_VERSION = 3
"""Bumped when what a profile holds or how it is measured changes: an older file is measured again."""
PREFIX_LEN = 256
"""Cached tokens before the timed forwards (a typical prompt plus some answer)."""
STEP_SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""New tokens per timed forward: plain decoding (1) to the largest tree build-tree grows (64 heads' nodes); sizes
between are interpolated (:meth:`MachineProfile.forward_s`). The per-step tree only runs these sizes on engines whose
cost jumps between sizes (its buckets, :mod:`medusa.drafters.per_step`), so they are dense where trees are."""
BATCH_SIZES = (4,)
"""Batch sizes timed besides 1 (batched decoding, :mod:`medusa.decode.batch`)."""
BATCH_STEP_SIZES = (1, 16)
"""New tokens per row in the batched timings."""
BATCH_PREFIX_LEN = 64
"""Cached tokens per row before the batched timings (each row is prefilled on its own, so they are kept short)."""
PLAIN_TOKENS = 16
"""Tokens decoded per timing of plain decoding and of ``generate``."""
REPEATS = 3
"""Timings per size, after one untimed round; the fastest is kept (interference from the rest of the machine only
ever adds time, so the minimum of a few rounds is the steadier estimate of a forward's own cost)."""
CANDIDATES = ("eager", "static", "onednn")
"""The engines ``auto`` chooses among. ``compiled`` is not one: it compiles each step size for about a minute on
two cores, so it stays opt-in (``--engine compiled``)."""
FALLBACK_ENGINE = "static"
"""What ``auto`` runs when the machine cannot be measured (with the reason)."""
PLAIN_TOLERANCE = 0.03
"""Plain decoding counts as not slower than ``generate`` within this fraction (the noise of one profile)."""
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""The CPU flags in the key: the ones that change which kernels torch and oneDNN run."""
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags under which bf16 matrix products have hardware support (``--dtype auto`` considers bf16)."""


# -- the key --------------------------------------------------------------------------------------------------------
def cpu_info() -> dict:
    """``{"model": str, "flags": [...]}``: the CPU's model name and which of :data:`CPU_FLAGS` it has, from
    ``/proc/cpuinfo`` (``platform.processor()`` and no flags where there is none)."""
    text = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    present = set(flags.group(1).split()) if flags else set()
    return {"model": model.group(1).strip() if model else (platform.processor() or platform.machine()),
            "flags": [f for f in CPU_FLAGS if f in present]}


def usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def model_identity(model) -> dict:
    """What a forward's cost depends on in a base model: its architecture and shape (not its weights' values)."""
    config = model.config.get_text_config(decoder=True)
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size", "head_dim", "sliding_window", "tie_word_embeddings", "num_local_experts", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size")
    shape = {f: getattr(config, f) for f in fields if isinstance(getattr(config, f, None), int | bool)}
    architecture = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    attention = getattr(model.config, "_attn_implementation", None)
    return {"architecture": architecture, **shape, "attention": attention}


def device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def profile_key(model) -> dict:
    """Everything the profile's figures depend on (see the module docstring); two profiles with equal keys measure
    the same thing."""
    import transformers

    cpu = cpu_info()
    return {"version": PROFILE_VERSION, "cpu": cpu["model"], "cpu_flags": cpu["flags"], "cores": usable_cores(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "model": model_identity(model),
            "dtype": str(model.dtype).removeprefix("torch."), "device": device_name(model.device)}


def key_differences(stored: dict, current: dict) -> list[str]:
    """``"field: stored -> current"`` for each field of two keys that differs (model shape fields by name)."""
    out = []
    for name in sorted(set(stored) | set(current)):
        a, b = stored.get(name), current.get(name)
        if name == "model" and isinstance(a, dict) and isinstance(b, dict):
            out += [f"model.{f}: {a.get(f)!r} -> {b.get(f)!r}" for f in sorted(set(a) | set(b))
                    if a.get(f) != b.get(f)]
        elif a != b:
            out.append(f"{name}: {a!r} -> {b!r}")
    return out


def cache_dir() -> Path:
    """Where profiles live: ``$MEDUSA_CACHE_DIR``, else ``$XDG_CACHE_HOME/medusa``, else ``~/.cache/medusa``."""
    if os.environ.get("MEDUSA_CACHE_DIR"):
        return Path(os.environ["MEDUSA_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "medusa"


def profile_path(key: dict, folder: str | Path | None = None) -> Path:
    """The file of the profile for ``key``'s model, dtype and device (one per such triple: a stored profile for another
    CPU, thread count or library version is found there and measured again)."""
    identity = json.dumps(key["model"], sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    arch = re.sub(r"[^A-Za-z0-9]+", "-", key["model"].get("architecture", "model")).strip("-").lower()
    device = re.sub(r"[^A-Za-z0-9]+", "-", key["device"]).strip("-").lower()
    return Path(folder or cache_dir()) / "profiles" / f"{arch}-{digest}-{key['dtype']}-{device}.json"


# -- the profile ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class EngineChoice:
    """What ``auto`` chose and why (recorded by the bench)."""

    engine: str
    reason: str
    step_size: int
    profile: str | None = None
    """The profile file the choice was read from (``None`` when measuring failed)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class MachineProfile:
    """Measured costs on one machine for one base model and dtype (see the module docstring); seconds throughout.

    ``engines[name]`` is ``{"forward_s": {n: s}, "batch_forward_s": {B: {n: s}}, "plain_token_s": s,
    "scores_all_nodes": bool}``, or ``{"error": str}`` for an engine that could not run here.
    """

    key: dict
    engines: dict[str, dict]
    hf_generate_token_s: float | None
    """Hugging Face ``generate``'s seconds per new token after the prefill (greedy, ``PREFIX_LEN`` prompt)."""
    drafters: dict[str, dict] = dataclasses.field(default_factory=dict)
    """Drafter cost by drafter key (:meth:`drafter_cost`)."""
    measured: dict = dataclasses.field(default_factory=dict)
    """``{"at": ISO time, "seconds": s, "prefix_len": n}``."""
    path: Path | None = None
    """Where it is stored (not saved in the file)."""

    # -- reading ----------------------------------------------------------------------------------------------------
    def usable(self) -> list[str]:
        """Measured engines that ran here, in measuring order."""
        return [name for name, e in self.engines.items() if "error" not in e]

    def forward_s(self, engine: str, n: int, batch: int = 1) -> float:
        """Seconds of one forward over ``n`` new tokens per row through ``engine`` at batch size ``batch``, linearly
        interpolated (and extrapolated) in the measured sizes.

        Raises:
            KeyError: ``engine`` (or that batch size) was not measured, or could not run here.
        """
        entry = self.engines[engine]
        if "error" in entry:
            raise KeyError(f"engine {engine!r} could not run on this machine: {entry['error']}")
        curve = entry["forward_s"] if batch == 1 else entry["batch_forward_s"][batch]
        return interpolate({int(k): v for k, v in curve.items()}, n)

    def cost_curve(self, engine: str) -> dict:
        """``{n: forward_s(n) / forward_s(1)}`` for the measured sizes plus ``"one_token_s"``: the relative verify
        cost ``build-tree`` sizes trees with."""
        one = self.forward_s(engine, 1)
        sizes = sorted(int(k) for k in self.engines[engine]["forward_s"])
        return {n: self.forward_s(engine, n) / one for n in sizes} | {"one_token_s": one}

    def choose_engine(self, step_size: int = 1, candidates=CANDIDATES) -> EngineChoice:
        """The engine ``auto`` runs: the cheapest forward over ``step_size`` new tokens among the measured
        ``candidates`` whose plain decoding is at most :data:`PLAIN_TOLERANCE` slower per token than ``generate``'s;
        when none is, the one with the fastest plain decoding (and the reason says so).

        Raises:
            ValueError: no candidate engine ran here.
        """
        names = [n for n in candidates if n in self.usable()]
        if not names:
            errors = "; ".join(f"{n}: {self.engines[n]['error']}" for n in candidates if n in self.engines)
            raise ValueError(f"no candidate engine ran on this machine ({errors or 'none measured'})")
        plain = {n: self.engines[n]["plain_token_s"] for n in names}
        step = {n: self.forward_s(n, step_size) for n in names}
        hf = self.hf_generate_token_s
        fast_enough = [n for n in names if hf is None or plain[n] <= hf * (1 + PLAIN_TOLERANCE)]
        if fast_enough:
            best = min(fast_enough, key=lambda n: (step[n], plain[n]))
            why = (f"the cheapest {step_size}-token forward" if step_size > 1 else "the cheapest one-token forward")
            excluded = [n for n in names if n not in fast_enough]
            if excluded:
                why += (" among engines whose plain decoding keeps up with HF generate (excluded: "
                        + ", ".join(f"{n} {1e3 * plain[n]:.1f} ms/token" for n in excluded) + ")")
        else:
            best = min(names, key=lambda n: plain[n])
            why = "no engine's plain decoding keeps up with HF generate here: the fastest plain decoding"
        figures = ", ".join(f"{n} {1e3 * step[n]:.1f} ms" for n in names)
        hf_text = f"{1e3 * hf:.1f}" if hf is not None else "?"
        reason = (f"{best}: {why} ({step_size}-token forward: {figures}; plain decoding {1e3 * plain[best]:.1f} "
                  f"ms/token vs HF generate {hf_text} ms/token)")
        return EngineChoice(best, reason, step_size, str(self.path) if self.path else None)

    def drafter_cost(self, drafter_key: str, measure) -> list[float]:
        """Seconds per tree depth of a drafter's own work (drafting one level), measured by ``measure()`` the first
        time this drafter asks on this profile and stored with it."""
        if drafter_key not in self.drafters:
            self.drafters[drafter_key] = {"per_depth_s": [float(s) for s in measure()]}
            if self.path is not None:
                self.save(self.path)
        return list(self.drafters[drafter_key]["per_depth_s"])

    # -- storing ----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("path")
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MachineProfile:
        """The profile in ``data`` (a stored file's JSON).

        Raises:
            ValueError: fields are missing or of the wrong kind (a corrupt or foreign file).
        """
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        try:
            engines = data["engines"]
            if not isinstance(data["key"], dict) or not isinstance(engines, dict):
                raise ValueError("key and engines must be objects")
            for name, entry in engines.items():
                if "error" in entry:
                    continue
                entry["forward_s"] = curve = {int(k): float(v) for k, v in entry["forward_s"].items()}
                entry["batch_forward_s"] = {int(b): {int(k): float(v) for k, v in c.items()}
                                            for b, c in entry.get("batch_forward_s", {}).items()}
                if sorted(curve) != list(STEP_SIZES):
                    raise ValueError(f"engine {name}: forward timings for sizes {sorted(curve)}, not {STEP_SIZES}")
                timings = [*curve.values(), float(entry["plain_token_s"])]
                timings += [v for c in entry["batch_forward_s"].values() for v in c.values()]
                if not all(_positive(t) for t in timings):
                    raise ValueError(f"engine {name}: every timing must be a positive finite number of seconds")
            hf = float(data["hf_generate_token_s"])
            if not _positive(hf):
                raise ValueError(f"hf_generate_token_s must be a positive finite number of seconds, got {hf}")
            drafters = dict(data.get("drafters", {}))
            for name, entry in drafters.items():
                per_depth = [float(s) for s in entry["per_depth_s"]]
                if not per_depth or not all(_positive(s) for s in per_depth):
                    raise ValueError(f"drafter {name}: per_depth_s must be positive finite seconds")
            return cls(key=data["key"], engines=engines, hf_generate_token_s=hf, drafters=drafters,
                       measured=dict(data.get("measured", {})))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"missing or malformed field: {e!r}") from e

    def save(self, path: str | Path) -> Path:
        """Write the profile to ``path`` atomically (a reader sees the old file or the new one, never half)."""
        from medusa.io.files import atomic_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        self.path = path
        return path


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def interpolate(curve: dict[int, float], n: int) -> float:
    """``curve`` (by size) at ``n``: linear between measured sizes, extended along the last two beyond them."""
    sizes = sorted(curve)
    if n <= sizes[0] or len(sizes) == 1:
        return curve[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:], strict=False):
        if n <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)
    lo, hi = sizes[-2], sizes[-1]
    return curve[hi] + (curve[hi] - curve[lo]) * (n - hi) / (hi - lo)


def read_profile(path: str | Path, key: dict) -> tuple[MachineProfile | None, str]:
    """The stored profile at ``path`` when it is readable and measured for ``key``; else ``(None, why not)``."""
    path = Path(path)
    if not path.is_file():
        return None, "none stored"
    try:
        profile = MachineProfile.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        logger.warning("machine profile %s is unreadable (%s): measuring again, not trusting it", path, e)
        return None, f"unreadable ({e})"
    differences = key_differences(profile.key, key)
    if differences:
        logger.warning("machine profile %s was measured for another setup (%s): measuring again", path,
                       "; ".join(differences))
        return None, "measured for another setup: " + "; ".join(differences)
    profile.path = path
    return profile, "stored"


def load_profile(model, refresh: bool = False, folder: str | Path | None = None, candidates=CANDIDATES,
                 progress=None) -> MachineProfile:
    """This machine's profile for ``model`` (its dtype and device): the stored one when its key matches
    (:func:`read_profile`), else measured (:func:`measure_profile`, about 30 s on two cores for a 135M model) and
    stored. ``progress(text)`` is called with a line per measuring stage (default: none)."""
    key = profile_key(model)
    path = profile_path(key, folder)
    if not refresh:
        profile, _ = read_profile(path, key)
        if profile is not None:
            # An engine not in it yet, or one that failed last time (a failure may have been passing), is measured
            # now; one that cannot run for this model (onednn on a GPU) is never measured as something else.
            missing = [c for c in candidates if _runs_here(c, model)
                       and (c not in profile.engines or "error" in profile.engines[c])]
            if not missing:
                return profile
            _measure_engines(profile, model, missing, progress)
            profile.save(path)
            return profile
    profile = measure_profile(model, candidates, progress)
    profile.save(path)
    return profile


def ensure_engine(profile: MachineProfile, model, engine: str, progress=None) -> MachineProfile:
    """Measure ``engine`` into ``profile`` when it is not in it yet (e.g. ``compiled``, never measured by default:
    each of its step sizes compiles), and store the profile again."""
    if engine not in profile.engines:
        _measure_engines(profile, model, [engine], progress)
        if profile.path is not None:
            profile.save(profile.path)
    return profile


# -- measuring ------------------------------------------------------------------------------------------------------
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _best(values: list[float]) -> float:
    return min(values)


@torch.inference_mode()
def time_forwards(engine, model, sizes=STEP_SIZES, repeats: int = REPEATS, prefix_len: int = PREFIX_LEN
                  ) -> dict[int, float]:
    """Seconds of one forward over n new tokens after ``prefix_len`` cached ones, through ``engine``, for each n in
    ``sizes``: the fastest of ``repeats`` rounds interleaved across sizes, after one untimed round. The lm_head is
    applied as decoding applies it on that engine (:attr:`medusa.engines.Engine.scores_all_nodes`): to all n rows, or
    to one (the walk along the accepted path asks for about tau rows, one at a time)."""
    from medusa.engines import kv_cache

    device, vocab = model.device, model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (prefix_len,), generator=generator).to(device)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    cache = engine.new_cache(prefix_len + max(sizes))
    engine.forward(prompt, torch.arange(prefix_len, device=device), kv_cache.causal_mask(prefix_len, device), cache,
                   logits_for=slice(-1, None))
    rows = None if engine.scores_all_nodes else slice(-1, None)
    engine.warm_up(list(sizes), prefix_len + max(sizes))
    for round_ in range(repeats + 1):
        for n in sizes:
            ids = torch.randint(0, vocab, (n,), generator=generator).to(device)
            positions = prefix_len + torch.arange(n, device=device)
            mask = kv_cache.causal_mask(n, device)
            _sync(device)
            start = time.perf_counter()
            engine.forward(ids, positions, mask, cache, logits_for=rows)
            _sync(device)
            if round_:
                times[n].append(time.perf_counter() - start)
            engine.keep_positions(cache, prefix_len, torch.empty(0, dtype=torch.long, device=device))
    return {n: _best(t) for n, t in times.items()}


@torch.inference_mode()
def time_batch_forwards(engine, model, batch: int, sizes=BATCH_STEP_SIZES, repeats: int = REPEATS - 1,
                        prefix_len: int = BATCH_PREFIX_LEN) -> dict[int, float]:
    """:func:`time_forwards` for ``batch`` rows through the engine's batch operations (:mod:`medusa.decode.batch`)."""
    from medusa.engines import kv_cache

    device, vocab = model.device, model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(1)
    caches = [engine.prefill_row(torch.randint(0, vocab, (prefix_len,), generator=generator).to(device),
                                 capacity=prefix_len + max(sizes))[0] for _ in range(batch)]
    cache = engine.stack_rows(caches)
    valid_len = torch.full((batch,), prefix_len, dtype=torch.long, device=device)
    empty = [torch.empty(0, dtype=torch.long, device=device)] * batch
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):
        for n in sizes:
            ids = torch.randint(0, vocab, (batch, n), generator=generator).to(device)
            positions = (prefix_len + torch.arange(n, device=device))[None].expand(batch, n)
            _sync(device)
            start = time.perf_counter()
            hidden = engine.forward_rows(ids, positions, valid_len, kv_cache.causal_mask(n, device), cache)
            engine.batch_lm_logits(hidden[:, -1])
            _sync(device)
            if round_:
                times[n].append(time.perf_counter() - start)
            engine.keep_row_paths(cache, prefix_len, valid_len, empty)
    return {n: _best(t) for n, t in times.items()}


@torch.inference_mode()
def time_plain_decoding(engine, model, tokens: int = PLAIN_TOKENS, runs: int = 2,
                        prefix_len: int = PREFIX_LEN) -> float:
    """Seconds per token of our plain decoding (the generation loop with no drafts) through ``engine`` after a
    ``prefix_len`` prompt, prefill excluded: the best of ``runs``."""
    from medusa.decode.loop import GenerationStats, decode_steps
    from medusa.drafters.composite import NoDrafter

    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(0, vocab, (prefix_len,), generator=torch.Generator().manual_seed(2)).to(model.device)
    best = float("inf")
    for _ in range(runs):
        stats = GenerationStats()
        for _ in decode_steps(model, NoDrafter(), prompt, tokens + 1, set(), stats, engine=engine):
            pass
        best = min(best, stats.decode_s / max(stats.decode_steps, 1))
    return best


@torch.inference_mode()
def time_hf_generate(model, tokens: int = PLAIN_TOKENS, runs: int = 2, prefix_len: int = PREFIX_LEN) -> float:
    """Seconds per new token of Hugging Face ``generate`` (greedy) after a ``prefix_len`` prompt, the prefill taken
    out (a 1-token call's time subtracted from a ``1 + tokens`` one): the best of ``runs``."""
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (1, prefix_len), generator=torch.Generator().manual_seed(3)).to(model.device)
    settings = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0,
                "eos_token_id": None}

    def run(n: int) -> float:
        _sync(model.device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **settings)
        _sync(model.device)
        if out.shape[1] != prefix_len + n:  # it stopped early: the per-token time would be wrong
            raise ValueError(f"HF generate returned {out.shape[1] - prefix_len} new tokens where {n} were asked")
        return time.perf_counter() - start

    one, many = [], []
    for _ in range(runs):  # the first pair warms up; the best of each is kept
        one.append(run(1))
        many.append(run(1 + tokens))
    return max(min(many) - min(one), 1e-9) / tokens


def _measure_engines(profile: MachineProfile, model, names, progress) -> None:
    from medusa.engines import make_engine

    say = progress or (lambda text: None)
    for name in names:
        start, engine = time.perf_counter(), None
        try:
            engine = make_engine(name, model)
            say(f"profile: {name} engine, forwards over {', '.join(map(str, STEP_SIZES))} new tokens")
            entry = {"forward_s": time_forwards(engine, model), "scores_all_nodes": engine.scores_all_nodes}
            if engine.supports_batch:
                say(f"profile: {name} engine, batched forwards at batch sizes {', '.join(map(str, BATCH_SIZES))}")
                try:
                    entry["batch_forward_s"] = {b: time_batch_forwards(engine, model, b) for b in BATCH_SIZES}
                except Exception as e:  # noqa: BLE001 - batched decoding failing leaves one sequence usable
                    logger.warning("profile: batched forwards through %s could not be timed: %s", name, e)
                    entry["batch_error"] = f"{type(e).__name__}: {e}"
            say(f"profile: {name} engine, plain decoding")
            entry["plain_token_s"] = time_plain_decoding(engine, model)
        except Exception as e:  # noqa: BLE001 - an engine that cannot run here is recorded, not fatal
            logger.warning("profile: the %s engine could not be measured here: %s", name, e)
            entry = {"error": f"{type(e).__name__}: {e}"}
        entry["measure_s"] = time.perf_counter() - start
        profile.engines[name] = entry
        del engine  # its packed weights are freed before the next engine packs its own


def measure_profile(model, candidates=CANDIDATES, progress=None) -> MachineProfile:
    """Measure a fresh profile of ``model`` on this machine (see the module docstring).

    Raises:
        ValueError: no candidate engine could run.
    """
    say = progress or (lambda text: None)
    start = time.perf_counter()
    profile = MachineProfile(key=profile_key(model), engines={}, hf_generate_token_s=None)
    say("profile: Hugging Face generate, per new token")
    profile.hf_generate_token_s = time_hf_generate(model)
    _measure_engines(profile, model, [c for c in candidates if _runs_here(c, model)], progress)
    for name in candidates:
        if not _runs_here(name, model):
            profile.engines[name] = {"error": f"not measured: {_why_not_here(name, model)}"}
    if not profile.usable():
        raise ValueError("no engine could run: " + "; ".join(f"{n}: {e['error']}" for n, e in profile.engines.items()))
    profile.measured = {"at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "seconds": round(time.perf_counter() - start, 1), "prefix_len": PREFIX_LEN}
    return profile


def _runs_here(engine: str, model) -> bool:
    """Whether ``engine`` is worth measuring for ``model``: ``onednn`` only where it can pack (a CPU, a dtype oneDNN
    runs); elsewhere it would run as ``static`` and measure that twice."""
    return _why_not_here(engine, model) is None


def _why_not_here(engine: str, model) -> str | None:
    if engine != "onednn":
        return None
    from medusa.engines.onednn import onednn_unavailable

    reason = onednn_unavailable(model)
    return None if reason is None else f"it would run as static here ({reason})"


# -- the choices ----------------------------------------------------------------------------------------------------
def stderr_progress(text: str) -> None:
    """The progress line of a profile being measured (about 30 s, once per machine), on stderr: a silent wait that
    long would look like a hang."""
    import sys

    print(f"[medusa] {text} (measuring this machine once, stored in {cache_dir() / 'profiles'})", file=sys.stderr,
          flush=True)


def auto_engine(model, step_size: int = 1, folder: str | Path | None = None, progress=None) -> EngineChoice:
    """``--engine auto``: the engine :meth:`MachineProfile.choose_engine` picks from this machine's profile for a
    step of ``step_size`` new tokens (the tree's nodes); the profile is measured first when none is stored. Where
    measuring fails, :data:`FALLBACK_ENGINE` with the reason (a warning too), never an exception."""
    try:
        profile = load_profile(model, folder=folder, progress=progress or stderr_progress)
        choice = profile.choose_engine(step_size)
    except Exception as e:  # noqa: BLE001 - any failure to measure falls back, and says why
        reason = f"{FALLBACK_ENGINE}: measuring this machine failed ({type(e).__name__}: {e})"
        logger.warning("--engine auto: %s", reason)
        return EngineChoice(FALLBACK_ENGINE, reason, step_size)
    logger.info("--engine auto: %s", choice.reason)
    return choice


def bf16_supported(device) -> bool:
    """Whether bf16 has hardware matrix support on ``device``: CUDA's own check, or one of :data:`BF16_FLAGS`."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return any(f in cpu_info()["flags"] for f in BF16_FLAGS)


# -- drafters -------------------------------------------------------------------------------------------------------
def heads_key(heads) -> str:
    """The drafter key of Medusa/Hydra heads in a profile: their type and shape (what their cost depends on)."""
    c = heads.config
    return (f"{c.head_type}:{c.num_heads}x{c.num_layers}:hidden{c.hidden_size}:vocab{heads.head_vocab_size}"
            f":{next(heads.parameters()).dtype}".replace("torch.", ""))


@torch.inference_mode()
def time_heads_levels(heads, rows: int = 4, repeats: int = 20) -> list[float]:
    """Seconds of drafting one tree level with each head (its call over ``rows`` nodes and a top-10), by depth
    (head k drafts depth k + 1)."""
    parameter = next(heads.parameters())
    # The drafting input, as decoding makes it: the heads' context fed a few positions of base states (the last
    # hidden state, then the layers a feature drafter reads).
    width = heads.config.hidden_size * (1 + len(heads.base_layers))
    states = torch.randn(8, width, device=parameter.device, dtype=parameter.dtype)
    hidden = heads.extend_context(heads.new_context(), states, torch.zeros(8, dtype=torch.long,
                                                                           device=parameter.device))
    paths = [torch.zeros(rows, k + 1, dtype=torch.long, device=parameter.device)
             for k in range(heads.config.num_heads)]
    out = []
    for k, p in enumerate(paths):
        heads.draft_logits(k, hidden, p).topk(10, dim=-1)  # untimed
        _sync(parameter.device)
        start = time.perf_counter()
        for _ in range(repeats):
            heads.draft_logits(k, hidden, p).topk(10, dim=-1)
        _sync(parameter.device)
        out.append((time.perf_counter() - start) / repeats)
    return out


def heads_level_s(profile: MachineProfile, heads) -> list[float]:
    """The heads' drafting seconds per depth on this machine, from ``profile`` (measured and stored there the first
    time these heads' type and shape ask, :meth:`MachineProfile.drafter_cost`)."""
    return profile.drafter_cost(heads_key(heads), lambda: time_heads_levels(heads))


DRAFT_SIZES = tuple(range(1, 9))
"""New-token counts at which a draft model's single forward is timed (a chain level feeds 1; a catch-up feeds the
tokens emitted since the last step, up to K + 1)."""


def draft_model_key(heads) -> str:
    """The drafter key of a separate draft model in a profile: what its forward cost depends on (architecture,
    layers, width, the lm_head rows it drafts from, quantization, engine, dtype), not its weights' values."""
    config = heads.model.config.get_text_config(decoder=True)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    dtype = str(heads.model.get_output_embeddings().weight.dtype).replace("torch.", "")
    return (f"draft_model:{config.model_type}:{layers}x{hidden}:vocab{heads.head_vocab_size}"
            f":{heads.quantized or dtype}:{heads.engine.name}")


def draft_forward_costs(profile: MachineProfile, heads) -> dict[int, float]:
    """``{n: seconds}`` of one draft-model forward over n new tokens after :data:`PREFIX_LEN` cached ones, its
    logits of one row included, for n in :data:`DRAFT_SIZES`: c_q of the seed's analysis, from ``profile`` (measured
    with :func:`medusa.drafters.draft_model.draft_forward_s` and stored there the first time this kind of draft
    asks, :meth:`MachineProfile.drafter_cost`)."""
    from medusa.drafters.draft_model import draft_forward_s

    def measure() -> list[float]:
        times = draft_forward_s(heads, sizes=DRAFT_SIZES, prefix_len=PREFIX_LEN)
        return [times[n] for n in DRAFT_SIZES]

    return dict(zip(DRAFT_SIZES, profile.drafter_cost(draft_model_key(heads), measure), strict=True))


# -- dtype ----------------------------------------------------------------------------------------------------------
BF16_PAYS = 0.10
"""``--dtype auto`` takes bf16 on a CPU when its best forward at the decoding step is at least this fraction cheaper
than fp32's, and its plain decoding is not slower."""


def choose_dtype(model, step_size: int, folder: str | Path | None = None, progress=None
                 ) -> tuple[torch.dtype, str]:
    """``--dtype auto`` for an fp32 ``model``: ``(dtype, reason)``.

    On CUDA, bf16 where the GPU supports it. On a CPU, bf16 only where it has hardware support (:data:`BF16_FLAGS`)
    and this machine's profiles say it pays (:data:`BF16_PAYS`; a bf16 copy of the model is measured once, then its
    profile is read). bf16 outputs can differ from fp32's where the base's top two logits are within bf16's rounding
    (the bench counts those as ties); fp32 stays the default for exact equality.
    """
    device = model.device
    if device.type == "cuda":
        return cuda_dtype(device)
    if not bf16_supported(device):
        return torch.float32, "float32: this CPU has no bfloat16 matrix instructions (AMX or AVX-512 BF16)"
    try:
        return _measured_cpu_dtype(model, step_size, folder, progress or stderr_progress)
    except Exception as e:  # noqa: BLE001 - like --engine auto: a failure to measure keeps the exact default
        reason = f"float32: measuring bfloat16 against float32 failed ({type(e).__name__}: {e})"
        logger.warning("--dtype auto: %s", reason)
        return torch.float32, reason


def cuda_dtype(device) -> tuple[torch.dtype, str]:
    """``--dtype auto`` on a GPU, decided before any weights load: bf16 where it is supported."""
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16, f"bfloat16: {device_name(device)} supports it"
    return torch.float32, f"float32: {device_name(device)} has no bfloat16"


def _measured_cpu_dtype(model, step_size: int, folder, progress) -> tuple[torch.dtype, str]:
    import copy

    fp32 = load_profile(model, folder=folder, progress=progress)
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)  # measured once; later calls read its stored profile
    bf16 = load_profile(bf16_model, folder=folder, progress=progress)
    del bf16_model
    a, b = fp32.choose_engine(step_size), bf16.choose_engine(step_size)
    step_a, step_b = fp32.forward_s(a.engine, step_size), bf16.forward_s(b.engine, step_size)
    plain_a, plain_b = fp32.engines[a.engine]["plain_token_s"], bf16.engines[b.engine]["plain_token_s"]
    figures = (f"a {step_size}-token forward {1e3 * step_b:.1f} ms ({b.engine}) vs {1e3 * step_a:.1f} ms "
               f"({a.engine}); plain decoding {1e3 * plain_b:.1f} vs {1e3 * plain_a:.1f} ms/token")
    if step_b <= (1 - BF16_PAYS) * step_a and plain_b <= plain_a:
        return torch.bfloat16, f"bfloat16 pays here: {figures}"
    return torch.float32, f"float32: bfloat16 does not pay here ({figures})"
