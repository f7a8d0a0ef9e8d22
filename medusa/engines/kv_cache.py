"""Every touch-point between Medusa decoding and transformers' cache, mask and forward APIs lives here.

Supported: transformers 5.17 through 5.24. Differences handled here:
- the cache keyword of ``forward`` is ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (found from the
  decoder's signature, never from a version string);
- ``DynamicCache.crop`` changed meaning across releases, so it is not used: rejected tree nodes are removed by
  rewriting each layer's ``keys``/``values`` directly.

Masks are passed as 4D *additive* float masks (0 where visible, dtype-min where not): a boolean 4D mask gives wrong
logits with eager attention in 5.24. Models with per-layer attention types (Gemma 2/3, Qwen2 with ``layer_types``)
get a dict of masks keyed by layer type; a model with a single ``sliding_window`` (Mistral) gets the sliding mask.

The cache is a plain ``DynamicCache()`` built without the model config, so sliding-window layers keep every position
too: a rejected tree can then be cut out without losing prefix tokens a sliding layer had already dropped. The
sliding window is enforced by the mask instead.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
from transformers import DynamicCache

FULL, SLIDING = "full_attention", "sliding_attention"


def new_cache() -> DynamicCache:
    """An empty cache that keeps every position in every layer (see module docstring)."""
    return DynamicCache()


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by the cache."""
    return cache.get_seq_length()


def decoder_of(model) -> torch.nn.Module:
    """The model's decoder stack (the part that returns the last hidden state, after the final norm)."""
    decoder = model.get_decoder()
    if decoder is model:
        raise ValueError(f"{type(model).__name__} exposes no separate decoder stack; cannot read its hidden states")
    return decoder


