"""Medusa-2: the heads train jointly with a LoRA on the base (Cai et al., 2024, section 2.2.2).

The base's own weights stay frozen; ``peft`` adds low-rank adapters to the linear modules named in the config. The
adapted base must keep its own next-token distribution, so the loss adds ``kl_weight x KL(frozen || adapted)``
(self-distillation): the frozen teacher is the same model with the adapter switched off (``disable_adapter``), not
a second copy. Training runs in two stages: stage 1 (the first ``stage1_steps``) trains the heads over the base as
it is, or the heads come trained from ``init_heads``; stage 2 trains both, the LoRA at its own smaller learning rate
and the heads' loss weight warming up (a fresh head's large gradient would otherwise pull the base around).

An adapter folder is peft's own (``adapter_config.json``, ``adapter_model.safetensors``); ``medusa merge`` folds it
into a plain model folder (:mod:`medusa.io.adapter`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from medusa.base import base_states
from medusa.drafters.heads import IGNORE_INDEX
from medusa.io.adapter import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from medusa.io.files import atomic_folder
from medusa.losses import next_token_kl_sum
from train.config import TrainConfig

ADAPTER_DIR = "adapter"


def apply_lora(model, config: TrainConfig):
    """The frozen ``model`` wrapped in a peft LoRA (``config.lora_*``); only the LoRA parameters require gradients.

    Raises:
        ValueError: a target module matches nothing in the base, or matches its lm_head or input embeddings (the
            heads share those: a LoRA there would change what the heads project with).
    """
    from peft import LoraConfig, get_peft_model

    check_lora_targets(model, config.lora_target_modules)
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=list(config.lora_target_modules), bias="none")
    return get_peft_model(model, lora)


def check_lora_targets(model, targets: tuple[str, ...]) -> None:
    """Refuse target names (peft's rule: a module whose name is or ends with ``.name``) that match no module, or
    match the lm_head or the input embeddings; the message names them and the base's linear module names."""
    names = [name for name, _ in model.named_modules()]

    def matches(name: str, target: str) -> bool:
        return name == target or name.endswith("." + target)

    missing = [t for t in targets if not any(matches(n, t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})
        raise ValueError(f"lora_target_modules {missing} match no module of the base ({type(model).__name__}); its "
                         f"linear modules are named {linear}")
    shared = {id(model.get_output_embeddings()), id(model.get_input_embeddings())}
    hit = sorted({n for n, m in model.named_modules() if id(m) in shared and any(matches(n, t) for t in targets)})
    if hit:
        raise ValueError(f"lora_target_modules {list(targets)} match {hit}: the heads share the base's lm_head and "
                         "input embeddings, so they must stay as they are; target the decoder's linear modules")


def lora_parameters(model) -> list[torch.nn.Parameter]:
    """The trainable (LoRA) parameters of an adapted base."""
    return [p for p in model.parameters() if p.requires_grad]


def in_stage2(config: TrainConfig, step: int) -> bool:
    """Whether optimizer step ``step`` (0-based) trains the base jointly."""
    return config.training_mode == "medusa2" and step >= config.stage1_steps


def heads_loss_weight(config: TrainConfig, step: int) -> float:
    """The heads' loss weight at optimizer step ``step``: 1 outside stage 2, else rising linearly to 1 over
    ``heads_loss_warmup_steps`` steps (1/W on the first stage-2 step)."""
    if not in_stage2(config, step) or config.heads_loss_warmup_steps == 0:
        return 1.0
    return min(1.0, (step - config.stage1_steps + 1) / config.heads_loss_warmup_steps)


def set_lora_dropout(model, training: bool) -> None:
    """Switch the LoRA dropout on or off while the base itself stays in eval mode (its own dropout off: the frozen
    teacher and the adapted student see the same base)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and "lora_dropout" in name:
            module.train(training)


def adapted_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``(B, T, H)`` of the adapted base, with gradient into the LoRA parameters."""
    return model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def frozen_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states ``(B, T, H)`` of the original base: the same model with its adapter switched off."""
    with model.disable_adapter():
        return base_states(model, input_ids, attention_mask)  # (B, T, H)


def kl_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` mask of the positions whose next token is supervised: where the base's next-token distribution is
    pulled back to the frozen base's."""
    mask = torch.zeros_like(labels, dtype=torch.bool)  # (B, T)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The base's logits ``(N, V)`` from hidden states ``(N, H)``: its lm_head and final soft-capping."""
    logits = model.get_output_embeddings()(hidden.to(model.get_output_embeddings().weight.dtype)).float()  # (N, V)
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def kl_sum(model, adapted: torch.Tensor, frozen: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed ``KL(frozen || adapted)`` of the next-token distributions over :func:`kl_positions`.

    Args:
        adapted: ``(B, T, H)`` adapted hidden states (with gradient); frozen: ``(B, T, H)`` the original's.
        labels: ``(B, T)``.
    """
    mask = kl_positions(labels)  # (B, T)
    with torch.no_grad():
        teacher = output_logits(model, frozen[mask])  # (N, V)
    return next_token_kl_sum(teacher, output_logits(model, adapted[mask]))


def save_adapter(model, out_dir: str | Path) -> Path:
    """Write the LoRA as a peft adapter folder, atomically (a temporary folder swapped in at the end)."""
    with atomic_folder(out_dir) as tmp:
        model.save_pretrained(str(tmp))
    return Path(out_dir)


def load_adapter_state(model, adapter_dir: Path, config: TrainConfig) -> None:
    """Load a checkpoint's LoRA weights into the adapted ``model``.

    Raises:
        FileNotFoundError: the adapter folder or a file of it is missing.
        ValueError: the adapter was trained with another rank or other target modules than ``config`` asks (the
            message names both), or its weights do not fit.
    """
    from peft import set_peft_model_state_dict

    config_path, weights_path = adapter_dir / ADAPTER_CONFIG_NAME, adapter_dir / ADAPTER_WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"Medusa-2 checkpoint {adapter_dir.parent} has no LoRA adapter file {path}")
    stored = json.loads(config_path.read_text())
    if stored.get("r") != config.lora_rank:
        raise ValueError(f"cannot resume Medusa-2 from {adapter_dir.parent}: its LoRA has rank {stored.get('r')}, "
                         f"the config asks lora_rank={config.lora_rank}; restore lora_rank or choose another "
                         "output_dir")
    if sorted(stored.get("target_modules") or []) != sorted(config.lora_target_modules):
        raise ValueError(f"cannot resume Medusa-2 from {adapter_dir.parent}: its LoRA targets "
                         f"{sorted(stored.get('target_modules') or [])}, the config asks "
                         f"{sorted(config.lora_target_modules)}")
    result = set_peft_model_state_dict(model, load_file(str(weights_path)))
    if result.unexpected_keys:
        raise ValueError(f"{weights_path}: keys that fit no LoRA module of the base: {result.unexpected_keys[:5]}")
