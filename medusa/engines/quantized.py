"""Weight-only quantized engines: the base's linear layers on 4-bit or 8-bit weights, on a CPU.

``int4``: every linear layer of the decoder (``nn.Linear`` and GPT-2's ``Conv1D``) becomes an :class:`Int4Linear`
running torch's int4 weight-only CPU kernel (``torch.ops.aten._weight_int4pack_mm_for_cpu``) on weights packed
group-wise (:data:`GROUP_SIZE` input features share a scale and a zero point) with bfloat16 activations: the
activation is cast to bfloat16 at the module's input and the result back to the model's dtype at its output, so
the rest of the forward (norms, attention, rotary) runs in the model's own dtype. ``int8``: the same with one scale
per output channel (``torch.ops.aten._weight_int8pack_mm``). The kernel's formula for a weight is

    w = (q - 8) * scale + zero      (q in 0..15, scale and zero per group of GROUP_SIZE input features)

(checked against the kernel in fp32 by ``tests/test_quantized.py``). The codes come either from the base's own
weights (min-max rounding per group, :func:`medusa.engines.int4.quantize_int4`) or, for a base prepared from a
4-bit GGUF, from the file's own blocks (:mod:`medusa.io.gguf_pack`), so nothing is rounded a second time.

Like the onednn engine, the engine runs a shadow of the decoder (new module objects sharing the base's parameters
and buffers) in which only the linear layers are replaced; the base model is not changed and runs as before
everywhere else. The quantized copies are a snapshot of the weights when the engine was made: after changing the
base's weights, call :meth:`QuantizedEngine.refresh` (a check of every layer on every forward is Python work on the
one-token path this engine is meant to shorten). A linear layer the kernel cannot take (its output size not a
multiple of 16, its input size not a multiple of the group size) stays dense and is named in
:meth:`QuantizedEngine.settings`.

Exactness: the bfloat16 casts turn a last-bit fp32 difference into a bfloat16 step, and torch's CPU attention gives
a query row last-bit different results beside other rows; so in decoding steps the shadow attends row by row
(:func:`row_invariant_attention`), and greedy Medusa through the engine equals plain greedy through it.

The lm_head stays dense by default (``lm_head=True`` quantizes it too; docs/quantized.md has the measurement that
chose the default), and the input embedding always does: one row is read per token.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from medusa.engines import kv_cache, static_cache
from medusa.engines.base import register_engine
from medusa.engines.int4 import GROUP_SIZE, Int4Codes, dequantize_int4, linear_weight, quantize_int4, quantize_int8
from medusa.engines.lean import LeanDecoder, base_attention, lean_unsupported
from medusa.engines.static import StaticEngine

INNER_K_TILES = 2
"""The int4 packing's inner tile count (``_convert_weight_to_int4pack_for_cpu``; only its CPU layout)."""
INT4_ROW_BLOCK = 64
"""The CPU int4 packing lays output rows out in blocks of this many: packed codes concatenate along the output
axis only after whole blocks (checked by ``tests/test_quantized.py``)."""
ACTIVATION_DTYPE = torch.bfloat16
"""The kernels' fast path on a CPU (fp32 activations take a slow path, fp16 slower still: docs/quantized.md)."""
KINDS = ("int4", "int8")
KERNELS = ("torch", "native", "native-q8")
"""Who runs one sequence's forwards: torch's kernels, or the C decoder of :mod:`medusa.engines.native`."""
LM_HEADS = (False, True, "fp32", "int4", "bf16", "gguf")
"""The engine's ``lm_head``: ``False``/``"fp32"`` the base's dense one; ``True``/``"int4"`` int4 codes like the
linear layers (lossy: docs/quantized.md); ``"bf16"``: a bf16 copy whose argmax is checked to be the fp32 one's
(:mod:`medusa.engines.checked_head`); ``"gguf"``: the GGUF's own Q8_0 blocks of the lm_head (the prepared fp32
weights exactly, ``w = d q``) in a C product with fp32 activations, the native kernels only. Int4 codes behind the
same check were tried and dropped: their error bound
leaves thousands of tokens to rescore (85-110 ms a token on the reference model, docs/quantized.md)."""
ROW_INVARIANT_ATTENTION = "medusa_row_invariant"
"""The attention implementation the shadow's attention modules run (:func:`row_invariant_attention`)."""
_ROW_INVARIANT = contextvars.ContextVar("medusa_row_invariant", default=False)


