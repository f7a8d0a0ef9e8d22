"""The machine profile, as stored data: what a forward costs here, the key it was measured for, where it is kept,
and the choices read from it. This module measures nothing and imports nothing of the package's engines, drafters or
loop: it is the bottom of the house. The measuring is :mod:`medusa.tools.measure`, above what it measures.

Speed choices that were right on one CPU were wrong on the next (docs/benchmark.md: the oneDNN engine that made a
step cheaper on the developers' AMD EPYC made plain decoding 25% slower than Hugging Face ``generate`` on an Intel
Xeon). So the choices are made from measurements of the machine they run on:

- per candidate engine (the registered engines that declare themselves candidates for the device and dtype,
  :meth:`medusa.engines.Engine.candidate_for`) in the base's dtype, the seconds of one base forward over n new
  tokens after :data:`PREFIX_LEN` cached ones, for n in :data:`STEP_SIZES` (1 to the largest tree), at batch size 1
  and at the batched sizes :data:`BATCH_SIZES`; and our plain decoding's seconds per token through that engine;
- Hugging Face ``generate``'s own seconds per new token (the baseline every speedup is against);
- the drafters' own cost per tree depth (:meth:`MachineProfile.drafter_cost`).

The profile is keyed by what the figures depend on (:func:`profile_key`: CPU model and flags, cores, torch threads,
torch and transformers versions, the base model's architecture and shape, dtype, device) and stored as JSON in a user
cache folder (:func:`cache_dir`). A stored profile whose key differs from this machine's, or that cannot be read, is
never trusted (:func:`read_profile` says why).

``--engine auto`` (:func:`medusa.engines.make_engine`) picks the engine from a stored profile
(:meth:`MachineProfile.choose_engine`): the cheapest forward at the step size decoding will use, among the engines
whose plain decoding is not slower than ``generate`` per token. Without a stored profile it runs
:data:`FALLBACK_ENGINE` and says so; nothing is measured behind a constructor (``medusa profile``, ``measure=True`` or
the CLI's first run measure, :mod:`medusa.tools.measure`). This one profile is what ``medusa build-tree`` and
``medusa bench`` read for the verify cost, and what a per-step tree reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
from pathlib import Path

import torch

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
FALLBACK_ENGINE = "static"
"""What ``auto`` runs when no usable profile is stored, or measuring failed (with the reason, in one log line)."""
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
    """The file of the profile for ``key``'s model, dtype, device and torch thread count (one per such tuple, so a
    run with ``--threads 1`` keeps its own profile beside the 2-thread one instead of measuring over it; a stored
    profile for another CPU or library version is found there and measured again)."""
    identity = json.dumps(key["model"], sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    arch = re.sub(r"[^A-Za-z0-9]+", "-", key["model"].get("architecture", "model")).strip("-").lower()
    device = re.sub(r"[^A-Za-z0-9]+", "-", key["device"]).strip("-").lower()
    threads = int(key.get("torch_threads") or 0)
    return Path(folder or cache_dir()) / "profiles" / f"{arch}-{digest}-{key['dtype']}-{device}-t{threads}.json"


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
    "scores_all_nodes": bool, "one_token_split_s": {"products_s": s, "outside_s": s}}`` (the split: a one-token
    forward's matrix-product kernels and the rest of it, on a CPU), or ``{"error": str}`` for an engine that could
    not run here. ``name`` is the engine's ``profile_name``: its registry name, plus the options that change its
    cost (``int4:lm_head=bf16``).
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

    def candidates(self) -> list[str]:
        """Measured engines that ran here and were measured as ``auto``'s candidates (an engine measured only on
        request, such as ``compiled``, is marked ``"candidate": false``), in measuring order."""
        return [name for name in self.usable() if self.engines[name].get("candidate", True)]

    def choose_engine(self, step_size: int = 1, candidates=None) -> EngineChoice:
        """The engine ``auto`` runs: the cheapest forward over ``step_size`` new tokens among the measured
        ``candidates`` (``None``: :meth:`candidates`; the engine layer passes the registered engines that declare
        themselves candidates here, :func:`medusa.engines.auto_candidates`) whose plain decoding is at most
        :data:`PLAIN_TOLERANCE` slower per token than ``generate``'s; when none is, the one with the fastest plain
        decoding (and the reason says so).

        Raises:
            ValueError: no candidate engine ran here.
        """
        candidates = self.candidates() if candidates is None else list(candidates)
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

    def drafter_cost(self, drafter_key: str, measure=None) -> list[float] | None:
        """Seconds per tree depth of a drafter's own work (drafting one level): the stored figures, else measured by
        ``measure()`` (when given) and stored with the profile, else ``None`` (nothing stored, nothing asked)."""
        if drafter_key not in self.drafters:
            if measure is None:
                return None
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


NONE_STORED = "none stored"
""":func:`read_profile`'s reason when there is no file at all."""


def read_profile(path: str | Path, key: dict) -> tuple[MachineProfile | None, str]:
    """The stored profile at ``path`` when it is readable and measured for ``key``; else ``(None, why not)``:
    :data:`NONE_STORED`, ``"unreadable (...)"`` or ``"measured for another setup: field: stored -> current; ..."``.
    Logs nothing (the caller says what it does instead, once)."""
    path = Path(path)
    if not path.is_file():
        return None, NONE_STORED
    try:
        profile = MachineProfile.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        return None, f"unreadable ({e})"
    differences = key_differences(profile.key, key)
    if differences:
        return None, "measured for another setup: " + "; ".join(differences)
    profile.path = path
    return profile, "stored"


def stored_profile(model, folder: str | Path | None = None) -> tuple[MachineProfile | None, str]:
    """This machine's stored profile for ``model`` (its dtype and device), never measured: ``(profile, "stored")``,
    or ``(None, why not)`` (:func:`read_profile`)."""
    key = profile_key(model)
    return read_profile(profile_path(key, folder), key)


# -- stored figures of the choices ----------------------------------------------------------------------------------


def bf16_supported(device) -> bool:
    """Whether bf16 has hardware matrix support on ``device``: CUDA's own check, or one of :data:`BF16_FLAGS`."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return any(f in cpu_info()["flags"] for f in BF16_FLAGS)


def cuda_dtype(device) -> tuple[torch.dtype, str]:
    """``--dtype auto`` on a GPU, decided before any weights load: bf16 where it is supported."""
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16, f"bfloat16: {device_name(device)} supports it"
    return torch.float32, f"float32: {device_name(device)} has no bfloat16"


# -- drafters -------------------------------------------------------------------------------------------------------
def heads_key(heads) -> str:
    """The drafter key of Medusa/Hydra heads in a profile: their type and shape, and the engine's drafter products
    where they are not matmul or a packed copy (what their cost depends on)."""
    c = heads.config
    products = getattr(heads, "drafter_products_key", None)  # the engine's drafter products, where they matter
    if products and products.endswith(":level") and c.head_type == "hydra" and c.num_layers > 1:
        products += "+blocks"  # the fused level took a head's ResBlocks in later: a cost measured before is stale
    return (f"{c.head_type}:{c.num_heads}x{c.num_layers}:hidden{c.hidden_size}:vocab{heads.head_vocab_size}"
            f":{next(heads.parameters()).dtype}".replace("torch.", "") + (f":products={products}" if products else ""))


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
