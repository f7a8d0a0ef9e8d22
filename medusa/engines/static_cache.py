"""A preallocated KV cache written in place: every touch-point of the static engine with transformers' cache API.

The stock model calls ``cache.update(keys, values, layer_idx, ...)`` in each attention layer and attends over what
it returns. :class:`SlotCache` answers that call by copying the new keys/values into fixed slots of buffers
allocated once (``(1, H_kv, capacity, d)`` per layer) and returning a view of the slots the step may read. The mask
(4D additive, see :mod:`medusa.engines.kv_cache`) hides every slot a query may not see, including unused ones, so the
view can have a fixed length (``fixed_shape``: one shape per step size, what a compiled or graph-captured step needs)
or end at the last written slot (less attention work in eager mode).

transformers' own ``StaticCache`` keeps a write pointer of its own and ignores ``cache_position``: after a rejected
tree it would append behind the rejected slots. Here the write slots are set by the caller before each forward
(:meth:`SlotCache.begin_step`), so a tree is written at ``length .. length+N-1`` and the accepted path is moved down
by one gather per layer (:meth:`SlotCache.keep`).

Like :func:`medusa.engines.kv_cache.new_cache`, every position is kept in every layer, sliding-window ones included;
the window is enforced by the mask.

Batched decoding (:class:`medusa.decode.loop.RunningBatch`) runs on this cache too, in the batched layout of
:mod:`medusa.engines.kv_cache` (row b's slot s holds its position s up to its own length, holes after it hidden by the
mask): :func:`stack_rows` puts rows prefilled on their own into one ``(B, H_kv, capacity, d)`` cache,
:func:`forward_rows` writes a step of ``(B, N)`` tokens after the longest row, :func:`keep_row_paths` moves each row's
accepted path down after its own prefix and :func:`select_rows` drops rows. ``length`` is then the longest row's.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from medusa.engines import kv_cache


class CacheFullError(ValueError):
    """A step would write past the preallocated slots."""


class _SlotLayer(CacheLayerMixin):
    """One layer's preallocated keys/values; written only through :meth:`SlotCache.update`."""

    is_compileable = True

    def lazy_initialization(self, key_states, value_states) -> None:  # allocation is done by SlotCache
        raise NotImplementedError

    def update(self, key_states, value_states, *args, **kwargs):  # SlotCache.update does the writing
        raise NotImplementedError

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("SlotCache is used with explicit 4D masks only")

    def get_seq_length(self) -> int:
        raise NotImplementedError

    def get_max_length(self) -> int:
        return -1 if self.keys is None else self.keys.shape[-2]

    def get_max_cache_shape(self) -> int:  # the same, under its older name (abstract in some 5.x releases)
        return self.get_max_length()


class SlotCache(Cache):
    """Keys and values of every layer in buffers of ``capacity`` slots, allocated at the first write (the prefill).

    Slots ``0 .. length-1`` hold positions ``0 .. length-1`` in order (the prompt and the accepted tokens); a step
    writes its N new tokens at slots ``length .. length+N-1`` and :meth:`keep` leaves only the accepted ones.

    Args:
        num_layers: the decoder's attention layers.
        capacity: slots per layer: prompt + generation budget + one tree at least.
        fixed_shape: attention reads all ``capacity`` slots every step (fixed shapes); else only up to the last
            written slot.
    """

    def __init__(self, num_layers: int, capacity: int, fixed_shape: bool = False):
        super().__init__(layers=[_SlotLayer() for _ in range(num_layers)])
        self.capacity = capacity
        self.fixed_shape = fixed_shape
        self.length = 0
        self.visible = 0  # slots the current step's attention reads
        self._slots = torch.arange(capacity)  # (capacity,) moved to the device at the first write
        self._write: dict[int, torch.Tensor] = {}  # N -> (N,) long write slots of a step of N tokens

    def begin_step(self, n: int) -> torch.Tensor:
        """Point the next forward's writes at slots ``length .. length+n-1``; returns those ``(n,)`` slots.

        Raises:
            CacheFullError: the step does not fit the preallocated slots.
        """
        if self.length + n > self.capacity:
            raise CacheFullError(
                f"the KV cache holds {self.capacity} positions ({self.length} used) and cannot take {n} more: "
                f"preallocate more (prompt + max_new_tokens + tree nodes), or shorten the prompt or the budget"
            )
        write = self._write.get(n)
        if write is None:
            write = self._write[n] = torch.empty(n, dtype=torch.long, device=self._slots.device)
        torch.add(self._slots[:n], self.length, out=write)
        self.visible = self.capacity if self.fixed_shape else self.length + n
        return write

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``(1, H_kv, N, d)`` keys/values at the step's slots; return the ``(1, H_kv, visible, d)`` views."""
        layer = self.layers[layer_idx]
        if layer.keys is None:
            shape = (*key_states.shape[:2], self.capacity, key_states.shape[-1])
            layer.keys = key_states.new_zeros(shape)
            layer.values = value_states.new_zeros((*shape[:3], value_states.shape[-1]))
            layer.is_initialized = True
            if layer.keys.is_cuda:  # CUDA graphs may then replay writes into these very buffers (compiled engine)
                torch._dynamo.mark_static_address(layer.keys)
                torch._dynamo.mark_static_address(layer.values)
        write = self._write[key_states.shape[-2]]
        layer.keys.index_copy_(2, write, key_states)
        layer.values.index_copy_(2, write, value_states)
        return layer.keys[:, :, : self.visible], layer.values[:, :, : self.visible]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    def keep(self, prefix_len: int, keep: torch.Tensor) -> None:
        """Leave the first ``prefix_len`` slots and, after them, the new slots listed in ``keep`` ``(A,)`` in order.

        One gather and one write per layer's keys and values; the prefix is never copied, and nothing is when the
        kept slots are already in place (``keep`` is ``0 .. A-1``: plain decoding, an accepted chain prefix).
        """
        if keep.device.type == "cpu" and (keep.numel() == 0 or int(keep[-1]) == len(keep) - 1
                                          and bool((keep[1:] > keep[:-1]).all())):
            self.length = prefix_len + len(keep)
            return
        store = getattr(self, "slot_store", None)  # every layer's keys and values in one tensor (an engine's)
        first = self.layers[0].keys
        if store is not None and first is not None and first.data_ptr() == store.data_ptr():
            kept = keep.to(store.device) + prefix_len  # (A,) slots kept
            store[:, prefix_len : prefix_len + len(keep)] = store.index_select(1, kept)
        else:
            kv_cache.move_slots(self, keep.to(self._slots.device) + prefix_len, prefix_len)  # (A,) slots kept
        self.length = prefix_len + len(keep)

    def to_device(self, device) -> None:
        self._slots = self._slots.to(device)
        self._write.clear()


