"""Decode engines: where the base's KV cache lives and how one forward over new tokens runs.

Every engine subclasses :class:`Engine`, which states the contract the generation loop (:mod:`medusa.generate`) and
batched decoding (:mod:`medusa.batch`) rely on, with shapes, and declares what each engine is good at as attributes
(:attr:`Engine.scores_all_nodes`, :attr:`Engine.fixed_shapes`, :attr:`Engine.step_buckets`,
:attr:`Engine.supports_batch`), never probed. Engines are registered by name (:func:`register_engine`,
:data:`ENGINES`) and made by :func:`make_engine`.

- ``eager``: transformers' ``DynamicCache``, grown by concatenation and cut after each tree (:mod:`medusa.kv_cache`).
- ``static``: a cache preallocated for prompt + budget + tree, written in place; the accepted path is moved down by
  one gather per layer; masks written into buffers kept per step size (:mod:`medusa.static_cache`).
- ``onednn``: ``static`` running its own shadow of the decoder whose linear layers, and the lm_head, use oneDNN
  prepacked copies of the base's weights (:mod:`medusa.onednn`), on a CPU: a verify step cheaper, and the lm_head
  cheap enough to score every tree node at once (measured in docs/engines.md). Elsewhere (a GPU, or a CPU dtype
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
import warnings
from typing import ClassVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from medusa import kv_cache, onednn, static_cache

logger = logging.getLogger(__name__)

DEFAULT_ENGINE = "onednn"
"""The engine used when none is named (the measured comparison is in docs/engines.md)."""
CAPACITY_BUCKET = 256
"""The compiled engine's cache capacity is rounded up to a multiple of this (shapes, hence compilations, shared)."""

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
    forward, the same owned transposed lm_head for few-row products and the same batched decoding on a
    ``DynamicCache``, so those live here once and an engine writes only its cache and its forward (the four abstract
    methods). A new engine is one subclass and one :func:`register_engine` line.

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
    supports_batch: ClassVar[bool] = True
    """Batched decoding (:mod:`medusa.batch`) can run through this engine's batch operations."""
    sdpa_backends: tuple | None = None
    """Scaled-dot-product attention kernels allowed around :meth:`forward` on CUDA (``None``: torch's choice)."""

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
        """
        start = time.perf_counter()
        cuda = self.model.device.type == "cuda"
        with attention_kernels(self.sdpa_backends) if cuda and self.sdpa_backends is not None else (
                contextlib.nullcontext()):
            out = self._forward(input_ids, positions, tree_mask, cache, logits_for)
        if self.sync_timing and cuda:
            torch.cuda.synchronize(self.model.device)
        self.last_forward_s = time.perf_counter() - start
        return out

    @abc.abstractmethod
    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        """:meth:`forward` without the timing and the attention-kernel block."""

    @abc.abstractmethod
    def keep_positions(self, cache, prefix_len: int, keep: torch.Tensor) -> None:
        """Keep the first ``prefix_len`` cached positions and after them the new ones at indices ``keep`` ``(A,)``
        (into the last forward's N tokens), in that order."""

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base's own lm_head (and soft-capping): ``(..., H)`` -> ``(..., V)``."""
        return kv_cache.lm_logits(self.model, hidden)

    def lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`lm_logits` for one or a few rows ``(M, H)`` -> ``(M, V)``, this engine's cheapest way (here a
        transposed lm_head copy the engine keeps, :class:`medusa.kv_cache.TransposedLMHead`)."""
        return self._transposed.logits(self.model, hidden)

    def warm_up(self, step_sizes: list[int], needed: int = 32) -> dict[str, float]:
        """Prepare the steps of these sizes for a call needing ``needed`` cache positions (compile them, where the
        engine compiles); returns the seconds each took by ``"N@capacity"`` (empty: nothing to prepare)."""
        return {}

    def settings(self) -> dict:
        """What the bench records about this engine."""
        return {"engine": self.name, "scores_all_nodes": self.scores_all_nodes}

    # -- batched decoding (medusa.batch): a DynamicCache with per-row holes, see medusa.kv_cache ------------------
    def _batch_decoder(self) -> torch.nn.Module | None:
        """The decoder stack batched forwards run (``None``: the model's own)."""
        return None

    def prefill_row(self, input_ids: torch.Tensor) -> tuple:
        """One prompt's own forward ``(T,)`` into a fresh single-row cache: ``(cache, logits (1, V) of its last
        position, hidden (T, H))``."""
        cache = kv_cache.new_cache()
        n = len(input_ids)
        positions = torch.arange(n, device=input_ids.device)
        logits, hidden = kv_cache.forward(self.model, input_ids, positions, kv_cache.causal_mask(n, input_ids.device),
                                          cache, logits_for=slice(-1, None), decoder=self._batch_decoder())
        return cache, logits, hidden

    def stack_rows(self, caches: list):
        """One batched cache from :meth:`prefill_row` caches of different lengths
        (:func:`medusa.kv_cache.stack_rows`)."""
        return kv_cache.stack_rows(caches)

    def rows_cache_length(self, cache) -> int:
        """Slots in a batched cache (the longest row's length)."""
        return kv_cache.cache_length(cache)

    def forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor, valid_len: torch.Tensor,
                     new_visible: torch.Tensor, cache) -> torch.Tensor:
        """One forward over ``(B, N)`` new tokens at ``(B, N)`` positions, rows with ``valid_len`` ``(B,)`` cached
        positions; ``new_visible`` ``(N, N)`` or ``(B, N, N)`` bool among the new tokens. Returns the hidden states
        ``(B, N, H)`` (:func:`medusa.kv_cache.forward_rows`)."""
        return kv_cache.forward_rows(self.model, input_ids, positions, valid_len, new_visible, cache,
                                     self._batch_decoder())

    def keep_row_paths(self, cache, prefix_len: int, valid_len: torch.Tensor, keep: list[torch.Tensor]
                       ) -> torch.Tensor:
        """Keep each row's accepted nodes ``keep[b]`` ``(A_b,)`` after its own prefix; returns the new ``valid_len``
        ``(B,)`` (:func:`medusa.kv_cache.keep_row_paths`)."""
        return kv_cache.keep_row_paths(cache, prefix_len, valid_len, keep)

    def select_rows(self, cache, rows: torch.Tensor, length: int) -> None:
        """Keep only batch rows ``rows`` ``(B',)`` and ``length`` slots (:func:`medusa.kv_cache.select_rows`)."""
        kv_cache.select_rows(cache, rows, length)

    def batch_lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of ``(M, H)`` rows picked from a batched forward: one row through the transposed copy, several
        through the base's lm_head (the same on every engine: batched decoding never uses a packed lm_head)."""
        return self._transposed.logits(self.model, hidden) if len(hidden) == 1 else self.lm_logits(hidden)


