"""The engine ``native``: the fp32 model's whole forward in one C call (:class:`medusa.engines.native.NativeDecoder`
on fp32 weights), the lm_head and the drafters' products through the same C product.

Why: on a CPU, decoding one token reads every weight once, so its floor is the weights' bytes over the memory
bandwidth. torch's fp32 products with one to a few rows reach a fraction of it (on the developers' 2-core EPYC,
SmolLM2-135M's 49152 x 576 lm_head took 12.7 ms a row in ``F.linear`` and 4.3 ms in oneDNN's packed product, 2.15
ms in this C product), and the step's norms, rotary, attention and Python cost as much again
(docs/engines.md, "The native engine"). The C product reads one row's weights in one stream; for several rows it
reads four weight rows a pass (each weight loaded once for four output channels) and asks for the weights 16 KB
ahead into L2, so 1 to 8 rows cost about what one row does (a tree step of 4-5 nodes about 1.3x a plain step).

Numbers: the fp32 weights, fp32 activations. A value differs from torch's by summation order (and the exponential's
polynomial in the SiLU and the softmax, about 2e-7 relative): the same model at fp32 rounding, as the ``onednn``
engine's products are. Row invariance: every value of a row is computed by the same instructions whatever rows
are beside it (the C file's header), the lm_head's included, so greedy Medusa through this engine equals plain
greedy decoding through it, a tree or a batch alike, with no near-tie settling needed.

Runs Llama-family bases (:func:`medusa.engines.lean.lean_unsupported`); the C library is compiled on first use
(:func:`medusa.engines.native.native_unavailable` says why it cannot be).
"""

from __future__ import annotations

import warnings

import torch

from medusa.engines import kv_cache
from medusa.engines.base import register_engine
from medusa.engines.static import StaticEngine


def native_fp32_unavailable(model) -> str | None:
    """Why the ``native`` engine cannot run ``model`` here, or ``None`` when it can: a CPU, fp32 weights, a
    Llama-family decoder the C forward supports, and the C library built."""
    from medusa.engines.lean import lean_unsupported
    from medusa.engines.native import native_unavailable

    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu":
        return f"the model is on {weight.device.type}, and the native decoder is a CPU path"
    if weight.dtype != torch.float32:
        return f"the model's weights are {weight.dtype}, and the native engine runs fp32 weights"
    return lean_unsupported(model, {}) or native_unavailable()


def _foreign(hooks) -> bool:
    """Hooks other than transformers' own, which record outputs (``output_hidden_states``) and stay installed."""
    return any(not getattr(hook, "__module__", "").startswith("transformers.") for hook in hooks.values())


def _plain(module) -> bool:
    """No forward hooks (but transformers' output recorders) and no replaced ``forward`` on ``module``: what the C
    forward computes is what the module computes."""
    hooks, pre = module._forward_hooks, module._forward_pre_hooks  # empty almost always: no generator made then
    return not ((hooks and _foreign(hooks)) or (pre and _foreign(pre)) or "forward" in module.__dict__)


_PROJECTIONS = tuple(f"{n}_proj" for n in ("q", "k", "v", "o", "gate", "up", "down"))
"""The decoder layers' linear layers the C forward reads, by name."""


def _replaced_computation(model) -> str | None:
    """Why the model's decoder computes something the C forward would not (hooks, a replaced ``forward``, a linear
    layer that is not a plain ``nn.Linear`` such as an unmerged peft LoRA wrapper, weights not fp32 on the CPU), or
    ``None``."""
    from medusa.engines.onednn import _plain_linear

    decoder = kv_cache.decoder_of(model)
    for name, module in [*decoder.named_modules(), ("lm_head", model.get_output_embeddings())]:
        if not _plain(module):
            return f"{name or 'the decoder'} has forward hooks or a replaced forward"
        # a linear layer's subclass, or a wrapper in its place (an unmerged peft LoRA layer is not an nn.Linear)
        if (isinstance(module, torch.nn.Linear) or name.endswith(_PROJECTIONS)) and not _plain_linear(module):
            kind = f"{type(module).__module__}.{type(module).__qualname__}"  # peft's wrapper is also "Linear"
            return f"{name} is a {kind}, not a plain nn.Linear (merge an adapter first)"
    for name, param in model.named_parameters():
        if param.dtype != torch.float32 or param.device.type != "cpu":
            return f"{name} is {param.dtype} on {param.device.type} (the native engine runs fp32 weights on a CPU)"
    return None