class StaticMask:
    """The 4D additive attention mask of a step, written into buffers kept per step size by
    :func:`medusa.engines.kv_cache.additive_masks` (the form of :func:`medusa.engines.kv_cache.build_attention_mask`;
    here the key axis is the cache's slots).

    Slot ``j < length`` holds position ``j``; the new tokens' slots hold their ``positions``. A new token sees the
    prefix slots, the new slots ``tree_mask`` allows, nothing else; sliding-window layers also hide keys
    ``sliding_window`` or more positions behind the query.
    """

    def __init__(self, config, dtype):
        self.config = config
        self.layout = kv_cache.attention_layout(config)  # (kinds, sliding window)
        self.per_layer_type = getattr(config.get_text_config(decoder=True), "layer_types", None) is not None
        self.dtype = dtype
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # (kind, N) -> (1, 1, N, capacity)

    def write(self, cache: SlotCache, positions: torch.Tensor, tree_mask: torch.Tensor):
        """The mask for ``N`` new tokens at ``positions`` ``(N,)`` about to be written after ``cache.length`` slots.

        Returns:
            A ``(1, 1, N, cache.visible)`` view of a preallocated buffer, or a dict of them keyed by layer type.
        """
        n, length, visible = len(positions), cache.length, cache.visible
        device = positions.device
        slots = cache._slots[:visible]  # (S,)
        key_pos = torch.where(slots < length, slots, -1)  # (S,) slots past the prefix: filled below or unused
        key_pos[length : length + n] = positions
        seen = slots[None, :] < length  # (1, S)
        new = torch.zeros(n, visible, dtype=torch.bool, device=device)  # (N, S)
        new[:, length : length + n] = tree_mask
        allowed = seen | new  # (N, S)
        buffers = {kind: self._buffer(kind, n, cache.capacity, device)[..., :visible] for kind in self.layout[0]}
        masks = kv_cache.additive_masks(allowed, positions, key_pos, self.layout, self.dtype, out=buffers)
        return masks if self.per_layer_type else next(iter(masks.values()))

    def _buffer(self, kind: str, n: int, capacity: int, device) -> torch.Tensor:
        buffer = self._buffers.get((kind, n))
        if buffer is None or buffer.shape[-1] != capacity:
            buffer = self._buffers[(kind, n)] = torch.zeros(1, 1, n, capacity, dtype=self.dtype, device=device)
        return buffer


def new_cache(model, capacity: int, fixed_shape: bool = False) -> SlotCache:
    """An empty :class:`SlotCache` for ``model``'s decoder."""
    config = model.config.get_text_config(decoder=True)
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    cache = SlotCache(layers, capacity, fixed_shape)
    cache.to_device(model.device)
    return cache


