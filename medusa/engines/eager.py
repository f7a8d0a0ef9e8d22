"""The eager engine: transformers' ``DynamicCache``, grown and cut (the reference engine)."""

from __future__ import annotations

import torch

from medusa.engines import kv_cache
from medusa.engines.base import Engine, register_engine


@register_engine("eager")
class EagerEngine(Engine):
    """transformers' ``DynamicCache`` through :mod:`medusa.engines.kv_cache` (the reference engine).

    ``max_cache_len`` is accepted and ignored: the cache grows as needed.
    """

    summary = "transformers' DynamicCache, grown and cut (the reference)"

    @classmethod
    def candidate_for(cls, device, dtype: torch.dtype) -> bool:
        """``auto`` considers it everywhere (it runs wherever the base does)."""
        return True

    def __init__(self, model, max_cache_len: int | None = None, scores_all_nodes: bool | None = None):
        super().__init__(model, scores_all_nodes)

    def new_cache(self, capacity: int):
        return kv_cache.new_cache()

    def cache_length(self, cache) -> int:
        return kv_cache.cache_length(cache)

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for, layers=()):
        return kv_cache.forward(self.model, input_ids, positions, tree_mask, cache, logits_for, layers=layers)

    def keep_positions(self, cache, prefix_len: int, keep: torch.Tensor) -> None:
        kv_cache.keep_positions(cache, prefix_len, keep)