ENGINES: dict[str, type[Engine]] = {}
"""The registered engines by name, in registration order (:func:`register_engine`)."""


def register_engine(name: str):
    """Class decorator: register an :class:`Engine` subclass under ``name`` for :func:`make_engine` and the CLI.

    Raises:
        ValueError: ``name`` is taken by another class.
    """
    def register(cls: type[Engine]) -> type[Engine]:
        if name in ENGINES and ENGINES[name] is not cls:
            raise ValueError(f"engine name {name!r} is taken by {ENGINES[name].__qualname__}")
        cls.name = name
        ENGINES[name] = cls
        return cls

    return register


@register_engine("eager")
class EagerEngine(Engine):
    """transformers' ``DynamicCache`` through :mod:`medusa.kv_cache` (the reference engine).

    ``max_cache_len`` is accepted and ignored: the cache grows as needed.
    """

    summary = "transformers' DynamicCache, grown and cut (the reference)"

    def __init__(self, model, max_cache_len: int | None = None, scores_all_nodes: bool | None = None):
        super().__init__(model, scores_all_nodes)

    def new_cache(self, capacity: int):
        return kv_cache.new_cache()

    def cache_length(self, cache) -> int:
        return kv_cache.cache_length(cache)

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        return kv_cache.forward(self.model, input_ids, positions, tree_mask, cache, logits_for)

    def keep_positions(self, cache, prefix_len: int, keep: torch.Tensor) -> None:
        kv_cache.keep_positions(cache, prefix_len, keep)


@register_engine("static")
class StaticEngine(Engine):
    """A preallocated :class:`medusa.static_cache.SlotCache`; ``max_cache_len`` caps what one decode call may ask.

    Raises (from :meth:`new_cache`):
        medusa.static_cache.CacheFullError: a call needs more positions than ``max_cache_len``.
    """

    summary = "a preallocated cache written in place"
    # On CUDA, not cuDNN's attention: it builds an execution plan for every new key length, and this cache's
    # visible length grows every step (measured in docs/engines.md).
    sdpa_backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

    def __init__(self, model, max_cache_len: int | None = None, scores_all_nodes: bool | None = None):
        super().__init__(model, scores_all_nodes)
        self.max_cache_len = max_cache_len
        self.mask = static_cache.StaticMask(model.config, model.get_output_embeddings().weight.dtype)
        self.decoder = None  # the model's own decoder stack

    def new_cache(self, capacity: int):
        if self.max_cache_len is not None and capacity > self.max_cache_len:
            raise static_cache.CacheFullError(
                f"this decode call needs {capacity} cache positions (prompt + max_new_tokens + tree nodes) but the "
                f"{self.name} engine preallocates at most {self.max_cache_len} (max_cache_len)")
        return static_cache.new_cache(self.model, self._capacity(capacity), self.fixed_shapes)

    def _capacity(self, needed: int) -> int:
        return needed

    def cache_length(self, cache) -> int:
        return cache.length

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        return static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, self.decoder,
                                    logits_for)

    def keep_positions(self, cache, prefix_len: int, keep: torch.Tensor) -> None:
        cache.keep(prefix_len, keep)

    def settings(self) -> dict:
        backends = None if self.sdpa_backends is None else [b.name for b in self.sdpa_backends]
        return super().settings() | {"max_cache_len": self.max_cache_len, "cuda_sdpa_backends": backends}


