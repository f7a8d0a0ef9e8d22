"""The engine seam: where the base's KV cache lives and how one forward over new tokens runs.

Every engine subclasses :class:`Engine`, which states the contract the generation loop (:mod:`medusa.decode.loop`) and
batched decoding (:mod:`medusa.decode.batch`) rely on, with shapes, and declares what each engine is good at as
attributes (:attr:`Engine.scores_all_nodes`, :attr:`Engine.fixed_shapes`, :attr:`Engine.step_buckets`,
:attr:`Engine.supports_batch`), never probed. Engines are registered by name (:func:`register_engine`,
:data:`ENGINES`) and made by :func:`make_engine`.

- ``eager``: transformers' ``DynamicCache``, grown by concatenation and cut after each tree
(:mod:`medusa.engines.kv_cache`).
- ``static``: a cache preallocated for prompt + budget + tree, written in place; the accepted path is moved down by
  one gather per layer; masks written into buffers kept per step size (:mod:`medusa.engines.static_cache`).
- ``onednn``: ``static`` running its own shadow of the decoder whose linear layers, and the lm_head, use oneDNN
  prepacked copies of the base's weights (:mod:`medusa.engines.onednn`), on a CPU: a verify step cheaper, and the
  lm_head cheap enough to score every tree node at once (measured in docs/engines.md). Elsewhere (a GPU, or a CPU dtype
  oneDNN cannot run) it runs as ``static`` and says so (a warning on a CPU, since one was expected to pay there).
- ``compiled``: ``static`` with fixed shapes (attention reads all slots of a capacity rounded up to
  :data:`CAPACITY_BUCKET`, so one compilation serves many prompts) and the decoder stack under ``torch.compile``:
  CPU inductor with weight freezing (constant-folded, prepacked weights), CUDA graphs (``reduce-overhead``) on a
  GPU. Compilation happens in :meth:`CompiledEngine.warm_up` (or at the first step of each size) and its time is
  reported; where compiling fails the engine warns with the reason and runs as ``static``.

No engine changes anything outside itself: the base's modules are never swapped (the onednn engine runs its own
shadow modules that share the base's weights), derived weights (the transposed lm_head, packed copies) belong to the
engine object, and attention kernels are narrowed only around the engine's own forward.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from typing import ClassVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from medusa.engines import kv_cache
from medusa.profile import FALLBACK_ENGINE, EngineChoice, profile_key, profile_path, read_profile
from medusa.registry import claim

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The engine name that means: choose from this machine's stored profile (:func:`make_engine`)."""
DEFAULT_ENGINE = AUTO
"""The engine used when none is named (``make_engine(None, ...)`` reads it from this module when called). Speed
choices fixed on one CPU were wrong on the next (docs/engines.md), so the default is read from this machine's stored
profile, with :data:`medusa.profile.FALLBACK_ENGINE` (said in one log line) where none is stored; it never measures.
Name an engine to choose one."""

_SDPA_ENABLED = {  # kernel -> whether torch allows it now (torch keeps these flags process-wide)
    SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}


def attention_kernels(allowed) -> contextlib.AbstractContextManager:
    """A ``torch.nn.attention.sdpa_kernel`` block narrowing scaled-dot-product attention to the kernels enabled now
    that are in ``allowed`` (all enabled now when none is), or a no-op when that is what is enabled already.

    The no-op case keeps the choice local: a caller's own narrower choice (its ``sdpa_kernel``) is never widened,
    and a forward that starts while another thread's block is open leaves the flags to that block, so overlapping
    blocks never leave them changed (torch keeps the flags process-wide; if that block ends first, the rest of this
    forward runs with the kernels enabled outside: speed, and float rounding as between any two kernels).
    """
    enabled = [b for b, on in _SDPA_ENABLED.items() if on()]
    keep = [b for b in enabled if b in allowed] or enabled
    return contextlib.nullcontext() if keep == enabled else sdpa_kernel(keep)