def quantize_unavailable(kind: str, device) -> str | None:
    """Why the ``kind`` kernel cannot run on ``device`` with this torch, or ``None`` when it can (a tiny trial).

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown weight quantization {kind!r}: choose one of {', '.join(KINDS)}")
    device = torch.device(device)
    if device.type != "cpu":
        return (f"the {kind} engine runs torch's weight-only CPU kernels and the model is on {device}: move the "
                "model to the CPU, or use engine 'static' or 'compiled' there")
    try:
        if kind == "int4":
            codes = torch.zeros(16, GROUP_SIZE, dtype=torch.uint8)
            layer = Int4Linear(codes, torch.ones(16, 1), torch.zeros(16, 1))
        else:
            layer = Int8Linear(torch.zeros(16, GROUP_SIZE, dtype=torch.int8), torch.ones(16))
        layer(torch.zeros(1, GROUP_SIZE))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        op = "_weight_int4pack_mm_for_cpu" if kind == "int4" else "_weight_int8pack_mm"
        return (f"torch {torch.__version__} cannot run torch.ops.aten.{op} with bfloat16 activations here "
                f"({str(e).splitlines()[0]}): use engine 'onednn' or 'static'")
    return None


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` int4 codes packed for ``_weight_int4pack_mm_for_cpu``; bfloat16 inside, the
    input's dtype outside.

    Args:
        codes: ``(N, K)`` uint8 in 0..15 (``N`` a multiple of 16, ``K`` of the group size).
        scale, zero: ``(N, K // group_size)``; the weight is ``(codes - 8) * scale + zero`` (rounded to bfloat16
            in the kernel).
        bias: ``(N,)`` or ``None``; added in the input's dtype.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        n, k = codes.shape
        self.in_features, self.out_features = k, n
        self.group_size = k // scale.shape[1]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(),
                                                                          INNER_K_TILES)  # (N, K / 2) uint8
        self.scale_zeros = torch.stack([scale.t(), zero.t()], -1).to(ACTIVATION_DTYPE).contiguous()  # (G, N, 2)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(ACTIVATION_DTYPE).contiguous()  # (M, K)
        y = self.product(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., N)
        return y if self.bias is None else y + self.bias

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel alone: bfloat16 ``(M, K)`` contiguous -> bfloat16 ``(M, N)`` (no bias, no casts)."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scale_zeros)



class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` int8 codes and one scale per output channel (``_weight_int8pack_mm``).

    Args:
        codes: ``(N, K)`` int8.
        scale: ``(N,)``; the weight is ``codes * scale[:, None]`` (the scale rounded to bfloat16 in the kernel).
        bias: ``(N,)`` or ``None``.
    """

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.codes = codes.contiguous()
        self.scale = scale.to(ACTIVATION_DTYPE)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(ACTIVATION_DTYPE).contiguous()  # (M, K)
        y = self.product(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., N)
        return y if self.bias is None else y + self.bias

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel alone: bfloat16 ``(M, K)`` contiguous -> bfloat16 ``(M, N)`` (no bias, no casts)."""
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)



def row_invariant_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention whose result for a query row depends only on that row and the keys it may see, in slot order.

    Why: the kernels' bfloat16 activations turn any one-ulp fp32 difference into a bfloat16 rounding step at the
    next linear layer, and torch's CPU attention gives a row last-bit different results with other rows beside it,
    with more (masked) keys, or on another path for one query row. Plain decoding (one row) and a Medusa tree (many
    rows, other nodes masked) would then drift apart. During decoding steps (:func:`row_invariant_steps`) each row
    here runs alone on exactly the keys its mask lets it see (gathered in slot order, contiguous), so a token gets
    the same result whichever way it is decoded; elsewhere (a prompt's own forward) the base's implementation runs
    as usual. Takes and returns what transformers' attention functions do: ``query (B, H, N, D)``, ``key/value
    (B, Hkv, S, D)``, an additive or boolean mask ``(B or 1, 1, N, S)``; returns ``((B, N, H, D), None)``.
    """
    inner = base_attention(module)
    if not _ROW_INVARIANT.get() or attention_mask is None:
        return inner(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(
        attention_mask.dtype).min / 2  # (B or 1, 1, N, S)
    rows = []
    for b in range(query.shape[0]):
        visible = mask[min(b, mask.shape[0] - 1), 0]  # (N, S)
        out = []
        for i in range(query.shape[2]):
            keep = visible[i].nonzero()[:, 0]  # (S_i,) the slots row i sees, in order
            k, v = key[b:b + 1].index_select(2, keep), value[b:b + 1].index_select(2, keep)  # (1, Hkv, S_i, D)
            out.append(inner(module, query[b:b + 1, :, i:i + 1].contiguous(), k, v, None, is_causal=False,
                             **kwargs)[0])  # (1, 1, H, D)
        rows.append(torch.cat(out, 1))
    return torch.cat(rows, 0), None


@contextlib.contextmanager
def row_invariant_steps(on: bool = True):
    """Within this block (a decoding step after the prompt) the shadow's attention runs row by row
    (:func:`row_invariant_attention`)."""
    token = _ROW_INVARIANT.set(on)
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


def _uses_row_invariant_attention(shadow: nn.Module) -> None:
    """Give each attention module of a shadow decoder its own config copy naming :data:`ROW_INVARIANT_ATTENTION`
    (registered once in transformers' ``AttentionInterface``, its documented extension point); the base's modules
    and config are not touched."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ROW_INVARIANT_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ROW_INVARIANT_ATTENTION, row_invariant_attention)
    for module in shadow.modules():
        config = getattr(module, "config", None)
        if type(module).__name__.endswith("Attention") and hasattr(config, "_attn_implementation"):
            own = copy.copy(config)
            own.medusa_base_attention = config._attn_implementation
            own._attn_implementation = ROW_INVARIANT_ATTENTION
            module.config = own


def _unpackable(kind: str, weight: torch.Tensor) -> str | None:
    n, k = weight.shape
    if kind == "int4" and (n % 16 or k % GROUP_SIZE):
        return f"int4 packing needs the output size a multiple of 16 and the input size of {GROUP_SIZE}, got {n}x{k}"
    return None


def quantized_linear(kind: str, module: nn.Module, codes: Int4Codes | None = None) -> nn.Module:
    """``module`` (see :func:`linear_weight`) as an :class:`Int4Linear` or :class:`Int8Linear`, from ``codes`` when
    given (int4 only) or else from its own weight."""
    weight = linear_weight(module)
    if kind == "int8":
        return Int8Linear(*quantize_int8(weight), module.bias)
    if codes is None:
        codes = Int4Codes(*quantize_int4(weight))
    return Int4Linear(codes.codes, codes.scale, codes.zero, module.bias)


class QuantizedLinears:
    """A shadow of ``decoder`` whose linear layers are quantized copies of the base's (see the module docstring),
    and optionally a quantized ``lm_head``.

    Args:
        decoder: the base's decoder stack (``model.model``).
        lm_head: the base's output embedding.
        kind: one of :data:`KINDS`.
        quantize_lm_head: quantize the lm_head too (else it stays the base's dense module).
        codes: int4 codes by the module's qualified name under ``decoder`` (``"lm_head"`` for the lm_head), taken
            instead of quantizing that module's weight (:mod:`medusa.io.gguf_pack`).
        keep_dense: modules (same names) to leave dense, with the reason (a GGUF tensor that is not 4-bit).
    """

    def __init__(self, decoder: nn.Module, lm_head: nn.Module, kind: str, quantize_lm_head: bool = False,
                 codes: dict[str, Int4Codes] | None = None, keep_dense: dict[str, str] | None = None):
        self.kind = kind
        self.codes = dict(codes or {})
        self.keep_dense = dict(keep_dense or {})
        self.dense: dict[str, str] = {}
        """Linear layers left dense, by qualified name, with the reason."""
        self.source: dict[str, str] = {}
        """Where each quantized layer's codes came from (``"weights"`` or ``"codes"``), by qualified name."""
        self.base_decoder, self.base_lm_head, self.quantize_lm_head = decoder, lm_head, quantize_lm_head
        self.refresh()

    def refresh(self) -> None:
        """Quantize again from the base as it is now; codes given at construction are used again where they still
        give the module's weight exactly, and are dropped (the weight quantized instead) where it changed."""
        if hasattr(self, "decoder"):  # a refresh, not the first build: keep only the codes still matching
            modules = dict(self.base_decoder.named_modules()) | {"lm_head": self.base_lm_head}
            self.codes = {name: c for name, c in self.codes.items() if name in modules and torch.equal(
                dequantize_int4(c.codes, c.scale, c.zero), linear_weight(modules[name]).detach().float())}
        self.dense, self.source = {}, {}
        self.decoder = self._shadow(self.base_decoder, "", {})
        _uses_row_invariant_attention(self.decoder)
        self.lm_head = None
        if self.quantize_lm_head:
            head = self._quantized("lm_head", self.base_lm_head)
            self.lm_head = None if head is self.base_lm_head else head

    def _quantized(self, name: str, module: nn.Module) -> nn.Module:
        weight = linear_weight(module)
        if weight is None:
            self.dense[name] = f"{type(module).__name__} is not a plain linear layer"
            return module
        reason = self.keep_dense.get(name) or _unpackable(self.kind, weight)
        if reason is not None:
            self.dense[name] = reason
            return module
        codes = self.codes.get(name) if self.kind == "int4" else None
        self.source[name] = "weights" if codes is None else "codes"
        return quantized_linear(self.kind, module, codes)

    def _shadow(self, module: nn.Module, name: str, made: dict[int, nn.Module]) -> nn.Module:
        if id(module) in made:  # a module used twice stays one module
            return made[id(module)]
        if linear_weight(module) is not None:
            made[id(module)] = self._quantized(name, module)
            return made[id(module)]
        shadow = copy.copy(module)  # a new object; its _parameters/_buffers dicts are the base's own
        shadow.__dict__["_modules"] = {}
        made[id(module)] = shadow
        for child_name, child in module._modules.items():
            shadow._modules[child_name] = None if child is None else self._shadow(
                child, f"{name}.{child_name}" if name else child_name, made)
        return shadow

    def fuse(self, names: list[str]) -> nn.Module:
        """The quantized layers ``names`` (qualified under the decoder) as one layer, their outputs side by side,
        packed from the same codes (the kernels compute each output column alone, so its columns are the parts'
        bits); a single name gives that layer itself. The parts then read their rows of the fused codes as views
        where the packing allows it (int8 always; int4 packs rows in blocks of :data:`INT4_ROW_BLOCK`, so when every
        part but the last fills whole blocks), and the codes are held once.

        Raises:
            ValueError: one of them stayed dense.
        """
        modules = dict(self.decoder.named_modules())
        parts = [modules[name] for name in names]
        if not all(isinstance(p, (Int4Linear, Int8Linear)) for p in parts):
            raise ValueError(f"cannot fuse {names}: not all of them are quantized ({self.dense})")
        if len(parts) == 1:
            return parts[0]
        if self.kind == "int8":
            fused = Int8Linear(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))
            field = "codes"
        else:
            codes = self.fused_codes(names)
            fused = Int4Linear(codes.codes, codes.scale, codes.zero)
            field = "packed" if all(p.out_features % INT4_ROW_BLOCK == 0 for p in parts[:-1]) else None
        if field is not None:
            start = 0
            for p in parts:
                setattr(p, field, getattr(fused, field)[start:start + p.out_features])  # a contiguous view
                start += p.out_features
        return fused

    def fused_codes(self, names: list[str]) -> Int4Codes:
        """The int4 codes of the layers ``names`` (qualified under the decoder), their outputs side by side: the
        codes given at construction where there are some (a GGUF's), else quantized from the base's weights."""
        base = dict(self.base_decoder.named_modules())
        codes = [self.codes[name] if self.source.get(name) == "codes" else
                 Int4Codes(*quantize_int4(linear_weight(base[name]))) for name in names]
        return Int4Codes(*(torch.cat([getattr(c, f) for c in codes]) for f in ("codes", "scale", "zero")))

    def nbytes(self) -> int:
        """Bytes held by the quantized copies (codes, scales, zeros; a code shared by views counted once)."""
        total = 0
        layers = [m for m in self.decoder.modules() if isinstance(m, (Int4Linear, Int8Linear))]
        for layer in [*layers, *([self.lm_head] if self.lm_head is not None else [])]:
            tensors = (layer.packed, layer.scale_zeros) if isinstance(layer, Int4Linear) else (layer.codes,
                                                                                                 layer.scale)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total


class QuantizedEngine(StaticEngine):
    """:class:`StaticEngine` whose forwards run a shadow of the decoder on weight-only quantized linear layers
    (:mod:`medusa.engines.quantized`); the base's own modules are left as they are. The drafter's projections run
    packed beside it (:meth:`drafter_product`).

    Args:
        model: a transformers ``*ForCausalLM`` on a CPU.
        max_cache_len, scores_all_nodes: as :class:`StaticEngine`.
        lm_head: one of :data:`LM_HEADS` (int4 from a GGUF only where its tensor is 4-bit).
        lean: one row's forwards through :class:`medusa.engines.lean.LeanDecoder` where it supports the model
            (``False``: the stock decoder's shadow always; the same bits, for A/B runs).
        gguf: the 4-bit GGUF this base was prepared from (``medusa prepare-model``): the codes are its own blocks
            (:func:`medusa.io.gguf_pack.gguf_codes`), and a layer whose tensor is not 4-bit stays dense.
        kernel: one of :data:`KERNELS`: ``"torch"``, torch's int4/int8 kernels with bfloat16 activations;
            ``"native"`` (int4 only), one sequence's forwards through :class:`medusa.engines.native.NativeDecoder`
            (one C call a forward, fp32 activations; compiled on first use), batched decoding's forwards over
            several rows included (:meth:`medusa.engines.native.NativeDecoder.forward_rows`).

    Raises:
        ValueError: the kernel cannot run for this model's device or in this torch (the message names what works);
            a ``gguf`` given to the int8 engine; a ``gguf`` that does not match the model (see ``gguf_codes``);
            ``kernel="native"`` where it cannot run (no C compiler, a model the lean forward does not support).
    """

    kind: ClassVar[str] = ""

    @classmethod
    def candidate_for(cls, device, dtype: torch.dtype) -> bool:
        """Never chosen by ``auto``: its tokens are the quantized model's, not the base's (ask for it by name)."""
        return False

    def __init__(self, model, max_cache_len: int | None = None, scores_all_nodes: bool | None = None,
                 lm_head: bool | str = False, gguf: str | Path | None = None, lean: bool = True,
                 kernel: str = "torch"):
        reason = quantize_unavailable(self.kind, model.get_output_embeddings().weight.device)
        if reason is not None:
            raise ValueError(reason)
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        if kernel != "torch" and self.kind != "int4":
            raise ValueError(f"the native kernel runs int4 codes; the {self.kind} engine runs kernel 'torch'")
        self.kernel = kernel
        if kernel != "torch":  # one C call a forward, which the profiler cannot see into
            self.products_visible = False
        codes, keep_dense, self.gguf = {}, {}, None if gguf is None else str(gguf)
        if gguf is not None:
            if self.kind != "int4":
                raise ValueError(f"a GGUF's 4-bit blocks are int4 codes; the {self.kind} engine quantizes from the "
                                 "weights: use the int4 engine with gguf=")
            from medusa.io.gguf_pack import gguf_codes  # the io layer sits above the engines

            read = gguf_codes(gguf, model)
            codes, keep_dense, self.gguf_max_abs_error = read.codes, read.dense, read.max_abs_error
        if lm_head not in LM_HEADS:
            raise ValueError(f"lm_head must be one of {', '.join(map(repr, LM_HEADS))}, got {lm_head!r}")
        if lm_head == "bf16" and getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise ValueError(f"lm_head={lm_head!r} (a checked lm_head) takes an lm_head without a bias")
        self.lm_head_mode = {False: "fp32", True: "int4"}.get(lm_head, lm_head)
        self.gguf_head = None
        if self.lm_head_mode == "gguf":
            if kernel == "torch" or gguf is None:
                raise ValueError("lm_head='gguf' reads the lm_head's Q8_0 blocks from the GGUF into the native "
                                 "kernel: give gguf= and kernel 'native' or 'native-q8'")
            from medusa.engines.native import NativeHead
            from medusa.io.gguf_pack import gguf_q8_0_head

            self.gguf_head = NativeHead(*gguf_q8_0_head(gguf, model), int8_activations=kernel == "native-q8")
        self.quantized = QuantizedLinears(kv_cache.decoder_of(model), model.get_output_embeddings(), self.kind,
                                          self.lm_head_mode == "int4", codes, keep_dense)
        self.use_lean = lean
        super().__init__(model, max_cache_len, scores_all_nodes)
        self.checked_head = self._checked_head()
        self._build_lean()
        self.released_bytes = 0
        """Bytes of dense weights :meth:`release_dense` freed (0: the base is whole)."""

    def release_dense(self) -> int:
        """Free the base's dense weights of every linear layer this engine runs quantized (and the int4 codes kept
        to quantize again), so that the process holds the quantized model, not both: each such ``nn.Linear`` of the
        base keeps an empty weight and a forward pre-hook that raises. What stays dense and shared is untouched:
        embeddings, norms, the lm_head (the heads and the checked lm_head read it) and any layer left dense.

        With a native kernel, the shadow decoder's torch packs go as well (the C decoder holds codes of its own and
        the engine runs no batched forwards).

        After it, the engine decodes as before (its forwards never read those weights), but the base model itself
        cannot run unquantized (HF ``generate``, another engine) and :meth:`refresh` raises. Calling it twice frees
        nothing more.

        Returns:
            the bytes freed by this call.
        """
        decoder = kv_cache.decoder_of(self.model)
        modules = dict(decoder.named_modules())
        freed = 0
        for name in self.quantized.source:
            module = modules.get(name)  # "lm_head" is not under the decoder: kept (tied to the embeddings here)
            weight = None if module is None else linear_weight(module)
            if weight is None or weight.numel() == 0:
                continue
            freed += weight.numel() * weight.element_size()
            _drop_pages(weight)
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
            module.register_forward_pre_hook(_released_forward)
        self.quantized.codes = {}  # the lean decoder holds its packed copies; these served only refresh()
        if self.kernel != "torch":  # the native decoder holds its own codes: the shadow's torch packs go too
            for layer in self.quantized.decoder.modules():
                if isinstance(layer, Int4Linear) and layer.packed.numel():
                    freed += sum(t.numel() * t.element_size() for t in (layer.packed, layer.scale_zeros))
                    layer.packed, layer.scale_zeros = layer.packed.new_empty(0), layer.scale_zeros.new_empty(0)
                    layer.register_forward_pre_hook(_released_forward)
        self.released_bytes += freed
        _return_freed_memory()
        return freed

    def _build_lean(self) -> None:
        """One row's forwards run :class:`medusa.engines.lean.LeanDecoder` where it supports the model (else the
        shadow of the stock decoder; :attr:`lean_reason` says why)."""
        self.lean_reason = "lean=False" if not self.use_lean else lean_unsupported(self.model, self.quantized.dense)
        if self.kernel != "torch":
            from medusa.engines.native import NativeDecoder, native_unavailable

            reason = self.lean_reason or native_unavailable()
            if reason is not None:
                raise ValueError(f"the native int4 decoder cannot run this model here: {reason}; use kernel 'torch'")
            self.lean = NativeDecoder(self.quantized.decoder, self.quantized.fused_codes,
                                      int8_activations=self.kernel == "native-q8")
            return
        self.lean = None if self.lean_reason is not None else LeanDecoder(self.quantized.decoder, self.quantized.fuse)

    @property
    def profile_name(self) -> str:
        """``int4`` / ``int8``, with ``:lm_head=MODE`` when the lm_head is not the base's fp32 one: the lm_head's
        precision changes a step's cost curve (and whether every node is scored), the codes' source does not."""
        if self.kernel == "torch":
            name = self.name
        else:  # the native decoder's figures are for one build of it (a new source is measured again)
            from medusa.engines.native import library_key

            name = f"{self.name}:kernel={self.kernel}@{library_key()[:8]}"
        return name if self.lm_head_mode == "fp32" else f"{name}:lm_head={self.lm_head_mode}"

    @property
    def smooth_step_cost(self) -> bool:
        """The native decoder runs every step size through the same loops: its cost is smooth in the size."""
        return self.kernel != "torch"

    @property
    def drafter_products_key(self) -> str | None:
        """``q8_0:level`` (``q8_0:int8:level`` with int8 activations) beside the native decoder, whose drafter
        products are those (:meth:`drafter_product`) and fuse a Hydra head's level into one C call
        (:meth:`medusa.engines.native.NativeHead.hydra_level`); else ``None``."""
        if self.kernel == "torch":
            return None
        return "q8_0" + (":int8" if self.kernel == "native-q8" else "") + ":level"

    def drafter_product(self, weight: torch.Tensor, role: str):
        """Beside the native decoder, every drafter product (the shared projection, the Hydra input layers and their
        ResBlocks) on the weight rounded to Q8_0 blocks, in C (:func:`medusa.engines.native.q8_0_product`; int8
        activations with ``native-q8``): a quarter of the fp32 bytes a level, which is what drafting one level on a
        CPU costs. Lossy in the drafts only (the verify decides what is emitted). Beside torch's kernels, the packed
        projection."""
        if self.kernel == "torch":
            from medusa.engines.onednn import packed_drafter_product

            return packed_drafter_product(weight, role)
        from medusa.engines.native import q8_0_product

        return q8_0_product(weight, int8_activations=self.kernel == "native-q8")

    def _scores_all_nodes(self) -> bool:
        """With a quantized lm_head its few-row product is cheap enough to score every node."""
        quantized = self.lm_head_mode == "int4" and self.quantized.lm_head is not None  # not left dense
        return super()._scores_all_nodes() or quantized or self.lm_head_mode in ("bf16", "gguf")

    def refresh(self) -> None:
        """Quantize again from the base's weights as they are now (see the module docstring).

        Raises:
            RuntimeError: :meth:`release_dense` freed the weights to quantize from.
        """
        if self.released_bytes:
            raise RuntimeError(f"the {self.name} engine freed the base's dense weights (release_dense): there is "
                               "nothing to quantize again from; load the base again")
        self.quantized.refresh()
        self._build_lean()
        self.checked_head = self._checked_head()

    def _checked_head(self):
        """The checked lm_head :attr:`lm_head_mode` asks for (:mod:`medusa.engines.checked_head`), else ``None``."""
        from medusa.engines.checked_head import CheckedHead

        if self.lm_head_mode != "bf16":
            return None
        return CheckedHead(self.model.get_output_embeddings().weight.detach())

    def _prefix_decoder(self):
        """The native int4 decoders (:class:`medusa.engines.native.NativeDecoder`: each token's bits its own however
        the prompt is cut); ``None`` through torch's kernels."""
        from medusa.engines.native import NativeDecoder

        return self.lean if isinstance(self.lean, NativeDecoder) else None

    def _forward(self, input_ids, positions, tree_mask, cache, logits_for, layers=()):
        if self.lean is not None:
            hidden, features = self.lean.forward(input_ids, positions, tree_mask, cache, self.mask, layers)
            logits = self._lm_logits_rows(hidden if logits_for is None else hidden[logits_for])  # forward() settles
            return (logits, hidden, features) if layers else (logits, hidden)
        with row_invariant_steps(cache.length > 0):
            _, hidden, *features = static_cache.forward(self.model, input_ids, positions, tree_mask, cache,
                                                        self.mask, self.quantized.decoder, slice(0, 0), layers)
        selected = hidden if logits_for is None else hidden[logits_for]
        return self._lm_logits_rows(selected), hidden, *features  # settled by forward()

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gguf_head is not None:
            rows = self.gguf_head.logits(hidden.reshape(-1, hidden.shape[-1]))  # (M, V)
            return kv_cache.soft_cap(self.model, rows.reshape(*hidden.shape[:-1], rows.shape[-1]))  # M may be 0
        if self.checked_head is not None:
            rows = self.checked_head.logits(hidden.reshape(-1, hidden.shape[-1]))  # (M, V)
            return kv_cache.soft_cap(self.model, rows.reshape(*hidden.shape[:-1], rows.shape[-1]))
        if self.quantized.lm_head is None:
            return super().lm_logits(hidden)
        return kv_cache.soft_cap(self.model, self.quantized.lm_head(hidden))

    @property
    def head_row_invariant(self) -> bool:
        """The engine's own lm_heads (int4 codes, the checked bf16 copy, the GGUF's Q8_0 blocks) score each row
        alike, whatever rows are beside it."""
        return not (self.quantized.lm_head is None and self.checked_head is None and self.gguf_head is None)

    def _lm_logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.head_row_invariant:
            return super()._lm_logits_rows(hidden)
        return self.lm_logits(hidden)

    def _batch_decoder(self) -> torch.nn.Module | None:
        return self.quantized.decoder

    def forward_rows(self, *args, **kwargs):
        if self.kernel != "torch":  # one C call for every row (its bits are each row's own)
            return super().forward_rows(*args, **kwargs)
        with row_invariant_steps():  # batched decoding steps (the prompts' own forwards run as usual)
            return super().forward_rows(*args, **kwargs)

    def _forward_rows(self, input_ids, positions, valid_len, new_visible, cache, layers):
        if self.kernel != "torch":
            return self.lean.forward_rows(input_ids, positions, valid_len, new_visible, cache, layers)
        return super()._forward_rows(input_ids, positions, valid_len, new_visible, cache, layers)

    def settings(self) -> dict:
        sources = set(self.quantized.source.values())
        return super().settings() | {
            "quantize": self.kind, "group_size": GROUP_SIZE if self.kind == "int4" else None,
            "forward": ("lean" if self.kernel == "torch" else self.kernel) if self.lean is not None else
            f"stock shadow ({self.lean_reason})", "kernel": self.kernel,
            "native_isa": _native_isa() if self.kernel != "torch" else None,
            "activation_dtype": {"native": "float32", "native-q8": "int8 blocks of 32"}.get(
                self.kernel, str(ACTIVATION_DTYPE).removeprefix("torch.")),
            "lm_head_quantized": self.quantized.lm_head is not None, "lm_head": self.lm_head_mode,
            "dense_layers": dict(self.quantized.dense),
            "codes_from": sorted(sources), "gguf": self.gguf,
            "gguf_unpackable": dict(self.quantized.keep_dense), "quantized_bytes": self.quantized.nbytes(),
            "released_dense_bytes": self.released_bytes}


def _native_isa() -> str:
    from medusa.engines.native import isa

    return isa()


def _drop_pages(tensor: torch.Tensor) -> None:
    """Tell the kernel that the memory pages lying wholly inside ``tensor``'s bytes are no longer needed
    (``madvise(MADV_DONTNEED)``; the pages at either edge, which a neighbour may share, are kept). A base loaded
    from safetensors holds its weights as views of the file mapped into memory: dropping the tensor alone leaves
    those pages resident as long as any other weight keeps the mapping. Called just before the tensor's last use
    is dropped; no-op where ``madvise`` is not available."""
    import ctypes
    import mmap

    if tensor.device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``): the freed weights were allocated
    among many smaller blocks, so without it the process keeps them resident. Elsewhere (no glibc) the freed memory
    is reused by the process instead, and resident size stays as it was."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _released_forward(module, args):
    raise RuntimeError(f"this {type(module).__name__}'s dense weight was freed by the quantized engine "
                       "(QuantizedEngine.release_dense, --release-dense): the base runs only through that engine; "
                       "load the base again to run it unquantized")


@register_engine("int4")
class Int4Engine(QuantizedEngine):
    """Linear layers on int4 weights, group size 32 (:mod:`medusa.engines.quantized`)."""

    kind = "int4"
    summary = ("static + the linear layers on int4 weights (group 32, bf16 activations; CPU; from a GGUF's own "
               "blocks when given)")


@register_engine("int8")
class Int8Engine(QuantizedEngine):
    """Linear layers on int8 weights, one scale per output channel (:mod:`medusa.engines.quantized`)."""

    kind = "int8"
    summary = "static + the linear layers on int8 weights (per channel, bf16 activations; CPU)"
