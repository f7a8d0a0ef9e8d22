"""The static engine: a preallocated cache written in place (:mod:`medusa.engines.static_cache`)."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from medusa.engines import static_cache
from medusa.engines.base import Engine, register_engine


@register_engine("static")
class StaticEngine(Engine):
    """A preallocated :class:`medusa.engines.static_cache.SlotCache`; ``max_cache_len`` caps what one decode call may
    ask.

    Raises (from :meth:`new_cache`):
        medusa.engines.static_cache.CacheFullError: a call needs more positions than ``max_cache_len``.
    """

    summary = "a preallocated cache written in place"
    # On CUDA, not cuDNN's attention: it builds an execution plan for every new key length, and this cache's
    # visible length grows every step (measured in docs/engines.md).
    sdpa_backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

    @classmethod
    def candidate_for(cls, device, dtype: torch.dtype) -> bool:
        """``auto`` considers it everywhere (it runs wherever the base does)."""
        return True

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

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for, layers=()):
        return static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask, self.decoder,
                                    logits_for, layers)

    def keep_positions(self, cache, prefix_len: int, keep: torch.Tensor) -> None:
        cache.keep(prefix_len, keep)

    def settings(self) -> dict:
        backends = None if self.sdpa_backends is None else [b.name for b in self.sdpa_backends]
        return super().settings() | {"max_cache_len": self.max_cache_len, "cuda_sdpa_backends": backends}


