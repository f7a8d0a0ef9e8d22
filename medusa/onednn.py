"""oneDNN prepacked weights for the base's linear layers and lm_head (CPU): a verify step cheaper per token.

Why: on a CPU, PyTorch's ``nn.Linear`` calls the BLAS it was built with (MKL). On the AMD EPYC machines this project
measures on, MKL's product of a few rows (the 8-16 tokens of a verify step) with a layer's weight is 1.6-2x slower
than oneDNN's product with the same weight reordered once into oneDNN's blocked layout, and the one-row product is
faster too. A verify forward over 11 tokens of SmolLM2-135M went from 98 to 76 ms, a plain one from 56 to 50 ms, and
the lm_head over 11 rows from 34 ms (or 5.5 ms a row, one row at a time) to 9 ms (measured in README, "Decode
engines"). This is the same reordering CPU inductor's weight freezing does for bf16; for fp32 inductor keeps MKL.

How: :class:`PackedLinears` keeps one reordered copy of every ``nn.Linear`` weight under the decoder stack and of the
lm_head (the base's own modules are never changed). :meth:`PackedLinears.swapped` makes those modules run
``torch.ops.mkldnn._linear_pointwise`` on the copies for the length of a ``with`` block and restores their own
``forward`` afterwards, so the same model still runs unchanged outside it (Hugging Face ``generate``, training).
A copy is made again when its weight was replaced or changed in place (a merged adapter). The results equal
``nn.Linear``'s up to float summation order (about 1e-6 apart).

Cost: the copies take as much memory as the weights they copy (about 540 MB for SmolLM2-135M in fp32).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from medusa import kv_cache

PACK_ROWS = 16
"""The number of rows oneDNN is told to expect when reordering (any number of rows works; 11-16 measured best)."""


def onednn_unavailable(model) -> str | None:
    """Why ``model`` cannot use oneDNN prepacked weights here, or ``None`` when it can.

    Needs a CPU model, a PyTorch built with oneDNN (mkldnn) and the private ops ``mkldnn._reorder_linear_weight`` and
    ``mkldnn._linear_pointwise``; bf16 and fp16 weights also need CPU instructions (AVX-512 or AVX-NE-CONVERT) that
    a tiny trial reorder checks.
    """
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu":
        return f"the model is on {weight.device.type}, and oneDNN prepacked weights are a CPU path"
    if not torch.backends.mkldnn.is_available():
        return f"torch {torch.__version__} was built without oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return f"torch {torch.__version__} lacks torch.ops.mkldnn._reorder_linear_weight / _linear_pointwise"
    try:
        trial = ops._reorder_linear_weight(torch.zeros(8, 8, dtype=weight.dtype), PACK_ROWS)
        ops._linear_pointwise(torch.zeros(1, 8, dtype=weight.dtype), trial, None, "none", [], "")
    except RuntimeError as e:
        return f"oneDNN cannot run {weight.dtype} linear layers on this CPU: {str(e).splitlines()[0]}"
    return None


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is ``nn.Linear``'s own (not a router or quantized subclass)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class _Packed:
    """One linear module's reordered weight, remade when the module's weight changes."""

    def __init__(self, module: nn.Linear, local: threading.local | None = None):
        self.module = module
        self.local = local  # the PackedLinears' per-thread count of open swapped() blocks (no cycle to it)
        self.key = None
        self.packed = None
        self.own = None  # the module's own instance-level forward, if any, while swapped (the fallback runs it)

    def refresh(self, force: bool = False) -> None:
        weight = self.module.weight
        # data_ptr/dtype/device: `.data = ...` and `.to(dtype)` keep the Parameter and its _version.
        key = (id(weight), kv_cache.weight_version(weight), weight.data_ptr(), weight.dtype, weight.device)
        if force or key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        # Another thread's plain use of the base, or a forward that needs gradients: the module's own product.
        if (self.local is not None and not getattr(self.local, "depth", 0)) or (
                torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)):
            return self.own(x) if self.own is not None else nn.Linear.forward(module, x)
        bias = module.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None if bias is None else bias.detach(), "none",
                                                  [], "")


class PackedLinears:
    """oneDNN reordered copies of every ``nn.Linear`` weight in ``decoder`` and of ``lm_head`` (see module docstring).

    Args:
        decoder: the base's decoder stack (``model.model``).
        lm_head: the base's output embedding (an ``nn.Linear``, possibly tied to the input embedding).

    Raises:
        TypeError: ``lm_head`` is not an ``nn.Linear``.
    """

    def __init__(self, decoder: nn.Module, lm_head: nn.Module):
        if not isinstance(lm_head, nn.Linear):
            raise TypeError(f"oneDNN packing needs an nn.Linear lm_head, got {type(lm_head).__name__}")
        self._lock = threading.Lock()
        self._depth = 0  # swapped() blocks open, all threads
        self._local = threading.local()  # .depth: this thread's open blocks
        self.layers = [_Packed(m, self._local) for m in decoder.modules() if _plain_linear(m)]
        self.lm_head = _Packed(lm_head)
        self.dtype = lm_head.weight.dtype
        self._saved: list = []
        self.refresh()

    def refresh(self, force: bool = False) -> None:
        """Reorder again every weight replaced or changed in place since the last call (cheap when none was).
        A change through ``weight.data`` is invisible (no version bump): ``force`` repacks everything."""
        for packed in self.layers:
            packed.refresh(force)
        self.lm_head.refresh(force)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Inside the block, the decoder's linear modules run on their reordered copies; outside, as before.

        Not for training: the reordered product has no backward.
        """
        with self._lock:
            if self._depth == 0:
                self.refresh()
                # A module's own instance-level forward (a hook library's wrapper) is put back afterwards.
                self._saved = [packed.module.__dict__.get("forward") for packed in self.layers]
                for packed, own in zip(self.layers, self._saved, strict=True):
                    packed.own = own
                    packed.module.forward = packed  # an instance attribute, shadowing nn.Linear.forward
            self._depth += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for packed, own in zip(self.layers, self._saved, strict=True):
                        if own is None:
                            del packed.module.forward
                        else:
                            packed.module.forward = own

    def lm_head_product(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)``: ``(..., H)`` -> ``(..., V)`` raw logits (bias included, no soft-capping)."""
        self.lm_head.refresh()
        return self.lm_head(hidden)


_BY_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> weakref to its PackedLinears


def packed_linears(model, decoder: nn.Module) -> PackedLinears:
    """The :class:`PackedLinears` of ``model`` (decoder stack ``decoder``), shared by the engines of that model that
    are alive (dropped with the last of them). A new engine repacks every weight (changes through ``.data``, as peft's
    merge makes, are invisible otherwise) and gets a new PackedLinears when the lm_head module was replaced."""
    ref = _BY_MODEL.get(model)
    packed = ref() if ref is not None else None
    if packed is None or packed.lm_head.module is not model.get_output_embeddings():
        packed = PackedLinears(decoder, model.get_output_embeddings())
        _BY_MODEL[model] = weakref.ref(packed)
    else:
        packed.refresh(force=True)
    return packed
