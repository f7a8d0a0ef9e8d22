"""How far an adapted base (Medusa-2's LoRA, merged) has drifted from the original.

Medusa-2 trains a LoRA on the base with a KL to the frozen base (Cai et al., 2024, section 2.2.2); decoding then
verifies against the adapted model, so its outputs are the adapted model's, not the original's. Measured on
held-out self-distilled answers (the original's own greedy continuations), over the answer tokens:

- ``top1_agreement``: the fraction of positions where both models' greedy next token is the same;
- ``adapted_nll`` / ``original_nll``: mean negative log-likelihood (nats per token) of the answer tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch


@torch.no_grad()
def drift(original, adapted, sequences: list[tuple[list[int], int]]) -> dict:
    """Greedy top-1 agreement and mean NLL of the original and adapted models on the answers of ``sequences``.

    Args:
        original, adapted: causal LMs over the same vocabulary, on the same device.
        sequences: ``(token_ids, response_start)``; positions predicting ``token_ids[response_start:]`` count.

    Returns:
        ``{"sequences", "tokens", "top1_agreement", "adapted_nll", "original_nll"}``.

    Raises:
        ValueError: no sequence holds an answer token.
    """
    agree = tokens = 0
    nll = {"adapted": 0.0, "original": 0.0}
    device = original.get_output_embeddings().weight.device
    for ids, start in sequences:
        if len(ids) - max(start, 1) < 1:
            continue
        input_ids = torch.tensor([ids], device=device)  # (1, T)
        targets = input_ids[0, max(start, 1):]  # (N,)
        picked = {}
        for name, model in (("original", original), ("adapted", adapted)):
            logits = model(input_ids=input_ids).logits[0, max(start, 1) - 1 : -1].float()  # (N, V)
            nll[name] += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            picked[name] = logits.argmax(dim=-1)  # (N,)
        agree += int((picked["original"] == picked["adapted"]).sum())
        tokens += len(targets)
    if tokens == 0:
        raise ValueError("no sequence holds an answer token to measure drift on")
    return {"sequences": len(sequences), "tokens": tokens, "top1_agreement": round(agree / tokens, 6),
            "adapted_nll": round(nll["adapted"] / tokens, 6), "original_nll": round(nll["original"] / tokens, 6)}


def drift_from(original: str | Path, adapted, data: str | Path, limit: int | None = None) -> dict:
    """:func:`drift` of the loaded ``adapted`` model from the base folder ``original`` (loaded in ``adapted``'s dtype,
    on its device) on the first ``limit`` self-distilled records of ``data``; the result names both."""
    from medusa.base import load_base
    from medusa.tools.bench import read_distilled_sequences

    base, _ = load_base(original, adapted.dtype, adapted.device)
    return {"original": str(original), "data": data,
            **drift(base, adapted, read_distilled_sequences(data, limit))}


def drift_of_folders(base: str | Path, data: str | Path, limit: int | None = None, adapter: str | Path | None = None,
                     adapted: str | Path | None = None) -> dict:
    """``medusa drift``: :func:`drift` of an adapted model from the base folder ``base`` on the first ``limit``
    self-distilled records of ``data``; the adapted model is ``adapter`` merged into the base, or the merged folder
    ``adapted``. The result names the three.

    Raises:
        ValueError: neither or both of ``adapter`` and ``adapted``.
    """
    from medusa.base import load_base
    from medusa.io.adapter import merge_adapter
    from medusa.tools.bench import read_distilled_sequences

    if (adapter is None) == (adapted is None):
        raise ValueError("pass one of --adapter and --adapted")
    sequences = read_distilled_sequences(data, limit)
    original, _ = load_base(base)
    model = merge_adapter(load_base(base)[0], adapter).eval() if adapter else load_base(adapted)[0]
    return {"original": base, "adapted": adapter or adapted, "data": data, **drift(original, model, sequences)}