@functools.cache
def _cache_kwarg(decoder_cls: type) -> str:
    params = inspect.signature(decoder_cls.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{decoder_cls.__name__}.forward takes neither `cache` nor `past_key_values`")


def attention_layout(config) -> tuple[set[str], int | None]:
    """Which attention kinds the model's layers use and its sliding window.

    Returns:
        ``(kinds, sliding_window)``: kinds is a subset of {"full_attention", "sliding_attention"}.

    Raises:
        NotImplementedError: a layer type other than full or sliding attention (chunked, linear...).
    """
    config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return ({SLIDING} if window is not None else {FULL}), window
    kinds = set(layer_types)
    unsupported = kinds - {FULL, SLIDING}
    if unsupported:
        raise NotImplementedError(f"attention layer types {sorted(unsupported)} are not supported by tree decoding")
    return kinds, (window if SLIDING in kinds else None)


def additive_masks(visible: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                   layout: tuple[set[str], int | None], dtype, out: dict[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """The one mask builder: 4D additive masks (0 where a query may attend, dtype-min where not) per attention kind.

    Every other builder (:func:`build_attention_mask`, :func:`build_rows_attention_mask`,
    :class:`medusa.engines.static_cache.StaticMask`) says which keys each query may see; this adds the sliding window
    (keys ``sliding_window`` or more positions behind the query are hidden) and writes the additive form.

    Args:
        visible: ``(..., N, K)`` bool, True where query i may see key j before the window is applied.
        query_pos: ``(..., N)`` long positions of the queries.
        key_pos: ``(..., K)`` long positions of the keys.
        layout: the model's attention kinds and sliding window (:func:`attention_layout`).
        dtype: dtype of the masks.
        out: attention kind -> a preallocated tensor of ``visible``'s shape (or one it broadcasts into) to fill in
            place; ``None``: new tensors.

    Returns:
        Attention kind -> its ``visible``-shaped additive mask.
    """
    kinds, window = layout
    masks = {}
    for kind in kinds:
        allowed = visible
        if kind == SLIDING:
            allowed = visible & (query_pos[..., :, None] - key_pos[..., None, :] < window)  # (..., N, K)
        if out is None:
            additive = torch.zeros(allowed.shape, dtype=dtype, device=visible.device)
        else:
            additive = out[kind].zero_()
        additive.masked_fill_(~allowed, torch.finfo(dtype).min)
        masks[kind] = additive
    return masks


def model_masks(config, masks: dict[str, torch.Tensor]):
    """What the model's forward takes: the dict of masks by layer type when its config has ``layer_types``, else the
    one mask."""
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)
    return masks if layer_types is not None else next(iter(masks.values()))


def build_attention_mask(config, prefix_len: int, positions: torch.Tensor, tree_mask: torch.Tensor, dtype):
    """The attention mask for ``N`` new tokens after ``prefix_len`` cached ones, in the form the model expects.

    Each new token sees the whole cached prefix and the new tokens that ``tree_mask`` allows (a causal
    lower-triangle for ordinary decoding, ancestors for a Medusa tree); sliding-window layers additionally hide
    keys ``sliding_window`` or more positions behind the query (:func:`additive_masks`).

    Args:
        config: the base model's config.
        prefix_len: positions already in the cache (their positions are ``0..prefix_len-1``).
        positions: ``(N,)`` long position ids of the new tokens.
        tree_mask: ``(N, N)`` bool, ``[i, j]`` True when new token i may attend to new token j.
        dtype: dtype of the additive mask (the model's compute dtype).

    Returns:
        A ``(1, 1, N, prefix_len + N)`` additive float mask, or a dict of them keyed by attention layer type.
    """
    device = positions.device
    key_pos = torch.cat([torch.arange(prefix_len, device=device), positions])  # (L+N,)
    visible = torch.cat([torch.ones(len(positions), prefix_len, dtype=torch.bool, device=device), tree_mask], 1)
    masks = additive_masks(visible, positions, key_pos, attention_layout(config), dtype)  # (N, L+N) each
    return model_masks(config, {kind: m[None, None] for kind, m in masks.items()})  # (1, 1, N, L+N)


def causal_mask(n: int, device) -> torch.Tensor:
    """``(n, n)`` bool lower-triangular mask: ordinary causal attention among ``n`` new tokens."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def layer_features(out, layers: tuple[int, ...]) -> torch.Tensor | None:
    """The outputs of decoder layers ``layers`` (0-based) of a decoder run with ``output_hidden_states=True``,
    concatenated: ``(..., len(layers) * H)``; ``None`` when no layer is asked for.

    transformers' ``hidden_states`` holds the embeddings first and then each layer's output, the last one after the
    final norm (what ``last_hidden_state`` is), so layer ``i`` is entry ``i + 1``.
    """
    if not layers:
        return None
    return torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)


def forward(model, input_ids, positions, tree_mask, cache, logits_for: torch.Tensor | slice | None = None,
            decoder: torch.nn.Module | None = None, layers: tuple[int, ...] = ()):
    """One forward of the stock model over new tokens at explicit positions with an explicit mask.

    Args:
        model: a transformers ``*ForCausalLM``.
        input_ids: ``(N,)`` long token ids (batch size 1).
        positions: ``(N,)`` long position ids.
        tree_mask: ``(N, N)`` bool mask among the new tokens (see :func:`build_attention_mask`).
        cache: the cache; the new keys/values are appended to it.
        logits_for: which of the N positions need logits (index tensor or slice); ``None`` for all.
        decoder: runs in place of the model's decoder stack (an engine's copy of it sharing its weights).
        layers: decoder layers (0-based) whose outputs are returned too (:func:`layer_features`).

    Returns:
        ``(logits, hidden)``: ``(M, V)`` float logits for the selected positions and ``(N, H)`` last hidden states;
        with ``layers``, ``(logits, hidden, features (N, len(layers) * H))``.
    """
    stack = decoder_of(model)
    dtype = model.get_output_embeddings().weight.dtype
    mask = build_attention_mask(model.config, cache_length(cache), positions, tree_mask, dtype)
    kwargs = {_cache_kwarg(type(stack)): cache}
    if layers:
        kwargs["output_hidden_states"] = True
    run = stack if decoder is None else decoder
    out = run(input_ids=input_ids[None], position_ids=positions[None], attention_mask=mask, use_cache=True, **kwargs)
    hidden = out.last_hidden_state[0]  # (N, H)
    selected = hidden if logits_for is None else hidden[logits_for]
    if layers:
        return lm_logits(model, selected), hidden, layer_features(out, layers)[0]  # (N, k*H)
    return lm_logits(model, selected), hidden


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The base's own logits from last hidden states ``(..., H)`` -> ``(..., V)``, with its final soft-capping."""
    return soft_cap(model, model.get_output_embeddings()(hidden))


def soft_cap(model, logits: torch.Tensor) -> torch.Tensor:
    """The base's final logit soft-capping (Gemma 2: ``cap * tanh(logits / cap)``) applied to raw lm_head logits;
    ``logits`` unchanged when the base has none."""
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def weight_version(weight: torch.Tensor) -> int | None:
    """``weight``'s in-place version counter, or ``None`` for an inference tensor (made under
    ``torch.inference_mode()``), which keeps none: a copy of it is then remade only when the tensor is replaced."""
    return None if weight.is_inference() else weight._version


class TransposedLMHead:
    """A transposed ``(H, V)`` copy of a model's lm_head weight, for products with one or a few rows.

    On a CPU a product of one row with the ``(V, H)`` weight runs a matrix-vector kernel that is slower than the
    same product with the ``(H, V)`` layout (measured in docs/engines.md). The copy belongs to whoever made this
    object (an engine); it is made at the first use and again when the weight is replaced or changed in place
    (:func:`weight_version`), and costs the lm_head's size in memory. The logits equal :func:`lm_logits` up to float
    summation order.
    """

    def __init__(self):
        self._weight = None  # a weak reference to the weight copied
        self._version = None
        self._copy = None  # (H, V)

    def logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """:func:`lm_logits` for ``(M, H)`` rows -> ``(M, V)``, through the transposed copy."""
        head = model.get_output_embeddings()
        weight = head.weight
        if self._copy is None or self._weight() is not weight or self._version != weight_version(weight):
            self._weight, self._version = weakref.ref(weight), weight_version(weight)
            self._copy = weight.detach().T.contiguous()  # (H, V)
        logits = hidden @ self._copy  # (M, V)
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias
        return soft_cap(model, logits)


class NearTies:
    """Settles rows whose best fp32 logits are too close for a product's rounding to decide between them, so that
    the token greedy decoding reads from a row does not depend on which product scored it: a CPU kernel sums a
    product over several rows in another order than over one, so without this a prompt decoded in a tree or a batch
    could read another token at a near-tie than decoded alone.

    Any order of summing a fp32 product of length H is within ``gamma_H * sum |h_i w_i|`` of the exact value (Higham,
    "Accuracy and Stability of Numerical Algorithms", section 3.1; ``gamma_H = H u / (1 - H u)``, ``u = 2^-24``), at
    most ``t = gamma_H * ||h|| * max_v ||w_v||`` (Cauchy-Schwarz; a bias or soft-capping adds a rounding, and
    soft-capping only narrows gaps: ``2 u |logit|`` more). So any token that is the argmax of some product, and the
    exact argmax, has a logit within ``4 t`` of the best in every product. Where a row's second-best logit is that
    close, the tokens that close (the candidates) are scored again exactly (float64 dot products of the row with
    their lm_head rows): the candidates get those values (rounded to fp32), and the exact argmax stays the row's
    unique best (a candidate rounded up to it is moved one fp32 step below). Every product then gives the row the
    same argmax, the exact one; the other logits keep the product's bits.
    """

    def __init__(self):
        self._weight = None  # a weak reference to the lm_head weight measured
        self._version = None
        self._row_norm = 0.0  # its largest row 2-norm (one token's)

    def settle(self, model, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``(..., V)`` fp32 of rows ``hidden`` ``(..., H)`` with their near-tie rows settled (the same
        tensor when there are none)."""
        flat_h, flat = hidden.reshape(-1, hidden.shape[-1]), logits.reshape(-1, logits.shape[-1])
        if flat.shape[0] == 0 or flat.shape[1] < 2:
            return logits
        head = model.get_output_embeddings()
        weight = head.weight
        if self._weight is None or self._weight() is not weight or self._version != weight_version(weight):
            self._weight, self._version = weakref.ref(weight), weight_version(weight)
            # fp32 norms, rounded up past their own error (a double copy would be the lm_head's size twice over)
            self._row_norm = float(torch.linalg.vector_norm(weight.detach().float(), dim=1).max()) * (1 + 1e-4)
        u = 2.0 ** -24
        gamma = flat_h.shape[1] * u / (1 - flat_h.shape[1] * u)
        top = flat.detach().topk(2, dim=-1).values.double()  # (M, 2)
        bound = gamma * flat_h.detach().double().norm(dim=1) * self._row_norm + 2 * u * top[:, 0].abs()  # (M,)
        near = ((top[:, 0] - top[:, 1]) <= 4 * bound).nonzero().flatten().tolist()
        if not near:
            return logits
        out = flat.detach().clone()
        bias = getattr(head, "bias", None)
        for i in near:
            candidates = (out[i] >= top[i, 0] - 4 * bound[i]).nonzero().flatten()  # (C,) ascending
            exact = weight.detach()[candidates].double() @ flat_h[i].detach().double()  # (C,)
            if bias is not None:
                exact = exact + bias.detach()[candidates].double()
            exact = soft_cap(model, exact)
            best = int(exact.argmax())  # ties: the lower id
            values = exact.float()
            below = torch.nextafter(values[best], torch.tensor(float("-inf")))
            values = torch.where((values >= values[best]) & (torch.arange(len(values)) != best), below, values)
            out[i, candidates] = values
        return out.view_as(logits)


def lm_logits_rows(model, hidden: torch.Tensor, head: TransposedLMHead | None = None) -> torch.Tensor:
    """:func:`lm_logits` for one or a few rows ``(M, H)`` -> ``(M, V)`` through a transposed lm_head copy: the one
    ``head`` keeps (an engine's, :meth:`medusa.engines.Engine.lm_logits_rows`), else one made for this call."""
    return (head if head is not None else TransposedLMHead()).logits(model, hidden)


def _filled_layers(cache):
    """The cache's layers that hold keys and values (a layer not written yet holds none)."""
    return [layer for layer in cache.layers
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel() > 0]


def move_slots(cache, src: torch.Tensor, start: int, rows: torch.Tensor | None = None,
               dst: torch.Tensor | None = None, end: int | None = None) -> None:
    """The one path compaction: copy cached slots ``src`` down to where the kept path goes, in every filled layer.

    Gather first (a copy), then write: a kept slot's source is never before its destination, and nothing else
    (no prefix) is copied. The keys/values are ``(B, H_kv, S, d)``.

    Args:
        src: ``(M,)`` long slots to keep, in order.
        start: with ``rows=None``, every batch row's kept slots go to ``start .. start+M-1``.
        rows: ``(M,)`` long batch row of each kept slot, which goes to that row's slot ``dst`` ``(M,)``.
        end: the cache is then cut to ``end`` slots (a ``DynamicCache``); ``None``: left as long (a preallocated one).
    """
    on: dict = {}  # device -> the index tensors there (moved once, not per layer)
    for layer in _filled_layers(cache):
        device = layer.keys.device
        if device not in on:
            on[device] = tuple(None if t is None else t.to(device) for t in (src, rows, dst))
        s, r, d = on[device]
        for name in ("keys", "values"):
            t = getattr(layer, name)
            if r is None:
                t[:, :, start : start + len(src)] = t.index_select(2, s)
            else:
                t[r, :, d, :] = t[r, :, s, :]  # (M, H_kv, d)
            if end is not None:
                setattr(layer, name, t[:, :, :end])


def keep_positions(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Keep the first ``prefix_len`` cached positions and, after them, only the new positions listed in ``keep``.

    After a tree verification the cache holds ``prefix_len + N`` positions; this leaves ``prefix_len + len(keep)``:
    the prefix followed by the accepted path, in order.

    Args:
        keep: ``(A,)`` long indices into the N new positions, in the order they should be kept.
    """
    move_slots(cache, keep + prefix_len, prefix_len, end=prefix_len + len(keep))


# Batched decoding (medusa.decode.batch). Layout of a batched cache: row b's cached slots 0..valid_len[b]-1 hold its
# positions 0..valid_len[b]-1 (slot == position); slots from valid_len[b] to the cache length are holes, hidden by
# the mask and overwritten as the row advances. The cache length is max(valid_len): the longest row has no hole.


def build_rows_attention_mask(config, valid_len: torch.Tensor, cache_len: int, positions: torch.Tensor,
                              new_visible: torch.Tensor, dtype):
    """:func:`build_attention_mask` for a batch of rows whose cached prefixes have different lengths.

    Args:
        config: the base model's config.
        valid_len: ``(B,)`` long: cached positions of each row (the rest of its ``cache_len`` slots are holes).
        cache_len: slots in the cache (``max(valid_len)``, or more).
        positions: ``(B, N)`` long position ids of the new tokens.
        new_visible: ``(N, N)`` or ``(B, N, N)`` bool, ``[.., i, j]`` True when new token i may attend to new token j.
        dtype: dtype of the additive mask.

    Returns:
        A ``(B, 1, N, cache_len + N)`` additive float mask, or a dict of them keyed by attention layer type.
    """
    device = positions.device
    batch, n = positions.shape
    slots = torch.arange(cache_len, device=device)  # (L,)
    prefix = (slots[None, :] < valid_len[:, None])[:, None, :].expand(batch, n, cache_len)  # (B, N, L)
    visible = torch.cat([prefix, new_visible.expand(batch, n, n)], dim=-1)  # (B, N, L+N)
    key_pos = torch.cat([slots[None, :].expand(batch, cache_len), positions], dim=1)  # (B, L+N)
    masks = additive_masks(visible, positions, key_pos, attention_layout(config), dtype)  # (B, N, L+N) each
    return model_masks(config, {kind: m[:, None] for kind, m in masks.items()})  # (B, 1, N, L+N)


def forward_rows(model, input_ids: torch.Tensor, positions: torch.Tensor, valid_len: torch.Tensor,
                 new_visible: torch.Tensor, cache, decoder: torch.nn.Module | None = None,
                 layers: tuple[int, ...] = ()):
    """One forward of the stock model over ``N`` new tokens per row, rows with cached prefixes of different lengths.

    Args:
        input_ids: ``(B, N)`` long token ids.
        positions: ``(B, N)`` long position ids.
        valid_len: ``(B,)`` long cached positions per row (see the batched layout above).
        new_visible: ``(N, N)`` or ``(B, N, N)`` bool mask among the new tokens.
        cache: the batched cache (``B`` rows, or empty); the new keys/values are appended to every row.
        decoder: runs in place of the model's decoder stack (as in :func:`forward`).
        layers: decoder layers whose outputs are returned too (as in :func:`forward`).

    Returns:
        ``(B, N, H)`` last hidden states (logits: :func:`lm_logits`); with ``layers``, ``(hidden, features
        (B, N, len(layers) * H))``.
    """
    stack = decoder_of(model)
    dtype = model.get_output_embeddings().weight.dtype
    mask = build_rows_attention_mask(model.config, valid_len, cache_length(cache), positions, new_visible, dtype)
    kwargs = {_cache_kwarg(type(stack)): cache}
    if layers:
        kwargs["output_hidden_states"] = True
    run = stack if decoder is None else decoder
    out = run(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True, **kwargs)
    if layers:
        return out.last_hidden_state, layer_features(out, layers)  # (B, N, H), (B, N, k*H)
    return out.last_hidden_state  # (B, N, H)


def keep_row_paths(cache, prefix_len: int, valid_len: torch.Tensor, keep: list[torch.Tensor]) -> torch.Tensor:
    """After a batched tree forward, keep each row's accepted nodes right after its own cached prefix.

    The cache holds ``prefix_len + N`` slots (``prefix_len`` = the cache length before the forward). Row b's nodes
    ``keep[b]`` (indices into the N new slots, in order) move to slots ``valid_len[b] ..``; the cache is cut to the
    new longest row. Only the kept slots are copied: no row's prefix moves.

    Args:
        prefix_len: slots in the cache before the tree forward.
        valid_len: ``(B,)`` long cached positions per row before the forward.
        keep: per row, ``(A_b,)`` long node indices.

    Returns:
        ``(B,)`` the new ``valid_len`` (``valid_len + A_b``).
    """
    rows, src, dst, new_len = row_path_slots(prefix_len, valid_len, keep)
    move_slots(cache, src, 0, rows, dst, end=int(new_len.max()))
    return new_len


def row_path_slots(prefix_len: int, valid_len: torch.Tensor, keep: list[torch.Tensor]):
    """Where each row's kept nodes go in a batched cache (the one index computation of :func:`keep_row_paths`, for
    a ``DynamicCache`` and a :class:`medusa.engines.static_cache.SlotCache` alike).

    Returns:
        ``(rows (M,), src (M,), dst (M,), new_len (B,))``: the batch row, source slot and destination slot of each
        kept node, and each row's new cached length.
    """
    device = valid_len.device
    counts = torch.tensor([len(k) for k in keep], dtype=torch.long, device=device)  # (B,)
    new_len = valid_len + counts
    rows = torch.repeat_interleave(torch.arange(len(keep), device=device), counts)  # (M,)
    offsets = torch.arange(len(rows), device=device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    dst = valid_len[rows] + offsets  # (M,)
    src = torch.cat([k.to(device) for k in keep]) + prefix_len  # (M,)
    return rows, src, dst, new_len


def stack_rows(caches: list) -> DynamicCache:
    """One batched cache from single-sequence caches of different lengths (the batched layout above: each row's
    positions from slot 0, zero-filled holes after the shorter rows). Reuses the first cache's layer objects."""
    stacked = caches[0]
    length = max(cache_length(c) for c in caches)
    for i, layer in enumerate(stacked.layers):
        rows = [c.layers[i] for c in caches]
        if not all(getattr(r, "is_initialized", True) and r.keys is not None and r.keys.numel() > 0 for r in rows):
            continue
        pad = [(0, 0, 0, length - r.keys.shape[-2]) for r in rows]
        layer.keys = torch.cat([torch.nn.functional.pad(r.keys, p) for r, p in zip(rows, pad, strict=True)])
        layer.values = torch.cat([torch.nn.functional.pad(r.values, p) for r, p in zip(rows, pad, strict=True)])
    return stacked


def select_rows(cache, rows: torch.Tensor, length: int) -> None:
    """Keep only the batch rows ``rows`` ``(B',)`` (in that order) and the first ``length`` slots of the cache.

    Used to drop finished sequences from a batch (one copy of the remaining rows), so they stop costing work.
    """
    for layer in _filled_layers(cache):
        r = rows.to(layer.keys.device)
        layer.keys = layer.keys[r, :, :length, :].contiguous()
        layer.values = layer.values[r, :, :length, :].contiguous()
