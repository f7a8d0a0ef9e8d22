"""oneDNN prepacked weights for the base's linear layers and lm_head (CPU): a verify step cheaper per token.

Why: on a CPU, PyTorch's ``nn.Linear`` calls the BLAS it was built with (MKL). On the AMD EPYC machines this project
measures on, MKL's product of a few rows (the 8-16 tokens of a verify step) with a layer's weight is slower than
oneDNN's product with the same weight reordered once into oneDNN's blocked layout, and the one-row product is
faster too; the lm_head becomes cheap enough to score every tree node at once (measured in docs/engines.md). This is
the same reordering CPU inductor's weight freezing does for bf16; for fp32 inductor keeps MKL.

How: :class:`PackedLinears` builds a shadow of the decoder stack: new module objects that share the base's
parameters and buffers (the same tensors), with every plain ``nn.Linear`` replaced by a :class:`PackedLinear`
holding the original module and a reordered copy of its weight, and its attention modules reading grouped key heads
in place under a mask (:mod:`medusa.engines.attention`). The onednn engine runs that shadow
(``static_cache.forward(..., decoder=shadow)``); nothing in the base model is changed, so the base runs as before
everywhere else, in any thread (Hugging Face ``generate``, training). A copy is made again when its weight was
replaced or changed in place through an operation that counts (its version counter or storage changes); a change
through ``weight.data`` (peft's default merge) is seen by a new engine, or after :meth:`OneDNNEngine.refresh`
``(force=True)``. The shadow is rebuilt when a module of the base was replaced or its train/eval mode changed. A base
linear module with forward hooks or a wrapper forward of its own runs as itself, so the hooks still fire. The results
equal ``nn.Linear``'s up to float summation order (about 1e-6 apart).

Cost: the copies take as much memory as the weights they copy; each engine owns its own.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from medusa.engines import kv_cache, static_cache
from medusa.engines.attention import use_grouped_query_attention
from medusa.engines.base import register_engine
from medusa.engines.static import StaticEngine

PACK_ROWS = 16
"""The number of rows oneDNN is told to expect when reordering (any number of rows works; measured best near a
verify step's size)."""


def onednn_unavailable(model) -> str | None:
    """Why ``model`` cannot use oneDNN prepacked weights here, or ``None`` when it can.

    Needs a CPU model, a PyTorch built with oneDNN (mkldnn) and the private ops ``mkldnn._reorder_linear_weight`` and
    ``mkldnn._linear_pointwise``; bf16 and fp16 weights also need CPU instructions (AVX-512 or AVX-NE-CONVERT) that
    a tiny trial reorder checks.
    """
    weight = model.get_output_embeddings().weight
    return onednn_unavailable_for(weight.device, weight.dtype)


def onednn_unavailable_for(device, dtype: torch.dtype) -> str | None:
    """:func:`onednn_unavailable` for weights of ``dtype`` on ``device`` (no model needed)."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"the model is on {device.type}, and oneDNN prepacked weights are a CPU path"
    if not torch.backends.mkldnn.is_available():
        return f"torch {torch.__version__} was built without oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return f"torch {torch.__version__} lacks torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise"
    try:
        trial = ops._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_ROWS)
        ops._linear_pointwise(torch.zeros(1, 8, dtype=dtype), trial, None, "none", [], "")
    except RuntimeError as e:
        return f"oneDNN cannot run {dtype} linear layers on this CPU: {str(e).splitlines()[0]}"
    return None


def packed_product(weight: torch.Tensor):
    """``rows (M, K) -> (M, N)`` with the ``(N, K)`` ``weight`` on a copy reordered once into oneDNN's blocked layout
    (no bias, no gradient; the rows in the weight's dtype), or ``None`` where oneDNN cannot run that dtype here (see
    :func:`onednn_unavailable_for`): the one place the drafters' and the checked lm_head's packed products are made.
    A snapshot of the weight: make it again after the weight changed."""
    if onednn_unavailable_for(weight.device, weight.dtype) is not None:
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)
    return lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")


def packed_drafter_product(weight: torch.Tensor, role: str, dtype: torch.dtype | None = None):
    """What the engines that pack their own products offer the drafter (:meth:`medusa.engines.Engine
    .drafter_product`): the heads' projection on a packed copy (:func:`packed_product`), the rest as it is; with
    ``dtype`` (bfloat16), every product on a packed copy in that dtype: the rows rounded to it, the outputs back in
    the weight's dtype (half the bytes a drafting level reads; lossy in the drafts only, the verify decides what is
    emitted). ``None`` where oneDNN cannot run ``dtype`` here. A snapshot, as the engine's own packed copies: the
    heads make it again when the weight's version changes, which a change through ``weight.data`` does not."""
    if dtype is None or dtype == weight.dtype:
        return packed_product(weight) if role == "projection" else None
    product = packed_product(weight.detach().to(dtype))
    if product is None:
        return None
    out_dtype, width = weight.dtype, weight.shape[0]

    def low_precision(rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 0:  # oneDNN's bf16 product refuses no rows; the fp32 one returns none
            return rows.new_zeros((0, width), dtype=out_dtype)
        return product(rows.to(dtype)).to(out_dtype)

    return low_precision


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is ``nn.Linear``'s own (not a router or quantized subclass)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class PackedLinear(nn.Module):
    """In a shadow decoder, one plain ``nn.Linear`` of the base: the same product on a oneDNN reordered copy of its
    weight. The original module stays where it was, unchanged; this holds it for its bias, to see its weight change,
    and to run it (its own forward, a hook's wrapper included, and a backward) where gradients are needed.

    Args:
        module: the base's ``nn.Linear``.
    """

    def __init__(self, module: nn.Linear):
        super().__init__()
        # Held, not registered as a child: the shadow's module tree stays its own (and the lookup stays cheap).
        object.__setattr__(self, "module", module)
        self.key = None  # what the copy was made from (see refresh)
        self.packed = None
        self.refresh()

    @property
    def weight(self) -> nn.Parameter:
        return self.module.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.module.bias

    def refresh(self, force: bool = False) -> None:
        """Reorder the weight again when it was replaced or changed in place since the copy was made (``force``:
        always; a change through ``weight.data`` keeps the version counter)."""
        weight = self.module.weight
        # data_ptr/dtype/device: `.data = ...` and `.to(dtype)` keep the Parameter and its _version.
        key = (id(weight), kv_cache.weight_version(weight), weight.data_ptr(), weight.dtype, weight.device)
        if force or key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad):
            return module(x)  # the reordered product has no backward
        if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
            return module(x)  # hooks or a wrapper on the base's module (added at any time) run as they would there
        bias = module.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None if bias is None else bias.detach(), "none",
                                                  [], "")