@register_engine("onednn")
class OneDNNEngine(StaticEngine):
    """:class:`StaticEngine` whose forwards run a shadow of the decoder on oneDNN prepacked weights, and the
    lm_head's prepacked copy (:mod:`medusa.onednn`); the base's own modules are left as they are.

    Where those cannot run (:func:`medusa.onednn.onednn_unavailable`) it is exactly :class:`StaticEngine`;
    :attr:`fallback_reason` says why, and on a CPU a ``RuntimeWarning`` says it too. It also runs as static while
    the model's lm_head module, dtype or device is no longer the one it packed. Batched forwards run on the shadow
    decoder too; batched logits stay the base lm_head's (:meth:`Engine.batch_lm_logits`).
    """

    summary = ("static + the base's linear layers and lm_head on oneDNN prepacked copies (CPU; as much memory again "
               "as the weights; static elsewhere)")

    def __init__(self, model, max_cache_len: int | None = None, scores_all_nodes: bool | None = None):
        self.fallback_reason = onednn.onednn_unavailable(model)
        self.packed: onednn.PackedLinears | None = None  # this engine's own copies
        if self.fallback_reason is None:
            self.packed = onednn.PackedLinears(kv_cache.decoder_of(model), model.get_output_embeddings())
        elif model.device.type == "cpu":
            warnings.warn(f"engine 'onednn' runs as 'static': {self.fallback_reason}", RuntimeWarning, stacklevel=3)
        super().__init__(model, max_cache_len, scores_all_nodes)

    def _scores_all_nodes(self) -> bool:
        """Also with the lm_head prepacked: its product over every node is then cheapest."""
        return super()._scores_all_nodes() or self.packed is not None

    def _uses_packed(self) -> bool:
        """Packed, and the model still has the dtype, device and lm_head module it was packed with."""
        head = self.model.get_output_embeddings()
        return (self.packed is not None and head is self.packed.lm_head.module
                and head.weight.dtype == self.packed.dtype and head.weight.device.type == "cpu")

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        if not self._uses_packed():
            return super()._forward(input_ids, positions, tree_mask, cache, logits_for)
        self.packed.refresh()
        _, hidden = static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask,
                                         self.packed.shadow_decoder(), slice(0, 0))
        selected = hidden if logits_for is None else hidden[logits_for]
        return self.lm_logits_rows(selected), hidden

    def lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._uses_packed():
            return super().lm_logits_rows(hidden)
        return kv_cache.soft_cap(self.model, self.packed.lm_head_product(hidden))

    def _batch_decoder(self) -> torch.nn.Module | None:
        if not self._uses_packed():
            return None
        self.packed.refresh()
        return self.packed.shadow_decoder()

    def settings(self) -> dict:
        return super().settings() | {"packed": self.packed is not None, "fallback_reason": self.fallback_reason,
                                     "pack_rows": onednn.PACK_ROWS}


