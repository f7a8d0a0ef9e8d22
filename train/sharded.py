"""Sharded training (FSDP2, DeepSpeed ZeRO-2/3): full copies of base weights that may be partitioned, and the
settings sharded training cannot run.

The heads are built from the base's lm_head (and, for Hydra heads, its input embeddings) ``(V, H)``. Under ZeRO-3
a parameter outside DeepSpeed's gather is an empty ``(0,)`` tensor; under FSDP2 it is a DTensor holding this
process's rows; with ``fsdp_cpu_ram_efficient_loading`` the processes other than rank 0 hold meta tensors. Reading
``weight.shape`` there builds heads of the wrong size, or none (a known Medusa failure under ZeRO-3). So each such
weight is gathered once into a full local copy, or refused with a message saying what was found.

The heads' own weights and optimizer state are saved whole by :mod:`train.checkpoints`.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType


def full_weight(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The whole 2-D ``(V, H)`` ``weight`` on this process: itself when it is whole, else a gathered copy.

    Args:
        weight: a base parameter, possibly sharded (DTensor) or partitioned (DeepSpeed ZeRO-3, ``ds_shape`` set).
        name: what it is, for errors ("lm_head", "input embeddings").

    Raises:
        ValueError: the weight is on the meta device, or empty / not 2-D without a way to gather it.
    """
    if hasattr(weight, "full_tensor"):  # a DTensor (FSDP2 or tensor parallel): all-gather its shards
        return weight.detach().full_tensor()
    if hasattr(weight, "ds_shape"):  # DeepSpeed ZeRO-3: gather once, keep a copy that outlives the gather
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            return weight.detach().clone()
    if weight.is_meta:
        raise ValueError(f"the base's {name} is on the meta device (not loaded on this process; "
                         "fsdp_cpu_ram_efficient_loading on a base that is not wrapped?): the heads need its values")
    if weight.ndim != 2 or weight.numel() == 0:
        raise ValueError(f"the base's {name} has shape {tuple(weight.shape)}, not (vocab, hidden): it looks "
                         "partitioned (DeepSpeed ZeRO-3 with zero3_init_flag?) and cannot be gathered here; load the "
                         "frozen base whole (configs/accelerate/deepspeed_zero3.yaml sets zero3_init_flag: false)")
    return weight


def check_sharded_settings(accelerator: Accelerator, grad_accum_steps: int) -> None:
    """Refuse what the launch's sharding cannot train correctly.

    Raises:
        ValueError: ``grad_accum_steps > 1`` under DeepSpeed: its engine steps the optimizer inside ``backward``
            (Accelerate's DeepSpeed backward), so every micro-batch would become an optimizer step.
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED and grad_accum_steps > 1:
        raise ValueError(f"grad_accum_steps={grad_accum_steps} cannot run under DeepSpeed: its engine steps the "
                         "optimizer inside backward, so each micro-batch would be an optimizer step; use "
                         "grad_accum_steps: 1 and a larger batch_size, or launch with FSDP or DDP")


def heads_are_sharded(accelerator: Accelerator) -> bool:
    """Whether the prepared heads are FSDP2- or DeepSpeed-wrapped: their forwards and state gathers are then
    collectives, which every process must enter equally often."""
    return accelerator.is_fsdp2 or accelerator.distributed_type == DistributedType.DEEPSPEED
