"""Int4 codes for a base prepared from a 4-bit GGUF, taken from the file's own blocks (nothing rounded twice).

``medusa prepare-model`` (:mod:`medusa.io.prepare`) dequantizes a GGUF into an fp32 folder; the int4 engine
(:mod:`medusa.engines.quantized`) then packs the same weights again. Quantizing the dequantized weights would round
them a second time; this module reads the GGUF's blocks instead and maps each onto the kernel's per-group scale and
zero point, ``w = (q - 8) * scale + zero`` over groups of 32 input features:

- ``Q4_0`` (32 weights, fp16 ``d``, ``w = d * (q - 8)``): ``scale = d``, ``zero = 0``.
- ``Q4_1`` (32 weights, fp16 ``d`` and ``m``, ``w = d * q + m``): ``scale = d``, ``zero = m + 8 d``.
- ``Q4_K`` (256 weights in 8 sub-blocks of 32, fp16 ``d`` and ``dmin``, 6-bit ``sc`` and ``mn`` per sub-block,
  ``w = d sc q - dmin mn``): ``scale = d sc``, ``zero = 8 scale - dmin mn``.

In fp32 the mapped codes give the dequantized folder's weights to within one rounding of the zero point's sum
(:func:`check_codes` measures it; 0 for Q4_0). The kernel itself holds scales and zeros in bfloat16, which rounds
them once more (docs/quantized.md gives the measured error). Any other block type (Q8_0, Q5/Q6, F16, F32) is not a
4-bit code: that tensor is named with its type in :attr:`GGUFCodes.dense` and stays dense.

Llama attention: GGUF stores the query and key rows permuted for its rotary layout, and transformers undoes that
when dequantizing (``LlamaTensorProcessor``); the codes' rows are permuted back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from medusa.engines import kv_cache
from medusa.engines.int4 import GROUP_SIZE, Int4Codes, dequantize_int4, linear_weight

PACKABLE = ("Q4_0", "Q4_1", "Q4_K")
"""GGUF block types whose blocks map exactly onto int4 codes with a per-32 scale and zero point."""
PERMUTED_ARCHITECTURES = ("llama",)
"""GGUF architectures whose attention query/key rows are stored permuted (undone as transformers does)."""


@dataclass
class GGUFCodes:
    """What :func:`gguf_codes` read."""

    codes: dict[str, Int4Codes] = field(default_factory=dict)
    """Int4 codes by module name under the decoder (``"lm_head"`` for the lm_head), for
    :class:`medusa.engines.quantized.QuantizedLinears`."""
    dense: dict[str, str] = field(default_factory=dict)
    """Linear modules whose GGUF tensor cannot be packed (name -> the GGUF tensor and its type): keep them dense."""
    max_abs_error: float = 0.0
    """The largest ``|dequantize(codes) - weight|`` in fp32 over every packed tensor (:func:`check_codes`)."""


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    return np.split(blocks, np.cumsum(sizes), axis=-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(..., 16)`` bytes -> ``(..., 32)`` codes: the low nibbles are the first 16 weights, the high the next 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def blocks_to_codes(kind: str, data: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One GGUF tensor's raw blocks ``(N, bytes per row)`` uint8, ``k`` weights per row, as int4 codes.

    Returns:
        ``(codes (N, K) uint8, scale (N, K / 32) fp32, zero (N, K / 32) fp32)``.

    Raises:
        ValueError: ``kind`` is not in :data:`PACKABLE`.
    """
    n = data.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        blocks = data.reshape(n, k // GROUP_SIZE, -1)  # (N, G, 18 or 20)
        if kind == "Q4_0":
            d, qs = _split(blocks, 2)
            scale, zero = _fp16(d), np.zeros((n, k // GROUP_SIZE), np.float32)
        else:
            d, m, qs = _split(blocks, 2, 2)
            scale = _fp16(d)
            zero = _fp16(m) + np.float32(8) * scale
        return _nibbles(qs).reshape(n, k), scale, zero
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = data.reshape(n * (k // 256), 144)  # (B, 144): d, dmin, 12 scale bytes, 128 code bytes
        d, dmin, scales, qs = _split(blocks, 2, 2, 12)
        sc, mn = Q4_K.get_scale_min(scales)  # (B, 8) each
        scale = _fp16(d)[:, None] * sc.astype(np.float32)
        zero = np.float32(8) * scale - _fp16(dmin)[:, None] * mn.astype(np.float32)
        # 4 chunks of 32 bytes; in each, the low nibbles are sub-block 2j and the high nibbles sub-block 2j + 1.
        codes = np.stack([qs.reshape(-1, 4, 32) & 0x0F, qs.reshape(-1, 4, 32) >> 4], axis=2)  # (B, 4, 2, 32)
        return codes.reshape(n, k), scale.reshape(n, -1), zero.reshape(n, -1)
    raise ValueError(f"GGUF block type {kind} is not a 4-bit code with a per-32 scale: packable are "
                     f"{', '.join(PACKABLE)}")


def unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """GGUF's llama query/key row order -> Hugging Face's (as transformers' ``LlamaTensorProcessor``): ``(N, ...)``
    rows, ``n_head`` heads (the key/value heads for the key)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _architecture(reader) -> str:
    field_ = reader.fields.get("general.architecture")
    if field_ is None:
        raise ValueError("the GGUF declares no general.architecture: not a model GGUF")
    return bytes(field_.parts[field_.data[0]]).decode("utf-8")


def gguf_codes(gguf: str | Path, model) -> GGUFCodes:
    """Int4 codes for ``model``'s linear layers from the GGUF it was prepared from (``medusa prepare-model``).

    Args:
        gguf: the ``.gguf`` file.
        model: the transformers ``*ForCausalLM`` loaded from the prepared folder.

    Returns:
        :class:`GGUFCodes`; layers whose tensor is not 4-bit are in ``dense``, named with the GGUF tensor and type.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the GGUF's architecture has no tensor-name map in the gguf package; a tensor's shape differs
            from the model's weight; or the codes do not reproduce the model's weights (not the GGUF this base was
            prepared from), naming the tensor and the error.
    """
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    reader = GGUFReader(str(gguf))
    arch_name = _architecture(reader)
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ValueError(f"{gguf}: the gguf package has no tensor names for architecture {arch_name!r}")
    config = model.config.get_text_config(decoder=True)
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    decoder = kv_cache.decoder_of(model)
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    modules = [(n, m) for n, m in decoder.named_modules() if linear_weight(m) is not None]
    head = model.get_output_embeddings()
    modules += [("lm_head", head)] if linear_weight(head) is not None else []
    out = GGUFCodes()
    for name, module in modules:
        hf_name = "lm_head" if name == "lm_head" else f"{prefix}.{name}"
        base = name_map.get_name(hf_name)
        tensor = tensors.get(f"{base}.weight") if base else None
        if tensor is None and name == "lm_head" and getattr(config, "tie_word_embeddings", False):
            tensor = tensors.get(f"{name_map.get_name(f'{prefix}.embed_tokens') or 'token_embd'}.weight")
        if tensor is None:
            out.dense[name] = f"no GGUF tensor maps to {hf_name}"
            continue
        kind = tensor.tensor_type.name
        if kind not in PACKABLE:
            out.dense[name] = f"GGUF tensor {tensor.name} is {kind}, not one of {', '.join(PACKABLE)}"
            continue
        weight = linear_weight(module)
        k, n = (int(s) for s in tensor.shape[:2])
        if (n, k) != tuple(weight.shape):
            raise ValueError(f"GGUF tensor {tensor.name} is {n}x{k} but {hf_name} is "
                             f"{tuple(weight.shape)}: not the GGUF this model was prepared from")
        codes = [torch.from_numpy(np.ascontiguousarray(a)) for a in blocks_to_codes(kind, np.asarray(tensor.data), k)]
        if arch_name in PERMUTED_ARCHITECTURES and base.endswith(("attn_q", "attn_k")):
            heads = config.num_attention_heads if base.endswith("attn_q") else config.num_key_value_heads
            codes = [unpermute_rows(c, heads) for c in codes]
        out.codes[name] = Int4Codes(*codes)
        error = check_codes(out.codes[name], weight)
        if error > 1e-6 * max(weight.detach().abs().max().item(), 1.0):
            raise ValueError(f"GGUF tensor {tensor.name} ({kind}) does not reproduce {hf_name} (max error "
                             f"{error:.3g}): not the GGUF this model was prepared from")
        out.max_abs_error = max(out.max_abs_error, error)
    return out


def check_codes(codes: Int4Codes, weight: torch.Tensor) -> float:
    """``max |dequantize(codes) - weight|`` in fp32, the kernel's formula (:func:`dequantize_int4`)."""
    return (dequantize_int4(codes.codes, codes.scale, codes.zero) - weight.detach().float()).abs().max().item()


def gguf_q8_0_head(gguf: str | Path, model) -> tuple[torch.Tensor, torch.Tensor]:
    """The lm_head of ``model`` from the GGUF's own Q8_0 blocks (``w = d q``, 32 weights a block): the output tensor,
    or the token embedding when the GGUF ties them. ``d q`` in fp32 equals the prepared folder's lm_head exactly.

    Returns:
        ``(codes (V, K) int8, d (V, K / 32) fp32)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the GGUF's lm_head tensor is not Q8_0 (named with its type), or its blocks do not reproduce
            the model's lm_head (not the GGUF this base was prepared from).
    """
    from gguf import GGUFReader

    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    tied = getattr(model.config.get_text_config(decoder=True), "tie_word_embeddings", False)
    tensor = tensors.get("output.weight") or (tensors.get("token_embd.weight") if tied else None)
    if tensor is None:
        raise ValueError(f"{gguf}: no lm_head tensor (output.weight, or token_embd.weight for a tied base)")
    if tensor.tensor_type.name != "Q8_0":
        raise ValueError(f"{gguf}: the lm_head tensor {tensor.name} is {tensor.tensor_type.name}, not Q8_0: use "
                         "another --quantized-lm-head")
    weight = model.get_output_embeddings().weight.detach()
    v, k = weight.shape
    blocks = np.asarray(tensor.data).reshape(v, k // GROUP_SIZE, 34)  # (V, G, 2 + 32)
    d, qs = _split(blocks, 2)
    codes = torch.from_numpy(np.ascontiguousarray(qs).view(np.int8).reshape(v, k).copy())
    scale = torch.from_numpy(_fp16(d).copy())  # (V, G)
    rebuilt = codes.float() * scale.repeat_interleave(GROUP_SIZE, 1)
    error = float((rebuilt - weight.float()).abs().max())
    if error > 1e-6 * max(float(weight.abs().max()), 1.0):
        raise ValueError(f"GGUF tensor {tensor.name} (Q8_0) does not reproduce the lm_head (max error {error:.3g}): "
                         "not the GGUF this model was prepared from")
    return codes, scale