class Engine(abc.ABC):
    """Cache plus forward: what the decoding loops ask of the base model, with shapes.

    A base class, not a ``Protocol``: every engine needs the same timing and attention-kernel block around its
    forward and the same owned transposed lm_head for few-row products, so those live here once and an engine
    writes only its cache and its forward (the four abstract methods), and, when its cache is not a
    ``DynamicCache``, the batched operations on it (``stack_rows`` ... ``select_rows``). A new engine is one subclass
    and one :func:`register_engine` line.

    Args:
        model: a transformers ``*ForCausalLM``.
        scores_all_nodes: override :attr:`scores_all_nodes` (``None``: the engine's own choice).
    """

    name: ClassVar[str] = ""
    """The registry name (set by :func:`register_engine`)."""
    summary: ClassVar[str] = ""
    """One line for the CLI's ``--engine`` help."""
    fixed_shapes: bool = False
    """Each step size (and cache capacity) is compiled once, so a new size costs a compilation: warm up the sizes
    decoding will use (:meth:`warm_up`)."""
    step_buckets: tuple[int, ...] | None = None
    """The step sizes this engine pads a step up to, or ``None``: any step size costs the same to set up (no
    engine pads today; ``compiled`` compiles each exact size, see :attr:`fixed_shapes`)."""
    smooth_step_cost: bool = False
    """A forward's cost grows smoothly with its size (one code path for every size, as the native int4 decoder's),
    so a per-step tree may take any size at the cost interpolated between the measured ones; else (torch picks
    kernels by shape, and a cost can jump between sizes) a tree settles on the sizes the profile measured."""
    products_visible: ClassVar[bool] = True
    """The forward's matrix products run as torch ops that ``torch.profiler`` sees, so the profile can split a
    forward into them and the rest (:func:`medusa.tools.measure.time_outside_products`); an engine whose forward is
    one opaque call (the native int4 decoder) sets it False."""
    supports_batch: ClassVar[bool] = True
    """Several rows can share a forward (:class:`medusa.decode.loop.RunningBatch`) through this engine's batch
    operations (the ones here work on a ``DynamicCache``: an engine with a cache of its own overrides them, or
    declares this False); one row always can."""
    returns_layers: ClassVar[bool] = True
    """:meth:`forward_features` can return the outputs of the base's intermediate decoder layers (what a feature
    drafter such as :mod:`medusa.drafters.eagle` drafts from); an engine that cannot leaves it False."""
    drafter_dtypes: ClassVar[tuple] = (None,)
    """The dtypes the drafter's products may take beside this engine (:meth:`drafter_product`); ``None`` is the
    weights' own. Where there are several, :meth:`medusa.model.MedusaModel.use_per_step_tree` keeps the one whose
    drafting this machine's profile measured cheapest (settable :attr:`drafter_dtype`)."""
    drafter_dtype = None
    """The one of :attr:`drafter_dtypes` the drafter's products use."""
    drafter_products_key: ClassVar[str | None] = None
    """Names the drafter products (:meth:`drafter_product`) where they change the drafting cost beyond a packed copy
    (part of the profile's drafter key, :func:`medusa.profile.heads_key`); ``None``: matmul or a packed copy."""

    def drafter_product(self, weight: torch.Tensor, role: str):
        """The product the heads draft through for ``weight`` ``(N, K)``: ``rows (M, K) -> (M, N)``, or ``None``
        (``matmul`` / ``nn.Linear``, as here). ``role``: ``"projection"`` (the heads' shared lm_head rows),
        ``"input{k}"`` (Hydra head k's input layer) or ``"block{k}.{j}"`` (its j-th ResBlock's linear). The engines
        that pack their own products offer a packed copy of the projection
        (:func:`medusa.engines.onednn.packed_drafter_product`), so the choice follows the engine (which ``auto``
        makes from this machine's measured profile), never a guess about the CPU."""
        return None
    sdpa_backends: tuple | None = None
    """Scaled-dot-product attention kernels allowed around :meth:`forward` on CUDA (``None``: torch's choice)."""

    @classmethod
    def candidate_for(cls, device, dtype: torch.dtype) -> bool:
        """Whether ``--engine auto`` should measure and consider this engine for a base on ``device`` in ``dtype``
        (:func:`auto_candidates`). The default is no: an engine opts in (one that compiles each step size, or runs
        as another engine there, would make the profile slow or measure the same thing twice)."""
        return False

    def __init__(self, model, scores_all_nodes: bool | None = None):
        self.model = model
        self.scores_all_nodes: bool = self._scores_all_nodes() if scores_all_nodes is None else scores_all_nodes
        """True when one lm_head product over every tree node is cheaper than scoring along the accepted path one
        row at a time (:meth:`lm_logits_rows`); both accept the same tokens."""
        self.last_forward_s = 0.0
        """Seconds the last :meth:`forward` took (the mask, the decoder and the lm_head rows asked for)."""
        self.sync_timing = False
        """Wait for the device at the end of each forward so :attr:`last_forward_s` is its true cost (CUDA)."""
        self._transposed = kv_cache.TransposedLMHead()  # this engine's (H, V) lm_head copy, made at first use
        self._near_ties = kv_cache.NearTies()
        self.choice = None
        """How ``--engine auto`` came to this engine (:class:`medusa.profile.EngineChoice`), when it did."""

    def _scores_all_nodes(self) -> bool:
        """The default of :attr:`scores_all_nodes`: on an accelerator, yes; on a CPU, one lm_head row at a time
        along the path (its matrix-vector kernel beats its few-row product there)."""
        return self.model.device.type != "cpu"

    # -- one sequence -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def new_cache(self, capacity: int):
        """An empty cache for a decode call that needs ``capacity`` positions (prompt + budget + tree nodes)."""

    @abc.abstractmethod
    def cache_length(self, cache) -> int:
        """Positions held by ``cache``."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache,
                logits_for: torch.Tensor | slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over new tokens after the cached ones; their keys/values are added to ``cache``.

        Args:
            input_ids: ``(N,)`` long token ids.
            positions: ``(N,)`` long position ids.
            tree_mask: ``(N, N)`` bool, ``[i, j]`` True when new token i may attend to new token j.
            cache: from :meth:`new_cache`.
            logits_for: which of the N rows need logits (index tensor or slice); ``None``: all.

        Returns:
            ``(logits (M, V), hidden (N, H))``; times itself (:attr:`last_forward_s`).

        Raises:
            ValueError: no new token (N = 0).
        """
        if input_ids is not None and input_ids.shape[-1] == 0:  # None: a subclass forward that reads no ids
            raise ValueError(f"the {self.name} engine's forward takes at least one new token, got none")
        start = time.perf_counter()
        cuda = self.model.device.type == "cuda"
        with attention_kernels(self.sdpa_backends) if cuda and self.sdpa_backends is not None else (
                contextlib.nullcontext()):
            out = self._forward(input_ids, positions, tree_mask, cache, logits_for)
        if self.sync_timing and cuda:
            torch.cuda.synchronize(self.model.device)
        self.last_forward_s = time.perf_counter() - start
        return self._settle_forward(out, logits_for)

    def _settle_forward(self, out: tuple, logits_for) -> tuple:
        """A forward's ``(logits, hidden, ...)`` with its logits' near-tie rows settled (:meth:`settle`)."""
        logits, hidden = out[0], out[1]
        if not self._settles(logits):
            return out
        rows = hidden if logits_for is None else hidden[logits_for]
        return (self.settle(rows, logits), *out[1:])

    def forward_features(self, input_ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache,
                         layers: tuple[int, ...], logits_for: torch.Tensor | slice | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward` that also returns the outputs of the base's decoder layers ``layers`` (0-based).

        Returns:
            ``(logits (M, V), hidden (N, H), features (N, len(layers) * H))``.

        Raises:
            ValueError: no layer asked for, or this engine cannot return layers (:attr:`returns_layers`).
        """
        if not layers:
            raise ValueError("forward_features needs at least one layer index")
        if not self.returns_layers:
            raise ValueError(f"the {self.name} engine cannot return the base's intermediate layers: choose another "
                             "engine for a feature drafter")
        start = time.perf_counter()
        cuda = self.model.device.type == "cuda"
        with attention_kernels(self.sdpa_backends) if cuda and self.sdpa_backends is not None else (
                contextlib.nullcontext()):
            out = self._forward(input_ids, positions, tree_mask, cache, logits_for, layers=tuple(layers))
        if self.sync_timing and cuda:
            torch.cuda.synchronize(self.model.device)
        self.last_forward_s = time.perf_counter() - start
        return self._settle_forward(out, logits_for)

    @abc.abstractmethod
    def _forward(self, input_ids, positions, tree_mask, cache, logits_for, layers: tuple[int, ...] = ()):
        """:meth:`forward` without the timing and the attention-kernel block; with ``layers`` (only engines that
        declare :attr:`returns_layers`) it returns those layers' outputs third."""

    @abc.abstractmethod
    def keep_positions(self, cache, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep the first ``prefix_len`` cached positions and after them the new ones at indices ``keep`` ``(A,)``
        (into the last forward's N tokens), in that order."""

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base's own lm_head (and soft-capping): ``(..., H)`` -> ``(..., V)``."""
        return kv_cache.lm_logits(self.model, hidden)

    def lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`lm_logits` for one or a few rows ``(M, H)`` -> ``(M, V)``, this engine's cheapest way
        (:meth:`_lm_logits_rows`), its near-tie rows settled (:meth:`settle`)."""
        logits = self._lm_logits_rows(hidden)
        return self.settle(hidden, logits) if self._settles(logits) else logits

    def _lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`lm_logits_rows` before settling: here a transposed lm_head copy the engine keeps
        (:class:`medusa.engines.kv_cache.TransposedLMHead`)."""
        return self._transposed.logits(self.model, hidden)

    head_row_invariant: bool = False
    """The lm_head gives a row the same bits whatever rows are scored beside it (a quantized engine's own heads):
    nothing to settle."""

    def _settles(self, logits: torch.Tensor) -> bool:
        """Whether these logits are settled: fp32 on a CPU (whose products' rounding the bound of :meth:`settle`
        covers; not TF32 on a GPU), from a head that is not row-invariant."""
        return (not self.head_row_invariant and logits.dtype == torch.float32 and logits.device.type == "cpu"
                and logits.numel() > 0)

    def settle(self, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` of rows ``hidden`` with each near-tie row replaced by its one-row product through the base's
        lm_head, so that greedy decoding reads the same token from a row whichever product scored it (alone, in a
        tree, in a batch): :class:`medusa.engines.kv_cache.NearTies`."""
        return self._near_ties.settle(self.model, hidden, logits)

    def warm_up(self, step_sizes: list[int], needed: int = 32) -> dict[str, float]:
        """Prepare the steps of these sizes for a call needing ``needed`` cache positions (compile them, where the
        engine compiles); returns the seconds each took by ``"N@capacity"`` (empty: nothing to prepare)."""
        return {}

    @property
    def profile_name(self) -> str:
        """The name this engine's costs are stored under in the machine profile: :attr:`name`, plus the options
        that change its cost (an engine whose options do overrides this, e.g. ``int4:lm_head=bf16``)."""
        return self.name

    def settings(self) -> dict:
        """What the bench records about this engine."""
        auto = {} if self.choice is None else {"auto": self.choice.to_dict()}
        return {"engine": self.name, "scores_all_nodes": self.scores_all_nodes} | auto

    # -- several rows (medusa.decode.loop.RunningBatch): the batched layout of medusa.engines.kv_cache -----------
    # Each engine batches on its own cache: here a DynamicCache (kv_cache's functions); the static engines override
    # these with their SlotCache's (medusa.engines.static_cache). Rows are prefilled on their own (new_cache +
    # forward, as one sequence), then stacked.
    def _batch_decoder(self) -> torch.nn.Module | None:
        """The decoder stack batched forwards run (``None``: the model's own)."""
        return None

    def prefill_row(self, input_ids: torch.Tensor, layers: tuple[int, ...] = (), capacity: int | None = None
                    ) -> tuple:
        """One prompt's own forward ``(T,)`` into a fresh cache of this engine for ``capacity`` positions (``None``:
        the prompt's; a batched step needs room for its tree): ``(cache, logits (1, V) of its last position, hidden
        (T, H))``; with ``layers``, also those decoder layers' outputs ``(T, len(layers) * H)``
        (:meth:`forward_features`)."""
        n = len(input_ids)
        cache = self.new_cache(n if capacity is None else capacity)
        positions = torch.arange(n, device=input_ids.device)
        mask = kv_cache.causal_mask(n, input_ids.device)
        if layers:
            return (cache, *self.forward_features(input_ids, positions, mask, cache, layers, slice(-1, None)))
        return (cache, *self.forward(input_ids, positions, mask, cache, logits_for=slice(-1, None)))

    def _prefix_decoder(self):
        """The C decoder (:class:`medusa.engines.native.NativeDecoder`) the next forward runs, whose one-row caches
        give exact prefix snapshots; ``None`` here: torch's kernels may round a token's sums differently with the
        number of tokens in the forward, so a prompt prefilled from a copy would not get the bits of one prefilled
        whole. The engines whose forward gives each token the same bits however the prompt is cut override it."""
        return None

    def prefix_snapshot(self, cache, length: int):
        """A copy of the first ``length`` positions of a one-row ``cache`` just prefilled, for
        :meth:`restore_prefix` into the cache of a later prompt that starts with the same tokens
        (:mod:`medusa.decode.prefix`), with ``nbytes`` and ``length``; ``None`` where this engine cannot promise
        that a prompt prefilled from it gets the bits of one prefilled whole (:meth:`_prefix_decoder`), or where
        another build of the weights or a non-C forward wrote some position of ``cache``."""
        decoder = self._prefix_decoder()
        return None if decoder is None else decoder.snapshot(cache, length)

    def restore_prefix(self, snapshot, cache, length: int) -> bool:
        """Put the first ``length`` positions of ``snapshot`` (:meth:`prefix_snapshot` of this engine) into the
        fresh one-row ``cache`` and count them as cached; ``False``, nothing written, where it cannot (the weights
        were built again since the copy, or the engine gives no snapshots)."""
        decoder = self._prefix_decoder()
        return decoder is not None and decoder.restore(snapshot, cache, length)

    def prefix_current(self, snapshot) -> bool:
        """Whether the next forward still computes with the weights ``snapshot`` was made with (checked again before
        the first forward after :meth:`restore_prefix`: the weights may change in between)."""
        decoder = self._prefix_decoder()
        return decoder is not None and decoder.build == snapshot.build

    def stack_rows(self, caches: list):
        """One batched cache from caches of this engine holding one row or more each, of different lengths
        (:func:`medusa.engines.kv_cache.stack_rows`)."""
        return kv_cache.stack_rows(caches)

    def rows_cache_length(self, cache) -> int:
        """Slots in use in a batched cache (the longest row's length)."""
        return kv_cache.cache_length(cache)

    def forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, valid_len: torch.Tensor,
                     new_visible: torch.Tensor, cache, layers: tuple[int, ...] = ()):
        """One forward over ``(B, N)`` new tokens at ``(B, N)`` positions, rows with ``valid_len`` ``(B,)`` cached
        positions; ``new_visible`` ``(N, N)`` or ``(B, N, N)`` bool among the new tokens. Returns the hidden states
        ``(B, N, H)``; with ``layers``, ``(hidden, features (B, N, len(layers) * H))``
        (:func:`medusa.engines.kv_cache.forward_rows`); times itself (:attr:`last_forward_s`)."""
        start = time.perf_counter()
        out = self._forward_rows(input_ids, positions, valid_len, new_visible, cache, tuple(layers))
        if self.sync_timing and self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.last_forward_s = time.perf_counter() - start
        return out

    def _forward_rows(self, input_ids, positions, valid_len, new_visible, cache, layers):
        return kv_cache.forward_rows(self.model, input_ids, positions, valid_len, new_visible, cache,
                                     self._batch_decoder(), layers)

    def keep_row_paths(self, cache, prefix_len: int, valid_len: torch.Tensor, keep: list[torch.Tensor]
                       ) -> torch.Tensor:
        """Keep each row's accepted nodes ``keep[b]`` ``(A_b,)`` after its own prefix; returns the new ``valid_len``
        ``(B,)`` (:func:`medusa.engines.kv_cache.keep_row_paths`)."""
        return kv_cache.keep_row_paths(cache, prefix_len, valid_len, keep)

    def select_rows(self, cache, rows: torch.Tensor, length: int) -> None:
        """Keep only batch rows ``rows`` ``(B',)`` and ``length`` slots
        (:func:`medusa.engines.kv_cache.select_rows`)."""
        kv_cache.select_rows(cache, rows, length)

    def batch_lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of ``(M, H)`` rows picked from a batched forward along the rows' paths: one row through the
        transposed copy, several through the base's lm_head, their near-tie rows settled (:meth:`settle`); an engine
        whose own lm_head is row-invariant scores every count of rows through it."""
        if self.head_row_invariant:
            return self.lm_logits(hidden)
        logits = self._transposed.logits(self.model, hidden) if len(hidden) == 1 else self.lm_logits(hidden)
        return self.settle(hidden, logits) if self._settles(logits) else logits


ENGINES: dict[str, type[Engine]] = {}
"""The registered engines by name, in registration order (:func:`register_engine`)."""


def register_engine(name: str):
    """Class decorator: register an :class:`Engine` subclass under ``name`` for :func:`make_engine` and the CLI.

    Raises:
        ValueError: ``name`` is taken by another class (both named, module-qualified).
    """
    def register(cls: type[Engine]) -> type[Engine]:
        claim(ENGINES, name, cls, "engine")
        cls.name = name
        return cls

    return register


def auto_candidates(device, dtype: torch.dtype) -> list[str]:
    """The registered engines ``auto`` measures and chooses among for a base on ``device`` in ``dtype``: those whose
    :meth:`Engine.candidate_for` says so, in registration order."""
    device = torch.device(device)
    return [name for name, cls in ENGINES.items() if cls.candidate_for(device, dtype)]


def make_engine(name: str | None, model, max_cache_len: int | None = None, step_size: int | None = None,
                profile=None, **options) -> Engine:
    """The engine registered as ``name`` (:data:`ENGINES`) bound to ``model``; ``options`` go to its constructor
    (every engine takes ``scores_all_nodes``: ``True``/``False`` overrides its own choice).

    ``name`` ``None`` is :data:`DEFAULT_ENGINE`; ``"auto"`` (:data:`AUTO`) is the engine this machine's profile says
    is cheapest for steps of ``step_size`` new tokens (the tree's nodes; ``None``: 1) among the candidates
    (:func:`auto_candidates`) whose plain decoding keeps up with Hugging Face ``generate``. The profile is
    ``profile`` (a :class:`medusa.profile.MachineProfile`), else the stored one; nothing is measured here. Without a
    usable one, :data:`medusa.profile.FALLBACK_ENGINE`, said in one warning with the way to measure
    (:mod:`medusa.tools.measure`). The engine's :attr:`Engine.choice` says why.

    Raises:
        ValueError: an unknown engine name (naming the registered ones).
    """
    name = DEFAULT_ENGINE if name is None else name
    if max_cache_len is not None:
        options["max_cache_len"] = max_cache_len
    if name != AUTO:
        cls = ENGINES.get(name)
        if cls is None:
            raise ValueError(f"unknown engine {name!r}: choose one of {', '.join([AUTO, *ENGINES])}")
        return cls(model, **options)
    choice = auto_choice(model, step_size or 1, profile)
    try:
        engine = ENGINES[choice.engine](model, **options)
    except Exception as e:  # noqa: BLE001 - auto never fails where the fallback engine runs; it says why
        reason = f"{FALLBACK_ENGINE}: the chosen {choice.engine} engine could not be made ({type(e).__name__}: {e})"
        logger.warning("--engine auto: %s", reason)
        choice = EngineChoice(FALLBACK_ENGINE, reason, choice.step_size, choice.profile)
        engine = ENGINES[FALLBACK_ENGINE](model, **options)
    engine.choice = choice
    return engine


_FALLBACKS_SAID: set[str] = set()
"""The fallback reasons :func:`auto_choice` has logged as warnings in this process (each is said once)."""


def auto_choice(model, step_size: int = 1, profile=None) -> EngineChoice:
    """``--engine auto``'s choice for ``model`` and steps of ``step_size`` new tokens, from ``profile`` or the stored
    profile (:func:`medusa.profile.read_profile`), never measured; :data:`medusa.profile.FALLBACK_ENGINE` with the
    reason where there is none (one warning per process and profile file) or it has no candidate that ran."""
    why, path = "given", None
    if profile is None:
        key = profile_key(model)
        path = profile_path(key)
        profile, why = read_profile(path, key)
    if profile is None:
        reason = (f"{FALLBACK_ENGINE}: the static default, not measured (no machine profile of this model at {path}: "
                  f"{why}; `medusa profile --base MODEL` or use_engine('auto', measure=True) measures one)")
        # Once per process and profile file: a loop of decode calls without an engine says it once, not per call.
        logger.log(logging.DEBUG if reason in _FALLBACKS_SAID else logging.WARNING, "--engine auto: %s", reason)
        _FALLBACKS_SAID.add(reason)
        return EngineChoice(FALLBACK_ENGINE, reason, step_size)
    try:
        choice = profile.choose_engine(step_size, auto_candidates(model.device, model.dtype))
    except ValueError as e:
        reason = f"{FALLBACK_ENGINE}: the machine profile {profile.path} has no usable candidate ({e})"
        logger.warning("--engine auto: %s", reason)
        return EngineChoice(FALLBACK_ENGINE, reason, step_size, str(profile.path) if profile.path else None)
    logger.info("--engine auto: %s", choice.reason)
    return choice


def check_dtype(dtype: torch.dtype, device) -> None:
    """Raise ``ValueError`` when ``device`` cannot run a forward in ``dtype`` (not floating, or no kernels)."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating-point dtype; use float32, bfloat16 or float16")
    device = torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(f"{device} does not support bfloat16; use float16 or float32")
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device)
        torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
        torch.nn.functional.linear(x, x).softmax(-1)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{device} cannot run {dtype}: {e}") from e
