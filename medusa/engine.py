"""Decode engines: where the base's KV cache lives and how one forward over new tokens runs.

The generation loop (:mod:`medusa.generate`) talks to an engine through five methods, the contract of
:mod:`medusa.kv_cache`: ``new_cache(capacity)``, ``cache_length(cache)``, ``forward(ids, positions, tree_mask,
cache, logits_for)``, ``keep_positions(cache, prefix_len, keep)`` and ``lm_logits_rows(hidden)``.

- ``eager``: transformers' ``DynamicCache``, grown by concatenation and cut after each tree (:mod:`medusa.kv_cache`).
- ``static``: a cache preallocated for prompt + budget + tree, written in place; the accepted path is moved down by
  one gather per layer; masks written into buffers kept per step size (:mod:`medusa.static_cache`).
- ``onednn``: ``static`` with the base's linear layers and lm_head run on oneDNN prepacked copies of their weights
  (:mod:`medusa.onednn`), on a CPU: a verify step over 11 tokens about 1.3x cheaper, a plain step 1.1x, and the
  lm_head cheap enough to score every tree node at once. Elsewhere (a GPU, or a CPU dtype oneDNN cannot run) it runs
  as ``static`` and says so (a warning on a CPU, since one was expected to pay there).
- ``compiled``: ``static`` with fixed shapes (attention reads all slots of a capacity rounded up to
  :data:`CAPACITY_BUCKET`, so one compilation serves many prompts) and the decoder stack under ``torch.compile``:
  CPU inductor with weight freezing (constant-folded, prepacked weights), CUDA graphs (``reduce-overhead``) on a
  GPU. Compilation happens in :meth:`CompiledEngine.warm_up` (or at the first step of each size) and its time is
  reported; where compiling fails the engine warns with the reason and runs as ``static``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings

import torch
from torch.nn.attention import SDPBackend

from medusa import kv_cache, onednn, static_cache

logger = logging.getLogger(__name__)

ENGINES = ("eager", "static", "onednn", "compiled")
DEFAULT_ENGINE = "onednn"
"""The engine used when none is named (the measured comparison is in README, "Decode engines")."""
CAPACITY_BUCKET = 256
"""The compiled engine's cache capacity is rounded up to a multiple of this (shapes, hence compilations, shared)."""

_B = torch.backends.cuda
_SDPA_FLAGS = {  # kernel -> (is it enabled, enable it): torch's process-wide switches
    SDPBackend.CUDNN_ATTENTION: (_B.cudnn_sdp_enabled, _B.enable_cudnn_sdp),
    SDPBackend.FLASH_ATTENTION: (_B.flash_sdp_enabled, _B.enable_flash_sdp),
    SDPBackend.EFFICIENT_ATTENTION: (_B.mem_efficient_sdp_enabled, _B.enable_mem_efficient_sdp),
    SDPBackend.MATH: (_B.math_sdp_enabled, _B.enable_math_sdp)}
_sdpa_lock = threading.Lock()
_sdpa_state = {"depth": 0, "saved": None}  # open attention_backends() blocks (all threads), the flags they replaced


@contextlib.contextmanager
def attention_backends(allowed):
    """Narrow the process's (global) scaled-dot-product-attention kernels to ``allowed`` for the block: the kernels
    enabled now and in ``allowed`` (all enabled now when none is). Counted across threads: the first block in saves
    the flags, the last one out restores them, so overlapping blocks never leave them changed; a caller's own
    narrower choice (``sdpa_kernel``) is kept."""
    with _sdpa_lock:
        if _sdpa_state["depth"] == 0:
            saved = {b: enabled() for b, (enabled, _) in _SDPA_FLAGS.items()}
            keep = {b for b, on in saved.items() if on and b in allowed} or {b for b, on in saved.items() if on}
            for b, (_, enable) in _SDPA_FLAGS.items():
                enable(b in keep)
            _sdpa_state["saved"] = saved
        _sdpa_state["depth"] += 1
    try:
        yield
    finally:
        with _sdpa_lock:
            _sdpa_state["depth"] -= 1
            if _sdpa_state["depth"] == 0:
                for b, on in _sdpa_state["saved"].items():
                    _SDPA_FLAGS[b][1](on)


class EagerEngine:
    """transformers' ``DynamicCache`` through :mod:`medusa.kv_cache` (the reference engine)."""

    name = "eager"
    sdpa_backends: tuple | None = None  # scaled-dot-product attention kernels allowed on CUDA (None: torch's choice)

    def __init__(self, model):
        self.model = model
        self.last_forward_s = 0.0
        """Seconds the last :meth:`forward` took (the mask, the decoder and the lm_head rows asked for)."""
        self.sync_timing = False
        """Wait for the device at the end of each forward so :attr:`last_forward_s` is its true cost (CUDA)."""

    @property
    def scores_all_nodes(self) -> bool:  # TEMPORARY until the engines branch lands
        return self.model.device.type != "cpu" or getattr(self, "packed", None) is not None

    def new_cache(self, capacity: int):
        return kv_cache.new_cache()

    def cache_length(self, cache) -> int:
        return kv_cache.cache_length(cache)

    def forward(self, input_ids, positions, tree_mask, cache, logits_for=None):
        """One forward over ``(N,)`` new tokens (:func:`medusa.kv_cache.forward`): ``(logits (M, V), hidden (N, H))``;
        times itself (:attr:`last_forward_s`)."""
        start = time.perf_counter()
        backends = self.sdpa_backends if self.model.device.type == "cuda" else None
        with attention_backends(backends) if backends is not None else contextlib.nullcontext():
            out = self._forward(input_ids, positions, tree_mask, cache, logits_for)
        if self.sync_timing and self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.last_forward_s = time.perf_counter() - start
        return out

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        return kv_cache.forward(self.model, input_ids, positions, tree_mask, cache, logits_for)

    def keep_positions(self, cache, prefix_len: int, keep: torch.Tensor) -> None:
        kv_cache.keep_positions(cache, prefix_len, keep)

    def lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return kv_cache.lm_logits_rows(self.model, hidden)

    def settings(self) -> dict:
        """What the bench records about this engine."""
        return {"engine": self.name}