@register_engine("compiled")
class CompiledEngine(StaticEngine):
    """:class:`StaticEngine` with fixed shapes and the decoder stack under ``torch.compile`` (see module docstring).

    Args:
        freezing: CPU inductor's weight freezing (weights become constants, linear weights prepacked).
        mode: ``torch.compile`` mode; ``None``: ``"reduce-overhead"`` (CUDA graphs) on CUDA, default on CPU.
    """

    summary = "static + torch.compile of the decoder, fixed shapes (static with a warning where it cannot compile)"
    fixed_shapes = True
    sdpa_backends = None  # fixed shapes: one plan per step size, made while compiling

    def __init__(self, model, max_cache_len: int | None = None, freezing: bool = True, mode: str | None = None,
                 scores_all_nodes: bool | None = None):
        super().__init__(model, max_cache_len, scores_all_nodes)
        self.mode = mode if mode is not None else ("reduce-overhead" if model.device.type == "cuda" else None)
        self.freezing = freezing and model.device.type == "cpu"
        self.compile_s: dict[str, float] = {}  # "N@capacity" -> seconds its first (compiling) call took
        self.fallback_reason: str | None = None
        reason = compile_unavailable(model.device)
        if reason:
            self._fall_back(reason)
            return
        options = {"freezing": True} if self.freezing else None
        self.decoder = torch.compile(kv_cache.decoder_of(model), dynamic=False, mode=self.mode, options=options)

    def _capacity(self, needed: int) -> int:
        """``max_cache_len`` when set (one shape for every call), else ``needed`` rounded up to the bucket."""
        if self.max_cache_len is not None:
            return self.max_cache_len
        return -(-needed // CAPACITY_BUCKET) * CAPACITY_BUCKET

    def new_cache(self, capacity: int):
        cache = super().new_cache(capacity)
        cache.fixed_shape = self.decoder is not None
        return cache

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        n = len(input_ids)
        if self.decoder is None or cache.length == 0:  # the prefill (any length) runs eagerly
            return static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, None,
                                        logits_for)
        key = f"{n}@{cache.capacity}"  # one compilation per step size and capacity
        if key in self.compile_s:
            return static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, self.decoder,
                                        logits_for)
        start = time.perf_counter()
        try:
            out = static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, self.decoder,
                                       logits_for)
        except Exception as e:  # noqa: BLE001 - any compiler failure: warn with its reason and run eagerly
            self._fall_back(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            cache.fixed_shape = False
            return static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, None,
                                        logits_for)
        self.compile_s[key] = time.perf_counter() - start
        logger.info("compiled the %d-token step (cache of %d) in %.1f s", n, cache.capacity, self.compile_s[key])
        return out

    def warm_up(self, step_sizes: list[int], needed: int = 32) -> dict[str, float]:
        """Compile the steps of the given sizes now, for the cache a call needing ``needed`` positions gets (a
        throwaway call each); returns the compile seconds by ``"N@capacity"``. Every later call with that capacity
        reuses them: give ``max_cache_len`` to make it one capacity for all.
        """
        device = self.model.device
        prompt_len = 16
        cache = self.new_cache(max(needed, prompt_len + max(step_sizes)))
        with torch.inference_mode():
            ids = torch.zeros(max(prompt_len, *step_sizes), dtype=torch.long, device=device)
            self.forward(ids[:prompt_len], torch.arange(prompt_len, device=device),
                         kv_cache.causal_mask(prompt_len, device),
                         cache, logits_for=slice(-1, None))
            for n in step_sizes:
                start = cache.length
                self.forward(ids[:n], start + torch.arange(n, device=device), kv_cache.causal_mask(n, device), cache,
                             logits_for=slice(0, 0))
                self.keep_positions(cache, start, torch.zeros(0, dtype=torch.long, device=device))
        return dict(self.compile_s)

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        self.decoder = None
        self.fixed_shapes = False  # uncompiled: nothing to compile per size
        self.sdpa_backends = StaticEngine.sdpa_backends  # uncompiled: key lengths vary again, as in static
        warnings.warn(f"engine 'compiled' runs as 'static' (uncompiled): {reason}", RuntimeWarning, stacklevel=3)

    def settings(self) -> dict:
        return {"engine": self.name, "scores_all_nodes": self.scores_all_nodes, "max_cache_len": self.max_cache_len,
                "compile_mode": self.mode,
                "freezing": self.freezing, "compiled": self.decoder is not None,
                "fallback_reason": self.fallback_reason, "compile_s": dict(self.compile_s),
                "capacity_bucket": CAPACITY_BUCKET}


def compile_unavailable(device) -> str | None:
    """Why ``torch.compile`` cannot run here (no compile, dynamo unsupported, no C++ compiler), or ``None``."""
    import shutil

    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        from torch import _dynamo

        if not _dynamo.is_dynamo_supported():
            return "torch.compile (dynamo) is not supported on this Python"
    except ImportError as e:
        return f"torch._dynamo cannot be imported: {e}"
    if torch.device(device).type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler (c++, g++ or clang++) on PATH for CPU inductor"
    return None


def make_engine(name: str, model, max_cache_len: int | None = None, **options) -> Engine:
    """The engine registered as ``name`` (:data:`ENGINES`) bound to ``model``; ``options`` go to its constructor
    (every engine takes ``scores_all_nodes``: ``True``/``False`` overrides its own choice).

    Raises:
        ValueError: an unknown engine name (naming the registered ones).
    """
    cls = ENGINES.get(name)
    if cls is None:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")
    if max_cache_len is not None:
        options["max_cache_len"] = max_cache_len
    return cls(model, **options)


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
