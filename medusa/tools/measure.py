"""Measuring the machine: the timings a :class:`medusa.profile.MachineProfile` stores, and the commands' "read the
stored profile, else measure it" (:func:`load_profile`, :func:`ensure_profile`).

This sits above what it measures (the engines, the generation loop, the drafters), so nothing below imports it: an
engine, a drafter or a model constructor never measures. Measuring happens only when asked: ``medusa profile``,
``measure=True`` (:meth:`medusa.model.MedusaModel.use_engine`, :meth:`~medusa.model.MedusaModel.use_per_step_tree`),
or the CLI's first run, which calls :func:`ensure_profile` and announces it with its duration. The stored data and
its reading are :mod:`medusa.profile`.
"""

from __future__ import annotations

import copy
import datetime
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from medusa.decode.loop import GenerationStats, decode_steps
from medusa.drafters.composite import NoDrafter
from medusa.drafters.draft_model import draft_forward_s
from medusa.engines import auto_candidates, kv_cache, make_engine
from medusa.profile import (
    BATCH_PREFIX_LEN,
    BATCH_SIZES,
    BATCH_STEP_SIZES,
    DRAFT_SIZES,
    NONE_STORED,
    PLAIN_TOKENS,
    PREFIX_LEN,
    REPEATS,
    STEP_SIZES,
    MachineProfile,
    bf16_supported,
    cuda_dtype,
    draft_model_key,
    heads_key,
    profile_key,
    profile_path,
    read_profile,
)

logger = logging.getLogger(__name__)

MEASURE_ABOUT_S = 30
"""About how long measuring a 135M base takes on two cores (what the announcement says to expect)."""


# -- read or measure ------------------------------------------------------------------------------------------------
def load_profile(model, refresh: bool = False, folder: str | Path | None = None, candidates=None,
                 progress=None) -> MachineProfile:
    """This machine's profile for ``model`` (its dtype and device): the stored one when its key matches
    (:func:`medusa.profile.read_profile`; a stored one that does not is named in a warning and measured again),
    else measured (:func:`measure_profile`, about 30 s on two cores for a 135M model) and stored. Engines of
    ``candidates`` (``None``: :func:`medusa.engines.auto_candidates` for the model's device and dtype) that a stored
    profile lacks, or that failed there, are measured into it. ``progress(text)`` is called with a line per measuring
    stage (default: none)."""
    key = profile_key(model)
    path = profile_path(key, folder)
    candidates = auto_candidates(model.device, model.dtype) if candidates is None else list(candidates)
    if not refresh:
        profile, why = read_profile(path, key)
        if profile is not None:
            # An engine not in it yet, or one that failed last time (a failure may have been passing), is measured
            # now.
            missing = [c for c in candidates if c not in profile.engines or "error" in profile.engines[c]]
            if not missing:
                return profile
            _measure_engines(profile, model, missing, progress)
            profile.save(path)
            return profile
        if why != NONE_STORED:
            logger.warning("machine profile %s is %s: measuring again, not trusting it", path, why)
    profile = measure_profile(model, candidates, progress)
    profile.save(path)
    return profile


def profile_complete(profile: MachineProfile | None, model) -> bool:
    """Whether ``profile`` holds every engine that declares itself a candidate for ``model``'s device and dtype."""
    return profile is not None and all(c in profile.engines and "error" not in profile.engines[c]
                                       for c in auto_candidates(model.device, model.dtype))


def ensure_profile(model, announce=None, folder: str | Path | None = None, refresh: bool = False
                   ) -> MachineProfile:
    """The CLI's first run: this machine's stored profile for ``model``, else measured now and stored, announced
    through ``announce(text)`` before (what, why, about how long, where) and after (how long it took), with a line
    per measuring stage in between. Returns the stored profile silently when it is complete."""
    key = profile_key(model)
    path = profile_path(key, folder)
    stored, why = (None, "--refresh asked") if refresh else read_profile(path, key)
    if profile_complete(stored, model):
        return stored
    say = announce or (lambda text: None)
    what = f"{key['model'].get('architecture', 'model')} in {key['dtype']} on {key['device']}"
    why = why if stored is None else "engines missing from the stored one"
    say(f"measuring this machine for {what} once ({why}; about {MEASURE_ABOUT_S} s), to be stored in {path}")
    start = time.perf_counter()
    profile = load_profile(model, refresh=refresh, folder=folder, progress=announce)
    say(f"measured this machine in {time.perf_counter() - start:.1f} s; later runs read {profile.path}")
    return profile