class StaticEngine(EagerEngine):
    """A preallocated :class:`medusa.static_cache.SlotCache`; ``max_cache_len`` caps what one decode call may ask.

    Raises (from :meth:`new_cache`):
        medusa.static_cache.CacheFullError: a call needs more positions than ``max_cache_len``.
    """

    name = "static"
    fixed_shape = False
    # On CUDA, not cuDNN's attention: it builds an execution plan for every new key length (1.28 ms of CPU per layer
    # and step on an H200 with a 7B shape: a plain step of 56 ms against 23 ms at a fixed length;
    # docs/results/gpu-h200-profile-plain-decoding.txt), and this cache's visible length grows every step.
    sdpa_backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

    def __init__(self, model, max_cache_len: int | None = None):
        super().__init__(model)
        self.max_cache_len = max_cache_len
        self.mask = static_cache.StaticMask(model.config, model.get_output_embeddings().weight.dtype)
        self.decoder = None  # the model's own decoder stack

    def new_cache(self, capacity: int):
        if self.max_cache_len is not None and capacity > self.max_cache_len:
            raise static_cache.CacheFullError(
                f"this decode call needs {capacity} cache positions (prompt + max_new_tokens + tree nodes) but the "
                f"{self.name} engine preallocates at most {self.max_cache_len} (max_cache_len)")
        return static_cache.new_cache(self.model, self._capacity(capacity), self.fixed_shape)

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
        return {"engine": self.name, "max_cache_len": self.max_cache_len, "cuda_sdpa_backends": backends}


class OneDNNEngine(StaticEngine):
    """:class:`StaticEngine` whose forwards run the base's linear layers and lm_head on oneDNN prepacked weights.

    See :mod:`medusa.onednn`. Where those cannot run (:func:`medusa.onednn.onednn_unavailable`) it is exactly
    :class:`StaticEngine`; :attr:`fallback_reason` says why, and on a CPU a ``RuntimeWarning`` says it too.
    """

    name = "onednn"

    def __init__(self, model, max_cache_len: int | None = None):
        super().__init__(model, max_cache_len)
        self.fallback_reason = onednn.onednn_unavailable(model)
        self.packed = None
        if self.fallback_reason is None:
            self.packed = onednn.packed_linears(model, kv_cache.decoder_of(model))
        elif model.device.type == "cpu":
            warnings.warn(f"engine 'onednn' runs as 'static': {self.fallback_reason}", RuntimeWarning, stacklevel=3)

    @property
    def packs_lm_head(self) -> bool:
        """Whether the lm_head runs on its prepacked copy (then scoring every tree node at once is cheapest)."""
        return self.packed is not None

    def uses_packed(self) -> bool:
        """Packed, and the model still has the dtype, device and lm_head module it was packed with."""
        head = self.model.get_output_embeddings()
        return (self.packed is not None and head is self.packed.lm_head.module
                and head.weight.dtype == self.packed.dtype and head.weight.device.type == "cpu")

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for):
        if not self.uses_packed():
            return super()._forward(input_ids, positions, tree_mask, cache, logits_for)
        with self.packed.swapped():
            _, hidden = static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, None,
                                             slice(0, 0))
        selected = hidden if logits_for is None else hidden[logits_for]
        return self.lm_logits_rows(selected), hidden

    def lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.uses_packed():
            return super().lm_logits_rows(hidden)
        return kv_cache.soft_cap(self.model, self.packed.lm_head_product(hidden))

    def settings(self) -> dict:
        return super().settings() | {"packed": self.packed is not None, "fallback_reason": self.fallback_reason,
                                     "pack_rows": onednn.PACK_ROWS}


class CompiledEngine(StaticEngine):
    """:class:`StaticEngine` with fixed shapes and the decoder stack under ``torch.compile`` (see module docstring).

    Args:
        freezing: CPU inductor's weight freezing (weights become constants, linear weights prepacked).
        mode: ``torch.compile`` mode; ``None``: ``"reduce-overhead"`` (CUDA graphs) on CUDA, default on CPU.
    """

    name = "compiled"
    fixed_shape = True
    sdpa_backends = None  # fixed shapes: one plan per step size, made while compiling

    def __init__(self, model, max_cache_len: int | None = None, freezing: bool = True, mode: str | None = None):
        super().__init__(model, max_cache_len)
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
        self.sdpa_backends = StaticEngine.sdpa_backends  # uncompiled: key lengths vary again, as in static
        warnings.warn(f"engine 'compiled' runs as 'static' (uncompiled): {reason}", RuntimeWarning, stacklevel=3)

    def settings(self) -> dict:
        return {"engine": self.name, "max_cache_len": self.max_cache_len, "compile_mode": self.mode,
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


def make_engine(name: str, model, max_cache_len: int | None = None, **options):
    """The engine ``name`` (one of :data:`ENGINES`) bound to ``model``.

    Raises:
        ValueError: an unknown engine name.
    """
    if name == "eager":
        return EagerEngine(model)
    if name == "static":
        return StaticEngine(model, max_cache_len)
    if name == "onednn":
        return OneDNNEngine(model, max_cache_len)
    if name == "compiled":
        return CompiledEngine(model, max_cache_len, **options)
    raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINES)}")


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
