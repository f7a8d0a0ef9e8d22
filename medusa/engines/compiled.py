"""The compiled engine: the static engine with fixed shapes and the decoder stack under ``torch.compile``."""

from __future__ import annotations

import logging
import time
import warnings

import torch

from medusa.engines import kv_cache, static_cache
from medusa.engines.base import register_engine
from medusa.engines.static import StaticEngine

logger = logging.getLogger(__name__)

CAPACITY_BUCKET = 256
"""The compiled engine's cache capacity is rounded up to a multiple of this (shapes, hence compilations, shared)."""

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

    @classmethod
    def candidate_for(cls, device, dtype: torch.dtype) -> bool:
        """Never ``auto``'s: each step size compiles for about a minute on two cores, so it stays opt-in
        (``--engine compiled``; ``medusa profile --engines compiled`` measures it on request)."""
        return False

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

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for, layers=()):
        n = len(input_ids)
        if self.decoder is None or cache.length == 0 or layers:
            # the prefill (any length) runs eagerly, and so do forwards asked for intermediate layers (the
            # compiled graph returns the last hidden state only)
            return static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, None,
                                        logits_for, layers)
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