def ensure_engine(profile: MachineProfile, model, engine, progress=None) -> MachineProfile:
    """Measure ``engine`` into ``profile`` when it is not in it yet (e.g. ``compiled``, never measured by default:
    each of its step sizes compiles), and store the profile again.

    Args:
        engine: an engine name (a default instance is made and measured), or an engine instance, measured as it is
            under its :attr:`medusa.engines.Engine.profile_name` (an ``int4`` engine with a bf16 lm_head costs
            otherwise than the default ``int4``).
    """
    key = engine if isinstance(engine, str) else engine.profile_name
    if key not in profile.engines:
        _measure_engines(profile, model, [engine], progress)
        if profile.path is not None:
            profile.save(profile.path)
    return profile


def stderr_progress(text: str) -> None:
    """A line of a profile being measured (about 30 s, once per machine) on stderr: a silent wait that long would
    look like a hang (measuring is always asked for, so this is the asker's output; :func:`ensure_profile` says
    what, why, where and how long)."""
    print(f"[medusa] {text}", file=sys.stderr, flush=True)


# -- measuring ------------------------------------------------------------------------------------------------------
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


ROUNDS_BUDGET_S = 4.0
"""Seconds of timed forwards after which :func:`time_forwards` stops adding rounds beyond its ``repeats``."""
MAX_ROUNDS = 30
"""Most timed rounds :func:`time_forwards` runs."""


def _best(values: list[float]) -> float:
    return min(values)


@torch.inference_mode()
def time_forwards(engine, model, sizes=STEP_SIZES, repeats: int = REPEATS, prefix_len: int = PREFIX_LEN,
                  budget_s: float = ROUNDS_BUDGET_S) -> dict[int, float]:
    """Seconds of one forward over n new tokens after ``prefix_len`` cached ones, through ``engine``, for each n in
    ``sizes``: the fastest of ``repeats`` rounds interleaved across sizes, after one untimed round, and of more rounds
    while the timed ones took under ``budget_s`` in all (at most :data:`MAX_ROUNDS`): a fast engine's curve from
    three rounds moved 10-25% at 4-8 tokens between two profiles of the same build, and the per-step tree's size
    follows it (docs/quantized.md, "Third pass"). The lm_head is
    applied as decoding applies it on that engine (:attr:`medusa.engines.Engine.scores_all_nodes`): to all n rows, or
    to one (the walk along the accepted path asks for about tau rows, one at a time)."""
    device, vocab = model.device, model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (prefix_len,), generator=generator).to(device)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    cache = engine.new_cache(prefix_len + max(sizes))
    engine.forward(prompt, torch.arange(prefix_len, device=device), kv_cache.causal_mask(prefix_len, device), cache,
                   logits_for=slice(-1, None))
    rows = None if engine.scores_all_nodes else slice(-1, None)
    engine.warm_up(list(sizes), prefix_len + max(sizes))
    spent, round_ = 0.0, 0
    while round_ <= repeats or (spent < budget_s and round_ <= MAX_ROUNDS):
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
                spent += times[n][-1]
            engine.keep_positions(cache, prefix_len, torch.empty(0, dtype=torch.long, device=device))
        round_ += 1
    return {n: _best(t) for n, t in times.items()}


@torch.inference_mode()
def time_batch_forwards(engine, model, batch: int, sizes=BATCH_STEP_SIZES, repeats: int = REPEATS - 1,
                        prefix_len: int = BATCH_PREFIX_LEN) -> dict[int, float]:
    """:func:`time_forwards` for ``batch`` rows through the engine's batch operations (:mod:`medusa.decode.batch`)."""
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