class PackedLinears:
    """A shadow of ``decoder`` on oneDNN reordered copies of its plain linear weights, and of ``lm_head`` (see the
    module docstring).

    Args:
        decoder: the base's decoder stack (``model.model``).
        lm_head: the base's output embedding (an ``nn.Linear``, possibly tied to the input embedding).

    Raises:
        TypeError: ``lm_head`` is not an ``nn.Linear``.
    """

    def __init__(self, decoder: nn.Module, lm_head: nn.Module):
        if not isinstance(lm_head, nn.Linear):
            raise TypeError(f"oneDNN packing needs an nn.Linear lm_head, got {type(lm_head).__name__}")
        self.base_decoder = decoder
        self.lm_head = PackedLinear(lm_head)
        self.dtype = lm_head.weight.dtype
        self.layers: dict[nn.Linear, PackedLinear] = {}  # base linear module -> its packed stand-in
        self.decoder: nn.Module = decoder
        self._links: list[tuple] = []  # (base parent, child name, base child, shadow child or None for a packed one)
        self._build()

    def _build(self) -> None:
        """Make the shadow of the base decoder as it is now, keeping the packed copies of linears still in it."""
        previous, self.layers, self._links = self.layers, {}, []
        self.decoder = self._shadow(self.base_decoder, {}, previous)
        use_grouped_query_attention(self.decoder)  # its own attention modules: the base's keep theirs

    def _shadow(self, module: nn.Module, made: dict[int, nn.Module], previous: dict) -> nn.Module:
        if id(module) in made:  # a module used twice stays one module
            return made[id(module)]
        if _plain_linear(module):
            packed = previous.get(module)
            packed = packed if packed is not None else PackedLinear(module)
            self.layers[module] = made[id(module)] = packed
            return packed
        shadow = copy.copy(module)  # a new object; its _parameters/_buffers dicts are the base's own
        shadow.__dict__["_modules"] = {}
        made[id(module)] = shadow
        for name, child in module._modules.items():
            child_shadow = None if child is None else self._shadow(child, made, previous)
            shadow._modules[name] = child_shadow
            self._links.append((module, name, child, None if isinstance(child_shadow, PackedLinear) else child_shadow))
        return shadow

    def shadow_decoder(self) -> nn.Module:
        """The shadow decoder, rebuilt first when a module under the base decoder was replaced or its train/eval
        mode changed since it was made."""
        stale = self.decoder.training != self.base_decoder.training or any(
            parent._modules.get(name) is not child or (shadow is not None and shadow.training != child.training)
            for parent, name, child, shadow in self._links)
        if stale:
            self._build()
        return self.decoder

    def refresh(self, force: bool = False) -> None:
        """Reorder again every weight replaced or changed in place since the last call (cheap when none was).
        A change through ``weight.data`` is invisible (no version bump): ``force`` repacks everything."""
        for packed in self.layers.values():
            packed.refresh(force)
        self.lm_head.refresh(force)

    def lm_head_product(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)``: ``(..., H)`` -> ``(..., V)`` raw logits (bias included, no soft-capping)."""
        self.lm_head.refresh()
        return self.lm_head.forward(hidden)


@register_engine("onednn")
class OneDNNEngine(StaticEngine):
    """:class:`StaticEngine` whose forwards run a shadow of the decoder on oneDNN prepacked weights, and the
    lm_head's prepacked copy (:mod:`medusa.engines.onednn`); the base's own modules are left as they are.

    Where those cannot run (:func:`medusa.engines.onednn_unavailable`) it is exactly :class:`StaticEngine`;
    :attr:`fallback_reason` says why, and on a CPU a ``RuntimeWarning`` says it too. It also runs as static while
    the model's lm_head module, dtype or device is no longer the one it packed. Batched forwards run on the shadow
    decoder too (on the static engine's cache), and every node's logits on the packed lm_head
    (:meth:`lm_logits_rows`, as :attr:`scores_all_nodes` declares).
    """

    summary = ("static + the base's linear layers and lm_head on oneDNN prepacked copies (CPU; as much memory again "
               "as the weights; static elsewhere)")
    drafter_dtype: torch.dtype | None = None
    """The dtype of the drafter's packed products (:meth:`drafter_product`): ``None``, the weights' own (the
    projection packed, the rest ``nn.Linear``), or one of :attr:`drafter_dtypes` that
    :meth:`medusa.model.MedusaModel.use_per_step_tree` found cheaper in this machine's profile."""

    def drafter_product(self, weight: torch.Tensor, role: str):
        return packed_drafter_product(weight, role, self.drafter_dtype)

    @property
    def drafter_dtypes(self) -> tuple:
        """``(None, torch.bfloat16)`` where the base is fp32 and packed here and oneDNN runs bf16 on this CPU: the
        drafter may draft in bf16 (each product reads half the bytes), which the profile measures; else ``(None,)``."""
        if (self.packed is None or self.packed.dtype != torch.float32
                or onednn_unavailable_for(torch.device("cpu"), torch.bfloat16) is not None):
            return (None,)
        return (None, torch.bfloat16)

    @property
    def drafter_products_key(self) -> str | None:
        """``None`` with the weights' own dtype (a packed projection), else ``onednn:<dtype>``: part of the profile's
        drafter key, so each dtype's drafting cost is stored apart."""
        return None if self.drafter_dtype is None else f"onednn:{str(self.drafter_dtype).replace('torch.', '')}"

    @classmethod
    def candidate_for(cls, device, dtype: torch.dtype) -> bool:
        """``auto`` considers it where it can pack (a CPU, a dtype oneDNN runs there); elsewhere it would run as
        ``static`` and the profile would measure that twice."""
        return onednn_unavailable_for(device, dtype) is None

    def __init__(self, model, max_cache_len: int | None = None, scores_all_nodes: bool | None = None):
        self.fallback_reason = onednn_unavailable(model)
        self.packed: PackedLinears | None = None  # this engine's own copies
        if self.fallback_reason is None:
            self.packed = PackedLinears(kv_cache.decoder_of(model), model.get_output_embeddings())
        elif model.device.type == "cpu":
            warnings.warn(f"engine 'onednn' runs as 'static': {self.fallback_reason}", RuntimeWarning, stacklevel=3)
        super().__init__(model, max_cache_len, scores_all_nodes)

    def refresh(self, force: bool = False) -> None:
        """Reorder the packed copies whose weights changed (``force``: all of them, for a change made through
        ``weight.data``, which keeps the version counter: peft's default ``merge_and_unload``)."""
        if self.packed is not None:
            self.packed.refresh(force)

    def _scores_all_nodes(self) -> bool:
        """Also with the lm_head prepacked: its product over every node is then cheapest."""
        return super()._scores_all_nodes() or self.packed is not None

    def _uses_packed(self) -> bool:
        """Packed, and the model still has the dtype, device and lm_head module it was packed with."""
        head = self.model.get_output_embeddings()
        return (self.packed is not None and head is self.packed.lm_head.module
                and head.weight.dtype == self.packed.dtype and head.weight.device.type == "cpu")

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for, layers=()):
        if not self._uses_packed():
            return super()._forward(input_ids, positions, tree_mask, cache, logits_for, layers)
        self.packed.refresh()
        _, hidden, *features = static_cache.forward(self.model, input_ids, positions, tree_mask, cache, self.mask,
                                                    self.packed.shadow_decoder(), slice(0, 0), layers)
        selected = hidden if logits_for is None else hidden[logits_for]
        return self._lm_logits_rows(selected), hidden, *features  # settled by forward()

    def _lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._uses_packed():
            return super()._lm_logits_rows(hidden)
        return kv_cache.soft_cap(self.model, self.packed.lm_head_product(hidden))

    def _batch_decoder(self) -> torch.nn.Module | None:
        if not self._uses_packed():
            return None
        self.packed.refresh()
        return self.packed.shadow_decoder()

    def settings(self) -> dict:
        drafter_dtype = None if self.drafter_dtype is None else str(self.drafter_dtype).replace("torch.", "")
        return super().settings() | {"packed": self.packed is not None, "fallback_reason": self.fallback_reason,
                                     "pack_rows": PACK_ROWS, "drafter_dtype": drafter_dtype}


