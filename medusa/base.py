"""The base model: loading a stock transformers causal LM, its end-of-sequence ids, the states a drafter reads from it
(:func:`base_states`), and Hugging Face ``generate`` over a batch of prompts (the reference the bench and
self-distillation both use)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_base(base: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              attn_implementation: str | None = None):
    """Load a causal LM and its tokenizer from a local folder (or a hub id when the hub is reachable).

    Raises:
        FileNotFoundError: ``base`` looks like a path but is not a folder with a ``config.json``.
        OSError: the folder or hub id could not be read as a model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(base)
    looks_local = path.exists() or str(base).startswith((".", "/", "~")) or len(path.parts) > 2
    if looks_local and not (path / "config.json").is_file():
        raise FileNotFoundError(f"base model folder {base} does not exist or has no config.json")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation=attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(base)
    except (OSError, ValueError) as e:
        raise OSError(f"could not load a causal LM from {base}: {e}") from e
    return model.to(device).eval(), tokenizer


PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
"""Role labels of :func:`render_plain_chat`."""


def render_plain_chat(messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """A chat as plain role-labelled text, for a tokenizer without a chat template (a pretrained base model):
    ``"User: <content>\n\nAssistant: <content>\n\n"``, and with ``add_generation_prompt`` a final
    ``"Assistant:"``.

    Training and decoding use this one rendering, so heads trained on such chats see at decode time the prompts they
    were trained on.

    Returns:
        ``(text, spans)``: the text and the character spans ``(start, end)`` of each assistant answer, each starting
        at the space after ``"Assistant:"`` (the base continues a prompt ending in ``"Assistant:"`` with that space,
        usually inside its first token).

    Raises:
        ValueError: a message has a role other than system/user/assistant.
    """
    parts, spans, length = [], [], 0
    for m in messages:
        if m["role"] not in PLAIN_ROLES:
            raise ValueError(f"plain chat rendering knows roles {sorted(PLAIN_ROLES)}, got {m['role']!r}")
        label = f"{PLAIN_ROLES[m['role']]}:"
        body = " " + m["content"].strip()
        if m["role"] == "assistant":
            spans.append((length + len(label), length + len(label) + len(body)))
        piece = label + body + "\n\n"
        parts.append(piece)
        length += len(piece)
    if add_generation_prompt:
        parts.append(f"{PLAIN_ROLES['assistant']}:")
    return "".join(parts), spans


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a generation prompt: the tokenizer's chat template with its generation prompt, or, for a
    tokenizer without one, plain role-labelled text ending in ``"Assistant:"`` (:func:`render_plain_chat`). What
    self-distillation, ``bench`` and ``generate`` all prompt with."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return list(tokenizer(render_plain_chat(messages, add_generation_prompt=True)[0])["input_ids"])


def stop_token_ids(generation_config, tokenizer=None) -> set[int]:
    """The end-of-sequence ids of ``generation_config`` (one id, a list or ``None``) and of ``tokenizer`` when given.

    Without a tokenizer these are exactly the ids at which Hugging Face ``generate`` stops.
    """
    eos = getattr(generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None:
        ids.add(tokenizer.eos_token_id)
    return {i for i in ids if i is not None}


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list, max_new_tokens: int, stop_token_ids: set[int],
                    pad_token_id: int) -> list[list[int]]:
    """Hugging Face ``generate``, greedy, on several prompts at once (left padding).

    Args:
        model: a transformers causal LM.
        prompts: token ids per prompt (lists or 1-D tensors).
        stop_token_ids: ``generate`` stops a row at these ids; empty: at none.
        pad_token_id: the id left padding and ``generate``'s padding of finished rows use.

    Returns:
        The new ids per prompt, each cut after its first stop token (kept) or at the budget.
    """
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)  # (B, T)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p) :], mask[b, longest - len(p) :] = torch.as_tensor(p), 1
    device = next(model.parameters()).device
    out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=sorted(stop_token_ids) or None, pad_token_id=pad_token_id)
    rows = []
    for row in out[:, longest:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_token_ids), len(row))
        rows.append(row[:cut])
    return rows


def check_layer_indices(layers, count: int, name: str = "layers") -> None:
    """Refuse decoder layer indices (0-based) outside a base of ``count`` decoder layers.

    Raises:
        ValueError: naming the offending indices, ``name`` (what they were given as) and the base's layer count.
    """
    bad = [i for i in layers if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad:
        which = f"layer {bad[0]} is" if len(bad) == 1 else f"layers {', '.join(map(str, bad))} are"
        raise ValueError(f"{name}: {which} outside the base's {count} decoder layers (0 .. {count - 1})")


def base_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                layers: tuple[int, ...] = ()) -> torch.Tensor:
    """What a drafter reads from the frozen base at every position: its last hidden state (after the final norm,
    what the lm_head reads) and, after it, the outputs of decoder layers ``layers`` (0-based; EAGLE-3's fused
    features, :mod:`medusa.drafters.eagle`), concatenated. No logits are computed.

    Args:
        model: a transformers causal LM (``get_decoder()`` is its decoder stack).
        input_ids: ``(B, T)`` token ids.
        attention_mask: ``(B, T)`` 1 on real tokens (``None``: every token is real).
        layers: decoder layers whose outputs follow the last hidden state; ``()`` gives the last hidden state
            alone, exactly as a run without ``output_hidden_states``.

    Returns:
        ``(B, T, (1 + len(layers)) * H)`` in the base's dtype, without gradient.

    Raises:
        ValueError: a layer index outside the base's decoder layers.
    """
    from medusa.engines.kv_cache import decoder_of, layer_features

    check_layer_indices(layers, model.config.get_text_config(decoder=True).num_hidden_layers)
    kwargs = {"output_hidden_states": True} if layers else {}
    with torch.no_grad():
        out = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    if not layers:
        return out.last_hidden_state  # (B, T, H)
    return torch.cat([out.last_hidden_state, layer_features(out, tuple(layers))], dim=-1)  # (B, T, (1 + k) H)


def learned_position_weight(model) -> torch.Tensor:
    """The base's learned absolute position embedding ``(P, H)`` (GPT-2's ``wpe``): what the eagle drafter adds to
    its token embeddings on such a base.

    Raises:
        ValueError: the base's decoder has no learned position embedding (``wpe``).
    """
    wpe = getattr(model.get_decoder(), "wpe", None)
    if wpe is None:
        raise ValueError(f"{type(model).__name__} has no learned position embedding (wpe) to read")
    return wpe.weight