PRODUCT_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int4pack_mm_for_cpu",
                         "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise", "aten::mkldnn_linear"})
"""The profiler's names of the matrix-product kernels a forward's linear layers and lm_head run on a CPU (the
composite ``aten::linear``/``aten::matmul`` hold no time of their own)."""


@torch.inference_mode()
def time_outside_products(engine, model, repeats: int = 5, prefix_len: int = PREFIX_LEN) -> dict | None:
    """Where a one-token forward's time goes: ``{"products_s", "outside_s"}``, the seconds of its matrix-product
    kernels (:data:`PRODUCT_OPS`, their own CPU time under ``torch.profiler``, per forward) and the rest of the
    forward's wall time, taken without the profiler (norms, attention, rotary, casts, copies, Python): the overhead a
    leaner forward cuts. Medians of ``repeats`` forwards after ``prefix_len`` cached tokens, lm_head applied as
    decoding applies it. ``None`` on a GPU (kernels run asynchronously there; docs/gpu.md times them apart) and for
    an engine whose products the profiler cannot see (:attr:`medusa.engines.Engine.products_visible`)."""
    if model.device.type != "cpu" or not engine.products_visible:
        return None
    from torch.profiler import ProfilerActivity, profile

    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(0, vocab, (prefix_len + 1,), generator=torch.Generator().manual_seed(4))
    cache = engine.new_cache(prefix_len + 1)
    engine.forward(prompt[:prefix_len], torch.arange(prefix_len), kv_cache.causal_mask(prefix_len, model.device),
                   cache, logits_for=slice(-1, None))
    one, position, nothing = torch.ones(1, 1, dtype=torch.bool), torch.tensor([prefix_len]), torch.empty(0).long()
    rows = None if engine.scores_all_nodes else slice(-1, None)

    def step() -> float:  # the same position each time: the token is dropped again after it
        start = time.perf_counter()
        engine.forward(prompt[prefix_len:], position, one, cache, logits_for=rows)
        seconds = time.perf_counter() - start
        engine.keep_positions(cache, prefix_len, nothing)
        return seconds

    step()  # untimed
    wall = statistics.median(step() for _ in range(repeats))  # without the profiler, whose cost per op adds up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    products = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in PRODUCT_OPS) / 1e6 / repeats
    return {"products_s": products, "outside_s": max(wall - products, 0.0)}


@torch.inference_mode()
def time_plain_decoding(engine, model, tokens: int = PLAIN_TOKENS, runs: int = 2,
                        prefix_len: int = PREFIX_LEN) -> float:
    """Seconds per token of our plain decoding (the generation loop with no drafts) through ``engine`` after a
    ``prefix_len`` prompt, prefill excluded: the best of ``runs``."""
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
    """Measure each engine of ``names`` (names, or engine instances measured as they are, under their
    ``profile_name``) into ``profile.engines`` (an engine that fails is recorded with its error; one measured on
    request that is not a candidate of ``auto`` here is marked ``"candidate": false``)."""
    say = progress or (lambda text: None)
    candidates = auto_candidates(model.device, model.dtype)
    for given in names:
        start, engine = time.perf_counter(), None
        name = given if isinstance(given, str) else given.profile_name
        try:
            engine = make_engine(given, model) if isinstance(given, str) else given
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
            split = time_outside_products(engine, model)
            if split is not None:
                entry["one_token_split_s"] = split
        except Exception as e:  # noqa: BLE001 - an engine that cannot run here is recorded, not fatal
            logger.warning("profile: the %s engine could not be measured here: %s", name, e)
            entry = {"error": f"{type(e).__name__}: {e}"}
        entry["measure_s"] = time.perf_counter() - start
        if name not in candidates:
            entry["candidate"] = False
        profile.engines[name] = entry
        del engine  # its packed weights are freed before the next engine packs its own