def forward(model, input_ids, positions, tree_mask, cache: SlotCache, mask: StaticMask, decoder=None,
            logits_for: torch.Tensor | slice | None = None, layers: tuple[int, ...] = ()):
    """:func:`medusa.engines.kv_cache.forward` through a :class:`SlotCache`; ``decoder`` replaces the model's decoder
    stack when given (a compiled one, or the onednn engine's copy on prepacked weights). The new tokens are written
    after ``cache.length`` slots and counted in it; :meth:`SlotCache.keep` then decides which stay.

    Returns:
        ``(logits, hidden)``: ``(M, V)`` logits for the selected positions and ``(N, H)`` last hidden states; with
        ``layers``, also the outputs of those decoder layers (:func:`medusa.engines.kv_cache.forward`).
    """
    stack = kv_cache.decoder_of(model)
    cache.begin_step(len(input_ids))
    attention = mask.write(cache, positions, tree_mask)
    kwargs = {kv_cache._cache_kwarg(type(stack)): cache}
    if layers:
        kwargs["output_hidden_states"] = True
    run = stack if decoder is None else decoder
    out = run(input_ids=input_ids[None], position_ids=positions[None], attention_mask=attention, use_cache=True,
              **kwargs)
    cache.length += len(input_ids)
    hidden = out.last_hidden_state[0]  # (N, H)
    selected = hidden if logits_for is None else hidden[logits_for]
    if layers:
        return kv_cache.lm_logits(model, selected), hidden, kv_cache.layer_features(out, layers)[0]  # (N, k*H)
    return kv_cache.lm_logits(model, selected), hidden


# Batched decoding on a SlotCache (see the module docstring): the batched layout of medusa.engines.kv_cache, in the
# preallocated slots; a batched cache reads only up to its last written slot (no fixed shape).


def stack_rows(caches: list[SlotCache]) -> SlotCache:
    """One batched cache from caches of one row or more each (their rows in order), each row's slots from 0, zero
    holes after the shorter rows; its capacity is the largest one's (each row's own need: prompt + budget + tree).
    """
    capacity, length = max(c.capacity for c in caches), max(c.length for c in caches)
    out = SlotCache(len(caches[0].layers), capacity)
    out.to_device(caches[0]._slots.device)
    for i, layer in enumerate(out.layers):
        rows = [c.layers[i] for c in caches]
        if any(r.keys is None for r in rows):
            continue
        for name in ("keys", "values"):
            parts = [getattr(r, name)[:, :, :length] for r in rows]  # (b, H_kv, <= length, d) each
            batch, heads, _, dim = parts[0].shape
            t = parts[0].new_zeros((sum(p.shape[0] for p in parts), heads, capacity, dim))
            start = 0
            for p in parts:
                t[start : start + p.shape[0], :, : p.shape[2]] = p
                start += p.shape[0]
            setattr(layer, name, t)
        layer.is_initialized = True
    out.length = length
    return out


def forward_rows(model, input_ids: torch.Tensor, positions: torch.Tensor, valid_len: torch.Tensor,
                 new_visible: torch.Tensor, cache: SlotCache, decoder: torch.nn.Module | None = None,
                 layers: tuple[int, ...] = ()):
    """:func:`medusa.engines.kv_cache.forward_rows` on a batched :class:`SlotCache`: ``(B, N)`` new tokens written
    at slots ``length .. length+N-1`` of every row (a row shorter than ``length`` keeps a hole before them).

    Returns:
        ``(B, N, H)`` last hidden states; with ``layers``, ``(hidden, features (B, N, len(layers) * H))``.

    Raises:
        CacheFullError: the step does not fit the preallocated slots.
    """
    stack = kv_cache.decoder_of(model)
    length, n = cache.length, input_ids.shape[1]
    cache.begin_step(n)
    dtype = model.get_output_embeddings().weight.dtype
    mask = kv_cache.build_rows_attention_mask(model.config, valid_len, length, positions, new_visible, dtype)
    kwargs = {kv_cache._cache_kwarg(type(stack)): cache}
    if layers:
        kwargs["output_hidden_states"] = True
    run = stack if decoder is None else decoder
    out = run(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True, **kwargs)
    cache.length += n
    if layers:
        return out.last_hidden_state, kv_cache.layer_features(out, layers)  # (B, N, H), (B, N, k*H)
    return out.last_hidden_state  # (B, N, H)


def keep_row_paths(cache: SlotCache, prefix_len: int, valid_len: torch.Tensor, keep: list[torch.Tensor]
                   ) -> torch.Tensor:
    """:func:`medusa.engines.kv_cache.keep_row_paths` on a batched :class:`SlotCache` (only the kept slots are
    copied; ``length`` becomes the new longest row's). Returns ``(B,)`` the new ``valid_len``."""
    rows, src, dst, new_len = kv_cache.row_path_slots(prefix_len, valid_len, keep)
    kv_cache.move_slots(cache, src, 0, rows, dst)
    cache.length = int(new_len.max())
    return new_len


def select_rows(cache: SlotCache, rows: torch.Tensor, length: int) -> None:
    """Keep only batch rows ``rows`` ``(B',)`` (in that order), ``length`` slots in use (one copy of those rows)."""
    for layer in cache.layers:
        if layer.keys is not None:
            r = rows.to(layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(0, r), layer.values.index_select(0, r)
    cache.length = length