@register_engine("native")
class NativeEngine(StaticEngine):
    """:class:`StaticEngine` whose forwards, one row or a batch, run the fp32 decoder in one C call
    (:class:`medusa.engines.native.NativeDecoder` with ``dense=True``), and whose lm_head and drafter products run
    the same C product (:class:`medusa.engines.native.NativeDense`); the base's own modules are left as they are.

    The fused query-key-value and gate-up weights are copies (the other weights are read in place): about as much
    memory again as those layers. A change to the base (a parameter written, replaced, moved or cast, a module
    replaced; a ``.data`` edit with ``refresh(force=True)``) is read again before the next forward; a forward hook
    or a wrapper added later runs the forward as ``static``, with a warning naming it.

    Raises:
        ValueError: the model cannot run here (:func:`native_fp32_unavailable` says why and this names what works).
    """

    summary = ("static + the whole fp32 forward in one C call, lm_head included (CPU, Llama family; compiled on "
               "first use with the system's C compiler)")
    products_visible = False  # one opaque C call a forward
    smooth_step_cost = True  # one code path for every step size
    head_row_invariant = True  # the C lm_head scores each row alike, whatever rows are beside it

    @classmethod
    def candidate_for(cls, device, dtype: torch.dtype) -> bool:
        """``auto`` considers it on a CPU for fp32 weights where the C library builds (a base it cannot run is
        recorded as such in the profile, with the reason)."""
        if torch.device(device).type != "cpu" or dtype != torch.float32:
            return False
        from medusa.engines.native import native_unavailable

        return native_unavailable() is None

    def __init__(self, model, max_cache_len: int | None = None, scores_all_nodes: bool | None = None):
        reason = native_fp32_unavailable(model) or _replaced_computation(model)
        if reason is not None:
            raise ValueError(f"the native engine cannot run this model here: {reason}; use --engine onednn or static")
        super().__init__(model, max_cache_len, scores_all_nodes)
        self.lean = None
        self.head = None
        self._watched: list[tuple] = []
        self._children: list[tuple] = []
        self._warned: set[str] = set()
        self._last_native = True  # whether the last forward ran the C decoder (its logits need no settling)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Build the C decoder's weights again where the base changed (``force``: always; a change made through
        ``weight.data`` keeps the version counter, and is only seen with ``force``). A change is any parameter
        replaced, written in place, moved or cast (its storage), or a module replaced.

        Raises:
            ValueError: the model as it is now cannot run through the C forward (the reason named).
        """
        if not force and self._current():
            return
        reason = native_fp32_unavailable(self.model) or _replaced_computation(self.model)
        if reason is not None:
            raise ValueError(f"the native engine cannot run this model now: {reason}")
        self._build()

    def _build(self) -> None:
        from medusa.engines.native import NativeDecoder, NativeDense

        decoder = kv_cache.decoder_of(self.model)
        modules = dict(decoder.named_modules())

        def fused(names: list[str]) -> torch.Tensor:
            parts = [modules[name].weight.detach() for name in names]
            return parts[0] if len(parts) == 1 else torch.cat(parts, 0)  # (N, K): outputs stacked

        with torch.no_grad():
            self.lean = NativeDecoder(decoder, fused, dense=True)
            self.head = NativeDense(self.model.get_output_embeddings().weight)
        self._head_module = self.model.get_output_embeddings()
        # What a forward checks is unchanged (a few dict lookups and two calls per parameter):
        watched = [*decoder.modules(), self._head_module]
        self._modules = watched
        self._watched = [(module, name, p, kv_cache.weight_version(p), p.data_ptr())
                         for module in watched for name, p in module._parameters.items() if p is not None]
        self._children = [(parent, name, child) for parent in watched for name, child in parent._modules.items()]

    def _current(self) -> bool:
        """Whether the C decoder's weights are the model's as they are now: the same parameters, storage and
        version, the same modules, and no hooks or replaced ``forward`` added since. Runs before every forward, so
        written as plain loops (0.18-0.22 ms for SmolLM2-135M's 273 parameters and 396 modules, docs/engines.md)."""
        for module, name, p, version, ptr in self._watched:
            q = module._parameters.get(name)
            # kv_cache.weight_version inline: an inference tensor keeps no version (None), so a parameter whose data
            # became one since never counts as current
            if q is not p or q.data_ptr() != ptr or (None if q.is_inference() else q._version) != version:
                return False
        for parent, name, child in self._children:
            if parent._modules.get(name) is not child:
                return False
        for module in self._modules:
            if not _plain(module):
                return False
        return self.model.get_output_embeddings() is self._head_module

    def _ready(self) -> bool:
        """Whether this forward runs the C decoder (rebuilt first where the model changed); else it runs as
        ``static`` (the model's own modules, hooks included), said once per reason in a ``RuntimeWarning``."""
        self._last_native = True
        if self._current():
            return True
        reason = native_fp32_unavailable(self.model) or _replaced_computation(self.model)
        if reason is None:
            self._build()
            return True
        self._last_native = False
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"engine 'native' runs as 'static': {reason}", RuntimeWarning, stacklevel=4)
        return False

    def _prefix_decoder(self):
        """The C decoder while the next forward runs it (rebuilt first where the model changed, as a forward would);
        ``None`` while forwards run as ``static``."""
        return self.lean if self._ready() else None

    def _scores_all_nodes(self) -> bool:
        """Its lm_head over a few rows costs about one row's read: score every node."""
        return True

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for, layers=()):
        if not self._ready():
            from medusa.engines.native import WRITER

            cache.__dict__[WRITER] = 0  # positions the C decoder did not write: no prefix snapshot of this cache
            return super()._forward(input_ids, positions, tree_mask, cache, logits_for, layers)
        hidden, features = self.lean.forward(input_ids, positions, tree_mask, cache, self.mask, layers)
        logits = self._head_logits(hidden if logits_for is None else hidden[logits_for])
        return (logits, hidden, features) if layers else (logits, hidden)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._ready():
            return super().lm_logits(hidden)
        return self._head_logits(hidden)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The C lm_head over ``(..., H)`` rows -> ``(..., V)`` (the caller checked :meth:`_ready`)."""
        rows = self.head.product(hidden.reshape(-1, hidden.shape[-1]))  # (M, V), M may be 0
        bias = getattr(self._head_module, "bias", None)
        if bias is not None:
            rows = rows + bias.detach()
        return kv_cache.soft_cap(self.model, rows.reshape(*hidden.shape[:-1], rows.shape[-1]))

    def _lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of a forward of this engine (decoding scores them right after it): through the head that forward
        ran, the C lm_head or the model's own (no second check of the model's state)."""
        return self._head_logits(hidden) if self._last_native else super().lm_logits(hidden)

    def _settles(self, logits: torch.Tensor) -> bool:
        """Nothing to settle while the C lm_head scores the rows (each row's bits are its own); the stock path's
        products are settled as the static engine's."""
        return not self._last_native and super()._settles(logits)

    def batch_lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._last_native:  # rows of the last batched forward, as in _lm_logits_rows
            return self._head_logits(hidden)
        logits = super().lm_logits(hidden)
        return self.settle(hidden, logits) if super()._settles(logits) else logits

    @property
    def drafter_dtype(self) -> str | None:
        """The drafter's products (:meth:`drafter_product`): ``None``, the C fp32 product on the weights themselves;
        ``"q8_0"``, the C Q8_0 product on the weights rounded to Q8_0 blocks, a Hydra head's level fused into one
        call (:meth:`medusa.engines.native.NativeHead.hydra_level`), fp32 activations; ``"q8_0:int8"``, the same
        with the activations rounded to int8 blocks on VNNI. Set by :meth:`medusa.model.MedusaModel.use_per_step_tree`
        to the one of :attr:`drafter_dtypes` this machine's profile measured cheapest (the heads take a new value
        at :meth:`medusa.model.MedusaModel._pack_drafter`, which that call runs).

        Raises:
            ValueError: set to a value that is not one of :attr:`drafter_dtypes`.
        """
        return self.__dict__.get("_drafter_dtype")

    @drafter_dtype.setter
    def drafter_dtype(self, value: str | None) -> None:
        if value not in self.drafter_dtypes:
            raise ValueError(f"the native engine drafts with one of {self.drafter_dtypes}, got {value!r}")
        self.__dict__["_drafter_dtype"] = value

    @property
    def drafter_dtypes(self) -> tuple:
        """``(None, "q8_0")``, and ``"q8_0:int8"`` where the library's int8-activation products run on VNNI: each
        Q8_0 product reads a quarter of the fp32 bytes (drafting one level of SmolLM2-135M's Hydra heads reads 13-17
        MB in fp32), and the profile measures which drafts cheapest here. Lossy in the drafts only: the verify, in
        fp32, decides what is emitted, so the tokens are the same whichever is chosen."""
        from medusa.engines.native import isa

        return (None, "q8_0", "q8_0:int8") if isa().endswith("+vnni") else (None, "q8_0")

    @property
    def drafter_products_key(self) -> str:
        """``f32:native`` with the fp32 products, else the Q8_0 products' key as the native int4 decoder names
        them (``q8_0:level``, ``q8_0:int8:level``: the same products, so the same drafting cost): part of the
        profile's drafter key."""
        return "f32:native" if self.drafter_dtype is None else f"{self.drafter_dtype}:level"

    def drafter_product(self, weight: torch.Tensor, role: str):
        """Every drafter product in C: with :attr:`drafter_dtype` ``None`` the fp32 product on the weight itself
        (read in place: a change to it is seen), whose few-row products read the weight at the memory's speed; else
        the Q8_0 product on the weight rounded to Q8_0 blocks (:func:`medusa.engines.native.q8_0_product`, a
        snapshot the heads make again when the weight is replaced or its version changes: a change through
        ``weight.data`` is not seen, as for the engine's own copies), whose Hydra levels fuse into one call, and the
        fp32 product for a shape the Q8_0 product cannot take. ``None`` (``matmul``) for a weight that is not fp32
        on the CPU."""
        from medusa.engines.native import NativeDense, q8_0_product

        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            return None
        if self.drafter_dtype is not None:
            product = q8_0_product(weight, int8_activations=self.drafter_dtype == "q8_0:int8")
            if product is not None:
                return product
        return NativeDense(weight).product

    def _forward_rows(self, input_ids, positions, valid_len, new_visible, cache, layers):
        if not self._ready():
            return super()._forward_rows(input_ids, positions, valid_len, new_visible, cache, layers)
        return self.lean.forward_rows(input_ids, positions, valid_len, new_visible, cache, layers)

    def settings(self) -> dict:
        from medusa.engines.native import isa

        return super().settings() | {"forward": "native fp32", "native_isa": isa(),
                                     "drafter_dtype": self.drafter_dtype,
                                     "native_bytes": self.lean.nbytes() if self.lean is not None else 0}