def measure_profile(model, candidates=None, progress=None) -> MachineProfile:
    """Measure a fresh profile of ``model`` on this machine (see :mod:`medusa.profile`), for the engines of
    ``candidates`` (``None``: :func:`medusa.engines.auto_candidates` for the model's device and dtype).

    Raises:
        ValueError: no candidate engine could run.
    """
    say = progress or (lambda text: None)
    candidates = auto_candidates(model.device, model.dtype) if candidates is None else list(candidates)
    start = time.perf_counter()
    profile = MachineProfile(key=profile_key(model), engines={}, hf_generate_token_s=None)
    say("profile: Hugging Face generate, per new token")
    profile.hf_generate_token_s = time_hf_generate(model)
    _measure_engines(profile, model, candidates, progress)
    if not profile.usable():
        raise ValueError("no engine could run: " + "; ".join(f"{n}: {e['error']}" for n, e in profile.engines.items()))
    profile.measured = {"at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        "seconds": round(time.perf_counter() - start, 1), "prefix_len": PREFIX_LEN}
    return profile


# -- drafters -------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def time_heads_levels(heads, rows: int = 4, repeats: int = 20) -> list[float]:
    """Seconds of drafting one tree level with each head (its call over ``rows`` nodes and a top-10), by depth
    (head k drafts depth k + 1): the median of ``repeats`` calls, each timed alone; on a CPU after the caches were
    flushed (:func:`_cache_evictor`): decoding calls the heads right after a base forward has streamed the base's
    weights through them, and a call timed with its weights cached ran two to three times faster than in decoding
    (0.20-0.22 ms against 0.45-0.74 ms a level for SmolLM2's Hydra heads beside the native int4 decoder). A level
    is timed as greedy drafting calls it: fused into one call where the heads offer it
    (:meth:`medusa.drafters.heads.HydraHeads.draft_ranked`). Greedy trees then learn what decoding's own calls take
    (:attr:`medusa.drafters.per_step.PerStepDrafter.level_learned_s`, never above this figure)."""
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
    evict = _cache_evictor(parameter.device)
    fused = getattr(heads, "draft_ranked", None)

    def level(k: int, path: torch.Tensor) -> None:  # as greedy drafting calls it: fused where the heads can
        if fused is None or fused(k, hidden, path, 10) is None:
            heads.draft_logits(k, hidden, path).topk(10, dim=-1)

    for k, p in enumerate(paths):
        level(k, p)  # untimed
        times = []
        for _ in range(repeats):
            evict()
            _sync(parameter.device)
            start = time.perf_counter()
            level(k, p)
            _sync(parameter.device)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times))
    return out


def _cache_evictor(device):
    """On a CPU, a function that reads a buffer twice the last-level cache (at least 64 MiB), so that a call timed
    after it finds its weights where decoding does: in memory, pushed out of the caches by the base's forward that
    came before (which reads the base's weights once, more bytes than any cache). Elsewhere, nothing."""
    if torch.device(device).type != "cpu":
        return lambda: None
    size = 64 << 20
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        size = max(size, 2 * int(text.rstrip("KMG")) * scale)
    except (OSError, ValueError):
        pass
    buffer = torch.ones(size // 4)
    return lambda: float(buffer.sum())


def heads_level_s(profile: MachineProfile, heads) -> list[float]:
    """The heads' drafting seconds per depth on this machine, from ``profile`` (measured now and stored there when
    these heads' type and shape are not in it yet, :meth:`MachineProfile.drafter_cost`)."""
    return profile.drafter_cost(heads_key(heads), lambda: time_heads_levels(heads))


def draft_forward_costs(profile: MachineProfile, heads) -> dict[int, float]:
    """``{n: seconds}`` of one draft-model forward over n new tokens after :data:`PREFIX_LEN` cached ones, its
    logits of one row included, for n in :data:`DRAFT_SIZES`: c_q of the seed's analysis, from ``profile`` (measured
    with :func:`medusa.drafters.draft_model.draft_forward_s` and stored there the first time this kind of draft
    asks, :meth:`MachineProfile.drafter_cost`)."""
    def measure() -> list[float]:
        times = draft_forward_s(heads, sizes=DRAFT_SIZES, prefix_len=PREFIX_LEN)
        return [times[n] for n in DRAFT_SIZES]

    return dict(zip(DRAFT_SIZES, profile.drafter_cost(draft_model_key(heads), measure), strict=True))

# -- dtype ----------------------------------------------------------------------------------------------------------
BF16_PAYS = 0.10
"""``--dtype auto`` takes bf16 on a CPU when its best forward at the decoding step is at least this fraction cheaper
than fp32's, and its plain decoding is not slower."""

def choose_dtype(model, step_size: int, folder: str | Path | None = None, progress=None, measure: bool = False
                 ) -> tuple[torch.dtype, str]:
    """``--dtype auto`` for an fp32 ``model``: ``(dtype, reason)``.

    On CUDA, bf16 where the GPU supports it. On a CPU, bf16 only where it has hardware support
    (:data:`medusa.profile.BF16_FLAGS`) and this machine's profiles of both dtypes say it pays (:data:`BF16_PAYS`).
    The profiles are read when stored; a missing one is measured only with ``measure`` (a bf16 copy of the model is
    measured once, announced through ``progress``), else float32 is kept and the reason says so (logged once). bf16
    outputs can differ from fp32's where the base's top two logits are within bf16's rounding (the bench counts those
    as ties); fp32 stays the default for exact equality.
    """
    device = model.device
    if device.type == "cuda":
        return cuda_dtype(device)
    if not bf16_supported(device):
        return torch.float32, "float32: this CPU has no bfloat16 matrix instructions (AMX or AVX-512 BF16)"
    try:
        if measure:
            fp32 = ensure_profile(model, progress or stderr_progress, folder)
            bf16_model = copy.deepcopy(model).to(torch.bfloat16)  # measured once; later calls read its profile
            bf16 = ensure_profile(bf16_model, progress or stderr_progress, folder)
            del bf16_model
        else:
            key = profile_key(model)
            fp32, why = read_profile(profile_path(key, folder), key)
            bf16_key = key | {"dtype": "bfloat16"}
            bf16, why_bf16 = read_profile(profile_path(bf16_key, folder), bf16_key)
            if fp32 is None or bf16 is None:
                reason = (f"float32: the exact default, not measured (no stored profile to compare bfloat16 with: "
                          f"float32 {why}, bfloat16 {why_bf16}; `medusa profile --dtype bfloat16` and "
                          f"`--dtype float32` measure them)")
                logger.warning("--dtype auto: %s", reason)
                return torch.float32, reason
        return _dtype_from_profiles(fp32, bf16, step_size)
    except Exception as e:  # noqa: BLE001 - like --engine auto: a failure to measure keeps the exact default
        reason = f"float32: measuring bfloat16 against float32 failed ({type(e).__name__}: {e})"
        logger.warning("--dtype auto: %s", reason)
        return torch.float32, reason


def _dtype_from_profiles(fp32: MachineProfile, bf16: MachineProfile, step_size: int) -> tuple[torch.dtype, str]:
    a, b = fp32.choose_engine(step_size), bf16.choose_engine(step_size)
    step_a, step_b = fp32.forward_s(a.engine, step_size), bf16.forward_s(b.engine, step_size)
    plain_a, plain_b = fp32.engines[a.engine]["plain_token_s"], bf16.engines[b.engine]["plain_token_s"]
    figures = (f"a {step_size}-token forward {1e3 * step_b:.1f} ms ({b.engine}) vs {1e3 * step_a:.1f} ms "
               f"({a.engine}); plain decoding {1e3 * plain_b:.1f} vs {1e3 * plain_a:.1f} ms/token")
    if step_b <= (1 - BF16_PAYS) * step_a and plain_b <= plain_a:
        return torch.bfloat16, f"bfloat16 pays here: {figures}"
    return torch.float32, f"float32: bfloat16 does not pay here ({figures})"
